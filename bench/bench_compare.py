"""llmhealth against the ways people check LLM servers today, on the same simulated servers.

Two questions, each answered with every contender running in the same run, each on its
own fresh simulated backend (one `llmhealth simulate` process, one port per contender),
so no contender's requests queue in front of another's:

1. Saturation: does a checker restart a healthy server that is merely full, and what does
   its checking cost the server? (The incident in shared/seeds/002: a real chat request
   every 5 min with a 45 s timeout, 5 failures in a row, restarted a busy healthy server.)
2. Wedge: when the engine really freezes, how long until each checker says so and restarts?

Contenders, each a small faithful loop whose "restart" is `POST /sim/restart` on its own
backend (for llmhealth, through the restart command in its config, run by llmhealth):

- llmhealth `check` on a timer (the shipped systemd timer: every minute), in-process via
  `run_cycle` with a config that has a restart command;
- llmhealth `watch`, the daemon, as a subprocess with the same kind of config;
- an active checker: a real completion request every 5 min, 45 s timeout, restart after
  5 failures in a row (the incident's watchdog; the simulator has no chat endpoint, so
  the "chat" is a 16-token `/v1/completions` request, which holds a slot the same way);
- a `/health` poller with Kubernetes liveness-probe defaults (period 10 s, timeout 1 s,
  failure threshold 3).

Time is scaled down by SCALE: every period, timeout, wait, cooldown and grace above is
divided by it (so 5 min becomes 10 s). Network and CPU costs do not scale, which makes a
read a larger share of a scaled wait than of a real one: that favours no contender that
reads more than it waits.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from report import Section, Table, spread
from simproc import SimulatorStartError, child_env, running_simulator

from llmhealth import config as config_module
from llmhealth.classify import Target
from llmhealth.cycle import run_cycle
from llmhealth.probe import ProbeSettings
from llmhealth.remediate import Mode
from llmhealth.report import CycleReport
from llmhealth.state import StateFile

SCALE = 30.0  # one bench second stands for this many real seconds
MODEL = "tiny"
MAX_NUM_SEQS = 4

# Real-world settings of each contender, in real seconds; the bench divides them by SCALE.
LLMHEALTH_REAL = {
    "wait": 5.0,
    "timeout": 5.0,
    "answer_timeout": 10.0,
    "timer": 60.0,  # systemd/llmhealth-check.timer: OnCalendar=*:0/1
    "stall_timeout": 600.0,
    "cooldown": 60.0,
    "cooldown_max": 1800.0,
    "startup_grace": 900.0,
    "restart_timeout": 120.0,
    "restart_budget_window": 86400.0,
}
ACTIVE_REAL = {"period": 300.0, "timeout": 45.0}
ACTIVE_THRESHOLD = 5
K8S_REAL = {"period": 10.0, "timeout": 1.0}
K8S_THRESHOLD = 3

# Section 1: one backend per contender held at saturation, a steady stream of user requests.
SATURATION_SECONDS = 60.0  # bench seconds (30 min of real time)
SATURATION_REQUEST_SECONDS = 2.0  # a synthetic batch request lasts 1 min real
USER_RATE = 1.0  # user requests per bench second, per backend
USER_TIMEOUT = 30.0  # bench seconds; long enough that only a restart fails a user request
USER_MAX_TOKENS = 64
DRAIN_SECONDS = 20.0  # after the window, how long in-flight user requests may finish

# Section 2: a backend wedges a known time after its (simulated) process started.
WEDGE_AFTER = 8.0
WEDGE_RUNS = 5
WEDGE_CAP = 60.0  # bench seconds after the wedge before a run gives up (30 min real)
WEDGE_REQUEST_SECONDS = 0.25  # light load: a probe request is answered in about 0.6 s

STATS_POLL = 0.05  # how often the bench looks at /sim/stats for restarts
READY_TIMEOUT = 60.0  # for the watch daemon to settle its first cycle
SIM_READY_TIMEOUT = 90.0  # a loaded shared machine can take long to start a simulator
STOP_TIMEOUT = 15.0

RESTART_SCRIPT = '''\
"""The bench's restart command: what `systemctl restart vllm` is to a real server."""
import json
import sys
import urllib.request

url, mode = sys.argv[1], sys.argv[2]
opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
request = urllib.request.Request(
    url + "/sim/restart",
    data=json.dumps({"mode": mode}).encode(),
    headers={"Content-Type": "application/json"},
    method="POST",
)
with opener.open(request, timeout=5) as response:
    sys.exit(0 if response.status == 200 else 1)
