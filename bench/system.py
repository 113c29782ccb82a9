"""The machine side of the bench: installs, the network namespace, fd limits, CPU pinning, /proc stats."""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import os
import resource
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

# Debian packages the bench runs (binary -> package).
DEBIAN_TOOLS: dict[str, str] = {
    "tinyproxy": "tinyproxy",
    "squid": "squid",
    "wrk": "wrk",
    "nginx": "nginx-light",
    "taskset": "util-linux",
    "ip": "iproute2",
    "npm": "npm",  # only when the npm job runs and no npm is on PATH
    "cc": "gcc",  # the C load generators (bench/connect_load.c, bench/tls_load.c)
    "/usr/include/openssl/ssl.h": "libssl-dev",  # bench/tls_load.c
    "bwrap": "bubblewrap",  # egressd sandbox and srt's Linux sandbox
    "socat": "socat",  # srt's bridge between its proxy and the sandbox
    "rg": "ripgrep",  # srt looks for files to protect with it
}
# Anthropic's sandbox-runtime (`srt`), from the npm registry into the bench's cache dir (pinned)
SRT_PACKAGE = "@anthropic-ai/sandbox-runtime"
SRT_VERSION = "0.0.83"
# PyPI packages installed into the bench's own interpreter (the venv) when missing; never in pyproject.
PYPI_TOOLS: dict[str, str] = {"matplotlib": "matplotlib", "uvloop": "uvloop", "py_spy": "py-spy"}

PROXY_CPU = 0  # every proxy runs on this core ...
LOAD_CPU = 1  # ... the load generators, the upstream servers and this process on this one


