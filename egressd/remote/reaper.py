"""The guard of a remote session: what the command connects to, and all it starts, end with it.

Why: when SSH drops, sshd only closes the command's pipes. A command (or a child it detached with
setsid or a double fork) lives on with the proxy credentials but no egressd in control, and a port
it connects to that nobody holds can be bound by another user of the remote host, who then
receives its requests. So the guard

* holds every TCP port the command is told to connect to (it binds them itself on the remote's
  loopback): the port is never free while anything of the command runs. In relay mode the guard
  relays each connection to a Unix-socket remote forward in the session's 0700 directory (no
  other user can connect to or bind anything there); in remote-egress mode it hands the listening
  sockets to egressd's agent (LISTEN_FDS) and keeps its own copies;
* is the command's child subreaper (Linux): every orphan below it is re-parented to it, so its
  descendants are the whole tree, `setsid` and double forks included;
* notices the session's end (sshd's session process, its parent, dies: PR_SET_PDEATHSIG delivers
  SIGHUP; SIGHUP/SIGTERM; a changed parent pid) and then at once freezes the tree (SIGSTOP), stops
  relaying, and only then hangs it up (SIGHUP, SIGKILL after 5 s); the ports are released when
  nothing of the tree is left;
* gives its child a parent-death signal (SIGKILL), so the child does not outlive a guard that is
  killed.

Used twice: run as a script by the remote's own python3 in relay mode (`python3 -I -S reaper.py
DIR CMD...`, uploaded into the session directory), and imported by `egressd remote-agent guard`
(remote egress mode, whose child is `egressd remote-agent run`). So this file uses the standard
library only, and Python 3.7 syntax at most.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import shutil
import signal
import socket
import sys
import threading
import time

PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36
HANGUP_GRACE = 5.0
LEFTOVER_GRACE = 1.0
PID_NAME = "pid"
PLAN_NAME = "env"
SESSION_LOST = 255
# In a plan's environment values, "\0NAME\0" stands for the port of listener NAME (known only
# once the guard bound it). An environment value can never hold a NUL, so this never collides.
MARK = "\0"


def port_mark(name: str) -> str:
    return MARK + name + MARK


def _prctl(option: int, value: int) -> bool:
    if not sys.platform.startswith("linux"):
        return False
    try:
        import ctypes

        return ctypes.CDLL(None, use_errno=True).prctl(option, value, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def become_subreaper() -> bool:
    """Orphans below this process come to it instead of init (Linux); False where unsupported."""
    return _prctl(PR_SET_CHILD_SUBREAPER, 1)


def die_with_parent(signo: int) -> bool:
    """This process gets `signo` when its parent dies (Linux); kept across exec."""
    return _prctl(PR_SET_PDEATHSIG, signo)


def _parents() -> dict[int, list[int]] | None:
    """parent pid -> live (non-zombie) children, from /proc; None without /proc."""
    try:
        entries = os.listdir("/proc")
    except OSError:
        return None
    children: dict[int, list[int]] = {}
    for name in entries:
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as stat:
                fields = stat.read().rpartition(b")")[2].split()
        except OSError:
            continue
        if len(fields) > 1 and fields[0] != b"Z":
            children.setdefault(int(fields[1]), []).append(int(name))
    return children


def descendants(root: int) -> list[int] | None:
    """Every live process below root; None when the platform cannot tell (no /proc)."""
    children = _parents()
    if children is None:
        return None
    found: list[int] = []
    todo = [root]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found:
                found.append(child)
                todo.append(child)
    return found


def reap() -> list[tuple[int, int]]:
    """Collect every exited child: (pid, wait status) pairs."""
    done = []
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return done
        if pid == 0:
            return done
        done.append((pid, status))


def exit_code(status: int) -> int:
    """os.waitstatus_to_exitcode, which Python < 3.9 lacks."""
    if os.WIFSIGNALED(status):
        return -os.WTERMSIG(status)
    return os.WEXITSTATUS(status)


def _signal_all(pids: list[int], signo: int) -> None:
    for pid in pids:
        with contextlib.suppress(OSError):
            os.kill(pid, signo)


def freeze(root: int) -> None:
    """SIGSTOP every process below root, again until a round finds none it had not stopped.

    A stopped process cannot fork, so a child forked meanwhile is found by the next round.
    """
    stopped: set[int] = set()
    for _ in range(1000):
        pids = descendants(root)
        if pids is None:
            return  # without /proc nothing can be told apart (the group holds this process too)
        new = [pid for pid in pids if pid not in stopped]
        if not new:
            return
        _signal_all(new, signal.SIGSTOP)
        stopped.update(new)


def end_tree(
    root: int, group: int | None = None, grace: float = HANGUP_GRACE, *, collect: bool = True
) -> list[tuple[int, int]]:
    """SIGHUP every process below root, SIGKILL what is left after `grace` s; reap them all.

    Killing repeats until nothing is left: a process forked meanwhile is re-parented to the
    subreaper and found by the next round. Without /proc, the command's process `group` only
    gets SIGHUP (the caller must handle SIGHUP itself).
    Returns the wait statuses reaped on the way (the command's may be among them); with
    `collect=False` nothing is reaped (another thread waits for its child itself).
    """
    gather = reap if collect else (lambda: [])
    reaped = gather()
    pids = descendants(root)
    if pids is None:
        # no /proc: the hang-up a terminal would send, to the command's group (this one's too)
        if group is not None:
            for signo in (signal.SIGHUP, signal.SIGCONT):
                with contextlib.suppress(OSError):
                    os.killpg(group, signo)
            time.sleep(min(grace, 1.0))
        return reaped + gather()
    if not pids:
        return reaped
    _signal_all(pids, signal.SIGHUP)
    _signal_all(pids, signal.SIGCONT)
    deadline = time.monotonic() + grace
    while pids and time.monotonic() < deadline:
        time.sleep(0.05)
        reaped += gather()
        pids = descendants(root) or []
    for _ in range(1000):
        if not pids:
            break
        _signal_all(pids, signal.SIGKILL)
        time.sleep(0.01)
        reaped += gather()
        pids = descendants(root) or []
    return reaped + gather()


def _die_like(code: int) -> None:
    """Exit with the command's status; die of its signal (sshd then reports that signal)."""
    if code < 0:
        signo = -code
        with contextlib.suppress(OSError, ValueError):
            signal.signal(signo, signal.SIG_DFL)
        os.kill(os.getpid(), signo)
        time.sleep(1.0)
        os._exit(128 + signo)
    os._exit(code)


# -- the ports the command connects to --------------------------------------------------------------
def _pump(src: socket.socket, dst: socket.socket) -> None:
    """src → dst until EOF, then half-close dst; any error ends both directions."""
    try:
        while True:
            block = src.recv(65536)
            if not block:
                break
            dst.sendall(block)
        dst.shutdown(socket.SHUT_WR)
    except OSError:
        for sock in (src, dst):
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)


