"""`llmhealth watch` over many simulated backends: does one cycle fit in one wait?

The daemon runs as it runs under systemd, as its own process (`llmhealth watch --config
... --listen ...`), against one simulator process serving every backend on its own port.
The fleet is the mix bench_check uses: half busy, a quarter idle (a tiny request every
wait), a quarter wedged (condemned at once, then read every wait all the same).

After a few warm-up cycles it follows a fixed number of cycles and prints:

- the cycle period achieved (time between two "cycle N" log lines) against the wait;
- the settle time of each cycle (`llmhealth_cycle_duration_seconds`);
- how many verdicts were wrong for their simulator mode (busy, idle, wedged);
- the probe durations the daemon exports (`llmhealth_backend_probe_duration_seconds`);
- CPU time per cycle of the watch process and of the simulator (both from
  /proc/<pid>/stat; they share this machine's cores), and the watch process's VmHWM.

"Fits one wait" means: every period within 10% of the wait, every probe done within the
wait, no wrong verdict, and the CPU of both processes within what the cores give.

It scrapes the daemon's /metrics once per cycle, as a Prometheus with a scrape interval
equal to the wait would; that scrape's CPU is part of the watch process's figure.
No figure is asserted. `--profile` instead runs the daemon in this process under
cProfile and prints where the time went: the event loop thread from start to the first
cycle, the event loop thread over the measured cycles (the probes), and the settle
thread over the same cycles. Under cProfile everything is slower, and time the loop
spends waiting for the GIL shows up in whatever frame it was in.

    .venv/bin/python bench/bench_watch.py                  # 1000 backends, wait 5 s
    .venv/bin/python bench/bench_watch.py --backends 200
    .venv/bin/python bench/bench_watch.py --backends 1000 --profile
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import cProfile
import io
import itertools
import os
import pstats
import queue
import re
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))
sys.path.insert(0, str(HERE))

from bench_check import fleet_modes  # noqa: E402 - the same fleet mix as the check bench
from report import nearest_rank  # noqa: E402
from simproc import child_env, free_port_block, running_simulator  # noqa: E402

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
CYCLE_LINE = re.compile(r"^cycle (\d+): .* settled in ([0-9.]+) s$")
READ_TIMEOUT = 10.0  # generous: a thousand reads share two cores with the simulator
SIM_READY_TIMEOUT = 240.0


def cpu_seconds(pid: int) -> float:
    """utime + stime of one process so far (children not included)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


