"""A session runs its services on the proxy's one event loop: the control API, the dashboard, the
metrics port and the watchers of the policy and the gateway's token file add no thread of their own.

Why: every thread with a loop of its own is another place state is shared across threads (each
guarded by a lock, each a race to get wrong) and another wake-up the proxy pays for. Here a
session with every service on serves a client of each and applies an edit of each watched file;
the only threads it may have started are the proxy's and the worker threads its loop hands
blocking work to (file reads, a scrape's rendering, imports).
"""

from __future__ import annotations

import http.client
import json
import re
import socket
import threading
import time
from pathlib import Path

import pytest

from egressd.control import paths
from egressd.session import ProxySession, SessionOptions
from egressd.session.gateway_options import GatewayOptions

POLICY = "version: 1\nmode: enforce\nallow: [a.test]\n"
EDITED = "version: 1\nmode: ask\nallow: [a.test, b.test]\n"


def unix_get(path: Path, target: str) -> tuple[int, bytes]:
    with socket.socket(socket.AF_UNIX) as sock:
        sock.settimeout(20)
        sock.connect(str(path))
        sock.sendall(f"GET {target} HTTP/1.1\r\nHost: egressd\r\nConnection: close\r\n\r\n".encode())
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split()[1]), body


def tcp_get(url: str) -> int:
    found = re.match(r"http://([\d.]+):(\d+)(/.*)", url)
    assert found is not None, url
    connection = http.client.HTTPConnection(found[1], int(found[2]), timeout=20)
    try:
        connection.request("GET", found[3])
        return connection.getresponse().status
    finally:
        connection.close()


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("EGRESSD_HOME", str(tmp_path / "home"))
    return tmp_path


def test_every_service_runs_on_the_proxys_loop(home: Path) -> None:
    policy = home / "policy.yaml"
    policy.write_text(POLICY)
    tokens = home / "tokens.json"
    said: list[str] = []
    options = SessionOptions(
        policy_file=str(policy),
        metrics=("127.0.0.1", 0),
        dashboard=True,
        prompt=False,
        gateway=GatewayOptions(tokens=tokens),
    )
    before = set(threading.enumerate())
    with ProxySession(options, say=said.append):
        control = paths.socket_path(paths.run_dir())
        status, body = unix_get(control, "/v1/info")
        assert status == 200 and json.loads(body)["mode"] == "enforce"
        metrics = next(line for line in said if line.startswith("metrics on ")).split()[-1]
        assert tcp_get(metrics) == 200
        dashboard = next(line for line in said if line.startswith("dashboard: ")).split()[1]
        assert tcp_get(dashboard) == 303  # the token exchanged for the cookie
        policy.write_text(EDITED)
        tokens.write_text('{"version": 1, "clients": {}}\n')
        deadline = time.monotonic() + 30
        while json.loads(unix_get(control, "/v1/info")[1])["mode"] != "ask":
            assert time.monotonic() < deadline, said
            time.sleep(0.1)
        started = {t for t in threading.enumerate() if t not in before and t.is_alive()}
    names = sorted(t.name for t in started)
    assert "egressd-proxy" in names
    others = [n for n in names if n != "egressd-proxy" and not re.fullmatch(r"(asyncio|uvloop)_\d+", n)]
    assert others == [], names
