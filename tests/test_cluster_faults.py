"""Two real `llmhealth watch` daemons, a real etcd, and a leader killed at the worst moment.

The slower faults (a paused leader, etcd away, three etcd members, cron beside the
daemons) run in `make e2e`: e2e/test_cluster.py.
"""

from __future__ import annotations

import json
import signal
import subprocess
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import httpx
import pytest
from clusterscene import (
    PREFIX,
    TTL,
    WAIT,
    Page,
    Scene,
    inject_wedge,
    leads,
    member_of,
    staged,
    switch_mode,
    two_daemons,
    until,
)
from pytest_httpserver import HTTPServer
from routeproc import COMPLETION, free_port, running_route
from test_daemon import MovedByOthers, Watch, write_config

from llmhealth.cluster import Elector, Etcd, Keys
from llmhealth.leadership import LeaseTiming, owner


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
        until("gpu re-admitted", scene.readmitted_since_restart)
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
        until("gpu re-admitted", scene.readmitted_since_restart)
        second.next_cycle(second.scrape() or Page(""))
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


@pytest.mark.slow
@pytest.mark.parametrize("top", ["", "read_workers = 2"], ids=["own loop", "read workers"])
def test_a_standby_sends_no_tiny_request_and_starts_asking_once_it_leads(
    scene: Scene, top: str
) -> None:
    # Every member reads every backend, but only the leader's verdicts are settled. A
    # standby's tiny request took a slot for nothing, and the leader's read of the idle
    # backend then showed it as work: a restarted backend phase-locked with a standby
    # stayed STALE, never seen idle by the leader (e2e/test_cluster.py, in CI).
    switch_mode(scene.gpu, "idle")
    log: list[str] = []
    holder = Elector(
        Etcd(scene.etcd.endpoints), Keys(PREFIX), "holder", LeaseTiming.for_ttl(TTL), log=log.append
    )
    holder.start()
    try:
        until("the holder leading", lambda: holder.decision().may_act)
        with scene.daemon("a", top=top) as watch:
            page = watch.until("the standby cycling", lambda p: p.cycled)
            for _ in range(4):
                page = watch.next_cycle(page)
                assert not leads(page)
            assert page.verdict("gpu") == "idle"
            assert scene.gpu.stats()["completions_received"] == 0
            holder.stop(resign=True)
            watch.until("the standby leading", leads)
            until("its tiny request", lambda: scene.gpu.stats()["completions_received"] > 0)
            page = watch.until("gpu idle and proven", lambda p: p.verdict("gpu") == "idle")
    finally:
        holder.stop(resign=True)
    assert page.state("gpu") == "healthy"


@pytest.mark.slow
@pytest.mark.parametrize("top", ["", "read_workers = 2"], ids=["own loop", "read workers"])
def test_a_sharded_standby_asks_a_stale_backend_of_its_share_that_others_keep_moving(
    entry_point: str, tmp_path: Path, httpserver: HTTPServer, top: str
) -> None:
    # With shard_reads the leader settles what the member owning a backend read. A STALE
    # backend is re-admitted only by an answered tiny request, and one whose engine
    # others move between any two reads is asked only by a reader that knows it is
    # STALE: the owner, a standby, learns it from the record it reads at every cycle.
    moved = MovedByOthers(httpserver)
    with (
        staged(
            entry_point,
            tmp_path,
            cluster="shard_reads = true",
            also=[{"name": "moved", "url": moved.url}],
        ) as scene,
        ExitStack() as stack,
    ):
        # Named so that the standby (the second to start) owns the backend under test.
        names = ("one", "two") if owner("moved", ["one", "two"]) == "two" else ("two", "one")
        leader = stack.enter_context(scene.daemon("a", names[0]))
        leader.until("the first daemon leading", leads)
        standby = stack.enter_context(scene.daemon("b", names[1], top=top))
        standby.until("the second daemon cycling", lambda p: p.cycled and not leads(p))
        leader.until(
            "two members sharing the reads",
            lambda p: len(p.samples("llmhealth_cluster_member_share_backends")) == 2,
        )
        leader.until("moved serving", lambda p: p.state("moved") == "healthy")
        with scene.explained(leader, "moved"):
            for verb in (["retire", "moved", "--reason", "card replaced"], ["reset", "moved"]):
                subprocess.run(
                    [entry_point, *verb, "-c", str(scene.config)],
                    capture_output=True,
                    timeout=60,
                    check=True,
                )
            asked_before = moved.completions
            until("moved re-admitted", lambda: scene.readmitted_since_reset("moved"))
        assert moved.completions > asked_before
        trail = scene.audit_command()
    readmitted = [r for r in trail if r["backend"] == "moved" and r["event"] == "readmitted"]
    assert "tiny request answered" in json.dumps(readmitted[-1]), trail


