"""The few shell snippets egressd runs on the remote host, and the env file it hands over there.

Every remote command is one line `exec sh -c 'SCRIPT' egressd ARGS...`: the user's login shell
(bash, zsh, fish, csh, ...) only has to run `exec`, and the script always runs under POSIX sh.
The proxy credentials travel in a 0600 file inside a 0700 directory (never in a command line,
which other users of the remote host can read in the process list); the wrapper sources it,
deletes it and execs the command, so the command keeps the pid the wrapper recorded for signals.
"""

from __future__ import annotations

import posixpath
import re
import shlex
from collections.abc import Mapping, Sequence

# One list of inherited proxy settings for local and remote children alike.
from egressd.child_env import _STRIP_LOWER as _INHERITED_PROXY_SETTINGS

DIR_PREFIX = "egressd-ssh."
ENV_NAME = "env"
PID_NAME = "pid"
CHANNEL_NAME = "policy.sock"
REAPER_NAME = "reaper.py"

# Remove this user's session directories whose command is gone (an SSH drop leaves them behind);
# one without a pid file yet is a session still starting, and is kept.
_COLLECT = (
    'for o in "$t"/' + DIR_PREFIX + '*; do [ -d "$o" ] && [ -O "$o" ] && [ -s "$o/' + PID_NAME + '" ] '
    '&& read p < "$o/'
    + PID_NAME
    + '" && [ "$p" -gt 1 ] 2>/dev/null && ! kill -0 "$p" 2>/dev/null && rm -rf -- "$o"; done; '
)
# stdin → "$d/env"; prints the new private directory.
SETUP = (
    'umask 077 && t="${TMPDIR:-/tmp}" && ' + _COLLECT + 'd=$(mktemp -d "$t/' + DIR_PREFIX + 'XXXXXXXXXX") '
    '&& cat > "$d/' + ENV_NAME + '" && printf "%s\\n" "$d"'
)
# $1 = the directory, then the command: record the pid, take the environment, exec.
WRAPPER = (
    'd=$1; shift; printf "%s\\n" "$$" > "$d/' + PID_NAME + '" '
    '&& . "$d/' + ENV_NAME + '" && rm -f "$d/' + ENV_NAME + '" && exec "$@"'
)
# Relay mode: the same, but under the reaper (egressd/remote/reaper.py, uploaded as "$d/reaper.py")
# with the remote's python3, which ends everything the command started when the session ends.
# Without python3 (3.7 or later) the command runs as WRAPPER runs it, and stderr says so.
RELAY_WRAPPER = (
    'd=$1; shift; . "$d/' + ENV_NAME + '" && rm -f "$d/' + ENV_NAME + '" && '
    'if python3 -I -S -c "import sys; sys.exit(sys.version_info < (3, 7))" >/dev/null 2>&1; '
    'then exec python3 -I -S "$d/' + REAPER_NAME + '" "$d" "$@"; fi; '
    'echo "egressd: no python3 here: what the command detaches outlives a dropped SSH connection" >&2; '
    'printf "%s\\n" "$$" > "$d/' + PID_NAME + '" && exec "$@"'
)
# $1 = signal name, $2 = the directory: signal the command the wrapper became (a signal that
# arrives while the session is still starting waits up to 3 s for the pid).
KILL = (
    'i=0; while [ ! -s "$2/' + PID_NAME + '" ] && [ "$i" -lt 30 ]; do sleep 0.1; i=$((i+1)); done; '
    'read p < "$2/' + PID_NAME + '" && kill -s "$1" "$p"'
)
# the remote's listening TCP sockets (Linux), to see where sshd bound the forwards
LISTENERS = "cat /proc/net/tcp /proc/net/tcp6 2>/dev/null; true"
# $1 = the directory, $2 = a file name: stdin → that file
PUT = 'cat > "$1/$2"'
CLEANUP = 'rm -rf -- "$1"'
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


def env_file(exports: Mapping[str, str], files: Mapping[str, str] | None = None) -> str:
    """sh source text: drop inherited proxy settings, then export egressd's variables.

    `files` maps variables to names of files uploaded into the session directory (the CA bundle):
    their value is the file's remote path, known only when the wrapper runs (`$d`).
    """
    lines = [f"unset {' '.join(unset_names())}"] if exports or files else []
    for key, value in exports.items():
        lines.append(f"export {_name(key)}={shlex.quote(value)}")
    for key, name in (files or {}).items():
        if not _FILE.fullmatch(name):
            raise ValueError(f"not a plain file name: {name!r}")
        lines.append(f'export {_name(key)}="$d/{name}"')
    return "".join(line + "\n" for line in lines)


def _name(key: str) -> str:
    if not _NAME.fullmatch(key):
        raise ValueError(f"not an environment variable name: {key!r}")
    return key


def wrapped(directory: str, command: Sequence[str]) -> str:
    """The session command: the wrapper around the user's (or the agent's) command."""
    return remote_command(WRAPPER, directory, *command)


def relay_wrapped(directory: str, command: Sequence[str]) -> str:
    """The relay session command: the user's command under the reaper (see RELAY_WRAPPER)."""
    return remote_command(RELAY_WRAPPER, directory, *command)


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
