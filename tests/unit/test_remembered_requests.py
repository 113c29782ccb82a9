"""The admission pipeline remembers an HTTP request's answer per connection: a remembered answer is
always the answer the steps give afresh.

The property drives one connection (which remembers) and, for every request, a fresh connection of
the same child (which does not), through the real pipeline, while the state changes between
requests: the policy reloaded, egressd's own address added, the child's token revoked and issued
again, the secrets' values changed, a grant added, a redirect remembered. Each answer, and whose
request it was, must be the same on both. The table names each input a remembered answer depends
on and shows a change of it answered afresh.
"""

from __future__ import annotations

import asyncio
import base64
import copy
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from egressd.admission.credentials import CredentialStore, ProxyCredentials
from egressd.admission.in_force import InForce, PolicyHolder
from egressd.admission.pipeline import Admitted, Attempt, Pipeline
from egressd.admission.state import ConnState
from egressd.policy import parse_policy
from egressd.policy.refusal import Refusal

SECRETS = [{"name": "api", "from": {"env": "X_KEY"}, "hosts": ["api.test"], "env": "API_KEY"}]
POLICY = parse_policy(
    {
        "version": 1,
        "allow": ["up.test", {"host": "api.test", "paths": ["/v1"], "methods": ["GET"]}, "127.0.0.1"],
        "secrets": SECRETS,
    },
    "a.yaml",
)
NARROW = parse_policy(
    {"version": 1, "allow": [{"host": "api.test", "paths": ["/v1"], "methods": ["GET"]}], "secrets": SECRETS},
    "b.yaml",
)


def _basic(creds: ProxyCredentials) -> str:
    return "Basic " + base64.b64encode(f"{creds.username}:{creds.token}".encode()).decode()


class World:
    """One pipeline, one child's credentials, one connection that remembers."""

    def __init__(self) -> None:
        self.holder = PolicyHolder(POLICY)
        self.store = CredentialStore()
        self.pipeline = Pipeline(self.holder, credentials=self.store)
        self.set_secret("REAL-1")
        self.creds = self.store.issue()
        self.conn = self.open()
        self.loop = asyncio.new_event_loop()

    def set_secret(self, value: str) -> None:
        """A reload that changed the secret's value: a new snapshot, the policy kept."""
        now = self.holder.now
        self.holder.set(InForce(now.policy, now.secrets.updated(POLICY.secrets, {"api": value})))

    def open(self) -> ConnState:
        return self.pipeline.open_conn("127.0.0.1:1")

    def ask(
        self, host: str, path: str, method: str = "GET", *fields: tuple[str, str], creds: str | None = ""
    ) -> Attempt:
        credentials = _basic(self.creds) if creds == "" else creds
        headers = [("Host", host), *fields]
        return Attempt(
            "request",
            host,
            80,
            scheme="http",
            method=method,
            path=path,
            credentials=credentials,
            headers=headers,
        )

    def admit(self, conn: ConnState, ask: Attempt) -> Admitted | Refusal:
        return self.loop.run_until_complete(self.pipeline.admit(conn, ask))

    def both(self, ask: Attempt) -> tuple[Any, Any]:
        """(the remembering connection's answer, a fresh connection's), the redirect memory as it
        was for each (a redirect's follow-up is taken once)."""
        redirects = copy.deepcopy(self.pipeline.redirects._entries)
        mine = _comparable(self.admit(self.conn, ask), self.conn)
        self.pipeline.redirects._entries = redirects
        fresh = self.open()
        theirs = _comparable(self.admit(fresh, ask), fresh)
        self.pipeline.close_conn(fresh)
        return mine, theirs


def _comparable(answer: Admitted | Refusal, conn: ConnState) -> tuple[Any, ...]:
    if isinstance(answer, Refusal):
        return ("refused", answer, conn.creds)
    return ("admitted", answer.decision, answer.strip, answer.injection, answer.inspect, conn.creds)


HOSTS = st.sampled_from(["up.test", "api.test", "other.test", "127.0.0.1", "UP.test"])
PATHS = st.sampled_from(["/", "/v1", "/v1/x", "/admin", "/v1?k=PLACEHOLDER"])
METHODS = st.sampled_from(["GET", "POST"])
FIELDS = st.lists(
    st.sampled_from(
        [
            ("X-A", "1"),
            ("Authorization", "Bearer PLACEHOLDER"),
            ("Connection", "upgrade"),
            ("Upgrade", "websocket"),
            ("Cookie", "a=b"),
            ("Host", "evil.test"),
        ]
    ),
    max_size=3,
)
CREDS = st.sampled_from(["", None, "Basic bm9wZTpub3Bl", "Bearer x"])
EVENTS = st.sampled_from(["none", "reload", "reload-back", "self", "revoke", "secret", "grant", "redirect"])


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(HOSTS, PATHS, METHODS, FIELDS, CREDS, EVENTS), min_size=1, max_size=10))
def test_a_remembered_answer_is_the_fresh_answer(steps: list[tuple[Any, ...]]) -> None:
    world = World()
    placeholder = world.pipeline.secrets.placeholder("api")
    for host, path, method, fields, creds, event in steps * 2:  # every request asked again
        if event == "reload":
            world.holder.set(NARROW)
        elif event == "reload-back":
            world.holder.set(POLICY)
        elif event == "self":
            world.pipeline.decider.add_self_address("127.0.0.1", 80)
        elif event == "revoke":
            world.store.revoke(world.creds)
            world.creds = world.store.issue()
        elif event == "secret":
            world.set_secret("REAL-2")
        elif event == "grant":
            world.pipeline.grants.add("other.test", once=False)
        elif event == "redirect":
            world.pipeline.redirects.remember(
                world.creds.token, "http://elsewhere.test/", f"http://{host}{path}"
            )
        path = path.replace("PLACEHOLDER", placeholder)
        fields = [(n, v.replace("PLACEHOLDER", placeholder)) for n, v in fields]
        mine, theirs = world.both(world.ask(host, path, method, *fields, creds=creds))
        assert mine == theirs


