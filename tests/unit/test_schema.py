"""The policy's one schema reader: every check names the exact key path, and a value of the wrong
type is a PolicyError, never another exception (a loader that crashes on `ports: [[]]` leaves the
proxy without a policy; one that reads `true` as port 1 reads a policy differently from how it was
written)."""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from egressd.policy import PolicyError, RuleError, parse_policy, parse_rule
from egressd.policy.model import MODES as POLICY_MODES
from egressd.policy.schema import Reader, item, join
from egressd.tools.importers import ImportError_, import_policy

READ = Reader("t.yaml")
MODES = ("enforce", "ask")


def _call(method: str, value: object, key: str) -> object:
    calls: dict[str, Callable[[], object]] = {
        "port": lambda: READ.port(value, key),
        "ports": lambda: READ.ports(value, key),
        "positive": lambda: READ.positive(value, key, 7),
        "count": lambda: READ.count(value, key),
        "integer": lambda: READ.integer(value, key),
        "bytes": lambda: READ.integer(value, key, 4096, "bytes"),
        "bool": lambda: READ.bool(value, key, True),
        "choice": lambda: READ.choice(value, key, MODES),
        "list": lambda: READ.list(value, key),
        "mapping": lambda: READ.mapping(value, key, ("allow", "ports")),
        "required": lambda: READ.mapping(value, key, ("allow",), required=True),
        "text": lambda: READ.text(value, key),
        "optional text": lambda: READ.text(value, key, required=False),
        "file": lambda: READ.file_path(value, key),
    }
    return calls[method]()


@pytest.mark.parametrize(
    ("method", "value", "key", "message"),
    [
        # YAML's `true` is a boolean, never the integer 1
        ("port", True, "ports[0]", "port must be an integer, not a boolean"),
        ("port", False, "ports[0]", "port must be an integer, not a boolean"),
        ("port", 1.0, "ports[0]", "port must be an integer, not float"),
        ("port", "443", "ports[0]", "port must be an integer, not a string"),
        ("port", None, "ports[0]", "port must be an integer, not null"),
        ("port", 0, "ports[0]", "port out of range 1-65535"),
        ("port", 65536, "ports[0]", "port out of range 1-65535"),
        ("port", 2**64 + 443, "ports[0]", "port out of range 1-65535"),
        ("port", -(2**70), "ports[0]", "port out of range 1-65535"),
        ("ports", [80, True], "ports[1]", "port must be an integer, not a boolean"),
        ("ports", "80", "ports", "must be a list, not a string"),
        ("positive", True, "timeouts.connect", "must be a number, not a boolean"),
        ("positive", "5", "timeouts.connect", "must be a number, not a string"),
        ("positive", math.nan, "timeouts.connect", "must be a positive, finite number"),
        ("positive", math.inf, "timeouts.connect", "must be a positive, finite number"),
        ("positive", -math.inf, "timeouts.connect", "must be a positive, finite number"),
        ("positive", 0, "timeouts.connect", "must be a positive, finite number"),
        ("positive", -0.0, "timeouts.connect", "must be a positive, finite number"),
        # an integer past a float's range is not a finite number of seconds
        ("positive", 10**400, "timeouts.connect", "must be a positive, finite number"),
        ("count", True, "limits.burst", "must be a positive integer or null"),
        ("count", 0, "limits.burst", "must be a positive integer or null"),
        ("count", 1.5, "limits.burst", "must be a positive integer or null"),
        ("count", math.nan, "limits.burst", "must be a positive integer or null"),
        ("integer", None, "preset.version", "must be a positive integer"),
        ("integer", True, "preset.version", "must be a positive integer"),
        ("bytes", 4095, "audit.max_queue_bytes", "must be an integer of at least 4096 (bytes)"),
        ("bytes", True, "audit.max_queue_bytes", "must be an integer of at least 4096 (bytes)"),
        ("bool", 1, "loopback.allow", "must be true or false, not int"),
        ("bool", "yes", "loopback.allow", "must be true or false, not a string"),
        ("bool", "true", "loopback.allow", "must be true or false, not a string"),
        ("choice", None, "mode", "must be one of enforce, ask"),
        ("choice", True, "mode", "must be one of enforce, ask"),
        ("choice", "ENFORCE", "mode", "must be one of enforce, ask"),
        ("choice", ["enforce"], "mode", "must be one of enforce, ask"),
        ("list", "a.test", "allow", "must be a list, not a string"),
        ("list", {"a.test": None}, "allow", "must be a list, not a mapping"),
        ("mapping", ["allow"], "loopback", "must be a mapping, not a list"),
        ("mapping", "allow", "loopback", "must be a mapping, not a string"),
        # keys that are not strings: named as written, never a TypeError
        ("mapping", {7: 1}, "loopback.7", "unknown key (expected one of: allow, ports)"),
        ("mapping", {None: 1}, "loopback.None", "unknown key (expected one of: allow, ports)"),
        ("mapping", {True: 1}, "loopback.True", "unknown key (expected one of: allow, ports)"),
        ("mapping", {(1, 2): 1}, "loopback.(1, 2)", "unknown key (expected one of: allow, ports)"),
        ("mapping", {"Allow": 1}, "loopback.Allow", "unknown key (expected one of: allow, ports)"),
        ("required", None, "builtin[0]", "must be a mapping, not null"),
        ("text", "", "preset.name", "must be a non-empty string"),
        ("text", " \t", "preset.name", "must be a non-empty string"),
        ("text", None, "preset.name", "must be a non-empty string"),
        ("text", 5, "preset.name", "must be a non-empty string"),
        ("optional text", 5, "preset.summary", "must be a string"),
        ("file", "", "upstream_proxy.credentials_file", "must be a file path"),
        ("file", "/run/a\0b", "upstream_proxy.credentials_file", "must be a file path"),
        ("file", ["/run/a"], "upstream_proxy.credentials_file", "must be a file path"),
    ],
)
def test_each_check_names_the_key_and_says_why(method: str, value: object, key: str, message: str) -> None:
    at = re.sub(r"(\[\d+\]|\.[^.]+)$", "", key) if method in ("ports", "mapping") else key
    with pytest.raises(PolicyError) as caught:
        _call(method, value, at)
    assert caught.value.key == key
    assert caught.value.message == message
    assert str(caught.value).startswith(f"t.yaml: {key}: ")


