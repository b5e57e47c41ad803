"""What checking costs, and how the cost grows with the fleet.

- Signal extraction against prometheus_client's full parser (bench_parse, reused).
- Bytes read per check, per kind of backend: each read of /metrics is a whole ~50 KB
  text, so the number of reads a verdict needs is the cost that matters.
- One `check` over 100, 1000 and 3000 simulated backends, and one `watch` daemon over the
  same fleets: wall time, CPU time, peak memory, and how each grows (1000/100 and
  3000/1000; linear growth would be 10x and 3x).

Every measured run is a fresh child process (`bench_scale.py child ...`), so peak memory
is that run's own and not the high-water mark of everything before it. The simulator is
another process on the same two cores: it renders every /metrics text the check reads,
so wall times include its share of the machine, as they would on a busy monitoring host.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import io
import itertools
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

import bench_parse
from bench_check import fleet_modes
from report import Section, Table, nearest_rank, spread
from simproc import Simulator, SimulatorStartError, child_env, running_simulator

from llmhealth import config as config_module
from llmhealth import eventloop
from llmhealth.classify import Target, Verdict
from llmhealth.cycle import run_cycle
from llmhealth.probe import ProbeSettings, check_fleet
from llmhealth.remediate import Mode
from llmhealth.state import StateFile

HERE = Path(__file__).resolve().parent
SIZES = (100, 1000, 3000, 10000)
REPEATS = 3
LARGE = 10000  # sizes from here on are run once: a run takes minutes on two cores
WAIT = 1.0  # check: the two waits a wedge needs are 2 s of every check's wall time
WATCH_WAIT = 5.0  # watch: the default wait; each backend is read once per wait
WATCH_CYCLES = 8  # the first settled cycle is warm-up; the periods after it are measured
WATCH_SIZES = SIZES  # sizes at which `watch` is measured too
# `watch` read in its own event loop (read_workers = 1), and by two read worker processes
# (one per core here), from this size on; alternated in each repeat, same simulators.
WATCH_KINDS = {"watch": 1, "watch2": 2}
WORKERS_FROM = 3000
PARSE_ROUNDS = bench_parse.ROUNDS
CLIENTS = 200  # clients made to price one client per backend
READ_TIMEOUT = 10.0  # generous: 3000 concurrent reads share two cores with the simulator
CHILD_TIMEOUT = 420.0
# A `watch` child stops after this long even short of its cycles, and reports the cycles
# it saw: one event loop over 10,000 backends takes far longer than its wait per cycle.
WATCH_DEADLINE = 200.0
SIM_READY_TIMEOUT = 180.0


def log(message: str) -> None:
    print(f"[scale {time.strftime('%H:%M:%S')}] {message}", flush=True)


def raise_open_files(wanted: int) -> None:
    """A connection per backend (plus the simulator's side) passes a default limit of 1024."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft >= wanted:
        return
    limit = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
    with contextlib.suppress(ValueError, OSError):
        resource.setrlimit(resource.RLIMIT_NOFILE, (limit, hard))


def rss_mib() -> float:
    """This process's resident memory now (Linux), MiB."""
    with contextlib.suppress(OSError, ValueError):
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


# --- children: one measured run each ------------------------------------------------------


def fleet_config(
    urls: list[str], wait: float, workdir: Path, read_workers: int = 1
) -> config_module.Config:
    """The config an operator would write for this fleet (no restart commands)."""
    return config_module.from_mapping(
        {
            "wait": wait,
            "read_workers": read_workers,
            "timeout": READ_TIMEOUT,
            "answer_timeout": READ_TIMEOUT,
            "state": str(workdir / "state.json"),
            "audit_log": str(workdir / "audit.jsonl"),
            "backend": [{"name": f"b{i}", "url": url} for i, url in enumerate(urls)],
        },
        "<bench_scale>",
    )


def wrong_verdicts(kinds_by_index: dict[int, str], size: int) -> Counter[str]:
    """Verdicts that do not match the backend's simulated mode, as `mode->verdict` counts."""
    expected = {"busy": "busy", "idle": "idle", "wedge:0": "wedged"}
    modes = fleet_modes(size)
    return Counter(
        f"{modes[i]}->{kind}"
        for i, kind in kinds_by_index.items()
        if expected.get(modes[i]) != kind
    )


def child_check(urls: list[str], whole: bool) -> dict[str, Any]:
    """One check: the probe alone (`check_fleet`), or the whole `run_cycle` with its state."""
    raise_open_files(4 * len(urls) + 256)
    with tempfile.TemporaryDirectory(prefix="llmhealth-scale-") as tmp:
        config = fleet_config(urls, WAIT, Path(tmp))
        targets = [Target(b.name, b.url) for b in config.backends]
        settings = ProbeSettings(wait=WAIT, timeout=READ_TIMEOUT, answer_timeout=READ_TIMEOUT)
        store = StateFile(Path(tmp) / "state.json")
        before = rss_mib()
        cpu = time.process_time()
        started = time.perf_counter()
        if whole:
            report = run_cycle(config, targets, settings, store, mode=Mode.ACT)
            outcomes = [backend.outcome for backend in report.backends]
        else:
            outcomes = asyncio.run(check_fleet(targets, settings))
        wall = time.perf_counter() - started
        cpu = time.process_time() - cpu
    by_index = {int(o.target.name[1:]): str(o.verdict.kind) for o in outcomes}
    wrong = wrong_verdicts(by_index, len(urls))
    examples: dict[str, str] = {}
    modes = fleet_modes(len(urls))
    for outcome in outcomes:
        key = f"{modes[int(outcome.target.name[1:])]}->{outcome.verdict.kind}"
        if key in wrong and key not in examples:
            examples[key] = outcome.verdict.evidence[:240]
    return {
        "wall": wall,
        "cpu": cpu,
        "rss_before": before,
        "peak": peak_mib(),
        "kinds": Counter(by_index.values()),
        "wrong": wrong,
        "examples": examples,
    }


def _proc_cpu(pids: list[int]) -> float:
    """CPU seconds (user + system) these processes have used, from /proc; 0 for one gone."""
    total = 0
    for pid in pids:
        with contextlib.suppress(OSError, IndexError, ValueError):
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])  # utime, stime (fields 14, 15)
    return total / os.sysconf("SC_CLK_TCK")


