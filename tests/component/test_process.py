"""Child process pass-through with real processes: exit status, signals, stdio byte for byte."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

# A minimal wrapper: what `egressd exec` does around the child, without the proxy.
WRAPPER = """
import os, sys
from egressd.child.process import child_signal_catcher, exit_like, run_child
catcher = child_signal_catcher().install()
exit_like(run_child(sys.argv[1:], os.environ, catcher=catcher))
"""

# A child that reports the signals it gets on stdout, then exits 0 on SIGTERM/after a while. It
# writes with os.write: a handler that prints while "ready" is still being printed fails.
COUNTER = """
import os, signal, sys, time
got = []
def handler(signo, frame):
    got.append(signo)
    os.write(1, f"got {signal.Signals(signo).name}\\n".encode())
    if signo == signal.SIGTERM:
        sys.exit(len([s for s in got if s == signal.SIGINT]))
for s in (signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2, signal.SIGHUP, signal.SIGWINCH, signal.SIGTERM):
    signal.signal(s, handler)
os.write(1, b"ready\\n")
deadline = time.monotonic() + 30
while time.monotonic() < deadline:
    time.sleep(0.05)
sys.exit(99)
"""


def wrap(*argv: str) -> list[str]:
    return [sys.executable, "-c", WRAPPER, *argv]


def run(*argv: str, **kw: object) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(wrap(*argv), capture_output=True, timeout=30, **kw)  # type: ignore[call-overload]


def start_counter() -> subprocess.Popen[bytes]:
    proc = subprocess.Popen(
        wrap(sys.executable, "-c", COUNTER), stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    assert proc.stdout is not None
    assert proc.stdout.readline() == b"ready\n"
    return proc


def test_exit_code_passes_through() -> None:
    assert run(sys.executable, "-c", "import sys; sys.exit(3)").returncode == 3
    assert run("true").returncode == 0


def test_child_killed_by_signal_kills_us_with_the_same_signal() -> None:
    result = run(sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGTERM)")
    assert result.returncode == -signal.SIGTERM
    result = run(sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGKILL)")
    assert result.returncode == -signal.SIGKILL


def _quit_at_default() -> None:
    """SIGQUIT at its default action in the wrapper, as under a terminal: a background job of a
    non-interactive shell (`cmd &`) inherits it ignored, and the wrapper rightly passes an ignored
    signal on to its child, whose `kill -QUIT $$` would then do nothing."""
    signal.signal(signal.SIGQUIT, signal.SIG_DFL)


def test_core_signal_passes_through_without_a_core_file(tmp_path: Path) -> None:
    result = run("sh", "-c", "kill -QUIT $$", cwd=tmp_path, preexec_fn=_quit_at_default)
    assert result.returncode == -signal.SIGQUIT
    assert not list(tmp_path.glob("core*"))


def test_sigterm_to_wrapper_is_forwarded() -> None:
    proc = start_counter()
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=20)
    assert b"got SIGTERM" in out
    assert proc.returncode == 0  # the child's own exit status (no SIGINT seen)


def test_sigterm_to_wrapper_with_default_child_dies_with_sigterm() -> None:
    proc = subprocess.Popen(wrap("sleep", "30"))
    time.sleep(0.5)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=20) == -signal.SIGTERM


def test_sigint_and_user_signals_are_forwarded_once() -> None:
    proc = start_counter()
    assert proc.stdout is not None
    for signo in (signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2, signal.SIGHUP, signal.SIGWINCH):
        proc.send_signal(signo)
        assert proc.stdout.readline() == f"got {signo.name}\n".encode()
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=20)
    assert out == b"got SIGTERM\n", err
    assert proc.returncode == 1  # exactly one SIGINT reached the child


def test_stdio_passthrough_is_byte_exact() -> None:
    data = bytes(range(256)) * 4096 + b"\r\n\x00\xff"
    result = run("cat", input=data)
    assert result.returncode == 0
    assert result.stdout == data
    assert result.stderr == b""


def test_stderr_passthrough_and_nothing_added() -> None:
    script = "import sys; sys.stdout.buffer.write(b'out\\x00'); sys.stderr.buffer.write(b'err\\xff')"
    result = run(sys.executable, "-c", script)
    assert (result.stdout, result.stderr) == (b"out\x00", b"err\xff")


def test_child_sees_a_terminal_stdin_unchanged() -> None:
    # No pipes in between: the child gets the very same file as stdin.
    script = "import os, sys; print(os.fstat(0).st_ino)"
    with open(os.devnull, "rb") as devnull:
        result = run(sys.executable, "-c", script, stdin=devnull)
    assert int(result.stdout) == os.stat(os.devnull).st_ino


def test_missing_command_is_127() -> None:
    result = run("egressd-no-such-command-xyz")
    assert result.returncode == 127
    assert result.stderr == b"egressd: egressd-no-such-command-xyz: command not found\n"
    assert result.stdout == b""


def test_missing_path_is_127_and_not_executable_is_126(tmp_path: Path) -> None:
    result = run(str(tmp_path / "nope"))
    assert result.returncode == 127 and b"No such file or directory" in result.stderr
    script = tmp_path / "script.sh"
    script.write_text("#!/bin/sh\necho hi\n")
    result = run(str(script))
    assert result.returncode == 126 and b"Permission denied" in result.stderr


def test_child_signal_mask_and_dispositions_are_clean() -> None:
    # The wrapper blocks signals for itself; the child must not inherit that, nor Python's SIG_IGN.
    result = run("cat", "/proc/self/status")
    status = dict(line.split(":\t", 1) for line in result.stdout.decode().splitlines() if ":\t" in line)
    assert int(status["SigBlk"], 16) == 0
    assert int(status["SigIgn"], 16) & (1 << (signal.SIGPIPE - 1)) == 0


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="pty job control semantics")
def test_terminal_ctrl_c_reaches_the_child_once(tmp_path: Path) -> None:
    """Ctrl-C on a terminal goes to the whole foreground group: egressd must not deliver it again."""
    import fcntl
    import pty
    import termios

    master, slave = pty.openpty()

    def take_terminal() -> None:
        fcntl.ioctl(0, termios.TIOCSCTTY, 0)

    out = tmp_path / "out"
    with open(out, "wb") as sink:
        proc = subprocess.Popen(
            wrap(sys.executable, "-c", COUNTER),
            stdin=slave,
            stdout=sink,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=take_terminal,  # runs after setsid(): the pty becomes the controlling tty
        )
    os.close(slave)
    try:
        deadline = time.monotonic() + 20
        while b"ready" not in out.read_bytes():
            assert time.monotonic() < deadline
            time.sleep(0.05)
        os.write(master, b"\x03")  # the tty driver sends SIGINT to the foreground process group
        deadline = time.monotonic() + 20
        while b"got SIGINT" not in out.read_bytes():
            assert time.monotonic() < deadline
            time.sleep(0.05)
        time.sleep(0.5)  # a duplicate delivery would arrive by now
        proc.send_signal(signal.SIGTERM)  # SI_USER: forwarded
        assert proc.wait(timeout=20) == 1, out.read_bytes()  # the child counted one SIGINT
    finally:
        if proc.poll() is None:
            proc.kill()
        os.close(master)
    assert out.read_bytes().count(b"got SIGINT") == 1
