"""Inside the sandbox: the bridge's side of capture (see capture.py for the rules that feed it).

- A DNS responder (UDP and TCP, on the sandbox's loopback) answers every A query with a synthetic
  address from 198.18.0.0/15, one per name and stable for the run, AAAA with no data (the
  sandbox has no IPv6 way out) and anything else with no data. It resolves nothing: the proxy
  resolves the name when it decides.
- A transparent TCP listener takes each redirected connection, recovers where the child meant to
  go (SO_ORIGINAL_DST), maps a synthetic address back to its name (an IP literal stays a literal)
  and asks the proxy, at its listener on the sandbox's loopback and with the child's credentials, for
  `CONNECT name:port`. The proxy decides it as any CONNECT (policy, audit, the SNI rule); on a
  refusal the bridge closes the connection, and the audit says why. The bridge reads only the
  proxy's answer, never the child's bytes.
"""

from __future__ import annotations

import asyncio
import base64
import ipaddress
import re
import socket
import struct

from egressd.sandbox import BRIDGE_SOURCE
from egressd.sandbox.splice import close_quietly, splice

SO_ORIGINAL_DST = 80  # linux/netfilter_ipv4.h
SYNTHETIC = ipaddress.IPv4Network("198.18.0.0/15")
MAX_NAMES = 65536  # a child asking for more names gets SERVFAIL, never unbounded memory
TTL = 60
MAX_NAME = 253
MAX_ANSWER_HEAD = 64 * 1024  # the proxy's answer to CONNECT (a refusal has a text body)
# The proxy bounds resolving and connecting itself, and an ask-mode approval may wait for a person:
# this only ends a hang (the proxy's default idle timeout).
ANSWER_TIMEOUT = 3600.0
DNS_TCP_TIMEOUT = 30.0
LOOPBACK = ipaddress.IPv4Network("127.0.0.0/8")
# Names handed an address: hostname characters only (IDNA arrives as xn--). Anything else would
# reach the proxy's CONNECT line as dnspython's escapes; refusing it here keeps that line plain.
HOSTNAME = re.compile(r"[A-Za-z0-9_-]+(\.[A-Za-z0-9_-]+)*")


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


def answer(table: NameTable, wire: bytes) -> bytes | None:
    """The DNS answer to one query message; None for bytes that are not a query (dropped)."""
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
    question = query.question[0]
    name = question.name.to_text(omit_final_dot=True)
    if question.rdclass != dns.rdataclass.IN or len(name) > MAX_NAME or not HOSTNAME.fullmatch(name):
        response.set_rcode(dns.rcode.REFUSED)
        return response.to_wire()
    if question.rdtype == dns.rdatatype.A:
        address = table.address_for(name)
        if address is None:
            response.set_rcode(dns.rcode.SERVFAIL)
            return response.to_wire()
        response.answer.append(dns.rrset.from_text(question.name, TTL, "IN", "A", str(address)))
    return response.to_wire()  # AAAA and every other type: no data


class _DnsUdp(asyncio.DatagramProtocol):
    def __init__(self, table: NameTable) -> None:
        self.table = table
        self.transport: asyncio.DatagramTransport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.DatagramTransport)
        self.transport = transport

    def datagram_received(self, data: bytes, addr: tuple[str, int]) -> None:
        reply = answer(self.table, data)
        if reply is not None and self.transport is not None:
            self.transport.sendto(reply, addr)


