"""The router's bare HTTP/1.1 server against hostile clients, over raw sockets.

Every test runs a real ``Edge`` on 127.0.0.1 with a handler that answers with what it
read, and speaks bytes to it: the outcomes asserted are the status a client reads, the
connection's end, and what the handler saw (never a time: bounds are asserted to end
within a generous ``BOUND``).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import tracemalloc
from collections.abc import AsyncIterator, Awaitable

import pytest

from llmhealth import eventloop
from llmhealth.edge import BadRequestError, Edge, Handler, Request
from llmhealth.http1 import (
    MAX_FIELDS,
    MAX_HEAD_BYTES,
    Fields,
    connection_tokens,
    keep_alive,
)

BOUND = 20.0  # seconds: a generous bound on anything that must happen, never a timing claim
MAX_BODY = 4096


def run(scenario: Awaitable[None]) -> None:
    eventloop.run(asyncio.wait_for(scenario, 60))


async def echo(request: Request) -> None:
    """Answers with the request as the handler saw it; a body it may not take, a 4xx."""
    try:
        body = request.body()
        if body is None:
            body = await asyncio.wait_for(request.read_body(), 1.0)
    except BadRequestError as exc:
        await request.answer(exc.status, Fields(), str(exc).encode())
        return
    except TimeoutError:
        await request.answer(408, Fields(), b"body too slow")
        return
    seen = {"method": request.method, "target": request.target, "path": request.path}
    seen["body"] = body.decode()
    await request.answer(
        200, Fields([("Content-Type", "application/json")]), json.dumps(seen).encode()
    )


@contextlib.asynccontextmanager
async def edge(
    idle_timeout: float = 60.0, cap: int = 100, handler: Handler = echo
) -> AsyncIterator[tuple[Edge, asyncio.StreamReader, asyncio.StreamWriter]]:
    """An edge with ``handler`` (the echo handler unless told), and one client
    connection to it."""
    server = Edge(handler, cap=cap, idle_timeout=idle_timeout, max_body=MAX_BODY)
    await server.start("127.0.0.1", 0, backlog=16)
    reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
    try:
        yield server, reader, writer
    finally:
        writer.close()
        await server.close()


async def read_to_close(reader: asyncio.StreamReader) -> bytes:
    """All a connection brings until the edge closes or resets it."""
    seen = b""
    with contextlib.suppress(ConnectionResetError):
        while piece := await asyncio.wait_for(reader.read(65536), BOUND):
            seen += piece
    return seen


async def answer(reader: asyncio.StreamReader) -> tuple[int, dict[str, str], bytes]:
    """One answer off the wire: status, fields (lower-case names), Content-Length body."""
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), BOUND)
    lines = head.decode("latin-1").split("\r\n")
    assert lines[0].startswith("HTTP/1.1 "), lines[0]
    fields = {}
    for line in lines[1:]:
        if line:
            name, _, value = line.partition(":")
            fields[name.lower()] = value.strip()
    body = await reader.readexactly(int(fields.get("content-length", "0")))
    return int(lines[0].split()[1]), fields, body


async def closed(reader: asyncio.StreamReader) -> bool:
    """True once the edge has ended the connection (whatever it still had to say read).

    An edge that closes while bytes the client sent are still unread in its socket makes
    the kernel answer with a reset instead of an end (a client trickling its head when the
    idle timeout comes): the same close, seen as ConnectionResetError here. A connection
    left open fails the test at BOUND.
    """
    with contextlib.suppress(ConnectionResetError):
        while await asyncio.wait_for(reader.read(65536), BOUND):
            pass
    return True


def post(body: bytes, *extra: bytes) -> bytes:
    fields = b"".join(field + b"\r\n" for field in extra)
    return b"POST /v1/x HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n%s\r\n%s" % (
        len(body),
        fields,
        body,
    )


@pytest.mark.parametrize(
    ("head", "status"),
    [
        (b"GARBAGE\r\n\r\n", 400),
        (b"GET /x HTTP/2.0\r\n\r\n", 400),
        (b"GET  /x HTTP/1.1\r\n\r\n", 400),
        (b"GET /x y HTTP/1.1\r\n\r\n", 400),
        (b"GET /x\x7fy HTTP/1.1\r\n\r\n", 400),
        (b"G\x01T /x HTTP/1.1\r\n\r\n", 400),
        (b"GET /x HTTP/1.1\r\n bad: fold\r\n\r\n", 400),
        (b"GET /x HTTP/1.1\r\nNo colon\r\n\r\n", 400),
        (b"GET /x HTTP/1.1\r\nX-A: one\ntwo\r\n\r\n", 400),
        (b"GET /x HTTP/1.1\r\nX-A: one\rtwo\r\n\r\n", 400),
        (b"GET /x HTTP/1.1\r\nX-A: \x00\r\n\r\n", 400),
        (b"GET http://[::1/x HTTP/1.1\r\n\r\n", 400),  # urlsplit's ValueError
        (b"GET /x HTTP/1.1\r\nX-Big: " + b"x" * MAX_HEAD_BYTES + b"\r\n\r\n", 431),
        (b"GET /x HTTP/1.1\r\n" + b"X-Many: 1\r\n" * (MAX_FIELDS + 1) + b"\r\n", 431),
        (b"POST /x HTTP/1.1\r\nContent-Length: abc\r\n\r\n", 400),
        (b"POST /x HTTP/1.1\r\nContent-Length: -1\r\n\r\n", 400),
        (b"POST /x HTTP/1.1\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\n", 400),
        (b"POST /x HTTP/1.1\r\nContent-Length: 1, 2\r\n\r\n", 400),
        (b"POST /x HTTP/1.1\r\nContent-Length: 1\r\nTransfer-Encoding: chunked\r\n\r\n", 400),
        (b"POST /x HTTP/1.0\r\nTransfer-Encoding: chunked\r\n\r\n", 400),
        (b"POST /x HTTP/1.1\r\nTransfer-Encoding: gzip\r\n\r\n", 501),
        # Passed on before: a name the backend may read otherwise, a coding dropped
        # (gzip bytes sent on as the body), control characters in a value.
        (b"POST /x HTTP/1.1\r\nTransfer Encoding: chunked\r\n\r\n", 400),
        (b"GET /x HTTP/1.1\r\nFoo(bar)@: 1\r\n\r\n", 400),
        (b"POST /x HTTP/1.1\r\nTransfer-Encoding: gzip, chunked\r\n\r\n", 501),
        (b"POST /x HTTP/1.1\r\nTransfer-Encoding: ,chunked\r\n\r\n", 501),
        (b"GET /x HTTP/1.1\r\nX-A: \x01\r\n\r\n", 400),
        (b"GET /x HTTP/1.1\r\nX-A: \x7f\r\n\r\n", 400),
        # A length of more than 18 digits is no length (a bound, not "too large": 400).
        (b"POST /x HTTP/1.1\r\nContent-Length: 1234567890123456789\r\n\r\n", 400),
        # Repeated fields are one list: the gzip is not dropped for the later "chunked".
        (b"POST /x HTTP/1.1\r\nTransfer-Encoding: gzip\r\nTransfer-Encoding: chunked\r\n\r\n", 501),
        # RFC 9112 3: a target longer than the server parses is 414; 431 (RFC 6585 5)
        # says the header fields are too large, which trimming them would not mend here.
        (b"GET /" + b"x" * MAX_HEAD_BYTES + b" HTTP/1.1\r\nHost: x\r\n\r\n", 414),
        (b"GET /" + b"x" * MAX_HEAD_BYTES, 414),  # a request line that never ends
        (b"GET /x HTTP/1.1\r\nHost: x\r\nX-Big: " + b"x" * MAX_HEAD_BYTES, 431),
    ],
    ids=[
        "garbage",
        "http-2",
        "two-spaces",
        "space-in-target",
        "delete-in-target",
        "control-in-method",
        "folded-field",
        "field-without-colon",
        "bare-lf-in-value",
        "bare-cr-in-value",
        "nul-in-value",
        "unclosed-ipv6-target",
        "oversize-head",
        "too-many-fields",
        "length-not-a-number",
        "negative-length",
        "two-lengths",
        "two-lengths-in-one",
        "length-and-chunked",
        "chunked-in-http-1.0",
        "gzip-only",
        "space-in-name",
        "brackets-in-name",
        "gzip-then-chunked",
        "empty-coding-then-chunked",
        "control-in-value",
        "delete-in-value",
        "length-of-19-digits",
        "gzip-then-chunked-in-two-fields",
        "long-target",
        "unending-target",
        "long-field-unending",
    ],
)
def test_a_head_beyond_the_rules_is_answered_its_4xx_or_501_and_the_connection_ends(
    head: bytes, status: int
) -> None:
    async def scenario() -> None:
        async with edge() as (_, reader, writer):
            writer.write(head)
            got, fields, body = await answer(reader)
            assert got == status, body
            assert fields["connection"] == "close"
            assert "error" in json.loads(body)
            assert await closed(reader)

    run(scenario())


def test_a_head_that_never_ends_is_refused_once_it_passes_the_bound() -> None:
    async def scenario() -> None:
        async with edge() as (_, reader, writer):
            writer.write(b"GET /x HTTP/1.1\r\nHost: x\r\nX-Big: ")
            for _ in range(MAX_HEAD_BYTES // 4096 + 2):  # no end of head, ever
                writer.write(b"x" * 4096)
                await writer.drain()
            assert (await answer(reader))[0] == 431

    run(scenario())


def test_pipelined_requests_are_answered_in_order_on_one_connection() -> None:
    async def scenario() -> None:
        async with edge() as (_, reader, writer):
            writer.write(post(b"one") + b"GET /two?q=1 HTTP/1.1\r\nHost: x\r\n\r\n" + post(b"3"))
            seen = [json.loads((await answer(reader))[2]) for _ in range(3)]
            assert [(s["method"], s["target"], s["body"]) for s in seen] == [
                ("POST", "/v1/x", "one"),
                ("GET", "/two?q=1", ""),
                ("POST", "/v1/x", "3"),
            ]

    run(scenario())


def test_bytes_past_a_head_are_not_read_while_a_request_is_in_progress() -> None:
    release = asyncio.Event()
    reads: list[str] = []

    async def slow(request: Request) -> None:
        reads.append(request.target)
        await release.wait()
        await request.answer(200, Fields(), b"ok")

    async def scenario() -> None:
        server = Edge(slow, cap=10, idle_timeout=60, max_body=MAX_BODY)
        await server.start("127.0.0.1", 0, backlog=16)
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        # Far more than the kernel's buffers on the way hold: if the edge kept reading,
        # the client's own buffer would empty.
        writer.write(b"GET /first HTTP/1.1\r\nHost: x\r\n\r\n" + b"x" * (32 * 1024 * 1024))
        async with asyncio.timeout(BOUND):
            while writer.transport.get_write_buffer_size() == 0:
                await asyncio.sleep(0.01)
        await asyncio.sleep(0.1)
        assert writer.transport.get_write_buffer_size() > 0  # still backed up
        assert reads == ["/first"]
        release.set()
        assert (await answer(reader))[0] == 200
        assert (await answer(reader))[0] == 414  # the x's: a request line that never ends
        writer.transport.abort()
        await server.close()

    run(scenario())


def test_a_client_gone_while_its_pipelined_bytes_are_not_read_ends_its_request() -> None:
    # Not read, the socket's end was not heard either: the request in progress (a
    # generation upstream) ran on for a client long gone, as long as the backend took.
    cancelled = asyncio.Event()

    async def waits(request: Request) -> None:
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            cancelled.set()
            raise

    async def scenario() -> None:
        server = Edge(waits, cap=10, idle_timeout=60, max_body=MAX_BODY)
        await server.start("127.0.0.1", 0, backlog=16)
        _, writer = await asyncio.open_connection("127.0.0.1", server.port)
        writer.write(b"GET /first HTTP/1.1\r\nHost: x\r\n\r\n" + post(b"x" * (2 * MAX_HEAD_BYTES)))
        await writer.drain()
        async with asyncio.timeout(BOUND):
            while server.held == 0:
                await asyncio.sleep(0.01)
        await asyncio.sleep(0.1)  # the edge reads its head's worth and pauses
        writer.close()
        await asyncio.wait_for(cancelled.wait(), BOUND)
        async with asyncio.timeout(BOUND):
            while server.held:
                await asyncio.sleep(0.01)
        await server.close()

    run(scenario())


def test_at_the_cap_the_longest_idle_connection_makes_room_and_a_busy_one_never() -> None:
    release = asyncio.Event()

    async def held(request: Request) -> None:
        await release.wait()
        await request.answer(200, Fields(), b"ok")

    async def scenario() -> None:
        server = Edge(held, cap=2, idle_timeout=60, max_body=MAX_BODY)
        await server.start("127.0.0.1", 0, backlog=16)
        port = server.port
        first = await asyncio.open_connection("127.0.0.1", port)
        second = await asyncio.open_connection("127.0.0.1", port)
        second[1].write(b"GET /busy HTTP/1.1\r\nHost: x\r\n\r\n")
        await second[1].drain()
        async with asyncio.timeout(BOUND):
            while server.held < 2:
                await asyncio.sleep(0.01)
        await asyncio.sleep(0.05)  # the busy one's head arrives
        third = await asyncio.open_connection("127.0.0.1", port)
        assert await closed(first[0])  # idle longest: closed for the third
        third[1].write(b"GET /busy HTTP/1.1\r\nHost: x\r\n\r\n")
        await third[1].drain()
        await asyncio.sleep(0.05)
        fourth = await asyncio.open_connection("127.0.0.1", port)
        assert await closed(fourth[0])  # everyone held is busy: the newcomer goes
        release.set()
        assert (await answer(second[0]))[0] == 200
        assert (await answer(third[0]))[0] == 200
        assert server.evicted == 2
        for _, writer in (first, second, third, fourth):
            writer.close()
        await server.close()

    run(scenario())


def test_a_connection_kept_alive_holds_no_body_of_a_request_answered() -> None:
    """An OpenAI client's pooled connection kept its last prompt (up to max_body) for as
    long as it stayed idle: ten idle clients after 21 MB prompts held 214 MB."""
    size, clients = 2 * 1024 * 1024, 8

    async def counts(request: Request) -> None:
        body = await request.read_body()
        await request.answer(200, Fields(), b"%d" % len(body))

    async def scenario() -> int:
        server = Edge(counts, cap=100, idle_timeout=60, max_body=size)
        await server.start("127.0.0.1", 0, backlog=16)
        tracemalloc.start()
        try:
            kept = []
            for _ in range(clients):
                reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
                writer.write(post(b"x" * size))
                assert await answer(reader) == (200, {"content-length": "7"}, b"%d" % size)
                kept.append(writer)  # open and idle
            held, _ = tracemalloc.get_traced_memory()
            for writer in kept:
                writer.close()
        finally:
            tracemalloc.stop()
            await server.close()
        return held

    held = eventloop.run(asyncio.wait_for(scenario(), 60))
    assert held < size * clients / 4, f"{held} bytes held by {clients} idle connections"


def test_a_connection_closed_after_its_answer_leaves_nothing_behind() -> None:
    """Each answer that ends its connection (HTTP/1.0, as nginx proxies by default) left
    a timer for the idle timeout: at 1,000 requests a second, 75,000 of them alive."""
    connections = 500

    async def short(request: Request) -> None:
        await request.answer(200, Fields(), b"ok")

    async def scenario() -> int:
        server = Edge(short, cap=100, idle_timeout=75, max_body=MAX_BODY)
        await server.start("127.0.0.1", 0, backlog=16)
        gc.collect()
        tracemalloc.start()
        try:
            before, _ = tracemalloc.get_traced_memory()
            for _ in range(connections):
                reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
                writer.write(b"GET / HTTP/1.0\r\n\r\n")
                assert (await asyncio.wait_for(reader.read(), BOUND)).endswith(b"ok")
                writer.close()
                await writer.wait_closed()
            async with asyncio.timeout(BOUND):
                while server.held:
                    await asyncio.sleep(0.01)
            gc.collect()  # what is garbage is not kept
            after, _ = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
            await server.close()
        return (after - before) // connections

    kept = eventloop.run(asyncio.wait_for(scenario(), 60))
    # About 1,500 bytes each with the timer; a few dozen without, and the rest noise.
    assert kept < 750, f"{kept} bytes kept per connection closed"


@pytest.mark.parametrize(
    ("head", "status"),
    [
        (b"GET /x HTTP/1.1\r\n\r\n", 400),
        (b"GET /x HTTP/1.1\r\nHost: a\r\nHost: b\r\n\r\n", 400),
        (b"GET http://a/x HTTP/1.1\r\n\r\n", 400),  # absolute-form needs one too
        (b"GET /x HTTP/1.1\r\nhost: a\r\n\r\n", 200),
        (b"GET /x HTTP/1.1\r\nHost:\r\n\r\n", 200),  # empty: no authority (RFC 9110 7.2)
        (b"GET /x HTTP/1.0\r\n\r\n", 200),  # HTTP/1.0 had no Host
    ],
    ids=["no-host", "two-hosts", "absolute-form-no-host", "host", "empty-host", "http-1.0"],
)
def test_an_http_1_1_request_without_exactly_one_host_is_answered_400(
    head: bytes, status: int
) -> None:
    """RFC 9112 3.2: a server MUST answer 400 to an HTTP/1.1 request lacking Host or
    carrying more than one; such requests were served."""

    async def scenario() -> None:
        async with edge() as (_, reader, writer):
            writer.write(head)
            got, _, body = await answer(reader)
            assert got == status, body

    run(scenario())


def test_http_1_0_and_connection_close_end_the_connection_after_the_answer() -> None:
    async def scenario() -> None:
        for request, kept in [
            (b"GET /x HTTP/1.0\r\n\r\n", False),
            (b"GET /x HTTP/1.0\r\nConnection: keep-alive\r\n\r\n", True),
            # RFC 9112 9.3: close wins; such a client was answered keep-alive and kept.
            (b"GET /x HTTP/1.0\r\nConnection: keep-alive, close\r\n\r\n", False),
            (b"GET /x HTTP/1.0\r\nConnection: keep-alive\r\nConnection: close\r\n\r\n", False),
            (b"GET /x HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n", False),
            (b"GET /x HTTP/1.1\r\nHost: x\r\n\r\n", True),
        ]:
            async with edge() as (_, reader, writer):
                writer.write(request)
                status, fields, _ = await answer(reader)
                assert status == 200
                if kept:
                    if b"HTTP/1.0" in request:  # such a client closes unless told otherwise
                        assert fields["connection"] == "keep-alive"
                    writer.write(b"GET /again HTTP/1.1\r\nHost: x\r\n\r\n")
                    assert json.loads((await answer(reader))[2])["target"] == "/again"
                else:
                    assert fields["connection"] == "close"
                    assert await closed(reader)

    run(scenario())


def test_a_streamed_answer_to_http_1_0_ends_with_the_connection_and_says_so() -> None:
    """No chunks in HTTP/1.0: a body without a length ends with the connection, so the
    answer says "close" even to a client that asked to keep it alive."""

    async def streams(request: Request) -> None:
        await request.start(200, Fields())
        await request.write(b"hello")
        await request.end()

    async def scenario() -> None:
        async with edge(handler=streams) as (_, reader, writer):
            writer.write(b"GET /x HTTP/1.0\r\nConnection: keep-alive\r\n\r\n")
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), BOUND)
            assert b"\r\nConnection: close\r\n" in head, head
            assert b"transfer-encoding" not in head.lower()
            assert await asyncio.wait_for(reader.read(), BOUND) == b"hello"

    run(scenario())


def test_a_chunked_body_is_taken_whole_however_its_pieces_come() -> None:
    async def scenario() -> None:
        head = b"POST /v1/x HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
        chunked = b"3;ext=1\r\nabc\r\n0A\r\n0123456789\r\n0\r\nX-Trailer: t\r\n\r\n"
        for pieces in (1, 7, len(chunked)):
            async with edge() as (_, reader, writer):
                writer.write(head)
                step = -(-len(chunked) // pieces)
                for start in range(0, len(chunked), step):
                    writer.write(chunked[start : start + step])
                    await writer.drain()
                    await asyncio.sleep(0)
                status, _, body = await answer(reader)
                assert status == 200
                assert json.loads(body)["body"] == "abc0123456789"

    run(scenario())


@pytest.mark.parametrize(
    ("chunked", "status"),
    [
        (b"zz\r\nab\r\n0\r\n\r\n", 400),
        (b"2\r\nabXX0\r\n\r\n", 400),
        (b"%x\r\n%s\r\n0\r\n\r\n" % (MAX_BODY + 1, b"x" * (MAX_BODY + 1)), 413),
        (b"800\r\n" + b"x" * 0x800 + b"\r\n" + b"800\r\n" + b"x" * 0x800 + b"\r\n1\r\nx\r\n", 413),
        (b"00000000000000001\r\nx\r\n0\r\n\r\n", 400),  # a size of more than 16 digits
    ],
    ids=[
        "bad-size",
        "no-crlf",
        "one-chunk-over-max-body",
        "chunks-adding-up-over-max-body",
        "size-of-17-digits",
    ],
)
def test_a_broken_or_oversize_chunked_body_is_the_clients_fault(
    chunked: bytes, status: int
) -> None:
    async def scenario() -> None:
        async with edge() as (_, reader, writer):
            writer.write(
                b"POST /x HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n" + chunked
            )
            got, fields, _ = await answer(reader)
            assert got == status
            assert fields["connection"] == "close"
            assert await closed(reader)

    run(scenario())


@pytest.mark.parametrize(
    "chunked",
    [
        b"1\r\nx\r\n" * MAX_BODY + b"0\r\n\r\n",
        b"1;" + b"e" * 8000 + b"\r\nx\r\n0\r\n\r\n",
    ],
    ids=["one-byte-chunks", "long-extension"],
)
def test_a_chunked_bodys_framing_is_held_to_max_body_as_its_data_is(chunked: bytes) -> None:
    """One-byte chunks cost the router's loop a microsecond each (2 s for 2 million,
    0.2 s per read), and a 16 MiB max_body let a body have 16 million. Chunk extensions
    (64 KiB a line) were read without end for as long as body_timeout."""

    async def scenario() -> None:
        async with edge() as (_, reader, writer):
            writer.write(
                b"POST /x HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n" + chunked
            )
            got, fields, body = await answer(reader)
            assert got == 413, body
            assert fields["connection"] == "close"
            assert await closed(reader)

    run(scenario())


@pytest.mark.parametrize(
    "chunked",
    [
        # 1 KiB of data in 16-byte chunks: each charged CHUNK_COST, 64 of them over 4 KiB.
        b"10\r\n%s\r\n" % (b"x" * 16) * 64 + b"0\r\n\r\n",
        # A whole 4 KiB in 128-byte chunks whose lines pass it only with their CRLFs.
        b"80;%s\r\n%s\r\n" % (b"e" * 119, b"x" * 128) * 32 + b"0\r\n\r\n",
    ],
    ids=["small-chunks", "lines-and-crlfs"],
)
def test_a_chunked_bodys_framing_costs_its_crlfs_and_each_chunk_at_least_chunk_cost(
    chunked: bytes,
) -> None:
    async def scenario() -> None:
        async with edge() as (_, reader, writer):
            writer.write(
                b"POST /x HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n" + chunked
            )
            got, _, body = await answer(reader)
            assert got == 413, body

    run(scenario())


def test_a_body_of_max_body_in_chunks_of_ordinary_size_is_taken_whole() -> None:
    async def scenario() -> None:
        size = 256  # twice what a chunk costs at least (CHUNK_COST)
        data = b"x" * MAX_BODY
        chunked = b"".join(
            b"%x\r\n%s\r\n" % (size, data[at : at + size]) for at in range(0, MAX_BODY, size)
        )
        async with edge() as (_, reader, writer):
            writer.write(
                b"POST /x HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
                + chunked
                + b"0\r\n\r\n"
            )
            got, _, body = await answer(reader)
            assert (got, len(json.loads(body)["body"])) == (200, MAX_BODY)

    run(scenario())


def test_blank_lines_before_a_request_line_count_in_the_heads_bound() -> None:
    """A client that sent nothing but CRLFs was read without end until idle_timeout: 300
    MiB in 10 s from one connection, the router's loop at 100% of a core meanwhile."""

    async def scenario() -> None:
        async with edge() as (_, reader, writer):
            writer.write(b"\r\n" * 3)  # a few, as old clients send after a body: skipped
            writer.write(b"GET /x HTTP/1.1\r\nHost: x\r\n\r\n")
            assert (await answer(reader))[0] == 200
            for _ in range(MAX_HEAD_BYTES // 4096 + 2):  # blank lines, and never a request
                writer.write(b"\r\n" * 2048)
                await writer.drain()
            got, fields, _ = await answer(reader)
            assert got == 431
            assert fields["connection"] == "close"
            assert await closed(reader)

    run(scenario())


@pytest.mark.parametrize("blank", [0, 1000])
@pytest.mark.parametrize(("size", "status"), [(MAX_HEAD_BYTES, 200), (MAX_HEAD_BYTES + 1, 431)])
def test_a_head_of_max_head_bytes_with_its_blank_lines_and_final_crlf_is_read(
    blank: int, size: int, status: int
) -> None:
    """The bound is on the head as sent: blank lines before it and its closing CRLFCRLF
    count, a head of exactly MAX_HEAD_BYTES is read and one byte more is refused."""

    async def scenario() -> None:
        start = b"GET /x HTTP/1.1\r\nHost: x\r\nX-Pad: "
        pad = size - blank - len(start) - 4
        async with edge() as (_, reader, writer):
            writer.write(b"\r\n" * (blank // 2) + start + b"p" * pad + b"\r\n\r\n")
            got, _, body = await answer(reader)
            assert got == status, body

    run(scenario())


@pytest.mark.parametrize("blank", [0, 1000])
@pytest.mark.parametrize(
    ("line", "status"),
    [(MAX_HEAD_BYTES - 2, 200), (MAX_HEAD_BYTES - 1, 414), (MAX_HEAD_BYTES, 414)],
    ids=["head-at-the-bound", "line-a-byte-short", "line-at-the-bound"],
)
def test_a_request_line_that_leaves_no_room_for_the_heads_end_is_414(
    blank: int, line: int, status: int
) -> None:
    """A request line (its CRLF and the blank lines before it counted) ending within the
    bound but too near it for the head's final CRLF: no header field makes it too large
    (there is none), the target does; it was answered 431."""

    async def scenario() -> None:
        start, end = b"GET /", b" HTTP/1.0\r\n"
        pad = line - blank - len(start) - len(end)
        async with edge() as (_, reader, writer):
            writer.write(b"\r\n" * (blank // 2) + start + b"x" * pad + end + b"\r\n")
            got, _, body = await answer(reader)
            assert got == status, body

    run(scenario())


def test_blank_lines_and_a_head_that_never_ends_count_together_in_the_bound() -> None:
    """Neither alone passes MAX_HEAD_BYTES, both together do: refused as they arrive, not
    when the head alone has grown past the bound."""

    async def scenario() -> None:
        async with edge() as (_, reader, writer):
            writer.write(b"\r\n" * (MAX_HEAD_BYTES // 4))  # half the bound in blank lines
            writer.write(b"GET /x HTTP/1.1\r\nHost: x\r\nX-Big: " + b"x" * (MAX_HEAD_BYTES // 2))
            got, fields, _ = await answer(reader)
            assert got == 431
            assert fields["connection"] == "close"

    run(scenario())


TRAILER = b"X-T: " + b"a" * 1000 + b"\r\n"


@pytest.mark.parametrize(
    ("framing", "why"),
    [
        # a chunk-size line that never ends
        (b"1;" + b"x" * (MAX_HEAD_BYTES + 10), str(MAX_HEAD_BYTES).encode()),
        (
            b"2\r\nok\r\n0\r\n" + TRAILER * (MAX_HEAD_BYTES // len(TRAILER) + 2) + b"\r\n",
            str(MAX_HEAD_BYTES).encode(),
        ),
        (b"2\r\nok\r\n0\r\n" + b"X-T: 1\r\n" * 101 + b"\r\n", b"more than 100 trailer fields"),
    ],
    ids=["endless-chunk-size-line", "trailers-past-the-bound", "too-many-trailer-fields"],
)
def test_a_chunked_bodys_framing_past_the_heads_bound_is_refused(
    framing: bytes, why: bytes
) -> None:
    """A chunk-size line, or trailers each line short of it, past MAX_HEAD_BYTES, or more
    trailer fields than a head may have: the request is refused, not buffered for as long
    as the client sends, nor each of 20,000 one-byte lines taken alone."""

    async def scenario() -> None:
        async with edge() as (_, reader, writer):
            writer.write(
                b"POST /x HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n" + framing
            )
            got, _, body = await answer(reader)
            assert got == 400, body
            assert why in body

    run(scenario())


def test_a_content_length_over_max_body_is_refused_without_reading_the_body() -> None:
    async def scenario() -> None:
        async with edge() as (_, reader, writer):
            writer.write(
                b"POST /x HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n{" % (MAX_BODY + 1)
            )
            got, fields, _ = await answer(reader)
            assert got == 413
            assert fields["connection"] == "close"
            writer.write(b"x" * MAX_BODY)  # the rest comes anyway: read and dropped
            assert await closed(reader)

    run(scenario())


@pytest.mark.parametrize("framing", ["length", "chunked"])
def test_a_truncated_body_gets_the_handlers_timeout_and_a_gone_client_ends_it(
    framing: str,
) -> None:
    async def scenario() -> None:
        if framing == "length":
            request = b"POST /x HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{"
        else:
            request = b"POST /x HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n64\r\n{"
        async with edge() as (server, reader, writer):
            writer.write(request)
            got, _, _ = await answer(reader)  # the echo handler's own 1 s bound
            assert got == 408
            assert await closed(reader)  # the body was never whole: no next request
        async with edge() as (server, reader, writer):
            writer.write(request)
            await writer.drain()
            writer.close()  # gone mid-body: the handler's task is cancelled
            async with asyncio.timeout(BOUND):
                while server.held:
                    await asyncio.sleep(0.01)

    run(scenario())


@pytest.mark.parametrize(
    "head",
    [
        b"GET /x HTTP/1.1\nHost: x\n\n",
        b"GET /x HTTP/1.1\r\nHost: x\n\r\n",
        b"GET /x HTTP/1.1\rHost: x\r\r",
    ],
    ids=["lf-only", "one-bare-lf", "cr-only"],
)
@pytest.mark.parametrize("trickled", [False, True], ids=["whole", "a-byte-at-a-time"])
def test_a_head_whose_lines_do_not_end_in_crlf_is_refused_without_waiting(
    head: bytes, trickled: bool
) -> None:
    """Such a head never holds the CRLFCRLF that ends one: its client heard nothing, and
    its connection was closed at idle_timeout. A 400 now, as a bare CR or LF ever was."""

    async def scenario() -> None:
        async with edge() as (server, reader, writer):
            for piece in [bytes([byte]) for byte in head] if trickled else [head]:
                writer.write(piece)
                await writer.drain()
                if trickled:  # each byte its own read: a CR met at the end of one
                    await asyncio.sleep(0.01)
            got, fields, body = await answer(reader)  # long before the idle timeout
            assert got == 400, body
            assert fields["connection"] == "close"
            assert await closed(reader)
            # And a head whose CRLFs come split between reads is still read whole.
            again, sending = await asyncio.open_connection("127.0.0.1", server.port)
            for byte in b"GET /x HTTP/1.1\r\nHost: x\r\n\r\n":
                sending.write(bytes([byte]))
                await sending.drain()
                await asyncio.sleep(0)
            assert (await answer(again))[0] == 200
            sending.close()

    run(scenario())


def test_a_head_sent_a_byte_at_a_time_is_closed_at_the_idle_timeout() -> None:
    async def scenario() -> None:
        async with edge(idle_timeout=0.3) as (server, reader, writer):

            async def trickle() -> None:
                for byte in b"GET /x HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"x" * 1000:
                    writer.write(bytes([byte]))
                    await asyncio.sleep(0.02)

            sending = asyncio.create_task(trickle())
            assert await closed(reader)  # long before the head could end
            sending.cancel()
            with contextlib.suppress(asyncio.CancelledError, ConnectionError):
                await sending
            assert server.held == 0

    run(scenario())


@pytest.mark.parametrize("expect", [b"100-continue", b"100-Continue"])  # case-insensitive
def test_expect_100_continue_is_answered_before_the_body_is_sent(expect: bytes) -> None:
    async def scenario() -> None:
        async with edge() as (_, reader, writer):
            writer.write(
                b"POST /x HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\nExpect: %s\r\n\r\n" % expect
            )
            interim = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), BOUND)
            assert interim == b"HTTP/1.1 100 Continue\r\n\r\n"
            writer.write(b"hi")
            status, _, body = await answer(reader)
            assert (status, json.loads(body)["body"]) == (200, "hi")

    run(scenario())


def test_expect_100_continue_from_an_http_1_0_client_is_ignored() -> None:
    # RFC 9110 10.1.1: an HTTP/1.0 client knows no 1xx answer; it took the 100 for the
    # whole answer, and the real one for garbage.
    async def scenario() -> None:
        async with edge() as (_, reader, writer):
            writer.write(b"POST /x HTTP/1.0\r\nContent-Length: 2\r\nExpect: 100-continue\r\n\r\nhi")
            status, _, body = await answer(reader)
            assert (status, json.loads(body)["body"]) == (200, "hi")

    run(scenario())


@pytest.mark.parametrize("framing", [b"", b"Content-Length: 0\r\n"], ids=["none", "length-0"])
def test_expect_100_continue_with_no_body_to_come_gets_the_answer_alone(framing: bytes) -> None:
    # A client waiting for nothing: the 100 would be read as its answer, and the answer as
    # the next one's.
    async def scenario() -> None:
        async with edge() as (_, reader, writer):
            writer.write(b"GET /x HTTP/1.1\r\nHost: x\r\n%sExpect: 100-continue\r\n\r\n" % framing)
            status, _, body = await answer(reader)
            assert (status, json.loads(body)["body"]) == (200, "")

    run(scenario())


def test_the_path_is_decoded_and_the_target_kept_as_sent() -> None:
    async def scenario() -> None:
        async with edge() as (_, reader, writer):
            writer.write(b"GET /v1/a%2Fb?x=%20 HTTP/1.1\r\nHost: x\r\n\r\n")
            seen = json.loads((await answer(reader))[2])
            assert (seen["path"], seen["target"]) == ("/v1/a/b", "/v1/a%2Fb?x=%20")
            writer.write(b"GET http://host:1/v1/y?z=1 HTTP/1.1\r\nHost: x\r\n\r\n")
            seen = json.loads((await answer(reader))[2])
            assert (seen["path"], seen["target"]) == ("/v1/y", "/v1/y?z=1")
            # An absolute form without a path asks for the root (RFC 9112 3.2.2).
            writer.write(b"GET http://host:1?z=1 HTTP/1.1\r\nHost: x\r\n\r\n")
            seen = json.loads((await answer(reader))[2])
            assert (seen["path"], seen["target"]) == ("/", "/?z=1")

    run(scenario())


@pytest.mark.parametrize("status", [204, 304])
def test_a_streamed_answer_that_can_have_no_body_is_its_head_alone(status: int) -> None:
    """A 204 relayed as an event stream was sent chunked, its "0" terminator read by a
    kept-alive client as the start of its next answer."""

    async def bodiless(request: Request) -> None:
        await request.start(status, Fields([("Content-Type", "text/event-stream")]))
        await request.write(b"data: ignored\n\n")
        await request.end()

    async def scenario() -> None:
        async with edge(handler=bodiless) as (_, reader, writer):
            writer.write(b"GET /a HTTP/1.1\r\nHost: x\r\n\r\nGET /b HTTP/1.1\r\nHost: x\r\n\r\n")
            for _ in range(2):  # the second head comes right after the first: nothing between
                head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), BOUND)
                assert head.startswith(b"HTTP/1.1 %d " % status), head
                assert b"transfer-encoding" not in head.lower()

    run(scenario())


@pytest.mark.parametrize("started", [False, True], ids=["before-the-answer", "in-the-answer"])
def test_a_handler_that_fails_is_a_500_only_before_its_answer_began(started: bool) -> None:
    """Once its head is out, a 500 written after part of the answer would be read as its
    body, or as the kept-alive client's next answer: the connection is cut off instead."""

    async def fails(request: Request) -> None:
        if started:
            await request.start(200, Fields())
            await request.write(b"hello")
        raise RuntimeError("a bug")

    async def scenario() -> None:
        asyncio.get_running_loop().set_exception_handler(lambda *_: None)  # the bug's log
        async with edge(handler=fails) as (_, reader, writer):
            writer.write(b"GET /x HTTP/1.1\r\nHost: x\r\n\r\n")
            seen = await read_to_close(reader)
            assert (b"HTTP/1.1 500 " in seen) is not started, seen

    run(scenario())


def test_an_answer_its_handler_left_unended_cuts_the_connection_off() -> None:
    """A chunked answer with no last chunk (a relay that gave up): kept alive, its client
    waited for the rest until the idle timeout; it is cut off at once."""

    async def unended(request: Request) -> None:
        await request.start(200, Fields())
        await request.write(b"hello")

    async def scenario() -> None:
        async with edge(handler=unended) as (_, reader, writer):
            writer.write(b"GET /x HTTP/1.1\r\nHost: x\r\n\r\n")
            seen = await read_to_close(reader)
            assert not seen.endswith(b"0\r\n\r\n"), seen

    run(scenario())


def test_header_fields_are_found_and_replaced_whatever_the_case_of_their_names() -> None:
    # HTTP's field names are case-blind (RFC 9110 5.1): a client's "content-length" is
    # the Content-Length the edge frames the body by.
    fields = Fields([("Content-Type", "a"), ("X-A", "1"), ("x-a", "2")])
    assert fields.get("content-type") == "a" and "CONTENT-TYPE" in fields
    fields["X-a"] = "3"
    assert fields.items() == [("Content-Type", "a"), ("X-a", "3")]


def test_connection_options_are_read_whatever_their_case() -> None:
    # "Close" is close (RFC 9110 7.6.1: the options are case-insensitive): kept alive,
    # the next message on that connection met a peer that had closed it.
    assert keep_alive("HTTP/1.1", connection_tokens([("connection", "Close")])) is False
    assert keep_alive("HTTP/1.0", connection_tokens([("Connection", "Keep-Alive")])) is True
    assert keep_alive("HTTP/1.0", connection_tokens([("Connection", "Keep-Alive, CLOSE")])) is False
