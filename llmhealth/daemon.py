"""`llmhealth watch`: the check cycle as a daemon under systemd.

Each target has its own probing task that reads it once per wait, so one hung backend
costs only its own timeouts. Every wait the daemon settles what came in: ledger, restart
plan, state file (locked per settle, so operator verbs interleave), its own metrics, the
serving file, and a WATCHDOG=1 to systemd that proves the loop itself still turns.
Restart commands and the serving hook run beside the loop, so no settle waits for one.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import itertools
import json
import os
import queue
import secrets
import signal
import socket
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple, ParamSpec, TypeVar
from urllib.parse import urlsplit

from rich.console import Console, Group
from rich.live import Live

from llmhealth import config as config_module
from llmhealth.actions import (
    Audit,
    AuditError,
    AuditLog,
    CommandResult,
    how_it_ended,
    run_command,
    without_keys,
)
from llmhealth.choice import ANY_MODEL, Models
from llmhealth.classify import (
    Outcome,
    Read,
    Target,
    Verdict,
    VerdictKind,
    asleep_engines,
    asleep_now,
    newest_vllm_read,
)
from llmhealth.cluster import (
    UNANSWERED_KEPT,
    ClusterError,
    LostSaveLandedError,
    SaveUnansweredError,
    Seat,
    SharedReads,
)
from llmhealth.cycle import (
    Kept,
    Settled,
    audit_path_for,
    backend_urls,
    baselines_of,
    command_changed,
    fresh_record,
    learned_steps_of,
    ledger_policy,
    load_record,
    reconciled,
    routed_backends,
    settle_fleet,
    withdrawn_now,
)
from llmhealth.exporter import BackendView, ClusterView, ExportView, FleetCollector, serve
from llmhealth.fleet import (
    READS_KEEP_UP,
    FleetRecord,
    Sighting,
    StallWatch,
    asleep_on_purpose,
    reads_per_wait,
    smoothed_gap,
)
from llmhealth.gctune import young_collections_spaced
from llmhealth.heap import give_back_free_pages
from llmhealth.leadership import Standing
from llmhealth.ledger import BackendSnapshot
from llmhealth.metrics import Signals
from llmhealth.openfiles import discard_output, reader_may_leave
from llmhealth.probe import STANDBY_ASKS_NOTHING, ProbeSettings, steady_for
from llmhealth.readers import ReadPool, ReadTasks, usable_cores, worker_count
from llmhealth.remediate import (
    CommandDone,
    Mode,
    RestartOrder,
    command_record,
    not_run,
)
from llmhealth.render import report_renderables
from llmhealth.report import BackendReport, CycleReport, FleetSummary, summarize
from llmhealth.state import (
    MemoryStore,
    RecordMovedError,
    StateError,
    StateFile,
    StateLockedError,
    Store,
)
from llmhealth.text import other_server, printable, same_server, url_host
from llmhealth.traffic import RequestOutcome
from llmhealth.window import LongestStep, longer

if TYPE_CHECKING:  # `watch` without a router need not import the router
    from llmhealth.router import Router

# After SIGTERM: seconds a settle in progress may take to finish, and then seconds the
# restart commands still running may take, their outcomes saved by one last settle.
SHUTDOWN_GRACE = 10.0
SERVING_HOOK_TIMEOUT = 30.0  # on_serving_change, e.g. `nginx -s reload`
# Log lines waiting for a reader that stopped reading (its pipe full) before newer ones
# are dropped, and how long an exit waits for those still waiting.
LOG_LINES_WAITING = 1000
LOG_FLUSH_TIMEOUT = 1.0
# A cluster leader's settle made again, on the record as it now is, when an operator's
# verb saved between its load and its save; past this the cycle is skipped as any failed
# save is (its commands and traffic outcomes kept for the next).
SETTLE_ATTEMPTS = 3
# A tiny request turned away for its key (HTTP 401 or 403): the backend is not judged,
# and the operator must learn why from more than its evidence (alerts/).
KEY_REFUSED = "key_refused"
_ERROR_KINDS = {
    VerdictKind.DOWN: "down",
    VerdictKind.UNRESPONSIVE: "unresponsive",
    VerdictKind.UNANSWERED: "unanswered",
}

Loader = Callable[[], tuple[config_module.Config, list[Target]]]
T = TypeVar("T")
A = TypeVar("A")
P = ParamSpec("P")


class Notifier:
    """systemd's sd_notify over $NOTIFY_SOCKET; silent when systemd did not ask for it."""

    def __init__(self, address: str | None) -> None:
        self._address = address
        if address and address.startswith("@"):
            self._address = "\0" + address[1:]  # the abstract socket namespace

    def send(self, *fields: str) -> None:
        if not self._address:
            return
        message = "\n".join(fields).encode()
        with contextlib.suppress(OSError), socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
            # Never waits: on the loop's thread, a systemd too busy to take the datagram
            # (its queue full) must cost one lost notice, not the loop.
            sock.sendto(message, socket.MSG_DONTWAIT, self._address)


class LogLines:
    """The daemon's log on stderr, written by a thread of its own. A reader that stops
    reading (`watch 2>&1 | less` left unscrolled, a stalled log shipper or container log
    driver) fills the pipe, and a line written on the loop's thread blocked the loop, and
    with it every cycle, watchdog ping and route, and the SIGTERM handler, for as long as
    nobody read. Past LOG_LINES_WAITING lines waiting, newer ones are dropped and counted.
    Written to the descriptor, not through ``sys.stderr``: a thread blocked holding its
    buffer's lock aborts the interpreter's exit."""

    def __init__(self) -> None:
        self._waiting: queue.Queue[tuple[int, bytes] | threading.Event] = queue.Queue(
            LOG_LINES_WAITING
        )
        self._lock = threading.Lock()
        self._writer: threading.Thread | None = None
        self._dropped = 0

    def write(self, message: str) -> None:
        stream = sys.stderr
        try:
            descriptor = stream.fileno()
        except (AttributeError, OSError, ValueError):  # io.UnsupportedOperation: a capture
            descriptor = None
        if descriptor is None or not self._started():
            # Nothing to block on the way (a capture's memory), or no thread to write in
            # (a process or pids limit): written here, as before.
            with contextlib.suppress(OSError), reader_may_leave(stream):
                print(message, file=stream, flush=True)
            return
        line = f"{message}\n".encode(stream.encoding or "utf-8", "backslashreplace")
        try:
            self._waiting.put_nowait((descriptor, line))
        except queue.Full:
            with self._lock:
                self._dropped += 1

    def flush(self, timeout: float) -> None:
        """Up to ``timeout`` for the lines waiting to be written: at exit, a reader that
        stalls must not hold the stop past systemd's TimeoutStopSec."""
        if self._writer is None:
            return
        written = threading.Event()
        deadline = time.monotonic() + timeout
        with contextlib.suppress(queue.Full):
            self._waiting.put(written, timeout=timeout)
            written.wait(max(0.0, deadline - time.monotonic()))

    def _started(self) -> bool:
        with self._lock:
            if self._writer is None:
                writer = threading.Thread(target=self._write, name="llmhealth-log", daemon=True)
                try:
                    writer.start()
                except RuntimeError:
                    return False
                self._writer = writer
            return True

    def _write(self) -> None:
        while True:
            item = self._waiting.get()
            if isinstance(item, threading.Event):
                item.set()
                continue
            descriptor, line = item
            with self._lock:
                dropped, self._dropped = self._dropped, 0
            if dropped:
                line = f"{dropped} log lines dropped: the log was not read\n".encode() + line
            try:
                while line:  # a write may take only part of it
                    line = line[os.write(descriptor, line) :]
            except BrokenPipeError:
                discard_output(sys.stderr)  # its reader is gone: as ``reader_may_leave``
            except OSError:
                pass  # a log that cannot be written (a full disk: ENOSPC): the line is lost


LOG_LINES = LogLines()  # one stderr per process


class LeftAtExit(concurrent.futures.ThreadPoolExecutor):
    """The loop's default executor in `watch`: as many threads as asyncio's own, but
    daemon threads, which neither the loop's close nor the interpreter's exit waits for.
    A backend's name is looked up there (``loop.getaddrinfo``): with its DNS server not
    answering (glibc: 5 s, twice, per server and search domain), a stopped daemon's exit
    waited for the resolver, past the stop systemd allows (TimeoutStopSec), and was
    killed. A lookup left running decides nothing; whatever else runs there is waited
    for by its caller (the last state read, the elector's resignation)."""

    def __init__(self) -> None:
        super().__init__()  # its own pool is never started: only its size is taken
        self._threads_at_most = self._max_workers
        # Calls to run; None tells the thread that takes it to end (``shutdown``).
        self._calls: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._started = 0
        self._closed = False
        self._starting = threading.Lock()

    def submit(
        self, fn: Callable[P, T], /, *args: P.args, **kwargs: P.kwargs
    ) -> concurrent.futures.Future[T]:
        future: concurrent.futures.Future[T] = concurrent.futures.Future()
        with self._starting:
            if self._closed:
                raise RuntimeError("cannot schedule new futures after shutdown")
            if self._started < self._threads_at_most:
                serving = threading.Thread(target=self._serve, name="llmhealth-pool", daemon=True)
                try:
                    serving.start()
                    self._started += 1
                except RuntimeError as exc:  # out of threads: told, unless one serves already
                    if not self._started:
                        future.set_exception(exc)
                        return future

        def call() -> None:
            if not future.set_running_or_notify_cancel():
                return
            try:
                result = fn(*args, **kwargs)
            except BaseException as exc:  # the caller's to hear, as ThreadPoolExecutor's
                future.set_exception(exc)
            else:
                future.set_result(result)

        self._calls.put(call)
        return future

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """Each thread told to end once it is free, none waited for: one held by a hung
        lookup is left to the exit. Never told, the threads of every loop a daemon ran
        in (a test's, a library's) stayed blocked on the queue for the process's life."""
        with self._starting:
            if self._closed:
                return
            self._closed = True
            for _ in range(self._started):
                self._calls.put(None)

    def _serve(self) -> None:
        while (call := self._calls.get()) is not None:
            call()


