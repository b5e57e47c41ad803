"""`llmhealth route`'s HTTP edge: an OpenAI-compatible router over the serving set.

I/O around the pure choice (``choice.choose``) and the ledger's second writer
(``traffic.RequestLog``). The daemon pushes the serving set in after every settle and
drains what real requests showed before the next; in between, the router steers on its
own: a backend with a counted failure leaves the pick set at once (the reflex drop).
Streams pass through chunk by chunk, both ways bounded in bytes and time, and every
failure a client sees is a named, deliberate answer: a 500 JSON, an SSE ``error`` event,
or ``no_backend_status`` with ``Retry-After``, never a hang until the client gives up.
"""

from __future__ import annotations

import asyncio
import json
import math
import resource
import time
from bisect import bisect_left
from collections import Counter
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Final

from prometheus_client import CollectorRegistry
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.exposition import generate_latest
from prometheus_client.registry import Collector

from llmhealth.choice import ANY_MODEL, Affinity, Models, choose, serves
from llmhealth.config import Backend, backend_key
from llmhealth.config import Router as RouterConfig
from llmhealth.deadlines import Deadlines
from llmhealth.edge import BadRequestError, Edge, Request
from llmhealth.http1 import Fields, HeaderSource, connection_tokens
from llmhealth.lateness import lateness_of
from llmhealth.openfiles import FILE_LIMIT_CEILING
from llmhealth.text import printable, same_server
from llmhealth.traffic import FailureKind, RequestLog, RequestOutcome
from llmhealth.upstream import BrokenError, ConnectError, Origin, Pool, Response

# RFC 9110 section 7.6.1: headers that describe one connection, never forwarded. Host and
# Content-Length are set again for the hop they travel on.
HOP_BY_HOP: Final = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "proxy-connection",
        "te",
        "trailer",
        "trailers",
        "transfer-encoding",
        "upgrade",
        "host",
        "content-length",
    }
)
# Seconds requests in progress get to end when the router stops (SIGTERM, an upgrade):
# most non-streamed answers and short streams end within it; a longer one is cut off.
DRAIN: Final = 5.0
# Below uvicorn's 5 s keep-alive (vLLM's server), so the router never sends a request on
# a connection the backend is closing: that race would read as a reset and be counted.
UPSTREAM_KEEPALIVE = 2.0
BACKEND_HEADER: Final = "X-LLMHealth-Backend"
# Seconds past a connect deadline at which the router hears of it and no longer blames
# the backend: its own loop was held up, so a connection made in time may have waited
# unseen. Far above what a busy loop's turns take (a few ms for thousands of streams).
LOOP_LATE: Final = 0.5
# Request bodies this big or bigger are parsed one at a time. json's parser holds the
# loop while it works (0.4 s for a 16 MiB token-id prompt), and forty that arrived
# together were parsed in one turn of the loop, which polled no socket for seconds;
# one at a time, the loop serves everything else between two of them.
BIG_BODY: Final = 1 << 20
MAX_METHOD: Final = 32  # characters of a request's method an outcome keeps (``_method``)
# Characters of a request's model: past any id a backend is known to serve (the probes
# take ids of up to 1,024 characters, each at most ten once made printable). Unbounded, a
# model of 8 Mi characters that are not printable held the loop a second while it was
# escaped, and came back escaped twice in the 503: 58 MB answered to a 16 MiB request.
MAX_MODEL: Final = 64 * 1024
SHOWN_MODEL: Final = 200  # characters of it an answer repeats
# Bytes of a whole answer (the router's own, or a short one relayed) written under one
# ``client_timeout``, as a stream's pieces are (``upstream.READ_SIZE``): that bound is for
# a client that takes no data. Written in one piece, a /metrics page of megabytes went to
# a scraper reading it steadily, but slower than the page per ``client_timeout``, cut off
# with a reset (24 MB at 10,000 backends: 400 KB/s at the default minute).
WHOLE_PIECE: Final = 64 * 1024
# File descriptors kept out of the client connections' share: the daemon's probe
# connections (one per backend), the state file, the audit log, the event loop, stdio.
RESERVED_FILES: Final = 64


