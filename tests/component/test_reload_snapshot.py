"""A reload puts the policy, its secrets' values and the gateway's tokens in force as one snapshot:
no request ever meets one version's policy with another version's secrets.

Why: a secret's hosts are in the policy and its value is read from a file with it, and an edit
changes both together (the key moves to another API, with that API's key). A request that met the
new hosts with the old value would send a key where no version sends it; one that met the new
policy with the old secrets would be refused (`secret_exfiltration`) where no version refuses it.
The window between two steps of a swap is microseconds wide, so the reloads are put in force here
in process, thousands a second from a thread of their own, while real clients send real requests
through the running proxy to a real server that shows what it received.
"""

from __future__ import annotations

import base64
import http.client
import os
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest

from egressd.policy import load_policy
from egressd.session import Overrides, ProxySession, SessionOptions
from egressd.session.snapshot import Loaded, PolicyFile
from tests.support.dns_server import DnsServer
from tests.support.upstreams import EchoHTTPServer

VALUES = {"a.test": "key-for-a-7d1c0e", "b.test": "key-for-b-93fa42"}
CLIENTS = 4
SECONDS = 4.0


def version(directory: Path, host: str) -> Path:
    """A policy that allows `host` alone and sends secret `api` (its value in a file of its own)
    to `host` alone."""
    value = directory / f"{host}.key"
    value.write_text(VALUES[host] + "\n")
    policy = directory / f"{host}.yaml"
    policy.write_text(
        f"""\
version: 1
mode: enforce
allow:
  - {host}
  - 198.51.100.0/24
secrets:
  - name: api
    from: {{file: {value}}}
    hosts: [{host}]
    header: "Authorization: Bearer {{}}"
    env: API_KEY
"""
    )
    return policy


@pytest.fixture
def session(tmp_path: Path, dns: DnsServer, upstream: EchoHTTPServer) -> Iterator[ProxySession]:
    for host in VALUES:
        dns.add(host, upstream.host)
    options = SessionOptions(
        policy_file=str(version(tmp_path, "a.test")),
        overrides=Overrides(nameservers=(dns.nameserver,)),
        control=False,
        prompt=False,
    )
    with ProxySession(options, say=lambda _: None) as running:
        yield running


def test_a_reload_never_mixes_one_versions_policy_with_anothers_secrets(
    tmp_path: Path, session: ProxySession, upstream: EchoHTTPServer
) -> None:
    assert session.proxy is not None and session.reloads is not None
    source = session.source
    assert isinstance(source, PolicyFile)
    versions: list[Loaded] = [
        source.build(load_policy(version(tmp_path, host), os.environ)) for host in ("b.test", "a.test")
    ]
    creds = session.credentials()
    placeholder = session.placeholders()["API_KEY"]
    auth = "Basic " + base64.b64encode(f"{creds.username}:{creds.token}".encode()).decode()
    proxy_host, proxy_port = session.proxy.http_address
    stop = threading.Event()
    seen: Counter[tuple[str, str]] = Counter()
    wrong: list[str] = []
    lock = threading.Lock()

    def client(host: str) -> None:
        connection = http.client.HTTPConnection(proxy_host, proxy_port, timeout=20)
        url = f"http://{host}:{upstream.port}/to/{host}"
        headers = {"Authorization": f"Bearer {placeholder}", "Proxy-Authorization": auth}
        while not stop.is_set():
            try:
                connection.request("GET", url, headers=headers)
                answer = connection.getresponse()
                body = answer.read()
            except (OSError, http.client.HTTPException):
                connection.close()
                connection = http.client.HTTPConnection(proxy_host, proxy_port, timeout=20)
                continue
            # what the server received is checked below (the answer masks the key it echoes)
            outcome = "sent" if answer.status == 200 else answer.headers.get("X-Egressd-Reason", "?")
            with lock:
                seen[host, outcome] += 1
                if outcome not in ("sent", "not_allowlisted"):
                    wrong.append(f"{host}: {outcome}: {body[:200]!r}")
            if answer.getheader("Connection", "").lower() == "close":
                connection.close()
        connection.close()

    def reloads() -> None:
        assert session.reloads is not None
        while not stop.is_set():
            for loaded in versions:
                session.reloads.policy(loaded)  # one snapshot, one assignment, from any thread

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)  # threads take turns often: a gap between two steps gets hit
    threads = [threading.Thread(target=client, args=(host,)) for host in VALUES for _ in range(CLIENTS // 2)]
    threads.append(threading.Thread(target=reloads))
    try:
        for thread in threads:
            thread.start()
        deadline = time.monotonic() + SECONDS
        while time.monotonic() < deadline and not wrong:
            time.sleep(0.05)
    finally:
        stop.set()
        for thread in threads:
            thread.join(timeout=30)
        sys.setswitchinterval(interval)
    assert wrong == [], (wrong[:5], seen)
    # what the server received: each host only its own key, never the other's, never a placeholder
    received = Counter((r["path"], r["headers"].get("authorization")) for r in upstream.requests)
    assert set(received) <= {(f"/to/{host}", f"Bearer {value}") for host, value in VALUES.items()}, received
    # both versions were in force while requests came: each host got its key, and was refused
    for host in VALUES:
        assert seen[host, "sent"] > 0 and seen[host, "not_allowlisted"] > 0, seen
    assert sum(received.values()) == seen["a.test", "sent"] + seen["b.test", "sent"]
