"""What each verdict means for a backend in each ledger state, walks over several runs
through the real ledger, and the fleet record that persists between runs.

Verdicts are built directly, so every row of the tables below is one sentence of the
contract: "a DEAD backend whose last sighting was refused and that now shows work has a
new process up", and so on.
"""

from __future__ import annotations

import json
import math
import tracemalloc
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from llmhealth.actions import CommandResult
from llmhealth.classify import Answer, Read, ReadProblem, Verdict, VerdictKind
from llmhealth.config import Backend, Policy
from llmhealth.fleet import (
    MAX_RETIRED_FORGOTTEN,
    READS_KEEP_UP,
    FleetRecord,
    MembershipChange,
    Sighting,
    _remember,
    events_for,
    process_of,
    reads_per_wait,
    requests_finished,
    saved_floor,
    sighting_of,
    smoothed_gap,
)
from llmhealth.ledger import (
    SERVING,
    Event,
    EventKind,
    GoodVerdict,
    Ledger,
    LedgerPolicy,
    NewProcessUp,
    ProbeFailure,
    ProcessSeen,
    Readmitted,
    RequestFailure,
    RestartFailed,
    RestartIssued,
    Retire,
    State,
    UnplannedRestart,
    WedgeProven,
    WeightsPartial,
)
from llmhealth.metrics import EngineSignals, Signals
from llmhealth.policy import Action, Hold, RestartHistory, plan_restarts
from llmhealth.remediate import (
    CommandDone,
    RestartOrder,
    hear_commands,
    not_run,
)
from llmhealth.rows import plain
from llmhealth.state import encode_pieces
from llmhealth.text import same_server
from llmhealth.window import LongestStep

NOW = 1_000.0
EARLIER = NOW - 60.0
URL_0 = "http://10.0.0.5:8000"
URL_1 = "http://10.0.0.6:8000"
URL_2 = "http://10.0.0.7:8000"
POLICY = LedgerPolicy()


def signals(*, steps: float = 100.0, running: float = 4.0, start: float | None = 50.0) -> Signals:
    engine = EngineSignals(
        engine="0",
        running=running,
        waiting=0.0,
        steps=steps,
        generation_tokens=steps * 4,
        prompt_tokens=48.0,
        finished=3.0,
        preemptions=0.0,
        kv_usage=0.1,
    )
    return Signals(engines=(engine,), process_start=start)


def readable(at: float = NOW, **kwargs: Any) -> Read:
    return Read(at, signals(**kwargs))


REFUSED = Read(NOW, problem=ReadProblem.DOWN, detail="connection refused")
TIMED_OUT = Read(
    NOW,
    problem=ReadProblem.UNRESPONSIVE,
    detail="GET /metrics: connected, but no complete HTTP answer within 1 s",
)
NOT_VLLM = Read(NOW, signals=Signals(), detail="GET /metrics sent 12 bytes without vLLM series")
ANSWERED = Answer(NOW, True, "answered in 0.05 s by model tiny", "tiny", ("tiny",))
FAILED = Answer(NOW, False, "failed: no complete HTTP answer within 1 s", "tiny", ("tiny",))

# The evidence of each verdict after its leading "kind: ", which is what the ledger keeps.
BUSY_DETAIL = "engine 0 progressed over 0.3 s (steps +40); no request sent"
STALLED_DETAIL = "engine 0 had work and made no progress over one wait (0.3 s)"
WEDGED_DETAIL = "engine 0 had work and made no progress over 2 consecutive waits (0.6 s)"
UNANSWERED_DETAIL = "no work (0 running, 0 waiting); tiny request failed: timed out"
NO_METRICS_FAILED_DETAIL = "no metrics (no vLLM series); tiny request failed: timed out"
RESTARTED_FAILED_DETAIL = "process start time 50.00 → 90.00 since the last run; tiny request failed"


def verdict(kind: VerdictKind, healthy: bool, detail: str, **kwargs: Any) -> Verdict:
    return Verdict(kind, healthy, f"{kind}: {detail}", **kwargs)


VERDICTS: dict[str, Verdict] = {
    "busy": verdict(
        VerdictKind.BUSY,
        True,
        BUSY_DETAIL,
        reads=(readable(NOW - 0.3), readable(steps=140.0)),
    ),
    "idle answered": verdict(
        VerdictKind.IDLE,
        True,
        "no work (0 running, 0 waiting); tiny request answered in 0.05 s by model tiny",
        reads=(readable(running=0.0),),
        answer=ANSWERED,
        requests_sent=1,
    ),
    "idle unanswered": verdict(
        VerdictKind.UNANSWERED,
        False,
        UNANSWERED_DETAIL,
        reads=(readable(running=0.0),),
        answer=FAILED,
        requests_sent=1,
    ),
    "stalled": verdict(
        VerdictKind.STALLED,
        False,
        STALLED_DETAIL,
        reads=(readable(NOW - 0.6), readable(NOW - 0.3, steps=140.0), readable(steps=140.0)),
    ),
    "wedged": verdict(
        VerdictKind.WEDGED,
        False,
        WEDGED_DETAIL,
        reads=(readable(NOW - 0.6), readable(NOW - 0.3), readable()),
    ),
    "restarted answered": verdict(
        VerdictKind.RESTARTED,
        True,
        "process start time 50.00 → 90.00 since the last run; tiny request answered",
        reads=(readable(steps=3.0, running=0.0, start=90.0),),
        answer=ANSWERED,
        requests_sent=1,
    ),
    "restarted failed": verdict(
        VerdictKind.RESTARTED,
        False,
        RESTARTED_FAILED_DETAIL,
        reads=(readable(steps=3.0, running=0.0, start=90.0),),
        answer=FAILED,
        requests_sent=1,
    ),
    "restarted unjudged": verdict(
        VerdictKind.RESTARTED,
        False,
        "process start time 50.00 → 90.00 between reads; the new process shows 4 running "
        "and no progress yet",
        reads=(readable(), readable(steps=3.0, start=90.0), readable(steps=3.0, start=90.0)),
    ),
    "no_metrics answered": verdict(
        VerdictKind.NO_METRICS,
        True,
        "no metrics (no vLLM series); tiny request answered in 0.05 s by model tiny",
        reads=(NOT_VLLM,),
        answer=ANSWERED,
        requests_sent=1,
    ),
    "no_metrics failed": verdict(
        VerdictKind.NO_METRICS,
        False,
        NO_METRICS_FAILED_DETAIL,
        reads=(NOT_VLLM,),
        answer=FAILED,
        requests_sent=1,
    ),
    "unresponsive": verdict(VerdictKind.UNRESPONSIVE, False, TIMED_OUT.detail, reads=(TIMED_OUT,)),
    "down": verdict(VerdictKind.DOWN, False, REFUSED.detail, reads=(REFUSED,)),
}

REACHABLE_BEFORE = Sighting(EARLIER, True, signals())
# Refused last time, and the process before the refusal unknown: an answer now is a new one.
REFUSED_BEFORE = Sighting(EARLIER, False, None)
# Refused last time, after a read of the process the verdicts show (same start time): a
# lost route or a reset hid it, and it is judged as the same process.
REFUSED_SAME_PROCESS = Sighting(EARLIER, False, signals())


def good(request_ok: bool) -> Event:
    return GoodVerdict(now=NOW, request_ok=request_ok)


def probe_failure(reason: str, detail: str) -> Event:
    return ProbeFailure(now=NOW, reason=reason, detail=detail)


def request_failure(reason: str, detail: str) -> Event:
    return RequestFailure(now=NOW, reason=reason, detail=detail)


WEDGE = WedgeProven(now=NOW, evidence=WEDGED_DETAIL)
NEW_PROCESS = NewProcessUp(now=NOW)
READMIT = Readmitted(now=NOW)
UNPLANNED = UnplannedRestart(now=NOW)

# HEALTHY and SUSPECT read every verdict the same way: the counting is the ledger's job.
IN_SERVICE: dict[str, list[Event]] = {
    "busy": [good(False)],
    "idle answered": [good(True)],
    "idle unanswered": [request_failure("unanswered", UNANSWERED_DETAIL)],
    "stalled": [probe_failure("stalled", STALLED_DETAIL)],
    "wedged": [WEDGE],
    "restarted answered": [UNPLANNED, READMIT],
    "restarted failed": [UNPLANNED],
    "restarted unjudged": [UNPLANNED],
    "no_metrics answered": [good(True)],
    "no_metrics failed": [request_failure("no_metrics", NO_METRICS_FAILED_DETAIL)],
    "unresponsive": [probe_failure("unresponsive", TIMED_OUT.detail)],
    "down": [probe_failure("down", REFUSED.detail)],
}

# RESTARTING, the same process as last time: only a new start time moves it.
ABSENT_SAME_PROCESS: dict[str, list[Event]] = {
    **{name: [] for name in VERDICTS},
    "restarted answered": [NEW_PROCESS, READMIT],
    "restarted failed": [NEW_PROCESS],
    "restarted unjudged": [NEW_PROCESS],
}

# DEAD, the same process as last time: read as in service, for the ledger to decide
# whether this process may come back in place (and to break a good streak). An answer for
# no expected model is good; a new start time is a new process.
DEAD_SAME_PROCESS: dict[str, list[Event]] = {
    **IN_SERVICE,
    "restarted answered": [NEW_PROCESS, READMIT],
    "restarted failed": [NEW_PROCESS],
    "restarted unjudged": [NEW_PROCESS],
}

# DEAD or RESTARTING after a refusal: metrics (or any answer) again means a new process.
ABSENT_AFTER_REFUSAL: dict[str, list[Event]] = {
    "busy": [NEW_PROCESS],
    "idle answered": [NEW_PROCESS, READMIT],
    "idle unanswered": [NEW_PROCESS],
    "stalled": [NEW_PROCESS],
    "wedged": [NEW_PROCESS],
    "restarted answered": [NEW_PROCESS, READMIT],
    "restarted failed": [NEW_PROCESS],
    "restarted unjudged": [NEW_PROCESS],
    "no_metrics answered": [NEW_PROCESS, READMIT],
    "no_metrics failed": [NEW_PROCESS],
    "unresponsive": [],
    "down": [],
}

# STALE leaves only by re-admission or proof of a wedge; failures are noted, never counted.
STALE_EVENTS: dict[str, list[Event]] = {
    "busy": [],
    "idle answered": [READMIT],
    "idle unanswered": [request_failure("unanswered", UNANSWERED_DETAIL)],
    "stalled": [probe_failure("stalled", STALLED_DETAIL)],
    "wedged": [WEDGE],
    # Replaced again before it was proven: the new process is the one to prove. It was
    # compared with the old one, and a working server was failed by the grace.
    "restarted answered": [NEW_PROCESS, READMIT],
    "restarted failed": [NEW_PROCESS],
    "restarted unjudged": [NEW_PROCESS],
    "no_metrics answered": [READMIT],
    "no_metrics failed": [request_failure("no_metrics", NO_METRICS_FAILED_DETAIL)],
    "unresponsive": [probe_failure("unresponsive", TIMED_OUT.detail)],
    "down": [probe_failure("down", REFUSED.detail)],
}

