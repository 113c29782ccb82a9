"""A small network for the `egressd ssh` tests: an "internet" and a "remote" namespace, and a real sshd.

Why: the point of `egressd ssh` is that a remote host WITHOUT a route to the internet still gets
exactly what the client's policy allows, through the client. So the tests build that topology
for real, from inside the pytest session's own namespace (the "client"):

    remote 198.18.0.2 --- 198.18.0.1  client (the test's namespace)  198.18.0.5 --- 198.18.0.6 internet
    (sshd :2222; :2223 without forwarding;         (all /30 links)         (upstream servers)
     :2224 with GatewayPorts yes)

The remote has no route to the internet; `direct_route()` adds one (a direct link
198.18.0.9 <-> 198.18.0.10 plus a route) for the remote-egress case only. Addresses are from
198.18.0.0/15 (the benchmark range), which no test-namespace address overlaps. Servers are started
INSIDE a namespace by a helper thread that joins it (setns is per thread), so the in-process
EchoHTTPServer / DnsServer with their connection counters work there unchanged. Everything is
removed on stop(): the processes in the namespaces (all started by the lab), the namespaces (which
deletes their veth ends and with them the peers), and stale namespaces of dead test runs.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any, Self

from egressd.platform.exits import alive
from tests.support.unprivileged import User

CLIENT_TO_REMOTE = "198.18.0.1"
REMOTE = "198.18.0.2"
CLIENT_TO_INTERNET = "198.18.0.5"
INTERNET = "198.18.0.6"
REMOTE_DIRECT = "198.18.0.9"
INTERNET_DIRECT = "198.18.0.10"
INTERNET_NET = "198.18.0.4/30"
SSH_PORT = 2222
NO_FORWARDING_PORT = 2223  # a `Match LocalPort` block turns TCP forwarding off there
GATEWAY_PORTS_PORT = 2224  # ... and GatewayPorts on there: forwards bind every address

PREFIX = "egressd-t-"
NETNS_DIR = Path("/run/netns")

# Runs on the remote with the remote's python3 (not the venv's): one JSON line per request.
#   name=URL          through the proxy variables egressd set (urllib reads them)
#   direct:name=URL   with every proxy disabled: the remote's own route
PROBE = r"""
import json, sys, urllib.error, urllib.request
for arg in sys.argv[1:]:
    name, _, url = arg.partition("=")
    direct = name.startswith("direct:")
    handlers = [urllib.request.ProxyHandler({})] if direct else []
    opener = urllib.request.build_opener(*handlers)
    out = {"name": name.removeprefix("direct:")}
    try:
        with opener.open(url, timeout=10) as resp:
            out.update(status=resp.status, body=resp.read().decode("utf-8", "replace"))
            headers = resp.headers
    except urllib.error.HTTPError as exc:
        out.update(status=exc.code, body=exc.read().decode("utf-8", "replace"))
        headers = exc.headers
    except OSError as exc:
        out.update(status=None, error=str(getattr(exc, "reason", exc)))
        headers = {}
    out["reason"] = headers.get("X-Egressd-Reason")
    out["proxy_status"] = headers.get("Proxy-Status")
    print(json.dumps(out), flush=True)