class Listener:
    """One loopback port the guard holds; `relay` is the Unix socket it relays to, if any."""

    def __init__(self, name: str, host: str, port: int, relay: str | None) -> None:
        self.name = name
        self.relay = relay
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.sock = socket.socket(family, socket.SOCK_STREAM)
        self.sock.bind((host, port))
        self.sock.listen(128)
        self.port = self.sock.getsockname()[1]


class Ports:
    """The listeners of a session: held from before the command starts until its tree is gone."""

    def __init__(self, listeners: list[Listener]) -> None:
        self.listeners = listeners
        self._open = True
        self._lock = threading.Lock()
        self._active: set[socket.socket] = set()
        self._threads: list[threading.Thread] = []

    def start_relays(self) -> None:
        for listener in self.listeners:
            if listener.relay is not None:
                thread = threading.Thread(target=self._accept, args=(listener,), daemon=True)
                thread.start()
                self._threads.append(thread)

    def _accept(self, listener: Listener) -> None:
        while self._open:
            ready, _, _ = select.select([listener.sock], [], [], 0.2)
            if not ready or not self._open:
                continue
            try:
                client, _ = listener.sock.accept()
            except OSError:
                continue
            threading.Thread(target=self._serve, args=(client, listener.relay), daemon=True).start()

    def _serve(self, client: socket.socket, path: str) -> None:
        upstream = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        with self._lock:
            if not self._open:
                client.close()
                upstream.close()
                return
            self._active.update((client, upstream))
        try:
            upstream.connect(path)
            back = threading.Thread(target=_pump, args=(upstream, client), daemon=True)
            back.start()
            _pump(client, upstream)
            back.join()
        except OSError:
            pass
        finally:
            with self._lock:
                self._active.difference_update((client, upstream))
            client.close()
            upstream.close()

    def stop_relaying(self) -> None:
        """No connection is relayed from now on; the ports stay held (close() releases them)."""
        with self._lock:
            self._open = False
            active = list(self._active)
        for sock in active:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        self.stop_relaying()
        for thread in self._threads:
            thread.join(1.0)
        for listener in self.listeners:
            listener.sock.close()


