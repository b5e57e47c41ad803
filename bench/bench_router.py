"""`llmhealth route` beside the usual ways to spread requests over vLLM backends.

Four contenders, side by side in one run, against the same backends and the same load
generator (a separate process, aiohttp, one keep-alive pool):
  direct       the client talks to the backend itself (the baseline; no failover)
  nginx        Debian's nginx, least_conn, passive max_fails=1 fail_timeout=10s
  vllm-router  the PyPI wheel (Rust), policy power_of_two, installed into its own venv
               (bench/.venv-vllm-router) by this script: a contender, never a dependency
  llmhealth    `llmhealth route` with defaults but for the same 10 s first-byte bound

Sections: added latency of small requests at 64 concurrent clients, closed loop and paced
to 1,000 requests/s; streams (time to the first chunk, gaps between chunks); throughput
and CPU per request of the router process; and the headline, one of four simulated
backends wedging under load (counters frozen, connections accepted): client-visible
failures and seconds until no new request reaches it. `python bench_router.py` prints the
section and writes it into RESULTS.md (section 5); `python bench_router.py --baseline REF
[ROUNDS]` runs only the speed part, the router of git REF against this tree's, alternated,
and writes section 5b. Each replaces its own section under RESULTS.md's "Not from this
run: the router" heading and nothing else.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import importlib.util
import itertools
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import aiohttp
import httpx
import report
from report import Section, Table, nearest_rank

from llmhealth.eventloop import ENV as LOOP_ENV
from llmhealth.eventloop import loop_in_use

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
VENV_ROUTER = HERE / ".venv-vllm-router"
PYTHON = sys.executable
SMALL_SECONDS = 8.0
CONCURRENCY = 64
STREAMS = 8
STREAM_CHUNKS, STREAM_GAP_MS = 20, 20
WEDGE_AFTER = 6.0  # seconds after the simulator starts
WEDGE_RUN = 36.0  # seconds of load per contender in the wedge run
WEDGE_CLIENTS = 16
SLOW = 5.0  # seconds: an answer this late hides a timeout and a retry
FAILURE_BOUND = 10  # seconds: nginx proxy_read_timeout, vllm-router and llmhealth timeouts
CONTENDERS = ("direct", "nginx", "vllm-router", "llmhealth")
SPEED_ROUNDS = 3  # section 5's speed runs, each contender once a round, alternated
PACED_RATE = 1000  # requests/s of the paced run: half issue 11's one-core 2,000/s
CLOSED_LOOP, PACED = "", "paced_"  # Speed's field prefixes of the two small-request runs
ADDED_BOUNDS = (("p50", 1.0), ("p99", 5.0))  # issue 11: ms a router may add
# Issue 11's "on one core": every contender's process tree (nginx's master and its one
# worker, vllm-router, llmhealth route) runs on ROUTER_CORE alone; this script, the load
# generator and the backends on LOAD_CORE, for the direct run too. So a router never waits
# for a core behind the load generator or the backend, for every contender alike; its
# added latency is its own service time and hops only where LOAD_CORE has room too (the
# paced run: the closed loop saturates it).
ROUTER_CORE, LOAD_CORE = 1, 0


def pin_load_side() -> None:
    """This process on LOAD_CORE: every child it starts inherits it, but the contenders,
    which ``contender`` starts under ``taskset`` on ROUTER_CORE."""
    if not {ROUTER_CORE, LOAD_CORE} <= os.sched_getaffinity(0):
        raise RuntimeError(f"needs cores {LOAD_CORE} and {ROUTER_CORE}: one for the router alone")
    os.sched_setaffinity(0, {LOAD_CORE})


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def cpu_seconds(pid: int) -> float:
    """User + system CPU of a process and all its descendants, from /proc."""
    tick = os.sysconf("SC_CLK_TCK")
    children: dict[int, list[int]] = {}
    stats: dict[int, list[str]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
                stats[int(entry.name)] = fields
                children.setdefault(int(fields[1]), []).append(int(entry.name))
    total, todo = 0.0, [pid]
    while todo:
        current = todo.pop()
        if current in stats:
            total += (int(stats[current][11]) + int(stats[current][12])) / tick
        todo += children.get(current, [])
    return total


@contextlib.contextmanager
def process(
    argv: list[str], ready: str | None = None, **kwargs: Any
) -> Iterator[subprocess.Popen[str]]:
    """A child process until the block ends; ``ready`` is a line its stdout prints."""
    child = subprocess.Popen(
        argv,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
        **kwargs,
    )
    assert child.stdout is not None
    tail: collections.deque[str] = collections.deque(maxlen=50)
    seen = threading.Event()

    def drain(stream: IO[str]) -> None:
        # Read everything, always: a child that logs into a full pipe stops dead.
        for line in stream:
            tail.append(line)
            if ready is not None and ready in line:
                seen.set()

    threading.Thread(target=drain, args=(child.stdout,), daemon=True).start()
    child.tail = tail  # type: ignore[attr-defined]  # for wait_http's error message
    try:
        if ready is not None and not seen.wait(60):
            raise RuntimeError(f"{argv[0]} not ready:\n{''.join(tail)}")
        yield child
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(child.pid, signal.SIGTERM)
        try:
            child.wait(15)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(child.pid, signal.SIGKILL)
            child.wait(5)


def wait_http(
    url: str, path: str, child: subprocess.Popen[str] | None = None, timeout: float = 180
) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url + path, timeout=2).status_code == 200:
                return
        if child is not None and child.poll() is not None:
            break
        time.sleep(0.2)
    output = "".join(getattr(child, "tail", ())) if child is not None else ""
    raise RuntimeError(f"{url}{path} not answering after {timeout:.0f} s:\n{output}")


# --- contenders ------------------------------------------------------------------------

NGINX = """daemon off; master_process on; worker_processes 1; pid {dir}/nginx.pid;
error_log {dir}/error.log warn;
events {{ worker_connections 4096; }}
http {{
  access_log off;
  client_body_temp_path {dir}/cb; proxy_temp_path {dir}/px; fastcgi_temp_path {dir}/fc;
  uwsgi_temp_path {dir}/uw; scgi_temp_path {dir}/sc;
  upstream backends {{ least_conn; {servers} keepalive 128; }}
  server {{
    listen 127.0.0.1:{port};
    location / {{
      proxy_pass http://backends; proxy_http_version 1.1; proxy_set_header Connection "";
      proxy_buffering off; proxy_read_timeout {bound}s; proxy_connect_timeout 3s;
    }}
  }}
}}
"""


@contextlib.contextmanager
def contender(
    name: str,
    backends: list[str],
    scratch: Path,
    source: Path | None = None,
    loop: str | None = None,
) -> Iterator[tuple[str, int | None]]:
    """The URL a client uses for ``name`` over ``backends``, and the PID whose CPU counts.

    ``source``: a directory holding another version of the ``llmhealth`` package, put
    first on the router's PYTHONPATH (``--baseline``); ``loop``: the router's
    LLMHEALTH_LOOP, else its default (asyncio's loop).
    """
    if name == "direct":
        yield backends[0], None
        return
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = None
    if name == "nginx":
        directory = scratch / f"nginx-{port}"
        directory.mkdir()
        servers = " ".join(
            f"server {b.removeprefix('http://')} max_fails=1 fail_timeout=10s;" for b in backends
        )
        conf = directory / "nginx.conf"
        conf.write_text(
            NGINX.format(dir=directory, servers=servers, port=port, bound=FAILURE_BOUND)
        )
        argv = [nginx_binary(), "-p", str(directory), "-c", str(conf), "-e", "stderr"]
    elif name == "vllm-router":
        argv = [str(VENV_ROUTER / "bin" / "vllm-router"), "--host", "127.0.0.1", "--port"]
        # power_of_two refuses a single worker; round_robin is the same thing over one.
        policy = "power_of_two" if len(backends) > 1 else "round_robin"
        argv += [str(port), "--policy", policy, "--worker-urls", *backends]
        argv += ["--request-timeout-secs", str(FAILURE_BOUND), "--log-level", "warning"]
        # Its metrics exporter binds a fixed port by default: a second one on the machine
        # would panic at start.
        argv += ["--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port())]
    else:
        config = scratch / f"route-{port}.toml"
        lines = [f'state = "{scratch / f"state-{port}.json"}"', "[router]"]
        lines.append(f'first_byte_timeout = "{FAILURE_BOUND}s"')
        for index, backend in enumerate(backends):
            lines += ["[[backend]]", f'name = "b{index}"', f'url = "{backend}"']
        config.write_text("\n".join(lines) + "\n")
        argv = [PYTHON, "-m", "llmhealth", "route", "--config", str(config)]
        argv += ["--listen", f"127.0.0.1:{port}"]
        env = {k: v for k, v in os.environ.items() if k != LOOP_ENV}
        if loop is not None:
            env[LOOP_ENV] = loop
        if source is not None:  # ahead of the installed (editable) package on sys.path
            env["PYTHONPATH"] = str(source)
    argv = ["taskset", "--cpu-list", str(ROUTER_CORE), *argv]  # execs: the PID is the contender's
    with process(argv, env=env) as child:
        wait_http(url, "/health" if name == "llmhealth" else "/v1/models", child)
        yield url, child.pid


def nginx_binary() -> str:
    for candidate in ("/usr/sbin/nginx", "/usr/bin/nginx"):
        if os.access(candidate, os.X_OK):
            return candidate
    raise RuntimeError("nginx is not installed: apt-get install nginx-light")


def install_vllm_router() -> str:
    """The contender's own venv; never part of llmhealth's dependencies."""
    binary = VENV_ROUTER / "bin" / "vllm-router"
    if not binary.exists():
        subprocess.run([sys.executable, "-m", "venv", str(VENV_ROUTER)], check=True)
        pip = [str(VENV_ROUTER / "bin" / "pip"), "install", "--quiet", "vllm-router"]
        subprocess.run(pip, check=True)
    done = subprocess.run(
        [str(VENV_ROUTER / "bin" / "pip"), "show", "vllm-router"],
        capture_output=True,
        text=True,
        check=False,
    )
    for line in done.stdout.splitlines():
        if line.startswith("Version:"):
            return line.split(":", 1)[1].strip()
    return "?"


# --- the load generator (a child process, the same for every contender) ----------------


SMALL_BODY = json.dumps({"model": "tiny", "prompt": "hi", "max_tokens": 1}).encode()


class _Tally:
    """What a small-request run's clients saw, one ``send`` at a time: both runs time and
    count a request the same way, so they differ only in when they send."""

    def __init__(self) -> None:
        self.latencies: list[float] = []
        self.failures = 0

    async def send(self, session: aiohttp.ClientSession, url: str) -> None:
        """One request, timed from its send to its whole answer read."""
        started = time.perf_counter()
        try:
            async with session.post(
                url + "/v1/completions",
                data=SMALL_BODY,
                headers={"Content-Type": "application/json"},
            ) as reply:
                await reply.read()
                ok = reply.status == 200
        except aiohttp.ClientError:
            ok = False
        if ok:
            self.latencies.append(time.perf_counter() - started)
        else:
            self.failures += 1


def _small_session(concurrency: int) -> aiohttp.ClientSession:
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=concurrency))


async def _small(url: str, concurrency: int, seconds: float) -> dict[str, Any]:
    """Closed loop: each client sends its next request the moment its last answer is read."""
    tally = _Tally()
    deadline = time.perf_counter() + seconds
    async with _small_session(concurrency) as session:

        async def client() -> None:
            while time.perf_counter() < deadline:
                await tally.send(session, url)

        await asyncio.gather(*(client() for _ in range(concurrency)))
    return {"latencies": tally.latencies, "failures": tally.failures, "seconds": seconds}


async def _paced(url: str, concurrency: int, seconds: float, rate: float) -> dict[str, Any]:
    """Each client on its own fixed schedule, together ``rate`` requests/s: the load no
    longer follows the answers, so a slow hop shows as latency instead of as fewer sends.

    Client i sends at start + i/rate + k*concurrency/rate. One behind its schedule (its
    last answer came after its next send was due) sends at once; a send more than one of
    its periods late is counted, so a run whose load side or router could not keep the
    rate shows as such. Nothing is sent after ``seconds``, caught up or not.
    """
    tally = _Tally()
    period = concurrency / rate
    late = 0
    async with _small_session(concurrency) as session:
        start = time.perf_counter()
        end = start + seconds

        async def client(index: int) -> None:
            nonlocal late
            due = start + index / rate
            while due < end and (now := time.perf_counter()) < end:
                if now < due:
                    await asyncio.sleep(due - now)
                elif now - due > period:
                    late += 1
                await tally.send(session, url)
                due += period

        await asyncio.gather(*(client(index) for index in range(concurrency)))
    return {"latencies": tally.latencies, "failures": tally.failures, "late": late}


async def _streams(url: str, concurrency: int, rounds: int) -> dict[str, Any]:
    body = json.dumps(
        {
            "model": "tiny",
            "prompt": "hi",
            "stream": True,
            "chunks": STREAM_CHUNKS,
            "gap_ms": STREAM_GAP_MS,
        }
    ).encode()
    first: list[float] = []
    gaps: list[float] = []
    async with aiohttp.ClientSession() as session:

        async def worker() -> None:
            for _ in range(rounds):
                started = time.perf_counter()
                last = None
                async with session.post(
                    url + "/v1/completions", data=body, headers={"Content-Type": "application/json"}
                ) as reply:
                    buffer = b""
                    async for piece in reply.content.iter_any():
                        now = time.perf_counter()
                        buffer += piece
                        events = buffer.count(b"\n\n")
                        buffer = buffer.rsplit(b"\n\n", 1)[-1]
                        for _ in range(events):
                            if last is None:
                                first.append(now - started)
                            else:
                                gaps.append(now - last)
                            last = now

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return {"first": first, "gaps": gaps}


async def _wedge_load(url: str, clients: int, seconds: float, timeout: float) -> dict[str, Any]:
    body = json.dumps({"model": "tiny", "prompt": "hi", "max_tokens": 4}).encode()
    outcomes: list[tuple[float, float, str]] = []  # sent at, took, outcome
    deadline = time.time() + seconds
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout)) as session:

        async def worker() -> None:
            while time.time() < deadline:
                sent = time.time()
                try:
                    async with session.post(
                        url + "/v1/completions",
                        data=body,
                        headers={"Content-Type": "application/json"},
                    ) as reply:
                        await reply.read()
                        outcome = str(reply.status)
                except (aiohttp.ClientError, TimeoutError) as exc:
                    outcome = type(exc).__name__
                outcomes.append((sent, time.time() - sent, outcome))

        await asyncio.gather(*(worker() for _ in range(clients)))
    return {"outcomes": outcomes}


def load(kind: str, url: str, *args: str) -> dict[str, Any]:
    """Run the load generator as its own process (its CPU is not the router's)."""
    argv = [PYTHON, str(Path(__file__)), "load", kind, url, *args]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=600, check=True)
    result: dict[str, Any] = json.loads(done.stdout)
    return result


def _load_main(argv: list[str]) -> None:
    kind, url, *rest = argv
    if kind == "small":
        result = asyncio.run(_small(url, int(rest[0]), float(rest[1])))
    elif kind == "paced":
        result = asyncio.run(_paced(url, int(rest[0]), float(rest[1]), float(rest[2])))
    elif kind == "streams":
        result = asyncio.run(_streams(url, int(rest[0]), int(rest[1])))
    else:
        result = asyncio.run(_wedge_load(url, int(rest[0]), float(rest[1]), float(rest[2])))
    print(json.dumps(result))


# --- measuring ---------------------------------------------------------------------------


@dataclass
class Speed:
    p50: float
    p99: float
    worst: float
    rps: float
    failures: int
    cpu_per_request_ms: float | None
    core_busy: float | None  # the router's CPU seconds over the run's wall seconds
    first_p50: float
    first_p99: float
    gap_p50: float
    gap_p99: float
    gap_worst: float
    paced_p50: float
    paced_p99: float
    paced_worst: float
    paced_late: int  # sends more than one client period behind their schedule
    paced_failures: int


def measure_speed(
    name: str, backend: str, scratch: Path, source: Path | None = None, loop: str | None = None
) -> Speed:
    with contender(name, [backend], scratch, source, loop) as (url, pid):
        load("small", url, "8", "2")  # warm-up: connections, caches
        cpu_before, wall_before = (cpu_seconds(pid) if pid else 0.0), time.monotonic()
        small = load("small", url, str(CONCURRENCY), str(SMALL_SECONDS))
        cpu = (cpu_seconds(pid) - cpu_before) if pid else None
        wall = time.monotonic() - wall_before
        paced = load("paced", url, str(CONCURRENCY), str(SMALL_SECONDS), str(PACED_RATE))
        streams = load("streams", url, str(STREAMS), "3")
    latencies = small["latencies"]
    return Speed(
        p50=nearest_rank(latencies, 0.5) * 1000,
        p99=nearest_rank(latencies, 0.99) * 1000,
        worst=max(latencies) * 1000,
        rps=len(latencies) / small["seconds"],
        failures=small["failures"],
        cpu_per_request_ms=None if cpu is None else cpu / max(1, len(latencies)) * 1000,
        core_busy=None if cpu is None else cpu / wall,
        first_p50=nearest_rank(streams["first"], 0.5) * 1000,
        first_p99=nearest_rank(streams["first"], 0.99) * 1000,
        gap_p50=nearest_rank(streams["gaps"], 0.5) * 1000,
        gap_p99=nearest_rank(streams["gaps"], 0.99) * 1000,
        gap_worst=max(streams["gaps"]) * 1000,
        paced_p50=nearest_rank(paced["latencies"], 0.5) * 1000,
        paced_p99=nearest_rank(paced["latencies"], 0.99) * 1000,
        paced_worst=max(paced["latencies"]) * 1000,
        paced_late=paced["late"],
        paced_failures=paced["failures"],
    )


@dataclass
class Wedge:
    failures: int
    failed_before: int  # of them, sent before the wedge (in flight on it when it came)
    requests: int
    slowest_failure: float
    slow_successes: int  # answered, but after more than SLOW seconds (a retry hidden inside)
    slowest_success: float
    avoid_seconds: float | None
    hung_on_wedged: int


def measure_wedge(name: str, scratch: Path) -> Wedge:
    """Four busy simulated backends, the last wedging WEDGE_AFTER s after start."""
    base = free_port_block(4)
    modes = ["busy", "busy", "busy", f"wedge:{WEDGE_AFTER:g}"]
    argv = [PYTHON, "-m", "llmhealth", "simulate", *modes, "--port", str(base)]
    argv += ["--max-num-seqs", "64", "--request-seconds", "0.2"]
    backends = [f"http://127.0.0.1:{base + i}" for i in range(4)]
    with process(argv, ready="ready") as _:
        born = time.time()
        wedged_at = born + WEDGE_AFTER
        if name == "direct":  # a client of one fixed backend: the one that wedges
            backends = [backends[3], *backends[:3]]
        with contender(name, backends, scratch) as (url, _pid):
            received: list[tuple[float, int]] = []
            stop = time.time() + WEDGE_RUN
            with subprocess.Popen(
                [
                    PYTHON,
                    str(Path(__file__)),
                    "load",
                    "wedge",
                    url,
                    str(WEDGE_CLIENTS),
                    str(WEDGE_RUN),
                    "60",
                ],
                stdout=subprocess.PIPE,
                text=True,
            ) as loader:
                while time.time() < stop + 1:
                    with contextlib.suppress(httpx.HTTPError):
                        stats = httpx.get(
                            backends[3 if name != "direct" else 0] + "/sim/stats", timeout=2
                        ).json()
                        received.append((time.time(), int(stats["completions_received"])))
                    time.sleep(0.25)
                output, _ = loader.communicate(timeout=120)
    outcomes = json.loads(output)["outcomes"]
    failed = [o for o in outcomes if o[2] != "200"]
    # The last moment a new request reached the wedged backend, after the wedge: the wedge
    # itself when none did (avoided within one sample), unknown only without samples.
    last_new = wedged_at if any(t > wedged_at for t, _ in received) else None
    for (_, n0), (t1, n1) in itertools.pairwise(received):
        if n1 > n0 and t1 > wedged_at:
            last_new = t1
    at_wedge = next((n for t, n in received if t >= wedged_at), 0)
    final = received[-1][1] if received else 0
    return Wedge(
        failures=len(failed),
        failed_before=sum(1 for o in failed if o[0] < wedged_at),
        requests=len(outcomes),
        slowest_failure=max((o[1] for o in failed), default=0.0),
        slow_successes=sum(1 for o in outcomes if o[2] == "200" and o[1] > SLOW),
        slowest_success=max((o[1] for o in outcomes if o[2] == "200"), default=0.0),
        avoid_seconds=None if last_new is None else last_new - wedged_at,
        hung_on_wedged=final - at_wedge,
    )


def free_port_block(count: int) -> int:
    for _ in range(100):
        base = free_port()
        if base + count < 65000 and all(_bindable(base + i) for i in range(count)):
            return base
    raise RuntimeError("no free port block")


def _bindable(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def run() -> list[Section]:
    began = time.monotonic()
    load_before = os.getloadavg()
    version = install_vllm_router()
    pin_load_side()
    speeds: dict[str, list[Speed]] = {name: [] for name in CONTENDERS}
    wedges: dict[str, Wedge] = {}
    with tempfile.TemporaryDirectory() as scratch_name:
        scratch = Path(scratch_name)
        backend_port = free_port()
        with process([PYTHON, str(HERE / "fast_backend.py"), str(backend_port)], ready="ready"):
            backend = f"http://127.0.0.1:{backend_port}"
            for index in range(1, SPEED_ROUNDS + 1):
                for name in CONTENDERS:
                    print(f"  speed, round {index}: {name}", flush=True)
                    speeds[name].append(measure_speed(name, backend, scratch))
        for name in CONTENDERS:
            print(f"  wedge: {name}", flush=True)
            wedges[name] = measure_wedge(name, scratch)
    done = section(speeds, wedges, version, time.monotonic() - began)
    done.intro.append(f"Load average (1, 5, 15 min) {_loads(load_before, os.getloadavg())}.")
    return [done]


def _loads(before: tuple[float, float, float], after: tuple[float, float, float]) -> str:
    return (
        f"when the run began {' / '.join(f'{x:.1f}' for x in before)}, when it ended "
        f"{' / '.join(f'{x:.1f}' for x in after)} (2 cores; the lock keeps other benches out)"
    )


def _med_max(values: list[float], form: str) -> str:
    """Median over the rounds, then the worst round's figure."""
    return f"{statistics.median(values):{form}} ({max(values):{form}})"


def _med_min(values: list[float], form: str) -> str:
    return f"{statistics.median(values):{form}} ({min(values):{form}})"


def _added(rounds: list[Speed], direct: list[Speed], field: str) -> list[float]:
    """Per round, the contender's figure minus the same round's direct run."""
    return [getattr(s, field) - getattr(d, field) for s, d in zip(rounds, direct, strict=True)]


FIRSTS = ("first_p50", "first_p99")


def _latency_cells(name: str, rounds: list[Speed], direct: list[Speed], run: str) -> list[str]:
    """Latency p50 / p99 / max, added p50, added p99 of one small-request run (``run``:
    CLOSED_LOOP or PACED), the columns both runs' tables share."""
    mid = [statistics.median(getattr(s, run + f) for s in rounds) for f in ("p50", "p99")]
    worst = max(getattr(s, run + "worst") for s in rounds)
    cells = [f"{mid[0]:.2f} / {mid[1]:.2f} / {worst:.1f}"]
    if name == "direct":
        return [*cells, "-", "-"]
    return cells + [_med_max(_added(rounds, direct, run + f), "+.2f") for f in ("p50", "p99")]


def _paced_rows(speeds: dict[str, list[Speed]]) -> list[list[str]]:
    """The paced run's table; late sends and failures summed over the rounds."""
    return [
        [
            name,
            *_latency_cells(name, rounds, speeds["direct"], PACED),
            str(sum(s.paced_late for s in rounds)),
            str(sum(s.paced_failures for s in rounds)),
        ]
        for name, rounds in speeds.items()
    ]


def section(
    speeds: dict[str, list[Speed]], wedges: dict[str, Wedge], version: str, seconds: float
) -> Section:
    direct = speeds["direct"]
    speed_rows = []
    for name, rounds in speeds.items():
        row = [name, *_latency_cells(name, rounds, direct, CLOSED_LOOP)]
        row += [_med_min([s.rps for s in rounds], ".0f"), str(sum(s.failures for s in rounds))]
        if name == "direct":
            row += ["-", "-"]
        else:
            row.append(_med_max([s.cpu_per_request_ms or 0.0 for s in rounds], ".3f"))
            row.append(_med_max([(s.core_busy or 0.0) * 100 for s in rounds], ".0f"))
        speed_rows.append(row)
    stream_rows = []
    for name, rounds in speeds.items():
        first = [statistics.median(getattr(s, f) for s in rounds) for f in FIRSTS]
        added = "-" if name == "direct" else _med_max(_added(rounds, direct, "first_p50"), "+.2f")
        stream_rows.append(
            [
                name,
                f"{first[0]:.2f} / {first[1]:.2f}",
                added,
                f"{statistics.median(s.gap_p50 for s in rounds):.2f}",
                _med_max([s.gap_p99 for s in rounds], ".2f"),
                f"{max(s.gap_worst for s in rounds):.1f}",
            ]
        )
    wedge_rows = []
    for name, w in wedges.items():
        after = w.failures - w.failed_before
        if name == "direct":
            avoid = "never: one fixed URL"
        else:
            avoid = "-" if w.avoid_seconds is None else f"{w.avoid_seconds:.1f}"
        wedge_rows.append(
            [
                name,
                f"{w.failures} of {w.requests} ({w.failed_before} / {after})",
                f"{w.slowest_failure:.1f}",
                f"{w.slow_successes} (slowest {w.slowest_success:.1f} s)",
                avoid,
                str(w.hung_on_wedged),
            ]
        )
    return Section(
        notes=verdicts(speeds, wedges),
        title="5. The router against nginx and vllm-router (bench_router)",
        command="cd bench && ../.venv/bin/python bench_router.py",
        intro=[
            f"One fast backend (`fast_backend.py`: answers at once; streams {STREAM_CHUNKS} "
            f"chunks {STREAM_GAP_MS} ms apart) behind each contender: direct, Debian nginx "
            f"(one worker, least_conn, max_fails=1 fail_timeout=10s, proxy_buffering off, "
            f"keepalive), vllm-router {version} (PyPI wheel in its own venv, power_of_two) "
            "and `llmhealth route` (defaults). Load from a separate aiohttp process: "
            f"{CONCURRENCY} concurrent clients for {SMALL_SECONDS:g} s of `max_tokens: 1` "
            f"requests; {STREAMS} concurrent streams, 3 each. {SPEED_ROUNDS} rounds, each "
            "contender once a round in turn, direct first; *added* is a round's figure minus "
            "the same round's direct run.",
            "Two small-request runs, in the same contender process after the same warm-up. "
            "The closed loop: each client sends its next request the moment its last answer "
            "arrives; that saturates the load side's core, so its added figure is mostly how "
            "that core's queue moved from run to run. Then a paced run: the same "
            f"{CONCURRENCY} clients for {SMALL_SECONDS:g} s, each on its own fixed schedule, "
            f"{PACED_RATE:,} requests/s together, latency from a request's send to its "
            "answer read; every core has room, so its added figure is the router's own "
            "service time and hops. A client behind its schedule sends at once; *late sends* "
            "counts sends more than one client's period "
            f"({CONCURRENCY / PACED_RATE * 1000:g} ms) behind it, over all rounds, as a run "
            "that could not keep the rate would show.",
            f"**Pinned, for every contender alike:** the contender's process tree (nginx's "
            f"master and its one worker, vllm-router, `llmhealth route`) runs on core "
            f"{ROUTER_CORE} alone (`taskset`); the load generator, the backend and this "
            f"script on core {LOAD_CORE} (`os.sched_setaffinity`), in the direct run too. So "
            "a router never waits for a core behind the load side, and requests/s is what "
            "one core of router serves, unless the load side's "
            "core is the limit (then direct's requests/s is about the same, and the router's "
            "core is not fully busy).",
            "Times in ms. Each cell: the median over the rounds, and in brackets the worst "
            "round (the lowest for requests/s). CPU is the router process tree's user+system "
            "time over the closed-loop run divided by the requests answered; *core busy* "
            "is that CPU time over the run's wall time (100% = the router's core saturated).",
        ],
        tables=[
            Table(
                [
                    "contender",
                    "latency p50 / p99 / max",
                    "added p50",
                    "added p99",
                    "requests/s",
                    "failed",
                    "CPU ms/request",
                    "core busy %",
                ],
                speed_rows,
                f"Small non-streaming requests at {CONCURRENCY} concurrent",
            ),
            Table(
                [
                    "contender",
                    "latency p50 / p99 / max",
                    "added p50",
                    "added p99",
                    "late sends",
                    "failed",
                ],
                _paced_rows(speeds),
                f"Small non-streaming requests at {CONCURRENCY} concurrent clients paced to "
                f"{PACED_RATE:,} requests/s",
            ),
            Table(
                [
                    "contender",
                    "first chunk p50 / p99",
                    "added p50",
                    "gap p50",
                    "gap p99",
                    "gap max",
                ],
                stream_rows,
                f"Streams ({STREAM_GAP_MS} ms between chunks at the backend)",
            ),
            Table(
                [
                    "contender",
                    "client-visible failures (sent before / after the wedge)",
                    "slowest failure s",
                    f"answers slower than {SLOW:g} s",
                    "s until no new request reaches it",
                    "requests it got after the wedge",
                ],
                wedge_rows,
                f"One of four busy simulated backends wedges {WEDGE_AFTER:g} s after start "
                f"(counters frozen, connections accepted); {WEDGE_CLIENTS} clients for "
                f"{WEDGE_RUN:g} s, client timeout 60 s, every contender's failure bound "
                f"{FAILURE_BOUND} s, pinned as above. Direct: the clients hold the wedging "
                "backend's URL.",
            ),
        ],
        seconds=seconds,
    )


def _verdict(met: bool) -> str:
    return "met" if met else "**MISSED**"


def _added_verdicts(rounds: list[Speed], direct: list[Speed], run: str, label: str) -> str:
    """The added-latency targets of one small-request run (``run``: CLOSED_LOOP or PACED)."""
    parts = []
    for quantile_name, bound in ADDED_BOUNDS:
        added = _added(rounds, direct, run + quantile_name)
        median = statistics.median(added)
        parts.append(
            f"added {quantile_name} ≤ {bound:g} ms, {label}: {_verdict(median <= bound)} "
            f"(median {median:+.2f} ms, worst round {max(added):+.2f})"
        )
    return "; ".join(parts)


def speed_verdicts(rounds: list[Speed], direct: list[Speed]) -> str:
    """The speed targets on the medians over the rounds, with the worst round beside; the
    added latency of both small-request runs, as only the paced one leaves the load side's
    core room."""
    rps = [s.rps for s in rounds]
    cpu = statistics.median(s.cpu_per_request_ms or 0.0 for s in rounds)
    busy = statistics.median(s.core_busy or 0.0 for s in rounds)
    direct_rps = statistics.median(d.rps for d in direct)
    if statistics.median(rps) >= 2000:
        throughput = _verdict(True)
    elif busy < 0.9:  # the router's core had room: the load side set the pace
        throughput = (
            f"not measured as such: the load side's core set the pace (direct "
            f"{direct_rps:.0f}/s) with the router's core {busy:.0%} busy; at "
            f"{cpu:.3f} ms a request one core would serve about {1000 / cpu:.0f}/s"
        )
    else:
        throughput = _verdict(False)
    return (
        f"{_added_verdicts(rounds, direct, PACED, f'paced to {PACED_RATE:,}/s')}; "
        f"{_added_verdicts(rounds, direct, CLOSED_LOOP, 'closed loop')}; ≥ 2,000 requests/s "
        f"on one core: {throughput} (median {statistics.median(rps):.0f}, lowest round "
        f"{min(rps):.0f})"
    )


def verdicts(speeds: dict[str, list[Speed]], wedges: dict[str, Wedge]) -> list[str]:
    """The issue's targets for llmhealth, each met or **MISSED** by this run's figures."""
    ours, direct = speeds["llmhealth"], speeds["direct"]
    others = [w for name, w in wedges.items() if name not in ("llmhealth", "direct")]
    mine = wedges["llmhealth"]
    fewer = all(mine.failures < w.failures for w in others)
    avoid = mine.avoid_seconds
    sooner = avoid is not None and all(
        w.avoid_seconds is None or avoid < w.avoid_seconds for w in others
    )
    gap_held = max(_added(ours, direct, "gap_p99"))
    return [
        f"Targets for llmhealth: {speed_verdicts(ours, direct)}; chunks never held: "
        f"{_verdict(gap_held <= 5)} (p99 gap against direct's, worst round {gap_held:+.2f} ms); "
        f"fewer client-visible failures than every other contender on the wedge: "
        f"{_verdict(fewer)}; shorter time until no new request reaches the wedged backend: "
        f"{_verdict(sooner)}.",
    ]


def run_baseline(ref: str, rounds: int) -> Section:
    """The speed section only, this tree's router against the one at git ``ref``,
    alternated round by round against one backend, so both see the same machine load."""
    began = time.monotonic()
    load_before = os.getloadavg()
    pin_load_side()
    commit = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "--short", ref],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    rows = []
    figures: dict[str, list[Speed]] = {}  # label -> per round
    directs: list[Speed] = []
    with tempfile.TemporaryDirectory() as scratch_name:
        scratch = Path(scratch_name)
        source = scratch / "baseline"
        source.mkdir()
        archive = subprocess.run(
            ["git", "-C", str(ROOT), "archive", commit, "llmhealth"],
            capture_output=True,
            check=True,
        )
        subprocess.run(["tar", "-x", "-C", str(source)], input=archive.stdout, check=True)
        # The baseline with the loop its tree chooses, this tree with its default
        # (asyncio's), and, with uvloop installed, this tree on uvloop's loop too: the
        # loop's share apart from the code's.
        variants: list[tuple[str, Path | None, str | None]] = [
            (f"llmhealth {commit}", source, None),
            ("llmhealth (this tree)", None, None),
        ]
        if importlib.util.find_spec("uvloop") is not None:
            variants.append((f"llmhealth (this tree, {LOOP_ENV}=uvloop)", None, "uvloop"))
        backend_port = free_port()
        with process([PYTHON, str(HERE / "fast_backend.py"), str(backend_port)], ready="ready"):
            backend = f"http://127.0.0.1:{backend_port}"
            for index in range(1, rounds + 1):
                direct = measure_speed("direct", backend, scratch)
                directs.append(direct)
                # Each variant in each place of the round in turn: a router's place after
                # another's teardown showed as large a difference as the loop did.
                turn = (index - 1) % len(variants)
                for label, tree, loop in variants[turn:] + variants[:turn]:
                    print(f"  round {index}: {label}", flush=True)
                    s = measure_speed("llmhealth", backend, scratch, tree, loop)
                    figures.setdefault(label, []).append(s)
                    rows.append(
                        [
                            f"{label}, round {index}",
                            f"{direct.p50:.2f} / {direct.p99:.2f}",
                            f"{s.p50:.2f} / {s.p99:.2f} / {s.worst:.1f}",
                            f"{s.p50 - direct.p50:+.2f} / {s.p99 - direct.p99:+.2f}",
                            f"{s.paced_p50 - direct.paced_p50:+.2f} / "
                            f"{s.paced_p99 - direct.paced_p99:+.2f}",
                            f"{s.rps:.0f}",
                            str(s.failures),
                            f"{s.cpu_per_request_ms:.3f}",
                            f"{(s.core_busy or 0.0) * 100:.0f}",
                            f"{s.gap_p99:.2f}",
                        ]
                    )
    return Section(
        title="5b. The router before and after (bench_router --baseline)",
        command=f"cd bench && ../.venv/bin/python bench_router.py --baseline {ref} {rounds}",
        intro=[
            f"The small-request and stream runs of section 5 ({CONCURRENCY} concurrent "
            f"clients for {SMALL_SECONDS:g} s, closed loop and paced to {PACED_RATE:,} "
            f"requests/s; {STREAMS} streams), `llmhealth route` at "
            f"{commit} and from this tree alternating against one `fast_backend.py`, each "
            "round with its own direct run just before and the routers' order turned by one "
            "place a round. Pinned as in section 5: the router "
            f"on core {ROUTER_CORE} alone, the load generator and the backend on core "
            f"{LOAD_CORE}. This tree's router runs on {loop_in_use()}'s event loop unless "
            f"{LOOP_ENV} says otherwise. Times in ms; CPU is the router process's "
            "user+system time per request answered, *core busy* that time over the run's "
            "wall time. Load average "
            f"(1, 5, 15 min) {_loads(load_before, os.getloadavg())}.",
        ],
        tables=[
            Table(
                [
                    "router",
                    "direct p50 / p99",
                    "latency p50 / p99 / max",
                    "added p50 / p99",
                    f"paced to {PACED_RATE:,}/s: added p50 / p99",
                    "requests/s",
                    "failed",
                    "CPU ms/request",
                    "core busy %",
                    "stream gap p99",
                ],
                rows,
                "Small non-streaming requests, and the gaps of streams",
            )
        ],
        notes=baseline_notes(figures, directs),
        seconds=time.monotonic() - began,
    )


def _spread(values: list[float], form: str) -> str:
    """Median (min to max): "to", as added latencies may be negative."""
    median = statistics.median(values)
    return f"{median:{form}} ({min(values):{form}} to {max(values):{form}})"


def baseline_notes(figures: dict[str, list[Speed]], directs: list[Speed]) -> list[str]:
    """Medians and spreads over the rounds for each router, and this tree's verdicts."""
    parts = []
    for label, rounds in figures.items():
        cpu = [s.cpu_per_request_ms or 0.0 for s in rounds]
        p50, p99 = (_added(rounds, directs, f) for f in ("p50", "p99"))
        parts.append(
            f"{label}: CPU per request {_spread(cpu, '.3f')} ms, requests/s "
            f"{_spread([s.rps for s in rounds], '.0f')}, added p50 {_spread(p50, '+.2f')} ms, "
            f"added p99 {_spread(p99, '+.2f')} ms"
        )
    notes = [f"Medians of the {len(directs)} rounds (min to max): " + "; ".join(parts) + "."]
    ours = figures.get("llmhealth (this tree)")
    if ours:
        notes.append(f"Targets, on this tree's rounds: {speed_verdicts(ours, directs)}.")
    return notes


BLOCK = "the router (bench_router)"
BLOCK_NOTE = (
    "`bench_router.py` is not one of `make bench`'s steps (it installs vllm-router and "
    "takes minutes): its own runs write the sections below, `python bench_router.py` "
    "section 5 and `python bench_router.py --baseline REF ROUNDS` section 5b, each "
    "replacing its earlier figures, with that run's load and command; `make bench` keeps "
    "this block as it is."
)


def main() -> int:
    if len(sys.argv) > 2 and sys.argv[1] == "--baseline":
        rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 3
        done = run_baseline(sys.argv[2], rounds)
    else:
        (done,) = run()
    print(report.section_markdown(done))
    path = report.write_standalone(done, BLOCK, BLOCK_NOTE)
    print(f"wrote section {done.title.split(' ', 1)[0].rstrip('.')} of {path}")
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "load":
        _load_main(sys.argv[2:])
        sys.exit(0)
    sys.exit(main())