def _status_mib(pid: int, field: str) -> float:
    """One figure of /proc/PID/status in MiB: ``VmHWM`` (peak resident), ``RssFile``
    (resident pages of mapped files: the interpreter and its shared libraries)."""
    with contextlib.suppress(OSError, ValueError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(f"{field}:"):
                return int(line.split()[1]) / 1024
    return 0.0


def _children() -> list[int]:
    """This process's child processes, from every thread."""
    found: list[int] = []
    with contextlib.suppress(OSError):
        for task in Path("/proc/self/task").iterdir():
            with contextlib.suppress(OSError, ValueError):
                found += [int(pid) for pid in (task / "children").read_text().split()]
    return found


class _DaemonLog(io.StringIO):
    """The daemon's log, counting its `cycle N:` lines as they are written: counting
    them in the whole text 20 times a second cost the measured process CPU of its own
    once thousands of wedges were logged."""

    cycles = 0

    def write(self, text: str) -> int:
        if text.startswith("cycle "):
            self.cycles += 1
        return super().write(text)


def child_watch(urls: list[str], wait: float, cycles: int, workers: int) -> dict[str, Any]:
    """`watch` over the fleet for a few cycles: settle time, CPU per cycle, peak memory.

    With read workers, their CPU counts in the cycle's (read when a cycle is first seen
    settled) and their peak resident memory in the peak."""
    from rich.console import Console  # noqa: PLC0415 - only this child needs them

    from llmhealth.daemon import Daemon  # noqa: PLC0415

    raise_open_files(4 * len(urls) + 256)
    log_text = _DaemonLog()
    samples: list[tuple[float, float, int]] = []
    heard_at: list[int] = []  # examinations heard by each sample
    with tempfile.TemporaryDirectory(prefix="llmhealth-scale-") as tmp:
        config = fleet_config(urls, wait, Path(tmp), workers)
        targets = [Target(b.name, b.url) for b in config.backends]
        daemon = Daemon(
            lambda: (config, targets),
            StateFile(Path(tmp) / "state.json"),
            listen=None,
            wait_override=None,
            serving_file=None,
            console=Console(file=io.StringIO()),  # not a terminal: plain lines on stderr
        )
        before = rss_mib()
        # Children this process had before the daemon are not read workers: a driver that
        # runs this beside the simulators it started had their CPU in every cycle's.
        not_readers = set(_children())
        readers: list[int] = []
        readers_peak = readers_files = 0.0
        # Each backend's newest verdict, wherever it was read: every one enters `hear`.
        latest: dict[str, str] = {}
        examined = [0]  # examinations heard: whether every backend is read once per wait
        hear = daemon.hear

        def heard(target: Target, verdict: Verdict | None, seconds: float) -> None:
            examined[0] += 1
            if verdict is not None:
                latest[target.name] = str(verdict.kind)
            hear(target, verdict, seconds)

        daemon.hear = heard  # type: ignore[method-assign]

        async def main() -> None:
            nonlocal readers, readers_peak, readers_files
            task = asyncio.create_task(daemon.run())
            deadline = time.monotonic() + WATCH_DEADLINE
            done = 0
            while not task.done() and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
                now_done = log_text.cycles
                if now_done == done and samples:
                    continue
                done = now_done
                # All started by the first settle.
                readers = [pid for pid in _children() if pid not in not_readers]
                spent = time.process_time() + _proc_cpu(readers)
                samples.append((time.monotonic(), spent, done))
                heard_at.append(examined[0])
                if done >= cycles:
                    readers_peak = sum(_status_mib(pid, "VmHWM") for pid in readers)
                    readers_files = sum(_status_mib(pid, "RssFile") for pid in readers)
                    daemon.stop()
            daemon.stop()
            await asyncio.wait_for(task, 30.0)

        with contextlib.redirect_stderr(log_text):
            # As `llmhealth watch` runs it: on the loop LLMHEALTH_LOOP names (`--loop`).
            eventloop.run(main())
    settled = [
        float(line.rsplit("settled in ", 1)[1].split()[0])
        for line in log_text.getvalue().splitlines()
        if line.startswith("cycle ") and "settled in " in line
    ]
    # CPU per cycle in the steady state: the first settled cycle (every backend's first
    # verdict, the state file created) is warm-up; measure from the second to the last.
    # When each cycle was first seen settled: the periods between them, from the second.
    seen = [next((s[0] for s in samples if s[2] >= k), None) for k in range(2, cycles + 1)]
    moments = [moment for moment in seen if moment is not None]
    periods = [later - earlier for earlier, later in itertools.pairwise(moments)]
    # When each settle began (seen settled, less its own `settled in`): the loop's schedule,
    # without the settles' own jitter, which the periods above carry.
    began = [m - took for m, took in zip(seen, settled[1:], strict=False) if m is not None]
    starts = [later - earlier for earlier, later in itertools.pairwise(began)]
    first = next((s for s in samples if s[2] >= min(2, cycles - 1)), None)
    last = next((s for s in samples if s[2] >= cycles), samples[-1] if samples else None)
    cpu_per_cycle = wall_per_cycle = reads_per_wait = cpu_per_read = None
    if first and last and last[2] > first[2]:
        cpu_per_cycle = (last[1] - first[1]) / (last[2] - first[2])
        wall_per_cycle = (last[0] - first[0]) / (last[2] - first[2])
        reads = heard_at[samples.index(last)] - heard_at[samples.index(first)]
        reads_per_wait = reads / len(urls) / ((last[0] - first[0]) / wait)
        # Per read made, not per backend: a fleet whose reads fall behind the wait makes
        # fewer reads per cycle, and per backend it would look cheaper than it is.
        cpu_per_read = (last[1] - first[1]) / reads * 1000 if reads else None
    return {
        "cycles": len(settled),
        "settle": settled,
        "cpu_per_cycle": cpu_per_cycle,
        "reads_per_wait": reads_per_wait,
        "cpu_per_read": cpu_per_read,
        "wall_per_cycle": wall_per_cycle,
        "periods": periods,
        "starts": starts,
        "kinds": Counter(latest.values()),
        "unjudged": len(urls) - len(latest),
        "wrong": wrong_verdicts({int(name[1:]): kind for name, kind in latest.items()}, len(urls)),
        "rss_before": before,
        "peak": peak_mib() + readers_peak,
        "workers_files": readers_files,
        "workers": len(readers),
    }


def child_clients() -> dict[str, Any]:
    """What `llmhealth.probe.new_client` costs per backend (its TLS context is shared)."""
    from llmhealth.probe import new_client  # noqa: PLC0415

    before = rss_mib()
    cpu = time.process_time()
    clients = [new_client() for _ in range(CLIENTS)]
    cpu = time.process_time() - cpu
    result = {"cpu": cpu / CLIENTS, "rss": (peak_mib() - before) / CLIENTS}

    async def close() -> None:
        await asyncio.gather(*(client.aclose() for client in clients))

    asyncio.run(close())
    return result


def run_child(args: list[str]) -> dict[str, Any]:
    """Run `bench_scale.py child ...` and return the JSON it prints; bounded in time."""
    argv = [sys.executable, str(HERE / "bench_scale.py"), "child", *args]
    done = subprocess.run(
        argv,
        capture_output=True,
        text=True,
        timeout=CHILD_TIMEOUT,
        env=child_env(),
        check=False,
        stdin=subprocess.DEVNULL,
    )
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(args)} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


