"""What each verdict means for a backend's record, and the fleet record that persists.

Pure. This is the one place that turns verdicts into ledger events, so the meaning of
"busy", "wedged" or "restarted" for a backend's health is written down once. The record
(ledger, what was last seen of each process, holds, restart histories) is what the state
file holds between runs; it is encoded and decoded here, stored by ``state``.
"""

from __future__ import annotations

import heapq
import json
import statistics
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

from llmhealth.classify import (
    ReadProblem,
    Verdict,
    VerdictKind,
    asleep_engines,
    restarted_between,
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
    RequestSuccess,
    State,
    Transition,
    UnplannedRestart,
    WedgeProven,
    is_finite_number,
)
from llmhealth.metrics import MAX_SLEEP_STATE, EngineSignals, Signals
from llmhealth.policy import Hold, RestartHistory
from llmhealth.rows import Table
from llmhealth.text import other_server, printable, same_server
from llmhealth.traffic import RequestOutcome
from llmhealth.window import LongestStep, longer

_Value = TypeVar("_Value")
_Kept = TypeVar("_Kept")

# What a backend condemned by real traffic is condemned by: the word restart_on matches.
TRAFFIC_CAUSE = "request_failures"
# The reads of a condemnation's proof the record keeps until the backend serves again (its
# restart is audited with them): a wedge of a server with 128 engines over a window of 61
# reads is 1.3 MB, and the record is one etcd request (1.5 MiB by default). The
# condemnation's own line in audit.jsonl has the reads whole (etcd's audit cuts it).
PROOF_BYTES = 32 * 1024
# And every proof's reads together: each kept within PROOF_BYTES, a hundred wedges of
# one-engine servers over 61 reads (14 KB each, kept whole) were a record over etcd's
# limit, and every save failed while they lasted (a RETIRED backend's proof for good).
PROOFS_BYTES = 256 * 1024
_ROW_MOST = 2048  # bytes, more than a read's or an engine's row of one takes
_ROW_LEAST = 16  # bytes, fewer than any such row takes

_FRESH_START = frozenset(
    {EventKind.NEW_PROCESS_UP, EventKind.UNPLANNED_RESTART, EventKind.READMITTED}
)
_PROBE_STYLE = frozenset({VerdictKind.STALLED, VerdictKind.UNRESPONSIVE, VerdictKind.DOWN})
# Only a refused or reset connection says the process may be gone. A read that timed out
# reached a live process (a busy machine can be slow): were it counted, the next good read
# would pass for "metrics again after refusal" and move a DEAD backend to STALE.
_UNREACHABLE = frozenset({ReadProblem.DOWN})


@dataclass(frozen=True, slots=True)
class Sighting:
    """What the last run saw of a backend's process: enough to tell a new one next time.

    ``longest_step`` is the longest step the backend's engines have been seen to take,
    kept across runs and restarts (the hardware does not change with the process), so a
    cron ``check`` widens the wedge window with what earlier runs learned.
    """

    at: float
    reachable: bool
    baseline: Signals | None = None
    longest_step: LongestStep | None = None

    def to_dict(self) -> dict[str, Any]:
        baseline = None
        if self.baseline is not None:
            baseline = {
                "process_start": self.baseline.process_start,
                # With the sleep state of an engine asleep on purpose: a server last read
                # asleep is asked nothing until a read shows it awake, in the next run too.
                "engines": {
                    e.engine: {**e.counters, "sleep_state": e.sleep_state}
                    if e.asleep
                    else e.counters
                    for e in self.baseline.engines
                },
            }
        document: dict[str, Any] = {
            "at": self.at,
            "reachable": self.reachable,
            "baseline": baseline,
        }
        if self.longest_step is not None:
            document["longest_step"] = self.longest_step.to_dict()
        return document

    @classmethod
    def from_dict(cls, data: object, where: str) -> Sighting:
        record = _table(data, where)
        at = _number(record.get("at"), f"{where}.at")
        reachable = record.get("reachable")
        if not isinstance(reachable, bool):
            raise ValueError(f"{where}.reachable: expected true or false")
        step = record.get("longest_step")
        longest_step = (
            None if step is None else LongestStep.from_dict(step, f"{where}.longest_step")
        )
        raw = record.get("baseline")
        if raw is None:
            return cls(at, reachable, longest_step=longest_step)
        baseline = _table(raw, f"{where}.baseline")
        start = baseline.get("process_start")
        engines = []
        engines_table = _table(baseline.get("engines"), f"{where}.baseline.engines")
        for engine, counters in engines_table.items():
            path = f"{where}.baseline.engines.{engine}"
            values = _table(counters, path)
            sleep_state = values.get("sleep_state")
            engines.append(
                EngineSignals(
                    engine=str(engine),
                    sleep_state=printable(sleep_state[:MAX_SLEEP_STATE])
                    if isinstance(sleep_state, str)
                    else None,
                    steps=_optional_number(values, "steps", path),
                    generation_tokens=_optional_number(values, "generation_tokens", path),
                    prompt_tokens=_optional_number(values, "prompt_tokens", path),
                    finished=_optional_number(values, "finished", path),
                    preemptions=_optional_number(values, "preemptions", path),
                )
            )
        process_start = None if start is None else _number(start, f"{where}.baseline.process_start")
        return cls(at, reachable, Signals(tuple(engines), process_start), longest_step)


def sighting_of(verdict: Verdict, at: float, previous: Sighting | None) -> Sighting:
    """The newest readable process seen in this verdict's reads, else the previous one's."""
    reachable = not verdict.reads or verdict.reads[-1].problem not in _UNREACHABLE
    step = longer(previous.longest_step if previous else None, verdict.longest_step)
    newest = _newest_signals(verdict)
    if newest is not None:
        return Sighting(at, reachable, newest, step)
    return Sighting(at, reachable, previous.baseline if previous else None, step)


def _rekey(kept: dict[str, _Value], old: str, new: str) -> None:
    if old in kept:
        kept[new] = kept.pop(old)


