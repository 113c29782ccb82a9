"""Where features meet: a secret's value echoed back to the child, in every part of a response, in
every spelling egressd itself produced, on both fronts.

Why: egressd puts a secret's real value into requests to the secret's hosts; the child must never
get it back, or it could send it anywhere (egressd scans requests for placeholders, not values). A
server that reflects what it got hands the value back in any part of its answer — the status line's
reason phrase, a header (name or value) of the final response or of a `100 Continue` / `103 Early
Hints`, a chunked trailer, the body (split across chunks and reads), an error egressd reports about
a response it could not read — and in the spelling egressd sent it: as is (a header), percent-encoded
(a `query:` secret is sent as `quote(value)`), or the forms a server that decodes and re-encodes a URL
gives back (`/` kept, `+` for a space, lower-case hex). Each row sends one request through the real
`egressd run` (plain HTTP, or HTTPS inspected by egressd) to a real server that echoes one spelling
of one value in one part, reads the whole answer with h11, and proves that the answer arrived, that
no spelling of any value is in it, and that the echo was masked where it was (same length, `*`).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote, quote_plus, urlsplit

import pytest
import trustme

from tests.support.dns_server import DnsServer
from tests.support.egressd_cli import EgressdRun, write_policy
from tests.support.proxied import FRONTS, Answer, Proxied
from tests.support.raw_upstream import RawUpstream, Script, Seen

ADDRESS = "198.51.100.61"
HEADER_VALUE = "sk-Echo/Hdr+Key 42=ok~9f3e"
QUERY_VALUE = "q/Echo+Qry w&z=1;x-77c1"
VALUES = {"header": HEADER_VALUE, "query": QUERY_VALUE}
NOT_SECRET = "nothing-secret-here"  # what a row without a value echoes: passed on as sent


def _lower_hex(text: str) -> str:
    return re.sub(r"%[0-9A-F]{2}", lambda m: m[0].lower(), text)


SPELLINGS: dict[str, Callable[[str], str]] = {
    "raw": lambda v: v,
    "percent": lambda v: quote(v, safe=""),
    "percent-lower-hex": lambda v: _lower_hex(quote(v, safe="")),
    "percent-slash-kept": lambda v: quote(v),
    "plus": lambda v: quote_plus(v, safe=""),
}
TOKEN_SAFE = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")
FINAL = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"


def _scripts(echo: bytes) -> dict[str, Script]:
    """What the upstream answers, by the part of the response that carries the echo."""
    half = len(echo) // 2
    return {
        "reason-phrase": [b"HTTP/1.1 200 OK " + echo + b"\r\nContent-Length: 2\r\n\r\nok"],
        "header-value": [b"HTTP/1.1 200 OK\r\nX-Echo: " + echo + b"\r\nContent-Length: 2\r\n\r\nok"],
        "header-name": [b"HTTP/1.1 200 OK\r\nX-" + echo + b": 1\r\nContent-Length: 2\r\n\r\nok"],
        "redirect-location": [
            b"HTTP/1.1 302 Found\r\nLocation: /next?key=" + echo + b"\r\nContent-Length: 0\r\n\r\n"
        ],
        "100-continue-header": [b"HTTP/1.1 100 Continue\r\nX-Echo: " + echo + b"\r\n\r\n", 0.05, FINAL],
        "103-early-hints-header": [
            b"HTTP/1.1 103 Early Hints\r\nLink: </" + echo + b">; rel=preload\r\n\r\n",
            0.05,
            FINAL,
        ],
        "103-reason-phrase": [b"HTTP/1.1 103 " + echo + b"\r\n\r\n", FINAL],
        "chunked-trailer": [
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nTrailer: X-Echo\r\n\r\n"
            b"2\r\nok\r\n0\r\nX-Echo: " + echo + b"\r\n\r\n"
        ],
        "body": [b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\nyou sent %s" % (9 + len(echo), echo)],
        "body-split-across-chunks-and-reads": [
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n",
            b"%x\r\nyou sent %s\r\n" % (9 + half, echo[:half]),
            0.2,
            b"%x\r\n%s end\r\n0\r\n\r\n" % (len(echo) - half + 4, echo[half:]),
        ],
        "unreadable-header-line": [b"HTTP/1.1 200 OK\r\nBroken " + echo + b"\r\n\r\n"],
        "unreadable-status-line": [b"HTTP/1.1 2x0 " + echo + b"\r\n\r\n"],
    }


PARTS = list(_scripts(b"x"))
UNREADABLE = ("unreadable-header-line", "unreadable-status-line")
INTERIM = ("100-continue-header", "103-early-hints-header", "103-reason-phrase")


def _script(seen: Seen) -> Script:
    """`/echo/<part>/<spelling>/<which value>?key=...`: one spelling of one value in one part."""
    _, _, part, spelling, which = urlsplit(seen.target).path.split("/")[:5]
    echo = SPELLINGS[spelling](VALUES.get(which, NOT_SECRET)).encode()
    return _scripts(echo)[part]


@dataclass
class Setup:
    run: EgressdRun
    plain: RawUpstream
    tls: RawUpstream

    def request(self, front: str, path: str) -> Answer:
        """GET `path` on api.test with both placeholders where the secrets' entries put their values."""
        port = self.plain.port if front == "plain" else self.tls.port
        headers = [("Authorization", f"Bearer {self.run.env['HDR_KEY']}")]
        target = f"{path}?key={self.run.env['QRY_KEY']}"
        return Proxied(self.run).request(front, f"api.test:{port}", "GET", target, headers)


