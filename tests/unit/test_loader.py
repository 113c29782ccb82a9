"""Policy loading: complete or an error naming file, key and entry; never half-loaded."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from egressd.policy import (
    Client,
    Policy,
    PolicyError,
    apply_env_mode,
    builtin_policy_path,
    decide,
    default_policy,
    load_policy,
    parse_policy,
)
from egressd.policy.loader import builtin_policy_names

REPO = Path(__file__).resolve().parents[2]
PRESETS = ["default", "npm", "pypi", "github"]


def write(tmp_path: Path, text: str, name: str = "policy.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


def test_full_policy(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        """
version: 1
mode: ask
allow: [example.com, "*.cdn.test:443", 198.51.100.0/24, {host: api.test, paths: [/v1/], methods: [get]}]
deny: [bad.example.com]
loopback: {allow: false, ports: [3000, 8080]}
private: {allow: true, origins: ["http://192.168.1.10:8080", "https://nas.local", "http://[fd00::1]:81/"]}
builtin: [{host: registry.test, paths: [/api/], methods: [GET, HEAD]}]
inspect: [api.test]
ports: [80, 443]
credentials: {strip_on_host_change: [Authorization, X-Api-Key]}
limits: {connect_timeout: 2.5, dns_timeout: 1, idle_timeout: 60, max_response_bytes: 1048576}
resolver: {nameservers: ["192.0.2.53", "192.0.2.54:5353", "[2001:db8::53]:53", "2001:db8::54"]}
profiles:
  ci: {allow: [example.com], deny: [x.example.com], ports: [443]}
  open: {}
