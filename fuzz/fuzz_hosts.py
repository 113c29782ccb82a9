"""Fuzz host canonicalisation, target parsing and the decision on the result.

Properties checked for every input (the text is read as UTF-8, undecodable bytes replaced):
- canonical_host / parse_target / make_target raise nothing but TargetError, and canonical_host is
  idempotent (its output reads back as itself, bare and bracketed);
- a spelling the C library's inet_aton reads as an address is the same address to egressd, never a
  name sent to DNS;
- under an allow-everything policy, nothing the independent reference (tests/support/reference.py)
  classifies as always-refused is allowed; under a one-name, one-address policy, nothing else is.

    .venv/bin/python fuzz/fuzz_hosts.py -max_total_time=600          # a long run
"""

from __future__ import annotations

import contextlib
import socket
from ipaddress import IPv4Address

from _common import instrumented, main

with instrumented():
    from egressd.policy import (
        Client,
        TargetError,
        canonical_host,
        decide,
        make_target,
        parse_policy,
        parse_target,
    )
    from tests.support import reference as ref

EVERYTHING = parse_policy(
    {"version": 1, "mode": "allow", "allow": ["0.0.0.0/0", "::/0"], "private": {"allow": True}}, "everything"
)
NARROW = parse_policy(
    {"version": 1, "allow": ["allowed.test", "198.51.100.1"], "loopback": {"allow": False}}, "narrow"
)
ALLOWED_IP = IPv4Address("198.51.100.1")


def _check_host(text: str) -> None:
    try:
        host = canonical_host(text)
    except TargetError:
        return
    assert canonical_host(host.text) == host, (text, host)
    assert canonical_host(host.url_host()) == host, (text, host)
    if host.name is not None:
        assert host.name == host.name.lower() and host.name.isascii() and len(host.name) <= 253, host
        assert not host.name.endswith("."), host
    if text.isascii() and text and all(c in "0123456789abcdefxX." for c in text):
        try:
            libc = IPv4Address(socket.inet_aton(text))
        except OSError:
            return
        assert host.ip == libc, (text, libc, host)


def _check_decisions(target: str) -> None:
    everything = decide(target, Client(), EVERYTHING)
    assert everything.reason != "internal_error", everything.detail
    if everything.allowed and everything.target is not None and everything.target.host.ip is not None:
        assert ref.classify(everything.target.host.ip) is not ref.Klass.FORBIDDEN, (target, everything)
    narrow = decide(target, Client(), NARROW)
    assert narrow.reason != "internal_error", narrow.detail
    if narrow.allowed:
        assert narrow.target is not None
        host = narrow.target.host
        if host.ip is not None:
            assert ref.folded(host.ip) == ALLOWED_IP, (target, host)
        else:
            assert host.name == "allowed.test" or str(host.name).endswith(".allowed.test"), (target, host)


def test_one_input(data: bytes) -> None:
    text = data.decode("utf-8", "replace")
    _check_host(text)
    for parse in (parse_target, lambda t: make_target(t, 443)):
        with contextlib.suppress(TargetError):  # anything else propagates: a finding
            parse(text)
    _check_decisions(text)
    _check_decisions(f"{text}:443")
    _check_decisions(f"http://{text}/")


if __name__ == "__main__":
    main(test_one_input, "hosts")
