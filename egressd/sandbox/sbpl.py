"""SBPL text: string literals no path can break out of, and a small reader to check profiles with.

A Seatbelt profile is Scheme (Apple's TinyScheme). A path goes into it as a string literal, so a
path with a quote, backslash or parenthesis must stay one literal, or the child's own directory
name would become rules. Quotes and backslashes are escaped (`\\"`, `\\\\`: the same in every
Scheme reader); control characters and undecodable bytes are refused rather than escaped, because
how Apple's reader treats them has not been checked on a Mac. The reader below reads what
`quote()` writes and is what the tests and `seatbelt.network_rules()` check profiles with.
"""

from __future__ import annotations

from dataclasses import dataclass

from egressd.sandbox.mounts import MountError


class UnquotablePath(MountError):
    """A path that cannot be put in a Seatbelt profile safely (control characters, bad bytes)."""


@dataclass(frozen=True)
class String:
    """A string literal: `"..."`, or `#"..."` (a regex) when `regex`."""

    text: str
    regex: bool = False


Form = str | String | list["Form"]  # a symbol, a literal or a list


def _refused(text: str) -> str | None:
    for char in text:
        if ord(char) < 0x20 or ord(char) == 0x7F:
            return f"the control character {char!r}"
        if 0xD800 <= ord(char) <= 0xDFFF:
            return "bytes that are not UTF-8"
    return None


def quote(text: str) -> str:
    """`text` as one double-quoted SBPL string literal; UnquotablePath when that is not safe."""
    why = _refused(text)
    if why:
        raise UnquotablePath(f"{text!r}: a path with {why} cannot be written into a Seatbelt profile")
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def render(form: Form) -> str:
    """The text of one form, literals quoted as quote() does."""
    if isinstance(form, String):
        return ("#" if form.regex else "") + quote(form.text)
    if isinstance(form, list):
        return "(" + " ".join(render(item) for item in form) + ")"
    return form


def _string(text: str, start: int) -> tuple[str, int]:
    """The literal opening at text[start] (a quote) and where it ends; `\\c` stands for c."""
    out = []
    i = start + 1
    while i < len(text):
        char = text[i]
        if char == '"':
            return "".join(out), i + 1
        if char == "\\":
            i += 1
            if i == len(text):
                break
            char = text[i]
        out.append(char)
        i += 1
    raise ValueError(f"unterminated string literal at {start}")


def read(text: str) -> list[Form]:
    """The top-level forms of a profile (comments dropped); ValueError when it does not parse."""
    stack: list[list[Form]] = [[]]
    i = 0
    while i < len(text):
        char = text[i]
        if char.isspace():
            i += 1
        elif char == ";":
            end = text.find("\n", i)
            i = len(text) if end < 0 else end
        elif char == "(":
            stack.append([])
            i += 1
        elif char == ")":
            if len(stack) == 1:
                raise ValueError(f"unbalanced ')' at {i}")
            done = stack.pop()
            stack[-1].append(done)
            i += 1
        elif char == '"' or text.startswith('#"', i):
            regex = char == "#"
            value, i = _string(text, i + 1 if regex else i)
            stack[-1].append(String(value, regex))
        else:
            start = i
            while i < len(text) and not text[i].isspace() and text[i] not in '();"':
                i += 1
            stack[-1].append(text[start:i])
    if len(stack) != 1:
        raise ValueError("unbalanced '(': the profile ends inside a form")
    return stack[0]
