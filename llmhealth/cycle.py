"""One settle of a fleet: lock the state, load, gather verdicts, settle, act, persist.

The shell around the pure core, and the one path by which ``check`` (one cycle) and
``watch`` (one per wait) change the record. The store stays locked from load to save, so
two runs never both act on a fleet.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import math
import signal
import threading
import time
from collections.abc import (
    Awaitable,
    Callable,
    Collection,
    Coroutine,
    Hashable,
    Iterator,
    Mapping,
    Sequence,
)
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import FrameType
from typing import Any, Final, TypeVar

from llmhealth.actions import Audit, AuditError, AuditLog, CommandResult, run_command
from llmhealth.classify import Outcome, Target, Verdict, VerdictKind
from llmhealth.config import Backend, Cluster, Config, check_audit_path
from llmhealth.config import Policy as ConfigPolicy
from llmhealth.fleet import FleetRecord, MembershipChange, kept_proofs
from llmhealth.gctune import young_collections_spaced
from llmhealth.ledger import EventKind, Ledger, LedgerPolicy, State, Transition
from llmhealth.metrics import Signals
from llmhealth.probe import STANDBY_ASKS_NOTHING, ProbeSettings, check_fleet
from llmhealth.remediate import (
    ACTOR,
    CommandDone,
    Mode,
    RestartOrder,
    RestartOutcome,
    command_record,
    hear_commands,
    heard_as,
    is_its_restart,
    not_run,
    pending_restarts,
    reads_evidence,
    remediate,
    restart_pending_now,
)
from llmhealth.report import BackendReport, CycleReport, RestartNote, summarize
from llmhealth.state import StateError, StateFile, Store, default_path, given_path
from llmhealth.text import other_server, printable, same_server
from llmhealth.traffic import RequestOutcome
from llmhealth.window import LongestStep

Clock = Callable[[], float]
T = TypeVar("T")


def ledger_policy(policy: ConfigPolicy) -> LedgerPolicy:
    return LedgerPolicy(
        unhealthy_threshold=policy.unhealthy_threshold,
        healthy_threshold=policy.healthy_threshold,
        min_healthy=policy.min_healthy,
        restart_budget=policy.restart_budget,
        restart_budget_window=policy.restart_budget_window,
        startup_grace=policy.startup_grace,
        recover_in_place=policy.recover_in_place,
        max_in_place_recoveries=policy.max_in_place_recoveries,
    )


def backend_urls(targets: Sequence[Target]) -> dict[str, str]:
    """The backends a run knows, by name: the ledger's members (proxies are not)."""
    return {target.name: target.url for target in targets if target.kind == "backend"}


def routed_backends(config: Config, targets: Sequence[Target]) -> list[Backend]:
    """Every backend a router may forward to: as configured, or bare from a URL given."""
    configured = {backend.name: backend for backend in config.backends}
    return [
        configured.get(target.name) or Backend(target.name, target.url)
        for target in targets
        if target.kind == "backend"
    ]


Requests = Mapping[str, Sequence[RequestOutcome]]


@dataclass(frozen=True, slots=True)
class TakenBack:
    """How one backend's times were taken back (``taken_back``)."""

    at: float  # the settle's time: those stamped after it were taken back to before it
    how: dict[float, float]  # each time, stamped as it was, to the time it is now

    def place(self, t: float) -> float:
        """A time of the backend's evidence that was not taken back with them (a verdict's
        reads), placed among those that were as it happened. Compared as stamped, a read
        from before the clock stepped back followed every real request taken back, and
        they were all fed before its verdict, those that came after it too."""
        if t > self.at:  # stamped before the clock stepped back: among those taken back
            before = [stamped for stamped in self.how if self.at < stamped <= t]
            if before:
                return self.how[max(before)]
            earliest = min(to for stamped, to in self.how.items() if stamped > self.at)
            return math.nextafter(earliest, -math.inf)
        # Stamped since it stepped back: after every time taken back, among the requests
        # seen since as they came.
        since = [stamped for stamped in self.how if stamped <= t]
        if since:
            return self.how[max(since)]
        return max(to for stamped, to in self.how.items() if stamped > self.at)


# Per backend whose times were taken back, how.
Taken = dict[str, TakenBack]


def load_record(
    store: Store | None,
    policy: LedgerPolicy,
    backends: Mapping[str, str],
    now: float,
    requests: Requests | None = None,
) -> tuple[FleetRecord, list[MembershipChange], Taken, Requests | None]:
    """The persisted record made to match the configured backends, or a fresh one.

    Call with the store's lock held. The changes say which backends came, moved or went;
    then how the times ahead of the clock were taken back (``reconciled``), and
    ``requests``, taken back with them.
    """
    if store is not None:
        loaded = store.load(lambda document: FleetRecord.from_dict(document, policy))
        if loaded is not None:
            return loaded, *reconciled(loaded, backends, now, requests)
    return fresh_record(policy, backends, now), [], {}, requests


def reconciled(
    record: FleetRecord,
    backends: Mapping[str, str],
    now: float,
    requests: Requests | None = None,
) -> tuple[list[MembershipChange], Taken, Requests | None]:
    """``record.reconcile``, and how the times ahead of the clock were taken back first:
    they came before a move or an arrival the reconcile stamps at ``now``, and a moved
    backend is read where it went before it is restarted (``settle`` takes them back as
    well, for its own callers). ``requests`` are taken back with them (``taken_back``)."""
    if requests:
        # Those the router counted under a backend's new name since a reload renamed it
        # are the same server's, after those under its old one: taken back with its times
        # as the record names it (``_close`` gives them the new name again).
        back = {new: old for old, new in record.renames(backends).items()}
        if back.keys() & requests.keys():
            merged = {name: list(seen) for name, seen in requests.items() if name not in back}
            for new, old in back.items():
                merged.setdefault(old, []).extend(requests.get(new, ()))
            requests = merged
    taken, requests = taken_back(record, now, requests)
    return record.reconcile(backends, now), taken, requests


