"""The one selection rule, on its own: values in, one candidate out."""

from __future__ import annotations

from pathlib import Path

from hypothesis import given
from hypothesis import strategies as st
from test_metrics import FORBIDDEN, called_names, imported_modules

from llmhealth.choice import fewest_in_flight

ROOT = Path(__file__).resolve().parent.parent


def test_the_candidate_with_fewest_requests_in_flight_is_chosen() -> None:
    assert fewest_in_flight(["a", "b", "c"], {"a": 3, "b": 1, "c": 2}) == "b"


def test_a_candidate_missing_from_the_counts_has_nothing_in_flight() -> None:
    assert fewest_in_flight(["a", "b"], {"a": 1}) == "b"


def test_ties_go_to_the_earliest_candidate_in_the_order_given() -> None:
    assert fewest_in_flight(["b", "a"], {"a": 1, "b": 1}) == "b"
    assert fewest_in_flight([2, 10, 1], {}) == 2


def test_counts_of_backends_that_are_not_candidates_are_ignored() -> None:
    # A backend that left the serving set may still have requests in flight.
    assert fewest_in_flight(["b"], {"a": 0, "b": 7}) == "b"


def test_no_candidates_means_no_choice() -> None:
    assert fewest_in_flight([], {"a": 0}) is None


@given(
    st.lists(st.integers(min_value=0, max_value=20), unique=True),
    st.dictionaries(st.integers(min_value=0, max_value=20), st.integers(0, 50)),
)
def test_the_choice_is_the_first_candidate_with_the_least_in_flight(
    candidates: list[int], counts: dict[int, int]
) -> None:
    chosen = fewest_in_flight(candidates, counts)
    if not candidates:
        assert chosen is None
        return
    least = min(counts.get(c, 0) for c in candidates)
    first = next(c for c in candidates if counts.get(c, 0) == least)
    assert chosen == first


def test_the_rule_is_pure() -> None:
    source = (ROOT / "llmhealth" / "choice.py").read_text(encoding="utf-8")
    assert not imported_modules(source) & FORBIDDEN
    assert not called_names(source) & {"open", "__import__", "exec", "eval"}
