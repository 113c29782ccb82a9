"""The macOS Seatbelt profile and argv, golden, checked on any platform (sandbox-exec never runs here).

What matters: the profile starts from `(deny default)`; nothing but the proxy's loopback ports is
open outbound, in particular no network-outbound rule filtered on the LOCAL endpoint (every outbound
connection has one, so such a rule opens everything); it hides and protects what the Linux sandbox
does, derived from the same Layout; and no path, whatever its characters, breaks out of its string
literal. `decide()` below evaluates a profile with Debian's tinyscheme and asks the model of
Seatbelt's rule precedence in tests/support/seatbelt_model.py what a path gets.
"""

from __future__ import annotations

import functools
import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from egressd.sandbox.layout import Layout
from egressd.sandbox.mounts import Mount
from egressd.sandbox.sbpl import UnquotablePath, quote
from egressd.sandbox.seatbelt import (
    seatbelt_argv,
    seatbelt_profile,
    spellings,
)
from egressd.sandbox.shields import Cover
from tests.support import sbpl_reader as sbpl
from tests.support.sbpl_reader import String, network_rules, outbound_rules
from tests.support.seatbelt_layouts import LAYOUT, TEMP, _named, _profile
from tests.support.seatbelt_model import Model

GOLDEN = r"""(version 1)
;; egressd sandbox (Seatbelt), generated from the sandbox's layout: everything not
;; allowed below is denied.
(deny default)

;; Processes: fork, and signal or inspect only the processes of this sandbox.
(allow process-fork)
(allow signal (target same-sandbox))
(allow process-info* (target same-sandbox))
;; Kernel parameters, read only and by name: CPU, memory, OS version, its own process
;; entries. Not kern.procargs*: the arguments and environment of every process of yours.
(allow sysctl-read
    (sysctl-name "hw.activecpu")
    (sysctl-name "hw.busfrequency_compat")
    (sysctl-name "hw.byteorder")
    (sysctl-name "hw.cacheconfig")
    (sysctl-name "hw.cachelinesize_compat")
    (sysctl-name "hw.cpufamily")
    (sysctl-name "hw.cpufrequency")
    (sysctl-name "hw.cpufrequency_compat")
    (sysctl-name "hw.cputype")
    (sysctl-name "hw.l1dcachesize_compat")
    (sysctl-name "hw.l1icachesize_compat")
    (sysctl-name "hw.l2cachesize_compat")
    (sysctl-name "hw.l3cachesize_compat")
    (sysctl-name "hw.logicalcpu")
    (sysctl-name "hw.logicalcpu_max")
    (sysctl-name "hw.machine")
    (sysctl-name "hw.memsize")
    (sysctl-name "hw.model")
    (sysctl-name "hw.ncpu")
    (sysctl-name "hw.nperflevels")
    (sysctl-name "hw.packages")
    (sysctl-name "hw.pagesize")
    (sysctl-name "hw.pagesize_compat")
    (sysctl-name "hw.physicalcpu")
    (sysctl-name "hw.physicalcpu_max")
    (sysctl-name "hw.tbfrequency_compat")
    (sysctl-name "hw.vectorunit")
    (sysctl-name "kern.argmax")
    (sysctl-name "kern.boottime")
    (sysctl-name "kern.hostname")
    (sysctl-name "kern.maxfiles")
    (sysctl-name "kern.maxfilesperproc")
    (sysctl-name "kern.maxproc")
    (sysctl-name "kern.ngroups")
    (sysctl-name "kern.osproductversion")
    (sysctl-name "kern.osrelease")
    (sysctl-name "kern.ostype")
    (sysctl-name "kern.osvariant_status")
    (sysctl-name "kern.osversion")
    (sysctl-name "kern.secure_kernel")
    (sysctl-name "kern.usrstack64")
    (sysctl-name "kern.version")
    (sysctl-name "machdep.cpu.brand_string")
    (sysctl-name "machdep.ptrauth_enabled")
    (sysctl-name "security.mac.lockdown_mode_state")
    (sysctl-name "sysctl.proc_cputype")
    (sysctl-name "vm.loadavg")
    (sysctl-name-prefix "hw.optional.")
    (sysctl-name-prefix "hw.perflevel")
    (sysctl-name-prefix "machdep.cpu.")
    (sysctl-name-prefix "kern.proc.pid.")
    (sysctl-name-prefix "kern.proc.pgrp.")
    (sysctl-name-prefix "net.routetable.")
)
;; Named POSIX semaphores: Python's multiprocessing locks.
(allow ipc-posix-sem)
;; Mach services, each named; no others (not trustd or mDNSResponder: they would fetch or
;; resolve names for the child outside the proxy).
(allow mach-lookup
    ;; users and groups: getpwuid (whoami, git, ssh, ~)
    (global-name "com.apple.system.opendirectoryd.libinfo")
    ;; group membership: getgrouplist (id, access checks)
    (global-name "com.apple.system.opendirectoryd.membership")
    ;; the per-user temporary directory (confstr _CS_DARWIN_USER_TEMP_DIR)
    (global-name "com.apple.bsd.dirhelper")
)
;; This run's mark: egressd asks the kernel whether a process may read it, and ends
;; the ones that may not when the run is over (a daemon the child left, too).
(deny file-read-data (literal "/egressd-run/0123abcd"))

;; Network: nothing but what follows. This also refuses the resolver's socket
;; (/private/var/run/mDNSResponder): there is no DNS inside, the proxy resolves names.
(deny network*)
;; The one way out: TCP to egressd's proxy on the loopback (HTTP, SOCKS5); not UDP. There
;; is deliberately no network-outbound rule on the LOCAL endpoint: every outbound
;; connection has one, so such a rule would open outbound traffic to anywhere.
(allow network-outbound (remote tcp "localhost:49152"))
(allow network-outbound (remote tcp "localhost:49153"))

;; Programs: from the system, package managers, your home, the working directory, --rw/--ro
;; paths, the temporary directories and egressd's Python; nowhere else (other users, volumes).
(allow process-exec*
    (subpath "/bin")
    (subpath "/sbin")
    (subpath "/usr")
    (subpath "/System")
    (subpath "/Library/Apple")
    (subpath "/Library/Developer/CommandLineTools")
    (subpath "/opt/homebrew")
    (subpath "/opt/local")
    (subpath "/nix")
    (regex #"^/Applications/Xcode[^/]*\.app/")
)
(allow process-exec*
    (subpath "/Users/u")
    (subpath "/private/var/folders/xy/T/egressd-run-abc")
    (subpath "/var/folders/xy/T/egressd-run-abc")
    (subpath "/opt/homebrew/Cellar/egressd/1.0/libexec")
)
;; Never the programs that make a process root on your say-so (a cached sudo ticket).
(deny process-exec*
    (literal "/usr/bin/sudo")
    (literal "/usr/bin/su")
    (literal "/usr/bin/login")
    (literal "/usr/bin/newgrp")
    (literal "/usr/libexec/security_authtrampoline")
)

;; Files: read everything but the hidden paths (below).
(allow file-read*)

;; Write: the devices every program writes to.
(allow file-write*
    (literal "/dev/null")
    (literal "/dev/zero")
    (literal "/dev/dtracehelper")
    (literal "/dev/tty")
    (regex #"^/dev/fd/[0-9]+$")
)
;; Terminals: the child's own only (/dev/tty and the one it inherited); opening another
;; would read what you type there. Its ioctls (isatty, raw mode, window size), but not
;; TIOCSTI, which would type into your shell once the child is gone.
(deny file-read* file-write* (regex #"^/dev/ttys[0-9]+$"))
(allow file-read* file-write* (literal "/dev/ttys003"))
(allow file-ioctl
    (literal "/dev/tty")
    (regex #"^/dev/ttys[0-9]+$")
)
(deny file-ioctl (ioctl-command #x80017472))
;; The run's own temporary directory (TMPDIR): never the host's /tmp or $TMPDIR, where
;; builds outside the sandbox keep what they run.
(allow file-write*
    (subpath "/private/var/folders/xy/T/egressd-run-abc")
    (subpath "/var/folders/xy/T/egressd-run-abc")
)
;; The working directory and --rw paths writable, --ro read-only; parents first, so the
;; most specific path wins, as on Linux.
(allow file-write* (subpath "/Users/u/project"))
(deny file-write* (subpath "/Users/u/project/.git"))
;; Never written: egressd's code and Python, the policy, the audit; --show paths.
(deny file-write*
    (subpath "/opt/homebrew/Cellar/egressd/1.0/libexec")
    (subpath "/Users/u/project/tools/policy.yaml")
    (subpath "/private/tmp/egressd-audit/audit.jsonl")
    (subpath "/tmp/egressd-audit/audit.jsonl")
    (subpath "/Users/u/.ssh/known_hosts")
)
;; Directories on the way to those or to a hidden path keep their names (no rename or removal);
;; what they hold stays writable.
(deny file-write-unlink
    (literal "/Users/u/project")
    (literal "/Users/u/project/tools")
)

;; Hidden: credentials (the listed ones that do not exist too), egressd's home (the CA key),
;; authority sockets, sudo's tickets: not read, written or run, even inside a writable path.
(deny file-read* file-write* process-exec*
    (subpath "/Users/u/.config/egressd")
    (subpath "/Users/u/.ssh")
    (subpath "/Users/u/.npmrc")
    (subpath "/private/tmp/com.apple.launchd.abc/Listeners")
    (subpath "/tmp/com.apple.launchd.abc/Listeners")
    (subpath "/private/var/db/sudo")
    (subpath "/var/db/sudo")
)
;; Shown read-only inside a hidden path (--show).
(allow file-read* (subpath "/Users/u/.ssh/known_hosts"))
;; egressd's own Python and CA bundle, read-only, where they lie in a hidden path.
(allow file-read* process-exec* (subpath "/Users/u/.config/egressd/ca.pem"))
"""


