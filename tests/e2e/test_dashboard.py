"""The dashboard in a real headless Chromium (Debian's /usr/bin/chromium driven by Playwright):
a request in `mode: ask` waits until a button is clicked in the page (Allow once: 200 from the
upstream; Deny: 403 to the child), decisions appear live, and the page works under its strict CSP
with no violation. Its guards are proved over plain HTTP: a wrong Host (DNS rebinding) is refused,
so is a request without the token, and a state change without the CSRF token or from a foreign
origin. Policy edits from the page are validated like a file edit."""

from __future__ import annotations

import contextlib
import http.client
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from egressd.dashboard.server import WHILE_OPEN
from tests.support.asking import finish, start_curl
from tests.support.control import ask_policy, ps_rows, wait_for
from tests.support.dns_server import DnsServer
from tests.support.egressd_cli import EgressdRun
from tests.support.upstreams import EchoHTTPServer

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
    policy = ask_policy(tmp_path, timeout=90)  # a loaded machine can take long to show a card
    options = ["--policy", str(policy), "--nameserver", dns.nameserver, "--no-prompt", "--dashboard"]
    with EgressdRun([*options, "--identify"]) as run:  # each decision names its program
        assert run.wait_for_stderr("dashboard: http://", timeout=15), run.stderr
        yield Served(run, policy)


@contextlib.contextmanager
def open_page(url: str) -> Iterator[Any]:
    """A headless Chromium page opened at `url`, collecting its console messages (type, text, url)."""
    with playwright_sync.sync_playwright() as pw:
        browser = pw.chromium.launch(
            executable_path=CHROMIUM,
            headless=True,
            args=["--no-sandbox", "--no-proxy-server", "--disable-gpu"],
        )
        try:
            context = browser.new_context(viewport={"width": 1200, "height": 800})
            page = context.new_page()
            messages: list[tuple[str, str, str]] = []
            page.console_messages = messages  # type: ignore[attr-defined]
            page.on("console", lambda msg: messages.append((msg.type, msg.text, msg.location.get("url", ""))))
            page.goto(url)
            page.wait_for_selector("#status.live", timeout=10_000)
            yield page
        finally:
            browser.close()


@pytest.fixture
def page(served: Served) -> Iterator[Any]:
    with open_page(served.url) as opened:
        yield opened


def csp_violations(page: Any) -> list[str]:
    """Violations of the CSP, and any other error in the console (a resource that failed: 404) but
    the API's refusals the page shows as its message (a bad rule: 400)."""
    return [
        f"{text} ({url})"
        for kind, text, url in page.console_messages
        if "Content Security Policy" in text or (kind == "error" and "/api/" not in url)
    ]


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
    found = re.search(r"dashboard: http://127\.0\.0\.1:(\d+)/\?token=(\S+)  \((.*)\)$", result.stderr, re.M)
    assert found, result.stderr
    assert found.group(3) == WHILE_OPEN == "asks wait for an answer only while a page is open"
    port, token, _ = found.groups()
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
        [*EGRESSD, "sandbox", "--allow", "example.test", "--", sys.executable, "-c", probe],
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
            assert WHILE_OPEN in line
            with open_page(found.group(1)) as page:
                wait_for(approver_attached, what="the page to count as an approver")
                curl = start_curl(run, f"http://up.test:{up.port}/first")
                page.locator("#asks li.ask button[data-answer=run]").click(timeout=10_000)
                assert finish(curl)[0] == 200
                assert finish(start_curl(run, f"http://up.test:{up.port}/second"))[0] == 200
                page.wait_for_selector("#grants code:text-is('up.test:" + str(up.port) + "')", timeout=10_000)
                assert csp_violations(page) == []
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


