"""The Prober feeding a FleetHealth from inside the caller's loop, against real simulated
vLLM processes. Between two probe() calls the test sleeps as a controller's loop would,
a little longer than the Prober's wait, so each call reads: never an assertion about
time."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import socket
import ssl
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from pytest_httpserver import HTTPServer
from simproc import running_simulator
from tlsproc import make_certificate
from wakes import CountedSelector
from werkzeug import Request, Response

import llmhealth
import llmhealth.prober
from llmhealth import FleetHealth, FleetPolicy, Prober, ProbeResult, StallWatch, State, VerdictKind
from llmhealth.probe import KEEP_ALIVE_LEAD, Client
from llmhealth.selector import Selector
from llmhealth.text import same_server

INTERVAL = 0.4  # the controller's probe interval in these tests
WAIT = 0.3  # the Prober's least time between two reads of a backend, inside INTERVAL
MAX_ROUNDS = 30  # bounds every loop that waits for the fleet to reach a state


async def probe_until(
    prober: Prober, fleet: FleetHealth, key: int, state: State
) -> list[list[ProbeResult]]:
    rounds = []
    for _ in range(MAX_ROUNDS):
        rounds.append(await prober.probe())
        if fleet.state_of(key) is state:
            return rounds
        await asyncio.sleep(INTERVAL)
    raise AssertionError(f"shard {key} never reached {state}: {fleet.snapshot()[key]}")


def test_an_idle_and_a_busy_backend_are_judged_and_stay_healthy() -> None:
    async def main(urls: list[str]) -> tuple[list[ProbeResult], list[ProbeResult]]:
        fleet = FleetHealth(urls)
        async with Prober(fleet, wait=WAIT, timeout=2.0, answer_timeout=2.0) as prober:
            first = await prober.probe()
            await asyncio.sleep(INTERVAL)
            second = await prober.probe()
        assert fleet.serving_shards() == [0, 1]
        return first, second

    with running_simulator(["idle", "busy"]) as sim:
        first, second = asyncio.run(main(sim.urls))
    assert first[0].verdict is VerdictKind.IDLE
    # One read of a busy engine proves nothing yet; the next call's read does.
    assert first[1].verdict is None
    assert second[1].verdict is VerdictKind.BUSY


@pytest.mark.slow
def test_nothing_of_the_prober_runs_in_the_callers_loop_between_calls() -> None:
    """The reads' measure of the loop's lateness ticked every 0.1 s in the trainer's
    loop from the first call on, between calls and after ``aclose``."""
    selector = CountedSelector()
    loop = asyncio.SelectorEventLoop(selector)

    async def main(urls: list[str]) -> tuple[int, int]:
        fleet = FleetHealth(urls)
        async with Prober(fleet, wait=WAIT, timeout=2.0, answer_timeout=2.0) as prober:
            await prober.probe()
            wakes = selector.wakes
            await asyncio.sleep(1.0)  # the trainer's own idle second between two calls
            between = selector.wakes - wakes
        wakes = selector.wakes
        await asyncio.sleep(1.0)
        return between, selector.wakes - wakes

    try:
        with running_simulator(["idle"]) as sim:
            between, after = loop.run_until_complete(main(sim.urls))
    finally:
        loop.close()
    assert between <= 2 and after <= 2  # the sleep's own timer, not ten ticks


@pytest.mark.slow
def test_a_wedged_backend_is_condemned_and_no_longer_probed() -> None:
    async def main(urls: list[str]) -> FleetHealth:
        fleet = FleetHealth(urls)
        async with Prober(fleet, wait=WAIT, timeout=2.0, answer_timeout=2.0) as prober:
            rounds = await probe_until(prober, fleet, 0, State.DEAD)
            assert rounds[-1][0].verdict is VerdictKind.WEDGED
            assert [r.key for r in await prober.probe()] == []
        return fleet

    with running_simulator(["wedge:0.5"]) as sim:
        fleet = asyncio.run(main(sim.urls))
    assert fleet.snapshot()[0].condemned_by == "wedged"


@pytest.mark.slow
@pytest.mark.parametrize("interval", [WAIT, WAIT * (1 - KEEP_ALIVE_LEAD)])
def test_a_loop_calling_every_wait_from_each_calls_start_reads_at_every_call(
    interval: float,
) -> None:
    """A ticker whose interval is the wait (or the wait less the keep-alive lead, which
    keeps a connection), counted from each call's start: reads paced from the end of the
    last one, or stamped when each read's task began, left calls unread, so verdicts took
    twice as long as the caller asked for."""

    async def main(url: str) -> list[ProbeResult]:
        fleet = FleetHealth([url])
        loop = asyncio.get_running_loop()
        results = []
        async with Prober(fleet, wait=WAIT, timeout=2.0, answer_timeout=2.0) as prober:
            for _ in range(4):
                started = loop.time()
                results += await prober.probe()
                await asyncio.sleep(max(0.0, started + interval - loop.time()))
        return results

    with running_simulator(["idle"]) as sim:
        results = asyncio.run(main(sim.urls[0]))
        with urllib.request.urlopen(f"{sim.urls[0]}/sim/stats", timeout=5) as answer:
            metrics_reads = json.load(answer)["metrics_reads"]
    assert [result.verdict for result in results] == [VerdictKind.IDLE] * 4, results
    assert metrics_reads == 4


@pytest.mark.slow
def test_a_young_process_gets_its_startup_window_from_the_prober_too() -> None:
    # The Prober stamped its reads with the monotonic clock: a process's age (read time
    # less its wall-clock start) came out about -1.8e9 s, not young, and a new engine
    # still compiling its first shapes was condemned as wedged in three calls.
    async def main(urls: list[str]) -> tuple[FleetHealth, list[list[ProbeResult]]]:
        fleet = FleetHealth(urls)
        rounds = []
        async with Prober(fleet, wait=WAIT, timeout=2.0, answer_timeout=2.0) as prober:
            for _ in range(5):
                rounds.append(await prober.probe())
                await asyncio.sleep(INTERVAL)
        return fleet, rounds

    with running_simulator(["wedge:0.5"], age=0.0) as sim:
        fleet, rounds = asyncio.run(main(sim.urls))
    verdicts = [result.verdict for results in rounds for result in results]
    assert VerdictKind.WEDGED not in verdicts, verdicts
    assert fleet.state_of(0) is State.HEALTHY


@pytest.mark.slow
def test_a_backend_that_restarted_by_itself_is_stale_until_a_refit() -> None:
    async def main(urls: list[str]) -> FleetHealth:
        fleet = FleetHealth(urls)
        async with Prober(fleet, wait=WAIT, timeout=2.0, answer_timeout=2.0) as prober:
            await probe_until(prober, fleet, 0, State.STALE)
            # Answering probes proves nothing about the weights it loaded at start.
            for _ in range(3):
                assert await prober.probe() == []
            assert fleet.state_of(0) is State.STALE
        fleet.report_refit(0, weight_version=5)
        return fleet

    with running_simulator(["restart:1.5"]) as sim:
        fleet = asyncio.run(main(sim.urls))
    assert fleet.state_of(0) is State.HEALTHY


def test_a_backend_that_went_away_is_counted_down_to_dead() -> None:
    with running_simulator(["idle"]) as sim:
        url = sim.urls[0]

    async def main() -> list[list[ProbeResult]]:
        fleet = FleetHealth([url], policy=FleetPolicy(unhealthy_threshold=3))
        async with Prober(fleet, wait=WAIT, timeout=1.0) as prober:
            return await probe_until(prober, fleet, 0, State.DEAD)

    rounds = asyncio.run(main())
    assert len(rounds) == 3
    assert {r[0].verdict for r in rounds} == {VerdictKind.DOWN}


@pytest.mark.slow
def test_a_dead_backend_is_probed_only_when_the_policy_allows_recovery_in_place() -> None:
    """Condemned by failed requests while its process is fine: with recover_in_place its
    own process proves itself back to STALE (a refit still decides); without, it is left
    alone, as seed 000 has it."""

    async def main(url: str, recover: bool) -> tuple[FleetHealth, int]:
        fleet = FleetHealth([url], policy=FleetPolicy(recover_in_place=recover))
        async with Prober(fleet, wait=WAIT, timeout=2.0, answer_timeout=2.0) as prober:
            await prober.probe()  # idle: the ledger learns which process this is
            for _ in range(3):
                fleet.report_failure(0, "500 from a generation")
            assert fleet.state_of(0) is State.DEAD
            probed = 0
            for _ in range(4):
                await asyncio.sleep(INTERVAL)
                probed += len(await prober.probe())
                if fleet.state_of(0) is not State.DEAD:
                    break
        return fleet, probed

    with running_simulator(["idle"]) as sim:
        off, probed_off = asyncio.run(main(sim.urls[0], recover=False))
        on, probed_on = asyncio.run(main(sim.urls[0], recover=True))
    assert off.state_of(0) is State.DEAD and probed_off == 0
    assert on.state_of(0) is State.STALE and probed_on >= 2
    assert 0 not in on.serving_shards()
    on.report_refit(0, weight_version=1)
    assert on.state_of(0) is State.HEALTHY


@pytest.mark.slow
def test_a_replacement_loaded_and_refit_between_two_probes_is_not_taken_for_a_restart() -> None:
    """The trainer restarts a dead shard on the same address, loads and refits it, all
    between two calls: the next read is of the new process, and comparing it with the old
    one's reads would say "restarted, unplanned" and put the refit shard back to STALE."""

    async def main(url: str) -> tuple[FleetHealth, list[ProbeResult]]:
        fleet = FleetHealth([url])
        async with Prober(fleet, wait=WAIT, timeout=2.0, answer_timeout=2.0) as prober:
            assert (await prober.probe())[0].verdict is VerdictKind.IDLE
            await asyncio.sleep(INTERVAL)
            fleet.record_actor_death(0, "ActorDiedError")
            fleet.mark_restarting(0)
            restart = urllib.request.Request(
                f"{url}/sim/restart", data=b'{"mode": "idle"}', method="POST"
            )
            with urllib.request.urlopen(restart, timeout=5) as answer:
                assert answer.status == 200
            fleet.mark_loaded(0)
            fleet.report_refit(0, weight_version=1)
            await asyncio.sleep(INTERVAL)
            return fleet, await prober.probe()

    with running_simulator(["idle"]) as sim:
        fleet, results = asyncio.run(main(sim.urls[0]))
        with urllib.request.urlopen(f"{sim.urls[0]}/sim/stats", timeout=5) as answer:
            assert json.load(answer)["restarts"] == 1
    assert [r.verdict for r in results] == [VerdictKind.IDLE]
    assert fleet.state_of(0) is State.HEALTHY, fleet.snapshot()[0]


