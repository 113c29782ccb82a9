"""`egressd acp` with the real agent-client-protocol SDK on both sides and a real MCP server.

A client (the SDK's ClientSideConnection, as an editor would use it) starts `egressd acp -- python
tests/support/acp_agent.py`; the agent starts `mcp-server-fetch` (PyPI) from `session/new` with an
explicit env that names a dead proxy, asks the client to run a terminal with such an env too, and
fetches an allowed and a refused URL. Everything the agent's MCP server and the client-run terminal
do must go through this egressd, and the refusals must reach the client with their reason.
"""

from __future__ import annotations

import asyncio
import os
import shlex
import sys
from pathlib import Path
from typing import Any

import pytest

acp = pytest.importorskip("acp")
pytest.importorskip("mcp_server_fetch")

from acp import PROTOCOL_VERSION, RequestError, spawn_agent_process, text_block  # noqa: E402
from acp.schema import (  # noqa: E402
    AllowedOutcome,
    ClientCapabilities,
    CreateTerminalResponse,
    DeniedOutcome,
    EnvVariable,
    HttpMcpServer,
    McpServerStdio,
    ReleaseTerminalResponse,
    RequestPermissionResponse,
    TerminalOutputResponse,
    WaitForTerminalExitResponse,
)

from tests.support.audit_log import audit_records  # noqa: E402
from tests.support.dns_server import DnsServer  # noqa: E402
from tests.support.egressd_cli import EGRESSD  # noqa: E402
from tests.support.upstreams import EchoHTTPServer, RefusingPort  # noqa: E402

AGENT = str(Path(__file__).parents[1] / "support" / "acp_agent.py")
# its SSRF guard on: it resolves every URL's host itself and refuses any address that is not public
FETCH_SERVER = [sys.executable, "-m", "mcp_server_fetch", "--ignore-robots-txt"]
FETCH_SERVER += ["--user-agent", "egressd-test"]
# In mode: ask, a name nobody has approved yet is answered with a stand-in address (198.18.0.0/15)
# in the agent's network namespace: a guard that judges addresses itself refuses it before egressd
# could ask anyone (docs/security.md), so the ask tests run the server with its guard off.
FETCH_SERVER_UNGUARDED = [*FETCH_SERVER, "--allow-private-ips"]
STDERR: dict[str, Any] = {"stderr": None}  # egressd's and the agent's stderr: the test log


class EditorClient:
    """What an editor does for an agent: shows updates, runs terminals, answers permissions."""

    def __init__(self) -> None:
        self.updates: list[tuple[str, str]] = []
        self.terminals: dict[str, tuple[asyncio.subprocess.Process, asyncio.Task[bytes]]] = {}
        self.terminal_envs: list[dict[str, str]] = []
        self.permissions: list[Any] = []
        # the option picked, or "cancelled" (the dialog dismissed), or a function of the tool call
        self.answer: str | Any = "allow_once"

    def on_connect(self, conn: Any) -> None:
        pass

    async def session_update(self, session_id: str, update: Any, **kwargs: Any) -> None:
        content = getattr(update, "content", None)
        text = getattr(content, "text", None)
        if isinstance(text, str):
            self.updates.append((session_id, text))

    async def request_permission(
        self, session_id: str, tool_call: Any, options: list[Any], **kwargs: Any
    ) -> Any:
        self.permissions.append((session_id, tool_call, options))
        answer = self.answer(tool_call) if callable(self.answer) else self.answer
        if answer == "cancelled":
            return RequestPermissionResponse(outcome=DeniedOutcome(outcome="cancelled"))
        return RequestPermissionResponse(outcome=AllowedOutcome(outcome="selected", option_id=answer))

    async def create_terminal(
        self,
        session_id: str,
        command: str,
        args: list[str] | None = None,
        env: list[Any] | None = None,
        **kw: Any,
    ) -> CreateTerminalResponse:
        given = {item.name: item.value for item in env or []}
        self.terminal_envs.append(given)
        proc = await asyncio.create_subprocess_exec(
            command,
            *(args or []),
            env={**os.environ, **given},
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
        )
        assert proc.stdout is not None
        terminal_id = f"t{len(self.terminals) + 1}"
        self.terminals[terminal_id] = (proc, asyncio.create_task(proc.stdout.read()))
        return CreateTerminalResponse(terminal_id=terminal_id)

    async def wait_for_terminal_exit(self, session_id: str, terminal_id: str, **kw: Any) -> Any:
        proc, _ = self.terminals[terminal_id]
        return WaitForTerminalExitResponse(exit_code=await asyncio.wait_for(proc.wait(), 60))

    async def terminal_output(self, session_id: str, terminal_id: str, **kw: Any) -> Any:
        _, output = self.terminals[terminal_id]
        text = (await asyncio.wait_for(output, 60)).decode("utf-8", "replace")
        return TerminalOutputResponse(output=text, truncated=False)

    async def release_terminal(self, session_id: str, terminal_id: str, **kw: Any) -> Any:
        return ReleaseTerminalResponse()

    async def kill_terminal(self, session_id: str, terminal_id: str, **kw: Any) -> Any:
        self.terminals[terminal_id][0].kill()

    async def write_text_file(self, *args: Any, **kw: Any) -> Any:
        raise RequestError.method_not_found("fs/write_text_file")

    async def read_text_file(self, *args: Any, **kw: Any) -> Any:
        raise RequestError.method_not_found("fs/read_text_file")

    def texts(self) -> str:
        return "\n".join(text for _, text in self.updates)


