"""A small real ACP agent (agent-client-protocol SDK) for `egressd acp` tests.

Why: `egressd acp` must keep what an agent launches under its policy, so this agent does what real
ones do: it starts the stdio MCP servers of `session/new` with exactly the `env` it was given (the
MCP SDK adds only HOME, PATH and the like: without egressd's rewrite, no proxy at all), calls their
tools, and asks its client to run terminals with an explicit env of its own. Each prompt is a list
of commands, one per line; results come back as agent message chunks:

    servers              the MCP servers it got: name, type, and the proxy URL in their env
    fetch URL            the `fetch` tool of the first stdio MCP server
    terminal CMD ARG...  a client-run terminal; its exit status and output
    write N              one agent message chunk of N bytes (framing of big messages)

Run: ``python tests/support/acp_agent.py``. Logs go to stderr.
"""

from __future__ import annotations

import asyncio
import contextlib
import shlex
import sys
from typing import Any

from acp import PROTOCOL_VERSION, run_agent, text_block, update_agent_message
from acp.schema import EnvVariable, InitializeResponse, NewSessionResponse, PromptResponse
from mcp import ClientSession
from mcp.client.stdio import StdioServerParameters, stdio_client


def log(message: str) -> None:
    print(f"acp-agent: {message}", file=sys.stderr, flush=True)


def _dump(server: Any) -> dict[str, Any]:
    return server.model_dump(by_alias=True) if hasattr(server, "model_dump") else dict(server)


class McpWorker:
    """One stdio MCP server, kept open by its own task (anyio scopes stay in the task that opened them)."""

    def __init__(self, server: dict[str, Any]) -> None:
        self.server = server
        self.requests: asyncio.Queue[tuple[str, dict[str, Any], asyncio.Future[str]]] = asyncio.Queue()
        self.task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        env = {item["name"]: item["value"] for item in self.server.get("env") or []}
        params = StdioServerParameters(
            command=self.server["command"], args=self.server.get("args") or [], env=env
        )
        try:
            async with stdio_client(params) as (read, write), ClientSession(read, write) as session:
                await session.initialize()
                while True:
                    tool, arguments, answer = await self.requests.get()
                    try:
                        result = await session.call_tool(tool, arguments)
                        text = "\n".join(getattr(c, "text", "") for c in result.content)
                        answer.set_result(f"isError={result.is_error}\n{text}")
                    except Exception as exc:  # noqa: BLE001 - reported to the client
                        answer.set_result(f"isError=True\nexception: {exc!r}")
        except Exception as exc:  # noqa: BLE001
            log(f"MCP server {self.server.get('name')} failed: {exc!r}")
            while not self.requests.empty():
                self.requests.get_nowait()[2].set_result(f"isError=True\nserver failed: {exc!r}")

    async def call(self, tool: str, arguments: dict[str, Any]) -> str:
        answer: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        await self.requests.put((tool, arguments, answer))
        return await asyncio.wait_for(answer, 60)


class TestAgent:
    def __init__(self) -> None:
        self.conn: Any = None
        self.sessions: dict[str, list[dict[str, Any]]] = {}
        self.workers: dict[str, list[McpWorker]] = {}

    def on_connect(self, conn: Any) -> None:
        self.conn = conn

    async def initialize(self, protocol_version: int, **kwargs: Any) -> InitializeResponse:
        return InitializeResponse(protocol_version=PROTOCOL_VERSION)

    async def new_session(
        self, cwd: str, mcp_servers: list[Any] | None = None, **kwargs: Any
    ) -> NewSessionResponse:
        session_id = f"s{len(self.sessions) + 1}"
        servers = [_dump(s) for s in mcp_servers or []]
        self.sessions[session_id] = servers
        self.workers[session_id] = [McpWorker(s) for s in servers if "command" in s]
        return NewSessionResponse(session_id=session_id)

    async def authenticate(self, method_id: str, **kwargs: Any) -> None:
        return None

    async def cancel(self, session_id: str, **kwargs: Any) -> None:
        return None

    async def say(self, session_id: str, text: str) -> None:
        await self.conn.session_update(session_id, update_agent_message(text_block(text)))

    async def prompt(self, session_id: str, prompt: list[Any], **kwargs: Any) -> PromptResponse:
        text = "\n".join(getattr(block, "text", "") for block in prompt)
        for line in text.splitlines():
            words = shlex.split(line)
            if not words:
                continue
            try:
                await self.say(session_id, await self.run(session_id, words))
            except Exception as exc:  # noqa: BLE001 - reported to the client
                await self.say(session_id, f"{words[0]}: failed: {exc!r}")
        return PromptResponse(stop_reason="end_turn")

    async def run(self, session_id: str, words: list[str]) -> str:
        verb, args = words[0], words[1:]
        if verb == "servers":
            lines = []
            for server in self.sessions[session_id]:
                env = {item["name"]: item["value"] for item in server.get("env") or []}
                line = (
                    f"{server.get('name')} type={server.get('type', 'stdio')} proxy={env.get('HTTP_PROXY')}"
                )
                # a secret's variable (tests/e2e/test_acp.py): a placeholder, never a value
                if "UPKEY" in env:
                    line += f" UPKEY={env['UPKEY']}"
                lines.append(line)
            return "servers:\n" + "\n".join(lines)
        if verb == "fetch":
            worker = self.workers[session_id][0]
            return f"fetch {args[0]} -> " + await worker.call("fetch", {"url": args[0], "max_length": 2000})
        if verb == "terminal":
            # an explicit env that would send the terminal around egressd, were it not rewritten
            env = [
                EnvVariable(name="HTTP_PROXY", value="http://127.0.0.1:9"),
                EnvVariable(name="NO_PROXY", value="*"),
            ]
            created = await self.conn.create_terminal(
                session_id=session_id, command=args[0], args=args[1:], env=env
            )
            exit_status = await self.conn.wait_for_terminal_exit(
                session_id=session_id, terminal_id=created.terminal_id
            )
            output = await self.conn.terminal_output(session_id=session_id, terminal_id=created.terminal_id)
            await self.conn.release_terminal(session_id=session_id, terminal_id=created.terminal_id)
            return f"terminal exit={exit_status.exit_code}\n{output.output}"
        if verb == "write":
            return "x" * int(args[0])
        return f"unknown command {verb!r}"


async def main() -> None:
    agent = TestAgent()
    try:
        await run_agent(agent)
    finally:
        for workers in agent.workers.values():
            for worker in workers:
                worker.task.cancel()
                with contextlib.suppress(BaseException):
                    await worker.task


if __name__ == "__main__":
    asyncio.run(main())
