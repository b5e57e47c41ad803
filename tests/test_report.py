"""The JSON document and the Nagios line: numbers a parser and a grapher can read."""

from __future__ import annotations

import dataclasses
import json

import pytest

from llmhealth.classify import Answer, Outcome, Target, Verdict, VerdictKind
from llmhealth.ledger import GoodVerdict, Ledger, LedgerPolicy, ProcessGone, State
from llmhealth.policy import Hold
from llmhealth.report import (
    BackendReport,
    CycleReport,
    ExitCode,
    FleetSummary,
    as_json,
    exit_code,
    nagios_line,
    status_exit_code,
    status_json,
    status_nagios,
    verdict_exit_code,
    worst,
)

FLEET = FleetSummary(serving=1, min_healthy=1, epoch=0, floor_breached=False, message="ok")


def report_of(name: str, steps_per_s: float, tokens_per_s: float) -> CycleReport:
    verdict = Verdict(
        VerdictKind.BUSY,
        True,
        "busy",
        running=2,
        waiting=0,
        steps_per_s=steps_per_s,
        tokens_per_s=tokens_per_s,
    )
    backend = BackendReport(Outcome(Target(name, "http://a:1"), verdict), None)
    return CycleReport(checked_at=1.0, backends=(backend,), fleet=FLEET)


def test_a_rate_past_the_largest_float_is_null_in_json_and_left_out_of_perfdata() -> None:
    # A hostile server's generation counters, summed over engines, overflow to inf.
    report = report_of("gpu0", steps_per_s=float("nan"), tokens_per_s=float("inf"))
    (backend,) = as_json(report)["backends"]
    assert (backend["steps_per_s"], backend["tokens_per_s"]) == (None, None)
    json.dumps(as_json(report), allow_nan=False)  # strict JSON: no Infinity, no NaN
    line = nagios_line(report)
    assert "inf" not in line and "nan" not in line, line
    assert "steps_per_s" not in line and "tokens_per_s" not in line, line
    assert "'gpu0 running'=2" in line


def test_perfdata_values_are_plain_decimals() -> None:
    line = nagios_line(report_of("gpu0", steps_per_s=1.99, tokens_per_s=9983770.0))
    perfdata = line.split(" | ", 1)[1]
    assert "e+" not in perfdata, perfdata
    assert "'gpu0 tokens_per_s'=9983770 " in perfdata, perfdata
    assert "'gpu0 steps_per_s'=1.99 " in perfdata, perfdata


# A name no config takes, as a record saved by an older version or written into a
# cluster's etcd by any member may hold it, and as a library caller may pass it.
FORGED = "gpu0 | evil=1\nLLMHEALTH OK - \x1b[2Jall fine"


def one_nagios_line(line: str) -> str:
    assert "\n" not in line and "\x1b" not in line, line
    assert line.count("|") == 1, line  # the one that starts the performance data
    return line


def test_status_nagios_shows_a_saved_name_no_config_takes_on_one_line() -> None:
    ledger = Ledger(LedgerPolicy(), [(FORGED, "http://127.0.0.1:9")], now=1.0)
    fleet = FleetSummary(serving=1, min_healthy=1, epoch=0, floor_breached=False, message="")
    line = one_nagios_line(status_nagios(ledger.snapshots(1.0), fleet))
    assert line.startswith("LLMHEALTH OK - 1 healthy (gpu0 ¦ evil=1\\nLLMHEALTH OK - \\x1b[2J")


def test_nagios_line_shows_a_callers_name_no_config_takes_on_one_line() -> None:
    line = one_nagios_line(nagios_line(report_of(FORGED, steps_per_s=1.0, tokens_per_s=2.0)))
    assert "(gpu0 ¦ evil=1\\nLLMHEALTH OK" in line
    assert "'gpu0 ¦ evil_1\\nLLMHEALTH OK - \\x1b[2Jall fine running'=2" in line


