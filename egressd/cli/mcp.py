"""`egressd mcp`: wrap an MCP client's stdio servers in egressd, unwrap them, run one."""

from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path
from typing import Any

import click

from egressd.admission.state import ProxyCredentials
from egressd.agents import mcp_config
from egressd.agents.stdio import StdioRelay
from egressd.agents.wiring import Network, mcp_relay
from egressd.cli.options import fail, say, secret_options, session_options
from egressd.cli.passthrough import passthrough_option
from egressd.cli.relayed import SANDBOX_FLAG, run_relayed, with_sandbox_options
from egressd.policy import PolicyError
from egressd.session import ProxySession, SessionOptions, base_policy, resolve_policy_path


@click.group(
    "mcp",
    epilog="""\b
Example:
  egressd mcp wrap ~/.config/Claude/claude_desktop_config.json --policy mcp.yaml
  egressd mcp unwrap ~/.config/Claude/claude_desktop_config.json
  egressd mcp run --profile fetch --policy mcp.yaml -- uvx mcp-server-fetch""",
)
def mcp_group() -> None:
    """MCP stdio servers under egressd: rewrite a client's config, or run one server."""


def egressd_command() -> tuple[str, ...]:
    """How an MCP client (which may have a short PATH) starts this egressd: absolute paths."""
    script = Path(sys.executable).parent / "egressd"
    if script.is_file() and os.access(script, os.X_OK):
        return (str(script),)
    return (sys.executable, "-m", "egressd")


def _load(config: str) -> tuple[Path, dict[str, Any], str, str]:
    path = Path(config)
    try:
        document, key, text = mcp_config.load(path)
    except mcp_config.ConfigError as exc:
        fail(str(exc))
    return path, document, key, text


@mcp_group.command(
    "wrap",
    short_help="Run each stdio server of an MCP client's config under egressd, one profile each.",
    epilog="""\b
Example:
  egressd mcp wrap ~/.config/Claude/claude_desktop_config.json --policy ~/.config/egressd/mcp.yaml
  egressd mcp wrap .vscode/mcp.json --policy mcp.yaml --sandbox --server fetch""",
)
@click.argument("config", metavar="CONFIG")
@click.option(
    "--policy", "policy_file", required=True, metavar="FILE", help="The policy file the servers run under."
)
@click.option("--sandbox", is_flag=True, help="Run each server in egressd's sandbox (`egressd sandbox`).")
@click.option("--server", "servers", multiple=True, metavar="NAME", help="Only this server (repeatable).")
def wrap_command(config: str, policy_file: str, sandbox: bool, servers: tuple[str, ...]) -> None:
    """Rewrite CONFIG so each stdio MCP server runs under egressd with its own profile.

    Server NAME runs with --profile NAME: `profiles.NAME` in the policy says what it may reach,
    so one server cannot use another's allowances. Wrapping twice is wrapping once. Only the
    wrapped entries' command and args change: comments (JSON with comments, as VS Code's mcp.json),
    spacing and every other byte stay. Remote (http/sse) servers are skipped, and wrap says so. The
    file before the change is kept as CONFIG.egressd-backup; the file is replaced atomically, and a
    file egressd cannot parse is left alone (exit 2).
    """
    path, _document, key, text = _load(config)
    try:
        policy = base_policy(policy_file)
    except PolicyError as exc:
        fail(str(exc))
    if not Path(policy_file).exists():
        fail(
            f"--policy {policy_file}: wrap needs a policy file (its profiles.<server> entries), not a preset"
        )
    options = mcp_config.WrapOptions(
        egressd_command(), str(resolve_policy_path(policy_file).resolve()), sandbox, servers
    )
    try:
        new_text, wrapped, skipped = mcp_config.wrap(text, key, options)
    except mcp_config.ConfigError as exc:
        fail(f"{path}: {exc}; the file was not changed")
    missing = [name for name in wrapped if mcp_config.profile_name(name) not in policy.profiles]
    if missing:
        snippet = "".join(f"\n  {name}:\n    allow: []   # the hosts {name} may reach" for name in missing)
        fail(
            f"{policy_file} has no profile for {', '.join(missing)}; a wrapped server runs only under its "
            f"own profile. Add to the policy:\nprofiles:{snippet}\n{path} was not changed"
        )
    changed = mcp_config.save(path, text, new_text, backup=True)
    if changed:
        kept = f"the file as it was is kept in {mcp_config.backup_path(path)}"
        say(f"{path}: wrapped {', '.join(wrapped)}; {kept}")
    elif wrapped:
        say(f"{path}: wrapped {', '.join(wrapped)} (already wrapped; unchanged)")
    else:
        say(f"{path}: no stdio server to wrap; unchanged")
    for name, why in skipped:
        say(f"{path}: skipped {name}: {why}")


@mcp_group.command(
    "unwrap",
    short_help="Restore a config `egressd mcp wrap` rewrote.",
    epilog="\b\nExample:\n  egressd mcp unwrap .mcp.json",
)
@click.argument("config", metavar="CONFIG")
@click.option("--server", "servers", multiple=True, metavar="NAME", help="Only this server (repeatable).")
def unwrap_command(config: str, servers: tuple[str, ...]) -> None:
    """Restore CONFIG's servers as they were before `egressd mcp wrap`, byte for byte (comments
    and everything else edited since are kept). The backup wrap left (CONFIG.egressd-backup) is
    removed when it holds exactly the restored file; otherwise unwrap says it is kept."""
    path, _document, key, text = _load(config)
    new_text, restored = mcp_config.unwrap(text, key, servers)
    changed = mcp_config.save(path, text, new_text, backup=False)
    done = f"{path}: unwrapped {', '.join(restored) or 'nothing'}" + ("" if changed else " (unchanged)")
    say(f"{done}; {mcp_config.settle_backup(path, new_text)}")


@with_sandbox_options
@mcp_group.command(
    "run",
    context_settings={"allow_interspersed_args": False},
    short_help="Run one MCP stdio server under egressd; failed tool calls say what it refused.",
    epilog="""\b
Example (what `egressd mcp wrap` writes into a client's config):
  egressd mcp run --profile fetch --policy mcp.yaml -- uvx mcp-server-fetch""",
)
@session_options
@secret_options
@SANDBOX_FLAG
@passthrough_option
@click.option(mcp_config.NO_ARGS_KEY, "no_args_key", is_flag=True, hidden=True)
@click.argument("command", nargs=-1, required=True, type=click.UNPROCESSED, metavar="-- SERVER [ARGS]...")
def run_command(
    options: SessionOptions, sandboxed: bool, no_args_key: bool, command: tuple[str, ...], **sandbox: Any
) -> None:
    """Run an MCP stdio server like `exec` (or `sandbox`), adding to each failed tool call what
    egressd refused meanwhile and why. Every other message passes byte for byte."""

    def relay(
        session: ProxySession, creds: ProxyCredentials, network: Network
    ) -> contextlib.AbstractContextManager[object]:
        return mcp_relay(session, StdioRelay("mcp", say))

    run_relayed(options, sandboxed, command, sandbox, relay)