def status_kib(pid: int, key: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise KeyError(key)


def raise_open_files(wanted: int) -> None:
    """A connection per backend on each side passes the usual soft limit of 1024."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < wanted:
        limit = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
        resource.setrlimit(resource.RLIMIT_NOFILE, (limit, hard))


def write_config(path: Path, urls: list[str], wait: float) -> None:
    lines = [f"wait = {wait}", f"timeout = {READ_TIMEOUT}", f"answer_timeout = {READ_TIMEOUT}"]
    for index, url in enumerate(urls):
        lines += ["", "[[backend]]", f'name = "b{index}"', f'url = "{url}"']
    path.write_text("\n".join(lines) + "\n")


@dataclass
class CycleSample:
    number: int
    seen_at: float  # monotonic time the log line arrived
    settle_logged: float  # "settled in X s", two decimals
    watch_cpu: float
    sim_cpu: float
    settle_exported: float | None = None
    wrong: int = 0  # backends whose current verdict is not the one their mode calls for
    verdicts: Counter[str] = field(default_factory=Counter)
    probe_seconds: list[float] = field(default_factory=list)
    scrape_seconds: float = 0.0
    logged_after: int = 0  # lines the cycle logged after its own: transitions, restarts


def expected_verdict(name: str) -> str:
    """What backend b<i> of bench_check.fleet_modes must be judged."""
    slot = int(name.removeprefix("b")) % 4
    return "busy" if slot < 2 else "idle" if slot == 2 else "wedged"


def scrape(port: int, sample: CycleSample) -> None:
    started = time.perf_counter()
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=30.0).text
    sample.scrape_seconds = time.perf_counter() - started
    for family in text_string_to_metric_families(text):
        if family.name == "llmhealth_cycle_duration_seconds":
            sample.settle_exported = family.samples[0].value
        elif family.name == "llmhealth_backend_verdict":
            current = {s.labels["backend"]: s.labels["verdict"] for s in family.samples if s.value}
            sample.verdicts.update(current.values())
            sample.wrong = sum(
                1 for name, verdict in current.items() if verdict != expected_verdict(name)
            )
        elif family.name == "llmhealth_backend_probe_duration_seconds":
            sample.probe_seconds = [s.value for s in family.samples]


def _pump(stream: io.BufferedReader, lines: queue.Queue[tuple[float, str] | None]) -> None:
    for raw in stream:
        lines.put((time.monotonic(), raw.decode(errors="replace").rstrip("\n")))
    lines.put(None)


def measure(
    urls: list[str], sim_pid: int, wait: float, warmup: int, cycles: int, log: Path | None
) -> str:
    entry = shutil.which("llmhealth", path=str(Path(sys.executable).parent))
    assert entry, "the llmhealth console script is not installed next to this Python"
    port = free_port_block(1)
    with tempfile.TemporaryDirectory(prefix="bench-watch-") as tmp:
        config = Path(tmp) / "fleet.toml"
        write_config(config, urls, wait)
        argv = [entry, "watch", "--config", str(config), "--state", f"{tmp}/state.json"]
        argv += ["--listen", f"127.0.0.1:{port}"]
        started = time.monotonic()
        process = subprocess.Popen(
            argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
            env=child_env(),
        )  # fmt: skip
        try:
            assert process.stderr is not None
            lines: queue.Queue[tuple[float, str] | None] = queue.Queue()
            threading.Thread(target=_pump, args=(process.stderr, lines), daemon=True).start()
            samples: list[CycleSample] = []
            other: list[str] = []
            deadline = time.monotonic() + (warmup + cycles + 4) * wait * 3 + 60
            while len(samples) < warmup + cycles + 1:
                item = lines.get(timeout=max(0.1, deadline - time.monotonic()))
                if item is None:
                    raise RuntimeError(f"watch exited with {process.wait()}: {other[-5:]}")
                at, line = item
                found = CYCLE_LINE.match(line)
                if not found:
                    other.append(line)
                    if samples:
                        samples[-1].logged_after += 1
                    continue
                sample = CycleSample(
                    int(found.group(1)),
                    at,
                    float(found.group(2)),
                    cpu_seconds(process.pid),
                    cpu_seconds(sim_pid),
                )
                scrape(port, sample)
                samples.append(sample)
            peak_kib = status_kib(process.pid, "VmHWM")
            rss_kib = status_kib(process.pid, "VmRSS")
        finally:
            process.terminate()
            try:
                process.wait(30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(30)
    if log is not None:
        log.write_text("\n".join(other) + "\n")
    first_cycle = samples[0].seen_at - started
    return report(samples[warmup:], wait, len(urls), first_cycle, peak_kib, rss_kib)


def report(
    samples: list[CycleSample],
    wait: float,
    size: int,
    first_cycle: float,
    peak_kib: int,
    rss_kib: int,
) -> str:
    # Samples n..n+k: k cycles between the first and the last, with their CPU between.
    periods = [b.seen_at - a.seen_at for a, b in itertools.pairwise(samples)]
    count = len(periods)
    watch_cpu = (samples[-1].watch_cpu - samples[0].watch_cpu) / count
    sim_cpu = (samples[-1].sim_cpu - samples[0].sim_cpu) / count
    settles = [s.settle_exported or s.settle_logged for s in samples[1:]]
    wrong = [s.wrong for s in samples[1:]]
    slowest = max(max(s.probe_seconds, default=0.0) for s in samples)
    probes = sorted(samples[-1].probe_seconds)
    verdicts = dict(sorted(samples[-1].verdicts.items()))
    period = statistics.median(periods)
    cores = os.cpu_count() or 1
    fits = (
        max(periods) <= wait * 1.1
        and slowest < wait
        and max(wrong) == 0
        and watch_cpu < wait
        and watch_cpu + sim_cpu < cores * wait
    )
    lines = [
        f"watch over {size} simulated backends, wait {wait:g} s"
        + (" (the default), " if wait == 5.0 else ", ")
        + f"{count} cycles measured after warm-up; load average now "
        f"{os.getloadavg()[0]:.1f} on {cores} cores",
        f"  verdicts        {verdicts}",
        f"  first cycle     {first_cycle:.1f} s after the process started",
        f"  cycle period    median {period:.2f} s, min {min(periods):.2f}, "
        f"max {max(periods):.2f} (wait {wait:g} s; {period - wait:+.2f} s per cycle)",
        f"  settle          median {statistics.median(settles):.3f} s, max {max(settles):.3f} "
        "(llmhealth_cycle_duration_seconds: ledger, state file, metrics view)",
        f"  wrong verdicts  per cycle max {max(wrong)}, median {statistics.median(wrong):.0f} "
        f"of {size} (not what the backend's simulator mode calls for)",
        f"  probe duration  last cycle median {statistics.median(probes):.3f} s, "
        f"p90 {nearest_rank(probes, 0.9):.3f} s, max {probes[-1]:.3f} s; slowest seen "
        f"{slowest:.3f} s (one read, plus the tiny request for idle backends)",
        f"  watch CPU       {watch_cpu:.2f} s per cycle = {watch_cpu / wait:.0%} of one core "
        f"({watch_cpu / size * 1000:.2f} ms per backend per cycle)",
        f"  simulator CPU   {sim_cpu:.2f} s per cycle = {sim_cpu / wait:.0%} of one core "
        "(renders every /metrics text read; it shares the cores)",
        f"  scrape          {statistics.median(s.scrape_seconds for s in samples):.3f} s "
        "median wall time of one /metrics scrape",
        f"  memory          VmHWM {peak_kib / 1024:.0f} MiB, VmRSS {rss_kib / 1024:.0f} MiB",
        f"  fits one wait   {'yes' if fits else 'NO'}: period within 10% of the wait, every "
        "probe done within the wait, no wrong verdict, and the CPU of both processes "
        "within the machine",
    ]
    lines.append("  per cycle       period s / settle s / lines logged (transitions)")
    for before, sample in itertools.pairwise(samples):
        # The last cycle's own lines were still to come when the daemon was stopped.
        logged = str(sample.logged_after) if sample is not samples[-1] else "-"
        lines.append(
            f"    cycle {sample.number:3d}   {sample.seen_at - before.seen_at:6.2f} / "
            f"{sample.settle_exported or sample.settle_logged:6.3f} / {logged}"
        )
    return "\n".join(lines)


def profile(urls: list[str], wait: float, warmup: int, cycles: int, top: int) -> str:
    """The daemon in this process under cProfile: the event loop thread, probes included."""
    from rich.console import Console  # noqa: PLC0415 - only the profile needs these

    from llmhealth import config as config_module  # noqa: PLC0415
    from llmhealth.classify import Target  # noqa: PLC0415
    from llmhealth.daemon import Daemon  # noqa: PLC0415
    from llmhealth.state import StateFile  # noqa: PLC0415

    os.environ.pop("NOTIFY_SOCKET", None)
    with tempfile.TemporaryDirectory(prefix="bench-watch-") as tmp:
        config = config_module.Config(
            wait=wait,
            timeout=READ_TIMEOUT,
            answer_timeout=READ_TIMEOUT,
            backends=tuple(config_module.Backend(f"b{i}", url) for i, url in enumerate(urls)),
        )
        targets = [Target(b.name, b.url) for b in config.backends]
        daemon = Daemon(
            lambda: (config, targets),
            StateFile(Path(tmp) / "state.json"),
            listen=None,
            wait_override=None,
            serving_file=None,
            console=Console(stderr=True),
        )
        log = io.StringIO()
        startup = cProfile.Profile()
        profiler = cProfile.Profile()
        # The settle runs in a worker thread, which cProfile does not follow: wrap it.
        settles = cProfile.Profile()
        settle = daemon._settle

        def profiled_settle(fresh: Any) -> Any:
            if not measuring.is_set():
                return settle(fresh)
            settles.enable()
            try:
                return settle(fresh)
            finally:
                settles.disable()

        measuring = threading.Event()
        daemon._settle = profiled_settle  # type: ignore[method-assign]

        def cycles_logged() -> int:
            return len(re.findall(r"^cycle \d+:", log.getvalue(), re.MULTILINE))

        async def until_cycle(count: int) -> None:
            deadline = time.monotonic() + count * wait * 4 + 120
            while cycles_logged() < count:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"no cycle {count} in time:\n{log.getvalue()[-2000:]}")
                await asyncio.sleep(0.1)

        async def main() -> None:
            startup.enable()
            running = asyncio.create_task(daemon.run())
            try:
                await until_cycle(1)
                startup.disable()
                await until_cycle(warmup)
                measuring.set()
                profiler.enable()
                await until_cycle(warmup + cycles)
                profiler.disable()
                measuring.clear()
            finally:
                daemon.stop()
                await running

        with contextlib.redirect_stderr(log):
            asyncio.run(main())
    out = io.StringIO()
    for title, which, shown in (
        ("event loop thread, from start to the first cycle", startup, 12),
        (f"event loop thread, {cycles} cycles after {warmup} of warm-up", profiler, top),
        (f"settle thread, the same {cycles} cycles", settles, 15),
    ):
        stats = pstats.Stats(which, stream=out)
        own = {key[2]: value[2] for key, value in stats.stats.items()}  # type: ignore[attr-defined]
        total = sum(own.values())
        idle = own.get("<method 'poll' of 'select.epoll' objects>", 0.0)
        out.write(
            f"\n=== {title}: {total:.2f} s profiled, of which "
            f"{idle:.2f} s waiting in epoll, {total - idle:.2f} s busy\n"
        )
        stats.sort_stats("tottime").print_stats(shown)
        if which is profiler:
            stats.sort_stats("cumulative").print_stats(shown)
    return out.getvalue()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backends", type=int, default=1000)
    parser.add_argument("--wait", type=float, default=5.0)
    parser.add_argument("--warmup", type=int, default=2, help="cycles not measured")
    parser.add_argument("--cycles", type=int, default=6, help="cycles measured")
    parser.add_argument("--profile", action="store_true", help="cProfile, in this process")
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--log", type=Path, help="write the daemon's other log lines here")
    args = parser.parse_args()
    raise_open_files(4 * args.backends + 256)
    modes = fleet_modes(args.backends)
    with running_simulator(modes, ready_timeout=SIM_READY_TIMEOUT) as sim:
        time.sleep(0.5)  # let the wedge:0 engines freeze before the first read
        if args.profile:
            print(profile(list(sim.urls), args.wait, args.warmup, args.cycles, args.top))
        else:
            pid = sim.process.pid
            print(measure(list(sim.urls), pid, args.wait, args.warmup, args.cycles, args.log))


if __name__ == "__main__":
    main()
