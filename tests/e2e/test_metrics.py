"""`egressd exec --metrics`: Prometheus metrics scraped with a real HTTP client after real traffic.

Why: metrics are only worth having if they move as the traffic does, carry no unbounded label (no
host), and are not served to other machines by accident. The child below makes real requests
through egressd (allowed, refused, an open tunnel), then waits while this test scrapes the
endpoint egressd printed; the policy file is edited to count a reload.
"""

from __future__ import annotations

import importlib.metadata
import os
import platform
import re
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import requests

from tests.support.dns_server import DnsServer
from tests.support.egressd_cli import EGRESSD, EgressdRun, egressd_exec, write_policy
from tests.support.metrics_text import sample
from tests.support.upstreams import EchoHTTPServer

CHILD = textwrap.dedent(
    """
    import os, socket, sys, time, urllib.parse
    import requests
    up, ready, done = sys.argv[1], sys.argv[2], sys.argv[3]
    for _ in range(3):
        assert requests.get(f"http://up.test:{up}/ok", timeout=20).status_code == 200
    for host in ("nope.test", "nope.test", "other-nope.test"):
        assert requests.get(f"http://{host}/", timeout=20).status_code == 403
    # one tunnel held open while the test scrapes
    proxy = urllib.parse.urlsplit(os.environ["HTTP_PROXY"])
    import base64
    auth = base64.b64encode(f"{proxy.username}:{proxy.password}".encode()).decode()
    tunnel = socket.create_connection((proxy.hostname, proxy.port), timeout=20)
    tunnel.sendall(
        f"CONNECT up.test:{up} HTTP/1.1\\r\\nHost: up.test:{up}\\r\\n"
        f"Proxy-Authorization: Basic {auth}\\r\\n\\r\\n".encode()
    )
    assert tunnel.recv(100).startswith(b"HTTP/1.1 200"), "tunnel refused"
    open(ready, "w").close()
    deadline = time.monotonic() + 60
    while not os.path.exists(done) and time.monotonic() < deadline:
        time.sleep(0.05)
    """
)


def until(check: Callable[[], bool], timeout: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.05)
    return check()


class Running:
    """`egressd exec --metrics 127.0.0.1:0 ...` in the background; `url` is what it printed."""

    def __init__(self, options: list[str], command: list[str]) -> None:
        self.proc = subprocess.Popen(
            [*EGRESSD, "exec", *options, "--", *command],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            stdin=subprocess.DEVNULL,
            text=True,
        )
        self.lines: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()
        assert until(lambda: any("metrics on http" in line for line in self.lines), 30), self.stderr
        line = next(line for line in self.lines if "metrics on http" in line)
        self.url = line.split("metrics on ", 1)[1].strip()

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.lines.append(line)

    @property
    def stderr(self) -> str:
        return "".join(self.lines)

    def scrape(self) -> str:
        answer = requests.get(self.url, timeout=10, proxies={"http": "", "https": ""})
        assert answer.status_code == 200
        assert answer.headers["content-type"].startswith("text/plain")
        return answer.text

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)


@pytest.fixture
def running() -> Iterator[list[Running]]:
    started: list[Running] = []
    yield started
    for run in started:
        run.stop()


