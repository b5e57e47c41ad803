"""What real requests showed about each backend, kept in order until the next settle.

Pure and bounded. The router records one outcome per forwarded request; every settle
drains them into the ledger (``fleet.FleetRecord.observe_requests``) in the order they
happened, so the failure streak the ledger sees is the streak on the wire.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Final

# Per backend between two settles. A run of successes is kept as its first and its newest
# one (the ledger treats n answered requests in a row as one, ``RequestLog.record``), so
# mostly failures fill this; past it the oldest go, and by then the streak has long
# reached any sane unhealthy_threshold.
MAX_PENDING: Final = 256


class FailureKind(StrEnum):
    """How a forwarded request failed the backend. Never the client's doing."""

    REFUSED = "refused"  # no connection: refused, reset or unreachable before sending
    FIRST_BYTE_TIMEOUT = "first_byte_timeout"  # accepted, no response headers in time
    STREAM_IDLE = "stream_idle"  # a response that started, then went silent
    BROKEN = "broken"  # the connection broke or the response was not HTTP
    SERVER_ERROR = "server_error"  # the backend answered 5xx itself


@dataclass(frozen=True, slots=True)
class RequestOutcome:
    """One forwarded request as the ledger needs to hear of it. ``failure`` None: answered."""

    at: float  # wall seconds when the outcome was known
    method: str
    path: str
    failure: FailureKind | None = None
    status: int | None = None  # the backend's status, when it sent one
    detail: str = ""

    @property
    def ok(self) -> bool:
        return self.failure is None

    def describe(self) -> str:
        """One line for last_error and the audit log: what failed, on which request."""
        what = f"{self.failure}" + (f" HTTP {self.status}" if self.status is not None else "")
        tail = f": {self.detail}" if self.detail else ""
        return f"{what} on {self.method} {self.path}{tail}"

    def to_dict(self) -> dict[str, object]:
        return {
            "at": self.at,
            "method": self.method,
            "path": self.path,
            "failure": None if self.failure is None else str(self.failure),
            "status": self.status,
            "detail": self.detail,
        }


class RequestLog:
    """Outcomes per backend since the last drain, in order, bounded."""

    def __init__(self) -> None:
        self._pending: dict[str, deque[RequestOutcome]] = {}

    def record(self, backend: str, outcome: RequestOutcome) -> None:
        """Keep ``outcome``; a run of successes keeps its first one and its newest.

        Both ends, not the newest alone: a settle places each outcome before or after the
        backend's verdict by its time, and a run kept as its newest moved the answer that
        broke a failure streak past an unanswered tiny request, which then condemned."""
        queue = self._pending.setdefault(backend, deque(maxlen=MAX_PENDING))
        if outcome.ok and len(queue) >= 2 and queue[-1].ok and queue[-2].ok:
            queue[-1] = outcome
            return
        queue.append(outcome)

    def has_failure(self, backend: str) -> bool:
        """A failure recorded since the last drain: the router keeps that backend dropped."""
        return any(not outcome.ok for outcome in self._pending.get(backend, ()))

    def drain(self) -> dict[str, tuple[RequestOutcome, ...]]:
        """Everything recorded so far, per backend in order; the log is empty afterwards."""
        drained = {name: tuple(queue) for name, queue in self._pending.items() if queue}
        self._pending = {}
        return drained

    def give_back(self, drained: Mapping[str, Sequence[RequestOutcome]]) -> None:
        """Outcomes a settle took but could not save (a skipped cycle), put back before
        those recorded since: lost, they would leave a failing backend in the choice."""
        for backend, outcomes in drained.items():
            since = tuple(self._pending.pop(backend, ()))
            for outcome in (*outcomes, *since):
                self.record(backend, outcome)
