"""The router's upstream link against raw sockets that say exactly what each test needs:
framing, reuse of kept-alive connections, and answers that are not HTTP."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import socket
import ssl
import struct
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path

import pytest
from test_router import read_request, run
from test_wire import FREED_AFTER_EACH_LOOKUP, OUT_OF_DESCRIPTORS
from tlsproc import make_certificate, run_child, tls_server, trusting

from llmhealth import upstream
from llmhealth.lateness import lateness_of
from llmhealth.upstream import MAX_HEAD_BYTES, BrokenError, ConnectError, Origin, Pool, Response

Reply = Callable[[int, bytes], Awaitable[bytes | None]]  # (connection, request) -> answer


@contextlib.asynccontextmanager
async def backend(
    reply: Reply, *, then_close: bool = False
) -> AsyncIterator[tuple[str, list[int]]]:
    """A backend answering each request on each connection with ``reply``'s bytes (None:
    close without answering; ``then_close``: close after the first answer, which ends an
    answer read to its close); the list counts requests per connection."""
    seen: list[int] = []

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        index = len(seen)
        seen.append(0)
        try:
            while True:
                request = await read_request(reader)
                seen[index] += 1
                answer = await reply(index, request)
                if answer is None:
                    break
                writer.write(answer)
                await writer.drain()
                if then_close:
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}", seen
    finally:
        server.close()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(server.wait_closed(), 2)


def replying(raw: bytes) -> Reply:
    """A reply of the same bytes to every request."""

    async def reply(_: int, __: bytes) -> bytes:
        return raw

    return reply


async def exchange(pool: Pool, url: str, method: str = "POST") -> tuple[Response, bytes]:
    """One request through ``pool``, its body read to the end and the link released."""
    response = await pool.request(Origin.parse(url), method, "/v1/completions", [], b"{}")
    body = b""
    while piece := await response.read():
        body += piece
    response.release()
    return response, body


def answer(body: bytes, *headers: bytes) -> bytes:
    head = b"HTTP/1.1 200 OK\r\n" + b"".join(h + b"\r\n" for h in headers)
    return head + b"Content-Length: %d\r\n\r\n" % len(body) + body


def test_sequential_requests_share_one_kept_alive_connection() -> None:
    async def reply(_: int, request: bytes) -> bytes:
        assert request.startswith(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:")
        assert request.endswith(b"Content-Length: 2\r\n\r\n{}")
        return answer(b"ok")

    async def scenario() -> None:
        async with backend(reply) as (url, seen):
            pool = Pool(connect_timeout=5, keepalive=60)
            for _ in range(3):
                response, body = await exchange(pool, url)
                assert (response.status, response.reason, body) == (200, "OK", b"ok")
            pool.close()
        assert seen == [3]

    run(scenario())


@pytest.mark.parametrize(
    "reply_bytes",
    [
        answer(b"ok", b"Connection: close"),
        b"HTTP/1.0 200 OK\r\nContent-Length: 2\r\n\r\nok",  # 1.0 without keep-alive
        # Both framings, the shape of request smuggling: read as chunked, never reused.
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nContent-Length: 99\r\n\r\n"
        b"2\r\nok\r\n0\r\n\r\n",
        # Chunked in HTTP/1.0, which has no chunks: faulty framing, its connection closed
        # after it however it asks to be kept (RFC 9112 6.1).
        b"HTTP/1.0 200 OK\r\nConnection: keep-alive\r\nTransfer-Encoding: chunked\r\n\r\n"
        b"2\r\nok\r\n0\r\n\r\n",
    ],
    ids=["connection-close", "http-1.0", "chunked-and-length", "chunked-in-http-1.0"],
)
def test_a_connection_the_answer_does_not_leave_reusable_is_closed(reply_bytes: bytes) -> None:
    async def reply(_: int, __: bytes) -> bytes:
        return reply_bytes

    async def scenario() -> None:
        async with backend(reply) as (url, seen):
            pool = Pool(connect_timeout=5, keepalive=60)
            for _ in range(2):
                _, body = await exchange(pool, url)
                assert body == b"ok"
            pool.close()
        assert seen == [1, 1]

    run(scenario())


def test_an_answer_read_to_its_close_ends_there() -> None:
    async def scenario() -> None:
        async with backend(
            replying(b"HTTP/1.1 200 OK\r\n\r\nall of it, until the end"), then_close=True
        ) as (url, _):
            pool = Pool(connect_timeout=5, keepalive=60)
            _, body = await exchange(pool, url)
            assert body == b"all of it, until the end"
            pool.close()

    run(scenario())


def test_an_answer_read_to_its_close_that_a_reset_cuts_is_broken_not_whole() -> None:
    # Framed by the connection's end, half a body then a TCP reset was passed on as the
    # whole answer, and counted as a success that cleared the backend's failure streak.
    async def scenario() -> None:
        async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await read_request(reader)
            writer.write(b'HTTP/1.1 200 OK\r\n\r\n{"choices": [{"text": "hal')
            await writer.drain()
            await asyncio.sleep(0.2)  # the half body read before the reset lands
            sock = writer.get_extra_info("socket")
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            writer.transport.abort()  # closed with linger 0: a reset, not an end

        server = await asyncio.start_server(serve, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        async with server:
            pool = Pool(connect_timeout=5, keepalive=60)
            with pytest.raises(BrokenError, match="reset before the body's end"):
                await exchange(pool, f"http://127.0.0.1:{port}")
            pool.close()

    run(scenario())


def test_a_connect_timeout_heard_after_the_loop_was_held_up_says_how_late() -> None:
    # The backend accepts at once; the loop is held up (CPU of its own) past the 0.2 s
    # deadline, so the connection made in time waits unseen and the bound fires first.
    async def scenario() -> None:
        async def hang_up(_: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            writer.close()

        server = await asyncio.start_server(hang_up, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        async with server:
            pool = Pool(connect_timeout=0.2, keepalive=60)
            attempt = asyncio.ensure_future(exchange(pool, f"http://127.0.0.1:{port}"))
            await asyncio.sleep(0)  # the connect is on its way
            time.sleep(1.0)  # the loop held up: nothing else runs meanwhile
            with pytest.raises(ConnectError, match=r"no connection in 0\.2 s") as raised:
                await attempt
            assert raised.value.late > 0.5
            pool.close()

    run(scenario())


def test_informational_answers_are_skipped_and_chunk_extensions_and_trailers_read() -> None:
    async def reply(_: int, __: bytes) -> bytes:
        return (
            b"HTTP/1.1 100 Continue\r\n\r\n"
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nX-Id: 1\r\nX-Id: 2\r\n\r\n"
            b"5;name=value\r\nhello\r\n1\r\n!\r\n0\r\nX-Trailer: t\r\n\r\n"
        )

    async def scenario() -> None:
        async with backend(reply) as (url, seen):
            pool = Pool(connect_timeout=5, keepalive=60)
            response, body = await exchange(pool, url)
            assert (response.status, body) == (200, b"hello!")
            assert [value for name, value in response.headers if name == "X-Id"] == ["1", "2"]
            await exchange(pool, url)
            pool.close()
        assert seen == [2]  # trailers read to the end: the connection was reusable

    run(scenario())


def test_eight_informational_answers_are_skipped_as_the_probe_skips_them() -> None:
    async def reply(_: int, __: bytes) -> bytes:
        return (
            b"HTTP/1.1 103 Early Hints\r\n\r\n" * 8
            + b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"
        )

    async def scenario() -> None:
        async with backend(reply) as (url, _):
            pool = Pool(connect_timeout=5, keepalive=60)
            response, body = await exchange(pool, url)
            assert (response.status, body) == (200, b"ok")
            pool.close()

    run(scenario())


@pytest.mark.parametrize(
    ("method", "status"), [("HEAD", 200), ("POST", 204), ("POST", 304)], ids=str
)
def test_answers_that_have_no_body_by_definition_are_complete_at_once(
    method: str, status: int
) -> None:
    async def reply(_: int, __: bytes) -> bytes:
        # A HEAD answer names the length it would have had; none of these bytes follow.
        return b"HTTP/1.1 %d X\r\nContent-Length: 50\r\n\r\n" % status

    async def scenario() -> None:
        async with backend(reply) as (url, seen):
            pool = Pool(connect_timeout=5, keepalive=60)
            for _ in range(2):
                response, body = await exchange(pool, url, method)
                assert (response.status, body, response.whole()) == (status, b"", b"")
            pool.close()
        assert seen == [2]

    run(scenario())


@pytest.mark.parametrize(
    ("reply_bytes", "why"),
    [
        (b"HTTP/1.1 200 OK\r\nX-Big: " + b"x" * MAX_HEAD_BYTES + b"\r\n\r\n", "head over"),
        (b"HTTP/2 200\r\n\r\n", "not an HTTP/1.x status line"),
        (b"HTTP/1.1 \xb200 OK\r\n\r\n", "not an HTTP/1.x status line"),
        (b"HTTP/1.1 200 OK\r\n bad: fold\r\n\r\n", "malformed header line"),
        (b"HTTP/1.1 200 OK\r\nContent-Length: 1, 2\r\n\r\n", "bad Content-Length"),
        (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip\r\n\r\n", "unsupported Transfer-Encoding"),
        (b"HTTP/1.1 100 Continue\r\n\r\n" * 9, "informational answers"),
        (b"HTTP/1.1 200 OK\r\nX-A: 1\nX-B: 2\r\n\r\n", "bare CR or LF"),
        (b"HTTP/1.1 200 OK\r\n" + b"X-Many: 1\r\n" * 101 + b"\r\n", "header fields"),
        (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip, chunked\r\n\r\n", "Transfer-Encoding"),
        (b"HTTP/1.1 099 Odd\r\nContent-Length: 2\r\n\r\nok", "not an HTTP/1.x status line"),
        # Bounded as the bytes arrive, not only once a whole head or line has come.
        (b"HTTP/1.1 200 OK\r\nX-Big: " + b"x" * (MAX_HEAD_BYTES + 10), "head over"),
        (
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n1;"
            + b"x" * (MAX_HEAD_BYTES + 10),
            "a chunk size over",
        ),
        (
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nok\r\n0\r\n"
            + (b"X-T: " + b"a" * 1000 + b"\r\n") * (MAX_HEAD_BYTES // 1007 + 2)
            + b"\r\n",
            "trailers over",
        ),
        (
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nok\r\n0\r\n"
            + b"X-T: 1\r\n" * 101
            + b"\r\n",
            "more than 100 trailer fields",
        ),
        (b"HTTP/1.1 200 O\x00K\r\nContent-Length: 2\r\n\r\nok", "a NUL"),
        (
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip\r\nTransfer-Encoding: chunked\r\n\r\n",
            "Transfer-Encoding",
        ),
    ],
    ids=[
        "huge-head",
        "http-2",
        "superscript-digit",
        "folded-header",
        "two-lengths",
        "gzip-only",
        "endless-1xx",
        "bare-lf",
        "too-many-fields",
        "gzip-then-chunked",  # its body read as plain chunks, the gzip dropped
        "status-below-100",  # no HTTP status: relayed as "HTTP/1.1 99", counted a success
        "endless-head",
        "endless-chunk-size-line",
        "trailers-past-the-bound",
        "too-many-trailer-fields",
        "nul-in-reason",  # relayed in the router's own status line
        "gzip-then-chunked-in-two-fields",
    ],
)
def test_an_answer_that_is_not_http_1_is_a_broken_exchange(reply_bytes: bytes, why: str) -> None:
    async def scenario() -> None:
        async with backend(replying(reply_bytes)) as (url, _):
            pool = Pool(connect_timeout=5, keepalive=60)
            with pytest.raises(BrokenError, match=why):
                await exchange(pool, url)
            pool.close()

    run(scenario())


@pytest.mark.parametrize(
    ("body", "why"),
    [
        (b"zz\r\n", "bad chunk size"),
        (b"2\r\nokXX", "without its CRLF"),
        (b"5\r\nhel", "middle of a chunk"),
        # Whole chunks in hand are taken together: one badly framed after them still is.
        (b"1\r\na\r\n1\r\nb\r\nzz\r\n", "bad chunk size"),
        (b"1\r\na\r\n1\r\nbXX1\r\nc\r\n", "without its CRLF"),
    ],
    ids=["bad-size", "no-crlf", "cut", "bad-size-after-whole", "no-crlf-after-whole"],
)
def test_a_broken_chunked_body_is_a_broken_exchange(body: bytes, why: str) -> None:
    async def scenario() -> None:
        async with backend(
            replying(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + body),
            then_close=True,
        ) as (url, _):
            pool = Pool(connect_timeout=5, keepalive=60)
            with pytest.raises(BrokenError, match=why):
                await exchange(pool, url)
            pool.close()

    run(scenario())


def test_an_answer_whose_connection_ends_before_its_length_is_a_broken_exchange() -> None:
    """Taken for whole, a body cut short was relayed as the backend's complete answer and
    counted a success."""

    async def scenario() -> None:
        async with backend(
            replying(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nhello"), then_close=True
        ) as (url, _):
            pool = Pool(connect_timeout=5, keepalive=60)
            with pytest.raises(BrokenError, match="5 bytes of the body still to come"):
                await exchange(pool, url)
            pool.close()

    run(scenario())


def test_one_byte_chunks_come_in_few_pieces_and_the_loop_turns_between_them() -> None:
    """A backend sending a flood of one-byte chunks: relayed one by one, each piece cost
    the router a client write and a deadline, and none waited, so the loop served nothing
    else for a second and more at a stretch."""
    count = 200_000

    async def scenario() -> None:
        async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await read_request(reader)
            writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
            writer.write(b"1\r\nx\r\n" * count + b"0\r\n\r\n")
            await writer.drain()
            await reader.read()
            writer.close()

        turns = 0

        async def ticker() -> None:
            nonlocal turns
            while True:
                turns += 1
                await asyncio.sleep(0)

        server = await asyncio.start_server(serve, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        async with server:
            pool = Pool(connect_timeout=5, keepalive=60)
            response = await pool.request(
                Origin.parse(f"http://127.0.0.1:{port}"), "POST", "/", [], b"{}"
            )
            counting = asyncio.create_task(ticker())
            pieces: list[tuple[int, int]] = []  # (the loop's turns so far, the piece's size)
            while piece := await response.read():
                pieces.append((turns, len(piece)))
            counting.cancel()
            response.release()
            pool.close()
        assert sum(size for _, size in pieces) == count
        assert len(pieces) < count // 100
        # Never more than a couple of pieces in one turn of the loop.
        per_turn = collections.Counter(turn for turn, _ in pieces)
        assert max(per_turn.values()) <= 2

    run(scenario())


@pytest.mark.parametrize(("method", "resent"), [("GET", True), ("POST", False)])
def test_a_reused_connection_closed_before_answering_resends_only_what_is_idempotent(
    method: str, resent: bool
) -> None:
    async def reply(connection: int, _: bytes) -> bytes | None:
        # The first connection answers once, then closes on the next request unanswered.
        if connection == 0 and first_answered.is_set():
            return None
        first_answered.set()
        return answer(b"ok")

    first_answered = asyncio.Event()

    async def scenario() -> None:
        async with backend(reply) as (url, seen):
            pool = Pool(connect_timeout=5, keepalive=60)
            await exchange(pool, url, method)
            if resent:
                _, body = await exchange(pool, url, method)
                assert body == b"ok"
                assert seen == [2, 1]  # the second request went again, on a new connection
            else:
                with pytest.raises(BrokenError, match="closed before the response head"):
                    await exchange(pool, url, method)
                assert seen == [2]  # never sent twice
            pool.close()

    run(scenario())


@pytest.mark.parametrize("case", ["new-connection", "part-of-a-head"])
def test_a_get_the_backend_may_have_begun_is_not_sent_again(case: str) -> None:
    """Sent once more only from a reused connection closed before a byte of the answer
    (closed while idle): a new connection closing unanswered, or one cut off inside its
    answer's head, is the backend's own broken exchange."""
    seen: list[int] = []

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        index = len(seen)
        seen.append(0)
        with contextlib.suppress(asyncio.IncompleteReadError, ConnectionError):
            while True:
                await read_request(reader)
                seen[index] += 1
                if case == "new-connection":
                    break  # closed unanswered
                if index == 0 and seen[0] == 2:
                    writer.write(b"HTTP/1.1 200 OK\r\nContent-")
                    break
                writer.write(answer(b"ok"))
                await writer.drain()
        await writer.drain()
        writer.close()

    async def scenario() -> None:
        server = await asyncio.start_server(serve, "127.0.0.1", 0)
        url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
        async with server:
            pool = Pool(connect_timeout=5, keepalive=60)
            if case == "part-of-a-head":
                await exchange(pool, url, "GET")  # the connection is kept, then reused
            with pytest.raises(BrokenError, match="closed before the response head"):
                await exchange(pool, url, "GET")
            pool.close()
        assert seen == ([1] if case == "new-connection" else [2])

    run(scenario())


def test_a_get_resent_after_a_reused_connection_closed_goes_once_and_on_a_new_connection() -> None:
    """Every kept connection of a backend that takes a request and closes unanswered: the
    GET went again on each of them in turn, a retry of a failed retry (RFC 9112 9.3.1),
    three times to a backend that may have begun each, before one new connection."""
    all_three = asyncio.Event()
    kept = 3

    async def reply(connection: int, _: bytes) -> bytes | None:
        if connection < kept:
            if all_three.is_set():
                return None  # the second request on a kept connection: taken, unanswered
            if connection == kept - 1:
                all_three.set()
            await all_three.wait()  # three requests in flight at once: three connections
        return answer(b"ok")

    async def scenario() -> None:
        async with backend(reply) as (url, seen):
            pool = Pool(connect_timeout=5, keepalive=60)
            await asyncio.gather(*(exchange(pool, url, "GET") for _ in range(kept)))
            _, body = await exchange(pool, url, "GET")
            assert body == b"ok"
            pool.close()
        # The first three answered at once; the GET then went to one kept connection and,
        # once more, to a new one: never to the other two kept ones.
        assert sorted(seen) == [1, 1, 1, 2]

    run(scenario())


def test_an_answer_released_before_its_body_came_does_not_leave_its_connection_kept() -> None:
    """Kept, the connection would carry the next request while the last body was still
    to come: that body would be read as the next answer's head."""

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(asyncio.IncompleteReadError, ConnectionError):
            await read_request(reader)
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n")
            await writer.drain()
            while True:
                await read_request(reader)  # the body only once another request came
                writer.write(b"ok" + answer(b"next"))
                await writer.drain()
        writer.close()

    async def scenario() -> None:
        server = await asyncio.start_server(serve, "127.0.0.1", 0)
        origin = Origin.parse(f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}")
        async with server:
            pool = Pool(connect_timeout=5, keepalive=60)
            response = await pool.request(origin, "GET", "/", [], b"")
            assert not response.complete
            response.release()
            response = await pool.request(origin, "GET", "/", [], b"")
            assert response.status == 200
            assert response.headers == [("Content-Length", "2")]  # a new connection's first
            response.close()
            pool.close()

    run(scenario())


