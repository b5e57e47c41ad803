"""llmhealth against a real vLLM 0.32 server (CPU, tiny random model), scenario by scenario.

Each test drives the real server into a state (idle, busy decode, prefill-heavy, engine
stopped, API server stopped, restarted, down, behind nginx, restarted by llmhealth
itself), runs the real `llmhealth check --format json` in a subprocess, and asserts the
verdict, the evidence and the exit code. Where llmhealth must not send a request, vLLM's
own counters and access log are the witness.

The tests run in file order and share one server (see conftest.py): the order keeps the
number of vLLM starts (30-70 s each on 2 cores) low.

On a 2-core machine that something else is also using, any process here may wait a second
or more for a CPU. So loads run until stopped rather than for a fixed time, and llmhealth
gets a 15 s read timeout except where a timeout is the point: the scenarios are about what
the server shows, not about how fast a starved machine answers.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import Nginx, record, start_server, watch_log
from helpers import (
    FINISHED,
    GENERATED,
    RUNNING,
    START,
    STEPS,
    WAITING,
    CheckRun,
    Load,
    access_lines,
    check,
    decode_body,
    log_size,
    prefill_body,
    scrape,
    wait_for,
    wait_quiet,
    work,
)
from vllm_server import MAX_NUM_SEQS, MODEL_NAME, VllmServer, free_port, process_state

import llmhealth

WAIT = "5s"  # llmhealth's default between reads: busy after one wait, wedged after two
TIMEOUT = "15s"  # one HTTP read; generous, see the module docstring
OK, WARNING, CRITICAL = 0, 1, 2
# More concurrent requests than --max-num-seqs: 4 running, the rest waiting.
LOAD_SIZE = 3 * MAX_NUM_SEQS


def check_backend(url: str, *extra: str) -> CheckRun:
    return check(url, "--wait", WAIT, "--timeout", TIMEOUT, *extra)


def start_decode_load(server: VllmServer, size: int = LOAD_SIZE) -> Load:
    """``size`` long decodes kept in flight until stopped; returns once the engine runs a
    full batch with more waiting and tokens are flowing."""
    before = scrape(server.url)
    load = Load(server.url, [decode_body() for _ in range(size)], until_stopped=True).start()

    def full_and_moving() -> bool:
        now = scrape(server.url)
        return (
            now[RUNNING] == MAX_NUM_SEQS
            and now[WAITING] > 0
            and now[GENERATED] > before.get(GENERATED, 0)
        )

    try:
        wait_for("a full batch with requests waiting", full_and_moving, 120)
    except BaseException:
        load.stop()
        raise
    return load


def in_full_batch(running: int | None) -> bool:
    """Whether a running gauge is that of a full batch with a queue behind it: the batch
    itself, or one less for the step between a decode finishing and the next request
    admitted from the queue (a library check in CI once read 3)."""
    return running is not None and MAX_NUM_SEQS - 1 <= running <= MAX_NUM_SEQS


def finish(load: Load, timeout: float = 180) -> None:
    """Stop sending, and wait (bounded) for what is in flight to be answered."""
    load.stop()
    assert load.join(timeout), f"load still running after {timeout:.0f} s: {load.summary()}"


# --- idle --------------------------------------------------------------------------------


def test_an_idle_server_is_sent_one_tiny_request_and_answers(server: VllmServer) -> None:
    before = wait_quiet(server)
    offset = log_size(server)
    run = check_backend(server.url)
    backend = run.backend
    assert run.code == OK, run
    assert backend["verdict"] == "idle", run
    assert backend["healthy"] is True, run
    assert backend["requests_sent"] == 1, run
    assert backend["running"] == 0 and backend["waiting"] == 0, run
    assert "no work (0 running, 0 waiting)" in backend["evidence"], run
    assert f"by model {MODEL_NAME}" in backend["evidence"], run
    # The server saw exactly that one request, and it finished.
    wait_for("the tiny request to be counted", lambda: scrape(server.url)[FINISHED] > 0, 30)
    assert scrape(server.url)[FINISHED] - before[FINISHED] == 1
    assert len(access_lines(server, offset, "POST /v1/completions")) == 1


# --- busy decode ---------------------------------------------------------------------------


def test_a_busy_server_is_judged_busy_and_sent_no_request(server: VllmServer) -> None:
    before = wait_quiet(server)
    offset = log_size(server)
    load = start_decode_load(server)
    try:
        run = check_backend(server.url)
    finally:
        finish(load)
    backend = run.backend
    assert run.code == OK, run
    assert backend["verdict"] == "busy", run
    assert backend["healthy"] is True, run
    assert backend["requests_sent"] == 0, run
    assert in_full_batch(backend["running"]) and backend["waiting"] > 0, run
    assert backend["steps_per_s"] > 0 and backend["tokens_per_s"] > 0, run
    assert "progressed over" in backend["evidence"], run
    assert "no request sent" in backend["evidence"], run
    # vLLM's own witness: every request it finished, and every POST in its access log, was
    # one of the load's. A request from llmhealth would be one more.
    after = wait_quiet(server)
    assert load.all_ok, load.summary()
    assert after[FINISHED] - before[FINISHED] == load.sent, (before, after, load.sent)
    assert len(access_lines(server, offset, "POST /v1/completions")) == load.sent


# --- the library --------------------------------------------------------------------------

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def test_the_library_its_prober_and_the_health_script_send_a_busy_server_no_request(
    server: VllmServer,
) -> None:
    before = wait_quiet(server)
    offset = log_size(server)
    load = start_decode_load(server)
    try:
        report = llmhealth.check([server.url], wait=5.0, timeout=15.0)
        script = run_with_stacks(
            [str(EXAMPLES / "llm-health.py"), server.url, "--timeout", "15"], timeout=120
        )
        probed = asyncio.run(probe_twice(server.url))
    finally:
        finish(load)
    backend = report.backends[0]
    assert backend.verdict is llmhealth.VerdictKind.BUSY, report.to_dict()
    assert backend.requests_sent == 0 and in_full_batch(backend.running), report.to_dict()
    assert script.returncode == OK, script
    assert script.stdout.startswith("OK - busy: "), script
    assert probed == [None, llmhealth.VerdictKind.BUSY]
    after = wait_quiet(server)
    assert load.all_ok, load.summary()
    assert after[FINISHED] - before[FINISHED] == load.sent, (before, after, load.sent)
    assert len(access_lines(server, offset, "POST /v1/completions")) == load.sent


def run_with_stacks(argv: list[str], timeout: float) -> subprocess.CompletedProcess[str]:
    """A Python script as a subprocess that prints every thread's stack to its stderr
    10 s before ``timeout``: once, beside a decode load, this script outlived its 120 s
    (15 s reads) and said nothing of where it was."""
    launcher = (
        "import faulthandler, runpy, sys; "
        f"faulthandler.dump_traceback_later({timeout - 10:g}, exit=False); "
        "sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')"
    )
    try:
        return subprocess.run(
            [sys.executable, "-c", launcher, *argv],
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
    except subprocess.TimeoutExpired as exc:
        stderr = exc.stderr.decode() if isinstance(exc.stderr, bytes) else exc.stderr
        pytest.fail(f"{argv[0]} still ran after {timeout:g} s; its stacks:\n{stderr}")


async def probe_twice(url: str) -> list[llmhealth.VerdictKind | None]:
    """Two probe() calls one wait apart, as a controller's loop would make them."""
    fleet = llmhealth.FleetHealth([url])
    async with llmhealth.Prober(fleet, wait=4.0, timeout=15.0) as prober:
        first = await prober.probe()
        await asyncio.sleep(5.0)
        second = await prober.probe()
    assert fleet.state_of(0) is llmhealth.State.HEALTHY
    return [first[0].verdict, second[0].verdict]