# -- what the page shows -----------------------------------------------------------------------------
def test_the_page_opens_with_the_recent_decisions(served: Served, up: EchoHTTPServer) -> None:
    """Decisions made before the page opened are listed when it opens (each once), beside the
    counters that count them; the page loads without one console error (no 404: it has its icon)."""
    for path in ("/a", "/b", "/c"):
        assert finish(start_curl(served.run, f"http://allowed.test:{up.port}{path}"))[0] == 200
    assert finish(start_curl(served.run, f"http://refused.test:{up.port}/")) == (403, "no_approver")
    with open_page(served.url) as page:
        rows = page.locator("#decisions tbody tr")
        wait_for(lambda: rows.count() >= 4, timeout=10, what="the backlog")
        targets = [rows.nth(i).locator("td").nth(3).inner_text() for i in range(rows.count())]
        assert targets == [
            f"refused.test:{up.port} GET /",
            *(f"allowed.test:{up.port} GET {path}" for path in ("/c", "/b", "/a")),
        ]
        assert page.locator("#decisions tr.refused[data-reason='no_approver']").count() == 1
        page.wait_for_selector("#clients tbody tr", timeout=5_000)
        assert "decisions 4 · allowed 3 · refused 1" in page.inner_text("#totals")
        # a new decision comes after the backlog, once
        assert finish(start_curl(served.run, f"http://allowed.test:{up.port}/d"))[0] == 200
        wait_for(lambda: rows.count() == 5, timeout=10, what="the live decision")
        assert rows.first.locator("td").nth(3).inner_text() == f"allowed.test:{up.port} GET /d"
        assert csp_violations(page) == []
    status, headers, _ = served.request(
        "GET", "/static/icon.svg", headers={"Host": f"127.0.0.1:{served.port}", "Cookie": served.login()}
    )
    assert status == 200 and headers["content-type"].startswith("image/svg+xml")


def test_an_ask_card_says_time_left_who_asks_what_it_covers_and_what_always_writes(
    served: Served, page: Any, up: EchoHTTPServer, dns: DnsServer
) -> None:
    """The card of a question two requests wait on: the time left counting down, the program that
    asked, each waiting request with its program, and for each button what it covers — "Always"
    the exact rule it writes and what that rule matches, which is then what it admits (a subdomain
    too)."""
    wait_for(approver_attached, what="the open page to count as an approver")
    url = f"http://up.test:{up.port}/same"
    curls = [start_curl(served.run, url) for _ in range(2)]
    other = start_curl(served.run, f"http://up.test:{up.port}/other")
    card = page.locator("#asks li.ask", has=page.locator(".target", has_text=" GET /same"))
    other_card = page.locator("#asks li.ask", has=page.locator(".target", has_text=" GET /other"))

    def two_waiting() -> bool:
        """The page redraws its cards as asks change: a card counted may be gone when read. The
        card of /other too: "for this run" names it once it waits."""
        try:
            return (
                card.count() == 1
                and other_card.count() == 1
                and ", 2 waiting" in card.inner_text(timeout=1000)
            )
        except playwright_sync.TimeoutError:
            return False

    wait_for(two_waiting, timeout=60, what="one card, 2 waiting, and the other ask's card")
    left = card.locator(".left")
    first = int(re.fullmatch(r"refused in (\d+) s unless answered", left.inner_text()).group(1))  # type: ignore[union-attr]
    assert 0 < first <= 90  # ask_timeout: 90
    wait_for(lambda: int(re.findall(r"\d+", left.inner_text())[0]) < first, timeout=20, what="the countdown")
    assert (
        "asked by" in card.locator(".who").inner_text() and "curl" in card.locator(".who code").inner_text()
    )
    requests = card.locator(".requests li")
    assert requests.count() == 2
    pids = sorted(int(re.search(r"\(pid (\d+)\)", requests.nth(i).inner_text()).group(1)) for i in range(2))  # type: ignore[union-attr]
    assert pids == sorted(c.pid for c in curls)
    scope = {key: card.locator(f"dd[data-answer={key}]").inner_text() for key in ("once", "run", "always")}
    assert scope["once"] == "these 2 waiting requests only; the next one is asked again."
    assert scope["run"] == (
        f"every request to up.test:{up.port} (this exact host, not its subdomains) until egressd exits"
        " — the other ask to it waiting now too: GET /other."
    )
    assert scope["always"] == (
        f"adds the rule up.test:{up.port} to the allow list of {served.policy}: it matches up.test and "
        f"every name under it (*.up.test) on port {up.port}, for every child, from now on."
    )
    labels = card.locator("button").all_inner_texts()
    assert labels == ["Allow once", "Allow for this run", "Always allow", "Deny"]
    form_label = page.locator("#grant-form button").inner_text()
    assert form_label == "Grant one request" and form_label not in labels  # two buttons, two names
    card.locator("button[data-answer=always]").click()
    assert [finish(c)[0] for c in (*curls, other)] == [200, 200, 200]
    assert f"  - up.test:{up.port}\n" in served.policy.read_text()  # the rule it said, written
    page.wait_for_selector(f"#allow code:text-is('up.test:{up.port}')", timeout=10_000)  # reloaded
    dns.add("sub.up.test", "127.0.0.1")
    assert finish(start_curl(served.run, f"http://sub.up.test:{up.port}/")) == (200, None)
    assert csp_violations(page) == []
