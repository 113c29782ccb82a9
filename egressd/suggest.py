"""`egressd policy suggest`: a minimal allowlist drafted from audit logs.

Why: `mode: learn` (and the refusals of enforce and ask) leave in the audit every host a child
needed that the policy did not allow. This turns those records into a policy a person can read,
trim and use: one allow rule per host and port, with comments saying how often, when and (when
the audit names it) which command. It never widens a rule past what the records show except by
the folding rule below, and it never folds across a public suffix.

Folding rule: names are grouped by their registrable domain (the Public Suffix List entry plus one
label: `example.com`, `a.github.io`, `b.c.kobe.jp`), read from the list bundled in
`publicsuffixlist` (never fetched at run time). Two or more names strictly below a common parent P
become the one rule P (which matches P and every subdomain) only when P is itself strictly below
the registrable domain: `x.api.example.com` + `y.api.example.com` -> `api.example.com`, but
`a.example.com` + `b.example.com` stay two rules and `a.github.io` + `b.github.io` (two registrable
domains) are never joined. A name a suggested rule already matches is dropped. IP literals are
never folded.
"""

from __future__ import annotations

import json
from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from egressd.policy import Client, Policy, TargetError, decide, make_target
from egressd.policy.hosts import canonical_host, join_host_port

__all__ = ["LEARNABLE", "Seen", "SuggestError", "fold", "read_audits", "render", "suggest"]

# Reasons a record is taken to mean "this was needed and the policy did not allow it". A refusal a
# person gave (ask_refused, ask_denied) is not: a draft must not undo an explicit no.
LEARNABLE = frozenset({"learned", "not_allowlisted", "no_approver", "ask"})
_ASK_SAID_NO = frozenset({"ask_refused", "ask_denied"})


class SuggestError(Exception):
    """Input that cannot be read as an audit log; the message names the file and line."""


def learnable(reason: object) -> bool:
    """Is a decision with this reason something to suggest allowing?"""
    if not isinstance(reason, str):
        return False
    return reason in LEARNABLE or (reason.startswith("ask_") and reason not in _ASK_SAID_NO)


@dataclass
class Seen:
    """What the audit shows of one host: how often, on which ports, when, from which commands."""

    host: str
    ip: bool
    count: int = 0
    ports: Counter[int] = field(default_factory=Counter)
    first: str = ""
    last: str = ""
    reasons: Counter[str] = field(default_factory=Counter)
    commands: set[str] = field(default_factory=set)
    folded: list[str] = field(default_factory=list)  # the names a folded rule stands for

    def add(self, port: int, time: str, reason: str, commands: Iterable[str]) -> None:
        self.count += 1
        self.ports[port] += 1
        self.reasons[reason] += 1
        if time and (not self.first or time < self.first):
            self.first = time
        if time and time > self.last:
            self.last = time
        self.commands.update(commands)

    def merge(self, other: Seen) -> None:
        self.count += other.count
        self.ports.update(other.ports)
        self.reasons.update(other.reasons)
        self.first = min(t for t in (self.first, other.first) if t) if (self.first or other.first) else ""
        self.last = max(self.last, other.last)
        self.commands |= other.commands
        self.folded.extend(other.folded or [other.host])


@dataclass
class Audit:
    """The records of the audit files that matter here."""

    records: list[dict[str, Any]] = field(default_factory=list)
    commands: dict[str, set[str]] = field(default_factory=lambda: defaultdict(set))  # client -> commands
    files: list[str] = field(default_factory=list)


