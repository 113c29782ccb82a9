"""What a refused client's user reads: the reason on the status line, and egressd's own stderr lines.

Why: curl, pip, git, npm and Go show a refused CONNECT as "403" at best; the body with the reason
never reaches the person or the model. Two fixes, each checked with the real clients through the
real `egressd exec`: the status line's reason phrase carries the reason code (`403 Forbidden by
egressd: not_allowlisted`, which curl -v, wget, requests and httpx print), and egressd prints one
line per refused host on stderr plus a summary when the child exits (never on stdout, which an MCP
child speaks JSON-RPC on; `--quiet` turns both off).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tests.support.dns_server import DnsServer
from tests.support.egressd_cli import egressd_exec, write_policy
from tests.support.upstreams import EchoHTTPServer, EchoHTTPSServer

PHRASE = "Forbidden by egressd: not_allowlisted"

PY_CLIENTS = """
import sys
import httpx, requests
url = sys.argv[1]
for name, get in (("requests", requests.get), ("httpx", httpx.get)):
    try:
        answer = get(url, timeout=20)
        print(name, answer.status_code, answer.reason if name == "requests" else answer.reason_phrase)
    except Exception as exc:
        print(name, type(exc).__name__, exc)
"""


@pytest.mark.parametrize("scheme", ["https", "http"])
def test_reason_phrase_reaches_every_client(scheme: str, tmp_path: Path) -> None:
    url = f"{scheme}://refused.test/"
    script = tmp_path / "clients.py"
    script.write_text(PY_CLIENTS)
    curl = egressd_exec(["-q"], ["curl", "-sv", "--max-time", "20", url])
    assert f"< HTTP/1.1 403 {PHRASE}".encode() in curl.stderr, curl.stderr
    wget = egressd_exec(["-q"], ["wget", "-O-", "--tries=1", url])
    assert PHRASE.encode() in wget.stderr, wget.stderr  # "Proxy tunneling failed: Forbidden by ..."
    python = egressd_exec(["-q"], [sys.executable, str(script), url])
    lines = python.stdout.decode().splitlines()
    assert len(lines) == 2, python.stderr
    for line in lines:  # a ProxyError for https (the CONNECT), a 403 response for http
        assert PHRASE in line, line


def test_reason_phrase_of_other_refusals(dns: DnsServer) -> None:
    """Not only the policy's: a DNS failure says why on the status line too."""
    dns.add("up.test", "198.51.100.9")  # no A record for missing.test: NXDOMAIN
    curl = egressd_exec(
        ["-q", "--allow", "missing.test", "--nameserver", dns.nameserver],
        ["curl", "-sv", "--max-time", "20", "http://missing.test/"],
    )
    assert b"< HTTP/1.1 502 Bad Gateway by egressd: dns_error" in curl.stderr, curl.stderr


def test_reason_phrase_inside_an_inspected_tunnel(
    tmp_path: Path, dns: DnsServer, upstream_tls: EchoHTTPSServer, ca_file: Path
) -> None:
    """A request mitmproxy's addon refuses (a path no built-in allowance admits) says why too."""
    dns.add("up.test", upstream_tls.host)
    policy = write_policy(
        tmp_path, "version: 1\nallow: [198.51.100.0/24]\nbuiltin:\n  - {host: up.test, paths: [/ok/]}\n"
    )
    options = ["-q", "--policy", str(policy), "--nameserver", dns.nameserver, "--upstream-ca", str(ca_file)]
    url = f"https://up.test:{upstream_tls.port}"
    curl = egressd_exec(options, ["curl", "-sv", "--max-time", "20", f"{url}/ok/x", f"{url}/other"])
    text = curl.stderr.decode()
    assert "< HTTP/1.1 200" in text, text  # /ok/ inside the inspected tunnel
    assert "< HTTP/1.1 403 Forbidden by egressd: builtin_path" in text, text
    assert "issuer: CN=egressd inspection CA" in text


CHILD = """
import subprocess, sys
for url in sys.argv[1:]:
    subprocess.run(["curl", "-s", "-o", "/dev/null", "--max-time", "20", url])
print("child stdout")
"""


def test_refused_hosts_are_told_once_and_summarised(
    tmp_path: Path, dns: DnsServer, upstream: EchoHTTPServer
) -> None:
    dns.add("up.test", upstream.host)
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    urls = [
        "https://a.example/",
        "https://a.example/again",
        "http://a.example/",
        "http://b.example:8080/",
        f"http://up.test:{upstream.port}/",  # allowed: not reported
        "http://denied.test/",
    ]
    policy = write_policy(tmp_path)
    options = ["--policy", str(policy), "--nameserver", dns.nameserver]
    result = egressd_exec(options, [sys.executable, str(script), *urls])
    assert result.returncode == 0, result.stderr
    assert result.stdout == b"child stdout\n"  # nothing of egressd's on the child's stdout
    lines = result.stderr.decode().splitlines()
    refused = [line for line in lines if line.startswith("egressd: refused ") and "hosts:" not in line]
    assert len(refused) == 3, lines  # one per host and reason, whatever the number of tries
    assert refused[0] == "egressd: refused a.example:443 (not_allowlisted) - allow with: --allow a.example"
    assert refused[1] == (
        "egressd: refused b.example:8080 (not_allowlisted) - allow with: --allow b.example:8080"
    )
    assert refused[2].startswith("egressd: refused denied.test:80 (denylist)")
    assert lines[-1] == (
        "egressd: refused 3 hosts: a.example (not_allowlisted), b.example (not_allowlisted), "
        "denied.test (denylist) - allow with: --allow a.example --allow b.example:8080"
    )
    assert "up.test" not in result.stderr.decode()


def test_quiet_turns_the_report_off(tmp_path: Path) -> None:
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    result = egressd_exec(["--quiet"], [sys.executable, str(script), "https://a.example/"])
    assert result.returncode == 0
    assert result.stdout == b"child stdout\n"
    assert b"refused" not in result.stderr, result.stderr


def test_trace_keeps_only_the_summary(tmp_path: Path) -> None:
    """--trace prints a line per decision already: the report adds only its summary."""
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    result = egressd_exec(["--trace"], [sys.executable, str(script), "https://a.example/"])
    text = result.stderr.decode()
    assert "egressd: DENY" in text
    assert "egressd: refused a.example:443" not in text
    assert text.splitlines()[-1].startswith("egressd: refused 1 host: a.example (not_allowlisted)")


def test_sandbox_reports_refusals_and_serves_metrics(tmp_path: Path, work: Path) -> None:
    """`egressd sandbox` has the same report, and --metrics (refused off loopback) too."""
    from tests.support.sandboxes import egressd_sandbox

    command = ["curl", "-s", "-o", "/dev/null", "--max-time", "20", "https://a.example/"]
    result = egressd_sandbox([], command, cwd=work)
    lines = result.stderr.decode().splitlines()
    assert "egressd: refused a.example:443 (not_allowlisted) - allow with: --allow a.example" in lines
    assert lines[-1].startswith("egressd: refused 1 host: a.example"), lines
    assert b"refused" not in egressd_sandbox(["--quiet"], command, cwd=work).stderr
    marker = work / "ran"
    refused = egressd_sandbox(["--metrics", "198.51.100.1:0"], ["touch", str(marker)], cwd=work)
    assert refused.returncode == 2 and b"not a loopback address" in refused.stderr
    assert not marker.exists()
    served = egressd_sandbox(["--metrics", "127.0.0.1:0"], ["true"], cwd=work)
    assert served.returncode == 0 and b"egressd: metrics on http://127.0.0.1:" in served.stderr
