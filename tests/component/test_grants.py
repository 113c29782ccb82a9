"""Grants, pure: what a target names, what it covers, and that a one-shot grant is used once."""

from __future__ import annotations

import threading

import pytest

from egressd.admission.grants import GrantError, GrantStore, parse_grant


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        ("x.test", ("x.test", (443, 80), None, None, "")),
        ("X.Test.", ("x.test", (443, 80), None, None, "")),
        ("x.test:8443", ("x.test", (8443,), None, None, "")),
        ("[2001:db8::1]:443", ("2001:db8::1", (443,), None, None, "")),
        ("http://x.test", ("x.test", (80,), None, None, "")),
        ("https://x.test/", ("x.test", (443,), None, None, "")),
        ("http://x.test:8080/a", ("x.test", (8080,), "http", "/a", "")),
        ("http://x.test/a?b=1", ("x.test", (80,), "http", "/a", "b=1")),
        ("https://x.test/a/./b", ("x.test", (443,), "https", "/a/b", "")),
    ],
)
def test_parse(spec: str, expected: tuple[object, ...]) -> None:
    assert parse_grant(spec) == expected


@pytest.mark.parametrize(
    "spec",
    ["http://user@x.test/", "ftp://x.test/", "x.test:0", "x .test", "", "x.test/a", "http://x.test/%2e%2e/"],
)
def test_unreadable_targets_are_refused(spec: str) -> None:
    with pytest.raises(GrantError):
        parse_grant(spec)


def test_once_is_used_once_and_only_for_its_target() -> None:
    store = GrantStore()
    store.add("http://x.test/a", ttl=60)
    assert store.take("request", "x.test", 80, "http", "/b") is None
    assert store.take("request", "x.test", 80, "http", "/a?q") is None
    assert store.take("request", "x.test", 81, "http", "/a") is None
    assert store.take("request", "a.x.test", 80, "http", "/a") is None
    assert store.take("request", "x.test", 80, "https", "/a") is None
    assert store.take("connect", "x.test", 80, "connect", None) is None  # http: no tunnel peek
    grant, inspect = store.take("request", "x.test", 80, "http", "/a") or (None, None)
    assert grant is not None and not inspect
    assert store.take("request", "x.test", 80, "http", "/a") is None
    assert not store


def test_an_https_path_grant_admits_the_tunnel_for_inspection_and_the_request_consumes_it() -> None:
    store = GrantStore()
    store.add("https://x.test/a", ttl=60)
    peek = store.take("connect", "x.test", 443, "connect", None)
    assert peek is not None and peek[1] is True
    assert store.take("inner", "x.test", 443, "https", "/b") is None
    assert store.take("inner", "x.test", 443, "https", "/a") is not None
    assert store.take("connect", "x.test", 443, "connect", None) is None


def test_expired_grants_lapse() -> None:
    store = GrantStore()
    grant = store.add("x.test:443", ttl=60)
    grant.expires = 0.0
    assert store.take("connect", "x.test", 443, "connect", None) is None
    assert store.list() == []


def test_racing_takes_admit_exactly_one() -> None:
    store = GrantStore()
    store.add("x.test:443", ttl=60)
    wins: list[object] = []
    start = threading.Barrier(16)

    def race() -> None:
        start.wait()
        if store.take("connect", "x.test", 443, "connect", None) is not None:
            wins.append(1)

    threads = [threading.Thread(target=race) for _ in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(wins) == 1


def test_run_grants_last_until_exit_and_are_exact() -> None:
    store = GrantStore()
    first = store.add_run("x.test", 443)
    assert store.add_run("x.test", 443) is first
    for _ in range(3):
        assert store.take("connect", "x.test", 443, "connect", None) is not None
    assert store.take("connect", "a.x.test", 443, "connect", None) is None
    assert store.take("connect", "x.test", 80, "connect", None) is None


@pytest.mark.parametrize("ttl", [0, -1, 10**9])
def test_bad_ttl(ttl: float) -> None:
    with pytest.raises(GrantError):
        GrantStore().add("x.test", ttl=ttl)
