"""Bypass corpus, request tricks: what the bytes of a request say vs. where egressd connects.

Why: a proxy decides on one field (absolute-form target, CONNECT authority, SNI) and a trick puts
another host in another field (Host header, SNI, a smuggled second request, a folded header) hoping
some reader downstream believes it. Each case sends raw bytes to one `egressd run` and asserts the
answer, the reason code, that the upstream got nothing it should not have, and that egressd still
serves a normal request afterwards.
"""

from __future__ import annotations

import contextlib
import socket
import ssl
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import trustme

from tests.support.corpus import ProxyClient, Reader, Response, ServerSet, read_response, tunnel_get
from tests.support.dns_server import DnsServer
from tests.support.egressd_cli import EgressdRun, write_policy
from tests.support.upstreams import EchoHTTPServer, EchoHTTPSServer

ALLOWED = "198.51.100.1"
EVIL = "198.51.100.9"
TLS_HOST = "198.51.100.2"

POLICY = f"""\
version: 1
allow: [allowed.test, up.test, {ALLOWED}, {TLS_HOST}]
loopback: {{allow: false}}
"""


@dataclass
class Env:
    client: ProxyClient
    servers: ServerSet
    tls: EchoHTTPSServer
    ca: trustme.CA
    run: EgressdRun

    @property
    def port(self) -> int:
        return self.servers.port

    @property
    def allowed(self) -> EchoHTTPServer:
        server = self.servers[ALLOWED]
        assert isinstance(server, EchoHTTPServer)
        return server

    def fill(self, template: bytes) -> bytes:
        """``{P}`` = this port, ``{AUTH}`` = the Proxy-Authorization line."""
        return template.replace(b"{P}", str(self.port).encode()).replace(b"{AUTH}", self.client.auth_header)


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory, ca: trustme.CA) -> Iterator[Env]:
    tmp = Path(tmp_path_factory.mktemp("requests"))
    policy = write_policy(tmp, POLICY)
    with (
        DnsServer() as dns,
        ServerSet((ALLOWED, EVIL, "127.0.0.1")) as servers,
        EchoHTTPSServer(TLS_HOST, ca=ca, hostnames=["up.test", "other.test", TLS_HOST]) as tls,
    ):
        dns.add("allowed.test", ALLOWED)
        dns.add("evil.test", EVIL)
        dns.add("up.test", TLS_HOST)
        dns.add("other.test", TLS_HOST)
        with EgressdRun(["--policy", str(policy), "--nameserver", dns.nameserver]) as run:
            yield Env(ProxyClient.from_env(run.env), servers, tls, ca, run)
        assert servers.reached(ALLOWED) == {}, "a refused server was reached"


@contextlib.contextmanager
def guarded(env: Env, *, allowed_requests: int = 0) -> Iterator[None]:
    """No connection to a refused server, at most ``allowed_requests`` reach the allowed one, and
    egressd answers a normal request afterwards."""
    before = env.servers.counts()
    requests_before = len(env.allowed.requests)
    yield
    after = env.servers.counts()
    assert {h: after[h] - before[h] for h in after if h != ALLOWED and after[h] != before[h]} == {}
    assert len(env.allowed.requests) - requests_before <= allowed_requests, env.allowed.requests[-1:]
    assert env.client.alive(env.allowed), "egressd stopped answering"


def assert_refused(response: Response | None, status: int, reason: str) -> None:
    assert response is not None, "closed without an answer"
    assert (response.status, response.reason) == (status, reason), response.raw_head[:400]


