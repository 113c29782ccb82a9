"""The gateway's token file on disk: where it is, reading it, and adding or removing a client.

The file is JSON (`egressd.admission.tokens.TokenTable`), mode 0600, replaced atomically (a running
gateway re-reads it when it changes, through egressd.platform.reload: it must see the old file or the new
one; a file another tool rewrites in place is applied once it holds still), and edits are
serialised by a lock file beside it so two `token add` never lose one another's entry. It holds
hashes only: the token itself is printed once by `token add` and never stored.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

from egressd.admission.tokens import TokenEntry, TokenFileError, TokenTable, make_entry, new_token
from egressd.platform.files import replace_atomically


def default_tokens_path(env: Mapping[str, str] | None = None) -> Path:
    """`$EGRESSD_HOME/gateway/tokens.json`, or under ~/.config/egressd (the CA's home) without it."""
    from egressd.inspect import ca

    return ca.config_dir(dict(env) if env is not None else None) / "gateway" / "tokens.json"


def load_table(path: Path) -> TokenTable:
    """The file's table; a missing file is an empty table (a gateway with no clients yet)."""
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return TokenTable.empty()
    except OSError as exc:
        raise TokenFileError(f"{path}: {exc.strerror or exc}") from exc
    return table_from_bytes(raw, str(path))


def table_from_bytes(raw: bytes, source: str) -> TokenTable:
    """The table these bytes of the token file `source` hold (the running gateway's watcher parses
    exactly the bytes it checked); anything but a whole, valid file raises TokenFileError."""
    try:
        data = json.loads(raw.decode("utf-8"))
    except ValueError as exc:  # UnicodeDecodeError is one
        raise TokenFileError(f"{source}: not JSON: {exc}") from exc
    return TokenTable.from_data(data, source)


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    fd = os.open(path.parent / f".{path.name}.lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _write(path: Path, table: TokenTable) -> None:
    text = json.dumps(table.to_data(), indent=1, sort_keys=True) + "\n"
    replace_atomically(path, text, mode=0o600)


def ensure_file(path: Path) -> None:
    """Create an empty token file (0600, its directory 0700) when there is none yet."""
    if path.exists():
        return
    with _locked(path):
        if not path.exists():
            _write(path, TokenTable.empty())


def add_clients(
    path: Path, names: Sequence[str], *, profile: str | None = None, sources: Sequence[str] = ()
) -> dict[str, str]:
    """Add (or replace) clients; returns each name's new token, which nothing stores."""
    tokens = {name: new_token() for name in names}
    now = round(time.time(), 3)
    entries = [make_entry(n, t, profile=profile, sources=sources, created=now) for n, t in tokens.items()]
    with _locked(path):
        table = load_table(path)
        for entry in entries:
            table = table.with_entry(entry)
        _write(path, table)
    return tokens


def remove_client(path: Path, name: str) -> bool:
    """Remove a client; False when there was none of that name."""
    with _locked(path):
        table = load_table(path)
        if name not in table.entries:
            return False
        _write(path, table.without(name))
    return True


def list_clients(path: Path) -> list[TokenEntry]:
    return sorted(load_table(path).entries.values(), key=lambda e: e.name)
