"""THE decision: one test per reason code at least, plus the order between the steps."""

from __future__ import annotations

import copy
import ipaddress
import pickle
from dataclasses import replace
from typing import Any

import pytest

from egressd.policy import (
    AddressClass,
    Client,
    Decision,
    Host,
    Policy,
    PolicyError,
    Target,
    decide,
    decide_written,
    default_policy,
    filter_addresses,
    make_target,
    parse_policy,
    resolution_refusal,
)

ip = ipaddress.ip_address
NOBODY = Client()
SELF = [(ip("127.0.0.1"), 8080)]


def pol(**data: Any) -> Policy:
    return parse_policy({"version": 1, **data}, "test.yaml")


def check(target: Target | str, policy: Policy, client: Client = NOBODY, **kw: Any) -> Decision:
    return decide(target, client, policy, **kw)


def connect(host: str, port: int) -> Target:
    return make_target(host, port, scheme="connect", method="CONNECT")


def get(url_host: str, port: int, path: str, method: str = "GET", scheme: str = "http") -> Target:
    return make_target(url_host, port, scheme=scheme, path=path, method=method)


# -- step 1: invalid targets --------------------------------------------------------------------


@pytest.mark.parametrize(
    "target",
    [
        "http://allowed.test@evil.test/",
        "exa mple.com:443",
        "example.com",  # no port
        "256.0.0.1:80",
        "example.com:0",
        Target(Host(name="EXA MPLE.com"), 443),
        Target(Host(name=None, ip=None), 443),
        Target(Host(name="example.com"), 0),
        Target(Host(name="example.com"), 70000),
        Target(Host(name="a..b"), 1),
    ],
)
def test_invalid_target(target: Target | str) -> None:
    decision = check(target, pol(mode="allow"))
    assert (decision.allowed, decision.reason) == (False, "invalid_target")


def test_userinfo_is_not_read_as_the_allowed_host() -> None:
    policy = pol(allow=["allowed.test"])
    assert check("http://allowed.test@evil.test/", policy).reason == "invalid_target"
    assert check("http://allowed.test.evil.test/", policy).reason == "not_allowlisted"
    assert check("http://allowed.test/", policy).reason == "allowlist"


def test_target_is_recanonicalised() -> None:
    decision = check(Target(Host(name="EXAMPLE.com."), 443), pol(allow=["example.com"]))
    assert decision.allowed and decision.target is not None
    assert decision.target.host == Host(name="example.com")


# -- step 1: a Target from make_target is trusted; any other Target is canonicalised again ------

TRUST_POLICY = pol(
    allow=["example.com", "10.0.0.0/8:5432", "[2001:db8::/32]", {"host": "api.test", "paths": ["/v1"]}],
    deny=["bad.example.com"],
    loopback={"ports": [8080]},
)
MADE = [
    connect("example.com", 443),
    connect("a.b.EXAMPLE.com.", 443),
    connect("bad.example.com", 443),
    connect("10.1.2.3", 5432),
    connect("10.1.2.3", 443),
    connect("0x0a.1.515", 5432),
    connect("[2001:db8::7]", 443),
    connect("[::ffff:10.0.0.1]", 5432),
    connect("169.254.169.254", 80),
    connect("127.0.0.1", 8080),
    connect("app.localhost", 9),
    connect("bücher.example.com", 443),
    get("api.test", 443, "/v1/x", scheme="https"),
    get("api.test", 443, "/v2", method="post", scheme="https"),
    make_target("api.test", 443),
]


def rebuilt(target: Target) -> Target:
    """The same fields in a Target make_target did not build: decided the slow, general way."""
    host = Host(target.host.name, target.host.ip)
    return Target(host, target.port, target.scheme, target.path, target.method)


@pytest.mark.parametrize("made", MADE, ids=lambda t: f"{t.method} {t.authority()}{t.path or ''}")
def test_a_target_decides_as_its_written_parts_and_its_rebuilt_copy(made: Target) -> None:
    written = decide_written(
        made.host.text,
        made.port,
        NOBODY,
        TRUST_POLICY,
        scheme=made.scheme,
        path=made.path,
        method=made.method,
    )
    given, rebuilt_one = check(made, TRUST_POLICY), check(rebuilt(made), TRUST_POLICY)
    assert written == given == rebuilt_one and repr(written) == repr(given) == repr(rebuilt_one)
    assert written.self_addresses == given.self_addresses == rebuilt_one.self_addresses


