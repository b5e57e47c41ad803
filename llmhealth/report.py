"""What a cycle says to people and machines: exit code, JSON document, Nagios line.

Pure: reports in, values out. Exit codes follow the monitoring-plugin convention, so
cron mailers, Nagios/Icinga and systemd all read the same number: the worst of what the
verdicts show now and what the ledger holds from earlier runs.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from decimal import Decimal
from enum import IntEnum
from typing import Any

from llmhealth.classify import Outcome, Verdict, VerdictKind
from llmhealth.ledger import BackendSnapshot, Ledger, State, Transition
from llmhealth.policy import Hold
from llmhealth.text import nagios_text


class ExitCode(IntEnum):
    OK = 0
    WARNING = 1  # something doubted or degraded
    CRITICAL = 2  # a backend wedged, failing or dead, a proxy down, or the fleet under its floor
    UNKNOWN = 3  # could not check: bad config, bad arguments, state locked, our own error


@dataclass(frozen=True, slots=True)
class BackendReport:
    outcome: Outcome
    snapshot: BackendSnapshot | None  # None for a proxy: proxies are not in the ledger
    transitions: tuple[Transition, ...] = ()


@dataclass(frozen=True, slots=True)
class FleetSummary:
    serving: int
    min_healthy: int
    epoch: int
    floor_breached: bool
    message: str


@dataclass(frozen=True, slots=True)
class RestartNote:
    """One decision about a DEAD backend, as the report shows it."""

    name: str
    action: str  # restart, retire or skip
    reason: str
    ran: bool  # the restart command was run
    ok: bool | None  # its outcome; None when it was not run
    dry_run: bool


@dataclass(frozen=True, slots=True)
class CycleReport:
    checked_at: float
    backends: tuple[BackendReport, ...]
    fleet: FleetSummary
    notes: tuple[str, ...] = ()
    restarts: tuple[RestartNote, ...] = ()
    traffic: tuple[Transition, ...] = ()  # what real requests through `route` did to the ledger
    expired: tuple[Transition, ...] = ()  # restarts whose startup grace ran out: failed


def summarize(ledger: Ledger) -> FleetSummary:
    return FleetSummary(
        serving=len(ledger.serving),
        min_healthy=ledger.policy.min_healthy,
        epoch=ledger.epoch,
        floor_breached=ledger.floor_breached,
        message=ledger.floor_message,
    )


_CRITICAL_KINDS = frozenset(
    {VerdictKind.WEDGED, VerdictKind.DOWN, VerdictKind.UNRESPONSIVE, VerdictKind.UNANSWERED}
)
_STATE_CODES = {
    State.HEALTHY: ExitCode.OK,
    State.SUSPECT: ExitCode.WARNING,
    State.STALE: ExitCode.WARNING,
    State.RESTARTING: ExitCode.WARNING,
    State.RETIRED: ExitCode.WARNING,  # out by decision; the floor says if that hurts
    State.DEAD: ExitCode.CRITICAL,
}


# How codes combine over a run: a failed server outranks a backend llmhealth could not
# check, so one unexaminable backend never hides a wedge; doubt ranks below both.
_SEVERITY = {ExitCode.OK: 0, ExitCode.WARNING: 1, ExitCode.UNKNOWN: 2, ExitCode.CRITICAL: 3}


def worst(codes: Iterable[ExitCode]) -> ExitCode:
    """The code a run of several findings exits with (OK when there are none)."""
    return max(codes, key=_SEVERITY.__getitem__, default=ExitCode.OK)


def verdict_exit_code(verdict: Verdict) -> ExitCode:
    if not verdict.judged:
        return ExitCode.UNKNOWN
    if verdict.kind in _CRITICAL_KINDS:
        return ExitCode.CRITICAL
    if verdict.kind is VerdictKind.STALLED:
        return ExitCode.WARNING
    if verdict.kind is VerdictKind.RESTARTED:
        # A new process that failed the tiny request is failing; one not yet judged is doubt,
        # as is one that turned our key away (a key rotated with the restart, most often).
        answer = verdict.answer
        failed_answer = answer is not None and not answer.ok and not answer.refused
        return ExitCode.CRITICAL if failed_answer else ExitCode.WARNING
    return ExitCode.OK if verdict.healthy else ExitCode.CRITICAL


def backend_exit_code(report: BackendReport) -> ExitCode:
    code = verdict_exit_code(report.outcome.verdict)
    if report.snapshot is not None:
        code = worst((code, _STATE_CODES[report.snapshot.state]))
    return code


def exit_code(report: CycleReport) -> ExitCode:
    code = worst(backend_exit_code(b) for b in report.backends)
    return ExitCode.CRITICAL if report.fleet.floor_breached else code


def as_json(report: CycleReport) -> dict[str, Any]:
    return {
        "checked_at": round(report.checked_at, 3),
        "exit_code": int(exit_code(report)),
        "backends": [_backend_json(backend) for backend in report.backends],
        "fleet": {
            "serving": report.fleet.serving,
            "min_healthy": report.fleet.min_healthy,
            "epoch": report.fleet.epoch,
            "floor_breached": report.fleet.floor_breached,
            "message": report.fleet.message,
        },
        "notes": list(report.notes),
        "restarts": [
            {
                "name": note.name,
                "action": note.action,
                "reason": note.reason,
                "ran": note.ran,
                "ok": note.ok,
                "dry_run": note.dry_run,
            }
            for note in report.restarts
        ],
    }


def _backend_json(report: BackendReport) -> dict[str, Any]:
    verdict = report.outcome.verdict
    snapshot = report.snapshot
    return {
        "name": report.outcome.target.name,
        "url": report.outcome.target.url,
        "kind": report.outcome.target.kind,
        "verdict": str(verdict.kind),
        "healthy": verdict.healthy,
        "state": None if snapshot is None else str(snapshot.state),
        "serving": None if snapshot is None else snapshot.serving,
        "running": finite(verdict.running),
        "waiting": finite(verdict.waiting),
        "steps_per_s": _rounded(verdict.steps_per_s),
        "tokens_per_s": _rounded(verdict.tokens_per_s),
        "requests_sent": verdict.requests_sent,
        "evidence": verdict.evidence,
        "transitions": [
            {"event": str(t.kind), "from": str(t.from_state), "to": str(t.to_state)}
            for t in report.transitions
            if t.applied and t.from_state != t.to_state
        ],
        "last_error": None if snapshot is None else snapshot.last_error or None,
    }


def nagios_line(report: CycleReport) -> str:
    """One status line, then perfdata: ``LLMHEALTH CRITICAL - … | 'gpu0 running'=4 …``."""
    code = exit_code(report)
    by_kind: dict[str, list[str]] = {}
    for backend in report.backends:
        label = str(backend.outcome.verdict.kind)
        if backend.snapshot is not None and backend.snapshot.state is not State.HEALTHY:
            label = f"{label}/{backend.snapshot.state}"
        by_kind.setdefault(label, []).append(backend.outcome.target.name)
    order = sorted(by_kind, key=lambda kind: (-_kind_weight(kind), kind))
    summary = "; ".join(f"{len(by_kind[k])} {k} ({_nagios_names(by_kind[k])})" for k in order)
    fleet = report.fleet
    if report.backends and any(b.snapshot is not None for b in report.backends):
        floor = " FLOOR BREACHED" if fleet.floor_breached else ""
        summary += f"; serving {fleet.serving}, min {fleet.min_healthy}{floor}"
    perfdata = []
    for backend in report.backends:
        verdict = backend.outcome.verdict
        name = backend.outcome.target.name
        perfdata.append(_perf(f"{name} healthy", 1 if verdict.healthy else 0))
        for label, value in (
            ("running", finite(verdict.running)),
            ("waiting", finite(verdict.waiting)),
            ("steps_per_s", _rounded(verdict.steps_per_s)),
            ("tokens_per_s", _rounded(verdict.tokens_per_s)),
        ):
            if value is not None:
                perfdata.append(_perf(f"{name} {label}", value))
    perfdata.append(_perf("serving", fleet.serving))
    return f"LLMHEALTH {code.name} - {summary or 'nothing to check'} | {' '.join(perfdata)}"


def _kind_weight(label: str) -> int:
    kind = label.split("/", 1)[0]
    weights = {"wedged": 5, "down": 4, "unresponsive": 4, "unanswered": 4, "no_metrics": 2}
    return weights.get(kind, 3 if kind in ("stalled", "restarted") else 0)


def _nagios_names(names: Iterable[str]) -> str:
    """Backend names for the status line. Config refuses what a Nagios line cannot hold
    (config.name_problem), but ``status`` shows names as saved: by an older version, or
    in a cluster's etcd record, which any member can write."""
    return ", ".join(nagios_text(name) for name in names)


