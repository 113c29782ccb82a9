"""Everything a refused client and its user read, rendered in one place from one registry.

The HTTP answer (status line with the reason code, Proxy-Status per RFC 9209, X-Egressd-Reason, the
explaining body) that every front, mitmproxy's error pages and the TLS refusal page write; the
SOCKS5 reply; the hint that says what would allow the target. The hint depends on where it is
read (`HintContext`): a person running `egressd exec` reruns it with `--allow`, the editor of
`egressd acp` edits its agent's command, a gateway's operator edits the gateway's policy file, a
profile refusal needs an edit of the profile. Every hint is addressed to a person ("a person can"),
never to the model or program that reads the refusal. Pure: no I/O.
"""

from __future__ import annotations

import contextlib
import ipaddress

from egressd.policy.addresses import AddressClass, classify
from egressd.policy.reasons import DENIED_ALWAYS, Kind, Lift, Reason
from egressd.policy.refusal import HintContext, Refusal

# the headers only egressd writes: an upstream's forged ones are stripped
EGRESSD_HEADERS = ("x-egressd-reason", "x-egressd-rule", "proxy-status")
DEFAULT_CONTEXT = HintContext()

# the standard phrase of each status a refusal can have (RFC 9110)
_PHRASES = {
    400: "Bad Request",
    403: "Forbidden",
    407: "Proxy Authentication Required",
    408: "Request Timeout",
    429: "Too Many Requests",
    500: "Internal Server Error",
    502: "Bad Gateway",
    503: "Service Unavailable",
    504: "Gateway Timeout",
}

_POLICY = "This is a policy decision: retrying, or trying to bypass the proxy, will not help."
_FAILURE = "This is not a policy decision: the network or the upstream failed; a retry may work."
# ask mode: the next attempt is asked again, so a retry is exactly what may help
_WHY = {
    Reason.ASK_TIMEOUT: (
        "This is a policy decision in ask mode: nobody answered in time. The next attempt is asked "
        "again; trying to bypass the proxy will not help."
    ),
    Reason.NO_APPROVER: (
        "This is a policy decision in ask mode: nobody was there to answer. A person becomes an "
        "approver with `egressd pending --follow` (then `egressd approve ID`), on the dashboard "
        "(`egressd dashboard`) or by running egressd in a terminal; the next attempt is then asked. "
        "Trying to bypass the proxy will not help."
    ),
    Reason.PROXY_AUTH_REQUIRED: (
        "Use the proxy URL egressd put in HTTP_PROXY/HTTPS_PROXY; it carries credentials."
    ),
    Reason.AUDIT_UNAVAILABLE: (
        "This is not a policy decision: egressd cannot write its audit log and admits nothing it "
        "cannot record. Retrying succeeds once the log can be written again."
    ),
    Reason.OVERLOADED: "This is not a policy decision: egressd is at its capacity; a retry may work.",
}

# the commands a person reruns with an added flag (the others are started by an editor or client)
_RERUN = {
    "exec": "egressd exec {flags} -- <command>",
    "sandbox": "egressd sandbox {flags} -- <command>",
    "ssh": "egressd ssh {flags} <destination> -- <command>",
    "run": "egressd run {flags}",
}
# where the command line of the others is kept
_CONFIGURED = {
    "acp": "the egressd acp command in the editor's agent settings",
    "mcp run": "this server's egressd mcp run command in the MCP client's configuration",
}


# -- the HTTP answer ----------------------------------------------------------------------------------
def phrase(refusal: Refusal, status: int | None = None) -> str:
    """The status line's reason phrase, carrying the reason code (`Forbidden by egressd:
    not_allowlisted`): many clients print only the status line of a refused CONNECT (RFC 9112 lets
    the phrase be any text), so this is how the reason reaches the user without a body."""
    status = status or refusal.reason.status
    return f"{_PHRASES.get(status, 'Error')} by egressd: {_header_safe(refusal.reason)}"