def taken_back(
    record: FleetRecord, now: float, requests: Requests | None
) -> tuple[Taken, Requests | None]:
    """``record.pull_back``, with the real-traffic outcomes not fed yet taken back in their
    order with their backend's times: those seen before the clock stepped back are stamped
    ahead as the record's times are, and fed as they came, after the record's were taken
    back, an answered request stayed ahead of the restart the same settle issued and
    passed for its replacement proving itself (never failed by its grace). Those seen
    since it stepped back (stamped at most ``now``) came after every time taken back, and
    are placed after them, in their order: kept where they were, a fresh start taken
    back passed for one after them, and they were dropped as the old process's. How each
    backend's times were taken back (``TakenBack.place`` places a verdict's among them),
    and the outcomes."""
    times = {name: [outcome.at for outcome in seen] for name, seen in (requests or {}).items()}
    taken = {name: TakenBack(now, how) for name, how in record.pull_back(now, times).items()}
    if requests is not None and taken.keys() & requests.keys():
        for name in taken.keys() & requests.keys():
            how = taken[name].how
            since = sorted({o.at for o in requests[name] if o.at <= now})
            last = max(how.values())  # just before now: the last time taken back
            gap = (now - last) / (len(since) + 1)
            how.update((t, last + (i + 1) * gap) for i, t in enumerate(since))
        requests = {
            name: [replace(o, at=taken[name].how.get(o.at, o.at)) for o in seen]
            if name in taken
            else seen
            for name, seen in requests.items()
        }
    return taken, requests


def stepped_note(name: str) -> str:
    """The note of a settle that pulled ``name``'s times back (``FleetRecord.pull_back``)."""
    return f"{name}: times ahead of the clock taken as now (it stepped back?)"


def fresh_record(policy: LedgerPolicy, backends: Mapping[str, str], now: float) -> FleetRecord:
    """The record a fleet starts from: its backends are the starting membership (epoch 0,
    every one HEALTHY), not changes to it."""
    return FleetRecord(Ledger(policy, backends.items(), now=now))


@dataclass(slots=True)
class Kept:
    """The record exactly as the last settle saved it, with the store's mark of that save:
    the next settle starts from it instead of reading and decoding the store again (at
    10,000 backends that was half of every settle), as long as the store still bears the
    mark. Another writer in between (an operator verb, a `check`) changes the mark, and
    the record is loaded as it is now.

    A settle takes the record out before it changes anything and puts it back only once
    the save succeeded, so memory is never ahead of the store: a settle that fails
    anywhere (a failed save, a lost lock) leaves nothing kept, and the next one loads
    what the store really holds.
    """

    record: FleetRecord | None = None
    mark: Hashable | None = None
    policy: LedgerPolicy | None = None

    def take(self, store: Store, policy: LedgerPolicy) -> FleetRecord | None:
        """The kept record if the store still holds it under the same policy; else None.
        Either way nothing stays kept until the next ``keep``."""
        record, self.record = self.record, None
        if record is None or self.mark is None or policy != self.policy:
            return None
        return record if store.mark() == self.mark else None

    def keep(self, store: Store, record: FleetRecord, policy: LedgerPolicy) -> None:
        """Called right after ``record`` was saved to ``store``, with its lock still held."""
        self.mark = store.mark()
        self.record, self.policy = (record, policy) if self.mark is not None else (None, None)


@dataclass(frozen=True, slots=True)
class Settled:
    """What one settle did (the report), the record as it saved it, and the restart
    commands it ordered: saved as issued, to be run by the caller outside the lock."""

    report: CycleReport
    record: FleetRecord
    orders: tuple[RestartOrder, ...] = ()


def settle_fleet(
    store: Store | None,
    config: Config,
    backends: Mapping[str, str],
    gather: Callable[[FleetRecord], Sequence[Outcome]],
    *,
    mode: Mode,
    audit: Audit | None,
    clock: Clock = time.time,
    notes: Sequence[str] = (),
    requests: Mapping[str, Sequence[RequestOutcome]] | None = None,
    commands: Sequence[CommandDone] = (),
    commands_running: Collection[str] = frozenset(),
    kept: Kept | None = None,
    unread: Collection[str] = frozenset(),
    in_grace: Collection[str] = frozenset(),
) -> Settled:
    """The one settle path: lock, load, gather verdicts, settle, save.

    ``check`` and ``watch`` both come through here, and differ only in ``gather``: check
    probes the fleet (with the record's baselines), watch hands over what its probing
    tasks read since the last settle. ``requests`` are what real traffic through
    ``route`` showed since then, per backend in order; ``commands`` the restart commands
    that finished, ``commands_running`` the backends whose command still runs (never a
    second at once), ``unread`` those it has not read yet at their present address (a
    daemon just started, a backend just added or moved), ``in_grace`` those whose restart
    command it saw end less than the startup grace ago on a steady clock (a wall clock
    stepped forward since does not fail their restarts). No command runs in here: the
    restarts it issues come back as orders.
    ``kept``: the record the caller's last settle saved, used instead of loading while
    the store is unchanged (``Kept``), and updated by this one. Without a store nothing
    is kept between runs.
    """
    with store.locked() if store is not None else contextlib.nullcontext():
        opened = _open(store, config, backends, clock, notes, kept, requests)
        outcomes = gather(opened.record)
        return _close(
            store,
            config,
            opened,
            outcomes,
            mode,
            audit,
            clock,
            opened.requests,
            commands,
            commands_running,
            kept,
            unread,
            in_grace,
        )


async def settle_fleet_async(
    store: Store | None,
    config: Config,
    backends: Mapping[str, str],
    gather: Callable[[FleetRecord], Awaitable[Sequence[Outcome]]],
    *,
    mode: Mode,
    audit: Audit | None,
    clock: Clock = time.time,
    notes: Sequence[str] = (),
    commands: Sequence[CommandDone] = (),
    kept: Kept | None = None,
) -> Settled:
    """settle_fleet for a ``gather`` that must run in the caller's event loop."""
    with store.locked() if store is not None else contextlib.nullcontext():
        opened = _open(store, config, backends, clock, notes, kept)
        outcomes = await gather(opened.record)
        return _close(
            store, config, opened, outcomes, mode, audit, clock, None, commands, frozenset(), kept
        )


