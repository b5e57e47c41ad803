"""Real-traffic outcomes: kept in order, bounded, and fed to the ledger in that order."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest

from llmhealth.actions import AuditLog
from llmhealth.classify import Answer, Outcome, Read, Target, Verdict, VerdictKind
from llmhealth.config import Backend, Config, Policy
from llmhealth.cycle import settle
from llmhealth.fleet import TRAFFIC_CAUSE, FleetRecord
from llmhealth.ledger import (
    BackendSnapshot,
    GoodVerdict,
    Ledger,
    LedgerPolicy,
    NewProcessUp,
    ProcessSeen,
    State,
    WedgeProven,
)
from llmhealth.metrics import Signals
from llmhealth.remediate import Mode
from llmhealth.report import CycleReport
from llmhealth.traffic import MAX_PENDING, FailureKind, RequestLog, RequestOutcome

T0 = 1_700_000_000.0


def ok(at: float) -> RequestOutcome:
    return RequestOutcome(at, "POST", "/v1/chat/completions")


def failed(at: float, kind: FailureKind = FailureKind.SERVER_ERROR) -> RequestOutcome:
    status = 500 if kind is FailureKind.SERVER_ERROR else None
    return RequestOutcome(at, "POST", "/v1/chat/completions", kind, status, "")


def record(policy: LedgerPolicy | None = None) -> FleetRecord:
    return FleetRecord(Ledger(policy or LedgerPolicy(), [("a", "http://a"), ("b", "http://b")]))


def test_the_log_keeps_order_per_backend_and_empties_on_drain() -> None:
    log = RequestLog()
    for outcome in (failed(T0), ok(T0 + 1), failed(T0 + 2)):
        log.record("a", outcome)
    log.record("b", ok(T0 + 3))
    assert log.drain() == {"a": (failed(T0), ok(T0 + 1), failed(T0 + 2)), "b": (ok(T0 + 3),)}
    assert log.drain() == {}


def test_a_run_of_successes_is_kept_as_its_first_and_its_newest() -> None:
    log = RequestLog()
    for i in range(1000):
        log.record("a", ok(T0 + i))
    log.record("a", failed(T0 + 1000))
    log.record("a", ok(T0 + 1001))
    assert log.drain()["a"] == (ok(T0), ok(T0 + 999), failed(T0 + 1000), ok(T0 + 1001))


def test_the_log_is_bounded_and_keeps_the_newest() -> None:
    log = RequestLog()
    for i in range(MAX_PENDING * 3):
        log.record("a", failed(T0 + i))
    drained = log.drain()["a"]
    assert len(drained) == MAX_PENDING
    assert drained[-1] == failed(T0 + MAX_PENDING * 3 - 1)


def test_has_failure_sees_only_what_was_not_yet_drained() -> None:
    log = RequestLog()
    log.record("a", failed(T0))
    assert log.has_failure("a") and not log.has_failure("b")
    log.drain()
    assert not log.has_failure("a")
    log.record("a", ok(T0 + 1))  # answered requests alone keep nothing dropped
    assert not log.has_failure("a")


def test_what_a_skipped_settle_gives_back_comes_before_what_came_since() -> None:
    # The settle could not save (a full disk): the failures it took must reach the next
    # one, in the order they happened, or a failing backend returns to the choice.
    log = RequestLog()
    log.record("a", failed(T0))
    log.record("a", ok(T0 + 1))
    taken = log.drain()
    log.record("a", ok(T0 + 2))
    log.record("b", failed(T0 + 3))
    log.give_back(taken)
    assert log.has_failure("a")
    # In the order they happened, as when recorded in turn.
    assert log.drain() == {"a": (failed(T0), ok(T0 + 1), ok(T0 + 2)), "b": (failed(T0 + 3),)}


def test_failures_in_a_row_condemn_with_the_requests_as_proof() -> None:
    fleet = record()
    outcomes = [failed(T0), failed(T0 + 1, FailureKind.FIRST_BYTE_TIMEOUT), failed(T0 + 2)]
    transitions = fleet.observe_requests("a", outcomes)
    assert [t.to_state for t in transitions] == [State.SUSPECT, State.SUSPECT, State.DEAD]
    snap = fleet.ledger.snapshot("a", T0 + 3)
    assert snap.condemned_by == TRAFFIC_CAUSE
    assert snap.last_error == f"{TRAFFIC_CAUSE}: server_error HTTP 500 on POST /v1/chat/completions"
    proof = fleet.proofs["a"]
    assert proof["verdict"] == TRAFFIC_CAUSE
    assert [r["at"] for r in proof["requests"]] == [T0, T0 + 1, T0 + 2]
    assert proof["requests"][1]["failure"] == "first_byte_timeout"
    assert fleet.ledger.state_of("b") is State.HEALTHY


def test_a_failure_real_traffic_saw_outlives_an_answered_tiny_request() -> None:
    fleet = record()
    fleet.observe_requests("a", [failed(T0)])
    answered = Answer(T0 + 2, True, "answered in 0.05 s by model tiny", "tiny", ("tiny",))
    idle = Verdict(VerdictKind.IDLE, True, "idle: answered", answer=answered)
    fleet.observe("a", idle, T0 + 2)
    snap = fleet.ledger.snapshot("a", T0 + 2)
    assert (snap.state, snap.request_failures, snap.traffic_failures) == (State.SUSPECT, 1, 1)
    fleet.observe_requests("a", [ok(T0 + 3)])
    assert fleet.ledger.snapshot("a", T0 + 3).request_failures == 0


def settled_past_an_unanswered_tiny_request(
    fleet: FleetRecord, requests: Mapping[str, Sequence[RequestOutcome]], at: float
) -> BackendSnapshot:
    """Backend a's snapshot after a settle at ``at`` of ``requests`` and a verdict whose
    tiny request went unanswered at T0 + 12 (reads at T0 + 11 and + 12)."""
    reads = (Read(T0 + 11, Signals()), Read(T0 + 12, Signals()))
    timed_out = Answer(T0 + 12, False, "failed: no answer within 1 s", timed_out=True)
    unanswered = Verdict(
        VerdictKind.UNANSWERED, False, "unanswered: idle", reads=reads, answer=timed_out
    )
    config = Config(backends=(Backend("a", "http://a"), Backend("b", "http://b")))
    outcome = Outcome(Target("a", "http://a"), unanswered)
    settle(fleet, config, [outcome], at, mode=Mode.OFF, audit=None, requests=requests)
    return fleet.ledger.snapshot("a", at)


def test_a_settle_hears_requests_and_a_verdict_in_the_order_they_happened() -> None:
    # Verdicts went first whatever the time: an unanswered tiny request after a real
    # request answered counted on the streak that answer had ended, and condemned.
    fleet = record()
    fleet.observe_requests("a", [failed(T0), failed(T0 + 1)])
    snap = settled_past_an_unanswered_tiny_request(fleet, {"a": [ok(T0 + 10)]}, T0 + 15)
    assert (snap.state, snap.request_failures) == (State.SUSPECT, 1)


def test_order_decides_a_success_between_failures_breaks_the_streak() -> None:
    broken = record()
    broken.observe_requests("a", [failed(T0), failed(T0 + 1), ok(T0 + 2), failed(T0 + 3)])
    assert broken.ledger.state_of("a") is State.SUSPECT
    assert broken.ledger.snapshot("a", T0 + 4).request_failures == 1
    # The same outcomes in another order condemn: the streak is the one on the wire.
    unbroken = record()
    unbroken.observe_requests("a", [ok(T0 + 2), failed(T0), failed(T0 + 1), failed(T0 + 3)])
    assert unbroken.ledger.state_of("a") is State.DEAD


def test_a_passing_probe_never_clears_the_traffic_streak() -> None:
    fleet = record()
    fleet.observe_requests("a", [failed(T0), failed(T0 + 1)])
    for i in range(5):
        fleet.ledger.apply("a", GoodVerdict(now=T0 + 3 + i))
    assert fleet.ledger.state_of("a") is State.SUSPECT
    fleet.observe_requests("a", [failed(T0 + 10)])
    assert fleet.ledger.state_of("a") is State.DEAD


def test_outcomes_for_a_backend_out_of_service_change_nothing() -> None:
    fleet = record(LedgerPolicy(unhealthy_threshold=1))
    fleet.observe_requests("a", [failed(T0)])
    assert fleet.ledger.state_of("a") is State.DEAD
    transitions = fleet.observe_requests("a", [ok(T0 + 1), failed(T0 + 2)])
    assert not any(t.applied for t in transitions)
    assert fleet.ledger.state_of("a") is State.DEAD


def settle_traffic(tmp_path: Path, restart_on: tuple[str, ...]) -> tuple[CycleReport, list[Any]]:
    config = Config(
        policy=Policy(restart_on=restart_on),
        backends=(Backend("a", "http://a", restart=("true",)), Backend("b", "http://b")),
    )
    audit = tmp_path / "audit.jsonl"
    report, _orders = settle(
        record(),
        config,
        [],
        T0 + 10,
        mode=Mode.DRY_RUN,
        audit=AuditLog(audit),
        requests={"a": [failed(T0), failed(T0 + 1), failed(T0 + 2)], "gone": [failed(T0)]},
    )
    return report, [json.loads(line) for line in audit.read_text().splitlines()]


def test_a_settle_audits_a_traffic_condemnation_and_restarts_only_when_opted_in(
    tmp_path: Path,
) -> None:
    report, audit = settle_traffic(tmp_path / "default", ("wedged",))
    assert [t.to_state for t in report.traffic] == [State.SUSPECT, State.SUSPECT, State.DEAD]
    condemned = next(line for line in audit if line.get("to") == "dead")
    assert len(condemned["evidence"]["requests"]) == 3
    assert [note.action for note in report.restarts] == ["skip"]
    assert "restart_on is [wedged]" in report.restarts[0].reason

    report, _ = settle_traffic(tmp_path / "opted", ("wedged", "request_failures"))
    assert [note.action for note in report.restarts] == ["restart"]


def test_the_proof_names_the_streak_across_settles_and_survives_the_state_file() -> None:
    fleet = record()
    fleet.observe_requests("a", [ok(T0), failed(T0 + 1)])
    fleet = FleetRecord.from_dict(json.loads(json.dumps(fleet.to_dict())), LedgerPolicy())
    fleet.observe_requests("a", [failed(T0 + 2, FailureKind.FIRST_BYTE_TIMEOUT)])
    fleet.observe_requests("a", [failed(T0 + 3)])
    assert fleet.ledger.state_of("a") is State.DEAD
    assert [r["at"] for r in fleet.proofs["a"]["requests"]] == [T0 + 1, T0 + 2, T0 + 3]


def test_an_answered_request_ends_the_streak_it_would_prove() -> None:
    fleet = record()
    fleet.observe_requests("a", [failed(T0), failed(T0 + 1)])
    fleet.observe_requests("a", [ok(T0 + 2)])
    assert fleet.request_streaks == {}
    fleet.observe_requests("a", [failed(T0 + 3), failed(T0 + 4), failed(T0 + 5)])
    assert [r["at"] for r in fleet.proofs["a"]["requests"]] == [T0 + 3, T0 + 4, T0 + 5]


def test_a_fresh_start_ends_the_streak_so_no_later_proof_names_the_old_process() -> None:
    """A new process re-admitted kept the old one's failed requests as its streak: the
    next condemnation's proof (audit log, restart evidence) named them."""
    fleet = record()
    fleet.observe_requests("a", [failed(T0), failed(T0 + 1)])
    fleet.ledger.apply("a", WedgeProven(now=T0 + 2))
    fleet.ledger.apply("a", NewProcessUp(now=T0 + 3))
    idle = Verdict(VerdictKind.IDLE, True, "idle", answer=Answer(T0 + 4, True, "answered"))
    fleet.observe("a", idle, T0 + 4)
    assert fleet.ledger.state_of("a") is State.HEALTHY
    assert fleet.request_streaks == {}
    fleet.observe_requests("a", [failed(T0 + 5), failed(T0 + 6), failed(T0 + 7)])
    assert [r["at"] for r in fleet.proofs["a"]["requests"]] == [T0 + 5, T0 + 6, T0 + 7]


