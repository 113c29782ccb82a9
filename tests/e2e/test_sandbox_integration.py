"""`egressd sandbox` with real bubblewrap, real curl and Python inside, real servers outside.

What is proved here: the proxy is the only way out (allowed -> 200, refused -> 403 with its reason,
bypassing the proxy -> nothing reaches any server, not even DNS or UDP), narrowing by --only and
--profile, the file system layout, stdio/exit status/signals as with exec, the relay's socket and
the credentials being the child's alone, and refusing to run without a working bubblewrap.

Needs root or unprivileged user namespaces (bubblewrap creates a user namespace); CI runs as root.
"""

from __future__ import annotations

import fcntl
import json
import os
import select
import signal
import socket
import subprocess
import termios
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest

from tests.support.answers import assert_refusal, parse_http
from tests.support.dns_server import DnsServer
from tests.support.egressd_cli import EGRESSD, write_policy
from tests.support.netns import UPSTREAM_V4
from tests.support.sandboxes import PY, egressd_sandbox, python_inside, sandbox_env
from tests.support.upstreams import EchoHTTPServer, EchoHTTPSServer, TcpEchoServer, free_port


@pytest.fixture
def policy(tmp_path: Path) -> Path:
    return write_policy(tmp_path)


def _base(policy: Path, dns: DnsServer) -> list[str]:
    return ["--policy", str(policy), "--nameserver", dns.nameserver]


# -- allowed and refused through the proxy ---------------------------------------------------------
def test_curl_reaches_an_allowed_upstream(
    policy: Path, dns: DnsServer, upstream: EchoHTTPServer, work: Path
) -> None:
    dns.add("up.test", upstream.host)
    result = egressd_sandbox(
        _base(policy, dns),
        ["curl", "-sS", "-i", "--max-time", "20", f"http://up.test:{upstream.port}/in?x=1"],
        cwd=work,
    )
    status, _, _ = parse_http(result.stdout)
    assert status == 200, result.stderr
    assert upstream.requests[-1]["path"] == "/in?x=1"
    assert "proxy-authorization" not in upstream.requests[-1]["headers"]


def test_curl_https_tunnel_and_refusal(
    policy: Path, dns: DnsServer, upstream_tls: EchoHTTPSServer, ca_file: Path, work: Path
) -> None:
    dns.add("up.test", upstream_tls.host)
    # the CA file lives under the host's /tmp, which the sandbox hides: --ro shows it
    options = [*_base(policy, dns), "--ro", str(ca_file.parent)]
    ok = egressd_sandbox(
        options,
        ["curl", "-sS", "-i", "--cacert", str(ca_file), f"https://up.test:{upstream_tls.port}/secure"],
        cwd=work,
    )
    status, _, body = parse_http(ok.stdout)
    assert status == 200, ok.stderr
    assert json.loads(body)["path"] == "/secure"
    refused = egressd_sandbox(options, ["curl", "-sS", "-i", "https://elsewhere.test/"], cwd=work)
    assert_refusal(refused, 403, "not_allowlisted", "http_request_denied")


def test_curl_refused_gets_403_with_reason(policy: Path, dns: DnsServer, work: Path) -> None:
    result = egressd_sandbox(_base(policy, dns), ["curl", "-sS", "-i", "http://elsewhere.test/x"], cwd=work)
    assert_refusal(result, 403, "not_allowlisted", "http_request_denied")
    assert b"policy decision" in parse_http(result.stdout)[2]
    assert dns.queries == []


PYTHON_CLIENT = """
    import json, sys, urllib.error, urllib.request
    for url in sys.argv[1:]:
        try:
            with urllib.request.urlopen(url, timeout=20) as response:
                server = json.load(response)["server"]
                print(json.dumps({"url": url, "status": response.status, "server": server}))
        except urllib.error.HTTPError as exc:
            print(json.dumps({"url": url, "status": exc.code, "reason": exc.headers.get("X-Egressd-Reason")}))
"""


def test_python_urllib_allowed_and_refused(
    policy: Path, dns: DnsServer, upstream: EchoHTTPServer, work: Path
) -> None:
    dns.add("up.test", upstream.host)
    allowed, refused = f"http://up.test:{upstream.port}/py", "http://elsewhere.test/py"
    result = egressd_sandbox(_base(policy, dns), [*python_inside(PYTHON_CLIENT), allowed, refused], cwd=work)
    assert result.returncode == 0, result.stderr
    lines = [json.loads(line) for line in result.stdout.splitlines()]
    assert lines[0] == {"url": allowed, "status": 200, "server": "upstream"}
    assert lines[1] == {"url": refused, "status": 403, "reason": "not_allowlisted"}


