"""Reading the real values of the policy's secrets, and keeping them out of the child's reach.

Values are read at start and on every reload (a reload whose value cannot be read fails and keeps
the last good policy and values). No message here ever holds a value: errors say which secret and
where it was looked for, never what was found.

A value read from egressd's own environment is taken out of it: removed from `os.environ` (so
neither the child nor a `command:` source inherits it) and wiped from the process's original
environment strings, which `/proc/<egressd>/environ` shows on Linux and `kern.procargs2`
(`ps -E`) on macOS. egressd also makes itself
non-dumpable while it holds secrets (`prctl(PR_SET_DUMPABLE, 0)`): a child running as the same
user can then read neither that file nor egressd's memory.
"""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
import threading
from collections.abc import Callable, Sequence
from pathlib import Path

from egressd.platform.interfaces import libc_name
from egressd.policy.secrets import SecretSpec

COMMAND_TIMEOUT = 10.0
MAX_VALUE = 16384
PR_SET_DUMPABLE = 4


class SecretError(Exception):
    """A secret whose value cannot be read; the message names it and its source, never a value."""


class EnvVault:
    """egressd's own environment variables that hold secrets, taken out of the environment once
    and kept here for the reloads."""

    def __init__(self, environ: os._Environ[str] | dict[str, str] | None = None) -> None:
        self._environ = os.environ if environ is None else environ
        self._taken: dict[str, str | None] = {}
        self._lock = threading.Lock()

    def take(self, name: str) -> str | None:
        with self._lock:
            if name not in self._taken:
                if self._environ is os.environ:
                    # first: unsetenv drops the entry from the array that leads to the string
                    wipe_original_environ(name)
                self._taken[name] = self._environ.pop(name, None)
            return self._taken[name]

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self._taken)


def _clean(value: str, spec: SecretSpec, where: str) -> str:
    value = value.removesuffix("\n").removesuffix("\r")
    if not value:
        raise SecretError(f"secret {spec.name!r}: {where} is empty")
    if len(value) > MAX_VALUE:
        raise SecretError(f"secret {spec.name!r}: {where} is longer than {MAX_VALUE} characters")
    if any(c in value for c in "\r\n\0") or not value.isprintable():
        raise SecretError(
            f"secret {spec.name!r}: {where} holds control characters (a header cannot carry it)"
        )
    return value


