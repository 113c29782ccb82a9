"""Seatbelt profiles read by a real Scheme reader, and a model of how Seatbelt applies their rules.

There is no Mac here, so a profile is checked in two steps:

1. `evaluate()` runs it through Debian's tinyscheme (the profile language is Apple's TinyScheme
   dialect) with `sbpl_prelude.scm`, which binds only the names macOS 13's profile language knows
   (`MACOS13_OPERATIONS` and the filters): a name it lacks stops the evaluation with "unbound
   variable" where `sandbox-exec` would refuse the profile. Every rule the profile makes comes
   back as data, written by the Scheme side in a length-prefixed form, so what the tests check is
   what a Scheme reader made of the text, not what egressd's own reader (sbpl.py) thinks.
2. `Model.decide()` answers allow or deny for one operation on one thing (a path, a connection, a
   Mach service, a sysctl), with Seatbelt's precedence as it is observed (Apple documents none):

   - an operation is decided at the most specific level that has a matching rule: the rules
     naming the operation itself, then each wildcard holding it from narrower to wider
     (`file-write-unlink`, `file-write*`, `file*`), then `default`. A wildcard rule never overrides
     an operation-specific one, in either order: a `(deny file-write-unlink ...)` is not undone by
     a later `(allow file-write* ...)` (sandbox-runtime relies on it), and a later
     `(deny file-read* (literal X))` does not take X back from `(allow file-read-data (subpath "/"))`
     (greywall measured it);
   - within one level the last matching rule with a filter wins, and a rule without one decides
     only when no filtered rule of its level matches (an unfiltered `(allow network-outbound)`
     after a path-filtered deny does not undo it: measured by mxc);
   - several filters in one rule: any of them; `require-all`/`require-any`/`require-not` combine.

   `Model(..., semantics="last-match")` is the plain reading (the last matching rule naming the
   operation or a wildcard of it wins). The invariant tests require egressd's denials to hold under
   both, so none of them rests on which reading is Apple's.

Network filters follow what is known of `(local|remote ip|tcp|udp "host:port")`: the host is
`localhost` (127.0.0.1 and ::1, not the IPv4-mapped ::ffff:127.0.0.1) or `*`; `ip` covers TCP and
UDP; a `local` filter on an outbound connection is checked against the socket's local address,
which for an unbound socket is the any-address, and `localhost` matches that too (the trap
seatbelt.py avoids).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

PRELUDE = Path(__file__).with_name("sbpl_prelude.scm")
TINYSCHEME = "tinyscheme"
EVALUATE_TIMEOUT = 60.0

# The operation names of macOS 13's profile language, as public reverse-engineering of its
# libsandbox lists them; `process-exec`, `ipc-posix-sem` and `ipc-posix-shm` are the older spellings
# of their wildcards, still accepted.
MACOS13_OPERATIONS: tuple[str, ...] = (
    "default",
    "appleevent-send",
    "authorization-right-obtain",
    "boot-arg-set",
    "device*",
    "device-camera",
    "device-microphone",
    "darwin-notification-post",
    "distributed-notification-post",
    "dynamic-code-generation",
    "file*",
    "file-chroot",
    "file-clone",
    "file-ioctl",
    "file-issue-extension",
    "file-link",
    "file-map-executable",
    "file-mknod",
    "file-mount",
    "file-mount-update",
    "file-read*",
    "file-read-data",
    "file-read-metadata",
    "file-read-xattr",
    "file-revoke",
    "file-search",
    "file-test-existence",
    "file-unmount",
    "file-write*",
    "file-write-acl",
    "file-write-create",
    "file-write-data",
    "file-write-finderinfo",
    "file-write-flags",
    "file-write-mode",
    "file-write-owner",
    "file-write-setugid",
    "file-write-times",
    "file-write-unlink",
    "file-write-xattr",
    "fs-rename",
    "fs-snapshot*",
    "fs-snapshot-create",
    "fs-snapshot-delete",
    "fs-snapshot-revert",
    "generic-issue-extension",
    "qtn-user",
    "hid-control",
    "iokit*",
    "iokit-issue-extension",
    "iokit-open",
    "iokit-set-properties",
    "iokit-get-properties",
    "ipc*",
    "ipc-posix*",
    "ipc-posix-issue-extension",
    "ipc-posix-sem*",
    "ipc-posix-sem",
    "ipc-posix-sem-create",
    "ipc-posix-sem-open",
    "ipc-posix-sem-post",
    "ipc-posix-sem-unlink",
    "ipc-posix-sem-wait",
    "ipc-posix-shm*",
    "ipc-posix-shm",
    "ipc-posix-shm-read*",
    "ipc-posix-shm-read-data",
    "ipc-posix-shm-read-metadata",
    "ipc-posix-shm-write*",
    "ipc-posix-shm-write-create",
    "ipc-posix-shm-write-data",
    "ipc-posix-shm-write-unlink",
    "ipc-sysv*",
    "ipc-sysv-msg",
    "ipc-sysv-sem",
    "ipc-sysv-shm",
    "job-creation",
    "load-unsigned-code",
    "lsopen",
    "mach*",
    "mach-cross-domain-lookup",
    "mach-host*",
    "mach-host-exception-port-set",
    "mach-host-special-port-set",
    "mach-issue-extension",
    "mach-lookup",
    "mach-per-user-lookup",
    "mach-priv*",
    "mach-priv-host-port",
    "mach-priv-task-port",
    "mach-register",
    "mach-task-name",
    "network*",
    "network-inbound",
    "network-bind",
    "network-outbound",
    "nvram*",
    "nvram-delete",
    "nvram-get",
    "nvram-set",
    "opendirectory-user-modify",
    "process*",
    "process-codesigning-status*",
    "process-codesigning-status-set",
    "process-codesigning-status-get",
    "process-exec*",
    "process-exec",
    "process-exec-interpreter",
    "process-fork",
    "process-info*",
    "process-info-codesignature",
    "process-info-dirtycontrol",
    "process-info-listpids",
    "process-info-rusage",
    "process-info-pidinfo",
    "process-info-pidfdinfo",
    "process-info-pidfileportinfo",
    "process-info-setcontrol",
    "pseudo-tty",
    "signal",
    "socket-ioctl",
    "sysctl*",
    "sysctl-read",
    "sysctl-write",
    "system*",
    "system-acct",
    "system-audit",
    "system-automount",
    "system-chud",
    "system-debug",
    "system-fsctl",
    "system-info",
    "system-kext*",
    "system-kext-load",
    "system-kext-unload",
    "system-kext-query",
    "system-mac-label",
    "system-nfssvc",
    "system-package-check",
    "system-privilege",
    "system-reboot",
    "system-sched",
    "system-set-time",
    "system-socket",
    "system-suspend-resume",
    "system-swap",
    "user-preference*",
    "user-preference-read",
    "managed-preference-read",
    "user-preference-write",
    "storage-class-map",
)
ALIASES = {
    "process-exec": "process-exec*",
    "ipc-posix-sem": "ipc-posix-sem*",
    "ipc-posix-shm": "ipc-posix-shm*",
}
WILDCARDS = tuple(op for op in MACOS13_OPERATIONS if op.endswith("*"))
# Every way to change a file (or what a path leads to), for the "never written" invariants.
WRITE_OPERATIONS: tuple[str, ...] = (
    *(op for op in MACOS13_OPERATIONS if op.startswith("file-write-")),
    "file-link",
    "file-clone",
    "file-mknod",
    "file-revoke",
    "file-chroot",
    "file-mount",
    "file-mount-update",
    "file-unmount",
    "fs-rename",
)
READ_OPERATIONS: tuple[str, ...] = (
    "file-read-data",
    "file-read-metadata",
    "file-read-xattr",
    "file-map-executable",
)
EXEC_OPERATIONS: tuple[str, ...] = ("process-exec", "process-exec-interpreter")

LOOPBACK = frozenset({"127.0.0.1", "::1"})
ANY_ADDRESS = frozenset({"0.0.0.0", "::"})


class ProfileError(Exception):
    """The profile does not evaluate (sandbox-exec would refuse it); the message is tinyscheme's."""


