"""A reader of the Seatbelt profiles egressd writes (SBPL, Scheme), for the tests to check them with.

It reads what `egressd.sandbox.sbpl.quote()` writes: forms, symbols, string literals and regex
literals (`#"..."`), comments dropped. `network_rules` and `outbound_rules` pick out what a profile
allows on the network (the trap: a `local ip` filter on network-outbound opens everything).
"""

from __future__ import annotations

from dataclasses import dataclass

from egressd.sandbox.sbpl import quote


@dataclass(frozen=True)
class String:
    """A string literal: `"..."`, or `#"..."` (a regex) when `regex`."""

    text: str
    regex: bool = False


Form = str | String | list["Form"]  # a symbol, a literal or a list


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


def network_rules(profile: str) -> list[tuple[str, str, str]]:
    """(action, operation, filters) for every rule on network operations (or `default`) in the
    profile, read as SBPL, for checks and tests."""
    rules = []
    for form in read(profile):
        if not (isinstance(form, list) and form and form[0] in ("allow", "deny")):
            continue
        operations = [item for item in form[1:] if isinstance(item, str)]
        filters = " ".join(render(item) for item in form[1:] if not isinstance(item, str))
        for operation in operations:
            if operation == "default" or operation.startswith("network"):
                rules.append((str(form[0]), operation, filters))
    return rules


def outbound_rules(profile: str) -> list[str]:
    """The filters of every rule that ALLOWS an outbound connection (network-outbound, network*,
    default)."""
    return [
        filt
        for action, operation, filt in network_rules(profile)
        if action == "allow" and operation in ("network-outbound", "network*", "default")
    ]