def read_value(spec: SecretSpec, vault: EnvVault, read: Callable[[Path], bytes] = Path.read_bytes) -> str:
    """The real value of one secret, from its source; raises SecretError. `read` reads a `file:`
    source (a watcher's snapshot: read once with the policy, and watched with it)."""
    source = spec.source
    where = source.describe()
    if source.kind == "env":
        value = vault.take(source.env)
        if value is None:
            raise SecretError(f"secret {spec.name!r}: {where} is not set in egressd's environment")
        return _clean(value, spec, where)
    if source.kind == "file":
        try:
            text = read(Path(os.path.expanduser(source.file))).decode("utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            why = exc.strerror if isinstance(exc, OSError) and exc.strerror else type(exc).__name__
            raise SecretError(f"secret {spec.name!r}: cannot read {where}: {why}") from None
        return _clean(text, spec, where)
    try:
        done = subprocess.run(
            list(source.command),
            stdin=subprocess.DEVNULL,
            capture_output=True,
            timeout=COMMAND_TIMEOUT,
            check=False,
        )
    except (OSError, subprocess.SubprocessError) as exc:
        why = exc.strerror if isinstance(exc, OSError) and exc.strerror else type(exc).__name__
        raise SecretError(f"secret {spec.name!r}: {where} could not run: {why}") from None
    if done.returncode != 0:
        # its output is never shown: a failing lookup may still have printed part of a credential
        raise SecretError(f"secret {spec.name!r}: {where} exited with status {done.returncode}")
    try:
        text = done.stdout.decode("utf-8")
    except UnicodeDecodeError:
        raise SecretError(f"secret {spec.name!r}: {where} printed something that is not UTF-8") from None
    return _clean(text, spec, where)


def read_values(
    specs: Sequence[SecretSpec], vault: EnvVault, read: Callable[[Path], bytes] = Path.read_bytes
) -> dict[str, str]:
    """{name: value} of every secret; the first that fails raises SecretError."""
    return {spec.name: read_value(spec, vault, read) for spec in specs}


def hidden_variables(specs: Sequence[SecretSpec], vault: EnvVault) -> tuple[str, ...]:
    """Variables a child never gets: every source variable a secret names or named this run."""
    return tuple(dict.fromkeys([*vault.names, *(s.source.env for s in specs if s.source.kind == "env")]))


def _libc() -> ctypes.CDLL | None:
    if not sys.platform.startswith(("linux", "darwin")):
        return None
    try:
        return ctypes.CDLL(libc_name(), use_errno=True)
    except OSError:
        return None


def environ_array() -> ctypes._Pointer[ctypes.c_void_p] | None:  # type: ignore[name-defined]
    """The C library's `environ` (char **): through `_NSGetEnviron()` on macOS (the documented way
    for a library to reach it), the `environ` symbol elsewhere."""
    libc = _libc()
    if libc is None:
        return None
    pointer = ctypes.POINTER(ctypes.c_void_p)
    try:
        if sys.platform == "darwin":
            get = libc._NSGetEnviron
            get.restype = ctypes.POINTER(pointer)
            return get().contents
        return pointer.in_dll(libc, "environ")
    except (AttributeError, ValueError):
        return None


def wipe_environ_entries(name: str, envp: ctypes._Pointer[ctypes.c_void_p] | None) -> bool:  # type: ignore[name-defined]
    """Overwrite the value of every `NAME=value` string the environment array `envp` leads to, in
    place: at start they are the strings the kernel copied in at exec, which another process of
    the user reads back (macOS: kern.procargs2). True when one was found."""
    if envp is None:
        return False
    prefix = name.encode() + b"="
    wiped = False
    for index in range(1 << 16):
        address = envp[index]
        if not address:
            break
        entry = ctypes.string_at(address)
        if entry.startswith(prefix):
            ctypes.memset(address + len(prefix), ord("x"), len(entry) - len(prefix))
            wiped = True
    return wiped


def not_dumpable() -> bool:
    """prctl(PR_SET_DUMPABLE, 0): /proc/<egressd>/environ, mem and ptrace closed to same-user processes
    (root keeps them). True when done."""
    libc = _libc() if sys.platform.startswith("linux") else None
    if libc is None:
        return False
    return bool(libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0) == 0)


def wipe_original_environ(name: str) -> bool:
    """Overwrite `NAME=value` in the process's original environment strings (os.environ and
    unsetenv leave them untouched). Linux: the whole block /proc/self/environ shows, also entries
    the array no longer leads to; macOS: the strings `environ` leads to (call before unsetenv).
    True when found and wiped."""
    if sys.platform == "darwin":
        return wipe_environ_entries(name, environ_array())
    libc = _libc()
    if libc is None:
        return False
    try:
        stat = Path("/proc/self/stat").read_text()
        fields = stat[stat.rindex(")") + 2 :].split()
        # fields after the command name start at field 3; env_start/env_end are fields 50 and 51
        start, end = int(fields[47]), int(fields[48])
    except (OSError, ValueError, IndexError):
        return False
    if not 0 < start < end or end - start > 1 << 24:
        return False
    block = ctypes.string_at(start, end - start)
    prefix = name.encode() + b"="
    offset, wiped = 0, False
    for entry in block.split(b"\0"):
        if entry.startswith(prefix):
            at = start + offset + len(prefix)
            ctypes.memset(at, ord("x"), len(entry) - len(prefix))
            wiped = True
        offset += len(entry) + 1
    return wiped
