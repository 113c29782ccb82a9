"""Policy reload: a good edit applies, a broken file keeps the last good policy."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest

from egressd.policy import Policy, PolicyError
from egressd.reload import PolicyWatcher

GOOD = "version: 1\nmode: enforce\nallow: [up.test]\n"
GOOD2 = "version: 1\nmode: enforce\nallow: [up.test, other.test]\n"
BROKEN = "version: 1\nallow: [up.test\n"


class Recorder:
    def __init__(self) -> None:
        self.policies: list[Policy] = []
        self.errors: list[str] = []
        self.event = threading.Event()

    def change(self, policy: Policy) -> None:
        self.policies.append(policy)
        self.event.set()

    def error(self, message: str) -> None:
        self.errors.append(message)
        self.event.set()


def allowed(policy: Policy) -> list[str]:
    return [rule.text for rule in policy.allow.rules]


def rewrite(path: Path, text: str) -> None:
    """Write and make sure the stat signature moves even on coarse-mtime file systems."""
    path.write_text(text)
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))


@pytest.fixture
def setup(tmp_path: Path) -> tuple[Path, Recorder, PolicyWatcher]:
    path = tmp_path / "policy.yaml"
    path.write_text(GOOD)
    rec = Recorder()
    return path, rec, PolicyWatcher(path, rec.change, rec.error, interval=0.05, env={})


def test_initial_load_and_no_change(setup: tuple[Path, Recorder, PolicyWatcher]) -> None:
    path, rec, watcher = setup
    assert allowed(watcher.load()) == ["up.test"]
    assert watcher.poll() is False
    os.utime(path)  # touched, same content: no reload
    assert watcher.poll() is False
    assert rec.policies == [] and rec.errors == []


def test_edit_applies(setup: tuple[Path, Recorder, PolicyWatcher]) -> None:
    path, rec, watcher = setup
    watcher.load()
    rewrite(path, GOOD2)
    assert watcher.poll() is True
    assert allowed(rec.policies[-1]) == ["up.test", "other.test"]


def test_broken_file_keeps_last_good_and_reports_once(setup: tuple[Path, Recorder, PolicyWatcher]) -> None:
    path, rec, watcher = setup
    watcher.load()
    rewrite(path, BROKEN)
    assert watcher.poll() is False
    assert watcher.poll() is False
    assert rec.policies == []
    assert len(rec.errors) == 1 and str(path) in rec.errors[0]
    rewrite(path, GOOD2)
    assert watcher.poll() is True
    assert allowed(rec.policies[-1]) == ["up.test", "other.test"]


def test_missing_file_is_an_error_not_a_change(setup: tuple[Path, Recorder, PolicyWatcher]) -> None:
    path, rec, watcher = setup
    watcher.load()
    path.unlink()
    assert watcher.poll() is False and watcher.poll() is False
    assert len(rec.errors) == 1 and rec.policies == []
    path.write_text(GOOD)  # back again (an editor's rename-on-save): reloaded
    assert watcher.poll() is True


def test_trigger_forces_reload(setup: tuple[Path, Recorder, PolicyWatcher]) -> None:
    _, rec, watcher = setup
    watcher.load()
    assert watcher.poll(force=True) is True
    assert allowed(rec.policies[-1]) == ["up.test"]


def test_transform_is_applied_and_its_errors_keep_the_last_good(tmp_path: Path) -> None:
    path = tmp_path / "p.yaml"
    path.write_text(GOOD)
    rec = Recorder()

    def transform(policy: Policy) -> Policy:
        policy = policy.with_overrides(allow=["cli.test"])
        if "other.test" in allowed(policy):
            raise PolicyError(policy.source, "--profile", "ci", "no such profile")
        return policy

    watcher = PolicyWatcher(path, rec.change, rec.error, env={}, transform=transform)
    assert allowed(watcher.load()) == ["up.test", "cli.test"]
    rewrite(path, GOOD2)
    assert watcher.poll() is False
    assert rec.policies == [] and "no such profile" in rec.errors[0]


def test_env_mode_applies_to_reloads(tmp_path: Path) -> None:
    path = tmp_path / "p.yaml"
    path.write_text(GOOD)
    rec = Recorder()
    watcher = PolicyWatcher(path, rec.change, rec.error, env={"EGRESSD_MODE": "ask"})
    assert watcher.load().mode == "ask"


def test_background_thread_picks_up_edits_and_trigger(setup: tuple[Path, Recorder, PolicyWatcher]) -> None:
    path, rec, watcher = setup
    watcher.load()
    watcher.start()
    try:
        rewrite(path, BROKEN)
        assert rec.event.wait(5)
        assert rec.errors and not rec.policies
        rec.event.clear()
        rewrite(path, GOOD2)
        assert rec.event.wait(5)
        assert allowed(rec.policies[-1]) == ["up.test", "other.test"]
        rec.event.clear()
        watcher.trigger()
        assert rec.event.wait(5)
        assert len(rec.policies) == 2
    finally:
        watcher.stop()


def test_on_change_failure_is_reported(setup: tuple[Path, Recorder, PolicyWatcher]) -> None:
    path, rec, _ = setup

    def boom(policy: Policy) -> None:
        raise RuntimeError("engine said no")

    watcher = PolicyWatcher(path, boom, rec.error, env={})
    watcher.load()
    rewrite(path, GOOD2)
    assert watcher.poll() is False
    assert "engine said no" in rec.errors[0]


def test_stop_is_prompt(setup: tuple[Path, Recorder, PolicyWatcher]) -> None:
    _, _, watcher = setup
    watcher.interval = 30
    watcher.start()
    started = time.monotonic()
    watcher.stop()
    assert time.monotonic() - started < 2
