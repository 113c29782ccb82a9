"""The file watcher: a good edit applies once the file holds still, a broken file keeps the last
good version, and a load parses exactly the bytes that were looked at."""

from __future__ import annotations

import contextlib
import os
import stat
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

import pytest

from egressd.platform.files import Snapshot, replace_atomically
from egressd.platform.reload import FileWatcher
from egressd.policy import Policy, PolicyError, load_policy

Setup = tuple[Path, "Recorder", FileWatcher[Policy]]
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


@contextlib.contextmanager
def rewriting(path: Path, versions: list[str], then: str | None = None) -> Iterator[None]:
    """A writer rewriting `path` with the versions in turn, every 10 ms, until the block ends;
    then it writes `then`."""
    stop = threading.Event()

    def writer() -> None:
        turn = 0
        while not stop.is_set():
            rewrite(path, versions[turn % len(versions)])
            turn += 1
            time.sleep(0.01)
        if then is not None:
            rewrite(path, then)

    thread = threading.Thread(target=writer)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


def policy_watcher(
    path: Path,
    rec: Recorder,
    *,
    env: Mapping[str, str] | None = None,
    transform: Callable[[Policy], Policy] | None = None,
    on_change: Callable[[Policy], None] | None = None,
    interval: float = 0.5,
) -> FileWatcher[Policy]:
    """The policy file's watcher, as the session builds it (the file read through the snapshot)."""

    def load(files: Snapshot) -> Policy:
        policy = load_policy(path, {} if env is None else env, files.read)
        return transform(policy) if transform else policy

    return FileWatcher(path, load, on_change or rec.change, rec.error, interval=interval)


def settled_poll(watcher: FileWatcher[Policy]) -> bool:
    """A change is applied on the second look that finds it unchanged."""
    first = watcher.poll()
    return watcher.poll() or first


@pytest.fixture
def setup(tmp_path: Path) -> Setup:
    path = tmp_path / "policy.yaml"
    path.write_text(GOOD)
    rec = Recorder()
    return path, rec, policy_watcher(path, rec, interval=0.05)


def test_initial_load_and_no_change(setup: Setup) -> None:
    path, rec, watcher = setup
    assert allowed(watcher.load()) == ["up.test"]
    assert watcher.poll() is False
    os.utime(path)  # touched, same content: no reload
    assert watcher.poll() is False
    assert rec.policies == [] and rec.errors == []


def test_edit_applies(setup: Setup) -> None:
    path, rec, watcher = setup
    watcher.load()
    rewrite(path, GOOD2)
    assert watcher.poll() is False  # changed since the last look: maybe still being written
    assert rec.policies == []
    assert watcher.poll() is True  # the same on the next look: applied
    assert allowed(rec.policies[-1]) == ["up.test", "other.test"]


def test_broken_file_keeps_last_good_and_reports_once(
    setup: Setup,
) -> None:
    path, rec, watcher = setup
    watcher.load()
    rewrite(path, BROKEN)
    assert watcher.poll() is False
    assert rec.errors == []  # not reported before it held still: it may be half written
    assert watcher.poll() is False
    assert watcher.poll() is False
    assert rec.policies == []
    assert len(rec.errors) == 1 and str(path) in rec.errors[0]
    rewrite(path, GOOD2)
    assert settled_poll(watcher) is True
    assert allowed(rec.policies[-1]) == ["up.test", "other.test"]


def test_missing_file_is_an_error_not_a_change(setup: Setup) -> None:
    path, rec, watcher = setup
    watcher.load()
    path.unlink()
    assert watcher.poll() is False and watcher.poll() is False and watcher.poll() is False
    assert len(rec.errors) == 1 and rec.policies == []
    assert str(path) in rec.errors[0] and "cannot read" in rec.errors[0]
    path.write_text(GOOD)  # back again (an editor's rename-on-save): reloaded
    assert settled_poll(watcher) is True


