"""The policy's `secrets:` entries: where a credential's real value comes from, which hosts it may go
to and how it is sent. Pure: reading the value is egressd.session.secret_values' job, swapping it in the
admission pipeline's (egressd.admission.secrets).

The child only ever sees a placeholder in its environment; egressd puts the value in the request
where the entry says, for the listed hosts only.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from .entries import PolicyError
from .hosts import Host
from .rules import RuleError, RuleSet, parse_rule

__all__ = [
    "DEFAULT_HEADER",
    "SecretSource",
    "SecretSpec",
    "check_secret_hosts",
    "parse_header_template",
    "parse_secret_host",
    "parse_secrets",
    "secret_to_data",
]

SourceKind = Literal["env", "file", "command"]
DEFAULT_HEADER = "Authorization: Bearer {}"
SECRET_NAME = re.compile(r"[a-z0-9][a-z0-9_]{0,63}")
ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,127}")
_HEADER_NAME = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")
_QUERY_NAME = re.compile(r"[A-Za-z0-9_.~-]{1,128}")
# headers a secret may never be put in: framing, routing and egressd's own
_FORBIDDEN_HEADERS = frozenset(
    {
        "host",
        "content-length",
        "transfer-encoding",
        "connection",
        "upgrade",
        "te",
        "trailer",
        "proxy-authorization",
        "proxy-connection",
        "keep-alive",
    }
)
_KEYS = ("name", "from", "hosts", "header", "query", "env")


@dataclass(frozen=True)
class SecretSource:
    """Where the real value is read (by egressd, at start and on every reload): an environment
    variable of egressd's own environment, a file, or a command's standard output."""

    kind: SourceKind
    env: str = ""
    file: str = ""
    command: tuple[str, ...] = ()

    def describe(self) -> str:
        """For messages: where, never what."""
        if self.kind == "env":
            return f"environment variable {self.env}"
        if self.kind == "file":
            return f"file {self.file}"
        return f"command {self.command[0]!r}"


@dataclass(frozen=True)
class SecretSpec:
    """One secret: `hosts` are exact hosts (with an optional port) it may be sent to."""

    name: str
    source: SecretSource
    hosts: tuple[tuple[Host, int | None], ...]
    env: str  # the child's variable that holds the placeholder
    header: tuple[str, str] | None = None  # (lower-case name, value template with one "{}")
    query: str | None = None  # or: the query parameter that carries it

    def admits(self, host: Host, port: int) -> bool:
        return any(h == host and (p is None or p == port) for h, p in self.hosts)

    def fill(self, value: str) -> str:
        """The header value with the real value in it."""
        assert self.header is not None
        return self.header[1].replace("{}", value, 1)

    def host_texts(self) -> list[str]:
        out = []
        for host, port in self.hosts:
            text = host.url_host()
            out.append(text if port is None else f"{text}:{port}")
        return out


def _fail(source: str, key: str, entry: object, message: str) -> PolicyError:
    return PolicyError(source, key, entry, message)


def parse_header_template(text: object, source: str, key: str) -> tuple[str, str]:
    """`Name: template` with exactly one `{}` in the template."""
    if not isinstance(text, str) or ":" not in text:
        raise _fail(source, key, text, "must be 'Header-Name: value with {}' (e.g. 'x-api-key: {}')")
    name, _, template = text.partition(":")
    name, template = name.strip(), template.strip()
    if not _HEADER_NAME.fullmatch(name):
        raise _fail(source, key, text, "not a valid header name")
    if name.lower() in _FORBIDDEN_HEADERS:
        raise _fail(source, key, text, f"a secret cannot be sent in the {name} header")
    if template.count("{}") != 1 or any(c in template for c in "\r\n\0"):
        raise _fail(source, key, text, "the value must hold exactly one '{}' where the secret goes")
    return name.lower(), template


def parse_secret_host(text: object, source: str, key: str) -> tuple[Host, int | None]:
    """One exact host (name or IP literal) with an optional port: no wildcards, no CIDRs."""
    if not isinstance(text, str):
        raise _fail(source, key, text, "must be a host name or address, e.g. api.example.com")
    try:
        rule = parse_rule(text)
    except RuleError as exc:
        raise _fail(source, key, text, str(exc)) from None
    if rule.kind == "name" and rule.name is not None:
        return Host(name=rule.name, ip=None), rule.port
    if rule.kind == "ip" and rule.network is not None:
        return Host(name=None, ip=rule.network.network_address), rule.port
    raise _fail(source, key, text, "a secret goes to exact hosts only (no wildcard, no CIDR)")


def _parse_source(value: object, source: str, key: str) -> SecretSource:
    if not isinstance(value, Mapping) or len(value) != 1:
        raise _fail(source, key, value, "must be one of {env: VAR}, {file: PATH}, {command: [ARGV...]}")
    ((kind, arg),) = value.items()
    if kind == "env":
        if not isinstance(arg, str) or not ENV_NAME.fullmatch(arg):
            raise _fail(source, f"{key}.env", arg, "not an environment variable name")
        return SecretSource("env", env=arg)
    if kind == "file":
        if not isinstance(arg, str) or not arg or "\0" in arg:
            raise _fail(source, f"{key}.file", arg, "must be a file path")
        return SecretSource("file", file=arg)
    if kind == "command":
        argv = [arg] if isinstance(arg, str) else arg
        if (
            not isinstance(argv, list)
            or not argv
            or not all(isinstance(a, str) and a and "\0" not in a for a in argv)
        ):
            raise _fail(source, f"{key}.command", arg, "must be a command: a list of arguments")
        return SecretSource("command", command=tuple(argv))
    raise _fail(source, f"{key}.{kind}", arg, "unknown source (expected env, file or command)")


def _parse_one(entry: object, source: str, key: str) -> SecretSpec:
    if not isinstance(entry, Mapping):
        raise _fail(source, key, entry, "must be a mapping {name, from, hosts, header|query, env}")
    for name in entry:
        if name not in _KEYS:
            raise _fail(
                source, f"{key}.{name}", entry[name], f"unknown key (expected one of: {', '.join(_KEYS)})"
            )
    name = entry.get("name")
    if not isinstance(name, str) or not SECRET_NAME.fullmatch(name):
        raise _fail(source, f"{key}.name", name, "secret names are lower-case letters, digits and '_'")
    if "from" not in entry:
        raise _fail(source, f"{key}.from", None, "where the value comes from is missing")
    origin = _parse_source(entry.get("from"), source, f"{key}.from")
    hosts_value = entry.get("hosts")
    if isinstance(hosts_value, str):
        hosts_value = [hosts_value]
    if not isinstance(hosts_value, list) or not hosts_value:
        raise _fail(source, f"{key}.hosts", hosts_value, "a secret needs at least one host it may go to")
    hosts = tuple(
        dict.fromkeys(parse_secret_host(h, source, f"{key}.hosts[{i}]") for i, h in enumerate(hosts_value))
    )
    if "header" in entry and "query" in entry:
        raise _fail(source, key, entry, "a secret is sent in a header or a query parameter, not both")
    header: tuple[str, str] | None = None
    query: str | None = None
    if "query" in entry:
        query = entry["query"]
        if not isinstance(query, str) or not _QUERY_NAME.fullmatch(query):
            raise _fail(source, f"{key}.query", query, "not a query parameter name")
    else:
        header = parse_header_template(entry.get("header", DEFAULT_HEADER), source, f"{key}.header")
    env = entry.get("env")
    if not isinstance(env, str) or not ENV_NAME.fullmatch(env):
        raise _fail(source, f"{key}.env", env, "the child's variable for the placeholder: a variable name")
    if env.upper().startswith("EGRESSD_") or env.lower().endswith("_proxy") or env.upper() == "NO_PROXY":
        raise _fail(source, f"{key}.env", env, "egressd's own and proxy variables cannot hold a placeholder")
    return SecretSpec(name=name, source=origin, hosts=hosts, env=env, header=header, query=query)


def parse_secrets(value: object, source: str, key: str = "secrets") -> tuple[SecretSpec, ...]:
    """The `secrets:` list; names and child variables are unique."""
    if value is None:
        return ()
    if not isinstance(value, list):
        raise _fail(source, key, value, "must be a list of secrets")
    specs = tuple(_parse_one(entry, source, f"{key}[{i}]") for i, entry in enumerate(value))
    return check_unique(specs, source, key)


def check_unique(specs: Sequence[SecretSpec], source: str, key: str = "secrets") -> tuple[SecretSpec, ...]:
    names: set[str] = set()
    envs: set[str] = set()
    for index, spec in enumerate(specs):
        if spec.name in names:
            raise _fail(source, f"{key}[{index}].name", spec.name, "two secrets of this name")
        if spec.env in envs:
            raise _fail(source, f"{key}[{index}].env", spec.env, "two secrets give the child this variable")
        names.add(spec.name)
        envs.add(spec.env)
    return tuple(specs)


def check_secret_hosts(
    specs: Sequence[SecretSpec], allow: RuleSet, deny: RuleSet, source: str, key: str = "secrets"
) -> None:
    """Every host a secret may go to must be allowed by an allow rule and denied by none: a secret
    never widens what the child may reach, and a typo in `hosts` is an error, not a silent no-op."""
    for index, spec in enumerate(specs):
        for number, (host, port) in enumerate(spec.hosts):
            probe = port if port is not None else 443
            where = f"{key}[{index}].hosts[{number}]"
            text = spec.host_texts()[number]
            if deny.match(host, probe) is not None:
                raise _fail(
                    source, where, text, "this host is denied by the policy; a secret cannot go there"
                )
            if allow.match(host, probe) is None:
                raise _fail(
                    source,
                    where,
                    text,
                    f"not allowed by this policy: add it to allow (a secret goes only to allowed hosts, "
                    f"port {probe} checked)",
                )


def secret_to_data(spec: SecretSpec) -> dict[str, Any]:
    """A secret entry back in the file format (never holds a value: only where it comes from)."""
    origin: dict[str, Any]
    if spec.source.kind == "env":
        origin = {"env": spec.source.env}
    elif spec.source.kind == "file":
        origin = {"file": spec.source.file}
    else:
        origin = {"command": list(spec.source.command)}
    data: dict[str, Any] = {"name": spec.name, "from": origin, "hosts": spec.host_texts(), "env": spec.env}
    if spec.query is not None:
        data["query"] = spec.query
    elif spec.header is not None:
        data["header"] = f"{spec.header[0]}: {spec.header[1]}"
    return data


def _pairs(values: Sequence[str], option: str, source: str) -> list[tuple[str, str]]:
    out = []
    for index, text in enumerate(values):
        name, sep, rest = text.partition("=")
        if not sep or not name or not rest:
            raise _fail(source, f"{option}[{index}]", text, f"expected {option} NAME=VALUE")
        out.append((name, rest))
    return out


def secrets_from_options(
    secrets: Sequence[str],
    hosts: Sequence[str],
    headers: Sequence[str] = (),
    queries: Sequence[str] = (),
    source: str = "command line",
) -> tuple[SecretSpec, ...]:
    """`--secret NAME=ENV_VAR` (the value from egressd's ENV_VAR; the child gets the placeholder in
    that same variable), `--secret-host NAME=HOST` (repeatable), `--secret-header NAME='x-api-key:
    {}'` (default `Authorization: Bearer {}`) or `--secret-query NAME=PARAM`, as policy entries."""
    entries: dict[str, dict[str, Any]] = {}
    for name, env in _pairs(secrets, "--secret", source):
        if name in entries:
            raise _fail(source, "--secret", name, "given twice")
        entries[name] = {"name": name, "from": {"env": env}, "env": env, "hosts": []}
    for option, pairs in (
        ("--secret-host", _pairs(hosts, "--secret-host", source)),
        ("--secret-header", _pairs(headers, "--secret-header", source)),
        ("--secret-query", _pairs(queries, "--secret-query", source)),
    ):
        for name, value in pairs:
            entry = entries.get(name)
            if entry is None:
                raise _fail(source, option, name, "no --secret of this name")
            if option == "--secret-host":
                entry["hosts"].append(value)
            else:
                entry[option.removeprefix("--secret-")] = value
    return tuple(_parse_one(entry, source, f"--secret {name}") for name, entry in entries.items())
