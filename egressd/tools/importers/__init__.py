"""``egressd policy import``: another tool's allowlist as an egressd policy, never wider.

Pure: the file's text in, the policy (as data, checked to load) and the findings out. Formats:
- ``allowlist-json``: ``{"allowed_hosts": ["api.example.com", "*.cdn.example", "host:443"]}``;
- ``srt``: sandbox-runtime's settings (``network.allowedDomains``, ``deniedDomains``,
  ``allowLocalBinding``, ``allowUnixSockets``; ``filesystem`` is the sandbox's business);
- ``smokescreen``: a Smokescreen ACL (v1): one role (``services[].name`` or ``default``) with the
  global allow and deny lists.
The findings use the export's words (tools/export/report.py): what was narrowed, dropped or has no
counterpart, so the import is read before it is used.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import yaml

from egressd.policy import PolicyError, parse_policy, strict_yaml
from egressd.policy.schema import Reader
from egressd.tools.export.report import Finding
from egressd.tools.importers.names import Pattern, parse_pattern, translate

__all__ = ["FORMATS", "ImportError_", "Imported", "import_policy"]


class ImportError_(ValueError):  # noqa: N801 - not the builtin ImportError
    """The input cannot be read as that format; nothing is printed."""


@dataclass
class Imported:
    """The policy as data (loadable) and what it could not say exactly."""

    data: dict[str, Any]
    findings: list[Finding] = field(default_factory=list)
    comment: str = ""

    def text(self) -> str:
        head = "".join(f"# {line}\n" for line in self.comment.splitlines())
        return head + yaml.safe_dump(self.data, sort_keys=False, allow_unicode=True)


# the input's shape is checked by the policy's own schema reader; import_policy turns its errors
# into ImportError_ without the file name (the command line puts it first)
_READ = Reader("")


def _patterns(items: object, key: str, findings: list[Finding], *, ports: bool = False) -> list[Pattern]:
    found = [parse_pattern(item, where, findings, ports=ports) for where, item in _READ.items(items, key)]
    return [p for p in found if p is not None]


def _unknown(data: Mapping[str, Any], known: tuple[str, ...], where: str, findings: list[Finding]) -> None:
    for key in data:
        if key not in known:
            findings.append(
                Finding(f"{where}{key}", None, "unsupported", "not read: egressd has no such setting")
            )


def _allowlist_json(text: str) -> Imported:
    data = _json(text)
    if not isinstance(data, Mapping) or "allowed_hosts" not in data:
        raise ImportError_('expected a JSON object with "allowed_hosts": [...]')
    findings: list[Finding] = []
    _unknown(data, ("allowed_hosts",), "", findings)
    allowed = _patterns(data["allowed_hosts"], "allowed_hosts", findings, ports=True)
    rules = translate(allowed, [])
    return Imported(
        {"version": 1, "mode": "enforce", "allow": rules.allow, "deny": rules.deny}, findings + rules.findings
    )


_LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")


def _srt(text: str) -> Imported:
    data = _json(text)
    if not isinstance(data, Mapping):
        raise ImportError_("expected a JSON object (sandbox-runtime settings)")
    findings: list[Finding] = []
    _unknown(data, ("network", "filesystem"), "", findings)
    network = _READ.mapping(data.get("network"), "network", None)
    known = (
        "allowedDomains",
        "deniedDomains",
        "allowLocalBinding",
        "allowUnixSockets",
        "allowAllUnixSockets",
    )
    _unknown(network, known, "network.", findings)
    allowed = _patterns(network.get("allowedDomains"), "network.allowedDomains", findings)
    denied = _patterns(network.get("deniedDomains"), "network.deniedDomains", findings)
    loopback = any(p.host in _LOOPBACK_NAMES for p in allowed)
    allowed = [p for p in allowed if p.host not in _LOOPBACK_NAMES]
    rules = translate(allowed, denied)
    findings += rules.findings
    if not loopback:
        findings.append(
            Finding(
                "loopback.allow",
                "false",
                "narrowed",
                "localhost is not in allowedDomains: egressd's loopback allowance is turned off",
            )
        )
    if network.get("allowLocalBinding"):
        findings.append(
            Finding(
                "network.allowLocalBinding",
                "true",
                "unsupported",
                "binding is not egress: egressd exec leaves it alone; egressd sandbox lets the child "
                "listen on its own loopback",
            )
        )
    for key in ("allowUnixSockets", "allowAllUnixSockets"):
        if network.get(key):
            findings.append(
                Finding(
                    f"network.{key}",
                    json.dumps(network[key]),
                    "unsupported",
                    "Unix sockets are not network egress: under egressd sandbox, agent and docker "
                    "sockets are hidden unless --show names them",
                )
            )
    if data.get("filesystem"):
        findings.append(
            Finding(
                "filesystem",
                None,
                "unsupported",
                "file access is the sandbox's: egressd sandbox --ro/--rw/--hide (docs/sandbox.md)",
            )
        )
    policy = {
        "version": 1,
        "mode": "enforce",
        "allow": rules.allow,
        "deny": rules.deny,
        "loopback": {"allow": loopback, "ports": []},
    }
    return Imported(policy, findings)


_ACTIONS = {"enforce": "enforce", "report": "learn", "open": "allow"}


def _role(data: Mapping[str, Any], role: str | None) -> tuple[str, Mapping[str, Any]]:
    services = _READ.list(data.get("services") or [], "services")
    named = {s.get("name"): s for s in services if isinstance(s, Mapping)}
    default = data.get("default")
    if role is None:
        choices = list(named) + (["default"] if default is not None else [])
        if len(choices) != 1:
            raise ImportError_(
                f"the ACL has several roles ({', '.join(map(str, choices))}): choose one with --role"
            )
        role = str(choices[0])
    if role == "default" and default is not None:
        return "default", _READ.mapping(default, "default", None)
    if role not in named:
        raise ImportError_(f"no role {role!r} (roles: {', '.join(map(str, named)) or 'none'})")
    return role, named[role]


def _smokescreen(text: str, role: str | None) -> Imported:
    try:
        data = strict_yaml.load(text)  # smokescreen's yaml.v2 refuses duplicate keys too
    except strict_yaml.YAMLError as exc:
        raise ImportError_(f"invalid YAML: {exc}") from None
    if not isinstance(data, Mapping):
        raise ImportError_("expected a Smokescreen ACL (a YAML mapping with version: v1)")
    if data.get("version") != "v1":
        raise ImportError_(f"unsupported ACL version {data.get('version')!r} (expected v1)")
    findings: list[Finding] = []
    _unknown(data, ("version", "services", "default", "global_allow_list", "global_deny_list"), "", findings)
    name, rule = _role(data, role)
    where = "default" if name == "default" else f"services[{name}]"
    _unknown(rule, ("name", "project", "action", "allowed_domains"), f"{where}.", findings)
    action = rule.get("action", "enforce")
    if action not in _ACTIONS:
        raise ImportError_(f"{where}.action: {action!r} (expected enforce, report or open)")
    own = _patterns(rule.get("allowed_domains"), f"{where}.allowed_domains", findings)
    shared = _patterns(data.get("global_allow_list"), "global_allow_list", findings)
    denied = _patterns(data.get("global_deny_list"), "global_deny_list", findings)
    rules = translate(own + shared, denied)
    findings += rules.findings
    for item in own:
        if any(
            d.host == item.host or (d.kind == "below" and item.host.endswith("." + d.host)) for d in denied
        ):
            findings.append(
                Finding(
                    f"{where}.allowed_domains",
                    item.text,
                    "narrowed",
                    "smokescreen lets a role's own domains override global_deny_list; in egressd deny wins",
                )
            )
    if action != "enforce":
        findings.append(
            Finding(
                f"{where}.action",
                action,
                "unsupported",
                f"imported as mode: {_ACTIONS[action]}: every host is admitted "
                + ("and recorded as learned" if action == "report" else "")
                + " (egressd's address guards still hold); set mode: enforce to enforce the list",
            )
        )
    project = rule.get("project")
    comment = f"smokescreen role {name}" + (f" (project {project})" if project else "")
    policy = {"version": 1, "mode": _ACTIONS[action], "allow": rules.allow, "deny": rules.deny}
    return Imported(policy, findings, comment)


def _json(text: str) -> object:
    try:
        return json.loads(text)
    except ValueError as exc:
        raise ImportError_(f"invalid JSON: {exc}") from None


FORMATS: dict[str, Callable[[str, str | None], Imported]] = {
    "allowlist-json": lambda text, _role: _allowlist_json(text),
    "srt": lambda text, _role: _srt(text),
    "smokescreen": _smokescreen,
}


def import_policy(text: str, fmt: str, *, source: str, role: str | None = None) -> Imported:
    """Read `text` as `fmt`; the policy is checked to load with egressd's own loader."""
    if role is not None and fmt != "smokescreen":
        raise ImportError_("--role is for smokescreen ACLs only")
    try:
        result = FORMATS[fmt](text, role)
    except PolicyError as exc:
        raise ImportError_(exc.located()) from None
    result.comment = f"egressd policy import --from {fmt} {source}" + (
        f"\n{result.comment}" if result.comment else ""
    )
    try:
        parse_policy(result.data, source)
    except PolicyError as exc:  # a bug here, never a wider policy: refuse to print it
        raise ImportError_(f"the imported policy does not load: {exc}") from exc
    return result
