"""`llmhealth route` as operators run it: a real process over real simulated backends.

The story the router exists for: a backend whose engine keeps stepping (busy to every
probe) but which never answers a real request is condemned by traffic alone, after a
handful of client-visible failures, each bounded by first_byte_timeout.
"""

from __future__ import annotations

import contextlib
import http.server
import json
import os
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from captures import asleep_capture, put_to_sleep
from pytest_httpserver import HTTPServer
from routeproc import (
    BOUND,
    COMPLETION,
    FIRST_BYTE,
    free_port,
    idle_sockets,
    running_route,
    wait_closed_by_peer,
    write_config,
)
from simproc import child_env, running_simulator
from werkzeug import Request, Response

from llmhealth.router import connection_cap


def backend_state(route_url: str, name: str) -> str:
    states: dict[str, str] = httpx.get(route_url + "/health", timeout=5).json()["backends"]
    return states[name]


@pytest.mark.slow
@pytest.mark.usefixtures("each_loop")
def test_a_backend_busy_to_probes_but_failing_every_request_is_condemned_by_traffic(
    tmp_path: Path, entry_point: str
) -> None:
    with running_simulator(["busy+unanswered", "idle"], request_seconds=0.05) as sim:
        # "a" sorts first, so with nothing in flight every tie goes to the liar.
        config = write_config(tmp_path, {"a": sim.urls[0], "b": sim.urls[1]})
        with running_route(entry_point, config, free_port()) as route:
            failed, answered = [], 0
            deadline = time.monotonic() + BOUND
            while backend_state(route, "a") != "dead":
                assert time.monotonic() < deadline, "traffic never condemned the wedged backend"
                # BOUND only keeps a router that never gives up from hanging the test.
                response = httpx.post(route + "/v1/completions", json=COMPLETION, timeout=BOUND)
                if response.status_code == 200:
                    answered += 1
                    continue
                assert response.status_code == 500
                assert response.json()["backend"] == "a"
                failed.append(response.json()["error"])
            # A handful: one per settle until the streak reaches the threshold (3), as the
            # reflex drop keeps "a" out between settles.
            assert 3 <= len(failed) <= 4
            # Each failure ended by first_byte_timeout: the router gave up on the backend
            # that never answers, and said why, rather than waiting for it.
            assert set(failed) == {
                f"backend failed: no response headers within {FIRST_BYTE:g} s"
            }, failed
            for _ in range(5):  # after condemnation every client is answered
                reply = httpx.post(route + "/v1/completions", json=COMPLETION, timeout=BOUND)
                assert reply.status_code == 200
            metrics = httpx.get(route + "/metrics", timeout=5).text
            assert 'llmhealth_backend_state{backend="a",state="dead"} 1.0' in metrics
    document = json.loads((tmp_path / "state.json").read_text())
    (record,) = [b for b in document["ledger"]["backends"] if b["name"] == "a"]
    assert record["condemned_by"] == "request_failures"
    assert "first_byte_timeout" in record["last_error"]
    audit = [json.loads(line) for line in (tmp_path / "audit.jsonl").read_text().splitlines()]
    condemned = [line for line in audit if line.get("to") == "dead"]
    assert condemned and condemned[0]["backend"] == "a"
    assert condemned[0]["evidence"]["verdict"] == "request_failures"
    # The proof names every failed request of the streak, across the settles it spanned.
    requests = condemned[0]["evidence"]["requests"]
    assert len(requests) == 3
    assert all(r["failure"] == "first_byte_timeout" for r in requests)
    assert [r["at"] for r in requests] == sorted(r["at"] for r in requests)


