"""`upstream_proxy:` parsing, credentials and the choice of parent, table-tested.

Why: the parent's credentials must never sit where a child can read them (the policy file, the
command line), never reach a log, and the `direct:` exceptions and loopback must be decided on the
canonical target — a spelling trick must not route a target around (or through) the parent.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from egressd.net.parent_proxy import parent_for, with_credentials
from egressd.policy import PolicyError, make_target, parse_policy
from egressd.policy.dump import policy_to_data


def policy(parent: object, **extra: object) -> object:
    return parse_policy({"version": 1, "upstream_proxy": parent, **extra}, "p.yaml")


@pytest.mark.parametrize(
    ("parent", "message"),
    [
        ({"url": "http://user:pw@proxy.example:3128"}, "credentials do not belong in the URL"),
        ({"url": "http://user@proxy.example:3128"}, "credentials do not belong in the URL"),
        ({"url": "http://:pw@proxy.example:3128"}, "credentials do not belong in the URL"),
        ({"url": "https://proxy.example:3128"}, "only an http:// parent"),
        ({"url": "socks5://proxy.example:1080"}, "only an http:// parent"),
        ({"url": "http://proxy.example"}, "explicit port"),
        ({"url": "http://proxy.example:3128/path"}, "no path"),
        ({"url": "http://proxy.example:3128?x=1"}, "no path"),
        ({"url": "http://proxy.example:99999"}, "not a valid URL"),
        ({"url": "http://proxy%2eexample:3128"}, "bad host"),
        ({"url": ""}, "must be a URL"),
        ({}, "must be a URL"),
        ("http://proxy.example:3128", "must be a mapping"),
        ({"url": "http://p.example:1", "credentials_env": "PROXY_AUTH"}, "EGRESSD_*"),
        ({"url": "http://p.example:1", "credentials_env": "EGRESSD_X=1"}, "EGRESSD_*"),
        ({"url": "http://p.example:1", "credentials_env": "EGRESSD_A", "credentials_file": "/f"}, "not both"),
        ({"url": "http://p.example:1", "connect_by": "ip"}, "connect_by"),
        ({"url": "http://p.example:1", "direct": "a.example"}, "list of host rules"),
        ({"url": "http://p.example:1", "direct": ["http://x"]}, "direct[0]"),
        ({"url": "http://p.example:1", "password": "x"}, "unknown key"),
    ],
)
def test_bad_parent_settings_are_refused(parent: object, message: str) -> None:
    with pytest.raises(PolicyError) as error:
        policy(parent)
    assert message in str(error.value)
    assert "pw" not in str(error.value).replace("upstream_proxy", "")  # a refused URL is not echoed


def test_parent_settings_load_canonically_and_dump_without_credentials(tmp_path: Path) -> None:
    loaded = policy(
        {
            "url": "http://PROXY.Example.:3128",
            "credentials_env": "EGRESSD_PARENT",
            "direct": ["intranet.example", "10.0.0.0/8"],
            "connect_by": "name",
        }
    )
    parent = loaded.upstream_proxy  # type: ignore[attr-defined]
    assert (parent.host, parent.port, parent.connect_by) == ("proxy.example", 3128, "name")
    read = with_credentials(loaded, {"EGRESSD_PARENT": "alice:pa:ss"})  # type: ignore[arg-type]
    assert read.upstream_proxy.authorization == "Basic YWxpY2U6cGE6c3M="  # type: ignore[union-attr]
    data = policy_to_data(read)
    assert "pa:ss" not in repr(data) and "YWxpY2U6cGE6c3M" not in repr(data)
    assert "pa:ss" not in repr(read) and "YWxpY2U6cGE6c3M" not in repr(read.upstream_proxy)
    again = parse_policy(data, "again")
    assert again.upstream_proxy == loaded.upstream_proxy  # type: ignore[attr-defined]


def test_credentials_come_from_egressd_s_environment_or_a_file(tmp_path: Path) -> None:
    by_env = policy({"url": "http://p.example:1", "credentials_env": "EGRESSD_PARENT"})
    with pytest.raises(PolicyError, match="not set in egressd's environment"):
        with_credentials(by_env, {})  # type: ignore[arg-type]
    with pytest.raises(PolicyError, match="user:password") as error:
        with_credentials(by_env, {"EGRESSD_PARENT": "no-colon-secret"})  # type: ignore[arg-type]
    assert "no-colon-secret" not in str(error.value)
    secret = tmp_path / "parent-auth"
    secret.write_text("bob:hunter2\n")
    by_file = policy({"url": "http://p.example:1", "credentials_file": str(secret)})
    assert with_credentials(by_file, {}).upstream_proxy.authorization == "Basic Ym9iOmh1bnRlcjI="  # type: ignore[arg-type,union-attr]
    with pytest.raises(PolicyError, match="parent-missing"):
        with_credentials(
            policy({"url": "http://p.example:1", "credentials_file": str(tmp_path / "parent-missing")}), {}
        )  # type: ignore[arg-type]
    # no credentials named: EGRESSD_UPSTREAM_PROXY_CREDENTIALS when set, else none at all
    bare = policy({"url": "http://p.example:1"})
    assert with_credentials(bare, {}).upstream_proxy.authorization is None  # type: ignore[arg-type,union-attr]
    env = {"EGRESSD_UPSTREAM_PROXY_CREDENTIALS": "c:d"}
    assert with_credentials(bare, env).upstream_proxy.authorization == "Basic Yzpk"  # type: ignore[arg-type,union-attr]


@pytest.mark.parametrize(
    ("host", "through_parent"),
    [
        ("api.example", True),
        ("intranet.example", False),
        ("INTRANET.example.", False),  # the canonical target, whatever the spelling
        ("db.intranet.example", False),
        ("intranet.example.evil.test", True),
        ("10.1.2.3", False),
        ("0xa010203", False),  # 10.1.2.3 in another spelling
        ("::ffff:10.1.2.3", False),  # IPv4-mapped: the same address, canonically 10.1.2.3
        ("[::ffff:a01:203]", False),
        ("127.0.0.1", False),  # loopback is this machine's, never the parent's
        ("127.1", False),
        ("::1", False),
        ("localhost", False),
        ("app.localhost", False),
        ("203.0.113.9", True),
    ],
)
def test_which_targets_go_through_the_parent(host: str, through_parent: bool) -> None:
    loaded = policy({"url": "http://p.example:1", "direct": ["intranet.example", "10.0.0.0/8"]})
    target = make_target(host, 443)
    assert (parent_for(loaded, target) is not None) is through_parent  # type: ignore[arg-type]


def test_no_parent_means_direct() -> None:
    assert parent_for(parse_policy({"version": 1}, "p"), make_target("api.example", 443)) is None


@given(st.text(min_size=1, max_size=12))
def test_a_url_with_userinfo_never_loads(secret: str) -> None:
    with pytest.raises(PolicyError) as error:
        policy({"url": f"http://user:{secret}@proxy.example:3128"})
    assert "<redacted>" in str(error.value)


def test_merged_policies_keep_their_one_parent() -> None:
    from egressd.policy.merge import merge_policies

    mine = policy({"url": "http://p.example:1", "direct": ["intranet.example"]}, allow=["a.example"])
    preset = parse_policy({"version": 1, "allow": ["b.example"]}, "preset.yaml")
    merged = merge_policies([mine, preset])  # type: ignore[list-item]
    assert merged.upstream_proxy == mine.upstream_proxy  # type: ignore[attr-defined]
    assert merge_policies([preset, mine]).upstream_proxy == mine.upstream_proxy  # type: ignore[list-item,attr-defined]
    other = policy({"url": "http://q.example:1"})
    with pytest.raises(PolicyError, match="different parent proxies"):
        merge_policies([mine, other])  # type: ignore[list-item]


# -- the parent's answer to a CONNECT ---------------------------------------------------------------
async def _answer_of_parent(answer: bytes) -> tuple[tuple[int, str] | str, bytes]:
    """What _handshake makes of a parent that answers `answer` to the CONNECT, and what is left
    in the socket afterwards (the tunnel's first bytes must be)."""
    import asyncio
    import socket

    from egressd.net import parent_proxy as upstream

    ours, parents = socket.socketpair()
    with ours, parents:
        ours.setblocking(False)
        parents.sendall(answer)
        parents.shutdown(socket.SHUT_WR)
        try:
            got: tuple[int, str] | str = await asyncio.wait_for(
                upstream._handshake(ours, "up.test", 443, None), timeout=10
            )
        except upstream.ParentFailure as exc:
            got = exc.detail
        ours.setblocking(True)
        left = b""
        while chunk := ours.recv(4096):
            left += chunk
        assert parents.recv(4096).startswith(b"CONNECT up.test:443 HTTP/1.1\r\nHost: up.test:443\r\n")
    return got, left


@pytest.mark.parametrize(
    ("answer", "got", "left"),
    [
        (
            b"HTTP/1.1 200 Connection established\r\n\r\nSSH-2.0-x\r\n",
            (200, "Connection established"),
            b"SSH-2.0-x\r\n",
        ),
        (b"HTTP/1.0 200 OK\r\nVia: squid\r\n\r\n", (200, "OK"), b""),
        (
            b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\n\r\nhi",
            (200, "OK"),
            b"hi",
        ),  # a 1xx is not the answer
        (
            b"HTTP/1.1 407 Proxy Authentication Required\r\nContent-Length: 4\r\n\r\nnope",
            (407, "Proxy Authentication Required"),
            b"nope",
        ),
        (b"SSH-2.0-OpenSSH_9.6\r\n\r\n", "did not answer in HTTP/1", b""),
        (b"HTTP/1.1 200 OK\r\n", "closed the connection without answering", b""),
    ],
)
async def test_the_parents_answer_is_read_by_its_head_alone(answer: bytes, got: object, left: bytes) -> None:
    seen, rest = await _answer_of_parent(answer)
    assert seen == got
    if isinstance(got, tuple):
        assert rest == left  # nothing after the head was read