def events_for(
    verdict: Verdict,
    state: State,
    *,
    now: float,
    previous: Sighting | None,
    expected_model: str | None = None,
    readmit_on_answer: bool = True,
    restart_pending: bool = False,
    command_ended_at: float | None = None,
    restarted_from: ProcessSeen | None = None,
) -> list[Event]:
    """The ledger events one verdict stands for, given where the backend is now.

    A backend out of the serving set is moved only by proof about its process: a new one
    seen (new start time, or metrics again after refusal), re-admission by the tiny
    request, or a wedge; or, for a DEAD one, its own process proving itself again (the
    ledger decides whether that may count). Every event names the process its reads came
    from, so the ledger knows which one it condemned.
    ``readmit_on_answer=False`` is for a caller that re-admits by its own proof (a trainer
    after a completed weight sync): an answered tiny request then proves nothing more.
    """
    if not verdict.judged:
        # llmhealth could not examine it (its own failure, a read worker lost): nothing
        # about the backend. Taken as an answer after refused reads, it was "a new process
        # up" and moved a DEAD backend, still down, to STALE, where nothing restarts it.
        return []
    kind = verdict.kind
    answered = verdict.answer is not None and verdict.answer.ok
    proven = answered and (
        expected_model is None
        or (verdict.answer is not None and expected_model in verdict.answer.models_served)
    )
    readmit: list[Event] = [Readmitted(now=now)] if proven and readmit_on_answer else []
    live = kind not in (VerdictKind.DOWN, VerdictKind.UNRESPONSIVE)
    # Answering after a spell of unreachable reads means a new process, unless the reads
    # show the very process last sighted (a reset, a lost route): that one is judged as
    # the same process, under in-place recovery's limits, not waved through as new.
    came_back = (
        previous is not None
        and not previous.reachable
        and live
        and not _same_process(verdict, previous, counters_tell=state is State.DEAD)
    )
    process = process_seen(verdict)

    # Read since our restart's command exited 0 (``command_ended_at``, while RESTARTING),
    # a live process is its replacement unless it is the process the restart replaced
    # (``restarted_from``). Without start times (vLLM's multiprocess mode) a cron check
    # took a replacement whose counters had passed the wedged process's for that process,
    # and the grace failed a working server; reads from before the command ended, and
    # the sighting (read during the command, perhaps the replacement already), decide
    # nothing here.
    after_command = (
        command_ended_at is not None
        and live
        and any(read.at > command_ended_at and read.signals is not None for read in verdict.reads)
        and _not_the_replaced(verdict, restarted_from)
    )
    if state in (State.DEAD, State.RESTARTING):
        if (
            kind is VerdictKind.RESTARTED
            or came_back
            or after_command
            or _another_process(verdict, previous)
        ):
            return _replaced(verdict, now, process, readmit)
        if state is State.RESTARTING:
            return []
        if kind is VerdictKind.WEDGED:
            return [WedgeProven(now=now, evidence=_detail(verdict), process=process)]
        if verdict.healthy:
            if answered and not proven:
                return []  # it answers, but not for the model it must serve: no proof
            good = GoodVerdict(
                now=now,
                request_ok=answered,
                requests_finished=requests_finished(verdict, previous),
                restart_pending=restart_pending,
                process=process,
            )
            return [good]
        return _failures(verdict, now, process)
    if state is State.STALE:
        if kind is VerdictKind.WEDGED:
            return [WedgeProven(now=now, evidence=_detail(verdict), process=process)]
        if kind is VerdictKind.RESTARTED or _another_process(verdict, previous):
            # Replaced again before it was proven (systemd restarted the replacement):
            # the process to prove is the new one, whose finished requests then count;
            # compared with the old one, a working server was failed by the grace.
            return _replaced(verdict, now, process, readmit)
        if readmit:
            return readmit
        if verdict.healthy and requests_finished(verdict, previous):
            # Not re-admission: the ledger only notes that the replacement works.
            return [GoodVerdict(now=now, requests_finished=True, process=process)]
        if verdict.healthy and asleep_on_purpose(verdict):
            # Never asked while it sleeps: failed by the startup grace of our restart, a
            # server its trainer put to sleep was restarted.
            return [GoodVerdict(now=now, asleep=True, process=process)]
        return _failures(verdict, now, process)
    if state in (State.HEALTHY, State.SUSPECT):
        # A restart the window saw, or one only the sighting shows: watch settles a
        # backend's newest verdict, and a second read before the settle (a backend that
        # closes idle connections is read every 0.96 wait and settled every wait:
        # probe.KEEP_ALIVE_LEAD) judges the new process alone.
        if kind is VerdictKind.RESTARTED or _another_process(verdict, previous):
            return [UnplannedRestart(now=now, process=process), *readmit]
        if kind is VerdictKind.WEDGED:
            return [WedgeProven(now=now, evidence=_detail(verdict), process=process)]
        if verdict.healthy:
            return [GoodVerdict(now=now, request_ok=answered, process=process)]
        return _failures(verdict, now, process)
    return []  # RETIRED: only an operator reset moves it


def _not_the_replaced(verdict: Verdict, replaced: ProcessSeen | None) -> bool:
    """The verdict's process is not the one a restart replaced: another start time; with
    none to compare, counters not all exactly the replaced process's (a wedged process's
    do not move, and a command that returns before its process stops leaves it answering;
    a replacement that matches every one of them is not credible). Unknown: not it."""
    seen = process_seen(verdict)
    if replaced is None or seen is None:
        return True
    if seen.start is not None and replaced.start is not None:
        return seen.start != replaced.start
    shared = seen.counters.keys() & replaced.counters.keys()
    return not shared or any(seen.counters[name] != replaced.counters[name] for name in shared)


def _replaced(
    verdict: Verdict, now: float, process: ProcessSeen | None, readmit: list[Event]
) -> list[Event]:
    """A new process where an unproven one (or none) was: up, and re-admitted with it
    when its answer proves it."""
    up: list[Event] = [NewProcessUp(now=now, process=process), *readmit]
    if not readmit and verdict.healthy and _new_process_works(verdict):
        # First seen already working (a cron check every 5 min, a model that loads for
        # 12): noted now, or the same settle's startup grace failed the replacement as
        # never proven and restarted a busy, healthy server.
        up.append(GoodVerdict(now=now, requests_finished=True, process=process))
    return up


def process_seen(verdict: Verdict) -> ProcessSeen | None:
    """The process behind the verdict's newest readable read, as the ledger compares it.

    Counters are kept per engine, so an engine missing from one text does not look like
    a counter that went back.
    """
    signals = _newest_signals(verdict)
    return None if signals is None else process_of(signals)


def process_of(signals: Signals) -> ProcessSeen:
    """The process a /metrics read shows, as the ledger compares processes."""
    counters = {
        f"engine {engine.engine} {name}": value
        for engine in signals.engines
        for name, value in engine.counters.items()
    }
    return ProcessSeen(start=signals.process_start, counters=counters)


def _another_process(verdict: Verdict, previous: Sighting | None) -> bool:
    """The verdict's process is not the one last sighted (and written down).

    A read window can miss a restart on its own: it starts afresh after a failed read,
    and a daemon that takes over from another never saw the old process at all. The
    record's sighting still did; the comparison is classify's own.
    """
    newest = _newest_signals(verdict)
    if newest is None or previous is None or previous.baseline is None:
        return False
    return restarted_between(previous.baseline, newest)


