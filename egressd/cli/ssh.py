"""`egressd ssh` and the hidden `egressd remote-agent`: thin click commands over egressd.remote.

`egressd ssh` takes every `exec` option (it shares the decorators and passes them through
unchanged).
"""

from __future__ import annotations

import contextlib
import shlex
import shutil
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import click

from egressd.child import process
from egressd.cli.options import CONTEXT, fail, open_session, parse_listen, say, session_options
from egressd.policy import join_host_port
from egressd.remote.destination import DestinationError, parse_destination
from egressd.remote.sshargs import SshCommand, SshOptionError, check_ssh_option

if TYPE_CHECKING:
    from egressd.policy import Policy
    from egressd.remote.connection import SshConnection
    from egressd.session import SessionOptions

SSH_PROGRAM = "ssh"


def _remote_say(message: str) -> None:
    """stderr on the remote is the SSH session's: once SSH dropped, writing there fails."""
    with contextlib.suppress(OSError, ValueError):
        click.echo(f"egressd (remote): {message}", err=True)


@click.command(
    "ssh",
    context_settings=CONTEXT,
    short_help="Run a command on a remote host over SSH under this machine's policy.",
    epilog="""\b
Examples:
  egressd ssh --policy npm build-box -- npm ci
  egressd ssh --allow api.example.com --ssh-option Port=2222 dev@10.0.0.5 -- python agent.py
  egressd ssh --egress remote ssh://ci@runner:2222 -- pip install -r requirements.txt

\b
Relay (default): the command's traffic comes back through the SSH connection and leaves from
this machine; the remote needs no egressd and no internet access. --egress remote: egressd on
the remote host enforces this machine's policy (pushed at connect and on every change) and the
traffic leaves from there.""",
)
@session_options
@click.option(
    "--ssh-option",
    "ssh_options",
    multiple=True,
    metavar="OPT",
    help="Pass `-o OPT` to ssh (repeatable), e.g. Port=2222, IdentityFile=~/.ssh/id_ed25519, RequestTTY=yes.",
)
@click.option(
    "--egress",
    type=click.Choice(["client", "remote"]),
    default="client",
    show_default=True,
    help="Where the traffic leaves: this machine (relay) or the remote host (egressd runs there).",
)
@click.option(
    "--remote-egressd",
    default="egressd",
    show_default=True,
    metavar="COMMAND",
    help="How to run egressd on the remote host with --egress remote (e.g. '~/.venv/bin/egressd').",
)
@click.option(
    "--client-loopback",
    is_flag=True,
    help="Relay mode: let the remote command reach THIS machine's loopback and own addresses "
    "(closed by default).",
)
@click.option(
    "--sandbox",
    is_flag=True,
    help="With --egress remote: run CMD in egressd's sandbox (bubblewrap) on the remote, whose only "
    "way out is the remote egressd's proxy.",
)
@click.option(
    "--rw",
    multiple=True,
    metavar="PATH",
    help="With --sandbox: this remote path is writable in the sandbox (repeatable; the remote "
    "home is masked there, as in `egressd sandbox`).",
)
@click.option(
    "--show",
    multiple=True,
    metavar="PATH",
    help="With --sandbox: let the command read this remote path in the masked home, or a "
    "credential hidden by default (repeatable; quote a leading ~ so the remote expands it).",
)
@click.option(
    "--hide",
    multiple=True,
    metavar="PATH",
    help="With --sandbox: also hide this remote path (repeatable).",
)
@click.argument("destination")
@click.argument("command", nargs=-1, required=True, type=click.UNPROCESSED, metavar="-- CMD [ARGS]...")
def ssh_command(
    destination: str,
    command: tuple[str, ...],
    ssh_options: tuple[str, ...],
    egress: str,
    remote_egressd: str,
    client_loopback: bool,
    sandbox: bool,
    rw: tuple[str, ...],
    show: tuple[str, ...],
    hide: tuple[str, ...],
    options: SessionOptions,
) -> None:
    """Run CMD on DESTINATION ([user@]host or ssh://[user@]host[:port]) under this machine's policy.

    Uses the system OpenSSH client, so ~/.ssh/config, keys and agents work as usual. Stdio, exit
    status and signals pass through as with `exec`; if SSH drops, egressd says so and exits 255.
    """
    try:
        dest = parse_destination(destination)
        ssh_args = tuple(check_ssh_option(o) for o in ssh_options)
    except (DestinationError, SshOptionError) as exc:
        raise click.BadParameter(str(exc)) from None
    if client_loopback and egress == "remote":
        raise click.BadParameter("--client-loopback is for relay mode (the remote's loopback is its own)")
    if sandbox and egress != "remote":
        raise click.BadParameter(
            "--sandbox runs CMD in egressd's sandbox on the remote host: it needs --egress remote "
            "(in relay mode no egressd runs there)"
        )
    for name, given in (("--rw", rw), ("--show", show), ("--hide", hide)):
        if given and not sandbox:
            raise click.BadParameter(f"{name} is for --sandbox")
    if shutil.which(SSH_PROGRAM) is None:
        fail("egressd ssh needs the OpenSSH client (`ssh`) on PATH")
    # Before any thread starts: every thread must inherit the blocked signal mask.
    catcher = process.child_signal_catcher().install()

    from egressd.remote.connection import SshConnection
    from egressd.remote.lifecycle import run_over_ssh
    from egressd.remote.spawn import Spawner

    def connection() -> SshConnection:
        return SshConnection(
            str(dest),
            lambda path: SshCommand(dest, path, ssh_args, SSH_PROGRAM),
            Spawner(catcher.original_mask),
        )

    if egress == "client":
        from egressd.remote.relay_mode import Relay, relay_policy

        def transform(policy: Policy) -> Policy:
            return relay_policy(policy, client_loopback=client_loopback)

        with open_session(
            options, announce_reloads=options.trace, transform=transform, command=command
        ) as session:
            returncode = run_over_ssh(lambda c: Relay(session, c, say), connection(), command, catcher, say)
        process.exit_like(returncode)

    returncode = _remote_egress(
        dest_name=str(dest),
        egressd=remote_egressd,
        options=options,
        command=command,
        catcher=catcher,
        connection=connection,
        sandbox=_sandbox_options(rw=rw, show=show, hide=hide) if sandbox else (),
    )
    process.exit_like(returncode)


