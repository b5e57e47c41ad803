"""The ledger: what llmhealth believes about each backend, and the only rules that change it.

A pure state machine after NeMo-RL's fleet-health ledger. Verdicts and actions arrive as
events that carry the wall time ``now``; nothing here reads a clock, the network or a file.
Everything that decides a transition lives in the table and the rules directly below it.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import ClassVar, Final, TypeAlias

from llmhealth.rows import Rows
from llmhealth.text import refuse_user_info, same_server


class State(StrEnum):
    """Lifecycle of one backend. Only HEALTHY and SUSPECT are handed traffic."""

    HEALTHY = "healthy"  # serving; nothing doubted
    SUSPECT = "suspect"  # serving but doubted: one blip must not cost capacity
    DEAD = "dead"  # condemned and out of the serving set; a restart candidate
    RESTARTING = "restarting"  # a restart was issued; waiting for the new process
    STALE = "stale"  # a new process is up but unproven; only re-admission returns it
    RETIRED = "retired"  # out for good; only an operator reset brings it back


class EventKind(StrEnum):
    """What happened to a backend. Each kind has one event class below."""

    GOOD_VERDICT = "good_verdict"  # busy, idle or up
    PROBE_FAILURE = "probe_failure"  # stalled, unresponsive or down: doubt, not proof
    REQUEST_FAILURE = "request_failure"  # unanswered, or a failure seen on real traffic
    REQUEST_SUCCESS = "request_success"  # a real request was answered
    PROCESS_GONE = "process_gone"  # proof the process is gone
    WEDGE_PROVEN = "wedge_proven"  # proof the engine holds work and makes no progress
    RESTART_ISSUED = "restart_issued"  # the shell is about to run the restart command
    RESTART_FAILED = "restart_failed"  # the restart did not bring up a process
    RESTART_RAN = "restart_ran"  # its command exited 0: the startup grace counts from now
    STARTUP_EXPIRED = "startup_expired"  # startup_grace since the restart ran out unproven
    NEW_PROCESS_UP = "new_process_up"  # a replacement process answers
    READMITTED = "readmitted"  # the replacement proved itself (tiny request, or an operator)
    UNPLANNED_RESTART = "unplanned_restart"  # a serving backend's process changed by itself
    RETIRE = "retire"  # give up on the backend
    OPERATOR_RESET = "operator_reset"  # an operator takes it out of RETIRED
    CONDEMNED = "condemned"  # a caller's judgement on independent evidence, e.g. a process
    # that answers probes yet did not take part in a collective
    WEIGHTS_PARTIAL = "weights_partial"  # an aborted weight sync left mixed weights behind
    WEIGHTS_STAMPED = "weights_stamped"  # a completed weight sync reached a serving backend


class Rule(StrEnum):
    """Table outcomes that depend on counters; each names one function below the table."""

    # SUSPECT -> HEALTHY at healthy_threshold good verdicts in a row with no request
    # failure outstanding; otherwise the state stays as it is.
    PROMOTE_WHEN_PROVEN = "promote_when_proven"
    # DEAD once the streak of this failure's kind reaches unhealthy_threshold; else SUSPECT.
    CONDEMN_AT_THRESHOLD = "condemn_at_threshold"
    # RESTARTING while attempts in the budget window are below restart_budget; else RETIRED.
    SPEND_RESTART = "spend_restart"
    # DEAD -> STALE when the process that was condemned, with no restart pending, shows
    # healthy_threshold good verdicts in a row proven by requests, doubled for each such
    # recovery in the budget window (recovery in place); refused when the policy is off,
    # the process is another one or unknown (one never known, then or now, is proven by
    # answered requests alone), a restart is pending, no request proves it, or
    # max_in_place_recoveries is reached.
    RECOVER_IN_PLACE = "recover_in_place"
    # A failure in DEAD: the good streak towards recovery in place starts again.
    BREAK_RECOVERY = "break_recovery"
    # DEAD once startup_grace has passed since the last restart and the backend has been
    # neither re-admitted nor seen working since; else the state stays (a STALE spell no
    # restart began, after an unplanned restart or a reset, has no grace to run out).
    FAIL_OVERDUE_RESTART = "fail_overdue_restart"
    # STALE stays STALE: requests finishing on its own process are noted (last_ok_at), so
    # a replacement that works is neither failed by its startup grace nor restarted again;
    # anything less is ignored, as a good probe is outside the serving set.
    NOTE_WORKING = "note_working"
    # DEAD stays DEAD when the caller says the process is gone or condemns it, the reason
    # that condemned it first kept; from then on only a new process comes back, as if the
    # word had condemned it. Said again, it is ignored: nothing more to record.
    KEEP_CALLERS_WORD = "keep_callers_word"
    # STALE -> HEALTHY, streaks cleared; but SUSPECT, streaks kept, when it was SUSPECT as
    # a weight sync left its weights partial: re-admission vouches for the weights only.
    READMIT = "readmit"


# The whole state machine. A (state, kind) pair that is missing means the event does not
# apply in that state: it changes nothing and is reported as ignored, with the reason from
# IGNORED_BECAUSE; a rule may refuse an event the same way, saying why. The two rules that
# carry the most weight show as absences: from outside the serving set only STALE +
# READMITTED leads in, and RETIRED accepts nothing but a reset.
TRANSITIONS: Final[Mapping[State, Mapping[EventKind, State | Rule]]] = {
    State.HEALTHY: {
        EventKind.GOOD_VERDICT: Rule.PROMOTE_WHEN_PROVEN,
        EventKind.REQUEST_SUCCESS: Rule.PROMOTE_WHEN_PROVEN,
        EventKind.PROBE_FAILURE: Rule.CONDEMN_AT_THRESHOLD,
        EventKind.REQUEST_FAILURE: Rule.CONDEMN_AT_THRESHOLD,
        EventKind.PROCESS_GONE: State.DEAD,
        EventKind.WEDGE_PROVEN: State.DEAD,
        EventKind.UNPLANNED_RESTART: State.STALE,
        EventKind.RETIRE: State.RETIRED,
        EventKind.CONDEMNED: State.DEAD,
        EventKind.WEIGHTS_PARTIAL: State.STALE,
        # A stamp, not a transition: nothing but the weight version changes, and above all
        # not the request-failure streak, the one counter that condemns an engine that
        # still answers every probe.
        EventKind.WEIGHTS_STAMPED: State.HEALTHY,
    },
    State.SUSPECT: {
        EventKind.GOOD_VERDICT: Rule.PROMOTE_WHEN_PROVEN,
        EventKind.REQUEST_SUCCESS: Rule.PROMOTE_WHEN_PROVEN,
        EventKind.PROBE_FAILURE: Rule.CONDEMN_AT_THRESHOLD,
        EventKind.REQUEST_FAILURE: Rule.CONDEMN_AT_THRESHOLD,
        EventKind.PROCESS_GONE: State.DEAD,
        EventKind.WEDGE_PROVEN: State.DEAD,
        EventKind.UNPLANNED_RESTART: State.STALE,
        EventKind.RETIRE: State.RETIRED,
        EventKind.CONDEMNED: State.DEAD,
        # STALE remembers SUSPECT, so suspected() still names it after the sync broke.
        EventKind.WEIGHTS_PARTIAL: State.STALE,
        EventKind.WEIGHTS_STAMPED: State.SUSPECT,
    },
    State.DEAD: {
        EventKind.RESTART_ISSUED: Rule.SPEND_RESTART,
        # Replaced by someone else (systemd, docker, an operator): unproven, so STALE.
        EventKind.NEW_PROCESS_UP: State.STALE,
        # The condemned process itself comes back: doubt, not proof, condemned it. With
        # policy.recover_in_place off (the library's default) these are ignored, as in
        # seed 000; on, they lead to STALE at most, never straight to serving.
        EventKind.GOOD_VERDICT: Rule.RECOVER_IN_PLACE,
        EventKind.REQUEST_SUCCESS: Rule.RECOVER_IN_PLACE,
        EventKind.PROBE_FAILURE: Rule.BREAK_RECOVERY,
        EventKind.REQUEST_FAILURE: Rule.BREAK_RECOVERY,
        EventKind.WEDGE_PROVEN: Rule.BREAK_RECOVERY,
        # Condemned by doubt, the process may come back in place; condemned by its caller
        # (an actor that died, a participant that hung a sync), never. Doubt first and the
        # caller's word after must end as the word alone does.
        EventKind.PROCESS_GONE: Rule.KEEP_CALLERS_WORD,
        EventKind.CONDEMNED: Rule.KEEP_CALLERS_WORD,
        EventKind.RETIRE: State.RETIRED,
    },
    State.RESTARTING: {
        EventKind.RESTART_FAILED: State.DEAD,
        EventKind.RESTART_RAN: State.RESTARTING,
        EventKind.STARTUP_EXPIRED: Rule.FAIL_OVERDUE_RESTART,
        EventKind.NEW_PROCESS_UP: State.STALE,
        EventKind.RETIRE: State.RETIRED,
    },
    State.STALE: {
        # Failures are noted (last error, streaks) for the operator but never condemn: a
        # replacement still loading its model fails probes for minutes, and counting those
        # to DEAD would hand a normal start-up to the restart policy. While its weights
        # are in doubt (a partial sync) the streaks are left as they were: they go back
        # to serving with it.
        EventKind.PROBE_FAILURE: State.STALE,
        EventKind.REQUEST_FAILURE: State.STALE,
        # The new process is alive, so proof of death or of a wedge still condemns it.
        EventKind.PROCESS_GONE: State.DEAD,
        EventKind.WEDGE_PROVEN: State.DEAD,
        # DEAD, not STALE: a STALE process still joins the next weight sync, which is what
        # a silent participant just broke.
        EventKind.CONDEMNED: State.DEAD,
        EventKind.READMITTED: Rule.READMIT,
        # Replaced again before it was proven (systemd restarted the replacement): the
        # process it must prove is the new one, whose requests finishing then count.
        EventKind.NEW_PROCESS_UP: State.STALE,
        # The command ended after its process showed up (it waits for readiness).
        EventKind.RESTART_RAN: State.STALE,
        # Busy with work from elsewhere, a replacement is never sent the tiny request: its
        # finishing requests show the restart worked, though it does not serve yet.
        EventKind.GOOD_VERDICT: Rule.NOTE_WORKING,
        # A replacement that never proves itself (it died again, or never answers) would
        # otherwise stay STALE for ever: out of serving, and never restarted again.
        EventKind.STARTUP_EXPIRED: Rule.FAIL_OVERDUE_RESTART,
        EventKind.RETIRE: State.RETIRED,
    },
    State.RETIRED: {
        # A reset backend still has to prove itself: STALE, not HEALTHY.
        EventKind.OPERATOR_RESET: State.STALE,
    },
}

# Where each rule may lead, so the table says it whole: that only STALE + READMITTED
# enters the serving set from outside it is read off these two tables (and ``apply``
# holds every rule to its row).
RULE_LEADS_TO: Final[Mapping[Rule, frozenset[State]]] = {
    Rule.PROMOTE_WHEN_PROVEN: frozenset({State.HEALTHY, State.SUSPECT}),
    Rule.CONDEMN_AT_THRESHOLD: frozenset({State.SUSPECT, State.DEAD}),
    Rule.SPEND_RESTART: frozenset({State.RESTARTING, State.RETIRED}),
    Rule.RECOVER_IN_PLACE: frozenset({State.DEAD, State.STALE}),
    Rule.BREAK_RECOVERY: frozenset({State.DEAD}),
    Rule.FAIL_OVERDUE_RESTART: frozenset({State.RESTARTING, State.STALE, State.DEAD}),
    Rule.NOTE_WORKING: frozenset({State.STALE}),
    Rule.KEEP_CALLERS_WORD: frozenset({State.DEAD}),
    Rule.READMIT: frozenset({State.HEALTHY, State.SUSPECT}),
}

IGNORED_BECAUSE: Final[Mapping[EventKind, str]] = {
    EventKind.GOOD_VERDICT: (
        "probes never resurrect; a backend out of the serving set returns only through "
        "STALE and re-admission"
    ),
    EventKind.PROBE_FAILURE: "it is already out of the serving set",
    EventKind.REQUEST_FAILURE: "it is already out of the serving set",
    EventKind.REQUEST_SUCCESS: "it takes no traffic; only re-admission returns it to serving",
    EventKind.PROCESS_GONE: "it is already absent",
    EventKind.WEDGE_PROVEN: "it is already absent",
    EventKind.RESTART_ISSUED: "a restart is issued only for a DEAD backend",
    EventKind.RESTART_FAILED: "only a RESTARTING backend can fail to restart",
    EventKind.RESTART_RAN: (
        "only a restart not yet proven (RESTARTING, or STALE since it) waits on its command"
    ),
    EventKind.STARTUP_EXPIRED: (
        "only a restart not yet proven (RESTARTING, or STALE since it) can run out of grace"
    ),
    EventKind.NEW_PROCESS_UP: (
        "a new process is expected only after a restart, in place of a DEAD one or of an "
        "unproven one (STALE); a serving backend that restarted by itself is an "
        "unplanned_restart"
    ),
    EventKind.READMITTED: "only a STALE backend can be re-admitted",
    EventKind.UNPLANNED_RESTART: (
        "only a serving backend can restart unplanned; the replacement of a DEAD or "
        "RESTARTING one is a new_process_up"
    ),
    EventKind.RETIRE: "it is already retired",
    EventKind.OPERATOR_RESET: "a reset only takes a backend out of RETIRED",
    EventKind.CONDEMNED: "it is already absent",
    EventKind.WEIGHTS_PARTIAL: (
        "only a serving backend's weights can be left partial; an absent one received "
        "nothing, and a STALE one is already withheld until re-admission"
    ),
    EventKind.WEIGHTS_STAMPED: (
        "only a serving backend is stamped; an absent one received no weights, and a STALE "
        "one returns with its weight version through re-admission"
    ),
}

RETIRED_IS_TERMINAL: Final = "RETIRED is terminal; only an operator reset leaves it"

SERVING: Final = frozenset({State.HEALTHY, State.SUSPECT})
# The backends whose process is gone or given up on. Deliberately not the complement of
# SERVING: a STALE backend is withheld from traffic, yet its process is alive.
ABSENT: Final = frozenset({State.DEAD, State.RESTARTING, State.RETIRED})
# The restart planner's and the remediator's one filter: only a condemned backend is a
# candidate for a restart, so both ask the ledger for the same set.
CONDEMNED: Final = frozenset({State.DEAD})

SCHEMA: Final = 1  # version of the to_dict() layout; bump on any incompatible change


class LedgerError(Exception):
    """Base of the ledger's own errors: a caller bug or bad data, or (NoServingBackend)
    a fleet with nothing to hand traffic to."""


# Named for the condition, like NoServingBackend, which callers already know by that name.
class UnknownBackend(LedgerError, LookupError):  # noqa: N818
    """No backend of that name is in the ledger."""


class NoServingBackend(LedgerError):  # noqa: N818
    """Nothing may be handed traffic: a selector's pick found no serving backend."""