# --- prefill-heavy -----------------------------------------------------------------------


def test_prefill_heavy_load_is_never_called_stalled_or_wedged(server: VllmServer) -> None:
    before = wait_quiet(server)
    rng = random.Random(7)
    bodies = [prefill_body(rng) for _ in range(40)]
    load = Load(server.url, bodies, until_stopped=True).start()
    runs = []
    try:
        wait_for("long prompts to reach the engine", lambda: work(scrape(server.url)) > 0, 120)
        for _ in range(3):
            runs.append(check_backend(server.url))
    finally:
        finish(load)
    history = "\n".join(map(repr, runs))
    for run in runs:
        assert run.code == OK, history
        assert run.backend["verdict"] == "busy", history
        assert run.backend["requests_sent"] == 0, history
        assert "progressed over" in run.backend["evidence"], history
    after = wait_quiet(server)
    assert load.all_ok, load.summary()
    assert after[FINISHED] - before[FINISHED] == load.sent


# --- wedged --------------------------------------------------------------------------------


def test_a_stopped_engine_core_is_wedged_and_recovers_when_resumed(server: VllmServer) -> None:
    before = wait_quiet(server)
    load = start_decode_load(server)
    engine = server.engine_core_pid()
    try:
        os.kill(engine, signal.SIGSTOP)
        try:
            time.sleep(1.0)  # let the last step's numbers reach /metrics
            frozen = scrape(server.url)
            wedged = check_backend(server.url)
            still_frozen = scrape(server.url)
            stopped = process_state(engine)
        finally:
            os.kill(engine, signal.SIGCONT)
        resumed = check_backend(server.url)
    finally:
        finish(load)

    backend = wedged.backend
    assert stopped == "T"
    assert wedged.code == CRITICAL, wedged
    assert backend["verdict"] == "wedged", wedged
    assert backend["healthy"] is False, wedged
    assert backend["requests_sent"] == 0, wedged
    evidence = backend["evidence"]
    assert "no progress over 2 consecutive waits" in evidence, wedged
    # Stopped mid-batch: the gauge froze at a full batch, or one less between steps.
    assert in_full_batch(int(frozen[RUNNING])), frozen
    running = f"{frozen[RUNNING]:g}"
    assert f"running {running}→{running}→{running}" in evidence, wedged
    steps = f"{frozen[STEPS]:g}"
    assert f"steps {steps}→{steps}→{steps}" in evidence, wedged
    assert "unchanged" in evidence and "engine awake" in evidence, wedged
    # The API server went on answering while the engine was frozen: a faithful wedge.
    assert still_frozen[STEPS] == frozen[STEPS] and still_frozen[RUNNING] == frozen[RUNNING]

    assert resumed.code == OK, resumed
    assert resumed.backend["verdict"] == "busy", resumed
    # Nothing was lost: every request of the load was answered once the engine went on.
    after = wait_quiet(server)
    assert load.all_ok, load.summary()
    assert after[FINISHED] - before[FINISHED] == load.sent


