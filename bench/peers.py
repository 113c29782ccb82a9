"""The targets: direct (no proxy), tinyproxy, Squid, mitmproxy (passthrough / intercepting), srt's proxy,
egressd-before (egressd at an earlier commit, bench/before.py) and egressd; and the wrappers of the
sandbox workloads (egressd exec, egressd sandbox, srt).

Each peer writes its config into the run's work directory, starts on the proxy core and hands back a
`Proxy`: where it listens, the Proxy-Authorization a client must send (egressd and srt), the proxy URL
for npm, and the CA a client must trust when the peer intercepts TLS. A `Wrapper` is a command prefix
that runs a child with a proxy (and, for the sandboxes, confined); its children find the proxy in
HTTP_PROXY.
"""

from __future__ import annotations

import base64
import functools
import hashlib
import json
import os
import pwd
import select
import shlex
import signal
import subprocess
import sys
import time
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

from bench import system
from bench.before import Before, clean_env

VENV_BIN = Path(sys.executable).parent
DIRECT, TINYPROXY, SQUID, MITMPROXY, EGRESSD = "direct", "tinyproxy", "squid", "mitmproxy", "egressd"
SRT = "srt"  # sandbox-runtime: its proxy in the proxy workloads, its sandbox in the sandbox workloads
EGRESSD_BEFORE = "egressd-before"  # egressd at an earlier commit (--before, default 05cc838)
TARGETS: tuple[str, ...] = (DIRECT, TINYPROXY, SQUID, MITMPROXY, SRT, EGRESSD_BEFORE, EGRESSD)
PEERS: tuple[str, ...] = (TINYPROXY, SQUID, MITMPROXY, SRT, EGRESSD_BEFORE)
# the sandbox workloads' targets: a child run by each wrapper
EXEC, SANDBOX = "egressd exec", "egressd sandbox"
SANDBOX_TARGETS: tuple[str, ...] = (EXEC, SANDBOX, SRT)
ALL_TARGETS: tuple[str, ...] = (*TARGETS, EXEC, SANDBOX)


class NotAvailable(Exception):
    """This target cannot run this workload (yet); the message is what the report shows."""


@dataclass
class Proxy:
    name: str
    port: int | None  # None: direct
    proc: subprocess.Popen[bytes] | None = None
    auth: str | None = None  # Proxy-Authorization header value
    url: str | None = None  # http://[user:pass@]127.0.0.1:port
    ca: Path | None = None  # CA a client trusts for TLS this proxy intercepts
    log: Path | None = None
    host: str = "127.0.0.1"
    stop_signal: int = signal.SIGTERM
    extra: dict[str, str] = field(default_factory=dict)

    @property
    def direct(self) -> bool:
        return self.port is None

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def connect_request(self, host: str, port: int) -> bytes:
        auth = f"Proxy-Authorization: {self.auth}\r\n" if self.auth else ""
        return f"CONNECT {host}:{port} HTTP/1.1\r\nHost: {host}:{port}\r\n{auth}\r\n".encode()

    def alive(self) -> bool:
        return self.proc is None or self.proc.poll() is None

    def stop(self) -> None:
        proc = self.proc
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(self.stop_signal)
        for _ in range(2):  # egressd drains on the first SIGTERM and stops at once on the second
            try:
                proc.wait(timeout=12)
                return
            except subprocess.TimeoutExpired:
                proc.send_signal(self.stop_signal)
        proc.kill()
        proc.wait()


