"""A real, programmable DNS server (UDP + TCP on one port) for egressd's resolver tests.

Why: egressd resolves names itself with dnspython and pins connections to the validated addresses;
the tests must control exactly what each query returns (rebinding sequences, CNAMEs, failures,
silence, oversized answers) and see every query that was made.
"""

from __future__ import annotations

import contextlib
import ipaddress
import logging
import selectors
import socket
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Self

import dns.exception
import dns.flags
import dns.message
import dns.name
import dns.rcode
import dns.rdataclass
import dns.rdatatype
import dns.rrset

log = logging.getLogger(__name__)
HOLD_LIMIT = 30.0  # s: an answer held for a retry that never comes is sent anyway

_MAX_CNAME_CHAIN = 8


def _norm(name: str) -> str:
    """Canonical key: lowercase, without the trailing dot."""
    return name.strip().rstrip(".").lower()


def _split_families(addresses: list[str] | tuple[str, ...]) -> tuple[list[str], list[str]]:
    v4: list[str] = []
    v6: list[str] = []
    for a in addresses:
        ip = ipaddress.ip_address(a)
        (v4 if ip.version == 4 else v6).append(str(ip))
    return v4, v6


def _huge_pool() -> list[str]:
    """Distinct IPv4 addresses for `huge`, the locally bound ranges first (so connecting can work)."""
    pool: list[str] = []
    for net in ("198.51.100.0/24", "203.0.113.0/24", "192.0.2.0/24", "198.18.0.0/15"):
        pool.extend(str(h) for h in ipaddress.ip_network(net).hosts())
    return pool


@dataclass
class _Entry:
    kind: str  # "static" | "sequence" | "cname" | "nxdomain" | "servfail" | "blackhole"
    v4: list[str] = field(default_factory=list)
    v6: list[str] = field(default_factory=list)
    ttl: int = 0
    sequence: list[list[str]] = field(default_factory=list)
    target: str = ""
    served: dict[str, int] = field(default_factory=dict)  # rdtype -> how many answered (sequence)
    delay: float = 0.0  # seconds before the answer is sent (queries that overlap in time)
    hold: int = 0  # and not before the name was asked this many times (of the query's type)
    first_only: bool = False  # only the first query of each type is answered; later ones get silence