def test_the_most_recently_kept_connection_is_reused_first() -> None:
    """The longest idle is the likeliest to be closed by its backend meanwhile."""
    both = asyncio.Event()

    async def reply(connection: int, _: bytes) -> bytes:
        if connection < 2 and not both.is_set():
            if connection == 1:
                both.set()
            await both.wait()  # two requests in flight at once: two connections
        return answer(b"%d" % connection)

    async def scenario() -> None:
        async with backend(reply) as (url, seen):
            pool = Pool(connect_timeout=5, keepalive=60)
            origin = Origin.parse(url)
            responses = await asyncio.gather(
                pool.request(origin, "GET", "/", [], b""), pool.request(origin, "GET", "/", [], b"")
            )
            bodies = [await response.read() for response in responses]
            for _, response in sorted(zip(bodies, responses, strict=True)):
                response.release()  # the first connection kept first, the second last
            _, body = await exchange(pool, url, "GET")
            assert body == b"1"
            pool.close()
        assert seen == [1, 2]

    run(scenario())


@pytest.mark.parametrize(("method", "length"), [("POST", b"Content-Length: 0\r\n"), ("GET", b"")])
def test_an_empty_body_is_sent_with_its_length_where_the_method_expects_one(
    method: str, length: bytes
) -> None:
    requests: list[bytes] = []

    async def reply(_: int, request: bytes) -> bytes:
        requests.append(request)
        return answer(b"ok")

    async def scenario() -> None:
        async with backend(reply) as (url, _):
            pool = Pool(connect_timeout=5, keepalive=60)
            response = await pool.request(Origin.parse(url), method, "/", [], b"")
            response.close()
            pool.close()
        assert requests[0].endswith(b"\r\n" + length + b"\r\n")
        assert (b"content-length" in requests[0].lower()) is bool(length)

    run(scenario())


