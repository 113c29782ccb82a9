"""Inside the child's network namespace: the bridge's side of capture (see capture.py for the
rules that feed it).

- A DNS responder (UDP and TCP, on the namespace's loopback) asks egressd for each name (over the
  launcher's own socket, front/names.py) and answers with the real addresses egressd resolved and
  kept after its own guards, so a client with an SSRF guard of its own judges the real address. A
  name the policy refuses gets NXDOMAIN (egressd records why); a name only a person, a grant or the
  program could allow gets a stand-in address from 198.18.0.0/15, stable for the run, and is decided
  when a connection is made. An A query gets IPv4 addresses, an AAAA query IPv6 ones only for a name
  without IPv4 (capture is IPv4); anything else no data.
- A transparent TCP listener takes each redirected connection, recovers where the child meant to
  go (SO_ORIGINAL_DST) and hands the connection itself to egressd (SCM_RIGHTS, over the launcher's
  own socket) with the target it is decided as: the name whose answer led to that address; of
  several (a shared CDN address), the one the client's first bytes name (TLS SNI, HTTP Host, peeked
  at, never read), which egressd then holds the TLS to; a stand-in maps back to its name; an
  address no answer held stays a literal. egressd decides it as it decides a CONNECT (policy,
  audit, the SNI rule), answers a refusal in the client's own protocol and relays an allowed one
  itself: the bridge reads none of the child's bytes, holds no credentials and decides nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import itertools
import re
import socket
import struct
import time
from collections import OrderedDict
from collections.abc import Sequence

from egressd.front.relay import join
from egressd.platform.fdwait import ready
from egressd.sandbox import BRIDGE_SOURCE

SO_ORIGINAL_DST = 80  # linux/netfilter_ipv4.h
SYNTHETIC = ipaddress.IPv4Network("198.18.0.0/15")
MAX_NAMES = 65536  # a child asking for more names gets SERVFAIL, never unbounded memory
TTL = 60
MAX_NAME = 253
DNS_TCP_TIMEOUT = 30.0
LOOPBACK = ipaddress.IPv4Network("127.0.0.0/8")
# Names handed an address: hostname characters only (IDNA arrives as xn--). Anything else would
# reach egressd's decision as dnspython's escapes; refusing it here keeps the name plain.
HOSTNAME = re.compile(r"[A-Za-z0-9_-]+(\.[A-Za-z0-9_-]+)*")
HOST_HEADER = re.compile(rb"\r\nhost:[ \t]*([A-Za-z0-9_.-]+)", re.IGNORECASE)
NAMES_TIMEOUT = 4.0  # egressd's answer for a name (it resolves within its dns_timeout, 5 s by default)
MAX_DNS_IN_FLIGHT = 256
PEEK_BYTES = 16384
PEEK_TIMEOUT = 2.0  # a client that speaks first (TLS, HTTP) has by then; one that waits (SSH) goes on
Address = ipaddress.IPv4Address | ipaddress.IPv6Address


class NameTable:
    """Name <-> synthetic address, handed out in order, stable for the run."""

    def __init__(self, network: ipaddress.IPv4Network = SYNTHETIC, limit: int = MAX_NAMES) -> None:
        self._base = int(network.network_address) + 1
        self._limit = min(limit, network.num_addresses - 2)
        self._by_name: dict[str, ipaddress.IPv4Address] = {}
        self._by_address: dict[ipaddress.IPv4Address, str] = {}

    def address_for(self, name: str) -> ipaddress.IPv4Address | None:
        """The name's address (a new one the first time); None when the table is full."""
        key = name.lower().rstrip(".")
        found = self._by_name.get(key)
        if found is not None:
            return found
        if len(self._by_name) >= self._limit:
            return None
        address = ipaddress.IPv4Address(self._base + len(self._by_name))
        self._by_name[key] = address
        self._by_address[address] = key
        return address

    def name_for(self, address: ipaddress.IPv4Address) -> str | None:
        return self._by_address.get(address)