def test_trigger_forces_reload(setup: Setup) -> None:
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

    watcher = policy_watcher(path, rec, transform=transform)
    assert allowed(watcher.load()) == ["up.test", "cli.test"]
    rewrite(path, GOOD2)
    assert settled_poll(watcher) is False
    assert rec.policies == [] and "no such profile" in rec.errors[0]


def test_env_mode_applies_to_reloads(tmp_path: Path) -> None:
    path = tmp_path / "p.yaml"
    path.write_text(GOOD)
    rec = Recorder()
    watcher = policy_watcher(path, rec, env={"EGRESSD_MODE": "ask"})
    assert watcher.load().mode == "ask"


def test_background_thread_picks_up_edits_and_trigger(
    setup: Setup,
) -> None:
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


def test_on_change_failure_is_reported(setup: Setup) -> None:
    path, rec, _ = setup

    def boom(policy: Policy) -> None:
        raise RuntimeError("engine said no")

    watcher = policy_watcher(path, rec, on_change=boom)
    watcher.load()
    rewrite(path, GOOD2)
    assert settled_poll(watcher) is False
    assert "engine said no" in rec.errors[0]


def test_stop_is_prompt(setup: Setup) -> None:
    _, _, watcher = setup
    watcher.interval = 30
    watcher.start()
    started = time.monotonic()
    watcher.stop()
    assert time.monotonic() - started < 2


def test_a_load_parses_the_bytes_it_looked_at(tmp_path: Path) -> None:
    """A write that lands between the look and the parse is not what the load parses: the bytes
    that were checked are the bytes parsed (the next version is applied on its own looks)."""
    path = tmp_path / "p.yaml"
    path.write_text(GOOD)
    rec = Recorder()
    loads: list[Path] = []

    def load(files: Snapshot) -> Policy:
        loads.append(path)
        if len(loads) == 2:  # another writer, just after the look that found GOOD2 unchanged
            path.write_text(BROKEN)
        return load_policy(path, {}, files.read)

    watcher = FileWatcher(path, load, rec.change, rec.error)
    watcher.load()
    rewrite(path, GOOD2)
    assert settled_poll(watcher) is True
    assert allowed(rec.policies[-1]) == ["up.test", "other.test"]  # as looked at, not BROKEN
    assert rec.errors == []
    assert settled_poll(watcher) is False and len(rec.errors) == 1  # then BROKEN, once it held still


def test_a_file_that_changed_between_looks_is_not_applied(
    setup: Setup,
) -> None:
    path, rec, watcher = setup
    watcher.load()
    half = GOOD2[: GOOD2.index("other.test")]  # "allow: [up.test, " : a half-written file
    rewrite(path, half)
    assert watcher.poll() is False  # the half file, looked at once
    rewrite(path, GOOD2)
    assert watcher.poll() is False  # changed again: still being written
    assert rec.policies == [] and rec.errors == []
    assert watcher.poll() is True
    assert [allowed(p) for p in rec.policies] == [["up.test", "other.test"]]


def test_the_same_content_rewritten_in_place_is_not_reloaded(
    setup: Setup,
) -> None:
    path, rec, watcher = setup
    watcher.load()
    rewrite(path, GOOD[:20])  # truncated and half rewritten ...
    assert watcher.poll() is False
    rewrite(path, GOOD)  # ... and finished: the content in force
    assert watcher.poll() is False and watcher.poll() is False
    assert rec.policies == [] and rec.errors == []


def test_a_forced_reload_applies_a_file_that_holds_still(
    setup: Setup,
) -> None:
    path, rec, watcher = setup
    watcher.load()
    rewrite(path, GOOD2)  # just written: looked at again QUIET later, unchanged, applied
    assert watcher.poll(force=True) is True
    assert allowed(rec.policies[-1]) == ["up.test", "other.test"]


