"""The peer `egressd-before`: egressd at an earlier commit (default 05cc838, the engine before the rebuild
of issue 14, with its native C front), prepared once into the bench's cache dir and reused.

    <cache>/egressd-<commit>/src     `git archive` of the commit (the repository the bench runs from)
    <cache>/egressd-<commit>/venv    its own venv (the same Python as the bench's), `pip install -e src`:
                                     its own dependencies, its setup.py builds the C front with gcc
    <cache>/egressd-<commit>/ready   written last: what was built (a half-prepared copy is redone)

It needs the package registries once (pip), so it is prepared before the bench leaves the network.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path

from bench import system

DEFAULT_COMMIT = "05cc838"
REPO = Path(__file__).resolve().parent.parent
# the module 05cc838's setup.py builds from egressd/engine/_tunnels.c: optional there (no compiler, no
# front), required here whenever the commit has that source — without it the baseline would be wrong
NATIVE_SOURCE = "egressd/engine/_tunnels.c"
NATIVE_MODULE = "egressd.engine._tunnels"


@dataclass(frozen=True)
class Before:
    """An egressd at `commit`, ready to run from `bin` (None: not available, `why`)."""

    commit: str  # the full hash, or what --before said when it does not resolve
    short: str
    subject: str
    root: Path | None = None
    bin: Path | None = None
    native: bool = False  # the commit has the C front and it is built
    version: str = ""
    why: str = ""

    def describe(self) -> str:
        if self.bin is None:
            return f"egressd at commit {self.short} — not available: {self.why}"
        front = "its native C front built" if self.native else "no native front at that commit"
        return f"egressd at commit {self.short} ({self.subject[:80]}), {front}; {self.version}; {self.root}"

    def as_dict(self) -> dict[str, object]:
        return {
            "commit": self.commit,
            "short": self.short,
            "subject": self.subject,
            "root": str(self.root) if self.root else None,
            "native_front": self.native,
            "version": self.version,
            "why": self.why,
        }


def _git(*args: str) -> str:
    out = subprocess.run(
        ["git", "-C", str(REPO), *args], capture_output=True, text=True, timeout=60, check=False
    )
    if out.returncode != 0:
        lines = (out.stderr or out.stdout).strip().splitlines()
        raise RuntimeError(lines[-1] if lines else f"git {args[0]} failed")
    return out.stdout.strip()


def clean_env() -> dict[str, str]:
    """The environment without PYTHONPATH/PYTHONHOME: the before-venv imports only its own egressd."""
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}


def _base_python() -> str:
    """The interpreter the bench's venv was made from (the before-venv gets the same Python)."""
    base = getattr(sys, "_base_executable", "") or sys.executable
    return base if Path(base).exists() else sys.executable


def prepare(cache: Path, commit: str = DEFAULT_COMMIT, *, install: bool = True) -> Before:
    """egressd at `commit` in its own source dir and venv under `cache` (built once, then reused)."""
    try:
        full = _git("rev-parse", "--verify", f"{commit}^{{commit}}")
        short = _git("rev-parse", "--short", full)
        subject = _git("log", "-1", "--format=%s", full)
    except (OSError, subprocess.SubprocessError, RuntimeError) as e:
        return Before(commit, commit, "", why=f"commit {commit!r} not found in {REPO}: {e}")
    base = cache / f"egressd-{full[:12]}"
    src, venv, stamp = base / "src", base / "venv", base / "ready"
    done = Before(full, short, subject, src, venv / "bin")
    if stamp.exists() and (venv / "bin" / "egressd").exists():
        try:
            info = json.loads(stamp.read_text())
            return _finish(done, info["has_native_source"], info["native_front"], str(info["version"]))
        except (OSError, ValueError, KeyError):
            pass
    if not install:
        return Before(full, short, subject, why=f"not prepared in {base} (--no-install)")
    system.log(f"egressd-before: preparing egressd at {short} in {base} (once; pip needs the registry)")
    shutil.rmtree(base, ignore_errors=True)
    src.mkdir(parents=True)
    try:
        with tempfile.TemporaryFile() as tar:
            subprocess.run(
                ["git", "-C", str(REPO), "archive", "--format=tar", full],
                stdout=tar,
                check=True,
                timeout=300,
            )
            tar.seek(0)
            with tarfile.open(fileobj=tar) as archive:
                archive.extractall(src, filter="data")
        subprocess.run([_base_python(), "-m", "venv", str(venv)], check=True, timeout=300)
        with open(base / "pip-install.log", "wb") as log:
            subprocess.run(
                [str(venv / "bin" / "python"), "-m", "pip", "install", "--disable-pip-version-check"]
                + ["-e", str(src)],
                stdout=log,
                stderr=subprocess.STDOUT,
                check=True,
                timeout=1800,
            )
    except (OSError, subprocess.SubprocessError, tarfile.TarError) as e:
        return Before(full, short, subject, why=f"could not prepare {base}: {e} (see pip-install.log)")
    has_source = (src / NATIVE_SOURCE).exists()
    # from the cache dir, without PYTHONPATH: never the bench's own tree's egressd
    check = f"import egressd, {NATIVE_MODULE}; assert egressd.__file__.startswith({str(src)!r})"
    native = has_source and (
        subprocess.run(
            [str(venv / "bin" / "python"), "-c", check],
            capture_output=True,
            cwd=base,
            env=clean_env(),
            timeout=60,
            check=False,
        ).returncode
        == 0
    )
    version = system.version_of([str(venv / "bin" / "egressd"), "--version"])  # (its own script)
    info = {"commit": full, "has_native_source": has_source, "native_front": native, "version": version}
    stamp.write_text(json.dumps(info) + "\n")
    return _finish(done, has_source, native, version)


def _finish(done: Before, has_source: bool, native: bool, version: str) -> Before:
    if has_source and not native:
        why = f"its native front ({NATIVE_MODULE}) did not build: see {done.root and done.root.parent}"
        return Before(done.commit, done.short, done.subject, why=why + "/pip-install.log")
    return Before(done.commit, done.short, done.subject, done.root, done.bin, native, version)
