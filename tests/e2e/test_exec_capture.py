"""`egressd exec` gives the child a network namespace of its own: clients that ignore the proxy
variables are captured and decided like any other, and nothing else of the child changes.

Through the real command, with real clients that never use a proxy (urllib3's PoolManager,
aiohttp's default session, node's fetch and https.get, `curl -x ""`): an allowed host answers 200,
a literal the policy refuses gets egressd's 403 with its reason (HTTP) or the refusal page inside
TLS (`refusal_pages: tls`), a refused name has no address; the audit, the stderr lines and the exit
summary name the program that ignored the variables. The child's own loopback servers work, the
host's loopback follows the loopback rules, exit status and signals pass through; --no-capture and
a kernel that refuses user namespaces say so on stderr, and the child then goes out directly.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.support import direct_clients, stuck
from tests.support.audit_log import audit_records
from tests.support.capture_clients import build_go_client, java_trusting
from tests.support.control import wait_for
from tests.support.dns_server import DnsServer
from tests.support.egressd_cli import EGRESSD, egressd_exec, write_policy
from tests.support.netns import UPSTREAM_V4
from tests.support.upstreams import EchoHTTPServer, EchoHTTPSServer

HERE = Path(__file__).resolve().parents[1]
NO_USERNS = str(HERE / "support" / "no_userns.py")
TIMEOUT = 180
POLICY = "version: 1\nmode: enforce\nprivate: {allow: true}\nallow: [up.test, other.test]\n"


@dataclass
class Sites:
    """up.test (plain HTTP) and other.test (HTTPS) allowed; an address no name led to refused; a
    name the policy refuses."""

    policy: Path
    dns: DnsServer
    audit: Path
    upstream: EchoHTTPServer
    unlisted: EchoHTTPServer
    urls: tuple[str, str, str, str]

    def exec(self, command: list[str], *options: str, env: dict[str, str] | None = None) -> Any:
        base = ["--policy", str(self.policy), "--nameserver", self.dns.nameserver, "--audit", str(self.audit)]
        return egressd_exec([*base, *options], command, env=env, timeout=TIMEOUT)


@pytest.fixture
def unlisted() -> Any:
    with EchoHTTPServer(UPSTREAM_V4[6], name="unlisted") as server:
        yield server


@pytest.fixture
def sites(
    tmp_path: Path,
    dns: DnsServer,
    upstream: EchoHTTPServer,
    upstream_tls: EchoHTTPSServer,
    unlisted: EchoHTTPServer,
) -> Sites:
    dns.add("elsewhere.test", unlisted.host)
    refused = f"http://{unlisted.host}:{unlisted.port}/refused-literal"
    urls = (*direct_clients.allowed_urls(dns, upstream, upstream_tls), refused)
    urls += (f"http://elsewhere.test:{unlisted.port}/refused-name",)
    policy = write_policy(tmp_path, POLICY)
    return Sites(policy, dns, tmp_path / "audit.jsonl", upstream, unlisted, urls)


def last_json(result: subprocess.CompletedProcess[bytes]) -> dict[str, Any]:
    assert result.returncode == 0, result.stderr.decode(errors="replace")
    return json.loads(result.stdout.decode().strip().splitlines()[-1])


@pytest.mark.parametrize("client", direct_clients.CLIENTS)
def test_a_client_that_ignores_the_proxy_variables_is_captured_and_decided(
    sites: Sites, ca_file: Path, client: str
) -> None:
    command = direct_clients.command(client, ca_file, list(sites.urls))
    result = sites.exec(["env", "-u", "NODE_USE_ENV_PROXY", *command])
    seen = last_json(result)
    plain, tls, literal, name = sites.urls
    for got in direct_clients.results(client, seen, plain):
        assert got == [200, "/plain"], seen
    for got in direct_clients.results(client, seen, tls):
        assert got == [200, "/tls"], seen
    for got in direct_clients.results(client, seen, literal):
        assert got == [403, "not_allowlisted"], seen  # egressd's refusal, in HTTP: with its reason
    for got in direct_clients.results(client, seen, name):
        assert got[0] == "error", seen  # a refused name has no address in the namespace
    assert sites.unlisted.connections == 0
    assert sorted({r["path"] for r in sites.upstream.requests}) == ["/plain"]
    records = [r for r in audit_records(sites.audit) if r.get("event") == "decision"]
    refused = [r for r in records if r.get("host") == sites.unlisted.host]
    assert refused and all(r["decision"] == "deny" and r.get("captured") is True for r in refused)
    program = direct_clients.PROGRAMS[client]
    assert all(os.path.basename(r.get("exe") or "").startswith(program) for r in refused), refused
    assert any(r.get("host") == "up.test" and r.get("captured") and r["decision"] == "allow" for r in records)
    assert any(r.get("stage") == "dns" and r.get("host") == "elsewhere.test" for r in records)
    stderr = result.stderr.decode()
    assert "ignores the proxy variables: its connections are captured" in stderr, stderr
    summary = stderr.strip().splitlines()
    captured = next(line for line in summary if line.startswith("egressd: captured "))
    assert "of programs that ignore the proxy variables" in captured and f"{program}" in captured, stderr
    assert "refused elsewhere.test (not_allowlisted)" in stderr  # the name's refusal, told on stderr


@pytest.fixture(scope="module")
def go_client(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_go_client(tmp_path_factory)


@pytest.mark.parametrize("client", ["java", "go"])
def test_java_and_go_clients_that_ignore_the_proxy_are_captured(
    sites: Sites, ca_file: Path, tmp_path: Path, go_client: Path, client: str
) -> None:
    """Java's HttpClient without egressd's JAVA_TOOL_OPTIONS, and a Go transport with `Proxy: nil`."""
    if client == "java":
        command = ["env", "-u", "JAVA_TOOL_OPTIONS", *java_trusting(tmp_path, ca_file)]
    else:
        command = [str(go_client), str(ca_file)]
    seen = last_json(sites.exec([*command, *sites.urls]))
    plain, tls, literal, name = sites.urls
    assert seen[plain] == [200, "/plain"] and seen[tls] == [200, "/tls"], seen
    assert seen[literal][0] == 403 and seen[name][0] == "error", seen
    assert sites.unlisted.connections == 0
    records = [r for r in audit_records(sites.audit) if r.get("event") == "decision"]
    refused = [r for r in records if r.get("host") == sites.unlisted.host]
    assert refused and all(r["decision"] == "deny" and r.get("captured") for r in refused), refused


@pytest.mark.parametrize("front", [["mcp", "run"], ["acp"]], ids=["mcp-run", "acp"])
def test_mcp_and_acp_children_are_captured_too(sites: Sites, ca_file: Path, front: list[str]) -> None:
    """A server or agent started by `egressd mcp run` or `egressd acp` (model-driven code) that
    ignores the proxy variables is captured as under exec: its output is not JSON-RPC, and passes
    through the relay as it is."""
    command = direct_clients.command("node", ca_file, list(sites.urls[2:]))
    base = ["--policy", str(sites.policy), "--nameserver", sites.dns.nameserver, "--audit", str(sites.audit)]
    result = subprocess.run(
        [*EGRESSD, *front, *base, "--", "env", "-u", "NODE_USE_ENV_PROXY", *command],
        capture_output=True,
        timeout=TIMEOUT,
    )
    seen = last_json(result)
    literal, name = sites.urls[2:]
    assert direct_clients.results("node", seen, literal) == [[403, "not_allowlisted"]] * 2, seen
    assert all(got[0] == "error" for got in direct_clients.results("node", seen, name)), seen
    assert sites.unlisted.connections == 0
    records = [r for r in audit_records(sites.audit) if r.get("event") == "decision"]
    refused = [r for r in records if r.get("host") == sites.unlisted.host]
    assert refused and all(r["decision"] == "deny" and r.get("captured") for r in refused), refused
    assert "node" in result.stderr.decode() and "ignore the proxy variables" in result.stderr.decode()


def test_a_program_whose_captured_connections_are_all_allowed_is_named(sites: Sites) -> None:
    """An allowed tunnel is recorded once, when its upstream connection opens: a program that
    ignores the proxy variables and is never refused is named on stderr and in the summary too."""
    curl = f'curl -sS -x "" -o /dev/null -w "%{{http_code}} " {sites.urls[0]}'
    result = sites.exec(["sh", "-c", f"{curl} && {curl}"])  # two processes, two connections
    assert result.stdout == b"200 200 ", result.stderr
    stderr = result.stderr.decode()
    assert stderr.count("egressd: curl (pid ") == 1, stderr  # told once
    assert "egressd: captured 2 connections of programs that ignore the proxy variables" in stderr
    assert stderr.rstrip().endswith(": curl (2)"), stderr
    allowed = [r for r in audit_records(sites.audit) if r.get("event") == "decision"]
    assert allowed and all(r["decision"] == "allow" and r.get("captured") for r in allowed), allowed


def test_clients_that_use_the_proxy_variables_are_not_called_captured(sites: Sites) -> None:
    result = sites.exec(["curl", "-sS", "-o", "/dev/null", "-w", "%{http_code}", sites.urls[0]])
    assert result.stdout == b"200", result.stderr
    records = [r for r in audit_records(sites.audit) if r.get("event") == "decision"]
    assert records and not any(r.get("captured") for r in records)
    assert b"ignore the proxy variables" not in result.stderr


def test_a_refused_https_literal_gets_the_refusal_page_inside_tls(
    tmp_path: Path, dns: DnsServer, unlisted: EchoHTTPServer
) -> None:
    """refusal_pages: tls: a captured HTTPS connection to port 443 is answered by egressd as the
    refused host (the child trusts egressd's CA through its environment), with the refusal."""
    policy = write_policy(tmp_path, POLICY + "refusal_pages: tls\n")
    url = f"https://{unlisted.host}/page"
    result = egressd_exec(
        ["--policy", str(policy), "--nameserver", dns.nameserver],
        ["curl", "-sS", "-x", "", "-D", "-", "--max-time", "60", url],
        timeout=TIMEOUT,
    )
    head, _, body = result.stdout.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 403"), result.stderr.decode()
    assert b"X-Egressd-Reason: not_allowlisted" in head
    assert unlisted.host.encode() in body and b"egressd" in body
    assert unlisted.connections == 0


def test_watch_names_the_program_whose_connection_was_captured(sites: Sites, tmp_path: Path) -> None:
    """`egressd watch` marks a captured connection's decision and names its program: the child
    asks with `curl -x ""` until the test has seen the line."""
    stop = tmp_path / "stop"
    curl = f'curl -s -o /dev/null -x "" --max-time 20 {sites.urls[2]}'
    loop = f"until [ -e {stop} ]; do {curl}; sleep 0.5; done"
    base = ["--policy", str(sites.policy), "--nameserver", sites.dns.nameserver]
    child = subprocess.Popen([*EGRESSD, "exec", *base, "--", "sh", "-c", loop], stderr=subprocess.DEVNULL)
    watch = subprocess.Popen(
        [*EGRESSD, "watch", "--pid", str(child.pid)], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL
    )
    assert watch.stdout is not None
    try:
        out = b""

        def seen() -> bool:
            nonlocal out
            ready, _, _ = select.select([watch.stdout], [], [], 1)
            if ready:
                out += os.read(watch.stdout.fileno(), 65536)  # type: ignore[union-attr]
            return b"captured" in out

        wait_for(seen, timeout=120, what="a captured decision on the watch")
    finally:
        stop.touch()
        watch.terminate()
        watch.wait(10)
        child.wait(60)
    line = next(text for text in out.decode().splitlines() if "captured" in text)
    assert sites.unlisted.host in line and "not_allowlisted" in line, line
    assert "/curl pid " in line and "ignored the proxy variables" in line, line
    assert sites.unlisted.connections == 0


# -- loopback: the child's own, and the host's --------------------------------------------------------
LOOPBACK = """
    import http.server, json, sys, threading, urllib.request
    class Own(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            body = json.dumps({"path": self.path, "server": "own"}).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
        def log_message(self, *args):
            pass
    own = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Own)
    while own.server_address[1] == int(sys.argv[1]):  # its own port is another namespace's: can match
        own.server_close()
        own = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Own)
    threading.Thread(target=own.serve_forever, daemon=True).start()
    direct = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    by_env = urllib.request.build_opener()  # the proxy variables, and NO_PROXY
    def ask(opener, url):
        try:
            with opener.open(url, timeout=60) as response:
                return [response.status, json.loads(response.read())["path"]]
        except urllib.error.HTTPError as exc:
            return [exc.code, exc.headers.get("X-Egressd-Reason")]
        except OSError as exc:
            return ["error", type(exc).__name__]
    mine = f"http://127.0.0.1:{own.server_address[1]}"
    host = f"http://127.0.0.1:{sys.argv[1]}"
    print(json.dumps({
        "own direct": ask(direct, mine + "/own-direct"), "own by env": ask(by_env, mine + "/own-env"),
        "host direct": ask(direct, host + "/host-direct"), "host by env": ask(by_env, host + "/host-env"),
    }))
"""


@pytest.mark.parametrize("named", [True, False], ids=["host-port-allowed", "host-port-not-named"])
def test_loopback_is_the_childs_own_first_then_the_hosts_by_the_loopback_rules(
    tmp_path: Path, dns: DnsServer, named: bool
) -> None:
    """A server the child starts on its loopback is reached where it listens, directly and through
    a client that reads the proxy variables (NO_PROXY names loopback); a port nothing of the
    child's listens on is the host's, through the proxy, as the policy's loopback rules say."""
    with EchoHTTPServer("127.0.0.1", name="host-service") as host:
        ports = host.port if named else 1
        policy = write_policy(tmp_path, f"version: 1\nloopback: {{allow: true, ports: [{ports}]}}\n")
        audit = tmp_path / "audit.jsonl"
        result = egressd_exec(
            ["--policy", str(policy), "--nameserver", dns.nameserver, "--audit", str(audit)],
            [sys.executable, "-c", textwrap.dedent(LOOPBACK), str(host.port)],
            timeout=TIMEOUT,
        )
        seen = last_json(result)
    assert seen["own direct"] == [200, "/own-direct"] and seen["own by env"] == [200, "/own-env"], seen
    if named:
        assert seen["host direct"] == [200, "/host-direct"] and seen["host by env"] == [200, "/host-env"]
        assert sorted(r["path"] for r in host.requests) == ["/host-direct", "/host-env"]
    else:
        assert seen["host direct"] == seen["host by env"] == [403, "loopback_port"], seen
        assert host.connections == 0
    records = audit_records(audit)
    decided = [r for r in records if r.get("host") == "127.0.0.1" and r.get("event") == "decision"]
    assert decided and all(r.get("captured") for r in decided if r.get("stage") == "connect")
    assert all(r.get("port") == host.port for r in decided)  # the child's own server: never decided


OWN_ON_THE_HOSTS_PORT = """
    import hashlib, json, os, socket, sys, threading
    port = int(sys.argv[1])
    server = socket.create_server(("127.0.0.1", port))  # the host's port number, in the child's own loopback
    def serve():
        conn, _ = server.accept()
        conn.sendall(b"hello\\n")  # a server that speaks first
        got = hashlib.sha256()
        size = 0
        while chunk := conn.recv(65536):  # to the client's half-close
            got.update(chunk)
            size += len(chunk)
        conn.sendall(f"{size} {got.hexdigest()}".encode())
        conn.close()
    threading.Thread(target=serve, daemon=True).start()
    payload = os.urandom(8 << 20)
    client = socket.create_connection(("127.0.0.1", port), timeout=60)
    greeting = b""
    while not greeting.endswith(b"\\n"):
        greeting += client.recv(1)
    client.sendall(payload)
    client.shutdown(socket.SHUT_WR)
    answer = b""
    while chunk := client.recv(65536):
        answer += chunk
    print(json.dumps({"greeting": greeting.decode(), "answer": answer.decode(),
                      "sent": f"{len(payload)} {hashlib.sha256(payload).hexdigest()}"}))
"""


def test_the_childs_own_server_on_a_port_named_for_the_host_is_joined_keeping_half_closes(
    tmp_path: Path,
) -> None:
    """A server of the child's own on a loopback port the policy names for the host is what the
    child reaches there, through the capture's join: its greeting arrives before the client says
    anything, megabytes go through under back-pressure, and the client's half-close reaches it as an
    end while its answer still comes back."""
    with EchoHTTPServer("127.0.0.1", name="host-service") as host:
        policy = write_policy(tmp_path, f"version: 1\nloopback: {{allow: true, ports: [{host.port}]}}\n")
        result = egressd_exec(
            ["--policy", str(policy)],
            [sys.executable, "-c", textwrap.dedent(OWN_ON_THE_HOSTS_PORT), str(host.port)],
            timeout=TIMEOUT,
        )
        seen = last_json(result)
        assert host.connections == 0
    assert seen["greeting"] == "hello\n"
    assert seen["answer"] == seen["sent"], seen


# -- what passes through as under any exec ---------------------------------------------------------
def test_exit_status_stdio_and_a_child_killed_by_a_signal(tmp_path: Path) -> None:
    result = egressd_exec([], ["sh", "-c", "cat; echo err >&2; exit 7"], input=b"in\x00put", timeout=TIMEOUT)
    assert (result.returncode, result.stdout) == (7, b"in\x00put")
    assert result.stderr.startswith(b"err\n"), result.stderr
    killed = egressd_exec([], ["sh", "-c", "kill -TERM $$"], timeout=TIMEOUT)
    assert killed.returncode == -signal.SIGTERM


# os.write, not print: the signal may come while "ready" is still being written (the test reads it
# first), and a handler that prints then re-enters stdout's buffer (RuntimeError, exit 1)
SIGNALLED = """
    import os, signal, sys, time
    def stop(signo, frame):
        os.write(1, f"got {signal.Signals(signo).name}\\n".encode())
        sys.exit(5)
    signal.signal(signal.SIGTERM, stop)
    os.write(1, b"ready\\n")
    time.sleep(60)
"""


def test_a_signal_to_egressd_reaches_the_child() -> None:
    proc = subprocess.Popen(
        [*EGRESSD, "exec", "--", sys.executable, "-c", textwrap.dedent(SIGNALLED)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=stuck.with_faulthandler(),
    )
    assert proc.stdout is not None
    try:
        assert proc.stdout.readline() == b"ready\n"
        proc.send_signal(signal.SIGTERM)
        try:
            out, err = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            pytest.fail("egressd and its child did not end after SIGTERM\n" + stuck.explain(proc))
    finally:
        proc.kill()
    assert (out, proc.returncode) == (b"got SIGTERM\n", 5), err.decode(errors="replace")


# -- when there is no capture: said on stderr --------------------------------------------------------
def test_no_capture_says_so_and_the_child_goes_out_directly(sites: Sites, ca_file: Path) -> None:
    command = direct_clients.command("urllib3", ca_file, [sites.urls[2]])
    result = sites.exec(command, "--no-capture")
    assert "WARNING: --no-capture" in result.stderr.decode()
    assert last_json(result)[sites.urls[2]] == [200, "/refused-literal"]  # nothing decided it
    assert sites.unlisted.connections == 1
    assert not [r for r in audit_records(sites.audit) if r.get("host") == sites.unlisted.host]


def test_without_user_namespaces_egressd_says_so_and_runs_the_child_as_it_is(
    sites: Sites, ca_file: Path
) -> None:
    """A kernel that refuses user namespaces: egressd runs under a user namespace the test makes
    with max_user_namespaces at 0 (as an ordinary user in it), so the child's cannot be made."""
    command = direct_clients.command("urllib3", ca_file, [sites.urls[2]])
    base = ["--policy", str(sites.policy), "--nameserver", sites.dns.nameserver, "--audit", str(sites.audit)]
    result = subprocess.run(
        [sys.executable, NO_USERNS, *EGRESSD, "exec", *base, "--", *command],
        capture_output=True,
        timeout=TIMEOUT,
    )
    stderr = result.stderr.decode()
    assert "cannot give the command a network namespace of its own" in stderr, stderr
    assert "NOT captured" in stderr and "user.max_user_namespaces" in stderr
    assert stderr.count("network namespace of its own") == 1  # once
    assert last_json(result)[sites.urls[2]] == [200, "/refused-literal"]  # out directly, as warned
    curl = ["curl", "-sS", "-o", "/dev/null", "-w", "%{http_code}", sites.urls[0]]
    proxied = egressd_exec_in_no_userns(sites, curl)
    assert proxied.stdout == b"200"  # the proxy variables still lead through egressd


@pytest.mark.parametrize("front", [["mcp", "run"], ["acp"]], ids=["mcp-run", "acp"])
def test_mcp_and_acp_without_user_namespaces_say_so_once(sites: Sites, front: list[str]) -> None:
    """`mcp run` and `acp` must know where their child reaches the proxy before it starts: they
    ask the kernel first, and say once that programs ignoring the proxy variables are not captured."""
    base = ["--policy", str(sites.policy), "--nameserver", sites.dns.nameserver]
    result = subprocess.run(
        [sys.executable, NO_USERNS, *EGRESSD, *front, *base, "--", "sh", "-c", "echo ran"],
        capture_output=True,
        timeout=TIMEOUT,
    )
    stderr = result.stderr.decode()
    assert result.returncode == 0 and result.stdout == b"ran\n", stderr
    assert stderr.count("cannot give the command a network namespace of its own") == 1, stderr
    assert "NOT captured" in stderr and "kernel.apparmor_restrict_unprivileged_userns" in stderr


def egressd_exec_in_no_userns(sites: Sites, command: list[str]) -> subprocess.CompletedProcess[bytes]:
    base = ["--policy", str(sites.policy), "--nameserver", sites.dns.nameserver]
    return subprocess.run(
        [sys.executable, NO_USERNS, *EGRESSD, "exec", *base, "--", *command],
        capture_output=True,
        timeout=TIMEOUT,
    )
