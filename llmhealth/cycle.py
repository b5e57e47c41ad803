"""One cycle over a fleet: lock the state, probe, feed the ledger, act, persist.

The shell around the pure core, shared by ``check`` (one cycle) and ``watch`` (one per
wait). The state stays locked from load to save, so two runs never both act on a fleet.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from llmhealth.actions import AuditLog
from llmhealth.classify import Outcome, Target
from llmhealth.config import Config
from llmhealth.config import Policy as ConfigPolicy
from llmhealth.fleet import FleetRecord
from llmhealth.ledger import Ledger, LedgerPolicy, State, Transition
from llmhealth.metrics import Signals
from llmhealth.probe import ProbeSettings, check_fleet
from llmhealth.remediate import ACTOR, Mode, RestartOutcome, reads_evidence, remediate
from llmhealth.report import BackendReport, CycleReport, RestartNote, summarize
from llmhealth.state import StateFile, default_path

Clock = Callable[[], float]


def ledger_policy(policy: ConfigPolicy) -> LedgerPolicy:
    return LedgerPolicy(
        unhealthy_threshold=policy.unhealthy_threshold,
        healthy_threshold=policy.healthy_threshold,
        min_healthy=policy.min_healthy,
        restart_budget=policy.restart_budget,
        restart_budget_window=policy.restart_budget_window,
        startup_grace=policy.startup_grace,
    )


def load_record(
    store: StateFile | None, policy: LedgerPolicy, backends: Mapping[str, str], now: float
) -> tuple[FleetRecord, list[str]]:
    """The persisted record made to match the configured backends, or a fresh one.

    Call with the store's lock held. The notes say which backends came or went.
    """
    if store is not None:
        loaded = store.load(lambda document: FleetRecord.from_dict(document, policy))
        if loaded is not None:
            return loaded, loaded.reconcile(backends, now)
    # A first run's backends are the starting membership (epoch 0), not changes to it.
    return FleetRecord(Ledger(policy, backends.items(), now=now)), []


def run_cycle(
    config: Config,
    targets: list[Target],
    settings: ProbeSettings,
    store: StateFile | None,
    *,
    mode: Mode = Mode.ACT,
    clock: Clock = time.time,
) -> CycleReport:
    """Lock, load, probe every target, feed the ledger, remediate, save, report."""
    if store is None:
        return _cycle(config, targets, settings, None, mode, clock)
    with store.locked():
        return _cycle(config, targets, settings, store, mode, clock)


def _cycle(
    config: Config,
    targets: list[Target],
    settings: ProbeSettings,
    store: StateFile | None,
    mode: Mode,
    clock: Clock,
) -> CycleReport:
    started = clock()
    backends = {t.name: t.url for t in targets if t.kind == "backend"}
    record, notes = load_record(store, ledger_policy(config.policy), backends, started)
    audit = AuditLog(audit_path_for(config, store.path)) if store is not None else None
    if store is None:
        notes.append("state not persisted: bare URLs without --state or --config")
        mode = Mode.OFF  # nothing to remember a restart by, and no restart commands
    notes += expire_restarts(record, audit, started)
    outcomes = asyncio.run(
        check_fleet(targets, settings, clock=clock, baselines=baselines_of(record))
    )
    report = settle(record, config, outcomes, clock(), mode=mode, audit=audit, notes=notes)
    if store is not None:
        store.save(record.to_dict())
    return replace(report, checked_at=started)


def expire_restarts(record: FleetRecord, audit: AuditLog | None, now: float) -> list[str]:
    """Restarts that outlived their startup grace failed: back to DEAD, cooldown doubled."""
    notes = []
    for expired in record.ledger.expire_restarts(now):
        record.restart_failed(expired.name)
        notes.append(f"{expired.name}: {expired.reason}")
        _audit_transition(audit, expired, now, {})
    return notes


def baselines_of(record: FleetRecord) -> dict[str, Signals]:
    """What earlier runs last read of each backend: the only way to see a restart between."""
    return {
        name: sighting.baseline
        for name, sighting in record.sightings.items()
        if sighting.baseline is not None
    }


def settle(
    record: FleetRecord,
    config: Config,
    outcomes: Sequence[Outcome],
    now: float,
    *,
    mode: Mode,
    audit: AuditLog | None,
    notes: Sequence[str] = (),
) -> CycleReport:
    """Feed verdicts to the ledger, act on the restart plan, and say what happened."""
    expected = {b.name: b.expected_model for b in config.backends}
    reports = []
    in_ledger = set()
    for outcome in outcomes:
        name = outcome.target.name
        if outcome.target.kind != "backend" or name not in record.ledger.names:
            reports.append(BackendReport(outcome, None))
            continue
        in_ledger.add(name)
        transitions = tuple(record.observe(name, outcome.verdict, now, expected.get(name)))
        moved = [t for t in transitions if t.applied and t.from_state != t.to_state]
        if moved:  # evidence as plain values only when something is written down
            evidence = {
                "verdict": str(outcome.verdict.kind),
                "evidence": outcome.verdict.evidence,
                "reads": reads_evidence(outcome.verdict),
            }
            for transition in moved:
                _audit_transition(audit, transition, now, evidence)
            if record.ledger.state_of(name) is State.DEAD:
                record.proofs[name] = evidence
        reports.append(BackendReport(outcome, None, transitions))
    restarts = remediate(record, config, now, mode=mode, audit=audit)
    # Snapshots after remediation, so a backend restarted this cycle shows RESTARTING.
    reports = [
        replace(report, snapshot=record.ledger.snapshot(report.outcome.target.name, now))
        if report.outcome.target.name in in_ledger
        else report
        for report in reports
    ]
    return CycleReport(
        now,
        tuple(reports),
        summarize(record.ledger),
        tuple(notes),
        tuple(_restart_note(o, mode) for o in restarts),
    )


def _audit_transition(
    audit: AuditLog | None, transition: Transition, now: float, evidence: dict[str, Any]
) -> None:
    """Ledger moves made by a check are written down with the evidence that caused them."""
    if audit is None:
        return
    audit.append(
        {
            "time": now,
            "actor": ACTOR,
            "backend": transition.name,
            "event": str(transition.kind),
            "from": str(transition.from_state),
            "to": str(transition.to_state),
            "reason": transition.reason,
            "evidence": evidence,
        }
    )


def _restart_note(outcome: RestartOutcome, mode: Mode) -> RestartNote:
    command = outcome.command
    return RestartNote(
        name=outcome.decision.name,
        action=str(outcome.decision.action),
        reason=outcome.decision.reason,
        ran=command is not None,
        ok=None if command is None else command.ok,
        dry_run=mode is Mode.DRY_RUN,
    )


def state_path_for(config: Config, explicit: str | None) -> Path:
    """``--state``, else the config's ``state``, else the default state directory."""
    if explicit:
        return Path(explicit)
    return Path(config.state) if config.state else default_path()


def audit_path_for(config: Config, state_path: Path) -> Path:
    """The audit log: as configured, else beside the state file."""
    return Path(config.audit_log) if config.audit_log else state_path.with_name("audit.jsonl")
