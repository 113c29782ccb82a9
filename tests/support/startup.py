"""What the start-up tests of `egressd exec` and `egressd sandbox` share: the list of modules a
process imported (`python -X importtime` on its stderr), the cut of that list where egressd lets
the child start, and a child that connects the instant it starts."""

from __future__ import annotations

import os
import subprocess
import textwrap
from pathlib import Path

MARK = "egressd-test: the child is let start"
# `egressd` with the setup pipe's end marked (where the launcher is let start the child): run as
# `python -m egressd` runs it, the real command unchanged
MARKED = textwrap.dedent(
    f"""
    import os, sys
    del sys.path[0]  # as python -m egressd: the working directory is the sandbox's, never imported from
    from egressd.sandbox.launch import LauncherLink
    end_setup = LauncherLink.end_setup
    def marked(self):
        if self.setup_w >= 0:
            os.write(2, {(MARK + chr(10)).encode()!r})
        end_setup(self)
    LauncherLink.end_setup = marked
    from egressd.entry import main
    main()
    """
)

# what only serving a connection needs: loaded once the child was let start (a subpackage listed
# here stands for all of it)
SERVING = (
    "egressd.admission.pipeline",
    "egressd.admission.resolve",
    "egressd.front.server",
    "egressd.front.tunnel",
    "egressd.front.plain_http",
    "egressd.front.socks",
    "egressd.front.relay",
    "egressd.wire.http1",
    "egressd.inspect.engine",
    "h11",
    "uvloop",
    "asyncio",  # the event loop, loaded in the proxy's thread
    "ssl",
    "egressd.admission.identity",  # which program holds a connection
    "egressd.platform.peer",
    "logging",  # with the proxy's modules, or with a first message
    "concurrent.futures",  # with the resolver's load
)


def imported(result: subprocess.CompletedProcess[str]) -> set[str]:
    names = set()
    for line in result.stderr.splitlines():
        if line.startswith("import time:") and line.count("|") == 2:
            names.add(line.rsplit("|", 1)[1].strip())
    assert "egressd.session.proxy" in names, result.stderr[-2000:]  # the listing is there
    return names


def loaded_before_the_child(result: subprocess.CompletedProcess[str]) -> set[str]:
    before, marked, _ = result.stderr.partition(MARK)
    assert marked, result.stderr[-3000:]
    return imported(subprocess.CompletedProcess(result.args, result.returncode, "", before))


def among(names: set[str], listed: tuple[str, ...]) -> list[str]:
    """The names that are one of `listed` or inside one of them."""
    return sorted(n for n in names for p in listed if n == p or n.startswith(p + "."))


def immediate_client(allowed: int, refused: int) -> str:
    """A child that opens two connections to its proxy (HTTP_PROXY) the instant it starts, asks
    one for 127.0.0.1:`allowed`, the other for 127.0.0.1:`refused`, and prints for each its status
    and egressd's reason, one line each."""
    return textwrap.dedent(
        f"""
        import base64, os, socket, urllib.parse
        proxy = urllib.parse.urlsplit(os.environ["HTTP_PROXY"])
        conns = [socket.create_connection((proxy.hostname, proxy.port), timeout=60) for _ in range(2)]
        user = urllib.parse.unquote(proxy.username or "") + ":" + urllib.parse.unquote(proxy.password or "")
        auth = base64.b64encode(user.encode()).decode()
        for conn, port in zip(conns, ({allowed}, {refused})):
            conn.sendall(
                f"GET http://127.0.0.1:{{port}}/now HTTP/1.1\\r\\nHost: 127.0.0.1:{{port}}\\r\\n"
                f"Proxy-Authorization: Basic {{auth}}\\r\\nConnection: close\\r\\n\\r\\n".encode()
            )
        for conn in conns:
            data = b""
            while chunk := conn.recv(65536):
                data += chunk
            head = data.split(b"\\r\\n\\r\\n", 1)[0].decode("latin-1").split("\\r\\n")
            fields = [f.partition(":") for f in head[1:]]
            reason = [v.strip() for k, _, v in fields if k.lower() == "x-egressd-reason"]
            print(head[0].split(" ")[1], *reason)
        """
    )


def first_on_path(directory: Path, env: dict[str, str]) -> dict[str, str]:
    """`env` with `directory` first on PYTHONPATH. Never an empty entry: Python reads one as the
    working directory, and egressd then refuses a sandbox whose writable directory it imports from."""
    parts = [str(directory), *filter(None, env.get("PYTHONPATH", "").split(os.pathsep))]
    return {**env, "PYTHONPATH": os.pathsep.join(parts)}


def broken_h11(directory: Path) -> Path:
    """A directory to put first on PYTHONPATH: its h11 (which only serving imports) fails to load."""
    package = directory / "broken" / "h11"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text('raise ImportError("h11 cannot be loaded (a test\'s stand-in)")\n')
    return package.parent


def unstartable_sites(directory: Path) -> Path:
    """A directory to put first on PYTHONPATH: its sitecustomize makes every site of a session's
    services (the control API, the dashboard, the metrics port) fail to start on the proxy's loop."""
    where = directory / "unstartable"
    where.mkdir(parents=True)
    (where / "sitecustomize.py").write_text(
        "from egressd.control import site\n\n"
        "async def start(self):\n"
        "    raise OSError(f'{self._name}: its socket cannot be served (a test\\'s stand-in)')\n\n"
        "site.LazySite.start = start\n"
    )
    return where
