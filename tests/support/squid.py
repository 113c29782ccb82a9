"""A real Squid on loopback for tests: its configuration scaffolding and its start.

Why: egressd's policy export is checked against what Squid really decides, and egressd's parent
proxy support against a real parent (credentials, refusals, the access log). Squid drops to its own
user for its logs and pid file, so the directory it writes to must be writable by anyone.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import time
from collections.abc import Iterator, Sequence
from pathlib import Path


def base_conf(directory: Path, port: int, *, access_log: bool = False) -> list[str]:
    """Loopback port, no cache, every file in `directory`."""
    return [
        f"http_port 127.0.0.1:{port}",
        f"pid_filename {directory}/squid.pid",
        f"cache_log {directory}/cache.log",
        f"access_log stdio:{directory}/access.log squid" if access_log else "access_log none",
        "cache deny all",
        "shutdown_lifetime 0 seconds",
        f"hosts_file {directory}/hosts",
        "connect_timeout 5 seconds",
    ]


def wait_port(port: int, proc: subprocess.Popen[bytes], log: Path, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            text = log.read_text() if log.exists() else ""
            raise RuntimeError(f"squid exited {proc.returncode}: {text[-3000:]}")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.1)
    raise RuntimeError(f"squid did not listen within {timeout}s: {log.read_text()[-3000:]}")


@contextlib.contextmanager
def running_squid(directory: Path, port: int, conf_lines: Sequence[str]) -> Iterator[subprocess.Popen[bytes]]:
    """Write squid.conf, check it (`squid -k parse`), run squid until the block ends."""
    os.chmod(directory, 0o777)
    hosts = directory / "hosts"
    if not hosts.exists():
        hosts.write_text("")
    conf = directory / "squid.conf"
    conf.write_text("\n".join([*conf_lines, ""]))
    parsed = subprocess.run(
        ["squid", "-k", "parse", "-f", str(conf)], capture_output=True, text=True, timeout=60
    )
    assert parsed.returncode == 0, parsed.stderr
    proc = subprocess.Popen(
        ["squid", "-N", "-f", str(conf)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        wait_port(port, proc, directory / "cache.log")
        yield proc
    finally:
        proc.terminate()
        proc.wait(20)