@pytest.mark.parametrize("made", MADE[:4], ids=lambda t: t.authority())
def test_copies_of_a_made_target_decide_the_same(made: Target) -> None:
    expected = check(made, TRUST_POLICY)
    for copied in (copy.copy(made), copy.deepcopy(made), pickle.loads(pickle.dumps(made))):
        assert copied == made and check(copied, TRUST_POLICY) == expected


def swapped(field_name: str, value: object, on_host: bool = False) -> Target:
    """A made Target with one field changed behind the frozen dataclass's back."""
    target = make_target("example.com", 443, scheme="connect", method="CONNECT")
    object.__setattr__(target.host if on_host else target, field_name, value)
    return target


class SubTarget(Target):
    pass


@pytest.mark.parametrize(
    ("odd", "reason", "host"),
    [
        (Target(Host(name="EXAMPLE.com."), 443), "allowlist", "example.com"),
        (replace(connect("example.com", 443), port=True), "invalid_target", None),
        (
            replace(connect("example.com", 443), host=Host(name="BAD.example.com")),
            "denylist",
            "bad.example.com",
        ),
        (replace(connect("example.com", 443), method="get post"), "invalid_target", None),
        (replace(connect("example.com", 443), scheme="gopher"), "invalid_target", None),
        (swapped("port", True), "invalid_target", None),
        (swapped("port", 0), "invalid_target", None),
        (swapped("scheme", "CONNECT"), "allowlist", "example.com"),
        (swapped("method", "connect"), "allowlist", "example.com"),
        (swapped("name", "BAD.Example.COM.", on_host=True), "denylist", "bad.example.com"),
        (swapped("name", "a..b", on_host=True), "invalid_target", None),
        (swapped("host", Host(name="EXA MPLE.com")), "invalid_target", None),
        (SubTarget(Host(name="EXAMPLE.com"), 443, "connect", None, "CONNECT"), "allowlist", "example.com"),
    ],
)
def test_other_targets_are_canonicalised_again(odd: Target, reason: str, host: str | None) -> None:
    decision = check(odd, TRUST_POLICY)
    assert decision.reason == reason
    if host is None:
        assert decision.target is None
    else:
        assert decision.target is not None and decision.target is not odd
        assert decision.target.host == Host(name=host) and decision.target.host.text == host


# -- step 2: self -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "target",
    [
        "127.0.0.1:8080",
        "localhost:8080",
        "LOCALHOST.:8080",
        "app.localhost:8080",
        "127.1:8080",
        "0x7f000001:8080",
        "2130706433:8080",
        "[::1]:8080",
        "[::ffff:127.0.0.1]:8080",
        "127.0.0.2:8080",
        "http://localhost:8080/",
    ],
)
def test_self_any_loopback_spelling(target: str) -> None:
    decision = check(target, default_policy(), self_addresses=SELF)
    assert (decision.allowed, decision.reason, decision.rule) == (False, "self", "self 127.0.0.1:8080")


def test_self_beats_loopback_and_mode_off() -> None:
    assert check("127.0.0.1:8080", default_policy()).reason == "loopback"
    assert check("127.0.0.1:8080", pol(mode="off"), self_addresses=SELF).reason == "self"
    assert check("127.0.0.1:8081", default_policy(), self_addresses=SELF).reason == "loopback"


def test_self_on_unspecified_and_non_loopback() -> None:
    wildcard = [(ip("0.0.0.0"), 3128)]
    assert check("127.0.0.5:3128", default_policy(), self_addresses=wildcard).reason == "self"
    lan = [(ip("192.168.1.5"), 3128)]
    policy = pol(allow=["192.168.0.0/16"])
    assert check("192.168.1.5:3128", policy, self_addresses=lan).reason == "self"
    assert check("192.168.1.6:3128", policy, self_addresses=lan).reason == "allowlist"
    # strings are accepted for convenience
    assert check("[::1]:9", default_policy(), self_addresses=[("::1", 9)]).reason == "self"


