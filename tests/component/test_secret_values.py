"""Reading the secrets' values: every failure names the secret and its source, never a value.

Why: an error message goes to stderr, the audit (a failed reload) and the control API; a value in
one of them is a leak. The sources are real: files, commands, an environment.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from egressd.policy.secrets import SecretSource, SecretSpec
from egressd.session.secret_values import EnvVault, SecretError, hidden_variables, read_value, read_values

VALUE = "sk-secret-value-1234"


def _spec(source: SecretSource) -> SecretSpec:
    return SecretSpec(name="api", source=source, hosts=(), env="API_KEY")


def test_each_source_and_the_trailing_newline(tmp_path: Path) -> None:
    key = tmp_path / "key"
    key.write_text(VALUE + "\n")
    vault = EnvVault({"REAL": VALUE})
    assert read_value(_spec(SecretSource("file", file=str(key))), vault) == VALUE
    assert read_value(_spec(SecretSource("env", env="REAL")), vault) == VALUE
    command = (sys.executable, "-c", f"print({VALUE!r})")
    assert read_value(_spec(SecretSource("command", command=command)), vault) == VALUE


def test_the_vault_takes_a_variable_out_of_the_environment_once() -> None:
    environ = {"REAL": VALUE, "OTHER": "x"}
    vault = EnvVault(environ)
    spec = _spec(SecretSource("env", env="REAL"))
    assert read_values([spec], vault) == {"api": VALUE}
    assert environ == {"OTHER": "x"}  # a child or a command source never inherits it
    assert read_values([spec], vault) == {"api": VALUE}  # the reload reads the kept copy
    assert hidden_variables([spec], vault) == ("REAL",)


@pytest.mark.parametrize(
    ("source", "fragment"),
    [
        (SecretSource("env", env="MISSING"), "environment variable MISSING is not set"),
        (SecretSource("file", file="/nonexistent/key"), "cannot read file /nonexistent/key"),
        (SecretSource("command", command=("/nonexistent/tool",)), "could not run"),
        (
            SecretSource("command", command=(sys.executable, "-c", f"print({VALUE!r}); raise SystemExit(3)")),
            "exited with status 3",
        ),
        (SecretSource("command", command=(sys.executable, "-c", f"print({VALUE!r} + '\\r\\nX')")), "control"),
        (SecretSource("command", command=(sys.executable, "-c", "print()")), "is empty"),
    ],
)
def test_failures_never_show_the_value(source: SecretSource, fragment: str) -> None:
    with pytest.raises(SecretError) as caught:
        read_value(_spec(source), EnvVault({}))
    assert fragment in str(caught.value) and "'api'" in str(caught.value)
    assert VALUE not in str(caught.value)


def test_the_original_environment_block_is_wiped(tmp_path: Path) -> None:
    """In a fresh process: /proc/self/environ no longer shows the value once the vault took it."""
    code = (
        "from egressd.session.secret_values import EnvVault\n"
        "EnvVault().take('REAL')\n"
        "print(open('/proc/self/environ', 'rb').read().split(b'\\0'))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        env={"REAL": VALUE, "PATH": "/usr/bin:/bin"},
        capture_output=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert VALUE.encode() not in done.stdout and b"REAL=" + b"x" * len(VALUE) in done.stdout


def test_the_environment_strings_are_wiped_through_the_environ_array() -> None:
    """What macOS relies on (its kern.procargs2 shows the strings `_NSGetEnviron()` leads to):
    walking the C library's environ array overwrites the value where the kernel put it. Checked
    here with glibc's `environ`, whose strings are the ones /proc/self/environ shows."""
    code = (
        "from egressd.session.secret_values import environ_array, wipe_environ_entries\n"
        "assert wipe_environ_entries('REAL', environ_array())\n"
        "assert not wipe_environ_entries('ABSENT', environ_array())\n"
        "print(open('/proc/self/environ', 'rb').read().split(b'\\0'))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        env={"REAL": VALUE, "REALLY": "kept", "PATH": "/usr/bin:/bin"},
        capture_output=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert VALUE.encode() not in done.stdout and b"REAL=" + b"x" * len(VALUE) in done.stdout
    assert b"REALLY=kept" in done.stdout