def test_socks5_inside_the_sandbox(
    policy: Path, dns: DnsServer, upstream: EchoHTTPServer, work: Path
) -> None:
    dns.add("up.test", upstream.host)
    script = f'curl -sS -i --proxy "$EGRESSD_SOCKS_PROXY" http://up.test:{upstream.port}/socks'
    result = egressd_sandbox(_base(policy, dns), ["sh", "-c", script], cwd=work)
    assert parse_http(result.stdout)[0] == 200, result.stderr
    assert upstream.requests[-1]["path"] == "/socks"


def test_child_environment(policy: Path, dns: DnsServer, work: Path) -> None:
    result = egressd_sandbox(_base(policy, dns), ["env"], cwd=work)
    env = dict(line.split("=", 1) for line in result.stdout.decode().splitlines() if "=" in line)
    assert env["HTTPS_PROXY"].startswith("http://egressd:") and env["HTTPS_PROXY"].endswith("@127.0.0.1:3128")
    assert env["HTTP_PROXY"] == env["ALL_PROXY"] == env["https_proxy"] == env["HTTPS_PROXY"]
    assert env["EGRESSD_SOCKS_PROXY"].endswith("@127.0.0.1:1080")
    assert env["NO_PROXY"] == "" and env["EGRESSD_SANDBOX"] == "bubblewrap"


INSPECT_CLIENT = """
    import json, os, sys, urllib.error, urllib.request
    home = sys.argv[1]
    out = {"home": sorted(os.listdir(home)), "ca": os.path.exists(os.path.join(home, "ca")),
           "bundle": os.environ.get("SSL_CERT_FILE")}
    for url in sys.argv[2:]:
        try:
            with urllib.request.urlopen(url, timeout=20) as response:
                out[url] = [response.status, json.load(response)["path"]]
        except urllib.error.HTTPError as exc:
            out[url] = [exc.code, exc.headers.get("X-Egressd-Reason")]
    print(json.dumps(out))
"""


def test_tls_inspection_inside_the_sandbox(
    tmp_path: Path, dns: DnsServer, upstream_tls: EchoHTTPSServer, ca_file: Path, work: Path
) -> None:
    """Path rules on HTTPS work inside (the CA bundle is shown to the child); egressd's home, with
    the CA key, is hidden."""
    dns.add("up.test", upstream_tls.host)
    policy = write_policy(
        tmp_path, "version: 1\nallow: [198.51.100.0/24]\nbuiltin:\n  - {host: up.test, paths: [/v1/]}\n"
    )
    home = work / "egressd-home"  # inside the working directory: visible, unless egressd hides it
    env = sandbox_env(work)
    env["EGRESSD_HOME"] = str(home)
    for var in ("SSL_CERT_FILE", "REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE", "SSL_CERT_DIR"):
        env.pop(var, None)
    urls = [upstream_tls.url_for("up.test", "/v1/item"), upstream_tls.url_for("up.test", "/v2/item")]
    result = egressd_sandbox(
        [*_base(policy, dns), "--upstream-ca", str(ca_file)],
        [*python_inside(INSPECT_CLIENT), str(home), *urls],
        cwd=work,
        env=env,
    )
    assert result.returncode == 0, result.stderr
    seen = json.loads(result.stdout)
    assert seen[urls[0]] == [200, "/v1/item"]
    assert seen[urls[1]] == [403, "builtin_path"]
    assert seen["bundle"] == str(home / "public" / "ca-bundle.pem")
    assert seen["home"] == ["public"] and seen["ca"] is False  # only the bundle is shown inside
    assert list((home / "ca").iterdir())  # while on the host the key is there
    assert [r["path"] for r in upstream_tls.requests] == ["/v1/item"]


