"""The secrets step: a request's placeholders swapped for the real values, or refused.

egressd gives the child `egressd-secret-<name>-<token>` instead of a credential (the token random per
run). For an HTTP request egressd sees — plain HTTP, or a request inside an inspected tunnel; the
hosts a secret may go to are always inspected — this step, run by the admission pipeline after the
request rules:

- refuses (`secret_exfiltration`) a request whose method, URL or headers carry the placeholder of a
  secret that may not go to its host, in any spelling the matcher knows (egressd.wire.placeholders);
- puts the real value where the secret's entry says (a header, or a query parameter) when the
  request to one of its hosts carries the placeholder there;
- hands the front the placeholders the body must not carry, for its streaming scan, and the values
  the response from one of a secret's hosts must not carry back (egressd.wire.placeholders.ValueMask,
  every part of the response, every spelling egressd sends a value in).

Values live only here (and in egressd.session.secret_values, which reads them): never in the policy, an
event, a record or a refusal.
"""

from __future__ import annotations

import secrets as random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from urllib.parse import quote

from egressd.policy import Host
from egressd.policy.reasons import Reason
from egressd.policy.refusal import Refusal
from egressd.policy.secrets import SecretSpec
from egressd.wire.placeholders import Needles, ValueMask, placeholder

REASON = Reason.SECRET_EXFILTRATION
Headers = Sequence[tuple[str, str]]


@dataclass(frozen=True)
class Injection:
    """What egressd changes in an admitted request: its headers and path (None: unchanged), the
    placeholders its body must not carry (empty: no scan), and what was swapped in (secret names)."""

    headers: tuple[tuple[str, str], ...] | None = None
    path: str | None = None
    body: Needles = field(default_factory=lambda: Needles({}))
    injected: tuple[str, ...] = ()
    # the values of the secrets this host may get: masked wherever its response echoes them
    values: tuple[str, ...] = ()


NO_INJECTION = Injection()