def test_requests_drained_after_a_move_to_a_new_address_went_to_the_old_one() -> None:
    fleet = record()
    fleet.reconcile({"a": "http://a2", "b": "http://b"}, T0 + 10)
    fleet.observe_requests("a", [failed(T0 + 9)])  # sent to http://a, drained only now
    assert fleet.ledger.snapshot("a", T0 + 11).request_failures == 0
    fleet.observe_requests("a", [failed(T0 + 11)])
    assert fleet.ledger.snapshot("a", T0 + 12).request_failures == 1


def test_a_malformed_streak_in_the_state_file_is_named() -> None:
    document = record().to_dict()
    document["request_streaks"] = {"a": "nonsense"}
    with pytest.raises(ValueError, match=r"request_streaks\.a"):
        FleetRecord.from_dict(document, LedgerPolicy())


def test_a_failure_from_before_a_re_admission_is_not_held_against_the_new_process() -> None:
    """Found by the demo: a stream that failed on the wedged process was drained in the
    settle that re-admitted its replacement, and made the new process SUSPECT."""
    fleet = record()
    fleet.ledger.apply("a", WedgeProven(now=T0 + 1))
    fleet.ledger.apply("a", NewProcessUp(now=T0 + 2))
    idle = Verdict(VerdictKind.IDLE, True, "idle", answer=Answer(T0 + 3, True, "answered"))
    fleet.observe("a", idle, T0 + 3)
    assert fleet.ledger.state_of("a") is State.HEALTHY
    fleet.observe_requests("a", [failed(T0 + 0.5), failed(T0 + 2.5)])
    assert fleet.ledger.state_of("a") is State.HEALTHY
    fleet = FleetRecord.from_dict(json.loads(json.dumps(fleet.to_dict())), LedgerPolicy())
    fleet.observe_requests("a", [failed(T0 + 2.9), failed(T0 + 4)])
    assert fleet.ledger.state_of("a") is State.SUSPECT
    assert fleet.ledger.snapshot("a", T0 + 5).request_failures == 1


