"""The router's upstream side: one HTTP/1.1 exchange with a backend, on a kept-alive link.

Why not aiohttp's client, as the router used before: per forwarded request it built a
request object, a URL, a payload, a writer task and a response object, and took about a
fifth of the router's CPU (bench/README.md, the router's profile). This sends the
request's head and body in one write on a pooled connection and reads the answer from
one buffer, handing the body on piece by piece as it arrives. Its rules:

- a response head is bounded (``MAX_HEAD_BYTES``, ``http1.MAX_INFORMATIONAL`` 1xx answers);
  anything that is not HTTP/1.x as RFC 9112 frames it (``http1``'s rules, which the
  router's client side applies too) is ``BrokenError``;
- bodies are framed by Transfer-Encoding: chunked, Content-Length, or the end of the
  connection (then never reused); a response with both is read as chunked and its
  connection closed afterwards, as after a chunked one in HTTP/1.0 (RFC 9112 6.1);
- the backend's socket stops being read while ``READ_HIGH`` bytes wait for a slow client;
- never connected (refused, unreachable, no connection in ``connect_timeout``) is
  ``ConnectError``, the one failure that proves the request never reached the backend;
- a kept-alive connection is reused only within ``keepalive`` seconds of its last
  answer, and only after an answer read to its end; when one turns out closed before a
  byte of the answer came, an idempotent request is sent once more on a new connection
  (the backend closed it while idle, which says nothing about the backend), and any
  other is ``BrokenError``: the router keeps ``keepalive`` below the backends' own.

Time bounds beyond the connect belong to the caller (the router's ``Deadlines`` around the calls),
which cancels; a cancelled or failed exchange closes its connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import ipaddress
import ssl
import struct
import sys
import termios
import time
from collections.abc import Collection, Iterable
from dataclasses import dataclass
from typing import Final, cast
from urllib.parse import urlsplit

from llmhealth import http1
from llmhealth.http1 import MAX_HEAD_BYTES
from llmhealth.lateness import lateness_of
from llmhealth.openfiles import (
    OwnShortageError,
    connect_one_of,
    default_tls,
    end_with_reset,
    look_up,
    out_of_files,
    short_of_descriptors,
    shortage_or,
    tls_leftover,
    trust_unread,
)
from llmhealth.text import dialable

READ_HIGH: Final = 256 * 1024  # buffered bytes past which the backend is not read
READ_SIZE: Final = 64 * 1024  # the most one read() hands on
CLOSE_WITHIN: Final = 2.0  # seconds a connection closing in order has before a reset
# Linux's SIOCOUTQ: a TCP socket's bytes the peer has not acknowledged (``_kernel_unsent``).
_OUTQ: Final = getattr(termios, "TIOCOUTQ", None)
# Linux's SIOCOUTQNSD (linux/sockios.h): those of them not yet sent at all.
_OUTQ_UNSENT: Final = 0x894B if sys.platform == "linux" else None
_NO_END: Final = "the connection ended without the backend's end of it (TLS: no close_notify)"


class ConnectError(Exception):
    """No connection to the backend: the request was never sent.

    ``late``: for a connection not made in time, how long a stall of the event loop that
    the deadline fell inside lasted (lateness.py), or how long after the deadline this
    task heard so, whichever is longer. A loop held up (by CPU work of its own, or a
    flood of it) may have had the connection in hand all along: one turn of it that
    lasted past the deadline ran the connect's completion and the time out together, the
    time out first, and hearing that only just after the deadline counted the loop's
    stall against the backend. Stalls that ended before the deadline took nothing from
    the backend's time: the kernel goes on connecting.
    ``ours``: the router's own process had no descriptor for it (a socket, the trust
    store): the backend was never asked.
    """

    def __init__(self, message: str, *, late: float = 0.0, ours: bool = False) -> None:
        super().__init__(message)
        self.late = late
        self.ours = ours


class BrokenError(Exception):
    """Connected, then the exchange broke or the answer was not HTTP."""


@dataclass(frozen=True, slots=True)
class Origin:
    """Where a backend's URL points: the connection to make and the path to prefix."""

    scheme: str
    host: str
    port: int
    prefix: str  # the URL's own path, before the client's (no trailing slash)
    host_header: bytes

    @classmethod
    def parse(cls, url: str) -> Origin:
        parts = urlsplit(url)
        host = parts.hostname or ""
        port = parts.port or (443 if parts.scheme == "https" else 80)
        # The name alone as IDNA writes it (``wire``): with its port, a long last label or
        # IPv6 zone was "label too long", and `route` died at start or on a reload.
        shown = f"[{host}]" if ":" in host else host.encode("idna").decode("ascii")
        if parts.port is not None:
            shown += f":{parts.port}"
        return cls(parts.scheme, host, port, parts.path.rstrip("/"), shown.encode("ascii"))