# -- bypassing the proxy gets nothing --------------------------------------------------------------
BYPASS = """
    import json, socket, sys
    import dns.message, dns.query
    tcp_host, tcp_port, dns_host, dns_port, http_host, http_port, v6_host = sys.argv[1:8]
    results = {}
    def attempt(name, action):
        try:
            action()
            results[name] = "CONNECTED"
        except Exception as exc:
            results[name] = type(exc).__name__ + ": " + str(exc)
    def tcp(host, port):
        with socket.create_connection((host, int(port)), timeout=5) as s:
            s.sendall(b"hello")
            s.recv(10)
    attempt("raw_tcp", lambda: tcp(tcp_host, tcp_port))
    attempt("raw_tcp_v6", lambda: tcp(v6_host, http_port))
    attempt("raw_http", lambda: tcp(http_host, http_port))
    def udp():
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.settimeout(3)
            s.sendto(b"ping", (tcp_host, int(tcp_port)))
            s.recvfrom(10)
    attempt("udp", udp)
    query = dns.message.make_query("up.test", "A")
    attempt("dns_udp", lambda: dns.query.udp(query, dns_host, port=int(dns_port), timeout=3))
    attempt("dns_tcp", lambda: dns.query.tcp(query, dns_host, port=int(dns_port), timeout=3))
    attempt("resolver", lambda: socket.getaddrinfo("up.test", 80))
    print(json.dumps(results))
"""


def test_a_program_ignoring_the_proxy_gets_nothing_out(
    policy: Path, tcp_echo: TcpEchoServer, upstream: EchoHTTPServer, upstream_v6: EchoHTTPServer, work: Path
) -> None:
    """The confinement alone (--no-capture): with capture, such connections reach the proxy instead
    (tests/e2e/test_sandbox_capture.py)."""
    with DnsServer(UPSTREAM_V4[8]) as outside_dns:
        outside_dns.add("up.test", upstream.host)
        # sanity: from the host, every one of these servers answers
        with socket.create_connection(tcp_echo.address, timeout=5) as s:
            s.sendall(b"x")
            assert s.recv(1) == b"x"
        tcp_echo.connections = tcp_echo.received = 0
        result = egressd_sandbox(
            [
                "--policy",
                str(policy),
                "--nameserver",
                outside_dns.nameserver,
                "--mode",
                "allow",
                "--no-capture",
            ],
            [
                *python_inside(BYPASS),
                tcp_echo.host,
                str(tcp_echo.port),
                outside_dns.host,
                str(outside_dns.port),
                upstream.host,
                str(upstream.port),
                upstream_v6.host,
            ],
            cwd=work,
        )
        assert result.returncode == 0, result.stderr
        results = json.loads(result.stdout)
        assert set(results) == {"raw_tcp", "raw_tcp_v6", "raw_http", "udp", "dns_udp", "dns_tcp", "resolver"}
        for name, outcome in results.items():
            assert outcome != "CONNECTED", name
        assert "Network is unreachable" in results["raw_tcp"]
        assert outside_dns.queries == []
    assert tcp_echo.connections == 0 and tcp_echo.received == 0
    assert upstream.connections == 0 and upstream_v6.connections == 0


def test_curl_ignoring_the_proxy_fails(
    policy: Path, dns: DnsServer, upstream: EchoHTTPServer, work: Path
) -> None:
    dns.add("up.test", upstream.host)
    result = egressd_sandbox(
        [*_base(policy, dns), "--mode", "allow", "--no-capture"],
        ["curl", "-sS", "--noproxy", "*", "--max-time", "10", f"http://{upstream.host}:{upstream.port}/"],
        cwd=work,
    )
    assert result.returncode == 7, result.stderr  # curl: couldn't connect
    assert upstream.connections == 0


# -- narrowing -------------------------------------------------------------------------------------
def test_only_narrows_both_ways(policy: Path, dns: DnsServer, upstream: EchoHTTPServer, work: Path) -> None:
    dns.add("up.test", upstream.host)
    dns.add("other.test", upstream.host)
    urls = [
        f"http://up.test:{upstream.port}/only",
        f"http://other.test:{upstream.port}/only",
        "http://outside.test/",
    ]
    result = egressd_sandbox(
        [*_base(policy, dns), "--only", "up.test", "--only", "outside.test"], _curls(urls), cwd=work
    )
    assert _statuses(result) == [
        (200, None),
        (403, "profile"),  # the policy allows other.test; --only does not list it
        (403, "not_allowlisted"),  # --only lists outside.test; the policy refuses it
    ]
    assert [r["path"] for r in upstream.requests] == ["/only"]


def _statuses(result: subprocess.CompletedProcess[bytes]) -> list[tuple[int, str | None]]:
    out = []
    for part in result.stdout.split(b"\n====\n"):
        code, headers, _ = parse_http(part.strip(b"\n"))
        out.append((code, headers.get("x-egressd-reason")))
    return out


