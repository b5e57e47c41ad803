"""Every verdict against real HTTP servers on 127.0.0.1: pytest-httpserver and raw sockets."""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import json
import socket
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

import pytest
from captures import put_to_sleep
from pytest_httpserver import HTTPServer
from werkzeug import Request, Response

import llmhealth.metrics as metrics_module
from llmhealth.classify import (
    Answer,
    Outcome,
    Read,
    ReadProblem,
    TakeRead,
    Target,
    Verdict,
    VerdictKind,
    decide,
)
from llmhealth.fleet import events_for
from llmhealth.ledger import State
from llmhealth.localcpu import LocalCpu
from llmhealth.metrics import EngineSignals, Signals, parse_metrics
from llmhealth.probe import (
    KEEP_ALIVE_LEAD,
    ProbeSettings,
    ask_tiny,
    check_fleet,
    examine_backend,
    examine_once,
    keep_read,
    new_client,
    read_metrics,
    seconds_argument,
    with_birth,
)
from llmhealth.report import ExitCode, verdict_exit_code
from llmhealth.shares import verdict_from_dict, verdict_to_dict
from llmhealth.text import printable
from llmhealth.window import DEFAULT_RULES, LongestStep

CAPTURES = Path(__file__).parent.parent / "fixtures" / "vllm-0.32"
FAST = ProbeSettings(wait=0.0, timeout=1.0, answer_timeout=1.0)
MODELS = {"object": "list", "data": [{"id": "tiny", "object": "model"}]}
COMPLETION = {"id": "cmpl-1", "object": "text_completion", "choices": [{"index": 0, "text": "!"}]}


def capture(name: str) -> str:
    return (CAPTURES / f"{name}.txt").read_text()


class FakeClock:
    """Reads get timestamps five seconds apart, as if the real wait had passed."""

    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        self.now += 5.0


class Backend:
    """A vLLM-like HTTP backend whose /metrics walks through captures in order."""

    def __init__(self, server: HTTPServer, texts: list[str], completion_ok: bool = True) -> None:
        self.texts = texts
        self.metrics_reads = 0
        self.completions = 0
        self.completion_ok = completion_ok
        server.expect_request("/metrics").respond_with_handler(self._metrics)
        server.expect_request("/v1/models").respond_with_json(MODELS)
        server.expect_request("/v1/completions", method="POST").respond_with_handler(self._complete)
        self.url = server.url_for("").rstrip("/")

    def _metrics(self, _request: Request) -> Response:
        text = self.texts[min(self.metrics_reads, len(self.texts) - 1)]
        self.metrics_reads += 1
        return Response(text, content_type="text/plain; version=1.0.0; charset=utf-8")

    def _complete(self, request: Request) -> Response:
        self.completions += 1
        body = json.loads(request.get_data())
        assert body["max_tokens"] == 1
        assert body["model"] == "tiny"
        if not self.completion_ok:
            return Response('{"error": "engine dead"}', status=500)
        return Response(json.dumps(COMPLETION), content_type="application/json")


def examine(url: str, settings: ProbeSettings = FAST, **target: str) -> Verdict:
    clock = FakeClock()

    async def run() -> Verdict:
        async with new_client() as client:
            return await examine_backend(
                client, Target("b", url, **target), settings, clock=clock, sleep=clock.sleep
            )

    return asyncio.run(run())


def test_a_busy_server_is_judged_busy_and_never_sent_a_request(httpserver: HTTPServer) -> None:
    backend = Backend(httpserver, [capture("busy-1"), capture("busy-2")])
    verdict = examine(backend.url)
    assert verdict.kind is VerdictKind.BUSY
    assert verdict.healthy
    assert (verdict.running, verdict.waiting) == (4, 8)
    assert verdict.steps_per_s == pytest.approx(684 / 5)
    assert verdict.tokens_per_s == pytest.approx((6065 - 3329) / 5)
    assert verdict.requests_sent == 0
    assert backend.completions == 0
    assert backend.metrics_reads == 2


def test_a_sleep_state_longer_than_any_is_not_written_into_the_verdict(
    httpserver: HTTPServer,
) -> None:
    """The sleep state a server names goes into the verdict ("asleep on purpose (engine 0
    ...)"), and from there to the table, the state, the audit and etcd: 200,000 characters
    of it went there whole, as a long engine label no longer does."""
    state = "x" * 200_000
    text = (
        capture("idle-1")
        .replace('sleep_state="awake"} 1.0', 'sleep_state="awake"} 0.0')
        .replace('sleep_state="weights_offloaded"} 0.0', f'sleep_state="{state}"}} 1.0')
    )
    backend = Backend(httpserver, [text])
    verdict = examine(backend.url)
    assert len(verdict.evidence) < 1_000
    assert state not in verdict.evidence


def test_a_wedged_server_takes_three_reads_and_no_request(httpserver: HTTPServer) -> None:
    backend = Backend(httpserver, [capture("wedge-1"), capture("wedge-2"), capture("wedge-3")])
    verdict = examine(backend.url)
    assert verdict.kind is VerdictKind.WEDGED
    assert not verdict.healthy
    assert "steps 8660→8660→8660" in verdict.evidence
    assert backend.metrics_reads == 3
    assert backend.completions == 0


def test_a_pause_of_one_wait_is_only_stalled_when_reads_run_out(httpserver: HTTPServer) -> None:
    backend = Backend(httpserver, [capture("wedge-1"), capture("wedge-2")])
    settings = ProbeSettings(wait=0.0, timeout=1.0, answer_timeout=1.0, max_reads=2)
    verdict = examine(backend.url, settings)
    assert verdict.kind is VerdictKind.STALLED
    assert backend.completions == 0


def _slow_lookups(monkeypatch: pytest.MonkeyPatch, seconds: float) -> None:
    """The name ``slow.test`` is 127.0.0.1, found after ``seconds``: a slow DNS server, or
    a lookup queued behind hundreds in the event loop's few threads."""
    real = socket.getaddrinfo

    def getaddrinfo(host: str, *args: object, **kwargs: object) -> object:
        if host == "slow.test":
            time.sleep(seconds)
            host = "127.0.0.1"
        return real(host, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)


