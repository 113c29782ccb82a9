"""Host canonicalisation and target parsing: one spelling per host, ambiguity refused."""

from __future__ import annotations

import ipaddress

import pytest

from egressd.policy import (
    Host,
    Target,
    TargetError,
    canonical_host,
    join_host_port,
    make_target,
    parse_target,
)

V4 = ipaddress.IPv4Address
V6 = ipaddress.IPv6Address


def test_host_text_is_worked_out_once_from_its_fields() -> None:
    """Host.text is the canonical spelling, made when the Host is (every step reads it); it is no
    field of equality or repr, and a Host changed behind the frozen dataclass's back is spelled from
    its fields again wherever a target is made of it."""
    import copy
    import pickle

    host = canonical_host("127.1")
    assert host.text == "127.0.0.1" and Host("example.com").text == "example.com"
    assert Host(None, V6("2001:db8::1")).text == "2001:db8::1" and Host(None).text == ""
    assert host == Host(None, V4("127.0.0.1")) and hash(host) == hash(Host(None, V4("127.0.0.1")))
    assert repr(host) == "Host(name=None, ip=IPv4Address('127.0.0.1'))"
    assert copy.deepcopy(host).text == "127.0.0.1" and pickle.loads(pickle.dumps(host)).text == "127.0.0.1"
    object.__setattr__(host, "ip", V6("::1"))  # swapped behind the frozen dataclass's back
    assert make_target(host, 443).host.text == "::1"
    assert make_target(Target(host, 443).host, 443).host == Host(None, V6("::1"))


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ("127.0.0.1", "127.0.0.1"),
        ("127.0.0.1.", "127.0.0.1"),  # one trailing dot on an IP
        ("2130706433", "127.0.0.1"),  # decimal
        ("0x7f000001", "127.0.0.1"),  # hex
        ("0X7F000001", "127.0.0.1"),
        ("0177.0.0.1", "127.0.0.1"),  # octal
        ("0177.0.0.01", "127.0.0.1"),
        ("127.1", "127.0.0.1"),  # short
        ("127.0.1", "127.0.0.1"),
        ("0x7f.1", "127.0.0.1"),  # mixed
        ("0x7f.0.0.0x1", "127.0.0.1"),
        ("0x7f.0x0.0x0.0x1", "127.0.0.1"),
        ("0", "0.0.0.0"),
        ("0x", "0.0.0.0"),
        ("4294967295", "255.255.255.255"),
        ("169.254.43518", "169.254.169.254"),
        ("0251.0376.0251.0376", "169.254.169.254"),
        ("0xa9fea9fe", "169.254.169.254"),
        ("2852039166", "169.254.169.254"),
        ("１２７.0.0.1", "127.0.0.1"),  # full-width digits map to ASCII first
        ("10.0.0.010", "10.0.0.8"),
        # around the dotted-quad shortcut: a leading zero still means octal
        ("010.1.1.1", "8.1.1.1"),
        ("1.2.3.04", "1.2.3.4"),
        ("1.2.3.00", "1.2.3.0"),
        ("0.0.0.0", "0.0.0.0"),
        ("255.255.255.255", "255.255.255.255"),
        ("199.249.250.251", "199.249.250.251"),
        ("1.2.3.4.", "1.2.3.4"),
    ],
)
def test_ipv4_legacy_spellings(raw: str, expected: str) -> None:
    host = canonical_host(raw)
    assert host == Host(name=None, ip=V4(expected))
    assert host.is_ip and host.text == expected


@pytest.mark.parametrize(
    "raw",
    [
        "256.0.0.1",
        "1.2.3.4.5",
        "4294967296",
        "0x100000000",
        "08.0.0.1",  # 8 is not octal
        "09",
        "1.2.3.256",
        "1.2.65536",
        "1.16777216",
        "127.0.0.1..",
        "127..0.1",
        "example.123",  # ends in a number: an IPv4 attempt, not a name
        "a.b.0x10",
        "0xfffffffff",
        "-1.2.3.4",
        "1" * 5000,  # never reaches int() with thousands of digits
        "0x" + "f" * 300,
    ],
)
def test_ipv4_invalid_is_error_not_name(raw: str) -> None:
    with pytest.raises(TargetError):
        canonical_host(raw)


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ("2001:db8::1", V6("2001:db8::1")),
        ("2001:0DB8:0000:0000:0000:0000:0000:0001", V6("2001:db8::1")),
        ("[2001:DB8::1]", V6("2001:db8::1")),
        ("[::1]", V6("::1")),
        ("::1", V6("::1")),
        ("[::]", V6("::")),
        ("[::ffff:127.0.0.1]", V4("127.0.0.1")),  # mapped
        ("::ffff:7f00:1", V4("127.0.0.1")),
        ("[::ffff:169.254.169.254]", V4("169.254.169.254")),
        ("[::127.0.0.1]", V4("127.0.0.1")),  # compatible
        ("::a9fe:a9fe", V4("169.254.169.254")),
        ("::2", V4("0.0.0.2")),
        ("[64:ff9b::a9fe:a9fe]", V6("64:ff9b::a9fe:a9fe")),  # NAT64 stays IPv6
    ],
)
def test_ipv6_forms(raw: str, expected: ipaddress.IPv4Address | ipaddress.IPv6Address) -> None:
    assert canonical_host(raw).ip == expected


