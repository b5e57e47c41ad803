"""`llmhealth route`'s client side: a bare asyncio HTTP/1.1 server, bounded everywhere.

Why not aiohttp's server, as the router used before: per request it ran a parser, built a
message, a payload stream, a request object, a response object and its writer, and took
about a quarter of the router's CPU (bench/README.md, the router's profile). Here a
connection is one ``asyncio.Protocol``: it cuts a request's head out of its buffer,
parses it with ``http1``'s rules (the ones ``upstream.py`` reads backends' answers with),
collects the body and runs the handler in one task. Its rules:

- a head, with any blank lines before it, is at most ``MAX_HEAD_BYTES`` and
  ``MAX_FIELDS`` fields (else 431; 414 when the request line alone leaves no room within
  the bound for the head's final CRLF); a request line that is not ``METHOD SP target
  SP HTTP/1.x`` (its target a path, a URL or ``*``), a malformed field, a bare CR or LF,
  a body framed both ways, or an HTTP/1.1 request without exactly one Host is 400; a
  Transfer-Encoding other than chunked is 501;
- a body is framed by Content-Length or chunked (HTTP/1.1 only) and at most ``max_body``
  bytes, a chunked body's framing too (each chunk costing at least ``http1.CHUNK_COST``): the
  handler hears ``BadRequestError`` (413, or 400 for a broken chunk), and the connection
  closes after the answer, since the rest of the body is unread;
- a connection with no request in progress (no whole head yet, or kept alive after its
  last answer) is idle: idle ones close after ``idle_timeout``, so a head sent a byte a
  minute is bounded too, and at the ``cap`` a new connection makes room by closing the
  one idle longest (when all are busy, the new one is closed at once);
- pipelined requests are answered one at a time, in order; while one is in progress at
  most ``MAX_HEAD_BYTES`` more are read, then the socket is not read until it ends (its
  TCP state is looked at instead, so that a client gone meanwhile still ends its request);
- a response takes its Content-Length when it has one, else it is chunked (HTTP/1.1) or
  ends with the connection (HTTP/1.0); an answer to a HEAD relayed without one gets
  none (its GET's is not known here); every write waits while the transport holds more
  than its high-water mark, so a client that never reads costs a bounded buffer (the
  handler bounds that wait in time);
- a client whose connection closes cancels its request's task;
- after an error answer the connection ends its side and reads what still comes for at
  most ``LINGER`` seconds, so the client reads the answer rather than a reset;
- a connection the router gives up on is let go at once, whatever its transport still
  holds: ``transport.close()`` waits for that to be sent, and a client that never reads
  would keep the socket, the buffer and its place under the cap for as long as its
  kernel keeps the connection; one whose answer was cut off is reset, so a client that
  reads to the connection's end (HTTP/1.0) sees an error, not a shorter whole answer.
"""

from __future__ import annotations

import asyncio
import json
import re
import socket
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from http import HTTPStatus
from typing import Final, cast
from urllib.parse import unquote, urlsplit

from llmhealth import http1
from llmhealth.http1 import MAX_HEAD_BYTES, Fields, FramingError
from llmhealth.openfiles import end_with_reset

LINGER: Final = 2.0  # seconds an error answer's connection reads on before it closes
SWEEP: Final = 1.0  # seconds between looks for connections idle past their timeout
# RFC 9112 3: method SP request-target SP HTTP-version; the target holds no space or CTL.
_REQUEST_LINE: Final = re.compile(rf"({http1.TOKEN}) ([^\x00-\x20\x7f]+) (HTTP/1\.[01])")
_REASONS: Final = {status.value: status.phrase for status in HTTPStatus}
# A line end that is not CRLF: an LF without its CR, a CR before anything but LF. A head
# holding one is a 400 whenever it ends, and a head of such lines never ends at all.
_BARE_LINE_END: Final = re.compile(rb"(?<!\r)\n|\r(?=[^\n])")
# Linux's TCP_INFO, whose first byte is the connection's state: CLOSE (reset) and
# CLOSE_WAIT (the client ended its side) say a client is gone without reading the socket.
_TCP_INFO: Final = getattr(socket, "TCP_INFO", None)
_PEER_GONE: Final = frozenset({7, 8})


