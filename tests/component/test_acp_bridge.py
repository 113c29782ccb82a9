"""The ACP rules and the JSON-RPC relay on their own: spellings, framing, what the agent may write.

The agent is the adversary: every way it can spell `terminal/create` so that a client reads it and
egressd does not must still get egressd's environment; the relay must pass bytes it does not
rewrite exactly, survive partial reads and malformed lines, and never write anything but JSON-RPC.
"""

from __future__ import annotations

import json
import os
import threading
from typing import Any

from egressd.agents.acp import AcpBridge, merge_env_list
from egressd.agents.jsonrpc import Writer, parse, pump
from egressd.agents.mcp_run import McpBridge
from egressd.policy import Decision, make_target

OURS = {"HTTP_PROXY": "http://egressd:tok@127.0.0.1:5000", "NO_PROXY": ""}


def _decide(host: str, port: int, profile: str | None, scheme: str, path: str) -> Decision:
    allowed = host == "ok.test"
    reason = "allowlist" if allowed else "not_allowlisted"
    return Decision(allowed, reason, None, make_target(host, port), detail=f"{host} decided")


def _bridge(
    sink: Writer, agent_profile: str | None = None, profiles: frozenset[str] = frozenset()
) -> AcpBridge:
    asked: list[str | None] = []

    def server_env(profile: str | None) -> dict[str, str]:
        asked.append(profile)
        return {**OURS, "X_PROFILE": str(profile)}

    bridge = AcpBridge(
        sink,
        server_env=server_env,
        terminal_env=lambda: dict(OURS),
        decide=_decide,
        agent_profile=agent_profile,
        profiles=lambda: profiles,
        warn=lambda _m: None,
    )
    return bridge


class _Collect:
    """A Writer stand-in that keeps what was written."""

    def __init__(self) -> None:
        self.data = b""
        self.broken = False

    def write(self, data: bytes) -> bool:
        self.data += data
        return True


def _from_agent(bridge: AcpBridge, line: bytes) -> Any:
    out = bridge.from_agent(line, parse(line))
    return [json.loads(x) for x in out.splitlines() if x.strip()]


def _terminal_env(message: Any) -> dict[str, str]:
    return {e["name"]: e["value"] for e in message["params"]["env"]}


def test_terminal_create_gets_egressd_env_in_every_spelling() -> None:
    bridge = _bridge(_Collect())  # type: ignore[arg-type]
    env = '[{"name":"HTTP_PROXY","value":"http://evil:1"},{"name":"no_proxy","value":"*"},{"name":"A","value":"1"}]'
    spellings = [
        '{"jsonrpc":"2.0","id":5,"method":"terminal/create","params":{"sessionId":"s","command":"sh","env":%s}}',
        '{"jsonrpc":"2.0","id":5,"method":"terminal\\/create","params":{"sessionId":"s","command":"sh","env":%s}}',
        '{"jsonrpc":"2.0","id":5,"method":"\\u0074erminal/create","params":{"sessionId":"s","command":"sh","env":%s}}',
        # a first-key-wins parser reads terminal/create: egressd re-encodes what it read
        '{"jsonrpc":"2.0","id":5,"method":"terminal/create","method":"x","params":{"command":"sh","env":%s}}',
    ]
    for spelling in spellings:
        line = (spelling % env).encode() + b"\n"
        (message,) = _from_agent(bridge, line)
        if message["method"] == "x":  # the duplicate: one method only is left, the one judged
            assert line.count(b'"method"') == 2
            continue
        got = _terminal_env(message)
        assert got["HTTP_PROXY"] == OURS["HTTP_PROXY"] and got["NO_PROXY"] == "" and got["A"] == "1"
        assert "no_proxy" not in got
    batch = (b'[{"jsonrpc":"2.0","id":1,"method":"terminal/create","params":{"command":"sh"}}]') + b"\n"
    (messages,) = _from_agent(bridge, batch)
    assert _terminal_env(messages[0]) == OURS
    for odd in (b'{"id":1,"method":"terminal/create","params":["sh"]}\n', b'{"method":"terminal/create"}\n'):
        assert bridge.from_agent(odd, parse(odd)) == b""
    odd_batch = b'[{"id":1,"method":"terminal/create"},{"id":2,"method":"x"}]\n'
    assert json.loads(bridge.from_agent(odd_batch, parse(odd_batch))) == [{"id": 2, "method": "x"}]