def test_a_name_slow_to_look_up_is_not_the_servers_time(
    httpserver: HTTPServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A check of hundreds of backends by name queued their lookups in asyncio's six
    threads; the last ran out of time before connecting and were judged ``down``."""
    _slow_lookups(monkeypatch, 0.6)
    backend = Backend(httpserver, [capture("busy-1"), capture("busy-2")])
    url = backend.url.replace("127.0.0.1", "slow.test").replace("localhost", "slow.test")
    verdict = examine(url, replace(FAST, timeout=0.4))
    assert verdict.kind is VerdictKind.BUSY, verdict.evidence


def test_a_name_that_takes_longer_than_the_reads_grace_leaves_the_server_not_judged(
    httpserver: HTTPServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    _slow_lookups(monkeypatch, 1.2)
    backend = Backend(httpserver, [capture("busy-1")])
    url = backend.url.replace("127.0.0.1", "slow.test").replace("localhost", "slow.test")
    verdict = examine(url, replace(FAST, timeout=0.25))  # given up at 1 s: four times
    assert not verdict.judged, verdict.evidence
    assert "the name slow.test took" in verdict.evidence
    assert backend.metrics_reads == 0


@pytest.mark.parametrize(
    ("failure", "judged", "said"),
    [
        (socket.EAI_AGAIN, False, "could not be looked up for now"),
        (socket.EAI_NONAME, True, "name does not resolve"),
    ],
)
def test_a_lookup_that_fails_for_now_judges_nothing_and_a_name_that_is_not_one_is_down(
    monkeypatch: pytest.MonkeyPatch, failure: int, judged: bool, said: str
) -> None:
    """A DNS server out of reach made every backend by name ``down`` at once, and three
    such runs condemned a working fleet; a name that does not exist is still the read's
    failure."""

    def getaddrinfo(host: str, *args: object, **kwargs: object) -> object:
        raise socket.gaierror(failure, "lookup failed")

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    verdict = examine("http://backend.test:8000")
    assert verdict.judged is judged, verdict.evidence
    assert said in verdict.evidence
    if judged:
        assert verdict.kind is VerdictKind.DOWN


def test_an_idle_server_gets_exactly_one_tiny_request(httpserver: HTTPServer) -> None:
    backend = Backend(httpserver, [capture("idle-1")])
    verdict = examine(backend.url)
    assert verdict.kind is VerdictKind.IDLE
    assert verdict.healthy
    assert verdict.requests_sent == 1
    assert backend.completions == 1
    assert backend.metrics_reads == 1


def test_a_reader_that_may_not_ask_judges_an_idle_server_by_its_metrics_and_says_so(
    httpserver: HTTPServer,
) -> None:
    backend = Backend(httpserver, [capture("idle-1")])
    settings = replace(FAST, unasked="a standby leaves the tiny request to the leader")

    async def once() -> Verdict | None:
        async with new_client() as client:
            return await examine_once(
                client, Target("b", backend.url), settings, [], clock=FakeClock()
            )

    verdict = asyncio.run(once())
    assert verdict is not None and verdict.kind is VerdictKind.IDLE and verdict.healthy
    assert verdict.answer is None and verdict.requests_sent == 0
    assert "no request sent: a standby leaves the tiny request to the leader" in verdict.evidence
    assert backend.completions == 0


# Idle at both reads, its engine moved between them: someone else's request came and went.
MOVED_BY_OTHERS = ["apifreeze-0", "apifreeze-after"]
# Busy, then idle: the work finished, and the engine moved.
FINISHED = ["apifreeze-pre", "apifreeze-after"]


def watch_twice(url: str, settings: ProbeSettings) -> Verdict | None:
    """Two of watch's examinations of one backend, a wait apart: the second's verdict.
    (The first, of one idle read, asks in any case: nothing yet shows the engine move.)"""
    clock: FakeClock = FakeClock()
    window: list[Read] = []

    async def twice() -> Verdict | None:
        async with new_client() as client:
            target = Target("b", url)
            await examine_once(client, target, settings, window, clock=clock)
            return await examine_once(client, target, settings, window, clock=clock)

    return asyncio.run(twice())


def test_an_idle_server_moved_by_someone_else_s_request_is_not_asked_while_it_serves(
    httpserver: HTTPServer,
) -> None:
    backend = Backend(httpserver, [capture(name) for name in MOVED_BY_OTHERS])
    verdict = watch_twice(backend.url, FAST)
    assert verdict is not None and verdict.kind is VerdictKind.IDLE and verdict.healthy
    assert "progressed" in verdict.evidence and "no request sent" in verdict.evidence
    assert verdict.answer is None and backend.completions == 1


def test_an_idle_server_awaiting_readmission_is_asked_though_someone_else_moved_it(
    httpserver: HTTPServer,
) -> None:
    # A STALE backend re-enters only by an answered tiny request: were it judged by its
    # counters, a trickle of others' requests (a second checker, a client of its own)
    # would keep it out of the serving set for as long as it lasts.
    backend = Backend(httpserver, [capture(name) for name in MOVED_BY_OTHERS])
    verdict = watch_twice(backend.url, replace(FAST, awaiting_answer=frozenset({"b"})))
    assert verdict is not None and verdict.kind is VerdictKind.IDLE and verdict.healthy
    assert verdict.answer is not None and verdict.answer.ok
    assert "progressed" in verdict.evidence and "tiny request answered" in verdict.evidence
    assert backend.completions == 2


def test_a_standby_asks_no_server_even_one_awaiting_readmission(httpserver: HTTPServer) -> None:
    backend = Backend(httpserver, [capture(name) for name in MOVED_BY_OTHERS])
    settings = replace(
        FAST, awaiting_answer=frozenset({"b"}), unasked="a standby leaves the tiny request"
    )
    verdict = watch_twice(backend.url, settings)
    assert verdict is not None and verdict.answer is None and backend.completions == 0
    # Judged by its counters, as a serving one: not a question it may not ask.
    assert "progressed" in verdict.evidence and "a standby" not in verdict.evidence


def test_a_retired_server_is_read_but_never_asked(httpserver: HTTPServer) -> None:
    """Out for good until a reset: nothing it answers is used, and its server may be
    serving someone else by now, so neither check nor watch takes one of its slots."""
    backend = Backend(httpserver, [capture("idle-1")])
    retired = replace(FAST, retired=frozenset({"b"}))
    verdict = examine(backend.url, retired)
    assert verdict.kind is VerdictKind.IDLE and verdict.answer is None
    assert "no request sent: it is retired; only a reset brings it back" in verdict.evidence
    assert watch_twice(backend.url, retired) is not None
    assert backend.completions == 0 and backend.metrics_reads > 0
    # Another backend's retirement is not this one's.
    assert examine(backend.url, replace(FAST, retired=frozenset({"other"}))).answer is not None
    assert backend.completions == 1


def test_check_asks_a_server_awaiting_readmission_whose_work_just_finished(
    httpserver: HTTPServer,
) -> None:
    backend = Backend(httpserver, [capture(name) for name in FINISHED])
    assert examine(backend.url).answer is None and backend.completions == 0
    backend.metrics_reads = 0
    verdict = examine(backend.url, replace(FAST, awaiting_answer=frozenset({"b"})))
    assert verdict.kind is VerdictKind.BUSY and verdict.healthy
    assert verdict.answer is not None and verdict.answer.ok and backend.completions == 1


def test_a_busy_server_awaiting_readmission_is_still_sent_no_request(
    httpserver: HTTPServer,
) -> None:
    backend = Backend(httpserver, [capture("busy-1"), capture("busy-2")])
    verdict = examine(backend.url, replace(FAST, awaiting_answer=frozenset({"b"})))
    assert verdict.kind is VerdictKind.BUSY and verdict.answer is None
    assert backend.completions == 0


def test_an_idle_server_that_fails_the_tiny_request_is_unanswered(httpserver: HTTPServer) -> None:
    backend = Backend(httpserver, [capture("idle-1")], completion_ok=False)
    verdict = examine(backend.url)
    assert verdict.kind is VerdictKind.UNANSWERED
    assert "HTTP 500" in verdict.evidence


@pytest.mark.parametrize(
    ("models", "completion", "said"),
    [
        (401, 200, "not sent: GET /v1/models answered HTTP 401"),
        (200, 401, "answered HTTP 401 for model tiny"),
        (403, 200, "not sent: GET /v1/models answered HTTP 403"),
    ],
)
def test_a_tiny_request_turned_away_for_its_key_judges_nothing(
    httpserver: HTTPServer, models: int, completion: int, said: str
) -> None:
    """vLLM with --api-key and a key missing or rotated: every idle backend was
    "unanswered", doubt that condemned a healthy fleet. Not judged now: UNKNOWN, no event."""
    httpserver.expect_request("/metrics").respond_with_data(capture("idle-1"))
    if models == 200:
        httpserver.expect_request("/v1/models").respond_with_json(MODELS)
    else:
        httpserver.expect_request("/v1/models").respond_with_json({"error": "no"}, status=models)
    httpserver.expect_request("/v1/completions", method="POST").respond_with_json(
        {"error": "Unauthorized"}, status=completion
    )
    verdict = examine(httpserver.url_for("").rstrip("/"))
    assert (verdict.kind, verdict.healthy, verdict.judged) == (VerdictKind.IDLE, False, False)
    assert said in verdict.evidence and "api_key_env" in verdict.evidence
    assert verdict_exit_code(verdict) is ExitCode.UNKNOWN
    assert events_for(verdict, State.HEALTHY, now=1.0, previous=None) == []
    shared = verdict_from_dict(verdict_to_dict(verdict), "verdict")
    assert (shared.judged, shared.answer is not None and shared.answer.refused) == (False, True)


@pytest.mark.parametrize(
    "answer",
    [{"choices": [None], "error": "out of memory"}, {"choices": [{}]}, {"choices": [0]}],
    ids=["null", "empty", "number"],
)
def test_a_200_that_completed_nothing_is_unanswered(
    httpserver: HTTPServer, answer: dict[str, object]
) -> None:
    # Any non-empty "choices" list counted as an answer, "out of memory" included.
    httpserver.expect_request("/metrics").respond_with_data(capture("idle-1"))
    httpserver.expect_request("/v1/models").respond_with_json(MODELS)
    httpserver.expect_request("/v1/completions", method="POST").respond_with_json(answer)
    verdict = examine(httpserver.url_for("").rstrip("/"))
    assert verdict.kind is VerdictKind.UNANSWERED
    assert "answered 200 without a completion" in verdict.evidence


@pytest.mark.parametrize(
    "listed",
    [[[[["tiny"]]]], 42, "x" * 5000, ""],
    ids=["nested list", "number", "too long", "empty"],
)
def test_a_model_id_that_is_not_a_name_is_no_model_list(
    httpserver: HTTPServer, listed: object
) -> None:
    # str() of anything was taken for a name: a list 900 deep was sent as the model, and
    # an id of 170,000 characters went whole into every status line, state and audit.
    httpserver.expect_request("/metrics").respond_with_data(capture("idle-1"))
    httpserver.expect_request("/v1/models").respond_with_json({"data": [{"id": listed}]})
    completions = httpserver.expect_request("/v1/completions", method="POST")
    completions.respond_with_json(COMPLETION)
    verdict = examine(httpserver.url_for("").rstrip("/"))
    assert verdict.kind is VerdictKind.UNANSWERED
    assert "not sent: GET /v1/models did not send a model list" in verdict.evidence


def test_a_tiny_request_that_never_answers_is_unanswered_within_the_timeout(
    httpserver: HTTPServer,
) -> None:
    release = threading.Event()
    httpserver.expect_request("/metrics").respond_with_data(capture("idle-1"))
    httpserver.expect_request("/v1/models").respond_with_json(MODELS)

    def hang(_request: Request) -> Response:
        release.wait(5)
        return Response("late")

    httpserver.expect_request("/v1/completions").respond_with_handler(hang)
    settings = ProbeSettings(wait=0.0, timeout=1.0, answer_timeout=0.3)
    try:
        verdict = examine(httpserver.url_for("").rstrip("/"), settings)
    finally:
        release.set()
    assert verdict.kind is VerdictKind.UNANSWERED
    assert "within 0.3 s" in verdict.evidence


def test_a_restart_between_reads_is_judged_by_the_tiny_request(httpserver: HTTPServer) -> None:
    # busy-3 has work; restart-1 is a fresh process (new start time) with none.
    backend = Backend(httpserver, [capture("busy-3"), capture("restart-1")])
    verdict = examine(backend.url)
    assert verdict.kind is VerdictKind.RESTARTED
    assert verdict.healthy
    assert backend.completions == 1
    assert "process start time" in verdict.evidence


def test_metrics_that_answer_404_are_no_metrics_judged_by_the_tiny_request(
    httpserver: HTTPServer,
) -> None:
    httpserver.expect_request("/metrics").respond_with_data("not here", status=404)
    httpserver.expect_request("/v1/models").respond_with_json(MODELS)
    httpserver.expect_request("/v1/completions").respond_with_json(COMPLETION)
    verdict = examine(httpserver.url_for("").rstrip("/"))
    assert verdict.kind is VerdictKind.NO_METRICS
    assert verdict.healthy
    assert "HTTP 404" in verdict.evidence
    assert verdict.requests_sent == 1


def test_an_html_error_page_is_no_metrics_not_a_crash(httpserver: HTTPServer) -> None:
    httpserver.expect_request("/metrics").respond_with_data(
        "<html><body>502 Bad Gateway</body></html>", content_type="text/html"
    )
    httpserver.expect_request("/v1/models").respond_with_data("<html>oops</html>", status=502)
    verdict = examine(httpserver.url_for("").rstrip("/"))
    assert verdict.kind is VerdictKind.NO_METRICS
    assert not verdict.healthy
    assert "text/html" in verdict.evidence
    assert "HTTP 502" in verdict.evidence


def test_a_redirect_is_not_followed(httpserver: HTTPServer) -> None:
    httpserver.expect_request("/metrics").respond_with_data(
        "", status=302, headers={"Location": "http://elsewhere.invalid/metrics"}
    )
    httpserver.expect_request("/v1/models").respond_with_json(MODELS)
    httpserver.expect_request("/v1/completions").respond_with_json(COMPLETION)
    verdict = examine(httpserver.url_for("").rstrip("/"))
    assert verdict.kind is VerdictKind.NO_METRICS
    assert "redirected (302) to http://elsewhere.invalid/metrics; not followed" in verdict.evidence


def test_a_not_modified_answer_without_a_location_is_said_as_its_status_not_a_redirect(
    httpserver: HTTPServer,
) -> None:
    # It read "GET /metrics redirected (304) to ?; not followed": no redirect, no target.
    httpserver.expect_request("/metrics").respond_with_data("", status=304)
    read = asyncio.run(_read_once(httpserver.url_for("").rstrip("/"), FAST))
    assert read.problem is ReadProblem.UNUSABLE
    assert read.detail == "GET /metrics answered HTTP 304"


def test_a_multiple_choices_answer_is_a_redirect_not_followed(httpserver: HTTPServer) -> None:
    # 300 is a redirection too (RFC 9110 15.4): its Location is named, not followed.
    httpserver.expect_request("/metrics").respond_with_data(
        "", status=300, headers={"Location": "http://elsewhere.invalid/metrics"}
    )
    read = asyncio.run(_read_once(httpserver.url_for("").rstrip("/"), FAST))
    assert read.problem is ReadProblem.UNUSABLE
    assert "redirected (300) to http://elsewhere.invalid/metrics; not followed" in read.detail


def test_metrics_answered_with_any_2xx_are_read(httpserver: HTTPServer) -> None:
    # As a proxy's model list: a front that marks its answers 203 still sent the text.
    httpserver.expect_request("/metrics").respond_with_data(capture("busy-1"), status=203)
    read = asyncio.run(_read_once(httpserver.url_for("").rstrip("/"), FAST))
    assert read.problem is None, read.detail
    assert read.signals is not None and read.signals.has_vllm


def test_a_body_over_the_cap_is_cut_off_and_named(httpserver: HTTPServer) -> None:
    httpserver.expect_request("/metrics").respond_with_data(capture("busy-2"))
    httpserver.expect_request("/v1/models").respond_with_json(MODELS)
    httpserver.expect_request("/v1/completions").respond_with_json(COMPLETION)
    settings = ProbeSettings(wait=0.0, timeout=1.0, answer_timeout=1.0, max_body=10_000)
    verdict = examine(httpserver.url_for("").rstrip("/"), settings)
    assert verdict.kind is VerdictKind.NO_METRICS
    assert "more than the 10000 bytes cap" in verdict.evidence


def test_a_refused_connection_is_down() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    verdict = examine(f"http://127.0.0.1:{port}")
    assert verdict.kind is VerdictKind.DOWN
    assert verdict.evidence == "down: connection refused"


def test_a_port_that_accepts_but_never_answers_is_unresponsive() -> None:
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)  # the kernel completes the handshake; nobody ever reads
        port = listener.getsockname()[1]
        settings = ProbeSettings(wait=0.0, timeout=0.3, answer_timeout=0.3)
        verdict = examine(f"http://127.0.0.1:{port}", settings)
    assert verdict.kind is VerdictKind.UNRESPONSIVE
    assert "connected, but no complete HTTP answer within 0.3 s" in verdict.evidence


@contextmanager
def raw_server(serve: Callable[[socket.socket], None]) -> Iterator[str]:
    """A one-connection-at-a-time TCP server whose behaviour the test writes by hand."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    listener.settimeout(0.1)
    stop = threading.Event()

    def loop() -> None:
        while not stop.is_set():
            try:
                connection, _ = listener.accept()
            except TimeoutError:
                continue
            with connection:
                connection.settimeout(2)
                try:
                    connection.recv(65536)
                    serve(connection)
                except OSError:
                    pass

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{listener.getsockname()[1]}"
    finally:
        stop.set()
        thread.join(5)
        listener.close()


def test_a_server_that_closes_mid_body_is_down_with_the_bytes_received() -> None:
    def half(connection: socket.socket) -> None:
        connection.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 50000\r\n\r\n" + b"x" * 1000)

    with raw_server(half) as url:
        verdict = examine(url)
    assert verdict.kind is VerdictKind.DOWN
    assert "mid-body after 1000 bytes" in verdict.evidence


def test_a_server_that_trickles_bytes_cannot_hold_a_read_past_its_timeout() -> None:
    stop = threading.Event()

    def trickle(connection: socket.socket) -> None:
        connection.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 100000\r\n\r\n")
        while not stop.wait(0.05):
            connection.sendall(b"v")

    settings = ProbeSettings(wait=0.0, timeout=0.5, answer_timeout=0.5)
    try:
        with raw_server(trickle) as url:
            verdict = examine(url, settings)
    finally:
        stop.set()
    assert verdict.kind is VerdictKind.UNRESPONSIVE
    assert "bytes received" in verdict.evidence


def test_tls_to_a_plain_http_server_is_down_and_says_tls(httpserver: HTTPServer) -> None:
    httpserver.expect_request("/metrics").respond_with_data(capture("idle-1"))
    url = httpserver.url_for("").rstrip("/").replace("http://", "https://")
    verdict = examine(url)
    assert verdict.kind is VerdictKind.DOWN
    assert "TLS" in verdict.evidence


def test_the_api_key_is_sent_as_a_bearer_token(httpserver: HTTPServer) -> None:
    httpserver.expect_request("/metrics").respond_with_data(capture("idle-1"))
    httpserver.expect_request(
        "/v1/models", headers={"Authorization": "Bearer s3cret"}
    ).respond_with_json(MODELS)
    httpserver.expect_request(
        "/v1/completions", headers={"Authorization": "Bearer s3cret"}
    ).respond_with_json(COMPLETION)
    verdict = examine(httpserver.url_for("").rstrip("/"), api_key="s3cret")
    assert verdict.kind is VerdictKind.IDLE


def test_a_proxy_is_asked_only_for_its_model_list(httpserver: HTTPServer) -> None:
    httpserver.expect_request("/v1/models").respond_with_json(MODELS)
    proxy = Target("lb", httpserver.url_for("").rstrip("/"), "proxy")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        dead_port = sock.getsockname()[1]
    dead = Target("lb2", f"http://127.0.0.1:{dead_port}", "proxy")
    outcomes = asyncio.run(check_fleet([proxy, dead], FAST))
    assert [o.verdict.kind for o in outcomes] == [VerdictKind.UP, VerdictKind.DOWN]
    assert [request.path for request, _ in httpserver.log] == ["/v1/models"]


def test_a_proxy_is_up_by_any_2xx_with_a_model_list(httpserver: HTTPServer) -> None:
    # DESIGN: "answered 2xx with a model list"; only a 200 was read, and a balancer that
    # marks its answers 203 (Non-Authoritative Information) was `down`.
    httpserver.expect_request("/v1/models").respond_with_json(MODELS, status=203)
    proxy = Target("lb", httpserver.url_for("").rstrip("/"), "proxy")
    (outcome,) = asyncio.run(check_fleet([proxy], FAST))
    assert outcome.verdict.kind is VerdictKind.UP, outcome.verdict.evidence


@pytest.mark.parametrize(("length", "up"), [(1024, True), (1025, False)])
def test_a_listed_model_id_is_at_most_1024_characters(
    httpserver: HTTPServer, length: int, up: bool
) -> None:
    httpserver.expect_request("/v1/models").respond_with_json({"data": [{"id": "m" * length}]})
    proxy = Target("lb", httpserver.url_for("").rstrip("/"), "proxy")
    (outcome,) = asyncio.run(check_fleet([proxy], FAST))
    assert (outcome.verdict.kind is VerdictKind.UP) == up, outcome.verdict.evidence


def test_an_expected_model_is_asked_for_as_the_server_lists_it(httpserver: HTTPServer) -> None:
    # A configured model is printable, so one listed with a no-break space is written
    # "tiny\\xa0x"; asked for so, the server has no such model and an idle backend failed.
    listed = "tiny\u00a0x"
    asked = []

    def complete(request: Request) -> Response:
        asked.append(json.loads(request.get_data())["model"])
        return Response(json.dumps(COMPLETION), content_type="application/json")

    httpserver.expect_request("/v1/models").respond_with_json({"data": [{"id": listed}]})
    httpserver.expect_request("/v1/completions").respond_with_handler(complete)
    target = Target("b", httpserver.url_for("").rstrip("/"), model=printable(listed))

    async def run() -> Answer:
        async with new_client() as client:
            return await ask_tiny(client, target, FAST, FakeClock())

    answer = asyncio.run(run())
    assert answer.ok, answer.detail
    assert asked == [listed]


def test_a_tiny_request_no_connection_took_is_not_counted_as_sent() -> None:
    # The model list answered and its server gone at once: the completion never went out.
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]

    def answer_the_list_then_go() -> None:
        connection, _ = listener.accept()
        listener.close()  # before the list is sent: the completion's connection is refused
        with connection:
            connection.settimeout(5)
            while b"\r\n\r\n" not in connection.recv(65536):
                pass
            body = json.dumps(MODELS).encode()
            connection.sendall(
                b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: %d\r\n\r\n%s"
                % (len(body), body)
            )

    server = threading.Thread(target=answer_the_list_then_go)
    server.start()

    async def run() -> Answer:
        async with new_client() as client:
            return await ask_tiny(
                client, Target("b", f"http://127.0.0.1:{port}"), FAST, FakeClock()
            )

    try:
        answer = asyncio.run(run())
    finally:
        server.join(5)
        listener.close()
    assert not answer.ok
    assert "connection refused" in answer.detail
    assert not answer.sent


