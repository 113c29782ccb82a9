"""scripts/demo.py (run by scripts/demo.sh): egressd allowing loopback, refusing the rest, on one screen.

It runs the real command line (`egressd exec ... -- sh -c 'curl ...; curl ...'`) against a test
server on 127.0.0.1, so what it shows is what a user gets. The resolver is pointed at a local
UDP socket that counts queries: the demo proves a refused name is never looked up, and nothing it
does can reach the network even if something were wrong. Exit 0 when every outcome is as expected.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

BODY = b"hello from the demo server on 127.0.0.1\n"
BLOCKED = "blocked.example"


class _Hello(BaseHTTPRequestHandler):
    hits = 0

    def do_GET(self) -> None:  # noqa: N802 - http.server's naming
        type(self).hits += 1
        self.send_response(200)
        self.send_header("Content-Type", "text/plain")
        self.send_header("Content-Length", str(len(BODY)))
        self.end_headers()
        self.wfile.write(BODY)

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - keep the transcript clean
        pass


class _QueryCounter:
    """A UDP 'nameserver' on loopback that only counts what arrives (and never answers)."""

    def __init__(self) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.settimeout(0.2)
        self.port: int = self.sock.getsockname()[1]
        self.count = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.sock.recvfrom(4096)
            except TimeoutError:
                continue
            except OSError:
                return
            self.count += 1

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
        self.sock.close()


def _child_env() -> dict[str, str]:
    """The caller's environment without settings that would change the demo's policy or proxy."""
    drop = {"http_proxy", "https_proxy", "all_proxy", "no_proxy"}
    return {k: v for k, v in os.environ.items() if k.lower() not in drop and not k.startswith("EGRESSD_")}


def _indent(text: str) -> str:
    lines = text.rstrip("\n").splitlines() or ["(nothing)"]
    return "\n".join(f"  | {line}" for line in lines)


def main() -> int:
    if shutil.which("curl") is None:
        print("egressd demo: curl is needed (scripts/setup.sh installs it)", file=sys.stderr)
        return 1
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Hello)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    dns = _QueryCounter()
    port = server.server_address[1]
    script = f"curl -sS http://127.0.0.1:{port}/hello; curl -sS -i http://{BLOCKED}/"
    try:
        with tempfile.TemporaryDirectory(prefix="egressd-demo-") as tmp:
            audit = Path(tmp) / "audit.jsonl"
            options = ["--trace", "--audit", str(audit), "--nameserver", f"127.0.0.1:{dns.port}"]
            shown = ["egressd", "exec", "--trace", "--audit", "audit.jsonl"]
            shown += ["--nameserver", f"127.0.0.1:{dns.port}", "--", "sh", "-c", script]
            print("egressd demo: one child, two requests, the built-in default policy")
            print("(nothing leaves this machine unless allowed; loopback is allowed).\n")
            print(f"A test server listens on http://127.0.0.1:{port}/ and a query counter stands in")
            print(f"for DNS on 127.0.0.1:{dns.port}. Running:\n\n  $ {shlex.join(shown)}\n")
            try:
                proc = subprocess.run(
                    [sys.executable, "-m", "egressd", "exec", *options, "--", "sh", "-c", script],
                    env=_child_env(),
                    stdin=subprocess.DEVNULL,
                    capture_output=True,
                    timeout=90,
                )
            except subprocess.TimeoutExpired:
                print("egressd demo: the command did not finish within 90 s", file=sys.stderr)
                return 1
            records = [json.loads(line) for line in audit.read_text().splitlines() if line.strip()]
    finally:
        server.shutdown()
        dns.close()
    out = proc.stdout.decode("utf-8", "replace")
    err = proc.stderr.decode("utf-8", "replace")
    print("The child's stdout (untouched by egressd):")
    print(_indent(out))
    print("\negressd's trace (stderr):")
    print(_indent(err))
    return _verdict(out, proc.returncode, records, dns.count, _Hello.hits)


def _verdict(out: str, returncode: int, records: list[dict[str, object]], queries: int, hits: int) -> int:
    blocked = [r for r in records if r.get("event") == "decision" and r.get("host") == BLOCKED]
    checks = [
        (
            BODY.decode().strip() in out and hits >= 1,
            'loopback 127.0.0.1 was allowed: the test server answered "hello ..."',
        ),
        (
            "HTTP/1.1 403" in out and "X-Egressd-Reason: not_allowlisted" in out,
            f"{BLOCKED} was refused: 403 with X-Egressd-Reason: not_allowlisted",
        ),
        (
            bool(blocked) and all(r.get("decision") == "deny" for r in blocked),
            f"the audit log recorded the refusal ({len(records)} JSON lines in all)",
        ),
        (
            queries == 0 and all(not r.get("resolved") for r in blocked),
            f"no DNS query was made for the refused name ({queries} queries received)",
        ),
        (returncode == 0, f"egressd exited like its child (status {returncode})"),
    ]
    print("\nWhat happened:")
    for ok, text in checks:
        print(f"  [{'ok' if ok else 'FAILED'}] {text}")
    passed = all(ok for ok, _ in checks)
    print("\ndemo passed." if passed else "\ndemo FAILED.")
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
