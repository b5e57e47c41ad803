"""Reading the fleet for `watch`: one probing task per target, here or in read workers.

Each target has one task that reads it once per wait, so one hung backend costs only its
own timeouts, and hands what it concluded to the daemon. ``ReadTasks`` runs those tasks
in the daemon's own event loop. ``ReadPool`` runs them in worker processes (``main``
below), each reading a share of the fleet with the same tasks, so reading and judging a
large fleet use every core; what they conclude comes back over a pipe and is settled by
the daemon alone, so the state keeps one writer however it was read.

Over the pipe goes each read once (about 300 bytes), not each verdict's whole window of
reads: the daemon keeps a copy of every window and gives each verdict its reads back
(pickling a verdict with a full 64-read window costs more CPU than the read itself).
Frames are pickles between two processes of this program, parent and child, over their
own pipes, and are bounded in size.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import functools
import math
import os
import pickle
import queue
import signal
import struct
import sys
import threading
import time
import zlib
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import IO

from llmhealth import eventloop
from llmhealth.classify import Read, Target, Verdict, newest_vllm_read
from llmhealth.gctune import young_collections_spaced
from llmhealth.heap import give_back_free_pages
from llmhealth.localcpu import LocalCpu
from llmhealth.metrics import Signals
from llmhealth.pickling import pickled_as_a_call
from llmhealth.probe import (
    KEEP_ALIVE_LEAD,
    ProbeSettings,
    examine_once,
    examine_proxy,
    keep_read,
    new_client,
    unjudged,
)
from llmhealth.window import LongestStep, longer

STAGGER = 0.5  # of the wait: the first reads of a fleet start spread over this much of it
# A worker's frames: flushed this long after the first verdict waiting, so a wait's
# thousands of verdicts travel in a few dozen writes yet none waits long for a settle.
FLUSH_AFTER = 0.02
PIPE_BYTES = 1024 * 1024  # Linux's default ceiling for an unprivileged pipe
# How much nicer than the daemon a worker runs. The settle is what a cycle must finish
# within its wait, and it runs in the daemon, while a wait's reads have the rest of the
# wait to land in. At the same niceness the settle's thread took its turn on the cores
# with both workers: at 10,000 backends on two cores, later settles of 0.4-0.6 s of CPU
# took 0.8-1.7 s, and a cycle period is the wait plus the difference of two settles
# (bench/README.md). Niceness lowers a worker's share only where others want the cores.
READ_WORKER_NICENESS = 10
MAX_FRAME = 256 * 1024 * 1024  # a frame longer than this is not ours: the worker is dropped
STOP_TIMEOUT = 5.0  # for a worker to leave after its stdin closed, before it is killed
# A worker with targets that sends nothing for this many waits (this many seconds at
# least) is stopped or deadlocked: killed and replaced, as one that exited.
SILENT_WAITS = 10
SILENT_FLOOR = 5.0
# Targets per read worker before `read_workers = "auto"` adds one: at 0.40-0.48 ms of CPU
# per read (RESULTS.md 3c), 4,000 fill about 40% of one core at the default 5 s wait. At
# 3,000 the daemon's own loop held its wait on 1.29 s of CPU a cycle and 19.4 KB a backend,
# where two workers took 1.68 s and 40.5 KB: a worker is an interpreter of its own.
AUTO_SHARE = 4000

Clock = Callable[[], float]
# What one examination of one target concluded: the verdict (None while undecided), how
# long the examination took, and the target's window of reads as it now stands.
Deliver = Callable[[Target, Verdict | None, float, Sequence[Read]], None]
Died = Callable[[str, str], None]  # a probing task ended by itself: the target, the cause
Log = Callable[[str], None]
_HEADER = struct.Struct(">I")


def worker_count(setting: int | None, targets: int, cores: int) -> int:
    """Read workers for a fleet: the configured number, or for ``None`` ("auto") one per
    AUTO_SHARE targets up to the usable cores, and none (reading in the daemon's own
    loop) for a fleet one loop reads with room to spare."""
    if setting is not None:
        return setting
    wanted = min(max(1, cores), math.ceil(targets / AUTO_SHARE))
    return wanted if wanted > 1 else 1


def share_of(name: str, workers: int) -> int:
    """The read worker that reads a target: by its name, so a reload moves no other."""
    return zlib.crc32(name.encode()) % workers


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return os.cpu_count() or 1


class ReadTasks:
    """A probing task per target, in the running event loop, reading it once per wait
    (KEEP_ALIVE_LEAD sooner once its server has closed an idle connection of ours).

    ``settings`` is asked before every read, and again when ``assign`` finds the wait
    changed (a reload): a task asleep for the old wait wakes and is paced by the new one.
    ``remember`` passes what earlier runs last read of some targets (a restart meanwhile
    is then seen at the next read) and the longest steps they took.
    """

    def __init__(
        self,
        settings: Callable[[], ProbeSettings],
        clock: Clock,
        deliver: Deliver,
        died: Died,
    ) -> None:
        self._settings = settings
        self._clock = clock
        self._deliver = deliver
        self._died = died
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._probing: dict[str, Target] = {}
        self._baselines: dict[str, Signals] = {}
        self._learned: dict[str, LongestStep] = {}
        self._closing = False
        # Each task asleep until its next read, by target: woken when a reload changes
        # the wait (``_pace``), and the wait they were paced by.
        self._asleep: dict[str, asyncio.Future[bool]] = {}
        self._paced_by: float | None = None

    def remember(
        self, baselines: Mapping[str, Signals], learned: Mapping[str, LongestStep]
    ) -> None:
        self._baselines.update(baselines)
        self._learned.update(learned)

    def assign(self, targets: Sequence[Target]) -> None:
        """Read these targets; on reload, start tasks only for the new or changed ones.

        An unchanged target keeps its task and so its window of reads: a reload must not
        cost two waits of wedge detection, nor hide a restart that happens across it.
        """
        wanted = {target.name: target for target in targets}
        for name in list(self._tasks):
            now, was = wanted.get(name), self._probing.get(name)
            if now is None or was is None or _read_otherwise(now, was):
                self._tasks.pop(name).cancel()
                self._probing.pop(name, None)
                if now is None:
                    # Taken at its task's first read: one still asleep in its start's
                    # spread left them for good, to a later target of the name too.
                    self._baselines.pop(name, None)
                    self._learned.pop(name, None)
            elif now != was:
                # Its rules, model or key changed (a [policy] edit changes every target's
                # rules): its task takes them from its next read on, its window kept.
                self._probing[name] = now
        starting = [target for name, target in wanted.items() if name not in self._tasks]
        wait = self._settings().wait
        if wait != self._paced_by:
            # A reload changed the wait: asleep for the old one (ten minutes, cut to 5 s),
            # a target was read again only once that had passed, and every settle
            # meanwhile had nothing to settle. Each wakes and is paced by the new one.
            self._paced_by = wait
            for woken in self._asleep.values():
                _wake(woken, False)
        for index, target in enumerate(starting):
            self._probing[target.name] = target
            # Spread over the first half of the wait: all at once, a big fleet's reads
            # held every body in memory together and queued on one burst of CPU; by
            # half the wait they are all done, in time for the first settle.
            self._start(target, delay=STAGGER * wait * index / len(starting))

    async def close(self) -> None:
        self._closing = True
        tasks = list(self._tasks.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def _start(self, target: Target, delay: float = 0.0) -> None:
        task = asyncio.create_task(self._read_forever(target, delay))
        task.add_done_callback(functools.partial(self._ended, target))
        self._tasks[target.name] = task

    def _ended(self, target: Target, task: asyncio.Task[None]) -> None:
        """A probing task ends only when cancelled: one that died is reported and started
        again, one wait later (a task that dies at once every time costs a report per
        wait, not a busy loop). Without this a backend would silently keep its last
        verdict forever."""
        if task.cancelled() or self._closing or self._tasks.get(target.name) is not task:
            return
        error = task.exception()
        cause = f"{type(error).__name__}: {error}" if error else "it returned"
        self._died(target.name, cause)
        self._start(target, delay=self._settings().wait)
        # Its last verdict would stand until the new task's first: one that dies every
        # time left a backend "busy" and serving for ever. Its window is gone with it.
        # Last, and its own failure kept here: the death is told and the task started
        # again whatever delivering does (the bug that killed the task may be there).
        why = f"not judged: its probing task died ({cause}); its reads start afresh"
        with contextlib.suppress(Exception):
            self._deliver(target, unjudged(why), 0.0, ())

    async def _read_forever(self, target: Target, delay: float = 0.0) -> None:
        """Read one target every wait, forever; what it concludes goes to ``deliver``."""
        # Its place in the start's spread, paced as if read a wait before: a reload that
        # shortens the wait wakes it too (from 600 s to 5 s, the second half of a fleet
        # started in the old wait's spread stayed unread for up to 300 s). Never later
        # than that place, though: a lengthened wait does not hold back a first read.
        first, wait = time.monotonic() + delay, self._settings().wait
        await self._pace(target.name, first - wait, False, wait, by=first)
        window: list[Read] = []
        cpu = LocalCpu(target.url, target.cgroup)  # remembers who listens, across cycles
        learned: LongestStep | None = None
        baseline: Signals | None = None
        try:
            # No TLS context of its own: every client shares the process's (wire.py).
            async with new_client() as client:
                while True:
                    target = self._probing.get(target.name, target)  # as the last reload left it
                    settings = self._settings()
                    started = time.monotonic()
                    if target.kind == "proxy":
                        verdict: Verdict | None = await examine_proxy(client, target, settings)
                    else:
                        # What the record last saw of this backend, when there is news of it (at
                        # start, or on taking the lead): one read is compared with it, so a
                        # restart that happened meanwhile is seen; the window is kept.
                        # Kept until a read with vLLM series is in the window: a server
                        # the record saw asleep stays unasked until a read shows it awake.
                        news = self._baselines.pop(target.name, None)
                        baseline = baseline if news is None else news
                        learned = longer(learned, self._learned.pop(target.name, None))
                        verdict = await examine_once(
                            client,
                            target,
                            settings,
                            window,
                            clock=self._clock,
                            baseline=baseline,
                            learned=learned,
                            cpu=cpu,
                        )
                        if verdict is not None:
                            learned = longer(learned, verdict.longest_step)
                        if newest_vllm_read(window) is not None:
                            baseline = None
                    self._deliver(target, verdict, time.monotonic() - started, window)
                    idle_closes = bool(client.connection.idle_closes)
                    await self._pace(target.name, started, idle_closes, settings.wait)
        except asyncio.CancelledError:
            raise
        except BaseException:
            # Died (a bug past every guard): the task started in its place takes the step
            # this one knew, the record's included, which it took at its first read; else
            # a backend inside a long step was wedged at two waits.
            kept = longer(learned, self._learned.get(target.name))
            if kept is not None:
                self._learned[target.name] = kept
            # And the newest read with vLLM series, as a baseline: a server read asleep
            # stays unasked until a read shows it awake (``classify.decide``).
            newest = newest_vllm_read(window)
            last_seen = baseline if newest is None else window[newest].signals
            if last_seen is not None:
                self._baselines.setdefault(target.name, last_seen)
            raise

    async def _pace(
        self, name: str, started: float, idle_closes: bool, wait: float, by: float | None = None
    ) -> None:
        """Until a target read at ``started`` is due again, one ``wait`` on (KEEP_ALIVE_LEAD
        of it sooner once its server has closed an idle connection of ours; the wait the
        read was made under): asked again only when ``assign`` wakes the task for a
        changed one, or changed it while the read ran, not once more every read. Not
        past ``by``, when given."""
        loop = asyncio.get_running_loop()
        woken_early = False
        while True:
            if woken_early or wait != self._paced_by:
                wait = self._settings().wait
            pause = wait * (1 - KEEP_ALIVE_LEAD) if idle_closes else wait
            left = started + pause - time.monotonic()
            if left <= 0 and woken_early and pause > 0:
                # Overdue only by the wait just shortened: on to its next turn at the new
                # pace, where its phase puts it. Read at once, every target of a big fleet
                # was read in one burst, every body in memory together.
                left %= pause
            if by is not None:
                left = min(left, by - time.monotonic())
            if left <= 0:
                return
            woken: asyncio.Future[bool] = loop.create_future()
            due = loop.call_later(left, _wake, woken, True)
            self._asleep[name] = woken
            try:
                if await woken:
                    return  # its time came
            finally:
                due.cancel()
                if self._asleep.get(name) is woken:
                    del self._asleep[name]
            woken_early = True


def _wake(woken: asyncio.Future[bool], due: bool) -> None:
    """``woken`` done: True when its time came, False when a changed wait woke it."""
    if not woken.done():
        woken.set_result(due)


def _read_otherwise(now: Target, was: Target) -> bool:
    """Whether a target's reads so far say nothing of it now: another server, another
    way of reading it, or other processes whose CPU time is sampled."""
    return (now.url, now.kind, now.cgroup) != (was.url, was.kind, was.cgroup)


# --- the pipe between the daemon and its read workers --------------------------------


@dataclass(frozen=True, slots=True)
class _Share:
    """Daemon → worker: what to read, with what settings, and what earlier runs saw."""

    settings: ProbeSettings
    targets: tuple[Target, ...]
    baselines: Mapping[str, Signals]
    learned: Mapping[str, LongestStep]


@pickled_as_a_call
@dataclass(frozen=True, slots=True)
class _Heard:
    """Worker → daemon: one examination. ``fresh`` are the window's reads not sent before
    (all of it when ``reset``: the window was cut or started afresh); ``kept`` is the
    window's length now. ``verdict`` travels without its reads: ``reads`` says how many
    of the window's newest are its own, or holds them when they are not the window's.
    ``url``: where it was read, so a read of an address a reload has since moved the
    backend from is not taken for the new one's."""

    name: str
    url: str
    seconds: float
    fresh: tuple[Read, ...]
    reset: bool
    kept: int
    verdict: Verdict | None
    reads: int | tuple[Read, ...]