CASES = [
    *(
        (state, previous, name, expected)
        for state in (State.HEALTHY, State.SUSPECT)
        for previous in (None, REACHABLE_BEFORE, REFUSED_BEFORE)
        for name, expected in IN_SERVICE.items()
    ),
    *(
        (State.RESTARTING, previous, name, expected)
        for previous in (None, REACHABLE_BEFORE)
        for name, expected in ABSENT_SAME_PROCESS.items()
    ),
    *(
        (State.DEAD, previous, name, expected)
        for previous in (None, REACHABLE_BEFORE)
        for name, expected in DEAD_SAME_PROCESS.items()
    ),
    # After a refusal the process the reads show is the one sighted before it: judged as
    # that process. An answer without metrics cannot show which process it is: new.
    *(
        (
            state,
            REFUSED_SAME_PROCESS,
            name,
            ABSENT_AFTER_REFUSAL[name] if name.startswith("no_metrics") else expected,
        )
        for state, table in (
            (State.RESTARTING, ABSENT_SAME_PROCESS),
            (State.DEAD, DEAD_SAME_PROCESS),
        )
        for name, expected in table.items()
    ),
    *(
        (state, REFUSED_BEFORE, name, expected)
        for state in (State.DEAD, State.RESTARTING)
        for name, expected in ABSENT_AFTER_REFUSAL.items()
        # Still refused: a DEAD backend's failures still break a good streak.
        if not (state is State.DEAD and name in ("unresponsive", "down"))
    ),
    *((State.DEAD, REFUSED_BEFORE, name, IN_SERVICE[name]) for name in ("unresponsive", "down")),
    *(
        (State.STALE, previous, name, expected)
        for previous in (None, REACHABLE_BEFORE, REFUSED_BEFORE)
        for name, expected in STALE_EVENTS.items()
    ),
    *(
        (State.RETIRED, previous, name, [])
        for previous in (None, REACHABLE_BEFORE, REFUSED_BEFORE)
        for name in VERDICTS
    ),
]


def _previous_id(previous: Sighting | None) -> str:
    if previous is None:
        return "never seen"
    if previous.reachable:
        return "last seen reachable"
    return "last seen refused" if previous.baseline is None else "refused, same process"


@pytest.mark.parametrize(
    ("state", "previous", "name", "expected"),
    CASES,
    ids=[f"{s}-{_previous_id(p)}-{n}" for s, p, n, _ in CASES],
)
def test_each_verdict_stands_for_exactly_these_events_in_each_state(
    state: State, previous: Sighting | None, name: str, expected: list[Event]
) -> None:
    events = events_for(VERDICTS[name], state, now=NOW, previous=previous)
    # Which process each event came from is the next test's business.
    assert [_without_process(event) for event in events] == expected


def _without_process(event: Event) -> Event:
    return replace(event, process=None) if hasattr(event, "process") else event


def test_every_event_names_the_process_its_newest_readable_read_came_from() -> None:
    busy = events_for(VERDICTS["busy"], State.HEALTHY, now=NOW, previous=None)
    assert busy == [
        GoodVerdict(
            now=NOW,
            process=ProcessSeen(
                start=50.0,
                counters={
                    "engine 0 steps": 140.0,
                    "engine 0 generation_tokens": 560.0,
                    "engine 0 prompt_tokens": 48.0,
                    "engine 0 finished": 3.0,
                    "engine 0 preemptions": 0.0,
                },
            ),
        )
    ]
    restarted = events_for(VERDICTS["restarted failed"], State.DEAD, now=NOW, previous=None)
    assert [e.process.start for e in restarted if isinstance(e, NewProcessUp) and e.process] == [
        90.0
    ]
    for name in ("unresponsive", "down", "no_metrics answered"):
        for state in (State.HEALTHY, State.DEAD, State.STALE):
            for event in events_for(VERDICTS[name], state, now=NOW, previous=None):
                assert getattr(event, "process", None) is None, (name, state)


def test_the_tables_cover_every_verdict_a_backend_can_get() -> None:
    backend_kinds = set(VerdictKind) - {VerdictKind.UP}
    assert {v.kind for v in VERDICTS.values()} == backend_kinds
    tables = (
        IN_SERVICE,
        ABSENT_SAME_PROCESS,
        DEAD_SAME_PROCESS,
        ABSENT_AFTER_REFUSAL,
        STALE_EVENTS,
    )
    for table in tables:
        assert table.keys() == VERDICTS.keys()
    assert {state for state, *_ in CASES} == set(State)


WRONG_MODEL = Answer(NOW, True, "answered by model tiny", "tiny", ("tiny",))
RIGHT_MODEL = Answer(NOW, True, "answered by model big", "big", ("tiny", "big"))


def restarted_with(answer: Answer) -> Verdict:
    return verdict(VerdictKind.RESTARTED, True, "new process", answer=answer, requests_sent=1)


def idle_with(answer: Answer) -> Verdict:
    return verdict(VerdictKind.IDLE, True, "no work", answer=answer, requests_sent=1)


@pytest.mark.parametrize(
    ("state", "made", "expected_without", "expected_with"),
    [
        (State.HEALTHY, restarted_with, [UNPLANNED], [UNPLANNED, READMIT]),
        (State.SUSPECT, restarted_with, [UNPLANNED], [UNPLANNED, READMIT]),
        (State.DEAD, restarted_with, [NEW_PROCESS], [NEW_PROCESS, READMIT]),
        (State.RESTARTING, restarted_with, [NEW_PROCESS], [NEW_PROCESS, READMIT]),
        (State.STALE, idle_with, [], [READMIT]),
        (State.STALE, restarted_with, [NEW_PROCESS], [NEW_PROCESS, READMIT]),
    ],
)
def test_an_answer_readmits_only_when_the_expected_model_is_served(
    state: State,
    made: Callable[[Answer], Verdict],
    expected_without: list[Event],
    expected_with: list[Event],
) -> None:
    def events(answer: Answer) -> list[Event]:
        return events_for(
            made(answer), state, now=NOW, previous=REACHABLE_BEFORE, expected_model="big"
        )

    assert events(WRONG_MODEL) == expected_without
    assert events(RIGHT_MODEL) == expected_with


def test_without_an_expected_model_any_answer_readmits() -> None:
    events = events_for(idle_with(WRONG_MODEL), State.STALE, now=NOW, previous=None)
    assert events == [READMIT]


def test_a_caller_that_readmits_by_its_own_proof_is_not_readmitted_by_an_answer() -> None:
    # A trainer re-admits after a completed weight sync: an answered tiny request proves
    # nothing more, in STALE or across a restart.
    def events(made: Verdict, state: State) -> list[Event]:
        return events_for(made, state, now=NOW, previous=REACHABLE_BEFORE, readmit_on_answer=False)

    assert events(idle_with(RIGHT_MODEL), State.STALE) == []
    assert events(restarted_with(RIGHT_MODEL), State.HEALTHY) == [UNPLANNED]
    assert events(restarted_with(RIGHT_MODEL), State.DEAD) == [NEW_PROCESS]


def test_a_replacement_whose_requests_finish_but_that_failed_the_tiny_request_is_not_working() -> (
    None
):
    # Noted as working, its startup grace would never fail it; only a healthy verdict
    # of a new process whose requests finish is noted so.
    def finished(at: float, total: float) -> Read:
        (engine,) = signals(start=90.0).engines
        return Read(at, Signals((replace(engine, finished=total),), process_start=90.0))

    reads = (finished(NOW - 0.3, 3.0), finished(NOW, 5.0))
    failing = verdict(
        VerdictKind.RESTARTED, False, RESTARTED_FAILED_DETAIL, reads=reads, answer=FAILED
    )
    events = events_for(failing, State.DEAD, now=NOW, previous=REACHABLE_BEFORE)
    assert [type(event) for event in events] == [NewProcessUp]
    working = replace(failing, healthy=True, answer=None)
    events = events_for(working, State.DEAD, now=NOW, previous=REACHABLE_BEFORE)
    assert [type(event) for event in events] == [NewProcessUp, GoodVerdict]


def test_events_carry_the_time_they_were_given() -> None:
    for name, made in VERDICTS.items():
        for state in State:
            for event in events_for(made, state, now=12.5, previous=REFUSED_BEFORE):
                assert event.now == 12.5, (name, state, event)


# --- sightings ---------------------------------------------------------------------


def test_a_sighting_keeps_the_newest_readable_process() -> None:
    verdict_ = VERDICTS["busy"]
    assert sighting_of(verdict_, NOW, REACHABLE_BEFORE) == Sighting(NOW, True, signals(steps=140))


def test_a_refused_backend_is_sighted_unreachable_with_its_old_baseline() -> None:
    sighted = sighting_of(VERDICTS["down"], NOW, REACHABLE_BEFORE)
    assert sighted == Sighting(NOW, False, REACHABLE_BEFORE.baseline)


def test_a_read_that_timed_out_reached_a_live_process_and_is_no_refusal() -> None:
    # Otherwise the next good read would pass for a new process and move DEAD to STALE.
    sighted = sighting_of(VERDICTS["unresponsive"], NOW, REACHABLE_BEFORE)
    assert sighted == Sighting(NOW, True, REACHABLE_BEFORE.baseline)


def test_a_backend_without_metrics_is_reachable_and_keeps_the_old_baseline() -> None:
    sighted = sighting_of(VERDICTS["no_metrics answered"], NOW, REACHABLE_BEFORE)
    assert sighted == Sighting(NOW, True, REACHABLE_BEFORE.baseline)


def test_the_first_sighting_without_a_readable_read_has_no_baseline() -> None:
    assert sighting_of(VERDICTS["down"], NOW, None) == Sighting(NOW, False, None)


LONG_STEP = LongestStep(214.0, "engine 0: an inter-token gap over 80 s")


def test_a_sighting_keeps_the_longest_step_ever_seen_across_processes() -> None:
    learned = replace(VERDICTS["busy"], longest_step=LongestStep(0.05, "gaps up to 0.05 s"))
    first = sighting_of(learned, NOW, None)
    assert first.longest_step == LongestStep(0.05, "gaps up to 0.05 s")
    before = Sighting(NOW - 60, True, signals(steps=100), LONG_STEP)
    # A shorter figure (a new process with fresh histograms) does not shrink it ...
    assert sighting_of(learned, NOW, before).longest_step == LONG_STEP
    # ... and a read that showed nothing keeps it too.
    assert sighting_of(VERDICTS["down"], NOW, before).longest_step == LONG_STEP
    longer_step = LongestStep(300.0, "gaps over 300 s")
    assert sighting_of(replace(learned, longest_step=longer_step), NOW, before).longest_step == (
        longer_step
    )


def test_a_read_refused_after_a_readable_one_is_unreachable_but_keeps_that_read() -> None:
    late = readable(NOW - 0.3, steps=7.0, start=90.0)
    gone = verdict(VerdictKind.DOWN, False, "connection refused", reads=(late, REFUSED))
    assert sighting_of(gone, NOW, REACHABLE_BEFORE) == Sighting(NOW, False, late.signals)


# --- the record: observe and reconcile ---------------------------------------------


def record_of(*backends: tuple[str, str]) -> FleetRecord:
    return FleetRecord(Ledger(POLICY, backends, now=0.0))


def test_observe_feeds_the_ledger_and_remembers_the_process_it_saw() -> None:
    record = record_of(("gpu0", URL_0))
    transitions = record.observe("gpu0", VERDICTS["busy"], NOW)
    assert [(t.kind, t.from_state, t.to_state, t.applied) for t in transitions] == [
        (EventKind.GOOD_VERDICT, State.HEALTHY, State.HEALTHY, True)
    ]
    assert record.sightings == {"gpu0": Sighting(NOW, True, signals(steps=140))}

    transitions = record.observe("gpu0", VERDICTS["down"], NOW + 60)
    assert [(t.kind, t.from_state, t.to_state) for t in transitions] == [
        (EventKind.PROBE_FAILURE, State.HEALTHY, State.SUSPECT)
    ]
    # The refusal shows no process, so the one seen before stays the baseline.
    assert record.sightings == {"gpu0": Sighting(NOW + 60, False, signals(steps=140))}
    assert record.ledger.snapshot("gpu0", NOW + 60).last_error == "down: connection refused"


def test_observe_uses_the_previous_sighting_to_see_a_process_come_back() -> None:
    record = record_of(("gpu0", URL_0))
    for step in range(3):
        record.observe("gpu0", VERDICTS["down"], NOW + step)
    assert record.ledger.state_of("gpu0") is State.DEAD
    transitions = record.observe("gpu0", VERDICTS["busy"], NOW + 3)
    assert [(t.kind, t.to_state) for t in transitions] == [(EventKind.NEW_PROCESS_UP, State.STALE)]