def question(wire: bytes) -> tuple[str, int] | None:
    """(name, record type) of a query egressd may answer with real addresses, else None."""
    import dns.exception
    import dns.message
    import dns.rdataclass
    import dns.rdatatype

    try:
        query = dns.message.from_wire(wire)
    except (dns.exception.DNSException, ValueError):
        return None
    if len(query.question) != 1:
        return None
    asked = query.question[0]
    name = asked.name.to_text(omit_final_dot=True)
    if asked.rdclass != dns.rdataclass.IN or asked.rdtype not in (dns.rdatatype.A, dns.rdatatype.AAAA):
        return None
    if len(name) > MAX_NAME or not HOSTNAME.fullmatch(name):
        return None
    return name.lower(), asked.rdtype


def answer(table: NameTable, wire: bytes, real: Sequence[Address] | None = None) -> bytes | None:
    """The DNS answer to one query message; None for bytes that are not a query (dropped).

    `real`: the addresses egressd resolved for the name (an A query gets its IPv4 ones, an AAAA
    query its IPv6 ones when it has no IPv4: capture is IPv4); [] for a name the policy refuses
    (NXDOMAIN); None: a stand-in address."""
    import dns.exception
    import dns.flags
    import dns.message
    import dns.rcode
    import dns.rdataclass
    import dns.rdatatype
    import dns.rrset

    try:
        query = dns.message.from_wire(wire)
    except (dns.exception.DNSException, ValueError):
        return None
    if query.flags & dns.flags.QR:
        return None
    response = dns.message.make_response(query, recursion_available=True)
    if len(query.question) != 1:
        response.set_rcode(dns.rcode.FORMERR)
        return response.to_wire()
    asked = query.question[0]
    name = asked.name.to_text(omit_final_dot=True)
    if asked.rdclass != dns.rdataclass.IN or len(name) > MAX_NAME or not HOSTNAME.fullmatch(name):
        response.set_rcode(dns.rcode.REFUSED)
        return response.to_wire()
    v4 = [str(a) for a in real or () if a.version == 4]
    v6 = [str(a) for a in real or () if a.version == 6]
    if real is not None and not real:  # the policy refuses the name: it has no address here
        response.set_rcode(dns.rcode.NXDOMAIN)
        return response.to_wire()
    if asked.rdtype == dns.rdatatype.A:
        if real is None:
            address = table.address_for(name)
            if address is None:
                response.set_rcode(dns.rcode.SERVFAIL)
                return response.to_wire()
            v4 = [str(address)]
        if v4:
            response.answer.append(dns.rrset.from_text_list(asked.name, TTL, "IN", "A", v4))
    elif asked.rdtype == dns.rdatatype.AAAA and v6 and not v4:
        response.answer.append(dns.rrset.from_text_list(asked.name, TTL, "IN", "AAAA", v6))
    return response.to_wire()  # every other type: no data


class Names:
    """The bridge's side of egressd's names service (front/names.py), and what it answered: the
    real addresses of each name for TTL seconds, and the names each address was given for."""

    def __init__(self, sock: socket.socket | None) -> None:
        self.sock = sock
        self._writer: asyncio.StreamWriter | None = None
        self._pending: dict[str, asyncio.Future[list[Address] | None]] = {}
        self._ids = itertools.count(1)
        self._answers: dict[str, tuple[float, list[Address] | None]] = {}
        self._asking: dict[str, asyncio.Future[list[Address] | None]] = {}
        self._names: OrderedDict[Address, list[str]] = OrderedDict()

    async def start(self) -> None:
        if self.sock is not None:
            reader, self._writer = await asyncio.open_connection(sock=self.sock)
            self._reading = asyncio.create_task(self._read(reader))

    async def _read(self, reader: asyncio.StreamReader) -> None:
        with contextlib.suppress(ConnectionError, OSError, ValueError):
            while line := await reader.readline():
                ident, _, rest = line.decode("ascii", "replace").strip().partition(" ")
                waiter = self._pending.pop(ident, None)
                if waiter is None or waiter.done():
                    continue
                try:
                    words = [] if rest == "!" else rest.split()
                    found = None if rest == "-" else [ipaddress.ip_address(a) for a in words]
                except ValueError:
                    found = None
                waiter.set_result(found)
        self._writer = None

    async def lookup(self, name: str) -> list[Address] | None:
        """egressd's real addresses for name, [] when the policy refuses it, or None (a stand-in
        then). Questions for one name at the same moment (a resolver's A and AAAA) share one
        answer: two answers could differ, and the connection goes where the last one says."""
        cached = self._answers.get(name)
        if cached is not None and cached[0] > time.monotonic():
            return cached[1]
        shared = self._asking.get(name)
        if shared is None:
            shared = asyncio.ensure_future(self._ask(name))
            self._asking[name] = shared
            shared.add_done_callback(lambda _: self._asking.pop(name, None))
        return await asyncio.shield(shared)

    async def _ask(self, name: str) -> list[Address] | None:
        now = time.monotonic()
        found: list[Address] | None = None
        if self._writer is not None:
            ident = str(next(self._ids))
            waiter: asyncio.Future[list[Address] | None] = asyncio.get_running_loop().create_future()
            self._pending[ident] = waiter
            try:
                self._writer.write(f"{ident} {name}\n".encode())
                found = await asyncio.wait_for(waiter, NAMES_TIMEOUT)
            except (TimeoutError, ConnectionError, OSError):
                found = None
            finally:
                self._pending.pop(ident, None)
        if len(self._answers) >= MAX_NAMES:
            self._answers.clear()
        self._answers[name] = (now + TTL, found)
        for address in found or ():
            names = self._names.pop(address, [])
            self._names[address] = [n for n in names if n != name][-7:] + [name]  # newest last
            if len(self._names) > MAX_NAMES:
                self._names.popitem(last=False)
        return found

    def names_for(self, address: Address) -> list[str]:
        """The names whose answers held address, newest last."""
        return list(self._names.get(address, ()))


