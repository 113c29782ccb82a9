"""The `egressd` command line: thin click commands that parse, call the library and print.

One module per command; the options, messages and session they share are in options.py. Exit
codes: `exec` and `sandbox` exit like their child; egressd's own set-up failures exit 2.
"""

from __future__ import annotations

import importlib.metadata

import click

from egressd import __version__
from egressd.cli.acp import acp_command
from egressd.cli.answer import approve_command, deny_command
from egressd.cli.ca import ca_group
from egressd.cli.check import check_command
from egressd.cli.dashboard import dashboard_command
from egressd.cli.exec import exec_command
from egressd.cli.gateway import gateway_group
from egressd.cli.grant import grant_command
from egressd.cli.mcp import mcp_group
from egressd.cli.options import CONTEXT
from egressd.cli.pending import pending_command
from egressd.cli.policy import policy_group
from egressd.cli.provider import provider_group
from egressd.cli.ps import ps_command
from egressd.cli.run import run_command
from egressd.cli.sandbox import sandbox_command
from egressd.cli.ssh import remote_agent, ssh_command
from egressd.cli.watch import watch_command


def _mitmproxy_version() -> str:
    try:
        return importlib.metadata.version("mitmproxy")
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _print_version(ctx: click.Context, _param: click.Parameter, value: bool) -> None:
    """`--version`: the package metadata is read only when asked (it costs ~40 ms at start)."""
    if not value or ctx.resilient_parsing:
        return
    click.echo(f"egressd {__version__} (mitmproxy {_mitmproxy_version()})")
    ctx.exit()


@click.group(
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


for _command in (
    exec_command,
    run_command,
    check_command,
    sandbox_command,
    ssh_command,
    remote_agent,
    policy_group,
    provider_group,
    ca_group,
    acp_command,
    mcp_group,
    ps_command,
    pending_command,
    approve_command,
    deny_command,
    grant_command,
    watch_command,
    dashboard_command,
    gateway_group,
):
    cli.add_command(_command)


def main() -> None:
    """Console-script entry point (`egressd`, `python -m egressd`)."""
    cli.main(prog_name="egressd")
