"""`python -m egressd.child.connect HOST PORT`: the CONNECT client egressd ships (an SSH ProxyCommand).

Against a real `egressd run` and a real TCP echo server: the tunnel carries bytes both ways and
ends cleanly at EOF; a refusal says why on stderr and writes nothing on stdout (which belongs to
ssh). SSH itself through the helper is in test_sandbox_ssh.py.
"""

from __future__ import annotations

import base64
import subprocess
import sys
from pathlib import Path

import pytest

from egressd.child.connect import ConnectError, Proxy, proxy_from_env, proxy_from_url
from egressd.wire.connect_client import ConnectClient
from tests.support.dns_server import DnsServer
from tests.support.egressd_cli import EgressdRun, write_policy
from tests.support.upstreams import TcpEchoServer

CONNECT = [sys.executable, "-m", "egressd.child.connect"]


def test_proxy_from_env_prefers_https_and_skips_socks() -> None:
    env = {
        "ALL_PROXY": "socks5h://u:t@127.0.0.1:1080",
        "HTTP_PROXY": "http://x:y@127.0.0.1:9",
        "HTTPS_PROXY": "http://prof%2B1:tok@127.0.0.1:3128",
    }
    assert proxy_from_env(env) == Proxy("127.0.0.1", 3128, "prof+1", "tok")
    del env["HTTPS_PROXY"]
    assert proxy_from_env(env) == Proxy("127.0.0.1", 9, "x", "y")
    with pytest.raises(ConnectError, match="no http:// proxy"):
        proxy_from_env({"ALL_PROXY": "socks5h://127.0.0.1:1080"})


def test_proxy_url_errors() -> None:
    with pytest.raises(ConnectError, match="only an http:// proxy"):
        proxy_from_url("https://127.0.0.1:3128")
    assert proxy_from_url("127.0.0.1:8080") == Proxy("127.0.0.1", 8080)


def connect_request(host: str, port: int, proxy: Proxy) -> bytes:
    return ConnectClient(host, port, proxy.authorization()).request


def test_connect_request_bytes() -> None:
    request = connect_request("git.test", 22, Proxy("127.0.0.1", 3128, "egressd", "s3cret"))
    auth = base64.b64encode(b"egressd:s3cret").decode()
    assert (
        request
        == (
            f"CONNECT git.test:22 HTTP/1.1\r\nHost: git.test:22\r\nProxy-Authorization: Basic {auth}\r\n\r\n"
        ).encode()
    )
    assert connect_request("2001:db8::1", 22, Proxy("h", 1)).startswith(
        b"CONNECT [2001:db8::1]:22 HTTP/1.1\r\n"
    )


@pytest.fixture
def proxy_run(tmp_path: Path, dns: DnsServer) -> EgressdRun:
    policy = write_policy(tmp_path)
    with EgressdRun(["--policy", str(policy), "--nameserver", dns.nameserver]) as run:
        yield run


def test_tunnel_carries_bytes_both_ways(proxy_run: EgressdRun, tcp_echo: TcpEchoServer) -> None:
    data = b"ssh-like bytes \x00\xff" * 5000
    proc = subprocess.Popen(
        [*CONNECT, tcp_echo.host, str(tcp_echo.port)],
        env=proxy_run.child_env(),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
    )
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.write(data)
    proc.stdin.flush()
    echoed = b""
    while len(echoed) < len(data) and (chunk := proc.stdout.read1(65536)):
        echoed += chunk
    assert echoed == data
    # like ssh at the end of a session: stdin closes, the tunnel ends, the helper exits 0
    proc.stdin.close()
    assert proc.wait(30) == 0
    assert tcp_echo.connections == 1


def test_refusal_is_explained_on_stderr_only(proxy_run: EgressdRun, tcp_echo: TcpEchoServer) -> None:
    result = subprocess.run(
        [*CONNECT, "elsewhere.test", "22"],
        env=proxy_run.child_env(),
        input=b"x",
        capture_output=True,
        timeout=30,
    )
    assert result.returncode == 1
    assert result.stdout == b""
    text = result.stderr.decode()
    assert text.startswith("egressd connect elsewhere.test:22: the proxy answered: HTTP/1.1 403")
    # the hint names the command that runs the proxy (egressd run), not one the user is not running
    assert "(reason: not_allowlisted)" in text and "egressd run --allow elsewhere.test:22" in text


def test_wrong_token_gets_407(proxy_run: EgressdRun, tcp_echo: TcpEchoServer) -> None:
    env = proxy_run.child_env()
    url = env["HTTPS_PROXY"]
    env["HTTPS_PROXY"] = url.replace(url.split(":")[2].split("@")[0], "not-the-token")
    result = subprocess.run(
        [*CONNECT, tcp_echo.host, str(tcp_echo.port)], env=env, input=b"x", capture_output=True, timeout=30
    )
    assert result.returncode == 1 and result.stdout == b""
    assert b"407" in result.stderr and b"proxy_auth_required" in result.stderr
    assert tcp_echo.connections == 0


def test_no_proxy_configured() -> None:
    result = subprocess.run(
        [*CONNECT, "h", "22"], env={"PATH": "/usr/bin:/bin"}, capture_output=True, timeout=30
    )
    assert result.returncode == 1 and result.stdout == b""
    assert b"no http:// proxy in HTTPS_PROXY" in result.stderr
