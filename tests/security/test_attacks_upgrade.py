"""Where features meet: an HTTP Upgrade must not turn a host admitted for some paths into a relay of
anything, on either front.

Why: after a `101 Switching Protocols` egressd relays whatever the connection carries, with no
further decision. A rule `{host: path.test, paths: [/ok/], methods: [GET]}` admits `GET /ok/...`
only; if `GET /ok/x` with `Upgrade: h2c` (and `HTTP2-Settings`) is answered 101, the child then
speaks HTTP/2 with any method and path, and with any other token it writes a raw `DELETE /admin`
after the 101. What holds: only `websocket` is ever relayed, as a real WebSocket handshake, and only
for a request that is itself admitted; `h2c` is refused and `HTTP2-Settings` never forwarded; a host
admitted only by path/method rules or `builtin` allows no upgrade unless that rule says
`websocket: true`; `websocket: false` allows none. Each row sends one upgrade through the real
`egressd run` (plain HTTP, and HTTPS egressd inspects) to a lenient server that switches protocols
whenever it is asked (and records every byte that follows), and proves who got a 101 and that
nothing of `DELETE /admin` or `HTTP2-Settings` ever reached the server where no upgrade was allowed.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import trustme

from tests.support.dns_server import DnsServer
from tests.support.egressd_cli import EgressdRun, write_policy
from tests.support.proxied import FRONTS, Answer, Proxied
from tests.support.raw_upstream import RawUpstream, Script, Seen

ADDRESS = "198.51.100.64"
POLICIES = {
    # hosts admitted by a host rule, by a path/method rule, by a builtin allowance
    "rules": """\
allow:
  - host.test
  - {host: path.test, paths: [/ok/], methods: [GET]}
builtin:
  - {host: built.test, paths: [/ok/], methods: [GET]}
""",
    # the same kinds of rule, saying websocket: true
    "websocket-rules": """\
allow:
  - {host: pathws.test, paths: [/ok/], methods: [GET], websocket: true}
builtin:
  - {host: builtws.test, paths: [/ok/], methods: [GET], websocket: true}
""",
    "websocket-off": """\