'''


def scaled(real_seconds: float) -> float:
    return real_seconds / SCALE


def log(message: str) -> None:
    print(f"[compare {time.strftime('%H:%M:%S')}] {message}", flush=True)


async def sleep_until(when: float, stop: asyncio.Event) -> bool:
    """Sleep until the wall-clock time `when`; False when `stop` was set first."""
    if stop.is_set():
        return False
    delay = when - time.time()
    if delay <= 0:
        return True
    try:
        await asyncio.wait_for(stop.wait(), delay)
    except TimeoutError:
        return True
    return False


def first_tick(anchor: float, phase: float, period: float, now: float) -> float:
    """The first tick at or after `now` of a timer that fires `phase` s before `anchor`."""
    tick = anchor - phase
    if tick < now:
        tick += math.ceil((now - tick) / period) * period
    return tick


def new_client() -> httpx.AsyncClient:
    """Loopback only, no environment proxies, as many connections as the load needs."""
    return httpx.AsyncClient(
        trust_env=False,
        limits=httpx.Limits(max_connections=None, max_keepalive_connections=32),
    )


async def sim_restart(client: httpx.AsyncClient, url: str, mode: str) -> bool:
    """A contender's restart: the simulated process starts over in `mode`."""
    try:
        response = await client.post(f"{url}/sim/restart", json={"mode": mode}, timeout=5.0)
    except httpx.HTTPError:
        return False
    return response.status_code == 200


async def sim_stats(client: httpx.AsyncClient, url: str) -> dict[str, Any]:
    response = await client.get(f"{url}/sim/stats", timeout=5.0)
    response.raise_for_status()
    stats: dict[str, Any] = response.json()
    return stats


# --- the bench's own instruments ----------------------------------------------------------


@dataclass
class UserRequest:
    sent: float
    done: float | None = None
    outcome: str = "pending"  # ok, failed_by_restart, error, timeout, unfinished


class LoadGenerator:
    """Real completions at a steady rate: the users a false restart fails.

    `/sim/restart` lets requests already held by the old simulated process finish; a real
    restart drops them (vLLM answers 500 or resets the connection). So when the bench sees
    a restart, every request of ours still in flight is cancelled and counted as failed by
    it. The reload time of a real restart (minutes, for 19 GB of weights) is not modelled:
    the simulator is back at once, so the failures counted are a lower bound.
    """

    def __init__(self, url: str, rate: float) -> None:
        self.url = url
        self.rate = rate
        self.requests: list[UserRequest] = []
        self._tasks: dict[asyncio.Task[None], UserRequest] = {}
        self._client = new_client()

    async def run(self, start: float, stop: asyncio.Event) -> None:
        index = 0
        while await sleep_until(start + index / self.rate, stop):
            record = UserRequest(time.time())
            self.requests.append(record)
            task = asyncio.create_task(self._one(record))
            self._tasks[task] = record
            task.add_done_callback(self._tasks.pop)
            index += 1

    async def _one(self, record: UserRequest) -> None:
        body = {"model": MODEL, "prompt": "Summarize the report.", "max_tokens": USER_MAX_TOKENS}
        try:
            async with asyncio.timeout(USER_TIMEOUT):
                response = await self._client.post(
                    f"{self.url}/v1/completions", json=body, timeout=USER_TIMEOUT
                )
            record.outcome = "ok" if response.status_code == 200 else "error"
        except TimeoutError:
            record.outcome = "timeout"
        except httpx.HTTPError:
            record.outcome = "error"
        except asyncio.CancelledError:
            if record.outcome == "pending":
                record.outcome = "unfinished"
            raise
        finally:
            record.done = time.time()

    def drop_in_flight(self) -> int:
        """A restart happened: what was in flight is lost, as with a real one."""
        dropped = 0
        for task, record in list(self._tasks.items()):
            if record.outcome == "pending":
                record.outcome = "failed_by_restart"
                task.cancel()
                dropped += 1
        return dropped

    async def drain(self, seconds: float) -> None:
        """Let in-flight requests finish for a bounded time, then cancel the rest."""
        pending = list(self._tasks)
        if pending:
            await asyncio.wait(pending, timeout=seconds)
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=5.0)
        await self._client.aclose()

    def count(self, outcome: str) -> int:
        return sum(1 for r in self.requests if r.outcome == outcome)

    def median_latency(self) -> float | None:
        times = [r.done - r.sent for r in self.requests if r.outcome == "ok" and r.done]
        return statistics.median(times) if times else None


class StatsWatcher:
    """Polls every backend's /sim/stats and notes when its restart count goes up.

    One observer for every contender, so "when did the restart happen" is measured the
    same way whether the bench or llmhealth's restart command issued it.
    """

    def __init__(
        self, urls: dict[str, str], on_restart: Callable[[str], object] | None = None
    ) -> None:
        self.urls = urls
        self.on_restart = on_restart
        self.restarts: dict[str, list[float]] = {name: [] for name in urls}
        self.first: dict[str, dict[str, Any]] = {}
        self.last: dict[str, dict[str, Any]] = {}
        self._client = new_client()

    async def baseline(self) -> None:
        for name, url in self.urls.items():
            self.first[name] = self.last[name] = await sim_stats(self._client, url)

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            await self.poll()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), STATS_POLL)

    async def close(self) -> None:
        """One last look (counts settle only once every request has arrived), then close."""
        try:
            await self.poll()
        finally:
            await self._client.aclose()

    async def poll(self) -> None:
        for name, url in self.urls.items():
            try:
                stats = await sim_stats(self._client, url)
            except httpx.HTTPError:
                continue
            seen = time.time()
            new = stats["restarts"] - self.last[name]["restarts"]
            self.last[name] = stats
            if new > 0:
                self.restarts[name] += [seen] * new
                if self.on_restart is not None:
                    self.on_restart(name)

    def delta(self, name: str, key: str) -> int:
        return int(self.last[name][key]) - int(self.first[name][key])


# --- contenders ---------------------------------------------------------------------------


@dataclass
class Tally:
    """What one contender did, in the terms every table uses."""

    requests: int = 0  # completions it sent itself (for the bench's own loops)
    held: float = 0.0  # seconds its completions were outstanding, client side
    probes: int = 0  # non-completion requests it made
    outcomes: Counter[str] = field(default_factory=Counter)
    condemned: list[float] = field(default_factory=list)  # when it decided "restart"
    failures: list[tuple[float, float]] = field(default_factory=list)  # (when, seconds taken)
    issued: list[float] = field(default_factory=list)  # when it sent the restart


class ActiveChecker:
    """The incident's watchdog: a real request on a timer, restart after N failures in a row."""

    label = "active checker"

    def __init__(self, url: str, after_mode: str) -> None:
        self.url = url
        self.after_mode = after_mode
        self.period = scaled(ACTIVE_REAL["period"])
        self.timeout = scaled(ACTIVE_REAL["timeout"])
        self.tally = Tally()

    @property
    def settings(self) -> str:
        return (
            f"chat request every {ACTIVE_REAL['period'] / 60:g} min, "
            f"{ACTIVE_REAL['timeout']:g} s timeout, restart after {ACTIVE_THRESHOLD} failures "
            f"(bench: {self.period:g} s, {self.timeout:g} s)"
        )

    async def run(self, tick: float, stop: asyncio.Event) -> None:
        streak = 0
        async with new_client() as client:
            while await sleep_until(tick, stop):
                sent = time.time()
                ok = await self._ask(client)
                self.tally.requests += 1
                self.tally.held += time.time() - sent
                if not ok:
                    self.tally.failures.append((sent, time.time() - sent))
                self.tally.outcomes["answered" if ok else "failed"] += 1
                streak = 0 if ok else streak + 1
                if streak >= ACTIVE_THRESHOLD:
                    self.tally.condemned.append(time.time())
                    if await sim_restart(client, self.url, self.after_mode):
                        self.tally.issued.append(time.time())
                    streak = 0
                tick += self.period
                tick += max(0, math.ceil((time.time() - tick) / self.period)) * self.period

    async def _ask(self, client: httpx.AsyncClient) -> bool:
        body = {"model": MODEL, "prompt": "Reply with OK.", "max_tokens": 16}
        try:
            async with asyncio.timeout(self.timeout):
                response = await client.post(
                    f"{self.url}/v1/completions", json=body, timeout=self.timeout
                )
        except (TimeoutError, httpx.HTTPError):
            return False
        return response.status_code == 200

    def conclusions(self) -> str:
        return ", ".join(f"{k} x{v}" for k, v in sorted(self.tally.outcomes.items())) or "-"


class HealthPoller:
    """A Kubernetes liveness probe on vLLM's /health with the kubelet's defaults."""

    label = "/health poller"

    def __init__(self, url: str, after_mode: str) -> None:
        self.url = url
        self.after_mode = after_mode
        self.period = scaled(K8S_REAL["period"])
        self.timeout = scaled(K8S_REAL["timeout"])
        self.tally = Tally()

    @property
    def settings(self) -> str:
        return (
            f"GET /health every {K8S_REAL['period']:g} s, {K8S_REAL['timeout']:g} s timeout, "
            f"restart after {K8S_THRESHOLD} failures "
            f"(bench: {self.period:.3f} s, {self.timeout:.3f} s)"
        )

    async def run(self, tick: float, stop: asyncio.Event) -> None:
        streak = 0
        async with new_client() as client:
            while await sleep_until(tick, stop):
                sent = time.time()
                ok = await self._probe(client)
                self.tally.probes += 1
                if not ok:
                    self.tally.failures.append((sent, time.time() - sent))
                self.tally.outcomes["200" if ok else "failed"] += 1
                streak = 0 if ok else streak + 1
                if streak >= K8S_THRESHOLD:
                    self.tally.condemned.append(time.time())
                    if await sim_restart(client, self.url, self.after_mode):
                        self.tally.issued.append(time.time())
                    streak = 0
                tick += self.period
                tick += max(0, math.ceil((time.time() - tick) / self.period)) * self.period

    async def _probe(self, client: httpx.AsyncClient) -> bool:
        try:
            async with asyncio.timeout(self.timeout):
                response = await client.get(f"{self.url}/health", timeout=self.timeout)
        except (TimeoutError, httpx.HTTPError):
            return False
        return response.status_code == 200

    def conclusions(self) -> str:
        return ", ".join(f"{k} x{v}" for k, v in sorted(self.tally.outcomes.items())) or "-"


def write_llmhealth_config(workdir: Path, name: str, url: str, after_mode: str) -> Path:
    """A scaled copy of the default config, with a restart command for this one backend."""
    script = workdir / "restart.py"
    script.write_text(RESTART_SCRIPT)
    restart = [sys.executable, "-I", "-S", str(script), url, after_mode]
    s = {key: scaled(value) for key, value in LLMHEALTH_REAL.items()}
    text = "\n".join(
        [
            f"wait = {s['wait']!r}",
            f"timeout = {s['timeout']!r}",
            f"answer_timeout = {s['answer_timeout']!r}",
            f"stall_timeout = {s['stall_timeout']!r}",
            f"state = {json.dumps(str(workdir / 'state.json'))}",
            f"audit_log = {json.dumps(str(workdir / 'audit.jsonl'))}",
            "",
            "[policy]",
            *(
                f"{key} = {s[key]!r}"
                for key in (
                    "cooldown",
                    "cooldown_max",
                    "startup_grace",
                    "restart_timeout",
                    "restart_budget_window",
                )
            ),
            "",
            "[[backend]]",
            f"name = {json.dumps(name)}",
            f"url = {json.dumps(url)}",
            f"restart = {json.dumps(restart)}",
            "",
        ]
    )
    path = workdir / "llmhealth.toml"
    path.write_text(text)
    config_module.load(path)  # fail here, loudly, if the bench wrote a config llmhealth refuses
    return path


def read_audit(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    entries = []
    for line in path.read_text().splitlines():
        with contextlib.suppress(ValueError):
            entries.append(json.loads(line))
    return entries


def wedged_from_audit(entries: list[dict[str, Any]]) -> list[tuple[float, float, float]]:
    """(first frozen read, proving read, ledger time) of every `wedged` condemnation."""
    found = []
    for entry in entries:
        evidence = entry.get("evidence") or {}
        if entry.get("to") != "dead" or evidence.get("verdict") != "wedged":
            continue
        reads = [float(read["at"]) for read in evidence.get("reads", []) if "at" in read]
        if reads:
            found.append((reads[0], reads[-1], float(entry["time"])))
    return found


def audit_story(entries: list[dict[str, Any]], since: float) -> list[str]:
    """The audit log as short lines, times relative to `since`: why a restart came when."""
    lines = []
    for entry in entries:
        when = float(entry.get("time", 0.0)) - since
        if when < -5.0:
            continue
        text = f"+{when:.2f} {entry.get('event')} {entry.get('from')}->{entry.get('to')}"
        command = entry.get("command")
        if isinstance(command, dict):
            outcome = (
                "timed out" if command.get("timed_out") else f"exit {command.get('exit_code')}"
            )
            text += f" (command {outcome} after {float(command.get('duration') or 0):.2f} s)"
        elif entry.get("reason"):
            text += f" ({str(entry['reason'])[:90]})"
        lines.append(text)
    return lines


def ledger_moves(entries: list[dict[str, Any]]) -> str:
    moves = Counter(
        f"{entry['from']}→{entry['to']}"
        for entry in entries
        if entry.get("from") != entry.get("to") and "from" in entry
    )
    return ", ".join(f"{move} x{count}" for move, count in sorted(moves.items())) or "none"


@dataclass
class CheckRecord:
    started: float
    finished: float
    verdict: str
    requests_sent: int
    restart_ran: bool


class CheckTimer:
    """`llmhealth check --config` on the shipped timer (every minute), run in-process."""

    label = "llmhealth check (timer)"

    def __init__(self, name: str, url: str, workdir: Path, after_mode: str) -> None:
        self.name = name
        self.workdir = workdir
        config_path = write_llmhealth_config(workdir, name, url, after_mode)
        self.config = config_module.load(config_path)
        self.targets = [Target(name, url)]
        self.probe = ProbeSettings(
            wait=self.config.wait,
            timeout=self.config.timeout,
            answer_timeout=self.config.answer_timeout,
            max_body=self.config.max_body,
        )
        self.store = StateFile(workdir / "state.json")
        self.period = scaled(LLMHEALTH_REAL["timer"])
        self.records: list[CheckRecord] = []

    @property
    def settings(self) -> str:
        return (
            f"every {LLMHEALTH_REAL['timer']:g} s, wait {LLMHEALTH_REAL['wait']:g} s "
            f"(bench: {self.period:g} s, {self.probe.wait:.3f} s)"
        )

    async def run(self, tick: float, stop: asyncio.Event) -> None:
        while await sleep_until(tick, stop):
            started = time.time()
            report: CycleReport = await asyncio.to_thread(
                run_cycle, self.config, self.targets, self.probe, self.store, mode=Mode.ACT
            )
            for backend in report.backends:
                verdict = backend.outcome.verdict
                self.records.append(
                    CheckRecord(
                        started,
                        time.time(),
                        str(verdict.kind),
                        verdict.requests_sent,
                        any(note.ran for note in report.restarts),
                    )
                )
            # A run still going when the timer fires is not started twice (systemd).
            tick += self.period
            tick += max(0, math.ceil((time.time() - tick) / self.period)) * self.period

    def audit(self) -> list[dict[str, Any]]:
        return read_audit(self.workdir / "audit.jsonl")

    def wedged(self) -> list[tuple[float, float, float]]:
        """(first frozen read, proving read, decision) of each `wedged` condemnation: read
        from the audit log, exactly as for `watch`."""
        return wedged_from_audit(self.audit())

    def conclusions(self) -> str:
        kinds = Counter(record.verdict for record in self.records)
        return ", ".join(f"{k} x{v}" for k, v in sorted(kinds.items())) or "-"


class WatchProcess:
    """`llmhealth watch --config` as the daemon runs: its own process, stopped by SIGTERM."""

    label = "llmhealth watch"

    def __init__(self, name: str, url: str, workdir: Path, after_mode: str) -> None:
        self.name = name
        self.workdir = workdir
        self.config_path = write_llmhealth_config(workdir, name, url, after_mode)
        self.lines: list[tuple[float, str]] = []
        self._process: subprocess.Popen[bytes] | None = None
        self._pump: threading.Thread | None = None
        self._ready = threading.Event()

    @property
    def settings(self) -> str:
        wait = LLMHEALTH_REAL["wait"]
        return f"a read every wait {wait:g} s (bench: {scaled(wait):.3f} s)"

    @contextlib.contextmanager
    def running(self) -> Iterator[WatchProcess]:
        argv = [
            sys.executable,
            "-m",
            "llmhealth",
            "watch",
            "--config",
            str(self.config_path),
            "--listen",
            "off",
        ]
        process = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            env=child_env(),
            start_new_session=True,
        )
        self._process = process
        assert process.stderr is not None
        self._pump = threading.Thread(target=self._read, args=(process.stderr,), daemon=True)
        self._pump.start()
        try:
            yield self
        finally:
            self.stop()

    def _read(self, stream: IO[bytes]) -> None:
        for raw in stream:
            line = raw.decode(errors="replace").rstrip("\n")
            self.lines.append((time.time(), line))
            if line.startswith("cycle "):
                self._ready.set()

    def wait_ready(self, timeout: float = READY_TIMEOUT) -> bool:
        """True once the daemon settled its first cycle."""
        return self._ready.wait(timeout)

    def stop(self) -> None:
        process = self._process
        if process is None:
            return
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(STOP_TIMEOUT)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(STOP_TIMEOUT)
        if self._pump is not None:
            self._pump.join(STOP_TIMEOUT)
        if process.stderr is not None:
            process.stderr.close()

    def audit(self) -> list[dict[str, Any]]:
        return read_audit(self.workdir / "audit.jsonl")

    def wedged(self) -> list[tuple[float, float, float]]:
        return wedged_from_audit(self.audit())

    def conclusions(self) -> str:
        cycles = sum(1 for _, line in self.lines if line.startswith("cycle "))
        return f"{cycles} cycles settled, ledger moves: {ledger_moves(self.audit())}"


# --- section 1: saturation ----------------------------------------------------------------


@dataclass
class SaturationRow:
    label: str
    settings: str
    restarts: int
    injected: int
    held: str
    metrics_reads: int
    probes: int
    users: LoadGenerator
    conclusions: str
    failures: list[tuple[float, float]] = field(default_factory=list)


async def _saturation(urls: dict[str, str], workdir: Path, seconds: float) -> list[SaturationRow]:
    after = "busy"  # the batch job is still there after a restart
    check = CheckTimer("check", urls["check"], workdir / "check", after)
    watch = WatchProcess("watch", urls["watch"], workdir / "watch", after)
    active = ActiveChecker(urls["active"], after)
    health = HealthPoller(urls["health"], after)
    users = {name: LoadGenerator(url, USER_RATE) for name, url in urls.items()}
    watcher = StatsWatcher(urls, on_restart=lambda name: users[name].drop_in_flight())
    stop = asyncio.Event()
    with watch.running():
        if not await asyncio.to_thread(watch.wait_ready):
            raise RuntimeError("llmhealth watch did not settle a first cycle:\n" + _tail(watch))
        await watcher.baseline()
        start = time.time()
        log(f"saturation window of {seconds:g} s starts (4 busy backends)")
        tasks = [
            asyncio.create_task(watcher.run(stop)),
            *(asyncio.create_task(u.run(start, stop)) for u in users.values()),
            asyncio.create_task(check.run(start, stop)),
            asyncio.create_task(active.run(start, stop)),
            asyncio.create_task(health.run(start, stop)),
        ]
        try:
            await asyncio.sleep(seconds)
            stop.set()
            contenders = tasks[1 + len(users) :]
            await asyncio.wait_for(asyncio.gather(*contenders), STOP_TIMEOUT)
        finally:
            stop.set()
            watch.stop()
            log(f"window over; letting user requests finish (at most {DRAIN_SECONDS:g} s)")
            await asyncio.gather(*(u.drain(DRAIN_SECONDS) for u in users.values()))
            await asyncio.wait(tasks, timeout=STOP_TIMEOUT)
            for task in tasks:
                task.cancel()
            await watcher.close()
    rows = []
    answer_timeout = scaled(LLMHEALTH_REAL["answer_timeout"])
    for name, contender in (("check", check), ("watch", watch)):
        injected = watcher.delta(name, "completions_received") - len(users[name].requests)
        held = "0" if injected == 0 else f"≤ {injected * answer_timeout:.2f}"
        rows.append(
            SaturationRow(
                contender.label,
                contender.settings,
                len(watcher.restarts[name]),
                injected,
                held,
                watcher.delta(name, "metrics_reads"),
                watcher.delta(name, "models_reads"),
                users[name],
                contender.conclusions(),
            )
        )
    for name, loop in (("active", active), ("health", health)):
        injected = watcher.delta(name, "completions_received") - len(users[name].requests)
        rows.append(
            SaturationRow(
                loop.label,
                loop.settings,
                len(watcher.restarts[name]),
                injected,
                f"{loop.tally.held:.2f}",
                watcher.delta(name, "metrics_reads"),
                loop.tally.probes,
                users[name],
                loop.conclusions(),
                loop.tally.failures,
            )
        )
    return rows


def _tail(watch: WatchProcess) -> str:
    return "\n".join(line for _, line in watch.lines[-20:])


def saturation_section(seconds: float = SATURATION_SECONDS) -> Section:
    began = time.monotonic()
    names = ("check", "watch", "active", "health")
    with (
        tempfile.TemporaryDirectory(prefix="llmhealth-bench-") as tmp,
        running_simulator(
            ["busy"] * len(names),
            max_num_seqs=MAX_NUM_SEQS,
            request_seconds=SATURATION_REQUEST_SECONDS,
            ready_timeout=SIM_READY_TIMEOUT,
        ) as sim,
    ):
        urls = dict(zip(names, sim.urls, strict=True))
        for name in names:
            (Path(tmp) / name).mkdir()
        rows = asyncio.run(_saturation(urls, Path(tmp), seconds))
    table = Table(
        [
            "contender (real settings; bench = real / 30)",
            "restarts",
            "completions injected",
            "slot·s held",
            "/metrics reads",
            "other requests",
            "user requests sent / ok / failed by its restarts",
            "user latency p50 (s)",
            "what it concluded",
        ],
        [
            [
                f"{row.label}: {row.settings}",
                str(row.restarts),
                str(row.injected),
                row.held,
                str(row.metrics_reads),
                str(row.probes),
                f"{len(row.users.requests)} / {row.users.count('ok')} / "
                f"{row.users.count('failed_by_restart')}",
                _fmt(row.users.median_latency()),
                row.conclusions,
            ]
            for row in rows
        ],
    )
    ours = [row for row in rows if row.label.startswith("llmhealth")]
    met = all(row.restarts == 0 and row.injected == 0 for row in ours)
    other_failures = {
        row.label: sum(row.users.count(k) for k in ("error", "timeout", "unfinished"))
        for row in rows
    }
    notes = [
        "Target for llmhealth: 0 restarts and 0 injected requests while busy: "
        + (
            "**met** by both `check` and `watch`."
            if met
            else "**MISSED**: "
            + "; ".join(f"{r.label}: {r.restarts} restarts, {r.injected} injected" for r in ours)
        ),
        "User requests that failed for another reason (error, timeout, or still unfinished "
        f"{DRAIN_SECONDS:g} s after the window): "
        + ", ".join(f"{label} {count}" for label, count in other_failures.items())
        + ".",
    ]
    for row in rows:
        if row.label == HealthPoller.label and row.restarts:
            notes.append(
                "The `/health` poller's restarts are not saturation showing through "
                "`/health` (the simulator answers it at once, busy or not): they are its "
                f"{scaled(K8S_REAL['timeout']) * 1000:.0f} ms probe timing out "
                f"{K8S_THRESHOLD} times in a row on this shared, loaded machine; the failed "
                "probes took " + ", ".join(f"{took:.3f} s" for _, took in row.failures[:12]) + "."
            )
    return Section(
        title="1. Saturation without false restarts",
        command="cd bench && ../.venv/bin/python bench_compare.py saturation",
        intro=[
            f"Time is scaled down {SCALE:g}x: one bench second stands for {SCALE:g} real "
            "seconds, and every period, timeout, wait, cooldown and grace below is divided "
            f"by {SCALE:g}. Four backends in one `llmhealth simulate` process, one per "
            f"contender, each `busy` for {seconds:g} s ({seconds * SCALE / 60:g} "
            f"min real): all {MAX_NUM_SEQS} `--max-num-seqs` slots decoding and "
            f"{2 * MAX_NUM_SEQS} synthetic requests queued, each synthetic request lasting "
            f"{SATURATION_REQUEST_SECONDS:g} s. Each backend also gets its own user stream: "
            f"{USER_RATE:g} completion per second ({USER_MAX_TOKENS} tokens), which queues "
            "behind the load like any request.",
            "A restart is `POST /sim/restart` (back in `busy`, the batch job is still there). "
            "The simulator lets requests held by the old process finish; a real restart "
            "fails them, so the bench cancels every user request in flight on a restarted "
            "backend and counts it failed. A real restart also keeps the model away for "
            "minutes while the weights load; that is not modelled, so these failures are a "
            "lower bound. Restarts and request counts come from the simulator's "
            "`/sim/stats`; *completions injected* = completions the backend received minus "
            "the user stream's. *Slot·s held* = seconds the contender's completions were "
            "outstanding (client side; each one queued for a slot); for llmhealth, whose "
            "requests the bench cannot time, a bound of injected x answer timeout.",
        ],
        tables=[table],
        notes=notes,
        seconds=time.monotonic() - began,
    )


def _fmt(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


# --- section 2: wedge detection -----------------------------------------------------------


@dataclass
class WedgeRun:
    phase: float  # fraction of each timer's period between its last tick and the wedge
    wedge_at: dict[str, float]
    # Seconds from the wedge to the moment each contender decided "restart it", by its own
    # clock: the active checker's Nth failure, llmhealth's ledger condemning the backend.
    verdict: dict[str, float | None]
    restart: dict[str, float | None]  # seconds from the wedge to the restart seen
    story: dict[str, list[str]]  # what each contender did after the wedge, for the notes


async def _wedge_run(urls: dict[str, str], workdir: Path, phase: float) -> WedgeRun:
    after = "busy"  # the restarted process is healthy
    async with new_client() as client:
        wedge_at = {}
        for name, url in urls.items():
            # The simulator's real start (its /metrics claims the process is an hour old).
            stats = (await client.get(f"{url}/sim/stats", timeout=5.0)).json()
            start = stats.get("start_time")
            if not isinstance(start, float):
                raise RuntimeError(f"{url}/sim/stats shows no start time")
            wedge_at[name] = start + WEDGE_AFTER
    check = CheckTimer("check", urls["check"], workdir / "check", after)
    watch = WatchProcess("watch", urls["watch"], workdir / "watch", after)
    active = ActiveChecker(urls["active"], after)
    health = HealthPoller(urls["health"], after)
    watcher = StatsWatcher(urls)
    stop = asyncio.Event()
    with watch.running():
        if not await asyncio.to_thread(watch.wait_ready):
            raise RuntimeError("llmhealth watch did not settle a first cycle:\n" + _tail(watch))
        await watcher.baseline()
        now = time.time()
        if min(wedge_at.values()) - now < 1.0:
            log("warning: contenders started less than 1 s before the wedge")
        tasks = [
            asyncio.create_task(watcher.run(stop)),
            asyncio.create_task(
                check.run(
                    first_tick(wedge_at["check"], phase * check.period, check.period, now), stop
                )
            ),
            asyncio.create_task(
                active.run(
                    first_tick(wedge_at["active"], phase * active.period, active.period, now), stop
                )
            ),
            asyncio.create_task(
                health.run(
                    first_tick(wedge_at["health"], phase * health.period, health.period, now), stop
                )
            ),
        ]
        try:
            deadline = max(wedge_at.values()) + WEDGE_CAP
            while time.time() < deadline and not all(
                watcher.restarts[name] for name in ("check", "watch", "active")
            ):
                await asyncio.sleep(0.1)
                failed = [t for t in tasks if t.done() and t.exception() is not None]
                if failed:
                    raise RuntimeError("a contender failed") from failed[0].exception()
        finally:
            stop.set()
            watch.stop()
            await asyncio.wait(tasks, timeout=STOP_TIMEOUT)
            for task in tasks:
                task.cancel()
            await watcher.close()
    verdict: dict[str, float | None] = {}
    restart: dict[str, float | None] = {}
    for name, found in (("check", check.wedged()), ("watch", watch.wedged())):
        after_wedge = [f for f in found if f[1] >= wedge_at[name]]
        verdict[name] = after_wedge[0][2] - wedge_at[name] if after_wedge else None
    for name, loop in (("active", active), ("health", health)):
        decided = [t for t in loop.tally.condemned if t >= wedge_at[name]]
        verdict[name] = decided[0] - wedge_at[name] if decided else None
    for name, seen in watcher.restarts.items():
        later = [t for t in seen if t >= wedge_at[name]]
        restart[name] = later[0] - wedge_at[name] if later else None
        early = [t for t in seen if t < wedge_at[name]]
        if early:
            log(f"note: {name} restarted its backend {len(early)}x before the wedge")
    since = wedge_at["check"] - check.period
    check_lines = [
        (r.finished, f"+{r.finished - wedge_at['check']:.2f} check said {r.verdict}")
        for r in check.records
        if r.finished >= since
    ]
    audit_lines = [
        (float(line.split()[0]) + wedge_at["check"], line)
        for line in audit_story(check.audit(), wedge_at["check"])
    ]
    story = {
        "check": [line for _, line in sorted(check_lines + audit_lines)],
        "watch": audit_story(watch.audit(), wedge_at["watch"]),
        "health": [
            f"+{when - wedge_at['health']:.2f} /health failed after {took:.3f} s"
            for when, took in health.tally.failures
        ],
    }
    return WedgeRun(phase, wedge_at, verdict, restart, story)


def _one_wedge_run(names: tuple[str, ...], phase: float) -> WedgeRun:
    with (
        tempfile.TemporaryDirectory(prefix="llmhealth-bench-") as tmp,
        running_simulator(
            [f"wedge:{WEDGE_AFTER:g}"] * len(names),
            max_num_seqs=MAX_NUM_SEQS,
            request_seconds=WEDGE_REQUEST_SECONDS,
            ready_timeout=SIM_READY_TIMEOUT,
        ) as sim,
    ):
        urls = dict(zip(names, sim.urls, strict=True))
        for name in names:
            (Path(tmp) / name).mkdir()
        return asyncio.run(_wedge_run(urls, Path(tmp), phase))


def wedge_section(runs: int = WEDGE_RUNS) -> Section:
    began = time.monotonic()
    names = ("check", "watch", "active", "health")
    results: list[WedgeRun] = []
    for index in range(runs):
        phase = (2 * index + 1) / (2 * runs)
        log(f"wedge run {index + 1}/{runs}: the wedge falls {phase:.0%} into each timer's period")
        try:
            run = _one_wedge_run(names, phase)
        except SimulatorStartError as exc:
            # A loaded shared machine can keep a simulator from starting in time: once more.
            log(f"  the simulator did not start ({str(exc).splitlines()[0]}); trying again")
            run = _one_wedge_run(names, phase)
        results.append(run)
        log(
            "  "
            + ", ".join(
                f"{name}: verdict {_fmt(run.verdict[name])} s, restart {_fmt(run.restart[name])} s"
                for name in names
            )
        )
        for name in late(run):
            log(f"  {name}: late; what it did: " + "; ".join(run.story[name][:12]))
    wait = scaled(LLMHEALTH_REAL["wait"])
    timer = scaled(LLMHEALTH_REAL["timer"])
    active_period = scaled(ACTIVE_REAL["period"])
    active_timeout = scaled(ACTIVE_REAL["timeout"])
    bounds = decision_bounds()
    expected = {
        "check": bounds["check"][1],
        "watch": bounds["watch"][1],
        "active": (
            f"{ACTIVE_THRESHOLD - 1}-{ACTIVE_THRESHOLD} periods + timeout: "
            f"{(ACTIVE_THRESHOLD - 1) * active_period + active_timeout:.1f}-"
            f"{ACTIVE_THRESHOLD * active_period + active_timeout:.1f}"
        ),
        "health": "never: /health answers 200 while the engine is frozen",
    }
    labels = {
        "check": CheckTimer.label,
        "watch": WatchProcess.label,
        "active": ActiveChecker.label,
        "health": HealthPoller.label,
    }

    def column(values: list[float | None], name: str = "") -> str:
        if name == "health":
            noise = sum(1 for v in values if v is not None)
            return "never (`/health` stays 200)" + (
                f"; {noise} of {len(values)} runs had a restart from probe timeouts (see below)"
                if noise
                else ""
            )
        seen = [v for v in values if v is not None]
        missing = len(values) - len(seen)
        text = spread(seen) if seen else f"never within {WEDGE_CAP:g} s"
        if seen and missing:
            text += f"; never in {missing} of {len(values)} runs"
        return text

    summary = Table(
        [
            "contender",
            "wedge → restart decision (s)",
            "wedge → restart seen (s)",
            "≈ real time",
            "stated bound on the decision (s, bench)",
        ],
        [],
    )
    for name in names:
        restarts = [r.restart[name] for r in results]
        seen = [v for v in restarts if v is not None]
        real = _real(statistics.median(seen)) if seen and name != "health" else "never"
        summary.rows.append(
            [
                labels[name],
                column([r.verdict[name] for r in results], name),
                column(restarts, name),
                real,
                expected[name],
            ]
        )
    per_run = Table(
        ["run", "wedge phase", *(f"{labels[n]}: decision / restart (s)" for n in names)],
        [
            [
                str(i + 1),
                f"{r.phase:.0%}",
                *(f"{_fmt(r.verdict[n])} / {_fmt(r.restart[n])}" for n in names),
            ]
            for i, r in enumerate(results)
        ],
    )
    extra: list[str] = []
    for index, run in enumerate(results):
        for name in late(run):
            health = run.story["health"]
            extra.append(
                f"**Run {index + 1}: {labels[name]} was late**: verdict "
                f"{_fmt(run.verdict[name])} s, restart {_fmt(run.restart[name])} s after "
                "the wedge. What it did, seconds from the wedge: "
                + "; ".join(run.story[name][:12])
                + ". In the same run the `/health` poller's probes "
                + (
                    "failed at " + ", ".join(line.split(" /health")[0] for line in health[:8])
                    if health
                    else "all answered"
                )
                + " (the simulator process serves every backend of the run)."
            )
    noise = [(i, r) for i, r in enumerate(results) if r.restart["health"] is not None]
    if noise:
        extra.append(
            "The `/health` poller's restarts above are not detections: `/health` kept "
            "answering 200 for the frozen engine. They are its "
            f"{scaled(K8S_REAL['timeout']) * 1000:.0f} ms probe timing out "
            f"{K8S_THRESHOLD} times in a row on this shared, loaded machine: "
            + "; ".join(f"run {i + 1}: " + ", ".join(r.story["health"][:6]) for i, r in noise)
            + "."
        )
    decided = {name: [r.verdict[name] for r in results] for name in bounds}
    met = {
        name: all(v is not None and v <= bounds[name][0] for v in values)
        for name, values in decided.items()
    }

    def missed_in(name: str) -> str:
        runs_missed = [
            str(i + 1) for i, v in enumerate(decided[name]) if v is None or v > bounds[name][0]
        ]
        return f" in run {', '.join(runs_missed)}; see the note on it below" if runs_missed else ""

    notes = [
        "Every contender's decision is timed the same way: from the wedge itself (the "
        "backend's start time + the simulated delay) to the moment the contender decided to "
        "restart, by its own clock: the active checker's last failed request, the `/health` "
        "poller's last failed probe, llmhealth's ledger condemning the backend (the audit "
        "log's `dead` entry, for `check` and `watch` alike).",
        "Target for llmhealth: that decision within its stated bound of the wedge: "
        + ", ".join(
            ("**met**" if met[name] else "**MISSED**")
            + f" by `{name}` (max {_fmt(_max(decided[name]), 3)} s, bound "
            f"{bounds[name][0]:.3f} s{missed_in(name)})"
            for name in ("watch", "check")
        )
        + ".",
        "Nothing can prove a wedge sooner than two waits after the first read that sees it: "
        "the first read after the wedge may still show the progress made just before it, so "
        f"`watch` proves a wedge 2 to 3 waits after it happens ({2 * wait:.2f}-"
        f"{3 * wait:.2f} s here) and its next settle (up to one more wait) condemns it; the "
        "restart command follows that decision. `check` on a timer adds the time to its next "
        f"run (up to {timer:g} s, one minute real).",
        f"The `/health` poller never restarts a wedged engine: the simulator answers "
        "`/health` from the API server, which stays up while the engine is frozen, as vLLM's "
        "does when its engine hangs without dying. The active checker finds the wedge, "
        f"after {ACTIVE_THRESHOLD} of its timeouts in a row.",
        f"{runs} runs, each with a fresh simulator ({len(names)} backends, `wedge:"
        f"{WEDGE_AFTER:g}`, light load: {WEDGE_REQUEST_SECONDS:g} s synthetic requests, so a "
        "probe request is answered before the wedge). Each timer's phase is set so that the "
        f"wedge falls {', '.join(f'{r.phase:.0%}' for r in results)} of the way through its "
        "period; `watch` reads on "
        "its own schedule. The wedge moment is the backend's process start time (from its "
        f"`/metrics`) + {WEDGE_AFTER:g} s.",
    ]
    notes += extra
    return Section(
        title="2. Wedge detection",
        command="cd bench && ../.venv/bin/python bench_compare.py wedge",
        intro=[
            f"Time scaled down {SCALE:g}x as in section 1. Seconds are bench seconds from "
            "the wedge; *≈ real time* multiplies the median restart time back.",
        ],
        tables=[summary, per_run],
        notes=notes,
        seconds=time.monotonic() - began,
    )


def decision_bounds() -> dict[str, tuple[float, str]]:
    """llmhealth's stated bound on wedge → restart decision, in bench seconds, and why.

    `watch` reads every wait: its first read that can see the freeze starts at most one
    wait after the wedge, the read two waits later proves it (and takes at most one read
    timeout), and the next settle, at most one wait on, condemns the backend. `check`
    waits for its timer (at most one period), then takes its three reads (two waits)
    and settles at once. Measured from the wedge, so a late first read counts too.
    """
    wait = scaled(LLMHEALTH_REAL["wait"])
    read = scaled(LLMHEALTH_REAL["timeout"])
    timer = scaled(LLMHEALTH_REAL["timer"])
    return {
        "check": (
            timer + 2 * wait + 3 * read,
            f"≤ timer period + 2 waits + 3 reads = {timer + 2 * wait + 3 * read:.2f}",
        ),
        "watch": (
            4 * wait + read,
            f"≤ 3 waits + 1 read to the proving read, + 1 wait to the settle = "
            f"{4 * wait + read:.2f}",
        ),
    }


def late(run: WedgeRun, slack: float = 1.0) -> list[str]:
    """llmhealth contenders past their stated decision bound, or slow from decision to
    restart (more than `slack` s)."""
    found = []
    for name, (limit, _) in decision_bounds().items():
        verdict, restart = run.verdict[name], run.restart[name]
        if verdict is None or verdict > limit or restart is None or restart - verdict > slack:
            found.append(name)
    return found


def _real(bench_seconds: float) -> str:
    """Bench seconds as the real time they stand for."""
    real = bench_seconds * SCALE
    return f"{real:.0f} s" if real < 120 else f"{real / 60:.1f} min"


def _max(values: list[float | None]) -> float | None:
    seen = [v for v in values if v is not None]
    return max(seen) if seen else None


def saturation() -> list[Section]:
    """run.py's step for section 1, on its own so a failure of one section spares the other."""
    log("section 1: saturation")
    return [saturation_section()]


def wedge() -> list[Section]:
    log("section 2: wedge detection")
    return [wedge_section()]


def run(
    which: str = "all", runs: int = WEDGE_RUNS, seconds: float = SATURATION_SECONDS
) -> list[Section]:
    sections = []
    if which in ("all", "saturation"):
        log("section 1: saturation")
        sections.append(saturation_section(seconds))
    if which in ("all", "wedge"):
        log("section 2: wedge detection")
        sections.append(wedge_section(runs))
    return sections


def main() -> None:
    from report import section_markdown  # noqa: PLC0415 - only the standalone run prints

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("which", nargs="?", default="all", choices=("all", "saturation", "wedge"))
    parser.add_argument("--runs", type=int, default=WEDGE_RUNS, help="wedge repetitions")
    parser.add_argument(
        "--seconds", type=float, default=SATURATION_SECONDS, help="saturation window"
    )
    args = parser.parse_args()
    for section in run(args.which, args.runs, args.seconds):
        print(section_markdown(section), flush=True)


if __name__ == "__main__":
    os.chdir(Path(__file__).resolve().parent)
    main()