def headers(refusal: Refusal) -> list[tuple[str, str]]:
    reason = refusal.reason
    details = _quote(f"{reason}: {refusal.detail}" if refusal.detail else reason)
    found = [
        ("Proxy-Status", f'egressd; error={reason.proxy_status}; details="{details}"'),
        ("X-Egressd-Reason", reason),
        ("Content-Type", "text/plain; charset=utf-8"),
        ("Cache-Control", "no-store"),
        ("Connection", "close"),
    ]
    if refusal.rule:
        found.append(("X-Egressd-Rule", _header_safe(refusal.rule)))
    if reason is Reason.PROXY_AUTH_REQUIRED:
        found.append(("Proxy-Authenticate", 'Basic realm="egressd"'))
    if reason.status == 429 or reason is Reason.OVERLOADED:
        found.append(("Retry-After", str(refusal.retry_after or 1)))
    return found


def body(refusal: Refusal) -> str:
    """The readable body: what was refused, the reason, the rule, the detail, whether a retry can
    help, and what would allow it."""
    reason = refusal.reason
    if reason.failure:
        first = f"egressd could not get an answer from {refusal.target}."
    else:
        first = f"egressd refused the connection to {refusal.target}."
    lines = [first, f"reason: {reason}"]
    if refusal.rule:
        lines.append(f"decided by: {refusal.rule}")
    if refusal.detail:
        lines.append(f"detail: {refusal.detail}")
    lines.append(why(reason))
    hint = allow_sentence(refusal)
    if hint:
        lines.append(hint)
    return "\n".join(lines) + "\n"