@pytest.mark.parametrize(
    ("method", "value", "expected"),
    [
        ("port", 1, 1),
        ("port", 65535, 65535),
        ("ports", [443, 80, 443], (443, 80)),
        ("ports", None, ()),
        ("positive", None, 7),
        ("positive", 0.001, 0.001),
        ("positive", 1e308, 1e308),
        ("count", None, None),
        ("count", 2**70, 2**70),  # a limit larger than anything reached is still a limit
        ("bool", None, True),
        ("bool", False, False),
        ("list", None, []),
        ("list", ("a",), ["a"]),
        ("mapping", None, {}),
        ("optional text", None, ""),
        ("choice", "ask", "ask"),
    ],
)
def test_what_each_check_accepts(method: str, value: object, expected: object) -> None:
    assert _call(method, value, "k") == expected


def test_key_paths_join_names_and_indexes() -> None:
    assert join("", "allow") == "allow"
    assert join(None, "allow") == "allow"
    assert item(join(join("profiles", "ci"), "ports"), 0) == "profiles.ci.ports[0]"
    assert [where for where, _ in READ.items(["a", "b", "c"], "allow")] == [
        "allow[0]",
        "allow[1]",
        "allow[2]",
    ]


def test_a_value_kept_out_of_the_message_is_not_echoed() -> None:
    """An upstream proxy URL written where its mapping belongs may carry credentials."""
    with pytest.raises(PolicyError) as caught:
        parse_policy({"upstream_proxy": "http://user:secret@p.test:3128"}, "t.yaml")
    assert caught.value.key == "upstream_proxy" and not caught.value.has_entry
    assert "secret" not in str(caught.value)
    assert "must be a mapping with url: http://HOST:PORT, not a string" in str(caught.value)


@pytest.mark.parametrize(
    ("document", "key", "message"),
    [
        ({"profiles": {"ci": {"ports": [True]}}}, "profiles.ci.ports[0]", "not a boolean"),
        ({"timeouts": {"connect": 10**400}}, "timeouts.connect", "positive, finite"),
        ({"limits": {"connect_timeout": math.inf}}, "limits.connect_timeout", "positive, finite"),
        ({"limits": {"requests_per_second": math.nan}}, "limits.requests_per_second", "positive, finite"),
        ({"limits": {"burst": True}}, "limits.burst", "positive integer or null"),
        ({"builtin": [{"host": "r.test", "paths": ["/a"], "methods": "GET"}]}, "builtin[0].methods", "list"),
        ({"builtin": [{"host": "r.test", "paths": ["/a"], 3: 1}]}, "builtin[0].3", "unknown key"),
        ({"providers": [{"name": "p", "version": True}]}, "providers[0].version", "positive integer"),
        ({"secrets": {"name": "api"}}, "secrets", "must be a list of secrets, not a mapping"),
        (
            {"secrets": [{"name": "api", "from": {"env": "K"}, "hosts": 5, "env": "API_KEY"}]},
            "secrets[0].hosts",
            "must be a list, not int",
        ),
        ({"secrets": [{"name": "api", "from": {"file": ""}}]}, "secrets[0].from.file", "must be a file path"),
        ({"secrets": ["api"]}, "secrets[0]", "must be a mapping {name, from, hosts, header|query, env}"),
        ({"secrets": [{"name": "api", 1: 2}]}, "secrets[0].1", "unknown key"),
        (
            {"upstream_proxy": {"url": "http://p.test:1", "connect_by": True}},
            "upstream_proxy.connect_by",
            "one of",
        ),
        ({"upstream_proxy": {"url": "http://p.test:1", "direct": "a.test"}}, "upstream_proxy.direct", "list"),
        (
            {"upstream_proxy": {"url": "http://p.test:1", "credentials_file": "/a\0b"}},
            "upstream_proxy.credentials_file",
            "must be a file path",
        ),
        ({"mode": None}, "mode", "must be one of"),
    ],
)
def test_nested_documents_name_the_exact_key(document: dict[str, Any], key: str, message: str) -> None:
    with pytest.raises(PolicyError) as caught:
        parse_policy({"version": 1, **document}, "t.yaml")
    assert caught.value.key == key
    assert message in caught.value.message


