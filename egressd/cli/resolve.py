"""Synchronous resolution for `egressd check --resolve` only.

The proxy resolves asynchronously in `egressd.net.dns`; `check` is a one-shot command, so a tiny
blocking lookup with the same rules (A + AAAA, one deadline, the policy's nameservers) is
clearer than running an event loop for one name.
"""

from __future__ import annotations

import ipaddress
import time
from collections.abc import Sequence

import dns.exception
import dns.nameserver
import dns.resolver

from egressd.policy.reasons import Reason

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address


class ResolveError(Exception):
    """Resolution failed; `reason` is `dns_error` or `dns_timeout` (the proxy's codes)."""

    def __init__(self, reason: Reason, message: str) -> None:
        super().__init__(message)
        self.reason = reason


def resolve_sync(
    name: str, *, nameservers: Sequence[tuple[str, int]] = (), timeout: float = 5.0
) -> list[IPAddress]:
    """A and AAAA addresses of `name` within `timeout` seconds in total (no search domains)."""
    try:
        resolver = dns.resolver.Resolver(configure=not nameservers)
    except dns.resolver.NoResolverConfiguration as exc:
        raise ResolveError(Reason.DNS_ERROR, f"no system resolver configuration: {exc}") from None
    if nameservers:
        resolver.nameservers = [dns.nameserver.Do53Nameserver(ip, port) for ip, port in nameservers]
    deadline = time.monotonic() + timeout
    found: list[IPAddress] = []
    answered = False
    for rdtype in ("A", "AAAA"):
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise ResolveError(Reason.DNS_TIMEOUT, f"{name}: no answer within {timeout:g}s")
        try:
            answer = resolver.resolve(
                name, rdtype, lifetime=remaining, search=False, raise_on_no_answer=False
            )
        except dns.resolver.NXDOMAIN:
            raise ResolveError(Reason.DNS_ERROR, f"{name}: no such name (NXDOMAIN)") from None
        except dns.resolver.LifetimeTimeout:
            raise ResolveError(Reason.DNS_TIMEOUT, f"{name}: no answer within {timeout:g}s") from None
        except dns.exception.DNSException as exc:
            raise ResolveError(Reason.DNS_ERROR, f"{name}: {exc}") from None
        answered = True
        for record in answer:
            found.append(ipaddress.ip_address(record.address))
    if answered and not found:
        raise ResolveError(Reason.DNS_ERROR, f"{name}: no A or AAAA records")
    return found
