"""Several `llmhealth check` runs in a row on one state file, against real simulated vLLM
processes, through the installed command: what an operator or a cron mailer sees.

Each run is a fresh process, so everything a run knows about the last one came through the
state file. Reads are fast (--wait 0.3, --timeout 1) so the whole file stays short; every
simulator and every check process is stopped when its test ends, failing or not.
"""

from __future__ import annotations

import json
import resource
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from captures import asleep_capture
from pytest_httpserver import HTTPServer
from simproc import running_simulator
from werkzeug import Request, Response

FAST = ["--format", "json", "--wait", "0.3", "--timeout", "1", "--answer-timeout", "1"]
RUN_TIMEOUT = 30.0  # a bound for a hung run, far above the ~1.5 s a run takes here
RESTART_PERIOD = 4.0  # restart:4: a new simulated process every 4 s


@dataclass(frozen=True)
class Run:
    code: int
    stdout: str
    stderr: str

    @property
    def report(self) -> dict[str, Any]:
        assert self.stdout, f"no JSON on stdout (exit {self.code}); stderr:\n{self.stderr}"
        document: dict[str, Any] = json.loads(self.stdout)
        assert document["exit_code"] == self.code, "the JSON and the exit status disagree"
        return document

    def backend(self, name: str | None = None) -> dict[str, Any]:
        backends: list[dict[str, Any]] = self.report["backends"]
        if name is None:
            assert len(backends) == 1
            return backends[0]
        return next(b for b in backends if b["name"] == name)

    def seen(self, name: str | None = None) -> tuple[str, str, bool, int, bool, int]:
        """verdict, ledger state, serving, fleet epoch, floor breached, exit code."""
        backend, fleet = self.backend(name), self.report["fleet"]
        return (
            backend["verdict"],
            backend["state"],
            backend["serving"],
            fleet["epoch"],
            fleet["floor_breached"],
            self.code,
        )


def check(entry_point: str, state: Path, *args: str) -> Run:
    completed = subprocess.run(
        [entry_point, "check", *args, "--state", str(state), *FAST],
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT,  # on expiry subprocess.run kills the child before raising
        check=False,
    )
    assert "Traceback" not in completed.stderr, completed.stderr
    return Run(completed.returncode, completed.stdout, completed.stderr)


def sim_stats(url: str) -> dict[str, Any]:
    stats: dict[str, Any] = httpx.get(f"{url}/sim/stats", timeout=2.0).json()
    return stats


def saved_backend(state: Path, name: str) -> dict[str, Any]:
    document = json.loads(state.read_text())
    return next(b for b in document["ledger"]["backends"] if b["name"] == name)


@pytest.mark.slow
def test_a_server_that_never_answers_is_suspect_twice_then_dead(
    entry_point: str, tmp_path: Path
) -> None:
    state = tmp_path / "state.json"
    with running_simulator(["hang"]) as sim:
        runs = [check(entry_point, state, sim.urls[0]) for _ in range(4)]
    # Exit 2 from the first run on: an unresponsive backend is failing now (CRITICAL, like
    # down), even while the ledger keeps it serving so that one blip costs no capacity.
    # The third failure in a row condemns it; the serving set shrinks and the epoch moves;
    # with min_healthy 1 and nothing left serving, the floor is breached. A fourth failure
    # changes nothing more.
    assert [run.seen() for run in runs] == [
        ("unresponsive", "suspect", True, 0, False, 2),
        ("unresponsive", "suspect", True, 0, False, 2),
        ("unresponsive", "dead", False, 1, True, 2),
        ("unresponsive", "dead", False, 1, True, 2),
    ]
    assert [run.backend()["transitions"] for run in runs] == [
        [{"event": "probe_failure", "from": "healthy", "to": "suspect"}],
        [],
        [{"event": "probe_failure", "from": "suspect", "to": "dead"}],
        [],
    ]
    assert runs[2].backend()["last_error"].startswith("unresponsive: ")
    assert runs[2].report["fleet"]["message"].startswith("floor breached: 0 of 1 backends")
    assert saved_backend(state, runs[2].backend()["name"])["condemned_by"] == "unresponsive"


