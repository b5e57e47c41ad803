"""bench_scale's `watch` child adds its read workers' CPU and memory to the daemon's, and no
other process's.

Found by hand: run from a driver that had started the simulators itself, the child took
them for read workers, and the daemon's own loop at 3,000 backends measured 3.96-4.35 s of
CPU per cycle against 2.44-2.59 s in a fresh child.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

from bench_scale import child_watch
from simproc import running_simulator


@pytest.mark.slow
def test_a_watch_child_counts_only_the_read_workers_its_daemon_started() -> None:
    # The simulator is this test's child, as the simulators are a driver's.
    with running_simulator(["busy", "idle", "wedge:0", "busy"]) as simulator:
        in_its_own_loop = child_watch(simulator.urls, 1.0, 3, 1)
        with_two_workers = child_watch(simulator.urls, 1.0, 3, 2)
    assert in_its_own_loop["workers"] == 0
    assert with_two_workers["workers"] == 2
    assert in_its_own_loop["cycles"] >= 3 and with_two_workers["cycles"] >= 3