# -- absolute-form target vs Host header ----------------------------------------------------------
HOST_CASES = [
    # (id, target, Host header(s), expected status, reason)
    ("host-names-evil", "http://allowed.test:{P}/", ["evil.test:{P}"], 400, "host_mismatch"),
    ("host-names-metadata", "http://allowed.test:{P}/", ["169.254.169.254"], 400, "host_mismatch"),
    ("host-names-loopback-hex", "http://allowed.test:{P}/", ["0x7f.1:{P}"], 400, "host_mismatch"),
    ("host-other-port", "http://allowed.test:{P}/", ["allowed.test:1"], 400, "host_mismatch"),
    (
        "two-host-headers",
        "http://allowed.test:{P}/",
        ["allowed.test:{P}", "evil.test:{P}"],
        400,
        "host_mismatch",
    ),
    ("host-with-userinfo", "http://allowed.test:{P}/", ["allowed.test:{P}@evil.test"], 400, "host_mismatch"),
    ("host-address-of-other", "http://198.51.100.1:{P}/", ["198.51.100.9:{P}"], 400, "host_mismatch"),
    # found by fuzz/fuzz_request_head.py: str.strip() calls \x1c-\x1f whitespace; egressd now refuses
    # any control character in a request head before it is parsed (egressd/wire/http_head.py)
    ("host-control-char-prefix", "http://allowed.test:{P}/", ["\x1eallowed.test:{P}"], 400, "bad_request"),
    ("host-control-char-suffix", "http://allowed.test:{P}/", ["allowed.test:{P}\x1c"], 400, "bad_request"),
    ("target-evil-host-allowed", "http://evil.test:{P}/", ["allowed.test:{P}"], 403, "not_allowlisted"),
    (
        "target-metadata-host-allowed",
        "http://169.254.169.254/",
        ["allowed.test:{P}"],
        403,
        "forbidden_address",
    ),
    # a proxy request names its target in absolute form: origin-form is refused before any decision
    ("origin-form-host-evil", "/", ["evil.test:{P}"], 400, "bad_request"),
    ("origin-form-host-allowed", "/", ["allowed.test:{P}"], 400, "bad_request"),
    ("origin-form-host-loopback", "/", ["0x7f.1:{P}"], 400, "bad_request"),
    ("origin-form-host-metadata", "/", ["[::ffff:a9fe:a9fe]"], 400, "bad_request"),
    ("asterisk-form", "*", ["allowed.test:{P}"], 400, "bad_request"),
    ("authority-form", "allowed.test:{P}", ["allowed.test:{P}"], 400, "bad_request"),
    ("origin-form-no-host", "/", [], 400, "bad_request"),
    ("target-with-userinfo", "http://allowed.test@evil.test:{P}/", ["evil.test:{P}"], 400, "bad_request"),
    ("scheme-ftp", "ftp://allowed.test:{P}/", ["allowed.test:{P}"], 400, "bad_request"),
    ("self-by-name", "http://localhost:{SELF}/", ["localhost:{SELF}"], 403, "self"),
    ("self-by-address", "http://127.0.0.1:{SELF}/", ["127.0.0.1:{SELF}"], 403, "self"),
]


@pytest.mark.parametrize(
    ("target", "hosts", "status", "reason"), [c[1:] for c in HOST_CASES], ids=[c[0] for c in HOST_CASES]
)
def test_target_vs_host_header(env: Env, target: str, hosts: list[str], status: int, reason: str) -> None:
    """The absolute-form target decides; a Host header naming anything else is refused."""

    def fill(text: str) -> str:
        return text.replace("{P}", str(env.port)).replace("{SELF}", str(env.client.port))

    lines = [f"GET {fill(target)} HTTP/1.1", *(f"Host: {fill(h)}" for h in hosts), "Connection: close"]
    raw = ("\r\n".join(lines) + "\r\n").encode() + env.client.auth_header + b"\r\n"
    with guarded(env):
        assert_refused(env.client.exchange(raw), status, reason)


def test_host_header_in_another_spelling_of_the_target_is_fine(env: Env) -> None:
    """Not a mismatch: ``ALLOWED.TEST.`` is the same host as the target ``allowed.test``."""
    with guarded(env, allowed_requests=1):
        response = env.client.get(f"http://allowed.test:{env.port}/", host=f"ALLOWED.TEST.:{env.port}")
        assert response is not None and response.status == 200


# -- CONNECT authority vs Host --------------------------------------------------------------------
def test_connect_authority_decides_not_host(env: Env) -> None:
    """CONNECT evil with ``Host: allowed`` is refused; CONNECT allowed with ``Host: evil`` tunnels to
    allowed only (the Host header of a CONNECT names nothing egressd connects to)."""
    with guarded(env), env.client.connect(f"evil.test:{env.port}", host=f"allowed.test:{env.port}") as (r, _):
        assert_refused(r, 403, "not_allowlisted")
    with (
        guarded(env, allowed_requests=1),
        env.client.connect(f"allowed.test:{env.port}", host=f"evil.test:{env.port}") as (r, sock),
    ):
        assert r is not None and r.status == 200
        inner = tunnel_get(sock, "evil.test")  # even the inner request naming evil lands on allowed
        assert inner is not None and b'"server": "http-198.51.100.1"' in inner.body


