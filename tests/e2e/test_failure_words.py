"""A network failure is told as a failure, never as a refusal: on stderr, in the trace, in the exit
summary and in `egressd watch` (ACP and MCP notices: tests/e2e/test_acp.py, tests/e2e/test_mcp.py).

Why: "egressd: refused up.test (dns_error)" sends a person to the policy, which cannot help; the
DNS, the network or the server failed. Through the real commands: a name that does not resolve
(dns_error), a port that refuses connections (connect_refused), and a host the policy refuses
(not_allowlisted) side by side.
"""

from __future__ import annotations

import json
import subprocess
import threading
from pathlib import Path

from tests.support.control import wait_for
from tests.support.dns_server import DnsServer
from tests.support.egressd_cli import EGRESSD, TEST_POLICY, EgressdRun, egressd_exec, write_policy
from tests.support.upstreams import RefusingPort

CHILD = 'for url in "$@"; do curl -s -o /dev/null --max-time 20 "$url"; done'


def _urls(refusing_port: RefusingPort) -> list[str]:
    return [
        "http://missing.test/",  # allowed, NXDOMAIN: dns_error
        f"http://up.test:{refusing_port.port}/",  # allowed, nothing listens: connect_refused
        "http://elsewhere.test/",  # not in the policy: refused
    ]


def _policy(tmp_path: Path) -> Path:
    return write_policy(tmp_path, TEST_POLICY.replace("  - up.test\n", "  - up.test\n  - missing.test\n"))


def test_stderr_lines_and_summary_say_failed(
    tmp_path: Path, dns: DnsServer, refusing_port: RefusingPort
) -> None:
    dns.add("up.test", refusing_port.host)
    result = egressd_exec(
        ["--policy", str(_policy(tmp_path)), "--nameserver", dns.nameserver],
        ["sh", "-c", CHILD, "child", *_urls(refusing_port)],
    )
    lines = result.stderr.decode().splitlines()
    assert (
        "egressd: failed to reach missing.test:80 (dns_error) - missing.test: no such host (NXDOMAIN)"
        in lines
    )
    refused_port = f"up.test:{refusing_port.port}"
    assert any(
        line.startswith(f"egressd: failed to reach {refused_port} (connect_refused)") for line in lines
    )
    assert any(line.startswith("egressd: refused elsewhere.test:80 (not_allowlisted)") for line in lines)
    assert lines[-1] == (
        "egressd: refused 1 host: elsewhere.test (not_allowlisted); "
        "failed to reach 2 hosts: missing.test (dns_error), up.test (connect_refused)"
        " - allow with: --allow elsewhere.test"
    ), lines
    assert not [
        line for line in lines if line.startswith(("egressd: refused missing", "egressd: refused up.test"))
    ]


def test_trace_says_fail(tmp_path: Path, dns: DnsServer, refusing_port: RefusingPort) -> None:
    dns.add("up.test", refusing_port.host)
    result = egressd_exec(
        ["--policy", str(_policy(tmp_path)), "--nameserver", dns.nameserver, "--trace"],
        ["sh", "-c", CHILD, "child", *_urls(refusing_port)],
    )
    lines = result.stderr.decode().splitlines()
    failed = [line for line in lines if line.startswith("egressd: FAIL ")]
    assert any("missing.test:80  dns_error" in line for line in failed), lines
    assert any(f"up.test:{refusing_port.port}  connect_refused" in line for line in failed), lines
    assert any(line.startswith("egressd: DENY ") and "elsewhere.test:80" in line for line in lines), lines
    assert not [line for line in lines if line.startswith("egressd: DENY ") and "_error" in line], lines
    assert not [line for line in lines if line.startswith("egressd: DENY ") and "connect_refused" in line]


def test_watch_says_fail(tmp_path: Path, dns: DnsServer, refusing_port: RefusingPort) -> None:
    dns.add("up.test", refusing_port.host)
    with EgressdRun(["--policy", str(_policy(tmp_path)), "--nameserver", dns.nameserver]) as run:
        watch = subprocess.Popen([*EGRESSD, "watch"], stdout=subprocess.PIPE, text=True)
        lines: list[str] = []
        assert watch.stdout is not None
        reader = threading.Thread(target=lambda: lines.extend(watch.stdout or ()), daemon=True)
        reader.start()
        try:

            def seen() -> bool:
                subprocess.run(["sh", "-c", CHILD, "child", *_urls(refusing_port)], env=run.child_env())
                text = "".join(lines)
                return "dns_error" in text and "connect_refused" in text and "not_allowlisted" in text

            wait_for(seen, what="the failures and the refusal on the watch stream")
        finally:
            watch.terminate()
            watch.wait(10)
    # each line: the pid of the egressd that decided, then the decision
    by_reason = {
        reason: line.split(maxsplit=1)[1]
        for line in lines
        for reason in ("dns_error", "connect_refused", "not_allowlisted")
        if f"  {reason}  " in line
    }
    assert by_reason["dns_error"].startswith("FAIL "), json.dumps(lines)
    assert by_reason["connect_refused"].startswith("FAIL "), json.dumps(lines)
    assert by_reason["not_allowlisted"].startswith("DENY "), json.dumps(lines)
