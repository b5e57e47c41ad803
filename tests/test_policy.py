"""The restart policy: one rule per test, then a property over random fleets fed through a
real ledger, with the plan's restarts and retirements fed back into it."""

from __future__ import annotations

import ast
import json
import math
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import llmhealth.policy as policy_module
from llmhealth.config import Backend, Policy
from llmhealth.ledger import (
    BackendSnapshot,
    GoodVerdict,
    Ledger,
    LedgerPolicy,
    NewProcessUp,
    ProbeFailure,
    ProcessGone,
    ProcessSeen,
    Readmitted,
    RequestFailure,
    RestartFailed,
    RestartIssued,
    RestartRan,
    Retire,
    State,
    UnplannedRestart,
    WedgeProven,
)
from llmhealth.policy import (
    Action,
    Hold,
    RestartDecision,
    RestartHistory,
    cooldown_ends_at,
    cooldown_for,
    plan_restarts,
    restart_pending,
)

# 2025-11-30 13:50 UTC: a wall time, so hold expiries read as clock times.
T0 = datetime(2025, 11, 30, 13, 50, tzinfo=UTC).timestamp()
POLICY = Policy()
LEDGER_POLICY = LedgerPolicy()


def command_for(name: str) -> tuple[str, ...]:
    return ("systemctl", "restart", f"vllm@{name}")


def configured(*names: str) -> dict[str, Backend]:
    return {n: Backend(n, f"http://{n}.example:8000", restart=command_for(n)) for n in names}


@dataclass
class Fleet:
    """A real ledger plus what the shell keeps beside it, driven the way the shell would."""

    ledger: Ledger
    backends: dict[str, Backend]
    holds: dict[str, Hold] = field(default_factory=dict)
    histories: dict[str, RestartHistory] = field(default_factory=dict)
    policy: Policy = POLICY
    started: dict[str, float] = field(default_factory=dict)  # each process's start, as seen
    commands_running: set[str] = field(default_factory=set)

    def plan(self, now: float) -> list[RestartDecision]:
        return plan_restarts(
            self.ledger,
            self.backends,
            self.holds,
            self.histories,
            self.policy,
            now,
            self.commands_running,
        )

    def decision(self, name: str, now: float) -> RestartDecision:
        (found,) = [d for d in self.plan(now) if d.name == name]
        return found

    def condemn(self, name: str, now: float, cause: str = "wedged") -> None:
        if cause == "wedged":
            self.ledger.apply(name, WedgeProven(now=now, evidence="no step in 2 waits"))
        else:
            for _ in range(self.ledger.policy.unhealthy_threshold):
                self.ledger.apply(name, ProbeFailure(now=now, reason=cause))
        assert self.ledger.state_of(name) is State.DEAD

    def issue(self, name: str, now: float) -> State:
        """Feed RestartIssued as the shell does for an acting decision."""
        t = self.ledger.apply(name, RestartIssued(now=now))
        if t.to_state is State.RESTARTING:
            self.histories[name] = self.history(name).record_attempt(now)
        return t.to_state

    def fail(self, name: str, now: float) -> None:
        t = self.ledger.apply(name, RestartFailed(now=now, reason="exit status 1"))
        assert t.applied
        self.histories[name] = self.history(name).record_failure()

    def history(self, name: str) -> RestartHistory:
        return self.histories.get(name, RestartHistory())


def fleet(
    *names: str, ledger_policy: LedgerPolicy = LEDGER_POLICY, policy: Policy = POLICY
) -> Fleet:
    ledger = Ledger(ledger_policy, [(n, f"http://{n}.example:8000") for n in names], now=T0)
    return Fleet(ledger, configured(*names), policy=policy)


# --- one rule at a time -------------------------------------------------------------------


def test_a_wedged_backend_with_a_restart_command_is_restarted() -> None:
    f = fleet("a")
    f.condemn("a", T0)
    assert f.plan(T0) == [
        RestartDecision(
            "a", Action.RESTART, "condemned by wedged: restart 1 of 5 allowed in 24h", "wedged"
        )
    ]
    assert f.plan(T0)[0].act
    assert f.issue("a", T0) is State.RESTARTING


def test_only_dead_backends_get_a_decision_and_in_name_order() -> None:
    f = fleet("healthy", "suspect", "dead2", "dead1", "restarting", "stale", "retired")
    f.ledger.apply("suspect", ProbeFailure(now=T0, reason="stalled"))
    for name in ("dead1", "dead2", "restarting", "stale", "retired"):
        f.condemn(name, T0)
    f.issue("restarting", T0)
    f.ledger.apply("stale", NewProcessUp(now=T0))
    f.ledger.apply("retired", Retire(now=T0, reason="operator"))
    f.policy = Policy(max_concurrent_restarts=3)
    assert [d.name for d in f.plan(T0)] == ["dead1", "dead2"]


@pytest.mark.parametrize("cause", ["down", "stalled", "unresponsive"])
def test_a_backend_condemned_by_a_verdict_outside_restart_on_is_left_dead(cause: str) -> None:
    f = fleet("a")
    f.condemn("a", T0, cause)
    d = f.decision("a", T0)
    assert d.action is Action.SKIP and not d.act
    assert d.reason == f"condemned by {cause}, restart_on is [wedged]"
    assert d.condemned_by == cause


def test_restart_on_decides_which_condemnations_restart() -> None:
    f = fleet("a", "b", policy=Policy(restart_on=("down",), max_concurrent_restarts=2))
    f.condemn("a", T0, "down")
    f.condemn("b", T0, "wedged")
    # A failed restart leaves it DEAD and still condemned by down, so it is tried again.
    f.issue("a", T0)
    f.fail("a", T0 + 1)
    assert {d.name: d.action for d in f.plan(T0 + 3600)} == {
        "a": Action.RESTART,
        "b": Action.SKIP,
    }
    assert f.decision("b", T0).reason == "condemned by wedged, restart_on is [down]"