def test_observe_sees_a_restart_of_a_serving_backend_that_only_the_sighting_shows() -> None:
    # watch settles a backend's newest verdict: when a second read came before the settle,
    # the "restarted" verdict was replaced by one judging the new process alone.
    record = record_of(("gpu0", URL_0), ("gpu1", URL_1))
    for name in ("gpu0", "gpu1"):
        record.observe(name, VERDICTS["busy"], NOW)
    new_process = (readable(NOW + 4.7, start=90.0), readable(NOW + 5, steps=140.0, start=90.0))
    busy_again = replace(VERDICTS["busy"], reads=new_process)
    transitions = record.observe("gpu0", busy_again, NOW + 5)
    assert [(t.kind, t.from_state, t.to_state) for t in transitions] == [
        (EventKind.UNPLANNED_RESTART, State.HEALTHY, State.STALE)
    ]
    assert record.sightings["gpu0"].baseline == signals(steps=140.0, start=90.0)
    # The same process, read again: nothing to see.
    transitions = record.observe("gpu1", VERDICTS["busy"], NOW + 5)
    assert [(t.kind, t.to_state) for t in transitions] == [(EventKind.GOOD_VERDICT, State.HEALTHY)]


def test_observe_passes_the_expected_model_to_readmission() -> None:
    record = record_of(("gpu0", URL_0))
    record.observe("gpu0", restarted_with(WRONG_MODEL), NOW, expected_model="big")
    assert record.ledger.state_of("gpu0") is State.STALE
    record.observe("gpu0", idle_with(RIGHT_MODEL), NOW + 1, expected_model="big")
    assert record.ledger.state_of("gpu0") is State.HEALTHY


def notes_of(changes: list[MembershipChange]) -> list[str]:
    return [change.note for change in changes]


def test_reconcile_adds_new_backends_and_says_so() -> None:
    record = record_of(("gpu0", URL_0))
    changes = notes_of(record.reconcile({"gpu0": URL_0, "gpu1": URL_1}, NOW))
    assert changes == [f"gpu1: new backend at {URL_1}; starts HEALTHY"]
    assert record.ledger.names == ("gpu0", "gpu1")
    assert record.ledger.state_of("gpu1") is State.HEALTHY
    assert record.ledger.epoch == 1  # the serving set grew


def test_reconcile_forgets_a_removed_backend_with_its_sighting_and_restarts() -> None:
    record = record_of(("gpu0", URL_0), ("gpu1", URL_1))
    record.observe("gpu1", VERDICTS["busy"], NOW)
    record.restarts["gpu1"] = RestartHistory(failures=1, last_attempt_at=NOW)
    changes = notes_of(record.reconcile({"gpu0": URL_0}, NOW))
    assert changes == ["gpu1: no longer configured; forgotten (healthy)"]
    assert record.ledger.names == ("gpu0",)
    assert "gpu1" not in record.sightings
    assert "gpu1" not in record.restarts
    assert record.ledger.epoch == 1  # a serving backend left


@pytest.mark.parametrize("restarting", [False, True], ids=["dead", "restarting"])
def test_a_verdict_llmhealth_could_not_judge_moves_nothing_and_sees_nothing(
    restarting: bool,
) -> None:
    """Our own failure (a read worker lost, an examination that raised) after refused
    reads was taken for an answer: "a new process up", and a DEAD backend still down went
    to STALE, where nothing restarts it."""
    record = record_of(("gpu0", URL_0))
    for index in range(3):
        record.observe("gpu0", VERDICTS["down"], NOW + index)
    if restarting:
        record.ledger.apply("gpu0", RestartIssued(now=NOW + 3))
    before = record.ledger.state_of("gpu0")
    sighting = record.sightings["gpu0"]
    unjudged = Verdict(VerdictKind.NO_METRICS, False, "no_metrics: not judged", judged=False)
    assert record.observe("gpu0", unjudged, NOW + 4) == []
    assert record.ledger.state_of("gpu0") is before
    assert record.sightings["gpu0"] == sighting  # still the refused read's
    assert events_for(unjudged, State.DEAD, now=NOW, previous=sighting) == []


def test_an_ended_hold_is_dropped_and_a_dropped_backends_hold_lasts_until_it_ends() -> None:
    """Nothing ever removed a hold but ``release``, so ended ones piled up. A running one
    of a backend the config dropped stays until it ends: dropped at once, a hold set for a
    backend just added to the config went with the first settle of a daemon that had not
    reloaded yet, and a weight sync met a restart. A name put back meanwhile is held, and
    its audit line says so."""
    record = record_of(("gpu0", URL_0), ("gpu1", URL_1))
    record.holds["gpu0"] = Hold("weight sync", NOW - 1, "ops")
    record.holds["gpu1"] = Hold("moving racks", NOW + 600, "ops")
    described = record.holds["gpu1"].describe(NOW)
    changes = notes_of(record.reconcile({"gpu0": URL_0}, NOW))
    assert changes == [
        f"gpu1: no longer configured; forgotten (healthy); its hold stays ({described})"
    ]
    assert list(record.holds) == ["gpu1"]
    back = notes_of(record.reconcile({"gpu0": URL_0, "gpu1": URL_1}, NOW + 1))
    held = record.holds["gpu1"].describe(NOW + 1)
    assert back == [f"gpu1: new backend at {URL_1}; starts HEALTHY; {held} (a hold on its name)"]
    record.reconcile({"gpu0": URL_0}, NOW + 2)
    assert notes_of(record.reconcile({"gpu0": URL_0}, NOW + 600)) == []
    assert record.holds == {}


def test_a_backend_given_a_new_name_at_its_address_keeps_everything_under_it() -> None:
    """Forgotten and added as new, a renamed backend came back HEALTHY and serving: a
    condemned server, a retired one, its restart budget and cooldown spent afresh."""
    record = record_of(("gpu0", URL_0), ("gpu1", URL_1), ("gpu2", URL_2))
    record.observe("gpu0", VERDICTS["busy"], NOW)
    record.observe("gpu0", VERDICTS["wedged"], NOW + 1)
    record.restarts["gpu0"] = RestartHistory(failures=2, last_attempt_at=NOW)
    record.proofs["gpu0"] = {"verdict": "wedged"}  # as the settle keeps it
    record.holds["gpu0"] = Hold("weight sync", NOW + 600, "ops")
    record.ledger.apply("gpu1", Retire(now=NOW, reason="bad HBM"))
    epoch = record.ledger.epoch
    changes = record.reconcile(
        {"node-a-gpu0": URL_0, "node-a-gpu1": "http://10.0.0.6:08000", "gpu2": URL_2},
        NOW + 2,
    )
    assert [(c.name, c.event, c.state) for c in changes] == [
        ("node-a-gpu0", "renamed", State.DEAD),
        ("node-a-gpu1", "renamed", State.RETIRED),
        ("node-a-gpu1", "readdressed", State.RETIRED),  # the same server, spelled anew
    ]
    assert changes[0].note == f"node-a-gpu0: renamed from gpu0 at {URL_0}; stays dead"
    assert record.ledger.names == ("gpu2", "node-a-gpu0", "node-a-gpu1")
    assert record.ledger.epoch == epoch
    assert record.restarts["node-a-gpu0"].failures == 2
    assert record.proofs["node-a-gpu0"]["verdict"] == "wedged"
    assert "gpu0" not in record.sightings and "node-a-gpu0" in record.sightings
    assert list(record.holds) == ["node-a-gpu0"]
    assert record.ledger.by_url(URL_0) == "node-a-gpu0"


def test_a_name_taken_by_a_rename_forgets_the_retired_backend_that_had_it() -> None:
    record = record_of(("old", URL_0), ("x", URL_1))
    record.ledger.apply("old", Retire(now=NOW, reason="bad HBM"))
    record.reconcile({"x": URL_1}, NOW + 1)  # "old" forgotten, remembered RETIRED
    record.reconcile({"old": URL_1}, NOW + 2)  # x renamed "old" at its own server
    record.reconcile({}, NOW + 3)
    back = record.reconcile({"old": URL_1}, NOW + 4)
    assert [(c.event, c.state) for c in back] == [("added", State.HEALTHY)]


def test_a_new_name_at_another_address_is_a_new_backend_not_a_rename() -> None:
    record = record_of(("gpu0", URL_0))
    record.observe("gpu0", VERDICTS["busy"], NOW)
    record.observe("gpu0", VERDICTS["wedged"], NOW + 1)
    changes = record.reconcile({"gpu9": URL_1}, NOW + 2)
    assert [(c.name, c.event) for c in changes] == [("gpu0", "forgotten"), ("gpu9", "added")]
    assert record.ledger.state_of("gpu9") is State.HEALTHY


def test_a_retired_backend_dropped_from_the_config_and_added_back_stays_retired() -> None:
    """An edit undone, or a cluster member whose config lacked it leading for a while:
    forgotten and added again, a retired GPU came back HEALTHY and serving."""
    record = record_of(("gpu0", URL_0), ("gpu1", URL_1))
    record.ledger.apply("gpu1", Retire(now=NOW, reason="bad GPU"))
    assert notes_of(record.reconcile({"gpu0": URL_0}, NOW + 1)) == [
        "gpu1: no longer configured; forgotten (retired)"
    ]
    again = FleetRecord.from_dict(json.loads(json.dumps(record.to_dict())), POLICY)
    epoch = again.ledger.epoch
    changes = again.reconcile({"gpu0": URL_0, "gpu1": URL_1}, NOW + 2)
    assert [(c.event, c.state) for c in changes] == [("added", State.RETIRED)]
    # Out of the serving set when it left and when it came back: the epoch stays put.
    assert again.ledger.epoch == epoch
    assert again.ledger.snapshot("gpu1", NOW + 2).last_error == (
        "retired: retired when it left the config; only a reset brings it back"
    )
    assert changes[0].note.startswith(f"gpu1: back in the config at {URL_1}; stays RETIRED")
    assert again.ledger.state_of("gpu1") is State.RETIRED
    assert again.ledger.serving == ("gpu0",)
    assert again.retired_forgotten == {}
    # A backend that was not retired when it left starts afresh, as before.
    assert notes_of(again.reconcile({"gpu1": URL_1}, NOW + 3)) == [
        "gpu0: no longer configured; forgotten (healthy)"
    ]
    assert notes_of(again.reconcile({"gpu0": URL_0, "gpu1": URL_1}, NOW + 4)) == [
        f"gpu0: new backend at {URL_0}; starts HEALTHY"
    ]


def test_a_condemned_backend_dropped_from_the_config_and_added_back_must_prove_itself() -> None:
    """An edit undone (a backend commented out, then back), or a cluster member whose
    config lacked it leading for a while: forgotten and added again, a wedged backend
    came back HEALTHY and served until a read proved the wedge again, two waits later.
    It comes back as it left: DEAD for what condemned it (the restart policy's to act
    on), STALE until proven."""
    record = record_of(("gpu0", URL_0), ("gpu1", URL_1), ("gpu2", URL_2))
    record.observe("gpu1", VERDICTS["busy"], NOW)
    record.observe("gpu1", VERDICTS["wedged"], NOW + 1)
    record.ledger.apply("gpu2", WeightsPartial(now=NOW + 1))  # STALE: alive, unproven
    assert [record.ledger.state_of(n) for n in ("gpu1", "gpu2")] == [State.DEAD, State.STALE]
    # What condemned it, as cycle.settle writes it: the restart it is owed is audited with
    # it (it came back with "last_error" alone); its reads are in the condemnation's record.
    proof = {"verdict": "wedged", "evidence": "engine 0: 4 running", "reads": [{"at": NOW}]}
    record.proofs["gpu1"] = proof
    assert notes_of(record.reconcile({"gpu0": URL_0}, NOW + 2)) == [
        "gpu1: no longer configured; forgotten (dead)",
        "gpu2: no longer configured; forgotten (stale)",
    ]
    again = FleetRecord.from_dict(json.loads(json.dumps(record.to_dict())), POLICY)
    epoch = again.ledger.epoch
    changes = again.reconcile({"gpu0": URL_0, "gpu1": URL_1, "gpu2": URL_2}, NOW + 3)
    assert [(c.name, c.event, c.state) for c in changes] == [
        ("gpu1", "added", State.DEAD),
        ("gpu2", "added", State.STALE),
    ]
    assert changes[0].note == f"gpu1: back in the config at {URL_1}; stays dead as it left"
    assert again.ledger.snapshot("gpu1", NOW + 3).condemned_by == "wedged"
    assert again.proofs == {"gpu1": {"verdict": "wedged", "evidence": "engine 0: 4 running"}}
    assert again.ledger.serving == ("gpu0",) and again.ledger.epoch == epoch
    assert again.withheld_forgotten == {}
    # Proof returns it as it returns any STALE backend.
    assert again.ledger.apply("gpu2", Readmitted(now=NOW + 4)).to_state is State.HEALTHY
    # Served when it left, it starts afresh, as before.
    again.reconcile({"gpu2": URL_2}, NOW + 5)
    changes = again.reconcile({"gpu0": URL_0, "gpu2": URL_2}, NOW + 6)
    assert [(c.name, c.state) for c in changes] == [("gpu0", State.HEALTHY)]