@dataclass(frozen=True, slots=True)
class LedgerPolicy:
    """Thresholds the transitions use; times are seconds."""

    unhealthy_threshold: int = 3
    healthy_threshold: int = 2
    min_healthy: int = 1
    restart_budget: int = 5
    restart_budget_window: float = 86400.0
    startup_grace: float = 900.0
    # Off by default, as in seed 000: a trainer's supervisor restarts every DEAD shard.
    # The CLI turns it on (config policy.recover_in_place).
    recover_in_place: bool = False
    # In-place recoveries allowed within restart_budget_window; the next one is refused
    # and the backend stays DEAD for an operator.
    max_in_place_recoveries: int = 3

    def __post_init__(self) -> None:
        # A threshold of 0 would condemn or promote on no evidence at all, so it is refused
        # here rather than silently treated as 1.
        for name, least in (
            ("unhealthy_threshold", 1),
            ("healthy_threshold", 1),
            ("restart_budget", 1),
            ("min_healthy", 0),
            ("max_in_place_recoveries", 0),
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"{name} must be an integer, got {value!r}")
            if value < least:
                raise ValueError(f"{name} must be at least {least}, got {value}")
        for name in ("restart_budget_window", "startup_grace"):
            value = getattr(self, name)
            if not is_finite_number(value) or value <= 0:
                raise ValueError(f"{name} must be a positive number of seconds, got {value!r}")
        if not isinstance(self.recover_in_place, bool):
            flag = self.recover_in_place
            raise ValueError(f"recover_in_place must be true or false, got {flag!r}")