# --- sections -----------------------------------------------------------------------------


def parse_section() -> Section:
    began = time.monotonic()
    log("signal extraction vs prometheus_client")
    load_before = os.getloadavg()[0]
    rows = bench_parse.run(rounds=PARSE_ROUNDS)
    ratios = [float(row["ratio"]) for row in rows]
    worst = min(ratios)
    table = Table(
        ["capture", "bytes", "llmhealth µs", "max", "prometheus_client µs", "ratio", "worst round"],
        [
            [
                str(row["capture"]),
                f"{row['bytes']:.0f}",
                f"{row['llmhealth_us']:.1f}",
                f"{row['llmhealth_max_us']:.1f}",
                f"{row['prometheus_client_us']:.0f}",
                f"{row['ratio']:.1f}x",
                f"{row['worst_ratio']:.1f}x",
            ]
            for row in rows
        ],
    )
    return Section(
        title="3a. Signal extraction vs prometheus_client",
        command="cd bench && ../.venv/bin/python bench_parse.py",
        intro=[
            "`llmhealth.metrics.parse_metrics` against `prometheus_client`'s full text "
            f"parser on every real vLLM 0.32 capture in `fixtures/` ({len(rows)}), both in "
            f"one process, alternated, every capture in each of {PARSE_ROUNDS} rounds; CPU "
            "time of the process "
            "per call (`time.process_time`), median and the slowest round; *worst round* is "
            "prometheus_client's fastest round over llmhealth's slowest. Load average "
            f"(1 min) {load_before:.1f} when it began, {os.getloadavg()[0]:.1f} at the end."
        ],
        tables=[table],
        notes=[
            f"Worst median ratio {worst:.1f}x (median over the captures "
            f"{statistics.median(ratios):.1f}x): "
            + ("**meets**" if worst >= bench_parse.TARGET_RATIO else "**MISSES**")
            + f" the {bench_parse.TARGET_RATIO:.0f}x target."
        ],
        seconds=time.monotonic() - began,
    )