def test_the_retired_backends_remembered_are_bounded_oldest_first() -> None:
    record = record_of(("gpu0", URL_0))
    for n in range(MAX_RETIRED_FORGOTTEN + 5):
        record.retired_forgotten[f"old{n}"] = float(n)
    record.ledger.apply("gpu0", Retire(now=NOW, reason="bad GPU"))
    record.reconcile({}, NOW + 1)
    assert len(record.retired_forgotten) <= MAX_RETIRED_FORGOTTEN
    assert "gpu0" in record.retired_forgotten and "old0" not in record.retired_forgotten


def test_a_record_holding_far_more_forgotten_than_its_bound_is_cut_in_one_pass() -> None:
    """A state edited or merged by hand may hold any number of forgotten backends (some
    300,000 fit in the 64 MiB a run reads): each one over the bound was found by a walk
    of all of them, and the first settle to forget a backend held the state lock for
    hours (40,000 took a `check` 68 s). Each is looked at once now, the newest kept."""
    looked_at = 0

    def at(value: float) -> float:
        nonlocal looked_at
        looked_at += 1
        return value

    forgotten = {f"old{n}": float(n) for n in range(3000)}
    _remember(forgotten, "gpu0", 1e9, at, bound=10)
    assert sorted(forgotten, key=forgotten.__getitem__) == [
        *(f"old{n}" for n in range(2991, 3000)),
        "gpu0",
    ]
    assert looked_at <= 2 * 3001


def test_a_condemned_backend_moved_to_a_new_address_stays_condemned_until_proven() -> None:
    # Forgotten and added again, a wedged backend whose address an operator (or an
    # inventory template) changed served at once, unproven; a retired one came back.
    record = record_of(("gpu0", URL_0), ("gpu1", URL_1))
    record.observe("gpu0", VERDICTS["busy"], NOW)
    record.observe("gpu0", VERDICTS["wedged"], NOW + 1)
    record.restarts["gpu0"] = RestartHistory(failures=2, last_attempt_at=NOW)
    record.ledger.apply("gpu1", Retire(now=NOW, reason="card replaced"))
    changes = notes_of(record.reconcile({"gpu0": URL_2, "gpu1": URL_1}, NOW + 2))
    assert changes == [f"gpu0: moved from {URL_0} to {URL_2}; stays dead"]
    snapshot = record.ledger.snapshot("gpu0", NOW + 2)
    assert (snapshot.url, snapshot.state, snapshot.condemned_by) == (URL_2, State.DEAD, "wedged")
    assert record.restarts["gpu0"].failures == 2  # a config edit is no fresh budget
    assert record.ledger.by_url(URL_2) == "gpu0" and record.ledger.by_url(URL_0) is None
    # The process at the new address is not the one condemned: a new one, unproven.
    there = verdict(VerdictKind.BUSY, True, "x", reads=(readable(start=90.0),))
    assert [t.kind for t in record.observe("gpu0", there, NOW + 3)] == [EventKind.NEW_PROCESS_UP]
    assert record.ledger.state_of("gpu0") is State.STALE
    assert notes_of(record.reconcile({"gpu0": URL_2, "gpu1": URL_0}, NOW + 4)) == [
        f"gpu1: moved from {URL_1} to {URL_0}; stays retired"
    ]
    assert record.ledger.snapshot("gpu1", NOW + 4).state is State.RETIRED


def test_a_serving_backend_moved_to_another_process_is_an_unplanned_restart() -> None:
    record = record_of(("gpu0", URL_0))
    record.observe("gpu0", VERDICTS["busy"], NOW)
    assert notes_of(record.reconcile({"gpu0": URL_2}, NOW + 1)) == [
        f"gpu0: moved from {URL_0} to {URL_2}; stays healthy"
    ]
    assert record.ledger.epoch == 0  # the same names serve
    same = verdict(VerdictKind.BUSY, True, "x", reads=(readable(steps=150.0),))
    assert [t.kind for t in record.observe("gpu0", same, NOW + 2)] == [EventKind.GOOD_VERDICT]
    other = verdict(VerdictKind.BUSY, True, "x", reads=(readable(start=90.0),))
    transitions = record.observe("gpu0", other, NOW + 3)
    assert [t.kind for t in transitions] == [EventKind.UNPLANNED_RESTART]
    assert record.ledger.state_of("gpu0") is State.STALE


def test_one_edit_may_remove_a_backend_and_move_another_onto_its_address() -> None:
    # gpu1 decommissioned, gpu0 repointed at gpu1's host, gpu2 added at gpu0's old one:
    # moved before the removal, gpu0 collided with gpu1 and every settle failed.
    record = record_of(("gpu0", URL_0), ("gpu1", URL_1))
    changes = notes_of(record.reconcile({"gpu0": URL_1, "gpu2": URL_0}, NOW))
    assert changes == [
        "gpu1: no longer configured; forgotten (healthy)",
        f"gpu0: moved from {URL_0} to {URL_1}; stays healthy",
        f"gpu2: new backend at {URL_0}; starts HEALTHY",
    ]
    assert (record.ledger.by_url(URL_1), record.ledger.by_url(URL_0)) == ("gpu0", "gpu2")


def test_two_backends_that_swap_addresses_each_keep_their_own_state() -> None:
    record = record_of(("gpu0", URL_0), ("gpu1", URL_1))
    record.observe("gpu1", VERDICTS["wedged"], NOW)
    changes = notes_of(record.reconcile({"gpu0": URL_1, "gpu1": URL_0}, NOW + 1))
    assert len(changes) == 2
    assert (record.ledger.by_url(URL_1), record.ledger.by_url(URL_0)) == ("gpu0", "gpu1")
    assert record.ledger.state_of("gpu0") is State.HEALTHY
    assert record.ledger.state_of("gpu1") is State.DEAD
    with pytest.raises(ValueError, match="share the URL"):
        record.ledger.readdress({"gpu0": URL_0})  # gpu1 stays there


def test_reconcile_with_the_same_backends_changes_nothing() -> None:
    record = record_of(("gpu0", URL_0), ("gpu1", URL_1))
    record.observe("gpu0", VERDICTS["busy"], NOW)
    before = record.to_dict()
    assert notes_of(record.reconcile({"gpu1": URL_1, "gpu0": URL_0}, NOW + 1)) == []
    assert record.to_dict() == before


# --- walks over several runs with the real ledger ----------------------------------


def whole(record: FleetRecord, name: str = "gpu0") -> tuple[State, int, int, int]:
    snapshot = record.ledger.snapshot(name, NOW)
    return (
        snapshot.state,
        snapshot.probe_failures,
        snapshot.request_failures,
        record.ledger.epoch,
    )


def walk(record: FleetRecord, names: list[str]) -> list[tuple[State, int, int, int]]:
    """Observe one verdict per run, a minute apart; the whole state after each."""
    seen = [whole(record)]
    for run, name in enumerate(names, start=1):
        record.observe("gpu0", VERDICTS[name], NOW + 60 * run)
        seen.append(whole(record))
    return seen


H, S, D, T = State.HEALTHY, State.SUSPECT, State.DEAD, State.STALE


def test_three_downs_in_a_row_condemn_a_backend() -> None:
    record = record_of(("gpu0", URL_0))
    assert walk(record, ["down", "down", "down"]) == [
        (H, 0, 0, 0),
        (S, 1, 0, 0),
        (S, 2, 0, 0),
        (D, 3, 0, 1),
    ]
    assert record.ledger.snapshot("gpu0", NOW).condemned_by == "down"


def test_one_wedge_condemns_a_backend_at_once() -> None:
    record = record_of(("gpu0", URL_0))
    assert walk(record, ["wedged"]) == [(H, 0, 0, 0), (D, 0, 0, 1)]
    assert record.ledger.snapshot("gpu0", NOW).condemned_by == "wedged"


def test_a_dead_backend_comes_back_through_stale_and_the_epoch_moves_exactly_twice() -> None:
    record = record_of(("gpu0", URL_0))
    record.observe("gpu0", VERDICTS["wedged"], NOW)
    transitions = record.observe("gpu0", VERDICTS["restarted answered"], NOW + 60)
    assert [(t.from_state, t.to_state, t.epoch_changed) for t in transitions] == [
        (D, T, False),
        (T, H, True),
    ]
    assert whole(record) == (H, 0, 0, 2)
    assert record.ledger.snapshot("gpu0", NOW).condemned_by is None


def test_a_dead_backend_showing_work_from_the_same_process_stays_dead() -> None:
    record = record_of(("gpu0", URL_0))
    assert walk(record, ["wedged", "busy", "busy", "idle answered"]) == [
        (H, 0, 0, 0),
        (D, 0, 0, 1),
        (D, 0, 0, 1),
        (D, 0, 0, 1),
        (D, 0, 0, 1),
    ]


RECOVER = LedgerPolicy(recover_in_place=True)


def test_a_wedge_that_ends_brings_the_same_process_back_through_stale_under_recover_in_place() -> (
    None
):
    record = FleetRecord(Ledger(RECOVER, [("gpu0", URL_0)], now=0.0))
    record.observe("gpu0", VERDICTS["busy"], NOW)  # the process llmhealth knows
    record.observe("gpu0", VERDICTS["wedged"], NOW + 60)
    assert whole(record) == (D, 0, 0, 1)
    # The engine steps again, but until a request finishes that proves nothing.
    record.observe("gpu0", VERDICTS["busy"], NOW + 120)
    assert record.ledger.snapshot("gpu0", NOW).good_streak == 0
    seen = []
    for run, finished in enumerate((5.0, 8.0, 11.0), start=3):
        reads = (_finished_read(NOW + 60 * run - 0.3, finished - 1), _finished_read(NOW, finished))
        record.observe("gpu0", verdict(VerdictKind.BUSY, True, "x", reads=reads), NOW + 60 * run)
        seen.append(whole(record))
    assert seen == [(D, 0, 0, 1), (T, 0, 0, 1), (T, 0, 0, 1)]  # STALE: not serving yet
    record.observe("gpu0", VERDICTS["idle answered"], NOW + 600)  # re-admission's proof
    assert whole(record) == (H, 0, 0, 2)
    assert record.ledger.snapshot("gpu0", NOW).in_place_recoveries == 1


