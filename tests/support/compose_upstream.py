"""The upstream of tests/test_compose_gateway.py: a stdlib HTTP server run inside a container.

Why: the compose tests' egress network is internal, so the "internet" is this container (aliases
up.test and other.test). It answers every GET with who it is and what it was asked, and prints one
JSON line per request (with the peer address) so a test can prove a request never arrived.
"""

from __future__ import annotations

import json
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class Handler(BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802 - http.server's hook name
        host = self.headers.get("Host", "")
        print(json.dumps({"peer": self.client_address[0], "host": host, "path": self.path}), flush=True)
        body = f"upstream ok host={host} path={self.path}\n".encode()
        self.send_response(200)
        self.send_header("Content-Type", "text/plain")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - the JSON line says it
        pass


if __name__ == "__main__":
    port = int(sys.argv[1]) if len(sys.argv) > 1 else 8080
    ThreadingHTTPServer(("0.0.0.0", port), Handler).serve_forever()
