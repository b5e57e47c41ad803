"""The JSON document and the Nagios line: numbers a parser and a grapher can read."""

from __future__ import annotations

import json

from llmhealth.classify import Outcome, Target, Verdict, VerdictKind
from llmhealth.ledger import Ledger, LedgerPolicy
from llmhealth.report import (
    BackendReport,
    CycleReport,
    FleetSummary,
    as_json,
    nagios_line,
    status_nagios,
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
