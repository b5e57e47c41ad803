"""etcd's wire against misbehaving raw sockets on 127.0.0.1, and a real etcd beside them.

What is under test is that every answer ends on time and within its size, as an error
that names the endpoint and lets the next one answer: a drip-feeding, endless, huge,
deeply nested or garbled answer never holds a settle, a verb or the elector's thread.
The whole-exchange bound is a value the tests set small; no test times anything.
"""

from __future__ import annotations

import base64
import json
import socket
import threading
import time
from collections.abc import Callable, Iterator

import pytest

from llmhealth import etcd_http
from llmhealth.cluster import ClusterUnavailableError, Etcd
from llmhealth.etcd_http import Bounds, Endpoint, EndpointError, post
from tests.etcdproc import EtcdCluster, running_etcd
from tests.test_wire import read_request, tcp_server

DRIP_FOR = 20.0  # a dripping server gives up by itself after this long


@pytest.fixture(scope="module")
def etcd_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EtcdCluster]:
    with running_etcd(tmp_path_factory.mktemp("etcd")) as cluster:
        yield cluster


def answering(head: bytes, body: bytes = b"") -> Callable[[socket.socket, int], None]:
    def answer(connection: socket.socket, _: int) -> None:
        read_request(connection)
        connection.sendall(head + body)

    return answer


def json_answer(value: object) -> Callable[[socket.socket, int], None]:
    body = json.dumps(value).encode()
    return answering(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(body), body)


def dripping(prefix: bytes) -> Callable[[socket.socket, int], None]:
    """``prefix`` at once, then one byte of a never-ending body every 20 ms."""

    def drip(connection: socket.socket, _: int) -> None:
        read_request(connection)
        connection.sendall(prefix)
        stop_at = time.monotonic() + DRIP_FOR
        while time.monotonic() < stop_at:
            connection.sendall(b" ")
            time.sleep(0.02)

    return drip


def stepping_clock(step: float) -> Callable[[], float]:
    """A clock that moves ``step`` seconds each time it is read."""
    now = [0.0]

    def read() -> float:
        now[0] += step
        return now[0]

    return read


def range_answer(key: str, value: bytes) -> dict[str, object]:
    encoded = {
        "key": base64.b64encode(key.encode()).decode(),
        "value": base64.b64encode(value).decode(),
        "mod_revision": "7",
        "create_revision": "5",
    }
    return {"header": {"revision": "7"}, "kvs": [encoded], "count": "1"}


@pytest.mark.parametrize(
    "prefix",
    [
        b"",  # the head, a byte at a time
        b"HTTP/1.1 200 OK\r\nContent-Length: 100000\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n186a0\r\n",
    ],
    ids=["head", "length", "chunked"],
)
def test_an_answer_that_drips_ends_at_the_whole_bound(prefix: bytes) -> None:
    # Each byte arrives well inside the 2 s of silence allowed; only the whole bound
    # (here 5 s of a clock that moves a second per look) ends the exchange.
    with tcp_server(dripping(prefix)) as (url, _):
        endpoint = Endpoint.from_url(url)
        with pytest.raises(EndpointError, match="no whole answer within 5 s"):
            post(endpoint, "kv/range", b"{}", Bounds(silence=2.0), clock=stepping_clock(1.0))


def test_a_dripping_endpoint_is_left_for_the_next_one(etcd_server: EtcdCluster) -> None:
    with tcp_server(dripping(b"HTTP/1.1 200 OK\r\n")) as (url, _):
        etcd = Etcd([url, *etcd_server.endpoints], bounds=Bounds(silence=2.0, whole=0.5))
        etcd.txn([], [{"request_put": {"key": b64("/drip/k"), "value": b64("v")}}])
        found = etcd.get("/drip/k")
        assert found is not None and found.value == b"v"
        with pytest.raises(ClusterUnavailableError, match=rf"{url}: TimeoutError: no whole"):
            Etcd([url], bounds=Bounds(silence=2.0, whole=0.5)).get("/drip/k")