def test_a_backend_condemned_by_traffic_comes_back_in_place_keeping_its_proof() -> None:
    fleet = record(LedgerPolicy(recover_in_place=True))
    process = ProcessSeen(start=T0 - 600, counters={"engine 0 finished": 40.0})
    fleet.ledger.apply("a", GoodVerdict(now=T0 - 1, process=process))  # the process it knows
    fleet.observe_requests("a", [failed(T0), failed(T0 + 1), failed(T0 + 2)])
    proof = fleet.proofs["a"]
    # A request still in flight fails late: it breaks no proof, only the good streak.
    (late,) = fleet.observe_requests("a", [failed(T0 + 3)])
    assert late.applied and late.to_state is State.DEAD
    assert fleet.proofs["a"] == proof
    # One the router saw answered clears the failures, though it cannot say which process.
    (answered,) = fleet.observe_requests("a", [ok(T0 + 4)])
    assert answered.applied and "which process answered is unknown" in answered.reason
    assert fleet.ledger.snapshot("a", T0 + 4).request_failures == 0
    climbing = ProcessSeen(start=T0 - 600, counters={"engine 0 finished": 45.0})
    for i in range(2):
        busy = GoodVerdict(now=T0 + 5 + i, requests_finished=True, process=climbing)
        fleet.ledger.apply("a", busy)
    assert fleet.ledger.state_of("a") is State.STALE


