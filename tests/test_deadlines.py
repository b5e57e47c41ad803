"""The router's shared coarse timer: asyncio.timeout's semantics at a fraction of its cost."""

from __future__ import annotations

import asyncio

import pytest

from llmhealth.deadlines import Deadlines


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
