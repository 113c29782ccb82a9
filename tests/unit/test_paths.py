"""Path normalisation and prefix matching: refuse what servers could read differently."""

from __future__ import annotations

import pytest

from egressd.policy import normalise_path, path_matches


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ("/", "/"),
        ("/api", "/api"),
        ("/api/", "/api/"),
        ("/api/x?q=1", "/api/x"),
        ("/api/x#frag", "/api/x"),
        ("/api/x?q=/../../admin", "/api/x"),
        ("/a/./b", "/a/b"),
        ("/a/b/../c", "/a/c"),
        ("/a/b/..", "/a/"),
        ("/a/b/.", "/a/b/"),
        ("/a/%2e%2e/b", "/b"),  # %2e is '.', so this is a dot segment
        ("/a/%2E%2E/b", "/b"),
        ("/a/.%2e/b", "/b"),
        ("/%61%70%69/x", "/api/x"),  # unreserved decoded
        ("/a%7Eb", "/a~b"),
        ("/a%2fb", "/a%2Fb"),  # encoded slash stays encoded
        ("/a%5cb", "/a%5Cb"),
        ("/a%20b", "/a%20b"),
        ("/a%3fb", "/a%3Fb"),
        ("/ü", "/%C3%BC"),
        ("/a//b", "/a//b"),
        ("/a;b=c/d", "/a;b=c/d"),
        ("/...", "/..."),
        ("/a/..b", "/a/..b"),
    ],
)
def test_normalise(raw: str, expected: str) -> None:
    assert normalise_path(raw) == expected


@pytest.mark.parametrize(
    "raw",
    [
        "",
        "*",
        "api",
        "//evil.test/x",
        "/..",
        "/../x",
        "/a/../..",
        "/%2e%2e/x",
        "/a/%ZZ",
        "/a/%2",
        "/a/%",
        "/a/..;/admin",  # Tomcat-style path parameter on a dot segment
        "/a/.;x/b",
        "/a/x%2F..%2F..%2Fadmin",  # a decoding server would see dot segments
        "/a/x%5C..%5Cadmin",
        "/a/b//../../c",  # '//' plus dot segments: merge_slashes servers disagree
        "/a\\..\\admin",
        "/a b",
        "/a\x00b",
        "/a\tb",
    ],
)
def test_normalise_rejects(raw: str) -> None:
    assert normalise_path(raw) is None


@pytest.mark.parametrize(
    ("prefix", "path", "expected"),
    [
        ("/api", "/api", True),
        ("/api", "/api/", True),
        ("/api", "/api/x", True),
        ("/api", "/apix", False),
        ("/api", "/ap", False),
        ("/api", "/api%2Fx", False),
        ("/api/", "/api/", True),
        ("/api/", "/api/x/y", True),
        ("/api/", "/api", False),
        ("/api/", "/apix", False),
        ("/", "/anything", True),
        ("/a/b", "/a/b/c", True),
        ("/a/b", "/a/bc", False),
    ],
)
def test_path_matches(prefix: str, path: str, expected: bool) -> None:
    assert path_matches(prefix, path) is expected


def test_traversal_out_of_prefix_does_not_match() -> None:
    path = normalise_path("/api/../admin")
    assert path == "/admin"
    assert not path_matches("/api/", path)
