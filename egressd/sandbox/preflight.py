"""Can a sandbox run here? bubblewrap is found before the proxy starts; whether the kernel lets it
make the sandbox's namespaces is the real run's to find out (a second bubblewrap started on every
run only to check would cost every run its start-up), and an empty sandbox, run once that failed,
tells why.

`egressd sandbox` never falls back to running the command unconfined: no bubblewrap, or a kernel
that refuses the user namespaces bubblewrap needs, stops it with what to do about it.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Mapping, Sequence

from egressd.sandbox.bwrap import probe_argv
from egressd.sandbox.mounts import within

BWRAP_ENV = "EGRESSD_BWRAP"
PROBE_TIMEOUT = 30.0

INSTALL_HINT = (
    "Install it: apt-get install bubblewrap (Debian, Ubuntu), dnf install bubblewrap (Fedora), "
    "pacman -S bubblewrap (Arch), apk add bubblewrap (Alpine)."
)
USERNS_ENABLE = (
    "To allow unprivileged user namespaces: `sysctl -w kernel.apparmor_restrict_unprivileged_userns=0` "
    "(Ubuntu 23.10 and later; or an AppArmor profile that allows userns for the program), "
    "`sysctl -w kernel.unprivileged_userns_clone=1` (older Debian), `sysctl -w "
    "user.max_user_namespaces=15000` (when it is 0). In a container, run it with a seccomp profile "
    "that allows clone/unshare of namespaces (e.g. --privileged)."
)
USERNS_HINT = f"The kernel refused the user namespace bubblewrap needs. {USERNS_ENABLE}"
_USERNS_SIGNS = (
    "namespace",
    "uid map",
    "gid map",
    "setgroups",
    "rtm_newaddr",
    "operation not permitted",
    "permission denied",
    "no space left",
)
NEVER_UNCONFINED = "egressd sandbox never runs the command unconfined."


class SandboxUnavailable(RuntimeError):
    """No sandbox can run here; the message says why and how to fix it."""


def locate_bwrap(
    explicit: str | None = None, env: Mapping[str, str] | None = None, writable: Sequence[str] = ()
) -> str:
    """--bwrap, else $EGRESSD_BWRAP, else `bwrap` on PATH; must be an executable file.

    `writable`: directories a sandboxed command can write (the working directory, --rw paths).
    A bwrap found there on PATH (which often leads into the project: an activated .venv/bin,
    node_modules/.bin) may be an earlier child's, and egressd runs it outside any sandbox: it is
    refused. A path the user names (--bwrap /x/bwrap) is taken as named.
    """
    env = os.environ if env is None else env
    wanted = explicit or env.get(BWRAP_ENV) or None
    if wanted is None:
        found = shutil.which("bwrap", path=env.get("PATH"))
        if found is None:
            raise SandboxUnavailable(
                f"bubblewrap (bwrap) is not installed, or not on PATH. {INSTALL_HINT} {NEVER_UNCONFINED}"
            )
        return _outside(found, writable)
    path = wanted if "/" in wanted else shutil.which(wanted, path=env.get("PATH"))
    if path is None or not (os.path.isfile(path) and os.access(path, os.X_OK)):
        origin = "--bwrap" if explicit else BWRAP_ENV
        raise SandboxUnavailable(
            f"bubblewrap not found at {wanted!r} ({origin}). {INSTALL_HINT} {NEVER_UNCONFINED}"
        )
    return path if "/" in wanted else _outside(path, writable)


def _outside(path: str, writable: Sequence[str]) -> str:
    found = os.path.abspath(path)
    for candidate in (found, os.path.realpath(found)):
        for top in writable:
            if within(candidate, top):
                raise SandboxUnavailable(
                    f"the bwrap found at {found} lies in {top}, which a sandboxed command can write "
                    "(an earlier one may have put it there), and egressd would run it unconfined; "
                    f"name the system's with --bwrap (e.g. /usr/bin/bwrap) or take {top} off PATH. "
                    f"{NEVER_UNCONFINED}"
                )
    return path


def supports_disable_userns(bwrap: str) -> bool:
    """bubblewrap 0.8 and later can forbid user namespaces inside the sandbox."""
    try:
        result = subprocess.run([bwrap, "--help"], capture_output=True, text=True, timeout=PROBE_TIMEOUT)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return "--disable-userns" in result.stdout + result.stderr


def explain_failure(message: str) -> str:
    """bubblewrap's own words plus what to do."""
    said = " ".join(message.split()) or "no message"
    if any(sign in said.lower() for sign in _USERNS_SIGNS):
        return f"bubblewrap cannot create a sandbox here ({said}). {USERNS_HINT} {NEVER_UNCONFINED}"
    return f"bubblewrap cannot create a sandbox here ({said}). {NEVER_UNCONFINED}"


