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

Private addresses: a rule never admits a non-global address (RFC 1918, CGNAT, ULA, documentation
and other special-purpose ranges) unless the policy of the learning run licensed it with
`private.allow` (its `policy`/`reload` audit records say so) or BASE does; otherwise the literal is
left out, with a comment saying why. The settings the learning run needed to reach what it reached
are carried over, each with a comment: `private.allow` when a learned name resolved to a private
address under it (split-horizon DNS, a VPN, a mirror), and the run's `resolver.nameservers`.
"""

from __future__ import annotations

import ipaddress
import json
from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from egressd.policy import AddressClass, Client, Policy, TargetError, decide, make_target
from egressd.policy.addresses import describe
from egressd.policy.dump import nameservers
from egressd.policy.hosts import canonical_host, join_host_port
from egressd.policy.reasons import Reason

__all__ = ["Seen", "SuggestError", "fold", "read_audits", "render", "suggest"]


class SuggestError(Exception):
    """Input that cannot be read as an audit log; the message names the file and line."""


def learnable(reason: object) -> bool:
    """Is a decision with this reason something to suggest allowing? ("this was needed and the
    policy did not allow it"; a refusal a person gave is not: a draft must not undo an explicit no)"""
    found = Reason.parse(reason)
    return found is not None and found.learnable


@dataclass(frozen=True)
class RunSettings:
    """The settings of the learning run's policy in force when a record was made (from its
    `policy` record at start and its `reload` records)."""

    source: str
    private_allow: bool
    nameservers: tuple[str, ...]

    @classmethod
    def of(cls, record: dict[str, Any]) -> RunSettings | None:
        private = record.get("private_allow")
        servers = record.get("nameservers")
        if not isinstance(private, bool) or not isinstance(servers, list):
            return None  # an audit written before egressd recorded them
        return cls(str(record.get("source") or "?"), private, tuple(str(s) for s in servers))

    @classmethod
    def of_base(cls, base: Policy) -> RunSettings:
        return cls(base.source, base.private.allow, tuple(nameservers(base)))


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
    # the non-global addresses it was reached at (a literal's own, or where a name connected)
    private: set[str] = field(default_factory=set)
    # the policy that licensed them (private.allow of the learning run, else of BASE)
    licensed_by: set[str] = field(default_factory=set)

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
        self.private |= other.private
        self.licensed_by |= other.licensed_by


@dataclass
class Audit:
    """The records of the audit files that matter here."""

    records: list[dict[str, Any]] = field(default_factory=list)
    # the learning run's settings in force at each record (None: the audit does not say)
    runs: list[RunSettings | None] = field(default_factory=list)
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
        run: RunSettings | None = None
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
            elif record.get("event") in ("policy", "reload"):
                run = RunSettings.of(record) or run
            elif record.get("event") == "decision":
                audit.records.append(record)
                audit.runs.append(run)
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


def _non_global(address: str) -> str | None:
    """Why an address is not a global one (describe()'s words), None when it is."""
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        return None
    klass, why = describe(ip)
    return None if klass is AddressClass.GLOBAL else why


def _connected_to(record: dict[str, Any]) -> str | None:
    """The address of a connection record's `connected` (`IP:PORT`, `[IPv6]:PORT`)."""
    connected = record.get("connected")
    if not isinstance(connected, str) or ":" not in connected:
        return None
    return connected.rpartition(":")[0].strip("[]")


def collect(audit: Audit, base: Policy | None = None) -> dict[str, Seen]:
    """Hosts with learnable records (not those BASE already allows), one Seen per host.

    A tunnel allowed by mode: learn has a decision record and a connection record with the same
    connection id: it counts once (its connection record still says where it connected)."""
    decided = {
        (r.get("conn"), r.get("host"), r.get("port"))
        for r in audit.records
        if r.get("stage") != "connection" and r.get("conn") is not None
    }
    all_commands = set().union(*audit.commands.values()) if audit.commands else set()
    seen: dict[str, Seen] = {}
    allowed_by_base: dict[tuple[str, int], bool] = {}
    base_run = RunSettings.of_base(base) if base is not None else None
    for record, run in zip(audit.records, audit.runs, strict=True):
        if not learnable(record.get("reason")):
            continue
        target = _target(record)
        if target is None:
            continue
        host, port, is_ip = target
        key = (record.get("conn"), record.get("host"), record.get("port"))
        if record.get("stage") == "connection" and key in decided:
            _reached(seen.get(host), record, run, base_run)
            continue
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
        _reached(entry, record, run, base_run)
    return seen


def _reached(entry: Seen | None, record: dict[str, Any], *runs: RunSettings | None) -> None:
    """Note the non-global address a record reached (an IP literal, or where a name connected)
    and which policy licensed it: the run's `private.allow` at the time, else BASE's."""
    if entry is None:
        return
    address = entry.host if entry.ip else _connected_to(record)
    if address is None or _non_global(address) is None:
        return
    entry.private.add(address)
    licence = next((run.source for run in runs if run is not None and run.private_allow), None)
    if licence is not None:
        entry.licensed_by.add(licence)


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


def _describe_private(entry: Seen) -> list[str]:
    """Why a rule that reaches non-global addresses may: who licensed it."""
    addresses = ", ".join(sorted(entry.private))
    what = f"not a global address ({_non_global(entry.host)})" if entry.ip else f"reached at {addresses}"
    if entry.licensed_by:
        return [_comment(f"{what}: licensed by private.allow in {', '.join(sorted(entry.licensed_by))}")]
    return [_comment(f"{what}: reached under an IP/CIDR rule or a private origin of the learning run")]


def _resolver(audit: Audit, base: Policy | None) -> RunSettings | None:
    """Where the learning run's nameservers came from, and which: the last ones in force at a
    learned record, else BASE's."""
    learned = [
        run for record, run in zip(audit.records, audit.runs, strict=True) if learnable(record.get("reason"))
    ]
    for run in reversed(learned):
        if run is not None and run.nameservers:
            return run
    if base is not None and base.resolver.nameservers:
        return RunSettings.of_base(base)
    return None


def render(
    rules: Sequence[Seen], files: Sequence[str], base: str | None, resolver: RunSettings | None = None
) -> str:
    """The suggested policy as YAML with comments (rules double-quoted: valid YAML for any host).

    A non-global literal nobody licensed is left out (a comment says so); `private.allow` and the
    nameservers the learning run needed are carried over, each with a comment."""
    kept = [r for r in rules if not (r.ip and r.private and not r.licensed_by)]
    left_out = [r for r in rules if r not in kept]
    out = [
        f"# egressd policy suggest: {len(kept)} host(s) from {', '.join(_comment(f) for f in files)}",
        "# allow rules that would have admitted what was learned (mode: learn) or refused as not",
        "# allowlisted; read them before use. Folding: see `egressd policy suggest --help`.",
    ]
    if base is not None:
        out.append(f"# only what {_comment(base)} does not already allow: add these to its allow list")
    for entry in left_out:
        for rule in _rule_texts(entry):
            out.append(
                _comment(
                    f"# left out: {rule}: not a global address ({_non_global(entry.host)}), and neither "
                    "the learning run's policy nor BASE licensed it (private.allow)"
                )
            )
    out += ["version: 1", "mode: enforce"]
    licences = sorted({source for r in kept if r.private for source in r.licensed_by})
    if licences:
        needed = sorted(
            r.host if r.ip else f"{r.host} ({', '.join(sorted(r.private))})" for r in kept if r.licensed_by
        )
        out.append("private:")
        out.append(
            _comment(f"  # carried over from {', '.join(licences)}: these reached non-global addresses")
        )
        out.append(_comment(f"  # under its private.allow: {'; '.join(needed)}"))
        out.append("  allow: true")
    if resolver is not None:
        out.append("resolver:")
        out.append(
            _comment(
                f"  # carried over from {resolver.source}: the learning run resolved names through these"
            )
        )
        out.append(f"  nameservers: {json.dumps(list(resolver.nameservers))}")
    if not kept:
        out.append("allow: []  # nothing to add")
        return "\n".join(out) + "\n"
    out.append("allow:")
    for entry in kept:
        out += [f"  # {line}" for line in _describe(entry)]
        if entry.private:
            out += [f"  # {line}" for line in _describe_private(entry)]
        out += [f"  - {json.dumps(rule, ensure_ascii=True)}" for rule in _rule_texts(entry)]
    return "\n".join(out) + "\n"


def suggest(paths: Sequence[str], base: Policy | None = None, base_name: str | None = None) -> str:
    """Read the audits, collect, fold and render: the text `egressd policy suggest` prints."""
    audit = read_audits(paths)
    if base is not None:
        base = base.with_overrides(mode="enforce")
    return render(fold(collect(audit, base)), audit.files, base_name, _resolver(audit, base))