def _perf(label: str, value: float) -> str:
    # Perfdata labels are quoted with single quotes; a quote inside is doubled. Config
    # refuses '=' in names (config.name_problem); a library caller's name, or a saved
    # one, still cannot end the label early nor carry a control character.
    quoted = "'" + nagios_text(label).replace("'", "''").replace("=", "_") + "'"
    return f"{quoted}={plain_decimal(value)}"


def plain_decimal(value: float) -> str:
    """``value`` written out in digits: plugin perfdata is ``[-0-9.]``, and a grapher
    reads ``9.98377e+06`` as 9.98377 or not at all. Callers leave non-finite values out."""
    if isinstance(value, int):
        return str(value)
    # repr is the shortest text that reads back as the same float; Decimal writes it out.
    return format(Decimal(repr(value)), "f").removesuffix(".0")


def finite(value: float | None) -> float | None:
    """None for inf and NaN: a hostile server can push a summed rate past the largest
    float, and neither JSON nor perfdata has a way to say infinity."""
    if value is None or isinstance(value, int) or math.isfinite(value):
        return value  # an int is finite, and one past a float's range is not an error here
    return None


def _rounded(value: float | None) -> float | None:
    value = finite(value)
    return None if value is None else round(value, 2)


# --- status: the ledger as saved, without probing ----------------------------------