websocket: false
""",
    )
    policy = load_policy(path)
    assert policy.source == str(path)
    assert policy.mode == "ask"
    assert [r.text for r in policy.allow] == [
        "example.com",
        "*.cdn.test:443",
        "198.51.100.0/24",
        "api.test",
    ]
    assert policy.allow.rules[3].paths == ("/v1/",) and policy.allow.rules[3].methods == ("GET",)
    assert policy.loopback.allow is False and policy.loopback.ports == (3000, 8080)
    assert policy.private.allow is True
    assert [str(o) for o in policy.private.origins] == [
        "http://192.168.1.10:8080",
        "https://nas.local:443",
        "http://[fd00::1]:81",
    ]
    assert policy.builtin[0].host == "registry.test" and policy.builtin[0].paths == ("/api/",)
    assert len(policy.inspect) == 1
    assert policy.ports == (80, 443)
    assert policy.credentials.strip_on_host_change == ("authorization", "x-api-key")
    assert policy.limits.connect_timeout == 2.5 and policy.limits.max_response_bytes == 1048576
    assert policy.resolver.nameservers == (
        ("192.0.2.53", 53),
        ("192.0.2.54", 5353),
        ("2001:db8::53", 53),
        ("2001:db8::54", 53),
    )
    assert policy.profiles["ci"].ports == (443,)
    assert policy.profiles["ci"].allow is not None and len(policy.profiles["ci"].allow) == 1
    assert policy.profiles["open"].allow is None
    assert policy.websocket is False


def test_json_accepted(tmp_path: Path) -> None:
    data = {"version": 1, "mode": "enforce", "allow": ["example.com"], "loopback": {"allow": True}}
    policy = load_policy(write(tmp_path, json.dumps(data), "policy.json"))
    assert [r.text for r in policy.allow] == ["example.com"]
    # JSON content in a .yaml file is fine too (YAML is a superset).
    assert load_policy(write(tmp_path, json.dumps(data), "other.yaml")).allow == policy.allow


@pytest.mark.parametrize(
    ("text", "key", "entry", "fragment"),
    [
        ("version: 1\nallow: [a.test, b.test, 'exa mple.com']\n", "allow[2]", "exa mple.com", "whitespace"),
        ("version: 1\ndeny: ['*']\n", "deny[0]", "*", "wildcard"),
        ("version: 1\nallow: [a.test:99999]\n", "allow[0]", "a.test:99999", "range"),
        (
            "version: 1\nallow: [{host: a.test, path: [/x]}]\n",
            "allow[0]",
            {"host": "a.test", "path": ["/x"]},
            "unknown",
        ),
        ("version: 2\n", "version", 2, "version"),
        ("version: '1'\n", "version", "1", "version"),
        ("version: 1\nmode: block\n", "mode", "block", "enforce"),
        ("version: 1\nmode: on\n", "mode", "on", "enforce"),
        ("version: 1\nallow: example.com\n", "allow", "example.com", "list"),
        ("version: 1\nloopback: {allow: yes}\n", "loopback.allow", "yes", "true or false"),
        ("version: 1\nloopback: {allow: 1}\n", "loopback.allow", 1, "true or false"),
        ("version: 1\nloopback: {ports: [0]}\n", "loopback.ports[0]", 0, "range"),
        ("version: 1\nports: [80, '443']\n", "ports[1]", "443", "integer"),
        ("version: 1\nports: [true]\n", "ports[0]", True, "integer"),
        ("version: 1\nlimits: {connect_timeout: 0}\n", "limits.connect_timeout", 0, "positive"),
        ("version: 1\nlimits: {dns_timeout: -1}\n", "limits.dns_timeout", -1, "positive"),
        ("version: 1\nlimits: {idle_timeout: '5'}\n", "limits.idle_timeout", "5", "number"),
        ("version: 1\nlimits: {max_response_bytes: 0}\n", "limits.max_response_bytes", 0, "positive"),
        (
            "version: 1\nresolver: {nameservers: [dns.google]}\n",
            "resolver.nameservers[0]",
            "dns.google",
            "IP",
        ),
        (
            "version: 1\nresolver: {nameservers: ['1.1.1.1:0']}\n",
            "resolver.nameservers[0]",
            "1.1.1.1:0",
            "port",
        ),
        (
            "version: 1\nprivate: {origins: ['192.168.1.1:80']}\n",
            "private.origins[0]",
            "192.168.1.1:80",
            "http",
        ),
        (
            "version: 1\nprivate: {origins: ['http://u@h.test']}\n",
            "private.origins[0]",
            "http://u@h.test",
            "credentials",
        ),
        (
            "version: 1\nprivate: {origins: ['http://h.test/x']}\n",
            "private.origins[0]",
            "http://h.test/x",
            "path",
        ),
        (
            "version: 1\nprivate: {origins: ['http://*.h.test']}\n",
            "private.origins[0]",
            "http://*.h.test",
            "exact",
        ),
        ("version: 1\nbuiltin: [{host: r.test}]\n", "builtin[0].paths", None, "at least one path"),
        ("version: 1\nbuiltin: [{host: r.test, paths: ['/a/*']}]\n", "builtin[0].paths[0]", "/a/*", "fixed"),
        (
            "version: 1\nbuiltin: [{host: '*.r.test', paths: [/a]}]\n",
            "builtin[0].host",
            "*.r.test",
            "invalid label",
        ),
        (
            "version: 1\nbuiltin: [{host: r.test, paths: [/a], methods: [1]}]\n",
            "builtin[0].methods[0]",
            1,
            "method",
        ),
        ("version: 1\nbuiltin: [r.test]\n", "builtin[0]", "r.test", "mapping"),
        (
            "version: 1\ncredentials: {strip_on_host_change: ['bad header']}\n",
            "credentials.strip_on_host_change[0]",
            "bad header",
            "header",
        ),
        (
            "version: 1\nprofiles: {ci: {allow: [ok.test, 'bad host']}}\n",
            "profiles.ci.allow[1]",
            "bad host",
            "host",
        ),
        ("version: 1\nprofiles: {ci: {ports: [70000]}}\n", "profiles.ci.ports[0]", 70000, "range"),
        ("version: 1\nprofiles: [ci]\n", "profiles", ["ci"], "mapping"),
        ("version: 1\nprofiles: {'bad name': {}}\n", "profiles", "bad name", "profile names"),
        ("version: 1\nwebsocket: maybe\n", "websocket", "maybe", "true or false"),
        ("version: 1\nrefusal_pages: html\n", "refusal_pages", "html", "one of status, tls"),
        (
            "version: 1\naudit: {on_failure: ignore}\n",
            "audit.on_failure",
            "ignore",
            "one of refuse, continue",
        ),
        ("version: 1\naudit: {on_failure: true}\n", "audit.on_failure", True, "one of refuse, continue"),
        ("version: 1\naudit: {on_failure: null}\n", "audit.on_failure", None, "one of refuse, continue"),
        ("version: 1\naudit: {max_queue_bytes: 100}\n", "audit.max_queue_bytes", 100, "at least 4096"),
        ("version: 1\naudit: {max_queue_bytes: 65536.5}\n", "audit.max_queue_bytes", 65536.5, "integer"),
        ("version: 1\naudit: {max_queue_bytes: true}\n", "audit.max_queue_bytes", True, "integer"),
        ("version: 1\naudit: {file: /tmp/a}\n", "audit.file", None, "unknown key"),
        ("version: 1\naudit: refuse\n", "audit", "refuse", "mapping"),
    ],
)
def test_errors_name_file_key_entry(
    tmp_path: Path, text: str, key: str, entry: object, fragment: str
) -> None:
    path = write(tmp_path, text)
    with pytest.raises(PolicyError) as info:
        load_policy(path)
    error = info.value
    assert error.file == str(path)
    assert error.key == key
    if entry is not None:
        assert error.entry == entry
    assert fragment.lower() in str(error).lower()
    assert str(error).startswith(f"{path}: {key}")


def test_refusal_pages(tmp_path: Path) -> None:
    """Default: the 403 on the CONNECT. `tls` needs egressd's CA even with no rule to inspect."""
    assert load_policy(write(tmp_path, "version: 1\n")).refusal_pages == "status"
    assert not load_policy(write(tmp_path, "version: 1\n")).needs_ca
    policy = load_policy(write(tmp_path, "version: 1\nrefusal_pages: tls\n"))
    assert policy.refusal_pages == "tls" and policy.needs_ca and not policy.needs_inspection


