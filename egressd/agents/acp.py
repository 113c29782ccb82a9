"""The ACP rules of `egressd acp`: what egressd rewrites between an editor and its agent.

Why: an ACP client (Zed, an IDE plug-in) hands the agent MCP servers to launch, possibly with an
explicit `env` that would drop egressd's proxy variables; it runs terminals the agent asks for in
its own process, outside egressd; and it is where the user is. So egressd (1) merges the proxy
variables into every stdio MCP server's `env` and decides http/sse servers up front, removing a
refused one with a notice the user sees; (2) adds the proxy variables to every `terminal/create`;
(3) tells the user, in the session, what egressd refused and why; (4) asks the user, with the
editor's own permission UI, when the policy is in `mode: ask`. Everything else passes byte for
byte (egressd.agents.jsonrpc).
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import queue
import secrets
import threading
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from egressd.admission.events import Decided, Event
from egressd.agents.jsonrpc import Message, Writer, encode
from egressd.child.env import CA_BUNDLE_VARS, NO_PROXY_VARS, PROXY_VARS, SOCKS_VAR, stripped_variable
from egressd.policy import Decision
from egressd.policy.reasons import Reason
from egressd.policy.refusal import HintContext, Refusal
from egressd.wire.refusal import notice

logger = logging.getLogger(__name__)

# requests whose params carry `mcpServers` (new and load are stable; fork and resume unstable)
MCP_SESSION_METHODS = frozenset({"session/new", "session/load", "session/fork", "session/resume"})
NOTICES_PER_TURN = 20  # refusal notices per prompt; a child refused everywhere must not flood the editor
QUEUED = 1000  # refusals waiting for the notifier (beyond: dropped, the audit has them)
CONTROLLED = frozenset(
    name.lower() for name in (*PROXY_VARS, *NO_PROXY_VARS, *CA_BUNDLE_VARS, SOCKS_VAR, "NODE_USE_ENV_PROXY")
)

# (host, port, profile, scheme, path) -> the proxy's own decision (Decider.decide)
DecideFn = Callable[[str, int, str | None, str, str], Decision]
# profile wanted (None: the agent's own) -> proxy variables for a process the agent launches
EnvFn = Callable[[str | None], dict[str, str]]


def controlled(name: object) -> bool:
    """A variable egressd sets or removes in a child's environment (compared case-insensitively)."""
    return not isinstance(name, str) or name.lower() in CONTROLLED or stripped_variable(name)


def merge_env_list(entries: object, ours: Mapping[str, str]) -> list[Any]:
    """ACP's `env` list ([{name, value}]) with egressd's variables last and none of the ones it
    controls left from the sender (a client's HTTP_PROXY must not win over egressd's)."""
    kept = (
        [e for e in entries if isinstance(e, dict) and not controlled(e.get("name"))]
        if isinstance(entries, list)
        else []
    )
    return kept + [{"name": name, "value": value} for name, value in ours.items()]


def _url_target(url: object) -> tuple[str, int, str, str] | None:
    """(host, port, scheme, path) of an http(s) URL, or None when it is not one."""
    if not isinstance(url, str):
        return None
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError:
        return None
    scheme = parts.scheme.lower()
    if scheme not in ("http", "https") or not parts.hostname:
        return None
    return parts.hostname, port or (443 if scheme == "https" else 80), scheme, parts.path or "/"


def event_notice(event: Decided, context: HintContext) -> str:
    """The notice of one refused (or failed) decision, naming the request where it was one."""
    refusal = event.refusal(context)
    what = refusal.target
    if event.method and event.path:
        what = f"{event.method} {event.scheme or 'http'}://{refusal.target}{event.path}"
    return notice(refusal, what)


@dataclass
class _Pending:
    method: str
    session_id: object
    notices: list[str] = field(default_factory=list)


@dataclass
class _PermissionRequest:
    """One session/request_permission egressd sent the editor for an ask, awaiting the option chosen."""

    done: threading.Event = field(default_factory=threading.Event)
    option: str | None = None


