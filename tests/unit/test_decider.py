"""The decide step remembers decisions (egressd.admission.decide.Decider): a remembered answer is
always the answer `decide_written` gives for the same inputs under the policy in force."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from egressd.admission import decide as decide_step
from egressd.admission.decide import Decider
from egressd.admission.in_force import PolicyHolder
from egressd.policy import Client, Program, decide_written, parse_policy
from tests.support.host_strategies import hosts_raw

POLICY = parse_policy(
    {
        "version": 1,
        "allow": ["example.com", "*.svc.test", "10.0.0.0/8", {"host": "api.test", "paths": ["/v1"]}],
        "deny": ["bad.example.com", {"host": "api.test", "paths": ["/v1/admin"]}],
        "profiles": {"narrow": {"allow": ["example.com"]}},
    },
    "a.yaml",
)
OTHER = parse_policy({"version": 1, "allow": ["*.svc.test"], "deny": ["example.com"]}, "b.yaml")
SPELLINGS = st.sampled_from(
    [
        "example.com",
        "EXAMPLE.com.",
        "bad.example.com",
        "a.svc.test",
        "A.SVC.TEST",
        "api.test",
        "10.1.2.3",
        "0x0a.1.515",
        "[::ffff:10.0.0.1]",
        "127.0.0.1",
        "exa mple.com",
        "",
        "xn--bcher-kva.example",
    ]
)
ASKS = st.tuples(
    SPELLINGS | hosts_raw,
    st.sampled_from([443, 80, 8080, 0, 70000]),
    st.sampled_from([None, "narrow", "nope"]),
    st.sampled_from([None, "connect", "http", "HTTPS", "gopher"]),
    st.sampled_from([None, "CONNECT", "get", "POST", "bad method"]),
    st.sampled_from([None, "/", "/v1/x", "/v1/admin/y", "/v1/../v1/admin"]),
    st.sampled_from([None, Program("/usr/bin/curl", frozenset({"/usr/bin/curl"}))]),
)


def fresh(decider: Decider, ask: tuple) -> object:  # type: ignore[type-arg]
    host, port, profile, scheme, method, path, program = ask
    return decide_written(
        host,
        port,
        Client(profile, program),
        decider.policies.get(),
        scheme=scheme,
        path=path,
        method=method,
        self_addresses=decider.self_addresses,
    )


def asked(decider: Decider, ask: tuple) -> object:  # type: ignore[type-arg]
    host, port, profile, scheme, method, path, program = ask
    return decider.decide(host, port, profile, scheme=scheme, method=method, path=path, program=program)


@settings(max_examples=150)
@given(st.lists(ASKS, min_size=1, max_size=12), st.lists(st.integers(0, 3), min_size=1, max_size=12))
def test_a_remembered_decision_is_the_decision(asks: list[tuple], events: list[int]) -> None:  # type: ignore[type-arg]
    """Asked again and again, with the policy swapped and egressd's own addresses added between
    asks: every answer equals a fresh decision of the same inputs under what is in force now."""
    holder = PolicyHolder(POLICY)
    decider = Decider(holder)
    for i, ask in enumerate(asks * 2):
        event = events[i % len(events)]
        if event == 1:
            holder.set(OTHER if holder.get() is POLICY else POLICY)
        elif event == 2:
            decider.add_self_address("10.1.2.3", 443)
        first, again = asked(decider, ask), asked(decider, ask)
        assert first == again == fresh(decider, ask)


def test_decisions_remembered_are_bounded_and_a_mode_question_is_not_kept() -> None:
    decider = Decider(PolicyHolder(POLICY))
    for n in range(decide_step.REMEMBERED + 10):
        decider.decide(f"h{n}.svc.test", 443, None, scheme="connect", method="CONNECT")
    assert 0 < len(decider._remembered) <= decide_step.REMEMBERED
    decider._remembered.clear()
    decider.decide("a.svc.test", 443, None, scheme="https", method="GET", path="/" + "x" * 600)
    decider.decide("b" * 600 + ".svc.test", 443, None, scheme="connect", method="CONNECT")
    assert decider._remembered == {}  # a long host or path is decided, never kept
    before = dict(decider._remembered)
    asked_as_ask = decider.decide("other.test", 443, None, scheme="connect", method="CONNECT", mode="ask")
    assert asked_as_ask.ask and decider._remembered == before
