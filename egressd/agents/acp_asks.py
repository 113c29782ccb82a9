"""`mode: ask` under `egressd acp`: the editor's permission UI answers egressd's asks.

Why: the user is in the editor, not at egressd's terminal (an editor starts egressd with no
terminal at all). So the ACP bridge joins the ask broker as one more approver: each question
becomes a `session/request_permission` request to the editor, and the option the user picks is the
broker's answer — the same answers the control API gives, `always` writing the policy file as
`egressd approve --always` does. A question answered elsewhere (the control API, the terminal)
or expired is withdrawn from the editor's side; a late answer from the editor is swallowed.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from egressd.admission.asks import Answerer
from egressd.admission.state import asker
from egressd.agents.acp import CANCELLED, AcpBridge

# ACP's permission option kinds -> the ask broker's answers. A dismissed dialog (`cancelled`) is a
# refusal, at once: the person saw the question and did not allow it (waiting for ask_timeout
# would hold the agent for a minute and then blame nobody).
ANSWERS = {
    "allow_once": "once",
    "allow_always": "always",
    "reject_once": "deny",
    "reject_always": "deny-always",
    CANCELLED: "deny",
}
# when the broker cannot write the policy (no policy file): the nearest answer it can give
FALLBACK = {"always": "run", "deny-always": "deny"}


def describe(ask: dict[str, Any]) -> str:
    """What the editor shows: the request, and who asks."""
    host, port = ask.get("host"), ask.get("port")
    where = f"[{host}]:{port}" if ":" in str(host) else f"{host}:{port}"
    if ask.get("method") and ask.get("path"):
        where = f"{ask['method']} {ask.get('scheme') or 'http'}://{where}{ask['path']}"
    command = " ".join(str(word) for word in ask.get("command") or [])
    who = ask.get("asker") or asker(ask.get("client"), ask.get("profile"))
    return where + (f" (asked by {command}, {who})" if command else "")


def attach(broker: Answerer, bridge: AcpBridge, warn: Callable[[str], None]) -> Callable[[], None]:
    """Make the editor an approver of `broker`; returns the function that detaches it."""

    def ask_editor(ask: dict[str, Any]) -> None:
        ask_id = str(ask.get("id"))
        option = bridge.request_permission(describe(ask), float(ask.get("expires_in") or 60), key=ask_id)
        if option not in ANSWERS:
            return  # no answer, or answered elsewhere: the broker decides (timeout)
        answer = ANSWERS[option]
        if answer not in (ask.get("answers") or ()):
            answer = FALLBACK.get(answer, answer)
        by = "the editor (ACP), its dialog dismissed" if option == CANCELLED else "the editor (ACP)"
        try:
            broker.answer(ask_id, answer, by=by)
        except Exception as exc:  # noqa: BLE001 - answered elsewhere meanwhile, or the file could not be written
            warn(f"the editor's answer to {describe(ask)} was not applied: {exc}")

    def listener(kind: str, ask: dict[str, Any]) -> None:
        # called on the proxy's thread: never wait here
        if kind == "ask":
            threading.Thread(target=ask_editor, args=(ask,), name="egressd-acp-ask", daemon=True).start()
        elif kind in ("answered", "expired", "withdrawn"):
            bridge.withdraw(str(ask.get("id")))

    return broker.attach(listener, approver=lambda: bridge.current_session is not None)
