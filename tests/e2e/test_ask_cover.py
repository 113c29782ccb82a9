"""An answer covers exactly what the person was shown, through the real `egressd run` and CLI.

A question shows one request (client, method, scheme, host, port, path and query; a tunnel: its
host and port), so it may hold only requests identical in all of these: `GET /public`,
`/admin/delete` and `/secrets/upload` to one host are three questions, and `approve --once` on
the first releases nothing else. And a grant made while a matching request waits answers it at
once, as it would have had it come first.
"""

from __future__ import annotations

import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.support.asking import attached, finish, run_ask
from tests.support.control import Follower, Terminal, ask_policy, cli, cli_json, ps_rows, wait_for
from tests.support.dns_server import DnsServer
from tests.support.egressd_cli import EGRESSD, EgressdRun
from tests.support.upstreams import EchoHTTPServer

THREE = ("/public", "/admin/delete", "/secrets/upload")


@pytest.fixture
def up(dns: DnsServer, upstream: EchoHTTPServer) -> EchoHTTPServer:
    dns.add("up.test", upstream.host)
    dns.add("other.test", upstream.host)
    return upstream


@dataclass(frozen=True)
class Req:
    """One request a child makes: `tunnel` sends it through a CONNECT (the ask shows no path)."""

    path: str
    method: str = "GET"
    host: str = "up.test"
    tunnel: bool = False

    def start(self, run: EgressdRun, port: int) -> subprocess.Popen[bytes]:
        command = ["curl", "-sS", "-i", "--max-time", "40", "--path-as-is", "-X", self.method]
        if self.tunnel:
            command.append("--proxytunnel")
        url = f"http://{self.host}:{port}{self.path}"
        return subprocess.Popen([*command, url], env=run.child_env(), stdout=subprocess.PIPE)


def pending() -> list[dict[str, Any]]:
    return cli_json("pending", "--json")


def waiting(count: int) -> list[dict[str, Any]] | None:
    """The pending asks once `count` requests wait on them, in the order they were asked."""
    asks = pending()
    if sum(int(a["waiting"]) for a in asks) != count:
        return None
    return sorted(asks, key=lambda a: a["created"])


# (id, first request, second request, one question?)
COALESCING = [
    ("same-request", Req("/p"), Req("/p"), True),
    ("same-request-with-query", Req("/p?x=1"), Req("/p?x=1"), True),
    ("other-path", Req("/public"), Req("/admin/delete"), False),
    ("other-query", Req("/p?x=1"), Req("/p?x=2"), False),
    ("other-method", Req("/p"), Req("/p", method="DELETE"), False),
    ("other-host", Req("/p"), Req("/p", host="other.test"), False),
    ("path-spelling", Req("/p"), Req("/./p"), False),
    ("path-case", Req("/p"), Req("/P"), False),
    ("tunnel-twice", Req("/a", tunnel=True), Req("/b", tunnel=True), True),  # a CONNECT shows host:port
    ("tunnel-and-request", Req("/p", tunnel=True), Req("/p"), False),
]


@pytest.mark.parametrize(
    ("first", "second", "merged"), [c[1:] for c in COALESCING], ids=[c[0] for c in COALESCING]
)
def test_one_question_holds_only_requests_its_answer_covers_identically(
    tmp_path: Path, dns: DnsServer, up: EchoHTTPServer, first: Req, second: Req, merged: bool
) -> None:
    with run_ask(ask_policy(tmp_path), dns) as run, Follower():
        wait_for(attached, what="the follower to attach")
        a = first.start(run, up.port)
        wait_for(lambda: waiting(1), what="the first request to wait")
        b = second.start(run, up.port)
        asks = wait_for(lambda: waiting(2), what="both requests to wait")
        assert len(asks) == (1 if merged else 2), asks
        if not merged:  # each question shows its own request
            shown = [(ask["method"], ask["path"]) for ask in asks]
            assert len(set(shown)) == 2 or asks[0]["host"] != asks[1]["host"], shown
        answer = cli("approve", asks[0]["id"])
        assert answer.returncode == 0, answer.stderr
        assert f"({2 if merged else 1} waiting released)" in answer.stdout
        assert finish(a)[0] != 403
        if merged:
            assert finish(b)[0] != 403
        else:
            time.sleep(0.3)
            assert b.poll() is None  # still waiting on its own question
            assert [ask["id"] for ask in pending()] == [asks[1]["id"]]
            assert cli("deny", asks[1]["id"]).returncode == 0
            assert finish(b) == (403, "ask_refused")


