"""The audit file's writer (egressd.observe.sink) on real pipes and files: whole lines, in order,
every lost one counted, never a blocked writer."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from egressd.observe.sink import LineSink

REPO = Path(__file__).resolve().parents[2]


def count_line(count: int, since: float, error: str) -> bytes:
    return (json.dumps({"event": "audit_dropped", "count": count, "error": error}) + "\n").encode()


def line(n: int, size: int) -> bytes:
    """A JSON line numbered n, `size` bytes or so long."""
    return (json.dumps({"n": n, "pad": "x" * size}) + "\n").encode()


class SlowReader:
    """A FIFO's reader that reads in small pieces with pauses, or not at all while `paused`."""

    def __init__(self, path: Path, piece: int = 1000, *, paused: bool = False) -> None:
        os.mkfifo(path)
        self.path, self.piece = path, piece
        self.data = bytearray()
        self.paused = threading.Event()
        if paused:
            self.paused.set()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        with open(self.path, "rb", buffering=0) as fifo:
            while True:
                while self.paused.is_set():
                    time.sleep(0.01)
                chunk = fifo.read(self.piece)
                if not chunk:
                    return
                self.data += chunk
                time.sleep(0.0005)

    def lines(self) -> list[dict[str, object]]:
        self.thread.join(20)
        assert not self.thread.is_alive()
        text = bytes(self.data).decode()
        assert text == "" or text.endswith("\n"), "a torn last line"
        return [json.loads(entry) for entry in text.splitlines()]


def sink(path: Path, said: list[str], max_queue_bytes: int = 1 << 20) -> LineSink:
    return LineSink(path, count_line=count_line, say=said.append, max_queue_bytes=max_queue_bytes)


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(sizes=st.lists(st.integers(min_value=0, max_value=12000), min_size=1, max_size=120))
def test_a_slow_pipe_gets_every_line_whole_and_in_order(tmp_path: Path, sizes: list[int]) -> None:
    """Lines longer than a pipe takes at once (PIPE_BUF, the pipe's 64 KiB) and a reader slower
    than the writer: write() never blocks, and the reader gets every line whole, in order."""
    directory = tmp_path / f"t{time.monotonic_ns()}"
    directory.mkdir()
    reader = SlowReader(directory / "fifo")
    said: list[str] = []
    out = sink(reader.path, said)
    started = time.monotonic()
    assert all(out.write(line(n, size)) for n, size in enumerate(sizes))
    assert time.monotonic() - started < 5  # never waited for the reader
    out.close()
    assert [entry["n"] for entry in reader.lines()] == list(range(len(sizes)))
    assert out.lost == 0 and said == []


def test_a_full_queue_drops_and_counts_exactly(tmp_path: Path) -> None:
    """A reader that stops: once the pipe and the queue are full, lines are lost and counted; when
    it reads again, an audit_dropped line with the exact count comes before any later line."""
    reader = SlowReader(tmp_path / "fifo", piece=65536, paused=True)
    said: list[str] = []
    out = sink(reader.path, said, max_queue_bytes=8192)
    accepted = [n for n in range(400) if out.write(line(n, 300))]
    assert len(accepted) < 400 and out.lost == 400 - len(accepted)
    assert not out.writable and "is not being read" in out.problem
    deadline = time.monotonic() + 10
    while not said:  # stderr is told at once, not at the next tick
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert "is not being read" in said[0], said
    reader.paused.clear()
    while not out.writable:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert out.write(line(1000, 10))
    out.close()
    entries = reader.lines()
    dropped = [e for e in entries if e.get("event") == "audit_dropped"]
    assert sum(int(e["count"]) for e in dropped) == 400 - len(accepted)  # type: ignore[call-overload]
    numbers = [e["n"] for e in entries if "n" in e]
    assert numbers == [*accepted, 1000]
    assert entries.index(dropped[0]) < len(entries) - 1  # before the later line


def test_a_file_that_cannot_grow_is_cut_back_to_whole_lines(tmp_path: Path) -> None:
    """A write the file takes only part of (here: the file size limit, EFBIG, as a full disk gives
    ENOSPC) is cut back to where its line began: only whole lines stay, the rest is counted."""
    path = tmp_path / "audit.jsonl"
    script = f"""
import json, resource, sys
sys.path.insert(0, {str(REPO)!r})
from egressd.observe.sink import LineSink
resource.setrlimit(resource.RLIMIT_FSIZE, (10000, resource.RLIM_INFINITY))
said = []
out = LineSink({str(path)!r}, count_line=lambda c, s, e: b'{{"event":"audit_dropped","count":%d}}\\n' % c,
               say=said.append)
results = [out.write((json.dumps({{"n": n, "pad": "x" * 290}}) + "\\n").encode()) for n in range(60)]
print(json.dumps({{"written": sum(results), "lost": out.lost, "writable": out.writable}}))
out.close()
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    outcome = json.loads(done.stdout)
    text = path.read_text()
    assert text.endswith("\n") and len(text) <= 10000
    entries = [json.loads(entry) for entry in text.splitlines()]  # every line whole
    numbers = [e["n"] for e in entries if "n" in e]
    assert numbers == sorted(numbers) and len(numbers) == outcome["written"]
    assert outcome["written"] + outcome["lost"] == 60 and outcome["lost"] > 0
    assert not outcome["writable"]
