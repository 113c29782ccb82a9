"""Per-process identity through the real `egressd exec`: each connection's program (pid, exe) in the
audit, allow rules scoped by program (`exe`), an owner that cannot be determined refused where a
rule needs it, and the credential-free listener that admits only the child's process tree — used
by real clients that cannot send proxy credentials (Java's HttpClient, headless Chromium).
"""

from __future__ import annotations

import base64
import hashlib
import os
import shutil
import socket
import ssl
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import trustme

from tests.support.audit_log import audit_records
from tests.support.corpus import read_head
from tests.support.dns_server import DnsServer
from tests.support.egressd_cli import EGRESSD, egressd_exec, write_policy
from tests.support.upstreams import EchoHTTPServer

PYTHON = "/usr/bin/python3" if os.access("/usr/bin/python3", os.X_OK) else sys.executable
CHROMIUM = "/usr/bin/chromium"
HERE = Path(__file__).resolve().parents[1]

URLLIB_GET = """
import sys, urllib.request, urllib.error
for url in sys.argv[1:]:
    try:
        print("python", url, urllib.request.urlopen(url, timeout=20).status, "-", flush=True)
    except urllib.error.HTTPError as e:
        print("python", url, e.code, e.headers.get("X-Egressd-Reason"), flush=True)
"""


def audit(path: Path) -> list[dict[str, Any]]:
    return audit_records(path)


def decisions(records: list[dict[str, Any]], host: str) -> list[dict[str, Any]]:
    return [r for r in records if r.get("event") == "decision" and r.get("host") == host]


def show(result: subprocess.CompletedProcess[bytes]) -> str:
    out, err = result.stdout.decode(), result.stderr.decode()[-3000:]
    return f"exit {result.returncode}\nstdout:\n{out}\nstderr:\n{err}"


def run(
    policy: Path,
    dns: DnsServer,
    script: str,
    *extra: str,
    env: dict[str, str] | None = None,
    timeout: float = 120,
) -> subprocess.CompletedProcess[bytes]:
    options = ["--policy", str(policy), "--nameserver", dns.nameserver, *extra]
    return egressd_exec(options, ["sh", "-c", script], env=env, timeout=timeout)


def lines(result: subprocess.CompletedProcess[bytes]) -> dict[str, list[str]]:
    """`client url status [reason]` lines by (client, url); a missing reason reads "-"."""
    out: dict[str, list[str]] = {}
    for line in result.stdout.decode().splitlines():
        parts = line.split()
        if len(parts) in (3, 4):
            out[f"{parts[0]} {parts[1]}"] = [*parts[2:], "-"][:2]
    return out


def curl_line(url: str, *options: str) -> str:
    fmt = "curl " + url + " %{http_code} %header{x-egressd-reason}\\n"
    return f"curl -s -o /dev/null --max-time 20 -w '{fmt}' {' '.join(options)} {url}"


# -- exe rules -----------------------------------------------------------------------------------
SCOPED = """\
version: 1
allow:
  - {host: up.test, exe: [curl]}
  - {host: other.test, exe: [python3]}
  - 198.51.100.0/24
"""


