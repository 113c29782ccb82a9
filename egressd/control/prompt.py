"""The terminal approver: asks shown and answered on /dev/tty, never on the child's stdio.

An MCP or ACP child speaks JSON-RPC on its stdin/stdout, so egressd must not write a prompt there
nor read an answer from there; the controlling terminal (/dev/tty) is the user's, whichever way the
child's stdio goes. One question at a time, in the order they came; one line answers it (a key,
then Enter: the terminal stays in the mode the user and the child left it). A question answered
elsewhere (the control API, a dashboard) or expired is withdrawn from the terminal.

The asks come from an `Answerer`: egressd's own ask broker, or every running egressd followed
over the control API (`egressd pending --interactive`, for agents run without a terminal).
"""

from __future__ import annotations

import contextlib
import os
import select
import shlex
import threading
from typing import TYPE_CHECKING, Any

from egressd.admission.asks import Answerer, AskError

if TYPE_CHECKING:
    import queue

KEYS = {"o": "once", "r": "run", "a": "always", "d": "deny", "D": "deny-always"}
TTY = "/dev/tty"


def printable(value: object) -> str:
    """Text from the child (a path, a program's name) shown on the user's terminal: no escape
    sequences."""
    return "".join(c if c.isprintable() else f"\\x{ord(c):02x}" for c in str(value))


class TtyPrompter:
    """Prompts on the controlling terminal; `open` answers None when there is none."""

    def __init__(self, broker: Answerer, fd: int, by: str = "the terminal") -> None:
        import queue  # here: without a terminal (a CI job, a service) no prompter is made

        self.broker = broker
        self.fd = fd
        self.by = by  # who answered, as the audit and the other surfaces say
        self._queue: queue.Queue[dict[str, Any]] = queue.Queue()
        self._ended: set[str] = set()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._detach: Any = None
        self._thread = threading.Thread(target=self._run, name="egressd-prompt", daemon=True)

    @classmethod
    def open(cls, broker: Answerer, path: str = TTY, by: str = "the terminal") -> TtyPrompter | None:
        try:
            fd = os.open(path, os.O_RDWR | os.O_NOCTTY | os.O_CLOEXEC)
        except OSError:
            return None  # no controlling terminal (a service, CI, a detached session)
        if not os.isatty(fd):
            os.close(fd)
            return None
        return cls(broker, fd, by)

    def foreground(self) -> bool:
        """egressd's process group owns the terminal now. A background egressd (`egressd run &`)
        must neither read it (SIGTTIN would stop the proxy) nor count as someone who can answer."""
        try:
            return os.tcgetpgrp(self.fd) == os.getpgrp()
        except OSError:
            return False

    def start(self) -> TtyPrompter:
        self._detach = self.broker.attach(self._heard, approver=self.foreground)
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._detach is not None:
            self._detach()
        self._stop.set()
        self._thread.join(timeout=2)
        with contextlib.suppress(OSError):
            os.close(self.fd)

    def _heard(self, kind: str, info: dict[str, Any]) -> None:
        if kind == "ask":
            self._queue.put(info)
        elif kind != "waiting":  # the question is over (a change of its count is not)
            with self._lock:
                self._ended.add(str(info["id"]))

    def _over(self, ask_id: str) -> bool:
        with self._lock:
            return ask_id in self._ended

    def _say(self, text: str) -> None:
        with contextlib.suppress(OSError):
            os.write(self.fd, text.encode("utf-8", "replace"))

    def _run(self) -> None:
        import queue

        while not self._stop.is_set():
            try:
                info = self._queue.get(timeout=0.2)
            except queue.Empty:
                continue
            while not self._stop.is_set() and not self._over(str(info["id"])) and not self.foreground():
                self._stop.wait(0.2)  # in the background: the control API answers, or egressd comes back
            if not self._stop.is_set() and not self._over(str(info["id"])):
                self._prompt(info)

    def _prompt(self, info: dict[str, Any]) -> None:
        ask_id = str(info["id"])
        self._say(self._question(info))
        while not self._stop.is_set():
            if self._over(ask_id):
                self._say("egressd:   (answered elsewhere or expired)\n")
                return
            ready, _, _ = select.select([self.fd], [], [], 0.2)
            if not ready or not self.foreground():
                continue
            try:
                line = os.read(self.fd, 1024).decode("utf-8", "replace").strip()
            except OSError:
                return
            kind = KEYS.get(line[:1]) if line else None
            if kind is None or (kind in ("always", "deny-always") and kind not in info["answers"]):
                self._say(f"egressd:   {self._keys(info)}\n")
                continue
            try:
                self.broker.answer(ask_id, kind, by=self.by)
            except AskError as exc:
                self._say(f"egressd:   {exc}\n")
                if exc.status == 404:
                    return
                continue
            self._say(f"egressd:   {kind}\n")
            return

    def _question(self, info: dict[str, Any]) -> str:
        host, port = printable(info["host"]), info["port"]
        what = f"{host}:{port}"
        if info.get("method") and info.get("path"):
            scheme = info.get("scheme") if info.get("scheme") in ("http", "https") else None
            url = f"{scheme}://{what}{printable(info['path'])}" if scheme else printable(info["path"])
            what += f" ({printable(info['method'])} {url})"
        # the program that asked, when egressd looked it up; else the command egressd runs
        first = (info.get("requests") or [{}])[0]
        command = shlex.join(first.get("cmdline") or info.get("command") or []) or "the child"
        waiting = f"{info['waiting']} waiting, " if int(info.get("waiting", 1)) > 1 else ""
        return (
            f"\negressd: ask {info['id']}: {printable(command)} wants {what}"
            f" [{waiting}refused in {info['expires_in']:g}s]\n"
            f"egressd:   {self._keys(info)}\n"
        )

    def _keys(self, info: dict[str, Any]) -> str:
        keys = ["o = allow once", "r = allow for this run"]
        if "always" in info["answers"]:
            keys.append("a = always (added to the policy file)")
        keys.append("d = deny")
        if "deny-always" in info["answers"]:
            keys.append("D = deny always")
        return ", ".join(keys) + "; then Enter"