def test_duplicate_keys_are_reencoded_so_the_client_reads_what_egressd_judged() -> None:
    bridge = _bridge(_Collect())  # type: ignore[arg-type]
    line = b'{"jsonrpc":"2.0","method":"session/update","method":"terminal/create","id":1,"params":{}}\n'
    out = bridge.from_agent(line, parse(line))
    assert out.count(b'"method"') == 1
    assert _terminal_env(json.loads(out)) == OURS


def test_session_new_merges_env_and_removes_refused_remote_servers() -> None:
    sink = _Collect()
    bridge = _bridge(sink, profiles=frozenset({"fetch"}))  # type: ignore[arg-type]
    request = {
        "jsonrpc": "2.0",
        "id": 7,
        "method": "session/new",
        "params": {
            "cwd": "/",
            "mcpServers": [
                {"name": "fetch", "command": "f", "args": [], "env": [{"name": "HTTPS_PROXY", "value": "x"}]},
                {"name": "other", "command": "o", "args": []},
                {"type": "http", "name": "bad", "url": "https://evil.test/mcp", "headers": []},
                {"type": "sse", "name": "good", "url": "https://ok.test/sse", "headers": []},
                {"type": "http", "name": "weird", "url": "ftp://ok.test/", "headers": []},
            ],
        },
    }
    line = json.dumps(request).encode() + b"\n"
    forwarded = json.loads(bridge.from_client(line, parse(line)))
    servers = {s["name"]: s for s in forwarded["params"]["mcpServers"]}
    assert set(servers) == {"fetch", "other", "good"}
    fetch_env = {e["name"]: e["value"] for e in servers["fetch"]["env"]}
    assert fetch_env["X_PROFILE"] == "fetch"  # its own profile: the agent runs with the whole policy
    assert "HTTPS_PROXY" not in fetch_env and fetch_env["HTTP_PROXY"] == OURS["HTTP_PROXY"]
    assert {e["name"]: e["value"] for e in servers["other"]["env"]}["X_PROFILE"] == "None"
    # the notices follow the agent's answer, in the session it created
    answer = b'{"jsonrpc":"2.0","id":7,"result":{"sessionId":"abc"}}\n'
    out = bridge.from_agent(answer, parse(answer))
    assert out.startswith(answer)
    notices = [json.loads(x) for x in out[len(answer) :].splitlines()]
    assert [n["params"]["sessionId"] for n in notices] == ["abc", "abc"]
    texts = " ".join(n["params"]["update"]["content"]["text"] for n in notices)
    assert (
        "'bad'" in texts and "not_allowlisted" in texts and "'weird'" in texts and "invalid_target" in texts
    )


def test_a_narrowed_agent_never_hands_out_a_server_profile() -> None:
    bridge = _bridge(_Collect(), agent_profile="agent", profiles=frozenset({"fetch"}))  # type: ignore[arg-type]
    line = b'{"id":1,"method":"session/load","params":{"sessionId":"s",'
    line += b'"mcpServers":[{"name":"fetch","command":"f"}]}}\n'
    forwarded = json.loads(bridge.from_client(line, parse(line)))
    env = {e["name"]: e["value"] for e in forwarded["params"]["mcpServers"][0]["env"]}
    assert env["X_PROFILE"] == "None"  # None = the agent's own profile


def test_untouched_lines_pass_byte_for_byte() -> None:
    bridge = _bridge(_Collect())  # type: ignore[arg-type]
    for line in [
        b'{ "jsonrpc" : "2.0", "id":1, "result" : {"x": "\\u00e9"} }\r\n',
        b"garbage that is not json\n",
        b"\xff\xfe\n",
        b"[]\n",
        b'"just a string"\n',
        b'{"jsonrpc":"2.0","id":9}',  # no terminator (the last line)
    ]:
        assert bridge.from_agent(line, parse(line)) == line
        assert bridge.from_client(line, parse(line)) == line


def test_merge_env_list_drops_what_egressd_controls() -> None:
    given = [
        {"name": "http_proxy", "value": "a"},
        {"name": "npm_config_proxy", "value": "b"},
        {"name": "EGRESSD_TOKEN", "value": "c"},
        {"name": "SSL_CERT_FILE", "value": "d"},
        {"name": 5, "value": "e"},
        "junk",
        {"name": "KEEP", "value": "f"},
    ]
    assert merge_env_list(given, OURS) == [{"name": "KEEP", "value": "f"}] + [
        {"name": k, "value": v} for k, v in OURS.items()
    ]


