"""The engine's own pieces: refusal rendering, credentials, the pinned connect, the SNI rule."""

from __future__ import annotations

import asyncio
import base64
import ipaddress
import time
from collections.abc import Awaitable, Callable

import pytest

from egressd.admission.credentials import CredentialStore
from egressd.inspect import patches
from egressd.inspect.error_pages import refusal_from_error
from egressd.net import pinning
from egressd.policy.refusal import Refusal
from egressd.wire.refusal import body as refusal_body
from egressd.wire.refusal import headers as refusal_headers
from tests.support.upstreams import EchoHTTPServer, RefusingPort, StallingPort

ip = ipaddress.ip_address


# -- refusals ----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("reason", "status", "error"),
    [
        ("not_allowlisted", 403, "http_request_denied"),
        ("denylist", 403, "http_request_denied"),
        ("forbidden_address", 403, "destination_ip_prohibited"),
        ("resolved_forbidden", 403, "destination_ip_prohibited"),
        ("self", 403, "destination_ip_prohibited"),
        ("dns_error", 502, "dns_error"),
        ("dns_timeout", 502, "dns_timeout"),
        ("connect_refused", 502, "connection_refused"),
        ("connect_timeout", 504, "connection_timeout"),
        ("proxy_auth_required", 407, "http_request_denied"),
        ("bad_request", 400, "http_request_error"),
        ("rate_limited", 429, "connection_limit_reached"),
        ("internal_error", 500, "proxy_internal_error"),
    ],
)
def test_refusal_status_and_proxy_status(reason: str, status: int, error: str) -> None:
    refusal = Refusal(reason, 'a "quoted" detail\n', "evil.test", 443)
    headers = dict(refusal_headers(refusal))
    assert refusal.status == status
    assert headers["X-Egressd-Reason"] == reason
    assert headers["Proxy-Status"].startswith(f"egressd; error={error}; details=")
    assert '\\"quoted\\"' in headers["Proxy-Status"] and "\n" not in headers["Proxy-Status"]
    body = refusal_body(refusal)
    assert "evil.test:443" in body and reason in body
    if status == 407:
        assert headers["Proxy-Authenticate"].startswith("Basic")
    if status == 429:
        assert "Retry-After" in headers


def test_policy_refusal_body_says_how_to_allow() -> None:
    refusal = Refusal("not_allowlisted", "not on the allowlist", "api.example", 443, "mode: enforce")
    body = refusal_body(refusal)
    assert "policy decision" in body and "retrying" in body
    assert "egressd exec --allow api.example" in body
    forbidden = Refusal("forbidden_address", "metadata", "169.254.169.254", 80)
    assert "egressd exec --allow" not in refusal_body(forbidden)


def test_mitmproxy_errors_map_to_reasons() -> None:
    """mitmproxy's own errors (no failure of egressd's recorded) keep their status and get a reason."""
    status, refusal = refusal_from_error(400, "Bad request line")
    assert status == 400 and refusal.reason == "bad_request"
    status, refusal = refusal_from_error(502, "TLS handshake failed: certificate verify failed")
    assert (status, refusal.reason) == (502, "upstream_tls_error")
    assert refusal_from_error(504, "timed out")[1].reason == "connect_timeout"


# -- credentials -------------------------------------------------------------------------------
def test_credentials_fresh_and_checked() -> None:
    store = CredentialStore()
    a, b = store.issue(), store.issue("ci")
    assert a.token != b.token and len(a.token) >= 24
    assert b.username == "ci" and b.profile == "ci" and a.profile is None
    assert store.check(a.username, a.token) == a
    assert store.check("ci", a.token) is None
    basic = "Basic " + base64.b64encode(f"ci:{b.token}".encode()).decode()
    assert store.check_basic(basic) == b
    for bad in (None, "", "Bearer x", "Basic !!!", "Basic " + base64.b64encode(b"nocolon").decode()):
        assert store.check_basic(bad) is None
    store.revoke(b)
    assert store.check_basic(basic) is None
    assert a.proxy_url("127.0.0.1", 8080) == f"http://egressd:{a.token}@127.0.0.1:8080"