@pytest.mark.parametrize("policy", [POLICY, RECOVER], ids=["library", "recover_in_place"])
def test_the_same_process_answering_after_failed_reads_is_not_taken_for_a_new_one(
    policy: LedgerPolicy,
) -> None:
    # Three resets condemn it; then the very process last sighted (same start time, no
    # counter gone back) answers again. A lost route hid it, nothing replaced it: it is
    # judged as the same process, not waved through to STALE as a new one.
    record = FleetRecord(Ledger(policy, [("gpu0", URL_0)], now=0.0))
    record.observe("gpu0", VERDICTS["busy"], NOW)
    for run in range(1, 4):
        record.observe("gpu0", VERDICTS["down"], NOW + 60 * run)
    assert whole(record) == (D, 3, 0, 1)
    transitions = record.observe("gpu0", VERDICTS["busy"], NOW + 240)
    assert [t.kind for t in transitions] == [EventKind.GOOD_VERDICT]
    assert record.ledger.state_of("gpu0") is D
    # A process with another start time after the same spell is a new one.
    other = verdict(VerdictKind.BUSY, True, "x", reads=(readable(start=90.0),))
    assert [t.kind for t in record.observe("gpu0", other, NOW + 300)] == [EventKind.NEW_PROCESS_UP]


def idle_answered_without_start(at: float, *, steps: float) -> Verdict:
    """An idle engine of vLLM's multiprocess mode (no start time), its tiny request
    answered."""
    reads = (readable(at, start=None, running=0.0, steps=steps),)
    return verdict(
        VerdictKind.IDLE, True, "idle; tiny request answered", reads=reads, answer=ANSWERED
    )


def test_a_process_without_a_start_time_answering_after_a_refused_read_is_the_same_one() -> None:
    """vLLM in multiprocess mode shows no start time: after one refused read (a lost
    route) the condemned process itself came back as "new", serving again in the same
    settle, past a pending restart and the in-place cap. Its counters, none gone back,
    say it is the same process; one whose counters went back is another."""
    policy = replace(RECOVER, max_in_place_recoveries=0)
    record = FleetRecord(Ledger(policy, [("gpu0", URL_0)], now=0.0))
    frozen = (readable(NOW - 1, start=None), readable(NOW, start=None))
    record.observe("gpu0", verdict(VerdictKind.WEDGED, False, "wedged", reads=frozen), NOW)
    assert record.ledger.state_of("gpu0") is D
    record.observe("gpu0", VERDICTS["down"], NOW + 5, restart_pending=True)
    same = idle_answered_without_start(NOW + 10, steps=140.0)
    transitions = record.observe("gpu0", same, NOW + 10, restart_pending=True)
    assert not any(t.kind is EventKind.NEW_PROCESS_UP for t in transitions)
    assert record.ledger.state_of("gpu0") is D
    record.observe("gpu0", VERDICTS["down"], NOW + 15, restart_pending=True)
    other = idle_answered_without_start(NOW + 20, steps=3.0)
    transitions = record.observe("gpu0", other, NOW + 20, restart_pending=True)
    assert [t.kind for t in transitions][:1] == [EventKind.NEW_PROCESS_UP]


def test_after_our_restart_metrics_again_without_a_start_time_are_the_replacement() -> None:
    """Counters at or above the old ones prove nothing without a start time: a process
    that wedged young is replaced by one whose counters are as low. After a restart we
    issued, what answers after the refused reads is the replacement, or a working one
    sat out its startup grace and counted as a failed restart."""
    record = FleetRecord(Ledger(RECOVER, [("gpu0", URL_0)], now=0.0))
    young = (readable(NOW - 1, start=None, steps=0.0), readable(NOW, start=None, steps=0.0))
    record.observe("gpu0", verdict(VerdictKind.WEDGED, False, "wedged", reads=young), NOW)
    record.ledger.apply("gpu0", RestartIssued(now=NOW + 1))
    record.observe("gpu0", VERDICTS["down"], NOW + 5)  # the old process gone
    fresh = idle_answered_without_start(NOW + 30, steps=5.0)
    transitions = record.observe("gpu0", fresh, NOW + 30)
    assert [t.kind for t in transitions] == [EventKind.NEW_PROCESS_UP, EventKind.READMITTED]
    assert record.ledger.state_of("gpu0") is H


def test_a_read_after_the_restart_command_ended_is_the_replacement_unless_it_is_the_old_one() -> (
    None
):
    """Without start times, a replacement whose counters passed the wedged process's is
    told by the reads since our command exited 0: any counter unlike the process the
    restart replaced makes it the replacement; all alike, the wedged process still
    answers; and a read from before the command ended decides nothing."""
    wedged = signals(start=None, steps=100.0)
    previous = Sighting(EARLIER, True, wedged)
    ended = NOW - 10.0

    def kinds(read_at: float, steps: float) -> list[EventKind]:
        reads = (readable(read_at, start=None, running=0.0, steps=steps),)
        idle = verdict(VerdictKind.IDLE, True, "idle", reads=reads, answer=ANSWERED)
        events = events_for(
            idle,
            State.RESTARTING,
            now=NOW,
            previous=previous,
            command_ended_at=ended,
            restarted_from=process_of(wedged),
        )
        return [event.kind for event in events]

    # Steps and tokens moved on, finished and prompt tokens did not: still another process.
    assert kinds(NOW, 140.0) == [EventKind.NEW_PROCESS_UP, EventKind.READMITTED]
    assert kinds(NOW, 100.0) == []
    assert kinds(ended, 140.0) == []


def test_a_dead_backend_with_a_restart_pending_says_so_to_the_ledger_and_stays_dead() -> None:
    record = FleetRecord(Ledger(RECOVER, [("gpu0", URL_0)], now=0.0))
    record.observe("gpu0", VERDICTS["busy"], NOW)
    record.observe("gpu0", VERDICTS["wedged"], NOW + 1)
    for run in range(4):
        (t,) = record.observe("gpu0", VERDICTS["busy"], NOW + 2 + run, restart_pending=True)
        assert not t.applied and "a restart is pending" in t.reason
    assert whole(record) == (D, 0, 0, 1)


def test_a_dead_backend_answering_for_another_model_shows_no_proof() -> None:
    wrong = events_for(
        VERDICTS["idle answered"], State.DEAD, now=NOW, previous=None, expected_model="big"
    )
    assert wrong == []


def _finished_read(at: float, finished: float, start: float = 50.0) -> Read:
    engine = EngineSignals(engine="0", running=2.0, waiting=0.0, steps=at, finished=finished)
    return Read(at, Signals(engines=(engine,), process_start=start))


def test_requests_finishing_are_seen_over_the_reads_or_since_the_last_sighting() -> None:
    climbing = verdict(
        VerdictKind.BUSY, True, "x", reads=(_finished_read(1.0, 5.0), _finished_read(2.0, 7.0))
    )
    flat = verdict(
        VerdictKind.BUSY, True, "x", reads=(_finished_read(1.0, 5.0), _finished_read(2.0, 5.0))
    )
    assert requests_finished(climbing, None)
    assert not requests_finished(flat, None)
    before = Sighting(EARLIER, True, _finished_read(0.0, 4.0).signals)
    assert requests_finished(flat, before)
    # Never across a restart: a new process's count says nothing against the old one's.
    restarted = verdict(VerdictKind.RESTARTED, True, "x", reads=(_finished_read(2.0, 9.0, 90.0),))
    assert not requests_finished(restarted, before)
    busy = events_for(climbing, State.DEAD, now=NOW, previous=None)
    assert [e.requests_finished for e in busy if isinstance(e, GoodVerdict)] == [True]


def test_a_stale_backend_whose_requests_finish_is_reported_working_not_readmitted() -> None:
    climbing = verdict(
        VerdictKind.BUSY, True, "x", reads=(_finished_read(1.0, 5.0), _finished_read(2.0, 7.0))
    )
    events = events_for(climbing, State.STALE, now=NOW, previous=None)
    assert [(type(e), getattr(e, "requests_finished", None)) for e in events] == [
        (GoodVerdict, True)
    ]
    assert not any(isinstance(e, Readmitted) for e in events)


def test_a_refused_backend_that_shows_work_again_must_still_be_readmitted() -> None:
    record = record_of(("gpu0", URL_0))
    assert walk(record, ["down", "down", "down", "busy", "busy", "idle answered"]) == [
        (H, 0, 0, 0),
        (S, 1, 0, 0),
        (S, 2, 0, 0),
        (D, 3, 0, 1),
        (T, 0, 0, 1),  # metrics again after refusal: a new process, unproven
        (T, 0, 0, 1),  # good probes never readmit
        (H, 0, 0, 2),  # the tiny request did
    ]


def test_busy_verdicts_do_not_clear_a_request_failure_streak() -> None:
    record = record_of(("gpu0", URL_0))
    assert walk(record, ["idle unanswered", "busy", "busy", "busy"]) == [
        (H, 0, 0, 0),
        (S, 0, 1, 0),
        (S, 0, 1, 0),
        (S, 0, 1, 0),
        (S, 0, 1, 0),
    ]
    # Only an answered request clears it.
    record.observe("gpu0", VERDICTS["idle answered"], NOW + 600)
    assert whole(record) == (H, 0, 0, 0)


def test_request_failures_between_busy_verdicts_still_condemn() -> None:
    record = record_of(("gpu0", URL_0))
    seen = walk(record, ["idle unanswered", "busy", "idle unanswered", "busy", "idle unanswered"])
    assert seen[-1] == (D, 0, 3, 1)
    assert record.ledger.snapshot("gpu0", NOW).condemned_by == "unanswered"


def test_a_serving_backend_that_restarted_and_answered_is_readmitted_in_the_same_run() -> None:
    record = record_of(("gpu0", URL_0))
    transitions = record.observe("gpu0", VERDICTS["restarted answered"], NOW)
    assert [(t.kind, t.from_state, t.to_state) for t in transitions] == [
        (EventKind.UNPLANNED_RESTART, H, T),
        (EventKind.READMITTED, T, H),
    ]
    assert record.ledger.epoch == 2


def test_a_serving_backend_that_restarted_unanswered_is_withheld_from_traffic() -> None:
    record = record_of(("gpu0", URL_0))
    assert walk(record, ["restarted failed", "down", "down", "down", "down"]) == [
        (H, 0, 0, 0),
        (T, 0, 0, 1),
        # STALE notes failures but never condemns: a new process may still be loading.
        (T, 1, 0, 1),
        (T, 2, 0, 1),
        (T, 3, 0, 1),
        (T, 4, 0, 1),
    ]


def test_a_retired_backend_ignores_every_verdict() -> None:
    record = record_of(("gpu0", URL_0))
    record.ledger.apply("gpu0", Retire(now=NOW, reason="restart budget spent"))
    before = record.ledger.to_dict()
    for made in VERDICTS.values():
        assert record.observe("gpu0", made, NOW + 1) == []
    assert record.ledger.to_dict() == before


# --- encoding ----------------------------------------------------------------------


def rich_record() -> FleetRecord:
    """A record with something in every part: states, baselines, holds, restarts."""
    record = record_of(("gpu0", URL_0), ("gpu1", URL_1), ("gpu2", URL_2))
    record.observe("gpu0", VERDICTS["busy"], NOW)
    record.observe("gpu1", VERDICTS["wedged"], NOW)
    record.observe("gpu2", VERDICTS["down"], NOW)
    multiproc = Signals(
        engines=(EngineSignals("0", steps=5.0), EngineSignals("1", finished=2.0)),
        process_start=None,
    )
    record.sightings["gpu2"] = Sighting(NOW + 1, False, multiproc, LONG_STEP)
    record.holds["gpu1"] = Hold(reason="weight sync", until=NOW + 600, by="trainer")
    record.restarts["gpu1"] = RestartHistory(failures=2, last_attempt_at=NOW - 30)
    return record


def test_a_record_survives_to_dict_and_from_dict() -> None:
    record = rich_record()
    decoded = FleetRecord.from_dict(record.to_dict(), POLICY)
    assert decoded.to_dict() == record.to_dict()
    assert decoded.holds == record.holds
    assert decoded.restarts == record.restarts


def test_a_record_survives_a_trip_through_json_text() -> None:
    record = rich_record()
    text = json.dumps(record.to_dict())
    decoded = FleetRecord.from_dict(json.loads(text), POLICY)
    assert json.dumps(decoded.to_dict()) == text
    # The baselines keep what a restart would reset: the start time and the counters.
    for name, sighting in record.sightings.items():
        baseline, restored = sighting.baseline, decoded.sightings[name].baseline
        assert baseline is not None and restored is not None
        assert restored.process_start == baseline.process_start
        assert [e.counters for e in restored.engines] == [e.counters for e in baseline.engines]


