"""Time bounds on the router's request path, all of them on one coarse shared timer.

Why not ``asyncio.timeout``, as the router used before: each block scheduled a loop
timer (a handle holding a copy of the context, pushed on the loop's heap) and cancelled
it on the way out, two or three times per request, about 8% of the router's CPU
(bench/README.md, the router's profile), for bounds that almost never fire. Here a block
files its task under the tick its deadline falls in (a dict insert), leaving takes it out
again (a dict delete), and one timer per ``TICK`` while anything is filed cancels the
tasks whose tick has passed. A bound fires at most ``TICK`` late and never early: the
router's bounds are whole seconds (first byte, stream idle, client writes, request
bodies), where 50 ms is noise.

Semantics as ``asyncio.timeout``'s: the expired block's task is cancelled, and the
block turns that cancellation (and only that one) into ``TimeoutError``; a block
entered with ``None`` bounds nothing.
"""

from __future__ import annotations

import asyncio
import heapq
import math
from types import TracebackType
from typing import Final

TICK: Final = 0.05  # seconds: how late a bound may fire
_TIMER_GRAIN: Final = 0.001  # seconds: uvloop's timer resolution, the most it runs one early


class Deadlines:
    """One event loop's bounds, filed by the tick their deadline falls in."""

    __slots__ = ("_armed", "_due", "_handle", "_loop", "_ticks")

    def __init__(self) -> None:
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ticks: dict[int, dict[Bound, None]] = {}  # tick -> its blocks, in entry order
        self._due: list[int] = []  # the ticks filed, a heap
        self._handle: asyncio.TimerHandle | None = None
        self._armed = 0  # the tick the timer is set for, while it is set

    def within(self, seconds: float | None) -> Bound:
        """``with deadlines.within(s):`` -- the block's awaits end in ``TimeoutError``
        once ``s`` seconds have passed."""
        return Bound(self, seconds)

    def _file(self, bound: Bound, seconds: float) -> int:
        loop = self._loop
        if loop is None:
            loop = self._loop = asyncio.get_running_loop()
        tick = math.ceil((loop.time() + seconds) / TICK)
        blocks = self._ticks.get(tick)
        if blocks is None:
            blocks = self._ticks[tick] = {}
            heapq.heappush(self._due, tick)
        blocks[bound] = None
        if self._handle is None or tick < self._armed:  # sooner than the timer: reset it
            self._arm(loop, tick * TICK)
        return tick

    def _arm(self, loop: asyncio.AbstractEventLoop, when: float) -> None:
        if self._handle is not None:
            self._handle.cancel()
        self._handle = loop.call_at(when, self._fire)
        self._armed = math.ceil(when / TICK)

    def _unfile(self, bound: Bound, tick: int) -> None:
        blocks = self._ticks.get(tick)
        if blocks is not None:
            blocks.pop(bound, None)

    def _fire(self) -> None:
        """Expire every block whose tick has passed; run again while any is filed."""
        self._handle = None
        loop = self._loop
        assert loop is not None
        now = loop.time()
        passed = False
        while self._due and self._due[0] * TICK <= now:
            passed = True
            for bound in self._ticks.pop(heapq.heappop(self._due)):
                bound.expire()
        if not self._due:
            return
        # Ticks whose blocks all left early stay on the heap until their time: one
        # wake-up each at most, cheaper than finding them on every exit. Armed at the
        # next one's time, not a TICK from now: run late (a loop held, and every run by
        # a little), its next tick's bounds fired up to 2 TICKs late, and under a steady
        # stream of bounds each run's lateness added to the next's.
        soonest = self._due[0] * TICK
        if passed:
            self._arm(loop, soonest)
        else:
            # Run before its time: uvloop rounds a timer to whole milliseconds and runs
            # it up to one early. Armed just past the tick (not at it: run early again,
            # it would spin until then).
            self._arm(loop, soonest + _TIMER_GRAIN)


class Bound:
    """One ``with`` block's deadline (see ``Deadlines.within``)."""

    __slots__ = ("_cancelling", "_owner", "_seconds", "_task", "_tick", "expired")

    def __init__(self, owner: Deadlines, seconds: float | None) -> None:
        self._owner = owner
        self._seconds = seconds
        self._task: asyncio.Task[object] | None = None
        self._tick = -1
        self._cancelling = 0
        self.expired = False

    def __enter__(self) -> Bound:
        if self._seconds is not None:
            task = asyncio.current_task()
            if task is None:
                raise RuntimeError("a deadline bounds a task: none is running")
            self._task = task
            self._cancelling = task.cancelling()
            self._tick = self._owner._file(self, self._seconds)
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        if self._task is None:
            return
        if not self.expired:
            self._owner._unfile(self, self._tick)
            return
        # Ours was the cancellation that ended the block: it reads as the timeout it is.
        if self._task.uncancel() <= self._cancelling and kind is asyncio.CancelledError:
            raise TimeoutError from error

    def expire(self) -> None:
        """The deadline passed while the block ran: cancel its task."""
        assert self._task is not None
        self.expired = True
        self._task.cancel()