"""


class LabError(RuntimeError):
    """The lab cannot be built here; the message says what is missing."""


def _run(*argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(list(argv), capture_output=True, text=True, check=False)
    if check and proc.returncode != 0:
        raise LabError(f"{' '.join(argv)}: {proc.stderr.strip() or proc.returncode}")
    return proc


def netns_pids(name: str) -> list[int]:
    proc = _run("ip", "netns", "pids", name, check=False)
    return [int(p) for p in proc.stdout.split() if p.isdigit()]


def _delete_netns(name: str) -> None:
    """Kill what runs in the namespace (the lab started all of it), then remove the namespace."""
    for _ in range(50):
        pids = netns_pids(name)
        if not pids:
            break
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.05)
    _run("ip", "netns", "del", name, check=False)


def remove_stale() -> None:
    """Namespaces left by an earlier test run that died (its pid is gone)."""
    if not NETNS_DIR.is_dir():
        return
    for entry in NETNS_DIR.iterdir():
        parts = entry.name.removeprefix(PREFIX).split("-")
        if entry.name.startswith(PREFIX) and parts[0].isdigit() and not alive(int(parts[0])):
            _delete_netns(entry.name)


def call_in_netns[T](name: str, fn: Callable[[], T]) -> T:
    """Run fn in a thread that joined namespace `name`; threads fn starts stay there too."""
    box: dict[str, object] = {}

    def target() -> None:
        fd = os.open(NETNS_DIR / name, os.O_RDONLY)
        try:
            os.setns(fd, os.CLONE_NEWNET)
        finally:
            os.close(fd)
        try:
            box["value"] = fn()
        except BaseException as exc:  # handed to the caller
            box["error"] = exc

    thread = threading.Thread(target=target, name=f"in-{name}", daemon=True)
    thread.start()
    thread.join()
    if "error" in box:
        raise box["error"]  # type: ignore[misc]
    return box["value"]  # type: ignore[return-value]


class SshLab:
    """Build with start(), tear down with stop() (or use as a context manager)."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        tag = f"{os.getpid()}"
        self.remote = f"{PREFIX}{tag}-remote"
        self.internet = f"{PREFIX}{tag}-internet"
        self._veth_remote = f"egr{tag}"[:15]
        self._veth_internet = f"egi{tag}"[:15]
        self.key = workdir / "id_ed25519"
        self.known_hosts = workdir / "known_hosts"
        self.sshd_log = workdir / "sshd.log"
        self.sshd: subprocess.Popen[bytes] | None = None
        self.remote_tmp: Path | None = None

    # -- building --------------------------------------------------------------------------
    def start(self) -> Self:
        for tool in ("ip", "ssh", "ssh-keygen"):
            if shutil.which(tool) is None:
                raise LabError(f"`{tool}` is missing (bash scripts/setup.sh installs it)")
        if not Path("/usr/sbin/sshd").exists():
            raise LabError("/usr/sbin/sshd is missing: install openssh-server (bash scripts/setup.sh)")
        remove_stale()
        try:
            self._namespaces()
            self._sshd()
        except BaseException:
            self.stop()
            raise
        return self

    def _namespaces(self) -> None:
        for ns in (self.remote, self.internet):
            _run("ip", "netns", "add", ns)
            _run("ip", "-n", ns, "link", "set", "lo", "up")
        for veth, ns, here, there in (
            (self._veth_remote, self.remote, CLIENT_TO_REMOTE, REMOTE),
            (self._veth_internet, self.internet, CLIENT_TO_INTERNET, INTERNET),
        ):
            _run("ip", "link", "add", veth, "type", "veth", "peer", "name", "up0", "netns", ns)
            _run("ip", "addr", "add", f"{here}/30", "dev", veth)
            _run("ip", "link", "set", veth, "up")
            _run("ip", "-n", ns, "addr", "add", f"{there}/30", "dev", "up0")
            _run("ip", "-n", ns, "link", "set", "up0", "up")

    def _sshd(self) -> None:
        host_key = self.workdir / "ssh_host_ed25519_key"
        for path in (host_key, self.key):
            _run("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "egressd-test", "-f", str(path))
        authorized = self.workdir / "authorized_keys"
        authorized.write_text(Path(f"{self.key}.pub").read_text())
        public = Path(f"{host_key}.pub").read_text().split()
        self.known_hosts.write_text(
            "".join(
                f"[{REMOTE}]:{port} {public[0]} {public[1]}\n"
                for port in (SSH_PORT, NO_FORWARDING_PORT, GATEWAY_PORTS_PORT)
            )
        )
        # remote sessions keep their directories here, not in the machine's /tmp (short: a Unix
        # socket lives inside, and its path must stay under ~100 bytes)
        self.remote_tmp = Path(tempfile.mkdtemp(prefix="egressd-lab-", dir="/tmp"))
        self.remote_tmp.chmod(0o1777)  # like /tmp: the remote's users share it
        config = self.workdir / "sshd_config"
        config.write_text(
            f"""\
Port {SSH_PORT}
Port {NO_FORWARDING_PORT}
Port {GATEWAY_PORTS_PORT}
ListenAddress {REMOTE}
HostKey {host_key}
AuthorizedKeysFile {authorized} .ssh/authorized_keys
PidFile {self.workdir / "sshd.pid"}
PermitRootLogin yes
StrictModes no
PasswordAuthentication no
KbdInteractiveAuthentication no
UsePAM no
AllowTcpForwarding yes
GatewayPorts no
X11Forwarding no
PrintMotd no
PermitUserEnvironment PATH
LogLevel VERBOSE
MaxStartups 200
Match User root
    SetEnv TMPDIR={self.remote_tmp} EGRESSD_HOME={self.remote_tmp / "egressd-home"}
Match all
    SetEnv TMPDIR={self.remote_tmp}
Match LocalPort {NO_FORWARDING_PORT}
    AllowTcpForwarding no
    AllowStreamLocalForwarding no
Match LocalPort {GATEWAY_PORTS_PORT}
    GatewayPorts yes
"""
        )
        Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)  # sshd's privilege separation directory
        with self.sshd_log.open("wb") as log:
            self.sshd = subprocess.Popen(
                ["ip", "netns", "exec", self.remote, "/usr/sbin/sshd", "-D", "-e", "-f", str(config)],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=log,
            )
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if self.sshd.poll() is not None:
                raise LabError(f"sshd exited: {self.sshd_log.read_text()}")
            with contextlib.suppress(OSError), socket.create_connection((REMOTE, SSH_PORT), timeout=0.5):
                return
            time.sleep(0.05)
        raise LabError(f"sshd did not start listening: {self.sshd_log.read_text()}")

    # -- tearing down ----------------------------------------------------------------------
    def stop(self) -> None:
        for ns in (self.remote, self.internet):
            _delete_netns(ns)
        for veth in (self._veth_remote, self._veth_internet):
            _run("ip", "link", "del", veth, check=False)  # normally gone with its peer already
        if self.sshd is not None:
            with contextlib.suppress(ProcessLookupError):
                self.sshd.kill()
            self.sshd.wait(5)
        if self.remote_tmp is not None:
            shutil.rmtree(self.remote_tmp, ignore_errors=True)

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- using -----------------------------------------------------------------------------
    @property
    def destination(self) -> str:
        return f"ssh://root@{REMOTE}:{SSH_PORT}"

    def ssh_options(self) -> list[str]:
        """`--ssh-option` arguments: the lab's key and host key only, never the user's ~/.ssh."""
        options = [
            f"IdentityFile={self.key}",
            "IdentitiesOnly=yes",
            "IdentityAgent=none",
            "BatchMode=yes",
            f"UserKnownHostsFile={self.known_hosts}",
            "GlobalKnownHostsFile=/dev/null",
            "StrictHostKeyChecking=yes",
            "CheckHostIP=no",
        ]
        return [arg for option in options for arg in ("--ssh-option", option)]

    def destination_of(self, user: User) -> str:
        return f"ssh://{user.name}@{REMOTE}:{SSH_PORT}"

    def allow_login(self, user: User) -> None:
        """`user` may log in to the remote with the lab's key (its own ~/.ssh/authorized_keys)."""
        ssh_dir = user.home / ".ssh"
        ssh_dir.mkdir(mode=0o700, exist_ok=True)
        keys = ssh_dir / "authorized_keys"
        keys.write_text(Path(f"{self.key}.pub").read_text())
        keys.chmod(0o600)
        for path in (ssh_dir, keys):
            user.own(path)

    def client_options(self, user: User) -> list[str]:
        """`--ssh-option` arguments for `user` running the client: the lab's key and host key,
        copied into its own ~/.ssh (the lab's files are root's)."""
        ssh_dir = user.home / ".ssh"
        ssh_dir.mkdir(mode=0o700, exist_ok=True)
        key, known = ssh_dir / "lab_key", ssh_dir / "lab_known_hosts"
        shutil.copyfile(self.key, key)
        shutil.copyfile(self.known_hosts, known)
        key.chmod(0o600)
        for path in (ssh_dir, key, known):
            user.own(path)
        options = self.ssh_options()
        mine = {"IdentityFile": str(key), "UserKnownHostsFile": str(known)}
        return [_replaced(option, mine) for option in options]

    def run_as(self, user: User, *argv: str, **popen: Any) -> subprocess.Popen[bytes]:
        """A process of `user` in the remote namespace, outside any SSH session (another user of
        the remote host)."""
        return subprocess.Popen(["ip", "netns", "exec", self.remote, *user.exec(argv, user.env())], **popen)

    def in_remote[T](self, fn: Callable[[], T]) -> T:
        return call_in_netns(self.remote, fn)

    def in_internet[T](self, fn: Callable[[], T]) -> T:
        return call_in_netns(self.internet, fn)

    def run_remote(self, *argv: str, timeout: float = 30) -> subprocess.CompletedProcess[bytes]:
        """A command in the remote namespace, outside any SSH session (another user's process)."""
        return subprocess.run(
            ["ip", "netns", "exec", self.remote, *argv], capture_output=True, timeout=timeout, check=False
        )

    def connection_pids(self) -> list[int]:
        """sshd's per-connection processes (children of the listener)."""
        assert self.sshd is not None
        return [pid for pid in netns_pids(self.remote) if _ppid(pid) == self.sshd.pid]

    def drop_connections(self) -> None:
        """SIGKILL every SSH connection on the remote side: the link drops under the client."""
        for pid in self.connection_pids():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    def link_down(self) -> None:
        """The network between the client and the remote drops (neither end closes anything)."""
        _run("ip", "link", "set", self._veth_remote, "down")

    def link_up(self) -> None:
        _run("ip", "link", "set", self._veth_remote, "up")

    def kill_sessions(self) -> None:
        """SIGKILL everything in the remote namespace but sshd's listener (left-over commands).

        Returns once they are reaped, not merely dead: a zombie still answers `kill -0`, and the
        orphans' new parent (this machine's init) reaps them only after a while.
        """
        assert self.sshd is not None
        victims = [pid for pid in netns_pids(self.remote) if pid != self.sshd.pid]
        for pid in victims:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 20
        while any(Path(f"/proc/{pid}").exists() for pid in victims) and time.monotonic() < deadline:
            time.sleep(0.05)

    @contextlib.contextmanager
    def direct_route(self) -> Iterator[None]:
        """Give the remote its own route to the internet namespace (remote egress mode)."""
        _run(
            "ip",
            "-n",
            self.remote,
            "link",
            "add",
            "direct0",
            "type",
            "veth",
            "peer",
            "name",
            "direct0",
            "netns",
            self.internet,
        )
        try:
            _run("ip", "-n", self.remote, "addr", "add", f"{REMOTE_DIRECT}/30", "dev", "direct0")
            _run("ip", "-n", self.internet, "addr", "add", f"{INTERNET_DIRECT}/30", "dev", "direct0")
            _run("ip", "-n", self.remote, "link", "set", "direct0", "up")
            _run("ip", "-n", self.internet, "link", "set", "direct0", "up")
            _run("ip", "-n", self.remote, "route", "add", INTERNET_NET, "via", INTERNET_DIRECT)
            yield
        finally:
            _run("ip", "-n", self.remote, "link", "del", "direct0", check=False)


