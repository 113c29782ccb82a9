"""The gateway's clients: named tokens, stored hashed, checked per connection with their source
networks.

`egressd run --gateway` serves other machines (containers), so a client is not a child egressd
started: it presents `NAME:TOKEN` (Proxy-Authorization Basic, or SOCKS5 user/password), and the
token file (`egressd gateway token add`) holds for each name a salted SHA-256 of the token, the
policy profile its connections get, and the networks it may come from. The token is 256 random
bits, so one fast hash is enough (nothing to brute-force) and a check is cheap; neither the file
nor the table keeps a plain token (in memory, a value a client presented and that was found valid
is remembered until the table in force is replaced: CredentialStore.check_basic). Everything here
is pure but the lock; the file's reading and writing are `egressd.session.token_file`.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import re
import secrets
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from egressd.admission.credentials import CredentialStore
from egressd.admission.state import ProxyCredentials

Network = ipaddress.IPv4Network | ipaddress.IPv6Network

# a name is a label in the audit and the metrics: short, no ":" (Basic splits there), no spaces
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
RESERVED_NAMES = frozenset({"other"})  # the metrics' label for every unknown name
HASH_SCHEME = "sha256"
TOKEN_BYTES = 32


class TokenFileError(ValueError):
    """The token file (or an entry for it) is not valid; the message says where."""


@dataclass(frozen=True)
class TokenEntry:
    """One client: its name, the salted hash of its token, its profile and source networks."""

    name: str
    salt: bytes
    digest: bytes
    profile: str | None = None
    sources: tuple[Network, ...] = ()
    created: float | None = None

    @property
    def key(self) -> str:
        """Who this entry's connections are, for limits and revocation: its name and which token
        (a prefix of the salted hash, useless to an attacker), never the token."""
        return f"gateway:{self.name}:{self.digest.hex()[:16]}"

    def matches(self, token: bytes) -> bool:
        return hmac.compare_digest(_digest(self.salt, token), self.digest)

    def to_data(self) -> dict[str, Any]:
        data: dict[str, Any] = {"hash": f"{HASH_SCHEME}:{self.salt.hex()}:{self.digest.hex()}"}
        if self.profile is not None:
            data["profile"] = self.profile
        if self.sources:
            data["from"] = [str(net) for net in self.sources]
        if self.created is not None:
            data["created"] = self.created
        return data


def _digest(salt: bytes, token: bytes) -> bytes:
    return hashlib.sha256(salt + token).digest()


def new_token() -> str:
    return secrets.token_urlsafe(TOKEN_BYTES)


def make_entry(
    name: str,
    token: str,
    *,
    profile: str | None = None,
    sources: Sequence[str] = (),
    created: float | None = None,
) -> TokenEntry:
    """A new entry for `token` (hashed with a fresh salt); a bad name or network raises."""
    check_name(name)
    if profile is not None and not profile:
        raise TokenFileError("--profile: empty")
    salt = secrets.token_bytes(16)
    nets = tuple(parse_network(text, "--from") for text in sources)
    return TokenEntry(name, salt, _digest(salt, token.encode()), profile, nets, created)


def check_name(name: str) -> None:
    if not NAME.fullmatch(name) or name in RESERVED_NAMES:
        raise TokenFileError(
            f"{name!r}: a client name is 1-64 letters, digits, '.', '_' or '-', starting with a "
            f"letter or digit (not {', '.join(sorted(RESERVED_NAMES))})"
        )


def parse_network(text: str, where: str) -> Network:
    try:
        return ipaddress.ip_network(text.strip(), strict=False)
    except ValueError:
        raise TokenFileError(f"{where}: {text!r} is not an IP network (CIDR)") from None


@dataclass(frozen=True)
class TokenTable:
    """The token file's entries by name."""

    entries: Mapping[str, TokenEntry]

    @classmethod
    def empty(cls) -> TokenTable:
        return cls(MappingProxyType({}))

    @classmethod
    def from_data(cls, data: Any, source: str) -> TokenTable:
        """The parsed JSON of a token file; anything unexpected raises (the file is refused whole)."""
        if (
            not isinstance(data, dict)
            or data.get("version") != 1
            or not isinstance(data.get("clients"), dict)
        ):
            raise TokenFileError(f"{source}: expected {{'version': 1, 'clients': {{...}}}}")
        entries: dict[str, TokenEntry] = {}
        for name, raw in data["clients"].items():
            where = f"{source}: clients.{name}"
            try:
                check_name(name)
            except TokenFileError as exc:
                raise TokenFileError(f"{source}: {exc}") from None
            if not isinstance(raw, dict) or set(raw) - {"hash", "profile", "from", "created"}:
                raise TokenFileError(f"{where}: expected hash, profile, from, created")
            entries[name] = _entry(name, raw, where)
        return cls(MappingProxyType(entries))

    def to_data(self) -> dict[str, Any]:
        return {"version": 1, "clients": {name: e.to_data() for name, e in sorted(self.entries.items())}}

    def with_entry(self, entry: TokenEntry) -> TokenTable:
        return TokenTable(MappingProxyType({**self.entries, entry.name: entry}))

    def without(self, name: str) -> TokenTable:
        return TokenTable(MappingProxyType({k: v for k, v in self.entries.items() if k != name}))


