"""The wheel built from this checkout, installed into a fresh venv, runs every command group.

Why: README's install is `pipx install .` / `pip install .`, which installs the wheel, not this
checkout: a package left out of it (a subpackage, the addons, the presets, the dashboard's static
files) breaks only there. The wheel is built offline (`pip wheel --no-build-isolation`, setuptools
from the test venv) and installed without its dependencies into a fresh venv that sees the test
venv's site-packages only as a plain path (so the checkout's editable install is not on it); every
command runs from that venv's `egressd`, in a directory away from the checkout, and must import
egressd from the wheel.
"""

from __future__ import annotations

import http.cookiejar
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import time
import urllib.request
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


SKIP = shutil.ignore_patterns(
    ".git", ".venv", ".cache", "build", "dist", "*.egg-info", "__pycache__", "wheels"
)


def pip(*args: str, cwd: Path | None = None) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "pip", "-q", *args], cwd=cwd, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, (args, done.stderr[-3000:])


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheel of this working tree, built in a copy of it (a `build/` left in the checkout by an
    earlier build would otherwise lend the wheel files its package list no longer names)."""
    tmp = tmp_path_factory.mktemp("wheel")
    source = tmp / "src"
    shutil.copytree(REPO, source, ignore=SKIP, symlinks=True)
    pip("wheel", "--no-deps", "--no-build-isolation", "-w", str(tmp), ".", cwd=source)
    (found,) = tmp.glob("egressd-*.whl")
    return found


@pytest.fixture(scope="module")
def installed(wheel: Path) -> Iterator[tuple[Path, dict[str, str], Path]]:
    """(the fresh venv's egressd, its environment, a working directory)."""
    tmp = wheel.parent
    venv = tmp / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    site = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    # the dependencies: the test venv's site-packages as a path (its .pth files, the editable
    # install's among them, are not read from there)
    (Path(site) / "zz-test-venv-deps.pth").write_text(sysconfig.get_path("purelib") + "\n")
    pip("--python", str(python), "install", "--no-deps", "--no-index", str(wheel))
    work = tmp / "work"
    work.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("EGRESSD_") and k != "PYTHONPATH"}
    env["EGRESSD_HOME"] = str(tmp / "home")
    for var in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy", "all_proxy"):
        env.pop(var, None)
    yield venv / "bin" / "egressd", env, work


def egressd(installed: tuple[Path, dict[str, str], Path], *args: str, code: int = 0) -> str:
    exe, env, work = installed
    done = subprocess.run([str(exe), *args], cwd=work, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == code, (args, done.returncode, done.stderr[-2000:])
    return done.stdout + done.stderr


def test_the_wheel_holds_every_package_and_no_demo(wheel: Path) -> None:
    """Every directory of modules under egressd/ and addons/ (as egressd.addons), the presets and the
    dashboard's page; not the demo, not a top-level `addons`."""
    names = set(zipfile.ZipFile(wheel).namelist())
    for source in [*REPO.joinpath("egressd").rglob("*.py"), *REPO.joinpath("addons").glob("*.py")]:
        relative = source.relative_to(REPO).as_posix()
        if relative.startswith("addons/"):
            relative = "egressd/" + relative
        assert relative in names, relative
    presets = {p.name for p in REPO.joinpath("policies").glob("*.yaml")}
    assert presets and {f"egressd/data/policies/{p}" for p in presets} <= names
    assert {"egressd/dashboard/static/index.html", "egressd/dashboard/static/app.js"} <= names
    assert not any(n.startswith("addons/") or n.endswith("/demo.py") for n in names)


def test_every_command_group_runs_from_the_wheel(installed: tuple[Path, dict[str, str], Path]) -> None:
    exe, env, work = installed
    where = egressd(installed, "--version")
    assert "mitmproxy 12.3.1" in where
    origin = subprocess.run(
        [str(exe.parent / "python"), "-c", "import egressd, egressd.addons; print(egressd.__file__)"],
        cwd=work,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert origin.startswith(str(exe.parent.parent)), origin  # the wheel's, not the checkout's
    # the presets, from the package data
    assert egressd(installed, "check", "--policy", "npm", "registry.npmjs.org:443").startswith("allow\n")
    assert egressd(installed, "policy", "path", "pypi").strip().endswith("egressd/data/policies/pypi.yaml")
    # policy import (egressd.tools.importers) and export (egressd.tools.export)
    settings = work / "srt.json"
    settings.write_text(json.dumps({"network": {"allowedDomains": ["github.com"], "deniedDomains": []}}))
    imported = egressd(installed, "policy", "import", "--from", "srt", str(settings))
    assert "github.com" in imported
    assert "http_access deny all" in egressd(
        installed, "policy", "export", "--to", "squid", "--policy", "npm"
    )
    assert "anthropic" in egressd(installed, "provider", "list")
    assert Path(egressd(installed, "ca", "path").strip()).is_file()
    # exec: a child through the proxy (mitmproxy and the addons import lazily: a tunnel is not needed)
    egressd(installed, "exec", "--", sys.executable, "-c", "import os; assert os.environ['HTTPS_PROXY']")
    assert "hidden" in egressd(installed, "sandbox", "--explain", "--", "true").lower()
    # run, with the dashboard's static files, and the commands that talk to a running egressd
    _serve(installed)
    for group in ("ssh", "remote-agent", "acp", "mcp", "watch", "approve", "deny", "grant", "dashboard"):
        assert "Usage:" in egressd(installed, group, "--help"), group
    assert "unwrap" in egressd(installed, "mcp", "--help")
    tokens = work / "tokens.json"
    assert len(egressd(installed, "gateway", "token", "add", "one", "--tokens", str(tokens)).split()[0]) >= 40


def _serve(installed: tuple[Path, dict[str, str], Path]) -> None:
    exe, env, work = installed
    proc = subprocess.Popen(
        [str(exe), "run", "--dashboard", "--no-prompt"],
        cwd=work,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stderr is not None
        found = None
        deadline = time.monotonic() + 60
        seen = ""
        while found is None and time.monotonic() < deadline:
            line = proc.stderr.readline()
            seen += line
            found = re.search(r"dashboard: (http://127\.0\.0\.1:\d+/\?token=\S+)", line)
        assert found, seen
        opener = urllib.request.build_opener(
            urllib.request.ProxyHandler({}), urllib.request.HTTPCookieProcessor(http.cookiejar.CookieJar())
        )
        page = opener.open(found.group(1), timeout=10).read().decode()
        assert "<html" in page.lower() and "app.js" in page
        base = found.group(1).split("/?", 1)[0]
        assert "function" in opener.open(f"{base}/static/app.js", timeout=10).read().decode()
        assert "egressd run" in egressd(installed, "ps") or "pid" in egressd(installed, "ps").lower()
        egressd(installed, "pending")
    finally:
        proc.terminate()
        proc.wait(30)
