"""`egressd mcp wrap|unwrap|run` with the real MCP SDK as client and real MCP servers.

The config formats of Claude Desktop, Claude Code, VS Code and Cursor are rewritten by the real
command; then the MCP SDK's stdio client starts each server exactly as the wrapped config says:
`mcp-server-fetch` (PyPI) fetches an allowed URL, a refused one (the tool error carries egressd's
reason) and one only another server's profile allows; `@modelcontextprotocol/server-everything`
(npm, installed by scripts/setup.sh) answers byte for byte as it does unwrapped.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("mcp_server_fetch")

from mcp import ClientSession  # noqa: E402
from mcp.client.stdio import StdioServerParameters, stdio_client  # noqa: E402

from egressd.agents import jsonc  # noqa: E402
from tests.support.dns_server import DnsServer  # noqa: E402
from tests.support.egressd_cli import EGRESSD  # noqa: E402
from tests.support.upstreams import EchoHTTPServer, RefusingPort  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
EVERYTHING = REPO / ".cache" / "mcp-npm" / "node_modules" / ".bin" / "mcp-server-everything"
# its SSRF guard on: it resolves every URL's host itself and refuses any address that is not public
FETCH = [sys.executable, "-m", "mcp_server_fetch", "--ignore-robots-txt"]
FETCH += ["--user-agent", "egressd-test"]


def mcp(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    result = subprocess.run([*EGRESSD, "mcp", *args], capture_output=True, text=True, timeout=60)
    if check:
        assert result.returncode == 0, result.stderr
    return result


def write_policy(
    tmp_path: Path, upstream: EchoHTTPServer, nameserver: str = "", profiles: str | None = None
) -> Path:
    path = tmp_path / "mcp-policy.yaml"
    resolver = f"resolver: {{nameservers: ['{nameserver}']}}\n" if nameserver else ""
    profiles = (
        profiles
        if profiles is not None
        else (
            "profiles:\n  fetch: {allow: [up.test, '" + upstream.host + "']}\n"
            "  everything: {allow: [other.test]}\n"
        )
    )
    path.write_text(
        f"version: 1\nmode: enforce\nallow: [up.test, other.test, '{upstream.host}']\n{resolver}{profiles}"
    )
    return path


# -- the four formats ---------------------------------------------------------------------------
CLAUDE_DESKTOP = """{
  "globalShortcut": "Ctrl+Space",
  "mcpServers": {
    "fetch": {
      "command": "uvx",
      "args": ["mcp-server-fetch"],
      "env": {"LOG": "1"},
      "x-unknown": {"keep": true}
    },
    "remote": {"type": "http", "url": "https://mcp.example/mcp"}
  },
  "zzz": 1
}
"""
VSCODE = """{
    "inputs": [{"type": "promptString", "id": "token", "password": true}],
    "servers": {
        "everything": {"type": "stdio", "command": "npx", "args": ["-y", "@modelcontextprotocol/everything"]},
        "noargs": {"command": "my-server", "envFile": "${workspaceFolder}/.env"},
        "web": {"type": "sse", "url": "http://localhost:3000/sse"}
    }
}
"""
CLAUDE_CODE = (
    '{"mcpServers": {"fetch": {"type": "stdio", "command": "python", "args": ["-m", "x"], "env": {}}}}'
)
CURSOR = (
    '{\n  "mcpServers": {\n    "fetch": {\n      "command": "uvx",\n'
    '      "args": ["mcp-server-fetch"]\n    }\n  }\n}\n'
)


@pytest.mark.parametrize(
    ("name", "text", "key", "stdio"),
    [
        ("claude_desktop_config.json", CLAUDE_DESKTOP, "mcpServers", ["fetch"]),
        (".mcp.json", CLAUDE_CODE, "mcpServers", ["fetch"]),
        ("mcp.json", VSCODE, "servers", ["everything", "noargs"]),
        ("cursor-mcp.json", CURSOR, "mcpServers", ["fetch"]),
    ],
)
def test_wrap_unwrap_formats(
    tmp_path: Path, upstream: EchoHTTPServer, name: str, text: str, key: str, stdio: list[str]
) -> None:
    config = tmp_path / name
    config.write_text(text)
    config.chmod(0o600)
    names = {"fetch", "everything", "noargs"}
    policy = write_policy(
        tmp_path, upstream, profiles="profiles:\n" + "".join(f"  {n}: {{allow: []}}\n" for n in names)
    )
    mcp("wrap", str(config), "--policy", str(policy))
    once = config.read_text()
    document = json.loads(once)
    before = json.loads(text)
    assert list(document) == list(before)  # unknown top-level keys kept, in order
    for server, entry in document[key].items():
        old = before[key][server]
        if server not in stdio:
            assert entry == old  # http/sse untouched
            continue
        assert (
            list(entry) == list(old) if "args" in old else list(entry) == ["command", "args", *list(old)[1:]]
        )
        assert entry["args"][entry["args"].index("--") + 1 :] == [old["command"], *old.get("args", [])]
        assert ["--profile", server] == entry["args"][2:4] or ["--profile", server] == entry["args"][4:6]
        assert {k: v for k, v in entry.items() if k not in ("command", "args")} == {
            k: v for k, v in old.items() if k not in ("command", "args")
        }
    assert (tmp_path / (name + ".egressd-backup")).read_text() == text
    assert config.stat().st_mode & 0o777 == 0o600
    mcp("wrap", str(config), "--policy", str(policy))  # idempotent
    assert config.read_text() == once
    mcp("unwrap", str(config))
    assert config.read_text() == text  # byte for byte
    mcp("unwrap", str(config))
    assert config.read_text() == text
    # a config that is a symlink (dotfiles) stays one
    link = tmp_path / "link.json"
    link.symlink_to(config)
    mcp("wrap", str(link), "--policy", str(policy))
    assert link.is_symlink() and config.read_text() == once


def test_wrap_refuses_without_touching(tmp_path: Path, upstream: EchoHTTPServer) -> None:
    policy = write_policy(tmp_path, upstream)
    cases = {
        "comment.json": '{\n  /* a comment that never ends\n  "servers": {}\n}\n',
        "garbage.json": "{not json",
        "dupes.json": '{"mcpServers": {"a": {"command": "x"}, "a": {"command": "y"}}}',
        "noservers.json": '{"other": {}}',
        "list.json": "[]",
    }
    for file_name, text in cases.items():
        path = tmp_path / file_name
        path.write_text(text)
        result = mcp("wrap", str(path), "--policy", str(policy), check=False)
        assert result.returncode == 2, (file_name, result.stderr)
        assert "not changed" in result.stderr and str(path) in result.stderr
        assert path.read_text() == text
        assert not (tmp_path / (file_name + ".egressd-backup")).exists()
    # a stdio server without its own profile: wrapping would give it none, so nothing changes
    path = tmp_path / "noprofile.json"
    path.write_text(CURSOR.replace('"fetch"', '"github"'))
    result = mcp("wrap", str(path), "--policy", str(policy), check=False)
    assert result.returncode == 2 and "github" in result.stderr and "profiles:" in result.stderr
    assert path.read_text() == CURSOR.replace('"fetch"', '"github"')
    result = mcp("wrap", str(path), "--policy", str(policy), "--server", "nope", check=False)
    assert result.returncode == 2 and "no such server" in result.stderr


VSCODE_JSONC = """// .vscode/mcp.json: VS Code reads JSON with comments
{
  "servers": {
    // the reference server, from npm
    "everything": {
      "type": "stdio",
      "command": "node",
      "args": [
        "EVERYTHING", // the script
        "stdio"
      ],
    },
    /* a remote server: the client connects to it itself */
    "remote": {"type": "http", "url": "https://mcp.example/mcp"},
    "events": {"type": "sse", "url": "http://localhost:3000/sse"},
  },
}
"""


async def test_wrap_jsonc_keeps_its_comments_and_the_server_runs(
    tmp_path: Path, upstream: EchoHTTPServer
) -> None:
    """VS Code's mcp.json with comments and trailing commas: wrap says which servers it skipped
    and why, keeps every comment, and writes what wrapping the same file without comments writes;
    the MCP SDK's stdio client runs the wrapped server; unwrap restores the bytes and removes the
    backup that holds the same bytes."""
    if not EVERYTHING.exists():
        pytest.fail(f"{EVERYTHING} is missing: run scripts/setup.sh (it npm-installs the server)")
    policy = write_policy(tmp_path, upstream, profiles="profiles:\n  everything: {allow: []}\n")
    text = VSCODE_JSONC.replace("EVERYTHING", str(EVERYTHING))
    config = tmp_path / "mcp.json"
    config.write_text(text)
    plain = tmp_path / "plain.json"  # the same servers as strict JSON, no comment
    plain.write_text(
        json.dumps(
            {
                "servers": {
                    "everything": {"type": "stdio", "command": "node", "args": [str(EVERYTHING), "stdio"]},
                    "remote": {"type": "http", "url": "https://mcp.example/mcp"},
                    "events": {"type": "sse", "url": "http://localhost:3000/sse"},
                }
            },
            indent=2,
        )
    )
    result = mcp("wrap", str(config), "--policy", str(policy))
    assert f"wrapped everything; the file as it was is kept in {config}.egressd-backup" in result.stderr
    assert "skipped remote: a remote server (type http)" in result.stderr, result.stderr
    assert "skipped events: a remote server (type sse)" in result.stderr
    assert "the MCP client connects to it itself" in result.stderr
    wrapped = config.read_text()
    for comment in ("// .vscode/mcp.json", "// the reference server", "// the script", "/* a remote server"):
        assert comment in wrapped
    mcp("wrap", str(plain), "--policy", str(policy))
    expected = json.loads(plain.read_text())["servers"]["everything"]
    entry = jsonc.parse(wrapped).value["servers"]["everything"]
    assert entry == expected
    params = StdioServerParameters(command=entry["command"], args=entry["args"])
    is_error, answer = await _call(params, "echo", {"message": "through egressd"})
    assert not is_error and "through egressd" in answer, answer
    result = mcp("unwrap", str(config))
    assert config.read_text() == text  # byte for byte, comments and trailing commas too
    assert f"its backup {config}.egressd-backup held the same bytes and is removed" in result.stderr
    assert not (tmp_path / "mcp.json.egressd-backup").exists()


def test_unwrap_says_where_the_backup_is_when_it_differs(tmp_path: Path, upstream: EchoHTTPServer) -> None:
    """A comment edited while wrapped: unwrap keeps the edit, and the backup (the file before
    wrap) stays, named; with no backup, unwrap says none is left."""
    policy = write_policy(tmp_path, upstream, profiles="profiles:\n  fetch: {allow: []}\n")
    config = tmp_path / "cursor-mcp.json"
    config.write_text("// mine\n" + CURSOR)
    mcp("wrap", str(config), "--policy", str(policy))
    config.write_text(config.read_text().replace("// mine", "// mine, edited"))
    result = mcp("unwrap", str(config))
    assert config.read_text() == "// mine, edited\n" + CURSOR
    backup = tmp_path / "cursor-mcp.json.egressd-backup"
    assert backup.read_text() == "// mine\n" + CURSOR
    assert f"the backup {backup} is kept" in result.stderr and "differs from the file now" in result.stderr
    backup.unlink()
    assert "no backup is left" in mcp("unwrap", str(config)).stderr


# -- real servers through the wrapped config ------------------------------------------------------
def _wrapped_params(config: Path, server: str) -> StdioServerParameters:
    entry = json.loads(config.read_text())["mcpServers"][server]
    return StdioServerParameters(command=entry["command"], args=entry["args"], env=entry.get("env"))


async def _call(params: StdioServerParameters, tool: str, arguments: dict[str, Any]) -> tuple[bool, str]:
    async with stdio_client(params) as (read, write), ClientSession(read, write) as session:
        await session.initialize()
        result = await session.call_tool(tool, arguments)
        return bool(result.is_error), "\n".join(getattr(c, "text", "") for c in result.content)


@pytest.fixture
def wrapped_config(tmp_path: Path, dns: DnsServer, public_upstream: EchoHTTPServer) -> Path:
    """fetch (its SSRF guard on) and everything, wrapped. The servers run in a network namespace of
    their own, whose DNS gives the real addresses egressd resolved: the upstream is one the guard
    takes for a public address (3fff::1)."""
    upstream = public_upstream
    dns.add("up.test", upstream.host)
    dns.add("other.test", upstream.host)
    if not EVERYTHING.exists():
        pytest.fail(f"{EVERYTHING} is missing: run scripts/setup.sh (it npm-installs the server)")
    config = tmp_path / "claude_desktop_config.json"
    config.write_text(
        json.dumps(
            {
                "mcpServers": {
                    "fetch": {"command": FETCH[0], "args": FETCH[1:]},
                    "everything": {"command": "node", "args": [str(EVERYTHING), "stdio"]},
                }
            },
            indent=2,
        )
    )
    policy = write_policy(tmp_path, upstream, nameserver=dns.nameserver)
    mcp("wrap", str(config), "--policy", str(policy))
    return config


async def test_fetch_server_allowed_refused_and_profile(
    wrapped_config: Path, public_upstream: EchoHTTPServer
) -> None:
    upstream = public_upstream
    params = _wrapped_params(wrapped_config, "fetch")
    is_error, text = await _call(params, "fetch", {"url": f"http://up.test:{upstream.port}/page-ok"})
    assert not is_error, text
    assert "/page-ok" in text

    is_error, text = await _call(params, "fetch", {"url": "http://refused.test/secret"})
    assert is_error
    assert "403" in text  # the server's own words
    assert "egressd refused GET http://refused.test:80/secret: not_allowlisted" in text  # egressd's reason
    # the server runs with profile fetch (mcp wrap): the file says both, no command line does
    assert "egressd exec" not in text
    assert "a person can add 'refused.test' to allow: (and to profiles.fetch.allow" in text

    # other.test is in the policy, but only the everything server's profile allows it
    is_error, text = await _call(params, "fetch", {"url": f"http://other.test:{upstream.port}/x"})
    assert is_error and "profile" in text and "fetch" in text, text


async def test_a_profile_refusal_names_the_profile_line_addressed_to_a_person(
    wrapped_config: Path, public_upstream: EchoHTTPServer
) -> None:
    """`mcp wrap` gives each server its own profile: a host the policy allows and the server's
    profile does not is lifted by a line in that profile, which the failed call names (in the
    wrapped policy file) for a person to add; no `--allow`, no `egressd exec`, one full stop each."""
    upstream = public_upstream
    params = _wrapped_params(wrapped_config, "fetch")
    is_error, text = await _call(params, "fetch", {"url": f"http://other.test:{upstream.port}/x"})
    assert is_error
    # the server's own DNS question for the name was refused too (its network namespace's DNS):
    # the request's notice is the one that names the port
    notice = next(line for line in text.splitlines() if line.startswith("egressd refused GET"))
    policy = wrapped_config.parent / "mcp-policy.yaml"
    assert notice.startswith(f"egressd refused GET http://other.test:{upstream.port}/x: profile. "), notice
    assert notice.endswith(
        f"To allow it, a person can add the line '- other.test:{upstream.port}' under profiles.fetch.allow "
        f"in {policy} (a saved edit applies at once)."
    ), notice
    assert "--allow" not in notice and "egressd exec" not in notice and ".)." not in notice


async def test_a_network_failure_is_told_as_one(
    wrapped_config: Path, public_upstream: EchoHTTPServer
) -> None:
    """A failed tool call whose connection the network failed (nothing listens on the port:
    connect_refused) says egressd failed to reach it, never that egressd refused it."""
    with RefusingPort(public_upstream.host) as closed:
        params = _wrapped_params(wrapped_config, "fetch")
        is_error, text = await _call(params, "fetch", {"url": f"http://up.test:{closed.port}/x"})
    assert is_error
    assert f"egressd failed to reach up.test:{closed.port}: connect_refused" in text, text
    assert "egressd refused" not in text, text


def _exchange(argv: list[str], lines: list[bytes], expect: int, timeout: float = 60) -> list[bytes]:
    """Write request lines to a stdio server and read `expect` response lines, as raw bytes."""
    proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    assert proc.stdin is not None and proc.stdout is not None
    try:
        proc.stdin.write(b"".join(lines))
        proc.stdin.flush()
        deadline = time.monotonic() + timeout
        out = []
        while len(out) < expect and time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            if b'"id"' in line:  # responses only (the server may also send notifications)
                out.append(line)
        return out
    finally:
        proc.kill()
        proc.wait()


def test_everything_server_framing_is_untouched(wrapped_config: Path) -> None:
    entry = json.loads(wrapped_config.read_text())["mcpServers"]["everything"]
    requests = [
        b'{"jsonrpc":"2.0","id":1,"method":"initialize","params":{"protocolVersion":"2025-06-18",'
        b'"capabilities":{},"clientInfo":{"name":"t","version":"1"}}}\n',
        b'{"jsonrpc":"2.0","method":"notifications/initialized"}\n',
        # odd spacing and a non-ASCII echo: the bytes that come back must be the server's own
        '{ "jsonrpc" : "2.0", "id" : 2, "method" : "tools/call", '
        '"params" : {"name": "echo", "arguments": {"message": "h\\u00e9llo \u2603 \\n"}} }\n'.encode(),
        b'{"jsonrpc":"2.0","id":3,"method":"tools/list"}\n',
    ]
    direct = _exchange(["node", str(EVERYTHING), "stdio"], requests, 3)
    wrapped = _exchange([entry["command"], *entry["args"]], requests, 3)
    assert len(direct) == 3
    assert wrapped == direct


def test_mcp_run_passes_stdio_byte_for_byte(tmp_path: Path) -> None:
    """Lines the relay has no business with — malformed, huge, without a final newline — arrive as sent."""
    echo = tmp_path / "cat.py"
    echo.write_text("import sys\nsys.stdout.buffer.write(sys.stdin.buffer.read())\n")
    payload = b"".join(
        [
            b"not json at all\n",
            b'{"jsonrpc":"2.0","id":1,"result":{"isError":true,"content":[]}}\r\n',
            b'{"a": 1, "a": 2}\n',
            b"\xff\xfe invalid utf-8\n",
            b'{"big":"' + b"x" * 3_000_000 + b'"}\n',
            b"[1,2,3]\n",
            b'{"jsonrpc":"2.0","id":"no-newline-at-end"}',
        ]
    )
    result = subprocess.run(
        [*EGRESSD, "mcp", "run", "--", sys.executable, str(echo)],
        input=payload,
        capture_output=True,
        timeout=60,
        env=dict(os.environ),
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout == payload


async def test_wrap_sandbox_one_server(
    tmp_path: Path, dns: DnsServer, public_upstream: EchoHTTPServer, work: Path
) -> None:
    """wrap --sandbox --server fetch: only that server is wrapped, and it runs confined; the
    allowed fetch works through the sandbox's bridge with the server's SSRF guard on (inside, the
    name resolves to its real address, which the guard accepts), and the refused one carries
    egressd's reason (the name has no address inside, so the guard leaves it to the proxy)."""
    from tests.support.sandboxes import sandbox_env

    dns.add("pub.test", public_upstream.host)
    config = tmp_path / ".mcp.json"
    everything = {"command": "node", "args": [str(EVERYTHING), "stdio"]}
    fetch = {"command": FETCH[0], "args": FETCH[1:], "env": {"KEEP": "1"}}
    config.write_text(json.dumps({"mcpServers": {"fetch": fetch, "everything": everything}}, indent=2) + "\n")
    policy = tmp_path / "mcp-policy.yaml"
    policy.write_text(
        f"version: 1\nallow: [pub.test, '3fff::/20']\nresolver: {{nameservers: ['{dns.nameserver}']}}\n"
        "profiles:\n  fetch: {allow: [pub.test, '3fff::/20']}\n"
    )
    mcp("wrap", str(config), "--policy", str(policy), "--sandbox", "--server", "fetch")
    servers = json.loads(config.read_text())["mcpServers"]
    assert servers["everything"] == everything
    assert "--sandbox" in servers["fetch"]["args"] and servers["fetch"]["env"] == {"KEEP": "1"}
    env = {**sandbox_env(work), **servers["fetch"]["env"]}
    params = StdioServerParameters(
        command=servers["fetch"]["command"], args=servers["fetch"]["args"], env=env, cwd=work
    )
    is_error, text = await _call(params, "fetch", {"url": f"http://pub.test:{public_upstream.port}/confined"})
    assert not is_error and "/confined" in text, text
    is_error, text = await _call(params, "fetch", {"url": "http://refused.test/x"})
    assert is_error and "not_allowlisted" in text, text