# --- API server frozen -------------------------------------------------------------------


def test_a_stopped_api_server_is_unresponsive(server: VllmServer) -> None:
    wait_quiet(server)
    assert server.pid is not None
    os.kill(server.pid, signal.SIGSTOP)
    try:
        frozen = check(server.url, "--wait", WAIT, "--timeout", "2s")
        stopped = process_state(server.pid)
    finally:
        os.kill(server.pid, signal.SIGCONT)
    wait_for("the API server to answer again", lambda: bool(scrape(server.url)), 60)
    after = check_backend(server.url)

    backend = frozen.backend
    assert stopped == "T"
    assert frozen.code == CRITICAL, frozen
    assert backend["verdict"] == "unresponsive", frozen
    assert backend["healthy"] is False and backend["requests_sent"] == 0, frozen
    assert backend["evidence"].startswith("unresponsive:"), frozen
    assert after.code == OK and after.backend["verdict"] == "idle", after


# --- restarted -------------------------------------------------------------------------


def test_a_restart_between_two_runs_is_seen_by_its_start_time(
    server: VllmServer, tmp_path: Path
) -> None:
    state = str(tmp_path / "state.json")
    wait_quiet(server)
    first = check_backend(server.url, "--state", state)
    old_start = scrape(server.url)[START]
    seconds = server.restart()
    record(f"vLLM start #{server.starts} (restart)", seconds)
    new_start = scrape(server.url)[START]
    second = check_backend(server.url, "--state", state)

    assert first.code == OK and first.backend["verdict"] == "idle", first
    assert new_start != old_start
    backend = second.backend
    assert backend["verdict"] == "restarted", second
    assert "process start time" in backend["evidence"], second
    assert f"{old_start:.2f}" in backend["evidence"], second
    assert f"{new_start:.2f}" in backend["evidence"], second
    assert second.code == WARNING, second


