"""The router's shared coarse timer: asyncio.timeout's semantics at a fraction of its cost."""

from __future__ import annotations

import asyncio
import contextlib
import time

import pytest

from llmhealth.deadlines import TICK, Deadlines


def test_a_block_past_its_deadline_raises_timeout_error() -> None:
    async def scenario() -> None:
        deadlines = Deadlines()
        with pytest.raises(TimeoutError), deadlines.within(0.01):
            await asyncio.Event().wait()

    asyncio.run(scenario())


def test_a_block_that_finishes_in_time_is_left_alone_afterwards() -> None:
    async def scenario() -> None:
        deadlines = Deadlines()
        with deadlines.within(0.05):
            await asyncio.sleep(0)
        await asyncio.sleep(0.2)  # past the deadline: nothing is cancelled any more

    asyncio.run(scenario())


def test_none_bounds_nothing() -> None:
    async def scenario() -> None:
        deadlines = Deadlines()
        with deadlines.within(None):
            await asyncio.sleep(0.1)

    asyncio.run(scenario())


def test_a_sooner_deadline_fires_before_a_later_one_already_set() -> None:
    async def scenario() -> None:
        deadlines = Deadlines()
        never = asyncio.Event()

        async def long_bound() -> None:
            with deadlines.within(3600):
                await never.wait()

        waiting = asyncio.create_task(long_bound())
        await asyncio.sleep(0)  # the hour-long bound has set the timer
        with pytest.raises(TimeoutError), deadlines.within(0.01):
            await never.wait()
        assert not waiting.done()
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting

    asyncio.run(scenario())


def test_a_cancellation_from_elsewhere_stays_a_cancellation() -> None:
    async def scenario() -> None:
        deadlines = Deadlines()
        started = asyncio.Event()

        async def bounded() -> None:
            with deadlines.within(3600):
                started.set()
                await asyncio.Event().wait()

        task = asyncio.create_task(bounded())
        await started.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(scenario())


def test_many_blocks_each_expire_and_each_in_its_own_task() -> None:
    async def scenario() -> None:
        deadlines = Deadlines()

        async def bounded(seconds: float) -> str:
            try:
                with deadlines.within(seconds):
                    await asyncio.Event().wait()
            except TimeoutError:
                return "timed out"
            return "finished"

        outcomes = await asyncio.gather(*(bounded(0.01 * (i % 5 + 1)) for i in range(50)))
        assert outcomes == ["timed out"] * 50

    asyncio.run(scenario())


def test_a_bound_never_fires_before_its_time() -> None:
    """Filed under the tick its deadline falls in, rounded up: late by a tick at most,
    early never (a bound of whole seconds cut short is a backend wrongly charged)."""

    async def scenario() -> list[float]:
        loop = asyncio.get_running_loop()
        deadlines = Deadlines()

        async def bounded(seconds: float) -> float:
            start = loop.time()
            with pytest.raises(TimeoutError), deadlines.within(seconds):
                await asyncio.Event().wait()
            return loop.time() - start - seconds

        return await asyncio.gather(*(bounded(0.013 * i) for i in range(1, 8)))

    assert min(asyncio.run(scenario())) >= 0


def test_a_timer_run_early_is_armed_again_just_past_its_tick_not_a_tick_on() -> None:
    """uvloop rounds a timer to whole milliseconds and runs it up to one early. Run so,
    the timer expired nothing and was armed a TICK on: bounds fired up to two TICKs
    late, where the README says at most one. Run early here by calling it early, with the
    loop's clock half a millisecond short of its time."""

    async def scenario() -> tuple[float, float]:
        loop = asyncio.get_running_loop()
        deadlines = Deadlines()
        with deadlines.within(0.5):
            handle = deadlines._handle
            assert handle is not None
            due = handle.when()
            handle.cancel()
            loop.time = lambda: due - 0.0005  # type: ignore[method-assign]
            try:
                deadlines._fire()  # half a millisecond before its time: nothing passed
            finally:
                del loop.time  # the loop's own clock again
            again = deadlines._handle
            assert again is not None
            return due, again.when()

    due, again = asyncio.run(scenario())
    assert due < again <= due + 0.0011  # just past the tick, not 50 ms on


def test_a_timer_run_late_is_armed_again_at_the_next_tick_not_a_tick_on() -> None:
    """Run late (a loop held 40 ms), the timer was armed a TICK from then, not at the next
    tick: that tick's bounds fired up to two TICKs late, and under a router's steady
    stream of bounds each run's own lateness carried into the next. Run late here by
    calling it with the loop's clock 40 ms past its time."""

    async def scenario() -> tuple[float, float, float]:
        loop = asyncio.get_running_loop()
        deadlines = Deadlines()

        async def bounded(seconds: float) -> None:
            with pytest.raises(TimeoutError), deadlines.within(seconds):
                await asyncio.Event().wait()

        first = asyncio.create_task(bounded(10.0))
        second = asyncio.create_task(bounded(10.0 + TICK))  # the tick after
        await asyncio.sleep(0)  # both filed
        handle = deadlines._handle
        assert handle is not None
        due = handle.when()
        handle.cancel()
        loop.time = lambda: due + 0.04  # type: ignore[method-assign]
        try:
            deadlines._fire()  # 40 ms late: the first bound's tick has passed
        finally:
            del loop.time  # the loop's own clock again
        again = deadlines._handle
        assert again is not None
        await first  # expired by that run
        next_tick = deadlines._due[0] * TICK
        second.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await second
        return due, next_tick, again.when()

    due, next_tick, again = asyncio.run(scenario())
    assert due < next_tick < due + 0.04 + TICK  # the next tick is before a TICK on ...
    assert again == next_tick  # ... and the timer is armed for it


def test_another_error_the_expired_block_ends_with_is_left_as_it_is() -> None:
    """Only the block's own cancellation reads as TimeoutError, as with asyncio.timeout."""

    async def scenario() -> None:
        deadlines = Deadlines()
        with pytest.raises(ValueError, match="cleanup failed"), deadlines.within(0.01):
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                raise ValueError("cleanup failed") from None

    asyncio.run(scenario())


def test_a_cancellation_from_elsewhere_as_the_bound_expires_stays_a_cancellation() -> None:
    """The task cancelled from outside and by its deadline both before it ran again: the
    outside one is not swallowed as a timeout."""

    async def scenario() -> None:
        deadlines = Deadlines()
        entered = asyncio.Event()

        async def bounded() -> None:
            with deadlines.within(0.01):
                entered.set()
                await asyncio.Event().wait()

        task = asyncio.create_task(bounded())
        await entered.wait()
        time.sleep(0.1)  # the loop held past the deadline: its timer is overdue
        await asyncio.sleep(0)  # resumed in the turn that runs the overdue timer, first
        task.cancel()  # so the bound expires too before the task runs again
        with pytest.raises(asyncio.CancelledError):
            await task
        assert task.cancelled()

    asyncio.run(scenario())


def test_a_bound_entered_while_its_task_is_being_cancelled_still_times_out() -> None:
    """A task's cleanup after a cancellation it has not uncancelled, bounded in time: its
    bound's expiry is its own, read as a timeout, as with asyncio.timeout."""

    async def scenario() -> str:
        deadlines = Deadlines()
        try:
            current = asyncio.current_task()
            assert current is not None
            current.cancel()
            await asyncio.sleep(0)
        except asyncio.CancelledError:
            try:
                with deadlines.within(0.01):
                    await asyncio.Event().wait()
            except TimeoutError:
                return "timed out"
        return "not timed out"

    assert asyncio.run(scenario()) == "timed out"
