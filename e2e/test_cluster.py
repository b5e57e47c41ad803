"""Several daemons on one fleet through the slow faults: no vLLM here, a real etcd.

A paused leader, etcd away for a minute, a three-member etcd with a member down, and a
cron `check` beside two daemons while wedges come and go. Each test stages its own etcd
and restartable simulated backends (tests/clusterscene.py) and stops them all.
"""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import pytest

from llmhealth.leadership import owner

TESTS = Path(__file__).resolve().parent.parent / "tests"
sys.path.insert(0, str(TESTS))

from clusterscene import (  # noqa: E402
    TTL,
    WAIT,
    Page,
    Scene,
    inject_wedge,
    leads,
    member_of,
    staged,
    two_daemons,
    until,
)

OUTAGE = 60.0  # seconds without etcd


@pytest.fixture(scope="session")
def entry_point() -> str:
    found = shutil.which("llmhealth", path=str(Path(sys.executable).parent))
    assert found, "the llmhealth console script is not installed next to this Python"
    return found


@pytest.fixture
def scene(entry_point: str, tmp_path: Path) -> Iterator[Scene]:
    with staged(entry_point, tmp_path) as staged_scene:
        yield staged_scene


def test_a_leader_paused_past_its_lease_acts_on_nothing_and_rejoins_as_standby(
    scene: Scene,
) -> None:
    with ExitStack() as stack:
        first, second = two_daemons(scene, stack)
        old_leader = member_of(first.until("a member label", lambda p: p.cycled))
        inject_wedge(scene.gpu)
        first.process.send_signal(signal.SIGSTOP)
        try:
            second.until("the standby leading", leads)
            until("the new leader's restart", lambda: bool(scene.restarts.lines()))
            second.until("gpu restarting or back", lambda p: p.state("gpu") != "healthy")
        finally:
            first.process.send_signal(signal.SIGCONT)
        # Whatever the old leader had proven before its pause, it must not act on it now.
        writers = set()
        resumed = first.logged("steps down")
        page = first.until("the old leader cycling again", lambda p: p.cycled)
        for _ in range(6):
            page = first.next_cycle(page)
            writers.add(json.dumps(scene.record()["written_by"], sort_keys=True))
            assert not leads(page)
        until("gpu re-admitted", scene.readmitted_since_restart)
        log = first.stderr()
    lines = scene.restarts.lines()
    assert len(lines) == 1 and lines[0][1] != old_leader, lines
    assert "steps down" in resumed
    assert "restart command ran" not in log.split("steps down", 1)[1]
    assert all(json.loads(writer)["member"] != old_leader for writer in writers), writers


def test_without_etcd_nobody_restarts_probing_goes_on_and_one_leader_returns(
    scene: Scene,
) -> None:
    with ExitStack() as stack:
        first, second = two_daemons(scene, stack)
        member = scene.etcd.members[0]
        member.stop()
        for watch in (first, second):
            watch.until(
                "no leader seen",
                lambda p: not leads(p) and p.get("llmhealth_cluster_etcd_up") == 0.0,
            )
        inject_wedge(scene.gpu)
        # Two daemons probe on, and see the wedge; neither may act on it.
        for watch in (first, second):
            watch.until("the wedge seen", lambda p: p.verdict("gpu") == "wedged")
        pages = [
            first.next_cycle(first.scrape() or Page("")),
            second.next_cycle(second.scrape() or Page("")),
        ]
        assert not any(leads(page) for page in pages)
        assert scene.restarts.lines() == []
        member.start()
        scene.etcd.wait_healthy()
        back = time.monotonic()
        until(
            "one leader", lambda: sum(leads(w.scrape() or Page("")) for w in (first, second)) == 1
        )
        led = time.monotonic()
        until("the restart", lambda: bool(scene.restarts.lines()))
        time.sleep(2 * WAIT)
        both = [first.scrape() or Page(""), second.scrape() or Page("")]
        lines = scene.restarts.lines()
    assert sum(leads(page) for page in both) == 1
    assert len(lines) == 1, lines
    # The old lease outlives the outage by up to one TTL (etcd renews leases it restores).
    assert led - back < 2 * TTL + 3.0, led - back