class Publication(NamedTuple):
    """What a sharding member publishes for the leader (``SharedReads.publish``), by
    backend of its share."""

    serials: dict[str, int]  # its newest verdict's serial, new with each
    verdicts: dict[str, Verdict]  # its newest verdict
    examined: dict[str, int]  # its count of examinations, decided or not
    urls: dict[str, str]  # where each verdict was read
    reading_at: dict[str, str]  # where it is read now


@dataclass(slots=True)
class _Probe:
    """What a target's probing task last produced, for the next settle to pick up."""

    outcome: Outcome | None = None
    seconds: float | None = None
    fresh: bool = False
    examinations: int = 0  # heard since the daemon started, decided or not
    heard_at: float | None = None  # monotonic, when the last one was heard
    gap: float | None = None  # between two heard, on average (fleet.smoothed_gap)
    # A not-judged notice heard while a judged verdict awaited its settle: the settle
    # after that one hears it (a reader lost for good is then said as such).
    after: Outcome | None = None
    # Whether its window's newest read with vLLM series, as last heard, shows an engine
    # asleep on purpose; None without one. Newer than its verdict's reads: an undecided
    # read (work on another engine) shows it too.
    window_asleep: bool | None = None


@dataclass(slots=True)
class WatchState:
    """The daemon's memory between cycles (the ledger itself lives in the state file)."""

    stall: StallWatch
    probes: dict[str, _Probe] = field(default_factory=dict)
    latest: dict[str, Outcome] = field(default_factory=dict)
    probe_errors: Counter[tuple[str, str]] = field(default_factory=Counter)
    restarts: Counter[tuple[str, str]] = field(default_factory=Counter)
    probe_task_restarts: Counter[str] = field(default_factory=Counter)
    serving_written: tuple[tuple[str, str], ...] | None = None
    cycles: int = 0
    notes: tuple[str, ...] = ()  # the last settle's, so that each is logged once
    share_alone: bool = False  # the last cycle heard this member's share alone (a standby)


