"""The placeholder matcher and its streaming scan; the secrets step's refusals and injections; the
`secrets:` entries of a policy.

Why: the child has read this code. It will try every spelling of the placeholder the matcher might
miss and every split of a body across chunks; what the matcher claims to find (docs/secrets.md) is
held here by tables of the nasty spellings and by properties over random splits.
"""

from __future__ import annotations

import base64
import json
import re
import urllib.parse

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from egressd.admission.secrets import SecretBook
from egressd.policy import PolicyError, canonical_host, parse_policy
from egressd.policy.dump import policy_to_data
from egressd.policy.refusal import Refusal
from egressd.policy.secrets import secrets_from_options
from egressd.wire.placeholders import (
    Needles,
    PlaceholderFound,
    PlaceholderStream,
    ValueMask,
    placeholder,
    value_spellings,
)

TOKEN = "0123456789abcdef0f1e2d3c4b5a6978"
PH = placeholder("api", TOKEN)
NEEDLES = Needles.of({"api": PH})


def _pct(text: str) -> str:
    return "".join(f"%{ord(c):02X}" for c in text)


SPELLINGS = {
    "as written": PH,
    "token alone": TOKEN,
    "upper case": PH.upper(),
    "mixed case": "".join(c.upper() if i % 2 else c for i, c in enumerate(PH)),
    "percent-encoded": _pct(PH),
    "percent-encoded, lower hex": _pct(PH).lower(),
    "percent-encoded twice": urllib.parse.quote(_pct(TOKEN)),
    "json unicode escapes": "".join(f"\\u00{ord(c):02x}" for c in TOKEN),
    "in a json string": json.dumps({"key": PH}),
    "utf-16": PH.encode("utf-16-le").decode("latin-1"),
    "hex of the token": TOKEN.encode().hex(),
    "base64, offset 0": base64.b64encode(TOKEN.encode()).decode(),
    "base64, offset 1": base64.b64encode(b"x" + TOKEN.encode()).decode(),
    "base64, offset 2": base64.b64encode(b"xy" + PH.encode() + b"z").decode(),
    "base64 of basic auth": base64.b64encode(f"user:{PH}".encode()).decode(),
    "url-safe base64": base64.urlsafe_b64encode(b"\xff\xfe" + TOKEN.encode()).decode(),
    "multipart": f'--b\r\nContent-Disposition: form-data; name="k"\r\n\r\n{PH}\r\n--b--\r\n',
}


@pytest.mark.parametrize("text", SPELLINGS.values(), ids=SPELLINGS.keys())
def test_every_known_spelling_is_found(text: str) -> None:
    assert NEEDLES.find(text) == "api"
    assert NEEDLES.find(text.encode("latin-1")) == "api"


CLEAN = {
    "the prefix without a token": "egressd-secret-api-",
    "another token": placeholder("api", "f" * 32),
    "the token cut short": TOKEN[:-1],
    "empty": "",
    "a body": "hello world " * 100,
    "hex digits elsewhere": "0123456789abcdef" * 3,
}


@pytest.mark.parametrize("lead", ["%", "%2", "%%", "%25", "\\u00", "%5c", "x%"])
@pytest.mark.parametrize("name", ["percent-encoded", "percent-encoded twice"])
def test_a_percent_or_escape_before_an_encoded_spelling_does_not_hide_it(lead: str, name: str) -> None:
    """A `%` before `%2530%2531...` decodes to `%0123...`, and a further round reads `%01` as one
    byte: every round is looked at, so the token is found after the round that reveals it."""
    assert NEEDLES.find(lead + SPELLINGS[name]) == "api"
    assert NEEDLES.find((lead + SPELLINGS[name]).encode("latin-1")) == "api"


@pytest.mark.parametrize("text", CLEAN.values(), ids=CLEAN.keys())
def test_what_is_not_a_placeholder_is_not_found(text: str) -> None:
    assert NEEDLES.find(text) is None


def test_redact_keeps_the_name_drops_the_token() -> None:
    assert NEEDLES.redact(f"/q?k={PH.upper()}") == "/q?k=EGRESSD-SECRET-API-[redacted]"


def _scan(chunks: list[bytes], needles: Needles = NEEDLES) -> tuple[bytes, str | None]:
    stream, out = PlaceholderStream(needles), []
    try:
        for chunk in chunks:
            out.append(stream.feed(chunk))
        out.append(stream.end())
    except PlaceholderFound as found:
        return b"".join(out), found.name
    return b"".join(out), None