@pytest.fixture(scope="module")
def setup(ca: trustme.CA, ca_file: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Setup]:
    directory = tmp_path_factory.mktemp("echo")
    (directory / "header.key").write_text(HEADER_VALUE + "\n")
    (directory / "query.key").write_text(QUERY_VALUE + "\n")
    policy = write_policy(
        directory,
        f"""\
version: 1
mode: enforce
allow: [api.test]
private: {{allow: true}}
secrets:
  - name: hdr
    from: {{file: {directory / "header.key"}}}
    hosts: [api.test]
    env: HDR_KEY
  - name: qry
    from: {{file: {directory / "query.key"}}}
    hosts: [api.test]
    query: key
    env: QRY_KEY
""",
    )
    with DnsServer() as dns:
        dns.add("api.test", ADDRESS)
        with (
            RawUpstream(ADDRESS, _script, name="echo-plain") as plain,
            RawUpstream(ADDRESS, _script, ca=ca, hostnames=["api.test"], name="echo-tls") as tls,
            EgressdRun(
                ["--policy", str(policy), "--nameserver", dns.nameserver, "--upstream-ca", str(ca_file)]
            ) as run,
        ):
            yield Setup(run, plain, tls)


def _rows() -> Iterator[tuple[str, str, str, str]]:
    for front in FRONTS:
        for part in PARTS:
            for spelling, spell in SPELLINGS.items():
                for which, value in VALUES.items():
                    if part == "header-name" and not TOKEN_SAFE.fullmatch(spell(value)):
                        continue  # not a field name any server could send
                    yield front, part, spelling, which


@pytest.mark.parametrize(("front", "part", "spelling", "which"), list(_rows()))
def test_an_echoed_value_never_reaches_the_child(
    setup: Setup, front: str, part: str, spelling: str, which: str
) -> None:
    path = f"/echo/{part}/{spelling}/{which}"
    answer = setup.request(front, path)
    assert answer.final is not None, f"no final response: {answer.raw[:400]!r}"
    upstream = setup.plain if front == "plain" else setup.tls
    [seen] = [s for s in upstream.requests() if s.target.startswith(path + "?")]
    # egressd did put both values in: the header as is, the query percent-encoded
    assert seen.header("authorization") == f"Bearer {HEADER_VALUE}"
    assert seen.target.endswith("?key=" + quote(QUERY_VALUE, safe=""))
    text = answer.text().lower()
    for name, value in VALUES.items():
        for spelling_name, spell in SPELLINGS.items():
            assert spell(value).lower().encode() not in text, (name, spelling_name, answer.raw[:600])
    echo = SPELLINGS[spelling](VALUES[which]).encode()
    stars = b"*" * len(echo)
    if part in UNREADABLE:
        assert answer.final.status_code == 502, answer.raw[:400]
        return
    assert answer.final.status_code == (302 if part == "redirect-location" else 200), answer.raw[:400]
    if part in INTERIM and front == "inspected":
        assert answer.interim == [] and answer.body == b"ok"  # interim answers are not forwarded there
        return
    where = {
        "reason-phrase": answer.final.reason,
        "header-value": answer.field(b"x-echo"),
        "header-name": b"\n".join(n for n, _ in answer.final.headers.raw_items()),
        "redirect-location": answer.field(b"location"),
        "chunked-trailer": b"\n".join(v for _, v in answer.trailers),
        "body": answer.body,
        "body-split-across-chunks-and-reads": answer.body,
    }.get(part, b"\n".join(h.reason + b"".join(v for _, v in h.headers.raw_items()) for h in answer.interim))
    assert where is not None and stars in where, (part, answer.raw[:600])
    if part.startswith("body"):
        assert len(answer.body) == 9 + len(echo) + (4 if "split" in part else 0)


@pytest.mark.parametrize("front", FRONTS)
@pytest.mark.parametrize("part", ["100-continue-header", "103-early-hints-header", "chunked-trailer"])
def test_interim_answers_and_trailers_reach_the_child(setup: Setup, front: str, part: str) -> None:
    """mitmproxy alone reads a 100 or 103 as THE response (the real one is lost) and dies on
    trailers: inside inspection the child gets the final answer, with its trailers; interim answers
    are passed on by the plain-HTTP front only."""
    answer = setup.request(front, f"/echo/{part}/raw/none")
    assert answer.final is not None and answer.final.status_code == 200, answer.raw[:400]
    assert answer.body == b"ok"
    if part == "chunked-trailer":
        assert answer.trailers == [(b"X-Echo", NOT_SECRET.encode())], answer.raw[:400]
    elif front == "plain":
        [interim] = answer.interim
        assert interim.status_code == int(part[:3]) and NOT_SECRET.encode() in b"".join(
            v for _, v in interim.headers.raw_items()
        )
    else:
        assert answer.interim == []
