"""Acting on the restart plan: feed the ledger, order the command, hear how it went.

The shell around ``policy.plan_restarts``, shared by ``check`` and ``watch``. The ledger
hears ``RestartIssued`` and the state is saved before any command runs, and a command is
ordered only if the ledger answered RESTARTING, so its guards and its budget hold even
against a bug here. The command itself runs outside the settle and the state lock (watch:
its own task; check: after the save), and its outcome comes back to a later settle as a
``CommandDone``. Every decision about a DEAD backend, to act or not, becomes one audit
line with its evidence; every command outcome another.
"""

from __future__ import annotations

import os
import re
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field, replace
from enum import StrEnum
from typing import Any

from llmhealth.actions import Audit, CommandResult, how_it_ended, restart_environment
from llmhealth.classify import Verdict
from llmhealth.config import Backend, Config
from llmhealth.fleet import FleetRecord, process_of
from llmhealth.ledger import CONDEMNED, RestartFailed, RestartIssued, RestartRan, State
from llmhealth.policy import (
    Action,
    RestartDecision,
    RestartHistory,
    plan_restarts,
    restart_pending,
)
from llmhealth.text import other_server

# A number, or a duration written as several ("1m5s", "1m", "55s"): one number to a reader.
_NUMBERS = re.compile(r"(?:\d+(?:\.\d+)?[hms](?![a-z]))+|\d+(?:\.\d+)?")
_AUDIT_EVENTS = {Action.RESTART: "restart", Action.RETIRE: "retire", Action.SKIP: "restart_skipped"}
ACTOR = "llmhealth"


class Mode(StrEnum):
    ACT = "act"  # restart what the plan allows
    DRY_RUN = "dry_run"  # decide and log every restart, issue and run none (verdicts still count)
    OFF = "off"  # no plan at all: --no-restart, or a settle that only hears commands


@dataclass(frozen=True, slots=True)
class RestartOrder:
    """A restart the ledger accepted (RESTARTING, saved), whose command is still to run."""

    name: str
    url: str  # the server it restarts, which a reload may give another name
    argv: tuple[str, ...]
    timeout: float
    issued_at: float  # the ledger's time of the restart: a later one makes this one moot
    reason: str  # the plan's, for the report once the command is done
    env: Mapping[str, str] = field(repr=False)  # never shown: the daemon's environment
    # The restart history's attempt before this one: withdrawn, this one is given back,
    # and its cooldown with it.
    attempt_before: float | None = None


@dataclass(frozen=True, slots=True)
class CommandDone:
    """A restart command's outcome, for the next settle to feed to the ledger."""

    order: RestartOrder
    result: CommandResult
    # Dropped before it ran because an operator's verb (a hold, a retire) came since it
    # was issued: back to DEAD as any command not run, but no failed restart of its own,
    # nor an attempt against the restart budget.
    withdrawn: bool = False


@dataclass(frozen=True, slots=True)
class RestartOutcome:
    decision: RestartDecision
    refused: str | None = None  # why the ledger refused to issue it, when it did
    order: RestartOrder | None = None  # the command to run once the state is saved


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


def pending_restarts(record: FleetRecord, config: Config, now: float) -> set[str]:
    """The DEAD backends the restart policy will restart, now or later: their own process
    may not prove its way back meanwhile. Whatever this run's mode: ``--no-restart`` and
    ``--dry-run`` postpone a restart, they do not cancel it."""
    backends = {backend.name: backend for backend in config.backends}
    return {
        snap.name
        for snap in record.ledger.snapshots(now, CONDEMNED)
        if restart_pending(
            snap, backends.get(snap.name), record.holds.get(snap.name), config.policy, now
        )
    }


def restart_pending_now(
    record: FleetRecord, backend: Backend | None, name: str, config: Config, now: float
) -> bool:
    """Whether ``pending_restarts`` would hold this backend as the ledger has it now (one
    real traffic condemned after that set was made)."""
    if name not in record.ledger or record.ledger.state_of(name) not in CONDEMNED:
        return False
    snap = record.ledger.snapshot(name, now)
    return restart_pending(snap, backend, record.holds.get(name), config.policy, now)