def _basic(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


@pytest.mark.parametrize(
    "value",
    [
        "Basic {good}{good}",  # excess data after the padding
        "Basic ={good}",  # leading padding
        "Basic {good_bare}",  # padding left off
        "Basic {good_bare}=",  # too little padding
        "Basic {half} {rest}",  # a space inside
        "Basic {half}\n{rest}",  # a line break inside
        "Basic {half}*{rest}",  # a byte outside the alphabet
        "Basic {good}é",  # non-ASCII text
        "Basic {good}\udcff",  # an undecodable byte, as the front passes it on (surrogateescape)
        "Basic " + base64.b64encode(b"egressd:\xff\xfe").decode(),  # not UTF-8 inside
        "Basic",
        "Basic ",
    ],
)
def test_anything_but_strict_base64_of_issued_credentials_is_refused(value: str) -> None:
    store = CredentialStore()
    a = store.issue()
    good = _basic(f"{a.username}:{a.token}")
    assert store.check_basic(f"Basic {good}") == a and store.check_basic(f"basic  {good} ") == a
    assert good.endswith("=")  # "egressd:" and 32 token characters: 40 bytes, padded
    half, rest = good[: len(good) // 2], good[len(good) // 2 :]
    value = value.format(good=good, good_bare=good.rstrip("="), half=half, rest=rest)
    assert store.check_basic(value) is None


# -- pinned connect ----------------------------------------------------------------------------
def test_an_address_text_is_its_own_whatever_else_shares_its_integer() -> None:
    """address_text remembers by class, integer and scope: an IPv4 and an IPv6 address of one
    integer, or two scopes of one IPv6 address, are each spelled as str() spells them."""
    spellings = ["0.0.0.1", "::1", "::ffff:1.2.3.4", "1.2.3.4", "fe80::1", "fe80::1%eth0", "fe80::1%2"]
    for _ in range(2):  # the second time from the memory
        for text in spellings:
            assert pinning.address_text(ip(text)) == str(ip(text))


class _Kept(asyncio.Protocol):
    transport: asyncio.BaseTransport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport


async def test_connect_pinned_tries_next_address() -> None:
    with EchoHTTPServer("198.51.100.7") as server:
        pin = pinning.Pin("up.test", server.port, (ip("198.51.100.8"), ip(server.host)), 2.0)
        protocol = _Kept()
        connected = await pinning.connect_protocol(pin, protocol)
        assert protocol.transport is not None
        protocol.transport.close()
        assert pin.connected == connected
        attempts = pin.attempts
        assert len(attempts) == 1 and "198.51.100.8" in attempts[0]
        assert connected == (server.host, server.port)


async def test_connect_pinned_reports_refused_and_timeout() -> None:
    with RefusingPort("198.51.100.6") as refusing, StallingPort("198.51.100.5") as stalling:
        with pytest.raises(pinning.ConnectFailure) as refused:
            await pinning.connect_protocol(
                pinning.Pin("up.test", refusing.address[1], (ip(refusing.address[0]),), 2.0),
                asyncio.Protocol(),
            )
        assert refused.value.reason == "connect_refused"
        # six silent addresses at 0.5 s each would take 3 s: all of them together get 2x connect_timeout
        start = time.monotonic()
        addresses = (ip(stalling.address[0]),) * 6
        with pytest.raises(pinning.ConnectFailure) as timed_out:
            await pinning.connect_protocol(
                pinning.Pin("up.test", stalling.address[1], addresses, 0.5), asyncio.Protocol()
            )
        elapsed = time.monotonic() - start
        assert timed_out.value.reason == "connect_timeout"
        assert elapsed < 2 * 0.5 + 1.5, elapsed  # within 2x connect_timeout (with margin), not 6x
        assert "2x connect_timeout used up" in timed_out.value.detail


async def _try_one(open_one: Callable[[str], Awaitable[None]], timeout: float) -> list[str]:
    attempts: list[str] = []
    await pinning.try_addresses((ip("192.0.2.1"), ip("192.0.2.2")), 443, timeout, open_one, attempts)
    return attempts


async def test_a_cancel_from_outside_is_not_taken_for_a_connect_timeout() -> None:
    """The client went away while egressd connected: the task ends, no next address is tried."""
    tried: list[str] = []

    async def cancelled_meanwhile(address: str) -> None:
        tried.append(address)
        task = asyncio.current_task()
        assert task is not None
        task.cancel()
        await asyncio.sleep(10)

    with pytest.raises(asyncio.CancelledError):
        await asyncio.create_task(_try_one(cancelled_meanwhile, 5.0))
    assert tried == ["192.0.2.1"]


async def test_a_cancel_from_outside_at_the_deadline_still_cancels() -> None:
    """The deadline and a cancel from outside together: the cancel wins, as with asyncio.timeout."""
    tried: list[str] = []

    async def cancelled_at_the_deadline(address: str) -> None:
        tried.append(address)
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:  # the deadline's; the client goes away in the same moment
            task = asyncio.current_task()
            assert task is not None
            task.cancel()
            raise

    with pytest.raises(asyncio.CancelledError):
        await asyncio.create_task(_try_one(cancelled_at_the_deadline, 0.05))
    assert tried == ["192.0.2.1"]


async def test_each_attempt_times_out_on_its_own_and_the_next_is_tried() -> None:
    async def silent(address: str) -> None:
        await asyncio.sleep(10)

    with pytest.raises(pinning.ConnectFailure) as failure:
        await _try_one(silent, 0.05)
    assert failure.value.reason == "connect_timeout"
    assert [a.split(":")[0] for a in failure.value.detail.split("; ")] == ["192.0.2.1", "192.0.2.2"]
    task = asyncio.current_task()
    assert task is not None and task.cancelling() == 0  # the deadlines' cancels were taken back


async def test_attempts_under_way_together_each_time_out_at_their_own_budget() -> None:
    """The attempts of one loop share one timer, set for the earliest deadline: a short budget
    entered after a long one still ends at its own, the long ones at theirs, each told apart."""

    async def silent(address: str) -> None:
        await asyncio.sleep(30)

    async def timed(budget: float) -> tuple[float, str]:
        start = time.monotonic()
        with pytest.raises(pinning.ConnectFailure) as failure:
            await _try_one(silent, budget)
        return time.monotonic() - start, failure.value.reason

    budgets = [3.0, 0.2, 1.5, 0.4, 3.0]
    tasks = []
    for budget in budgets:
        tasks.append(asyncio.create_task(timed(budget)))
        await asyncio.sleep(0.01)
    for budget, (elapsed, reason) in zip(budgets, await asyncio.gather(*tasks), strict=True):
        assert reason == "connect_timeout"
        # two addresses, each given up after its budget (a loaded machine only adds; the short
        # budgets still end well before the long ones' 6 s)
        assert 2 * budget * 0.9 <= elapsed < 2 * budget + 3.5, (budget, elapsed)


async def test_an_attempt_that_connected_is_never_cancelled_by_its_deadline_later() -> None:
    """An attempt that ended before its deadline leaves nothing behind: the task goes on past the
    deadline uncancelled, while another attempt's deadline fires meanwhile."""

    async def at_once(address: str) -> str:
        return address

    async def silent(address: str) -> None:
        await asyncio.sleep(30)

    opened, connected = await pinning.try_addresses((ip("192.0.2.1"),), 443, 0.1, at_once)
    assert (opened, connected) == ("192.0.2.1", ("192.0.2.1", 443))
    with pytest.raises(pinning.ConnectFailure):
        await _try_one(silent, 0.05)  # a deadline of another attempt fires while the first is over
    await asyncio.sleep(0.3)  # past the first attempt's deadline: no CancelledError here
    task = asyncio.current_task()
    assert task is not None and task.cancelling() == 0
    assert not pinning._deadlines().pending


def test_connect_hook_refuses_other_mitmproxy_version(monkeypatch: pytest.MonkeyPatch) -> None:
    from mitmproxy import version

    monkeypatch.setattr(version, "VERSION", "99.0.0")
    with pytest.raises(RuntimeError, match="mitmproxy==12.3.1"):
        patches.install()


# -- SNI rule ----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("tunnel", "sni", "ok"),
    [
        ("up.test", "up.test", True),
        ("up.test", "UP.test.", True),
        ("xn--bcher-kva.example", "bücher.example", True),
        ("up.test", "other.test", False),
        ("up.test", "up.test.other.test", False),
        ("up.test", None, False),
        ("up.test", "", False),
        ("198.51.100.1", None, True),
        ("198.51.100.1", "up.test", False),
        ("2001:db8::1", None, True),
        ("up.test", "up..test", False),
        ("up.test", "up.test\x00.evil", False),
    ],
)
def test_sni_rule(tunnel: str, sni: str | None, ok: bool) -> None:
    from egressd.wire.sni import sni_problem

    assert (sni_problem(tunnel, sni) is None) is ok