def _curls(urls: Sequence[str]) -> list[str]:
    return ["sh", "-c", "; echo; echo ====; ".join(f"curl -sS -i {url}" for url in urls)]


def test_profile_narrows_and_combines_with_only(
    tmp_path: Path, dns: DnsServer, upstream: EchoHTTPServer, work: Path
) -> None:
    policy = write_policy(
        tmp_path,
        "version: 1\nallow: [up.test, other.test, third.test, 198.51.100.0/24]\n"
        "profiles:\n  agent: {allow: [up.test, other.test, 198.51.100.0/24]}\n",
    )
    for name in ("up.test", "other.test", "third.test"):
        dns.add(name, upstream.host)
    urls = [f"http://{host}:{upstream.port}/p" for host in ("up.test", "other.test", "third.test")]
    profile_only = egressd_sandbox([*_base(policy, dns), "--profile", "agent"], _curls(urls), cwd=work)
    # third.test: the policy allows it, profile agent does not
    assert _statuses(profile_only) == [(200, None), (200, None), (403, "profile")]
    both = egressd_sandbox(
        [*_base(policy, dns), "--profile", "agent", "--only", "other.test", "--only", "third.test"],
        _curls(urls),
        cwd=work,
    )
    # only other.test is in the policy AND the profile AND --only
    assert _statuses(both) == [(403, "profile"), (200, None), (403, "profile")]


def test_refusal_hints_name_the_sandbox_and_the_profile(
    tmp_path: Path, dns: DnsServer, upstream: EchoHTTPServer, work: Path
) -> None:
    """What the child reads and what the person's stderr says name `egressd sandbox` (the command
    that runs it), and for a host the profile narrows out, the line to add to that profile."""
    policy = write_policy(
        tmp_path,
        "version: 1\nallow: [up.test, third.test, 198.51.100.0/24]\n"
        "profiles:\n  agent:\n    allow:\n      - up.test\n",
    )
    dns.add("third.test", upstream.host)
    bare = egressd_sandbox(_base(policy, dns), ["curl", "-sS", "http://elsewhere.test/"], cwd=work)
    hint = "egressd sandbox --allow elsewhere.test -- <command>"
    assert f"To allow it, a person can run: {hint}" in bare.stdout.decode(), bare.stdout
    assert "egressd exec" not in bare.stdout.decode() + bare.stderr.decode()
    url = f"http://third.test:{upstream.port}/p"
    narrowed = egressd_sandbox([*_base(policy, dns), "--profile", "agent"], ["curl", "-sS", url], cwd=work)
    line = f"the line '- third.test:{upstream.port}' under profiles.agent.allow in {policy}"
    assert f"To allow it, a person can add {line}" in narrowed.stdout.decode(), narrowed.stdout
    assert f"(profile) - add {line}" in narrowed.stderr.decode(), narrowed.stderr
    assert "--allow" not in narrowed.stdout.decode()
    assert upstream.requests == []


# -- loopback: the host's through the proxy, the sandbox's own directly ------------------------------
OWN_SERVER = """
    import http.server, subprocess, sys, threading
    port = int(sys.argv[1])
    class Own(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            body = b"own loopback"
            self.send_response(200); self.send_header("Content-Length", str(len(body))); self.end_headers()
            self.wfile.write(body)
        def log_message(self, *args):
            pass
    server = http.server.ThreadingHTTPServer(("127.0.0.1", port), Own)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{port}/"
    def curl(*args):
        return subprocess.run(["curl", "-sS", *args], capture_output=True).stdout.decode()
    through_proxy = curl(url)
    by_name = curl(f"http://localhost:{port}/")
    own = curl("--noproxy", "127.0.0.1", url)
    print(through_proxy); print("===="); print(by_name); print("===="); print(own)
"""


def test_host_loopback_through_the_proxy_own_loopback_directly(policy: Path, work: Path) -> None:
    with EchoHTTPServer("127.0.0.1", name="host-loopback") as host_server:
        # the child runs its own server on the SAME port number, on the sandbox's own loopback
        result = egressd_sandbox(
            ["--policy", str(policy), "--allow-loopback-port", str(host_server.port)],
            [*python_inside(OWN_SERVER), str(host_server.port)],
            cwd=work,
        )
        assert result.returncode == 0, result.stderr
        through_proxy, by_name, own = result.stdout.decode().split("====")
        assert json.loads(through_proxy)["server"] == "host-loopback"
        assert json.loads(by_name)["server"] == "host-loopback"
        assert own.strip() == "own loopback"
        assert host_server.connections == 2