def test_a_header_value_holding_a_line_break_is_not_sent() -> None:
    """It would end its line and start another field (or the body) on the backend."""
    requests: list[bytes] = []

    async def reply(_: int, request: bytes) -> bytes:
        requests.append(request)
        return answer(b"ok")

    async def scenario() -> None:
        async with backend(reply) as (url, _):
            pool = Pool(connect_timeout=5, keepalive=60)
            headers = [("X-A", "1\r\nX-Injected: 2"), ("X-B", "3\nX-Injected: 4"), ("X-C", "5")]
            response = await pool.request(Origin.parse(url), "GET", "/", headers, b"")
            response.close()
            pool.close()
        assert b"X-Injected" not in requests[0]
        assert b"\r\nX-C: 5\r\n" in requests[0]

    run(scenario())


def test_a_backend_is_not_read_past_read_high_while_its_answer_waits() -> None:
    """An answer that comes faster than it is relayed waits in the backend's socket, not
    in the router's memory."""
    big = b"x" * (16 * 1024 * 1024)  # far more than the kernel's buffers on the way hold
    writers: list[asyncio.StreamWriter] = []

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writers.append(writer)
        with contextlib.suppress(asyncio.IncompleteReadError, ConnectionError):
            await read_request(reader)
            writer.write(answer(big))
            await writer.drain()
        writer.close()

    async def scenario() -> None:
        server = await asyncio.start_server(serve, "127.0.0.1", 0)
        origin = Origin.parse(f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}")
        pool = Pool(connect_timeout=5, keepalive=60)
        try:
            response = await pool.request(origin, "GET", "/", [], b"")
            await asyncio.sleep(0.1)
            assert writers[0].transport.get_write_buffer_size() > 0  # still backed up
            body = bytearray()
            while piece := await response.read():
                body += piece
            assert body == big
            response.release()
        finally:
            pool.close()
            server.close()

    run(scenario())


