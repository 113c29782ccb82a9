"""A real Docker engine for the compose gateway's tests: the engine, the images, one compose project.

Why: docker-compose.yml is a user deliverable, so its test runs it as a user does — `docker-compose
up` on a real engine — with tests/compose.test.yml on top (the egress network internal too, the
upstream a container), so no packet leaves the machine. The engine is started when none answers
(and stopped again at the end, when started here). The images come from scripts/gateway_image.py
with --offline: the parts needing the network (the Debian base image, the dependency wheels) were
made by scripts/setup.sh, and egressd's image is rebuilt, offline, only when its recipe hash changed.

The test process lives in its own network namespace (tests/conftest.py); the engine does not, and is
reached over its Unix socket only, so every look inside goes through `docker exec`.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType

REPO = Path(__file__).resolve().parents[2]
COMPOSE_FILES = [REPO / "docker-compose.yml", REPO / "tests" / "compose.test.yml"]
UPSTREAM_SCRIPT = Path(__file__).with_name("compose_upstream.py")


class DockerLabError(RuntimeError):
    """The engine or the images are not there; the message says what to run."""


def _builder() -> ModuleType:
    """scripts/gateway_image.py as a module: the one place that knows how the images are made."""
    spec = importlib.util.spec_from_file_location("gateway_image", REPO / "scripts" / "gateway_image.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def start_engine(deadline_s: float = 90.0) -> subprocess.Popen[bytes] | None:
    """Make sure an engine answers; return the dockerd started here (None: one was running)."""
    builder = _builder()
    try:
        return builder.ensure_dockerd(deadline_s)
    except builder.BuildError as exc:
        raise DockerLabError(str(exc)) from exc


def stop_engine(proc: subprocess.Popen[bytes], timeout: float = 30.0) -> None:
    proc.terminate()
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)


def build_images(timeout: float = 600.0) -> tuple[dict[str, str], float]:
    """The gateway's images (cached by recipe hash, offline); returns their references and the seconds."""
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "gateway_image.py"), "--offline"],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    if done.returncode != 0:
        raise DockerLabError(f"scripts/gateway_image.py --offline failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1]), time.monotonic() - started


class ComposeProject:
    """docker-compose.yml + tests/compose.test.yml under a project name of its own."""

    def __init__(
        self, workdir: Path, images: dict[str, str], policy: str, lab_files: dict[str, bytes] | None = None
    ) -> None:
        self.name = f"egressdtest{uuid.uuid4().hex[:10]}"
        self.policy_dir = workdir / "policy"
        self.ca_dir = workdir / "ca"
        self.lab_dir = workdir / "lab"
        for d in (self.policy_dir, self.lab_dir):
            d.mkdir(parents=True)
        (self.lab_dir / UPSTREAM_SCRIPT.name).write_bytes(UPSTREAM_SCRIPT.read_bytes())
        for name, data in (lab_files or {}).items():  # mounted read-only at /lab in the test services
            (self.lab_dir / name).write_bytes(data)
        self.write_policy(policy)
        self.env = {
            **os.environ,
            "EGRESSD_POLICY_DIR": str(self.policy_dir),
            "EGRESSD_CA_DIR": str(self.ca_dir),
            "EGRESSD_BASE_IMAGE": images["base"],
            "EGRESSD_IMAGE": images["egressd"],  # this checkout's, by recipe hash
            "EGRESSD_AGENT_IMAGE": images["agent"],
            "EGRESSD_METRICS": "127.0.0.1:",  # "127.0.0.1::9090": any free host port, never a clash
            "LAB_DIR": str(self.lab_dir),
            "COMPOSE_PROJECT_NAME": self.name,
        }
        for var in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy", "all_proxy"):
            self.env.pop(var, None)  # docker-compose would send its engine API calls to them

    def write_policy(self, text: str) -> None:
        """Replace policy.yaml as an editor does (a new file renamed over the old one)."""
        tmp = self.policy_dir / ".policy.yaml.new"
        tmp.write_text(text)
        tmp.replace(self.policy_dir / "policy.yaml")

    def compose(
        self, *args: str, timeout: float = 180.0, check: bool = True
    ) -> subprocess.CompletedProcess[str]:
        cmd = ["docker-compose", "-p", self.name]
        for f in COMPOSE_FILES:
            cmd += ["-f", str(f)]
        done = subprocess.run(
            [*cmd, *args],
            capture_output=True,
            text=True,
            timeout=timeout,
            env=self.env,
            cwd=REPO,
            check=False,
        )
        if check and done.returncode != 0:
            raise DockerLabError(
                f"docker-compose {' '.join(args)} failed ({done.returncode}):\n{done.stderr[-4000:]}"
            )
        return done

    def up(self) -> None:
        self.compose("up", "-d", "--no-build", timeout=300)

    def down(self) -> subprocess.CompletedProcess[str]:
        return self.compose(
            "down", "--volumes", "--remove-orphans", "--timeout", "10", timeout=180, check=False
        )

    def exec(
        self, service: str, argv: Sequence[str], timeout: float = 60.0
    ) -> subprocess.CompletedProcess[str]:
        """A command in the running service's container (through its entrypoint's environment only if
        the command asks for it)."""
        return self.compose("exec", "-T", service, *argv, timeout=timeout, check=False)

    def run(
        self, service: str, argv: Sequence[str], timeout: float = 120.0
    ) -> subprocess.CompletedProcess[str]:
        """A one-off container of `service`, through its entrypoint (the agent's proxy settings)."""
        return self.compose("run", "--rm", "-T", "--no-deps", service, *argv, timeout=timeout, check=False)

    def logs(self, service: str) -> str:
        return self.compose("logs", "--no-color", service, check=False).stdout

    def container_ip(self, service: str, network: str) -> str:
        return self.inspect(
            service, f'{{{{(index .NetworkSettings.Networks "{self.name}_{network}").IPAddress}}}}'
        )

    def inspect(self, service: str, fmt: str) -> str:
        """`docker inspect --format FMT` of the service's container."""
        cid = self.compose("ps", "-q", service).stdout.strip()
        done = subprocess.run(
            ["docker", "inspect", "--format", fmt, cid], capture_output=True, text=True, check=True
        )
        return done.stdout.strip()

    def health(self, service: str) -> str:
        """The engine's view of the service's health check: starting, healthy or unhealthy."""
        return self.inspect(service, "{{.State.Health.Status}}")

    def leftovers(self) -> dict[str, list[str]]:
        """Everything of this project the engine still has: containers (running or not), networks, volumes."""
        label = f"label=com.docker.compose.project={self.name}"
        found: dict[str, list[str]] = {}
        for kind, cmd in (
            ("containers", ["docker", "ps", "-a", "--filter", label, "--format", "{{.Names}}"]),
            ("networks", ["docker", "network", "ls", "--filter", label, "--format", "{{.Name}}"]),
            ("volumes", ["docker", "volume", "ls", "--filter", label, "--format", "{{.Name}}"]),
        ):
            out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.split()
            found[kind] = out
        return found