@pytest.mark.parametrize(
    ("rule", "message"),
    [
        ({"host": "a.test", "path": ["/x"]}, "path: unknown key (expected one of: host, paths, methods"),
        ({"host": "a.test", 5: 1}, "5: unknown key"),
        ({"paths": ["/x"]}, "host: None: must be a non-empty string"),
        ({"host": "a.test", "websocket": 1}, "websocket: 1: must be true or false, not int"),
        ({"host": "a.test", "paths": "/x"}, "paths: '/x': must be a list of path prefixes, not a string"),
        (
            {"host": "a.test", "paths": ["/x", "/y?z"]},
            "paths[1]: '/y?z': must not contain a query or fragment",
        ),
        ({"host": "a.test", "methods": ["GET", "G T"]}, "methods[1]: 'G T': not a valid HTTP method"),
        ({"host": "a.test", "exe": ["curl", "bin/x"]}, "exe[1]: 'bin/x': a path must be absolute"),
    ],
)
def test_a_rules_mapping_form_names_the_field(rule: dict[object, object], message: str) -> None:
    """The mapping form is read by the same reader, with key paths inside the rule; the policy's
    error names the rule itself (``allow[0]``) and the rule as written."""
    with pytest.raises(RuleError) as refused:
        parse_rule(rule)  # type: ignore[arg-type]
    assert str(refused.value).startswith(message)
    with pytest.raises(PolicyError) as caught:
        parse_policy({"allow": [rule]}, "t.yaml")
    assert caught.value.key == "allow[0]" and caught.value.entry == rule
    assert caught.value.message.startswith(message)


@pytest.mark.parametrize(
    ("settings_", "message"),
    [
        ({"network": []}, "network: []: must be a mapping, not a list"),
        (
            {"network": {"allowedDomains": "a.test"}},
            "network.allowedDomains: 'a.test': must be a list, not a string",
        ),
    ],
)
def test_the_importers_use_the_same_checks(settings_: dict[str, object], message: str) -> None:
    with pytest.raises(ImportError_) as caught:
        import_policy(json.dumps(settings_), "srt", source="in")
    assert str(caught.value) == message


# -- property: a wrong type anywhere is a PolicyError at exactly that key --------------------------
_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.integers(min_value=2**63, max_value=2**80),
    st.sampled_from([10**400, -(10**400), 0, 1, 65535, 65536, 4096]),
    st.floats(),
    st.text(max_size=12),
    st.binary(max_size=4),
    st.sampled_from(["address", "enforce", "80", "true", "", "\0", "/a", "a.test", "EGRESSD_X"]),
)
values = st.recursive(
    _scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=3),
        st.tuples(inner),
        st.dictionaries(
            st.one_of(st.text(max_size=6), st.integers(), st.booleans(), st.none()), inner, max_size=3
        ),
    ),
    max_leaves=8,
)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_port(value: object) -> bool:
    return _is_int(value) and 1 <= value <= 65535  # type: ignore[operator]


def _is_seconds(value: object) -> bool:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return False
    try:
        return value > 0 and math.isfinite(float(value))
    except OverflowError:
        return False


@dataclass(frozen=True)
class Hole:
    """A document with one value put at `key`; `fits` says which values that key takes."""

    key: str
    document: Callable[[object], dict[str, Any]]
    fits: Callable[[object], bool]
    says: str = ""  # what the message names, where the key is the rule's


def _optional(check: Callable[[object], bool]) -> Callable[[object], bool]:
    return lambda value: value is None or check(value)


