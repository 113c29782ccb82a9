"""`egressd policy export --to smokescreen`, decided by Smokescreen's own matching rules on the Squid table.

Why: no smokescreen binary installs here, but its ACL format and matching are small and documented.
This module writes them down once, as a model with the source it follows, and proves the model on
Smokescreen's OWN test vectors before trusting it (stripe/smokescreen at commit
a3294a6cc4e4e33cd086ec0d5bca9f22db097023, 2026-07-06, after tag v0.0.4):

- README.md "ACLs" and "Global Hostname Allow/Deny Lists": globs, their validity, the order;
- pkg/smokescreen/acl/v1/acl.go: Decide (allowed_domains, then global_deny_list, then
  global_allow_list, then the rule's action), HostMatchesGlob, ValidateDomainGlob;
  acl_test.go: TestHostMatchesGlob, TestIDNHostMatching, TestACLDecision, TestACLAddInvalidGlob;
- pkg/smokescreen/acl/v1/yaml_loader.go: the file (version v1, `services` required, actions);
- pkg/smokescreen/hostport/hostport.go: NormalizeHost (net.ParseIP, else UTS46 to ASCII, lower case,
  only [a-z0-9.-_]); hostport_test.go: TestNew, TestNewWithScheme;
- pkg/smokescreen/smokescreen.go: checkACLsForRequest (a destination with ':' is refused),
  classifyAddr (not global unicast or loopback: only --allow-range; then --allow-range,
  --deny-range, IPv6 embeddings, private, CGNAT); smokescreen_test.go: TestClassifyAddr.

Then the export of the shared target table (tests/support/export_targets.py) goes through both
egressd and the model, both fronts, with the flags the export prints: every difference must be
narrower and predicted by the report, or a spelling egressd refuses read as a host egressd admits.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import re
from typing import Any

import idna
import pytest
import yaml

from egressd.tools.export import export_policy
from tests.support import export_targets as table

IP = ipaddress.IPv4Address | ipaddress.IPv6Address
NET = ipaddress.IPv4Network | ipaddress.IPv6Network
PORT = 8080


class Refused(Exception):
    """What Smokescreen answers with an error (a 400 or a loader error)."""


# -- hostport.go ---------------------------------------------------------------------------------
def go_parse_ip(s: str) -> IP | None:
    """Go's net.ParseIP: dotted decimal IPv4 without leading zeros, or IPv6 without a zone."""
    if "%" in s:
        return None
    try:
        ip = ipaddress.ip_address(s)
    except ValueError:
        return None
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return ip.ipv4_mapped  # Go keeps IPv4 as mapped IPv6 and prints it dotted
    return ip


def _label(label: str) -> str:
    """One label of golang.org/x/net/idna's lookup mapping with ValidateLabels (hyphens, punycode)."""
    if not label:
        return label  # no VerifyDNSLength: empty labels pass
    if not label.isascii():
        return "xn--" + label.encode("punycode").decode()
    if label.startswith("xn--"):
        try:
            idna.decode(label)
        except idna.IDNAError as exc:
            raise Refused(f"invalid domain: {exc}") from exc
    elif len(label) > 4 and label[2:4] == "--" or label[0] == "-" or label[-1] == "-":
        raise Refused(f"invalid domain {label!r}: hyphens")
    return label


def normalize_host(s: str) -> str:
    """hostport.NormalizeHost(s, false)."""
    ip = go_parse_ip(s)
    if ip is not None:
        return str(ip)
    try:
        mapped = idna.uts46_remap(s, std3_rules=False, transitional=False)
    except idna.IDNAError as exc:
        raise Refused(f"invalid domain {s!r}: {exc}") from exc
    domain = ".".join(_label(label) for label in mapped.split(".")).lower()
    if domain.strip("abcdefghijklmnopqrstuvwxyz0123456789.-_"):
        raise Refused(f"invalid domain {s!r}: disallowed rune")
    return domain


def split_host_port(s: str) -> tuple[str, str]:
    """Go's net.SplitHostPort."""
    if s.startswith("["):
        end = s.find("]")
        if end < 0 or not s[end + 1 :].startswith(":") or "[" in s[1:end] or "]" in s[end + 1 :]:
            raise Refused("missing port in address")
        return s[1:end], s[end + 2 :]
    host, colon, port = s.rpartition(":")
    if not colon:
        raise Refused("missing port in address")
    if ":" in host:
        raise Refused("too many colons in address")
    return host, port


# -- acl.go --------------------------------------------------------------------------------------
def host_matches_glob(host: str, glob: str) -> bool:
    if not host:
        return False
    try:
        h = normalize_host(host)
        wildcard = glob.startswith("*.")
        g = normalize_host(glob[2:] if wildcard else glob)
    except Refused:
        return False
    h, g = h.lower().rstrip("."), g.lower().rstrip(".")
    return h.endswith("." + g) if wildcard else h == g


