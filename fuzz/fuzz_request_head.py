"""Fuzz request-head parsing as the proxy does it: egressd's HTTP/1 reader, then its decision.

The input is the bytes a client sends to egressd's HTTP port. They go through what the front does
with a plain-HTTP request, in process and without sockets: `egressd.wire.http1.ClientSide` (the
strict raw-head guard, then its one parse of the head), the decision
(`egressd.admission.decide.Decider`) and the Host check of the request rules. Properties:
- nothing raises but the WireError egressd answers with 400;
- an allowed request names the allowed host (the policy: ``allowed.test`` and 198.51.100.1), and
  the same host as the C library reads it (inet_aton) — never another;
- a Host header that passed egressd's check names the same host and port as the target.

    .venv/bin/python fuzz/fuzz_request_head.py -max_total_time=600    # a long run
"""

from __future__ import annotations

import socket
from ipaddress import IPv4Address

from _common import instrumented, main

with instrumented():
    from egressd.admission.decide import Decider
    from egressd.admission.http_rules import host_header_mismatch
    from egressd.admission.in_force import PolicyHolder
    from egressd.policy import TargetError, canonical_host, parse_policy
    from egressd.wire.http1 import ClientSide, RequestHead, WireError
    from tests.support import reference as ref

POLICY = parse_policy(
    {"version": 1, "allow": ["allowed.test", "198.51.100.1"], "loopback": {"allow": False}}, "fuzz"
)
DECIDER = Decider(PolicyHolder(POLICY))
ALLOWED_IP = IPv4Address("198.51.100.1")


def _read(data: bytes) -> RequestHead | None:
    """The request head egressd's front reads from these bytes, or None where it answers 400 / waits."""
    try:
        events = ClientSide().receive(data)
    except WireError:
        return None
    heads = [e for e in events if isinstance(e, RequestHead)]
    return heads[0] if heads else None


def test_one_input(data: bytes) -> None:
    request = _read(data)
    if request is None:
        return
    decision = DECIDER.decide(
        request.host, request.port, None, scheme=request.scheme, method=request.method, path=request.path
    )
    assert decision.reason != "internal_error", decision.detail
    if not decision.allowed:
        return
    target = decision.target
    assert target is not None
    if host_header_mismatch(request.values("host"), target) is not None:
        return  # refused with 400 host_mismatch
    if target.host.ip is not None:
        assert ref.folded(target.host.ip) == ALLOWED_IP, (data, target)
    else:
        assert target.host.name == "allowed.test" or str(target.host.name).endswith(".allowed.test"), target
    if all(c in "0123456789abcdefxX." for c in request.host) and request.host:
        try:
            libc = IPv4Address(socket.inet_aton(request.host))
        except OSError:
            pass
        else:
            assert target.host.ip == libc, (request.host, libc, target)
    for header in request.values("host"):
        value = header.strip(" \t")
        host, _, port = value.rpartition(":") if value.count(":") == 1 or "]:" in value else (value, "", "")
        try:
            assert canonical_host(host) == target.host, (header, target)
        except TargetError as exc:
            raise AssertionError(f"Host header {header!r} accepted by egressd, unreadable: {exc}") from None
        if port:
            assert int(port) == target.port, (header, target)


if __name__ == "__main__":
    main(test_one_input, "request_head")
