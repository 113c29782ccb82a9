"""The spelling table of the bypass corpus: one host per row, with the outcome egressd must give.

Why a module of its own: the same rows drive the end-to-end corpus (tests/security/test_bypass_spellings.py),
the pure-function check (tests/security/test_bypass_pure.py) and the fuzzers' seed corpus (fuzz/corpus/hosts).
"""

from __future__ import annotations

from dataclasses import dataclass

ALLOWED_V4 = "198.51.100.1"
ALLOWED_V6 = "2001:db8::1"
EVIL_V4 = "198.51.100.9"  # evil.test and every look-alike name resolve here
INTERNAL_V4 = "192.0.2.1"
LOOPBACK = ("127.0.0.1", "::1")
SERVER_HOSTS = (ALLOWED_V4, ALLOWED_V6, EVIL_V4, INTERNAL_V4, *LOOPBACK)

POLICY = f"""\
version: 1
mode: enforce
allow:
  - allowed.test
  - {ALLOWED_V4}
  - "{ALLOWED_V6}"
  - bücher.test     # an IDN rule: matches in either spelling
  - faß.test        # IDNA2008 (xn--fa-hia); IDNA2003 would have mapped it to fass.test
deny:
  - denied.test
loopback:
  allow: false      # so that every loopback spelling must be refused, and the victim stays at 0
"""

DNS_NAMES = {
    "allowed.test": ALLOWED_V4,
    "sub.allowed.test": ALLOWED_V4,
    "denied.test": ALLOWED_V4,  # deny must win even though the address is allowed
    "sub.denied.test": ALLOWED_V4,
    "evil.test": EVIL_V4,
    "allowed.test.evil.test": EVIL_V4,
    "evilallowed.test": EVIL_V4,
    "allowedtest": EVIL_V4,
    "allowed-test.test": EVIL_V4,
    "xn--llowed-2nf.test": EVIL_V4,  # Cyrillic а
    "198.51.100.1.nip.io": EVIL_V4,
    "localhost.evil.test": EVIL_V4,
    "internal.test": INTERNAL_V4,
    "xn--bcher-kva.test": ALLOWED_V4,
    "xn--fa-hia.test": ALLOWED_V4,
}

ALLOW = "allow"
INVALID = "invalid"  # unparseable: 400 bad_request (mitmproxy's reader) or 403 invalid_target (egressd)


@dataclass(frozen=True)
class Case:
    host: str  # as written in a URL (IPv6 bracketed)
    expect: str  # ALLOW, INVALID or the policy reason code
    why: str
    also: str | None = None  # where front ends legitimately differ: the other accepted outcome


def c(host: str, expect: str, why: str, also: str | None = None) -> Case:
    return Case(host, expect, why, also)


LOOP = "loopback_disabled"
FORBID = "forbidden_address"
NOT = "not_allowlisted"
PRIV = "private_address"  # a non-global literal without a licence, in every mode
DENY = "denylist"

