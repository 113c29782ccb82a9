"""`upstream_proxy:` — the parent proxy admitted connections leave through (pure: parsing only).

The parent's credentials are never in the policy file (a child may be able to read it): the file
names an EGRESSD_* environment variable or a file that holds them, and egressd reads them itself
(`egressd.net.parent_proxy`). EGRESSD_* variables are stripped from every child's environment.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, cast, get_args
from urllib.parse import urlsplit

from .entries import parse_rule_list
from .hosts import TargetError, canonical_host
from .rules import RuleSet
from .schema import PolicyError, Reader, join

__all__ = ["CONNECT_BY", "DEFAULT_CREDENTIALS_ENV", "ConnectBy", "UpstreamProxy", "parse_upstream_proxy"]

ConnectBy = Literal["address", "name"]
CONNECT_BY: tuple[str, ...] = get_args(ConnectBy)
# where `--upstream-proxy URL` takes its credentials from, when that variable is set
DEFAULT_CREDENTIALS_ENV = "EGRESSD_UPSTREAM_PROXY_CREDENTIALS"
_KEYS = ("url", "credentials_env", "credentials_file", "direct", "connect_by")


@dataclass(frozen=True)
class UpstreamProxy:
    """The parent: `host:port` spoken to with HTTP CONNECT, except for `direct` targets.

    connect_by: "address" sends the pinned address in the CONNECT (the pin holds through the
    parent); "name" sends the canonical name (for parents that filter by name; the parent resolves
    it again). `authorization` is the Proxy-Authorization value egressd read from the environment or
    the file at start or reload; never compared, printed or dumped."""

    host: str
    port: int
    credentials_env: str | None = None
    credentials_file: str | None = None
    direct: RuleSet = field(default_factory=RuleSet)
    connect_by: ConnectBy = "address"
    authorization: str | None = field(default=None, compare=False, repr=False)

    @property
    def where(self) -> str:
        """`host:port` of the parent, for details and the audit (no credentials, ever)."""
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"


def parse_proxy_url(url: object, source: str, key: str) -> tuple[str, int]:
    """`http://HOST:PORT` → (canonical host, port). Credentials in the URL are refused: the policy
    file and the command line can both be read by a child."""
    if not isinstance(url, str) or not url:
        raise PolicyError(source, key, url, "must be a URL http://HOST:PORT")
    if "@" in url:  # checked before parsing: a URL that fails to parse is never echoed with them
        raise PolicyError(
            source,
            key,
            "<redacted>",
            "credentials do not belong in the URL (a child can read the policy file and the command "
            f"line): put 'user:password' in {DEFAULT_CREDENTIALS_ENV} or use credentials_file",
        )
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as exc:
        raise PolicyError(source, key, url, f"not a valid URL ({exc})") from None
    if parts.scheme != "http":
        raise PolicyError(source, key, url, "only an http:// parent proxy is supported (HTTP CONNECT)")
    if parts.path not in ("", "/") or parts.query or parts.fragment:
        raise PolicyError(source, key, url, "a proxy URL has no path, query or fragment")
    if not parts.hostname or port is None:
        raise PolicyError(source, key, url, "needs a host and an explicit port (http://HOST:PORT)")
    try:
        host = canonical_host(parts.hostname)
    except TargetError as exc:
        raise PolicyError(source, key, url, f"bad host: {exc}") from None
    return host.text, port


def parse_upstream_proxy(value: object, source: str, key: str = "upstream_proxy") -> UpstreamProxy | None:
    """The `upstream_proxy:` mapping (or null)."""
    if value is None:
        return None
    reader = Reader(source)
    # the value is never echoed: a URL written where the mapping belongs may carry credentials
    data = reader.mapping(value, key, _KEYS, what=" with url: http://HOST:PORT", echo=False)
    host, port = parse_proxy_url(data.get("url"), source, join(key, "url"))
    env = data.get("credentials_env")
    if env is not None and (not isinstance(env, str) or not env.startswith("EGRESSD_") or "=" in env):
        why = "must name an EGRESSD_* variable (egressd never passes those to a child)"
        raise reader.fail(join(key, "credentials_env"), why, env)
    path = data.get("credentials_file")
    if path is not None:
        reader.file_path(path, join(key, "credentials_file"))
    if env is not None and path is not None:
        raise reader.fail(key, "give credentials_env or credentials_file, not both")
    direct = reader.list(data.get("direct"), join(key, "direct"), what=" of host rules")
    return UpstreamProxy(
        host=host,
        port=port,
        credentials_env=env,
        credentials_file=path,
        direct=RuleSet(parse_rule_list(direct, source, join(key, "direct"))),
        connect_by=cast(
            ConnectBy, reader.choice(data.get("connect_by", "address"), join(key, "connect_by"), CONNECT_BY)
        ),
    )