def _same_process(verdict: Verdict, previous: Sighting, *, counters_tell: bool) -> bool:
    """The verdict's process is the one last sighted: the same start time, no counter gone
    back since.

    Without a start time (multiprocess mode) only a counter gone back proves another
    process; counters at or above the old ones may be either. ``counters_tell`` takes them
    for the same process: right for a condemned backend nothing of ours replaced (DEAD),
    which after one refused read otherwise came back as "new", past the in-place cap and a
    pending restart; wrong after our restart (a replacement of a process that wedged young
    shows counters as low as its own), which would then sit out its startup grace.
    """
    newest = _newest_signals(verdict)
    baseline = previous.baseline
    if newest is None or baseline is None:
        return False
    if newest.process_start is None or baseline.process_start is None:
        return counters_tell and not restarted_between(baseline, newest)
    return newest.process_start == baseline.process_start


def requests_finished(verdict: Verdict, previous: Sighting | None) -> bool:
    """vllm:request_success climbed: over this verdict's reads, or since the last sighting
    of the same process. For a backend with work this is the answered request it is never
    sent."""
    totals = [
        _finished_total(read.signals)
        for read in verdict.reads
        if read.signals is not None and read.signals.has_vllm
    ]
    # Never across a restart: counters of two processes are not compared.
    baseline = previous.baseline if previous is not None else None
    if baseline is not None and verdict.kind is not VerdictKind.RESTARTED:
        totals.insert(0, _finished_total(baseline))
    return _climbed(totals)


def _new_process_works(verdict: Verdict) -> bool:
    """vllm:request_success climbed between reads of the newest process alone (its start
    time on both): a window across a restart compares two processes' counters."""
    newest = _newest_signals(verdict)
    if newest is None or newest.process_start is None:
        return False
    totals = [
        _finished_total(read.signals)
        for read in verdict.reads
        if read.signals is not None
        and read.signals.has_vllm
        and read.signals.process_start == newest.process_start
    ]
    return _climbed(totals)


def _climbed(totals: Sequence[float | None]) -> bool:
    """The newest known finished-request total is above the oldest known one."""
    known = [total for total in totals if total is not None]
    return len(known) >= 2 and known[-1] > known[0]


def _newest_signals(verdict: Verdict) -> Signals | None:
    for read in reversed(verdict.reads):
        if read.signals is not None and read.signals.has_vllm:
            return read.signals
    return None


def _awake(signals: Signals) -> Signals:
    """These signals without the sleep state of any engine."""
    engines = tuple(replace(engine, sleep_state=None) for engine in signals.engines)
    return replace(signals, engines=engines)


def asleep_on_purpose(verdict: Verdict) -> bool:
    """The verdict's newest readable read shows an engine put to sleep on purpose."""
    return bool(asleep_engines(_newest_signals(verdict)))


def _finished_total(signals: Signals) -> float | None:
    values = [engine.finished for engine in signals.engines if engine.finished is not None]
    return sum(values) if values else None


def _failures(verdict: Verdict, now: float, process: ProcessSeen | None) -> list[Event]:
    reason, detail = str(verdict.kind), _detail(verdict)
    if verdict.kind in _PROBE_STYLE:
        return [ProbeFailure(now=now, reason=reason, detail=detail, process=process)]
    if verdict.answer is not None and not verdict.answer.ok:
        return [RequestFailure(now=now, reason=reason, detail=detail, process=process)]
    return []


def _detail(verdict: Verdict) -> str:
    """The evidence without its leading verdict name, which the ledger records apart."""
    return verdict.evidence.removeprefix(f"{verdict.kind}: ")


# Retired backends remembered after a config dropped them; past this the oldest are let go.
MAX_RETIRED_FORGOTTEN = 1024
# Withheld ones (DEAD, RESTARTING, STALE) keep their whole entry and sighting, about
# 800 bytes each where a retired one's name and time are 30: 1,024 of them added
# 0.8 MB to a record that must fit one etcd request (1.5 MiB by default).
MAX_WITHHELD_FORGOTTEN = 128
_RETIRED_BACK = "retired when it left the config; only a reset brings it back"


@dataclass(frozen=True, slots=True)
class MembershipChange:
    """A backend the config added, moved or dropped. A note for whoever runs the verb, and
    a line of the audit trail: a forgotten serving backend takes its history with it (one
    out of the serving set is remembered, by name and server: ``admit``, ``renames``),
    and only the trail can say so afterwards."""

    name: str
    event: str  # "forgotten", "renamed", "readdressed" or "added"
    state: State  # the backend's state when it changed (HEALTHY for an added one)
    note: str
    was: str | None = None  # a renamed backend's old name
    # A readdressed backend's new address names another server, not the same one written
    # another way (the scheme's own port, a host's case): what a reload counts as moved.
    elsewhere: bool = False

    def audit_record(self, now: float, actor: str) -> dict[str, Any]:
        return {
            "time": now,
            "actor": actor,
            "backend": self.name,
            "event": self.event,
            "from": str(self.state),
            "to": None if self.event == "forgotten" else str(self.state),
            "reason": self.note,
        }