def _sandbox_options(**paths: tuple[str, ...]) -> tuple[str, ...]:
    """`remote-agent run` options for --sandbox and its paths (remote paths, passed as given)."""
    given = [arg for name, values in paths.items() for path in values for arg in (f"--{name}", path)]
    return ("--sandbox", *given)


def _remote_egress(
    *,
    dest_name: str,
    egressd: str,
    options: SessionOptions,
    command: tuple[str, ...],
    catcher: process.SignalCatcher,
    connection: Callable[[], SshConnection],
    sandbox: tuple[str, ...] = (),
) -> int:
    from egressd.remote.lifecycle import run_over_ssh
    from egressd.remote.push import AuditFile, LocalPolicy
    from egressd.remote.remote_egress import RemoteEgress
    from egressd.session import SessionError

    try:
        words = shlex.split(egressd)
    except ValueError as exc:
        fail(f"--remote-egressd {egressd!r}: {exc}")
    if not words:
        fail("--remote-egressd: empty command")

    def reload_failed(message: str) -> None:
        say(f"reload failed: {' '.join(message.split())}; keeping the last good policy (here and remotely)")

    try:
        local = LocalPolicy(options.policy_file, options.overrides, reload_failed)
    except SessionError as exc:
        fail(str(exc))
    audit = None
    if options.audit_path:
        try:
            audit = AuditFile(options.audit_path, dest_name)
        except OSError as exc:
            fail(f"--audit {options.audit_path}: {exc.strerror or exc}")
    files: dict[str, bytes] = {}  # copied into the remote session directory for the agent
    for index, path in enumerate(options.upstream_ca):
        try:
            files[f"upstream-ca-{index}.pem"] = Path(path).read_bytes()
        except OSError as exc:
            fail(f"--upstream-ca {path}: {exc.strerror or exc}")
    agent: list[str] = []
    if options.overrides.profile:
        agent += ["--profile", options.overrides.profile]
    host, port = options.listen
    # the ports the command connects to, bound and held by the session's guard (reaper.py); in the
    # sandbox the command reaches the proxy through listeners made inside it instead
    listen = [{"name": "http", "host": host, "port": port}, {"name": "socks", "host": host, "port": 0}]
    if sandbox and (host, port) != ("127.0.0.1", 0):
        agent += ["--listen", join_host_port(host, port)]
    if options.trace:
        agent.append("--trace")
    if not options.inspect:
        agent.append("--no-inspect")
    if audit is not None:
        agent.append("--audit-channel")
    agent += sandbox
    return run_over_ssh(
        lambda c: RemoteEgress(
            c,
            local,
            words,
            agent,
            listen=() if sandbox else listen,
            say=say,
            announce=options.trace,
            audit=audit,
            files=files,
        ),
        connection(),
        command,
        catcher,
        say,
    )


