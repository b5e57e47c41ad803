"""`llmhealth demo` stopped part-way, as an operator stops it: everything it started goes.

The demo runs for about a minute, so only its stop is tested here (in the slow lane);
`make demo` runs it whole.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import pytest
from simproc import alive, children

from llmhealth.demo import _streams_told

PATIENCE = 60.0  # seconds: a bound on what must happen, never a timing claim


@pytest.mark.slow
@pytest.mark.parametrize(
    ("part", "signum"),
    [
        ("1. one check", signal.SIGTERM),
        ("2. llmhealth watch", signal.SIGINT),
        ("2. llmhealth watch", signal.SIGTERM),
    ],
    ids=["check-sigterm", "watch-ctrl-c", "watch-sigterm"],
)
def test_a_demo_stopped_part_way_stops_its_simulators_and_exits_130(
    part: str, signum: signal.Signals
) -> None:
    # Before: SIGTERM in the check part ended the demo at once with its simulator left
    # running, reparented to init; in the watch part the daemon took either signal and
    # the demo went on to scrape it, gone, and ended in a ConnectError traceback.
    demo = subprocess.Popen(
        [sys.executable, "-m", "llmhealth", "demo"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        text=True,
        env={**os.environ, "COLUMNS": "200"},
    )
    seen: list[str] = []
    assert demo.stdout is not None
    reader = threading.Thread(target=lambda: seen.extend(demo.stdout or ()), daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + PATIENCE
        while not any(part in line for line in seen):
            assert demo.poll() is None and time.monotonic() < deadline, "".join(seen)
            time.sleep(0.1)
        simulators = children(demo.pid)
        assert simulators, "the demo's simulator"
        demo.send_signal(signum)
        _, stderr = demo.communicate(timeout=PATIENCE)
    finally:
        if demo.poll() is None:
            demo.kill()
            demo.wait()
    assert demo.returncode == 130, stderr  # a shell's code for an interrupted command
    assert "Traceback" not in stderr, stderr
    assert not [pid for pid in simulators if alive(pid)]


@pytest.mark.parametrize(
    ("streams", "told"),
    [
        ([("r0-wedging", False)] * 3, "All 3 streams finished: none met the wedge."),
        (
            [("r0-wedging", False), ("r0-wedging", True), ("r1-idle", False), ("r0-wedging", True)],
            "The wedged backend cost the client 2 of 4 streams, each ended by an SSE error "
            "event; of the 2 after the first, 1 finished on r1.",
        ),
        (
            [("r0-wedging", True), ("r1-idle", False), ("r0-wedging", False)],
            "The wedged backend cost the client 1 of 3 streams, each ended by an SSE error "
            "event; of the 2 after the first, 1 finished on r1, and r0 served again once its "
            "new process was re-admitted.",
        ),
    ],
    ids=["no-failure", "r0-failed-twice", "r0-back"],
)
def test_the_routing_part_tells_what_its_streams_showed(
    streams: list[tuple[str, bool]], told: str
) -> None:
    """Its closing words were fixed text ("steered the next ones to r1 at once"), true
    on a fast machine, told also where a stream after the first failure failed again."""
    assert _streams_told(streams) == told