@dataclass(slots=True)
class FleetRecord:
    """Everything that persists between runs, with the ledger at its centre."""

    ledger: Ledger
    sightings: dict[str, Sighting] = field(default_factory=dict)
    holds: dict[str, Hold] = field(default_factory=dict)
    restarts: dict[str, RestartHistory] = field(default_factory=dict)
    # The evidence that condemned each backend, kept until it serves again: a restart in a
    # later run must be audited with the proof, not with whatever that run happened to see.
    proofs: dict[str, dict[str, Any]] = field(default_factory=dict)
    # The last restart-skip reason written to the audit log per backend, so an unchanged
    # one is not written again every cycle.
    skips: dict[str, str] = field(default_factory=dict)
    # The failed real requests of each backend's current request-failure streak (at most
    # unhealthy_threshold), kept across settles: the proof a condemnation names.
    request_streaks: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    # When each backend last got a new process or was re-admitted: real-traffic outcomes
    # from before then are about what it was, and are not counted.
    fresh_since: dict[str, float] = field(default_factory=dict)
    # Backends forgotten while RETIRED, by name, with when: one that comes back into the
    # config (an edit undone, or a cluster member whose config lacked it leading for a
    # while) comes back RETIRED, an operator's decision kept, never HEALTHY and serving.
    retired_forgotten: dict[str, float] = field(default_factory=dict)
    # Where each of those was (absent from records written before it was kept): a new
    # name configured at that server is that backend renamed (``renames``).
    retired_urls: dict[str, str] = field(default_factory=dict)
    # Backends forgotten while out of the serving set and not retired (DEAD, RESTARTING,
    # STALE), by name: when ("at"), their ledger entry, sighting and restart history (the
    # newest MAX_WITHHELD_FORGOTTEN). Back in the config, one comes back as it left, never
    # HEALTHY and serving the wedge it was condemned for, nor STALE for ever where a DEAD
    # one would have been restarted.
    withheld_forgotten: dict[str, dict[str, Any]] = field(default_factory=dict)

    def reconcile(self, backends: Mapping[str, str], now: float) -> list[MembershipChange]:
        """Make the ledger's members the configured backends; return what changed.

        In this order, so that one edit may do all four: a backend the config calls by a
        new name at its address is renamed, backends no longer configured are forgotten
        (freeing their addresses), those whose address changed move, and new ones are
        added."""
        changes = []
        for name in [n for n, hold in self.holds.items() if not hold.active(now)]:
            del self.holds[name]  # nothing reads an ended hold; kept, they piled up
        changes.extend(self._rename_all(self.renames(backends), backends, now))
        for name in self.ledger.names:
            if name not in backends:
                changes.append(self._forget(name, now, "no longer configured"))
        moves = {
            name: backends[name]
            for name in self.ledger.names
            if self.ledger.url_of(name) != backends[name]
        }
        for name, url in moves.items():
            # A new address is not a new backend: forgotten and added again, a condemned
            # or retired one served at once. The sighting stays, so the first read there
            # shows a process other than the one last seen as the restart it is.
            state = self.ledger.state_of(name)
            note = f"{name}: moved from {self.ledger.url_of(name)} to {url}; stays {state}"
            elsewhere = other_server(url, self.ledger.url_of(name))
            changes.append(MembershipChange(name, "readdressed", state, note, elsewhere=elsewhere))
            # Requests drained after the move went to the old address; not when it is only
            # written another way (the scheme's own port, a host's case): the same server,
            # whose outcomes the router still records (``Router.configure``).
            if elsewhere:
                self.fresh_since[name] = now
                self._not_asleep(name)
        self.ledger.readdress(moves)
        for name, url in backends.items():
            if name not in self.ledger:
                changes.append(self.admit(name, url, now))
        return changes

    def renamed_for(
        self, name: str, backends: Mapping[str, str], now: float
    ) -> list[MembershipChange]:
        """The renames a check would make (``reconcile``) that give ``name``, a configured
        name, a record (the ledger lacks it, or holds it for another server), with those
        along its chain: its own record renamed on first (else it was dropped, its
        server's condemnation with it)."""
        pending = self.renames(backends)
        chain = {old: new for old, new in pending.items() if new == name}
        at = name
        while at in pending and at not in chain:
            chain[at] = pending[at]
            at = pending[at]
        return self._rename_all(chain, backends, now)

    def _rename_all(
        self, pending: dict[str, str], backends: Mapping[str, str], now: float
    ) -> list[MembershipChange]:
        changes = []
        while pending:
            # One whose own record is renamed on goes first (``renames`` has no cycle).
            old, new = next((o, n) for o, n in pending.items() if n not in pending)
            del pending[old]
            displaced = new in self.ledger
            if displaced:  # a serving backend moved onto a condemned server
                why = f"moved from {self.ledger.url_of(new)} onto {old}'s server, as {old}"
                changes.append(self._forget(new, now, why))
            changes.append(self.rename(old, new))
            if displaced or old in backends:
                # The requests drained under either name were partly another server's.
                self.fresh_since[new] = now
        return changes

    def _forget(self, name: str, now: float, why: str) -> MembershipChange:
        """Drop a backend's record; a RETIRED one is remembered by name and server, one
        otherwise out of the serving set with its entry (``admit``, ``renames``)."""
        state = self.ledger.state_of(name)
        if state is State.RETIRED:
            _remember(self.retired_forgotten, name, now, float, bound=MAX_RETIRED_FORGOTTEN)
            self.retired_urls[name] = self.ledger.url_of(name)
            for gone in self.retired_urls.keys() - self.retired_forgotten.keys():
                del self.retired_urls[gone]
        elif state not in SERVING:
            sighting = self.sightings.get(name)
            history = self.restarts.get(name)
            kept = {
                "at": now,
                "entry": self.ledger.entry(name),
                "sighting": None if sighting is None else sighting.to_dict(),
                # Its back-off (failed restarts in a row): "as it left", the
                # restart policy goes on with it, not from a fresh cooldown.
                "restarts": None if history is None else history.to_dict(),
                # What condemned it, for the restart it may still be owed: its
                # verdict and evidence, not its reads (the record must fit one
                # etcd request; the condemnation's audit record has them).
                "proof": _without_reads(self.proofs.get(name)),
            }
            _remember(
                self.withheld_forgotten,
                name,
                kept,
                lambda k: float(k["at"]),
                bound=MAX_WITHHELD_FORGOTTEN,
            )
        self.ledger.remove(name)
        self.sightings.pop(name, None)
        self.restarts.pop(name, None)
        self.proofs.pop(name, None)
        self.skips.pop(name, None)
        self.request_streaks.pop(name, None)
        self.fresh_since.pop(name, None)
        note = f"{name}: {why}; forgotten ({state})"
        if name in self.holds:
            # Kept until it ends or is released (by name; status lists it): dropped,
            # a hold set for a backend just added to the config was lost to a
            # daemon that had not reloaded yet, or to a cluster member whose config
            # lacked it, and a weight sync met a restart.
            note += f"; its hold stays ({self.holds[name].describe(now)})"
        return MembershipChange(name, "forgotten", state, note)

    def renames(self, backends: Mapping[str, str]) -> dict[str, str]:
        """Old name -> new name, one for one, for each record whose server the config now
        calls by another name, which takes the record over (``rename``).

        A record out of the serving set is its server's (the process condemned, the
        retirement): such a backend, or one forgotten-but-kept (``withheld_forgotten``,
        ``retired_forgotten``), is renamed when its server is configured under a name new
        to the ledger, or when its own name is not configured and a serving backend moved
        onto its server (that one's record is dropped, unless the name at its own server
        takes it over); not when both names stay (two backends that swap addresses keep
        their own). A serving backend is renamed only when the config left it and a name
        new to the ledger is configured at its server. Otherwise the ledger follows names.
        """
        ledger = self.ledger
        if len(backends) == len(ledger.names) and all(
            name in ledger and ledger.url_of(name) == url for name, url in backends.items()
        ):
            return {}  # nothing came, moved or went (each settle asks)
        configured = {same_server(url): name for name, url in backends.items()}
        kept = self.withheld_forgotten
        holders = {  # server -> the record there: the ledger's, else the newest kept
            same_server(self.retired_urls[name]): name
            for name in sorted(self.retired_urls, key=lambda n: self.retired_forgotten[n])
        }
        for name in sorted(kept, key=lambda n: float(kept[n]["at"])):
            holders[same_server(str(kept[name]["entry"]["url"]))] = name
        holders.update({same_server(ledger.url_of(name)): name for name in ledger.names})
        kept_at = {name: same_server(url) for name, url in self.retired_urls.items()}
        kept_at.update({name: same_server(str(k["entry"]["url"])) for name, k in kept.items()})
        pairs: dict[str, str] = {}
        onto: dict[str, str] = {}
        for server, old in holders.items():
            new = configured.get(server)
            if new is None or new == old:
                continue
            if old in ledger and ledger.state_of(old) in SERVING:
                if old not in backends and new not in ledger:
                    pairs[old] = new
            elif new not in ledger:
                # Not when the two swap (each keeps its own); a kept name configured here
                # while this one moves on elsewhere left its own record at its server.
                if old not in backends or configured.get(kept_at.get(new, "")) != old:
                    pairs[old] = new
            elif old not in backends or configured.get(same_server(ledger.url_of(new))) != old:
                # Moved onto a condemned server whose backend left it, or went elsewhere
                # (not a swap): that server's record, not a HEALTHY one serving its wedge.
                onto[old] = new
        while more := {  # until none is left: names shifted along a row of servers
            old: new
            for old, new in onto.items()
            if old not in pairs and (ledger.state_of(new) in SERVING or new in pairs)
        }:
            pairs.update(more)
        # Names turned round a ring of servers all out of the serving set: no order renames
        # them one by one, and each keeps its own (out of the serving set too).
        return {old: new for old, new in pairs.items() if not _ring(pairs, old)}

    def rename(self, old: str, new: str) -> MembershipChange:
        """A new name for the same server is no new backend: forgotten and added again, a
        condemned one served at once, a retired one too, its restart budget and cooldown
        were spent afresh, and the restart its running command stood for was lost.
        ``old`` may be forgotten but kept (``renames``): it comes back as ``new`` at its
        server, as it left."""
        if old in self.ledger:
            self.ledger.rename(old, new)
        else:
            self._take_back(old, new)
        _rekey(self.sightings, old, new)
        _rekey(self.restarts, old, new)
        _rekey(self.proofs, old, new)
        _rekey(self.skips, old, new)
        _rekey(self.request_streaks, old, new)
        _rekey(self.fresh_since, old, new)
        if old in self.holds and new not in self.holds:
            self.holds[new] = self.holds.pop(old)
        # One forgotten under the new name was another server: kept under it, this one
        # would come back as that one the next time it left the config and returned.
        # Its record follows its server (``renames``): kept aside under a name no config
        # gives ('|'), not dropped, or that server came in HEALTHY under the next name.
        here = self.ledger.url_of(new)
        since = self.retired_forgotten.pop(new, None)
        where = self.retired_urls.pop(new, None)
        if since is not None and where is not None and other_server(here, where):
            self.retired_forgotten[f"{new}|{where}"] = since
            self.retired_urls[f"{new}|{where}"] = where
        aside = self.withheld_forgotten.pop(new, None)
        if aside is not None and other_server(here, left := str(aside["entry"]["url"])):
            self.withheld_forgotten[f"{new}|{left}"] = aside
        state = self.ledger.state_of(new)
        note = f"{new}: renamed from {old} at {self.ledger.url_of(new)}; stays {state}"
        return MembershipChange(new, "renamed", state, note, was=old)

    def admit(self, name: str, url: str, now: float) -> MembershipChange:
        """Add a configured backend the record does not hold: HEALTHY; RETIRED when it was
        retired as it left the config (an operator's decision outlives an edit); as it
        left when it left out of the serving set otherwise (DEAD for what condemned it,
        its back-off kept: the evidence against it outlives an edit too). ValueError when
        its URL is another backend's."""
        if name in self.withheld_forgotten:
            left_at = self.withheld_forgotten[name]["entry"].get("url")
            state = self._take_back(name, name, url)
            if isinstance(left_at, str) and other_server(url, left_at):
                # Back at another server: moved, as a readdress is (``reconcile``). What
                # condemned it was the server it left, and restarted before its first
                # read here, a server never judged was restarted.
                self.fresh_since[name] = now
                self._not_asleep(name)
            note = f"{name}: back in the config at {url}; stays {state} as it left"
            return MembershipChange(name, "added", state, note)
        if name not in self.retired_forgotten:
            self.ledger.add(name, url, now)
            note = f"{name}: new backend at {url}; starts HEALTHY"
            held = self.holds.get(name)
            if held is not None and held.active(now):
                note += f"; {held.describe(now)} (a hold on its name)"
            return MembershipChange(name, "added", State.HEALTHY, note)
        self._take_back(name, name, url, now)
        note = f"{name}: back in the config at {url}; stays RETIRED ({_RETIRED_BACK})"
        return MembershipChange(name, "added", State.RETIRED, note)

    def _not_asleep(self, name: str) -> None:
        """A backend moved to another server: the sleep its sighting shows was the old
        server's. Kept, a server at the new address whose /metrics has no vLLM series
        was never asked, routed to nor re-admitted (a read showing it awake never came)."""
        seen = self.sightings.get(name)
        if seen is not None and seen.baseline is not None:
            self.sightings[name] = replace(seen, baseline=_awake(seen.baseline))

    def _take_back(
        self, kept: str, name: str, url: str | None = None, now: float | None = None
    ) -> State:
        """A backend forgotten-but-kept back in the ledger as ``name``, at ``url`` (else
        where it left), as it left: RETIRED (since ``now``, else since it left), or with
        its entry, sighting, back-off and proof. Remembered until then."""
        if kept in self.retired_forgotten:
            since = self.retired_forgotten.pop(kept)
            where = self.retired_urls.pop(kept, None) if url is None else url
            self.retired_urls.pop(kept, None)
            assert where is not None  # taken back elsewhere only by its server (renames)
            self.ledger.add(
                name, where, since if now is None else now, retired_because=_RETIRED_BACK
            )
            return State.RETIRED
        record = self.withheld_forgotten.pop(kept)
        entry = record["entry"]
        state = self.ledger.restore({**entry, "name": name}, entry["url"] if url is None else url)
        if record["sighting"] is not None:
            self.sightings[name] = Sighting.from_dict(record["sighting"], f"{name}.sighting")
        if record.get("restarts") is not None:
            self.restarts[name] = RestartHistory.from_dict(record["restarts"], f"{name}.restarts")
        if record.get("proof") is not None:
            self.proofs[name] = dict(record["proof"])
        return state

    def observe(
        self,
        name: str,
        verdict: Verdict,
        now: float,
        expected_model: str | None = None,
        *,
        restart_pending: bool = False,
    ) -> list[Transition]:
        """Feed one verdict to the ledger and remember the process it showed.

        ``restart_pending``: the restart policy will restart this backend if it is DEAD,
        so its own process may not prove its way back meanwhile.
        """
        previous = self.sightings.get(name)
        state = self.ledger.state_of(name)
        # A replacement our restart brought up, not yet proven: failing now, it is that
        # restart failing (its cooldown doubles), as when its startup grace runs out.
        replacing = state is State.STALE and self.ledger.restart_unproven(name, now)
        events = events_for(
            verdict,
            state,
            now=now,
            previous=previous,
            expected_model=expected_model,
            restart_pending=restart_pending,
            command_ended_at=self.ledger.restart_ran_at(name)
            if state is State.RESTARTING
            else None,
            restarted_from=self.ledger.restarted_from(name),
        )
        transitions = [self.ledger.apply(name, event) for event in events]
        if verdict.judged:  # else it saw nothing: the last judged read's process stands
            self.sightings[name] = sighting_of(verdict, now, previous)
        self.moved(name, transitions, now)
        if replacing and self.ledger.state_of(name) is State.DEAD:
            self.restart_failed(name)
        return transitions

    def moved(self, name: str, transitions: Sequence[Transition], now: float) -> None:
        """What the ledger's moves mean for the rest of the record, whoever made them (a
        verdict, or an operator's verb: a `readmit` left all of this behind, and the
        failed requests drained at the next settle condemned the backend again at once).

        After a new process or a re-admission, outcomes known before it are about what
        the backend was; a re-admission also proves a restart worked and ends the proof
        that condemned it; and once the ledger counts no request failure (an answered
        tiny request, a fresh start) the failed requests kept as the streak's proof go,
        or a later condemnation named the old process's requests.
        """
        applied = {t.kind for t in transitions if t.applied}
        if applied & _FRESH_START:
            self.fresh_since[name] = now
        if EventKind.READMITTED in applied:
            self.restart_worked(name)
            self.proofs.pop(name, None)
        streak_kept = name in self.request_streaks and name in self.ledger
        if streak_kept and self.ledger.snapshot(name, now).request_failures == 0:
            del self.request_streaks[name]

    def observe_requests(self, name: str, outcomes: Sequence[RequestOutcome]) -> list[Transition]:
        """Feed real-traffic outcomes to the ledger, each at its own time, in order.

        A condemnation keeps the failed requests of the streak as its proof, so the audit
        log and a later restart name the requests, not whatever a probe saw next.
        """
        transitions = []
        streak = self.request_streaks.setdefault(name, [])
        keep = self.ledger.policy.unhealthy_threshold
        since = self.fresh_since.get(name)
        for outcome in outcomes:
            if since is not None and outcome.at < since:
                # About the process before a restart or re-admission, drained only now:
                # the new one must not inherit it.
                continue
            event: Event
            if outcome.ok:
                event = RequestSuccess(now=outcome.at)
            else:
                event = RequestFailure(
                    now=outcome.at, reason=TRAFFIC_CAUSE, detail=outcome.describe(), traffic=True
                )
            transition = self.ledger.apply(name, event)
            transitions.append(transition)
            if not transition.applied:
                continue
            if not outcome.ok:
                streak[:] = [*streak, outcome.to_dict()][-keep:]
            # The ledger's own count decides when the streak is over (an answered request,
            # a new process), so this list never disagrees with it.
            if self.ledger.snapshot(name, outcome.at).request_failures == 0:
                streak.clear()
            # Only the move into DEAD condemns; a DEAD one's late failures replace no proof.
            if transition.to_state is State.DEAD and transition.from_state is not State.DEAD:
                self.proofs[name] = {
                    "verdict": TRAFFIC_CAUSE,
                    "evidence": transition.reason,
                    "requests": list(streak),
                }
        if not streak:
            self.request_streaks.pop(name, None)
        return transitions

    def pull_back(
        self, now: float, more: Mapping[str, Iterable[float]] | None = None
    ) -> dict[str, dict[float, float]]:
        """``Ledger.pull_back``, with the record's own times of each backend in the same
        order: a cooldown counted from an attempt stamped ahead of the clock lasted as
        long, a fresh start stamped ahead dropped every real-traffic outcome until then,
        and a last read or a death stamped ahead is still before a move made now (a moved
        backend is read where it went before it is restarted). ``more``: times the caller
        holds of each backend (real-traffic outcomes not fed yet), ordered with these.
        Per backend so changed, how its times were taken back."""
        # Only times after ``now`` are ever taken back (``pulled_back``): gathering every
        # backend's cost a settle of 10,000 backends 18 ms, twice, for a clock that had
        # not stepped.
        beside: dict[str, list[float]] = {}
        for name, times in (more or {}).items():
            if later := [t for t in times if t > now]:
                beside[name] = later
        for name, history in self.restarts.items():
            if history.last_attempt_at is not None and history.last_attempt_at > now:
                beside.setdefault(name, []).append(history.last_attempt_at)
        for name, since in self.fresh_since.items():
            if since > now:
                beside.setdefault(name, []).append(since)
        for name, sighting in self.sightings.items():
            if sighting.at > now:
                beside.setdefault(name, []).append(sighting.at)
        changed = self.ledger.pull_back(now, beside)
        for name, taken in changed.items():
            attempt = self.restarts.get(name)
            if attempt is not None and attempt.last_attempt_at in taken:
                self.restarts[name] = replace(
                    attempt, last_attempt_at=taken[attempt.last_attempt_at]
                )
            if name in self.fresh_since:
                self.fresh_since[name] = taken.get(self.fresh_since[name], self.fresh_since[name])
            seen = self.sightings.get(name)
            if seen is not None and seen.at in taken:
                self.sightings[name] = replace(seen, at=taken[seen.at])
        return changed

    def restart_worked(self, name: str) -> None:
        """Re-admission is the only proof a restart worked: its failures stop counting."""
        if name in self.restarts:
            self.restarts[name] = self.restarts[name].record_success()

    def restart_failed(self, name: str) -> None:
        self.restarts[name] = self.restarts.get(name, RestartHistory()).record_failure()

    def to_dict(self) -> dict[str, Any]:
        return {
            **self.to_document(),
            "ledger": self.ledger.to_dict(),
            "sightings": {name: s.to_dict() for name, s in sorted(self.sightings.items())},
        }

    def to_document(self) -> dict[str, Any]:
        """``to_dict()``, the ledger's entries made as they are written (rows.py): what a
        save writes."""
        return {
            "ledger": self.ledger.to_document(),
            # The floor its writer judged by, for a reader with no config (``saved_floor``).
            "min_healthy": self.ledger.policy.min_healthy,
            "sightings": Table(self.sightings, Sighting.to_dict),
            "holds": {name: hold.to_dict() for name, hold in sorted(self.holds.items())},
            "restarts": {name: h.to_dict() for name, h in sorted(self.restarts.items())},
            "proofs": dict(sorted(self.proofs.items())),
            "skips": dict(sorted(self.skips.items())),
            "request_streaks": dict(sorted(self.request_streaks.items())),
            "fresh_since": dict(sorted(self.fresh_since.items())),
            "retired_forgotten": dict(sorted(self.retired_forgotten.items())),
            "retired_urls": dict(sorted(self.retired_urls.items())),
            "withheld_forgotten": dict(sorted(self.withheld_forgotten.items())),
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], policy: LedgerPolicy) -> FleetRecord:
        """Decode a state document; any malformed part is a ValueError naming it."""
        ledger = Ledger.from_dict(data.get("ledger"), policy)
        sightings = {
            str(name): Sighting.from_dict(value, f"sightings.{name}")
            for name, value in _table(data.get("sightings", {}), "sightings").items()
        }
        holds = {
            str(name): Hold.from_dict(value, f"holds.{name}")
            for name, value in _table(data.get("holds", {}), "holds").items()
        }
        restarts = {
            str(name): RestartHistory.from_dict(value, f"restarts.{name}")
            for name, value in _table(data.get("restarts", {}), "restarts").items()
        }
        proofs = {
            str(name): dict(_table(value, f"proofs.{name}"))
            for name, value in _table(data.get("proofs", {}), "proofs").items()
        }
        skips = {
            str(name): str(reason)
            for name, reason in _table(data.get("skips", {}), "skips").items()
        }
        streaks = {}  # absent from files written before `route`
        for name, value in _table(data.get("request_streaks", {}), "request_streaks").items():
            if not isinstance(value, list) or not all(isinstance(r, Mapping) for r in value):
                raise ValueError(f"request_streaks.{name}: expected a list of tables")
            streaks[str(name)] = [dict(r) for r in value]
        fresh_since = {
            str(name): _number(at, f"fresh_since.{name}")
            for name, at in _table(data.get("fresh_since", {}), "fresh_since").items()
        }
        retired_forgotten = {  # absent from files written before it was kept
            str(name): _number(at, f"retired_forgotten.{name}")
            for name, at in _table(data.get("retired_forgotten", {}), "retired_forgotten").items()
        }
        retired_urls = {  # likewise
            str(name): _text(url, f"retired_urls.{name}")
            for name, url in _table(data.get("retired_urls", {}), "retired_urls").items()
            if str(name) in retired_forgotten
        }
        withheld_forgotten = {  # likewise
            str(name): _withheld(value, f"withheld_forgotten.{name}")
            for name, value in _table(
                data.get("withheld_forgotten", {}), "withheld_forgotten"
            ).items()
        }
        return cls(
            ledger,
            sightings,
            holds,
            restarts,
            proofs,
            skips,
            streaks,
            fresh_since,
            retired_forgotten,
            retired_urls,
            withheld_forgotten,
        )

    def with_policy(self, policy: LedgerPolicy) -> FleetRecord:
        """The same record under new thresholds (a config reload)."""
        return replace(self, ledger=Ledger.from_dict(self.ledger.to_dict(), policy))