def test_a_process_gone_counts_as_its_reason() -> None:
    f = fleet("a", policy=Policy(restart_on=("wedged", "down")))
    f.ledger.apply("a", ProcessGone(now=T0, reason="down", detail="connection refused"))
    assert f.decision("a", T0).action is Action.RESTART


def test_a_backend_without_a_restart_command_is_never_restarted() -> None:
    f = fleet("a")
    f.backends["a"] = Backend("a", "http://a.example:8000")
    f.condemn("a", T0)
    d = f.decision("a", T0)
    assert (d.action, d.reason) == (Action.SKIP, "no restart command configured")


def test_a_name_missing_from_the_configured_backends_is_never_restarted() -> None:
    # A proxy, or a backend since dropped from the config, may still be in the ledger.
    f = fleet("a", "lb")
    del f.backends["lb"]
    f.condemn("lb", T0)
    d = f.decision("lb", T0)
    assert d.action is Action.SKIP
    assert d.reason.startswith("not a configured backend")
    assert "never a proxy" in d.reason


def test_a_held_backend_is_not_restarted_until_the_hold_expires() -> None:
    f = fleet("a")
    f.condemn("a", T0)
    until = datetime(2025, 11, 30, 14, 5, tzinfo=UTC).timestamp()
    f.holds["a"] = Hold(reason="weight sync", until=until, by="trainer")
    d = f.decision("a", T0)
    assert (d.action, d.reason) == (Action.SKIP, "on hold until 14:05 UTC by trainer: weight sync")
    assert f.decision("a", until - 1).action is Action.SKIP
    assert f.decision("a", until).action is Action.RESTART


def test_a_hold_into_another_day_names_the_date_and_seconds_show_when_set() -> None:
    until = datetime(2025, 12, 1, 2, 0, 30, tzinfo=UTC).timestamp()
    hold = Hold(reason="maintenance", until=until, by="operator:alice")
    assert (
        hold.describe(T0) == "on hold until 2025-12-01 02:00:30 UTC by operator:alice: maintenance"
    )
    assert hold.active(T0) and not hold.active(until)


def test_a_hold_on_another_backend_does_not_hold_this_one() -> None:
    f = fleet("a", "b")
    f.condemn("a", T0)
    f.holds["b"] = Hold(reason="weight sync", until=T0 + 600, by="trainer")
    assert f.decision("a", T0).action is Action.RESTART


def test_after_failed_attempts_the_cooldown_doubles_and_says_how_long_is_left() -> None:
    f = fleet("a")
    f.condemn("a", T0)
    f.issue("a", T0)
    f.fail("a", T0 + 5)
    # One failure: twice the base cooldown of 1m, from the attempt.
    assert f.decision("a", T0 + 60).reason == "cooling down: 1m left after 1 failed attempt"
    assert f.decision("a", T0 + 120).action is Action.RESTART
    f.issue("a", T0 + 120)
    f.fail("a", T0 + 125)
    d = f.decision("a", T0 + 120 + 140)
    assert (d.action, d.reason) == (Action.SKIP, "cooling down: 1m40s left after 2 failed attempts")
    assert f.decision("a", T0 + 120 + 240).action is Action.RESTART


def test_a_backend_that_wedges_again_after_readmission_waits_the_base_cooldown() -> None:
    f = fleet("a")
    f.condemn("a", T0)
    f.issue("a", T0)
    f.ledger.apply("a", NewProcessUp(now=T0 + 10))
    f.ledger.apply("a", Readmitted(now=T0 + 20))
    f.histories["a"] = f.history("a").record_success()
    f.condemn("a", T0 + 30)
    d = f.decision("a", T0 + 30)
    assert d.reason == "cooling down: 30s left after the last attempt"
    assert f.decision("a", T0 + 60).action is Action.RESTART


def test_the_ledgers_last_restart_still_cools_down_when_the_history_is_lost() -> None:
    f = fleet("a")
    f.condemn("a", T0)
    f.issue("a", T0)
    f.fail("a", T0 + 1)
    f.histories.clear()
    assert f.decision("a", T0 + 59).action is Action.SKIP
    assert f.decision("a", T0 + 60).action is Action.RESTART


@pytest.mark.parametrize(
    ("failures", "seconds"),
    [(0, 60.0), (1, 120.0), (2, 240.0), (4, 960.0), (5, 1800.0), (6, 1800.0), (10**6, 1800.0)],
)
def test_cooldown_doubles_per_failed_attempt_up_to_the_cap(failures: int, seconds: float) -> None:
    assert cooldown_for(failures, POLICY) == seconds


def test_cooldown_refuses_a_negative_count() -> None:
    with pytest.raises(ValueError, match="must not be negative"):
        cooldown_for(-1, POLICY)


def test_no_previous_attempt_means_no_cooldown() -> None:
    assert cooldown_ends_at(RestartHistory(), None, POLICY) is None
    assert cooldown_ends_at(RestartHistory(failures=3), None, POLICY) is None


def test_the_later_of_the_historys_attempt_and_the_ledgers_restart_starts_the_cooldown() -> None:
    # A history from an old state file must not make the policy restart sooner than the
    # ledger's own last restart allows, nor the other way round.
    old = RestartHistory(failures=1, last_attempt_at=T0)
    assert cooldown_ends_at(old, T0 + 500, POLICY) == T0 + 500 + 120
    newer = RestartHistory(failures=0, last_attempt_at=T0 + 500)
    assert cooldown_ends_at(newer, T0, POLICY) == T0 + 500 + 60


def test_one_restart_at_a_time_by_default_and_the_first_name_goes_first() -> None:
    f = fleet("b", "a", "c")
    for name in ("c", "b", "a"):
        f.condemn(name, T0)
    plan = f.plan(T0)
    assert [(d.name, d.action) for d in plan] == [
        ("a", Action.RESTART),
        ("b", Action.SKIP),
        ("c", Action.SKIP),
    ]
    assert plan[1].reason == "1 restart already under way (max_concurrent_restarts 1)"


