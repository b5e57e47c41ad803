"""The /metrics client against raw sockets on 127.0.0.1: framing, reuse, bounds, failures.

The hostile-server tests in test_probe.py run through it too; these pin what only the
client itself decides: how a body is framed, when a connection is reused, what is sent.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import gc
import os
import socket
import ssl
import struct
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from tlsproc import make_certificate, run_child, tls_server, trusting

from llmhealth import eventloop, wire
from llmhealth.wire import MAX_HEAD_BYTES, Connection, Failure, WireError, WireResponse

Handler = Callable[[socket.socket, int], None]  # a connection, and its number from 0


@contextmanager
def tcp_server(handle: Handler, host: str = "127.0.0.1") -> Iterator[tuple[str, list[bytes]]]:
    """Each accepted connection runs ``handle`` in its own thread; every byte received
    by the server is kept, so a test can see exactly what the client sent."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    listener = socket.create_server((host, 0), family=family)
    listener.settimeout(0.1)
    stop = threading.Event()
    received: list[bytes] = []
    threads: list[threading.Thread] = []

    def run(connection: socket.socket, number: int) -> None:
        with connection, contextlib.suppress(OSError):
            connection.settimeout(5)
            handle(connection, number)

    def accept() -> None:
        number = 0
        while not stop.is_set():
            try:
                connection, _ = listener.accept()
            except TimeoutError:
                continue
            thread = threading.Thread(target=run, args=(_Recorder(connection, received), number))
            thread.start()
            threads.append(thread)
            number += 1

    acceptor = threading.Thread(target=accept)
    acceptor.start()
    try:
        name = f"[{host}]" if ":" in host else host
        yield f"http://{name}:{listener.getsockname()[1]}", received
    finally:
        stop.set()
        acceptor.join(5)
        for thread in threads:
            thread.join(5)
        listener.close()


class _Recorder(socket.socket):
    """A socket whose received bytes are also appended to a shared list."""

    def __init__(self, connection: socket.socket, received: list[bytes]) -> None:
        super().__init__(fileno=connection.detach())
        self._received = received

    def recv(self, size: int, flags: int = 0) -> bytes:
        data = super().recv(size, flags)
        self._received.append(data)
        return data


def read_request(connection: socket.socket) -> bytes:
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = connection.recv(65536)
        if not chunk:
            return data
        data += chunk
    return data


def get(url: str, *, times: int = 1, max_bytes: int = 1 << 20) -> list[WireResponse]:
    async def run() -> list[WireResponse]:
        connection = Connection(None, "llmhealth/test")
        loop = asyncio.get_running_loop()
        try:
            return [
                await connection.request("GET", url, deadline=loop.time() + 5, max_bytes=max_bytes)
                for _ in range(times)
            ]
        finally:
            await connection.aclose()

    return eventloop.run(run())


def timed_out_read(url: str, tls: ssl.SSLContext | None) -> WireError:
    """The failure of a GET given half a second, which the server must let run out."""

    async def run() -> WireError:
        connection = Connection(tls, "llmhealth/test")
        loop = asyncio.get_running_loop()
        try:
            await connection.request("GET", url, deadline=loop.time() + 0.5, max_bytes=100)
        except WireError as error:
            return error
        finally:
            await connection.aclose()
        raise AssertionError("the read should have timed out")

    return eventloop.run(run())


def failure_of(url: str, *, max_bytes: int = 1 << 20) -> WireError:
    with pytest.raises(WireError) as caught:
        get(url, max_bytes=max_bytes)
    return caught.value


def test_the_request_asks_for_identity_names_the_host_and_nothing_else() -> None:
    def answer(connection: socket.socket, _number: int) -> None:
        read_request(connection)
        connection.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")

    with tcp_server(answer) as (url, received):
        (response,) = get(f"{url}/metrics")
    port = url.rsplit(":", 1)[1]
    assert b"".join(received) == (
        b"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1:" + port.encode() + b"\r\n"
        b"User-Agent: llmhealth/test\r\nAccept: */*\r\nAccept-Encoding: identity\r\n\r\n"
    )
    assert (response.status, response.body) == (200, b"ok")


def test_a_host_whose_last_label_is_long_is_read_its_port_apart_from_its_name() -> None:
    """The Host header was IDNA-encoded with its port, which joined the last label: a
    label `config check` took (63 characters at most) grew past 63 with ":8000", and
    every read failed as "input llmhealth cannot handle" (the same in the router's
    origin, which ended `route` with a traceback). Here a dotted quad whose last part
    is 58 characters long (zeros before the 1, as inet_aton reads it) stands for such
    a name, as no resolver here knows a long one."""
    from llmhealth.config import check_url  # noqa: PLC0415
    from llmhealth.upstream import Origin  # noqa: PLC0415

    def answer(connection: socket.socket, _number: int) -> None:
        read_request(connection)
        connection.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")

    host = "127.0.0." + "0" * 57 + "1"
    with tcp_server(answer) as (url, received):
        long_url = check_url(url.replace("127.0.0.1", host))
        (response,) = get(f"{long_url}/metrics")
    assert (response.status, response.body) == (200, b"ok")
    port = url.rsplit(":", 1)[1]
    assert f"\r\nHost: {host}:{port}\r\n".encode() in b"".join(received)
    assert Origin.parse(long_url).host_header == f"{host}:{port}".encode()
    zoned = "http://[fe80:0000:0000:0000:0000:0000:0000:0001%25abcdefghijklmno]:8000"
    assert Origin.parse(check_url(zoned)).host_header == zoned[7:].encode()
    assert Origin.parse("http://bücher.example:8000").host_header == b"xn--bcher-kva.example:8000"


def test_an_ipv6_address_is_written_in_brackets_in_the_host_header() -> None:
    # RFC 9110 7.2: the Host is the URL's authority, where an IPv6 address has brackets.
    def answer(connection: socket.socket, _number: int) -> None:
        read_request(connection)
        connection.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")

    try:
        socket.create_server(("::1", 0), family=socket.AF_INET6).close()
    except OSError:
        pytest.skip("no IPv6 loopback here")
    with tcp_server(answer, "::1") as (url, received):
        (response,) = get(f"{url}/metrics")
    assert response.body == b"ok"
    assert f"\r\nHost: [::1]:{url.rsplit(':', 1)[1]}\r\n".encode() in b"".join(received)


@pytest.mark.usefixtures("each_loop")
def test_a_kept_alive_connection_is_reused_for_the_next_read() -> None:
    def answer_many(connection: socket.socket, _number: int) -> None:
        while read_request(connection):
            connection.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nhello")

    connections = []

    def counted(connection: socket.socket, number: int) -> None:
        connections.append(number)
        answer_many(connection, number)

    with tcp_server(counted) as (url, _):
        responses = get(f"{url}/metrics", times=3)
    assert [response.body for response in responses] == [b"hello"] * 3
    assert connections == [0]


@pytest.mark.usefixtures("each_loop")
def test_chunked_bodies_are_joined_and_their_trailers_skipped() -> None:
    def chunked(connection: socket.socket, _number: int) -> None:
        while read_request(connection):
            connection.sendall(
                b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
                b"5;ext=1\r\nhello\r\n1\r\n \r\n5\r\nworld\r\n0\r\nX-Trailer: 1\r\n\r\n"
            )

    with tcp_server(chunked) as (url, _):
        responses = get(f"{url}/metrics", times=2)  # framing right: the second read works
    assert [response.body for response in responses] == [b"hello world"] * 2


def test_a_body_without_length_runs_to_the_close_and_the_connection_is_not_reused() -> None:
    def close_delimited(connection: socket.socket, _number: int) -> None:
        read_request(connection)
        connection.sendall(b"HTTP/1.0 200 OK\r\n\r\nall of it")

    with tcp_server(close_delimited) as (url, _):
        responses = get(f"{url}/metrics", times=2)
    assert [response.body for response in responses] == [b"all of it"] * 2


def test_an_http_1_0_answer_saying_close_and_keep_alive_ends_the_connection() -> None:
    """RFC 9112 9.3 (as http1.keep_alive, the router's two sides): close wins. A server
    that said so and dropped the next request on that connection failed the tiny POST."""

    def closing(connection: socket.socket, number: int) -> None:
        read_request(connection)
        connection.sendall(
            b"HTTP/1.0 200 OK\r\nConnection: keep-alive, close\r\nContent-Length: 1\r\n\r\nx"
        )
        if number == 0:
            read_request(connection)  # what comes after its close is not answered

    async def run(url: str) -> list[WireResponse]:
        connection = Connection(None, "llmhealth/test")
        loop = asyncio.get_running_loop()
        try:
            return [
                await connection.request(method, url, deadline=loop.time() + 5, max_bytes=100)
                for method in ("GET", "POST")
            ]
        finally:
            await connection.aclose()

    with tcp_server(closing) as (url, _):
        responses = eventloop.run(run(f"{url}/v1/completions"))
    assert [response.body for response in responses] == [b"x", b"x"]