def _replaced(option: str, values: dict[str, str]) -> str:
    key = option.partition("=")[0]
    return f"{key}={values[key]}" if key in values else option


def _ppid(pid: int) -> int | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rpartition(")")[2].split()[1])


def descendants(pid: int) -> set[int]:
    """Every live process below pid (egressd's ssh clients, for the no-leftovers checks)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            parent = _ppid(int(entry.name))
            if parent is not None:
                children.setdefault(parent, []).append(int(entry.name))
    found: set[int] = set()
    todo = [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def cmdline(pid: int) -> list[str]:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return []
    return [part.decode(errors="replace") for part in raw.split(b"\0") if part]


def ssh_masters(pids: Iterable[int]) -> list[int]:
    """The ssh control masters among pids (not the small process that waits for one)."""
    return [pid for pid in pids if cmdline(pid)[:1] == ["ssh"] and "ControlMaster=yes" in cmdline(pid)]


def all_cmdlines() -> Iterator[tuple[int, str]]:
    """Every process's command line, as a remote user would see them in `ps`."""
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            yield int(entry.name), " ".join(cmdline(int(entry.name)))


def remote_egressd() -> str:
    """How the remote runs egressd in these tests: this interpreter (the remote shares the disk)."""
    return f"{sys.executable} -m egressd"
