"""The one reading of a port number: the nasty spellings, and a property against an oracle written
from RFC 3986's `port = *DIGIT` (ASCII digits) and TCP's 16-bit port field."""

from __future__ import annotations

import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

from egressd.policy.ports import port_number, port_problem

TABLE = [
    ("80", 80),
    ("1", 1),
    ("65535", 65535),
    ("0080", 80),  # leading zeros, as a URL reads them
    ("0" * 5000 + "443", 443),  # beyond Python's 4,300-digit limit for int(): still no exception
    ("0", None),
    ("00000", None),
    ("65536", None),
    ("99999", None),
    ("100000", None),
    ("9" * 5000, None),
    ("", None),
    (" 80", None),
    ("80 ", None),
    ("+80", None),
    ("-1", None),
    ("8_0", None),  # int() takes underscores
    ("0x50", None),
    ("²", None),  # str.isdigit() says yes, int() raises
    ("٨٠", None),  # Arabic-Indic digits: int() reads 80
    ("８０", None),  # full-width digits: int() reads 80
    ("𝟖𝟎", None),  # mathematical bold digits: int() reads 80
    ("80\n", None),
    ("80\x00", None),
]


@pytest.mark.parametrize(("text", "port"), TABLE, ids=[repr(t[:12]) for t, _ in TABLE])
def test_a_port_is_ascii_digits_from_1_to_65535(text: str, port: int | None) -> None:
    assert port_number(text) == port


def test_zero_is_a_port_where_the_caller_asks_for_any_free_one() -> None:
    assert port_number("0", lowest=0) == 0
    assert port_number("000", lowest=0) == 0
    assert port_number("٠", lowest=0) is None


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("²", "invalid port '²'"),
        ("8_0", "invalid port '8_0'"),
        ("70000", "port 70000 out of range 1-65535"),
        ("0", "port 0 out of range 1-65535"),
        ("9" * 5000, "port 999999999999... out of range 1-65535"),
    ],
)
def test_the_problem_names_what_was_written(text: str, problem: str) -> None:
    assert port_problem(text) == problem


def _oracle(text: str, lowest: int) -> int | None:
    if re.fullmatch(r"[0-9]+", text, re.ASCII) is None:
        return None
    digits = text.lstrip("0")
    if len(digits) > 5:
        return None
    value = sum(int(d) * 10**i for i, d in enumerate(reversed(digits)))
    return value if lowest <= value <= 65535 else None


@given(st.text(max_size=12), st.sampled_from([0, 1]))
def test_any_text_reads_as_the_oracle_does_and_never_raises(text: str, lowest: int) -> None:
    assert port_number(text, lowest=lowest) == _oracle(text, lowest)


@given(st.integers(min_value=0, max_value=200_000), st.integers(min_value=0, max_value=8))
def test_every_number_with_any_leading_zeros(value: int, zeros: int) -> None:
    text = "0" * zeros + str(value)
    assert port_number(text) == (value if 1 <= value <= 65535 else None)