def connection_cap(file_limit: int, backends: int) -> int:
    """How many client connections the router holds at once under ``file_limit``.

    Half of what is left after the reserve (and a probe connection per backend): a client
    connection with a request in flight holds a second descriptor upstream, so even with
    every client busy the router never runs out, and never counts its own shortage
    against a backend as a refused connection.
    """
    return max(8, (file_limit - RESERVED_FILES - backends) // 2)


def model_of(body: bytes) -> tuple[str | None, dict[str, object] | None]:
    """The request's ``model`` and its parsed JSON object; an empty body has neither.

    The body itself is forwarded byte for byte: this parse only decides the choice. The
    model is made printable, as the models each backend serves are known (probe.py): a
    served id with a character that is not (a no-break space) is then still found.
    """
    if not body.strip():
        return None, None
    try:
        parsed = json.loads(body)
    except (ValueError, RecursionError) as exc:
        # RecursionError: a body nested thousands deep is the client's fault like any other.
        raise BadRequestError(400, f"the request body is not valid JSON: {_short(exc)}") from None
    if not isinstance(parsed, dict):
        raise BadRequestError(400, "the request body must be a JSON object")
    model = parsed.get("model")
    if not isinstance(model, str) or not model:
        raise BadRequestError(400, "the request body names no model: the router chooses by model")
    if len(model) > MAX_MODEL:
        raise BadRequestError(
            400, f"the request's model name over {MAX_MODEL} characters: no backend serves it"
        )
    return printable(model), parsed


def upstream_headers(incoming: HeaderSource, api_key: str | None) -> Fields:
    """The client's headers minus hop-by-hop ones; the backend's own key when it has one."""
    named = connection_tokens(incoming.items())
    headers = Fields()
    for name, value in incoming.items():
        lower = name.lower()
        if lower in HOP_BY_HOP or lower in named:
            continue
        if api_key is not None and lower == "authorization":
            continue
        headers.add(name, value)
    if api_key is not None:
        headers["Authorization"] = f"Bearer {api_key}"
    return headers


def downstream_headers(incoming: HeaderSource) -> Fields:
    """The backend's response headers minus hop-by-hop ones. Content-Length is kept,
    unless a Transfer-Encoding came beside it: the body is then read as chunked (RFC 9112
    6.3), and its length passed on framed the client's read of it wrongly (a short one
    left the rest to be taken for the next response, a long one hung the client)."""
    named = connection_tokens(incoming.items())
    encoded = any(name.lower() == "transfer-encoding" for name, _ in incoming.items())
    dropped = HOP_BY_HOP - ({"content-length"} if not encoded else set())
    headers = Fields()
    for name, value in incoming.items():
        lower = name.lower()
        if lower in named or lower in dropped:
            continue
        headers.add(name, value)
    return headers


@dataclass(frozen=True, slots=True)
class Answer:
    """The router's own answer to a request (not a backend's), sent whole."""

    status: int
    headers: Fields
    body: bytes


@dataclass(frozen=True, slots=True)
class _Retry:
    """The request never reached the backend: the caller may send it elsewhere once.
    ``ours``: the router's own failure (its loop held up, no descriptor left), which the
    client hears as the router's if no other backend takes the request."""

    detail: str
    ours: bool = False


# Seconds, the upper bounds of the two histograms' buckets (as they were under
# prometheus_client's Histogram, so dashboards keep their series).
FIRST_BYTE_BUCKETS: Final = (
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    120.0,
    300.0,
)
DURATION_BUCKETS: Final = (
    0.01,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    120.0,
    300.0,
    600.0,
)


class Buckets:
    """One histogram's counts as plain numbers: an observation is a bisect and two adds,
    without prometheus_client's lock and per-bucket loop on the request path."""

    __slots__ = ("bounds", "counts", "total")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # the last one: above every bound (+Inf)
        self.total = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1  # le: the first bound >= value
        self.total += value

    def cumulative(self) -> list[tuple[str, float]]:
        """Prometheus buckets: (le, observations at or below it), +Inf last."""
        running, buckets = 0, []
        for bound, count in zip((*self.bounds, math.inf), self.counts, strict=True):
            running += count
            buckets.append(("+Inf" if bound == math.inf else repr(bound), float(running)))
        return buckets


@dataclass(frozen=True, slots=True)
class BackendSeries:
    first_byte: Buckets
    duration: Buckets


class RouterMetrics(Collector):
    """The router's own series; labels are configured backend names, never client input.

    Counted in plain ints and lists as requests pass, and made into Prometheus families
    only when ``/metrics`` is scraped: a request costs no metric lock and no label lookup.
    Counting runs on the event loop's thread alone, so plain numbers need no lock. A
    scrape reads them from a thread beside it (``Router._metrics_page``): each map is
    copied by one ``sorted`` call, which no count interleaves with, and a histogram's sum
    read apart from its buckets is at most one request behind them.
    """

    def __init__(self, in_flight: Mapping[str, int]) -> None:
        self.in_flight = in_flight  # the router's own count, exported as it stands
        self.requests: Counter[tuple[str, int]] = Counter()
        self.failures: Counter[tuple[str, str]] = Counter()
        self.no_backend = 0
        self.retries = 0
        self.late_timeouts = 0
        self.own_failures = 0
        self.serving = 0
        self._series: dict[str, BackendSeries] = {}

    def start_backend(self, name: str) -> None:
        """Zero series from the start, so a rate() sees a backend's first failure."""
        self.backend(name)
        for kind in FailureKind:
            self.failures[name, str(kind)] += 0

    def keep_only(self, names: Collection[str]) -> None:
        """Drop the series of backends no longer configured: frozen, they would keep an
        alert on them firing and grow the page with every rename. The router's own
        answers ("none") stay."""
        for answered in [k for k in self.requests if k[0] not in names and k[0] != "none"]:
            del self.requests[answered]
        for failed in [k for k in self.failures if k[0] not in names]:
            del self.failures[failed]
        for name in [name for name in self._series if name not in names]:
            del self._series[name]

    def backend(self, name: str) -> BackendSeries:
        """The per-request series of one backend."""
        series = self._series.get(name)
        if series is None:
            series = BackendSeries(Buckets(FIRST_BYTE_BUCKETS), Buckets(DURATION_BUCKETS))
            self._series[name] = series
        return series

    def answered(self, backend: str, status: int) -> None:
        """One request answered with ``status`` (``backend`` is "none" for the router's own)."""
        self.requests[backend, status] += 1

    def collect(self) -> Iterator[Metric]:
        requests = CounterMetricFamily(
            "llmhealth_router_requests",
            "Requests answered, by backend ('none' when none was chosen) and HTTP status.",
            labels=["backend", "code"],
        )
        for (backend, status), count in sorted(self.requests.items()):
            requests.add_metric([backend, str(status)], count)
        failures = CounterMetricFamily(
            "llmhealth_router_backend_failures",
            "Failures counted against a backend, by kind.",
            labels=["backend", "kind"],
        )
        for (backend, kind), count in sorted(self.failures.items()):
            failures.add_metric([backend, kind], count)
        yield requests
        yield failures
        yield CounterMetricFamily(
            "llmhealth_router_no_backend",
            "Requests answered no_backend_status: nothing serving served the model.",
            value=self.no_backend,
        )
        yield CounterMetricFamily(
            "llmhealth_router_retries",
            "Requests sent to a second backend after the first refused the connection.",
            value=self.retries,
        )
        yield CounterMetricFamily(
            "llmhealth_router_late_timeouts",
            "Connections not made in time while the router's own event loop was held up "
            "past the deadline: not counted against the backend.",
            value=self.late_timeouts,
        )
        yield CounterMetricFamily(
            "llmhealth_router_own_connect_failures",
            "Connections the router could not open for want of its own file descriptors "
            "(a socket, the CA certificates to read) or local ports: not counted against "
            "the backend.",
            value=self.own_failures,
        )
        in_flight = GaugeMetricFamily(
            "llmhealth_router_in_flight_requests",
            "Requests forwarded to a backend and not yet finished.",
            labels=["backend"],
        )
        first_byte = HistogramMetricFamily(
            "llmhealth_router_time_to_first_byte_seconds",
            "From choosing a backend to its response headers.",
            labels=["backend"],
        )
        duration = HistogramMetricFamily(
            "llmhealth_router_request_duration_seconds",
            "From choosing a backend to the last byte of its response.",
            labels=["backend"],
        )
        for name, series in sorted(self._series.items()):
            in_flight.add_metric([name], self.in_flight.get(name, 0))
            for family, buckets in ((first_byte, series.first_byte), (duration, series.duration)):
                family.add_metric([name], buckets.cumulative(), buckets.total)
        yield in_flight
        yield first_byte
        yield duration
        yield GaugeMetricFamily(
            "llmhealth_router_serving_backends",
            "Backends in the router's pick set (serving, and not dropped after a failure).",
            value=self.serving,
        )


# vLLM's error event inside a stream that had already begun (status 200 sent): an
# exception while generating, the engine dying mid-stream among them, is written as
# `data: {"error": {"message", "type", "param", "code"}}` and then `data: [DONE]`. A bare
# quote cannot occur inside a JSON string, so no token a model writes looks like this.
ERROR_EVENT: Final = b'data: {"error"'
# Bytes of one error event kept while it arrives: vLLM's are a few hundred. Past this the
# event is let go unread (and the request is still no success).
ERROR_EVENT_BOUND: Final = 16 * 1024


class ErrorEventWatch:
    """Watches an event stream as it is relayed for the backend's own error event.

    Pure: fed the body's pieces as they come (an event may be split between any two),
    it answers ``(code, detail)`` once the first error event is whole. The status line of
    such a stream said 200 before the failure, so without this the router counted a
    request the engine failed as a success, and a backend failing every stream stayed in
    the pick set. Scanning costs one ``bytes.find`` per piece until an event is seen.
    """

    __slots__ = ("_event", "_tail", "seen")

    def __init__(self) -> None:
        self._tail = b""  # the end of the last piece: an event's mark split between two
        self._event: bytearray | None = None  # the error event so far, from its mark
        self.seen = False  # an error event began: this request is no success

    def feed(self, piece: bytes) -> tuple[int | None, str] | None:
        """The error event's code (None: none given) and words, once it is whole."""
        if self._event is None:
            if self.seen:
                return None  # one event per request: it has been judged or let go
            joined = self._tail + piece[: len(ERROR_EVENT) - 1]
            at = joined.find(ERROR_EVENT)
            if at >= 0:
                self._event = bytearray(joined[at:])
                self._event += piece[len(ERROR_EVENT) - 1 :]
            else:
                at = piece.find(ERROR_EVENT)
                if at < 0:
                    self._tail = (self._tail + piece)[-(len(ERROR_EVENT) - 1) :]
                    return None
                self._event = bytearray(piece[at:])
            self.seen = True
        else:
            self._event += piece
        end = self._event.find(b"\n\n")
        if end < 0:
            end = self._event.find(b"\r\n\r\n")  # SSE allows either line ending
        if end < 0:
            if len(self._event) > ERROR_EVENT_BOUND:
                self._event = None
            return None
        event, self._event = bytes(self._event[len(b"data: ") : end]), None
        return _error_event(event)


def _error_event(data: bytes) -> tuple[int | None, str]:
    """An error event's code and words, as far as they can be read."""
    try:
        error = json.loads(data)["error"]
    # RecursionError: an event nested a few thousand deep fits well inside its bound, and
    # is the backend's odd answer, not a failure of the router's own.
    except (ValueError, TypeError, KeyError, RecursionError):
        return None, "an error event that is not vLLM's JSON"
    if not isinstance(error, dict):
        return None, printable(f"error event: {str(error)[:200]}")
    code = error.get("code")
    words = f"{error.get('type', '')}: {error.get('message', '')}"
    return (
        code if isinstance(code, int) and not isinstance(code, bool) else None,
        printable(f"error event in the stream: {words[:200]}"),
    )


class Router:
    """The router's state between settles, and its request handler."""

    def __init__(
        self,
        settings: RouterConfig,
        backends: Iterable[Backend],
        *,
        clock: Callable[[], float] = time.time,
        retry_after: float = 5.0,
        collectors: Iterable[Collector] = (),
    ) -> None:
        self._settings = settings
        self._clock = clock
        self._retry_after = _retry_after(retry_after)
        self._routes = frozenset(settings.routes)
        self._affinity = Affinity.parse(settings.affinity) if settings.affinity else None
        self._log = RequestLog()
        self._in_flight: Counter[str] = Counter()
        self._serving: dict[str, Models] = {}
        self._states: dict[str, str] = {}
        self._dropped: set[str] = set()
        self._min_healthy = 1
        self._backends: dict[str, Backend] = {}
        self.registry = CollectorRegistry(auto_describe=True)
        for collector in collectors:
            self.registry.register(collector)
        self.metrics = RouterMetrics(self._in_flight)
        self.registry.register(self.metrics)
        # Upstream connections: one per request in flight, kept alive between requests
        # for UPSTREAM_KEEPALIVE and closed past it at each push (a settle's wait).
        self._pool = Pool(settings.connect_timeout, UPSTREAM_KEEPALIVE)
        self.configure(backends)
        self._deadlines = Deadlines()  # every bound on the request path, one shared timer
        self._big_parse = asyncio.Lock()  # BIG_BODY
        self._rendering: asyncio.Future[bytes] | None = None  # the /metrics page, under way
        self.connections: Edge | None = None

    # --- what the daemon calls ---------------------------------------------------------

    def configure(self, backends: Iterable[Backend], retry_after: float | None = None) -> None:
        """The configured backends (at start and on reload): URLs and keys to use; and
        on reload the wait, which a 503's Retry-After says (kept, a wait cut from ten
        minutes still sent clients away for ten).

        A backend a reload dropped leaves the serving set at once, not at the next push
        (a settle away, or more while settles fail): it had no address left to send to.
        So does one a reload moved to another address (written another way is no move)
        until the next push: what answers there is unproven, and the settle drops the
        outcomes drained across a move (``fleet``), so failures there were not counted.
        """
        if retry_after is not None:
            self._retry_after = _retry_after(retry_after)
        before = self._backends
        self._backends = {backend.name: backend for backend in backends}
        self._origins = {name: Origin.parse(b.url) for name, b in self._backends.items()}
        self._serving = {
            n: m
            for n, m in self._serving.items()
            if n in self._backends
            and same_server(before[n].url) == same_server(self._backends[n].url)
        }
        self._states = {n: s for n, s in self._states.items() if n in self._backends}
        self._dropped &= self._backends.keys()
        # A count of 0 under a name no longer configured is let go (one still in flight
        # goes as its last request ends, in ``_forward``): kept, a fleet whose names change
        # with each reload grew the map for good.
        for name in [n for n, count in self._in_flight.items() if not count]:
            if name not in self._backends:
                del self._in_flight[name]
        self._pool.sweep(set(self._origins.values()))
        self.metrics.keep_only(self._backends)
        self.metrics.serving = len(self._pick_set())
        for name in self._backends:
            self.metrics.start_backend(name)

    def push(
        self, serving: Mapping[str, Models], states: Mapping[str, str], min_healthy: int
    ) -> None:
        """The serving set after a settle, each backend with the models it serves.

        A backend that failed since the last drain stays dropped: the settle that pushes
        this has not heard of that failure yet.
        """
        self._serving = {name: models for name, models in serving.items() if name in self._backends}
        self._states = dict(states)
        self._min_healthy = min_healthy
        self._dropped = {name for name in self._dropped if self._log.has_failure(name)}
        self.metrics.serving = len(self._pick_set())
        self._pool.sweep(set(self._origins.values()))

    def drain(self) -> dict[str, tuple[RequestOutcome, ...]]:
        """Every outcome since the last drain, per backend in order, for the settle."""
        return self._log.drain()

    def give_back(self, drained: Mapping[str, Sequence[RequestOutcome]]) -> None:
        """What a skipped settle drained, for the next one (``RequestLog.give_back``)."""
        self._log.give_back(drained)

    @property
    def in_flight(self) -> dict[str, int]:
        return {name: count for name, count in self._in_flight.items() if count}

    async def start(self, host: str, port: int) -> None:
        file_limit = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        if file_limit == resource.RLIM_INFINITY:
            file_limit = FILE_LIMIT_CEILING
        self.connections = Edge(
            self._handle,
            cap=connection_cap(file_limit, len(self._backends)),
            idle_timeout=self._settings.idle_timeout,
            max_body=self._settings.max_body,
        )
        await self.connections.start(host, port, backlog=1024)
        # Its ticks from now on: a stall before the first connect is counted too.
        lateness_of(asyncio.get_running_loop())

    async def close(self) -> None:
        """Stop routing: requests in progress get ``DRAIN`` seconds to end first."""
        if self.connections is not None:
            await self.connections.close(DRAIN)
        self._pool.close()

    # --- requests ----------------------------------------------------------------------

    async def _handle(self, request: Request) -> None:
        """One request, its answer written whole (a client that goes away cancels this, and
        with it the upstream request, so the engine aborts the generation)."""
        answer = await self._answer_request(request)
        if answer is None:
            return  # relayed from a backend
        try:
            await self._answer_whole(request, answer.status, answer.headers, answer.body)
        except (TimeoutError, ConnectionError):
            request.abort()  # a client that takes no answer is dropped, as below

    async def _answer_request(self, request: Request) -> Answer | None:
        path = request.path
        if path == "/health":
            return self._health()
        if path == "/metrics":
            headers = Fields([("Content-Type", "text/plain; version=0.0.4; charset=utf-8")])
            return Answer(200, headers, await self._metrics_page())
        if path == "/v1/models":
            return self._models()
        if path not in self._routes:
            return self._answer(None, 404, {"error": f"not routed: {printable(path[:200])}"})
        try:
            # Most bodies come whole with the headers: taken as they lie, with no timer.
            body = request.body()
            if body is None:
                with self._deadlines.within(self._settings.body_timeout):
                    body = await request.read_body()
            if len(body) >= BIG_BODY:
                async with self._big_parse:
                    model, parsed = model_of(body)
                    # Held across one turn of the loop: the next big parse waits for it.
                    await asyncio.sleep(0)
            else:
                model, parsed = model_of(body)
        except TimeoutError:
            seconds = self._settings.body_timeout
            return self._answer(None, 408, {"error": f"request body not received in {seconds:g} s"})
        except BadRequestError as exc:  # 413 over max_body, a broken chunk, bad JSON
            return self._answer(None, exc.status, {"error": str(exc)})
        key = self._affinity.key_of(request.headers, parsed) if self._affinity else None
        # Not held while the backend answers: a 16 MiB token-id prompt parses to about
        # 100 MB of objects, and a few in flight held the router's memory for minutes.
        del parsed
        tried: dict[str, _Retry] = {}
        while True:
            pool = {n: m for n, m in self._pick_set().items() if n not in tried}
            name = choose(
                pool, self._in_flight, model=model, key=key, slack=self._settings.affinity_slack
            )
            if name is None:
                if tried:  # the one retry found nowhere to go: the client hears why
                    first, why = next(iter(tried.items()))
                    return self._not_sent(first, why, f"{why.detail}, and no other backend serves")
                return self._no_backend(model)
            if tried:
                self.metrics.retries += 1  # a second backend is tried: counted as it is
            result = await self._forward(request, name, body)
            if not isinstance(result, _Retry):
                return result
            tried[name] = result
            if len(tried) > 1:
                return self._not_sent(name, result, result.detail)

    async def _forward(self, request: Request, name: str, body: bytes) -> Answer | _Retry | None:
        """One attempt on one backend, from connect to the last byte to the client (None:
        relayed)."""
        backend = self._backends[name]
        api_key = backend_key(backend)
        started = time.monotonic()
        series = self.metrics.backend(name)
        origin = self._origins[name]  # a reload may move the backend while this runs
        self._in_flight[name] += 1
        upstream: Response | None = None
        finished = False
        try:
            try:
                with self._deadlines.within(self._settings.first_byte_timeout):
                    upstream = await self._pool.request(
                        origin,
                        request.method,
                        request.target,
                        upstream_headers(request.headers, api_key).items(),
                        body,
                    )
            except ConnectError as exc:
                # Never connected, so never sent: safe to send elsewhere.
                if exc.ours:
                    # No descriptor left in the router's own process: every backend
                    # would have been condemned by it.
                    self.metrics.own_failures += 1
                    return _Retry(f"{_short(exc)}, in the router's own process", ours=True)
                if exc.late > LOOP_LATE:
                    # Its own loop held up past the deadline (CPU of its own: a burst of
                    # huge JSON bodies to read), the router cannot tell whether the
                    # backend was slow to accept: counted as its own, not against it.
                    self.metrics.late_timeouts += 1
                    return _Retry(
                        f"{_short(exc)}, the router itself {exc.late:.1f} s late", ours=True
                    )
                self._fail(name, origin, request, FailureKind.REFUSED, None, _short(exc))
                return _Retry(f"connection failed: {_short(exc)}")
            except TimeoutError:
                seconds = self._settings.first_byte_timeout
                detail = f"no response headers within {seconds:g} s"
                self._fail(name, origin, request, FailureKind.FIRST_BYTE_TIMEOUT, None, detail)
                return self._backend_failed(name, detail)
            except BrokenError as exc:
                detail = f"connection broke before the response: {_short(exc)}"
                self._fail(name, origin, request, FailureKind.BROKEN, None, detail)
                return self._backend_failed(name, detail)
            series.first_byte.observe(time.monotonic() - started)
            finished = await self._relay(request, name, origin, upstream)
            return None
        finally:
            if upstream is not None and finished:
                upstream.release()
            elif upstream is not None:
                upstream.close()  # never back to the pool half read: the backend sees it end
            self._in_flight[name] -= 1
            if not self._in_flight[name] and name not in self._backends:
                del self._in_flight[name]  # a reload dropped it meanwhile (``configure``)
            series.duration.observe(time.monotonic() - started)

    async def _relay(self, request: Request, name: str, origin: Origin, upstream: Response) -> bool:
        """Pass the backend's response on as it comes; True when it ended cleanly."""
        status = upstream.status
        # One request, one outcome: a 5xx is counted at its head, and a body of it that
        # then breaks or goes silent is not counted again.
        counted = status >= 500
        if counted:
            # Passed through unchanged (vLLM says why in the body), and counted now, so the
            # reflex drop applies before this response has even been relayed.
            # The backend's words reach `status`, the state and the audit, cut as every
            # other detail is (_short): a reason phrase may be most of a 64 KiB head.
            reason = printable(upstream.reason[:200])
            self._fail(name, origin, request, FailureKind.SERVER_ERROR, status, reason)
        headers = downstream_headers(Fields(upstream.headers))
        headers[BACKEND_HEADER] = name  # which backend answered, for the operator
        self._answered(name, status)
        # Without regard to case, as media types are named (RFC 9110 8.3.1).
        event_stream = (headers.get("Content-Type") or "").lower().startswith("text/event-stream")
        # An error event written past a declared length would end the client's body early,
        # or be cut into it, and pass for the whole: only a stream its chunks (or its
        # close) frame is told in-band that it broke; one framed by length is cut off.
        in_band = event_stream and headers.get("Content-Length") is None
        whole = None if event_stream else upstream.whole()
        watch = ErrorEventWatch() if event_stream and not counted else None
        cut = False  # the answer broke: never served, whatever is left in hand
        # The last bytes relayed of an in-band stream: an error event written after half
        # an event was glued to it, its "event: error" line read as the half's data, and
        # the client's SSE parser handed on one broken message instead (``_between_events``).
        tail = b""
        try:
            # A shared coarse timer, not wait_for nor asyncio.timeout: on Python 3.11
            # wait_for costs a task per call, asyncio.timeout a loop timer, and this path
            # runs for every chunk of every response.
            if whole is not None:
                # The whole body came with the headers (a short answer): relayed without
                # the read loop's waits, in one send with the headers up to WHOLE_PIECE.
                await self._answer_whole(request, status, headers, whole, upstream.reason)
                self._record_success(name, origin, request, status)
                return True
            with self._deadlines.within(self._settings.client_timeout):
                await request.start(status, headers, upstream.reason)
            while True:
                try:
                    with self._deadlines.within(self._settings.stream_idle_timeout):
                        chunk = await upstream.read()
                except TimeoutError:
                    cut = True
                    seconds = self._settings.stream_idle_timeout
                    detail = f"response silent for {seconds:g} s after it started"
                    if not counted:
                        self._fail(name, origin, request, FailureKind.STREAM_IDLE, status, detail)
                    await self._end_broken(request, name, detail, in_band and _between_events(tail))
                    return False
                except BrokenError as exc:
                    cut = True
                    detail = f"response cut off: {_short(exc)}"
                    if not counted:
                        self._fail(name, origin, request, FailureKind.BROKEN, status, detail)
                    await self._end_broken(request, name, detail, in_band and _between_events(tail))
                    return False
                if not chunk:
                    break
                if in_band:
                    tail = (tail + chunk[-3:])[-3:]
                if watch is not None and (error := watch.feed(chunk)) is not None:
                    code, detail = error
                    if code is not None and code >= 500:  # below: the request's own fault
                        counted = True
                        self._fail(name, origin, request, FailureKind.SERVER_ERROR, code, detail)
                with self._deadlines.within(self._settings.client_timeout):
                    await request.write(chunk)
            with self._deadlines.within(self._settings.client_timeout):
                await request.end()
        except (TimeoutError, ConnectionError):
            # The client stopped reading or went away: its doing, never the backend's,
            # which served all the same when its whole answer was in hand.
            request.abort()
            if not cut:
                self._served_anyway(name, origin, request, upstream, watch)
            return False
        except asyncio.CancelledError:
            # The client's connection ended while a write waited for it to take more: its
            # end cancels this (edge.py), the usual way a client leaves; as above.
            if not cut:
                self._served_anyway(name, origin, request, upstream, watch)
            raise
        if watch is None or not watch.seen:
            self._record_success(name, origin, request, status)
        return True

    async def _answer_whole(
        self, request: Request, status: int, headers: Fields, body: bytes, reason: str = ""
    ) -> None:
        """A whole answer: a short one in one write with its head; a longer one framed by
        its length and written in pieces of ``WHOLE_PIECE``, each bounded by
        ``client_timeout`` on its own, so that only a client that stops taking data is
        dropped (``TimeoutError``), never one taking a large answer slowly."""
        client_timeout = self._settings.client_timeout
        if len(body) <= WHOLE_PIECE:
            with self._deadlines.within(client_timeout):
                await request.answer(status, headers, body, reason)
            return
        if "content-length" not in headers:
            headers.add("Content-Length", str(len(body)))  # as ``answer`` gives it
        with self._deadlines.within(client_timeout):
            await request.start(status, headers, reason)
        for at in range(0, len(body), WHOLE_PIECE):
            with self._deadlines.within(client_timeout):
                await request.write(body[at : at + WHOLE_PIECE])
        with self._deadlines.within(client_timeout):
            await request.end()

    async def _metrics_page(self) -> bytes:
        """The ``/metrics`` page, rendered in a thread beside the loop, one render at a
        time, shared by the scrapes that ask while it runs.

        Rendered on the loop, the page (every backend's series and, in ``route``, the
        daemon's) held every stream for its CPU: 0.2 s at 1,000 backends, per request
        of any client. A process out of threads renders it here, as before."""
        rendering = self._rendering
        if rendering is None:
            loop = asyncio.get_running_loop()
            try:
                rendering = loop.run_in_executor(None, generate_latest, self.registry)
            except RuntimeError:  # no thread to be had (a pids limit)
                return generate_latest(self.registry)
            self._rendering = rendering
            rendering.add_done_callback(self._rendered)
        # Shielded: a scraper that leaves does not end the render the others wait for.
        return await asyncio.shield(rendering)

    def _rendered(self, rendering: asyncio.Future[bytes]) -> None:
        if self._rendering is rendering:
            self._rendering = None

    def _served_anyway(
        self,
        name: str,
        origin: Origin,
        request: Request,
        upstream: Response,
        watch: ErrorEventWatch | None,
    ) -> None:
        """A success for an answer its client left, when the backend's whole answer was
        read and no error event was in it."""
        if upstream.complete and (watch is None or not watch.seen):
            self._record_success(name, origin, request, upstream.status)

    def _record_success(self, name: str, origin: Origin, request: Request, status: int) -> None:
        """A request the backend answered below 400: it served, whatever the client did next."""
        if status < 400 and (named := self._named_now(name, origin)) is not None:
            self._log.record(named, RequestOutcome(self._clock(), _method(request), request.path))

    async def _end_broken(
        self,
        request: Request,
        name: str,
        detail: str,
        in_band: bool,
    ) -> None:
        """A response that broke after it started. An SSE client of a stream not framed by
        length and broken between two events (``in_band``) hears an ``error`` event (the
        OpenAI SDKs raise it), then the stream's end and the connection's close; any other
        body is cut off, so no client takes part of a body for the whole."""
        if not in_band:
            request.abort()
            return
        event = {"error": {"message": f"backend failed: {detail}", "type": "backend_failed"}}
        payload = f"event: error\ndata: {json.dumps({**event, 'backend': name})}\n\n"
        request.force_close()
        try:
            with self._deadlines.within(self._settings.client_timeout):
                await request.write(payload.encode())
                await request.end()
        except (TimeoutError, ConnectionError):
            request.abort()

    # --- the router's own answers ------------------------------------------------------

    def _fail(
        self,
        name: str,
        origin: Origin,
        request: Request,
        kind: FailureKind,
        status: int | None,
        detail: str,
    ) -> None:
        """Count a failure against a backend and drop it from choice until the next push.
        Not a failure at the address a reload has since moved it from: that server is not
        this one, and the new one never saw the request. Renamed at that server since, it
        counts under the new name (``_named_now``)."""
        named = self._named_now(name, origin)
        if named is None:
            return
        name = named
        self._log.record(
            name,
            RequestOutcome(self._clock(), _method(request), request.path, kind, status, detail),
        )
        self._dropped.add(name)
        self.metrics.failures[name, str(kind)] += 1
        self.metrics.serving = len(self._pick_set())

    def _moved(self, name: str, origin: Origin) -> bool:
        """Whether a reload has since taken the backend from the server at ``origin``; its
        URL written another way (the scheme's own port spelled out) is no move, as in
        ``configure``: the Host header it sends is not where it is."""
        now = self._origins.get(name)
        return now is None or (now.scheme, now.host, now.port, now.prefix) != (
            origin.scheme,
            origin.host,
            origin.port,
            origin.prefix,
        )

    def _named_now(self, name: str, origin: Origin) -> str | None:
        """The name the server at ``origin`` has now, for an outcome of a request sent to
        it as ``name``: that name unless a reload since moved it (``_moved``); the new
        name when one renamed it there (the settle renames it, its streak kept); None
        when nothing is configured there any more."""
        if not self._moved(name, origin):
            return name
        if name in self._backends:
            return None  # moved elsewhere: what its old server did is not this one's
        for other in self._backends:
            if not self._moved(other, origin):
                return other
        return None

    def _pick_set(self) -> dict[str, Models]:
        return {n: m for n, m in self._serving.items() if n not in self._dropped}

    def _backend_failed(self, name: str, detail: str) -> Answer:
        # 500, not 502/504: the OpenAI SDKs retry 5xx either way, and a gateway timeout
        # would blame the network for what the backend did.
        return self._answer(name, 500, {"error": f"backend failed: {detail}", "backend": name})

    def _not_sent(self, name: str, why: _Retry, detail: str) -> Answer:
        """A request no backend was sent: its last attempt's failure, as the client hears it.
        The router's own is its ``no_backend_status`` with Retry-After, as for nothing
        serving, not a backend's 500: that would count in the backend's series of answers
        and tell the client it failed."""
        if why.ours:
            return self._answer(
                None,
                self._settings.no_backend_status,
                {"error": f"the router could not send the request: {detail}"},
                headers={"Retry-After": self._retry_after},
            )
        return self._backend_failed(name, detail)

    def _no_backend(self, model: str | None) -> Answer:
        self.metrics.no_backend += 1
        shown = model if model is None or len(model) <= SHOWN_MODEL else model[:SHOWN_MODEL] + "..."
        wanted = f"model {shown!r}" if shown else "this request"
        backends = {}
        for name in sorted(self._backends):
            state = self._states.get(name, "unknown")
            if name in self._dropped:
                state += " (dropped after a failed request, until the next settle)"
            elif name in self._serving and not serves(self._serving[name], model):
                state += " (serves other models)"
            backends[name] = state
        return self._answer(
            None,
            self._settings.no_backend_status,
            {"error": f"no backend is serving {wanted}", "backends": backends},
            headers={"Retry-After": self._retry_after},
        )

    def _health(self) -> Answer:
        """The ledger's floor, and whether the router can send anywhere now: with every
        serving backend dropped after a failure (sent nothing until the next settle, named
        apart) each request gets ``no_backend_status``, and a load balancer that heard
        "ok" kept sending. One dropped among others breaches nothing: the rest serve.
        Nor is a floor of 0 with nothing serving "ok": never breached, it said so while
        every request was answered ``no_backend_status``."""
        serving = len(self._serving)
        if serving < self._min_healthy:
            status = "floor breached"
        elif not serving:
            status = "no backend serving"
        elif not self._pick_set():
            status = "every serving backend dropped after a failed request"
        else:
            status = "ok"
        body = {
            "status": status,
            "serving": serving,
            "min_healthy": self._min_healthy,
            "backends": {
                name: self._states.get(name, "unknown") for name in sorted(self._backends)
            },
            "dropped": sorted(self._dropped),
            "in_flight": self.in_flight,
        }
        return _json(200 if status == "ok" else 503, body)

    def _models(self) -> Answer:
        models = sorted(
            {
                model
                for served in self._serving.values()
                if served is not ANY_MODEL
                for model in served
            }
        )
        data = [{"id": model, "object": "model", "owned_by": "llmhealth"} for model in models]
        return _json(200, {"object": "list", "data": data})

    def _answer(
        self,
        backend: str | None,
        status: int,
        body: dict[str, object],
        headers: Mapping[str, str] | None = None,
    ) -> Answer:
        self._answered(backend, status)
        return _json(status, body, headers)

    def _answered(self, backend: str | None, status: int) -> None:
        """Count one answer; never under a backend a reload dropped while it was asked:
        its series left the page then, and counted it came back, for good."""
        if backend is None:
            self.metrics.answered("none", status)
        elif backend in self._backends:
            self.metrics.answered(backend, status)


def _between_events(tail: bytes) -> bool:
    """Whether an event stream whose relayed bytes end in ``tail`` (its last three) stopped
    between two events: nothing yet, or a blank line last (SSE ends a line with CRLF, LF
    or CR: a line ended by CR, then a blank one by CRLF, is one too). Cut inside one, an
    event written after it would be read as part of it."""
    return not tail or tail.endswith((b"\n\n", b"\r\r", b"\n\r\n", b"\r\r\n"))


def _json(status: int, body: object, headers: Mapping[str, str] | None = None) -> Answer:
    fields = Fields([("Content-Type", "application/json; charset=utf-8")])
    for name, value in (headers or {}).items():
        fields.add(name, value)
    return Answer(status, fields, json.dumps(body).encode())


def _method(request: Request) -> str:
    """The request's method as an outcome keeps it: the client's to choose, any token up
    to the 64 KiB head bound, and it reaches the ledger's last error, the state and the
    audit with every failure, where each other detail is cut (``_short``)."""
    method = request.method
    return method if len(method) <= MAX_METHOD else method[:MAX_METHOD] + "..."


def _short(exc: BaseException) -> str:
    """An error's text, short and printable: it goes into logs and JSON answers."""
    return printable((str(exc) or type(exc).__name__)[:200])


def _retry_after(wait: float) -> str:
    """A 503's Retry-After for a wait: whole seconds, at least one (RFC 9110 10.2.3)."""
    return str(max(1, math.ceil(wait)))