@functools.lru_cache(maxsize=64)
def _model(profile: str) -> Model:
    return Model.of(profile)


def decide(profile: str, operation: str, path: str) -> str:
    """ "allow" or "deny" for `operation` on `path` under `profile`, by Seatbelt's precedence."""
    return _model(profile).decide(operation, path=path)


def test_golden_profile() -> None:
    assert _profile() == GOLDEN


def test_golden_argv() -> None:
    assert seatbelt_argv(GOLDEN, ["curl", "-sS", "https://example.com/"]) == [
        "/usr/bin/sandbox-exec",
        "-p",
        GOLDEN,
        "--",
        "curl",
        "-sS",
        "https://example.com/",
    ]


def test_it_starts_from_deny_default_and_allows_only_with_filters() -> None:
    """The only unfiltered allowances are these: a layout with nothing in it (no temp, mounts or
    terminal) must never turn into an unfiltered `(allow file-write*)`."""
    empty = Layout((), (), (), ())
    for profile in (_profile(), seatbelt_profile(empty, [1], temp=[], home="/Users/u")):
        forms = [f for f in sbpl.read(profile) if isinstance(f, list)]
        assert forms[0] == ["version", "1"] and forms[1] == ["deny", "default"]
        bare = [f for f in forms if f[0] == "allow" and all(isinstance(i, str) for i in f)]
        assert bare == [
            ["allow", "process-fork"],
            ["allow", "ipc-posix-sem"],
            ["allow", "file-read*"],
        ]
    assert decide(seatbelt_profile(empty, [1], temp=[], home="/Users/u"), "file-write-data", "/x") == "deny"


