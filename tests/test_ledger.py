"""The ledger as walks (feed an event, assert the whole record, repeat) and as properties
over random event sequences."""

from __future__ import annotations

import ast
import copy
import json
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import llmhealth.ledger as ledger_module
from llmhealth.ledger import (
    ABSENT,
    IGNORED_BECAUSE,
    RULE_LEADS_TO,
    SCHEMA,
    SERVING,
    TRANSITIONS,
    BackendSnapshot,
    Condemned,
    Event,
    EventKind,
    GoodVerdict,
    Ledger,
    LedgerPolicy,
    NewProcessUp,
    OperatorReset,
    ProbeFailure,
    ProcessGone,
    ProcessSeen,
    Readmitted,
    RequestFailure,
    RequestSuccess,
    RestartFailed,
    RestartIssued,
    RestartRan,
    Retire,
    Rule,
    StartupExpired,
    State,
    Transition,
    UnknownBackend,
    UnplannedRestart,
    WedgeProven,
    WeightsPartial,
    WeightsStamped,
)

URL_A = "http://10.0.0.5:8000"
URL_B = "http://10.0.0.6:8000"
URL_C = "http://10.0.0.7:8000"
POLICY = LedgerPolicy()


def one_backend(policy: LedgerPolicy = POLICY, now: float = 0.0) -> Ledger:
    return Ledger(policy, [("a", URL_A)], now=now)


def fresh(now: float = 0.0) -> BackendSnapshot:
    """What a newly configured backend looks like."""
    return BackendSnapshot(
        name="a",
        url=URL_A,
        state=State.HEALTHY,
        probe_failures=0,
        request_failures=0,
        good_streak=0,
        restart_attempts=0,
        last_restart_at=None,
        last_ok_at=None,
        last_error="",
        weight_version=None,
        condemned_by=None,
        state_since=now,
    )


class Walk:
    """Feeds events to backend "a" and checks the whole snapshot after each one."""

    def __init__(self, policy: LedgerPolicy = POLICY) -> None:
        self.ledger = one_backend(policy)
        self.expected = fresh()
        self.now = 0.0
        assert self.ledger.snapshot("a", self.now) == self.expected

    def feed(self, make: Callable[[float], Event], **changes: Any) -> Transition:
        self.now += 10.0
        before = self.expected.state
        transition = self.ledger.apply("a", make(self.now))
        if "state" in changes and changes["state"] != before:
            changes.setdefault("state_since", self.now)
        self.expected = replace(self.expected, **changes)
        assert self.ledger.snapshot("a", self.now) == self.expected
        assert transition.from_state == before
        assert transition.to_state == self.expected.state
        return transition

    def ignore(self, make: Callable[[float], Event]) -> Transition:
        self.now += 10.0
        before = self.ledger.to_dict()
        transition = self.ledger.apply("a", make(self.now))
        assert not transition.applied
        assert not transition.epoch_changed
        assert transition.from_state == transition.to_state == self.expected.state
        assert self.ledger.to_dict() == before
        assert self.ledger.snapshot("a", self.now) == self.expected
        return transition


def good(request_ok: bool = False) -> Callable[[float], Event]:
    return lambda now: GoodVerdict(now=now, request_ok=request_ok)


def probe_fail(reason: str = "down", detail: str = "") -> Callable[[float], Event]:
    return lambda now: ProbeFailure(now=now, reason=reason, detail=detail)


def request_fail(reason: str = "unanswered") -> Callable[[float], Event]:
    return lambda now: RequestFailure(now=now, reason=reason)


def request_ok(now: float) -> Event:
    return RequestSuccess(now=now)


def wedge(now: float) -> Event:
    return WedgeProven(now=now, evidence="3 running, no step over 2 waits")


def restart(now: float) -> Event:
    return RestartIssued(now=now)


def new_process(now: float) -> Event:
    return NewProcessUp(now=now)


def unplanned(now: float) -> Event:
    return UnplannedRestart(now=now)


def readmit(version: int | None = None) -> Callable[[float], Event]:
    return lambda now: Readmitted(now=now, weight_version=version)


# --- the table ------------------------------------------------------------------------


def test_the_table_has_a_row_for_every_state_and_uses_every_rule() -> None:
    assert set(TRANSITIONS) == set(State)
    used = {outcome for row in TRANSITIONS.values() for outcome in row.values()}
    assert set(Rule) <= used
    assert set(IGNORED_BECAUSE) == set(EventKind)


def test_only_readmission_from_stale_leads_into_the_serving_set_from_outside_it() -> None:
    entries = [
        (state, kind)
        for state, row in TRANSITIONS.items()
        for kind, outcome in row.items()
        if state not in SERVING
        and (RULE_LEADS_TO[outcome] if isinstance(outcome, Rule) else {outcome}) & SERVING
    ]
    assert entries == [(State.STALE, EventKind.READMITTED)]
    assert set(RULE_LEADS_TO) == set(Rule)


def test_retired_accepts_nothing_but_an_operator_reset() -> None:
    assert dict(TRANSITIONS[State.RETIRED]) == {EventKind.OPERATOR_RESET: State.STALE}


def test_the_absent_set_is_dead_restarting_and_retired_and_stale_is_neither() -> None:
    assert {State.DEAD, State.RESTARTING, State.RETIRED} == ABSENT
    assert {State.HEALTHY, State.SUSPECT} == SERVING
    assert State.STALE not in ABSENT | SERVING


def test_states_are_lower_case_strings() -> None:
    assert [str(s) for s in State] == [
        "healthy",
        "suspect",
        "dead",
        "restarting",
        "stale",
        "retired",
    ]


# --- doubt and condemnation -----------------------------------------------------------


def test_three_probe_failures_in_a_row_condemn_a_backend_that_kept_serving_until_then() -> None:
    walk = Walk()
    t = walk.feed(
        probe_fail("down", "connection refused"),
        state=State.SUSPECT,
        probe_failures=1,
        last_error="down: connection refused",
    )
    assert t.applied and not t.epoch_changed
    assert walk.ledger.serving == ("a",)
    assert walk.ledger.suspected == ("a",)
    walk.feed(probe_fail("stalled"), probe_failures=2, last_error="stalled")
    t = walk.feed(
        probe_fail("unresponsive"),
        state=State.DEAD,
        probe_failures=3,
        last_error="unresponsive",
        condemned_by="unresponsive",
    )
    assert t.epoch_changed
    assert "condemned" in t.reason
    assert not walk.ledger.serving
    assert walk.ledger.absent == ("a",)
    assert walk.ledger.epoch == 1


def test_a_suspect_backend_is_healthy_again_after_two_good_verdicts_in_a_row() -> None:
    walk = Walk()
    walk.feed(probe_fail(), state=State.SUSPECT, probe_failures=1, last_error="down")
    walk.feed(good(), probe_failures=0, good_streak=1, last_ok_at=20.0)
    t = walk.feed(good(), state=State.HEALTHY, good_streak=2, last_ok_at=30.0)
    # SUSPECT <-> HEALTHY leaves the serving set as it was.
    assert not t.epoch_changed
    assert walk.ledger.epoch == 0
    # Last error stays on record after recovery: it is history, not a state.
    assert walk.ledger.snapshot("a", walk.now).last_error == "down"


def test_a_probe_failure_resets_the_good_streak() -> None:
    walk = Walk()
    walk.feed(probe_fail(), state=State.SUSPECT, probe_failures=1, last_error="down")
    walk.feed(good(), probe_failures=0, good_streak=1, last_ok_at=20.0)
    walk.feed(probe_fail(), probe_failures=1, good_streak=0)
    walk.feed(good(), probe_failures=0, good_streak=1, last_ok_at=40.0)
    walk.feed(good(), state=State.HEALTHY, good_streak=2, last_ok_at=50.0)


def test_a_good_verdict_breaks_a_probe_failure_row() -> None:
    walk = Walk()
    walk.feed(probe_fail(), state=State.SUSPECT, probe_failures=1, last_error="down")
    walk.feed(probe_fail(), probe_failures=2)
    walk.feed(good(), probe_failures=0, good_streak=1, last_ok_at=30.0)
    walk.feed(probe_fail(), probe_failures=1, good_streak=0)
    walk.feed(probe_fail(), probe_failures=2)
    walk.feed(probe_fail(), state=State.DEAD, probe_failures=3, condemned_by="down")


def test_a_server_that_answers_probes_but_fails_every_request_is_condemned() -> None:
    walk = Walk()
    walk.feed(
        request_fail(),
        state=State.SUSPECT,
        request_failures=1,
        last_error="unanswered",
    )
    # Good probes do not clear the request streak, so no flapping back to HEALTHY.
    walk.feed(good(), good_streak=1, last_ok_at=20.0)
    t = walk.feed(good(), good_streak=2, last_ok_at=30.0)
    assert "not yet cleared" in t.reason
    walk.feed(good(), good_streak=3, last_ok_at=40.0)
    walk.feed(request_fail(), request_failures=2, good_streak=0)
    walk.feed(good(), good_streak=1, last_ok_at=60.0)
    walk.feed(
        request_fail(),
        state=State.DEAD,
        request_failures=3,
        good_streak=0,
        condemned_by="unanswered",
    )


def test_only_an_answered_request_clears_the_request_failure_streak() -> None:
    walk = Walk()
    walk.feed(request_fail(), state=State.SUSPECT, request_failures=1, last_error="unanswered")
    walk.feed(good(), good_streak=1, last_ok_at=20.0)
    walk.feed(request_ok, request_failures=0, last_ok_at=30.0)
    walk.feed(good(), state=State.HEALTHY, good_streak=2, last_ok_at=40.0)


def test_an_answered_request_promotes_once_enough_good_verdicts_were_already_seen() -> None:
    walk = Walk()
    walk.feed(request_fail(), state=State.SUSPECT, request_failures=1, last_error="unanswered")
    walk.feed(good(), good_streak=1, last_ok_at=20.0)
    walk.feed(good(), good_streak=2, last_ok_at=30.0)
    walk.feed(request_ok, state=State.HEALTHY, request_failures=0, last_ok_at=40.0)


def test_a_good_verdict_with_an_answered_tiny_request_counts_as_a_request_success() -> None:
    walk = Walk()
    walk.feed(request_fail(), state=State.SUSPECT, request_failures=1, last_error="unanswered")
    walk.feed(good(request_ok=True), request_failures=0, good_streak=1, last_ok_at=20.0)
    walk.feed(good(), state=State.HEALTHY, good_streak=2, last_ok_at=30.0)


def test_a_request_failure_also_restarts_the_count_of_good_verdicts() -> None:
    walk = Walk()
    walk.feed(probe_fail(), state=State.SUSPECT, probe_failures=1, last_error="down")
    walk.feed(good(), probe_failures=0, good_streak=1, last_ok_at=20.0)
    walk.feed(request_fail(), request_failures=1, good_streak=0, last_error="unanswered")
    walk.feed(request_ok, request_failures=0, last_ok_at=40.0)
    walk.feed(good(), good_streak=1, last_ok_at=50.0)
    walk.feed(good(), state=State.HEALTHY, good_streak=2, last_ok_at=60.0)


def test_probe_and_request_failures_count_on_separate_streaks() -> None:
    walk = Walk()
    walk.feed(probe_fail(), state=State.SUSPECT, probe_failures=1, last_error="down")
    walk.feed(request_fail(), request_failures=1, last_error="unanswered")
    walk.feed(probe_fail(), probe_failures=2, last_error="down")
    walk.feed(request_fail(), request_failures=2, last_error="unanswered")
    # Four failures, yet neither streak reached three.
    walk.feed(
        request_fail("http 500"),
        state=State.DEAD,
        request_failures=3,
        last_error="http 500",
        condemned_by="http 500",
    )


def test_a_healthy_backend_accepts_good_news_without_changing_state() -> None:
    walk = Walk()
    walk.feed(good(), good_streak=1, last_ok_at=10.0)
    walk.feed(request_ok, last_ok_at=20.0)
    walk.feed(good(request_ok=True), good_streak=2, last_ok_at=30.0)


def test_a_threshold_of_one_condemns_a_healthy_backend_on_its_first_failure() -> None:
    walk = Walk(LedgerPolicy(unhealthy_threshold=1, healthy_threshold=1))
    walk.feed(
        probe_fail(), state=State.DEAD, probe_failures=1, last_error="down", condemned_by="down"
    )


def test_proof_of_death_condemns_at_once_without_counting() -> None:
    walk = Walk()
    t = walk.feed(
        lambda now: ProcessGone(now=now, reason="down", detail="unit inactive"),
        state=State.DEAD,
        last_error="down: unit inactive",
        condemned_by="down",
        caller_condemned=True,
    )
    assert t.epoch_changed


def test_a_proven_wedge_condemns_a_suspect_backend_at_once_and_records_wedged() -> None:
    walk = Walk()
    walk.feed(probe_fail("stalled"), state=State.SUSPECT, probe_failures=1, last_error="stalled")
    walk.feed(
        wedge,
        state=State.DEAD,
        last_error="wedged: 3 running, no step over 2 waits",
        condemned_by="wedged",
    )


# --- restart and re-admission ----------------------------------------------------------


def test_a_restarted_backend_serves_again_only_after_readmission() -> None:
    walk = Walk()
    walk.feed(
        wedge,
        state=State.DEAD,
        last_error="wedged: 3 running, no step over 2 waits",
        condemned_by="wedged",
    )
    assert walk.ledger.epoch == 1
    t = walk.feed(restart, state=State.RESTARTING, restart_attempts=1, last_restart_at=20.0)
    assert "restart 1 of 5" in t.reason
    walk.ignore(good(request_ok=True))
    walk.feed(new_process, state=State.STALE)
    assert walk.ledger.serving == () and walk.ledger.absent == ()
    walk.ignore(good(request_ok=True))
    walk.ignore(request_ok)
    t = walk.feed(
        readmit(7),
        state=State.HEALTHY,
        weight_version=7,
        condemned_by=None,
        last_ok_at=walk.now + 10.0,
    )
    assert t.epoch_changed
    assert walk.ledger.epoch == 2
    assert list(walk.ledger.serving) == ["a"]


def test_a_failed_restart_returns_to_dead_and_keeps_why_it_was_condemned() -> None:
    walk = Walk()
    walk.feed(
        wedge,
        state=State.DEAD,
        last_error="wedged: 3 running, no step over 2 waits",
        condemned_by="wedged",
    )
    walk.feed(restart, state=State.RESTARTING, restart_attempts=1, last_restart_at=20.0)
    walk.feed(
        lambda now: RestartFailed(now=now, reason="exit status 1"),
        state=State.DEAD,
        last_error="restart failed: exit status 1",
    )
    assert walk.ledger.snapshot("a", walk.now).condemned_by == "wedged"
    walk.feed(restart, state=State.RESTARTING, restart_attempts=2, last_restart_at=40.0)