class Daemon:
    def __init__(
        self,
        load: Loader,
        store: StateFile | MemoryStore | Seat,
        *,
        listen: tuple[str, int] | None,
        wait_override: float | None,
        serving_file: Path | None,
        console: Console,
        clock: Callable[[], float] = time.time,
        router: Router | None = None,
        router_listen: tuple[str, int] | None = None,
        steady: Callable[[], float] | None = None,
    ) -> None:
        self._load = load
        self._config, self._targets = load()
        # Every variable an api_key_env of any config loaded since the start named: a
        # reload that drops a backend or renames its variable leaves the old one in this
        # process's environment, and no command we run may inherit it.
        self._key_variables = self._config.key_variables
        # With a cluster seat only its leader settles (through the fenced store); every
        # daemon probes, and a standby reports from the record it reads.
        self._seat = store if isinstance(store, Seat) else None
        self._store: Store = store.store if isinstance(store, Seat) else store
        self._reader: Store = store.reader if isinstance(store, Seat) else store
        # A cluster's audit trail is in etcd, written with the state; else a local file,
        # beside the state file unless the config says otherwise; a run that keeps no
        # state (bare URLs) keeps no trail either.
        self._audit: Audit | None
        if isinstance(store, Seat):
            self._audit = store.store.audit
        elif isinstance(store, MemoryStore):
            self._audit = None
        else:
            audit_path = audit_path_for(self._config, store.path)
            if serving_file is not None:
                config_module.check_serving_path(serving_file, store.path, audit_path)
            self._audit = AuditLog(audit_path)
        self._listen = listen
        self._wait_override = wait_override
        self._serving_file = serving_file
        self._console = console
        self._clock = clock
        # The steady clock (``probe.steady_for``): when each backend's last restart command
        # ended, on it, so that a wall clock stepped forward fails no restart in its grace.
        self._steady = steady_for(clock, steady)
        # By the order's name: its server, and when its command ended on the steady clock.
        self._commands_ended: dict[str, tuple[str, float]] = {}
        self._notifier = Notifier(os.environ.get("NOTIFY_SOCKET"))
        self._watchdog_every = watchdog_interval(os.environ, os.getpid())
        self._ready_told = False
        # [cluster] shard_reads: this member reads its share (None: every backend) and
        # publishes it; leading, it settles the others' published verdicts too.
        cluster = self._config.cluster
        sharded = self._seat is not None and cluster is not None and cluster.shard_reads
        self._shares = SharedReads(self._seat) if self._seat and sharded else None
        self._share: frozenset[str] | None = None
        self._publish_error: str | None = None  # why the last publication failed, if it did
        # What a leader's settle that wrote nothing drained from the router: the loop gives
        # it back (on the router's thread) for the next settle, as after a failed save.
        self._unsettled_requests: Mapping[str, Sequence[RequestOutcome]] | None = None
        # What each leader's settle whose save went unanswered was given, by the save's
        # nonce: kept for the next settle as any unsettled news, and taken out of it
        # if the store finds that save went in after all (``_heard_already``); and the
        # restarts it issued, run then.
        self._unanswered: dict[
            bytes,
            tuple[
                list[CommandDone],
                Mapping[str, Sequence[RequestOutcome]] | None,
                tuple[RestartOrder, ...],
            ],
        ] = {}
        # The restarts a save found gone in had issued, until a settle of this leader
        # saves: the settle that found it may fail itself (its own save unanswered too,
        # etcd away, deposed), and kept by that settle alone they were run by nobody.
        # One per backend, the newest: an older one the record has moved past.
        self._landed: dict[str, RestartOrder] = {}
        # What the read workers were last told: whether they may send tiny requests,
        # which backends to ask even when their engines moved, and which never to ask.
        self._told: tuple[bool, frozenset[str], frozenset[str]] = (True, frozenset(), frozenset())
        # STALE in the last record seen: asked whenever idle, as re-admission needs.
        self._awaiting: frozenset[str] = frozenset()
        # RETIRED in the last record seen: read, never asked.
        self._retired: frozenset[str] = frozenset()
        # The serial of each backend's newest fresh verdict, for the leader: one count for
        # all of them, so a backend the config drops is forgotten here, and one that comes
        # back never repeats a serial the leader may have settled. Started anywhere in 2**48
        # (below 2**53, jq's exact integers): counted from 1, a member restarted under its
        # name published its first verdicts under the serials its last process ended on,
        # and the leader took them for verdicts it had settled.
        self._serials: dict[str, int] = {}
        self._serial = itertools.count(1 + secrets.randbelow(2**48))
        self._collector = FleetCollector()
        self._state = WatchState(StallWatch(started_at=self._stall_now()))
        self._stop = asyncio.Event()
        self._reload = False
        self._reload_asked = asyncio.Event()  # wakes a wait, so a reload applies at once
        # Who reads: tasks in this loop, or read worker processes for a large fleet
        # (chosen when `run` starts; a changed read_workers takes a restart).
        self._reading: ReadTasks | ReadPool = ReadTasks(
            lambda: self.settings, clock, self._heard, self._probe_task_died
        )
        self._snapshots: dict[str, BackendSnapshot] = {}
        self._fleet: FleetSummary | None = None
        # The record as the last settle saved it, which the next starts from while the
        # state file is unchanged; touched by the settle thread only, which changes it
        # in place. What the loop's thread needs of it is copied out after each settle.
        self._kept = Kept()
        self._record: FleetRecord | None = None  # as last settled or read
        self._news: tuple[dict[str, Signals], dict[str, LongestStep]] = ({}, {})
        # The longest step learned at each server (``same_server``), under whatever name
        # the record keeps it (in the ledger or kept aside): a reload's new name for a
        # server may take over its record (``FleetRecord.renames``), and a longer window
        # only waits longer for a proof.
        self._steps_at: dict[str, LongestStep | None] = {}
        # `route`: the router in front of the backends, fed the serving set after every
        # settle, and drained of what real traffic showed before the next.
        self._router = router
        self._router_listen = router_listen
        if router is not None:  # one /metrics: the router's series and the daemon's
            router.registry.register(self._collector)
        self._models: dict[str, frozenset[str]] = {}  # as the tiny request last listed them
        # Backends a reload moved to another server, until a settle hears a read there:
        # what answers at the new address is unproven (another process is STALE, then
        # re-admitted), so neither the router nor the serving file is handed it before.
        self._moved: frozenset[str] = frozenset()
        # Restart commands run beside the loop, never inside a settle or the state lock;
        # what they finished waits here for the next settle. Touched on the loop only.
        self._commands_running: dict[asyncio.Future[CommandDone], RestartOrder] = {}
        self._commands_done: list[CommandDone] = []
        # on_serving_change runs the same way: one at a time, once more if the serving
        # file changed again while it ran.
        self._serving_changed = False
        self._hook: asyncio.Future[CommandResult] | None = None
        self._hook_again = False
        # The settle a stop gave up waiting for, and what it was given: its thread goes
        # on, and may still save (its restarts issued) or fail (its news unsaved).
        self._unfinished: tuple[asyncio.Future[Settled], News] | None = None

    @property
    def _wait(self) -> float:
        return self._wait_override or self._config.wait

    @property
    def settings(self) -> ProbeSettings:
        return ProbeSettings(
            wait=self._wait,
            timeout=self._config.timeout,
            answer_timeout=self._config.answer_timeout,
            max_body=self._config.max_body,
            max_check_time=self._config.max_check_time,
            unasked=STANDBY_ASKS_NOTHING if self._standby_reading_all() else None,
            awaiting_answer=self._awaiting,
            retired=self._retired,
        )

    def _standby_reading_all(self) -> bool:
        """A standby of a cluster whose members all read every backend: nobody settles its
        verdicts, so a tiny request of its own would only take a slot, and show to the
        leader as work on a backend the leader must see idle to re-admit it."""
        if self._seat is None or self._shares is not None:
            return False
        return not self._seat.elector.decision().may_act

    async def run(self) -> int:
        """Watch until stopped; young garbage collections spaced meanwhile (gctune.py:
        at 10,000 backends the default's full collections were a quarter of the CPU)."""
        with young_collections_spaced():
            try:
                return await self._run()
            finally:
                LOG_LINES.flush(LOG_FLUSH_TIMEOUT)

    async def _run(self) -> int:
        loop = asyncio.get_running_loop()
        loop.set_default_executor(LeftAtExit())
        loop.add_signal_handler(signal.SIGTERM, self.stop)
        loop.add_signal_handler(signal.SIGINT, self.stop)
        loop.add_signal_handler(signal.SIGHUP, self._ask_reload)
        server = None
        if self._listen is not None:
            host, port = self._listen
            try:
                server, _ = serve(self._collector, host, port)
            except OSError as exc:
                raise config_module.ConfigError(
                    f"--listen {host}:{port}: cannot serve metrics there: {exc.strerror or exc}"
                ) from exc
            self._log(f"metrics on http://{url_host(host)}:{port}/metrics")
        if self._seat is not None:
            self._seat.elector.start()
        try:
            baselines, learned = await asyncio.to_thread(self._read_baselines)
            # What the record saw, until the first settle says it again (``_asleep``), its
            # steps included: a read worker started again before that settle (not started
            # at first, or lost) was sent none, and its share's long steps wedged at two waits.
            self._news = (baselines, learned)
            workers = worker_count(self._config.read_workers, len(self._targets), usable_cores())
            if workers > 1:
                self._reading = ReadPool(
                    workers,
                    lambda: self.settings,
                    self._heard,
                    self._probe_task_died,
                    self._log,
                    self._record_news,
                )
                await self._reading.start()
                pids = ", ".join(map(str, self._reading.pids))
                self._log(f"reading with {workers} read worker processes (pids {pids})")
            self._reading.remember(baselines, learned)
            if self._router is not None and self._router_listen is not None:
                await self._start_router(self._router, *self._router_listen)
            self._start_probes()
            await self._loop()
            await self._finish_commands()
            await self._finish_serving_hook()
        finally:
            if not self._stop.is_set():  # ended by an error: stopping from here on
                self._notifier.send("STOPPING=1")
            if self._seat is not None:
                # Resigning revokes the lease: a standby leads at its next round, not a TTL on.
                await asyncio.to_thread(self._seat.elector.stop)
            await self._reading.close()
            if server is not None:
                server.shutdown()
                server.server_close()
            if self._router is not None:
                await self._router.close()
        self._log("stopped")
        return 0

    async def _start_router(self, router: Router, host: str, port: int) -> None:
        try:
            await router.start(host, port)
        except OSError as exc:
            raise config_module.ConfigError(
                f"--listen {host}:{port}: cannot route there: {exc.strerror or exc}"
            ) from exc
        self._push_router()  # the saved ledger's serving set, until the first settle
        self._log(f"routing on http://{url_host(host)}:{port}")

    def _push_router(self) -> None:
        """Hand the router the serving set, each backend with the models it serves."""
        if self._router is None:
            return
        expected = {b.name: b.expected_model for b in self._config.backends}
        serving: dict[str, Models] = {}
        for name, snapshot in self._snapshots.items():
            if not snapshot.serving or self._asleep(name) or name in self._moved:
                continue
            models = set(self._models.get(name, ()))
            if expected.get(name):
                models.add(str(expected[name]))
            serving[name] = frozenset(models) if models else ANY_MODEL
        states = {name: str(snapshot.state) for name, snapshot in self._snapshots.items()}
        self._router.push(serving, states, self._config.policy.min_healthy)

    def _asleep(self, name: str) -> bool:
        """Its newest read shows an engine put to sleep on purpose: healthy, but a client's
        completion sent to a sleeping vLLM crashed it (vLLM #15483), and a data-parallel
        server may route one to the sleeping engine. Not routed to until it wakes."""
        return self._asleep_as_shown(name, self._shown_asleep(name))

    def _shown_asleep(self, name: str) -> bool | None:
        """Whether its own reads show it asleep; None when none shows it either way. On
        the loop's thread, where reads are heard."""
        probe = self._state.probes.get(name)
        if probe is not None and probe.window_asleep is not None:
            return probe.window_asleep
        outcome = probe.outcome if probe is not None else None
        if outcome is not None and newest_vllm_read(outcome.verdict.reads) is not None:
            return asleep_on_purpose(outcome.verdict)
        return None

    def _asleep_as_shown(self, name: str, shown: bool | None) -> bool:
        """``_asleep`` from what its reads showed (``_shown_asleep``)."""
        if shown is not None:
            return shown
        # No read of its own shows it (no verdict yet since this run or its task began, or
        # its /metrics failing since): as the record last saw it, asleep until a read shows
        # it awake, as its verdict judged it (``classify.decide``'s baseline), or clients
        # crashed it. From the start too: the saved serving set is routed before any read.
        return bool(asleep_engines(self._news[0].get(name)))

    def _asleep_now(self) -> dict[str, bool | None]:
        """What each backend's reads show of its sleep (``_shown_asleep``), for the
        settle's serving file: taken on the loop's thread, where reads are heard, and
        judged by the settle against the record it settles (``_asleep_as_shown``), as the
        router is pushed after it. Judged against the record before it, one renamed or
        read by another member was listed a settle after the router left it out. Only
        with a serving file to write, else a walk over every backend per settle for
        nothing."""
        if self._serving_file is None:
            return {}
        return {
            target.name: self._shown_asleep(target.name)
            for target in self._targets
            if target.kind == "backend"
        }

    def stop(self) -> None:
        """Ask the loop to finish, as SIGTERM does. systemd hears STOPPING=1 at once: the
        settle under way, the restart commands' grace, the last settle and a running
        on_serving_change take up to four SHUTDOWN_GRACE, without a watchdog ping, and
        told only at their end, a stop systemd did not send itself (`kill`, `systemctl
        kill`) looked all that while like a running daemon that had stopped petting its
        watchdog."""
        if not self._stop.is_set():
            self._stop.set()
            self._notifier.send("STOPPING=1")

    def _ask_reload(self) -> None:
        self._reload = True
        self._reload_asked.set()

    async def _loop(self) -> None:
        live = (
            Live(console=self._console, auto_refresh=False) if self._console.is_terminal else None
        )
        with live if live is not None else contextlib.nullcontext():
            due = time.monotonic()
            while not self._stop.is_set():
                # Cycles keep a fixed period: the settle's own time is not added to the wait.
                due = max(due + self.settings.wait, time.monotonic())
                due = await self._wait_until(due)  # a reload asked meanwhile is applied
                if self._stop.is_set():
                    break
                started = time.monotonic()
                pace = self._reads_per_wait(started)
                # Drained here, on the loop's thread: the router records on it too.
                requests = self._router.drain() if self._router is not None else None
                self._reshard()
                self._tell_workers_who_asks()
                news = News(
                    self._take_fresh(),
                    self._take_commands(),
                    requests,
                    self._publication(),
                    commands_running=self._restarting_now(),
                    unread=self._unread(),
                    in_grace=self._in_grace(),
                    asleep=self._asleep_now(),
                )
                try:
                    cycle = _in_daemon_thread(self._settle_and_give_back, news)
                except RuntimeError as exc:  # out of threads: skipped, as a failed save is
                    self._commands_done[:0] = news.commands
                    if self._router is not None and requests:
                        self._router.give_back(requests)
                    self._log(f"cycle skipped: no thread to settle in: {exc}")
                    self._tell_systemd(f"cycle skipped: {exc}")
                    continue
                # SIGTERM during a cycle: let it finish within a bound, then leave; the
                # state file is only ever replaced whole. It runs in a daemon thread,
                # which the interpreter does not wait for at exit, but which goes on
                # while the daemon stops: ``_finish_commands`` hears how it ended.
                stopping = asyncio.ensure_future(self._stop.wait())
                either: list[asyncio.Future[Any]] = [cycle, stopping]
                await asyncio.wait(either, return_when=asyncio.FIRST_COMPLETED)
                stopping.cancel()
                if not cycle.done():
                    # Waited, not awaited: a settle that fails now (a lock held, a full
                    # disk) is heard below like any other, its commands kept for the last.
                    await asyncio.wait({cycle}, timeout=SHUTDOWN_GRACE)
                    if not cycle.done():
                        self._log("stopping with a cycle unfinished")
                        self._unfinished = (cycle, news)
                        return
                try:
                    settled = cycle.result()
                    back, self._unsettled_requests = self._unsettled_requests, None
                    if self._router is not None and back:
                        self._router.give_back(back)
                except (StateError, AuditError) as exc:
                    # Nothing was saved, records included (the state is written aside,
                    # the records made durable, then the state put in place): probing,
                    # metrics and routing go on, and the next settle tries again. Exiting
                    # would turn a full disk into a restart loop.
                    self._commands_done[:0] = news.commands  # for the next settle to hear
                    if self._router is not None and requests:
                        self._router.give_back(requests)  # the failures it saw, likewise
                    self._log(f"cycle skipped: {exc}")
                    self._tell_systemd(f"state unusable: {exc}")
                    continue
                # Saved as RESTARTING first; only now, outside the lock, do commands run.
                for order in settled.orders:
                    if self._stop.is_set():
                        # Stopping: a command started now is left running, or killed
                        # half-way (KillMode=mixed). Heard by the last settle as not run,
                        # no attempt spent, for the next start to restart.
                        self._drop_order(order, "the daemon is stopping", withdrawn=True)
                    else:
                        self._launch(order)
                if self._serving_changed:
                    self._serving_changed = False
                    self._run_serving_hook()
                self._remember_models(settled.report)
                self._push_router()
                self._after_cycle(settled.report, time.monotonic() - started, pace, live)

    async def _wait_until(self, due: float) -> float:
        """Until the next cycle is due, or a stop. Waiting is health: systemd hears so at
        least twice per watchdog period, as a `wait` may be longer than WatchdogSec (35 s
        against the unit's 30 s killed the daemon every cycle); a cycle that hangs still
        starves the watchdog, as it should. Told as the wait ends too: the last notice
        came up to half a period before the cycle (none in a shorter wait), and a settle
        that waited out the state lock or etcd's calls was killed with time left in its
        bound."""
        while not self._stop.is_set():
            if self._reload:  # between settles: none reads the config meanwhile
                self._reload = False
                wait = self._wait
                self._reload_config()
                due += self._wait - wait  # a changed wait counts from the last cycle
            left = due - time.monotonic()
            if left <= 0:
                return due
            every = self._watchdog_every if self._ready_told else None
            self._reload_asked.clear()
            woken = [
                asyncio.ensure_future(self._stop.wait()),
                asyncio.ensure_future(self._reload_asked.wait()),
            ]
            await asyncio.wait(
                woken, timeout=min(left, every or left), return_when=asyncio.FIRST_COMPLETED
            )
            for waiting in woken:
                waiting.cancel()
            if every is not None and not self._stop.is_set():
                self._notifier.send("WATCHDOG=1")
        return due

    def _tell_systemd(self, status: str) -> None:
        """After every cycle, settled or skipped: READY=1 the first time, then WATCHDOG=1.
        Ready does not wait for a settle that succeeds: the daemon probes, serves its page
        and routes while its state cannot be written, and systemd's start timeout would
        otherwise restart it in a loop for as long as the disk stays full."""
        if self._stop.is_set():  # STOPPING=1 was said (stop): nothing after it
            return
        if not self._ready_told:
            self._ready_told = True
            self._notifier.send("READY=1", f"STATUS={status}")
        self._notifier.send("WATCHDOG=1", f"STATUS={status}")

    def _stall_now(self) -> float:
        """Now for the fleet stall watch: on the steady clock where there is one. Fed the
        wall clock, a step forward of ``stall_timeout`` (NTP, a VM resumed, `date -s`) in a
        cycle with work pending and no request finished called a fleet seconds old stalled
        (LLMHealthFleetStalled, critical) until a request finished."""
        return self._clock() if self._steady is None else self._steady()

    def _reads_per_wait(self, now: float) -> float | None:
        """How often the targets read here are examined, per wait: the one sign that reads
        fall behind the wait, which otherwise shows only as verdicts that come late. On
        the loop's thread, where examinations are heard."""
        gaps = [
            (probe.gap, now - probe.heard_at)
            for probe in self._state.probes.values()
            if probe.heard_at is not None
        ]
        return reads_per_wait(gaps, self._wait)

    def _restarting_now(self) -> frozenset[str]:
        """The backends whose restart command runs, as the configuration names them now:
        a reload that renamed one (its server kept) had the plan restart that server
        again under its new name beside the running command, and a name no longer
        configured stopped counting against ``max_concurrent_restarts``. A command for a
        server nothing is configured at any more still counts, under its old name."""
        if not self._commands_running:
            return frozenset()  # the common case: no walk over every target per settle
        configured = self._servers_now()
        names: set[str] = set()
        for order in self._commands_running.values():
            server = same_server(order.url)
            here = {name for name, url in configured.items() if url == server}
            names |= here if here and order.name not in configured else {*here, order.name}
        return frozenset(names)

    def _servers_now(self) -> dict[str, str]:
        """Each configured backend's server (``same_server``), by name: what a command's
        backend is called now, after a reload that renamed it."""
        return {t.name: same_server(t.url) for t in self._targets if t.kind == "backend"}

    def _in_grace(self) -> frozenset[str]:
        """Backends whose restart command ended less than the startup grace ago on the
        steady clock: the wall clock stepped forward since (NTP, a VM resumed, `date -s`)
        failed their restarts a few seconds after the command, and restarted servers still
        loading their models (``settle_fleet``'s in_grace)."""
        if self._steady is None:
            return frozenset()
        now = self._steady()
        grace = ledger_policy(self._config.policy).startup_grace
        for name, (_, ended) in list(self._commands_ended.items()):
            if now - ended >= grace:
                del self._commands_ended[name]
        if not self._commands_ended:
            return frozenset()  # the common case: not a walk over every target per settle
        # As the configuration names its server now: a reload that renamed the backend
        # (its server kept) has the settle fail the restart under its new name.
        configured = self._servers_now()
        names: set[str] = set()
        for name, (server, _) in self._commands_ended.items():
            here = {other for other, url in configured.items() if url == server}
            names |= here or {name}
        return frozenset(names)

    def _unread(self) -> frozenset[str]:
        """Backends this daemon has had no verdict of at their configured server yet:
        just started, or added or moved by a reload. Their restarts' startup grace does
        not fail them unseen (``settle``'s ``unread``)."""
        latest = self._state.latest
        return frozenset(
            target.name
            for target in self._targets
            if target.kind == "backend"
            and (
                (seen := latest.get(target.name)) is None
                or other_server(seen.target.url, target.url)
            )
        )

    def _launch(self, order: RestartOrder) -> None:
        """Run a restart command in its own thread; its outcome waits for a later settle.

        Only if the store may still act on the save that ordered it (a cluster leader
        whose fence holds and whose deadline has not passed), with its fencing token.
        One command per backend at a time: the settle that issued it knew which commands
        were running when it began (``News.commands_running``), and none is launched
        between that and this.
        """
        try:
            # The order's environment is stripped of the keys its config names (remediate);
            # an earlier config's are stripped here, the one place that remembers them.
            kept = without_keys(order.env, self._key_variables)
            order = replace(order, env={**kept, **self._store.command_env()})
        except StateError as exc:
            self._log(f"{order.name}: restart saved but not run: {exc}")
            return
        try:
            running = _in_daemon_thread(self._run_unless_withdrawn, order)
        except RuntimeError as exc:  # out of threads: not run, and the next settle hears so
            # This process's want, no restart that failed (``CommandResult.own_shortage``).
            self._drop_order(order, f"no thread to run it in: {exc}", own_shortage=True)
            return
        self._commands_running[running] = order
        running.add_done_callback(self._command_finished)

    def _run_unless_withdrawn(self, order: RestartOrder) -> CommandDone:
        """In the command's thread: the order dropped, not run, when the record as stored
        now says it must not run (``cycle.withdrawn_now``). The settle that issued it let go
        of the lock before this launch, and an operator's `hold` or `retire` waiting for
        that lock was saved in between, and answered as applied, while the restart went
        ahead; `check` looks again before each command for the same reason."""
        dropped = withdrawn_now(self._store, self._config, order, self._clock())
        if dropped is not None:
            return dropped
        try:
            # Asked again after that read: with etcd slow or away it takes a call's whole
            # bound (5 s), and a command launched near the leader's renew deadline ran
            # past it, and past the lease itself at the default 10 s TTL, while etcd could
            # be giving the lead to another member.
            self._store.command_env()
        except StateError as exc:  # nothing ran: logged, no grace, no attempt spent
            return not_run(order, str(exc), withdrawn=True)
        # The config asked again: the loop applies a reload once this settle's orders are
        # launched, and one applied during those reads (etcd: each up to a call's bound)
        # gave the backend another command, or none, while the old one ran.
        changed = command_changed(self._config, order)
        if changed is not None:
            return not_run(order, changed, withdrawn=True)
        return CommandDone(order, _run_order(order))

    def _drop_order(
        self, order: RestartOrder, why: str, *, withdrawn: bool = False, own_shortage: bool = False
    ) -> None:
        self._log(f"{order.name}: its restart command will not run: {why}")
        done = not_run(order, why, withdrawn=withdrawn, own_shortage=own_shortage)
        self._commands_done.append(done)

    def _command_finished(self, running: asyncio.Future[CommandDone]) -> None:
        order = self._commands_running.pop(running)
        if running.cancelled():
            return
        error = running.exception()
        if error is not None:  # a bug of ours; the startup grace will fail the restart
            self._log(f"{order.name}: the restart command could not be run: {error!r}")
            return
        done = running.result()
        if done.withdrawn:  # nothing ran: no grace starts
            self._log(f"{order.name}: its restart command will not run: {done.result.stderr}")
        elif self._steady is not None and not done.result.own_shortage:
            # Before the settle that starts the grace hears of it. Not for one this process
            # had no descriptor or process to start: nothing ran, as when withdrawn.
            self._commands_ended[order.name] = (same_server(order.url), self._steady())
        self._commands_done.append(done)

    def _run_serving_hook(self) -> None:
        """Tell the balancer, beside the loop: a slow `nginx -s reload` holds no settle."""
        argv = self._config.on_serving_change
        if not argv:
            return
        if self._hook is not None:
            self._hook_again = True
            return
        # Like a restart command, the hook has no business with any backend's API key.
        environment = without_keys(os.environ, self._key_variables)
        try:
            self._hook = _in_daemon_thread(_run_hook, (argv, environment), "llmhealth-hook")
        except RuntimeError as exc:  # out of threads: this change's hook, after the next settle
            self._serving_changed = True
            self._log(f"on_serving_change not run yet: no thread to run it in: {exc}")
            return
        self._hook.add_done_callback(self._serving_hook_finished)

    def _serving_hook_finished(self, hook: asyncio.Future[CommandResult]) -> None:
        self._hook = None
        if not hook.cancelled():
            error = hook.exception()
            if error is not None:
                self._log(f"on_serving_change could not be run: {error!r}")
            elif not (result := hook.result()).ok:
                self._log(f"on_serving_change {how_it_ended(result)}: {result.stderr}")
        if self._hook_again and not self._stop.is_set():
            self._hook_again = False
            self._run_serving_hook()

    async def _finish_serving_hook(self) -> None:
        """On the way out, after the last settle, give a running ``on_serving_change`` up
        to ``SHUTDOWN_GRACE`` to end and run it once more for a serving file it has not
        announced: a change written while it ran, then a stop, left the balancer on the
        old set (a condemned backend still sent traffic) with the file naming the new."""
        deadline = time.monotonic() + SHUTDOWN_GRACE
        while True:
            if self._hook is None and (self._hook_again or self._serving_changed):
                self._hook_again = self._serving_changed = False
                self._run_serving_hook()
            hook = self._hook
            if hook is None:
                return
            await asyncio.wait({hook}, timeout=max(0.0, deadline - time.monotonic()))
            if not hook.done():
                self._log("stopping with on_serving_change still running")
                return
            # Its done callback (``_serving_hook_finished``), added before the wait's, has
            # let it go: at a stop it runs nothing again, which the next turn here does.

    def _take_commands(self) -> list[CommandDone]:
        """Restart commands finished since the last settle; called on the loop's thread."""
        done, self._commands_done = self._commands_done, []
        return done

    async def _finish_commands(self) -> None:
        """On the way out, give running restart commands the shutdown grace, then save how
        every finished one went. A command still running after that is left to itself
        (under systemd, KillMode=mixed ends it); its restart stays on record as issued,
        RESTARTING, which the startup grace fails if no new process shows.

        The router stops first (no new connection; requests in progress get their drain,
        beside the commands' grace): what it saw while they ended goes to the last settle
        too. Drained before them, an answer that broke a failure streak was dropped."""
        closing = None if self._router is None else asyncio.ensure_future(self._router.close())
        unfinished = self._unfinished
        waited: set[asyncio.Future[Any]] = set(self._commands_running)
        if self._commands_running:
            self._log(
                f"waiting up to {SHUTDOWN_GRACE:g} s for "
                f"{len(self._commands_running)} restart command(s)"
            )
        if unfinished is not None:
            waited.add(unfinished[0])  # in the same grace: no longer a stop than before
        if waited:
            await asyncio.wait(waited, timeout=SHUTDOWN_GRACE)
            for order in self._commands_running.values():
                self._log(f"{order.name}: restart command still running; its restart stays issued")
        if unfinished is not None:
            self._hear_unfinished(*unfinished)
        if closing is not None:
            await closing
        done = self._take_commands()
        # What the router saw since the last settle too: dropped, an answered request that
        # broke a failure streak was never heard, and the next run's first failure
        # condemned the backend "3 in a row".
        requests = self._router.drain() if self._router is not None else None
        # A leader's save said unanswered may have gone in with restarts nobody ran: the
        # last settle finds out, and hears them as not run (``_settle``).
        if not done and not requests and not self._landed and not self._unanswered:
            return
        try:
            # A command still running keeps its restart's grace from running out, in
            # this settle as in every other.
            news = News(
                [],
                done,
                requests,
                final=True,
                commands_running=self._restarting_now(),
                unread=self._unread(),
                in_grace=self._in_grace(),
                asleep=self._asleep_now(),
            )
            last = _in_daemon_thread(self._settle, news)
            async with asyncio.timeout(SHUTDOWN_GRACE):  # not wait_for (readers.py)
                await asyncio.shield(last)
        except TimeoutError:
            self._log("stopping before the restart commands' outcomes were saved")
        except (StateError, AuditError, RuntimeError) as exc:  # RuntimeError: no thread
            self._log(f"the restart commands' outcomes were not saved: {exc}")
            self._audit_unsettled(done, exc)

    def _hear_unfinished(self, cycle: asyncio.Future[Settled], news: News) -> None:
        """How the settle a stop gave up waiting for ended, for the last settle to hear.
        Saved, it had issued restarts that nobody launched: saved RESTARTING, an attempt
        spent, and the next start failed them after their grace; they are heard as not
        run, as the loop drops any order once stopping. Failed, the restart commands'
        outcomes it was given were in neither the state nor the audit log."""
        if not cycle.done():
            return  # still under way: abandoned with the process, as documented
        error = None if cycle.cancelled() else cycle.exception()
        if error is not None or cycle.cancelled():
            self._commands_done[:0] = news.commands
            if self._router is not None and news.requests:
                self._router.give_back(news.requests)
            return
        back, self._unsettled_requests = self._unsettled_requests, None
        if self._router is not None and back:
            self._router.give_back(back)
        for order in cycle.result().orders:
            self._drop_order(order, "the daemon is stopping", withdrawn=True)

    def _audit_unsettled(self, done: Sequence[CommandDone], exc: Exception) -> None:
        """The outcomes the last settle could not record, in the audit log by themselves
        (marked ``unsettled``, as `check` keeps its own): else a command's exit status and
        output were in no trail. Not after a settle that may still finish (TimeoutError):
        its records would be written twice. A cluster's trail takes records only with its
        state, so there this fails and says so."""
        if self._audit is None:
            return
        now = self._clock()
        try:
            with self._audit.batch():
                for finished in done:
                    self._audit.append({**command_record(finished, now), "unsettled": str(exc)})
        except AuditError as why:
            self._log(f"nor are they in the audit log: {why}")

    def _read_baselines(self) -> tuple[dict[str, Signals], dict[str, LongestStep]]:
        """What earlier runs last read of each backend, and the longest step each took."""
        policy = ledger_policy(self._config.policy)
        try:
            with self._reader.locked():
                record, changes, *_ = load_record(
                    self._reader, policy, backend_urls(self._targets), self._clock()
                )
        except StateLockedError as locked:
            # Another run holds it, a `check` for its whole run (minutes on a frozen
            # backend): read as `status` does, without the lock. Started without the
            # steps the record keeps, a backend inside a long step was wedged at two waits.
            try:
                stored = self._reader.read(lambda doc: FleetRecord.from_dict(doc, policy))
            except StateError:
                stored = None
            if stored is None:
                self._log(f"starting without earlier reads: {locked}")
                return {}, {}
            record = stored
            changes, *_ = reconciled(record, backend_urls(self._targets), self._clock())
        except StateError as exc:
            self._log(f"starting without earlier reads: {exc}")
            return {}, {}
        now = self._clock()
        self._snapshots = {snap.name: snap for snap in record.ledger.snapshots(now)}
        # The config edited while the daemon was stopped moves them now, as a reload does.
        self._moved = frozenset(c.name for c in changes if c.event == "readdressed" and c.elsewhere)
        self._note_whom_to_ask(record)
        return baselines_of(record), learned_steps_of(record)

    def _start_probes(self) -> None:
        """Have every target this member reads read (with shard_reads, its share); on
        reload or a new share, forget the ones no longer read."""
        reading = [target for target in self._targets if self._reads(target)]
        wanted = {target.name for target in reading}
        for name in [name for name in self._state.probes if name not in wanted]:
            self._state.probes.pop(name, None)
            self._state.latest.pop(name, None)
        for target in reading:
            self._state.probes.setdefault(target.name, _Probe())
        self._reading.assign(reading)

    def hear(self, target: Target, verdict: Verdict | None, seconds: float) -> None:
        """What one examination of a target concluded, wherever it was read (a task in
        this loop, a read worker): it waits here for the next settle. Called on the
        event loop's thread."""
        probe = self._state.probes.setdefault(target.name, _Probe())
        probe.seconds = seconds
        probe.examinations += 1
        now = time.monotonic()
        if probe.heard_at is not None:
            probe.gap = smoothed_gap(probe.gap, now - probe.heard_at, self._wait)
        probe.heard_at = now
        if verdict is None:
            return
        unsettled = probe.outcome if probe.fresh else None
        if not verdict.judged and unsettled is not None and unsettled.verdict.judged:
            # A real verdict not yet settled (a wedge proven) is settled first; the notice
            # that its reader was lost since waits for the settle after it.
            probe.after = Outcome(target, verdict)
            return
        probe.after = None
        probe.outcome = Outcome(target, verdict)
        probe.fresh = True

    def _reads(self, target: Target) -> bool:
        """Whether this member reads ``target``: a proxy always, a backend if in its share."""
        return self._share is None or target.kind != "backend" or target.name in self._share

    def _reshard(self) -> None:
        """With shard_reads, the share of the members seen now; on a change of it, probing
        tasks start for the backends gained and stop for those lost."""
        if self._shares is None:
            return
        backends = list(backend_urls(self._targets))
        share = self._shares.share(backends)
        if share != self._share:
            # A backend gained is first compared with what the record saw of it last (as
            # the leader keeps it), not with a start-up baseline hours old: that would
            # show its restart since then as a new one.
            reading = self._share if self._share is not None else frozenset(backends)
            baselines, learned = self._record_news()
            gained = share - reading
            self._reading.remember(
                {name: seen for name, seen in baselines.items() if name in gained},
                {name: step for name, step in learned.items() if name in gained},
            )
            self._share = share
            members = len(self._shares.members())
            self._log(
                f"cluster: reads {len(share)} of {len(backends)} backends ({members} members)"
            )
            self._start_probes()

    def _tell_workers_who_asks(self) -> None:
        """Read workers hold the settings their share came with: on taking or losing the
        lead, or a change of the backends awaiting re-admission or retired, send them
        again (the daemon's own tasks ask before every read)."""
        settings = self.settings
        told = (settings.unasked is None, settings.awaiting_answer, settings.retired)
        if told != self._told and isinstance(self._reading, ReadPool):
            self._start_probes()
        self._told = told

    def _publication(self) -> Publication | None:
        """This member's share's newest verdicts, with their serials, and how often it
        has examined each backend, decided or not, for the leader."""
        if self._shares is None:
            return None
        backends = {target.name for target in self._targets if target.kind == "backend"}
        verdicts = {
            name: probe.outcome.verdict
            for name, probe in self._state.probes.items()
            if probe.outcome is not None and name in backends
        }
        examined = {
            name: probe.examinations
            for name, probe in self._state.probes.items()
            if probe.examinations and name in backends
        }
        urls = {
            name: probe.outcome.target.url
            for name, probe in self._state.probes.items()
            if probe.outcome is not None and name in backends
        }
        reading_at = {
            target.name: target.url for target in self._targets if target.name in examined
        }
        return Publication(dict(self._serials), verdicts, examined, urls, reading_at)

    def _heard(
        self, target: Target, verdict: Verdict | None, seconds: float, window: Sequence[Read]
    ) -> None:
        probe = self._state.probes.setdefault(target.name, _Probe())
        # No reads at all: its task died or its worker was lost, and its reads start
        # afresh. That shows nothing of the server: the sleep last heard stands until a
        # read shows it awake (an undecided read's is in no verdict nor the record).
        if window:
            # Its newest read with vLLM series, else the record's, unless a read after
            # it shows another process (a new one starts awake); None with none readable.
            shown = newest_vllm_read(window) is not None or any(
                read.signals is not None and read.signals.process_start is not None
                for read in window
            )
            probe.window_asleep = (
                bool(asleep_now(window, self._news[0].get(target.name))) if shown else None
            )
        self.hear(target, verdict, seconds)

    def _probe_task_died(self, name: str, cause: str) -> None:
        """A probing task ended by itself (a bug past every guard): logged and counted;
        it was started again."""
        self._state.probe_task_restarts[name] += 1
        self._log(f"{name}: probing task died ({cause}); started again")

    def _record_news(self) -> tuple[dict[str, Signals], dict[str, LongestStep]]:
        """What the last settled record saw of each backend, for reads that start afresh;
        on the loop's thread, while the settle thread may be changing the record itself."""
        return self._news

    def _seen(self, record: FleetRecord) -> None:
        """The record as settled or read, and what the loop's thread may read of it."""
        self._record = record
        # With the steps of backends kept aside (left the config out of the serving set):
        # one a reload brings back is read at once, before the settle that restores its
        # sighting, and without its step it was wedged at two waits, as at no start.
        kept = _withheld_steps(record)
        live = learned_steps_of(record)
        self._news = (baselines_of(record), {**kept, **live})
        steps_at: dict[str, LongestStep | None] = {}
        for name, step in kept.items():
            server = same_server(str(record.withheld_forgotten[name]["entry"]["url"]))
            steps_at[server] = longer(steps_at.get(server), step)
        for name, step in live.items():
            if name in record.ledger:
                server = same_server(record.ledger.url_of(name))
                steps_at[server] = longer(steps_at.get(server), step)
        self._steps_at = steps_at
        self._note_whom_to_ask(record)

    def _note_whom_to_ask(self, record: FleetRecord) -> None:
        """The ledger's say in the tiny request: STALE ones asked whenever idle, RETIRED
        ones never."""
        self._awaiting = record.ledger.awaiting_readmission
        self._retired = record.ledger.retired

    def _take_fresh(self) -> list[Outcome]:
        """Verdicts that came in since the last cycle; called on the event loop's thread."""
        fresh = []
        for probe in self._state.probes.values():
            if not probe.fresh and probe.after is not None:
                # Its judged verdict went to the last settle (and, in a cluster, out under
                # its own serial, published after this take): the notice is this one's.
                probe.outcome, probe.after, probe.fresh = probe.after, None, True
            if probe.fresh and probe.outcome is not None:
                probe.fresh = False
                fresh.append(probe.outcome)
                self._serials[probe.outcome.target.name] = next(self._serial)
        return fresh

    def _settle_and_give_back(self, news: News) -> Settled:
        """A cycle's settle, then the C heap's free pages handed back (heap.py): a wait's
        bodies, freed, had kept them resident. In the settle's thread, so the loop that
        reads never waits for it."""
        try:
            return self._settle(news)
        finally:
            give_back_free_pages()

    def _settle(self, news: News) -> Settled:
        """One cycle's bookkeeping, in a worker thread: it may wait for the state lock, but
        never for a restart command (those it issues come back as orders to launch)."""
        backends = backend_urls(self._targets)
        seat = self._seat
        shares = self._shares
        if shares is not None and news.published is not None:
            self._publish(shares, news.published)
        if seat is not None and not (decision := seat.elector.decision()).may_act:
            if shares is not None:
                shares.stand_down()
            if decision.standing is Standing.STEPPING_DOWN or seat.elector.led_last:
                # It led when its router saw them, and no other leader is known (etcd
                # away past the renew deadline): kept, as for a settle cut off mid-way.
                # Dropped, the failing backend was back in the choice each wait while
                # etcd stayed away, and the settle on leading again never heard of it.
                # Kept too once its elector's next round has stepped down (a standby
                # from then on): kept only until then, they were dropped a retry later.
                # Until a whole round says otherwise, not until one fails: asked whether
                # etcd answered, a settle during the round that stepped down (seconds on
                # a silent etcd, after a pause) heard of the round before, and dropped them.
                return self._not_settled(news, seat.standing())
            # A standby serves the serving set the leader's record holds: it may never
            # read a moved backend itself (another member's share), nor settle its read.
            self._moved = frozenset()
            return self._stand_by(news, seat.standing())
        verdicts = news.verdicts
        if shares is not None and not news.final:
            try:
                verdicts = [*verdicts, *self._others_verdicts(shares, backends)]
            except StateError as exc:
                return self._not_settled(news, f"did not settle: {exc}")
        # A standby that takes over never saw the processes the old leader wrote down: the
        # record's sightings show the ledger a restart its windows missed (fleet.py).
        attempt = 1
        while True:
            if news.final and self._landed:
                # Stopping: the last settle's orders are launched by nobody. Heard in it as
                # not run, withdrawn, as the loop drops any order once stopping; taken as
                # its orders, they stayed RESTARTING, an attempt spent on no command, and
                # the next start failed them after their grace.
                stopping, why = [], "the daemon is stopping"
                for order in self._landed.values():
                    self._log(f"{order.name}: its restart command will not run: {why}")
                    stopping.append(not_run(order, why, withdrawn=True))
                news = replace(news, commands=[*news.commands, *stopping])
                self._landed = {}
            try:
                settled = settle_fleet(
                    self._store,
                    self._config,
                    backends,
                    lambda _record: verdicts,
                    mode=Mode.OFF if news.final else Mode.ACT,
                    audit=self._audit,
                    clock=self._clock,
                    requests=news.requests,
                    commands=news.commands,
                    commands_running=news.commands_running,
                    kept=self._kept,
                    unread=news.unread,
                    in_grace=news.in_grace,
                )
            except LostSaveLandedError as exc:
                # Nothing done yet: made again at once, without what the record holds.
                news, found = self._heard_already(news, exc.nonce)
                self._landed.update((order.name, order) for order in found)
            except RecordMovedError:
                # Nothing was written nor kept: the next attempt loads the verb's record.
                # Standing by instead cost the cycle's verdicts, a wedge proven a wait late.
                if attempt == SETTLE_ATTEMPTS:
                    raise
                attempt += 1
            except SaveUnansweredError as exc:
                # Written or not, nobody can tell yet: kept as below, and remembered.
                self._unanswered[exc.nonce] = (list(news.commands), news.requests, exc.orders)
                for nonce in list(self._unanswered)[:-UNANSWERED_KEPT]:  # as the store's
                    del self._unanswered[nonce]
                return self._not_settled(news, f"did not settle: {exc}")
            except ClusterError as exc:
                # Deposed, fenced out or cut off from etcd mid-settle: nothing was written,
                # no restart ordered; this cycle's verdicts are still reported.
                return self._not_settled(news, f"did not settle: {exc}")
            else:
                break
        self._unanswered.clear()  # none of them can go in after this save (EtcdStore)
        if self._landed:
            # Saved RESTARTING by the save that went in, and run by nobody: the backend
            # waited out its startup grace still wedged, an attempt spent on nothing.
            # Run as this settle's own; one moved on since, or whose command a reload
            # changed, is withdrawn before it runs (``cycle.withdrawn_now``).
            settled = replace(settled, orders=(*self._landed.values(), *settled.orders))
            self._landed = {}
        now = settled.report.checked_at
        self._seen(settled.record)
        self._snapshots = {snap.name: snap for snap in settled.record.ledger.snapshots(now)}
        self._fleet = settled.report.fleet
        read_there = {
            backend.outcome.target.name
            for backend in settled.report.backends
            if backend.outcome.target.name in backends
            and not other_server(backend.outcome.target.url, backends[backend.outcome.target.name])
            and _a_judged_read(backend.outcome.verdict)
        }
        self._moved = self._moved - read_there
        # Nor one read asleep: as for the router, a completion a balancer sent it crashed it.
        asleep = {name for name, shown in news.asleep.items() if self._asleep_as_shown(name, shown)}
        held_back = self._moved | asleep
        serving = tuple(name for name in settled.record.ledger.serving if name not in held_back)
        self._write_serving(serving, backends)
        return settled

    def _heard_already(self, news: News, nonce: bytes) -> tuple[News, tuple[RestartOrder, ...]]:
        """``news`` without what the settle whose unanswered save went in was given (its
        command outcomes, the router's outcomes given back since): the record holds them,
        and heard again a failure counted twice and a command's outcome was audited twice.
        With the restarts that settle issued, which nobody ran.
        """
        heard = self._unanswered.pop(nonce, None)
        self._unanswered.clear()  # the others' saves compared a record this one moved on
        if heard is None:
            return news, ()
        commands, requests, orders = heard
        left: dict[str, list[RequestOutcome]] = {}
        for name, seen in (news.requests or {}).items():
            gone = list((requests or {}).get(name, ()))
            for outcome in seen:
                if outcome in gone:
                    gone.remove(outcome)
                else:
                    left.setdefault(name, []).append(outcome)
        return replace(
            news,
            commands=[done for done in news.commands if all(done is not c for c in commands)],
            requests=left if news.requests is not None else None,
        ), orders

    def _publish(self, shares: SharedReads, published: Publication) -> None:
        """Best effort: a settle goes on without it. Logged once per cause, and when it
        works again: while it fails the leader settles this member's share `stalled`
        ("no member has published a verdict of it"), and only this log says why."""
        try:
            if not shares.publish(*published):
                return  # no lease (the elector says why): nothing published, again or not
        except StateError as exc:
            why = str(exc)
            if why != self._publish_error:
                self._log(f"cluster: this member's verdicts were not published: {why}")
            self._publish_error = why
            return
        if self._publish_error is not None:
            self._log("cluster: this member's verdicts are published again")
        self._publish_error = None

    def _others_verdicts(self, shares: SharedReads, backends: Mapping[str, str]) -> list[Outcome]:
        """What the other members read since the last settle, each verdict once; doubt for
        a backend none of them has for a lease's TTL and three waits (the time for its
        reader's lease to lapse, its share to move, and the new reader to judge)."""
        assert self._config.cluster is not None
        stale_after = self._config.cluster.lease_ttl + 3 * self.settings.wait
        undecided_for = self.settings.longest_undecided
        taken = shares.take(backends, stale_after, undecided_for)
        targets = {target.name: target for target in self._targets}
        # Each as read where its member read it: settle counts none read at an address
        # the backend has since left (a reload, here or on that member).
        return [
            Outcome(replace(targets[name], url=taken.urls.get(name, targets[name].url)), verdict)
            for name, verdict in taken.verdicts.items()
            if name in targets
        ]

    def _not_settled(self, news: News, why: str) -> Settled:
        """A leader's settle that wrote nothing (etcd away, fenced out, deposed): a stand-by
        cycle, and the router's outcomes it drained kept for the next settle. Lost, the
        failures of real traffic let the failing backend back into the router's choice at
        the push after this cycle, and the next settle never heard of them."""
        self._unsettled_requests = news.requests
        return self._stand_by(news, why)

    def _stand_by(self, news: News, why: str) -> Settled:
        """A cycle that acts on nothing: the verdicts with the ledger as the leader keeps it.

        The serving file keeps its last content: only a leader writes it. Outcomes of
        commands this daemon ran while it led wait for a settle of its own as leader.
        """
        self._commands_done[:0] = news.commands
        now = self._clock()
        policy = ledger_policy(self._config.policy)
        try:
            with self._reader.locked():
                record = self._reader.load(lambda doc: FleetRecord.from_dict(doc, policy))
        except StateError:
            record = None  # etcd away: the last ledger seen stands
        if record is not None:
            self._seen(record)
            self._snapshots = {snap.name: snap for snap in record.ledger.snapshots(now)}
            self._fleet = summarize(record.ledger)
        fleet = self._fleet or FleetSummary(
            0, self._config.policy.min_healthy, 0, False, "no fleet record seen yet"
        )
        reports = tuple(
            BackendReport(outcome, self._snapshots.get(outcome.target.name))
            for outcome in news.verdicts
        )
        seen = self._record or fresh_record(policy, backend_urls(self._targets), now)
        return Settled(CycleReport(now, reports, fleet, (why,)), seen)

    def _remember_models(self, report: CycleReport) -> None:
        """The model lists the tiny request saw; kept while the backend is busy and so
        not asked again. Only where the backend is now: a reload may have moved it while
        the old address was asked."""
        where = {target.name: target.url for target in self._targets}
        for backend in report.backends:
            read_at = backend.outcome.target.url
            if (url := where.get(backend.outcome.target.name)) is None or other_server(
                read_at, url
            ):
                continue
            answer = backend.outcome.verdict.answer
            if answer is not None and answer.models_served:
                self._models[backend.outcome.target.name] = frozenset(answer.models_served)

    def _after_cycle(
        self, report: CycleReport, seconds: float, pace: float | None, live: Live | None
    ) -> None:
        state = self._state
        state.cycles += 1
        now = self._clock()
        steady_now = self._stall_now()
        signals: dict[str, Signals] = {}
        for backend in report.backends:
            outcome = backend.outcome
            state.latest[outcome.target.name] = outcome
            error = _ERROR_KINDS.get(outcome.verdict.kind)
            if outcome.verdict.kind is VerdictKind.NO_METRICS and not outcome.verdict.healthy:
                error = "no_metrics"
            if outcome.verdict.answer is not None and outcome.verdict.answer.refused:
                error = KEY_REFUSED  # not judged (a new process's is: restarted, unproven)
            if error is not None:
                state.probe_errors[(outcome.target.name, error)] += 1
            for read in reversed(outcome.verdict.reads):
                if read.signals is not None and read.signals.has_vllm:
                    signals[outcome.target.name] = read.signals
                    break
        # A sharding standby hears of its share alone: the others' verdicts (their
        # publications) are taken only by the leader's settle.
        seat = self._seat
        share_alone = (
            self._share is not None and seat is not None and not seat.elector.decision().may_act
        )
        if share_alone:
            # Standing by, the verdict last heard while leading of a backend another member
            # reads stayed on /metrics for as long as this member stood by: a "wedged" or
            # "down" there kept LLMHealthBackendWedged or Down firing for a mended backend.
            for target in self._targets:
                if not self._reads(target):
                    state.latest.pop(target.name, None)
        elif state.share_alone:
            # Hearing the whole fleet from now on: what it observed standing by was its
            # share's alone, and kept, a share with work and nothing finished had the new
            # leader call the fleet stalled at once, before the others' backends' finished
            # requests were heard (their first verdicts come a settle or two later).
            state.stall = StallWatch(started_at=steady_now)
        state.share_alone = share_alone
        for line in report.notes:
            if line not in state.notes:  # a standby's note holds from cycle to cycle
                self._log(line)
        state.notes = report.notes
        # Only backends configured now: a command heard after a reload dropped its backend
        # brought that backend's counter back to /metrics, frozen, for the daemon's life.
        configured = {target.name for target in self._targets}
        for note in report.restarts:
            if note.name not in configured:
                continue
            if note.ran:
                state.restarts[(note.name, "ok" if note.ok else "failed")] += 1
            elif note.action == "retire":
                state.restarts[(note.name, "retired")] += 1
        for expired in report.expired:  # its command may have exited 0: the restart failed
            if expired.name in configured:
                state.restarts[(expired.name, "failed")] += 1
        state.stall.observe(signals, steady_now)
        # Whether the fleet stalls is the leader's to say: a share with work pending and
        # none finished was called a stalled fleet (LLMHealthFleetStalled, critical) while
        # the others' backends finished requests. Observed all the same, for its gauge of
        # the time since a request finished (of its share).
        stalled = not share_alone and state.stall.stalled(steady_now, self._config.stall_timeout)
        # Every backend's ledger state, not only those whose probe reported this cycle.
        snapshots = self._snapshots
        views = []
        for target in self._targets:
            latest = state.latest.get(target.name)
            snapshot = snapshots.get(target.name)
            verdict = latest.verdict if latest else None
            refused = (
                verdict is not None
                and not verdict.judged
                and verdict.answer is not None
                and verdict.answer.refused
            )
            probe = state.probes.get(target.name)
            views.append(
                BackendView(
                    name=target.name,
                    kind=target.kind,
                    # Turned away for our key: not judged, so no verdict (its kind said
                    # "idle", or "down" for a proxy, which paged as a failed balancer).
                    verdict=str(verdict.kind) if verdict and not refused else None,
                    state=str(snapshot.state) if snapshot else None,
                    serving=snapshot.serving if snapshot else None,
                    running=verdict.running if verdict else None,
                    waiting=verdict.waiting if verdict else None,
                    steps_per_s=verdict.steps_per_s if verdict else None,
                    tokens_per_s=verdict.tokens_per_s if verdict else None,
                    probe_seconds=probe.seconds if probe else None,
                    in_place_recoveries=snapshot.in_place_recoveries if snapshot else None,
                    examinations=probe.examinations if probe else None,
                )
            )
        self._collector.publish(
            ExportView(
                backends=tuple(views),
                fleet=report.fleet,
                seconds_since_finished=state.stall.seconds_since_finished(steady_now),
                fleet_stalled=stalled,
                last_cycle_at=now,
                cycle_seconds=seconds,
                reads_per_wait=pace,
                probe_errors=dict(state.probe_errors),
                probe_task_restarts={
                    **{target.name: 0 for target in self._targets},
                    **state.probe_task_restarts,
                },
                # Zero series from the start, so increase() sees a backend's first failure.
                restarts={
                    **{
                        (backend.name, outcome): 0
                        for backend in self._config.backends
                        if backend.restart
                        for outcome in ("ok", "failed", "retired")
                    },
                    **state.restarts,
                },
                cluster=self._cluster_view(report, now),
            )
        )
        fleet = report.fleet
        behind = pace is not None and pace < READS_KEEP_UP
        status = (
            (f"{self._seat.standing()}: " if self._seat is not None else "")
            + f"{fleet.serving} serving (min {fleet.min_healthy}), epoch {fleet.epoch}"
            + (", FLOOR BREACHED" if fleet.floor_breached else "")
            + (", FLEET STALLED" if stalled else "")
            + (f", READS BEHIND ({pace:.2f} per wait)" if behind else "")
        )
        self._tell_systemd(status)
        if stalled:
            self._log(
                "fleet stall: work is pending and no backend finished a request for "
                f"{state.stall.seconds_since_finished(steady_now):.0f} s (stall_timeout "
                f"{self._config.stall_timeout:g} s); nothing is restarted for this"
            )
        if behind:
            self._log(
                f"reads behind the wait: the targets are examined {pace:.2f} times per "
                f"{self._wait:g} s wait, not once, so a wedge is proven that much later; "
                "reading needs more CPU than it has (more read_workers, a longer wait, or "
                "[cluster] shard_reads), or most targets answer slower than the wait "
                "(llmhealth_backend_probe_duration_seconds)"
            )
        if live is not None:
            live.update(Group(*report_renderables(report)), refresh=True)
            return
        self._log(f"cycle {state.cycles}: {status}, settled in {seconds:.2f} s")
        for backend in report.backends:
            for transition in backend.transitions:
                if transition.applied and transition.from_state != transition.to_state:
                    self._log(
                        f"{transition.name}: {transition.from_state} -> {transition.to_state}: "
                        f"{backend.outcome.verdict.evidence}"
                    )
        for transition in report.traffic:  # what requests through the router did
            if transition.applied and transition.from_state != transition.to_state:
                self._log(
                    f"{transition.name}: {transition.from_state} -> {transition.to_state}: "
                    f"{transition.reason}"
                )
        for note in report.restarts:
            if note.ran:
                done = "restart command ran" if note.ok else "restart command FAILED"
                self._log(f"{note.name}: {done}: {note.reason}")
            elif note.action != "skip":
                self._log(f"{note.name}: {note.action}: {note.reason}")

    def _cluster_view(self, report: CycleReport, now: float) -> ClusterView | None:
        """Who leads as seen from here, for the metrics; and this member's own report."""
        seat = self._seat
        if seat is None:
            return None
        summary: dict[str, Any] = {
            "at": now,
            "cycles": self._state.cycles,
            "verdicts": len(report.backends),
            "serving": report.fleet.serving,
        }
        if self._share is not None:
            summary["share"] = len(self._share)
        seat.elector.report(summary)
        observed = seat.elector.observed
        leader = observed.leader
        members, shares = {}, {}
        for name, value in observed.members:
            last = value.get("last_report", {})
            last = last if isinstance(last, dict) else {}
            at, share = last.get("at"), last.get("share")
            members[name] = float(at) if isinstance(at, int | float) else 0.0
            if isinstance(share, int) and not isinstance(share, bool):
                shares[name] = share
        leading = seat.elector.decision().may_act
        return ClusterView(
            member=seat.member,
            leading=leading,
            etcd_up=observed.etcd_up,
            leader=leader.member if leader else None,
            leader_since=leader.since if leader else None,
            fence=leader.fence if leader else 0,
            revision=max(seat.store.revision, seat.reader.revision),
            members=members,
            shares=shares if self._shares is not None else None,
            stale_verdicts=len(self._shares.stale) if self._shares and leading else None,
        )

    def _reload_config(self) -> None:
        try:
            config, targets = self._load()
        except (config_module.ConfigError, ValueError) as exc:
            self._log(f"reload refused, keeping the running config: {exc}")
            return
        refused = config.cannot_replace(self._config)
        if not targets:
            # As at start: an empty or truncated file would forget every backend, and with
            # them every retirement, proof and restart budget.
            refused = "nothing to watch (no backends or proxies)"
        elif self._router is not None and not routed_backends(config, targets):
            # As `route` refuses to start: a router left with no backend refuses every
            # request, and the reload forgot every backend as an empty file would.
            refused = "nothing to route to (no backends)"
        if refused is not None:
            self._log(f"reload refused, keeping the running config: {refused}")
            return
        wait = self._wait
        was = {(t.kind, same_server(t.url)): t.name for t in self._targets}
        reading = {t.name: (t.url, t.cgroup) for t in self._targets}
        # A moved one renamed at its new address (its record goes to the new name) is
        # still unjudged there: held back under its new name too.
        moved_to = {
            same_server(t.url)
            for t in self._targets
            if t.kind == "backend" and t.name in self._moved
        }
        self._moved = frozenset(
            t.name
            for t in targets
            if t.kind == "backend"
            and (
                t.name in self._moved
                or (t.name in reading and other_server(t.url, reading[t.name][0]))
                or (t.name not in reading and same_server(t.url) in moved_to)
            )
        )
        self._config, self._targets = config, targets
        # A target read afresh (a new name at its server, an address written another way
        # or moved, other processes sampled) starts with the longest step the record
        # learned of its server, or of its name (moved), the longer: as at start. Without
        # it, a renamed server inside a long step was wedged at two waits and restarted;
        # a longer window only waits longer for a proof.
        _, steps = self._record_news()
        fresh = {}
        for target in targets:
            if target.kind != "backend" or reading.get(target.name) == (target.url, target.cgroup):
                continue  # its reading goes on, with what it learned (``ReadTasks.assign``)
            step = longer(self._steps_at.get(same_server(target.url)), steps.get(target.name))
            if step is not None:
                fresh[target.name] = step
        if fresh:
            self._reading.remember({}, fresh)
        # A model list learned of another server (a name dropped, or moved) is not this
        # one's; its URL written another way, or a new name at its server, is the same one
        # (a busy backend is not asked again: dropped, it was pushed as serving any model).
        learned, self._models = self._models, {}
        for target in targets:
            old = was.get((target.kind, same_server(target.url)))
            if old is not None and old in learned:
                self._models[target.name] = learned[old]
        self._key_variables |= config.key_variables
        self._forget_series_of_removed(targets)
        if self._wait != wait:
            # Timing kept against the old wait says nothing of the new one, and the first
            # gap after the reload still spans the old wait: each target counts again
            # from its next examination, so a shorter wait does not read as "behind".
            for probe in self._state.probes.values():
                probe.gap = probe.heard_at = None
        self._start_probes()
        if self._router is not None:  # [router] settings themselves take a restart
            self._router.configure(routed_backends(config, targets), retry_after=self._wait)
        self._log(f"config reloaded: {len(targets)} targets")

    def _forget_series_of_removed(self, targets: Sequence[Target]) -> None:
        """A backend the config no longer names leaves /metrics: its frozen counters would
        keep alerts firing (a failed restart's for an hour) and grow with every rename."""
        names = {target.name for target in targets}
        state = self._state
        for counter in (state.probe_errors, state.restarts):
            for key in [key for key in counter if key[0] not in names]:
                del counter[key]
        for name in [name for name in state.probe_task_restarts if name not in names]:
            del state.probe_task_restarts[name]
        # Nor may what is kept by name grow with every name a fleet ever had (pods).
        for name in [name for name in self._models if name not in names]:
            del self._models[name]
        for name in [name for name in self._serials if name not in names]:
            del self._serials[name]
        state.stall.forget_all_but(names)
        # And leaves the page now, not when the next cycle publishes another: a wait on
        # (minutes), or for as long as settles are skipped (a full disk), its last verdict
        # and counters stayed there firing alerts.
        view = self._collector.view
        self._collector.publish(
            replace(
                view,
                backends=tuple(backend for backend in view.backends if backend.name in names),
                probe_errors={k: n for k, n in view.probe_errors.items() if k[0] in names},
                restarts={k: n for k, n in view.restarts.items() if k[0] in names},
                probe_task_restarts={
                    k: n for k, n in view.probe_task_restarts.items() if k in names
                },
            )
        )

    def _write_serving(self, serving: tuple[str, ...], urls: Mapping[str, str]) -> None:
        """Tell an existing balancer which backends serve: a file, then an optional hook."""
        current = tuple((name, urls[name]) for name in serving if name in urls)
        if self._serving_file is None or current == self._state.serving_written:
            return
        path = self._serving_file
        if path.suffix == ".conf":
            lines = ["# written by llmhealth watch: the backends that may be handed traffic"]
            lines += [f"server {_host_port(url)};" for _, url in current]
            if not current:
                # nginx refuses an upstream without servers; a down one keeps it loadable.
                lines.append("server 127.0.0.1:9 down;")
            text = "\n".join(lines) + "\n"
        else:
            text = json.dumps(
                {"serving": [{"name": name, "url": url} for name, url in current]}, indent=1
            )
        temporary: Path | None = None
        try:
            # A random name opened with O_EXCL (a fixed one could be a planted symlink),
            # then 0644: the balancer, another user, must read it.
            descriptor, name = tempfile.mkstemp(
                prefix=f".{path.name}.", suffix=".tmp", dir=path.parent
            )
            temporary = Path(name)
            with os.fdopen(descriptor, "w", encoding="utf-8") as handle:
                os.fchmod(handle.fileno(), 0o644)
                handle.write(text)
                # On disk before the rename, as the state is: renamed unsynced, a power
                # loss could leave it empty, an upstream nginx refuses (no balancer at
                # boot). The old file or the new one is whole; the next start rewrites it.
                handle.flush()
                os.fsync(handle.fileno())
            os.replace(temporary, path)
        except OSError as exc:
            if temporary is not None:
                with contextlib.suppress(OSError):
                    temporary.unlink()
            # The balancer keeps its last file; watching goes on, and the next cycle retries.
            self._log(f"cannot write the serving file {path}: {exc}")
            return
        self._state.serving_written = current
        self._serving_changed = True  # the loop runs on_serving_change, not this thread

    def _log(self, message: str) -> None:
        # Printable, and never read as markup: messages quote evidence and command output.
        message = printable(message)
        if self._console.is_terminal:
            self._console.log(message, markup=False, highlight=False, emoji=False)
        else:  # journald adds its own timestamp
            # A log's reader gone (a closed pipe) is no reason to stop watching or routing,
            # nor is a log that cannot be written (a full disk: ENOSPC): the line is lost;
            # nor a reader that stops reading (``LogLines``).
            LOG_LINES.write(message)