class Peer(ABC):
    name: str
    description: str

    def __init__(self, work: Path, cpu: int | None) -> None:
        self.work = work / self.name
        self.work.mkdir(parents=True, exist_ok=True)
        self.cpu = cpu
        self.config_text = ""

    @abstractmethod
    def start(self) -> Proxy: ...

    def version(self) -> str:
        return ""

    def _spawn(
        self, argv: list[str], port: int, *, env: dict[str, str] | None = None
    ) -> subprocess.Popen[bytes]:
        log = open(self.work / "stderr.log", "ab")  # noqa: SIM115 - handed to the child
        proc = subprocess.Popen(
            system.pinned(argv, self.cpu), stdin=subprocess.DEVNULL, stdout=log, stderr=log, env=env
        )
        log.close()
        try:
            system.wait_port("127.0.0.1", port, proc=proc)
        except Exception:
            proc.kill()
            raise
        return proc

    def _spawn_reading(self, argv: list[str], env: dict[str, str]) -> subprocess.Popen[bytes]:
        """argv started on the peer's core with its stdout piped to the bench (where it says where it
        listens) and its stderr in the work dir's stderr.log."""
        log = open(self.work / "stderr.log", "ab")  # noqa: SIM115 - handed to the child
        proc = subprocess.Popen(
            system.pinned(argv, self.cpu),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=log,
            env=env,
        )
        log.close()
        return proc


class DirectPeer(Peer):
    name = DIRECT
    description = "no proxy: clients connect straight to the upstream (the limit)"

    def start(self) -> Proxy:
        return Proxy(DIRECT, None)


class TinyproxyPeer(Peer):
    name = TINYPROXY
    description = "tinyproxy from Debian, one thread per client"

    def start(self) -> Proxy:
        port = system.free_port()
        # No ConnectPort line: CONNECT to any port. Nothing logged below errors.
        self.config_text = f"""Port {port}
Listen 127.0.0.1
Timeout 3600
MaxClients {max(1000, system.fd_limit() - 100)}
Allow 127.0.0.1
LogLevel Error
LogFile "{self.work}/tinyproxy.log"
PidFile "{self.work}/tinyproxy.pid"
DisableViaHeader Yes
"""
        conf = self.work / "tinyproxy.conf"
        conf.write_text(self.config_text)
        proc = self._spawn([system.which("tinyproxy") or "tinyproxy", "-d", "-c", str(conf)], port)
        return Proxy(TINYPROXY, port, proc, url=f"http://127.0.0.1:{port}", log=self.work / "stderr.log")

    def version(self) -> str:
        return system.version_of([system.which("tinyproxy") or "tinyproxy", "-v"])


class SquidPeer(Peer):
    name = SQUID
    description = "Squid from Debian, no cache, no access log"

    def start(self) -> Proxy:
        port = system.free_port()
        self.config_text = f"""http_port 127.0.0.1:{port}
# CONNECT to any port, plain HTTP to loopback: only the client address is checked
http_access allow localhost
http_access deny all
cache deny all
cache_mem 8 MB
access_log none
cache_store_log none
cache_log {self.work}/cache.log
pid_filename {self.work}/squid.pid
coredump_dir {self.work}
max_filedescriptors {system.fd_limit()}
via off
forwarded_for delete
shutdown_lifetime 0 seconds
pinger_enable off
icp_port 0
htcp_port 0
netdb_filename none
logfile_rotate 0
"""
        conf = self.work / "squid.conf"
        conf.write_text(self.config_text)
        if os.geteuid() == 0:  # squid drops to its effective user (proxy), which must write here
            try:
                user = pwd.getpwnam("proxy")
                os.chown(self.work, user.pw_uid, user.pw_gid)
            except KeyError:
                pass
        squid = system.which("squid") or "squid"
        proc = self._spawn([squid, "-N", "-f", str(conf)], port)
        return Proxy(SQUID, port, proc, url=f"http://127.0.0.1:{port}", log=self.work / "cache.log")

    def version(self) -> str:
        return system.version_of([system.which("squid") or "squid", "-v"])


class MitmPassthroughPeer(Peer):
    name = MITMPROXY
    description = "mitmdump --ignore-hosts '.*' (every tunnel passed through), defaults otherwise"

    def argv(self, port: int) -> list[str]:
        return [
            str(VENV_BIN / "mitmdump"),
            "--mode",
            f"regular@127.0.0.1:{port}",
            "--ignore-hosts",
            ".*",
            "--set",
            f"confdir={self.work / 'confdir'}",
            "--set",
            "tcp_timeout=3600",
            "--set",
            "flow_detail=0",
            "--set",
            "termlog_verbosity=error",
        ]

    def start(self) -> Proxy:
        port = system.free_port()
        argv = self.argv(port)
        self.config_text = shlex.join(argv)
        proc = self._spawn(argv, port)
        return Proxy(MITMPROXY, port, proc, url=f"http://127.0.0.1:{port}", log=self.work / "stderr.log")

    def version(self) -> str:
        return system.version_of([str(VENV_BIN / "mitmdump"), "--version"])


