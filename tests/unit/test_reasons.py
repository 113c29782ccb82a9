"""The one registry of reason codes: what each code means on every surface, and that no surface can
spell one the registry does not know.

The expected values are written here from the documents, not read from the registry: the HTTP
status and RFC 9209 Proxy-Status error type of docs/refusals.md, the SOCKS5 reply codes of RFC 1928
(0x01 general failure, 0x02 not allowed by ruleset, 0x04 host unreachable, 0x05 connection refused,
0x06 TTL expired), and which codes are network failures (told "failed", never "refused").
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from egressd.admission.events import Decided
from egressd.admission.in_force import PolicyHolder
from egressd.admission.pipeline import Pipeline
from egressd.observe.metrics import Metrics
from egressd.policy import Decision, default_policy
from egressd.policy.reasons import Kind, Reason, is_network_failure
from egressd.policy.refusal import Refusal
from egressd.wire.refusal import body, headers, http_response, socks_reply

DOCS = Path(__file__).resolve().parents[2] / "docs"

A, P, X, F = "allow", "policy", "proxy", "failure"
DENIED, PROHIBITED = "http_request_denied", "destination_ip_prohibited"
# code: (kind, HTTP status, Proxy-Status error type, SOCKS5 reply)
MEANING: dict[str, tuple[str, int, str, int]] = {
    "allowlist": (A, 0, "", 0),
    "loopback": (A, 0, "", 0),
    "builtin": (A, 0, "", 0),
    "private_origin": (A, 0, "", 0),
    "mode_allow": (A, 0, "", 0),
    "learned": (A, 0, "", 0),
    "approved": (A, 0, "", 0),
    "granted": (A, 0, "", 0),
    "self": (P, 403, PROHIBITED, 0x02),
    "forbidden_address": (P, 403, PROHIBITED, 0x02),
    "private_address": (P, 403, PROHIBITED, 0x02),
    "resolved_forbidden": (P, 403, PROHIBITED, 0x02),
    "mode_off": (P, 403, DENIED, 0x02),
    "denylist": (P, 403, DENIED, 0x02),
    "loopback_disabled": (P, 403, DENIED, 0x02),
    "loopback_port": (P, 403, DENIED, 0x02),
    "builtin_path": (P, 403, DENIED, 0x02),
    "not_allowlisted": (P, 403, DENIED, 0x02),
    "port": (P, 403, DENIED, 0x02),
    "profile": (P, 403, DENIED, 0x02),
    "exe_not_allowed": (P, 403, DENIED, 0x02),
    "invalid_target": (P, 403, DENIED, 0x02),
    "ask": (P, 403, DENIED, 0x02),
    "no_approver": (P, 403, DENIED, 0x02),
    "ask_refused": (P, 403, DENIED, 0x02),
    "ask_timeout": (P, 403, DENIED, 0x02),
    "needs_inspection": (P, 403, DENIED, 0x02),
    "sni_mismatch": (P, 403, DENIED, 0x02),
    "not_http": (P, 403, DENIED, 0x02),
    "websocket": (P, 403, DENIED, 0x02),
    "secret_exfiltration": (P, 403, DENIED, 0x02),
    "proxy_auth_required": (X, 407, DENIED, 0x01),
    "bad_request": (X, 400, "http_request_error", 0x01),
    "host_mismatch": (X, 400, "http_request_error", 0x01),
    "rate_limited": (X, 429, "connection_limit_reached", 0x01),
    "connection_limit": (X, 429, "connection_limit_reached", 0x01),
    "overloaded": (X, 503, "connection_limit_reached", 0x01),
    "internal_error": (X, 500, "proxy_internal_error", 0x01),
    "audit_unavailable": (X, 503, "proxy_internal_error", 0x01),
    "response_too_large": (X, 502, "http_response_body_size", 0x01),
    "upstream_proxy_refused": (X, 502, "connection_refused", 0x01),
    "dns_error": (F, 502, "dns_error", 0x04),
    "dns_timeout": (F, 502, "dns_timeout", 0x04),
    "connect_refused": (F, 502, "connection_refused", 0x05),
    "connect_timeout": (F, 504, "connection_timeout", 0x06),
    "connect_error": (F, 502, "destination_unavailable", 0x01),
    "upstream_timeout": (F, 504, "http_response_timeout", 0x01),
    "upstream_protocol_error": (F, 502, "http_protocol_error", 0x01),
    "upstream_tls_error": (F, 502, "tls_certificate_error", 0x01),
    "upstream_proxy_unreachable": (F, 502, "destination_unavailable", 0x01),
}


def test_the_registry_is_exactly_the_documented_codes() -> None:
    assert {reason.value for reason in Reason} == set(MEANING)


@pytest.mark.parametrize("code", sorted(MEANING))
def test_each_code_means_the_same_on_every_surface(code: str) -> None:
    kind, status, error, socks = MEANING[code]
    reason = Reason(code)
    meaning = (reason.kind.value, reason.status, reason.proxy_status, reason.socks)
    assert meaning == (kind, status, error, socks)
    assert reason == code and f"{reason}" == code  # records and headers carry the bare code
    assert is_network_failure(code) is (kind == F) and reason.failure is (kind == F)
    if kind == A:
        return
    refusal = Refusal(code, "a detail", "h.test", 443)
    answer = http_response(refusal)
    head = answer.split(b"\r\n\r\n", 1)[0].decode()
    assert head.startswith(f"HTTP/1.1 {status} ")
    assert head.split("\r\n", 1)[0].endswith(f"by egressd: {code}")
    assert dict(headers(refusal))["Proxy-Status"].startswith(f"egressd; error={error}; ")
    assert f"X-Egressd-Reason: {code}\r\n" in head
    assert socks_reply(reason) == bytes([0x05, socks, 0x00, 0x01, 0, 0, 0, 0, 0, 0])
    said = body(refusal)
    assert said.startswith("egressd could not get an answer" if kind == F else "egressd refused")
    assert ("This is a policy decision" in said) is (kind == P)


TYPOS = ["not_alowlisted", "Not_Allowlisted", "not_allowlisted ", "", "dns-error", "allowed", "other"]


@pytest.mark.parametrize("typo", TYPOS)
def test_a_code_the_registry_does_not_know_cannot_be_made(typo: str) -> None:
    """A misspelt reason is an error where it is made, never a new label, page or reply."""
    with pytest.raises(ValueError):
        Reason(typo)
    with pytest.raises(ValueError):
        Reason.of(typo)
    with pytest.raises(ValueError):
        Refusal(typo, "detail", "h.test", 443)
    with pytest.raises(ValueError):
        Decision(False, typo, None, None)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        socks_reply(typo)  # type: ignore[arg-type]
    with pytest.raises(ValueError):  # nor recorded: no audit line, metric or notice gets it
        pipeline = Pipeline(PolicyHolder(default_policy()))
        pipeline.refused_early(None, "h.test", 443, typo, "x", stage="request")  # type: ignore[arg-type]
    assert Reason.parse(typo) is None  # a record of another version is read as unknown, not raised on
    assert not is_network_failure(typo)


def test_refusals_and_decisions_carry_the_member() -> None:
    assert Refusal("dns_error", "x").reason is Reason.DNS_ERROR
    assert Decision(False, "denylist", None, None).reason is Reason.DENYLIST  # type: ignore[arg-type]


def test_metrics_count_every_code_under_its_own_name() -> None:
    """Every code the registry has is its own label value (`granted` was once counted as other)."""
    metrics = Metrics(mode=lambda: "enforce")
    for reason in Reason:
        allowed = reason.kind is Kind.ALLOW
        metrics.observe(Decided("c", None, None, "request", "h.test", 80, allowed, reason, None, ""))
    counted = {
        (s.labels["reason"], s.labels["decision"]): s.value
        for family in text_string_to_metric_families(metrics.render().decode())
        for s in family.samples
        if s.name == "egressd_decisions_total"
    }
    assert counted == {
        (reason.value, "allow" if reason.kind is Kind.ALLOW else "deny"): 1.0 for reason in Reason
    }


@pytest.mark.parametrize(
    ("code", "allowed", "said"),
    [("dns_error", False, "failed"), ("denylist", False, "refused"), ("allowlist", True, "allowed")],
)
def test_the_control_api_says_failed_for_a_network_failure(code: str, allowed: bool, said: str) -> None:
    """`egressd watch` and the dashboard read the events of the control API: a network failure is
    `failed` there too, never `refused`."""
    from egressd.control.app import event_json

    event = Decided("c", None, None, "connection", "h.test", 443, allowed, Reason(code), None, "")
    assert event_json(event)["outcome"] == said


def test_the_docs_list_every_code() -> None:
    """docs/refusals.md has a row per code; the network failures it names are the failure kind."""
    text = (DOCS / "refusals.md").read_text()
    listed = set(re.findall(r"^\| `([a-z_]+)` \|", text, re.MULTILINE))
    assert listed == set(MEANING), set(MEANING) ^ listed
    failures = {code for code, (kind, *_rest) in MEANING.items() if kind == F}
    sentence = text.split("A network failure —", 1)[1].split("— is no refusal", 1)[0]
    assert set(re.findall(r"`([a-z_]+)`", sentence)) == failures