def big_record(size: int) -> FleetRecord:
    """``size`` backends, each observed once, in a mix of states."""
    names = [(f"gpu{i:05d}", f"http://10.{i // 250}.{i % 250}.1:8000") for i in range(size)]
    record = record_of(*names)
    kinds = ("busy", "wedged", "down")
    for i, (name, _) in enumerate(names):
        record.observe(name, VERDICTS[kinds[i % 3]], NOW)
    return record


@pytest.mark.parametrize("size", [3, 64, 65, 300])
def test_the_saved_document_writes_what_to_dict_holds_byte_for_byte(size: int) -> None:
    # Its ledger entries are made as they are written (rows.py), every writer alike.
    record = big_record(size)
    whole = json.dumps(record.to_dict(), sort_keys=True).encode()
    assert b"".join(encode_pieces(record.to_document())) == whole
    assert json.dumps(record.to_document(), sort_keys=True, default=plain).encode() == whole


@pytest.mark.slow
def test_writing_the_saved_document_never_holds_every_entry_at_once() -> None:
    # Every entry's and sighting's dict at once was about 1.5 KB per backend of a settle's
    # peak at 3,000.
    record = big_record(3000)

    def peak_of(write: Callable[[], object]) -> int:
        tracemalloc.start()
        try:
            write()
            return tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()

    as_rows = peak_of(lambda: sum(map(len, encode_pieces(record.to_document()))))
    every_entry = peak_of(lambda: sum(map(len, encode_pieces(record.to_dict()))))
    assert as_rows * 4 < every_entry, (as_rows, every_entry)


def test_a_decoded_baseline_still_reveals_a_restart() -> None:
    record = rich_record()
    decoded = FleetRecord.from_dict(json.loads(json.dumps(record.to_dict())), POLICY)
    events = events_for(
        VERDICTS["restarted answered"],
        decoded.ledger.state_of("gpu0"),
        now=NOW,
        previous=decoded.sightings["gpu0"],
    )
    assert [_without_process(event) for event in events] == [UNPLANNED, READMIT]


def valid_document() -> dict[str, Any]:
    document: dict[str, Any] = json.loads(json.dumps(rich_record().to_dict()))
    return document


Mutation = Callable[[dict[str, Any]], None]


def _set(path: tuple[str | int, ...], value: object) -> Mutation:
    def mutate(document: dict[str, Any]) -> None:
        target: Any = document
        for key in path[:-1]:
            target = target[key]
        target[path[-1]] = value

    return mutate


def _delete(path: tuple[str | int, ...]) -> Mutation:
    def mutate(document: dict[str, Any]) -> None:
        target: Any = document
        for key in path[:-1]:
            target = target[key]
        del target[path[-1]]

    return mutate


MALFORMED: list[tuple[str, Mutation, str]] = [
    ("no ledger", _delete(("ledger",)), "ledger"),
    ("ledger not a table", _set(("ledger",), []), "ledger"),
    ("unknown state", _set(("ledger", "backends", 0, "state"), "zombie"), "backends[0].state"),
    ("negative streak", _set(("ledger", "backends", 1, "probe_failures"), -1), "backends[1]"),
    ("epoch a string", _set(("ledger", "epoch"), "7"), "epoch"),
    ("sightings a list", _set(("sightings",), []), "sightings"),
    ("sighting a number", _set(("sightings", "gpu0"), 3), "sightings.gpu0"),
    ("sighting time a string", _set(("sightings", "gpu0", "at"), "noon"), "sightings.gpu0.at"),
    ("sighting time NaN", _set(("sightings", "gpu0", "at"), math.nan), "sightings.gpu0.at"),
    ("sighting time missing", _delete(("sightings", "gpu0", "at")), "sightings.gpu0.at"),
    (
        "reachable a string",
        _set(("sightings", "gpu0", "reachable"), "yes"),
        "sightings.gpu0.reachable",
    ),
    ("baseline a list", _set(("sightings", "gpu0", "baseline"), []), "sightings.gpu0.baseline"),
    ("engines missing", _delete(("sightings", "gpu0", "baseline", "engines")), "sightings.gpu0"),
    (
        "counter a string",
        _set(("sightings", "gpu0", "baseline", "engines", "0", "steps"), "many"),
        "steps",
    ),
    ("start time a bool", _set(("sightings", "gpu0", "baseline", "process_start"), True), "gpu0"),
    (
        "longest step negative",
        _set(("sightings", "gpu2", "longest_step", "seconds"), -1),
        "sightings.gpu2.longest_step.seconds",
    ),
    (
        "longest step without why",
        _delete(("sightings", "gpu2", "longest_step", "why")),
        "sightings.gpu2.longest_step.why",
    ),
    ("holds a string", _set(("holds",), "none"), "holds"),
    ("hold until a string", _set(("holds", "gpu1", "until"), "later"), "holds.gpu1.until"),
    ("hold without reason", _delete(("holds", "gpu1", "reason")), "holds.gpu1"),
    ("restart failures negative", _set(("restarts", "gpu1", "failures"), -1), "restarts.gpu1"),
    ("restarts a list", _set(("restarts",), [1]), "restarts"),
]


@pytest.mark.parametrize(
    ("mutation", "where"), [(m, w) for _, m, w in MALFORMED], ids=[n for n, _, _ in MALFORMED]
)
def test_a_malformed_document_is_a_value_error_naming_where(mutation: Mutation, where: str) -> None:
    document = valid_document()
    mutation(document)
    with pytest.raises(ValueError, match=r".") as caught:
        FleetRecord.from_dict(document, POLICY)
    assert where in str(caught.value)


def test_a_bad_baseline_counter_is_named_by_its_full_path() -> None:
    document = valid_document()
    document["sightings"]["gpu0"]["baseline"]["engines"]["0"]["steps"] = "many"
    with pytest.raises(ValueError, match=r"sightings\.gpu0\.baseline\.engines\.0\.steps"):
        FleetRecord.from_dict(document, POLICY)


@pytest.mark.parametrize(
    "path",
    [("sightings", "gpu0", "at"), ("ledger", "backends", 0, "last_ok_at")],
    ids=["sighting time", "ledger time"],
)
def test_a_number_too_large_for_a_float_is_a_value_error(path: tuple[str | int, ...]) -> None:
    document = valid_document()
    _set(path, 10**400)(document)
    with pytest.raises(ValueError, match=r"."):
        FleetRecord.from_dict(document, POLICY)


# Random damage to a valid document. Integers stay within what a float can hold: the
# overflow above is pinned by its own test, so this one keeps looking for other faults.
json_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**63), max_value=2**63),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=8),
)
json_values = st.recursive(
    json_scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=6), inner, max_size=3)
    ),
    max_leaves=6,
)


def _containers(value: object, path: tuple[str | int, ...] = ()) -> list[tuple[str | int, ...]]:
    """The path of every dict and list inside a document, the root included."""
    if not isinstance(value, dict | list):
        return []
    found = [path]
    if isinstance(value, dict):
        for key, item in value.items():
            found += _containers(item, (*path, key))
    elif isinstance(value, list):
        for index, item in enumerate(value):
            found += _containers(item, (*path, index))
    return found


@st.composite
def damaged_documents(draw: st.DrawFn) -> dict[str, Any]:
    document = valid_document()
    for _ in range(draw(st.integers(min_value=1, max_value=3))):
        places = _containers(document)
        path = draw(st.sampled_from(places))
        target: Any = document
        for key in path:
            target = target[key]
        keys = list(target) if isinstance(target, dict) else list(range(len(target)))
        action = draw(st.sampled_from(["replace", "delete", "add"] if keys else ["add"]))
        if action == "add":
            if isinstance(target, dict):
                target[draw(st.text(max_size=6))] = draw(json_values)
            else:
                target.append(draw(json_values))
        elif action == "delete":
            del target[draw(st.sampled_from(keys))]
        else:
            target[draw(st.sampled_from(keys))] = draw(json_values)
    return document


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(damaged_documents())
def test_a_randomly_damaged_document_decodes_or_is_a_value_error(document: dict[str, Any]) -> None:
    try:
        record = FleetRecord.from_dict(document, POLICY)
    except ValueError as exc:
        assert str(exc)
        return
    # Whatever was accepted is a record that encodes and decodes to itself.
    encoded = json.loads(json.dumps(record.to_dict()))
    assert FleetRecord.from_dict(encoded, POLICY).to_dict() == encoded


@pytest.mark.parametrize("state", [State.RESTARTING, State.DEAD])
def test_a_process_other_than_the_one_sighted_is_a_new_process_even_unannounced(
    state: State,
) -> None:
    # The read window that would have said "restarted" started afresh (a failed read, or
    # a daemon that took over from another): the record's sighting still knows the old one.
    old = Sighting(EARLIER, True, signals(start=50.0))
    new = verdict(
        VerdictKind.IDLE,
        True,
        "no work (0 running, 0 waiting); tiny request answered in 0.05 s by model tiny",
        reads=(readable(running=0.0, start=90.0, steps=3.0),),
        answer=ANSWERED,
    )
    events = events_for(new, state, now=NOW, previous=old)
    assert [type(event) for event in events] == [NewProcessUp, Readmitted]
    # The same process, or nothing sighted to compare with, is no news.
    same = replace(new, reads=(readable(running=0.0, start=50.0, steps=140.0),))
    assert not any(
        isinstance(e, NewProcessUp) for e in events_for(same, state, now=NOW, previous=old)
    )
    assert not any(
        isinstance(e, NewProcessUp) for e in events_for(new, state, now=NOW, previous=None)
    )
    # A counter that went back is another process too, where no start time is shown.
    multiproc_old = Sighting(EARLIER, True, signals(start=None, steps=500.0))
    multiproc_new = replace(new, reads=(readable(running=0.0, start=None, steps=3.0),))
    events = events_for(multiproc_new, state, now=NOW, previous=multiproc_old)
    assert [type(event) for event in events] == [NewProcessUp, Readmitted]


def test_a_restart_the_window_missed_still_ends_restarting() -> None:
    record = record_of(("gpu0", URL_0))
    record.observe("gpu0", VERDICTS["busy"], NOW)
    record.observe("gpu0", VERDICTS["wedged"], NOW + 1)
    record.ledger.apply("gpu0", RestartIssued(now=NOW + 2))
    assert record.ledger.state_of("gpu0") is State.RESTARTING
    fresh = verdict(
        VerdictKind.IDLE,
        True,
        "no work (0 running, 0 waiting); tiny request answered in 0.05 s by model tiny",
        reads=(readable(running=0.0, start=999.0, steps=1.0),),
        answer=ANSWERED,
    )
    record.observe("gpu0", fresh, NOW + 3)
    assert record.ledger.state_of("gpu0") is State.HEALTHY


def test_a_command_that_outlived_its_kill_or_never_ran_fails_its_restart() -> None:
    command = ("restart-gpu0",)
    order = RestartOrder("gpu0", URL_0, command, 60.0, NOW + 2, "wedged", {})
    timed_out = CommandDone(order, CommandResult(command, None, True, 60.0, "", ""))
    unkillable = record_of(("gpu0", URL_0))
    unkillable.observe("gpu0", VERDICTS["busy"], NOW)
    unkillable.observe("gpu0", VERDICTS["wedged"], NOW + 1)
    unkillable.ledger.apply("gpu0", RestartIssued(now=NOW + 2))
    hear_commands(unkillable, [timed_out], None, NOW + 70)  # it outlived SIGKILL: no code
    assert unkillable.ledger.snapshot("gpu0", NOW + 70).last_error.endswith(
        "restart command timed out"
    )
    dropped = not_run(order, "no thread to run it in")
    assert dropped.result.exit_code is None and not dropped.result.ok
    assert dropped.result.stderr == "not run: no thread to run it in"


# --- whether the reads keep up with the wait -----------------------------------------------


