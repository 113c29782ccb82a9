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

from .hosts import Host
from .rules import RuleError, RuleSet, parse_rule
from .schema import Reader, item, join

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


def parse_header_template(text: object, reader: Reader, key: str) -> tuple[str, str]:
    """`Name: template` with exactly one `{}` in the template."""
    if not isinstance(text, str) or ":" not in text:
        raise reader.fail(key, "must be 'Header-Name: value with {}' (e.g. 'x-api-key: {}')", text)
    name, _, template = text.partition(":")
    name, template = name.strip(), template.strip()
    if not _HEADER_NAME.fullmatch(name):
        raise reader.fail(key, "not a valid header name", text)
    if name.lower() in _FORBIDDEN_HEADERS:
        raise reader.fail(key, f"a secret cannot be sent in the {name} header", text)
    if template.count("{}") != 1 or any(c in template for c in "\r\n\0"):
        raise reader.fail(key, "the value must hold exactly one '{}' where the secret goes", text)
    return name.lower(), template


def parse_secret_host(text: object, reader: Reader, key: str) -> tuple[Host, int | None]:
    """One exact host (name or IP literal) with an optional port: no wildcards, no CIDRs."""
    if not isinstance(text, str):
        raise reader.fail(key, "must be a host name or address, e.g. api.example.com", text)
    try:
        rule = parse_rule(text)
    except RuleError as exc:
        raise reader.fail(key, str(exc), text) from None
    if rule.kind == "name" and rule.name is not None:
        return Host(name=rule.name, ip=None), rule.port
    if rule.kind == "ip" and rule.network is not None:
        return Host(name=None, ip=rule.network.network_address), rule.port
    raise reader.fail(key, "a secret goes to exact hosts only (no wildcard, no CIDR)", text)


def _parse_source(value: object, reader: Reader, key: str) -> SecretSource:
    if not isinstance(value, Mapping) or len(value) != 1:
        raise reader.fail(key, "must be one of {env: VAR}, {file: PATH}, {command: [ARGV...]}", value)
    ((kind, arg),) = value.items()
    if kind == "env":
        if not isinstance(arg, str) or not ENV_NAME.fullmatch(arg):
            raise reader.fail(join(key, "env"), "not an environment variable name", arg)
        return SecretSource("env", env=arg)
    if kind == "file":
        return SecretSource("file", file=reader.file_path(arg, join(key, "file")))
    if kind == "command":
        argv = [arg] if isinstance(arg, str) else arg
        if (
            not isinstance(argv, list)
            or not argv
            or not all(isinstance(a, str) and a and "\0" not in a for a in argv)
        ):
            raise reader.fail(join(key, "command"), "must be a command: a list of arguments", arg)
        return SecretSource("command", command=tuple(argv))
    raise reader.fail(join(key, str(kind)), "unknown source (expected env, file or command)", arg)


def _parse_one(entry: object, reader: Reader, key: str) -> SecretSpec:
    data = reader.mapping(entry, key, _KEYS, what=" {name, from, hosts, header|query, env}", required=True)
    name = data.get("name")
    if not isinstance(name, str) or not SECRET_NAME.fullmatch(name):
        raise reader.fail(join(key, "name"), "secret names are lower-case letters, digits and '_'", name)
    if "from" not in data:
        raise reader.fail(join(key, "from"), "where the value comes from is missing", None)
    origin = _parse_source(data.get("from"), reader, join(key, "from"))
    hosts_value = data.get("hosts")
    if isinstance(hosts_value, str):
        hosts_value = [hosts_value]
    hosts_key = join(key, "hosts")
    hosts = tuple(
        dict.fromkeys(
            parse_secret_host(h, reader, where) for where, h in reader.items(hosts_value, hosts_key)
        )
    )
    if not hosts:
        raise reader.fail(hosts_key, "a secret needs at least one host it may go to", hosts_value)
    if "header" in data and "query" in data:
        raise reader.fail(key, "a secret is sent in a header or a query parameter, not both", entry)
    header: tuple[str, str] | None = None
    query: str | None = None
    if "query" in data:
        query = data["query"]
        if not isinstance(query, str) or not _QUERY_NAME.fullmatch(query):
            raise reader.fail(join(key, "query"), "not a query parameter name", query)
    else:
        header = parse_header_template(data.get("header", DEFAULT_HEADER), reader, join(key, "header"))
    env = data.get("env")
    if not isinstance(env, str) or not ENV_NAME.fullmatch(env):
        raise reader.fail(join(key, "env"), "the child's variable for the placeholder: a variable name", env)
    if env.upper().startswith("EGRESSD_") or env.lower().endswith("_proxy") or env.upper() == "NO_PROXY":
        raise reader.fail(
            join(key, "env"), "egressd's own and proxy variables cannot hold a placeholder", env
        )
    return SecretSpec(name=name, source=origin, hosts=hosts, env=env, header=header, query=query)


