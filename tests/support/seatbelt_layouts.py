"""Helpers that several test modules use (so none imports another), from the tests of: The macOS
Seatbelt profile and argv, golden, checked on any platform (sandbox-exec never runs here)."""

from __future__ import annotations

from egressd.sandbox.layout import Layout
from egressd.sandbox.mounts import Mount
from egressd.sandbox.seatbelt import (
    run_marker,
    seatbelt_profile,
)
from egressd.sandbox.shields import Cover

# A project with --ro .git, the policy inside it (so its directory is pinned), egressd installed by
# Homebrew, the audit in /tmp, credentials hidden (the ssh-agent's socket under /private/tmp), one
# file shown inside ~/.ssh and the CA bundle inside egressd's hidden home.
LAYOUT = Layout(
    mounts=(Mount("/Users/u/project", True), Mount("/Users/u/project/.git", False)),
    covers=(
        Cover("/Users/u/project/tools/policy.yaml", "ro"),
        Cover("/Users/u/project/tools", "pin"),
        Cover("/Users/u/.config/egressd", "tmpfs"),
        Cover("/Users/u/.ssh", "tmpfs"),
        Cover("/Users/u/.npmrc", "empty"),
        Cover("/private/tmp/com.apple.launchd.abc/Listeners", "empty"),
        Cover("/Users/u/.ssh/known_hosts", "ro"),
    ),
    hidden=(
        "/Users/u/.config/egressd",
        "/Users/u/.ssh",
        "/Users/u/.npmrc",
        "/private/tmp/com.apple.launchd.abc/Listeners",
    ),
    shown=("/Users/u/.ssh/known_hosts",),
    guarded=(
        "/opt/homebrew/Cellar/egressd/1.0/libexec",
        "/Users/u/project/tools/policy.yaml",
        "/private/tmp/egressd-audit/audit.jsonl",
    ),
)


TEMP = ["/private/var/folders/xy/T/egressd-run-abc"]


MARKER = run_marker("0123abcd")


NEEDED = ("/opt/homebrew/Cellar/egressd/1.0/libexec", "/Users/u/.config/egressd/ca.pem")


def _profile(layout: Layout = LAYOUT) -> str:
    return seatbelt_profile(
        layout,
        [49152, 49153],
        temp=TEMP,
        home="/Users/u",
        needed=NEEDED,
        terminals=["/dev/ttys003"],
        marker=MARKER,
    )


def _named(name: str) -> str:
    """A profile with `name` in every role: a writable mount, --ro and hidden paths inside it, a
    guarded file, a temp dir and a terminal."""
    top = f"/Users/u/{name}"
    layout = Layout(
        (Mount(top, True), Mount(f"{top}/{name}.git", False)),
        (Cover(f"{top}/{name}/.env", "empty"), Cover(f"{top}/{name}", "pin")),
        (f"{top}/{name}/.env",),
        (),
        None,
        (f"{top}/{name}/policy.yaml",),
        absent=(f"/Users/u/.{name}",),
    )
    return seatbelt_profile(
        layout, [3128], temp=[f"/private/tmp/{name}"], home="/Users/u", terminals=[f"/dev/{name}"]
    )