def test_a_restart_that_outlives_the_startup_grace_is_failed_back_to_dead() -> None:
    ledger = Ledger(LedgerPolicy(startup_grace=100.0), [("a", URL_A), ("b", URL_B)], now=0.0)
    ledger.apply("a", WedgeProven(now=10.0))
    ledger.apply("a", RestartIssued(now=20.0))
    assert ledger.overdue(119.0) == []
    assert ledger.expire_restarts(119.0) == []
    assert ledger.state_of("a") is State.RESTARTING
    assert ledger.overdue(120.0) == ["a"]  # what expire_restarts fails, without failing it
    assert ledger.state_of("a") is State.RESTARTING
    [t] = ledger.expire_restarts(120.0)
    assert t == Transition(
        name="a",
        kind=EventKind.STARTUP_EXPIRED,
        from_state=State.RESTARTING,
        to_state=State.DEAD,
        applied=True,
        reason="restart failed: no new process within the startup grace of 100s",
        epoch_changed=False,
    )
    snap = ledger.snapshot("a", 120.0)
    assert snap.state is State.DEAD and snap.state_since == 120.0
    assert ledger.expire_restarts(500.0) == []


def test_the_grace_of_a_restart_whose_command_ran_long_counts_from_its_end() -> None:
    ledger = Ledger(LedgerPolicy(startup_grace=100.0), [("a", URL_A)], now=0.0)
    ledger.apply("a", WedgeProven(now=10.0))
    ledger.apply("a", RestartIssued(now=20.0))
    assert ledger.expire_restarts(150.0, sparing={"a"}) == []  # its command still runs
    ran = ledger.apply("a", RestartRan(now=160.0))
    assert (ran.applied, ran.to_state) == (True, State.RESTARTING)
    assert ledger.overdue(259.0) == []
    ledger.apply("a", NewProcessUp(now=200.0))
    assert ledger.overdue(259.0) == [] and ledger.restart_unproven("a", 259.0)
    assert ledger.overdue(260.0) == ["a"]
    restored = Ledger.from_dict(ledger.to_dict(), LedgerPolicy(startup_grace=100.0))
    assert restored.snapshot("a", 260.0).restart_ran_at == 160.0
    # A command that ended before the restart it served (an older one's) moves nothing.
    ledger.apply("a", StartupExpired(now=260.0))
    ledger.apply("a", RestartIssued(now=300.0))
    assert ledger.overdue(400.0) == ["a"]


def test_an_earlier_commands_end_does_not_stretch_a_later_restarts_grace() -> None:
    # The wall clock stepped back between two restarts: the first command's end, "later"
    # than the second restart, kept that restart from ever running out of grace.
    ledger = Ledger(LedgerPolicy(startup_grace=100.0), [("a", URL_A)], now=0.0)
    ledger.apply("a", WedgeProven(now=10.0))
    ledger.apply("a", RestartIssued(now=1000.0))
    ledger.apply("a", RestartRan(now=1500.0))
    ledger.apply("a", StartupExpired(now=1600.0))
    ledger.apply("a", RestartIssued(now=1100.0))
    assert ledger.overdue(1200.0) == ["a"]


def test_a_replacement_never_readmitted_within_the_grace_is_a_failed_restart() -> None:
    walk = Walk(LedgerPolicy(startup_grace=100.0))
    walk.feed(
        wedge,
        state=State.DEAD,
        last_error="wedged: 3 running, no step over 2 waits",
        condemned_by="wedged",
    )
    walk.feed(restart, state=State.RESTARTING, restart_attempts=1, last_restart_at=20.0)
    walk.feed(new_process, state=State.STALE)
    walk.feed(request_fail(), state=State.STALE, request_failures=1, last_error="unanswered")
    assert walk.ledger.expire_restarts(119.0) == []  # 99 s after the restart: not yet
    [t] = walk.ledger.expire_restarts(120.0)
    why = "restart failed: the new process was not re-admitted within the startup grace of 100s"
    assert t == Transition(
        name="a",
        kind=EventKind.STARTUP_EXPIRED,
        from_state=State.STALE,
        to_state=State.DEAD,
        applied=True,
        reason=why,
        epoch_changed=False,
    )
    walk.now = 120.0
    walk.expected = replace(walk.expected, state=State.DEAD, state_since=120.0, last_error=why)
    assert walk.ledger.snapshot("a", 120.0) == walk.expected
    # Still condemned by the wedge, so the restart policy can try again; the next attempt
    # spends the budget like any other.
    walk.feed(restart, state=State.RESTARTING, restart_attempts=2, last_restart_at=130.0)


def test_startup_expired_before_the_grace_or_after_readmission_changes_nothing() -> None:
    walk = Walk(LedgerPolicy(startup_grace=100.0))
    walk.feed(
        wedge,
        state=State.DEAD,
        last_error="wedged: 3 running, no step over 2 waits",
        condemned_by="wedged",
    )
    walk.feed(restart, state=State.RESTARTING, restart_attempts=1, last_restart_at=20.0)
    t = walk.feed(lambda now: StartupExpired(now=now), state=State.RESTARTING)
    assert t.applied and t.reason == "no restart of it is overdue (startup grace 100s)"
    walk.feed(new_process, state=State.STALE)
    walk.feed(readmit(), state=State.HEALTHY, condemned_by=None, last_ok_at=50.0)
    # An unplanned restart long after: STALE again, but no restart of ours awaits proof.
    walk.now = 1000.0
    walk.feed(
        lambda now: UnplannedRestart(now=now),
        state=State.STALE,
        last_error="process restarted unplanned",
    )
    assert walk.ledger.expire_restarts(5000.0) == []
    t = walk.feed(lambda now: StartupExpired(now=now), state=State.STALE)
    assert t.applied and t.from_state is t.to_state is State.STALE


def test_a_stale_backend_no_restart_began_never_runs_out_of_grace() -> None:
    ledger = Ledger(LedgerPolicy(startup_grace=100.0), [("a", URL_A)], now=0.0)
    ledger.apply("a", UnplannedRestart(now=10.0))
    assert ledger.expire_restarts(10_000.0) == []
    assert ledger.state_of("a") is State.STALE


def test_an_overdue_replacement_past_the_budget_retires_on_its_next_restart() -> None:
    ledger = Ledger(LedgerPolicy(startup_grace=100.0, restart_budget=1), [("a", URL_A)], now=0.0)
    ledger.apply("a", WedgeProven(now=10.0))
    ledger.apply("a", RestartIssued(now=20.0))
    ledger.apply("a", NewProcessUp(now=30.0))
    [t] = ledger.expire_restarts(120.0)
    assert (t.from_state, t.to_state) == (State.STALE, State.DEAD)
    retired = ledger.apply("a", RestartIssued(now=200.0))
    assert retired.to_state is State.RETIRED


def test_the_restart_past_the_budget_retires_the_backend_instead() -> None:
    walk = Walk(LedgerPolicy(restart_budget=2, restart_budget_window=3600.0))
    for attempt in (1, 2):
        walk.feed(
            wedge,
            state=State.DEAD,
            last_error="wedged: 3 running, no step over 2 waits",
            condemned_by="wedged",
        )
        walk.feed(
            restart,
            state=State.RESTARTING,
            restart_attempts=attempt,
            last_restart_at=walk.now + 10.0,
        )
        walk.feed(new_process, state=State.STALE)
        walk.feed(readmit(), state=State.HEALTHY, condemned_by=None, last_ok_at=walk.now + 10.0)
    walk.feed(
        wedge,
        state=State.DEAD,
        last_error="wedged: 3 running, no step over 2 waits",
        condemned_by="wedged",
    )
    t = walk.feed(
        restart,
        state=State.RETIRED,
        last_error="restart budget spent: 2 attempts in 1h; "
        "last error: wedged: 3 running, no step over 2 waits",
    )
    assert t.reason == "restart budget spent: 2 attempts in 1h"
    assert walk.ledger.absent == ("a",)


def test_the_default_budget_message_speaks_of_24h() -> None:
    ledger = one_backend(LedgerPolicy(restart_budget=1))
    ledger.apply("a", WedgeProven(now=1.0))
    ledger.apply("a", RestartIssued(now=2.0))
    ledger.apply("a", RestartFailed(now=3.0, reason="exit 1"))
    t = ledger.apply("a", RestartIssued(now=4.0))
    assert t.to_state is State.RETIRED
    assert t.reason == "restart budget spent: 1 attempts in 24h"


def test_restart_attempts_older_than_the_window_stop_counting() -> None:
    ledger = one_backend(LedgerPolicy(restart_budget=1, restart_budget_window=100.0))
    ledger.apply("a", WedgeProven(now=0.0))
    ledger.apply("a", RestartIssued(now=10.0))
    ledger.apply("a", RestartFailed(now=20.0, reason="exit 1"))
    assert ledger.snapshot("a", 109.0).restart_attempts == 1
    assert ledger.snapshot("a", 110.0).restart_attempts == 0
    t = ledger.apply("a", RestartIssued(now=110.0))
    assert t.to_state is State.RESTARTING
    snap = ledger.snapshot("a", 110.0)
    assert snap.restart_attempts == 1 and snap.last_restart_at == 110.0


def test_an_unplanned_restart_of_a_serving_backend_lands_in_stale_with_clean_streaks() -> None:
    walk = Walk()
    walk.feed(probe_fail(), state=State.SUSPECT, probe_failures=1, last_error="down")
    walk.feed(request_fail(), request_failures=1, last_error="unanswered")
    t = walk.feed(
        unplanned,
        state=State.STALE,
        probe_failures=0,
        request_failures=0,
        last_error="process restarted unplanned",
    )
    assert t.epoch_changed
    walk.ignore(good(request_ok=True))
    walk.feed(readmit(), state=State.HEALTHY, last_ok_at=walk.now + 10.0)


def test_a_dead_backend_replaced_from_outside_goes_to_stale_not_healthy() -> None:
    walk = Walk()
    walk.feed(probe_fail(), state=State.SUSPECT, probe_failures=1, last_error="down")
    walk.feed(probe_fail(), probe_failures=2)
    walk.feed(probe_fail(), state=State.DEAD, probe_failures=3, condemned_by="down")
    walk.feed(new_process, state=State.STALE, probe_failures=0, replaced_while_dead=True)
    assert walk.ledger.snapshot("a", walk.now).condemned_by == "down"


def test_failures_of_a_stale_backend_are_noted_but_never_condemn_or_serve() -> None:
    walk = Walk()
    walk.feed(unplanned, state=State.STALE, last_error="process restarted unplanned")
    for n in range(1, 6):
        t = walk.feed(probe_fail("down", "refused"), probe_failures=n, last_error="down: refused")
        assert t.applied and t.to_state is State.STALE and not t.epoch_changed
    walk.feed(request_fail(), request_failures=1, last_error="unanswered")
    # Re-admission starts the new life clean.
    walk.feed(
        readmit(3),
        state=State.HEALTHY,
        probe_failures=0,
        request_failures=0,
        weight_version=3,
        last_ok_at=walk.now + 10.0,
    )


def test_a_stale_backend_that_dies_or_wedges_is_condemned() -> None:
    walk = Walk()
    walk.feed(unplanned, state=State.STALE, last_error="process restarted unplanned")
    walk.feed(
        wedge,
        state=State.DEAD,
        last_error="wedged: 3 running, no step over 2 waits",
        condemned_by="wedged",
    )
    walk.feed(new_process, state=State.STALE, replaced_while_dead=True)
    walk.feed(
        lambda now: ProcessGone(now=now, reason="down"),
        state=State.DEAD,
        last_error="down",
        condemned_by="down",
        replaced_while_dead=False,
        caller_condemned=True,
    )


# --- retirement and reset ----------------------------------------------------------------


@pytest.mark.parametrize("state", [s for s in State if s is not State.RETIRED])
def test_any_backend_not_yet_retired_can_be_retired(state: State) -> None:
    ledger = ledger_in(state)
    t = ledger.apply("a", Retire(now=100.0, reason="decommissioned"))
    assert t.applied and t.to_state is State.RETIRED
    assert t.epoch_changed == (state in SERVING)
    snap = ledger.snapshot("a", 100.0)
    assert snap.last_error == "retired: decommissioned"
    assert snap.state_since == 100.0


def test_an_operator_reset_brings_a_retired_backend_back_as_stale_with_a_clean_slate() -> None:
    walk = Walk(LedgerPolicy(restart_budget=1))
    walk.feed(probe_fail(), state=State.SUSPECT, probe_failures=1, last_error="down")
    walk.feed(
        wedge,
        state=State.DEAD,
        last_error="wedged: 3 running, no step over 2 waits",
        condemned_by="wedged",
    )
    walk.feed(restart, state=State.RESTARTING, restart_attempts=1, last_restart_at=30.0)
    walk.feed(
        lambda now: RestartFailed(now=now, reason="exit 1"),
        state=State.DEAD,
        last_error="restart failed: exit 1",
    )
    walk.feed(
        restart,
        state=State.RETIRED,
        last_error="restart budget spent: 1 attempts in 24h; last error: restart failed: exit 1",
    )
    for kind in EventKind:
        if kind is not EventKind.OPERATOR_RESET:
            t = walk.ignore(maker_for(kind))
            assert "RETIRED is terminal" in t.reason
    walk.feed(
        lambda now: OperatorReset(now=now),
        state=State.STALE,
        probe_failures=0,
        restart_attempts=0,
        last_restart_at=None,
        condemned_by=None,
    )
    walk.feed(readmit(), state=State.HEALTHY, last_ok_at=walk.now + 10.0)


# --- every ignored event ---------------------------------------------------------------


def ledger_in(state: State) -> Ledger:
    """A one-backend ledger whose backend "a" reached ``state`` by legal events."""
    ledger = one_backend()
    path: dict[State, list[Event]] = {
        State.HEALTHY: [],
        State.SUSPECT: [ProbeFailure(now=1.0, reason="stalled")],
        State.DEAD: [WedgeProven(now=1.0)],
        State.RESTARTING: [WedgeProven(now=1.0), RestartIssued(now=2.0)],
        State.STALE: [UnplannedRestart(now=1.0)],
        State.RETIRED: [Retire(now=1.0, reason="operator")],
    }
    for event in path[state]:
        assert ledger.apply("a", event).applied
    assert ledger.state_of("a") is state
    return ledger