def test_three_paths_are_three_questions_on_every_listing(
    tmp_path: Path, dns: DnsServer, up: EchoHTTPServer
) -> None:
    """`approve --once` on GET /public releases /public only; `egressd pending` lists each path."""
    with run_ask(ask_policy(tmp_path), dns) as run, Follower() as follower:
        wait_for(attached, what="the follower to attach")
        curls = {path: Req(path).start(run, up.port) for path in THREE}
        asks = wait_for(lambda: waiting(3), what="three requests to wait")
        assert sorted(ask["path"] for ask in asks) == sorted(THREE)
        assert all(ask["waiting"] == 1 for ask in asks)
        listing = cli("pending").stdout.splitlines()
        for path in THREE:
            [line] = [line for line in listing if f"GET {path} " in line]
            assert "1 waiting" in line
        public = next(ask for ask in asks if ask["path"] == "/public")
        answer = cli("approve", public["id"])
        assert answer.returncode == 0 and "(1 waiting released)" in answer.stdout, answer
        assert finish(curls["/public"])[0] == 200
        time.sleep(0.3)
        assert curls["/admin/delete"].poll() is None and curls["/secrets/upload"].poll() is None
        for ask in asks:
            if ask is not public:
                assert cli("deny", ask["id"]).returncode == 0
        assert finish(curls["/admin/delete"]) == (403, "ask_refused")
        assert finish(curls["/secrets/upload"]) == (403, "ask_refused")
        assert [r["path"] for r in up.requests] == ["/public"]
        assert len(follower.asks()) == 3


def test_the_terminal_prompt_asks_each_path_on_its_own(
    tmp_path: Path, dns: DnsServer, up: EchoHTTPServer
) -> None:
    """Three parallel requests of the child: three questions on /dev/tty, one after the other, each
    naming its own URL and none "3 waiting"; `o` on /public releases /public only."""
    urls = {path: f"http://up.test:{up.port}{path}" for path in THREE}
    curl = "curl -sS -o /dev/null --max-time 40 -w"
    fetches = " & ".join(f"{curl} '%{{http_code}} {path}\\n' '{url}'" for path, url in urls.items())
    command = [*EGRESSD, "exec", "--policy", str(ask_policy(tmp_path)), "--nameserver", dns.nameserver]
    with Terminal([*command, "--", "sh", "-c", f"{fetches} & wait"]) as tty:
        answered: list[str] = []
        for _ in THREE:
            question = tty.read_until(b"then Enter").decode()
            # every request still unanswered is waiting: the question is asked about all it holds
            wait_for(lambda: waiting(len(THREE) - len(answered)), what="the unanswered requests to wait")
            wants = question.split(" wants ", 1)[1]  # before it: the child's command line
            [path] = [path for path, url in urls.items() if f"(GET {url})" in wants]
            assert "waiting" not in wants, question
            assert not [p for p in THREE if p != path and p in wants], question
            tty.type("o" if path == "/public" else "d")
            answered.append(path)
        out, err = tty.finish()
    assert sorted(answered) == sorted(THREE)
    expected = ["200 /public", "403 /admin/delete", "403 /secrets/upload"]
    assert sorted(out.decode().splitlines()) == sorted(expected), err
    assert [r["path"] for r in up.requests] == ["/public"]


