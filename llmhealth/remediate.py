"""Acting on the restart plan: feed the ledger, run the command, write down what happened.

The shell around ``policy.plan_restarts``, shared by ``check`` and ``watch``. The ledger
hears ``RestartIssued`` before the command runs and the command runs only if the ledger
answered RESTARTING, so its guards and its budget hold even against a bug here. Every
decision about a DEAD backend, to act or not, becomes one audit line with its evidence.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, Protocol

from llmhealth.actions import AuditLog, CommandResult, restart_environment, run_command
from llmhealth.classify import Verdict
from llmhealth.config import Config
from llmhealth.fleet import FleetRecord
from llmhealth.ledger import RestartFailed, RestartIssued, State, Transition
from llmhealth.policy import Action, RestartDecision, RestartHistory, plan_restarts


class Runner(Protocol):
    def __call__(
        self, argv: Sequence[str], timeout: float, *, env: Mapping[str, str] | None = None
    ) -> CommandResult: ...


_NUMBERS = re.compile(r"\d+(?:\.\d+)?")
_AUDIT_EVENTS = {Action.RESTART: "restart", Action.RETIRE: "retire", Action.SKIP: "restart_skipped"}
ACTOR = "llmhealth"


class Mode(StrEnum):
    ACT = "act"  # restart what the plan allows
    DRY_RUN = "dry_run"  # decide and log, run nothing, change nothing
    OFF = "off"  # --no-restart: no plan at all for this run


@dataclass(frozen=True, slots=True)
class RestartOutcome:
    decision: RestartDecision
    transition: Transition | None = None  # None when nothing was fed to the ledger
    command: CommandResult | None = None


def reads_evidence(verdict: Verdict) -> list[dict[str, Any]]:
    """The reads behind a verdict as plain values: what proved a wedge, for the audit log."""
    rows = []
    for read in verdict.reads:
        row: dict[str, Any] = {"at": read.at}
        if read.signals is None:
            row["problem"] = str(read.problem) if read.problem else None
            row["detail"] = read.detail
        else:
            row["process_start"] = read.signals.process_start
            row["engines"] = {
                engine.engine: {
                    "running": engine.running,
                    "waiting": engine.waiting,
                    "kv_usage": engine.kv_usage,
                    **engine.counters,
                }
                for engine in read.signals.engines
            }
        rows.append(row)
    return rows


def remediate(
    record: FleetRecord,
    config: Config,
    now: float,
    *,
    mode: Mode,
    audit: AuditLog | None,
    run: Runner = run_command,
) -> list[RestartOutcome]:
    """Plan restarts for every DEAD backend and carry out what the plan allows.

    Each audit line carries the proof kept when the backend was condemned (the verdict's
    evidence and reads), whichever run that was; failing that, the ledger's last error.
    """
    if mode is Mode.OFF:
        return []
    backends = {backend.name: backend for backend in config.backends}
    holds = {name: hold for name, hold in record.holds.items() if hold.active(now)}
    decisions = plan_restarts(record.ledger, backends, holds, record.restarts, config.policy, now)
    for name in list(record.skips):  # a backend that left DEAD starts afresh
        if name not in record.ledger.names or record.ledger.state_of(name) is not State.DEAD:
            del record.skips[name]
    outcomes = []
    for decision in decisions:
        snapshot = record.ledger.snapshot(decision.name, now)
        entry: dict[str, Any] = {
            "time": now,
            "actor": ACTOR,
            "backend": decision.name,
            "event": _AUDIT_EVENTS[decision.action],
            "from": str(snapshot.state),
            "to": str(snapshot.state),
            "reason": decision.reason,
            "condemned_by": decision.condemned_by,
            "evidence": record.proofs.get(decision.name) or {"last_error": snapshot.last_error},
            "dry_run": mode is Mode.DRY_RUN,
        }
        outcome = RestartOutcome(decision)
        if decision.act and mode is Mode.ACT:
            outcome = _carry_out(
                record, decision, backends[decision.name].restart, config, now, run
            )
            entry["to"] = str(record.ledger.state_of(decision.name))
            if outcome.command is not None:
                entry["command"] = outcome.command.to_dict()
            if outcome.transition is not None and not outcome.transition.applied:
                entry["reason"] = (
                    f"{decision.reason}; the ledger refused: {outcome.transition.reason}"
                )
        if audit is not None and _worth_writing(record, decision, mode):
            audit.append(entry)
        outcomes.append(outcome)
    return outcomes


def _worth_writing(record: FleetRecord, decision: RestartDecision, mode: Mode) -> bool:
    """Every act is written; a skip only when its reason changed since the last one written.

    watch settles every wait, and a DEAD backend that will not be restarted would
    otherwise add the same line, fsync'd, every few seconds. Numbers (time left in a
    cooldown) do not make a new reason.
    """
    if decision.act or mode is Mode.DRY_RUN:
        record.skips.pop(decision.name, None)
        return True
    reason = _NUMBERS.sub("#", decision.reason)
    if record.skips.get(decision.name) == reason:
        return False
    record.skips[decision.name] = reason
    return True


def _carry_out(
    record: FleetRecord,
    decision: RestartDecision,
    argv: tuple[str, ...],
    config: Config,
    now: float,
    run: Runner,
) -> RestartOutcome:
    issued = record.ledger.apply(decision.name, RestartIssued(now=now))
    if issued.to_state is not State.RESTARTING:
        return RestartOutcome(decision, issued)  # retired past the budget, or refused
    history = record.restarts.get(decision.name, RestartHistory())
    record.restarts[decision.name] = history.record_attempt(now)
    snapshot = record.ledger.snapshot(decision.name, now)
    environment = restart_environment(
        os.environ,
        {backend.api_key_env for backend in config.backends if backend.api_key_env},
        backend=decision.name,
        url=snapshot.url,
        reason=snapshot.last_error or decision.reason,
    )
    result = run(argv, config.policy.restart_timeout, env=environment)
    if result.ok:
        return RestartOutcome(decision, issued, result)
    why = "timed out" if result.timed_out else f"exited {result.exit_code}"
    record.ledger.apply(
        decision.name, RestartFailed(now=now + result.duration, reason=f"restart command {why}")
    )
    record.restart_failed(decision.name)
    return RestartOutcome(decision, issued, result)