def test_audit_on_failure(tmp_path: Path) -> None:
    """Default: refuse what cannot be recorded; `continue` and the queue bound are read as written."""
    default = load_policy(write(tmp_path, "version: 1\n")).audit
    assert (default.on_failure, default.max_queue_bytes) == ("refuse", 4 * 1024 * 1024)
    policy = load_policy(
        write(tmp_path, "version: 1\naudit: {on_failure: continue, max_queue_bytes: 4096}\n")
    )
    assert (policy.audit.on_failure, policy.audit.max_queue_bytes) == ("continue", 4096)


def test_error_message_format() -> None:
    with pytest.raises(PolicyError) as info:
        parse_policy({"version": 1, "allow": ["a.test", "b.test", "exa mple.com"]}, "policy.yaml")
    assert str(info.value) == "policy.yaml: allow[2]: 'exa mple.com': not a valid host (contains whitespace)"


@pytest.mark.parametrize(
    ("data", "key"),
    [
        ({"version": 1, "alow": []}, "alow"),
        ({"version": 1, "loopback": {"allowed": True}}, "loopback.allowed"),
        ({"version": 1, "private": {"origin": []}}, "private.origin"),
        ({"version": 1, "limits": {"timeout": 1}}, "limits.timeout"),
        ({"version": 1, "resolver": {"servers": []}}, "resolver.servers"),
        ({"version": 1, "credentials": {"strip": []}}, "credentials.strip"),
        ({"version": 1, "profiles": {"ci": {"mode": "allow"}}}, "profiles.ci.mode"),
        ({"version": 1, "builtin": [{"host": "r.test", "paths": ["/a"], "path": "/b"}]}, "builtin[0].path"),
        ({"version": 1, 7: 1}, "7"),
    ],
)
def test_unknown_keys(data: dict[object, object], key: str) -> None:
    with pytest.raises(PolicyError) as info:
        parse_policy(data, "p.yaml")
    assert info.value.key == key
    assert "unknown key" in str(info.value)


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("", "empty"),
        ("   \n# only a comment\n", "empty"),
        ("- a\n- b\n", "mapping"),
        ("just a string\n", "mapping"),
        ("version: 1\nmode: enforce\nmode: allow\n", "duplicate"),
        # unhashable keys (found by fuzz/fuzz_policy.py): a clear error, not a TypeError
        ("version: 1\n[a, b]: 1\n", "mapping key must be a scalar"),
        ("version: 1\n? {a: 1}\n: x\n", "mapping key must be a scalar"),
        ("version: 1\nlimits:\n  ? !!set {a}\n  : 1\n", "mapping key must be a scalar"),
        ("version: 1\nallow: [a.test\n", "invalid YAML"),
        ("version: 1\nallow: !!python/object:os.system {}\n", "invalid YAML"),
    ],
)
def test_bad_files(tmp_path: Path, text: str, fragment: str) -> None:
    path = write(tmp_path, text)
    with pytest.raises(PolicyError) as info:
        load_policy(path)
    assert info.value.file == str(path)
    assert fragment in str(info.value)


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ('{"version": 1, "mode": "enforce", "mode": "allow"}', "duplicate"),
        ("version: 1\n", "invalid JSON"),
        ('{"version": 1, "limits": {"connect_timeout": NaN}}', "invalid JSON"),
        ("[1, 2]", "mapping"),
    ],
)
def test_bad_json(tmp_path: Path, text: str, fragment: str) -> None:
    with pytest.raises(PolicyError) as info:
        load_policy(write(tmp_path, text, "p.json"))
    assert fragment in str(info.value)