def test_one_host_for_curl_the_other_for_python_in_one_child(
    tmp_path: Path, dns: DnsServer, upstream: EchoHTTPServer
) -> None:
    """curl and python3 run by one shell: each reaches only the host its rule names; the other
    program is refused exe_not_allowed, and every decision names the program's pid and exe."""
    dns.add("up.test", upstream.host)
    dns.add("other.test", upstream.host)
    policy = write_policy(tmp_path, SCOPED)
    (tmp_path / "get.py").write_text(URLLIB_GET)
    up, other = f"http://up.test:{upstream.port}/a", f"http://other.test:{upstream.port}/b"
    script = "\n".join([curl_line(up), curl_line(other), f"{PYTHON} {tmp_path / 'get.py'} {up} {other}"])
    log = tmp_path / "audit.jsonl"
    result = run(policy, dns, script, "--audit", str(log))
    got = lines(result)
    assert got[f"curl {up}"] == ["200", "-"], show(result)
    assert got[f"curl {other}"][:2] == ["403", "exe_not_allowed"], show(result)
    assert got[f"python {up}"] == ["403", "exe_not_allowed"], show(result)
    assert got[f"python {other}"] == ["200", "-"], show(result)
    assert [r["path"] for r in upstream.requests] == ["/a", "/b"]  # nothing refused reached it

    records = audit(log)
    by_exe: dict[tuple[str, str], set[str]] = {}
    for host in ("up.test", "other.test"):
        for record in decisions(records, host):
            if record["stage"] == "request":
                assert isinstance(record["pid"], int) and record["pid"] > 1, record
                by_exe.setdefault((host, os.path.basename(record["exe"])), set()).add(record["reason"])
    python_exe = os.path.basename(os.path.realpath(PYTHON))
    assert by_exe == {
        ("up.test", "curl"): {"allowlist"},
        ("other.test", "curl"): {"exe_not_allowed"},
        ("up.test", python_exe): {"exe_not_allowed"},
        ("other.test", python_exe): {"allowlist"},
    }, records
    refused = [r for r in decisions(records, "up.test") if r["reason"] == "exe_not_allowed"]
    assert python_exe in refused[0]["detail"] and "curl" in refused[0]["detail"]


SHARED_SOCKET = """
import os, socket, subprocess, sys, time, urllib.parse, base64
proxy = urllib.parse.urlsplit(os.environ["HTTP_PROXY"])
auth = base64.b64encode(f"{proxy.username}:{proxy.password}".encode()).decode()
url = sys.argv[1]
sock = socket.create_connection((proxy.hostname, proxy.port))
# another program holds the same socket (inherited, as SCM_RIGHTS would pass it): who sends?
holder = subprocess.Popen(["sleep", "60"], pass_fds=[sock.fileno()])
time.sleep(0.5)
host = urllib.parse.urlsplit(url).netloc
head = f"GET {url} HTTP/1.1\\r\\nHost: {host}\\r\\nProxy-Authorization: Basic {auth}\\r\\n"
sock.sendall(head.encode() + b"\\r\\n")
head = sock.recv(65536).split(b"\\r\\n\\r\\n")[0].decode()
holder.kill()
status = head.split()[1]
reason = [l.split(":", 1)[1].strip() for l in head.split("\\r\\n")
          if l.lower().startswith("x-egressd-reason")]
print("shared", url, status, reason[0] if reason else "-", flush=True)
"""


def test_an_owner_that_cannot_be_determined_is_refused_where_a_rule_needs_it(
    tmp_path: Path, dns: DnsServer, upstream: EchoHTTPServer
) -> None:
    """A socket held by two programs (python3 and sleep) has no one owner: a host scoped to
    python3 is refused to it, while a host without exe is not; python3 alone is admitted."""
    dns.add("other.test", upstream.host)
    dns.add("open.test", upstream.host)
    policy = write_policy(tmp_path, SCOPED + "  - open.test\n")
    (tmp_path / "shared.py").write_text(SHARED_SOCKET)
    (tmp_path / "get.py").write_text(URLLIB_GET)
    other, open_ = f"http://other.test:{upstream.port}/b", f"http://open.test:{upstream.port}/c"
    script = "\n".join(
        [
            f"{PYTHON} {tmp_path / 'shared.py'} {other}",
            f"{PYTHON} {tmp_path / 'shared.py'} {open_}",
            f"{PYTHON} {tmp_path / 'get.py'} {other}",
        ]
    )
    log = tmp_path / "audit.jsonl"
    result = run(policy, dns, script, "--audit", str(log))
    got = lines(result)
    assert got[f"shared {other}"] == ["403", "exe_not_allowed"], show(result)
    assert got[f"shared {open_}"] == ["200", "-"], show(result)
    assert got[f"python {other}"] == ["200", "-"], show(result)
    assert [r["path"] for r in upstream.requests] == ["/c", "/b"]
    refused = [r for r in decisions(audit(log), "other.test") if r["reason"] == "exe_not_allowed"]
    assert refused and refused[0]["exe"] is None and "could not identify" in refused[0]["detail"]