def maker_for(kind: EventKind, flag: bool = False) -> Callable[[float], Event]:
    makers: dict[EventKind, Callable[[float], Event]] = {
        EventKind.GOOD_VERDICT: lambda now: GoodVerdict(
            now=now, request_ok=flag, process=ProcessSeen(start=7.0, counters={"steps": now})
        ),
        EventKind.PROBE_FAILURE: lambda now: ProbeFailure(
            now=now, reason="down" if flag else "stalled"
        ),
        EventKind.REQUEST_FAILURE: lambda now: RequestFailure(
            now=now, reason="request_failures" if flag else "unanswered", traffic=flag
        ),
        EventKind.REQUEST_SUCCESS: lambda now: RequestSuccess(now=now),
        EventKind.PROCESS_GONE: lambda now: ProcessGone(now=now, reason="down"),
        EventKind.WEDGE_PROVEN: lambda now: WedgeProven(now=now, evidence="no steps"),
        EventKind.RESTART_ISSUED: lambda now: RestartIssued(now=now),
        EventKind.RESTART_FAILED: lambda now: RestartFailed(now=now, reason="exit 1"),
        EventKind.RESTART_RAN: lambda now: RestartRan(now=now),
        EventKind.STARTUP_EXPIRED: lambda now: StartupExpired(now=now),
        EventKind.NEW_PROCESS_UP: lambda now: NewProcessUp(
            now=now, process=ProcessSeen(start=now) if flag else None
        ),
        EventKind.READMITTED: lambda now: Readmitted(now=now, weight_version=7 if flag else None),
        EventKind.UNPLANNED_RESTART: lambda now: UnplannedRestart(now=now),
        EventKind.RETIRE: lambda now: Retire(now=now, reason="operator"),
        EventKind.OPERATOR_RESET: lambda now: OperatorReset(now=now),
        EventKind.CONDEMNED: lambda now: Condemned(now=now, reason="silent participant"),
        EventKind.WEIGHTS_PARTIAL: lambda now: WeightsPartial(now=now),
        EventKind.WEIGHTS_STAMPED: lambda now: WeightsStamped(now=now, weight_version=3),
    }
    return makers[kind]


IGNORED_PAIRS = [
    (state, kind) for state in State for kind in EventKind if kind not in TRANSITIONS[state]
]


@pytest.mark.parametrize(("state", "kind"), IGNORED_PAIRS, ids=str)
def test_an_event_that_does_not_apply_changes_nothing_and_says_why(
    state: State, kind: EventKind
) -> None:
    ledger = ledger_in(state)
    before = ledger.to_dict()
    for flag in (False, True):
        t = ledger.apply("a", maker_for(kind, flag)(50.0))
        assert t == Transition(
            name="a",
            kind=kind,
            from_state=state,
            to_state=state,
            applied=False,
            reason=t.reason,
            epoch_changed=False,
        )
        assert t.reason.startswith(f"{kind} ignored in {state}: ")
        assert ledger.to_dict() == before


def test_a_replacement_whose_requests_finish_is_noted_working_and_no_grace_fails_it() -> None:
    # Restarted, up, and busy with work from elsewhere: never idle, so never sent the tiny
    # request. Its finishing requests show the restart worked: it stays STALE (out of
    # serving), but neither holds a restart slot nor is failed and restarted at the grace.
    ledger = one_backend()
    policy = ledger.policy
    process = ProcessSeen(start=90.0, counters={"steps": 10.0})
    for event in (
        WedgeProven(now=1.0),
        RestartIssued(now=2.0),
        NewProcessUp(now=60.0, process=process),
    ):
        assert ledger.apply("a", event).applied
    assert ledger.restart_unproven("a", 60.0)
    other = ProcessSeen(start=95.0, counters={"steps": 1.0})
    t = ledger.apply("a", GoodVerdict(now=70.0, requests_finished=True, process=other))
    assert not t.applied  # another process's requests say nothing of this one
    busy = ProcessSeen(start=90.0, counters={"steps": 400.0})
    t = ledger.apply("a", GoodVerdict(now=80.0, requests_finished=True, process=busy))
    assert t.applied and t.to_state is State.STALE and "it works" in t.reason
    assert not ledger.restart_unproven("a", 80.0)
    assert ledger.expire_restarts(2.0 + policy.startup_grace + 1) == []
    assert ledger.state_of("a") is State.STALE
    assert not ledger.snapshot("a", 100.0).serving


def test_the_ignored_set_covers_the_guards_the_callers_used_to_keep() -> None:
    ignored = set(IGNORED_PAIRS)
    for state in (State.RESTARTING, State.STALE, State.RETIRED):
        assert (state, EventKind.REQUEST_SUCCESS) in ignored
    for state in (State.RESTARTING, State.RETIRED):
        assert (state, EventKind.GOOD_VERDICT) in ignored
    # In STALE a good verdict meets the working-replacement rule, which turns away all but
    # requests finishing on its own process exactly as an absent entry would.
    assert TRANSITIONS[State.STALE][EventKind.GOOD_VERDICT] is Rule.NOTE_WORKING
    stale = ledger_in(State.STALE)
    before = stale.to_dict()
    for flag in (False, True):
        t = stale.apply("a", maker_for(EventKind.GOOD_VERDICT, flag)(50.0))
        assert not t.applied and t.to_state is State.STALE
        assert t.reason.startswith("good_verdict ignored in stale: ")
        assert stale.to_dict() == before
    # In DEAD they meet the in-place rule, which the default policy (off) turns away
    # exactly as an absent entry would: seed 000's semantics.
    for kind in (EventKind.GOOD_VERDICT, EventKind.REQUEST_SUCCESS):
        assert TRANSITIONS[State.DEAD][kind] is Rule.RECOVER_IN_PLACE
        ledger = ledger_in(State.DEAD)
        before = ledger.to_dict()
        for flag in (False, True):
            t = ledger.apply("a", maker_for(kind, flag)(50.0))
            assert not t.applied and t.to_state is State.DEAD
            assert t.reason.startswith(f"{kind} ignored in dead: ")
            assert t.reason.endswith("(policy.recover_in_place is off)")
            assert ledger.to_dict() == before
    for state in set(State) - {State.STALE}:
        assert (state, EventKind.READMITTED) in ignored
    for state in set(State) - {State.DEAD}:
        assert (state, EventKind.RESTART_ISSUED) in ignored
    for state in set(State) - {State.RESTARTING}:
        assert (state, EventKind.RESTART_FAILED) in ignored
    for state in set(State) - {State.RESTARTING, State.DEAD, State.STALE}:
        assert (state, EventKind.NEW_PROCESS_UP) in ignored


# --- recovery in place ----------------------------------------------------------------

RECOVER = LedgerPolicy(recover_in_place=True)


def seen(start: float | None = 1000.0, steps: float = 50.0, finished: float = 5.0) -> ProcessSeen:
    return ProcessSeen(start=start, counters={"steps": steps, "finished": finished})


def good_from(
    process: ProcessSeen | None,
    *,
    request_ok: bool = True,
    requests_finished: bool = False,
    restart_pending: bool = False,
) -> Callable[[float], Event]:
    """A good verdict from ``process``: by default idle, the tiny request answered."""
    return lambda now: GoodVerdict(
        now=now,
        request_ok=request_ok,
        requests_finished=requests_finished,
        restart_pending=restart_pending,
        process=process,
    )


def condemned_by_probes(walk: Walk, process: ProcessSeen | None = None) -> None:
    """Serving with ``process`` known, then three unanswered /metrics reads: DEAD."""
    walk.feed(good_from(process or seen(steps=40.0)), last_ok_at=walk.now + 10.0, good_streak=1)
    unresponsive = probe_fail("unresponsive", "no answer in 5 s")
    walk.feed(
        unresponsive,
        state=State.SUSPECT,
        probe_failures=1,
        good_streak=0,
        last_error="unresponsive: no answer in 5 s",
    )
    walk.feed(unresponsive, probe_failures=2)
    walk.feed(unresponsive, state=State.DEAD, probe_failures=3, condemned_by="unresponsive")


def test_the_same_process_answering_again_goes_from_dead_to_stale_then_serves_on_readmission() -> (
    None
):
    walk = Walk(RECOVER)
    condemned_by_probes(walk)
    dead_at = walk.now
    t = walk.feed(
        good_from(seen(steps=60.0), request_ok=True),
        probe_failures=0,
        good_streak=1,
        last_ok_at=walk.now + 10.0,
    )
    assert t.applied and t.to_state is State.DEAD
    assert t.reason == "1 of 2 good verdicts in a row from the same process"
    t = walk.feed(
        good_from(seen(steps=70.0), request_ok=True),
        state=State.STALE,
        good_streak=0,
        in_place_recoveries=1,
        last_ok_at=walk.now + 10.0,
    )
    assert t.reason.startswith(f"same process, back after {walk.now - dead_at:.0f} s: ")
    assert "in-place recovery 1 of 3 allowed in 24h" in t.reason
    assert not t.epoch_changed and walk.ledger.serving == ()
    # From STALE it re-enters exactly as any STALE backend does, and only so.
    walk.ignore(good_from(seen(steps=80.0), request_ok=True))
    t = walk.feed(readmit(), state=State.HEALTHY, condemned_by=None, last_ok_at=walk.now + 10.0)
    assert t.epoch_changed and walk.ledger.serving == ("a",)


def test_a_backend_condemned_by_unanswered_tiny_requests_needs_an_answered_one_to_recover() -> None:
    walk = Walk(RECOVER)
    walk.feed(good_from(seen()), last_ok_at=10.0, good_streak=1)
    unanswered = lambda now: RequestFailure(now=now, reason="unanswered", process=seen())  # noqa: E731
    walk.feed(
        unanswered,
        state=State.SUSPECT,
        request_failures=1,
        good_streak=0,
        last_error="unanswered",
    )
    walk.feed(unanswered, request_failures=2)
    walk.feed(unanswered, state=State.DEAD, request_failures=3, condemned_by="unanswered")
    # Requests finishing for others show the process answers, not that the tiny request
    # it failed would now be answered: they count, and clear nothing.
    t = walk.feed(
        good_from(seen(), request_ok=False, requests_finished=True),
        good_streak=1,
        last_ok_at=walk.now + 10.0,
    )
    assert "3 request failure(s) not yet cleared" in t.reason
    t = walk.feed(
        good_from(seen(), request_ok=False, requests_finished=True),
        good_streak=2,
        last_ok_at=walk.now + 10.0,
    )
    assert t.to_state is State.DEAD
    walk.feed(
        good_from(seen(), request_ok=True),
        state=State.STALE,
        request_failures=0,
        good_streak=0,
        in_place_recoveries=1,
        last_ok_at=walk.now + 10.0,
    )


def test_a_backend_condemned_by_traffic_recovers_on_requests_finishing_once_one_is_answered() -> (
    None
):
    walk = Walk(RECOVER)
    walk.feed(good_from(seen()), last_ok_at=10.0, good_streak=1)
    # The router reports by URL, with no /metrics read: no process attached.
    failed = request_fail("upstream_5xx")
    walk.feed(
        failed, state=State.SUSPECT, request_failures=1, good_streak=0, last_error="upstream_5xx"
    )
    walk.feed(failed, request_failures=2)
    walk.feed(failed, state=State.DEAD, request_failures=3, condemned_by="upstream_5xx")
    # Busy, vllm:request_success climbing: the finishing requests prove the process
    # answers (no tiny request is sent to a backend with work), but the requests that
    # failed on the router's side are cleared only by one seen answered.
    for streak, finished in ((1, 9.0), (2, 12.0)):
        t = walk.feed(
            good_from(seen(finished=finished), request_ok=False, requests_finished=True),
            good_streak=streak,
            last_ok_at=walk.now + 10.0,
        )
        assert "3 request failure(s) not yet cleared" in t.reason
    # One the router saw answered clears them, though it cannot say which process answered.
    t = walk.feed(request_ok, request_failures=0, last_ok_at=walk.now + 10.0)
    assert t.to_state is State.DEAD and "which process answered is unknown" in t.reason
    walk.ignore(request_ok)  # nothing left to clear, and nothing it can prove
    walk.feed(
        good_from(seen(finished=15.0), request_ok=False, requests_finished=True),
        state=State.STALE,
        good_streak=0,
        in_place_recoveries=1,
        last_ok_at=walk.now + 10.0,
    )


def test_an_engine_that_steps_while_no_request_finishes_proves_nothing() -> None:
    walk = Walk(RECOVER)
    condemned_by_probes(walk)
    for steps in (60.0, 70.0, 80.0):
        t = walk.ignore(good_from(seen(steps=steps), request_ok=False))
        assert "no request finished or was answered" in t.reason


def test_a_wedge_that_ends_without_a_restart_is_a_same_process_recovery() -> None:
    walk = Walk(RECOVER)
    walk.feed(good_from(seen(steps=40.0)), last_ok_at=10.0, good_streak=1)
    walk.feed(
        lambda now: WedgeProven(now=now, evidence="no step over 2 waits", process=seen()),
        state=State.DEAD,
        good_streak=0,
        condemned_by="wedged",
        last_error="wedged: no step over 2 waits",
    )
    # The engine steps again (a long compile, a collective that resolved) and the stuck
    # requests finish: busy, so no tiny request, and the finishing requests are the proof.
    walk.feed(
        good_from(seen(steps=51.0, finished=6.0), request_ok=False, requests_finished=True),
        good_streak=1,
        last_ok_at=walk.now + 10.0,
    )
    t = walk.feed(
        good_from(seen(steps=63.0, finished=8.0), request_ok=False, requests_finished=True),
        state=State.STALE,
        good_streak=0,
        in_place_recoveries=1,
        last_ok_at=walk.now + 10.0,
    )
    assert "same process" in t.reason
    assert walk.ledger.snapshot("a", walk.now).condemned_by == "wedged"


def test_a_failure_while_dead_starts_the_good_streak_again() -> None:
    walk = Walk(RECOVER)
    condemned_by_probes(walk)
    walk.feed(good_from(seen()), probe_failures=0, good_streak=1, last_ok_at=walk.now + 10.0)
    t = walk.feed(
        probe_fail("stalled", "no step"),
        probe_failures=1,
        good_streak=0,
        last_error="stalled: no step",
    )
    assert t.applied and "the good streak starts again" in t.reason
    walk.feed(good_from(seen()), probe_failures=0, good_streak=1, last_ok_at=walk.now + 10.0)
    walk.feed(
        good_from(seen()),
        state=State.STALE,
        good_streak=0,
        in_place_recoveries=1,
        last_ok_at=walk.now + 10.0,
    )


