"""FleetHealth and Selector: seed 000's verbs, each behaviour as a test of its own, the
job-5925668 walk, and properties over random verb sequences. No I/O: the clock is ours."""

from __future__ import annotations

import asyncio
import concurrent.futures
import subprocess
import sys
import threading
import tomllib
from collections.abc import Callable
from enum import Enum, StrEnum
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import llmhealth
from llmhealth import (
    FleetExhausted,
    FleetHealth,
    FleetPolicy,
    NoServingBackend,
    Selector,
    State,
    UnknownBackend,
)
from llmhealth.ledger import SERVING
from llmhealth.selector import counts_against_backend
from llmhealth.text import printable

ROOT = Path(__file__).resolve().parent.parent
URLS = ["http://10.0.0.1:8000", "http://10.0.0.2:8000", "http://10.0.0.3:8000"]


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now

    def tick(self, seconds: float = 5.0) -> float:
        self.now += seconds
        return self.now


def fleet(
    urls: list[str] | None = None, policy: FleetPolicy | None = None
) -> tuple[FleetHealth, Clock]:
    clock = Clock()
    return FleetHealth(urls or URLS, policy=policy, clock=clock), clock


def make_dead(f: FleetHealth, key: int) -> None:
    f.record_actor_death(key, "actor died")
    assert f.state_of(key) is State.DEAD


def make_stale(f: FleetHealth, key: int) -> None:
    make_dead(f, key)
    f.mark_restarting(key)
    f.mark_loaded(key)
    assert f.state_of(key) is State.STALE


# --- construction and bad input --------------------------------------------------------


def test_a_list_of_urls_makes_shard_indices_in_order() -> None:
    f, _ = fleet()
    assert f.keys == (0, 1, 2)
    assert f.serving_shards() == [0, 1, 2]
    assert f.serving_base_urls() == URLS


def test_a_mapping_of_names_makes_backends_known_by_name() -> None:
    f = FleetHealth({"gpu0": URLS[0], "gpu1": URLS[1]})
    assert f.keys == ("gpu0", "gpu1")
    f.record_actor_death("gpu1")
    assert f.serving_shards() == ["gpu0"]
    assert f.absent_shards() == ["gpu1"]


@pytest.mark.parametrize("key", [3, -1, True, 1.0, "3", "00", " 0", None, [0]])
def test_an_unknown_shard_index_is_a_lookup_error_naming_the_valid_ones(key: Any) -> None:
    f, _ = fleet()
    with pytest.raises(UnknownBackend, match=r"shards 0\.\.2") as raised:
        f.state_of(key)
    assert isinstance(raised.value, LookupError)


def test_the_name_a_transition_or_snapshot_carries_is_taken_back() -> None:
    # The ledger names shard 1 "1"; a caller passing a Transition's name back to a verb
    # must reach shard 1, not an UnknownBackend.
    f, _ = fleet()
    died = f.record_actor_death(1, "ActorDiedError")
    assert died.name == "1"
    assert f.state_of(died.name) is State.DEAD
    assert f.mark_restarting(died.name).applied
    assert f.snapshot()[1].state is State.RESTARTING
    names = [snap.name for snap in f.snapshot().values()]
    assert [f.state_of(name) for name in names] == [State.HEALTHY, State.RESTARTING, State.HEALTHY]


def test_an_unknown_backend_name_is_a_lookup_error_and_changes_nothing() -> None:
    f = FleetHealth({"gpu0": URLS[0]})
    with pytest.raises(LookupError, match="'gpu9'"):
        f.report_failure("gpu9", RuntimeError("boom"))
    assert f.snapshot()["gpu0"].request_failures == 0


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("unhealthy_threshold", 0),
        ("healthy_threshold", -1),
        ("max_restart_attempts", 0),
        ("min_healthy", -1),
        ("unhealthy_threshold", 2.5),
        ("healthy_threshold", True),
        ("restart_window", 0),
        ("restart_window", float("nan")),
        ("restart_window", float("inf")),
        ("recover_in_place", "yes"),
        ("max_in_place_recoveries", -1),
    ],
)
def test_an_out_of_range_policy_value_is_refused_naming_the_field(field: str, value: Any) -> None:
    with pytest.raises(ValueError, match=f"FleetPolicy.{field}"):
        FleetPolicy(**{field: value})


def test_in_place_recovery_is_off_unless_the_policy_turns_it_on() -> None:
    assert not FleetPolicy().ledger_policy().recover_in_place
    on = FleetPolicy(recover_in_place=True, max_in_place_recoveries=1).ledger_policy()
    assert on.recover_in_place and on.max_in_place_recoveries == 1


def test_a_floor_above_the_fleet_size_is_refused_at_construction() -> None:
    with pytest.raises(ValueError, match="min_healthy"):
        FleetHealth(URLS[:1], policy=FleetPolicy(min_healthy=2))


@pytest.mark.parametrize(
    ("urls", "error"),
    [
        ([], ValueError),
        ([URLS[0], URLS[0] + "/"], ValueError),
        (["http://10.0.0.1:8000", ""], ValueError),
        (["10.0.0.1:8000"], ValueError),
        ([b"http://10.0.0.1:8000"], ValueError),
        ({"gpu0": None}, ValueError),
        ("http://10.0.0.1:8000", TypeError),
    ],
)
def test_a_fleet_of_bad_urls_is_refused(urls: Any, error: type[Exception]) -> None:
    with pytest.raises(error):
        FleetHealth(urls)


def test_the_injected_clock_stamps_every_record() -> None:
    f, clock = fleet()
    clock.tick(7.0)
    f.record_probe(0, ok=True)
    assert f.snapshot()[0].last_ok_at == 107.0
    clock.tick(3.0)
    f.record_actor_death(1)
    assert f.snapshot()[1].state_since == 110.0


# --- probes ------------------------------------------------------------------------------


def test_a_failed_probe_makes_a_healthy_backend_suspect_and_still_serving() -> None:
    f, _ = fleet()
    t = f.record_probe(0, ok=False, error="timeout")
    assert (t.applied, t.to_state) == (True, State.SUSPECT)
    assert 0 in f.serving_shards()
    assert f.snapshot()[0].last_error == "probe failed: timeout"


def test_an_error_given_as_none_is_no_error_text() -> None:
    """A caller's `error=str(e) if e else None` is no description, not Python's name of
    None: "probe failed: NoneType: None" sent on-call looking for a missing object."""
    f, _ = fleet()
    f.record_probe(0, ok=False, error=None)  # type: ignore[arg-type]
    assert f.snapshot()[0].last_error == "probe failed"
    f.report_failure(1, None)  # type: ignore[arg-type]
    assert f.snapshot()[1].last_error == "request failed"
    f.record_actor_death(2, None)  # type: ignore[arg-type]
    assert f.snapshot()[2].last_error == "process gone"