class MitmInterceptPeer(MitmPassthroughPeer):
    """Regular intercepting mitmdump with its own CA (workload 5 only)."""

    description = "mitmdump intercepting TLS with its own CA, bodies streamed over 256 KiB"

    def __init__(self, work: Path, cpu: int | None, upstream_ca: Path) -> None:
        super().__init__(work / "intercept", cpu)
        self.upstream_ca = upstream_ca

    def argv(self, port: int) -> list[str]:
        return [
            str(VENV_BIN / "mitmdump"),
            "--mode",
            f"regular@127.0.0.1:{port}",
            "--set",
            f"confdir={self.work / 'confdir'}",
            "--set",
            f"ssl_verify_upstream_trusted_ca={self.upstream_ca}",
            "--set",
            "stream_large_bodies=256k",
            "--set",
            "tcp_timeout=3600",
            "--set",
            "flow_detail=0",
            "--set",
            "termlog_verbosity=error",
        ]

    def start(self) -> Proxy:
        proxy = super().start()
        ca = self.work / "confdir" / "mitmproxy-ca-cert.pem"
        deadline = time.monotonic() + 20
        while not ca.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        proxy.ca = ca
        return proxy


def srt_settings(allowed: Sequence[str]) -> dict[str, Any]:
    """srt's settings file: only `allowed` (host or host:port) reachable, nothing asked, nothing else set."""
    return {
        "network": {"allowedDomains": list(allowed), "deniedDomains": [], "strictAllowlist": True},
        "filesystem": {"denyRead": [], "allowRead": [], "allowWrite": [], "denyWrite": []},
    }


def srt_version(package: Path | None) -> str:
    try:
        assert package is not None
        version = json.loads((package / "package.json").read_text())["version"]
    except (AssertionError, OSError, ValueError, KeyError):
        return "unknown"
    return (
        f"sandbox-runtime {version}, node {system.version_of([system.which('node') or 'node', '--version'])}"
    )


class SrtPeer(Peer):
    """sandbox-runtime's proxy, started as `srt` starts it (bench/srt_proxy.mjs), without a sandbox."""

    name = SRT
    description = (
        "sandbox-runtime's proxy (SandboxManager.initialize, as `srt` runs it): its HTTP+SOCKS port, "
        "allowedDomains 127.0.0.1, strictAllowlist"
    )

    def __init__(self, work: Path, cpu: int | None, package: Path | None, why: str = "") -> None:
        super().__init__(work, cpu)
        self.package = package
        self.why = why

    def start(self) -> Proxy:
        if self.package is None:
            raise NotAvailable(f"n/a (srt not installed: {self.why})")
        settings = self.work / "srt-settings.json"
        text = json.dumps(srt_settings(["127.0.0.1"]), indent=2)
        settings.write_text(text + "\n")
        driver = Path(__file__).with_name("srt_proxy.mjs")
        argv = [system.which("node") or "node", str(driver), str(self.package), str(settings)]
        self.config_text = shlex.join(argv) + "\n# srt-settings.json\n" + text
        proc = self._spawn_reading(argv, _clean_env())
        try:
            info = json.loads(_read_line(proc, 60.0))
            port, token = int(info["port"]), str(info["token"])
            system.wait_port("127.0.0.1", port, proc=proc)
        except Exception:
            proc.kill()
            proc.wait()
            raise
        auth = base64.b64encode(f"srt:{token}".encode()).decode()
        return Proxy(
            SRT,
            port,
            proc,
            auth=f"Basic {auth}",
            url=f"http://srt:{token}@127.0.0.1:{port}",
            log=self.work / "stderr.log",
        )

    def version(self) -> str:
        return srt_version(self.package)