def http_response(refusal: Refusal) -> bytes:
    """A refusal as a complete HTTP/1.1 response (Connection: close)."""
    data = body(refusal).encode()
    lines = [f"HTTP/1.1 {refusal.reason.status} {phrase(refusal)}"]
    lines += [f"{name}: {value}" for name, value in headers(refusal)]
    lines.append(f"Content-Length: {len(data)}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + data


def socks_reply(reason: Reason) -> bytes:
    """The SOCKS5 reply of a refusal: "not allowed by ruleset" for the policy's, "host unreachable"
    for DNS, "refused" and "TTL expired" for the connect, else "general failure"."""
    from egressd.wire.socks5 import reply  # loaded with the SOCKS5 front, which calls this

    return reply(Reason.of(reason).socks)


def why(reason: Reason) -> str:
    """Whether retrying can help: the sentence every surface gives after the detail."""
    found = _WHY.get(reason)
    if found is not None:
        return found
    if reason.kind is Kind.POLICY:
        return _POLICY
    if reason.kind is Kind.FAILURE:
        return _FAILURE
    return "This is not a policy decision."


# -- what a person reads elsewhere ----------------------------------------------------------------
def notice(refusal: Refusal, what: str) -> str:
    """The text an ACP editor shows and an MCP tool result carries, read by the model as much as by
    the person: what was refused (a network failure is told as one), why, and what a person can
    change; each part one sentence."""
    reason = refusal.reason
    verb = "failed to reach" if reason.failure else "refused"
    parts = [f"egressd {verb} {what}: {reason}."]
    if refusal.detail:
        parts.append(sentence(refusal.detail))
    if reason.kind is not Kind.ALLOW:
        parts.append(why(reason))
    hint = allow_sentence(refusal)
    if hint:
        parts.append(sentence(hint))
    return " ".join(parts)


def sentence(text: str) -> str:
    """`text` ending in exactly one full stop (a detail may or may not end in one already)."""
    text = text.strip()
    return text if text.endswith((".", "!", "?")) else text + "."


def allow_flag(host: str, port: int | None) -> str:
    """The --allow rule that admits this target: the host, with the port unless 80/443."""
    where = f"[{host}]" if ":" in host else host
    return where if port in (None, 80, 443) else f"{where}:{port}"


def flags(refusal: Refusal) -> tuple[str, ...]:
    """The `--allow` rules that would admit this target on the running command's line (every
    command takes them), () when no flag can: the host, or for a name refused for the addresses it
    resolved to, a rule for each of them."""
    reason, host = refusal.reason, refusal.host
    if not host or (reason is Reason.ASK_REFUSED and refusal.rule == DENIED_ALWAYS):
        return ()
    if reason.liftable or reason.lift is Lift.PRIVATE:
        return (allow_flag(host, refusal.port),)
    if reason.lift is Lift.ADDRESS:
        return tuple(network for network, _ in _lifted_addresses(refusal.addresses))
    return ()


def allow_sentence(refusal: Refusal, context: HintContext | None = None) -> str | None:
    """`To allow it, a person can run: egressd exec --allow a.example -- <command>` (or the edit
    that would, where it is read), None when no change can allow it."""
    context = context or refusal.context or DEFAULT_CONTEXT
    edit = _remedy(refusal, context)
    if edit is None:
        return None
    verb, rest = edit
    if context.gateway:
        return f"To allow it, the gateway's operator {verb}s {rest}"
    if verb == "run":
        return f"To allow it, a person can run: {rest}"
    return f"To allow it, a person can {verb} {rest}"


def line_flags(refusal: Refusal, context: HintContext | None = None) -> tuple[str, ...]:
    """The `--allow` rules egressd's own stderr lines name for this refusal: () where a flag on
    the command line would not do (a child with a profile, a gateway's policy file) or none can."""
    context = context or refusal.context or DEFAULT_CONTEXT
    if _narrowed(refusal) or (context.gateway and context.policy_file):
        return ()
    return flags(refusal)


def rerun_hint(refusal: Refusal, context: HintContext | None = None) -> str | None:
    """`egressd exec --allow a.example -- <command>`: the command line that admits this target,
    where the command is one a person reruns (exec, sandbox, ssh, run) and a flag does it."""
    context = context or refusal.context or DEFAULT_CONTEXT
    found = line_flags(refusal, context)
    rerun = _RERUN.get(context.command)
    if not found or rerun is None or context.gateway:
        return None
    return rerun.format(flags=" ".join(f"--allow {flag}" for flag in found))


def short_hint(refusal: Refusal, context: HintContext | None = None) -> str | None:
    """The hint of egressd's own stderr lines, read by the person who runs it: `allow with:
    --allow a.example`, or the edit (`add the line '- a.example' under profiles.NAME.allow in
    FILE`); None where the detail says more."""
    context = context or refusal.context or DEFAULT_CONTEXT
    found = line_flags(refusal, context)
    if found:
        return "allow with: " + " ".join(f"--allow {flag}" for flag in found)
    if refusal.reason.lift is Lift.PROFILE or flags(refusal):
        edit = _remedy(refusal, context)
        if edit is not None:
            return f"{edit[0]} {edit[1]}"
    return None


# -- the remedy, by what lifts the reason and where it is read ------------------------------------
def _remedy(refusal: Refusal, context: HintContext) -> tuple[str, str] | None:
    """(verb, the rest): `("run", "egressd exec --allow a.example -- <command>")`,
    `("add", "'a.example' to allow: in /p/policy.yaml ...")`; None when nothing can allow it."""
    reason, host, port = refusal.reason, refusal.host, refusal.port
    if not host:
        return None
    lift = reason.lift
    target = allow_flag(host, port)
    where = f"in {context.policy_file}" if context.policy_file else "in the policy file"
    if lift in (Lift.ALLOW, Lift.ASK, Lift.PRIVATE, Lift.ADDRESS):
        rules = flags(refusal)
        if not rules:
            return None
        return _allow(rules, refusal, context)
    if lift is Lift.PROFILE:
        return _profile(refusal, target, context)
    if lift is Lift.DENY:
        rule = (refusal.rule or host).removeprefix("deny: ")
        if context.policy_file:
            return "remove", f"the deny rule '{rule}' from {context.policy_file}"
        return "remove", f"the deny rule '{rule}' from the policy"
    if lift is Lift.LOOPBACK:
        return "set", f"loopback.allow: true {where}"
    if lift is Lift.LOOPBACK_PORT:
        if context.command == "sandbox" and not context.gateway:
            return "run", f"egressd sandbox --allow-loopback-port {port} -- <command>"
        return "add", f"{port} to loopback.ports {where}"
    if lift is Lift.PORT:
        return "add", f"{port} to ports: {where}"
    if lift is Lift.BUILTIN:
        return "add", f"the path to the built-in allowance for {host} {where} (builtin: paths)"
    if lift is Lift.EXE:
        return "add", f"this program to the exe list of the allow rule '{refusal.rule or host}' {where}"
    if lift is Lift.INSPECT:
        if context.gateway:
            return "let", f"egressd inspect {host} (no --no-inspect): {where} names its paths"
        return "run", "without --no-inspect (this host is admitted only for some paths)"
    if lift is Lift.MODE:
        if context.gateway or context.command not in _RERUN:
            return "set", f"mode: enforce {where}, with '{target}' in its allow list"
        return "run", _RERUN[context.command].format(flags=f"--mode enforce --allow {target}")
    return None


def _allow(rules: tuple[str, ...], refusal: Refusal, context: HintContext) -> tuple[str, str]:
    """Allow rules: on the running command's line, or in the policy file it watches. A child with a
    profile needs the rule in the profile too when the profile lists hosts (it narrows): then only
    the file can say both."""
    listed = "' and '".join(rules)
    file, profile = context.policy_file, _narrowed(refusal)
    private = refusal.reason.lift is Lift.PRIVATE or any(
        klass is AddressClass.PRIVATE for _, klass in _lifted_addresses(refusal.addresses)
    )
    also = f" (and to profiles.{profile}.allow if that profile has an allow list)" if profile else ""
    in_policy = f"in {file}" if file else "in the policy"
    if context.gateway:
        if file is None:
            return "restart", f"it with --policy FILE, '{listed}' in that file's allow list{also}"
        saved = (
            "(a saved edit applies at once; or private.allow: true there)"
            if private
            else ("(a saved edit applies at once)")
        )
        return "add", f"'{listed}' to the allow list{also} in {file} {saved}"
    if file:
        edit = f"'{listed}' to allow:{also} in {file}; a saved edit applies at once"
    else:
        edit = f"'{listed}' to the policy's allow list{also}"
    if private:
        edit += f"; or set private.allow: true {in_policy}"
    if profile:
        return "add", edit
    flag_text = " ".join(f"--allow {rule}" for rule in rules)
    rerun = _RERUN.get(context.command)
    if rerun is not None:
        return "run", f"{rerun.format(flags=flag_text)}   (or add {edit})"
    configured = _CONFIGURED.get(context.command, f"the egressd {context.command} command")
    return "add", f"{flag_text} to {configured} (or add {edit})"


def _narrowed(refusal: Refusal) -> str | None:
    """The profile that must list the target too for an allow rule to admit it: the child's, for
    a target it decides (an address a name resolved to is licensed by the policy's rules alone)."""
    return refusal.profile if refusal.reason.lift is not Lift.ADDRESS else None


def _profile(refusal: Refusal, target: str, context: HintContext) -> tuple[str, str] | None:
    """A profile refusal: the profile's allow list, deny rule or ports (its rule says which)."""
    rule = refusal.rule or ""
    name = refusal.profile or rule.removeprefix("profile ").split(":", 1)[0]
    if not name:
        return None
    prefix = f"profile {name}"
    file = context.policy_file
    where = f"in {file} (a saved edit applies at once)" if file else "in the policy file"
    if rule == f"{prefix}: allow":
        return "add", f"the line '- {target}' under profiles.{name}.allow {where}"
    if rule.startswith(f"{prefix}: deny "):
        return "remove", f"'{rule[len(prefix) + 7 :]}' from profiles.{name}.deny {where}"
    if rule.startswith(f"{prefix}: ports"):
        return "add", f"{refusal.port} to profiles.{name}.ports {where}"
    return "define", f"profiles.{name} {where}, or run the child with a profile the policy defines"


def _lifted_addresses(addresses: tuple[str, ...]) -> list[tuple[str, AddressClass]]:
    """The resolved addresses an explicit rule may admit (`203.0.113.80/32`), with their class: the
    private and documentation ranges a name may resolve to (split-horizon DNS, a mirror) and
    loopback; never an always-refused one."""
    found: dict[str, AddressClass] = {}
    for ip in filter(None, map(_address, addresses)):
        klass = classify(ip)
        if klass in (AddressClass.PRIVATE, AddressClass.LOOPBACK):
            found.setdefault(f"{ip}/{ip.max_prefixlen}", klass)
    return list(found.items())


def _address(text: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    with contextlib.suppress(ValueError):
        return ipaddress.ip_address(text)
    return None


def _quote(text: str) -> str:
    return _header_safe(text).replace("\\", "\\\\").replace('"', '\\"')


def _header_safe(text: str) -> str:
    return "".join(ch if 0x20 <= ord(ch) < 0x7F else "?" for ch in text)[:400]
