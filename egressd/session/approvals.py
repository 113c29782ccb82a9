"""Ask mode in a session: the ask broker the pipeline awaits, the terminal that answers it, and the
edits of the policy file an "always" answer or the dashboard makes (applied by the reload, like any
edit of the file)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from egressd.session.options import SessionOptions
from egressd.session.snapshot import PolicySource

if TYPE_CHECKING:
    from egressd.admission.asks import AskBroker
    from egressd.control.prompt import TtyPrompter
    from egressd.session.proxy import ProxyServer


class Approvals:
    """The broker is the pipeline's approver; the terminal prompt is one of its approvers.

    The prompt keeps a thread of its own: a terminal's writes block while it is stopped (Ctrl-S, a
    background job's SIGTTOU) and a tty cannot be watched by every platform's loop (kqueue on
    macOS), and neither may ever hold up the proxy's loop."""

    def __init__(
        self,
        proxy: ProxyServer,
        options: SessionOptions,
        policy_file: PolicySource,
        command: Sequence[str],
        say: Callable[[str], None],
    ) -> None:
        from egressd.admission.asks import AskBroker

        self.policy_file = policy_file
        self.broker: AskBroker = AskBroker(
            proxy.grants,
            timeout=lambda: proxy.policy.ask_timeout,
            command=command,
            write_rule=self.write_rule if policy_file.writable else None,
            approve_all=options.approve_all,
            events=proxy.events,
        )
        proxy.approver = self.broker
        if options.approve_all:
            say(
                "WARNING: --approve-all: every ask is approved without asking anyone; the child may "
                "reach any host the policy would have asked about"
            )
        self.prompter: TtyPrompter | None = None
        if options.prompt and not options.approve_all:
            from egressd.control.prompt import TtyPrompter

            self.prompter = TtyPrompter.open(self.broker)

    def start(self) -> None:
        if self.prompter is not None:
            self.prompter.start()

    def stop(self) -> None:
        if self.prompter is not None:
            self.prompter.stop()

    def write_rule(self, which: str, rule: str) -> str:
        from egressd.tools.policy_edit import add_rule

        assert self.policy_file.path is not None
        done = add_rule(self.policy_file.path, which, rule)
        self.policy_file.trigger()  # the reload applies it like any edit (and reports a failure)
        return done

    def edit_policy(self, op: str, which: str, rule: str) -> str:
        """The dashboard's add/remove of an allow/deny rule: the same file edit as an "always"
        answer (validated, atomic), serialised with it, then applied by the reload."""
        from egressd.tools.policy_edit import edit_rule

        assert self.policy_file.path is not None
        with self.broker.write_lock:
            done = edit_rule(self.policy_file.path, which, rule, remove=op == "remove")
        self.policy_file.trigger()  # the reload applies it like any edit (and reports a failure)
        return done
