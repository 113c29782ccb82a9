"""The policy file edit behind "always" answers: comments and order kept, checked, atomic."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from egressd.policy import load_policy
from egressd.tools.policy_edit import PolicyEditError, add_rule, edit_rule, validate_rule

YAML = """\
version: 1
# why this file exists
mode: ask   # ask about the rest
allow:
  - a.test   # the first
  - "b.test"
private: {allow: false}
"""


def test_yaml_keeps_comments_order_quoting_and_indent(tmp_path: Path) -> None:
    path = tmp_path / "p.yaml"
    path.write_text(YAML)
    os.chmod(path, 0o640)
    assert "added c.test:443 to allow" in add_rule(path, "allow", "c.test:443")
    assert path.read_text() == YAML.replace('  - "b.test"\n', '  - "b.test"\n  - c.test:443\n')
    assert os.stat(path).st_mode & 0o777 == 0o640
    add_rule(path, "deny", "d.test:80")
    assert path.read_text().endswith("private: {allow: false}\ndeny:\n  - d.test:80\n")
    assert "already" in add_rule(path, "deny", "d.test:80")
    policy = load_policy(path, env={})
    assert [r.text for r in policy.allow.rules] == ["a.test", "b.test", "c.test:443"]
    assert [p.name for p in tmp_path.iterdir()] == ["p.yaml"]  # no temporary file left


def test_symlinked_policy_edits_the_target(tmp_path: Path) -> None:
    real = tmp_path / "real.yaml"
    real.write_text("version: 1\nallow: []\n")
    link = tmp_path / "link.yaml"
    link.symlink_to(real)
    add_rule(link, "allow", "x.test:443")
    assert link.is_symlink() and "x.test:443" in real.read_text()


def test_json_stays_json(tmp_path: Path) -> None:
    path = tmp_path / "p.json"
    path.write_text(json.dumps({"version": 1, "mode": "ask"}))
    add_rule(path, "allow", "x.test:443")
    assert json.loads(path.read_text())["allow"] == ["x.test:443"]


def test_a_rule_that_would_not_load_leaves_the_file_alone(tmp_path: Path) -> None:
    path = tmp_path / "p.yaml"
    path.write_text(YAML)
    with pytest.raises(PolicyEditError, match="not a valid allow rule"):  # refused before the write
        add_rule(path, "allow", "bad host//")
    assert path.read_text() == YAML
    assert [p.name for p in tmp_path.iterdir()] == ["p.yaml"]


@pytest.mark.parametrize(
    ("which", "rule"),
    [
        ("allow", ""),
        ("allow", "  "),
        ("allow", "a b.test"),
        ("deny", "x.test:99999"),
        ("ports", "a.test"),
        ("allow", 7),
        ("allow", "http://a.test/\n"),
    ],
)
def test_invalid_entries_are_refused_with_a_message(which: str, rule: object) -> None:
    """The dashboard's add: what a hand edit of the file would reject is refused up front."""
    with pytest.raises(PolicyEditError) as caught:
        validate_rule(which, rule)
    assert str(caught.value)


def test_remove_keeps_the_rest_of_the_file(tmp_path: Path) -> None:
    path = tmp_path / "p.yaml"
    path.write_text(YAML)
    assert "removed a.test from allow" in edit_rule(path, "allow", "a.test", remove=True)
    assert path.read_text() == YAML.replace("  - a.test   # the first\n", "")
    with pytest.raises(PolicyEditError, match="not in allow"):
        edit_rule(path, "allow", "a.test", remove=True)
    with pytest.raises(PolicyEditError, match="not in deny"):
        edit_rule(path, "deny", "b.test", remove=True)
    assert [r.text for r in load_policy(path, env={}).allow.rules] == ["b.test"]
    json_path = tmp_path / "p.json"
    json_path.write_text(json.dumps({"version": 1, "allow": ["x.test", "y.test"]}))
    edit_rule(json_path, "allow", "x.test", remove=True)
    assert json.loads(json_path.read_text())["allow"] == ["y.test"]
