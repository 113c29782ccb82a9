"""The server side of SOCKS5 (RFC 1928) with username/password authentication (RFC 1929), sans-I/O.

egressd's front feeds the client's bytes in as they arrive and gets typed events back: the
greeting (with the method egressd chose), the credentials, the CONNECT request, then the tunnel's
first bytes. Nothing here decides, authenticates or connects: the admission pipeline does, for
SOCKS5 exactly as for an HTTP CONNECT. What this module refuses by itself is only what cannot be a
SOCKS5 CONNECT egressd serves (another version, BIND/UDP, an unknown address type, a name that is no
ASCII host, port 0): each such refusal raises Socks5Error carrying the reply to send before closing.

Each byte is looked at a bounded number of times (a handshake sent one byte per write costs what its
size costs), and the parser never holds more than one incomplete message: the largest legal one is
MAX_MESSAGE bytes; whatever follows the request is handed back at once as the tunnel's first bytes.
"""

from __future__ import annotations

import enum
import ipaddress
import struct
from dataclasses import dataclass

from egressd.policy.reasons import Reason

VERSION = 0x05
AUTH_VERSION = 0x01  # of the RFC 1929 sub-negotiation

NO_AUTH = 0x00
USER_PASS = 0x02
NO_ACCEPTABLE = 0xFF

CMD_CONNECT = 0x01
CMD_BIND = 0x02
CMD_UDP_ASSOCIATE = 0x03

ATYP_IPV4 = 0x01
ATYP_DOMAIN = 0x03
ATYP_IPV6 = 0x04

MAX_GREETING = 2 + 255  # VER NMETHODS METHODS
MAX_AUTH = 1 + 1 + 255 + 1 + 255  # VER ULEN UNAME PLEN PASSWD
MAX_REQUEST = 4 + 1 + 255 + 2  # VER CMD RSV ATYP, the longest address (a name), PORT
MAX_MESSAGE = max(MAX_GREETING, MAX_AUTH, MAX_REQUEST)


class Reply(enum.IntEnum):
    """The REP codes of RFC 1928 section 6."""

    SUCCEEDED = 0x00
    GENERAL_FAILURE = 0x01
    NOT_ALLOWED = 0x02  # "connection not allowed by ruleset": every policy refusal
    NETWORK_UNREACHABLE = 0x03
    HOST_UNREACHABLE = 0x04  # DNS failures
    CONNECTION_REFUSED = 0x05
    TTL_EXPIRED = 0x06  # the closest code for "timed out"
    COMMAND_NOT_SUPPORTED = 0x07
    ADDRESS_TYPE_NOT_SUPPORTED = 0x08


class Socks5Error(ValueError):
    """Bytes egressd will not serve as SOCKS5. `reply` is what to send before closing (maybe
    nothing), `reason` the refusal's reason code for the audit."""

    def __init__(self, message: str, reply: bytes = b"", reason: Reason = Reason.BAD_REQUEST) -> None:
        super().__init__(message)
        self.reply = reply
        self.reason = reason


@dataclass(frozen=True)
class Greeting:
    """The client's method offer and the method egressd chose (NO_ACCEPTABLE never: that raises)."""

    methods: bytes
    method: int

    @property
    def reply(self) -> bytes:
        return bytes([VERSION, self.method])


@dataclass(frozen=True)
class Credentials:
    """RFC 1929 username and password; None where the bytes are not UTF-8 (wrong credentials, never
    a crash, never a lossy decoding that might equal a real token)."""

    username: str | None
    password: str | None


@dataclass(frozen=True)
class Request:
    """A CONNECT to host:port as the client wrote it (ATYP 1 and 4 as address text, 3 as the name):
    the admission pipeline canonicalises it like any other target."""

    host: str
    port: int
    atyp: int


@dataclass(frozen=True)
class TunnelData:
    """Bytes after the request: the tunnel's first bytes, never interpreted here."""

    data: bytes


Event = Greeting | Credentials | Request | TunnelData


def method_reply(method: int) -> bytes:
    return bytes([VERSION, method])


