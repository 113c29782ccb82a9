"""Bypass corpus, pure core: the same spellings through `decide` (what `egressd check` answers), and
table tests of the address classes a spelling can hide behind.

Why: the proxy, SOCKS and `egressd check` must agree (one decision function); and each way an
address can hide (an IPv6 form that carries it, a range Python calls global) gets a table that pins
egressd/policy/addresses.py down without a network.
"""

from __future__ import annotations

import ipaddress

import pytest
import yaml

from egressd.policy import (
    AddressClass,
    Client,
    TargetError,
    classify,
    decide,
    filter_addresses,
    make_target,
    normalise_path,
    parse_policy,
    parse_target,
)
from egressd.policy.addresses import embedded_ipv4_candidates
from tests.support.spellings import ALLOW, CASES, INVALID, POLICY, Case

F, L, P, G = AddressClass.FORBIDDEN, AddressClass.LOOPBACK, AddressClass.PRIVATE, AddressClass.GLOBAL
ip = ipaddress.ip_address

# -- the spelling corpus through the pure function ------------------------------------------------
CORPUS_POLICY = parse_policy(yaml.safe_load(POLICY), "corpus.yaml")


@pytest.mark.parametrize("case", CASES, ids=[f"{x.expect}:{x.host[:40]}" for x in CASES])
def test_check_agrees_with_the_proxy(case: Case) -> None:
    """`egressd check http://HOST:8080/` refuses what the proxy refuses, for the same reason."""
    decision = decide(f"http://{case.host}:8080/", Client(), CORPUS_POLICY)
    expected = {case.expect, case.also} - {None}
    if ALLOW in expected and decision.allowed:
        assert decision.reason == "allowlist"
        return
    assert not decision.allowed, (case.host, decision.reason)
    if INVALID in expected:
        # a URL reader may see another host than a request line does ("evil.test#@allowed.test" is
        # evil.test); whatever it reads, it refuses
        assert decision.reason in ("invalid_target", "not_allowlisted"), (case.host, decision.detail)
    else:
        assert decision.reason in expected, (case.host, decision.reason, decision.detail)


# -- IPv4-mapped / -compatible loopback is LOOPBACK ------------------------------------------------
@pytest.mark.parametrize(
    ("address", "klass"),
    [
        ("::ffff:127.0.0.1", L),
        ("::ffff:7f00:1", L),
        ("::ffff:127.8.9.10", L),
        ("::127.0.0.1", L),
        ("::ffff:169.254.169.254", F),
        ("::ffff:0.0.0.0", F),
        ("::ffff:10.0.0.1", P),
        ("::ffff:198.51.100.1", P),
        ("::ffff:8.8.8.8", G),
        ("::8.8.8.8", G),
        ("64:ff9b::7f00:1", P),  # behind a translator: never LOOPBACK
        ("2002:7f00:1::1", P),
    ],
)
def test_mapped_and_compatible_take_the_ipv4_class(address: str, klass: AddressClass) -> None:
    assert classify(ip(address)) is klass


def test_name_resolving_to_mapped_loopback_obeys_loopback_rules() -> None:
    """::ffff:127.0.0.1 is loopback, not private: taken for private, private.allow would skip
    loopback.allow, loopback.ports and the check for egressd's own port, and reach 127.0.0.1."""
    policy = parse_policy(
        {"version": 1, "allow": ["*.lan.test"], "private": {"allow": True}, "loopback": {"allow": False}},
        "t.yaml",
    )
    decision = decide("x.lan.test:8080", Client(), policy)
    assert decision.allowed and decision.needs_resolution
    for answer in ("127.0.0.1", "::ffff:127.0.0.1", "::ffff:7f00:1", "::127.0.0.1", "::1"):
        kept, verdicts = filter_addresses(decision, [ip(answer)], policy)
        assert kept == [], (answer, verdicts)
    # egressd's own listener, loopback allowed: still refused in the mapped spelling
    open_policy = parse_policy({"version": 1, "allow": ["*.lan.test"], "private": {"allow": True}}, "t.yaml")
    own = decide("x.lan.test:8080", Client(), open_policy, self_addresses=[(ip("127.0.0.1"), 8080)])
    kept, verdicts = filter_addresses(own, [ip("::ffff:127.0.0.1")], open_policy)
    assert kept == [] and "own listening address" in verdicts[0].why