@dataclass(frozen=True, slots=True)
class ProcessSeen:
    """Which process a verdict's reads came from, as far as its /metrics text shows.

    ``counters`` are the vLLM counters summed over engines (steps, tokens, finished
    requests...): within one process they never go down. The ledger keeps the one it
    condemned, so that only that same process may come back in place.
    """

    start: float | None  # process_start_time_seconds; absent in Prometheus multiprocess mode
    counters: Mapping[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.start is not None and not is_finite_number(self.start):
            raise ValueError(f"ProcessSeen.start must be a finite number, got {self.start!r}")
        for name, value in self.counters.items():
            if not isinstance(name, str) or not is_finite_number(value):
                raise ValueError(f"ProcessSeen.counters: bad entry {name!r}: {value!r}")

    def differs_from(self, condemned: ProcessSeen) -> str | None:
        """Why this cannot be shown to be the ``condemned`` process; None when it is."""
        if None not in (self.start, condemned.start) and self.start != condemned.start:
            return f"start time {condemned.start:.2f} -> {self.start:.2f}: another process"
        went_back = sorted(
            name
            for name, value in self.counters.items()
            if name in condemned.counters and value < condemned.counters[name]
        )
        if went_back:
            return f"{', '.join(went_back)} went back: another process"
        if (self.start is None or condemned.start is None) and not (
            self.counters.keys() & condemned.counters.keys()
        ):
            return "neither a start time nor a counter to compare: the process is unknown"
        return None


# Events. Fields are keyword-only so a call site reads as the record it makes, e.g.
# ProbeFailure(now=t, reason="down", detail="connection refused").


@dataclass(frozen=True, kw_only=True)
class _EventBase:
    kind: ClassVar[EventKind]
    now: float  # wall seconds at which it happened

    def __post_init__(self) -> None:
        if not is_finite_number(self.now):
            raise ValueError(f"{type(self).__name__}.now must be a finite number, got {self.now!r}")


@dataclass(frozen=True, kw_only=True)
class _SeenEventBase(_EventBase):
    # The process the evidence came from, when a /metrics read showed it. The ledger keeps
    # the last one seen, and while DEAD the one it condemned.
    process: ProcessSeen | None = None


@dataclass(frozen=True, kw_only=True)
class GoodVerdict(_SeenEventBase):
    """busy, idle or up. ``request_ok``: a tiny request was answered, which also clears the
    request-failure streak; a verdict from reads alone does not.

    Two facts matter only to a DEAD backend: ``requests_finished``, the reads show
    requests finishing (vllm:request_success climbing), which for a backend with work
    stands in for the tiny request it is never sent (it proves the process answers, but
    clears no request-failure streak); ``restart_pending``, the restart policy will
    restart this backend, so it is the restart that decides, not this process.
    """

    kind: ClassVar[EventKind] = EventKind.GOOD_VERDICT
    request_ok: bool = False
    requests_finished: bool = False
    restart_pending: bool = False
    # A STALE process shows an engine put to sleep on purpose: it loaded, and its owner
    # rests it. Never asked the tiny request (a completion crashed a sleeping vLLM), it is
    # noted working as one whose requests finish is, so no startup grace fails it.
    asleep: bool = False


@dataclass(frozen=True, kw_only=True)
class ProbeFailure(_SeenEventBase):
    """stalled, unresponsive or down. ``reason`` is the verdict name: it becomes
    ``condemned_by`` if this failure condemns the backend, so restart_on can match it."""

    kind: ClassVar[EventKind] = EventKind.PROBE_FAILURE
    reason: str
    detail: str = ""


@dataclass(frozen=True, kw_only=True)
class RequestFailure(_SeenEventBase):
    """unanswered, or a failure reported from real traffic; ``reason`` as for ProbeFailure."""

    kind: ClassVar[EventKind] = EventKind.REQUEST_FAILURE
    reason: str
    detail: str = ""
    # Seen on real traffic (the router, a trainer's report_failure): in service, only a
    # real request answered clears it, never the tiny one, or a server that answers one
    # token and fails every real request went SUSPECT and back at every settle for ever.
    traffic: bool = False


@dataclass(frozen=True, kw_only=True)
class RequestSuccess(_SeenEventBase):
    """A real request was answered. An answered request (this, or a GoodVerdict with
    request_ok) is the only evidence that clears the request-failure streak.
    ``restart_pending`` as for GoodVerdict."""

    kind: ClassVar[EventKind] = EventKind.REQUEST_SUCCESS
    restart_pending: bool = False


@dataclass(frozen=True, kw_only=True)
class ProcessGone(_EventBase):
    """Proof, not doubt, that the process is gone; counting more failures would only delay
    the same conclusion."""

    kind: ClassVar[EventKind] = EventKind.PROCESS_GONE
    reason: str
    detail: str = ""


@dataclass(frozen=True, kw_only=True)
class WedgeProven(_SeenEventBase):
    """Work present and no progress over two consecutive waits: condemned without counting."""

    kind: ClassVar[EventKind] = EventKind.WEDGE_PROVEN
    reason: str = "wedged"
    evidence: str = ""


@dataclass(frozen=True, kw_only=True)
class RestartIssued(_EventBase):
    """Fed before the restart command runs, so a refused attempt never runs it.
    ``process``: the process the restart replaces as last read, when the caller knows it
    (else the one the ledger condemned): its counters may have moved since."""

    kind: ClassVar[EventKind] = EventKind.RESTART_ISSUED
    process: ProcessSeen | None = None


@dataclass(frozen=True, kw_only=True)
class RestartFailed(_EventBase):
    """The restart brought up no process: back to DEAD. ``withdrawn``: its command never
    ran (an operator's hold came before it), so the attempt it spent is given back."""

    kind: ClassVar[EventKind] = EventKind.RESTART_FAILED
    reason: str
    withdrawn: bool = False


@dataclass(frozen=True, kw_only=True)
class RestartRan(_EventBase):
    """The restart command exited 0, proving nothing yet. The startup grace is the new
    process's time to prove itself, so it counts from here when the command took long:
    a command past its grace (a ``restart_timeout`` longer than it, or one that outlived
    its kill) failed its own restart, and the next one killed what the first brought up."""

    kind: ClassVar[EventKind] = EventKind.RESTART_RAN


@dataclass(frozen=True, kw_only=True)
class StartupExpired(_EventBase):
    """The startup grace after a restart ran out with nothing proven: no new process
    (RESTARTING), or one that was never re-admitted (STALE). A failed restart, so the
    restart policy takes over again: cooldown, budget, RETIRED past it."""

    kind: ClassVar[EventKind] = EventKind.STARTUP_EXPIRED


@dataclass(frozen=True, kw_only=True)
class NewProcessUp(_SeenEventBase):
    """A replacement process answers. ``url``: where, when it bound a new address; the
    serving URLs must follow it, or traffic goes to a socket nobody listens on. ``process``:
    the new one, when a read showed it; None leaves it unknown until one does."""

    kind: ClassVar[EventKind] = EventKind.NEW_PROCESS_UP
    url: str | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.url is not None:
            if not isinstance(self.url, str) or not self.url:
                raise ValueError(f"NewProcessUp.url must be a non-empty string, got {self.url!r}")
            refuse_user_info(self.url)  # the ledger's URLs reach the state file


MAX_WEIGHT_VERSION: Final = 2**63 - 1


def check_weight_version(version: object, where: str) -> int:
    """A weight version is an integer of at most 64 bits (a trainer's step or a sync's
    counter), refused before anything is recorded. Why a bound: an integer of thousands
    of digits cannot even be written in a message, so the ledger would keep it and then
    raise while saying what it did."""
    if isinstance(version, bool) or not isinstance(version, int):
        shown = repr(version) if not isinstance(version, int) else type(version).__name__
        raise ValueError(f"{where} must be an integer, got {shown[:80]}")
    if not -MAX_WEIGHT_VERSION <= version <= MAX_WEIGHT_VERSION:
        # Counted with its sign: 2**63 is 64 bits unsigned, and "must fit in 64 bits, got
        # one of 64 bits" refused it in words that said it fitted.
        raise ValueError(
            f"{where} must fit in 64 bits with its sign (at most 2**63 - 1 either way), "
            f"got one of {version.bit_length() + 1} bits with its sign"
        )
    return version


@dataclass(frozen=True, kw_only=True)
class Readmitted(_EventBase):
    """The replacement proved itself. ``weight_version`` is recorded as given: None means
    the admitter does not know, and an old number would be a lie about the new process."""

    kind: ClassVar[EventKind] = EventKind.READMITTED
    weight_version: int | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.weight_version is not None:
            check_weight_version(self.weight_version, "Readmitted.weight_version")


@dataclass(frozen=True, kw_only=True)
class UnplannedRestart(_SeenEventBase):
    kind: ClassVar[EventKind] = EventKind.UNPLANNED_RESTART


@dataclass(frozen=True, kw_only=True)
class Retire(_EventBase):
    kind: ClassVar[EventKind] = EventKind.RETIRE
    reason: str


@dataclass(frozen=True, kw_only=True)
class OperatorReset(_EventBase):
    kind: ClassVar[EventKind] = EventKind.OPERATOR_RESET


@dataclass(frozen=True, kw_only=True)
class Condemned(_EventBase):
    """A judgement, not an observation: the caller owes an independent reason to believe
    this backend is the culprit (it answers probes, yet broke a collective)."""

    kind: ClassVar[EventKind] = EventKind.CONDEMNED
    reason: str
    detail: str = ""


@dataclass(frozen=True, kw_only=True)
class WeightsPartial(_EventBase):
    """An aborted weight sync left this backend with a mix of old and new weights: alive,
    but it must not serve until a completed sync re-admits it."""

    kind: ClassVar[EventKind] = EventKind.WEIGHTS_PARTIAL


@dataclass(frozen=True, kw_only=True)
class WeightsStamped(_EventBase):
    """A completed weight sync reached this serving backend; only its version changes."""

    kind: ClassVar[EventKind] = EventKind.WEIGHTS_STAMPED
    weight_version: int

    def __post_init__(self) -> None:
        super().__post_init__()
        check_weight_version(self.weight_version, "WeightsStamped.weight_version")


Event: TypeAlias = (
    GoodVerdict
    | ProbeFailure
    | RequestFailure
    | RequestSuccess
    | ProcessGone
    | WedgeProven
    | RestartIssued
    | RestartFailed
    | RestartRan
    | StartupExpired
    | NewProcessUp
    | Readmitted
    | UnplannedRestart
    | Retire
    | OperatorReset
    | Condemned
    | WeightsPartial
    | WeightsStamped
)


@dataclass(frozen=True, slots=True)
class Transition:
    """What one event did. ``applied`` is False when the table refused it; then nothing changed."""

    name: str
    kind: EventKind
    from_state: State
    to_state: State
    applied: bool
    reason: str
    epoch_changed: bool


@dataclass(frozen=True, slots=True)
class BackendSnapshot:
    """Everything known about one backend at one time."""

    name: str
    url: str
    state: State
    probe_failures: int  # probe-style failures in a row
    request_failures: int  # request failures not yet cleared by a successful request
    good_streak: int  # good verdicts in a row
    restart_attempts: int  # attempts within restart_budget_window before the snapshot time
    last_restart_at: float | None
    last_ok_at: float | None
    last_error: str
    weight_version: int | None
    condemned_by: str | None  # the verdict or cause that last condemned it; None once served
    state_since: float | None  # None: in this state since before the ledger knew it
    # While STALE after a partial weight sync: the serving state it had when the sync broke.
    state_before_partial: State | None = None
    in_place_recoveries: int = 0  # DEAD -> STALE by the same process, within the budget window
    restart_ran_at: float | None = None  # when a restart's command last exited 0
    traffic_failures: int = 0  # of request_failures, those real traffic reported
    replaced_while_dead: bool | None = False  # this STALE spell began where a DEAD one was
    # Condemned on its caller's word (a process gone, a silent participant): only a new
    # process comes back, never this one in place.
    caller_condemned: bool = False

    @property
    def serving(self) -> bool:
        return self.state in SERVING


@dataclass(slots=True)
class _Backend:
    name: str
    url: str
    state: State = State.HEALTHY
    probe_failures: int = 0
    request_failures: int = 0
    good_streak: int = 0
    restart_times: list[float] = field(default_factory=list)
    last_ok_at: float | None = None
    last_error: str = ""
    weight_version: int | None = None
    condemned_by: str | None = None
    state_since: float | None = None
    state_before_partial: State | None = None
    # The process last seen; while DEAD, the one that was condemned.
    process: ProcessSeen | None = None
    # Condemned on its caller's word (proof its process is gone, or judged the silent
    # participant of a collective), not on doubt: that process never returns in place.
    caller_condemned: bool = False
    recovery_times: list[float] = field(default_factory=list)  # in-place recoveries
    restart_ran_at: float | None = None  # when the last restart's command exited 0
    traffic_failures: int = 0  # of request_failures, those real traffic reported
    # The process the last restart replaced (the one condemned then), to tell its
    # replacement by the process, not by two hosts' clocks.
    restarted_from: ProcessSeen | None = None
    # This STALE spell began with a new process where a DEAD one was, not where a restart
    # of ours waited (RESTARTING): someone else's restart, perhaps by hand. None: unknown
    # (a state written before it was kept), taken as the times alone say.
    replaced_while_dead: bool | None = False
    # A new process was seen since the last restart was issued (new_process_up).
    replaced_since_restart: bool = False
    # The time the last restart was issued at, when ``pull_back`` took it back since: its
    # order (a command still running) bears this one. None: not taken back.
    restart_stamped_at: float | None = None
    # While RESTARTING after an earlier restart: whether that one's replacement had been
    # seen when this one was issued, for a withdrawal to give back. None: nothing to give.
    replaced_before_restart: bool | None = None
    # Likewise: when that earlier restart's command exited 0 (``restart_ran_at``), from
    # which its startup grace counts. None: nothing to give.
    ran_before_restart: float | None = None


class _Refused(Exception):  # noqa: N818 - a signal inside apply(), never seen outside
    """Raised by a rule, before it changes anything, to refuse its event with a reason."""

    def __init__(self, state: State, kind: EventKind, why: str, *, off: bool = False) -> None:
        # A rule the policy turned off reads exactly as an absent table entry.
        self.reason = (
            f"{_why_ignored(state, kind)} ({why})" if off else f"{kind} refused in {state}: {why}"
        )
        super().__init__(self.reason)


# Rules: the counter-dependent outcomes named in the table. Each updates the record for
# the event and returns the next state and a sentence saying why.


def _promote_when_proven(b: _Backend, event: Event, policy: LedgerPolicy) -> tuple[State, str]:
    match event:
        case GoodVerdict(request_ok=request_ok):
            b.probe_failures = 0
            b.good_streak += 1
            what = "good verdict with an answered request" if request_ok else "good verdict"
            if request_ok and b.traffic_failures:
                what += " (the tiny one, which clears no failure real traffic saw)"
            elif request_ok:
                _clear_request_failures(b)
        case RequestSuccess():
            _clear_request_failures(b)
            what = "request answered"
        case _:
            raise AssertionError(f"{Rule.PROMOTE_WHEN_PROVEN} cannot take {event.kind}")
    b.last_ok_at = event.now
    if b.state is State.HEALTHY:
        return State.HEALTHY, what
    # A good probe says the server answers probes, not that it answers requests: without
    # this condition a server failing every request would flap SUSPECT <-> HEALTHY forever.
    if b.request_failures:
        return State.SUSPECT, (
            f"{what}; still suspect: {b.request_failures} request failure(s) not yet cleared "
            "by an answered request"
        )
    if b.good_streak < policy.healthy_threshold:
        return State.SUSPECT, (
            f"{what}; {b.good_streak} of {policy.healthy_threshold} good verdicts in a row"
        )
    return State.HEALTHY, f"{what}; {b.good_streak} good verdicts in a row and no request failing"


def _condemn_at_threshold(b: _Backend, event: Event, policy: LedgerPolicy) -> tuple[State, str]:
    match event:
        case ProbeFailure():
            b.probe_failures += 1
            streak, what = b.probe_failures, "probe failure"
        case RequestFailure():
            _count_request_failure(b, event)
            streak, what = b.request_failures, "request failure"
        case _:
            raise AssertionError(f"{Rule.CONDEMN_AT_THRESHOLD} cannot take {event.kind}")
    # Good evidence must be in a row: any failure starts the count to HEALTHY again.
    b.good_streak = 0
    b.last_error = _error_text(event.reason, event.detail)
    if streak >= policy.unhealthy_threshold:
        b.condemned_by = event.reason
        return State.DEAD, f"{what} {streak} in a row ({b.last_error}): condemned"
    return State.SUSPECT, (
        f"{what} {streak} of {policy.unhealthy_threshold} in a row ({b.last_error})"
    )


def _spend_restart(b: _Backend, event: Event, policy: LedgerPolicy) -> tuple[State, str]:
    window = policy.restart_budget_window
    # Only attempts inside the window matter, and at most restart_budget of them are ever
    # kept, so the record stays bounded however long the backend lives.
    b.restart_times = [t for t in b.restart_times if _in_window(t, event.now, window)]
    spent = len(b.restart_times)
    if spent >= policy.restart_budget:
        why = f"restart budget spent: {spent} attempts in {_span(window)}"
        # Retirement ends the record, so it keeps what the backend last failed on: a reload
        # that could not get its GPU and one with a bad config want different answers.
        b.last_error = f"{why}; last error: {b.last_error}" if b.last_error else why
        return State.RETIRED, why
    # Withdrawn before its command ran, this restart must leave the one before it as it
    # was: a replacement of that one seen failing still holds its concurrency place.
    earlier = b.restart_times and b.process is not None
    b.replaced_before_restart = _replaced_since(b, max(b.restart_times)) if earlier else None
    b.ran_before_restart = b.restart_ran_at if b.restart_times else None
    b.restart_times.append(event.now)
    # Good news stamped after this restart came before it all the same: the wall clock
    # stepped back by less than ``pull_back`` takes back (CLOCKS_APART). Left ahead, it
    # read as good since the restart: its replacement passed for proven at once, holding
    # no max_concurrent_restarts place, and no startup grace failed one that never
    # answered. At the restart's instant it is before it (``_awaited_restart``).
    if b.last_ok_at is not None and b.last_ok_at > event.now:
        b.last_ok_at = event.now
    # Good verdicts towards recovery in place must be in a row, and RESTARTING ignores
    # every verdict: none seen during the attempt could break the streak, so it ends here.
    b.good_streak = 0
    b.restart_ran_at = None  # an earlier command's end must not stretch this one's grace
    b.restart_stamped_at = None
    if isinstance(event, RestartIssued) and event.process is not None:
        # The process as last read: compared with it as condemned, one whose counters
        # moved since held a concurrency place after its command failed.
        b.process = event.process
    b.restarted_from = b.process
    b.replaced_since_restart = False
    return State.RESTARTING, (
        f"restart {spent + 1} of {policy.restart_budget} allowed in {_span(window)}"
    )


def _recover_in_place(b: _Backend, event: Event, policy: LedgerPolicy) -> tuple[State, str]:
    """The condemned process proves itself again: DEAD -> STALE, never straight to serving.

    What condemned it was doubt (failures counted) or a wedge that has since ended; the
    weights it holds are the ones it served with. A new process is never let through
    here: it arrives as new_process_up and must answer as any replacement does.
    """
    if not isinstance(event, GoodVerdict | RequestSuccess):
        raise AssertionError(f"{Rule.RECOVER_IN_PLACE} cannot take {event.kind}")
    if not policy.recover_in_place:
        raise _Refused(b.state, event.kind, "policy.recover_in_place is off", off=True)
    if b.caller_condemned:
        # Answering proves nothing against it: an orphaned server outlives its actor, and
        # a silent participant answers every probe, then hangs the next sync it joins.
        raise _Refused(
            b.state,
            event.kind,
            "condemned on its caller's word: only a new process comes back",
        )
    if event.restart_pending:
        raise _Refused(
            b.state, event.kind, "a restart is pending: the restart decides, not this process"
        )
    window = policy.restart_budget_window
    recent = [t for t in b.recovery_times if _in_window(t, event.now, window)]
    done = len(recent)
    if done >= policy.max_in_place_recoveries:
        raise _Refused(
            b.state,
            event.kind,
            f"{done} in-place recoveries in {_span(window)} (max_in_place_recoveries "
            f"{policy.max_in_place_recoveries}): it stays DEAD for an operator",
        )
    # Only a request seen answered (the tiny one, or real traffic) clears a request-failure
    # streak, as in service: requests finishing for other clients say nothing of the ones
    # that failed. They do prove that a backend with work answers, where no tiny request
    # may be sent.
    answered = isinstance(event, RequestSuccess) or event.request_ok
    proof = answered or (isinstance(event, GoodVerdict) and event.requests_finished)
    condemned = b.process
    if condemned is None and proof:
        # Condemned before any read showed its process (requests that failed, or a server
        # that never answered HTTP, before its first read): the first process to prove
        # itself since stands for it. Refused for good, it stayed DEAD while every read
        # showed it; were it a replacement, it would go to STALE all the same.
        condemned = event.process
    # Never identified, then or now (its /metrics shows no process: metrics off, judged
    # by the tiny request alone): its answer stands for the condemned process, as a first
    # process does for one condemned unread. Refused, a backend condemned by failed
    # requests answered every tiny request and stayed DEAD for good: nothing restarts a
    # traffic condemnation by default, and no read will ever show its process. A verdict
    # only: a request the router saw answered (in flight when it was condemned) was no
    # read at all, so it shows nothing of what /metrics would.
    unknowable = (
        isinstance(event, GoodVerdict)
        and event.request_ok
        and condemned is None
        and event.process is None
    )
    if (event.process is None or condemned is None) and not unknowable:
        if not answered or not b.request_failures:
            raise _Refused(
                b.state,
                event.kind,
                "which process answered is unknown: only a /metrics read shows it",
            )
        # An answered request clears the request-failure streak whichever process it was;
        # it cannot count towards recovery in place without knowing that process.
        _clear_request_failures(b)
        b.last_ok_at = event.now
        return State.DEAD, (
            "request answered: request failures cleared; which process answered is unknown, "
            "so it does not count towards recovery in place"
        )
    other = None
    if event.process is not None and condemned is not None:
        other = event.process.differs_from(condemned)
    if other is not None:
        raise _Refused(
            b.state, event.kind, f"{other}; a new process goes through new_process_up and STALE"
        )
    if not proof:
        raise _Refused(
            b.state,
            event.kind,
            "the engine steps but no request finished or was answered: a condemned process "
            "proves itself by requests",
        )
    b.process = condemned
    b.probe_failures = 0
    b.good_streak += 1
    b.last_ok_at = event.now
    if answered:
        _clear_request_failures(b)
    # Each recovery in the window doubles the good time asked of the next (Envoy's
    # ejection multiplier); at a steady probing interval, verdicts in a row are that time.
    needed = policy.healthy_threshold * 2**done
    # The audit trail says what was proven: of a process no read ever showed, only that
    # something answered. Written "same process", a recovery read as one identified.
    whose = "answered, no read showing which process" if unknowable else "from the same process"
    so_far = f"{b.good_streak} of {needed} good verdicts in a row {whose}"
    if b.request_failures:
        return State.DEAD, (
            f"{so_far}; {b.request_failures} request failure(s) not yet cleared by an "
            "answered request"
        )
    if b.good_streak < needed:
        return State.DEAD, so_far
    since = b.state_since if b.state_since is not None else event.now
    # Only recoveries inside the window are kept, at most the cap: the record stays bounded.
    b.recovery_times = [*recent, event.now]
    _clear_streaks(b)
    last = done + 1 == policy.max_in_place_recoveries
    return State.STALE, (
        f"{'process never read' if unknowable else 'same process'}, back after "
        f"{max(0.0, event.now - since):.0f} s: in-place recovery "
        f"{done + 1} of {policy.max_in_place_recoveries} allowed in {_span(window)}"
        + ("; the last: condemned again, it stays DEAD for an operator" if last else "")
        + "; re-admission returns it to serving"
    )


def _break_recovery(b: _Backend, event: Event, policy: LedgerPolicy) -> tuple[State, str]:
    """A failure of a DEAD backend: good verdicts towards recovery must be in a row.

    A wedge proven on a backend that something else condemned (failed requests, doubt,
    a stall) is the proof the restart policy asks for: it becomes the condemning cause,
    whatever ``recover_in_place`` says, or ``restart_on = ["wedged"]`` would pass over a
    proven wedge for ever because doubt got there first.
    """
    if not isinstance(event, ProbeFailure | RequestFailure | WedgeProven):
        raise AssertionError(f"{Rule.BREAK_RECOVERY} cannot take {event.kind}")
    if isinstance(event, WedgeProven) and b.condemned_by != event.reason:
        was = b.condemned_by
        b.condemned_by = event.reason
        b.good_streak = 0
        b.last_error = _error_text(event.reason, event.evidence)
        return State.DEAD, f"wedge proven ({b.last_error}): condemned by it now, not by {was}"
    if not policy.recover_in_place:
        raise _Refused(b.state, event.kind, "policy.recover_in_place is off", off=True)
    b.good_streak = 0
    match event:
        case WedgeProven():
            b.last_error = _error_text(event.reason, event.evidence)
        case ProbeFailure():
            b.probe_failures += 1
            b.last_error = _error_text(event.reason, event.detail)
        case RequestFailure():
            _count_request_failure(b, event)
            b.last_error = _error_text(event.reason, event.detail)
    return State.DEAD, f"still failing ({b.last_error}): the good streak starts again"


def _note_working(b: _Backend, event: Event, policy: LedgerPolicy) -> tuple[State, str]:
    """A STALE process whose requests finish works: noted, never re-admitted by it."""
    if not isinstance(event, GoodVerdict):
        raise AssertionError(f"{Rule.NOTE_WORKING} cannot take {event.kind}")
    own = b.process
    if own is None and event.process is not None and b.replaced_since_restart:
        # Up with its process unknown (no read showed it yet): the first read that shows
        # one stands for it, unless it is the process the restart replaced. Refused, a
        # busy replacement stayed unknown while every read showed it, and its grace failed it.
        replaced = b.restarted_from
        if replaced is None or event.process.differs_from(replaced) is not None:
            own = event.process
    same = event.process is not None and own is not None and event.process.differs_from(own) is None
    if not ((event.requests_finished or event.asleep) and same):
        raise _Refused(b.state, event.kind, "no request finished on its process", off=True)
    b.process = own  # known from now on: a later read of another process is another one
    b.last_ok_at = event.now
    how = "requests finish on its process" if event.requests_finished else "put to sleep"
    return State.STALE, (
        f"{how}: it works, and no startup grace fails it; re-admission still returns it to serving"
    )


def _keep_callers_word(b: _Backend, event: Event, policy: LedgerPolicy) -> tuple[State, str]:
    """The caller's word on a backend already DEAD by doubt or a wedge.

    ``condemned_by`` stays: the restart policy restarts by the reason that condemned it,
    and a wedge proven is still the wedge whatever the caller adds. What changes is what
    may come back: only a new process, as when the word had condemned it.
    """
    if not isinstance(event, ProcessGone | Condemned):
        raise AssertionError(f"{Rule.KEEP_CALLERS_WORD} cannot take {event.kind}")
    if b.caller_condemned:
        raise _Refused(b.state, event.kind, "its caller's word is already recorded", off=True)
    b.caller_condemned = True
    b.good_streak = 0  # good verdicts before the word count for nothing after it
    b.last_error = _error_text(event.reason, event.detail)
    return State.DEAD, (
        f"{b.last_error}: condemned already ({b.condemned_by or 'no reason kept'}), now on "
        "its caller's word too; only a new process comes back"
    )


def _readmit(b: _Backend, event: Event, policy: LedgerPolicy) -> tuple[State, str]:
    """Back to serving, and to the doubt it was in when a weight sync broke.

    A backend SUSPECT for failing requests, then marked partial by the sync that its
    failures may have broken, is the same process after the refit: only its weights were
    mended. Its request-failure streak is the one counter that condemns an engine that
    still answers every probe, and clearing it here let a shard fail real requests for as
    long as refits kept coming (NeMo-RL fixed the same laundering in its recovery path).
    Any other STALE backend is a new or a healthy process and starts afresh.
    """
    if not isinstance(event, Readmitted):
        raise AssertionError(f"{Rule.READMIT} cannot take {event.kind}")
    b.weight_version = event.weight_version
    b.condemned_by = None
    b.last_ok_at = event.now
    how = "re-admitted"
    if event.weight_version is not None:
        how = f"re-admitted with weight version {event.weight_version}"
    if b.state_before_partial is State.SUSPECT:
        return State.SUSPECT, (
            f"{how}, SUSPECT as before its weights were left partial: "
            f"{b.request_failures} request and {b.probe_failures} probe failure(s) kept"
        )
    _clear_streaks(b)
    return State.HEALTHY, how


def _fail_overdue_restart(b: _Backend, event: Event, policy: LedgerPolicy) -> tuple[State, str]:
    grace = policy.startup_grace
    if _overdue_restart(b, event.now, grace) is None:
        return b.state, f"no restart of it is overdue (startup grace {_span(grace)})"
    # condemned_by stays, as for RestartFailed: the policy needs it to try again.
    if b.state is State.RESTARTING:
        b.last_error = f"restart failed: no new process within the startup grace of {_span(grace)}"
    else:
        b.last_error = (
            "restart failed: the new process was not re-admitted within the startup grace "
            f"of {_span(grace)}"
        )
    return State.DEAD, b.last_error


def _awaited_restart(b: _Backend, grace: float) -> float | None:
    """When the restart this backend still waits on was issued: RESTARTING, or STALE on
    the process a restart brought up, neither re-admitted nor seen finishing requests
    since. Until then the restart has proven nothing, so it is still under way
    (``Ledger.restart_unproven``)."""
    if b.state is State.RESTARTING:
        # Set on entering RESTARTING (by the restart itself); from_dict enforces it.
        return b.state_since
    if b.state is State.STALE and b.restart_times:
        restarted_at = max(b.restart_times)
        # Good since (re-admitted, seen working, or recovered in place and then STALE
        # again): that restart is not what this spell waits on. Good at its very instant
        # is good before it: a settle feeds its verdicts before it restarts.
        if b.last_ok_at is not None and b.last_ok_at > restarted_at:
            return None
        # Replaced while DEAD once that restart's grace had run out (an operator's hand
        # restart): not ours to fail. Counted from our restart, it was failed the moment
        # it was seen, and restarted. Our own replacement seen late is still ours.
        since = b.state_since
        late = since is not None and since - _grace_from(b, restarted_at) >= grace
        if late and b.replaced_while_dead is not False:
            return None
        return restarted_at
    return None


def _overdue_restart(b: _Backend, now: float, grace: float) -> float | None:
    """When the restart this backend still waits on was issued, if its grace ran out: from
    its command's end when that came later (``RestartRan``)."""
    restarted_at = _awaited_restart(b, grace)
    if restarted_at is None or now - _grace_from(b, restarted_at) < grace:
        return None
    return restarted_at


def _replaced_since(b: _Backend, restarted_at: float) -> bool:
    """Whether the process last seen is the replacement of the restart issued at
    ``restarted_at`` (``Ledger.restart_unproven``); ``b.process`` must be known."""
    assert b.process is not None
    if b.replaced_since_restart:
        return True  # a new process was seen since: its replacement, whatever it shows
    if b.restarted_from is not None:
        # Another process than the one the restart replaced: its replacement. Told by
        # the processes (start time, or counters gone back), not by clocks: a backend
        # host 2 min behind ours made every replacement "older" than the restart, and
        # a shared fault restarted the fleet in turn. Unknown counts as replaced.
        return b.process.differs_from(b.restarted_from) is not None
    # The process it replaced was never read (or an older state did not keep it): a
    # process started since, hosts' clocks a minute apart at most; no start time
    # (multiprocess mode) is taken as replaced, the doubt erring towards fewer restarts,
    # as the budget's.
    start = b.process.start
    return start is None or start >= restarted_at - CLOCKS_APART


def _grace_from(b: _Backend, restarted_at: float) -> float:
    """When the startup grace of the restart issued at ``restarted_at`` began."""
    ran_at = b.restart_ran_at
    return ran_at if ran_at is not None and ran_at > restarted_at else restarted_at


_RULES: Final = {
    Rule.PROMOTE_WHEN_PROVEN: _promote_when_proven,
    Rule.CONDEMN_AT_THRESHOLD: _condemn_at_threshold,
    Rule.SPEND_RESTART: _spend_restart,
    Rule.RECOVER_IN_PLACE: _recover_in_place,
    Rule.BREAK_RECOVERY: _break_recovery,
    Rule.FAIL_OVERDUE_RESTART: _fail_overdue_restart,
    Rule.NOTE_WORKING: _note_working,
    Rule.KEEP_CALLERS_WORD: _keep_callers_word,
    Rule.READMIT: _readmit,
}


def _record(b: _Backend, event: Event) -> str:
    """Bookkeeping for an event the table sends to a fixed state; returns why."""
    match event:
        case ProbeFailure() | RequestFailure():
            b.last_error = _error_text(event.reason, event.detail)
            why = f"noted, never condemns: a {b.state} backend takes no traffic ({b.last_error})"
            if b.state_before_partial is not None:
                # Its streaks go back to serving with it (``_readmit``): failures of a
                # refit in progress would make one failure after it condemn at once.
                return f"{why}; not counted while its weights are in doubt"
            if isinstance(event, ProbeFailure):
                b.probe_failures += 1
            else:
                _count_request_failure(b, event)
            return why
        case ProcessGone():
            b.condemned_by = event.reason
            b.caller_condemned = True
            b.good_streak = 0  # good verdicts before the proof count for nothing after it
            b.last_error = _error_text(event.reason, event.detail)
            return f"process gone ({b.last_error}): condemned at once"
        case WedgeProven():
            b.condemned_by = event.reason
            b.good_streak = 0
            b.last_error = _error_text(event.reason, event.evidence)
            return f"wedge proven ({b.last_error}): condemned at once"
        case RestartFailed():
            # condemned_by stays: the restart failing does not change why it was condemned,
            # and the restart policy needs that reason to try again.
            if event.withdrawn:
                # No command ran, so no attempt was made: the budget gets back the one this
                # RESTARTING spell spent (stamped when it began), and the last error stays.
                if b.state_since in b.restart_times:
                    b.restart_times.remove(b.state_since)
                    b.restart_stamped_at = None
                    # The restart before it stands again as it was: its replacement, seen
                    # before this one was issued, is still its replacement.
                    b.replaced_since_restart = bool(b.replaced_before_restart)
                    # And its grace counts from its command's end again, not its issue.
                    b.restart_ran_at = b.ran_before_restart
                return f"restart withdrawn before its command ran ({event.reason}): no attempt"
            b.last_error = f"restart failed: {event.reason}"
            return b.last_error
        case RestartRan():
            b.restart_ran_at = event.now
            return "restart command exited 0: proves nothing yet; the startup grace counts from now"
        case NewProcessUp() | UnplannedRestart():
            # A replacement must not inherit the failures of the process it replaced, nor
            # its identity: unknown until a read shows it. Nor the doubt its predecessor
            # was in when a sync broke: re-admitted, it would come back SUSPECT, first in
            # line to be condemned for what the other process did.
            _clear_streaks(b)
            b.process = event.process
            b.state_before_partial = None
            b.caller_condemned = False
            if isinstance(event, UnplannedRestart):
                b.last_error = "process restarted unplanned"
                return "process restarted unplanned; the new one must prove itself"
            return "new process up; it must prove itself before serving"
        case Retire():
            b.last_error = f"retired: {event.reason}"
            return b.last_error
        case Condemned():
            b.condemned_by = event.reason
            b.caller_condemned = True
            b.good_streak = 0
            b.last_error = _error_text(event.reason, event.detail)
            return f"condemned ({b.last_error})"
        case WeightsPartial():
            # Kept because the sync overwrote the suspicion microseconds before anyone asks
            # which backend the ledger already doubted.
            b.state_before_partial = b.state
            return f"weights partial after an aborted sync (was {b.state}): withheld"
        case WeightsStamped():
            b.weight_version = event.weight_version
            return f"weight version {event.weight_version} recorded"
        case OperatorReset():
            _clear_streaks(b)
            b.restart_times.clear()
            b.restart_stamped_at = None
            b.recovery_times.clear()
            b.condemned_by = None
            b.caller_condemned = False
            return (
                "operator reset: streaks, restart attempts and in-place recoveries cleared; "
                "must prove itself"
            )
        case GoodVerdict() | RequestSuccess() | RestartIssued() | StartupExpired() | Readmitted():
            raise AssertionError(f"{event.kind} only ever goes through a rule")


def _unchanged(name: str, event: Event, state: State, reason: str) -> Transition:
    return Transition(
        name=name,
        kind=event.kind,
        from_state=state,
        to_state=state,
        applied=False,
        reason=reason,
        epoch_changed=False,
    )


def _clear_streaks(b: _Backend) -> None:
    b.probe_failures = 0
    _clear_request_failures(b)
    b.good_streak = 0


def _count_request_failure(b: _Backend, event: RequestFailure) -> None:
    b.request_failures += 1
    if event.traffic:
        b.traffic_failures += 1


def _clear_request_failures(b: _Backend) -> None:
    b.request_failures = 0
    b.traffic_failures = 0


def _why_ignored(state: State, kind: EventKind) -> str:
    why = RETIRED_IS_TERMINAL if state is State.RETIRED else IGNORED_BECAUSE[kind]
    return f"{kind} ignored in {state}: {why}"


_EVENT_TYPES: Final = (
    GoodVerdict,
    ProbeFailure,
    RequestFailure,
    RequestSuccess,
    ProcessGone,
    WedgeProven,
    RestartIssued,
    RestartFailed,
    RestartRan,
    StartupExpired,
    NewProcessUp,
    Readmitted,
    UnplannedRestart,
    Retire,
    OperatorReset,
    Condemned,
    WeightsPartial,
    WeightsStamped,
)


class Ledger:
    """Per-backend health for one fleet, and the serving set that follows from it.

    Configured backends start HEALTHY: on first sight there is no evidence against them,
    and starting them STALE would make every fresh fleet report nothing serving until each
    answered a proof request. Doubt is cheap to reach (one failure makes SUSPECT).
    """

    def __init__(
        self,
        policy: LedgerPolicy,
        backends: Iterable[tuple[str, str]] = (),
        *,
        now: float | None = None,
    ) -> None:
        if now is not None:
            _as_time(now, "now")
        self._policy = policy
        self._epoch = 0
        self._backends: dict[str, _Backend] = {}
        self._by_url: dict[str, str] = {}  # URL key -> name: a lookup per load, not a scan
        # URL keys more than one backend was ever at (a RETIRED one's taken address, one
        # server under two spellings in an older record): the only ones _forget_url scans
        # for another holder, so a reload dropping thousands scans nothing.
        self._shared_urls: set[str] = set()
        for name, url in backends:
            self._insert(_Backend(name=name, url=url, state_since=now), "backends")

    # --- mutators ---------------------------------------------------------------------

    def apply(self, name: str, event: Event) -> Transition:
        """Feed one event to one backend. An event the table refuses changes nothing."""
        if not isinstance(event, _EVENT_TYPES):
            raise TypeError(f"not a ledger event: {event!r}")
        b = self._lookup(name)
        before = b.state
        outcome = TRANSITIONS[before].get(event.kind)
        if outcome is None:
            return _unchanged(name, event, before, _why_ignored(before, event.kind))
        if isinstance(event, NewProcessUp) and event.url is not None:
            self._check_url_free(event.url, name)
        if isinstance(event, OperatorReset):
            if self._url_taken(b):
                taker = self.by_url(b.url)
                why = f"its address {b.url} now belongs to backend {taker!r}; give it another first"
                return _unchanged(name, event, before, why)
            self._by_url[_url_key(b.url)] = name  # freed by a taker that moved on
        if isinstance(outcome, Rule):
            try:
                after, why = _RULES[outcome](b, event, self._policy)
            except _Refused as refused:
                return _unchanged(name, event, before, refused.reason)
            if after not in RULE_LEADS_TO[outcome]:
                raise AssertionError(f"{outcome} led {name} to {after}, outside its row")
        else:
            after, why = outcome, _record(b, event)
        if isinstance(event, NewProcessUp) and event.url is not None:
            self._move(b, event.url)
            why = f"{why}; now at {event.url}"
        seen = event.process if isinstance(event, _SeenEventBase) else None
        # While DEAD the record keeps the process it condemned, so that only that same
        # process can come back in place; anywhere else it follows the latest one seen.
        if seen is not None and not (before is State.DEAD and after is State.DEAD):
            b.process = seen
        if after is not before:
            b.state = after
            b.state_since = event.now
        if after is not State.STALE:
            b.state_before_partial = None  # remembered only while the weights are in doubt
            b.replaced_while_dead = False
        elif before is not State.STALE:
            b.replaced_while_dead = before is State.DEAD and isinstance(event, NewProcessUp)
        if isinstance(event, NewProcessUp):
            b.replaced_since_restart = True
        if after is not State.RESTARTING:
            b.replaced_before_restart = None  # only a RESTARTING spell's withdrawal reads it
            b.ran_before_restart = None
        # Only this backend moved, so the serving set changed iff it crossed the line.
        moved = (before in SERVING) != (after in SERVING)
        if moved:
            self._epoch += 1
        return Transition(
            name=name,
            kind=event.kind,
            from_state=before,
            to_state=after,
            applied=True,
            reason=why,
            epoch_changed=moved,
        )

    def pull_back(
        self, now: float, beside: Mapping[str, Iterable[float]] | None = None
    ) -> dict[str, dict[float, float]]:
        """Take the times kept later than ``now`` back to just before it, in their order,
        for each backend holding one more than a minute ahead (hosts' clocks apart, as
        ``CLOCKS_APART`` allows); per backend so changed, how its times were taken back
        (``pulled_back``). ``beside``: more times of each backend the caller keeps
        (``FleetRecord.pull_back``), ordered with these and taken back with them.

        The wall clock stepped back since (NTP correcting a clock that ran ahead, a VM
        resumed from a snapshot), or the record came from a host whose clock ran ahead:
        a restart stamped hours ahead stayed RESTARTING, its grace not begun, for those
        hours (for ever at 1e300), holding the fleet's restart slot all the while, and
        its cooldown likewise. How long ago it really was is unknown, so the startup
        grace, the cooldown and the budget window count from when it is first seen. What
        came before what is known, and kept: taken to one instant, a replacement seen
        working after its restart was failed by the restart's grace.
        """
        _as_time(now, "now")
        beside = beside or {}
        changed = {}
        limit = now + CLOCKS_APART
        for b in self._backends.values():
            more = beside.get(b.name, ())
            stamps = (
                b.state_since or 0.0,
                b.last_ok_at or 0.0,
                b.restart_ran_at or 0.0,
                b.ran_before_restart or 0.0,
            )
            if not more and max(*stamps, *b.restart_times, *b.recovery_times) <= limit:
                continue  # nothing far enough ahead (``pulled_back``), as nearly always
            times = [b.state_since, b.last_ok_at, b.restart_ran_at, b.ran_before_restart]
            taken = pulled_back([*times, *b.restart_times, *b.recovery_times, *more], now)
            if taken is None:
                continue
            last = max(b.restart_times, default=None)
            if last in taken and b.restart_stamped_at is None:
                b.restart_stamped_at = last  # what its command's order still bears
            b.state_since = _taken(b.state_since, taken)
            b.last_ok_at = _taken(b.last_ok_at, taken)
            b.restart_ran_at = _taken(b.restart_ran_at, taken)
            b.ran_before_restart = _taken(b.ran_before_restart, taken)
            b.restart_times = [taken.get(t, t) for t in b.restart_times]
            b.recovery_times = [taken.get(t, t) for t in b.recovery_times]
            changed[b.name] = taken
        return changed

    def expire_restarts(
        self, now: float, *, sparing: Collection[str] = frozenset()
    ) -> list[Transition]:
        """Fail every restart whose startup grace ran out before it was proven, but those
        of ``sparing``: backends whose restart command the caller still runs (the grace
        is the new process's, and counts from the command's end: ``RestartRan``).

        Without this a restart that never reports back would leave the backend RESTARTING
        for ever, and a replacement that dies again or never answers would stay STALE for
        ever: never retried, as neither is DEAD, and never retired, as that is driven by
        restart attempts.
        """
        return [
            self.apply(name, StartupExpired(now=now))
            for name in self.overdue(now)
            if name not in sparing
        ]

    def overdue(self, now: float) -> list[str]:
        """The backends ``expire_restarts`` would fail now, sparing none, in name order."""
        grace = self._policy.startup_grace
        return [b.name for b in self._sorted() if _overdue_restart(b, now, grace) is not None]

    def add(self, name: str, url: str, now: float, *, retired_because: str | None = None) -> None:
        """Add a newly configured backend, HEALTHY (see the class docstring for why), or
        RETIRED for the given reason: an operator's retirement that outlived a config
        edit. A RETIRED one joins outside the serving set, so the epoch stays put."""
        _as_time(now, "now")
        b = _Backend(name=name, url=url, state_since=now)
        if retired_because is not None:
            _record(b, Retire(now=now, reason=retired_because))
            b.state = State.RETIRED
        self._insert(b, "add")
        if b.state in SERVING:
            self._epoch += 1

    def readdress(self, moves: Mapping[str, str]) -> None:
        """Backends the configuration moved to new addresses (name -> URL), all at once,
        so two that swap addresses pass. Not an event: each keeps its state, streaks and
        history (a condemned or retired backend stays so, whatever its address), and what
        answers at the new address is judged by the caller's next read of it, against
        the process it last saw there (``fleet.FleetRecord``)."""
        staying = {_url_key(b.url): b.name for b in self._backends.values() if b.name not in moves}
        arriving: dict[str, str] = {}
        for name, url in moves.items():
            self._lookup(name)
            _check_url(url, name, "readdress")
            other = staying.get(_url_key(url)) or arriving.get(_url_key(url))
            if other is not None:
                raise ValueError(
                    f"readdress: backends {other!r} and {name!r} share the URL {url!r}"
                )
            arriving[_url_key(url)] = name
        for name in moves:
            self._forget_url(self._backends[name])
        for name, url in moves.items():
            self._backends[name].url = url
            self._by_url[_url_key(url)] = name

    def rename(self, old: str, new: str) -> None:
        """A backend the configuration now calls by another name at the same address. Not
        an event: it keeps its state, streaks and history, and the epoch stays (the
        serving set is the same servers)."""
        b = self._lookup(old)
        if not isinstance(new, str) or not new:
            raise ValueError(f"rename: a backend name must be a non-empty string, got {new!r}")
        if new in self._backends:
            raise ValueError(f"rename: backend name {new!r} is taken")
        del self._backends[old]
        b.name = new
        self._backends[new] = b
        if self._by_url.get(_url_key(b.url)) == old:
            self._by_url[_url_key(b.url)] = new

    def entry(self, name: str) -> dict[str, object]:
        """One backend's entry as the state holds it, for ``restore``."""
        return _entry_dict(self._lookup(name))

    def restore(self, entry: object, url: str) -> State:
        """Take back, at ``url``, a backend ``entry`` gave that left the config out of the
        serving set: as it was (its state, the cause and process it was condemned for,
        its restarts), so the restart policy and recovery in place go on with it. Out of
        the serving set, it leaves the epoch alone. ValueError when the entry is malformed
        or serving, or its URL is another backend's."""
        b = _parse_backend(entry, "restore")
        if b.state in SERVING:
            raise ValueError(f"restore {b.name!r}: only a backend out of the serving set")
        b.url = url
        self._insert(b, "restore")
        return b.state

    def remove(self, name: str) -> None:
        """Forget a backend that left the configuration."""
        b = self._lookup(name)
        del self._backends[name]
        self._forget_url(b)
        if b.state in SERVING:
            self._epoch += 1

    # --- views ------------------------------------------------------------------------

    @property
    def policy(self) -> LedgerPolicy:
        return self._policy

    @property
    def epoch(self) -> int:
        """Membership epoch: moves by one each time the serving set changes, and only then."""
        return self._epoch

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(sorted(self._backends))

    def __contains__(self, name: object) -> bool:
        """Is this backend a member: without sorting every name, as ``names`` does (a
        settle asks once per verdict; over 10,000 backends that was seconds a cycle)."""
        return name in self._backends

    @property
    def serving(self) -> tuple[str, ...]:
        return self._names_in(SERVING)

    @property
    def absent(self) -> tuple[str, ...]:
        return self._names_in(ABSENT)

    @property
    def awaiting_readmission(self) -> frozenset[str]:
        """STALE: out of the serving set until re-admitted (by an answered tiny request,
        or an operator or trainer), so a reader asks them whenever they are idle; and those
        ``awaiting_an_answer``. Unsorted: every settle of ``watch`` asks, over the whole
        fleet."""
        stale = (b.name for b in self._backends.values() if b.state is State.STALE)
        return self.awaiting_an_answer.union(stale)

    @property
    def awaiting_an_answer(self) -> frozenset[str]:
        """DEAD backends whose request failures only an answered request clears (condemned
        by real traffic, or ``unanswered``) when they may come back in place, so a reader
        asks them whenever they are idle too: the router sends them nothing, and asked
        only when no request had finished since the last read, requests from elsewhere
        landing between our reads kept them DEAD for as long as they came, though their
        same process proved itself at every read. The library's ``Prober`` asks these."""
        if not self.policy.recover_in_place:
            return frozenset()
        return frozenset(
            b.name
            for b in self._backends.values()
            if b.state is State.DEAD and b.request_failures > 0 and not b.caller_condemned
        )

    @property
    def retired(self) -> frozenset[str]:
        """RETIRED: out for good, so a reader leaves their request slots alone (an
        operator may have taken the server for something else). Unsorted, as above."""
        return frozenset(b.name for b in self._backends.values() if b.state is State.RETIRED)

    @property
    def suspected(self) -> tuple[str, ...]:
        """SUSPECT, or STALE having been SUSPECT when a weight sync broke.

        Not for routing: for a caller with independent evidence that something stopped
        taking part, asking which backend the ledger already doubted.
        """
        return tuple(
            b.name
            for b in self._sorted()
            if b.state is State.SUSPECT
            or (b.state is State.STALE and b.state_before_partial is State.SUSPECT)
        )

    @property
    def counts(self) -> dict[State, int]:
        counts = dict.fromkeys(State, 0)
        for b in self._backends.values():
            counts[b.state] += 1
        return counts

    @property
    def floor_breached(self) -> bool:
        """Fewer serving than ``min_healthy``; never for a ledger of no backends (a run
        over proxies alone has none to fall short with)."""
        return bool(self._backends) and len(self.serving) < self._policy.min_healthy

    @property
    def floor_message(self) -> str:
        """Serving count against the floor, and every backend's state and last error."""
        serving, total = len(self.serving), len(self._backends)
        floor = self._policy.min_healthy
        if self.floor_breached:
            head = f"floor breached: {serving} of {total} backends serving, min_healthy is {floor}"
        else:
            head = f"{serving} of {total} backends serving, min_healthy is {floor}"
        if not self._backends:
            return f"{head}: no backends configured"
        parts = [
            f"{b.name} {b.state}" + (f" (last error: {b.last_error})" if b.last_error else "")
            for b in self._sorted()
        ]
        return f"{head}: " + "; ".join(parts)

    @property
    def metrics(self) -> dict[str, int]:
        """Flat numbers for an exporter or a JSON status."""
        flat = {
            "backends": len(self._backends),
            "serving": len(self.serving),
            "absent": len(self.absent),
            "epoch": self._epoch,
            "floor_breached": int(self.floor_breached),
        }
        flat.update({str(state): n for state, n in self.counts.items()})
        return flat

    def state_of(self, name: str) -> State:
        return self._lookup(name).state

    def condemned_by(self, name: str) -> str | None:
        """What last condemned it (None once it served): a snapshot's, without making one."""
        return self._lookup(name).condemned_by

    def restart_ran_at(self, name: str) -> float | None:
        """When the last restart's command exited 0 (``RestartRan``), if it did."""
        return self._lookup(name).restart_ran_at

    def restart_stamped_at(self, name: str) -> float | None:
        """The time the last restart was issued at, if ``pull_back`` took it back since."""
        return self._lookup(name).restart_stamped_at

    def restarted_from(self, name: str) -> ProcessSeen | None:
        """The process the last restart replaced, as it was last read, if it was."""
        return self._lookup(name).restarted_from

    def restart_unproven(self, name: str, now: float, *, in_grace: bool = False) -> bool:
        """Restarted, and the replacement has been neither re-admitted nor seen working
        (nor has its startup grace run out): a restart still under way, as far as
        ``max_concurrent_restarts`` counts. A replacement that came up and then fails as
        its predecessor did must not free the slot for the next backend: a fault they
        share would restart them all. So a backend DEAD again within the startup grace
        of its last restart, on its replacement (a new process seen since the restart, or
        one that differs from the process it replaced), good at no time since, still
        holds it, unless its budget is spent (its next attempt retires it, which starts
        nothing). A restart whose command failed brought up no replacement: it holds
        nothing, as before. ``in_grace``: its caller saw the restart's command end less
        than the startup grace ago on a steady clock (``settle``'s in_grace): a wall clock
        stepped forward since freed the slot, and the next backend was restarted.
        """
        b = self._lookup(name)
        if _awaited_restart(b, self._policy.startup_grace) is not None:
            return True
        if b.state is not State.DEAD or not b.restart_times or b.process is None:
            return False
        policy = self._policy
        restarted_at = max(b.restart_times)
        replaced = _replaced_since(b, restarted_at)
        proven = b.last_ok_at is not None and b.last_ok_at > restarted_at
        spent = sum(_in_window(t, now, policy.restart_budget_window) for t in b.restart_times)
        return (
            replaced
            and not proven
            and (in_grace or now - _grace_from(b, restarted_at) < policy.startup_grace)
            and spent < policy.restart_budget
        )

    def snapshot(self, name: str, now: float) -> BackendSnapshot:
        """``now`` only decides which restart attempts still count against the budget."""
        b = self._lookup(name)
        window = self._policy.restart_budget_window
        return BackendSnapshot(
            name=b.name,
            url=b.url,
            state=b.state,
            probe_failures=b.probe_failures,
            request_failures=b.request_failures,
            good_streak=b.good_streak,
            restart_attempts=sum(1 for t in b.restart_times if _in_window(t, now, window)),
            last_restart_at=max(b.restart_times, default=None),
            last_ok_at=b.last_ok_at,
            last_error=b.last_error,
            weight_version=b.weight_version,
            condemned_by=b.condemned_by,
            state_since=b.state_since,
            state_before_partial=b.state_before_partial,
            in_place_recoveries=sum(1 for t in b.recovery_times if _in_window(t, now, window)),
            restart_ran_at=b.restart_ran_at,
            traffic_failures=b.traffic_failures,
            replaced_while_dead=b.replaced_while_dead,
            caller_condemned=b.caller_condemned,
        )

    def snapshots(
        self, now: float, states: frozenset[State] | None = None
    ) -> list[BackendSnapshot]:
        """Every backend's snapshot in name order, or only those in ``states``: a settle
        looks at the DEAD ones twice, and at 10,000 backends a snapshot of every one, each
        time, was a fifth of its CPU (bench/README.md)."""
        return [
            self.snapshot(b.name, now)
            for b in self._sorted()
            if states is None or b.state in states
        ]

    def url_of(self, name: str) -> str:
        return self._lookup(name).url

    def by_url(self, url: str) -> str | None:
        """The backend behind a URL, for failures reported by a router that knows only URLs."""
        return self._by_url.get(_url_key(url))

    # --- persistence ------------------------------------------------------------------

    def to_dict(self) -> dict[str, object]:
        """A JSON-compatible copy of the whole ledger; the policy is not part of it."""
        return {**self.to_document(), "backends": [_entry_dict(b) for b in self._sorted()]}

    def to_document(self) -> dict[str, object]:
        """``to_dict()``, its entries made as they are written (rows.py): what a save
        writes, without every entry's copy in memory at once."""
        return {
            "schema": SCHEMA,
            "epoch": self._epoch,
            "backends": Rows(self._sorted(), _entry_dict),
        }

    @classmethod
    def from_dict(cls, data: object, policy: LedgerPolicy) -> Ledger:
        """Rebuild a ledger from to_dict() output; anything malformed is a ValueError saying
        where and what, so a damaged state file is reported instead of half-loaded."""
        top = _as_record(data, "ledger", _TOP_KEYS)
        schema = _as_int(top["schema"], "schema")
        if schema != SCHEMA:
            raise ValueError(f"schema: expected {SCHEMA}, got {schema}")
        ledger = cls(policy)
        ledger._epoch = _as_int(top["epoch"], "epoch")
        items = top["backends"]
        if not isinstance(items, list):
            raise ValueError(f"backends: expected a list, got {_type_name(items)}")
        for i, item in enumerate(items):
            where = f"backends[{i}]"
            ledger._insert(_parse_backend(item, where), where, saved=True)
        return ledger

    # --- internals --------------------------------------------------------------------

    def _lookup(self, name: str) -> _Backend:
        try:
            return self._backends[name]
        except KeyError:
            raise UnknownBackend(f"no backend named {name!r} in the ledger") from None

    def _check_url_free(self, url: str, name: str) -> None:
        """A RETIRED backend's address is free: it is out for good, never sent a request,
        and a replacement bound where its process was must not be refused."""
        other = self.by_url(url)
        if other is not None and other != name and self._backends[other].state is not State.RETIRED:
            raise ValueError(f"{name!r} cannot move to {url!r}: backend {other!r} is there")

    def _url_taken(self, b: _Backend) -> bool:
        """Whether another backend holds the address this (RETIRED) one still names. A
        RETIRED holder does not (``_check_url_free``): which of two held the lookup
        depended on whether the record had been saved and loaded since."""
        holder = self.by_url(b.url)
        return (
            holder is not None
            and holder != b.name
            and self._backends[holder].state is not State.RETIRED
        )

    def _forget_url(self, b: _Backend) -> None:
        """Free b's address, unless another now holds it (a RETIRED b's taken address).
        Another backend still at it (a RETIRED one, or the other spelling a record of an
        older version kept) takes the lookup, a serving one first: dropped, failures a
        router reported by that URL reached no backend."""
        key = _url_key(b.url)
        if self._by_url.get(key) != b.name:
            return
        del self._by_url[key]
        if key not in self._shared_urls:
            return
        still = [o for o in self._sorted() if o is not b and _url_key(o.url) == key]
        for other in sorted(still, key=lambda o: o.state is State.RETIRED):
            self._by_url[key] = other.name
            return

    def _move(self, b: _Backend, url: str) -> None:
        self._forget_url(b)
        b.url = url
        if self._by_url.get(_url_key(url), b.name) != b.name:
            self._shared_urls.add(_url_key(url))  # a RETIRED backend's address, taken
        self._by_url[_url_key(url)] = b.name

    def _insert(self, b: _Backend, where: str, *, saved: bool = False) -> None:
        if not isinstance(b.name, str) or not b.name:
            raise ValueError(f"{where}: a backend name must be a non-empty string, got {b.name!r}")
        _check_url(b.url, b.name, where)
        if b.name in self._backends:
            raise ValueError(f"{where}: backend name {b.name!r} appears twice")
        # Two names for one URL would make by_url() ambiguous and double-count one server;
        # a RETIRED one may keep an address a replacement took (``_check_url_free``).
        other = self.by_url(b.url)
        retired = (b.state is State.RETIRED) or (
            other is not None and self._backends[other].state is State.RETIRED
        )
        # A record saved before URLs compared case-blind may hold one server written two
        # ways: loaded, the first keeps the lookup, and the config (which refuses them
        # both) decides which stays; refused, the whole record was set aside as corrupt.
        spelled_apart = (
            saved
            and other is not None
            and self._backends[other].url.rstrip("/") != b.url.rstrip("/")
        )
        if other is not None and not (retired or spelled_apart):
            raise ValueError(f"{where}: backends {other!r} and {b.name!r} share the URL {b.url!r}")
        if other is not None:
            self._shared_urls.add(_url_key(b.url))
        self._backends[b.name] = b
        # The lookup goes to a backend that may be sent work: a RETIRED one keeps it only
        # while nobody else holds the address (a reset is then refused while it is taken).
        if other is None or (
            b.state is not State.RETIRED and self._backends[other].state is State.RETIRED
        ):
            self._by_url[_url_key(b.url)] = b.name

    def _sorted(self) -> list[_Backend]:
        return [self._backends[name] for name in sorted(self._backends)]

    def _names_in(self, states: frozenset[State]) -> tuple[str, ...]:
        return tuple(b.name for b in self._sorted() if b.state in states)


# --- helpers ----------------------------------------------------------------------------


def _check_url(url: object, name: str, where: str) -> None:
    """A backend's address as the ledger keeps it: a non-empty string with no user info
    (a password in a URL would be stored, printed and logged with it)."""
    if not isinstance(url, str) or not url:
        raise ValueError(f"{where}: backend {name!r} needs a non-empty URL, got {url!r}")
    try:
        refuse_user_info(url)
    except ValueError as exc:
        raise ValueError(f"{where}: backend {name!r}: {exc}") from None


def is_finite_number(value: object) -> bool:
    """A number a float can hold: not a bool, NaN, infinity, or an integer past 1e308.

    State files are JSON, whose integers have no bound; math.isfinite raises
    OverflowError on a huge one, and that must read as bad data, not as a crash.
    """
    if isinstance(value, bool) or not isinstance(value, int | float):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


# Seconds a backend's host clock may run behind ours when its process's start time is
# compared with when we restarted it (a replacement starts after the command, on its host);
# and a record's times may run ahead of our clock before ``pull_back`` takes them as now.
CLOCKS_APART: Final = 60.0


# How far apart the times ``pulled_back`` takes back are set: their order is kept.
_PULLED_APART: Final = 0.001


def pulled_back(times: Iterable[float | None], now: float) -> dict[float, float] | None:
    """How one backend's times later than ``now`` are taken back, when one of them is more
    than ``CLOCKS_APART`` ahead (None otherwise): each to just before ``now``, in their
    order, equal ones equal (a RESTARTING spell's start is its restart's stamp), and all
    before what this settle stamps at ``now``."""
    ahead = sorted({t for t in times if t is not None and t > now})
    if not ahead or ahead[-1] <= now + CLOCKS_APART:
        return None
    return {t: now - (len(ahead) - i) * _PULLED_APART for i, t in enumerate(ahead)}


def _taken(t: float | None, taken: Mapping[float, float]) -> float | None:
    return None if t is None else taken.get(t, t)


def _in_window(t: float, now: float, window: float) -> bool:
    # An attempt stamped after ``now`` (the wall clock stepped back) still counts: when in
    # doubt, the budget errs towards restarting less.
    return now - t < window


def _span(seconds: float) -> str:
    for unit, size in (("h", 3600), ("m", 60)):
        if seconds >= size and seconds % size == 0:
            return f"{int(seconds // size)}{unit}"
    return f"{seconds:g}s"


def _error_text(reason: str, detail: str) -> str:
    return f"{reason}: {detail}" if detail else reason


def _url_key(url: str) -> str:
    return same_server(url)


def _type_name(value: object) -> str:
    return "null" if value is None else type(value).__name__


_TOP_KEYS: Final = frozenset({"schema", "epoch", "backends"})
_BACKEND_KEYS: Final = frozenset(
    {
        "name",
        "url",
        "state",
        "probe_failures",
        "request_failures",
        "good_streak",
        "restart_times",
        "last_ok_at",
        "last_error",
        "weight_version",
        "condemned_by",
        "state_since",
    }
)
# Keys added after schema 1 was first written: absent in older files, so not required.
_LATER_BACKEND_KEYS: Final = frozenset(
    {
        "state_before_partial",
        "process",
        "recovery_times",
        "restart_ran_at",
        "traffic_failures",
        "restarted_from",
        "replaced_while_dead",
        "replaced_since_restart",
        "caller_condemned",
        "restart_stamped_at",
        "replaced_before_restart",
        "ran_before_restart",
    }
)


def _as_record(
    value: object, where: str, keys: frozenset[str], later: frozenset[str] = frozenset()
) -> dict[str, object]:
    """A saved object's keys: ``keys`` required, ``later`` optional, any other passed over.

    A key this build does not know was added by a later one within the same schema, as
    ``later``'s were: refused, the whole state was set aside as corrupt on a rollback and
    a fresh ledger started, a retired GPU serving again and every hold gone. A change an
    older build must not pass over raises ``SCHEMA`` instead."""
    if not isinstance(value, dict):
        raise ValueError(f"{where}: expected an object, got {_type_name(value)}")
    record: dict[str, object] = {}
    for key, item in value.items():
        if not isinstance(key, str):
            raise ValueError(f"{where}: keys must be strings, got {key!r}")
        if key in keys or key in later:
            record[key] = item
    missing = sorted(keys - record.keys())
    if missing:
        raise ValueError(f"{where}: missing key {missing[0]!r}")
    return record


def _as_int(value: object, where: str) -> int:
    """A count from a saved record: a whole number from 0 to 2**53 (what every JSON reader
    keeps exact). ``10**400`` loaded, and the /metrics page and the library's
    ``as_metrics`` raised OverflowError on it: bad data, not a crash."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{where}: expected an integer, got {value!r}")
    if not 0 <= value <= _LARGEST_COUNT:
        raise ValueError(f"{where}: must be from 0 to 2**53, got {str(value)[:20]}")
    return value


_LARGEST_COUNT: Final = 2**53


def _as_bool(value: object, where: str) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{where}: expected true or false, got {value!r}")
    return value


def _as_time(value: object, where: str) -> float:
    if not is_finite_number(value):
        raise ValueError(f"{where}: expected a finite number of seconds, got {value!r}")
    assert isinstance(value, int | float)  # narrowed by _is_number, for mypy
    return float(value)


def _as_optional_time(value: object, where: str) -> float | None:
    return None if value is None else _as_time(value, where)


def _as_str(value: object, where: str) -> str:
    if not isinstance(value, str):
        raise ValueError(f"{where}: expected a string, got {_type_name(value)}")
    return value


def _times(value: object, where: str) -> list[float]:
    if not isinstance(value, list):
        raise ValueError(f"{where}: expected a list, got {_type_name(value)}")
    return [_as_time(t, f"{where}[{i}]") for i, t in enumerate(value)]


def _process_dict(process: ProcessSeen) -> dict[str, object]:
    return {"start": process.start, "counters": dict(sorted(process.counters.items()))}


def _parse_process(value: object, where: str) -> ProcessSeen | None:
    if value is None:
        return None
    r = _as_record(value, where, frozenset({"start", "counters"}))
    counters = r["counters"]
    if not isinstance(counters, dict):
        raise ValueError(f"{where}.counters: expected an object, got {_type_name(counters)}")
    return ProcessSeen(
        start=_as_optional_time(r["start"], f"{where}.start"),
        counters={
            _as_str(name, f"{where}.counters"): _as_time(v, f"{where}.counters.{name}")
            for name, v in counters.items()
        },
    )


def _parse_backend(value: object, where: str) -> _Backend:
    r = _as_record(value, where, _BACKEND_KEYS, _LATER_BACKEND_KEYS)
    raw_state = r["state"]
    if not isinstance(raw_state, str) or raw_state not in set(State):
        allowed = ", ".join(State)
        raise ValueError(f"{where}.state: {raw_state!r} is not a state (expected one of {allowed})")
    state = State(raw_state)
    raw_before = r.get("state_before_partial")
    before_partial = None
    if raw_before is not None:
        if state is not State.STALE or raw_before not in (State.HEALTHY, State.SUSPECT):
            raise ValueError(
                f"{where}.state_before_partial: {raw_before!r} can only be healthy or suspect, "
                "on a stale backend"
            )
        before_partial = State(str(raw_before))
    weight = r["weight_version"]
    # Any integer a saved record holds (JSON's own bound, 4,300 digits, is writable back):
    # a build before the 64-bit bound saved larger ones, and a record refused is set aside
    # whole, every hold and retirement with it. Only new versions are bounded.
    if weight is not None and (isinstance(weight, bool) or not isinstance(weight, int)):
        raise ValueError(f"{where}.weight_version: expected an integer or null, got {weight!r}")
    condemned_by = r["condemned_by"]
    if condemned_by is not None:
        condemned_by = _as_str(condemned_by, f"{where}.condemned_by")
    b = _Backend(
        name=_as_str(r["name"], f"{where}.name"),
        url=_as_str(r["url"], f"{where}.url"),
        state=state,
        probe_failures=_as_int(r["probe_failures"], f"{where}.probe_failures"),
        request_failures=_as_int(r["request_failures"], f"{where}.request_failures"),
        good_streak=_as_int(r["good_streak"], f"{where}.good_streak"),
        restart_times=_times(r["restart_times"], f"{where}.restart_times"),
        last_ok_at=_as_optional_time(r["last_ok_at"], f"{where}.last_ok_at"),
        last_error=_as_str(r["last_error"], f"{where}.last_error"),
        weight_version=weight,
        condemned_by=None
        if condemned_by is None
        else _as_str(condemned_by, f"{where}.condemned_by"),
        state_since=_as_optional_time(r["state_since"], f"{where}.state_since"),
        state_before_partial=before_partial,
        process=_parse_process(r.get("process"), f"{where}.process"),
        restarted_from=_parse_process(r.get("restarted_from"), f"{where}.restarted_from"),
        replaced_while_dead=None
        if r.get("replaced_while_dead") is None
        else _as_bool(r["replaced_while_dead"], f"{where}.replaced_while_dead"),
        replaced_since_restart=_as_bool(
            r.get("replaced_since_restart", False), f"{where}.replaced_since_restart"
        ),
        recovery_times=_times(r.get("recovery_times", []), f"{where}.recovery_times"),
        restart_ran_at=_as_optional_time(r.get("restart_ran_at"), f"{where}.restart_ran_at"),
        traffic_failures=_as_int(r.get("traffic_failures", 0), f"{where}.traffic_failures"),
        caller_condemned=_as_bool(r.get("caller_condemned", False), f"{where}.caller_condemned"),
        restart_stamped_at=_as_optional_time(
            r.get("restart_stamped_at"), f"{where}.restart_stamped_at"
        ),
        replaced_before_restart=None
        if r.get("replaced_before_restart") is None or state is not State.RESTARTING
        else _as_bool(r["replaced_before_restart"], f"{where}.replaced_before_restart"),
        ran_before_restart=None
        if state is not State.RESTARTING
        else _as_optional_time(r.get("ran_before_restart"), f"{where}.ran_before_restart"),
    )
    # Invariants the transitions keep; data breaking them was not written by this ledger.
    if b.state is State.HEALTHY and (b.probe_failures or b.request_failures):
        raise ValueError(f"{where}: a healthy backend cannot have a failure streak")
    if b.traffic_failures > b.request_failures:
        raise ValueError(f"{where}.traffic_failures: more than its request_failures")
    if b.state is State.RESTARTING and b.state_since is None:
        raise ValueError(f"{where}.state_since: a restarting backend needs the time of its restart")
    return b


def _entry_dict(b: _Backend) -> dict[str, object]:
    """One ledger entry as the state document holds it."""
    entry: dict[str, object] = {
        "name": b.name,
        "url": b.url,
        "state": str(b.state),
        "probe_failures": b.probe_failures,
        "request_failures": b.request_failures,
        "good_streak": b.good_streak,
        "restart_times": list(b.restart_times),
        "last_ok_at": b.last_ok_at,
        "last_error": b.last_error,
        "weight_version": b.weight_version,
        "condemned_by": b.condemned_by,
        "state_since": b.state_since,
        "state_before_partial": None
        if b.state_before_partial is None
        else str(b.state_before_partial),
        "process": None if b.process is None else _process_dict(b.process),
        "restarted_from": None if b.restarted_from is None else _process_dict(b.restarted_from),
        "replaced_while_dead": b.replaced_while_dead,
        "replaced_since_restart": b.replaced_since_restart,
        "recovery_times": list(b.recovery_times),
        "restart_ran_at": b.restart_ran_at,
        "traffic_failures": b.traffic_failures,
    }
    # Written only when set, which only the library's verbs do: the state files `check`
    # and `watch` write keep the layout an earlier build reads (one refuses a key it does
    # not know, and a state refused is set aside, its ledger started afresh).
    if b.caller_condemned:
        entry["caller_condemned"] = True
    if b.restart_stamped_at is not None:  # likewise: only after a clock stepped back
        entry["restart_stamped_at"] = b.restart_stamped_at
    if b.replaced_before_restart is not None:  # likewise: only while RESTARTING again
        entry["replaced_before_restart"] = b.replaced_before_restart
    if b.ran_before_restart is not None:  # likewise
        entry["ran_before_restart"] = b.ran_before_restart
    return entry