def test_a_minute_without_etcd_restarts_nothing_and_ends_with_one_leader(scene: Scene) -> None:
    with ExitStack() as stack:
        first, second = two_daemons(scene, stack)
        member = scene.etcd.members[0]
        member.stop()
        inject_wedge(scene.gpu)
        pages = {}
        ended = time.monotonic() + OUTAGE
        while time.monotonic() < ended:
            for name, watch in (("a", first), ("b", second)):
                page = watch.scrape()
                assert page is not None, f"daemon {name} stopped serving its metrics"
                pages[name] = page
            assert scene.restarts.lines() == []
            time.sleep(1.0)
        for page in pages.values():
            assert not leads(page)
            assert page.verdict("gpu") == "wedged"  # probing went on the whole time
            assert page.get("llmhealth_cluster_etcd_up") == 0.0
        member.start()
        scene.etcd.wait_healthy()
        back = time.monotonic()
        until(
            "one leader",
            lambda: sum(leads(w.scrape() or Page("")) for w in (first, second)) == 1,
        )
        led = time.monotonic()
        until("the restart", lambda: bool(scene.restarts.lines()))
        until("gpu re-admitted", scene.readmitted_since_restart)
        lines = scene.restarts.lines()
    assert len(lines) == 1, lines
    assert led - back < 2 * TTL + 3.0, led - back


def test_with_one_of_three_etcd_members_down_the_fleet_is_run_as_usual(
    entry_point: str, tmp_path: Path
) -> None:
    with staged(entry_point, tmp_path, etcd_members=3) as scene, ExitStack() as stack:
        first, second = two_daemons(scene, stack)
        scene.etcd.members[0].stop()  # the first endpoint each daemon tries
        inject_wedge(scene.gpu)
        until("the restart", lambda: bool(scene.restarts.lines()))
        until("gpu re-admitted", scene.readmitted_since_restart)
        pages = [first.next_cycle(first.scrape() or Page("")), second.scrape() or Page("")]
        lines = scene.restarts.lines()
    assert len(lines) == 1, lines
    assert sum(leads(page) for page in pages) == 1


def test_two_daemons_and_cron_restart_each_of_many_wedges_exactly_once(
    entry_point: str, tmp_path: Path
) -> None:
    wedges = 5
    # Back to back: no cooldown between one wedge's restart and the next one's.
    policy = 'cooldown = "1s"\nrestart_budget = 20'
    with staged(entry_point, tmp_path, policy=policy) as scene, ExitStack() as stack:
        first, second = two_daemons(scene, stack)
        stack.enter_context(scene.explained(first))
        stop = threading.Event()
        checks: list[subprocess.CompletedProcess[str]] = []

        def cron() -> None:
            while not stop.is_set():
                checks.append(
                    subprocess.run(
                        [
                            entry_point,
                            "check",
                            "-c",
                            str(scene.config),
                            "--wait",
                            "0.5",
                            "-f",
                            "json",
                        ],
                        capture_output=True,
                        text=True,
                        timeout=60,
                        check=False,
                    )
                )

        runner = threading.Thread(target=cron, daemon=True)
        runner.start()
        try:
            for count in range(1, wedges + 1):
                second.until("gpu healthy", lambda p: p.state("gpu") == "healthy", timeout=60)
                inject_wedge(scene.gpu)
                until(f"restart {count}", lambda n=count: len(scene.restarts.lines()) >= n, 60)
        finally:
            stop.set()
            runner.join(90)
        second.until("gpu healthy at the end", lambda p: p.state("gpu") == "healthy", timeout=60)
        lines = scene.restarts.lines()
        launches = scene.gpu.launches()
        trail = [r for r in scene.audit_command() if r["backend"] == "gpu"]
        audited = scene.audited_restarts()
    assert len(lines) == wedges, lines
    assert len(launches) == wedges + 1, launches
    assert len({fence for fence, _ in lines}) >= 1
    # The fleet's audit trail in etcd, as `llmhealth audit` prints it: each wedge is
    # restarted once and proven back (re-admitted from STALE) before the next restart,
    # whoever led at the time. A doubt and its end (suspect, healthy again: a read late on
    # a slow host) are no restart's.
    steps = [
        "restart" if r["event"] == "restart" and r["to"] == "restarting" else "back"
        for r in trail
        if (r["event"] == "restart" and r["to"] == "restarting")
        or (r["from"] == "stale" and r["to"] == "healthy")
    ]
    assert steps == ["restart", "back"] * wedges, "\n".join(map(str, trail))
    assert [r["fence"] for r in audited] == [fence for fence, _ in lines]
    assert checks, "cron never ran a check"
    for done in checks:
        assert "Traceback" not in done.stderr, done.stderr
        assert done.returncode in (0, 1, 2), done.stderr
    # With two daemons renewing, a check from cron does not win the lease: it only reports,
    # and says who leads.
    said = [json.loads(done.stdout)["notes"] for done in checks]
    assert any(any("not acting: standby (" in note for note in notes) for notes in said), said
    assert any(any(" leads)" in note for note in notes) for notes in said), said