def test_another_process_never_recovers_in_place_and_goes_through_stale_as_before() -> None:
    walk = Walk(RECOVER)
    condemned_by_probes(walk, seen(start=1000.0))
    for _ in range(5):
        t = walk.ignore(good_from(seen(start=2000.0), request_ok=True))
        assert t.reason == (
            "good_verdict refused in dead: start time 1000.00 -> 2000.00: another process; "
            "a new process goes through new_process_up and STALE"
        )
    walk.feed(
        lambda now: NewProcessUp(now=now, process=seen(start=2000.0, steps=0.0)),
        state=State.STALE,
        probe_failures=0,
        replaced_while_dead=True,
    )
    assert walk.ledger.snapshot("a", walk.now).in_place_recoveries == 0


def test_a_failure_read_from_another_process_while_dead_leaves_the_condemned_one_on_record() -> (
    None
):
    # While DEAD the record keeps the process it condemned: a failure read from another
    # process, taken as the one on record, let that process recover in place unproven.
    ledger = Ledger(RECOVER, [("a", "http://a.example:8000")], now=0.0)
    wedge = WedgeProven(now=1.0, evidence="no step in 2 waits", process=seen(start=1000.0))
    ledger.apply("a", wedge)
    other = seen(start=2000.0)
    assert ledger.apply("a", ProbeFailure(now=2.0, reason="stalled", process=other)).applied
    for now in (3.0, 4.0, 5.0):
        t = ledger.apply("a", GoodVerdict(now=now, request_ok=True, process=other))
        assert not t.applied and "another process" in t.reason
    assert ledger.state_of("a") is State.DEAD


def test_counters_that_went_back_mark_another_process_when_there_is_no_start_time() -> None:
    walk = Walk(RECOVER)
    condemned_by_probes(walk, seen(start=None, steps=400.0, finished=30.0))
    t = walk.ignore(good_from(seen(start=None, steps=3.0, finished=1.0), request_ok=True))
    assert "finished, steps went back: another process" in t.reason
    # Counters that kept climbing are the same process.
    walk.feed(
        good_from(seen(start=None, steps=450.0, finished=31.0), request_ok=True),
        probe_failures=0,
        good_streak=1,
        last_ok_at=walk.now + 10.0,
    )


def test_a_process_that_cannot_be_identified_never_recovers_in_place() -> None:
    walk = Walk(RECOVER)
    condemned_by_probes(walk)
    t = walk.ignore(good_from(None, request_ok=True))
    assert "which process answered is unknown" in t.reason
    t = walk.ignore(good_from(ProcessSeen(start=None), request_ok=True))
    assert "neither a start time nor a counter to compare" in t.reason


def test_a_backend_never_identified_recovers_in_place_on_answered_tiny_requests() -> None:
    """A backend whose /metrics shows no process (metrics off: ``no_metrics``, judged by
    the tiny request alone), condemned by failed requests, answered every tiny request
    and was refused each time ("which process answered is unknown"): no restart follows a
    traffic condemnation by default, so it stayed DEAD for good. Nothing ever identified
    the condemned process nor the one answering: the answers count, within the limits."""
    walk = Walk(RECOVER)
    failed = request_fail("upstream_5xx")
    walk.feed(failed, state=State.SUSPECT, request_failures=1, last_error="upstream_5xx")
    walk.feed(failed, request_failures=2)
    walk.feed(failed, state=State.DEAD, request_failures=3, condemned_by="upstream_5xx")
    walk.feed(good_from(None), request_failures=0, good_streak=1, last_ok_at=walk.now + 10.0)
    t = walk.feed(
        good_from(None),
        state=State.STALE,
        good_streak=0,
        in_place_recoveries=1,
        last_ok_at=walk.now + 10.0,
    )
    assert "in-place recovery 1 of 3" in t.reason
    walk.feed(readmit(), state=State.HEALTHY, condemned_by=None, last_ok_at=walk.now + 10.0)
    # Only an answer is proof then: a read alone shows nothing of an unknown process.
    ledger = one_backend(RECOVER)
    for now in (1.0, 2.0, 3.0):
        ledger.apply("a", RequestFailure(now=now, reason="unanswered"))
    t = ledger.apply("a", GoodVerdict(now=4.0, requests_finished=True))
    assert not t.applied and "which process answered is unknown" in t.reason


def test_a_recovery_no_read_identified_does_not_say_it_was_the_same_process() -> None:
    """The audit trail keeps each recovery's reason: of a process no read ever showed,
    answered tiny requests prove only that something answers. Written "same process",
    an operator read the recovery as one whose process had been identified."""
    ledger = one_backend(RECOVER)
    for now in (1.0, 2.0, 3.0):
        ledger.apply("a", RequestFailure(now=now, reason="upstream_5xx", traffic=True))
    first = ledger.apply("a", GoodVerdict(now=4.0, request_ok=True))
    back = ledger.apply("a", GoodVerdict(now=5.0, request_ok=True))
    assert back.applied and ledger.state_of("a") is State.STALE
    for t in (first, back):
        assert "same process" not in t.reason
    assert first.reason == "1 of 2 good verdicts in a row answered, no read showing which process"
    assert back.reason.startswith("process never read, back after 2 s: in-place recovery 1 of 3")


CALLERS_WORD = pytest.mark.parametrize(
    "word",
    [
        lambda now: ProcessGone(now=now, reason="process gone", detail="ActorDiedError"),
        lambda now: Condemned(now=now, reason="silent participant", detail="no NCCL join"),
    ],
    ids=["process gone", "silent participant"],
)


@CALLERS_WORD
def test_a_process_condemned_on_its_callers_word_never_recovers_in_place(
    word: Callable[[float], Event],
) -> None:
    # The same process answering again was let back to STALE within two probes: an
    # orphaned server outliving its actor, or the participant that had just hung the
    # weight sync, which a STALE backend joins again.
    ledger = one_backend(RECOVER)
    ledger.apply("a", GoodVerdict(now=1.0, request_ok=True, process=seen()))
    assert ledger.apply("a", word(2.0)).to_state is State.DEAD
    for now in range(3, 13):
        t = ledger.apply("a", GoodVerdict(now=float(now), request_ok=True, process=seen()))
        assert not t.applied and "condemned on its caller's word" in t.reason
    # It survives the state file, and ends with the process: a new one comes back.
    again = Ledger.from_dict(json.loads(json.dumps(ledger.to_dict())), RECOVER)
    t = again.apply("a", GoodVerdict(now=13.0, request_ok=True, process=seen()))
    assert not t.applied and "condemned on its caller's word" in t.reason
    assert again.apply("a", NewProcessUp(now=14.0, process=seen(start=2000.0))).applied
    # Unset, the key is not written: an earlier build refuses keys it does not know.
    assert "caller_condemned" not in again.to_dict()["backends"][0]  # type: ignore[index]
    again.apply("a", Readmitted(now=15.0))
    for now in (16.0, 17.0, 18.0):
        again.apply("a", ProbeFailure(now=now, reason="unresponsive", detail="no answer"))
    assert again.state_of("a") is State.DEAD
    for now in (19.0, 20.0):
        t = again.apply("a", GoodVerdict(now=now, request_ok=True, process=seen(start=2000.0)))
    assert t.to_state is State.STALE, t.reason


@CALLERS_WORD
def test_a_callers_word_on_a_backend_already_dead_by_doubt_still_holds(
    word: Callable[[float], Event],
) -> None:
    # Condemned by doubt first (three unanswered reads), then the caller says its actor
    # died: the word was ignored as "already absent", so two good probes of the same
    # process brought back what the caller had just written off.
    ledger = one_backend(RECOVER)
    ledger.apply("a", GoodVerdict(now=1.0, request_ok=True, process=seen()))
    for now in (2.0, 3.0, 4.0):
        ledger.apply("a", ProbeFailure(now=now, reason="unresponsive", detail="no answer"))
    assert ledger.state_of("a") is State.DEAD
    epoch = ledger.epoch
    t = ledger.apply("a", word(5.0))
    assert t.applied and t.to_state is State.DEAD and not t.epoch_changed, t.reason
    assert ledger.epoch == epoch
    # Why it was condemned first stays: the restart policy's reason is that one.
    assert ledger.snapshot("a", 5.0).condemned_by == "unresponsive"
    for now in range(6, 12):
        t = ledger.apply("a", GoodVerdict(now=float(now), request_ok=True, process=seen()))
        assert not t.applied and "condemned on its caller's word" in t.reason
    # Said twice, it is what the first time made it: nothing more to record.
    t = ledger.apply("a", word(12.0))
    assert not t.applied and "already absent" in t.reason


def test_a_pending_restart_is_left_to_decide() -> None:
    walk = Walk(RECOVER)
    condemned_by_probes(walk)
    for _ in range(4):
        t = walk.ignore(good_from(seen(), request_ok=True, restart_pending=True))
        assert t.reason == (
            "good_verdict refused in dead: a restart is pending: the restart decides, "
            "not this process"
        )
    t = walk.ignore(lambda now: RequestSuccess(now=now, process=seen(), restart_pending=True))
    assert "a restart is pending" in t.reason


def recover_once(walk: Walk, verdicts: int) -> Transition:
    """Condemn by probes, then feed good verdicts from the same process until STALE."""
    condemned = walk.expected
    condemned_by_probes(walk)
    for _ in range(verdicts - 1):
        t = walk.ledger.apply("a", GoodVerdict(now=walk.now, request_ok=True, process=seen()))
        assert t.applied and t.to_state is State.DEAD
    t = walk.ledger.apply("a", GoodVerdict(now=walk.now, request_ok=True, process=seen()))
    assert t.to_state is State.STALE, t.reason
    walk.ledger.apply("a", Readmitted(now=walk.now))
    walk.expected = walk.ledger.snapshot("a", walk.now)
    assert condemned.state is State.HEALTHY
    return t


def test_each_recovery_in_the_window_doubles_the_good_time_and_past_the_cap_it_stays_dead() -> None:
    walk = Walk(RECOVER)
    assert "recovery 1 of 3" in recover_once(walk, 2).reason
    t = recover_once(walk, 4)
    assert "recovery 2 of 3" in t.reason
    t = recover_once(walk, 8)
    assert "recovery 3 of 3 allowed in 24h; the last: condemned again, it stays DEAD" in t.reason
    assert walk.ledger.snapshot("a", walk.now).in_place_recoveries == 3
    condemned_by_probes(walk)
    for _ in range(20):
        t = walk.ignore(good_from(seen(), request_ok=True))
        assert t.reason == (
            "good_verdict refused in dead: 3 in-place recoveries in 24h "
            "(max_in_place_recoveries 3): it stays DEAD for an operator"
        )


def test_recoveries_older_than_the_window_stop_counting() -> None:
    walk = Walk(LedgerPolicy(recover_in_place=True, restart_budget_window=1000.0))
    recover_once(walk, 2)
    first = walk.now
    walk.now += 500.0
    recover_once(walk, 4)
    second = walk.now
    walk.now = first + 1000.0
    walk.expected = walk.ledger.snapshot("a", walk.now)
    assert walk.expected.in_place_recoveries == 1
    recover_once(walk, 4)  # one recovery in the window: twice the base again, not four times
    walk.now = max(second, walk.now) + 1000.0
    walk.expected = walk.ledger.snapshot("a", walk.now)
    assert walk.expected.in_place_recoveries == 0
    recover_once(walk, 2)


def test_a_cap_of_zero_never_recovers_in_place() -> None:
    walk = Walk(LedgerPolicy(recover_in_place=True, max_in_place_recoveries=0))
    condemned_by_probes(walk)
    t = walk.ignore(good_from(seen(), request_ok=True))
    assert "it stays DEAD for an operator" in t.reason


def test_an_operator_reset_clears_the_in_place_recoveries() -> None:
    walk = Walk(RECOVER)
    recover_once(walk, 2)
    walk.ledger.apply("a", Retire(now=walk.now, reason="operator"))
    t = walk.ledger.apply("a", OperatorReset(now=walk.now))
    assert "in-place recoveries cleared" in t.reason
    assert walk.ledger.snapshot("a", walk.now).in_place_recoveries == 0


def test_the_condemned_process_and_recoveries_survive_a_round_trip_and_old_files_load() -> None:
    walk = Walk(RECOVER)
    recover_once(walk, 2)
    condemned_by_probes(walk, seen(start=77.5, steps=3.0))
    data = walk.ledger.to_dict()
    again = Ledger.from_dict(json.loads(json.dumps(data)), RECOVER)
    assert again.to_dict() == data
    refused = again.apply("a", GoodVerdict(now=walk.now, process=seen(start=1000.0)))
    assert "start time 77.50 -> 1000.00" in refused.reason
    # A state file from before recovery in place has neither key: nothing known, none done.
    for backend in data["backends"]:  # type: ignore[attr-defined]
        del backend["process"], backend["recovery_times"]
    old = Ledger.from_dict(data, RECOVER)
    assert old.snapshot("a", walk.now).in_place_recoveries == 0
    assert "unknown" in old.apply("a", GoodVerdict(now=walk.now, process=seen())).reason


@pytest.mark.parametrize(
    ("process", "message"),
    [
        ({"start": "x", "counters": {}}, r"process.start: expected a finite number"),
        ({"start": 1.0}, r"process: missing key 'counters'"),
        ({"start": 1.0, "counters": []}, r"process.counters: expected an object"),
        ({"start": 1.0, "counters": {"steps": None}}, r"process.counters.steps"),
    ],
)
def test_a_damaged_condemned_process_is_a_value_error(process: object, message: str) -> None:
    data: Any = busy_ledger().to_dict()
    data["backends"][0]["process"] = process
    with pytest.raises(ValueError, match=message):
        Ledger.from_dict(data, POLICY)


