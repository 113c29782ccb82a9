"""`egressd policy import`: other tools' allowlists as egressd policies, never wider.

Properties against a reference matcher of the source's own semantics (an exact name is that name
only, `*.x` its subdomains only; srt's deny first; Smokescreen's role over its global deny), table
tests of nasty entries, the export → import round trip, and the real command line.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from egressd.policy import Client, decide, make_target, parse_policy
from egressd.tools.export import export_policy
from egressd.tools.importers import ImportError_, import_policy
from tests.support.egressd_cli import EGRESSD

LABELS = ["a", "b", "api"]
ROOTS = ["x.test", "y.test"]
NAMES = ROOTS + [f"{a}.{r}" for a in LABELS for r in ROOTS] + [f"{a}.b.{r}" for a in LABELS for r in ROOTS]
PATTERNS = NAMES + [f"*.{n}" for n in NAMES]
PORTS = [443, 8443]


def _ref_match(pattern: str, host: str, port: int) -> bool:
    """The source tools' matcher (sandbox-runtime's matchesDomainPattern, Smokescreen's globs)."""
    if ":" in pattern:
        pattern, _, want = pattern.partition(":")
        if int(want) != port:
            return False
    if pattern.startswith("*."):
        return host.endswith("." + pattern[2:])
    return host == pattern


def _egressd_allows(policy_data: dict[str, object], host: str, port: int) -> bool:
    policy = parse_policy(policy_data, "imported")
    return decide(make_target(host, port, scheme="https"), Client(), policy).allowed


def _imported(fmt: str, document: object, role: str | None = None) -> dict[str, object]:
    text = document if isinstance(document, str) else json.dumps(document)
    return import_policy(text, fmt, source="in", role=role).data


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.sampled_from(PATTERNS), max_size=6),
    st.lists(st.sampled_from(PATTERNS), max_size=3),
    st.sampled_from(NAMES),
)
def test_srt_import_never_admits_what_srt_refuses(allowed: list[str], denied: list[str], host: str) -> None:
    data = _imported("srt", {"network": {"allowedDomains": allowed, "deniedDomains": denied}})
    srt_allows = not any(_ref_match(d, host, 443) for d in denied) and any(
        _ref_match(a, host, 443) for a in allowed
    )
    if _egressd_allows(data, host, 443):
        assert srt_allows, (allowed, denied, host, data)
    if any(_ref_match(d, host, 443) for d in denied):
        assert not _egressd_allows(data, host, 443)


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.sampled_from(PATTERNS + [f"{p}:443" for p in NAMES[:4]]), max_size=6),
    st.sampled_from(NAMES),
    st.sampled_from(PORTS),
)
def test_allowlist_import_never_admits_more(allowed: list[str], host: str, port: int) -> None:
    data = _imported("allowlist-json", {"allowed_hosts": allowed})
    if _egressd_allows(data, host, port):
        assert any(_ref_match(a, host, port) for a in allowed), (allowed, host, port, data)


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.sampled_from(PATTERNS), max_size=4),
    st.lists(st.sampled_from(PATTERNS), max_size=3),
    st.lists(st.sampled_from(PATTERNS), max_size=3),
    st.sampled_from(NAMES),
)
def test_smokescreen_import_never_admits_more(
    own: list[str], shared: list[str], denied: list[str], host: str
) -> None:
    acl = {
        "version": "v1",
        "services": [{"name": "svc", "project": "p", "action": "enforce", "allowed_domains": own}],
        "global_allow_list": shared,
        "global_deny_list": denied,
    }
    data = _imported("smokescreen", yaml.safe_dump(acl))
    # smokescreen: the role's domains, then the global deny, then the global allow
    allows = any(_ref_match(p, host, 443) for p in own) or (
        not any(_ref_match(p, host, 443) for p in denied) and any(_ref_match(p, host, 443) for p in shared)
    )
    if _egressd_allows(data, host, 443):
        assert allows, (acl, host, data)


@pytest.mark.parametrize(
    ("entry", "action", "rules"),
    [
        ("*", "dropped", None),
        ("*.*", "dropped", None),
        ("a.*.example", "dropped", None),
        ("example.*", "dropped", None),
        ("*.com", "dropped", None),
        ("https://example.com/", "dropped", None),
        ("user@example.com", "dropped", None),
        ("exa mple.com", "dropped", None),
        ("", "dropped", None),
        (7, "dropped", None),
        ("0x7f.0.0.1", "dropped", None),
        ("2130706433", "dropped", None),
        ("[::ffff:127.0.0.1]", "dropped", None),
        ("bücher.example", "normalised", ["xn--bcher-kva.example"]),
        ("xn--bcher-kva.example", "narrowed", ["xn--bcher-kva.example"]),
        ("EXAMPLE.com.", "narrowed", ["example.com"]),
        (".example.com", "narrowed", ["*.example.com"]),
        ("203.0.113.7", None, ["203.0.113.7"]),  # an address rule is exact: nothing to narrow
        ("2001:db8::1", None, ["2001:db8::1"]),
        ("*.example.com", None, ["*.example.com"]),
    ],
)
def test_nasty_srt_entries(entry: object, action: str | None, rules: list[str] | None) -> None:
    result = import_policy(json.dumps({"network": {"allowedDomains": [entry]}}), "srt", source="in")
    actions = {f.action for f in result.findings if f.setting.startswith("network.allowedDomains")}
    if action is not None:
        assert action in actions, result.findings
    else:
        assert not actions, result.findings
    assert result.data["allow"] == (rules or [])
    if rules is None:  # nothing admitted at all
        assert result.data["deny"] == []