def first_name(data: bytes) -> str | None:
    """The name the client's first bytes ask for: a TLS ClientHello's SNI, an HTTP Host header."""
    if data[:1] == b"\x16":
        from egressd.wire.client_hello import HelloReader, parse_message

        try:
            hello = parse_message(HelloReader().feed(data))
        except ValueError:
            return None
        return hello.sni.lower().rstrip(".") if hello is not None and hello.sni else None
    found = HOST_HEADER.search(data.partition(b"\r\n\r\n")[0])
    return found.group(1).decode("ascii", "replace").lower().rstrip(".") if found else None


class _DnsUdp(asyncio.DatagramProtocol):
    def __init__(self, capture: Capture) -> None:
        self.capture = capture
        self.transport: asyncio.DatagramTransport | None = None
        self.tasks: set[asyncio.Task[None]] = set()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.DatagramTransport)
        self.transport = transport

    def datagram_received(self, data: bytes, addr: tuple[str, int]) -> None:
        if len(self.tasks) < MAX_DNS_IN_FLIGHT:
            task = asyncio.create_task(self._reply(data, addr))
            self.tasks.add(task)
            task.add_done_callback(self.tasks.discard)

    async def _reply(self, data: bytes, addr: tuple[str, int]) -> None:
        reply = await self.capture.respond(data)
        if reply is not None and self.transport is not None:
            self.transport.sendto(reply, addr)