# -- step 3: mode off ---------------------------------------------------------------------------


def test_mode_off() -> None:
    decision = check("example.com:443", pol(mode="off", allow=["example.com"]))
    assert (decision.allowed, decision.reason, decision.rule) == (False, "mode_off", "mode: off")
    assert check("127.0.0.1:80", pol(mode="off")).reason == "mode_off"


# -- step 4: always-refused addresses -----------------------------------------------------------

ALLOW_ALL = pol(mode="allow", allow=["0.0.0.0/0", "::/0"], private={"allow": True})


@pytest.mark.parametrize(
    "target",
    [
        "169.254.169.254:80",
        "http://169.254.169.254/latest/meta-data/",
        "2852039166:80",
        "0xa9fea9fe:80",
        "0251.0376.0251.0376:80",
        "169.254.43518:80",
        "[::ffff:169.254.169.254]:80",
        "[::ffff:a9fe:a9fe]:80",
        "[64:ff9b::a9fe:a9fe]:80",
        "[2002:a9fe:a9fe::]:80",
        "[2001:0:4136:e378:8000:63bf:5601:5601]:80",  # Teredo client 169.254.169.254
        "[fd00:ec2::254]:80",
        "100.100.100.200:80",
        "168.63.129.16:80",
        "0.0.0.0:80",
        "0:80",
        "[::]:80",
        "224.0.0.1:80",
        "[ff02::1]:80",
        "255.255.255.255:80",
        "240.0.0.1:80",
        "[fe80::1]:80",
        "[fec0::1]:80",
    ],
)
def test_forbidden_in_every_spelling_even_when_everything_is_allowed(target: str) -> None:
    decision = check(target, ALLOW_ALL)
    assert (decision.allowed, decision.reason) == (False, "forbidden_address")


def test_forbidden_beats_explicit_allow_rule() -> None:
    policy = pol(allow=["169.254.169.254", "169.254.0.0/16:80"], loopback={"allow": True})
    assert check("169.254.169.254:80", policy).reason == "forbidden_address"


# -- step 5: deny -------------------------------------------------------------------------------


def test_deny_beats_allow() -> None:
    policy = pol(mode="allow", allow=["example.com", "10.0.0.0/8"], deny=["*.evil.example.com", "10.0.0.5"])
    decision = check("x.evil.example.com:443", policy)
    assert (decision.allowed, decision.reason, decision.rule) == (
        False,
        "denylist",
        "deny: *.evil.example.com",
    )
    assert check("evil.example.com:443", policy).reason == "allowlist"
    assert check("10.0.0.5:22", policy).reason == "denylist"
    assert check("10.0.0.6:22", policy).reason == "allowlist"


def test_deny_beats_loopback() -> None:
    assert check("localhost:5432", pol(deny=["localhost:5432"])).reason == "denylist"
    assert check("localhost:5432", pol(deny=["127.0.0.0/8:5432"])).reason == "denylist"
    assert check("[::1]:5432", pol(deny=["::1"])).reason == "denylist"
    assert check("localhost:5433", pol(deny=["localhost:5432"])).reason == "loopback"


def test_deny_in_any_host_spelling() -> None:
    policy = pol(mode="allow", deny=["bücher.example", "203.0.113.0/24"])
    for target in ["xn--bcher-kva.example:443", "BÜCHER.example.:443", "www.bücher.example:80"]:
        assert check(target, policy).reason == "denylist"
    for target in ["203.0.113.9:80", "3405803785:80", "[::ffff:cb00:7109]:80"]:
        assert check(target, policy).reason == "denylist"


def test_deny_with_paths() -> None:
    policy = pol(mode="allow", deny=[{"host": "api.test", "paths": ["/admin"]}])
    assert check(get("api.test", 80, "/admin/x"), policy).reason == "denylist"
    assert check(get("api.test", 80, "/api/../admin"), policy).reason == "denylist"
    allowed = check(get("api.test", 80, "/public"), policy)
    assert allowed.allowed and not allowed.needs_inspection
    tunnel = check(connect("api.test", 443), policy)
    assert tunnel.allowed and tunnel.needs_inspection  # the denied path is not visible yet


