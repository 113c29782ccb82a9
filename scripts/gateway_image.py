#!/usr/bin/env python3
"""Build the images of the compose gateway (docker-compose.yml) without any container registry.

Why: no image registry is needed (or reachable in CI). The base image is a Debian root file system
made by `mmdebstrap` from Debian packages and `docker import`ed; egressd's image installs egressd from
a wheelhouse built on this machine (`pip install --no-index`), so the `docker build` itself never
touches the network. Debian trixie, not bookworm: egressd needs Python >= 3.12 (mitmproxy 12.3.1)
and bookworm ships 3.11, trixie 3.13 — a Debian-packaged interpreter beats copying a host build.

Every step is cached by a hash of its recipe, so a second run does nothing (docs/compose.md):

  base      `egressd-base:<hash>`: the suite, the package list and the mmdebstrap options (network:
            the Debian mirror).
  wheels    `.cache/gateway-wheels/<hash>/`: egressd's dependencies for the image's Python, pinned to
            the versions installed in .venv (network: PyPI).
  images    `egressd:local` and `egressd-agent:local`, labelled with the hash of what goes into them
            (egressd's source, the wheelhouse, the Dockerfiles). Offline: egressd's own wheel is built
            from the source here with the setuptools of the wheelhouse.

Usage:
  python3 scripts/gateway_image.py            # all of it (scripts/setup.sh runs this)
  python3 scripts/gateway_image.py --offline  # fail instead of downloading (the tests)
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DOCKER_DIR = REPO / "docker"
WHEEL_CACHE = REPO / ".cache" / "gateway-wheels"
VENV_PYTHON = REPO / ".venv" / "bin" / "python"

SUITE = "trixie"
PYTHON = "3.13"  # trixie's python3
MIRROR = os.environ.get("EGRESSD_DEBIAN_MIRROR", "http://deb.debian.org/debian")
PACKAGES = ["python3", "python3-venv", "ca-certificates", "curl"]
MMDEBSTRAP_OPTIONS = [
    "--variant=minbase",
    "--dpkgopt=force-unsafe-io",  # a throw-away build: no fsync per file (minutes on a loaded disk)
    "--dpkgopt=path-exclude=/usr/share/doc/*",
    "--dpkgopt=path-exclude=/usr/share/man/*",
    "--dpkgopt=path-exclude=/usr/share/locale/*",
    "--dpkgopt=path-exclude=/usr/share/info/*",
    '--aptopt=Acquire::Retries "3"',
]
BASE_REPO = "egressd-base"
BASE_LOCAL = f"{BASE_REPO}:local"  # what docker-compose.yml builds FROM
# Each image is tagged with its recipe hash (what the tests run: checkouts building side by side
# never run each other's) and as `local` (what docker-compose.yml runs by default).
EGRESSD_REPO = "egressd"
AGENT_REPO = "egressd-agent"
LABEL = "org.egressd.recipe"
# What egressd's wheel is built from (copied to a scratch directory: the checkout stays untouched).
SOURCE_PARTS = ["pyproject.toml", "setup.py", "README.md", "egressd", "addons"]
DOCKERD_LOG = Path("/var/log/egressd-dockerd.log")


class BuildError(RuntimeError):
    """A step failed; the message says which and how to fix it."""


def log(message: str) -> None:
    print(f"gateway-image: {message}", file=sys.stderr, flush=True)


def run(cmd: list[str], **kwargs) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(cmd, text=True, capture_output=True, check=False, **kwargs)
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout or "").strip()[-3000:]
        raise BuildError(f"{' '.join(cmd[:4])} ... failed ({proc.returncode}):\n{tail}")
    return proc


def digest(*parts: str | bytes) -> str:
    h = hashlib.sha256()
    for part in parts:
        data = part.encode() if isinstance(part, str) else part
        h.update(len(data).to_bytes(8, "big") + data)
    return h.hexdigest()[:16]


def tree_digest(paths: list[Path], root: Path) -> str:
    """Hash of file names and contents under `paths` (bytecode caches ignored)."""
    parts: list[str | bytes] = []
    for top in paths:
        files = [top] if top.is_file() else sorted(p for p in top.rglob("*") if p.is_file())
        for f in files:
            if "__pycache__" in f.parts or f.suffix == ".pyc":
                continue
            parts += [str(f.relative_to(root)), f.read_bytes()]
    return digest(*parts)


# -- the Docker engine ---------------------------------------------------------------------------
def docker_ready() -> bool:
    return subprocess.run(["docker", "info"], capture_output=True, check=False).returncode == 0


def ensure_dockerd(deadline_s: float = 60.0) -> subprocess.Popen[bytes] | None:
    """Start dockerd when no engine answers; returns the process started here (None: one was running)."""
    if shutil.which("docker") is None:
        raise BuildError("no `docker` command: install docker.io (bash scripts/setup.sh)")
    if docker_ready():
        return None
    dockerd = shutil.which("dockerd") or "/usr/sbin/dockerd"
    if not os.path.exists(dockerd):
        raise BuildError("no dockerd: install docker.io (bash scripts/setup.sh)")
    log(f"starting dockerd (log: {DOCKERD_LOG})")
    out = open(DOCKERD_LOG, "ab")  # noqa: SIM115 - handed to the daemon
    proc = subprocess.Popen(
        [dockerd], stdout=out, stderr=out, stdin=subprocess.DEVNULL, start_new_session=True
    )
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        if docker_ready():  # ours, or one started at the same moment by someone else (ours then exits)
            return proc if proc.poll() is None else None
        time.sleep(0.5)
    tail = DOCKERD_LOG.read_text(errors="replace")[-2000:] if DOCKERD_LOG.exists() else ""
    if proc.poll() is None:
        proc.terminate()
    raise BuildError(f"dockerd did not answer within {deadline_s:g}s; its log ends:\n{tail}")


def image_exists(ref: str) -> bool:
    done = subprocess.run(["docker", "image", "inspect", ref], capture_output=True, check=False)
    return done.returncode == 0


# -- base: Debian packages -> docker import ------------------------------------------------------
def base_ref() -> str:
    return f"{BASE_REPO}:{digest(SUITE, MIRROR, ' '.join(PACKAGES), ' '.join(MMDEBSTRAP_OPTIONS))}"


def ensure_base(offline: bool) -> str:
    ref = base_ref()
    if image_exists(ref):
        log(f"base {ref}: cached")
        run(["docker", "tag", ref, BASE_LOCAL])
        return ref
    if offline:
        raise BuildError(f"base image {ref} missing and --offline: run `bash scripts/setup.sh` first")
    if shutil.which("mmdebstrap") is None:
        raise BuildError("no mmdebstrap: install it (bash scripts/setup.sh)")
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="egressd-base-") as tmp:
        rootfs = Path(tmp) / "rootfs.tar"
        log(f"base {ref}: mmdebstrap {SUITE} ({', '.join(PACKAGES)}) from {MIRROR}")
        run(
            ["mmdebstrap", *MMDEBSTRAP_OPTIONS, f"--include={','.join(PACKAGES)}", SUITE, str(rootfs), MIRROR]
        )
        run(
            [
                "docker",
                "import",
                "--change",
                f"LABEL {LABEL}={ref.split(':')[1]}",
                "--change",
                'CMD ["/bin/bash"]',
                str(rootfs),
                ref,
            ]
        )
    run(["docker", "tag", ref, BASE_LOCAL])
    log(f"base {ref}: built in {time.monotonic() - started:.0f}s")
    return ref


# -- wheels: egressd's dependencies for the image's Python ----------------------------------------
def _dependencies() -> list[str]:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    return list(project["dependencies"])


def _constraints() -> str:
    """The versions installed in .venv (what the tests run here), so the image runs the same ones."""
    python = str(VENV_PYTHON) if VENV_PYTHON.exists() else sys.executable
    out = run([python, "-m", "pip", "freeze", "--exclude-editable", "--disable-pip-version-check"]).stdout
    return (
        "\n".join(line for line in out.splitlines() if "==" in line and not line.startswith("egressd=="))
        + "\n"
    )


def wheels_dir() -> tuple[Path, str]:
    constraints = _constraints()
    key = digest(PYTHON, platform.machine(), "\n".join(_dependencies()), constraints)
    return WHEEL_CACHE / key, constraints


def ensure_wheels(offline: bool) -> Path:
    target, constraints = wheels_dir()
    if (target / ".complete").exists():
        log(f"wheels {target.name}: cached")
        return target
    if offline:
        raise BuildError(f"wheelhouse {target} missing and --offline: run `bash scripts/setup.sh` first")
    started = time.monotonic()
    partial = target.with_name(target.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    (partial / "constraints.txt").write_text(constraints)
    machine = platform.machine()
    platforms = [f"manylinux_2_{minor}_{machine}" for minor in (17, 28, 34)] + [
        f"manylinux2014_{machine}",
        f"manylinux1_{machine}",
        f"manylinux_2_5_{machine}",
    ]
    python = str(VENV_PYTHON) if VENV_PYTHON.exists() else sys.executable
    cmd = [
        python,
        "-m",
        "pip",
        "download",
        "--disable-pip-version-check",
        "-q",
        "--dest",
        str(partial),
        "--only-binary=:all:",
        "--python-version",
        PYTHON,
        "--implementation",
        "cp",
        "--abi",
        f"cp{PYTHON.replace('.', '')}",
        "--abi",
        "abi3",
        "--abi",
        "none",
        *[arg for p in platforms for arg in ("--platform", p)],
        "--platform",
        "any",
        "-c",
        str(partial / "constraints.txt"),
        *_dependencies(),
        "setuptools>=68",
        "wheel",
    ]
    log(f"wheels {target.name}: pip download for CPython {PYTHON} ({machine})")
    run(cmd)
    (partial / ".complete").write_text("")
    shutil.rmtree(target, ignore_errors=True)
    partial.rename(target)
    log(
        f"wheels {target.name}: {len(list(target.glob('*.whl')))} wheels in {time.monotonic() - started:.0f}s"
    )
    return target


# -- the images ----------------------------------------------------------------------------------
def _build(ref: str, context: Path, recipe: str, base: str) -> None:
    """docker build with the recipe label; the version it replaces (now untagged) is removed."""
    env = dict(os.environ, DOCKER_BUILDKIT="0")  # the classic builder: Debian's engine has no buildx
    run(
        [
            "docker",
            "build",
            "-q",
            "--force-rm",  # a failed step leaves no container behind
            "--label",
            f"{LABEL}={recipe}",
            "--build-arg",
            f"BASE_IMAGE={base}",
            "-t",
            ref,
            str(context),
        ],
        env=env,
    )
    run(["docker", "image", "prune", "--force", "--filter", f"label={LABEL}"])


def ensure_egressd_image(base: str, wheels: Path) -> str:
    """egressd's image from docker/egressd/ plus a wheelhouse written into docker/egressd/wheels/.

    The wheelhouse stays there (ignored by git), so `docker-compose build` works afterwards too.
    """
    context = DOCKER_DIR / "egressd"
    recipe = digest(
        base,
        wheels.name,
        tree_digest([REPO / p for p in SOURCE_PARTS], REPO),
        tree_digest([context / "Dockerfile"], REPO),
    )
    ref = f"{EGRESSD_REPO}:{recipe}"
    if image_exists(ref):
        log(f"{ref}: cached")
        run(["docker", "tag", ref, f"{EGRESSD_REPO}:local"])
        return ref
    started = time.monotonic()
    out = context / "wheels"
    shutil.rmtree(out, ignore_errors=True)
    deps, own = out / "deps", out / "egressd"
    deps.mkdir(parents=True)
    own.mkdir()
    for whl in wheels.glob("*.whl"):
        shutil.copy2(whl, deps / whl.name)
    (deps / "requirements.txt").write_text("\n".join(_dependencies()) + "\n")
    python = str(VENV_PYTHON) if VENV_PYTHON.exists() else sys.executable
    with tempfile.TemporaryDirectory(prefix="egressd-src-") as src:
        for part in SOURCE_PARTS:
            if (REPO / part).is_dir():
                shutil.copytree(REPO / part, Path(src) / part, ignore=shutil.ignore_patterns("__pycache__"))
            else:
                shutil.copy2(REPO / part, Path(src) / part)
        # egressd's own wheel, offline: build isolation takes setuptools and wheel from the wheelhouse
        run(
            [
                python,
                "-m",
                "pip",
                "wheel",
                "--disable-pip-version-check",
                "-q",
                "--no-deps",
                "--no-index",
                "--find-links",
                str(wheels),
                "--wheel-dir",
                str(own),
                src,
            ]
        )
    _build(ref, context, recipe, base)
    run(["docker", "tag", ref, f"{EGRESSD_REPO}:local"])
    log(f"{ref}: built in {time.monotonic() - started:.0f}s")
    return ref


def ensure_agent_image(base: str) -> str:
    context = DOCKER_DIR / "agent"
    recipe = digest(base, tree_digest([context], REPO))
    ref = f"{AGENT_REPO}:{recipe}"
    if not image_exists(ref):
        started = time.monotonic()
        _build(ref, context, recipe, base)
        log(f"{ref}: built in {time.monotonic() - started:.0f}s")
    else:
        log(f"{ref}: cached")
    run(["docker", "tag", ref, f"{AGENT_REPO}:local"])
    return ref


def build(offline: bool = False) -> dict[str, str]:
    """Every step, cached; returns the image references (base, egressd, agent)."""
    started = time.monotonic()
    ensure_dockerd()
    base = ensure_base(offline)
    wheels = ensure_wheels(offline)
    refs = {"base": base, "egressd": ensure_egressd_image(base, wheels), "agent": ensure_agent_image(base)}
    log(f"done in {time.monotonic() - started:.0f}s")
    return refs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--offline", action="store_true", help="never download: fail when a cache is missing")
    args = parser.parse_args(argv)
    try:
        refs = build(offline=args.offline)
    except BuildError as exc:
        log(f"ERROR: {exc}")
        return 1
    print(json.dumps(refs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