@dataclass(frozen=True, slots=True)
class _Opened:
    record: FleetRecord
    policy: LedgerPolicy
    started: float
    notes: list[str]
    changes: list[MembershipChange]  # for the audit trail, with the settle's own records
    requests: Requests | None = None  # as given, their times taken back with the record's
    taken: Taken = field(default_factory=dict)  # how the record's times were taken back


def _open(
    store: Store | None,
    config: Config,
    backends: Mapping[str, str],
    clock: Clock,
    notes: Sequence[str],
    kept: Kept | None,
    requests: Requests | None = None,
) -> _Opened:
    """The first half of a settle, with the lock held: the record as last kept, if the
    store still holds it, else loaded; ``requests`` taken back with its times."""
    started = clock()
    policy = ledger_policy(config.policy)
    record = kept.take(store, policy) if kept is not None and store is not None else None
    if record is not None:
        changes, taken, requests = reconciled(record, backends, started, requests)
    else:
        record, changes, taken, requests = load_record(store, policy, backends, started, requests)
    notes = [*notes, *(c.note for c in changes), *(stepped_note(name) for name in sorted(taken))]
    return _Opened(record, policy, started, notes, changes, requests, taken)


def _close(
    store: Store | None,
    config: Config,
    opened: _Opened,
    outcomes: Sequence[Outcome],
    mode: Mode,
    audit: Audit | None,
    clock: Clock,
    requests: Mapping[str, Sequence[RequestOutcome]] | None,
    commands: Sequence[CommandDone],
    commands_running: Collection[str],
    kept: Kept | None,
    unread: Collection[str] = frozenset(),
    in_grace: Collection[str] = frozenset(),
) -> Settled:
    """The second half, with the lock still held: settle the verdicts, act, save."""
    record = opened.record
    renamed = {change.was: change.name for change in opened.changes if change.was is not None}
    if requests and renamed.keys() & requests.keys():
        # Outcomes recorded under a backend's old name before a reload renamed it: the same
        # server, whose streak the rename kept. Dropped as "no longer configured", a
        # failure drained across the rename was lost.
        requests = _renamed_requests(requests, renamed)
    taken = {renamed.get(name, name): how for name, how in opened.taken.items()}
    # One fsync for the settle's audit records, once the state that follows from them is
    # written aside and before it replaces the old: a full disk fails the state's write
    # first, and nothing of the settle is kept, its records included.
    with contextlib.ExitStack() as batch:
        if audit is not None:
            batch.enter_context(audit.batch())
        for change in opened.changes:
            _audit_change(audit, change, opened.started)
        report, orders = settle(
            record,
            config,
            outcomes,
            clock(),
            mode=mode,
            audit=audit,
            notes=opened.notes,
            requests=requests,
            commands=commands,
            commands_running=commands_running,
            unread=unread,
            taken=taken,
            in_grace=in_grace,
        )
        if store is not None:
            try:
                store.save(record.to_document(), before=batch.close)
            except StateError as exc:
                if isinstance(audit, AuditLog):  # its records may be durable already
                    audit.take_back_batch()
                from llmhealth.cluster import SaveUnansweredError  # noqa: PLC0415

                if isinstance(exc, SaveUnansweredError):
                    exc.orders = tuple(orders)  # for the settle that finds it went in
                raise
    if store is not None and kept is not None:
        kept.keep(store, record, opened.policy)
    return Settled(replace(report, checked_at=opened.started), record, tuple(orders))


def _renamed_requests(
    requests: Mapping[str, Sequence[RequestOutcome]], renamed: Mapping[str, str]
) -> dict[str, list[RequestOutcome]]:
    """``requests`` under the names the backends have now, each backend's in time order."""
    merged: dict[str, list[RequestOutcome]] = {}
    for name, seen in requests.items():
        merged.setdefault(renamed.get(name, name), []).extend(seen)
    for name in set(renamed.values()) & merged.keys():
        merged[name].sort(key=lambda outcome: outcome.at)  # stable: ties keep their order
    return merged


def run_cycle(
    config: Config,
    targets: list[Target],
    settings: ProbeSettings,
    store: Store | None,
    *,
    mode: Mode = Mode.ACT,
    clock: Clock = time.time,
    audit: Audit | None = None,
    notes: Sequence[str] = (),
) -> CycleReport:
    """One ``check``: probe every target inside the settle, so two runs never both act.

    The restart commands it orders run after the settle let go of the lock, one after
    another, and a second settle records how they went; only then does the check report.
    """
    return run_loop(
        run_cycle_async(
            config, targets, settings, store, mode=mode, clock=clock, audit=audit, notes=notes
        )
    )


def run_cycle_in_cluster(
    config: Config,
    cluster: Cluster,
    targets: list[Target],
    settings: ProbeSettings,
    *,
    mode: Mode,
    log: Callable[[str], None],
) -> CycleReport:
    """One ``check`` beside a cluster's daemons (from cron, a script): it acts only if it
    wins the lease for its run. Otherwise it reads and reports as a standby does, says who
    leads, and writes nothing; with etcd away it writes nothing either. ``log`` hears the
    elector's news (etcd's own error texts among them)."""
    from llmhealth.cluster import ClusterError, Seat  # noqa: PLC0415 - only a cluster's

    seat = Seat.for_config(cluster, log)
    # Not acting, it asks nothing either, as a standby daemon does (STANDBY_ASKS_NOTHING).
    standby = replace(settings, unasked=STANDBY_ASKS_NOTHING)
    try:
        seat.elector.step_and_observe()
    except ClusterError as exc:
        # The lead may have been won before the reads that failed: given back, or no
        # daemon could lead for a whole lease after this run was gone.
        seat.elector.stop()
        note = f"etcd unreachable, nothing acted on or written: {exc}"
        return run_cycle(config, targets, standby, None, mode=Mode.OFF, notes=[note])
    if not seat.elector.decision().may_act:
        note = f"not acting: {seat.standing()}; nothing restarted or written"
        seat.elector.stop()
        return run_cycle(config, targets, standby, seat.reader, mode=Mode.OFF, notes=[note])
    seat.elector.start()  # keeps the lease renewed while the reads take their waits
    with _stops_delivered_after():  # a stop its commands held off ends it once resigned
        try:
            # Its audit records go to etcd with the state, as the daemons' do.
            return run_cycle(
                config, targets, settings, seat.store, mode=mode, audit=seat.store.audit
            )
        finally:
            seat.elector.stop()  # resigns: the daemons' next round elects one of them


