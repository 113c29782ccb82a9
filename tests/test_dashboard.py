"""The dashboard in a real headless Chromium (Debian's /usr/bin/chromium driven by Playwright):
a request in `mode: ask` waits until a button is clicked in the page (Allow once: 200 from the
upstream; Deny: 403 to the child), decisions appear live, and the page works under its strict CSP
with no violation. Its guards are proved over plain HTTP: a wrong Host (DNS rebinding) is refused,
so is a request without the token, and a state change without the CSRF token or from a foreign
origin. Policy edits from the page are validated like a file edit."""

from __future__ import annotations

import http.client
import os
import re
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.control import ask_policy, ps_rows, wait_for
from tests.support.dns_server import DnsServer
from tests.support.egressd_cli import EgressdRun
from tests.support.upstreams import EchoHTTPServer
from tests.test_ask_mode import finish, start_curl

CHROMIUM = "/usr/bin/chromium"
playwright_sync = pytest.importorskip("playwright.sync_api")
pytestmark = pytest.mark.skipif(not os.access(CHROMIUM, os.X_OK), reason="Debian's chromium is not installed")


@pytest.fixture
def up(dns: DnsServer) -> Iterator[EchoHTTPServer]:
    with EchoHTTPServer("127.0.0.1") as server:
        for name in ("up.test", "allowed.test"):
            dns.add(name, "127.0.0.1")
        yield server


class Served:
    """`egressd run --dashboard` in ask mode, and the dashboard URL it printed on stderr."""

    def __init__(self, run: EgressdRun, policy: Path) -> None:
        self.run = run
        self.policy = policy
        found = re.search(r"dashboard: (http://127\.0\.0\.1:(\d+)/\?token=(\S+))", run.stderr)
        assert found, run.stderr
        self.url, self.port, self.token = found.group(1), int(found.group(2)), found.group(3)
        self.cookie = ""

    def request(
        self, method: str, path: str, *, headers: dict[str, str] | None = None, body: str | None = None
    ) -> tuple[int, dict[str, str], bytes]:
        """One raw HTTP request to the dashboard (no proxy, headers exactly as given)."""
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=10)
        try:
            conn.putrequest(method, path, skip_host=True, skip_accept_encoding=True)
            for key, value in (headers or {}).items():
                conn.putheader(key, value)
            data = body.encode() if body is not None else None
            if data is not None:
                conn.putheader("Content-Length", str(len(data)))
            conn.endheaders(data)
            response = conn.getresponse()
            return response.status, {k.lower(): v for k, v in response.getheaders()}, response.read()
        finally:
            conn.close()

    def login(self) -> str:
        """The cookie the token URL sets (as a browser would get it)."""
        status, headers, _ = self.request(
            "GET", f"/?token={self.token}", headers={"Host": f"127.0.0.1:{self.port}"}
        )
        assert status == 303, status
        cookie = headers["set-cookie"]
        assert "HttpOnly" in cookie and "SameSite=Strict" in cookie, cookie
        self.cookie = cookie.split(";", 1)[0]
        return self.cookie


@pytest.fixture
def served(tmp_path: Path, dns: DnsServer, up: EchoHTTPServer) -> Iterator[Served]:
    policy = ask_policy(tmp_path)
    options = ["--policy", str(policy), "--nameserver", dns.nameserver, "--no-prompt", "--dashboard"]
    with EgressdRun([*options, "--identify"]) as run:  # each decision names its program
        assert run.wait_for_stderr("dashboard: http://", timeout=15), run.stderr
        yield Served(run, policy)


@pytest.fixture
def page(served: Served) -> Iterator[Any]:
    """A headless Chromium page opened at the printed URL, collecting console messages."""
    with playwright_sync.sync_playwright() as pw:
        browser = pw.chromium.launch(
            executable_path=CHROMIUM,
            headless=True,
            args=["--no-sandbox", "--no-proxy-server", "--disable-gpu"],
        )
        try:
            context = browser.new_context(viewport={"width": 1200, "height": 800})
            page = context.new_page()
            page.console_messages = []  # type: ignore[attr-defined]
            page.on("console", lambda msg: page.console_messages.append(msg.text))  # type: ignore[attr-defined]
            page.goto(served.url)
            page.wait_for_selector("#status.live", timeout=10_000)
            yield page
        finally:
            browser.close()


def csp_violations(page: Any) -> list[str]:
    return [m for m in page.console_messages if "Content Security Policy" in m or "CSP" in m]


def approver_attached() -> bool:
    rows = ps_rows()
    return bool(rows) and rows[0]["approvers"]["can_answer"]


