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

from egressd.agents import jsonc
from egressd.platform.files import replace_atomically

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
    """(document, the servers key, the file's text); ConfigError when it is not an MCP config.
    JSON with comments and trailing commas (VS Code's JSONC) is read too."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path}: cannot read it: {exc}") from exc
    try:
        document, key = _servers(text)
    except jsonc.JsoncError as exc:
        raise ConfigError(f"{path}: not valid JSON (with comments): {exc}; the file was not changed") from exc
    except ConfigError as exc:
        raise ConfigError(f"{path}: {exc}; the file was not changed") from exc
    return document, key, text


def _servers(text: str) -> tuple[dict[str, Any], str]:
    document = jsonc.parse(text).value
    if not isinstance(document, dict):
        raise ConfigError("the top level must be a JSON object")
    for key in SERVER_KEYS:
        if key in document:
            if not isinstance(document[key], dict):
                raise ConfigError(f"{key!r} must be an object")
            return document, key
    raise ConfigError("no 'mcpServers' (Claude Desktop, Claude Code, Cursor) or 'servers' (VS Code) object")


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


def _separator_index(args: Sequence[object]) -> int | None:
    """Where the `--` before the original command is in a wrapped entry's args; None if unwrapped."""
    if (start := _run_index(args)) is None:
        return None
    try:
        separator = list(args).index("--", start + 2)
    except ValueError:
        return None
    if separator + 1 >= len(args) or not isinstance(args[separator + 1], str):
        return None
    return separator


def original(entry: dict[str, Any]) -> tuple[str, list[Any], bool] | None:
    """(command, args, had an args key) of a wrapped entry; None when it is not wrapped."""
    args = entry.get("args")
    if not isinstance(args, list) or (separator := _separator_index(args)) is None:
        return None
    start = _run_index(args) or 0
    return args[separator + 1], args[separator + 2 :], NO_ARGS_KEY not in args[start + 2 : separator]


def skip_reason(entry: object) -> str:
    """Why `wrap` leaves an entry as it is (not a stdio server)."""
    if not isinstance(entry, dict):
        return "not a server entry (an object)"
    kind = entry.get("type")
    if kind is not None and kind != "stdio":
        return (
            f"a remote server (type {kind}): the MCP client connects to it itself, egressd is not "
            "between them; only stdio servers (a command) run under egressd"
        )
    return "no command to run (only stdio servers run under egressd)"


def _entry(text: str, key: str, name: str) -> jsonc.Node:
    return jsonc.parse(text).members[key][1].members[name][1]


def _space_before(text: str, index: int) -> str:
    start = index
    while start > 0 and text[start - 1] in jsonc.WHITESPACE:
        start -= 1
    return text[start:index]


def _separator(text: str, index: int) -> str:
    """What goes between two items placed before `index`: a comma and the line break and
    indentation that lead to it, when it starts a line; else a comma and a space."""
    space = _space_before(text, index)
    return "," + space if "\n" in space else ", "


def _remove_member(entry: jsonc.Node, key: str) -> tuple[int, int, str]:
    """The edit that removes one member of an object with its comma."""
    names = list(entry.members)
    at = names.index(key)
    key_start, value = entry.members[key]
    if at > 0:
        return (entry.members[names[at - 1]][1].end, value.end, "")
    if at + 1 < len(names):
        return (key_start, entry.members[names[at + 1]][0], "")
    return (key_start, value.end, "")


def unwrap_entry(text: str, key: str, name: str) -> str | None:
    """The text with server `name` restored (every other byte kept); None when it is not wrapped."""
    entry = _entry(text, key, name)
    if not isinstance(entry.value, dict) or (found := original(entry.value)) is None:
        return None
    had_args = found[2]
    command = entry.members["command"][1]
    items = entry.members["args"][1].items
    first = _separator_index(entry.value["args"]) + 1  # type: ignore[operator]  # wrapped: found
    edits = [(command.start, command.end, text[items[first].start : items[first].end])]
    if had_args:
        end = items[first + 1].start if first + 1 < len(items) else items[first].end
        edits.append((items[0].start, end, ""))
    else:
        edits.append(_remove_member(entry, "args"))
    return jsonc.splice(text, edits)