def _listener(directory: str, item: dict) -> Listener:
    """A listener of the plan: {"name", "host", "port", "relay": a socket name in the directory}."""
    relay = item.get("relay")
    if relay is not None and ("/" in relay or relay in ("", ".", "..")):
        raise ValueError(f"not a plain file name: {relay!r}")
    path = os.path.join(directory, relay) if relay is not None else None
    return Listener(str(item["name"]), str(item.get("host", "127.0.0.1")), int(item.get("port", 0)), path)


def read_plan(directory: str) -> dict:
    """The session's plan, written by the client (JSON): read once, then deleted (it holds the
    proxy credentials). Without one nothing runs: a command must never start without the
    environment its client meant it to have."""
    path = os.path.join(directory, PLAN_NAME)
    with open(path, "rb") as source:
        data = source.read()
    os.unlink(path)
    plan = json.loads(data.decode("utf-8"))
    if not isinstance(plan, dict):
        raise ValueError("the session plan is not a JSON object")
    return plan


def child_environment(directory: str, plan: dict, ports: dict[str, int]) -> dict[str, str]:
    """The command's environment: ours, minus the plan's `unset`, plus its `set` (ports filled
    in) and `files` (names of files in the session directory)."""
    env = dict(os.environ)
    for name in plan.get("unset", []):
        env.pop(name, None)
    for name, value in plan.get("set", {}).items():
        for port_name, port in ports.items():
            value = value.replace(port_mark(port_name), str(port))
        if MARK in value:
            raise ValueError(f"the session plan names an unknown port in {name}")
        env[name] = value
    for name, file_name in plan.get("files", {}).items():
        if "/" in file_name or file_name in ("", ".", ".."):
            raise ValueError(f"not a plain file name: {file_name!r}")
        env[name] = os.path.join(directory, file_name)
    return env


def _start(command: list[str], env: dict[str, str], handed: list[Listener]) -> int:
    """fork + exec the command: it dies with the guard, and gets the `handed` listening sockets
    as fds 3, 4, ... (LISTEN_FDS, as systemd's socket activation hands them)."""
    guard = os.getpid()
    pid = os.fork()
    if pid != 0:
        return pid
    try:
        die_with_parent(signal.SIGKILL)
        if os.getppid() != guard:
            os._exit(SESSION_LOST)
        signal.set_wakeup_fd(-1)
        for signo in (signal.SIGHUP, signal.SIGTERM, signal.SIGCHLD, signal.SIGINT, signal.SIGQUIT):
            signal.signal(signo, signal.SIG_DFL)
        for name in ("SIGPIPE", "SIGXFSZ"):  # ignored by Python; an ignored signal survives exec
            if hasattr(signal, name):
                signal.signal(getattr(signal, name), signal.SIG_DFL)
        if handed:
            high = [os.dup(listener.sock.fileno()) for listener in handed]  # out of the way of 3, 4..
            for index, fd in enumerate(high):
                os.dup2(fd, 3 + index)  # dup2 makes the new fd inheritable
                os.close(fd)
            env = dict(env)
            env["LISTEN_PID"] = str(os.getpid())
            env["LISTEN_FDS"] = str(len(handed))
            env["LISTEN_FDNAMES"] = ":".join(listener.name for listener in handed)
        os.execvpe(command[0], command, env)
    except OSError as exc:
        with contextlib.suppress(OSError):
            os.write(2, f"{command[0]}: {exc.strerror}\n".encode(errors="replace"))
        os._exit(127 if isinstance(exc, FileNotFoundError) else 126)
    finally:
        os._exit(126)  # never return into the guard's code in the child