def run_loop(main: Coroutine[Any, Any, T]) -> T:
    """``asyncio.run(main)`` for a check, which runs to its end in its own loop.

    ``main``'s value is not made the result of its task: leaving, ``asyncio.run`` puts
    back the SIGINT handler it replaced, and ``signal`` tries the handler it takes off
    (which holds the main task) as an enum member; the message of that failure is a
    ``repr`` of the task and so of its result. The report of a check of 3,000 backends
    was rendered whole, 87,000 dataclass ``repr`` calls, to be cut to 60 characters and
    thrown away (Python 3.11).

    The cyclic collector runs a young collection after ``gctune.YOUNG`` allocations
    instead of 700 while it runs: nearly everything a check allocates (reads, verdicts,
    the report) lives until it ends, and at the default the collector walked it again and again,
    about 540 collections and 0.4-0.6 s of a 3,000-backend check's CPU.
    """
    kept: list[T] = []

    async def keep() -> None:
        kept.append(await main)

    with young_collections_spaced():
        try:
            asyncio.run(keep())
        except RuntimeError as exc:
            # Raised by the loop's close once ``main`` ended: out of threads (a pids
            # limit), it could not start the one that shuts its executor down. The check
            # is done and recorded; raised, it ended as a bug, its report unprinted.
            # A check a Ctrl-C ended is interrupted still, no bug: the close raised in
            # place of the KeyboardInterrupt it was leaving with.
            if not kept:
                if isinstance(interrupt := exc.__context__, KeyboardInterrupt):
                    raise interrupt from None
                raise
    return kept[0]


async def run_cycle_async(
    config: Config,
    targets: list[Target],
    settings: ProbeSettings,
    store: Store | None,
    *,
    mode: Mode = Mode.ACT,
    clock: Clock = time.time,
    audit: Audit | None = None,
    notes: Sequence[str] = (),
) -> CycleReport:
    """run_cycle inside a running event loop (the library's check_async).

    The audit log is the given one, else the state file's neighbour; a store that is not
    a file (a cluster's) writes none unless given one.
    """
    notes = list(notes)
    if audit is None and isinstance(store, StateFile):
        # Locked on the loop, as the state is: waited for no longer than the state's lock
        # (none for check_async), or a backup holding it froze the caller's loop for 10 s.
        audit = AuditLog(audit_path_for(config, store.path), lock_timeout=store.lock_timeout)
    if store is None:
        if not notes:  # a caller with its own reason (etcd away) has said it
            notes.append("state not persisted: bare URLs without --state or --config")
        mode = Mode.OFF  # nothing to remember a restart by, and no restart commands

    kept = Kept()  # the settle that hears the commands starts from what the first saved

    async def probe(record: FleetRecord) -> list[Outcome]:
        return await check_fleet(
            targets,
            replace(
                settings,
                awaiting_answer=record.ledger.awaiting_readmission,
                retired=record.ledger.retired,
            ),
            clock=clock,
            baselines=baselines_of(record),
            learned=learned_steps_of(record),
        )

    settled = await settle_fleet_async(
        store,
        config,
        backend_urls(targets),
        probe,
        mode=mode,
        audit=audit,
        clock=clock,
        notes=notes,
        kept=kept,
    )
    if not settled.orders:
        return settled.report
    assert store is not None  # orders come only from a settle that saved them
    stops = _Stops()
    try:
        return await _run_orders(config, targets, store, audit, clock, kept, settled, stops)
    finally:
        stops.release()  # a stop that came ends the check here, its commands recorded