def test_a_wedged_server_is_dead_on_the_first_run(entry_point: str, tmp_path: Path) -> None:
    with running_simulator(["wedge:0.5"]) as sim:
        time.sleep(0.6)  # the engine froze 0.5 s after the simulator started
        run = check(entry_point, tmp_path / "state.json", sim.urls[0])
        stats = sim_stats(sim.urls[0])
    assert run.seen() == ("wedged", "dead", False, 1, True, 2)
    assert run.backend()["transitions"] == [
        {"event": "wedge_proven", "from": "healthy", "to": "dead"}
    ]
    assert "no progress over 2 consecutive waits" in run.backend()["evidence"]
    assert stats["completions_received"] == 0  # work was showing: no request was spent


def test_a_busy_server_stays_healthy_and_is_never_sent_a_request(
    entry_point: str, tmp_path: Path
) -> None:
    state = tmp_path / "state.json"
    with running_simulator(["busy"]) as sim:
        runs = [check(entry_point, state, sim.urls[0]) for _ in range(3)]
        stats = sim_stats(sim.urls[0])
    assert [run.seen() for run in runs] == [("busy", "healthy", True, 0, False, 0)] * 3
    assert [run.backend()["requests_sent"] for run in runs] == [0, 0, 0]
    assert stats["completions_received"] == 0
    assert stats["models_reads"] == 0
    assert stats["metrics_reads"] >= 2 * len(runs)  # judged by its metrics alone


def _process_start(url: str) -> float:
    """When the simulated process really started (its /metrics claims an hour earlier)."""
    start = sim_stats(url)["start_time"]
    assert isinstance(start, float)
    return start


def _sleep_into_next_process(url: str, margin: float = 0.2) -> float:
    """Sleep until just after the simulator's next restart; returns when the one after is."""
    next_start = _process_start(url) + RESTART_PERIOD
    time.sleep(max(0.0, next_start + margin - time.time()))
    return next_start + RESTART_PERIOD


@pytest.mark.slow
def test_a_restart_between_runs_is_seen_from_the_saved_baseline(
    entry_point: str, tmp_path: Path
) -> None:
    state = tmp_path / "state.json"
    with running_simulator([f"restart:{RESTART_PERIOD:g}"]) as sim:
        url = sim.urls[0]
        # Each run must fall inside one simulated process's life, so runs start just
        # after a restart: the first in whichever life has room left, the others in the next.
        if time.time() - _process_start(url) > RESTART_PERIOD - 2.0:
            _sleep_into_next_process(url)
        first = check(entry_point, state, url)
        next_restart = _sleep_into_next_process(url)
        second = check(entry_point, state, url)
        third = check(entry_point, state, url)  # and not only once
        finished = time.time()
    assert finished < next_restart, "the runs were too slow to fit between two restarts"

    assert first.seen() == ("idle", "healthy", True, 0, False, 0)
    # Within one run nothing changed between reads: only the start time saved by the first
    # run reveals the new process. It answered the tiny request, so it is re-admitted at
    # once; the serving set changed twice (out to STALE, back in). A restart is a warning.
    assert second.seen() == ("restarted", "healthy", True, 2, False, 1)
    assert "since the last run" in second.backend()["evidence"]
    assert second.backend()["transitions"] == [
        {"event": "unplanned_restart", "from": "healthy", "to": "stale"},
        {"event": "readmitted", "from": "stale", "to": "healthy"},
    ]
    assert third.seen() == ("idle", "healthy", True, 2, False, 0)