def _clean_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.upper().endswith("_PROXY")}


def _read_line(proc: subprocess.Popen[bytes], timeout: float) -> str:
    """The first line the process prints on stdout (then stdout is closed)."""
    assert proc.stdout is not None
    fd = proc.stdout.fileno()
    data = b""
    deadline = time.monotonic() + timeout
    while b"\n" not in data and time.monotonic() < deadline:
        ready, _, _ = select.select([fd], [], [], 0.2)
        if ready:
            chunk = os.read(fd, 65536)
            if not chunk:
                break
            data += chunk
        elif proc.poll() is not None:
            break
    proc.stdout.close()
    if b"\n" not in data:
        raise RuntimeError(f"{proc.args!r} printed no settings line (exit {proc.poll()}): {data[:200]!r}")
    return data.split(b"\n", 1)[0].decode()


# --egressd-env KEY=VALUE: extra environment for every egressd the bench starts (A/B runs)
EGRESSD_EXTRA_ENV: dict[str, str] = {}
# --egressd-args "ARGS": extra options for the `egressd run` under test (not egressd-before, whose
# older command line may not know them), e.g. "--metrics 127.0.0.1:0" for an A/B run
EGRESSD_EXTRA_ARGS: list[str] = []


def _egressd_env(work: Path) -> dict[str, str]:
    env = {
        k: v
        for k, v in clean_env().items()
        if not k.upper().endswith("_PROXY") and not k.startswith("EGRESSD_")
    }
    env["XDG_CONFIG_HOME"] = str(work / "config")  # egressd's config dir (its CA) stays in the bench
    env.update(EGRESSD_EXTRA_ENV)
    return env