def sim_post(url: str, path: str, body: dict[str, object]) -> None:
    request = urllib.request.Request(f"{url}{path}", data=json.dumps(body).encode(), method="POST")
    with urllib.request.urlopen(request, timeout=5) as answer:
        assert answer.status == 200


@pytest.mark.slow
def test_a_restart_behind_a_read_not_judged_still_lands_in_stale() -> None:
    """A read llmhealth could not judge (the caller's loop held past the read's grace)
    empties the window; the process restarted meanwhile, and the next read, with nothing
    to compare, called the replacement idle: HEALTHY and serving on whatever weights it
    loaded at start, never STALE."""

    async def main(url: str) -> tuple[FleetHealth, list[VerdictKind | None]]:
        fleet = FleetHealth([url])
        verdicts = []
        async with Prober(fleet, wait=WAIT, timeout=0.5, answer_timeout=2.0) as prober:
            assert [r.verdict for r in await prober.probe()] == [VerdictKind.IDLE]
            await asyncio.sleep(INTERVAL)
            await asyncio.to_thread(sim_post, url, "/sim/metrics", {"hang": True})

            async def trainer_holds_its_loop() -> None:
                await asyncio.sleep(0.1)  # the read is on its way
                time.sleep(2.5)  # a synchronous call in the trainer's loop

            results, _ = await asyncio.gather(prober.probe(), trainer_holds_its_loop())
            assert "not judged" in results[0].evidence, results
            # Replaced (systemd, Ray) while nobody could look.
            await asyncio.to_thread(sim_post, url, "/sim/restart", {"mode": "idle", "age": 3600})
            await asyncio.to_thread(sim_post, url, "/sim/metrics", {"hang": False})
            for _ in range(3):
                await asyncio.sleep(INTERVAL)
                verdicts += [r.verdict for r in await prober.probe()]
        return fleet, verdicts

    with running_simulator(["idle"]) as sim:
        fleet, verdicts = asyncio.run(main(sim.urls[0]))
    assert VerdictKind.RESTARTED in verdicts, verdicts
    assert fleet.state_of(0) is State.STALE, fleet.snapshot()[0]


