"""What a refused client sees: status, Proxy-Status (RFC 9209), X-Egressd-Reason and a readable body.

Every path that refuses (the HTTP proxy, SOCKS, the sandbox bridge, the SSH relay) builds its answer
here, so a refusal reads the same wherever it happens. No I/O and no mitmproxy import.
"""

from __future__ import annotations

from dataclasses import dataclass

# reason code -> (HTTP status, RFC 9209 error type)
_FAILURES: dict[str, tuple[int, str]] = {
    "dns_error": (502, "dns_error"),
    "dns_timeout": (502, "dns_timeout"),
    "connect_refused": (502, "connection_refused"),
    "connect_timeout": (504, "connection_timeout"),
    "connect_error": (502, "destination_unavailable"),
    # the upstream accepted the request but sent no response head within timeouts.response
    "upstream_timeout": (504, "http_response_timeout"),
    # the upstream's answer could not be read as HTTP/1 (a half response, a bad head, a close)
    "upstream_protocol_error": (502, "http_protocol_error"),
    # egressd is at its capacity of open files or connections: a later try may be served
    "overloaded": (503, "connection_limit_reached"),
    "proxy_auth_required": (407, "http_request_denied"),
    "bad_request": (400, "http_request_error"),
    "host_mismatch": (400, "http_request_error"),
    "rate_limited": (429, "connection_limit_reached"),
    "connection_limit": (429, "connection_limit_reached"),
    "header_timeout": (408, "http_request_error"),
    "internal_error": (500, "proxy_internal_error"),
    "draining": (503, "proxy_internal_error"),
    # audit.on_failure: refuse, while a record cannot be written (a full disk, a sink not reading)
    "audit_unavailable": (503, "proxy_internal_error"),
    "response_too_large": (502, "http_response_body_size"),
    "upstream_tls_error": (502, "tls_certificate_error"),
    # the parent proxy (upstream_proxy:) refused the CONNECT (403/407) or could not be reached
    "upstream_proxy_refused": (502, "connection_refused"),
    "upstream_proxy_unreachable": (502, "destination_unavailable"),
}
FAILURE_REASONS = frozenset(_FAILURES)

# reasons that say the way to the upstream failed (its DNS, the network, the server itself), not
# that anyone refused: every surface says "failed" for these, never "refused" (retrying may help)
NETWORK_FAILURES = frozenset(
    {
        "dns_error",
        "dns_timeout",
        "connect_refused",
        "connect_timeout",
        "connect_error",
        "upstream_timeout",
        "upstream_protocol_error",
        "upstream_tls_error",
        "upstream_proxy_unreachable",
    }
)


def is_network_failure(reason: str) -> bool:
    """True when reason says the upstream could not be reached or answered badly, not a refusal."""
    return reason in NETWORK_FAILURES


def outcome(reason: str) -> str:
    """The word every surface uses for a connection that did not happen: "failed" or "refused"."""
    return "failed" if reason in NETWORK_FAILURES else "refused"


# policy refusals about the address itself get the IP-specific error type
_ADDRESS_REASONS = {"forbidden_address", "private_address", "resolved_forbidden", "self"}

# reasons that are policy decisions: retrying will not help, an edit of the policy would
POLICY_REASONS = frozenset(
    {
        "self",
        "mode_off",
        "forbidden_address",
        "private_address",
        "denylist",
        "loopback_disabled",
        "loopback_port",
        "builtin_path",
        "not_allowlisted",
        "port",
        "profile",
        "exe_not_allowed",
        "resolved_forbidden",
        "invalid_target",
        "ask",
        "no_approver",
        "ask_refused",
        "ask_timeout",
        "needs_inspection",
        "sni_mismatch",
        "not_http",
        "websocket",
        "secret_exfiltration",
    }
)

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

EGRESSD_HEADERS = ("x-egressd-reason", "x-egressd-rule", "proxy-status")


@dataclass(frozen=True)
class GatewayHints:
    """Under `egressd run --gateway` the client is another machine, whose user cannot run egressd:
    the hint names what the gateway's operator edits instead."""

    policy_file: str | None  # the policy file the gateway watches (None: it runs without one)