def test_unhealthy_threshold_failed_probes_in_a_row_condemn() -> None:
    f, _ = fleet(policy=FleetPolicy(unhealthy_threshold=3))
    for _ in range(2):
        f.record_probe(0, ok=False)
    assert f.state_of(0) is State.SUSPECT
    f.record_probe(0, ok=False)
    assert f.state_of(0) is State.DEAD


def test_a_suspect_backend_needs_healthy_threshold_good_probes_in_a_row() -> None:
    f, _ = fleet(policy=FleetPolicy(healthy_threshold=2))
    f.record_probe(0, ok=False)
    f.record_probe(0, ok=True)
    assert f.state_of(0) is State.SUSPECT
    f.record_probe(0, ok=True)
    assert f.state_of(0) is State.HEALTHY


@pytest.mark.parametrize("state", [State.DEAD, State.RESTARTING, State.STALE, State.RETIRED])
def test_a_good_probe_never_resurrects_a_backend_out_of_the_serving_set(state: State) -> None:
    f, _ = fleet()
    make_dead(f, 0)
    if state is State.RESTARTING:
        f.mark_restarting(0)
    if state is State.STALE:
        f.mark_restarting(0)
        f.mark_loaded(0)
    if state is State.RETIRED:
        f.retire(0, reason="bad GPU")
    epoch = f.membership_epoch
    for _ in range(5):
        t = f.record_probe(0, ok=True)
        assert not t.applied
    assert f.state_of(0) is state
    assert f.membership_epoch == epoch


# --- proof of death, and judgements ------------------------------------------------------


def test_proof_of_process_death_is_dead_at_once_without_counting() -> None:
    f, _ = fleet(policy=FleetPolicy(unhealthy_threshold=5))
    t = f.record_actor_death(1, "ActorDiedError: node lost")
    assert (t.applied, t.from_state, t.to_state) == (True, State.HEALTHY, State.DEAD)
    assert f.snapshot()[1].last_error == "process gone: ActorDiedError: node lost"


def test_a_repeated_death_report_changes_nothing() -> None:
    f, clock = fleet()
    f.record_actor_death(1, "first")
    before, epoch = f.snapshot()[1], f.membership_epoch
    clock.tick()
    t = f.record_actor_death(1, "second")
    assert not t.applied and "already absent" in t.reason
    assert f.snapshot()[1] == before
    assert f.membership_epoch == epoch


def test_a_death_report_on_a_backend_doubt_condemned_is_kept() -> None:
    # Ignored as "already absent", the report left a process the caller had written off
    # free to recover in place, and the Prober kept comparing the dead actor's reads.
    f, clock = fleet(policy=FleetPolicy(recover_in_place=True))
    for _ in range(3):
        clock.tick()
        f.report_failure(1, "router: failed generation")
    assert f.state_of(1) is State.DEAD
    clock.tick()
    t = f.record_actor_death(1, "ActorDiedError")
    assert t.applied and f.state_of(1) is State.DEAD, t.reason
    assert f.process_changes(1) == 1
    assert f.snapshot()[1].condemned_by == "request failed"
    clock.tick()
    assert not f.record_actor_death(1, "again").applied
    assert f.process_changes(1) == 1


def test_a_death_report_never_disturbs_a_retired_backend() -> None:
    f, _ = fleet()
    f.retire(2, reason="operator")
    t = f.record_actor_death(2, "late report")
    assert not t.applied and "RETIRED is terminal" in t.reason
    assert f.state_of(2) is State.RETIRED


def test_a_silent_participant_is_condemned_dead_with_the_reason() -> None:
    f, _ = fleet()
    t = f.condemn_silent_participant(1, reason="only rank missing from refit 12")
    assert t.applied and f.state_of(1) is State.DEAD
    assert 1 in f.absent_shards()
    assert f.snapshot()[1].last_error == "silent participant: only rank missing from refit 12"


def test_a_stale_silent_participant_is_condemned_out_of_the_next_refit() -> None:
    # STALE still joins a refit; the point of condemning is to make it absent.
    f, _ = fleet()
    f.mark_weights_partial(0)
    assert 0 not in f.absent_shards()
    f.condemn_silent_participant(0, reason="hung refit 13")
    assert f.state_of(0) is State.DEAD and 0 in f.absent_shards()


def test_condemning_without_a_reason_is_refused_and_changes_nothing() -> None:
    f, _ = fleet()
    with pytest.raises(ValueError, match=r"^condemning a backend needs a reason, got ' '$"):
        f.condemn_silent_participant(0, reason=" ")
    assert f.state_of(0) is State.HEALTHY


# --- failures seen on real requests ------------------------------------------------------


def test_request_failures_count_on_their_own_streak_that_good_probes_do_not_clear() -> None:
    # A wedged engine answers every liveness probe and fails every generation.
    f, _ = fleet(policy=FleetPolicy(unhealthy_threshold=3))
    for _ in range(3):
        f.report_failure(0, TimeoutError("generation timed out"))
        f.record_probe(0, ok=True)
        f.record_probe(0, ok=True)
    assert f.state_of(0) is State.DEAD
    assert f.snapshot()[0].last_error == "request failed: TimeoutError: generation timed out"


def test_a_completed_request_clears_the_failure_streak() -> None:
    f, _ = fleet(policy=FleetPolicy(unhealthy_threshold=3))
    for _ in range(10):
        f.report_failure(0, "500 from the engine")
        f.report_failure(0, "500 from the engine")
        f.report_success(0)
    assert f.state_of(0) in SERVING
    assert f.snapshot()[0].request_failures == 0


def test_a_failure_reported_by_url_finds_its_shard() -> None:
    f, _ = fleet()
    assert f.shard_for_base_url(URLS[1] + "/") == 1
    assert f.shard_for_base_url("http://elsewhere:8000") is None
    # A rollout router knows its backends by their OpenAI base URLs: found none before.
    assert f.shard_for_base_url(URLS[1] + "/v1") == 1
    assert f.shard_for_base_url(URLS[1] + "/v1/") == 1
    assert f.shard_for_base_url("http://elsewhere:8000/v1") is None


def test_a_long_error_text_is_bounded() -> None:
    f, _ = fleet()
    f.report_failure(0, RuntimeError("x" * 10_000))
    assert len(f.snapshot()[0].last_error) < 400


# --- restarts ----------------------------------------------------------------------------


def test_a_replacement_on_a_new_port_moves_the_serving_urls() -> None:
    f, _ = fleet()
    make_dead(f, 1)
    f.mark_restarting(1)
    assert f.state_of(1) is State.RESTARTING
    moved = "http://10.0.0.2:8011"
    t = f.mark_loaded(1, base_url=moved)
    assert t.applied and f.state_of(1) is State.STALE
    f.report_refit(1, weight_version=4)
    assert f.serving_base_urls() == [URLS[0], moved, URLS[2]]
    assert f.shard_for_base_url(moved) == 1
    assert f.shard_for_base_url(URLS[1]) is None