class _Link(asyncio.Protocol):
    """One connection to a backend: what it has sent so far, and a wake-up for the reader."""

    def __init__(self, origin: Origin) -> None:
        self.origin = origin  # where the pool files it when kept
        self.transport: asyncio.Transport | None = None
        self.buffer = bytearray()
        self.received = 0  # bytes, ever: did anything come after a request went out?
        self.unwaited = 0  # bytes taken since the last wait for more (``Response.read``)
        self.closed = False  # the backend ended its side, or the connection was lost
        # Why the connection was lost, when not by the backend's orderly end (a reset):
        # a body framed by the connection's end is whole only after an orderly one.
        self.lost: BaseException | None = None
        self.ended = False  # the backend's orderly end came (over TLS: its close_notify)
        # When the last bytes came: the backend's keep-alive runs from about then, not from
        # when a slow client had been handed the answer.
        self.last_arrival = 0.0
        self._waiter: asyncio.Future[None] | None = None
        self._deadline: asyncio.TimerHandle | None = None  # a close's reset, if it lingers
        self._gone = False  # connection_lost came: nothing left to end
        self._paused = False
        # Ever paused: what the kernel held meanwhile came in no one knows when, and a
        # paused connection does not hear the backend close it.
        self.was_paused = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # create_connection's stream transport; not an isinstance check, as uvloop's
        # transports do not subclass asyncio.Transport.
        self.transport = cast("asyncio.Transport", transport)

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        self.received += len(data)
        self.last_arrival = time.monotonic()
        if len(self.buffer) > READ_HIGH and not self._paused and self.transport is not None:
            self._paused = self.was_paused = True
            self.transport.pause_reading()
        self._wake()

    def eof_received(self) -> bool:
        self.closed = True
        # Over TLS the orderly end is close_notify: a TCP end without it cuts an answer
        # short (``tls_leftover``). asyncio calls this for either; uvloop only for
        # close_notify, and for the rest ``connection_lost`` alone.
        self._take_leftover()
        if not self.ended:
            self.lost = ConnectionResetError(_NO_END)
        self._wake()
        return False  # close the transport: nothing is ever sent after the backend's end

    def connection_lost(self, exc: BaseException | None) -> None:
        self.closed = self._gone = True
        if exc is None and not self.ended and self.lost is None:
            # uvloop's TLS layer, its reading paused for us, drops what it still holds at
            # the TCP end, close_notify with it, and says nothing but this: taken from it
            # here, a whole answer is not judged a ragged end (nor half of one whole).
            self._take_leftover()
        if exc is None and not self.ended:
            exc = self.lost or ConnectionResetError(_NO_END)
        self.lost = exc
        if self._deadline is not None:
            self._deadline.cancel()
        self._wake()

    def _take_leftover(self) -> None:
        held, self.ended = tls_leftover(self.transport)
        if held:
            self.buffer += held
            self.received += len(held)
            self.last_arrival = time.monotonic()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def more(self) -> bool:
        """Wait for bytes beyond those buffered; False when none can come any more."""
        if self.closed:
            return False
        if self._paused and self.transport is not None:
            self._paused = False
            self.transport.resume_reading()
        self._waiter = asyncio.get_running_loop().create_future()
        try:
            await self._waiter
        finally:
            self._waiter = None
        self.unwaited = 0
        return True

    def take(self, size: int) -> bytes:
        data = bytes(self.buffer[:size])
        del self.buffer[:size]
        self.unwaited += len(data)
        return data

    def close(self, answered: bool = False) -> None:
        """End the connection: in order once what was written is sent, but never later
        than ``CLOSE_WITHIN``, and at once while some of it is known to be unsent.
        ``transport.close()`` waits for that, and a frozen backend that reads nothing
        kept the socket and up to a whole request body for as long as it stayed so (a TLS
        link's own buffer is empty then: it passed everything on to its socket's).

        ``answered``: after a whole answer, bytes only on their way (sent, not yet
        acknowledged) are no sign of a frozen backend: a TLS link's own close_notify,
        sent back to a backend that ended the connection, is such; reset for that, the
        backend saw a healthy exchange end in an abort."""
        self.closed = True
        transport = self.transport
        if transport is None or self._gone:
            return
        # Closing already counts too: the backend's end of its side (an answer framed by
        # it, a refusal ahead of the body) closes the transport, which then waits as well.
        if transport.get_write_buffer_size() or _kernel_unsent(transport, answered):
            # Unsent in the kernel too: closed in order, the descriptor went at once and
            # with it the reset below, and the kernel held the connection and the bytes
            # while it probed a frozen backend's closed window (minutes).
            self.abort()
            return
        if transport.is_closing():
            return
        transport.close()
        with contextlib.suppress(RuntimeError):  # no loop running: nothing left to wait for
            loop = asyncio.get_running_loop()
            self._deadline = loop.call_later(CLOSE_WITHIN, self.abort)

    def abort(self) -> None:
        """End the connection now with a reset, whatever is unsent."""
        if self.transport is not None:
            end_with_reset(self.transport)