def test_mach_services_are_named_one_by_one() -> None:
    (rule,) = [f for f in sbpl.read(_profile()) if isinstance(f, list) and f[:2] == ["allow", "mach-lookup"]]
    assert [f[1].text for f in rule[2:]] == [
        "com.apple.system.opendirectoryd.libinfo",
        "com.apple.system.opendirectoryd.membership",
        "com.apple.bsd.dirhelper",
    ]


def test_only_the_proxy_ports_are_open_outbound() -> None:
    """Every allowing rule that could match an outbound connection names a proxy port, remotely,
    over TCP (`ip` would admit UDP to it too)."""
    assert outbound_rules(_profile()) == [
        '(remote tcp "localhost:49152")',
        '(remote tcp "localhost:49153")',
    ]


@pytest.mark.parametrize("serve", [(), (8000, 8443)])
def test_no_rule_filters_outbound_on_the_local_endpoint(serve: tuple[int, ...]) -> None:
    """Outbound to the proxy ports only, remotely; bind and accept only on the --serve ports."""
    profile = seatbelt_profile(LAYOUT, [49152], temp=TEMP, home="/Users/u", serve=serve)
    rules = network_rules(profile)
    assert rules[:2] == [("deny", "default", ""), ("deny", "network*", "")]
    served = []
    for action, operation, filt in rules[2:]:
        assert action == "allow"
        if operation == "network-outbound":
            assert filt == '(remote tcp "localhost:49152")'
        else:
            assert operation in ("network-bind", "network-inbound")
            served.append((operation, filt))
    ops = ("network-bind", "network-inbound")
    expected = [(op, f'(local tcp "localhost:{p}")') for op in ops for p in serve]
    assert served == expected