# --- a real proxy -------------------------------------------------------------------------


def test_nginx_in_front_of_the_server_is_up_and_only_asked_for_models(
    server: VllmServer, nginx: Nginx
) -> None:
    wait_quiet(server)
    run = check_backend(server.url, "--proxy", nginx.url)
    backend, proxy = run.backend, run.proxy
    assert run.code == OK, run
    assert backend["verdict"] == "idle", run
    assert proxy["verdict"] == "up", run
    assert proxy["healthy"] is True and proxy["requests_sent"] == 0, run
    assert proxy["evidence"] == f"up: /v1/models lists {MODEL_NAME}", run
    # A proxy is only ever asked GET /v1/models: nginx's log shows nothing else, and the
    # backend's /metrics and tiny request went to it directly.
    asked = nginx.access_log().splitlines()
    assert len(asked) == 1 and '"GET /v1/models HTTP/1.1" 200' in asked[0], asked


def test_a_stopped_server_is_down_and_nginx_in_front_of_it_too(
    server: VllmServer, nginx: Nginx
) -> None:
    server.stop()
    run = check_backend(server.url, "--proxy", nginx.url)
    backend, proxy = run.backend, run.proxy
    assert run.code == CRITICAL, run
    assert backend["verdict"] == "down", run
    assert backend["healthy"] is False and backend["requests_sent"] == 0, run
    assert backend["evidence"].startswith("down:"), run
    assert "refused" in backend["evidence"].lower(), run
    # nginx still answers, with 502: reachable is not up.
    assert proxy["verdict"] == "down", run
    assert "502" in proxy["evidence"], run


# --- restarted, Prometheus multiprocess mode (no start time) ------------------------------


def test_a_restart_without_start_time_is_seen_by_counters_going_down(
    vllm: VllmServer, spare_servers: list[VllmServer], tmp_path: Path
) -> None:
    vllm.stop()  # two servers at once would share 2 cores
    state = str(tmp_path / "state.json")
    port = free_port()

    def multiproc_server(name: str) -> VllmServer:
        directory = tmp_path / f"prometheus-{name}"
        directory.mkdir()
        server = VllmServer(
            port, tmp_path / f"vllm-{name}.log", env={"PROMETHEUS_MULTIPROC_DIR": str(directory)}
        )
        spare_servers.append(server)
        start_server(server)
        return server

    first = multiproc_server("first")
    assert START not in scrape(first.url), "multiprocess mode should hide the start time"
    # Counters above zero, so that the next process's zeros are lower.
    served = Load(first.url, [decode_body(max_tokens=8) for _ in range(3)]).start()
    finish(served, 60)
    assert served.all_ok, served.summary()
    before = check_backend(first.url, "--state", state)
    first.stop()
    second = multiproc_server("second")
    after = check_backend(second.url, "--state", state)

    assert before.code == OK and before.backend["verdict"] == "idle", before
    backend = after.backend
    assert backend["verdict"] == "restarted", after
    assert "counters went down" in backend["evidence"], after
    assert "no start time" in backend["evidence"], after
    assert after.code == WARNING, after


