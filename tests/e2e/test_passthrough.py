"""--passthrough / EGRESSD_PASSTHROUGH=1: the child runs without egressd, never silently.

Through the real commands that start a child (exec, sandbox, acp, mcp run): the child has no
proxy variables and no EGRESSD_* variable, egressd warns on stderr, the audit file has the record,
and the exit status passes through.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.audit_log import audit_records
from tests.support.egressd_cli import EGRESSD

PROBE = (
    "import json, os, sys; "
    "print(json.dumps({k: v for k, v in os.environ.items() "
    "if 'proxy' in k.lower() or k.startswith(('EGRESSD_', 'SSL_CERT', 'NODE_'))})); sys.exit(3)"
)
PROXY_VARS = {"HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy", "ALL_PROXY", "all_proxy"}


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if "proxy" not in k.lower() and not k.startswith("EGRESSD_")}
    env.update(extra)
    return env


def run(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*EGRESSD, *args, "--", sys.executable, "-c", PROBE],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
        stdin=subprocess.DEVNULL,
    )


def records(audit: Path) -> list[dict[str, object]]:
    return audit_records(audit)


COMMANDS = [["exec"], ["sandbox"], ["acp"], ["mcp", "run"]]


@pytest.mark.parametrize("command", COMMANDS, ids=" ".join)
@pytest.mark.parametrize("how", ["flag", "env"])
def test_passthrough_runs_the_child_unwrapped_and_says_so(
    tmp_path: Path, command: list[str], how: str
) -> None:
    audit = tmp_path / "audit.jsonl"
    env = clean_env(EGRESSD_PASSTHROUGH="1") if how == "env" else clean_env()
    flag = ["--passthrough"] if how == "flag" else []
    done = run([*command, *flag, "--audit", str(audit), "--policy", "npm"], env)
    assert done.returncode == 3, done.stderr  # the child's own status
    seen = json.loads(done.stdout)
    assert not PROXY_VARS & set(seen), seen
    assert not [k for k in seen if k.startswith("EGRESSD_") or k == "NODE_USE_ENV_PROXY"], seen
    assert "WARNING: passthrough" in done.stderr and "WITHOUT egressd" in done.stderr
    cause = "--passthrough" if how == "flag" else "EGRESSD_PASSTHROUGH=1"
    assert cause in done.stderr
    [record] = [r for r in records(audit) if r.get("event") == "passthrough"]
    assert record["program"] == Path(sys.executable).name and record["cause"] == cause


def test_the_users_own_proxy_settings_pass_through(tmp_path: Path) -> None:
    env = clean_env(HTTPS_PROXY="http://corporate.example:3128")
    done = run(["exec", "--passthrough"], env)
    assert done.returncode == 3, done.stderr
    seen = json.loads(done.stdout)
    assert {k: v for k, v in seen.items() if "proxy" in k.lower()} == {
        "HTTPS_PROXY": "http://corporate.example:3128"
    }


@pytest.mark.parametrize("value", ["0", "", "false", "off"])
def test_passthrough_off_values_keep_egressd(value: str) -> None:
    done = run(["exec"], clean_env(EGRESSD_PASSTHROUGH=value))
    assert done.returncode == 3, done.stderr
    seen = json.loads(done.stdout)
    assert set(seen) >= PROXY_VARS and "passthrough" not in done.stderr


def test_an_unknown_passthrough_value_is_an_error_not_a_guess() -> None:
    done = run(["exec"], clean_env(EGRESSD_PASSTHROUGH="maybe"))
    assert done.returncode == 2 and done.stdout == ""
    assert "EGRESSD_PASSTHROUGH='maybe'" in done.stderr


def test_passthrough_never_hands_the_child_a_secrets_real_value(tmp_path: Path) -> None:
    policy = tmp_path / "policy.yaml"
    policy.write_text(
        "version: 1\nallow: [api.a.test, api.b.test]\nsecrets:\n"
        "  - {name: filed, from: {env: FILED_KEY}, hosts: [api.b.test], env: FILED_KEY}\n"
    )
    env = clean_env(CLI_KEY="real-cli-value", FILED_KEY="real-file-value", OTHER="kept")
    names = "('CLI_KEY', 'FILED_KEY', 'OTHER')"
    probe = f"import json, os; print(json.dumps({{k: os.environ.get(k) for k in {names}}}))"
    done = subprocess.run(
        [
            *EGRESSD,
            "exec",
            "--passthrough",
            "--policy",
            str(policy),
            "--secret",
            "cli=CLI_KEY",
            "--secret-host",
            "cli=api.a.test",
            "--",
            sys.executable,
            "-c",
            probe,
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
        stdin=subprocess.DEVNULL,
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == {"CLI_KEY": None, "FILED_KEY": None, "OTHER": "kept"}
    assert "CLI_KEY, FILED_KEY" in done.stderr
