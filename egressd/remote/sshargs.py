"""The ssh command lines egressd runs: one control master, then multiplexed clients.

Pure functions of the destination, the control socket and the user's `--ssh-option` values, so
they are golden-tested. Option order matters: for `-o` OpenSSH keeps the FIRST value it sees
(command line before ~/.ssh/config), so the options egressd depends on come first, the user's
next, and egressd's mere defaults last (the user's value and their config file beat those).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from egressd.remote.destination import Destination

# The master must stay our child in the foreground (no fork, no persistence) and must treat a
# failed forward as fatal.
MASTER_FORCED: tuple[str, ...] = (
    "ControlMaster=yes",
    "ControlPersist=no",
    "ExitOnForwardFailure=yes",
)
# No forward of the user's config (LocalForward, RemoteForward, DynamicForward): every ssh that
# reads one — the master and each multiplexed client, which asks the master to open the forwards
# its own config names — clears them. Only the client that opens egressd's relay forward cannot
# (the option clears the command line's -R too): it reads no config file at all (`-F none`).
NO_FORWARDS = "ClearAllForwardings=yes"
# Forwardings that hand the remote authority on THIS machine (the ssh agent's keys, the X
# display, a network tunnel): off for the master and every multiplexed client (a mux client's own
# config decides what its session requests), as flags and options placed before anything a
# config file says: ssh keeps the first value it obtains.
NO_AUTHORITY_FLAGS: tuple[str, ...] = ("-a", "-x")
NO_AUTHORITY: tuple[str, ...] = (
    "ForwardAgent=no",
    "ForwardX11=no",
    "ForwardX11Trusted=no",
    "Tunnel=no",
)
# --ssh-option names refused unless their value is off
AUTHORITY_OPTIONS: frozenset[str] = frozenset(option.split("=", 1)[0].lower() for option in NO_AUTHORITY)
_OFF = frozenset({"no", "false"})
# Defaults a user may override: notice a dead link within a minute, do not hang on connecting.
MASTER_DEFAULTS: tuple[str, ...] = (
    "ServerAliveInterval=15",
    "ServerAliveCountMax=4",
    "ConnectTimeout=30",
)
# Options egressd sets itself; a --ssh-option naming one is refused rather than silently ignored.
MANAGED_OPTIONS: frozenset[str] = frozenset(
    {
        "controlmaster",
        "controlpath",
        "controlpersist",
        "exitonforwardfailure",
        "clearallforwardings",
        "forkafterauthentication",
        "sessiontype",
        "stdinnull",
        "localforward",
        "remoteforward",
        "dynamicforward",
    }
)


class SshOptionError(ValueError):
    """A --ssh-option value egressd cannot pass on."""


def option_name(option: str) -> str:
    """`Port=2222` / `Port 2222` → `port` (ssh option names are case-insensitive)."""
    for sep in ("=", " ", "\t"):
        if sep in option:
            return option.split(sep, 1)[0].strip().lower()
    return option.strip().lower()


def check_ssh_option(option: str) -> str:
    """Validate one --ssh-option (`Key=Value`); return it unchanged."""
    name = option_name(option)
    if not name or option.startswith("-") or ("=" not in option and " " not in option.strip()):
        raise SshOptionError(f"{option!r}: expected KEY=VALUE, e.g. Port=2222 or IdentityFile=~/.ssh/id")
    if any(ch in option for ch in "\r\n\0"):
        raise SshOptionError(f"{option!r}: contains a line break or NUL")
    if name in AUTHORITY_OPTIONS and _value(option).lower() not in _OFF:
        raise SshOptionError(
            f"{option!r}: egressd ssh never forwards the ssh agent, X11 or a tunnel: they would give "
            "the remote command authority on this machine that no policy decides (ForwardAgent, "
            "ForwardX11, ForwardX11Trusted and Tunnel are always off)"
        )
    if name in MANAGED_OPTIONS:
        raise SshOptionError(
            f"{option!r}: egressd ssh manages {option.split('=', 1)[0].strip()} itself "
            "(one control master per run, no other forwards)"
        )
    return option


def _value(option: str) -> str:
    """`Key=Value` / `Key Value` → `Value` (stripped)."""
    value = option.replace("=", " ", 1).split(None, 1)[1:] or [""]
    return value[0].strip()


def requests_tty(options: Sequence[str]) -> bool:
    """The user asked for a pseudo-terminal (`RequestTTY=yes|force`), as with `ssh -t`."""
    for option in options:
        if option_name(option) == "requesttty":
            return _value(option).lower() in {"yes", "force"}
    return False


def _opts(values: Sequence[str]) -> list[str]:
    return [arg for value in values for arg in ("-o", value)]


@dataclass(frozen=True)
class SshCommand:
    """Command lines for one connection to `destination` through the socket `control_path`."""

    destination: Destination
    control_path: str
    options: tuple[str, ...] = ()
    program: str = "ssh"

    def _tail(self, *after: str) -> list[str]:
        return [*self.destination.port_args, "--", self.destination.target, *after]

    def _mux(self) -> list[str]:
        # -S first: for ControlPath too the first value wins.
        return [
            self.program,
            "-S",
            self.control_path,
            "-o",
            "ControlMaster=no",
            "-o",
            NO_FORWARDS,
            *NO_AUTHORITY_FLAGS,
            *_opts(NO_AUTHORITY),
        ]

    def master(self) -> list[str]:
        """The control master: authenticates, then only carries forwards and sessions (-N)."""
        return [
            self.program,
            "-n",
            "-N",
            "-S",
            self.control_path,
            *NO_AUTHORITY_FLAGS,
            *_opts(MASTER_FORCED),
            "-o",
            NO_FORWARDS,
            *_opts(NO_AUTHORITY),
            *_opts(self.options),
            *_opts(MASTER_DEFAULTS),
            *self._tail(),
        ]

    def control(self, operation: str, *extra: str) -> list[str]:
        """`ssh -O check|forward|exit` against the running master."""
        return [*self._mux(), "-O", operation, *extra, *self._tail()]

    def check(self) -> list[str]:
        return self.control("check")

    def forward_sockets(self, forwards: Sequence[tuple[str, str, int]]) -> list[str]:
        """Reverse forwards from Unix sockets on the remote (paths) to (host, port) here.

        No config file is read (`-F none`): the master would open every forward it names.
        """
        specs = []
        for path, host, port in forwards:
            if ":" in path or any(ch.isspace() for ch in path):
                raise ValueError(f"a forward's socket path must not hold ':' or whitespace: {path!r}")
            target = f"[{host}]" if ":" in host else host
            specs += ["-R", f"{path}:{target}:{port}"]
        mux = [self.program, "-F", "none", "-S", self.control_path, "-o", "ControlMaster=no"]
        return [*mux, "-O", "forward", *specs, *self._tail()]

    def exit(self) -> list[str]:
        return self.control("exit")

    def helper(self, remote_command: str) -> list[str]:
        """A short command of egressd's own on the remote: never a tty, no escape character."""
        return [*self._mux(), "-T", "-e", "none", "-o", "LogLevel=ERROR", *self._tail(remote_command)]

    def session(self, remote_command: str) -> list[str]:
        """The user's command. No pty (like `ssh host cmd`) unless --ssh-option RequestTTY=yes."""
        tty = [] if any(option_name(o) == "requesttty" for o in self.options) else ["-T", "-e", "none"]
        return [*self._mux(), *tty, *_opts(self.options), *self._tail(remote_command)]