@settings(max_examples=200, deadline=None)
@given(
    condemned_start=st.floats(0.0, 1e9, allow_nan=False),
    later=st.lists(
        st.tuples(
            st.sampled_from(["good", "success", "probe_fail", "request_fail", "wedge"]),
            st.floats(0.0, 1e9, allow_nan=False),
            st.booleans(),
            st.floats(0.0, 1e6, allow_nan=False),
        ),
        max_size=40,
    ),
    how=st.sampled_from(["probes", "requests", "wedge"]),
    healthy_threshold=st.integers(1, 3),
)
def test_a_backend_whose_start_time_changed_never_recovers_in_place(
    condemned_start: float,
    later: list[tuple[str, float, bool, float]],
    how: str,
    healthy_threshold: int,
) -> None:
    policy = LedgerPolicy(recover_in_place=True, healthy_threshold=healthy_threshold)
    ledger = one_backend(policy)
    condemned = ProcessSeen(start=condemned_start, counters={"steps": 10.0})
    ledger.apply("a", GoodVerdict(now=1.0, process=condemned))
    for i in range(policy.unhealthy_threshold):
        if how == "probes":
            ledger.apply("a", ProbeFailure(now=2.0 + i, reason="unresponsive"))
        elif how == "requests":
            ledger.apply("a", RequestFailure(now=2.0 + i, reason="unanswered", process=condemned))
        else:
            ledger.apply("a", WedgeProven(now=2.0 + i, process=condemned))
    assert ledger.state_of("a") is State.DEAD
    now = 10.0
    for kind, start, flag, steps in later:
        now += 5.0
        # Any start time but the condemned one: another process, whatever its counters.
        other = ProcessSeen(
            start=start if start != condemned_start else start + 1.0, counters={"steps": steps}
        )
        event: Event
        if kind == "good":
            event = GoodVerdict(now=now, request_ok=flag, requests_finished=flag, process=other)
        elif kind == "success":
            event = RequestSuccess(now=now, process=other if flag else None)
        elif kind == "probe_fail":
            event = ProbeFailure(now=now, reason="stalled", process=other)
        elif kind == "request_fail":
            event = RequestFailure(now=now, reason="unanswered", process=other if flag else None)
        else:
            event = WedgeProven(now=now, process=other)
        t = ledger.apply("a", event)
        assert ledger.state_of("a") is State.DEAD, t.reason
        assert ledger.snapshot("a", now).in_place_recoveries == 0


# --- fleet views ---------------------------------------------------------------------------


def three_backends(policy: LedgerPolicy = POLICY) -> Ledger:
    return Ledger(policy, [("b", URL_B), ("a", URL_A), ("c", URL_C)], now=0.0)


def test_views_sort_by_name_and_count_every_state() -> None:
    ledger = three_backends()
    ledger.apply("b", ProbeFailure(now=1.0, reason="stalled"))
    ledger.apply("c", WedgeProven(now=1.0))
    assert ledger.names == ("a", "b", "c")
    assert ledger.serving == ("a", "b")
    assert ledger.suspected == ("b",)
    assert ledger.absent == ("c",)
    assert ledger.counts == {
        State.HEALTHY: 1,
        State.SUSPECT: 1,
        State.DEAD: 1,
        State.RESTARTING: 0,
        State.STALE: 0,
        State.RETIRED: 0,
    }
    assert ledger.metrics == {
        "backends": 3,
        "serving": 2,
        "absent": 1,
        "epoch": 1,
        "floor_breached": 0,
        "healthy": 1,
        "suspect": 1,
        "dead": 1,
        "restarting": 0,
        "stale": 0,
        "retired": 0,
    }
    assert [s.name for s in ledger.snapshots(1.0)] == ["a", "b", "c"]
    assert ledger.snapshots(1.0, frozenset({State.DEAD, State.SUSPECT})) == [
        s for s in ledger.snapshots(1.0) if s.state in (State.DEAD, State.SUSPECT)
    ]
    assert [ledger.url_of(s.name) for s in ledger.snapshots(1.0)] == [
        s.url for s in ledger.snapshots(1.0)
    ]


def test_the_floor_is_breached_below_min_healthy_and_the_message_names_every_cause() -> None:
    ledger = Ledger(LedgerPolicy(min_healthy=2), [("a", URL_A), ("b", URL_B)], now=0.0)
    assert not ledger.floor_breached
    ledger.apply("a", ProcessGone(now=1.0, reason="down", detail="connection refused"))
    assert ledger.floor_breached
    assert ledger.floor_message == (
        "floor breached: 1 of 2 backends serving, min_healthy is 2: "
        "a dead (last error: down: connection refused); b healthy"
    )
    assert ledger.metrics["floor_breached"] == 1


def test_a_fleet_of_no_backends_has_no_floor_to_breach() -> None:
    # A run over proxies alone: its summary said "floor breached: 0 of 0 backends
    # serving" beside floor_breached false.
    ledger = Ledger(POLICY)
    assert not ledger.floor_breached
    assert ledger.floor_message == (
        "0 of 0 backends serving, min_healthy is 1: no backends configured"
    )
    assert ledger.metrics["floor_breached"] == 0


def test_a_floor_of_zero_is_never_breached() -> None:
    ledger = Ledger(LedgerPolicy(min_healthy=0))
    assert not ledger.floor_breached
    assert not ledger.floor_message.startswith("floor breached")


def test_a_backend_is_found_by_url_with_or_without_a_trailing_slash() -> None:
    ledger = three_backends()
    assert ledger.by_url(URL_B) == "b"
    assert ledger.by_url(URL_B + "/") == "b"
    assert ledger.by_url("http://elsewhere:8000") is None


def test_an_unknown_backend_name_is_a_typed_error() -> None:
    ledger = one_backend()
    with pytest.raises(UnknownBackend, match="'zz'"):
        ledger.apply("zz", RequestSuccess(now=1.0))
    with pytest.raises(UnknownBackend):
        ledger.remove("zz")
    with pytest.raises(UnknownBackend):
        ledger.snapshot("zz", 1.0)


def test_something_that_is_not_an_event_is_refused() -> None:
    with pytest.raises(TypeError):
        one_backend().apply("a", "good")  # type: ignore[arg-type]


def test_adding_a_backend_makes_it_healthy_and_moves_the_epoch() -> None:
    ledger = one_backend()
    ledger.add("b", URL_B, now=5.0)
    assert ledger.epoch == 1
    assert ledger.serving == ("a", "b")
    assert ledger.snapshot("b", 5.0) == replace(fresh(5.0), name="b", url=URL_B)


def test_adding_a_backend_retired_keeps_it_out_and_the_epoch_still() -> None:
    """A retirement that outlived a config edit: the backend joins outside the serving
    set, so the serving set and its epoch do not change, and its address is no one's."""
    ledger = one_backend()
    ledger.add("b", URL_B, now=5.0, retired_because="retired before it left the config")
    assert ledger.epoch == 0
    assert ledger.serving == ("a",)
    assert ledger.snapshot("b", 5.0) == replace(
        fresh(5.0),
        name="b",
        url=URL_B,
        state=State.RETIRED,
        last_error="retired: retired before it left the config",
    )
    assert ledger.apply("b", OperatorReset(now=6.0)).to_state is State.STALE


def test_removing_moves_the_epoch_only_when_the_backend_was_serving() -> None:
    ledger = three_backends()
    ledger.apply("c", WedgeProven(now=1.0))
    assert ledger.epoch == 1
    ledger.remove("c")
    assert ledger.epoch == 1
    ledger.remove("b")
    assert ledger.epoch == 2
    assert ledger.names == ("a",)
    assert "a" in ledger and "b" not in ledger and "c" not in ledger


@pytest.mark.parametrize(
    ("name", "url", "message"),
    [
        ("a", URL_B, "name 'a' appears twice"),
        ("b", URL_A + "/", "share the URL"),
        ("", URL_B, "non-empty string"),
        ("b", "", "non-empty URL"),
    ],
)
def test_adding_a_duplicate_or_empty_backend_is_refused(name: str, url: str, message: str) -> None:
    ledger = one_backend()
    before = ledger.to_dict()
    with pytest.raises(ValueError, match=message):
        ledger.add(name, url, now=1.0)
    assert ledger.to_dict() == before


def test_a_time_that_is_not_a_finite_number_is_refused_when_adding() -> None:
    with pytest.raises(ValueError, match="now: expected a finite number"):
        one_backend().add("b", URL_B, now=float("nan"))
    with pytest.raises(ValueError, match="now: expected a finite number"):
        Ledger(POLICY, [("a", URL_A)], now=float("inf"))


def test_a_ledger_built_without_a_time_does_not_invent_one() -> None:
    ledger = Ledger(POLICY, [("a", URL_A)])
    assert ledger.snapshot("a", 0.0).state_since is None


# --- policy and event validation -------------------------------------------------------


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("unhealthy_threshold", 0),
        ("healthy_threshold", 0),
        ("healthy_threshold", -1),
        ("restart_budget", 0),
        ("min_healthy", -1),
        ("restart_budget_window", 0.0),
        ("restart_budget_window", -5.0),
        ("startup_grace", 0),
        ("startup_grace", float("nan")),
        ("startup_grace", float("inf")),
        ("unhealthy_threshold", 2.5),
        ("unhealthy_threshold", True),
        ("startup_grace", "15m"),
        ("max_in_place_recoveries", -1),
        ("recover_in_place", "yes"),
    ],
)
def test_a_policy_out_of_range_is_refused_naming_the_field_and_value(
    field: str, value: object
) -> None:
    with pytest.raises(ValueError, match=field) as info:
        LedgerPolicy(**{field: value})  # type: ignore[arg-type]
    assert repr(value) in str(info.value) or str(value) in str(info.value)


def test_the_default_policy_matches_the_design() -> None:
    assert LedgerPolicy() == LedgerPolicy(
        unhealthy_threshold=3,
        healthy_threshold=2,
        min_healthy=1,
        restart_budget=5,
        restart_budget_window=86400.0,
        startup_grace=900.0,
        # Seed 000's semantics unless asked: a DEAD backend never comes back in place.
        recover_in_place=False,
        max_in_place_recoveries=3,
    )


@pytest.mark.parametrize("now", [float("nan"), float("inf"), "12", None])
def test_an_event_without_a_finite_time_is_refused(now: object) -> None:
    with pytest.raises(ValueError, match="now must be a finite number"):
        RequestSuccess(now=now)  # type: ignore[arg-type]


def test_a_weight_version_must_be_an_integer() -> None:
    with pytest.raises(ValueError, match="weight_version"):
        Readmitted(now=1.0, weight_version="7")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "version", [2**63, -(2**63), 10**5000], ids=["2**63", "-2**63", "10**5000"]
)
def test_a_weight_version_past_64_bits_is_refused_before_anything_is_recorded(
    version: int,
) -> None:
    """10**5000 cannot be written as decimal text (Python's 4,300-digit limit): the ledger
    took it, then raised while describing what it had recorded."""
    ledger = three_backends()
    before = ledger.to_dict()
    for event in (
        lambda: WeightsStamped(now=1.0, weight_version=version),
        lambda: Readmitted(now=1.0, weight_version=version),
    ):
        with pytest.raises(ValueError, match="64 bits"):
            ledger.apply("a", event())
    assert ledger.to_dict() == before
    assert WeightsStamped(now=1.0, weight_version=2**63 - 1).weight_version == 2**63 - 1


def test_a_saved_weight_version_past_64_bits_still_loads() -> None:
    """A build before the 64-bit bound saved any integer `readmit --weight-version` took:
    refused on load, the whole record was set aside, its holds and retirements lost."""
    ledger = three_backends()
    record: Any = ledger.to_dict()
    record["backends"][0]["weight_version"] = 2**64
    loaded = Ledger.from_dict(json.loads(json.dumps(record)), POLICY)
    assert loaded.to_dict() == record


# --- persistence ---------------------------------------------------------------------------


def busy_ledger() -> Ledger:
    ledger = three_backends()
    ledger.apply("a", ProbeFailure(now=1.0, reason="stalled", detail="no step in 5s"))
    ledger.apply("b", WedgeProven(now=2.0, evidence="e"))
    ledger.apply("b", RestartIssued(now=3.0))
    ledger.apply("c", UnplannedRestart(now=4.0))
    ledger.apply("c", Readmitted(now=5.0, weight_version=12))
    return ledger


def test_to_dict_is_plain_json_and_round_trips() -> None:
    ledger = busy_ledger()
    data = ledger.to_dict()
    assert data["schema"] == SCHEMA
    text = json.dumps(data)
    again = Ledger.from_dict(json.loads(text), POLICY)
    assert again.to_dict() == data
    assert again.snapshots(6.0) == ledger.snapshots(6.0)
    assert again.epoch == ledger.epoch


def _break(path: list[Any], value: Any) -> dict[str, Any]:
    data: dict[str, Any] = copy.deepcopy(busy_ledger().to_dict())
    target: Any = data
    for key in path[:-1]:
        target = target[key]
    if value is _DELETE:
        del target[path[-1]]
    else:
        target[path[-1]] = value
    return data


_DELETE = object()


@pytest.mark.parametrize(
    ("path", "value", "message"),
    [
        (["schema"], 2, "schema: expected 1, got 2"),
        (["schema"], _DELETE, "missing key 'schema'"),
        (["extra"], 1, None),  # a key a later build added is passed over
        (["epoch"], -1, "epoch: must be from 0 to 2"),
        (["epoch"], 10**400, "epoch: must be from 0 to 2"),  # /metrics raised OverflowError
        (["backends", 0, "probe_failures"], 2**53 + 1, "probe_failures: must be from 0"),
        (["epoch"], "3", "epoch: expected an integer"),
        (["backends"], {}, "backends: expected a list"),
        (["backends", 0], "a", r"backends\[0\]: expected an object"),
        (["backends", 1, "state"], "zombie", r"backends\[1\].state: 'zombie' is not a state"),
        (["backends", 1, "state"], ["dead"], "is not a state"),
        (["backends", 0, "probe_failures"], True, "probe_failures: expected an integer"),
        (["backends", 0, "restart_times"], [1.0, "x"], r"restart_times\[1\]"),
        (["backends", 0, "restart_times"], None, "restart_times: expected a list"),
        (["backends", 0, "last_ok_at"], float("nan"), "last_ok_at: expected a finite number"),
        (["backends", 0, "name"], 7, "name: expected a string"),
        (["backends", 0, "name"], "b", "appears twice"),
        (["backends", 0, "url"], URL_B, "share the URL"),
        (["backends", 0, "weight_version"], 1.5, "weight_version"),
        (["backends", 0, "condemned_by"], 3, "condemned_by: expected a string"),
        (["backends", 2, "state"], "healthy", None),
        (["backends", 1, "state_since"], None, "restarting backend needs"),
        (["backends", 0, "color"], "red", None),  # likewise
    ],
)
def test_from_dict_refuses_malformed_data_saying_what_is_wrong(
    path: list[Any], value: Any, message: str | None
) -> None:
    data = _break(path, value)
    if message is None:
        Ledger.from_dict(data, POLICY)  # a legal edit is still accepted
        return
    with pytest.raises(ValueError, match=message):
        Ledger.from_dict(data, POLICY)


def test_from_dict_refuses_a_healthy_backend_with_a_failure_streak() -> None:
    data = _break(["backends", 2, "request_failures"], 1)
    with pytest.raises(ValueError, match="healthy backend cannot have a failure streak"):
        Ledger.from_dict(data, POLICY)


