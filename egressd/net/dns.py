"""Name resolution with dnspython: one lookup per connection, bounded in time.

egressd never lets the operating system (or mitmproxy) resolve a name behind its back: the addresses
returned here are classified by the policy and then they are the only ones connected to.

Lookups of one name that are in flight at the same moment share one DNS query per record type (a
burst of connections to one host must not become a burst of queries). Nothing is kept once the
query is answered: the next connection asks again.

A query is asked again (the next nameserver first) every quarter of dns_timeout, at least 0.5 s, when
no answer came, and the earlier tries keep listening: the first answer of any try counts, so a
nameserver that answers slower than one try's share still answers in time. The query ends at
dns_timeout, never later.
"""

from __future__ import annotations

import asyncio
import copy
import errno
import ipaddress
from collections.abc import Sequence

import dns._features

# egressd asks nameservers over plain DNS (UDP, TCP) only: dnspython's DNS-over-HTTPS and DNS-over-QUIC
# transports would import httpx and h2 (or aioquic) with it, ~0.1 s of CPU for code never used here.
# Before the first import of dns.query, which decides once (dnspython's documented workaround).
dns._features.force("doh", False)
dns._features.force("doq", False)

import dns.asyncbackend  # noqa: E402
import dns.asyncresolver  # noqa: E402
import dns.exception  # noqa: E402
import dns.nameserver  # noqa: E402
import dns.rdata  # noqa: E402
import dns.rdataclass  # noqa: E402
import dns.rdatatype  # noqa: E402
import dns.resolver  # noqa: E402

from egressd.policy import IPAddress  # noqa: E402
from egressd.policy.reasons import Reason  # noqa: E402

MAX_TRIES = 4  # tries of one query in flight at once (a slow nameserver keeps each busy)
_OUT_OF_DESCRIPTORS = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)


class ResolveError(Exception):
    """Resolution failed; reason is dns_error or dns_timeout (overloaded: egressd had no socket
    left to ask with)."""

    def __init__(self, reason: Reason, detail: str) -> None:
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
    resolver.timeout = timeout
    resolver.cache = None
    return resolver


def load() -> None:
    """Import now what a lookup would import on first use: the asyncio backend and the record
    types an answer to A or AAAA carries (egressd.admission.resolve loads this at start)."""
    dns.asyncbackend.set_default_backend("asyncio")  # no sniffing of the running loop either
    for rdtype in ("A", "AAAA", "CNAME", "DNAME", "NS", "SOA", "OPT"):
        dns.rdata.get_rdata_class(dns.rdataclass.IN, dns.rdatatype.from_text(rdtype))


def retry_interval(timeout: float) -> float:
    """How long a try waits for its answer alone before the next try joins it."""
    return min(timeout, max(0.5, timeout / 4))


