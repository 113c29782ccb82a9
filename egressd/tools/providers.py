"""Provider presets and their acknowledgement in the user's policy file (`egressd provider`).

A preset (`policies/NAME.yaml` with a `preset:` key) names the hosts a service really uses and
what data goes to them. `add` writes those hosts into the user's `allow` list and records the
acknowledgement (`providers:`: name, preset version, day, hosts, and which rules this add wrote),
in one atomic edit that keeps the file's comments (policy_edit). `remove` takes out only the rules
an add wrote and no other acknowledged provider needs: rules the user wrote by hand stay.
"""

from __future__ import annotations

import datetime
import os
from collections.abc import MutableMapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from egressd.policy import Policy, PolicyError, load_policy
from egressd.policy.loader import builtin_policy_names, builtin_policy_path
from egressd.policy.model import PresetInfo
from egressd.tools.policy_edit import PolicyEditError, edit_document


class ProviderError(Exception):
    """An unknown provider, or a policy file that cannot be edited; nothing was changed."""


@dataclass(frozen=True)
class Provider:
    """One shipped preset that describes itself as a provider."""

    info: PresetInfo
    hosts: tuple[str, ...]  # its allow rules as written
    path: Path
    policy: Policy


def providers() -> list[Provider]:
    """Every shipped preset with a `preset:` key, by name."""
    found = []
    for name in builtin_policy_names():
        policy = load_policy(builtin_policy_path(name))
        if policy.preset is not None:
            found.append(_provider(policy, builtin_policy_path(name)))
    return found


def _provider(policy: Policy, path: Path) -> Provider:
    assert policy.preset is not None
    return Provider(policy.preset, tuple(rule.text for rule in policy.allow.rules), path, policy)


def provider(name: str) -> Provider:
    """The preset `name`; ProviderError naming the known ones otherwise."""
    known = {p.info.name: p for p in providers()}
    if name not in known:
        raise ProviderError(f"unknown provider {name!r} (known: {', '.join(sorted(known))})")
    return known[name]


def _rules_text(rules: object) -> list[str]:
    return [r for r in rules if isinstance(r, str)] if isinstance(rules, list) else []


def _acks(data: MutableMapping[str, Any]) -> list[Any]:
    acks = data.get("providers")
    if acks is None:
        acks = data["providers"] = []
    if not isinstance(acks, list):
        raise PolicyEditError("providers is not a list")
    return acks


def _take_out(data: MutableMapping[str, Any], name: str) -> list[str]:
    """Remove the acknowledgement of `name` and the rules it wrote that no other acknowledged
    provider lists; a kept rule becomes the other provider's to remove. Returns the rules removed."""
    acks = _acks(data)
    mine = next((a for a in acks if isinstance(a, dict) and a.get("name") == name), None)
    if mine is None:
        return []
    acks.remove(mine)
    allow = data.get("allow")
    removed = []
    for rule in _rules_text(mine.get("added")):
        other = next((a for a in acks if isinstance(a, dict) and rule in _rules_text(a.get("hosts"))), None)
        if other is not None:
            other.setdefault("added", [])
            if rule not in other["added"]:
                other["added"].append(rule)
        elif isinstance(allow, list) and rule in allow:
            allow.remove(rule)
            removed.append(rule)
    if not acks:
        del data["providers"]
    return removed


def user_file(path: str | os.PathLike[str]) -> None:
    """The file to edit is the user's: never a shipped preset, nor a preset's bare name with no such
    file (which `--policy NAME` reads as the preset, not as the file this would create)."""
    text = os.fspath(path)
    real = os.path.realpath(text)
    for name in builtin_policy_names():
        preset = builtin_policy_path(name)
        if real == os.path.realpath(preset):
            raise ProviderError(f"{text} is egressd's {name} preset: acknowledge into your own policy file")
        if text == name and not os.path.exists(text):
            raise ProviderError(f"{text!r} names the {name} preset: give your policy file's path (./{text})")


def acknowledge(
    path: str | os.PathLike[str], chosen: Provider, today: datetime.date | None = None
) -> list[str]:
    """Write the provider's hosts into `allow` and its acknowledgement into `providers:` (an
    earlier acknowledgement of it is replaced); the rules added. A missing file is created from the
    default policy."""
    user_file(path)
    added: list[str] = []
    day = (today or datetime.date.today()).isoformat()

    def change(data: MutableMapping[str, Any]) -> bool:
        previous = _take_out(data, chosen.info.name)
        allow = data.get("allow")
        if allow is None:
            allow = data["allow"] = []
        if not isinstance(allow, list):
            raise PolicyEditError("allow is not a list")
        mine = []
        for rule in chosen.hosts:
            if rule in allow:
                continue  # written by hand, or another acknowledged provider's: not this add's
            allow.append(rule)
            mine.append(rule)
        added.extend(r for r in mine if r not in previous)
        _acks(data).append(
            {
                "name": chosen.info.name,
                "version": chosen.info.version,
                "acknowledged": day,
                "hosts": list(chosen.hosts),
                "added": mine,
            }
        )
        return True

    try:
        edit_document(path, change, create=builtin_policy_path("default").read_text(encoding="utf-8"))
    except PolicyEditError as exc:
        raise ProviderError(str(exc)) from exc
    return added


def withdraw(path: str | os.PathLike[str], name: str) -> list[str]:
    """Remove the acknowledgement of `name` and the rules only it needed; the rules removed."""
    user_file(path)
    removed: list[str] = []
    found = False

    def change(data: MutableMapping[str, Any]) -> bool:
        nonlocal found
        acks = data.get("providers")
        found = isinstance(acks, list) and any(isinstance(a, dict) and a.get("name") == name for a in acks)
        if found:
            removed.extend(_take_out(data, name))
        return found

    try:
        edit_document(path, change)
    except PolicyEditError as exc:
        raise ProviderError(str(exc)) from exc
    if not found:
        raise ProviderError(f"{name} is not acknowledged in {path} (nothing changed)")
    return removed


def acknowledged(path: str | os.PathLike[str]) -> Policy:
    """The policy file as loaded, for its `providers:`; ProviderError when it does not load."""
    try:
        return load_policy(path)
    except PolicyError as exc:
        raise ProviderError(str(exc)) from exc
