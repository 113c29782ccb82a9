"""`egressd provider`: presets acknowledged into a policy file, through the real command line.

The file is edited atomically with its comments kept; `remove` takes out only what an add wrote and
no other acknowledged provider needs; no terminal and no --yes is a refusal; a running egressd
applies the edit by its reload.
"""

from __future__ import annotations

import datetime
import fcntl
import json
import os
import select
import subprocess
import termios
import time
from pathlib import Path

import pytest
import yaml

from egressd.policy import load_policy
from tests.support.corpus import ProxyClient
from tests.support.dns_server import DnsServer
from tests.support.egressd_cli import EGRESSD, EgressdRun

ANTHROPIC = ["api.anthropic.com:443", "console.anthropic.com:443", "claude.ai:443"]

USER_POLICY = """\
# my agent's policy: comments and order must survive egressd's edits
version: 1
mode: enforce
allow:
  - api.anthropic.com:443   # written by hand before any provider was added
  - up.test                 # my own host
deny: []
"""


def egressd(*args: str, stdin: int | None = subprocess.DEVNULL) -> subprocess.CompletedProcess[str]:
    """The real command with no controlling terminal (a new session) unless the test gives one."""
    return subprocess.run(
        [*EGRESSD, *args], capture_output=True, text=True, timeout=60, stdin=stdin, start_new_session=True
    )


def acks(path: Path) -> dict[str, dict[str, object]]:
    data = yaml.safe_load(path.read_text()) if path.suffix != ".json" else json.loads(path.read_text())
    return {a["name"]: a for a in data.get("providers", [])}


def allow_list(path: Path) -> list[object]:
    data = yaml.safe_load(path.read_text()) if path.suffix != ".json" else json.loads(path.read_text())
    return list(data.get("allow") or [])


def test_list_and_show_name_every_preset_with_its_hosts_and_data_warning() -> None:
    listed = egressd("provider", "list")
    assert listed.returncode == 0, listed.stderr
    names = {line.split()[0] for line in listed.stdout.splitlines()}
    expected = "anthropic openai gemini mistral groq openrouter ollama huggingface github gitlab npm pypi"
    expected += " crates go dockerhub"
    assert set(expected.split()) <= names
    shown = egressd("provider", "show", "huggingface")
    assert shown.returncode == 0, shown.stderr
    assert "huggingface.co:443" in shown.stdout and "what goes there:" in shown.stdout


def test_add_records_the_acknowledgement_and_keeps_comments(tmp_path: Path) -> None:
    policy = tmp_path / "agent.yaml"
    policy.write_text(USER_POLICY)
    done = egressd("provider", "add", "anthropic", "--policy", str(policy), "--yes")
    assert done.returncode == 0, done.stderr
    assert "what goes there:" in done.stderr and "api.anthropic.com:443" in done.stderr
    text = policy.read_text()
    assert "# my agent's policy" in text and "# written by hand" in text and "# my own host" in text
    assert allow_list(policy) == ["api.anthropic.com:443", "up.test", *ANTHROPIC[1:]]
    ack = acks(policy)["anthropic"]
    assert ack["version"] == 1 and ack["hosts"] == ANTHROPIC
    assert str(ack["acknowledged"]) == datetime.date.today().isoformat()
    assert ack["added"] == ANTHROPIC[1:]  # the hand-written rule is not the provider's to remove
    loaded = load_policy(policy)
    assert [p.name for p in loaded.providers] == ["anthropic"]
    listed = egressd("provider", "list", "--policy", str(policy))
    assert "anthropic" in listed.stdout and "[acknowledged" in listed.stdout


def test_remove_keeps_hand_written_rules_and_hosts_another_provider_needs(tmp_path: Path) -> None:
    policy = tmp_path / "agent.yaml"
    policy.write_text(USER_POLICY)
    assert egressd("provider", "add", "anthropic", "--policy", str(policy), "--yes").returncode == 0
    assert egressd("provider", "add", "openai", "--policy", str(policy), "--yes").returncode == 0
    # another acknowledged provider that also names one of anthropic's hosts (as a newer preset might)
    data = yaml.safe_load(policy.read_text())
    data["providers"][1]["hosts"].append("claude.ai:443")
    policy.write_text(yaml.safe_dump(data, sort_keys=False))

    done = egressd("provider", "remove", "anthropic", "--policy", str(policy))
    assert done.returncode == 0, done.stderr
    assert "console.anthropic.com:443" in done.stderr
    rules = allow_list(policy)
    assert "console.anthropic.com:443" not in rules  # only anthropic needed it
    assert "api.anthropic.com:443" in rules and "up.test" in rules  # written by hand
    assert "claude.ai:443" in rules  # openai's acknowledgement names it too
    assert set(acks(policy)) == {"openai"} and "claude.ai:443" in acks(policy)["openai"]["added"]

    assert egressd("provider", "remove", "openai", "--policy", str(policy)).returncode == 0
    assert allow_list(policy) == ["api.anthropic.com:443", "up.test"]
    assert "providers" not in yaml.safe_load(policy.read_text())
    again = egressd("provider", "remove", "openai", "--policy", str(policy))
    assert again.returncode == 2 and "not acknowledged" in again.stderr


