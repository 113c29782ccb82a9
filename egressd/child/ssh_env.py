"""`GIT_SSH_COMMAND` through the proxy: git over SSH as a CONNECT decided like any other request.

Set when the policy may allow SSH at all; ssh then reaches the server through
`python -m egressd.child.connect %h %p` (an SSH ProxyCommand egressd ships), so there is no socat or nc
requirement and, in the sandbox, no other way to reach port 22. A GIT_SSH_COMMAND (or GIT_SSH)
the user already set is kept: the ProxyCommand option is appended to it.
"""

from __future__ import annotations

import shlex
import sys
from collections.abc import Mapping
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # not at run time: `exec --attach` imports this module, and not the policy
    from egressd.policy import Policy

SSH_PORT = 22


def ssh_may_be_allowed(policy: Policy) -> bool:
    """True when some SSH connection could be allowed: mode allow/learn/ask, or an allow rule for port 22
    or for any port (never in mode off)."""
    if policy.mode == "off":
        return False
    if policy.mode in ("allow", "learn", "ask"):
        return True
    return any(rule.port is None or rule.port == SSH_PORT for rule in policy.allow.rules)


def proxy_command(python: str | None = None) -> str:
    """The ssh ProxyCommand value (ssh runs it with the user's shell: quoted accordingly)."""
    return f"{shlex.quote(python or sys.executable)} -I -m egressd.child.connect %h %p"


def git_ssh_command(base: str | None = None, python: str | None = None) -> str:
    option = shlex.quote(f"ProxyCommand={proxy_command(python)}")
    return f"{base or 'ssh'} -o {option}"


def with_git_ssh(env: Mapping[str, str], policy: Policy, python: str | None = None) -> dict[str, str]:
    """The child environment plus GIT_SSH_COMMAND when the policy may allow SSH."""
    return add_git_ssh(env, python) if ssh_may_be_allowed(policy) else dict(env)


def add_git_ssh(env: Mapping[str, str], python: str | None = None) -> dict[str, str]:
    """The environment plus GIT_SSH_COMMAND through egressd (a user's own command kept)."""
    out = dict(env)
    base = out.get("GIT_SSH_COMMAND") or (shlex.quote(out["GIT_SSH"]) if out.get("GIT_SSH") else None)
    out["GIT_SSH_COMMAND"] = git_ssh_command(base, python)
    return out
