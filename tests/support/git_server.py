"""A smart-HTTP git server over HTTPS: ``git http-backend`` run as CGI for every request.

Why: ``git clone https://...`` through egressd's TLS inspection is only proven against a real git
server. This one runs the git that is installed here as a CGI program, exactly as a web server would:
the request becomes CGI variables plus the body on stdin, and the CGI headers (``Status:``) of its
output become the HTTP response.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import trustme

from tests.support.https_app import AppHTTPSServer, Reply, Request

_IDENTITY = {
    "GIT_AUTHOR_NAME": "egressd tests",
    "GIT_AUTHOR_EMAIL": "tests@egressd.invalid",
    "GIT_COMMITTER_NAME": "egressd tests",
    "GIT_COMMITTER_EMAIL": "tests@egressd.invalid",
}


def git_env(home: Path) -> dict[str, str]:
    """An environment for git with no system or user configuration (HOME is a test folder)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("GIT_")}
    env.update(_IDENTITY)
    env.update({"HOME": str(home), "GIT_CONFIG_NOSYSTEM": "1", "GIT_TERMINAL_PROMPT": "0"})
    return env


def make_bare_repo(root: Path, name: str, files: dict[str, str], *, home: Path) -> str:
    """Create ``root/name`` (a bare repository) with one commit of ``files``; returns the commit id."""
    env = git_env(home)
    work = root / f".work-{name}"
    work.mkdir(parents=True)
    subprocess.run(["git", "init", "-q", "-b", "main", str(work)], check=True, env=env)
    for rel, text in files.items():
        (work / rel).parent.mkdir(parents=True, exist_ok=True)
        (work / rel).write_text(text)
    subprocess.run(["git", "-C", str(work), "add", "-A"], check=True, env=env)
    subprocess.run(["git", "-C", str(work), "commit", "-q", "-m", "initial"], check=True, env=env)
    commit = subprocess.run(
        ["git", "-C", str(work), "rev-parse", "HEAD"], check=True, env=env, capture_output=True, text=True
    ).stdout.strip()
    subprocess.run(["git", "clone", "-q", "--bare", str(work), str(root / name)], check=True, env=env)
    shutil.rmtree(work)
    return commit


def _cgi_reply(output: bytes) -> Reply:
    """Split CGI output into headers (``Status:`` → the HTTP status) and body."""
    for sep in (b"\r\n\r\n", b"\n\n"):
        head, found, body = output.partition(sep)
        if found:
            break
    else:
        return Reply(502, b"http-backend wrote no CGI header\n")
    status = 200
    headers: dict[str, str] = {}
    for line in head.decode("latin-1").splitlines():
        key, _, value = line.partition(":")
        if key.strip().lower() == "status":
            status = int(value.split()[0])
        elif key.strip():
            headers[key.strip()] = value.strip()
    return Reply(status, body, headers)


class GitHTTPServer(AppHTTPSServer):
    """Serves the bare repositories under ``project_root`` via ``git http-backend`` (CGI)."""

    def __init__(
        self, host: str, *, ca: trustme.CA, hostnames: list[str], project_root: Path, home: Path
    ) -> None:
        super().__init__(host, ca=ca, hostnames=hostnames, name="git-server")
        self.project_root = project_root
        self.home = home

    def handle(self, request: Request) -> Reply:
        path, _, query = request.path.partition("?")
        env = git_env(self.home)
        env.update(
            {
                "GATEWAY_INTERFACE": "CGI/1.1",
                "SERVER_PROTOCOL": "HTTP/1.1",
                "GIT_PROJECT_ROOT": str(self.project_root),
                "GIT_HTTP_EXPORT_ALL": "1",
                "PATH_INFO": path,
                "QUERY_STRING": query,
                "REQUEST_METHOD": request.method,
                "CONTENT_TYPE": request.headers.get("content-type", ""),
                "CONTENT_LENGTH": str(len(request.body)),
                "REMOTE_ADDR": "127.0.0.1",
            }
        )
        # the other request headers as CGI meta-variables: Git-Protocol (v2), Content-Encoding (gzip)
        for key, value in request.headers.items():
            if key not in ("content-type", "content-length"):
                env["HTTP_" + key.upper().replace("-", "_")] = value
        proc = subprocess.run(
            ["git", "http-backend"], input=request.body, env=env, capture_output=True, timeout=30
        )
        if proc.returncode != 0 and not proc.stdout:
            return Reply(500, proc.stderr or b"http-backend failed\n")
        return _cgi_reply(proc.stdout)
