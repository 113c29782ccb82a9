"""Add one rule to a policy file for an ask answered "always" / "deny always".

The file is the user's: its comments, key order, quoting and indentation are kept (ruamel.yaml
round-trip), the new text must load as a valid policy before it replaces the old one, and the
replacement is atomic (a temporary file beside it, then rename), so the watcher — which applies it
like any edit — never reads half a file. The policy package stays pure; this is the I/O beside it.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import tempfile
from pathlib import Path

from egressd.policy import PolicyError, load_policy

LISTS = ("allow", "deny")


class PolicyEditError(Exception):
    """The rule could not be added; the file is unchanged."""


def add_rule(path: str | os.PathLike[str], which: str, rule: str) -> str:
    """Append `rule` to the `which` list ("allow" or "deny") of the policy file; return a line
    saying what was done. A rule already there is left alone."""
    if which not in LISTS:
        raise PolicyEditError(f"cannot add to {which!r}")
    real = Path(os.path.realpath(path))
    try:
        text = real.read_text(encoding="utf-8")
    except OSError as exc:
        raise PolicyEditError(f"{path}: {exc.strerror or exc}") from exc
    if real.suffix.lower() == ".json":
        new_text, added = _add_json(text, which, rule)
    else:
        new_text, added = _add_yaml(text, which, rule)
    if not added:
        return f"{rule} already in {which} of {real}"
    _replace(real, new_text)
    return f"added {rule} to {which} in {real}"


def _add_yaml(text: str, which: str, rule: str) -> tuple[str, bool]:
    from ruamel.yaml import YAML
    from ruamel.yaml.comments import CommentedMap, CommentedSeq

    yaml = YAML()  # round-trip: comments, order and quoting survive
    yaml.preserve_quotes = True
    yaml.width = 4096
    if re.search(r"^[ \t]+- ", text, re.MULTILINE):
        yaml.indent(mapping=2, sequence=4, offset=2)  # the file indents its lists ("  - x")
    data = yaml.load(text)
    if data is None:
        data = CommentedMap()
    if not isinstance(data, dict):
        raise PolicyEditError("the policy file is not a mapping")
    entries = data.get(which)
    if entries is None:
        data[which] = CommentedSeq([rule])
    elif not isinstance(entries, list):
        raise PolicyEditError(f"{which} is not a list")
    elif rule in entries:
        return text, False
    else:
        entries.append(rule)
    out = io.StringIO()
    yaml.dump(data, out)
    return out.getvalue(), True


def _add_json(text: str, which: str, rule: str) -> tuple[str, bool]:
    data = json.loads(text)
    if not isinstance(data, dict):
        raise PolicyEditError("the policy file is not a mapping")
    entries = data.setdefault(which, [])
    if not isinstance(entries, list):
        raise PolicyEditError(f"{which} is not a list")
    if rule in entries:
        return text, False
    entries.append(rule)
    return json.dumps(data, indent=2) + "\n", True


def _replace(path: Path, text: str) -> None:
    """Write beside the file, check the result loads as a policy, then rename over the file."""
    mode = path.stat().st_mode & 0o7777
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=path.suffix, dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        try:
            load_policy(tmp, env={})
        except PolicyError as exc:
            raise PolicyEditError(f"the edited policy would not load: {exc}") from exc
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
