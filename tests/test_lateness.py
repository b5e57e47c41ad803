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