def test_add_to_json_and_to_a_new_file(tmp_path: Path) -> None:
    policy = tmp_path / "agent.json"
    policy.write_text(json.dumps({"version": 1, "allow": ["up.test"]}))
    assert egressd("provider", "add", "pypi", "--policy", str(policy), "--yes").returncode == 0
    assert allow_list(policy) == ["up.test", "pypi.org:443", "files.pythonhosted.org:443"]
    assert acks(policy)["pypi"]["added"] == ["pypi.org:443", "files.pythonhosted.org:443"]
    fresh = tmp_path / "new.yaml"
    assert egressd("provider", "add", "groq", "--policy", str(fresh), "--yes").returncode == 0
    assert load_policy(fresh).allow.rules[0].text == "api.groq.com:443"
    assert "nothing leaves this machine unless it is allowed" in fresh.read_text()  # the default's comments


@pytest.mark.parametrize(
    ("content", "args", "message"),
    [
        (USER_POLICY, ("add", "no-such-provider", "--yes"), "unknown provider 'no-such-provider'"),
        ("version: 1\nallow: [up.test\n", ("add", "anthropic", "--yes"), "invalid YAML"),
        ("version: 1\nallow: ['exa mple.com']\n", ("add", "anthropic", "--yes"), "allow[0]"),
        ("version: 1\nallow: [up.test\n", ("remove", "anthropic"), "invalid YAML"),
        (USER_POLICY, ("add", "anthropic"), "no terminal to confirm"),
    ],
)
def test_refusals_leave_the_file_untouched(
    tmp_path: Path, content: str, args: tuple[str, ...], message: str
) -> None:
    policy = tmp_path / "agent.yaml"
    policy.write_text(content)
    before = policy.stat()
    done = egressd("provider", *args, "--policy", str(policy))
    assert done.returncode == 2, done.stderr
    assert message in done.stderr
    assert policy.read_text() == content
    assert policy.stat().st_ino == before.st_ino


def _on_a_terminal(args: list[str], answer: bytes) -> tuple[int, str]:
    """Run egressd with a pseudo-terminal as its controlling terminal (/dev/tty), answer the
    question, and return (exit status, what the terminal showed)."""
    master, slave = os.openpty()

    def take_terminal() -> None:
        fcntl.ioctl(0, termios.TIOCSCTTY, 0)

    proc = subprocess.Popen(
        [*EGRESSD, *args],
        stdin=slave,
        stdout=slave,
        stderr=slave,
        start_new_session=True,
        preexec_fn=take_terminal,
    )
    os.close(slave)
    shown = b""
    deadline = time.monotonic() + 60
    answered = False
    while time.monotonic() < deadline:
        ready, _, _ = select.select([master], [], [], 0.2)
        if ready:
            try:
                chunk = os.read(master, 4096)
            except OSError:  # the terminal closed: egressd has exited
                break
            if not chunk:
                break
            shown += chunk
        if not answered and b"[y/N]" in shown:
            os.write(master, answer)
            answered = True
        if proc.poll() is not None and not ready:
            break
    os.close(master)
    return proc.wait(timeout=30), shown.decode(errors="replace")


@pytest.mark.parametrize(("answer", "code"), [(b"y\n", 0), (b"n\n", 1)])
def test_add_asks_on_the_terminal(tmp_path: Path, answer: bytes, code: int) -> None:
    policy = tmp_path / "agent.yaml"
    policy.write_text(USER_POLICY)
    status, shown = _on_a_terminal(["provider", "add", "mistral", "--policy", str(policy)], answer)
    assert status == code, shown
    assert "api.mistral.ai:443" in shown and "what goes there:" in shown and "[y/N]" in shown
    if code == 0:
        assert "mistral" in acks(policy)
    else:
        assert policy.read_text() == USER_POLICY


def test_a_running_egressd_applies_the_acknowledgement(tmp_path: Path) -> None:
    """`egressd run --policy FILE`: before the add the host is not allowlisted; after it the policy
    allows it (the test DNS server then resolves it to loopback, which a name may not reach: the
    refusal changes from not_allowlisted to resolved_forbidden, and no packet leaves)."""
    policy = tmp_path / "agent.yaml"
    policy.write_text(USER_POLICY)
    connect = b"CONNECT console.anthropic.com:443 HTTP/1.1\r\nHost: console.anthropic.com:443\r\n"
    with DnsServer() as dns:
        dns.add("console.anthropic.com", "127.0.0.1")
        with EgressdRun(["--policy", str(policy), "--nameserver", f"127.0.0.1:{dns.port}"]) as run:
            client = ProxyClient.from_env(run.env)
            before = client.exchange(connect + client.auth_header + b"\r\n")
            assert before is not None and before.reason == "not_allowlisted"
            assert egressd("provider", "add", "anthropic", "--policy", str(policy), "--yes").returncode == 0
            deadline = time.monotonic() + 20
            reason = before.reason
            while time.monotonic() < deadline and reason == "not_allowlisted":
                time.sleep(0.1)
                after = client.exchange(connect + client.auth_header + b"\r\n")
                reason = after.reason if after is not None else None
            assert reason == "resolved_forbidden", run.stderr


def test_a_preset_is_never_the_file_written(tmp_path: Path) -> None:
    preset = subprocess.run(
        [*EGRESSD, "policy", "path", "npm"], capture_output=True, text=True
    ).stdout.strip()
    before = Path(preset).read_text()
    done = egressd("provider", "add", "anthropic", "--policy", preset, "--yes")
    assert done.returncode == 2 and "npm preset" in done.stderr
    assert Path(preset).read_text() == before
    bare = subprocess.run(
        [*EGRESSD, "provider", "add", "anthropic", "--policy", "npm", "--yes"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        stdin=subprocess.DEVNULL,
    )
    assert bare.returncode == 2 and "./npm" in bare.stderr and not (tmp_path / "npm").exists()