@pytest.mark.slow
@pytest.mark.usefixtures("each_loop")
def test_a_request_failure_seen_while_settles_cannot_be_saved_reaches_the_ledger_after(
    tmp_path: Path, entry_point: str
) -> None:
    # The audit log cannot be opened (a full disk, a bad mount): every settle is skipped.
    # The failures it drained from the router were lost with it, so a backend failing
    # every request went back to the choice with a clean streak once the disk recovered.
    not_a_directory = tmp_path / "not-a-directory"
    not_a_directory.write_text("")
    audit = not_a_directory / "audit.jsonl"
    with running_simulator(["busy+unanswered", "idle"], request_seconds=0.05) as sim:
        config = write_config(tmp_path, {"a": sim.urls[0], "b": sim.urls[1]})
        config.write_text(f'audit_log = "{audit}"\n' + config.read_text())
        with running_route(entry_point, config, free_port()) as route:
            response = httpx.post(route + "/v1/completions", json=COMPLETION, timeout=BOUND)
            assert response.status_code == 500 and response.json()["backend"] == "a"
            time.sleep(2.0)  # four waits: the failure is drained by a settle that is skipped
            state = tmp_path / "state.json"
            assert saved_record(state, "a")["request_failures"] == 0  # nothing saved since
            not_a_directory.unlink()  # the disk is back
            not_a_directory.mkdir()
            saved = state.stat().st_mtime_ns
            deadline = time.monotonic() + BOUND
            for _ in range(2):  # two settles saved after it: the next one had the failure
                while state.stat().st_mtime_ns == saved:
                    assert time.monotonic() < deadline, "no settle saved after the disk came back"
                    time.sleep(0.05)
                saved = state.stat().st_mtime_ns
    record = saved_record(state, "a")
    assert record["request_failures"] == 1, record
    assert "first_byte_timeout" in record["last_error"]


def saved_record(state: Path, name: str) -> dict[str, object]:
    document = json.loads(state.read_text())
    (record,) = [b for b in document["ledger"]["backends"] if b["name"] == name]
    assert isinstance(record, dict)
    return record


