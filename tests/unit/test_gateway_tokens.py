"""The gateway's credentials step and token file: who a presented NAME:TOKEN is, from where.

Why table and property tests: the client has read this code. A name or token that differs in any
way (case, padding, a byte that is not UTF-8, a prefix), a peer outside the networks, a token file
with a stray field: each must be refused, never matched by accident.
"""

from __future__ import annotations

import base64
import ipaddress
import json
import stat
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from egressd.admission.credentials import authenticate
from egressd.admission.state import ConnState
from egressd.admission.tokens import (
    GatewayCredentials,
    TokenFileError,
    TokenTable,
    make_entry,
    peer_address,
)
from egressd.session.token_file import add_clients, ensure_file, list_clients, load_table, remove_client

TOKEN = "k" * 43


def store(**sources: list[str]) -> GatewayCredentials:
    table = TokenTable.empty()
    table = table.with_entry(make_entry("agent1", TOKEN))
    table = table.with_entry(
        make_entry("pinned", TOKEN + "p", sources=sources.get("pinned", ["10.1.0.0/16"]))
    )
    table = table.with_entry(make_entry("ci", TOKEN + "c", profile="narrow"))
    nets = [ipaddress.ip_network(n) for n in sources.get("gateway", [])]
    return GatewayCredentials(table, nets)


def basic(text: str | bytes) -> str:
    raw = text.encode() if isinstance(text, str) else text
    return "Basic " + base64.b64encode(raw).decode()


def test_a_good_token_names_its_client_and_profile() -> None:
    creds = store().check("ci", TOKEN + "c", "127.0.0.1:5000")
    assert creds is not None and creds.username == "ci" and creds.profile == "narrow" and creds.gateway
    assert TOKEN not in creds.token  # the key for limits is not the secret
    plain = store().check("agent1", TOKEN, "127.0.0.1:5000")
    assert plain is not None and plain.profile is None


@pytest.mark.parametrize(
    "value",
    [
        None,
        "",
        "Basic",
        "Basic ",
        f"Bearer {TOKEN}",
        basic(f"agent1:{TOKEN} "),
        basic(f" agent1:{TOKEN}"),
        basic(f"Agent1:{TOKEN}"),
        basic(f"agent1:{TOKEN.upper()}"),
        basic(f"agent1:{TOKEN[:-1]}"),
        basic(f"agent1:{TOKEN}k"),
        basic(f"agent1{TOKEN}"),
        basic(f":{TOKEN}"),
        basic("agent1:"),
        basic(f"agent1:{TOKEN}\x00"),
        basic(b"agent1:\xff" + TOKEN.encode()),
        basic(f"agent1\x00:{TOKEN}"),
        basic(f"ci:{TOKEN}"),  # another client's name with this token
        basic(f"other:{TOKEN}"),
        basic(f"decoy:{TOKEN}"),
        basic(f"agent1:{TOKEN}") + "=",
        basic(f"agent1:{TOKEN}")[:-2],
        "Basic " + base64.urlsafe_b64encode(f"agent1:{TOKEN}".encode()).decode() + "!",
    ],
)
def test_every_other_spelling_is_refused(value: str | None) -> None:
    creds = store()
    assert creds.check_basic(value, "127.0.0.1:1") is None
    conn = ConnState("c1", "127.0.0.1:1")
    assert not authenticate(creds, conn, value)


def test_the_basic_scheme_is_case_insensitive_like_any_client_sends_it() -> None:
    assert store().check_basic(basic(f"agent1:{TOKEN}").replace("Basic", "basic"), "127.0.0.1:1") is not None


@pytest.mark.parametrize(
    ("name", "peer", "gateway", "admitted"),
    [
        ("pinned", "10.1.2.3:5000", [], True),
        ("pinned", "10.2.0.1:5000", [], False),
        ("pinned", "[10.1.2.3]:5000", [], False),  # the front never writes brackets: unparseable
        ("pinned", "::ffff:10.1.2.3:5000", [], True),  # IPv4-mapped counts as its IPv4 address
        ("pinned", None, [], False),
        ("pinned", "?:0", [], False),
        ("pinned", "garbage", [], False),
        ("agent1", "garbage", [], True),  # no network named: any peer
        ("agent1", "192.0.2.1:1", ["10.0.0.0/8"], False),
        ("agent1", "10.9.9.9:1", ["10.0.0.0/8"], True),
        ("pinned", "10.1.0.1:1", ["10.0.0.0/8"], True),
        ("pinned", "10.1.0.1:1", ["192.168.0.0/16"], False),  # both must admit
        ("agent1", "fe80::1%eth0:1", ["fe80::/10"], True),
        ("agent1", "::1:1", ["127.0.0.0/8"], False),
    ],
)
def test_source_networks(name: str, peer: str | None, gateway: list[str], admitted: bool) -> None:
    token = {"agent1": TOKEN, "pinned": TOKEN + "p"}[name]
    assert (store(gateway=gateway).check(name, token, peer) is not None) is admitted