def guard(directory: str, command: list[str]) -> None:
    """Run command under the plan in `directory`; end all it started when it or the session ends.

    Exits like the command, or with 255 when the session ends first, once the tree is gone and the
    session directory removed (in either case: the client may no longer be there to remove it).
    The guard lets go of stdin/stdout/stderr once the command runs, so the command's end-of-file
    on them reaches the client as if no guard were there.
    """
    parent = os.getppid()
    become_subreaper()
    stops: list[int] = []
    wake_read, wake_write = os.pipe()
    for fd in (wake_read, wake_write):
        os.set_blocking(fd, False)
    signal.set_wakeup_fd(wake_write)

    def stop(signo: int, frame: object) -> None:
        stops.append(signo)

    for signo in (signal.SIGHUP, signal.SIGTERM):
        signal.signal(signo, stop)
    signal.signal(signal.SIGCHLD, lambda signo, frame: None)  # wakes the loop below
    for signo in (signal.SIGINT, signal.SIGQUIT):
        # a terminal sends these to the whole foreground group: they are for the command
        signal.signal(signo, lambda signo, frame: None)
    die_with_parent(signal.SIGHUP)
    if os.getppid() != parent:
        stops.append(signal.SIGHUP)
    try:
        plan = read_plan(directory)
        listeners = [_listener(directory, item) for item in plan.get("listen", [])]
        ports = Ports(listeners)
        env = child_environment(directory, plan, {listener.name: listener.port for listener in listeners})
    except (OSError, ValueError, KeyError, TypeError) as exc:
        sys.stderr.write(f"egressd (remote): cannot start the session: {exc}\n")
        sys.stderr.flush()
        os._exit(2)
    pid = _start(command, env, [listener for listener in listeners if listener.relay is None])
    group = os.getpgrp()
    record = os.path.join(directory, PID_NAME)
    with open(record + ".new", "w") as out:
        out.write(f"{pid}\n")
    os.replace(record + ".new", record)
    ports.start_relays()
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)
    os.close(null)
    code: int | None = None
    while code is None:
        for done, status in reap():
            if done == pid:
                code = exit_code(status)
        if code is not None:
            break
        if stops or os.getppid() != parent:
            _hang_up(directory, ports, group)
        select.select([wake_read], [], [], 0.5)
        with contextlib.suppress(OSError):
            os.read(wake_read, 512)
    end_tree(os.getpid(), group, grace=LEFTOVER_GRACE)  # what the command left behind
    ports.close()
    shutil.rmtree(directory, ignore_errors=True)  # the client may not be there to remove it
    _die_like(code)


def _hang_up(directory: str, ports: Ports, group: int) -> None:
    """The session ended: freeze the tree at once, stop relaying, then hang it up; the ports go
    last, with nothing of the tree left to connect to them."""
    me = os.getpid()
    freeze(me)
    ports.stop_relaying()
    end_tree(me, group)
    ports.close()
    shutil.rmtree(directory, ignore_errors=True)
    os._exit(SESSION_LOST)


if __name__ == "__main__":
    guard(sys.argv[1], sys.argv[2:])
