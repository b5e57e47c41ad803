"""`llmhealth route` under 10,000 idle client connections (issue 11's bad-input list).

No vLLM here: a simulated backend and the real `route` process. It sits in the e2e lane
because opening and accepting ten thousand sockets takes several seconds of both cores,
more than `make test`'s budget allows; `tests/test_route.py` keeps the small version (the
connection cap at a low file limit).
"""

from __future__ import annotations

import resource
import shutil
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