def interpreter_paths() -> tuple[str, ...]:
    """The Python egressd runs on (venv and base install): it must be visible in any sandbox."""
    return tuple(dict.fromkeys(os.path.realpath(p) for p in (sys.prefix, sys.base_prefix)))


def probe(bwrap: str, disable_userns: bool) -> None:
    """Run an empty sandbox with the real namespaces; raise SandboxUnavailable, saying why and what
    to do, when it fails."""
    # from the system's directories: PATH may lead into the project (it would run confined, but a
    # probe must not depend on what a child left there)
    program = os.path.realpath(shutil.which("true", path="/usr/bin:/bin") or "/bin/true")
    argv = probe_argv(bwrap, program, disable_userns, interpreter_paths())
    # bubblewrap's words on stdout and stderr, in order
    quiet, pipe, merged = subprocess.DEVNULL, subprocess.PIPE, subprocess.STDOUT
    try:
        result = subprocess.run(argv, stdin=quiet, stdout=pipe, stderr=merged, timeout=PROBE_TIMEOUT)
    except subprocess.TimeoutExpired:
        raise SandboxUnavailable(
            f"bubblewrap did not start within {PROBE_TIMEOUT:g}s. {NEVER_UNCONFINED}"
        ) from None
    except OSError as exc:
        raise SandboxUnavailable(f"cannot run {bwrap}: {exc.strerror or exc}. {NEVER_UNCONFINED}") from None
    if result.returncode != 0:
        raise SandboxUnavailable(explain_failure(result.stdout.decode("utf-8", "replace")))


# A program every Mac has, run once under the profile: sandbox-exec loads the profile before it
# runs anything, so a profile it refuses is reported as what it is, not as the command's exit status.
PROFILE_PROBE = "/usr/bin/true"


def check_profile(sandbox_exec: str, profile: str, timeout: float = PROBE_TIMEOUT) -> str | None:
    """Why `sandbox-exec` refuses `profile` (its status and words), or None when it loads it."""
    try:
        result = subprocess.run(
            [sandbox_exec, "-p", profile, PROFILE_PROBE],
            stdin=subprocess.DEVNULL,
            capture_output=True,
            timeout=timeout,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"cannot check the sandbox profile with {sandbox_exec}: {exc}"
    if result.returncode == 0:
        return None
    said = " ".join((result.stderr or result.stdout).decode("utf-8", "replace").split())[:500]
    return (
        f"{sandbox_exec} refused egressd's sandbox profile (exit status {result.returncode}: "
        f"{said or 'no message'}); this macOS does not accept a rule egressd writes. {NEVER_UNCONFINED}"
    )


def locate_sandbox_exec() -> str:
    from egressd.sandbox.seatbelt import SANDBOX_EXEC  # macOS's: Linux never loads Seatbelt's modules

    if os.access(SANDBOX_EXEC, os.X_OK):
        return SANDBOX_EXEC
    raise SandboxUnavailable(f"{SANDBOX_EXEC} is missing: Seatbelt is not available. {NEVER_UNCONFINED}")