def test_the_trap_would_be_caught() -> None:
    """The checker itself sees a local-endpoint outbound allowance (it is not vacuous)."""
    trapped = _profile() + '(allow network-outbound (local ip "localhost:*"))\n'
    assert '(local ip "localhost:*")' in outbound_rules(trapped)
    assert "" in outbound_rules(_profile() + "(allow network*)\n")
    assert "" in outbound_rules(_profile() + "(allow default)\n")


def test_the_denies_come_before_the_allowances() -> None:
    """Seatbelt applies the last matching rule: a deny after the allowances would close the proxy."""
    rules = network_rules(_profile())
    denies = [i for i, rule in enumerate(rules) if rule[0] == "deny"]
    allows = [i for i, rule in enumerate(rules) if rule[0] == "allow"]
    assert max(denies) < min(allows)


def test_terminals_no_tiocsti_and_no_other_terminal() -> None:
    profile = _profile()
    assert "(deny file-ioctl (ioctl-command #x80017472))" in profile
    assert profile.index("(deny file-ioctl (ioctl-command #x80017472))") > profile.index("(allow file-ioctl")
    assert decide(profile, "file-read-data", "/dev/ttys003") == "allow"  # the child's own
    assert decide(profile, "file-read-data", "/dev/ttys007") == "deny"  # another window's input
    assert decide(profile, "file-write-data", "/dev/ttys007") == "deny"
    assert decide(profile, "file-write-data", "/dev/tty.Bluetooth-Incoming-Port") == "deny"
    assert decide(profile, "file-write-data", "/dev/tty") == "allow"