@pytest.mark.slow
def test_two_runs_started_together_take_turns_on_the_state(
    entry_point: str, tmp_path: Path
) -> None:
    state = tmp_path / "state.json"
    with running_simulator(["hang"]) as sim:
        argv = [entry_point, "check", sim.urls[0], "--state", str(state), *FAST]
        processes: list[subprocess.Popen[str]] = []
        try:
            for _ in range(2):
                processes.append(
                    subprocess.Popen(
                        argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
                    )
                )
            outputs = [process.communicate(timeout=RUN_TIMEOUT) for process in processes]
        finally:
            for process in processes:
                if process.poll() is None:
                    process.kill()
                    process.communicate()
    runs = [Run(p.returncode, out, err) for p, (out, err) in zip(processes, outputs, strict=True)]
    for index, run in enumerate(runs):
        assert "Traceback" not in run.stderr, run.stderr
        if run.code == 3:
            # Gave up on the lock: says so, naming the run that held it.
            other = processes[1 - index].pid
            assert f"locked by another llmhealth (PID {other})" in run.stderr, run.stderr
        else:
            assert run.seen()[1:] == ("suspect", True, 0, False, 2)
    ran = [run for run in runs if run.code != 3]
    assert ran, "neither run got the lock"
    # No lost update: the saved streak counts every run that got the lock.
    name = ran[0].backend()["name"]
    assert saved_backend(state, name)["probe_failures"] == len(ran)
    if len(ran) == 2:
        # The second started its cycle only after the first let go: each held the lock for
        # at least the 1 s read timeout.
        starts = sorted(run.report["checked_at"] for run in ran)
        assert starts[1] - starts[0] >= 0.9
    assert not list(tmp_path.glob(".state.json.*.tmp"))


CORRUPT = {
    "not json": b'{"ledger": {"schema": 1,',
    "a ledger of the wrong shape": json.dumps(
        {"schema": 1, "ledger": {"schema": 1, "epoch": 0, "backends": "gpu0"}}
    ).encode(),
    "bytes that are not text": b'{"ledger": "\xff\xfe\x00garbage"}',
}


@pytest.mark.slow
def test_a_corrupt_state_file_is_set_aside_and_the_next_run_starts_afresh(
    entry_point: str, tmp_path: Path
) -> None:
    with running_simulator(["idle"]) as sim:
        for label, content in CORRUPT.items():
            folder = tmp_path / label.replace(" ", "-")
            folder.mkdir()
            state = folder / "state.json"
            state.write_bytes(content)

            refused = check(entry_point, state, sim.urls[0])
            assert refused.code == 3, (label, refused.stderr)
            assert "moved aside" in refused.report["error"]  # --format json: a document
            assert "unreadable" in refused.stderr and "moved aside" in refused.stderr, label
            assert not state.exists()
            [aside] = folder.glob("state.json.corrupt-*")
            assert str(aside) in refused.stderr
            assert aside.read_bytes() == content

            fresh = check(entry_point, state, sim.urls[0])
            assert fresh.seen() == ("idle", "healthy", True, 0, False, 0), label
            assert json.loads(state.read_text())["ledger"]["backends"][0]["state"] == "healthy"
            assert aside.read_bytes() == content  # kept: never deleted, never replaced


def test_a_state_file_with_an_enormous_number_is_set_aside_too(
    entry_point: str, tmp_path: Path
) -> None:
    state = tmp_path / "state.json"
    ledger = {"schema": 1, "epoch": 0, "backends": []}
    text = json.dumps({"schema": 1, "ledger": ledger, "sightings": {"gpu0": {"at": 0}}})
    state.write_text(text.replace('"at": 0', '"at": 1' + "0" * 400))
    refused = check(entry_point, state, "http://127.0.0.1:9")
    assert refused.code == 3
    assert "moved aside" in refused.stderr


def _write_config(path: Path, urls: list[str], min_healthy: int) -> Path:
    backends = "".join(
        f'\n[[backend]]\nname = "gpu{index}"\nurl = "{url}"\n' for index, url in enumerate(urls)
    )
    path.write_text(f"[policy]\nmin_healthy = {min_healthy}\n{backends}")
    return path