def saved_floor(data: Mapping[str, Any]) -> int | None:
    """The ``min_healthy`` a record was saved with; None in a record from before it was.

    Only the config knows the floor, and ``status`` or a verb run without one would judge
    the fleet by the default (1): a fleet its daemon calls CRITICAL looked OK. Malformed,
    the record is as unreadable as for any other malformed part (a ValueError).
    """
    value = data.get("min_healthy")
    if value is None:
        return None
    if type(value) is not int or value < 0:
        raise ValueError(f"min_healthy: expected a whole number of 0 or more, got {value!r}")
    return value


def _withheld(value: object, where: str) -> dict[str, Any]:
    """A withheld backend as saved: malformed, a ValueError here, not at its return."""
    kept = _table(value, where)
    Ledger(LedgerPolicy()).restore(kept.get("entry"), "http://check.invalid")
    sighting = kept.get("sighting")
    if sighting is not None:
        Sighting.from_dict(sighting, f"{where}.sighting")
    history = kept.get("restarts")  # absent from a record written before it was kept
    if history is not None:
        RestartHistory.from_dict(history, f"{where}.restarts")
    proof = kept.get("proof")  # likewise
    if proof is not None:
        proof = {str(key): str(text) for key, text in _table(proof, f"{where}.proof").items()}
    return {
        "at": _number(kept.get("at"), f"{where}.at"),
        "entry": kept["entry"],
        "sighting": sighting,
        "restarts": history,
        "proof": proof,
    }


