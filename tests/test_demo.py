"""`llmhealth demo` stopped part-way, as an operator stops it: everything it started goes.

The demo runs for about a minute, so only its stop is tested here (in the slow lane);
`make demo` runs it whole.
"""

from __future__ import annotations

import asyncio
import gc
import io
import itertools
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
from pytest_httpserver import HTTPServer
from rich.console import Console
from simproc import alive, children, running_simulator
from werkzeug import Response

from llmhealth import demo
from llmhealth.demo import _streams_told

PATIENCE = 60.0  # seconds: a bound on what must happen, never a timing claim


@pytest.mark.slow
@pytest.mark.parametrize(
    ("part", "signum"),
    [
        ("1. one check", signal.SIGTERM),
        ("2. llmhealth watch", signal.SIGINT),
        ("2. llmhealth watch", signal.SIGTERM),
        # Its terminal closed (or `kill -HUP`): SIGHUP's default ended the demo at once
        # and left every process it had started running, the two `watch` daemons of its
        # takeover part too (they take SIGHUP as a reload), for ever.
        ("1. one check", signal.SIGHUP),
        # In the parts with a daemon in the demo's own process, that daemon took SIGHUP
        # as a reload: the demo ran all its other parts, and exited 0.
        ("2. llmhealth watch", signal.SIGHUP),
    ],
    ids=["check-sigterm", "watch-ctrl-c", "watch-sigterm", "check-sighup", "watch-sighup"],
)
def test_a_demo_stopped_part_way_stops_its_simulators_and_exits_130(
    part: str, signum: signal.Signals
) -> None:
    # Before: SIGTERM in the check part ended the demo at once with its simulator left
    # running, reparented to init; in the watch part the daemon took either signal and
    # the demo went on to scrape it, gone, and ended in a ConnectError traceback.
    demo = subprocess.Popen(
        [sys.executable, "-m", "llmhealth", "demo"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        text=True,
        env={**os.environ, "COLUMNS": "200"},
    )
    seen: list[str] = []
    assert demo.stdout is not None
    reader = threading.Thread(target=lambda: seen.extend(demo.stdout or ()), daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + PATIENCE
        while not any(part in line for line in seen):
            assert demo.poll() is None and time.monotonic() < deadline, "".join(seen)
            time.sleep(0.1)
        simulators = children(demo.pid)
        assert simulators, "the demo's simulator"
        demo.send_signal(signum)
        _, stderr = demo.communicate(timeout=PATIENCE)
    finally:
        if demo.poll() is None:
            demo.kill()
            demo.wait()
    assert demo.returncode == 130, stderr  # a shell's code for an interrupted command
    assert "Traceback" not in stderr, stderr
    assert not [pid for pid in simulators if alive(pid)]


@pytest.mark.parametrize(
    ("streams", "told"),
    [
        ([("r0-wedging", False)] * 3, "All 3 streams finished: none met the wedge."),
        (
            [("r0-wedging", False), ("r0-wedging", True), ("r1-idle", False), ("r0-wedging", True)],
            "The wedged backend cost the client 2 of 4 streams, each ended by an SSE error "
            "event; of the 2 after the first, 1 finished on r1.",
        ),
        (
            [("r0-wedging", True), ("r1-idle", False), ("r0-wedging", False)],
            "The wedged backend cost the client 1 of 3 streams, each ended by an SSE error "
            "event; of the 2 after the first, 1 finished on r1, and r0 served again once its "
            "new process was re-admitted.",
        ),
    ],
    ids=["no-failure", "r0-failed-twice", "r0-back"],
)
def test_the_routing_part_tells_what_its_streams_showed(
    streams: list[tuple[str, bool]], told: str
) -> None:
    """Its closing words were fixed text ("steered the next ones to r1 at once"), true
    on a fast machine, told also where a stream after the first failure failed again."""
    assert _streams_told(streams) == told


def test_the_routing_part_shows_a_streams_error_words_as_sent_not_as_markup(
    httpserver: HTTPServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An error event's message is the server's text (the router relays a backend's own
    events unchanged): it went into a markup string, so a "[/...]" in it ended the demo
    with rich's MarkupError, and an escape character in it reached the terminal."""
    message = "[/red] engine gone \x1b[2J"
    event = json.dumps({"error": {"message": message, "type": "internal_error"}})
    said: list[str] = []

    def health(_: object) -> Response:
        # The first answer says the router is up, the second what r0 is, and the third
        # moves r0 to a state the demo then shows: the router's words.
        said.append("healthy" if len(said) < 2 else "[/bold] odd")
        return Response(json.dumps({"backends": {"r0": said[-1]}}), content_type="application/json")

    httpserver.expect_request("/health").respond_with_handler(health)
    httpserver.expect_request("/v1/completions", method="POST").respond_with_data(
        f"data: {event}\n\ndata: [DONE]\n\n",
        content_type="text/event-stream",
        headers={"X-LLMHealth-Backend": "r0"},
    )
    shown = io.StringIO()
    streams: list[tuple[str, bool]] = []
    url = httpserver.url_for("").rstrip("/")
    # A clock that moves one second a look: three looks a stream, so three streams.
    monkeypatch.setattr(demo, "time", SimpleNamespace(monotonic=itertools.count().__next__))
    asyncio.run(demo._stream_client(Console(file=shown, width=200), url, 8, streams))
    assert streams == [("r0", True)] * 3
    assert "error event: [/red] engine gone \\x1b[2J" in shown.getvalue()
    assert "r0: healthy → [/bold] odd" in shown.getvalue()
    assert "\x1b" not in shown.getvalue()


def _refusing_proxy() -> socket.socket:
    """A port nothing answers on (bound, never listening): a proxy that refuses."""
    dead = socket.socket()
    dead.bind(("127.0.0.1", 0))
    return dead


def test_the_demo_reaches_its_loopback_servers_past_an_http_proxy_in_the_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """On a host with HTTP_PROXY set (a corporate network), the demo's restart command
    and its own reads went to the proxy: gpu2's restart FAILED and part 2 ended in a
    ConnectError traceback ("internal error"), though llmhealth itself reads direct."""
    with _refusing_proxy() as dead, running_simulator(["idle"]) as sim:
        proxy = f"http://127.0.0.1:{dead.getsockname()[1]}"
        for name in ("HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy"):
            monkeypatch.setenv(name, proxy)
        monkeypatch.delenv("NO_PROXY", raising=False)
        monkeypatch.delenv("no_proxy", raising=False)
        url = sim.urls[0]
        port = int(url.rsplit(":", 1)[1])
        restart = subprocess.run(
            [sys.executable, "-c", demo._RESTART_CODE, url],
            capture_output=True,
            text=True,
            timeout=PATIENCE,
            check=False,
        )
        assert restart.returncode == 0, restart.stderr
        with httpx.Client(timeout=5.0, trust_env=False) as direct:
            assert direct.get(f"{url}/sim/stats").json()["restarts"] == 1
        assert demo._answers(f"{url}/health")
        assert "vllm:num_requests_running" in demo._scrape(port)
        assert demo._own_metrics(port).startswith("\n$ curl")


def test_a_taken_metrics_port_stops_the_watch_part_with_its_reason_not_an_interrupt(
    tmp_path: Path,
) -> None:
    """The demo picks its ports first and serves the daemon's metrics seconds later: a
    port taken meanwhile ended the demo with exit 130, as if interrupted, and only an
    asyncio "Task exception was never retrieved" traceback said why."""
    urls = [f"http://127.0.0.1:{port}" for port in (1, 2, 3, 4)]  # never read
    console = Console(file=io.StringIO())
    with socket.socket() as taken, demo._terminate_as_interrupt():
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(demo.DemoError, match=f"127.0.0.1:{port}: cannot serve metrics"):
            demo._watch_live(console, urls, "http://127.0.0.1:5", tmp_path, port)


def test_the_check_part_says_why_it_keeps_no_state_as_it_was_run() -> None:
    """The part says it runs as a check over a fleet named in a config; its report's note
    said "bare URLs without --state or --config", the reason of a run it was not."""
    base = demo.free_port_block(len(demo._FLEET) + 1)
    urls = [f"http://127.0.0.1:{base + index}" for index in range(len(demo._FLEET))]
    proxy = f"http://127.0.0.1:{base + len(demo._FLEET)}"
    modes = [mode for _, mode in demo._FLEET] + [f"proxy:{urls[0]},{urls[1]}"]
    console = Console(file=io.StringIO(), width=200)
    with demo.simulated_fleet(modes, base):
        demo._one_check(console, urls, proxy)
    shown = console.file.getvalue()  # type: ignore[attr-defined]
    assert "bare URLs" not in shown
    assert "note: state not persisted: the demo's check keeps none" in shown


def test_a_simulator_that_cannot_listen_is_a_plain_failure_not_a_bug_report() -> None:
    """It was a RuntimeError, which the CLI prints as a traceback and "internal error
    (the traceback above is a bug report)"."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with (
            pytest.raises(demo.DemoError, match="cannot listen"),
            demo.simulated_fleet(["idle"], port),
        ):
            pass


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP])
def test_a_stop_signal_landing_in_a_gathered_task_unwinds_as_ctrl_c_without_a_stray_traceback(
    signum: signal.Signals, caplog: pytest.LogCaptureFixture
) -> None:
    # Before: the demo's handler raised KeyboardInterrupt wherever the signal landed. In
    # a task a gather had started (one backend's read in the check part), asyncio.run's
    # close re-raised it from the main task while cancelling it, and that task's
    # exception was logged as "never retrieved", a traceback on the demo's stderr.
    async def one_read() -> None:
        os.kill(os.getpid(), signum)
        for _ in range(1_000_000):  # the handler runs here, inside this task's step
            await asyncio.sleep(0)

    async def check() -> None:
        await asyncio.gather(one_read(), asyncio.sleep(PATIENCE))

    with demo._terminate_as_interrupt(), pytest.raises(KeyboardInterrupt):
        asyncio.run(check())
    gc.collect()
    assert not [record for record in caplog.records if record.name == "asyncio"]


@pytest.mark.slow
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP])
def test_a_stop_signal_in_the_routing_part_unwinds_as_ctrl_c_not_a_connect_error(
    signum: signal.Signals, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Before: the routing part's daemon took the signal and closed the router at once,
    # then waited for its restart command; the demo's client, its stream over, asked the
    # gone router for /health, and that ConnectError ended the demo as "internal error"
    # (a traceback, exit 3), not as an interrupt (130).
    monkeypatch.setattr(demo, "_ROUTE_WEDGE_AFTER", 0.5)
    # A restart command still running when the signal comes, as `systemctl restart` is.
    monkeypatch.setattr(demo, "_RESTART_CODE", "import time; time.sleep(3)")
    shown = io.StringIO()
    stopped: list[bool] = []

    def stop_once_restarting() -> None:
        deadline = time.monotonic() + PATIENCE
        while time.monotonic() < deadline:
            if "→ restarting" in shown.getvalue():
                os.kill(os.getpid(), signum)
                stopped.append(True)
                return
            time.sleep(0.05)

    stopper = threading.Thread(target=stop_once_restarting, daemon=True)
    stopper.start()
    with demo._terminate_as_interrupt(), pytest.raises(KeyboardInterrupt):
        demo._route_live(Console(file=shown, width=200), tmp_path)
    stopper.join(PATIENCE)
    assert stopped, shown.getvalue()
