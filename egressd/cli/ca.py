"""`egressd ca`: the CA egressd signs intercepted connections with."""

from __future__ import annotations

from typing import TYPE_CHECKING

import click

if TYPE_CHECKING:
    pass
from egressd.cli.options import fail, say


@click.group(
    "ca",
    short_help="egressd's certificate authority for TLS inspection.",
    epilog="""\b
Example:
  egressd ca path            # the CA certificate to trust (created on first need)
  egressd ca rotate          # a new CA key and certificate""",
)
def ca_group() -> None:
    """The CA egressd signs intercepted connections with; its key never leaves EGRESSD_HOME/ca."""


@ca_group.command("path", epilog='\b\nExample:\n  curl --cacert "$(egressd ca path)" ...')
def ca_path() -> None:
    """Print the path of the CA certificate (no key), creating the CA when there is none yet."""
    from egressd.inspect import ca

    try:
        click.echo(str(ca.ensure_ca(ca.config_dir())))
    except ca.CAError as exc:
        fail(str(exc))


@ca_group.command("rotate", epilog="\b\nExample:\n  egressd ca rotate && egressd ca path")
def ca_rotate() -> None:
    """Replace the CA; children started afterwards trust only the new certificate."""
    from egressd.inspect import ca

    try:
        path = ca.rotate_ca(ca.config_dir())
    except ca.CAError as exc:
        fail(str(exc))
    say(f"new CA certificate: {path}")
