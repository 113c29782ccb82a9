"""The `egressd` command line: thin click commands that parse, call the library and print.

One module per command; the options, messages and session they share are in options.py. Exit
codes: `exec` and `sandbox` exit like their child; egressd's own set-up failures exit 2.
"""

from __future__ import annotations

import importlib
from typing import Any

import click

from egressd import __version__
from egressd.cli.options import CONTEXT

# name -> (module, attribute): a command's module is imported only when that command runs (or help
# lists them all), so `egressd exec` does not load the sandbox, SSH, ACP and MCP code it never uses
COMMANDS: dict[str, tuple[str, str]] = {
    "exec": ("egressd.cli.exec", "exec_command"),
    "run": ("egressd.cli.run", "run_command"),
    "check": ("egressd.cli.check", "check_command"),
    "sandbox": ("egressd.cli.sandbox", "sandbox_command"),
    "ssh": ("egressd.cli.ssh", "ssh_command"),
    "remote-agent": ("egressd.cli.ssh", "remote_agent"),
    "policy": ("egressd.cli.policy", "policy_group"),
    "provider": ("egressd.cli.provider", "provider_group"),
    "ca": ("egressd.cli.ca", "ca_group"),
    "acp": ("egressd.cli.acp", "acp_command"),
    "mcp": ("egressd.cli.mcp", "mcp_group"),
    "ps": ("egressd.cli.ps", "ps_command"),
    "pending": ("egressd.cli.pending", "pending_command"),
    "approve": ("egressd.cli.answer", "approve_command"),
    "deny": ("egressd.cli.answer", "deny_command"),
    "grant": ("egressd.cli.grant", "grant_command"),
    "watch": ("egressd.cli.watch", "watch_command"),
    "dashboard": ("egressd.cli.dashboard", "dashboard_command"),
    "gateway": ("egressd.cli.gateway", "gateway_group"),
}


class LazyGroup(click.Group):
    """The top-level group: commands listed by name, each module imported on first use."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted({*COMMANDS, *super().list_commands(ctx)})

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name not in self.commands and cmd_name in COMMANDS:
            module, attribute = COMMANDS[cmd_name]
            command: Any = getattr(importlib.import_module(module), attribute)
            self.add_command(command, cmd_name)
        return super().get_command(ctx, cmd_name)


def _mitmproxy_version() -> str:
    import importlib.metadata

    try:
        return importlib.metadata.version("mitmproxy")
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _print_version(ctx: click.Context, _param: click.Parameter, value: bool) -> None:
    """`--version`: the package metadata is read only when asked (reading it slows every start)."""
    if not value or ctx.resilient_parsing:
        return
    click.echo(f"egressd {__version__} (mitmproxy {_mitmproxy_version()})")
    ctx.exit()


@click.group(
    cls=LazyGroup,
    context_settings=CONTEXT,
    epilog="""\b
Example:
  egressd exec --allow registry.npmjs.org -- npm install
  egressd check https://evil.test/
  egressd policy validate policy.yaml""",
)
@click.option(
    "--version",
    is_flag=True,
    expose_value=False,
    is_eager=True,
    callback=_print_version,
    help="Show the version and exit.",
)
def cli() -> None:
    """egressd: an egress-filtering forward proxy for child processes.

    Every connection the child makes through egressd is decided against one policy: the
    allowlist, the loopback allowance and the built-in allowances. Refusals say why.
    """


def main() -> None:
    """Console-script entry point (`egressd`, `python -m egressd`)."""
    cli.main(prog_name="egressd")
