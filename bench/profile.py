"""Summaries of the py-spy profiles `--profile` records (collapsed stacks, `--format raw`).

    .venv/bin/python -m bench.profile bench/results/<run>/profiles/setup-egressd.txt

prints where egressd's CPU went: by package/module of the innermost frame (self time), the hottest
functions (self) and the frames most often on the stack (inclusive).
"""

from __future__ import annotations

import argparse
import re
import sysconfig
from collections import Counter
from pathlib import Path

_PROXY_THREAD = "ProxyServer._thread_main"
_FRAME = re.compile(r"^(?P<func>.*?) \((?P<file>[^()]*?)(?::(?P<line>\d+))?\)$")


def _frame(text: str) -> tuple[str, str]:
    """(function, file) of one py-spy frame `func (path/to/file.py:123)`."""
    m = _FRAME.match(text.strip())
    if not m:
        return text.strip(), ""
    return m.group("func"), m.group("file")


_STDLIB = Path(sysconfig.get_paths()["stdlib"])


def _area(path: str) -> str:
    """A readable owner for a frame's file: `stdlib`, or the package and module (mitmproxy 3 deep)."""
    rel = path.split("site-packages/", 1)[-1]
    if rel.startswith("<") or (_STDLIB / rel).exists():
        return "stdlib " + rel.split("/", 1)[0].removesuffix(".py")
    parts = rel.removesuffix(".py").split("/")
    depth = 3 if parts[0] == "mitmproxy" else 2
    return ".".join(parts[:depth])


def summarize(path: Path, top: int = 25) -> str:
    self_time: Counter[str] = Counter()
    inclusive: Counter[str] = Counter()
    areas: Counter[str] = Counter()
    total = 0
    lines = path.read_text(errors="replace").splitlines()
    # egressd runs mitmproxy in its own thread: keep that thread (the main one only waits for signals)
    proxy_only = any(_PROXY_THREAD in line for line in lines)
    for line in lines:
        stack, _, count_text = line.rpartition(" ")
        if not stack or not count_text.isdigit() or (proxy_only and _PROXY_THREAD not in stack):
            continue
        count = int(count_text)
        frames = [f for f in stack.split(";") if "(" in f]
        if not frames:
            continue
        total += count
        func, file = _frame(frames[-1])
        self_time[f"{func} ({_short(file)})"] += count
        areas[_area(file)] += count
        for name in {f"{_frame(f)[0]} ({_short(_frame(f)[1])})" for f in frames}:
            inclusive[name] += count
    if not total:
        return f"{path.name}: no samples\n"
    scope = "the proxy thread's CPU-active stacks" if proxy_only else "CPU-active stacks"
    out = [f"# {path.name}: {total} samples ({scope})", "", "## Self time by area", ""]
    out += [f"{100 * c / total:5.1f}%  {a}" for a, c in areas.most_common(top)]
    out += ["", "## Hottest functions (self)", ""]
    out += [f"{100 * c / total:5.1f}%  {f}" for f, c in self_time.most_common(top)]
    out += ["", "## Most often on the stack (inclusive)", ""]
    out += [f"{100 * c / total:5.1f}%  {f}" for f, c in inclusive.most_common(top)]
    return "\n".join(out) + "\n"


def _short(path: str) -> str:
    for marker in ("site-packages/", "/work/main/"):
        if marker in path:
            return path.split(marker, 1)[1]
    return path.rsplit("/lib/", 1)[-1]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("profiles", nargs="+", type=Path)
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args()
    for path in args.profiles:
        print(summarize(path, args.top))


if __name__ == "__main__":
    main()
