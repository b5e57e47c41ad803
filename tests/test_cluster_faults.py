"""Two real `llmhealth watch` daemons, a real etcd, and a leader killed at the worst moment.

The slower faults (a paused leader, etcd away, three etcd members, cron beside the
daemons) run in `make e2e`: e2e/test_cluster.py.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import pytest
from clusterscene import (
    TTL,
    WAIT,
    Scene,
    inject_wedge,
    leads,
    member_of,
    staged,
    two_daemons,
    until,
)


@pytest.fixture
def scene(entry_point: str, tmp_path: Path) -> Iterator[Scene]:
    with staged(entry_point, tmp_path) as staged_scene:
        yield staged_scene


@pytest.mark.slow
def test_a_standby_proves_and_restarts_once_a_wedge_its_killed_leader_was_proving(
    scene: Scene,
) -> None:
    with ExitStack() as stack:
        first, second = two_daemons(scene, stack)
        standby = member_of(second.until("a member label", lambda p: p.cycled))
        inject_wedge(scene.gpu)
        first.process.send_signal(signal.SIGKILL)
        killed = time.monotonic()
        restarted = until("a restart", lambda: bool(scene.restarts.lines()))
        second.until("gpu healthy again", lambda p: p.state("gpu") == "healthy")
        lines = scene.restarts.lines()
    assert len(lines) == 1, lines
    assert lines[0][1] == standby  # the new leader ran it, with its own fencing token
    # The fleet's audit trail in etcd says the same: one restart, by the standby, under
    # the token its command was given; no daemon kept a local audit log.
    audited = scene.audited_restarts()
    assert [(r["backend"], r["member"], r["fence"]) for r in audited] == [
        ("gpu", standby, lines[0][0])
    ]
    assert not list(scene.folder.glob("*.jsonl"))
    # The first process and one restart (the script records it once the server answers).
    until("the restart recorded", lambda: len(scene.gpu.launches()) >= 2)
    assert len(scene.gpu.launches()) == 2
    # The standby had been reading all along: the lease runs out, then two waits prove.
    assert restarted - killed < TTL + 2 * WAIT + 3.0, restarted - killed


@pytest.mark.slow
def test_a_leader_killed_just_after_committing_a_restart_is_not_repeated(
    scene: Scene,
) -> None:
    with ExitStack() as stack:
        first, second = two_daemons(scene, stack)
        inject_wedge(scene.gpu)
        # The command's line is written after RESTARTING was committed: kill right then.
        until("the leader's restart command", lambda: bool(scene.restarts.lines()))
        first.process.send_signal(signal.SIGKILL)
        second.until("the new leader", leads)
        page = second.until("gpu healthy again", lambda p: p.state("gpu") == "healthy")
        second.next_cycle(page)
        lines = scene.restarts.lines()
    assert len(lines) == 1, lines
    until("the restart recorded", lambda: len(scene.gpu.launches()) >= 2)
    assert len(scene.gpu.launches()) == 2
    # The killed leader's restart is in the trail (written with RESTARTING), once; the new
    # leader's later records (the re-admission) follow it under a larger token.
    trail = scene.audit_command()
    restarts = [r for r in trail if r["event"] == "restart" and r["to"] == "restarting"]
    assert [r["fence"] for r in restarts] == [lines[0][0]], restarts
    readmitted = [r for r in trail if r["backend"] == "gpu" and r["to"] == "healthy"]
    assert readmitted and all(int(r["fence"]) > lines[0][0] for r in readmitted), trail
    record = scene.record()
    written_by = record["written_by"]
    assert isinstance(written_by, dict)
    assert written_by["fence"] is not None and written_by["fence"] > lines[0][0]