class DnsServer:
    """DNS server on ``host`` (UDP and TCP, same ephemeral port) in background threads.

    Unknown names get NXDOMAIN; a known name asked for a type it has no data for gets NOERROR with an
    empty answer. Names match case-insensitively, with or without the trailing dot.
    """

    def __init__(self, host: str = "127.0.0.1", port: int = 0) -> None:
        self.host = host
        self.port = port  # 0: an ephemeral port (a fixed one for clients that only ask port 53: squid)
        self.queries: list[tuple[str, str]] = []
        #: Same as ``queries`` plus the transport: (qname, rdtype, "udp" | "tcp").
        self.query_log: list[tuple[str, str, str]] = []
        self._entries: dict[str, _Entry] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._udp: socket.socket | None = None
        self._tcp: socket.socket | None = None
        self._tcp_clients: set[socket.socket] = set()

    # -- programming -------------------------------------------------------------------------------
    def add(
        self,
        name: str,
        *addresses: str,
        ttl: int = 0,
        delay: float = 0.0,
        hold: int = 0,
        first_only: bool = False,
    ) -> None:
        """Answer A/AAAA for ``name`` with ``addresses`` (sorted by family); replaces earlier data.

        ``delay``: send each answer that many seconds after its query arrived (other queries are
        answered meanwhile), so that lookups of one name overlap in time. ``hold``: and not before
        the name was asked ``hold`` times for that type (at most HOLD_LIMIT seconds), so that a
        client's retry comes before the answer however late the client runs. ``first_only``: the
        later queries of a type (a client's retries) get no answer at all."""
        v4, v6 = _split_families(addresses)
        with self._lock:
            self._entries[_norm(name)] = _Entry(
                "static", v4=v4, v6=v6, ttl=ttl, delay=delay, hold=hold, first_only=first_only
            )

    def add_sequence(self, name: str, answers: list[list[str]], ttl: int = 0) -> None:
        """The n-th query of a type gets ``answers[min(n, len-1)]`` (of that family) — for rebinding."""
        if not answers:
            raise ValueError("answers must not be empty")
        for a in answers:
            _split_families(a)  # validate early
        with self._lock:
            self._entries[_norm(name)] = _Entry("sequence", sequence=[list(a) for a in answers], ttl=ttl)

    def add_cname(self, name: str, target: str, ttl: int = 0) -> None:
        """``name`` is a CNAME for ``target``; the chain is followed within this server's data."""
        with self._lock:
            self._entries[_norm(name)] = _Entry("cname", target=_norm(target), ttl=ttl)

    def nxdomain(self, name: str) -> None:
        """Answer NXDOMAIN (the default for unknown names; explicit to override earlier data)."""
        with self._lock:
            self._entries[_norm(name)] = _Entry("nxdomain")

    def servfail(self, name: str) -> None:
        """Answer SERVFAIL."""
        with self._lock:
            self._entries[_norm(name)] = _Entry("servfail")

    def blackhole(self, name: str) -> None:
        """Never answer (UDP: drop; TCP: keep the connection open, silent) — for DNS timeouts."""
        with self._lock:
            self._entries[_norm(name)] = _Entry("blackhole")

    def huge(self, name: str, count: int = 500, ttl: int = 0) -> list[str]:
        """Answer with ``count`` distinct A records (too big for UDP: TC bit, client retries on TCP).

        The first addresses are 198.51.100.1.. (locally bound), then 203.0.113.x, 192.0.2.x, 198.18/15.
        Returns the addresses in answer order.
        """
        pool = _huge_pool()
        if not 0 < count <= min(len(pool), 4000):
            raise ValueError(f"count must be in 1..{min(len(pool), 4000)}")
        addrs = pool[:count]
        with self._lock:
            self._entries[_norm(name)] = _Entry("static", v4=addrs, ttl=ttl)
        return addrs

    def remove(self, name: str) -> None:
        """Forget ``name`` (it answers NXDOMAIN again)."""
        with self._lock:
            self._entries.pop(_norm(name), None)

    def count(self, name: str, rdtype: str | None = None) -> int:
        """How many queries (of ``rdtype``, or any type) were received for ``name``."""
        key = _norm(name)
        with self._lock:
            return sum(1 for q, t in self.queries if q == key and (rdtype is None or t == rdtype.upper()))

    def clear_log(self) -> None:
        """Forget the query log."""
        with self._lock:
            self.queries.clear()
            self.query_log.clear()

    # -- lifecycle ---------------------------------------------------------------------------------
    @property
    def address(self) -> tuple[str, int]:
        return (self.host, self.port)

    @property
    def nameserver(self) -> str:
        """``IP:PORT`` as egressd's ``--nameserver``/``resolver.nameservers`` take it."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"

    def start(self) -> Self:
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        last_error: OSError | None = None
        for _attempt in range(50 if not self.port else 1):
            udp = socket.socket(family, socket.SOCK_DGRAM)
            udp.bind((self.host, self.port))
            port = udp.getsockname()[1]
            tcp = socket.socket(family, socket.SOCK_STREAM)
            tcp.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                tcp.bind((self.host, port))
            except OSError as exc:  # TCP port taken: try another UDP port
                last_error = exc
                udp.close()
                tcp.close()
                continue
            tcp.listen(64)
            self._udp, self._tcp, self.port = udp, tcp, port
            break
        else:
            raise RuntimeError(f"no common UDP/TCP port found on {self.host}: {last_error}")
        self._stop.clear()
        for target, tname in ((self._serve_udp, "udp"), (self._serve_tcp, "tcp")):
            t = threading.Thread(target=target, name=f"dns-{tname}-{self.port}", daemon=True)
            t.start()
            self._threads.append(t)
        return self

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=5)
        self._threads.clear()
        with self._lock:
            clients = list(self._tcp_clients)
        for c in clients:
            _close(c)
        for s in (self._udp, self._tcp):
            if s is not None:
                _close(s)
        self._udp = self._tcp = None

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- answering ---------------------------------------------------------------------------------
    def _answer(
        self, wire: bytes, transport: str
    ) -> tuple[dns.message.Message | None, int, Callable[[], None] | None]:
        """The response to ``wire`` (None: stay silent), the client's UDP size limit, and what to
        wait for before sending it (None: send now)."""
        try:
            query = dns.message.from_wire(wire)
        except dns.exception.DNSException as exc:
            log.debug("bad query: %s", exc)
            return None, 512, None
        limit = max(query.payload, 512) if query.edns >= 0 else 512
        return self._respond(query, transport), limit, self._release(query)

    def _release(self, query: dns.message.Message) -> Callable[[], None] | None:
        if not query.question:
            return None
        name = _norm(query.question[0].name.to_text())
        rdtype = dns.rdatatype.to_text(query.question[0].rdtype)
        with self._lock:
            entry = self._entries.get(name)
        if entry is None or not (entry.delay or entry.hold):
            return None
        arrived = time.monotonic()

        def wait() -> None:
            self._stop.wait(entry.delay)
            give_up = arrived + HOLD_LIMIT
            while self.count(name, rdtype) < entry.hold and time.monotonic() < give_up:
                if self._stop.wait(0.01):
                    return

        return wait

    def _respond(self, query: dns.message.Message, transport: str) -> dns.message.Message | None:
        if not query.question:
            resp = dns.message.make_response(query)
            resp.set_rcode(dns.rcode.FORMERR)
            return resp
        q = query.question[0]
        qname = _norm(q.name.to_text())
        rdtype = dns.rdatatype.to_text(q.rdtype)
        with self._lock:
            self.queries.append((qname, rdtype))
            self.query_log.append((qname, rdtype, transport))
            resp = dns.message.make_response(query)
            resp.flags |= dns.flags.RA
            name = qname
            for _hop in range(_MAX_CNAME_CHAIN):
                entry = self._entries.get(name)
                if entry is None or entry.kind == "nxdomain":
                    resp.set_rcode(dns.rcode.NXDOMAIN)
                    return resp
                if entry.kind == "servfail":
                    resp.set_rcode(dns.rcode.SERVFAIL)
                    return resp
                if entry.kind == "blackhole":
                    return None
                owner = dns.name.from_text(name)
                if entry.kind == "cname":
                    resp.answer.append(
                        dns.rrset.from_text(
                            owner, entry.ttl, dns.rdataclass.IN, dns.rdatatype.CNAME, entry.target + "."
                        )
                    )
                    if q.rdtype == dns.rdatatype.CNAME:
                        return resp
                    name = entry.target
                    continue
                if entry.first_only and sum(1 for asked in self.queries if asked == (qname, rdtype)) > 1:
                    return None  # a retry: silence
                addrs = self._addresses(entry, rdtype)
                if addrs:
                    resp.answer.append(
                        dns.rrset.from_text_list(owner, entry.ttl, dns.rdataclass.IN, q.rdtype, addrs)
                    )
                return resp
            resp.set_rcode(dns.rcode.SERVFAIL)  # CNAME loop / chain too long
            return resp

    @staticmethod
    def _addresses(entry: _Entry, rdtype: str) -> list[str]:
        if rdtype not in ("A", "AAAA"):
            return []
        if entry.kind == "sequence":
            n = entry.served.get(rdtype, 0)
            entry.served[rdtype] = n + 1
            v4, v6 = _split_families(entry.sequence[min(n, len(entry.sequence) - 1)])
        else:
            v4, v6 = entry.v4, entry.v6
        return v4 if rdtype == "A" else v6

    def _serve_udp(self) -> None:
        assert self._udp is not None
        sock = self._udp
        sel = selectors.DefaultSelector()
        sel.register(sock, selectors.EVENT_READ)
        try:
            while not self._stop.is_set():
                if not sel.select(timeout=0.1):
                    continue
                try:
                    wire, peer = sock.recvfrom(65535)
                except OSError:
                    continue
                resp, limit, release = self._answer(wire, "udp")
                if resp is None:
                    continue
                try:
                    out = resp.to_wire(max_size=limit)
                except dns.exception.TooBig:
                    resp.answer.clear()
                    resp.authority.clear()
                    resp.additional.clear()
                    resp.flags |= dns.flags.TC
                    out = resp.to_wire()
                if release is not None:
                    threading.Thread(
                        target=_send_udp_after, args=(release, sock, out, peer), daemon=True
                    ).start()
                else:
                    _send_udp(sock, out, peer)
        finally:
            sel.close()

    def _serve_tcp(self) -> None:
        assert self._tcp is not None
        sock = self._tcp
        sel = selectors.DefaultSelector()
        sel.register(sock, selectors.EVENT_READ)
        try:
            while not self._stop.is_set():
                if not sel.select(timeout=0.1):
                    continue
                try:
                    conn, _peer = sock.accept()
                except OSError:
                    continue
                with self._lock:
                    self._tcp_clients.add(conn)
                threading.Thread(
                    target=self._tcp_client, args=(conn,), daemon=True, name=f"dns-tcp-client-{self.port}"
                ).start()
        finally:
            sel.close()

    def _tcp_client(self, conn: socket.socket) -> None:
        conn.settimeout(0.2)
        try:
            while not self._stop.is_set():
                header = _recv_exact(conn, 2, self._stop)
                if header is None:
                    return
                (length,) = struct.unpack("!H", header)
                wire = _recv_exact(conn, length, self._stop)
                if wire is None:
                    return
                resp, _limit, release = self._answer(wire, "tcp")
                if resp is None:
                    continue  # silent, keep the connection open
                if release is not None:
                    release()
                out = resp.to_wire()
                conn.sendall(struct.pack("!H", len(out)) + out)
        except OSError:
            return
        finally:
            with self._lock:
                self._tcp_clients.discard(conn)
            _close(conn)


def _send_udp_after(
    release: Callable[[], None], sock: socket.socket, out: bytes, peer: tuple[str, int]
) -> None:
    release()
    _send_udp(sock, out, peer)


def _send_udp(sock: socket.socket, out: bytes, peer: tuple[str, int]) -> None:
    try:
        sock.sendto(out, peer)
    except OSError as exc:
        log.debug("udp send to %s failed: %s", peer, exc)


def _recv_exact(conn: socket.socket, n: int, stop: threading.Event) -> bytes | None:
    buf = b""
    while len(buf) < n:
        if stop.is_set():
            return None
        try:
            chunk = conn.recv(n - len(buf))
        except TimeoutError:
            continue
        if not chunk:
            return None
        buf += chunk
    return buf


def _close(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        sock.close()