@pytest.mark.slow  # 10-20 s of real daemons on etcd: the e2e lane's
def test_a_young_engine_its_sharded_reader_watches_compile_is_not_condemned_by_the_leader(
    entry_point: str, tmp_path: Path, httpserver: HTTPServer
) -> None:
    # A young engine with work and no progress gets minutes of window (it compiles):
    # its reader examines it every wait and decides nothing yet. The leader timed the
    # backend by verdicts alone, settled "stalled" once lease_ttl and three waits went
    # by without one, and three of those condemned a healthy engine.
    text = (Path(__file__).parent.parent / "fixtures" / "vllm-0.32" / "busy-1.txt").read_text()
    start = "\nprocess_start_time_seconds "
    begun = text.index(start) + len(start)
    text = text[:begun] + f"{time.time():.3f}" + text[text.index("\n", begun) :]
    httpserver.expect_request("/metrics").respond_with_data(text, content_type="text/plain")
    young = {
        "name": "young",
        "url": httpserver.url_for("").rstrip("/"),
        # No CPU evidence, as for an engine on another host (a cluster's usual case).
        "cgroup": str(tmp_path / "not-a-cgroup"),
    }
    with (
        staged(entry_point, tmp_path, cluster="shard_reads = true", also=[young]) as scene,
        ExitStack() as stack,
    ):
        names = ("one", "two") if owner("young", ["one", "two"]) == "two" else ("two", "one")
        leader = stack.enter_context(scene.daemon("a", names[0]))
        leader.until("the first daemon leading", leads)
        standby = stack.enter_context(scene.daemon("b", names[1]))
        standby.until("the second daemon cycling", lambda p: p.cycled and not leads(p))
        page = leader.until(
            "two members sharing the reads",
            lambda p: len(p.samples("llmhealth_cluster_member_share_backends")) == 2,
        )
        shared_at = time.monotonic()
        stale_after = TTL + 3 * WAIT
        while time.monotonic() - shared_at < 3 * stale_after + 5 * WAIT:
            page = leader.next_cycle(page)
            assert page.state("young") == "healthy", page.verdict("young")
            assert page.get("llmhealth_cluster_stale_verdicts") == 0.0
        trail = scene.audit_command()
    assert not [r for r in trail if r["backend"] == "young"], trail


def router_page(url: str) -> Page:
    return Page(httpx.get(f"{url}/metrics", timeout=5.0).text)


