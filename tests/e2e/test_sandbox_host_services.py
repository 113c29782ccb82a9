"""The host's own services from inside `egressd sandbox`: on its loopback and on its own interface
addresses alike, only the ports the policy names.

A database, a dev server or a TCP Docker API listening on 0.0.0.0 answers on every address of the
host: its LAN address, a Docker bridge's, an IPv6 ULA. With `private.allow` and a LAN range
allowed, those addresses must not be a way around the loopback rules: they are the host's loopback
for the sandbox (as for a gateway's clients and the SSH relay's remote command). The test builds
such a host: a network namespace of its own with addresses on an interface, a service on every
address, and egressd and its sandbox inside.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

from tests.support.egressd_cli import EGRESSD, write_policy
from tests.support.netns import in_a_namespace_of_its_own
from tests.support.sandboxes import sandbox_env

REPO = Path(__file__).resolve().parents[2]
HOST_ADDRESSES = ["192.0.2.2/24", "172.17.0.1/16", "fd00::2/64"]
POLICY = """\
version: 1
private: {allow: true}
allow: [192.0.2.0/24, 172.16.0.0/12, "fd00::/8", lan.test]
"""
# the host's own addresses, in the spellings a child might try, and a name that resolves to one
URLS = {
    "lan": "http://192.0.2.2:PORT/",
    "docker bridge": "http://172.17.0.1:PORT/",
    "ula": "http://[fd00::2]:PORT/",
    "loopback": "http://127.0.0.1:PORT/",
    "mapped": "http://[::ffff:192.0.2.2]:PORT/",
    "name": "http://lan.test:PORT/",
}

# Runs inside the namespace: a service on every address of the host, a DNS server naming one of
# them, then `egressd sandbox` around curl (through the proxy, and once ignoring it: captured).
INSIDE = """
    import json, socket, subprocess, sys, threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
    repo, egressd, options, urls = json.loads(sys.argv[1])
    sys.path.insert(0, repo)
    from tests.support.dns_server import DnsServer

    class Service(BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.send_header("Content-Length", "0")
            self.end_headers()
        def log_message(self, *args):
            pass

    class EveryAddress(ThreadingHTTPServer):
        address_family = socket.AF_INET6
        def server_bind(self):
            self.socket.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
            super().server_bind()

    service = EveryAddress(("::", 0), Service)
    threading.Thread(target=service.serve_forever, daemon=True).start()
    port = str(service.server_address[1])
    with DnsServer() as dns:
        dns.add("lan.test", "192.0.2.2")
        fill = lambda text: text.replace("PORT", port)
        curl = 'curl -s -o /dev/null --max-time 30 -w "%{http_code} %header{x-egressd-reason}\\\\n"'
        script = f'for u in "$@"; do {curl} "$u"; done; {curl} --noproxy "*" "$0"'
        argv = [*egressd, "sandbox", "--nameserver", dns.nameserver, *map(fill, options), "--",
                "sh", "-c", script, fill("http://192.0.2.2:PORT/"), *map(fill, urls)]
        result = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    lines = result.stdout.splitlines()
    print(json.dumps({"lines": lines, "stderr": result.stderr, "code": result.returncode}))
"""


def _inside(tmp_path: Path, work: Path, *options: str) -> dict[str, str]:
    policy = write_policy(tmp_path, POLICY)
    config = [str(REPO), EGRESSD, ["--policy", str(policy), *options], list(URLS.values())]
    argv = [sys.executable, "-c", textwrap.dedent(INSIDE), json.dumps(config)]
    result = subprocess.run(
        in_a_namespace_of_its_own(HOST_ADDRESSES, argv),
        cwd=work,
        env=sandbox_env(work),
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert result.returncode == 0, result.stderr
    seen = json.loads(result.stdout)
    assert len(seen["lines"]) == len(URLS) + 1, seen  # the exit code is the last curl's
    return dict(zip([*URLS, "captured"], seen["lines"], strict=True))


def test_the_hosts_own_addresses_are_its_loopback(tmp_path: Path, work: Path) -> None:
    seen = _inside(tmp_path, work)
    for what in ("lan", "docker bridge", "ula", "loopback", "mapped"):
        assert seen[what] == "403 loopback_port", (what, seen)
    assert seen["name"] == "403 resolved_forbidden", seen  # lan.test resolves to the host itself
    assert seen["captured"] == "403 loopback_port", seen  # a client that ignores the proxy: decided alike


def test_the_ports_the_policy_names_are_reached_on_every_address(tmp_path: Path, work: Path) -> None:
    seen = _inside(tmp_path, work, "--allow-loopback-port", "PORT")
    assert seen == {what: "200 " for what in seen}, seen


def test_the_built_host_has_its_addresses_and_runs_egressd_as_the_tests_user() -> None:
    """What egressd sees there: the interface addresses the test gave it, none of the session's,
    and it runs as whoever runs the tests (an ordinary user stays one)."""
    code = "import os; from egressd.platform.interfaces import local_addresses as a; print(os.getuid(), *a())"
    argv = in_a_namespace_of_its_own(HOST_ADDRESSES, [sys.executable, "-c", code])
    uid, *addresses = subprocess.run(
        argv, capture_output=True, text=True, timeout=60, check=True
    ).stdout.split()
    assert int(uid) == os.getuid()
    assert {"192.0.2.2", "172.17.0.1", "fd00::2", "127.0.0.1", "::1"} <= set(addresses)
    assert not [a for a in addresses if a.startswith(("198.51.100.", "203.0.113.", "2001:db8:"))]
