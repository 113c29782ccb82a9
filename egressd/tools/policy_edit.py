"""Add or remove one rule of a policy file: an ask answered "always" / "deny always", the dashboard.

The file is the user's: its comments, key order, quoting and indentation are kept (ruamel.yaml
round-trip), the new text must load as a valid policy before it replaces the old one, and the
replacement is atomic (a temporary file beside it, then rename), so the watcher — which applies it
like any edit — never reads half a file. The policy package stays pure; this is the I/O beside it.
"""

from __future__ import annotations

import io
import json
import os
import re
from collections.abc import Callable, MutableMapping
from pathlib import Path
from typing import Any

from egressd.platform.files import replace_atomically
from egressd.policy import PolicyError, load_policy
from egressd.policy.entries import parse_rule_list

LISTS = ("allow", "deny")

PolicyEditor = Callable[[str, str, str], str]  # (op "add"/"remove", list, rule) -> what was done


class PolicyEditError(Exception):
    """The rule could not be added; the file is unchanged."""


def validate_rule(which: str, rule: object) -> str:
    """The rule as text if it is one a policy list may hold; PolicyEditError saying why not (a UI
    refuses it before the file is touched)."""
    if which not in LISTS:
        raise PolicyEditError(f"the list must be one of {', '.join(LISTS)}, not {which!r}")
    if not isinstance(rule, str) or not rule.strip():
        raise PolicyEditError("the rule must be a non-empty string")
    rule = rule.strip()
    try:
        parse_rule_list([rule], "<rule>", which)
    except PolicyError as exc:
        raise PolicyEditError(f"not a valid {which} rule: {exc}") from None
    return rule


def add_rule(path: str | os.PathLike[str], which: str, rule: str) -> str:
    """Append `rule` to the `which` list ("allow" or "deny") of the policy file; return a line
    saying what was done. A rule already there is left alone."""
    return edit_rule(path, which, rule, remove=False)


def edit_rule(path: str | os.PathLike[str], which: str, rule: str, *, remove: bool) -> str:
    """Add or remove one rule, checked first (validate_rule), the result checked to load as a
    policy, the file replaced atomically; the line saying what was done."""
    rule = validate_rule(which, rule)
    real = Path(os.path.realpath(path))

    def change(data: MutableMapping[str, Any]) -> bool:
        entries = data.get(which)
        if remove:
            if not isinstance(entries, list) or rule not in entries:
                return False
            entries.remove(rule)
        elif entries is None:
            data[which] = [rule]
        elif not isinstance(entries, list):
            raise PolicyEditError(f"{which} is not a list")
        elif rule in entries:
            return False
        else:
            entries.append(rule)
        return True

    if not edit_document(real, change):
        if remove:
            raise PolicyEditError(f"{rule} is not in {which} of {real}")
        return f"{rule} already in {which} of {real}"
    return f"{'removed' if remove else 'added'} {rule} {'from' if remove else 'to'} {which} in {real}"


def edit_document(
    path: str | os.PathLike[str],
    change: Callable[[MutableMapping[str, Any]], bool],
    *,
    create: str | None = None,
) -> bool:
    """Apply `change` to the policy file's top-level mapping (its lists are plain lists to the
    callable; YAML keeps its comments, order and quoting), check the result loads, and replace the
    file atomically. False when `change` changed nothing (the file is untouched). A file that does
    not load now is refused untouched; a missing file starts from `create` when given."""
    real = Path(os.path.realpath(path))
    try:
        text = real.read_text(encoding="utf-8")
    except FileNotFoundError:
        if create is None:
            raise PolicyEditError(f"{path}: no such file") from None
        text = create
    except OSError as exc:
        raise PolicyEditError(f"{path}: {exc.strerror or exc}") from exc
    else:
        try:
            load_policy(real, env={})
        except PolicyError as exc:
            raise PolicyEditError(f"the policy does not load, so it was not edited: {exc}") from exc
    if real.suffix.lower() == ".json":
        new_text, changed = _edit_json(text, change)
    else:
        new_text, changed = _edit_yaml(text, change)
    if changed:
        _replace(real, new_text)
    return changed


def _edit_yaml(text: str, change: Callable[[MutableMapping[str, Any]], bool]) -> tuple[str, bool]:
    from ruamel.yaml import YAML
    from ruamel.yaml.comments import CommentedMap

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
    if not change(data):
        return text, False
    out = io.StringIO()
    yaml.dump(data, out)
    return out.getvalue(), True


def _edit_json(text: str, change: Callable[[MutableMapping[str, Any]], bool]) -> tuple[str, bool]:
    data = json.loads(text)
    if not isinstance(data, dict):
        raise PolicyEditError("the policy file is not a mapping")
    if not change(data):
        return text, False
    return json.dumps(data, indent=2) + "\n", True


def _replace(path: Path, text: str) -> None:
    """Write beside the file, check the result loads as a policy, then rename over the file."""

    def loads(temp: str) -> None:
        try:
            load_policy(temp, env={})
        except PolicyError as exc:
            raise PolicyEditError(f"the edited policy would not load: {exc}") from exc

    replace_atomically(path, text, check=loads)