async def _dial(origin: Origin, tls: ssl.SSLContext | None) -> _Link:
    """A connection to ``origin``: a name's addresses each tried in turn, as the probe
    does (``connect_one_of``), so that this process's own shortage towards one of them
    is told from the backend's refusal."""
    loop = asyncio.get_running_loop()
    host = dialable(origin.host)
    hostname = origin.host if tls else None
    try:
        ipaddress.ip_address(host)
    except ValueError:
        pass
    else:  # an address is connected to at once, without a lookup
        try:
            _, link = await loop.create_connection(
                lambda: _Link(origin), host, origin.port, ssl=tls, server_hostname=hostname
            )
        except OSError as exc:
            raise shortage_or(exc, host, origin.port) from exc
        return link
    found = await look_up(loop, host, origin.port)
    sock = await connect_one_of(host, found)
    _, link = await loop.create_connection(
        lambda: _Link(origin), sock=sock, ssl=tls, server_hostname=hostname
    )
    return link


def _kernel_unsent(transport: asyncio.BaseTransport, sent_taken: bool = False) -> bool:
    """Whether the kernel still holds bytes written on the connection that its peer has
    not taken (not sent, or not acknowledged; ``sent_taken``: not sent); False where that
    cannot be told."""
    request = _OUTQ_UNSENT if sent_taken else _OUTQ
    sock = transport.get_extra_info("socket")
    if sock is None or request is None:
        return False
    try:
        queued = fcntl.ioctl(sock.fileno(), request, b"\0\0\0\0")
    except (OSError, ValueError):  # not a TCP socket's SIOCOUTQ, or already closed
        return False
    return bool(struct.unpack("i", queued)[0])