def test_restarting_backends_count_against_the_limit() -> None:
    f = fleet("a", "b", "c", policy=Policy(max_concurrent_restarts=2))
    for name in ("a", "b", "c"):
        f.condemn(name, T0)
    f.issue("b", T0)
    f.issue("c", T0)
    assert f.decision("a", T0).reason == "2 restarts already under way (max_concurrent_restarts 2)"
    f.ledger.apply("c", NewProcessUp(now=T0 + 1))
    # Up, but unproven: the slot stays taken until the replacement is re-admitted.
    assert f.decision("a", T0 + 1).reason == (
        "2 restarts already under way (max_concurrent_restarts 2)"
    )
    f.ledger.apply("c", Readmitted(now=T0 + 2))
    assert f.decision("a", T0 + 2).action is Action.RESTART


def test_a_shared_fault_restarts_one_backend_until_its_replacement_proves_itself() -> None:
    # Every backend wedged by a cause they share: the first one's replacement comes up
    # and wedges too. The slot is not freed by the new process, only by proof, or by the
    # startup grace sending it back to DEAD; the others are never restarted meanwhile.
    f = fleet("a", "b", "c")
    for name in ("a", "b", "c"):
        f.condemn(name, T0)
    assert f.issue("a", T0) is State.RESTARTING
    f.ledger.apply("a", NewProcessUp(now=T0 + 60))
    assert f.ledger.state_of("a") is State.STALE
    for later in (T0 + 90, T0 + 600, T0 + 880):
        assert {d.name: d.action for d in f.plan(later)} == {"b": Action.SKIP, "c": Action.SKIP}
    # The grace runs out: "a" is DEAD again and the slot is free for the next in line.
    grace = f.ledger.policy.startup_grace
    f.ledger.expire_restarts(T0 + grace + 1)
    assert f.ledger.state_of("a") is State.DEAD
    assert not f.ledger.restart_unproven("a", T0 + grace + 1)


def test_a_withdrawn_restart_leaves_the_slot_its_predecessors_failing_replacement_holds() -> None:
    # "a"'s replacement came up and wedged within its grace: it holds the one slot, and
    # "b" waits. "a"'s own retry is issued, then withdrawn before its command ran (an
    # operator's hold while `check` ran an earlier command, a Ctrl-C): no command ran,
    # so nothing changed. Before, the withdrawal forgot that the replacement had been
    # seen, the slot was freed, and "b" was restarted beside a shared fault.
    f = fleet("a", "b")
    f.condemn("a", T0)
    f.condemn("b", T0)
    assert f.issue("a", T0) is State.RESTARTING
    replacement = ProcessSeen(start=T0 + 50)
    f.ledger.apply("a", NewProcessUp(now=T0 + 60, process=replacement))
    f.ledger.apply("a", WedgeProven(now=T0 + 120, evidence="again", process=replacement))
    assert f.ledger.state_of("a") is State.DEAD
    waits = "1 restart already under way (max_concurrent_restarts 1)"
    assert f.decision("b", T0 + 300).reason == waits
    assert f.decision("a", T0 + 300).action is Action.RESTART
    assert f.issue("a", T0 + 300) is State.RESTARTING
    # Saved RESTARTING; the withdrawal is heard by a later settle, which loads it.
    f.ledger = Ledger.from_dict(json.loads(json.dumps(f.ledger.to_dict())), LEDGER_POLICY)
    withdrawn = RestartFailed(now=T0 + 301, reason="not run: on hold", withdrawn=True)
    assert f.ledger.apply("a", withdrawn).to_state is State.DEAD
    assert f.ledger.restart_unproven("a", T0 + 302)
    assert f.decision("b", T0 + 302).reason == waits  # before: restart


def test_a_withdrawn_restart_gives_back_its_predecessors_grace_counted_from_its_commands_end() -> (
    None
):
    # "a"'s first restart command took 200 s (a slow reload): its startup grace counts
    # from the command's end (RestartRan). Its replacement wedged within that grace and
    # holds the one slot. "a"'s retry is issued, then withdrawn before its command ran:
    # nothing ran, so the slot stays held until the grace from T0 + 200 runs out. The
    # withdrawal gave back the attempt and the replacement, not the command's end: the
    # grace was counted from the issue again, the slot freed 200 s early, and "b" was
    # restarted beside a shared fault.
    f = fleet("a", "b")
    f.condemn("a", T0)
    f.condemn("b", T0)
    assert f.issue("a", T0) is State.RESTARTING
    f.ledger.apply("a", RestartRan(now=T0 + 200))
    replacement = ProcessSeen(start=T0 + 190)
    f.ledger.apply("a", NewProcessUp(now=T0 + 210, process=replacement))
    f.ledger.apply("a", WedgeProven(now=T0 + 260, evidence="again", process=replacement))
    grace = LEDGER_POLICY.startup_grace
    later = T0 + grace + 100  # past a grace from the issue, inside one from the command's end
    assert f.ledger.restart_unproven("a", later)
    assert f.issue("a", later) is State.RESTARTING
    withdrawn = RestartFailed(now=later + 1, reason="not run: on hold", withdrawn=True)
    assert f.ledger.apply("a", withdrawn).to_state is State.DEAD
    assert f.ledger.restart_unproven("a", later + 2)
    # Saved and loaded, as the next settle (or `check`) reads it.
    f.ledger = Ledger.from_dict(json.loads(json.dumps(f.ledger.to_dict())), LEDGER_POLICY)
    assert f.ledger.restart_unproven("a", later + 2)
    assert not f.ledger.restart_unproven("a", T0 + 200 + grace + 1)


def test_a_restart_whose_command_outlives_its_grace_stays_under_way_until_the_command_ends() -> (
    None
):
    # A restart_timeout past the startup grace (or a command that outlived its kill): the
    # grace fails the restart while its command still runs. Before, the plan restarted it
    # again at once (a second command beside the first, an attempt of the budget) and
    # gave its slot to "b", whose restart then ran beside "a"'s.
    f = fleet("a", "b")
    f.condemn("a", T0)
    f.condemn("b", T0)
    assert f.issue("a", T0) is State.RESTARTING
    f.commands_running.add("a")
    grace = f.ledger.policy.startup_grace
    f.ledger.expire_restarts(T0 + grace + 1)
    f.histories["a"] = f.history("a").record_failure()  # as the settle counts it
    later = T0 + grace + 3600  # the cooldown long over
    assert f.ledger.state_of("a") is State.DEAD
    assert f.decision("a", later) == RestartDecision(
        "a", Action.SKIP, "its last restart command still runs", "wedged"
    )
    assert f.decision("b", later).reason == (
        "1 restart already under way (max_concurrent_restarts 1)"
    )
    f.commands_running.clear()  # the command ended
    assert f.decision("a", later).action is Action.RESTART