def read_audits(paths: Sequence[str]) -> Audit:
    """Every record of every file; a missing file, a line that is not a JSON object or an audit
    with no record at all is an error (nothing is suggested from half an input)."""
    audit = Audit()
    for name in paths:
        try:
            text = Path(name).read_text(encoding="utf-8", errors="surrogateescape")
        except FileNotFoundError:
            raise SuggestError(f"{name}: no such file") from None
        except (IsADirectoryError, PermissionError, OSError) as exc:
            raise SuggestError(f"{name}: cannot read: {exc.strerror or exc}") from None
        found = 0
        for number, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise SuggestError(f"{name}:{number}: not a JSON audit record ({exc.msg})") from None
            if not isinstance(record, dict):
                raise SuggestError(f"{name}:{number}: not a JSON audit record (a {type(record).__name__})")
            found += 1
            if record.get("event") == "child" and isinstance(record.get("program"), str):
                audit.commands[str(record.get("client"))].add(record["program"])
            elif record.get("event") == "decision":
                audit.records.append(record)
        if not found:
            raise SuggestError(f"{name}: empty audit (no records)")
        audit.files.append(name)
    return audit


def _target(record: dict[str, Any]) -> tuple[str, int, bool] | None:
    """(canonical host, port, is an IP literal) of a record, or None when it names no target."""
    host, port = record.get("host"), record.get("port")
    if not isinstance(host, str) or not isinstance(port, int) or isinstance(port, bool):
        return None
    try:
        canonical = canonical_host(host)
    except (TargetError, ValueError):
        return None
    return canonical.text, port, canonical.ip is not None


def collect(audit: Audit, base: Policy | None = None) -> dict[str, Seen]:
    """Hosts with learnable records (not those BASE already allows), one Seen per host.

    A tunnel allowed by mode: learn has a decision record and a connection record with the same
    connection id: it counts once."""
    decided = {
        (r.get("conn"), r.get("host"), r.get("port"))
        for r in audit.records
        if r.get("stage") != "connection" and r.get("conn") is not None
    }
    all_commands = set().union(*audit.commands.values()) if audit.commands else set()
    seen: dict[str, Seen] = {}
    allowed_by_base: dict[tuple[str, int], bool] = {}
    for record in audit.records:
        if not learnable(record.get("reason")):
            continue
        key = (record.get("conn"), record.get("host"), record.get("port"))
        if record.get("stage") == "connection" and key in decided:
            continue
        target = _target(record)
        if target is None:
            continue
        host, port, is_ip = target
        if base is not None:
            known = allowed_by_base.get((host, port))
            if known is None:
                known = allowed_by_base[(host, port)] = _allows(base, host, port, record)
            if known:
                continue
        client = record.get("client")
        commands = audit.commands.get(str(client)) or (all_commands if len(all_commands) == 1 else ())
        entry = seen.setdefault(host, Seen(host, is_ip))
        entry.add(port, str(record.get("time") or ""), str(record["reason"]), commands)
    return seen


def _allows(base: Policy, host: str, port: int, record: dict[str, Any]) -> bool:
    """Would BASE, enforced, allow this target (its mode aside)?"""
    scheme = record.get("scheme") if isinstance(record.get("scheme"), str) else None
    try:
        target = make_target(host, port, scheme=scheme or "connect")
    except ValueError:
        return False
    return decide(target, Client(), base).allowed


def _labels(name: str) -> list[str]:
    return name.split(".")


def _registrable(name: str) -> str | None:
    """The registrable domain (public suffix + one label), None for a public suffix itself."""
    from publicsuffixlist import PublicSuffixList

    global _PSL
    if _PSL is None:
        _PSL = PublicSuffixList()  # the list bundled in the package: no network, ever
    result = _PSL.privatesuffix(name)
    return result if isinstance(result, str) else None


_PSL: Any = None


def _below(name: str, parent: str) -> bool:
    return name.endswith("." + parent)