def test_informational_answers_are_skipped() -> None:
    def with_continue(connection: socket.socket, _number: int) -> None:
        read_request(connection)
        connection.sendall(
            b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\nContent-Length: 1\r\n\r\nx"
        )

    with tcp_server(with_continue) as (url, _):
        (response,) = get(f"{url}/metrics")
    assert (response.status, response.body) == (200, b"x")


@pytest.mark.parametrize(("informational", "read"), [(8, True), (9, False)])
def test_at_most_eight_informational_answers_are_skipped(informational: int, read: bool) -> None:
    def with_many(connection: socket.socket, _number: int) -> None:
        read_request(connection)
        connection.sendall(
            b"HTTP/1.1 103 Early Hints\r\n\r\n" * informational
            + b"HTTP/1.1 200 OK\r\nContent-Length: 1\r\n\r\nx"
        )

    with tcp_server(with_many) as (url, _):
        if read:  # eight were refused as "more than 8"
            assert get(f"{url}/metrics")[0].body == b"x"
        else:
            assert failure_of(f"{url}/metrics").failure is Failure.MALFORMED


@pytest.mark.parametrize(("fields", "read"), [(100, True), (101, False)])
def test_at_most_a_hundred_header_fields_are_read_in_one_head(fields: int, read: bool) -> None:
    # As the router and the etcd client read an answer (http1.MAX_FIELDS): 16,000 fields
    # of one letter fit in a 64 KiB head, and each head's repeats were joined one by one.
    def with_fields(connection: socket.socket, _number: int) -> None:
        read_request(connection)
        many = b"X-A: a\r\n" * (fields - 1)
        connection.sendall(b"HTTP/1.1 103 Early Hints\r\n" + many + b"Link: </>\r\n\r\n")
        connection.sendall(b"HTTP/1.1 200 OK\r\n" + many + b"Content-Length: 1\r\n\r\nx")

    with tcp_server(with_fields) as (url, _):
        if read:
            (response,) = get(f"{url}/metrics")
            assert (response.body, response.headers["x-a"]) == (b"x", ", ".join(["a"] * 99))
        else:
            error = failure_of(f"{url}/metrics")
            assert error.failure is Failure.MALFORMED
            assert "more than 100 header fields" in str(error)


@pytest.mark.usefixtures("each_loop")
@pytest.mark.parametrize("when", ["with the answer", "after the answer"])
def test_bytes_past_an_answers_end_never_become_the_next_answer(when: str) -> None:
    # A Content-Length short of its body: the rest was taken for the next request's answer
    # on the kept connection, and every later answer was one behind.
    connections = []
    read_once = threading.Event()

    def says_too_much(connection: socket.socket, number: int) -> None:
        connections.append(number)
        read_request(connection)
        answer = b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nfirst"
        surplus = b"HTTP/1.1 500 Stale\r\nContent-Length: 5\r\n\r\nstale"
        if number > 0:
            connection.sendall(answer.replace(b"first", b"fresh"))
        elif when == "with the answer":
            connection.sendall(answer + surplus)
        else:
            connection.sendall(answer)
            read_once.wait(5)
            connection.sendall(surplus)
        while read_request(connection):  # a request on this connection gets the surplus
            connection.sendall(answer.replace(b"first", b"later"))

    async def read_twice(url: str) -> list[tuple[int, bytes]]:
        connection = Connection(None, "llmhealth/test")
        loop = asyncio.get_running_loop()
        try:
            first = await connection.request("GET", url, deadline=loop.time() + 5, max_bytes=99)
            read_once.set()
            async with asyncio.timeout(5):
                while when == "after the answer" and not wire._unread(connection._reader):
                    await asyncio.sleep(0.01)  # the surplus has arrived, unread
            second = await connection.request("GET", url, deadline=loop.time() + 5, max_bytes=99)
        finally:
            await connection.aclose()
        return [(first.status, first.body), (second.status, second.body)]

    with tcp_server(says_too_much) as (url, _):
        answers = eventloop.run(read_twice(f"{url}/metrics"))
    assert answers == [(200, b"first"), (200, b"fresh")]
    assert connections == [0, 1]


@pytest.mark.usefixtures("each_loop")
def test_an_idle_connection_the_server_closed_is_replaced_without_a_failure() -> None:
    def one_answer_then_close(connection: socket.socket, _number: int) -> None:
        read_request(connection)
        connection.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
        # Keep-alive was promised; the connection closes anyway, as uvicorn's does
        # after its idle timeout, before or while the next request is on its way.

    with tcp_server(one_answer_then_close) as (url, _):
        responses = get(f"{url}/metrics", times=3)
    assert [response.body for response in responses] == [b"ok"] * 3


def test_each_kept_connection_the_server_closed_is_counted_for_the_caller() -> None:
    def one_answer_then_close(connection: socket.socket, _number: int) -> None:
        read_request(connection)
        connection.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")

    async def three_reads(url: str) -> tuple[int, int]:
        connection = Connection(None, "llmhealth/test")
        loop = asyncio.get_running_loop()
        try:
            await connection.request("GET", url, deadline=loop.time() + 5, max_bytes=1 << 20)
            first = connection.idle_closes
            for _ in range(2):
                await asyncio.sleep(0.05)  # the server's close reaches us, or crosses the next
                await connection.request("GET", url, deadline=loop.time() + 5, max_bytes=1 << 20)
            return first, connection.idle_closes
        finally:
            await connection.aclose()

    with tcp_server(one_answer_then_close) as (url, _):
        assert eventloop.run(three_reads(f"{url}/metrics")) == (0, 2)


def test_a_fresh_connection_closed_before_an_answer_is_a_failure_not_retried() -> None:
    attempts = []

    def close_at_once(connection: socket.socket, number: int) -> None:
        attempts.append(number)
        read_request(connection)

    with tcp_server(close_at_once) as (url, _):
        error = failure_of(f"{url}/metrics")
    assert error.failure is Failure.CLOSED
    assert attempts == [0]


def _get_then(method: str, url: str, pause: float = 0.0) -> tuple[WireResponse | WireError, int]:
    """A GET, then after ``pause`` ``method`` on the same Connection: the second's outcome,
    and the idle closes the connection counted."""

    async def run() -> tuple[WireResponse | WireError, int]:
        connection = Connection(None, "llmhealth/test")
        loop = asyncio.get_running_loop()
        try:
            await connection.request("GET", url, deadline=loop.time() + 5, max_bytes=100)
            await asyncio.sleep(pause)
            body = b"{}" if method == "POST" else None
            try:
                second: WireResponse | WireError = await connection.request(
                    method, url, deadline=loop.time() + 5, max_bytes=100, body=body
                )
            except WireError as error:
                second = error
            return second, connection.idle_closes
        finally:
            await connection.aclose()

    return eventloop.run(run())


def test_a_post_the_server_took_on_a_kept_connection_is_never_sent_twice() -> None:
    # The tiny request follows /v1/models on its connection. A server that took it and
    # died had it sent again, and the second generation's answer judged the server.
    posts = []

    def takes_the_post_then_dies(connection: socket.socket, number: int) -> None:
        while request := read_request(connection):
            if request.startswith(b"POST"):
                posts.append(number)
                return
            connection.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}")

    with tcp_server(takes_the_post_then_dies) as (url, _):
        second, idle_closes = _get_then("POST", f"{url}/v1/completions")
    assert isinstance(second, WireError) and second.failure is Failure.CLOSED
    assert (len(posts), idle_closes) == (1, 0)


@pytest.mark.slow
@pytest.mark.parametrize(("pause", "connections"), [(0.0, [0]), (1.5, [0, 1])])
def test_a_post_goes_on_a_connection_just_used_or_on_a_fresh_one(
    pause: float, connections: list[int]
) -> None:
    # A kept connection idle for a while may be closed by the server as the POST goes
    # out, and a POST may not be sent twice: after a pause it goes on a new connection.
    opened = []

    def answer_all(connection: socket.socket, number: int) -> None:
        opened.append(number)
        while read_request(connection):
            connection.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}")

    with tcp_server(answer_all) as (url, _):
        second, idle_closes = _get_then("POST", f"{url}/v1/completions", pause)
    assert isinstance(second, WireResponse) and second.body == b"{}"
    assert (opened, idle_closes) == (connections, 0)


_STARVED = 1.2  # longer than wire._WARM and than the keep-alive of the server below