async def _run_orders(
    config: Config,
    targets: list[Target],
    store: Store,
    audit: Audit | None,
    clock: Clock,
    kept: Kept,
    settled: Settled,
    stops: _Stops,
) -> CycleReport:
    """A check's restart commands, run one after another, and the settle that records
    how they went; the check's report with their outcomes."""
    done: list[CommandDone] = []
    first, interrupted = settled.report, False
    held = contextlib.ExitStack()  # Ctrl-C held off, once it came, until it is recorded
    this = asyncio.current_task()
    why = "the check was interrupted (Ctrl-C) before it ran"
    for index, order in enumerate(settled.orders):
        if stops.came is not None:
            # Stopped while an earlier command ran: no more commands, as for a Ctrl-C.
            stopped = f"the check was stopped ({stops.came.name}) before it ran"
            done += [not_run(later, stopped, withdrawn=True) for later in settled.orders[index:]]
            break
        # An operator's verb saved while an earlier command ran (outside the lock, which
        # it must not hold up): a hold or a retire since the settle stops this one.
        dropped = withdrawn_now(store, config, order, clock()) if done else None
        if dropped is not None:
            done.append(dropped)
            continue
        try:
            # A cluster leader's store refuses once its lease may have passed on, and
            # otherwise adds its fencing token to the command's environment.
            env = {**order.env, **store.command_env()}
        except StateError as exc:
            note = f"{order.name}: restart saved but not run: {exc}"
            first = replace(first, notes=(*first.notes, note))
            break  # nor the orders after it; the commands already run are still heard
        if this is not None and this.cancelling():
            # Ctrl-C came since the last await (the settle's save, the read between two
            # commands): started anyway, the command ran and was waited for after it.
            held.callback(_hold_ctrl_c())
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.sleep(0)  # taken here, as below, not in the recording settle
            interrupted = True
            done += [not_run(later, why, withdrawn=True) for later in settled.orders[index:]]
            break
        # A future, not a task: asyncio.run's close cancels every task left (a second
        # Ctrl-C), and a cancelled task would lose the result its thread still brings.
        handoff = _Handoff(order, env)
        try:
            running = asyncio.get_running_loop().run_in_executor(None, handoff.run)
        except RuntimeError as exc:
            # Out of threads (a pids limit): this process's want, no restart that failed
            # (``CommandResult.own_shortage``), as in `watch`. Raised, the check ended
            # with a traceback, its backend RESTARTING until the grace failed it as a
            # tried restart. The executor queued the call before its thread failed to
            # start: given up, a thread freed later does not run it after all; one freed
            # in between took it, and it is heard as any command that ran.
            # None of the orders after it runs either: each would queue another call.
            if handoff.give_up():
                short = f"no thread to run it in: {exc}"
                done += [
                    not_run(later, short, own_shortage=True) for later in settled.orders[index:]
                ]
                break
            running = asyncio.wrap_future(handoff.ran)
        try:
            result = await asyncio.shield(running)
        except asyncio.CancelledError:
            # Ctrl-C: its thread runs the command to its end regardless; hear how it went.
            # A later Ctrl-C is held off until that is recorded: raised as KeyboardInterrupt
            # anywhere (the recording settle's wait for the state lock too), it lost it.
            held.callback(_hold_ctrl_c())
            while not running.done():
                with contextlib.suppress(asyncio.CancelledError):
                    await asyncio.shield(running)
            done.append(CommandDone(order, running.result()))
            interrupted = True
            # The orders after it were saved RESTARTING and will not run: heard as not run
            # (no attempt spent), or each sat RESTARTING, holding a concurrency place,
            # until its startup grace failed it as a restart that had been tried.
            done += [not_run(later, why, withdrawn=True) for later in settled.orders[index + 1 :]]
            break
        done.append(CommandDone(order, result))
    if not done:
        return first
    if not interrupted:
        # A Ctrl-C that first comes now (this settle waits up to 10 s for a lock another
        # run holds) ends the check once it is recorded; one pressed again meanwhile was
        # a KeyboardInterrupt inside it, the commands' outcomes lost.
        held.callback(_hold_ctrl_c(pass_first=this is None or not this.cancelling()))

    async def nothing(_record: FleetRecord) -> list[Outcome]:
        return []

    try:
        heard = await settle_fleet_async(
            store,
            config,
            backend_urls(targets),
            nothing,
            mode=Mode.OFF,  # this settle records the commands; the plan was made above
            audit=audit,
            clock=clock,
            commands=done,
            kept=kept,
        )
    except (StateError, AuditError) as exc:
        report = _commands_unsettled(first, done, audit, clock(), exc)
    else:
        report = _with_commands(first, heard)
    finally:
        held.close()
    if interrupted:
        raise asyncio.CancelledError  # recorded: now the interruption goes on
    return report


class _Handoff:
    """A check's command handed to its loop's executor: run by the thread that takes it,
    or given up by the check, never both. The executor queues a call before it starts the
    thread for it; that start failing, a thread of its own freed in between may have
    taken the call already, and ran the restart the check would hear as not run."""

    def __init__(self, order: RestartOrder, env: Mapping[str, str]) -> None:
        self.order, self.env = order, env
        self.ran: concurrent.futures.Future[CommandResult] = concurrent.futures.Future()
        self._claimed = threading.Lock()

    def run(self) -> CommandResult:
        """The command's result, in the executor's thread; nothing run once given up."""
        if not self._claimed.acquire(blocking=False):
            return not_run(self.order, "given up by its check: no thread to run it in").result
        try:
            result = run_command(self.order.argv, self.order.timeout, env=self.env)
        except BaseException as exc:
            self.ran.set_exception(exc)
            raise
        self.ran.set_result(result)
        return result

    def give_up(self) -> bool:
        """True when no thread has taken the call, which then never runs; False when one
        has (its result comes in ``ran``)."""
        return self._claimed.acquire(blocking=False)


def withdrawn_now(
    store: Store, config: Config, order: RestartOrder, now: float
) -> CommandDone | None:
    """The order dropped, not run, if the record as stored now says it must not run: an
    operator's verb, which is no failed restart (``CommandDone.withdrawn``)."""
    why = _no_longer_to_run(store, config, order, now)
    return None if why is None else not_run(order, why, withdrawn=True)


def _no_longer_to_run(store: Store, config: Config, order: RestartOrder, now: float) -> str | None:
    """Why a restart this check saved must not run now, if it must not: its command no
    longer the one ``config`` gives its server (a daemon reloaded since it was issued), or
    its backend held, retired or otherwise moved past that restart since (the record as
    stored now). None when the record cannot be read: the settle that hears the commands
    says why. Withdrawn, a command a reload changed spends no attempt, and the next
    settle issues the restart anew with the command configured then, if any."""
    changed = command_changed(config, order)
    if changed is not None:
        return changed
    policy = ledger_policy(config.policy)
    try:
        record = store.read(lambda document: FleetRecord.from_dict(document, policy))
    except StateError:
        return None
    if record is None:
        return None
    ledger = record.ledger
    name = order.name if order.name in ledger else ledger.by_url(order.url)
    if name is None:
        return f"{order.name} is no longer in the state"
    snapshot = ledger.snapshot(name, now)
    if snapshot.state is not State.RESTARTING or not is_its_restart(record, name, order, now):
        return f"{name} is {snapshot.state} since its restart was issued"
    hold = record.holds.get(name)
    if hold is not None and hold.active(now):
        return f"{name} is {hold.describe(now)}"
    return None


def command_changed(config: Config, order: RestartOrder) -> str | None:
    """Why ``order`` must not run, if ``config`` no longer gives its server its command (a
    daemon reloaded since it was issued): asked again by a daemon's command thread just
    before it runs, as a reload may be applied while the thread reads the record."""
    server = same_server(order.url)
    configured = next((b.restart for b in config.backends if same_server(b.url) == server), None)
    if configured is None:  # the backend dropped, or moved to another server
        return f"{order.name}'s server was taken out of the config by a reload since it was issued"
    if configured != order.argv:
        return f"{order.name}'s restart command was changed by a reload since it was issued"
    return None


