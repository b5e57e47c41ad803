"""How late an event loop ran (llmhealth.lateness)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest

from llmhealth import eventloop
from llmhealth.lateness import _LATE_KEPT, _TICK, LATE_ENOUGH, Lateness, lateness_of, lent_to


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


class _Clock:
    """A real event loop whose clock the test sets: its ticks are run by hand, at the
    moments the test says they ran, and never by the loop (it is not run)."""

    def __init__(self) -> None:
        self.now = 1000.0
        self.loop = asyncio.new_event_loop()
        self.loop.time = lambda: self.now  # type: ignore[method-assign]

    def tick_at(self, lateness: Lateness, moment: float) -> None:
        self.now = moment
        lateness._tick()


@pytest.fixture
def clock() -> Iterator[_Clock]:
    made = _Clock()
    yield made
    made.loop.close()


def test_a_tick_late_by_no_more_than_noise_is_not_counted(clock: _Clock) -> None:
    lateness = Lateness(clock.loop)
    clock.tick_at(lateness, lateness._due + LATE_ENOUGH / 2)  # scheduling noise
    clock.now = lateness._due  # the next tick due now: none overdue
    assert lateness.since(0.0) == 0.0
    clock.tick_at(lateness, lateness._due + 0.5)
    clock.now = lateness._due
    assert lateness.since(0.0) == pytest.approx(0.5)


def test_the_tick_overdue_now_counts_less_the_noise_allowed(clock: _Clock) -> None:
    lateness = Lateness(clock.loop)
    start = clock.now
    clock.now = lateness._due + 1.0  # the loop held a second: its tick has not run yet
    assert lateness.since(start) == pytest.approx(1.0 - LATE_ENOUGH)


def test_a_stall_is_counted_once_the_ticks_after_it_run_on_time(clock: _Clock) -> None:
    """The next tick is due a tick after the late one ran, not a tick after it was due:
    those would all be overdue at once, each counting the same stall again."""
    lateness = Lateness(clock.loop)
    start = clock.now
    clock.tick_at(lateness, lateness._due + 1.0)
    for _ in range(3):
        clock.tick_at(lateness, clock.now + _TICK)  # each a tick after the last: on time
    assert lateness.since(start) == pytest.approx(1.0)


def test_only_the_last_late_ticks_are_remembered(clock: _Clock) -> None:
    """A loop late on every tick for hours keeps a bounded history, not one of them all."""
    lateness = Lateness(clock.loop)
    for _ in range(3 * _LATE_KEPT):
        clock.tick_at(lateness, lateness._due + 0.1)
    clock.now = lateness._due
    assert lateness.since(0.0) == pytest.approx(_LATE_KEPT * 0.1)


def test_a_moment_before_the_stall_under_way_is_not_inside_it(clock: _Clock) -> None:
    lateness = Lateness(clock.loop)
    due = lateness._due
    clock.now = due + 1.0  # held since the tick was due, and still
    assert lateness.across(due - 0.01) == 0.0  # before it began: the loop was free then
    assert lateness.across(due) == pytest.approx(1.0)  # it held from its due time on
    assert lateness.across(due + 0.5) == pytest.approx(1.0)
    clock.now = due + LATE_ENOUGH / 2  # only noise overdue: no stall
    assert lateness.across(due + LATE_ENOUGH / 4) == 0.0


def test_a_stall_is_told_from_the_moment_its_tick_was_due(clock: _Clock) -> None:
    lateness = Lateness(clock.loop)
    lateness._late.append((clock.now - 1.0, 2.0))  # held from now - 3 to now - 1
    assert lateness.across(clock.now - 3.0) == 2.0


def test_every_asker_on_one_loop_shares_its_one_lateness(clock: _Clock) -> None:
    """The probes and the router read the history one Lateness keeps: a new one per
    asker would know of no stall before it was made."""
    assert lateness_of(clock.loop) is lateness_of(clock.loop)


def test_a_loops_lateness_lent_to_a_check_stops_after_it_and_one_kept_for_good_does_not() -> None:
    """A check in its caller's loop (``check_async``) lends the loop ticks while it runs;
    a router's or a daemon's, started before, tick on after the check."""

    async def run() -> tuple[bool, bool, bool]:
        loop = asyncio.get_running_loop()
        with lent_to(loop), lent_to(loop):  # two checks gathered
            lent = lateness_of(loop)
        await asyncio.sleep(0.2)  # past its next tick's time
        stopped = lent._next is None and lateness_of(loop) is not lent and not lent.since(0.0)
        kept = lateness_of(loop)  # a router's, for good
        with lent_to(loop):
            pass
        return stopped, kept._next is not None, lateness_of(loop) is kept

    assert eventloop.run(run()) == (True, True, True)