async def resolve(name: str, nameservers: Sequence[tuple[str, int]], timeout: float) -> list[IPAddress]:
    """A and AAAA for name, IPv4 first, answer order kept; raises ResolveError."""
    servers = tuple(nameservers)
    results = await asyncio.gather(
        _shared_query(name, dns.rdatatype.A, servers, timeout),
        _shared_query(name, dns.rdatatype.AAAA, servers, timeout),
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
    for reason in (Reason.OVERLOADED, Reason.DNS_TIMEOUT):  # what a retry may cure comes first
        if any(e.reason == reason for e in errors):
            raise next(e for e in errors if e.reason == reason)
    if errors:
        raise errors[0]
    raise ResolveError(Reason.DNS_ERROR, f"{name}: no A or AAAA records")


# the query in flight per (event loop, name, record type, nameservers, timeout): a waiter joins it
_QueryKey = tuple[asyncio.AbstractEventLoop, str, int, tuple[tuple[str, int], ...], float]
_in_flight: dict[_QueryKey, asyncio.Future[list[IPAddress] | ResolveError]] = {}


async def _shared_query(
    name: str, rdtype: dns.rdatatype.RdataType, nameservers: tuple[tuple[str, int], ...], timeout: float
) -> list[IPAddress] | ResolveError:
    """The answer of the query for (name, rdtype) in flight now, or of a new one.

    Keyed by the nameservers and timeout too (a reload that changes them starts a new query) and
    by the loop (a future belongs to one). A waiter that is cancelled does not cancel the query
    the others wait for (shield); the query ends within its own lifetime either way."""
    key: _QueryKey = (asyncio.get_running_loop(), name, int(rdtype), nameservers, timeout)
    query = _in_flight.get(key)
    if query is None:
        query = asyncio.ensure_future(_query(make_resolver(nameservers, timeout), name, rdtype))
        if not query.done():  # an eager task may already have finished: nothing to share then
            _in_flight[key] = query
            query.add_done_callback(lambda done: _forget(key, done))
    return await asyncio.shield(query)


def _forget(key: _QueryKey, done: asyncio.Future[list[IPAddress] | ResolveError]) -> None:
    if _in_flight.get(key) is done:
        del _in_flight[key]


async def _query(
    resolver: dns.asyncresolver.Resolver, name: str, rdtype: dns.rdatatype.RdataType
) -> list[IPAddress] | ResolveError:
    """The first answer of staggered tries (see the module's docstring), or why there was none
    within the resolver's lifetime (dns_timeout)."""
    loop = asyncio.get_running_loop()
    lifetime = float(resolver.lifetime)
    start = loop.time()
    deadline = start + lifetime
    interval = retry_interval(lifetime)
    servers = list(resolver.nameservers)
    tries: set[asyncio.Future[list[IPAddress] | ResolveError | None]] = set()
    started = 0
    try:
        while (now := loop.time()) < deadline:
            if started < MAX_TRIES and now >= start + started * interval:
                one = copy.copy(resolver)  # the next nameserver first: a silent one holds up no try
                shift = started % len(servers) if servers else 0
                one.nameservers = servers[shift:] + servers[:shift]
                tries.add(asyncio.ensure_future(_try(one, name, rdtype, deadline - now)))
                started += 1
            wake = min(deadline, start + started * interval) if started < MAX_TRIES else deadline
            if not tries:  # every try heard nothing (their clock ran out a moment before ours)
                await asyncio.sleep(wake - now)
                continue
            done, tries = await asyncio.wait(tries, timeout=wake - now, return_when=asyncio.FIRST_COMPLETED)
            for finished in done:
                if (outcome := finished.result()) is not None:
                    return outcome
        return ResolveError(Reason.DNS_TIMEOUT, f"{name}: no DNS answer within {lifetime:g}s")
    finally:
        for pending in tries:
            pending.cancel()


async def _try(
    resolver: dns.asyncresolver.Resolver, name: str, rdtype: dns.rdatatype.RdataType, budget: float
) -> list[IPAddress] | ResolveError | None:
    """One try: the answer, a definite failure (NXDOMAIN, every nameserver failed), or None when
    it heard nothing within its budget (another try may)."""
    resolver.lifetime = resolver.timeout = budget
    try:
        answer = await resolver.resolve(name, rdtype, search=False, raise_on_no_answer=False)
    except dns.resolver.NXDOMAIN:
        return ResolveError(Reason.DNS_ERROR, f"{name}: no such host (NXDOMAIN)")
    except dns.resolver.LifetimeTimeout:
        return None
    except dns.resolver.NoNameservers as e:
        if any(_out_of_descriptors(error) for *_, error, _ in e.kwargs.get("errors") or ()):
            return ResolveError(Reason.OVERLOADED, f"{name}: no socket left to ask the nameserver")
        return ResolveError(Reason.DNS_ERROR, f"{name}: DNS server failure ({_short(e)})")
    except dns.exception.DNSException as e:
        return ResolveError(Reason.DNS_ERROR, f"{name}: {_short(e)}")
    except OSError as e:
        if _out_of_descriptors(e):
            return ResolveError(Reason.OVERLOADED, f"{name}: no socket left to ask the nameserver")
        return ResolveError(Reason.DNS_ERROR, f"{name}: {_short(e)}")
    out: list[IPAddress] = []
    if answer.rrset is not None:
        for rdata in answer.rrset:
            out.append(ipaddress.ip_address(rdata.address))
    return out


def _out_of_descriptors(error: object) -> bool:
    return isinstance(error, OSError) and error.errno in _OUT_OF_DESCRIPTORS


def _short(exc: Exception) -> str:
    text = str(exc) or type(exc).__name__
    return text if len(text) < 200 else text[:197] + "..."
