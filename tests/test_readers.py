"""Read workers: `watch` reading its fleet in worker processes, settling it alone.

Real `llmhealth watch` processes with `read_workers = 2` against a real simulator: the
verdicts and the audited proof are the ones the daemon's own loop gives, a worker killed
costs its share a verdict that says so (never a silent healthy one) and is started
again, and SIGTERM stops every process. Then the pipe's bookkeeping, in this process:
the daemon's copy of each window follows the worker's through appends, cuts and resets.
Last, a probing task's pause against a server that closes connections idle for the wait.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import os
import pickle
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Coroutine, Iterator, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from captures import asleep_capture
from pytest_httpserver import HTTPServer
from rich.console import Console
from simproc import Simulator, alive, children, running_simulator
from test_daemon import Page, fleet_config, watching, write_config
from test_wire import read_request, tcp_server
from werkzeug import Request, Response

from llmhealth import config as config_module
from llmhealth import readers
from llmhealth.actions import AuditLog
from llmhealth.classify import Outcome, Read, Target, Verdict, VerdictKind
from llmhealth.cycle import settle_fleet
from llmhealth.daemon import Daemon
from llmhealth.metrics import EngineSignals, Signals, parse_metrics
from llmhealth.probe import ProbeSettings
from llmhealth.remediate import Mode
from llmhealth.state import StateFile
from llmhealth.window import LongestStep, WedgeRules

MODES = ["busy", "busy", "wedge:0", "wedge:0", "idle"]
SHARES = [0, 1, 0, 1, 0]  # the read worker each of them gets


@pytest.fixture(scope="module")
def sim() -> Iterator[Simulator]:
    with running_simulator(MODES) as simulator:
        yield simulator


def names_for(sim: Simulator) -> dict[str, str]:
    """A name per simulated backend, chosen so that each of two workers reads a busy and
    a wedged one, and the first the idle one too."""
    names = {}
    for url, mode, share in zip(sim.urls, MODES, SHARES, strict=True):
        kind = mode.split(":", 1)[0]
        candidates = (f"{kind}-{n}" for n in itertools.count())
        names[next(c for c in candidates if readers.share_of(c, 2) == share)] = url
    return names


def expected_verdict(name: str) -> str:
    return {"busy": "busy", "wedge": "wedged", "idle": "idle"}[name.split("-", 1)[0]]


@pytest.mark.slow
@pytest.mark.usefixtures("each_loop")
def test_read_workers_judge_the_fleet_survive_a_killed_worker_and_stop_on_sigterm(
    entry_point: str, sim: Simulator, tmp_path: Path
) -> None:
    backends = names_for(sim)
    config = write_config(
        tmp_path / "fleet.toml",
        fleet_config(
            [{"name": name, "url": url} for name, url in backends.items()], read_workers=2
        ),
    )
    with watching(entry_point, config, tmp_path / "state.json") as watch:
        judged = watch.until(
            "every backend judged by the workers",
            lambda p: (
                all(p.verdict(n) == expected_verdict(n) for n in backends)
                and all(p.state(n) == "dead" for n in backends if n.startswith("wedge"))
            ),
        )
        workers = children(watch.process.pid)
        assert len(workers) == 2, workers
        # Nicer than the daemon, so its settle is not slowed by the reads it settles.
        daemon_nice = os.getpriority(os.PRIO_PROCESS, watch.process.pid)
        for pid in workers:
            assert os.getpriority(os.PRIO_PROCESS, pid) == min(
                19, daemon_nice + readers.READ_WORKER_NICENESS
            ), pid
        # The proof audited for a wedge is the frozen window itself, rebuilt from the
        # reads the workers sent one at a time.
        audit = [json.loads(line) for line in (tmp_path / "audit.jsonl").read_text().splitlines()]
        proven = [r for r in audit if r["event"] == "wedge_proven"]
        assert {r["backend"] for r in proven} == {n for n in backends if n.startswith("wedge")}
        for record in proven:
            reads = record["evidence"]["reads"]
            assert len(reads) >= 3
            assert len({json.dumps(read["engines"]) for read in reads}) == 1, "frozen"

        # Kill the worker that reads share 0: its backends get a verdict saying so, and
        # keep their ledger state; the other worker's backends are not touched.
        log = watch.logged("read worker processes (pids ")
        listed = log.split("read worker processes (pids ", 1)[1].split(")", 1)[0]
        victim = int(listed.split(", ")[0])
        assert {int(pid) for pid in listed.split(", ")} == workers
        lost = [n for n in backends if readers.share_of(n, 2) == 0]
        kept = [n for n in backends if n not in lost]
        states = {n: judged.state(n) for n in backends}
        # Stopped first, for two settles: a judged verdict of its still unsettled holds the
        # notice back a settle (daemon.hear), and the new worker's verdict, a wait later,
        # would then replace the notice before any page showed it.
        os.kill(victim, signal.SIGSTOP)
        watch.next_cycle(watch.next_cycle(judged))
        os.kill(victim, signal.SIGKILL)
        doubted: set[str] = set()

        def doubted_then_judged_again(page: Page) -> bool:
            assert {n: page.state(n) for n in backends} == states
            assert all(page.verdict(n) == expected_verdict(n) for n in kept)
            doubted.update(n for n in lost if page.verdict(n) == "no_metrics")
            return doubted == set(lost) and all(
                page.verdict(n) == expected_verdict(n) for n in lost
            )

        watch.until(
            "the killed worker's backends doubted, then judged anew", doubted_then_judged_again
        )
        log = watch.logged(f"(pid {victim}) exited (-9); its {len(lost)} targets")
        assert "read afresh by a new one" in log
        now = children(watch.process.pid)
        assert len(now) == 2 and victim not in now, now
        rc, _ = watch.stop()
    assert rc == 0
    assert not any(alive(pid) for pid in now | workers)


def test_a_worker_refused_its_niceness_reads_on(monkeypatch: pytest.MonkeyPatch) -> None:
    # A unit whose system call filter refuses setpriority (EPERM) made every worker exit
    # at its start, to be started again each wait, its targets never judged.
    def refused(_increment: int) -> int:
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(os, "nice", refused)
    readers.yield_to_the_settle()


def test_a_hangup_of_the_whole_group_reloads_the_daemon_and_kills_no_worker() -> None:
    """SIGHUP is the daemon's reload, but it reaches the workers too when sent to the
    group (`systemctl kill -s HUP`, a terminal hung up): each died of it, and every
    backend was doubted, not judged, until workers were started again a wait later."""
    heard: list[Verdict | None] = []
    logged: list[str] = []

    async def main() -> None:
        pool = _delivering_pool(
            lambda verdict, _w: heard.append(verdict),
            lambda: ProbeSettings(wait=0.2, timeout=0.5),
            logged.append,
        )
        await pool.start()
        try:
            pool.assign([Target("b", "http://127.0.0.1:9", "backend")])
            for _ in range(400):  # its first examination: the worker is past its start
                if heard:
                    break
                await asyncio.sleep(0.05)
            assert heard, "the worker never read"
            os.kill(pool.pids[0], signal.SIGHUP)
            examined = len(heard)
            for _ in range(400):
                if logged or len(heard) >= examined + 3:
                    break
                await asyncio.sleep(0.05)
        finally:
            await pool.close()

    asyncio.run(main())
    assert not logged, logged


# Put on a new worker's sys.path: its import of llmhealth.readers says so, then takes 3 s.
SLOW_IMPORT = """
import os, sys, time

class Slow:
    def find_spec(self, name, path=None, target=None):
        if name == "llmhealth.readers":
            sys.meta_path.remove(self)
            open(os.environ["IMPORTING_MARK"], "w").close()
            time.sleep(3)
        return None