class Response:
    """A backend's answer: status, reason and headers read; the body handed on as it comes."""

    __slots__ = (
        "_chunk_left",
        "_done",
        "_framing",
        "_left",
        "_link",
        "_pool",
        "_reusable",
        "headers",
        "reason",
        "status",
    )

    def __init__(
        self,
        pool: Pool,
        link: _Link,
        status: int,
        reason: str,
        headers: list[tuple[str, str]],
        framing: str,
        length: int,
        reusable: bool,
    ) -> None:
        self._pool = pool
        self._link = link
        self.status = status
        self.reason = reason
        self.headers = headers  # as sent: names' case, order and repeats kept
        self._framing = framing  # "length", "chunked", "close" (to the end) or "none"
        self._left = length  # body bytes still to come ("length")
        self._chunk_left = 0  # bytes of the current chunk still to come ("chunked")
        self._reusable = reusable
        self._done = framing == "none" or (framing == "length" and length == 0)

    @property
    def complete(self) -> bool:
        """The body is read to its end: the backend has given its whole answer."""
        return self._done

    def whole(self) -> bytes | None:
        """The whole body when it is already in hand (a short answer, as most are)."""
        if self._done:
            return b""
        if self._framing == "length" and len(self._link.buffer) >= self._left:
            self._done = True
            return self._link.take(self._left)
        return None

    async def read(self) -> bytes:
        """The next piece of the body as the backend sent it; b"" once it is complete.

        A body that came faster than it is relayed is read from the buffer without a wait,
        and no write to a client that keeps up waits either: past ``READ_SIZE`` bytes so
        taken, the loop gets a turn first. Without it, a backend sending one-byte chunks
        held the router's loop for a second and more at a stretch, every other stream and
        deadline with it."""
        if self._done:
            return b""
        link = self._link
        if link.unwaited >= READ_SIZE:
            link.unwaited = 0
            await asyncio.sleep(0)
        if self._framing == "chunked":
            return await self._read_chunked()
        while not link.buffer:
            if not await link.more():
                if self._framing == "close" and link.lost is None:
                    self._done = True
                    return b""
                if self._framing == "close":
                    raise BrokenError(f"reset before the body's end: {link.lost}")
                raise BrokenError(f"closed with {self._left} bytes of the body still to come")
        size = min(len(link.buffer), READ_SIZE)
        if self._framing == "length":
            size = min(size, self._left)
            self._left -= size
            self._done = self._left == 0
        return link.take(size)

    async def _read_chunked(self) -> bytes:
        link = self._link
        if self._chunk_left == 0:
            line = await _line(link, "a chunk size")
            try:
                size = http1.chunk_size(line)
            except http1.FramingError as exc:
                raise BrokenError(str(exc)) from None
            if size == 0:
                trailers = fields = 0
                while (trailer := await _line(link, "the trailers")) != b"":
                    trailers += len(trailer)
                    fields += 1
                    if trailers > MAX_HEAD_BYTES:
                        raise BrokenError(f"trailers over {MAX_HEAD_BYTES} bytes")
                    if fields > http1.MAX_FIELDS:
                        # As a head's fields: 20,000 one-byte lines fit in the bytes'
                        # bound, each taken alone, the router's loop held for each answer.
                        raise BrokenError(f"more than {http1.MAX_FIELDS} trailer fields")
                self._done = True
                return b""
            self._chunk_left = size
        while not link.buffer:
            if not await link.more():
                raise BrokenError("closed in the middle of a chunk")
        size = min(len(link.buffer), self._chunk_left, READ_SIZE)
        data = link.take(size)
        self._chunk_left -= size
        if self._chunk_left == 0:
            while len(link.buffer) < 2:
                if not await link.more():
                    raise BrokenError("closed in the middle of a chunk")
            if link.take(2) != b"\r\n":
                raise BrokenError("a chunk without its CRLF")
            data = self._whole_chunks(data)
        return data

    def _whole_chunks(self, data: bytes) -> bytes:
        """``data`` and the whole chunks after it already in hand, up to ``READ_SIZE``
        bytes of them with their framing, as one piece: relayed one by one, each cost a
        write and a deadline of its own, for one byte each from a backend that sends
        them so. The last chunk, and anything not well framed, is left to the next read."""
        link = self._link
        buffer = link.buffer
        pieces = [data]
        at = 0
        while (end := buffer.find(b"\r\n", at, at + READ_SIZE)) >= 0:
            try:
                size = http1.chunk_size(bytes(buffer[at:end]))
            except http1.FramingError:
                break
            start = end + 2
            stop = start + size + 2
            if size == 0 or stop - at + link.unwaited > READ_SIZE or len(buffer) < stop:
                break
            if buffer[stop - 2 : stop] != b"\r\n":
                break
            pieces.append(bytes(buffer[start : stop - 2]))
            link.unwaited += stop - at
            at = stop
        if at == 0:
            return data
        del buffer[:at]
        return b"".join(pieces)

    def release(self) -> None:
        """Done with the answer: its connection is kept for the next request when the
        answer was read to its end and nothing else came; else it is closed.

        Not one whose reading was ever paused (an answer relayed slower than it came):
        kept paused, it never heard the backend close it, and the next generation sent
        on it failed as the backend's broken connection (a large answer to a slow client
        then counted against a healthy backend)."""
        link = self._link
        if (
            self._done
            and self._reusable
            and not link.closed
            and not link.buffer
            and not link.was_paused
        ):
            self._pool.keep(link)
        else:
            link.close(answered=self._done)

    def close(self) -> None:
        """The answer will not be relayed to its end (the client left, or it broke)."""
        self._link.close(answered=self._done)