def remediate(
    record: FleetRecord,
    config: Config,
    now: float,
    *,
    mode: Mode,
    audit: Audit | None,
    commands_running: Collection[str] = frozenset(),
    in_grace: Collection[str] = frozenset(),
) -> list[RestartOutcome]:
    """Plan restarts for every DEAD backend and issue what the plan allows.

    An issued restart is RESTARTING in the ledger and comes back as a ``RestartOrder``:
    running its command is the caller's business, after the state is saved.
    ``commands_running``: the backends whose command the caller still runs (``watch``
    runs them beside its settles): never restarted again meanwhile, and each counted as a
    restart under way (``plan_restarts``); ``in_grace`` those whose command it saw end
    within the startup grace on a steady clock (``plan_restarts``).

    Each audit line carries the proof kept when the backend was condemned (the verdict's
    evidence and reads), whichever run that was; failing that, the ledger's last error.
    """
    if mode is Mode.OFF:
        return []
    backends = {backend.name: backend for backend in config.backends}
    holds = {name: hold for name, hold in record.holds.items() if hold.active(now)}
    # Moved by a reload to another server while DEAD (the one mark a DEAD backend gets
    # after it was condemned, ``fresh_since``) and not read there since: what condemned
    # it was the server it left, and a restart before the first read hit one never judged.
    unread = {
        name
        for name, since in record.fresh_since.items()
        if name in record.ledger
        and record.ledger.state_of(name) is State.DEAD
        and (seen := record.sightings.get(name)) is not None
        and seen.at < since
        and (dead_since := record.ledger.snapshot(name, now).state_since) is not None
        and dead_since < since
    }
    decisions = plan_restarts(
        record.ledger,
        backends,
        holds,
        record.restarts,
        config.policy,
        now,
        commands_running,
        unread,
        in_grace,
    )
    for name in list(record.skips):  # a backend that left DEAD starts afresh
        if name not in record.ledger or record.ledger.state_of(name) is not State.DEAD:
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
            outcome = _issue(record, decision, backends[decision.name].restart, config, now)
            entry["to"] = str(record.ledger.state_of(decision.name))
            if outcome.order is not None:
                entry["argv"] = list(outcome.order.argv)
            if outcome.refused is not None:
                entry["reason"] = f"{decision.reason}; the ledger refused: {outcome.refused}"
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


def _issue(
    record: FleetRecord,
    decision: RestartDecision,
    argv: tuple[str, ...],
    config: Config,
    now: float,
) -> RestartOutcome:
    # The process as last read, not as condemned: a command that returns before it stops
    # leaves it answering, and counters it moved since made it look like its replacement.
    sighting = record.sightings.get(decision.name)
    last = None if sighting is None or sighting.baseline is None else process_of(sighting.baseline)
    issued = record.ledger.apply(decision.name, RestartIssued(now=now, process=last))
    if issued.to_state is not State.RESTARTING:  # retired past the budget, or refused
        return RestartOutcome(decision, None if issued.applied else issued.reason)
    history = record.restarts.get(decision.name, RestartHistory())
    record.restarts[decision.name] = history.record_attempt(now)
    snapshot = record.ledger.snapshot(decision.name, now)
    # What condemned it, as README promises: its last error may be a failed restart
    # ("restart failed: ...") or a probe since, and a script choosing by cause chose wrong.
    condemned = _condemning_evidence(record, decision.name)
    # This config's keys only: a daemon also strips those of the configs it loaded before
    # a reload (still in its environment) when it launches the order (daemon._launch).
    environment = restart_environment(
        os.environ,
        config.key_variables,
        backend=decision.name,
        url=snapshot.url,
        reason=condemned or snapshot.last_error or decision.reason,
    )
    order = RestartOrder(
        decision.name,
        snapshot.url,
        argv,
        config.policy.restart_timeout,
        now,
        decision.reason,
        environment,
        history.last_attempt_at,
    )
    return RestartOutcome(decision, order=order)


def _condemning_evidence(record: FleetRecord, name: str) -> str | None:
    """The evidence of the verdict (or the failed requests) that condemned ``name``, as
    kept with its proof until it serves again."""
    proof = record.proofs.get(name) or {}
    evidence = proof.get("evidence")
    return evidence if isinstance(evidence, str) and evidence else None


def not_run(
    order: RestartOrder, why: str, *, withdrawn: bool = False, own_shortage: bool = False
) -> CommandDone:
    """An order dropped before its command ran, heard and audited as any command's end.
    ``withdrawn``: dropped for an operator's verb, not a failure (``CommandDone``).
    ``own_shortage``: dropped for want of this process's own (no thread to run it in),
    no failed restart either (``CommandResult.own_shortage``), its cooldown kept."""
    result = CommandResult(order.argv, None, False, 0.0, "", f"not run: {why}", own_shortage)
    return CommandDone(order, result, withdrawn)