# Signals whose default ends a run at once, what it started left unowned: `timeout`
# around a check, a oneshot unit stopped, a CronJob's deadline, a terminal closed.
STOP_SIGNALS: Final = (signal.SIGTERM, signal.SIGHUP)


class _Stops:
    """SIGTERM and SIGHUP held off while a check's restart commands run and the settle
    that records them does, then let through (``release``): the check ends as it would
    have, once what it started is on record. Each ended the check at once: its command
    ran on in its own session with nobody to hear it, its exit code and output in no
    audit line, its backend RESTARTING until the startup grace (15 min) failed it, a
    command that had failed at once included.

    Only where the signal would end the process (its default handler, in the main
    thread): one the caller handles or ignores (``nohup``) is left as it is."""

    def __init__(self) -> None:
        self.came: signal.Signals | None = None
        self._put_aside: dict[
            signal.Signals, Callable[[int, FrameType | None], Any] | int | signal.Handlers | None
        ] = {}
        if threading.current_thread() is not threading.main_thread():
            return
        for signum in STOP_SIGNALS:
            if signal.getsignal(signum) is signal.SIG_DFL:
                self._put_aside[signum] = signal.signal(signum, self._came)

    def _came(self, signum: int, _frame: FrameType | None) -> None:
        if self.came is None:
            self.came = signal.Signals(signum)

    def release(self) -> None:
        """Each handler put back; the first stop that came, if one did, delivered now, or
        where ``_stops_delivered_after`` ends if the check is inside one."""
        for signum, before in self._put_aside.items():
            signal.signal(signum, before)
        if self.came is None:
            return
        if _DELIVERED_AFTER:  # came only in the main thread, the one these are taken in
            _DELIVERED_AFTER[-1].append(self.came)
        else:
            signal.raise_signal(self.came)


# The main thread's places a held stop is delivered at instead (``_stops_delivered_after``),
# the latest last.
_DELIVERED_AFTER: list[list[signal.Signals]] = []


@contextlib.contextmanager
def _stops_delivered_after() -> Iterator[None]:
    """A stop a check's commands held off (``_Stops``) delivered as this ends, not as the
    check's cycle does: a cluster's check gives its lead back first. Delivered at the
    cycle's end, the stop ended the check before its resign, and its leader key kept
    every daemon from leading for a whole lease."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    came: list[signal.Signals] = []
    _DELIVERED_AFTER.append(came)
    try:
        yield
    finally:
        _DELIVERED_AFTER.pop()  # taken and let go in order: one thread, one with each
        if came:
            signal.raise_signal(came[0])


@dataclass(eq=False)
class _Held:
    """One hold of Ctrl-C (``_hold_ctrl_c``): what it put aside, and whether the one
    press it passes on has come."""

    before: Callable[[int, FrameType | None], Any] | int | signal.Handlers | None
    passed: bool

    def pressed(self, signum: int, frame: FrameType | None) -> None:
        if not self.passed and callable(self.before):
            self.passed = True
            self.before(signum, frame)


# The main thread's holds, the latest last. Checks run together in one program (a
# library's check_async, gathered) hold and let go in any order: each putting back what
# it had replaced, the last to let go put back another's hold, which ignored Ctrl-C for
# the rest of the program's life.
_HELD: list[_Held] = []


def _hold_ctrl_c(*, pass_first: bool = False) -> Callable[[], object]:
    """Ignore SIGINT (in the main thread, where a handler can be set) until the function
    returned puts back the handler it replaced. ``pass_first``: the first one still goes
    to asyncio.run's handler, which cancels the check where it next waits (and makes
    the run exit 130); only the ones after it are ignored."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None
    before = signal.getsignal(signal.SIGINT)
    if pass_first and (not callable(before) or before is signal.default_int_handler):
        return lambda: None  # no asyncio.run handler to pass it to: left as it is
    held = _Held(before, passed=not pass_first)
    signal.signal(signal.SIGINT, held.pressed)
    _HELD.append(held)

    def release() -> None:
        index = _HELD.index(held)
        del _HELD[index]
        if index < len(_HELD):
            # A hold taken since is still on, with this one's handler put aside: what
            # this one replaced is what that one puts back, and passes a press on to.
            _HELD[index].before = held.before
        else:
            signal.signal(signal.SIGINT, held.before)

    return release


def _commands_unsettled(
    first: CycleReport,
    done: Sequence[CommandDone],
    audit: Audit | None,
    now: float,
    exc: Exception,
) -> CycleReport:
    """The commands ran, and the settle that records them failed (the state locked, set
    aside, a disk full): their outcomes went with it, a failed command's exit code and
    stderr in no trail, its backend left RESTARTING until its grace ran out. They go to
    a file audit log by themselves, in one batch (a log locked by another waits once),
    and to the report: each restart's note says it ran and how it went."""
    kept = "in the audit log (unsettled)"
    if audit is not None:
        try:
            with audit.batch():
                for finished in done:
                    audit.append({**command_record(finished, now), "unsettled": str(exc)})
        except AuditError as why:  # a cluster's trail takes records only with its state
            kept = f"in no audit log ({why})"
    else:
        kept = "in no audit log"
    notes = list(first.notes)
    outcomes = {}
    for finished in done:
        result = finished.result
        outcomes[finished.order.name] = finished
        if finished.withdrawn:
            went = f"withdrawn ({printable(result.stderr.strip()[-200:])})"
        else:
            went = "ran" if result.ok else f"failed ({printable(result.stderr.strip()[-200:])})"
        notes.append(
            f"{finished.order.name}: restart command {went}; its outcome is in no state "
            f"({exc}), {kept}"
        )
    restarts = tuple(
        _heard_note(note.name, outcomes[note.name])
        if note.action == "restart" and note.name in outcomes
        else note
        for note in first.restarts
    )
    return replace(first, notes=tuple(notes), restarts=restarts)


