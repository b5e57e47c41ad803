"""The one selection rule, and the router's choice around it, driven without sockets."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st
from test_metrics import FORBIDDEN, called_names, imported_modules

from llmhealth.choice import ANY_MODEL, Affinity, choose, fewest_in_flight, serves
from llmhealth.fleet_health import FleetHealth
from llmhealth.selector import Selector

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


LLAMA = frozenset({"llama"})
QWEN = frozenset({"qwen"})


def test_fewest_in_flight_wins_and_ties_go_to_the_first_name() -> None:
    pool = {"b": LLAMA, "a": LLAMA, "c": LLAMA}
    assert choose(pool, {"a": 2, "b": 1, "c": 1}, model="llama") == "b"
    assert choose(pool, {}, model="llama") == "a"


def test_only_backends_that_serve_the_model_are_chosen() -> None:
    pool = {"a": LLAMA, "b": QWEN}
    assert choose(pool, {"b": 50}, model="qwen") == "b"
    assert choose(pool, {}, model="mistral") is None


def test_an_unknown_model_list_accepts_any_model_and_no_model_goes_anywhere() -> None:
    assert serves(ANY_MODEL, "anything")
    assert serves(LLAMA, None)
    assert choose({"a": ANY_MODEL, "b": QWEN}, {}, model="llama") == "a"


def test_an_empty_pick_set_chooses_nothing() -> None:
    assert choose({}, {}, model="llama") is None
    assert choose({}, {}, model=None, key="s") is None


def test_the_library_selector_chooses_by_the_same_rule() -> None:
    fleet = FleetHealth({"a": "http://a:8000", "b": "http://b:8000"})
    for in_flight in ({}, {"a": 3, "b": 1}, {"a": 1, "b": 1}):
        selector = Selector(fleet)
        for name, count in in_flight.items():
            for _ in range(count):
                selector.acquire(name)
        serving = fleet.serving_shards()
        assert selector.next_shard() == fewest_in_flight(serving, in_flight)
        assert selector.next_shard() == choose(
            dict.fromkeys(serving, ANY_MODEL), in_flight, model=None
        )


def test_a_session_key_stays_on_one_backend_under_even_load() -> None:
    pool = dict.fromkeys("abcd", LLAMA)
    homes = {choose(pool, {}, model="llama", key=f"session-{i}", slack=4) for i in range(200)}
    assert homes == set("abcd")  # keys spread over every backend...
    for i in range(50):
        key = f"session-{i}"
        first = choose(pool, {}, model="llama", key=key, slack=4)
        # ...and each stays where it went, whatever the others' load below the slack.
        others = {name: 3 for name in "abcd" if name != first}
        assert choose(pool, others, model="llama", key=key, slack=4) == first


def test_only_a_departed_backends_sessions_move() -> None:
    pool = dict.fromkeys("abcd", LLAMA)
    keys = [f"user-{i}" for i in range(300)]
    before = {key: choose(pool, {}, model="llama", key=key, slack=4) for key in keys}
    smaller = {name: LLAMA for name in "abd"}
    after = {key: choose(smaller, {}, model="llama", key=key, slack=4) for key in keys}
    moved = {key for key in keys if before[key] != after[key]}
    assert moved == {key for key in keys if before[key] == "c"}
    assert moved  # the walk really removed a backend that had sessions


def test_a_sticky_backend_slack_requests_busier_than_the_least_loses_the_session() -> None:
    pool = dict.fromkeys("ab", LLAMA)
    key = next(f"k{i}" for i in range(100) if choose(pool, {}, model="llama", key=f"k{i}") == "b")
    assert choose(pool, {"b": 3, "a": 0}, model="llama", key=key, slack=4) == "b"
    assert choose(pool, {"b": 4, "a": 0}, model="llama", key=key, slack=4) == "a"
    assert choose(pool, {"b": 7, "a": 4}, model="llama", key=key, slack=4) == "b"


def test_a_session_never_goes_to_a_backend_that_does_not_serve_its_model() -> None:
    pool = {"a": LLAMA, "b": frozenset({"mistral"})}
    both = dict.fromkeys("ab", LLAMA)
    key = next(f"k{i}" for i in range(100) if choose(both, {}, model="llama", key=f"k{i}") == "b")
    assert choose(pool, {}, model="llama", key=key) == "a"


def test_the_slack_is_counted_from_the_least_loaded_backend_serving_the_model() -> None:
    pool = {"a": LLAMA, "b": LLAMA, "c": frozenset({"mistral"})}
    both = dict.fromkeys("ab", LLAMA)
    key = next(f"k{i}" for i in range(100) if choose(both, {}, model="llama", key=f"k{i}") == "b")
    # Idle c serves another model: b is no busier than a, so the session stays.
    assert choose(pool, {"a": 4, "b": 4, "c": 0}, model="llama", key=key, slack=4) == "b"


def test_a_session_key_with_lone_surrogates_has_a_home_like_any_other() -> None:
    # A header's non-UTF-8 bytes as decoded, or a JSON "\udcff": a strict encode raised.
    pool = dict.fromkeys("abcd", LLAMA)
    for key in ("caf\udce9", "\udcff", "\ud800x"):
        home = choose(pool, {}, model="llama", key=key, slack=4)
        assert home in pool and choose(pool, {}, model="llama", key=key, slack=4) == home


def test_a_session_goes_where_a_router_in_another_process_sent_it() -> None:
    """A restarted router must send each session where the previous one did: Python
    salts str hashes per process, so two interpreters with different seeds must agree."""
    code = (
        "from llmhealth.choice import choose\n"
        "pool = dict.fromkeys('abcdefgh', None)\n"
        "print(''.join(choose(pool, {}, model=None, key=f'user-{i}') for i in range(64)))\n"
    )
    homes = {
        subprocess.run(
            [sys.executable, "-c", code],
            env={**os.environ, "PYTHONHASHSEED": seed},
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        for seed in ("1", "2", "3")
    }
    assert len(homes) == 1, homes
    (home,) = homes
    assert len(set(home.strip())) > 1  # the keys really spread over the backends


def test_slack_below_one_is_refused() -> None:
    with pytest.raises(ValueError, match="slack"):
        choose({"a": LLAMA}, {}, model="llama", key="k", slack=0)


@given(
    st.dictionaries(st.sampled_from("abcdef"), st.integers(0, 20), min_size=1),
    st.text(max_size=20),
    st.integers(1, 10),
)
def test_the_choice_is_never_more_than_slack_above_the_least(
    in_flight: dict[str, int], key: str, slack: int
) -> None:
    pool = dict.fromkeys(in_flight, LLAMA)
    chosen = choose(pool, in_flight, model="llama", key=key, slack=slack)
    assert chosen in pool
    assert in_flight[chosen] - min(in_flight.values()) < slack


@pytest.mark.parametrize(
    ("spec", "headers", "body", "key"),
    [
        ("header:X-Session-Id", {"X-Session-Id": "s1"}, None, "s1"),
        ("body:user", {}, {"user": "alice"}, "alice"),
        ("body:user", {}, {"user": 42}, "42"),
        # A JSON field name is case-sensitive, unlike a header's.
        ("body:userId", {}, {"userid": "wrong", "userId": "bob"}, "bob"),
        ("body:user", {}, {"user": ["not", "a", "name"]}, None),
        ("body:user", {}, {"user": True}, None),
        ("body:user", {}, {"user": ""}, None),
        ("body:user", {}, None, None),
        ("header:X-Session-Id", {}, {"X-Session-Id": "in the body"}, None),
    ],
)
def test_the_session_key_comes_from_where_the_affinity_says(
    spec: str, headers: dict[str, str], body: dict[str, object] | None, key: str | None
) -> None:
    assert Affinity.parse(spec).key_of(headers, body) == key


def test_a_huge_session_key_is_cut_before_hashing() -> None:
    key = Affinity.parse("body:user").key_of({}, {"user": "x" * 100_000})
    assert key is not None and len(key) == 512


@pytest.mark.parametrize("spec", ["user", "cookie:x", "header:", "body: "])
def test_a_bad_affinity_spec_is_refused_with_the_forms_it_takes(spec: str) -> None:
    with pytest.raises(ValueError, match="header:NAME"):
        Affinity.parse(spec)


@pytest.mark.parametrize("spec", ["header:X Session-Id", "header:X-Session\x1b", "header:Sessión"])
def test_an_affinity_header_no_request_can_carry_is_refused(spec: str) -> None:
    """The edge refuses a request whose field name is not a token (400): such an affinity
    was taken, and no request ever had a session key, affinity off without a word."""
    with pytest.raises(ValueError, match="not a header name"):
        Affinity.parse(spec)


@pytest.mark.parametrize("module", ["traffic", "fleet", "ledger"])
def test_the_router_core_does_no_io(module: str) -> None:
    source = (ROOT / "llmhealth" / f"{module}.py").read_text(encoding="utf-8")
    assert not imported_modules(source) & (FORBIDDEN | {"aiohttp", "asyncio", "importlib"})
    assert not called_names(source) & {"open", "__import__", "exec", "eval"}