@dataclass(frozen=True, slots=True)
class _TaskDied:
    name: str
    cause: str


@dataclass(frozen=True, slots=True)
class _Alive:
    """Worker -> daemon, once a wait: its loop turns. An examination may take minutes (a
    tiny request waits up to max_check_time), so a worker's silence is judged by these."""


def _frame(message: object) -> bytes:
    body = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    return _HEADER.pack(len(body)) + body


async def _next_frame(stream: asyncio.StreamReader) -> object:
    """The next message; IncompleteReadError at the end of the stream."""
    (size,) = _HEADER.unpack(await stream.readexactly(_HEADER.size))
    if size > MAX_FRAME:
        raise ValueError(f"a frame of {size} bytes, over the {MAX_FRAME} limit")
    return pickle.loads(await stream.readexactly(size))


def _heard(
    target: Target,
    verdict: Verdict | None,
    seconds: float,
    window: Sequence[Read],
    sent: Read | None,
) -> _Heard:
    """What to send of one examination, given the last read already sent of the window."""
    index = next((i for i in range(len(window) - 1, -1, -1) if window[i] is sent), None)
    reset = index is None
    fresh = tuple(window if index is None else window[index + 1 :])
    reads: int | tuple[Read, ...] = 0
    if verdict is not None and verdict.reads:
        count = len(verdict.reads)
        suffix = window[-count:] if count <= len(window) else ()
        own = len(suffix) == count and all(
            a is b for a, b in zip(verdict.reads, suffix, strict=True)
        )
        reads = count if own else verdict.reads
        verdict = replace(verdict, reads=())
    return _Heard(target.name, target.url, seconds, fresh, reset, len(window), verdict, reads)