def bytes_section() -> Section:
    """Reads per verdict x body size: what one check costs each backend, in bytes."""
    began = time.monotonic()
    log("bytes read per check")
    modes = ["busy", "idle", "wedge:0", "no-metrics", "idle"]  # the last: a yardstick
    measured = modes[:4]
    with running_simulator(modes) as sim:
        time.sleep(0.5)  # wedge:0 freezes at once; let its first read be frozen already
        targets = [Target(mode, url) for mode, url in zip(measured, sim.urls, strict=False)]
        settings = ProbeSettings(wait=WAIT, timeout=READ_TIMEOUT, answer_timeout=READ_TIMEOUT)
        with httpx.Client(trust_env=False, timeout=10.0) as client:
            before = [client.get(f"{u}/sim/stats").json() for u in sim.urls[:4]]
            outcomes = asyncio.run(check_fleet(targets, settings))
            after = [client.get(f"{u}/sim/stats").json() for u in sim.urls[:4]]
            # Body sizes, read after the counts so these reads are not counted.
            metrics_size = [len(client.get(f"{u}/metrics").content) for u in sim.urls[:4]]
            spare = sim.urls[4]
            models_size = len(client.get(f"{spare}/v1/models").content)
            tiny = {"model": "tiny", "prompt": "Hi", "max_tokens": 1, "temperature": 0}
            tiny_size = len(client.post(f"{spare}/v1/completions", json=tiny).content)
            chat = {"model": "tiny", "prompt": "Reply with OK.", "max_tokens": 16}
            chat_size = len(client.post(f"{spare}/v1/completions", json=chat).content)
    rows = []
    for index, outcome in enumerate(outcomes):
        reads = after[index]["metrics_reads"] - before[index]["metrics_reads"]
        models = after[index]["models_reads"] - before[index]["models_reads"]
        completions = after[index]["completions_received"] - before[index]["completions_received"]
        total = reads * metrics_size[index] + models * models_size + completions * tiny_size
        rows.append(
            [
                f"`{measured[index]}`",
                str(outcome.verdict.kind),
                f"{reads} x {metrics_size[index]:,}",
                str(models),
                str(completions),
                f"{total:,}",
                "0" if completions == 0 else f"{completions} (max_tokens 1)",
            ]
        )
    rows += [
        [
            "any (active checker, per check)",
            "-",
            "0",
            "0",
            "1",
            f"{chat_size:,}",
            "1 (16 tokens), queued behind real work",
        ],
        ["any (`/health` poller, per probe)", "-", "0", "0", "0", "0 (empty 200)", "0"],
        [
            "any (a Prometheus scrape, per scrape)",
            "-",
            f"1 x {metrics_size[0]:,}",
            "0",
            "0",
            f"{metrics_size[0]:,}",
            "0",
        ],
    ]
    table = Table(
        [
            "backend",
            "llmhealth verdict",
            "/metrics reads x bytes",
            "/v1/models",
            "completions",
            "bytes received (bodies)",
            "request slots used",
        ],
        rows,
    )
    return Section(
        title="3b. Bytes read per check",
        command="cd bench && ../.venv/bin/python bench_scale.py bytes",
        intro=[
            "One `check` (wait 1 s) of four simulated backends; request counts from each "
            "backend's `/sim/stats`, body sizes measured on the same simulator afterwards. "
            "Response headers (about 150 bytes each) and request bodies are not counted. "
            "The checkers of section 1 are listed for comparison."
        ],
        tables=[table],
        notes=[
            "A busy backend costs two reads and no slot; a wedged one three reads; only a "
            "backend with no work (or no metrics) costs a `/v1/models` and one 1-token "
            "completion."
        ],
        seconds=time.monotonic() - began,
    )


SIMULATOR_SHARE = 2500  # backends per simulator process: a free block of ports that size


def _simulate(simulators: contextlib.ExitStack, size: int) -> list[Simulator]:
    """Simulators for ``size`` backends, in processes of at most SIMULATOR_SHARE, each on
    its own loopback address (127.0.0.2, .3, ...): on 127.0.0.1 the other work on this
    machine leaves no four free blocks of 2,500 ports in the range the helper picks from,
    while the other addresses' ports are all free. Several processes keep the simulator
    from being the bottleneck; their CPU is measured apart (``_cpu_seconds``)."""
    modes = fleet_modes(size)
    sims = []
    for index, first in enumerate(range(0, size, SIMULATOR_SHARE)):
        share = modes[first : first + SIMULATOR_SHARE]
        sims.append(
            simulators.enter_context(
                running_simulator(
                    share, host=f"127.0.0.{2 + index}", ready_timeout=SIM_READY_TIMEOUT
                )
            )
        )
    return sims


def _read_by(workers: int) -> str:
    """How a `watch` kind reads, as the targets name it."""
    return "in its own loop" if workers == 1 else f"by {workers} read workers"


def _targets(
    sizes: tuple[int, ...],
    wall: dict[str, dict[int, list[float]]],
    cpu: dict[str, dict[int, list[float]]],
    growth: dict[str, dict[int, list[float]]],
    files_once: dict[str, dict[int, list[float]]],
    periods: dict[str, dict[int, list[float]]],
    cadence: dict[str, dict[int, list[float]]],
    per_read: dict[str, dict[int, list[float]]],
) -> list[str]:
    """Issue 13's targets, each met or **MISSED** with the figure that decides it."""

    def verdict(met: bool) -> str:
        return "met" if met else "**MISSED**"

    notes = []
    for kind, workers in WATCH_KINDS.items():
        if not periods[kind].get(3000):
            continue
        median = statistics.median(periods[kind][3000])
        p90 = nearest_rank(periods[kind][3000], 0.9)
        how = _read_by(workers)
        notes.append(
            f"Target: a `watch` cycle over 3,000 backends holds its {WATCH_WAIT:g} s wait "
            f"(median and 90th percentile ≤ {1.05 * WATCH_WAIT:g} s), read {how}: "
            f"{verdict(p90 <= 1.05 * WATCH_WAIT)} (median {median:.2f} s, p90 {p90:.2f} s)."
        )
    for kind, workers in WATCH_KINDS.items():
        if not (periods[kind].get(LARGE) and cpu[kind].get(LARGE)):
            continue
        used = statistics.median(cpu[kind][LARGE])
        median = statistics.median(periods[kind][LARGE])
        p90 = nearest_rank(periods[kind][LARGE], 0.9)
        # CPU inside the wait proves nothing if the reads fell behind it: fewer were made.
        reads = statistics.median(cadence[kind].get(LARGE) or [0.0])
        cores = min(2, max(workers, 1) + (workers > 1))
        held = p90 <= 1.05 * WATCH_WAIT and used <= cores * WATCH_WAIT and reads >= 0.95
        how = _read_by(workers)
        notes.append(
            f"Target: {LARGE:,} backends with the cycle's CPU inside its wait, on both "
            "cores (periods as at 3,000, every backend read once per wait, CPU per cycle "
            f"within the wait on the cores used), read {how}: "
            f"{verdict(held and workers > 1)} (periods median {median:.2f} s, p90 "
            f"{p90:.2f} s; {reads:.2f} reads per backend per wait; {used:.2f} s of CPU per "
            f"{WATCH_WAIT:g} s cycle)."
        )
    if wall["check"].get(3000):
        bound = 2 * WAIT + 2.0
        took = statistics.median(wall["check"][3000])
        notes.append(
            f"Target: one `check` of 3,000 backends within two waits plus 2 s ({bound:g} s): "
            f"{verdict(took <= bound)} (median {took:.2f} s)."
        )
    for size in (3000, LARGE):
        for kind in ("check", *WATCH_KINDS):
            if growth[kind].get(size):
                per_backend = statistics.median(growth[kind][size]) * 1024 / size
                notes.append(
                    f"Target: resident growth ≤ 25 KB per backend, {kind} at {size:,}: "
                    f"{verdict(per_backend <= 25)} ({per_backend:.1f} KB)."
                )
                if WATCH_KINDS.get(kind, 1) > 1:
                    once = statistics.median(files_once[kind][size]) * 1024 / size
                    notes.append(
                        f"Target: resident growth ≤ 25 KB per backend, {kind} at {size:,}, "
                        "the workers' file pages counted once: "
                        f"{verdict(once <= 25)} ({once:.1f} KB; {per_backend:.1f} KB "
                        "counting them in every worker)."
                    )
    for kind, workers in WATCH_KINDS.items():
        watch_cpu = {
            size: statistics.median(per_read[kind][size])
            for size in sizes
            if per_read[kind].get(size)
        }
        if len(watch_cpu) < 2:
            continue
        # The target is about growth: a larger fleet's reads must not cost more each. A
        # smaller fleet's may cost more, and do (its reads come far apart).
        ordered = sorted(watch_cpu.items())
        grew = max(
            ms / min(cheaper for _, cheaper in ordered[:index])
            for index, (_, ms) in enumerate(ordered)
            if index
        )
        shown = ", ".join(f"{size:,}: {ms:.2f}" for size, ms in ordered)
        how = _read_by(workers)
        notes.append(
            f"Target: CPU per backend flat from 100 to 10,000 (`watch` read {how}, ms of "
            "CPU per read made, so that reads falling behind the wait do not pass for "
            "cheaper ones; flat taken as no fleet's above 1.5x the cheapest smaller "
            f"fleet's): {verdict(grew <= 1.5)} ({shown}; {grew:.2f}x at most)."
        )
    return notes