def test_host_loopback_refused_when_the_policy_says_so(tmp_path: Path, work: Path) -> None:
    policy = write_policy(tmp_path, "version: 1\nloopback: {allow: false}\n")
    with EchoHTTPServer("127.0.0.1", name="host-loopback") as host_server:
        result = egressd_sandbox(
            ["--policy", str(policy)],
            ["curl", "-sS", "-i", f"http://127.0.0.1:{host_server.port}/"],
            cwd=work,
        )
        assert_refusal(result, 403, "loopback_disabled", "http_request_denied")
        raw = egressd_sandbox(
            ["--policy", str(policy)],
            ["curl", "-sS", "--noproxy", "*", f"http://127.0.0.1:{host_server.port}/"],
            cwd=work,
        )
        assert raw.returncode == 7  # the sandbox's own loopback has nothing on that port
        assert host_server.connections == 0


# -- file system -----------------------------------------------------------------------------------
FS_CHECK = """
    import json, os, sys
    def can_write(path):
        try:
            with open(path, "w") as f:
                f.write("x")
            return True
        except OSError as exc:
            return exc.strerror
    host_tmp_marker, rw_dir, ro_dir = sys.argv[1:4]
    print(json.dumps({
        "cwd": os.getcwd(),
        "cwd_write": can_write("written-in-cwd"),
        "usr_write": can_write("/usr/egressd-test-file"),
        "home_write": can_write(os.path.expanduser("~/egressd-test-file")),
        "tmp_write": can_write("/tmp/inside"),
        "host_tmp_visible": os.path.exists(host_tmp_marker),
        "run": sorted(os.listdir("/run")),
        "rw_write": can_write(os.path.join(rw_dir, "f")),
        "ro_write": can_write(os.path.join(ro_dir, "f")),
        "ro_listing": sorted(os.listdir(ro_dir)),
    }))
"""


def test_filesystem_layout(tmp_path: Path, policy: Path, work: Path) -> None:
    rw_dir, ro_dir = tmp_path / "rw", work / "protected"
    rw_dir.mkdir()
    ro_dir.mkdir()
    (ro_dir / "keep").write_text("k")
    host_marker = Path("/tmp") / f"egressd-host-marker-{os.getpid()}"
    host_marker.write_text("host")
    try:
        result = egressd_sandbox(
            ["--policy", str(policy), "--rw", str(rw_dir), "--ro", str(ro_dir)],
            [*python_inside(FS_CHECK), str(host_marker), str(rw_dir), str(ro_dir)],
            cwd=work,
        )
    finally:
        host_marker.unlink()
    assert result.returncode == 0, result.stderr
    seen = json.loads(result.stdout)
    assert seen["cwd"] == str(work)
    assert seen["cwd_write"] is True and (work / "written-in-cwd").read_text() == "x"
    assert seen["usr_write"] == "Read-only file system"
    assert seen["home_write"] in ("Read-only file system", "Permission denied")
    assert seen["tmp_write"] is True and not Path("/tmp/inside").exists()  # private /tmp
    assert seen["host_tmp_visible"] is False
    assert seen["run"] == []  # the host's daemon sockets are hidden
    assert seen["rw_write"] is True and (rw_dir / "f").exists()
    assert seen["ro_write"] == "Read-only file system" and seen["ro_listing"] == ["keep"]


def test_missing_path_option_is_refused(policy: Path, work: Path) -> None:
    result = egressd_sandbox(
        ["--policy", str(policy), "--rw", "/nonexistent/dir"], ["touch", "ran"], cwd=work
    )
    assert result.returncode == 2
    assert b"--rw /nonexistent/dir: no such file or directory" in result.stderr
    assert not (work / "ran").exists()


# -- stdio, exit status, signals, nothing left running ------------------------------------------
def test_stdio_and_exit_status_pass_through(policy: Path, work: Path) -> None:
    result = egressd_sandbox(
        ["--policy", str(policy)],
        ["sh", "-c", "cat; echo to-stderr >&2; exit 3"],
        cwd=work,
        input=b'{"jsonrpc": "2.0", "id": 1}\n',
    )
    assert result.returncode == 3
    assert result.stdout == b'{"jsonrpc": "2.0", "id": 1}\n'  # egressd writes nothing on stdout
    assert b"to-stderr" in result.stderr