async def _dns_tcp(capture: Capture, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while True:
            size = struct.unpack("!H", await asyncio.wait_for(reader.readexactly(2), DNS_TCP_TIMEOUT))[0]
            reply = await capture.respond(await asyncio.wait_for(reader.readexactly(size), DNS_TCP_TIMEOUT))
            if reply is None:
                break
            writer.write(struct.pack("!H", len(reply)) + reply)
            await writer.drain()
    except (asyncio.IncompleteReadError, TimeoutError, ConnectionError, OSError):
        pass
    finally:
        writer.close()
        with contextlib.suppress(ConnectionError, OSError):
            await writer.wait_closed()


def original_destination(sock: socket.socket) -> tuple[ipaddress.IPv4Address, int]:
    """Where the child connected before the redirect (netfilter's conntrack remembers)."""
    raw = sock.getsockopt(socket.SOL_IP, SO_ORIGINAL_DST, 16)
    port = struct.unpack("!H", raw[2:4])[0]
    return ipaddress.IPv4Address(raw[4:8]), port


async def peek(sock: socket.socket, timeout: float = PEEK_TIMEOUT) -> bytes:
    """What the client sent first, left unread in the socket (for egressd to read), if it speaks
    first (TLS, HTTP) within `timeout`."""
    try:
        await asyncio.wait_for(ready(sock.fileno()), timeout)
        return sock.recv(PEEK_BYTES, socket.MSG_PEEK)
    except (TimeoutError, OSError):
        return b""


async def send_connection(
    channel: socket.socket,
    conn: socket.socket,
    target: tuple[str, int],
    destination: tuple[ipaddress.IPv4Address, int],
) -> None:
    """Hand one captured connection to egressd, one message with its descriptor: `HOST PORT` of
    what it is decided as, then `ADDRESS PORT` of where the client connected."""
    message = f"{target[0]} {target[1]} {destination[0]} {destination[1]}".encode()
    while True:
        try:
            socket.send_fds(channel, [message], [conn.fileno()])
            return
        except BlockingIOError:
            await ready(channel.fileno(), write=True)


class Capture:
    """The bridge's DNS responder and transparent listener; they share one name table."""

    def __init__(self, port: int, handover: socket.socket, names: socket.socket | None = None) -> None:
        self.port = port  # the transparent listener's own
        self.handover = handover  # to egressd: the captured connections, each with its target
        self.table = NameTable()  # stand-ins, for names egressd gave no real answer for
        self.names = Names(names)
        self._tasks: set[asyncio.Task[None]] = set()

    async def respond(self, wire: bytes) -> bytes | None:
        """The answer to one DNS message: egressd's real addresses where it gives them."""
        asked = question(wire)
        real = await self.names.lookup(asked[0]) if asked is not None else None
        return answer(self.table, wire, real)

    def target(self, address: ipaddress.IPv4Address, port: int) -> tuple[str, int] | None:
        """What a captured destination is decided as; None to close it unasked."""
        if address in LOOPBACK:
            # a loopback port the policy names for the host (only those are redirected), or a
            # direct connection to the listener itself (closed)
            return (str(address), port) if port != self.port else None
        if address in SYNTHETIC:
            name = self.table.name_for(address)
            return (name, port) if name is not None else None
        return str(address), port

    async def handle(self, conn: socket.socket) -> None:
        """One captured connection, handed to egressd or closed: whatever goes wrong ends in a
        closed connection, never a traceback on the child's terminal."""
        try:
            await self._handle(conn)
        except Exception:  # noqa: BLE001 - the child only ever sees the connection close
            pass
        finally:
            conn.close()  # egressd holds its own descriptor of it now

    async def _handle(self, conn: socket.socket) -> None:
        try:
            address, port = original_destination(conn)
        except (OSError, ValueError, struct.error):
            return
        names = self.names.names_for(address) if address not in LOOPBACK else []
        if names:
            # an address egressd resolved for this child: decided by the name that led here; of
            # several (a shared CDN address), the one the client's first bytes name (SNI, Host),
            # which egressd then holds the TLS to
            first = await peek(conn) if len(names) > 1 else b""
            named = first_name(first) if first else None
            target: tuple[str, int] | None = (named if named in names else names[-1], port)
        else:
            target = self.target(address, port)
        if target is None:
            return
        if address in LOOPBACK and await self._own_loopback(address, port, conn):
            return
        await send_connection(self.handover, conn, target, (address, port))

    async def _own_loopback(self, address: ipaddress.IPv4Address, port: int, conn: socket.socket) -> bool:
        """A server of the child's own on a loopback port the policy names for the host is the one
        the child reaches there: joined to it when it accepts (True), else the host's (False)."""
        local = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            local.setblocking(False)
            local.bind((BRIDGE_SOURCE, 0))
            await asyncio.get_running_loop().sock_connect(local, (str(address), port))
        except OSError:
            local.close()
            return False
        await join(conn.dup(), local)
        return True

    async def _accept(self, listener: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        listener.setblocking(False)
        while True:
            try:
                conn, _ = await loop.sock_accept(listener)
            except OSError:  # out of descriptors, a client gone before accept: the next one
                await asyncio.sleep(0.05)
                continue
            task = asyncio.create_task(self.handle(conn))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def serve(self, tcp: socket.socket, dns_udp: socket.socket, dns_tcp: socket.socket) -> None:
        """Serve the transparent listener and the DNS responder forever."""
        loop = asyncio.get_running_loop()
        self.handover.setblocking(False)
        await self.names.start()
        await loop.create_datagram_endpoint(lambda: _DnsUdp(self), sock=dns_udp)
        dns = await asyncio.start_server(lambda r, w: _dns_tcp(self, r, w), sock=dns_tcp)
        await asyncio.gather(self._accept(tcp), dns.serve_forever())
