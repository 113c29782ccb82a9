"""`egressd run`: a long-running proxy that prints the settings a child needs."""

from __future__ import annotations

import os
import shlex
import signal
import sys
import threading
from collections.abc import Sequence

import click

from egressd.child import process
from egressd.cli.options import dashboard_option, gateway_options, open_session, say, session_options
from egressd.session import ProxySession, SessionOptions

DRAIN_TIMEOUT = 10.0


@click.command(
    "run",
    short_help="Run the proxy in the foreground; print the proxy settings for children.",
    epilog="""\b
Example:
  egressd run --policy policy.yaml > egressd.env &
  . ./egressd.env && npm install
  kill -HUP %1     # reload policy.yaml now, reopen the --audit file (edits and rotation are
                   # also picked up by themselves)
  kill %1          # drain: in-flight connections get 10 s, then egressd exits

\b
As a gateway for other machines (containers; docs/gateway.md):
  egressd gateway token add agent1 > agent1.token
  egressd run --gateway --listen 0.0.0.0:3128 --policy policy.yaml""",
)
@gateway_options
@session_options
@dashboard_option
def run_command(options: SessionOptions) -> None:
    """Run the proxy until SIGTERM/SIGINT; print the `export` lines a child needs.

    stdout gets only the export lines (then is closed, so `$(...)` and pipes see EOF); status
    goes to stderr. With --gateway it serves other machines instead, each client with its own
    token (`egressd gateway token add`), and prints nothing on stdout. The policy file is
    reloaded when it changes and on SIGHUP; a file that fails to load is reported and the last
    good policy stays in force. SIGHUP also reopens the --audit file (log rotation).
    """
    stops = (signal.SIGINT, signal.SIGTERM)
    catcher = process.SignalCatcher((*stops, signal.SIGHUP)).install()
    with open_session(options, announce_reloads=True) as session:
        if options.gateway is not None:
            _announce_gateway(session)
        else:
            _announce_exports(session, options)
        assert session.proxy is not None
        _serve(catcher, session, stops)
        if session.failure is None:  # else open_session says why and exits
            say(f"draining (up to {DRAIN_TIMEOUT:g}s for open connections)")
            _drain(session, catcher, stops)
    say("stopped")
    sys.exit(0)


def _announce_exports(session: ProxySession, options: SessionOptions) -> None:
    """The export lines a child needs on stdout (then closed), where egressd listens on stderr."""
    for key, value in session.exports().items():
        click.echo(f"export {key}={shlex.quote(value)}")
    _close_stdout()
    assert session.proxy is not None
    host, port = session.proxy.http_address
    where = f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"
    socks_note = f", SOCKS5 on port {session.proxy.socks_address[1]}" if session.proxy.socks_address else ""
    profile = options.overrides.profile
    profile_note = f"; profile: {profile}" if profile else ""
    policy = session.policy
    click.echo(
        f"# egressd listening on {where}{socks_note}; policy: {policy.source} (mode: {policy.mode})"
        f"{profile_note}. SIGHUP reloads; SIGTERM or Ctrl-C drains and exits.",
        err=True,
    )


def _announce_gateway(session: ProxySession) -> None:
    """The gateway prints no credentials (its clients have their own tokens): stdout gets nothing
    and is closed; stderr says where it listens."""
    _close_stdout()
    assert session.proxy is not None and session.gateway is not None and session.options.gateway is not None
    host, port = session.proxy.http_address
    scheme = "https" if session.options.gateway.tls is not None else "http"
    where = f"{scheme}://[{host}]:{port}" if ":" in host else f"{scheme}://{host}:{port}"
    socks = session.proxy.socks_address
    socks_note = f", SOCKS5 on {socks[0]}:{socks[1]}" if socks else ""
    sources = session.options.gateway.allow_from
    from_note = f"; clients from {', '.join(sources)} only" if sources else ""
    policy = session.policy
    click.echo(
        f"# egressd gateway listening on {where}{socks_note}; policy: {policy.source} (mode: "
        f"{policy.mode}); {len(session.gateway.names())} clients in {session.options.gateway.tokens}"
        f"{from_note}. SIGHUP reloads; SIGTERM or Ctrl-C drains and exits.",
        err=True,
    )


def _close_stdout() -> None:
    """After the exports, stdout is done: point fd 1 at /dev/null so readers see EOF."""
    sys.stdout.flush()
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)


def _serve(catcher: process.SignalCatcher, session: ProxySession, stops: Sequence[int]) -> None:
    while True:
        got = catcher.wait(1.0)
        if got is None:
            if session.failure is not None:  # a service it was asked for could not start
                return
            continue
        if got.signo in stops:
            return
        reopened = session.reopen_audit()  # logrotate's postrotate: the audit file was moved
        if not session.reload_now() and not reopened:
            say("SIGHUP: no --policy file to reload")


def _drain(session: ProxySession, catcher: process.SignalCatcher, stops: Sequence[int]) -> None:
    """drain() in a thread so a second SIGTERM/Ctrl-C can still cut it short: the session's close
    then stops the services and the proxy, open connections and all."""
    worker = threading.Thread(target=session.drain, args=(DRAIN_TIMEOUT,), name="egressd-drain", daemon=True)
    worker.start()
    while worker.is_alive():
        got = catcher.wait(0.2)
        if got is not None and got.signo in stops:
            say("second signal: stopping now")
            return