@pytest.mark.slow
def test_a_fleet_below_its_floor_is_critical_and_says_why(entry_point: str, tmp_path: Path) -> None:
    with running_simulator(["busy", "wedge:0.5"]) as sim:
        config = _write_config(tmp_path / "fleet.toml", sim.urls, min_healthy=2)
        time.sleep(0.6)  # the second engine froze 0.5 s after the simulator started
        run = check(entry_point, tmp_path / "state.json", "--config", str(config))
    assert run.seen("gpu0") == ("busy", "healthy", True, 1, True, 2)
    assert run.seen("gpu1") == ("wedged", "dead", False, 1, True, 2)
    fleet = run.report["fleet"]
    assert (fleet["serving"], fleet["min_healthy"]) == (1, 2)
    assert fleet["message"].startswith("floor breached: 1 of 2 backends serving, min_healthy is 2")
    assert "gpu1 dead (last error: wedged: " in fleet["message"]


@pytest.mark.slow
def test_the_floor_alone_makes_a_run_critical(entry_point: str, tmp_path: Path) -> None:
    state = tmp_path / "state.json"
    with running_simulator(["busy", "busy"]) as sim:
        config = _write_config(tmp_path / "fleet.toml", sim.urls, min_healthy=2)
        first = check(entry_point, state, "--config", str(config))
        where = ["--config", str(config), "--state", str(state)]
        retire = subprocess.run(
            [entry_point, "retire", "gpu1", "--reason", "taken out for a test", *where],
            capture_output=True,
            text=True,
            timeout=RUN_TIMEOUT,
            check=False,
        )
        second = check(entry_point, state, "--config", str(config))
    assert first.seen("gpu1") == ("busy", "healthy", True, 0, False, 0)
    assert retire.returncode == 0, retire.stderr
    # Alone, each backend is at most a warning (gpu1 is retired: out by decision, and busy);
    # one serving backend against a floor of two makes the run critical.
    assert second.seen("gpu0") == ("busy", "healthy", True, 1, True, 2)
    assert second.seen("gpu1") == ("busy", "retired", False, 1, True, 2)


@pytest.mark.slow
def test_a_retired_backend_whose_address_the_config_changes_stays_retired(
    entry_point: str, tmp_path: Path
) -> None:
    # The config is the operator's (or an inventory template's): a new address for a
    # name is not a new backend. Forgotten and added again, it served at once, out of
    # RETIRED without the reset the ledger demands, with a fresh restart budget.
    state = tmp_path / "state.json"
    config = tmp_path / "fleet.toml"
    where = ["--config", str(config), "--state", str(state)]
    with running_simulator(["busy"]) as first, running_simulator(["busy"]) as second:
        _write_config(config, first.urls, min_healthy=0)
        check(entry_point, state, "--config", str(config))
        retire = subprocess.run(
            [entry_point, "retire", "gpu0", "--reason", "card replaced", *where],
            capture_output=True,
            text=True,
            timeout=RUN_TIMEOUT,
            check=False,
        )
        assert retire.returncode == 0, retire.stderr
        _write_config(config, second.urls, min_healthy=0)
        moved = check(entry_point, state, "--config", str(config))
    # Another process answers there: a restart as the old sighting shows it, still retired.
    assert moved.seen("gpu0")[:3] == ("restarted", "retired", False)
    assert moved.backend("gpu0")["url"] == second.urls[0]
    assert f"gpu0: moved from {first.urls[0]} to {second.urls[0]}; stays retired" in (
        moved.stdout + moved.stderr
    )


def _metrics_hang(url: str, hang: bool) -> None:
    reply = httpx.post(f"{url}/sim/metrics", json={"hang": hang}, timeout=2.0)
    assert reply.json() == {"metrics_hang": hang}


