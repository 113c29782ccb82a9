"""Name resolution with dnspython: one lookup per connection, bounded in time.

egressd never lets the operating system (or mitmproxy) resolve a name behind its back: the addresses
returned here are classified by the policy and then they are the only ones connected to.
"""

from __future__ import annotations

import asyncio
import ipaddress
from collections.abc import Sequence

import dns.asyncresolver
import dns.exception
import dns.nameserver
import dns.rdatatype
import dns.resolver

from egressd.policy import IPAddress


class ResolveError(Exception):
    """Resolution failed; reason is dns_error or dns_timeout."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason
        self.detail = detail


def make_resolver(nameservers: Sequence[tuple[str, int]], timeout: float) -> dns.asyncresolver.Resolver:
    if nameservers:
        resolver = dns.asyncresolver.Resolver(configure=False)
        resolver.nameservers = [dns.nameserver.Do53Nameserver(ip, port) for ip, port in nameservers]
    else:
        resolver = dns.asyncresolver.Resolver()
    resolver.lifetime = timeout
    # a lost UDP packet is retried within the lifetime instead of using all of it up
    resolver.timeout = min(timeout, max(0.5, timeout / 4))
    resolver.cache = None
    return resolver


async def resolve(name: str, nameservers: Sequence[tuple[str, int]], timeout: float) -> list[IPAddress]:
    """A and AAAA for name, IPv4 first, answer order kept; raises ResolveError."""
    resolver = make_resolver(nameservers, timeout)
    results = await asyncio.gather(
        _query(resolver, name, dns.rdatatype.A),
        _query(resolver, name, dns.rdatatype.AAAA),
    )
    addresses: list[IPAddress] = []
    errors: list[ResolveError] = []
    for result in results:
        if isinstance(result, ResolveError):
            errors.append(result)
        else:
            addresses.extend(result)
    if addresses:
        return addresses
    if any(e.reason == "dns_timeout" for e in errors):
        raise next(e for e in errors if e.reason == "dns_timeout")
    if errors:
        raise errors[0]
    raise ResolveError("dns_error", f"{name}: no A or AAAA records")


async def _query(
    resolver: dns.asyncresolver.Resolver, name: str, rdtype: dns.rdatatype.RdataType
) -> list[IPAddress] | ResolveError:
    try:
        answer = await resolver.resolve(name, rdtype, search=False, raise_on_no_answer=False)
    except dns.resolver.NXDOMAIN:
        return ResolveError("dns_error", f"{name}: no such host (NXDOMAIN)")
    except dns.resolver.LifetimeTimeout:
        return ResolveError("dns_timeout", f"{name}: no DNS answer within {resolver.lifetime:g}s")
    except dns.resolver.NoNameservers as e:
        return ResolveError("dns_error", f"{name}: DNS server failure ({_short(e)})")
    except dns.exception.DNSException as e:
        return ResolveError("dns_error", f"{name}: {_short(e)}")
    out: list[IPAddress] = []
    if answer.rrset is not None:
        for rdata in answer.rrset:
            out.append(ipaddress.ip_address(rdata.address))
    return out


def _short(exc: Exception) -> str:
    text = str(exc) or type(exc).__name__
    return text if len(text) < 200 else text[:197] + "..."