def test_peer_address_parses_what_the_front_writes() -> None:
    assert peer_address("127.0.0.2:4242") == ipaddress.ip_address("127.0.0.2")
    assert peer_address("2001:db8::1:443") == ipaddress.ip_address("2001:db8::1")
    assert peer_address("") is None


@given(st.text(max_size=80), st.text(max_size=80))
def test_no_random_credentials_are_anyones(name: str, token: str) -> None:
    creds = store()
    found = creds.check(name, token, "127.0.0.1:1")
    assert found is None or (name, token) in {("agent1", TOKEN), ("ci", TOKEN + "c")}


@given(st.binary(max_size=120))
def test_no_random_header_is_anyones(raw: bytes) -> None:
    value = "Basic " + base64.b64encode(raw).decode()
    found = store().check_basic(value, "127.0.0.1:1")
    assert found is None or raw in (f"agent1:{TOKEN}".encode(), f"ci:{TOKEN}c".encode())


def test_a_swapped_table_applies_to_the_next_check() -> None:
    """The table in force is read at every check (a session's snapshot, swapped on reload)."""
    in_force = [store().table]
    creds = GatewayCredentials(lambda: in_force[-1])
    swap = in_force.append
    assert creds.check("agent1", TOKEN) is not None
    swap(creds.table.without("agent1"))
    assert creds.check("agent1", TOKEN) is None
    ci = creds.check("ci", TOKEN + "c")
    assert ci is not None and creds.valid(ci)
    swap(creds.table.without("ci"))
    assert not creds.valid(ci) and creds.check("ci", TOKEN + "c") is None
    # a replaced token: the same name, another token: the old one's connections are not valid
    agent = creds.check("pinned", TOKEN + "p", "10.1.0.1:1")
    assert agent is not None and creds.valid(agent)
    swap(creds.table.with_entry(make_entry("pinned", "new-token", sources=["10.1.0.0/16"])))
    assert not creds.valid(agent) and creds.check("pinned", TOKEN + "p", "10.1.0.1:1") is None
    assert creds.check("pinned", "new-token", "10.1.0.1:1") is not None


@pytest.mark.parametrize(
    "data",
    [
        None,
        [],
        {"version": 2, "clients": {}},
        {"version": 1},
        {"version": 1, "clients": []},
        {"version": 1, "clients": {"a:b": {"hash": "sha256:00:" + "00" * 32}}},
        {"version": 1, "clients": {"a": {"hash": "md5:00:" + "00" * 16}}},
        {"version": 1, "clients": {"a": {"hash": "sha256::" + "00" * 32}}},
        {"version": 1, "clients": {"a": {"hash": "sha256:00:" + "00" * 31}}},
        {"version": 1, "clients": {"a": {"hash": "sha256:zz:" + "00" * 32}}},
        {"version": 1, "clients": {"a": {"hash": "sha256:00:" + "00" * 32, "token": "x"}}},
        {"version": 1, "clients": {"a": {"hash": "sha256:00:" + "00" * 32, "from": "10.0.0.0/8"}}},
        {"version": 1, "clients": {"a": {"hash": "sha256:00:" + "00" * 32, "from": ["10.0.0.0/33"]}}},
        {"version": 1, "clients": {"a": {"hash": "sha256:00:" + "00" * 32, "profile": ""}}},
        {"version": 1, "clients": {"a": {"hash": "sha256:00:" + "00" * 32, "profile": 3}}},
        {"version": 1, "clients": {"a": "sha256:00:" + "00" * 32}},
    ],
)
def test_a_bad_token_file_is_refused_whole(data: object) -> None:
    with pytest.raises(TokenFileError):
        TokenTable.from_data(data, "tokens.json")


def test_the_file_round_trips_and_keeps_no_token(tmp_path: Path) -> None:
    path = tmp_path / "gw" / "tokens.json"
    ensure_file(path)
    assert load_table(path).entries == {}
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    tokens = add_clients(path, ["a", "b"], profile="narrow", sources=["10.0.0.0/8"])
    text = path.read_text()
    assert all(token not in text for token in tokens.values())
    table = load_table(path)
    assert GatewayCredentials(table).check("a", tokens["a"], "10.0.0.1:1") is not None
    assert GatewayCredentials(table).check("a", tokens["b"], "10.0.0.1:1") is None
    assert [e.name for e in list_clients(path)] == ["a", "b"]
    assert remove_client(path, "a") and not remove_client(path, "a")
    assert list(json.loads(path.read_text())["clients"]) == ["b"]
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert not list(path.parent.glob(".tokens.json.*.tmp"))


def test_a_missing_file_is_an_empty_table(tmp_path: Path) -> None:
    assert load_table(tmp_path / "none.json").entries == {}
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(TokenFileError):
        load_table(tmp_path / "bad.json")
