"""The macOS sandbox: a Seatbelt profile (SBPL) whose only way out is egressd's proxy port.

macOS has no per-process network namespace; Seatbelt instead filters each network operation. The
profile denies all network operations, then allows outbound connections to the proxy's loopback
ports only, plus binding and accepting on loopback so the child can still run its own servers.

The known trap: `(allow network-outbound (local ip "localhost:*"))` (or `"*:*"`) reads like a
local-only allowance, but it matches the connection's LOCAL endpoint, which every outbound
connection has - so it opens outbound traffic to anywhere. This profile never filters
network-outbound on the local endpoint; `outbound_rules()` lets the tests check that.

Seatbelt applies the last matching rule, so the order below matters: deny first, allowances after.
Pure functions; `egressd sandbox` on macOS runs `sandbox-exec -p PROFILE -- CMD...`.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

SANDBOX_EXEC = "/usr/bin/sandbox-exec"

# Device files every program writes to; everything else outside the writable paths is read-only.
_DEVICE_WRITES: tuple[str, ...] = (
    '(literal "/dev/null")',
    '(literal "/dev/zero")',
    '(literal "/dev/dtracehelper")',
    '(regex #"^/dev/tty")',
    '(regex #"^/dev/fd/")',
)


def sbpl_string(text: str) -> str:
    """A double-quoted SBPL string literal."""
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def seatbelt_profile(
    proxy_ports: Sequence[int], writable: Sequence[str], readonly: Sequence[str] = ()
) -> str:
    """The profile text. Paths must be canonical (macOS: /private/tmp, not /tmp)."""
    if not proxy_ports:
        raise ValueError("the proxy port is the only way out: at least one is required")
    lines = [
        "(version 1)",
        ";; egressd sandbox: the proxy on the loopback is the only way out.",
        "(allow default)",
        "",
        ";; Network: nothing unless allowed below. This also refuses the resolver's socket",
        ";; (/private/var/run/mDNSResponder): there is no DNS inside, the proxy resolves names.",
        "(deny network*)",
        ";; The child's own servers on loopback: bind and accept only. There is deliberately no",
        ";; network-outbound rule on the LOCAL endpoint: every outbound connection has one, so",
        ";; such a rule would open outbound traffic to anywhere.",
        '(allow network-bind (local ip "localhost:*"))',
        '(allow network-inbound (local ip "localhost:*"))',
        ";; The one way out: egressd's proxy.",
        *(f'(allow network-outbound (remote ip "localhost:{int(port)}"))' for port in proxy_ports),
        "",
        ";; Files: read anywhere; write only in the working directory, --rw paths and temporary files.",
        "(deny file-write*)",
        "(allow file-write*",
        *(f"    (subpath {sbpl_string(path)})" for path in writable),
        *(f"    {rule}" for rule in _DEVICE_WRITES),
        ")",
    ]
    if readonly:
        lines += [
            ";; --ro paths stay read-only even inside a writable directory.",
            "(deny file-write*",
            *(f"    (subpath {sbpl_string(path)})" for path in readonly),
            ")",
        ]
    return "\n".join(lines) + "\n"


def seatbelt_argv(profile: str, command: Sequence[str], sandbox_exec: str = SANDBOX_EXEC) -> list[str]:
    return [sandbox_exec, "-p", profile, "--", *command]


_RULE = re.compile(r"^\((allow|deny) (network[-a-z*]*)(.*)\)$")


def network_rules(profile: str) -> list[tuple[str, str, str]]:
    """(action, operation, filter) for every network rule in the profile, for checks and tests."""
    rules = []
    for line in profile.splitlines():
        match = _RULE.match(line.strip())
        if match:
            rules.append((match.group(1), match.group(2), match.group(3).strip()))
    return rules


def outbound_rules(profile: str) -> list[str]:
    """The filters of every rule that ALLOWS an outbound connection (network-outbound or network*)."""
    return [
        filt
        for action, operation, filt in network_rules(profile)
        if action == "allow" and operation in ("network-outbound", "network*")
    ]