def test_allow_once_clicked_in_the_page_releases_the_waiting_request(
    served: Served, page: Any, up: EchoHTTPServer
) -> None:
    wait_for(approver_attached, what="the open page to count as an approver")
    curl = start_curl(served.run, f"http://up.test:{up.port}/clicked")
    button = page.locator("#asks li.ask button[data-answer=once]")
    button.wait_for(timeout=10_000)
    assert "up.test" in page.locator("#asks li.ask .target").inner_text()
    assert up.connections == 0  # held until the click
    button.click()
    assert finish(curl)[0] == 200
    assert up.connections == 1
    page.wait_for_selector("#decisions tr.allowed[data-host='up.test']", timeout=10_000)
    page.wait_for_selector("#no-asks:not([hidden])", timeout=10_000)
    assert csp_violations(page) == []


def test_deny_clicked_in_the_page_refuses_the_child(served: Served, page: Any, up: EchoHTTPServer) -> None:
    wait_for(approver_attached, what="the open page to count as an approver")
    curl = start_curl(served.run, f"http://up.test:{up.port}/denied")
    page.locator("#asks li.ask button[data-answer=deny]").click(timeout=10_000)
    assert finish(curl) == (403, "ask_refused")
    assert up.connections == 0
    page.wait_for_selector("#decisions tr.refused[data-reason='ask_refused']", timeout=10_000)
    assert csp_violations(page) == []


def test_a_decision_shows_in_the_page_within_a_second(served: Served, page: Any, up: EchoHTTPServer) -> None:
    rows = page.locator("#decisions tr[data-host='allowed.test']")
    curl = start_curl(served.run, f"http://allowed.test:{up.port}/")
    assert finish(curl)[0] == 200
    done = time.monotonic()
    deadline = done + 1.0
    while rows.count() == 0 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert rows.count() >= 1, "the decision did not show within a second of the response"
    # the program that made the request (--identify): curl, with its pid
    assert re.fullmatch(r"/usr/bin/curl \(pid \d+\)", rows.first.locator("td").nth(7).inner_text())
    # the per-child counters follow
    page.wait_for_selector("#clients tbody tr", timeout=5_000)  # (a string eval: the CSP forbids it)
    assert csp_violations(page) == []


def test_the_page_adds_and_refuses_policy_rules_like_a_file_edit(served: Served, page: Any) -> None:
    page.fill("#rule-text", "bad rule with spaces")
    page.click("#rule-form button")
    page.wait_for_selector("#message.error", timeout=10_000)
    assert "not a valid allow rule" in page.inner_text("#message")
    assert "bad rule" not in served.policy.read_text()
    page.fill("#rule-text", "added.test:8443")
    page.click("#rule-form button")
    page.wait_for_selector("#allow code:text-is('added.test:8443')", timeout=10_000)
    text = served.policy.read_text()
    assert "added.test:8443" in text and "# the human loop under test" in text  # comments kept
    page.locator("#allow li", has_text="added.test:8443").locator("button").click()
    wait_for(lambda: "added.test" not in served.policy.read_text(), what="the rule removed from the file")
    assert csp_violations(page) == []


def test_grants_are_added_and_revoked_from_the_page(served: Served, page: Any) -> None:
    page.fill("#grant-target", "once.test:443")
    page.click("#grant-form button")
    page.wait_for_selector("#grants code:text-is('once.test:443')", timeout=10_000)
    assert [g["target"] for g in _grants(served)] == ["once.test:443"]
    page.locator("#grants li", has_text="once.test").locator("button").click()
    wait_for(lambda: not _grants(served), what="the grant revoked")


def _grants(served: Served) -> list[dict[str, Any]]:
    import json

    cookie = served.cookie or served.login()
    status, _, body = served.request(
        "GET", "/api/state", headers={"Host": f"127.0.0.1:{served.port}", "Cookie": cookie}
    )
    assert status == 200
    return json.loads(body)["grants"]


# -- the guards, over plain HTTP ---------------------------------------------------------------------
def test_a_wrong_host_header_is_refused(served: Served) -> None:
    cookie = served.login()
    port = served.port
    spellings = (
        "evil.test", f"evil.test:{port}", "127.0.0.1", f"127.0.0.2:{port}", "",
        f"127.0.0.1.:{port}", f"127.1:{port}", f"0x7f.0.0.1:{port}", f"[::ffff:127.0.0.1]:{port}",
        f"localhost.:{port}", f"127.0.0.1:0{port}", f"127.0.0.1:{port}@evil.test", f"evil.localhost:{port}",
    )  # fmt: skip
    for host in spellings:
        status, _, _ = served.request("GET", "/api/state", headers={"Host": host, "Cookie": cookie})
        assert status == 421, host
        status, _, _ = served.request("GET", f"/?token={served.token}", headers={"Host": host})
        assert status == 421, host
    ok, _, _ = served.request(
        "GET", "/api/state", headers={"Host": f"localhost:{served.port}", "Cookie": cookie}
    )
    assert ok == 200


