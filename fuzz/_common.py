"""Shared runner for egressd's fuzz harnesses: atheris (coverage-guided libFuzzer) when installed,
otherwise a small random-mutation loop over the seed corpus with the same command line.

Why a fallback: the harnesses are part of the test suite (tests/fuzz/test_fuzz_smoke.py); a machine where
atheris has no wheel should still run them, just without coverage guidance.

Command line (libFuzzer's; the fallback understands the same subset):
    python fuzz/fuzz_hosts.py [-max_total_time=S] [-runs=N] [-timeout=S] [-artifact_prefix=DIR/]
                              [CORPUS_DIR...]
"""

from __future__ import annotations

import contextlib
import os
import random
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

SEEDS = Path(__file__).resolve().parent / "corpus"
INSTRUMENT = ["egressd", "addons", "idna", "h11", "mitmproxy.net", "yaml", "tests.support.reference"]
# idna's generated data tables are huge and branch-free: instrumenting them costs seconds, finds nothing
NOT_INSTRUMENTED = ["idna.idnadata", "idna.uts46data", "idna.package_data"]


def atheris_or_none() -> ModuleType | None:
    if os.environ.get("EGRESSD_FUZZ_NO_ATHERIS"):
        return None
    try:
        import atheris
    except ImportError:
        return None
    return atheris


@contextlib.contextmanager
def instrumented() -> Iterator[None]:
    """Import the code under test with atheris' coverage instrumentation (a no-op without atheris)."""
    atheris = atheris_or_none()
    if atheris is None:
        yield
        return
    # EGRESSD_FUZZ_INSTRUMENT=egressd,addons narrows the instrumentation (faster start: the smoke test)
    include = [m for m in os.environ.get("EGRESSD_FUZZ_INSTRUMENT", "").split(",") if m] or INSTRUMENT
    with atheris.instrument_imports(include=include, exclude=NOT_INSTRUMENTED):
        yield


def main(test_one_input: Callable[[bytes], None], seeds: str) -> None:
    """Fuzz ``test_one_input``; the seed corpus ``fuzz/corpus/<seeds>`` is always read too.

    libFuzzer writes new inputs into the FIRST corpus directory: without one on the command line
    that is a work directory under the system temp dir, never the seed corpus in the repository;
    crash inputs go there too unless ``-artifact_prefix`` says otherwise.
    """
    argv = list(sys.argv)
    positional = [a for a in argv[1:] if not a.startswith("-")]
    if any(Path(a).is_file() for a in positional):  # replay: run exactly those inputs
        _run(argv, test_one_input)
        return
    work = Path(tempfile.gettempdir()) / "egressd-fuzz" / seeds
    if not positional:
        work.mkdir(parents=True, exist_ok=True)
        argv.append(str(work))
    if not any(a.startswith("-artifact_prefix=") for a in argv):
        work.mkdir(parents=True, exist_ok=True)
        argv.insert(1, f"-artifact_prefix={work}/")
    seed_dir = SEEDS / seeds
    if seed_dir.is_dir() and str(seed_dir) not in argv:
        argv.append(str(seed_dir))
    _run(argv, test_one_input)


def _run(argv: list[str], test_one_input: Callable[[bytes], None]) -> None:
    atheris = atheris_or_none()
    if atheris is not None:
        atheris.Setup(argv, test_one_input)
        atheris.Fuzz()
        return
    sys.exit(_fallback(argv, test_one_input))


def _option(argv: list[str], name: str, default: float) -> float:
    for arg in argv:
        if arg.startswith(f"-{name}="):
            return float(arg.split("=", 1)[1])
    return default


def _seeds(argv: list[str]) -> list[bytes]:
    out: list[bytes] = []
    for arg in argv[1:]:
        if arg.startswith("-"):
            continue
        path = Path(arg)
        files = sorted(p for p in path.iterdir() if p.is_file()) if path.is_dir() else [path]
        out.extend(p.read_bytes() for p in files if p.is_file())
    return out or [b""]


def _mutate(rng: random.Random, data: bytes, pool: list[bytes]) -> bytes:
    buf = bytearray(data)
    for _ in range(rng.randint(1, 4)):
        choice = rng.randrange(5)
        position = rng.randint(0, len(buf))
        if choice == 0 and buf:
            buf[min(position, len(buf) - 1)] ^= 1 << rng.randrange(8)
        elif choice == 1:
            buf[position:position] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 4)))
        elif choice == 2 and buf:
            del buf[position : position + rng.randint(1, 8)]
        elif choice == 3:
            other = rng.choice(pool)
            start = rng.randint(0, len(other))
            buf[position:position] = other[start : start + rng.randint(1, 32)]
        else:
            token = rng.choice(
                [b".", b":", b"[", b"]", b"%", b"@", b"0x", b"\r\n", b"\n", b" ", b"\x00", b"::"]
            )
            buf[position:position] = token
    return bytes(buf)


def _fallback(argv: list[str], test_one_input: Callable[[bytes], None]) -> int:
    budget = _option(argv, "max_total_time", 10.0)
    runs = int(_option(argv, "runs", -1))
    prefix = next((a.split("=", 1)[1] for a in argv if a.startswith("-artifact_prefix=")), "./")
    pool = _seeds(argv)
    if any(Path(a).is_file() for a in argv[1:] if not a.startswith("-")):
        runs = len(pool)  # replay exactly the given inputs
    rng = random.Random(int(_option(argv, "seed", time.time())))
    deadline = time.monotonic() + budget
    done = 0
    inputs = iter(pool)
    print(f"egressd fuzz: atheris not available; random mutation for {budget:g}s", file=sys.stderr)
    while time.monotonic() < deadline and (runs < 0 or done < runs):
        data = next(inputs, None)
        if data is None:
            data = _mutate(rng, rng.choice(pool), pool)
        try:
            test_one_input(data)
        except Exception:
            path = Path(f"{prefix}crash-fallback-{done}")
            path.write_bytes(data)
            traceback.print_exc()
            print(f"==ERROR== input written to {path}", file=sys.stderr)
            return 1
        done += 1
    print(f"egressd fuzz: {done} runs, no failure", file=sys.stderr)
    return 0