def _kept_proof(evidence: Mapping[str, Any], limit: int) -> dict[str, Any]:
    """A condemnation's evidence as the record keeps it: whole when within about ``limit``
    bytes, else with only as many of its newest reads as fit, and how many were left out
    (counting those an earlier trim left out)."""
    proof = dict(evidence)
    reads = proof.get("reads")
    if not isinstance(reads, list) or not reads:
        return proof
    # Few engines over few reads are far within it (an engine's row is about 500 bytes,
    # 1.3 KB at most with a 64-character label escaped): not encoded to find that out,
    # as 2,500 backends condemned in one settle would pay 24 µs each.
    rows = sum(_rows(read) for read in reads)
    if rows * _ROW_MOST <= limit:
        return proof
    # Nor encoded whole when it cannot fit: a hundred-odd bytes each is what 2,500
    # proofs kept in one settle get of PROOFS_BYTES.
    if rows * _ROW_LEAST <= limit and len(json.dumps(proof, default=str)) <= limit:
        return proof
    before = proof.get("reads_left_out")
    before = before if isinstance(before, int) and not isinstance(before, bool) else 0
    bare = {**proof, "reads": [], "reads_left_out": before + len(reads)}
    left = limit - len(json.dumps(bare, default=str))
    kept = 0
    for read in reversed(reads):
        left -= len(json.dumps(read, default=str)) + 2
        if left < 0:
            break
        kept += 1
    proof["reads"] = reads[len(reads) - kept :]
    proof["reads_left_out"] = before + len(reads) - kept
    return proof