def test_a_post_after_an_answer_read_late_goes_on_a_fresh_connection() -> None:
    """The server's keep-alive runs from when it sent its answer, not from when a busy
    event loop got round to reading it: at 10,000 backends in one loop, the tiny request
    followed its /v1/models "just now" by our reading, the server had already given up on
    the connection, and about 2,000 of 2,500 idle backends were judged ``unanswered``."""
    keep_alive = 0.5  # this server's: a request later than this after an answer is refused
    opened = []

    def closes_idle_connections(connection: socket.socket, number: int) -> None:
        opened.append(number)
        answered_at = None
        while read_request(connection):
            if answered_at is not None and time.monotonic() - answered_at > keep_alive:
                return  # its idle close, crossing the request on the wire
            connection.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}")
            answered_at = time.monotonic()

    def starved(_status: int, _headers: object) -> None:
        time.sleep(_STARVED)  # other targets' work held the loop as the answer came

    async def run(url: str) -> WireResponse:
        connection = Connection(None, "llmhealth/test")
        loop = asyncio.get_running_loop()
        try:
            await connection.request(
                "GET", url, deadline=loop.time() + 5, max_bytes=100, accept=starved
            )
            return await connection.request(
                "POST", url, deadline=loop.time() + 5, max_bytes=100, body=b"{}"
            )
        finally:
            await connection.aclose()

    with tcp_server(closes_idle_connections) as (url, _):
        answer = eventloop.run(run(f"{url}/v1/completions"))
    assert answer.body == b"{}"
    assert opened == [0, 1]


def _name_for(monkeypatch: pytest.MonkeyPatch, name: str, found: list[Any], seconds: float) -> None:
    """``name`` looks up to ``found`` (getaddrinfo's entries), after ``seconds``."""
    real = socket.getaddrinfo

    def getaddrinfo(host: str, *args: Any, **kwargs: Any) -> Any:
        if host != name:
            return real(host, *args, **kwargs)
        time.sleep(seconds)
        return found

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)


def _dual_stack(monkeypatch: pytest.MonkeyPatch, port: int) -> None:
    """``dual.test`` looks up to ::1 first, then 127.0.0.1, both at ``port``, at once."""
    _name_for(
        monkeypatch,
        "dual.test",
        [
            (socket.AF_INET6, socket.SOCK_STREAM, 6, "", ("::1", port, 0, 0)),
            (socket.AF_INET, socket.SOCK_STREAM, 6, "", ("127.0.0.1", port)),
        ],
        0.0,
    )


def _answer_after(seconds: float) -> Handler:
    def answer(connection: socket.socket, _number: int) -> None:
        while read_request(connection):
            time.sleep(seconds)
            connection.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")

    return answer


def test_an_address_this_host_cannot_open_is_one_address_failed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A name with an IPv6 address first, on a host with IPv6 turned off: the socket
    that could not be made failed the read, where asyncio tried the next address."""
    with tcp_server(_answer_after(0.0)) as (url, _):
        port = int(url.rsplit(":", 1)[1])
        _dual_stack(monkeypatch, port)
        real_socket = socket.socket

        def no_ipv6(family: int = -1, *args: Any, **kwargs: Any) -> socket.socket:
            if family == socket.AF_INET6 and len(args) < 3 and "fileno" not in kwargs:
                raise OSError(errno.EAFNOSUPPORT, "Address family not supported by protocol")
            return real_socket(family, *args, **kwargs)

        monkeypatch.setattr(socket, "socket", no_ipv6)
        [response] = get(f"http://dual.test:{port}/metrics")
    assert response.body == b"ok"


def test_a_name_whose_addresses_fail_for_want_of_descriptors_is_not_the_servers_failure(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """One address of another family this host cannot open, the other out of descriptors:
    the two errors merged into one with no errno, and the server was judged down for
    this process's own shortage."""
    _dual_stack(monkeypatch, 9)
    real_socket = socket.socket

    def short_of_everything(family: int = -1, *args: Any, **kwargs: Any) -> socket.socket:
        if len(args) > 2 or "fileno" in kwargs:  # the event loop's own, and accepted ones
            return real_socket(family, *args, **kwargs)
        if family == socket.AF_INET6:
            raise OSError(errno.EAFNOSUPPORT, "Address family not supported by protocol")
        raise OSError(errno.EMFILE, "Too many open files")

    monkeypatch.setattr(socket, "socket", short_of_everything)
    error = failure_of("http://dual.test:9/metrics")
    assert error.failure is Failure.STARVED, error.detail