def log(message: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def which(binary: str) -> str | None:
    return shutil.which(binary) or next(
        (str(p) for d in ("/usr/sbin", "/sbin") if (p := Path(d) / binary).exists()), None
    )


def _installed(tool: str) -> bool:
    return Path(tool).exists() if tool.startswith("/") else which(tool) is not None


def build_c(source: Path, libraries: Sequence[str] = ()) -> Path | None:
    """source built (once per content) with the system C compiler into /tmp, else None."""
    text = source.read_bytes()
    binary = Path("/tmp") / f"egressd-bench-{source.stem}-{hashlib.sha256(text).hexdigest()[:12]}"
    if not binary.exists():
        try:
            argv = ["cc", "-O2", "-o", f"{binary}.part", str(source), *libraries]
            subprocess.run(argv, check=True, capture_output=True, timeout=120)
            os.replace(f"{binary}.part", binary)
        except (OSError, subprocess.SubprocessError):
            return None
    return binary


def ensure_debian_tools(binaries: Iterable[str]) -> None:
    """apt-get install what is missing (the bench's peers and tools); one `apt-get update` first."""
    missing = sorted({DEBIAN_TOOLS[b] for b in binaries if not _installed(b)})
    if not missing:
        return
    if os.geteuid() != 0:
        raise SystemExit(f"bench: missing {', '.join(missing)}; run as root or apt-get install them")
    log(f"installing Debian packages: {', '.join(missing)}")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    subprocess.run(["apt-get", "update", "-q"], check=True, env=env, stdout=subprocess.DEVNULL)
    subprocess.run(
        ["apt-get", "install", "-y", "-q", "--no-install-recommends", *missing],
        check=True,
        env=env,
        stdout=subprocess.DEVNULL,
    )
    stop_packaged_daemons()


def srt_dir(cache: Path) -> Path:
    """Where the pinned sandbox-runtime package lives once installed (its package.json inside)."""
    return cache / f"srt-{SRT_VERSION}" / "node_modules" / SRT_PACKAGE


def ensure_srt(cache: Path, npm: str, *, install: bool = True) -> tuple[Path | None, str]:
    """sandbox-runtime installed with `npm install` into the cache (once); (package dir, or None and why)."""
    package = srt_dir(cache)
    if (package / "dist" / "cli.js").exists():
        return package, ""
    if not install:
        return None, f"{SRT_PACKAGE} is not in {package.parent.parent} (--no-install)"
    if not npm:
        return None, "npm is missing"
    prefix = package.parent.parent.parent
    prefix.mkdir(parents=True, exist_ok=True)
    log(f"npm installing {SRT_PACKAGE}@{SRT_VERSION} into {prefix}")
    out = subprocess.run(
        [
            npm,
            "install",
            "--prefix",
            str(prefix),
            "--no-audit",
            "--no-fund",
            "--ignore-scripts",
            "--no-save",
            f"{SRT_PACKAGE}@{SRT_VERSION}",
        ],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    if out.returncode != 0 or not (package / "dist" / "cli.js").exists():
        why = (out.stderr or out.stdout).strip().splitlines()
        return None, f"npm install {SRT_PACKAGE} failed: {why[-1] if why else out.returncode}"
    return package, ""


def stop_packaged_daemons() -> None:
    """Debian may start tinyproxy/squid/nginx on install (where an init runs); the bench runs its own."""
    for service in ("tinyproxy", "squid", "nginx"):
        if shutil.which("service"):
            subprocess.run(["service", service, "stop"], capture_output=True, check=False)


def _present(module: str) -> bool:
    if module == "py_spy":  # a binary, not a module
        return (Path(sys.executable).parent / "py-spy").exists()
    return importlib.util.find_spec(module) is not None


def ensure_pypi_tools(modules: Iterable[str]) -> list[str]:
    """pip-install missing bench-only tools into this interpreter; returns those still missing."""
    modules = list(modules)
    missing = [m for m in modules if not _present(m)]
    if missing:
        log(f"pip installing into {sys.prefix}: {', '.join(PYPI_TOOLS[m] for m in missing)}")
        subprocess.run(
            [sys.executable, "-m", "pip", "install", "-q", *(PYPI_TOOLS[m] for m in missing)],
            check=False,
        )
        importlib.invalidate_caches()
    return [m for m in modules if not _present(m)]


# -- the network namespace ------------------------------------------------------------------------
def enter_netns() -> str:
    """Move this process (and so every child) into a fresh network namespace with only `lo`.

    No bench packet can leave the machine, other sessions' servers are invisible, and the socket
    sysctls below apply to the bench only.
    """
    if os.environ.get("EGRESSD_BENCH_NETNS") == "1":
        return "already inside the bench's namespace"
    try:
        os.unshare(os.CLONE_NEWNET)
    except OSError as e:  # not root: stay here (every target is still on 127.0.0.1)
        return f"this process' namespace (no new namespace: {e}); loopback addresses only"
    subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
    os.environ["EGRESSD_BENCH_NETNS"] = "1"
    tuned = []
    for path, value in (
        ("/proc/sys/net/core/somaxconn", "65535"),
        ("/proc/sys/net/ipv4/tcp_max_syn_backlog", "65535"),
        ("/proc/sys/net/ipv4/ip_local_port_range", "10000 65000"),
        ("/proc/sys/net/ipv4/tcp_tw_reuse", "1"),
    ):
        with contextlib.suppress(OSError):
            Path(path).write_text(value)
            tuned.append(f"{Path(path).name}={value}")
    return "fresh network namespace (lo only); " + ", ".join(tuned)


# -- fd limits ------------------------------------------------------------------------------------
def raise_fd_limit() -> tuple[int, int]:
    """Soft = hard RLIMIT_NOFILE (children inherit it). The hard limit cannot be raised here."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    for want in (1 << 20, hard):
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, max(want, hard)))
            break
        except (ValueError, OSError):
            continue
    return resource.getrlimit(resource.RLIMIT_NOFILE)


def fd_limit() -> int:
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


# -- CPU pinning ----------------------------------------------------------------------------------
def can_pin() -> bool:
    return (
        hasattr(os, "sched_setaffinity")
        and len(os.sched_getaffinity(0)) >= 2
        and which("taskset") is not None
    )


def pin_self(cpu: int) -> None:
    os.sched_setaffinity(0, {cpu})


def wall(argv: Sequence[str], env: dict[str, str] | None = None) -> float:
    """Seconds one run of argv takes, start to exit (its output discarded; a failure raises)."""
    t0 = time.perf_counter()
    subprocess.run(
        argv,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=env,
        check=True,
    )
    return time.perf_counter() - t0


def pinned(argv: Sequence[str], cpu: int | None) -> list[str]:
    """argv run on one core (taskset), or unchanged when pinning is off."""
    return ["taskset", "-c", str(cpu), *argv] if cpu is not None else list(argv)


# -- ports ----------------------------------------------------------------------------------------
def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def wait_port(
    host: str, port: int, timeout: float = 30.0, proc: subprocess.Popen[bytes] | None = None
) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"process {proc.args!r} exited with {proc.returncode} before listening")
        try:
            with socket.create_connection((host, port), timeout=1.0):
                return
        except OSError:
            time.sleep(0.05)
    raise TimeoutError(f"nothing listens on {host}:{port} after {timeout:g}s")


# -- /proc stats of a process tree ----------------------------------------------------------------
def _children(pid: int) -> list[int]:
    kids: list[int] = []
    task = Path(f"/proc/{pid}/task")
    with contextlib.suppress(OSError):
        for tid in os.listdir(task):
            with contextlib.suppress(OSError):
                kids += [int(c) for c in (task / tid / "children").read_text().split()]
    return kids


def tree(pid: int) -> list[int]:
    """pid and all its descendants."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo += _children(p)
    return out


def _status_kib(pid: int, field: str) -> int:
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def rss_bytes(pid: int) -> int:
    """Resident set of the process tree (VmRSS summed)."""
    return sum(_status_kib(p, "VmRSS") for p in tree(pid)) * 1024


def reset_peak_rss(pid: int) -> None:
    """Reset VmHWM (the kernel's peak RSS) of every process in the tree: `echo 5 > clear_refs`."""
    for p in tree(pid):
        with contextlib.suppress(OSError):
            Path(f"/proc/{p}/clear_refs").write_text("5")


def peak_rss_bytes(pid: int) -> int:
    return sum(_status_kib(p, "VmHWM") for p in tree(pid)) * 1024


_TICKS = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """utime + stime of the process tree (all threads), in seconds."""
    return sum(cpu_split(pid))


def cpu_split(pid: int) -> tuple[float, float]:
    """(user, system) CPU seconds of the process tree (all threads)."""
    user = system = 0
    for p in tree(pid):
        with contextlib.suppress(OSError, IndexError, ValueError):
            stat = Path(f"/proc/{p}/stat").read_text()
            fields = stat[stat.rindex(")") + 2 :].split()
            user, system = user + int(fields[11]), system + int(fields[12])
    return user / _TICKS, system / _TICKS


@dataclass
class CpuWindow:
    """CPU seconds a process tree used between start() and stop()."""

    pid: int | None
    start_cpu: float = 0.0
    seconds: float = 0.0

    def start(self) -> CpuWindow:
        self.start_cpu = cpu_seconds(self.pid) if self.pid else 0.0
        return self

    def stop(self) -> float:
        self.seconds = (cpu_seconds(self.pid) - self.start_cpu) if self.pid else 0.0
        return self.seconds


def self_cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def load_average() -> tuple[float, float, float]:
    return os.getloadavg()


def version_of(argv: Sequence[str]) -> str:
    try:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=20, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    text = (out.stdout or out.stderr).strip().splitlines()
    return text[0].strip() if text else "unknown"


def _cpu_times() -> dict[int, tuple[int, int]]:
    """Per-core (busy, total) jiffies from /proc/stat."""
    out: dict[int, tuple[int, int]] = {}
    for line in Path("/proc/stat").read_text().splitlines():
        if line.startswith("cpu") and line[3:4].isdigit():
            name, *values = line.split()
            ticks = [int(v) for v in values]
            idle = ticks[3] + (ticks[4] if len(ticks) > 4 else 0)
            out[int(name[3:])] = (sum(ticks[:8]) - idle, sum(ticks[:8]))
    return out


@dataclass
class CoreBusy:
    """How busy each core was between start() and stop(), 0..1 (anything on the core counts)."""

    start_times: dict[int, tuple[int, int]] | None = None
    busy: dict[int, float] | None = None

    def start(self) -> CoreBusy:
        self.start_times = _cpu_times()
        return self

    def stop(self) -> dict[int, float]:
        end = _cpu_times()
        assert self.start_times is not None
        self.busy = {}
        for cpu, (b1, t1) in end.items():
            b0, t0 = self.start_times.get(cpu, (b1, t1))
            self.busy[cpu] = (b1 - b0) / (t1 - t0) if t1 > t0 else 0.0
        return self.busy


def machine_cpu() -> tuple[float, float, float]:
    """(busy CPU seconds of the whole machine, monotonic wall, CPU seconds of this process and its
    reaped children) — the difference over a run is what other processes used."""
    busy = sum(b for b, _ in _cpu_times().values()) / _TICKS
    own = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return busy, time.monotonic(), own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime
