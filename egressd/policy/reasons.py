"""Every reason code egressd gives, in one typed registry, with what each means on every surface.

A decision, a refusal, an audit record, a metric label, a SOCKS5 reply, a refusal page and a hint
all name their reason with a `Reason`: a code that is not here cannot be made (`Reason("typo")`
raises ValueError), so no surface can count, word or answer a reason differently from another. The
members are strings (`StrEnum`): records, JSON and headers carry the bare code. Pure data; the
renderers of what a client and a person read are in `egressd.wire.refusal`.
"""

from __future__ import annotations

from enum import Enum, StrEnum


class Kind(Enum):
    """What a reason says happened."""

    ALLOW = "allow"  # why a decision admitted
    POLICY = "policy"  # the policy refused: retrying does not help, an edit of the policy (or an answer) does
    PROXY = "proxy"  # egressd itself refused: credentials, limits, a malformed request, its own state
    FAILURE = "failure"  # the way to the upstream failed (DNS, network, server): no edit helps, a retry may


class Lift(Enum):
    """What a person changes to admit a target refused for this reason: the kind of hint."""

    NONE = "none"  # nothing can (or the detail says what the setting is)
    ALLOW = "allow"  # an allow rule for the host
    ASK = "ask"  # an answer to the ask (an approver present), or an allow rule
    PROFILE = "profile"  # the child's profile (profiles.NAME): allow, deny or ports
    DENY = "deny"  # removing the deny rule
    PRIVATE = "private"  # a non-global literal: an explicit IP/CIDR rule, or private.allow
    ADDRESS = "address"  # the addresses a name resolved to: a rule for each, or private.allow
    LOOPBACK = "loopback"  # loopback.allow
    LOOPBACK_PORT = "loopback_port"  # loopback.ports
    PORT = "port"  # the policy's ports
    BUILTIN = "builtin"  # a path of a built-in allowance
    EXE = "exe"  # the program list of an allow rule
    INSPECT = "inspect"  # TLS inspection (without --no-inspect)
    MODE = "mode"  # the mode (mode: off)


# the RFC 1928 reply codes the registry names (egressd.wire.socks5 writes them)
SOCKS_GENERAL_FAILURE = 0x01
SOCKS_NOT_ALLOWED = 0x02
SOCKS_HOST_UNREACHABLE = 0x04
SOCKS_CONNECTION_REFUSED = 0x05
SOCKS_TTL_EXPIRED = 0x06  # the closest code for "timed out"

# the rule of an ask answered "deny always" (egressd.admission.asks): no hint may say how to allow
# what a person refused for good
DENIED_ALWAYS = "mode: ask (denied always)"

_P, _X, _F = Kind.POLICY, Kind.PROXY, Kind.FAILURE
_DENIED, _ADDRESS_DENIED = "http_request_denied", "destination_ip_prohibited"
_NOT_ALLOWED, _GENERAL = SOCKS_NOT_ALLOWED, SOCKS_GENERAL_FAILURE


class Reason(StrEnum):
    """A reason code and its meaning: `kind`, HTTP `status`, RFC 9209 Proxy-Status error type
    (`proxy_status`), SOCKS5 reply (`socks`) and what lifts it (`lift`)."""

    kind: Kind
    status: int
    proxy_status: str
    socks: int
    lift: Lift

    def __new__(
        cls,
        code: str,
        kind: Kind,
        status: int = 0,
        proxy_status: str = "",
        socks: int = 0,
        lift: Lift = Lift.NONE,
    ) -> Reason:
        member = str.__new__(cls, code)
        member._value_ = code
        member.kind, member.status, member.proxy_status = kind, status, proxy_status
        member.socks, member.lift = socks, lift
        return member

    # -- allows: why a decision admitted ----------------------------------------------------------
    ALLOWLIST = "allowlist", Kind.ALLOW
    LOOPBACK = "loopback", Kind.ALLOW
    BUILTIN = "builtin", Kind.ALLOW
    PRIVATE_ORIGIN = "private_origin", Kind.ALLOW
    MODE_ALLOW = "mode_allow", Kind.ALLOW
    LEARNED = "learned", Kind.ALLOW  # mode: learn (the record names what enforce would have said)
    APPROVED = "approved", Kind.ALLOW  # an approver said yes
    GRANTED = "granted", Kind.ALLOW  # the user's grant

    # -- the policy's refusals: 403, "not allowed by ruleset" -------------------------------------
    SELF = "self", _P, 403, _ADDRESS_DENIED, _NOT_ALLOWED
    MODE_OFF = "mode_off", _P, 403, _DENIED, _NOT_ALLOWED, Lift.MODE
    FORBIDDEN_ADDRESS = "forbidden_address", _P, 403, _ADDRESS_DENIED, _NOT_ALLOWED
    PRIVATE_ADDRESS = "private_address", _P, 403, _ADDRESS_DENIED, _NOT_ALLOWED, Lift.PRIVATE
    DENYLIST = "denylist", _P, 403, _DENIED, _NOT_ALLOWED, Lift.DENY
    LOOPBACK_DISABLED = "loopback_disabled", _P, 403, _DENIED, _NOT_ALLOWED, Lift.LOOPBACK
    LOOPBACK_PORT = "loopback_port", _P, 403, _DENIED, _NOT_ALLOWED, Lift.LOOPBACK_PORT
    BUILTIN_PATH = "builtin_path", _P, 403, _DENIED, _NOT_ALLOWED, Lift.BUILTIN
    NOT_ALLOWLISTED = "not_allowlisted", _P, 403, _DENIED, _NOT_ALLOWED, Lift.ALLOW
    PORT = "port", _P, 403, _DENIED, _NOT_ALLOWED, Lift.PORT
    PROFILE = "profile", _P, 403, _DENIED, _NOT_ALLOWED, Lift.PROFILE
    EXE_NOT_ALLOWED = "exe_not_allowed", _P, 403, _DENIED, _NOT_ALLOWED, Lift.EXE
    RESOLVED_FORBIDDEN = "resolved_forbidden", _P, 403, _ADDRESS_DENIED, _NOT_ALLOWED, Lift.ADDRESS
    INVALID_TARGET = "invalid_target", _P, 403, _DENIED, _NOT_ALLOWED
    ASK = "ask", _P, 403, _DENIED, _NOT_ALLOWED, Lift.ASK  # mode: ask, still waiting for an answer
    NO_APPROVER = "no_approver", _P, 403, _DENIED, _NOT_ALLOWED, Lift.ASK
    ASK_REFUSED = "ask_refused", _P, 403, _DENIED, _NOT_ALLOWED, Lift.ALLOW
    ASK_TIMEOUT = "ask_timeout", _P, 403, _DENIED, _NOT_ALLOWED, Lift.ASK
    NEEDS_INSPECTION = "needs_inspection", _P, 403, _DENIED, _NOT_ALLOWED, Lift.INSPECT
    SNI_MISMATCH = "sni_mismatch", _P, 403, _DENIED, _NOT_ALLOWED
    NOT_HTTP = "not_http", _P, 403, _DENIED, _NOT_ALLOWED
    WEBSOCKET = "websocket", _P, 403, _DENIED, _NOT_ALLOWED
    SECRET_EXFILTRATION = "secret_exfiltration", _P, 403, _DENIED, _NOT_ALLOWED

    # -- egressd's own refusals: not the policy's, not the network's -------------------------------
    PROXY_AUTH_REQUIRED = "proxy_auth_required", _X, 407, _DENIED, _GENERAL
    BAD_REQUEST = "bad_request", _X, 400, "http_request_error", _GENERAL
    HOST_MISMATCH = "host_mismatch", _X, 400, "http_request_error", _GENERAL
    RATE_LIMITED = "rate_limited", _X, 429, "connection_limit_reached", _GENERAL
    CONNECTION_LIMIT = "connection_limit", _X, 429, "connection_limit_reached", _GENERAL
    # egressd is at its capacity of open files or connections: a later try may be served
    OVERLOADED = "overloaded", _X, 503, "connection_limit_reached", _GENERAL
    INTERNAL_ERROR = "internal_error", _X, 500, "proxy_internal_error", _GENERAL
    # audit.on_failure: refuse, while a record cannot be written (a full disk, a sink not reading)
    AUDIT_UNAVAILABLE = "audit_unavailable", _X, 503, "proxy_internal_error", _GENERAL
    RESPONSE_TOO_LARGE = "response_too_large", _X, 502, "http_response_body_size", _GENERAL
    # the parent proxy (upstream_proxy:) refused the CONNECT (403/407)
    UPSTREAM_PROXY_REFUSED = "upstream_proxy_refused", _X, 502, "connection_refused", _GENERAL

    # -- network failures: the way to the upstream failed, nobody refused ------------------------
    DNS_ERROR = "dns_error", _F, 502, "dns_error", SOCKS_HOST_UNREACHABLE
    DNS_TIMEOUT = "dns_timeout", _F, 502, "dns_timeout", SOCKS_HOST_UNREACHABLE
    CONNECT_REFUSED = "connect_refused", _F, 502, "connection_refused", SOCKS_CONNECTION_REFUSED
    CONNECT_TIMEOUT = "connect_timeout", _F, 504, "connection_timeout", SOCKS_TTL_EXPIRED
    CONNECT_ERROR = "connect_error", _F, 502, "destination_unavailable", _GENERAL
    # the upstream accepted the request but sent no response head within timeouts.response
    UPSTREAM_TIMEOUT = "upstream_timeout", _F, 504, "http_response_timeout", _GENERAL
    # the upstream's answer could not be read as HTTP/1 (a half response, a bad head, a close)
    UPSTREAM_PROTOCOL_ERROR = "upstream_protocol_error", _F, 502, "http_protocol_error", _GENERAL
    UPSTREAM_TLS_ERROR = "upstream_tls_error", _F, 502, "tls_certificate_error", _GENERAL
    UPSTREAM_PROXY_UNREACHABLE = "upstream_proxy_unreachable", _F, 502, "destination_unavailable", _GENERAL

    @classmethod
    def of(cls, code: str) -> Reason:
        """The member for a code, as `Reason(code)` (ValueError for a code that is not one) in a
        fraction of its time: refusals are made on the hot path of a child refused in a loop."""
        if type(code) is cls:
            return code  # type: ignore[return-value]
        found = cls._value2member_map_.get(code)
        if found is None:
            raise ValueError(f"{code!r} is not a reason code of egressd")
        return found  # type: ignore[return-value]

    @classmethod
    def parse(cls, text: object) -> Reason | None:
        """The member a record names (an audit line, a control API event), None for anything else:
        records may come from another version of egressd, code never does (use `Reason(code)`)."""
        return cls._value2member_map_.get(text) if isinstance(text, str) else None  # type: ignore[return-value]

    @property
    def failure(self) -> bool:
        """The upstream could not be reached or answered badly: told as "failed", never "refused"."""
        return self.kind is Kind.FAILURE

    @property
    def policy(self) -> bool:
        return self.kind is Kind.POLICY

    @property
    def outcome(self) -> str:
        """The word every surface uses: "allowed", "failed" or "refused"."""
        return "allowed" if self.kind is Kind.ALLOW else "failed" if self.kind is Kind.FAILURE else "refused"

    @property
    def liftable(self) -> bool:
        """An allow rule for the target (`--allow HOST`) admits what this reason refused."""
        return self.lift in (Lift.ALLOW, Lift.ASK)

    @property
    def learnable(self) -> bool:
        """A record of this reason means "the child needed this and the policy did not allow it" (what
        `policy suggest` drafts a rule from): never a person's explicit no."""
        return self is Reason.LEARNED or (self.liftable and self is not Reason.ASK_REFUSED)


def is_network_failure(reason: object) -> bool:
    """True when a reason (a member, or a record's text) says the upstream failed, not a refusal."""
    found = reason if type(reason) is Reason else Reason.parse(reason)
    return found is not None and found.kind is Kind.FAILURE