allow: [off.test]
websocket: false
""",
}
# host -> (policy, whether a WebSocket upgrade of an admitted request is relayed)
HOSTS = {
    "host.test": ("rules", True),
    "path.test": ("rules", False),
    "built.test": ("rules", False),
    "pathws.test": ("websocket-rules", True),
    "builtws.test": ("websocket-rules", True),
    "off.test": ("websocket-off", False),
}
KEY = base64.b64encode(b"egressd-upgrades").decode()
HANDSHAKE = [("Sec-WebSocket-Key", KEY), ("Sec-WebSocket-Version", "13")]
SETTINGS = [("HTTP2-Settings", "AAMAAABkAARAAAAAAAIAAAAA")]
# token -> (the request's upgrade fields, whether it is a WebSocket upgrade egressd may relay)
TOKENS: dict[str, tuple[list[tuple[str, str]], bool]] = {
    "websocket": ([("Connection", "Upgrade"), ("Upgrade", "websocket"), *HANDSHAKE], True),
    "WebSocket": ([("Connection", "keep-alive, UPGRADE"), ("Upgrade", "WebSocket"), *HANDSHAKE], True),
    "websocket-without-handshake": ([("Connection", "Upgrade"), ("Upgrade", "websocket")], False),
    "h2c": ([("Connection", "Upgrade, HTTP2-Settings"), ("Upgrade", "h2c"), *SETTINGS], False),
    "h2c-then-websocket": ([("Connection", "Upgrade"), ("Upgrade", "h2c, websocket"), *HANDSHAKE], False),
    "websocket-then-h2c": ([("Connection", "Upgrade"), ("Upgrade", "websocket, h2c"), *HANDSHAKE], False),
    "two-upgrade-fields": (
        [("Connection", "Upgrade"), ("Upgrade", "websocket"), ("Upgrade", "h2c"), *HANDSHAKE],
        False,
    ),
    "tls": ([("Connection", "Upgrade"), ("Upgrade", "TLS/1.2")], False),
    "anything": ([("Connection", "Upgrade"), ("Upgrade", "egressd-raw")], False),
}
SMUGGLED = b"DELETE /admin HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n"


def _answer(seen: Seen) -> Script:
    """A lenient server: it switches to whatever the request names in an Upgrade field (even
    without `Connection: upgrade`), and on `/ok/force101` even unasked."""
    asked = seen.header("upgrade")
    if asked is None and not seen.target.endswith("/force101"):
        return [b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"]
    token = (asked or "egressd-raw").split(",")[0].strip().encode()
    head = b"HTTP/1.1 101 Switching Protocols\r\nConnection: Upgrade\r\nUpgrade: " + token + b"\r\n"
    if (key := seen.header("sec-websocket-key")) is not None:
        digest = hashlib.sha1(key.encode() + b"258EAFA5-E914-47DA-95CA-C5AB0DC85B11").digest()
        head += b"Sec-WebSocket-Accept: " + base64.b64encode(digest) + b"\r\n"
    return [head + b"\r\n"]


@dataclass
class Setup:
    runs: dict[str, EgressdRun]
    plain: RawUpstream
    tls: RawUpstream

    def upstream(self, front: str) -> RawUpstream:
        return self.plain if front == "plain" else self.tls

    def upgrade(self, front: str, host: str, path: str, fields: list[tuple[str, str]]) -> Answer:
        """GET `path` on `host` with `fields`; after a 101, a raw `DELETE /admin` on the connection."""
        proxied = Proxied(self.runs[HOSTS[host][0]])
        authority = f"{host}:{self.upstream(front).port}"
        with proxied.open(front, authority) as sock:
            answer = proxied.send(sock, front, authority, "GET", path, fields)
            with contextlib.suppress(OSError):
                sock.sendall(SMUGGLED)
                sock.settimeout(1)
                with contextlib.suppress(OSError):
                    sock.recv(65536)
        return answer

    def smuggled(self, front: str) -> int:
        """How often the server got the raw DELETE: relayed after a 101, or read as a request."""
        requests = self.upstream(front).requests()
        return sum(s.after.count(SMUGGLED) + (s.method == "DELETE") for s in requests)

    def seen(self, front: str, path: str) -> list[Seen]:
        return [s for s in self.upstream(front).requests() if s.target.endswith(path)]


@pytest.fixture(scope="module")
def setup(ca: trustme.CA, ca_file: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Setup]:
    directory = tmp_path_factory.mktemp("upgrade")
    with contextlib.ExitStack() as stack:
        dns = stack.enter_context(DnsServer())
        for host in HOSTS:
            dns.add(host, ADDRESS)
        plain = stack.enter_context(RawUpstream(ADDRESS, _answer, name="upgrade-plain", read_timeout=3))
        tls = stack.enter_context(
            RawUpstream(ADDRESS, _answer, ca=ca, hostnames=list(HOSTS), name="upgrade-tls", read_timeout=3)
        )
        runs = {}
        for name, rules in POLICIES.items():
            inspect = [h for h, (policy, _) in HOSTS.items() if policy == name]
            text = f"version: 1\nmode: enforce\n{rules}inspect: {inspect}\nprivate: {{allow: true}}\n"
            policy = write_policy(directory, text, name=f"{name}.yaml")
            options = ["--policy", str(policy), "--nameserver", dns.nameserver, "--upstream-ca", str(ca_file)]
            runs[name] = stack.enter_context(EgressdRun(options))
        yield Setup(runs, plain, tls)


@pytest.mark.parametrize("front", FRONTS)
@pytest.mark.parametrize("token", list(TOKENS))
@pytest.mark.parametrize("host", list(HOSTS))
def test_only_an_admitted_websocket_is_ever_relayed(setup: Setup, front: str, token: str, host: str) -> None:
    fields, websocket = TOKENS[token]
    path = f"/ok/{front}-{host}-{token}"
    before = setup.smuggled(front)
    answer = setup.upgrade(front, host, path, fields)
    seen = setup.seen(front, path)
    if websocket and HOSTS[host][1]:
        assert answer.switched, answer.raw[:400]
        [request] = seen
        assert request.header("upgrade") is not None and request.header("http2-settings") is None
        return
    assert not answer.switched and answer.status == 403, answer.raw[:400]
    assert answer.field(b"x-egressd-reason") == b"websocket", answer.raw[:400]
    assert seen == [], seen  # the server never heard of it
    assert setup.smuggled(front) == before


@pytest.mark.parametrize("front", FRONTS)
@pytest.mark.parametrize("host", ["host.test", "path.test", "built.test"])
def test_upgrade_fields_of_a_request_that_is_no_upgrade_never_reach_the_server(
    setup: Setup, front: str, host: str
) -> None:
    """`Upgrade: h2c` and `HTTP2-Settings` without `Connection: upgrade`: the request is decided
    as the plain GET it is, and goes up without them (a lenient server would switch on them)."""
    path = f"/ok/{front}-{host}-no-connection"
    answer = setup.upgrade(front, host, path, [("Upgrade", "h2c"), *SETTINGS])
    assert answer.status == 200 and answer.body == b"ok", answer.raw[:400]
    [request] = setup.seen(front, path)
    assert request.header("upgrade") is None and request.header("http2-settings") is None, request.head
    assert SMUGGLED not in request.after


@pytest.mark.parametrize("front", FRONTS)
@pytest.mark.parametrize("host", ["host.test", "path.test"])
def test_a_101_nobody_asked_for_is_not_relayed(setup: Setup, front: str, host: str) -> None:
    """A server that switches protocols unasked: the child gets no 101 and no relay."""
    path = f"/ok/{front}-{host}/force101"
    answer = setup.upgrade(front, host, path, [])
    assert not answer.switched, answer.raw[:400]
    [request] = setup.seen(front, path)
    assert SMUGGLED not in request.after
