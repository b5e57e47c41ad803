"""What the router holds for a request: a frozen backend's connection, a prompt, a method."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import socket
import ssl
import threading
import tracemalloc
from pathlib import Path

import pytest
from test_router import (
    BODY,
    BOUND,
    CHAT,
    client,
    drained,
    quiet,
    raw_backend,
    read_request,
    refused_url,
    routing,
    run,
)
from tlsproc import make_certificate

from llmhealth import eventloop, upstream
from llmhealth.config import Router as RouterConfig

TCP_ESTABLISHED = 1


def tcp_state(sock: socket.socket) -> int:
    """The kernel's TCP state of one socket (tcp_info's first byte)."""
    return sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 8)[0]


@pytest.mark.usefixtures("each_loop")
@pytest.mark.parametrize(
    "prompt_bytes",
    [
        # The rest waits in the router's transport: transport.close() waits for every
        # byte to be sent first, so socket and buffer stayed as long as the backend froze.
        pytest.param(12 << 20, id="past the kernel's buffers"),
        # The kernel's buffers take it all (the backend's receive and the router's
        # autotuned send buffer) and the transport's is empty: the orderly close let the
        # descriptor go at once, the 2 s reset was cancelled with it, and the kernel kept
        # the connection, and the prompt, while it probed the frozen backend's closed
        # window (minutes).
        pytest.param(512 << 10, id="within the kernel's buffers"),
    ],
)
def test_a_request_body_a_frozen_backend_never_read_does_not_keep_its_connection(
    prompt_bytes: int,
) -> None:
    # A frozen backend (its process stopped, its loop held) accepts the connection and
    # reads nothing. Once the router gives up on it (no headers in time), the connection
    # must end, whatever of the prompt is still unsent.
    accepted: list[socket.socket] = []
    done = asyncio.Event()

    async def frozen(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        accepted.append(writer.get_extra_info("socket"))
        writer.transport.pause_reading()  # reads nothing, as a stopped process
        await done.wait()
        writer.transport.abort()

    body = json.dumps({"model": "tiny", "prompt": "x" * prompt_bytes}).encode()
    settings = RouterConfig(connect_timeout=0.2, first_byte_timeout=0.5)

    async def scenario() -> None:
        async with (
            raw_backend(frozen) as url,
            routing({"a": url}, settings) as (router, base),
            client() as http,
        ):
            try:
                response = await http.post(base + CHAT, content=body)
                assert response.status_code == 500
                await quiet(router)
                (sock,) = accepted
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(BOUND):
                        while tcp_state(sock) == TCP_ESTABLISHED:
                            await asyncio.sleep(0.02)
                assert tcp_state(sock) != TCP_ESTABLISHED, "the router still holds it"
            finally:
                done.set()

    run(scenario())


def test_a_clients_method_reaches_the_ledger_bounded() -> None:
    # The method is the client's to choose: any token up to the 64 KiB head bound. A
    # backend refusing connections has every request that met it recorded with it, and
    # describe() is its last error in the state, the audit and (cluster) the etcd record,
    # where every other detail the router records is cut to 200 characters.
    method = "X" * 60_000

    async def scenario() -> None:
        async with (
            routing({"a": refused_url()}) as (router, base),
            client() as http,
        ):
            response = await http.request(method, base + CHAT, content=BODY)
            assert response.status_code == 500
            (outcome,) = (await drained(router))["a"]
        assert len(outcome.describe()) <= 1000, len(outcome.describe())
        assert len(str(outcome.to_dict())) <= 1000

    run(scenario())


def test_a_prompt_is_held_once_while_the_backend_generates() -> None:
    # The edge's bytearray beside the bytes made of it, and the request joined whole for
    # its one write, were two more copies of a prompt of up to max_body (16 MiB), held
    # for as long as a non-streamed generation takes (first_byte_timeout, 300 s).
    size = 8 << 20
    body = json.dumps({"model": "tiny", "prompt": "x" * size}).encode()
    generating = asyncio.Event()
    answered = asyncio.Event()

    async def slow(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        generating.set()
        await answered.wait()
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}")
        await writer.drain()
        writer.close()

    async def scenario() -> int:
        async with raw_backend(slow) as url, routing({"a": url}) as (_, base):
            port = int(base.rsplit(":", 1)[1])
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            gc.collect()
            tracemalloc.start()
            try:
                before, _ = tracemalloc.get_traced_memory()
                writer.write(
                    b"POST %s HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n"
                    % (CHAT.encode(), len(body))
                )
                writer.write(body)
                await writer.drain()
                await generating.wait()
                gc.collect()
                held = tracemalloc.get_traced_memory()[0] - before
            finally:
                tracemalloc.stop()
                answered.set()
            await reader.readuntil(b"{}")
            writer.close()
            return held

    held = eventloop.run(asyncio.wait_for(scenario(), 60))
    assert held < 1.5 * len(body), f"{held / len(body):.1f} copies of the body held"


@pytest.mark.slow
@pytest.mark.usefixtures("each_loop")
def test_a_request_a_frozen_tls_backend_never_read_does_not_keep_its_connection(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # As over plain TCP; a TLS transport's own buffer is empty here (all of it went on to
    # the socket's transport), so only an abort of the exchange given up on ends it.
    cert, key = make_certificate(tmp_path)
    server_side = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server_side.load_cert_chain(cert, key)
    trusted = ssl.create_default_context(cafile=str(cert))
    monkeypatch.setattr(upstream, "default_tls", lambda: trusted)
    listener = socket.create_server(("127.0.0.1", 0))
    accepted: list[ssl.SSLSocket] = []

    def frozen() -> None:  # a handshake, then nothing read: a process stopped after it
        with contextlib.suppress(OSError):
            connection, _ = listener.accept()
            accepted.append(server_side.wrap_socket(connection, server_side=True))

    thread = threading.Thread(target=frozen, daemon=True)
    thread.start()
    body = json.dumps({"model": "tiny", "prompt": "x" * (12 << 20)}).encode()
    settings = RouterConfig(connect_timeout=1.0, first_byte_timeout=1.5)
    url = f"https://127.0.0.1:{listener.getsockname()[1]}"

    async def scenario() -> None:
        async with routing({"a": url}, settings) as (router, base), client() as http:
            try:
                response = await http.post(base + CHAT, content=body)
                assert response.status_code == 500
                await quiet(router)
                (sock,) = accepted
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(BOUND):
                        while tcp_state(sock) == TCP_ESTABLISHED:
                            await asyncio.sleep(0.02)
                assert tcp_state(sock) != TCP_ESTABLISHED, "the router still holds it"
            finally:
                listener.close()
                for sock in accepted:
                    sock.close()  # unread bytes: a reset, which ends the router's side too

    run(scenario())
    thread.join(5)


TCP_CLOSE = 7  # the connection ended (a reset came): the kernel holds nothing of it


@pytest.mark.usefixtures("each_loop")
def test_a_body_refused_early_by_a_backend_that_then_froze_does_not_keep_its_connection() -> None:
    # A backend refuses the body at its head (a 413 whose body ends with the connection),
    # ends its side as RFC 9112 9.6 has it (the half of a close that lets the answer
    # arrive whole), then reads nothing.
    # The router's transport, closing on that end, waited to send the rest of the body
    # first: the router's own close of it, a no-op on a closing transport, reset nothing.
    accepted: list[socket.socket] = []
    done = asyncio.Event()

    async def refuses(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        accepted.append(writer.get_extra_info("socket"))
        await reader.readuntil(b"\r\n\r\n")
        writer.transport.pause_reading()  # reads nothing more, as a stopped process
        # Its body framed by the connection's end, as RFC 9112 6.3 allows.
        writer.write(b"HTTP/1.1 413 Too Large\r\nConnection: close\r\n\r\ntoo large")
        writer.write_eof()
        await done.wait()
        writer.transport.abort()

    body = json.dumps({"model": "tiny", "prompt": "x" * (12 << 20)}).encode()

    async def scenario() -> None:
        async with (
            raw_backend(refuses) as url,
            routing({"a": url}) as (router, base),
            client() as http,
        ):
            try:
                response = await http.post(base + CHAT, content=body)
                assert response.status_code == 413
                await quiet(router)
                (sock,) = accepted
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(BOUND):
                        while tcp_state(sock) != TCP_CLOSE:
                            await asyncio.sleep(0.02)
                assert tcp_state(sock) == TCP_CLOSE, "the router still holds it"
            finally:
                done.set()

    run(scenario())


@pytest.mark.usefixtures("each_loop")
def test_a_whole_tls_answer_ended_by_its_backend_is_not_reset(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A TLS backend answers in full and ends the connection as TLS has it: close_notify
    # (an answer with "Connection: close", or one framed by its end). The router's
    # close_notify in return is on its way, not yet acknowledged, when it closes its
    # side: a healthy exchange, which must end in order, never with a reset.
    cert, key = make_certificate(tmp_path)
    server_side = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server_side.load_cert_chain(cert, key)
    trusted = ssl.create_default_context(cafile=str(cert))
    monkeypatch.setattr(upstream, "default_tls", lambda: trusted)
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(BOUND)
    seen: list[str] = []

    def answers() -> None:
        incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
        tls = server_side.wrap_bio(incoming, outgoing, server_side=True)

        def more(connection: socket.socket) -> None:
            connection.sendall(outgoing.read())
            data = connection.recv(65536)
            if not data:
                raise ConnectionError("closed before the answer")
            incoming.write(data)

        try:
            connection, _ = listener.accept()
        except OSError as exc:
            seen.append(repr(exc))
            return
        with connection:
            connection.settimeout(BOUND)
            try:
                while True:
                    try:
                        tls.do_handshake()
                        break
                    except ssl.SSLWantReadError:
                        more(connection)
                request = b""
                while not request.endswith(b"}"):  # BODY, whole
                    try:
                        request += tls.read(65536)
                    except ssl.SSLWantReadError:
                        more(connection)
                tls.write(b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\n{}")
                with contextlib.suppress(ssl.SSLWantReadError):
                    tls.unwrap()  # close_notify: sent with the answer, in one segment
                connection.sendall(outgoing.read())
                while connection.recv(65536):  # the router's close_notify, then its end
                    pass
                seen.append("eof")
            except OSError as exc:
                seen.append(repr(exc))

    thread = threading.Thread(target=answers, daemon=True)
    thread.start()
    url = f"https://127.0.0.1:{listener.getsockname()[1]}"

    async def scenario() -> None:
        async with routing({"a": url}) as (router, base), client() as http:
            response = await http.post(base + CHAT, content=BODY)
            assert (response.status_code, response.content) == (200, b"{}")
            assert [o.ok for o in (await drained(router))["a"]] == [True]

    try:
        run(scenario())
        thread.join(BOUND)
    finally:
        listener.close()
    assert seen == ["eof"]