class _Sender:
    """The worker's side: examinations batched into frames on its stdout.

    A thread of its own writes them, blocking while the pipe is full: the event loop
    writes a pipe once per turn, and a turn of 5,000 probing tasks is long, so frames
    written by the loop fell seconds behind the reads at 10,000 backends.
    """

    def __init__(self, pipe: IO[bytes]) -> None:
        self._frames: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()
        self._writer = threading.Thread(target=self._write, args=(pipe,), daemon=True)
        self._writer.start()
        self._waiting: list[object] = []
        self._sent: dict[str, Read | None] = {}

    def close(self) -> None:
        """Flush, and let the writer finish what is queued (it ends at the pipe's end)."""
        self._flush()
        self._frames.put(None)
        self._writer.join(STOP_TIMEOUT)

    def _write(self, pipe: IO[bytes]) -> None:
        with contextlib.suppress(OSError), pipe:  # the daemon is gone: nobody to tell
            while (frame := self._frames.get()) is not None:
                rest = memoryview(frame)
                while rest:  # a raw write may take only part of it
                    rest = rest[pipe.write(rest) or 0 :]

    def deliver(
        self, target: Target, verdict: Verdict | None, seconds: float, window: Sequence[Read]
    ) -> None:
        self._queue(_heard(target, verdict, seconds, window, self._sent.get(target.name)))
        self._sent[target.name] = window[-1] if window else None

    def keep_only(self, names: Collection[str]) -> None:
        """Forget the last read sent of targets no longer read here: kept, a fleet whose
        names change (pods) grew this by a read per name it ever had."""
        for name in [name for name in self._sent if name not in names]:
            del self._sent[name]

    def died(self, name: str, cause: str) -> None:
        self._sent.pop(name, None)  # its next task starts a new window
        self._queue(_TaskDied(name, cause))

    def alive(self) -> None:
        self._queue(_Alive())

    def _queue(self, message: object) -> None:
        if not self._waiting:
            asyncio.get_running_loop().call_later(FLUSH_AFTER, self._flush)
        self._waiting.append(message)

    def _flush(self) -> None:
        waiting, self._waiting = self._waiting, []
        if waiting:
            self._frames.put(_frame(waiting))


