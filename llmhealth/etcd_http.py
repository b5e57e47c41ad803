"""One request to etcd's v3 JSON gateway, bounded in bytes and in time: the cluster's wire.

I/O. The cluster's calls run in threads that a settle, an operator's verb and (through
the settle) the systemd watchdog wait on, so an endpoint that drips its answer, sends a
huge one or garbles it must end as an error on time, as a model server's would: every
socket operation waits at most ``silence``, the whole exchange at most ``whole``, and an
answer's body is read up to ``max_bytes``. One connection per request (a leader makes a
handful per settle; a connection kept between them would be one more thing to go stale);
no proxy from the environment; TLS verified against the system's store. The framing rules
are ``http1``'s. ``cluster.Etcd`` turns the two errors below into its own, once.
"""

from __future__ import annotations

import json
import socket
import ssl
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Final
from urllib.parse import urlsplit

from llmhealth import http1
from llmhealth.text import dialable

WHOLE_SECONDS: Final = 5.0  # one exchange, connect to last byte (etcdctl's command timeout)
# The largest answer read: a page of a member's published verdicts (8 MiB) or of audit
# batches (8 MiB by their record counts), base64 in JSON (about 11 MiB), with room for
# records past their share. Decoded, etcd's JSON takes about 1.5 times its bytes; a hostile answer
# of empty objects up to about 20 times, so this also bounds the memory of the decoding.
MAX_ANSWER_BYTES: Final = 32 * 1024 * 1024
_READ_SIZE: Final = 256 * 1024
# Not etcd's word on the request: the gateway could not reach its server, or gave up; a
# 502 comes from something in front of etcd (its gateway maps no error to it).
_ENDPOINT_AWAY: Final = frozenset({408, 502, 503, 504})


class EndpointError(Exception):
    """The endpoint gave no usable answer (refused, silent, slow, cut, too big, not etcd's
    JSON, an error page not etcd's): another endpoint may still answer the same request."""


class EtcdRefusedError(Exception):
    """etcd answered with an error of its own (``is_etcd_error``); the text is its status
    and body, unescaped."""


@dataclass(frozen=True)
class Endpoint:
    """Where one etcd member's gateway listens, from its configured URL (path ignored)."""

    host: str
    port: int
    tls: ssl.SSLContext | None = field(default=None, compare=False, repr=False)

    @classmethod
    def from_url(cls, url: str) -> Endpoint:
        parts = urlsplit(url)
        secure = parts.scheme == "https"
        return cls(
            parts.hostname or "127.0.0.1",
            parts.port or 2379,
            ssl.create_default_context() if secure else None,
        )

    @property
    def authority(self) -> str:
        """Host and port for the Host header: a name as IDNA writes it (a request head is
        ASCII; ``bücher.example`` passed the config and failed every request)."""
        if ":" in self.host:
            return f"[{self.host}]:{self.port}"
        return f"{self.host.encode('idna').decode('ascii')}:{self.port}"


@dataclass(frozen=True)
class Bounds:
    """How long one exchange may take and how much of an answer is read."""

    silence: float  # one connect, send or receive
    whole: float = WHOLE_SECONDS
    max_bytes: int = MAX_ANSWER_BYTES


def encode(body: Mapping[str, Any]) -> bytes:
    """A request's JSON, made once for every endpoint it is offered to (a body that cannot
    be encoded is a bug of ours, raised before any endpoint is blamed for it)."""
    return json.dumps(body, separators=(",", ":")).encode()