def test_a_backend_condemned_by_traffic_before_its_first_verdict_comes_back_in_place() -> None:
    """`route`'s first settles: requests failed before any verdict showed the backend's
    process (a busy one is undecided at its first read). Condemned with its process
    unknown, every later verdict was refused ("which process answered is unknown") and,
    as restart_on leaves traffic condemnations alone by default, it stayed DEAD for good."""
    fleet = record(LedgerPolicy(recover_in_place=True))
    fleet.observe_requests("a", [failed(T0), failed(T0 + 1), failed(T0 + 2)])
    assert fleet.ledger.state_of("a") is State.DEAD
    process = ProcessSeen(start=T0 - 600, counters={"engine 0 finished": 40.0})
    for i in range(2):
        fleet.ledger.apply("a", GoodVerdict(now=T0 + 5 + i, request_ok=True, process=process))
    assert fleet.ledger.state_of("a") is State.STALE


def test_an_answer_before_an_unanswered_tiny_request_still_breaks_the_streak() -> None:
    # Two real requests failed, one was answered, the tiny request then went unanswered,
    # and one more was answered before the settle. The log kept the run of answers as its
    # newest, after the verdict: the streak the ledger saw was three failures in a row,
    # and a server whose real requests were answered was condemned.
    log = RequestLog()
    for outcome in (failed(T0), failed(T0 + 1), ok(T0 + 5), ok(T0 + 20)):
        log.record("a", outcome)
    snap = settled_past_an_unanswered_tiny_request(record(), log.drain(), T0 + 25)
    assert (snap.state, snap.request_failures) == (State.SUSPECT, 0)


