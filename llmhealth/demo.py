"""`llmhealth demo`: a simulated fleet on loopback, checked once, then watched live.

It runs the real simulator as a child process and the real check and watch against it,
so what it shows is what an operator would see. In the watch part one backend is wedged;
the daemon proves it, runs a real restart command (it asks the simulator to start a new
"process"), sees the new process and re-admits it. With etcd installed, it ends with two
`watch` processes on one fleet and the leader killed while a wedge is being proven: the
other takes over and restarts it, once. Everything stops by itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Coroutine, Iterator
from pathlib import Path
from types import FrameType
from typing import Any, TypeVar

import httpx
from rich.console import Console
from rich.text import Text

from llmhealth.actions import read
from llmhealth.classify import Target, VerdictKind
from llmhealth.config import Config, from_mapping
from llmhealth.cycle import STOP_SIGNALS, run_cycle
from llmhealth.daemon import Daemon
from llmhealth.operate import read_record
from llmhealth.probe import ProbeSettings
from llmhealth.render import print_report, print_status
from llmhealth.report import exit_code, summarize
from llmhealth.router import Router
from llmhealth.state import StateFile
from llmhealth.text import printable

_HOST = "127.0.0.1"
_T = TypeVar("_T")
_READY_WITHIN = 30.0
_WEDGE_AFTER = 1.0
_WATCH_FOR = 10.0
_ROUTE_WEDGE_AFTER = 4.0
_ROUTE_FOR = 14.0
_TAKEOVER_WEDGE_AFTER = 4.0
_TAKEOVER_TTL = 3
_TAKEOVER_WITHIN = 40.0  # every wait of the takeover part, on a slow machine
# name, simulator mode; the proxy fronts the first two backends
_FLEET = (
    ("gpu0-busy", "busy"),
    ("gpu1-idle", "idle"),
    ("gpu2-wedging", f"wedge:{_WEDGE_AFTER:g}"),
    ("gpu3-no-metrics", "no-metrics"),
)
# The demo's restart command: ask the simulator for a new process in idle mode. A real
# fleet would have e.g. ["systemctl", "restart", "vllm@2"]; either way it is an argv. It
# goes direct, as every read of the demo does (trust_env=False): an HTTP_PROXY in the
# environment is no way to loopback, and through it the restart failed.
_RESTART_CODE = (
    "import sys, urllib.request as u; u.build_opener(u.ProxyHandler({})).open(u.Request("
    "sys.argv[1] + '/sim/restart', data=b'{\"mode\": \"idle\"}', method='POST'), timeout=5)"
)


class DemoError(RuntimeError):
    """A part of the demo could not run (a port taken meanwhile, a process that did not
    come up): said in a sentence, not as a traceback nor as an interrupt."""


def free_port_block(count: int, attempts: int = 50) -> int:
    """First port of ``count`` consecutive free ports on loopback."""
    for _ in range(attempts):
        with socket.socket() as probe:
            probe.bind((_HOST, 0))
            base = int(probe.getsockname()[1])
        if base + count > 65535:
            continue
        sockets: list[socket.socket] = []
        try:
            for offset in range(count):
                sock = socket.socket()
                sockets.append(sock)
                sock.bind((_HOST, base + offset))
        except OSError:
            continue
        finally:
            for sock in sockets:
                sock.close()
        return base
    raise DemoError(f"no block of {count} free ports on {_HOST}")


@contextlib.contextmanager
def simulated_fleet(
    modes: list[str], base_port: int, request_seconds: float = 4.0
) -> Iterator[subprocess.Popen[str]]:
    """Run ``llmhealth simulate`` until the block exits; it is always stopped."""
    argv = [sys.executable, "-m", "llmhealth", "simulate", *modes, "--port", str(base_port)]
    argv.append(f"--request-seconds={request_seconds:g}")
    process = subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True
    )
    try:
        _wait_ready(process)
        yield process
    finally:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=10)
        for stream in (process.stdout, process.stderr):
            if stream is not None:
                stream.close()


def _wait_ready(process: subprocess.Popen[str]) -> None:
    deadline = time.monotonic() + _READY_WITHIN
    assert process.stdout is not None
    while time.monotonic() < deadline:
        line = process.stdout.readline()
        if line.strip() == "ready":
            return
        if not line and process.poll() is not None:
            error = process.stderr.read().strip() if process.stderr else ""
            raise DemoError(f"the simulator exited with {process.returncode}: {error}")
    raise DemoError(f"the simulator was not ready within {_READY_WITHIN:g} s")


def _interrupted(signum: int, frame: FrameType | None) -> None:
    """Taken as a Ctrl-C, by whatever handles Ctrl-C now: inside ``asyncio.run`` its
    handler cancels the main task where it waits. Raised where it landed instead, in a
    task a gather started (one backend's read), the run's close raised it again from the
    main task, and asyncio logged that task's exception as never retrieved: a traceback
    on the demo's stderr. SIGINT ignored (a background job of a script): raised here."""
    ctrl_c = signal.getsignal(signal.SIGINT)
    if not callable(ctrl_c):
        raise KeyboardInterrupt(f"signal {signum}")
    ctrl_c(signal.SIGINT, frame)


@contextlib.contextmanager
def _terminate_as_interrupt() -> Iterator[None]:
    """SIGTERM and SIGHUP unwind the demo as Ctrl-C does, so every simulator, daemon and
    etcd it started is stopped on the way out; before, either ended it at once and left
    them."""
    before = {signum: signal.signal(signum, _interrupted) for signum in STOP_SIGNALS}
    try:
        yield
    finally:
        for signum, handler in before.items():
            signal.signal(signum, handler)


class _DemoDaemon(Daemon):
    """The demo's in-process daemon: SIGHUP stops it, and the demo with it, as SIGTERM
    does. Its config is the demo's own, with nothing to reload; taken as a reload, a
    closed terminal ran the demo's other parts to their end, and it exited 0."""

    def _ask_reload(self) -> None:
        self.stop()

    @property
    def stopping(self) -> bool:
        """Whether a stop was asked: by the demo, or by a signal the daemon took."""
        return self._stop.is_set()


def _run(main: Coroutine[Any, Any, _T]) -> _T:
    """``asyncio.run``, and SIGTERM and SIGHUP an interrupt again after it: the daemon's
    loop takes them (and SIGINT) for itself, and closing it leaves them at their default."""
    try:
        return asyncio.run(main)
    finally:
        for signum in STOP_SIGNALS:
            signal.signal(signum, _interrupted)


def _stopped_early(daemon: asyncio.Task[int], demo_daemon: _DemoDaemon) -> None:
    """A daemon that stopped, or began to stop, before the demo stopped it either failed
    (a port it was to serve on was taken meanwhile: said as such) or took a Ctrl-C, a
    SIGTERM or a SIGHUP meant for the demo (it handles them itself): the demo stops too,
    instead of scraping or streaming from what is gone. A daemon still stopping (its
    restart commands' grace) has closed its router and exporter already: a client's
    refused request then is that stop, not a failure of the demo."""
    if daemon.done():
        failure = None if daemon.cancelled() else daemon.exception()
        if failure is not None:
            raise DemoError(f"its daemon stopped: {failure}") from failure
    elif not demo_daemon.stopping:
        return
    raise KeyboardInterrupt("stopped")


def run_demo(console: Console) -> int:
    with _terminate_as_interrupt():
        try:
            return _run_parts(console)
        except DemoError as exc:
            console.print(f"\nThe demo stopped: {exc}.", markup=False)
            return 1


def _run_parts(console: Console) -> int:
    base = free_port_block(len(_FLEET) + 2)
    urls = [f"http://{_HOST}:{base + index}" for index in range(len(_FLEET))]
    proxy_url = f"http://{_HOST}:{base + len(_FLEET)}"
    metrics_port = base + len(_FLEET) + 1
    modes = [mode for _, mode in _FLEET] + [f"proxy:{urls[0]},{urls[1]}"]

    console.rule("llmhealth demo")
    console.print(f"Simulated fleet on {_HOST}:{base}-{base + len(_FLEET)}:")
    for (name, mode), url in zip(_FLEET, urls, strict=True):
        console.print(f"  {name:<16} {url}  simulator mode {mode}")
    console.print(f"  {'lb':<16} {proxy_url}  a least-connections proxy in front of gpu0, gpu1")
    with simulated_fleet(modes, base), tempfile.TemporaryDirectory() as scratch:
        time.sleep(_WEDGE_AFTER + 0.5)  # let gpu2 wedge before the first read
        _one_check(console, urls, proxy_url)
        _watch_live(console, urls, proxy_url, Path(scratch), metrics_port)
    with tempfile.TemporaryDirectory() as scratch:
        _route_live(console, Path(scratch))
    with tempfile.TemporaryDirectory() as scratch:
        try:
            _takeover_live(console, Path(scratch))
        except DemoError as exc:  # a machine too slow for its bounds: say so, plainly
            console.print(f"The takeover part did not finish: {exc}.", markup=False)
            return 1
    console.print("\nSimulators stopped; the demo's state and audit logs were in temp dirs.")
    return 0


def _one_check(console: Console, urls: list[str], proxy_url: str) -> None:
    console.rule("1. one check, as cron or an operator runs it")
    targets = [Target(name, url) for (name, _), url in zip(_FLEET, urls, strict=True)]
    targets.append(Target("lb", proxy_url, "proxy"))
    console.print(
        "In this process, as `llmhealth check --wait 2s --timeout 3s` runs over the fleet "
        "above named in a config ([[backend]], [[proxy]]), keeping no state:\n",
        markup=False,
    )
    # Its own note: run_cycle's, "bare URLs without --state or --config", is the reason of
    # a run the sentence above says this is not.
    report = run_cycle(
        Config(),
        targets,
        ProbeSettings(wait=2.0, timeout=3.0),
        None,
        notes=["state not persisted: the demo's check keeps none"],
    )
    print_report(report, console)
    code = exit_code(report)
    verdicts = {b.outcome.target.name: b.outcome.verdict for b in report.backends}
    busy, wedging = verdicts["gpu0-busy"], verdicts["gpu2-wedging"]
    asked = (
        "sent no request"
        if busy.requests_sent == 0
        else f"sent {busy.requests_sent} request(s) (it was idle when read)"
    )
    proven = (
        "the wedged one was proven over two waits"
        if wedging.kind is VerdictKind.WEDGED
        else f"the wedging one was judged {wedging.kind} (a slow machine: the watch part proves it)"
    )
    console.print(
        f"\nExit {int(code)} ({code.name}). The busy backend was judged by its own counters "
        f"and {asked}; {proven}; {_proxy_asked(proxy_url)}."
    )


def _proxy_asked(url: str) -> str:
    """What the proxy was asked, as its simulator counted it."""
    with httpx.Client(timeout=5.0, trust_env=False) as http:
        stats = http.get(f"{url}/sim/stats").json()
    if stats["metrics_reads"] == 0 and stats["completions_received"] == 0:
        return f"the proxy was only asked for /v1/models ({stats['models_reads']} time(s))"
    return (
        f"the proxy was asked for /metrics {stats['metrics_reads']} time(s) and sent "
        f"{stats['completions_received']} completion(s)"
    )


def _watch_live(
    console: Console, urls: list[str], proxy_url: str, scratch: Path, metrics_port: int
) -> None:
    console.rule(f"2. llmhealth watch for {_WATCH_FOR:g} s, with a restart command for gpu2")
    backends: list[dict[str, object]] = [
        {"name": name, "url": url} for (name, _), url in zip(_FLEET, urls, strict=True)
    ]
    backends[2]["restart"] = [sys.executable, "-c", _RESTART_CODE, urls[2]]
    config = from_mapping(
        {
            "wait": "1s",
            "timeout": "2s",
            "answer_timeout": "3s",
            "state": str(scratch / "state.json"),
            "backend": backends,
            "proxy": [{"name": "lb", "url": proxy_url}],
        },
        "<demo>",
    )

    def load() -> tuple[Config, list[Target]]:
        targets = [Target(b.name, b.url) for b in config.backends]
        return config, [*targets, Target("lb", proxy_url, "proxy")]

    store = StateFile(scratch / "state.json")
    daemon = _DemoDaemon(
        load,
        store,
        listen=(_HOST, metrics_port),
        wait_override=None,
        serving_file=scratch / "serving.json",
        console=console,
    )

    async def bounded() -> int:
        task = asyncio.create_task(daemon.run())
        try:
            await asyncio.wait({task}, timeout=_WATCH_FOR)
            _stopped_early(task, daemon)
            console.print(_own_metrics(metrics_port))
        finally:
            daemon.stop()
        return await task

    _run(bounded())
    console.rule("3. what it left behind")
    console.print("$ llmhealth status\n")
    record = read_record(store, config)
    now = time.time()
    print_status(record.ledger.snapshots(now), record.holds, summarize(record.ledger), now, console)
    console.print("\n$ tail audit.jsonl  (one line per ledger move and restart decision)\n")
    for entry in read(scratch / "audit.jsonl"):
        console.print(
            f"  {entry.get('backend')}: {entry.get('event')} {entry.get('from')} → "
            f"{entry.get('to')}",
            highlight=False,
        )


def _own_metrics(port: int) -> str:
    """A few lines of the daemon's own /metrics, as Prometheus would scrape them."""
    text = httpx.get(f"http://{_HOST}:{port}/metrics", timeout=5, trust_env=False).text
    wanted = (
        "llmhealth_fleet_",
        "llmhealth_backend_restarts_total",
        'llmhealth_backend_state{backend="gpu2-wedging",state="healthy"}',
    )
    lines = [line for line in text.splitlines() if line.startswith(wanted)]
    return f"\n$ curl -s {_HOST}:{port}/metrics | grep ...\n" + "\n".join(lines)


_ROUTE_FLEET = (("r0-wedging", f"wedge:{_ROUTE_WEDGE_AFTER:g}"), ("r1-idle", "idle"))
_STREAM = {"model": "tiny", "prompt": "hello", "max_tokens": 300, "stream": True}


def _route_live(console: Console, scratch: Path) -> None:
    console.rule(
        f"4. llmhealth route for {_ROUTE_FOR:g} s: a client streams through the router "
        "while r0 wedges"
    )
    base = free_port_block(len(_ROUTE_FLEET) + 1)
    urls = [f"http://{_HOST}:{base + index}" for index in range(len(_ROUTE_FLEET))]
    router_url = f"http://{_HOST}:{base + len(_ROUTE_FLEET)}"
    for (name, mode), url in zip(_ROUTE_FLEET, urls, strict=True):
        console.print(f"  {name:<11} {url}  simulator mode {mode}")
    console.print(
        f"  router      {router_url}  first_byte_timeout 3 s, stream_idle_timeout 2 s\n"
        f"$ llmhealth route --config demo.toml --listen {router_url.removeprefix('http://')}\n"
    )
    backends: list[dict[str, object]] = [
        {"name": name, "url": url} for (name, _), url in zip(_ROUTE_FLEET, urls, strict=True)
    ]
    backends[0]["restart"] = [sys.executable, "-c", _RESTART_CODE, urls[0]]
    config = from_mapping(
        {
            "wait": "1s",
            "timeout": "2s",
            "answer_timeout": "3s",
            "state": str(scratch / "state.json"),
            "backend": backends,
            "router": {
                "first_byte_timeout": "3s",
                "connect_timeout": "1s",
                "stream_idle_timeout": "2s",
            },
        },
        "<demo>",
    )
    targets = [Target(b.name, b.url) for b in config.backends]
    router = Router(config.router, config.backends, retry_after=config.wait)
    daemon = _DemoDaemon(
        lambda: (config, targets),
        StateFile(scratch / "state.json"),
        listen=None,
        wait_override=None,
        serving_file=None,
        # The daemon's own live table would fight the client's lines: it draws elsewhere.
        console=Console(file=io.StringIO(), force_terminal=True),
        router=router,
        router_listen=(_HOST, base + len(_ROUTE_FLEET)),
    )

    streams: list[tuple[str, bool]] = []  # (backend, ended by an error), in order

    async def bounded() -> None:
        task = asyncio.create_task(daemon.run())
        client = asyncio.create_task(
            _stream_client(console, router_url, time.monotonic() + _ROUTE_FOR, streams)
        )
        try:
            await asyncio.wait({task, client}, return_when=asyncio.FIRST_COMPLETED)
            if client.done() and not client.cancelled():
                client.exception()  # retrieved: a stop below makes it its echo
            if not client.done() or daemon.stopping:
                _stopped_early(task, daemon)
            client.result()
        finally:
            client.cancel()
            daemon.stop()
            await asyncio.wait({task})
        task.result()

    modes = [mode for _, mode in _ROUTE_FLEET]
    with simulated_fleet(modes, base, request_seconds=0.4):
        _run(bounded())
    console.print(f"\n{_streams_told(streams)}")
    console.print("\n$ tail audit.jsonl\n")
    for entry in read(scratch / "audit.jsonl"):
        console.print(
            f"  {entry.get('backend')}: {entry.get('event')} {entry.get('from')} → "
            f"{entry.get('to')}",
            highlight=False,
        )


def _streams_told(streams: list[tuple[str, bool]]) -> str:
    """What the streams above showed, from what they showed: a machine too slow for the
    demo's bounds tells a different story, and must not be told the expected one."""
    failed = [index for index, (_, error) in enumerate(streams) if error]
    if not failed:
        return f"All {len(streams)} streams finished: none met the wedge."
    after = streams[failed[0] + 1 :]
    told = (
        f"The wedged backend cost the client {len(failed)} of {len(streams)} streams, each "
        f"ended by an SSE error event; of the {len(after)} after the first, "
        f"{sum(1 for backend, error in after if backend == 'r1-idle' and not error)} "
        "finished on r1"
    )
    back = any(backend == "r0-wedging" and not error for backend, error in after)
    return told + (", and r0 served again once its new process was re-admitted." if back else ".")


async def _stream_client(
    console: Console, url: str, until: float, streams: list[tuple[str, bool]]
) -> None:
    """Stream one completion after another through the router, a line per stream, and
    each one's backend and whether it ended in error into ``streams``."""
    states: dict[str, str] = {}
    async with httpx.AsyncClient(timeout=30, trust_env=False) as http:
        while True:  # the daemon reads the saved ledger before it listens
            with contextlib.suppress(httpx.ConnectError):
                await http.get(f"{url}/health")
                break
            if time.monotonic() > until:
                raise DemoError(f"the router at {url} did not come up")
            await asyncio.sleep(0.1)
        number = 0
        while time.monotonic() < until:
            number += 1
            started = time.monotonic()
            tokens, error = 0, ""
            try:
                async with http.stream("POST", f"{url}/v1/completions", json=_STREAM) as reply:
                    backend = reply.headers.get("X-LLMHealth-Backend", "-")
                    async for line in reply.aiter_lines():
                        if not line.startswith("data: {"):
                            continue
                        event = json.loads(line.removeprefix("data: "))
                        if "error" in event:
                            error = str(event["error"]["message"])
                        else:
                            tokens += 1
                    status = reply.status_code
            except httpx.HTTPError as exc:
                backend, status, error = "-", 0, f"{type(exc).__name__}: {exc}"
            took = time.monotonic() - started
            streams.append((backend, bool(error) or status != 200))
            # A Text of printable words, never markup: the error's words are the server's
            # (the router relays a backend's own error event), and a "[/...]" in them
            # ended the demo with a MarkupError, an escape character reached the terminal.
            shown = Text(
                printable(
                    f"  stream {number:>2} via {backend:<11} {tokens:>3} tokens in {took:4.1f} s"
                )
            )
            if status != 200:
                shown.append(f"  HTTP {status}")
            if error:
                shown.append(printable(f"  error event: {error}"), style="red")
            console.print(shown, highlight=False)
            health = (await http.get(f"{url}/health")).json()["backends"]
            for name, state in health.items():
                if states.get(name, state) != state:
                    moved = printable(f"      {name}: {states[name]} → {state}")
                    console.print(Text(moved, style="bold"), highlight=False)
                states[name] = state


# --- 5. two daemons, one etcd, the leader killed --------------------------------------


def _etcd_binary() -> str | None:
    return shutil.which("etcd") or ("/usr/bin/etcd" if Path("/usr/bin/etcd").exists() else None)


def _takeover_live(console: Console, scratch: Path) -> None:
    console.rule("5. two watch daemons on one fleet (etcd): the leader killed mid-wedge")
    etcd = _etcd_binary()
    if etcd is None:
        console.print(
            "etcd is not installed (`make tools` installs Debian's etcd-server): skipped."
        )
        return
    base = free_port_block(6)
    client, peer = f"http://{_HOST}:{base}", f"http://{_HOST}:{base + 1}"
    urls = [f"http://{_HOST}:{base + 2}", f"http://{_HOST}:{base + 3}"]
    metrics = [base + 4, base + 5]
    config = scratch / "cluster.toml"
    config.write_text(
        'wait = "1s"\ntimeout = "2s"\nanswer_timeout = "3s"\n'
        f'[[backend]]\nname = "t0-wedging"\nurl = "{urls[0]}"\n'
        f"restart = {json.dumps([sys.executable, '-c', _RESTART_CODE, urls[0]])}\n"
        f'[[backend]]\nname = "t1-idle"\nurl = "{urls[1]}"\n'
        f'[cluster]\netcd = ["{client}"]\nprefix = "/llmhealth/demo"\n'
        f"lease_ttl = {_TAKEOVER_TTL}\n"
    )
    console.print(
        f"  etcd {client}; t0-wedging {urls[0]} (wedges {_TAKEOVER_WEDGE_AFTER:g} s in), "
        f"t1-idle {urls[1]}\n  lease_ttl {_TAKEOVER_TTL} s, wait 1 s\n"
        "$ llmhealth watch --config cluster.toml   # twice, as on two machines\n"
    )
    etcd_argv = [
        etcd, "--name", "demo", "--data-dir", str(scratch / "etcd"),
        "--listen-client-urls", client, "--advertise-client-urls", client,
        "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
        "--initial-cluster", f"demo={peer}", "--unsafe-no-fsync",
    ]  # fmt: skip
    restarts: list[dict[str, Any]] = []
    with contextlib.ExitStack() as stack:
        stack.enter_context(_process(etcd_argv, scratch / "etcd.log"))
        _until(lambda: _answers(f"{client}/health"), "etcd to answer")
        modes = [f"wedge:{_TAKEOVER_WEDGE_AFTER:g}", "idle"]
        stack.enter_context(simulated_fleet(modes, base + 2))
        started = time.monotonic()
        daemons = [
            stack.enter_context(
                _process(
                    [sys.executable, "-m", "llmhealth", "watch", "--config", str(config),
                     "--listen", f"{_HOST}:{port}"],
                    scratch / f"watch-{index}.log",
                )
            )
            for index, port in enumerate(metrics)
        ]  # fmt: skip

        def at() -> str:
            return f"{time.monotonic() - started:5.1f} s"

        leader = _until(lambda: _leader(metrics), "one daemon to lead")
        console.print(f"  {at()}  daemon {leader} leads (llmhealth_cluster_leader 1)")
        # Kill it as the wedge is being proven: after the wedge, before two reads of it.
        time.sleep(max(0.0, started + _TAKEOVER_WEDGE_AFTER + 1.0 - time.monotonic()))
        daemons[leader].send_signal(signal.SIGKILL)
        console.print(f"  {at()}  daemon {leader} killed (SIGKILL), its lease left to lapse")
        other = 1 - leader
        _until(lambda: _leader([metrics[other]]) == 0, "the other daemon to lead")
        console.print(f"  {at()}  daemon {other} leads")
        _until(lambda: _restarted(metrics[other], "t0-wedging"), "the restart")
        console.print(f"  {at()}  daemon {other} restarted t0-wedging (RESTARTING committed first)")
        _until(lambda: _state(metrics[other], "t0-wedging") == "healthy", "the re-admission")
        console.print(f"  {at()}  t0-wedging re-admitted: healthy")
        for command, title in (
            ("status", "the ledger and who leads"),
            ("audit", "the audit trail"),
        ):
            console.print(f"\n$ llmhealth {command} --config cluster.toml   # {title}, from etcd\n")
            done = subprocess.run(
                [sys.executable, "-m", "llmhealth", command, "--config", str(config)],
                capture_output=True, text=True, timeout=30, check=False,
            )  # fmt: skip
            if command == "status":
                console.print(done.stdout.rstrip(), highlight=False, markup=False)
                continue
            entries = [json.loads(line) for line in done.stdout.splitlines()]
            restarts = [e for e in entries if e.get("event") == "restart"]
            for entry in entries:
                console.print(
                    f"  {entry.get('backend')}: {entry.get('event')} {entry.get('from')} → "
                    f"{entry.get('to')}  (by {entry.get('member')}, fence {entry.get('fence')})",
                    highlight=False,
                    markup=False,
                )
    by = sorted({str(entry.get("member")) for entry in restarts})
    # Said from the trail, not assumed: the old leader may have restarted before it died.
    what = "1 restart" if len(restarts) == 1 else f"{len(restarts)} restarts"
    whose = (
        "the daemon that took over, under its own fencing token"
        if len(by) == 1
        else "each under its daemon's own fencing token"
    )
    console.print(
        f"\n{what} in the trail, by {', '.join(by)}: {whose}. Each record was written in "
        "the same etcd transaction as the state it led to.",
        highlight=False,
        markup=False,
    )


@contextlib.contextmanager
def _process(argv: list[str], log: Path) -> Iterator[subprocess.Popen[bytes]]:
    """A child process with its output in ``log``; terminated (then killed) on exit."""
    with log.open("wb") as output:
        process = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=output, stderr=output)
        try:
            yield process
        finally:
            if process.poll() is None:
                process.terminate()
                try:
                    process.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait(timeout=10)