def test_a_command_running_for_a_name_a_reload_dropped_still_takes_its_place() -> None:
    f = fleet("b")
    f.condemn("b", T0)
    f.commands_running.add("a")  # renamed or dropped while its command runs
    assert f.decision("b", T0).reason == "1 restart already under way (max_concurrent_restarts 1)"


def test_a_backend_moved_to_another_server_waits_for_its_first_read_there() -> None:
    # The wedge was proven on the server it left: the first read of the new one decides.
    f = fleet("a", "b")
    f.condemn("a", T0)
    f.condemn("b", T0)
    url = f.ledger.snapshot("a", T0).url
    plan = plan_restarts(f.ledger, f.backends, {}, {}, POLICY, T0, unread={"a"})
    assert [(d.name, d.action, d.reason) for d in plan] == [
        ("a", Action.SKIP, f"moved to {url}: not read there yet"),
        ("b", Action.RESTART, "condemned by wedged: restart 1 of 5 allowed in 24h"),
    ]
    assert f.decision("a", T0).action is Action.RESTART  # read there: the rules go on


def test_a_command_still_running_does_not_keep_a_hold_from_naming_itself() -> None:
    f = fleet("a")
    f.condemn("a", T0)
    f.issue("a", T0)
    f.ledger.expire_restarts(T0 + f.ledger.policy.startup_grace + 1)
    f.commands_running.add("a")
    f.holds["a"] = Hold("weight sync", T0 + 10_000, "ops")
    assert f.decision("a", T0 + 5_000).reason.startswith("on hold until")


def test_a_wedge_proven_after_doubt_condemned_the_backend_makes_it_restartable() -> None:
    # Failed requests condemned it first; the wedge proven later is what restart_on asks
    # for, with in-place recovery on or off.
    for recover in (True, False):
        f = fleet("a", ledger_policy=LedgerPolicy(recover_in_place=recover))
        f.condemn("a", T0, "request_failures")
        assert f.decision("a", T0).action is Action.SKIP
        t = f.ledger.apply("a", WedgeProven(now=T0 + 30, evidence="no step in 2 waits"))
        assert t.applied and t.to_state is State.DEAD
        assert "condemned by it now, not by request_failures" in t.reason
        assert f.decision("a", T0 + 30).action is Action.RESTART
        again = f.ledger.apply("a", WedgeProven(now=T0 + 40, evidence="still no step"))
        assert f.ledger.snapshot("a", T0 + 40).condemned_by == "wedged"
        assert again.applied is recover  # a second proof only restarts the good streak


def test_a_restart_is_pending_whenever_the_plan_would_restart_or_retire_the_backend() -> None:
    f = fleet("gpu0", "gpu1")
    f.condemn("gpu0", T0)
    f.condemn("gpu1", T0)

    def pending(name: str, now: float) -> bool:
        snap = f.ledger.snapshot(name, now)
        return restart_pending(snap, f.backends.get(name), f.holds.get(name), f.policy, now)

    # gpu1 waits for the one restart slot, gpu0 then cools down: both still pending.
    assert [d.action for d in f.plan(T0)] == [Action.RESTART, Action.SKIP]
    assert pending("gpu0", T0) and pending("gpu1", T0)
    f.issue("gpu0", T0)
    f.fail("gpu0", T0 + 1)
    assert "cooling down" in f.decision("gpu0", T0 + 2).reason
    assert pending("gpu0", T0 + 2)


@pytest.mark.parametrize("why", ["cause", "command", "hold", "unconfigured"])
def test_no_restart_is_pending_when_nothing_would_ever_restart_the_backend(why: str) -> None:
    f = fleet("gpu0")
    f.condemn("gpu0", T0, cause="unresponsive" if why == "cause" else "wedged")
    if why == "command":
        f.backends["gpu0"] = Backend("gpu0", "http://gpu0.example:8000")
    if why == "hold":
        f.holds["gpu0"] = Hold("weight sync", T0 + 600, "trainer")
    if why == "unconfigured":
        del f.backends["gpu0"]
    backend = f.backends.get("gpu0")
    snap = f.ledger.snapshot("gpu0", T0)
    assert not restart_pending(snap, backend, f.holds.get("gpu0"), f.policy, T0)
    assert f.decision("gpu0", T0).action is Action.SKIP
    if why == "hold":  # once the hold ends, the restart is pending again
        assert restart_pending(snap, backend, f.holds["gpu0"], f.policy, T0 + 600)


def test_a_spent_budget_is_an_explicit_retire_that_the_ledger_carries_out() -> None:
    f = fleet("a", ledger_policy=LedgerPolicy(restart_budget=2))
    f.condemn("a", T0)
    for at in (T0, T0 + 600):
        assert f.decision("a", at).action is Action.RESTART
        f.issue("a", at)
        f.fail("a", at + 1)
    d = f.decision("a", T0 + 1200)
    assert d.action is Action.RETIRE and d.act
    assert d.reason == (
        "restart budget spent: 2 attempts in 24h (restart_budget 2): the next attempt retires it"
    )
    assert f.issue("a", T0 + 1200) is State.RETIRED


def test_a_retirement_waits_out_the_cooldown_as_the_attempt_it_stands_for() -> None:
    f = fleet("a", ledger_policy=LedgerPolicy(restart_budget=1))
    f.condemn("a", T0)
    f.issue("a", T0)
    f.fail("a", T0 + 1)
    assert f.decision("a", T0 + 60).action is Action.SKIP
    assert f.decision("a", T0 + 120).action is Action.RETIRE


