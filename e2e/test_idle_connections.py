"""`llmhealth route` under 10,000 idle client connections (issue 11's bad-input list).

No vLLM here: a simulated backend and the real `route` process. It sits in the e2e lane
because opening and accepting ten thousand sockets takes several seconds of both cores,
more than `make test`'s budget allows; `tests/test_route.py` keeps the small version (the
connection cap at a low file limit).
"""

from __future__ import annotations

import resource
import shutil
import socket
import sys
import time
from pathlib import Path

import httpx
from conftest import record
from routeproc import (
    BOUND,
    COMPLETION,
    file_limit_at_least,
    free_port,
    idle_sockets,
    open_files,
    running_route,
    wait_closed_by_peer,
    write_config,
)
from simproc import running_simulator

from llmhealth.router import FILE_LIMIT_CEILING, connection_cap

IDLE_CONNECTIONS = 10_000
IDLE = 15  # seconds: the router's idle_timeout here
FILES_SPARE = 512  # descriptors this test process keeps for everything but the idle sockets
# The dev venv's console script: this lane runs with the dev venv's pytest.
ENTRY_POINT = shutil.which("llmhealth", path=str(Path(sys.executable).parent)) or "llmhealth"


def test_ten_thousand_idle_client_connections_are_bounded_and_cost_no_one_an_answer(
    tmp_path: Path,
) -> None:
    # Fewer than 10,000 only if this machine's hard limit on open files leaves no room for
    # them in this process: then as many as it does, and the recorded count says so (the
    # lane never skips itself: tests/test_e2e_lane.py).
    with file_limit_at_least(IDLE_CONNECTIONS + FILES_SPARE) as limit:
        count = max(100, min(IDLE_CONNECTIONS, limit - FILES_SPARE))
        hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
        # The router holds half its (raised) limit in client connections; past that, the
        # longest idle make room (tests/test_route.py).
        held = min(count, connection_cap(min(hard, FILE_LIMIT_CEILING), 1))
        with running_simulator(["idle"], request_seconds=0.05) as sim:
            # Long enough that every socket is still open when the last is, short enough to
            # wait out.
            config = write_config(tmp_path, {"a": sim.urls[0]}, f'idle_timeout = "{IDLE}s"')
            port, pids = free_port(), []
            # It starts with the 1024 a login shell gets and must raise its soft limit to
            # the hard one itself to hold them.
            with running_route(ENTRY_POINT, config, port, (1024, hard), pids) as route:
                began = time.monotonic()
                idle = idle_sockets(port, count, route)  # a real client answered every 500
                record(f"route: {count} idle connections opened", time.monotonic() - began)
                try:
                    assert open_files(pids[0]) >= held  # all at once, and answers went on
                    wait_closed_by_peer(idle, count)  # the idle timeout closes every one
                    record("route: ... and closed by its idle timeout", time.monotonic() - began)
                finally:
                    for sock in idle:
                        sock.close()
                assert open_files(pids[0]) < 200  # its descriptors are back
                reply = httpx.post(route + "/v1/completions", json=COMPLETION, timeout=BOUND)
                assert reply.status_code == 200


def test_at_the_cap_with_every_connection_busy_a_new_one_is_closed_until_one_ends(
    tmp_path: Path,
) -> None:
    # A router whose hard limit is 512 files holds connection_cap(512, 1) = 223 client
    # connections. Each here carries a completion the backend never answers (busy to its
    # probes, so it keeps serving): none is idle, so a 224th connection is closed at once,
    # and the router's descriptors stay within its limit. Once clients leave, it serves.
    cap = connection_cap(512, 1)
    request = (
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b'Content-Length: 41\r\n\r\n{"model": "tiny", "prompt": "hi", "n": 1}'
    )
    with running_simulator(["busy+unanswered"], request_seconds=0.05) as sim:
        config = write_config(tmp_path, {"a": sim.urls[0]}, first_byte=300)
        port, pids = free_port(), []
        with running_route(ENTRY_POINT, config, port, (512, 512), pids) as route:
            busy: list[socket.socket] = []
            try:
                for _ in range(cap):
                    sock = socket.create_connection(("127.0.0.1", port), timeout=BOUND)
                    busy.append(sock)
                    sock.sendall(request)
                deadline = time.monotonic() + BOUND
                while received(sim.urls[0]) < cap:  # every one forwarded and held
                    assert time.monotonic() < deadline, "the requests never reached the backend"
                    time.sleep(0.1)
                extra = socket.create_connection(("127.0.0.1", port), timeout=BOUND)
                busy.append(extra)
                extra.settimeout(BOUND)
                assert extra.recv(1) == b""  # closed at once: every held one is busy
                assert open_files(pids[0]) < 512
            finally:
                for sock in busy[: len(busy) // 2]:
                    sock.close()
                half = busy[len(busy) // 2 :]
            try:
                reply = httpx.get(route + "/health", timeout=BOUND)  # room again
                assert reply.status_code == 200
            finally:
                for sock in half:
                    sock.close()


def received(backend: str) -> int:
    stats = httpx.get(backend + "/sim/stats", timeout=BOUND).json()
    return int(stats["completions_received"])