# -- SIIT "IPv4-translated" addresses embed IPv4 too -----------------------------------------------
@pytest.mark.parametrize(
    ("address", "klass", "embedded"),
    [
        ("::ffff:0:a9fe:a9fe", F, "169.254.169.254"),
        ("::ffff:0:0:0", F, "0.0.0.0"),
        ("::ffff:0:7f00:1", P, "127.0.0.1"),
        ("::ffff:0:a00:1", P, "10.0.0.1"),
        ("::ffff:0:808:808", G, "8.8.8.8"),
    ],
)
def test_siit_translated_addresses(address: str, klass: AddressClass, embedded: str) -> None:
    assert embedded_ipv4_candidates(ip(address)) == (ip(embedded),)
    assert classify(ip(address)) is klass


def test_siit_metadata_literal_is_refused_whatever_the_policy() -> None:
    everything = parse_policy(
        {"version": 1, "mode": "allow", "allow": ["::/0", "0.0.0.0/0"], "private": {"allow": True}}, "t.yaml"
    )
    decision = decide("[::ffff:0:169.254.169.254]:80", Client(), everything)
    assert (decision.allowed, decision.reason) == (False, "forbidden_address")


# -- local-use NAT64 (64:ff9b:1::/48) with a /56 or /64 site prefix --------------------------------
@pytest.mark.parametrize(
    ("address", "klass"),
    [
        ("64:ff9b:1:12a9:fe:a9fe::", F),  # /56 prefix 64:ff9b:1:12::/56, metadata
        ("64:ff9b:1:1234:a9:fea9:fe00:0", F),  # /64 prefix 64:ff9b:1:1234::/64, metadata
        ("64:ff9b:1:1234:7f:0:100::", P),  # /64, loopback: private, never loopback
        ("64:ff9b:1::a9fe:a9fe", F),  # /96 (unchanged)
        ("64:ff9b:1:a9fe:a9:fe00::", F),  # /48 (unchanged)
        ("64:ff9b:1::808:808", P),  # /96 of 8.8.8.8: the prefix is local-use, so private
    ],
)
def test_local_use_nat64_layouts(address: str, klass: AddressClass) -> None:
    assert classify(ip(address)) is klass


def test_local_use_nat64_suffix_rule() -> None:
    """A layout counts only when its suffix is zero: /96 addresses do not grow /56 or /64 readings."""
    assert embedded_ipv4_candidates(ip("64:ff9b:1::102:304")) == (ip("1.2.3.4"),)


# -- IPv6 ranges Python 3.12's ipaddress still calls global ----------------------------------------
@pytest.mark.parametrize("address", ["3fff::1", "3fff:fff:ffff::1", "5f00::1"])
def test_documentation_and_srv6_ranges_are_private(address: str) -> None:
    assert classify(ip(address)) is P


def test_parse_target_refuses_what_it_cannot_read() -> None:
    for text in ("http://allowed.test@evil.test/", "http://allowed.test\\@evil.test/", "http://[::1%25lo]/"):
        with pytest.raises(TargetError):
            parse_target(text)


# -- raw non-UTF-8 bytes in a request path (fuzz/fuzz_request_head.py's) ---------------------------
@pytest.mark.parametrize(
    ("raw", "normal"),
    [
        ("/\udc89x", "/%89x"),  # mitmproxy's surrogate escape of the raw byte 0x89
        ("/pkg/\udcff/", "/pkg/%FF/"),
        ("/é", "/%C3%A9"),
        ("/\ud800", None),  # a lone surrogate is no byte at all: unreadable
    ],
)
def test_path_with_raw_bytes_is_normalised_not_an_internal_error(raw: str, normal: str | None) -> None:
    assert normalise_path(raw) == normal
    policy = parse_policy(
        {"version": 1, "allow": [{"host": "allowed.test", "paths": ["/pkg/"]}, "other.test"]}, "t.yaml"
    )
    for host in ("allowed.test", "other.test"):
        decision = decide(make_target(host, 80, scheme="http", path=raw, method="GET"), Client(), policy)
        assert decision.reason != "internal_error", decision.detail
    inside = decide(
        make_target("allowed.test", 80, scheme="http", path="/pkg/\udcff/x", method="GET"), Client(), policy
    )
    assert inside.allowed