# -- step 6: loopback ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("target", "address"),
    [
        ("127.0.0.1:3000", "127.0.0.1"),
        ("127.1:3000", "127.0.0.1"),
        ("127.9.9.9:3000", "127.9.9.9"),
        ("[::1]:3000", "::1"),
        ("[::ffff:127.0.0.1]:3000", "127.0.0.1"),
        ("localhost:3000", "127.0.0.1"),
        ("LocalHost.:3000", "127.0.0.1"),
        ("app.localhost:3000", "127.0.0.1"),
        ("http://localhost:3000/x", "127.0.0.1"),
    ],
)
def test_loopback_allowed_with_empty_allowlist(target: str, address: str) -> None:
    decision = check(target, default_policy())
    assert (decision.allowed, decision.reason, decision.rule) == (True, "loopback", "loopback.allow")
    assert decision.addresses == (ip(address),)
    assert not decision.needs_resolution


def test_loopback_disabled() -> None:
    decision = check("localhost:3000", pol(loopback={"allow": False}))
    assert (decision.allowed, decision.reason, decision.rule) == (
        False,
        "loopback_disabled",
        "loopback.allow: false",
    )
    # an allow rule does not lift it: loopback is decided at step 6
    assert (
        check("127.0.0.1:3000", pol(loopback={"allow": False}, allow=["127.0.0.1"])).reason
        == "loopback_disabled"
    )


def test_loopback_ports() -> None:
    policy = pol(loopback={"ports": [3000, 8080]}, ports=[443])
    decision = check("127.0.0.1:22", policy)
    assert (decision.allowed, decision.reason) == (False, "loopback_port")
    assert decision.rule == "loopback.ports: [3000, 8080]"
    assert check("[::1]:3000", policy).reason == "loopback"
    assert check("localhost:8080", policy).reason == "loopback"  # not subject to `ports: [443]`


# -- step 7: built-in allowances ----------------------------------------------------------------

BUILTIN = pol(builtin=[{"host": "registry.test", "paths": ["/api/", "/v2/index"]}])


def test_builtin_allows_path_and_method() -> None:
    decision = check(get("registry.test", 80, "/api/pkg?x=1"), BUILTIN)
    assert (decision.allowed, decision.reason) == (True, "builtin")
    assert decision.rule == "builtin: registry.test /api/ GET,HEAD"
    assert decision.needs_resolution and not decision.needs_inspection
    assert check(get("registry.test", 80, "/v2/index", "HEAD"), BUILTIN).reason == "builtin"
    assert check("http://registry.test/api/x", BUILTIN).reason == "builtin"


def test_builtin_connect_needs_inspection() -> None:
    decision = check(connect("registry.test", 443), BUILTIN)
    assert (decision.allowed, decision.reason, decision.needs_inspection) == (True, "builtin", True)


@pytest.mark.parametrize(
    ("path", "method"),
    [
        ("/other", "GET"),
        ("/apix", "GET"),
        ("/api", "GET"),
        ("/api/../admin", "GET"),
        ("/api/%2e%2e/admin", "GET"),
        ("/api/x%2F..%2F..%2Fadmin", "GET"),
        ("/v2/indexes", "GET"),
        ("/api/x", "POST"),
        ("/api/x", "DELETE"),
    ],
)
def test_builtin_path_refused(path: str, method: str) -> None:
    decision = check(get("registry.test", 80, path, method), BUILTIN)
    assert (decision.allowed, decision.reason) == (False, "builtin_path")


def test_builtin_subdomain_is_not_builtin() -> None:
    assert check(get("x.registry.test", 80, "/api/"), BUILTIN).reason == "not_allowlisted"


def test_builtin_host_also_allowlisted() -> None:
    policy = pol(allow=["registry.test"], builtin=[{"host": "registry.test", "paths": ["/api/"]}])
    assert check(get("registry.test", 80, "/other"), policy).reason == "allowlist"
    tunnel = check(connect("registry.test", 443), policy)
    assert (tunnel.reason, tunnel.needs_inspection) == ("allowlist", False)


