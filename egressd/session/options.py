"""What a session is asked to run: the command line's options, handed over as one value."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from egressd.session.overrides import Overrides

if TYPE_CHECKING:
    from egressd.session.gateway_options import GatewayOptions


class SessionError(Exception):
    """The session cannot start (bad policy, audit file, proxy); the message says why."""


@dataclass(frozen=True)
class SessionOptions:
    """What a command's options ask of its session (the proxy, its files, its services)."""

    policy_file: str | None = None
    overrides: Overrides = Overrides()
    listen: tuple[str, int] = ("127.0.0.1", 0)
    audit_path: str | None = None
    trace: bool = False
    socks: bool = True
    inspect: bool = True  # TLS inspection where a rule needs it; --no-inspect turns it off
    upstream_ca: tuple[str, ...] = ()
    config_dir: Path | None = None  # egressd's config dir (the CA); None = EGRESSD_HOME or ~/.config
    metrics: tuple[str, int] | None = None  # --metrics HOST:PORT (checked by the CLI)
    metrics_token_file: str | None = None  # --metrics answers only `Authorization: Bearer` its token
    report: bool = False  # the refusal lines and summary on stderr (the CLI's default; --quiet: off)
    approve_all: bool = False  # --approve-all: every ask approved at once (explicit only, loud)
    prompt: bool = True  # ask on /dev/tty when there is one; --no-prompt: the control API only
    control: bool = True  # serve the control API on the user's Unix socket
    dashboard: bool = False  # --dashboard: serve the web dashboard on loopback (needs the control API)
    passthrough: bool = False  # --passthrough / EGRESSD_PASSTHROUGH=1: the child runs without egressd
    gateway: GatewayOptions | None = None  # run --gateway: token-named clients, any listen address
    # --identify: look up every connection's program (pid, exe) for the audit; None: the command's default
    identify: bool | None = None
