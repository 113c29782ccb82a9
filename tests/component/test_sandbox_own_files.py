"""What egressd opens while the child runs, the child can write none of: on Linux and under macOS's profile.

egressd reads and writes files after the child started: its CA, the roots mitmproxy verifies
upstream servers against (the connections egressd puts real secrets into), the keys of refusal
pages, the policy, the audit, its own code. A child that could write one could add its own CA to
the roots egressd trusts, or change what egressd runs. The test runs the real `egressd sandbox` as
a user who is not root, with TLS inspection on (so egressd makes its trust files) and TMPDIR inside
the project (a place the child writes), records every path egressd's process opens, creates,
renames, removes or binds from the moment the layout is planned (an audit hook,
tests/support/opened_paths.py), and checks each against what the child gets: bubblewrap's view of
the layout on Linux, and for macOS the Seatbelt profile built from the same layout, evaluated by
the rule model for every write operation.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from egressd.sandbox.layout import Layout
from egressd.sandbox.mounts import Mount
from egressd.sandbox.runner import temp_root
from egressd.sandbox.seatbelt import seatbelt_profile
from egressd.sandbox.shields import Cover, inside_view
from tests.support.seatbelt_model import WRITE_OPERATIONS, Model, tinyscheme_available
from tests.support.unprivileged import User, unprivileged_user

RECORDER = Path(__file__).parents[1] / "support" / "opened_paths.py"
POLICY = "version: 1\nallow: [up.test]\ninspect: [up.test]\n"
# Devices the child shares by design: what is written there nobody reads back.
SHARED_DEVICES = ("/dev/null", "/dev/tty")
# The project's files the exit summary reads once the child ended, as untrusted input
# (egressd/sandbox/exit_summary.py: a plain file of bounded size, its content only adds names).
SUMMARY_READS = ("package.json",)


@pytest.fixture(scope="module")
def user() -> Iterator[User]:
    with unprivileged_user() as created:
        created.write("proj/conf/policy.yaml", POLICY, 0o644)
        created.mkdir("proj/.t")
        yield created


def _layout(data: dict[str, object]) -> Layout:
    fields = dict(data)
    fields["mounts"] = tuple(Mount(**m) for m in data["mounts"])  # type: ignore[union-attr]
    fields["covers"] = tuple(Cover(**c) for c in data["covers"])  # type: ignore[union-attr]
    for name, value in fields.items():
        if isinstance(value, list):
            fields[name] = tuple(tuple(v) if isinstance(v, list) else v for v in value)
    return Layout(**fields)  # type: ignore[arg-type]


def _run(user: User, tmpdir: str) -> tuple[Layout, dict[str, str], list[str]]:
    out = user.home / f"opened-{os.getpid()}.jsonl"
    out.unlink(missing_ok=True)
    argv = [sys.executable, str(RECORDER), str(out), "sandbox", "--policy", "conf/policy.yaml"]
    argv += ["--audit", "audit.jsonl", "--", "true"]
    env = {"TMPDIR": str(user.home / "proj" / ".t")} if tmpdir == "project" else {}
    result = user.run(argv, cwd=user.home / "proj", env=env)
    assert result.returncode == 0, result.stderr.decode()
    entries = [json.loads(line) for line in out.read_text().splitlines()]
    out.unlink()
    (started,) = [e for e in entries if "layout" in e]
    paths = [os.path.realpath(os.path.join(e["cwd"], e["path"])) for e in entries if "path" in e]
    paths = [p for p in paths if p not in {str(user.home / "proj" / name) for name in SUMMARY_READS}]
    assert any(p.endswith("upstream-roots.pem") for p in paths), "inspection was not set up"
    return _layout(started["layout"]), started["environ"], list(dict.fromkeys(paths))


@pytest.mark.parametrize("tmpdir", ["project", "default"])
def test_nothing_egressd_opens_after_planning_is_writable_by_the_child(user: User, tmpdir: str) -> None:
    """TMPDIR inside the project (writable on either system), and unset (/tmp: the host's own
    under Seatbelt)."""
    layout, environ, paths = _run(user, tmpdir)
    # Linux: what bubblewrap shows the child at each path
    writable = [p for p in paths if inside_view(p, layout.mounts, layout.covers, layout.private) == "rw"]
    assert writable == []
    # macOS: the profile egressd would run the child with, for the same layout and environment
    if not tinyscheme_available():
        pytest.fail("tinyscheme is not installed: run scripts/setup.sh")
    run_dir = os.path.join(temp_root(environ), "egressd-run-x")  # where run_seatbelt makes it
    profile = seatbelt_profile(layout, [3128], temp=[run_dir], home=str(user.home))
    model = Model.of(profile)
    files = [p for p in paths if p not in SHARED_DEVICES]
    writable = [(op, p) for p in files for op in WRITE_OPERATIONS if model.decide(op, path=p) == "allow"]
    assert writable == []