def test_a_forced_reload_leaves_a_file_being_written_to_the_polls(tmp_path: Path) -> None:
    """SIGHUP while the file is being written: nothing is applied until it holds still, and then
    the reload happens even though the content is the one in force (it was asked for)."""
    path = tmp_path / "p.yaml"
    path.write_text(GOOD)
    rec = Recorder()
    # a poll longer than the writer's pauses can be, even on a loaded machine (a writer that pauses
    # longer than a poll is the one case no reader can tell from a finished file)
    watcher = policy_watcher(path, rec, interval=1.0)
    watcher.load()
    watcher.start()
    with rewriting(path, [BROKEN, GOOD2], then=GOOD):
        watcher.trigger()
        time.sleep(2.5)
        assert rec.policies == [] and rec.errors == []
    try:
        assert rec.event.wait(10)
        assert [allowed(p) for p in rec.policies] == [["up.test"]] and rec.errors == []
    finally:
        watcher.stop()


def test_every_file_the_load_reads_is_watched(tmp_path: Path) -> None:
    """A file the policy names (a merged policy, a secret's file) is read through the snapshot:
    watched like the policy, applied whole with it; a file a new version starts to read is applied
    only once it, too, held still."""
    path, extra = tmp_path / "p.yaml", tmp_path / "extra.txt"
    path.write_text(GOOD)
    extra.write_text("one")
    rec = Recorder()
    seen: list[bytes] = []

    def load(files: Snapshot) -> Policy:
        policy = load_policy(path, {}, files.read)
        if "other.test" in allowed(policy):
            seen.append(files.read(extra))
        return policy

    watcher = FileWatcher(path, load, rec.change, rec.error)
    watcher.load()
    rewrite(path, GOOD2)  # this version reads `extra` too
    assert watcher.poll() is False and watcher.poll() is False  # extra: seen once only
    assert watcher.poll() is True and seen[-1] == b"one"
    rewrite(extra, "two")
    assert settled_poll(watcher) is True and seen[-1] == b"two"
    extra.unlink()
    assert settled_poll(watcher) is False
    assert len(rec.errors) == 1 and str(extra) in rec.errors[0]


def test_the_first_load_waits_for_a_file_being_written(tmp_path: Path) -> None:
    path = tmp_path / "p.yaml"
    path.write_text(GOOD[:10])
    rec = Recorder()
    watcher = policy_watcher(path, rec)

    def writer() -> None:
        for end in [*range(20, len(GOOD2), 5), len(GOOD2)]:
            time.sleep(0.03)
            rewrite(path, GOOD2[:end])

    thread = threading.Thread(target=writer)
    thread.start()
    try:
        assert allowed(watcher.load()) == ["up.test", "other.test"]
    finally:
        thread.join()


def test_the_first_load_gives_up_on_a_file_that_never_holds_still(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from egressd.platform import reload

    monkeypatch.setattr(reload, "START_WAIT", 0.5)
    path = tmp_path / "p.yaml"
    path.write_text(GOOD)
    with rewriting(path, [GOOD, GOOD2]), pytest.raises(reload.UnsettledError, match="replace it atomically"):
        policy_watcher(path, Recorder()).load()


def test_replace_atomically_keeps_or_sets_the_mode_and_refuses_whole(tmp_path: Path) -> None:
    """The one atomic replace every writer uses: a file keeps its permissions, a private one is
    created private, bytes and text alike, and a refused check leaves the file as it was."""
    kept = tmp_path / "policy.yaml"
    kept.write_text("old\n")
    kept.chmod(0o640)
    replace_atomically(kept, "new\n")
    assert kept.read_text() == "new\n" and stat.S_IMODE(kept.stat().st_mode) == 0o640
    private = tmp_path / "tokens.json"
    replace_atomically(private, b"{}\n", mode=0o600)
    assert private.read_bytes() == b"{}\n" and stat.S_IMODE(private.stat().st_mode) == 0o600

    def refuse(temp: str) -> None:
        assert Path(temp).read_text() == "broken\n"
        raise ValueError("no")

    with pytest.raises(ValueError, match="no"):
        replace_atomically(kept, "broken\n", check=refuse)
    assert kept.read_text() == "new\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["policy.yaml", "tokens.json"]
