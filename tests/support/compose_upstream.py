"""The upstream of tests/e2e/test_compose_gateway.py: a stdlib HTTP(S) server run inside a container.

Why: the compose tests' egress network is internal, so the "internet" is this container (aliases
up.test and other.test). It answers every GET with who it is and what it was asked, and prints one
JSON line per request (with the peer address) so a test can prove a request never arrived. With a
certificate next to it (server.pem: chain and key, from the test's CA) it serves HTTPS too.
"""

from __future__ import annotations

import json
import ssl
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path


class Handler(BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802 - http.server's hook name
        host = self.headers.get("Host", "")
        scheme = "https" if isinstance(self.connection, ssl.SSLSocket) else "http"
        line = {"peer": self.client_address[0], "host": host, "path": self.path, "scheme": scheme}
        print(json.dumps(line), flush=True)
        body = f"upstream ok host={host} path={self.path}\n".encode()
        self.send_response(200)
        self.send_header("Content-Type", "text/plain")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - the JSON line says it
        pass


def serve_tls(port: int, pem: Path) -> None:
    server = ThreadingHTTPServer(("0.0.0.0", port), Handler)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(pem)
    server.socket = context.wrap_socket(server.socket, server_side=True)
    server.serve_forever()


if __name__ == "__main__":
    port = int(sys.argv[1]) if len(sys.argv) > 1 else 8080
    pem = Path(__file__).with_name("server.pem")
    if pem.exists():
        threading.Thread(target=serve_tls, args=(port + 363, pem), daemon=True).start()  # 8080 -> 8443
    ThreadingHTTPServer(("0.0.0.0", port), Handler).serve_forever()
