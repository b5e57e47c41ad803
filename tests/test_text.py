"""printable: what a server sent, shown without any control or format character."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from llmhealth.text import printable


@pytest.mark.parametrize(
    ("sent", "shown"),
    [
        ("engine 0", "engine 0"),
        ("0\x1b[2J", "0\\x1b[2J"),  # clear screen
        ("a\nforged log line", "a\\nforged log line"),
        ("tab\there", "tab\\there"),
        ("\x9b31m", "\\x9b31m"),  # the one-byte C1 CSI
        ("abc\u202edcba", "abc\\u202edcba"),  # right-to-left override
        ("modèle-日本", "modèle-日本"),  # printable non-ASCII stays as it is
        ("bell\x07", "bell\\x07"),
    ],
)
def test_control_and_format_characters_are_escaped_and_the_rest_kept(sent: str, shown: str) -> None:
    assert printable(sent) == shown


@given(st.text())
def test_anything_at_all_comes_out_printable(sent: str) -> None:
    assert printable(sent).isprintable()


@given(st.text().filter(str.isprintable))
def test_printable_text_is_left_alone(sent: str) -> None:
    assert printable(sent) == sent