def _fresh(link: _Link, fresh_since: float) -> bool:
    """Whether a kept connection may carry another request: open, nothing unasked for in
    it, and its last answer's end within the keep-alive."""
    return not link.closed and not link.buffer and link.last_arrival > fresh_since


class Pool:
    """Kept-alive connections to backends, the most recently used first."""

    def __init__(self, connect_timeout: float, keepalive: float) -> None:
        self._connect_timeout = connect_timeout
        self._keepalive = keepalive
        self._idle: dict[Origin, list[_Link]] = {}

    async def request(
        self,
        origin: Origin,
        method: str,
        target: str,
        headers: Iterable[tuple[str, str]],
        body: bytes,
    ) -> Response:
        """Send one request and read its response head; the body is the caller's to read.

        ``target`` is the path and query as the client sent them (already encoded).
        """
        head = _request_head(origin, method, target, headers, body)
        reuse = True
        while True:
            # Sent once more at most, and then on a new connection: another kept one closing
            # too was a retry of a failed retry (RFC 9112 9.3.1), a GET sent to a backend
            # that takes each request and closes unanswered once per kept connection.
            link = self._reused(origin) if reuse else None
            reused = link is not None
            if link is None:
                link = await self._connect(origin)
            assert link.transport is not None
            received = link.received
            # Joined for the write alone: a request kept whole while the backend generates
            # was one more copy of a prompt of up to max_body, for up to first_byte_timeout.
            link.transport.write(head + body)
            try:
                return await self._head(link, method)
            except BrokenError:
                link.close()
                # A generation (POST) the backend may have begun is never sent twice: its
                # reused connection closing before the answer is the backend's failure.
                if reused and link.received == received and method in http1.IDEMPOTENT:
                    reuse = False
                    continue  # closed while idle, before this request: a new connection
                raise
            except BaseException:
                link.close()  # cancelled (a timeout, the client left): state unknown
                raise

    def keep(self, link: _Link) -> None:
        self._idle.setdefault(link.origin, []).append(link)

    def close(self) -> None:
        for links in self._idle.values():
            for link in links:
                link.close()
        self._idle.clear()

    def sweep(self, origins: Collection[Origin]) -> None:
        """Close the kept connections past their keep-alive, and every one to an origin
        not in ``origins`` (a backend a reload dropped or moved).

        Otherwise a connection was only looked at when its backend was asked again: a
        burst of 200 requests left 200 sockets open after it, to a dropped backend for
        as long as the router ran, and a backend that never closes an idle connection
        (a frozen one) could use up the descriptors, refusing every backend.
        """
        fresh_since = time.monotonic() - self._keepalive
        for origin in list(self._idle):
            kept: list[_Link] = []
            for link in self._idle[origin]:
                if origin in origins and _fresh(link, fresh_since):
                    kept.append(link)
                else:
                    link.close()
            if kept:
                self._idle[origin] = kept
            else:
                del self._idle[origin]

    def _reused(self, origin: Origin) -> _Link | None:
        links = self._idle.get(origin)
        if not links:
            return None
        fresh_since = time.monotonic() - self._keepalive
        while links:
            link = links.pop()
            if _fresh(link, fresh_since):
                # Older ones than this are staler still: close them while here.
                while links and links[0].last_arrival <= fresh_since:
                    links.pop(0).close()
                return link
            link.close()
        return None

    async def _connect(self, origin: Origin) -> _Link:
        loop = asyncio.get_running_loop()
        try:
            tls = default_tls() if origin.scheme == "https" else None
        except OSError as exc:  # its CA file unread for want of descriptors
            raise ConnectError(str(exc), ours=out_of_files(exc)) from exc
        # Two spare: the socket's, and a CA directory's file (trust_unread).
        short = tls is not None and short_of_descriptors(2)
        deadline = loop.time() + self._connect_timeout
        try:
            async with asyncio.timeout_at(deadline):
                link = await _dial(origin, tls)
        except TimeoutError as exc:
            late = max(loop.time() - deadline, lateness_of(loop).across(deadline))
            raise ConnectError(f"no connection in {self._connect_timeout:g} s", late=late) from exc
        except OwnShortageError as exc:
            raise ConnectError(str(exc), ours=True) from exc
        except (OSError, ssl.SSLError) as exc:
            ours = out_of_files(exc) or trust_unread(exc, short)
            raise ConnectError(str(exc) or type(exc).__name__, ours=ours) from exc
        return link

    async def _head(self, link: _Link, method: str) -> Response:
        for _ in range(http1.MAX_INFORMATIONAL + 1):  # the answer itself after them
            while (end := link.buffer.find(b"\r\n\r\n")) < 0:
                if len(link.buffer) > MAX_HEAD_BYTES:
                    raise BrokenError(f"response head over {MAX_HEAD_BYTES} bytes")
                if not await link.more():
                    raise BrokenError("closed before the response head was complete")
            head = link.take(end + 4)
            if len(head) > MAX_HEAD_BYTES:
                raise BrokenError(f"response head over {MAX_HEAD_BYTES} bytes")
            try:
                lines = http1.head_lines(head[:-4].decode("latin-1"))
                version, status, reason = http1.status_line(lines[0])
                headers = http1.fields(lines[1:])
            except http1.FramingError as exc:
                raise BrokenError(str(exc)) from None
            if 100 <= status < 200:
                continue
            return self._framed(link, version, status, reason, headers, method)
        raise BrokenError(f"more than {http1.MAX_INFORMATIONAL} informational answers")

    def _framed(
        self,
        link: _Link,
        version: str,
        status: int,
        reason: str,
        headers: list[tuple[str, str]],
        method: str,
    ) -> Response:
        """How the body is delimited (RFC 9112 section 6.3), and whether the connection
        may carry another request afterwards."""
        coding, length_text = http1.body_fields(headers)
        reusable = http1.keep_alive(version, http1.connection_tokens(headers))
        if method == "HEAD" or status in (204, 304):
            return Response(self, link, status, reason, headers, "none", 0, reusable)
        try:
            if coding is not None:
                http1.require_chunked(coding)
                # Both framings: smuggling's shape; read as chunked, never reuse the connection.
                # Nor after chunks in HTTP/1.0, which has none: a hop that did not know them
                # may have kept part of the body back for the next answer (RFC 9112 6.1).
                reusable = reusable and length_text is None and version == "HTTP/1.1"
                return Response(self, link, status, reason, headers, "chunked", 0, reusable)
            if length_text is None:
                return Response(self, link, status, reason, headers, "close", 0, False)
            length = http1.content_length(length_text)
        except http1.FramingError as exc:
            raise BrokenError(str(exc)) from None
        return Response(self, link, status, reason, headers, "length", length, reusable)


