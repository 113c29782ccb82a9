"""`egressd policy`: validate, show and locate policies."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

import click

from egressd.policy import (
    PolicyError,
    builtin_policy_path,
    load_policy,
)
from egressd.policy.dump import policy_to_data
from egressd.policy.model import MODES

if TYPE_CHECKING:
    pass
from egressd.cli.options import cli_overrides, effective_policy, fail, first_policy


@click.group(
    "policy",
    epilog="""\b
Example:
  egressd policy validate policy.yaml policies/*.yaml
  egressd policy show --allow api.github.com
  egressd policy path npm
  egressd policy export --to squid --policy policy.yaml""",
)
def policy_group() -> None:
    """Validate, show and locate policies."""


@policy_group.command(
    "validate",
    epilog="""\b
Example:
  egressd policy validate policy.yaml
  egressd policy validate policies/*.yaml""",
)
@click.argument("files", nargs=-1, required=True, metavar="FILE...")
def policy_validate(files: tuple[str, ...]) -> None:
    """Check policy files: one line per file; exit 1 if any is bad."""
    bad = 0
    for name in files:
        try:
            policy = load_policy(name)
        except PolicyError as exc:
            bad += 1
            click.echo(" ".join(str(exc).split()))
            continue
        click.echo(
            f"{name}: ok (mode {policy.mode}, {len(policy.allow.rules)} allow, "
            f"{len(policy.deny.rules)} deny, {len(policy.profiles)} profiles)"
        )
    sys.exit(1 if bad else 0)


@policy_group.command(
    "show",
    epilog="""\b
Example:
  egressd policy show
  egressd policy show policy.yaml --allow example.com --mode ask""",
)
@click.argument("files", nargs=-1, metavar="[FILE|PRESET]...")
@click.option("--allow", multiple=True, metavar="RULE", help="Add an allow rule (repeatable).")
@click.option("--deny", multiple=True, metavar="RULE", help="Add a deny rule (repeatable).")
@click.option("--mode", type=click.Choice(MODES), help="Override the mode.")
@click.option("--nameserver", "nameservers", multiple=True, metavar="IP[:PORT]", help="DNS server override.")
def policy_show(
    files: tuple[str, ...],
    allow: tuple[str, ...],
    deny: tuple[str, ...],
    mode: str | None,
    nameservers: tuple[str, ...],
) -> None:
    """Print the effective policy (the FILEs merged, or the built-in default, plus overrides) as YAML."""
    import yaml

    policy = effective_policy(first_policy(files), cli_overrides(allow, deny, mode, nameservers, None, files))
    click.echo(f"# effective policy from {policy.source}")
    click.echo(yaml.safe_dump(policy_to_data(policy), sort_keys=False, allow_unicode=True), nl=False)


@policy_group.command(
    "path",
    epilog="""\b
Example:
  egressd policy path default
  cp "$(egressd policy path npm)" my-policy.yaml""",
)
@click.argument("name")
def policy_path(name: str) -> None:
    """Print the path of the built-in preset NAME."""
    try:
        click.echo(str(builtin_policy_path(name)))
    except PolicyError as exc:
        fail(str(exc))


EXPORT_TARGETS = ("squid", "smokescreen", "cilium", "istio", "envoy")


@policy_group.command(
    "export",
    epilog="""\b
Example:
  egressd policy export --to squid --policy policy.yaml > /etc/squid/conf.d/egressd.conf
  egressd policy export --to cilium --policy npm --report-json report.json""",
)
@click.option("--to", "target", type=click.Choice(EXPORT_TARGETS), required=True, help="The engine.")
@click.option(
    "--policy",
    "policy_file",
    multiple=True,
    metavar="FILE",
    help="Policy file or preset (default: built-in); repeatable, merged (deny wins).",
)
@click.option("--report-json", metavar="FILE", help="Also write the report as JSON to FILE.")
def policy_export(target: str, policy_file: tuple[str, ...], report_json: str | None) -> None:
    """Print the policy as TARGET's configuration; on stderr, every rule it cannot say exactly.

    Faithful or narrower, never wider: such rules are dropped, narrowed or refused (exit 3)."""
    from egressd.tools.export import ExportRefused, export_policy

    policy = effective_policy(first_policy(policy_file), cli_overrides((), (), None, (), None, policy_file))
    try:
        result = export_policy(policy, target)
    except ExportRefused as exc:
        for finding in exc.findings:
            click.echo(f"egressd: export: {finding.line()}", err=True)
        fail(str(exc), 3)
    if report_json:
        with open(report_json, "w", encoding="utf-8") as out:
            out.write(result.report_json())
    for line in result.report_lines():
        click.echo(f"egressd: export: {line}", err=True)
    click.echo(result.text, nl=False)


@policy_group.command(
    "suggest",
    epilog="""\b
Which records count: decisions with reason learned (mode: learn), not_allowlisted, no_approver
and ask_* (except ask_refused/ask_denied: a person said no). One rule per host and port; a host
seen on two ports gets two rules.

\b
Folding: names are grouped by registrable domain (public suffix + one label, from the Public
Suffix List bundled with the publicsuffixlist package; nothing is downloaded). Two or more names
strictly below a parent P fold into the rule P only when P is strictly below the registrable
domain: x.api.example.com + y.api.example.com -> api.example.com; a.example.com + b.example.com
stay two rules; a.github.io + b.github.io are never joined (github.io is a public suffix).
A name below another suggested name is merged into it (a rule matches its subdomains).

\b
Private addresses: a rule admitting a non-global address (10.0.0.1, 172.17.0.1:2375, fd00::1)
is suggested only where the learning run's policy (recorded in the audit) or BASE had
private.allow; otherwise it is left out, with a comment. private.allow (when a learned name
reached a private address under it) and the run's nameservers are carried over, with comments.

\b
Example:
  egressd exec --mode learn --audit audit.jsonl -- npm install
  egressd policy suggest audit.jsonl > learned.yaml
  egressd policy suggest audit.jsonl --policy policy.yaml   # only what policy.yaml lacks

\b
Exit status: 0 printed, 2 bad input (missing file, a line that is not JSON, an empty audit).""",
)
@click.argument("audits", nargs=-1, required=True, metavar="AUDIT.jsonl...")
@click.option("--policy", "base_file", metavar="BASE", help="Suggest only what BASE does not already allow.")
def policy_suggest(audits: tuple[str, ...], base_file: str | None) -> None:
    """Print a minimal policy (YAML with comments) that would have allowed what the audit learned."""
    from egressd.session import resolve_policy_path
    from egressd.tools.suggest import SuggestError, suggest

    base = None
    if base_file is not None:
        try:
            base = load_policy(resolve_policy_path(base_file))
        except PolicyError as exc:
            fail(" ".join(str(exc).split()))
    try:
        text = suggest(audits, base, base_file)
    except SuggestError as exc:
        fail(str(exc))
    click.echo(text, nl=False)


IMPORT_FORMATS = ("allowlist-json", "srt", "smokescreen")


@policy_group.command(
    "import",
    epilog="""\b
Example:
  egressd policy import --from srt ~/.srt-settings.json > agent.yaml
  egressd policy import --from smokescreen acl.yaml --role my-service > service.yaml
  egressd policy import --from allowlist-json network_allowlist.json > policy.yaml""",
)
@click.option("--from", "fmt", type=click.Choice(IMPORT_FORMATS), required=True, help="The input's format.")
@click.option("--role", metavar="NAME", help="smokescreen: the role (services[].name, or default).")
@click.argument("file", type=click.Path(dir_okay=False))
def policy_import(fmt: str, role: str | None, file: str) -> None:
    """Print FILE (another tool's allowlist) as an egressd policy; on stderr, what it could not say
    exactly. Never wider: what has no egressd counterpart is narrowed or left out."""
    from egressd.tools.importers import ImportError_, import_policy

    try:
        with open(file, encoding="utf-8") as handle:
            text = handle.read()
    except (OSError, UnicodeDecodeError) as exc:
        fail(f"{file}: {getattr(exc, 'strerror', None) or exc}")
    try:
        result = import_policy(text, fmt, source=file, role=role)
    except ImportError_ as exc:
        fail(f"{file}: {exc}")
    for finding in result.findings:
        click.echo(f"egressd: import: {finding.line()}", err=True)
    click.echo(result.text(), nl=False)