async def _work() -> None:
    """A read worker: read the share the daemon sends, send back what each read found;
    leave when the daemon closes the pipe (or dies)."""
    loop = asyncio.get_running_loop()
    incoming = asyncio.StreamReader(limit=MAX_FRAME)
    await loop.connect_read_pipe(
        lambda: asyncio.StreamReaderProtocol(incoming), os.fdopen(0, "rb", buffering=0)
    )
    # Frames go to the original stdout; anything printed goes to stderr (the journal).
    frames = os.fdopen(os.dup(1), "wb", buffering=0)
    os.dup2(2, 1)
    # A larger pipe: fewer wake-ups of the writer thread and of the daemon's reader.
    with contextlib.suppress(AttributeError, OSError):  # not Linux, or a lower maximum
        fcntl.fcntl(frames.fileno(), fcntl.F_SETPIPE_SZ, PIPE_BYTES)
    sender = _Sender(frames)
    share: _Share | None = None
    tasks = ReadTasks(
        lambda: share.settings if share else ProbeSettings(), time.time, sender.deliver, sender.died
    )

    share_came = asyncio.Event()

    async def every_wait() -> None:
        """Say it is alive (the daemon replaces a worker silent for long): at once, then
        each wait, and at once again when a share comes, since the daemon's bound follows
        the wait it sent. Hand back freed heap pages once a wait, as the daemon does after
        a settle it does not have (heap.py), however often shares come."""
        given_back = time.monotonic()
        while True:
            sender.alive()
            share_came.clear()
            wait = share.settings.wait if share else ProbeSettings().wait
            # Not wait_for, which on Python 3.11 drops a cancellation that comes in the
            # turn its wait ends in (localcpu.sample_within_limit): this task would beat
            # on after its worker was told to stop.
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(wait):
                    await share_came.wait()
            if time.monotonic() - given_back >= wait:
                give_back_free_pages()
                given_back = time.monotonic()

    beating = asyncio.create_task(every_wait())
    try:
        while True:
            try:
                message = await _next_frame(incoming)
            except asyncio.IncompleteReadError:
                return  # the daemon is gone or stopping
            if isinstance(message, _Share):
                share = message
                tasks.remember(message.baselines, message.learned)
                tasks.assign(message.targets)
                sender.keep_only({target.name for target in message.targets})
                # A beat still spaced by an older, longer wait (a reload, or the default
                # before the first share) was taken for silence.
                share_came.set()
    finally:
        beating.cancel()
        await tasks.close()
        sender.close()


