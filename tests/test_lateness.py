"""How late an event loop ran (llmhealth.lateness)."""

from __future__ import annotations

import asyncio

import pytest

from llmhealth import eventloop
from llmhealth.lateness import Lateness


def test_a_loops_lateness_since_a_moment_counts_only_the_late_ticks_after_it() -> None:
    """Asked on every read (each body-gate wait), it walks back from the newest tick to
    the moment asked about, not the whole history of a loaded loop."""

    async def run() -> tuple[float, float, float]:
        loop = asyncio.get_running_loop()
        lateness = Lateness(loop)
        now = loop.time()
        for ran in (now - 10.0, now - 5.0, now - 1.0):  # each 0.5 s late, in time order
            lateness._late.append((ran, 0.5))
        return lateness.since(now - 7.0), lateness.since(now - 1.2), lateness.since(now)

    both, the_last_in_part, none = eventloop.run(run())
    assert both == pytest.approx(1.0, abs=0.05)
    assert the_last_in_part == pytest.approx(0.2, abs=0.05)
    assert none == pytest.approx(0.0, abs=0.05)


def test_a_moment_inside_a_stall_of_the_loop_is_told_how_long_it_lasted() -> None:
    """What a deadline inside a stall was judged late by; stalls that ended before it
    took nothing from what was awaited."""

    async def run() -> tuple[float, float, float, float]:
        loop = asyncio.get_running_loop()
        lateness = Lateness(loop)
        now = loop.time()
        for ran, late in ((now - 10.0, 0.3), (now - 5.0, 2.0)):  # held [-10.3,-10], [-7,-5]
            lateness._late.append((ran, late))
        return (
            lateness.across(now - 6.0),
            lateness.across(now - 10.1),
            lateness.across(now - 8.0),
            lateness.across(now - 1.0),
        )

    inside, inside_the_first, between, after = eventloop.run(run())
    assert (inside, inside_the_first, between, after) == (2.0, 0.3, 0.0, 0.0)