def test_the_rules_listed_from_the_file_are_read_as_strictly_as_the_policy(tmp_path: Path) -> None:
    """The dashboard lists the rules the file holds itself; a file the loader refuses (a duplicate
    key) lists none, never the rules of the copy of the key a lax reader would keep."""
    from egressd.session import load_policy_data

    good = write(tmp_path, "version: 1\nallow: [a.test]\n", "good.yaml")
    assert load_policy_data(good) == {"version": 1, "allow": ["a.test"]}
    twice = write(tmp_path, "version: 1\nallow: [a.test]\nallow: [b.test]\n", "twice.yaml")
    assert load_policy_data(twice) is None
    twice_json = write(tmp_path, '{"version": 1, "allow": ["a.test"], "allow": ["b.test"]}', "twice.json")
    assert load_policy_data(twice_json) is None
    assert load_policy_data(tmp_path / "missing.yaml") is None


def test_unreadable_and_binary(tmp_path: Path) -> None:
    with pytest.raises(PolicyError, match="cannot read"):
        load_policy(tmp_path / "missing.yaml")
    path = tmp_path / "bin.yaml"
    path.write_bytes(b"\xff\xfe\x00garbage")
    with pytest.raises(PolicyError, match="UTF-8"):
        load_policy(path)


def test_yaml_off_is_the_mode_not_false(tmp_path: Path) -> None:
    assert load_policy(write(tmp_path, "version: 1\nmode: off\n")).mode == "off"


def test_null_sections_are_empty(tmp_path: Path) -> None:
    policy = load_policy(write(tmp_path, "version: 1\nallow:\ndeny:\nloopback:\nprofiles:\n"))
    assert policy == default_policy()


def test_version_defaults_to_1() -> None:
    assert parse_policy({}, "x").version == 1


def test_never_half_loads(tmp_path: Path) -> None:
    good = load_policy(write(tmp_path, "version: 1\nallow: [a.test]\n", "good.yaml"))
    bad = write(tmp_path, "version: 1\nallow: [b.test]\nports: [0]\n", "bad.yaml")
    with pytest.raises(PolicyError):
        load_policy(bad)
    # the previously loaded policy is untouched and usable
    assert [r.text for r in good.allow] == ["a.test"]
    assert decide("b.test:443", Client(), good).reason == "not_allowlisted"


def test_env_mode_override(tmp_path: Path) -> None:
    path = write(tmp_path, "version: 1\nmode: enforce\n")
    assert load_policy(path).mode == "enforce"
    assert load_policy(path, env={}).mode == "enforce"
    assert load_policy(path, env={"EGRESSD_MODE": "allow"}).mode == "allow"
    assert load_policy(path, env={"EGRESSD_MODE": ""}).mode == "enforce"
    assert decide("x.test:443", Client(), load_policy(path, env={"EGRESSD_MODE": "off"})).reason == "mode_off"
    with pytest.raises(PolicyError) as info:
        load_policy(path, env={"EGRESSD_MODE": "permissive"})
    assert "EGRESSD_MODE" in str(info.value) and "permissive" in str(info.value)
    assert apply_env_mode(default_policy(), {"EGRESSD_MODE": "ask"}).mode == "ask"


def test_with_overrides() -> None:
    policy = default_policy().with_overrides(
        allow=["a.test", "10.0.0.0/8"], deny=["b.a.test"], mode="ask", nameservers=["192.0.2.1:5353"]
    )
    assert [r.text for r in policy.allow] == ["a.test", "10.0.0.0/8"]
    assert [r.text for r in policy.deny] == ["b.a.test"]
    assert policy.mode == "ask"
    assert policy.resolver.nameservers == (("192.0.2.1", 5353),)
    assert default_policy().with_overrides() == default_policy()
    for kwargs, name in [
        ({"allow": ["ok.test", "bad host"]}, "--allow"),
        ({"deny": ["*"]}, "--deny"),
        ({"mode": "nope"}, "--mode"),
        ({"nameservers": ["resolver.test"]}, "--nameserver"),
    ]:
        with pytest.raises(PolicyError) as info:
            default_policy().with_overrides(**kwargs)  # type: ignore[arg-type]
        assert name in str(info.value)