def test_a_retirement_takes_no_restart_slot() -> None:
    f = fleet("a", "b", ledger_policy=LedgerPolicy(restart_budget=1))
    f.condemn("a", T0)
    f.issue("a", T0)
    f.fail("a", T0 + 1)
    f.condemn("b", T0 + 500)
    assert [(d.name, d.action) for d in f.plan(T0 + 500)] == [
        ("a", Action.RETIRE),
        ("b", Action.RESTART),
    ]


def test_the_budget_frees_up_as_old_attempts_leave_the_window() -> None:
    f = fleet("a", ledger_policy=LedgerPolicy(restart_budget=1, restart_budget_window=3600))
    f.condemn("a", T0)
    f.issue("a", T0)
    f.fail("a", T0 + 1)
    assert f.decision("a", T0 + 3599).action is Action.RETIRE
    d = f.decision("a", T0 + 3600)
    assert (d.action, d.reason) == (
        Action.RESTART,
        "condemned by wedged: restart 1 of 1 allowed in 1h",
    )


def test_a_hold_keeps_even_a_spent_budget_from_retiring_it() -> None:
    f = fleet("a", ledger_policy=LedgerPolicy(restart_budget=1))
    f.condemn("a", T0)
    f.issue("a", T0)
    f.fail("a", T0 + 1)
    f.holds["a"] = Hold(reason="weight sync", until=T0 + 7200, by="trainer")
    assert f.decision("a", T0 + 600).action is Action.SKIP


def test_a_decision_reads_as_a_plain_record() -> None:
    d = RestartDecision("a", Action.RETIRE, "budget", "wedged")
    assert json.loads(json.dumps(d.to_dict())) == {
        "backend": "a",
        "action": "retire",
        "reason": "budget",
        "condemned_by": "wedged",
    }


def test_plan_refuses_a_time_that_is_not_a_number() -> None:
    f = fleet("a")
    with pytest.raises(ValueError, match="now"):
        f.plan(float("nan"))


# --- histories and holds as data --------------------------------------------------------


def test_a_history_records_attempts_failures_and_success() -> None:
    h = RestartHistory().record_attempt(10.0).record_failure().record_attempt(20.0)
    assert h == RestartHistory(failures=1, last_attempt_at=20.0)
    h = h.record_failure()
    assert h.failures == 2
    assert h.record_success() == RestartHistory(failures=0, last_attempt_at=20.0)


@pytest.mark.parametrize(
    "history", [RestartHistory(), RestartHistory(failures=3, last_attempt_at=1.7e9 + 0.25)]
)
def test_a_history_survives_json(history: RestartHistory) -> None:
    assert RestartHistory.from_dict(json.loads(json.dumps(history.to_dict()))) == history


def test_a_hold_survives_json() -> None:
    hold = Hold(reason="weight sync", until=T0 + 60, by="trainer")
    assert Hold.from_dict(json.loads(json.dumps(hold.to_dict()))) == hold


