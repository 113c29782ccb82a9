"""A short run of each fuzz harness in fuzz/ (coverage-guided with atheris), as part of the suite.

Why: the harnesses must keep working as the code changes (an import or API change would otherwise
only show in the next long run), and a short run over the seed corpus already replays every seed
through every property. The long run is a documented command (fuzz/README.md).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

FUZZ = Path(__file__).resolve().parents[2] / "fuzz"
HARNESSES = ("fuzz_hosts.py", "fuzz_policy.py", "fuzz_request_head.py")
SECONDS = 3


def _start(
    harness: str, work: Path, *options: str, env: dict[str, str] | None = None
) -> subprocess.Popen[str]:
    corpus = work / harness.removesuffix(".py")
    corpus.mkdir(parents=True, exist_ok=True)
    return subprocess.Popen(
        [sys.executable, str(FUZZ / harness), *options, f"-artifact_prefix={work}/", str(corpus)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )


def test_each_harness_runs_clean(tmp_path: Path) -> None:
    """All three harnesses in parallel for a few seconds each: exit 0, no crash file."""
    started = time.monotonic()
    # instrument egressd's own code only: the same properties, a quicker start than the full list
    env = dict(os.environ, EGRESSD_FUZZ_INSTRUMENT="egressd,addons")
    options = (f"-max_total_time={SECONDS}", "-timeout=10")
    procs = {h: _start(h, tmp_path, *options, env=env) for h in HARNESSES}
    for harness, proc in procs.items():
        out, _ = proc.communicate(timeout=120)
        assert proc.returncode == 0, f"{harness}:\n{out[-4000:]}"
        assert "Done" in out or "no failure" in out, out[-2000:]
    assert not list(tmp_path.glob("crash-*")), "a harness wrote a crash input"
    assert time.monotonic() - started < 60


@pytest.mark.parametrize("harness", HARNESSES)
def test_fallback_without_atheris(tmp_path: Path, harness: str) -> None:
    """Where atheris has no wheel, the same harness runs as a plain mutation loop."""
    env = dict(os.environ, EGRESSD_FUZZ_NO_ATHERIS="1")
    proc = _start(harness, tmp_path, "-runs=300", "-seed=1", env=env)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, out[-4000:]
    assert "no failure" in out