def test_check_has_no_program_and_takes_exe(tmp_path: Path) -> None:
    policy = write_policy(tmp_path, SCOPED)

    def check(*args: str) -> subprocess.CompletedProcess[str]:
        command = [*EGRESSD, "check", "--policy", str(policy), *args]
        return subprocess.run(command, capture_output=True, text=True, timeout=60)

    plain = check("up.test")
    assert plain.returncode == 1 and "reason: exe_not_allowed" in plain.stdout
    assert "--exe PROGRAM" in plain.stdout
    assert check("--exe", "curl", "up.test").returncode == 0
    assert check("--exe", "/usr/bin/curl", "up.test").returncode == 0
    assert check("--exe", "/usr/bin/curl", "other.test").returncode == 1
    assert check("--exe", PYTHON, "other.test").returncode == 0  # python3 -> python3.11 followed


# -- the credential-free listener ----------------------------------------------------------------
POLICY = """\
version: 1
allow:
  - up.test
  - ws.test
  - 198.51.100.0/24
  - 127.0.0.0/8
"""


def test_the_child_and_its_descendants_use_the_credential_free_listener(
    tmp_path: Path, dns: DnsServer, upstream: EchoHTTPServer
) -> None:
    dns.add("up.test", upstream.host)
    policy = write_policy(tmp_path, POLICY)
    (tmp_path / "get.py").write_text(URLLIB_GET.replace('"python"', '"grandchild"'))
    up, refused = f"http://up.test:{upstream.port}/free", f"http://denied.test:{upstream.port}/no"
    noauth = '--proxy "$EGRESSD_CHILD_PROXY"'
    unset = "env -u HTTP_PROXY -u http_proxy http_proxy=$EGRESSD_CHILD_PROXY"
    grandchild = f"sh -c '{unset} {PYTHON} {tmp_path / 'get.py'} {up}'"
    script = "\n".join([curl_line(up, noauth), curl_line(refused, noauth), grandchild])
    log = tmp_path / "audit.jsonl"
    result = run(policy, dns, script, "--audit", str(log))
    got = lines(result)
    assert got[f"curl {up}"][0] == "200", show(result)
    assert got[f"curl {refused}"] == ["403", "not_allowlisted"], show(result)
    assert got[f"grandchild {up}"] == ["200", "-"], show(result)
    assert [r["path"] for r in upstream.requests] == ["/free", "/free"]  # never /no
    allowed = [r for r in decisions(audit(log), "up.test") if r["stage"] == "request"]
    assert {os.path.basename(r["exe"]) for r in allowed} == {
        "curl",
        os.path.basename(os.path.realpath(PYTHON)),
    }
    assert all(r["client"] == "egressd" for r in allowed)  # the child's own credentials


WAITING_CHILD = """
echo "$EGRESSD_CHILD_PROXY" > {url_file}
i=0
while [ ! -e {go_file} ] && [ $i -lt 600 ]; do sleep 0.1; i=$((i+1)); done
"""


def _raw_get(address: tuple[str, int], url: str) -> bytes:
    with socket.create_connection(address, timeout=20) as sock:
        sock.sendall(f"GET {url} HTTP/1.1\r\nHost: up.test\r\n\r\n".encode())
        return read_head(sock)