def test_a_replacement_may_bind_the_port_a_retired_shard_left() -> None:
    """Refused before: the shard stayed RESTARTING, or the trainer published a dead URL."""
    f, _ = fleet()
    f.retire(1, reason="bad GPU")
    make_dead(f, 0)
    f.mark_restarting(0)
    assert f.mark_loaded(0, base_url=URLS[1]).to_state is State.STALE
    f.report_refit(0, weight_version=2)
    assert f.serving_base_urls() == [URLS[1], URLS[2]]
    assert f.shard_for_base_url(URLS[1]) == 0
    with pytest.raises(ValueError, match="backend '2' is there"):
        make_dead(f, 0)
        f.mark_restarting(0)
        f.mark_loaded(0, base_url=URLS[2])  # a live shard's address is still refused


def test_an_openai_base_url_is_refused_with_the_root_to_give_instead() -> None:
    """Seed 000's shards have OpenAI base URLs (``…/v1``); taken as roots they would be
    read at /v1/metrics, answered 404, and a healthy fleet condemned in three probes."""
    with pytest.raises(ValueError, match=r"ends in /v1: give the server's root \(http://h:8000\)"):
        FleetHealth(["http://h:8000/v1"])


@pytest.mark.parametrize(
    ("base_url", "refusal"),
    [("10.0.0.2:8011", "not an http"), ("http://10.0.0.2:8011/v1", "ends in /v1")],
)
def test_a_replacement_at_a_url_that_is_not_one_is_refused_and_nothing_changes(
    base_url: str, refusal: str
) -> None:
    f, _ = fleet()
    make_dead(f, 1)
    f.mark_restarting(1)
    with pytest.raises(ValueError, match=refusal):
        f.mark_loaded(1, base_url=base_url)
    assert f.state_of(1) is State.RESTARTING
    assert f.base_url_of(1) == URLS[1]


def test_a_base_url_with_a_password_is_refused_without_repeating_it() -> None:
    secret = "http://trainer:s3cret@10.0.0.2:8011"
    with pytest.raises(ValueError, match="user name or password") as given:
        FleetHealth([URLS[0], secret])
    f, _ = fleet()
    make_dead(f, 1)
    f.mark_restarting(1)
    with pytest.raises(ValueError, match="user name or password") as moved:
        f.mark_loaded(1, base_url=secret)
    assert f.state_of(1) is State.RESTARTING
    assert f.base_url_of(1) == URLS[1]
    for refused in (given, moved):
        assert "s3cret" not in str(refused.value) and "trainer" not in str(refused.value)


def test_a_base_url_that_is_not_a_string_is_refused_by_its_type_not_repeated() -> None:
    # bytes (os.environb's) with a password in it: the error repeated it whole.
    secret = b"http://trainer:s3cret@10.0.0.2:8011"
    with pytest.raises(ValueError, match="bytes") as given:
        FleetHealth([URLS[0], secret])  # type: ignore[list-item]
    with pytest.raises(ValueError, match="bytes") as named:
        FleetHealth({"a": URLS[0], "b": secret})  # type: ignore[dict-item]
    f, _ = fleet()
    make_dead(f, 1)
    f.mark_restarting(1)
    with pytest.raises(ValueError, match="bytes") as moved:
        f.mark_loaded(1, base_url=secret)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="bytes") as looked_up:
        f.shard_for_base_url(secret)  # type: ignore[arg-type]
    assert f.base_url_of(1) == URLS[1]
    for refused in (given, named, moved, looked_up):
        assert "s3cret" not in str(refused.value) and "trainer" not in str(refused.value)


def test_a_failed_restart_is_dead_again_and_says_what_the_reload_failed_on() -> None:
    f, _ = fleet()
    make_dead(f, 0)
    f.mark_restarting(0)
    t = f.mark_restart_failed(0, error="GPU still held by an orphaned EngineCore")
    assert t.applied and f.state_of(0) is State.DEAD
    assert f.snapshot()[0].last_error == "restart failed: GPU still held by an orphaned EngineCore"
    # DEAD again, so it can be retried rather than stuck in RESTARTING.
    assert f.mark_restarting(0).applied


def test_a_restart_failure_reported_for_a_backend_not_restarting_changes_nothing() -> None:
    f, _ = fleet()
    t = f.mark_restart_failed(0, error="late")
    assert not t.applied and f.state_of(0) is State.HEALTHY


def test_the_restart_past_max_restart_attempts_retires_the_backend() -> None:
    f, _ = fleet(policy=FleetPolicy(max_restart_attempts=2))
    make_dead(f, 0)
    for attempt in range(2):
        assert f.mark_restarting(0).to_state is State.RESTARTING
        f.mark_restart_failed(0, error=f"attempt {attempt}")
    t = f.mark_restarting(0)
    assert t.to_state is State.RETIRED
    # Retirement keeps what the reloads failed on, not only that the attempts ran out.
    assert f.snapshot()[0].last_error == (
        "restart budget spent: 2 attempts in 24h; last error: restart failed: attempt 1"
    )


def test_a_replacement_that_loaded_holds_stale_weights_and_does_not_serve() -> None:
    f, _ = fleet()
    make_stale(f, 0)
    assert 0 not in f.serving_shards()
    assert 0 not in f.absent_shards()  # alive: it joins the next refit


# --- the weight-sync life cycle ----------------------------------------------------------


def test_a_partial_weight_sync_makes_serving_backends_stale() -> None:
    f, _ = fleet()
    epoch = f.membership_epoch
    for key in f.serving_shards():
        assert f.mark_weights_partial(key).to_state is State.STALE
    assert f.serving_shards() == []
    assert f.absent_shards() == []
    assert f.membership_epoch == epoch + 3


def test_a_partial_weight_sync_leaves_absent_backends_alone() -> None:
    f, _ = fleet()
    make_dead(f, 2)
    before = f.snapshot()[2]
    t = f.mark_weights_partial(2)
    assert not t.applied
    assert f.snapshot()[2] == before


def test_a_partial_weight_sync_keeps_the_suspicion_of_a_backend_that_was_suspect() -> None:
    f, _ = fleet()
    f.record_probe(1, ok=False, error="slow")
    assert f.suspected_shards() == [1]
    for key in f.serving_shards():
        f.mark_weights_partial(key)
    assert f.state_of(1) is State.STALE
    assert f.snapshot()[1].state_before_partial is State.SUSPECT
    assert f.suspected_shards() == [1]


