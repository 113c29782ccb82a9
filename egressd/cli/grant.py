"""`egressd grant TARGET`: consent to one request or connection, never written anywhere."""

from __future__ import annotations

import click

from egressd.admission.grants import DEFAULT_TTL, MAX_TTL
from egressd.cli.instances import call, pid_option, select


@click.command(
    "grant",
    short_help="Admit one request or connection the policy refuses, within a TTL.",
    epilog="""\b
Example:
  egressd grant pypi.org                       # the next connection to pypi.org:443 or :80
  egressd grant api.example.com:8443 --ttl 30
  egressd grant http://mirror.test/pkg.tar.gz  # that path only""",
)
@pid_option
@click.argument("target", metavar="HOST[:PORT]|URL")
@click.option(
    "--once", is_flag=True, default=True, help="One request or connection: what every grant is (the default)."
)
@click.option(
    "--ttl",
    type=click.FloatRange(min=0, min_open=True, max=MAX_TTL),
    default=DEFAULT_TTL,
    show_default=True,
    metavar="SECONDS",
    help="The grant lapses unused after this long.",
)
def grant_command(pid: int | None, target: str, once: bool, ttl: float) -> None:
    """Admit exactly one request or connection to TARGET that the policy would refuse as not
    allowlisted (or ask about), within --ttl seconds. The grant is never written to the policy;
    the next identical request is decided normally. It never lifts a deny rule, an always-refused
    address or the private-address guard. HOST without a port means 443 or 80; a URL with a path
    admits that path only (for https that needs TLS inspection)."""
    grant = call(select(pid), "POST", "/v1/grants", {"target": target, "ttl": ttl, "once": True})
    ports = ",".join(str(p) for p in grant["ports"])
    scope = f" path {grant['path']}" if grant.get("path") else ""
    click.echo(f"{grant['id']}: once, {grant['host']} port {ports}{scope}, for {grant['expires_in']:g}s")