@pytest.fixture
def up(dns: DnsServer, public_upstream: EchoHTTPServer) -> EchoHTTPServer:
    """The agent and its MCP servers run in a network namespace of their own, whose DNS gives the
    real addresses egressd resolved: the fetch server's SSRF guard must take it for a public one."""
    dns.add("up.test", public_upstream.host)
    return public_upstream


def _policy(tmp_path: Path, upstream: EchoHTTPServer, extra: str = "", *allow: str) -> Path:
    path = tmp_path / "policy.yaml"
    rules = ", ".join(["up.test", f"'{upstream.host}'", *allow])
    path.write_text(f"version: 1\nmode: enforce\nallow: [{rules}]\n{extra}")
    return path


def _egressd_acp(policy: Path, dns: DnsServer, audit: Path, *extra: str) -> list[str]:
    return [
        *EGRESSD,
        "acp",
        "--policy",
        str(policy),
        "--nameserver",
        dns.nameserver,
        "--audit",
        str(audit),
        *extra,
        "--",
        sys.executable,
        AGENT,
    ]


async def _session(conn: Any, servers: list[Any]) -> str:
    await asyncio.wait_for(
        conn.initialize(
            protocol_version=PROTOCOL_VERSION, client_capabilities=ClientCapabilities(terminal=True)
        ),
        30,
    )
    created = await asyncio.wait_for(conn.new_session(cwd=os.getcwd(), mcp_servers=servers), 30)
    return created.session_id


async def _prompt(conn: Any, session_id: str, text: str, timeout: float = 90) -> None:
    await asyncio.wait_for(conn.prompt(session_id=session_id, prompt=[text_block(text)]), timeout)


async def _until(predicate: Any, timeout: float = 10) -> bool:
    deadline = asyncio.get_running_loop().time() + timeout
    while asyncio.get_running_loop().time() < deadline:
        if predicate():
            return True
        await asyncio.sleep(0.05)
    return predicate()