def test_a_failed_server_outranks_one_not_examined_and_both_outrank_doubt() -> None:
    # The codes' numbers are not their ranks: UNKNOWN is 3, CRITICAL 2.
    assert worst([ExitCode.CRITICAL, ExitCode.UNKNOWN]) is ExitCode.CRITICAL
    assert worst([ExitCode.UNKNOWN, ExitCode.WARNING]) is ExitCode.UNKNOWN
    assert worst([ExitCode.WARNING, ExitCode.OK]) is ExitCode.WARNING
    assert worst([]) is ExitCode.OK


@pytest.mark.parametrize(
    ("kind", "healthy", "judged", "code"),
    [
        (VerdictKind.BUSY, True, True, ExitCode.OK),
        (VerdictKind.UNANSWERED, False, True, ExitCode.CRITICAL),
        (VerdictKind.WEDGED, False, True, ExitCode.CRITICAL),
        (VerdictKind.STALLED, False, True, ExitCode.WARNING),
        (VerdictKind.NO_METRICS, False, True, ExitCode.CRITICAL),
        (VerdictKind.NO_METRICS, False, False, ExitCode.UNKNOWN),
    ],
)
def test_each_verdict_exits_with_its_documented_code(
    kind: VerdictKind, healthy: bool, judged: bool, code: ExitCode
) -> None:
    verdict = Verdict(kind, healthy, "evidence", judged=judged)
    assert verdict_exit_code(verdict) is code


STATE_CODES = [
    (State.HEALTHY, ExitCode.OK),
    (State.SUSPECT, ExitCode.WARNING),
    (State.STALE, ExitCode.WARNING),
    (State.RESTARTING, ExitCode.WARNING),
    (State.RETIRED, ExitCode.WARNING),
    (State.DEAD, ExitCode.CRITICAL),
]


@pytest.mark.parametrize(("state", "code"), STATE_CODES)
def test_each_saved_state_gives_status_and_check_their_code(state: State, code: ExitCode) -> None:
    (healthy,) = Ledger(LedgerPolicy(), [("gpu0", "http://a:1")], now=1.0).snapshots(1.0)
    snapshot = dataclasses.replace(healthy, state=state)
    fleet = FleetSummary(serving=1, min_healthy=0, epoch=0, floor_breached=False, message="")
    assert status_exit_code([snapshot], fleet) is code
    # check: a verdict that found nothing wrong now does not hide what the ledger holds.
    answered = Verdict(VerdictKind.IDLE, True, "idle")
    backend = BackendReport(Outcome(Target("gpu0", "http://a:1"), answered), snapshot)
    assert exit_code(CycleReport(checked_at=1.0, backends=(backend,), fleet=fleet)) is code


def test_a_breached_floor_is_critical_though_every_backend_is_fine() -> None:
    (snapshot,) = Ledger(LedgerPolicy(), [("gpu0", "http://a:1")], now=1.0).snapshots(1.0)
    breached = FleetSummary(serving=1, min_healthy=2, epoch=0, floor_breached=True, message="")
    assert status_exit_code([snapshot], breached) is ExitCode.CRITICAL
    backend = BackendReport(
        Outcome(Target("gpu0", "http://a:1"), Verdict(VerdictKind.IDLE, True, "idle")), snapshot
    )
    report = CycleReport(checked_at=1.0, backends=(backend,), fleet=breached)
    assert exit_code(report) is ExitCode.CRITICAL
    assert as_json(report)["exit_code"] == 2


def test_the_nagios_line_puts_the_worst_first_with_state_and_a_healthy_perf_value() -> None:
    (fine, dead) = Ledger(
        LedgerPolicy(), [("a", "http://a:1"), ("b", "http://b:1")], now=1.0
    ).snapshots(1.0)
    dead = dataclasses.replace(dead, state=State.DEAD)
    backends = (
        BackendReport(
            Outcome(Target("a", "http://a:1"), Verdict(VerdictKind.IDLE, True, "")), fine
        ),
        BackendReport(
            Outcome(Target("b", "http://b:1"), Verdict(VerdictKind.WEDGED, False, "")), dead
        ),
    )
    line = nagios_line(CycleReport(checked_at=1.0, backends=backends, fleet=FLEET))
    assert line.startswith("LLMHEALTH CRITICAL - 1 wedged/dead (b); 1 idle (a); serving 1, min 1 |")
    assert "'a healthy'=1" in line and "'b healthy'=0" in line
    # Proxies only (no ledger): no serving count in the summary.
    proxy_only = nagios_line(report_of("p", steps_per_s=1.0, tokens_per_s=1.0))
    assert "serving" not in proxy_only.split(" | ")[0]