def test_command_not_found(policy: Path, work: Path) -> None:
    result = egressd_sandbox(["--policy", str(policy)], ["no-such-command-egressd"], cwd=work)
    assert result.returncode == 127
    assert b"no-such-command-egressd: command not found" in result.stderr


def test_child_killed_by_signal_kills_egressd_the_same_way(policy: Path, work: Path) -> None:
    result = egressd_sandbox(["--policy", str(policy)], ["sh", "-c", "kill -TERM $$"], cwd=work)
    assert result.returncode == -signal.SIGTERM


SIGNAL_CHILD = """
    import signal, sys, time
    got = []
    said = 0
    def handler(signo, frame):  # only noted here: print is not reentrant, the loop says each
        got.append(signal.Signals(signo).name)
    def say():  # each signal is said as it arrives: the test sends the next after it
        global said
        while said < len(got):
            print(got[said], flush=True)
            said += 1
    for signo in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1, signal.SIGHUP):
        signal.signal(signo, handler)
    print("ready", flush=True)
    deadline = time.monotonic() + 30
    while "SIGTERM" not in got and time.monotonic() < deadline:
        say()
        time.sleep(0.05)
    time.sleep(0.3)
    say()
    print(",".join(got), flush=True)
    sys.exit(0 if "SIGTERM" in got else 1)
"""


def test_signals_reach_the_child_once(policy: Path, work: Path) -> None:
    """kill(2) on egressd, and a "Ctrl-C" to its whole process group, each arrive exactly once."""
    proc = subprocess.Popen(
        [*EGRESSD, "sandbox", "--policy", str(policy), "--", *python_inside(SIGNAL_CHILD)],
        cwd=work,
        env=sandbox_env(work),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,  # its own process group, like a terminal job
    )
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline() == b"ready\n"
        # each signal is sent once the one before has arrived (signals pending together would be
        # delivered in number order, not in the order sent)
        os.kill(proc.pid, signal.SIGUSR1)
        assert proc.stdout.readline() == b"SIGUSR1\n"
        os.killpg(proc.pid, signal.SIGINT)  # what the terminal does on Ctrl-C
        assert proc.stdout.readline() == b"SIGINT\n"
        os.kill(proc.pid, signal.SIGHUP)
        assert proc.stdout.readline() == b"SIGHUP\n"
        os.kill(proc.pid, signal.SIGTERM)
        out, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == 0, err
    # after SIGTERM and a pause, the child lists every signal it got: each exactly once
    assert out.decode().split() == ["SIGTERM", "SIGUSR1,SIGINT,SIGHUP,SIGTERM"]


def test_ctrl_c_on_a_terminal_reaches_the_child_once(policy: Path, work: Path) -> None:
    """On a real terminal: ^C makes the tty send SIGINT to egressd's group; the child (in its own
    session inside the sandbox, so the tty cannot reach it) gets it from egressd, exactly once."""
    master, slave = os.openpty()

    def controlling_tty() -> None:
        os.setsid()
        fcntl.ioctl(slave, termios.TIOCSCTTY, 0)

    proc = subprocess.Popen(
        [*EGRESSD, "sandbox", "--policy", str(policy), "--", *python_inside(SIGNAL_CHILD)],
        cwd=work,
        env=sandbox_env(work),
        stdin=slave,
        stdout=slave,
        stderr=subprocess.DEVNULL,
        preexec_fn=controlling_tty,  # noqa: PLW1509 - a controlling terminal needs it
    )
    # the slave stays open here until the end: with every slave closed, Linux answers a read of the
    # master EIO and may drop what the child wrote last
    output = b""

    def read_until(text: bytes) -> None:
        nonlocal output
        deadline = time.monotonic() + 30
        while text not in output:
            assert time.monotonic() < deadline, output
            ready, _, _ = select.select([master], [], [], 0.5)
            if ready:
                output += os.read(master, 4096)

    try:
        read_until(b"ready")
        os.write(master, b"\x03")  # ^C
        read_until(b"SIGINT")  # the child says it, then SIGTERM follows (not pending beside it)
        os.kill(proc.pid, signal.SIGTERM)
        read_until(b"SIGINT,SIGTERM")
        assert proc.wait(30) == 0
    finally:
        proc.kill()
        proc.wait()
        os.close(master)
        os.close(slave)
    last = output.split(b"ready")[1].replace(b"^C", b"").strip().splitlines()[-1]  # the tty echoes ^C
    assert last == b"SIGINT,SIGTERM"


def _processes_with(marker: str) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if marker.encode() in (entry / "cmdline").read_bytes():
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