def egressd_source_state() -> str:
    """`<git HEAD>+src:<hash of the working tree's egressd sources>`: the code an egressd started now runs."""
    import egressd

    package = Path(egressd.__file__).resolve().parent
    files = sorted(package.rglob("*.py")) + sorted((package.parent / "addons").glob("*.py"))
    digest = hashlib.sha256()
    for f in files:
        digest.update(str(f.relative_to(package.parent)).encode())
        digest.update(f.read_bytes())
    try:
        head = subprocess.run(
            ["git", "-C", str(package.parent), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            timeout=10,
            check=False,
        ).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        head = ""
    return f"{head or 'no-git'}+src:{digest.hexdigest()[:10]}"


class EgressdPeer(Peer):
    name = EGRESSD
    description = "egressd run, default policy (loopback allowed), no audit"
    bin = VENV_BIN  # where its `egressd` is

    def __init__(
        self, work: Path, cpu: int | None, *, intercept: bool = False, upstream_ca: Path | None = None
    ):
        super().__init__(work / "intercept" if intercept else work, cpu)
        self.intercept = intercept
        self.upstream_ca = upstream_ca
        self.ca_path: Path | None = None
        self.source_state = ""

    @property
    def egressd(self) -> str:
        return str(self.bin / "egressd")

    def source(self) -> str:
        return egressd_source_state()

    def policy_text(self) -> str:
        inspect = '["127.0.0.1"]' if self.intercept else "[]"
        return f"""version: 1
mode: enforce
allow: []
loopback:
  allow: true
inspect: {inspect}
"""

    def env(self) -> dict[str, str]:
        env = _egressd_env(self.work)
        if self.intercept and self.upstream_ca is not None and not _run_option(self.egressd, "--upstream-ca"):
            env["SSL_CERT_FILE"] = str(self.upstream_ca)  # egressd must trust the bench's upstreams
        return env

    def upstream_args(self) -> list[str]:
        if self.intercept and self.upstream_ca is not None and _run_option(self.egressd, "--upstream-ca"):
            return ["--upstream-ca", str(self.upstream_ca)]
        return []

    def extra_args(self) -> list[str]:
        return list(EGRESSD_EXTRA_ARGS)

    def check_intercept(self) -> Path:
        """The CA egressd intercepts with, or NotAvailable (`egressd ca path` does not work yet)."""
        try:
            out = subprocess.run(
                [self.egressd, "ca", "path"],
                capture_output=True,
                text=True,
                timeout=60,
                env=self.env(),
                check=False,
            )
        except (OSError, subprocess.TimeoutExpired) as e:
            raise NotAvailable(f"n/a (not implemented: egressd ca path: {e})") from e
        path = (
            Path(out.stdout.strip().splitlines()[-1]) if out.returncode == 0 and out.stdout.strip() else None
        )
        if path is None or not path.exists():
            why = (out.stderr or out.stdout).strip().splitlines()
            raise NotAvailable(f"n/a (not implemented: `egressd ca path` {why[-1] if why else 'failed'})")
        return path

    def start(self) -> Proxy:
        if self.intercept:
            self.ca_path = self.check_intercept()
        port = system.free_port()
        policy = self.work / "policy.yaml"
        policy.write_text(self.policy_text())
        argv = [self.egressd, "run", "--policy", str(policy), "--listen", f"127.0.0.1:{port}"]
        argv += self.upstream_args() + self.extra_args()
        extra = "".join(f"{k}={shlex.quote(v)} " for k, v in EGRESSD_EXTRA_ENV.items())
        self.config_text = extra + shlex.join(argv) + "\n# policy.yaml\n" + self.policy_text()
        self.source_state = self.source()
        proc = self._spawn_reading(argv, self.env())
        try:
            exports = _read_until_eof(proc, 60.0)
            url = _export(exports, "HTTP_PROXY")
            system.wait_port("127.0.0.1", port, proc=proc)
        except Exception:
            proc.kill()
            proc.wait()
            raise
        parts = urlsplit(url)
        user, password = unquote(parts.username or ""), unquote(parts.password or "")
        token = base64.b64encode(f"{user}:{password}".encode()).decode()
        return Proxy(
            self.name,
            port,
            proc,
            auth=f"Basic {token}",
            url=url,
            ca=self.ca_path,
            log=self.work / "stderr.log",
        )

    def version(self) -> str:
        version = system.version_of([self.egressd, "--version"])
        return f"{version}, source {self.source_state}"


class EgressdBeforePeer(EgressdPeer):
    """egressd at an earlier commit (bench/before.py: its own source copy and venv in the cache dir),
    started exactly like the egressd under test: same argv, policy, environment and core."""

    name = EGRESSD_BEFORE
    description = "egressd run at an earlier commit (the same argv and policy as egressd)"

    def __init__(
        self,
        work: Path,
        cpu: int | None,
        before: Before,
        *,
        intercept: bool = False,
        upstream_ca: Path | None = None,
    ):
        super().__init__(work, cpu, intercept=intercept, upstream_ca=upstream_ca)
        self.before = before
        self.description = f"egressd run at commit {before.short} (the same argv and policy as egressd)"
        if before.bin is not None:
            self.bin = before.bin

    def extra_args(self) -> list[str]:
        return []  # --egressd-args are for the egressd under test only

    def source(self) -> str:
        front = ", native C front built" if self.before.native else ""
        return f"commit {self.before.short}{front} ({self.before.root})"

    def start(self) -> Proxy:
        if self.before.bin is None:
            raise NotAvailable(f"n/a (egressd at {self.before.short}: {self.before.why})")
        return super().start()


@functools.cache
def _run_option(egressd: str, option: str) -> bool:
    """Does this egressd's `run` take the option? (The bench runs against a moving tree.)"""
    try:
        out = subprocess.run(
            [egressd, "run", "--help"],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired):
        return False
    return option in out.stdout


def _read_until_eof(proc: subprocess.Popen[bytes], timeout: float) -> str:
    assert proc.stdout is not None
    fd = proc.stdout.fileno()
    chunks: list[bytes] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ready, _, _ = select.select([fd], [], [], 0.2)
        if ready:
            data = os.read(fd, 65536)
            if not data:
                proc.stdout.close()
                return b"".join(chunks).decode()
            chunks.append(data)
        elif proc.poll() is not None:
            raise RuntimeError(f"egressd run exited with {proc.returncode} before printing its settings")
    raise TimeoutError("egressd run printed no settings in time")


def _export(text: str, name: str) -> str:
    for line in text.splitlines():
        words = shlex.split(line)
        if len(words) == 2 and words[0] == "export" and words[1].startswith(name + "="):
            return words[1].split("=", 1)[1]
    raise RuntimeError(f"egressd run printed no {name}: {text!r}")


def make_peers(
    work: Path,
    cpu: int | None,
    srt: Path | None = None,
    srt_why: str = "not installed",
    before: Before | None = None,
) -> dict[str, Peer]:
    """The targets of every proxy workload except 5 (srt: the installed package, or None and why;
    before: egressd at an earlier commit, None with --no-before)."""
    peers: dict[str, Peer] = {
        DIRECT: DirectPeer(work, cpu),
        TINYPROXY: TinyproxyPeer(work, cpu),
        SQUID: SquidPeer(work, cpu),
        MITMPROXY: MitmPassthroughPeer(work, cpu),
        SRT: SrtPeer(work, cpu, srt, srt_why),
    }
    if before is not None:
        peers[EGRESSD_BEFORE] = EgressdBeforePeer(work, cpu, before)
    peers[EGRESSD] = EgressdPeer(work, cpu)
    return peers


# -- the sandbox workloads' wrappers --------------------------------------------------------------
@dataclass
class Wrapper:
    """A command prefix that runs a child with a proxy: `prefix + ["--"] + child argv`."""

    name: str
    description: str
    prefix: list[str]
    env: dict[str, str]
    config_text: str
    version: str = ""

    def argv(self, child: Sequence[str]) -> list[str]:
        return [*self.prefix, "--", *child]


def make_wrappers(
    work: Path, cpu: int | None, ports: Sequence[int], srt: Path | None, srt_why: str = "not installed"
) -> dict[str, Wrapper | str]:
    """egressd exec, egressd sandbox and srt, each letting its child reach 127.0.0.1 on `ports` only
    (and nothing else), run on the proxy core. A str instead of a Wrapper: why that target cannot run."""
    work.mkdir(parents=True, exist_ok=True)
    egressd = str(VENV_BIN / "egressd")
    policy_text = f"""version: 1
mode: enforce
allow: []
loopback:
  allow: true
  ports: [{", ".join(str(p) for p in ports)}]
"""
    policy = work / "policy.yaml"
    policy.write_text(policy_text)
    out: dict[str, Wrapper | str] = {}
    env = _egressd_env(work)
    extra = "".join(f"{k}={shlex.quote(v)} " for k, v in EGRESSD_EXTRA_ENV.items())
    version = system.version_of([egressd, "--version"])
    for name, command in ((EXEC, "exec"), (SANDBOX, "sandbox")):
        argv = [egressd, command, "--policy", str(policy)]
        out[name] = Wrapper(
            name,
            f"`egressd {command}`, a policy with only 127.0.0.1 on the upstream's ports",
            system.pinned(argv, cpu),
            env,
            extra + shlex.join([*argv, "--", "CMD"]) + "\n# policy.yaml\n" + policy_text,
            f"{version}, source {egressd_source_state()}",
        )
    if srt is None:
        out[SRT] = f"n/a (srt not installed: {srt_why})"
        return out
    settings = work / "srt-settings.json"
    text = json.dumps(srt_settings([f"127.0.0.1:{p}" for p in ports]), indent=2)
    settings.write_text(text + "\n")
    argv = [system.which("node") or "node", str(srt / "dist" / "cli.js"), "--settings", str(settings)]
    out[SRT] = Wrapper(
        SRT,
        "`srt` (bubblewrap, its own network namespace, socat bridge to its proxy)",
        system.pinned(argv, cpu),
        _clean_env(),
        shlex.join([*argv, "--", "CMD"]) + "\n# srt-settings.json\n" + text,
        srt_version(srt),
    )
    return out