UNREADABLE = ((400, "bad_request"), (403, "invalid_target"))  # mitmproxy's reader or egressd's


@pytest.mark.parametrize(
    ("authority", "expected"),
    [
        ("allowed.test", UNREADABLE),  # no port
        ("/", UNREADABLE),
        ("allowed.test:0", UNREADABLE),
        ("allowed.test:65536", UNREADABLE),
        ("allowed.test:{P}@evil.test:{P}", UNREADABLE),
        ("evil.test:{P}#@allowed.test:{P}", UNREADABLE),
        ("127.0.0.1:{SELF}", ((403, "self"),)),
        ("[::1]:{SELF}", ((403, "self"),)),
        ("localhost:{SELF}", ((403, "self"),)),
    ],
    ids=[
        "no-port",
        "slash",
        "port-0",
        "port-65536",
        "userinfo",
        "fragment",
        "self-v4",
        "self-v6",
        "self-name",
    ],
)
def test_connect_malformed_authority(env: Env, authority: str, expected: tuple[tuple[int, str], ...]) -> None:
    """Unreadable CONNECT authorities are refused (by whichever reader sees them first); egressd's
    own listener is refused in every spelling."""
    authority = authority.replace("{P}", str(env.port)).replace("{SELF}", str(env.client.port))
    with guarded(env), env.client.connect(authority) as (response, _):
        assert response is not None, "closed without an answer"
        assert (response.status, response.reason) in expected, response.raw_head[:300]


REFUSED_AS = {400: "bad_request", 403: "not_allowlisted", 407: "proxy_auth_required"}


def test_pipelined_requests_are_each_decided(env: Env) -> None:
    """A second request on a kept-alive connection (absolute- or origin-form, or hidden after a body
    the upstream would see as complete) is decided on its own."""
    first = b"GET http://allowed.test:{P}/one HTTP/1.1\r\nHost: allowed.test:{P}\r\n{AUTH}\r\n"
    for second, refused in (
        (
            b"GET http://evil.test:{P}/ HTTP/1.1\r\nHost: evil.test:{P}\r\n{AUTH}Connection: close\r\n\r\n",
            403,
        ),
        (b"GET / HTTP/1.1\r\nHost: evil.test:{P}\r\n{AUTH}Connection: close\r\n\r\n", 400),
        # without credentials of its own: the first request's do not carry over (on any path)
        (b"GET http://evil.test:{P}/ HTTP/1.1\r\nHost: evil.test:{P}\r\nConnection: close\r\n\r\n", 407),
    ):
        for lead in (
            first,
            b"POST http://allowed.test:{P}/ HTTP/1.1\r\nHost: allowed.test:{P}\r\n{AUTH}"
            b"Transfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
            b"POST http://allowed.test:{P}/ HTTP/1.1\r\nHost: allowed.test:{P}\r\n{AUTH}"
            b"Content-Length: 0\r\n\r\n",
        ):
            with guarded(env, allowed_requests=1), env.client.open() as sock:
                sock.sendall(env.fill(lead + second))
                reader = Reader(sock)
                one = reader.response()
                assert one is not None and one.status == 200
                assert_refused(reader.response(), refused, REFUSED_AS[refused])


def test_tunnel_contents_cannot_retarget(env: Env) -> None:
    """Inside an allowed pass-through tunnel, an absolute-form request for evil still goes to allowed."""
    with guarded(env, allowed_requests=1), env.client.connect(f"{ALLOWED}:{env.port}") as (r, sock):
        assert r is not None and r.status == 200
        sock.sendall(f"GET http://evil.test:{env.port}/ HTTP/1.1\r\nHost: evil.test\r\n\r\n".encode())
        inner = read_response(sock)
        assert inner is not None and b"http-198.51.100.1" in inner.body