def test_a_proxy_that_turns_our_key_away_is_not_judged_down(httpserver: HTTPServer) -> None:
    # It answers: our key failed, not the proxy. "down" paged as a failed balancer.
    httpserver.expect_request("/v1/models").respond_with_json({"error": "no"}, status=401)
    proxy = Target("lb", httpserver.url_for("").rstrip("/"), "proxy")
    (outcome,) = asyncio.run(check_fleet([proxy], FAST))
    assert not outcome.verdict.judged and "api_key_env" in outcome.verdict.evidence
    assert verdict_exit_code(outcome.verdict) is ExitCode.UNKNOWN


def test_a_proxy_the_checker_could_not_read_is_not_judged_down(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Its name could not be looked up for now: the evidence said "the server was not
    # judged", and the verdict was a judged `down`, CRITICAL as a failed balancer.
    def getaddrinfo(host: str, *args: object, **kwargs: object) -> object:
        raise socket.gaierror(socket.EAI_AGAIN, "lookup failed")

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    proxy = Target("lb", "http://lb.test:8000", "proxy")
    (outcome,) = asyncio.run(check_fleet([proxy], FAST))
    assert not outcome.verdict.judged, outcome.verdict.evidence
    assert "could not be looked up for now" in outcome.verdict.evidence
    assert verdict_exit_code(outcome.verdict) is ExitCode.UNKNOWN


# --- hostile servers: every one is a verdict, within the same bounds -----------------

NESTED = "[" * 200_000  # 200 KB, far under the body caps, deeper than any recursion limit


def test_a_deeply_nested_model_list_is_a_verdict_with_evidence(httpserver: HTTPServer) -> None:
    httpserver.expect_request("/metrics").respond_with_data("no metrics here", status=404)
    httpserver.expect_request("/v1/models").respond_with_data(
        NESTED, content_type="application/json"
    )
    verdict = examine(httpserver.url_for("").rstrip("/"))
    assert verdict.kind is VerdictKind.NO_METRICS
    assert not verdict.healthy
    assert "GET /v1/models did not send a model list" in verdict.evidence


def test_a_deeply_nested_completion_is_unanswered_not_a_crash(httpserver: HTTPServer) -> None:
    httpserver.expect_request("/metrics").respond_with_data(capture("idle-1"))
    httpserver.expect_request("/v1/models").respond_with_json(MODELS)
    httpserver.expect_request("/v1/completions").respond_with_data(
        '{"choices": ' + NESTED, content_type="application/json"
    )
    verdict = examine(httpserver.url_for("").rstrip("/"))
    assert verdict.kind is VerdictKind.UNANSWERED
    assert "answered 200 without a completion" in verdict.evidence


def test_a_hostile_backend_does_not_cost_its_neighbours_their_verdicts(
    httpserver: HTTPServer,
) -> None:
    healthy = HTTPServer(host="127.0.0.1")
    healthy.start()
    try:
        Backend(healthy, [capture("busy-1"), capture("busy-2")])
        httpserver.expect_request("/metrics").respond_with_data("", status=404)
        httpserver.expect_request("/v1/models").respond_with_data(NESTED)
        hostile = Target("hostile", httpserver.url_for("").rstrip("/"))
        neighbour = Target("neighbour", healthy.url_for("").rstrip("/"))
        proxy = Target("lb", hostile.url, "proxy")
        outcomes = asyncio.run(check_fleet([hostile, neighbour, proxy], FAST))
    finally:
        healthy.clear()
        healthy.stop()
    assert [(o.target.name, o.verdict.kind) for o in outcomes] == [
        ("hostile", VerdictKind.NO_METRICS),
        ("neighbour", VerdictKind.BUSY),
        ("lb", VerdictKind.DOWN),
    ]


def test_an_exception_while_judging_becomes_that_backends_verdict(
    httpserver: HTTPServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A bug of ours, simulated where no server input can reach yet: still one verdict."""
    Backend(httpserver, [capture("busy-1"), capture("busy-2")])

    def broken_decide(*_args: object, **_kwargs: object) -> None:
        raise RecursionError("maximum recursion depth exceeded")

    monkeypatch.setattr("llmhealth.probe.decide", broken_decide)
    verdict = examine(httpserver.url_for("").rstrip("/"))
    assert verdict.kind is VerdictKind.NO_METRICS
    assert not verdict.healthy
    assert "not judged: examining it raised RecursionError" in verdict.evidence


def test_a_parser_failure_makes_the_read_unusable_not_the_check(
    httpserver: HTTPServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    Backend(httpserver, [capture("idle-1")])

    def broken_parse(_body: bytes) -> None:
        raise ValueError("a parser bug")

    monkeypatch.setattr("llmhealth.probe.parse_metrics", broken_parse)
    verdict = examine(httpserver.url_for("").rstrip("/"))
    assert verdict.kind is VerdictKind.NO_METRICS
    assert verdict.healthy  # judged by the tiny request, which was answered
    assert "could not be read (ValueError: a parser bug)" in verdict.evidence


def test_every_request_asks_for_the_identity_encoding(httpserver: HTTPServer) -> None:
    backend = Backend(httpserver, [capture("idle-1")])
    examine(backend.url)
    paths = [
        (request.path, request.headers.get("Accept-Encoding")) for request, _ in httpserver.log
    ]
    assert paths == [
        ("/metrics", "identity"),
        ("/v1/models", "identity"),
        ("/v1/completions", "identity"),
    ]


def gzip_bomb(layers: int) -> bytes:
    """64 MiB of zeros, compressed ``layers`` times: a few dozen KB on the wire."""
    body = b"\0" * (64 * 1024 * 1024)
    for _ in range(layers):
        body = gzip.compress(body, compresslevel=9)
    return body


@pytest.mark.parametrize(("encoding", "layers"), [("gzip, gzip", 2), ("gzip", 1), ("br", 0)])
def test_a_compressed_body_is_unusable_and_never_inflated(
    httpserver: HTTPServer, encoding: str, layers: int
) -> None:
    body = gzip_bomb(layers) if layers else b"\x1b\x00" * 100
    httpserver.expect_request("/metrics").respond_with_data(
        body, headers={"Content-Encoding": encoding}
    )
    httpserver.expect_request("/v1/models").respond_with_json(MODELS)
    httpserver.expect_request("/v1/completions").respond_with_json(COMPLETION)
    verdict = examine(httpserver.url_for("").rstrip("/"))
    assert verdict.kind is VerdictKind.NO_METRICS
    assert verdict.healthy  # judged by the tiny request
    assert (
        f"GET /metrics sent Content-Encoding: {encoding}, though asked for identity; not decoded"
        in verdict.evidence
    )


@pytest.mark.parametrize(
    "chunk",
    [
        b"%x\r\n%s\r\n" % (64 * 1024, b"a" * 64 * 1024),
        # A one-byte chunk behind 60 KB of extension: only the data bytes were counted,
        # and one read took in 822 MB in 2 s.
        b"1;" + b"x" * 60_000 + b"\r\na\r\n",
    ],
    ids=["data", "extensions"],
)
def test_an_endless_chunked_body_is_cut_off_at_the_cap_on_the_wire(chunk: bytes) -> None:
    """No Content-Length to trust: the cap counts bytes as they arrive, framing too."""
    stop = threading.Event()

    def endless(connection: socket.socket) -> None:
        connection.sendall(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        while not stop.is_set():
            connection.sendall(chunk)

    settings = ProbeSettings(wait=0.0, timeout=5.0, answer_timeout=1.0, max_body=1024 * 1024)
    try:
        with raw_server(endless) as url:
            read = asyncio.run(_read_once(url, settings))
    finally:
        stop.set()
    assert read.problem is ReadProblem.UNUSABLE
    assert read.detail == "GET /metrics sent more than the 1 MiB cap"


def test_a_content_length_of_thousands_of_digits_is_malformed_not_left_unjudged() -> None:
    # int() of 5,000 digits raised ValueError, not a wire error: the backend was left
    # "not judged" at every run, and kept serving. It is a failure like any framing error.
    def endless_length(connection: socket.socket) -> None:
        connection.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: " + b"9" * 5000 + b"\r\n\r\n")

    settings = ProbeSettings(wait=0.0, timeout=2.0, answer_timeout=1.0)
    with raw_server(endless_length) as url:
        read = asyncio.run(_read_once(url, settings))
    assert read.problem is ReadProblem.DOWN, read  # not HTTP as framed: no usable answer
    assert "bad Content-Length" in read.detail
    # It answered: "connection closed or reset before an answer" said otherwise.
    assert read.detail.startswith("GET /metrics: answered, but not in HTTP/1.x: "), read


def test_a_text_too_long_to_read_says_so_not_that_it_has_no_vllm_series(
    httpserver: HTTPServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(metrics_module, "MAX_LINES", 100)
    running = "".join(f'vllm:num_requests_running{{engine="{i}"}} 1\n' for i in range(150))
    httpserver.expect_request("/metrics").respond_with_data(running)
    settings = ProbeSettings(wait=0.0, timeout=2.0, answer_timeout=1.0)
    read = asyncio.run(_read_once(httpserver.url_for("").rstrip("/"), settings))
    assert read.detail.endswith(": more than 100 lines of vLLM series: not read"), read
    assert "without vLLM series" not in read.detail


def test_a_read_knows_when_it_was_asked_for_as_well_as_when_it_was_in(
    httpserver: HTTPServer,
) -> None:
    """A freeze is measured to when its newest read was asked for (classify): its answer
    may be taken in seconds later by a loop running behind."""
    httpserver.expect_request("/metrics").respond_with_data(capture("busy-1"))
    ticks = iter([100.0, 101.5])  # the clock as the request goes out, then as it is in

    async def read_it(url: str) -> Read:
        async with new_client() as client:
            settings = ProbeSettings(wait=0.0, timeout=2.0, answer_timeout=1.0)
            return await read_metrics(client, Target("b", url), settings, lambda: next(ticks))

    read = asyncio.run(read_it(httpserver.url_for("").rstrip("/")))
    assert read.signals is not None
    assert (read.sent, read.at) == (100.0, 101.5)


async def _read_once(url: str, settings: ProbeSettings) -> Read:
    async with new_client() as client:
        return await read_metrics(client, Target("b", url), settings, FakeClock())


def test_control_characters_from_the_server_arrive_printable(httpserver: HTTPServer) -> None:
    hostile = capture("idle-1").replace('engine="0"', 'engine="0\x1b[2J\x9b\u202e"')
    httpserver.expect_request("/metrics").respond_with_data(hostile)
    httpserver.expect_request("/v1/models").respond_with_json(
        {"data": [{"id": "tiny\x1b]0;owned\x07"}]}
    )
    httpserver.expect_request("/v1/completions").respond_with_data("nope", status=500)
    verdict = examine(httpserver.url_for("").rstrip("/"))
    shown = [verdict.evidence, *(read.detail for read in verdict.reads)]
    shown += [engine.engine for read in verdict.reads for engine in _engines(read)]
    assert verdict.answer is not None
    shown += [verdict.answer.detail, *verdict.answer.models_served]
    assert all(text.isprintable() for text in shown), shown
    assert [engine.engine for engine in _engines(verdict.reads[0])] == ["0\\x1b[2J\\x9b\\u202e"]
    assert "tiny\\x1b]0;owned\\x07" in verdict.evidence


def _engines(read: Read) -> tuple[EngineSignals, ...]:
    return read.signals.engines if read.signals is not None else ()


@pytest.mark.slow  # about 3 s: a timeout of 2 s, and the late answer after it
def test_a_stale_keep_alive_retry_stays_within_one_timeout() -> None:
    """The server answers one read, then drops the kept-alive connection at 80% of the
    timeout; the retry's fresh connection is answered only 60% of a timeout after it was
    accepted: past the first request's timeout, well within a second full one. Both
    attempts share one --timeout (before, the retry got a second full one, and so this
    late answer): the client must have hung up on the retry before it came."""
    timeout = 2.0
    held, answer_after = 0.8 * timeout, 0.6 * timeout
    stop = threading.Event()
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    listener.settimeout(0.1)
    metrics = capture("idle-1").encode()
    answer = b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(metrics), metrics)
    retries: list[bool] = []  # per retry connection: had the client closed it before the answer?

    def serve() -> None:
        first = True
        while not stop.is_set():
            try:
                connection, _ = listener.accept()
            except TimeoutError:
                continue
            with connection:
                if first:
                    first = False
                    connection.recv(65536)
                    connection.sendall(answer)
                    connection.recv(65536)  # the second request on the kept-alive connection
                    stop.wait(held)
                    continue
                connection.settimeout(answer_after)
                with contextlib.suppress(TimeoutError):
                    connection.recv(65536)  # the retried request, if sent in time
                stop.wait(answer_after)
                connection.setblocking(False)
                try:
                    hung_up = connection.recv(65536) == b""
                except BlockingIOError:
                    hung_up = False  # still open, and waiting
                except OSError:
                    hung_up = True  # reset by the client
                retries.append(hung_up)
                with contextlib.suppress(OSError):
                    connection.sendall(answer)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    settings = ProbeSettings(wait=0.0, timeout=timeout, answer_timeout=timeout)
    url = f"http://127.0.0.1:{listener.getsockname()[1]}"

    async def two_reads() -> Read:
        async with new_client() as client:
            await read_metrics(client, Target("b", url), settings, FakeClock())
            return await read_metrics(client, Target("b", url), settings, FakeClock())

    try:
        second = asyncio.run(two_reads())
        # The server's verdict on the retry is in once it has made its late answer.
        for _ in range(100):  # a bound for a hung server thread, not a timing claim
            if retries or not thread.is_alive():
                break
            stop.wait(0.1)
    finally:
        stop.set()
        thread.join(5)
        listener.close()
    assert not thread.is_alive()
    # The scenario happened: the stale connection was retried on a fresh one.
    assert len(retries) == 1, retries
    # Before: the retry, with a full timeout of its own, took the late answer.
    assert second.problem is ReadProblem.UNRESPONSIVE, second
    assert f"within {timeout:g} s" in second.detail
    assert retries == [True], "the client still held the retry open past its one timeout"


def test_the_api_key_is_never_in_a_targets_repr() -> None:
    """Targets end up in exception messages and debug output; the key must not."""
    target = Target("gpu0", "http://10.0.0.5:8000", api_key="s3cret")
    assert "s3cret" not in repr(target)
    assert "s3cret" not in repr(Outcome(target, Verdict(VerdictKind.IDLE, True, "idle")))


def test_watch_gets_a_verdict_too_when_judging_one_read_raises(
    httpserver: HTTPServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """examine_once, the watch loop's per-read step, has the same guard as check's."""
    Backend(httpserver, [capture("busy-1")])

    def broken_decide(*_args: object, **_kwargs: object) -> None:
        raise RecursionError("maximum recursion depth exceeded")

    monkeypatch.setattr("llmhealth.probe.decide", broken_decide)
    window: list[Read] = []

    async def once() -> Verdict | None:
        async with new_client() as client:
            target = Target("b", httpserver.url_for("").rstrip("/"))
            return await examine_once(client, target, FAST, window, clock=FakeClock())

    verdict = asyncio.run(once())
    assert verdict is not None and verdict.kind is VerdictKind.NO_METRICS
    assert "not judged: examining it raised RecursionError" in verdict.evidence
    assert window == [], "reads that judged nothing are not compared again"


# --- long steps: the tiny request waits for them, and a timeout behind one is doubt ------


def with_long_gap(text: str) -> str:
    """A capture whose inter-token histogram holds one gap past its last bucket (80 s)."""
    lines = []
    for line in text.splitlines():
        head, _, value = line.rpartition(" ")
        counted = head.startswith("vllm:inter_token_latency_seconds_count") or (
            head.startswith("vllm:inter_token_latency_seconds_bucket") and 'le="+Inf"' in head
        )
        lines.append(f"{head} {float(value) + 1}" if counted else line)
    return "\n".join(lines) + "\n"


@pytest.fixture
def no_local_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """The backend below runs inside this test process, so the "engine processes" found by
    its port would be whatever children pytest has at that moment; local CPU evidence is
    tested against real process trees in test_localcpu.py."""
    monkeypatch.setattr(LocalCpu, "applies", property(lambda _self: False))


@contextmanager
def engine_inside_a_long_step(server: HTTPServer) -> Iterator[Backend]:
    """Idle gauges, a known 80 s+ step, and a completion that queues past any timeout here.

    The hanging answer ends after 1.5 s: pytest-httpserver serves one request at a time,
    and the read that follows must get through.
    """
    backend = Backend(server, [with_long_gap(capture("idle-2"))])

    def queued(_request: Request) -> Response:
        backend.completions += 1
        time.sleep(1.5)
        return Response("late")

    server.clear()
    server.expect_request("/metrics").respond_with_handler(backend._metrics)
    server.expect_request("/v1/models").respond_with_json(MODELS)
    server.expect_request("/v1/completions").respond_with_handler(queued)
    yield backend


LONG_STEP_SETTINGS = ProbeSettings(wait=0.0, timeout=3.0, answer_timeout=0.3, max_check_time=1.0)
# As above, but a new process with no long step known is given 1 s, not 0.3 s, to answer:
# at once, but on a loaded machine.
ASKED_AGAIN_SETTINGS = replace(LONG_STEP_SETTINGS, answer_timeout=1.0)


@pytest.mark.slow
@pytest.mark.usefixtures("no_local_cpu")
def test_a_tiny_request_waits_longer_for_an_engine_with_long_steps_and_is_then_stalled(
    httpserver: HTTPServer,
) -> None:
    with engine_inside_a_long_step(httpserver) as backend:
        verdict = examine(backend.url, LONG_STEP_SETTINGS)
    # The timeout grew from 0.3 s towards 3 x 80 s, bounded by max_check_time (1 s).
    assert verdict.answer is not None and "within 1 s" in verdict.answer.detail
    assert verdict.kind is VerdictKind.STALLED
    assert verdict.requests_sent == 1
    assert backend.completions == 1
    assert backend.metrics_reads == 2  # the read after the timeout shows nothing moved
    assert "window 240 s" in verdict.evidence


@pytest.mark.slow
@pytest.mark.usefixtures("no_local_cpu")
def test_a_process_restarted_while_the_tiny_request_timed_out_is_asked_its_own(
    httpserver: HTTPServer,
) -> None:
    """The tiny request to an engine inside a long step times out, and the read after it
    finds a new process: that timeout was the old process's. Judged by it, the new one,
    idle and never asked, was a `restarted` that "failed the tiny request" (CRITICAL)."""
    with restarted_while_asked(httpserver) as backend:
        verdict = examine(backend.url, ASKED_AGAIN_SETTINGS)
    assert verdict.kind is VerdictKind.RESTARTED, verdict.evidence
    assert verdict.healthy, verdict.evidence
    assert verdict.answer is not None and verdict.answer.ok
    assert verdict_exit_code(verdict) is ExitCode.WARNING
    assert backend.completions == 2
    assert verdict.requests_sent == 2  # the old process's was sent as well


@pytest.mark.slow
@pytest.mark.usefixtures("no_local_cpu")
def test_watch_asks_a_process_restarted_while_the_tiny_request_timed_out_its_own(
    httpserver: HTTPServer,
) -> None:
    """As ``check`` above, in ``watch`` (and the ``Prober``): undecided in the cycle that
    found the new process, which the next cycle asks."""
    clock = FakeClock()
    window: list[Read] = []

    async def cycles(url: str) -> list[Verdict | None]:
        verdicts = []
        async with new_client() as client:
            for _ in range(2):
                verdicts.append(
                    await examine_once(
                        client, Target("b", url), ASKED_AGAIN_SETTINGS, window, clock=clock
                    )
                )
                clock.now += 5.0
        return verdicts

    with restarted_while_asked(httpserver) as backend:
        found, asked = asyncio.run(cycles(backend.url))
    assert found is None
    assert asked is not None and asked.kind is VerdictKind.RESTARTED, asked
    assert asked.healthy and asked.answer is not None and asked.answer.ok, asked.evidence
    assert backend.completions == 2


@contextmanager
def restarted_while_asked(server: HTTPServer) -> Iterator[Backend]:
    """An idle engine with a known 80 s+ step whose first tiny request queues past the
    1 s it waits (``ASKED_AGAIN_SETTINGS``); the read after it shows a new idle process,
    which answers at once."""
    backend = Backend(server, [with_long_gap(capture("idle-2")), capture("restart-1")])

    def first_queued(_request: Request) -> Response:
        backend.completions += 1
        if backend.completions == 1:
            time.sleep(1.5)
            return Response("late")
        return Response(json.dumps(COMPLETION), content_type="application/json")

    server.clear()
    server.expect_request("/metrics").respond_with_handler(backend._metrics)
    server.expect_request("/v1/models").respond_with_json(MODELS)
    server.expect_request("/v1/completions").respond_with_handler(first_queued)
    yield backend


@pytest.mark.slow
@pytest.mark.usefixtures("no_local_cpu")
def test_watch_settles_a_tiny_request_stuck_behind_a_long_step_within_one_cycle(
    httpserver: HTTPServer,
) -> None:
    with engine_inside_a_long_step(httpserver) as backend:

        async def run() -> Verdict | None:
            async with new_client() as client:
                return await examine_once(client, Target("b", backend.url), LONG_STEP_SETTINGS, [])

        verdict = asyncio.run(run())
    assert verdict is not None
    assert verdict.kind is VerdictKind.STALLED
    assert backend.metrics_reads == 2


@pytest.mark.parametrize("answered_in", [0.0, 4.0])
def test_a_watch_reading_early_keeps_enough_reads_to_prove_a_young_engines_wedge(
    answered_in: float,
) -> None:
    """Reads 4.8 s apart (KEEP_ALIVE_LEAD) and 61 kept spanned 288 s, short of the 300 s
    window of a young engine: its wedge was proven only after its startup grace. A freeze
    lasts until its newest read was asked for, from the first one's answer: with answers
    4 s in coming, 64 reads spanned 298.4 s, and the wedge was never proven."""
    settings = ProbeSettings()  # the defaults: a 5 s wait, max_check_time 300 s
    signals = parse_metrics(capture("wedge-4"))
    assert signals.process_start is not None
    window: list[Read] = []
    for index in range(80):
        sent = signals.process_start + 60.0 + index * settings.wait * (1 - KEEP_ALIVE_LEAD)
        at = sent + answered_in
        keep_read(window, Read(at, signals=signals, sent=sent), settings.paced_read_limit)
        decision = decide(window, max_reads=settings.paced_read_limit, paced_wait=settings.wait)
        if isinstance(decision, Verdict):
            break
    assert isinstance(decision, Verdict) and decision.kind is VerdictKind.WEDGED, decision
    assert "startup_wedge_after 300 s" in decision.evidence
    assert window[-1].at - signals.process_start < DEFAULT_RULES.startup_grace


@pytest.mark.parametrize("wait", [0.15, 0.5, 5.0, 7.0])
def test_the_reads_kept_on_a_schedule_span_max_check_time_at_their_closest(wait: float) -> None:
    """N reads span at least N - 2 of the closest paces (a freeze runs from its first
    read's answer to its newest read's request); the Prober's reads may come a timer's
    jitter sooner than watch's, which at a 0.15 s wait left 297.9 s of a 300 s window."""
    settings = ProbeSettings(wait=wait)
    assert (settings.paced_read_limit - 2) * settings.soonest_read >= settings.max_check_time


def test_a_reader_reading_a_wait_apart_decides_within_the_time_its_leader_waits() -> None:
    # A frozen engine whose window no read limit covers, read every full wait (a server
    # that keeps its connections): the reader decides at its limit. The leader took a
    # member's silence for doubt after max_check_time and a wait, sooner than that.
    settings = ProbeSettings()
    signals = parse_metrics(capture("wedge-4"))
    assert signals.process_start is not None
    first = signals.process_start + 3600.0
    window: list[Read] = []
    limit = settings.paced_read_limit
    rules = replace(DEFAULT_RULES, wedge_after=10_000.0)  # a window no read limit covers
    for index in range(limit + 1):
        at = first + index * settings.wait
        keep_read(window, Read(at, signals=signals), limit)
        decision = decide(window, max_reads=limit, rules=rules, paced_wait=settings.wait)
        if isinstance(decision, Verdict):
            break
    assert isinstance(decision, Verdict) and decision.kind is VerdictKind.STALLED
    assert window[-1].at - first <= settings.longest_undecided - settings.wait


def test_a_watch_window_keeps_its_limit_and_one_copy_of_values_that_did_not_change() -> None:
    """61 reads of a frozen engine at the defaults: its window holds their values once."""
    frozen = EngineSignals(engine="0", running=4, waiting=8, steps=100.0)
    window: list[Read] = []
    for at in range(1, 6):
        keep_read(window, Read(float(at), signals=Signals((frozen,), 1.0)), 3)
    # The freeze's first read stays, with the newest: the freeze is measured from it.
    assert [read.at for read in window] == [1.0, 4.0, 5.0]
    assert window[0].signals is window[1].signals is window[2].signals
    moved = EngineSignals(engine="0", running=4, waiting=8, steps=101.0)
    keep_read(window, Read(6.0, signals=Signals((moved,), 1.0)), 3)
    assert window[-1].signals is not window[-2].signals
    assert window[-1].signals == Signals((moved,), 1.0)
    keep_read(window, Read(7.0, problem=ReadProblem.DOWN, detail="refused"), 3)
    assert [read.at for read in window] == [5.0, 6.0, 7.0] and window[-1].signals is None


WATCH_LIMIT = ProbeSettings().read_limit  # 61: max_check_time 5 min over 5 s waits
LONG_STEP = LongestStep(40.0, "engine 0: a 40 s step seen")


def busy_read(number: int) -> Read:
    """Read ``number`` of a busy engine that steps every wait, 5 s apart."""
    engine = EngineSignals(engine="0", running=4, waiting=0, steps=float(number))
    return Read(5.0 * number, signals=Signals((engine,), 1.0))


def test_a_watch_window_keeps_the_current_freeze_and_lets_older_reads_go() -> None:
    window: list[Read] = []
    for number in range(100):
        keep_read(window, busy_read(number), WATCH_LIMIT)
    assert len(window) == 4  # a busy engine's window no longer fills to 61 reads
    frozen = EngineSignals(engine="0", running=4, waiting=0, steps=99.0)
    for number in range(100, 110):
        keep_read(window, Read(5.0 * number, signals=Signals((frozen,), 1.0)), WATCH_LIMIT)
    # The ten frozen reads, the last one that moved, and the one before it.
    assert [read.at for read in window] == [5.0 * n for n in range(98, 110)]
    for number in range(110, 200):
        keep_read(window, Read(5.0 * number, signals=Signals((frozen,), 1.0)), WATCH_LIMIT)
    assert len(window) == WATCH_LIMIT  # a long freeze still fills its window


@pytest.mark.parametrize("earlier_reads", [0, 100])
def test_a_freeze_inside_its_window_is_undecided_however_long_the_watch_has_run(
    earlier_reads: int,
) -> None:
    """Two waits without progress, inside a 40 s step's window: "not decided yet" in the
    daemon's first minute and long after it; once the window held 61 reads, the older
    busy reads made it say `stalled` at once, as if 5 minutes of freeze had been read."""
    window: list[Read] = []
    for number in range(earlier_reads):
        keep_read(window, busy_read(number), WATCH_LIMIT)
    frozen = EngineSignals(engine="0", running=4, waiting=0, steps=-1.0)
    for number in range(earlier_reads, earlier_reads + 3):
        keep_read(window, Read(5.0 * number, signals=Signals((frozen,), 1.0)), WATCH_LIMIT)
    decision = decide(window, max_reads=WATCH_LIMIT, learned=LONG_STEP)
    assert isinstance(decision, TakeRead), decision
    assert "inside its window" in decision.reason


@pytest.mark.parametrize("earlier_reads", [1, 100])
def test_a_tiny_request_stuck_behind_a_long_step_gets_one_more_read_however_long_the_watch_has_run(
    earlier_reads: int,
) -> None:
    """An idle engine whose tiny request timed out behind a 40 s step is read once more
    (and then judged `stalled` if nothing moved); with a full window of older reads it was
    `unanswered` at once."""
    idle = EngineSignals(engine="0", running=0, waiting=0, steps=7.0)
    window: list[Read] = []
    for number in range(earlier_reads):
        keep_read(window, Read(5.0 * number, signals=Signals((idle,), 1.0)), WATCH_LIMIT)
    answer = Answer(5.0 * earlier_reads, ok=False, detail="timed out after 120 s", timed_out=True)
    decision = decide(window, answer, max_reads=WATCH_LIMIT, learned=LONG_STEP)
    assert isinstance(decision, TakeRead), decision


@pytest.mark.slow
def test_a_read_the_checker_was_too_held_up_to_time_is_not_judged_and_not_down(
    httpserver: HTTPServer,
) -> None:
    """The server answers at once, but this process cannot run for far longer than the
    read's timeout (an overloaded host): no verdict on the server, and none against it."""
    backend = Backend(httpserver, [capture("busy-1"), capture("busy-2")])
    settings = ProbeSettings(wait=0.0, timeout=0.2, answer_timeout=0.2)
    clock = FakeClock()

    async def run() -> Verdict:
        asyncio.get_running_loop().call_soon(time.sleep, 1.5)  # held from the first wait on
        async with new_client() as client:
            return await examine_backend(
                client, Target("b", backend.url), settings, clock=clock, sleep=clock.sleep
            )

    verdict = asyncio.run(run())
    assert verdict.kind is VerdictKind.NO_METRICS
    assert not verdict.healthy
    assert "not judged" in verdict.evidence
    assert "could not run" in verdict.evidence


def test_an_idle_server_that_closes_after_each_answer_is_idle_not_unanswered() -> None:
    from tests.test_wire import read_request, tcp_server  # noqa: PLC0415

    bodies = {
        b"GET /metrics": capture("idle-1").encode(),
        b"GET /v1/models": json.dumps(MODELS).encode(),
        b"POST /v1/completions": b'{"choices":[{"index":0,"text":"!"}]}',
    }

    def one_answer_per_connection(connection: socket.socket, number: int) -> None:
        request = read_request(connection)
        body = next(b for start, b in bodies.items() if request.startswith(start))
        connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_CORK, 1)
        connection.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
        connection.shutdown(socket.SHUT_WR)
        connection.recv(1)

    with tcp_server(one_answer_per_connection) as (url, _):
        verdict = examine(url)
    assert verdict.kind is VerdictKind.IDLE, verdict.evidence


@pytest.mark.slow
def test_a_read_watch_was_too_held_up_to_time_keeps_the_freeze_it_interrupted(
    httpserver: HTTPServer,
) -> None:
    """A read cut off by this process's own lateness judges nothing, and neither does it
    undo what the reads before it showed: it emptied the window, so each overloaded
    moment started a wedge's proof again (one whose window is minutes, a young engine's
    or a long-stepping one's, was never proven on a host loaded that often)."""
    backend = Backend(httpserver, [capture("wedge-1")])
    settings = ProbeSettings(wait=5.0, timeout=0.2, answer_timeout=0.2)
    clock = FakeClock()
    window: list[Read] = []

    async def watched(held: bool) -> Verdict | None:
        clock.now += 5.0
        if held:  # an overloaded host: this process cannot run for far past the timeout
            asyncio.get_running_loop().call_soon(time.sleep, 1.5)
        async with new_client() as client:
            return await examine_once(
                client, Target("b", backend.url), settings, window, clock=clock
            )

    async def run() -> list[Verdict | None]:
        return [await watched(held) for held in (False, False, True, False)]

    first, second, starved, fourth = asyncio.run(run())
    assert first is None and second is None
    assert starved is not None and not starved.judged, starved
    assert "could not run" in starved.evidence
    assert fourth is not None and fourth.kind is VerdictKind.WEDGED, fourth


class SteppedClock:
    """The wall clock and a steady one, five seconds a wait each; ``step_at`` reads in,
    the wall clock alone jumps ``step`` seconds forward (NTP, a VM resumed, ``date -s``)."""

    def __init__(self, now: float, step: float = 0.0, step_at: int = 2) -> None:
        self.now = now
        self.ticks = 500.0
        self.step = step
        self.step_at = step_at
        self.served = 0

    def __call__(self) -> float:
        return self.now

    def steady(self) -> float:
        return self.ticks

    def wait(self) -> None:
        self.now += 5.0
        self.ticks += 5.0

    async def sleep(self, _seconds: float) -> None:
        self.wait()

    def serving(self) -> None:
        """A request reached the server: the step comes once ``step_at`` of them have."""
        self.served += 1
        if self.served == self.step_at:
            self.now += self.step


# wedge-1..4: the engine stood still with work for 20 s (SIGSTOP), then moved again; its
# process 211 s old at wedge-1, so its startup window (300 s) covers the pause.
PAUSED = ["wedge-1", "wedge-2", "wedge-3", "wedge-4", "wedge-resume-1"]
PAUSED_AT = 1796024587.7  # wedge-1's own time (fixtures/vllm-0.32/INDEX.tsv)


def paused_backend(
    server: HTTPServer, clock: SteppedClock, names: Sequence[str] = tuple(PAUSED)
) -> str:
    texts = [capture(name) for name in names]

    def metrics(_request: Request) -> Response:
        text = texts[min(clock.served, len(texts) - 1)]
        clock.serving()
        return Response(text, content_type="text/plain; version=0.0.4")

    server.expect_request("/metrics").respond_with_handler(metrics)
    return server.url_for("").rstrip("/")


def watched_by_reads(url: str, clock: SteppedClock, reads: int) -> list[Verdict | None]:
    """``watch``'s examination of one backend, ``reads`` waits in a row on ``clock``."""
    settings = ProbeSettings(wait=5.0, timeout=2.0)

    async def run() -> list[Verdict | None]:
        window: list[Read] = []
        verdicts = []
        async with new_client() as client:
            for _ in range(reads):
                verdicts.append(
                    await examine_once(
                        client, Target("b", url), settings, window, clock=clock, steady=clock.steady
                    )
                )
                clock.wait()
        return verdicts

    return asyncio.run(run())


@pytest.mark.parametrize("step", [0.0, 3600.0], ids=["steady", "stepped"])
def test_a_wall_clock_stepped_forward_inside_a_long_step_does_not_wedge_check(
    httpserver: HTTPServer, step: float
) -> None:
    clock = SteppedClock(PAUSED_AT, step)
    url = paused_backend(httpserver, clock)

    async def run() -> Verdict:
        async with new_client() as client:
            return await examine_backend(
                client,
                Target("b", url),
                ProbeSettings(wait=5.0, timeout=2.0),
                clock=clock,
                sleep=clock.sleep,
                steady=clock.steady,
            )

    verdict = asyncio.run(run())
    assert verdict.kind is VerdictKind.BUSY, verdict.evidence
    assert len(verdict.reads) == len(PAUSED)
    # The reads keep the wall clock's times, step and all: the record's times are wall.
    assert verdict.reads[-1].at - verdict.reads[0].at == 4 * 5.0 + step


@pytest.mark.parametrize("step", [0.0, 3600.0], ids=["steady", "stepped"])
def test_a_wall_clock_stepped_forward_inside_a_long_step_does_not_wedge_watch(
    httpserver: HTTPServer, step: float
) -> None:
    clock = SteppedClock(PAUSED_AT, step)
    verdicts = watched_by_reads(paused_backend(httpserver, clock), clock, len(PAUSED))
    assert verdicts[:-1] == [None] * (len(PAUSED) - 1)  # inside its window: undecided
    last = verdicts[-1]
    assert last is not None and last.kind is VerdictKind.BUSY, last


@contextmanager
def threaded_server() -> Iterator[HTTPServer]:
    server = HTTPServer(threaded=True)
    server.start()
    try:
        yield server
    finally:
        server.clear()
        server.stop()


@pytest.mark.parametrize("step", [0.0, 3600.0], ids=["steady", "stepped"])
def test_a_wall_clock_stepped_forward_while_the_tiny_request_waits_is_no_failure(
    step: float,
) -> None:
    """A young engine (42 s) showing no work inside its first long step: its tiny request
    times out behind the step, which its 300 s startup window excuses; the wall clock
    stepping an hour meanwhile does not make the wait an hour."""
    clock = SteppedClock(1796024717.9, step)  # restart-1's own time
    release = threading.Event()

    def hang(_request: Request) -> Response:
        clock.now += clock.step
        release.wait(5)
        return Response("late")

    with threaded_server() as server:
        server.expect_request("/metrics").respond_with_data(capture("restart-1"))
        server.expect_request("/v1/models").respond_with_json(MODELS)
        server.expect_request("/v1/completions").respond_with_handler(hang)
        url = server.url_for("").rstrip("/")

        async def run() -> Verdict:
            async with new_client() as client:
                return await examine_backend(
                    client,
                    Target("b", url),
                    ProbeSettings(wait=5.0, timeout=2.0, answer_timeout=0.3),
                    clock=clock,
                    sleep=clock.sleep,
                    steady=clock.steady,
                )

        try:
            verdict = asyncio.run(run())
        finally:
            release.set()
    assert verdict.kind is VerdictKind.STALLED, verdict.evidence
    assert "not proof of a failure" in verdict.evidence


@pytest.mark.parametrize("step", [0.0, 3600.0], ids=["steady", "stepped"])
def test_a_wall_clock_stepped_forward_leaves_a_young_engine_young(
    httpserver: HTTPServer, step: float
) -> None:
    """The engine, 210 s old, read busy (wedge-pre); the wall clock then stepped an hour
    forward, and the engine stood still for 20 s (wedge-1..4), inside its startup window
    (300 s). Its process start (vLLM's, fixed) against the stepped clock made it an hour
    old: out of its startup window, it was wedged at two waits."""
    clock = SteppedClock(PAUSED_AT - 1.1, step)
    names = ["wedge-pre", *PAUSED]
    verdicts = watched_by_reads(paused_backend(httpserver, clock, names), clock, len(names))
    kinds = [None if v is None else v.kind for v in verdicts]
    assert VerdictKind.WEDGED not in kinds, [v.evidence for v in verdicts if v is not None][2:3]


def test_work_that_just_appeared_is_not_stalled_in_watch_any_more_than_in_check(
    httpserver: HTTPServer,
) -> None:
    """Idle reads, then one whose engine shows a request waiting and nothing moved yet (no
    step of it has ended): no baseline for it, so no doubt, and ``check`` reads once more.
    ``watch``'s window still held the idle reads, counted as reads spent, and the same
    read was ``stalled`` at once: HEALTHY → SUSPECT for a request that had just come."""
    idle = capture("prefill-0")
    arrived = idle.replace(
        'vllm:num_requests_waiting{engine="0",model_name="tiny"} 0.0',
        'vllm:num_requests_waiting{engine="0",model_name="tiny"} 1.0',
    ).replace(
        'vllm:num_requests_waiting_by_reason{engine="0",model_name="tiny",reason="capacity"} 0.0',
        'vllm:num_requests_waiting_by_reason{engine="0",model_name="tiny",reason="capacity"} 1.0',
    )
    backend = Backend(httpserver, [idle, idle, idle, arrived, capture("prefill-1")])
    settings = ProbeSettings(wait=5.0, timeout=1.0, answer_timeout=1.0)
    clock = FakeClock()
    window: list[Read] = []

    async def cycles() -> list[Verdict | None]:
        verdicts = []
        async with new_client() as client:
            for _ in range(5):
                verdicts.append(
                    await examine_once(
                        client, Target("b", backend.url), settings, window, clock=clock
                    )
                )
                clock.now += 5.0
        return verdicts

    verdicts = asyncio.run(cycles())
    assert [v.kind if v else None for v in verdicts[:3]] == [VerdictKind.IDLE] * 3
    assert verdicts[3] is None, verdicts[3] and verdicts[3].evidence
    assert verdicts[4] is not None and verdicts[4].kind is VerdictKind.BUSY
    assert backend.completions == 3


def engine_one_frozen() -> str:
    """A second engine, "1", with work and the counters of ``wedge-1``."""
    return "\n".join(
        line.replace('engine="0"', 'engine="1"')
        for line in capture("wedge-1").splitlines()
        if line.startswith("vllm:")
    )


def failing_after(httpserver: HTTPServer, texts: list[str], good_reads: int) -> Backend:
    """A backend serving ``texts`` as ``Backend`` does, whose /metrics answers HTTP 503
    from read ``good_reads`` + 1 on; its completions counted."""
    backend = Backend(httpserver, texts)
    served = backend._metrics

    def metrics(request: Request) -> Response:
        response = served(request)
        if backend.metrics_reads > good_reads:
            response.status_code = 503
        return response

    httpserver.clear_all_handlers()
    httpserver.expect_request("/metrics").respond_with_handler(metrics)
    httpserver.expect_request("/v1/models").respond_with_json(MODELS)
    httpserver.expect_request("/v1/completions", method="POST").respond_with_handler(
        backend._complete
    )
    return backend


def watched(backend: Backend, settings: ProbeSettings, reads: int) -> list[Verdict | None]:
    """``reads`` examinations of ``backend`` into one window, a wait apart, as `watch`
    reads it."""
    clock = FakeClock()
    window: list[Read] = []

    async def cycles() -> list[Verdict | None]:
        verdicts = []
        async with new_client() as client:
            for _ in range(reads):
                target = Target("b", backend.url)
                verdicts.append(await examine_once(client, target, settings, window, clock=clock))
                clock.now += settings.wait
        return verdicts

    return asyncio.run(cycles())


def test_a_server_read_asleep_is_not_sent_a_request_when_its_next_metrics_fail(
    httpserver: HTTPServer,
) -> None:
    """A server read asleep on purpose, whose next /metrics answered HTTP 503: judged as
    "no metrics" by the tiny request, it was sent a completion, which crashed a sleeping
    vLLM (vLLM #15483). Nothing since showed it awake; the router keeps it out until a
    read does."""
    asleep = put_to_sleep(capture("idle-1"))
    backend = failing_after(httpserver, [asleep, "unavailable"], good_reads=1)
    settings = ProbeSettings(wait=5.0, timeout=1.0, answer_timeout=1.0)
    first, second = watched(backend, settings, 2)
    assert first is not None and first.kind is VerdictKind.IDLE and "asleep" in first.evidence
    assert backend.completions == 0, second and second.evidence
    assert second is not None and second.kind is VerdictKind.NO_METRICS
    assert "asleep" in second.evidence


def test_a_server_read_asleep_is_not_asked_once_its_failed_reads_fill_the_watch_window(
    httpserver: HTTPServer,
) -> None:
    """Read asleep on purpose, then /metrics failing (HTTP 503) read after read: "no
    metrics", not asked, while the asleep read is in the window. Once as many failed
    reads as the window holds (``paced_read_limit``) had come, the asleep read slid out
    and the next read sent the completion that crashes a sleeping vLLM (#15483), though
    no read had shown it awake: ``check``, with its baseline, never asks it."""
    asleep = put_to_sleep(capture("idle-1"))
    backend = failing_after(httpserver, [asleep], good_reads=1)
    settings = ProbeSettings(wait=5.0, timeout=1.0, answer_timeout=1.0, max_check_time=10.0)
    verdicts = watched(backend, settings, settings.paced_read_limit + 3)
    asked = [v.evidence for v in verdicts if v is not None and v.requests_sent]
    assert backend.completions == 0, asked[:1]
    assert all(v is not None and "asleep" in v.evidence for v in verdicts)


def test_an_engine_asleep_beside_a_frozen_one_is_not_asked_once_failed_reads_fill_the_window(
    httpserver: HTTPServer,
) -> None:
    """Data-parallel: engine 0 put to sleep on purpose while engine 1 held work through a
    long step (no counter moved over one wait), then /metrics failing (HTTP 503) read
    after read. The window keeps the freeze's first read once failed reads outgrow it
    (``keep_read``), and that path dropped the asleep read: the freeze's first read,
    taken before engine 0 slept, was then the newest with vLLM series, and the next read
    sent the completion a data-parallel server may route to the sleeping engine (#15483)."""
    one = engine_one_frozen()
    sleeping = put_to_sleep(capture("idle-1"))
    backend = failing_after(
        httpserver, [f"{capture('idle-1')}\n{one}\n", f"{sleeping}\n{one}\n"], good_reads=2
    )
    settings = ProbeSettings(wait=5.0, timeout=1.0, answer_timeout=1.0, max_check_time=10.0)
    verdicts = watched(backend, settings, settings.paced_read_limit + 4)
    asked = [v.evidence for v in verdicts if v is not None and v.requests_sent]
    assert backend.completions == 0, asked[:1]
    assert all(v is not None and "asleep" in v.evidence for v in verdicts[2:])


def test_a_new_process_read_asleep_is_not_asked_after_its_restart_verdict_came_at_a_failed_read(
    httpserver: HTTPServer,
) -> None:
    """A data-parallel server restarted: its new process shows engine 0 asleep on purpose
    and work on engine 1 (one more read judges it), then /metrics fails (HTTP 503). The
    ``restarted`` verdict came at the failed read, unasked, and the window was cut to
    that read alone: the asleep read gone, the next failed read sent the completion the
    server may route to the sleeping engine (#15483), though no read showed it awake."""
    one = engine_one_frozen()
    sleeping = put_to_sleep(capture("restart-1"))
    backend = failing_after(
        httpserver, [capture("restart-0"), f"{sleeping}\n{one}\n"], good_reads=2
    )
    settings = ProbeSettings(wait=5.0, timeout=1.0, answer_timeout=1.0, max_check_time=10.0)
    verdicts = watched(backend, settings, 5)
    kinds = [None if v is None else v.kind for v in verdicts]
    assert kinds[:3] == [VerdictKind.IDLE, None, VerdictKind.RESTARTED], kinds
    # The old process, idle and awake, was asked at the first read: that one only.
    asked = [v.evidence for v in verdicts[1:] if v is not None and v.requests_sent]
    assert backend.completions == 1, asked[:1]


def idle_of(text: str) -> str:
    """``text`` with nothing running or waiting: an idle engine's read."""
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting"):
        text = "\n".join(
            f"{line.rpartition(' ')[0]} 0.0" if line.startswith(name + "{") else line
            for line in text.splitlines()
        )
    return text + "\n"


@pytest.mark.parametrize(
    ("texts", "max_reads", "kind"),
    [
        # The one more read that decides showed work and progress.
        (("prefill-0", "prefill-1"), None, VerdictKind.BUSY),
        # The reads after it showed work that did not move, judged by its window.
        (("idle-of:wedge-1", "wedge-1"), 6, VerdictKind.STALLED),
    ],
    ids=["busy", "freeze"],
)
def test_a_tiny_request_that_timed_out_is_kept_in_the_verdict_after_it(
    httpserver: HTTPServer, texts: tuple[str, str], max_reads: int | None, kind: VerdictKind
) -> None:
    """An idle engine with a long learned step was asked, the request timed out, and the
    reads after it showed work: the verdict said "no request sent" and ``requests_sent``
    0, though a request had been sent and had timed out."""
    release = threading.Event()
    served = [
        idle_of(capture(name.removeprefix("idle-of:"))) if name.startswith("idle-of:")
        else capture(name)
        for name in texts
    ]  # fmt: skip
    backend = Backend(httpserver, served)

    def hang(_request: Request) -> Response:
        backend.completions += 1
        release.wait(0.6)  # past the answer's timeout; the server then reads again
        return Response("late")

    httpserver.clear_all_handlers()
    httpserver.expect_request("/metrics").respond_with_handler(backend._metrics)
    httpserver.expect_request("/v1/models").respond_with_json(MODELS)
    httpserver.expect_request("/v1/completions", method="POST").respond_with_handler(hang)
    settings = ProbeSettings(wait=0.0, timeout=1.0, answer_timeout=0.3, max_check_time=0.4)
    if max_reads is not None:
        settings = replace(settings, max_reads=max_reads)
    clock = FakeClock()

    async def run() -> Verdict:
        async with new_client() as client:
            return await examine_backend(
                client,
                Target("b", backend.url),
                settings,
                clock=clock,
                sleep=clock.sleep,
                learned=LongestStep(60.0, "a long step"),
            )

    try:
        verdict = asyncio.run(run())
    finally:
        release.set()
    assert backend.completions == 1
    assert verdict.kind is kind, verdict.evidence
    assert verdict.requests_sent == 1, verdict.evidence
    assert verdict.answer is not None and verdict.answer.timed_out
    assert "no request sent" not in verdict.evidence


@pytest.mark.parametrize("value", [True, False, "5", None, float("inf"), float("nan"), 0.0, 3601])
def test_a_callers_seconds_outside_a_millisecond_to_an_hour_are_refused(value: object) -> None:
    # A bool is an int to Python: True was one second, False nothing at all.
    with pytest.raises(ValueError, match="from a millisecond to an hour"):
        seconds_argument(value, "timeout")


@pytest.mark.parametrize("value", [0.001, 5, 3600])
def test_a_callers_seconds_from_a_millisecond_to_an_hour_are_taken(value: float) -> None:
    assert seconds_argument(value, "timeout") == float(value)


def test_a_verdict_may_take_three_reads_however_short_the_check_time() -> None:
    assert ProbeSettings(wait=10.0, max_check_time=5.0).read_limit == 3


def test_the_tiny_request_waits_longer_for_a_long_step_never_shorter_for_a_short_one() -> None:
    settings = ProbeSettings(answer_timeout=10.0)
    short = settings.for_answer([], LongestStep(0.5, "a short step"), DEFAULT_RULES)
    assert short.answer_timeout == 10.0
    long = settings.for_answer([], LongestStep(40.0, "a long step"), DEFAULT_RULES)
    assert long.answer_timeout == DEFAULT_RULES.step_factor * 40.0


def test_cpu_is_sampled_for_a_window_longer_than_two_waits() -> None:
    learned = LongestStep(40.0, "a long step")  # a window of three such steps: 120 s
    assert ProbeSettings(wait=48.0).wants_cpu([], learned, DEFAULT_RULES)
    assert not ProbeSettings(wait=60.0).wants_cpu([], learned, DEFAULT_RULES)


def test_a_refused_backend_examined_while_another_error_is_handled_is_refused() -> None:
    # A cluster's `check` probes after etcd failed, inside that error's handler: the
    # refused backend's evidence named the etcd error, not the refusal.
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    try:
        raise RuntimeError("no etcd endpoint answered")
    except RuntimeError:
        verdict = examine(f"http://localhost:{port}")
    assert verdict.kind is VerdictKind.DOWN
    assert "connection refused" in verdict.evidence
    assert "etcd" not in verdict.evidence


def test_a_long_location_is_shortened_in_the_evidence(httpserver: HTTPServer) -> None:
    far = "http://elsewhere.invalid/" + "a" * 1000
    httpserver.expect_request("/metrics").respond_with_data(
        "", status=302, headers={"Location": far}
    )
    read = asyncio.run(_read_once(httpserver.url_for("").rstrip("/"), FAST))
    assert "redirected (302) to http://elsewhere.invalid/aaa" in read.detail
    assert "a" * 200 not in read.detail
    assert "..." in read.detail


def test_a_backend_is_read_at_once_and_waited_for_only_between_reads(
    httpserver: HTTPServer,
) -> None:
    backend = Backend(httpserver, [capture("busy-1"), capture("busy-2")])
    clock = FakeClock()
    waits: list[float] = []

    async def sleep(seconds: float) -> None:
        waits.append(seconds)
        await clock.sleep(seconds)

    async def run() -> Verdict:
        async with new_client() as client:
            target = Target("b", backend.url)
            return await examine_backend(client, target, FAST, clock=clock, sleep=sleep)

    verdict = asyncio.run(run())
    assert verdict.kind is VerdictKind.BUSY
    assert (backend.metrics_reads, waits) == (2, [FAST.wait])


def test_a_read_of_another_process_is_not_given_the_earlier_ones_birth() -> None:
    old = parse_metrics(capture("busy-1"))
    assert old.process_start is not None
    new = replace(old, process_start=old.process_start + 100.0)
    before = Read(old.process_start + 500.0, signals=old, tick=500.0, born=0.0)
    read = with_birth(Read(new.process_start + 50.0, signals=new, tick=650.0), [before])
    assert read.born == 600.0  # its own age, 50 s, before its tick
    same = with_birth(Read(old.process_start + 560.0, signals=old, tick=560.0), [before])
    assert same.born == 0.0


def _ask(url: str, **target: str) -> Answer:
    async def run() -> Answer:
        async with new_client() as client:
            return await ask_tiny(client, Target("b", url, **target), FAST, FakeClock())

    return asyncio.run(run())


def test_the_configured_model_is_asked_for_not_the_first_listed(httpserver: HTTPServer) -> None:
    asked = []

    def complete(request: Request) -> Response:
        asked.append(json.loads(request.get_data())["model"])
        return Response(json.dumps(COMPLETION), content_type="application/json")

    httpserver.expect_request("/v1/models").respond_with_json(
        {"data": [{"id": "first"}, {"id": "second"}]}
    )
    httpserver.expect_request("/v1/completions").respond_with_handler(complete)
    answer = _ask(httpserver.url_for("").rstrip("/"), model="second")
    assert answer.ok, answer.detail
    assert asked == ["second"]


def test_an_empty_model_list_sends_no_tiny_request(httpserver: HTTPServer) -> None:
    httpserver.expect_request("/v1/models").respond_with_json({"data": []})
    answer = _ask(httpserver.url_for("").rstrip("/"))
    assert (answer.ok, answer.sent) == (False, False)
    assert "lists no model" in answer.detail


def test_no_tcp_connection_within_the_timeout_is_down() -> None:
    # A listener whose backlog is full drops new connections' SYNs, as a host gone from
    # the network does: the connect times out, and the backend is down, not unresponsive.
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(0)
    host, port = listener.getsockname()
    url = f"http://{host}:{port}"
    fillers = []
    try:
        for _ in range(4):  # more than Linux queues for a backlog of 0
            filler = socket.socket()
            filler.setblocking(False)
            with contextlib.suppress(BlockingIOError):
                filler.connect(listener.getsockname())
            fillers.append(filler)
        settings = ProbeSettings(wait=0.0, timeout=0.5, answer_timeout=0.5)
        read = asyncio.run(_read_once(url, settings))
    finally:
        for filler in fillers:
            filler.close()
        listener.close()
    assert read.problem is ReadProblem.DOWN, read.detail
    assert "no TCP connection within 0.5 s" in read.detail


def test_no_tiny_request_is_sent_when_the_model_list_fails(httpserver: HTTPServer) -> None:
    httpserver.expect_request("/v1/models").respond_with_data("oops", status=500)
    answer = _ask(httpserver.url_for("").rstrip("/"))
    assert (answer.ok, answer.sent) == (False, False)
    assert "not sent: GET /v1/models answered HTTP 500" in answer.detail
