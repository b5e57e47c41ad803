"""The router over real HTTP on both sides: pytest-httpserver backends, raw misbehaving
sockets, and a real client. Waits are event-driven with generous bounds, never timed."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import itertools
import json
import os
import re
import socket
import struct
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping
from typing import Any

import httpx
import pytest
from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.exposition import generate_latest
from prometheus_client.registry import Collector
from pytest_httpserver import HTTPServer
from simproc import running_simulator
from werkzeug import Request, Response

from llmhealth import eventloop
from llmhealth import router as router_module
from llmhealth.choice import ANY_MODEL, Models
from llmhealth.config import Backend
from llmhealth.config import Router as RouterConfig
from llmhealth.router import (
    BACKEND_HEADER,
    ERROR_EVENT_BOUND,
    FIRST_BYTE_BUCKETS,
    ErrorEventWatch,
    Router,
    downstream_headers,
    model_of,
    upstream_headers,
)
from llmhealth.traffic import FailureKind
from llmhealth.upstream import Origin, Pool

BOUND = 20.0  # seconds: a generous bound on anything that must happen, never a timing claim
CHAT = "/v1/chat/completions"
# A streamed answer's head as vLLM sends it: an event stream framed in chunks.
SSE_CHUNKED_HEAD = (
    b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
)
BODY = json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}).encode()
Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def refused_url() -> str:
    return f"http://127.0.0.1:{free_port()}"  # nothing listens: connection refused


@contextlib.asynccontextmanager
async def routing(
    backends: Mapping[str, str],
    settings: RouterConfig | None = None,
    models: Mapping[str, Models] | None = None,
    keys: Mapping[str, str] | None = None,
) -> AsyncIterator[tuple[Router, str]]:
    """A router on a free port over ``backends`` (name -> URL), all serving."""
    configured = [
        Backend(name, url, api_key_env=(keys or {}).get(name)) for name, url in backends.items()
    ]
    router = Router(settings or RouterConfig(), configured, retry_after=5.0)
    port = free_port()
    await router.start("127.0.0.1", port)
    serving = {name: (models or {}).get(name, ANY_MODEL) for name in backends}
    router.push(serving, dict.fromkeys(backends, "healthy"), 1)
    try:
        yield router, f"http://127.0.0.1:{port}"
    finally:
        await router.close()


@contextlib.asynccontextmanager
async def raw_backend(handler: Handler) -> AsyncIterator[str]:
    """A backend that is only a socket: it says exactly what ``handler`` writes."""
    server = await asyncio.start_server(handler, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.close()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(server.wait_closed(), 2)


async def read_request(reader: asyncio.StreamReader) -> bytes:
    """Read one request's head and Content-Length body off a raw socket."""
    head = await reader.readuntil(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n"):
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value)
    return head + await reader.readexactly(length)


def run(scenario: Awaitable[None]) -> None:
    eventloop.run(asyncio.wait_for(scenario, 60))


def client() -> httpx.AsyncClient:
    return httpx.AsyncClient(timeout=BOUND)


async def quiet(router: Router) -> None:
    """Wait until no request is in flight: a handler records its outcome after the client
    already has the last byte."""
    async with asyncio.timeout(BOUND):
        while router.in_flight:
            await asyncio.sleep(0.01)


async def drained(router: Router) -> dict[str, Any]:
    await quiet(router)
    return dict(router.drain())


async def failures(router: Router) -> list[tuple[str, FailureKind | None, int | None]]:
    await quiet(router)
    return [
        (name, outcome.failure, outcome.status)
        for name, outcomes in router.drain().items()
        for outcome in outcomes
    ]


# --- pure helpers ------------------------------------------------------------------------


def test_the_model_is_read_from_the_body_and_bad_bodies_are_the_clients_fault() -> None:
    assert model_of(BODY)[0] == "tiny"
    assert model_of(b"") == (None, None)
    for body, why in [
        (b"{not json", "not valid JSON"),
        (b"[1, 2]", "must be a JSON object"),
        (b'{"prompt": "x"}', "names no model"),
        (b'{"model": 7}', "names no model"),
        (b"[" * 100_000, "not valid JSON"),
    ]:
        with pytest.raises(Exception, match=why) as caught:
            model_of(body)
        assert getattr(caught.value, "status", None) == 400


def test_hop_by_hop_headers_are_stripped_and_the_key_replaced_when_configured() -> None:
    incoming = {
        "Connection": "keep-alive, X-Hop",
        "X-Hop": "1",
        "Keep-Alive": "timeout=5",
        "Transfer-Encoding": "chunked",
        "Host": "router",
        "Authorization": "Bearer client",
        "X-Request-Id": "r1",
    }
    passed = upstream_headers(incoming, None)
    assert dict(passed) == {"Authorization": "Bearer client", "X-Request-Id": "r1"}
    assert upstream_headers(incoming, "secret")["Authorization"] == "Bearer secret"
    back = downstream_headers({"Content-Length": "3", "Connection": "close", "X-A": "b"})
    assert dict(back) == {"Content-Length": "3", "X-A": "b"}


def test_the_plain_counting_exports_what_prometheus_clients_histogram_would() -> None:
    # The oracle: prometheus_client's own Histogram, fed the same observations, bound
    # values included (le is "at or below").
    observed = [0.001, 0.005, 0.0051, 0.3, 1.0, 7.0, 299.0, 1000.0]
    oracle_registry = CollectorRegistry()
    oracle = Histogram(
        "llmhealth_router_time_to_first_byte_seconds",
        "x",
        ["backend"],
        registry=oracle_registry,
        buckets=FIRST_BYTE_BUCKETS,
    )
    router = Router(RouterConfig(), [Backend("a", "http://127.0.0.1:9")])
    for value in observed:
        oracle.labels("a").observe(value)
        router.metrics.backend("a").first_byte.observe(value)

    def samples(registry: CollectorRegistry) -> list[str]:
        return [
            line
            for line in generate_latest(registry).decode().splitlines()
            if line.startswith("llmhealth_router_time_to_first_byte_seconds_")
            and "_created" not in line
        ]

    assert samples(router.registry) == samples(oracle_registry)
    assert len(samples(router.registry)) == len(FIRST_BYTE_BUCKETS) + 3  # +Inf, count, sum


# --- forwarding ----------------------------------------------------------------------------


@pytest.mark.usefixtures("each_loop")
def test_a_request_is_forwarded_byte_for_byte_and_answered_by_the_backend(
    httpserver: HTTPServer,
) -> None:
    seen: list[Request] = []

    def answer(request: Request) -> Response:
        seen.append(request)
        return Response('{"ok": true}', content_type="application/json")

    httpserver.expect_request(CHAT, method="POST").respond_with_handler(answer)

    async def scenario() -> None:
        async with routing({"a": httpserver.url_for("")}) as (router, url), client() as http:
            response = await http.post(
                url + CHAT + "?x=1&y=a%20b%2Fc",
                content=BODY,
                headers={
                    "Authorization": "Bearer client-key",
                    "X-Trace": "t1",
                    "X-Name": "café".encode(),  # bytes beyond ASCII pass as they came
                },
            )
            assert response.status_code == 200
            assert response.json() == {"ok": True}
            assert await failures(router) == [("a", None, None)]

    run(scenario())
    (request,) = seen
    assert request.get_data() == BODY
    assert request.args["x"] == "1"
    assert request.args["y"] == "a b/c"
    assert request.headers["X-Name"] == "café".encode().decode("latin-1")  # as WSGI reads it
    assert request.headers["Authorization"] == "Bearer client-key"
    assert request.headers["X-Trace"] == "t1"


async def send_head_and_body(
    writer: asyncio.StreamWriter, head: bytes, body: bytes, *, together: bool
) -> None:
    """One write, or the body a moment after the head: the two ways a peer's bytes come."""
    if together:
        writer.write(head + body)
    else:
        writer.write(head)
        await writer.drain()
        await asyncio.sleep(0.05)
        writer.write(body)
    await writer.drain()


