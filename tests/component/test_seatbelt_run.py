"""egressd's macOS run path on Linux, with a stand-in for sandbox-exec.

The stand-in is a real executable script: it loads no profile (there is no Seatbelt here) but
answers the preflight as it is told and then runs the command, so everything egressd does around
the sandbox runs for real: the profile preflight (a profile sandbox-exec refuses is reported as
that, never as the child's exit status), the child's environment and inherited descriptors, its
own temporary directory and process group, and what is removed and killed when it ends. What the
profile itself allows is checked in tests/component/test_seatbelt_invariants.py.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from egressd.admission.credentials import ProxyCredentials
from egressd.child.process import child_signal_catcher
from egressd.platform.exits import EXIT_CANNOT_RUN
from egressd.sandbox import runner
from egressd.sandbox.layout import Layout
from egressd.sandbox.mounts import Mount

FAKE_SANDBOX_EXEC = """#!/bin/sh
# $1 is -p, $2 the profile; then /usr/bin/true (the preflight) or -- and the command
printf '%s\\n' "$3" >> "$FAKE_LOG"
if [ "$3" = /usr/bin/true ]; then
  if [ -n "$FAKE_REFUSE" ]; then
    echo 'sandbox-exec: unbound variable: TIOCSTI at <input string>, line 132, column 33' >&2
    exit 65
  fi
  exit 0
fi
printf '%s' "$2" > "$FAKE_LOG.profile"
shift 3
exec "$@"
"""


class _Proxy:
    http_address = ("127.0.0.1", 49152)
    socks_address = ("127.0.0.1", 49153)


class _Session:
    """What run_seatbelt reads of a session: the proxy's addresses, no CA, no secrets."""

    proxy = _Proxy()
    ca_bundle = None

    def __init__(self) -> None:
        from egressd.policy import parse_policy

        self.policy = parse_policy({"version": 1, "allow": ["github.com:22"]}, "p.yaml")

    def placeholders(self) -> dict[str, str]:
        return {}

    def hidden_variables(self) -> tuple[str, ...]:
        return ()

    def load(self) -> None:
        """The proxy's load once the child is on its way: this proxy serves nothing, so none."""


@pytest.fixture
def fake(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    script = tmp_path / "sandbox-exec"
    script.write_text(FAKE_SANDBOX_EXEC)
    script.chmod(0o755)
    monkeypatch.setenv("FAKE_LOG", str(tmp_path / "log"))
    monkeypatch.setenv("HTTPS_PROXY", "http://inherited.example:1")
    yield script


def _run(fake: Path, tmp_path: Path, command: list[str], layout: Layout | None = None) -> runner.Outcome:
    catcher = child_signal_catcher()
    try:
        return runner.run_seatbelt(
            _Session(),  # type: ignore[arg-type]
            ProxyCredentials("egressd", "tok"),
            command,
            layout or Layout((Mount(str(tmp_path), True),), (), (), ()),
            sandbox_exec=str(fake),
            catcher=catcher,
        )
    finally:
        catcher.uninstall()


def test_a_profile_sandbox_exec_refuses_is_reported_as_that(
    fake: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """sandbox-exec exits 65 on a profile it cannot load: egressd says the sandbox did not start
    (with sandbox-exec's words) and runs nothing, instead of exiting 65 as if the child had."""
    monkeypatch.setenv("FAKE_REFUSE", "1")
    ran = tmp_path / "ran"
    outcome = _run(fake, tmp_path, ["touch", str(ran)])
    assert not outcome.started and outcome.returncode == EXIT_CANNOT_RUN
    assert outcome.error is not None
    assert "refused egressd's sandbox profile (exit status 65" in outcome.error
    assert "unbound variable: TIOCSTI" in outcome.error
    assert (tmp_path / "log").read_text().splitlines() == ["/usr/bin/true"]
    assert not ran.exists()


def _gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return True
    return state == "Z"


def test_the_child_gets_its_own_temp_dir_no_stray_descriptor_and_leaves_nothing_running(
    fake: Path, tmp_path: Path
) -> None:
    stray = os.open(tmp_path, os.O_RDONLY)  # what egressd's own parent might have left open
    os.set_inheritable(stray, True)
    out = tmp_path / "out"
    script = (
        'printf "%s\\n" "$TMPDIR" "$TMP" "$TEMP" "$npm_config_cache" "$HTTPS_PROXY" "$EGRESSD_SANDBOX" '
        '> "$1"; '
        'ls /proc/self/fd > "$1.fds"; echo made > "$TMPDIR/made"; '
        'sleep 300 & echo $! > "$1.pid"; exit 3'
    )
    try:
        outcome = _run(fake, tmp_path, ["sh", "-c", script, "sh", str(out)])
    finally:
        os.close(stray)
    assert outcome.started and outcome.returncode == 3
    temp, tmp, temp2, npm_cache, proxy, kind = out.read_text().splitlines()
    assert temp == tmp == temp2 and os.path.basename(temp).startswith("egressd-run-")
    assert os.path.dirname(temp) == runner.temp_root(os.environ)
    assert npm_cache == os.path.join(temp, ".egressd-cache", "npm")
    assert proxy == "http://egressd:tok@127.0.0.1:49152" and kind == "seatbelt"
    assert not os.path.exists(temp)  # removed with what the child made in it
    assert str(stray) not in (tmp_path / "out.fds").read_text().split()
    leftover = int((tmp_path / "out.pid").read_text())
    deadline = time.monotonic() + 10
    while not _gone(leftover) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _gone(leftover), "the child's background process outlived the run"
    profile = (tmp_path / "log.profile").read_text()
    assert profile.startswith("(version 1)") and f'(subpath "{temp}")' in profile
    assert (tmp_path / "log").read_text().splitlines() == ["/usr/bin/true", "--"]


def test_an_unquotable_path_runs_nothing(fake: Path, tmp_path: Path) -> None:
    outcome = _run(fake, tmp_path, ["true"], Layout((Mount(f"{tmp_path}/a\nb", True),), (), (), ()))
    assert not outcome.started and outcome.returncode == EXIT_CANNOT_RUN
    assert outcome.error and "control character" in outcome.error
    assert not (tmp_path / "log").exists()