def yield_to_the_settle() -> None:
    """This worker READ_WORKER_NICENESS nicer (the kernel stops at 19). Raising one's
    own niceness needs no privilege, but a service's system call filter may refuse it
    all the same; the worker then reads at the daemon's niceness, as before."""
    with contextlib.suppress(OSError):
        os.nice(READ_WORKER_NICENESS)


def main() -> None:
    # Ctrl-C at a terminal reaches the whole process group: the daemon decides, and
    # closes this worker's pipe. So may a hangup (a terminal closed, `systemctl kill -s
    # HUP`), the daemon's reload: each worker died of it, and its share was doubted.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    yield_to_the_settle()
    # A worker allocates as the daemon's own loop does when it reads: the same spacing.
    with young_collections_spaced():
        eventloop.run(_work())  # the daemon's loop choice: LLMHEALTH_LOOP is inherited


# --- the daemon's side -----------------------------------------------------------------


@dataclass(slots=True)
class _Worker:
    index: int
    process: asyncio.subprocess.Process | None = None
    share: dict[str, Target] = field(default_factory=dict)
    windows: dict[str, list[Read]] = field(default_factory=dict)
    receiving: asyncio.Task[None] | None = None
    # Targets of its share told it does not read them (not started, lost) since it last
    # started, by name and address: each told once, as an examination each would count
    # for one; a target a reload drops, or moves, is told again when it comes back.
    told_not_read: dict[str, str] = field(default_factory=dict)

    @property
    def reading(self) -> bool:
        """Started, not exited, and its pipe open: what is sent to it is read."""
        process = self.process
        return (
            process is not None
            and process.returncode is None
            and process.stdin is not None
            and not process.stdin.is_closing()
        )