def test_targets_read_once_per_wait_are_read_once_per_wait() -> None:
    # Heard a few ms either side of the wait, and each due again within it.
    gaps = [(5.003, 1.2), (4.998, 4.9), (5.0, 0.0)]
    assert reads_per_wait(gaps, 5.0) == pytest.approx(1.0, abs=0.001)
    # A target examined once so far counts as on time until a wait has gone by.
    assert reads_per_wait([(None, 3.0)], 5.0) == 1.0


def test_reads_that_fall_behind_show_below_the_mark() -> None:
    # A saturated loop reaching each of its targets every 12-14 s against a 5 s wait.
    pace = reads_per_wait([(12.0, 2.0), (13.0, 0.5), (14.0, 9.0)], 5.0)
    assert pace == pytest.approx(5.0 / 13.0)
    assert pace is not None and pace < READS_KEEP_UP


def test_a_few_targets_slow_to_answer_do_not_make_the_fleet_behind() -> None:
    # One target of five whose read times out after four waits: its own verdict says so.
    gaps = [(1.0, 0.3)] * 4 + [(4.0, 1.0)]
    assert reads_per_wait(gaps, 1.0) == 1.0
    # A fleet read alone, by a read that times out: the figure is that target's.
    assert reads_per_wait([(4.0, 1.0)], 1.0) == pytest.approx(0.25)


def test_an_overdue_examination_counts_before_it_is_heard() -> None:
    # On time until now, but nothing heard for 20 s: late now, not when it comes back.
    assert reads_per_wait([(5.0, 20.0)], 5.0) == pytest.approx(0.25)
    assert reads_per_wait([(None, 10.0)], 5.0) == pytest.approx(0.5)


def test_one_late_read_moves_a_targets_average_gap_a_little_and_lasting_ones_a_lot() -> None:
    average = None
    for gap in (5.0, 5.0, 6.5, 4.0, 5.0):  # a settle delayed one read by 1.5 s
        average = smoothed_gap(average, gap, 5.0)
        pace = reads_per_wait([(average, 1.0)], 5.0)
        assert pace is not None and pace >= 0.95
    # Reads every 13 s against a 5 s wait: behind from the first such gap, then more so.
    paces = []
    for _ in range(10):
        average = smoothed_gap(average, 13.0, 5.0)
        paces.append(reads_per_wait([(average, 1.0)], 5.0))
    assert all(pace is not None and pace < READS_KEEP_UP for pace in paces)
    assert paces == sorted(paces, reverse=True)
    assert paces[-1] == pytest.approx(5.0 / average)


def test_a_targets_first_gap_moves_from_the_wait_not_to_it() -> None:
    # The first gap may follow a start-up burst: it is one gap, not the average.
    assert smoothed_gap(None, 6.5, 5.0) == pytest.approx(5.0 + 0.13 * 1.5)
    assert smoothed_gap(5.0, 5.0, 5.0) == 5.0


def test_the_average_gap_covers_the_same_time_however_often_a_target_is_read() -> None:
    # From an average of one 3 s wait: a minute of reads every 5 s (12 gaps) and a minute
    # of reads every 15 s (4 gaps) each move it about as far toward their own gap.
    every_five = every_fifteen = 3.0
    for _ in range(12):
        every_five = smoothed_gap(every_five, 5.0, 3.0)
    for _ in range(4):
        every_fifteen = smoothed_gap(every_fifteen, 15.0, 3.0)
    moved_five = (every_five - 3.0) / (5.0 - 3.0)
    moved_fifteen = (every_fifteen - 3.0) / (15.0 - 3.0)
    assert 0.8 < moved_five < 1.0 and 0.8 < moved_fifteen < 1.0
    assert moved_fifteen == pytest.approx(moved_five, abs=0.1)
    # A gap ten waits long or more replaces the average outright.
    assert smoothed_gap(3.0, 40.0, 3.0) == 40.0


def test_nothing_examined_or_no_wait_is_no_figure() -> None:
    assert reads_per_wait([], 5.0) is None
    assert reads_per_wait([(5.0, 1.0)], 0.0) is None


def test_the_floor_a_record_was_saved_with_is_read_back_strictly() -> None:
    policy = LedgerPolicy(min_healthy=3)
    record = FleetRecord(Ledger(policy, [("a", "http://127.0.0.1:8000")], now=0.0))
    document = json.loads(b"".join(encode_pieces(record.to_document())))
    assert saved_floor(document) == 3
    assert saved_floor({}) is None  # a record from before it was saved
    for odd in (True, -1, 2.0, "3"):
        with pytest.raises(ValueError, match="min_healthy"):
            saved_floor({"min_healthy": odd})


def test_a_dead_backend_dropped_and_added_back_whose_process_is_down_is_still_restarted() -> None:
    """Forgotten while DEAD and added back STALE (as it once was), a backend whose
    process is down stayed STALE for ever: a STALE one without a restart of ours is never
    condemned by failures nor failed by a startup grace, so it was never restarted.
    Back DEAD for what condemned it, the restart policy acts on it."""
    policy = Policy(restart_on=("wedged", "down"))
    ledger_policy = LedgerPolicy(startup_grace=policy.startup_grace)
    record = FleetRecord(Ledger(ledger_policy, [("gpu0", URL_0), ("gpu1", URL_1)], now=0.0))
    backends = {
        "gpu0": Backend("gpu0", URL_0, restart=("systemctl", "restart", "vllm@0")),
        "gpu1": Backend("gpu1", URL_1, restart=("systemctl", "restart", "vllm@1")),
    }
    for i in range(3):
        record.observe("gpu1", VERDICTS["down"], NOW + i)
    assert record.ledger.state_of("gpu1") is State.DEAD
    record.reconcile({"gpu0": URL_0}, NOW + 5)  # an edit ...
    record = FleetRecord.from_dict(json.loads(json.dumps(record.to_dict())), ledger_policy)
    record.reconcile({"gpu0": URL_0, "gpu1": URL_1}, NOW + 10)  # ... undone
    # Its process is still down: read every 5 s for two startup graces.
    restarted = False
    t = NOW + 10
    while t < NOW + 10 + 2 * policy.startup_grace and not restarted:
        t += 5.0
        record.observe("gpu1", VERDICTS["down"], t)
        record.ledger.expire_restarts(t)
        decisions = plan_restarts(record.ledger, backends, {}, {}, policy, t)
        restarted = any(d.name == "gpu1" and d.action is Action.RESTART for d in decisions)
    assert restarted, f"gpu1 left {record.ledger.state_of('gpu1')}, never restarted"


def test_a_damaged_withheld_backend_makes_the_record_unreadable_at_once() -> None:
    # Found only when the backend came back to the config, it would have failed that
    # reload; read with the rest, the record is set aside as any malformed one is.
    record = record_of(("gpu0", URL_0), ("gpu1", URL_1))
    record.observe("gpu1", VERDICTS["busy"], NOW)
    record.observe("gpu1", VERDICTS["wedged"], NOW + 1)
    record.reconcile({"gpu0": URL_0}, NOW + 2)
    document = json.loads(json.dumps(record.to_dict()))
    assert FleetRecord.from_dict(document, POLICY).withheld_forgotten.keys() == {"gpu1"}
    document["withheld_forgotten"]["gpu1"]["proof"] = ["wedged"]
    with pytest.raises(ValueError, match="proof"):
        FleetRecord.from_dict(document, POLICY)
    document["withheld_forgotten"]["gpu1"]["proof"] = None
    document["withheld_forgotten"]["gpu1"]["entry"]["state"] = "sleeping"
    with pytest.raises(ValueError, match="state"):
        FleetRecord.from_dict(document, POLICY)
    document["withheld_forgotten"]["gpu1"] = {"at": NOW}
    with pytest.raises(ValueError):
        FleetRecord.from_dict(document, POLICY)


def test_a_dead_backend_dropped_and_added_back_keeps_its_restart_cooldown() -> None:
    """Three failed restarts in a row: the next waits cooldown * 2**3 (8 min). Forgotten
    and added back "as it left", its RestartHistory was dropped with the rest of the
    record's per-backend tables: the cooldown fell back to the base minute and a
    restart that keeps failing was run again 7 minutes early (and every config flap
    resets the back-off)."""
    policy = Policy(restart_on=("down",))
    ledger_policy = LedgerPolicy(startup_grace=policy.startup_grace)
    record = FleetRecord(Ledger(ledger_policy, [("gpu0", URL_0), ("gpu1", URL_1)], now=0.0))
    backends = {
        "gpu0": Backend("gpu0", URL_0, restart=("true",)),
        "gpu1": Backend("gpu1", URL_1, restart=("true",)),
    }
    for i in range(3):
        record.observe("gpu1", VERDICTS["down"], NOW + i)
    assert record.ledger.state_of("gpu1") is State.DEAD
    t = NOW + 10
    for _ in range(3):  # three restarts whose command failed
        assert record.ledger.apply("gpu1", RestartIssued(now=t)).to_state is State.RESTARTING
        history = record.restarts.get("gpu1", RestartHistory())
        record.restarts["gpu1"] = history.record_attempt(t)
        record.ledger.apply("gpu1", RestartFailed(now=t + 1, reason="restart command exited 1"))
        record.restart_failed("gpu1")
        t += 2000.0
    last = t - 2000.0
    probe = last + 120.0  # 2 min after the last attempt: inside 8 min of back-off

    def decision(rec: FleetRecord) -> Action:
        decisions = plan_restarts(rec.ledger, backends, {}, rec.restarts, policy, probe)
        (d,) = [d for d in decisions if d.name == "gpu1"]
        return d.action

    assert decision(record) is Action.SKIP  # cooling down, before the edit
    record.reconcile({"gpu0": URL_0}, last + 60)  # an edit ...
    record = FleetRecord.from_dict(json.loads(json.dumps(record.to_dict())), ledger_policy)
    changes = record.reconcile({"gpu0": URL_0, "gpu1": URL_1}, last + 90)  # ... undone
    assert [(c.name, c.state) for c in changes] == [("gpu1", State.DEAD)]
    assert decision(record) is Action.SKIP, "the restart back-off was forgotten"


def test_a_fleet_within_the_documented_size_still_fits_etcd_after_churn() -> None:
    """README: the record is one etcd value, under etcd's default 1.5 MiB request limit
    up to about 1,500 backends. Each backend forgotten while withheld now keeps its whole
    ledger entry and sighting (about 800 bytes, was about 30), 1,024 of them: a fleet of
    1,400 whose dead nodes were taken out of the config over time no longer fits, and
    every settle is refused by etcd."""
    live, gone = 1400, 1024
    names = [
        (f"gpu{i}", f"http://10.{i // 62500}.{i // 250 % 250}.{i % 250}:8000")
        for i in range(live + gone)
    ]
    record = FleetRecord(Ledger(LedgerPolicy(), names, now=1.0))
    engine = EngineSignals("0", 4, 8, 1200.0, 4800.0, 9600.0, 30.0, 0.0, 0.3)
    busy = Verdict(VerdictKind.BUSY, True, "busy")
    down = Verdict(VerdictKind.DOWN, False, "down: connection refused")
    for i, (name, _) in enumerate(names):
        record.observe(name, busy, 2.0)
        if i >= live:
            for k in range(3):
                record.observe(name, down, 3.0 + k)
        record.sightings[name] = Sighting(2.0, True, Signals((engine,), 1_796_000_000.0))
        if i >= live:  # a wedge's evidence names every engine's frozen numbers
            record.proofs[name] = {"verdict": "wedged", "evidence": "e" * 600, "reads": []}
    record.reconcile(dict(names[:live]), 10.0)
    assert record.withheld_forgotten
    size = len(json.dumps(record.to_dict(), sort_keys=True).encode())
    assert size < 1_572_864 - 64 * 1024, f"{size} bytes: over etcd's default request limit"


# --- a condemned server's record follows the server, whatever the config calls it ----


