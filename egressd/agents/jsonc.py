"""JSON with comments (JSONC: VS Code's `mcp.json`, and any client config a person annotated),
read with the position of every value, so a change is a splice of the original text and every
comment, space, escape and byte not changed stays as it was.

How: the comments (`// ...`, `/* ... */`), the trailing commas and a leading byte-order mark are
blanked out — replaced by spaces, newlines kept, so every offset stays — by a scanner that knows
where strings are (a `//` in a URL or a `/*` in a string is text). What remains is strict JSON:
Python's own JSON scanner reads each string and scalar, and a small recursive reader records where
every value starts and ends. Duplicate keys are reported, never silently resolved.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from json.decoder import scanstring
from typing import Any

WHITESPACE = " \t\n\r"
MAX_DEPTH = 200  # a config nests a few levels; a deeper one is not a config


class JsoncError(ValueError):
    """The text is not JSON with comments; the message says where."""


@dataclass
class Node:
    """A value and where it is in the text: `start` to `end` (exclusive)."""

    start: int
    end: int
    value: Any
    members: dict[str, tuple[int, Node]] = field(default_factory=dict)  # an object's: key start, value
    items: list[Node] = field(default_factory=list)  # an array's


def blank(text: str) -> str:
    """`text` with comments, trailing commas and a leading BOM turned into spaces (newlines kept):
    strict JSON at the same offsets. JsoncError for a comment that never ends."""
    out = list(text)
    i, n = 0, len(text)
    last = before = -1  # the last two significant characters outside strings and comments
    if text.startswith("\ufeff"):
        out[0] = " "
        i = 1
    while i < n:
        c = text[i]
        if c == '"':
            i = _string_end(text, i)
            last, before = i - 1, last
            continue
        if c == "/" and text.startswith("//", i):
            end = text.find("\n", i)
            end = n if end < 0 else end
            out[i:end] = " " * (end - i)
            i = end
            continue
        if c == "/" and text.startswith("/*", i):
            end = text.find("*/", i + 2)
            if end < 0:
                raise JsoncError(f"a /* comment at {_where(text, i)} never ends")
            out[i : end + 2] = [ch if ch in "\r\n" else " " for ch in text[i : end + 2]]
            i = end + 2
            continue
        if c in "]}" and last >= 0 and out[last] == "," and before >= 0 and out[before] not in "[{,":
            out[last] = " "  # a trailing comma (after a value: `[,]` and `[1,,]` stay errors)
        if c not in WHITESPACE:
            last, before = i, last
        i += 1
    return "".join(out)


def _string_end(text: str, start: int) -> int:
    """The index after the string that opens at `start` (its escapes skipped); the text's end
    when it never closes (the strict reader then says so)."""
    i, n = start + 1, len(text)
    while i < n:
        c = text[i]
        if c == "\\":
            i += 2
        elif c == '"':
            return i + 1
        elif c == "\n":
            return i  # strings hold no raw newline: the strict reader reports it here
        else:
            i += 1
    return n


def parse(text: str) -> Node:
    """The top-level value of `text` with every position; JsoncError when it is not JSONC."""
    strict = blank(text)
    reader = _Reader(strict, text)
    node = reader.value(reader.skip(0), 0)
    rest = reader.skip(node.end)
    if rest != len(strict):
        raise JsoncError(f"unexpected text after the value at {_where(text, rest)}")
    return node


def _where(text: str, index: int) -> str:
    line = text.count("\n", 0, index) + 1
    column = index - (text.rfind("\n", 0, index) + 1) + 1
    return f"line {line} column {column}"


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


_SCALARS = json.JSONDecoder(parse_constant=_no_constant)


class _Reader:
    def __init__(self, strict: str, original: str) -> None:
        self.text = strict
        self.original = original

    def fail(self, index: int, what: str) -> JsoncError:
        return JsoncError(f"{what} at {_where(self.original, index)}")

    def skip(self, i: int) -> int:
        n = len(self.text)
        while i < n and self.text[i] in WHITESPACE:
            i += 1
        return i

    def value(self, i: int, depth: int) -> Node:
        if depth > MAX_DEPTH:
            raise self.fail(i, f"nested deeper than {MAX_DEPTH}")
        if i >= len(self.text):
            raise self.fail(i, "expected a value, found the end")
        c = self.text[i]
        if c == "{":
            return self.object(i, depth)
        if c == "[":
            return self.array(i, depth)
        if c == '"':
            text, end = self.string(i)
            return Node(i, end, text)
        try:
            value, end = _SCALARS.raw_decode(self.text, i)
        except ValueError as exc:
            raise self.fail(i, "expected a value") from exc
        if isinstance(value, dict | list | str):  # raw_decode read past what this reader checks
            raise self.fail(i, "expected a value")
        return Node(i, end, value)

    def string(self, i: int) -> tuple[str, int]:
        try:
            return scanstring(self.text, i + 1, True)
        except ValueError as exc:
            raise self.fail(i, f"a bad string ({exc.args[0].split(':')[0]})") from exc

    def object(self, start: int, depth: int) -> Node:
        node = Node(start, start, {})
        i = self.skip(start + 1)
        if self.text.startswith("}", i):
            node.end = i + 1
            return node
        while True:
            if not self.text.startswith('"', i):
                raise self.fail(i, "expected a key in double quotes")
            key_start = i
            key, i = self.string(i)
            if key in node.members:
                raise self.fail(key_start, f"duplicate key {key!r}")
            i = self.skip(i)
            if not self.text.startswith(":", i):
                raise self.fail(i, "expected ':'")
            child = self.value(self.skip(i + 1), depth + 1)
            node.members[key] = (key_start, child)
            node.value[key] = child.value
            i, closed = self.after(child.end, "}")
            if closed:
                node.end = i
                return node

    def array(self, start: int, depth: int) -> Node:
        node = Node(start, start, [])
        i = self.skip(start + 1)
        if self.text.startswith("]", i):
            node.end = i + 1
            return node
        while True:
            child = self.value(i, depth + 1)
            node.items.append(child)
            node.value.append(child.value)
            i, closed = self.after(child.end, "]")
            if closed:
                node.end = i
                return node

    def after(self, i: int, close: str) -> tuple[int, bool]:
        """Past the comma after a member or item (False), or past the closing bracket (True)."""
        i = self.skip(i)
        if self.text.startswith(",", i):
            return self.skip(i + 1), False
        if self.text.startswith(close, i):
            return i + 1, True
        raise self.fail(i, f"expected ',' or '{close}'")


def splice(text: str, edits: list[tuple[int, int, str]]) -> str:
    """`text` with each (start, end, replacement) applied; the edits must not overlap."""
    out, at = [], 0
    for start, end, replacement in sorted(edits):
        if start < at:
            raise ValueError("overlapping edits")
        out += [text[at:start], replacement]
        at = end
    return "".join([*out, text[at:]])