def _entry(name: str, raw: Mapping[str, Any], where: str) -> TokenEntry:
    scheme, _, rest = str(raw.get("hash", "")).partition(":")
    salt_hex, _, digest_hex = rest.partition(":")
    try:
        salt, digest = bytes.fromhex(salt_hex), bytes.fromhex(digest_hex)
    except ValueError:
        salt = digest = b""
    if scheme != HASH_SCHEME or not salt or len(digest) != hashlib.sha256().digest_size:
        raise TokenFileError(f"{where}.hash: expected {HASH_SCHEME}:SALT:DIGEST in hex")
    profile = raw.get("profile")
    if profile is not None and (not isinstance(profile, str) or not profile):
        raise TokenFileError(f"{where}.profile: expected a profile name")
    sources = raw.get("from", [])
    if not isinstance(sources, list) or not all(isinstance(s, str) for s in sources):
        raise TokenFileError(f"{where}.from: expected a list of networks")
    created = raw.get("created")
    if created is not None and not isinstance(created, (int, float)):
        raise TokenFileError(f"{where}.created: expected a number")
    nets = tuple(parse_network(s, f"{where}.from") for s in sources)
    return TokenEntry(name, salt, digest, profile, nets, created)


def peer_address(peer: str | None) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    """The IP of a ConnState peer ("ip:port", "[v6]" never: the front writes the bare address);
    an IPv4-mapped IPv6 address counts as its IPv4 address."""
    if not peer:
        return None
    host = peer.rpartition(":")[0].partition("%")[0]
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return None
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped
    return address


def _within(address: ipaddress.IPv4Address | ipaddress.IPv6Address | None, nets: Iterable[Network]) -> bool:
    return address is not None and any(address in net for net in nets)


# compared when a name is unknown, so an unknown name costs what a wrong token costs
_DECOY = TokenEntry("decoy", b"\0" * 16, b"\0" * 32)


class GatewayCredentials(CredentialStore):
    """The gateway's credentials step: the token table in force and the gateway-wide source
    networks (`--allow-from`). A client outside them, or outside its own token's `from`, is refused
    like a wrong token (407): a stolen token is useless elsewhere, and nothing tells a prober which
    of the two was wrong.

    `table`: a fixed table, or where the one in force is read (the session's snapshot, which a
    reload of the token file swaps whole with the policy's)."""

    def __init__(
        self, table: TokenTable | Callable[[], TokenTable], allow_from: Sequence[Network] = ()
    ) -> None:
        super().__init__()
        self._table: Callable[[], TokenTable] = table if callable(table) else lambda: table
        self.allow_from = tuple(allow_from)

    @property
    def table(self) -> TokenTable:
        return self._table()

    @property
    def state(self) -> object:
        return self._table()  # the table in force: one that is replaced is another object

    def names(self) -> frozenset[str]:
        return frozenset(self._table().entries)

    def issue(self, profile: str | None = None) -> ProxyCredentials:
        raise RuntimeError("a gateway issues no child credentials: clients use `egressd gateway token add`")

    def source_of(self, peer: str | None) -> str | None:
        """A check depends on the client's IP (its source networks), not on its port."""
        return peer.rpartition(":")[0] if peer else peer

    def check(self, username: str, token: str, peer: str | None = None) -> ProxyCredentials | None:
        entry = self._table().entries.get(username)
        secret = token.encode("utf-8", "surrogatepass")
        matched = (entry or _DECOY).matches(secret)
        if entry is None or not matched:
            return None
        address = peer_address(peer)
        if self.allow_from and not _within(address, self.allow_from):
            return None
        if entry.sources and not _within(address, entry.sources):
            return None
        return ProxyCredentials(entry.name, entry.key, gateway=True, gateway_profile=entry.profile)

    def valid(self, creds: ProxyCredentials) -> bool:
        """Still in the token file with the same token (a removed or replaced one is not)."""
        entry = self._table().entries.get(creds.username)
        return creds.gateway and entry is not None and entry.key == creds.token