def test_a_key_a_later_build_added_to_a_history_or_hold_is_passed_over() -> None:
    history = RestartHistory.from_dict({"failures": 2, "last_attempt_at": None, "x": 1})
    assert history == RestartHistory(failures=2)
    hold = Hold.from_dict({"reason": "sync", "until": T0, "by": "trainer", "x": 1})
    assert hold == Hold(reason="sync", until=T0, by="trainer")


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ([], "h: expected an object, got list"),
        (None, "h: expected an object, got null"),
        ({"failures": 0}, "h: missing key 'last_attempt_at'"),
        ({"failures": -1, "last_attempt_at": None}, "h.failures: must not be negative"),
        ({"failures": True, "last_attempt_at": None}, "h.failures: expected a whole number"),
        ({"failures": 1.0, "last_attempt_at": None}, "h.failures: expected a whole number"),
        ({"failures": 0, "last_attempt_at": "yesterday"}, "h.last_attempt_at: expected a finite"),
        ({"failures": 0, "last_attempt_at": float("inf")}, "h.last_attempt_at: expected a finite"),
        # JSON integers have no bound; one past a float's range is bad data, not a crash.
        ({"failures": 0, "last_attempt_at": 10**400}, "h.last_attempt_at: expected a finite"),
    ],
)
def test_a_damaged_history_is_a_value_error_naming_the_key(data: object, message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        RestartHistory.from_dict(data, where="h")


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"reason": "", "until": 1.0, "by": "x"}, "hold.reason: expected a non-empty string"),
        ({"reason": "r", "until": "soon", "by": "x"}, "hold.until: expected a finite number"),
        ({"reason": "r", "until": 10**400, "by": "x"}, "hold.until: expected a finite number"),
        ({"reason": "r", "until": 1.0}, "hold: missing key 'by'"),
    ],
)
def test_a_damaged_hold_is_a_value_error_naming_the_key(data: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Hold.from_dict(data)


def test_policy_module_does_no_io() -> None:
    forbidden = {"httpx", "time", "subprocess", "socket", "os", "pathlib", "rich"}
    tree = ast.parse(Path(policy_module.__file__).read_text(encoding="utf-8"))
    imported: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            imported.add(node.module.split(".")[0])
    assert imported, "the walk found no imports at all: the test is broken"
    assert not imported & forbidden


# --- the property -------------------------------------------------------------------------

NAMES = ("a", "b", "c", "d")
# Weighted by repetition: wedges, plans and restart outcomes often enough that cooldowns,
# budgets and the concurrency limit all come into play within one sequence.
OPS = (
    *("wedged",) * 4,
    *("stalled", "unresponsive", "down", "down", "unanswered", "gone", "good", "unplanned"),
    *("plan",) * 6,
    *("fail", "fail", "fail", "up", "up", "readmit", "readmit", "expire"),
    *("hold", "hold", "release"),
)

Op = tuple[str, str, float, int]
ops = st.lists(
    st.tuples(
        st.sampled_from(NAMES),
        st.sampled_from(OPS),
        st.sampled_from([0.0, 0.0, 1.0, 1.0, 5.0, 10.0, 20.0, 45.0, 120.0, 900.0]),
        st.integers(0, 5),
    ),
    # Hypothesis favours short lists; a fleet needs a few dozen steps to wedge, restart,
    # fail, cool down and run out of budget.
    min_size=20,
    max_size=120,
)
policies = st.builds(
    Policy,
    restart_on=st.sampled_from(
        [("wedged",), ("wedged",), ("wedged", "down"), ("down", "unanswered"), ()]
    ),
    max_concurrent_restarts=st.integers(1, 3),
    cooldown=st.sampled_from([10.0, 60.0]),
    cooldown_max=st.sampled_from([60.0, 300.0]),
)
ledger_policies = st.builds(
    LedgerPolicy,
    unhealthy_threshold=st.integers(1, 3),
    restart_budget=st.integers(1, 3),
    restart_budget_window=st.sampled_from([600.0, 5000.0]),
    startup_grace=st.sampled_from([100.0, 900.0]),
)
configs = st.fixed_dictionaries(
    {n: st.sampled_from(["command", "command", "command", "none", "missing"]) for n in NAMES}
)


def check_plan(f: Fleet, plan: list[RestartDecision], now: float) -> None:
    """Every decision against an oracle written from the rules, not from the code."""
    snaps = {s.name: s for s in f.ledger.snapshots(now)}
    dead = sorted(n for n, s in snaps.items() if s.state is State.DEAD)
    assert [d.name for d in plan] == dead
    # Under way: restarting, or up again and not yet proven (re-admitted since it), or
    # DEAD again within the startup grace, unproven, with attempts left; each backend's
    # own restart aside, as its cooldown and budget rule that.
    grace, budget = f.ledger.policy.startup_grace, f.ledger.policy.restart_budget

    def unproven(s: BackendSnapshot) -> bool:
        return s.last_restart_at is not None and (
            s.last_ok_at is None or s.last_ok_at < s.last_restart_at
        )

    def ours(s: BackendSnapshot) -> bool:
        """A STALE spell begun where a DEAD process was, once its restart's grace had run
        out, is someone else's restart, not that one's."""
        assert s.last_restart_at is not None and s.state_since is not None
        begun = max(s.last_restart_at, s.restart_ran_at or s.last_restart_at)
        return not (s.replaced_while_dead and s.state_since - begun >= grace)

    holding = {
        name
        for name, s in snaps.items()
        if s.state is State.RESTARTING
        or (s.state is State.STALE and unproven(s) and ours(s))
        or (
            s.state is State.DEAD
            and unproven(s)
            and s.last_restart_at is not None
            and now - s.last_restart_at < grace
            and s.restart_attempts < budget
            # on its replacement: a process started since that restart (hosts' clocks a
            # minute apart at most), not the one a failed command left
            and f.started.get(name, -math.inf) >= s.last_restart_at - 60.0
        )
    }
    # Not bounded on its own: a backend whose restart failed may come up by another hand
    # (STALE, unproven) while the next one restarts. The plan only never adds past it.
    for d in plan:
        snap = snaps[d.name]
        assert d.reason and d.condemned_by == snap.condemned_by
        backend = f.backends.get(d.name)
        hold = f.holds.get(d.name)
        history = f.history(d.name)
        last = max(
            (t for t in (history.last_attempt_at, snap.last_restart_at) if t is not None),
            default=None,
        )
        eligible = (
            backend is not None
            and bool(backend.restart)
            and snap.condemned_by in f.policy.restart_on
            and not (hold is not None and now < hold.until)
            and (last is None or now >= last + cooldown_for(history.failures, f.policy))
        )
        spent = snap.restart_attempts >= f.ledger.policy.restart_budget
        room = len(holding - {d.name}) < f.policy.max_concurrent_restarts
        if d.action is Action.RESTART:
            assert eligible and not spent and room
            holding.add(d.name)
        elif d.action is Action.RETIRE:
            assert eligible and spent
        else:
            # A skip must have a rule behind it: the plan is not allowed to be timid either.
            assert not eligible or (not spent and not room)
    if any(d.action is Action.RESTART for d in plan):
        assert len(holding) <= f.policy.max_concurrent_restarts


def edges(f: Fleet, now: float) -> list[float]:
    """Times not before ``now`` just before and at each hold expiry, cooldown end and
    budget-window end of the fleet."""
    window = f.ledger.policy.restart_budget_window
    found: list[float] = []
    for snap in f.ledger.snapshots(now):
        hold = f.holds.get(snap.name)
        ends = [
            hold.until if hold else None,
            cooldown_ends_at(f.history(snap.name), snap.last_restart_at, f.policy),
            snap.last_restart_at + window if snap.last_restart_at is not None else None,
        ]
        found += [t for end in ends if end is not None for t in (end - 0.001, end) if t >= now]
    return sorted(set(found))


def step(f: Fleet, name: str, op: str, now: float, k: int) -> None:
    ledger = f.ledger
    match op:
        case "wedged":
            ledger.apply(name, WedgeProven(now=now))
        case "stalled" | "unresponsive" | "down":
            ledger.apply(name, ProbeFailure(now=now, reason=op))
        case "unanswered":
            ledger.apply(name, RequestFailure(now=now, reason=op))
        case "gone":
            ledger.apply(name, ProcessGone(now=now, reason="down", detail="connection refused"))
        case "good":
            ledger.apply(name, GoodVerdict(now=now, request_ok=k % 2 == 0))
        case "unplanned":
            if ledger.apply(name, UnplannedRestart(now=now)).applied:
                f.started.pop(name, None)  # a process not yet read: its start unknown
        case "fail":
            if ledger.apply(name, RestartFailed(now=now, reason="exit status 1")).applied:
                f.histories[name] = f.history(name).record_failure()
        case "expire":
            for t in ledger.expire_restarts(now):
                f.histories[t.name] = f.history(t.name).record_failure()
        case "up":
            up = NewProcessUp(now=now, process=ProcessSeen(start=now, counters={}))
            if ledger.apply(name, up).applied:
                f.started[name] = now
        case "readmit":
            if ledger.apply(name, Readmitted(now=now)).applied:
                f.histories[name] = f.history(name).record_success()
        case "hold":
            f.holds[name] = Hold(reason="weight sync", until=now + 60.0 * k, by="trainer")
        case "release":
            f.holds.pop(name, None)
        case "plan":
            # The plan is pure, so it can also be asked about the moments where a rule
            # changes its mind; a step of a few seconds would rarely land on them.
            for at in edges(f, now):
                check_plan(f, f.plan(at), at)
            plan = f.plan(now)
            check_plan(f, plan, now)
            for d in plan:
                if d.act:
                    to = f.issue(d.name, now)
                    # The plan predicts the ledger: a restart starts, a retirement retires.
                    expected = State.RESTARTING if d.action is Action.RESTART else State.RETIRED
                    assert to is expected
            restarting = sum(1 for n in ledger.names if ledger.state_of(n) is State.RESTARTING)
            assert restarting <= f.policy.max_concurrent_restarts
        case _:
            raise AssertionError(op)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(policy=policies, ledger_policy=ledger_policies, config=configs, sequence=ops)
def test_random_fleets_only_ever_restart_what_every_rule_allows(
    policy: Policy, ledger_policy: LedgerPolicy, config: dict[str, str], sequence: list[Op]
) -> None:
    ledger = Ledger(ledger_policy, [(n, f"http://{n}.example:8000") for n in NAMES], now=T0)
    backends = {
        n: Backend(
            n, f"http://{n}.example:8000", restart=command_for(n) if kind == "command" else ()
        )
        for n, kind in config.items()
        if kind != "missing"
    }
    f = Fleet(ledger, backends, policy=policy)
    now = T0
    for name, op, dt, k in sequence:
        now += dt
        step(f, name, op, now, k)
    step(f, "a", "plan", now, 0)


def test_a_replacement_that_wedged_again_holds_one_slot_and_a_failed_command_none() -> None:
    # Its replacement up and wedged again within the grace, a holds a slot (a shared
    # fault must not restart the fleet in turn), once: planned again, it was counted
    # twice and the next backend skipped at max_concurrent_restarts 2.
    f = fleet("a", "b", "c", policy=Policy(max_concurrent_restarts=2))
    for name in ("a", "b", "c"):
        f.condemn(name, T0)
    f.issue("a", T0)
    f.ledger.apply("a", NewProcessUp(now=T0 + 20, process=ProcessSeen(T0 + 10, {})))
    f.ledger.apply("a", WedgeProven(now=T0 + 35))
    assert f.ledger.state_of("a") is State.DEAD
    plan = {d.name: d.action for d in f.plan(T0 + 200)}
    assert plan == {"a": Action.RESTART, "b": Action.RESTART, "c": Action.SKIP}
    # A command that failed brought up no replacement: it holds nothing.
    g = fleet("a", "b", policy=Policy(max_concurrent_restarts=1))
    for name in ("a", "b"):
        g.condemn(name, T0)
    g.issue("a", T0)
    g.fail("a", T0 + 1)
    assert not g.ledger.restart_unproven("a", T0 + 2)
    assert g.decision("b", T0 + 2).action is Action.RESTART


def test_a_replacement_dead_again_holds_its_slot_only_within_the_grace_and_the_budget() -> None:
    def wedged_again(f: Fleet) -> None:
        for name in ("a", "b"):
            f.condemn(name, T0)
        f.issue("b", T0)
        f.ledger.apply("b", NewProcessUp(now=T0 + 20, process=ProcessSeen(T0 + 10, {})))
        f.ledger.apply("b", WedgeProven(now=T0 + 35))
        assert f.ledger.state_of("b") is State.DEAD

    f = fleet("a", "b")
    wedged_again(f)
    grace = f.ledger.policy.startup_grace
    assert f.ledger.restart_unproven("b", T0 + grace - 1)
    assert f.decision("a", T0 + grace - 1).action is Action.SKIP
    # Its startup grace over, b's restart is no longer under way.
    assert not f.ledger.restart_unproven("b", T0 + grace)
    assert f.decision("a", T0 + grace).action is Action.RESTART
    # Its budget spent, its next attempt retires it and starts nothing: no slot held.
    g = fleet("a", "b", ledger_policy=LedgerPolicy(restart_budget=1))
    wedged_again(g)
    assert not g.ledger.restart_unproven("b", T0 + 100)
    plan = {d.name: d.action for d in g.plan(T0 + 100)}
    assert plan == {"a": Action.RESTART, "b": Action.RETIRE}


def test_a_failed_command_holds_no_slot_after_an_earlier_restart_that_worked() -> None:
    # The replacement seen after the first restart is no replacement of the second: that
    # one's command failed, brought up nothing, and must not keep b waiting.
    f = fleet("a", "b")
    wedged = ProcessSeen(T0 - 5000, {"steps": 900.0})
    f.ledger.apply("a", WedgeProven(now=T0, evidence="no step in 2 waits", process=wedged))
    f.issue("a", T0)
    new = ProcessSeen(T0 + 10, {"steps": 5.0})
    f.ledger.apply("a", NewProcessUp(now=T0 + 20, process=new))
    f.ledger.apply("a", Readmitted(now=T0 + 30))
    f.histories["a"] = f.history("a").record_success()
    again = ProcessSeen(T0 + 10, {"steps": 50.0})
    f.ledger.apply("a", WedgeProven(now=T0 + 100, evidence="no step in 2 waits", process=again))
    f.condemn("b", T0 + 100)
    assert f.issue("a", T0 + 200) is State.RESTARTING
    f.fail("a", T0 + 201)
    assert not f.ledger.restart_unproven("a", T0 + 202)
    assert f.decision("b", T0 + 202).action is Action.RESTART


def test_a_replacement_on_a_host_whose_clock_is_behind_still_holds_the_slot() -> None:
    # Told by clocks, a replacement that started on a host 2 min behind ours looked older
    # than the restart, held nothing, and a shared fault restarted the fleet in turn.
    f = fleet("a", "b")
    old = ProcessSeen(T0 - 5000, {"steps": 900.0})
    f.ledger.apply("a", WedgeProven(now=T0, evidence="no step in 2 waits", process=old))
    f.condemn("b", T0)
    f.issue("a", T0)
    behind = ProcessSeen(T0 + 10 - 120, {"steps": 5.0})  # its clock 2 min behind ours
    f.ledger.apply("a", NewProcessUp(now=T0 + 20, process=behind))
    f.ledger.apply("a", WedgeProven(now=T0 + 35, evidence="no step in 2 waits", process=behind))
    assert f.ledger.restart_unproven("a", T0 + 40)
    assert f.decision("b", T0 + 40).action is Action.SKIP
    # The process it restarted, still there after a failed command, holds nothing.
    g = fleet("a", "b")
    g.ledger.apply("a", WedgeProven(now=T0, evidence="no step in 2 waits", process=old))
    g.condemn("b", T0)
    g.issue("a", T0)
    g.fail("a", T0 + 1)
    assert not g.ledger.restart_unproven("a", T0 + 2)
    # Nor after its counters moved while DEAD, the restart knowing it as last read.
    h = fleet("a", "b")
    h.ledger.apply("a", WedgeProven(now=T0, evidence="no step in 2 waits", process=old))
    h.condemn("b", T0)
    moved = ProcessSeen(T0 - 5000, {"steps": 901.0})
    h.ledger.apply("a", RestartIssued(now=T0, process=moved))
    h.fail("a", T0 + 1)
    assert not h.ledger.restart_unproven("a", T0 + 2)


def test_a_replacement_that_shows_nothing_new_but_was_seen_new_holds_the_slot() -> None:
    # No start times, and a replacement that wedged as young as its predecessor (no
    # counter went back): compared with the process it replaced, it looked like that one,
    # held nothing, and a shared fault restarted the fleet in turn.
    f = fleet("a", "b")
    young = ProcessSeen(None, {"steps": 0.0})
    f.ledger.apply("a", WedgeProven(now=T0, evidence="no step in 2 waits", process=young))
    f.condemn("b", T0)
    f.issue("a", T0)
    f.ledger.apply("a", NewProcessUp(now=T0 + 20, process=young))
    f.ledger.apply("a", WedgeProven(now=T0 + 35, evidence="no step in 2 waits", process=young))
    assert f.ledger.restart_unproven("a", T0 + 40)
    assert f.decision("b", T0 + 40).action is Action.SKIP


def test_a_replacement_of_no_known_start_that_wedged_again_holds_the_slot() -> None:
    # vLLM's multiprocess mode publishes no start time: "started since the restart" could
    # not be shown, so a shared fault there restarted the next backend at once.
    f = fleet("a", "b")
    for name in ("a", "b"):
        f.condemn(name, T0)
    f.issue("a", T0)
    f.ledger.apply("a", NewProcessUp(now=T0 + 20, process=ProcessSeen(None, {"steps": 5.0})))
    f.ledger.apply("a", WedgeProven(now=T0 + 35))
    assert f.ledger.restart_unproven("a", T0 + 40)
    assert f.decision("b", T0 + 40).action is Action.SKIP


def test_a_restart_seen_within_its_grace_on_a_steady_clock_holds_its_slot_past_a_clock_step() -> (
    None
):
    # b's replacement died again within the grace, as the caller's steady clock tells
    # (``in_grace``); the wall clock stepped an hour forward since. Freeing b's slot by
    # the wall clock restarted a, and a fault they share restarted the fleet in turn.
    f = fleet("a", "b")
    for name in ("a", "b"):
        f.condemn(name, T0)
    f.issue("b", T0)
    f.ledger.apply("b", NewProcessUp(now=T0 + 20, process=ProcessSeen(T0 + 10, {})))
    f.ledger.apply("b", WedgeProven(now=T0 + 35))
    later = T0 + f.ledger.policy.startup_grace + 3600
    assert f.decision("a", later).action is Action.RESTART
    plan = plan_restarts(
        f.ledger, f.backends, f.holds, f.histories, f.policy, later, in_grace={"b"}
    )
    (a,) = [d for d in plan if d.name == "a"]
    assert a.action is Action.SKIP and "1 restart already under way" in a.reason


def test_a_restart_after_the_clock_stepped_back_under_a_minute_waits_for_its_replacement() -> None:
    # The wall clock stepped back 30 s (NTP), less than pull_back takes back: a's last
    # good verdict is stamped after its restart. Read as good since the restart, its
    # replacement passed for proven at once: b was restarted beside it (a fault they
    # share restarted the fleet), and no startup grace failed a replacement that never
    # answered.
    f = fleet("a", "b")
    process = ProcessSeen(T0 - 5000, {"steps": 900.0})
    for name in ("a", "b"):
        f.ledger.apply(name, GoodVerdict(now=T0, request_ok=True, process=process))
    back = T0 - 30
    for name in ("a", "b"):
        f.condemn(name, back)
    assert f.decision("a", back).action is Action.RESTART
    assert f.issue("a", back) is State.RESTARTING
    f.ledger.apply("a", NewProcessUp(now=back + 10, process=ProcessSeen(back + 5, {})))
    assert f.ledger.state_of("a") is State.STALE
    assert f.ledger.restart_unproven("a", back + 15)
    decision = f.decision("b", back + 15)
    assert decision.action is Action.SKIP and "1 restart already under way" in decision.reason
    grace = f.ledger.policy.startup_grace
    assert f.ledger.overdue(back + grace) == ["a"]
    # Good at the very instant of its restart is good before it, as for any restart.
    assert f.ledger.snapshot("a", back).last_ok_at == back


def test_a_cooldown_with_under_a_second_left_never_reads_as_over() -> None:
    f = fleet("a")
    f.condemn("a", T0)
    f.issue("a", T0)
    f.fail("a", T0 + 1)
    ready = T0 + cooldown_for(1, f.policy)
    decision = f.decision("a", ready - 0.25)
    assert decision.action is Action.SKIP
    assert decision.reason == "cooling down: 1s left after 1 failed attempt"