def test_ipv6_text_and_url_host() -> None:
    host = canonical_host("[2001:DB8::1]")
    assert host.text == "2001:db8::1"
    assert host.url_host() == "[2001:db8::1]"
    assert canonical_host("127.1").url_host() == "127.0.0.1"
    assert canonical_host("Example.COM").url_host() == "example.com"


@pytest.mark.parametrize(
    "raw",
    [
        "[fe80::1%eth0]",
        "fe80::1%25eth0",
        "[fe80::1%25eth0]",
        "[::1",
        "::1]",
        "[]",
        "[127.0.0.1]",  # brackets only for IPv6
        "[::1]x",
        "2001:db8:::1",
        "::1.",
        "1:2:3:4:5:6:7:8:9",
    ],
)
def test_ipv6_rejected(raw: str) -> None:
    with pytest.raises(TargetError):
        canonical_host(raw)


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ("example.com", "example.com"),
        ("EXAMPLE.Com", "example.com"),
        ("example.com.", "example.com"),
        ("bücher.example", "xn--bcher-kva.example"),
        ("BÜCHER.example", "xn--bcher-kva.example"),
        ("xn--bcher-kva.example", "xn--bcher-kva.example"),
        ("XN--BCHER-KVA.example", "xn--bcher-kva.example"),
        ("straße.test", "xn--strae-oqa.test"),  # non-transitional: ß is kept
        ("bücher．example", "xn--bcher-kva.example"),  # full-width dot is a separator
        ("bücher。example", "xn--bcher-kva.example"),
        ("_dmarc.example.com", "_dmarc.example.com"),  # underscores exist in real DNS
        ("r4---sn-4g5e6nz7.googlevideo.com", "r4---sn-4g5e6nz7.googlevideo.com"),
        ("localhost", "localhost"),
        ("a" * 63 + ".test", "a" * 63 + ".test"),
        ("123.example", "123.example"),  # numeric label but not the last one
        ("0x10.example", "0x10.example"),
        ("deadbeef", "deadbeef"),
        # around the plain-name shortcut
        ("A-B_C.Example.", "a-b_c.example"),
        ("axn--b.test", "axn--b.test"),  # xn-- inside a label: the general code, same answer
        ("1-2.3-4", "1-2.3-4"),
    ],
)
def test_names(raw: str, expected: str) -> None:
    host = canonical_host(raw)
    assert host == Host(name=expected, ip=None)
    assert not host.is_ip and host.text == expected


@pytest.mark.parametrize(
    "raw",
    [
        "",
        ".",
        "example.com..",  # only ONE trailing dot is stripped
        "a..b",
        ".example.com",
        "-a.test",
        "a-.test",
        "xn--zz",
        "xn--zz.test",
        "xn--a.test",
        "a" * 64 + ".test",  # label > 63
        ".".join(["a" * 63] * 4) + ".com",  # name > 253
        "exa mple.com",
        " example.com",
        "example.com\n",
        "exa\tmple.com",
        "exa\x00mple.com",
        "exa\x7fmple.com",
        "user@example.com",
        "example.com/path",
        "example.com\\path",
        "exa%6dple.com",  # percent-encoded hosts are rejected, not decoded
        "%65xample.com",
        "a_ü.test",  # no underscore in a u-label
        "ab--cd-ü.test",  # invalid IDNA (hyphens in 3rd/4th position)
        "*.example.com",
        "exa*mple.com",
        "example.com:80",  # ports belong to targets, not hosts
        "a／b.test",  # full-width solidus maps to '/'
        "exa\u3000mple.com",  # ideographic space
        "\u0661\u0662\u0663.test" + "a",  # mixed-direction junk
    ],
)
def test_names_rejected(raw: str) -> None:
    with pytest.raises(TargetError):
        canonical_host(raw)


def test_suffix_name_is_not_the_name() -> None:
    assert canonical_host("allowed.test.evil.test").name == "allowed.test.evil.test"
    assert canonical_host("allowed.test.evil.test") != canonical_host("allowed.test")


