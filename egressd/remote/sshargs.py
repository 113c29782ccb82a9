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
_MANAGED: tuple[str, ...] = (
    "ControlMaster",
    "ControlPath",
    "ControlPersist",
    "ExitOnForwardFailure",
    "ClearAllForwardings",
    "ForkAfterAuthentication",
    "SessionType",
    "StdinNull",
    "LocalForward",
    "RemoteForward",
    "DynamicForward",
)
MANAGED_OPTIONS: dict[str, str] = {name.lower(): name for name in _MANAGED}

# How OpenSSH splits a configuration line, which each `-o` value is read as
_WHITESPACE = " \t\r\n"


class SshOptionError(ValueError):
    """A --ssh-option value egressd cannot pass on."""


def _strdelim(text: str) -> tuple[str | None, str | None]:
    """(token, rest) as OpenSSH's strdelim(): a token ends at whitespace or one `=`; a `"` anywhere
    in it is dropped and the token then runs to the next `"` (None: no closing quote)."""
    cut = next((i for i, ch in enumerate(text) if ch in _WHITESPACE + '"='), None)
    if cut is None:
        return text, None
    if text[cut] == '"':
        text = text[:cut] + text[cut + 1 :]
        end = text.find('"', cut)
        if end < 0:
            return None, None
        return text[:end], text[end + 1 :].lstrip(_WHITESPACE)
    token, rest = text[:cut], text[cut + 1 :].lstrip(_WHITESPACE)
    if text[cut] != "=" and rest.startswith("="):
        rest = rest[1:].lstrip(_WHITESPACE)
    return token, rest


def _argv_split(text: str) -> list[str] | None:
    """The arguments after the keyword, as OpenSSH's argv_split() reads them (quotes, escapes,
    a `#` that starts a word ends the line); None for an unclosed quote (ssh refuses the line)."""
    words: list[str] = []
    i = 0
    while i < len(text):
        if text[i] in " \t":
            i += 1
            continue
        if text[i] == "#":
            break
        word: list[str] = []
        quote = ""
        while i < len(text):
            ch = text[i]
            if (
                ch == "\\"
                and i + 1 < len(text)
                and (text[i + 1] in "'\"\\" or (not quote and text[i + 1] == " "))
            ):
                i += 1
                word.append(text[i])
            elif not quote and ch in " \t":
                break
            elif not quote and ch in "\"'":
                quote = ch
            elif quote and ch == quote:
                quote = ""
            else:
                word.append(ch)
            i += 1
        if quote:
            return None
        words.append("".join(word))
    return words


def parse_option(option: str) -> tuple[str, list[str]] | None:
    """(keyword in lower case, arguments) as ssh reads `-o OPTION`; None for a line ssh ignores
    (empty, a comment, an unclosed quote in the keyword) or refuses (no argument, bad quotes).

    The same spelling must mean the same option here as there: `"RemoteForward" x`, `Remote"Forward" x`,
    `remoteforward=x` and ` RemoteForward = x` are all RemoteForward to ssh.
    """
    line = option
    while len(line) > 1 and line[-1] in _WHITESPACE + "\f":
        line = line[:-1]
    keyword, rest = _strdelim(line)
    if keyword == "" and rest is not None:
        keyword, rest = _strdelim(rest)
    if not keyword or keyword[0] in "\n#":
        return None
    rest = (rest or "").lstrip(_WHITESPACE)
    args = _argv_split(rest) if rest else None
    if not args:
        return None
    return keyword.lower(), args


def option_name(option: str) -> str:
    """`Port=2222` / `"Port" 2222` → `port` (what ssh reads; "" for a line it ignores or refuses)."""
    parsed = parse_option(option)
    return parsed[0] if parsed is not None else ""


def check_ssh_option(option: str) -> str:
    """Validate one --ssh-option (`Key=Value`); return it unchanged."""
    if any(ch in option for ch in "\r\n\0"):
        raise SshOptionError(f"{option!r}: contains a line break or NUL")
    parsed = parse_option(option)
    if parsed is None or option.startswith("-"):
        raise SshOptionError(f"{option!r}: expected KEY=VALUE, e.g. Port=2222 or IdentityFile=~/.ssh/id")
    name, args = parsed
    if name in AUTHORITY_OPTIONS and args[0].lower() not in _OFF:
        raise SshOptionError(
            f"{option!r}: egressd ssh never forwards the ssh agent, X11 or a tunnel: they would give "
            "the remote command authority on this machine that no policy decides (ForwardAgent, "
            "ForwardX11, ForwardX11Trusted and Tunnel are always off)"
        )
    if name in MANAGED_OPTIONS:
        raise SshOptionError(
            f"{option!r}: egressd ssh manages {MANAGED_OPTIONS[name]} itself "
            "(one control master per run, no other forwards)"
        )
    return option


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