def fold(seen: dict[str, Seen]) -> list[Seen]:
    """The folding rule of the module docstring; returns one Seen per rule, sorted by rule."""
    names = {h: s for h, s in seen.items() if not s.ip}
    rules: list[Seen] = [s for s in seen.values() if s.ip]
    by_domain: dict[str | None, list[str]] = defaultdict(list)
    for host in names:
        by_domain[_registrable(host)].append(host)
    for domain, hosts in by_domain.items():
        current = {h: names[h] for h in hosts}
        if domain is not None:
            _fold_domain(current, domain)
        _drop_covered(current)
        rules.extend(current.values())
    return sorted(rules, key=lambda s: (s.ip, list(reversed(_labels(s.host))) if not s.ip else [s.host]))


def _fold_domain(current: dict[str, Seen], domain: str) -> None:
    """Fold, deepest parent first, names strictly below a parent strictly below `domain`."""
    depth = len(_labels(domain))
    parents: set[str] = set()
    for host in current:
        labels = _labels(host)
        for cut in range(1, len(labels) - depth):
            parents.add(".".join(labels[cut:]))
    for parent in sorted(parents, key=lambda p: -len(_labels(p))):
        under = [h for h in current if _below(h, parent)]
        if len(under) < 2:
            continue
        folded = current.pop(parent, None) or Seen(parent, False)
        if folded.count:
            folded.folded.append(parent)
        for host in under:
            folded.merge(current.pop(host))
        current[parent] = folded


def _drop_covered(current: dict[str, Seen]) -> None:
    """A name rule matches its subdomains: a name below another suggested one merges into it."""
    for host in sorted(current, key=lambda h: len(_labels(h))):
        if host not in current:
            continue
        for other in [h for h in current if _below(h, host)]:
            current[host].merge(current.pop(other))


def _rule_texts(entry: Seen) -> list[str]:
    """One rule per port seen (a rule without a port would allow every port)."""
    return [join_host_port(entry.host, port) for port in sorted(entry.ports)]


def _comment(text: str) -> str:
    """One comment line's worth of text: control characters escaped, no line breaks."""
    return "".join(ch if ch.isprintable() else repr(ch)[1:-1] for ch in text)


def _describe(entry: Seen) -> list[str]:
    ports = ", ".join(f"{port} ({count}x)" for port, count in sorted(entry.ports.items()))
    reasons = ", ".join(f"{reason} {count}" for reason, count in sorted(entry.reasons.items()))
    lines = [f"{entry.host}: {entry.count} seen ({reasons}); ports {ports}"]
    if entry.first:
        lines.append(f"first {entry.first}, last {entry.last}")
    if entry.folded:
        lines.append("folded: " + ", ".join(sorted(set(entry.folded))))
    for command in sorted(entry.commands):
        lines.append(f"command: {command}")
    return [_comment(line) for line in lines]


def render(rules: Sequence[Seen], files: Sequence[str], base: str | None) -> str:
    """The suggested policy as YAML with comments (rules double-quoted: valid YAML for any host)."""
    out = [
        f"# egressd policy suggest: {len(rules)} host(s) from {', '.join(_comment(f) for f in files)}",
        "# allow rules that would have admitted what was learned (mode: learn) or refused as not",
        "# allowlisted; read them before use. Folding: see `egressd policy suggest --help`.",
    ]
    if base is not None:
        out.append(f"# only what {_comment(base)} does not already allow: add these to its allow list")
    out += ["version: 1", "mode: enforce"]
    if not rules:
        out.append("allow: []  # nothing to add")
        return "\n".join(out) + "\n"
    out.append("allow:")
    for entry in rules:
        out += [f"  # {line}" for line in _describe(entry)]
        out += [f"  - {json.dumps(rule, ensure_ascii=True)}" for rule in _rule_texts(entry)]
    return "\n".join(out) + "\n"


def suggest(paths: Sequence[str], base: Policy | None = None, base_name: str | None = None) -> str:
    """Read the audits, collect, fold and render: the text `egressd policy suggest` prints."""
    audit = read_audits(paths)
    if base is not None:
        base = base.with_overrides(mode="enforce")
    return render(fold(collect(audit, base)), audit.files, base_name)