# --- a wedge that llmhealth restarts itself ---------------------------------------------


def test_a_wedge_is_restarted_by_its_command_and_readmitted(
    vllm: VllmServer, spare_servers: list[VllmServer], tmp_path: Path
) -> None:
    vllm.stop()
    port = free_port()
    pidfile, log = tmp_path / "vllm.pid", tmp_path / "vllm-restarted.log"
    helper = [sys.executable, str(Path(__file__).with_name("vllm_server.py"))]
    where = ["--pidfile", str(pidfile), "--port", str(port), "--log", str(log)]
    config = tmp_path / "llmhealth.toml"
    config.write_text(
        f'wait = "{WAIT}"\n'
        f'timeout = "{TIMEOUT}"\n'
        f'state = "{tmp_path / "state.json"}"\n'
        "[policy]\n"
        'startup_grace = "5m"\n'
        "[[backend]]\n"
        'name = "gpu0"\n'
        f'url = "http://127.0.0.1:{port}"\n'
        f"restart = {json.dumps([*helper, 'restart', *where])}\n",
        encoding="utf-8",
    )
    # The first process is started the way the restart command starts the next one.
    server = VllmServer(port, log)
    spare_servers.append(server)
    watch_log(server)
    started = time.monotonic()
    server.adopt(_run_helper([*helper, "start", *where, "--wait"], pidfile))
    record("vLLM start (for the restart scenario)", time.monotonic() - started)

    healthy = check("--config", str(config))
    assert healthy.code == OK and healthy.backend["state"] == "healthy", healthy

    load = start_decode_load(server)
    try:
        os.kill(server.engine_core_pid(), signal.SIGSTOP)
        time.sleep(1.0)
        old_pid = server.pid
        wedged = check("--config", str(config))
        new_pid = int(pidfile.read_text(encoding="utf-8"))
        server.adopt(new_pid)  # from here on the fixture stops the new one
    finally:
        finish(load, 60)  # the old server is gone: its requests failed, nothing is resent

    backend = wedged.backend
    assert wedged.code == CRITICAL, wedged
    assert backend["verdict"] == "wedged", wedged
    assert [r["action"] for r in wedged.doc["restarts"]] == ["restart"], wedged
    assert wedged.doc["restarts"][0]["ran"] is True, wedged
    assert wedged.doc["restarts"][0]["ok"] is True, wedged
    assert backend["state"] == "restarting", wedged
    assert new_pid != old_pid
    assert old_pid is not None and process_state(old_pid) in (None, "Z")

    # Check again and again, as a timer would, until the new process is re-admitted.
    runs = []
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        runs.append(check("--config", str(config)))
        if runs[-1].backend["state"] == "healthy":
            break
        time.sleep(3)
    history = "\n".join(map(repr, runs))
    assert runs[-1].backend["state"] == "healthy", history
    moves = [(t["from"], t["to"]) for run in runs for t in run.backend["transitions"]]
    assert ("restarting", "stale") in moves, history
    assert moves[-1] == ("stale", "healthy"), history
    assert all(run.doc["restarts"] == [] for run in runs), history
    # The run that re-admits it still reports the restart it saw (a warning); the next one
    # finds a plain healthy, idle backend.
    settled = check("--config", str(config))
    assert settled.code == OK, settled
    assert settled.backend["verdict"] == "idle" and settled.backend["state"] == "healthy"
    record(f"restart scenario: re-admitted after {len(runs)} more checks", 0.0)


def _run_helper(argv: list[str], pidfile: Path) -> int:
    done = subprocess.run(argv, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, f"{argv} failed:\n{done.stdout}\n{done.stderr}"
    return int(pidfile.read_text(encoding="utf-8"))