def _split(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({min(c, len(data)) for c in cuts})
    pieces, last = [], 0
    for point in points:
        pieces.append(data[last:point])
        last = point
    pieces.append(data[last:])
    return pieces


@settings(max_examples=300, deadline=None)
@example(before=b"%", after=b"", spelling=SPELLINGS["percent-encoded twice"], cuts=[])
@given(
    before=st.binary(max_size=300),
    after=st.binary(max_size=300),
    spelling=st.sampled_from(list(SPELLINGS.values())),
    cuts=st.lists(st.integers(min_value=0, max_value=1000), max_size=12),
)
def test_a_body_split_anywhere_is_refused_before_the_token_goes_out(
    before: bytes, after: bytes, spelling: str, cuts: list[int]
) -> None:
    body = before + spelling.encode("latin-1") + after
    passed, found = _scan(_split(body, cuts))
    assert found == "api"
    assert TOKEN.encode() not in passed.lower()  # nothing of it was passed on in full
    assert body.startswith(passed)


@settings(max_examples=200, deadline=None)
@given(body=st.binary(max_size=2000), cuts=st.lists(st.integers(min_value=0, max_value=2000), max_size=12))
def test_a_clean_body_passes_unchanged_whatever_its_chunks(body: bytes, cuts: list[int]) -> None:
    passed, found = _scan(_split(body, cuts))
    if found is None:
        assert passed == body
    else:  # random bytes that happen to spell the token: astronomically unlikely, but then refused
        assert NEEDLES.find(body) == found


def test_the_held_window_is_bounded() -> None:
    stream = PlaceholderStream(NEEDLES)
    for _ in range(100):
        stream.feed(b"a" * 65536)
    assert len(stream._held) <= NEEDLES.window


# -- the secrets step ----------------------------------------------------------------------------------
POLICY = {
    "version": 1,
    "allow": ["api.test", "other.test", "q.test"],
    "secrets": [
        {"name": "api", "from": {"env": "REAL_KEY"}, "hosts": ["api.test"], "env": "API_KEY"},
        {
            "name": "q",
            "from": {"command": ["pass", "show", "q"]},
            "hosts": ["q.test:443"],
            "query": "key",
            "env": "Q_KEY",
        },
    ],
}


def _book() -> SecretBook:
    policy = parse_policy(POLICY, "p.yaml")
    return SecretBook().updated(policy.secrets, {"api": "REAL-VALUE", "q": "v@l ue"})


def test_the_listed_host_gets_the_value_where_the_entry_says() -> None:
    book = _book()
    ph = book.placeholder("api")
    done = book.judge(
        canonical_host("api.test"), 443, "GET", "/v1", [("Authorization", f"Bearer {ph}"), ("X-A", "b")]
    )
    assert not isinstance(done, Refusal)
    # the response is asked for unencoded, so an echo of the value can be masked
    assert done.headers == (
        ("Authorization", "Bearer REAL-VALUE"),
        ("X-A", "b"),
        ("Accept-Encoding", "identity"),
    )
    assert done.values == ("REAL-VALUE",)
    assert done.injected == ("api",) and not done.body.tokens.get("api")
    assert done.body.tokens.get("q")  # the other secret's placeholder may not go in the body
    q = book.placeholder("q")
    done = book.judge(canonical_host("q.test"), 443, "GET", f"/s?a=1&key={q}&b=2", [])
    assert not isinstance(done, Refusal) and done.path == "/s?a=1&key=v%40l%20ue&b=2"
    # the listed host without the placeholder: no value put in, but its response is still masked
    # (the server may echo a value it got earlier), so it is still asked for unencoded
    done = book.judge(canonical_host("api.test"), 443, "GET", "/", [("Authorization", "Bearer mine")])
    assert not isinstance(done, Refusal) and done.injected == () and done.values == ("REAL-VALUE",)
    assert done.headers == (("Authorization", "Bearer mine"), ("Accept-Encoding", "identity"))
    # a host no secret goes to: nothing changes, nothing to mask
    done = book.judge(canonical_host("other.test"), 443, "GET", "/", [("Accept-Encoding", "gzip")])
    assert not isinstance(done, Refusal) and done.headers is None and done.values == ()


@pytest.mark.parametrize(
    ("host", "port", "method", "path", "headers"),
    [
        ("other.test", 443, "GET", "/", [("Authorization", "Bearer {api}")]),
        ("other.test", 443, "GET", "/?x={api}", []),
        ("other.test", 443, "GET", "/", [("X-{api}", "name, not value")]),
        ("other.test", 443, "{api}", "/", []),  # curl -X "$API_KEY"
        ("other.test", 443, "X{api_token}", "/", []),  # the token alone, in a method
        ("api.test", 443, "GET", "/?key={q}", []),  # another secret's host
        ("q.test", 8443, "GET", "/?key={q}", []),  # the listed host, another port
        ("sub.api.test", 443, "GET", "/", [("Authorization", "Bearer {api}")]),  # exact hosts only
    ],
)
def test_a_placeholder_anywhere_else_is_refused(
    host: str, port: int, method: str, path: str, headers: list
) -> None:
    book = _book()
    values = {"api": book.placeholder("api"), "q": book.placeholder("q")}
    values["api_token"] = values["api"].rsplit("-", 1)[-1]
    headers = [(n.format(**values), v.format(**values)) for n, v in headers]
    refused = book.judge(canonical_host(host), port, method.format(**values), path.format(**values), headers)
    assert isinstance(refused, Refusal) and refused.reason == "secret_exfiltration"
    assert refused.status == 403
    for text in (*values.values(), "REAL-VALUE"):
        assert text.rsplit("-", 1)[-1] not in refused.detail


def test_placeholders_are_stable_across_reloads_and_outlive_their_secret() -> None:
    book = _book()
    ph = book.placeholder("api")
    book = book.updated((), {})  # a reload that removed every secret
    assert book.placeholder("api") == ph
    refused = book.judge(canonical_host("api.test"), 443, "GET", "/", [("Authorization", f"Bearer {ph}")])
    assert isinstance(refused, Refusal) and "no longer in the policy" in refused.detail


# -- the policy entries ----------------------------------------------------------------------------------
def test_secrets_round_trip_and_force_inspection() -> None:
    policy = parse_policy(POLICY, "p.yaml")
    assert policy.needs_inspection
    assert policy.secrets[0].header == ("authorization", "Bearer {}")  # the default
    again = parse_policy(policy_to_data(policy), "p.yaml")
    assert again.secrets == policy.secrets
    # where the value comes from, as written: a policy never holds a value (the book does)
    assert policy_to_data(policy)["secrets"][0]["from"] == {"env": "REAL_KEY"}


def _with(secret: dict) -> dict:
    return {**POLICY, "secrets": [secret]}


BASE = {"name": "api", "from": {"env": "REAL_KEY"}, "hosts": ["api.test"], "env": "API_KEY"}


@pytest.mark.parametrize(
    ("secret", "fragment"),
    [
        ({**BASE, "hosts": ["nope.test"]}, "secrets[0].hosts[0]: 'nope.test': not allowed by this policy"),
        ({**BASE, "hosts": ["*.api.test"]}, "exact hosts only"),
        ({**BASE, "hosts": []}, "at least one host"),
        ({**BASE, "name": "Bad Name"}, "secrets[0].name"),
        ({**BASE, "from": {"env": "A", "file": "b"}}, "must be one of"),
        ({**BASE, "from": {"url": "x"}}, "unknown source"),
        ({**BASE, "from": {"command": []}}, "a list of arguments"),
        ({**BASE, "header": "x-api-key: no placeholder"}, "exactly one '{}'"),
        ({**BASE, "header": "Host: {}"}, "cannot be sent in the Host header"),
        ({**BASE, "header": "a: {}", "query": "k"}, "not both"),
        ({**BASE, "env": "HTTPS_PROXY"}, "proxy variables"),
        ({**BASE, "env": "EGRESSD_X"}, "egressd's own"),
        ({**BASE, "extra": 1}, "unknown key"),
    ],
)
def test_bad_entries_are_clear_errors(secret: dict, fragment: str) -> None:
    with pytest.raises(PolicyError) as caught:
        parse_policy(_with(secret), "p.yaml")
    assert fragment in str(caught.value)


def test_denied_and_duplicate_secrets_are_refused() -> None:
    with pytest.raises(PolicyError, match="denied by the policy"):
        parse_policy({**_with(BASE), "deny": ["api.test"]}, "p.yaml")
    with pytest.raises(PolicyError, match="two secrets of this name"):
        parse_policy({**POLICY, "secrets": [BASE, {**BASE, "env": "OTHER"}]}, "p.yaml")


def test_command_line_secrets() -> None:
    [spec] = secrets_from_options(["api=API_KEY"], ["api=api.test"], ["api=x-api-key: {}"])
    assert (spec.source.env, spec.env, spec.header) == ("API_KEY", "API_KEY", ("x-api-key", "{}"))
    policy = parse_policy({"version": 1, "allow": ["api.test"]}, "p.yaml")
    assert policy.with_overrides(secrets=[spec]).secrets == (spec,)
    with pytest.raises(PolicyError, match="not allowed"):
        parse_policy({"version": 1}, "p.yaml").with_overrides(secrets=[spec])
    with pytest.raises(PolicyError, match="no --secret of this name"):
        secrets_from_options([], ["api=api.test"])


# -- masking echoes of a value in a response ---------------------------------------------------------------
VALUE = "sk-REAL-0123456789"


@settings(max_examples=300, deadline=None)
@given(
    parts=st.lists(st.sampled_from([b"x", b"\n", VALUE.encode(), VALUE.encode()[:5], b"sk-"]), max_size=30),
    cuts=st.lists(st.integers(min_value=0, max_value=600), max_size=12),
)
def test_a_masked_response_keeps_its_length_and_never_holds_the_value(
    parts: list[bytes], cuts: list[int]
) -> None:
    body = b"".join(parts)
    mask = ValueMask([VALUE])
    out = b"".join([mask.feed(chunk) for chunk in _split(body, cuts)] + [mask.end()])
    assert len(out) == len(body)
    assert VALUE.encode() not in out
    assert out == body.replace(VALUE.encode(), b"*" * len(VALUE))


ODD_VALUE = "q/k+y w&z=1;~"  # every spelling egressd sends differs: `/`, `+`, space, `&`, `=`, `;`
ODD_SPELLINGS = sorted(value_spellings(ODD_VALUE))
LOWER_HEX = [re.sub(rb"%[0-9A-F]{2}", lambda m: m[0].lower(), s) for s in ODD_SPELLINGS]


def test_the_spellings_are_those_egressd_sends() -> None:
    assert {s.decode() for s in ODD_SPELLINGS} == {
        ODD_VALUE,
        urllib.parse.quote(ODD_VALUE, safe=""),  # what a `query:` secret sends
        urllib.parse.quote(ODD_VALUE),
        urllib.parse.quote_plus(ODD_VALUE, safe=""),
        urllib.parse.quote_plus(ODD_VALUE),
    }


@settings(max_examples=400, deadline=None)
@given(
    parts=st.lists(
        st.sampled_from([b"x", b"%", b"\r\n", *ODD_SPELLINGS, *LOWER_HEX, *(s[:5] for s in ODD_SPELLINGS)]),
        max_size=24,
    ),
    cuts=st.lists(st.integers(min_value=0, max_value=900), max_size=16),
)
def test_no_spelling_survives_any_split(parts: list[bytes], cuts: list[int]) -> None:
    body = b"".join(parts)
    mask = ValueMask([ODD_VALUE])
    out = b"".join([mask.feed(chunk) for chunk in _split(body, cuts)] + [mask.end()])
    assert len(out) == len(body)
    for spelling in ODD_SPELLINGS:
        assert spelling.lower() not in out.lower(), (spelling, out)
    assert all(o in (b, ord("*")) for o, b in zip(out, body, strict=True))  # only masked bytes change


def test_fields_and_texts_are_masked_but_framing_is_not() -> None:
    mask = ValueMask(["12", ODD_VALUE])
    pct = urllib.parse.quote(ODD_VALUE, safe="").encode()
    fields = [(b"Content-Length", b"12"), (b"X-" + pct, b"a " + pct.lower()), (b"Location", b"/?k=12")]
    assert mask.fields(fields) == [
        (b"Content-Length", b"12"),
        (b"X-" + b"*" * len(pct), b"a " + b"*" * len(pct)),
        (b"Location", b"/?k=**"),
    ]
    assert mask.text(f"OK {ODD_VALUE}", "latin-1") == "OK " + "*" * len(ODD_VALUE)
    assert mask.text_fields([("X-A", ODD_VALUE)], "latin-1") == [("X-A", "*" * len(ODD_VALUE))]
    assert not ValueMask([]) and ValueMask([]).text("x") == "x"