def _heard_note(name: str, done: CommandDone) -> RestartNote:
    """How a restart command went, for the report: one withdrawn before it ran (an
    operator's hold or retire since, a Ctrl-C, a stop) did not run, and is no failed
    restart (``CommandDone.withdrawn``): shown as one, `watch` counted it in
    ``llmhealth_backend_restarts_total{outcome="failed"}``, where two holds fired
    LLMHealthRestartsFailing, and logged and printed "restart FAILED"."""
    if done.withdrawn:
        why = done.result.stderr.strip()
        return RestartNote(name, "restart", f"{why} ({done.order.reason})", False, None, False)
    return RestartNote(name, "restart", done.order.reason, True, done.result.ok, False)


def _with_commands(first: CycleReport, heard: Settled) -> CycleReport:
    """A check's report once its commands ran: each restart with its outcome, and every
    backend in the state the record now holds (DEAD again after a failed command)."""
    ledger, now = heard.record.ledger, heard.report.checked_at
    outcomes = {note.name: note for note in heard.report.restarts}
    return replace(
        first,
        backends=tuple(
            replace(backend, snapshot=ledger.snapshot(backend.outcome.target.name, now))
            if backend.snapshot is not None and backend.outcome.target.name in ledger
            else backend
            for backend in first.backends
        ),
        fleet=heard.report.fleet,
        notes=first.notes + heard.report.notes,
        restarts=tuple(
            outcomes.get(note.name, note) if note.action == "restart" else note
            for note in first.restarts
        ),
    )


def expire_restarts(
    record: FleetRecord,
    audit: Audit | None,
    now: float,
    verdicts: Mapping[str, Verdict],
    sparing: Collection[str] = frozenset(),
) -> list[Transition]:
    """Restarts not proven within their startup grace failed: DEAD again, cooldown doubled;
    never those of ``sparing`` (a command still running, a new process seen first now).

    Called after this settle's verdicts were fed, so a replacement re-admitted just now is
    not failed. The audit line says what was waited for and what was last seen.
    """
    failed = []
    before = {name: record.ledger.snapshot(name, now) for name in record.ledger.overdue(now)}
    for expired in record.ledger.expire_restarts(now, sparing=sparing):
        record.restart_failed(expired.name)
        failed.append(expired)
        snap = before[expired.name]
        evidence: dict[str, Any] = {
            "restarted_at": snap.last_restart_at,
            "restart_ran_at": snap.restart_ran_at,
            "startup_grace": record.ledger.policy.startup_grace,
            "in_state_since": snap.state_since,
            "last_error": snap.last_error,
        }
        verdict = verdicts.get(expired.name)
        if verdict is not None:
            evidence["verdict"] = str(verdict.kind)
            evidence["evidence"] = verdict.evidence
        _audit_transition(audit, expired, now, evidence)
    return failed


def baselines_of(record: FleetRecord) -> dict[str, Signals]:
    """What earlier runs last read of each backend: the only way to see a restart between."""
    return {
        name: sighting.baseline
        for name, sighting in record.sightings.items()
        if sighting.baseline is not None
    }


def learned_steps_of(record: FleetRecord) -> dict[str, LongestStep]:
    """The longest step earlier runs saw each backend take: it widens the wedge window."""
    return {
        name: sighting.longest_step
        for name, sighting in record.sightings.items()
        if sighting.longest_step is not None
    }