def _ratio(values: dict[int, list[float]], big: int, small: int) -> str:
    if not values.get(big) or not values.get(small):
        return "-"
    return f"{statistics.median(values[big]) / statistics.median(values[small]):.2f}x"


def fsync_ms(count: int = 20) -> list[float]:
    """Milliseconds for one small append + fsync, as the audit log writes each record."""
    times = []
    with tempfile.TemporaryDirectory(prefix="llmhealth-scale-") as tmp:
        path = Path(tmp) / "audit.jsonl"
        for index in range(count):
            started = time.perf_counter()
            with path.open("a") as handle:
                handle.write(json.dumps({"record": index}) + "\n")
                handle.flush()
                os.fsync(handle.fileno())
            times.append((time.perf_counter() - started) * 1000)
    return times


def scale_section(
    sizes: tuple[int, ...] = SIZES, repeats: int = REPEATS, *, watch: bool = True
) -> Section:
    began = time.monotonic()
    raise_open_files(4 * max(sizes) + 512)
    loop = eventloop.loop_in_use()  # the watch children's, from the environment they inherit
    kinds = ("check", *WATCH_KINDS)
    wall: dict[str, dict[int, list[float]]] = {k: {} for k in kinds}
    cpu: dict[str, dict[int, list[float]]] = {k: {} for k in kinds}
    peak: dict[str, dict[int, list[float]]] = {k: {} for k in kinds}
    growth: dict[str, dict[int, list[float]]] = {k: {} for k in kinds}
    # The growth with the read workers' file pages counted once, in the daemon's own
    # memory before the run: each worker maps the same interpreter and libraries.
    files_once: dict[str, dict[int, list[float]]] = {k: {} for k in kinds}
    loads: dict[str, dict[int, list[float]]] = {k: {} for k in kinds}
    sim_cores: dict[str, dict[int, list[float]]] = {k: {} for k in kinds}
    settle: dict[str, dict[int, list[float]]] = {k: {} for k in WATCH_KINDS}
    first_settle: dict[str, dict[int, list[float]]] = {k: {} for k in WATCH_KINDS}
    periods: dict[str, dict[int, list[float]]] = {k: {} for k in WATCH_KINDS}
    starts: dict[str, dict[int, list[float]]] = {k: {} for k in WATCH_KINDS}
    watch_wrong: dict[str, dict[int, list[str]]] = {k: {} for k in WATCH_KINDS}
    cadence: dict[str, dict[int, list[float]]] = {k: {} for k in WATCH_KINDS}
    per_read: dict[str, dict[int, list[float]]] = {k: {} for k in WATCH_KINDS}
    verdicts: dict[int, list[str]] = {}
    wrong: dict[int, list[Counter[str]]] = {}
    examples: dict[int, dict[str, str]] = {}
    unmeasured: list[str] = []
    for size in sizes:
        log(f"{size} backends: starting the simulator")
        with (
            tempfile.TemporaryDirectory(prefix="llmhealth-scale-") as tmp,
            contextlib.ExitStack() as simulators,
        ):
            try:
                sims = _simulate(simulators, size)
            except SimulatorStartError as exc:
                unmeasured.append(f"{size:,} backends were not measured: {exc}.")
                log(f"  {size} backends: not measured: {exc}")
                continue
            urls = [url for sim in sims for url in sim.urls]
            urls_file = Path(tmp) / "urls.json"
            urls_file.write_text(json.dumps(urls))
            time.sleep(0.5)
            runs = repeats if size < LARGE else 1
            sim_pids = [sim.process.pid for sim in sims]

            def measured(kind: str, size: int, sim_pids: list[int], urls: Path) -> dict[str, Any]:
                """One child run, with the load before it and the simulators' CPU over it
                (as a number of cores busy), kept apart from the checker's own."""
                loads[kind].setdefault(size, []).append(os.getloadavg()[0])
                spent, started = _proc_cpu(sim_pids), time.monotonic()
                result = run_child([kind, str(urls)])
                cores = (_proc_cpu(sim_pids) - spent) / (time.monotonic() - started)
                sim_cores[kind].setdefault(size, []).append(cores)
                return result

            try:
                for repeat in range(runs):
                    result = measured("check", size, sim_pids, urls_file)
                    wall["check"].setdefault(size, []).append(result["wall"])
                    cpu["check"].setdefault(size, []).append(result["cpu"])
                    peak["check"].setdefault(size, []).append(result["peak"])
                    grown = result["peak"] - result["rss_before"]
                    growth["check"].setdefault(size, []).append(grown)
                    files_once["check"].setdefault(size, []).append(grown)
                    verdicts.setdefault(size, []).append(
                        ", ".join(f"{k} {v}" for k, v in sorted(result["kinds"].items()))
                    )
                    wrong.setdefault(size, []).append(Counter(result["wrong"]))
                    for key, text in result["examples"].items():
                        examples.setdefault(size, {}).setdefault(key, text)
                    log(
                        f"  {size} backends, check {repeat + 1}/{runs}: wall "
                        f"{result['wall']:.2f} s, cpu {result['cpu']:.2f} s, peak "
                        f"{result['peak']:.0f} MiB, {sum(result['wrong'].values())} wrong verdicts"
                    )
                    if not watch or size not in WATCH_SIZES:
                        continue
                    for kind, workers in WATCH_KINDS.items():
                        if workers > 1 and size < WORKERS_FROM:
                            continue
                        try:
                            result = measured(kind, size, sim_pids, urls_file)
                        except (RuntimeError, subprocess.TimeoutExpired) as exc:
                            # The other way of reading must still get its figures.
                            unmeasured.append(f"{size:,} backends, {kind}: failed: {exc}"[:400])
                            log(f"  {size} backends, {kind}: failed: {exc}")
                            continue
                        if result["cpu_per_cycle"] is not None:
                            cpu[kind].setdefault(size, []).append(result["cpu_per_cycle"])
                            wall[kind].setdefault(size, []).append(result["wall_per_cycle"])
                        peak[kind].setdefault(size, []).append(result["peak"])
                        grown = result["peak"] - result["rss_before"]
                        growth[kind].setdefault(size, []).append(grown)
                        files_once[kind].setdefault(size, []).append(
                            grown - result["workers_files"]
                        )
                        first_settle[kind].setdefault(size, []).extend(result["settle"][:1])
                        periods[kind].setdefault(size, []).extend(result["periods"])
                        starts[kind].setdefault(size, []).extend(result["starts"])
                        if result["reads_per_wait"] is not None:
                            cadence[kind].setdefault(size, []).append(result["reads_per_wait"])
                        if result["cpu_per_read"] is not None:
                            per_read[kind].setdefault(size, []).append(result["cpu_per_read"])
                        judged_by = ", ".join(
                            f"{k} {v}" for k, v in sorted(result["kinds"].items())
                        )
                        off = ", ".join(f"{k} {v}" for k, v in sorted(result["wrong"].items()))
                        watch_wrong[kind].setdefault(size, []).append(
                            f"{off or '0'} (of {judged_by}; {result['unjudged']} with none)"
                        )
                        settle[kind].setdefault(size, []).extend(result["settle"][1:])
                        log(
                            f"  {size} backends, {kind} {repeat + 1}/{runs}: "
                            f"{result['cycles']} cycles, {result['workers']} read workers, "
                            f"cpu/cycle {result['cpu_per_cycle'] or 0:.2f} s, periods "
                            + " ".join(f"{p:.2f}" for p in result["periods"])
                            + f", peak {result['peak']:.0f} MiB"
                        )
            except (RuntimeError, subprocess.TimeoutExpired) as exc:
                # One size that could not be run must not cost the others their figures.
                unmeasured.append(f"{size:,} backends: a run failed: {str(exc)[-300:]}")
                log(f"  {size} backends: a run failed: {exc}")
    names = {
        "check": "one `check` (`run_cycle`: probe, ledger, state, audit)",
        "watch": f"`watch`, one cycle (wait {WATCH_WAIT:g} s), its own loop reads",
        "watch2": f"`watch`, one cycle (wait {WATCH_WAIT:g} s), "
        f"{WATCH_KINDS['watch2']} read workers",
    }
    absolute = Table(
        [
            "what",
            "backends",
            "wall s",
            "CPU s",
            "CPU ms / backend",
            "peak RSS MiB",
            "RSS growth MiB",
            "RSS growth KB / backend",
            "RSS growth KB / backend, workers' file pages once",
            "load (1 min)",
            "simulator cores",
        ],
        [],
    )
    for kind in kinds:
        for size in sizes:
            if size not in peak[kind]:
                continue
            per_backend = [c / size * 1000 for c in cpu[kind].get(size, [])]
            absolute.rows.append(
                [
                    names[kind],
                    str(size),
                    spread(wall[kind].get(size, [])),
                    spread(cpu[kind].get(size, [])),
                    spread(per_backend),
                    spread(peak[kind][size], 0),
                    spread(growth[kind][size], 0),
                    spread([g * 1024 / size for g in growth[kind][size]], 1),
                    spread([g * 1024 / size for g in files_once[kind][size]], 1),
                    spread(loads[kind].get(size, []), 1),
                    spread(sim_cores[kind].get(size, []), 2),
                ]
            )
    ratios = Table(
        [
            "what",
            "wall 1000/100",
            "wall 3000/1000",
            "CPU 1000/100",
            "CPU 3000/1000",
            "CPU 10000/3000",
            "RSS growth 1000/100",
            "RSS growth 3000/1000",
        ],
        [
            [
                names[kind],
                _ratio(wall[kind], 1000, 100),
                _ratio(wall[kind], 3000, 1000),
                _ratio(cpu[kind], 1000, 100),
                _ratio(cpu[kind], 3000, 1000),
                _ratio(cpu[kind], 10000, 3000),
                _ratio(growth[kind], 1000, 100),
                _ratio(growth[kind], 3000, 1000),
            ]
            for kind in kinds
            if cpu[kind]
        ],
        caption="Growth (medians; linear would be 10x, 3x and 3.3x; every check's wall time "
        "holds "
        f"a fixed {2 * WAIT:g} s of waiting, and a watch cycle's is its wait):",
    )
    judged = Table(
        [
            "backends",
            "check verdicts, per run",
            "wrong verdicts, per run",
            "watch: first settle (s)",
            "watch: later settles (s)",
            "watch, read workers: first settle (s)",
            "watch, read workers: later settles (s)",
            "watch: wrong verdicts, per run (of the last verdicts)",
            "watch, read workers: wrong verdicts, per run (of the last verdicts)",
        ],
        [
            [
                str(size),
                "; ".join(verdicts.get(size, [])) or "-",
                "; ".join(
                    ", ".join(f"{k} {v}" for k, v in sorted(c.items())) or "0"
                    for c in wrong.get(size, [])
                )
                or "-",
                spread(first_settle["watch"].get(size, []), 3),
                spread(settle["watch"].get(size, []), 3),
                spread(first_settle["watch2"].get(size, []), 3),
                spread(settle["watch2"].get(size, []), 3),
                "; ".join(watch_wrong["watch"].get(size, [])) or "-",
                "; ".join(watch_wrong["watch2"].get(size, [])) or "-",
            ]
            for size in sizes
        ],
        caption="What each check concluded (a verdict is wrong when it does not match the "
        "backend's simulated mode: busy, idle, wedged), and for `watch` each backend's last "
        "verdict when the run stopped:",
    )
    clients = run_child(["clients"])
    syncs = fsync_ms()
    costs = Table(
        ["unit cost", "CPU ms", "RSS MiB", "wall ms"],
        [
            [
                "one target's client (`new_client()`: a `wire` connection, not yet open)",
                f"{clients['cpu'] * 1000:.3f}",
                f"{clients['rss']:.3f}",
                "-",
            ],
            [
                "one audit record's append + fsync (every ledger move and restart decision)",
                "-",
                "-",
                spread(syncs, 1),
            ],
        ],
        caption=f"Where the time and memory go ({CLIENTS} clients made in a fresh child; "
        f"{len(syncs)} fsyncs in a temporary directory):",
    )
    notes = []
    for size in sizes:
        bad = [sum(c.values()) for c in wrong.get(size, [])]
        if any(bad):
            notes.append(
                f"**Wrong verdicts at {size} backends** in {sum(1 for b in bad if b)} of "
                f"{len(bad)} runs (up to {max(bad)} of {size}). `check_fleet` starts every "
                f"backend's read at once, and each read must finish within {READ_TIMEOUT:g} s "
                "of its own start, its parsing included: the CPU time above is the work one "
                "event loop has to get through for all of them, on two cores shared with the "
                "simulator (and, on this shared machine, with other jobs). A read reported "
                "unresponsive with its whole body received timed out in llmhealth's own "
                "process, not in the server. The evidence llmhealth gave, one example per kind: "
                + "; ".join(
                    f'{key}: "{text}"' for key, text in sorted(examples.get(size, {}).items())
                )
                + "."
            )
    for kind in kinds:
        for small, big in itertools.pairwise(sizes):
            if not (cpu[kind].get(small) and cpu[kind].get(big)):
                continue
            ratio = statistics.median(cpu[kind][big]) / statistics.median(cpu[kind][small])
            linear = big / small
            if ratio > 1.2 * linear:
                per_small = statistics.median(cpu[kind][small]) / small * 1000
                per_big = statistics.median(cpu[kind][big]) / big * 1000
                notes.append(
                    f"**CPU grew faster than the fleet** for {names[kind]} from {small} to "
                    f"{big} backends: {ratio:.2f}x for {linear:g}x the backends, "
                    f"{per_small:.2f} → {per_big:.2f} ms per backend."
                )
    for size in sizes:
        per_cycle = wall["watch"].get(size)
        cycle_cpu = cpu["watch"].get(size)
        if not per_cycle or not cycle_cpu or max(per_cycle) <= 1.2 * WATCH_WAIT:
            continue
        typical = statistics.median(per_cycle)
        text = (
            f"At {size} backends a `watch` cycle read in its own loop took {typical:.1f} s "
            "(median; up to "
            f"{max(per_cycle):.1f} s) against its wait of {WATCH_WAIT:g} s. "
        )
        if statistics.median(cycle_cpu) > WATCH_WAIT:
            text = (
                f"**{text.rstrip()}** Its CPU per cycle, {statistics.median(cycle_cpu):.1f} s "
                "(median), exceeds the wait: every backend is read and judged in one event "
                "loop, so the cycle stretches to the work."
            )
        else:
            text += (
                f"Its CPU per cycle was at most {max(cycle_cpu):.2f} s in every run, well "
                "within the wait: the late cycle was not llmhealth's own computing."
            )
        notes.append(text)
    cycle_table = Table(
        [
            "backends",
            "read by",
            "cycle periods",
            "median s",
            "90th percentile s",
            "max s",
            "settle starts: median / p90 / max s",
            "reads per backend per wait",
            "CPU per read made, ms",
        ],
        [
            [
                str(size),
                "its own loop" if WATCH_KINDS[kind] == 1 else f"{WATCH_KINDS[kind]} read workers",
                str(len(periods[kind][size])),
                f"{statistics.median(periods[kind][size]):.2f}",
                f"{nearest_rank(periods[kind][size], 0.9):.2f}",
                f"{max(periods[kind][size]):.2f}",
                " / ".join(
                    f"{value:.2f}"
                    for value in (
                        statistics.median(starts[kind][size]),
                        nearest_rank(starts[kind][size], 0.9),
                        max(starts[kind][size]),
                    )
                )
                if starts[kind].get(size)
                else "-",
                spread(cadence[kind].get(size, []), 2),
                spread(per_read[kind].get(size, []), 2),
            ]
            for size in sizes
            for kind in WATCH_KINDS
            if periods[kind].get(size)
        ],
        caption=f"`watch` cycle periods (wait {WATCH_WAIT:g} s): the time between two "
        "settled cycles, every period of every run after the first settle. A settle begins "
        "on a fixed schedule while the loop keeps up, so a period is the wait plus the "
        "difference of two settles' own durations; *settle starts* are the periods between "
        "the moments settles began (seen settled, less the `settled in` it logged), the "
        "loop's schedule without that jitter. *Reads per backend per wait*: examinations "
        "the daemon heard over the measured cycles, per backend and wait (1.00: every "
        "backend read once per wait; below, the reads fall behind the settles). *CPU per "
        "read made*: the measured cycles' CPU (the settles' and the workers' included) over "
        "those examinations:",
    )
    notes.extend(_targets(sizes, wall, cpu, growth, files_once, periods, cadence, per_read))
    notes.extend(unmeasured)
    return Section(
        title="3c. One check and one watch cycle over "
        + ", ".join(f"{size:,}" for size in sizes)
        + " backends",
        command="cd bench && ../.venv/bin/python bench_scale.py scale"
        + ("" if loop == "asyncio" else f" --loop {loop}"),
        intro=[
            f"Simulator processes of up to {SIMULATOR_SHARE:,} backends each (one port "
            "each, every process on its own loopback address) serve the fleet: half busy, "
            "a quarter idle, a quarter wedged, so every kind of verdict is paid for; their "
            "CPU is apart from the checker's (*simulator cores*: their CPU seconds over the "
            "run's wall seconds). Each "
            f"figure is the median (min-max) of {repeats} runs ({LARGE:,} backends and "
            "more: one run), each in a fresh child "
            f"process. `check` is `run_cycle` with a state file and audit log (no restart "
            f"commands), wait {WAIT:g} s, read timeouts {READ_TIMEOUT:g} s. `watch` runs the "
            f"daemon in the child for {WATCH_CYCLES} settled cycles at its default wait, "
            f"on {loop}'s event loop as `llmhealth watch` runs it (`--loop`, "
            f"`{eventloop.ENV}`; `check` runs on asyncio's always), "
            "no metrics listener, reading in its own event loop (`read_workers = 1`) and, "
            f"from {WORKERS_FROM:,} backends, with {WATCH_KINDS['watch2']} read worker "
            "processes, alternated; its wall and CPU are per cycle from the second settled "
            "cycle to the last (the first is warm-up), the workers' CPU and peak memory "
            "included. *Load* is the 1-minute load average before each run. A settle is "
            "the daemon's bookkeeping "
            "per cycle (its `settled in` log figure: ledger, state file, audit, restart "
            "plan), in a worker thread beside the event loop that reads; the first one "
            "takes every backend's first verdict. *RSS growth* is the peak minus the "
            "child's resident memory before the run (interpreter and imports), with each "
            "read worker's whole peak added. A worker's peak holds its resident file "
            "pages (about 10 MB: the interpreter and its shared libraries), the same "
            "pages the daemon maps and counted in its memory before the run; the column "
            "*workers' file pages once* takes them out (each worker's `RssFile` when the "
            "run ends); the column before it counts them in every worker, as this "
            "section did before it had both. Section 3d "
            "has `check_fleet` "
            "alone at 200 backends."
        ],
        tables=[absolute, ratios, cycle_table, judged, costs],
        notes=notes,
        seconds=time.monotonic() - began,
    )


