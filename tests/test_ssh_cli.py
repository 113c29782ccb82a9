"""`egressd ssh` / `egressd remote-agent` argument handling: refused before any connection is made.

No SSH server is needed: each case must stop with exit 2 and a clear message before ssh runs.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from tests.support.egressd_cli import EGRESSD


def egressd(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*EGRESSD, *args], capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL
    )


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["me@-oProxyCommand=touch /tmp/x"], "must not start with '-'"),
        (["ssh://host:99999"], "port must be 1-65535"),
        (["--ssh-option", "ControlPath=/tmp/c", "host"], "manages ControlPath itself"),
        (["--ssh-option", "Port", "host"], "expected KEY=VALUE"),
        (["--ssh-option", "ForwardAgent=yes", "host"], "never forwards the ssh agent, X11 or a tunnel"),
        (["--ssh-option", "ForwardX11=yes", "host"], "never forwards the ssh agent, X11 or a tunnel"),
        (["--ssh-option", "Tunnel=yes", "host"], "never forwards the ssh agent, X11 or a tunnel"),
        (["--listen", "0.0.0.0:0", "host"], "loopback only"),
        (["--egress", "elsewhere", "host"], "'elsewhere' is not one of"),
        (["--sandbox", "host"], "it needs --egress remote"),
        (["--rw", "/tmp", "--egress", "remote", "host"], "--rw is for --sandbox"),
    ],
)
def test_bad_arguments_exit_2_before_connecting(args: list[str], message: str, tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    result = egressd("ssh", *args, "--", "touch", str(marker))
    assert result.returncode == 2, result.stderr
    assert message in result.stderr
    assert not marker.exists()


def test_bad_policy_exits_2_before_connecting(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("version: 1\nallow: ['exa mple.com']\n")
    for mode in ("client", "remote"):
        # 198.51.100.99:9 would hang or refuse: a policy error must come first, without connecting
        result = egressd("ssh", "--egress", mode, "--policy", str(bad), "ssh://198.51.100.99:9", "--", "true")
        assert result.returncode == 2, result.stderr
        assert "allow[0]" in result.stderr and "could not connect" not in result.stderr


def test_ssh_help_lists_exec_options_and_modes() -> None:
    result = egressd("ssh", "--help")
    assert result.returncode == 0
    for option in (
        "--policy",
        "--allow",
        "--profile",
        "--audit",
        "--trace",
        "--ssh-option",
        "--egress",
        "--remote-egressd",
    ):
        assert option in result.stdout


def test_remote_agent_refuses_a_policy_of_its_own(tmp_path: Path) -> None:
    policy = tmp_path / "remote.yaml"
    policy.write_text("version: 1\nmode: allow\n")
    result = egressd(
        "remote-agent", "run", "--channel", str(tmp_path / "c.sock"), "--policy", str(policy), "--", "true"
    )
    assert result.returncode == 2
    assert "takes its policy from the SSH connection only" in result.stderr


def test_remote_agent_without_a_channel_does_not_run_the_command(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    result = egressd(
        "remote-agent", "run", "--channel", str(tmp_path / "none.sock"), "--", "touch", str(marker)
    )
    assert result.returncode == 2
    assert "cannot reach the policy channel" in result.stderr
    assert not marker.exists()


def test_remote_agent_is_hidden() -> None:
    assert "remote-agent" not in egressd("--help").stdout
