"""`egressd sandbox --explain`: what the child would see, read and write, without running anything.

Read from the same Layout bubblewrap and Seatbelt get, so it cannot describe another sandbox than
the one that runs.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Sequence

from egressd.sandbox.layout import Layout
from egressd.sandbox.mounts import within

WIDTH = 44


def _line(path: str, what: str) -> str:
    return f"  {path:<{WIDTH}} {what}" if len(path) <= WIDTH else f"  {path}\n  {'':<{WIDTH}} {what}"


def _what(layout: Layout, path: str, default: str) -> str:
    return dict(layout.notes).get(path, default)


def _home_entries(layout: Layout, home: str, needed: Sequence[str]) -> list[str]:
    """The names in the home the child does not see, each marked when part of it is shown."""
    try:
        names = sorted(os.listdir(home))
    except OSError:
        return []
    shown = [*(m.path for m in layout.mounts), *layout.revealed, *needed]
    entries = []
    for name in names:
        path = os.path.join(home, name)
        if not layout.hides(path):
            continue
        partly = any(within(p, path) and p != path for p in shown)
        entries.append(f"{name} (partly shown)" if partly else name)
    return entries


def explain(layout: Layout, needed: Sequence[str], *, workdir: str, kind: str) -> str:
    """The text --explain prints: writable, read-only and hidden paths, with what each is."""
    home = layout.masked[0] if layout.masked else None
    lines = [f"egressd sandbox ({kind}), as it would start here; nothing was run.", "", "Writable:"]
    for mount in layout.mounts:
        if mount.writable:
            what = "the working directory" if mount.path == os.path.realpath(workdir) else "--rw"
            lines.append(_line(mount.path, "--cache" if mount.path == layout.cache else what))
    if layout.private:
        lines.append(_line("/tmp, /run", "private and empty, the sandbox's own"))
    lines += ["", "Read-only:", _line("/", "everything not listed here")]
    for mount in layout.mounts:
        if not mount.writable:
            lines.append(_line(mount.path, "--ro"))
    for path in layout.revealed:
        what = "shown by default (harmless configuration)" if path in layout.harmless else "--show"
        lines.append(_line(path, what))
    for cover in layout.covers:
        if cover.kind == "ro" and cover.path in layout.guarded:
            lines.append(_line(cover.path, _what(layout, cover.path, "egressd's own")))
    for path in needed:
        if layout.hides(path):  # shown for egressd's launcher: nothing else shows it
            lines.append(_line(path, "egressd's Python, package or CA bundle"))
    lines += ["", "Read-only: the project's hooks (they run code outside the sandbox later)"]
    covered = {c.path for c in layout.covers if c.kind == "ro"}
    missing = {p.path for p in layout.placeholders}
    for path, why in layout.hooks:
        if path in covered:
            lines.append(_line(path, f"{why}{'; missing: cannot be created' if path in missing else ''}"))
    if not layout.hooks:
        lines.append("  none: with --allow-project-hooks the child can write them")
    lines += ["", "Hidden:"]
    if home:
        lines.append(_line(home, "your home: empty and read-only but for the paths above"))
        entries = _home_entries(layout, home, needed)
        if entries:
            lines.append(f"    hidden in it: {', '.join(entries)}")
    for path in layout.hidden:
        what = _what(layout, path, "hidden")
        if home and within(path, home) and _only_masked(layout, path, home):
            what += " (in your home)"
        lines.append(_line(path, what))
    if layout.withheld:
        lines += ["", "Listed as harmless configuration but not shown:"]
        lines += [_line(path, f"{why}; --show it if you trust it") for path, why in layout.withheld]
    lines += [
        "",
        "A program that needs a file in your home: --show PATH (read-only) or --rw PATH.",
    ]
    return "\n".join(lines) + "\n"


def _only_masked(layout: Layout, path: str, home: str) -> bool:
    """The masked home alone hides `path`: no shown path holds it."""
    shown = [*(m.path for m in layout.mounts), *layout.revealed]
    return not any(within(path, s) for s in shown if s != home)


def home_hint(layout: Layout, command: Sequence[str], returncode: int, path: str | None) -> str | None:
    """The line egressd prints when the child failed and the masked home may be why: the command
    itself lives there, or a file it wanted may."""
    if returncode <= 0 or not layout.masked or not command:
        return None
    home = layout.masked[0]
    found = shutil.which(command[0], path=path)
    if found is not None:
        real = os.path.realpath(found)
        if layout.hides(os.path.abspath(found)) or layout.hides(real):
            where = os.path.dirname(os.path.abspath(found))
            more = f" and --show {os.path.dirname(real)}" if not within(real, where) else ""
            return (
                f"{command[0]} is {found}, in your home, which the sandbox hides: "
                f"--show {where}{more} lets it run"
            )
    return (
        f"{command[0]} exited with status {returncode}; inside the sandbox your home ({home}) is "
        "empty but for the working directory, --rw/--ro/--show paths and a few configuration "
        "files: if it needed a file there, give --show PATH (egressd sandbox --explain lists what "
        "is hidden)"
    )