def _a_judged_read(verdict: Verdict) -> bool:
    """Whether ``verdict`` came of a read llmhealth judged: not its own failure
    (``probe.unjudged``, our API key turned away), nor a cluster leader's doubt of a
    backend nobody read (``shares.doubt``: STALLED, made of no read)."""
    return verdict.judged and (verdict.kind is not VerdictKind.STALLED or bool(verdict.reads))


def _withheld_steps(record: FleetRecord) -> dict[str, LongestStep]:
    """The longest step of each backend the record keeps aside (``withheld_forgotten``)."""
    steps = {}
    for name, kept in record.withheld_forgotten.items():
        if kept.get("sighting") is not None:
            step = Sighting.from_dict(kept["sighting"], f"{name}.sighting").longest_step
            if step is not None:
                steps[name] = step
    return steps


@dataclass(frozen=True, slots=True)
class News:
    """What a settle feeds to the ledger: fresh verdicts, finished restart commands and
    what real traffic showed. ``final``: the last settle on the way out, which issues no
    new restart."""

    verdicts: list[Outcome]
    commands: list[CommandDone]
    requests: Mapping[str, Sequence[RequestOutcome]] | None = None
    published: Publication | None = None  # shard_reads
    final: bool = False
    commands_running: frozenset[str] = frozenset()  # backends whose restart command runs
    unread: frozenset[str] = frozenset()  # backends not read yet where they are configured
    in_grace: frozenset[str] = frozenset()  # restart commands ended within the grace (steady)
    # What each backend's reads show of a sleep on purpose (``Daemon._shown_asleep``)
    asleep: Mapping[str, bool | None] = field(default_factory=dict)