def test_metrics_move_with_real_traffic(
    tmp_path: Path, dns: DnsServer, upstream: EchoHTTPServer, running: list[Running]
) -> None:
    dns.add("up.test", upstream.host)
    policy = write_policy(tmp_path)
    ready, done = tmp_path / "ready", tmp_path / "done"
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    run = Running(
        ["--policy", str(policy), "--nameserver", dns.nameserver, "--metrics", "127.0.0.1:0"],
        [sys.executable, str(script), str(upstream.port), str(ready), str(done)],
    )
    running.append(run)
    assert until(ready.exists, 60), run.stderr
    text = run.scrape()
    decisions = "egressd_decisions_total"
    assert sample(text, decisions, stage="request", decision="allow", reason="allowlist") == 3, text
    assert sample(text, decisions, stage="request", mode="enforce", reason="not_allowlisted") == 3
    # an allowed tunnel is recorded with its upstream connection (stage "connection"), like the pool's
    assert sample(text, decisions, stage="connection", decision="allow", reason="allowlist") >= 2
    assert sample(text, "egressd_tunnels_open") == 1
    # upstream connections: pooled plain HTTP (at least one) plus the tunnel's
    assert sample(text, "egressd_connections_total", direction="outbound") >= 2
    assert sample(text, "egressd_dns_lookup_seconds_count", outcome="ok") >= 2
    assert sample(text, "egressd_dns_lookup_seconds_bucket", outcome="ok", le="+Inf") >= 2
    # no host label anywhere: hosts are unbounded
    assert "up.test" not in text and "nope.test" not in text and 'host="' not in text
    # the closed client connections carried bytes both ways
    assert until(lambda: sample(run.scrape(), "egressd_bytes_total", direction="down") > 0)
    text = run.scrape()
    assert sample(text, "egressd_bytes_total", direction="up") > 0
    assert sample(text, "egressd_connections_total", direction="inbound") >= 1
    # a reload, then a reload that fails
    policy.write_text(policy.read_text() + "  - more.test\n")
    assert until(lambda: sample(run.scrape(), "egressd_reloads_total", outcome="ok") == 1), run.stderr
    policy.write_text("version: 1\nmode: nonsense\n")
    assert until(lambda: sample(run.scrape(), "egressd_reloads_total", outcome="failed") == 1), run.stderr
    done.touch()
    assert run.proc.wait(30) == 0, run.stderr
    assert upstream.connections >= 2


def test_metrics_count_asks_and_refused_tunnels(
    tmp_path: Path, dns: DnsServer, running: list[Running]
) -> None:
    """mode: ask with nobody to answer: the wait and its outcome (no_approver) are counted."""
    done = tmp_path / "done"
    script = (
        "import subprocess, sys, os, time\n"
        "r = subprocess.run(['curl', '-s', '-o', '/dev/null', '-w', '%{http_code}', "
        "'https://asked.test/'], capture_output=True)\n"
        f"open({str(tmp_path / 'ready')!r}, 'w').close()\n"
        f"while not os.path.exists({str(done)!r}): time.sleep(0.05)\n"
    )
    run = Running(
        ["--mode", "ask", "--nameserver", dns.nameserver, "--metrics", "127.0.0.1:0", "--quiet"],
        [sys.executable, "-c", script],
    )
    running.append(run)
    assert until((tmp_path / "ready").exists, 60), run.stderr
    text = run.scrape()
    assert sample(text, "egressd_ask_wait_seconds_count", outcome="no_approver") == 1, text
    assert sample(text, "egressd_decisions_total", stage="connect", mode="ask", reason="no_approver") == 1
    assert sample(text, "egressd_tunnels_open") == 0
    done.touch()
    assert run.proc.wait(30) == 0
    assert "refused" not in run.stderr  # --quiet