def validate_domain_glob(glob: str) -> None:
    if glob == "":
        raise Refused("glob cannot be empty")
    if glob in ("*", "*."):
        raise Refused("domain glob must not match everything")
    if glob.startswith("*") and not glob.startswith("*."):
        raise Refused("domain glob must represent a full prefix (sub)domain")
    domain = glob.removeprefix("*.")
    if "*" in domain:
        raise Refused("domain globs are only supported as prefix")
    normalized = normalize_host(domain)
    if normalized != domain:
        raise Refused(f"incorrect ACL entry; use {'*.' if glob.startswith('*.') else ''}{normalized}")


@dataclasses.dataclass
class Rule:
    action: str  # enforce | report | open
    globs: list[str]


@dataclasses.dataclass
class ACL:
    rules: dict[str, Rule]
    default: Rule | None
    deny: list[str]
    allow: list[str]

    @classmethod
    def load(cls, data: dict[str, Any]) -> ACL:
        """yaml_loader.go Load, then acl.go Validate."""
        if data.get("version") != "v1":
            raise Refused(f"expected version v1, got {data.get('version')!r}")
        if data.get("services") is None:
            raise Refused("Top level list 'services' is missing")

        def rule(raw: dict[str, Any]) -> Rule:
            if raw.get("action") not in ("open", "report", "enforce"):
                raise Refused(f"unknown action {raw.get('action')}")
            return Rule(raw["action"], list(raw.get("allowed_domains") or []))

        rules = {s["name"]: rule(s) for s in data["services"]}
        default = rule(data["default"]) if data.get("default") is not None else None
        acl = cls(
            rules,
            default,
            list(data.get("global_deny_list") or []),
            list(data.get("global_allow_list") or []),
        )
        for r in [*rules.values(), *([default] if default else [])]:
            for glob in r.globs:
                validate_domain_glob(glob)
        for glob in acl.deny + acl.allow:
            validate_domain_glob(glob)
        return acl

    def decide(self, service: str, host: str) -> tuple[str, str]:
        """acl.go Decide: (Allow | AllowAndReport | Deny, reason)."""
        rule = self.rules.get(service, self.default)
        if rule is None:
            return "Deny", "no rule matched"
        if any(host_matches_glob(host, g) for g in rule.globs):
            return "Allow", "host matched allowed domain in rule"
        if any(host_matches_glob(host, g) for g in self.deny):
            return "Deny", "host matched rule in global deny list"
        if any(host_matches_glob(host, g) for g in self.allow):
            return "Allow", "host matched rule in global allow list"
        result = {"report": "AllowAndReport", "enforce": "Deny", "open": "Allow"}[rule.action]
        return (
            result,
            "default rule policy used" if rule is self.default else f"rule has {rule.action} policy",
        )


# -- smokescreen.go ------------------------------------------------------------------------------
def _v4(ip: IP) -> IP:
    return ip.ipv4_mapped if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped else ip


def _in(ip: IP, nets: list[NET]) -> bool:
    ip = _v4(ip)
    return any(ip.version == n.version and ip in n for n in nets)


def classify_addr(ip: IP, allow: list[NET], deny: list[NET]) -> str:
    """classifyAddr, for a configuration of --allow-range/--deny-range flags without ports."""
    ip = _v4(ip)
    broadcast = ip == ipaddress.IPv4Address("255.255.255.255")
    global_unicast = not (
        broadcast or ip.is_unspecified or ip.is_loopback or ip.is_multicast or ip.is_link_local
    )
    if not global_unicast or ip.is_loopback:
        return "ipAllowUserConfigured" if _in(ip, allow) else "ipDenyNotGlobalUnicast"
    if _in(ip, allow):
        return "ipAllowUserConfigured"
    if _in(ip, deny):
        return "ipDenyUserConfigured"
    embeddings = [ipaddress.ip_network(n) for n in ("64:ff9b::/96", "2002::/16", "2001::/32")]
    if ip.version == 6 and _in(ip, embeddings):
        return "ipDenyIPv6Embedding"
    private = [ipaddress.ip_network(n) for n in ("10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16", "fc00::/7")]
    if _in(ip, private):
        return "ipDenyPrivateRange"
    if _in(ip, [ipaddress.ip_network("100.64.0.0/10")]):
        return "ipDenyCGNAT"
    return "ipAllowDefault"


# -- the front: Go's net/http server (golang.org/x/net/http/httpguts, net/url) -------------------
_VALID_HOST_HEADER = re.compile(r"[A-Za-z0-9!$%&'()*+,\-.:;=\[\]_~]*")