@pytest.mark.slow
def test_a_restart_read_in_a_cancelled_call_is_not_lost() -> None:
    """A controller bounds its probe call (``asyncio.wait_for``). One backend's read saw
    its process restart and kept only the new process's reads; another's was still in
    flight when the call was cancelled, so the ``restarted`` verdict never reached the
    fleet, and every later read compared the replacement with itself alone."""

    async def main(restarted: str, slow: str) -> tuple[FleetHealth, list[VerdictKind | None]]:
        fleet = FleetHealth([restarted, slow])
        verdicts = []
        async with Prober(fleet, wait=WAIT, timeout=2.0, answer_timeout=2.0) as prober:
            assert [r.verdict for r in await prober.probe()] == [VerdictKind.IDLE] * 2
            await asyncio.sleep(INTERVAL)
            await asyncio.to_thread(sim_post, slow, "/sim/metrics", {"hang": True})
            await asyncio.to_thread(
                sim_post, restarted, "/sim/restart", {"mode": "idle", "age": 3600}
            )
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(prober.probe(), 1.0)
            await asyncio.to_thread(sim_post, slow, "/sim/metrics", {"hang": False})
            for _ in range(3):
                await asyncio.sleep(INTERVAL)
                verdicts += [r.verdict for r in await prober.probe() if r.key == 0]
        return fleet, verdicts

    with running_simulator(["idle", "idle"]) as sim:
        fleet, verdicts = asyncio.run(main(*sim.urls))
    # The verdict reaches the fleet as its read ends, in the cancelled call itself; the
    # reads after it see a STALE backend, which is not probed.
    assert fleet.state_of(0) is State.STALE, (verdicts, fleet.snapshot()[0])


def test_the_stall_watch_sees_the_fleet_finish_requests() -> None:
    async def main(urls: list[str]) -> StallWatch:
        stall = StallWatch(started_at=time.monotonic())
        fleet = FleetHealth(urls)
        async with Prober(fleet, wait=WAIT, timeout=2.0, stall=stall) as prober:
            for _ in range(MAX_ROUNDS):
                await prober.probe()
                if stall.last_finished_at is not None:
                    break
                await asyncio.sleep(INTERVAL)
        return stall

    with running_simulator(["busy"], request_seconds=0.3) as sim:
        stall = asyncio.run(main(sim.urls))
    assert stall.last_finished_at is not None
    assert stall.work_pending
    assert not stall.stalled(time.monotonic(), 3600.0)


@pytest.mark.parametrize("argument", ["timeout", "wait"])
@pytest.mark.parametrize("bad", [0, -1.0, float("nan"), float("inf"), True, 3601])
def test_a_prober_with_a_bad_timeout_or_wait_is_refused(argument: str, bad: float) -> None:
    """An infinite timeout let a hung backend hold ``probe()`` for ever; a wait of 0
    would let two reads of one instant count as two waits."""
    with pytest.raises(ValueError, match=argument):
        Prober(FleetHealth(["http://127.0.0.1:9"]), **{argument: bad})  # type: ignore[arg-type]


def test_calls_in_a_tight_loop_read_a_busy_engine_once_per_wait_and_never_condemn_it(
    httpserver: HTTPServer, fixture_text: Callable[[str], str]
) -> None:
    """A controller that probed in a tight loop read a busy engine whose counters stood
    still for a moment (one long step) 61 times in a tenth of a second: ``stalled``, three
    times, and DEAD; one calling every 0.2 s proved it wedged over 0.4 s. Each read counted
    as a full wait. Now a backend is read again only once the wait has passed."""
    busy = fixture_text("vllm-0.32/busy-1.txt")
    reads = []

    def metrics(request: Request) -> Response:
        reads.append(request.path)
        return Response(busy, content_type="text/plain; version=1.0.0; charset=utf-8")

    httpserver.expect_request("/metrics").respond_with_handler(metrics)

    async def main(url: str) -> tuple[FleetHealth, list[ProbeResult], int]:
        fleet = FleetHealth([url])
        async with Prober(fleet, timeout=2.0) as prober:  # watch's wait, 5 s
            results = [result for _ in range(70) for result in await prober.probe()]
        read_by_the_first = len(reads)
        # Once its wait has passed, a backend is read again.
        async with Prober(fleet, wait=WAIT, timeout=2.0) as prober:
            for _ in range(2):
                results += await prober.probe()
                await asyncio.sleep(WAIT)
        return fleet, results, read_by_the_first

    fleet, results, read_by_the_first = asyncio.run(main(httpserver.url_for("").rstrip("/")))
    assert (read_by_the_first, len(reads)) == (1, 3)
    assert fleet.state_of(0) is State.HEALTHY, fleet.snapshot()[0]
    assert {result.verdict for result in results} == {None}
    assert "read again once 5 s have passed" in results[69].evidence


@pytest.mark.parametrize(
    ("argument", "bad", "error"),
    [
        ("api_key", "token\n", ValueError),  # a key file read with its newline
        ("api_key", "tök", ValueError),
        ("model", 5, ValueError),
        ("model", "", ValueError),
        ("fleet", None, TypeError),
        ("stall", "x", TypeError),
    ],
)
def test_a_prober_with_a_bad_argument_is_refused_before_any_backend_pays(
    argument: str, bad: object, error: type[Exception]
) -> None:
    """A key with its newline failed every tiny request on our side, so a backend that
    never answered stayed HEALTHY; a model that is not a name earned 404s that condemned
    a healthy one. Both are the caller's mistake, said at once."""
    arguments: dict[str, object] = {"fleet": FleetHealth(["http://127.0.0.1:9"])}
    arguments[argument] = bad
    with pytest.raises(error, match=argument):
        Prober(**arguments)  # type: ignore[arg-type]


def test_two_probes_at_once_are_refused_not_read_as_the_backends_failure() -> None:
    """Two calls at once shared each backend's one connection; the collision read as the
    backend's ``down``, and three rounds of it condemned a healthy one."""

    async def main(url: str) -> tuple[list[ProbeResult], BaseException | list[ProbeResult]]:
        fleet = FleetHealth([url])
        async with Prober(fleet, wait=WAIT, timeout=2.0, answer_timeout=2.0) as prober:
            first, second = await asyncio.gather(
                prober.probe(), prober.probe(), return_exceptions=True
            )
            assert fleet.state_of(0) is State.HEALTHY
        assert isinstance(first, list)
        return first, second

    with running_simulator(["idle"]) as sim:
        first, second = asyncio.run(main(sim.urls[0]))
    assert [r.verdict for r in first] == [VerdictKind.IDLE]
    assert isinstance(second, RuntimeError) and "already running" in str(second)