class AcpBridge:
    """The rewriting of one `egressd acp` run; its two handlers are given to jsonrpc.pump."""

    def __init__(
        self,
        to_client: Writer,
        *,
        server_env: EnvFn,
        terminal_env: Callable[[], dict[str, str]],
        decide: DecideFn,
        agent_profile: str | None,
        profiles: Callable[[], frozenset[str]],
        warn: Callable[[str], None],
        context: HintContext | None = None,
    ) -> None:
        self.to_client = to_client
        self.context = context or HintContext("acp")  # where its notices' hints are read
        self.server_env = server_env
        self.terminal_env = terminal_env
        self.decide = decide
        self.agent_profile = agent_profile
        self.profiles = profiles
        self.warn = warn
        self._lock = threading.Lock()
        self._pending: dict[str, _Pending] = {}  # client request id (JSON) -> notices after its answer
        self._asks: dict[str, _PermissionRequest] = {}  # egressd's own request id -> the waiting ask
        self._by_key: dict[str, str] = {}  # the ask broker's id -> egressd's request id
        self._retired: deque[str] = deque(maxlen=256)  # requests no longer waited for
        self._ids = itertools.count(1)
        self._prefix = f"egressd-{secrets.token_hex(6)}-"
        # where refusal notices and asks go: the last prompted session (before one: the first created)
        self.current_session: object = None
        self._told: set[tuple[object, str, int | None, str]] = set()
        self._refusals: queue.Queue[Decided | None] = queue.Queue(QUEUED)
        self._notifier = threading.Thread(
            target=self._notify_refusals, name="egressd-acp-notices", daemon=True
        )
        self._notifier.start()

    # -- client -> agent ---------------------------------------------------------------------------
    def from_client(self, line: bytes, message: Message | None) -> bytes:
        if message is None:
            return line
        value = message.value
        if isinstance(value, list):
            changed = [self._client_message(item) for item in value]
            return encode(value, message.terminator) if any(changed) or message.ambiguous else line
        changed = self._client_message(value)
        if changed is None:
            return b""  # an answer to egressd's own request: not the agent's
        return encode(value, message.terminator) if changed or message.ambiguous else line

    def _client_message(self, value: object) -> bool | None:
        """Rewrite one message in place; True when changed, None when egressd consumed it."""
        if not isinstance(value, dict):
            return False
        method = value.get("method")
        params = value.get("params")
        if method is None and isinstance(value.get("id"), str) and value["id"].startswith(self._prefix):
            with self._lock:
                ask = self._asks.pop(value["id"], None)
                late = value["id"] in self._retired  # answered after egressd stopped waiting
            if ask is not None:
                ask.option = _selected_option(value)
                ask.done.set()
            if ask is not None or late:
                return None
        if not isinstance(params, dict):
            return False
        if method == "session/prompt":
            with self._lock:  # a new turn: its refusals are told afresh
                self._told.clear()
                self.current_session = params.get("sessionId")
            return False
        if method in MCP_SESSION_METHODS and isinstance(params.get("mcpServers"), list):
            notices = self._rewrite_servers(params)
            if "id" in value:  # its answer names the session (notices go there, asks too)
                with self._lock:
                    key = json.dumps(value["id"])
                    self._pending[key] = _Pending(str(method), params.get("sessionId"), notices)
            return True
        return False

    def _rewrite_servers(self, params: dict[str, Any]) -> list[str]:
        kept: list[Any] = []
        notices: list[str] = []
        known = self.profiles()
        for server in params["mcpServers"]:
            if not isinstance(server, dict):
                kept.append(server)
                continue
            kind = server.get("type")
            if kind in ("http", "sse"):
                refusal = self._judge_remote(server)
                if refusal is None:
                    kept.append(server)
                    continue
                name = server.get("name")
                notices.append(notice(refusal, f"the MCP server {name!r} ({server.get('url')}); removed"))
                self.warn(f"MCP server {name!r} removed: {refusal.reason}")
                continue
            if kind is None or "command" in server:  # stdio (ACP's stdio entry has no `type`)
                name = server.get("name")
                # a server's own profile only where the agent has the whole policy: otherwise the
                # agent, which reads this env, would gain what that profile allows
                profile = name if self.agent_profile is None and name in known else None
                server["env"] = merge_env_list(server.get("env"), self.server_env(profile))
            kept.append(server)
        params["mcpServers"] = kept
        return notices

    def _judge_remote(self, server: dict[str, Any]) -> Refusal | None:
        target = _url_target(server.get("url"))
        if target is None:
            return Refusal(Reason.INVALID_TARGET, f"not an http(s) URL: {server.get('url')!r}")
        host, port, scheme, path = target
        decision = self.decide(host, port, self.agent_profile, scheme, path)
        if decision.allowed or decision.ask:  # an ask is asked when the agent connects
            return None
        shown = decision.target.host.text if decision.target is not None else host
        return Refusal(
            decision.reason,
            decision.detail,
            shown,
            port,
            decision.rule,
            profile=decision.profile,
            context=self.context,
        )

    # -- agent -> client ---------------------------------------------------------------------------
    def from_agent(self, line: bytes, message: Message | None) -> bytes:
        if message is None:
            return line
        value = message.value
        items = value if isinstance(value, list) else [value]
        changed = False
        after: list[bytes] = []
        for item in list(items):
            if not isinstance(item, dict):
                continue
            if item.get("method") == "terminal/create":
                changed = True
                if isinstance(item.get("params"), dict):
                    params = item["params"]
                    params["env"] = merge_env_list(params.get("env"), self.terminal_env())
                else:  # no params egressd can add to: a client must not run it as it is
                    self.warn("dropped a terminal/create without params")
                    items.remove(item)
            elif "method" not in item and "id" in item:
                after += self._notices_after(item)
        if changed and not items:
            return b"".join(after)
        out = encode(value, message.terminator) if changed or message.ambiguous else line
        return out + b"".join(after)

    def _notices_after(self, response: dict[str, Any]) -> list[bytes]:
        with self._lock:
            pending = self._pending.pop(json.dumps(response["id"]), None)
        if pending is None or not isinstance(response.get("result"), dict):
            return []
        session = response["result"].get("sessionId", pending.session_id)
        if session is None:
            return []
        with self._lock:
            if self.current_session is None:
                self.current_session = session
        return [encode(_update(session, text)) for text in pending.notices]

    # -- what egressd refused, told to the user ----------------------------------------------------
    def observe(self, event: Event) -> None:
        """Pipeline observer (runs on the proxy's thread: only queues)."""
        if isinstance(event, Decided) and not event.allowed:
            with contextlib.suppress(queue.Full):
                self._refusals.put_nowait(event)

    def close(self) -> None:
        self._refusals.put(None)
        with self._lock:
            asks, self._asks = list(self._asks.values()), {}
        for ask in asks:
            ask.done.set()

    def _notify_refusals(self) -> None:
        while (event := self._refusals.get()) is not None:
            with self._lock:
                session = self.current_session
                key = (session, event.host or "", event.port, event.reason)
                if session is None or key in self._told or len(self._told) > NOTICES_PER_TURN:
                    continue
                self._told.add(key)
                last = len(self._told) > NOTICES_PER_TURN
            if last:
                text = "egressd: more refusals in this turn are not shown here; the audit has every one."
                self.to_client.write(encode(_update(session, text)))
                continue
            self.to_client.write(encode(_update(session, event_notice(event, self.context))))

    # -- mode: ask -> session/request_permission --------------------------------------------------
    def request_permission(self, what: str, timeout: float, key: str = "") -> str | None:
        """Ask the user in the editor; the option chosen (allow_once, allow_always, reject_once,
        reject_always), `cancelled` (the user dismissed the dialog, or the turn was cancelled), or
        None (no session, no answer within `timeout`, withdrawn with `withdraw(key)`)."""
        with self._lock:
            session = self.current_session
            if session is None:
                return None
            request_id = f"{self._prefix}{next(self._ids)}"
            ask = self._asks[request_id] = _PermissionRequest()
            if key:
                self._by_key[key] = request_id
        request = {
            "jsonrpc": "2.0",
            "id": request_id,
            "method": "session/request_permission",
            "params": {
                "sessionId": session,
                "toolCall": {
                    "toolCallId": request_id,
                    "title": f"egressd: allow a connection to {what}?",
                    "kind": "fetch",
                    "status": "pending",
                    "rawInput": {"egressd": "ask", "target": what},
                },
                "options": [
                    {"optionId": "allow_once", "name": "Allow once", "kind": "allow_once"},
                    {"optionId": "allow_always", "name": "Always allow", "kind": "allow_always"},
                    {"optionId": "reject_once", "name": "Refuse", "kind": "reject_once"},
                    {"optionId": "reject_always", "name": "Always refuse", "kind": "reject_always"},
                ],
            },
        }
        if not self.to_client.write(encode(request)):
            return None
        ask.done.wait(timeout)
        with self._lock:
            self._asks.pop(request_id, None)
            self._by_key.pop(key, None)
            self._retired.append(request_id)
        return ask.option

    def withdraw(self, key: str) -> None:
        """The question was answered elsewhere, expired or withdrawn: stop waiting for the editor
        (its late answer is swallowed, never passed to the agent)."""
        with self._lock:
            ask = self._asks.get(self._by_key.get(key, ""))
        if ask is not None:
            ask.done.set()


CANCELLED = "cancelled"  # request_permission's answer when the user dismissed the dialog


def _selected_option(response: dict[str, Any]) -> str | None:
    result = response.get("result")
    outcome = result.get("outcome") if isinstance(result, dict) else None
    if isinstance(outcome, dict) and outcome.get("outcome") == "selected":
        option = outcome.get("optionId")
        return option if isinstance(option, str) else None
    if isinstance(outcome, dict) and outcome.get("outcome") == CANCELLED:
        return CANCELLED
    return None


def _update(session: object, text: str) -> dict[str, Any]:
    """A `session/update` notification showing `text` as an agent message."""
    return {
        "jsonrpc": "2.0",
        "method": "session/update",
        "params": {
            "sessionId": session,
            "update": {"sessionUpdate": "agent_message_chunk", "content": {"type": "text", "text": text}},
        },
    }
