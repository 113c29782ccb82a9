"""What the user reads when a child is refused: one stderr line per refused host, and a summary.

Most clients show a refused HTTPS CONNECT as "403" or less (curl, pip, git, npm, Go): the reason in
the body never reaches the person or the model. So egressd says it itself, on stderr (never stdout:
MCP and ACP children speak JSON-RPC there): one line the first time a host is refused for a reason,
and when the child exits one summary naming every refused host and the `--allow` flags that would
admit them. A network failure (DNS, a refused or timed-out connection, a broken answer) is told as
"failed to reach", never as a refusal: no edit of the policy would help it. `--quiet` turns both
off. An observer of the pipeline's events like the audit.
"""

from __future__ import annotations

from typing import TextIO

from egressd.admission.events import Decided, Event
from egressd.observe.lines import StderrReport
from egressd.policy.refusal import HintContext, Refusal

MAX_HOSTS = 1000  # remembered per run: a child trying a million names does not grow egressd
SUMMARY_HOSTS = 20  # named in the summary; the rest are counted


def _printable(text: str) -> str:
    """A hostile host name must not drive the user's terminal."""
    return text if text.isprintable() else "".join(ch if ch.isprintable() else "?" for ch in text)


def _hosts(verb: str, seen: dict[str, dict[str, Refusal]], failed: bool) -> str:
    """`refused 3 hosts: a.example (not_allowlisted), ...` for the refusals (or, `failed`, the
    network failures) of `seen`; "" when there are none."""
    hosts = {
        host: [code for code, refusal in reasons.items() if refusal.reason.failure == failed]
        for host, reasons in seen.items()
    }
    hosts = {host: codes for host, codes in hosts.items() if codes}
    if not hosts:
        return ""
    named = [f"{host} ({', '.join(reasons)})" for host, reasons in list(hosts.items())[:SUMMARY_HOSTS]]
    text = f"{verb} {len(hosts)} host{'s' if len(hosts) != 1 else ''}: " + ", ".join(named)
    more = len(hosts) - len(named)
    return text + f" and {more} more" if more else text


class RefusalReport(StderrReport):
    """Deduplicated refusal lines (per host and reason) and the summary at exit; their hints name
    what the person who runs this command can change (`context`)."""

    def __init__(self, stream: TextIO, *, lines: bool = True, context: HintContext | None = None) -> None:
        super().__init__(stream, lines=lines)
        self.context = context or HintContext()
        # host -> {reason: the first refusal of it for that reason}, in the order first seen
        self._refused: dict[str, dict[str, Refusal]] = {}
        self._dropped = 0

    def observe(self, event: Event) -> None:
        """A refused decision naming a host: remembered, and told the first time."""
        if type(event) is not Decided or event.allowed or not event.host:  # type: ignore[union-attr]
            return
        assert isinstance(event, Decided)
        host, reason = event.host, event.reason
        assert host is not None
        with self._lock:
            reasons = self._refused.get(host)
            if reasons is None:
                if len(self._refused) >= MAX_HOSTS:
                    self._dropped += 1
                    return
                reasons = self._refused[host] = {}
            elif reason in reasons:
                return
            refusal = reasons[reason] = event.refusal(self.context)
        if self._lines:
            self._write(self.line(refusal))

    @staticmethod
    def line(refusal: Refusal) -> str:
        """`egressd: refused a.example:443 (not_allowlisted) - allow with: --allow a.example`, or
        `egressd: failed to reach a.example:443 (dns_timeout) - ...` for a network failure."""
        from egressd.wire.refusal import short_hint  # the hints: with the first refusal

        verb = "failed to reach" if refusal.reason.failure else "refused"
        text = f"egressd: {verb} {refusal.target} ({refusal.reason})"
        hint = short_hint(refusal)
        if hint:
            text += f" - {hint}"
        elif refusal.detail:
            text += f" - {refusal.detail}"
        return _printable(text)

    def summary(self) -> str | None:
        """`egressd: refused 3 hosts: a.example (not_allowlisted), ... allow with: --allow a.example`
        (and `failed to reach 1 host: b.example (dns_timeout)` for network failures), or None when
        nothing was refused and nothing failed."""
        with self._lock:
            refused = {host: dict(reasons) for host, reasons in self._refused.items()}
            dropped = self._dropped
        if not refused:
            return None
        parts = [
            _hosts(verb, refused, failed) for verb, failed in (("refused", False), ("failed to reach", True))
        ]
        text = "egressd: " + "; ".join(part for part in parts if part)
        if dropped:
            text += f" (and {dropped} refusals or failures of hosts not remembered)"
        from egressd.wire.refusal import line_flags, short_hint

        allow: dict[str, None] = {}  # the --allow flags, in order, once each
        edits: dict[str, None] = {}  # the other hints
        for reasons in refused.values():
            for refusal in reasons.values():
                found = line_flags(refusal)
                allow.update(dict.fromkeys(found))
                if not found and (hint := short_hint(refusal)):
                    edits[hint] = None
        hints = list(edits)
        if allow:
            hints.insert(0, "allow with: " + " ".join(f"--allow {flag}" for flag in allow))
        if hints:
            text += " - " + "; ".join(hints)
        return _printable(text)