sys.meta_path.insert(0, Slow())
"""


@pytest.mark.slow  # 4 s: a worker's import held 3 s
def test_a_hangup_of_the_whole_group_while_a_worker_imports_kills_it_not(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ignored from ``main`` on, SIGHUP still killed a worker during its import of
    llmhealth (0.2-1.5 s): a hangup of the group at the daemon's start, or just after a
    worker was replaced, doubted its share until the next was started a wait later."""
    (tmp_path / "sitecustomize.py").write_text(SLOW_IMPORT)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    mark = tmp_path / "importing"
    monkeypatch.setenv("IMPORTING_MARK", str(mark))
    logged: list[str] = []

    async def main() -> None:
        pool = _delivering_pool(lambda _v, _w: None, lambda: ProbeSettings(wait=0.2), logged.append)
        await pool.start()
        try:
            for _ in range(400):
                if mark.exists():
                    break
                await asyncio.sleep(0.01)
            assert mark.exists(), "the worker never imported llmhealth.readers"
            os.kill(pool.pids[0], signal.SIGHUP)
            await asyncio.sleep(0.5)
        finally:
            await pool.close()

    asyncio.run(main())
    assert not logged, logged


@pytest.mark.slow  # 8 s: a worker stopped, noticed silent, killed, replaced
def test_a_stopped_read_worker_is_noticed_killed_and_replaced(
    entry_point: str, sim: Simulator, tmp_path: Path
) -> None:
    """Stopped (or deadlocked), a worker is alive and its pipe never ends: its targets
    kept their last verdicts, serving, for as long as it stayed stopped. Its silence
    past twice an examination's longest is now a loss like an exit."""
    backends = names_for(sim)
    config = write_config(
        tmp_path / "fleet.toml",
        fleet_config(
            [{"name": name, "url": url} for name, url in backends.items()], read_workers=2
        ),
    )
    # A planted package where watch starts: workers must import the installed one.
    planted = tmp_path / "cwd" / "llmhealth"
    planted.mkdir(parents=True)
    marker = tmp_path / "planted-imported"
    planted.joinpath("__init__.py").write_text(f"open({str(marker)!r}, 'w').close()\n")
    with watching(entry_point, config, tmp_path / "state.json", cwd=planted.parent) as watch:
        watch.until(
            "every backend judged by the workers",
            lambda p: all(p.verdict(n) == expected_verdict(n) for n in backends),
        )
        log = watch.logged("read worker processes (pids ")
        listed = log.split("read worker processes (pids ", 1)[1].split(")", 1)[0]
        victim = int(listed.split(", ")[0])
        lost = [n for n in backends if readers.share_of(n, 2) == 0]
        os.kill(victim, signal.SIGSTOP)
        try:
            log = watch.logged(f"(pid {victim}) exited (-9); it sent nothing for ")
            watch.until(
                "the new worker's verdicts",
                lambda p: all(p.verdict(n) == expected_verdict(n) for n in backends),
            )
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(victim, signal.SIGKILL)
        assert f"its {len(lost)} targets read afresh by a new one" in log
        rc, _ = watch.stop()
    assert rc == 0
    assert not marker.exists(), "a worker imported llmhealth from the working directory"


@pytest.mark.slow  # 8 s of a worker beating while it waits
def test_a_worker_waiting_minutes_on_a_tiny_request_is_not_taken_for_a_stopped_one() -> None:
    """A tiny request waits three times the longest step learned (up to max_check_time),
    so a worker whose targets all wait on one sends no examination for that long: it
    says it is alive once a wait, and is left alone (it was killed, and its replacement
    waited as long, for ever, the backend never judged)."""
    settings = ProbeSettings(wait=0.5, timeout=1.0, answer_timeout=0.5, max_check_time=30.0)
    logged: list[str] = []
    heard: list[Verdict | None] = []

    async def main(url: str) -> None:
        pool = _delivering_pool(
            lambda verdict, _w: heard.append(verdict), lambda: settings, logged.append
        )
        await pool.start()
        assert pool._silence_bound() == readers.SILENT_FLOOR  # 5 s: ten waits are less
        pool.remember({}, {"idle": LongestStep(2.5, "earlier runs")})  # a 7.5 s answer wait
        pool.assign([Target("idle", url, "backend")])
        for _ in range(300):
            if any(v is not None for v in heard):
                break
            await asyncio.sleep(0.05)
        await pool.close()

    with running_simulator(["unanswered"]) as one:
        asyncio.run(main(one.urls[0]))
    assert not [line for line in logged if "sent nothing" in line], logged
    decided = [v for v in heard if v is not None]
    assert decided and decided[0].kind is VerdictKind.UNANSWERED


@pytest.mark.slow  # a worker first sleeps through a 30 s wait's beat
def test_a_worker_beats_at_the_newest_waits_pace_after_a_reload_shortens_it() -> None:
    """Its beat kept the old wait's spacing until that sleep ended, while the daemon's
    bound followed the new wait at the next frame: a working worker, between two long
    examinations, was killed as silent."""
    settings = ProbeSettings(wait=30.0, timeout=1.0, answer_timeout=6.0, max_check_time=60.0)
    logged: list[str] = []
    heard: list[Verdict | None] = []

    async def main(url: str) -> None:
        nonlocal settings
        pool = _delivering_pool(
            lambda verdict, _w: heard.append(verdict), lambda: settings, logged.append
        )
        await pool.start()
        pool.assign([])
        await asyncio.sleep(6.0)  # past the worker's first beat: its sleep is 30 s now
        settings = replace(settings, wait=0.5)
        pool.assign([Target("idle", url, "backend")])
        for _ in range(260):  # two examinations of 6 s each, with room
            if len([v for v in heard if v is not None]) >= 2:
                break
            await asyncio.sleep(0.05)
        await pool.close()

    with running_simulator(["unanswered"]) as one:
        asyncio.run(main(one.urls[0]))
    assert not [line for line in logged if "sent nothing" in line], logged
    assert len([v for v in heard if v is not None]) >= 2


GIVING_BACK_COUNTED = """
import sys
import llmhealth.readers as readers
readers.give_back_free_pages = lambda: print("given back", file=sys.stderr, flush=True)
readers.main()
"""