@pytest.mark.parametrize("data", [None, [], "ledger", 3, {"schema": 1}])
def test_from_dict_refuses_what_is_not_a_ledger(data: object) -> None:
    with pytest.raises(ValueError, match="ledger"):
        Ledger.from_dict(data, POLICY)


# --- the weight-sync events and caller judgements -----------------------------------------


def test_a_partial_sync_makes_a_serving_backend_stale_and_remembers_what_it_was() -> None:
    ledger = three_backends()
    ledger.apply("a", ProbeFailure(now=1.0, reason="stalled"))
    for name in ("a", "b"):
        t = ledger.apply(name, WeightsPartial(now=2.0))
        assert (t.applied, t.to_state, t.epoch_changed) == (True, State.STALE, True)
    assert ledger.snapshot("a", 2.0).state_before_partial is State.SUSPECT
    assert ledger.snapshot("b", 2.0).state_before_partial is State.HEALTHY
    assert ledger.suspected == ("a",)
    # Re-admission settles the doubt about the weights, not about the process: "a" is
    # SUSPECT again, "b" HEALTHY, and neither remembers the sync any more.
    ledger.apply("a", Readmitted(now=3.0, weight_version=4))
    ledger.apply("b", Readmitted(now=3.0, weight_version=4))
    assert [ledger.state_of(name) for name in ("a", "b")] == [State.SUSPECT, State.HEALTHY]
    assert ledger.snapshot("a", 3.0).state_before_partial is None
    assert ledger.suspected == ("a",)


def test_a_refit_does_not_clear_the_failures_of_a_backend_suspect_before_the_sync() -> None:
    """Before, re-admission zeroed the request-failure streak of a backend marked partial
    while SUSPECT: a shard failing real requests, refit after refit, never condemned."""
    policy = replace(POLICY, unhealthy_threshold=3)
    ledger = Ledger(policy, [("a", "http://a:8000")], now=0.0)
    for t in (1.0, 2.0):
        ledger.apply("a", RequestFailure(now=t, reason="unanswered"))
    ledger.apply("a", WeightsPartial(now=3.0))
    back = ledger.apply("a", Readmitted(now=4.0, weight_version=7))
    assert (back.to_state, back.epoch_changed) == (State.SUSPECT, True)
    assert "2 request and 0 probe failure(s) kept" in back.reason
    snap = ledger.snapshot("a", 4.0)
    assert (snap.request_failures, snap.weight_version) == (2, 7)
    third = ledger.apply("a", RequestFailure(now=5.0, reason="unanswered"))
    assert third.to_state is State.DEAD


def test_failures_while_the_weights_are_in_doubt_do_not_count_against_the_refit() -> None:
    # A refit in progress fails probes and aborted requests; counted, they came back with
    # the backend, and its first failure after the refit condemned it at once.
    policy = replace(POLICY, unhealthy_threshold=3)
    ledger = Ledger(policy, [("a", "http://a:8000")], now=0.0)
    ledger.apply("a", RequestFailure(now=1.0, reason="unanswered"))
    ledger.apply("a", WeightsPartial(now=2.0))
    for t in (3.0, 4.0, 5.0):
        noted = ledger.apply("a", ProbeFailure(now=t, reason="down"))
        assert noted.reason.endswith("not counted while its weights are in doubt")
        ledger.apply("a", RequestFailure(now=t, reason="unanswered"))
    ledger.apply("a", Readmitted(now=6.0, weight_version=2))
    snap = ledger.snapshot("a", 6.0)
    assert (snap.state, snap.request_failures, snap.probe_failures) == (State.SUSPECT, 1, 0)
    assert ledger.apply("a", RequestFailure(now=7.0, reason="unanswered")).to_state is (
        State.SUSPECT
    )


def test_a_weight_stamp_changes_the_version_and_nothing_else() -> None:
    ledger = one_backend()
    ledger.apply("a", RequestFailure(now=1.0, reason="unanswered"))
    before = ledger.snapshot("a", 2.0)
    t = ledger.apply("a", WeightsStamped(now=2.0, weight_version=9))
    assert t.applied and t.from_state is t.to_state is State.SUSPECT
    assert ledger.snapshot("a", 2.0) == replace(before, weight_version=9)


def test_a_condemned_stale_backend_is_dead_with_the_reason() -> None:
    ledger = ledger_in(State.STALE)
    t = ledger.apply("a", Condemned(now=5.0, reason="silent participant", detail="refit 3"))
    assert t.applied and t.to_state is State.DEAD
    snap = ledger.snapshot("a", 5.0)
    assert snap.last_error == "silent participant: refit 3"
    assert snap.condemned_by == "silent participant"


def test_a_replacement_on_a_new_address_moves_the_backend_url() -> None:
    ledger = ledger_in(State.RESTARTING)
    t = ledger.apply("a", NewProcessUp(now=3.0, url="http://10.0.0.5:9001"))
    assert t.applied and t.to_state is State.STALE
    assert ledger.snapshot("a", 3.0).url == "http://10.0.0.5:9001"
    assert ledger.by_url("http://10.0.0.5:9001") == "a"
    assert ledger.by_url(URL_A) is None


def test_a_url_with_a_password_is_never_stored_in_the_ledger() -> None:
    ledger = ledger_in(State.RESTARTING)
    before = ledger.to_dict()
    with pytest.raises(ValueError, match="user name or password") as moved:
        ledger.apply("a", NewProcessUp(now=3.0, url="http://root:s3cret@10.0.0.5:9001"))
    with pytest.raises(ValueError, match="user name or password") as added:
        ledger.add("b", "http://root:s3cret@10.0.0.6:8000", now=3.0)
    with pytest.raises(ValueError, match="user name or password") as built:
        Ledger(POLICY, [("c", "http://root:s3cret@10.0.0.7:8000")], now=0.0)
    assert ledger.to_dict() == before
    for refused in (moved, added, built):
        assert "s3cret" not in str(refused.value) and "root" not in str(refused.value)


def test_a_replacement_cannot_take_another_backends_address_and_nothing_changes() -> None:
    ledger = three_backends()
    ledger.apply("a", WedgeProven(now=1.0))
    before = ledger.to_dict()
    with pytest.raises(ValueError, match="backend 'b' is there"):
        ledger.apply("a", NewProcessUp(now=2.0, url=URL_B + "/"))
    assert ledger.to_dict() == before


def test_a_replacement_may_take_a_retired_backends_address_and_the_retired_one_keeps_it() -> None:
    """A RETIRED backend is out for good; a replacement bound where its process was (the
    port is free again) was refused, leaving the trainer to publish a dead address. The
    retired one comes back only through a reset, refused while another holds its address."""
    ledger = three_backends()
    ledger.apply("b", Retire(now=1.0, reason="bad GPU"))
    ledger.apply("a", WedgeProven(now=1.0))
    ledger.apply("a", RestartIssued(now=2.0))
    moved = ledger.apply("a", NewProcessUp(now=3.0, url=URL_B))
    assert moved.applied and moved.to_state is State.STALE
    assert ledger.by_url(URL_B) == "a" and ledger.by_url(URL_A) is None
    assert ledger.snapshot("b", 3.0).url == URL_B  # what it was, as it was retired
    again = Ledger.from_dict(ledger.to_dict(), POLICY)
    assert again.to_dict() == ledger.to_dict() and again.by_url(URL_B) == "a"
    refused = ledger.apply("b", OperatorReset(now=4.0))
    assert not refused.applied and "now belongs to backend 'a'" in refused.reason
    ledger.readdress({"a": URL_A})  # the taker moves on
    assert ledger.apply("b", OperatorReset(now=6.0)).applied
    assert ledger.by_url(URL_B) == "b"


def test_a_record_saved_with_one_server_written_two_ways_still_loads() -> None:
    """Saved before URLs compared case-blind: refused on load, the whole record (every
    retirement, budget and proof) was set aside as corrupt. The first keeps the lookup;
    the config, which refuses the two, decides which stays."""
    ledger = Ledger(POLICY, [("a", "http://gpu-host:9"), ("b", URL_B)], now=0.0)
    data: Any = ledger.to_dict()
    data["backends"][1]["url"] = "http://GPU-HOST:9/"
    loaded = Ledger.from_dict(data, POLICY)
    assert loaded.by_url("http://Gpu-Host:9") == "a"
    assert loaded.snapshot("b", 0.0).url == "http://GPU-HOST:9/"
    loaded.remove("a")
    # The one left at that server takes the lookup: failures a router reports by URL
    # reached no backend while it had none.
    assert loaded.by_url("http://gpu-host:9") == "b"
    with pytest.raises(ValueError, match="share the URL"):
        Ledger(POLICY, [("a", "http://gpu-host:9"), ("b", "http://GPU-HOST:9")], now=0.0)
    # A RETIRED first holder gives the lookup up to one that may be sent work, and so
    # cannot be reset onto it: two serving backends on one server.
    ledger.apply("a", Retire(now=1.0, reason="bad GPU"))
    data = ledger.to_dict()
    data["backends"][1]["url"] = "http://GPU-HOST:9/"
    loaded = Ledger.from_dict(data, POLICY)
    assert loaded.by_url("http://gpu-host:9") == "b"
    assert not loaded.apply("a", OperatorReset(now=2.0)).applied


def test_a_state_file_written_before_partial_syncs_existed_still_loads() -> None:
    data: Any = one_backend().to_dict()
    for backend in data["backends"]:
        del backend["state_before_partial"]
    assert Ledger.from_dict(data, POLICY).snapshot("a", 0.0).state_before_partial is None


def test_a_remembered_state_on_a_backend_that_is_not_stale_is_refused_on_load() -> None:
    data: Any = one_backend().to_dict()
    data["backends"][0]["state_before_partial"] = "suspect"
    with pytest.raises(ValueError, match="state_before_partial"):
        Ledger.from_dict(data, POLICY)


# --- purity --------------------------------------------------------------------------------


def test_the_ledger_imports_nothing_that_does_io_or_reads_a_clock() -> None:
    source = Path(ledger_module.__file__).read_text(encoding="utf-8")
    imported: set[str] = set()
    called: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            imported.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            imported.add(node.module.split(".")[0])
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
            called.add(node.func.id)
    forbidden = {"httpx", "time", "subprocess", "socket", "os", "pathlib", "rich", "datetime"}
    assert imported & forbidden == set()
    assert {"open", "print", "input"} & called == set()


# --- properties over random event sequences -------------------------------------------


NAMES = ("a", "b", "c")
ALL_KINDS: list[EventKind | str] = [*EventKind, "expire"]

# Each step: backend, which event, whether to draw it from the events that apply in the
# backend's current state (so walks get deep: restart, new process, re-admission, budget)
# or from all of them (so ignored events keep being tried), time passing, and a flag.
_step = st.tuples(
    st.sampled_from(NAMES),
    st.integers(0, 1000),
    st.booleans(),
    st.floats(min_value=0.0, max_value=60.0, allow_nan=False),
    st.booleans(),
)
# Length drawn first: plain st.lists averages a handful of steps, too few to reach a spent
# restart budget on one backend.
steps = st.integers(0, 80).flatmap(lambda n: st.lists(_step, min_size=n, max_size=n))
Step = tuple[str, int, bool, float, bool]


def choose(ledger: Ledger, name: str, pick: int, legal: bool) -> EventKind | str:
    kinds = [*TRANSITIONS[ledger.state_of(name)], "expire"] if legal else ALL_KINDS
    return kinds[pick % len(kinds)]


policies = st.builds(
    LedgerPolicy,
    recover_in_place=st.booleans(),
    max_in_place_recoveries=st.integers(0, 2),
    unhealthy_threshold=st.integers(1, 3),
    healthy_threshold=st.integers(1, 3),
    min_healthy=st.integers(0, 3),
    restart_budget=st.integers(1, 3),
    restart_budget_window=st.sampled_from([50.0, 400.0]),
    startup_grace=st.sampled_from([20.0, 150.0]),
)


def check_transition(
    t: Transition,
    before: Ledger,
    before_dict: dict[str, object],
    after: Ledger,
    now: float,
    event: Event,
) -> None:
    snap_before = before.snapshot(t.name, now)
    snap_after = after.snapshot(t.name, now)
    assert snap_before.state is t.from_state and snap_after.state is t.to_state
    if not t.applied:
        assert t.from_state is t.to_state
        assert after.to_dict() == before_dict
    # Nothing outside the serving set comes back in except STALE through re-admission.
    if t.from_state not in SERVING and t.to_state in SERVING:
        assert (t.from_state, t.kind) == (State.STALE, EventKind.READMITTED)
    if t.to_state is State.HEALTHY and t.from_state is not State.HEALTHY:
        assert t.from_state in {State.SUSPECT, State.STALE}
    # Good probes never resurrect. Outside the serving set they apply only to a DEAD
    # backend under recover_in_place, and lead at most to STALE.
    if t.kind is EventKind.GOOD_VERDICT and t.from_state not in SERVING and t.applied:
        assert before.policy.recover_in_place and t.from_state is State.DEAD
        assert t.to_state in {State.DEAD, State.STALE}
    # Only the very process that was condemned comes back in place.
    if t.from_state is State.DEAD and t.to_state is State.STALE:
        assert t.kind is EventKind.NEW_PROCESS_UP or (
            isinstance(event, GoodVerdict | RequestSuccess)
            and event.process is not None
            and not event.restart_pending
        )
    # RETIRED stays RETIRED until an operator reset.
    if t.from_state is State.RETIRED and t.kind is not EventKind.OPERATOR_RESET:
        assert t.to_state is State.RETIRED and not t.applied
    # A good verdict without an answered request never clears the request-failure streak.
    if isinstance(event, GoodVerdict) and not event.request_ok:
        assert snap_after.request_failures == snap_before.request_failures
    # A weight stamp is not a transition: only the version moves, never a streak.
    if t.kind is EventKind.WEIGHTS_STAMPED and t.applied:
        assert isinstance(event, WeightsStamped)
        assert snap_after == replace(snap_before, weight_version=event.weight_version)
    # A partial sync remembers the serving state it interrupted.
    if t.kind is EventKind.WEIGHTS_PARTIAL and t.applied:
        assert snap_after.state_before_partial is t.from_state
        assert t.from_state in SERVING
    # The epoch moves by exactly one when the serving set changes, and only then.
    changed = set(before.serving) != set(after.serving)
    assert t.epoch_changed == changed
    assert after.epoch == before.epoch + (1 if changed else 0)