async def test_agent_mcp_server_terminal_and_remote_servers_stay_under_egressd(
    tmp_path: Path, dns: DnsServer, up: EchoHTTPServer
) -> None:
    audit = tmp_path / "audit.jsonl"
    client = EditorClient()
    allowed = f"http://up.test:{up.port}/allowed-page"
    servers = [
        # an explicit env naming a dead proxy: without egressd's merge the server would use it
        McpServerStdio(
            name="fetch",
            command=FETCH_SERVER[0],
            args=FETCH_SERVER[1:],
            env=[
                EnvVariable(name="HTTP_PROXY", value="http://127.0.0.1:9"),
                EnvVariable(name="NO_PROXY", value="*"),
            ],
        ),
        HttpMcpServer(type="http", name="remote-refused", url="http://refused-mcp.test/mcp", headers=[]),
        HttpMcpServer(type="http", name="remote-allowed", url=f"http://up.test:{up.port}/mcp", headers=[]),
    ]
    command = _egressd_acp(_policy(tmp_path, up), dns, audit)
    async with spawn_agent_process(client, command[0], *command[1:], transport_kwargs=STDERR) as (conn, proc):
        session_id = await _session(conn, servers)
        # the refused http MCP server was removed, and the user is told why, in this session
        assert await _until(lambda: any("remote-refused" in t for _, t in client.updates))
        notice = next(t for s, t in client.updates if "remote-refused" in t)
        assert "not_allowlisted" in notice and "removed" in notice
        assert client.updates[0][0] == session_id

        await _prompt(conn, session_id, "servers")
        listing = client.texts()
        assert "remote-allowed type=http" in listing and "remote-refused type=" not in listing
        stdio_line = next(line for line in listing.splitlines() if line.startswith("fetch type="))
        assert "127.0.0.1:9" not in stdio_line and "@127.0.0.1:" in stdio_line  # egressd's, with credentials

        await _prompt(conn, session_id, f"fetch {allowed}\nfetch http://refused.test/secret")
        texts = client.texts()
        assert f"fetch {allowed} -> isError=False" in texts
        assert "/allowed-page" in texts  # the echo server's answer came back through the tool
        assert "fetch http://refused.test/secret -> isError=True" in texts
        assert "403" in texts  # the tool's own error: the proxy's status
        # egressd's reason for the refusal reaches the client, in the session
        # egressd's notice itself, not any text naming the host and the code (the tool's error does)
        def notice() -> str | None:
            told = (t for _, t in client.updates if t.startswith("egressd refused") and "refused.test" in t)
            return next(told, None)

        assert await _until(lambda: notice() is not None, timeout=30)
        reason = notice()
        assert reason is not None
        assert "not_allowlisted" in reason and "egressd exec" not in reason  # not a command the user runs
        assert "a person can add --allow refused.test to the egressd acp command" in reason

        await _prompt(conn, session_id, "terminal curl -sS -i http://refused.test/from-terminal")
        env = client.terminal_envs[-1]
        assert env["HTTP_PROXY"].startswith("http://egressd:") and env["NO_PROXY"] == ""
        terminal = next(t for _, t in client.updates if t.startswith("terminal exit="))
        assert "X-Egressd-Reason: not_allowlisted" in terminal
    records = audit_records(audit)
    decided = [(r.get("host"), r.get("decision")) for r in records if r.get("host")]
    assert ("up.test", "allow") in decided  # the allowed fetch went through egressd
    assert ("refused.test", "deny") in decided


async def test_a_network_failure_is_told_as_one(
    tmp_path: Path, dns: DnsServer, refusing_port: RefusingPort
) -> None:
    """A connection the network failed (nothing listens: connect_refused) is told in the session
    as egressd failing to reach the host, never as egressd refusing it."""
    dns.add("closed.test", refusing_port.host)
    policy = tmp_path / "policy.yaml"
    policy.write_text(f"version: 1\nallow: [closed.test, {refusing_port.host}/32]\n")
    client = EditorClient()
    command = _egressd_acp(policy, dns, tmp_path / "audit.jsonl")
    async with spawn_agent_process(client, command[0], *command[1:], transport_kwargs=STDERR) as (conn, proc):
        session_id = await _session(conn, [])
        await _prompt(conn, session_id, f"terminal curl -sS -i http://closed.test:{refusing_port.port}/")
        target = f"closed.test:{refusing_port.port}"
        assert await _until(lambda: f"egressd failed to reach {target}: connect_refused" in client.texts())
        notice = next(t for _, t in client.updates if t.startswith("egressd failed to reach"))
        assert "retry may work" in notice and "--allow" not in notice, notice
        assert not [t for _, t in client.updates if t.startswith("egressd refused")], client.updates


async def test_refusal_notices_name_what_a_person_edits_for_egressd_acp(
    tmp_path: Path, dns: DnsServer, up: EchoHTTPServer
) -> None:
    """The notices the editor shows (and the model reads) say what a person changes for `egressd
    acp` (its command in the editor's settings, or the policy file it watches), never `egressd
    exec`, never to the model itself; each part is one sentence with one full stop; a name refused
    for the addresses it resolved to names each address's rule and private.allow."""
    dns.add("mirror.test", "203.0.113.80")
    policy = _policy(tmp_path, up, "", "mirror.test")
    client = EditorClient()
    command = _egressd_acp(policy, dns, tmp_path / "audit.jsonl")
    async with spawn_agent_process(client, command[0], *command[1:], transport_kwargs=STDERR) as (conn, proc):
        session_id = await _session(conn, [])
        await _prompt(
            conn,
            session_id,
            "terminal curl -sS http://refused.test/a\nterminal curl -sS http://mirror.test/b",
        )
        assert await _until(lambda: "mirror.test:80: resolved_forbidden" in client.texts())
    notices = [text for _, text in client.updates if text.startswith("egressd refused")]
    refused = next(text for text in notices if "refused.test" in text)
    assert refused.startswith(
        "egressd refused GET http://refused.test:80/a: not_allowlisted. "
        "refused.test:80 is not in the allowlist"
    )
    assert "(mode: enforce). This is a policy decision" in refused, refused
    assert refused.endswith(
        "To allow it, a person can add --allow refused.test to the egressd acp command in the editor's agent "
        f"settings (or add 'refused.test' to allow: in {policy}; a saved edit applies at once)."
    ), refused
    mirror = next(text for text in notices if "mirror.test" in text)
    assert "resolved_forbidden" in mirror and "--allow 203.0.113.80/32" in mirror, mirror
    assert f"private.allow: true in {policy}" in mirror
    for text in notices:
        assert "egressd exec" not in text and ".)." not in text and ".." not in text, text
        assert text.endswith("."), text
        assert "To allow it:" not in text  # an instruction the model might follow itself