@pytest.mark.parametrize("name", PRESETS)
def test_presets_load_and_match_package_data(name: str) -> None:
    path = builtin_policy_path(name)
    assert path == REPO / "policies" / f"{name}.yaml"
    policy = load_policy(path)
    assert isinstance(policy, Policy) and policy.mode == "enforce"
    packaged = REPO / "egressd" / "data" / "policies" / f"{name}.yaml"
    assert packaged.read_bytes() == path.read_bytes()


def test_preset_names() -> None:
    assert set(PRESETS) <= set(builtin_policy_names())
    with pytest.raises(PolicyError):
        builtin_policy_path("no-such-preset")
    with pytest.raises(PolicyError):
        builtin_policy_path("../default")


def test_default_preset_equals_default_policy() -> None:
    assert load_policy(builtin_policy_path("default")) == default_policy()


@pytest.mark.parametrize(
    ("preset", "target", "allowed"),
    [
        ("npm", "registry.npmjs.org:443", True),
        ("npm", "registry.yarnpkg.com:443", True),
        ("npm", "registry.npmjs.org:80", False),
        ("npm", "evil.test:443", False),
        ("pypi", "https://pypi.org/simple/requests/", True),
        ("pypi", "https://files.pythonhosted.org/packages/x.whl", True),
        ("pypi", "http://pypi.org/simple/", False),
        ("github", "github.com:443", True),
        ("github", "github.com:22", True),
        ("github", "api.github.com:80", False),
        ("github", "codeload.github.com:443", True),
        ("github", "objects.githubusercontent.com:443", True),
        ("github", "raw.githubusercontent.com:443", True),
        ("github", "github.com.evil.test:443", False),
        ("default", "example.com:443", False),
        ("default", "localhost:3000", True),
    ],
)
def test_presets_decide(preset: str, target: str, allowed: bool) -> None:
    policy = load_policy(builtin_policy_path(preset))
    assert decide(target, Client(), policy).allowed is allowed


def test_ask_timeout(tmp_path: Path) -> None:
    assert parse_policy({"version": 1}, "t").ask_timeout == 60
    assert parse_policy({"version": 1, "ask_timeout": 2.5}, "t").ask_timeout == 2.5
    for bad in (0, -1, "60", True, float("inf")):
        with pytest.raises(PolicyError, match="ask_timeout"):
            parse_policy({"version": 1, "ask_timeout": bad}, "t")


def test_timeouts_section_and_the_older_spellings() -> None:
    """`timeouts:` holds every timeout; `limits.*_timeout` and `ask_timeout` still load."""
    default = parse_policy({"version": 1}, "t")
    assert default.limits.response_timeout == 300
    both = parse_policy(
        {
            "version": 1,
            "timeouts": {"connect": 1, "dns": 2, "header": 3, "response": 4, "idle": 5, "ask": 6},
        },
        "t",
    )
    limits = both.limits
    assert (limits.connect_timeout, limits.dns_timeout, limits.header_timeout) == (1, 2, 3)
    assert (limits.response_timeout, limits.idle_timeout, both.ask_timeout) == (4, 5, 6)
    older = parse_policy(
        {
            "version": 1,
            "limits": {"connect_timeout": 1, "dns_timeout": 2, "header_timeout": 3, "idle_timeout": 5},
            "ask_timeout": 6,
            "timeouts": {"response": 4},
        },
        "t",
    )
    assert older == both


@pytest.mark.parametrize(
    ("data", "key", "message"),
    [
        (
            {"timeouts": {"dns": 1}, "limits": {"dns_timeout": 1}},
            "timeouts.dns",
            "also given as limits.dns_timeout",
        ),
        ({"timeouts": {"ask": 1}, "ask_timeout": 2}, "timeouts.ask", "also given as ask_timeout"),
        ({"timeouts": {"response": 0}}, "timeouts.response", "positive"),
        ({"timeouts": {"response": "300"}}, "timeouts.response", "number"),
        ({"timeouts": {"response": float("nan")}}, "timeouts.response", "positive"),
        ({"timeouts": {"read": 1}}, "timeouts.read", "unknown key"),
        ({"timeouts": [1]}, "timeouts", "mapping"),
        ({"limits": {"dns_timeout": -1}}, "limits.dns_timeout", "positive"),
    ],
)
def test_timeouts_errors_name_the_key(data: dict, key: str, message: str) -> None:
    with pytest.raises(PolicyError) as caught:
        parse_policy({"version": 1, **data}, "t")
    assert caught.value.key == key and message in str(caught.value)