def wedged_gpu0(*others: tuple[str, str]) -> FleetRecord:
    record = record_of(("gpu0", URL_0), *others)
    record.observe("gpu0", VERDICTS["busy"], NOW)
    record.observe("gpu0", VERDICTS["wedged"], NOW + 1)
    record.restarts["gpu0"] = RestartHistory(failures=2, last_attempt_at=NOW)
    return record


def saved(record: FleetRecord) -> FleetRecord:
    return FleetRecord.from_dict(
        json.loads(json.dumps(record.to_document(), default=plain)), POLICY
    )


@pytest.mark.parametrize("retired", [False, True], ids=["dead", "retired"])
def test_a_new_name_at_a_forgotten_condemned_server_is_that_backend_renamed(retired: bool) -> None:
    """Dropped from the config in one run and configured under a new name in a later
    one, a wedged (or retired) server came in as a new backend, HEALTHY and serving."""
    record = wedged_gpu0(("gpu1", URL_1))
    if retired:
        record.ledger.apply("gpu0", Retire(now=NOW + 1, reason="bad HBM"))
    record.reconcile({"gpu1": URL_1}, NOW + 2)
    again = saved(record)
    changes = again.reconcile({"gpu1": URL_1, "node-a": "http://10.0.0.5:08000"}, NOW + 3)
    expected = State.RETIRED if retired else State.DEAD
    first = changes[0]
    assert (first.name, first.event, first.state, first.was) == (
        "node-a",
        "renamed",
        expected,
        "gpu0",
    )
    assert again.ledger.state_of("node-a") is expected
    assert again.ledger.serving == ("gpu1",)
    assert again.ledger.url_of("node-a") == "http://10.0.0.5:08000"  # as configured
    if not retired:
        assert again.ledger.snapshot("node-a", NOW + 3).condemned_by == "wedged"
        assert again.restarts["node-a"].failures == 2  # a new name is no fresh budget
    assert again.withheld_forgotten == {} and again.retired_forgotten == {}


def test_a_backend_moved_onto_a_forgotten_condemned_server_takes_its_condemnation() -> None:
    record = wedged_gpu0(("gpu1", URL_1))
    record.reconcile({"gpu1": URL_1}, NOW + 2)
    again = saved(record)
    changes = again.reconcile({"gpu1": URL_0}, NOW + 3)
    assert [(c.name, c.event) for c in changes] == [("gpu1", "forgotten"), ("gpu1", "renamed")]
    assert again.ledger.state_of("gpu1") is State.DEAD
    assert again.ledger.serving == ()


def test_one_edit_that_shifts_names_onto_a_condemned_server_keeps_it_condemned() -> None:
    """{gpu0 (wedged): u0, gpu1: u1} -> {gpu1: u0, gpu2: u1}: gpu1 moved onto the wedged
    server, HEALTHY and serving there."""
    record = wedged_gpu0(("gpu1", URL_1))
    epoch = record.ledger.epoch
    changes = record.reconcile({"gpu1": URL_0, "gpu2": URL_1}, NOW + 2)
    assert [(c.name, c.event, c.state) for c in changes] == [
        ("gpu1", "forgotten", State.HEALTHY),
        ("gpu1", "renamed", State.DEAD),
        ("gpu2", "added", State.HEALTHY),
    ]
    assert record.ledger.state_of("gpu1") is State.DEAD
    assert record.ledger.by_url(URL_0) == "gpu1" and record.ledger.by_url(URL_1) == "gpu2"
    assert record.restarts["gpu1"].failures == 2
    assert record.fresh_since["gpu1"] == NOW + 2  # gpu1's drained requests were at u1
    assert record.ledger.serving == ("gpu2",)
    assert record.ledger.epoch == epoch + 2  # gpu1 left the serving set, gpu2 joined


def test_one_edit_that_shifts_names_off_a_condemned_server_leaves_its_condemnation() -> None:
    """{gpu0 (wedged): u0, gpu1: u1} -> {gpu2: u0, gpu0: u1}: gpu2 served the wedged u0,
    and gpu0's DEAD state and restart budget moved onto u1, a working server."""
    record = wedged_gpu0(("gpu1", URL_1))
    record.ledger.apply("gpu1", Retire(now=NOW, reason="bad HBM"))  # u1's own stays too
    changes = record.reconcile({"gpu2": URL_0, "gpu0": URL_1}, NOW + 2)
    assert [(c.name, c.event, c.state, c.was) for c in changes] == [
        ("gpu2", "renamed", State.DEAD, "gpu0"),
        ("gpu0", "renamed", State.RETIRED, "gpu1"),
    ]
    assert record.ledger.by_url(URL_0) == "gpu2" and record.ledger.by_url(URL_1) == "gpu0"
    assert record.restarts["gpu2"].failures == 2 and "gpu0" not in record.restarts
    assert record.ledger.serving == ()
    # A working server vacated the same way: the new name there is new, as before.
    record = wedged_gpu0(("gpu1", URL_1))
    record.reconcile({"gpu2": URL_0, "gpu0": URL_1}, NOW + 2)
    assert record.ledger.state_of("gpu2") is State.DEAD
    assert record.ledger.state_of("gpu0") is State.HEALTHY
    assert "gpu0" not in record.restarts and record.ledger.serving == ("gpu0",)
    assert record.fresh_since["gpu2"] == NOW + 2  # requests drained as gpu0 were at u1 too


def test_two_condemned_backends_that_swap_addresses_still_keep_their_own_state() -> None:
    record = wedged_gpu0(("gpu1", URL_1))
    record.reconcile({"gpu1": URL_1}, NOW + 2)  # gpu0 kept, DEAD at u0
    record.observe("gpu1", VERDICTS["wedged"], NOW + 3)
    changes = record.reconcile({"gpu1": URL_0, "gpu0": URL_1}, NOW + 4)
    assert [(c.name, c.event) for c in changes] == [("gpu1", "readdressed"), ("gpu0", "added")]
    assert record.ledger.serving == ()


def test_a_name_a_condemned_server_kept_aside_had_given_to_another_server_keeps_it_kept() -> None:
    """gpu0 (wedged at u0) left the config and was kept aside; the config then called
    gpu1's server (u1) "gpu0": the rename took the name and dropped u0's kept record, so
    u0 configured later under any name came in HEALTHY and serving its wedge."""
    record = wedged_gpu0(("gpu1", URL_1))
    record.reconcile({"gpu1": URL_1}, NOW + 2)  # gpu0 kept aside, DEAD at u0
    changes = record.reconcile({"gpu0": URL_1}, NOW + 3)
    assert [(c.name, c.event, c.state, c.was) for c in changes] == [
        ("gpu0", "renamed", State.HEALTHY, "gpu1")
    ]
    again = saved(record)
    again.reconcile({"gpu0": URL_1, "node-a": URL_0}, NOW + 4)
    assert again.ledger.state_of("node-a") is State.DEAD
    assert again.restarts["node-a"].failures == 2
    assert again.ledger.serving == ("gpu0",)


def test_a_backend_moved_onto_a_condemned_server_whose_backend_moves_on_is_condemned() -> None:
    """{gpu0 (wedged): u0, gpu1: u1} -> {gpu1: u0, gpu0: u2}, not a swap: gpu1 served the
    wedged u0 as HEALTHY, and gpu0's DEAD state and restart budget moved onto u2."""
    record = wedged_gpu0(("gpu1", URL_1))
    record.reconcile({"gpu1": URL_0, "gpu0": URL_2}, NOW + 2)
    assert record.ledger.by_url(URL_0) == "gpu1" and record.ledger.by_url(URL_2) == "gpu0"
    assert record.ledger.state_of("gpu1") is State.DEAD
    assert record.restarts["gpu1"].failures == 2
    assert record.ledger.serving == ("gpu0",) and "gpu0" not in record.restarts


def test_names_turned_round_condemned_servers_keep_their_own_and_the_reconcile_ends() -> None:
    """gpu0 wedged at u0, gpu1 and gpu2 kept aside condemned at u1 and u2; the config
    turns the names round: a record renamed along such a ring had no first to go."""
    record = record_of(("gpu0", URL_0), ("gpu1", URL_1), ("gpu2", URL_2))
    for name in ("gpu0", "gpu1", "gpu2"):
        record.ledger.apply(name, WedgeProven(now=NOW, evidence="steps 1→1→1"))
    record.reconcile({"gpu0": URL_0}, NOW + 1)
    assert set(record.withheld_forgotten) == {"gpu1", "gpu2"}
    record.reconcile({"gpu1": URL_0, "gpu2": URL_1, "gpu0": URL_2}, NOW + 2)
    assert record.ledger.serving == ()
    assert sorted(record.ledger.names) == ["gpu0", "gpu1", "gpu2"]
    # One shifted along the servers instead, the kept name taking a moved one's server.
    record = record_of(("gpu0", URL_0), ("gpu1", URL_1), ("gpu2", URL_2))
    record.ledger.apply("gpu0", WedgeProven(now=NOW, evidence="steps 1→1→1"))
    record.ledger.apply("gpu1", WedgeProven(now=NOW, evidence="steps 1→1→1"))
    record.reconcile({"gpu0": URL_0, "gpu2": URL_2}, NOW + 1)  # gpu1 kept aside at u1
    record.reconcile({"gpu1": URL_0, "gpu0": URL_2, "node-a": URL_1}, NOW + 2)
    assert record.ledger.state_of("gpu1") is State.DEAD  # u0, gpu0's wedge
    assert record.ledger.state_of("node-a") is State.DEAD  # u1, gpu1's
    assert record.ledger.serving == ("gpu0",)  # u2, gpu2's server


_SERVERS = [f"http://10.0.0.{index}:8000" for index in range(5)]
_edit = st.dictionaries(st.sampled_from("abcde"), st.sampled_from(_SERVERS), max_size=5).filter(
    lambda config: len(set(config.values())) == len(config)
)
_step = st.one_of(
    st.tuples(st.just("edit"), _edit),
    st.tuples(st.sampled_from(["wedge", "retire"]), st.integers(0, 4)),
    st.tuples(st.just("save"), st.none()),
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(steps=st.lists(_step, max_size=12))
def test_no_config_edit_lets_a_condemned_server_serve_but_a_swap_of_two_names(
    steps: list[tuple[str, Any]],
) -> None:
    """A record out of the serving set (in the ledger or kept aside) follows its server
    through any run of renames, shifts, removals and returns: only two configured names
    swapping servers keep their own records, as the README says. Before, a shift of names
    or a later run's new name served a wedged server (and ``reconcile`` must end, with no
    cycle of renames)."""
    now = 100.0
    record = FleetRecord(Ledger(LedgerPolicy(), [("a", _SERVERS[0]), ("b", _SERVERS[1])], now=now))
    for action, argument in steps:
        now += 1.0
        ledger = record.ledger
        if action == "save":
            record = saved(record)
        elif action in ("wedge", "retire"):
            serving = ledger.serving
            if serving:
                name = serving[argument % len(serving)]
                event = (
                    WedgeProven(now=now, evidence="wedged: frozen")
                    if action == "wedge"
                    else Retire(now=now, reason="an operator")
                )
                ledger.apply(name, event)
        else:
            at = {name: same_server(ledger.url_of(name)) for name in ledger.names}
            kept = {
                name: same_server(str(entry["entry"]["url"]))
                for name, entry in record.withheld_forgotten.items()
            }
            kept.update({n: same_server(url) for n, url in record.retired_urls.items()})
            condemned = {at[n] for n in ledger.names if ledger.state_of(n) not in SERVING}
            condemned |= set(kept.values())
            holder = {server: name for name, server in {**kept, **at}.items()}
            record.reconcile(argument, now)
            for name in record.ledger.serving:
                server = same_server(record.ledger.url_of(name))
                if server in condemned:
                    # Allowed only as a swap: this name was configured at another server,
                    # and the name that held this one is configured at that one now.
                    other = holder[server]
                    assert name in at and same_server(argument.get(other, "")) == at[name], (
                        f"{name} serves {server}, condemned as {other}"
                    )