def parse_secrets(value: object, source: str, key: str = "secrets") -> tuple[SecretSpec, ...]:
    """The `secrets:` list; names and child variables are unique."""
    reader = Reader(source)
    specs = tuple(
        _parse_one(entry, reader, where) for where, entry in reader.items(value, key, what=" of secrets")
    )
    return check_unique(specs, source, key)


def check_unique(specs: Sequence[SecretSpec], source: str, key: str = "secrets") -> tuple[SecretSpec, ...]:
    reader = Reader(source)
    names: set[str] = set()
    envs: set[str] = set()
    for index, spec in enumerate(specs):
        if spec.name in names:
            raise reader.fail(join(item(key, index), "name"), "two secrets of this name", spec.name)
        if spec.env in envs:
            raise reader.fail(
                join(item(key, index), "env"), "two secrets give the child this variable", spec.env
            )
        names.add(spec.name)
        envs.add(spec.env)
    return tuple(specs)


def check_secret_hosts(
    specs: Sequence[SecretSpec], allow: RuleSet, deny: RuleSet, source: str, key: str = "secrets"
) -> None:
    """Every host a secret may go to must be allowed by an allow rule and denied by none: a secret
    never widens what the child may reach, and a typo in `hosts` is an error, not a silent no-op."""
    reader = Reader(source)
    for index, spec in enumerate(specs):
        for number, (host, port) in enumerate(spec.hosts):
            probe = port if port is not None else 443
            where = item(join(item(key, index), "hosts"), number)
            text = spec.host_texts()[number]
            if deny.match(host, probe) is not None:
                raise reader.fail(where, "this host is denied by the policy; a secret cannot go there", text)
            if allow.match(host, probe) is None:
                raise reader.fail(
                    where,
                    f"not allowed by this policy: add it to allow (a secret goes only to allowed hosts, "
                    f"port {probe} checked)",
                    text,
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


def _pairs(values: Sequence[str], option: str, reader: Reader) -> list[tuple[str, str]]:
    out = []
    for where, text in reader.items(values, option):
        name, sep, rest = text.partition("=")
        if not sep or not name or not rest:
            raise reader.fail(where, f"expected {option} NAME=VALUE", text)
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
    reader = Reader(source)
    entries: dict[str, dict[str, Any]] = {}
    for name, env in _pairs(secrets, "--secret", reader):
        if name in entries:
            raise reader.fail("--secret", "given twice", name)
        entries[name] = {"name": name, "from": {"env": env}, "env": env, "hosts": []}
    for option, pairs in (
        ("--secret-host", _pairs(hosts, "--secret-host", reader)),
        ("--secret-header", _pairs(headers, "--secret-header", reader)),
        ("--secret-query", _pairs(queries, "--secret-query", reader)),
    ):
        for name, value in pairs:
            entry = entries.get(name)
            if entry is None:
                raise reader.fail(option, "no --secret of this name", name)
            if option == "--secret-host":
                entry["hosts"].append(value)
            else:
                entry[option.removeprefix("--secret-")] = value
    return tuple(_parse_one(entry, reader, f"--secret {name}") for name, entry in entries.items())