async def _dns_tcp(table: NameTable, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while True:
            size = struct.unpack("!H", await asyncio.wait_for(reader.readexactly(2), DNS_TCP_TIMEOUT))[0]
            reply = answer(table, await asyncio.wait_for(reader.readexactly(size), DNS_TCP_TIMEOUT))
            if reply is None:
                break
            writer.write(struct.pack("!H", len(reply)) + reply)
            await writer.drain()
    except (asyncio.IncompleteReadError, TimeoutError, ConnectionError, OSError):
        pass
    finally:
        await close_quietly(writer)


def original_destination(sock: socket.socket) -> tuple[ipaddress.IPv4Address, int]:
    """Where the child connected before the redirect (netfilter's conntrack remembers)."""
    raw = sock.getsockopt(socket.SOL_IP, SO_ORIGINAL_DST, 16)
    port = struct.unpack("!H", raw[2:4])[0]
    return ipaddress.IPv4Address(raw[4:8]), port


def connect_head(host: str, port: int, auth: str) -> bytes:
    """The CONNECT the bridge sends for a captured connection, with the child's credentials."""
    authority = f"{host}:{port}"
    token = base64.b64encode(auth.encode()).decode()
    return (
        f"CONNECT {authority} HTTP/1.1\r\nHost: {authority}\r\nProxy-Authorization: Basic {token}\r\n\r\n"
    ).encode()


async def _proxy_answer(reader: asyncio.StreamReader) -> tuple[int, bytes]:
    """The status of the proxy's answer and any bytes after its head (the tunnel's first bytes)."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = await reader.read(4096)
        if not chunk or len(data) > MAX_ANSWER_HEAD:
            return 0, b""
        data += chunk
    head, _, rest = data.partition(b"\r\n\r\n")
    parts = head.split(b"\r\n", 1)[0].split(b" ")
    if len(parts) < 2 or not parts[0].startswith(b"HTTP/1.") or not parts[1].isdigit():
        return 0, b""
    return int(parts[1]), rest


class Capture:
    """The bridge's DNS responder and transparent listener; they share one name table."""

    def __init__(self, proxy: tuple[str, int], auth: str, port: int) -> None:
        self.proxy = proxy  # the proxy's listener on the sandbox's loopback
        self.auth = auth
        self.port = port  # the transparent listener's own
        self.table = NameTable()

    def target(self, address: ipaddress.IPv4Address, port: int) -> tuple[str, int] | None:
        """What to CONNECT to for a captured destination; None to close it unasked."""
        if address in LOOPBACK:
            # a loopback port the policy names for the host (only those are redirected), or a
            # direct connection to the listener itself (closed)
            return (str(address), port) if port != self.port else None
        if address in SYNTHETIC:
            name = self.table.name_for(address)
            return (name, port) if name is not None else None
        return str(address), port

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """One captured connection: whatever goes wrong ends in a closed connection, never a
        traceback on the child's terminal."""
        try:
            await self._handle(reader, writer)
        except Exception:  # noqa: BLE001 - the child only ever sees the connection close
            await close_quietly(writer)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            address, port = original_destination(writer.get_extra_info("socket"))
        except (OSError, ValueError, struct.error):
            await close_quietly(writer)
            return
        target = self.target(address, port)
        if target is None:
            await close_quietly(writer)
            return
        if address in LOOPBACK and await self._own_loopback(address, port, reader, writer):
            return
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.proxy)
        except OSError:
            await close_quietly(writer)
            return
        try:
            up_writer.write(connect_head(*target, self.auth))
            status, rest = await asyncio.wait_for(_proxy_answer(up_reader), ANSWER_TIMEOUT)
        except (TimeoutError, ConnectionError, OSError):
            status, rest = 0, b""
        if status != 200:  # refused: the proxy's audit holds the reason
            await close_quietly(up_writer)
            await close_quietly(writer)
            return
        if rest:
            writer.write(rest)
        await splice((reader, writer), (up_reader, up_writer))

    async def _own_loopback(
        self,
        address: ipaddress.IPv4Address,
        port: int,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
    ) -> bool:
        """A server in the sandbox on a loopback port the policy names for the host is the one the
        child reaches there: spliced to it when it accepts (True), else the host's (False)."""
        try:
            local = await asyncio.open_connection(str(address), port, local_addr=(BRIDGE_SOURCE, 0))
        except OSError:
            return False
        await splice((reader, writer), local)
        return True

    async def serve(self, tcp: socket.socket, dns_udp: socket.socket, dns_tcp: socket.socket) -> None:
        """Serve the transparent listener and the DNS responder forever."""
        loop = asyncio.get_running_loop()
        await loop.create_datagram_endpoint(lambda: _DnsUdp(self.table), sock=dns_udp)
        servers = [
            await asyncio.start_server(self.handle, sock=tcp),
            await asyncio.start_server(lambda r, w: _dns_tcp(self.table, r, w), sock=dns_tcp),
        ]
        await asyncio.gather(*(server.serve_forever() for server in servers))
