"""Clients that ignore the proxy variables, as the capture tests run them.

Each is a real client run the way users meet it: urllib3's PoolManager used directly, aiohttp's
default session (trust_env off), node's fetch and https.get (node 20 reads no proxy variable),
and curl told `-x ""`. Each takes a CA file and URLs, and prints one JSON object: for each URL
`[status, what]`, where `what` is the echo server's path for a 200, egressd's X-Egressd-Reason for
another answer, or `["error", name]` when the request failed.
"""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

from tests.support.dns_server import DnsServer
from tests.support.upstreams import EchoHTTPServer, EchoHTTPSServer

URLLIB3 = """
    import json, sys, urllib3
    out = {}
    timeout = urllib3.Timeout(connect=30, read=60)
    pool = urllib3.PoolManager(ca_certs=sys.argv[1], retries=False, timeout=timeout)
    for url in sys.argv[2:]:
        try:
            response = pool.request("GET", url)
            what = json.loads(response.data)["path"] if response.status == 200 else None
            out[url] = [response.status, what or response.headers.get("X-Egressd-Reason")]
        except Exception as exc:
            out[url] = ["error", type(exc).__name__]
    print(json.dumps(out))
"""

AIOHTTP = """
    import asyncio, json, ssl, sys, aiohttp
    async def main():
        out = {}
        context = ssl.create_default_context(cafile=sys.argv[1])
        timeout = aiohttp.ClientTimeout(total=90)
        async with aiohttp.ClientSession(timeout=timeout) as session:  # trust_env=False: no proxy
            for url in sys.argv[2:]:
                try:
                    async with session.get(url, ssl=context) as response:
                        body = await response.read()
                        what = json.loads(body)["path"] if response.status == 200 else None
                        out[url] = [response.status, what or response.headers.get("X-Egressd-Reason")]
                except Exception as exc:
                    out[url] = ["error", type(exc).__name__]
        print(json.dumps(out))
    asyncio.run(main())
"""

NODE = """
    const https = require("https");
    const http = require("http");
    function what(status, body, headers) {
      return status === 200 ? JSON.parse(body).path : headers["x-egressd-reason"];
    }
    function get(url) {
      const lib = url.startsWith("https:") ? https : http;
      return new Promise((resolve) => {
        const req = lib.get(url, { timeout: 60000 }, (res) => {
          let body = "";
          res.on("data", (c) => (body += c));
          res.on("end", () => resolve([res.statusCode, what(res.statusCode, body, res.headers)]));
        });
        req.on("error", (e) => resolve(["error", e.code || e.message]));
        req.on("timeout", () => req.destroy(new Error("timeout")));
      });
    }
    async function viaFetch(url) {
      try {
        const res = await fetch(url, { signal: AbortSignal.timeout(60000) });
        const body = await res.text();
        return [res.status, what(res.status, body, Object.fromEntries(res.headers))];
      } catch (e) {
        return ["error", String((e.cause && e.cause.code) || e.message)];
      }
    }
    (async () => {
      const out = {};
      for (const url of process.argv.slice(1)) {
        out["fetch " + url] = await viaFetch(url);
        out["get " + url] = await get(url);
      }
      console.log(JSON.stringify(out));
    })();
"""

# curl told to use no proxy (`-x ""` beats every variable), run once per URL
CURL = """
    import json, subprocess, sys
    out = {}
    for url in sys.argv[2:]:
        done = subprocess.run(
            ["curl", "-sS", "-x", "", "--cacert", sys.argv[1], "--max-time", "60", "-D", "-", url],
            capture_output=True,
        )
        if done.returncode != 0:
            out[url] = ["error", f"curl exit {done.returncode}"]
            continue
        head, _, body = done.stdout.partition(b"\\r\\n\\r\\n")
        lines = head.decode("latin-1").split("\\r\\n")
        status = int(lines[0].split()[1])
        headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
        what = json.loads(body)["path"] if status == 200 else headers.get("x-egressd-reason")
        out[url] = [status, what]
    print(json.dumps(out))
"""


def allowed_urls(dns: DnsServer, upstream: EchoHTTPServer, upstream_tls: EchoHTTPSServer) -> tuple[str, str]:
    """up.test (plain HTTP, /plain) and other.test (HTTPS, /tls), named in `dns`: what the tests'
    policies allow."""
    dns.add("up.test", upstream.host)
    dns.add("other.test", upstream_tls.host)
    return f"http://up.test:{upstream.port}/plain", upstream_tls.url_for("other.test", "/tls")


def command(name: str, ca_file: Path, urls: list[str]) -> list[str]:
    """The argv of client `name` (urllib3, aiohttp, node, curl) asking `urls`."""
    if name == "node":
        return ["env", f"NODE_EXTRA_CA_CERTS={ca_file}", "node", "-e", textwrap.dedent(NODE), *urls]
    script = {"urllib3": URLLIB3, "aiohttp": AIOHTTP, "curl": CURL}[name]
    return [sys.executable, "-c", textwrap.dedent(script), str(ca_file), *urls]


def results(name: str, seen: dict[str, list[object]], url: str) -> list[list[object]]:
    """What client `name` got for `url` (node asks twice: fetch and https.get)."""
    if name == "node":
        return [seen["fetch " + url], seen["get " + url]]
    return [seen[url]]


# The program that holds the client's socket, as the audit names it (the identity step)
PROGRAMS = {"urllib3": "python", "aiohttp": "python", "node": "node", "curl": "curl"}
CLIENTS = tuple(PROGRAMS)
