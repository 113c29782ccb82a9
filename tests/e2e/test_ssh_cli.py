"""`egressd ssh` / `egressd remote-agent` argument handling: refused before any connection is made.

No SSH server is needed: each case must stop with exit 2 and a clear message before ssh runs.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from egressd.remote.sshargs import SshOptionError, check_ssh_option, option_name
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
        (["--show", "~/.gitconfig", "--egress", "remote", "host"], "--show is for --sandbox"),
        (["--hide", "/srv/x", "--egress", "remote", "host"], "--hide is for --sandbox"),
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


# -- --ssh-option spellings: the name egressd checks is the one ssh reads ---------------------------
# A value ssh shows in `ssh -G` unlike its default, for each option egressd refuses or forces.
REFUSED = {
    "RemoteForward": "7777 127.0.0.1:9999",
    "LocalForward": "7777 127.0.0.1:22",
    "DynamicForward": "7777",
    "ControlPath": "/tmp/elsewhere",
    "ControlMaster": "yes",
    "ControlPersist": "yes",
    "ExitOnForwardFailure": "yes",
    "ClearAllForwardings": "yes",
    "ForkAfterAuthentication": "yes",
    "SessionType": "none",
    "StdinNull": "yes",
    "ForwardAgent": "yes",
    "ForwardX11": "yes",
    "Tunnel": "yes",
}
_BASELINE: dict[str, list[str]] = {}


def ssh_applies(option: str) -> set[str] | None:
    """The keywords whose value `ssh -G -o OPTION` changes from the defaults (what ssh made of the
    spelling); None when ssh refuses the option."""

    def resolved(*args: str) -> list[str] | None:
        argv = ["ssh", "-G", "-F", "none", *args, "h.invalid"]
        done = subprocess.run(argv, capture_output=True, text=True, stdin=subprocess.DEVNULL)
        return done.stdout.splitlines() if done.returncode == 0 else None

    if "base" not in _BASELINE:
        _BASELINE["base"] = resolved() or []
    after = resolved("-o", option)
    if after is None:
        return None
    return {line.split(" ", 1)[0] for line in set(after) - set(_BASELINE["base"])}


@pytest.mark.parametrize(
    "spelling",
    [
        '"RemoteForward" 7777 127.0.0.1:9999',
        'Remote"Forward" 7777 127.0.0.1:9999',
        "remoteforward=7777 127.0.0.1:9999",
        "REMOTEFORWARD 7777 127.0.0.1:9999",
        " RemoteForward 7777 127.0.0.1:9999",
        "\tRemoteForward\t7777 127.0.0.1:9999",
        " =RemoteForward 7777 127.0.0.1:9999",
        "RemoteForward = 7777 127.0.0.1:9999",
        "RemoteForward =7777 127.0.0.1:9999",
        '"LocalForward"  7777 127.0.0.1:22',
        'Dynamic"Forward" 7777',
        '"ControlPath" /tmp/elsewhere',
        'ForwardAgent "yes"',
        "ForwardAgent YES",
        "forwardagent=True",
        '"ForwardAgent" /tmp/agent.sock',
        'Forward"X11" yes',
        "Tunnel=Ethernet",
        "SessionType none",
    ],
)
def test_ssh_option_spellings_ssh_reads_as_refused_options_are_refused(spelling: str) -> None:
    """Every spelling ssh itself reads as a forward, a control option or an authority forwarding
    (asked of the real ssh: `ssh -G`) is refused: quotes, case, `=` or whitespace."""
    applied = ssh_applies(spelling)
    assert applied, f"ssh does not read {spelling!r} as an option: the table entry is wrong"
    assert applied & {name.lower() for name in REFUSED}, applied
    assert option_name(spelling) in applied
    with pytest.raises(SshOptionError):
        check_ssh_option(spelling)


@pytest.mark.parametrize(
    "spelling",
    ["Port=2222", '"Port" 2222', "port 2222", " Port = 2222", "ForwardAgent no", 'ForwardAgent "NO"'],
)
def test_ssh_option_spellings_of_harmless_options_pass(spelling: str) -> None:
    assert check_ssh_option(spelling) == spelling


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    name=st.sampled_from(sorted(REFUSED)),
    case=st.lists(st.booleans(), min_size=30, max_size=30),
    quote=st.integers(min_value=-1, max_value=30),
    lead=st.sampled_from(["", " ", "\t", " =", "="]),
    sep=st.sampled_from(["=", " ", "\t", " = ", "= ", " =", "=\t"]),
    quote_value=st.booleans(),
    trail=st.sampled_from(["", " ", "\t "]),
)
def test_ssh_option_spellings_property(
    name: str, case: list[bool], quote: int, lead: str, sep: str, quote_value: bool, trail: str
) -> None:
    """For random spellings of a refused option: whenever ssh reads it as that option, egressd
    refuses it, and the name egressd reads is the one ssh read."""
    keyword = "".join(ch.upper() if up else ch.lower() for ch, up in zip(name, case, strict=False))
    if 0 <= quote <= len(keyword):
        keyword = keyword[:quote] + '"' + keyword[quote:] + '"'
    value = REFUSED[name]
    if quote_value and " " not in value:
        value = f'"{value}"'
    spelling = f"{lead}{keyword}{sep}{value}{trail}"
    applied = ssh_applies(spelling)
    if applied:
        assert option_name(spelling) in applied, (spelling, applied)
    if applied and name.lower() in applied:
        with pytest.raises(SshOptionError):
            check_ssh_option(spelling)
