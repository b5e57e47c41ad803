"""Who may act on a fleet watched by several daemons: the leadership rule, and who reads what.

Pure: values in, values out; the caller passes its own monotonic clock as ``now``. The
rule is client-go's leaderelection rule: a leader acts only while its last renewal is
younger than a renew deadline that is shorter than the lease's TTL, counted from when
the renewal was *sent* (the server cannot have started the TTL any earlier). So it stops
acting before etcd can expire its lease and hand the leader key to another daemon, even
when it was paused and has not yet heard that the key is gone.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from enum import StrEnum

# client-go's defaults are a 15 s lease, a 10 s renew deadline and a 2 s retry period:
# the deadline leaves a third of the lease for clock rate drift and a slow last request.
RENEW_DEADLINE_SHARE = 2 / 3
RETRY_SHARE = 2 / 15
RETRY_JITTER = 0.2  # a wait after a failure is up to this share longer: daemons spread out
# Retry periods, at most, between tries while no lease may be alive: 4 of them (8/15 of
# the TTL) bring a member back to the election within a renew deadline of etcd's return.
BACKOFF_LIMIT = 4


@dataclass(frozen=True, slots=True)
class LeaseTiming:
    """The three durations of a lease-based election, in seconds."""

    ttl: float
    renew_deadline: float  # a leader stops acting this long after its last renewal was sent
    retry_period: float  # how often a lease is renewed and the leader key tried

    def __post_init__(self) -> None:
        if not 0 < self.retry_period < self.renew_deadline < self.ttl:
            raise ValueError(
                "lease timing needs 0 < retry_period < renew_deadline < ttl, got "
                f"{self.retry_period:g} < {self.renew_deadline:g} < {self.ttl:g}"
            )

    @classmethod
    def for_ttl(cls, ttl: float) -> LeaseTiming:
        return cls(ttl, ttl * RENEW_DEADLINE_SHARE, ttl * RETRY_SHARE)


@dataclass(frozen=True, slots=True)
class LeaseFacts:
    """What a daemon knows of its own lease and of the leader key, with monotonic times.

    ``renewed_at`` is when the request behind the last successful grant or keep-alive was
    sent; ``leader_since`` when this daemon's leader key was created, None when it holds
    none (or knows it lost it).
    """

    lease_id: int | None = None
    renewed_at: float | None = None
    leader_since: float | None = None


class Standing(StrEnum):
    LEADER = "leader"  # holds the leader key and renewed in time: may act
    STANDBY = "standby"  # holds no leader key: probes and reports, acts on nothing
    STEPPING_DOWN = "stepping_down"  # held it, but the deadline passed: stop acting now


@dataclass(frozen=True, slots=True)
class Decision:
    standing: Standing
    reason: str
    acts_until: float | None = None  # monotonic; set only for a leader

    @property
    def may_act(self) -> bool:
        return self.standing is Standing.LEADER


def decide(facts: LeaseFacts, timing: LeaseTiming, now: float) -> Decision:
    """May this daemon act at ``now`` (its monotonic clock), and must it step down?

    Stepping down means: act on nothing more, and treat the lease as lost (campaign again
    on a new one), because past the deadline nothing proves it is still held.
    """
    if facts.leader_since is None:
        return Decision(Standing.STANDBY, "does not hold the leader key")
    if facts.lease_id is None or facts.renewed_at is None:
        return Decision(Standing.STEPPING_DOWN, "holds the leader key on no known lease")
    acts_until = facts.renewed_at + timing.renew_deadline
    if now >= acts_until:
        return Decision(
            Standing.STEPPING_DOWN,
            f"last renewal sent {now - facts.renewed_at:.1f} s ago, past the renew deadline "
            f"of {timing.renew_deadline:.1f} s (lease TTL {timing.ttl:g} s)",
        )
    return Decision(
        Standing.LEADER, f"renewed {now - facts.renewed_at:.1f} s ago", acts_until=acts_until
    )


def renewal_due(facts: LeaseFacts, timing: LeaseTiming, now: float) -> float:
    """When the next keep-alive should be sent: a retry period after the last one."""
    if facts.renewed_at is None:
        return now
    return max(now, facts.renewed_at + timing.retry_period)


def retry_due(
    facts: LeaseFacts,
    timing: LeaseTiming,
    now: float,
    failures: int,
    jitter: float,
    round_started: float,
) -> float:
    """When to try again after ``failures`` rounds failed in a row, the last of them
    begun at ``round_started``; ``jitter`` in [0, 1).

    Never within a retry period of the last try's start: an etcd that fails fast (a
    429, a refused connection) was asked twenty times a second. Counted from the start,
    not the end: a round that failed slowly (5 s across silent endpoints) already took
    its wait, and a leader whose lease may still be alive (renewed less than a TTL ago)
    must renew as it would have without the failure, or it steps down for nothing.
    Without such a lease nothing is lost by waiting, and the wait doubles up to
    ``BACKOFF_LIMIT`` retry periods.
    """
    periods = 1
    if facts.renewed_at is None or now >= facts.renewed_at + timing.ttl:
        periods = min(2 ** min(max(failures, 1) - 1, 8), BACKOFF_LIMIT)
    return max(now, round_started + timing.retry_period * periods * (1 + RETRY_JITTER * jitter))


def owner(backend: str, members: Iterable[str]) -> str | None:
    """The member that reads ``backend``: the highest rendezvous weight, ties by name.

    Rendezvous hashing moves only the leaving member's backends when membership changes,
    and every member computes the same owner from the same list without talking.
    """
    best: tuple[bytes, str] | None = None
    for member in members:
        weight = hashlib.blake2b(f"{member}\0{backend}".encode(), digest_size=8).digest()
        if best is None or (weight, member) > best:
            best = (weight, member)
    return None if best is None else best[1]


def share_of(member: str, backends: Sequence[str], members: Iterable[str]) -> list[str]:
    """The backends ``member`` reads among ``members`` (it counts as one even if absent)."""
    everyone = sorted({*members, member})
    return [backend for backend in backends if owner(backend, everyone) == member]