def _request_head(
    origin: Origin, method: str, target: str, headers: Iterable[tuple[str, str]], body: bytes
) -> bytes:
    """The request's head as it goes on the wire, its body's length included."""
    host = origin.host_header.decode("ascii")  # IDNA: ASCII by construction
    lines = [f"{method} {origin.prefix}{target} HTTP/1.1", f"Host: {host}"]
    for name, value in headers:
        if "\r" in value or "\n" in value:
            continue  # cannot be sent as one header line; aiohttp's parser let none through
        lines.append(f"{name}: {value}")
    if body or method not in ("GET", "HEAD", "DELETE", "OPTIONS"):
        lines.append(f"Content-Length: {len(body)}")
    lines.append("\r\n")  # the blank line that ends the head
    # One encode for the whole head. utf-8 with surrogateescape: the bytes aiohttp's parser
    # decoded so, exactly as they came.
    return "\r\n".join(lines).encode("utf-8", "surrogateescape")


async def _line(link: _Link, what: str) -> bytes:
    """One CRLF-ended line of the body's framing, without its CRLF."""
    while (end := link.buffer.find(b"\r\n")) < 0:
        if len(link.buffer) > MAX_HEAD_BYTES:
            raise BrokenError(f"{what} over {MAX_HEAD_BYTES} bytes")
        if not await link.more():
            raise BrokenError(f"closed in {what}")
    line = link.take(end + 2)
    return line[:-2]
