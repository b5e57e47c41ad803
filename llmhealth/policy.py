"""Remediation policy: which DEAD backends may be restarted now, and why the others may not.

Pure: the ledger, the configuration, holds and restart histories go in with ``now``; one
decision per DEAD backend comes out, each with a reason an operator can read. Nothing here
runs a command, reads a clock or touches a file; the shell acts on the plan.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from enum import StrEnum
from typing import TYPE_CHECKING, Final

from llmhealth.ledger import CONDEMNED, BackendSnapshot, Ledger, is_finite_number

if TYPE_CHECKING:
    # Types only: config reads files, and importing it at run time would pull that in.
    from llmhealth.config import Backend, Policy


class Action(StrEnum):
    """What the shell does with one DEAD backend.

    For RESTART and RETIRE alike the shell feeds ``RestartIssued`` to the ledger and runs
    the restart command only if the ledger answers RESTARTING. The ledger, not this plan,
    enforces the restart budget; RETIRE says in advance that it will refuse the attempt.
    """

    RESTART = "restart"  # run the restart command now
    RETIRE = "retire"  # the restart budget is spent: the attempt retires it, nothing runs
    SKIP = "skip"  # leave it DEAD for now; the reason says why


@dataclass(frozen=True, slots=True)
class RestartDecision:
    name: str
    action: Action
    reason: str
    condemned_by: str | None  # the verdict that condemned it, as the ledger recorded it

    @property
    def act(self) -> bool:
        """True when the shell must feed RestartIssued (a restart, or a retirement)."""
        return self.action is not Action.SKIP

    def to_dict(self) -> dict[str, object]:
        return {
            "backend": self.name,
            "action": str(self.action),
            "reason": self.reason,
            "condemned_by": self.condemned_by,
        }


@dataclass(frozen=True, slots=True)
class Hold:
    """An operator or trainer asked that a backend be left alone until ``until``, e.g. for
    a weight sync. Verdicts are still recorded; only remediation waits."""

    reason: str
    until: float  # unix seconds
    by: str

    def __post_init__(self) -> None:
        _check_text(self.reason, "Hold.reason")
        _check_text(self.by, "Hold.by")
        _check_time(self.until, "Hold.until")

    def active(self, now: float) -> bool:
        return now < self.until

    def describe(self, now: float) -> str:
        return f"on hold until {_utc_clock(self.until, now)} by {self.by}: {self.reason}"

    def to_dict(self) -> dict[str, object]:
        return {"reason": self.reason, "until": self.until, "by": self.by}

    @classmethod
    def from_dict(cls, data: object, where: str = "hold") -> Hold:
        """A ValueError naming ``where`` and the key for anything to_dict() did not write."""
        r = _record(data, where, _HOLD_KEYS)
        return cls(
            reason=_text(r["reason"], f"{where}.reason"),
            until=_time(r["until"], f"{where}.until"),
            by=_text(r["by"], f"{where}.by"),
        )


@dataclass(frozen=True, slots=True)
class RestartHistory:
    """What the cooldown needs about one backend's restarts.

    ``failures`` counts failed attempts in a row; the shell records an attempt when it
    feeds RestartIssued, a failure when it feeds RestartFailed, and a success on
    re-admission, which is the only proof that the restart worked.
    """

    failures: int = 0
    last_attempt_at: float | None = None

    def __post_init__(self) -> None:
        _count(self.failures, "RestartHistory.failures")
        if self.last_attempt_at is not None:
            _check_time(self.last_attempt_at, "RestartHistory.last_attempt_at")

    def record_attempt(self, now: float) -> RestartHistory:
        return replace(self, last_attempt_at=now)

    def record_failure(self) -> RestartHistory:
        return replace(self, failures=self.failures + 1)

    def record_success(self) -> RestartHistory:
        # The attempt time stays: a backend that wedges again right after re-admission
        # still waits the base cooldown before the next restart.
        return replace(self, failures=0)

    def to_dict(self) -> dict[str, object]:
        return {"failures": self.failures, "last_attempt_at": self.last_attempt_at}

    @classmethod
    def from_dict(cls, data: object, where: str = "restart history") -> RestartHistory:
        """A ValueError naming ``where`` and the key for anything to_dict() did not write."""
        r = _record(data, where, _HISTORY_KEYS)
        last = r["last_attempt_at"]
        return cls(
            failures=_count(r["failures"], f"{where}.failures"),
            last_attempt_at=None if last is None else _time(last, f"{where}.last_attempt_at"),
        )


def cooldown_for(failures: int, policy: Policy) -> float:
    """Seconds to wait after an attempt: ``policy.cooldown`` after one that has not failed
    (it is in flight, or succeeded), doubled for each failed attempt in a row, capped at
    ``policy.cooldown_max``. With the defaults: 1m, 2m, 4m, 8m, 16m, 30m, 30m, ..."""
    _count(failures, "failures")
    # Past 64 doublings any sane cap has long been reached; stopping there keeps the
    # power finite for whatever count a long-lived state file holds.
    return min(policy.cooldown * 2.0 ** min(failures, 64), policy.cooldown_max)


def plan_restarts(
    ledger: Ledger,
    backends: Mapping[str, Backend],
    holds: Mapping[str, Hold],
    histories: Mapping[str, RestartHistory],
    policy: Policy,
    now: float,
    commands_running: Collection[str] = frozenset(),
    unread: Collection[str] = frozenset(),
    in_grace: Collection[str] = frozenset(),
) -> list[RestartDecision]:
    """One decision per DEAD backend, in name order.

    A backend is restarted only if every rule below lets it, checked in this order (the
    first that refuses gives the reason): it is a configured backend (a name missing from
    ``backends`` - a proxy, or one dropped from the config - never is); its condemning
    verdict is in ``policy.restart_on``; it has a restart command; it is not on an active
    hold; no restart command of its own still runs (``commands_running``: a restart whose
    startup grace ran out before its command ended, a ``restart_timeout`` past the grace or
    a command that outlived its kill, is still under way, and a second command at once
    would fight the first); it has been read since a reload moved it to another server
    (``unread``: the wedge was proven on the server it left, and the first read of the new
    one tells whether that is another process); its cooldown has passed; its restart
    budget is not spent (if it is, the decision is RETIRE); and fewer than
    ``policy.max_concurrent_restarts`` restarts are under way, counting the other backends
    whose restart has not proven itself yet (RESTARTING, or STALE on the replacement until
    it is re-admitted, seen finishing requests, or out of its startup grace, or DEAD again
    within that grace), the backends whose restart command still runs, and the restarts
    planned earlier in this same call.

    A RETIRE neither waits for nor takes a concurrency slot, as it starts no process; it
    does wait out the hold, its running command and the cooldown, since it stands for the
    next attempt (and what that command brings up must not be left unwatched).
    """
    _check_time(now, "now")
    # A backend's own unproven restart does not keep it from the next (its cooldown and
    # budget rule that); its own command still running does (``_decide``).
    # ``in_grace``: restarts whose command the caller saw end within the startup grace on
    # a steady clock, DEAD again on their replacement: a wall clock stepped forward does
    # not end their grace (``Ledger.restart_unproven``).
    under_way = {
        name
        for name in ledger.names
        if ledger.restart_unproven(name, now, in_grace=name in in_grace)
    }
    under_way.update(commands_running)  # a name a reload dropped counts as well
    decisions: list[RestartDecision] = []
    for snap in ledger.snapshots(now, CONDEMNED):
        action, reason = _decide(
            snap,
            backends.get(snap.name),
            holds.get(snap.name),
            histories.get(snap.name, RestartHistory()),
            ledger,
            policy,
            len(under_way - {snap.name}),
            now,
            command_running=snap.name in commands_running,
            unread=snap.name in unread,
        )
        if action is Action.RESTART:
            under_way.add(snap.name)  # planned now: once, if it held a slot already
        decisions.append(RestartDecision(snap.name, action, reason, snap.condemned_by))
    return decisions


def cooldown_ends_at(
    history: RestartHistory, last_restart_at: float | None, policy: Policy
) -> float | None:
    """When the next attempt may start; None if there was no attempt to cool down from.

    The later of the history's attempt and the ledger's last restart counts, so a history
    lost with an old state file cannot make the policy restart sooner.
    """
    times = [t for t in (history.last_attempt_at, last_restart_at) if t is not None]
    if not times:
        return None
    return max(times) + cooldown_for(history.failures, policy)


def restart_pending(
    snap: BackendSnapshot,
    backend: Backend | None,
    hold: Hold | None,
    policy: Policy,
    now: float,
) -> bool:
    """Will the restart policy restart this DEAD backend, now or once its cooldown, its
    running command or a concurrency slot allows? Then its own process must not prove its
    way back meanwhile:
    the restart decides. Not when nothing would restart it (no command, a cause outside
    restart_on, an active hold): then recovery in place is its only way back."""
    return _not_restartable(snap, backend, hold, policy, now) is None


def _not_restartable(
    snap: BackendSnapshot,
    backend: Backend | None,
    hold: Hold | None,
    policy: Policy,
    now: float,
) -> str | None:
    """Why no restart will follow for now, whatever the time; None if one will."""
    if backend is None:
        return (
            "not a configured backend: only a [[backend]] with a restart command is "
            "restarted, never a proxy"
        )
    cause = snap.condemned_by
    if cause not in policy.restart_on:
        return (
            f"condemned by {cause or 'an unrecorded cause'}, "
            f"restart_on is [{', '.join(policy.restart_on)}]"
        )
    if not backend.restart:
        return "no restart command configured"
    if hold is not None and hold.active(now):
        return hold.describe(now)
    return None


def _decide(
    snap: BackendSnapshot,
    backend: Backend | None,
    hold: Hold | None,
    history: RestartHistory,
    ledger: Ledger,
    policy: Policy,
    under_way: int,
    now: float,
    *,
    command_running: bool,
    unread: bool = False,
) -> tuple[Action, str]:
    refusal = _not_restartable(snap, backend, hold, policy, now)
    if refusal is not None:
        return Action.SKIP, refusal
    if command_running:
        return Action.SKIP, "its last restart command still runs"
    if unread:
        return Action.SKIP, f"moved to {snap.url}: not read there yet"
    cause = snap.condemned_by
    ready_at = cooldown_ends_at(history, snap.last_restart_at, policy)
    if ready_at is not None and now < ready_at:
        return Action.SKIP, (
            f"cooling down: {_span(ready_at - now)} left after {_attempts(history.failures)}"
        )
    # The ledger enforces the budget when RestartIssued arrives, so its policy and its
    # count of attempts inside the window are what predict the outcome.
    budget = ledger.policy.restart_budget
    window = _span(ledger.policy.restart_budget_window)
    if snap.restart_attempts >= budget:
        return Action.RETIRE, (
            f"restart budget spent: {_plural(snap.restart_attempts, 'attempt')} in {window} "
            f"(restart_budget {budget}): the next attempt retires it"
        )
    limit = policy.max_concurrent_restarts
    if under_way >= limit:
        return Action.SKIP, (
            f"{_plural(under_way, 'restart')} already under way (max_concurrent_restarts {limit})"
        )
    return Action.RESTART, (
        f"condemned by {cause}: restart {snap.restart_attempts + 1} of {budget} allowed in {window}"
    )


# --- words and checks -----------------------------------------------------------------

_HOLD_KEYS: Final = frozenset({"reason", "until", "by"})
_HISTORY_KEYS: Final = frozenset({"failures", "last_attempt_at"})


def _attempts(failures: int) -> str:
    return "the last attempt" if failures == 0 else _plural(failures, "failed attempt")


def _plural(n: int, noun: str) -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def _span(seconds: float) -> str:
    """A duration as an operator reads it: 1m40s, 24h, 45s. Rounded up, so a wait that
    is not over never reads as 0s."""
    total = max(math.ceil(seconds), 0)
    hours, rest = divmod(total, 3600)
    minutes, secs = divmod(rest, 60)
    parts = [f"{n}{unit}" for n, unit in ((hours, "h"), (minutes, "m"), (secs, "s")) if n]
    return "".join(parts) or "0s"


def _utc_clock(t: float, now: float) -> str:
    """Time of day in UTC, with the date when it is not today's (UTC)."""
    try:
        when = datetime.fromtimestamp(t, tz=UTC)
        today = datetime.fromtimestamp(now, tz=UTC).date()
    except (OverflowError, ValueError, OSError):
        return f"{t:.0f} (unix seconds)"
    clock = when.strftime("%H:%M" if when.second == 0 else "%H:%M:%S")
    return f"{clock} UTC" if when.date() == today else f"{when:%Y-%m-%d} {clock} UTC"