CASES: list[Case] = [
    # -- IPv4 loopback in every legacy form (inet_aton / WHATWG) ----------------------------------
    c("127.0.0.1", LOOP, "dotted decimal"),
    c("127.1", LOOP, "short form a.d"),
    c("127.0.1", LOOP, "short form a.b.d"),
    c("0x7f.1", LOOP, "hex + short"),
    c("0x7f000001", LOOP, "one hex number"),
    c("0X7F000001", LOOP, "upper-case hex prefix"),
    c("2130706433", LOOP, "one decimal number"),
    c("017700000001", LOOP, "one octal number"),
    c("0177.0.0.1", LOOP, "octal first part"),
    c("0177.0.0.01", LOOP, "octal parts"),
    c("00000177.0.0.1", LOOP, "octal with many zeros"),
    c("0x7f.0x0.0x0.0x1", LOOP, "hex parts"),
    c("0x7f.0.0.1", LOOP, "mixed hex and decimal"),
    c("127.000.000.001", LOOP, "zero-padded (octal zeros)"),
    c("127.0.0.1.", LOOP, "trailing dot"),
    c("127.255.255.254", LOOP, "anywhere in 127/8"),
    c("0x7f.0xffffff", LOOP, "hex a.bcd"),
    # -- IPv6 loopback and mapped/compatible forms --------------------------------------------------
    c("[::1]", LOOP, "IPv6 loopback"),
    c("[0:0:0:0:0:0:0:1]", LOOP, "IPv6 loopback, long form"),
    c("[0000::0001]", LOOP, "IPv6 loopback, zero padded"),
    c("[::ffff:127.0.0.1]", LOOP, "IPv4-mapped"),
    c("[::FFFF:7f00:1]", LOOP, "IPv4-mapped, hex, upper case"),
    c("[::127.0.0.1]", LOOP, "IPv4-compatible"),
    c("localhost", LOOP, "the name localhost"),
    c("LOCALHOST.", LOOP, "localhost, upper case, trailing dot"),
    c("foo.localhost", LOOP, "*.localhost"),
    c("localhost.evil.test", NOT, "localhost as a label of another name"),
    # -- cloud metadata and link-local, in every form ---------------------------------------------
    c("169.254.169.254", FORBID, "metadata"),
    c("169.254.169.254.", FORBID, "metadata, trailing dot"),
    c("0xa9fea9fe", FORBID, "metadata, one hex number"),
    c("0xA9FEA9FE", FORBID, "metadata, upper-case hex"),
    c("2852039166", FORBID, "metadata, one decimal number"),
    c("0251.0376.0251.0376", FORBID, "metadata, octal parts"),
    c("0xa9.0xfe.0xa9.0xfe", FORBID, "metadata, hex parts"),
    c("169.254.43518", FORBID, "metadata, a.b.cd"),
    c("169.16689662", FORBID, "metadata, a.bcd"),
    c("0251.0xfe.43518", FORBID, "metadata, octal+hex+decimal"),
    c("[::ffff:169.254.169.254]", FORBID, "metadata, IPv4-mapped"),
    c("[::ffff:a9fe:a9fe]", FORBID, "metadata, IPv4-mapped hex"),
    c("[::169.254.169.254]", FORBID, "metadata, IPv4-compatible"),
    c("[64:ff9b::169.254.169.254]", FORBID, "metadata, NAT64"),
    c("[64:ff9b::a9fe:a9fe]", FORBID, "metadata, NAT64 hex"),
    c("[64:ff9b:1::a9fe:a9fe]", FORBID, "metadata, local-use NAT64"),
    c("[2002:a9fe:a9fe::1]", FORBID, "metadata, 6to4"),
    c("[2001:0:4136:e378:8000:63bf:5601:5601]", FORBID, "metadata, Teredo client"),
    c("[fd00:ec2::254]", FORBID, "AWS IPv6 metadata"),
    c("100.100.100.200", FORBID, "Alibaba metadata"),
    c("168.63.129.16", FORBID, "Azure wire server"),
    c("[fe80::1]", FORBID, "IPv6 link-local"),
    c("169.254.0.1", FORBID, "IPv4 link-local"),
    # -- unspecified, broadcast, multicast, reserved -----------------------------------------------
    c("0.0.0.0", FORBID, "unspecified (reaches loopback on Linux)"),
    c("0", FORBID, "unspecified, one number"),
    c("0x0", FORBID, "unspecified, hex"),
    c("0.0", FORBID, "unspecified, short"),
    c("[::]", FORBID, "IPv6 unspecified"),
    c("[0:0:0:0:0:0:0:0]", FORBID, "IPv6 unspecified, long form"),
    c("[::ffff:0.0.0.0]", FORBID, "unspecified, IPv4-mapped"),
    c("255.255.255.255", FORBID, "broadcast"),
    c("4294967295", FORBID, "broadcast, one number"),
    c("224.0.0.1", FORBID, "multicast"),
    c("[ff02::1]", FORBID, "IPv6 multicast"),
    c("240.0.0.1", FORBID, "reserved 240/4"),
    # -- the allowed host, written differently (must reach the allowed server only) ----------------
    c("allowed.test", ALLOW, "as written in the policy"),
    c("ALLOWED.TEST", ALLOW, "upper case"),
    c("AllOwEd.TeSt", ALLOW, "mixed case"),
    c("allowed.test.", ALLOW, "trailing dot"),
    c("sub.allowed.test", ALLOW, "subdomain of a name rule"),
    c(ALLOWED_V4, ALLOW, "the allowed address"),
    c("0xc6.0x33.0x64.1", ALLOW, "allowed address, hex parts"),
    c("3325256705", ALLOW, "allowed address, one number"),
    c("0306.063.0144.01", ALLOW, "allowed address, octal parts"),
    c("198.51.25601", ALLOW, "allowed address, a.b.cd"),
    c("[::ffff:198.51.100.1]", ALLOW, "allowed address, IPv4-mapped"),
    c("[::ffff:c633:6401]", ALLOW, "allowed address, IPv4-mapped hex"),
    c(f"[{ALLOWED_V6}]", ALLOW, "allowed IPv6 address"),
    c("[2001:DB8:0:0:0:0:0:0001]", ALLOW, "allowed IPv6 address, long upper-case form"),
    c("xn--bcher-kva.test", ALLOW, "IDN rule, A-label request"),
    c("XN--BCHER-KVA.TEST.", ALLOW, "IDN rule, A-label upper case, trailing dot"),
    # -- raw UTF-8 hosts: the HTTP and SOCKS readers refuse them; were one to accept, UTS46 maps
    #    each to the name on the right, so the outcome may be that name's and nothing else
    c("bücher.test", INVALID, "U-label of the IDN rule", also=ALLOW),
    c("ａｌｌｏｗｅｄ．ｔｅｓｔ", INVALID, "fullwidth letters and dot", also=ALLOW),
    c("allowed。test", INVALID, "ideographic full stop", also=ALLOW),
    c("allowed.test\u200b", INVALID, "zero-width space", also=ALLOW),
    c("аllowed.test", INVALID, "confusable: Cyrillic а (U-label)", also=NOT),
    c("☃.test", INVALID, "IDNA-disallowed code point"),
    c("allowed\u2024test", INVALID, "one-dot leader is not a dot"),
    # -- look-alikes of the allowed host ----------------------------------------------------------
    c("allowed.test.evil.test", NOT, "allowed name as a prefix of another"),
    c("evilallowed.test", NOT, "allowed name as a suffix without a dot"),
    c("allowed-test.test", NOT, "dash for dot"),
    c("allowedtest", NOT, "dot dropped"),
    c("evil.test", NOT, "another name"),
    c("xn--llowed-2nf.test", NOT, "confusable: Cyrillic а (A-label)"),
    c("198.51.100.1.nip.io", NOT, "an address as labels of a name"),
    c(EVIL_V4, PRIV, "an address outside the IP rule"),
    c("0xc6.0x33.0x64.9", PRIV, "that address in hex"),
    c("[::ffff:198.51.100.9]", PRIV, "that address IPv4-mapped"),
    c("[64:ff9b::198.51.100.1]", PRIV, "NAT64 of the allowed address is another address"),
    c("[2002:c633:6401::1]", PRIV, "6to4 of the allowed address is another address"),
    c(INTERNAL_V4, PRIV, "a private address without a rule"),
    # -- deny wins, in every spelling ----------------------------------------------------------------
    c("denied.test", DENY, "deny rule"),
    c("DENIED.TEST.", DENY, "deny rule, upper case, trailing dot"),
    c("sub.denied.test", DENY, "subdomain of a deny rule"),
    # -- unparseable: refused, never guessed -------------------------------------------------------
    c("allowed%2etest", INVALID, "percent-encoded dot"),
    c("%61llowed.test", INVALID, "percent-encoded letter"),
    c("allowed.test%00", INVALID, "percent-encoded NUL"),
    c("[::1%25lo]", INVALID, "IPv6 zone ID (encoded)"),
    c("[fe80::1%25eth0]", INVALID, "link-local with zone ID"),
    c("[fe80::1%eth0]", INVALID, "zone ID, raw %"),
    c("allowed.test..", INVALID, "two trailing dots"),
    c(".allowed.test", INVALID, "leading dot"),
    c("allowed..test", INVALID, "empty label"),
    c("-allowed.test", INVALID, "label starting with a dash"),
    c("a" * 64 + ".allowed.test", INVALID, "over-long label (64)"),
    c(".".join(["a" * 63] * 4) + ".allowed.test", INVALID, "over-long name (>253)"),
    c("xn--zz.allowed.test", INVALID, "invalid punycode"),
    c("xn--.allowed.test", INVALID, "empty punycode"),
    c("256.0.0.1", INVALID, "IPv4 part out of range"),
    c("1.2.3.256", INVALID, "last part out of range"),
    c("0x100.0.0.1", INVALID, "hex part out of range"),
    c("4294967296", INVALID, "one number out of range"),
    c("1.2.3.4.5", INVALID, "five parts"),
    c("08.0.0.1", INVALID, "bad octal"),
    c("127.0.0.1x", NOT, "a name: its last label is not a number"),
    c("allowed.test.1", INVALID, "ends in a number: an IPv4 attempt"),
    # mitmproxy's CONNECT reader unwraps brackets, egressd's does not: both readings refuse loopback
    c("[127.0.0.1]", INVALID, "IPv4 in brackets", also=LOOP),
    # ... and both readings of a bracketed name name the same allowed host: never another one
    c("[allowed.test]", INVALID, "a name in brackets", also=ALLOW),
    c("allowed.test@evil.test", INVALID, "userinfo: names evil.test"),
    c("evil.test@allowed.test", INVALID, "userinfo: names allowed.test"),
    c("allowed.test\\@evil.test", INVALID, "backslash userinfo confusion"),
    c("evil.test#@allowed.test", INVALID, "fragment userinfo confusion"),
    c("evil.test?@allowed.test", INVALID, "query userinfo confusion"),
    c("allowed.test evil.test", INVALID, "space in the host"),
]