def test_builtin_custom_methods() -> None:
    policy = pol(builtin=[{"host": "r.test", "paths": ["/upload"], "methods": ["POST"]}])
    assert check(get("r.test", 80, "/upload", "POST"), policy).reason == "builtin"
    assert check(get("r.test", 80, "/upload", "GET"), policy).reason == "builtin_path"


# -- step 8: allow rules ------------------------------------------------------------------------


def test_allowlist() -> None:
    policy = pol(allow=["example.com", "*.cdn.test", "api.test:443"])
    decision = check("www.example.com:443", policy)
    assert (decision.allowed, decision.reason, decision.rule) == (True, "allowlist", "allow: example.com")
    assert decision.needs_resolution and not decision.private_ok and decision.addresses == ()
    assert check("a.cdn.test:443", policy).reason == "allowlist"
    assert check("cdn.test:443", policy).reason == "not_allowlisted"
    assert check("api.test:443", policy).reason == "allowlist"
    assert check("api.test:80", policy).reason == "not_allowlisted"
    assert check("example.com.evil.test:443", policy).reason == "not_allowlisted"


def test_allow_ip_rule_licenses_private() -> None:
    decision = check("198.51.100.7:8080", pol(allow=["up.test", "198.51.100.0/24"]))
    assert (decision.reason, decision.private_ok) == ("allowlist", True)
    assert decision.addresses == (ip("198.51.100.7"),)
    assert not decision.needs_resolution


def test_allow_rule_with_paths() -> None:
    policy = pol(
        allow=[
            {"host": "api.test", "paths": ["/v1/"], "methods": ["GET"]},
            {"host": "api.test", "paths": ["/v2/"]},
        ]
    )
    assert check(get("api.test", 80, "/v1/x"), policy).reason == "allowlist"
    assert check(get("api.test", 80, "/v2/x", "POST"), policy).reason == "allowlist"
    assert check(get("api.test", 80, "/v1/x", "POST"), policy).reason == "not_allowlisted"
    assert check(get("api.test", 80, "/v3/"), policy).reason == "not_allowlisted"
    assert check(get("api.test", 80, "/v1/../v3/"), policy).reason == "not_allowlisted"
    tunnel = check(connect("api.test", 443), policy)
    assert (tunnel.allowed, tunnel.reason, tunnel.needs_inspection) == (True, "allowlist", True)


# -- step 9: private origins --------------------------------------------------------------------


def test_private_origin() -> None:
    policy = pol(private={"origins": ["http://192.168.1.10:8080", "https://nas.lan"]})
    decision = check(get("192.168.1.10", 8080, "/"), policy)
    assert (decision.allowed, decision.reason, decision.private_ok) == (True, "private_origin", True)
    assert decision.rule == "private.origins: http://192.168.1.10:8080"
    assert check(get("192.168.1.10", 8081, "/"), policy).reason == "private_address"
    assert check(connect("192.168.1.10", 8080), policy).reason == "private_address"  # http origin != tunnel
    named = check(connect("nas.lan", 443), policy)
    assert (named.reason, named.private_ok, named.needs_resolution) == ("private_origin", True, True)
    assert check(get("nas.lan", 443, "/", scheme="http"), policy).reason == "not_allowlisted"


# -- step 10: by mode ---------------------------------------------------------------------------


def test_not_allowlisted() -> None:
    decision = check("example.com:443", default_policy())
    assert (decision.allowed, decision.reason, decision.rule) == (False, "not_allowlisted", "mode: enforce")
    assert "example.com" in decision.detail and "allowlist" in decision.detail
    assert not decision.needs_resolution


def test_mode_allow() -> None:
    decision = check("example.com:443", pol(mode="allow"))
    assert (decision.allowed, decision.reason, decision.rule) == (True, "mode_allow", "mode: allow")
    assert decision.needs_resolution


def test_ask() -> None:
    decision = check("example.com:443", pol(mode="ask"))
    assert (decision.allowed, decision.reason, decision.ask) == (False, "ask", True)
    assert decision.rule == "mode: ask"
    # an allowlisted host is not asked about
    assert check("example.com:443", pol(mode="ask", allow=["example.com"])).reason == "allowlist"
    # a port that would be refused anyway is refused, not asked
    assert check("example.com:22", pol(mode="ask", ports=[443])).reason == "port"