@pytest.mark.slow
def test_a_lookup_held_up_with_its_loop_is_forgiven_once_not_twice(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A loop that ran late while a name was looked up had that time forgiven as the
    loop's lateness and again as the lookup's: a server 1.6 s late on a 1 s budget was
    let through."""
    with tcp_server(_answer_after(1.6)) as (url, _):
        port = int(url.rsplit(":", 1)[1])
        found = [(socket.AF_INET, socket.SOCK_STREAM, 6, "", ("127.0.0.1", port))]
        _name_for(monkeypatch, "slow.test", found, 0.8)

        async def run() -> WireError:
            connection = Connection(None, "llmhealth/test")
            loop = asyncio.get_running_loop()
            loop.call_soon(time.sleep, 0.8)  # held up while the name is looked up
            try:
                await connection.request(
                    "GET", f"http://slow.test:{port}/", deadline=loop.time() + 1.0, max_bytes=100
                )
            except WireError as error:
                return error
            finally:
                await connection.aclose()
            raise AssertionError("answered within its budget and its lateness")

        error = eventloop.run(run())
    assert error.failure is Failure.ANSWER_TIMEOUT, error.detail


def test_a_head_cut_off_on_a_kept_connection_is_the_servers_failure_not_an_idle_close() -> None:
    attempts = []

    def half_a_head(connection: socket.socket, number: int) -> None:
        attempts.append(number)
        read_request(connection)
        connection.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
        read_request(connection)
        connection.sendall(b"HTTP/1.1 500 Internal Serv")  # and the process is gone

    with tcp_server(half_a_head) as (url, _):
        second, idle_closes = _get_then("GET", f"{url}/metrics")
    assert isinstance(second, WireError) and second.failure is Failure.CLOSED
    assert (attempts, idle_closes) == ([0], 0)


def test_a_head_cut_off_by_a_reset_on_a_kept_connection_is_not_sent_again() -> None:
    # The bytes of the head a reset cut off stay in the reader, not in the error: they
    # too say the server took the request, which a GET sent again would hide.
    attempts = []

    def half_a_head_then_reset(connection: socket.socket, number: int) -> None:
        attempts.append(number)
        read_request(connection)
        connection.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
        read_request(connection)
        connection.sendall(b"HTTP/1.1 500 Internal Serv")
        time.sleep(0.2)  # read by the client before the reset comes
        connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))

    with tcp_server(half_a_head_then_reset) as (url, _):
        second, idle_closes = _get_then("GET", f"{url}/metrics")
    assert isinstance(second, WireError) and second.failure is Failure.CLOSED
    assert (attempts, idle_closes) == ([0], 0)


def test_a_post_after_a_get_whose_connection_was_reset_goes_on_a_fresh_one() -> None:
    # A reset the loop took in while the connection waited leaves it closing, with its
    # error in the reader: the POST, never sent on it, must not be judged by that error.
    posts = []

    def answer_then_reset(connection: socket.socket, number: int) -> None:
        request = read_request(connection)
        if request.startswith(b"POST"):
            posts.append(number)
        connection.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}")
        if number == 0:
            connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))

    with tcp_server(answer_then_reset) as (url, _):
        second, _idle_closes = _get_then("POST", f"{url}/v1/completions", 0.3)
    assert isinstance(second, WireResponse) and second.body == b"{}"
    assert posts == [1]


def test_an_answer_framed_by_both_length_and_chunks_does_not_keep_its_connection() -> None:
    connections = []

    def framed_twice(connection: socket.socket, number: int) -> None:
        connections.append(number)
        while read_request(connection):
            connection.sendall(
                b"HTTP/1.1 200 OK\r\nContent-Length: 3\r\nTransfer-Encoding: chunked\r\n\r\n"
                b"3\r\nabc\r\n0\r\n\r\n"
            )

    with tcp_server(framed_twice) as (url, _):
        responses = get(f"{url}/metrics", times=2)
    assert [response.body for response in responses] == [b"abc"] * 2
    assert connections == [0, 1]  # RFC 9112 6.3: closed after such an answer


def test_a_body_ended_by_the_close_is_not_counted_as_an_idle_close() -> None:
    def close_delimited(connection: socket.socket, _number: int) -> None:
        read_request(connection)
        connection.sendall(b"HTTP/1.1 200 OK\r\n\r\nabc")

    with tcp_server(close_delimited) as (url, _):
        second, idle_closes = _get_then("GET", f"{url}/metrics")
    assert isinstance(second, WireResponse) and second.body == b"abc"
    assert idle_closes == 0  # counted, the caller would read this server earlier for ever


def test_a_content_length_over_the_cap_is_refused_before_the_body_is_read() -> None:
    def announce_a_lot(connection: socket.socket, _number: int) -> None:
        read_request(connection)
        connection.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 999999999\r\n\r\n")

    with tcp_server(announce_a_lot) as (url, _):
        error = failure_of(f"{url}/metrics", max_bytes=1000)
    assert error.failure is Failure.TOO_BIG


def test_a_body_ended_by_the_close_is_cut_off_at_the_cap() -> None:
    # No Content-Length and no chunks: only the bytes as they arrive bound the read.
    def close_delimited(connection: socket.socket, _number: int) -> None:
        read_request(connection)
        connection.sendall(b"HTTP/1.1 200 OK\r\n\r\n" + b"x" * 5000)

    with tcp_server(close_delimited) as (url, _):
        error = failure_of(f"{url}/metrics", max_bytes=1000)
    assert error.failure is Failure.TOO_BIG


@pytest.mark.parametrize(("length", "refused"), [(1000, False), (1001, True)])
def test_a_content_length_is_refused_from_one_byte_over_the_cap(length: int, refused: bool) -> None:
    def announce(connection: socket.socket, _number: int) -> None:
        read_request(connection)
        connection.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % length)
        connection.sendall(b"x" * length)

    with tcp_server(announce) as (url, _):
        if refused:
            assert failure_of(f"{url}/metrics", max_bytes=1000).failure is Failure.TOO_BIG
        else:
            assert get(f"{url}/metrics", max_bytes=1000)[0].body == b"x" * length


def test_a_not_modified_answer_has_no_body_whatever_its_length_says() -> None:
    # RFC 9110 15.4.5: a 304's Content-Length is the representation's, not a body's.
    def not_modified(connection: socket.socket, _number: int) -> None:
        read_request(connection)
        connection.sendall(b"HTTP/1.1 304 Not Modified\r\nContent-Length: 100\r\n\r\n")

    with tcp_server(not_modified) as (url, _):
        (response,) = get(f"{url}/metrics")
    assert (response.status, response.body) == (304, b"")


def test_trailer_lines_under_the_cap_each_are_bounded_together() -> None:
    # Each line short of MAX_HEAD_BYTES, their sum past it: the trailers end the read.
    line = b"X-T: " + b"a" * 1000 + b"\r\n"
    many = line * (MAX_HEAD_BYTES // len(line) + 2)

    def trailers(connection: socket.socket, _number: int) -> None:
        read_request(connection)
        connection.sendall(
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nok\r\n0\r\n"
            + many
            + b"\r\n"
        )

    with tcp_server(trailers) as (url, _):
        error = failure_of(f"{url}/metrics")
    assert error.failure is Failure.MALFORMED
    assert f"trailers over {MAX_HEAD_BYTES} bytes" in str(error)


@pytest.mark.parametrize(("fields", "read"), [(100, True), (101, False)])
def test_at_most_a_hundred_trailer_fields_are_read(fields: int, read: bool) -> None:
    # As a head's fields and the etcd client's trailers: 16,000 lines of three bytes fit
    # under MAX_HEAD_BYTES, and each was read on its own.
    def trailers(connection: socket.socket, _number: int) -> None:
        read_request(connection)
        connection.sendall(
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nok\r\n0\r\n"
            + b"a:\r\n" * fields
            + b"\r\n"
        )

    with tcp_server(trailers) as (url, _):
        if read:
            (response,) = get(f"{url}/metrics")
            assert response.body == b"ok"
        else:
            error = failure_of(f"{url}/metrics")
            assert error.failure is Failure.MALFORMED
            assert "more than 100 trailer fields" in str(error)


@pytest.mark.parametrize(
    "head",
    [
        b"SMTP ready\r\n\r\n",
        b"HTTP/1.1 2x0 OK\r\n\r\n",
        b"HTTP/1.1 \xb200 OK\r\n\r\n",  # "\xb2" is "\u00b2" in latin-1: isdigit(), not int()
        b"HTTP/1.1 200 OK\r\nno colon here\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nContent-Length : 2\r\n\r\nok",  # RFC 9112 5.1: no space
        b"HTTP/1.1 200 OK\r\nContent-Length: 5, 6\r\n\r\nhello",
        b"HTTP/1.1 200 OK\r\nContent-Length: -5\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
        # A chunk longer than its size says: its data does not end with the CRLF.
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nokXY0\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nX-Big: " + b"a" * MAX_HEAD_BYTES + b"\r\n\r\n",
        b"HTTP/1.1 2000 OK\r\nContent-Length: 0\r\n\r\n",  # was read as 200
        b"HTTP/1.1 099 Low\r\nContent-Length: 0\r\n\r\n",  # below 100: no status at all
        # A chunk-size or trailer line past the head's cap: was "closed before an answer".
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n1;" + b"x" * MAX_HEAD_BYTES,
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n0\r\nX: " + b"a" * MAX_HEAD_BYTES,
    ],
)
def test_answers_that_are_not_http_as_framed_are_malformed(head: bytes) -> None:
    def send(connection: socket.socket, _number: int) -> None:
        read_request(connection)
        connection.sendall(head)

    with tcp_server(send) as (url, _):
        error = failure_of(f"{url}/metrics")
    assert error.failure is Failure.MALFORMED


def test_the_query_is_sent_with_the_path() -> None:
    def answer(connection: socket.socket, _number: int) -> None:
        read_request(connection)
        connection.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")

    with tcp_server(answer) as (url, received):
        get(f"{url}/metrics?name=vllm&x=1")
    assert b"".join(received).startswith(b"GET /metrics?name=vllm&x=1 HTTP/1.1\r\n")


def test_environment_proxies_are_never_used(monkeypatch: pytest.MonkeyPatch) -> None:
    def answer(connection: socket.socket, _number: int) -> None:
        read_request(connection)
        connection.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 6\r\n\r\ndirect")

    for name in ("HTTP_PROXY", "http_proxy", "ALL_PROXY"):
        monkeypatch.setenv(name, "http://127.0.0.1:9")  # the discard port: nothing there
    with tcp_server(answer) as (url, _):
        (response,) = get(f"{url}/metrics")
    assert response.body == b"direct"


def test_a_deadline_before_the_connection_says_so_after_it_says_answer() -> None:
    def hold(connection: socket.socket, _number: int) -> None:
        read_request(connection)
        connection.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nabc")
        connection.recv(1)  # held until the client gives up

    with tcp_server(hold) as (url, _):
        error = timed_out_read(f"{url}/metrics", None)
    assert (error.failure, error.received) == (Failure.ANSWER_TIMEOUT, 3)


def test_a_post_sends_its_json_body_with_its_length_and_the_headers_given() -> None:
    def answer(connection: socket.socket, _number: int) -> None:
        body = read_request(connection).partition(b"\r\n\r\n")[2]
        while len(body) < 10:
            body += connection.recv(65536)
        connection.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}")

    async def post(url: str) -> WireResponse:
        connection = Connection(None, "llmhealth/test")
        loop = asyncio.get_running_loop()
        try:
            return await connection.request(
                "POST",
                url,
                deadline=loop.time() + 5,
                max_bytes=100,
                body=b'{"a":"\xc3\xa9"}',
                headers={"Authorization": "Bearer k"},
            )
        finally:
            await connection.aclose()

    with tcp_server(answer) as (url, received):
        response = asyncio.run(post(f"{url}/v1/completions"))
    sent = b"".join(received)
    assert sent.startswith(b"POST /v1/completions HTTP/1.1\r\n")
    assert b"\r\nContent-Type: application/json\r\nContent-Length: 10\r\n" in sent
    assert b"\r\nAuthorization: Bearer k\r\n\r\n" in sent
    assert sent.endswith(b'\r\n\r\n{"a":"\xc3\xa9"}')
    assert response.body == b"{}"


def test_a_header_that_would_end_its_line_early_is_refused_before_sending() -> None:
    async def send(url: str) -> None:
        connection = Connection(None, "llmhealth/test")
        loop = asyncio.get_running_loop()
        try:
            await connection.request(
                "GET",
                url,
                deadline=loop.time() + 5,
                max_bytes=100,
                headers={"Authorization": "Bearer k\r\nX-Forged: 1"},
            )
        finally:
            await connection.aclose()

    with (
        tcp_server(lambda _connection, _number: None) as (url, received),
        pytest.raises(ValueError, match="control characters"),
    ):
        asyncio.run(send(f"{url}/v1/models"))
    assert received == []


def _read_while_blocked(url: str, budget: float, blocked: float) -> WireResponse | WireError:
    """A GET with ``budget`` seconds, during which this event loop is held for ``blocked``
    seconds by a synchronous call, as a host with more work than cores holds it."""

    async def run() -> WireResponse | WireError:
        connection = Connection(None, "llmhealth/test")
        loop = asyncio.get_running_loop()
        # Held from the request's first wait on: the connection and the answer are made
        # by the kernel and the server while nothing in this process can see them.
        loop.call_soon(time.sleep, blocked)
        try:
            return await connection.request(
                "GET", url, deadline=loop.time() + budget, max_bytes=100
            )
        except WireError as error:
            return error
        finally:
            await connection.aclose()

    return asyncio.run(run())


def _answer_at_once(connection: socket.socket, _number: int) -> None:
    read_request(connection)
    connection.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")


def test_time_the_checker_could_not_run_is_not_counted_against_the_server() -> None:
    """The answer was there before the deadline; only this process was late to read it.

    It used to be a timeout (UNRESPONSIVE or DOWN): at 3,000 backends on a loaded host,
    hundreds of busy backends were judged down for llmhealth's own lateness.
    """
    with tcp_server(_answer_at_once) as (url, _):
        outcome = _read_while_blocked(f"{url}/metrics", budget=0.5, blocked=1.0)
    assert isinstance(outcome, WireResponse), outcome
    assert (outcome.status, outcome.body) == (200, b"ok")


@pytest.mark.slow
def test_a_checker_held_longer_than_the_read_allows_says_so_instead_of_blaming_the_server() -> None:
    with tcp_server(_answer_at_once) as (url, _):
        outcome = _read_while_blocked(f"{url}/metrics", budget=0.2, blocked=1.5)
    assert isinstance(outcome, WireError)
    assert outcome.failure is Failure.STARVED
    assert "could not run" in outcome.detail


@pytest.mark.slow
def test_a_server_that_gave_up_on_a_held_up_checker_is_not_blamed_for_closing() -> None:
    """A server closes a connection that sends it nothing for a while (uvicorn: 5 s);
    when that silence was this process being held up, the close says nothing about the
    server: the read is not judged, where it used to make the backend `down`."""

    def give_up(connection: socket.socket, _number: int) -> None:
        time.sleep(0.3)  # no request yet: this server's idle timeout, shortened

    with tcp_server(give_up) as (url, _):
        outcome = _read_while_blocked(f"{url}/metrics", budget=5.0, blocked=1.5)
    assert isinstance(outcome, WireError)
    assert outcome.failure is Failure.STARVED
    assert "closed the connection" in outcome.detail


@pytest.mark.slow
def test_a_server_that_began_its_answer_and_closed_is_blamed_however_held_up_the_checker() -> None:
    """Any byte of the answer says the server took the request: a close after it is the
    server's failure, not an idle timeout our silence caused, however late this process
    ran meanwhile."""

    def half_a_head(connection: socket.socket, _number: int) -> None:
        read_request(connection)
        connection.sendall(b"HTTP/1.1 500 Internal Serv")  # and the process is gone

    with tcp_server(half_a_head) as (url, _):
        outcome = _read_while_blocked(f"{url}/metrics", budget=5.0, blocked=1.5)
    assert isinstance(outcome, WireError)
    assert outcome.failure is Failure.CLOSED


def _read_both(first: str, second: str, budgets: tuple[float, float]) -> list[object]:
    """GET ``first``, then (once its request is out) ``second``, in one event loop; each
    outcome (a response or a WireError) in the order they finished."""

    async def run() -> list[object]:
        loop = asyncio.get_running_loop()
        finished: list[object] = []

        async def one(url: str, budget: float) -> None:
            connection = Connection(None, "llmhealth/test")
            try:
                finished.append(
                    await connection.request(
                        "GET", url, deadline=loop.time() + budget, max_bytes=100
                    )
                )
            except WireError as error:
                finished.append(error)
            finally:
                await connection.aclose()

        started = asyncio.create_task(one(first, budgets[0]))
        await asyncio.sleep(0.1)
        await one(second, budgets[1])
        await started
        return finished

    return asyncio.run(run())


def _behind_a_slow_body(pause: float) -> list[object]:
    """One body read at a time: a quick answer (0.3 s budget) that came while a slow body
    (its last bytes ``pause`` seconds late) was being read; both outcomes."""

    def dribble(connection: socket.socket, _number: int) -> None:
        read_request(connection)
        connection.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 4\r\n\r\nsl")
        time.sleep(pause)
        connection.sendall(b"ow")

    with tcp_server(dribble) as (slow, _), tcp_server(_answer_at_once) as (quick, _):
        return _read_both(f"{slow}/metrics", f"{quick}/metrics", (5.0, 0.3))


def test_bodies_beyond_the_gate_wait_and_their_wait_is_not_the_servers(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """One body at a time: an answer that came while another body was arriving waits
    (in the kernel) for it, longer than its own budget, and is still read, not blamed."""
    monkeypatch.setattr(wire, "BODIES_AT_ONCE", 1)
    outcome = _behind_a_slow_body(0.6)
    assert [(o.status, o.body) for o in outcome if isinstance(o, WireResponse)] == [
        (200, b"slow"),
        (200, b"ok"),
    ]


@pytest.mark.slow
def test_an_answer_held_at_the_gate_past_its_grace_says_so_not_that_the_host_was_busy(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Cut off behind a slow body, a healthy server's read said "llmhealth's own process
    # could not run (an overloaded host)", sending the operator to the wrong machine.
    monkeypatch.setattr(wire, "BODIES_AT_ONCE", 1)
    (held,) = [o for o in _behind_a_slow_body(2.0) if isinstance(o, WireError)]
    assert held.failure is Failure.STARVED
    assert "to be read behind 1 slower answers" in held.detail
    assert "overloaded host" not in held.detail


def test_a_server_that_has_not_answered_holds_no_place_at_the_gate(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(wire, "BODIES_AT_ONCE", 1)

    def silent(connection: socket.socket, _number: int) -> None:
        read_request(connection)
        time.sleep(1.0)

    with tcp_server(silent) as (hung, _), tcp_server(_answer_at_once) as (quick, _):
        outcome = _read_both(f"{hung}/metrics", f"{quick}/metrics", (0.5, 5.0))
    assert isinstance(outcome[0], WireResponse)
    assert outcome[0].body == b"ok"
    assert isinstance(outcome[1], WireError)
    assert outcome[1].failure is Failure.ANSWER_TIMEOUT


def _freed_without_the_collector(steps: Callable[[Connection, str], Any], url: str) -> bool:
    """Runs ``steps`` with the cyclic collector off, on asyncio's own loop (uvloop's
    transports are another matter); whether what it returned a weak reference to was
    freed by the time the connection closed and the loop turned a few times."""

    async def run() -> weakref.ref[object]:
        connection = Connection(None, "llmhealth/test")
        try:
            gone = await steps(connection, url)
        finally:
            await connection.aclose()
        for _ in range(3):  # the transport's connection_lost, scheduled by close()
            await asyncio.sleep(0)
        return gone  # type: ignore[no-any-return]

    gc.collect()
    gc.disable()
    try:
        return asyncio.run(run())() is None
    finally:
        gc.enable()


def test_a_connection_it_closes_is_freed_when_dropped_not_left_to_the_collector() -> None:
    # A backend that closes idle connections after the wait costs one per read.
    async def read_once(connection: Connection, url: str) -> weakref.ref[object]:
        loop = asyncio.get_running_loop()
        await connection.request("GET", url, deadline=loop.time() + 5, max_bytes=1 << 20)
        assert connection._writer is not None
        return weakref.ref(connection._writer.transport)

    with tcp_server(_answer_at_once) as (url, _):
        assert _freed_without_the_collector(read_once, f"{url}/metrics")


def test_a_reset_stale_connection_is_freed_when_the_request_is_sent_again() -> None:
    connections = []

    def answer_then_reset(connection: socket.socket, number: int) -> None:
        connections.append(number)
        read_request(connection)
        connection.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
        if number == 0:
            # Closed with the next request unread: the kernel resets the connection, as
            # when a request crosses a server's idle close on the wire.
            connection.recv(1, socket.MSG_PEEK)
            connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))

    async def read_twice(connection: Connection, url: str) -> weakref.ref[object]:
        loop = asyncio.get_running_loop()
        await connection.request("GET", url, deadline=loop.time() + 5, max_bytes=1 << 20)
        first = weakref.ref(connection._reader)
        second = await connection.request("GET", url, deadline=loop.time() + 5, max_bytes=1 << 20)
        assert second.body == b"ok"
        return first

    with tcp_server(answer_then_reset) as (url, _):
        assert _freed_without_the_collector(read_twice, f"{url}/metrics")
    assert connections == [0, 1]  # the second request sent again on a new connection


# --- TLS ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def certificate(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A self-signed certificate for 127.0.0.1."""
    return make_certificate(tmp_path_factory.mktemp("tls"))