@pytest.mark.slow
def test_a_prober_called_from_one_runner_proves_a_wedge_and_from_a_new_loop_says_why_not() -> None:
    """A synchronous trainer ran each call in ``asyncio.run``: the kept connection was the
    closed loop's, every other read failed on our side and emptied the window, and a
    wedged engine stayed HEALTHY for ever. One ``asyncio.Runner`` is the way; another loop
    is refused at once."""
    with running_simulator(["wedge:0.5"]) as sim:
        fleet = FleetHealth(sim.urls)
        prober = Prober(fleet, wait=WAIT, timeout=2.0, answer_timeout=2.0)
        with asyncio.Runner() as runner:
            for _ in range(MAX_ROUNDS):
                results = runner.run(prober.probe())
                assert all("not judged" not in r.evidence for r in results), results
                if fleet.state_of(0) is State.DEAD:
                    break
                time.sleep(INTERVAL)
            assert fleet.state_of(0) is State.DEAD, fleet.snapshot()[0]
            with pytest.raises(RuntimeError, match="event loop of its first probe"):
                asyncio.run(prober.probe())
            runner.run(prober.aclose())


def test_a_verdict_read_while_the_caller_rebuilt_the_backend_is_not_its_replacements() -> None:
    """The trainer rebuilt a wedged shard while a read of the old process was in flight:
    the old process's ``wedged`` moved the new, STALE shard to DEAD."""

    async def main(url: str) -> tuple[FleetHealth, list[ProbeResult]]:
        fleet = FleetHealth([url])
        async with Prober(fleet, wait=WAIT, timeout=2.0, answer_timeout=2.0) as prober:

            async def rebuild_while_read() -> None:
                await asyncio.sleep(0)  # the read has started: its slot is taken
                fleet.record_actor_death(0, "ActorDiedError")
                fleet.mark_restarting(0)
                fleet.mark_loaded(0)

            results, _ = await asyncio.gather(prober.probe(), rebuild_while_read())
        return fleet, results

    with running_simulator(["idle"]) as sim:
        fleet, results = asyncio.run(main(sim.urls[0]))
    assert [(r.verdict, r.transitions) for r in results] == [(None, ())]
    assert "rebuilt or moved while it was read" in results[0].evidence
    assert fleet.state_of(0) is State.STALE, fleet.snapshot()[0]


@pytest.mark.slow
def test_a_backend_condemned_on_the_callers_word_is_not_probed_to_recover_in_place() -> None:
    """The ledger never lets it back in place, yet every call read it and, idle, sent it
    the tiny request: an orphaned server kept answering for nothing."""

    async def main(url: str) -> tuple[FleetHealth, list[list[ProbeResult]]]:
        fleet = FleetHealth([url], policy=FleetPolicy(recover_in_place=True))
        async with Prober(fleet, wait=WAIT, timeout=2.0, answer_timeout=2.0) as prober:
            await prober.probe()  # idle: the ledger learns which process this is
            fleet.record_actor_death(0, "ActorDiedError")
            rounds = []
            for _ in range(3):
                await asyncio.sleep(INTERVAL)
                rounds.append(await prober.probe())
        return fleet, rounds

    with running_simulator(["idle"]) as sim:
        fleet, rounds = asyncio.run(main(sim.urls[0]))
        with urllib.request.urlopen(f"{sim.urls[0]}/sim/stats", timeout=5) as answer:
            stats = json.load(answer)
    assert rounds == [[], [], []]
    assert fleet.state_of(0) is State.DEAD and fleet.snapshot()[0].caller_condemned
    # The first call's read and tiny request alone.
    assert (stats["metrics_reads"], stats["completions_received"]) == (1, 1), stats


def test_the_targets_of_a_large_fleet_recovering_in_place_ask_for_the_serving_set_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Asked once per backend, each answer sorting the whole ledger: 2,000 targets took
    # 0.37 s of the caller's loop before any read, against 0.4 ms without recovery.
    urls = [f"http://127.0.0.1:{9000 + i}" for i in range(50)]
    fleet = FleetHealth(urls, policy=FleetPolicy(recover_in_place=True))
    asked = []
    serving = fleet.serving_shards
    monkeypatch.setattr(fleet, "serving_shards", lambda: asked.append(1) or serving())
    prober = Prober(fleet, wait=WAIT)
    assert prober._targets() == list(fleet.keys)
    assert len(asked) == 1


@pytest.mark.slow
def test_the_prober_takes_no_busy_engine_without_a_start_time_for_a_restarted_one(
    httpserver: HTTPServer, fixture_text: Callable[[str], str]
) -> None:
    """Each read is compared with the newest read of the last verdict given to the
    fleet, and was put before a window whose oldest read is older than it. With start
    times the two agree; without them (vLLM's multiprocess mode) only counters compare,
    and the window's oldest read, behind the baseline by the engine's progress, read as
    "a counter went down": a busy, healthy backend was called restarted and left the
    serving set, STALE until a refit."""
    text = "\n".join(
        line
        for line in fixture_text("vllm-0.32/busy-1.txt").splitlines()
        if not line.startswith("process_start_time_seconds")
    )
    served = []

    def metrics(request: Request) -> Response:
        n = len(served)
        served.append(n)
        body = re.sub(
            r"^(vllm:(?:iteration_tokens_total_count|generation_tokens_total)\{[^}]*\}) [0-9.e+]+$",
            lambda m: f"{m.group(1)} {1000.0 + 500.0 * n}",
            text,
            flags=re.M,
        )
        return Response(body + "\n", content_type="text/plain; version=1.0.0; charset=utf-8")

    httpserver.expect_request("/metrics").respond_with_handler(metrics)

    async def main(url: str) -> tuple[FleetHealth, list[VerdictKind | None]]:
        fleet = FleetHealth([url])
        verdicts = []
        async with Prober(fleet, wait=0.3, timeout=2.0, answer_timeout=2.0) as prober:
            for _ in range(5):
                verdicts += [r.verdict for r in await prober.probe()]
                await asyncio.sleep(0.4)
        return fleet, verdicts

    fleet, verdicts = asyncio.run(main(httpserver.url_for("").rstrip("/")))
    assert VerdictKind.RESTARTED not in verdicts, verdicts
    assert fleet.state_of(0) is State.HEALTHY, fleet.snapshot()[0]