class ModelError(Exception):
    """A rule the model does not understand: it must learn it rather than guess."""


@dataclass(frozen=True)
class Sym:
    name: str


@dataclass(frozen=True)
class Regex:
    text: str


Datum = str | int | Sym | Regex | list["Datum"]


@dataclass(frozen=True)
class Rule:
    action: str
    operations: tuple[str, ...]
    filters: tuple[Datum, ...]
    modifiers: tuple[str, ...]


def tinyscheme_available() -> bool:
    return shutil.which(TINYSCHEME) is not None


def _prelude() -> str:
    ops = "\n".join(f"(define {op} '{op})" for op in MACOS13_OPERATIONS)
    return PRELUDE.read_text() + "\n" + ops + "\n"


def _params(params: Mapping[str, str]) -> str:
    def string(text: str) -> str:
        return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'

    # keyed by symbol: this tinyscheme cannot compare strings (its string-ref is broken)
    pairs = " ".join(f"(cons (string->symbol {string(k)}) {string(v)})" for k, v in params.items())
    return f"(set! *params* (list {pairs}))\n"


def evaluate(profile: str, params: Mapping[str, str] | None = None) -> list[Rule]:
    """The rules `profile` makes, as tinyscheme evaluates it; ProfileError when it does not."""
    with tempfile.TemporaryDirectory(prefix="sbpl-") as work:
        prelude = os.path.join(work, "prelude.scm")
        text = os.path.join(work, "profile.sb")
        Path(prelude).write_text(_prelude() + _params(params or {}))
        Path(text).write_bytes(profile.encode("utf-8"))
        result = subprocess.run(
            [TINYSCHEME, prelude, text],
            capture_output=True,
            timeout=EVALUATE_TIMEOUT,
            cwd=work,
        )
    out = result.stdout
    if result.returncode != 0 or b"Error:" in out:
        at = out.find(b"Error:")
        said = (out[at:] if at >= 0 else out[-500:]).decode("utf-8", "replace") + result.stderr.decode(
            "utf-8", "replace"
        )
        raise ProfileError(" ".join(said.split()))
    return [_rule(form) for form in _parse(out)]