def test_without_the_token_nothing_is_served(served: Served) -> None:
    host = {"Host": f"127.0.0.1:{served.port}"}
    for path in ("/", "/api/state", "/api/stream", "/static/app.js"):
        assert served.request("GET", path, headers=host)[0] == 401, path
        assert served.request("GET", path, headers={**host, "Cookie": "egressd_dashboard=nope"})[0] == 401
    assert served.request("GET", "/?token=wrong", headers=host)[0] == 403


def test_state_changes_need_same_origin_and_the_csrf_token(
    served: Served, page: Any, up: EchoHTTPServer
) -> None:
    cookie = served.login()
    csrf = page.get_attribute("meta[name=egressd-csrf]", "content")
    origin = f"http://127.0.0.1:{served.port}"
    base = {"Host": f"127.0.0.1:{served.port}", "Cookie": cookie, "Content-Type": "application/json"}
    body = '{"target": "sneaky.test:443"}'
    cases = {
        "no csrf": {**base, "Origin": origin},
        "wrong csrf": {**base, "Origin": origin, "X-CSRF-Token": "x" * 43},
        "foreign origin": {**base, "Origin": "http://evil.test", "X-CSRF-Token": csrf},
        "no origin": {**base, "X-CSRF-Token": csrf},
        "cross-site fetch": {**base, "Origin": origin, "X-CSRF-Token": csrf, "Sec-Fetch-Site": "cross-site"},
    }
    for name, headers in cases.items():
        assert served.request("POST", "/api/grants", headers=headers, body=body)[0] == 403, name
    assert _grants(served) == []
    status, _, _ = served.request(
        "POST", "/api/grants", headers={**base, "Origin": origin, "X-CSRF-Token": csrf}, body=body
    )
    assert status == 201
    assert [g["target"] for g in _grants(served)] == ["sneaky.test:443"]


def test_every_answer_carries_the_strict_headers(served: Served) -> None:
    cookie = served.login()
    for path, headers in (
        ("/", {"Cookie": cookie}),
        ("/static/app.js", {"Cookie": cookie}),
        ("/api/state", {}),
    ):
        status, got, _ = served.request("GET", path, headers={"Host": f"127.0.0.1:{served.port}", **headers})
        csp = got.get("content-security-policy", "")
        assert "default-src 'self'" in csp and "script-src 'self'" in csp and "unsafe-inline" not in csp, path
        assert got.get("x-frame-options") == "DENY" and got.get("cache-control") == "no-store", path