class BadRequestError(Exception):
    """The client's request cannot be served as sent; the message says why (a 4xx)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


Handler = Callable[["Request"], Awaitable[None]]


class Request:
    """One request as the client sent it, and the way to answer it."""

    __slots__ = (
        "_chunked",
        "_conn",
        "_length",
        "_writes",
        "ended",
        "headers",
        "keep_alive",
        "method",
        "path",
        "started",
        "target",
        "version",
    )

    def __init__(
        self,
        conn: _Connection,
        method: str,
        target: str,
        version: str,
        headers: Fields,
        keep_alive: bool,
    ) -> None:
        self._conn = conn
        self.method = method
        self.target = target  # path and query as sent (percent-encoded), for the next hop
        self.path = _path(target)
        self.version = version
        self.headers = headers
        self.keep_alive = keep_alive
        self.started = False  # the answer's head is written
        self.ended = False  # the answer is written whole
        self._chunked = False  # the answer's body goes in chunks
        self._length = True  # the answer's body is delimited (not by the close)
        self._writes = True  # the answer may have a body

    def body(self) -> bytes | None:
        """The whole body when it is already in hand (most come with their head)."""
        return self._conn.body_in_hand()

    async def read_body(self) -> bytes:
        """The whole body, once it has come; the caller bounds the wait in time."""
        return await self._conn.read_body()

    async def answer(self, status: int, headers: Fields, body: bytes, reason: str = "") -> None:
        """A whole answer in one write: its head and body together. An answer to a HEAD
        given no body (a backend's, relayed) is given no length either: its GET's is not
        known here, and "0" would misstate it (RFC 9110 8.6)."""
        if (
            "content-length" not in headers
            and not _bodiless_status(status)
            and (body or self.method != "HEAD")
        ):
            headers.add("Content-Length", str(len(body)))
        head = self._head(status, reason, headers)
        self.started = True
        self._conn.write(head + body if body and not self._bodiless(status) else head)
        await self._conn.drain()
        self.ended = True

    async def start(self, status: int, headers: Fields, reason: str = "") -> None:
        """The head of an answer whose body follows in ``write``s; an answer that can
        have none (to a HEAD, a 204, a 304) is the head alone, whatever is written after:
        a chunked 204's "0" would be read by the client as the start of its next answer."""
        if self._bodiless(status):
            self._writes = False
        elif "content-length" not in headers:
            if self.version == "HTTP/1.1":
                headers.add("Transfer-Encoding", "chunked")
                self._chunked = True
            else:
                self.keep_alive = False  # the body ends with the connection
                self._length = False
        head = self._head(status, reason, headers)
        self.started = True
        self._conn.write(head)
        await self._conn.drain()

    async def write(self, data: bytes) -> None:
        if not self._writes:
            return
        if self._chunked:
            data = b"%x\r\n%s\r\n" % (len(data), data)
        self._conn.write(data)
        await self._conn.drain()

    async def end(self) -> None:
        if self._chunked:
            self._conn.write(b"0\r\n\r\n")
        await self._conn.drain()
        self.ended = True

    def _bodiless(self, status: int) -> bool:
        return self.method == "HEAD" or _bodiless_status(status)

    @property
    def delimited(self) -> bool:
        """The answer's body has a known end (else it ends with the connection)."""
        return self._length

    def force_close(self) -> None:
        """Close the connection once this answer ends."""
        self.keep_alive = False

    def abort(self) -> None:
        """End the connection now with a reset: the answer, if begun, is cut off."""
        self._conn.abort()

    def _head(self, status: int, reason: str, headers: Fields) -> bytes:
        if self._conn.body_unread:
            self.keep_alive = False  # its rest would be read as the next request
        if not self.keep_alive:
            headers["Connection"] = "close"
        elif self.version == "HTTP/1.0":
            headers["Connection"] = "keep-alive"
        lines = [f"HTTP/1.1 {status} {reason or _REASONS.get(status, '')}"]
        lines += [f"{name}: {value}" for name, value in headers.items()]
        lines.append("\r\n")
        # latin-1: a backend's fields were read so, and go back out byte for byte.
        return "\r\n".join(lines).encode("latin-1", "replace")


def _bodiless_status(status: int) -> bool:
    """An answer with this status has no body, whatever its headers say (RFC 9110 6.4.1)."""
    return status < 200 or status in (204, 304)


def _fresh_from(size: int, fresh: int | None) -> int:
    """Where a search of a buffer of ``size`` bytes, the last ``fresh`` of them new, starts:
    at the byte before the new ones, which a CR among them may follow."""
    return 0 if fresh is None else max(0, size - fresh - 1)


def _path(target: str) -> str:
    path = target.partition("?")[0]
    return unquote(path) if "%" in path else path


class _Connection(asyncio.Protocol):
    """One client connection: its unread bytes, the request in progress and its body."""

    def __init__(self, edge: Edge) -> None:
        self._edge = edge
        self.transport: asyncio.Transport | None = None
        self._buffer = bytearray()
        self._request: Request | None = None  # the one in progress
        self._task: asyncio.Task[None] | None = None
        self._lost = False
        self._lingering = False
        self._reading_paused = False
        self._write_paused = False
        self._drain_waiter: asyncio.Future[None] | None = None
        # The body of the request in progress.
        self._body = bytearray()
        self._whole: bytes | None = None  # the body once whole, as the handler takes it
        self._body_left = 0  # Content-Length bytes still to come, or the chunk's
        self._chunk_state = 0  # 0: not chunked; 1: a size line next; 2: data; 3: trailers
        self._body_done = True
        self._body_error: BadRequestError | None = None
        self._body_waiter: asyncio.Future[None] | None = None
        self._framing = 0  # a chunked body's framing bytes so far, charged (CHUNK_COST)
        self._trailers = 0  # the trailer fields of the chunked body in progress
        self._blank = 0  # bytes of blank lines skipped before the next request line
        # When a connection closing in order (what is buffered sent first) ends anyway:
        # cancelled once it has, so that a closed connection leaves no timer behind.
        self._deadline: asyncio.TimerHandle | None = None

    # --- the transport's calls ------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # Not an isinstance check: uvloop's transports do not subclass asyncio.Transport.
        self.transport = cast("asyncio.Transport", transport)
        self._edge.opened(self)

    def connection_lost(self, exc: BaseException | None) -> None:
        self._lost = True
        if self._deadline is not None:
            self._deadline.cancel()
        self._edge.closed(self)
        if self._task is not None and not self._task.done():
            self._task.cancel()  # the client went away: so does its upstream request
        for waiter in (self._drain_waiter, self._body_waiter):
            if waiter is not None and not waiter.done():
                waiter.set_exception(ConnectionResetError("the client closed the connection"))

    def data_received(self, data: bytes) -> None:
        if self._lingering:
            return  # read and dropped: the answer is already on its way
        self._buffer += data
        if self._request is None:
            self._next(len(data))
            return
        if not self._body_done:
            self._feed_body()
        if self._body_done and len(self._buffer) > MAX_HEAD_BYTES:
            self._pause_reading()  # pipelined requests beyond a head's worth wait

    def eof_received(self) -> bool:
        return False  # the client is done sending: close, which cancels what is in progress

    def pause_writing(self) -> None:
        self._write_paused = True

    def resume_writing(self) -> None:
        self._write_paused = False
        waiter = self._drain_waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    # --- requests ---------------------------------------------------------------------

    def _next(self, fresh: int | None = None) -> None:
        """Start the next request if its head is whole; refuse one beyond the bounds.
        ``fresh``: how many of the buffer's last bytes came since it was last looked at
        (None: all of them)."""
        buffer = self._buffer
        while buffer.startswith(b"\r\n"):
            # RFC 9112 2.2: blank lines before a request line are skipped, counted in the
            # head's bound: unbounded, a client sending nothing else kept the router's
            # loop busy reading them (300 MiB, 10 s of its CPU in 10 s) until idle_timeout.
            del buffer[:2]
            self._blank += 2
            if self._blank > MAX_HEAD_BYTES:
                self._refuse(431, f"request head over {MAX_HEAD_BYTES} bytes")
                return
        end = buffer.find(b"\r\n\r\n")
        if end < 0:
            if self._blank + len(buffer) > MAX_HEAD_BYTES:
                self._refuse_oversize()
            elif _BARE_LINE_END.search(buffer, _fresh_from(len(buffer), fresh)) is not None:
                # Refused now, as it would be once whole: a client ending its lines with a
                # bare LF ("GET / HTTP/1.1\n\n") sends no CRLFCRLF, and heard nothing
                # until idle_timeout closed its connection. Only the bytes new since the
                # last look (and the one before them) are searched: a head sent a byte at
                # a time is not searched whole for each byte.
                self._refuse(400, "a bare CR or LF in the request head")
            return
        if self._blank + end + 4 > MAX_HEAD_BYTES:
            self._refuse_oversize()
            return
        head = bytes(buffer[:end])
        del buffer[: end + 4]
        self._blank = 0
        try:
            request, framing = self._parse(head)
        except FramingError as exc:
            self._refuse(exc.status, str(exc))
            return
        self._request = request
        self._edge.busy(self)
        self._start_body(request, framing)
        self._task = asyncio.get_running_loop().create_task(self._run(request))

    def _refuse_oversize(self) -> None:
        """A head past ``MAX_HEAD_BYTES``: 414 when its request line alone leaves no room
        within it for the head's final CRLF (RFC 9112 3: a target longer than the server
        parses), else 431. A long URL was answered 431, which names the header fields, the
        one part not too large; so was one ending within two bytes of the bound, with no
        field at all."""
        line_end = self._buffer.find(b"\r\n", 0, MAX_HEAD_BYTES + 2)
        if line_end < 0 or self._blank + line_end + 4 > MAX_HEAD_BYTES:
            self._refuse(414, f"request line too long for a {MAX_HEAD_BYTES}-byte head")
        else:
            self._refuse(431, f"request head over {MAX_HEAD_BYTES} bytes")

    def _parse(self, head: bytes) -> tuple[Request, int | None]:
        """The request, and its body's length (None: chunked)."""
        # utf-8 with surrogateescape: any byte a client sent goes on to the backend as it came.
        lines = http1.head_lines(head.decode("utf-8", "surrogateescape"))
        match = _REQUEST_LINE.fullmatch(lines[0])
        if match is None:
            raise FramingError(f"not an HTTP/1.x request line: {lines[0][:80]!r}")
        method, target, version = match.groups()
        if not target.startswith("/") and "://" in target:  # absolute-form (RFC 9112 3.2.2)
            try:
                parts = urlsplit(target)
            except ValueError as exc:  # "http://[::1/x": an IPv6 host never closed
                raise FramingError(f"a request target that is no URL: {exc}") from None
            target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        # Looked at after a URL is taken apart too: "://" in a query or fragment passed
        # "%2Fv1%2Fchat%2Fcompletions?next=http://x" for one, with no authority and a path
        # not beginning with "/", and it went on as it came.
        if not target.startswith("/") and target != "*":  # "*": OPTIONS' asterisk-form
            # RFC 9112 3.2: neither a path nor a URL. "%2Fv1%2Fchat%2Fcompletions" decodes
            # to a route, and went on to the backend as a request line with no path.
            raise FramingError(
                f"a request target that is neither a path nor a URL: {target[:80]!r}"
            )
        headers = Fields(http1.fields(lines[1:]))
        coding, length_text = http1.body_fields(headers.items())
        length: int | None = 0
        if coding is not None:
            if length_text is not None:
                raise FramingError("a body framed by Transfer-Encoding and Content-Length")
            if version == "HTTP/1.0":
                raise FramingError("Transfer-Encoding in an HTTP/1.0 request")
            http1.require_chunked(coding)
            length = None
        elif length_text is not None:
            length = http1.content_length(length_text)
        if (
            version == "HTTP/1.1"
            and sum(name.lower() == "host" for name, _ in headers.items()) != 1
        ):
            # RFC 9112 3.2: a server MUST answer 400 to an HTTP/1.1 request without a Host
            # or with more than one; such requests were served.
            raise FramingError("an HTTP/1.1 request needs exactly one Host field")
        alive = http1.keep_alive(version, http1.connection_tokens(headers.items()))
        return Request(self, method, target, version, headers, alive), length

    async def _run(self, request: Request) -> None:
        try:
            await self._edge.handler(request)
        except asyncio.CancelledError:
            return  # the client went away, or the router is closing
        except Exception as exc:  # a bug: the client hears a 500, the loop's handler why
            asyncio.get_running_loop().call_exception_handler(
                {"message": "the router's handler failed", "exception": exc}
            )
            if request.started:
                self.abort()
            else:
                self._send(_error_answer(500, "the router failed: see its log"))
                self._linger()
            return
        self._ended(request)

    def _ended(self, request: Request) -> None:
        """The answer is written: next request, or the connection's end."""
        self._request = self._task = None
        self._body = bytearray()  # an idle connection holds no request body
        self._whole = None
        if self._lost:
            return
        if not request.ended:
            self.abort()  # cut off: reset, so it cannot pass for a whole answer
            return
        if self.body_unread:
            self._linger()  # the rest of the body was never read
            return
        if not request.keep_alive or not request.delimited:
            # An orderly end (it ends a body sent without a length), after what is
            # buffered is sent, if the client reads it within its idle time; else a
            # reset, so that a body cut short is not taken for a whole one.
            self._close_in_order(self._edge.idle_timeout)
            return
        self._edge.idle(self)
        if self._lost or self.transport is None or self.transport.is_closing():
            return  # let go at once: the edge is closing
        if self._reading_paused:
            self._reading_paused = False
            assert self.transport is not None
            self.transport.resume_reading()
        if self._buffer:
            self._next()  # a pipelined request

    # --- bodies -------------------------------------------------------------------------

    def _start_body(self, request: Request, length: int | None) -> None:
        self._body = bytearray()
        self._whole = None
        self._body_error = None
        self._framing = 0
        max_body = self._edge.max_body
        if length is None:
            self._chunk_state, self._body_done = 1, False
        elif length > max_body:
            self._body_done = False  # never read: the answer is a 413 and the close
            self._body_error = BadRequestError(413, f"request body over {max_body} bytes")
            self._buffer.clear()
            self._lingering = True  # what else comes is dropped
            return
        else:
            self._chunk_state, self._body_left, self._body_done = 0, length, length == 0
        if (
            not self._body_done
            and request.version == "HTTP/1.1"  # RFC 9110 10.1.1: ignored in HTTP/1.0
            and (request.headers.get("Expect") or "").lower() == "100-continue"
        ):
            self._send(b"HTTP/1.1 100 Continue\r\n\r\n")
        self._feed_body()

    @property
    def body_unread(self) -> bool:
        """The request's body was not (or cannot be) read to its end."""
        return not self._body_done or self._body_error is not None

    def body_in_hand(self) -> bytes | None:
        if self._body_error is not None:
            raise self._body_error
        if not self._body_done:
            return None
        if self._whole is None:
            # Made once, and what it was made of let go: kept beside it, the body was held
            # twice for as long as the request was in progress (a backend's generation).
            self._whole, self._body = bytes(self._body), bytearray()
        return self._whole

    async def read_body(self) -> bytes:
        while (body := self.body_in_hand()) is None:
            self._body_waiter = asyncio.get_running_loop().create_future()
            try:
                await self._body_waiter
            finally:
                self._body_waiter = None
        return body

    def _feed_body(self) -> None:
        """Move what the buffer holds of the body into it; wake its reader when whole."""
        try:
            if self._chunk_state == 0:
                size = min(self._body_left, len(self._buffer))
                self._body += self._buffer[:size]
                del self._buffer[:size]
                self._body_left -= size
                self._body_done = self._body_left == 0
            else:
                self._feed_chunks()
        except FramingError as exc:
            self._body_error = BadRequestError(400, f"request body: {exc}")
        except BadRequestError as exc:
            self._body_error = exc
        if self._body_error is not None:
            self._buffer.clear()
            self._lingering = True  # what else comes is dropped; the answer closes
        if self._body_done or self._body_error is not None:
            waiter = self._body_waiter
            if waiter is not None and not waiter.done():
                waiter.set_result(None)

    def _feed_chunks(self) -> None:
        buffer, max_body = self._buffer, self._edge.max_body
        while True:
            if self._chunk_state in (1, 3):
                end = buffer.find(b"\r\n")
                if end < 0:
                    if len(buffer) > MAX_HEAD_BYTES:
                        raise FramingError(f"a chunk-size line or trailer over {MAX_HEAD_BYTES}")
                    return
                line = bytes(buffer[:end])
                del buffer[: end + 2]
                if self._chunk_state == 3:
                    if line == b"":
                        self._body_done = True
                        return
                    self._body_left += len(line)  # trailers' bytes, dropped, bounded
                    if self._body_left > MAX_HEAD_BYTES:
                        raise FramingError(f"trailers over {MAX_HEAD_BYTES} bytes")
                    self._trailers += 1
                    if self._trailers > http1.MAX_FIELDS:
                        # As a head's fields: 20,000 one-byte lines fit in the bytes'
                        # bound, each taken alone while the router's loop waited.
                        raise FramingError(f"more than {http1.MAX_FIELDS} trailer fields")
                    continue
                size = http1.chunk_size(line)
                if len(self._body) + size > max_body:
                    raise BadRequestError(413, f"request body over {max_body} bytes")
                # The line, its CRLF, the data's CRLF, and what a tiny chunk falls short of:
                # uncharged, one-byte chunks held the loop 0.2 s per read, and extensions
                # of 64 KiB a chunk were read for as long as body_timeout allowed.
                self._framing += len(line) + 4 + max(0, http1.CHUNK_COST - size)
                if self._framing > max_body:
                    raise BadRequestError(
                        413, f"request body's chunk framing over {max_body} bytes (tiny chunks)"
                    )
                self._body_left, self._chunk_state = size, 2 if size else 3
                self._trailers = 0
                continue
            # data, then its CRLF
            if len(buffer) < self._body_left + 2:
                take = min(len(buffer), self._body_left)
                self._body += buffer[:take]
                del buffer[:take]
                self._body_left -= take
                return
            self._body += buffer[: self._body_left]
            if buffer[self._body_left : self._body_left + 2] != b"\r\n":
                raise FramingError("a chunk without its CRLF")
            del buffer[: self._body_left + 2]
            self._body_left, self._chunk_state = 0, 1

    # --- writes and the connection's end ---------------------------------------------

    def write(self, data: bytes) -> None:
        transport = self.transport
        if self._lost or transport is None or transport.is_closing():
            raise ConnectionResetError("the client's connection is closed")
        transport.write(data)

    def _send(self, data: bytes) -> None:
        """The edge's own few bytes, sent if the connection still takes any."""
        transport = self.transport
        if not self._lost and transport is not None and not transport.is_closing():
            transport.write(data)

    async def drain(self) -> None:
        """Wait while the transport holds more than its high-water mark."""
        if self._lost:
            raise ConnectionResetError("the client's connection is closed")
        if not self._write_paused:
            return
        self._drain_waiter = asyncio.get_running_loop().create_future()
        try:
            await self._drain_waiter
        finally:
            self._drain_waiter = None

    def abort(self) -> None:
        """End now with a reset, dropping what is unsent: an answer cut off, or a
        client that stopped reading."""
        if self.transport is not None:
            end_with_reset(self.transport)

    def let_go(self) -> None:
        """End an idle connection in order, which keep-alive clients expect of one: the
        end of its last answer may still be buffered (up to the high-water mark), so it
        is sent first, if its client takes it within ``LINGER``; then it goes anyway."""
        self._close_in_order(LINGER)

    def _close_in_order(self, within: float) -> None:
        """Close once what is buffered is sent; reset if that has not happened ``within``
        seconds (a client that does not read)."""
        transport = self.transport
        if transport is None or transport.is_closing():
            return
        transport.close()
        self._deadline = asyncio.get_running_loop().call_later(within, self.abort)

    def _pause_reading(self) -> None:
        if not self._reading_paused and self.transport is not None:
            self._reading_paused = True
            self.transport.pause_reading()
            self._edge.paused(self)

    @property
    def reading_paused(self) -> bool:
        return self._reading_paused and not self._lost

    def peer_gone(self) -> bool:
        """Whether the client reset or ended its side, told by the socket's TCP state: one
        not read does not hear its end, and a client that pipelined past a head's worth and
        left kept its request (a generation upstream) going until the backend answered."""
        transport = self.transport
        sock = transport.get_extra_info("socket") if transport is not None else None
        if sock is None or _TCP_INFO is None:
            return False
        try:
            info = sock.getsockopt(socket.IPPROTO_TCP, _TCP_INFO, 1)
        except (OSError, ValueError):
            return False
        return bool(info) and info[0] in _PEER_GONE

    def _refuse(self, status: int, message: str) -> None:
        """A head the router will not read: a 4xx, then the connection ends."""
        self._edge.busy(self)
        self._send(_error_answer(status, message))
        self._linger()

    def _linger(self) -> None:
        """End our side now, drop what the client still sends, and close within ``LINGER``."""
        transport = self.transport
        self._lingering = True
        self._buffer.clear()
        if transport is None or transport.is_closing():
            return
        if self._reading_paused:
            self._reading_paused = False
            transport.resume_reading()
        if transport.can_write_eof():
            transport.write_eof()
        self._deadline = asyncio.get_running_loop().call_later(LINGER, transport.abort)

    @property
    def task(self) -> asyncio.Task[None] | None:
        return self._task


def _error_answer(status: int, message: str) -> bytes:
    """The edge's own JSON error, as the router's answers look; the connection closes."""
    body = json.dumps({"error": message}).encode()
    head = (
        f"HTTP/1.1 {status} {_REASONS.get(status, '')}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    )
    return head.encode("ascii") + body


class Edge:
    """The listening socket and its client connections, at most ``cap`` of them."""

    def __init__(self, handler: Handler, *, cap: int, idle_timeout: float, max_body: int) -> None:
        self.handler = handler
        self.cap = cap
        self.idle_timeout = idle_timeout
        self.max_body = max_body
        self.evicted = 0  # connections closed at the cap to make room
        self._held: set[_Connection] = set()
        self._paused: set[_Connection] = set()  # not read, a request in progress: looked at
        # Idle connections, the one idle longest first, with the time each became idle.
        self._idle: OrderedDict[_Connection, float] = OrderedDict()
        self._server: asyncio.Server | None = None
        self._sweeper: asyncio.TimerHandle | None = None
        self._closing = False

    async def start(self, host: str, port: int, backlog: int) -> None:
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(
            lambda: _Connection(self), host, port, backlog=backlog
        )
        self._sweeper = loop.call_later(SWEEP, self._sweep)

    async def close(self, grace: float = 0.0) -> None:
        """Take no more connections, let the idle ones go, give requests in progress up
        to ``grace`` seconds to end (each connection let go once its answer is written),
        then cut off what is left: a stop or an upgrade no longer fails every request
        that was about to finish."""
        self._closing = True
        if self._sweeper is not None:
            self._sweeper.cancel()
        if self._server is not None:
            self._server.close()
        for conn in list(self._idle):
            conn.let_go()
        busy = [conn.task for conn in self._held if conn.task is not None]
        if busy and grace > 0:
            await asyncio.wait(busy, timeout=grace)
        tasks = [conn.task for conn in self._held if conn.task is not None]
        for conn in list(self._held):
            if conn.task is not None:
                conn.abort()  # an answer cut off
            else:
                conn.let_go()
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=5)

    @property
    def held(self) -> int:
        return len(self._held)

    @property
    def port(self) -> int:
        assert self._server is not None
        port: int = self._server.sockets[0].getsockname()[1]
        return port

    def opened(self, conn: _Connection) -> None:
        self._held.add(conn)
        self._idle[conn] = time.monotonic()
        if len(self._held) > self.cap:
            oldest, _ = self._idle.popitem(last=False)  # the new one, when all others are busy
            self._held.discard(oldest)
            self.evicted += 1
            oldest.let_go()

    def closed(self, conn: _Connection) -> None:
        self._held.discard(conn)
        self._idle.pop(conn, None)
        self._paused.discard(conn)

    def paused(self, conn: _Connection) -> None:
        """Its socket is not read while its request is in progress: looked at each sweep."""
        self._paused.add(conn)

    def busy(self, conn: _Connection) -> None:
        """A request of this connection is in progress: not to be closed for room."""
        self._idle.pop(conn, None)

    def idle(self, conn: _Connection) -> None:
        """Its answer is written whole: it may be closed for room, or when idle too long
        (at once while the edge closes)."""
        if self._closing:
            conn.let_go()
        elif conn in self._held:
            self._idle[conn] = time.monotonic()

    def _sweep(self) -> None:
        now = time.monotonic()
        cutoff = now - self.idle_timeout
        while self._idle:
            conn, since = next(iter(self._idle.items()))
            if since > cutoff:
                break
            del self._idle[conn]
            conn.let_go()
        for paused in list(self._paused):
            if not paused.reading_paused:
                self._paused.discard(paused)
            elif paused.peer_gone():
                self._paused.discard(paused)
                paused.abort()  # its end cancels the request, as a close read would
        self._sweeper = asyncio.get_running_loop().call_later(
            min(SWEEP, max(self.idle_timeout / 4, 0.05)), self._sweep
        )