@pytest.mark.parametrize(
    ("operation", "path", "expected"),
    [
        # reading: everything but the hidden paths; a --show path and egressd's CA bundle inside
        ("file-read-data", "/etc/hosts", "allow"),
        ("file-read-data", "/Users/u/project/src/main.py", "allow"),
        ("file-read-data", "/Users/u/.ssh/id_ed25519", "deny"),
        ("file-read-metadata", "/Users/u/.ssh", "deny"),
        ("file-read-data", "/Users/u/.ssh/known_hosts", "allow"),
        ("file-read-data", "/Users/u/.npmrc", "deny"),
        ("file-read-data", "/Users/u/.config/egressd/ca-key.pem", "deny"),
        ("file-read-data", "/Users/u/.config/egressd/ca.pem", "allow"),
        ("file-read-data", "/Users/u/.config/egressd-other", "allow"),  # a sibling, not inside
        # the ssh-agent's socket, by both spellings of /tmp
        ("file-read-data", "/private/tmp/com.apple.launchd.abc/Listeners", "deny"),
        ("file-read-data", "/tmp/com.apple.launchd.abc/Listeners", "deny"),
        # writing: the working directory, the temp dirs, devices; not --ro, the home or the system
        ("file-write-data", "/Users/u/project/src/main.py", "allow"),
        ("file-write-create", "/Users/u/project/tools/new.txt", "allow"),
        ("file-write-data", "/Users/u/project/.git/config", "deny"),
        ("file-write-data", "/Users/u/project/tools/policy.yaml", "deny"),
        ("file-write-data", "/Users/u/.ssh/known_hosts", "deny"),
        ("file-write-data", "/Users/u/.ssh/authorized_keys", "deny"),
        ("file-write-data", "/Users/u/.zshrc", "deny"),
        ("file-write-data", "/usr/local/bin/git", "deny"),
        ("file-write-data", "/opt/homebrew/Cellar/egressd/1.0/libexec/egressd/cli.py", "deny"),
        ("file-write-data", "/private/var/folders/xy/T/egressd-run-abc/build.log", "allow"),
        ("file-write-data", "/var/folders/xy/T/egressd-run-abc/build.log", "allow"),
        # the host's /tmp and $TMPDIR are not the child's: builds outside keep what they run there
        ("file-write-data", "/private/tmp/build.log", "deny"),
        ("file-write-data", "/tmp/build.log", "deny"),
        ("file-write-data", "/private/var/folders/xy/T/tmp123", "deny"),
        ("file-write-create", "/private/var/folders/xy/T/go-build1/b001/exe/main", "deny"),
        ("file-write-data", "/private/var/folders/xy/C/cache", "deny"),
        ("file-write-data", "/private/tmp/egressd-audit/audit.jsonl", "deny"),
        ("file-write-data", "/tmp/egressd-audit/audit.jsonl", "deny"),
        ("file-write-data", "/dev/null", "allow"),
        ("file-write-data", "/dev/fd/1", "allow"),
        ("file-write-data", "/dev/disk0", "deny"),
        # names on the way to what is protected stay (a rename would put another file there)
        ("file-write-unlink", "/Users/u/project/tools", "deny"),
        ("file-write-unlink", "/Users/u/project", "deny"),
        ("file-write-unlink", "/private/tmp/egressd-audit", "deny"),
        ("file-write-unlink", "/tmp/egressd-audit", "deny"),
        ("file-write-unlink", "/private/tmp/com.apple.launchd.abc", "deny"),
        ("file-write-unlink", "/private/var/folders/xy/T/egressd-run-abc/x", "allow"),
        ("file-write-unlink", "/Users/u/project/tools/notes.txt", "allow"),
        ("file-write-unlink", "/Users/u/project/src", "allow"),
        # programs: system, package managers, home, project, temp; not elsewhere or hidden
        ("process-exec", "/usr/bin/git", "allow"),
        ("process-exec", "/bin/sh", "allow"),
        ("process-exec", "/opt/homebrew/bin/node", "allow"),
        ("process-exec", "/Library/Developer/CommandLineTools/usr/bin/git", "allow"),
        ("process-exec", "/Applications/Xcode.app/Contents/Developer/usr/bin/git", "allow"),
        ("process-exec", "/Applications/Xcode-beta.app/Contents/Developer/usr/bin/git", "allow"),
        ("process-exec", "/Applications/Xcodes.app.evil/x", "deny"),
        ("process-exec", "/Applications/Evil.app/Contents/MacOS/Evil", "deny"),
        ("process-exec", "/Users/u/.cargo/bin/cargo", "allow"),
        ("process-exec", "/Users/u/project/node_modules/.bin/tsc", "allow"),
        ("process-exec-interpreter", "/Users/u/project/.venv/bin/python", "allow"),
        ("process-exec", "/private/var/folders/xy/T/egressd-run-abc/go-build1/b001/exe/main", "allow"),
        ("process-exec", "/private/var/folders/xy/T/go-build1/b001/exe/main", "deny"),
        ("process-exec", "/usr/bin/sudo", "deny"),
        ("process-exec", "/usr/bin/su", "deny"),
        ("file-read-data", "/private/var/db/sudo/ts/u", "deny"),
        ("process-exec", "/Users/other/bin/tool", "deny"),
        ("process-exec", "/Volumes/usb/tool", "deny"),
        ("process-exec", "/Users/u/.ssh/helper", "deny"),
        ("process-exec", "/Users/u/.config/egressd/tool", "deny"),
        # nothing else is allowed by default
        ("mach-lookup", "", "deny"),
        ("file-link", "/Users/u/project/link", "deny"),
    ],
)
def test_what_a_path_gets(operation: str, path: str, expected: str) -> None:
    assert decide(_profile(), operation, path) == expected


def test_the_most_specific_mount_wins_in_any_order() -> None:
    """--rw inside --ro stays writable and --ro inside --rw read-only, as bubblewrap's mounts are."""
    layout = Layout(
        (
            Mount("/Users/u/data/build", True),
            Mount("/Users/u/data", False),
            Mount("/Users/u/project", True),
            Mount("/Users/u/project/vendor", False),
        ),
        (),
        (),
        (),
    )
    profile = _profile(layout)
    assert decide(profile, "file-write-data", "/Users/u/data/build/out.o") == "allow"
    assert decide(profile, "file-write-data", "/Users/u/data/input.csv") == "deny"
    assert decide(profile, "file-write-data", "/Users/u/project/vendor/lib.c") == "deny"
    assert decide(profile, "file-write-data", "/Users/u/project/main.c") == "allow"


