"""Workload 9, the real job: `npm ci` of a project with 268 packages from a registry the bench serves.

Preparation (before the bench leaves the network, once, cached): every tarball of
`bench/npm-job/package-lock.json` is fetched with `npm pack` from the public registry into the cache
and checked against the lockfile's integrity. A run then serves them from nginx over HTTPS on
127.0.0.1 (packuments generated from the tarballs' own package.json), and `npm ci` installs the
project with a fresh npm cache each time: every packument and tarball crosses the proxy.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import shutil
import subprocess
import tarfile
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from bench import system
from bench.peers import Proxy

PROJECT = Path(__file__).resolve().parent / "npm-job"
_BATCH = 40


@dataclass(frozen=True)
class Package:
    name: str
    version: str
    integrity: str

    @property
    def basename(self) -> str:
        return f"{self.name.rsplit('/', 1)[-1]}-{self.version}.tgz"

    @property
    def rel(self) -> str:
        """Path of the tarball below the registry root: `@scope/name/-/name-1.0.0.tgz`."""
        return f"{self.name}/-/{self.basename}"


def lock_packages(project: Path = PROJECT) -> list[Package]:
    lock = json.loads((project / "package-lock.json").read_text())
    out: dict[tuple[str, str], Package] = {}
    for path, entry in lock["packages"].items():
        if not path or entry.get("link"):
            continue
        name = entry.get("name") or path.rsplit("node_modules/", 1)[-1]
        pkg = Package(name, entry["version"], entry.get("integrity", ""))
        out[(pkg.name, pkg.version)] = pkg
    return sorted(out.values(), key=lambda p: (p.name, p.version))


def _sri(data: bytes, algorithm: str = "sha512") -> str:
    return f"{algorithm}-" + base64.b64encode(hashlib.new(algorithm, data).digest()).decode()


def _integrity_ok(data: bytes, integrity: str) -> bool:
    if not integrity:
        return True
    for item in integrity.split():
        algorithm = item.split("-", 1)[0]
        if algorithm in ("sha512", "sha384", "sha256", "sha1") and _sri(data, algorithm) == item:
            return True
    return False


def prepare(cache: Path, npm: str = "npm") -> list[Package]:
    """Fetch the tarballs the lockfile names (only those missing from the cache)."""
    packages = lock_packages()
    store = cache / "npm" / "tarballs"
    missing = [p for p in packages if not (store / p.rel).exists()]
    if missing:
        system.log(f"npm job: fetching {len(missing)} of {len(packages)} tarballs with npm pack (once)")
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(0, len(missing), _BATCH):
            batch = missing[i : i + _BATCH]
            out = subprocess.run(
                [
                    npm,
                    "pack",
                    "--json",  # from npm's configured registry, as the machine is set up
                    "--pack-destination",
                    tmp,
                    *(f"{p.name}@{p.version}" for p in batch),
                ],
                capture_output=True,
                text=True,
                cwd=tmp,
                check=False,
            )
            if out.returncode != 0:
                raise RuntimeError(f"npm pack failed: {out.stderr.strip()[-800:]}")
            for item in json.loads(out.stdout):
                pkg = next(p for p in batch if p.name == item["name"] and p.version == item["version"])
                source = Path(tmp) / item["filename"]
                data = source.read_bytes()
                if not _integrity_ok(data, pkg.integrity):
                    raise RuntimeError(f"{pkg.name}@{pkg.version}: tarball does not match the lockfile")
                dest = store / pkg.rel
                dest.parent.mkdir(parents=True, exist_ok=True)
                shutil.move(source, dest)
    absent = [p for p in packages if not (store / p.rel).exists()]
    if absent:
        raise RuntimeError(f"npm job: tarballs missing after npm pack: {absent[:5]}")
    return packages


def _manifest(tarball: Path) -> dict[str, object]:
    with tarfile.open(tarball, "r:gz") as tar:
        for member in tar:
            parts = member.name.split("/")
            if len(parts) == 2 and parts[1] == "package.json" and member.isfile():
                f = tar.extractfile(member)
                assert f is not None
                return json.loads(f.read().decode("utf-8-sig"))
    raise RuntimeError(f"{tarball}: no package.json")


def _version_key(version: str) -> tuple[int, ...]:
    core = version.split("-", 1)[0].split("+", 1)[0]
    return tuple(int(x) if x.isdigit() else 0 for x in core.split("."))


def build_registry(cache: Path, root: Path, url: str, packages: list[Package]) -> int:
    """Packuments for `url` under root; tarballs linked from the cache. Returns the package count."""
    store = cache / "npm" / "tarballs"
    manifests = cache / "npm" / "manifests.json"
    known: dict[str, dict[str, object]] = json.loads(manifests.read_text()) if manifests.exists() else {}
    by_name: dict[str, list[Package]] = {}
    for p in packages:
        by_name.setdefault(p.name, []).append(p)
    for name, versions in by_name.items():
        doc: dict[str, object] = {"name": name, "versions": {}}
        for p in versions:
            key = f"{p.name}@{p.version}"
            tarball = store / p.rel
            if key not in known:
                known[key] = _manifest(tarball)
            manifest = {k: v for k, v in known[key].items() if k not in ("readme", "readmeFilename")}
            data = tarball.read_bytes()
            manifest.update(
                name=p.name,
                version=p.version,
                dist={
                    "tarball": f"{url}{p.rel}",
                    "integrity": p.integrity or _sri(data),
                    "shasum": hashlib.sha1(data).hexdigest(),
                },
            )
            doc["versions"][p.version] = manifest  # type: ignore[index]
        latest = max((p.version for p in versions), key=_version_key)
        doc["dist-tags"] = {"latest": latest}
        directory = root / name
        directory.mkdir(parents=True, exist_ok=True)
        (directory / "index.json").write_text(json.dumps(doc))
        link = directory / "-"
        if not link.exists():
            link.symlink_to(store / name / "-")
    manifests.write_text(json.dumps(known))
    return len(packages)


@dataclass
class JobRun:
    seconds: float
    installed: int
    proxy_cpu: float


def _npm_argv(npm: str, registry: str, ca: Path, cache: Path, proxy: Proxy | None) -> list[str]:
    argv = [
        npm,
        "ci",
        "--ignore-scripts",
        "--no-audit",
        "--no-fund",
        "--no-update-notifier",
        "--loglevel=error",
        f"--registry={registry}",
        f"--cafile={ca}",
        f"--cache={cache}",
        "--fetch-retries=0",
    ]
    if proxy is not None and proxy.url:
        argv += [f"--proxy={proxy.url}", f"--https-proxy={proxy.url}", "--noproxy="]
    return argv


def _env(home: Path) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.lower().endswith("_proxy") and not k.lower().startswith("npm_")
    }
    env["HOME"] = str(home)  # no ~/.npmrc
    env["NO_UPDATE_NOTIFIER"] = "1"
    return env


def run_job(npm: str, registry: str, ca: Path, proxy: Proxy, scratch: Path, timeout: float = 600) -> JobRun:
    """One `npm ci` in a fresh copy of the project with an empty npm cache; timed wall clock."""
    if scratch.exists():
        shutil.rmtree(scratch)
    project = scratch / "project"
    project.mkdir(parents=True)
    shutil.copy(PROJECT / "package.json", project)
    shutil.copy(PROJECT / "package-lock.json", project)
    home = scratch / "home"
    home.mkdir()
    argv = _npm_argv(npm, registry, ca, scratch / "npm-cache", None if proxy.direct else proxy)
    cpu = system.CpuWindow(proxy.pid).start()
    t0 = time.perf_counter()
    out = subprocess.run(
        argv, cwd=project, env=_env(home), capture_output=True, text=True, timeout=timeout, check=False
    )
    elapsed = time.perf_counter() - t0
    proxy_cpu = cpu.stop()
    if out.returncode != 0:
        raise RuntimeError(f"npm ci failed ({out.returncode}): {(out.stderr or out.stdout).strip()[-600:]}")
    installed_lock = project / "node_modules" / ".package-lock.json"
    installed = len(json.loads(installed_lock.read_text())["packages"]) if installed_lock.exists() else 0
    shutil.rmtree(scratch, ignore_errors=True)
    return JobRun(elapsed, installed, proxy_cpu)


def check_uses_proxy(npm: str, registry: str, ca: Path, scratch: Path, dead_port: int) -> str:
    """npm must really go through the proxy: with a proxy that is not there, it has to fail."""
    dead = Proxy("dead", dead_port, url=f"http://127.0.0.1:{dead_port}")
    try:
        run_job(npm, registry, ca, dead, scratch, timeout=120)
    except RuntimeError:
        return "npm fails with a proxy that is not listening: it does not bypass the proxy"
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    raise RuntimeError("npm installed through a proxy that does not exist: it bypasses the proxy")