def check_ledger(ledger: Ledger, now: float) -> None:
    for snap in ledger.snapshots(now):
        if snap.state is State.HEALTHY:
            assert snap.probe_failures == snap.request_failures == 0
        if snap.state in SERVING:
            assert snap.condemned_by is None
        if snap.state is not State.STALE:
            assert snap.state_before_partial is None
        assert 0 <= snap.traffic_failures <= snap.request_failures
    assert set(ledger.serving).isdisjoint(ledger.absent)
    assert set(ledger.absent) == {s.name for s in ledger.snapshots(now) if s.state in ABSENT}
    assert sum(ledger.counts.values()) == len(ledger.names)
    assert ledger.floor_breached == (len(ledger.serving) < ledger.policy.min_healthy)
    data = ledger.to_dict()
    again = Ledger.from_dict(json.loads(json.dumps(data)), ledger.policy)
    assert again.to_dict() == data


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(policy=policies, sequence=steps)
@pytest.mark.slow
def test_random_event_sequences_keep_every_invariant(
    policy: LedgerPolicy, sequence: list[Step]
) -> None:
    ledger = Ledger(policy, [(n, f"http://{n}.example:8000") for n in NAMES], now=0.0)
    now = 0.0
    for name, pick, legal, dt, flag in sequence:
        now += dt
        kind = choose(ledger, name, pick, legal)
        before_dict = ledger.to_dict()
        before = Ledger.from_dict(before_dict, policy)
        if kind == "expire":
            transitions = ledger.expire_restarts(now)
            for t in transitions:
                assert t.from_state in (State.RESTARTING, State.STALE)
                assert t.to_state is State.DEAD
            # Several backends may expire in one call; check them one by one on a replay.
            replay = before
            for t in transitions:
                step_before = Ledger.from_dict(replay.to_dict(), policy)
                expired = StartupExpired(now=now)
                replay.apply(t.name, expired)
                check_transition(t, step_before, step_before.to_dict(), replay, now, expired)
            assert replay.to_dict() == ledger.to_dict()

            # The grace counts from the restart, or from its command's exit when later.
            def grace_from(s: BackendSnapshot, issued: float) -> float:
                ran = s.restart_ran_at
                return ran if ran is not None and ran > issued else issued

            assert not any(
                s.state is State.RESTARTING
                and s.state_since is not None
                and now - grace_from(s, s.state_since) >= policy.startup_grace
                for s in ledger.snapshots(now)
            )
            # No restart of ours is left unproven past its grace: a STALE backend still
            # here was re-admitted since its last restart, was never restarted, or was
            # replaced while DEAD once that restart's grace had run out (not ours).
            assert not any(
                s.state is State.STALE
                and s.last_restart_at is not None
                and now - grace_from(s, s.last_restart_at) >= policy.startup_grace
                and (s.last_ok_at is None or s.last_ok_at < s.last_restart_at)
                and s.state_since is not None
                and not (
                    s.replaced_while_dead
                    and s.state_since - grace_from(s, s.last_restart_at) >= policy.startup_grace
                )
                for s in ledger.snapshots(now)
            )
        else:
            event = maker_for(EventKind(kind), flag)(now)
            t = ledger.apply(name, event)
            check_transition(t, before, before_dict, ledger, now, event)
        check_ledger(ledger, now)


@pytest.mark.slow
@settings(max_examples=200, deadline=None)
@given(
    sequence=steps,
    path=st.lists(
        st.sampled_from(
            [
                "schema",
                "epoch",
                "backends",
                0,
                1,
                "state",
                "name",
                "restart_times",
                "last_ok_at",
                "weight_version",
            ]
        ),
        min_size=1,
        max_size=3,
    ),
    value=st.recursive(
        st.none() | st.booleans() | st.integers(-3, 3) | st.floats() | st.text(max_size=5),
        lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=3), inner),
        max_leaves=5,
    ),
)
def test_from_dict_answers_damage_with_a_value_error_or_a_valid_ledger(
    sequence: list[Step], path: list[Any], value: Any
) -> None:
    ledger = three_backends()
    now = 0.0
    for name, pick, legal, dt, flag in sequence:
        now += dt
        kind = choose(ledger, name, pick, legal)
        if kind != "expire":
            ledger.apply(name, maker_for(EventKind(kind), flag)(now))
    data: Any = ledger.to_dict()
    target = data
    for key in path[:-1]:
        try:
            target = target[key]
        except (KeyError, IndexError, TypeError):
            return
    try:
        target[path[-1]] = value
    except (IndexError, TypeError):
        return
    try:
        loaded = Ledger.from_dict(data, POLICY)
    except ValueError:
        return
    assert Ledger.from_dict(loaded.to_dict(), POLICY).to_dict() == loaded.to_dict()


def test_the_tiny_request_clears_no_failure_real_traffic_saw() -> None:
    """A server that answers one token and fails every real request: the router drops it
    after one failure until the settle, it goes idle, the tiny request answers, and the
    streak was cleared at every settle: SUSPECT and back for ever, never condemned."""
    policy = replace(POLICY, unhealthy_threshold=3)
    ledger = Ledger(policy, [("a", URL_A)], now=0.0)
    for cycle in range(3):
        t = float(cycle * 10)
        ledger.apply("a", RequestFailure(now=t, reason="request_failures", traffic=True))
        answered = ledger.apply("a", GoodVerdict(now=t + 5, request_ok=True))
        assert answered.to_state in (State.SUSPECT, State.DEAD)
    assert ledger.state_of("a") is State.DEAD
    # A real request answered clears it, and the tiny one clears its own kind.
    other = Ledger(policy, [("b", URL_B)], now=0.0)
    other.apply("b", RequestFailure(now=1.0, reason="request_failures", traffic=True))
    other.apply("b", RequestSuccess(now=2.0))
    other.apply("b", RequestFailure(now=3.0, reason="unanswered"))
    other.apply("b", GoodVerdict(now=4.0, request_ok=True))
    snap = other.snapshot("b", 4.0)
    assert (snap.request_failures, snap.traffic_failures) == (0, 0)


def test_a_late_stale_spell_saved_before_its_origin_was_kept_stays_exempt() -> None:
    # A state written before `replaced_while_dead`: the times alone decide, as then, and a
    # hand-restarted backend waiting to prove itself was not failed by the upgrade.
    policy = LedgerPolicy(startup_grace=100.0)
    ledger = Ledger(policy, [("a", URL_A)], now=0.0)
    ledger.apply("a", WedgeProven(now=1.0))
    ledger.apply("a", RestartIssued(now=10.0))
    ledger.expire_restarts(110.0)
    ledger.apply("a", NewProcessUp(now=500.0))
    data = ledger.to_dict()
    for backend in data["backends"]:
        del backend["replaced_while_dead"]
    assert Ledger.from_dict(data, policy).overdue(1000.0) == []


def test_a_rename_keeps_the_backend_and_its_address_under_the_new_name() -> None:
    ledger = Ledger(POLICY, [("a", URL_A), ("b", URL_B)], now=0.0)
    ledger.apply("a", WedgeProven(now=1.0))
    epoch = ledger.epoch
    ledger.rename("a", "node-a")
    assert ledger.names == ("b", "node-a") and ledger.by_url(URL_A) == "node-a"
    assert ledger.snapshot("node-a", 2.0).state is State.DEAD and ledger.epoch == epoch
    with pytest.raises(ValueError, match="taken"):
        ledger.rename("node-a", "b")
    with pytest.raises(UnknownBackend):
        ledger.rename("a", "c")


def test_a_backend_condemned_before_any_read_showed_its_process_can_still_recover_in_place() -> (
    None
):
    """Unresponsive from its first sight (or failing real requests before its first read),
    it was condemned with no process known; every read after showed one, and each was
    refused as "which process answered is unknown", so it stayed DEAD for good."""
    walk = Walk(RECOVER)
    unresponsive = probe_fail("unresponsive", "no answer in 5 s")
    walk.feed(
        unresponsive,
        state=State.SUSPECT,
        probe_failures=1,
        last_error="unresponsive: no answer in 5 s",
    )
    walk.feed(unresponsive, probe_failures=2)
    walk.feed(unresponsive, state=State.DEAD, probe_failures=3, condemned_by="unresponsive")
    # The first process to prove itself stands for the one condemned, and is held to it.
    walk.feed(
        good_from(seen(steps=60.0)), probe_failures=0, good_streak=1, last_ok_at=walk.now + 10
    )
    t = walk.ignore(good_from(seen(start=2000.0, steps=1.0)))
    assert "another process" in t.reason
    walk.feed(
        good_from(seen(steps=70.0)),
        state=State.STALE,
        good_streak=0,
        in_place_recoveries=1,
        last_ok_at=walk.now + 10,
    )


def test_good_verdicts_before_a_failed_restart_do_not_count_towards_recovery_in_place() -> None:
    # One good verdict, then a restart: its probe failures are ignored while RESTARTING,
    # so nothing broke the streak; the command failed, and one good verdict after it was
    # taken for the second "in a row" and let the process back to STALE.
    ledger = one_backend(RECOVER)
    old = seen()
    for t in (1.0, 2.0, 3.0):
        ledger.apply("a", ProbeFailure(now=t, reason="stalled", process=old))
    assert ledger.state_of("a") is State.DEAD
    assert ledger.apply("a", GoodVerdict(now=4.0, request_ok=True, process=old)).applied
    assert ledger.apply("a", RestartIssued(now=5.0)).to_state is State.RESTARTING
    for t in (6.0, 7.0, 8.0):
        assert not ledger.apply("a", ProbeFailure(now=t, reason="down")).applied
    assert ledger.apply("a", RestartFailed(now=9.0, reason="exit 1")).to_state is State.DEAD
    assert ledger.snapshot("a", 9.0).good_streak == 0
    t = ledger.apply("a", GoodVerdict(now=10.0, request_ok=True, process=old))
    assert t.to_state is State.DEAD, t.reason
    assert ledger.apply("a", GoodVerdict(now=11.0, request_ok=True, process=old)).to_state is (
        State.STALE
    )


def test_a_replacement_first_seen_without_its_process_is_noted_working_once_a_read_shows_it() -> (
    None
):
    # NewProcessUp without a process (FleetHealth.mark_loaded, or a first read of the
    # replacement without vLLM series) leaves it unknown "until a read shows it": the
    # first read showing requests finishing on it must count, or a busy replacement,
    # never sent the tiny request, is failed at its startup grace and restarted again.
    ledger = one_backend()
    policy = ledger.policy
    replaced = ProcessSeen(start=50.0, counters={"steps": 10.0})
    for event in (
        WedgeProven(now=1.0, process=replaced),
        RestartIssued(now=2.0),
        NewProcessUp(now=60.0),
    ):
        assert ledger.apply("a", event).applied
    # The process the restart replaced, still answering, proves nothing of its replacement.
    t = ledger.apply("a", GoodVerdict(now=65.0, requests_finished=True, process=replaced))
    assert not t.applied
    busy = ProcessSeen(start=90.0, counters={"steps": 400.0})
    t = ledger.apply("a", GoodVerdict(now=70.0, requests_finished=True, process=busy))
    assert t.applied and t.to_state is State.STALE, t.reason
    assert not ledger.restart_unproven("a", 70.0)
    assert ledger.expire_restarts(2.0 + policy.startup_grace + 1) == []
    assert ledger.state_of("a") is State.STALE


def test_our_own_replacement_seen_only_after_the_grace_is_still_failed_by_it() -> None:
    """Late, but from RESTARTING, not replaced while DEAD: the process our restart brought
    up, seen only once its grace had run out (expire_restarts had not been called yet), is
    still ours to fail. Exempted as a hand restart, it stayed STALE for ever: out of
    serving, and never restarted again."""
    ledger = Ledger(LedgerPolicy(startup_grace=100.0), [("a", URL_A)], now=0.0)
    ledger.apply("a", WedgeProven(now=10.0))
    ledger.apply("a", RestartIssued(now=20.0))
    ledger.apply("a", NewProcessUp(now=200.0))  # 180 s after the restart, no expiry between
    snap = ledger.snapshot("a", 200.0)
    assert snap.state is State.STALE and snap.replaced_while_dead is False
    assert ledger.restart_unproven("a", 250.0)
    assert ledger.overdue(250.0) == ["a"]
    [t] = ledger.expire_restarts(250.0)
    assert (t.from_state, t.to_state) == (State.STALE, State.DEAD)


def test_a_good_verdict_at_the_restarts_own_instant_does_not_prove_the_restart() -> None:
    """A settle feeds its verdicts before it restarts, at one ``now``: a good one at the
    restart's very instant came before it, and says nothing of the replacement."""
    ledger = Ledger(LedgerPolicy(startup_grace=100.0), [("a", URL_A)], now=0.0)
    ledger.apply("a", GoodVerdict(now=20.0, request_ok=True))
    ledger.apply("a", WedgeProven(now=20.0))
    ledger.apply("a", RestartIssued(now=20.0))
    ledger.apply("a", NewProcessUp(now=30.0))
    assert ledger.snapshot("a", 30.0).last_ok_at == 20.0
    assert ledger.restart_unproven("a", 119.0)
    assert ledger.overdue(119.0) == []
    assert ledger.overdue(120.0) == ["a"]


def test_two_retired_backends_at_one_address_answer_a_reset_alike_before_and_after_a_save() -> None:
    """A replacement that took a RETIRED backend's address, retired in its turn, left two
    RETIRED backends at one server. Which could be reset depended on which held the
    lookup, and a save and load (every `check`, every verb) gave it to the other: a reset
    refused in the daemon's record was taken from the file, and the other way round. A
    RETIRED holder is out for good, as for a replacement's ``NewProcessUp``: either may
    be reset, and the first one reset takes the address."""
    ledger = three_backends()
    ledger.apply("a", Retire(now=1.0, reason="bad GPU"))
    ledger.apply("b", ProcessGone(now=2.0, reason="gone"))
    ledger.apply("b", NewProcessUp(now=3.0, url=URL_A))
    ledger.apply("b", Retire(now=4.0, reason="also bad"))
    for name in ("a", "b"):
        live = Ledger.from_dict(ledger.to_dict(), POLICY)
        live._by_url = dict(ledger._by_url)  # as the record in memory holds it
        saved = Ledger.from_dict(json.loads(json.dumps(ledger.to_dict())), POLICY)
        answers = [x.apply(name, OperatorReset(now=5.0)).applied for x in (live, saved)]
        assert answers == [True, True], (name, answers)
        assert saved.by_url(URL_A) == name
        other = "b" if name == "a" else "a"
        assert not saved.apply(other, OperatorReset(now=6.0)).applied  # now taken


# --- rules a mutation run found untested ----------------------------------------------