def post(
    endpoint: Endpoint,
    path: str,
    payload: bytes,
    bounds: Bounds,
    clock: Callable[[], float] = time.monotonic,
) -> dict[str, Any]:
    """etcd's JSON answer to ``payload`` at ``/v3/<path>``, or one of the two errors above."""
    request = (
        f"POST /v3/{path} HTTP/1.1\r\nHost: {endpoint.authority}\r\n"
        "Content-Type: application/json\r\nAccept: application/json\r\n"
        f"Content-Length: {len(payload)}\r\nConnection: close\r\n\r\n"
    ).encode("ascii")
    exchange = _Exchange(bounds, clock)
    try:
        status, reason, answer = exchange.run(endpoint, request + payload)
    except (OSError, http1.FramingError) as exc:  # timeouts and TLS errors are OSErrors
        raise EndpointError(f"{type(exc).__name__}: {exc}") from exc
    if status in _ENDPOINT_AWAY:
        raise EndpointError(f"HTTP {status}")
    text = answer.decode("utf-8", errors="replace")
    if status != 200:
        # Only etcd's own error is its word on the request. A 404 or 500 page from a
        # proxy routed to the wrong place says nothing of etcd: taken as etcd's word, one
        # such endpoint first in the list failed every call while the others were fine.
        if is_etcd_error(text):
            raise EtcdRefusedError(f"HTTP {status} {reason}: {text}")
        raise EndpointError(f"HTTP {status} {reason}, not an etcd error: {text}")
    try:
        decoded = json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise EndpointError(f"an answer that is not JSON ({type(exc).__name__})") from exc
    if not isinstance(decoded, dict):
        raise EndpointError(f"a JSON {type(decoded).__name__} where etcd answers an object")
    return decoded


def is_etcd_error(text: str) -> bool:
    """Whether a body is an error in the shape etcd's gateway gives one: a JSON object
    with gRPC's int ``code`` and its text in ``message`` (3.4 also says it in ``error``),
    as in ``{"error":"etcdserver: requested lease not found","message":...,"code":5}``."""
    try:
        decoded = json.loads(text)
    except (ValueError, RecursionError):
        return False
    if not isinstance(decoded, dict):
        return False
    code = decoded.get("code")
    said = (decoded.get("message"), decoded.get("error"))
    return type(code) is int and any(isinstance(part, str) for part in said)