def test_the_refit_after_an_aborted_sync_keeps_a_failing_survivors_streak() -> None:
    # The trainer's recovery: every serving shard marked partial, then refit and promoted.
    # Before, shard 2 came back HEALTHY with its two failed generations forgotten.
    f, _ = fleet()
    for _ in range(2):
        f.report_failure(2, "router: failed generation")
    assert f.state_of(2) is State.SUSPECT
    for key in f.serving_shards():
        f.mark_weights_partial(key)
    for key in (0, 1, 2):
        f.report_refit(key, weight_version=5)
    after = f.snapshot()
    assert (f.state_of(2), after[2].request_failures) == (State.SUSPECT, 2)
    assert (f.state_of(1), after[1].request_failures) == (State.HEALTHY, 0)
    assert f.suspected_shards() == [2]


def test_a_shard_replaced_after_an_aborted_sync_does_not_inherit_the_suspicion() -> None:
    # Shard 2 was SUSPECT when the sync broke, then its process was replaced: the new
    # one came back SUSPECT with no failure of its own, named by suspected_shards() as
    # the shard to condemn for the next hang.
    f, _ = fleet()
    for _ in range(2):
        f.report_failure(2, "router: failed generation")
    for key in f.serving_shards():
        f.mark_weights_partial(key)
    assert f.mark_loaded(2).to_state is State.STALE
    assert f.snapshot()[2].state_before_partial is None
    assert f.suspected_shards() == []
    assert f.report_refit(2, weight_version=5).to_state is State.HEALTHY


def test_a_refit_without_a_weight_version_is_refused_as_a_stamp_without_one_is() -> None:
    f, _ = fleet()
    f.mark_weights_partial(0)
    with pytest.raises(ValueError, match="weight_version"):
        f.report_refit(0, weight_version=None)  # type: ignore[arg-type]
    assert f.state_of(0) is State.STALE


def test_a_weight_version_past_64_bits_is_refused_and_the_one_before_kept() -> None:
    f, _ = fleet()
    f.record_weight_version(0, weight_version=4)
    for version in (2**63, 10**5000):
        with pytest.raises(ValueError, match="64 bits") as refused:
            f.record_weight_version(0, weight_version=version)
        # The refusal says why: "must fit in 64 bits, got one of 64 bits" did not.
        assert "one of 64 bits" not in str(refused.value)
    assert f.snapshot()[0].weight_version == 4
    with pytest.raises(ValueError, match="one of 65 bits with its sign"):
        f.record_weight_version(0, weight_version=-(2**63))
    f.record_weight_version(0, weight_version=2**63 - 1)


def test_a_weight_version_stamp_is_not_a_transition_and_clears_no_streak() -> None:
    f, _ = fleet()
    f.report_failure(0, "500")
    before, epoch = f.snapshot()[0], f.membership_epoch
    t = f.record_weight_version(0, weight_version=8)
    assert t.applied and t.from_state is t.to_state is State.SUSPECT
    after = f.snapshot()[0]
    assert after.weight_version == 8
    assert after.request_failures == before.request_failures == 1
    assert f.membership_epoch == epoch


@pytest.mark.parametrize("state", [State.DEAD, State.RESTARTING, State.STALE, State.RETIRED])
def test_a_weight_version_stamp_does_not_apply_outside_the_serving_set(state: State) -> None:
    f, _ = fleet()
    make_dead(f, 0)
    if state is State.RESTARTING:
        f.mark_restarting(0)
    elif state is State.STALE:
        f.mark_restarting(0)
        f.mark_loaded(0)
    elif state is State.RETIRED:
        f.retire(0, reason="x")
    t = f.record_weight_version(0, weight_version=3)
    assert not t.applied
    assert f.snapshot()[0].weight_version is None


def test_a_refit_is_the_only_way_back_into_the_serving_set() -> None:
    f, _ = fleet()
    f.mark_weights_partial(0)
    for _ in range(5):
        f.record_probe(0, ok=True)
        f.report_success(0)
    assert f.state_of(0) is State.STALE
    t = f.report_refit(0, weight_version=9)
    assert (t.applied, t.to_state) == (True, State.HEALTHY)
    snap = f.snapshot()[0]
    assert snap.weight_version == 9 and snap.state_before_partial is None
    assert f.suspected_shards() == []


def test_a_refit_does_not_bring_back_a_dead_backend() -> None:
    f, _ = fleet()
    make_dead(f, 0)
    t = f.report_refit(0, weight_version=9)
    assert not t.applied and "only a STALE backend" in t.reason
    assert f.state_of(0) is State.DEAD


def test_a_refit_reported_for_a_healthy_backend_changes_nothing() -> None:
    # A refit is a transition; driven on a HEALTHY backend it would clear its streaks.
    f, _ = fleet()
    f.report_failure(0, "500")
    t = f.report_refit(0, weight_version=2)
    assert not t.applied
    assert f.snapshot()[0].request_failures == 1


# --- retirement, the floor, views --------------------------------------------------------


def test_a_retired_backend_stays_out_whatever_is_reported() -> None:
    f, _ = fleet()
    f.retire(0, reason="bad GPU")
    f.record_probe(0, ok=True)
    f.report_success(0)
    f.mark_loaded(0)
    f.report_refit(0, weight_version=1)
    assert f.state_of(0) is State.RETIRED
    assert f.snapshot()[0].last_error == "retired: bad GPU"


def test_raise_if_exhausted_names_every_backend_state_and_last_error() -> None:
    f, _ = fleet(policy=FleetPolicy(min_healthy=2))
    f.raise_if_exhausted()
    f.record_actor_death(0, "node lost")
    f.raise_if_exhausted()
    f.condemn_silent_participant(1, reason="hung refit")
    with pytest.raises(FleetExhausted) as raised:
        f.raise_if_exhausted()
    message = str(raised.value)
    assert "1 of 3 backends serving, min_healthy is 2" in message
    assert "0 dead (last error: process gone: node lost)" in message
    assert "1 dead (last error: silent participant: hung refit)" in message
    assert "2 healthy" in message


def test_the_membership_epoch_moves_only_when_the_serving_set_changes() -> None:
    f, _ = fleet()
    assert f.membership_epoch == 0
    f.record_probe(0, ok=False)  # SUSPECT still serves
    f.record_weight_version(1, weight_version=1)
    assert f.membership_epoch == 0
    f.record_actor_death(0)
    assert f.membership_epoch == 1
    f.mark_restarting(0)
    f.mark_loaded(0)
    assert f.membership_epoch == 1
    f.report_refit(0, weight_version=1)
    assert f.membership_epoch == 2