def kept_proofs(proofs: dict[str, dict[str, Any]], total: int = PROOFS_BYTES) -> None:
    """Every proof's reads within its share of ``total`` (and of ``PROOF_BYTES``), in
    place: the record keeps them all until their backends serve again."""
    holding = [name for name, proof in proofs.items() if proof.get("reads")]
    if holding:
        share = min(PROOF_BYTES, total // len(holding))
        for name in holding:
            proofs[name] = _kept_proof(proofs[name], share)


def _rows(read: object) -> int:
    """A read's rows in a proof: its own and its engines'."""
    engines = read.get("engines") if isinstance(read, dict) else None
    return 1 + (len(engines) if isinstance(engines, dict | list) else 0)


def _without_reads(proof: Mapping[str, Any] | None) -> dict[str, str] | None:
    """A proof's verdict and evidence, as text."""
    if proof is None:
        return None
    return {key: str(proof[key]) for key in ("verdict", "evidence") if key in proof}


def _remember(
    forgotten: dict[str, _Kept],
    name: str,
    kept: _Kept,
    at: Callable[[_Kept], float],
    *,
    bound: int,
) -> None:
    """A backend forgotten in a state it must keep when it comes back; the oldest (by
    ``at``) of more than ``bound`` go first."""
    forgotten[name] = kept
    # All the oldest at once: one at a time, each a walk of the whole, a record holding
    # far more than ``bound`` (a state edited or merged by hand: 300,000 in its 64 MiB)
    # held the state lock for hours, a daemon's settle with it.
    excess = len(forgotten) - bound
    if excess > 0:
        for each in heapq.nsmallest(excess, forgotten, key=lambda each: at(forgotten[each])):
            del forgotten[each]


def _table(value: object, where: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise ValueError(f"{where}: expected a table")
    return value


def _ring(pairs: Mapping[str, str], start: str) -> bool:
    """Whether following ``pairs`` (one to one) from ``start`` comes back to it."""
    at = pairs.get(start)
    for _ in range(len(pairs)):
        if at is None or at == start:
            break
        at = pairs.get(at)
    return at == start


def _text(value: object, where: str) -> str:
    if not isinstance(value, str):
        raise ValueError(f"{where}: expected a string, got {value!r}")
    return value


def _number(value: object, where: str) -> float:
    if not is_finite_number(value):
        raise ValueError(f"{where}: expected a finite number, got {value!r}")
    assert isinstance(value, int | float)  # narrowed by is_finite_number, for mypy
    return float(value)


def _optional_number(values: Mapping[str, Any], key: str, where: str) -> float | None:
    return _number(values[key], f"{where}.{key}") if key in values else None


@dataclass(slots=True)
class StallWatch:
    """Is the fleet as a whole making progress? A question no per-backend check answers.

    It alerts when work is waiting somewhere and no backend has finished a request for
    ``stall_timeout``; it never restarts anything, because the cause may be outside every
    backend (a shared store, the network, a client that stopped reading).
    """

    started_at: float
    last_finished_at: float | None = None
    work_pending: bool = False
    _finished: dict[str, float] = field(default_factory=dict)

    def observe(self, signals_by_backend: Mapping[str, Signals], now: float) -> None:
        """Feed each backend's newest readable signals of this cycle.

        A time kept ahead of ``now`` is taken as ``now``: the wall clock stepped back (NTP
        correcting a clock that ran ahead, a VM resumed from a snapshot), and counted from
        it, a fleet that stalled went unreported for as long as the step."""
        self.started_at = min(self.started_at, now)
        if self.last_finished_at is not None:
            self.last_finished_at = min(self.last_finished_at, now)
        pending = False
        for name, signals in signals_by_backend.items():
            finished = sum(e.finished or 0.0 for e in signals.engines)
            previous = self._finished.get(name)
            # A lower count is a new process, not progress; it only resets the baseline.
            if previous is not None and finished > previous:
                self.last_finished_at = now
            self._finished[name] = finished
            pending = pending or any((e.work or 0) > 0 for e in signals.engines if not e.asleep)
        self.work_pending = pending

    def forget_all_but(self, names: Collection[str]) -> None:
        """Forget the backends no longer watched: one named again is first seen again."""
        for name in [name for name in self._finished if name not in names]:
            del self._finished[name]

    def seconds_since_finished(self, now: float) -> float:
        """Since the last finished request seen, or since watching began if none was."""
        since = self.last_finished_at if self.last_finished_at is not None else self.started_at
        return max(0.0, now - since)

    def stalled(self, now: float, stall_timeout: float) -> bool:
        return self.work_pending and self.seconds_since_finished(now) >= stall_timeout


# Below this many reads per wait for the median target, `watch` says its reads fall
# behind: a wedge is then proven that much later than two waits after it began.
READS_KEEP_UP = 0.9
# How far a target's average gap between examinations moves toward a new gap one wait
# long (a longer gap moves it further, in proportion): an average over about the last ten
# waits. A stretch that delays most reads in flight at once (the median gap went to
# 6.5 s for one cycle at 3,000 backends here, then back) must not read as a fleet
# behind; gaps that stay long (13 s against a 5 s wait) cross the mark at their first.
GAP_SMOOTHING = 0.1


def smoothed_gap(average: float | None, gap: float, wait: float) -> float:
    """A target's average time between examinations, after one more gap (from the wait,
    the gap its probing task intends, before the first). Weighted by the time the gap
    spans, so the average covers the same stretch of time however often the target is
    read, and a fleet read every 13 s reaches its figure as soon as one read every 5 s."""
    start = wait if average is None else average
    return start + min(1.0, GAP_SMOOTHING * gap / wait) * (gap - start)


def reads_per_wait(gaps: Iterable[tuple[float | None, float]], wait: float) -> float | None:
    """How often the median target is examined, per wait: 1.0 while each is read once per
    wait, as its probing task intends; lower when the loop or the read workers have more
    to read than their cores hold, which slows every target they read alike.

    ``gaps`` has, for each target examined so far, its average time between examinations
    (``smoothed_gap``; None after its first) and the time since its last one, which counts
    once it is the longer: a target whose examination is overdue is late now. A target
    counts as the wait over the longer of the two, at most 1. Per target from its own
    examinations, not reads counted between two settles, so a small fleet whose reads
    land on a settle's edge does not swing between 0 and 2. The median, not the mean: a
    few targets slow to answer (a read timing out, a tiny request unanswered) are their
    own verdicts' news, and must not make a fleet read on time look behind.
    """
    if wait <= 0:
        return None
    paces = [wait / max(wait, since, wait if last is None else last) for last, since in gaps]
    return statistics.median(paces) if paces else None