@pytest.mark.slow
def test_route_refuses_to_start_without_backends_or_with_a_bad_address(
    tmp_path: Path, entry_point: str
) -> None:
    nothing = subprocess.run(
        [entry_point, "route"], capture_output=True, text=True, timeout=60, check=False
    )
    assert nothing.returncode == 3, nothing.stderr
    assert "nothing to route to" in nothing.stderr
    config = write_config(tmp_path, {"a": "http://127.0.0.1:9"})
    bad = subprocess.run(
        [entry_point, "route", "--config", str(config), "--listen", "nowhere"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert bad.returncode == 3, bad.stderr
    assert "'nowhere' is not HOST:PORT" in bad.stderr


@pytest.mark.slow
def test_at_its_file_limit_the_router_closes_the_longest_idle_connection_for_a_new_one(
    tmp_path: Path, entry_point: str
) -> None:
    # A router whose hard limit is 512 files holds (512 - 64 - 1) // 2 = 223 client
    # connections (half for requests in flight upstream): one that cannot raise its limit
    # must still answer every new client.
    with running_simulator(["idle"], request_seconds=0.05) as sim:
        config = write_config(tmp_path, {"a": sim.urls[0]})  # idle_timeout: the default 75 s
        port = free_port()
        pids: list[int] = []
        with running_route(entry_point, config, port, (512, 512), pids) as route:
            idle = idle_sockets(port, 600, route)
            try:
                # The oldest ones make room, at once (long before any idle timeout), and
                # each real client above was answered.
                evicted = len(idle) - connection_cap(512, 1)
                wait_closed_by_peer(idle[:evicted], evicted)
                reply = httpx.post(route + "/v1/completions", json=COMPLETION, timeout=BOUND)
                assert reply.status_code == 200
            finally:
                for sock in idle:
                    sock.close()


@pytest.mark.slow  # about 6 s: a real `route` over the simulator
def test_a_condemnation_by_traffic_is_in_the_daemons_log(tmp_path: Path, entry_point: str) -> None:
    # journald is what an operator reads of `llmhealth route`: each ledger move the probes
    # cause is logged there ("a: healthy -> dead: wedged: ..."), but one the router's
    # failed requests caused was not, so a backend came back "dead -> stale" in the log
    # without ever having gone.
    log = tmp_path / "route.log"
    with running_simulator(["busy+unanswered", "idle"], request_seconds=0.05) as sim:
        config = write_config(tmp_path, {"a": sim.urls[0], "b": sim.urls[1]})
        port = free_port()
        with log.open("wb") as stderr:
            process = subprocess.Popen(
                [entry_point, "route", "--config", str(config), "--listen", f"127.0.0.1:{port}"],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=stderr,
                env=child_env(),
            )
            try:
                route = f"http://127.0.0.1:{port}"
                deadline = time.monotonic() + BOUND
                while True:
                    assert process.poll() is None, log.read_text()
                    with contextlib.suppress(httpx.HTTPError):
                        if backend_state(route, "a") == "dead":
                            break
                        httpx.post(route + "/v1/completions", json=COMPLETION, timeout=BOUND)
                    assert time.monotonic() < deadline, "traffic never condemned the backend"
            finally:
                process.send_signal(signal.SIGTERM)
                try:
                    process.wait(15)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait(5)
    text = log.read_text()
    assert process.returncode == 0, text
    assert "a: suspect -> dead: request failure 3 in a row" in text, text


@pytest.mark.slow  # a few seconds: a real `route` over the simulator
@pytest.mark.usefixtures("each_loop")
def test_no_client_request_is_sent_to_a_server_asleep_on_purpose(
    tmp_path: Path, entry_point: str
) -> None:
    # A completion sent to a sleeping vLLM crashed it (vLLM #15483), which is why no tiny
    # request goes to one; the router forwarded clients' completions to it all the same (it
    # is healthy, idle as shown), and their failures condemned the sleeping server.
    with running_simulator(["asleep", "idle"], request_seconds=0.05) as sim:
        # "a" sorts first, so with nothing in flight every tie goes to the sleeper.
        config = write_config(tmp_path, {"a": sim.urls[0], "b": sim.urls[1]})
        with running_route(entry_point, config, free_port()) as route:
            deadline = time.monotonic() + BOUND
            settled = 'llmhealth_backend_verdict{backend="a",verdict="idle"} 1.0'
            while settled not in httpx.get(route + "/metrics", timeout=5).text:
                assert time.monotonic() < deadline, "the sleeping backend was never settled"
                time.sleep(0.05)
            failed = []
            for _ in range(12):  # several settles (a wait is 0.5 s): a streak would condemn it
                response = httpx.post(route + "/v1/completions", json=COMPLETION, timeout=BOUND)
                if response.status_code != 200:
                    failed.append(response.json().get("backend"))
                time.sleep(0.1)
            assert failed == [], failed
            assert backend_state(route, "a") == "healthy"


@pytest.mark.slow  # a few seconds: two real `route` runs
def test_no_client_request_is_sent_to_a_server_the_record_saw_asleep_while_its_metrics_fail(
    tmp_path: Path, entry_point: str, httpserver: HTTPServer
) -> None:
    """`route` started again over a server its record last read asleep on purpose, whose
    /metrics now answers HTTP 503: its verdict said "asleep on purpose", no tiny request
    went to it, but the router took it for awake (the verdict's own reads show no engine)
    and forwarded clients' completions to it, the crash of vLLM #15483. Nor was its tiny
    request withheld: the state file had kept the read's counters, not its sleep state."""
    asleep = asleep_capture("idle-1")
    failing = threading.Event()
    clients: list[bool] = []  # whether /metrics failed then

    def metrics(_request: Request) -> Response:
        if failing.is_set():
            return Response("starting", status=503)
        return Response(asleep, content_type="text/plain")

    def complete(request: Request) -> Response:
        if json.loads(request.get_data()).get("max_tokens") != 1:
            clients.append(failing.is_set())  # a client's, not the tiny request
        elif failing.is_set():
            clients.append(True)  # the tiny request, once nothing showed it awake
        return Response(json.dumps({"choices": [{"text": "!"}]}), content_type="application/json")

    httpserver.expect_request("/metrics").respond_with_handler(metrics)
    httpserver.expect_request("/v1/models").respond_with_json({"data": [{"id": "tiny"}]})
    httpserver.expect_request("/v1/completions", method="POST").respond_with_handler(complete)
    with running_simulator(["idle"], request_seconds=0.05) as sim:
        # "a" sorts first, so with nothing in flight every tie goes to the sleeper.
        config = write_config(tmp_path, {"a": httpserver.url_for("").rstrip("/"), "b": sim.urls[0]})
        for verdict in ("idle", "no_metrics"):
            with running_route(entry_point, config, free_port()) as route:
                deadline = time.monotonic() + BOUND
                settled = f'llmhealth_backend_verdict{{backend="a",verdict="{verdict}"}} 1.0'
                while settled not in httpx.get(route + "/metrics", timeout=5).text:
                    assert time.monotonic() < deadline, f"never settled {verdict}"
                    time.sleep(0.05)
                time.sleep(0.6)  # a settle after it, for the router's serving set
                for _ in range(6):
                    response = httpx.post(route + "/v1/completions", json=COMPLETION, timeout=BOUND)
                    assert response.status_code == 200
            failing.set()
    assert clients == [], f"{len(clients)} client completions sent to the sleeping server"


class _FailingFront(http.server.BaseHTTPRequestHandler):
    """In front of one simulated backend: answers 500 to the first ``failures`` client
    completions (the router's, ``max_tokens`` 2), then forwards everything (the tiny
    request, the reads of /metrics) to ``upstream`` as it is."""

    protocol_version = "HTTP/1.1"
    upstream = ""
    failures = 0

    def log_message(self, format: str, *args: object) -> None:
        pass

    def do_GET(self) -> None:
        self._forward(b"")

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        if json.loads(body).get("max_tokens") == COMPLETION["max_tokens"] and self.failures:
            type(self).failures -= 1
            self.send_response(500)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        self._forward(body)

    def _forward(self, body: bytes) -> None:
        response = httpx.request(
            self.command, self.upstream + self.path, content=body or None, timeout=BOUND
        )
        self.send_response(response.status_code)
        self.send_header("Content-Type", response.headers.get("content-type", "text/plain"))
        self.send_header("Content-Length", str(len(response.content)))
        self.end_headers()
        self.wfile.write(response.content)


@contextlib.contextmanager
def failing_front(upstream: str, failures: int) -> Iterator[str]:
    handler = type("Front", (_FailingFront,), {"upstream": upstream, "failures": failures})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


@pytest.mark.slow  # a few seconds: a real `route` over the simulator
def test_a_backend_condemned_by_traffic_comes_back_in_place_while_others_requests_land(
    tmp_path: Path, entry_point: str
) -> None:
    # Three failed requests condemn "a"; then its same process serves well. The router
    # sends it nothing (DEAD), and only an answered request clears the request-failure
    # streak, but the tiny request went to it only when no request had finished since the
    # last read: another client's short requests, landing between every two reads, kept it
    # DEAD for as long as they came, while every read proved the same process good.
    with (
        running_simulator(["idle", "idle"], request_seconds=0.05) as sim,
        failing_front(sim.urls[0], 3) as front,
    ):
        config = write_config(tmp_path, {"a": front, "b": sim.urls[1]})
        stop = threading.Event()

        def elsewhere() -> None:  # another client of a's server, straight to it
            while not stop.wait(0.15):
                with contextlib.suppress(httpx.HTTPError):
                    httpx.post(sim.urls[0] + "/v1/completions", json=COMPLETION, timeout=BOUND)

        other = threading.Thread(target=elsewhere)
        other.start()
        try:
            with running_route(entry_point, config, free_port()) as route:
                deadline = time.monotonic() + BOUND
                while backend_state(route, "a") != "dead":
                    assert time.monotonic() < deadline, "traffic never condemned a"
                    httpx.post(route + "/v1/completions", json=COMPLETION, timeout=BOUND)
                state = tmp_path / "state.json"
                while True:
                    assert time.monotonic() < deadline, "a never left DEAD nor proved itself"
                    record = saved_record(state, "a")
                    # Twice the good verdicts in a row its recovery needs (2), each proven
                    # by requests finishing on the condemned process: it had to be back.
                    if record["state"] != "dead" or int(str(record["good_streak"])) >= 4:
                        break
                    time.sleep(0.05)
        finally:
            stop.set()
            other.join()
    assert record["state"] != "dead", record


@pytest.mark.slow  # a few seconds: a real `route` over the simulator
def test_what_the_router_saw_since_the_last_settle_is_saved_on_the_way_out(
    tmp_path: Path, entry_point: str
) -> None:
    # Two failed requests left "a" SUSPECT, 2 request failures in a row; then a request it
    # answered broke the streak, and the router was stopped before the next settle. The
    # answer was dropped with the daemon: the state kept 2 in a row, and the next run's
    # first failure condemned "a", "request failure 3 in a row".
    state = tmp_path / "state.json"
    with (
        running_simulator(["idle", "idle"], request_seconds=0.05) as sim,
        failing_front(sim.urls[0], 2) as front,
    ):
        config = write_config(tmp_path, {"a": front, "b": sim.urls[1]})
        config.write_text(config.read_text().replace('wait = "0.5s"', 'wait = "1s"'))
        with running_route(entry_point, config, free_port()) as route:
            deadline = time.monotonic() + BOUND
            for failures in (1, 2):
                # "a" sorts first: it is sent the next request once back in the choice.
                while httpx.post(route + "/v1/completions", json=COMPLETION).status_code != 500:
                    assert time.monotonic() < deadline, "a was never sent a request"
                while (
                    not state.exists() or saved_record(state, "a")["request_failures"] != failures
                ):
                    assert time.monotonic() < deadline, "the failure was never settled"
                    time.sleep(0.05)
            while True:  # back in the choice after the settle: answered now
                assert time.monotonic() < deadline, "a never answered"
                response = httpx.post(route + "/v1/completions", json=COMPLETION)
                if response.headers.get("X-LLMHealth-Backend") == "a":
                    break
                time.sleep(0.05)
            assert response.status_code == 200
    record = saved_record(state, "a")
    assert record["request_failures"] == 0, record


@pytest.mark.slow  # a few seconds: two real `route` runs
def test_route_started_again_sends_no_client_request_to_a_server_its_record_saw_asleep(
    tmp_path: Path, entry_point: str
) -> None:
    """`route` pushes the saved record's serving set before any read; a server the record
    last read asleep on purpose was in it, and until its first verdict came (a slow
    /metrics: up to the read's timeout) clients' completions went to it, the crash of
    vLLM #15483, though no read had shown it awake."""
    asleep = asleep_capture("idle-1")
    slow, release = threading.Event(), threading.Event()
    clients: list[bool] = []

    def metrics(_request: Request) -> Response:
        if slow.is_set():
            release.wait(BOUND)  # the next run's first read waits for the test's clients
        return Response(asleep, content_type="text/plain")

    def complete(request: Request) -> Response:
        if json.loads(request.get_data()).get("max_tokens") != 1:
            clients.append(True)  # a client's, not the tiny request
        return Response(json.dumps({"choices": [{"text": "!"}]}), content_type="application/json")

    sleeper = HTTPServer(host="127.0.0.1", port=0, threaded=True)
    sleeper.expect_request("/metrics").respond_with_handler(metrics)
    sleeper.expect_request("/v1/models").respond_with_json({"data": [{"id": "tiny"}]})
    sleeper.expect_request("/v1/completions", method="POST").respond_with_handler(complete)
    sleeper.start()
    try:
        with running_simulator(["idle"], request_seconds=0.05) as sim:
            # "a" sorts first, so with nothing in flight every tie goes to the sleeper.
            url = sleeper.url_for("").rstrip("/")
            config = write_config(tmp_path, {"a": url, "b": sim.urls[0]})
            config.write_text(
                config.read_text().replace('wait = "0.5s"', 'timeout = "60s"\nwait = "0.5s"')
            )
            with running_route(entry_point, config, free_port()) as route:
                deadline = time.monotonic() + BOUND
                settled = 'llmhealth_backend_verdict{backend="a",verdict="idle"} 1.0'
                while settled not in httpx.get(route + "/metrics", timeout=5).text:
                    assert time.monotonic() < deadline, "never settled asleep"
                    time.sleep(0.05)
            slow.set()
            with running_route(entry_point, config, free_port()) as route:
                for _ in range(4):
                    response = httpx.post(route + "/v1/completions", json=COMPLETION, timeout=BOUND)
                    assert response.status_code == 200
                release.set()
    finally:
        release.set()
        sleeper.clear()
        sleeper.stop()
    assert clients == [], f"{len(clients)} client completions sent to the sleeping server"


@pytest.mark.slow  # a few seconds: a real `route` run
def test_no_client_request_is_sent_after_the_settle_after_an_undecided_read_shows_it_asleep(
    tmp_path: Path, entry_point: str
) -> None:
    """Data-parallel: engine 0 put to sleep on purpose as engine 1 took work (no counter
    moved yet: one more read decides, no verdict). README: no client request from the
    settle after a read shows it asleep; the router looked at verdicts only, and the
    settle after that read kept forwarding clients' completions to the server, which
    may route them to the sleeping engine (vLLM #15483)."""
    captures = Path(__file__).parent.parent / "fixtures" / "vllm-0.32"

    def engine_one(name: str) -> str:
        return "\n".join(
            line.replace('engine="0"', 'engine="1"')
            for line in (captures / f"{name}.txt").read_text().splitlines()
            if line.startswith("vllm:")
        )

    idle = (captures / "idle-1.txt").read_text()
    quiet = "\n".join(
        f"{line.rpartition(' ')[0]} 0.0"
        if line.startswith(("vllm:num_requests_running{", "vllm:num_requests_waiting"))
        else line
        for line in engine_one("wedge-1").splitlines()
    )
    awake = f"{idle}\n{quiet}\n"
    sleeping = f"{put_to_sleep(idle)}\n{engine_one('wedge-1')}\n"
    switch, release = threading.Event(), threading.Event()
    served: list[bool] = []  # asleep or not, per read served
    clients: list[bool] = []

    def metrics(_request: Request) -> Response:
        if switch.is_set():
            if any(served):
                release.wait(BOUND)  # later reads wait for the test's clients
            served.append(True)
            return Response(sleeping, content_type="text/plain")
        served.append(False)
        return Response(awake, content_type="text/plain")

    def complete(request: Request) -> Response:
        if json.loads(request.get_data()).get("max_tokens") != 1:
            clients.append(switch.is_set())
        return Response(json.dumps({"choices": [{"text": "!"}]}), content_type="application/json")

    sleeper = HTTPServer(host="127.0.0.1", port=0, threaded=True)
    sleeper.expect_request("/metrics").respond_with_handler(metrics)
    sleeper.expect_request("/v1/models").respond_with_json({"data": [{"id": "tiny"}]})
    sleeper.expect_request("/v1/completions", method="POST").respond_with_handler(complete)
    sleeper.start()
    try:
        with running_simulator(["idle"], request_seconds=0.05) as sim:
            url = sleeper.url_for("").rstrip("/")
            config = write_config(tmp_path, {"a": url, "b": sim.urls[0]})
            with running_route(entry_point, config, free_port()) as route:
                deadline = time.monotonic() + BOUND
                settled = 'llmhealth_backend_verdict{backend="a",verdict="idle"} 1.0'
                while settled not in httpx.get(route + "/metrics", timeout=5).text:
                    assert time.monotonic() < deadline, "never settled idle"
                    time.sleep(0.05)
                switch.set()
                while True:
                    assert time.monotonic() < deadline, "the asleep read never settled"
                    if any(served):  # the asleep read served, then heard and settled
                        n = len(served)
                        text = httpx.get(route + "/metrics", timeout=5).text
                        line = f'llmhealth_backend_examinations_total{{backend="a"}} {n}.0'
                        if line in text:
                            break
                    time.sleep(0.05)
                for _ in range(4):
                    response = httpx.post(route + "/v1/completions", json=COMPLETION, timeout=BOUND)
                    assert response.status_code == 200
                release.set()
    finally:
        release.set()
        sleeper.clear()
        sleeper.stop()
    assert [c for c in clients if c] == [], f"{len(clients)} client completions sent asleep"


class _SlowFront(_FailingFront):
    """As ``_FailingFront``, and each client completion after the failures waits
    ``delay`` seconds before it is forwarded (``arrived`` set as it comes)."""

    delay = 0.0
    arrived: threading.Event

    def do_POST(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length)
        client = json.loads(body).get("max_tokens") == COMPLETION["max_tokens"]
        if client and self.failures:
            type(self).failures -= 1
            self.send_response(500)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        if client:
            self.arrived.set()
            time.sleep(self.delay)
        self._forward(body)


@pytest.mark.slow  # a few seconds: a real `route` over the simulator
def test_a_request_answered_while_the_router_stops_is_saved_on_the_way_out(
    tmp_path: Path, entry_point: str
) -> None:
    # As above, but the answered request that breaks the streak is still in flight when
    # SIGTERM comes: the router lets it end (its drain) after the last settle took what
    # it had seen, and the answer was dropped with the daemon, the streak kept at 2.
    state = tmp_path / "state.json"
    arrived = threading.Event()
    with running_simulator(["idle", "idle"], request_seconds=0.05) as sim:
        handler = type(
            "Front",
            (_SlowFront,),
            {"upstream": sim.urls[0], "failures": 2, "delay": 1.0, "arrived": arrived},
        )
        server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
        serving = threading.Thread(target=server.serve_forever)
        serving.start()
        try:
            front = f"http://127.0.0.1:{server.server_address[1]}"
            config = write_config(tmp_path, {"a": front, "b": sim.urls[1]}, first_byte=5.0)
            config.write_text(config.read_text().replace('wait = "0.5s"', 'wait = "1s"'))
            pids: list[int] = []
            answers: list[httpx.Response] = []
            with running_route(entry_point, config, free_port(), started=pids) as route:
                deadline = time.monotonic() + BOUND
                for failures in (1, 2):
                    while httpx.post(route + "/v1/completions", json=COMPLETION).status_code != 500:
                        assert time.monotonic() < deadline, "a was never sent a request"
                    while not state.exists() or (
                        saved_record(state, "a")["request_failures"] != failures
                    ):
                        assert time.monotonic() < deadline, "the failure was never settled"
                        time.sleep(0.05)
                while not arrived.is_set():  # back in the choice after the settle
                    assert time.monotonic() < deadline, "a never answered"
                    asking = threading.Thread(
                        target=lambda: answers.append(
                            httpx.post(route + "/v1/completions", json=COMPLETION, timeout=BOUND)
                        )
                    )
                    asking.start()
                    if arrived.wait(0.5):
                        break
                    asking.join()
                os.kill(pids[0], signal.SIGTERM)  # while a's answer is on its way
                asking.join()
        finally:
            server.shutdown()
            server.server_close()
            serving.join()
    assert answers[-1].status_code == 200
    assert answers[-1].headers.get("X-LLMHealth-Backend") == "a"
    record = saved_record(state, "a")
    assert record["request_failures"] == 0, record