def test_a_backend_without_metrics_condemned_by_traffic_comes_back_on_answers() -> None:
    """Metrics off: every verdict is ``no_metrics``, judged by the tiny request alone, and
    no read ever shows the process. Condemned by failed requests (which restart_on leaves
    alone by default), it answered every tiny request and stayed DEAD for good."""
    fleet = record(LedgerPolicy(recover_in_place=True))
    fleet.observe_requests("a", [failed(T0), failed(T0 + 1), failed(T0 + 2)])
    assert fleet.ledger.state_of("a") is State.DEAD
    for at in (T0 + 10, T0 + 20):
        answered = Answer(at, True, "answered in 0.05 s by model tiny", "tiny", ("tiny",))
        verdict = Verdict(
            VerdictKind.NO_METRICS, True, "no_metrics: answered", reads=(), answer=answered
        )
        fleet.observe("a", verdict, at)
    assert fleet.ledger.state_of("a") is State.STALE
    assert fleet.ledger.snapshot("a", T0 + 20).in_place_recoveries == 1
    answered = Answer(T0 + 30, True, "answered in 0.05 s by model tiny", "tiny", ("tiny",))
    readmitted = Verdict(VerdictKind.NO_METRICS, True, "no_metrics", answer=answered)
    fleet.observe("a", readmitted, T0 + 30)
    assert fleet.ledger.state_of("a") is State.HEALTHY


def test_requests_answered_on_a_backend_never_read_clear_its_failures_and_prove_no_recovery() -> (
    None
):
    fleet = record(LedgerPolicy(recover_in_place=True))
    fleet.observe_requests("a", [failed(T0), failed(T0 + 1), failed(T0 + 2)])
    fleet.observe_requests("a", [ok(T0 + 3), ok(T0 + 4), ok(T0 + 5)])
    snap = fleet.ledger.snapshot("a", T0 + 6)
    assert (snap.state, snap.request_failures, snap.good_streak) == (State.DEAD, 0, 0)