# -- step 11: ports and profiles ----------------------------------------------------------------


def test_port_restriction() -> None:
    policy = pol(allow=["example.com", "10.0.0.0/8"], ports=[80, 443])
    decision = check("example.com:8443", policy)
    assert (decision.allowed, decision.reason, decision.rule) == (False, "port", "ports: [80, 443]")
    assert check("10.0.0.1:22", policy).reason == "port"
    assert check("example.com:443", policy).reason == "allowlist"
    assert check("127.0.0.1:22", policy).reason == "loopback"
    assert check("localhost:5432", policy).reason == "loopback"


PROFILES = pol(
    allow=["example.com", "other.test"],
    profiles={
        "ci": {"allow": ["example.com", "extra.test"], "deny": ["bad.example.com"], "ports": [443]},
        "nodeny": {},
    },
)


def test_profile_narrows() -> None:
    ci = Client(profile="ci")
    assert check("www.example.com:443", PROFILES, ci).reason == "allowlist"
    decision = check("other.test:443", PROFILES, ci)
    assert (decision.allowed, decision.reason, decision.rule) == (False, "profile", "profile ci: allow")
    assert check("bad.example.com:443", PROFILES, ci).rule == "profile ci: deny bad.example.com"
    assert check("example.com:80", PROFILES, ci).rule == "profile ci: ports [443]"
    assert check("other.test:443", PROFILES, Client(profile="nodeny")).reason == "allowlist"
    assert check("other.test:443", PROFILES, NOBODY).reason == "allowlist"


def test_profile_never_widens() -> None:
    decision = check("extra.test:443", PROFILES, Client(profile="ci"))
    assert (decision.allowed, decision.reason) == (False, "not_allowlisted")


def test_unknown_profile() -> None:
    decision = check("example.com:443", PROFILES, Client(profile="nope"))
    assert (decision.allowed, decision.reason) == (False, "profile")
    assert "unknown profile" in decision.detail


def test_profile_applies_to_loopback_but_not_its_ports() -> None:
    policy = pol(profiles={"p": {"allow": ["localhost"], "ports": [443]}, "q": {"deny": ["127.0.0.0/8"]}})
    assert check("localhost:3000", policy, Client(profile="p")).reason == "loopback"
    assert check("127.0.0.1:3000", policy, Client(profile="q")).reason == "profile"


# -- never raises -------------------------------------------------------------------------------


def test_internal_error_never_raises() -> None:
    decision = decide("example.com:443", NOBODY, None)  # type: ignore[arg-type]
    assert (decision.allowed, decision.reason) == (False, "internal_error")
    assert decide(12345, NOBODY, default_policy()).reason == "invalid_target"  # type: ignore[arg-type]


# -- after resolution ---------------------------------------------------------------------------


def addrs(*texts: str) -> list[ipaddress.IPv4Address | ipaddress.IPv6Address]:
    return [ip(t) for t in texts]


def test_filter_drops_forbidden_and_private_by_default() -> None:
    policy = pol(allow=["up.test"])
    decision = check("up.test:443", policy)
    kept, verdicts = filter_addresses(
        decision,
        addrs(
            "93.184.216.34",
            "169.254.169.254",
            "10.0.0.1",
            "127.0.0.1",
            "::ffff:127.0.0.1",
            "2606:4700::1",
            "93.184.216.34",
            "64:ff9b::a9fe:a9fe",
        ),
        policy,
    )
    assert kept == addrs("93.184.216.34", "2606:4700::1")
    by_address = {str(v.address): v for v in verdicts}
    assert (
        by_address["169.254.169.254"].klass is AddressClass.FORBIDDEN
        and not by_address["169.254.169.254"].kept
    )
    assert not by_address["10.0.0.1"].kept and not by_address["127.0.0.1"].kept
    assert not by_address["64:ff9b::a9fe:a9fe"].kept
    assert len(verdicts) == 6  # duplicates (incl. ::ffff:127.0.0.1 == 127.0.0.1) collapsed