@pytest.mark.slow  # 3.5 s: a wedge proven beside a hung backend
def test_a_wedge_proven_while_another_backend_hangs_reaches_the_fleet_at_once() -> None:
    """Each verdict reached the fleet only once every backend's read had ended: one
    backend whose /metrics hangs (a partition) held a proven wedge back for its whole
    timeout, the selector still sending to the wedged engine, and a controller bounding
    its probe call below that timeout (``asyncio.wait_for``) lost every verdict of every
    call, so the wedged engine stayed HEALTHY for as long as the other one hung."""

    async def main(wedged: str, partitioned: str) -> FleetHealth:
        fleet = FleetHealth([wedged, partitioned])
        async with Prober(fleet, wait=WAIT, timeout=5.0, answer_timeout=2.0) as prober:
            await asyncio.to_thread(sim_post, partitioned, "/sim/metrics", {"hang": True})
            try:
                for _ in range(10):  # the wedge is proven within a few calls
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(prober.probe(), 0.5)
                    if fleet.state_of(0) is State.DEAD:
                        break
                    await asyncio.sleep(INTERVAL)
            finally:
                await asyncio.to_thread(sim_post, partitioned, "/sim/metrics", {"hang": False})
        return fleet

    with running_simulator(["wedge:0.5", "idle"]) as sim:
        fleet = asyncio.run(main(*sim.urls))
    assert fleet.state_of(0) is State.DEAD, fleet.snapshot()[0]
    assert fleet.snapshot()[0].condemned_by == "wedged"
    # The partitioned one was never read to the end: nothing is said of it.
    assert fleet.state_of(1) is State.HEALTHY


def test_a_closed_prober_refuses_to_probe_rather_than_open_connections_nobody_closes() -> None:
    """A call after ``aclose`` (after its ``async with`` block) opened a new connection to
    every backend and kept it: nothing closed them again, and they stayed open until the
    loop's end (``ResourceWarning: unclosed``)."""

    async def main(url: str) -> tuple[FleetHealth, BaseException | None, int]:
        fleet = FleetHealth([url])
        async with Prober(fleet, wait=WAIT, timeout=2.0, answer_timeout=2.0) as prober:
            await prober.probe()
        await asyncio.sleep(INTERVAL)
        try:
            await prober.probe()
        except RuntimeError as exc:
            return fleet, exc, len(prober._slots)
        return fleet, None, len(prober._slots)

    with running_simulator(["idle"]) as sim:
        fleet, error, connections = asyncio.run(main(sim.urls[0]))
    assert isinstance(error, RuntimeError) and "closed" in str(error), error
    assert connections == 0
    assert fleet.state_of(0) is State.HEALTHY


@pytest.mark.slow
def test_the_stall_watch_is_fed_by_calls_cancelled_while_another_backend_hangs() -> None:
    """A controller bounding each call (``asyncio.wait_for``) while one backend's /metrics
    hangs: the verdicts of the others reach the fleet, but the StallWatch was fed only at
    the end of a whole call, so it never heard of any read: no work pending, no request
    finished, and a fleet that stops finishing requests would never be called stalled."""

    async def main(busy: str, partitioned: str) -> StallWatch:
        stall = StallWatch(started_at=time.monotonic())
        fleet = FleetHealth([busy, partitioned])
        async with Prober(fleet, wait=WAIT, timeout=5.0, stall=stall) as prober:
            await asyncio.to_thread(sim_post, partitioned, "/sim/metrics", {"hang": True})
            try:
                for _ in range(MAX_ROUNDS):
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(prober.probe(), 0.5)
                    if stall.last_finished_at is not None:
                        break
                    await asyncio.sleep(INTERVAL)
            finally:
                await asyncio.to_thread(sim_post, partitioned, "/sim/metrics", {"hang": False})
        return stall

    with running_simulator(["busy", "idle"], request_seconds=0.3) as sim:
        stall = asyncio.run(main(*sim.urls))
    assert stall.last_finished_at is not None
    assert stall.work_pending


def test_counts_that_add_up_past_a_float_are_a_verdict_not_an_exception(
    httpserver: HTTPServer,
) -> None:
    """Two finished_reason lines of 1e308 each summed to infinity, which the ledger's
    record of the process refused with a ValueError: every ``probe()`` of the fleet raised
    (and ``llmhealth.check`` with it) for one backend's text, never judging the others."""
    text = (
        'vllm:num_requests_running{engine="0"} 0\n'
        'vllm:num_requests_waiting{engine="0"} 0\n'
        'vllm:request_success_total{engine="0",finished_reason="stop"} 1e308\n'
        'vllm:request_success_total{engine="0",finished_reason="length"} 1e308\n'
    )
    httpserver.expect_request("/metrics").respond_with_data(text, content_type="text/plain")
    httpserver.expect_request("/v1/models").respond_with_json({"data": [{"id": "m"}]})
    httpserver.expect_request("/v1/completions").respond_with_json({"choices": [{"text": "x"}]})
    url = httpserver.url_for("").rstrip("/")

    async def main() -> list[ProbeResult]:
        async with Prober(FleetHealth([url]), wait=WAIT, timeout=2.0) as prober:
            return await prober.probe()

    assert [result.verdict for result in asyncio.run(main())] == [VerdictKind.IDLE]
    report = llmhealth.check([url], wait=WAIT, timeout=2.0)
    assert report.backends[0].verdict is VerdictKind.IDLE


@pytest.mark.slow
def test_a_lease_that_outlived_a_restart_the_prober_saw_reports_nothing_on_the_new_process() -> (
    None
):
    """The process restarted by itself (a supervisor's, k8s's) while requests hung on it;
    the Prober saw the new process (STALE, its failures and identity not inherited) and the
    trainer refit it. The hung requests then timed out and were counted against the
    replacement, as the ones ended by ``mark_loaded`` no longer are."""

    async def main(urls: list[str]) -> tuple[FleetHealth, Selector]:
        fleet = FleetHealth(urls, policy=FleetPolicy(unhealthy_threshold=3))
        selector = Selector(fleet)
        hung = [selector.lease() for _ in range(3)]
        assert [lease.__enter__() for lease in hung] == [0, 0, 0]
        async with Prober(fleet, wait=WAIT, timeout=2.0, answer_timeout=2.0) as prober:
            await probe_until(prober, fleet, 0, State.STALE)
        fleet.report_refit(0, weight_version=5)
        assert fleet.state_of(0) is State.HEALTHY
        for lease in hung:
            timed_out = TimeoutError("read timed out")
            assert not lease.__exit__(TimeoutError, timed_out, None)
        return fleet, selector

    with running_simulator(["restart:1.5"]) as sim:
        fleet, selector = asyncio.run(main(sim.urls))
    assert fleet.snapshot()[0].request_failures == 0 and selector.inflight(0) == 0
    assert fleet.state_of(0) is State.HEALTHY


