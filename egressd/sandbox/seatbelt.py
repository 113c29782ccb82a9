"""The macOS sandbox: a Seatbelt profile (SBPL) built from the same Layout bubblewrap gets on Linux.

The profile starts from `(deny default)` and allows what a CLI child needs: forking, programs
from the system's, package managers' and the user's directories, signals to its own processes,
reading every file but the hidden ones (the home but for what is shown in it, credentials,
egressd's home, the secrets' sources), writing only where the layout makes it writable, and
TCP connections only to egressd's proxy on the loopback. The layout's hidden paths (credentials,
listed ones that do not exist yet included: Seatbelt needs nothing to lie on; egressd's home) are
neither read nor written; its guarded paths (egressd's code, policy, audit) are never written.
macOS has no private /tmp: the child writes only the run's own temporary directory, never the
host's /tmp or $TMPDIR.

The known trap: `(allow network-outbound (local ip "localhost:*"))` reads like a local-only
allowance, but it matches the connection's LOCAL endpoint, which every outbound connection has,
so it opens outbound traffic to anywhere. This profile never filters network-outbound on the local
endpoint (the tests check it on every profile).

Seatbelt decides an operation by the rules naming it before those naming a wildcard holding it
(`file-write-unlink` before `file-write*`), and among those by the last that matches; each
section allows first and denies after, and no rule here relies on which of the two readings is
Apple's (tests/support/seatbelt_model.py checks the denials under both). Paths
are canonical (the kernel checks the resolved path: /private/tmp, not /tmp); the other spelling of
/tmp, /var and /etc is written too. Pure functions; on macOS `egressd sandbox` runs
`sandbox-exec -p PROFILE -- CMD...`. Not yet run on a Mac: tested as text only (see the README).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

from egressd.sandbox.mounts import order, within
from egressd.sandbox.sbpl import quote

if TYPE_CHECKING:  # preflight imports this module; the Layout's imports are heavy
    from egressd.sandbox.layout import Layout

SANDBOX_EXEC = "/usr/bin/sandbox-exec"

# Where programs may run from, besides the user's home, the layout's paths and the temp dirs.
SYSTEM_PROGRAMS: tuple[str, ...] = (
    "/bin",
    "/sbin",
    "/usr",  # also /usr/local: Homebrew on Intel
    "/System",
    "/Library/Apple",  # Apple's own software outside /System (Rosetta)
    "/Library/Developer/CommandLineTools",  # what /usr/bin/git, cc, make hand over to
    "/opt/homebrew",
    "/opt/local",  # MacPorts
    "/nix",
)
XCODE = r'(regex #"^/Applications/Xcode[^/]*\.app/")'

# What a process may ask the kernel for by name, read only: CPU, memory and OS facts, its own
# process group and pid entries. Never kern.procargs/kern.procargs2 (the argv and ENVIRONMENT of
# every process of the user: egressd's own, with the secrets it took from its environment).
SYSCTL_NAMES: tuple[str, ...] = (
    "hw.activecpu",
    "hw.busfrequency_compat",
    "hw.byteorder",
    "hw.cacheconfig",
    "hw.cachelinesize_compat",
    "hw.cpufamily",
    "hw.cpufrequency",
    "hw.cpufrequency_compat",
    "hw.cputype",
    "hw.l1dcachesize_compat",
    "hw.l1icachesize_compat",
    "hw.l2cachesize_compat",
    "hw.l3cachesize_compat",
    "hw.logicalcpu",
    "hw.logicalcpu_max",
    "hw.machine",
    "hw.memsize",
    "hw.model",
    "hw.ncpu",
    "hw.nperflevels",
    "hw.packages",
    "hw.pagesize",
    "hw.pagesize_compat",
    "hw.physicalcpu",
    "hw.physicalcpu_max",
    "hw.tbfrequency_compat",
    "hw.vectorunit",
    "kern.argmax",
    "kern.boottime",
    "kern.hostname",
    "kern.maxfiles",
    "kern.maxfilesperproc",
    "kern.maxproc",
    "kern.ngroups",
    "kern.osproductversion",
    "kern.osrelease",
    "kern.ostype",
    "kern.osvariant_status",
    "kern.osversion",
    "kern.secure_kernel",
    "kern.usrstack64",
    "kern.version",
    "machdep.cpu.brand_string",
    "machdep.ptrauth_enabled",
    "security.mac.lockdown_mode_state",
    "sysctl.proc_cputype",
    "vm.loadavg",
)
SYSCTL_PREFIXES: tuple[str, ...] = (
    "hw.optional.",  # CPU features
    "hw.perflevel",
    "machdep.cpu.",
    "kern.proc.pid.",  # one process's kinfo_proc (name, ids), not its arguments
    "kern.proc.pgrp.",
    "net.routetable.",  # the interface list (getifaddrs)
)
# Programs that run as root on the user's say-so: a cached sudo ticket would make the child root.
# Their state (/private/var/db/sudo: the tickets) is unreadable too.
PRIVILEGED_PROGRAMS: tuple[str, ...] = (
    "/usr/bin/sudo",
    "/usr/bin/su",
    "/usr/bin/login",
    "/usr/bin/newgrp",
    "/usr/libexec/security_authtrampoline",
)
PRIVILEGED_STATE = "/private/var/db/sudo"
# Where the run's marker lies: a path no file is at, which this run's profile alone denies, so
# egressd can tell its own processes (daemonised ones included) by asking the kernel about it.
MARKER_ROOT = "/egressd-run"

# Each Mach service by name, none other. Not trustd, ocspd or mDNSResponder: they fetch (AIA, OCSP,
# CRL) or resolve names on a client's behalf, outside the sandbox, so they would be ways out.
MACH_SERVICES: tuple[tuple[str, str], ...] = (
    ("com.apple.system.opendirectoryd.libinfo", "users and groups: getpwuid (whoami, git, ssh, ~)"),
    ("com.apple.system.opendirectoryd.membership", "group membership: getgrouplist (id, access checks)"),
    ("com.apple.bsd.dirhelper", "the per-user temporary directory (confstr _CS_DARWIN_USER_TEMP_DIR)"),
)

_DEVICES: tuple[str, ...] = (
    '(literal "/dev/null")',
    '(literal "/dev/zero")',
    '(literal "/dev/dtracehelper")',
    '(literal "/dev/tty")',  # the child's own terminal (password prompts)
    '(regex #"^/dev/fd/[0-9]+$")',
)
# TIOCSTI by number (_IOW('t', 114, char)): the symbol TIOCSTI is unbound in the profile language
# of macOS 13.7 and 14.2-14.3, where a profile naming it does not load at all.
TIOCSTI = 0x80017472
_ANY_TERMINAL = '(regex #"^/dev/ttys[0-9]+$")'  # not /dev/tty.* (serial ports)

# macOS's symlinks at the root: a rule names both spellings of a path below one of them.
_SYMLINKED = ("/tmp", "/var", "/etc")


def spellings(path: str) -> tuple[str, ...]:
    """The canonical path, then its other spelling when it lies under /private/{tmp,var,etc}."""
    for top in _SYMLINKED:
        if within(path, "/private" + top):
            return path, path.removeprefix("/private")
        if within(path, top):
            return "/private" + path, path
    return (path,)


def _paths(filt: str, paths: Iterable[str]) -> list[str]:
    return [f"({filt} {quote(s)})" for path in paths for s in spellings(path)]


def _rule(head: str, filters: Sequence[str]) -> list[str]:
    """One rule, or none without filters: an unfiltered `(allow file-write*)` would allow everything.
    Several filters go on lines of their own."""
    if not filters:
        return []
    if len(filters) == 1:
        return [f"({head} {filters[0]})"]
    return [f"({head}", *(f"    {f}" for f in filters), ")"]


def _unique(paths: Iterable[str]) -> list[str]:
    return list(dict.fromkeys(paths))


def _outermost(paths: Iterable[str]) -> list[str]:
    """The paths that lie in no other one of them (a subpath rule covers the rest)."""
    paths = _unique(paths)
    return [p for p in paths if not any(within(p, q) and p != q for q in paths)]


def _process_rules(marker: str | None) -> list[str]:
    sysctls = [f"(sysctl-name {quote(n)})" for n in SYSCTL_NAMES]
    sysctls += [f"(sysctl-name-prefix {quote(p)})" for p in SYSCTL_PREFIXES]
    lines = [
        ";; Processes: fork, and signal or inspect only the processes of this sandbox.",
        "(allow process-fork)",
        "(allow signal (target same-sandbox))",
        "(allow process-info* (target same-sandbox))",
        ";; Kernel parameters, read only and by name: CPU, memory, OS version, its own process",
        ";; entries. Not kern.procargs*: the arguments and environment of every process of yours.",
        *_rule("allow sysctl-read", sysctls),
        ";; Named POSIX semaphores: Python's multiprocessing locks.",
        "(allow ipc-posix-sem)",
        ";; Mach services, each named; no others (not trustd or mDNSResponder: they would fetch or",
        ";; resolve names for the child outside the proxy).",
        "(allow mach-lookup",
    ]
    for name, why in MACH_SERVICES:
        lines += [f"    ;; {why}", f"    (global-name {quote(name)})"]
    lines.append(")")
    if marker is not None:
        lines += [
            ";; This run's mark: egressd asks the kernel whether a process may read it, and ends",
            ";; the ones that may not when the run is over (a daemon the child left, too).",
            f"(deny file-read-data (literal {quote(marker)}))",
        ]
    return lines


def _network_rules(proxy_ports: Sequence[int], serve: Sequence[int]) -> list[str]:
    lines = [
        ";; Network: nothing but what follows. This also refuses the resolver's socket",
        ";; (/private/var/run/mDNSResponder): there is no DNS inside, the proxy resolves names.",
        "(deny network*)",
        ";; The one way out: TCP to egressd's proxy on the loopback (HTTP, SOCKS5); not UDP. There",
        ";; is deliberately no network-outbound rule on the LOCAL endpoint: every outbound",
        ";; connection has one, so such a rule would open outbound traffic to anywhere.",
        *(f'(allow network-outbound (remote tcp "localhost:{int(port)}"))' for port in proxy_ports),
    ]
    if serve:
        lines += [
            ";; --serve: the child listens on these ports (a page in your browser could reach any",
            ";; other, and a squatted OAuth redirect port would receive your login).",
            *(f'(allow network-bind (local tcp "localhost:{int(port)}"))' for port in serve),
            *(f'(allow network-inbound (local tcp "localhost:{int(port)}"))' for port in serve),
        ]
    return lines


def _exec_rules(layout: Layout, temp: Sequence[str], home: str, needed: Sequence[str]) -> list[str]:
    places = _outermost([home, *(m.path for m in layout.mounts), *temp, *needed])
    return [
        ";; Programs: from the system, package managers, your home, the working directory, --rw/--ro",
        ";; paths, the temporary directories and egressd's Python; nowhere else (other users, volumes).",
        *_rule("allow process-exec*", [*_paths("subpath", SYSTEM_PROGRAMS), XCODE]),
        *_rule("allow process-exec*", _paths("subpath", places)),
        ";; Never the programs that make a process root on your say-so (a cached sudo ticket).",
        *_rule("deny process-exec*", _paths("literal", PRIVILEGED_PROGRAMS)),
    ]


def _write_rules(layout: Layout, temp: Sequence[str], terminals: Sequence[str]) -> list[str]:
    lines = [
        ";; Write: the devices every program writes to.",
        *_rule("allow file-write*", _DEVICES),
        ";; Terminals: the child's own only (/dev/tty and the one it inherited); opening another",
        ";; would read what you type there. Its ioctls (isatty, raw mode, window size), but not",
        ";; TIOCSTI, which would type into your shell once the child is gone.",
        f"(deny file-read* file-write* {_ANY_TERMINAL})",
        *_rule("allow file-read* file-write*", _paths("literal", terminals)),
        *_rule("allow file-ioctl", ['(literal "/dev/tty")', _ANY_TERMINAL]),
        f"(deny file-ioctl (ioctl-command #x{TIOCSTI:08x}))",
        ";; The run's own temporary directory (TMPDIR): never the host's /tmp or $TMPDIR, where",
        ";; builds outside the sandbox keep what they run.",
        *_rule("allow file-write*", _paths("subpath", temp)),
        ";; The working directory and --rw paths writable, --ro read-only; parents first, so the",
        ";; most specific path wins, as on Linux.",
    ]
    for mount in order(layout.mounts):
        action = "allow" if mount.writable else "deny"
        lines += _rule(f"{action} file-write*", _paths("subpath", [mount.path]))
    project = {path for path, _ in layout.hooks}
    ro = [c.path for c in layout.covers if c.kind == "ro" and c.path not in project]
    guarded = _unique([*layout.guarded, *ro])
    if guarded:
        lines += [
            ";; Never written: egressd's code and Python, the policy, the audit; --show paths.",
            *_rule("deny file-write*", _paths("subpath", guarded)),
        ]
    hooks = [c.path for c in layout.covers if c.kind == "ro" and c.path in project]
    if hooks:
        lines += [
            ";; Never written or created: the project's hooks (.git/hooks, .git/config, editor and agent",
            ";; settings), which run code outside the sandbox later (hooks.py).",
            *_rule("deny file-write*", _paths("subpath", hooks)),
        ]
    return lines


def _keep_names(layout: Layout, temp: Sequence[str]) -> list[str]:
    """Directories in a writable place on the way to a protected path: a rename there would put
    another file at that path (bubblewrap's pins and mount points do the same on Linux)."""
    writable = [*temp, *(m.path for m in layout.mounts if m.writable)]
    protected = [*(m.path for m in layout.mounts if not m.writable), *layout.guarded]
    protected += [*(c.path for c in layout.covers), *layout.hidden]
    names = []
    for path in protected:
        parent = os.path.dirname(path)
        while parent != "/" and any(within(parent, top) for top in writable):
            names.append(parent)
            parent = os.path.dirname(parent)
    if not names:
        return []
    return [
        ";; Directories on the way to those or to a hidden path keep their names (no rename or removal);",
        ";; what they hold stays writable.",
        *_rule("deny file-write-unlink", _paths("literal", _unique(names))),
    ]


def _masked_rules(layout: Layout, needed: Sequence[str]) -> list[str]:
    """The home: neither read, written nor run, but for what is shown in it (before the write
    rules, which then allow the writable mounts in it again)."""
    if not layout.masked:
        return []
    shown = [*(m.path for m in layout.mounts), *layout.revealed, *needed]
    inside = _outermost(p for p in shown if _under(p, layout.masked))
    return [
        ";; Your home: hidden but for the working directory, --rw/--ro/--show paths, the harmless",
        ";; configuration shown by default and egressd's own Python (nothing in it is read otherwise).",
        *_rule("deny file-read* file-write* process-exec*", _paths("subpath", layout.masked)),
        *_rule("allow file-read-metadata", _paths("literal", layout.masked)),
        *_rule("allow file-read* process-exec*", _paths("subpath", inside)),
    ]


def _hidden_rules(layout: Layout, needed: Sequence[str]) -> list[str]:
    hidden = _unique([*layout.hidden, *layout.absent, PRIVILEGED_STATE])
    lines = [
        ";; Hidden: credentials (the listed ones that do not exist too), egressd's home (the CA key),",
        ";; authority sockets, sudo's tickets: not read, written or run, even inside a writable path.",
        *_rule("deny file-read* file-write* process-exec*", _paths("subpath", hidden)),
    ]
    inside = [c.path for c in layout.covers if c.kind == "ro" and _under(c.path, layout.hidden)]
    if inside:
        lines += [
            ";; Shown read-only inside a hidden path (--show).",
            *_rule("allow file-read*", _paths("subpath", inside)),
        ]
    ours = [p for p in needed if _under(p, layout.hidden)]
    if ours:
        lines += [
            ";; egressd's own Python and CA bundle, read-only, where they lie in a hidden path.",
            *_rule("allow file-read* process-exec*", _paths("subpath", ours)),
        ]
    return lines


def _under(path: str, tops: Iterable[str]) -> bool:
    return any(within(path, top) and path != top for top in tops)


def seatbelt_profile(
    layout: Layout,
    proxy_ports: Sequence[int],
    *,
    temp: Sequence[str],
    home: str,
    needed: Sequence[str] = (),
    terminals: Sequence[str] = (),
    serve: Sequence[int] = (),
    marker: str | None = None,
) -> str:
    """The profile text for `layout` (canonical paths). `temp`: the run's own temporary directory
    (the only place the child writes outside its mounts); `home`: the user's; `needed`: what
    egressd's own process needs inside (its Python, the CA bundle); `terminals`: the terminal
    devices the child inherits; `serve`: the ports the child may listen on (--serve); `marker`:
    the run's mark (run_marker). UnquotablePath when a path cannot be written safely."""
    if not proxy_ports:
        raise ValueError("the proxy port is the only way out: at least one is required")
    sections = [
        [
            "(version 1)",
            ";; egressd sandbox (Seatbelt), generated from the sandbox's layout: everything not",
            ";; allowed below is denied.",
            "(deny default)",
        ],
        _process_rules(marker),
        _network_rules(proxy_ports, serve),
        _exec_rules(layout, temp, home, needed),
        [";; Files: read everything but the hidden paths (below).", "(allow file-read*)"],
        _masked_rules(layout, needed),
        _write_rules(layout, temp, terminals) + _keep_names(layout, temp),
        _hidden_rules(layout, needed),
    ]
    return "\n\n".join("\n".join(lines) for lines in sections if lines) + "\n"


def run_marker(token: str) -> str:
    """The path this run's profile alone denies reading (see MARKER_ROOT)."""
    return f"{MARKER_ROOT}/{token}"


def seatbelt_argv(profile: str, command: Sequence[str], sandbox_exec: str = SANDBOX_EXEC) -> list[str]:
    return [sandbox_exec, "-p", profile, "--", *command]