def test_a_connection_idle_longer_than_keepalive_is_not_reused() -> None:
    async def reply(_: int, __: bytes) -> bytes:
        return answer(b"ok")

    async def scenario() -> None:
        async with backend(reply) as (url, seen):
            pool = Pool(connect_timeout=5, keepalive=0)  # every kept link is already stale
            for _ in range(2):
                await exchange(pool, url)
            pool.close()
        assert seen == [1, 1]

    run(scenario())


def test_a_connection_paused_while_its_answer_waited_is_not_kept() -> None:
    """An answer that came faster than it was relayed paused the connection's reading;
    kept so, it never heard the backend close it, and the next generation sent on it
    failed as the backend's broken connection (a slow client's large answer counted
    against a healthy backend)."""
    big = b"x" * 400_000  # two of the transport's reads, both in before any is relayed

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        connections.append(writer)
        with contextlib.suppress(asyncio.IncompleteReadError, ConnectionError):
            await read_request(reader)
            writer.write(answer(big))
            await writer.drain()
            if len(connections) == 1:
                writer.close()  # its keep-alive ran out while the answer was relayed
                return
            while True:
                await read_request(reader)
                writer.write(answer(b"ok"))
        writer.close()

    connections: list[asyncio.StreamWriter] = []

    async def scenario() -> None:
        server = await asyncio.start_server(serve, "127.0.0.1", 0)
        origin = Origin.parse(f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}")
        pool = Pool(connect_timeout=5, keepalive=60)
        try:
            response = await pool.request(origin, "POST", "/v1/completions", [], b"{}")
            await asyncio.sleep(0.3)  # a slow client: the whole answer arrives meanwhile
            body = b""
            while piece := await response.read():
                body += piece
            response.release()
            assert body == big
            response = await pool.request(origin, "POST", "/v1/completions", [], b"{}")
            assert response.status == 200
            response.close()
            assert len(connections) == 2
        finally:
            pool.close()
            server.close()

    run(scenario())