def shares_of(page: Page) -> dict[str, float]:
    return {
        sample.labels["member"]: sample.value
        for sample in page.samples("llmhealth_cluster_member_share_backends")
    }


def reads_of(scene: Scene) -> dict[str, int]:
    return {
        name: int(server.stats()["metrics_reads"]) for name, (server, _) in scene.servers.items()
    }


def test_sharded_reads_one_reader_each_a_wedge_restarted_once_a_dead_members_share_read_again(
    entry_point: str, tmp_path: Path
) -> None:
    backends = 6
    with (
        staged(entry_point, tmp_path, more=backends - 1, cluster="shard_reads = true") as scene,
        ExitStack() as stack,
    ):
        # Named, so that the split is the same every run: six backends over these three
        # names give each two (over PIDs, one member in eleven would read none).
        first, second = two_daemons(scene, stack, ("one", "two"))
        third = stack.enter_context(scene.daemon("c", "three"))
        # The leader sees three members whose shares cover the fleet once.
        page = first.until(
            "three shares",
            lambda p: len(shares_of(p)) == 3 and sum(shares_of(p).values()) == backends,
            timeout=60,
        )
        leader = member_of(page)
        names = {
            member_of(w.until("a member label", lambda p: p.cycled)): w for w in (second, third)
        }
        members = sorted([leader, *names])
        owners = {backend: owner(backend, members) for backend in scene.servers}
        # Each backend is read by its owner alone: one read a wait, not one per member.
        # The leader still settles all of them, every wait.
        before, started = reads_of(scene), time.monotonic()
        time.sleep(12 * WAIT)
        after, seconds = reads_of(scene), time.monotonic() - started
        page = first.scrape() or Page("")
        waits = seconds / WAIT
        for backend in scene.servers:
            assert 1 <= after[backend] - before[backend] <= waits + 2, (backend, before, after)
            assert page.verdict(backend) == "busy", page.text
        assert page.get("llmhealth_cluster_stale_verdicts") == 0.0
        # A wedge in a standby's share: proven from its published verdicts, restarted once,
        # by the leader.
        assert sorted(Counter(owners.values()).values()) == [2, 2, 2], owners
        standby = sorted(names)[0]
        target = next(b for b, who in sorted(owners.items()) if who == standby)
        server, restarts = scene.servers[target]
        inject_wedge(server)
        until(f"{target} restarted", lambda: bool(restarts.lines()), timeout=60)
        first.until(f"{target} healthy again", lambda p: p.state(target) == "healthy", timeout=60)
        lines = restarts.lines()
        audited = [r for r in scene.audited_restarts() if r["backend"] == target]
        # The member that read it killed: once its lease lapses its backends are read
        # again by the others, the restarted one included, and nothing mistakes the
        # restart the leader already settled for a new one.
        dead, dead_name = names[standby], standby
        orphans = [b for b, who in owners.items() if who == dead_name]
        assert orphans, owners
        dead.process.send_signal(signal.SIGKILL)
        killed = time.monotonic()
        base = reads_of(scene)
        resumed = {}
        for backend in orphans:
            until(
                f"{backend} read again",
                lambda b=backend: reads_of(scene)[b] >= base[b] + 2,
                timeout=60,
            )
            resumed[backend] = time.monotonic() - killed
        page = first.until("two shares", lambda p: len(shares_of(p)) == 2, timeout=30)
        assert sum(shares_of(page).values()) == backends
        for _ in range(4):
            page = first.next_cycle(page)
            assert page.state(target) == "healthy", page.text
        moves = [r["event"] for r in scene.audit_command() if r["backend"] == target]
    assert len(lines) == 1 and lines[0][1] == leader, lines
    assert [r["member"] for r in audited] == [leader], audited
    # The injection itself is a new process (the first unplanned restart); after the
    # re-admission nothing more, though another member now reads it.
    assert moves.count("readmitted") == 1, moves
    assert "unplanned_restart" not in moves[moves.index("readmitted") :], moves
    # Two reads by a new owner: the lease's TTL, an elector round, then two waits or so.
    assert max(resumed.values()) < TTL + 3 * WAIT + 3.0, resumed
