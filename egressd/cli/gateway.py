"""`egressd gateway token add|list|remove`: the clients of `egressd run --gateway`.

`add` prints the new token on stdout and nothing else (so `> name.token` or `$(...)` take exactly
it); the file keeps only its hash. A running gateway picks up every change without a restart.
"""

from __future__ import annotations

from pathlib import Path

import click

from egressd.admission.tokens import TokenFileError
from egressd.cli.options import CONTEXT, fail, say
from egressd.session.token_file import add_clients, default_tokens_path, list_clients, remove_client

_TOKENS = click.option(
    "--tokens",
    "tokens_file",
    metavar="FILE",
    help="The token file (default: $EGRESSD_HOME/gateway/tokens.json, as `run --gateway`).",
)


def _path(tokens_file: str | None) -> Path:
    return Path(tokens_file) if tokens_file else default_tokens_path()


_EXAMPLE = """\b
Example:
  egressd gateway token add agent1 --profile ci --policy policy.yaml > agent1.token
  egressd gateway token list
  egressd gateway token remove agent1"""


@click.group(
    "gateway",
    context_settings=CONTEXT,
    short_help="Manage the clients of `egressd run --gateway`.",
    epilog=_EXAMPLE,
)
def gateway_group() -> None:
    """The clients of `egressd run --gateway` (docs/gateway.md)."""


@gateway_group.group("token", context_settings=CONTEXT, epilog=_EXAMPLE)
def token_group() -> None:
    """Per-client tokens: the proxy URL of client NAME is http://NAME:TOKEN@GATEWAY:PORT."""


@token_group.command(
    "add",
    epilog="""\b
Example:
  egressd gateway token add agent1 --profile ci --policy policy.yaml --from 172.28.0.0/16 > agent1.token
  HTTPS_PROXY=http://agent1:$(cat agent1.token)@gateway:3128 pip install requests""",
)
@click.argument("name")
@click.option(
    "--profile",
    metavar="P",
    help="Apply policy profile P (`profiles.P`) to this client; P must be in the --policy files.",
)
@click.option(
    "--policy",
    "policy_files",
    multiple=True,
    metavar="FILE",
    help="The gateway's policy file or preset (repeatable, as `run --policy`): --profile is checked "
    "against it (default: the built-in policy).",
)
@click.option(
    "--from",
    "sources",
    multiple=True,
    metavar="CIDR",
    help="Accept this client from this network only (repeatable).",
)
@_TOKENS
def token_add(
    name: str,
    profile: str | None,
    policy_files: tuple[str, ...],
    sources: tuple[str, ...],
    tokens_file: str | None,
) -> None:
    """Add client NAME (replacing its token if it exists); print the token once on stdout."""
    if profile is not None:
        _check_profile(profile, policy_files)
    path = _path(tokens_file)
    try:
        token = add_clients(path, [name], profile=profile, sources=sources)[name]
    except (TokenFileError, OSError) as exc:
        fail(str(exc))
    click.echo(token)
    say(f"client {name} added to {path} (the token above is not stored; keep it)")


def _check_profile(profile: str, policy_files: tuple[str, ...]) -> None:
    """A profile the gateway's policy does not define would refuse the client everything, later
    and silently: refuse it now, naming what is defined."""
    from egressd.policy import PolicyError
    from egressd.session import base_policy

    defined: set[str] = set()
    try:
        for policy_file in policy_files or (None,):
            defined |= set(base_policy(policy_file).profiles)
    except PolicyError as exc:
        fail(str(exc))
    if profile not in defined:
        where = ", ".join(policy_files) or "the built-in policy (no --policy given)"
        known = ", ".join(sorted(defined)) or "none"
        fail(
            f"profile {profile!r} is not defined in {where} (profiles: {known}); add it under "
            "`profiles:` there, or name the gateway's policy with --policy FILE"
        )


@token_group.command("list", epilog=_EXAMPLE)
@_TOKENS
def token_list(tokens_file: str | None) -> None:
    """The clients: name, profile, source networks, when added (never a token)."""
    try:
        entries = list_clients(_path(tokens_file))
    except (TokenFileError, OSError) as exc:
        fail(str(exc))
    import time

    for entry in entries:
        created = time.strftime("%Y-%m-%d %H:%M", time.localtime(entry.created)) if entry.created else "-"
        sources = ",".join(str(net) for net in entry.sources) or "any"
        click.echo(f"{entry.name}\tprofile={entry.profile or '-'}\tfrom={sources}\tadded={created}")


@token_group.command("remove", epilog=_EXAMPLE)
@click.argument("name")
@_TOKENS
def token_remove(name: str, tokens_file: str | None) -> None:
    """Remove client NAME: a running gateway refuses its new connections and requests at once."""
    path = _path(tokens_file)
    try:
        removed = remove_client(path, name)
    except (TokenFileError, OSError) as exc:
        fail(str(exc))
    if not removed:
        fail(f"no client {name!r} in {path}", code=1)
    say(f"client {name} removed from {path}")
