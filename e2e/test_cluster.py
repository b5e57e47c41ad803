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
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import pytest

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
        second.until("gpu healthy again", lambda p: p.state("gpu") == "healthy")
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
        second.until("gpu healthy again", lambda p: p.state("gpu") == "healthy")
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
        second.until("gpu healthy again", lambda p: p.state("gpu") == "healthy")
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
        _, second = two_daemons(scene, stack)
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
    # restarted once and proven back before the next restart, whoever led at the time.
    steps = [
        "restart" if r["event"] == "restart" and r["to"] == "restarting" else "back"
        for r in trail
        if (r["event"] == "restart" and r["to"] == "restarting") or r["to"] == "healthy"
    ]
    assert steps == ["restart", "back"] * wedges, steps
    assert [r["fence"] for r in audited] == [fence for fence, _ in lines]
    assert checks, "cron never ran a check"
    for done in checks:
        assert "Traceback" not in done.stderr, done.stderr
        assert done.returncode in (0, 1, 2), done.stderr
    # With two daemons renewing, a check from cron does not win the lease: it only reports.
    said = [json.loads(done.stdout)["notes"] for done in checks]
    assert any(any("not acting" in note for note in notes) for notes in said), said