def test_a_connections_keep_alive_runs_from_its_answers_last_byte() -> None:
    """The backend's keep-alive starts when it has sent the answer; counted from when a
    slow client had been handed it, the router reused connections the backend was
    closing."""

    async def reply(_: int, __: bytes) -> bytes:
        return answer(b"ok")

    async def scenario() -> None:
        async with backend(reply) as (url, seen):
            pool = Pool(connect_timeout=5, keepalive=0.3)
            response = await pool.request(Origin.parse(url), "POST", "/", [], b"{}")
            await asyncio.sleep(0.5)  # the answer is in; the client is slow to take it
            while await response.read():
                pass
            response.release()
            await exchange(pool, url)
            pool.close()
        assert seen == [1, 1]

    run(scenario())


def test_a_sweep_closes_kept_connections_past_keep_alive_or_to_dropped_backends() -> None:
    """Looked at only when their backend was asked again, kept connections to a backend
    a reload dropped stayed open for as long as the router ran."""

    async def reply(_: int, __: bytes) -> bytes:
        return answer(b"ok")

    async def scenario() -> None:
        async with backend(reply) as (kept_url, _), backend(reply) as (dropped_url, _):
            kept, dropped = Origin.parse(kept_url), Origin.parse(dropped_url)
            pool = Pool(connect_timeout=5, keepalive=60)
            links = {}
            for url in (kept_url, dropped_url):
                response, _ = await exchange(pool, url)
                links[url] = response._link
            pool.sweep({kept})
            assert links[dropped_url].closed and not links[kept_url].closed
            pool = Pool(connect_timeout=5, keepalive=0.1)
            response, _ = await exchange(pool, kept_url)
            await asyncio.sleep(0.2)
            pool.sweep({kept, dropped})
            assert response._link.closed
            links[kept_url].close()

    run(scenario())