def _wait_until(condition: Callable[[], bool], timeout: float = 5) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_nothing_left_running(policy: Path, work: Path) -> None:
    marker = f"{4000 + os.getpid() % 1000}.5"
    result = egressd_sandbox(
        ["--policy", str(policy)],
        ["sh", "-c", f"setsid sleep {marker} >/dev/null 2>&1 & echo started"],
        cwd=work,
    )
    assert result.returncode == 0 and result.stdout == b"started\n", result.stderr
    _wait_until(lambda: not _processes_with(f"sleep\0{marker}"))
    assert list((work / ".t").iterdir()) == []  # the relay's socket directory is gone


def test_egressd_killed_stops_the_child(policy: Path, work: Path) -> None:
    """If egressd dies (SIGKILL), the child loses its way out; the launcher stops it."""
    marker = f"{5000 + os.getpid() % 1000}.5"
    proc = subprocess.Popen(
        [*EGRESSD, "sandbox", "--policy", str(policy), "--", "sh", "-c", f"echo ready; exec sleep {marker}"],
        cwd=work,
        env=sandbox_env(work),
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline() == b"ready\n"
        _wait_until(lambda: bool(_processes_with(f"sleep\0{marker}")))
    finally:
        proc.kill()
        proc.wait()
    _wait_until(lambda: not _processes_with(f"sleep\0{marker}"), timeout=15)


# -- the socket and the credentials are the child's alone -----------------------------------------
def _proxy_request(connect: socket.socket, target: str) -> bytes:
    connect.sendall(f"GET {target} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode())
    data = b""
    while chunk := connect.recv(65536):
        data += chunk
    return data


PROXY_WITHOUT_TOKEN = """
    import json, os, socket, sys
    target = sys.argv[1]
    with socket.create_connection(("127.0.0.1", 3128), timeout=20) as s:
        s.sendall(f"GET {target} HTTP/1.1\\r\\nHost: x\\r\\nConnection: close\\r\\n\\r\\n".encode())
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    print(json.dumps({"answer": data.split(b"\\r\\n", 1)[0].decode(), "proxy": os.environ["HTTP_PROXY"]}))
"""


def test_the_proxy_inside_needs_the_childs_token_and_leaves_no_socket_on_the_host(
    policy: Path, dns: DnsServer, upstream: EchoHTTPServer, work: Path, shared_tmpdir: Path
) -> None:
    """The proxy's listener lives in the sandbox's own network namespace (the launcher binds it
    there and hands it to egressd): nothing on the host's file system leads to it, and a request
    without the child's token gets 407."""
    dns.add("up.test", upstream.host)
    env = dict(os.environ, TMPDIR=str(shared_tmpdir))
    target = f"http://up.test:{upstream.port}/stolen"
    proc = subprocess.Popen(
        [*EGRESSD, "sandbox", *_base(policy, dns), "--", "sh", "-c", 'echo ready; read line; "$@"', "sh",
         *python_inside(PROXY_WITHOUT_TOKEN), target],
        cwd=work,
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )  # fmt: skip
    try:
        assert proc.stdout is not None and proc.stdin is not None
        assert proc.stdout.readline() == b"ready\n"
        assert [p for p in shared_tmpdir.rglob("*") if p.is_socket()] == []
        out, err = proc.communicate(b"go\n", timeout=60)
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == 0, err
    seen = json.loads(out)
    assert seen["answer"].startswith("HTTP/1.1 407")
    assert upstream.connections == 0
    token = seen["proxy"].split(":")[2].split("@")[0]
    assert token and token not in " ".join(os.environ.values())  # issued for this child only


def test_the_proxy_tcp_port_needs_the_childs_token(
    policy: Path, dns: DnsServer, upstream: EchoHTTPServer, work: Path
) -> None:
    """The host-side proxy port (127.0.0.1, not the sandbox's) refuses a request without the token."""
    dns.add("up.test", upstream.host)
    listen_port = free_port()
    proc = subprocess.Popen(
        [
            *EGRESSD,
            "sandbox",
            *_base(policy, dns),
            "--listen",
            f"127.0.0.1:{listen_port}",
            "--",
            "sh",
            "-c",
            "echo ready; cat >/dev/null",
        ],
        cwd=work,
        env=sandbox_env(work),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        assert proc.stdout is not None and proc.stdin is not None
        assert proc.stdout.readline() == b"ready\n"
        with socket.create_connection(("127.0.0.1", listen_port), timeout=10) as s:
            status, headers, _ = parse_http(_proxy_request(s, f"http://up.test:{upstream.port}/stolen"))
        assert status == 407 and headers["x-egressd-reason"] == "proxy_auth_required"
        assert upstream.connections == 0
        proc.stdin.close()
        assert proc.wait(30) == 0
    finally:
        proc.kill()
        proc.wait()


# -- never unconfined ------------------------------------------------------------------------------
@pytest.mark.parametrize("how", ["option", "env", "path"])
def test_missing_bubblewrap_stops_with_the_fix(policy: Path, work: Path, how: str) -> None:
    env = sandbox_env(work)
    options = ["--policy", str(policy)]
    if how == "option":
        options += ["--bwrap", "/nonexistent/bwrap"]
    elif how == "env":
        env["EGRESSD_BWRAP"] = "/nonexistent/bwrap"
    else:
        env["PATH"] = str(work)  # no bwrap there
    result = egressd_sandbox(options, [PY, "-c", "open('ran', 'w')"], cwd=work, env=env)
    assert result.returncode == 2
    text = result.stderr.decode()
    assert "apt-get install bubblewrap" in text and "never runs the command unconfined" in text
    assert not (work / "ran").exists()


def test_user_namespaces_refused_stops_with_the_fix(policy: Path, work: Path) -> None:
    """A real refusal: inside a user namespace whose max_user_namespaces is 0."""
    script = 'echo 0 > /proc/sys/user/max_user_namespaces || exit 99; exec "$@"'
    result = subprocess.run(
        ["unshare", "--user", "--map-root-user", "sh", "-c", script, "sh",
         *EGRESSD, "sandbox", "--policy", str(policy), "--", PY, "-c", "open('ran', 'w')"],
        cwd=work,
        env=sandbox_env(work),
        capture_output=True,
        timeout=60,
    )  # fmt: skip
    assert result.returncode == 2, result.stderr
    text = result.stderr.decode()
    assert "max_user_namespaces" in text and "kernel.apparmor_restrict_unprivileged_userns=0" in text
    assert "never runs the command unconfined" in text
    assert not (work / "ran").exists()


def test_bubblewrap_failing_for_another_reason(policy: Path, work: Path) -> None:
    fake = work / "fake-bwrap"
    fake.write_text("#!/bin/sh\necho 'bwrap: Unknown option --frobnicate' >&2\nexit 1\n")
    fake.chmod(0o755)
    result = egressd_sandbox(["--policy", str(policy), "--bwrap", str(fake)], ["touch", "ran"], cwd=work)
    assert result.returncode == 2
    assert b"bubblewrap cannot create a sandbox here (bwrap: Unknown option --frobnicate)" in result.stderr
    assert not (work / "ran").exists()


def test_sandbox_accepts_every_exec_option() -> None:
    import click

    from egressd.cli import cli

    ctx = click.Context(cli)
    exec_command, sandbox_command = cli.get_command(ctx, "exec"), cli.get_command(ctx, "sandbox")
    assert exec_command is not None and sandbox_command is not None
    exec_options = {p.name for p in exec_command.params}
    sandbox_options = {p.name for p in sandbox_command.params}
    # exec's own: the credential-free listener (in the sandbox every connection is the child's
    # already: the launcher's listeners) and --attach/--pid (a child under a running egressd, which
    # starts no sandbox)
    assert exec_options - {"credentials_listener", "attach", "pid"} <= sandbox_options
    assert sandbox_options - exec_options == {
        "rw", "ro", "only", "bwrap_path", "hide", "show", "rw_home", "env_clear", "pass_env",
        "loopback_ports", "cache", "explain", "serve", "allow_project_hooks",
    }  # fmt: skip


EXIT_WITH_CONNECTIONS_OPEN = """
    import os, socket
    waiting = socket.create_connection(("127.0.0.1", 3128))
    waiting.sendall(b"CONNECT 127.0.0.1:9 HTTP/1.1\\r\\n\\r\\n")
    idle = socket.create_connection(("127.0.0.1", 3128))
    os._exit(0)
"""


def test_no_traceback_when_the_child_exits_with_connections_open(work: Path) -> None:
    for _ in range(6):
        result = egressd_sandbox([], python_inside(EXIT_WITH_CONNECTIONS_OPEN), cwd=work)
        assert result.returncode == 0, result.stderr
        assert b"Traceback" not in result.stderr and b"Error" not in result.stderr, result.stderr