def test_a_backend_condemned_by_requests_before_its_first_read_recovers_in_place() -> None:
    """Failures reported before the Prober first read the backend condemned it with its
    process unknown; every later read then showed a process the ledger would not compare
    ("which process answered is unknown"), and the backend stayed DEAD for good, while
    one read a moment earlier came back to STALE."""

    async def main(url: str) -> FleetHealth:
        fleet = FleetHealth([url], policy=FleetPolicy(recover_in_place=True))
        for _ in range(3):
            fleet.report_failure(0, "500 from a generation")
        assert fleet.state_of(0) is State.DEAD
        async with Prober(fleet, wait=WAIT, timeout=2.0, answer_timeout=2.0) as prober:
            await probe_until(prober, fleet, 0, State.STALE)
        return fleet

    with running_simulator(["idle"]) as sim:
        fleet = asyncio.run(main(sim.urls[0]))
    assert 0 not in fleet.serving_shards()
    fleet.report_refit(0, weight_version=1)
    assert fleet.state_of(0) is State.HEALTHY


def test_a_prober_closed_while_it_reads_sends_no_request_after_its_close() -> None:
    """``aclose`` from another task (a controller's shutdown) while a read waited on a kept
    connection: the closed connection looked like a server's idle close, the read was
    sent again on a new connection, and that one stayed open in a client no one had any
    more (closed at last by the collector, with ``ResourceWarning: unclosed``)."""
    metrics = (Path(__file__).parent.parent / "fixtures" / "vllm-0.32" / "busy-1.txt").read_bytes()
    answer = b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(metrics), metrics)
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(0.1)
    stop, second_read = threading.Event(), threading.Event()
    accepted: list[int] = []

    def serve() -> None:
        while not stop.is_set():
            try:
                connection, _ = listener.accept()
            except TimeoutError:
                continue
            accepted.append(len(accepted))
            with connection, contextlib.suppress(OSError):
                connection.settimeout(5)
                connection.recv(65536)
                connection.sendall(answer)
                connection.recv(65536)  # the next read, on the kept connection
                second_read.set()
                connection.recv(1)  # never answered: the Prober is closed meanwhile

    thread = threading.Thread(target=serve)
    thread.start()

    async def main(url: str) -> None:
        prober = Prober(FleetHealth([url]), wait=0.05, timeout=2.0)
        await prober.probe()
        await asyncio.sleep(0.1)  # past the wait: the next call reads
        reading = asyncio.create_task(prober.probe())
        assert await asyncio.to_thread(second_read.wait, 5)
        await prober.aclose()
        await reading

    try:
        asyncio.run(main(f"http://127.0.0.1:{listener.getsockname()[1]}"))
    finally:
        stop.set()
        thread.join(5)
        listener.close()
    assert accepted == [0]


@pytest.mark.slow
def test_a_dead_backend_condemned_by_traffic_recovers_in_place_while_others_requests_land() -> None:
    """As `watch` and `check` ask it: condemned by the caller's failed requests, its
    request-failure streak is cleared only by an answered request, and the caller sends
    it none while it is DEAD. Another client's short requests, finishing between every
    two reads, made each read "requests finished" with no tiny request sent: the same
    process proved itself at every read and stayed DEAD for as long as they came."""
    completion = json.dumps({"model": "tiny", "prompt": "hi", "max_tokens": 2}).encode()

    async def main(url: str) -> FleetHealth:
        fleet = FleetHealth([url], policy=FleetPolicy(recover_in_place=True))
        async with Prober(fleet, wait=WAIT, timeout=2.0, answer_timeout=2.0) as prober:
            await prober.probe()  # idle: the ledger learns which process this is
            for _ in range(3):
                fleet.report_failure(0, "500 from a generation")
            assert fleet.state_of(0) is State.DEAD
            for _ in range(12):
                # Another client's request, answered between this read and the next.
                post = urllib.request.Request(
                    f"{url}/v1/completions",
                    data=completion,
                    headers={"Content-Type": "application/json"},
                )
                answer = await asyncio.to_thread(urllib.request.urlopen, post, timeout=5)
                answer.close()
                await asyncio.sleep(INTERVAL)
                await prober.probe()
                if fleet.state_of(0) is not State.DEAD:
                    break
        return fleet

    with running_simulator(["idle"], request_seconds=0.05) as sim:
        fleet = asyncio.run(main(sim.urls[0]))
    assert fleet.state_of(0) is State.STALE, fleet.snapshot()[0]