class _Exchange:
    """One connection's request and answer, each wait cut to what the deadline leaves."""

    def __init__(self, bounds: Bounds, clock: Callable[[], float]) -> None:
        self._bounds = bounds
        self._clock = clock
        self._deadline = clock() + bounds.whole
        self._buffer = bytearray()
        self._sock: socket.socket | None = None

    def run(self, endpoint: Endpoint, request: bytes) -> tuple[int, str, bytes]:
        sock = self._connect(endpoint)
        try:
            if endpoint.tls is not None:
                sock = endpoint.tls.wrap_socket(sock, server_hostname=endpoint.host)
            self._sock = sock
            sock.settimeout(self._wait())
            sock.sendall(request)
            status, reason, headers = self._head()
            return status, reason, self._body(status, headers)
        finally:
            sock.close()

    def _connect(self, endpoint: Endpoint) -> socket.socket:
        """A connection to the first of the name's addresses that takes one, all of them
        within the whole bound (``create_connection`` gives each address a full timeout).
        The name's lookup is the resolver's own, bounded by its resolv.conf timeouts."""
        addresses = socket.getaddrinfo(
            dialable(endpoint.host), endpoint.port, type=socket.SOCK_STREAM
        )
        failure: OSError = OSError(f"no address for {endpoint.host}")
        for family, kind, protocol, _, address in addresses:
            sock = socket.socket(family, kind, protocol)
            try:
                sock.settimeout(self._wait())
                sock.connect(address)
            except OSError as exc:
                sock.close()
                if isinstance(exc, TimeoutError):
                    self._wait()  # the whole bound ran out: say so, try no more addresses
                failure = exc
                continue
            return sock
        raise failure

    def _wait(self) -> float:
        left = self._deadline - self._clock()
        if left <= 0:
            raise TimeoutError(f"no whole answer within {self._bounds.whole:g} s")
        return min(self._bounds.silence, left)

    def _more(self) -> bool:
        assert self._sock is not None
        self._sock.settimeout(self._wait())
        try:
            data = self._sock.recv(_READ_SIZE)
        except TimeoutError:
            self._wait()  # when the whole bound ran out, say so rather than "timed out"
            raise
        self._buffer += data
        return bool(data)

    def _take(self, size: int) -> bytes:
        taken = bytes(self._buffer[:size])
        del self._buffer[:size]
        return taken

    def _line(self, limit: int) -> bytes:
        while (end := self._buffer.find(b"\r\n")) < 0:
            if len(self._buffer) > limit:
                raise http1.FramingError(f"a line over {limit} bytes")
            if not self._more():
                raise http1.FramingError("closed inside a line")
        return self._take(end + 2)[:-2]

    def _head(self) -> tuple[int, str, list[tuple[str, str]]]:
        for _ in range(http1.MAX_INFORMATIONAL + 1):  # the answer itself after them
            while (end := self._buffer.find(b"\r\n\r\n")) < 0:
                if len(self._buffer) > http1.MAX_HEAD_BYTES:
                    raise http1.FramingError(f"an answer head over {http1.MAX_HEAD_BYTES} bytes")
                if not self._more():
                    raise http1.FramingError("closed before the answer head was complete")
            lines = http1.head_lines(self._take(end + 4)[:-4].decode("latin-1"))
            _, status, reason = http1.status_line(lines[0])
            if not 100 <= status < 200:
                return status, reason, http1.fields(lines[1:])
        raise http1.FramingError(f"more than {http1.MAX_INFORMATIONAL} informational answers")

    def _body(self, status: int, headers: list[tuple[str, str]]) -> bytes:
        if status in (204, 304):
            return b""
        coding, length_text = http1.body_fields(headers)
        if coding is not None:
            http1.require_chunked(coding)
            return self._chunked()
        if length_text is None:
            self._refuse_past(len(self._buffer))
            while self._more():  # we asked for the connection to close after it
                self._refuse_past(len(self._buffer))
            return self._take(len(self._buffer))
        length = http1.content_length(length_text)
        self._refuse_past(length)
        while len(self._buffer) < length:
            if not self._more():
                raise http1.FramingError("closed before the end of the answer")
        return self._take(length)

    def _chunked(self) -> bytes:
        """A chunked body, its framing counted against ``max_bytes`` with its data, each
        chunk as at least ``http1.CHUNK_COST``, as ``wire`` counts a backend's: counted by
        its data alone, an answer of one-byte chunks each under 64 KiB of extensions, or
        of a hundred trailer lines of 64 KiB, was read for gigabytes within its bound."""
        body = bytearray()
        charged = 0  # every byte on the wire, each chunk as at least CHUNK_COST
        while True:
            line = self._line(http1.MAX_HEAD_BYTES)
            size = http1.chunk_size(line)
            charged += len(line) + 2
            if not size:
                break
            charged += max(size, http1.CHUNK_COST) + 2
            self._refuse_past(charged)
            while len(self._buffer) < size + 2:
                if not self._more():
                    raise http1.FramingError("closed inside a chunk")
            body += self._take(size)
            if self._take(2) != b"\r\n":
                raise http1.FramingError("a chunk not followed by CRLF")
        trailers, fields = 0, 0
        while line := self._line(http1.MAX_HEAD_BYTES):  # trailers, read and dropped
            trailers += len(line) + 2
            fields += 1
            self._refuse_past(charged + trailers)
            if trailers > http1.MAX_HEAD_BYTES:
                raise http1.FramingError(f"trailers over {http1.MAX_HEAD_BYTES} bytes")
            if fields > http1.MAX_FIELDS:
                raise http1.FramingError(f"more than {http1.MAX_FIELDS} trailer fields")
        return bytes(body)

    def _refuse_past(self, size: int) -> None:
        if size > self._bounds.max_bytes:
            raise http1.FramingError(f"an answer over {self._bounds.max_bytes} bytes")
