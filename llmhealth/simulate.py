"""`llmhealth simulate`: serve simulated vLLM backends and proxies over real HTTP/1.1 sockets.

Rule: this module only does I/O (sockets, the clock, signals, the proxy's httpx client). What a
backend shows and when it answers is decided by simengine from the time passed in; nothing here
runs on a timer, so one process can hold a thousand backends.
"""

from __future__ import annotations

import asyncio
import contextlib
import http
import importlib.resources
import json
import signal
import sys
import time
import traceback
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, replace
from email.utils import formatdate
from typing import TYPE_CHECKING, Any

from llmhealth import simengine
from llmhealth.simengine import ModeSpec, Outcome, SimConfig

if TYPE_CHECKING:
    import httpx

MAX_HEADER_BYTES = 64 * 1024
MAX_BODY_BYTES = 1024 * 1024
TEMPLATE_NAME = "vllm_metrics_template.txt"
VERSION = "0.32.0"  # the vLLM version the template was captured from
METRICS_CONTENT_TYPE = "text/plain; version=1.0.0; charset=utf-8"
_HOP_BY_HOP = frozenset(
    {"connection", "keep-alive", "transfer-encoding", "te", "upgrade", "host", "content-length"}
    | {"proxy-authorization", "proxy-connection", "expect"}
)


class SimulateError(Exception):
    """Bad modes or options, or a port that cannot be listened on."""


class _HttpError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class _Request:
    method: str
    target: str  # origin form, path and query as sent
    version: str
    headers: dict[str, str]  # lower-case names
    body: bytes

    @property
    def path(self) -> str:
        return self.target.partition("?")[0]

    @property
    def keep_alive(self) -> bool:
        tokens = {t.strip().lower() for t in self.headers.get("connection", "").split(",")}
        if self.version == "HTTP/1.0":
            return "keep-alive" in tokens
        return "close" not in tokens


@dataclass(frozen=True)
class _Response:
    status: int
    body: bytes = b""
    content_type: str | None = None


def _json(status: int, payload: object) -> _Response:
    body = json.dumps(payload, separators=(",", ":")).encode()
    return _Response(status, body, "application/json")


def _error(status: int, message: str) -> _Response:
    # The nested shape vLLM's OpenAI server uses for its errors.
    kind = http.HTTPStatus(status).phrase.replace(" ", "") + "Error"
    error = {"message": message, "type": kind, "param": None, "code": status}
    return _json(status, {"error": error})


def _loads(body: bytes) -> Any:
    """A request body's JSON; ValueError for any body that is not JSON we can take.

    Bodies of 1 MiB reach further than json's own errors: 100,000 nested brackets raise
    RecursionError, an integer of 5,000 digits a plain ValueError, and either answered
    500 with a traceback on the simulator's stderr, where vLLM answers 400.
    """
    try:
        return json.loads(body)  # its other errors are ValueErrors (bad UTF-8 too)
    except RecursionError as exc:
        raise ValueError("JSON nested too deep") from exc


def _detail(status: int) -> _Response:
    # FastAPI's shape for routing errors (unknown path, wrong method).
    return _json(status, {"detail": http.HTTPStatus(status).phrase})


def _encode(response: _Response, *, close: bool) -> bytes:
    lines = [
        f"HTTP/1.1 {response.status} {http.HTTPStatus(response.status).phrase}",
        f"date: {formatdate(usegmt=True)}",
        "server: llmhealth-simulate",
        f"content-length: {len(response.body)}",
    ]
    if response.content_type:
        lines.append(f"content-type: {response.content_type}")
    if close:
        lines.append("connection: close")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + response.body