def test_json_rounds_rates_and_time_and_a_perf_label_doubles_its_quote() -> None:
    report = dataclasses.replace(report_of("it's", 1.23456, 2.0), checked_at=1.23456)
    document = as_json(report)
    assert document["checked_at"] == 1.235
    assert document["backends"][0]["steps_per_s"] == 1.23
    assert "'it''s running'=2" in nagios_line(report)


def test_json_lists_only_transitions_that_moved_and_no_empty_last_error() -> None:
    ledger = Ledger(LedgerPolicy(), [("gpu0", "http://a:1")], now=1.0)
    stayed = ledger.apply("gpu0", GoodVerdict(now=2.0))
    assert stayed.from_state is stayed.to_state
    moved = ledger.apply("gpu0", ProcessGone(now=3.0, reason="gone", detail=""))
    assert moved.applied and moved.to_state is State.DEAD
    (snapshot,) = ledger.snapshots(3.0)
    clean = dataclasses.replace(snapshot, last_error="")
    verdict = Verdict(VerdictKind.DOWN, False, "down")
    backend = BackendReport(Outcome(Target("gpu0", "http://a:1"), verdict), clean, (stayed, moved))
    (shown,) = as_json(CycleReport(checked_at=1.0, backends=(backend,), fleet=FLEET))["backends"]
    assert shown["transitions"] == [{"event": str(moved.kind), "from": "healthy", "to": "dead"}]
    assert shown["last_error"] is None


def test_a_restarted_backend_that_refused_our_key_is_doubt_one_that_failed_is_critical() -> None:
    def restarted(answer: Answer) -> Verdict:
        return Verdict(VerdictKind.RESTARTED, False, "restarted", answer=answer)

    refused = Answer(at=1.0, ok=False, detail="HTTP 401", refused=True)
    failed = Answer(at=1.0, ok=False, detail="HTTP 500")
    assert verdict_exit_code(restarted(refused)) is ExitCode.WARNING
    assert verdict_exit_code(restarted(failed)) is ExitCode.CRITICAL


def test_status_shows_only_holds_still_running() -> None:
    snapshots = Ledger(LedgerPolicy(), [("gpu0", "http://a:1")], now=1.0).snapshots(1.0)
    holds = {
        "gpu0": Hold(reason="lent", until=100.0, by="ops"),
        "gone": Hold(reason="lent", until=100.0, by="ops"),
    }
    fleet = FleetSummary(serving=1, min_healthy=1, epoch=0, floor_breached=False, message="")
    running = status_json(snapshots, holds, fleet, now=50.0)
    assert running["backends"][0]["hold"] == holds["gpu0"].to_dict()
    assert list(running["holds_of_unconfigured_names"]) == ["gone"]
    ended = status_json(snapshots, holds, fleet, now=150.0)
    assert ended["backends"][0]["hold"] is None
    assert ended["holds_of_unconfigured_names"] == {}


def test_the_nagios_line_names_a_wedge_before_a_down_backend() -> None:
    backends = tuple(
        BackendReport(Outcome(Target(name, f"http://{name}:1"), Verdict(kind, False, "")), None)
        for name, kind in (("a", VerdictKind.DOWN), ("b", VerdictKind.WEDGED))
    )
    line = nagios_line(CycleReport(checked_at=1.0, backends=backends, fleet=FLEET))
    assert line.startswith("LLMHEALTH CRITICAL - 1 wedged (b); 1 down (a) |"), line