@pytest.mark.slow
def test_a_server_whose_metrics_hung_for_three_runs_serves_again_with_no_restart_or_operator(
    entry_point: str, tmp_path: Path
) -> None:
    state = tmp_path / "state.json"
    with running_simulator(["idle"]) as sim:
        url = sim.urls[0]
        start = _process_start(url)
        serving = check(entry_point, state, url)  # the process llmhealth will know again
        _metrics_hang(url, True)  # a long pause: the process lives, /metrics does not answer
        condemned = [check(entry_point, state, url) for _ in range(3)]
        _metrics_hang(url, False)
        back = [check(entry_point, state, url) for _ in range(3)]
        stats = sim_stats(url)
        assert _process_start(url) == start
    assert serving.seen() == ("idle", "healthy", True, 0, False, 0)
    assert condemned[-1].seen() == ("unresponsive", "dead", False, 1, True, 2)
    # healthy_threshold (2) good verdicts from the same process, then re-admission: three
    # runs, and nothing restarted it (no restart command; restart_on is only wedged).
    assert [run.seen()[:3] for run in back] == [
        ("idle", "dead", False),
        ("idle", "stale", False),
        ("idle", "healthy", True),
    ]
    assert back[1].backend()["transitions"] == [
        {"event": "good_verdict", "from": "dead", "to": "stale"}
    ]
    assert back[2].backend()["transitions"] == [
        {"event": "readmitted", "from": "stale", "to": "healthy"}
    ]
    assert back[2].seen()[3:] == (2, False, 0)
    assert stats["restarts"] == 0
    saved = saved_backend(state, back[2].backend()["name"])
    assert saved["recovery_times"] and len(saved["recovery_times"]) == 1
    audit = [json.loads(line) for line in (tmp_path / "audit.jsonl").read_text().splitlines()]
    recovered = [entry for entry in audit if entry["from"] == "dead" and entry["to"] == "stale"]
    assert len(recovered) == 1
    assert recovered[0]["reason"].startswith("same process, back after ")
    assert "in-place recovery 1 of 3 allowed in 24h" in recovered[0]["reason"]
    assert recovered[0]["evidence"]["verdict"] == "idle"


def test_a_fleet_larger_than_the_open_file_limit_is_read_whole(
    entry_point: str, tmp_path: Path
) -> None:
    # A connection per backend: started with a soft limit below the fleet (systemd's 1024
    # against a fleet of thousands), the reads past it failed with EMFILE, each read as
    # that server's `down`. The run raises its soft limit to the hard one now.
    def low_soft_limit() -> None:
        hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
        resource.setrlimit(resource.RLIMIT_NOFILE, (48, hard))

    with running_simulator(["busy"] * 60) as sim:
        completed = subprocess.run(
            [entry_point, "check", *sim.urls, "--state", str(tmp_path / "s.json"), *FAST],
            capture_output=True,
            text=True,
            timeout=RUN_TIMEOUT,
            check=False,
            preexec_fn=low_soft_limit,
        )
    run = Run(completed.returncode, completed.stdout, completed.stderr)
    verdicts = [backend["verdict"] for backend in run.report["backends"]]
    assert verdicts == ["busy"] * 60, completed.stdout


def test_a_server_the_last_check_read_asleep_is_not_asked_while_its_metrics_fail(
    entry_point: str, tmp_path: Path, httpserver: HTTPServer
) -> None:
    """README: a server last read asleep stays so until a read shows it awake; a /metrics
    that fails meanwhile (a 503, or the read before this `check` showed it asleep) is
    `no_metrics`, not asked. The state file kept the last read's counters and start time
    but not its sleep state: the next `check`, its /metrics answering 503, sent the
    completion that crashes a sleeping vLLM (#15483)."""
    asleep = asleep_capture("idle-1")
    failing = threading.Event()
    completions: list[bool] = []  # whether /metrics failed then

    def metrics(_request: Request) -> Response:
        if failing.is_set():
            return Response("starting", status=503)
        return Response(asleep, content_type="text/plain")

    def complete(_request: Request) -> Response:
        completions.append(failing.is_set())
        return Response(json.dumps({"choices": [{"text": "!"}]}), content_type="application/json")

    httpserver.expect_request("/metrics").respond_with_handler(metrics)
    httpserver.expect_request("/v1/models").respond_with_json({"data": [{"id": "tiny"}]})
    httpserver.expect_request("/v1/completions", method="POST").respond_with_handler(complete)
    state = tmp_path / "state.json"
    url = httpserver.url_for("").rstrip("/")
    first = check(entry_point, state, url)
    assert first.backend()["verdict"] == "idle", first.stdout
    failing.set()
    second = check(entry_point, state, url)
    assert second.backend()["verdict"] == "no_metrics", second.stdout
    assert completions == [], second.backend()["evidence"]
    assert "asleep" in second.backend()["evidence"]