@dataclass(frozen=True)
class Refusal:
    """A refusal ready to be rendered for any protocol."""

    reason: str
    detail: str
    host: str = ""
    port: int | None = None
    rule: str | None = None
    retry_after: int | None = None  # seconds, for 429 and overloaded answers
    gateway: GatewayHints | None = None  # set by the pipeline of `run --gateway`

    @property
    def is_policy(self) -> bool:
        return self.reason in POLICY_REASONS

    @property
    def is_network_failure(self) -> bool:
        return self.reason in NETWORK_FAILURES

    @property
    def status(self) -> int:
        if self.is_policy:
            return 403
        return _FAILURES.get(self.reason, (502, "destination_unavailable"))[0]

    @property
    def error_type(self) -> str:
        if self.is_policy:
            return "destination_ip_prohibited" if self.reason in _ADDRESS_REASONS else "http_request_denied"
        return _FAILURES.get(self.reason, (502, "destination_unavailable"))[1]

    @property
    def target(self) -> str:
        if not self.host:
            return "the target"
        if self.port is None:
            return self.host
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"

    def phrase(self, status: int | None = None) -> str:
        """The status line's reason phrase, carrying the reason code (`Forbidden by egressd:
        not_allowlisted`): many clients print only the status line of a refused CONNECT (RFC 9112
        lets the phrase be any text), so this is how the reason reaches the user without a body."""
        status = status or self.status
        return f"{_PHRASES.get(status, 'Error')} by egressd: {_header_safe(self.reason)}"

    def headers(self) -> list[tuple[str, str]]:
        details = _quote(f"{self.reason}: {self.detail}" if self.detail else self.reason)
        headers = [
            ("Proxy-Status", f'egressd; error={self.error_type}; details="{details}"'),
            ("X-Egressd-Reason", self.reason),
            ("Content-Type", "text/plain; charset=utf-8"),
            ("Cache-Control", "no-store"),
            ("Connection", "close"),
        ]
        if self.rule:
            headers.append(("X-Egressd-Rule", _header_safe(self.rule)))
        if self.reason == "proxy_auth_required":
            headers.append(("Proxy-Authenticate", 'Basic realm="egressd"'))
        if self.status == 429 or self.reason == "overloaded":
            headers.append(("Retry-After", str(self.retry_after or 1)))
        return headers

    def body(self) -> str:
        if self.is_network_failure:
            first = f"egressd could not get an answer from {self.target}."
        else:
            first = f"egressd refused the connection to {self.target}."
        lines = [first, f"reason: {self.reason}"]
        if self.rule:
            lines.append(f"decided by: {self.rule}")
        if self.detail:
            lines.append(f"detail: {self.detail}")
        if self.is_policy:
            lines.append("This is a policy decision: retrying, or trying to bypass the proxy, will not help.")
            hint = self.allow_hint()
            if hint:
                lines.append(f"To allow it, a person can run: {hint}")
        elif self.reason == "proxy_auth_required":
            lines.append("Use the proxy URL egressd put in HTTP_PROXY/HTTPS_PROXY; it carries credentials.")
        elif self.reason == "audit_unavailable":
            lines.append(
                "This is not a policy decision: egressd cannot write its audit log and admits nothing it "
                "cannot record. Retrying succeeds once the log can be written again."
            )
        elif self.is_network_failure:
            lines.append(
                "This is not a policy decision: the network or the upstream failed; a retry may work."
            )
        elif self.reason == "overloaded":
            lines.append("This is not a policy decision: egressd is at its capacity; a retry may work.")
        else:
            lines.append("This is not a policy decision.")
        return "\n".join(lines) + "\n"

    def allow_hint(self) -> str | None:
        """The command that would allow this target, when an edit of the allowlist can."""
        if not self.host or self.reason in {"forbidden_address", "self", "invalid_target", "sni_mismatch"}:
            return None
        rule = self.host if self.port in (None, 80, 443) else self.target
        if self.gateway is not None and self.reason not in {"denylist", "exe_not_allowed", "builtin_path"}:
            return self._gateway_hint(rule)
        if self.reason == "mode_off":
            return "egressd exec --mode enforce --allow <host> -- <command>"
        if self.reason == "denylist":
            return f"remove the deny rule '{self.rule or self.host}' from the policy"
        if self.reason == "resolved_forbidden":
            return f"egressd exec --allow <CIDR of the address> --allow {rule} -- <command>"
        if self.reason == "builtin_path":
            return f"add the path to the built-in allowance for {self.host} in the policy (builtin: paths)"
        if self.reason == "needs_inspection":
            return "run without --no-inspect (this host is admitted only for some paths)"
        if self.reason == "exe_not_allowed":
            return f"add this program to the exe list of the allow rule '{self.rule or self.host}'"
        return f"egressd exec --allow {rule} -- <command>   (or add '{rule}' to the policy's allow list)"

    def _gateway_hint(self, rule: str) -> str:
        assert self.gateway is not None
        who, where = "the gateway's operator", self.gateway.policy_file
        if where is None:
            return f"{who} restarts it with --policy FILE, '{rule}' in that file's allow list"
        if self.reason == "mode_off":
            return f"{who} sets mode: enforce in {where} and adds '{rule}' to its allow list"
        if self.reason == "needs_inspection":
            return f"{who} lets egressd inspect {self.host} (no --no-inspect): {where} names its paths"
        if self.reason == "resolved_forbidden":
            rule = f"{rule}' and '<CIDR of the address>"
        return f"{who} adds '{rule}' to the allow list in {where} (a saved edit applies at once)"


def _quote(text: str) -> str:
    return _header_safe(text).replace("\\", "\\\\").replace('"', '\\"')


def _header_safe(text: str) -> str:
    return "".join(ch if 0x20 <= ord(ch) < 0x7F else "?" for ch in text)[:400]