def test_counts_and_metrics_cover_every_state() -> None:
    f, _ = fleet()
    f.record_actor_death(0)
    f.mark_weights_partial(1)
    assert f.counts_by_state() == {
        State.HEALTHY: 1,
        State.SUSPECT: 0,
        State.DEAD: 1,
        State.RESTARTING: 0,
        State.STALE: 1,
        State.RETIRED: 0,
    }
    metrics = f.as_metrics()
    assert metrics["fleet/serving"] == 1.0
    assert metrics["fleet/dead"] == 1.0
    assert metrics["fleet/stale"] == 1.0
    assert metrics["fleet/epoch"] == 2.0
    assert all(isinstance(value, float) for value in metrics.values())


def test_absent_is_not_the_complement_of_serving() -> None:
    f, _ = fleet()
    f.mark_weights_partial(0)
    make_dead(f, 1)
    assert f.serving_shards() == [2]
    assert f.absent_shards() == [1]


# --- the job-5925668 story ---------------------------------------------------------------


def test_job_5925668_a_dead_rank_is_absent_at_once_so_the_rebuild_has_something_to_do() -> None:
    """Two shards, default policy. Shard 1's actor dies during a refit. Counting probes
    would have left it SUSPECT for probe_interval * unhealthy_threshold, past the refit
    deadline, and the rebuild after the abort found an empty absent set."""
    f, clock = fleet(URLS[:2])
    selector = Selector(f)
    # Steady state: both serve, the refit stamps both.
    for key in (0, 1):
        f.record_weight_version(key, weight_version=1)
    # t=5: the probe of shard 1 times out (the process is already gone).
    clock.tick()
    f.record_probe(1, ok=False, error="is_alive timed out")
    assert f.state_of(1) is State.SUSPECT
    # t=6: Ray reports the actor dead. Proof, not doubt: DEAD now, not at t=15.
    clock.tick(1.0)
    f.record_actor_death(1, "ActorDiedError")
    assert f.state_of(1) is State.DEAD
    assert f.absent_shards() == [1]
    assert selector.next_shard() == 0
    # The refit aborts; the survivors hold partial weights.
    for key in f.serving_shards():
        f.mark_weights_partial(key)
    assert f.serving_shards() == [] and f.absent_shards() == [1]
    with pytest.raises(NoServingBackend, match="1 dead"):
        selector.next_shard()
    # The rebuild: restart the absent rank on a new port, then a completed refit.
    f.mark_restarting(1)
    f.mark_loaded(1, base_url="http://10.0.0.2:8100")
    f.record_probe(1, ok=True)  # answering proves nothing about weights
    assert f.serving_shards() == []
    for key in (0, 1):
        f.report_refit(key, weight_version=2)
    assert f.serving_shards() == [0, 1]
    assert f.serving_base_urls() == [URLS[0], "http://10.0.0.2:8100"]
    assert [s.weight_version for s in f.snapshot().values()] == [2, 2]
    f.raise_if_exhausted()


# --- the selector ------------------------------------------------------------------------


def test_the_selector_picks_the_serving_shard_with_fewest_in_flight() -> None:
    f, _ = fleet()
    selector = Selector(f)
    selector.acquire(0)
    selector.acquire(0)
    selector.acquire(1)
    assert selector.next_shard() == 2
    selector.acquire(2)
    selector.acquire(2)
    assert selector.next_shard() == 1


def test_selector_ties_go_to_the_lowest_index_every_time() -> None:
    f, _ = fleet()
    selector = Selector(f)
    assert [selector.next_shard() for _ in range(3)] == [0, 0, 0]


def test_the_selector_never_picks_a_backend_out_of_the_serving_set() -> None:
    f, _ = fleet()
    selector = Selector(f)
    f.record_actor_death(0)
    f.mark_weights_partial(1)
    selector.acquire(2)
    selector.acquire(2)
    assert selector.next_shard() == 2


def test_a_suspect_backend_still_takes_traffic() -> None:
    f, _ = fleet(URLS[:1])
    f.record_probe(0, ok=False)
    assert Selector(f).next_shard() == 0


def test_no_serving_backend_is_an_error_naming_every_state() -> None:
    f, _ = fleet(URLS[:2])
    f.record_actor_death(0, "gone")
    f.retire(1, reason="bad GPU")
    with pytest.raises(NoServingBackend, match=r"0 dead \(last error: process gone: gone\)"):
        Selector(f).next_shard()


def test_acquire_release_and_inflight_count_per_shard() -> None:
    f, _ = fleet()
    selector = Selector(f)
    selector.acquire(1)
    selector.acquire(1)
    assert (selector.inflight(0), selector.inflight(1)) == (0, 2)
    selector.release(1)
    assert selector.inflight(1) == 1


def test_a_shard_named_as_a_transition_names_it_is_counted_as_the_same_shard() -> None:
    """Shard 1 named "1" (as a Transition carries it) and 1 are one shard: counted apart, the choice
    would send the next request to a backend with two already in flight."""
    f, _ = fleet()
    selector = Selector(f)
    selector.acquire("1")
    selector.acquire(f.record_probe(1, ok=True).name)
    selector.acquire(0)
    assert (selector.inflight(1), selector.inflight("1")) == (2, 2)
    assert selector.next_shard() == 2
    selector.release(1)
    selector.release("1")
    assert selector.inflight(1) == 0


def test_releasing_more_than_was_acquired_is_refused() -> None:
    selector = Selector(fleet()[0])
    with pytest.raises(ValueError, match="without a matching acquire"):
        selector.release(0)
    assert selector.inflight(0) == 0


def test_acquiring_an_unknown_shard_is_a_lookup_error_and_counts_nothing() -> None:
    selector = Selector(fleet()[0])
    with pytest.raises(UnknownBackend):
        selector.acquire(7)
    assert selector.next_shard() == 0


def test_a_lease_reports_success_and_releases() -> None:
    f, _ = fleet()
    f.report_failure(0, "500")
    selector = Selector(f)
    with selector.lease() as key:
        assert key == 0
        assert selector.inflight(0) == 1
    assert selector.inflight(0) == 0
    assert f.snapshot()[0].request_failures == 0


def test_a_lease_reports_a_failure_releases_and_lets_the_error_through() -> None:
    f, _ = fleet()
    selector = Selector(f)
    with pytest.raises(ConnectionResetError), selector.lease() as key:
        raise ConnectionResetError("peer reset")
    assert selector.inflight(key) == 0
    assert f.snapshot()[key].last_error == "request failed: ConnectionResetError: peer reset"


def test_a_lease_spares_failures_the_caller_says_are_not_the_backends() -> None:
    f, _ = fleet()
    selector = Selector(f)
    with pytest.raises(ValueError), selector.lease(counts=lambda e: not isinstance(e, ValueError)):
        raise ValueError("the client sent a bad prompt")
    assert f.snapshot()[0].request_failures == 0


class _StatusError(Exception):
    """An error carrying an HTTP status as the OpenAI SDK's do (``status_code``)."""

    def __init__(self, status_code: int) -> None:
        super().__init__(f"HTTP {status_code}")
        self.status_code = status_code


