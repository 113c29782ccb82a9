"""The raw bytes of an HTTP/1 request head, checked before anyone parses them.

Parsers disagree on the bytes this refuses (bare LF or CR, obs-fold, NUL and other control
characters, oversized heads): a proxy that reads a head one way while the upstream reads it another
way forwards a request nobody decided (request smuggling). egressd refuses such heads with 400/431
instead of normalising them. No I/O, no mitmproxy import.
"""

from __future__ import annotations

import re

MAX_HEAD = 64 * 1024
# C0 controls and DEL, except HTAB; CR and LF are checked as line structure below
_CTL = re.compile(rb"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f]")
_BARE_LF = re.compile(rb"(?<!\r)\n")
_BARE_CR = re.compile(rb"\r(?!\n)")
# A complete head with nothing any check refuses, in one pass: lines of no control byte (HTAB
# allowed) each ending in CRLF, no line after the first starting with SP or HTAB (obs-fold), up to
# the first empty line. No byte is matched two ways, so the match is linear.
_CLEAN_HEAD = re.compile(
    rb"[^\x00-\x08\x0a-\x1f\x7f]*\r\n(?:[^\x00-\x20\x7f][^\x00-\x08\x0a-\x1f\x7f]*\r\n)*\r\n"
)


def head_problem(data: bytes) -> tuple[int, str] | None:
    """(status, why) when the head at the start of data must be refused; None when it is fine
    or not complete yet (and not too long)."""
    start = leading_empty_lines(data)
    clean = _CLEAN_HEAD.match(data, start)
    if clean is not None and clean.end() - start <= MAX_HEAD:
        return None  # what nearly every client sends: one regex pass instead of the checks below
    return checked_head_problem(data, start)


def checked_head_problem(data: bytes, start: int) -> tuple[int, str] | None:
    """head_problem by the checks one at a time (data[start:] after the empty lines): what the
    one-pass match leaves, and what it is tested against."""
    lf_end = data.find(b"\n\n", start)
    crlf_end = data.find(b"\r\n\r\n", start)
    ends = [e + 2 for e in (lf_end,) if e >= 0] + [e + 4 for e in (crlf_end,) if e >= 0]
    if not ends:
        if len(data) - start > MAX_HEAD:
            return 431, f"request head longer than {MAX_HEAD} bytes"
        # what is there already may be refused without waiting for the rest
        return named_problem(data[start:], complete=False)
    end = min(ends)
    if end - start > MAX_HEAD:
        return 431, f"request head longer than {MAX_HEAD} bytes"
    return named_problem(data[start:end], complete=True)


def leading_empty_lines(data: bytes | bytearray) -> int:
    """How many bytes of empty lines (CRLF) come before the request line: RFC 9112 2.2 says to
    ignore them, and every path skips them the same way."""
    start = 0
    while data.startswith(b"\r\n", start):
        start += 2
    return start


_METHOD = re.compile(rb"[!#$%&'*+.^_`|~0-9A-Za-z-]{1,1024}")  # a method token (RFC 9110), bounded


def starts_like_request(data: bytes) -> bool | None:
    """Whether a client's first bytes start an HTTP/1 request line — a method token, then a space —
    after at most a few empty lines (RFC 9112 2.2); None while they do not tell yet. What the
    inspected tunnel decides per request, whatever its method (a digit first, a placeholder)."""
    start = leading_empty_lines(data)
    if start > 64:
        return False
    space = data.find(b" ", start)
    if space < 0:
        rest = data[start:]
        return None if rest == b"" or _METHOD.fullmatch(rest) else False
    return _METHOD.fullmatch(data, start, space) is not None


def named_problem(head: bytes, *, complete: bool) -> tuple[int, str] | None:
    """What is wrong with a head (or the start of one), by name; None when nothing is."""
    if _BARE_LF.search(head):
        return 400, "bare LF line ending in the request head"
    body = head if complete else head[: head.rfind(b"\r\n") + 2] if b"\r\n" in head else b""
    if _BARE_CR.search(body):
        return 400, "bare CR in the request head"
    if _CTL.search(head):
        return 400, "control character in the request head"
    lines = body.split(b"\r\n")
    for line in lines[1:]:
        if line[:1] in (b" ", b"\t"):
            return 400, "obsolete line folding (obs-fold) in the request head"
    return None


_ENDS = (b"\r\n\r\n", b"\n\n", b"\n\r\n")  # where a head may end (all but the first are refused)


class HeadScanner:
    """head_problem, incrementally: fed the growing buffer of one head, it looks at each new byte a
    bounded number of times (a head sent one byte per read must not cost its length squared), and
    runs the full check once, on the complete head.

    A fresh scanner's state is its class's: made per head, it runs no __init__ (a Python function
    the class's call would enter from C)."""

    start = 0  # where the head's first line begins, after empty lines (RFC 9112 2.2)
    searched = 0  # bytes before this were looked at already

    def scan(self, data: bytes | bytearray) -> tuple[int, str] | tuple[int, int] | None:
        """(status, why) to refuse; (0, end) when data[start:end] is a complete, clean head (end
        after its empty line); None while more bytes are needed."""
        while data.startswith(b"\r\n", self.start):
            self.start += 2
        if self.start > MAX_HEAD:
            return 400, "too many empty lines before the request line"
        if self.searched == 0:
            # the first bytes read (most often a whole head): head_problem's one pass, done once
            clean = _CLEAN_HEAD.match(data, self.start)
            if clean is not None and clean.end() - self.start <= MAX_HEAD:
                return 0, clean.end()
        return self.scan_on(data)

    def scan_on(self, data: bytes | bytearray) -> tuple[int, str] | tuple[int, int] | None:
        """scan, after the empty lines, by the new bytes only (what scan's one pass leaves, and
        what it is tested against)."""
        since = max(self.start, self.searched - 3)
        ends = [i + len(end) for end in _ENDS if (i := data.find(end, since)) >= 0]
        if ends:
            end = min(ends)
            return head_problem(bytes(data[self.start : end])) or (0, end)
        new = bytes(data[max(self.start, self.searched - 1) :])  # a byte of context for CR LF
        self.searched = len(data)
        if len(data) - self.start > MAX_HEAD:
            return 431, f"request head longer than {MAX_HEAD} bytes"
        if _BARE_LF.search(new, 1 if self.searched - len(new) > self.start else 0):
            return 400, "bare LF line ending in the request head"
        if _CTL.search(new):
            return 400, "control character in the request head"
        return None