# -- request smuggling and malformed heads (plain HTTP): 400, nothing forwarded ------------------
_GET = b"GET http://allowed.test:{P}/s HTTP/1.1\r\nHost: allowed.test:{P}\r\n{AUTH}"
_POST = b"POST http://allowed.test:{P}/s HTTP/1.1\r\nHost: allowed.test:{P}\r\n{AUTH}"
SMUGGLING = [
    ("cl-and-te", _POST + b"Content-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n"),
    ("te-and-cl", _POST + b"Transfer-Encoding: chunked\r\nContent-Length: 5\r\n\r\n0\r\n\r\n"),
    ("duplicate-cl-differing", _POST + b"Content-Length: 5\r\nContent-Length: 6\r\n\r\nhello!"),
    ("duplicate-cl-equal", _POST + b"Content-Length: 5\r\nContent-Length: 5\r\n\r\nhello"),
    ("cl-list", _POST + b"Content-Length: 5, 5\r\n\r\nhello"),
    ("cl-negative", _POST + b"Content-Length: -1\r\n\r\n"),
    ("cl-plus", _POST + b"Content-Length: +5\r\n\r\nhello"),
    ("cl-hex", _POST + b"Content-Length: 0x5\r\n\r\nhello"),
    ("te-duplicate", _POST + b"Transfer-Encoding: chunked\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n"),
    ("te-identity-chunked", _POST + b"Transfer-Encoding: identity, chunked\r\n\r\n0\r\n\r\n"),
    ("te-xchunked", _POST + b"Transfer-Encoding: xchunked\r\n\r\n0\r\n\r\n"),
    ("te-chunked-gzip", _POST + b"Transfer-Encoding: chunked, gzip\r\n\r\n0\r\n\r\n"),
    ("te-obs-fold", _POST + b"Transfer-Encoding:\r\n chunked\r\n\r\n0\r\n\r\n"),
    ("te-vertical-tab", _POST + b"Transfer-Encoding:\x0bchunked\r\n\r\n0\r\n\r\n"),
    ("space-before-colon", _GET + b"Transfer-Encoding : chunked\r\n\r\n0\r\n\r\n"),
    ("header-without-colon", _GET + b"X-No-Colon\r\n\r\n"),
    ("leading-continuation", b"GET http://allowed.test:{P}/s HTTP/1.1\r\n folded: x\r\n{AUTH}\r\n"),
    ("obs-fold", _GET + b"X-A: a\r\n b\r\n\r\n"),
    ("obs-fold-tab", _GET + b"X-A: a\r\n\tb\r\n\r\n"),
    # forwarded verbatim, the fold hides a second framing header from egressd but not from an
    # upstream that reads a leading-space line as a new field
    (
        "obs-fold-hiding-te",
        _POST + b"Content-Length: 5\r\nX-A: a\r\n Transfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
    ),
    ("bare-lf-everywhere", b"GET http://allowed.test:{P}/s HTTP/1.1\nHost: allowed.test:{P}\n{AUTH}\n"),
    ("bare-lf-one-line", _GET + b"X-A: a\nX-B: b\r\n\r\n"),
    ("bare-cr-in-value", _GET + b"X-A: a\rX-B: b\r\n\r\n"),
    (
        "bare-cr-hiding-te",
        _POST + b"Content-Length: 5\r\nX-A: a\rTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
    ),
    ("nul-in-value", _GET + b"X-A: a\x00b\r\n\r\n"),
    ("nul-in-name", _GET + b"X-\x00A: a\r\n\r\n"),
    ("nul-in-target", b"GET http://allowed.test:{P}/s\x00x HTTP/1.1\r\nHost: allowed.test:{P}\r\n{AUTH}\r\n"),
    ("http-0.9", b"GET http://allowed.test:{P}/s\r\n\r\n"),
    ("bad-version", b"GET http://allowed.test:{P}/s HTTP/1.1x\r\nHost: allowed.test:{P}\r\n{AUTH}\r\n"),
]


@pytest.mark.parametrize("raw", [c[1] for c in SMUGGLING], ids=[c[0] for c in SMUGGLING])
def test_smuggling_and_malformed_heads_get_400(env: Env, raw: bytes) -> None:
    """RFC 9112 framing errors (CL+TE, duplicate CL, obs-fold, bare LF/CR, NUL) are refused with 400
    and nothing is forwarded: a lenient proxy in front of a strict upstream (or the reverse) is how
    a second, undecided request gets smuggled through."""
    with guarded(env):
        response = env.client.exchange(env.fill(raw))
        assert_refused(response, 400, "bad_request")


