"""JSON with comments (egressd.agents.jsonc) and the MCP config edits built on it.

Why: `egressd mcp wrap` rewrites a file the user wrote by hand (VS Code's mcp.json is JSONC), so
reading it must agree with a strict JSON reader on every value — a `//` or `/*` inside a string
is text, never a comment — and an edit must change only the bytes it means to. Nasty inputs are
tabled; hypothesis builds configs with comments, trailing commas and odd strings everywhere and
checks that the values read are the values written, and that unwrap undoes wrap byte for byte.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from egressd.agents import jsonc, mcp_config

# -- read: the values a strict reader sees once the comments are gone --------------------------------
READS = [
    ('{"a": "// not a comment", "b": "/* nor this */"}', {"a": "// not a comment", "b": "/* nor this */"}),
    ('{"url": "https://x.test//p"} // a comment', {"url": "https://x.test//p"}),
    ('{"a": [1, 2,], "b": {"c": 1,},}', {"a": [1, 2], "b": {"c": 1}}),
    ('{"a": /* c */ 1 /* d */}', {"a": 1}),
    ('/* "quoted" // and { */ {"a": 1}', {"a": 1}),
    ('// /* not a block\n{"a": 1}', {"a": 1}),
    ('\ufeff{"a": 1}', {"a": 1}),
    ('{"a": "say \\"// hi\\""}', {"a": 'say "// hi"'}),
    ('{"a": "c:\\\\"} // the string ends at the second quote', {"a": "c:\\"}),
    ('{"a": "\\\\\\"/*"} /* */', {"a": '\\"/*'}),
    ('{"a" /* c */ : /* d */ 1}', {"a": 1}),
    ('{"é": "☃", "s": "\\ud83d\\ude00"}', {"é": "☃", "s": "\U0001f600"}),
    ('{\r\n  // c\r\n  "a": 1\r\n}', {"a": 1}),
    ('{"a": 1} // the end, no newline', {"a": 1}),
    ("/**/[/**/1/**/,/**/2/**/,/**/]/**/", [1, 2]),
    ('{"a": "/*", "b": "*/"}', {"a": "/*", "b": "*/"}),
    ('[1, "]", ","]', [1, "]", ","]),
    ('{"a": [],}', {"a": []}),
    ("/* multi\n line\n comment */ 5", 5),
    ('{"n": -1.5e3, "t": true, "f": false, "z": null}', {"n": -1500.0, "t": True, "f": False, "z": None}),
]


@pytest.mark.parametrize(("text", "expected"), READS)
def test_reads_what_a_strict_reader_reads(text: str, expected: Any) -> None:
    node = jsonc.parse(text)
    assert node.value == expected
    assert len(jsonc.blank(text)) == len(text)
    _check_spans(text, node)


def _check_spans(text: str, node: jsonc.Node) -> None:
    """Every node's span, blanked, is exactly its value in strict JSON."""
    strict = jsonc.blank(text)
    assert json.loads(strict[node.start : node.end]) == node.value
    for key_start, child in node.members.values():
        assert strict[key_start] == '"'
        _check_spans(text, child)
    for child in node.items:
        _check_spans(text, child)


REFUSED = [
    ('{"a": 1 /* never ends', "never ends"),
    ("[1,,]", "expected a value"),
    ("[,]", "expected a value"),
    ("{,}", "expected a key"),
    ('{"a": 1, "a": 2}', "duplicate key 'a'"),
    ('{"a": "unterminated}', "bad string"),
    ('{"a": "line\nbreak"}', "bad string"),
    ('{"a": NaN}', "expected a value"),
    ("{'a': 1}", "expected a key"),
    ('{"a" 1}', "expected ':'"),
    ("{} x", "unexpected text"),
    ("{} /", "unexpected text"),
    ("[" * 1000, "nested deeper"),
    ("", "found the end"),
    ('{"a": 01}', "expected ','"),
    ("# not a comment\n{}", "expected a value"),
]


@pytest.mark.parametrize(("text", "why"), REFUSED)
def test_refuses_what_is_not_jsonc(text: str, why: str) -> None:
    with pytest.raises(jsonc.JsoncError, match=why):
        jsonc.parse(text)


def test_an_error_says_where() -> None:
    with pytest.raises(jsonc.JsoncError, match="line 3 column 8"):
        jsonc.parse('{\n  "a": 1,\n  "b": ?\n}')


# -- edits: only the wrapped entries' command and args change ------------------------------------------
OPTIONS = mcp_config.WrapOptions(("/opt/egressd",), "/home/u/policy.yaml")

VSCODE = """\ufeff// VS Code: .vscode/mcp.json
{
  "inputs": [], // none yet
  "servers": {
    /* the fetch tool */
    "fetch": {
      "type": "stdio",
      "command": "uvx", // from PyPI
      "args": [
        "mcp-server-fetch", // its name
        "--user-agent=a//b"
      ],
    },
    "noargs": {"command": "my-server" /* no args */, "envFile": "${workspaceFolder}/.env",},
    "empty": {"command": "x", "args": [ ]},
    "remote": {"type": "http", "url": "https://mcp.example/mcp"}, // skipped
  },
}
"""