@pytest.mark.parametrize("status", [400, 404, 413, 429])
def test_a_lease_spares_a_clients_own_4xx_by_default(status: int) -> None:
    """DESIGN: a 4xx or a 429 never counts; three rate-limited requests condemned a
    healthy backend, where the router counts none."""
    f, _ = fleet()
    selector = Selector(f)
    for _ in range(3):
        with pytest.raises(_StatusError), selector.lease():
            raise _StatusError(status)
    assert f.snapshot()[0].request_failures == 0 and f.state_of(0) is State.HEALTHY
    response = httpx.Response(status, request=httpx.Request("GET", "http://127.0.0.1:9/"))
    error = httpx.HTTPStatusError("client error", request=response.request, response=response)
    assert not counts_against_backend(error)
    assert counts_against_backend(_StatusError(503)) and counts_against_backend(OSError())
    assert not counts_against_backend(_StatusError(307))  # the router's rule: 5xx only
    assert counts_against_backend(_StatusError(500)) and not counts_against_backend(
        _StatusError(499)
    )


def test_a_retry_elsewhere_leaves_out_the_backend_that_failed() -> None:
    """The failed one stays serving while SUSPECT and, idle again, won the tie back: the
    example's "retried once elsewhere" went to the same failing shard."""
    f, _ = fleet()
    selector = Selector(f)
    with pytest.raises(ConnectionResetError), selector.lease() as failed:
        raise ConnectionResetError("peer reset")
    assert f.state_of(failed) is State.SUSPECT and selector.next_shard() == failed
    with selector.lease(exclude={failed}) as other:
        assert other != failed
    with pytest.raises(NoServingBackend, match="other than the excluded"):
        selector.next_shard(exclude=set(f.keys))
    # Keys as acquire() takes them; one name is no collection of names.
    assert selector.next_shard(exclude={str(failed)}) != failed
    with pytest.raises(TypeError, match="a collection of keys"):
        selector.next_shard(exclude="0")


def test_selector_ties_go_by_name_whatever_order_the_names_were_given() -> None:
    """The router ties by name; the library went by the order given."""
    f = FleetHealth({"gpu1": "http://127.0.0.1:9", "gpu0": "http://127.0.0.1:10"})
    assert Selector(f).next_shard() == "gpu0"


def test_a_cancelled_request_is_not_counted_against_the_backend() -> None:
    f, _ = fleet()
    selector = Selector(f)

    async def request() -> None:
        with selector.lease():
            await asyncio.sleep(3600)

    async def main() -> None:
        task = asyncio.create_task(request())
        await asyncio.sleep(0)
        assert selector.inflight(0) == 1
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    assert selector.inflight(0) == 0
    assert f.snapshot()[0].request_failures == 0