def test_no_connection_is_a_connect_error() -> None:
    async def scenario() -> None:
        pool = Pool(connect_timeout=5, keepalive=60)
        with socket.socket() as bound:  # bound, never listening: refused
            bound.bind(("127.0.0.1", 0))
            port = bound.getsockname()[1]
            with pytest.raises(ConnectError):
                await exchange(pool, f"http://127.0.0.1:{port}")

    run(scenario())


def test_an_ipv6_zone_as_a_url_writes_it_is_dialled_as_an_address(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # "fe80::1%25lo" went to the resolver as written and never resolved: every request to
    # a link-local backend failed as a name lookup. fe80::1 is on no interface here: the
    # connection fails at once, but as an address.
    monkeypatch.delenv("LLMHEALTH_LOOP", raising=False)

    async def scenario() -> None:
        pool = Pool(connect_timeout=5, keepalive=60)
        with pytest.raises(ConnectError) as raised:
            await exchange(pool, "http://[fe80::1%25lo]:9")
        assert not isinstance(raised.value.__cause__, socket.gaierror), raised.value.__cause__

    asyncio.run(scenario())


def test_the_origin_keeps_the_urls_path_and_brackets_an_ipv6_host() -> None:
    assert Origin.parse("http://10.0.0.5:8000/prefix/") == Origin(
        "http", "10.0.0.5", 8000, "/prefix", b"10.0.0.5:8000"
    )
    assert Origin.parse("https://[::1]/").host_header == b"[::1]"
    assert Origin.parse("https://[::1]/").port == 443


def _request_taken_over_tls(
    connection: socket.socket, server_side: ssl.SSLContext
) -> tuple[ssl.SSLObject, ssl.MemoryBIO]:
    """A backend's side of TLS done by hand on ``connection``, up to the request (a body
    of ``{}``) read: the TLS object and its outgoing bytes, so that a test ends the answer
    as it wants (with close_notify or without, its TCP end when it wants)."""
    connection.settimeout(20)
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    tls = server_side.wrap_bio(incoming, outgoing, server_side=True)

    def more() -> None:
        connection.sendall(outgoing.read())
        incoming.write(connection.recv(65536) or b"")

    while True:
        try:
            tls.do_handshake()
            break
        except ssl.SSLWantReadError:
            more()
    request = b""
    while not request.endswith(b"{}"):
        try:
            request += tls.read(65536)
        except ssl.SSLWantReadError:
            more()
    return tls, outgoing


@contextlib.contextmanager
def never_accepting() -> Iterator[int]:
    """A port on 127.0.0.1 whose accept queue is full: a connection to it is never made
    (Linux drops further SYNs), as to a backend that stopped accepting."""
    blackhole = socket.socket()
    fillers: list[socket.socket] = []
    try:
        blackhole.bind(("127.0.0.1", 0))
        blackhole.listen(0)
        port = blackhole.getsockname()[1]
        for _ in range(3):
            filler = socket.socket()
            fillers.append(filler)
            filler.setblocking(False)
            with contextlib.suppress(BlockingIOError):
                filler.connect(("127.0.0.1", port))
        yield port
    finally:
        for filler in fillers:
            filler.close()
        blackhole.close()


@pytest.mark.slow
def test_a_connect_deadline_inside_a_stall_of_the_loop_is_as_late_as_the_stall() -> None:
    # The stall began before the deadline and ended soon after: heard only a little late,
    # the connect's deadline was still judged with nothing taken in for the whole stall.
    async def scenario(port: int) -> None:
        loop = asyncio.get_running_loop()
        lateness_of(loop)  # as the router starts it
        await asyncio.sleep(0.2)
        loop.call_later(0.3, time.sleep, 1.2)  # held from 0.3 s to 1.5 s; deadline 0.7 s
        pool = Pool(connect_timeout=0.7, keepalive=60)
        with pytest.raises(ConnectError) as raised:
            await pool.request(Origin.parse(f"http://127.0.0.1:{port}"), "GET", "/", [], b"")
        assert raised.value.late > 1.0, raised.value.late  # not its 0.8 s after the deadline

    with never_accepting() as port:
        run(scenario(port))


@pytest.mark.usefixtures("each_loop")
@pytest.mark.parametrize("close_notify", [True, False], ids=["close_notify", "ragged"])
def test_a_tls_answer_read_to_its_close_is_whole_only_after_close_notify(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, close_notify: bool
) -> None:
    # Over TLS the orderly end of an answer framed by the connection's end is close_notify
    # (RFC 9112 9.8); a TCP end without it (a backend or its TLS terminator killed mid-body)
    # passed half a body on as the whole answer, a success that cleared the backend's
    # failure streak, and the client read it as complete.
    cert, key = make_certificate(tmp_path)
    server_side = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server_side.load_cert_chain(cert, key)
    monkeypatch.setattr(upstream, "default_tls", lambda: ssl.create_default_context(cafile=cert))
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(20)

    def answers() -> None:
        with contextlib.suppress(OSError), listener.accept()[0] as connection:
            tls, outgoing = _request_taken_over_tls(connection, server_side)
            tls.write(b'HTTP/1.1 200 OK\r\nConnection: close\r\n\r\n{"choices": [{"text": "hal')
            if close_notify:
                with contextlib.suppress(ssl.SSLWantReadError):
                    tls.unwrap()
            connection.sendall(outgoing.read())
            connection.shutdown(socket.SHUT_WR)  # the TCP end, with or without close_notify
            while connection.recv(65536):
                pass

    thread = threading.Thread(target=answers, daemon=True)
    thread.start()

    async def scenario() -> None:
        pool = Pool(connect_timeout=5, keepalive=60)
        url = f"https://127.0.0.1:{listener.getsockname()[1]}"
        try:
            if close_notify:
                _, body = await exchange(pool, url)
                assert body == b'{"choices": [{"text": "hal'
            else:
                with pytest.raises(BrokenError, match="close_notify"):
                    await exchange(pool, url)
        finally:
            pool.close()

    try:
        run(scenario())
        thread.join(20)
    finally:
        listener.close()


def test_a_tls_backend_that_does_not_speak_tls_is_a_connect_error() -> None:
    async def plain(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n")  # no TLS
        await writer.drain()
        with contextlib.suppress(ConnectionError):
            await reader.read()
        writer.close()

    async def scenario() -> None:
        server = await asyncio.start_server(plain, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        async with server:
            pool = Pool(connect_timeout=5, keepalive=60)
            with pytest.raises(ConnectError):  # never sent, so the router may go elsewhere
                await exchange(pool, f"https://127.0.0.1:{port}")

    run(scenario())


_CONNECT_TWICE = """
import asyncio
from llmhealth.upstream import ConnectError, Origin, Pool
loop = asyncio.new_event_loop()
pool = Pool(connect_timeout=5, keepalive=60)
leave(1)  # the connection's socket: none for a CA directory's file
async def connect():
    try:
        (await pool._connect(Origin.parse("URL"))).close()
        print("connected")
    except ConnectError as error:
        print("ours" if error.ours else "the backend's", error)
loop.run_until_complete(connect())
give_back()
loop.run_until_complete(connect())
"""


@pytest.mark.parametrize("trusted_in", ["a CA file", "a CA directory"])
def test_a_certificate_refused_for_want_of_the_routers_descriptors_is_its_own(
    tmp_path: Path, trusted_in: str
) -> None:
    # A CA directory is read at the handshake: with no descriptor for its file, the
    # chain had no issuer, and the router counted the backend as refusing.
    cert, key = make_certificate(tmp_path)
    with tls_server(cert, key) as port:
        first, second = run_child(
            _CONNECT_TWICE.replace("URL", f"https://127.0.0.1:{port}/"),
            trusting(cert, tmp_path, trusted_in),
        )
    assert first == "connected" or first.startswith("ours "), first
    assert second == "connected"


_CONNECT_BY_NAME = (
    "from llmhealth.upstream import ConnectError, Origin, Pool\n"
    + OUT_OF_DESCRIPTORS
    + FREED_AFTER_EACH_LOOKUP
    + """
async def connect():
    try:
        (await Pool(connect_timeout=5, keepalive=60)._connect(Origin.parse("URL"))).close()
        print("connected")
    except ConnectError as error:
        print("ours" if error.ours else "the backend's", error)
loop.run_until_complete(connect())
"""
)


def test_a_name_not_found_for_want_of_the_routers_descriptors_freed_since_is_looked_up_again() -> (
    None
):
    # At the limit, another connection closed between the failed lookup and the router's
    # asking whether it was short: the backend behind the name was counted as failing
    # ("Name or service not known"), as if its name did not resolve.
    with socket.create_server(("127.0.0.1", 0)) as listener:
        url = f"http://localhost:{listener.getsockname()[1]}/"
        done = subprocess.run(
            [sys.executable, "-c", _CONNECT_BY_NAME.replace("URL", url)],
            capture_output=True, text=True, timeout=60, check=True,
        )  # fmt: skip
    assert done.stdout == "connected\n", done.stdout


def test_a_name_that_does_not_resolve_is_the_backends_connect_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Looked up twice (the second for a descriptor maybe freed since), it fails both
    # times and counts against the backend: the router's own process was not short.
    asked: list[str] = []

    def getaddrinfo(host: str, *args: object, **kwargs: object) -> object:
        asked.append(host)
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)

    async def scenario() -> None:
        pool = Pool(connect_timeout=5, keepalive=60)
        with pytest.raises(ConnectError) as raised:
            await pool.request(Origin.parse("http://backend.test:8000"), "GET", "/", [], b"")
        assert not raised.value.ours, raised.value

    run(scenario())
    assert asked == ["backend.test", "backend.test"]


def test_stalls_of_the_loop_that_end_before_a_connects_deadline_excuse_nothing() -> None:
    # Only a stall the deadline falls inside can time out a connection made in time (the
    # kernel goes on connecting meanwhile): stalls before it, summed, let a backend that
    # never accepts pass for the router's own lateness, never charged nor dropped.
    async def scenario(port: int) -> None:
        loop = asyncio.get_running_loop()
        lateness_of(loop)  # as the router starts it
        await asyncio.sleep(0.2)
        loop.call_later(0.1, time.sleep, 0.7)  # the router's own work, over by 0.8 s
        pool = Pool(connect_timeout=1.0, keepalive=60)
        with pytest.raises(ConnectError) as raised:
            await pool.request(Origin.parse(f"http://127.0.0.1:{port}"), "GET", "/", [], b"")
        assert raised.value.late < 0.5, raised.value.late  # the router's LOOP_LATE

    with never_accepting() as port:
        run(scenario(port))


@pytest.mark.usefixtures("each_loop")
def test_a_tls_answer_read_to_its_close_notify_while_paused_is_whole(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A large answer framed by the connection's end, relayed slower than it came: its
    # reading paused while the rest, the backend's close_notify and its TCP end came.
    # uvloop's TLS layer then drops what it held undelivered and reports the end as a
    # plain connection_lost(None): half the answer was judged a ragged end (broken,
    # counted against a backend that ended in order).
    cert, key = make_certificate(tmp_path)
    server_side = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server_side.load_cert_chain(cert, key)
    monkeypatch.setattr(upstream, "default_tls", lambda: ssl.create_default_context(cafile=cert))
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(20)
    big = b"x" * 600_000
    sent = threading.Event()

    def answers() -> None:
        with contextlib.suppress(OSError), listener.accept()[0] as connection:
            tls, outgoing = _request_taken_over_tls(connection, server_side)
            tls.write(b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\n" + big)
            with contextlib.suppress(ssl.SSLWantReadError):
                tls.unwrap()
            connection.sendall(outgoing.read())
            connection.shutdown(socket.SHUT_WR)
            sent.set()
            while connection.recv(65536):
                pass

    thread = threading.Thread(target=answers, daemon=True)
    thread.start()

    async def scenario() -> None:
        pool = Pool(connect_timeout=5, keepalive=60)
        origin = Origin.parse(f"https://127.0.0.1:{listener.getsockname()[1]}")
        try:
            response = await pool.request(origin, "POST", "/v1/completions", [], b"{}")
            await asyncio.to_thread(sent.wait, 20)
            await asyncio.sleep(0.3)  # a slow client: the whole answer and its end come
            body = b""
            while piece := await response.read():
                body += piece
            response.release()
            assert body == big
        finally:
            pool.close()

    try:
        run(scenario())
        thread.join(20)
    finally:
        listener.close()