def test_filter_limit_and_order() -> None:
    policy = pol(allow=["up.test"])
    decision = check("up.test:443", policy)
    many = addrs("1.1.1.1", "1.0.0.1", "8.8.8.8", "8.8.4.4", "9.9.9.9", "1.1.1.1")
    kept, verdicts = filter_addresses(decision, many, policy)
    assert kept == many[:4]
    assert [v.kept for v in verdicts] == [True, True, True, True, False]
    assert filter_addresses(decision, many, policy, limit=2)[0] == many[:2]


def test_filter_private_licences() -> None:
    explicit = pol(allow=["up.test", "198.51.100.0/24"])
    decision = check("up.test:80", explicit)
    kept, _ = filter_addresses(decision, addrs("198.51.100.7", "10.0.0.1"), explicit)
    assert kept == addrs("198.51.100.7")

    everything = pol(allow=["up.test"], private={"allow": True})
    kept, _ = filter_addresses(
        check("up.test:80", everything), addrs("10.0.0.1", "169.254.1.1", "fd00::1"), everything
    )
    assert kept == addrs("10.0.0.1", "fd00::1")

    origin = pol(private={"origins": ["https://nas.lan"]})
    kept, _ = filter_addresses(check(connect("nas.lan", 443), origin), addrs("192.168.1.2"), origin)
    assert kept == addrs("192.168.1.2")


def test_filter_deny_rules_and_profile_deny() -> None:
    policy = pol(allow=["up.test"], deny=["93.184.216.0/24"], profiles={"p": {"deny": ["1.1.1.1"]}})
    kept, verdicts = filter_addresses(check("up.test:443", policy), addrs("93.184.216.34", "1.1.1.1"), policy)
    assert kept == addrs("1.1.1.1")
    assert verdicts[0].why == "deny: 93.184.216.0/24"
    kept, _ = filter_addresses(check("up.test:443", policy, Client("p")), addrs("1.1.1.1", "8.8.8.8"), policy)
    assert kept == addrs("8.8.8.8")


def test_filter_resolved_loopback_respects_self_and_loopback_settings() -> None:
    policy = pol(allow=["up.test"], private={"allow": True}, loopback={"ports": [3000]})
    decision = check("up.test:8080", policy, self_addresses=SELF)
    kept, verdicts = filter_addresses(decision, addrs("127.0.0.1", "10.0.0.1"), policy)
    assert kept == addrs("10.0.0.1")
    assert "own listening" in verdicts[0].why
    kept, _ = filter_addresses(check("up.test:3000", policy), addrs("127.0.0.1"), policy)
    assert kept == addrs("127.0.0.1")
    kept, _ = filter_addresses(check("up.test:3001", policy), addrs("127.0.0.1"), policy)
    assert kept == []


def test_filter_refused_decision_keeps_nothing() -> None:
    policy = default_policy()
    kept, verdicts = filter_addresses(check("up.test:443", policy), addrs("1.1.1.1"), policy)
    assert kept == [] and not verdicts[0].kept


def test_resolution_refusal() -> None:
    policy = pol(allow=["up.test"])
    decision = check("up.test:443", policy)
    kept, verdicts = filter_addresses(decision, addrs("10.0.0.1", "169.254.169.254"), policy)
    assert kept == []
    refusal = resolution_refusal(decision, verdicts)
    assert (refusal.allowed, refusal.reason) == (False, "resolved_forbidden")
    assert "10.0.0.1" in refusal.detail and "169.254.169.254" in refusal.detail
    assert refusal.target == decision.target and not refusal.needs_resolution
    assert resolution_refusal(decision, []).reason == "resolved_forbidden"


