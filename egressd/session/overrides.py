"""The command line's additions to the policy, and where a policy is read from."""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from egressd.policy import (
    Policy,
    PolicyError,
    apply_env_mode,
    builtin_policy_path,
    default_policy,
    load_policy,
)

if TYPE_CHECKING:
    from egressd.platform.files import ReadBytes, Snapshot
    from egressd.policy.secrets import SecretSpec

_PRESET_NAME = re.compile(r"[a-z0-9][a-z0-9_-]*")


@dataclass(frozen=True)
class Overrides:
    """Command-line additions, re-applied to every reload so an edit never drops them."""

    allow: tuple[str, ...] = ()
    deny: tuple[str, ...] = ()
    mode: str | None = None
    nameservers: tuple[str, ...] = ()
    profile: str | None = None
    # more --policy files or presets, merged with the first (deny wins; docs/providers.md),
    # read again at every reload so an edit of any of them is never half applied
    policies: tuple[str, ...] = ()
    secrets: tuple[SecretSpec, ...] = ()  # exec --secret ...: where values come from, never values
    upstream_proxy: str | None = None  # --upstream-proxy URL: the parent proxy (its url only)

    def apply(self, policy: Policy, read: ReadBytes = Path.read_bytes) -> Policy:
        """The overrides on `policy`; `read` reads the merged files (a watcher's snapshot)."""
        if self.policies:
            from egressd.policy.merge import merge_policies

            more = [load_policy(resolve_policy_path(p), os.environ, read) for p in self.policies]
            policy = merge_policies([policy, *more])
        policy = policy.with_overrides(
            allow=self.allow,
            deny=self.deny,
            mode=self.mode,  # type: ignore[arg-type]  # the CLI's click.Choice checked it
            nameservers=self.nameservers,
            upstream_proxy=self.upstream_proxy,
            secrets=self.secrets,
        )
        if self.profile is not None and self.profile not in policy.profiles:
            known = ", ".join(sorted(policy.profiles)) or "none defined"
            raise PolicyError(policy.source, "--profile", self.profile, f"no such profile (known: {known})")
        return policy


def resolve_policy_path(value: str) -> Path:
    """--policy takes a file, or the name of a built-in preset (`npm`) when no such file exists."""
    path = Path(value)
    if path.exists() or not _PRESET_NAME.fullmatch(value):
        return path
    return builtin_policy_path(value)


def policy_file_shown(value: str | None) -> str | None:
    """The policy file a hint may tell a person to edit: the first --policy when it is a file
    (absolute), None for a built-in preset or no --policy (an edit there is no one's to make)."""
    if value is None or resolve_policy_path(value) != Path(value):
        return None
    return os.path.abspath(value)


def file_policy(path: Path, overrides: Overrides, files: Snapshot) -> Policy:
    """The policy file with the command line's overrides, every file read once through `files`
    (a file watcher's snapshot: the bytes it checked are the bytes parsed)."""
    return overrides.apply(load_policy(path, os.environ, files.read), files.read)


def base_policy(policy_file: str | None) -> Policy:
    """The file's policy, or the built-in default; EGRESSD_MODE applies to both."""
    if policy_file is not None:
        return load_policy(resolve_policy_path(policy_file), env=os.environ)
    # policies/default.yaml, built without reading it (a unit test checks they agree):
    # a run on the default policy never loads PyYAML
    return apply_env_mode(default_policy(), os.environ)


def host_loopback(policy: Policy, ports: Sequence[int] = ()) -> Policy:
    """The host's own services — on its loopback and on its own interface addresses (a LAN
    address, a Docker bridge's, a container's own IP) — reachable only on the ports the policy
    names in `loopback.ports` and `ports`, never all of them (none when none are named).

    For clients that are not the host's own processes: a gateway's (other machines) and a
    sandboxed child (its own network). A service listening on 0.0.0.0 answers on every interface
    address, so those count as loopback. Computed at each load, so the addresses are current.
    """
    from dataclasses import replace

    from egressd.platform.interfaces import local_addresses

    own = frozenset(ip for ip in local_addresses() if not ip.is_loopback)
    named = tuple(dict.fromkeys((*policy.loopback.ports, *ports)))
    loopback = replace(
        policy.loopback, ports=named, named_ports_only=True, addresses=policy.loopback.addresses | own
    )
    return replace(policy, loopback=loopback)