def auth_reply(ok: bool) -> bytes:
    """The RFC 1929 status: 0x00 success; any other value is a failure, and the server closes."""
    return bytes([AUTH_VERSION, 0x00 if ok else 0x01])


def reply(code: int, bound: tuple[str, int] | None = None) -> bytes:
    """A reply to the request; `bound` is the proxy's address towards the server (success only),
    else 0.0.0.0:0 as clients expect on a failure."""
    host, port = bound if bound is not None else ("0.0.0.0", 0)
    address = ipaddress.ip_address(host.split("%", 1)[0])
    atyp = ATYP_IPV4 if address.version == 4 else ATYP_IPV6
    return bytes([VERSION, code, 0x00, atyp]) + address.packed + struct.pack("!H", port)


def failure(code: int) -> bytes:
    return reply(code)


class _State(enum.Enum):
    GREETING = enum.auto()
    AUTH = enum.auto()
    REQUEST = enum.auto()
    TUNNEL = enum.auto()
    FAILED = enum.auto()


class Socks5Server:
    """One client's SOCKS5 handshake, as the server reads it.

    `allow_no_auth`: the listener grants credentials by itself (a credential-free listener only the
    child reaches), so a client that offers only NO AUTH is served too; otherwise USER/PASS is
    required. A client that offers USER/PASS gets it either way: credentials it sends are checked.
    The caller checks a Credentials event before acting on anything after it (a client may send its
    request without waiting for the auth status), and answers each event with the replies above."""

    def __init__(self, *, allow_no_auth: bool = False) -> None:
        self.allow_no_auth = allow_no_auth
        self._state = _State.GREETING
        self._buffer = bytearray()
        self._need = 1  # bytes of the current message needed before it can be read further

    @property
    def done(self) -> bool:
        """The request has been read: every later byte is tunnel data."""
        return self._state is _State.TUNNEL

    @property
    def buffered(self) -> int:
        return len(self._buffer)

    def feed(self, data: bytes) -> list[Event]:
        """The events the bytes complete, in order. Raises Socks5Error (and stays failed)."""
        if self._state is _State.FAILED:
            raise Socks5Error("the SOCKS5 handshake has failed already")
        if self._state is _State.TUNNEL:
            return [TunnelData(bytes(data))] if data else []
        events: list[Event] = []
        self._buffer += data
        try:
            while self._state is not _State.TUNNEL and len(self._buffer) >= self._need:
                event = self._step()
                if event is not None:
                    events.append(event)
        except Socks5Error:
            self._state = _State.FAILED
            self._buffer = bytearray()
            raise
        if self._state is _State.TUNNEL and self._buffer:
            events.append(TunnelData(bytes(self._buffer)))
            self._buffer = bytearray()
        return events

    # -- one step: either a larger need, or a whole message consumed --------------------------------
    def _step(self) -> Event | None:
        if self._state is _State.GREETING:
            return self._greeting()
        if self._state is _State.AUTH:
            return self._auth()
        return self._request()

    def _take(self, size: int, state: _State) -> bytes:
        message = bytes(self._buffer[:size])
        del self._buffer[:size]
        self._state, self._need = state, 1
        return message

    def _greeting(self) -> Event | None:
        buf = self._buffer
        if buf[0] != VERSION:
            raise Socks5Error(f"not SOCKS5: version byte 0x{buf[0]:02x} in the greeting (expected 0x05)")
        if len(buf) < 2:
            self._need = 2
            return None
        size = 2 + buf[1]
        if len(buf) < size:
            self._need = size
            return None
        methods = bytes(buf[2:size])
        if USER_PASS in methods:
            method, state = USER_PASS, _State.AUTH
        elif self.allow_no_auth and NO_AUTH in methods:
            method, state = NO_AUTH, _State.REQUEST
        else:
            wanted = "USER/PASS (0x02) or NO AUTH (0x00)" if self.allow_no_auth else "USER/PASS (0x02)"
            raise Socks5Error(
                f"SOCKS5 client offers no acceptable method (offered {methods.hex() or 'none'}; "
                f"egressd needs {wanted})",
                method_reply(NO_ACCEPTABLE),
                reason=Reason.PROXY_AUTH_REQUIRED,
            )
        self._take(size, state)
        return Greeting(methods, method)

    def _auth(self) -> Event | None:
        buf = self._buffer
        if buf[0] != AUTH_VERSION:
            raise Socks5Error(
                f"SOCKS5 username/password sub-negotiation version 0x{buf[0]:02x} (expected 0x01)",
                auth_reply(False),
                reason=Reason.PROXY_AUTH_REQUIRED,
            )
        if len(buf) < 2:
            self._need = 2
            return None
        ulen = buf[1]
        if len(buf) < 3 + ulen:
            self._need = 3 + ulen
            return None
        size = 3 + ulen + buf[2 + ulen]
        if len(buf) < size:
            self._need = size
            return None
        message = self._take(size, _State.REQUEST)
        return Credentials(_utf8(message[2 : 2 + ulen]), _utf8(message[3 + ulen : size]))

    def _request(self) -> Event | None:
        buf = self._buffer
        if buf[0] != VERSION:
            raise Socks5Error(
                f"not SOCKS5: version byte 0x{buf[0]:02x} in the request (expected 0x05)",
                failure(Reply.GENERAL_FAILURE),
            )
        if len(buf) < 4:
            self._need = 4
            return None
        command, reserved, atyp = buf[1], buf[2], buf[3]
        if command != CMD_CONNECT:
            name = {CMD_BIND: "BIND", CMD_UDP_ASSOCIATE: "UDP ASSOCIATE"}.get(command, f"0x{command:02x}")
            raise Socks5Error(
                f"SOCKS5 command {name} is not supported (only CONNECT)", failure(Reply.COMMAND_NOT_SUPPORTED)
            )
        if reserved != 0:
            raise Socks5Error(
                f"SOCKS5 request with reserved byte 0x{reserved:02x} (must be 0x00)",
                failure(Reply.GENERAL_FAILURE),
            )
        if atyp == ATYP_IPV4:
            size = 4 + 4 + 2
        elif atyp == ATYP_IPV6:
            size = 4 + 16 + 2
        elif atyp == ATYP_DOMAIN:
            if len(buf) < 5:
                self._need = 5
                return None
            size = 5 + buf[4] + 2
        else:
            raise Socks5Error(
                f"SOCKS5 address type 0x{atyp:02x} is not supported",
                failure(Reply.ADDRESS_TYPE_NOT_SUPPORTED),
            )
        if len(buf) < size:
            self._need = size
            return None
        message = self._take(size, _State.TUNNEL)
        port = struct.unpack("!H", message[-2:])[0]
        host = _domain(message[5:-2]) if atyp == ATYP_DOMAIN else str(ipaddress.ip_address(message[4:-2]))
        if port == 0:
            raise Socks5Error(
                f"SOCKS5 CONNECT to {host} port 0", failure(Reply.NOT_ALLOWED), Reason.INVALID_TARGET
            )
        return Request(host, port, atyp)


def _utf8(raw: bytes) -> str | None:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return None


def _domain(raw: bytes) -> str:
    """The name of an ATYP 3 request: 1 to 255 printable ASCII bytes (RFC 1928 says a fully qualified
    domain name; an internationalised name travels as its A-label). Other bytes are refused here,
    before any string is built from them; what is left (e.g. '%', '..') is the policy's to judge."""
    if not raw:
        empty = "SOCKS5 CONNECT to an empty name"
        raise Socks5Error(empty, failure(Reply.NOT_ALLOWED), Reason.INVALID_TARGET)
    if not all(0x20 < b < 0x7F for b in raw):
        raise Socks5Error(
            f"SOCKS5 CONNECT to a name with control, space or non-ASCII bytes: {raw[:100]!r}",
            failure(Reply.NOT_ALLOWED),
            Reason.INVALID_TARGET,
        )
    return raw.decode("ascii")
