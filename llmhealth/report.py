"""What a check says to people and machines: exit code, JSON document, Nagios line.

Pure: outcomes in, values out. Exit codes follow the monitoring-plugin convention, so
cron mailers, Nagios/Icinga and systemd all read the same number.
"""

from __future__ import annotations

from collections.abc import Sequence
from enum import IntEnum
from typing import Any

from llmhealth.classify import Outcome, Verdict, VerdictKind


class ExitCode(IntEnum):
    OK = 0
    WARNING = 1  # something doubted or degraded
    CRITICAL = 2  # a backend wedged or failing, or a proxy down
    UNKNOWN = 3  # could not check: bad config, bad arguments, our own error


_CRITICAL_KINDS = frozenset(
    {
        VerdictKind.WEDGED,
        VerdictKind.DOWN,
        VerdictKind.UNRESPONSIVE,
        VerdictKind.UNANSWERED,
    }
)


def verdict_exit_code(verdict: Verdict) -> ExitCode:
    if verdict.kind in _CRITICAL_KINDS:
        return ExitCode.CRITICAL
    if verdict.kind is VerdictKind.STALLED:
        return ExitCode.WARNING
    if verdict.kind is VerdictKind.RESTARTED:
        # A new process that failed the tiny request is failing; one not yet judged is doubt.
        failed_answer = verdict.answer is not None and not verdict.answer.ok
        return ExitCode.CRITICAL if failed_answer else ExitCode.WARNING
    return ExitCode.OK if verdict.healthy else ExitCode.CRITICAL


def exit_code(outcomes: Sequence[Outcome]) -> ExitCode:
    return max((verdict_exit_code(o.verdict) for o in outcomes), default=ExitCode.OK)


def as_json(outcomes: Sequence[Outcome], checked_at: float) -> dict[str, Any]:
    return {
        "checked_at": round(checked_at, 3),
        "exit_code": int(exit_code(outcomes)),
        "backends": [_backend_json(outcome) for outcome in outcomes],
    }


def _backend_json(outcome: Outcome) -> dict[str, Any]:
    verdict = outcome.verdict
    return {
        "name": outcome.target.name,
        "url": outcome.target.url,
        "kind": outcome.target.kind,
        "verdict": str(verdict.kind),
        "healthy": verdict.healthy,
        "running": verdict.running,
        "waiting": verdict.waiting,
        "steps_per_s": _rounded(verdict.steps_per_s),
        "tokens_per_s": _rounded(verdict.tokens_per_s),
        "requests_sent": verdict.requests_sent,
        "evidence": verdict.evidence,
    }


def nagios_line(outcomes: Sequence[Outcome]) -> str:
    """One status line, then perfdata: ``LLMHEALTH CRITICAL - … | 'gpu0 running'=4 …``."""
    code = exit_code(outcomes)
    by_kind: dict[str, list[str]] = {}
    for outcome in outcomes:
        by_kind.setdefault(str(outcome.verdict.kind), []).append(outcome.target.name)
    order = sorted(by_kind, key=lambda kind: (-_kind_weight(kind), kind))
    summary = "; ".join(f"{len(by_kind[k])} {k} ({', '.join(by_kind[k])})" for k in order)
    perfdata = []
    for outcome in outcomes:
        verdict = outcome.verdict
        name = outcome.target.name
        perfdata.append(_perf(f"{name} healthy", 1 if verdict.healthy else 0))
        for label, value in (
            ("running", verdict.running),
            ("waiting", verdict.waiting),
            ("steps_per_s", _rounded(verdict.steps_per_s)),
            ("tokens_per_s", _rounded(verdict.tokens_per_s)),
        ):
            if value is not None:
                perfdata.append(_perf(f"{name} {label}", value))
    return f"LLMHEALTH {code.name} - {summary or 'nothing to check'} | {' '.join(perfdata)}"


def _kind_weight(kind: str) -> int:
    weights = {"wedged": 5, "down": 4, "unresponsive": 4, "unanswered": 4, "no_metrics": 2}
    return weights.get(kind, 3 if kind in ("stalled", "restarted") else 0)


def _perf(label: str, value: float) -> str:
    # Perfdata labels are quoted with single quotes; a quote inside is doubled.
    quoted = "'" + label.replace("'", "''").replace("=", "_") + "'"
    return f"{quoted}={value:g}"


def _rounded(value: float | None) -> float | None:
    return None if value is None else round(value, 2)
