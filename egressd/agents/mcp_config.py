"""`egressd mcp wrap|unwrap`: an MCP client's configuration, rewritten so each stdio server runs
under `egressd mcp run` with its own profile, and restored.

Why a profile per server: servers wrapped under one policy would otherwise share its allowances —
a fetch tool could reach the hosts the GitHub server needs. Each wrapped server runs with
`--profile <server>`, and `profiles.<server>` in the policy narrows it; a server whose profile is
missing does not start (egressd refuses an unknown profile), so wrap refuses until it exists.

Formats: Claude Desktop `claude_desktop_config.json`, Claude Code `.mcp.json` and Cursor
`.cursor/mcp.json` keep servers under `mcpServers`; VS Code `.vscode/mcp.json` under `servers`
(`type: stdio`). Only stdio entries (a `command`) are wrapped; everything else, every unknown key
and the key order stay. The wrapped entry is `{command: egressd, args: [mcp, run, OPTIONS..., --,
ORIGINAL COMMAND, ORIGINAL ARGS...]}`, which is also how unwrap finds the original.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from egressd.files import replace_atomically

SERVER_KEYS = ("mcpServers", "servers")
BACKUP_SUFFIX = ".egressd-backup"
NO_ARGS_KEY = "--no-args-key"  # the original entry had no `args` (unwrap removes it again)
_PROFILE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")  # as egressd.policy.loader accepts


class ConfigError(Exception):
    """The file cannot be read or rewritten; it was not touched. The message says why."""


@dataclass(frozen=True)
class WrapOptions:
    egressd: tuple[str, ...]  # how a client starts egressd: (command, *leading args)
    policy: str  # absolute path of the policy file whose profiles the servers run under
    sandbox: bool = False
    servers: tuple[str, ...] = ()  # only these (default: every stdio server)


def profile_name(server: str) -> str:
    """The profile a server runs under: its name, when egressd accepts it as a profile name."""
    if not _PROFILE_NAME.fullmatch(server):
        raise ConfigError(
            f"server {server!r}: its name cannot name an egressd profile (letters, digits, '.', '_', '-'; "
            "at most 64); rename it, or leave it out with --server"
        )
    return server


def load(path: Path) -> tuple[dict[str, Any], str, str]:
    """(document, the servers key, the file's text); ConfigError when it is not an MCP config."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path}: cannot read it: {exc}") from exc
    duplicates: list[str] = []

    def pairs(items: list[tuple[str, Any]]) -> dict[str, Any]:
        result = dict(items)
        if len(result) != len(items):
            seen: set[str] = set()
            duplicates.extend(k for k, _ in items if k in seen or seen.add(k))  # type: ignore[func-returns-value]
        return result

    try:
        document = json.loads(text, object_pairs_hook=pairs)
    except ValueError as exc:
        raise ConfigError(
            f"{path}: not valid JSON ({exc}); comments and trailing commas are not supported. "
            "The file was not changed."
        ) from exc
    if duplicates:
        raise ConfigError(f"{path}: duplicate keys {sorted(set(duplicates))}; the file was not changed")
    if not isinstance(document, dict):
        raise ConfigError(f"{path}: the top level must be a JSON object; the file was not changed")
    for key in SERVER_KEYS:
        if key in document:
            if not isinstance(document[key], dict):
                raise ConfigError(f"{path}: {key!r} must be an object; the file was not changed")
            return document, key, text
    raise ConfigError(
        f"{path}: no 'mcpServers' (Claude Desktop, Claude Code, Cursor) or 'servers' (VS Code) object; "
        "the file was not changed"
    )


def is_stdio(entry: object) -> bool:
    return (
        isinstance(entry, dict)
        and isinstance(entry.get("command"), str)
        and entry.get("type", "stdio") == "stdio"
    )


def _run_index(args: Sequence[object]) -> int | None:
    """Where `mcp run` starts in a wrapped entry's args (after `-m egressd` for a Python command)."""
    for start in (0, 2):
        if list(args[start : start + 2]) == ["mcp", "run"] and (
            start == 0 or list(args[:2]) == ["-m", "egressd"]
        ):
            return start
    return None


def original(entry: dict[str, Any]) -> tuple[str, list[Any], bool] | None:
    """(command, args, had an args key) of a wrapped entry; None when it is not wrapped."""
    args = entry.get("args")
    if not isinstance(args, list) or (start := _run_index(args)) is None:
        return None
    try:
        separator = args.index("--", start + 2)
    except ValueError:
        return None
    if separator + 1 >= len(args) or not isinstance(args[separator + 1], str):
        return None
    return args[separator + 1], args[separator + 2 :], NO_ARGS_KEY not in args[start + 2 : separator]


def unwrap_entry(entry: dict[str, Any]) -> bool:
    """Restore one entry in place (key order kept); False when it was not wrapped."""
    found = original(entry)
    if found is None:
        return False
    command, args, had_args = found
    entry["command"] = command
    if had_args:
        entry["args"] = args
    else:
        del entry["args"]
    return True


def wrap_entry(name: str, entry: dict[str, Any], options: WrapOptions) -> None:
    """Wrap one stdio entry in place; an entry already wrapped is wrapped again from its original."""
    unwrap_entry(entry)
    flags = ["--profile", profile_name(name), "--policy", options.policy]
    if options.sandbox:
        flags.append("--sandbox")
    had_args = "args" in entry
    if not had_args:
        flags.append(NO_ARGS_KEY)
    wrapped_args = [
        *options.egressd[1:],
        "mcp",
        "run",
        *flags,
        "--",
        entry["command"],
        *entry.get("args", []),
    ]
    if had_args:
        entry["command"] = options.egressd[0]
        entry["args"] = wrapped_args
        return
    # keep the key order: `args` goes right after `command`
    rebuilt: dict[str, Any] = {}
    for key, value in entry.items():
        rebuilt[key] = options.egressd[0] if key == "command" else value
        if key == "command":
            rebuilt["args"] = wrapped_args
    entry.clear()
    entry.update(rebuilt)


def wrap(document: dict[str, Any], key: str, options: WrapOptions) -> list[str]:
    """Wrap the chosen stdio servers in place; their names, in file order."""
    servers = document[key]
    unknown = [name for name in options.servers if name not in servers]
    if unknown:
        raise ConfigError(
            f"no such server: {', '.join(unknown)} (the file has: {', '.join(servers) or 'none'})"
        )
    chosen = [name for name in servers if (not options.servers or name in options.servers)]
    wrapped = []
    for name in chosen:
        entry = servers[name]
        if not is_stdio(entry):
            if options.servers:
                raise ConfigError(f"server {name!r} is not a stdio server (only those run under egressd)")
            continue
        profile_name(name)
        wrap_entry(name, entry, options)
        wrapped.append(name)
    return wrapped


def unwrap(document: dict[str, Any], key: str, names: Sequence[str] = ()) -> list[str]:
    """Restore the wrapped servers in place (only `names` when given); their names."""
    return [
        name
        for name, entry in document[key].items()
        if (not names or name in names) and isinstance(entry, dict) and unwrap_entry(entry)
    ]


def render(document: dict[str, Any], like: str) -> str:
    """JSON text in the file's own indentation and final newline."""
    match = re.search(r"\n([ \t]+)\S", like)
    indent: str | int = match.group(1) if match else 2
    text = json.dumps(document, indent=indent, ensure_ascii=False)
    return text + "\n" if like.endswith("\n") or not like else text


def backup_path(path: Path) -> Path:
    return path.with_name(path.name + BACKUP_SUFFIX)


def same(document: dict[str, Any], text: str) -> bool:
    """`document` says what `text` says, in the same key order (then the file is left as it is)."""
    return json.dumps(document) == json.dumps(json.loads(text))


def save(path: Path, old_text: str, new_text: str) -> bool:
    """Write `new_text` when it differs, after keeping `old_text` as the backup; False if unchanged."""
    if new_text == old_text:
        return False
    write_atomically_new(backup_path(path), old_text, like=path)
    # a config that is a symlink (dotfiles) stays one: the file it leads to is replaced
    replace_atomically(path.resolve(), new_text)
    return True


def write_atomically_new(path: Path, text: str, *, like: Path) -> None:
    """Write a file that may not exist yet, with the permissions of `like` (a config may hold tokens)."""
    if not path.exists():
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, like.stat().st_mode & 0o666)
        os.close(fd)
    replace_atomically(path, text)


def restored_text(path: Path, document: dict[str, Any], rendered: str) -> str:
    """After unwrap: the backup's exact bytes when it holds the same configuration (wrap's own
    formatting undone too), else the rendered document."""
    backup = backup_path(path)
    with contextlib.suppress(OSError, UnicodeDecodeError, ValueError):
        text = backup.read_text(encoding="utf-8")
        if same(document, text):
            return text
    return rendered