def status_exit_code(snapshots: Sequence[BackendSnapshot], fleet: FleetSummary) -> ExitCode:
    code = worst(_STATE_CODES[s.state] for s in snapshots)
    return ExitCode.CRITICAL if fleet.floor_breached else code


def unconfigured_holds(
    snapshots: Sequence[BackendSnapshot], holds: Mapping[str, Hold], now: float
) -> dict[str, Hold]:
    """Holds still running on names the config no longer has: kept until they end (one
    set just before a daemon reloaded must not be lost to its old config), and shown, or
    no one would know a name put back is held."""
    names = {snapshot.name for snapshot in snapshots}
    return {
        name: hold for name, hold in sorted(holds.items()) if name not in names and hold.active(now)
    }


def status_json(
    snapshots: Sequence[BackendSnapshot],
    holds: Mapping[str, Hold],
    fleet: FleetSummary,
    now: float,
) -> dict[str, Any]:
    return {
        "checked_at": round(now, 3),
        "exit_code": int(status_exit_code(snapshots, fleet)),
        "backends": [
            {
                "name": s.name,
                "url": s.url,
                "state": str(s.state),
                "serving": s.serving,
                "state_since": s.state_since,
                "probe_failures": s.probe_failures,
                "request_failures": s.request_failures,
                "restart_attempts": s.restart_attempts,
                "in_place_recoveries": s.in_place_recoveries,
                "last_ok_at": s.last_ok_at,
                "last_error": s.last_error or None,
                "condemned_by": s.condemned_by,
                "weight_version": s.weight_version,
                "hold": holds[s.name].to_dict()
                if s.name in holds and holds[s.name].active(now)
                else None,
            }
            for s in snapshots
        ],
        "fleet": {
            "serving": fleet.serving,
            "min_healthy": fleet.min_healthy,
            "epoch": fleet.epoch,
            "floor_breached": fleet.floor_breached,
            "message": fleet.message,
        },
        "holds_of_unconfigured_names": {
            name: hold.to_dict() for name, hold in unconfigured_holds(snapshots, holds, now).items()
        },
    }


def status_nagios(snapshots: Sequence[BackendSnapshot], fleet: FleetSummary) -> str:
    code = status_exit_code(snapshots, fleet)
    by_state: dict[str, list[str]] = {}
    for snapshot in snapshots:
        by_state.setdefault(str(snapshot.state), []).append(snapshot.name)
    summary = "; ".join(
        f"{len(names)} {state} ({_nagios_names(names)})"
        for state, names in sorted(by_state.items())
    )
    floor = " FLOOR BREACHED" if fleet.floor_breached else ""
    perfdata = " ".join(
        [
            _perf("serving", fleet.serving),
            _perf("min_healthy", fleet.min_healthy),
            _perf("epoch", fleet.epoch),
        ]
    )
    return (
        f"LLMHEALTH {code.name} - {summary or 'no backends'}; serving {fleet.serving}, "
        f"min {fleet.min_healthy}{floor} | {perfdata}"
    )