def watchdog_interval(environment: Mapping[str, str], pid: int) -> float | None:
    """Half of systemd's watchdog period (``WATCHDOG_USEC``) when it watches this process
    (``WATCHDOG_PID`` unset or ours), else None."""
    owner = environment.get("WATCHDOG_PID")
    if owner is not None and owner != str(pid):
        return None
    try:
        usec = int(environment.get("WATCHDOG_USEC", ""))
    except ValueError:
        return None
    return usec / 2e6 if usec > 0 else None


def _run_order(order: RestartOrder) -> CommandResult:
    return run_command(order.argv, order.timeout, env=order.env)


def _run_hook(command: tuple[tuple[str, ...], Mapping[str, str]]) -> CommandResult:
    argv, environment = command
    return run_command(argv, SERVING_HOOK_TIMEOUT, env=environment)


def _in_daemon_thread(
    function: Callable[[A], T], argument: A, name: str = "llmhealth-cycle"
) -> asyncio.Future[T]:
    """Run ``function`` in a daemon thread; asyncio.to_thread's pool would be joined at exit.
    RuntimeError when no thread can be started (a process or pids limit)."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[T] = loop.create_future()

    def deliver(outcome: Callable[[], None]) -> None:
        if not future.done():
            outcome()

    def run() -> None:
        try:
            result = function(argument)
        except BaseException as exc:  # handed to the loop, which decides what it means
            error = exc
            with contextlib.suppress(RuntimeError):  # the loop is already closed
                loop.call_soon_threadsafe(deliver, lambda: future.set_exception(error))
            return
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(deliver, lambda: future.set_result(result))

    threading.Thread(target=run, name=name, daemon=True).start()
    return future


def _host_port(url: str) -> str:
    """``url``'s host and port for an nginx ``server`` line, the port always written:
    nginx takes a bare host as port 80, so an https backend without one (443) was handed
    clients on port 80, and an empty port (``http://h:``, which is ``http://h``) made a
    line nginx refuses, failing its reload. A name is written as every request resolves
    it (IDNA): nginx looks "bücher.example" up as written, finds no such host, and
    refuses the whole file."""
    parts = urlsplit(url)
    netloc = parts.netloc
    host = netloc[: netloc.rindex(":")] if netloc.rfind(":") > netloc.rfind("]") else netloc
    if not host.startswith("["):
        host = host.encode("idna").decode("ascii")
    port = parts.port or (443 if parts.scheme.lower() == "https" else 80)
    return f"{host}:{port}"