def run(
    which: str = "all",
    sizes: tuple[int, ...] = SIZES,
    repeats: int = REPEATS,
    *,
    watch: bool = True,
) -> list[Section]:
    sections = []
    if which in ("all", "parse"):
        sections.append(parse_section())
    if which in ("all", "bytes"):
        sections.append(bytes_section())
    if which in ("all", "scale"):
        sections.append(scale_section(sizes, repeats, watch=watch))
    return sections


def main() -> None:
    from report import section_markdown  # noqa: PLC0415 - only the standalone run prints

    if len(sys.argv) > 1 and sys.argv[1] == "child":
        kind = sys.argv[2]
        urls = json.loads(Path(sys.argv[3]).read_text()) if len(sys.argv) > 3 else []
        if kind in WATCH_KINDS:
            result = child_watch(urls, WATCH_WAIT, WATCH_CYCLES, WATCH_KINDS[kind])
        elif kind == "clients":
            result = child_clients()
        else:
            result = child_check(urls, whole=kind == "check")
        print(json.dumps(result), flush=True)
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "which", nargs="?", default="all", choices=("all", "parse", "bytes", "scale")
    )
    parser.add_argument("--sizes", default=",".join(map(str, SIZES)), help="e.g. 100,1000,3000")
    parser.add_argument("--repeats", type=int, default=REPEATS)
    parser.add_argument(
        "--check-only", action="store_true", help="scale: measure `check` alone, no `watch`"
    )
    parser.add_argument(
        "--loop",
        choices=eventloop.CHOICES,
        help=f"scale: the event loop `watch` (and its read workers) run on, as {eventloop.ENV} "
        "sets it for `llmhealth watch`; by default that variable's own choice",
    )
    args = parser.parse_args()
    if args.loop is not None:
        os.environ[eventloop.ENV] = args.loop  # inherited by every child and read worker
    try:
        eventloop.loop_in_use()
    except config_module.ConfigError as exc:
        parser.error(str(exc))
    sizes = tuple(int(size) for size in args.sizes.split(","))
    for section in run(args.which, sizes, args.repeats, watch=not args.check_only):
        print(section_markdown(section), flush=True)


if __name__ == "__main__":
    main()