def test_raw_bytes_in_the_path_are_refused(env: Env) -> None:
    """A non-UTF-8 byte in a request line is refused (400) and audited, in origin-form (never a
    proxy request) and in absolute-form (found by the request-head fuzzer: it was a 500)."""
    origin_form = b"GET /raw\x89\xff HTTP/1.1\r\nHost: allowed.test:{P}\r\n{AUTH}\r\n"
    absolute_form = (
        b"GET http://allowed.test:{P}/raw\x89\xff HTTP/1.1\r\nHost: allowed.test:{P}\r\n{AUTH}\r\n"
    )
    with guarded(env):
        assert_refused(env.client.exchange(env.fill(origin_form)), 400, "bad_request")
        assert_refused(env.client.exchange(env.fill(absolute_form)), 400, "bad_request")


def test_invalid_chunk_size_forwards_nothing(env: Env) -> None:
    """A chunked body whose size line is not hex: nothing reaches the upstream (answer 400 or close)."""
    raw = env.fill(_POST + b"Transfer-Encoding: chunked\r\n\r\n0x5\r\nhello\r\n0\r\n\r\n")
    with guarded(env):
        response = env.client.exchange(raw)
        if response is not None:
            assert_refused(response, 400, "bad_request")


# -- oversized heads: refused by egressd, not buffered and not forwarded -------------------------
def _send_big(env: Env, raw: bytes, timeout: float = 10.0) -> Response | None:
    with env.client.open(timeout) as sock:
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            sock.sendall(raw)
        try:
            return read_response(sock, timeout)
        except (ConnectionResetError, TimeoutError):
            return None


OVERSIZED = [
    ("request-line-128k", b"GET http://allowed.test:{P}/" + b"a" * (128 * 1024) + b" HTTP/1.1\r\n{AUTH}\r\n"),
    ("one-header-128k", _GET + b"X-Big: " + b"a" * (128 * 1024) + b"\r\n\r\n"),
    ("headers-512k", _GET + b"".join(b"X-%d: %s\r\n" % (i, b"a" * 1000) for i in range(512)) + b"\r\n"),
    ("many-small-headers", _GET + b"".join(b"X-%d: y\r\n" % i for i in range(20000)) + b"\r\n"),
]


@pytest.mark.parametrize("raw", [c[1] for c in OVERSIZED], ids=[c[0] for c in OVERSIZED])
def test_oversized_head_is_refused(env: Env, raw: bytes) -> None:
    """A request head far beyond any real client's (>= 128 KiB) is answered by egressd (400/414/431,
    reason bad_request) and never forwarded: the upstream must not be the one that objects."""
    with guarded(env):
        response = _send_big(env, env.fill(raw))
        assert response is not None, "closed without an answer"
        assert response.status in (400, 414, 431), response.raw_head[:300]
        assert response.reason == "bad_request", response.raw_head[:300]


def test_unterminated_head_is_cut(env: Env) -> None:
    """A head that never ends (4 MiB without a blank line) is answered and closed, not buffered forever."""
    raw = env.fill(_GET) + b"".join(b"X-%d: %s\r\n" % (i, b"a" * 1000) for i in range(4096))
    started = time.monotonic()
    with guarded(env):
        response = _send_big(env, raw, timeout=5)
        assert response is not None and response.status in (400, 431), response
        assert response.reason == "bad_request"
    assert time.monotonic() - started < 6