def wrap_entry(text: str, key: str, name: str, options: WrapOptions) -> str:
    """The text with stdio server `name` run under egressd: its command becomes egressd, and
    egressd's arguments and the original command go in front of its own `args` (every other byte
    kept); an entry already wrapped is wrapped again from its original."""
    text = unwrap_entry(text, key, name) or text
    entry = _entry(text, key, name)
    if "args" in entry.members and not isinstance(entry.value["args"], list):
        raise ConfigError(f"server {name!r}: its args must be a list")
    flags = ["--profile", profile_name(name), "--policy", options.policy]
    if options.sandbox:
        flags.append("--sandbox")
    if "args" not in entry.members:
        flags.append(NO_ARGS_KEY)
    command = entry.members["command"][1]
    words = [_json(word) for word in (*options.egressd[1:], "mcp", "run", *flags, "--")]
    words.append(text[command.start : command.end])  # the original command, exactly as written
    edits = [(command.start, command.end, _json(options.egressd[0]))]
    if "args" not in entry.members:  # `args` goes right after `command`
        separator = _separator(text, entry.members["command"][0])
        edits.append((command.end, command.end, f'{separator}"args": [{", ".join(words)}]'))
    elif items := entry.members["args"][1].items:
        separator = _separator(text, items[0].start)
        edits.append((items[0].start, items[0].start, separator.join(words) + separator))
    else:
        opening = entry.members["args"][1].start + 1
        edits.append((opening, opening, ", ".join(words)))
    return jsonc.splice(text, edits)


def _json(value: str) -> str:
    return json.dumps(value, ensure_ascii=False)


def wrap(text: str, key: str, options: WrapOptions) -> tuple[str, list[str], list[tuple[str, str]]]:
    """(the new text, the servers wrapped, the servers skipped with why), in file order."""
    servers = _servers(text)[0][key]
    unknown = [name for name in options.servers if name not in servers]
    if unknown:
        raise ConfigError(
            f"no such server: {', '.join(unknown)} (the file has: {', '.join(servers) or 'none'})"
        )
    wrapped, skipped = [], []
    for name, entry in servers.items():
        if options.servers and name not in options.servers:
            continue
        if not is_stdio(entry):
            if options.servers:
                raise ConfigError(f"server {name!r} is not a stdio server: {skip_reason(entry)}")
            skipped.append((name, skip_reason(entry)))
            continue
        text = wrap_entry(text, key, name, options)
        wrapped.append(name)
    return text, wrapped, skipped


def unwrap(text: str, key: str, names: Sequence[str] = ()) -> tuple[str, list[str]]:
    """(the text with the wrapped servers restored — only `names` when given —, their names)."""
    restored = []
    for name in _servers(text)[0][key]:
        if names and name not in names:
            continue
        unwrapped = unwrap_entry(text, key, name)
        if unwrapped is not None:
            text = unwrapped
            restored.append(name)
    return text, restored


def backup_path(path: Path) -> Path:
    return path.with_name(path.name + BACKUP_SUFFIX)


def save(path: Path, old_text: str, new_text: str, *, backup: bool) -> bool:
    """Write `new_text` when it differs (after keeping `old_text` as the backup, with `backup`);
    False if unchanged."""
    if new_text == old_text:
        return False
    if backup:
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


def settle_backup(path: Path, text: str) -> str:
    """After unwrap: wrap's backup is removed when it holds exactly `text` (nothing in it is lost);
    otherwise it stays. What to tell the user either way."""
    backup = backup_path(path)
    try:
        kept = backup.read_text(encoding="utf-8")
    except FileNotFoundError:
        return "no backup is left"
    except (OSError, UnicodeDecodeError) as exc:
        return f"the backup {backup} is kept (it could not be read: {exc})"
    if kept == text:
        with contextlib.suppress(FileNotFoundError):
            backup.unlink()
        return f"its backup {backup} held the same bytes and is removed"
    return (
        f"the backup {backup} is kept: it holds the file as `egressd mcp wrap` found it, which differs "
        "from the file now (compare them, then delete it)"
    )