def _outside_gets_407(host: str, port: int, proxy: str, url: str) -> None:
    """The child's credential-free listener, asked by processes that are not the child's."""
    answer = _raw_get((host, int(port)), url)
    assert answer.startswith(b"HTTP/1.1 407 "), answer[:300]
    assert b"Proxy-Authenticate" in answer
    outside = subprocess.run(
        [
            "curl",
            "-s",
            "-o",
            "/dev/null",
            "-w",
            "%{http_code}",
            "--max-time",
            "20",
            "--proxy",
            proxy,
            url,
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert outside.stdout == "407", outside
    if os.geteuid() == 0 and shutil.which("setpriv"):  # another user's process (CI runs as root)
        nobody = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", *outside.args]
        other_user = subprocess.run(nobody, capture_output=True, text=True, timeout=60)
        assert other_user.stdout == "407", other_user


@pytest.mark.parametrize("capture", [False, True], ids=["no-capture", "own-network"])
def test_a_process_outside_the_childs_tree_gets_407(
    tmp_path: Path, dns: DnsServer, upstream: EchoHTTPServer, capture: bool
) -> None:
    """The test itself and a curl it starts outside egressd reach the listener's port: 407, and
    nothing reaches the upstream. In the child's own network namespace the listener is on that
    namespace's loopback: outside, nothing listens there at all."""
    dns.add("up.test", upstream.host)
    policy = write_policy(tmp_path, POLICY)
    url_file, go_file = tmp_path / "url", tmp_path / "go"
    script = WAITING_CHILD.format(url_file=url_file, go_file=go_file)
    command = [
        *EGRESSD,
        "exec",
        "--policy",
        str(policy),
        "--nameserver",
        dns.nameserver,
        *([] if capture else ["--no-capture"]),
        "--",
        "sh",
        "-c",
        script,
    ]
    child = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 60
        while not (url_file.exists() and url_file.read_text().strip()) and time.monotonic() < deadline:
            time.sleep(0.05)
        proxy = url_file.read_text().strip()
        assert proxy.startswith("http://127.0.0.1:"), proxy
        host, port = proxy.removeprefix("http://").rsplit(":", 1)
        url = f"http://up.test:{upstream.port}/outside"
        if capture:
            with pytest.raises(ConnectionRefusedError):
                _raw_get((host, int(port)), url)
        else:
            _outside_gets_407(host, int(port), proxy, url)
    finally:
        go_file.touch()
        child.wait(timeout=60)
    assert child.returncode == 0, child.stderr.read().decode() if child.stderr else ""
    assert upstream.requests == []


def test_no_credentials_listener_option(tmp_path: Path, dns: DnsServer) -> None:
    policy = write_policy(tmp_path, POLICY)
    env = dict(os.environ, JAVA_TOOL_OPTIONS="-Duser.mine=1")
    printed = 'echo "[$EGRESSD_CHILD_PROXY] [$JAVA_TOOL_OPTIONS]"'
    off = run(policy, dns, printed, "--no-credentials-listener", env=env)
    assert off.stdout.decode().strip() == "[] [-Duser.mine=1]", show(off)
    on = run(policy, dns, printed, env=env)
    child_proxy, java = on.stdout.decode().strip().split("] [")
    port = child_proxy.rsplit(":", 1)[1]
    assert java.startswith("-Duser.mine=1 "), java  # the user's own options are kept, first
    assert f"-Dhttp.proxyPort={port} " in java and f"-Dhttps.proxyPort={port} " in java
    assert "-Dhttp.nonProxyHosts=" in java


# -- Java's HttpClient ----------------------------------------------------------------------------
JAVA_FETCH = """
import java.net.URI;
import java.net.http.HttpClient;
import java.net.http.HttpRequest;
import java.net.http.HttpResponse;

public class Fetch {
    public static void main(String[] args) throws Exception {
        HttpClient client = HttpClient.newHttpClient();
        System.out.println("mine " + System.getProperty("user.mine") + " - -");
        for (String url : args) {
            try {
                HttpResponse<String> r = client.send(
                    HttpRequest.newBuilder(URI.create(url)).build(), HttpResponse.BodyHandlers.ofString());
                System.out.println("java " + url + " " + r.statusCode() + " "
                    + r.headers().firstValue("x-egressd-reason").orElse("-"));
            } catch (Exception e) {
                String text = String.valueOf(e.getMessage()).replace(' ', '_');
                System.out.println("java " + url + " error " + text);
            }
        }
    }
}
"""


def test_java_httpclient_through_the_credential_free_listener(
    tmp_path: Path, dns: DnsServer, upstream: EchoHTTPServer, upstream_tls: EchoHTTPServer, ca_file: Path
) -> None:
    """Java 17's HttpClient with only JAVA_TOOL_OPTIONS from egressd: plain HTTP allowed and
    refused (with the reason), HTTPS through inspection trusting egressd's CA (the trust store),
    a refused HTTPS CONNECT failing; the user's own JAVA_TOOL_OPTIONS kept."""
    dns.add("up.test", upstream.host)
    dns.add("tls.test", upstream_tls.host)
    dns.add("other.test", upstream_tls.host)
    policy = write_policy(tmp_path, POLICY + "  - other.test\ninspect:\n  - other.test\n")
    (tmp_path / "Fetch.java").write_text(JAVA_FETCH)
    up = f"http://up.test:{upstream.port}/java"
    refused = f"http://denied.test:{upstream.port}/no"
    inspected = f"https://other.test:{upstream_tls.port}/secure"
    refused_tls = f"https://tls.test:{upstream_tls.port}/no"
    env = dict(os.environ, JAVA_TOOL_OPTIONS="-Duser.mine=kept")
    result = run(
        policy,
        dns,
        f"java {tmp_path / 'Fetch.java'} {up} {refused} {inspected} {refused_tls}",
        "--upstream-ca",
        str(ca_file),
        env=env,
        timeout=180,
    )
    got = lines(result)
    assert got["mine kept"] == ["-", "-"], show(result)
    assert got[f"java {up}"] == ["200", "-"], show(result)
    assert got[f"java {refused}"] == ["403", "not_allowlisted"], show(result)
    assert got[f"java {inspected}"] == ["200", "-"], show(result)
    assert got[f"java {refused_tls}"][0] == "error" and "403" in got[f"java {refused_tls}"][1], show(result)
    assert [r["path"] for r in upstream.requests] == ["/java"]
    assert [r["path"] for r in upstream_tls.requests] == ["/secure"]


# -- headless Chromium ----------------------------------------------------------------------------
def _chromium(url: str) -> str:
    return (
        f"{CHROMIUM} --headless --no-sandbox --disable-gpu --no-first-run "
        f'--proxy-server="$EGRESSD_CHILD_PROXY" --dump-dom {url} 2>/dev/null'
    )


def test_chromium_loads_an_allowed_page_and_shows_the_refusal(
    tmp_path: Path, dns: DnsServer, upstream: EchoHTTPServer
) -> None:
    dns.add("up.test", upstream.host)
    policy = write_policy(tmp_path, POLICY)
    up = f"http://up.test:{upstream.port}/page"
    refused = f"http://denied.test:{upstream.port}/no"
    script = f"{_chromium(up)}; echo =====; {_chromium(refused)}"
    result = run(policy, dns, script, timeout=180)
    allowed, _, denied = result.stdout.decode().partition("=====")
    assert '"path": "/page"' in allowed or '"path":"/page"' in allowed, show(result)
    assert "egressd refused the connection to denied.test:" in denied, show(result)
    assert "reason: not_allowlisted" in denied
    assert {r["path"] for r in upstream.requests} <= {"/page", "/favicon.ico"}  # never /no


class WebSocketServer:
    """A TLS WebSocket server on 127.0.0.x: completes the handshake and sends one text message."""

    def __init__(self, ca: trustme.CA, host: str = "127.0.0.7") -> None:
        self.context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        ca.issue_cert("ws.test").configure_cert(self.context)
        self.sock = socket.create_server((host, 0))
        self.host, self.port = self.sock.getsockname()[:2]
        self.upgrades = 0
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while True:
            try:
                raw, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._client, args=(raw,), daemon=True).start()

    def _client(self, raw: socket.socket) -> None:
        try:
            with self.context.wrap_socket(raw, server_side=True) as conn:
                head = read_head(conn)
                if b"\r\n\r\n" not in head:
                    return  # closed before its head ended
                key = next(
                    line.split(b":", 1)[1].strip()
                    for line in head.split(b"\r\n")
                    if line.lower().startswith(b"sec-websocket-key:")
                )
                accept = base64.b64encode(
                    hashlib.sha1(key + b"258EAFA5-E914-47DA-95CA-C5AB0DC85B11").digest()
                )
                self.upgrades += 1
                conn.sendall(
                    b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
                    b"Sec-WebSocket-Accept: " + accept + b"\r\n\r\n" + b"\x81\x05hello"
                )
                time.sleep(5)
        except (OSError, StopIteration):
            return

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
def ws_server(ca: trustme.CA, dns: DnsServer) -> Iterator[WebSocketServer]:
    server = WebSocketServer(ca)
    dns.add("ws.test", server.host)
    try:
        yield server
    finally:
        server.close()


PLAYWRIGHT_WS = f"""
import json, os, sys
from playwright.sync_api import sync_playwright
with sync_playwright() as pw:
    browser = pw.chromium.launch(
        executable_path="{CHROMIUM}", headless=True, args=["--no-sandbox", "--disable-gpu"],
        proxy={{"server": os.environ["EGRESSD_CHILD_PROXY"]}},
    )
    page = browser.new_context(ignore_https_errors=True).new_page()
    page.goto(sys.argv[1])
    outcome = page.evaluate('''url => new Promise(done => {{
        const ws = new WebSocket(url);
        ws.onmessage = e => done("message:" + e.data);
        ws.onerror = () => done("error");
        setTimeout(() => done("timeout"), 15000);
    }})''', sys.argv[2])
    browser.close()
print("ws", sys.argv[2], outcome, "-", flush=True)
"""


@pytest.mark.parametrize("websocket", [True, False])
def test_chromium_websocket_follows_the_policy(
    tmp_path: Path,
    dns: DnsServer,
    upstream: EchoHTTPServer,
    ws_server: WebSocketServer,
    ca_file: Path,
    websocket: bool,
) -> None:
    """A WebSocket from a page in Chromium (driven by Playwright inside the child) to an inspected
    host: opened with `websocket: true`, refused with `websocket: false`."""
    dns.add("up.test", upstream.host)
    text = POLICY + f"inspect:\n  - ws.test\nwebsocket: {'true' if websocket else 'false'}\n"
    policy = write_policy(tmp_path, text)
    (tmp_path / "ws.py").write_text(PLAYWRIGHT_WS)
    page, ws = f"http://up.test:{upstream.port}/page", f"wss://ws.test:{ws_server.port}/socket"
    log = tmp_path / "audit.jsonl"
    result = run(
        policy,
        dns,
        f"{sys.executable} {tmp_path / 'ws.py'} {page} {ws}",
        "--upstream-ca",
        str(ca_file),
        "--audit",
        str(log),
        timeout=180,
    )
    got = lines(result)
    if websocket:
        assert got[f"ws {ws}"] == ["message:hello", "-"], show(result)
        assert ws_server.upgrades == 1
    else:
        assert got[f"ws {ws}"] == ["error", "-"], show(result)
        assert ws_server.upgrades == 0
        refused = [r for r in decisions(audit(log), "ws.test") if r["reason"] == "websocket"]
        assert refused and refused[0]["decision"] == "deny", audit(log)