@pytest.mark.parametrize("pieces", [1, 2], ids=["whole-with-the-headers", "body-later"])
def test_an_answer_keeps_the_backends_status_headers_and_bytes(pieces: int) -> None:
    # One write: the body is in hand with the headers (relayed in one send). Two, the body
    # a moment later: the streamed relay. The client must not be able to tell them apart.
    body = b"\x00\xff raw bytes, passed on as they came"
    head = (
        b"HTTP/1.1 201 Made\r\nContent-Type: application/octet-stream\r\n"
        b"X-Request-Id: r-1\r\nContent-Length: %d\r\n\r\n" % len(body)
    )

    async def answers(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        await send_head_and_body(writer, head, body, together=pieces == 1)
        await reader.read()  # until the router closes its end
        writer.close()

    async def scenario() -> None:
        async with (
            raw_backend(answers) as backend,
            routing({"a": backend}) as (router, url),
            client() as http,
        ):
            response = await http.post(url + CHAT, content=BODY)
            assert (response.status_code, response.reason_phrase) == (201, "Made")
            assert response.headers["X-Request-Id"] == "r-1"
            assert response.headers["Content-Type"] == "application/octet-stream"
            assert response.headers["Content-Length"] == str(len(body))
            assert response.headers[BACKEND_HEADER] == "a"
            assert await response.aread() == body
            assert await failures(router) == [("a", None, None)]

    run(scenario())


def test_a_configured_api_key_replaces_the_clients(
    httpserver: HTTPServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ROUTER_TEST_KEY", "backend-key")
    httpserver.expect_request(
        CHAT, headers={"Authorization": "Bearer backend-key"}
    ).respond_with_json({"ok": True})

    async def scenario() -> None:
        backends = {"a": httpserver.url_for("")}
        async with (
            routing(backends, keys={"a": "ROUTER_TEST_KEY"}) as (_, url),
            client() as http,
        ):
            headers = {"Authorization": "Bearer client-key"}
            response = await http.post(url + CHAT, content=BODY, headers=headers)
            assert response.status_code == 200

    run(scenario())


def test_the_router_answers_models_health_metrics_and_unrouted_paths_itself(
    httpserver: HTTPServer,
) -> None:
    # Any request reaching the backend would fail the test: the router must answer alone.
    async def scenario() -> None:
        models = {"a": frozenset({"llama"}), "b": frozenset({"qwen", "llama"})}
        backends = {"a": httpserver.url_for(""), "b": httpserver.url_for("/b")}
        async with routing(backends, models=models) as (router, url), client() as http:
            listed = (await http.get(url + "/v1/models")).json()
            assert [m["id"] for m in listed["data"]] == ["llama", "qwen"]
            health = await http.get(url + "/health")
            assert health.status_code == 200
            assert health.json()["backends"] == {"a": "healthy", "b": "healthy"}
            metrics = (await http.get(url + "/metrics")).text
            assert "llmhealth_router_serving_backends 2.0" in metrics
            assert "vllm:" not in metrics
            missing = await http.post(url + "/v1/secret", content=BODY)
            assert missing.status_code == 404
            assert missing.json() == {"error": "not routed: /v1/secret"}
            router.push({}, {"a": "dead", "b": "suspect"}, 1)
            health = await http.get(url + "/health")
            assert health.status_code == 503
            assert health.json()["status"] == "floor breached"

    run(scenario())
    assert httpserver.log == []


def test_health_counts_a_backend_dropped_after_a_failure_as_not_serving(
    httpserver: HTTPServer,
) -> None:
    """Until the next settle a dropped backend is sent nothing, so a router with none
    left answers every request no_backend_status: its /health must not say "ok" then, or
    the load balancer in front keeps sending it what it cannot serve."""
    httpserver.expect_request(CHAT).respond_with_data("engine dead", status=500)

    async def scenario() -> None:
        async with routing({"a": httpserver.url_for("")}) as (router, url), client() as http:
            assert (await http.get(url + "/health")).status_code == 200
            assert (await http.post(url + CHAT, content=BODY)).status_code == 500
            health = await http.get(url + "/health")
            assert health.status_code == 503
            assert health.json()["status"] == "every serving backend dropped after a failed request"
            assert health.json()["serving"] == 1  # the ledger's count and states, unchanged
            assert health.json()["backends"] == {"a": "healthy"}
            assert health.json()["dropped"] == ["a"]
            router.drain()  # the next settle hears the failure and keeps the backend
            router.push({"a": ANY_MODEL}, {"a": "healthy"}, 1)
            health = await http.get(url + "/health")
            assert (health.status_code, health.json()["serving"]) == (200, 1)
            assert health.json()["dropped"] == []

    run(scenario())


def test_health_with_a_floor_of_zero_and_nothing_serving_is_503() -> None:
    """A floor of 0 is never breached, yet with nothing serving the router answers every
    request no_backend_status: its /health said "ok" then, and the load balancer in front
    kept sending it what it could not serve (README: 200 only while it has one to send to)."""

    async def scenario() -> None:
        async with routing({"a": refused_url()}) as (router, url), client() as http:
            router.push({}, {"a": "dead"}, 0)
            assert (await http.post(url + CHAT, content=BODY)).status_code == 503
            health = await http.get(url + "/health")
            assert health.status_code == 503
            assert health.json()["status"] == "no backend serving"
            assert (health.json()["serving"], health.json()["min_healthy"]) == (0, 0)
            router.push({"a": ANY_MODEL}, {"a": "healthy"}, 0)
            health = await http.get(url + "/health")
            assert (health.status_code, health.json()["status"]) == (200, "ok")

    run(scenario())


def test_health_stays_ok_with_one_backend_dropped_while_another_serves(
    httpserver: HTTPServer,
) -> None:
    """The floor is the ledger's: one backend's failed request breaches nothing while
    the router still sends to the others (a 503 there would take a working router out)."""
    httpserver.expect_request(CHAT).respond_with_data("engine dead", status=500)
    httpserver.expect_request("/b" + CHAT).respond_with_json({"ok": True})

    async def scenario() -> None:
        backends = {"a": httpserver.url_for(""), "b": httpserver.url_for("/b")}
        async with routing(backends) as (router, url), client() as http:
            router.push(dict.fromkeys(backends, ANY_MODEL), dict.fromkeys(backends, "healthy"), 2)
            assert (await http.post(url + CHAT, content=BODY)).status_code == 500  # "a" first
            health = await http.get(url + "/health")
            assert (health.status_code, health.json()["status"]) == (200, "ok")
            assert health.json()["dropped"] == ["a"]
            assert (await http.post(url + CHAT, content=BODY)).status_code == 200

    run(scenario())


def test_a_metrics_page_is_rendered_beside_the_loop_not_on_it() -> None:
    """The page holds every backend's series and, in `route`, the daemon's: at 1,000
    backends a render is 0.2 s of CPU, on the loop that every stream waits on, per
    request, and any client of the router may ask for it again and again."""
    entered, release, returned = threading.Event(), threading.Event(), threading.Event()

    class Slow(Collector):
        def describe(self) -> list[Metric]:
            return []  # registered without a collect(), which would block right there

        def collect(self) -> Iterator[Metric]:
            entered.set()
            release.wait(5)  # a bound for the failing case only: set below once answered
            returned.set()
            yield from ()

    async def scenario() -> None:
        router = Router(RouterConfig(), [Backend("a", refused_url())], collectors=[Slow()])
        port = free_port()
        await router.start("127.0.0.1", port)
        url = f"http://127.0.0.1:{port}"
        try:
            async with client() as http:
                scrapes = [asyncio.ensure_future(http.get(url + "/metrics")) for _ in range(2)]
                assert await asyncio.to_thread(entered.wait, BOUND)
                health = await http.get(url + "/health")
                assert health.status_code == 503  # answered while the page is rendered
                assert not returned.is_set()
                release.set()
                for scrape in scrapes:
                    assert (await scrape).status_code == 200
        finally:
            release.set()
            await router.close()

    run(scenario())


def test_a_reload_that_drops_a_backend_drops_its_series(httpserver: HTTPServer) -> None:
    """Frozen counters of a backend no longer configured kept alerts firing and grew the
    page with every rename; the router's own answers ('none') are not a backend's."""
    httpserver.expect_request(CHAT).respond_with_json({"ok": True})

    metrics = ""

    async def scenario() -> None:
        nonlocal metrics
        backends = {"a": httpserver.url_for(""), "gone": refused_url()}
        async with routing(backends) as (router, url), client() as http:
            assert (await http.post(url + "/v1/secret", content=BODY)).status_code == 404
            for _ in range(3):
                await http.post(url + CHAT, content=BODY)
            assert 'backend="gone"' in (await http.get(url + "/metrics")).text
            router.configure([Backend("a", httpserver.url_for(""))])
            metrics = (await http.get(url + "/metrics")).text

    run(scenario())
    assert 'backend="gone"' not in metrics
    assert 'llmhealth_router_requests_total{backend="none",code="404"} 1.0' in metrics
    assert 'llmhealth_router_in_flight_requests{backend="a"} 0.0' in metrics


def test_the_in_flight_counts_keep_no_entry_for_backends_reloads_dropped(
    httpserver: HTTPServer,
) -> None:
    """A count of 0 stayed behind for every name a request was ever sent to: a fleet
    whose names change with each reload (pods) grew the router's memory for good."""
    httpserver.expect_request(CHAT).respond_with_json({"ok": True})
    kept: set[str] = set()

    async def scenario() -> None:
        nonlocal kept
        async with routing({"pod-0": httpserver.url_for("")}) as (router, url), client() as http:
            for i in range(1, 30):
                assert (await http.post(url + CHAT, content=BODY)).status_code == 200
                await quiet(router)
                name = f"pod-{i}"
                router.configure([Backend(name, httpserver.url_for(""))])
                router.push({name: ANY_MODEL}, {name: "healthy"}, 1)
            kept = set(router.metrics.in_flight)

    run(scenario())
    assert kept <= {"pod-29"}


@pytest.mark.parametrize("answer", [b"200 OK", b"503 Busy"])
def test_a_backend_a_reload_drops_mid_request_gets_no_series_back(answer: bytes) -> None:
    """Its answer, heard after the reload, put its requests_total back on the page, a
    series no reload would drop again (its name is no longer configured)."""
    asked, go = asyncio.Event(), asyncio.Event()

    async def slow(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        asked.set()
        await go.wait()
        writer.write(b"HTTP/1.1 " + answer + b"\r\nContent-Length: 2\r\n\r\nok")
        await writer.drain()
        writer.close()

    async def scenario() -> None:
        async with (
            raw_backend(slow) as gone,
            routing({"gone": gone, "stays": refused_url()}, models={"stays": frozenset()}) as (
                router,
                url,
            ),
            client() as http,
        ):
            request = asyncio.ensure_future(http.post(url + CHAT, content=BODY))
            async with asyncio.timeout(BOUND):
                await asked.wait()
            router.configure([Backend("stays", refused_url())])
            go.set()
            await request
            await quiet(router)
            metrics = (await http.get(url + "/metrics")).text
        assert 'backend="gone"' not in metrics

    run(scenario())


def test_a_reload_that_drops_a_serving_backend_sends_it_nothing_before_the_next_push(
    httpserver: HTTPServer,
) -> None:
    """Until the next settle pushed, the dropped backend stayed in the pick set with no
    address: every request it was chosen for got a 500 (least in flight chose it)."""
    httpserver.expect_request(CHAT).respond_with_json({"ok": True})

    async def scenario() -> None:
        # "a-gone" sorts first: ties of least in flight go to it.
        backends = {"a-gone": refused_url(), "b": httpserver.url_for("")}
        async with routing(backends) as (router, url), client() as http:
            router.configure([Backend("b", httpserver.url_for(""))])
            for _ in range(3):
                response = await http.post(url + CHAT, content=BODY)
                assert response.status_code == 200
                assert response.headers["X-LLMHealth-Backend"] == "b"
            assert "a-gone" not in (await http.get(url + "/health")).text

    run(scenario())


def test_a_reload_that_moves_a_backend_sends_it_nothing_before_the_next_push(
    httpserver: HTTPServer,
) -> None:
    """At its new address it stayed in the pick set until the settle that reads it there:
    traffic went to an unproven process, and failures there were thrown away."""
    httpserver.expect_request(CHAT).respond_with_json({"ok": True})

    async def scenario() -> None:
        # "a" sorts first: ties of least in flight go to it.
        backends = {"a": httpserver.url_for(""), "b": httpserver.url_for("")}
        async with routing(backends) as (router, url), client() as http:
            router.configure([Backend("a", refused_url()), Backend("b", httpserver.url_for(""))])
            for _ in range(3):
                response = await http.post(url + CHAT, content=BODY)
                assert response.status_code == 200
                assert response.headers["X-LLMHealth-Backend"] == "b"
            assert "a" not in await drained(router)  # nothing sent to the new address
            # Written another way is no move: it stays (the settle sees no move either).
            router.configure(
                [Backend("a", refused_url()), Backend("b", httpserver.url_for("").upper())]
            )
            response = await http.post(url + CHAT, content=BODY)
            assert response.headers["X-LLMHealth-Backend"] == "b"

    run(scenario())


def test_bad_requests_get_a_4xx_and_count_against_nobody(httpserver: HTTPServer) -> None:
    async def scenario() -> None:
        settings = RouterConfig(max_body=2048)
        async with (
            routing({"a": httpserver.url_for("")}, settings) as (router, url),
            client() as http,
        ):
            for body, status in [
                (b"{broken", 400),
                (b'{"prompt": "no model"}', 400),
                (b'{"model": "tiny", "prompt": "' + b"x" * 5000 + b'"}', 413),
            ]:
                response = await http.post(url + CHAT, content=body)
                assert response.status_code == status
                assert "error" in response.json()
            assert (await drained(router)) == {}

    run(scenario())
    assert httpserver.log == []


@pytest.mark.parametrize("whole", [True, False], ids=["with-the-head", "after-the-head"])
def test_a_body_over_max_body_gets_a_413_however_it_arrives(
    httpserver: HTTPServer, whole: bool
) -> None:
    body = b'{"model": "tiny", "prompt": "' + b"x" * 5000 + b'"}'
    head = b"POST %s HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % (
        CHAT.encode(),
        len(body),
    )

    async def scenario() -> None:
        async with routing({"a": httpserver.url_for("")}, RouterConfig(max_body=2048)) as (
            router,
            url,
        ):
            port = int(url.rsplit(":", 1)[1])
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            # together: the router finds the body complete with the head
            await send_head_and_body(writer, head, body, together=whole)
            status_line = await reader.readline()
            writer.close()
            assert status_line.split()[1] == b"413"
            assert (await drained(router)) == {}

    run(scenario())
    assert httpserver.log == []


@pytest.mark.parametrize(
    "head",
    [
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nX-Big: " + b"x" * 100_000,
        b"POST /v1/chat/completions HTTP/1.1\r\n" + b"X-Many: 1\r\n" * 1000,
        b"NOT HTTP AT ALL\r\n",
    ],
    ids=["one-huge-header", "a-thousand-headers", "garbage"],
)
def test_a_request_head_beyond_the_bounds_gets_a_4xx_and_counts_against_nobody(
    httpserver: HTTPServer, head: bytes
) -> None:
    httpserver.expect_request(CHAT).respond_with_json({"ok": True})

    async def scenario() -> None:
        async with routing({"a": httpserver.url_for("")}) as (router, url), client() as http:
            port = int(url.rsplit(":", 1)[1])
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(head + b"\r\n\r\n")
            await writer.drain()
            status_line = await asyncio.wait_for(reader.readline(), BOUND)
            writer.close()
            version, status = status_line.split(b" ")[:2]
            assert version.startswith(b"HTTP/1.") and status.startswith(b"4"), status_line
            assert (await http.post(url + CHAT, content=BODY)).status_code == 200  # others go on
            assert await failures(router) == [("a", None, None)]

    run(scenario())


@pytest.mark.parametrize(
    "target",
    [
        b"%2Fv1%2Fchat%2Fcompletions",
        b"v1/chat/completions",
        b"host:443",
        # "://" in its query or fragment passed it for a URL, whose path had no "/"
        b"%2Fv1%2Fchat%2Fcompletions?next=http://x",
        b"%2Fv1%2Fchat%2Fcompletions#://",
        b"http:%2Fv1%2Fchat%2Fcompletions?://",
    ],
)
def test_a_target_neither_a_path_nor_a_url_is_400_and_never_sent_on(target: bytes) -> None:
    """RFC 9112 3.2: a request's target is a path (origin-form) or a URL (absolute-form,
    sent on as its path). One that only decoded to a route was sent on as it came, a
    request line with no path that backends read each their own way (served, refused),
    and a backend closing on it had the client's malformed request counted against it."""
    sent: list[bytes] = []

    async def answers(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(asyncio.IncompleteReadError, ConnectionError):
            sent.append(await read_request(reader))
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
            await writer.drain()
        writer.close()

    async def scenario() -> None:
        async with raw_backend(answers) as backend, routing({"a": backend}) as (router, url):
            reader, writer = await asyncio.open_connection("127.0.0.1", int(url.split(":")[-1]))
            writer.write(
                b"POST %s HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s"
                % (target, len(BODY), BODY)
            )
            status_line = await asyncio.wait_for(reader.readline(), BOUND)
            writer.close()
            assert status_line.split()[1] == b"400", status_line
            assert await drained(router) == {}

    run(scenario())
    assert sent == []


def test_nothing_serving_the_model_is_answered_at_once_naming_every_backend() -> None:
    async def scenario() -> None:
        backends = {"a": refused_url(), "b": refused_url()}
        async with (
            routing(backends, models={"a": frozenset({"llama"})}) as (router, url),
            client() as http,
        ):
            router.push({"a": frozenset({"llama"})}, {"a": "healthy", "b": "dead"}, 1)
            response = await http.post(url + CHAT, content=BODY)
            assert response.status_code == 503
            assert response.headers["Retry-After"] == "5"
            assert response.json() == {
                "error": "no backend is serving model 'tiny'",
                "backends": {"a": "healthy (serves other models)", "b": "dead"},
            }

    run(scenario())


def test_a_model_name_past_any_served_ids_length_is_refused_and_never_echoed_whole() -> None:
    # A model of half a million characters that are not printable took the loop's time to
    # escape (a second for a 16 MiB body), and the 503 named it escaped twice: 2.7 MB
    # answered to a 1 MiB request (58 MB to 16 MiB), held whole while a client read it.
    huge = json.dumps({"model": "\x85" * (512 * 1024)}, ensure_ascii=False).encode()
    long = json.dumps({"model": "\x85" * 20_000}, ensure_ascii=False).encode()

    async def scenario() -> None:
        served = {"a": frozenset({"llama"})}
        async with (
            routing({"a": refused_url()}, models=served) as (router, url),
            client() as http,
        ):
            response = await http.post(url + CHAT, content=huge)
            assert response.status_code == 400
            assert "model name over" in response.json()["error"]
            assert len(response.content) < 1024
            response = await http.post(url + CHAT, content=long)  # within the bound
            assert response.status_code == 503
            assert len(response.content) < 2048  # the name shown cut, not its 80,000 bytes
            assert await failures(router) == []

    run(scenario())


# --- failures, counted where they happen -----------------------------------------------------


@pytest.mark.usefixtures("each_loop")
def test_a_refused_connection_is_retried_once_elsewhere_and_counted_against_the_first(
    httpserver: HTTPServer,
) -> None:
    httpserver.expect_request(CHAT).respond_with_json({"ok": True})

    async def scenario() -> None:
        # "a" sorts first, so an idle router tries it first.
        backends = {"a": refused_url(), "b": httpserver.url_for("")}
        async with routing(backends) as (router, url), client() as http:
            response = await http.post(url + CHAT, content=BODY)
            assert response.status_code == 200
            assert await failures(router) == [("a", FailureKind.REFUSED, None), ("b", None, None)]
            # Reflex drop: "a" is not tried again before the next settle.
            assert (await http.post(url + CHAT, content=BODY)).status_code == 200
            assert await failures(router) == [("b", None, None)]
            metrics = (await http.get(url + "/metrics")).text
            assert 'llmhealth_router_backend_failures_total{backend="a",kind="refused"} 1.0' in (
                metrics
            )
            assert "llmhealth_router_retries_total 1.0" in metrics

    run(scenario())


def test_a_retry_with_nowhere_to_go_is_a_deliberate_500() -> None:
    async def scenario() -> None:
        async with routing({"a": refused_url()}) as (router, url), client() as http:
            response = await http.post(url + CHAT, content=BODY)
            assert response.status_code == 500
            assert response.json()["backend"] == "a"
            error = response.json()["error"]
            assert error.startswith("backend failed: connection failed: "), error
            assert error.endswith(", and no other backend serves"), error
            assert await failures(router) == [("a", FailureKind.REFUSED, None)]
            # No second backend was tried: no retry counted.
            metrics = (await http.get(url + "/metrics")).text
            assert "llmhealth_router_retries_total 0.0" in metrics

    run(scenario())


@pytest.mark.usefixtures("each_loop")
def test_no_response_headers_within_first_byte_timeout_is_a_500_and_counted() -> None:
    requests_seen = asyncio.Event()

    async def accepts_and_says_nothing(
        reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        await read_request(reader)
        requests_seen.set()
        await reader.read()  # until the router gives up and closes
        writer.close()

    async def scenario() -> None:
        settings = RouterConfig(first_byte_timeout=0.5)
        async with (
            raw_backend(accepts_and_says_nothing) as hung,
            routing({"a": hung}, settings) as (router, url),
            client() as http,
        ):
            response = await http.post(url + CHAT, content=BODY)
            assert requests_seen.is_set()
            assert response.status_code == 500
            assert response.json() == {
                "error": "backend failed: no response headers within 0.5 s",
                "backend": "a",
            }
            assert await failures(router) == [("a", FailureKind.FIRST_BYTE_TIMEOUT, None)]
            # Dropped at once: the next request is told nothing serves, not held again.
            assert (await http.post(url + CHAT, content=BODY)).status_code == 503

    run(scenario())


@pytest.mark.usefixtures("each_loop")
def test_a_stream_that_goes_silent_ends_with_an_sse_error_event_and_is_counted() -> None:
    async def one_chunk_then_silence(
        reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        await read_request(reader)
        writer.write(SSE_CHUNKED_HEAD)
        chunk = b'data: {"choices": [{"delta": {"content": "hel"}}]}\n\n'
        writer.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
        await writer.drain()
        await reader.read()
        writer.close()

    async def scenario() -> None:
        settings = RouterConfig(stream_idle_timeout=0.5)
        async with (
            raw_backend(one_chunk_then_silence) as silent,
            routing({"a": silent}, settings) as (router, url),
            client() as http,
        ):
            response = await http.post(url + CHAT, content=BODY)
            assert response.status_code == 200  # the headers had gone out already
            assert response.text.startswith('data: {"choices"')
            assert "event: error\ndata: " in response.text
            event = response.text.split("event: error\ndata: ", 1)[1].strip()
            assert json.loads(event)["backend"] == "a"
            assert "silent for 0.5 s" in json.loads(event)["error"]["message"]
            assert await failures(router) == [("a", FailureKind.STREAM_IDLE, 200)]

    run(scenario())


@pytest.mark.parametrize(
    ("status", "counted"), [(500, True), (503, True), (400, False), (404, False), (429, False)]
)
def test_a_backends_5xx_is_passed_through_and_counted_and_its_4xx_never(
    httpserver: HTTPServer, status: int, counted: bool
) -> None:
    httpserver.expect_request(CHAT).respond_with_json({"error": "from vllm"}, status=status)

    async def scenario() -> None:
        async with routing({"a": httpserver.url_for("")}) as (router, url), client() as http:
            response = await http.post(url + CHAT, content=BODY)
            assert response.status_code == status
            assert response.json() == {"error": "from vllm"}
            expected = [("a", FailureKind.SERVER_ERROR, status)] if counted else []
            assert await failures(router) == expected

    run(scenario())


@pytest.mark.parametrize(
    ("reason", "recorded"),
    [
        # `status` shows the last error: a terminal escape must not reach the screen.
        (b"\x1b]0;owned\x07 sorry", "\\x1b]0;owned\\x07 sorry"),
        # Up to most of the 64 KiB head, the backend's to choose: cut to 200 characters
        # as every other detail the router records (_short), then escaped.
        (b"\x80" * 60_000, "\\x80" * 200),
    ],
    ids=["escape", "huge"],
)
def test_a_5xx_reason_phrase_is_recorded_printable_and_bounded(
    reason: bytes, recorded: str
) -> None:
    async def says(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 500 " + reason + b"\r\nContent-Length: 0\r\n\r\n")
        await writer.drain()
        writer.close()

    async def scenario() -> None:
        async with (
            raw_backend(says) as bad,
            routing({"a": bad}) as (router, url),
            client() as http,
        ):
            assert (await http.post(url + CHAT, content=BODY)).status_code == 500
            (outcome,) = (await drained(router))["a"]
        assert outcome.detail.endswith(recorded), outcome.detail[:300]
        assert len(outcome.detail) < len(recorded) + 100

    run(scenario())


@pytest.mark.parametrize(
    "reply",
    [
        b"this is not HTTP\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nonly part",
        b"",
        # A status code below 100 is no HTTP status (RFC 9110 15): it was relayed as
        # "HTTP/1.1 99", a line no client reads, its body dropped as a 1xx's, and counted
        # as the backend's success.
        b"HTTP/1.1 099 Odd\r\nContent-Length: 2\r\n\r\nok",
    ],
    ids=["garbage", "closed-mid-body", "closed-before-answering", "status-below-100"],
)
def test_a_backend_that_sends_garbage_or_closes_early_is_counted(reply: bytes) -> None:
    async def misbehaves(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(reply)
        await writer.drain()
        writer.close()

    async def scenario() -> None:
        async with (
            raw_backend(misbehaves) as bad,
            routing({"a": bad}) as (router, url),
            client() as http,
        ):
            with contextlib.suppress(httpx.HTTPError):  # a cut-off body is cut off here too
                response = await http.post(url + CHAT, content=BODY)
                assert response.status_code in (200, 500)
            assert await failures(router) == [
                ("a", FailureKind.BROKEN, 200 if b"only" in reply else None)
            ]

    run(scenario())


@pytest.mark.parametrize(("bound", "stall"), [(0.2, 1.0), (1.0, 1.2)])
def test_a_connect_timeout_while_the_routers_own_loop_was_held_up_is_not_the_backends(
    monkeypatch: pytest.MonkeyPatch, httpserver: HTTPServer, bound: float, stall: float
) -> None:
    # Forty 16 MiB token-id bodies parsed on the loop held it up for seconds; the connect
    # bounds that expired meanwhile were counted as refusals, and a healthy backend was
    # condemned by the router's own stall. Here the loop is held up once, right after a
    # real connect began. A stall that ends just past the bound (1.2 s against 1 s) ran
    # the connect's completion and its time out in one turn, heard 0.2 s late: the
    # backend was charged until the loop's lateness during the connect counted.
    httpserver.expect_request(CHAT).respond_with_json({})
    real_connect = Pool._connect
    stalls: list[float] = []

    async def connect_then_hold_up(pool: Pool, origin: Origin) -> Any:
        attempt = asyncio.ensure_future(real_connect(pool, origin))
        await asyncio.sleep(0)
        if not stalls:
            stalls.append(stall)
            time.sleep(stall)  # CPU of the router's own, past the bound
        return await attempt

    monkeypatch.setattr(Pool, "_connect", connect_then_hold_up)

    async def scenario() -> None:
        settings = RouterConfig(connect_timeout=bound)
        backends = {"a": httpserver.url_for("").rstrip("/")}
        async with routing(backends, settings) as (router, url), client() as http:
            first = await http.post(url + CHAT, content=BODY)
            assert first.status_code == 503  # nowhere else to send it: the router's own
            assert first.headers["Retry-After"] == "5"
            assert "the router itself" in first.json()["error"]
            assert "backend" not in first.json()
            assert router.metrics.late_timeouts == 1
            assert await failures(router) == []  # nothing against the backend
            assert (await http.post(url + CHAT, content=BODY)).status_code == 200

    run(scenario())


@pytest.mark.parametrize(
    "shortage",
    [
        errno.EMFILE,
        # No local port left for one more connection (every one of the ephemeral range in
        # use or in TIME_WAIT towards that backend, the router closing its idle links
        # first): the router's own shortage too, counted as the backend refusing, and a
        # burst of connections condemned every backend (seen in a network namespace with
        # a narrowed ip_local_port_range).
        errno.EADDRNOTAVAIL,
    ],
    ids=["EMFILE", "EADDRNOTAVAIL"],
)
def test_a_connection_the_router_had_no_descriptor_for_is_not_the_backends(
    monkeypatch: pytest.MonkeyPatch, httpserver: HTTPServer, shortage: int
) -> None:
    # EMFILE from the router's own process was counted as the backend refusing: a router
    # out of descriptors condemned every backend it tried. The shortage is injected where
    # the kernel says it, at the backend's connect, and only while the test wants it.
    httpserver.expect_request(CHAT).respond_with_json({})
    backend = ("127.0.0.1", httpserver.port)
    short = [True]
    real_connect = socket.socket.connect

    def connect(sock: socket.socket, address: Any) -> None:
        # TCP's connect alone: a UDP socket's, which takes none of TCP's ports, still has
        # an address to send from (``own_connect_shortage``).
        if short[0] and address == backend and sock.type == socket.SOCK_STREAM:
            raise OSError(shortage, os.strerror(shortage))
        real_connect(sock, address)

    monkeypatch.setattr(socket.socket, "connect", connect)

    async def scenario() -> None:
        backends = {"a": httpserver.url_for("").rstrip("/")}
        async with routing(backends) as (router, url), client() as http:
            first = await http.post(url + CHAT, content=BODY)
            assert first.status_code == 503  # nowhere else to send it: the router's own
            assert first.headers["Retry-After"] == "5"
            assert "in the router's own process" in first.json()["error"]
            assert await failures(router) == []  # nothing against the backend
            metrics = (await http.get(url + "/metrics")).text
            assert "llmhealth_router_own_connect_failures_total 1.0" in metrics
            assert 'llmhealth_router_requests_total{backend="none",code="503"} 1.0' in metrics
            assert 'backend="a",code="503"' not in metrics
            short[0] = False
            assert (await http.post(url + CHAT, content=BODY)).status_code == 200

    run(scenario())


def test_a_backend_this_host_has_no_address_to_send_to_is_the_backends_failure(
    monkeypatch: pytest.MonkeyPatch, httpserver: HTTPServer
) -> None:
    # EADDRNOTAVAIL also says this host has no source address towards the backend (IPv6
    # turned off, as containers have it by default, and a backend at an IPv6 address):
    # taken for a want of local ports, it was never counted against the backend, which
    # stayed in the choice for ever. Injected as the kernel says it then: at every
    # connect to that address, a UDP socket's too.
    backend = ("127.0.0.1", httpserver.port)
    real_connect = socket.socket.connect

    def connect(sock: socket.socket, address: Any) -> None:
        if address == backend:
            raise OSError(errno.EADDRNOTAVAIL, os.strerror(errno.EADDRNOTAVAIL))
        real_connect(sock, address)

    monkeypatch.setattr(socket.socket, "connect", connect)

    async def scenario() -> None:
        backends = {"a": httpserver.url_for("").rstrip("/")}
        async with routing(backends) as (router, url), client() as http:
            response = await http.post(url + CHAT, content=BODY)
            assert "in the router's own process" not in response.text
            assert await failures(router) == [("a", FailureKind.REFUSED, None)]
            metrics = (await http.get(url + "/metrics")).text
            assert "llmhealth_router_own_connect_failures_total 0.0" in metrics

    run(scenario())


def test_big_bodies_are_parsed_one_per_turn_of_the_loop(
    monkeypatch: pytest.MonkeyPatch, httpserver: HTTPServer
) -> None:
    # json holds the loop while it parses (0.4 s for a 16 MiB token-id prompt). Bodies
    # that arrived together were parsed in one turn of the loop, which polled no socket
    # for seconds. Counted here in turns, not seconds: a ticker runs once per turn.
    httpserver.expect_request(CHAT).respond_with_json({})
    parses_this_turn = [0]
    most_in_one_turn = [0]
    real_model_of = router_module.model_of

    def slow_model_of(body: bytes) -> tuple[str | None, dict[str, object] | None]:
        time.sleep(0.2)  # a slow parse: the other bodies arrive meanwhile
        parses_this_turn[0] += 1
        most_in_one_turn[0] = max(most_in_one_turn[0], parses_this_turn[0])
        return real_model_of(body)

    monkeypatch.setattr(router_module, "model_of", slow_model_of)
    big = json.dumps({"model": "tiny", "prompt": "x" * router_module.BIG_BODY}).encode()

    async def scenario() -> None:
        loop = asyncio.get_running_loop()
        ticking = True

        def tick() -> None:
            parses_this_turn[0] = 0
            if ticking:
                loop.call_soon(tick)

        tick()
        backends = {"a": httpserver.url_for("").rstrip("/")}
        async with routing(backends) as (_, url), client() as http:
            answers = await asyncio.gather(
                *(http.post(url + CHAT, content=big) for _ in range(4)),
            )
        ticking = False
        assert [answer.status_code for answer in answers] == [200] * 4

    run(scenario())
    assert most_in_one_turn[0] == 1


def test_a_backend_that_trickles_its_response_head_is_bounded_by_first_byte_timeout() -> None:
    """A byte at a time, each well inside any read timeout: only a bound on the whole head
    ends it, and the client gets the deliberate 500, not a hang."""
    stopped = asyncio.Event()

    async def trickles(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        try:
            for byte in b"HTTP/1.1 200 OK\r\nX-Slow: " + b"x" * 10_000:
                writer.write(bytes([byte]))
                await writer.drain()
                await asyncio.sleep(0.02)
        except ConnectionError:
            stopped.set()  # the router hung up on it
        writer.close()

    async def scenario() -> None:
        settings = RouterConfig(first_byte_timeout=0.5)
        async with (
            raw_backend(trickles) as slow,
            routing({"a": slow}, settings) as (router, url),
            client() as http,
        ):
            response = await http.post(url + CHAT, content=BODY)
            assert response.status_code == 500
            assert response.json()["error"] == "backend failed: no response headers within 0.5 s"
            assert await failures(router) == [("a", FailureKind.FIRST_BYTE_TIMEOUT, None)]
            await asyncio.wait_for(stopped.wait(), BOUND)

    run(scenario())


# A media type's name is case-insensitive (RFC 9110 8.3.1): a backend's capitals must not
# turn its broken stream into a body cut off without a word.
@pytest.mark.parametrize(
    "media_type",
    ["text/event-stream", "Text/Event-Stream; charset=UTF-8"],
    ids=["lower", "capitals"],
)
def test_a_stream_cut_off_mid_way_ends_with_an_sse_error_event_and_is_counted(
    media_type: str,
) -> None:
    async def closes_mid_stream(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(SSE_CHUNKED_HEAD.replace(b"text/event-stream", media_type.encode()))
        chunk = b'data: {"choices": [{"delta": {"content": "hel"}}]}\n\n'
        writer.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
        writer.write(b"40\r\n")  # a chunk announced, then the connection ends
        await writer.drain()
        writer.close()

    async def scenario() -> None:
        async with (
            raw_backend(closes_mid_stream) as cut,
            routing({"a": cut}) as (router, url),
            client() as http,
        ):
            response = await http.post(url + CHAT, content=BODY)
            assert response.status_code == 200  # the headers had gone out already
            assert response.text.startswith('data: {"choices"')
            event = response.text.split("event: error\ndata: ", 1)[1].strip()
            assert json.loads(event)["backend"] == "a"
            assert "response cut off" in json.loads(event)["error"]["message"]
            assert await failures(router) == [("a", FailureKind.BROKEN, 200)]

    run(scenario())


def sse_events(text: str) -> list[tuple[str, str]]:
    """What an SSE client's parser dispatches (WHATWG's rules): (event type, data) each."""
    events: list[tuple[str, str]] = []
    kind, data = "message", []
    for line in re.split(r"\r\n|\r|\n", text):
        if not line:
            if data:
                events.append((kind, "\n".join(data)))
            kind, data = "message", []
            continue
        field, _, value = line.partition(":")
        value = value.removeprefix(" ")
        if field == "event":
            kind = value
        elif field == "data":
            data.append(value)
    return events


@pytest.mark.parametrize("then", ["close", "silence"])
def test_a_stream_broken_inside_an_event_is_cut_off_not_given_an_event_glued_to_it(
    then: str,
) -> None:
    # The error event went out straight after half an event: its "event: error" line was
    # read as the rest of the half's data line, and the client's parser dispatched one
    # message of both, which is no JSON (the OpenAI SDKs raised a decode error, not it).
    async def breaks_mid_event(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(SSE_CHUNKED_HEAD)
        chunk = b'data: {"choices": [{"delta": {"content": "hel"}}]}\n\n'
        writer.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
        writer.write(b"40\r\ndata: half a chu")  # a chunk begun inside an event
        await writer.drain()
        if then == "silence":
            await reader.read()
        writer.close()

    async def scenario() -> None:
        settings = RouterConfig(stream_idle_timeout=0.5)
        async with (
            raw_backend(breaks_mid_event) as cut,
            routing({"a": cut}, settings) as (router, url),
            client() as http,
        ):
            seen = ""
            with pytest.raises((httpx.RemoteProtocolError, httpx.ReadError)):
                async with http.stream("POST", url + CHAT, content=BODY) as response:
                    assert response.status_code == 200  # the headers had gone out already
                    async for text in response.aiter_text():
                        seen += text
            assert all(kind == "message" for kind, _ in sse_events(seen))
            assert "event: error" not in seen
            kind = FailureKind.BROKEN if then == "close" else FailureKind.STREAM_IDLE
            assert await failures(router) == [("a", kind, 200)]

    run(scenario())


@pytest.mark.parametrize(
    ("ending", "between"),
    [
        (b"\n\n", True),
        (b"\r\n\r\n", True),
        (b"\r\r", True),
        (b"\n\r\n", True),
        (b"\r\r\n", True),  # a line ended by CR, then a blank one by CRLF
        (b"\n", False),
        (b"\r\n", False),
        (b"\r", False),
    ],
)
def test_a_stream_broken_after_an_event_hears_the_error_event_whatever_its_line_ends(
    ending: bytes, between: bool
) -> None:
    # SSE ends a line with CRLF, LF or CR, and an event with a blank line: one whose
    # last event ended so, its last byte in a chunk of its own, hears the error event as
    # an event of its own; one stopped after a line but before the blank one is cut off.
    async def breaks_after(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(SSE_CHUNKED_HEAD)
        for chunk in (b'data: {"choices": []}' + ending[:-1], ending[-1:]):
            if chunk:
                writer.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                await writer.drain()
                await asyncio.sleep(0.05)  # relayed apart, not read as one chunk
        writer.write(b"40\r\n")  # a chunk announced, then the connection ends
        await writer.drain()
        writer.close()

    async def scenario() -> None:
        async with (
            raw_backend(breaks_after) as cut,
            routing({"a": cut}) as (router, url),
            client() as http,
        ):
            if between:
                response = await http.post(url + CHAT, content=BODY)
                events = sse_events(response.text)
                assert [kind for kind, _ in events] == ["message", "error"]
                assert json.loads(events[1][1])["backend"] == "a"
            else:
                with pytest.raises((httpx.RemoteProtocolError, httpx.ReadError)):
                    await http.post(url + CHAT, content=BODY)
            assert await failures(router) == [("a", FailureKind.BROKEN, 200)]

    run(scenario())


def test_a_stream_framed_by_length_that_breaks_is_cut_off_not_given_an_event_past_it() -> None:
    # The error event went out past the declared length: a client short of fewer bytes
    # than the event read a whole body, a piece of the event at its end.
    async def breaks_short(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        body = b"data: " + b"x" * 300 + b"\n\n"
        writer.write(
            b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
            b"Content-Length: %d\r\n\r\n%s" % (len(body) + 40, body)
        )
        await writer.drain()
        await asyncio.sleep(0.2)
        writer.close()  # 40 bytes short

    async def scenario() -> None:
        async with (
            raw_backend(breaks_short) as cut,
            routing({"a": cut}) as (router, url),
            client() as http,
        ):
            # Reset or ended short: either way the client knows the body is not whole.
            with pytest.raises((httpx.RemoteProtocolError, httpx.ReadError)):
                await http.post(url + CHAT, content=BODY)
            assert await failures(router) == [("a", FailureKind.BROKEN, 200)]

    run(scenario())


# vLLM 0.32's in-band error, as `create_streaming_error_response` writes it, then its end.
ENGINE_DEAD_EVENT = (
    b'data: {"error": {"message": "EngineCore encountered an issue. See stack trace (above)'
    b' for the root cause.", "type": "InternalServerError", "param": null, "code": 500}}\n\n'
)
TOKEN_EVENT = b'data: {"choices": [{"delta": {"content": "say \\"error\\" {\\"error\\""}}]}\n\n'


def feed_in_pieces(stream: bytes, cuts: list[int]) -> list[tuple[int | None, str]]:
    watch = ErrorEventWatch()
    bounds = [0, *cuts, len(stream)]
    heard = [watch.feed(stream[a:b]) for a, b in itertools.pairwise(bounds)]
    return [error for error in heard if error is not None]


def test_an_error_event_is_heard_however_the_stream_is_cut() -> None:
    stream = TOKEN_EVENT + ENGINE_DEAD_EVENT + b"data: [DONE]\n\n"
    for cut in range(1, len(stream)):
        heard = feed_in_pieces(stream, [cut])
        assert [code for code, _ in heard] == [500], cut
    assert feed_in_pieces(stream, list(range(1, len(stream)))) == heard  # a byte a piece
    assert heard[0][1].startswith("error event in the stream: InternalServerError: EngineCore")


def test_tokens_that_spell_error_and_other_shapes_are_not_an_error_event() -> None:
    assert feed_in_pieces(TOKEN_EVENT * 3 + b"data: [DONE]\n\n", []) == []
    crlf = ENGINE_DEAD_EVENT.replace(b"\n", b"\r\n")
    assert [code for code, _ in feed_in_pieces(crlf, [])] == [500]
    client_fault = b'data: {"error": {"message": "bad tool call", "code": 400}}\n\n'
    assert [code for code, _ in feed_in_pieces(client_fault, [])] == [400]
    for odd in (b'data: {"error": "engine dead"}\n\n', b'data: {"error": [1]\n\n'):
        watch = ErrorEventWatch()
        heard = watch.feed(odd)
        assert heard is not None and heard[0] is None and heard[1]  # no code: not counted
        assert watch.seen  # yet no success either
    endless = ErrorEventWatch()
    assert endless.feed(b'data: {"error": "' + b"x" * ERROR_EVENT_BOUND) is None
    assert endless.feed(b'"}\n\n' + ENGINE_DEAD_EVENT) is None  # let go, once: still no success
    assert endless.seen


# Nested thousands deep, inside the event's bound: json raises RecursionError, which cut
# the client's stream as a failure of the router's own and recorded nothing.
NESTED_ERROR_EVENT = b'data: {"error": ' + b"[" * 5000 + b"\n\n"


@pytest.mark.parametrize(
    ("event", "counted"),
    [
        (ENGINE_DEAD_EVENT, 500),
        (ENGINE_DEAD_EVENT.replace(b'"code": 500', b'"code": 503'), 503),
        (ENGINE_DEAD_EVENT.replace(b'"code": 500', b'"code": 400'), None),
        (NESTED_ERROR_EVENT, None),  # no code: not counted; seen: no success either
    ],
    ids=["500", "503", "400", "nested"],
)
def test_an_error_event_inside_a_200_stream_counts_by_its_code(
    event: bytes, counted: int | None
) -> None:
    # The engine failing mid-stream is written into a stream that already said 200: the
    # router counted it as answered, so a backend failing every stream was never condemned.
    failed_in_router: list[object] = []

    async def fails_in_band(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(SSE_CHUNKED_HEAD)
        for piece in (TOKEN_EVENT, event[:20], event[20:], b"data: [DONE]\n\n", b""):
            writer.write(b"%x\r\n%s\r\n" % (len(piece), piece))
            await writer.drain()
        await reader.read()  # until the router lets the connection go
        writer.close()

    async def scenario() -> None:
        asyncio.get_running_loop().set_exception_handler(
            lambda loop, context: failed_in_router.append(context.get("exception"))
        )
        async with (
            raw_backend(fails_in_band) as backend,
            routing({"a": backend}) as (router, url),
            client() as http,
        ):
            response = await http.post(url + CHAT, content=BODY)
            assert response.status_code == 200
            assert response.content == TOKEN_EVENT + event + b"data: [DONE]\n\n"  # unchanged
            expected = [("a", FailureKind.SERVER_ERROR, counted)] if counted else []
            assert await failures(router) == expected  # and no success either way
        assert failed_in_router == []

    run(scenario())


def test_a_request_in_progress_when_the_router_stops_is_answered_whole() -> None:
    """Stopping cut every request in progress at once: an upgrade or a SIGTERM failed
    the answers about to come. They get DRAIN seconds now; new connections none."""

    async def answers_late(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        await asyncio.sleep(1.0)
        body = b'{"choices": ["late but whole"]}'
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
        await writer.drain()
        writer.close()

    async def scenario() -> None:
        async with (
            raw_backend(answers_late) as late,
            routing({"a": late}) as (router, url),
            client() as http,
        ):
            sending = asyncio.create_task(http.post(url + CHAT, content=BODY))
            async with asyncio.timeout(BOUND):
                while not router.in_flight:
                    await asyncio.sleep(0.01)
            stopping = asyncio.create_task(router.close())
            response = await sending
            assert response.status_code == 200
            assert response.json() == {"choices": ["late but whole"]}
            await stopping
            with pytest.raises(httpx.ConnectError):
                await http.post(url + CHAT, content=BODY)

    run(scenario())


def test_a_body_cut_off_is_a_reset_for_a_client_that_reads_to_the_connections_end() -> None:
    """HTTP/1.0 has no chunks: its answer ends with the connection, so an orderly end
    after a backend broke mid-body passed a part of the JSON for the whole of it."""

    async def breaks(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(
            b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
            b'Transfer-Encoding: chunked\r\n\r\nf\r\n{"choices": [{"\r\n'
        )
        await writer.drain()
        writer.transport.abort()

    async def scenario() -> None:
        async with raw_backend(breaks) as cut, routing({"a": cut}) as (router, url):
            port = int(url.rsplit(":", 1)[1])
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(
                b"POST %s HTTP/1.0\r\nContent-Length: %d\r\n\r\n%s"
                % (CHAT.encode(), len(BODY), BODY)
            )
            with pytest.raises(ConnectionResetError):
                await asyncio.wait_for(reader.read(), BOUND)  # to the connection's end
            assert await failures(router) == [("a", FailureKind.BROKEN, 200)]
            writer.close()

    run(scenario())


def test_a_whole_answer_to_http_1_0_ends_with_the_connection_in_order(
    httpserver: HTTPServer,
) -> None:
    httpserver.expect_request(CHAT).respond_with_data(
        b'{"choices": []}', content_type="application/json"
    )

    async def scenario() -> None:
        async with routing({"a": httpserver.url_for("")}) as (router, url):
            port = int(url.rsplit(":", 1)[1])
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(
                b"POST %s HTTP/1.0\r\nContent-Length: %d\r\n\r\n%s"
                % (CHAT.encode(), len(BODY), BODY)
            )
            answer = await asyncio.wait_for(reader.read(), BOUND)
            assert answer.startswith(b"HTTP/1.1 200") and answer.endswith(b'{"choices": []}')
            assert [f for f, _, _ in await failures(router)] == ["a"]
            writer.close()

    run(scenario())


@pytest.mark.parametrize("then", ["cut", "silent"])
def test_a_5xx_whose_body_then_breaks_is_one_failure_not_two(then: str) -> None:
    # Counted at its head, the 5xx was counted again when its body broke or went
    # silent: two failures for one request, so two such requests condemned a backend
    # at an unhealthy_threshold of three.
    async def fails_then_breaks(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(
            b"HTTP/1.1 500 Internal Server Error\r\nContent-Type: text/event-stream\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n"
        )
        chunk = b'data: {"error": "engine dead"}\n\n'
        writer.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
        await writer.drain()
        if then == "cut":
            writer.transport.abort()
        else:
            await reader.read()  # until the router gives up on it
            writer.close()

    async def scenario() -> None:
        settings = RouterConfig(stream_idle_timeout=0.5)
        async with (
            raw_backend(fails_then_breaks) as backend,
            routing({"a": backend}, settings) as (router, url),
            client() as http,
        ):
            with contextlib.suppress(httpx.HTTPError):
                response = await http.post(url + CHAT, content=BODY)
                assert response.status_code == 500
            assert await failures(router) == [("a", FailureKind.SERVER_ERROR, 500)]

    run(scenario())


@pytest.mark.parametrize("length", [5, 200])
def test_an_answer_framed_both_ways_reaches_the_client_whole_as_chunked(length: int) -> None:
    # Transfer-Encoding wins (RFC 9112 6.3) and the body is read as chunked; its
    # Content-Length passed on as well cut the client's read short (the rest taken for
    # the next response on that connection) or left it waiting for bytes never sent.
    body = b'{"id": "cmpl-1", "choices": []}'

    async def both(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(
            b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n%x\r\n%s\r\n0\r\n\r\n" % (length, len(body), body)
        )
        await writer.drain()
        writer.close()

    async def scenario() -> None:
        async with (
            raw_backend(both) as backend,
            routing({"a": backend}) as (_, url),
            client() as http,
        ):
            for _ in range(2):  # the second on the same client connection
                response = await http.post(url + CHAT, content=BODY)
                assert (response.status_code, response.content) == (200, body)

    run(scenario())


def test_a_head_answer_without_a_length_is_relayed_without_one() -> None:
    # RFC 9110 8.6: a HEAD's Content-Length must be the length its GET's body would have.
    # Relayed, the backend's (chunked, so none) became "Content-Length: 0".
    async def chunked(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        if not head.startswith(b"HEAD "):
            writer.write(b"5\r\nhello\r\n0\r\n\r\n")
        await writer.drain()
        writer.close()

    async def scenario() -> None:
        async with (
            raw_backend(chunked) as backend,
            routing({"a": backend}) as (router, url),
            client() as http,
        ):
            response = await http.head(url + CHAT)
            assert response.status_code == 200
            assert "content-length" not in response.headers
            assert (await http.get(url + CHAT)).content == b"hello"
            # The router's own answers to a HEAD still say their GET's length.
            own = await http.head(url + "/health")
            assert int(own.headers["content-length"]) == len(
                (await http.get(url + "/health")).content
            )
            # Both answered: a run of answers is kept as its first and its newest.
            assert await failures(router) == [("a", None, None), ("a", None, None)]

    run(scenario())


# --- streaming and disconnects ---------------------------------------------------------


def test_each_chunk_reaches_the_client_before_the_backend_produces_the_next() -> None:
    """The backend sends chunk n+1 only once the client has chunk n: a router that held
    chunks back would deadlock here, and the bounded wait would fail the test."""
    received = [asyncio.Event() for _ in range(5)]

    async def lockstep(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(SSE_CHUNKED_HEAD)
        for index, event in enumerate(received):
            chunk = b"data: %d\n\n" % index
            writer.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
            await writer.drain()
            await asyncio.wait_for(event.wait(), BOUND)
        writer.write(b"0\r\n\r\n")
        await writer.drain()
        writer.close()

    async def scenario() -> None:
        async with (
            raw_backend(lockstep) as backend,
            routing({"a": backend}) as (router, url),
            client() as http,
            http.stream("POST", url + CHAT, content=BODY) as response,
        ):
            seen = b""
            async for piece in response.aiter_raw():
                seen += piece
                for index, event in enumerate(received):
                    if b"data: %d\n\n" % index in seen:
                        event.set()
            assert seen == b"".join(b"data: %d\n\n" % i for i in range(5))
        assert await failures(router) == [("a", None, None)]

    run(scenario())


@pytest.mark.usefixtures("each_loop")
def test_a_client_that_goes_away_closes_the_upstream_request_and_counts_nothing() -> None:
    backend_saw_close = asyncio.Event()

    async def streams_until_closed(
        reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n")
        writer.write(b"Transfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n")
        await writer.drain()
        if await reader.read() == b"":  # the router closed its side
            backend_saw_close.set()
        writer.close()

    async def scenario() -> None:
        async with (
            raw_backend(streams_until_closed) as backend,
            routing({"a": backend}) as (router, url),
        ):
            port = int(url.rsplit(":", 1)[1])
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(
                b"POST %s HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s"
                % (CHAT.encode(), len(BODY), BODY)
            )
            await writer.drain()
            assert b"hello" in await reader.readuntil(b"hello")
            assert router.in_flight == {"a": 1}
            writer.close()
            await asyncio.wait_for(backend_saw_close.wait(), BOUND)
            assert (await drained(router)) == {}

    run(scenario())


@pytest.mark.usefixtures("each_loop")
def test_a_whole_answer_the_client_left_before_taking_still_clears_the_backend() -> None:
    # "It served, whatever the client did next": a backend whose whole answer is in the
    # router's hands has served, and only a success clears its request-failure streak
    # (DESIGN.md section 7); a client gone at that moment was counted as neither.
    held: dict[str, socket.socket] = {}

    async def answers(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}")  # whole, at once
        gone = held.pop("client")  # and the client resets as it arrives
        gone.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        gone.close()
        await writer.drain()
        writer.close()

    async def scenario() -> None:
        async with (
            raw_backend(answers) as backend,
            routing({"a": backend}) as (router, url),
        ):
            port = int(url.rsplit(":", 1)[1])
            held["client"] = socket.create_connection(("127.0.0.1", port))
            held["client"].sendall(
                b"POST %s HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s"
                % (CHAT.encode(), len(BODY), BODY)
            )
            async with asyncio.timeout(BOUND):
                while "client" in held or router.in_flight:
                    await asyncio.sleep(0.01)
            outcomes = await drained(router)
            assert [(name, [o.ok for o in seen]) for name, seen in outcomes.items()] == [
                ("a", [True])
            ]

    run(scenario())


def _readable(sock: socket.socket) -> bool:
    try:
        return bool(sock.recv(1, socket.MSG_PEEK))
    except BlockingIOError:
        return False


def _sse(size: int, error: bool) -> bytes:
    """A chunked event stream of about ``size`` bytes, ending with an error event or not."""
    event = b"data: " + json.dumps({"choices": [{"text": "x" * 1000}]}).encode() + b"\n\n"
    events = [event] * (size // len(event))
    if error:
        failed = {"error": {"message": "engine dead", "type": "InternalServerError", "code": 500}}
        events.append(b"event: error\ndata: " + json.dumps(failed).encode() + b"\n\n")
    events.append(b"data: [DONE]\n\n")
    chunks = b"".join(b"%x\r\n%s\r\n" % (len(e), e) for e in events)
    head = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
    head += b"Transfer-Encoding: chunked\r\n\r\n"
    return head + chunks + b"0\r\n\r\n"


LEFT_ANSWERS = {
    # Came with its head: relayed whole in one write, then the client left.
    "whole": (b"HTTP/1.1 200 OK\r\nContent-Length: 120000\r\n\r\n" + b"x" * 120_000, [True]),
    # An error event in the part never relayed: the engine failed it. (An answer relayed
    # piece by piece whose rest waits unread in the router's buffer when the client
    # leaves is not known whole, and counts nothing.)
    "stream with an error": (_sse(200_000, error=True), []),
}


@pytest.mark.usefixtures("each_loop")
@pytest.mark.parametrize("kind", list(LEFT_ANSWERS))
def test_a_whole_answer_a_slow_client_then_left_still_clears_the_backend(kind: str) -> None:
    # The backend's whole answer was read by the router; a slow client across a network
    # takes only part of it, then goes away, which cancels the relay: the backend served
    # all the same ("whatever the client did next"), and only a success clears its
    # request-failure streak. No success for a stream whose unrelayed rest failed.
    answer, expected = LEFT_ANSWERS[kind]
    answered = asyncio.Event()

    async def answers(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(answer)
        async with asyncio.timeout(BOUND):
            while writer.transport.get_write_buffer_size():
                await asyncio.sleep(0.01)
        answered.set()
        await reader.read()  # the router's end
        writer.close()

    async def scenario() -> None:
        async with raw_backend(answers) as backend, routing({"a": backend}) as (router, url):
            port = int(url.rsplit(":", 1)[1])
            client = socket.socket()
            # A client across a network, reading slowly: a small window, a usual segment.
            client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            client.setsockopt(socket.IPPROTO_TCP, socket.TCP_MAXSEG, 1460)
            client.connect(("127.0.0.1", port))
            client.setblocking(False)
            await asyncio.get_running_loop().sock_sendall(
                client,
                b"POST %s HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s"
                % (CHAT.encode(), len(BODY), BODY),
            )
            await answered.wait()
            async with asyncio.timeout(BOUND):
                while not _readable(client):
                    await asyncio.sleep(0.01)
            await asyncio.sleep(0.2)  # the router's relay waits for the client to take more
            client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            client.close()
            outcomes = await drained(router)
            oks = [outcome.ok for outcome in outcomes.get("a", ())]
            assert oks == expected if expected else True not in oks, outcomes

    run(scenario())


def test_a_client_disconnect_while_waiting_for_headers_closes_the_upstream_too() -> None:
    backend_saw_close = asyncio.Event()
    request_arrived = asyncio.Event()

    async def thinks_forever(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        request_arrived.set()
        if await reader.read() == b"":
            backend_saw_close.set()
        writer.close()

    async def scenario() -> None:
        async with (
            raw_backend(thinks_forever) as backend,
            routing({"a": backend}) as (router, url),
        ):
            port = int(url.rsplit(":", 1)[1])
            _, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(
                b"POST %s HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s"
                % (CHAT.encode(), len(BODY), BODY)
            )
            await asyncio.wait_for(request_arrived.wait(), BOUND)
            writer.close()
            await asyncio.wait_for(backend_saw_close.wait(), BOUND)
            assert (await drained(router)) == {}

    run(scenario())


def test_a_request_body_that_never_finishes_arriving_gets_a_408(httpserver: HTTPServer) -> None:
    async def scenario() -> None:
        settings = RouterConfig(body_timeout=0.5)
        async with routing({"a": httpserver.url_for("")}, settings) as (router, url):
            port = int(url.rsplit(":", 1)[1])
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(
                b"POST %s HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n{" % CHAT.encode()
            )
            await writer.drain()
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), BOUND)
            assert head.startswith(b"HTTP/1.1 408")
            writer.close()
            assert (await drained(router)) == {}

    run(scenario())
    assert httpserver.log == []


# --- choice through the router ---------------------------------------------------------


def test_a_session_stays_on_one_backend_and_load_goes_to_the_least_busy(
    httpserver: HTTPServer,
) -> None:
    served: list[str] = []

    def answer(request: Request) -> Response:
        served.append(request.path)
        return Response("{}", content_type="application/json")

    for name in ("a", "b", "c"):
        httpserver.expect_request(f"/{name}{CHAT}").respond_with_handler(answer)

    async def scenario() -> None:
        backends = {name: httpserver.url_for(f"/{name}") for name in ("a", "b", "c")}
        settings = RouterConfig(affinity="header:X-Session-Id")
        async with routing(backends, settings) as (_, url), client() as http:
            for session in ("s1", "s2", "s3", "s4", "s5", "s6"):
                for _ in range(3):
                    headers = {"X-Session-Id": session}
                    await http.post(url + CHAT, content=BODY, headers=headers)

    run(scenario())
    by_session = [served[i : i + 3] for i in range(0, len(served), 3)]
    assert all(len(set(turns)) == 1 for turns in by_session)  # each session stayed put
    assert len({turns[0] for turns in by_session}) > 1  # and sessions spread out


@pytest.mark.parametrize(
    ("affinity", "headers", "body"),
    [
        ("header:X-Session-Id", {"X-Session-Id": b"caf\xe9"}, BODY),  # Latin-1, not UTF-8
        ("body:user", {}, b'{"model": "tiny", "prompt": "hi", "user": "\\udcff"}'),
    ],
    ids=["latin-1 header", "lone surrogate"],
)
def test_a_session_key_that_is_not_valid_unicode_is_routed_not_a_500(
    httpserver: HTTPServer, affinity: str, headers: dict[str, bytes], body: bytes
) -> None:
    httpserver.expect_request(CHAT).respond_with_json({})

    async def scenario() -> None:
        settings = RouterConfig(affinity=affinity)
        backends = {"a": httpserver.url_for("").rstrip("/")}
        async with routing(backends, settings) as (router, url), client() as http:
            for _ in range(2):
                response = await http.post(url + CHAT, content=body, headers=headers)
                assert response.status_code == 200, response.text
            assert [failure for _, failure, _ in await failures(router)] == [None, None]

    run(scenario())


def test_a_push_restores_a_dropped_backend_unless_it_failed_after_the_drain(
    httpserver: HTTPServer,
) -> None:
    httpserver.expect_request(f"/a{CHAT}").respond_with_json({}, status=500)
    httpserver.expect_request(f"/b{CHAT}").respond_with_json({})

    async def scenario() -> None:
        backends = {"a": httpserver.url_for("/a"), "b": httpserver.url_for("/b")}
        async with routing(backends) as (router, url), client() as http:
            assert (await http.post(url + CHAT, content=BODY)).status_code == 500
            everyone = dict.fromkeys(backends, ANY_MODEL)
            states = dict.fromkeys(backends, "healthy")
            router.push(everyone, states, 1)  # not drained: "a" failed after this settle's drain
            assert (await http.post(url + CHAT, content=BODY)).status_code == 200
            assert [o.failure for o in (await drained(router))["a"]] == [FailureKind.SERVER_ERROR]
            router.push(everyone, states, 1)  # the settle heard of it: "a" may serve again
            assert (await http.post(url + CHAT, content=BODY)).status_code == 500

    run(scenario())


def test_outcomes_drain_in_the_order_they_happened(httpserver: HTTPServer) -> None:
    statuses = iter([200, 500, 200, 502, 429])

    def answer(_: Request) -> Response:
        return Response("{}", status=next(statuses), content_type="application/json")

    httpserver.expect_request(CHAT).respond_with_handler(answer)

    async def scenario() -> None:
        backend = {"a": httpserver.url_for("")}
        seen: list[Any] = []
        async with routing(backend) as (router, url), client() as http:
            for _ in range(5):
                await http.post(url + CHAT, content=BODY)
                # A settle after every request: drain, then push "a" back into service.
                seen += (await drained(router)).get("a", ())
                router.push(dict.fromkeys(backend, ANY_MODEL), {"a": "suspect"}, 1)
        # The 429 counts for nothing: not the backend's failure, and not an answer.
        assert [o.status for o in seen] == [None, 500, None, 502]

    run(scenario())


def test_a_simulated_stream_passes_through_and_a_hung_one_ends_with_an_error_event() -> None:
    completion = json.dumps({"model": "tiny", "prompt": "hi", "max_tokens": 5, "stream": True})

    async def scenario(live: str, hung: str) -> None:
        settings = RouterConfig(stream_idle_timeout=0.5)
        async with routing({"a": live, "b": hung}, settings) as (router, url), client() as http:
            response = await http.post(url + "/v1/completions", content=completion)
            assert response.headers["X-LLMHealth-Backend"] == "a"
            events = [line for line in response.text.split("\n") if line.startswith("data: ")]
            assert len(events) == 6 and events[-1] == "data: [DONE]"
            router.push({"b": ANY_MODEL}, {"a": "healthy", "b": "healthy"}, 1)
            response = await http.post(url + "/v1/completions", content=completion)
            assert response.headers["X-LLMHealth-Backend"] == "b"
            assert "event: error" in response.text
            assert await failures(router) == [
                ("a", None, None),
                ("b", FailureKind.STREAM_IDLE, 200),
            ]

    with running_simulator(["idle", "busy+unanswered"], request_seconds=0.05) as sim:
        run(scenario(*sim.urls))


def test_a_client_that_never_reads_is_dropped_and_the_upstream_closed() -> None:
    backend_saw_close = asyncio.Event()

    async def floods(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\n")
        writer.write(b"Content-Length: %d\r\n\r\n" % (256 * 1024 * 1024))
        block = b"x" * (1024 * 1024)
        try:
            for _ in range(256):  # far more than every socket buffer on the way holds
                writer.write(block)
                await writer.drain()
        except ConnectionError:
            backend_saw_close.set()
            return
        writer.close()

    async def scenario() -> None:
        settings = RouterConfig(client_timeout=0.5)
        async with (
            raw_backend(floods) as backend,
            routing({"a": backend}, settings) as (router, url),
        ):
            port = int(url.rsplit(":", 1)[1])
            _, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(
                b"POST %s HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s"
                % (CHAT.encode(), len(BODY), BODY)
            )
            await writer.drain()  # and then never read a byte
            await asyncio.wait_for(backend_saw_close.wait(), BOUND)
            assert await drained(router) == {}  # the client's doing: counted against nobody
            # Let go with what it never read: closed "once sent", the socket, its buffer
            # and its place under the cap stayed for as long as the client stayed.
            assert router.connections is not None
            async with asyncio.timeout(BOUND):
                while router.connections.held:
                    await asyncio.sleep(0.05)
            writer.close()

    run(scenario())


def test_a_client_taking_a_large_answer_slowly_but_steadily_is_not_dropped() -> None:
    """client_timeout drops a client that takes no data, never one that takes a page of
    megabytes (a scraper of /metrics at 10,000 backends) slower than the page per bound:
    written in one piece under one bound, it was cut off with a reset part way."""
    page = 3 * 1024 * 1024

    class Large(Collector):
        def describe(self) -> list[Metric]:
            return []

        def collect(self) -> Iterator[Metric]:
            family = GaugeMetricFamily("large", "A large page.", labels=["name"])
            for index in range(page // 1024):
                family.add_metric([f"{index:01000d}"], index)
            yield family

    async def scenario() -> None:
        router = Router(
            RouterConfig(client_timeout=0.5), [Backend("a", refused_url())], collectors=[Large()]
        )
        port = free_port()
        await router.start("127.0.0.1", port)
        try:
            # Small socket buffers both ways (the router's taken from its listening socket),
            # so that the kernels on the way do not take the page whole: the client's reads
            # pace it, and the router sees each piece taken as it is.
            assert router.connections is not None and router.connections._server is not None
            listening = router.connections._server.sockets[0]
            listening.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 64 * 1024)
            sock = socket.socket()
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 16 * 1024)
            sock.setblocking(False)
            await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", port))
            reader, writer = await asyncio.open_connection(sock=sock)
            writer.write(b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            received = b""
            while piece := await asyncio.wait_for(reader.read(64 * 1024), BOUND):
                received += piece  # reset part way, before the fix: ConnectionResetError
                await asyncio.sleep(0.05)  # steady, and far slower than a page per bound
            writer.close()
            head, _, body = received.partition(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 200 ")
            length = re.search(rb"\r\nContent-Length: (\d+)", head)
            assert length is not None
            assert len(body) == int(length.group(1)) > page // 2  # the page, whole
        finally:
            await router.close()

    run(scenario())


def test_hundreds_of_idle_client_connections_do_not_stop_anyone_else(
    httpserver: HTTPServer,
) -> None:
    httpserver.expect_request(CHAT).respond_with_json({"ok": True})

    async def scenario() -> None:
        async with routing({"a": httpserver.url_for("")}) as (_, url), client() as http:
            port = int(url.rsplit(":", 1)[1])
            idle = [await asyncio.open_connection("127.0.0.1", port) for _ in range(300)]
            half_sent = idle[0][1]
            half_sent.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n")  # never ends
            response = await http.post(url + CHAT, content=BODY)
            assert response.status_code == 200
            for _, writer in idle:
                writer.close()

    run(scenario())


def test_an_error_event_nested_too_deep_is_no_error_of_the_routers_own() -> None:
    # The error event is the backend's to write; json's decoder raises RecursionError (not
    # a ValueError) past Python's recursion limit, well inside ERROR_EVENT_BOUND.
    watch = ErrorEventWatch()
    heard = watch.feed(NESTED_ERROR_EVENT)
    assert heard is not None and heard[0] is None  # not vLLM's JSON: no code, not counted
    assert watch.seen  # and no success either


MOVED_SSE_HEAD = (
    b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
)
MOVED_TOKEN = b'data: {"choices": [{"delta": {"content": "hi"}}]}\n\n'


def test_streams_cut_at_a_moved_backends_old_address_do_not_condemn_the_new_one() -> None:
    from llmhealth.fleet import FleetRecord  # noqa: PLC0415
    from llmhealth.ledger import Ledger, LedgerPolicy, State  # noqa: PLC0415

    """A reload moves "a" to a new server; the old one is then switched off and the three
    streams still in flight there break. The new server never saw a request, yet the
    settle after the move counts the old address's failures against it and condemns it."""
    streaming = 0
    all_streaming = asyncio.Event()
    old_goes_away = asyncio.Event()
    new_server_requests = 0

    async def old_server(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal streaming
        await read_request(reader)
        writer.write(MOVED_SSE_HEAD + b"%x\r\n%s\r\n" % (len(MOVED_TOKEN), MOVED_TOKEN))
        await writer.drain()
        streaming += 1
        if streaming == 3:
            all_streaming.set()
        await old_goes_away.wait()
        sock = writer.get_extra_info("socket")
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        writer.transport.abort()  # the old machine is switched off: a reset

    async def new_server(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal new_server_requests
        await read_request(reader)
        new_server_requests += 1
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}")
        await writer.drain()
        writer.close()

    async def scenario() -> None:
        async with raw_backend(old_server) as old, raw_backend(new_server) as new:
            record = FleetRecord(Ledger(LedgerPolicy(), [("a", old)], now=time.time()))
            router = Router(RouterConfig(), [Backend("a", old)])
            port = free_port()
            await router.start("127.0.0.1", port)
            router.push({"a": ANY_MODEL}, {"a": "healthy"}, 1)
            try:
                clients = []
                for _ in range(3):
                    reader, writer = await asyncio.open_connection("127.0.0.1", port)
                    writer.write(
                        b"POST %s HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s"
                        % (CHAT.encode(), len(BODY), BODY)
                    )
                    clients.append((reader, writer))
                await asyncio.wait_for(all_streaming.wait(), BOUND)
                # SIGHUP: the daemon reconfigures the router at once (_reload_config) ...
                router.configure([Backend("a", new)])
                # ... and its next settle reconciles the record (cycle._open), then pushes.
                record.reconcile({"a": new}, time.time())
                router.push({"a": ANY_MODEL}, {"a": "healthy"}, 1)
                old_goes_away.set()  # the old server is switched off
                for reader, writer in clients:
                    await asyncio.wait_for(reader.read(), BOUND)  # its error event and end
                    writer.close()
                await quiet(router)
                drained = router.drain()
                # The settle after: what the router saw is fed to the ledger.
                record.observe_requests("a", drained.get("a", ()))
                assert new_server_requests == 0
                snapshot = record.ledger.snapshot("a", time.time())
                assert snapshot.request_failures == 0, [o.describe() for o in drained["a"]]
                assert record.ledger.state_of("a") is State.HEALTHY
            finally:
                await router.close()

    run(scenario())


def test_a_reload_that_only_respells_the_url_loses_no_failure() -> None:
    """configure(): "written another way is no move" (same_server: the scheme's own port
    dropped). But _fail compares Origin objects, whose host_header differs for
    ``http://127.0.0.1:80`` and ``http://127.0.0.1``: a 500 from the very server the
    request went to, still the backend's server, is neither counted nor drops it."""
    try:  # port 80: the scheme's own, so the respelling is possible at all
        probe = socket.socket()
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        probe.bind(("127.0.0.1", 80))
        probe.close()
    except OSError as exc:
        pytest.skip(f"port 80 not bindable here: {errno.errorcode.get(exc.errno, exc)}")
    answer = asyncio.Event()
    server = _a_500_once(answer)  # the reload comes while the request is at the server

    async def scenario() -> None:
        listening = await asyncio.start_server(server, "127.0.0.1", 80)
        router = Router(RouterConfig(), [Backend("a", "http://127.0.0.1:80")])
        port = free_port()
        await router.start("127.0.0.1", port)
        router.push({"a": ANY_MODEL}, {"a": "healthy"}, 1)
        try:
            reader, writer = await _chat_in_flight(router, port, "a")
            # SIGHUP: the same server, its URL written without the scheme's own port.
            router.configure([Backend("a", "http://127.0.0.1")])
            assert "a" in router._pick_set(), "a respelling is no move (configure)"
            answer.set()
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), BOUND)
            assert head.startswith(b"HTTP/1.1 500"), head
            writer.close()
            await quiet(router)
            drained = router.drain()
            assert [o.status for o in drained.get("a", ())] == [500], drained
            assert "a" not in router._pick_set(), "the reflex drop did not apply"
        finally:
            await router.close()
            listening.close()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(listening.wait_closed(), 2)

    run(scenario())


@pytest.mark.usefixtures("each_loop")
def test_a_model_whose_served_id_is_not_printable_is_routed(httpserver: HTTPServer) -> None:
    """The models a backend serves reach the router made printable (`llama\\xa03` for a
    served `llama` + no-break space + `3`): a client asking for the model by the id the
    backend serves, and answers, was told no backend serves it."""
    from pathlib import Path  # noqa: PLC0415

    from llmhealth.classify import Target  # noqa: PLC0415
    from llmhealth.probe import ProbeSettings, check_fleet  # noqa: PLC0415

    served = "llama\u00a03"
    idle = Path(__file__).parent.parent / "fixtures" / "vllm-0.32" / "idle-1.txt"
    httpserver.expect_request("/metrics").respond_with_data(idle.read_text())
    httpserver.expect_request("/v1/models").respond_with_json({"data": [{"id": served}]})
    httpserver.expect_request("/v1/completions").respond_with_json(
        {"choices": [{"index": 0, "text": "!"}]}
    )
    httpserver.expect_request(CHAT).respond_with_json({"ok": True})
    url = httpserver.url_for("").rstrip("/")
    settings = ProbeSettings(wait=0.0, timeout=1.0, answer_timeout=1.0)
    (outcome,) = asyncio.run(check_fleet([Target("a", url)], settings))
    answer = outcome.verdict.answer
    assert answer is not None and answer.ok, outcome.verdict.evidence
    body = json.dumps({"model": served, "messages": [{"role": "user", "content": "hi"}]})

    async def scenario() -> None:
        # What the daemon hands the router: the models the tiny request saw.
        models = {"a": frozenset(answer.models_served)}
        async with routing({"a": url}, models=models) as (_, router_url), client() as http:
            response = await http.post(router_url + CHAT, content=body)
            assert response.status_code == 200, response.text


def test_a_failure_in_flight_across_a_rename_counts_against_the_renamed_backend() -> None:
    """A reload that only renames a backend keeps its server (the settle renames it in
    the ledger, its streak kept, and moves the outcomes recorded under its old name to
    the new one). A request in flight at the reload that then failed at that very server
    was counted under neither name: the old one is no longer configured (``_moved``), so
    a wedged server's hung requests, timing out just after a rename, were all lost."""
    answer = asyncio.Event()
    server = _a_500_once(answer)  # the reload comes while the request is at the server

    async def scenario() -> None:
        async with raw_backend(server) as url:
            router = Router(RouterConfig(), [Backend("a", url)])
            port = free_port()
            await router.start("127.0.0.1", port)
            router.push({"a": ANY_MODEL}, {"a": "healthy"}, 1)
            try:
                reader, writer = await _chat_in_flight(router, port, "a")
                router.configure([Backend("node-a", url)])  # SIGHUP: a new name, same server
                answer.set()
                head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), BOUND)
                assert head.startswith(b"HTTP/1.1 500"), head
                writer.close()
                await quiet(router)
                drained = router.drain()
                assert [o.status for o in drained.get("node-a", ())] == [500], drained
            finally:
                await router.close()

    run(scenario())


async def _chat_in_flight(
    router: Router, port: int, name: str
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A chat request sent to the router on ``port``, once it is in flight at ``name``."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(
        b"POST %s HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s"
        % (CHAT.encode(), len(BODY), BODY)
    )
    await writer.drain()
    for _ in range(int(BOUND / 0.01)):
        if router.in_flight.get(name):
            break
        await asyncio.sleep(0.01)
    return reader, writer


def _a_500_once(
    answer: asyncio.Event,
) -> Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]:
    """A backend that reads a request and answers it 500 once ``answer`` is set."""

    async def server(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        await answer.wait()
        writer.write(b"HTTP/1.1 500 Internal Server Error\r\nContent-Length: 2\r\n\r\n{}")
        await writer.drain()
        writer.close()

    return server


def test_no_local_port_towards_one_address_of_a_backends_name_is_not_the_backends(
    monkeypatch: pytest.MonkeyPatch, httpserver: HTTPServer
) -> None:
    # A backend by a name with an IPv6 and an IPv4 address, listening on IPv4 alone (vLLM
    # on 0.0.0.0): ::1 refuses, and the router has no local port left towards its IPv4
    # address. asyncio merges the two errors into one without an errno: the router's own
    # shortage was counted as the backend refusing, and a burst condemned it (the checker
    # tells each address's error apart, ``wire._open``).
    httpserver.expect_request(CHAT).respond_with_json({})
    port = httpserver.port
    real_getaddrinfo = socket.getaddrinfo

    def getaddrinfo(host: str, *args: Any, **kwargs: Any) -> Any:
        if host != "dual.test":
            return real_getaddrinfo(host, *args, **kwargs)
        return [
            (socket.AF_INET6, socket.SOCK_STREAM, 6, "", ("::1", port, 0, 0)),
            (socket.AF_INET, socket.SOCK_STREAM, 6, "", ("127.0.0.1", port)),
        ]

    real_connect = socket.socket.connect

    def connect(sock: socket.socket, address: Any) -> None:
        if address == ("127.0.0.1", port) and sock.type == socket.SOCK_STREAM:
            raise OSError(errno.EADDRNOTAVAIL, os.strerror(errno.EADDRNOTAVAIL))
        real_connect(sock, address)

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    monkeypatch.setattr(socket.socket, "connect", connect)
    # uvloop looks names up in libuv, past socket.getaddrinfo: "dual.test" resolved nowhere
    # (the dial itself is the same code on either loop).
    monkeypatch.delenv(eventloop.ENV, raising=False)

    async def scenario() -> None:
        async with routing({"a": f"http://dual.test:{port}"}) as (router, url), client() as http:
            response = await http.post(url + CHAT, content=BODY)
            assert await failures(router) == [], response.text
            metrics = (await http.get(url + "/metrics")).text
            assert "llmhealth_router_own_connect_failures_total 1.0" in metrics

    run(scenario())