def test_a_hidden_path_inside_a_writable_mount() -> None:
    """Not read, written, run, or moved away by renaming the directory that holds it."""
    layout = Layout(
        (Mount("/Users/u/project", True),),
        (Cover("/Users/u/project/deploy/.env", "empty"),),
        ("/Users/u/project/deploy/.env",),
        (),
    )
    profile = _profile(layout)
    for operation in ("file-read-data", "file-write-data", "file-write-unlink", "process-exec"):
        assert decide(profile, operation, "/Users/u/project/deploy/.env") == "deny", operation
    assert decide(profile, "file-write-unlink", "/Users/u/project/deploy") == "deny"
    assert decide(profile, "file-write-data", "/Users/u/project/deploy/run.sh") == "allow"
    assert decide(profile, "file-read-data", "/Users/u/project/deploy/.env.example") == "allow"


@pytest.mark.parametrize(
    ("path", "expected"),
    [
        ("/private/tmp/x", ("/private/tmp/x", "/tmp/x")),
        ("/tmp/x", ("/private/tmp/x", "/tmp/x")),
        ("/tmp", ("/private/tmp", "/tmp")),
        ("/private/var/folders/xy/T", ("/private/var/folders/xy/T", "/var/folders/xy/T")),
        ("/private/etc/hosts", ("/private/etc/hosts", "/etc/hosts")),
        ("/Users/u/tmp", ("/Users/u/tmp",)),
        ("/private/tmpfoo", ("/private/tmpfoo",)),
        ("/private", ("/private",)),
        ("/variable", ("/variable",)),
    ],
)
def test_both_spellings_of_the_root_symlinks(path: str, expected: tuple[str, ...]) -> None:
    assert spellings(path) == expected


def test_a_symlinked_credential_is_hidden_at_its_target(tmp_path, monkeypatch) -> None:
    """~/.aws -> elsewhere: the layout holds the real path, which the kernel checks; on macOS a
    target under /tmp or /var is denied by both spellings."""
    from egressd.sandbox.shields import credential_paths

    home = tmp_path / "home"
    vault = tmp_path / "vault" / "aws"
    vault.mkdir(parents=True)
    (vault / "credentials").write_text("secret")
    home.mkdir()
    (home / ".aws").symlink_to(vault)
    hidden = credential_paths(str(home), {})
    from egressd.sandbox.shields import AUTHORITY_SOCKETS

    # the host's own daemon sockets (a running dockerd's, say) are hidden by default too
    sockets = tuple(os.path.realpath(s) for s in AUTHORITY_SOCKETS if os.path.exists(s))
    assert hidden == (os.path.realpath(vault), *sockets)
    layout = Layout((), tuple(Cover(p, "tmpfs") for p in hidden), hidden, ())
    profile = seatbelt_profile(layout, [1], temp=[], home=str(home))
    target = os.path.join(hidden[0], "credentials")
    assert decide(profile, "file-read-data", target) == "deny"
    for spelled in spellings(target):
        assert decide(profile, "file-read-data", spelled) == "deny"


def test_the_layout_carries_what_seatbelt_protects(tmp_path, monkeypatch) -> None:
    """plan_layout on real files: credentials (one symlinked), --hide inside the working
    directory, the policy inside it, the audit in a temp dir, egressd's home and code."""
    import egressd
    from egressd.sandbox.layout import plan_layout
    from egressd.session import SessionOptions

    home = tmp_path / "home"
    project = home / "project"
    temp = tmp_path / "T"
    for directory in (home / ".ssh", project / "conf", temp / "logs", tmp_path / "vault"):
        directory.mkdir(parents=True)
    (home / ".netrc").symlink_to(tmp_path / "vault" / "netrc")
    (tmp_path / "vault" / "netrc").write_text("machine x password y")
    (project / "conf" / "policy.yaml").write_text("version: 1\n")
    (project / ".env").write_text("TOKEN=1")
    monkeypatch.setenv("HOME", str(home))
    options = SessionOptions(
        policy_file=str(project / "conf" / "policy.yaml"),
        audit_path=str(temp / "logs" / "audit.jsonl"),
        config_dir=home / ".config" / "egressd",
    )
    hide = [str(project / ".env")]
    layout = plan_layout(options, workdir=str(project), rw=[], ro=[], hide=hide, environ={})
    real = os.path.realpath
    assert real(str(project / "conf" / "policy.yaml")) in layout.guarded
    assert real(os.path.dirname(egressd.__file__)) in layout.guarded
    profile = seatbelt_profile(layout, [3128], temp=[real(str(temp))], home=real(str(home)))
    expected = [
        ("file-read-data", str(home / ".ssh" / "id_rsa"), "deny"),
        ("file-read-data", str(tmp_path / "vault" / "netrc"), "deny"),
        ("file-read-data", str(home / ".config" / "egressd" / "ca.key"), "deny"),
        ("file-read-data", str(project / ".env"), "deny"),
        ("file-write-data", str(project / ".env"), "deny"),
        ("file-write-data", str(project / "main.py"), "allow"),
        ("file-write-data", str(project / "conf" / "policy.yaml"), "deny"),
        ("file-write-unlink", str(project / "conf"), "deny"),
        ("file-write-data", str(temp / "logs" / "audit.jsonl"), "deny"),
        ("file-write-unlink", str(temp / "logs"), "deny"),
        ("file-write-data", str(temp / "logs" / "other.log"), "allow"),
        ("file-write-data", os.path.join(os.path.dirname(egressd.__file__), "cli.py"), "deny"),
    ]
    for operation, path, want in expected:
        for spelled in spellings(real(path)):
            assert decide(profile, operation, spelled) == want, (operation, spelled)