def _client_sockets_to(port: int) -> int:
    """This machine's TCP connections towards ``port`` that neither end has begun to
    close (ESTABLISHED): a socket closed on our side is in FIN-WAIT or gone."""
    count = 0
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        remote_port = int(fields[2].rsplit(":", 1)[1], 16)
        if remote_port == port and fields[3] == "01":
            count += 1
    return count


def test_a_stalled_tls_handshake_is_connected_not_unreachable() -> None:
    # The handshake was part of connecting: a server that accepted and never answered it
    # read "no TCP connection (no route?)" and `down`, not `unresponsive`.
    def accepts_and_says_nothing(connection: socket.socket, _number: int) -> None:
        connection.recv(65536)  # the client's hello arrives; the answer never comes
        connection.recv(1)  # held open until the client gives up

    with tcp_server(accepts_and_says_nothing) as (url, _):
        error = timed_out_read(url.replace("http:", "https:"), ssl.create_default_context())
    assert (error.failure, error.detail) == (Failure.ANSWER_TIMEOUT, "the TLS handshake not done")


def test_a_tls_handshake_stalled_past_asyncios_own_limit_is_unresponsive_not_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # asyncio ends a handshake after 60 s of its own: a read given longer (a timeout past a
    # minute, a tiny request's grown one) read the same stall as "TLS handshake failed:
    # SSL handshake is taking longer than 60.0 seconds", `down`. Its limit is made shorter
    # than the read's here, as 60 s is shorter than such a read.
    monkeypatch.setattr(asyncio.constants, "SSL_HANDSHAKE_TIMEOUT", 0.1)

    def accepts_and_says_nothing(connection: socket.socket, _number: int) -> None:
        connection.recv(65536)
        connection.recv(1)

    with tcp_server(accepts_and_says_nothing) as (url, _):
        error = timed_out_read(url.replace("http:", "https:"), ssl.create_default_context())
    assert (error.failure, error.detail) == (Failure.ANSWER_TIMEOUT, "the TLS handshake not done")


