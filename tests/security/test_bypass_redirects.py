"""Bypass corpus, redirects: an allowed server sends the child somewhere it may not go.

Why: egressd never follows redirects itself, but real clients do, and a redirect is how a server
the policy trusts turns into a pointer at the metadata service or a loopback port. Every follow-up
is a new request and must be decided like any other; a redirect loop must not wedge the proxy. The
clients here are real (curl -L, Python requests) with the environment `egressd run` prints.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, quote, urlsplit

import pytest

from tests.support.answers import parse_http
from tests.support.corpus import ProxyClient, ServerSet
from tests.support.dns_server import DnsServer
from tests.support.egressd_cli import EgressdRun, write_policy

ORIGIN = "198.51.100.1"
EVIL = "198.51.100.9"
VICTIMS = (EVIL, "127.0.0.1", "::1")

POLICY = f"""\
version: 1
allow: [allowed.test, "*.allowed.test", {ORIGIN}]
loopback: {{allow: false}}
"""


class _RedirectHandler(BaseHTTPRequestHandler):
    """``/to?u=URL`` → 302 to URL; ``/loop`` → 302 to itself; ``/ping``/``/pong`` → 302 to each other
    on two different allowed origins (a cross-origin loop)."""

    protocol_version = "HTTP/1.1"
    server: _RedirectServer

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's name
        pass

    def do_GET(self) -> None:  # noqa: N802 - http.server's naming
        self.server.hits += 1
        url = urlsplit(self.path)
        port = self.server.server_address[1]
        if url.path == "/to":
            location = parse_qs(url.query)["u"][0]
        elif url.path == "/loop":
            location = "/loop"
        elif url.path == "/ping":
            location = f"http://pong.allowed.test:{port}/pong"
        elif url.path == "/pong":
            location = f"http://ping.allowed.test:{port}/ping"
        else:
            body = json.dumps({"server": "redirector", "path": self.path}).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
            return
        self.send_response(302)
        self.send_header("Location", location)
        self.send_header("Content-Length", "0")
        self.end_headers()


class _RedirectServer(ThreadingHTTPServer):
    daemon_threads = True
    hits = 0


@dataclass
class Env:
    run: EgressdRun
    client: ProxyClient
    victims: ServerSet
    redirector: _RedirectServer

    @property
    def port(self) -> int:
        """The port every victim listens on (the redirects name it)."""
        return self.victims.port

    def redirect_url(self, location: str) -> str:
        port = self.redirector.server_address[1]
        return f"http://allowed.test:{port}/to?u={quote(location.replace('{P}', str(self.port)), safe='')}"


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    tmp = Path(tmp_path_factory.mktemp("redirects"))
    policy = write_policy(tmp, POLICY)
    redirector = _RedirectServer((ORIGIN, 0), _RedirectHandler)
    thread = threading.Thread(target=redirector.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        with DnsServer() as dns, ServerSet(VICTIMS) as victims:
            for name in ("allowed.test", "ping.allowed.test", "pong.allowed.test"):
                dns.add(name, ORIGIN)
            dns.add("lo.allowed.test", "127.0.0.1")
            dns.add("evil.test", EVIL)
            with EgressdRun(["--policy", str(policy), "--nameserver", dns.nameserver]) as run:
                yield Env(run, ProxyClient.from_env(run.env), victims, redirector)
            assert victims.reached() == {}, "a redirect reached a refused server"
    finally:
        redirector.shutdown()
        redirector.server_close()


def curl(env: Env, url: str, *args: str) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(
        ["curl", "-sS", "-i", "-L", "--max-time", "20", *args, url],
        env=env.run.child_env(),
        capture_output=True,
        timeout=60,
    )


REDIRECTS = [
    # (id, Location, expected status, reason)
    ("metadata", "http://169.254.169.254/latest/meta-data/", 403, "forbidden_address"),
    ("metadata-hex", "http://0xa9fea9fe/latest/meta-data/", 403, "forbidden_address"),
    ("metadata-decimal", "http://2852039166/", 403, "forbidden_address"),
    ("metadata-mapped", "http://[::ffff:169.254.169.254]/", 403, "forbidden_address"),
    ("metadata-https", "https://169.254.169.254/", 403, "forbidden_address"),
    ("metadata-by-name", "http://metadata.google.internal/computeMetadata/v1/", 403, "not_allowlisted"),
    ("unspecified", "http://0:{P}/", 403, "forbidden_address"),
    ("loopback", "http://127.0.0.1:{P}/", 403, "loopback_disabled"),
    ("loopback-short", "http://127.1:{P}/", 403, "loopback_disabled"),
    ("localhost", "http://localhost:{P}/", 403, "loopback_disabled"),
    ("loopback-v6", "http://[::1]:{P}/", 403, "loopback_disabled"),
    ("name-to-loopback", "http://lo.allowed.test:{P}/", 403, "resolved_forbidden"),
    ("userinfo-to-loopback", "http://allowed.test@127.0.0.1:{P}/", 403, "loopback_disabled"),
    ("other-host", "http://evil.test:{P}/", 403, "not_allowlisted"),
    ("scheme-relative", "//evil.test:{P}/", 403, "not_allowlisted"),
]


@pytest.mark.parametrize(
    ("location", "status", "reason"), [r[1:] for r in REDIRECTS], ids=[r[0] for r in REDIRECTS]
)
def test_curl_follows_into_a_refusal(env: Env, location: str, status: int, reason: str) -> None:
    """curl -L: the 302 passes, the follow-up is refused with its reason, no victim is reached."""
    before = env.victims.counts()
    result = curl(env, env.redirect_url(location))
    assert b" 302 " in result.stdout, result.stdout[:300]
    got, headers, _ = parse_http(result.stdout)
    assert (got, headers.get("x-egressd-reason")) == (status, reason), (result.stdout[-600:], result.stderr)
    assert env.victims.counts() == before


PY_FOLLOW = r"""
import json, sys, requests
r = requests.get(sys.argv[1], timeout=20)
print(json.dumps([r.status_code, r.headers.get("X-Egressd-Reason"), [h.status_code for h in r.history]]))
"""


@pytest.mark.parametrize(
    ("location", "reason"),
    [
        ("http://169.254.169.254/latest/meta-data/", "forbidden_address"),
        ("http://[::ffff:a9fe:a9fe]/", "forbidden_address"),
        ("http://127.0.0.1:{P}/", "loopback_disabled"),
        ("http://lo.allowed.test:{P}/", "resolved_forbidden"),
    ],
    ids=["metadata", "metadata-mapped-hex", "loopback", "name-to-loopback"],
)
def test_requests_follows_into_a_refusal(env: Env, location: str, reason: str) -> None:
    before = env.victims.counts()
    result = subprocess.run(
        [sys.executable, "-c", PY_FOLLOW, env.redirect_url(location)],
        env=env.run.child_env(),
        capture_output=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr.decode()[-800:]
    status, got_reason, history = json.loads(result.stdout)
    assert (status, got_reason, history) == (403, reason, [302])
    assert env.victims.counts() == before


@pytest.mark.parametrize("path", ["/loop", "/ping"], ids=["same-origin-loop", "cross-origin-loop"])
def test_redirect_loop_ends_at_the_client_and_egressd_keeps_serving(env: Env, path: str) -> None:
    """A loop is the client's to stop (curl: --max-redirs); egressd decides every hop and stays up."""
    port = env.redirector.server_address[1]
    host = "ping.allowed.test" if path == "/ping" else "allowed.test"
    hits = env.redirector.hits
    result = curl(env, f"http://{host}:{port}{path}", "--max-redirs", "25")
    assert result.returncode == 47, result.stderr  # CURLE_TOO_MANY_REDIRECTS
    assert env.redirector.hits - hits == 26
    ok = env.client.get(f"http://allowed.test:{port}/done", host=f"allowed.test:{port}")
    assert ok is not None and ok.status == 200