@pytest.mark.slow
def test_a_backend_moved_off_a_server_read_asleep_is_asked_at_its_new_address(
    entry_point: str, tmp_path: Path, httpserver: HTTPServer
) -> None:
    """The record keeps the sleep of a server last read asleep, and a move keeps the
    sighting (the first read there shows a restart as such): that sleep was the old
    server's. A backend moved by a config edit onto a server whose /metrics has no vLLM
    series (HTTP 404) was never asked, `no_metrics` and exit 2 at every check for ever,
    and `route` sent it no client."""
    asleep = asleep_capture("idle-1")
    httpserver.expect_request("/metrics").respond_with_data(asleep, content_type="text/plain")
    httpserver.expect_request("/v1/models").respond_with_json({"data": [{"id": "tiny"}]})
    other = HTTPServer(host="127.0.0.1", port=0)
    other.expect_request("/metrics").respond_with_data("not here", status=404)
    other.expect_request("/v1/models").respond_with_json({"data": [{"id": "tiny"}]})
    other.expect_request("/v1/completions", method="POST").respond_with_json(
        {"choices": [{"text": "!"}]}
    )
    other.start()
    state = tmp_path / "state.json"
    config = tmp_path / "llmhealth.toml"

    def at(url: str) -> str:
        config.write_text(f'state = "{state}"\n[[backend]]\nname = "a"\nurl = "{url}"\n')
        return str(config)

    try:
        first = check(entry_point, state, "--config", at(httpserver.url_for("").rstrip("/")))
        assert first.backend()["verdict"] == "idle", first.stdout
        moved = check(entry_point, state, "--config", at(other.url_for("").rstrip("/")))
    finally:
        other.clear()
        other.stop()
    assert moved.backend()["verdict"] == "no_metrics", moved.stdout
    assert "tiny request answered" in moved.backend()["evidence"]
    assert moved.code == 0, moved.backend()["evidence"]


@pytest.mark.slow
def test_a_server_read_asleep_then_replaced_by_a_process_without_vllm_series_is_asked(
    entry_point: str, tmp_path: Path
) -> None:
    """A new process at the address starts awake: the sleep the record keeps was its
    predecessor's. vLLM started again with `--disable-log-stats` publishes no vLLM series
    (only the process collector's, with its own start time): kept asleep, it was never
    asked, routed to nor re-admitted, as the move the sleep fix mended."""
    asleep = asleep_capture()
    replaced = "# TYPE process_start_time_seconds gauge\nprocess_start_time_seconds 1.9e+09\n"
    metrics = [asleep]
    completions: list[bool] = []

    def serve_metrics(_request: Request) -> Response:
        return Response(metrics[0], content_type="text/plain")

    def complete(_request: Request) -> Response:
        completions.append(True)
        return Response(json.dumps({"choices": [{"text": "!"}]}), content_type="application/json")

    server = HTTPServer(host="127.0.0.1", port=0)
    server.expect_request("/metrics").respond_with_handler(serve_metrics)
    server.expect_request("/v1/models").respond_with_json({"data": [{"id": "tiny"}]})
    server.expect_request("/v1/completions", method="POST").respond_with_handler(complete)
    server.start()
    state = tmp_path / "state.json"
    url = server.url_for("").rstrip("/")
    try:
        first = check(entry_point, state, url)
        assert first.backend()["verdict"] == "idle", first.stdout
        metrics[0] = replaced
        second = check(entry_point, state, url)
        third = check(entry_point, state, url)  # and not only once
    finally:
        server.clear()
        server.stop()
    assert second.backend()["requests_sent"] == 1, second.backend()["evidence"]
    assert len(completions) == 2, third.backend()["evidence"]
    assert third.code == 0, third.backend()["evidence"]