def test_metrics_refuse_a_non_loopback_address(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    for address in ("198.51.100.1:9100", "0.0.0.0:0", "[::]:0"):
        result = egressd_exec(["--metrics", address], ["touch", str(marker)])
        assert result.returncode == 2, result.stderr
        assert b"not a loopback address" in result.stderr and b"--metrics-any" in result.stderr
        assert not marker.exists()  # refused before anything ran
    result = egressd_exec(["--metrics-any"], ["touch", str(marker)])
    assert result.returncode == 2 and b"--metrics-any needs --metrics" in result.stderr


def test_metrics_any_serves_on_every_address(tmp_path: Path, running: list[Running]) -> None:
    done = tmp_path / "done"
    run = Running(
        ["--metrics", "0.0.0.0:0", "--metrics-any"],
        [sys.executable, "-c", f"import os,time\nwhile not os.path.exists({str(done)!r}): time.sleep(0.05)"],
    )
    running.append(run)
    port = run.url.rsplit(":", 1)[1].split("/")[0]
    # reachable on an address other than loopback (the namespace's documentation-range address)
    answer = requests.get(f"http://198.51.100.1:{port}/metrics", timeout=10, proxies={"http": ""})
    assert answer.status_code == 200 and "egressd_decisions_total" in answer.text
    done.touch()
    assert run.proc.wait(30) == 0


def test_metrics_endpoint_is_refused_to_the_child(tmp_path: Path, running: list[Running]) -> None:
    """The child cannot read egressd's metrics through the proxy: the endpoint is egressd's own."""
    out = tmp_path / "out"
    script = (
        "import os, sys, time, requests\n"
        "url = open(sys.argv[1]).read() if os.path.exists(sys.argv[1]) else None\n"
        "deadline = time.monotonic() + 30\n"
        "while url is None and time.monotonic() < deadline:\n"
        "    time.sleep(0.05)\n"
        "    url = open(sys.argv[1]).read() if os.path.exists(sys.argv[1]) else None\n"
        "r = requests.get(url, timeout=10)\n"
        "open(sys.argv[2], 'w').write(r.headers.get('x-egressd-reason', str(r.status_code)))\n"
    )
    url_file = tmp_path / "url"
    run = Running(["--metrics", "127.0.0.1:0"], [sys.executable, "-c", script, str(url_file), str(out)])
    running.append(run)
    url_file.write_text(run.url)
    assert run.proc.wait(60) == 0, run.stderr
    assert out.read_text() == "self"
    assert os.path.exists(out)


def test_run_serves_metrics_and_summarises_refusals_when_stopped() -> None:
    """`egressd run --metrics`: scraped while it serves; the refusal summary when it stops."""
    with EgressdRun(["--metrics", "127.0.0.1:0"]) as run:
        assert run.wait_for_stderr("metrics on http"), run.stderr
        url = run.stderr.split("metrics on ", 1)[1].split()[0]
        refused = requests.get("http://refused.test/", proxies={"http": run.proxy_url}, timeout=10)
        assert refused.status_code == 403 and refused.reason == "Forbidden by egressd: not_allowlisted"
        text = requests.get(url, timeout=10, proxies={"http": ""}).text
        assert sample(text, "egressd_decisions_total", stage="request", reason="not_allowlisted") == 1
        assert run.stop() == 0
    assert "egressd: refused 1 host: refused.test (not_allowlisted)" in run.stderr


def test_control_api_serves_the_same_metrics() -> None:
    """GET /metrics on the control socket (curl --unix-socket): the registry --metrics serves."""
    from egressd.control.client import find_instances

    with EgressdRun(["--metrics", "127.0.0.1:0", "--no-prompt"]) as run:
        assert run.wait_for_stderr("metrics on http"), run.stderr
        url = run.stderr.split("metrics on ", 1)[1].split()[0]
        for _ in range(2):
            requests.get("http://refused.test/", proxies={"http": run.proxy_url}, timeout=10)
        [instance] = [i for i in until_found(find_instances) if i.pid == run.proc.pid]
        answer = subprocess.run(
            ["curl", "-sS", "-i", "--unix-socket", str(instance.path), "http://egressd/metrics"],
            capture_output=True,
            text=True,
            timeout=20,
        )
        head, _, text = answer.stdout.partition("\n\n")  # text=True: CRLF read as LF
        assert head.startswith("HTTP/1.1 200") and "Content-Type: text/plain; version=" in head, answer.stdout
        refused = {"stage": "request", "reason": "not_allowlisted"}
        assert sample(text, "egressd_decisions_total", **refused) == 2, text
        tcp = requests.get(url, timeout=10, proxies={"http": ""}).text
        assert sample(tcp, "egressd_decisions_total", **refused) == 2


def until_found(find: Callable[[], tuple[Path, list]]) -> list:
    found: list = []
    until(lambda: bool(found.extend(find()[1]) or found))
    return found


def test_metrics_token_file_requires_the_bearer_token(tmp_path: Path) -> None:
    """--metrics-token-file: without `Authorization: Bearer TOKEN` (or with another token, or a
    prefix of it) the metrics port answers 401 and shows nothing; with it, the metrics."""
    token_file = tmp_path / "metrics.token"
    token = "m" * 12 + "etrics-token-4f2a"
    token_file.write_text(token + "\n")
    with EgressdRun(["--metrics", "127.0.0.1:0", "--metrics-token-file", str(token_file)]) as run:
        found = re.search(r"metrics on (\S+)", run.stderr)
        assert found is not None, run.stderr
        url = found.group(1)
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Bearer {token[:-1]}"}):
            refused = requests.get(url, headers=headers, timeout=10)
            assert refused.status_code == 401 and "egressd_" not in refused.text, headers
        served = requests.get(url, headers={"Authorization": f"Bearer {token}"}, timeout=10)
        assert served.status_code == 200 and "egressd_" in served.text
    short = tmp_path / "short.token"
    short.write_text("abc")
    done = subprocess.run(
        [*EGRESSD, "run", "--metrics", "127.0.0.1:0", "--metrics-token-file", str(short)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode != 0 and "16 characters" in done.stderr


# -- names and conventions ------------------------------------------------------------------------------
REPO = Path(__file__).resolve().parents[2]
GAUGES = {
    "egressd_build_info",
    "egressd_audit_writable",
    "egressd_audit_queue_bytes",
    "egressd_client_connections_open",
    "egressd_tunnels_open",
    "egressd_upstream_connections_open",
}


def families(text: str) -> dict[str, str]:
    """name -> type, from the `# TYPE` lines of a scrape."""
    return dict(re.findall(r"^# TYPE (\S+) (\S+)$", text, flags=re.MULTILINE))


def sample_names(text: str) -> list[tuple[str, str]]:
    """(name, labels) of every sample line."""
    return re.findall(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})? ", text, flags=re.MULTILINE)


def reference_created(disable: bool) -> bool:
    """Whether prometheus_client's own Counter and Histogram show `_created` (in a fresh process:
    the library reads PROMETHEUS_DISABLE_CREATED_SERIES once, when imported)."""
    code = (
        "from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest\n"
        "r = CollectorRegistry()\n"
        "Counter('c', 'c', ['x'], registry=r).labels('1').inc()\n"
        "Histogram('h', 'h', registry=r).observe(1)\n"
        "t = generate_latest(r).decode()\n"
        "print(('c_created{' in t) + ('h_created ' in t))\n"
    )
    env = {**os.environ, "PROMETHEUS_DISABLE_CREATED_SERIES": "True" if disable else "False"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    return {"2": True, "0": False}[out.stdout.strip()]


@pytest.mark.parametrize("disable", [False, True])
def test_metric_names_follow_prometheus_client(monkeypatch: pytest.MonkeyPatch, disable: bool) -> None:
    """A scrape of `egressd run --metrics` after traffic: `egressd_build_info` names the versions;
    every counter and histogram series has its `_created` exactly when prometheus_client's own
    Counter and Histogram have one (PROMETHEUS_DISABLE_CREATED_SERIES switches both off), a gauge
    never; the gauges of what is open now all end in `_open`; and docs/metrics.md lists exactly
    the families scraped, with their types."""
    from egressd import __version__

    monkeypatch.setenv("PROMETHEUS_DISABLE_CREATED_SERIES", "True" if disable else "False")
    with EgressdRun(["--metrics", "127.0.0.1:0", "--no-prompt"]) as run:
        assert run.wait_for_stderr("metrics on http"), run.stderr
        url = run.stderr.split("metrics on ", 1)[1].split()[0]
        requests.get("http://refused.test/", proxies={"http": run.proxy_url}, timeout=10)
        text = requests.get(url, timeout=10, proxies={"http": ""}).text
    types = families(text)
    created_families = {n for n in types if n.endswith("_created")}
    own = {n: t for n, t in types.items() if n not in created_families}
    assert {n for n, t in own.items() if t == "gauge"} == GAUGES, own
    assert sorted(n for n in GAUGES if "connections" in n or "tunnels" in n) == [
        n for n in sorted(GAUGES) if n.endswith("_open")
    ]
    info = re.search(r"^egressd_build_info\{([^}]*)\} 1\.0$", text, flags=re.MULTILINE)
    assert info, text
    labels = dict(re.findall(r'(\w+)="([^"]*)"', info.group(1)))
    assert labels["version"] == __version__ and labels["python"] == platform.python_version()
    assert labels["mitmproxy"] == importlib.metadata.version("mitmproxy")

    expected = reference_created(disable)
    samples = sample_names(text)
    for name, kind in own.items():
        base = name.removesuffix("_total")
        if kind == "gauge":
            assert not [s for s in samples if s[0] == f"{base}_created"], name
            continue
        count = f"{base}_count" if kind == "histogram" else name
        series = {labels for sample_name, labels in samples if sample_name == count}
        created = {labels for sample_name, labels in samples if sample_name == f"{base}_created"}
        assert created == (series if expected else set()), (name, series, created)
    assert any(s[0] == "egressd_decisions_created" for s in samples) == expected

    documented = dict(
        re.findall(
            r"^\| `(egressd_[a-z_]+)` \| (counter|gauge|histogram) \|",
            (REPO / "docs/metrics.md").read_text(),
            re.M,
        )
    )
    scraped = {n: t for n, t in own.items()}
    gateway_only = {"egressd_gateway_client_decisions_total": "counter"}
    assert documented == {**scraped, **gateway_only}