@pytest.mark.slow
def test_a_long_step_learned_before_a_rebuild_still_covers_the_replacement(
    httpserver: HTTPServer, fixture_text: Callable[[str], str]
) -> None:
    """A trainer's rebuild (or a restart the Prober saw) starts a backend's reads afresh,
    and they forgot the longest step the engine had been seen to take: a replacement on
    the same hardware, past its startup window and inside its first long step, was
    wedged at two waits and condemned, where `watch` keeps what it learned across
    restarts and waits out three times that step."""
    busy = fixture_text("vllm-0.32/busy-1.txt")
    now = time.time()
    reads: list[int] = []
    replaced = threading.Event()

    def text() -> str:
        n = len(reads)
        reads.append(n)
        old = not replaced.is_set()
        start = now - 7200 if old else now - 1800  # the replacement is past startup_grace
        body = re.sub(
            r"^process_start_time_seconds .*$",
            f"process_start_time_seconds {start}",
            busy,
            flags=re.M,
        )
        if old:
            # The old process moves, and once waited out one long step: a gap in (20, 40] s.
            body = re.sub(
                r"^(vllm:(?:iteration_tokens_total_count|generation_tokens_total)\{[^}]*\}) "
                r"[0-9.e+]+$",
                lambda m: f"{m.group(1)} {5000.0 + 100.0 * n}",
                body,
                flags=re.M,
            )
            body = re.sub(
                r'^(vllm:inter_token_latency_seconds_bucket\{engine="0",'
                r'le="(?:40\.0|80\.0|\+Inf)"[^}]*\}) [0-9.e+]+$',
                lambda m: f"{m.group(1)} 3324.0",
                body,
                flags=re.M,
            )
        return body

    def metrics(request: Request) -> Response:
        return Response(text(), content_type="text/plain; version=1.0.0; charset=utf-8")

    httpserver.expect_request("/metrics").respond_with_handler(metrics)

    async def main(url: str) -> tuple[FleetHealth, list[VerdictKind | None]]:
        fleet = FleetHealth([url])
        verdicts: list[VerdictKind | None] = []
        async with Prober(fleet, wait=WAIT, timeout=2.0, answer_timeout=2.0) as prober:
            for _ in range(2):  # undecided, then busy
                verdicts += [r.verdict for r in await prober.probe()]
                await asyncio.sleep(INTERVAL)
            assert VerdictKind.BUSY in verdicts, verdicts
            # The trainer rebuilds the shard; the replacement, on the same hardware, has
            # not yet taken a long step of its own, and is inside one now.
            fleet.record_actor_death(0, "ActorDiedError")
            fleet.mark_restarting(0)
            fleet.mark_loaded(0)
            fleet.report_refit(0, weight_version=1)
            replaced.set()
            for _ in range(5):  # wedged at the fourth before, over two waits
                verdicts += [r.verdict for r in await prober.probe()]
                await asyncio.sleep(INTERVAL)
        return fleet, verdicts

    fleet, verdicts = asyncio.run(main(httpserver.url_for("").rstrip("/")))
    assert VerdictKind.WEDGED not in verdicts, (verdicts, fleet.snapshot()[0].last_error)
    assert fleet.state_of(0) is State.HEALTHY, fleet.snapshot()[0]


@pytest.mark.slow
def test_a_shard_moved_to_a_server_that_learned_a_long_step_keeps_that_step(
    httpserver: HTTPServer, fixture_text: Callable[[str], str]
) -> None:
    """`watch` gives a backend moved to another address the longer of its own step and
    the one learned at that server (``same_server``): the hardware stays. The Prober kept
    the shard's own only, so a shard rebuilt at the address where another took 20-40 s
    steps, inside its first long step there, was wedged at two waits and condemned."""
    busy = fixture_text("vllm-0.32/busy-1.txt")
    idle = fixture_text("vllm-0.32/idle-1.txt")
    now = time.time()
    reads: list[int] = []
    replaced = threading.Event()

    def started(body: str, start: float) -> str:
        return re.sub(
            r"^process_start_time_seconds .*$",
            f"process_start_time_seconds {start}",
            body,
            flags=re.M,
        )

    def long_stepping() -> str:
        n = len(reads)
        reads.append(n)
        if replaced.is_set():  # shard 0's replacement, past startup, inside a long step
            return started(busy, now - 1800)
        body = re.sub(
            r"^(vllm:(?:iteration_tokens_total_count|generation_tokens_total)\{[^}]*\}) "
            r"[0-9.e+]+$",
            lambda m: f"{m.group(1)} {5000.0 + 100.0 * n}",
            started(busy, now - 7200),
            flags=re.M,
        )
        return re.sub(
            r'^(vllm:inter_token_latency_seconds_bucket\{engine="0",'
            r'le="(?:40\.0|80\.0|\+Inf)"[^}]*\}) [0-9.e+]+$',
            lambda m: f"{m.group(1)} 3324.0",
            body,
            flags=re.M,
        )

    httpserver.expect_request("/metrics").respond_with_handler(
        lambda request: Response(long_stepping(), content_type="text/plain; version=0.0.4")
    )
    other = HTTPServer(host="127.0.0.1", port=0)
    other.expect_request("/metrics").respond_with_handler(
        lambda request: Response(started(idle, now - 7200), content_type="text/plain")
    )
    other.expect_request("/c/metrics").respond_with_handler(
        lambda request: Response(started(idle, now - 60), content_type="text/plain")
    )
    other.start()

    async def main(a: str, b: str) -> tuple[FleetHealth, list[VerdictKind | None]]:
        fleet = FleetHealth([a, b])
        verdicts: list[VerdictKind | None] = []
        async with Prober(fleet, wait=WAIT, timeout=2.0, answer_timeout=2.0) as prober:
            for _ in range(2):  # shard 1 learns its server's long step
                results = await prober.probe()
                verdicts += [r.verdict for r in results if r.key == 1]
                await asyncio.sleep(INTERVAL)
            assert VerdictKind.BUSY in verdicts, verdicts
            # The trainer rebuilds both: shard 1 elsewhere, shard 0 at shard 1's former
            # server (the hardware there takes long steps).
            for key, url in ((1, f"{a}/c"), (0, b)):
                fleet.record_actor_death(key, "ActorDiedError")
                fleet.mark_restarting(key)
                fleet.mark_loaded(key, base_url=url)
                fleet.report_refit(key, weight_version=1)
            replaced.set()
            verdicts.clear()
            for _ in range(5):
                results = await prober.probe()
                verdicts += [r.verdict for r in results if r.key == 0]
                await asyncio.sleep(INTERVAL)
        return fleet, verdicts

    try:
        fleet, verdicts = asyncio.run(
            main(other.url_for("").rstrip("/"), httpserver.url_for("").rstrip("/"))
        )
    finally:
        other.clear()
        other.stop()
    assert VerdictKind.WEDGED not in verdicts, (verdicts, fleet.snapshot()[0].last_error)
    assert fleet.state_of(0) is State.HEALTHY, fleet.snapshot()[0]