def _type_name(value: object) -> str:
    return "null" if value is None else type(value).__name__


def _record(data: object, where: str, keys: frozenset[str]) -> dict[str, object]:
    if not isinstance(data, dict):
        raise ValueError(f"{where}: expected an object, got {_type_name(data)}")
    # A key a later build added is passed over, as in a ledger entry (``ledger._as_record``).
    missing = sorted(keys - data.keys())
    if missing:
        raise ValueError(f"{where}: missing key {missing[0]!r}")
    return {str(k): v for k, v in data.items() if k in keys}


def _count(value: object, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{where}: expected a whole number, got {value!r}")
    if value < 0:
        raise ValueError(f"{where}: must not be negative, got {value}")
    return value


def _time(value: object, where: str) -> float:
    _check_time(value, where)
    assert isinstance(value, int | float)  # narrowed by _check_time, for mypy
    return float(value)


def _check_time(value: object, where: str) -> None:
    if not is_finite_number(value):
        raise ValueError(f"{where}: expected a finite number of seconds, got {value!r}")


def _text(value: object, where: str) -> str:
    _check_text(value, where)
    assert isinstance(value, str)  # narrowed by _check_text, for mypy
    return value


def _check_text(value: object, where: str) -> None:
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"{where}: expected a non-empty string, got {value!r}")