def command_record(finished: CommandDone, now: float) -> dict[str, Any]:
    """The audit record of how a restart command went."""
    return {
        "time": now,
        "actor": ACTOR,
        "backend": finished.order.name,
        "event": "restart_command",
        "reason": finished.order.reason,
        "command": finished.result.to_dict(),
    }


def heard_as(record: FleetRecord, order: RestartOrder) -> str:
    """The name a finished command's backend has now: a reload may have renamed it at
    its server while the command ran. Its server's record first when its name is now
    another server's and that record's last restart is the order's: a reload that shifted
    names (``FleetRecord.renames``) gave the record the order restarted another name, and
    its outcome went to the backend new at another server."""
    ledger = record.ledger
    if order.name in ledger and not other_server(ledger.url_of(order.name), order.url):
        return order.name
    at = ledger.by_url(order.url)
    if at is not None and (
        order.name not in ledger or is_its_restart(record, at, order, order.issued_at)
    ):
        return at
    return order.name


def is_its_restart(record: FleetRecord, name: str, order: RestartOrder, now: float) -> bool:
    """Whether the ledger's last restart of ``name`` is the one ``order`` ran for: stamped
    at its issue, or the same one taken back to a settle's clock (``Ledger.pull_back``)
    while its command ran, which the ledger remembers it by. Not any restart stamped well
    before the order's: after the clock stepped back, a restart issued once that one was
    taken back and failed (a cron `check` running a slow command) is too, and the old
    command's failure failed it while its own command still ran."""
    last_restart_at = record.ledger.snapshot(name, now).last_restart_at
    if last_restart_at is None:
        return False
    return order.issued_at in (last_restart_at, record.ledger.restart_stamped_at(name))


def _attempt_given_back(
    record: FleetRecord, name: str, order: RestartOrder, stamped: float | None
) -> None:
    """A withdrawn restart's attempt out of the history too: kept, the cooldown it
    started left the backend DEAD ("cooling down ... after the last attempt") although
    no command ran. ``stamped``: the ledger's time of that restart, which a clock
    stepped back since took back with the history's (``FleetRecord.pull_back``)."""
    history = record.restarts.get(name)
    if history is not None and history.last_attempt_at in (order.issued_at, stamped):
        record.restarts[name] = replace(history, last_attempt_at=order.attempt_before)


def hear_commands(
    record: FleetRecord, done: Sequence[CommandDone], audit: Audit | None, now: float
) -> None:
    """Feed finished restart commands to the ledger: a failed one sends it back to DEAD.

    A command that exited 0 proves nothing (only a new process, then re-admission, does),
    so it changes no state; the restart's startup grace counts from its end (a slow
    command does not use up the new process's time); its outcome is still audited. The
    outcome of a restart the ledger has since moved past (failed by its startup grace,
    replaced by a newer restart, the backend gone from the config) is audited and changes
    nothing.
    """
    for finished in done:
        order, result = finished.order, finished.result
        name = heard_as(record, order)
        entry = command_record(finished, now)
        if name != order.name:
            entry.update(backend=name, issued_as=order.name)
        current = name in record.ledger and is_its_restart(record, name, order, now)
        if current:
            state = record.ledger.state_of(name)
            entry["from"] = entry["to"] = str(state)
            if result.ok:
                # Its startup grace counts from now if the command took long.
                record.ledger.apply(name, RestartRan(now=now))
            else:
                why = how_it_ended(result)  # "did not run": the audit line says why
                stamped = record.ledger.snapshot(name, now).last_restart_at
                # A command this process had no descriptor, process or thread to start
                # spent no attempt: held against the backend, a daemon short of them spent
                # each wedged backend's budget and retired it. Its cooldown stands (failures not
                # doubled), so the next try waits the base cooldown, not the next settle.
                no_attempt = finished.withdrawn or result.own_shortage
                failed = record.ledger.apply(
                    name,
                    RestartFailed(now=now, reason=f"restart command {why}", withdrawn=no_attempt),
                )
                entry["to"] = str(failed.to_state)
                if failed.applied and not no_attempt:
                    record.restart_failed(name)
                elif failed.applied and finished.withdrawn:
                    _attempt_given_back(record, name, order, stamped)
        else:
            entry["superseded"] = True
        if audit is not None:
            audit.append(entry)