def test_the_masked_home_hides_all_but_what_is_shown(tmp_path, monkeypatch) -> None:
    """As on Linux: the home is hidden but for the project, --show paths, the harmless configuration
    and egressd's own Python; the credentials stay hidden inside a shown directory."""
    from egressd.sandbox.layout import plan_layout
    from egressd.session import SessionOptions

    home = tmp_path / "Users" / "u"
    project = home / "project"
    for directory in (project, home / ".config" / "gh", home / "notes", home / ".pyenv" / "bin"):
        directory.mkdir(parents=True)
    for name, text in {
        ".zsh_history": "export TOKEN=x",
        ".pgpass": "db:5432:*:u:pw",
        ".gitconfig": "[user]\n\tname = U\n",
        ".config/gh/hosts.yml": "oauth_token: x",
        ".config/tool.toml": "theme = dark",
        "notes/todo.txt": "todo",
    }.items():
        (home / name).write_text(text)
    monkeypatch.setenv("HOME", str(home))
    options = SessionOptions(config_dir=home / ".config" / "egressd")
    layout = plan_layout(
        options, workdir=str(project), rw=[], ro=[], show=[str(home / ".config")], environ={}, private=()
    )
    python = str(home / ".pyenv")
    profile = seatbelt_profile(layout, [3128], temp=[], home=str(home), needed=(python,))
    expected = [
        ("file-read-data", home / ".zsh_history", "deny"),
        ("file-read-data", home / ".pgpass", "deny"),
        ("file-read-data", home / "notes" / "todo.txt", "deny"),
        ("process-exec", home / ".cargo" / "bin" / "cargo", "deny"),
        ("file-read-data", home / ".gitconfig", "allow"),
        ("file-write-data", home / ".gitconfig", "deny"),
        ("file-read-data", home / ".config" / "tool.toml", "allow"),  # --show ~/.config
        ("file-read-data", home / ".config" / "gh" / "hosts.yml", "deny"),  # a credential inside it
        ("file-read-data", home / ".config" / "egressd" / "ca.key", "deny"),
        ("file-read-data", project / "main.py", "allow"),
        ("file-write-data", project / "main.py", "allow"),
        ("process-exec", home / ".pyenv" / "bin" / "python3", "allow"),
        ("file-write-data", home / ".pyenv" / "bin" / "python3", "deny"),
        ("file-write-create", home / "planted", "deny"),
        ("file-read-metadata", home, "allow"),
    ]
    for operation, path, want in expected:
        assert decide(profile, operation, str(path)) == want, (operation, path)


# -- string literals: no path breaks out ----------------------------------------------------------
@pytest.mark.parametrize(
    "text",
    [
        '/Users/a "b"',
        "/Users/a\\b",
        "/Users/trailing\\",
        '\\"',
        '"',
        '/p") (allow network*) ("',
        '/p")) (allow file-write* (subpath "/")) ((',
        "/p;(allow default)",
        '/p #"^/" #t',
        "/a(b)c",
        "/Users/ünï cödé/日本/🦀",
        "/with space/and\u00a0nbsp",
    ],
)
def test_a_literal_reads_back_as_the_same_path(text: str) -> None:
    assert sbpl.read(quote(text)) == [String(text)]