def test_max_lengths_accepted() -> None:
    name = ".".join(["a" * 63] * 3 + ["b" * 61])
    assert len(name) == 253
    assert canonical_host(name).name == name
    assert canonical_host(name + ".").name == name


def test_non_string_rejected() -> None:
    with pytest.raises(TargetError):
        canonical_host(None)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("text", "host", "port", "scheme", "path"),
    [
        ("http://example.com/", "example.com", 80, "http", "/"),
        ("http://example.com", "example.com", 80, "http", "/"),
        ("https://Example.COM./a/b?q=1#frag", "example.com", 443, "https", "/a/b?q=1"),
        ("HTTPS://example.com:8443/x", "example.com", 8443, "https", "/x"),
        ("ws://example.com/sock", "example.com", 80, "http", "/sock"),
        ("wss://example.com/sock", "example.com", 443, "https", "/sock"),
        ("http://[2001:db8::1]:8080/", "2001:db8::1", 8080, "http", "/"),
        ("http://[::ffff:127.0.0.1]/", "127.0.0.1", 80, "http", "/"),
        ("http://127.1/", "127.0.0.1", 80, "http", "/"),
        ("http://example.com?x", "example.com", 80, "http", "/?x"),
    ],
)
def test_parse_target_urls(text: str, host: str, port: int, scheme: str, path: str) -> None:
    target = parse_target(text)
    assert (target.host.text, target.port, target.scheme, target.path) == (host, port, scheme, path)


@pytest.mark.parametrize(
    ("text", "default", "host", "port"),
    [
        ("example.com:443", None, "example.com", 443),
        ("example.com", 443, "example.com", 443),
        ("[2001:db8::1]:443", None, "2001:db8::1", 443),
        ("[2001:db8::1]", 80, "2001:db8::1", 80),
        ("2001:db8::1", 22, "2001:db8::1", 22),
        ("127.1:8080", None, "127.0.0.1", 8080),
        ("bücher.example:1", None, "xn--bcher-kva.example", 1),
        ("example.com:65535", None, "example.com", 65535),
    ],
)
def test_parse_target_host_port(text: str, default: int | None, host: str, port: int) -> None:
    target = parse_target(text, default_port=default)
    assert (target.host.text, target.port, target.scheme, target.path) == (host, port, None, None)


@pytest.mark.parametrize(
    "text",
    [
        "",
        "example.com",  # no port and no default
        "example.com:0",
        "example.com:65536",
        "example.com:-1",
        "example.com:http",
        "example.com:",
        "[2001:db8::1]:",
        "[2001:db8::1]x",
        "http://allowed.test@evil.test/",  # userinfo: never read as allowed.test
        "http://user:pass@example.com/",
        "http://allowed.test:80@evil.test/",
        "http://evil.test\\@allowed.test/",
        "http://evil.test\\allowed.test/",
        "ftp://example.com/",
        "file:///etc/passwd",
        "http:///path",
        "http://",
        "http://exa mple.com/",
        " example.com:443",
        "http://example.com:99999/",
        "http://[fe80::1%25eth0]/",
        "http://exa%6dple.com/",
        "user@example.com:443",
        "example.com/x:443",
    ],
)
def test_parse_target_rejected(text: str) -> None:
    with pytest.raises(TargetError):
        parse_target(text, default_port=None)


def test_make_target() -> None:
    target = make_target("EXAMPLE.com.", 443, scheme="CONNECT", method="connect")
    assert target == Target(Host("example.com"), 443, "connect", None, "connect")  # as written
    assert target.authority() == "example.com:443"
    assert make_target("[::1]", 80).authority() == "[::1]:80"
    assert make_target(canonical_host("127.1"), 80).host.text == "127.0.0.1"


@pytest.mark.parametrize(
    ("port", "scheme", "method"),
    [
        (0, None, None),
        (65536, None, None),
        (True, None, None),
        ("80", None, None),
        (80, "gopher", None),
        (80, None, "GE T"),
    ],
)
def test_make_target_rejects(port: object, scheme: str | None, method: str | None) -> None:
    with pytest.raises(TargetError):
        make_target("example.com", port, scheme=scheme, method=method)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("host", "port", "text"),
    [
        ("example.com", 443, "example.com:443"),
        ("127.0.0.1", 8080, "127.0.0.1:8080"),
        ("::1", 80, "[::1]:80"),
        ("2001:db8::1", 1, "[2001:db8::1]:1"),
        ("::ffff:192.0.2.1", 443, "[::ffff:192.0.2.1]:443"),
    ],
)
def test_join_host_port_brackets_ipv6_only(host: str, port: int, text: str) -> None:
    assert join_host_port(host, port) == text