def test_loopback_addresses_fall_under_the_loopback_rules() -> None:
    """`loopback.addresses` (egressd ssh's relay: the client's own addresses) are loopback, in every
    spelling, for literals and for resolved names; an explicit CIDR allow does not lift that."""
    base = pol(allow=["198.51.100.0/24", "own.test"])
    own = frozenset({ip("198.51.100.7"), ip("2001:db8::7")})
    closed = replace(base, loopback=replace(base.loopback, allow=False, addresses=own))
    for spelling in (
        "198.51.100.7",
        "[::ffff:198.51.100.7]",
        "[64:ff9b::c633:6407]",
        "3325256711",
        "[2001:db8::7]",
    ):
        got = check(f"{spelling}:80", closed)
        assert (got.allowed, got.reason) == (False, "loopback_disabled"), spelling
    assert check("198.51.100.8:80", closed).allowed  # another address of the allowed range
    named = check("own.test:80", closed)
    kept, verdicts = filter_addresses(named, [ip("198.51.100.7"), ip("198.51.100.8")], closed)
    assert kept == [ip("198.51.100.8")]
    assert verdicts[0].klass is AddressClass.LOOPBACK and "loopback.allow is false" in verdicts[0].why
    ported = replace(base, loopback=replace(base.loopback, ports=(5432,), addresses=own))
    assert check("198.51.100.7:5432", ported).allowed
    assert check("198.51.100.7:80", ported).reason == "loopback_port"


# -- upgrades: which admitted requests may switch protocols ------------------------------------------
PATH_RULE = {"host": "api.test", "paths": ["/ok/"], "methods": ["GET"]}
UPGRADES = [
    # (policy, profile, target host, path, may upgrade)
    ({"allow": ["api.test"]}, None, "api.test", "/x", True),
    ({"allow": [PATH_RULE]}, None, "api.test", "/ok/x", False),
    ({"allow": [{**PATH_RULE, "websocket": True}]}, None, "api.test", "/ok/x", True),
    ({"allow": [PATH_RULE, "api.test"]}, None, "api.test", "/ok/x", True),  # a whole-host rule too
    ({"allow": [PATH_RULE, {**PATH_RULE, "websocket": True}]}, None, "api.test", "/ok/x", True),
    ({"builtin": [{"host": "api.test", "paths": ["/ok/"]}]}, None, "api.test", "/ok/x", False),
    (
        {"builtin": [{"host": "api.test", "paths": ["/ok/"], "websocket": True}]},
        None,
        "api.test",
        "/ok/x",
        True,
    ),
    (
        {"allow": ["api.test"], "deny": [{"host": "api.test", "paths": ["/admin"]}]},
        None,
        "api.test",
        "/x",
        False,
    ),
    ({"allow": ["api.test"], "profiles": {"p": {"allow": [PATH_RULE]}}}, "p", "api.test", "/ok/x", False),
    (
        {"allow": ["api.test"], "profiles": {"p": {"allow": [{**PATH_RULE, "websocket": True}]}}},
        "p",
        "api.test",
        "/ok/x",
        True,
    ),
    (
        {"allow": ["api.test"], "profiles": {"p": {"deny": [{"host": "api.test", "paths": ["/a"]}]}}},
        "p",
        "api.test",
        "/x",
        False,
    ),
    ({"mode": "allow"}, None, "api.test", "/x", True),
    ({"allow": []}, None, "127.0.0.1", "/x", True),  # loopback
]


@pytest.mark.parametrize(("data", "profile", "host", "path", "upgrade"), UPGRADES)
def test_which_admitted_requests_may_upgrade(
    data: dict[str, Any], profile: str | None, host: str, path: str, upgrade: bool
) -> None:
    decision = check(get(host, 80, path), pol(**data), Client(profile=profile))
    assert decision.allowed and decision.upgrade is upgrade, decision
    assert not check(connect(host, 443), pol(**data), Client(profile=profile)).upgrade  # tunnels: never


@pytest.mark.parametrize("kind", ["deny", "inspect"])
def test_websocket_is_for_allow_rules_only(kind: str) -> None:
    with pytest.raises(PolicyError, match="websocket is only for allow rules"):
        pol(**{kind: [{"host": "a.test", "websocket": True}]})
    with pytest.raises(PolicyError, match="websocket: 'yes': must be true or false"):
        pol(allow=[{"host": "a.test", "paths": ["/x"], "websocket": "yes"}])


def test_methods_are_case_sensitive() -> None:
    policy = pol(allow=[{"host": "api.test", "paths": ["/ok/"], "methods": ["get"]}])  # read as GET
    assert check(get("api.test", 80, "/ok/x", "GET"), policy).allowed
    for method in ("get", "Get", "gET"):
        decision = check(get("api.test", 80, "/ok/x", method), policy)
        assert not decision.allowed and decision.target is not None and decision.target.method == method