def test_a_request_cancelled_through_a_concurrent_future_is_not_counted() -> None:
    """A trainer thread whose request runs on an event loop of its own thread
    (``asyncio.run_coroutine_threadsafe``) hears a cancellation as
    ``concurrent.futures.CancelledError``, an ``Exception``: counted, three stragglers
    cancelled at a batch's end condemned a healthy backend."""
    f, _ = fleet()
    selector = Selector(f)
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever)
    thread.start()

    async def ended() -> None:  # the cancelled requests' tasks, before the loop stops
        others = asyncio.all_tasks() - {asyncio.current_task()}
        await asyncio.gather(*others, return_exceptions=True)

    try:
        for _ in range(3):
            with pytest.raises(concurrent.futures.CancelledError), selector.lease():
                request = asyncio.run_coroutine_threadsafe(asyncio.sleep(3600), loop)
                request.cancel()
                request.result(timeout=10)
    finally:
        asyncio.run_coroutine_threadsafe(ended(), loop).result(timeout=10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join()
        loop.close()
    assert selector.inflight(0) == 0
    assert f.snapshot()[0].request_failures == 0 and f.state_of(0) is State.HEALTHY


def test_a_lease_that_outlived_its_process_reports_nothing_on_the_replacement() -> None:
    """Requests hung on a wedged engine while the trainer rebuilt the shard (a new process
    on a new port, refit, HEALTHY): their timeouts then condemned the fresh replacement.
    Their end is the old process's, as a Prober's read of it is."""
    f, _ = fleet()
    selector = Selector(f)
    hung = [selector.lease(exclude={1, 2}) for _ in range(3)]
    assert [lease.__enter__() for lease in hung] == [0, 0, 0]
    f.condemn_silent_participant(0, reason="hung the weight sync")
    f.mark_restarting(0)
    f.mark_loaded(0, base_url="http://10.0.0.1:8001")
    f.report_refit(0, weight_version=2)
    for lease in hung:
        timed_out = TimeoutError("read timed out")
        assert not lease.__exit__(TimeoutError, timed_out, None)  # not swallowed
    assert f.state_of(0) is State.HEALTHY
    assert f.snapshot()[0].request_failures == 0 and selector.inflight(0) == 0
    # A request that began on the replacement still reports on it.
    with pytest.raises(TimeoutError), selector.lease() as key:
        raise TimeoutError("read timed out")
    assert key == 0 and f.snapshot()[0].request_failures == 1


def test_a_lease_that_outlived_its_process_reports_no_success_on_the_replacement() -> None:
    """An answer from the old process says nothing of the new one: counted, it cleared
    the replacement's own failure streak."""
    f, _ = fleet()
    selector = Selector(f)
    old = selector.lease(exclude={1, 2})
    assert old.__enter__() == 0
    f.record_actor_death(0, "actor died")
    f.mark_restarting(0)
    f.mark_loaded(0, base_url="http://10.0.0.1:8001")
    f.report_refit(0, weight_version=2)
    with pytest.raises(TimeoutError), selector.lease(exclude={1, 2}) as key:
        raise TimeoutError("read timed out")
    assert key == 0 and f.snapshot()[0].request_failures == 1
    old.__exit__(None, None, None)
    assert f.snapshot()[0].request_failures == 1 and selector.inflight(0) == 0


def test_a_lease_refuses_a_counts_rule_it_could_not_call_before_the_request() -> None:
    """counts=None was taken, and only a failed request called it: a TypeError replaced
    the request's own error, so the caller's handler missed it and nothing was counted."""
    f, _ = fleet()
    selector = Selector(f)
    with (
        pytest.raises(TypeError, match="counts must be a callable"),
        selector.lease(counts=None),  # type: ignore[arg-type]
    ):
        raise ConnectionResetError("engine went away")
    assert selector.inflight(0) == 0 and f.snapshot()[0].request_failures == 0


class Gpu(StrEnum):
    A = "gpu0"
    B = "gpu1"


def test_a_fleet_named_by_a_str_subclass_takes_its_own_keys_back() -> None:
    """The constructor took StrEnum names, then every verb refused them ("no backend
    <Gpu.A: 'gpu0'>; it has backends <Gpu.A: 'gpu0'>, ..."), and so did lease()."""
    f = FleetHealth({Gpu.A: URLS[0], Gpu.B: URLS[1]})
    with Selector(f).lease() as key:
        assert key is Gpu.A
    assert f.snapshot()[Gpu.A].request_failures == 0
    f.record_actor_death(Gpu.B, "actor died")
    assert f.state_of("gpu1") is State.DEAD and f.serving_shards() == [Gpu.A]


class OldGpu(str, Enum):  # noqa: UP042 - the pre-3.11 idiom, whose str() differs
    A = "gpu0"
    B = "gpu1"


def test_a_fleet_named_by_a_str_enum_is_built_and_known_by_the_names_text() -> None:
    """str() of a (str, Enum) member is "OldGpu.A": the constructor looked the URL up by
    that, a KeyError, and no such fleet could be made."""
    f = FleetHealth({OldGpu.A: URLS[0], OldGpu.B: URLS[1]})
    t = f.record_actor_death(OldGpu.B, "actor died")
    assert t.name == "gpu1" and f.key_for(t.name) is OldGpu.B
    assert f.state_of("gpu1") is State.DEAD and f.serving_shards() == [OldGpu.A]
    assert f.shard_for_base_url(URLS[0]) is OldGpu.A


@pytest.mark.slow
def test_a_fleet_named_by_a_str_enum_type_checks_in_the_callers_code(tmp_path: Path) -> None:
    """The constructor takes a mapping keyed by a StrEnum (the test above), and the package
    ships py.typed: typed ``Mapping[str, str]``, invariant in its key, mypy --strict
    refused the caller's ``dict[Gpu, str]``. A key that is no str is still refused."""
    code = tmp_path / "trainer.py"
    code.write_text(
        "from enum import StrEnum\n"
        "from llmhealth import FleetHealth\n"
        "class Gpu(StrEnum):\n"
        "    A = 'gpu0'\n"
        "urls: dict[Gpu, str] = {Gpu.A: 'http://10.0.0.1:8000'}\n"
        "FleetHealth(urls).report_success(Gpu.A)\n"
        "FleetHealth({'gpu0': 'http://10.0.0.1:8000'})\n"
        "FleetHealth(['http://10.0.0.1:8000'])\n"
        "FleetHealth({0: 'http://10.0.0.1:8000'})  # line 9: refused\n"
    )
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "mypy",
            "--strict",
            "--cache-dir",
            str(tmp_path / "c"),
            "trainer.py",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    errors = [line for line in run.stdout.splitlines() if ": error:" in line]
    assert len(errors) == 1 and errors[0].startswith("trainer.py:9:"), run.stdout


def test_leases_spread_concurrent_requests_over_the_fleet() -> None:
    f, _ = fleet()
    selector = Selector(f)
    with selector.lease() as a, selector.lease() as b, selector.lease() as c:
        assert sorted([a, b, c]) == [0, 1, 2]


# --- the public face ---------------------------------------------------------------------


def test_every_public_name_resolves_and_nothing_else_is_offered() -> None:
    for name in llmhealth.__all__:
        assert getattr(llmhealth, name) is not None
    with pytest.raises(AttributeError):
        _ = llmhealth.Ledger  # type: ignore[attr-defined]


def test_importing_the_package_and_the_ledger_api_loads_no_http_or_terminal_library() -> None:
    # Checked in a fresh interpreter: this one has long imported everything.
    code = (
        "import sys, llmhealth\n"
        "from llmhealth import FleetHealth, FleetPolicy, Selector, StallWatch, State\n"
        "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('httpx', 'rich', 'typer'))\n"
        "print(heavy)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert done.stdout.strip() == "[]"


def test_the_version_is_the_packages_version() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    assert llmhealth.__version__ == project["project"]["version"]
    assert (ROOT / "llmhealth" / "py.typed").exists()


# --- properties over random verb sequences -----------------------------------------------

VERBS: list[Callable[[FleetHealth, int, int], object]] = [
    lambda f, k, n: f.record_probe(k, ok=bool(n % 2), error="x"),
    lambda f, k, n: f.record_actor_death(k, "gone"),
    lambda f, k, n: f.condemn_silent_participant(k, reason="hung"),
    lambda f, k, n: f.report_failure(k, RuntimeError("boom")),
    lambda f, k, n: f.report_success(k),
    lambda f, k, n: f.mark_restarting(k),
    lambda f, k, n: f.mark_loaded(k, base_url=f"http://10.9.{k}.{n}:8000" if n % 3 else None),
    lambda f, k, n: f.mark_restart_failed(k, error="oom"),
    lambda f, k, n: f.mark_weights_partial(k),
    lambda f, k, n: f.record_weight_version(k, weight_version=n),
    lambda f, k, n: f.report_refit(k, weight_version=n),
    lambda f, k, n: f.retire(k, reason="done"),
]

verb_steps = st.lists(
    st.tuples(st.integers(0, len(VERBS) - 1), st.integers(0, 2), st.integers(0, 50)),
    max_size=60,
)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(steps=verb_steps)
def test_random_library_verbs_keep_the_ledgers_invariants(
    steps: list[tuple[int, int, int]],
) -> None:
    f, clock = fleet(policy=FleetPolicy(max_restart_attempts=2, min_healthy=0))
    selector = Selector(f)
    for verb, key, n in steps:
        before = f.snapshot()
        serving_before = f.serving_shards()
        epoch_before = f.membership_epoch
        clock.tick(1.0)
        t = VERBS[verb](f, key, n)
        after = f.snapshot()
        # Nothing outside the serving set comes back in but a STALE backend through a refit.
        was, now = before[key].state, after[key].state
        if was not in SERVING and now in SERVING:
            assert (was, verb) == (State.STALE, 10)
        if was is State.RETIRED:
            assert now is State.RETIRED
        # Refused verbs change nothing at all.
        assert getattr(t, "applied", True) or after == before
        # A stamp never moves a state or a streak.
        if verb == 9:
            assert after[key].state is was
            assert after[key].request_failures == before[key].request_failures
        # The epoch moves exactly when the serving set does.
        moved = f.serving_shards() != serving_before
        assert f.membership_epoch == epoch_before + (1 if moved else 0)
        # Views agree with each other and with the selector.
        assert set(f.serving_shards()).isdisjoint(f.absent_shards())
        assert sum(f.counts_by_state().values()) == 3
        assert set(f.suspected_shards()) <= {
            k for k, s in after.items() if s.state in (State.SUSPECT, State.STALE)
        }
        if f.serving_shards():
            assert selector.next_shard() in f.serving_shards()
        else:
            with pytest.raises(NoServingBackend):
                selector.next_shard()
        for k, snap in after.items():
            assert f.shard_for_base_url(snap.url) == k


HOSTILE_TEXT = "Traceback:\n" + "\x1b]0;owned\x07 \x1b[2J frame\n" * 400


@pytest.mark.parametrize(
    "verb",
    [
        lambda f: [f.record_probe(0, ok=False, error=HOSTILE_TEXT) for _ in range(3)],
        lambda f: f.record_actor_death(0, HOSTILE_TEXT),
        lambda f: f.condemn_silent_participant(0, reason=HOSTILE_TEXT),
        lambda f: f.retire(0, reason=HOSTILE_TEXT),
        lambda f: (
            (f.record_actor_death(0), f.mark_restarting(0))
            and f.mark_restart_failed(0, error=HOSTILE_TEXT)
        ),
    ],
    ids=["record_probe", "record_actor_death", "condemn", "retire", "mark_restart_failed"],
)
def test_every_verb_keeps_a_callers_error_text_short_and_printable(
    verb: Callable[[FleetHealth], object],
) -> None:
    """A Ray traceback with a server's escapes in it reaches snapshots and the floor
    message a trainer prints, whichever verb carried it."""
    f, _ = fleet(policy=FleetPolicy(min_healthy=3))
    verb(f)
    last_error = f.snapshot()[0].last_error
    assert "\x1b" not in last_error and "\n" not in last_error, last_error[:80]
    assert len(last_error) < 400
    with pytest.raises(FleetExhausted) as raised:
        f.raise_if_exhausted()
    assert "\x1b" not in str(raised.value) and len(str(raised.value)) < 2000


@settings(max_examples=300, deadline=None)
@given(
    st.integers(0, 900).flatmap(  # lengths drawn evenly: hypothesis's own favour short texts
        lambda size: st.text(st.sampled_from("ab\n\x1b\u00e9 \t\x07"), min_size=size, max_size=size)
    )
)
def test_an_error_text_is_its_escaped_form_cut_short(text: str) -> None:
    """Only the part of a long error that can be shown is escaped: the same text as the
    whole escaped and cut, and "..." exactly when something was left out."""
    f, _ = fleet()
    f.report_failure(0, text)
    escaped = printable(text)
    wanted = escaped if len(escaped) <= 300 else escaped[:297] + "..."
    assert f.snapshot()[0].last_error == (f"request failed: {wanted}" if text else "request failed")


@pytest.mark.parametrize("reason", ["", "  ", None])
def test_retiring_needs_a_reason(reason: str) -> None:
    f, _ = fleet()
    with pytest.raises(ValueError, match="reason"):
        f.retire(0, reason=reason)
    assert f.state_of(0) is State.HEALTHY


def test_an_error_text_that_quotes_a_server_is_kept_printable() -> None:
    # An SDK's exception carries the response body: a terminal escape in it reached
    # snapshots and the floor message a trainer prints.
    f, _ = fleet()
    f.report_failure(0, RuntimeError("500: \x1b]0;owned\x07 \x1b[2J"))
    last_error = f.snapshot()[0].last_error
    assert last_error is not None and "\x1b" not in last_error and "\\x1b" in last_error


@pytest.mark.parametrize(
    "misuse",
    [
        lambda: FleetHealth(URLS, policy={"min_healthy": 1}),  # type: ignore[arg-type]
        lambda: FleetHealth(URLS, clock=lambda: None),  # type: ignore[arg-type, return-value]
        lambda: fleet()[0].record_probe(0, ok="no"),  # type: ignore[arg-type]
        lambda: fleet()[0].shard_for_base_url(None),  # type: ignore[arg-type]
    ],
    ids=["policy-dict", "clock-none", "ok-string", "url-none"],
)
def test_misuse_is_a_type_error_that_says_what_was_wanted(misuse: Callable[[], object]) -> None:
    """Each was taken before: "no" counted as a good probe, a dict policy and a None clock
    failed later with an unrelated AttributeError or ValueError."""
    with pytest.raises(TypeError, match=r"must (be|return)"):
        misuse()


def test_a_shard_is_found_by_its_url_as_given_and_in_any_case() -> None:
    f = FleetHealth(["http://GPU0:8000", "http://gpu1:8000"])
    assert f.base_url_of(0) == "http://GPU0:8000"  # as the caller wrote it
    assert f.shard_for_base_url("http://GPU0:8000") == 0
    assert f.shard_for_base_url("http://gpu0:8000/") == 0
    assert f.shard_for_base_url("HTTP://GPU1:8000") == 1
    assert f.serving_base_urls() == ["http://GPU0:8000", "http://gpu1:8000"]


def test_a_shard_is_found_by_its_url_with_the_white_space_the_fleet_took_it_with() -> None:
    """The constructor strips a URL read from a file ("...\\n"); the lookup did not, so
    the fleet found no shard by the very text it had been given."""
    f = FleetHealth(["http://10.0.0.1:8000\n", " http://10.0.0.2:8000 "])
    assert f.shard_for_base_url("http://10.0.0.1:8000\n") == 0
    assert f.shard_for_base_url(" http://10.0.0.2:8000 ") == 1
    assert f.shard_for_base_url("http://10.0.0.2:8000/v1\n") == 1


def test_one_host_written_in_two_cases_is_one_backend_and_refused_twice() -> None:
    with pytest.raises(ValueError, match="share the URL"):
        FleetHealth(["http://LOCALHOST:9001", "http://localhost:9001"])


def test_the_default_policy_is_seed_000s() -> None:
    # FleetHealthPolicy's documented defaults: 3 to condemn, 2 to trust, 5 restarts, 1 floor.
    policy = FleetPolicy()
    assert (
        policy.unhealthy_threshold,
        policy.healthy_threshold,
        policy.max_restart_attempts,
        policy.min_healthy,
    ) == (3, 2, 5, 1)


def test_a_fleet_of_no_backends_or_an_empty_name_is_refused_whatever_the_floor() -> None:
    with pytest.raises(ValueError, match="at least one backend"):
        FleetHealth([], policy=FleetPolicy(min_healthy=0))
    with pytest.raises(ValueError, match="non-empty strings"):
        FleetHealth({"": URLS[0], "b": URLS[1]})


def test_backends_awaiting_an_answer_come_in_the_order_given() -> None:
    names = ["h", "c", "f", "a", "g", "b", "e", "d"]
    clock = Clock()
    f = FleetHealth(
        dict(zip(names, [f"http://10.0.0.{i}:8000" for i in range(1, 9)], strict=True)),
        policy=FleetPolicy(recover_in_place=True, min_healthy=0),
        clock=clock,
    )
    for _ in range(3):
        clock.tick()
        for name in names:
            f.report_failure(name, "router: failed generation")
    assert f.absent_shards() == names
    assert f.awaiting_an_answer() == names