@pytest.mark.slow
def test_the_servers_whose_step_is_remembered_are_bounded(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A step per server outlives the shard that moved away (the hardware stays), so a
    trainer rebuilding on fresh ports added one each time for its process's life: the
    servers heard from longest ago are let go past the bound."""
    monkeypatch.setattr(llmhealth.prober, "_SERVERS_REMEMBERED", 2)

    async def main(urls: list[str]) -> list[str]:
        fleet = FleetHealth(urls[:1])
        async with Prober(fleet, wait=WAIT, timeout=2.0, answer_timeout=2.0) as prober:
            for url in urls:
                if url != urls[0]:  # the shard rebuilt at the next address
                    fleet.record_actor_death(0, "rebuilt")
                    fleet.mark_restarting(0)
                    fleet.mark_loaded(0, base_url=url)
                    fleet.report_refit(0, weight_version=1)
                for _ in range(20):
                    if (await prober.probe())[0].verdict is not None:
                        break
                    await asyncio.sleep(INTERVAL)
            return list(prober._learned_at)

    with running_simulator(["busy", "busy", "busy"]) as sim:
        remembered = asyncio.run(main(sim.urls))
    assert remembered == [same_server(url) for url in sim.urls[1:]], remembered


@contextlib.contextmanager
def _tls_backends_that_keep_quiet(
    count: int, where: Path, monkeypatch: pytest.MonkeyPatch, client: type[Client] = Client
) -> Iterator[list[str]]:
    """``count`` https backends that answer one read of /metrics on a kept connection,
    then hold it open without a word: closing it, the Prober waits for a TLS goodbye that
    never comes (``wire.Connection.aclose``). The Prober's clients, of class ``client``,
    trust their certificate."""
    cert, key = make_certificate(where)
    server_side = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server_side.load_cert_chain(cert, key)
    trusting = ssl.create_default_context(cafile=str(cert))
    monkeypatch.setattr(llmhealth.prober, "new_client", lambda: client(trusting))
    metrics = (Path(__file__).parent.parent / "fixtures" / "vllm-0.32" / "busy-1.txt").read_bytes()
    answer = b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(metrics), metrics)
    stop = threading.Event()
    listeners = [socket.create_server(("127.0.0.1", 0)) for _ in range(count)]

    def serve(listener: socket.socket) -> None:
        listener.settimeout(5)
        with contextlib.suppress(OSError):
            connection, _ = listener.accept()
            connection.settimeout(5)
            with server_side.wrap_socket(connection, server_side=True) as tls:
                tls.recv(65536)
                tls.sendall(answer)
                stop.wait(10)

    threads = [threading.Thread(target=serve, args=(listener,)) for listener in listeners]
    for thread in threads:
        thread.start()
    try:
        yield [f"https://127.0.0.1:{listener.getsockname()[1]}" for listener in listeners]
    finally:
        stop.set()
        for thread in threads:
            thread.join(10)
        for listener in listeners:
            listener.close()


def test_a_prober_closed_while_it_lets_go_of_departed_tls_backends_raises_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``aclose`` from a controller's shutdown while a call let go of two backends that
    left the serving set: the first one's TLS close waited for the goodbye, the close
    emptied the slots meanwhile, and the call raised KeyError for the second."""

    async def main(urls: list[str]) -> None:
        fleet = FleetHealth(urls)
        prober = Prober(fleet, wait=0.05, timeout=2.0)
        await prober.probe()
        fleet.record_actor_death(0, "gone")
        fleet.record_actor_death(1, "gone")
        reading = asyncio.create_task(prober.probe())
        await asyncio.sleep(0.02)  # the call waits for shard 0's TLS goodbye
        await prober.aclose()
        assert [result.key for result in await reading] == [2]

    with _tls_backends_that_keep_quiet(3, tmp_path, monkeypatch) as urls:
        asyncio.run(main(urls))


def test_a_prober_closed_while_it_lets_go_of_a_moved_tls_backend_reads_nothing_after(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``aclose`` while a call closed the connection of a backend rebuilt at a new address:
    that close waited for the TLS goodbye, and then the call read the new address anyway,
    after the Prober was closed, on a connection nobody closed."""
    replacement = socket.create_server(("127.0.0.1", 0))
    replacement.settimeout(0.05)
    stop = threading.Event()
    accepted: list[int] = []

    def serve() -> None:
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                connection, _ = replacement.accept()
                accepted.append(1)
                connection.close()

    async def main(old: str) -> None:
        fleet = FleetHealth([old])
        prober = Prober(fleet, wait=0.05, timeout=2.0)
        await prober.probe()
        fleet.record_actor_death(0, "rebuilt")
        fleet.mark_restarting(0)
        fleet.mark_loaded(0, base_url=f"http://127.0.0.1:{replacement.getsockname()[1]}")
        fleet.report_refit(0, weight_version=1)
        reading = asyncio.create_task(prober.probe())
        await asyncio.sleep(0.02)  # the call waits for the old connection's TLS goodbye
        await prober.aclose()
        await reading

    thread = threading.Thread(target=serve)
    thread.start()
    try:
        with _tls_backends_that_keep_quiet(1, tmp_path, monkeypatch) as urls:
            asyncio.run(main(urls[0]))
    finally:
        stop.set()
        thread.join(5)
        replacement.close()
    assert accepted == []


@pytest.mark.parametrize("parting", ["departed", "closed"])
def test_the_goodbyes_of_departed_tls_backends_are_awaited_together_not_in_turn(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, httpserver: HTTPServer, parting: str
) -> None:
    """A node lost with its shards (``record_actor_death`` for each): closing each one's
    kept TLS connection waits up to 0.1 s for a goodbye that never comes, and the call
    waited for them one after another before reading anything, so 30 of them held every
    surviving backend's read back 3 s, past a controller's bound on its call. Counted,
    not timed: how many of those closes were under way at once."""
    departed = 30
    metrics = (Path(__file__).parent.parent / "fixtures" / "vllm-0.32" / "busy-1.txt").read_text()
    httpserver.expect_request("/metrics").respond_with_data(metrics, content_type="text/plain")
    survivor = httpserver.url_for("").rstrip("/")
    closing = [0, 0]  # under way now, the most at once

    class Counted(Client):
        async def aclose(self) -> None:
            closing[0] += 1
            closing[1] = max(closing)
            try:
                await super().aclose()
            finally:
                closing[0] -= 1

    async def main(urls: list[str]) -> list[ProbeResult]:
        fleet = FleetHealth([*urls, survivor])
        async with Prober(fleet, wait=0.05, timeout=2.0) as prober:
            results = await prober.probe()  # each keeps its connection
            if parting == "closed":  # a controller's shutdown: every one at the exit
                return results
            for shard in range(departed):
                fleet.record_actor_death(shard, "node lost")
            await asyncio.sleep(0.1)
            return await prober.probe()

    with _tls_backends_that_keep_quiet(departed, tmp_path, monkeypatch, Counted) as urls:
        results = asyncio.run(main(urls))
    if parting == "closed":
        assert len(results) == departed + 1
        assert closing[1] == departed + 1  # all together (one after another: 1)
    else:
        assert [result.key for result in results] == [departed]
        assert closing[1] == departed