@pytest.mark.slow  # 3 s of waits
def test_a_worker_hands_back_heap_pages_each_wait_however_often_shares_come() -> None:
    """Shares come at each settle whose news changed, about once a wait; restarting the
    beat at each one restarted the wait before the pages were handed back, so they
    never were."""
    worker = subprocess.Popen(
        [sys.executable, "-P", "-c", GIVING_BACK_COUNTED],
        stdin=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    assert worker.stdin is not None and worker.stderr is not None
    share = readers._frame(readers._Share(ProbeSettings(wait=0.3), (), {}, {}))
    try:
        for _ in range(20):  # a share twice a wait, for six waits
            worker.stdin.write(share)
            worker.stdin.flush()
            time.sleep(0.15)
    finally:
        worker.stdin.close()
        said = worker.stderr.read().decode()  # to its end: the worker leaves at the pipe's
        worker.stderr.close()
        worker.wait(10)
    assert said.count("given back") >= 2, said


def test_a_worker_that_cannot_be_started_is_tried_again_not_a_crash(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Out of processes at start (fork's EAGAIN), watch died with a traceback, and under
    systemd's Restart= that was a loop; a restart that failed with RuntimeError (no
    thread for asyncio's child watcher) was never tried again."""
    real = asyncio.create_subprocess_exec
    failures = [BlockingIOError(11, "Resource temporarily unavailable"), RuntimeError("no thread")]

    async def exhausted(*args: Any, **kwargs: Any) -> asyncio.subprocess.Process:
        if failures:
            raise failures.pop(0)
        return await real(*args, **kwargs)

    monkeypatch.setattr(readers.asyncio, "create_subprocess_exec", exhausted)
    logged: list[str] = []

    async def main() -> list[int]:
        pool = readers.ReadPool(
            1,
            lambda: ProbeSettings(wait=0.05),
            lambda *_: None,
            lambda _n, _c: None,
            logged.append,
            lambda: ({}, {}),
        )
        await pool.start()
        for _ in range(200):
            if pool.pids:
                break
            await asyncio.sleep(0.05)
        pids = pool.pids
        await pool.close()
        return pids

    pids = asyncio.run(main())
    assert len(pids) == 1
    assert logged[0].startswith("read worker 1 not started: [Errno 11]")
    assert logged[1] == "read worker 1 not started again: no thread"


def test_a_worker_never_started_gives_its_share_verdicts_that_say_so(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Out of processes for as long as it lasted, the share had no verdict at all and
    kept its saved states, serving; a lost worker's share is told at once."""

    async def exhausted(*_args: Any, **_kwargs: Any) -> asyncio.subprocess.Process:
        raise BlockingIOError(11, "Resource temporarily unavailable")

    monkeypatch.setattr(readers.asyncio, "create_subprocess_exec", exhausted)
    heard: list[Verdict | None] = []

    async def main() -> None:
        pool = _delivering_pool(lambda verdict, _w: heard.append(verdict))
        await pool.start()
        pool.assign([Target("b", "http://127.0.0.1:9", "backend")])
        # Once while it stays unstarted: each would count as an examination.
        pool.assign([Target("b", "http://127.0.0.1:9", "backend")])
        # A target a reload adds is told too.
        pool.assign([Target(n, "http://127.0.0.1:9", "backend") for n in ("b", "c")])
        await pool.close()

    asyncio.run(main())
    assert len(heard) == 2
    for verdict in heard:
        assert verdict is not None and not verdict.judged
        assert "not judged: read worker 1 not started; its reads start afresh" in verdict.evidence


def test_a_target_a_reload_gives_a_worker_that_is_not_reading_is_told_so(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A reload that added a target to a worker not started, or lost and not started
    again, sent it nothing: the new backend was admitted healthy and serving, and stayed
    so unread for as long as the worker stayed down."""
    real = asyncio.create_subprocess_exec
    started: list[asyncio.subprocess.Process] = []

    async def once(*args: Any, **kwargs: Any) -> asyncio.subprocess.Process:
        if started:
            raise BlockingIOError(11, "Resource temporarily unavailable")
        started.append(await real(*args, **kwargs))
        return started[0]

    monkeypatch.setattr(readers.asyncio, "create_subprocess_exec", once)
    heard: list[tuple[str, Verdict | None]] = []

    async def main() -> None:
        pool = readers.ReadPool(
            1,
            lambda: ProbeSettings(wait=0.2),
            lambda target, verdict, _s, _w: heard.append((target.name, verdict)),
            lambda _n, _c: None,
            lambda _m: None,
            lambda: ({}, {}),
        )
        await pool.start()
        pool.assign([Target("b", "http://127.0.0.1:9", "backend")])
        started[0].kill()  # lost; every start after it fails
        async with asyncio.timeout(30):
            while not any(verdict is not None and not verdict.judged for _, verdict in heard):
                await asyncio.sleep(0.01)
        told = len(heard)
        pool.assign([Target(n, "http://127.0.0.1:9", "backend") for n in ("b", "c")])
        pool.assign([Target(n, "http://127.0.0.1:9", "backend") for n in ("b", "c")])
        pool.assign([Target("b", "http://127.0.0.1:9", "backend")])  # c dropped...
        pool.assign([Target(n, "http://127.0.0.1:9", "backend") for n in ("b", "c")])  # back
        pool.assign([Target("b", "http://127.0.0.1:8", "backend")])  # b moved
        await pool.close()
        # Once each, the new one; again when it came back, or moved.
        assert [name for name, _ in heard[told:]] == ["c", "c", "b"]

    asyncio.run(main())
    new = heard[-1][1]
    assert new is not None and not new.judged
    assert "not judged: read worker 1 not running; its reads start afresh" in new.evidence


# A worker whose first frame the daemon cannot take in: a Read with a field too many,
# as a worker of another llmhealth version would send it. It then waits for its pipe.
FORGED_FRAME_WORKER = """
import dataclasses, pickle, sys
from llmhealth import readers
from llmhealth.classify import Read

class Forged:
    def __reduce__(self):
        return (Read, tuple(range(len(dataclasses.fields(Read)) + 1)))

body = pickle.dumps([Forged()])
sys.stdout.buffer.write(readers._HEADER.pack(len(body)) + body)
sys.stdout.flush()
sys.stdin.buffer.read()
"""


def _one_target_until_logged(polls: int) -> tuple[list[str], list[Verdict | None]]:
    """A pool at a 60 s wait reading one target until its first log line (or `polls`
    times 50 ms), then closed: what it logged, and the verdicts it delivered."""
    logged: list[str] = []
    heard: list[Verdict | None] = []

    async def main() -> None:
        pool = _delivering_pool(
            lambda verdict, _w: heard.append(verdict),
            lambda: ProbeSettings(wait=60.0),
            logged.append,
        )
        await pool.start()
        pool.assign([Target("b", "http://127.0.0.1:9", "backend")])
        for _ in range(polls):
            if logged:
                break
            await asyncio.sleep(0.05)
        await pool.close()

    asyncio.run(main())
    return logged, heard


def test_a_frame_that_cannot_be_taken_in_for_any_reason_replaces_the_worker(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Only some errors were caught: a TypeError ended the reading of that worker's pipe
    unseen, the worker ran on unread, its backends kept their last verdicts, serving."""
    real = asyncio.create_subprocess_exec

    async def forged(*_args: Any, **kwargs: Any) -> asyncio.subprocess.Process:
        return await real(sys.executable, "-P", "-c", FORGED_FRAME_WORKER, **kwargs)

    monkeypatch.setattr(readers.asyncio, "create_subprocess_exec", forged)
    logged, heard = _one_target_until_logged(polls=400)
    assert logged and "it sent what cannot be read (TypeError: " in logged[0], logged
    assert "its 1 targets read afresh by a new one" in logged[0]
    assert [v is not None and not v.judged for v in heard] == [True]


SILENCED_WORKER = """
import os, time
os.close(1)  # its frames end (an exit hung on a thread that does not end)
time.sleep(120)  # and it does not leave
"""
WRITERLESS_WORKER = """
from llmhealth import readers

def gone(self, pipe):  # the frame writer thread ends, its pipe closed; the loop reads on
    with pipe:
        raise OSError(5, "Input/output error")

readers._Sender._write = gone
readers.main()
"""


@pytest.mark.parametrize(
    ("program", "ended"),
    [
        (WRITERLESS_WORKER, "exited (0); its 1 targets"),  # it leaves when told to
        (SILENCED_WORKER, "exited (-9); its frames ended and it did not leave; its 1 targets"),
    ],
    ids=["writer-gone", "exit-hung"],
)
def test_a_worker_whose_frames_end_but_that_does_not_leave_is_replaced(
    monkeypatch: pytest.MonkeyPatch, program: str, ended: str
) -> None:
    """At the end of its frames the pool waited for the worker's exit without a bound:
    one whose pipe ended while it lived on (its writer thread gone, its loop reading on;
    or its exit hung on a thread that does not end) was never replaced, its backends
    keeping their last verdicts, serving, and no silence bound ever came due."""
    real = asyncio.create_subprocess_exec
    spawned: list[asyncio.subprocess.Process] = []

    async def silenced(*_args: Any, **kwargs: Any) -> asyncio.subprocess.Process:
        process = await real(sys.executable, "-P", "-c", program, **kwargs)
        spawned.append(process)
        return process

    monkeypatch.setattr(readers.asyncio, "create_subprocess_exec", silenced)
    monkeypatch.setattr(readers, "STOP_TIMEOUT", 0.5)
    try:
        logged, heard = _one_target_until_logged(polls=200)  # 10 s: the silence bound is 600 s
    finally:
        for process in spawned:
            if process.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(process.pid, signal.SIGKILL)
    assert logged, "a worker whose frames ended lived on, its share never replaced"
    assert f"(pid {spawned[0].pid}) {ended}" in logged[0], logged
    assert "read afresh by a new one" in logged[0]
    assert [v is not None and not v.judged for v in heard] == [True]


def test_a_probing_task_that_dies_leaves_a_verdict_that_says_so_not_its_last(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Dying at every examination after a first good one, a task left the backend's
    last verdict ("busy", serving) standing for ever, one log line a wait."""
    examinations = itertools.count()

    async def once_then_broken(*_args: Any, **_kwargs: Any) -> Verdict:
        if next(examinations) == 0:
            return Verdict(VerdictKind.BUSY, True, "busy: working")
        raise RuntimeError("a bug past examine_once's guard")

    monkeypatch.setattr(readers, "examine_once", once_then_broken)
    heard: list[Verdict | None] = []
    died: list[str] = []

    async def main() -> None:
        tasks = readers.ReadTasks(
            lambda: ProbeSettings(wait=0.05),
            time.time,
            lambda _t, verdict, _s, _w: heard.append(verdict),
            lambda _name, cause: died.append(cause),
        )
        tasks.assign([Target("b", "http://127.0.0.1:9", "backend")])
        for _ in range(200):
            if died:
                break
            await asyncio.sleep(0.05)
        await tasks.close()

    asyncio.run(main())
    assert died[0] == "RuntimeError: a bug past examine_once's guard"
    first, second = heard[:2]
    assert first is not None and first.kind is VerdictKind.BUSY
    assert second is not None and not second.judged and not second.healthy
    assert "its probing task died (RuntimeError: a bug past" in second.evidence


HUNG_WORKER = "import time; time.sleep(120)"  # deaf to its pipe's end


def test_hung_workers_are_given_their_time_to_leave_together_not_in_turn(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """In turn, each hung worker took STOP_TIMEOUT of a stop systemd bounds: three of
    them after the last settle's own bound got the daemon killed mid-stop."""
    real = asyncio.create_subprocess_exec

    async def hung(*_args: Any, **kwargs: Any) -> asyncio.subprocess.Process:
        return await real(sys.executable, "-c", HUNG_WORKER, **kwargs)

    monkeypatch.setattr(readers.asyncio, "create_subprocess_exec", hung)
    monkeypatch.setattr(readers, "STOP_TIMEOUT", 0.5)
    let_leave = readers._let_leave
    leaving: list[int] = []
    most_at_once = 0

    async def counted(process: asyncio.subprocess.Process) -> None:
        nonlocal most_at_once
        leaving.append(process.pid)
        most_at_once = max(most_at_once, len(leaving))
        try:
            await let_leave(process)
        finally:
            leaving.remove(process.pid)

    monkeypatch.setattr(readers, "_let_leave", counted)

    async def main() -> list[int | None]:
        pool = readers.ReadPool(
            3, ProbeSettings, lambda *_: None, lambda _n, _c: None, print, lambda: ({}, {})
        )
        await pool.start()
        processes = [w.process for w in pool._workers]
        await pool.close()
        return [p.returncode if p is not None else None for p in processes]

    assert asyncio.run(main()) == [-signal.SIGKILL] * 3
    assert most_at_once == 3


def quiet_pool(
    *,
    workers: int = 1,
    wait: float = 0.2,
    news: tuple[dict[str, Signals], dict[str, LongestStep]] | None = None,
) -> readers.ReadPool:
    """A pool whose verdicts, task deaths and log go nowhere: a test watches its workers
    and frames; ``news`` is the record's, as the daemon's ``_record_news`` gives it."""
    told = news if news is not None else ({}, {})
    return readers.ReadPool(
        workers,
        lambda: ProbeSettings(wait=wait),
        lambda *_: None,
        lambda _n, _c: None,
        lambda _m: None,
        lambda: told,
    )


async def _kill_the_worker(pool: readers.ReadPool) -> None:
    [worker] = pool._workers
    assert worker.process is not None
    worker.process.kill()  # lost: started again a wait later
    async with asyncio.timeout(30):
        while worker.reading:
            await asyncio.sleep(0.01)


def _run_killing_what_is_left(
    main: Coroutine[Any, Any, list[int | None]], spawned: list[asyncio.subprocess.Process]
) -> list[int | None]:
    """``main``'s worker exit codes; every worker it started that still runs is killed
    after it, pass or fail, so none outlives the test."""
    try:
        return asyncio.run(main)
    finally:
        for process in spawned:
            if process.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(process.pid, signal.SIGKILL)


def test_a_worker_started_again_while_the_pool_closes_does_not_outlive_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A lost worker's replacement whose start was under way when close() began was
    never told to leave nor waited for: it read on after the pool had closed."""
    real = asyncio.create_subprocess_exec
    spawned: list[asyncio.subprocess.Process] = []
    respawning = asyncio.Event()
    gate = asyncio.Event()

    async def gated(*args: Any, **kwargs: Any) -> asyncio.subprocess.Process:
        if len(spawned) >= 2:  # the replacement: held until close() is under way
            respawning.set()
            await gate.wait()
        process = await real(*args, **kwargs)
        spawned.append(process)
        return process

    monkeypatch.setattr(readers.asyncio, "create_subprocess_exec", gated)
    monkeypatch.setattr(readers, "STOP_TIMEOUT", 0.5)

    async def main() -> list[int | None]:
        pool = quiet_pool(workers=2, wait=0.05)
        await pool.start()
        pool.assign([])
        first, second = spawned
        first.kill()  # lost: started again one wait later
        await respawning.wait()
        second.send_signal(signal.SIGSTOP)  # slow to leave: close() waits for it
        closing = asyncio.create_task(pool.close())
        for _ in range(5):
            await asyncio.sleep(0)
        gate.set()
        await closing
        return [p.returncode for p in spawned]

    codes = _run_killing_what_is_left(main(), spawned)
    assert len(codes) == 3
    assert None not in codes, f"a worker outlived the pool's close: {codes}"


def test_a_worker_forgets_what_it_sent_of_targets_no_longer_its_own() -> None:
    """Kept by name for every target it ever read: a fleet whose names change (pods)
    grew a worker by a read per name."""
    read, write = os.pipe()

    async def main() -> list[str]:
        sender = readers._Sender(os.fdopen(write, "wb", buffering=0))
        for name in ("old-0", "old-1", "kept"):
            sender.deliver(Target(name, "http://127.0.0.1:9"), None, 0.0, [_read(1.0, 1.0)])
        sender.keep_only({"kept", "new"})
        sender.close()
        return list(sender._sent)

    try:
        assert asyncio.run(main()) == ["kept"]
    finally:
        os.close(read)


def test_a_probing_task_dies_told_and_started_again_even_if_delivering_fails(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The verdict that says so comes last: a deliver that raises (the bug that killed
    the task may be there) must not leave the backend unread for good, uncounted."""

    async def broken(*_args: Any, **_kwargs: Any) -> Verdict:
        raise RuntimeError("a bug past examine_once's guard")

    monkeypatch.setattr(readers, "examine_once", broken)
    died: list[str] = []

    def deliver(*_args: object) -> None:
        raise RuntimeError("a bug in deliver")

    async def main() -> None:
        tasks = readers.ReadTasks(
            lambda: ProbeSettings(wait=0.05), time.time, deliver, lambda _n, c: died.append(c)
        )
        tasks.assign([Target("b", "http://127.0.0.1:9", "backend")])
        for _ in range(200):
            if len(died) >= 3:
                break
            await asyncio.sleep(0.05)
        await tasks.close()

    asyncio.run(main())
    assert len(died) >= 3, died


def _read(at: float, steps: float) -> Read:
    engine = EngineSignals(engine="0", running=1, waiting=0, steps=steps)
    return Read(at, signals=Signals((engine,), process_start=1.0))


def _delivering_pool(
    heard: Callable[[Verdict | None, list[Read]], object],
    settings: Callable[[], ProbeSettings] = ProbeSettings,
    log: Callable[[str], object] = lambda _m: None,
) -> readers.ReadPool:
    """A pool of one worker (not started), whose deliveries (verdict, window) go to
    ``heard`` and whose log lines to ``log``."""
    return readers.ReadPool(
        1,
        settings,
        lambda _t, verdict, _s, window: heard(verdict, window),
        lambda _n, _c: None,
        log,
        lambda: ({}, {}),
    )


def test_the_daemons_copy_of_each_window_follows_the_workers_through_cuts_and_resets() -> None:
    """Each read crosses the pipe once; the daemon rebuilds every window, and each
    verdict's reads, from what crossed. Driven here as `examine_once` changes a window:
    a read appended, two at once (the tiny request's extra read), the window cut to its
    limit, cut to the last read (a restart), emptied (a failure), and a verdict whose
    reads are not the window's."""
    target = Target("b", "http://127.0.0.1:9")
    delivered: list[tuple[Verdict | None, list[Read]]] = []
    pool = _delivering_pool(lambda verdict, window: delivered.append((verdict, list(window))))
    worker = readers._Worker(0, share={"b": target})
    window: list[Read] = []
    sent: Read | None = None
    clock = iter(range(1, 1000))

    def step(change: str) -> None:
        nonlocal sent
        if change == "append":
            window.append(_read(next(clock), 1.0))
        elif change == "append two":
            window.extend([_read(next(clock), 2.0), _read(next(clock), 3.0)])
        elif change == "cut to three":
            window.append(_read(next(clock), 4.0))
            del window[:-3]
        elif change == "restart":
            window.append(_read(next(clock), 5.0))
            del window[:-1]
        elif change == "failure":
            window.clear()
        verdict = Verdict(VerdictKind.BUSY, True, "busy", reads=tuple(window[-2:]))
        if change == "foreign reads":
            verdict = Verdict(VerdictKind.BUSY, True, "busy", reads=(_read(0.5, 9.0),))
        item = readers._heard(target, verdict, 0.1, window, sent)
        sent = window[-1] if window else None
        pool._hear(worker, item)
        got_verdict, got_window = delivered[-1]
        assert got_window == window, change
        assert got_verdict == verdict, change

    for change in (
        "append",
        "append",
        "append two",
        "cut to three",
        "cut to three",
        "restart",
        "append",
        "failure",
        "append",
        "foreign reads",
    ):
        step(change)
    # Over the pipe, a verdict carries no reads the window already sent.
    item = readers._heard(
        target,
        Verdict(VerdictKind.BUSY, True, "busy", reads=tuple(window)),
        0.1,
        window,
        window[-1],
    )
    assert item.fresh == () and item.reads == len(window) and item.verdict is not None
    assert item.verdict.reads == ()


CAPTURES = Path(__file__).parent.parent / "fixtures" / "vllm-0.32"


def test_a_reload_that_changes_only_a_targets_rules_keeps_its_window(
    httpserver: HTTPServer,
) -> None:
    """A [policy] edit changes every target's wedge rules: each task was started again,
    and every freeze under way was counted from zero, a wedge proven a window late."""
    frozen = (CAPTURES / "busy-1.txt").read_bytes()  # work shown, the same every read
    httpserver.expect_request("/metrics").respond_with_data(frozen)
    url = httpserver.url_for("").rstrip("/")
    first = Target("b", url)
    edited = replace(first, rules=WedgeRules(startup_grace=600.0))
    heard: list[tuple[Target, int]] = []

    async def main() -> None:
        tasks = readers.ReadTasks(
            lambda: ProbeSettings(wait=0.05),
            time.time,
            lambda target, _v, _s, window: heard.append((target, len(window))),
            lambda _n, _c: None,
        )
        tasks.assign([first])
        async with asyncio.timeout(30):
            while len(heard) < 4:
                await asyncio.sleep(0.01)
        before = len(heard)
        tasks.assign([edited])
        async with asyncio.timeout(30):
            while len(heard) < before + 2:
                await asyncio.sleep(0.01)
        await tasks.close()
        (last_before, kept), (now_target, now_kept) = heard[before - 1], heard[-1]
        assert last_before == first and now_target == edited  # read under its new rules
        assert now_kept > kept >= 3, heard

    asyncio.run(main())


def test_an_examination_of_an_address_a_reload_moved_the_backend_from_is_dropped() -> None:
    # Matched by name alone, a read of the old address in flight at the reload arrived as
    # the new address's verdict, and a refused old port condemned a busy new server.
    delivered: list[Verdict | None] = []
    pool = _delivering_pool(lambda verdict, _window: delivered.append(verdict))
    old, new = Target("b", "http://127.0.0.1:9"), Target("b", "http://127.0.0.1:10")
    worker = readers._Worker(0, share={"b": new})
    refused = Verdict(VerdictKind.DOWN, False, "down: connection refused")
    pool._hear(worker, pickle.loads(pickle.dumps(readers._heard(old, refused, 0.1, [], None))))
    assert delivered == []
    pool._hear(worker, pickle.loads(pickle.dumps(readers._heard(new, refused, 0.1, [], None))))
    assert delivered == [refused]


def test_a_probing_task_death_of_a_target_a_reload_removed_is_not_told() -> None:
    # In flight at the reload, as an examination of it is (dropped above): told, the
    # removed backend's probe_task_restarts series came back to /metrics after the reload
    # forgot it, and stayed, beside a log line saying it was started again.
    died: list[str] = []
    pool = readers.ReadPool(
        1,
        ProbeSettings,
        lambda *_: None,
        lambda name, _cause: died.append(name),
        lambda _m: None,
        lambda: ({}, {}),
    )
    worker = readers._Worker(0, share={"kept": Target("kept", "http://127.0.0.1:9")})
    for name in ("removed", "kept"):
        pool._hear(worker, pickle.loads(pickle.dumps(readers._TaskDied(name, "RuntimeError"))))
    assert died == ["kept"]


def test_the_daemons_copy_of_a_window_holds_unchanged_values_once_as_the_workers_does() -> None:
    """Each read arrives unpickled, with values of its own; the daemon's copy shares
    them again: an idle engine's reads one set of signals, a busy one's its gauges."""
    target = Target("b", "http://127.0.0.1:9")
    windows: list[list[Read]] = []
    pool = _delivering_pool(lambda _verdict, window: windows.append(list(window)))
    worker = readers._Worker(0, share={"b": target})
    window: list[Read] = []
    sent: Read | None = None
    for at, steps in ((1, 5.0), (2, 5.0), (3, 5.0), (4, 6.0)):
        window.append(_read(at, steps))
        item = readers._heard(target, None, 0.1, window, sent)
        sent = window[-1]
        pool._hear(worker, pickle.loads(pickle.dumps(item)))
    got = windows[-1]
    assert got == window
    assert got[0].signals is got[1].signals is got[2].signals
    assert got[3].signals is not None and got[2].signals is not None
    assert got[3].signals.engines[0].running is got[2].signals.engines[0].running


@pytest.mark.parametrize(
    ("setting", "targets", "cores", "workers"),
    [
        (None, 100, 2, 1),
        (None, 3000, 2, 1),
        (None, 4000, 2, 1),
        (None, 4001, 2, 2),
        (None, 10_000, 2, 2),
        (None, 10_000, 16, 3),
        (None, 10_000, 1, 1),
        (3, 10, 2, 3),
        (1, 10_000, 16, 1),
    ],
)
def test_auto_reads_in_the_daemons_loop_until_the_fleet_needs_more_cores(
    setting: int | None, targets: int, cores: int, workers: int
) -> None:
    assert readers.worker_count(setting, targets, cores) == workers


def test_read_workers_is_a_whole_number_from_one_or_auto() -> None:
    def parsed(value: object) -> int | None:
        return config_module.from_mapping({"read_workers": value}, "<t>").read_workers

    assert config_module.from_mapping({}, "<t>").read_workers is None
    assert parsed("auto") is None
    assert parsed(2) == 2
    for bad in (0, -1, "many", 1.5, True):
        with pytest.raises(config_module.ConfigError, match="read_workers"):
            parsed(bad)


@pytest.mark.slow  # five reads one wait apart
def test_a_read_answered_late_and_the_next_on_time_do_not_make_two_waits_of_one(
    fixture_text: Callable[[str], str],
) -> None:
    """A read's task keeps its schedule: after a /metrics answered most of a wait late, the
    next read came at once, and a freeze of one wait was proven a wedge."""
    wait, late = 1.0, 0.94
    texts = [fixture_text(f"vllm-0.32/{name}.txt").encode() for name in ("busy-2", "busy-3")]
    answered: list[float] = []

    def serve(connection: socket.socket, _: int) -> None:
        while read_request(connection):
            if len(answered) == 1:
                time.sleep(late)  # the engine's loop, busy, builds the text late
            body = texts[min(len(answered), 1)]  # progress, then frozen for good
            connection.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(body))
            connection.sendall(body)
            answered.append(time.time())

    async def first_wedged(url: str) -> Verdict:
        verdicts: list[Verdict] = []
        wedged = asyncio.Event()

        def deliver(_t: Target, verdict: Verdict | None, _s: float, _w: object) -> None:
            if verdict is not None and verdict.kind is VerdictKind.WEDGED:
                verdicts.append(verdict)
                wedged.set()

        tasks = readers.ReadTasks(
            lambda: ProbeSettings(wait=wait, timeout=5.0), time.time, deliver, lambda _n, _c: None
        )
        tasks.assign([Target("b", url)])
        try:
            await asyncio.wait_for(wedged.wait(), timeout=20 * wait)
        finally:
            await tasks.close()
        return verdicts[0]

    with tcp_server(serve) as (url, _):
        verdict = asyncio.run(first_wedged(url))
    frozen = [read.at for read in verdict.reads if read.at >= answered[1] - 0.01]
    assert frozen[-1] - frozen[0] >= 1.5 * wait, (frozen, verdict.evidence)


@pytest.mark.slow  # 5 s of waits against a dropping server
def test_a_server_that_drops_connections_idle_for_the_wait_keeps_one_after_its_first_drop(
    fixture_text: Callable[[str], str],
) -> None:
    """uvicorn (vLLM's server) times out a connection idle for 5 s, the default wait. Here
    the server's keep-alive ends 20 ms short of the wait, so a read one wait after the last
    one began always finds its connection gone; once it has been dropped, the target's
    reads start early enough (KEEP_ALIVE_LEAD, 40 ms here) to keep the next one."""
    wait, keep_alive, reads = 1.0, 0.98, 6
    body = fixture_text("vllm-0.32/busy-2.txt").encode()
    answer = b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
    connections: list[int] = []

    def serve_until_idle(connection: socket.socket, number: int) -> None:
        connections.append(number)
        connection.settimeout(keep_alive)
        with contextlib.suppress(TimeoutError):
            while read_request(connection):
                connection.sendall(answer)
                # uvicorn's keep-alive timer starts once the answer is sent
                connection.settimeout(keep_alive)

    async def read_while_counting(url: str) -> int:
        delivered: list[Verdict | None] = []
        enough = asyncio.Event()

        def deliver(_t: Target, verdict: Verdict | None, _s: float, _w: object) -> None:
            delivered.append(verdict)
            if len(delivered) == reads:
                enough.set()

        tasks = readers.ReadTasks(
            lambda: ProbeSettings(wait=wait), time.time, deliver, lambda _n, _c: None
        )
        tasks.assign([Target("b", url)])
        try:
            await asyncio.wait_for(enough.wait(), timeout=reads * wait + 10)
        finally:
            await tasks.close()
        return len(delivered)

    with tcp_server(serve_until_idle) as (url, _):
        assert asyncio.run(read_while_counting(url)) == reads
    # Read on the wait's schedule, each of the 6 reads would need a connection of its own;
    # one late pause of the loop may still cost one more than the first two.
    assert len(connections) <= 3, f"{len(connections)} connections for {reads} reads"


def test_a_server_the_record_saw_asleep_is_not_asked_at_watchs_second_failed_read(
    httpserver: HTTPServer,
) -> None:
    """`watch` started while a server the record last read asleep on purpose answers
    /metrics with HTTP 503: its first read was compared with the record's read, "no
    metrics" and not asked; the baseline was then dropped, and the second read, which
    showed nothing awake either, sent the completion that crashes a sleeping vLLM
    (#15483). `check` keeps it unasked at every run (README: asleep until a read shows
    it awake)."""
    asleep = asleep_capture("idle-1")
    completions: list[str] = []

    def complete(_request: Request) -> Response:
        completions.append("sent")
        return Response(json.dumps({"choices": [{"text": "!"}]}), content_type="application/json")

    httpserver.expect_request("/metrics").respond_with_data("starting", status=503)
    httpserver.expect_request("/v1/models").respond_with_json({"data": [{"id": "tiny"}]})
    httpserver.expect_request("/v1/completions", method="POST").respond_with_handler(complete)
    heard: list[Verdict | None] = []

    async def main() -> None:
        tasks = readers.ReadTasks(
            lambda: ProbeSettings(wait=0.05, timeout=1.0, answer_timeout=1.0),
            time.time,
            lambda _t, verdict, _s, _w: heard.append(verdict),
            lambda _name, _cause: None,
        )
        tasks.remember({"b": parse_metrics(asleep)}, {})
        tasks.assign([Target("b", httpserver.url_for("").rstrip("/"), "backend")])
        for _ in range(200):
            if len(heard) >= 4:
                break
            await asyncio.sleep(0.02)
        await tasks.close()

    asyncio.run(main())
    assert len(heard) >= 4
    assert all(v is not None and v.kind is VerdictKind.NO_METRICS for v in heard)
    assert not completions, [v.evidence for v in heard if v is not None]


def test_a_probing_task_started_again_does_not_ask_a_server_its_predecessor_read_asleep(
    httpserver: HTTPServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The task died (a bug past every guard) after reading the server asleep on purpose;
    its /metrics answers HTTP 503 since. The task started in its place began with an
    empty window and no baseline, and its first read, which showed nothing awake, sent
    the completion that crashes a sleeping vLLM (#15483). It takes the newest read its
    predecessor had, as it takes the step it learned."""
    asleep = asleep_capture("idle-1")
    reads: list[str] = []
    completions: list[str] = []

    def metrics(_request: Request) -> Response:
        reads.append("read")
        if len(reads) == 1:
            return Response(asleep, content_type="text/plain")
        return Response("starting", status=503)

    def complete(_request: Request) -> Response:
        completions.append("sent")
        return Response(json.dumps({"choices": [{"text": "!"}]}), content_type="application/json")

    httpserver.expect_request("/metrics").respond_with_handler(metrics)
    httpserver.expect_request("/v1/models").respond_with_json({"data": [{"id": "tiny"}]})
    httpserver.expect_request("/v1/completions", method="POST").respond_with_handler(complete)
    examine = readers.examine_once
    calls = itertools.count()

    async def dies_once(*args: Any, **kwargs: Any) -> Verdict | None:
        if next(calls) == 1:
            raise RuntimeError("a bug past examine_once's guard")
        return await examine(*args, **kwargs)

    monkeypatch.setattr(readers, "examine_once", dies_once)
    heard: list[Verdict | None] = []
    died: list[str] = []

    async def main() -> None:
        tasks = readers.ReadTasks(
            lambda: ProbeSettings(wait=0.05, timeout=1.0, answer_timeout=1.0),
            time.time,
            lambda _t, verdict, _s, _w: heard.append(verdict),
            lambda _name, cause: died.append(cause),
        )
        tasks.assign([Target("b", httpserver.url_for("").rstrip("/"), "backend")])
        for _ in range(200):
            if died and len(reads) >= 4:
                break
            await asyncio.sleep(0.02)
        await tasks.close()

    asyncio.run(main())
    assert died and len(reads) >= 4
    assert not completions, [v.evidence for v in heard if v is not None]


def shares_sent(monkeypatch: pytest.MonkeyPatch) -> list[readers._Share]:
    """Every share the daemon's pool sends a worker from now on, in order."""
    framed = readers._frame
    shares: list[readers._Share] = []

    def frame(message: object) -> bytes:
        if isinstance(message, readers._Share):
            shares.append(message)
        return framed(message)

    monkeypatch.setattr(readers, "_frame", frame)
    return shares


def test_a_worker_started_again_before_the_first_settle_reads_with_the_steps_on_record(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A worker not started at first (out of processes) is started again a wait later,
    with what the record last saw of its share: before the first settle that was the
    record's baselines without its longest steps, and a backend inside a long step the
    record knew of was wedged at two waits and restarted."""
    step = LongestStep(214.0, "engine 0: an inter-token gap over 80 s")
    target = Target("d", "http://127.0.0.1:9")  # read by worker 1 of 2, started first
    assert readers.share_of(target.name, 2) == 0
    config = config_module.Config(read_workers=2)
    store = StateFile(tmp_path / "state.json")
    learned = Verdict(VerdictKind.BUSY, True, "busy", longest_step=step)
    settle_fleet(
        store,
        config,
        {"d": target.url},
        lambda _record: [Outcome(target, learned)],
        mode=Mode.ACT,
        audit=AuditLog(tmp_path / "audit.jsonl"),
    )
    real = asyncio.create_subprocess_exec
    failures = [BlockingIOError(11, "Resource temporarily unavailable")]

    async def exhausted(*args: Any, **kwargs: Any) -> asyncio.subprocess.Process:
        if failures:
            raise failures.pop(0)
        return await real(*args, **kwargs)

    monkeypatch.setattr(readers.asyncio, "create_subprocess_exec", exhausted)
    shares = shares_sent(monkeypatch)
    daemon = Daemon(
        lambda: (config, [target]),
        store,
        listen=None,
        wait_override=0.05,
        serving_file=None,
        console=Console(stderr=True),
    )

    async def until_its_share_is_sent(_self: Daemon) -> None:
        # No settle meanwhile: what the worker is sent comes from the start's reads alone.
        async with asyncio.timeout(30):
            while not any(share.targets == (target,) for share in shares):
                await asyncio.sleep(0.01)

    monkeypatch.setattr(Daemon, "_loop", until_its_share_is_sent)
    asyncio.run(daemon.run())
    [sent] = [share for share in shares if share.targets == (target,)]
    assert sent.learned == {"d": step}


def test_a_target_two_quick_reloads_drop_and_give_back_gets_no_fragment_of_its_window(
    httpserver: HTTPServer,
) -> None:
    """Dropped by one reload and named again by the next before the worker's frames of
    its old window came in: the daemon had forgotten its copy of that window, and took
    the reads sent after it as a window of their own (a fragment, its verdict's reads
    cut short) until the worker's new window started."""
    httpserver.expect_request("/metrics").respond_with_data((CAPTURES / "busy-1.txt").read_bytes())
    target = Target("b", httpserver.url_for("").rstrip("/"))
    heard: list[tuple[int, int]] = []  # (the daemon's copy's length, the worker's)

    async def main() -> None:
        pool = quiet_pool(wait=0.05)
        hear = pool._hear

        def counted(worker: readers._Worker, item: object) -> None:
            hear(worker, item)
            if isinstance(item, readers._Heard) and item.name in worker.windows:
                heard.append((len(worker.windows[item.name]), item.kept))

        pool._hear = counted  # type: ignore[method-assign]
        await pool.start()
        try:
            pool.assign([target])
            async with asyncio.timeout(30):
                while len(heard) < 3:
                    await asyncio.sleep(0.01)
            # The daemon's loop busy (a settle) while the worker reads on: its frames wait
            # in the pipe, and two reloads come in one turn.
            time.sleep(0.5)
            before = len(heard)
            pool.assign([])
            pool.assign([target])
            async with asyncio.timeout(30):
                while len(heard) < before + 3:
                    await asyncio.sleep(0.01)
        finally:
            await pool.close()

    asyncio.run(main())
    assert all(mine == theirs for mine, theirs in heard), heard


def test_a_reload_while_a_worker_is_down_keeps_its_steps_for_the_worker_started_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A reload's step for a target read afresh (a new name at its server) was sent to
    every worker's share and then forgotten, a worker down at that moment included: the
    one started in its place was sent the record's news alone, which knows the step by
    the old name, and a backend inside a long step was judged without it."""
    shares = shares_sent(monkeypatch)
    step = LongestStep(214.0, "engine 0: an inter-token gap over 80 s")
    target = Target("renamed", "http://127.0.0.1:9")

    async def main() -> None:
        pool = quiet_pool()
        await pool.start()
        try:
            await _kill_the_worker(pool)
            pool.remember({}, {"renamed": step})  # as the daemon's reload does, then assigns
            pool.assign([target])
            async with asyncio.timeout(30):
                while not shares:
                    await asyncio.sleep(0.01)
        finally:
            await pool.close()

    asyncio.run(main())
    assert shares[0].targets == (target,)
    assert shares[0].learned == {"renamed": step}


def _naming_reads(settings: Callable[[], ProbeSettings], heard: list[str]) -> readers.ReadTasks:
    """ReadTasks that name in ``heard`` each target they read, in order; deaths ignored."""
    return readers.ReadTasks(
        settings, time.time, lambda target, _v, _s, _w: heard.append(target.name), lambda *_: None
    )


def test_a_target_a_reload_removes_before_its_first_read_leaves_nothing_behind(
    httpserver: HTTPServer,
) -> None:
    """Its task still asleep in its start's spread, what the record saw of it stayed for
    good: each name a fleet ever had (pods) grew the reader by an entry, and a later
    target of that name, at another server, was compared with this one's last read."""
    httpserver.expect_request("/metrics").respond_with_data((CAPTURES / "busy-1.txt").read_bytes())
    url = httpserver.url_for("").rstrip("/")
    seen = Signals((EngineSignals(engine="0", running=1, waiting=0, steps=1.0),), 1.0)
    step = LongestStep(214.0, "engine 0: an inter-token gap over 80 s")
    heard: list[str] = []

    async def main() -> readers.ReadTasks:
        tasks = _naming_reads(lambda: ProbeSettings(wait=60.0), heard)
        tasks.remember({"first": seen, "later": seen}, {"first": step, "later": step})
        tasks.assign([Target("first", url), Target("later", url)])  # "later" at 15 s
        async with asyncio.timeout(30):
            while not heard:
                await asyncio.sleep(0.01)
        tasks.assign([Target("first", url)])
        await tasks.close()
        return tasks

    tasks = asyncio.run(main())
    assert heard == ["first"]
    assert list(tasks._tasks) == list(tasks._probing) == ["first"]
    assert tasks._baselines == {} and tasks._learned == {}


def test_a_worker_started_again_is_sent_the_records_newest_sighting_not_an_older_kept_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A backend a reshard gave a worker while it was down kept the sighting the record
    had then; by the time its worker was started again the record saw it newer (a
    restart since, read by the member that read it before), and the older one was sent
    over it: the first read, compared with it, showed again a restart the record knew."""
    shares = shares_sent(monkeypatch)
    old = Signals((EngineSignals(engine="0", running=1, waiting=0, steps=1.0),), 1.0)
    new = Signals((EngineSignals(engine="0", running=1, waiting=0, steps=9.0),), 2.0)
    target = Target("gained", "http://127.0.0.1:9")
    news: tuple[dict[str, Signals], dict[str, LongestStep]] = ({}, {})

    async def main() -> None:
        pool = quiet_pool(news=news)
        await pool.start()
        try:
            await _kill_the_worker(pool)
            pool.remember({"gained": old}, {})  # as the daemon's reshard does, then assigns
            pool.assign([target])
            news[0]["gained"] = new  # a settle since: the record's newer sighting
            async with asyncio.timeout(30):
                while not shares:
                    await asyncio.sleep(0.01)
        finally:
            await pool.close()

    asyncio.run(main())
    assert shares[0].targets == (target,)
    assert shares[0].baselines == {"gained": new}


def test_a_target_a_reload_removes_while_its_worker_is_down_leaves_nothing_behind() -> None:
    """A step kept for a share whose worker was down stayed for good once a reload
    removed its target before the worker was started again: a name a fleet ever had
    (pods) an entry each, and a later target of the name was sent it."""
    step = LongestStep(214.0, "engine 0: an inter-token gap over 80 s")
    kept: list[Mapping[str, LongestStep]] = []

    async def main() -> None:
        pool = quiet_pool()
        await pool.start()
        try:
            await _kill_the_worker(pool)
            pool.remember({}, {"renamed": step})
            pool.assign([Target("renamed", "http://127.0.0.1:9")])
            pool.assign([])
            [worker] = pool._workers
            async with asyncio.timeout(30):
                while not worker.reading:
                    await asyncio.sleep(0.01)
            kept.append(pool._learned)
        finally:
            await pool.close()

    asyncio.run(main())
    assert kept == [{}]


def heard_across_a_wait_change(
    httpserver: HTTPServer,
    names: Sequence[str],
    waits: tuple[float, float],
    enough: Callable[[list[str]], bool],
) -> list[str]:
    """The targets read, in order, by ReadTasks over ``names`` (one server answering 500)
    paced by the first of ``waits`` until a first read, then by the second, as a reload
    sets it (``_start_probes``), until ``enough`` of them or 10 s."""
    httpserver.expect_request("/metrics").respond_with_data("", status=500)
    url = httpserver.url_for("").rstrip("/")
    targets = [Target(name, url) for name in names]
    settings = [ProbeSettings(wait=waits[0])]
    heard: list[str] = []

    async def main() -> None:
        tasks = _naming_reads(lambda: settings[-1], heard)
        try:
            tasks.assign(targets)
            async with asyncio.timeout(30):
                while not heard:
                    await asyncio.sleep(0.01)
            settings.append(ProbeSettings(wait=waits[1]))
            tasks.assign(targets)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(10):
                    while not enough(heard):
                        await asyncio.sleep(0.01)
        finally:
            await tasks.close()

    asyncio.run(main())
    return heard


def test_a_reload_that_shortens_the_wait_wakes_a_target_asleep_for_the_old_one(
    httpserver: HTTPServer,
) -> None:
    """README: SIGHUP applies the wait "at once, ... without waiting out the wait". The
    settle came at the new pace, but each probing task slept out the pause of the old
    wait first: cut from 600 s to 0.1 s, no target was read again for ten minutes, and
    every settle meanwhile settled nothing."""
    heard = heard_across_a_wait_change(httpserver, ["b"], (600.0, 0.1), lambda h: len(h) >= 3)
    assert len(heard) >= 3, "the old wait's pause was slept out"


def test_a_reload_that_shortens_the_wait_wakes_a_target_still_in_its_starts_spread(
    httpserver: HTTPServer,
) -> None:
    """The same for a target whose first read is still to come: started with the fleet
    spread over half the old wait (the second of two, 150 s in at a 600 s wait), it slept
    out its place in that spread after a reload cut the wait to 0.1 s."""
    heard = heard_across_a_wait_change(
        httpserver, ["a", "b"], (600.0, 0.1), lambda h: h.count("b") >= 2
    )
    assert heard.count("b") >= 2, "its place in the old wait's spread was slept out"


def test_a_reload_that_lengthens_the_wait_does_not_hold_back_a_first_read(
    httpserver: HTTPServer,
) -> None:
    """Woken by a longer wait, a target still in its start's spread keeps its place in it
    ("b", half a second on at a 2 s wait): its first read is not put off by the new one."""
    heard = heard_across_a_wait_change(httpserver, ["a", "b"], (2.0, 600.0), lambda h: "b" in h)
    assert "b" in heard, "a longer wait put off a first read"


def test_a_wait_a_reload_changed_while_a_read_ran_paces_that_target(
    httpserver: HTTPServer,
) -> None:
    """A task not asleep when ``assign`` saw the wait change (its read was still under
    way) is not woken; it paces by the wait the reload set, not the one it read under."""
    answering, reloaded = threading.Event(), threading.Event()

    def metrics(_request: Request) -> Response:
        answering.set()
        reloaded.wait(10)  # the first read stays under way until the reload is in
        return Response("", status=500)

    httpserver.expect_request("/metrics").respond_with_handler(metrics)
    target = Target("b", httpserver.url_for("").rstrip("/"))
    settings = [ProbeSettings(wait=600.0)]
    heard: list[str] = []

    async def main() -> None:
        tasks = _naming_reads(lambda: settings[-1], heard)
        try:
            tasks.assign([target])
            async with asyncio.timeout(30):
                while not answering.is_set():
                    await asyncio.sleep(0.01)
            settings.append(ProbeSettings(wait=0.1))
            tasks.assign([target])
            reloaded.set()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(10):
                    while len(heard) < 3:
                        await asyncio.sleep(0.01)
        finally:
            reloaded.set()
            await tasks.close()

    asyncio.run(main())
    assert len(heard) >= 3, "paced by the wait the read began under"


def test_a_worker_started_again_while_a_pool_none_of_whose_workers_ran_closes_outlives_it_not(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """No worker of the pool ever started (out of processes at start): close() found no
    process to stop and returned at once, and the retry under way started a worker
    after it, which read on after the pool had closed."""
    real = asyncio.create_subprocess_exec
    spawned: list[asyncio.subprocess.Process] = []
    calls = 0
    respawning = asyncio.Event()
    gate = asyncio.Event()

    async def exhausted_then_gated(*args: Any, **kwargs: Any) -> asyncio.subprocess.Process:
        nonlocal calls
        calls += 1
        if calls <= 2:  # both workers, at start
            raise BlockingIOError(11, "Resource temporarily unavailable")
        respawning.set()
        await gate.wait()  # a retry: held until close() is under way
        process = await real(*args, **kwargs)
        spawned.append(process)
        return process

    monkeypatch.setattr(readers.asyncio, "create_subprocess_exec", exhausted_then_gated)

    async def main() -> list[int | None]:
        pool = quiet_pool(workers=2, wait=0.05)
        await pool.start()
        pool.assign([])
        await respawning.wait()
        await pool.close()
        gate.set()
        for _ in range(50):  # what was left running of the pool runs on
            await asyncio.sleep(0.01)
        return [p.returncode for p in spawned]

    codes = _run_killing_what_is_left(main(), spawned)
    assert codes == [], f"a worker was started after the pool's close: {codes}"