@click.group("remote-agent", hidden=True, context_settings=CONTEXT)
def remote_agent() -> None:
    """The remote end of `egressd ssh --egress remote` (started by it; not for direct use)."""


@remote_agent.command("run")
@click.option("--channel", "channel_path", required=True, metavar="SOCKET", help="The policy channel.")
@click.option("--profile", metavar="NAME")
@click.option("--listen", default="127.0.0.1:0", show_default=True, metavar="HOST:PORT")
@click.option("--trace", is_flag=True)
@click.option("--audit-channel", is_flag=True, help="Send the audit records to the client.")
@click.option("--no-inspect", is_flag=True, help="Never intercept TLS.")
@click.option("--upstream-ca", multiple=True, metavar="FILE", help="Also trust this CA for upstreams.")
@click.option("--sandbox", is_flag=True, help="Run COMMAND in the sandbox (bubblewrap).")
@click.option("--rw", multiple=True, metavar="PATH", help="With --sandbox: writable in the sandbox.")
@click.option("--show", multiple=True, metavar="PATH", help="With --sandbox: shown in the masked home.")
@click.option("--hide", multiple=True, metavar="PATH", help="With --sandbox: also hidden.")
@click.option("--policy", "policy_file", hidden=True)
@click.argument("command", nargs=-1, required=True, type=click.UNPROCESSED)
def agent_run(
    channel_path: str,
    profile: str | None,
    listen: str,
    trace: bool,
    audit_channel: bool,
    no_inspect: bool,
    upstream_ca: tuple[str, ...],
    sandbox: bool,
    rw: tuple[str, ...],
    show: tuple[str, ...],
    hide: tuple[str, ...],
    policy_file: str | None,
    command: tuple[str, ...],
) -> None:
    """Run COMMAND under the policies the client pushes over the channel."""
    if policy_file is not None:
        fail(
            "remote-agent takes its policy from the SSH connection only (egressd ssh --egress remote "
            "pushes the client's); --policy is refused here"
        )
    address = parse_listen(listen)
    catcher = process.child_signal_catcher().install()
    from egressd.remote.agent import Agent, AgentError, SandboxPlan, inherited_sockets
    from egressd.remote.channel import LineChannel

    sockets = inherited_sockets()

    plan = None
    if sandbox:
        try:
            plan = SandboxPlan.prepare(rw, show, hide)
        except AgentError as exc:  # before the channel: the client hears it and nothing runs
            _remote_say(str(exc))
            sys.exit(2)

    try:
        channel = LineChannel.connect(channel_path)
    except OSError as exc:
        _remote_say(f"cannot reach the policy channel {channel_path}: {exc.strerror or exc}")
        sys.exit(2)
    agent = Agent(
        channel,
        profile=profile,
        listen=address,
        trace=trace,
        audit_to_client=audit_channel,
        say=_remote_say,
        inspect=not no_inspect,
        upstream_ca=upstream_ca,
        sandbox=plan,
        sockets=sockets,
    )
    try:
        returncode = agent.run(command, catcher)
    except AgentError as exc:
        _remote_say(str(exc))
        returncode = 2
    finally:
        channel.close()
    process.exit_like(returncode)


@remote_agent.command("guard", context_settings=CONTEXT)
@click.argument("directory")
@click.argument("command", nargs=-1, required=True, type=click.UNPROCESSED)
def agent_guard(directory: str, command: tuple[str, ...]) -> None:
    """Run COMMAND (the agent) under the session's guard: the ports it serves stay held, and all
    it starts is ended, whenever it or the SSH session ends (egressd/remote/reaper.py)."""
    from egressd.remote import reaper

    reaper.guard(directory, list(command))


@remote_agent.command("feed")
@click.option("--socket", "socket_path", required=True, metavar="PATH")
def agent_feed(socket_path: str) -> None:
    """Relay policies from this session's stdin to the agent (and its answers back)."""
    from egressd.remote.feeder import run_feeder

    sys.exit(run_feeder(socket_path))