@pytest.mark.parametrize(
    "text",
    ["/a\nb", "/a\rb", "/a\tb", "/a\x00b", "/a\x1b[31m", "/a\x7f", "/a\udcffb", "/a\x0bb"],
)
def test_control_characters_and_bad_bytes_are_refused(text: str) -> None:
    with pytest.raises(UnquotablePath, match="cannot be written into a Seatbelt profile"):
        quote(text)


def test_a_hostile_directory_name_changes_no_rule() -> None:
    """A working directory named like rules stays one literal: the network and file decisions
    are those of a plain name."""
    name = '/Users/u/p") (allow network*) (allow file-write* (subpath "/")) ("'
    hostile = _profile(Layout((Mount(name, True),), (), (), ()))
    plain = _profile(Layout((Mount("/Users/u/plain", True),), (), (), ()))
    assert network_rules(hostile) == network_rules(plain)
    assert decide(hostile, "file-write-data", "/etc/passwd") == "deny"
    assert decide(hostile, "file-write-data", name + "/x") == "allow"
    assert len(sbpl.read(hostile)) == len(sbpl.read(plain))


NAMES = st.text(st.characters(exclude_categories=()), min_size=1, max_size=40).filter(
    lambda s: "/" not in s and s not in (".", "..")
)
PLACEHOLDER = "PLACEHOLDER"


def _unquotable(text: str) -> bool:
    """Control characters and lone surrogates (bytes that were not UTF-8): what quote() refuses."""
    return any(ord(c) < 0x20 or ord(c) == 0x7F or 0xD800 <= ord(c) <= 0xDFFF for c in text)


def _substituted(form: sbpl.Form, name: str) -> sbpl.Form:
    if isinstance(form, String):
        return String(form.text.replace(PLACEHOLDER, name), form.regex)
    if isinstance(form, list):
        return [_substituted(item, name) for item in form]
    return form


@settings(max_examples=300, deadline=None)
@given(NAMES)
def test_any_name_yields_the_same_rules_with_its_literals(name: str) -> None:
    """Property: the profile for any directory name parses to exactly the rules of a placeholder
    name, each literal reading back as the path given; or the name is refused as a whole."""
    if _unquotable(name):
        with pytest.raises(UnquotablePath):
            _named(name)
        return
    expected = [_substituted(form, name) for form in sbpl.read(_named(PLACEHOLDER))]
    assert sbpl.read(_named(name)) == expected


@given(st.text(st.characters(exclude_categories=())))
def test_quote_reads_back_or_refuses(text: str) -> None:
    try:
        quoted = quote(text)
    except UnquotablePath:
        assert _unquotable(text)
        return
    assert sbpl.read(quoted) == [String(text)]


def test_the_reader_refuses_what_is_not_sbpl() -> None:
    for bad in ('(allow "unterminated)', "(allow (x)", "x)", '"\\'):
        with pytest.raises(ValueError):
            sbpl.read(bad)


def test_a_proxy_port_is_required() -> None:
    with pytest.raises(ValueError, match="proxy port"):
        seatbelt_profile(LAYOUT, [], temp=TEMP, home="/Users/u")


@pytest.mark.parametrize(
    ("tmpdir", "expected"),
    [
        ("/private/var/folders/xy/abc/T", "/private/var/folders/xy/abc/T"),
        ("/private/tmp/mine", "/private/tmp/mine"),
        ("/private/tmp", "/private/tmp"),
        (None, "/private/tmp"),
        ("/Users/u", "/private/tmp"),  # the home is not where the run's directory goes
        ("/private/var/folders", "/private/tmp"),
        ("/", "/private/tmp"),
    ],
)
def test_where_the_runs_own_temporary_directory_goes(
    monkeypatch: pytest.MonkeyPatch, tmpdir: str | None, expected: str
) -> None:
    from egressd.sandbox import runner

    monkeypatch.setattr(runner.os.path, "realpath", lambda p: {"/tmp": "/private/tmp"}.get(p, p))
    monkeypatch.setattr(runner.os.path, "isdir", lambda p: True)
    assert runner.temp_root({"TMPDIR": tmpdir} if tmpdir else {}) == expected
