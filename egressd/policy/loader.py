"""Policy loading and validation: build a complete Policy or raise; never half-load.

Every error names the file, the key path (``allow[2]``, ``profiles.ci.ports[0]``) and the bad entry,
because a policy that is silently read differently from how it was written is worse than none.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, cast

from .entries import parse_nameserver, parse_rule_list
from .hosts import Host, TargetError, canonical_host
from .model import (
    AUDIT_FAILURES,
    MODES,
    REFUSAL_PAGES,
    AuditFailure,
    AuditPolicy,
    BuiltinAllowance,
    Credentials,
    Limits,
    LoopbackPolicy,
    Mode,
    Origin,
    Policy,
    PresetInfo,
    PrivatePolicy,
    Profile,
    ProviderAck,
    RefusalPages,
    ResolverConfig,
)
from .paths import normalise_path
from .rules import RuleError, RuleSet, parse_rule, read_methods
from .schema import PolicyError, Reader, item, join
from .secrets import check_secret_hosts, parse_secrets
from .upstream import parse_upstream_proxy

__all__ = [
    "PolicyError",
    "apply_env_mode",
    "builtin_policy_names",
    "builtin_policy_path",
    "load_policy",
    "parse_nameserver",
    "parse_policy",
    "parse_rule_list",
    "policy_from_bytes",
]

_TOP_KEYS = (
    "version",
    "mode",
    "allow",
    "deny",
    "loopback",
    "private",
    "builtin",
    "inspect",
    "ports",
    "credentials",
    "limits",
    "timeouts",
    "resolver",
    "profiles",
    "websocket",
    "refusal_pages",
    "ask_timeout",
    "upstream_proxy",
    "preset",
    "providers",
    "secrets",
    "audit",
)
_HEADER = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")
_PROFILE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
_POLICY_NAME = re.compile(r"[a-z0-9][a-z0-9_-]*")
_ORIGIN_PORTS = {"http": 80, "https": 443}


def _rules(value: object, reader: Reader, key: str) -> RuleSet:
    rules = parse_rule_list(reader.list(value, key), reader.source, key)
    for index, rule in enumerate(rules):
        # `exe` narrows what an allow rule admits; a deny or inspect rule applies to every
        # program (a deny that spared other programs would widen, which `exe` never does)
        if rule.exe and not key.endswith("allow"):
            why = "exe is only for allow rules (a deny applies to every program)"
            raise reader.fail(item(key, index), why, rule.text)
        if rule.websocket and not key.endswith("allow"):
            why = "websocket is only for allow rules (it lets a request they admit upgrade)"
            raise reader.fail(item(key, index), why, rule.text)
        # `private` licenses what the policy's own allow rule admits; a profile only narrows
        if rule.private and key != "allow":
            why = "private is only for the policy's allow rules (it licenses what they admit)"
            raise reader.fail(item(key, index), why, rule.text)
    return RuleSet(rules)


def _parse_origin(entry: object, reader: Reader, key: str) -> Origin:
    if not isinstance(entry, str):
        raise reader.fail(key, "origin must be a string like 'http://192.168.1.10:8080'", entry)
    scheme, sep, rest = entry.partition("://")
    scheme = scheme.lower()
    if not sep or scheme not in _ORIGIN_PORTS:
        raise reader.fail(key, "origin must start with http:// or https://", entry)
    if rest.endswith("/"):
        rest = rest[:-1]
    if not rest or any(c in rest for c in "/?#@\\"):
        raise reader.fail(key, "origin is scheme://host[:port] only (no path, query or credentials)", entry)
    try:
        rule = parse_rule(rest)
    except RuleError as exc:
        raise reader.fail(key, str(exc), entry) from None
    if rule.kind not in ("name", "ip"):
        raise reader.fail(key, "origin host must be one exact name or address", entry)
    if rule.network is not None:
        host = Host(name=None, ip=rule.network.network_address)
    else:
        host = Host(name=rule.name, ip=None)
    return Origin(scheme=scheme, host=host, port=rule.port or _ORIGIN_PORTS[scheme])


def _parse_builtin(entry: object, reader: Reader, key: str) -> BuiltinAllowance:
    fields = ("host", "paths", "methods", "websocket")
    data = reader.mapping(entry, key, fields, what=" {host, paths, methods, websocket}", required=True)
    host_text = data.get("host")
    if not isinstance(host_text, str):
        raise reader.fail(join(key, "host"), "must be a string naming one exact host", host_text)
    try:
        host = canonical_host(host_text)
    except TargetError as exc:
        raise reader.fail(join(key, "host"), exc.reason, host_text) from None
    paths = reader.list(data.get("paths"), join(key, "paths"))
    if not paths:
        raise reader.fail(join(key, "paths"), "a built-in allowance needs at least one path")
    normalised: list[str] = []
    for path_key, path in reader.items(paths, join(key, "paths")):
        if not isinstance(path, str) or not path.startswith("/") or any(c in path for c in "*?#"):
            raise reader.fail(path_key, "must be a fixed path starting with '/'", path)
        normal = normalise_path(path)
        if normal is None:
            raise reader.fail(path_key, "not a valid path", path)
        normalised.append(normal)
    return BuiltinAllowance(
        host=host.text,
        paths=tuple(dict.fromkeys(normalised)),
        methods=read_methods(reader, data.get("methods"), join(key, "methods")),
        websocket=reader.bool(data.get("websocket"), join(key, "websocket"), False),
    )


def _parse_profile(name: object, value: object, reader: Reader) -> Profile:
    key = f"profiles.{name}"
    if not isinstance(name, str) or not _PROFILE_NAME.fullmatch(name):
        raise reader.fail("profiles", "profile names are letters, digits, '.', '_', '-'", name)
    data = reader.mapping(value, key, ("allow", "deny", "ports"))
    allow = None if data.get("allow") is None else _rules(data["allow"], reader, f"{key}.allow")
    return Profile(
        name=name,
        allow=allow,
        deny=_rules(data.get("deny"), reader, f"{key}.deny"),
        ports=reader.ports(data.get("ports"), f"{key}.ports"),
    )


def _parse_preset(value: object, reader: Reader) -> PresetInfo | None:
    if value is None:
        return None
    data = reader.mapping(value, "preset", ("name", "version", "summary", "sends"))
    name = reader.text(data.get("name"), "preset.name")
    if not _POLICY_NAME.fullmatch(name):
        raise reader.fail("preset.name", "preset names are lower-case letters, digits, '_', '-'", name)
    return PresetInfo(
        name=name,
        version=reader.integer(data.get("version"), "preset.version"),
        summary=reader.text(data.get("summary"), "preset.summary", required=False),
        sends=reader.text(data.get("sends"), "preset.sends", required=False),
    )


def _host_texts(value: object, reader: Reader, key: str) -> tuple[str, ...]:
    parse_rule_list(reader.list(value, key), reader.source, key)  # each must be a host rule
    return tuple(dict.fromkeys(reader.text(entry, where) for where, entry in reader.items(value, key)))


def _parse_providers(value: object, reader: Reader) -> tuple[ProviderAck, ...]:
    acks: list[ProviderAck] = []
    seen: set[str] = set()
    for key, entry in reader.items(value, "providers"):
        data = reader.mapping(entry, key, ("name", "version", "acknowledged", "hosts", "added"))
        name = reader.text(data.get("name"), f"{key}.name")
        if name in seen:
            raise reader.fail(f"{key}.name", "this provider is acknowledged twice", name)
        seen.add(name)
        day = data.get("acknowledged")
        day_text = day.isoformat() if hasattr(day, "isoformat") else day
        acks.append(
            ProviderAck(
                name=name,
                version=reader.integer(data.get("version"), f"{key}.version"),
                acknowledged=reader.text(day_text, f"{key}.acknowledged"),
                hosts=_host_texts(data.get("hosts"), reader, f"{key}.hosts"),
                added=_host_texts(data.get("added"), reader, f"{key}.added"),
            )
        )
    return tuple(acks)


def _parse_audit(value: object, reader: Reader) -> AuditPolicy:
    data = reader.mapping(value, "audit", ("on_failure", "max_queue_bytes"))
    defaults = AuditPolicy()
    on_failure = reader.choice(
        data.get("on_failure", defaults.on_failure), "audit.on_failure", AUDIT_FAILURES
    )
    queue = data.get("max_queue_bytes", defaults.max_queue_bytes)
    return AuditPolicy(
        on_failure=cast(AuditFailure, on_failure),
        max_queue_bytes=reader.integer(queue, "audit.max_queue_bytes", 4096, "bytes"),
    )


def parse_policy(data: object, source: str) -> Policy:
    """Validate a decoded policy document and build the Policy."""
    reader = Reader(source)
    top = reader.mapping(reader.document(data), "", _TOP_KEYS)

    version = top.get("version", 1)
    if isinstance(version, bool) or not isinstance(version, int) or version != 1:
        raise reader.fail("version", "unsupported version (expected 1)", version)
    mode = reader.choice(top.get("mode", "enforce"), "mode", MODES)
    refusal_pages = reader.choice(top.get("refusal_pages", "status"), "refusal_pages", REFUSAL_PAGES)

    loopback = reader.mapping(top.get("loopback"), "loopback", ("allow", "ports"))
    private = reader.mapping(top.get("private"), "private", ("allow", "origins"))
    credentials = reader.mapping(top.get("credentials"), "credentials", ("strip_on_host_change",))
    limits = reader.mapping(
        top.get("limits"),
        "limits",
        (
            "connect_timeout",
            "dns_timeout",
            "idle_timeout",
            "max_response_bytes",
            "header_timeout",
            "max_connections",
            "requests_per_second",
            "burst",
        ),
    )
    resolver = reader.mapping(top.get("resolver"), "resolver", ("nameservers",))
    profiles = reader.mapping(top.get("profiles"), "profiles", None)

    origins = tuple(
        _parse_origin(entry, reader, where)
        for where, entry in reader.items(private.get("origins"), "private.origins")
    )
    builtin = tuple(
        _parse_builtin(entry, reader, where) for where, entry in reader.items(top.get("builtin"), "builtin")
    )
    headers: list[str] = []
    strip = credentials.get("strip_on_host_change", list(Credentials().strip_on_host_change))
    for where, header in reader.items(strip, "credentials.strip_on_host_change"):
        if not isinstance(header, str) or not _HEADER.fullmatch(header):
            raise reader.fail(where, "not a valid header name", header)
        headers.append(header.lower())
    timeouts = _timeouts(top, limits, reader)
    nameservers = tuple(
        parse_nameserver(entry, source, where)
        for where, entry in reader.items(resolver.get("nameservers"), "resolver.nameservers")
    )
    allow = _rules(top.get("allow"), reader, "allow")
    deny = _rules(top.get("deny"), reader, "deny")
    secrets = parse_secrets(top.get("secrets"), source)
    check_secret_hosts(secrets, allow, deny, source)
    return Policy(
        version=1,
        mode=cast(Mode, mode),
        allow=allow,
        deny=deny,
        loopback=LoopbackPolicy(
            allow=reader.bool(loopback.get("allow"), "loopback.allow", True),
            ports=reader.ports(loopback.get("ports"), "loopback.ports"),
        ),
        private=PrivatePolicy(
            allow=reader.bool(private.get("allow"), "private.allow", False), origins=origins
        ),
        builtin=builtin,
        inspect=_rules(top.get("inspect"), reader, "inspect"),
        ports=reader.ports(top.get("ports"), "ports"),
        credentials=Credentials(strip_on_host_change=tuple(dict.fromkeys(headers))),
        limits=Limits(
            connect_timeout=timeouts["connect"],
            dns_timeout=timeouts["dns"],
            idle_timeout=timeouts["idle"],
            max_response_bytes=reader.count(limits.get("max_response_bytes"), "limits.max_response_bytes"),
            header_timeout=timeouts["header"],
            max_connections=reader.count(limits.get("max_connections"), "limits.max_connections"),
            requests_per_second=(
                None
                if limits.get("requests_per_second") is None
                else reader.positive(limits.get("requests_per_second"), "limits.requests_per_second", 1)
            ),
            burst=reader.count(limits.get("burst"), "limits.burst"),
            response_timeout=timeouts["response"],
        ),
        resolver=ResolverConfig(nameservers=nameservers),
        profiles={name: _parse_profile(name, value, reader) for name, value in profiles.items()},
        websocket=reader.bool(top.get("websocket"), "websocket", True),
        refusal_pages=cast(RefusalPages, refusal_pages),
        ask_timeout=timeouts["ask"],
        upstream_proxy=parse_upstream_proxy(top.get("upstream_proxy"), source),
        preset=_parse_preset(top.get("preset"), reader),
        providers=_parse_providers(top.get("providers"), reader),
        secrets=secrets,
        audit=_parse_audit(top.get("audit"), reader),
        source=source,
    )


# timeouts: NAME -> (the other place it may be written, from before `timeouts:`; its default)
_LIMITS = Limits()
_TIMEOUTS: dict[str, tuple[str | None, float]] = {
    "connect": ("limits.connect_timeout", _LIMITS.connect_timeout),
    "dns": ("limits.dns_timeout", _LIMITS.dns_timeout),
    "header": ("limits.header_timeout", _LIMITS.header_timeout),
    "response": (None, _LIMITS.response_timeout),
    "idle": ("limits.idle_timeout", _LIMITS.idle_timeout),
    "ask": ("ask_timeout", 60),
}


def _timeouts(top: Mapping[str, Any], limits: Mapping[str, Any], reader: Reader) -> dict[str, float]:
    """Every timeout in seconds: from `timeouts:`, or its other spelling (`limits.dns_timeout`,
    `ask_timeout`, ...), never both (two values for one timeout would leave a reader guessing)."""
    given = reader.mapping(top.get("timeouts"), "timeouts", tuple(_TIMEOUTS))
    out: dict[str, float] = {}
    for name, (other, default) in _TIMEOUTS.items():
        key, value = f"timeouts.{name}", given.get(name)
        if other is not None:
            section, _, field_name = other.rpartition(".")
            written = (limits if section else top).get(field_name)
            if value is not None and written is not None:
                raise reader.fail(key, f"also given as {other}: write one of them", value)
            if value is None:
                key, value = other, written
        out[name] = reader.positive(value, key, default)
    return out


def _json_pairs(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    result: dict[str, Any] = {}
    for key, value in pairs:
        if key in result:
            raise ValueError(f"duplicate key {key!r}")
        result[key] = value
    return result


def _reject_constant(name: str) -> None:
    raise ValueError(f"{name} is not allowed")


def _decode(text: str, source: str, as_json: bool) -> object:
    if as_json:
        try:
            return json.loads(text, object_pairs_hook=_json_pairs, parse_constant=_reject_constant)
        except ValueError as exc:
            raise PolicyError(source, None, message=f"invalid JSON: {exc}") from None
    from . import strict_yaml  # here: a run without a policy file never loads PyYAML

    try:
        return strict_yaml.load(text)
    except strict_yaml.YAMLError as exc:
        raise PolicyError(source, None, message=f"invalid YAML: {exc}") from None


def load_policy(
    path: str | os.PathLike[str],
    env: Mapping[str, str] | None = None,
    read: Callable[[Path], bytes] = Path.read_bytes,
) -> Policy:
    """Read, validate and build a policy file; ``env`` (if given) may override the mode. ``read``
    is how its bytes are read (a file watcher's snapshot: the bytes it checked)."""
    source = os.fspath(path)
    try:
        raw = read(Path(source))
    except OSError as exc:
        raise PolicyError(source, None, message=f"cannot read: {exc.strerror or exc}") from None
    return policy_from_bytes(raw, source, env)


def policy_from_bytes(raw: bytes, source: str, env: Mapping[str, str] | None = None) -> Policy:
    """Validate and build the policy these bytes of file `source` hold: a watcher parses exactly
    the bytes it checked, never a second read that may catch the file half rewritten."""
    policy = parse_policy(policy_data(raw, source), source)
    return apply_env_mode(policy, env) if env is not None else policy


def policy_data(raw: bytes, source: str) -> Mapping[str, Any]:
    """The mapping these bytes of policy file `source` hold, before validation: UTF-8, JSON for a
    `.json` file, else strict YAML (duplicate keys refused); PolicyError for anything else."""
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError:
        raise PolicyError(source, None, message="not UTF-8 text") from None
    if not text.strip():
        raise PolicyError(source, None, message="empty policy file")
    data = _decode(text, source, source.lower().endswith(".json"))
    if data is None:
        raise PolicyError(source, None, message="empty policy file (no settings)")
    return Reader(source).document(data)


def apply_env_mode(policy: Policy, env: Mapping[str, str]) -> Policy:
    """``EGRESSD_MODE`` overrides the file's mode; an empty value counts as unset."""
    value = env.get("EGRESSD_MODE")
    if value is None or value == "":
        return policy
    return policy.with_overrides(mode=cast(Mode, Reader("EGRESSD_MODE").choice(value, None, MODES)))


def preset_dirs() -> list[Path]:
    """Where presets are read from, first match wins: a checkout's `policies/`, then the package's
    data (the sandbox keeps both read-only: a preset the child rewrote would be every later run's)."""
    package = Path(__file__).resolve().parent.parent
    dirs = []
    repo = package.parent
    if (repo / "pyproject.toml").is_file() and (repo / "policies").is_dir():
        dirs.append(repo / "policies")
    dirs.append(package / "data" / "policies")
    return dirs


def builtin_policy_names() -> list[str]:
    """Names of the shipped presets (default, npm, pypi, github, ...)."""
    names: set[str] = set()
    for directory in preset_dirs():
        if directory.is_dir():
            names.update(p.stem for p in directory.glob("*.yaml"))
    return sorted(names)


def builtin_policy_path(name: str) -> Path:
    """Path of preset ``name``: the repo's ``policies/`` first, else the installed package data."""
    if not isinstance(name, str) or not _POLICY_NAME.fullmatch(name):
        raise PolicyError(str(name), None, message="not a built-in policy name")
    for directory in preset_dirs():
        candidate = directory / f"{name}.yaml"
        if candidate.is_file():
            return candidate
    available = ", ".join(builtin_policy_names()) or "none"
    raise PolicyError(name, None, message=f"no built-in policy of that name (available: {available})")