def test_an_ipv6_address_with_its_zone_as_a_url_writes_it_is_an_address_not_a_name(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # "http://[fe80::1%25eth0]:8000" is how RFC 6874 (and the config's check) writes a
    # zone; it went to the resolver as "fe80::1%25eth0", which names no interface, and a
    # healthy backend read "name does not resolve": `down`, every time. fe80::1 is on no
    # interface here: the connection fails at once, on this host, but as an address.
    monkeypatch.delenv("LLMHEALTH_LOOP", raising=False)  # asyncio's: it says so at once
    error = failure_of("http://[fe80::1%25lo]:9/metrics")
    assert error.failure is Failure.CONNECT_FAILED
    assert not isinstance(error.__cause__, socket.gaierror), error.__cause__


def test_a_tls_connection_given_up_on_is_closed_at_once(certificate: tuple[Path, Path]) -> None:
    # TLS's polite close waited 30 s for the peer's goodbye with the socket open: a hung
    # TLS backend per read used up the file descriptors, then healthy ones read `down`.
    cert, key = certificate
    server_side = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server_side.load_cert_chain(cert, key)
    done = threading.Event()

    def reads_and_hangs(connection: socket.socket, _number: int) -> None:
        with server_side.wrap_socket(connection, server_side=True) as tls:
            read_request(tls)
            done.wait(10)  # never answers, never says goodbye, holds its end open

    client_side = ssl.create_default_context(cafile=str(cert))
    with tcp_server(reads_and_hangs) as (url, _):
        port = int(url.rsplit(":", 1)[1])
        try:
            error = timed_out_read(url.replace("http:", "https:"), client_side)
            assert error.failure is Failure.ANSWER_TIMEOUT
            assert error.detail == "no complete HTTP answer"
            gone = time.monotonic() + 5  # a bound, far below the 30 s it was held
            while _client_sockets_to(port) and time.monotonic() < gone:
                time.sleep(0.05)
            assert _client_sockets_to(port) == 0
        finally:
            done.set()


def test_a_tls_close_cancelled_while_it_waits_for_the_goodbye_still_closes_the_socket(
    certificate: tuple[Path, Path],
) -> None:
    # The close waits up to 0.1 s for the peer's goodbye, then aborts; cancelled in that
    # wait (a caller's shutdown cancelling the task closing its clients), the abort was
    # skipped and the socket held for asyncio's 30 s goodbye, the descriptor with it.
    cert, key = certificate
    server_side = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server_side.load_cert_chain(cert, key)
    done = threading.Event()

    def answers_then_holds(connection: socket.socket, _number: int) -> None:
        with server_side.wrap_socket(connection, server_side=True) as tls:
            read_request(tls)
            tls.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
            done.wait(10)  # never says goodbye, holds its end open

    async def read_then_cancel_the_close(url: str) -> None:
        connection = Connection(ssl.create_default_context(cafile=str(cert)), "llmhealth/test")
        loop = asyncio.get_running_loop()
        await connection.request("GET", url, deadline=loop.time() + 5, max_bytes=99)
        closing = asyncio.create_task(connection.aclose())
        await asyncio.sleep(0)  # the close is under way: waiting for the goodbye
        closing.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await closing

    with tcp_server(answers_then_holds) as (url, _):
        port = int(url.rsplit(":", 1)[1])
        try:
            eventloop.run(read_then_cancel_the_close(url.replace("http:", "https:")))
            gone = time.monotonic() + 5  # a bound, far below the 30 s it was held
            while _client_sockets_to(port) and time.monotonic() < gone:
                time.sleep(0.05)
            assert _client_sockets_to(port) == 0
        finally:
            done.set()


# A child process's start at its descriptor limit (after its own imports, which open
# files): its resolver thread started, as a daemon's is, then every descriptor under a
# limit of 64 taken and kept in ``held``.
OUT_OF_DESCRIPTORS = """
import asyncio, resource, socket
loop = asyncio.new_event_loop()
"warm".encode("idna")  # imported on first use: a file to open
loop.run_until_complete(loop.getaddrinfo("127.0.0.1", 9))  # the resolver thread, as a daemon has
resource.setrlimit(resource.RLIMIT_NOFILE, (64, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
held = []
while True:
    try:
        held.append(open("/dev/null"))
    except OSError:
        break
"""
# ...and one of them freed as each lookup ends, as another connection closing would.
FREED_AFTER_EACH_LOOKUP = """
real = socket.getaddrinfo
def getaddrinfo(*args, **kwargs):
    try:
        return real(*args, **kwargs)  # the resolver, out of descriptors
    finally:
        held.pop().close()  # another read's connection closed meanwhile
socket.getaddrinfo = getaddrinfo
"""


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost"])
def test_no_file_descriptor_left_is_the_checkers_problem_not_the_servers(host: str) -> None:
    # EMFILE from our own socket() read as the server's: `down`, and a restart if asked.
    # By name, the resolver fails first, and says only "Name or service not known".
    script = (
        "from llmhealth import wire\n"
        + OUT_OF_DESCRIPTORS
        + """
async def read():
    connection = wire.Connection(None, "llmhealth/test")
    try:
        await connection.request("GET", "http://HOST:9/metrics",
                                 deadline=loop.time() + 5, max_bytes=100)
    except wire.WireError as error:
        print(error.failure.value, error.detail)
loop.run_until_complete(read())
"""
    )
    done = subprocess.run(
        [sys.executable, "-c", script.replace("HOST", host)],
        capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    assert done.stdout.startswith("starved llmhealth's own process could not open a connection")


def test_a_name_not_found_for_want_of_descriptors_freed_since_is_looked_up_again() -> None:
    # At the limit, another read's connection closed between the failed lookup and the
    # loop's asking whether it was short: the healthy server behind the name was `down`
    # ("Name or service not known"), as if its name did not resolve.
    script = (
        "from llmhealth import wire\n"
        + OUT_OF_DESCRIPTORS
        + FREED_AFTER_EACH_LOOKUP
        + """
async def read():
    connection = wire.Connection(None, "llmhealth/test")
    try:
        answer = await connection.request("GET", "URL/metrics",
                                          deadline=loop.time() + 5, max_bytes=100)
        print("answered", answer.status)
    except wire.WireError as error:
        print(error.failure.value, error.detail)
loop.run_until_complete(read())
"""
    )

    def answer(connection: socket.socket, _number: int) -> None:
        read_request(connection)
        connection.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")

    with tcp_server(answer) as (url, _):
        by_name = url.replace("127.0.0.1", "localhost")
        done = subprocess.run(
            [sys.executable, "-c", script.replace("URL", by_name)],
            capture_output=True, text=True, timeout=60, check=True,
        )  # fmt: skip
    assert done.stdout == "answered 200\n", done.stdout


_READ_TWICE = """
import asyncio
from llmhealth import wire
loop = asyncio.new_event_loop()
leave(1)  # the connection's socket
async def read():
    connection = wire.Connection(None, "llmhealth/test")
    try:
        answer = await connection.request("GET", "URL", deadline=loop.time() + 5, max_bytes=100)
        print("answered", answer.status)
    except wire.WireError as error:
        print(error.failure.value, error.detail)
    finally:
        await connection.aclose()
loop.run_until_complete(read())
give_back()
loop.run_until_complete(read())  # the descriptors back: the context in use is whole
"""


@pytest.mark.parametrize("trusted_in", ["a CA file", "a CA directory"])
def test_a_tls_read_with_one_descriptor_left_is_not_judged_for_its_trust_store(
    certificate: tuple[Path, Path], tmp_path: Path, trusted_in: str
) -> None:
    # The default TLS context was built after the socket took the last descriptor: the
    # CA file could not be read, the context trusted no one, and, kept for the process,
    # it judged every https backend `down` ("certificate verify failed") from then on.
    # A CA directory is read at the handshake: the same want failed that one read.
    with tls_server(*certificate) as port:
        first, second = run_child(
            _READ_TWICE.replace("URL", f"https://127.0.0.1:{port}/"),
            environment=trusting(certificate[0], tmp_path, trusted_in),
        )
    # Never the server's failure: not judged while short, answered once it is not.
    assert first == "answered 200" or first.startswith("starved "), first
    assert second == "answered 200"


def test_a_certificate_for_another_name_is_judged_however_short_the_process_is(
    tmp_path: Path,
) -> None:
    # Only a chain without its issuer can come of a CA directory not read: a name that
    # does not match is the server's, and still fails the read.
    cert, key = make_certificate(tmp_path, "elsewhere.invalid")
    with tls_server(cert, key) as port:
        first, second = run_child(
            _READ_TWICE.replace("URL", f"https://127.0.0.1:{port}/"),
            environment=trusting(cert, tmp_path, "a CA file"),
        )
    assert first.startswith("connect_failed ") and "mismatch" in first, first
    assert second.startswith("connect_failed ") and "mismatch" in second, second


def test_a_post_after_a_get_whose_server_closed_silently_is_not_a_failure() -> None:
    # An HTTP/1.1 server may close a connection after any answer without saying so
    # (RFC 9112 9.6); the close was on the wire before the POST was written.
    def one_answer_per_connection(connection: socket.socket, number: int) -> None:
        request = read_request(connection)
        body = b'{"choices":[{"text":"!"}]}' if request.startswith(b"POST") else b"{}"
        # Corked: the answer and its FIN leave in one segment, as one process's send
        # and close do on a network, whatever this process's threads do between them.
        connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_CORK, 1)
        connection.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
        connection.shutdown(socket.SHUT_WR)
        connection.recv(1)  # until the client closes

    async def run(url: str) -> WireResponse | WireError:
        connection = Connection(None, "llmhealth/test")
        loop = asyncio.get_running_loop()
        try:
            await connection.request(
                "GET", f"{url}/v1/models", deadline=loop.time() + 5, max_bytes=100
            )
            try:
                return await connection.request(
                    "POST",
                    f"{url}/v1/completions",
                    deadline=loop.time() + 5,
                    max_bytes=100,
                    body=b"{}",
                )
            except WireError as error:
                return error
        finally:
            await connection.aclose()

    with tcp_server(one_answer_per_connection) as (url, _):
        outcome = eventloop.run(run(url))
    assert isinstance(outcome, WireResponse), outcome


def test_a_body_of_one_byte_chunks_is_refused_by_its_framing_not_timed_out() -> None:
    # 16 MiB of "1\r\nx\r\n": within the byte cap, 2.8 million chunks. Read one await
    # each, it cost this process ~4 s of CPU (a plain 16 MiB body: ~10 ms), and a read
    # given 2 s blamed the server: "connected, but no complete HTTP answer".
    chunks = 16 * 1024 * 1024 // 6
    answer = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + b"1\r\nx\r\n" * chunks

    def tiny_chunks(connection: socket.socket, number: int) -> None:
        read_request(connection)
        connection.sendall(answer + b"0\r\n\r\n")

    async def run(url: str) -> WireError | WireResponse:
        connection = Connection(None, "llmhealth/test")
        loop = asyncio.get_running_loop()
        try:
            return await connection.request(
                "GET", url, deadline=loop.time() + 2, max_bytes=16 * 1024 * 1024
            )
        except WireError as error:
            return error
        finally:
            await connection.aclose()

    with tcp_server(tiny_chunks) as (url, _):
        outcome = eventloop.run(run(url))
    assert isinstance(outcome, WireError), outcome
    assert outcome.failure is Failure.TOO_BIG, (outcome.failure, outcome.detail)


@pytest.mark.slow
@pytest.mark.parametrize("reset", [False, True])
def test_a_server_that_closes_at_once_is_closed_whatever_its_name_took_to_look_up(
    monkeypatch: pytest.MonkeyPatch, reset: bool
) -> None:
    """The close before any answer was forgiven as this process's when the read had been
    held up for more than a second since it began, the name's lookup included: a dead
    backend behind a port forwarder (docker-proxy, kube-proxy: accepted, then closed)
    read "not judged, an overloaded host" for as long as its lookups took that long (a
    hundred backends by name queue in asyncio's few lookup threads), never `down`. The
    lookup ends before the connection is made: no server can have given up on it."""

    def close_at_once(connection: socket.socket, _number: int) -> None:
        time.sleep(0.2)  # the connection made on both sides, no request read
        if reset:
            connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))

    with tcp_server(close_at_once) as (url, _):
        port = int(url.rsplit(":", 1)[1])
        found = [(socket.AF_INET, socket.SOCK_STREAM, 6, "", ("127.0.0.1", port))]
        _name_for(monkeypatch, "slow.test", found, 1.2)

        async def run() -> WireError:
            connection = Connection(None, "llmhealth/test")
            loop = asyncio.get_running_loop()
            try:
                await connection.request(
                    "GET", f"http://slow.test:{port}/", deadline=loop.time() + 1.0, max_bytes=100
                )
            except WireError as error:
                return error
            finally:
                await connection.aclose()
            raise AssertionError("answered")

        error = eventloop.run(run())
    assert error.failure is Failure.CLOSED, error.detail