def _until(found: Callable[[], Any], what: str, poll: float = 0.2) -> Any:
    """``found()``'s first value that is not None or False, polled; bounded in time."""
    deadline = time.monotonic() + _TAKEOVER_WITHIN
    while time.monotonic() < deadline:
        value = found()
        if value is not None and value is not False:
            return value
        time.sleep(poll)
    raise DemoError(f"the demo waited {_TAKEOVER_WITHIN:g} s for {what}")


def _answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=1.0, trust_env=False).status_code == 200
    except httpx.HTTPError:
        return False


def _scrape(port: int) -> str:
    try:
        return httpx.get(f"http://{_HOST}:{port}/metrics", timeout=2.0, trust_env=False).text
    except httpx.HTTPError:
        return ""  # not up yet, or killed


def _leader(ports: list[int]) -> int | None:
    """Which of these daemons says it leads (may act), by index."""
    for index, port in enumerate(ports):
        for line in _scrape(port).splitlines():
            if line.startswith("llmhealth_cluster_leader{") and line.endswith(" 1.0"):
                return index
    return None


def _restarted(port: int, backend: str) -> bool:
    """The daemon ran a restart command for ``backend`` that exited 0."""
    line = f'llmhealth_backend_restarts_total{{backend="{backend}",outcome="ok"}} '
    return any(
        sample.startswith(line) and float(sample[len(line) :]) >= 1
        for sample in _scrape(port).splitlines()
    )


def _state(port: int, backend: str) -> str | None:
    """The ledger state a daemon exports for ``backend``."""
    prefix = f'llmhealth_backend_state{{backend="{backend}",state="'
    for line in _scrape(port).splitlines():
        if line.startswith(prefix) and line.endswith(" 1.0"):
            return line[len(prefix) :].split('"', 1)[0]
    return None