def _parse(data: bytes) -> list[Datum]:
    forms: list[Datum] = []
    i = 0
    while i < len(data):
        if data[i : i + 1] in (b"\n", b" "):
            i += 1
            continue
        form, i = _datum(data, i)
        forms.append(form)
    return forms


def _datum(data: bytes, i: int) -> tuple[Datum, int]:
    kind = data[i : i + 1]
    if kind == b"(":
        items: list[Datum] = []
        i += 1
        while data[i : i + 1] != b")":
            item, i = _datum(data, i)
            items.append(item)
        return items, i + 1
    if kind in (b"s", b"y"):
        colon = data.index(b":", i)
        length = int(data[i + 1 : colon])
        text = data[colon + 1 : colon + 1 + length].decode("utf-8", "surrogateescape")
        return (text if kind == b"s" else Sym(text)), colon + 1 + length
    if kind == b"n":
        end = data.index(b";", i)
        return int(data[i + 1 : end]), end + 1
    raise ModelError(f"unreadable evaluator output at {i}: {data[i : i + 40]!r}")


def _rule(form: Datum) -> Rule:
    if not (isinstance(form, list) and form and isinstance(form[0], Sym)):
        raise ModelError(f"not a rule: {form!r}")
    head = form[0].name
    if head == "version":
        return Rule("version", (), tuple(form[1:]), ())
    operations, filters, modifiers = [], [], []
    for item in form[1:]:
        if isinstance(item, Sym):
            operations.append(ALIASES.get(item.name, item.name))
        elif isinstance(item, list) and item and item[0] == Sym("with"):
            modifiers += [m.name if isinstance(m, Sym) else str(m) for m in item[1:]]
        else:
            filters.append(_regexes(item))
    return Rule(head, tuple(operations), tuple(filters), tuple(modifiers))


def _regexes(item: Datum) -> Datum:
    """(regex-literal "x") lists become Regex values."""
    if isinstance(item, list):
        if len(item) == 2 and item[0] == Sym("regex-literal") and isinstance(item[1], str):
            return Regex(item[1])
        return [_regexes(i) for i in item]
    return item


def chain(operation: str) -> list[str]:
    """The levels that decide `operation`: itself, its wildcards from narrower to wider, default."""
    operation = ALIASES.get(operation, operation)
    if operation not in MACOS13_OPERATIONS:
        raise ModelError(f"unknown operation {operation!r}")
    wild = [w for w in WILDCARDS if w != operation and operation.startswith(w[:-1])]
    levels = [operation, *sorted(wild, key=len, reverse=True)]
    return [*levels, "default"] if operation != "default" else levels


class Model:
    def __init__(self, rules: Sequence[Rule], semantics: str = "seatbelt") -> None:
        if semantics not in ("seatbelt", "last-match"):
            raise ValueError(semantics)
        self.rules = [r for r in rules if r.action in ("allow", "deny")]
        self.semantics = semantics

    @classmethod
    def of(cls, profile: str, semantics: str = "seatbelt", params: Mapping[str, str] | None = None) -> Model:
        return cls(evaluate(profile, params), semantics)

    def decide(self, operation: str, **probe: object) -> str:
        """ "allow" or "deny" for `operation` on what `probe` describes: path=, remote=/local=
        (kind, host, port) with kind tcp/udp/unix, target= ("same-sandbox" or "other"), name= (a
        Mach service), sysctl=, ioctl= (a number), vnode=."""
        levels = chain(operation)
        if self.semantics == "last-match":
            decision = "allow"  # a profile without a default rule allows
            for rule in self.rules:
                if any(level in rule.operations for level in levels) and (
                    not rule.filters or any(_matches(f, probe) for f in rule.filters)
                ):
                    decision = rule.action
            return decision
        for level in levels:
            named = [r for r in self.rules if level in r.operations]
            filtered = [r for r in named if r.filters and any(_matches(f, probe) for f in r.filters)]
            if filtered:
                return filtered[-1].action
            plain = [r for r in named if not r.filters]
            if plain:
                return plain[-1].action
        return "allow"

    def rules_for(self, operation: str) -> list[Rule]:
        return [r for r in self.rules if operation in r.operations]