def _relay(chunks: list[bytes], strict: bool, handler: Any = None, max_line: int = 1 << 20) -> bytes:
    """Run pump between two pipes, writing `chunks` one by one (partial reads)."""
    src_r, src_w = os.pipe()
    dst_r, dst_w = os.pipe()
    sink = Writer(dst_w)
    thread = threading.Thread(
        target=pump,
        args=(src_r, sink, handler or (lambda line, _m: line)),
        kwargs={"strict": strict, "name": "t", "max_line": max_line},
    )
    thread.start()
    out = bytearray()
    reader = threading.Thread(target=lambda: out.extend(_read_all(dst_r)))
    reader.start()
    for chunk in chunks:
        os.write(src_w, chunk)
    os.close(src_w)
    thread.join(10)
    sink.close()
    reader.join(10)
    os.close(src_r)
    return bytes(out)


def _read_all(fd: int) -> bytes:
    data = b""
    while chunk := os.read(fd, 65536):
        data += chunk
    os.close(fd)
    return data


def test_pump_partial_reads_and_long_lines() -> None:
    stream = b'{"a":1}\n' + b"x" * 5000 + b"\n" + b'{"b":2}'
    one_byte = [stream[i : i + 1] for i in range(len(stream))]
    assert _relay(one_byte, strict=True) == stream
    # over max_line: the lenient direction forwards it raw, the strict one drops it, both go on
    long = b"y" * 3000 + b"\n"
    assert _relay([long, b"ok\n"], strict=False, max_line=1000) == long + b"ok\n"
    assert _relay([long, b"ok\n"], strict=True, max_line=1000) == b"ok\n"


def test_pump_survives_a_failing_handler() -> None:
    def boom(line: bytes, _m: Any) -> bytes:
        if b"boom" in line:
            raise RuntimeError("bug")
        return line

    assert _relay([b"boom\n", b"fine\n"], strict=False, handler=boom) == b"boom\nfine\n"
    assert _relay([b"boom\n", b"fine\n"], strict=True, handler=boom) == b"fine\n"


def test_egressd_own_requests_are_answered_by_the_client_only() -> None:
    sink = _Collect()
    bridge = _bridge(sink)  # type: ignore[arg-type]
    prompt = b'{"jsonrpc":"2.0","id":1,"method":"session/prompt","params":{"sessionId":"s1","prompt":[]}}\n'
    bridge.from_client(prompt, parse(prompt))
    answers: list[str | None] = []
    asking = threading.Thread(target=lambda: answers.append(bridge.request_permission("evil.test:443", 10)))
    asking.start()
    for _ in range(200):
        if sink.data:
            break
        threading.Event().wait(0.01)
    request = json.loads(sink.data)
    assert request["method"] == "session/request_permission" and request["params"]["sessionId"] == "s1"
    kinds = [o["kind"] for o in request["params"]["options"]]
    assert kinds == ["allow_once", "allow_always", "reject_once", "reject_always"]
    # a response with an id egressd never used passes to the agent; the real one is consumed
    forged = (
        b'{"jsonrpc":"2.0","id":"egressd-0-1","result":{"outcome":{"outcome":"selected","optionId":"x"}}}\n'
    )
    assert bridge.from_client(forged, parse(forged)) == forged
    response = {
        "jsonrpc": "2.0",
        "id": request["id"],
        "result": {"outcome": {"outcome": "selected", "optionId": "allow_always"}},
    }
    line = json.dumps(response).encode() + b"\n"
    assert bridge.from_client(line, parse(line)) == b""
    asking.join(10)
    assert answers == ["allow_always"]
    bridge.close()


def test_mcp_bridge_annotates_only_failed_tool_calls() -> None:
    from egressd.admission.events import Decided

    bridge = McpBridge()
    call = b'{"jsonrpc":"2.0","id":3,"method":"tools/call","params":{"name":"fetch"}}\n'
    assert bridge.from_client(call, parse(call)) == call
    refused = Decided(None, "fetch", "fetch", "request", "evil.test", 80, False, "not_allowlisted", None, "d")
    bridge.observe(refused)
    ok = b'{"jsonrpc":"2.0","id":4,"result":{"isError":true,"content":[]}}\n'  # not a tracked call
    assert bridge.from_server(ok, parse(ok)) == ok
    failed = b'{"jsonrpc":"2.0","id":3,"result":{"isError":true,"content":[{"type":"text","text":"403"}]}}\n'
    out = json.loads(bridge.from_server(failed, parse(failed)))
    assert "not_allowlisted" in out["result"]["content"][-1]["text"]