async def test_stdio_passes_byte_for_byte_and_big_messages(
    tmp_path: Path, dns: DnsServer, up: EchoHTTPServer
) -> None:
    """A 3 MB agent message arrives whole; unknown and malformed client lines pass untouched."""
    audit = tmp_path / "audit.jsonl"
    client = EditorClient()
    command = _egressd_acp(_policy(tmp_path, up), dns, audit)
    async with spawn_agent_process(
        client, command[0], *command[1:], transport_kwargs={**STDERR, "limit": 50 * 1024 * 1024}
    ) as (conn, proc):
        session_id = await _session(conn, [])
        await _prompt(conn, session_id, "write 3000000")
        assert any(len(text) == 3_000_000 for _, text in client.updates)


async def test_sandboxed_agent_mcp_server_uses_the_sandbox_bridge(
    tmp_path: Path, dns: DnsServer, public_upstream: EchoHTTPServer, work: Path
) -> None:
    """--sandbox: the agent and the MCP servers it starts are inside; their proxy is the sandbox's
    loopback bridge, the fetch server's SSRF guard accepts the real address the name has inside,
    and the refusal still reaches the client."""
    from tests.support.sandboxes import sandbox_env

    dns.add("pub.test", public_upstream.host)
    up = public_upstream
    client = EditorClient()
    servers = [McpServerStdio(name="fetch", command=FETCH_SERVER[0], args=FETCH_SERVER[1:], env=[])]
    policy = tmp_path / "policy.yaml"
    policy.write_text(
        "version: 1\nallow: [pub.test, '3fff::/20']\n"
        "secrets:\n  - {name: upkey, from: {env: ACP_TEST_UPKEY}, hosts: [pub.test], env: UPKEY}\n"
    )
    command = _egressd_acp(policy, dns, tmp_path / "audit.jsonl", "--sandbox")
    env = {**sandbox_env(work), "ACP_TEST_UPKEY": "sk-acp-value-33c1"}
    async with spawn_agent_process(
        client, command[0], *command[1:], cwd=work, env=env, transport_kwargs=STDERR
    ) as (conn, proc):
        session_id = await _session(conn, servers)
        await _prompt(conn, session_id, "servers")
        assert "@127.0.0.1:3128" in client.texts()  # the bridge inside the sandbox
        assert "UPKEY=egressd-secret-upkey-" in client.texts()  # the MCP server's secret: a placeholder
        assert "sk-acp-value-33c1" not in client.texts()
        await _prompt(
            conn, session_id, f"fetch http://pub.test:{up.port}/inside\nfetch http://refused.test/x"
        )
        texts = client.texts()
        assert f"fetch http://pub.test:{up.port}/inside -> isError=False" in texts
        assert "fetch http://refused.test/x -> isError=True" in texts
        assert await _until(lambda: "not_allowlisted" in client.texts())