def test_the_url_goes_to_stderr_never_stdout(tmp_path: Path, dns: DnsServer) -> None:
    from tests.support.egressd_cli import EGRESSD

    result = subprocess.run(
        [
            *EGRESSD,
            "exec",
            "--policy",
            str(ask_policy(tmp_path)),
            "--no-prompt",
            "--dashboard",
            "--",
            "sh",
            "-c",
            "env; echo child-done",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    assert "child-done" in result.stdout
    found = re.search(r"dashboard: http://127\.0\.0\.1:(\d+)/\?token=(\S+)", result.stderr)
    assert found, result.stderr
    port, token = found.groups()
    assert token not in result.stdout  # neither printed on stdout nor in the child's environment
    assert f"127.0.0.1:{port}" not in result.stdout


@pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is needed")
def test_the_sandboxed_child_cannot_reach_the_dashboard(served: Served, tmp_path: Path) -> None:
    """The sandbox has its own network namespace: the host's loopback port is not there."""
    from tests.support.egressd_cli import EGRESSD

    probe = (
        "import socket,sys\n"
        f"s=socket.socket(); s.settimeout(3)\n"
        f"try:\n s.connect(('127.0.0.1', {served.port})); print('reached')\n"
        "except OSError as e: print('unreachable', e)\n"
    )
    result = subprocess.run(
        [*EGRESSD, "sandbox", "--allow", "example.test", "--", "python3", "-c", probe],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert "unreachable" in result.stdout, (result.stdout, result.stderr)
    assert "reached\n" not in result.stdout


def test_egressd_dashboard_attaches_to_a_running_instance(
    tmp_path: Path, dns: DnsServer, up: EchoHTTPServer
) -> None:
    """`egressd dashboard` (no --dashboard on the instance): the same page, served by the command,
    answering through the instance's control API; Allow for this run admits later requests too."""
    from tests.support.egressd_cli import EGRESSD

    assert subprocess.run([*EGRESSD, "dashboard"], capture_output=True, timeout=30).returncode == 2  # none
    options = ["--policy", str(ask_policy(tmp_path)), "--nameserver", dns.nameserver, "--no-prompt"]
    with EgressdRun(options) as run:
        dash = subprocess.Popen(
            [*EGRESSD, "dashboard"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        try:
            assert dash.stderr is not None
            line = dash.stderr.readline()
            found = re.search(r"dashboard: (http://127\.0\.0\.1:\d+/\?token=\S+)", line)
            assert found, line
            with playwright_sync.sync_playwright() as pw:
                browser = pw.chromium.launch(
                    executable_path=CHROMIUM, headless=True, args=["--no-sandbox", "--no-proxy-server"]
                )
                try:
                    page = browser.new_page()
                    page.goto(found.group(1))
                    page.wait_for_selector("#status.live", timeout=10_000)
                    wait_for(approver_attached, what="the page to count as an approver")
                    curl = start_curl(run, f"http://up.test:{up.port}/first")
                    page.locator("#asks li.ask button[data-answer=run]").click(timeout=10_000)
                    assert finish(curl)[0] == 200
                    assert finish(start_curl(run, f"http://up.test:{up.port}/second"))[0] == 200
                    page.wait_for_selector(
                        "#grants code:text-is('up.test:" + str(up.port) + "')", timeout=10_000
                    )
                finally:
                    browser.close()
        finally:
            dash.terminate()
            dash.wait(timeout=10)
        assert dash.stdout is not None and dash.stdout.read() == ""  # nothing on stdout


def test_without_an_open_page_the_dashboard_is_no_approver(served: Served, up: EchoHTTPServer) -> None:
    """An unattended dashboard never makes a child wait: asks are refused at once."""
    assert finish(start_curl(served.run, f"http://up.test:{up.port}/")) == (403, "no_approver")


def test_a_state_change_must_be_json(served: Served, page: Any) -> None:
    cookie = served.login()
    csrf = page.get_attribute("meta[name=egressd-csrf]", "content")
    headers = {
        "Host": f"127.0.0.1:{served.port}",
        "Cookie": cookie,
        "Origin": f"http://127.0.0.1:{served.port}",
        "X-CSRF-Token": csrf,
        "Content-Type": "text/plain",
    }
    assert served.request("POST", "/api/grants", headers=headers, body='{"target": "x.test"}')[0] == 415


def test_always_clicked_in_the_page_writes_the_policy_file(
    served: Served, page: Any, up: EchoHTTPServer
) -> None:
    wait_for(approver_attached, what="the open page to count as an approver")
    curl = start_curl(served.run, f"http://up.test:{up.port}/always")
    page.locator("#asks li.ask button[data-answer=always]").click(timeout=10_000)
    assert finish(curl)[0] == 200
    text = served.policy.read_text()
    assert f"up.test:{up.port}" in text and "# the human loop under test" in text
    page.wait_for_selector(f"#allow code:text-is('up.test:{up.port}')", timeout=10_000)
    assert csp_violations(page) == []


def test_a_closed_page_stops_counting_as_an_approver(served: Served, page: Any, up: EchoHTTPServer) -> None:
    """The page's reads of the state never count as polling: once it is closed, asks are refused
    at once again (not after the control API's 30 s poll grace)."""
    wait_for(approver_attached, what="the open page to count as an approver")
    page.close()
    wait_for(lambda: not approver_attached(), timeout=15, what="the closed page to stop counting")
    assert finish(start_curl(served.run, f"http://up.test:{up.port}/")) == (403, "no_approver")


def test_each_path_is_its_own_card_and_allow_once_releases_that_one(
    served: Served, page: Any, up: EchoHTTPServer
) -> None:
    """Three parallel requests to one host are three cards, each naming its path, each "1 waiting";
    Allow once on GET /public releases /public only."""
    wait_for(approver_attached, what="the open page to count as an approver")
    paths = ("/public", "/admin/delete", "/secrets/upload")
    curls = {path: start_curl(served.run, f"http://up.test:{up.port}{path}") for path in paths}
    cards = page.locator("#asks li.ask")
    wait_for(lambda: cards.count() == 3, what="three cards")
    texts = {cards.nth(i).locator(".target").inner_text(): cards.nth(i) for i in range(3)}
    assert sorted(texts) == sorted(f"up.test:{up.port} GET {path}" for path in paths)
    for card in texts.values():
        assert ", 1 waiting" in card.inner_text()
    texts[f"up.test:{up.port} GET /public"].locator("button[data-answer=once]").click()
    assert finish(curls["/public"])[0] == 200
    wait_for(lambda: cards.count() == 2, what="the answered card to go")
    assert curls["/admin/delete"].poll() is None and curls["/secrets/upload"].poll() is None
    for left in (1, 0):
        page.locator("#asks li.ask button[data-answer=deny]").first.click(timeout=10_000)
        wait_for(lambda left=left: cards.count() == left, what="a denied card to go")
    assert finish(curls["/admin/delete"]) == (403, "ask_refused")
    assert finish(curls["/secrets/upload"]) == (403, "ask_refused")
    assert [r["path"] for r in up.requests] == ["/public"]
    assert csp_violations(page) == []