def test_refusal_notices_are_bounded_per_turn() -> None:
    """A child refused everywhere must not flood the editor: NOTICES_PER_TURN, then one line."""
    from egressd.admission.events import Decided
    from egressd.agents.acp import NOTICES_PER_TURN

    sink = _Collect()
    bridge = _bridge(sink)  # type: ignore[arg-type]
    prompt = b'{"jsonrpc":"2.0","id":1,"method":"session/prompt","params":{"sessionId":"s1","prompt":[]}}\n'
    bridge.from_client(prompt, parse(prompt))
    for i in range(100):
        host, refused = f"h{i}.test", "not_allowlisted"
        bridge.observe(Decided(None, "egressd", None, "connect", host, 443, False, refused, None, "d"))
    bridge.close()  # the notifier tells what was queued before, then stops
    bridge._notifier.join(10)
    lines = [json.loads(line) for line in sink.data.splitlines()]
    assert len(lines) == NOTICES_PER_TURN + 1
    assert "not shown" in lines[-1]["params"]["update"]["content"]["text"]


class _FakeBroker:
    """The interface of egressd.admission.asks.AskBroker that the ACP bridge uses."""

    def __init__(self) -> None:
        self.listener: Any = None
        self.approver: Any = None
        self.answers: list[tuple[str, str]] = []
        self.answered = threading.Event()

    def attach(self, listener: Any, *, approver: Any) -> Any:
        self.listener, self.approver = listener, approver
        return lambda: None

    def answer(self, ask_id: str, kind: str, *, by: str = "api") -> dict[str, object]:
        self.answers.append((ask_id, kind))
        self.answered.set()
        return {}


def _wait_for(predicate: Any, timeout: float = 10) -> bool:
    for _ in range(int(timeout / 0.01)):
        if predicate():
            return True
        threading.Event().wait(0.01)
    return predicate()


def test_asks_become_permission_requests_and_the_option_is_the_answer() -> None:
    from egressd.agents import acp_asks

    sink = _Collect()
    bridge = _bridge(sink)  # type: ignore[arg-type]
    broker = _FakeBroker()
    acp_asks.attach(broker, bridge, lambda _m: None)  # type: ignore[arg-type]
    assert not broker.approver()  # no session yet: the editor cannot be asked
    prompt = b'{"jsonrpc":"2.0","id":1,"method":"session/prompt","params":{"sessionId":"s1","prompt":[]}}\n'
    bridge.from_client(prompt, parse(prompt))
    assert broker.approver()
    cases = [
        ("allow_once", ["once", "run", "always", "deny", "deny-always"], "once"),
        ("allow_always", ["once", "run", "always", "deny", "deny-always"], "always"),
        ("allow_always", ["once", "run", "deny"], "run"),  # no policy file to write
        ("reject_once", ["once", "run", "deny"], "deny"),
        ("reject_always", ["once", "run", "always", "deny", "deny-always"], "deny-always"),
    ]
    for number, (option, answers, expected) in enumerate(cases):
        sink.data = b""
        broker.answered.clear()
        ask = {"id": f"a{number}", "host": "evil.test", "port": 443, "answers": answers, "expires_in": 30}
        broker.listener("ask", {**ask, "command": ["agent"], "client": "egressd"})
        assert _wait_for(lambda: sink.data)
        request = json.loads(sink.data)
        assert "evil.test:443" in request["params"]["toolCall"]["title"]
        reply = {"jsonrpc": "2.0", "id": request["id"], "result": {"outcome": {"outcome": "selected"}}}
        reply["result"]["outcome"]["optionId"] = option
        line = json.dumps(reply).encode() + b"\n"
        assert bridge.from_client(line, parse(line)) == b""
        assert broker.answered.wait(10)
        assert broker.answers[-1] == (f"a{number}", expected)
    # answered elsewhere: the editor's question is withdrawn, its late answer swallowed, no answer
    sink.data = b""
    count = len(broker.answers)
    broker.listener(
        "ask", {"id": "late", "host": "x.test", "port": 80, "answers": ["once"], "expires_in": 30}
    )
    assert _wait_for(lambda: sink.data)
    request = json.loads(sink.data)
    broker.listener("answered", {"id": "late"})
    assert _wait_for(lambda: not bridge._asks)  # egressd stopped waiting for the editor
    reply = {"jsonrpc": "2.0", "id": request["id"], "result": {"outcome": {"outcome": "cancelled"}}}
    line = json.dumps(reply).encode() + b"\n"
    assert bridge.from_client(line, parse(line)) == b""
    assert len(broker.answers) == count
    bridge.close()