async def _let_leave(process: asyncio.subprocess.Process) -> bool:
    """A worker whose pipe was closed: STOP_TIMEOUT to leave, then killed (True)."""
    try:
        async with asyncio.timeout(STOP_TIMEOUT):  # not wait_for (see every_wait)
            await process.wait()
    except TimeoutError:
        with contextlib.suppress(ProcessLookupError):
            process.kill()
        await process.wait()
        return True
    return False


class ReadPool:
    """``count`` read worker processes, each reading the targets whose name hashes to it
    (stable across reloads, so an unchanged target keeps its worker and its window).

    A worker that exits is started again one wait later. Its targets' windows are lost
    with it, so each gets a verdict at once that says so: unhealthy and not judged,
    which shows on every report and metric and moves no ledger state (the same as any
    failure of llmhealth's own while examining a backend); their reads start afresh.
    """

    def __init__(
        self,
        count: int,
        settings: Callable[[], ProbeSettings],
        deliver: Deliver,
        died: Died,
        log: Log,
        news: Callable[[], tuple[Mapping[str, Signals], Mapping[str, LongestStep]]],
    ) -> None:
        self._workers = [_Worker(index) for index in range(count)]
        self._settings = settings
        self._deliver = deliver
        self._died = died
        self._log = log
        self._news = news  # what the record last saw, for a worker started again
        self._baselines: Mapping[str, Signals] = {}
        self._learned: Mapping[str, LongestStep] = {}
        self._closing = False

    @property
    def pids(self) -> list[int]:
        return [w.process.pid for w in self._workers if w.process is not None]

    def remember(
        self, baselines: Mapping[str, Signals], learned: Mapping[str, LongestStep]
    ) -> None:
        # Added to, as ``ReadTasks`` does: a reload's step for a target no worker reads
        # yet (with shard_reads, a new name is read from the next share on) was replaced
        # by the share's news, which knew it by its old name only, and lost.
        self._baselines = {**self._baselines, **baselines}
        self._learned = {**self._learned, **learned}

    async def start(self) -> None:
        for worker in self._workers:
            try:
                await self._spawn(worker)
            except (OSError, RuntimeError) as exc:  # out of processes, threads or files
                self._log(f"read worker {worker.index + 1} not started: {exc}")
                worker.receiving = asyncio.create_task(self._start_again(worker))

    def assign(self, targets: Sequence[Target]) -> None:
        # Removed from a share (a reload, a reshard), a target takes what was kept for it
        # along: its worker down, it stayed for good, to a later target of the name too.
        named = {target.name for target in targets}
        removed = {n for worker in self._workers for n in worker.share if n not in named}
        self._baselines = {n: s for n, s in self._baselines.items() if n not in removed}
        self._learned = {n: s for n, s in self._learned.items() if n not in removed}
        for worker in self._workers:
            count = len(self._workers)
            worker.share = {t.name: t for t in targets if share_of(t.name, count) == worker.index}
            for name in [n for n in worker.windows if n not in worker.share]:
                del worker.windows[name]
            for name in [n for n in worker.told_not_read if n not in worker.share]:
                del worker.told_not_read[name]
            self._send_share(worker)
        # Sent once, as ReadTasks pops them; kept for a target not read yet, one of a
        # worker down included: dropped, the one started again was sent the record's
        # news alone, and a step a reload gave a renamed backend was lost.
        self._forget_sent()

    async def close(self) -> None:
        """Close every worker's pipe, give them STOP_TIMEOUT to leave, then kill."""
        self._closing = True
        left: set[asyncio.subprocess.Process] = set()
        # Again while any is new: a lost worker's replacement whose start was under way
        # when the close began comes in while the others leave, and read on unclosed.
        # And the retries are stopped even when no worker has a process: a pool none of
        # whose workers ever started left its retries running, and one under way started
        # a worker after the close.
        while True:
            leaving = [
                w.process for w in self._workers if w.process is not None and w.process not in left
            ]
            for process in leaving:
                if process.stdin is not None:
                    process.stdin.close()
            # All at once: one after another, three hung workers took 15 s of a stop that
            # systemd bounds (TimeoutStopSec), after the last settle's own 10 s.
            await asyncio.gather(*(_let_leave(process) for process in leaving))
            left.update(leaving)
            receiving = [
                w.receiving
                for w in self._workers
                if w.receiving is not None and not w.receiving.done()
            ]
            for task in receiving:
                task.cancel()
            await asyncio.gather(*receiving, return_exceptions=True)
            if not leaving and not receiving:
                return

    async def _spawn(self, worker: _Worker) -> None:
        worker.process = await asyncio.create_subprocess_exec(
            sys.executable,
            # -P: no working directory on sys.path, as the daemon's console script has
            # none; else a ./llmhealth where watch was started (/tmp) ran in every worker.
            "-P",
            "-c",
            # Not `-m`: run as __main__, the classes in the frames would not be the ones
            # the daemon knows by name. Ctrl-C and a hangup ignored first, as ``main``
            # does: only from there, a group's SIGHUP during the import (0.2-1.5 s; at the
            # daemon's start, or just after a worker was replaced) killed the new worker.
            "import signal; signal.signal(signal.SIGINT, signal.SIG_IGN); "
            "signal.signal(signal.SIGHUP, signal.SIG_IGN); "
            "from llmhealth.readers import main; main()",
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            limit=MAX_FRAME,
        )
        worker.windows = {}
        worker.told_not_read = {}
        worker.receiving = asyncio.create_task(self._receive(worker, worker.process))

    def _send_share(self, worker: _Worker) -> None:
        process = worker.process
        if not worker.reading:
            # Not started yet, or lost and not yet started again (tried each wait): its
            # share gets what a lost worker's gets, a target a reload gave it included,
            # or it kept its saved state (a new one: healthy) with no verdict at all.
            if not self._closing:
                state = "not started" if process is None else "not running"
                self._unjudged(worker, f"read worker {worker.index + 1} {state}")
            return
        assert process is not None and process.stdin is not None
        names = worker.share.keys()
        share = _Share(
            self._settings(),
            tuple(worker.share.values()),
            {n: s for n, s in self._baselines.items() if n in names},
            {n: s for n, s in self._learned.items() if n in names},
        )
        process.stdin.write(_frame(share))

    async def _receive(self, worker: _Worker, process: asyncio.subprocess.Process) -> None:
        assert process.stdout is not None
        why = ""
        frame = asyncio.ensure_future(_next_frame(process.stdout))
        try:
            while True:
                silence = self._silence_bound()
                await asyncio.wait({frame}, timeout=silence)
                if not frame.done():
                    # Once more, briefly: after a stall of the daemon's own loop (a VM
                    # paused) the timeout and the waiting frame come due in one turn.
                    await asyncio.wait({frame}, timeout=1.0)
                if not frame.done():
                    if not worker.share:
                        continue  # nothing to read, nothing to say
                    # Stopped, deadlocked or starved: alive, so its pipe never ends, and
                    # its targets would keep their last verdicts, serving, for ever.
                    why = f"; it sent nothing for {silence:g} s with {len(worker.share)} to read"
                    with contextlib.suppress(ProcessLookupError):
                        process.kill()
                    break
                message = frame.result()
                if not isinstance(message, list):
                    raise ValueError(f"unexpected {type(message).__name__}")
                for item in message:
                    self._hear(worker, item)
                frame = asyncio.ensure_future(_next_frame(process.stdout))
        except asyncio.IncompleteReadError:
            # Its frames ended: it is leaving, or it lives on without them (its writer
            # thread gone while its loop reads on, or its exit hung on a thread). Waited
            # for without a bound, such a worker was never replaced: its backends kept
            # their last verdicts, serving, and no silence bound came due. Told to leave
            # as at a stop, then killed (at a stop, ``close`` does so itself).
            if not self._closing:
                if process.stdin is not None:
                    process.stdin.close()
                if await _let_leave(process):
                    why = "; its frames ended and it did not leave"
        except Exception as exc:  # any frame not taken in: a TypeError of another version
            # Ending here unseen left the worker running, unread: its backends kept their
            # last verdicts, serving, and its frames piled up in this process.
            why = f"; it sent what cannot be read ({type(exc).__name__}: {exc})"
            with contextlib.suppress(ProcessLookupError):
                process.kill()
        finally:
            frame.cancel()
        code = await process.wait()
        if self._closing:
            return
        self._lost(
            worker, f"read worker {worker.index + 1} (pid {process.pid}) exited ({code}){why}"
        )
        await self._start_again(worker)

    async def _start_again(self, worker: _Worker) -> None:
        """A new worker for a lost one's share, tried once a wait until one starts."""
        while True:
            await asyncio.sleep(self._settings().wait)
            if self._closing:
                return
            try:
                await self._spawn(worker)
            except (OSError, RuntimeError) as exc:  # out of processes, threads or files
                self._log(f"read worker {worker.index + 1} not started again: {exc}")
                continue
            # The record's news, with what was kept for targets not read yet (a reload's
            # steps for this share's renamed backends among them). A kept sighting is an
            # earlier record's: over the news, a restart the record has seen since was
            # shown again at the first read.
            pending = self._baselines, self._learned
            baselines, learned = self._news()
            self._baselines = {**pending[0], **baselines}
            self._learned = {
                **learned,
                **{n: longer(learned.get(n), s) or s for n, s in pending[1].items()},
            }
            self._send_share(worker)
            self._baselines, self._learned = pending
            self._forget_sent()
            return

    def _forget_sent(self) -> None:
        """What earlier runs saw of targets a running worker was sent: kept no longer."""
        sent = {name for worker in self._workers if worker.reading for name in worker.share}
        self._baselines = {n: s for n, s in self._baselines.items() if n not in sent}
        self._learned = {n: s for n, s in self._learned.items() if n not in sent}

    def _silence_bound(self) -> float:
        """How long a worker with targets may send nothing: it says it is alive once a
        wait, so ten waits (5 s at least) without a frame is a loop that no longer turns."""
        return max(SILENT_FLOOR, SILENT_WAITS * self._settings().wait)

    def _hear(self, worker: _Worker, item: object) -> None:
        if isinstance(item, _Alive):
            return
        if isinstance(item, _TaskDied):
            # Of a target a reload has since taken from it, as an examination below: told,
            # a removed backend's probe_task_restarts series came back and stayed.
            if item.name in worker.share:
                self._died(item.name, item.cause)
            return
        if not isinstance(item, _Heard):
            raise ValueError(f"unexpected {type(item).__name__}")
        target = worker.share.get(item.name)
        if target is None or target.url != item.url:
            return  # no longer this worker's, or not there (a reload): the worker drops it too
        if not item.reset and item.name not in worker.windows:
            # The rest of a window let go of here: a reload dropped the target and the next
            # named it again before its old task's frames came in. The worker drops that
            # task, and its new one starts with a reset; taken as a window of its own, it
            # was a fragment of the worker's, its verdicts' reads cut short.
            return
        window = [] if item.reset else worker.windows[item.name]
        for read in item.fresh:
            # Unpickled, each read has values of its own: shared again as the worker's
            # window shares them, or an idle backend's 61 reads held 61 copies here.
            keep_read(window, read, item.kept)
        del window[: max(0, len(window) - item.kept)]
        worker.windows[item.name] = window
        verdict = item.verdict
        if verdict is not None:
            reads = item.reads
            own = tuple(window[-reads:]) if isinstance(reads, int) and reads else ()
            verdict = replace(verdict, reads=reads if isinstance(reads, tuple) else own)
        self._deliver(target, verdict, item.seconds, window)

    def _lost(self, worker: _Worker, why: str) -> None:
        self._log(f"{why}; its {len(worker.share)} targets read afresh by a new one")
        worker.windows = {}
        self._unjudged(worker, why)

    def _unjudged(self, worker: _Worker, why: str) -> None:
        """Each of the worker's targets not yet told since it last started: not judged,
        for ``why``; reads start afresh."""
        verdict = unjudged(
            f"not judged: {why}; its reads start afresh (a failure of llmhealth's own)"
        )
        for name, target in worker.share.items():
            if worker.told_not_read.get(name) != target.url:
                worker.told_not_read[name] = target.url
                self._deliver(target, verdict, 0.0, ())