def test_a_restart_replaces_the_process_as_last_read_not_as_condemned() -> None:
    # Without start times (vLLM's multiprocess mode) only counters tell processes apart.
    # RestartIssued names the process as last read: its counters moved on after it was
    # condemned, and a replacement whose counters passed the condemned ones, not the last
    # read ones, must still be told from it, or a busy replacement is never noted working.
    ledger = one_backend()
    condemned = ProcessSeen(start=None, counters={"finished": 10.0})
    last_read = ProcessSeen(start=None, counters={"finished": 20.0})
    ledger.apply("a", WedgeProven(now=1.0, process=condemned))
    assert ledger.apply("a", RestartIssued(now=2.0, process=last_read)).applied
    assert ledger.restarted_from("a") == last_read
    ledger.apply("a", NewProcessUp(now=60.0))
    replacement = ProcessSeen(start=None, counters={"finished": 15.0})
    t = ledger.apply("a", GoodVerdict(now=70.0, requests_finished=True, process=replacement))
    assert t.applied and t.to_state is State.STALE, t.reason
    assert not ledger.restart_unproven("a", 70.0)


def test_only_in_place_recoveries_inside_the_window_are_kept() -> None:
    # "The record stays bounded": a recovery that left the window is dropped when the next
    # is recorded, not carried in every state file for the backend's whole life.
    policy = LedgerPolicy(recover_in_place=True, healthy_threshold=1, restart_budget_window=100.0)
    ledger = one_backend(policy)
    same = ProcessSeen(start=5.0, counters={"finished": 1.0})
    ledger.apply("a", WedgeProven(now=1.0, process=same))
    assert ledger.apply("a", GoodVerdict(now=2.0, request_ok=True, process=same)).applied
    ledger.apply("a", Readmitted(now=3.0))
    ledger.apply("a", WedgeProven(now=500.0, process=same))
    back = ledger.apply("a", GoodVerdict(now=501.0, request_ok=True, process=same))
    assert back.to_state is State.STALE, back.reason
    assert ledger.entry("a")["recovery_times"] == [501.0]
    assert ledger.snapshot("a", 501.0).in_place_recoveries == 1


def test_a_replacement_put_to_sleep_is_noted_working_and_no_grace_fails_it() -> None:
    # Never sent the tiny request (a completion crashed a sleeping vLLM), an engine its
    # owner put to sleep loaded and works: failed by the grace, it would be restarted again.
    ledger = one_backend()
    new = ProcessSeen(start=90.0, counters={"steps": 5.0})
    for event in (
        WedgeProven(now=1.0),
        RestartIssued(now=2.0),
        NewProcessUp(now=60.0, process=new),
    ):
        assert ledger.apply("a", event).applied
    t = ledger.apply("a", GoodVerdict(now=70.0, asleep=True, process=new))
    assert t.applied and t.to_state is State.STALE and "put to sleep" in t.reason, t.reason
    assert ledger.snapshot("a", 70.0).last_ok_at == 70.0
    assert not ledger.restart_unproven("a", 70.0)
    assert ledger.expire_restarts(2.0 + ledger.policy.startup_grace + 1) == []


def test_a_replacement_of_a_process_never_read_is_the_first_one_a_read_shows() -> None:
    # Condemned before any read showed its process (a server that never answered HTTP),
    # the restart replaced no known process: the first one a read shows is its replacement.
    ledger = one_backend()
    for t in (1.0, 2.0, 3.0):
        ledger.apply("a", ProbeFailure(now=t, reason="down"))
    ledger.apply("a", RestartIssued(now=4.0))
    assert ledger.restarted_from("a") is None
    ledger.apply("a", NewProcessUp(now=60.0))
    busy = ProcessSeen(start=50.0, counters={"steps": 400.0})
    t = ledger.apply("a", GoodVerdict(now=70.0, requests_finished=True, process=busy))
    assert t.applied and t.to_state is State.STALE, t.reason
    assert ledger.expire_restarts(4.0 + ledger.policy.startup_grace + 1) == []


def test_good_verdicts_before_a_callers_word_count_for_nothing_after_it() -> None:
    ledger = one_backend(RECOVER)
    same = ProcessSeen(start=5.0, counters={"finished": 1.0})
    ledger.apply("a", WedgeProven(now=1.0, process=same))
    ledger.apply("a", GoodVerdict(now=2.0, request_ok=True, process=same))
    assert ledger.snapshot("a", 2.0).good_streak == 1
    ledger.apply("a", ProcessGone(now=3.0, reason="actor died"))
    snap = ledger.snapshot("a", 3.0)
    assert (snap.good_streak, snap.caller_condemned) == (0, True)


def test_a_process_seen_the_instant_a_restarts_grace_ran_out_is_not_that_restarts_to_fail() -> None:
    # The grace ran out at 110 (expire_restarts failed it then): a new process seen while
    # DEAD at that very instant is someone else's restart, as one seen later is. Taken for
    # ours, it was failed as overdue the moment it was seen.
    ledger = Ledger(LedgerPolicy(startup_grace=100.0), [("a", URL_A)], now=0.0)
    ledger.apply("a", WedgeProven(now=1.0))
    ledger.apply("a", RestartIssued(now=10.0))
    assert [t.to_state for t in ledger.expire_restarts(110.0)] == [State.DEAD]
    ledger.apply("a", NewProcessUp(now=110.0))
    assert ledger.snapshot("a", 110.0).replaced_while_dead is True
    assert ledger.overdue(1000.0) == []
    assert not ledger.restart_unproven("a", 120.0)


@pytest.mark.parametrize(
    ("start", "replaced"),
    [(970.0, True), (None, True), (900.0, False)],
    ids=["started a minute before the restart", "no start time", "started long before"],
)
def test_a_state_that_did_not_keep_the_replaced_process_judges_by_start_time(
    start: float | None, replaced: bool
) -> None:
    # An older state file kept neither the process a restart replaced nor whether a new
    # one was seen since: a process started since the restart (hosts' clocks a minute
    # apart at most), or with no start time at all, is taken for its replacement, so its
    # dying again within the grace still holds the restart slot.
    policy = LedgerPolicy(startup_grace=100.0)
    ledger = Ledger(policy, [("a", URL_A)], now=0.0)
    ledger.apply("a", WedgeProven(now=1.0, process=ProcessSeen(start=0.0)))
    ledger.apply("a", RestartIssued(now=1000.0))
    ledger.apply("a", NewProcessUp(now=1010.0, process=ProcessSeen(start=start)))
    ledger.apply("a", WedgeProven(now=1020.0))
    assert ledger.restart_unproven("a", 1030.0)
    data = ledger.to_dict()
    for backend in data["backends"]:
        del backend["restarted_from"], backend["replaced_since_restart"]
    assert Ledger.from_dict(data, policy).restart_unproven("a", 1030.0) is replaced


def test_a_replacement_does_not_inherit_the_doubt_its_predecessor_was_in_when_a_sync_broke() -> (
    None
):
    ledger = one_backend()
    ledger.apply("a", ProbeFailure(now=1.0, reason="stalled"))
    ledger.apply("a", WeightsPartial(now=2.0))
    assert ledger.suspected == ("a",)
    ledger.apply("a", NewProcessUp(now=3.0))
    assert ledger.suspected == () and ledger.snapshot("a", 3.0).state_before_partial is None
    back = ledger.apply("a", Readmitted(now=4.0))
    assert back.to_state is State.HEALTHY, back.reason


def test_a_replacement_good_since_its_restart_frees_the_slot_when_it_dies_again() -> None:
    ledger = Ledger(LedgerPolicy(startup_grace=100.0), [("a", URL_A)], now=0.0)
    ledger.apply("a", WedgeProven(now=1.0, process=ProcessSeen(start=0.0)))
    ledger.apply("a", RestartIssued(now=10.0))
    ledger.apply("a", NewProcessUp(now=20.0, process=ProcessSeen(start=15.0)))
    ledger.apply("a", Readmitted(now=30.0))
    ledger.apply("a", WedgeProven(now=40.0))
    assert ledger.state_of("a") is State.DEAD
    # Re-admitted, it proved the restart worked: dead again, it holds no slot.
    assert not ledger.restart_unproven("a", 50.0)


def test_a_caller_seeing_the_command_end_within_the_grace_keeps_the_slot_held() -> None:
    # A wall clock stepped forward past the grace must not free the slot while the
    # caller's steady clock says the command ended less than the grace ago.
    ledger = Ledger(LedgerPolicy(startup_grace=100.0), [("a", URL_A)], now=0.0)
    ledger.apply("a", WedgeProven(now=1.0, process=ProcessSeen(start=0.0)))
    ledger.apply("a", RestartIssued(now=10.0))
    ledger.apply("a", NewProcessUp(now=20.0, process=ProcessSeen(start=15.0)))
    ledger.apply("a", WedgeProven(now=30.0))
    later = 10.0 + 3600.0
    assert not ledger.restart_unproven("a", later)
    assert ledger.restart_unproven("a", later, in_grace=True)


def test_a_dead_backend_condemned_on_its_callers_word_awaits_no_answer() -> None:
    # Only a new process comes back after the caller's word: asking the old one for an
    # answer proves nothing, and spends a request slot on a server its actor left.
    ledger = one_backend(RECOVER)
    for t in (1.0, 2.0, 3.0):
        ledger.apply("a", RequestFailure(now=t, reason="unanswered"))
    assert ledger.awaiting_an_answer == frozenset({"a"})
    ledger.apply("a", ProcessGone(now=4.0, reason="actor died"))
    assert ledger.awaiting_an_answer == frozenset()
    assert ledger.awaiting_readmission == frozenset()


def test_times_less_than_a_minute_ahead_are_not_pulled_back() -> None:
    # Hosts' clocks a minute apart are normal (CLOCKS_APART): only a time further ahead
    # says the clock stepped back.
    assert ledger_module.pulled_back([130.0, None], 100.0) is None
    assert ledger_module.pulled_back([160.0], 100.0) is None
    taken = ledger_module.pulled_back([161.0, 130.0], 100.0)
    assert taken is not None and set(taken) == {130.0, 161.0}
    assert taken[130.0] < taken[161.0] < 100.0
    ledger = one_backend()
    ledger.apply("a", WedgeProven(now=1.0))
    ledger.apply("a", RestartIssued(now=130.0))
    assert ledger.pull_back(100.0) == {}
    assert ledger.snapshot("a", 100.0).last_restart_at == 130.0


def test_the_taken_back_restart_stamp_is_dropped_by_the_next_restart_withdrawal_or_reset() -> None:
    # ``restart_stamped_at`` is what the last restart's command order bears once pull_back
    # took its time back; a later restart, a withdrawn one or a reset has no such order.
    def stamped_ahead() -> Ledger:
        ledger = one_backend()
        ledger.apply("a", WedgeProven(now=1.0))
        ledger.apply("a", RestartIssued(now=10_000.0))  # a clock far ahead
        assert "a" in ledger.pull_back(100.0)
        assert ledger.restart_stamped_at("a") == 10_000.0
        return ledger

    again = stamped_ahead()
    again.apply("a", RestartFailed(now=101.0, reason="exit status 1"))
    assert again.apply("a", RestartIssued(now=200.0)).to_state is State.RESTARTING
    assert again.restart_stamped_at("a") is None

    withdrawn = stamped_ahead()
    t = withdrawn.apply("a", RestartFailed(now=101.0, reason="held", withdrawn=True))
    assert t.to_state is State.DEAD and withdrawn.snapshot("a", 101.0).restart_attempts == 0
    assert withdrawn.restart_stamped_at("a") is None

    reset = stamped_ahead()
    reset.apply("a", Retire(now=101.0, reason="operator"))
    reset.apply("a", OperatorReset(now=102.0))
    assert reset.restart_stamped_at("a") is None


def test_what_a_withdrawal_would_give_back_is_kept_only_while_restarting() -> None:
    ledger = one_backend()
    ledger.apply("a", WedgeProven(now=1.0, process=ProcessSeen(start=0.0)))
    ledger.apply("a", RestartIssued(now=10.0))
    ledger.apply("a", NewProcessUp(now=20.0, process=ProcessSeen(start=15.0)))
    ledger.apply("a", RestartRan(now=25.0))
    ledger.apply("a", WedgeProven(now=30.0))
    ledger.apply("a", RestartIssued(now=40.0))
    entry = ledger.entry("a")
    assert (entry["replaced_before_restart"], entry["ran_before_restart"]) == (True, 25.0)
    ledger.apply("a", NewProcessUp(now=50.0))
    entry = ledger.entry("a")
    assert "replaced_before_restart" not in entry and "ran_before_restart" not in entry


def test_a_restart_command_ending_after_its_replacement_showed_up_starts_the_grace() -> None:
    # The command waits for readiness: its process shows up (STALE) before it exits 0,
    # and the grace counts from its end, as for one that ends while RESTARTING.
    ledger = Ledger(LedgerPolicy(startup_grace=100.0), [("a", URL_A)], now=0.0)
    ledger.apply("a", WedgeProven(now=1.0))
    ledger.apply("a", RestartIssued(now=10.0))
    ledger.apply("a", NewProcessUp(now=20.0))
    ran = ledger.apply("a", RestartRan(now=500.0))
    assert (ran.applied, ran.to_state) == (True, State.STALE), ran.reason
    assert ledger.snapshot("a", 500.0).restart_ran_at == 500.0
    assert ledger.overdue(550.0) == []
    assert ledger.overdue(600.0) == ["a"]


def test_a_stale_backend_awaits_readmission() -> None:
    ledger = Ledger(POLICY, [("a", URL_A), ("b", URL_B)], now=0.0)
    ledger.apply("a", UnplannedRestart(now=1.0))
    assert ledger.awaiting_readmission == frozenset({"a"})


def test_only_attempts_inside_the_window_keep_a_failing_replacement_short_of_its_budget() -> None:
    # The first attempt left the budget window: the next one restarts, not retires, so
    # the replacement dead again within its grace still holds its restart slot.
    policy = LedgerPolicy(restart_budget=2, restart_budget_window=1000.0, startup_grace=100.0)
    ledger = Ledger(policy, [("a", URL_A)], now=0.0)
    ledger.apply("a", WedgeProven(now=1.0, process=ProcessSeen(start=0.0)))
    ledger.apply("a", RestartIssued(now=10.0))
    ledger.apply("a", RestartFailed(now=11.0, reason="exit status 1"))
    ledger.apply("a", RestartIssued(now=1000.0))
    ledger.apply("a", NewProcessUp(now=1010.0, process=ProcessSeen(start=1005.0)))
    ledger.apply("a", WedgeProven(now=1020.0))
    assert ledger.snapshot("a", 1050.0).restart_attempts == 1
    assert ledger.restart_unproven("a", 1050.0)