class _Connection:
    """A client connection with its own buffer, so a disconnect watcher never loses bytes."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._reader = reader
        self._writer = writer
        self._buffer = bytearray()
        self._eof = False

    async def _fill(self) -> None:
        data = await self._reader.read(65536)
        if data:
            self._buffer += data
        else:
            self._eof = True

    async def read_request(self, idle_timeout: float | None) -> _Request | None:
        """The next request, or None when the client closed or stayed idle too long."""
        try:
            async with asyncio.timeout(idle_timeout):
                return await self._read_request()
        except TimeoutError:
            return None

    async def _read_request(self) -> _Request | None:
        while (end := self._buffer.find(b"\r\n\r\n")) < 0:
            if len(self._buffer) > MAX_HEADER_BYTES:
                raise _HttpError(431, "request headers are larger than 64 KiB")
            if self._eof:
                if self._buffer.strip():
                    raise _HttpError(400, "incomplete request")
                return None
            await self._fill()
        if end > MAX_HEADER_BYTES:
            raise _HttpError(431, "request headers are larger than 64 KiB")
        head = self._buffer[:end].decode("latin-1")
        del self._buffer[: end + 4]
        request_line, *header_lines = head.lstrip("\r\n").split("\r\n")
        parts = request_line.split(" ")
        if len(parts) != 3 or not parts[2].startswith("HTTP/1.") or not parts[1].startswith("/"):
            raise _HttpError(400, "malformed request line")
        method, target, version = parts
        headers: dict[str, str] = {}
        for line in header_lines:
            name, colon, value = line.partition(":")
            if not colon or not name or name != name.strip():
                raise _HttpError(400, "malformed header line")
            key = name.lower()
            headers[key] = f"{headers[key]}, {value.strip()}" if key in headers else value.strip()
        if "transfer-encoding" in headers:
            raise _HttpError(501, "chunked request bodies are not supported; send Content-Length")
        try:
            length = int(headers.get("content-length", "0"))
        except ValueError:
            raise _HttpError(400, "bad Content-Length") from None
        if length < 0:
            raise _HttpError(400, "bad Content-Length")
        if length > MAX_BODY_BYTES:
            raise _HttpError(413, "request body is larger than 1 MiB")
        if length and headers.get("expect", "").lower() == "100-continue":
            self._writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        while len(self._buffer) < length:
            if self._eof:
                return None
            await self._fill()
        body = bytes(self._buffer[:length])
        del self._buffer[:length]
        return _Request(method, target, version, headers, body)

    async def send(self, data: bytes) -> None:
        """Part of a response that is written as it is made (a stream)."""
        self._writer.write(data)
        await self._writer.drain()

    async def until_peer_closes(self) -> None:
        """Return when the client closes; keep what it sends meanwhile, up to a bound."""
        while not self._eof and len(self._buffer) <= MAX_HEADER_BYTES + MAX_BODY_BYTES:
            await self._fill()

    async def wait_unless_closed(self, delay: float) -> bool:
        """Wait `delay` seconds; False if the client hung up first."""
        if delay <= 0:
            return True
        watcher = asyncio.ensure_future(self.until_peer_closes())
        try:
            done, _ = await asyncio.wait({watcher}, timeout=delay)
        finally:
            await _cancel(watcher)
        return not done


async def _cancel(*tasks: asyncio.Future[Any]) -> None:
    """Cancel helper tasks and reap them, without swallowing a cancellation of our own."""
    for task in tasks:
        task.cancel()
    await asyncio.wait(tasks)
    for task in tasks:
        if not task.cancelled():
            task.exception()  # retrieved, so asyncio does not log it; a reset peer is expected


Handler = Callable[[_Request, _Connection], Awaitable[_Response | None]]
# How long an idle connection may wait for its next request (None: forever), asked before
# each one: a restart may turn a backend into a hung one or back.
IdleTimeout = Callable[[], float | None]


async def _serve_connection(
    reader: asyncio.StreamReader,
    writer: asyncio.StreamWriter,
    handler: Handler,
    idle_timeout: IdleTimeout,
) -> None:
    conn = _Connection(reader, writer)
    try:
        while True:
            try:
                request = await conn.read_request(idle_timeout())
            except _HttpError as exc:
                writer.write(_encode(_error(exc.status, str(exc)), close=True))
                await writer.drain()
                return
            if request is None:
                return
            try:
                response = await handler(request, conn)
            except Exception:
                # A bug in the simulator: show it, and answer as a crashing server would.
                traceback.print_exc()
                response = _error(500, "internal error in llmhealth simulate")
            if response is None:
                return
            writer.write(_encode(response, close=not request.keep_alive))
            await writer.drain()
            if not request.keep_alive:
                return
    except OSError:
        return  # reset, broken pipe: the client is gone, which is its right
    finally:
        writer.close()
        try:
            async with asyncio.timeout(1.0):
                await writer.wait_closed()
        except (TimeoutError, OSError):
            writer.transport.abort()


class _Clock:
    """Wall-clock seconds that never run backwards (the engines need epoch-like times)."""

    def __init__(self) -> None:
        self._wall = time.time()
        self._mono = time.monotonic()

    def __call__(self) -> float:
        return self._wall + (time.monotonic() - self._mono)


@dataclass
class _Stats:
    mode: str
    completions_received: int = 0
    completions_answered: int = 0
    metrics_reads: int = 0
    models_reads: int = 0
    restarts: int = 0

    def response(self) -> _Response:
        return _json(200, self.__dict__)


class _Backend:
    """The HTTP face of one simengine.SimBackend."""

    def __init__(
        self, spec: ModeSpec, config: SimConfig, metrics: simengine.MetricsText, clock: _Clock
    ) -> None:
        self.spec = spec
        self.config = config
        self.metrics = metrics
        self.clock = clock
        self.model = simengine.SimBackend(spec, config, born=clock())
        self.stats = _Stats(spec.text)
        # POST /sim/metrics {"hang": true}: /metrics stops answering (a long pause, a
        # partition) while the process and its engines go on, until {"hang": false}.
        self.metrics_hang = False

    def stats_response(self) -> _Response:
        """The counters, and when the current simulated process really started."""
        start = self.model.start_time(self.clock())
        return _json(200, {**self.stats.__dict__, "start_time": start})

    def idle_timeout(self) -> float | None:
        """A hung server never times a connection out; the others close idle ones as uvicorn."""
        return None if self.spec.hang else self.config.keep_alive

    async def handle(self, request: _Request, conn: _Connection) -> _Response | None:
        path, method = request.path, request.method
        # The simulator's own controls answer whatever its process does: a restart is
        # what brings a frozen API server back, and a test asks for the stats of any.
        if path == "/sim/restart" and method == "POST":
            return self._restart(request)
        if path == "/sim/metrics" and method == "POST":
            return self._set_metrics_hang(request)
        if path == "/sim/stats" and method == "GET":
            return self.stats_response()
        if self.spec.hang:
            # A frozen API server: the connection opens, the request is read, nothing comes back.
            await conn.until_peer_closes()
            return None
        if path == "/v1/completions":
            if method != "POST":
                return _detail(405)
            return await self._completion(request, conn)
        if path == "/ping" and method == "POST":
            return _Response(200)
        if path == "/metrics" and self.metrics_hang:
            await conn.until_peer_closes()
            return None
        if path not in _GET_ROUTES:
            return _detail(404)
        if method != "GET":
            return _detail(405)
        return _GET_ROUTES[path](self)

    def _restart(self, request: _Request) -> _Response:
        """Stand in for a process restart, so a restart command can be exercised for real.

        The new "process" has a new start time and counters from zero, in the mode the
        body names (``{"mode": "idle"}``; the current one when absent). Requests still
        held by the old one finish against it. It is young, as a real restart is (its
        startup window applies), unless the body gives it an ``age`` in seconds: a test
        that stands another long-running process in its place.
        """
        try:
            payload = _loads(request.body or b"{}")
        except ValueError as exc:
            return _error(400, f"body must be a JSON object: {exc}")
        try:
            spec = simengine.parse_mode(str(payload.get("mode", self.spec.text)))
            age = payload.get("age", 0.0)
            if isinstance(age, bool) or not isinstance(age, int | float):
                return _error(400, "age must be a number of seconds")
            # float() first: an integer too large for one passed the checks, and then
            # every /metrics of the new process failed on it.
            config = replace(self.config, age=float(age))
        except AttributeError as exc:
            return _error(400, f"body must be a JSON object: {exc}")
        except OverflowError:
            return _error(400, "age must be a finite number of seconds, 0 or more")
        except (simengine.ModeError, TypeError, ValueError) as exc:
            return _error(400, str(exc))
        if spec.is_proxy or spec.multiproc != self.spec.multiproc:
            return _error(400, "a restart keeps the backend's kind and metrics mode")
        self.spec = spec
        self.model = simengine.SimBackend(spec, config, born=self.clock())
        self.stats.mode = spec.text
        self.stats.restarts += 1
        return _json(200, {"mode": spec.text, "start_time": self.model.start_time(self.clock())})

    def _set_metrics_hang(self, request: _Request) -> _Response:
        """Make /metrics hang or answer again; the process (start time, counters) stays."""
        try:
            payload = _loads(request.body or b"{}")
        except ValueError as exc:
            return _error(400, f"body must be a JSON object: {exc}")
        hang = payload.get("hang") if isinstance(payload, dict) else None
        if not isinstance(hang, bool):
            return _error(400, 'body must be {"hang": true} or {"hang": false}')
        self.metrics_hang = hang
        return _json(200, {"metrics_hang": hang})

    def _metrics(self) -> _Response:
        self.stats.metrics_reads += 1
        if self.spec.no_metrics:
            return _detail(404)
        text = self.metrics.render(self.model.observe(self.clock()))
        return _Response(200, text.encode(), METRICS_CONTENT_TYPE)

    def _models(self) -> _Response:
        self.stats.models_reads += 1
        created = int(self.model.start_time(self.clock()))
        return _json(200, _model_list(self.config.model, created))

    async def _completion(self, request: _Request, conn: _Connection) -> _Response | None:
        self.stats.completions_received += 1
        try:
            payload = _loads(request.body)
        except ValueError:
            return _error(400, "request body is not valid JSON")
        if not isinstance(payload, dict):
            return _error(400, "request body must be a JSON object")
        model = payload.get("model", self.config.model)
        if model != self.config.model:
            return _error(404, f"The model `{model}` does not exist.")
        stream = payload.get("stream") is True
        max_tokens = payload.get("max_tokens", simengine.DEFAULT_MAX_TOKENS)
        if (
            not isinstance(max_tokens, int)
            or isinstance(max_tokens, bool)
            or not 1 <= max_tokens <= simengine.MAX_MODEL_LEN
        ):
            return _error(400, f"max_tokens must be an integer from 1 to {simengine.MAX_MODEL_LEN}")
        prompt_tokens = _count_prompt_tokens(payload.get("prompt"))
        if prompt_tokens is None:
            return _error(400, "prompt must be a string, a list of strings or of token ids")
        ticket = self.model.submit(self.clock(), prompt_tokens, max_tokens)
        if stream:
            await self._stream(ticket, conn)
            return None
        if ticket.outcome is Outcome.HANG:
            await conn.until_peer_closes()
            return None
        if not await conn.wait_unless_closed(ticket.at - self.clock()):
            return None
        if ticket.outcome is Outcome.DROP:
            return None  # the simulated process went away under the request
        self.stats.completions_answered += 1
        return _json(200, _completion_body(self.config.model, ticket, int(self.clock())))

    async def _stream(self, ticket: simengine.Ticket, conn: _Connection) -> None:
        """``stream: true`` as vLLM answers it: headers at once, then one SSE event per
        token, spread evenly until the ticket's time, then ``data: [DONE]``. A request the
        engine will never finish (HANG) gets the headers and then silence, as a wedged
        vLLM gives; the connection closes after the stream either way."""
        await conn.send(
            b"HTTP/1.1 200 OK\r\nserver: llmhealth-simulate\r\n"
            b"content-type: text/event-stream\r\ntransfer-encoding: chunked\r\n"
            b"connection: close\r\n\r\n"
        )
        if ticket.outcome is Outcome.HANG:
            await conn.until_peer_closes()
            return
        tokens = ticket.completion_tokens
        for index in range(tokens):
            if not await conn.wait_unless_closed((ticket.at - self.clock()) / (tokens - index)):
                return
            if ticket.outcome is Outcome.DROP and self.clock() >= ticket.at:
                return  # the simulated process went away mid-stream
            event = {
                "object": "text_completion",
                "model": self.config.model,
                "choices": [{"index": 0, "text": " sim", "finish_reason": None}],
            }
            await conn.send(_chunk(b"data: " + json.dumps(event).encode() + b"\n\n"))
        if ticket.outcome is Outcome.DROP:
            return
        self.stats.completions_answered += 1
        await conn.send(_chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n")


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


_GET_ROUTES: dict[str, Callable[[_Backend], _Response]] = {
    "/metrics": _Backend._metrics,
    "/v1/models": _Backend._models,
    "/health": lambda b: _Response(200),
    "/ping": lambda b: _Response(200),
    "/version": lambda b: _json(200, {"version": VERSION}),
    "/load": lambda b: _json(200, {"server_load": 0}),
    "/sim/stats": lambda b: b.stats_response(),
}


def _count_prompt_tokens(prompt: object) -> int | None:
    """A rough token count (words for text), enough to move the prompt-token counters.

    The prompts vLLM takes: a text, token ids, or a list of either. Any depth of lists
    was counted by recursion, and 900 nested ones answered 500 with a RecursionError.
    """
    if isinstance(prompt, str):
        return max(1, len(prompt.split()))
    if not isinstance(prompt, list) or not prompt:
        return None
    if _token_ids(prompt):
        return len(prompt)
    if all(isinstance(p, str) for p in prompt):
        return sum(max(1, len(p.split())) for p in prompt)
    if all(isinstance(p, list) and p and _token_ids(p) for p in prompt):
        return sum(len(p) for p in prompt)
    return None


def _token_ids(prompt: list[Any]) -> bool:
    return all(isinstance(p, int) and not isinstance(p, bool) for p in prompt)


def _model_list(model: str, created: int) -> dict[str, object]:
    permission = {
        "id": f"modelperm-{uuid.uuid4().hex[:16]}",
        "object": "model_permission",
        "created": created,
        "allow_create_engine": False,
        "allow_sampling": True,
        "allow_logprobs": True,
        "allow_search_indices": False,
        "allow_view": True,
        "allow_fine_tuning": False,
        "organization": "*",
        "group": None,
        "is_blocking": False,
    }
    card = {
        "id": model,
        "object": "model",
        "created": created,
        "owned_by": "vllm",
        "root": model,
        "parent": None,
        "max_model_len": simengine.MAX_MODEL_LEN,
        "permission": [permission],
    }
    return {"object": "list", "data": [card]}


def _completion_body(model: str, ticket: simengine.Ticket, created: int) -> dict[str, object]:
    choice = {
        "index": 0,
        "text": " sim" * ticket.completion_tokens,
        "logprobs": None,
        "finish_reason": "length",
        "stop_reason": None,
        "prompt_logprobs": None,
    }
    usage = {
        "prompt_tokens": ticket.prompt_tokens,
        "total_tokens": ticket.prompt_tokens + ticket.completion_tokens,
        "completion_tokens": ticket.completion_tokens,
        "prompt_tokens_details": None,
    }
    return {
        "id": f"cmpl-{uuid.uuid4().hex}",
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": [choice],
        "usage": usage,
        "service_tier": None,
        "system_fingerprint": None,
        "kv_transfer_params": None,
    }


class _Proxy:
    """A least-connections forwarder; like a real balancer it has no /metrics of its own."""

    def __init__(self, spec: ModeSpec, client: httpx.AsyncClient) -> None:
        self.urls = spec.proxy_urls
        self.client = client
        self.stats = _Stats(spec.text)
        self._in_flight = [0] * len(self.urls)
        self._next = 0

    def _pick(self) -> int:
        fewest = min(self._in_flight)
        for step in range(len(self.urls)):
            index = (self._next + step) % len(self.urls)
            if self._in_flight[index] == fewest:
                self._next = (index + 1) % len(self.urls)
                return index
        raise AssertionError("unreachable: some backend has the fewest requests")

    async def handle(self, request: _Request, conn: _Connection) -> _Response | None:
        import httpx  # noqa: PLC0415 - only proxies pay for importing httpx

        path = request.path
        if path == "/sim/stats":
            return self.stats.response()
        if path == "/metrics":
            self.stats.metrics_reads += 1
            return _detail(404)
        completion = path == "/v1/completions"
        self.stats.completions_received += int(completion)
        self.stats.models_reads += int(path == "/v1/models")
        index = self._pick()
        # The bytes as received (read as latin-1): httpx encodes a str value as ASCII, and
        # a value of obs-text (a UTF-8 name), legal HTTP, was answered 500.
        headers = [
            (name.encode("latin-1"), value.encode("latin-1"))
            for name, value in request.headers.items()
            if name not in _HOP_BY_HOP
        ]
        self._in_flight[index] += 1
        try:
            upstream = asyncio.ensure_future(
                self.client.request(
                    request.method,
                    self.urls[index] + request.target,
                    content=request.body,
                    headers=headers,
                )
            )
            watcher = asyncio.ensure_future(conn.until_peer_closes())
            try:
                await asyncio.wait({upstream, watcher}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                await _cancel(upstream, watcher)
        finally:
            self._in_flight[index] -= 1
        if upstream.cancelled():
            return None  # the client left; the upstream request was cancelled with it
        exc = upstream.exception()
        if isinstance(exc, httpx.InvalidURL):
            # A target no URL can carry (a control character): refused, as a real proxy
            # does; it was answered 500, with a traceback on stderr.
            return _error(400, f"request target cannot be forwarded: {exc}")
        if isinstance(exc, httpx.HTTPError):
            return _error(502, f"backend {self.urls[index]}: {type(exc).__name__}: {exc}")
        if exc is not None:
            raise exc
        reply = upstream.result()
        if completion and reply.is_success:
            self.stats.completions_answered += 1
        return _Response(reply.status_code, reply.content, reply.headers.get("content-type"))


class _Listeners:
    """Every listening socket and client connection, so shutdown can close them all."""

    def __init__(self) -> None:
        self.servers: list[asyncio.Server] = []
        self.tasks: set[asyncio.Task[None]] = set()
        self.closing = False

    async def listen(self, handler: Handler, host: str, port: int, idle: IdleTimeout) -> int:
        def connected(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            if self.closing:
                writer.transport.abort()
                return
            # Our own tasks (not a coroutine callback) so shutdown can cancel and reap them.
            task = asyncio.get_running_loop().create_task(
                _serve_connection(reader, writer, handler, idle)
            )
            self.tasks.add(task)
            task.add_done_callback(self.tasks.discard)

        try:
            server = await asyncio.start_server(connected, host, port)
        except OSError as exc:
            raise SimulateError(f"cannot listen on {_url(host, port)}: {exc.strerror}") from exc
        self.servers.append(server)
        bound: int = server.sockets[0].getsockname()[1]
        return bound

    async def close(self) -> None:
        self.closing = True
        for server in self.servers:
            server.close()
        tasks = list(self.tasks)
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks)
        for server in self.servers:
            await server.wait_closed()


def _url(host: str, port: int) -> str:
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def _raise_fd_limit(backends: int) -> None:
    """A listener per backend plus its clients can pass a default soft limit of 1024 fds."""
    try:
        import resource  # noqa: PLC0415 - POSIX only
    except ImportError:
        return
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = 4 * backends + 256
    if soft != resource.RLIM_INFINITY and soft < wanted:
        limit = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (limit, hard))


def _parse_modes(modes: Sequence[str]) -> list[ModeSpec]:
    if not modes:
        raise SimulateError("give at least one mode")
    try:
        return [simengine.parse_mode(mode) for mode in modes]
    except simengine.ModeError as exc:
        raise SimulateError(str(exc)) from exc


async def _serve(specs: list[ModeSpec], config: SimConfig, host: str, port: int) -> None:
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)
    _raise_fd_limit(len(specs))
    template = importlib.resources.files("llmhealth").joinpath(TEMPLATE_NAME).read_text("utf-8")
    texts = {
        multiproc: simengine.MetricsText(
            template, engines=config.engines, model=config.model, multiproc=multiproc
        )
        for multiproc in {spec.multiproc for spec in specs if not spec.is_proxy}
    }
    clock = _Clock()
    listeners = _Listeners()
    client: httpx.AsyncClient | None = None
    try:
        lines = []
        for offset, spec in enumerate(specs):
            handler: Handler
            idle: IdleTimeout
            if spec.is_proxy:
                if client is None:
                    client = _proxy_client()
                handler, idle = _Proxy(spec, client).handle, lambda: config.keep_alive
            else:
                backend = _Backend(spec, config, texts[spec.multiproc], clock)
                handler, idle = backend.handle, backend.idle_timeout
            bound = await listeners.listen(handler, host, port + offset if port else 0, idle)
            lines.append(f"listening {_url(host, bound)} {spec.text}\n")
        sys.stdout.write("".join(lines) + "ready\n")
        sys.stdout.flush()
        await stop.wait()
    finally:
        await listeners.close()
        if client is not None:
            await client.aclose()
        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(signum)


def _proxy_client() -> httpx.AsyncClient:
    import httpx  # noqa: PLC0415 - only proxies pay for importing httpx

    # No read timeout: the proxy waits as long as its client does, and gives up with it.
    return httpx.AsyncClient(
        timeout=httpx.Timeout(5.0, read=None, pool=None),
        limits=httpx.Limits(max_connections=None, max_keepalive_connections=64),
        trust_env=False,
    )


def run(
    modes: Sequence[str],
    *,
    host: str = "127.0.0.1",
    port: int = 8100,
    max_num_seqs: int = 4,
    model: str = "tiny",
    engines: int = 1,
    request_seconds: float = 4.0,
    age: float = 3600.0,
    keep_alive: float = 5.0,
) -> None:
    """Blocks serving one simulated backend per mode on port, port+1, ... until SIGINT/SIGTERM.

    Port 0 gives each backend a free port chosen by the system. Raises SimulateError for bad
    modes or options and for a port that cannot be listened on.
    """
    specs = _parse_modes(modes)
    try:
        config = SimConfig(
            max_num_seqs=max_num_seqs,
            request_seconds=request_seconds,
            engines=engines,
            model=model,
            age=age,
            keep_alive=keep_alive,
        )
    except ValueError as exc:
        raise SimulateError(str(exc)) from exc
    if not 0 <= port <= 65535 or (port and port + len(specs) - 1 > 65535):
        raise SimulateError(f"ports {port}..{port + len(specs) - 1} are not all valid TCP ports")
    asyncio.run(_serve(specs, config, host, port))
