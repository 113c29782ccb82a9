"""The command line without the proxy engine: --version, --help, check, policy, exec set-up errors."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from egressd.policy import load_policy
from tests.support.dns_server import DnsServer

EGRESSD = [sys.executable, "-m", "egressd"]


def egressd(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("EGRESSD_")}
    return subprocess.run(
        [*EGRESSD, *args], capture_output=True, text=True, timeout=60, env={**base, **(env or {})}
    )


def write(tmp_path: Path, text: str, name: str = "policy.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_version() -> None:
    result = egressd("--version")
    assert result.returncode == 0
    assert result.stdout == "egressd 0.1.0 (mitmproxy 12.3.1)\n"


def _all_commands() -> list[list[str]]:
    """Every visible command and group, found by walking the CLI: a new command is covered too."""
    import click

    from egressd.cli import cli

    found: list[list[str]] = [[]]

    def walk(group: click.Group, prefix: list[str]) -> None:
        ctx = click.Context(group)
        for name in group.list_commands(ctx):  # the top level loads its commands on demand
            command = group.get_command(ctx, name)
            if command is None or command.hidden:
                continue
            found.append([*prefix, name])
            if isinstance(command, click.Group):
                walk(command, [*prefix, name])

    walk(cli, [])
    return found


ALL_COMMANDS = _all_commands()


def test_the_walk_finds_the_known_commands() -> None:
    for command in (
        ["exec"],
        ["run"],
        ["check"],
        ["sandbox"],
        ["ssh"],
        ["ca", "rotate"],
        ["policy", "validate"],
    ):
        assert command in ALL_COMMANDS


@pytest.mark.parametrize("command", ALL_COMMANDS, ids=lambda c: " ".join(c) or "egressd")
def test_every_help_has_an_example(command: list[str]) -> None:
    result = egressd(*command, "--help")
    assert result.returncode == 0, result.stderr
    assert "Example" in result.stdout
    assert "egressd " in result.stdout.split("Example", 1)[1]


# -- check --------------------------------------------------------------------------------------
def test_check_loopback_is_allowed() -> None:
    result = egressd("check", "127.0.0.1:8080")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0] == "allow"
    assert "reason: loopback" in lines
    assert any(line.startswith("rule: ") for line in lines)


def test_check_unlisted_name_is_refused_with_reason() -> None:
    result = egressd("check", "evil.test")
    assert result.returncode == 1
    lines = result.stdout.splitlines()
    assert lines[0] == "deny"
    assert "target: evil.test:443" in lines  # a bare host means port 443
    assert "reason: not_allowlisted" in lines
    assert any(line.startswith("detail: ") and "evil.test" in line for line in lines)


def test_check_url_and_always_refused_address() -> None:
    result = egressd("check", "http://169.254.169.254/latest/meta-data/")
    assert result.returncode == 1
    assert result.stdout.splitlines()[0] == "deny"
    assert "reason: forbidden_address" in result.stdout


def test_check_allow_override_and_policy_file(tmp_path: Path) -> None:
    result = egressd("check", "--allow", "example.test", "https://api.example.test/v1?x=1")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("allow\n") and "rule: allow: example.test" in result.stdout
    assert "--resolve" in result.stdout  # says that a name is resolved at connect time
    policy = write(tmp_path, "version: 1\nallow: [example.test]\ndeny: [bad.example.test]\n")
    result = egressd("check", "--policy", str(policy), "bad.example.test:443")
    assert result.returncode == 1 and "reason: deny" in result.stdout, result.stdout


def test_check_mode_override() -> None:
    result = egressd("check", "--mode", "allow", "anything.test")
    assert result.returncode == 0 and result.stdout.startswith("allow\n")
    result = egressd("check", "--mode", "off", "127.0.0.1:80")
    assert result.returncode == 1


@pytest.mark.parametrize(
    "args",
    [
        ["check", "http://user@evil.test/"],
        ["check", "ftp://evil.test/"],
        ["check", "evil test"],
        ["check", "evil.test:99999"],
        ["check", "--allow", "bad rule!", "a.test"],
        ["check", "--mode", "sometimes", "a.test"],
        ["check", "--nameserver", "dns.example", "a.test"],
        ["check", "--profile", "nope", "a.test"],
        ["check", "--policy", "/nonexistent/policy.yaml", "a.test"],
        ["check"],
    ],
)
def test_check_bad_input_exits_2(args: list[str]) -> None:
    result = egressd(*args)
    assert result.returncode == 2, (result.stdout, result.stderr)
    assert result.stdout == ""
    assert result.stderr.strip()


def test_check_without_resolve_sends_no_dns_query() -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.bind(("127.0.0.1", 0))
        sock.setblocking(False)
        port = sock.getsockname()[1]
        result = egressd(
            "check", "--allow", "example.test", "--nameserver", f"127.0.0.1:{port}", "example.test"
        )
        assert result.returncode == 0
        with pytest.raises(BlockingIOError):
            sock.recvfrom(4096)


def test_check_resolve_applies_the_address_rules(dns: DnsServer) -> None:
    dns.add("up.test", "198.51.100.7")
    dns.add("sneaky.test", "127.0.0.1", "10.0.0.1")
    allow = ["--allow", "up.test", "--allow", "sneaky.test", "--allow", "198.51.100.0/24"]
    ns = ["--nameserver", dns.nameserver]
    result = egressd("check", *allow, *ns, "--resolve", "up.test")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "resolved: 198.51.100.7" in result.stdout and "kept" in result.stdout
    result = egressd("check", *allow, *ns, "--resolve", "sneaky.test")
    assert result.returncode == 1
    assert result.stdout.startswith("deny\n") and "reason: resolved_forbidden" in result.stdout
    assert "dropped" in result.stdout
    dns.nxdomain("gone.test")
    result = egressd("check", "--allow", "gone.test", *ns, "--resolve", "gone.test")
    assert result.returncode == 1 and "reason: dns_error" in result.stdout


# -- policy -------------------------------------------------------------------------------------
def test_policy_validate_good_and_bad(tmp_path: Path) -> None:
    good = write(tmp_path, "version: 1\nallow: [example.test]\n", "good.yaml")
    bad = write(tmp_path, "version: 1\nallow: [example.test, 'bad rule!']\n", "bad.yaml")
    result = egressd("policy", "validate", str(good))
    assert result.returncode == 0 and result.stdout.startswith(f"{good}: ok")
    result = egressd("policy", "validate", str(good), str(bad))
    assert result.returncode == 1
    lines = result.stdout.splitlines()
    assert len(lines) == 2
    assert lines[0].startswith(f"{good}: ok")
    assert lines[1].startswith(str(bad)) and "allow" in lines[1] and "bad rule!" in lines[1]


# -- a port number is ASCII digits wherever it is written ---------------------------------------
# str.isdigit() takes '²' (int() then raises) and '٨٠' (int() reads 80); int() raises past 4,300 digits.
ODD_PORTS = ["²", "٨٠", "８０", "8_0", "9" * 5000]
ODD_IDS = ["superscript", "arabic-indic", "full-width", "underscore", "long"]


@pytest.mark.parametrize("port", ODD_PORTS, ids=ODD_IDS)
def test_policy_validate_names_an_odd_port_without_a_traceback(tmp_path: Path, port: str) -> None:
    rule = write(tmp_path, f"version: 1\nallow: ['a.test:{port}']\n", "rule.yaml")
    nameserver = write(tmp_path, f"version: 1\nresolver: {{nameservers: ['127.0.0.1:{port}']}}\n", "ns.yaml")
    result = egressd("policy", "validate", str(rule), str(nameserver))
    assert result.returncode == 1, result.stderr
    assert "Traceback" not in result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].startswith(f"{rule}: allow[0]:") and "port" in lines[0]
    assert lines[1].startswith(f"{nameserver}: resolver.nameservers[0]:") and "port" in lines[1]


def test_leading_zeros_read_as_the_port(tmp_path: Path) -> None:
    rule = write(tmp_path, f"version: 1\nallow: ['a.test:{'0' * 5000}443']\n", "rule.yaml")
    allowed = egressd("check", "--policy", str(rule), "a.test:443")
    assert allowed.returncode == 0, (allowed.stdout, allowed.stderr)
    refused = egressd("check", "--policy", str(rule), "a.test:8443")
    assert refused.returncode == 1 and "not_allowlisted" in refused.stdout, (refused.stdout, refused.stderr)


@pytest.mark.parametrize("port", ODD_PORTS, ids=ODD_IDS)
@pytest.mark.parametrize(
    "args",
    [
        ["exec", "--listen", "127.0.0.1:PORT", "--", "true"],
        ["run", "--metrics", "127.0.0.1:PORT"],
        ["check", "--nameserver", "127.0.0.1:PORT", "a.test"],
        ["check", "--allow", "a.test:PORT", "a.test"],
        ["ssh", "ssh://user@h.test:PORT", "--", "true"],
    ],
    ids=["exec-listen", "run-metrics", "check-nameserver", "check-allow", "ssh-destination"],
)
def test_an_odd_port_on_the_command_line_exits_2_naming_it(args: list[str], port: str) -> None:
    result = egressd(*[a.replace("PORT", port) for a in args])
    assert result.returncode == 2, (result.stdout, result.stderr)
    assert "Traceback" not in result.stderr
    assert "port" in result.stderr


def test_an_imported_allowlist_drops_an_odd_port(tmp_path: Path) -> None:
    hosts = [f"odd{i}.test:{port}" for i, port in enumerate(ODD_PORTS)] + ["api.test:0443"]
    source = write(tmp_path, json.dumps({"allowed_hosts": hosts}), "allowlist.json")
    result = egressd("policy", "import", "--from", "allowlist-json", str(source))
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr
    assert "api.test:443" in result.stdout and "odd" not in result.stdout
    assert result.stderr.count("not a valid port") == len(ODD_PORTS)


def test_policy_validate_builtin_presets() -> None:
    presets = sorted((Path(__file__).resolve().parents[2] / "policies").glob("*.yaml"))
    assert presets
    result = egressd("policy", "validate", *map(str, presets))
    assert result.returncode == 0, result.stdout


def test_policy_show_round_trips(tmp_path: Path) -> None:
    text = (
        "version: 1\nmode: ask\nallow: [example.test, '10.0.0.0/8:5432']\ndeny: [bad.example.test]\n"
        "builtin: [{host: files.example.test, paths: [/pub/], methods: [GET, HEAD]}]\n"
        "private: {allow: false, origins: ['http://192.168.1.10:8080']}\n"
        "resolver: {nameservers: ['127.0.0.1:5353']}\n"
        "profiles: {ci: {allow: [example.test], ports: [443]}}\n"
    )
    source = write(tmp_path, text)
    result = egressd("policy", "show", str(source), "--allow", "extra.test")
    assert result.returncode == 0, result.stderr
    shown = write(tmp_path, result.stdout, "shown.yaml")
    again = load_policy(shown)
    assert again == load_policy(source).with_overrides(allow=["extra.test"])


def test_policy_show_default_and_path() -> None:
    result = egressd("policy", "show")
    assert result.returncode == 0 and "mode: enforce" in result.stdout
    result = egressd("policy", "path", "default")
    assert result.returncode == 0 and Path(result.stdout.strip()).is_file()
    result = egressd("policy", "path", "no-such-preset")
    assert result.returncode == 2 and "default" in result.stderr


# -- exec set-up errors: nothing runs -----------------------------------------------------------
@pytest.mark.parametrize(
    "options",
    [
        ["--policy", "BROKEN"],
        ["--profile", "nope"],
        ["--allow", "bad rule!"],
        ["--listen", "0.0.0.0:0"],
        ["--listen", "192.0.2.1:8080"],
    ],
)
def test_exec_setup_errors_exit_2_without_running(tmp_path: Path, options: list[str]) -> None:
    broken = write(tmp_path, "version: 1\nallow: [a.test\n", "broken.yaml")
    options = [str(broken) if o == "BROKEN" else o for o in options]
    marker = tmp_path / "ran"
    result = egressd("exec", *options, "--", "touch", str(marker))
    assert result.returncode == 2, result.stderr
    assert not marker.exists()
    assert result.stdout == ""
    assert result.stderr.strip()


def test_exec_needs_a_command() -> None:
    result = egressd("exec")
    assert result.returncode == 2 and result.stdout == ""