def test_allowlist_ports_and_empty_lists() -> None:
    data = _imported("allowlist-json", {"allowed_hosts": ["api.example.com:443", "cdn.example.com:99999"]})
    assert data["allow"] == ["api.example.com:443"] and data["deny"] == ["*.api.example.com:443"]
    empty = _imported("allowlist-json", {"allowed_hosts": []})
    assert empty["allow"] == [] and empty["mode"] == "enforce"
    with pytest.raises(ImportError_, match="allowed_hosts"):
        import_policy(json.dumps({"hosts": []}), "allowlist-json", source="in")


def test_srt_loopback_and_local_options() -> None:
    off = import_policy(json.dumps({"network": {"allowedDomains": ["x.test"]}}), "srt", source="in")
    assert off.data["loopback"] == {"allow": False, "ports": []}
    on = import_policy(
        json.dumps({"network": {"allowedDomains": ["localhost"], "allowUnixSockets": ["/run/x.sock"]}}),
        "srt",
        source="in",
    )
    assert on.data["loopback"]["allow"] is True and on.data["allow"] == []
    assert any(f.setting == "network.allowUnixSockets" and f.action == "unsupported" for f in on.findings)


@pytest.mark.parametrize(("action", "mode"), [("enforce", "enforce"), ("report", "learn"), ("open", "allow")])
def test_smokescreen_actions(action: str, mode: str) -> None:
    acl = {"version": "v1", "default": {"project": "p", "action": action, "allowed_domains": []}}
    result = import_policy(yaml.safe_dump(acl), "smokescreen", source="in")
    assert result.data["mode"] == mode
    assert (action != "enforce") == any(f.setting == "default.action" for f in result.findings)


def test_smokescreen_roles_must_be_chosen() -> None:
    acl = {
        "version": "v1",
        "services": [
            {"name": "one", "project": "p", "action": "enforce", "allowed_domains": ["one.test"]},
            {"name": "two", "project": "p", "action": "enforce", "allowed_domains": ["two.test"]},
        ],
        "global_deny_list": ["*.one.test", "one.test"],
    }
    with pytest.raises(ImportError_, match="several roles"):
        import_policy(yaml.safe_dump(acl), "smokescreen", source="in")
    one = import_policy(yaml.safe_dump(acl), "smokescreen", source="in", role="one")
    assert any("override global_deny_list" in f.detail for f in one.findings)
    assert not _egressd_allows(one.data, "one.test", 443)  # deny wins: narrower
    assert _egressd_allows(_imported("smokescreen", yaml.safe_dump(acl), "two"), "two.test", 443)
    with pytest.raises(ImportError_, match="no role 'three'"):
        import_policy(yaml.safe_dump(acl), "smokescreen", source="in", role="three")
    with pytest.raises(ImportError_, match="version"):
        import_policy("version: v2\n", "smokescreen", source="in")


def test_a_smokescreen_acl_with_a_duplicate_key_is_refused() -> None:
    """Two readers of one duplicated key may take different values: smokescreen's own YAML reader
    refuses such an ACL, and so does the import, rather than pick the one it sees last."""
    acl = (
        "version: v1\n"
        "default:\n"
        "  project: p\n"
        "  action: enforce\n"
        "  allowed_domains: [narrow.test]\n"
        "  allowed_domains: [wide.test]\n"
    )
    with pytest.raises(ImportError_, match="duplicate key"):
        import_policy(acl, "smokescreen", source="in")


@settings(max_examples=150, deadline=None)
@given(
    st.lists(st.sampled_from(NAMES + [f"*.{n}" for n in NAMES]), max_size=5),
    st.lists(st.sampled_from(NAMES + [f"*.{n}" for n in NAMES]), max_size=2),
    st.sampled_from(["enforce", "learn", "allow"]),
)
def test_smokescreen_export_then_import_decides_the_same(
    allow: list[str], deny: list[str], mode: str
) -> None:
    original = parse_policy({"mode": mode, "allow": allow, "deny": deny}, "original")
    exported = export_policy(original, "smokescreen").text
    back = parse_policy(import_policy(exported, "smokescreen", source="acl").data, "back")
    assert back.mode == original.mode
    for host in NAMES + ["z.test"]:
        one = decide(make_target(host, 443, scheme="https"), Client(), original)
        two = decide(make_target(host, 443, scheme="https"), Client(), back)
        assert one.allowed == two.allowed, (host, allow, deny, exported)


def test_the_command_prints_a_loadable_policy_and_the_report(tmp_path: Path) -> None:
    settings_file = tmp_path / "srt.json"
    settings_file.write_text(
        json.dumps({"network": {"allowedDomains": ["github.com", "*"], "deniedDomains": []}})
    )
    done = subprocess.run(
        [*EGRESSD, "policy", "import", "--from", "srt", str(settings_file)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    (tmp_path / "out.yaml").write_text(done.stdout)
    check = subprocess.run(
        [*EGRESSD, "policy", "validate", str(tmp_path / "out.yaml")], capture_output=True, text=True
    )
    assert check.returncode == 0, check.stdout
    assert "egressd: import: dropped: network.allowedDomains[1] '*'" in done.stderr
    assert "egressd: import: narrowed: network.allowedDomains[0] 'github.com'" in done.stderr
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    refused = subprocess.run(
        [*EGRESSD, "policy", "import", "--from", "srt", str(bad)], capture_output=True, text=True, timeout=60
    )
    assert refused.returncode == 2 and refused.stdout == "" and "invalid JSON" in refused.stderr
