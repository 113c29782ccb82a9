"""The few shell snippets egressd runs on the remote host, and the session plan it hands over there.

Every remote command is one line `exec sh -c 'SCRIPT' egressd ARGS...`: the user's login shell
(bash, zsh, fish, csh, ...) only has to run `exec`, and the script always runs under POSIX sh.
The proxy credentials travel in a 0600 file inside a 0700 directory (never in a command line,
which other users of the remote host can read in the process list): the session plan, which the
session's guard (reaper.py) reads and deletes before it starts the command.
"""

from __future__ import annotations

import json
import posixpath
import re
import shlex
from collections.abc import Mapping, Sequence

# One list of inherited proxy settings for local and remote children alike.
from egressd.child.env import _STRIP_LOWER as _INHERITED_PROXY_SETTINGS
from egressd.remote.reaper import PID_NAME, PLAN_NAME

DIR_PREFIX = "egressd-ssh."
CHANNEL_NAME = "policy.sock"
REAPER_NAME = "reaper.py"
MIN_PYTHON = (3, 7)

# Remove this user's session directories whose command is gone (an SSH drop leaves them behind);
# one without a pid file yet is a session still starting, and is kept.
_COLLECT = (
    'for o in "$t"/' + DIR_PREFIX + '*; do [ -d "$o" ] && [ -O "$o" ] && [ -s "$o/' + PID_NAME + '" ] '
    '&& read p < "$o/'
    + PID_NAME
    + '" && [ "$p" -gt 1 ] 2>/dev/null && ! kill -0 "$p" 2>/dev/null && rm -rf -- "$o"; done; '
)
# stdin → "$d/env" (the plan); prints the new private directory. A TMPDIR too deep for the Unix
# sockets the directory holds (sun_path: 104 bytes on macOS) is passed over for /tmp.
SETUP = (
    'umask 077 && t="${TMPDIR:-/tmp}" && { [ "${#t}" -le 64 ] || t=/tmp; } && '
    + _COLLECT
    + 'd=$(mktemp -d "$t/'
    + DIR_PREFIX
    + 'XXXXXXXXXX") && cat > "$d/'
    + PLAN_NAME
    + '" && printf "%s\\n" "$d"'
)
# Relay mode, $1 = the directory: stdin → the guard (reaper.py); fails unless python3 >= 3.7 runs.
PREPARE_RELAY = (
    'cat > "$1/' + REAPER_NAME + '" && exec python3 -I -S -c '
    f'"import sys; sys.exit(sys.version_info < {MIN_PYTHON!r})"'
)
# Relay mode, $1 = the directory, then the command: run it under the guard, by the remote's python3.
RELAY_GUARDED = 'd=$1; shift; exec python3 -I -S "$d/' + REAPER_NAME + '" "$d" "$@"'
# $1 = signal name, $2 = the directory: signal the command the guard started (a signal that
# arrives while the session is still starting waits up to 3 s for the pid).
KILL = (
    'i=0; while [ ! -s "$2/' + PID_NAME + '" ] && [ "$i" -lt 30 ]; do sleep 0.1; i=$((i+1)); done; '
    'read p < "$2/' + PID_NAME + '" && kill -s "$1" "$p"'
)
# $1 = the directory, $2 = a file name: stdin → that file
PUT = 'cat > "$1/$2"'
CLEANUP = 'rm -rf -- "$1"'
# a command given as its words
EXEC = 'exec "$@"'
# the remote egressd command (one or more words), asked for its version
VERSION = '"$@" --version'

_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_FILE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*")


def remote_command(script: str, *args: str) -> str:
    """The single line the remote login shell runs."""
    if "\n" in script or "'" in script:
        raise ValueError("remote scripts are single-line and free of single quotes")
    return shlex.join(["exec", "sh", "-c", script, "egressd", *args])


def unset_names() -> list[str]:
    """Inherited proxy settings the remote child must not keep (both spellings)."""
    return sorted({n for name in _INHERITED_PROXY_SETTINGS for n in (name, name.upper())})


def session_plan(
    exports: Mapping[str, str] | None = None,
    files: Mapping[str, str] | None = None,
    listen: Sequence[Mapping[str, object]] = (),
) -> str:
    """The session plan for the guard (reaper.py), as JSON.

    `exports` are the command's variables (inherited proxy settings are dropped first), where
    "\0NAME\0" stands for the port of listener NAME; `files` maps variables to names of files
    uploaded into the session directory (the CA bundle), whose path is known only there; `listen`
    are the loopback ports the guard holds ({"name", "host", "port", "relay"?}).
    """
    for key in [*(exports or {}), *(files or {})]:
        _name(key)
    for name in (files or {}).values():
        if not _FILE.fullmatch(name):
            raise ValueError(f"not a plain file name: {name!r}")
    plan: dict[str, object] = {"listen": [dict(item) for item in listen]}
    if exports or files:
        plan.update(unset=unset_names(), set=dict(exports or {}), files=dict(files or {}))
    return json.dumps(plan)


def _name(key: str) -> str:
    if not _NAME.fullmatch(key):
        raise ValueError(f"not an environment variable name: {key!r}")
    return key


def relay_guarded(directory: str, command: Sequence[str]) -> str:
    """The relay session command: the user's command under the guard (reaper.py)."""
    return remote_command(RELAY_GUARDED, directory, *command)


def exec_command(argv: Sequence[str]) -> str:
    return remote_command(EXEC, *argv)


def prepare_relay_command(directory: str) -> str:
    return remote_command(PREPARE_RELAY, directory)


def kill_command(directory: str, signal_name: str) -> str:
    return remote_command(KILL, signal_name, directory)


def cleanup_command(directory: str) -> str:
    return remote_command(CLEANUP, directory)


def put_command(directory: str, name: str) -> str:
    return remote_command(PUT, directory, name)


def version_command(egressd: Sequence[str]) -> str:
    return remote_command(VERSION, *egressd)


def channel_path(directory: str) -> str:
    return posixpath.join(directory, CHANNEL_NAME)


def parse_directory(output: str) -> str:
    """The directory SETUP printed (its last line: a chatty shell rc file may print before it).

    Anything unexpected is refused: the directory is later removed with `rm -rf`.
    """
    path = output.strip("\n").rsplit("\n", 1)[-1]
    base = posixpath.basename(path)
    if (
        not path.startswith("/")
        or not base.startswith(DIR_PREFIX)
        or len(base) <= len(DIR_PREFIX)
        or posixpath.normpath(path) != path.replace("//", "/")
        or any(ch.isspace() or not ch.isprintable() for ch in path)
    ):
        raise ValueError(f"unexpected reply from the remote set-up: {output[:200]!r}")
    return path