_not_a_mapping = _optional(lambda value: isinstance(value, Mapping))  # a mapping's keys err deeper
_not_a_list = _optional(lambda value: isinstance(value, list | tuple))  # so do a list's items
HOLES = [
    Hole("ports[1]", lambda v: {"ports": [80, v]}, _is_port),
    Hole("profiles.ci.ports[0]", lambda v: {"profiles": {"ci": {"ports": [v]}}}, _is_port),
    Hole("loopback.ports[0]", lambda v: {"loopback": {"ports": [v]}}, _is_port),
    Hole("loopback.allow", lambda v: {"loopback": {"allow": v}}, _optional(lambda v: isinstance(v, bool))),
    Hole("websocket", lambda v: {"websocket": v}, _optional(lambda v: isinstance(v, bool))),
    Hole("timeouts.connect", lambda v: {"timeouts": {"connect": v}}, _optional(_is_seconds)),
    Hole("limits.dns_timeout", lambda v: {"limits": {"dns_timeout": v}}, _optional(_is_seconds)),
    Hole(
        "limits.max_connections",
        lambda v: {"limits": {"max_connections": v}},
        _optional(lambda v: _is_int(v) and v >= 1),
    ),
    Hole(
        "audit.max_queue_bytes",
        lambda v: {"audit": {"max_queue_bytes": v}},
        lambda v: _is_int(v) and v >= 4096,
    ),
    Hole("mode", lambda v: {"mode": v}, lambda v: isinstance(v, str) and v in POLICY_MODES),
    Hole(
        "builtin[0].websocket",
        lambda v: {"builtin": [{"host": "r.test", "paths": ["/a"], "websocket": v}]},
        _optional(lambda v: isinstance(v, bool)),
    ),
    Hole("builtin[0]", lambda v: {"builtin": [v]}, lambda v: isinstance(v, Mapping)),
    Hole(
        "upstream_proxy.connect_by",
        lambda v: {"upstream_proxy": {"url": "http://p.test:3128", "connect_by": v}},
        lambda v: v in ("address", "name"),
    ),
    Hole("private", lambda v: {"private": v}, _not_a_mapping),
    Hole("profiles.ci", lambda v: {"profiles": {"ci": v}}, _not_a_mapping),
    Hole("upstream_proxy", lambda v: {"upstream_proxy": v}, _not_a_mapping),
    Hole("allow", lambda v: {"allow": v}, _not_a_list),
    Hole("secrets", lambda v: {"secrets": v}, _not_a_list),
    Hole("resolver.nameservers", lambda v: {"resolver": {"nameservers": v}}, _not_a_list),
    # a rule's own fields: the error names the rule, the message the field
    Hole(
        "allow[0]",
        lambda v: {"allow": [{"host": "a.test", "websocket": v}]},
        _optional(lambda v: isinstance(v, bool)),
        says="websocket: ",
    ),
    Hole(
        "allow[0]",
        lambda v: {"allow": [{"host": "a.test", "paths": v}]},
        _not_a_list,
        says="paths: ",
    ),
]


@settings(
    max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much]
)
@given(hole=st.sampled_from(HOLES), value=values)
def test_a_wrong_type_is_a_policy_error_at_its_exact_key(hole: Hole, value: object) -> None:
    assume(not _safe_fits(hole, value))
    with pytest.raises(PolicyError) as caught:  # any other exception fails the test
        parse_policy({"version": 1, **hole.document(value)}, "prop.yaml")
    assert caught.value.key == hole.key, caught.value
    assert caught.value.message.startswith(hole.says), caught.value
    assert str(caught.value).startswith(f"prop.yaml: {hole.key}: ")


def _safe_fits(hole: Hole, value: object) -> bool:
    try:
        return bool(hole.fits(value))
    except TypeError:  # e.g. an unhashable value compared with `in`: not a fit
        return False


@settings(max_examples=300, deadline=None)
@given(
    method=st.sampled_from(
        ["port", "positive", "count", "bool", "choice", "list", "mapping", "text", "file"]
    ),
    path=st.lists(st.one_of(st.text(min_size=1, max_size=5), st.integers(0, 9)), min_size=1, max_size=4),
    value=values,
)
def test_every_check_raises_only_policy_error_naming_its_key(
    method: str, path: list[object], value: object
) -> None:
    key = ""
    for part in path:
        key = item(key, part) if isinstance(part, int) and key else join(key, str(part))
    try:
        _call(method, value, key)
    except PolicyError as exc:
        if method == "mapping" and isinstance(value, Mapping):
            assert exc.key is not None and exc.key.startswith(f"{key}.")
            assert exc.message.startswith("unknown key")
        else:
            assert exc.key == key
        assert str(exc).startswith(f"t.yaml: {exc.key}: ")