# -- non-HTTP bytes --------------------------------------------------------------------------------
NON_HTTP = [
    ("binary-garbage", b"\x00\x01\x02\x03\xff\xfe garbage\r\n\r\n", (400, "bad_request")),
    ("proxy-protocol", b"PROXY TCP4 1.2.3.4 5.6.7.8 1 2\r\n{AUTH}\r\n", (400, "bad_request")),
    ("http2-preface", b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n", (400, "bad_request")),
    ("ssh-banner", b"SSH-2.0-OpenSSH_9.6\r\n\r\n", (400, "bad_request")),
    ("tls-to-proxy", b"\x16\x03\x01\x00\x05\x01\x00\x00\x01\x00", None),  # closed without an answer
    ("socks5-on-http-port", b"\x05\x01\x00", None),
    ("socks4-on-http-port", b"\x04\x01\x00\x50\x7f\x00\x00\x01egressd\x00", None),
]


@pytest.mark.parametrize(("raw", "expected"), [c[1:] for c in NON_HTTP], ids=[c[0] for c in NON_HTTP])
def test_non_http_bytes(env: Env, raw: bytes, expected: tuple[int, str] | None) -> None:
    """Bytes that are not an HTTP request get a 400 (or a closed connection), never a tunnel."""
    with guarded(env), env.client.open(5) as sock:
        sock.sendall(env.fill(raw))
        if expected is None:
            sock.shutdown(socket.SHUT_WR)
        try:
            response = read_response(sock, 5)
        except (ConnectionResetError, TimeoutError):
            response = None
        if expected is None:
            assert response is None or response.status >= 400
        else:
            assert_refused(response, *expected)


# -- TLS inside a CONNECT tunnel: SNI must name the CONNECT host ---------------------------------
def _client_hello_session(
    env: Env, sni: str | None
) -> tuple[ssl.SSLObject, ssl.MemoryBIO, ssl.MemoryBIO, bytes]:
    context = ssl.create_default_context()
    env.ca.configure_trust(context)
    if sni is None:
        context.check_hostname = False
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    tls = context.wrap_bio(incoming, outgoing, server_hostname=sni)
    with contextlib.suppress(ssl.SSLWantReadError):
        tls.do_handshake()
    return tls, incoming, outgoing, outgoing.read()


def _tls_through(env: Env, authority: str, sni: str | None, split: int | None) -> bytes | None:
    """TLS over a CONNECT tunnel, the ClientHello optionally split in two TCP segments; returns the
    body of ``GET /`` inside, or None when the tunnel was closed before the handshake finished."""
    with env.client.connect(authority) as (response, sock):
        assert response is not None and response.status == 200, response
        tls, incoming, outgoing, hello = _client_hello_session(env, sni)
        if split is None:
            sock.sendall(hello)
        else:
            sock.sendall(hello[:split])
            time.sleep(0.3)
            sock.sendall(hello[split:])
        sock.settimeout(5)
        while True:
            try:
                data = sock.recv(65536)
            except (ConnectionResetError, TimeoutError):
                return None
            if not data:
                return None
            incoming.write(data)
            try:
                tls.do_handshake()
                break
            except ssl.SSLWantReadError:
                sock.sendall(outgoing.read())
        tls.write(b"GET /sni HTTP/1.1\r\nHost: up.test\r\nConnection: close\r\n\r\n")
        sock.sendall(outgoing.read())
        body = b""
        while True:
            try:
                body += tls.read(65536)
            except ssl.SSLWantReadError:
                data = sock.recv(65536)
                if not data:
                    break
                incoming.write(data)
            except (ssl.SSLZeroReturnError, ssl.SSLEOFError):
                break
            if b"}" in body:
                break
        return body


SNI_CASES = [
    # (id, CONNECT authority host, SNI, split at, reaches the TLS server)
    ("sni-matches", "up.test", "up.test", None, True),
    ("sni-matches-other-case", "up.test", "UP.TEST", None, True),
    ("sni-names-other-host", "up.test", "other.test", None, False),
    ("sni-names-evil", "up.test", "evil.test", None, False),
    ("sni-missing-for-name", "up.test", None, None, False),
    ("sni-missing-for-ip", TLS_HOST, None, None, True),
    ("sni-mismatch-split-hello-5", "up.test", "other.test", 5, False),
    ("sni-mismatch-split-hello-60", "up.test", "other.test", 60, False),
    ("sni-matches-split-hello-60", "up.test", "up.test", 60, True),
]


@pytest.mark.parametrize(
    ("host", "sni", "split", "ok"), [c[1:] for c in SNI_CASES], ids=[c[0] for c in SNI_CASES]
)
def test_sni_must_name_the_connect_host(
    env: Env, host: str, sni: str | None, split: int | None, ok: bool
) -> None:
    """A tunnel whose ClientHello names another host (or none, for a name) is closed before the
    upstream sees a handshake — also when the ClientHello arrives in pieces."""
    handshakes, requests = env.tls.tls_handshakes, len(env.tls.requests)
    body = _tls_through(env, f"{host}:{env.tls.port}", sni, split)
    if ok:
        assert body is not None and b'"path": "/sni"' in body
        assert env.tls.tls_handshakes == handshakes + 1
    else:
        assert body is None
        assert env.tls.tls_handshakes == handshakes and len(env.tls.requests) == requests