@dataclasses.dataclass
class Smokescreen:
    acl: ACL
    allow: list[NET]
    deny: list[NET]

    @classmethod
    def load(cls, text: str) -> Smokescreen:
        """The exported ACL and the --allow-range/--deny-range flags its header says to run with."""
        flags = re.findall(r"^#\s+--(allow|deny)-range=(\S+)$", text, re.M)
        return cls(
            ACL.load(yaml.safe_load(text)),
            [ipaddress.ip_network(v) for k, v in flags if k == "allow"],
            [ipaddress.ip_network(v) for k, v in flags if k == "deny"],
        )

    def decides(self, front: str, host: str, port: int) -> tuple[bool, str]:
        """One row as the Squid test sends it (a Host header naming the target), by the default rule."""
        authority = f"{host}:{port}"
        if not _VALID_HOST_HEADER.fullmatch(authority):
            return False, "400: malformed Host header"
        try:
            name, _ = split_host_port(authority)
            destination = normalize_host(name)
        except Refused as exc:
            return False, f"400: {exc}"
        if ":" in destination:
            return False, "Destination host cannot be determined"
        result, reason = self.acl.decide("an unknown client", destination)
        if result == "Deny":
            return False, reason
        ip = go_parse_ip(destination)
        addresses = [ip] if ip is not None else [ipaddress.ip_address(a) for a in table.resolve(destination)]
        if not addresses:
            return False, "no such host"
        verdict = classify_addr(addresses[0], self.allow, self.deny)
        return verdict in ("ipAllowDefault", "ipAllowUserConfigured"), f"{reason}; {verdict}"


# -- Smokescreen's own test vectors, through the model -------------------------------------------
HOST_MATCHES_GLOB = [  # acl_test.go TestHostMatchesGlob and TestIDNHostMatching
    ("example.com", "example.com", True),
    ("contrived.example.com", "*.example.com", True),
    ("more.contrived.example.com", "*.example.com", True),
    ("login.eu.example.com", "login.*.example.com", False),
    ("example.com.", "example.com", True),
    ("EXAMPLE.COM", "example.com", True),
    ("example.com", "EXAMPLE.COM", True),
    ("", "example.com", False),
    ("тест.example.com", "xn--e1aybc.example.com", True),
    ("xn--e1aybc.example.com", "тест.example.com", True),
    ("sub.тест.example.com", "*.xn--e1aybc.example.com", True),
    ("тест.example.com", "*.xn--e1aybc.example.com", False),
]


@pytest.mark.parametrize(("host", "glob", "match"), HOST_MATCHES_GLOB)
def test_model_host_matches_glob(host: str, glob: str, match: bool) -> None:
    assert host_matches_glob(host, glob) is match


INVALID_GLOBS = [  # acl_test.go TestACLAddInvalidGlob and TestIDNValidation; README "ACLs"
    ("*.*.stripe.com", "domain globs are only supported as prefix"),
    ("*", "domain glob must not match everything"),
    ("*.", "domain glob must not match everything"),
    ("éxämple.com", "use xn--xmple-gra7a.com"),
    ("тест.example.com", "use xn--e1aybc.example.com"),
    ("*.тест.example.com", "use *.xn--e1aybc.example.com"),
    ("*example.com", "full prefix"),
    ("ex*ample.com", "only supported as prefix"),
    ("example.*", "only supported as prefix"),
]


@pytest.mark.parametrize(("glob", "error"), INVALID_GLOBS)
def test_model_refuses_invalid_globs(glob: str, error: str) -> None:
    with pytest.raises(Refused, match=re.escape(error)):
        validate_domain_glob(glob)
    for valid in ("example.com", "*.example.com", "xn--e1aybc.example.com"):
        validate_domain_glob(valid)