async def test_mode_ask_is_answered_in_the_editor(tmp_path: Path, dns: DnsServer, up: EchoHTTPServer) -> None:
    """mode: ask: the agent's MCP server asks for a host; the editor's permission answer decides it,
    and allow_always writes the policy file as `egressd approve --always` does."""
    dns.add("other.test", up.host)
    dns.add("third.test", up.host)
    policy = tmp_path / "policy.yaml"
    policy.write_text(f"version: 1\nmode: ask\nallow: ['{up.host}']\n")
    client = EditorClient()
    servers = [McpServerStdio(name="fetch", command=FETCH_SERVER[0], args=FETCH_SERVER_UNGUARDED[1:], env=[])]
    command = _egressd_acp(policy, dns, tmp_path / "audit.jsonl")
    async with spawn_agent_process(client, command[0], *command[1:], transport_kwargs=STDERR) as (conn, proc):
        session_id = await _session(conn, servers)
        client.answer = "allow_once"
        await _prompt(conn, session_id, f"fetch http://up.test:{up.port}/asked")
        assert f"fetch http://up.test:{up.port}/asked -> isError=False" in client.texts()
        assert client.permissions and client.permissions[-1][0] == session_id
        assert "up.test" in client.permissions[-1][1].title

        client.answer = "reject_once"
        await _prompt(conn, session_id, f"fetch http://other.test:{up.port}/no")
        assert f"fetch http://other.test:{up.port}/no -> isError=True" in client.texts()
        assert await _until(lambda: "ask_refused" in client.texts())

        client.answer = "allow_always"
        await _prompt(conn, session_id, f"fetch http://third.test:{up.port}/always")
        assert f"fetch http://third.test:{up.port}/always -> isError=False" in client.texts()
        assert f"third.test:{up.port}" in policy.read_text()


def _ask_policy(tmp_path: Path, up: EchoHTTPServer) -> Path:
    policy = tmp_path / "policy.yaml"
    policy.write_text(f"version: 1\nmode: ask\nask_timeout: 60\nallow: ['{up.host}']\n")
    return policy


async def test_a_dismissed_permission_dialog_refuses_at_once(
    tmp_path: Path, dns: DnsServer, up: EchoHTTPServer
) -> None:
    """The user closes the dialog (outcome `cancelled`): a refusal now, not a wait of ask_timeout
    (60 s here) reported as "nobody answered"."""
    client = EditorClient()
    client.answer = "cancelled"
    servers = [McpServerStdio(name="fetch", command=FETCH_SERVER[0], args=FETCH_SERVER_UNGUARDED[1:], env=[])]
    audit = tmp_path / "audit.jsonl"
    command = _egressd_acp(_ask_policy(tmp_path, up), dns, audit)
    async with spawn_agent_process(client, command[0], *command[1:], transport_kwargs=STDERR) as (conn, proc):
        session_id = await _session(conn, servers)
        started = asyncio.get_running_loop().time()
        await _prompt(conn, session_id, f"fetch http://up.test:{up.port}/dismissed", timeout=45)
        assert asyncio.get_running_loop().time() - started < 30
        assert f"fetch http://up.test:{up.port}/dismissed -> isError=True" in client.texts()
        assert len(client.permissions) == 1
        assert await _until(lambda: "ask_refused" in client.texts())
    refused = [r for r in audit_records(audit) if r.get("host") == "up.test" and r.get("event") == "decision"]
    assert refused and {r["reason"] for r in refused} == {"ask_refused"}
    assert "dismissed" in refused[0]["detail"]
    assert up.requests == []


def _requested(call: Any) -> str:
    """What a permission dialog asks about: its title up to who asks."""
    title = str(call.title)
    return title.removeprefix("egressd: allow a connection to ").split(" (asked by ", 1)[0].removesuffix("?")


async def test_each_path_is_its_own_permission_dialog(
    tmp_path: Path, dns: DnsServer, up: EchoHTTPServer
) -> None:
    """Three parallel requests (a client-run terminal) to one host: three dialogs, each titled with
    its own path; allowing GET /public releases /public only."""
    client = EditorClient()
    paths = ("/public", "/admin/delete", "/secrets/upload")
    client.answer = lambda call: "allow_once" if _requested(call).endswith("/public") else "reject_once"
    command = _egressd_acp(_ask_policy(tmp_path, up), dns, tmp_path / "audit.jsonl")
    curl = "curl -sS -o /dev/null -w"
    fetches = " & ".join(
        f"{curl} '%{{http_code}} {path}\\n' http://up.test:{up.port}{path}" for path in paths
    )
    async with spawn_agent_process(client, command[0], *command[1:], transport_kwargs=STDERR) as (conn, proc):
        session_id = await _session(conn, [])
        await _prompt(conn, session_id, f"terminal sh -c {shlex.quote(fetches + ' & wait')}")
        terminal = next(t for _, t in client.updates if t.startswith("terminal exit="))
    asked = sorted(_requested(call) for _, call, _ in client.permissions)
    assert asked == sorted(f"GET http://up.test:{up.port}{path}" for path in paths)
    expected = ["200 /public", "403 /admin/delete", "403 /secrets/upload"]
    assert sorted(terminal.splitlines()[1:]) == sorted(expected), terminal
    assert [r["path"] for r in up.requests] == ["/public"]
