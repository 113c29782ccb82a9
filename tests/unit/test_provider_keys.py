"""The `preset:` and `providers:` keys: validated like every key, kept by the dump, never decisive."""

from __future__ import annotations

import datetime

import pytest

from egressd.policy import PolicyError, parse_policy
from egressd.policy.dump import policy_to_data
from egressd.remote.channel import policy_message

ACK = {
    "name": "anthropic",
    "version": 1,
    "acknowledged": "2026-12-01",
    "hosts": ["api.anthropic.com:443"],
    "added": [],
}


def test_keys_round_trip_through_the_dump() -> None:
    data = {
        "allow": ["api.anthropic.com:443"],
        "preset": {"name": "anthropic", "version": 2, "summary": "s", "sends": "prompts"},
        "providers": [ACK],
    }
    policy = parse_policy(data, "p.yaml")
    again = parse_policy(policy_to_data(policy), "again")
    assert again == policy and again.providers == policy.providers and again.preset == policy.preset
    assert "providers" not in policy_message(policy, 1)["policy"]  # not pushed to a remote egressd


def test_a_yaml_date_is_read_as_the_day() -> None:
    policy = parse_policy({"providers": [{**ACK, "acknowledged": datetime.date(2026, 12, 1)}]}, "p")
    assert policy.providers[0].acknowledged == "2026-12-01"


@pytest.mark.parametrize(
    ("providers", "key"),
    [
        ([{**ACK, "version": 0}], "providers[0].version"),
        ([{**ACK, "version": True}], "providers[0].version"),
        ([{**ACK, "hosts": ["exa mple.com"]}], "providers[0].hosts[0]"),
        ([{**ACK, "extra": 1}], "providers[0].extra"),
        ([ACK, ACK], "providers[1].name"),
        ([{**ACK, "name": ""}], "providers[0].name"),
        ("anthropic", "providers"),
    ],
)
def test_bad_acknowledgements_name_the_key(providers: object, key: str) -> None:
    with pytest.raises(PolicyError) as info:
        parse_policy({"providers": providers}, "p.yaml")
    assert info.value.key == key


def test_bad_preset_names_the_key() -> None:
    with pytest.raises(PolicyError, match="preset.name"):
        parse_policy({"preset": {"name": "Bad Name", "version": 1}}, "p.yaml")
    with pytest.raises(PolicyError, match="preset.version"):
        parse_policy({"preset": {"name": "ok"}}, "p.yaml")


def test_every_preset_describes_itself_and_comments_each_host() -> None:
    from egressd.policy import load_policy
    from egressd.policy.loader import builtin_policy_names, builtin_policy_path

    names = set(builtin_policy_names())
    expected = (
        "anthropic openai gemini mistral groq openrouter ollama huggingface github gitlab npm pypi crates go"
    )
    assert {*expected.split(), "dockerhub", "default"} <= names
    for name in names - {"default"}:
        path = builtin_policy_path(name)
        policy = load_policy(path)
        assert policy.preset is not None and policy.preset.name == name, path
        assert policy.preset.version >= 1 and policy.preset.sends and policy.preset.summary, path
        lines = path.read_text().splitlines()
        start = lines.index("allow:")
        for index, line in enumerate(lines[start + 1 :], start + 1):
            if not line.startswith("  - "):
                if not line.startswith(" "):
                    break
                continue
            above = next(text for text in reversed(lines[:index]) if not text.startswith("  - "))
            commented = "#" in line or above.lstrip().startswith("#")  # its own, or its group's
            assert commented, f"{path}:{index + 1}: {line.strip()} has no comment"