# pkg/smokescreen/acl/v1/testdata/sample_config_with_global.yaml, as its values
SAMPLE_WITH_GLOBAL = {
    "version": "v1",
    "services": [
        {
            "name": "enforce-dummy-srv",
            "project": "usersec",
            "action": "enforce",
            "allowed_domains": ["example1.com", "example2.com", "badexample1.com"],
        },
        {
            "name": "report-dummy-srv",
            "project": "security",
            "action": "report",
            "allowed_domains": ["example3.com"],
        },
        {"name": "open-dummy-srv", "project": "automation", "action": "open"},
        {"name": "dummy-glob", "project": "phony", "action": "enforce", "allowed_domains": ["*.example.com"]},
    ],
    "default": {"project": "other", "action": "report", "allowed_domains": ["default.example.com"]},
    "global_allow_list": [
        "goodexample1.com",
        "goodexample2.com",
        "goodexample3.com",
        "conflictingexample.com",
    ],
    "global_deny_list": ["badexample1.com", "badexample2.com", "conflictingexample.com"],
}
DECISIONS = [  # acl_test.go TestACLDecision (the cases on sample_config_with_global.yaml, and globs)
    ("dummy-glob", "shouldbreak.com", "Deny"),
    ("dummy-glob", "example.com", "Deny"),
    ("dummy-glob", "api.example.com", "Allow"),
    ("unknown-service", "nope.example.com", "AllowAndReport"),  # the default rule here is report
    ("unknown-service", "default.example.com", "Allow"),
    ("enforce-dummy-srv", "goodexample1.com", "Allow"),
    ("unknown-service", "goodexample2.com", "Allow"),
    ("enforce-dummy-srv", "badexample1.com", "Allow"),
    ("report-dummy-srv", "badexample1.com", "Deny"),
    ("unknown-service", "badexample2.com", "Deny"),
    ("open-dummy-srv", "badexample2.com", "Deny"),
    ("open-dummy-srv", "badexample2.com.", "Deny"),
    ("open-dummy-srv", "bAdExAmPlE2.cOm", "Deny"),
    ("open-dummy-srv", "conflictingexample.com", "Deny"),
]


@pytest.mark.parametrize(("service", "host", "result"), DECISIONS)
def test_model_decides_like_smokescreens_tests(service: str, host: str, result: str) -> None:
    assert ACL.load(SAMPLE_WITH_GLOBAL).decide(service, host)[0] == result


NORMALIZE = [  # hostport_test.go TestNew and TestNewWithScheme (the host part)
    ("127.0.0.1", "127.0.0.1"),
    ("example.net.", "example.net."),
    ("2001:DB8::1337", "2001:db8::1337"),
    ("🔐.example.com", "xn--jv8h.example.com"),
    ("✉️.example.com.", "xn--4bi.example.com."),
    ("foo_bar.example.com", "foo_bar.example.com"),
    ("FOO-BAR.example.com", "foo-bar.example.com"),
]


@pytest.mark.parametrize(("host", "normalized"), NORMALIZE)
def test_model_normalizes_hosts(host: str, normalized: str) -> None:
    assert normalize_host(host) == normalized
    with pytest.raises(Refused, match="disallowed rune"):
        normalize_host("[2001:DB8::1337]")


CLASSIFY = [  # smokescreen_test.go TestClassifyAddr, the cases that need no port-scoped ranges
    ("8.8.8.8", "ipAllowDefault"),
    ("10.0.0.1", "ipDenyPrivateRange"),
    ("172.16.0.1", "ipDenyPrivateRange"),
    ("192.168.0.1", "ipDenyPrivateRange"),
    ("100.64.0.1", "ipDenyCGNAT"),
    ("100.127.255.254", "ipDenyCGNAT"),
    ("100.63.255.254", "ipAllowDefault"),
    ("100.128.0.1", "ipAllowDefault"),
    ("127.0.0.1", "ipDenyNotGlobalUnicast"),
    ("127.255.255.255", "ipDenyNotGlobalUnicast"),
    ("::1", "ipDenyNotGlobalUnicast"),
    ("169.254.169.254", "ipDenyNotGlobalUnicast"),
    ("255.255.255.255", "ipDenyNotGlobalUnicast"),
    ("ff02:0:0:0:0:0:0:2", "ipDenyNotGlobalUnicast"),
    ("64:ff9b::ac1c:5", "ipDenyIPv6Embedding"),
    ("64:ff9b::808:808", "ipDenyIPv6Embedding"),
    ("2002:c000:201::1", "ipDenyIPv6Embedding"),
    ("2001:0:4136:e378:8000:63bf:3fff:fdd2", "ipDenyIPv6Embedding"),
    ("2001:4860:4860::8888", "ipAllowDefault"),
    ("64:ff9c::1", "ipAllowDefault"),
]


@pytest.mark.parametrize(("address", "verdict"), CLASSIFY)
def test_model_classifies_like_smokescreens_tests(address: str, verdict: str) -> None:
    assert classify_addr(ipaddress.ip_address(address), [], []) == verdict


# -- the export, through the model ---------------------------------------------------------------
def test_export_loads_in_smokescreen() -> None:
    """Every export of the presets and test policies loads: version, services, actions, and every
    glob valid by Smokescreen's own rule (normalized Punycode, a prefix wildcard only)."""
    from tests.support.export_policies import _policies

    for name, policy in _policies():
        Smokescreen.load(export_policy(policy, "smokescreen").text), name


def test_smokescreen_decides_like_egressd() -> None:
    """The target table through egressd and the modelled Smokescreen: differences narrower and
    predicted, and per target kind exactly what the loss report says."""
    table.check_differential("smokescreen", lambda text: Smokescreen.load(text).decides, PORT)