def _text(value: Datum) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, Regex):
        return value.text
    raise ModelError(f"expected a string, got {value!r}")


def _within(path: str, top: str) -> bool:
    top = top.rstrip("/") or "/"
    return path == top or path.startswith(top if top == "/" else top + "/")


def _path_match(kind: str, arg: Datum, path: object) -> bool:
    if not isinstance(path, str):
        return False
    if kind == "literal":
        return path == _text(arg)
    if kind == "subpath":
        return _within(path, _text(arg))
    if kind == "prefix":
        return path.startswith(_text(arg))
    if kind == "regex":
        return re.search(_text(arg), path) is not None
    raise ModelError(kind)


def _address(spec: str, endpoint: object, local: bool) -> bool:
    if not (isinstance(endpoint, tuple) and len(endpoint) == 3):
        return False
    _kind, host, port = endpoint
    want_host, _, want_port = spec.rpartition(":")
    if want_port != "*" and str(port) != want_port:
        return False
    if want_host == "*":
        return True
    if want_host == "localhost":
        return host in LOOPBACK or (local and host in ANY_ADDRESS)
    raise ModelError(f"a network filter host Seatbelt does not take: {spec!r}")


def _network(filt: list[Datum], probe: Mapping[str, object], side: str) -> bool:
    endpoint = probe.get(side)
    if not (isinstance(endpoint, tuple) and len(endpoint) == 3):
        return False
    proto = filt[1] if len(filt) > 1 else None
    if not isinstance(proto, Sym):
        raise ModelError(f"a network filter without a protocol: {filt!r}")
    kind = endpoint[0]
    if proto.name == "unix-socket":
        if kind != "unix":
            return False
        inner = filt[2:]
        return not inner or any(_matches(f, {"path": endpoint[1]}) for f in inner)
    if kind == "unix" or (proto.name == "tcp" and kind != "tcp") or (proto.name == "udp" and kind != "udp"):
        return False
    if proto.name not in ("ip", "tcp", "udp"):
        raise ModelError(f"a network protocol the model does not know: {proto.name}")
    if len(filt) == 2:
        return True
    return _address(_text(filt[2]), endpoint, side == "local")


def _matches(filt: Datum, probe: Mapping[str, object]) -> bool:
    if not (isinstance(filt, list) and filt and isinstance(filt[0], Sym)):
        raise ModelError(f"not a filter: {filt!r}")
    kind, args = filt[0].name, filt[1:]
    if kind in ("literal", "subpath", "prefix", "regex"):
        return _path_match(kind, args[0], probe.get("path"))
    if kind == "require-all":
        return all(_matches(f, probe) for f in args)
    if kind == "require-any":
        return any(_matches(f, probe) for f in args)
    if kind == "require-not":
        return not _matches(args[0], probe)
    if kind in ("remote", "local"):
        return _network(filt, probe, kind)
    if kind == "target":
        return isinstance(args[0], Sym) and probe.get("target") == args[0].name
    names = {
        "global-name": "name",
        "global-name-prefix": "name",
        "global-name-regex": "name",
        "local-name": "local_name",
        "local-name-prefix": "local_name",
        "sysctl-name": "sysctl",
        "sysctl-name-prefix": "sysctl",
        "sysctl-name-regex": "sysctl",
        "ipc-posix-name": "ipc_name",
        "ipc-posix-name-prefix": "ipc_name",
        "ipc-posix-name-regex": "ipc_name",
    }
    if kind in names:
        value = probe.get(names[kind])
        if not isinstance(value, str):
            return False
        if kind.endswith("-regex"):
            return re.search(_text(args[0]), value) is not None
        if kind.endswith("-prefix"):
            return value.startswith(_text(args[0]))
        return value == _text(args[0])
    if kind == "ioctl-command":
        return probe.get("ioctl") == args[0]
    if kind == "vnode-type":
        return isinstance(args[0], Sym) and probe.get("vnode") == args[0].name
    if kind in ("socket-domain", "socket-type", "socket-protocol"):
        want = args[0].name if isinstance(args[0], Sym) else args[0]
        return probe.get(kind.replace("-", "_")) == want
    if kind in ("extension", "iokit-registry-entry-class", "iokit-user-client-class"):
        return False  # no probe holds an extension or opens IOKit
    raise ModelError(f"a filter the model does not know: {kind}")