@dataclass(frozen=True, eq=False)
class SecretBook:
    """The secrets in force with their values, and every placeholder this run handed out: one
    immutable value (part of what a reload swaps whole, `admission.in_force.InForce`). Placeholders
    are stable: `updated` keeps every one made before, so children keep theirs across reloads and a
    removed secret's placeholder stays refused everywhere."""

    placeholders: Mapping[str, str] = field(default_factory=dict)
    specs: Mapping[str, SecretSpec] = field(default_factory=dict)
    values: Mapping[str, str] = field(default_factory=dict)
    needles: Needles = field(default_factory=lambda: Needles({}))
    mask: ValueMask = field(default_factory=lambda: ValueMask(()))

    def updated(self, specs: Sequence[SecretSpec], values: Mapping[str, str]) -> SecretBook:
        """The book of a new version of the policy: its secrets and their values, read together."""
        placeholders = dict(self.placeholders)
        for spec in specs:
            if spec.name not in placeholders:
                placeholders[spec.name] = placeholder(spec.name, random.token_hex(16))
        return SecretBook(
            placeholders,
            {s.name: s for s in specs},
            dict(values),
            Needles.of(placeholders),
            ValueMask(values.values()),
        )

    def __bool__(self) -> bool:
        return bool(self.placeholders)

    def spec(self, name: str) -> SecretSpec | None:
        return self.specs.get(name)

    def placeholder(self, name: str) -> str:
        return self.placeholders[name]

    def child_variables(self) -> dict[str, str]:
        """{child variable: placeholder} of the secrets in force."""
        return {spec.env: self.placeholders[name] for name, spec in self.specs.items()}

    def listed(self, host: Host, port: int) -> bool:
        """A host some secret may go to: its tunnels are inspected, so egressd sees the headers."""
        return any(spec.admits(host, port) for spec in self.specs.values())

    def header_names(self) -> tuple[str, ...]:
        """The headers secrets go in: dropped from the follow-up of a redirect to another origin."""
        return tuple(s.header[0] for s in self.specs.values() if s.header is not None)

    def mask_text(self, text: str) -> str:
        """`text` with every secret's value masked: what egressd writes about a response it could
        not read (an error page, a record) may quote the response, and with it an echoed value."""
        return self.mask.text(text)

    def judge(
        self, host: Host, port: int, method: str | None, path: str, headers: Headers
    ) -> Refusal | Injection:
        """The refusal of a request carrying a placeholder its host may not get, or what to change."""
        if not self.placeholders:
            return NO_INJECTION
        allowed = {name for name, spec in self.specs.items() if spec.admits(host, port)}
        foreign = Needles({n: t for n, t in self.needles.tokens.items() if n not in allowed})
        if foreign:
            name = foreign.find(path)
            where = "URL"
            if name is None and method is not None and (name := foreign.find(method)) is not None:
                where = "method"
            if name is None:
                for header, value in headers:
                    if (name := foreign.find(value) or foreign.find(header)) is not None:
                        where = f"{foreign.redact(header.lower())} header"
                        break
            if name is not None:
                return refusal(name, where, host, port, self.specs.get(name))
        values = tuple(v for name in sorted(allowed) if (v := self.values.get(name)) is not None)
        if not values:
            return Injection(body=foreign)
        new_headers, new_path, injected = list(headers), path, []
        for name in sorted(allowed):
            spec, token = self.specs[name], self.placeholders[name]
            value = self.values.get(name)
            if value is None:
                continue
            if spec.header is not None:
                changed = _inject_header(new_headers, spec, token, value)
            else:
                assert spec.query is not None
                new_path, changed = _inject_query(new_path, spec.query, token, value)
            if changed:
                injected.append(name)
        # every response of a secret's host is read for echoes of its values (masked): asked for
        # unencoded, whether or not this request carries a value (the server may echo an earlier one)
        new_headers = [(n, v) for n, v in new_headers if n.lower() != "accept-encoding"]
        new_headers.append(("Accept-Encoding", "identity"))
        return Injection(
            headers=tuple(new_headers) if new_headers != list(headers) else None,
            path=new_path if new_path != path else None,
            body=foreign,
            injected=tuple(injected),
            values=values,
        )


NO_SECRETS = SecretBook()


def refusal(name: str, where: str, host: Host, port: int, spec: SecretSpec | None) -> Refusal:
    """`secret_exfiltration`: names the secret and where, never its placeholder or value."""
    goes = (
        f"it may only go to {', '.join(spec.host_texts())}"
        if spec is not None
        else "it is no longer in the policy"
    )
    detail = (
        f"the {where} carries the placeholder of secret {name!r}, and {host.url_host()}:{port} may not "
        f"receive it ({goes})"
    )
    return Refusal(REASON, detail, host.text, port)


def _inject_header(
    headers: list[tuple[str, str]], spec: SecretSpec, placeholder_text: str, value: str
) -> bool:
    """Every header of the entry's name that carries the placeholder becomes the filled template."""
    assert spec.header is not None
    changed = False
    for index, (name, current) in enumerate(headers):
        if name.lower() == spec.header[0] and placeholder_text in current:
            headers[index] = (name, spec.fill(value))
            changed = True
    return changed


def _inject_query(path: str, parameter: str, placeholder_text: str, value: str) -> tuple[str, bool]:
    """The parameter's value becomes the (percent-encoded) real value where it is the placeholder."""
    base, sep, query = path.partition("?")
    if not sep:
        return path, False
    fragment = ""
    if "#" in query:
        query, _, fragment = query.partition("#")
        fragment = "#" + fragment
    parts = query.split("&")
    changed = False
    for index, part in enumerate(parts):
        key, eq, current = part.partition("=")
        if eq and key == parameter and placeholder_text in current:
            parts[index] = f"{key}={quote(value, safe='')}"
            changed = True
    return (f"{base}?{'&'.join(parts)}{fragment}", changed) if changed else (path, False)