@pytest.mark.slow  # 10-20 s of real daemons on etcd: the e2e lane's
def test_routers_of_a_cluster_keep_one_ledger_in_etcd_and_only_the_leader_restarts(
    scene: Scene,
) -> None:
    # `llmhealth route` on every node: the record in etcd is their one ledger. The router
    # holding the lease settles and restarts; the other routes by the serving set the
    # record holds. Each keeping a ledger of its own would restart every wedge once per
    # node, the cascade llmhealth exists to prevent.
    switch_mode(scene.gpu, "idle")  # a completion through a router is answered at once
    routers: dict[str, str] = {}
    with ExitStack() as stack:
        for name in ("a", "b"):
            routers[name] = stack.enter_context(
                running_route(
                    scene.entry_point,
                    scene.config_for(name, member=name),
                    free_port(),
                    more=["--state", str(scene.state(name)), "--wait", str(WAIT)],
                )
            )
            if name == "a":
                until("router a leading", lambda: leads(router_page(routers["a"])))
        until("router b cycling", lambda: router_page(routers["b"]).cycled)
        assert not leads(router_page(routers["b"]))
        until(
            "gpu serving by the record, on the standby's router",
            lambda: router_page(routers["b"]).state("gpu") == "healthy",
        )
        answer = httpx.post(f"{routers['b']}/v1/completions", json=COMPLETION, timeout=30.0)
        assert answer.status_code == 200, answer.text
        inject_wedge(scene.gpu)
        until("gpu restarted", lambda: bool(scene.restarts.lines()))
        until("gpu re-admitted", scene.readmitted_since_restart)
        for _ in range(4):  # a second ledger would restart it again
            page = router_page(routers["a"])
            until(
                "a later cycle", lambda p=page: router_page(routers["a"]).last_cycle != p.last_cycle
            )
    assert scene.restarts.lines() == [(scene.restarts.lines()[0][0], "a")]
    assert [r["member"] for r in scene.audited_restarts()] == ["a"]
    assert not scene.state("a").exists() and not scene.state("b").exists()


@pytest.mark.slow
def test_a_reload_that_drops_the_cluster_is_refused_and_the_member_goes_on(
    entry_point: str, tmp_path: Path
) -> None:
    # Where the ledger lives is chosen at start. Taken on SIGHUP, a config without its
    # [cluster] had a sharding member settle without a lease, and die on the next cycle.
    with (
        staged(entry_point, tmp_path, cluster="shard_reads = true") as scene,
        scene.daemon("a", "one") as watch,
    ):
        page = watch.until("leading", leads)
        path = scene.config_for("a", member="one")  # the file the daemon reads
        text = path.read_text()
        write_config(path, text[: text.index("[cluster]")])
        watch.signal(signal.SIGHUP)
        log = watch.logged("reload refused")
        for _ in range(3):
            page = watch.next_cycle(page)
            assert leads(page)
        rc, _ = watch.stop()
    assert rc == 0
    refusal = next(line for line in log.splitlines() if "reload refused" in line)
    assert "[cluster] changed" in refusal, refusal
    assert not scene.state("a").exists()


@pytest.mark.slow  # 10-20 s of real daemons on etcd, one paused past its lease
def test_a_sharded_member_that_stops_leading_exports_no_frozen_verdict_of_anothers_share(
    entry_point: str, tmp_path: Path
) -> None:
    # Leading with shard_reads, a member hears the verdicts of the backends the others
    # read (their publications) and exports them. Standing by, it hears none of them:
    # the one heard last stayed on its /metrics for as long as it stood by, a "wedged"
    # or "down" there firing LLMHealthBackendWedged or Down for a backend long mended.
    with staged(entry_point, tmp_path, cluster="shard_reads = true") as scene, ExitStack() as stack:
        # Named so that the second daemon (the standby, then the leader) reads gpu.
        names = ("one", "two") if owner("gpu", ["one", "two"]) == "two" else ("two", "one")
        first = stack.enter_context(scene.daemon("a", names[0]))
        first.until("the first daemon leading", leads)
        second = stack.enter_context(scene.daemon("b", names[1]))
        second.until("the second daemon cycling", lambda p: p.cycled and not leads(p))
        first.until(
            "gpu busy as its reader, the second, says",
            lambda p: (
                len(p.samples("llmhealth_cluster_member_share_backends")) == 2
                and p.verdict("gpu") == "busy"
            ),
        )
        first.process.send_signal(signal.SIGSTOP)  # its lease runs out: the second leads
        try:
            second.until("the second daemon leading", leads)
        finally:
            first.process.send_signal(signal.SIGCONT)
        page = first.until("the first cycling as a standby", lambda p: not leads(p))
        switch_mode(scene.gpu, "idle")
        second.until("gpu idle", lambda p: p.verdict("gpu") == "idle")
        for _ in range(3):
            page = first.next_cycle(page)
            assert not leads(page)
    # Before: "busy", heard while leading, for as long as it stood by. Now as a member
    # that never led shows a backend it does not read: the ledger's state, no verdict, no
    # examinations (which LLMHealthBackendWedged asks for before it calls DEAD alone).
    assert page.verdict("gpu") is None, page.verdict("gpu")
    assert page.get("llmhealth_backend_examinations_total", backend="gpu") is None
    assert page.state("gpu") is not None