def settle(
    record: FleetRecord,
    config: Config,
    outcomes: Sequence[Outcome],
    now: float,
    *,
    mode: Mode,
    audit: Audit | None,
    notes: Sequence[str] = (),
    requests: Mapping[str, Sequence[RequestOutcome]] | None = None,
    commands: Sequence[CommandDone] = (),
    commands_running: Collection[str] = frozenset(),
    unread: Collection[str] = frozenset(),
    taken: Taken | None = None,
    in_grace: Collection[str] = frozenset(),
) -> tuple[CycleReport, list[RestartOrder]]:
    """Feed finished restart commands, verdicts, then real-traffic outcomes to the ledger;
    fail the restarts left unproven past their startup grace; plan and issue restarts;
    say what happened, and which restart commands are to run.

    Verdicts and real-traffic outcomes go in the order they happened, each backend's
    requests that ended before its verdict's evidence first: a request answered between
    two failures breaks the streak whichever told of it (a wedge proven after a traffic
    condemnation still becomes the condemning cause). Overdue restarts come after both,
    so a replacement re-admitted in this settle is spared.

    ``taken``: how the caller already took the record's times back, and ``requests``
    with them (``settle_fleet``): a verdict's reads are placed among them to be ordered
    with the requests.
    """
    hear_commands(record, commands, audit, now)  # first: each knows its restart by its time
    here, requests = taken_back(record, now, requests)
    stepped = sorted(here)
    taken = {**(taken or {}), **here}
    expected = {b.name: b.expected_model for b in config.backends}
    configured = {b.name: b for b in config.backends}
    pending = pending_restarts(record, config, now)
    reports = []
    in_ledger = set()
    proven = False  # a proof with reads kept in this settle
    verdicts = {}  # what was fed: a restart's expiry may quote it as evidence
    # Backends whose new process this settle saw first: it gets one settle to prove itself
    # before the grace fails it. Seen first late (a cron check every 5 min, a model that
    # loads for 12), it was failed the moment it was seen, and its working server killed.
    arrived = set()
    unheard = {name: list(seen) for name, seen in (requests or {}).items()}
    traffic: list[Transition] = []

    def hear_requests(name: str, seen: Sequence[RequestOutcome]) -> None:
        for transition in record.observe_requests(name, seen):
            traffic.append(transition)
            if transition.applied and transition.from_state != transition.to_state:
                _audit_transition(audit, transition, now, record.proofs.get(name, {}))
                # Condemned by traffic before its verdict: its restart is as pending as
                # one condemned before the settle, or the verdict counted towards a
                # recovery in place, stamped good at the instant of the restart after it.
                if restart_pending_now(record, configured.get(name), name, config, now):
                    pending.add(name)

    for outcome in outcomes:
        name = outcome.target.name
        if (
            outcome.target.kind != "backend"
            or name not in record.ledger
            # Read at the address the backend had before a reload moved it: what its old
            # server did says nothing of the new one, which starts afresh (``moved``).
            # Its URL only written another way is the same server.
            or other_server(outcome.target.url, record.ledger.url_of(name))
        ):
            reports.append(BackendReport(outcome, None))
            continue
        in_ledger.add(name)
        verdicts[name] = outcome.verdict
        # Real requests that ended before the verdict's reads go first, in time order: one
        # answered in between broke the streak the verdict would otherwise have ended.
        read_at = _verdict_time(outcome.verdict)
        if read_at is not None and name in taken:
            read_at = taken[name].place(read_at)
        drained = unheard.get(name, [])
        cut = 0  # the outcomes come in the order they ended
        while read_at is not None and cut < len(drained) and drained[cut].at <= read_at:
            cut += 1
        if cut:
            unheard[name] = drained[cut:]
            hear_requests(name, drained[:cut])
        # A wedge proven on a backend something else condemned becomes its cause, DEAD to
        # DEAD: written down with its proof like any condemnation, or a restart for it
        # went to the trail with the evidence of the cause it replaced.
        dead = (
            outcome.verdict.kind is VerdictKind.WEDGED
            and record.ledger.state_of(name) is State.DEAD
        )
        cause = record.ledger.condemned_by(name) if dead else None
        transitions = tuple(
            record.observe(
                name,
                outcome.verdict,
                now,
                expected.get(name),
                restart_pending=name in pending,
            )
        )
        recondemned = (
            dead
            and record.ledger.state_of(name) is State.DEAD
            and record.ledger.condemned_by(name) != cause
        )
        moved = [
            t
            for t in transitions
            if t.applied
            and (t.from_state != t.to_state or (recondemned and t.to_state is t.from_state))
        ]
        if moved:  # evidence as plain values only when something is written down
            evidence = {
                "verdict": str(outcome.verdict.kind),
                "evidence": outcome.verdict.evidence,
                "reads": reads_evidence(outcome.verdict),
            }
            for transition in moved:
                _audit_transition(audit, transition, now, evidence)
            if record.ledger.state_of(name) is State.DEAD:
                record.proofs[name] = evidence  # cut to its share below (kept_proofs)
                proven = True
        if any(t.applied and t.kind is EventKind.NEW_PROCESS_UP for t in transitions):
            arrived.add(name)
        reports.append(BackendReport(outcome, None, transitions))
    if proven:  # the record keeps every proof: together within their bytes too
        kept_proofs(record.proofs)
    for name, seen in unheard.items():
        if name in record.ledger and seen:  # else it left the config since it was forwarded
            hear_requests(name, seen)
    # Nor one its caller has not read yet (a daemon started, or a backend added, past the
    # grace): failed unseen, a server that came back meanwhile was restarted, unread.
    unseen = {name for name in unread if name not in verdicts}
    # Nor one whose command its caller saw end within the grace on a steady clock: a wall
    # clock stepped forward since (NTP, a VM resumed, `date -s`) failed a restart seconds
    # old, and restarted a server still loading its model (``settle_fleet``'s in_grace).
    spared = {*commands_running, *arrived, *unseen, *in_grace}
    expired = expire_restarts(record, audit, now, verdicts, spared)
    notes = [
        *notes,
        *(stepped_note(name) for name in stepped),
        *(f"{t.name}: {t.reason}" for t in expired),
    ]
    restarts = remediate(
        record,
        config,
        now,
        mode=mode,
        audit=audit,
        commands_running=commands_running,
        in_grace=in_grace,
    )
    # Snapshots after remediation, so a backend restarted this cycle shows RESTARTING.
    reports = [
        replace(report, snapshot=record.ledger.snapshot(report.outcome.target.name, now))
        if report.outcome.target.name in in_ledger
        else report
        for report in reports
    ]
    heard = [
        # Under the name hear_commands gave it: a rename while it ran is the same server.
        _heard_note(heard_as(record, done.order), done)
        for done in commands
    ]
    report = CycleReport(
        now,
        tuple(reports),
        summarize(record.ledger),
        tuple(notes),
        (*heard, *(_restart_note(o, mode) for o in restarts)),
        tuple(traffic),
        tuple(expired),
    )
    return report, [outcome.order for outcome in restarts if outcome.order is not None]


def _verdict_time(verdict: Verdict) -> float | None:
    """When a verdict's evidence was last gathered: its answer, or its newest read."""
    times = [read.at for read in verdict.reads]
    if verdict.answer is not None:
        times.append(verdict.answer.at)
    return max(times, default=None)


def _audit_transition(
    audit: Audit | None, transition: Transition, now: float, evidence: dict[str, Any]
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


def _audit_change(audit: Audit | None, change: MembershipChange, now: float) -> None:
    """A config edit that changed the ledger's members is a ledger change like any other."""
    if audit is not None:
        audit.append(change.audit_record(now, ACTOR))


def _restart_note(outcome: RestartOutcome, mode: Mode) -> RestartNote:
    """A decision as the report shows it; an issued restart's command has not run yet."""
    return RestartNote(
        name=outcome.decision.name,
        action=str(outcome.decision.action),
        reason=outcome.decision.reason,
        ran=False,
        ok=None,
        dry_run=mode is Mode.DRY_RUN,
    )


def state_path_for(config: Config, explicit: str | None) -> Path:
    """``--state``, else the config's ``state``, else the default state directory."""
    if explicit is not None:
        return given_path(explicit)
    return Path(config.state) if config.state else default_path()


def audit_path_for(config: Config, state_path: Path) -> Path:
    """The audit log: as configured, else beside the state file; never the state itself
    (``--state`` may name the file the config's ``audit_log`` does)."""
    audit = Path(config.audit_log) if config.audit_log else state_path.with_name("audit.jsonl")
    check_audit_path(state_path, audit)
    return audit
