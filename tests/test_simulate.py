"""`llmhealth simulate` as real processes on 127.0.0.1: each mode seen from outside, over HTTP."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from simproc import LAUNCH, Simulator, child_env, running_simulator

from llmhealth.metrics import EngineSignals, parse_metrics

CAPTURES = Path(__file__).resolve().parent.parent / "fixtures" / "vllm-0.32"
CONTENT_TYPE = "text/plain; version=1.0.0; charset=utf-8"
SHORT = 0.3  # a client timeout that a hung request runs into
ENGINE0 = {"engine": "0", "model_name": "tiny"}
TINY = {"model": "tiny", "prompt": "hello there", "max_tokens": 1}
_BODY = json.dumps(TINY).encode()
POST_TINY = b"POST /v1/completions HTTP/1.1\r\nContent-Length: %d\r\n\r\n%s" % (len(_BODY), _BODY)

FLEET = [
    "idle",
    "busy",
    "prefill",
    "wedge:1",
    "unanswered",
    "hang",
    "restart:1.5",
    "no-metrics",
    "multiproc",
    "asleep",
    "busy+multiproc",
]

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


@pytest.fixture(scope="module")
def fleet() -> Iterator[Simulator]:
    with running_simulator(FLEET, max_num_seqs=4, request_seconds=4.0) as sim:
        yield sim
        assert sim.stop() == 0
        # Whatever the tests did, the simulator logged no error of its own.
        assert sim.stderr() == ""


@pytest.fixture(scope="module")
def client() -> Iterator[httpx.Client]:
    # One client for the module: building one (and its TLS context) costs tens of ms.
    with httpx.Client(timeout=5.0) as c:
        yield c


def samples(text: str) -> Samples:
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def value(got: Samples, name: str, **labels: str) -> float:
    return got[(name, frozenset({**ENGINE0, **labels}.items()))]


def metrics(client: httpx.Client, url: str) -> Samples:
    reply = client.get(f"{url}/metrics")
    assert reply.status_code == 200
    return samples(reply.text)


def progress(got: Samples) -> tuple[float, ...]:
    names = ("iteration_tokens_total_count", "generation_tokens_total", "prompt_tokens_total")
    return (
        *(value(got, f"vllm:{n}") for n in names),
        value(got, "vllm:request_success_total", finished_reason="length"),
    )


def stats(client: httpx.Client, url: str) -> dict[str, Any]:
    reply = client.get(f"{url}/sim/stats")
    assert reply.status_code == 200
    result: dict[str, Any] = reply.json()
    return result


def poll(check: Callable[[], bool], seconds: float = 6.0, every: float = 0.1) -> None:
    deadline = time.monotonic() + seconds
    while not check():
        if time.monotonic() > deadline:
            pytest.fail(f"condition not met within {seconds} s")
        time.sleep(every)


def times_out(
    client: httpx.Client, url: str, path: str = "/v1/completions", timeout: float = SHORT
) -> bool:
    try:
        if path == "/v1/completions":
            client.post(f"{url}{path}", json=TINY, timeout=timeout)
        else:
            client.get(f"{url}{path}", timeout=timeout)
    except httpx.ReadTimeout:
        return True
    return False


# --- startup, shape and size ---------------------------------------------------------------


def test_each_backend_is_announced_in_order_on_consecutive_ports(fleet: Simulator) -> None:
    ports = [int(url.rsplit(":", 1)[1]) for url in fleet.urls]
    assert ports == list(range(ports[0], ports[0] + len(FLEET)))
    assert all(url.startswith("http://127.0.0.1:") for url in fleet.urls)


@pytest.mark.parametrize(
    ("mode", "capture"),
    [
        ("idle", "idle-1.txt"),
        ("busy", "busy-2.txt"),
        ("prefill", "prefill-2.txt"),
        ("wedge:1", "wedge-2.txt"),
        ("restart:1.5", "restart-1.txt"),
        ("multiproc", "multiapi-idle-1.txt"),
        ("busy+multiproc", "multiapi-after-load.txt"),
    ],
)
def test_the_metrics_text_parses_and_is_as_large_as_a_real_one(
    fleet: Simulator, client: httpx.Client, mode: str, capture: str
) -> None:
    reply = client.get(f"{fleet.url(mode)}/metrics")
    assert reply.status_code == 200
    assert reply.headers["content-type"] == CONTENT_TYPE
    assert list(text_string_to_metric_families(reply.text))
    real = (CAPTURES / capture).stat().st_size
    assert 0.7 * real <= len(reply.content) <= 1.3 * real


def test_the_api_answers_like_vllm(fleet: Simulator, client: httpx.Client) -> None:
    url = fleet.url("idle")
    models = client.get(f"{url}/v1/models").json()
    assert models["object"] == "list"
    assert [(m["id"], m["object"]) for m in models["data"]] == [("tiny", "model")]
    assert client.get(f"{url}/version").json() == {"version": "0.32.0"}
    health = client.get(f"{url}/health")
    assert (health.status_code, health.content) == (200, b"")
    assert client.get(f"{url}/nothing/here").status_code == 404
    assert client.post(f"{url}/metrics").status_code == 405
    assert client.post(f"{url}/v1/completions", json={**TINY, "model": "other"}).status_code == 404
    assert client.post(f"{url}/v1/completions", content=b"{not json").status_code == 400


# --- modes ---------------------------------------------------------------------------------


def test_an_idle_backend_answers_a_tiny_request_and_counts_it(
    fleet: Simulator, client: httpx.Client
) -> None:
    url = fleet.url("idle")
    counted_before = stats(client, url)
    before = metrics(client, url)
    assert value(before, "vllm:num_requests_running") == 0
    assert value(before, "vllm:num_requests_waiting") == 0
    assert progress(metrics(client, url)) == progress(before)
    reply = client.post(f"{url}/v1/completions", json=TINY)
    assert reply.status_code == 200
    body = reply.json()
    assert body["object"] == "text_completion"
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == 1
    steps, generated, prompt, finished = progress(metrics(client, url))
    old_steps, old_generated, old_prompt, old_finished = progress(before)
    assert (steps, generated, finished) == (old_steps + 1, old_generated + 1, old_finished + 1)
    assert prompt == old_prompt + body["usage"]["prompt_tokens"]
    counted = stats(client, url)
    assert counted["mode"] == "idle"
    grew = {
        key: counted[key] - counted_before[key]
        for key in counted
        if key not in ("mode", "start_time")
    }
    assert grew == {
        "completions_received": 1,
        "completions_answered": 1,
        "metrics_reads": 3,
        "models_reads": 0,
        "restarts": 0,
    }
    # The simulated process really started then, an hour after its /metrics says (--age).
    assert counted["start_time"] == counted_before["start_time"]
    claimed = before[("process_start_time_seconds", frozenset())]
    assert claimed == pytest.approx(counted["start_time"] - 3600.0, abs=0.01)


def test_a_busy_backend_makes_progress_with_work_present(
    fleet: Simulator, client: httpx.Client
) -> None:
    url = fleet.url("busy")
    first = metrics(client, url)
    time.sleep(0.2)
    second = metrics(client, url)
    assert value(second, "vllm:num_requests_running") == 4
    assert value(second, "vllm:num_requests_waiting") == 8
    steps, generated, prompt, finished = progress(second)
    assert steps > progress(first)[0]
    assert generated > progress(first)[1]
    assert (prompt, finished) >= progress(first)[2:]
    assert value(second, "vllm:kv_cache_usage_perc") != value(first, "vllm:kv_cache_usage_perc")


def test_a_completion_to_a_busy_backend_waits_in_its_queue(
    fleet: Simulator, client: httpx.Client
) -> None:
    url = fleet.url("busy")
    assert times_out(client, url)
    counted = stats(client, url)
    assert (counted["completions_received"], counted["completions_answered"]) == (1, 0)


def test_a_prefilling_backend_moves_only_its_kv_use(fleet: Simulator, client: httpx.Client) -> None:
    url = fleet.url("prefill")
    first = metrics(client, url)
    time.sleep(0.1)
    second = metrics(client, url)
    assert progress(first) == progress(second)
    assert value(second, "vllm:num_requests_running") > 0
    assert value(second, "vllm:num_requests_waiting") > 0
    assert value(second, "vllm:kv_cache_usage_perc") != value(first, "vllm:kv_cache_usage_perc")


def test_a_wedged_backend_freezes_yet_keeps_answering_reads(
    fleet: Simulator, client: httpx.Client
) -> None:
    url = fleet.url("wedge:1")
    reads: list[Samples] = [metrics(client, url)]

    def frozen() -> bool:
        reads.append(metrics(client, url))
        return reads[-1] == reads[-2]

    poll(frozen, every=0.2)
    assert value(reads[-1], "vllm:num_requests_running") > 0
    assert value(reads[-1], "vllm:num_requests_waiting") > 0
    assert value(reads[-1], "vllm:iteration_tokens_total_count") > 0
    assert client.get(f"{url}/health").status_code == 200
    assert client.get(f"{url}/v1/models").status_code == 200
    assert times_out(client, url)
    assert metrics(client, url) == reads[-1]


def test_an_unanswered_backend_shows_no_work_and_never_answers(
    fleet: Simulator, client: httpx.Client
) -> None:
    url = fleet.url("unanswered")
    got = metrics(client, url)
    assert value(got, "vllm:num_requests_running") == 0
    assert value(got, "vllm:num_requests_waiting") == 0
    assert client.get(f"{url}/v1/models").status_code == 200
    assert times_out(client, url)


def test_a_hung_backend_accepts_connections_but_never_answers(
    fleet: Simulator, client: httpx.Client
) -> None:
    url = fleet.url("hang")
    assert times_out(client, url, "/metrics")


def test_a_backend_without_metrics_still_serves(fleet: Simulator, client: httpx.Client) -> None:
    url = fleet.url("no-metrics")
    assert client.get(f"{url}/metrics").status_code == 404
    assert client.get(f"{url}/v1/models").status_code == 200
    assert client.post(f"{url}/v1/completions", json=TINY).status_code == 200


def test_multiprocess_mode_hides_the_process_and_the_gauges_until_a_request(
    fleet: Simulator, client: httpx.Client
) -> None:
    url = fleet.url("multiproc")
    text = client.get(f"{url}/metrics").text
    for absent in ("process_start_time_seconds", "python_", "_created", "num_requests_running"):
        assert absent not in text
    assert "vllm:generation_tokens_total{" in text
    assert client.post(f"{url}/v1/completions", json=TINY).status_code == 200
    assert value(metrics(client, url), "vllm:num_requests_running") == 0


def test_multiprocess_mode_with_a_load_shows_work_but_no_start_time(
    fleet: Simulator, client: httpx.Client
) -> None:
    text = client.get(f"{fleet.url('busy+multiproc')}/metrics").text
    assert "process_start_time_seconds" not in text
    assert value(samples(text), "vllm:num_requests_running") == 4


def test_an_asleep_backend_reports_its_sleep_state(fleet: Simulator, client: httpx.Client) -> None:
    got = metrics(client, fleet.url("asleep"))
    assert value(got, "vllm:engine_sleep_state", sleep_state="awake") == 0
    assert value(got, "vllm:engine_sleep_state", sleep_state="weights_offloaded") == 1
    assert value(got, "vllm:num_requests_running") == 0


def test_a_restarting_backend_changes_its_start_time_and_resets_its_counters(
    fleet: Simulator, client: httpx.Client
) -> None:
    url = fleet.url("restart:1.5")
    start: tuple[str, frozenset[tuple[str, str]]] = ("process_start_time_seconds", frozenset())
    labels = frozenset({**ENGINE0, "finished_reason": "length"}.items())
    success = "vllm:request_success_total", labels
    counted: list[Samples] = []

    def counted_in_one_process() -> bool:
        before = metrics(client, url)
        try:
            answered = client.post(f"{url}/v1/completions", json=TINY).status_code == 200
        except httpx.RemoteProtocolError:
            return False  # the simulated process restarted under the request: try again
        counted.append(metrics(client, url))
        return answered and counted[-1][start] == before[start]

    poll(counted_in_one_process)
    assert counted[-1][success] >= 1
    restarted: list[Samples] = []

    def new_process() -> bool:
        restarted.append(metrics(client, url))
        return restarted[-1][start] != counted[-1][start]

    poll(new_process)
    assert restarted[-1][start] > counted[-1][start]
    assert restarted[-1][success] == 0
    created = "vllm:request_success_created", labels
    assert restarted[-1][created] != counted[-1][created]


# --- HTTP edges ----------------------------------------------------------------------------


def connect(url: str) -> socket.socket:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    return socket.create_connection((host, int(port)), timeout=5)


def raw_exchange(url: str, payload: bytes, reads: int = 1) -> bytes:
    with connect(url) as sock:
        sock.sendall(payload)
        received = b""
        while received.count(b"HTTP/1.1 ") < reads:
            chunk = sock.recv(65536)
            if not chunk:
                break
            received += chunk
        return received


def test_keep_alive_serves_several_requests_on_one_connection(fleet: Simulator) -> None:
    request = b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"
    received = raw_exchange(fleet.url("idle"), request * 3, reads=3)
    assert received.count(b"HTTP/1.1 200 OK\r\n") == 3


def test_an_idle_connection_is_closed_after_the_keep_alive_it_was_given(fleet: Simulator) -> None:
    # The module's fleet keeps vLLM's 5 s; this one closes after 0.3 s. Both connections
    # are answered once, then left idle: the short one must close first, the other stay.
    request = b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"
    with (
        running_simulator(["idle"], keep_alive=0.3) as short,
        connect(short.url("idle")) as brief,
        connect(fleet.url("idle")) as kept,
    ):
        for sock in (brief, kept):
            sock.sendall(request)
            assert sock.recv(65536).startswith(b"HTTP/1.1 200 OK\r\n")
        brief.settimeout(10)
        assert brief.recv(1) == b""  # closed by the server
        kept.setblocking(False)
        with pytest.raises(BlockingIOError):
            kept.recv(1)  # still open, nothing to read
        assert short.stop() == 0


def test_oversized_headers_and_bodies_are_refused(fleet: Simulator) -> None:
    url = fleet.url("idle")
    huge_header = b"GET /health HTTP/1.1\r\nX-Big: " + b"a" * 70_000 + b"\r\n\r\n"
    assert raw_exchange(url, huge_header).startswith(b"HTTP/1.1 431 ")
    huge_body = b"POST /v1/completions HTTP/1.1\r\nContent-Length: 2000000\r\n\r\n{"
    assert raw_exchange(url, huge_body).startswith(b"HTTP/1.1 413 ")
    chunked = b"POST /v1/completions HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n"
    assert raw_exchange(url, chunked).startswith(b"HTTP/1.1 501 ")
    assert raw_exchange(url, b"NONSENSE\r\n\r\n").startswith(b"HTTP/1.1 400 ")


# --- data-parallel engines -----------------------------------------------------------------


def test_each_engine_reports_separately_and_wedge_one_freezes_only_the_last() -> None:
    with (
        running_simulator(["busy", "wedge-one:0.3"], engines=2) as sim,
        httpx.Client(timeout=5.0) as client,
    ):
        busy = client.get(f"{sim.url('busy')}/metrics").text
        running = [
            s.labels["engine"]
            for family in text_string_to_metric_families(busy)
            for s in family.samples
            if s.name == "vllm:num_requests_running"
        ]
        assert running == ["0", "1"]
        url = sim.url("wedge-one:0.3")

        def steps(got: Samples, engine: str) -> float:
            labels = frozenset({"engine": engine, "model_name": "tiny"}.items())
            return got[("vllm:iteration_tokens_total_count", labels)]

        reads: list[Samples] = [metrics(client, url)]

        def last_engine_frozen() -> bool:
            reads.append(metrics(client, url))
            return steps(reads[-1], "1") == steps(reads[-2], "1")

        poll(last_engine_frozen, every=0.2)
        time.sleep(0.1)
        again = metrics(client, url)
        assert steps(again, "1") == steps(reads[-1], "1")
        assert steps(again, "0") > steps(reads[-1], "0")


# --- proxy ---------------------------------------------------------------------------------


@pytest.mark.slow
def test_a_proxy_forwards_to_the_least_busy_backend_and_has_no_metrics() -> None:
    with running_simulator(["unanswered", "idle"]) as backends:
        proxy_mode = "proxy:" + ",".join(backends.urls)
        with running_simulator([proxy_mode]) as proxy, httpx.Client(timeout=5.0) as client:
            url = proxy.urls[0]
            assert client.get(f"{url}/metrics").status_code == 404
            models = client.get(f"{url}/v1/models")
            assert models.status_code == 200
            assert models.json()["data"][0]["id"] == "tiny"
            # The models read went to the first backend, so on a tie the first completion goes
            # to the second and the next one to the first, where it hangs.
            assert client.post(f"{url}/v1/completions", json=TINY).status_code == 200
            with connect(url) as stuck:
                stuck.sendall(POST_TINY)
                poll(lambda: stats(client, backends.urls[0])["completions_received"] == 1)
                # While it hangs there, fewest connections sends every other request elsewhere.
                for _ in range(3):
                    assert client.post(f"{url}/v1/completions", json=TINY).status_code == 200
            assert stats(client, backends.urls[1])["completions_answered"] == 4
            assert stats(client, backends.urls[0])["completions_received"] == 1
            forwarded = stats(client, url)
            assert (forwarded["completions_received"], forwarded["completions_answered"]) == (5, 4)


def test_a_proxy_forwards_any_header_value_and_refuses_a_target_it_cannot_forward() -> None:
    # Before: a header value of obs-text (a byte over 0x7f, legal HTTP: a UTF-8 name)
    # and a control character in the target were each answered 500, with a traceback on
    # the simulator's stderr, where the backend itself answered.
    with (
        running_simulator(["idle"]) as backend,
        running_simulator([f"proxy:{backend.urls[0]}"]) as proxy,
    ):
        url = proxy.urls[0]
        named = b"GET /v1/models HTTP/1.1\r\nX-User: Jos\xc3\xa9\r\nConnection: close\r\n\r\n"
        assert raw_exchange(url, named).startswith(b"HTTP/1.1 200 ")
        control = b"GET /v1/models\x01 HTTP/1.1\r\nConnection: close\r\n\r\n"
        assert raw_exchange(url, control).startswith(b"HTTP/1.1 400 ")
        assert "Traceback" not in proxy.stderr()


# --- process lifecycle ---------------------------------------------------------------------


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_stops_the_simulator_cleanly_even_with_clients_waiting(signum: int) -> None:
    with running_simulator(["idle", "hang", "busy"]) as sim, ExitStack() as open_sockets:
        for url in sim.urls:
            open_sockets.enter_context(connect(url)).sendall(POST_TINY)
        time.sleep(0.2)  # let the requests arrive and start waiting
        assert sim.stop(signum) == 0
        assert sim.stderr() == ""


def run_simulator_briefly(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*LAUNCH, *args],
        capture_output=True,
        text=True,
        timeout=20,
        check=False,
        env=child_env(),
    )


@pytest.mark.parametrize(
    ("args", "complaint"),
    [
        (["bogus"], "unknown mode"),
        (["idle", "--engines=0"], "engines"),
        (["idle", "idle", "--port=65535"], "not all valid TCP ports"),
    ],
)
def test_bad_input_exits_3_with_a_message(args: list[str], complaint: str) -> None:
    done = run_simulator_briefly(*args)
    assert done.returncode == 3
    assert complaint in done.stderr
    assert done.stdout == ""


def test_a_taken_port_is_reported() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = run_simulator_briefly("idle", f"--port={port}")
    assert done.returncode == 3
    assert "cannot listen" in done.stderr


def test_a_restart_request_brings_a_new_process_in_the_mode_asked(client: httpx.Client) -> None:
    with running_simulator(["wedge:0.1"]) as sim:
        url = sim.urls[0]
        before = metrics(client, url)
        assert value(before, "vllm:num_requests_running") > 0
        answer = client.post(f"{url}/sim/restart", json={"mode": "idle"})
        assert answer.status_code == 200, answer.text
        after = metrics(client, url)
        start = ("process_start_time_seconds", frozenset[tuple[str, str]]())
        assert after[start] > before[start]
        assert value(after, "vllm:num_requests_running") == 0
        assert value(after, "vllm:iteration_tokens_total_count") == 0
        done = client.post(
            f"{url}/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 1}
        )
        assert done.status_code == 200
        assert client.get(f"{url}/sim/stats").json()["restarts"] == 1
        refused = client.post(f"{url}/sim/restart", json={"mode": "multiproc"})
        assert refused.status_code == 400
        assert client.post(f"{url}/sim/restart", json={"mode": "bogus"}).status_code == 400
        assert client.post(f"{url}/sim/restart", json={"age": -1}).status_code == 400
        assert client.post(f"{url}/sim/restart", json={"age": "old"}).status_code == 400


def test_a_restarted_process_is_young_unless_it_is_given_an_age(client: httpx.Client) -> None:
    """The simulator's first process says it has been up an hour; a restart aged as much
    had its wedge proven in two waits, where a real restart gets its startup window."""
    start = ("process_start_time_seconds", frozenset[tuple[str, str]]())
    with running_simulator(["idle"]) as sim:
        url = sim.urls[0]
        assert metrics(client, url)[start] < time.time() - 3000
        assert client.post(f"{url}/sim/restart", json={"mode": "idle"}).status_code == 200
        assert metrics(client, url)[start] > time.time() - 60
        assert client.post(f"{url}/sim/restart", json={"age": 600}).status_code == 200
        assert time.time() - 700 < metrics(client, url)[start] < time.time() - 500


def test_metrics_can_be_made_to_hang_and_answer_again_from_the_same_process(
    client: httpx.Client,
) -> None:
    with running_simulator(["busy"]) as sim:
        url = sim.urls[0]
        before = metrics(client, url)
        assert client.post(f"{url}/sim/metrics", json={"hang": True}).json() == {
            "metrics_hang": True
        }
        with pytest.raises(httpx.ReadTimeout):
            client.get(f"{url}/metrics", timeout=0.5)
        # Everything else still answers: only /metrics is paused.
        assert client.get(f"{url}/v1/models").status_code == 200
        assert client.post(f"{url}/sim/metrics", json={"hang": False}).status_code == 200
        after = metrics(client, url)
        start = ("process_start_time_seconds", frozenset[tuple[str, str]]())
        assert after[start] == before[start]  # the same process, its counters still climbing
        steps = "vllm:iteration_tokens_total_count"
        assert value(after, steps) >= value(before, steps)
        for bad in ({"hang": "yes"}, {}, []):
            assert client.post(f"{url}/sim/metrics", json=bad).status_code == 400


@pytest.mark.slow
def test_a_hung_backend_still_takes_its_control_requests_and_a_restart_revives_it(
    client: httpx.Client,
) -> None:
    """A frozen API server is what a restart command is for; /sim/restart, which stands
    in for one, hung with the rest of a `hang` backend (and once a restart had made one,
    for good), so a restart command timed out where a real restart brings it back."""
    request = b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"
    with running_simulator(["hang"], keep_alive=0.3) as sim:
        url = sim.urls[0]
        assert times_out(client, url, "/health")
        assert client.get(f"{url}/sim/stats", timeout=2.0).json()["mode"] == "hang"
        answer = client.post(f"{url}/sim/restart", json={"mode": "idle"}, timeout=2.0)
        assert answer.status_code == 200, answer.text
        assert client.post(f"{url}/v1/completions", json=TINY).status_code == 200
        with connect(url) as idle:  # and it keeps its keep-alive, as the idle one it is
            idle.sendall(request)
            assert idle.recv(65536).startswith(b"HTTP/1.1 200 OK\r\n")
            assert idle.recv(1) == b""  # closed by the server
        assert client.post(f"{url}/sim/restart", json={"mode": "hang"}).status_code == 200
        assert times_out(client, url, "/metrics")
        assert client.post(f"{url}/sim/restart", json={"mode": "busy"}).status_code == 200
        assert client.get(f"{url}/metrics").status_code == 200


def test_a_process_shows_the_prefill_time_of_the_prompts_it_read(client: httpx.Client) -> None:
    """The prefill time was the template's fixed 0.10 s whatever the prompts: a restarted
    process that had read none showed it (a real new one shows 0, restart-2.txt), and
    after one 1-token prompt llmhealth learned "prefill 100 ms per prompt token", a
    0.8 s step, where the real server took 0.05 s a request (busy-0.txt)."""

    def engine(body: bytes) -> EngineSignals:
        return parse_metrics(body).engines[0]

    real_new = engine((CAPTURES / "restart-2.txt").read_bytes())
    real_served = engine((CAPTURES / "busy-0.txt").read_bytes())
    assert real_served.prefill_seconds and real_served.prompt_tokens
    with running_simulator(["busy"]) as sim:
        url = sim.urls[0]
        assert client.post(f"{url}/sim/restart", json={"mode": "idle"}).status_code == 200
        fresh = engine(client.get(f"{url}/metrics").content)
        assert fresh.prefill_seconds == real_new.prefill_seconds == 0
        assert client.post(f"{url}/v1/completions", json=TINY).status_code == 200
        served = engine(client.get(f"{url}/metrics").content)
    assert served.prefill_seconds and served.prompt_tokens and served.finished == 1
    # Per request, as the real server's prefill time goes (busy-0.txt: two short prompts
    # in 0.10 s; chunk-1.txt: one of 2,000 tokens in 0.10 s), not per prompt token.
    assert real_served.finished
    assert served.prefill_seconds == pytest.approx(
        real_served.prefill_seconds / real_served.finished
    )


def test_a_restart_whose_age_is_no_number_of_seconds_is_refused(client: httpx.Client) -> None:
    """An integer age too large for a float was taken, and every /metrics after it
    answered 500 with a traceback; `true` was taken for one second."""
    with running_simulator(["idle"]) as sim:
        url = sim.urls[0]
        for bad in ('{"age": 1' + "0" * 400 + "}", '{"age": true}'):
            answer = client.post(f"{url}/sim/restart", content=bad)
            assert answer.status_code == 400, answer.text
        assert client.get(f"{url}/metrics").status_code == 200
        assert client.get(f"{url}/sim/stats").json()["restarts"] == 0
        assert sim.stop() == 0
        assert sim.stderr() == ""


def test_a_body_json_cannot_take_is_refused_not_a_crash(client: httpx.Client) -> None:
    """Bodies under the 1 MiB cap that json itself cannot take (100,000 nested brackets:
    RecursionError; an integer of 5,000 digits: a ValueError that is no JSONDecodeError)
    or that the prompt count recursed into answered 500, each with a traceback on the
    simulator's stderr, at every endpoint that reads JSON; vLLM answers 400."""
    deep = b"[" * 100_000
    big = b"1" * 5_000
    nested_prompt = b'{"prompt": ' + b"[" * 900 + b"1" + b"]" * 900 + b"}"
    bodies = {
        "/v1/completions": [deep, b'{"max_tokens": ' + big + b"}", nested_prompt],
        "/sim/metrics": [deep, b'{"hang": ' + big + b"}"],
        "/sim/restart": [deep, b'{"age": ' + big + b"}"],
    }
    with running_simulator(["idle"]) as sim:
        url = sim.urls[0]
        for path, payloads in bodies.items():
            for body in payloads:
                answer = client.post(f"{url}{path}", content=body)
                assert answer.status_code == 400, (path, body[:20], answer.text)
        assert client.post(f"{url}/v1/completions", json=TINY).status_code == 200
        assert sim.stop() == 0
        assert sim.stderr() == ""