@contextmanager
def _standing_by_with_a_share_in_prefill(
    entry_point: str, tmp_path: Path, stall_timeout: str
) -> Iterator[tuple[Watch, Watch, Page]]:
    """Two shard_reads members, the standby reading gpu1 in a long prefill (work, none of
    it finishing) and the leader gpu, whose requests finish: the fleet stall, "work
    pending somewhere and no backend finished a request", is a question of the whole
    fleet. Yields the leader, the standby and its page after 5 s of cycles side by side,
    the leader never saying stalled."""
    pairs = [(f"m{i}", f"n{i}") for i in range(50)]
    names = next(
        p for p in pairs if owner("gpu", list(p)) == p[0] and owner("gpu1", list(p)) == p[1]
    )
    top = f'stall_timeout = "{stall_timeout}"'
    with (
        staged(entry_point, tmp_path, more=1, cluster="shard_reads = true") as scene,
        ExitStack() as stack,
    ):
        switch_mode(scene.servers["gpu1"][0], "prefill")
        leader = stack.enter_context(scene.daemon("a", names[0], top=top))
        leader.until("the first daemon leading", leads)
        standby = stack.enter_context(scene.daemon("b", names[1], top=top))
        standby.until("the second daemon cycling", lambda p: p.cycled and not leads(p))
        page = leader.until(
            "two members sharing the reads",
            lambda p: len(p.samples("llmhealth_cluster_member_share_backends")) == 2,
        )
        mine = standby.scrape() or Page("")
        begun = time.monotonic()
        while time.monotonic() - begun < 5.0:  # past stall_timeout
            page = leader.next_cycle(page)
            mine = standby.next_cycle(mine)
            assert page.get("llmhealth_fleet_stalled") == 0.0, page.text
        yield leader, standby, mine


@pytest.mark.slow  # 10-20 s of real daemons on etcd
def test_a_sharded_standby_does_not_call_the_fleet_stalled_for_its_own_share(
    entry_point: str, tmp_path: Path
) -> None:
    with _standing_by_with_a_share_in_prefill(entry_point, tmp_path, "2s") as (_, _, mine):
        stalled = mine.get("llmhealth_fleet_stalled")
    # Before: 1.0 on the standby (LLMHealthFleetStalled, critical), 0.0 on the leader.
    assert stalled == 0.0, mine.get("llmhealth_fleet_seconds_since_last_finished_request")


@pytest.mark.slow  # 10-20 s of real daemons on etcd, the leader killed
def test_a_sharded_standby_that_takes_the_lead_does_not_call_the_fleet_stalled_from_its_share(
    entry_point: str, tmp_path: Path
) -> None:
    # Standing by, a member observes its share alone for the stall, no request finished
    # there since it started. Leading, it said the fleet stalled at once from that
    # share-only history (its log line, the gauge, STATUS), while the gpu its killed
    # leader read finished requests all along.
    with _standing_by_with_a_share_in_prefill(entry_point, tmp_path, "4s") as (
        leader,
        standby,
        _,
    ):
        leader.process.send_signal(signal.SIGKILL)
        page = standby.until("the standby leading", leads)
        for _ in range(6):
            page = standby.next_cycle(page)
        log = standby.stderr()
    # Before: "fleet stall: work is pending and no backend finished a request for N s"
    # on its first cycles as leader, gpu's finished requests not yet heard.
    assert "fleet stall" not in log, log