@pytest.mark.parametrize(
    "handler",
    [
        answering(b"HTTP/1.1 200 OK\r\nContent-Length: 2000\r\n\r\n"),
        answering(
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n",
            b"100\r\n" + b"x" * 256 + b"\r\n" + b"400\r\n" + b"x" * 1024 + b"\r\n0\r\n\r\n",
        ),
        answering(b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\n", b"x" * 5000),
        # Under the bound by their data alone: the framing is on the wire too.
        answering(
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n",
            b"".join(b"1;ext=%s\r\n%c\r\n" % (b"e" * 2000, byte) for byte in b"{}") + b"0\r\n\r\n",
        ),
        answering(
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n",
            b"".join(b"1\r\n%c\r\n" % byte for byte in b'{"a": "' + b"x" * 20 + b'"}')
            + b"0\r\n\r\n",
        ),
        answering(
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n",
            b"2\r\n{}\r\n0\r\n" + b"X-Trailer: %s\r\n" % (b"t" * 500) * 5 + b"\r\n",
        ),
    ],
    ids=["length", "chunked", "to-close", "chunk-extensions", "one-byte-chunks", "trailers"],
)
def test_an_answer_past_the_size_bound_is_refused(
    handler: Callable[[socket.socket, int], None],
) -> None:
    with tcp_server(handler) as (url, _), pytest.raises(EndpointError, match="over 1000 bytes"):
        post(Endpoint.from_url(url), "kv/range", b"{}", Bounds(silence=2.0, max_bytes=1000))


@pytest.mark.parametrize(
    ("handler", "said"),
    [
        (answering(b"HTTP/1.1 200 OK\r\nContent-Length: 6\r\n\r\n", b"<html>"), "not JSON"),
        (json_answer([1, 2]), "a JSON list where etcd answers an object"),
        (
            answering(
                b"HTTP/1.1 200 OK\r\nContent-Length: 200000\r\n\r\n",
                b"[" * 100_000 + b"]" * 100_000,
            ),
            r"not JSON \(RecursionError\)",
        ),
        (answering(b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 0\r\n\r\n"), "HTTP 503"),
        (answering(b"HTTP/1.1 502 Bad Gateway\r\nContent-Length: 0\r\n\r\n"), "HTTP 502"),
        (answering(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\n", b"{}"), "closed before"),
        (answering(b"HTTP/1.1 \xb200 OK\r\n\r\n"), "not an HTTP/1.x status line"),
        (answering(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip\r\n\r\n"), "Transfer-Encoding"),
        (json_answer({"kvs": {"key": "a2V5"}}), "not etcd's answer"),
        (json_answer({"kvs": [{"key": "a2V5", "value": "not base64!"}]}), "not etcd's answer"),
        (json_answer({"kvs": [{"key": "a2V5", "mod_revision": "x"}]}), "not etcd's answer"),
        (json_answer({"kvs": [{"key": "a2V5", "lease": float("inf")}]}), "not etcd's answer"),
    ],
    ids=[
        "html",
        "list",
        "nested",
        "unavailable",
        "bad-gateway",
        "cut",
        "latin1-digit",
        "gzip",
        "kvs-object",
        "value-not-base64",
        "revision-not-a-number",
        "lease-infinite",
    ],
)
def test_an_answer_that_is_not_etcds_is_one_clear_error(
    handler: Callable[[socket.socket, int], None], said: str
) -> None:
    with tcp_server(handler) as (url, _), pytest.raises(ClusterUnavailableError) as raised:
        Etcd([url], timeout=2.0).get("/x")
    assert raised.match("no etcd endpoint answered")
    assert raised.match(said)


def test_a_lease_answer_without_its_id_is_not_taken_for_one() -> None:
    refused = pytest.raises(ClusterUnavailableError, match="not etcd's answer")
    with tcp_server(json_answer({"ID": None})) as (url, _), refused:
        Etcd([url], timeout=2.0).grant(5)


def test_a_chunked_answer_after_an_informational_one_is_read_whole() -> None:
    body = json.dumps(range_answer("/k", b"\x00value\xff")).encode()
    chunks = b"".join(b"%x\r\n%s\r\n" % (len(part), part) for part in (body[:9], body[9:]))
    handler = answering(
        b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n",
        chunks + b"0\r\nX-Trailer: yes\r\n\r\n",
    )
    with tcp_server(handler) as (url, received):
        found = Etcd([url], timeout=2.0).get("/k")
    assert found is not None
    assert (found.value, found.mod_revision, found.create_revision) == (b"\x00value\xff", 7, 5)
    sent = b"".join(received)
    assert sent.startswith(b"POST /v3/kv/range HTTP/1.1\r\n")
    assert json.loads(sent.partition(b"\r\n\r\n")[2]) == {"key": b64("/k")}


@pytest.mark.parametrize(("informational", "read"), [(8, True), (9, False)])
def test_at_most_eight_informational_answers_are_skipped(informational: int, read: bool) -> None:
    body = json.dumps(range_answer("/k", b"v")).encode()
    handler = answering(
        b"HTTP/1.1 103 Early Hints\r\n\r\n" * informational
        + b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(body),
        body,
    )
    with tcp_server(handler) as (url, _):
        if read:
            found = Etcd([url], timeout=2.0).get("/k")
            assert found is not None
            assert found.value == b"v"
        else:
            with pytest.raises(ClusterUnavailableError, match="informational answers"):
                Etcd([url], timeout=2.0).get("/k")


def test_an_endpoint_at_an_ipv6_address_with_its_zone_is_dialled_as_an_address() -> None:
    # As the probe's and the router's: "%25lo" as the URL writes it never resolved.
    with pytest.raises(ClusterUnavailableError) as raised:
        Etcd(["http://[fe80::1%25lo]:9"], timeout=2.0).get("/k")
    assert "Name or service not known" not in str(raised.value), raised.value


def test_a_proxy_in_the_environment_is_not_used(
    etcd_server: EtcdCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    # etcd is reached directly, as the backends are: a proxy named for other tools must
    # not see the cluster's record (nor stand between a leader and its lease).
    proxied: list[int] = []

    def proxy(connection: socket.socket, number: int) -> None:
        proxied.append(number)

    with tcp_server(proxy) as (proxy_url, _):
        for name in ("HTTP_PROXY", "http_proxy", "HTTPS_PROXY", "https_proxy", "ALL_PROXY"):
            monkeypatch.setenv(name, proxy_url)
        monkeypatch.delenv("NO_PROXY", raising=False)
        monkeypatch.delenv("no_proxy", raising=False)
        etcd = Etcd(etcd_server.endpoints)
        lease = etcd.grant(30)
        assert etcd.keepalive(lease) > 0
        etcd.revoke(lease)
        assert etcd.keepalive(lease) == -1
    assert proxied == []


@pytest.mark.slow
def test_a_silent_endpoint_ends_at_the_silence_bound() -> None:
    arrived = threading.Event()

    def silent(connection: socket.socket, _: int) -> None:
        read_request(connection)
        arrived.set()
        time.sleep(3.0)

    with tcp_server(silent) as (url, _), pytest.raises(EndpointError, match="timed out"):
        post(Endpoint.from_url(url), "kv/range", b"{}", Bounds(silence=0.3))
    assert arrived.is_set()


def test_one_call_over_every_endpoint_ends_within_its_bound() -> None:
    """Seven endpoints at 2 s each held a cycle past systemd's watchdog while etcd was
    away. The clock here steps 2 s per look (one to set the deadline, one before each
    endpoint), so the call's 5 s reach two endpoints and name the rest as not tried."""
    refused = []
    for _ in range(7):
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            refused.append(f"http://127.0.0.1:{sock.getsockname()[1]}")
    etcd = Etcd(refused, clock=stepping_clock(2.0))
    with pytest.raises(ClusterUnavailableError) as failed:
        etcd.get("/k")
    said = str(failed.value)
    assert said.count("not tried, 5 s spent") == 5
    assert all(url in said for url in refused)


@pytest.mark.parametrize(
    "status",
    [b"404 Not Found", b"500 Internal Server Error", b"401 Unauthorized", b"429 Too Many"],
)
def test_an_error_page_that_is_not_etcds_sends_the_call_to_the_next_endpoint(
    etcd_server: EtcdCluster, status: bytes
) -> None:
    # A proxy's page in front of the first endpoint was taken for etcd's own word: every
    # call failed at once, and the endpoints behind it were never asked.
    page = b"<html>nginx</html>"
    handler = answering(b"HTTP/1.1 %s\r\nContent-Length: %d\r\n\r\n" % (status, len(page)), page)
    with tcp_server(handler) as (url, received):
        etcd = Etcd([url, *etcd_server.endpoints], timeout=2.0)
        etcd.txn([], [{"request_put": {"key": b64("/page/k"), "value": b64("v")}}])
        found = etcd.get("/page/k")
        assert found is not None and found.value == b"v"
        with pytest.raises(ClusterUnavailableError, match="no etcd endpoint answered") as alone:
            Etcd([url], timeout=2.0).get("/page/k")
        assert alone.match("not an etcd error")
    assert received  # the page was asked first, and passed over


def test_etcds_own_error_is_its_word_and_no_other_endpoint_is_asked(
    etcd_server: EtcdCluster,
) -> None:
    # A real etcd's refusal (a lease it does not have: HTTP 404, gRPC code 5) and one in
    # its shape from a raw socket (too many requests: 429, code 8) end the call there.
    asked: list[int] = []

    def count(connection: socket.socket, number: int) -> None:
        asked.append(number)

    with tcp_server(count) as (spare, _):
        refused = pytest.raises(ClusterUnavailableError, match="requested lease not found")
        with refused as raised:
            Etcd([*etcd_server.endpoints, spare], timeout=2.0).revoke(0x7E57)
        assert str(raised.value).startswith(f"etcd {etcd_server.endpoints[0]}: HTTP 404")
        said = {"error": "etcdserver: too many requests", "code": 8}
        said["message"] = said["error"]
        body = json.dumps(said).encode()
        busy = answering(b"HTTP/1.1 429 Too Many\r\nContent-Length: %d\r\n\r\n" % len(body), body)
        with tcp_server(busy) as (url, _), pytest.raises(ClusterUnavailableError) as raised:
            Etcd([url, spare], timeout=2.0).get("/k")
        assert raised.match(f"etcd {url}: HTTP 429") and raised.match("too many requests")
    assert asked == []


@pytest.mark.parametrize(
    ("body", "etcds"),
    [
        ('{"error":"e","message":"etcdserver: requested lease not found","code":5}', True),
        ('{"code":3,"message":"illegal base64 data"}', True),  # grpc-gateway v2's shape
        ('{"error":"illegal base64 data","code":3}', True),
        ('{"code":true,"message":"m"}', False),
        ('{"code":"5","message":"m"}', False),
        ('{"code":5}', False),
        ('{"code":5,"message":["m"]}', False),
        ('[{"code":5,"message":"m"}]', False),
        ('{"message":' + "[" * 50_000 + "]" * 50_000 + ',"code":5}', False),
        ("<html>Not Found</html>", False),
        ("404 page not found\n", False),
        ("", False),
    ],
)
def test_only_a_body_in_etcds_error_shape_is_taken_for_its_error(body: str, etcds: bool) -> None:
    assert etcd_http.is_etcd_error(body) is etcds


def b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


def test_a_host_name_beyond_ascii_is_written_as_idna_in_the_host_header() -> None:
    """The config takes it (a request can carry it); written raw, every request failed
    encoding its head as ASCII."""
    assert Endpoint.from_url("http://bücher.example:2379").authority == "xn--bcher-kva.example:2379"
    assert Endpoint.from_url("http://[::1]:2379").authority == "[::1]:2379"


@pytest.mark.slow
def test_endpoints_a_failed_call_did_not_reach_are_asked_first_by_the_next(
    etcd_server: EtcdCluster,
) -> None:
    """Three endpoints that take the connection and never answer (paused members) ahead
    of a live one: each call spent its bound on the first three and never asked the
    fourth, call after call, while it would have answered."""
    silent = [socket.create_server(("127.0.0.1", 0)) for _ in range(3)]  # never accepted
    try:
        urls = [f"http://127.0.0.1:{sock.getsockname()[1]}" for sock in silent]
        etcd = Etcd([*urls, *etcd_server.endpoints], timeout=0.3, call_seconds=0.75)
        with pytest.raises(ClusterUnavailableError) as first:
            etcd.get("/silent/k")
        assert first.match(f"{etcd_server.endpoints[0]}: not tried")
        assert etcd.get("/silent/k") is None  # the next call asks it first
    finally:
        for sock in silent:
            sock.close()
