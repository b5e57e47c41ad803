"""How late an event loop has run: time its own process could not use.

A loop held up (CPU work of its own, a host with more work than cores, a VM paused) runs
every timer late; a deadline measured on it then expires for time the awaited party was
never given. The probes forgive that lateness (wire.py) and the router does not count a
connection it timed out meanwhile against the backend (upstream.py): both ask one
``Lateness`` per loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import weakref
from collections import deque
from collections.abc import Iterator

LATE_ENOUGH = 0.05  # seconds a timer may run late without counting: scheduling noise
_TICK = 0.1  # how often a Lateness looks at its loop's clock
_LATE_KEPT = 1024  # late ticks remembered per loop


class Lateness:
    """How late one event loop has run its timers: time its process could not use.

    A timer every ``_TICK`` notes how long after its time it ran, when that is more than
    noise; a request asks how much of that fell within its own span. Timer handles only,
    no task, and a weak reference to the loop: it ends with its loop, or when stopped
    (``lent_to``).
    """

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = weakref.ref(loop)
        self._late: deque[tuple[float, float]] = deque(maxlen=_LATE_KEPT)  # (ran, late by)
        self._due = loop.time() + _TICK
        self._next: asyncio.TimerHandle | None = loop.call_at(self._due, self._tick)

    def _tick(self) -> None:
        loop = self._loop()
        if loop is None or loop.is_closed():
            return
        now = loop.time()
        if now - self._due > LATE_ENOUGH:
            self._late.append((now, now - self._due))
        self._due = now + _TICK
        self._next = loop.call_at(self._due, self._tick)

    def stop(self) -> None:
        """No more ticks: what it noted stays, and nothing runs on its loop for it."""
        if self._next is not None:
            self._next.cancel()
            self._next = None
        # No tick is overdue now: one due for ever, or a read asking later took the time
        # since the stop for the loop's own lateness.
        self._due = math.inf

    def since(self, start: float) -> float:
        """Seconds this loop ran late after ``start``, the tick overdue now included."""
        loop = self._loop()
        now = loop.time() if loop is not None else self._due
        total = max(0.0, now - self._due - LATE_ENOUGH)
        # Newest first, up to ``start``: they were noted in time order, and each read's
        # body-gate wait asks (_Deadline.unhold), so a loaded loop's full history of
        # 1,024 late ticks must not be walked on every read.
        for ran, late in reversed(self._late):
            if ran <= start:
                break
            total += min(late, ran - start)
        return total

    def across(self, moment: float) -> float:
        """How long a stall of this loop that ``moment`` fell inside lasted (0: none did).

        A tick due at ``due`` that ran ``late`` seconds after shows the loop held from
        at least ``due`` to ``due + late``. A deadline inside such a stall was judged at
        its end, with whatever completed meanwhile not yet taken in; stalls before the
        deadline took nothing from what was awaited (the kernel kept working).
        """
        loop = self._loop()
        now = loop.time() if loop is not None else self._due
        if self._due <= moment <= now and now - self._due > LATE_ENOUGH:
            return now - self._due  # the tick overdue now
        for ran, late in reversed(self._late):
            if ran < moment:
                break
            if ran - late <= moment:
                return late
        return 0.0


_KEPT: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, Lateness] = weakref.WeakKeyDictionary()


def lateness_of(loop: asyncio.AbstractEventLoop) -> Lateness:
    """The loop's one Lateness, made (and its ticks started) by the first to ask."""
    kept = _KEPT.get(loop)
    if kept is None:
        kept = _KEPT[loop] = Lateness(loop)
    return kept


# Loops whose Lateness a check lent them, by how many checks run in each now.
_LENT: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, int] = weakref.WeakKeyDictionary()


@contextlib.contextmanager
def lent_to(loop: asyncio.AbstractEventLoop) -> Iterator[None]:
    """The loop's Lateness ticking while inside, and stopped after the last such block
    ends unless it ticked before the first began (a router's, a daemon's: theirs for good).

    ``llmhealth.check_async`` runs in its caller's loop: its reads started the ticks, and
    nothing ended them, so the caller's loop woke ten times a second for the rest of its
    life, after one check.
    """
    if loop in _KEPT and loop not in _LENT:
        yield  # ticking for good already
        return
    _LENT[loop] = _LENT.get(loop, 0) + 1
    lateness = lateness_of(loop)
    try:
        yield
    finally:
        _LENT[loop] -= 1
        if not _LENT[loop]:
            del _LENT[loop]
            if _KEPT.get(loop) is lateness:
                del _KEPT[loop]
            lateness.stop()