def test_wrap_keeps_every_comment_and_unwrap_restores_the_bytes() -> None:
    text, wrapped, skipped = mcp_config.wrap(VSCODE, "servers", OPTIONS)
    assert wrapped == ["fetch", "noargs", "empty"]
    assert [name for name, _ in skipped] == ["remote"] and "remote server (type http)" in skipped[0][1]
    for comment in ("// VS Code", "// none yet", "/* the fetch tool */", "// from PyPI", "// its name",
                    "/* no args */", "// skipped"):  # fmt: skip
        assert comment in text
    assert text.startswith("\ufeff")
    servers = jsonc.parse(text).value["servers"]
    fetch = servers["fetch"]
    assert fetch["command"] == "/opt/egressd"
    assert fetch["args"] == ["mcp", "run", "--profile", "fetch", "--policy", "/home/u/policy.yaml", "--",
                             "uvx", "mcp-server-fetch", "--user-agent=a//b"]  # fmt: skip
    assert servers["noargs"]["args"][-2:] == ["--", "my-server"] and list(servers["noargs"])[:2] == [
        "command",
        "args",
    ]
    assert servers["empty"]["args"][-2:] == ["--", "x"]
    assert servers["remote"] == {"type": "http", "url": "https://mcp.example/mcp"}
    # each new argument on its own line where the file puts them so
    assert '\n        "mcp",\n        "run",' in text
    assert mcp_config.wrap(text, "servers", OPTIONS)[0] == text  # wrapping twice is wrapping once
    assert mcp_config.unwrap(text, "servers")[0] == VSCODE  # byte for byte
    # one server only: the others stay wrapped
    partial, restored = mcp_config.unwrap(text, "servers", ["noargs"])
    assert restored == ["noargs"] and jsonc.parse(partial).value["servers"]["fetch"] == fetch


def test_a_command_with_escapes_comes_back_exactly() -> None:
    text = '{"mcpServers": {"s": {"command": "C:\\\\tools\\u002fserver.exe", "args": ["\\u00e9"]}}}'
    wrapped, _, _ = mcp_config.wrap(text, "mcpServers", OPTIONS)
    assert jsonc.parse(wrapped).value["mcpServers"]["s"]["args"][-2:] == ["C:\\tools/server.exe", "é"]
    assert mcp_config.unwrap(wrapped, "mcpServers")[0] == text


# -- properties ------------------------------------------------------------------------------------------
PIECES = [*'ab/*"\\\n\t,:[]{} é☃', "//", "/*", "*/", "\\u"]  # what strings and comments confuse
TRICKY = st.lists(st.sampled_from(PIECES), max_size=8).map("".join)
SCALARS = st.none() | st.booleans() | st.integers(-(10**6), 10**6) | TRICKY
VALUES = st.recursive(
    SCALARS,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(TRICKY, inner, max_size=4),
    max_leaves=12,
)
GAPS = st.sampled_from(["", " ", "\n  ", "/* c */", " // line ' \" /* \n", "/**/", "\r\n", "/* // */ "])


def render(value: Any, draw: Any) -> str:
    """`value` as JSONC: comments and spaces between every two tokens, a trailing comma sometimes."""

    def gap() -> str:
        return draw(GAPS)

    if isinstance(value, dict):
        parts = [f"{gap()}{json.dumps(k)}{gap()}:{gap()}{render(v, draw)}{gap()}" for k, v in value.items()]
        trailing = "," if parts and draw(st.booleans()) else ""
        return "{" + ",".join(parts) + trailing + gap() + "}"
    if isinstance(value, list):
        parts = [f"{gap()}{render(v, draw)}{gap()}" for v in value]
        trailing = "," if parts and draw(st.booleans()) else ""
        return "[" + ",".join(parts) + trailing + gap() + "]"
    return json.dumps(value, ensure_ascii=draw(st.booleans()))


@settings(max_examples=300, deadline=None)
@given(VALUES, st.data())
def test_any_value_with_comments_everywhere_reads_back(value: Any, data: st.DataObject) -> None:
    text = data.draw(GAPS) + render(value, data.draw) + data.draw(GAPS)
    assert jsonc.parse(text).value == value


SERVER = st.fixed_dictionaries(
    {"command": TRICKY},
    optional={"args": st.lists(TRICKY, max_size=3), "env": st.dictionaries(TRICKY, TRICKY, max_size=2)},
)
NAMES = st.from_regex(r"[a-z][a-z0-9_-]{0,8}", fullmatch=True)


@settings(max_examples=200, deadline=None)
@given(st.dictionaries(NAMES, SERVER, min_size=1, max_size=4), st.data())
def test_unwrap_undoes_wrap_byte_for_byte(servers: dict[str, Any], data: st.DataObject) -> None:
    text = render({"mcpServers": servers}, data.draw)
    wrapped, names, _ = mcp_config.wrap(text, "mcpServers", OPTIONS)
    assert names == list(servers)
    after = jsonc.parse(wrapped).value["mcpServers"]
    for name, entry in servers.items():
        assert after[name]["command"] == "/opt/egressd"
        tail = after[name]["args"][after[name]["args"].index("--") + 1 :]
        assert tail == [entry["command"], *entry.get("args", [])]
        assert {k: v for k, v in after[name].items() if k not in ("command", "args")} == {
            k: v for k, v in entry.items() if k not in ("command", "args")
        }
    assert mcp_config.wrap(wrapped, "mcpServers", OPTIONS)[0] == wrapped
    assert mcp_config.unwrap(wrapped, "mcpServers")[0] == text