# (id, the requests waiting, the grant made meanwhile, how many of them it admits)
GRANTS = [
    ("host-and-port", [Req("/p")], "up.test:{P}", 1),
    ("one-of-two-identical", [Req("/p"), Req("/p")], "up.test:{P}", 1),
    ("one-of-two-paths", [Req("/p"), Req("/q")], "up.test:{P}", 1),
    ("url", [Req("/p?x=1")], "http://up.test:{P}/p?x=1", 1),
    ("url-of-another-path", [Req("/q")], "http://up.test:{P}/p", 0),
    ("url-of-another-query", [Req("/p?x=2")], "http://up.test:{P}/p?x=1", 0),
    ("another-host", [Req("/p")], "other.test:{P}", 0),
    ("another-port", [Req("/p")], "up.test:{Q}", 0),
    ("bare-host-web-ports-only", [Req("/p")], "up.test", 0),
    ("tunnel", [Req("/t", tunnel=True)], "up.test:{P}", 1),
]


@pytest.mark.parametrize(
    ("requests", "grant", "admitted"), [g[1:] for g in GRANTS], ids=[g[0] for g in GRANTS]
)
def test_a_grant_answers_the_requests_waiting_that_it_covers(
    tmp_path: Path, dns: DnsServer, up: EchoHTTPServer, requests: list[Req], grant: str, admitted: int
) -> None:
    """A one-shot grant made while requests wait on asks admits (at once, not after ask_timeout)
    what it would have admitted had it come first, and only that."""
    with run_ask(ask_policy(tmp_path), dns) as run, Follower():
        wait_for(attached, what="the follower to attach")
        curls = []
        for request in requests:  # one after the other: the asks are made in this order
            curls.append(request.start(run, up.port))
            wait_for(lambda: waiting(len(curls)), what="the request to wait")
        spec = grant.replace("{P}", str(up.port)).replace("{Q}", str(up.port % 65535 + 1))
        made = cli("grant", spec, "--once")
        assert made.returncode == 0, made.stderr
        started = time.monotonic()
        wait_for(lambda: sum(c.poll() is not None for c in curls) >= admitted, what="the granted requests")
        assert time.monotonic() - started < 10  # at once: ask_timeout is 30 s
        time.sleep(0.5)
        done = [c for c in curls if c.poll() is not None]
        assert len(done) == admitted and all(finish(c)[0] == 200 for c in done)
        assert waiting(len(curls) - admitted) is not None  # the others still wait on their asks
        for ask in pending():
            assert cli("deny", ask["id"]).returncode == 0
        assert [finish(c) for c in curls if c not in done] == [(403, "ask_refused")] * (len(curls) - admitted)
        grants = ps_rows()[0]["counts"]["grants"]
        assert grants == (0 if admitted else 1)  # a grant that admitted a request is used up


def test_a_run_answer_releases_the_other_questions_of_that_host_and_port(
    tmp_path: Path, dns: DnsServer, up: EchoHTTPServer
) -> None:
    """`approve --run` admits the host and port for the rest of the run: the requests to it that
    wait on other questions go too; another host's question stays."""
    with run_ask(ask_policy(tmp_path), dns) as run, Follower():
        wait_for(attached, what="the follower to attach")
        requests = [Req("/a"), Req("/b", method="POST"), Req("/c", host="other.test")]
        curls = []
        for request in requests:
            curls.append(request.start(run, up.port))
            wait_for(lambda: waiting(len(curls)), what="the request to wait")
        first = next(ask for ask in pending() if ask["path"] == "/a")
        answer = cli("approve", "--run", first["id"])
        assert answer.returncode == 0 and "(1 waiting released)" in answer.stdout, answer
        assert finish(curls[0])[0] == 200 and finish(curls[1])[0] == 200
        [left] = wait_for(lambda: waiting(1), what="only other.test's question left")
        assert left["host"] == "other.test" and curls[2].poll() is None
        assert cli("deny", left["id"]).returncode == 0
        assert finish(curls[2]) == (403, "ask_refused")