@pytest.mark.slow
def test_a_server_that_closes_at_once_is_closed_whatever_the_loop_ran_late_in_the_lookup(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # As above, the loop held up while the name was looked up: the connection did not
    # exist then, so no server can have given up on it for this process's silence.
    def close_at_once(connection: socket.socket, _number: int) -> None:
        time.sleep(0.2)  # the connection made on both sides, no request read

    with tcp_server(close_at_once) as (url, _):
        port = int(url.rsplit(":", 1)[1])
        found = [(socket.AF_INET, socket.SOCK_STREAM, 6, "", ("127.0.0.1", port))]
        _name_for(monkeypatch, "held.test", found, 0.0)

        async def run() -> WireError:
            connection = Connection(None, "llmhealth/test")
            loop = asyncio.get_running_loop()
            loop.call_soon(time.sleep, 1.5)  # while the lookup is under way
            try:
                await connection.request(
                    "GET", f"http://held.test:{port}/", deadline=loop.time() + 5.0, max_bytes=100
                )
            except WireError as error:
                return error
            finally:
                await connection.aclose()
            raise AssertionError("answered")

        error = asyncio.run(run())
    assert error.failure is Failure.CLOSED, error.detail


def test_a_connection_shut_while_its_name_is_looked_up_sends_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Its owner done with it (a check ended, a target removed): the connection made after
    # the lookup is closed, not kept, and the server never sees the request.
    with tcp_server(_answer_at_once) as (url, received):
        port = int(url.rsplit(":", 1)[1])
        found = [(socket.AF_INET, socket.SOCK_STREAM, 6, "", ("127.0.0.1", port))]
        _name_for(monkeypatch, "shut.test", found, 0.5)

        async def run() -> WireResponse | WireError:
            connection = Connection(None, "llmhealth/test")
            loop = asyncio.get_running_loop()
            read = asyncio.create_task(
                connection.request(
                    "GET", f"http://shut.test:{port}/", deadline=loop.time() + 5.0, max_bytes=100
                )
            )
            await asyncio.sleep(0.1)  # the lookup under way
            await connection.shut()
            try:
                return await read
            except WireError as error:
                return error

        outcome = asyncio.run(run())
    assert isinstance(outcome, WireError) and outcome.failure is Failure.STARVED, outcome
    assert b"".join(received) == b""


@pytest.mark.parametrize("ended_by", ["a malformed answer", "a cancel"])
def test_a_tls_read_ended_just_before_its_deadline_leaves_no_error_behind(
    certificate: tuple[Path, Path], ended_by: str
) -> None:
    """A TLS connection's close waits up to 0.1 s for the server's goodbye, after the
    attempt's timeout has been left and before the deadline's timer is cancelled: a
    deadline falling in that wait rescheduled a timeout already left, and the event loop
    logged "Exception in callback _Deadline._at_deadline()" with a RuntimeError."""
    cert, key = certificate
    server_side = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server_side.load_cert_chain(cert, key)
    done = threading.Event()

    def answers_late_and_hangs(connection: socket.socket, _number: int) -> None:
        with server_side.wrap_socket(connection, server_side=True) as tls:
            read_request(tls)
            if ended_by == "a malformed answer":
                time.sleep(0.45)
                tls.sendall(b"NOT HTTP\r\n\r\n")
            done.wait(10)  # never says goodbye, holds its end open

    async def run(url: str) -> list[dict[str, Any]]:
        loop = asyncio.get_running_loop()
        errors: list[dict[str, Any]] = []
        loop.set_exception_handler(lambda _loop, context: errors.append(context))
        connection = Connection(ssl.create_default_context(cafile=str(cert)), "llmhealth/test")
        deadline = loop.time() + 0.5
        read = asyncio.create_task(connection.request("GET", url, deadline=deadline, max_bytes=100))
        if ended_by == "a cancel":
            loop.call_at(deadline - 0.05, read.cancel)
        with contextlib.suppress(WireError, asyncio.CancelledError):
            await read
        await asyncio.sleep(0.2)  # past the deadline and the close's wait
        await connection.aclose()
        return errors

    with tcp_server(answers_late_and_hangs) as (url, _):
        try:
            errors = asyncio.run(run(url.replace("http:", "https:") + "/metrics"))
        finally:
            done.set()
    assert errors == [], [context.get("exception") for context in errors]


@pytest.mark.slow
def test_a_tls_server_that_gave_up_on_a_held_up_checker_is_not_blamed_for_closing() -> None:
    """As over plain HTTP: a server gives up on a connection that says nothing (a TLS
    front's handshake timeout, Go's ReadHeaderTimeout); when the silence was this process
    held up, the close during the handshake says nothing about the server. It was
    "connect_failed" (`down`), never checked against the loop's lateness at all."""

    def give_up(connection: socket.socket, _number: int) -> None:
        time.sleep(0.3)  # no handshake yet: the front's timeout, shortened

    async def run(url: str) -> WireError:
        connection = Connection(ssl.create_default_context(), "llmhealth/test")
        loop = asyncio.get_running_loop()
        loop.call_soon(time.sleep, 1.5)  # held from the request's first wait on
        try:
            await connection.request("GET", url, deadline=loop.time() + 5.0, max_bytes=100)
        except WireError as error:
            return error
        finally:
            await connection.aclose()
        raise AssertionError("answered")

    with tcp_server(give_up) as (url, _):
        outcome = asyncio.run(run(url.replace("http:", "https:") + "/metrics"))
    assert outcome.failure is Failure.STARVED, (outcome.failure, outcome.detail)
    assert "closed the connection" in outcome.detail


@pytest.mark.usefixtures("each_loop")
@pytest.mark.parametrize("close_notify", [True, False], ids=["close_notify", "ragged"])
def test_a_tls_body_read_to_the_close_is_whole_only_after_close_notify(
    certificate: tuple[Path, Path], close_notify: bool
) -> None:
    # Over TLS the orderly end of a body framed by the connection's end is close_notify
    # (RFC 9112 9.8): a TCP end without it (a backend or its TLS front killed mid-body)
    # handed half a /metrics text on as the whole of it, read as if complete.
    cert, key = certificate
    server_side = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server_side.load_cert_chain(cert, key)
    text = b"vllm:num_requests_running 1\nvllm:num_requests_waiting 1"

    def cut(connection: socket.socket, _number: int) -> None:
        with server_side.wrap_socket(connection, server_side=True) as tls:
            read_request(tls)
            tls.sendall(b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\n" + text)
            if close_notify:
                tls.unwrap().shutdown(socket.SHUT_WR)
            else:
                tls.shutdown(socket.SHUT_WR)  # the TCP end alone: no close_notify
            with contextlib.suppress(OSError):
                while connection.recv(65536):
                    pass

    async def read(url: str) -> bytes:
        connection = Connection(ssl.create_default_context(cafile=str(cert)), "llmhealth/test")
        loop = asyncio.get_running_loop()
        try:
            response = await connection.request(
                "GET", url, deadline=loop.time() + 5, max_bytes=1 << 20
            )
        finally:
            await connection.aclose()
        return response.body

    with tcp_server(cut) as (plain, _):
        url = plain.replace("http:", "https:")
        if close_notify:
            assert eventloop.run(read(url)) == text
        else:
            with pytest.raises(WireError) as caught:
                eventloop.run(read(url))
            assert caught.value.failure is Failure.CLOSED


@pytest.mark.parametrize("host", ["127.0.0.1", "ports.test"])
def test_no_local_port_left_is_the_checkers_problem_not_the_servers(
    monkeypatch: pytest.MonkeyPatch, host: str
) -> None:
    # No local port left for one more connection (the ephemeral range in use, or in
    # TIME_WAIT towards the backend): the checker's own shortage, as EMFILE is, and the
    # router's since 31967f1; the probe judged the backend `down` for it ("connection
    # refused"), every backend at once in a burst. Injected where the kernel says it.
    with tcp_server(_answer_after(0.0)) as (url, _):
        port = int(url.rsplit(":", 1)[1])
        if host != "127.0.0.1":
            _name_for(
                monkeypatch,
                host,
                [(socket.AF_INET, socket.SOCK_STREAM, 6, "", ("127.0.0.1", port))],
                0.0,
            )
        real_connect = socket.socket.connect

        def connect(sock: socket.socket, address: Any) -> None:
            # TCP's connect alone: a UDP socket takes none of TCP's ports.
            if address == ("127.0.0.1", port) and sock.type == socket.SOCK_STREAM:
                raise OSError(errno.EADDRNOTAVAIL, os.strerror(errno.EADDRNOTAVAIL))
            real_connect(sock, address)

        monkeypatch.setattr(socket.socket, "connect", connect)
        error = failure_of(f"http://{host}:{port}/metrics")
    assert error.failure is Failure.STARVED, error.detail


@pytest.mark.usefixtures("each_loop")
def test_a_tls_answer_the_server_ends_with_close_notify_is_read(
    certificate: tuple[Path, Path],
) -> None:
    # A TLS server answering "Connection: close" and then saying goodbye in order (uvicorn
    # over TLS, nginx, Go): asyncio's TLS transport, already closed by that close_notify,
    # forgot its protocol on our close(), and the next get_extra_info raised
    # AttributeError: every read of the backend "not judged ... a bug in llmhealth".
    cert, key = certificate
    server_side = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server_side.load_cert_chain(cert, key)

    def answer_and_goodbye(connection: socket.socket, _number: int) -> None:
        with server_side.wrap_socket(connection, server_side=True) as tls:
            read_request(tls)
            tls.sendall(b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 2\r\n\r\nok")
            tls.unwrap().shutdown(socket.SHUT_WR)
            with contextlib.suppress(OSError):
                while connection.recv(65536):
                    pass

    async def read(url: str) -> bytes:
        connection = Connection(ssl.create_default_context(cafile=str(cert)), "llmhealth/test")
        loop = asyncio.get_running_loop()
        try:
            response = await connection.request("GET", url, deadline=loop.time() + 5, max_bytes=100)
        finally:
            await connection.aclose()
        return response.body

    with tcp_server(answer_and_goodbye) as (url, _):
        assert eventloop.run(read(url.replace("http:", "https:"))) == b"ok"


@pytest.mark.parametrize("host", ["[::1]", "dual.test"])
def test_a_server_this_host_has_no_address_to_send_to_is_judged_not_excused(
    monkeypatch: pytest.MonkeyPatch, host: str
) -> None:
    # EADDRNOTAVAIL also says this host has no source address towards the server: IPv6
    # turned off, as containers have it by default, and a name's ::1 (localhost's) or an
    # IPv6 server. Taken for a want of local ports, a dead server behind such a name (its
    # IPv4 address refused) was "not judged" at every read, never `down`. Injected as
    # the kernel says it then: at every connect to ::1, a UDP socket's too.
    with socket.create_server(("127.0.0.1", 0)) as unused:
        port = unused.getsockname()[1]  # nothing listens there now: refused
    _dual_stack(monkeypatch, port)
    real_connect = socket.socket.connect

    def connect(sock: socket.socket, address: Any) -> None:
        if address[0] == "::1":
            raise OSError(errno.EADDRNOTAVAIL, os.strerror(errno.EADDRNOTAVAIL))
        real_connect(sock, address)

    monkeypatch.setattr(socket.socket, "connect", connect)
    error = failure_of(f"http://{host}:{port}/metrics")
    assert error.failure is Failure.CONNECT_FAILED, error.detail