# -- each input, changed --------------------------------------------------------------------------------
def _allowed(answer: Admitted | Refusal) -> Admitted:
    assert isinstance(answer, Admitted), answer
    return answer


def _refused(answer: Admitted | Refusal, reason: str) -> None:
    assert isinstance(answer, Refusal) and answer.reason == reason, answer


def test_the_same_request_is_answered_from_memory_until_its_state_changes() -> None:
    world = World()
    ask = world.ask("up.test", "/a")
    _allowed(world.admit(world.conn, ask))
    assert not world.conn.remembered  # a connection's first request is not kept
    second = _allowed(world.admit(world.conn, ask))
    assert world.conn.remembered is not None and len(world.conn.remembered) == 1
    again = _allowed(world.admit(world.conn, ask))
    assert again.decision is second.decision and again is not second  # each request its own answer
    world.holder.set(NARROW)
    _refused(world.admit(world.conn, ask), "not_allowlisted")


CHANGES = [
    ("another token", lambda w: None, {"creds": "Basic bm9wZTpub3Bl"}, "proxy_auth_required"),
    ("no token", lambda w: None, {"creds": None}, "proxy_auth_required"),
    ("the token revoked", lambda w: w.store.revoke(w.creds), {}, "proxy_auth_required"),
    ("the Host field", lambda w: None, {"fields": [("Host", "evil.test")]}, "host_mismatch"),
    (
        "the method",
        lambda w: None,
        {"host": "api.test", "path": "/v1", "method": "POST"},
        "not_allowlisted",
    ),
    ("the path", lambda w: None, {"host": "api.test", "path": "/admin"}, "not_allowlisted"),
    ("a placeholder", lambda w: None, {"fields": [("X-A", "PLACEHOLDER")]}, "secret_exfiltration"),
    ("the policy", lambda w: w.holder.set(NARROW), {}, "not_allowlisted"),
    (
        "egressd's own address",
        lambda w: w.pipeline.decider.add_self_address("127.0.0.1", 80),
        {"host": "127.0.0.1"},
        "self",
    ),
]


@pytest.mark.parametrize(("change", "apply", "differs", "reason"), CHANGES, ids=[c[0] for c in CHANGES])
def test_a_change_of_an_input_is_answered_afresh(
    change: str, apply: Any, differs: dict[str, Any], reason: str
) -> None:
    """Each input of a remembered answer: the request as remembered is allowed, then with this input
    changed it is refused, as a fresh connection would be."""
    world = World()
    base = {"host": "up.test", "path": "/v1", "method": "GET", "fields": [], "creds": ""}
    if differs.get("host") in ("api.test", "127.0.0.1"):
        base["host"] = differs["host"]
    placeholder = world.pipeline.secrets.placeholder("api")

    def ask(**kw: Any) -> Attempt:
        fields = [(n, v.replace("PLACEHOLDER", placeholder)) for n, v in kw["fields"]]
        if not any(n == "Host" for n, _ in fields):
            fields.insert(0, ("Host", kw["host"]))
        return Attempt(
            "request",
            kw["host"],
            80,
            scheme="http",
            method=kw["method"],
            path=kw["path"],
            credentials=_basic(world.creds) if kw["creds"] == "" else kw["creds"],
            headers=fields,
        )

    _allowed(world.admit(world.conn, ask(**base)))
    _allowed(world.admit(world.conn, ask(**base)))  # remembered
    apply(world)
    changed = ask(**{**base, **differs})
    mine, theirs = world.both(changed)
    assert mine == theirs
    _refused(world.admit(world.open(), changed), reason)


def test_a_new_secret_value_is_put_in_not_the_remembered_one() -> None:
    world = World()
    placeholder = world.pipeline.secrets.placeholder("api")
    ask = world.ask("api.test", "/v1", "GET", ("Authorization", f"Bearer {placeholder}"))
    assert (
        dict(_allowed(world.admit(world.conn, ask)).injection.headers or ())["Authorization"]
        == "Bearer REAL-1"
    )
    world.set_secret("REAL-2")
    assert (
        dict(_allowed(world.admit(world.conn, ask)).injection.headers or ())["Authorization"]
        == "Bearer REAL-2"
    )


def test_a_redirect_to_a_remembered_request_strips_its_credentials_once() -> None:
    """The follow-up of a cross-origin redirect loses its credentials even when the same request was
    answered from memory before; the request after it is as before."""
    world = World()
    ask = world.ask("up.test", "/next", "GET", ("Cookie", "a=b"))
    assert not _allowed(world.admit(world.conn, ask)).strip
    world.pipeline.redirects.remember(world.creds.token, "http://elsewhere.test/", "http://up.test/next")
    assert "cookie" in _allowed(world.admit(world.conn, ask)).strip
    assert not _allowed(world.admit(world.conn, ask)).strip


def test_what_a_grant_admits_is_never_remembered() -> None:
    """A one-shot grant answers once: the next request is refused, however it was asked."""
    world = World()
    world.pipeline.grants.add("other.test")
    ask = world.ask("other.test", "/")
    assert _allowed(world.admit(world.conn, ask)).decision.reason == "granted"
    assert not world.conn.remembered
    _refused(world.admit(world.conn, ask), "not_allowlisted")
