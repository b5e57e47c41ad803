"""The cluster on a real etcd: one member name per process, its publications, wide proofs."""

from __future__ import annotations

import contextlib
import json
import socket
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from rich.console import Console

from llmhealth.choice import ANY_MODEL
from llmhealth.classify import Outcome, Read, Target, Verdict, VerdictKind
from llmhealth.cluster import (
    CALL_SECONDS,
    ClusterError,
    Elector,
    Etcd,
    EtcdStore,
    Keys,
    Observation,
    Seat,
    SharedReads,
    _b64,
    put,
    read_members,
)
from llmhealth.config import Backend, Config
from llmhealth.config import Cluster as ClusterConfig
from llmhealth.cycle import settle_fleet
from llmhealth.daemon import Daemon, News, Publication
from llmhealth.fleet import FleetRecord
from llmhealth.leadership import owner
from llmhealth.metrics import EngineSignals, Signals
from llmhealth.remediate import Mode, RestartOrder
from llmhealth.traffic import FailureKind, RequestOutcome
from tests.etcdproc import EtcdCluster, running_etcd
from tests.test_cluster import Clock, elector, read_posted
from tests.test_wire import tcp_server

if TYPE_CHECKING:
    from llmhealth.router import Router


@pytest.fixture(scope="module")
def etcd_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EtcdCluster]:
    with running_etcd(tmp_path_factory.mktemp("etcd")) as cluster:
        yield cluster


@pytest.fixture
def keys(request: pytest.FixtureRequest) -> Keys:
    return Keys(f"/llmhealth-members/{request.node.name}")


def frozen_wide_server(width: int = 128) -> Verdict:
    """A wedge proven on a server with ``width`` engines over a window of 61 reads."""
    engines = tuple(
        EngineSignals(
            str(i),
            running=3,
            waiting=1,
            steps=12345,
            generation_tokens=1234567,
            prompt_tokens=7654321,
            finished=1000,
            preemptions=0,
            kv_usage=0.42,
        )
        for i in range(width)
    )
    frozen = tuple(
        Read(1.7e9 + 5 * i, signals=Signals(engines, process_start=1.6e9)) for i in range(61)
    )
    return Verdict(VerdictKind.WEDGED, False, "wedged: frozen", reads=frozen)


def test_a_wedge_of_a_wide_server_does_not_stop_every_later_settle(
    etcd_server: EtcdCluster, keys: Keys
) -> None:
    """The record kept the reads of each condemnation's proof whole until the backend
    served again: 1.3 MB for a server of 128 engines frozen over 61 reads. Two such wedges
    (or one in a record of 500 backends) made a record over etcd's 1.5 MiB: etcd refused
    every save ("received message larger than max"), and the leader settled nothing more,
    the wedges never written down nor restarted, while they lasted."""
    targets = [Target(f"gpu{i}", f"http://127.0.0.1:{9 + i}") for i in range(3)]
    config = Config(backends=tuple(Backend(t.name, t.url) for t in targets))
    backends = {t.name: t.url for t in targets}
    etcd = Etcd(etcd_server.endpoints)
    leader = elector(etcd, keys, "a", Clock(), [])
    leader.step()
    store = EtcdStore(etcd, keys, leader)

    def settle(outcomes: list[Outcome]) -> FleetRecord:
        return settle_fleet(
            store, config, backends, lambda _: outcomes, mode=Mode.OFF, audit=store.audit
        ).record

    try:
        wedged = settle([Outcome(targets[i], frozen_wide_server()) for i in range(2)])
        assert wedged.ledger.state_of("gpu0") == wedged.ledger.state_of("gpu1") == "dead"
        down = settle([Outcome(targets[2], Verdict(VerdictKind.DOWN, False, "down: refused"))])
        assert down.ledger.state_of("gpu2") == "suspect"
        proof = down.proofs["gpu0"]
        assert proof["reads"] and proof["reads_left_out"] > 0
        assert proof["reads"][-1]["at"] == frozen_wide_server().reads[-1].at  # the newest
        assert proof["evidence"] == "wedged: frozen"
    finally:
        leader.stop()


def test_a_second_process_under_one_member_name_is_refused_not_settled_as_news(
    etcd_server: EtcdCluster, keys: Keys
) -> None:
    """Two processes started as one member (``member`` set in a config copied to two
    machines, a new process started before the old one is gone): each put the member key
    and the publication over the other's. Their serials are their own counts, so each
    overwrite was news to the leader: one failed read on each made three failures, DEAD,
    by the third wait, and more for as long as both ran."""
    backends = {f"gpu{index}": f"http://10.0.0.{index}:8000" for index in range(12)}
    clock = Clock()
    logs: list[list[str]] = [[], [], []]
    first = Seat(etcd_server.endpoints, keys.prefix, "a", 3.0, log=logs[0].append)
    twins = [Seat(etcd_server.endpoints, keys.prefix, "b", 3.0, log=log.append) for log in logs[1:]]
    seats = [first, *twins]
    reads = [SharedReads(seat, clock=clock) for seat in seats]
    try:
        for seat in seats:
            seat.elector.step()
        for seat in seats:
            seat.elector.observed = Observation(True, None, read_members(seat.etcd, seat.keys))
        leader, *readers = reads
        assert first.elector.decision().may_act
        assert leader.take(backends, 10.0, 300.0).verdicts == {}
        name = sorted(readers[0].share(backends))[0]
        down = Verdict(VerdictKind.DOWN, False, "down: refused")
        taken = 0
        for reader, serial in ((readers[0], 5), (readers[1], 1), (readers[0], 5)):
            with contextlib.suppress(ClusterError):
                reader.publish({name: serial}, {name: down}, {name: 1}, {})
            taken += name in leader.take(backends, 10.0, 300.0).verdicts
        assert taken == 1  # the one verdict of the process that holds the name (3 before)
        assert [line for line in logs[2] if "member name 'b' is held by another" in line]
        twins[0].elector.step()  # the holder's next round keeps it, and says nothing
        assert twins[0].elector.member_refused is None and not logs[1]
        # Once the holder is gone (it resigned), the other takes the name at its next round.
        twins[0].elector.stop()
        twins[1].elector.step()
        assert twins[1].elector.member_refused is None
        readers[1].publish({name: 1}, {name: down}, {name: 1}, {})
        assert name in leader.take(backends, 10.0, 300.0).verdicts
    finally:
        for seat in seats:
            seat.elector.stop()


def test_a_verdict_settled_before_its_reader_was_cut_off_is_not_settled_again_on_its_return(
    etcd_server: EtcdCluster, keys: Keys
) -> None:
    """A reader cut off from the leader's view (its member key gone past its lease: a
    pause, a partition) and back, still publishing the verdict it had not replaced (its
    backend undecided since, in a long step): the intake remembered only the newest
    settled (member, serial), the share's reader meanwhile's, and the returning reader's
    old failure was settled a second time."""
    backends = {f"gpu{index}": f"http://10.0.0.{index}:8000" for index in range(24)}
    clock = Clock()
    logs: list[str] = []
    seats = [Seat(etcd_server.endpoints, keys.prefix, n, 3.0, log=logs.append) for n in "abc"]
    leader, cut_off, other = (SharedReads(seat, clock=clock) for seat in seats)
    name = next(
        n for n in backends if owner(n, ["a", "b", "c"]) == "b" and owner(n, ["a", "c"]) == "c"
    )
    try:
        for seat in seats:
            seat.elector.step()
        everyone = read_members(seats[0].etcd, seats[0].keys)
        for seat in seats:
            seat.elector.observed = Observation(True, None, everyone)
        assert seats[0].elector.decision().may_act
        assert leader.take(backends, 60.0, 300.0).verdicts == {}
        old = Verdict(VerdictKind.DOWN, False, "down: refused (b's)")
        cut_off.publish({name: 5}, {name: old}, {name: 1}, {})
        assert leader.take(backends, 60.0, 300.0).verdicts[name] == old
        # b's member key gone from the leader's view: its share is c's now.
        without_b = tuple(member for member in everyone if member[0] != "b")
        seats[0].elector.observed = Observation(True, None, without_b)
        other.publish({name: 9}, {name: replace(old, evidence="down: (c's)")}, {name: 1}, {})
        assert leader.take(backends, 60.0, 300.0).verdicts[name].evidence == "down: (c's)"
        seats[0].elector.observed = Observation(True, None, everyone)  # b back
        again = leader.take(backends, 60.0, 300.0).verdicts
        assert name not in again, again  # b's failure of before, a second time
    finally:
        for seat in seats:
            seat.elector.stop()


def test_a_members_failed_publication_is_logged(
    etcd_server: EtcdCluster, keys: Keys, capsys: pytest.CaptureFixture[str]
) -> None:
    """A member whose verdicts etcd refused (here its lease is gone behind its back, as
    after a pause past its TTL; a publication too slow for its link, every wait) said
    nothing: the leader settled its share `stalled` ("no member has published a verdict
    of it; b reads it") and b's log was silent about why."""
    target = Target("gpu0", "http://127.0.0.1:9")
    cluster_config = ClusterConfig(
        tuple(etcd_server.endpoints), keys.prefix, 3.0, "b", shard_reads=True
    )
    config = Config(backends=(Backend("gpu0", target.url),), cluster=cluster_config)
    seat = Seat.for_config(cluster_config, [].append)
    daemon = Daemon(
        lambda: (config, [target]),
        seat,
        listen=None,
        wait_override=None,
        serving_file=None,
        console=Console(stderr=True),
    )
    try:
        seat.elector.step()
        lease = seat.elector.lease_id
        assert lease is not None
        seat.etcd.revoke(lease)
        down = Verdict(VerdictKind.DOWN, False, "down: refused")
        published = Publication({"gpu0": 1}, {"gpu0": down}, {"gpu0": 1}, {}, {})
        capsys.readouterr()
        daemon._settle(News([], [], published=published))
        logged = capsys.readouterr().err
        assert "not published" in logged and "lease not found" in logged, logged
    finally:
        seat.elector.stop()


def test_a_process_takes_back_its_own_member_key_left_on_a_lease_it_lost(
    etcd_server: EtcdCluster, keys: Keys
) -> None:
    """A lease this process lost without revoking it (etcd away at its step-down, and
    restored with the lease renewed) still holds its member key: that is no other
    process under its name."""
    log: list[str] = []
    seat = Seat(etcd_server.endpoints, keys.prefix, "c", 3.0, log=log.append)
    try:
        seat.elector.step()
        old = seat.elector.lease_id
        seat.elector._lose("etcd away")  # as when the keep-alive said the lease was gone
        seat.elector.step()
        assert seat.elector.lease_id not in (None, old)
        assert seat.elector.member_refused is None, log
        found = seat.etcd.get(keys.member("c"))
        assert found is not None and found.lease == seat.elector.lease_id
        assert old is not None
        seat.etcd.revoke(old)  # its leader key goes with it: the next round leads again
        seat.elector.step()
        assert seat.elector.decision().may_act and seat.elector.member_refused is None
    finally:
        seat.elector.stop()


@pytest.mark.slow
def test_many_condemned_backends_keep_the_record_within_etcd(
    etcd_server: EtcdCluster, keys: Keys
) -> None:
    """Each proof kept within 32 KiB does not keep the record within etcd's 1.5 MiB: the
    proofs stay until their backends serve again (a RETIRED one's for good), and a wedge
    of an ordinary one-engine server over 61 reads is 14 KB, kept whole. About a hundred
    of them and every save failed from then on: nothing more condemned,
    restarted or re-admitted while they lasted."""
    frozen = frozen_wide_server(width=1)
    targets = [Target(f"gpu{i}", f"http://127.0.0.1:{9 + i}") for i in range(120)]
    config = Config(backends=tuple(Backend(t.name, t.url) for t in targets))
    backends = {t.name: t.url for t in targets}
    etcd = Etcd(etcd_server.endpoints)
    leader = elector(etcd, keys, "a", Clock(), [])
    leader.step()
    store = EtcdStore(etcd, keys, leader)

    def settle(outcomes: list[Outcome]) -> FleetRecord:
        return settle_fleet(
            store, config, backends, lambda _: outcomes, mode=Mode.OFF, audit=store.audit
        ).record

    try:
        for start in range(0, 120, 10):  # ten more condemned every settle
            record = settle([Outcome(target, frozen) for target in targets[start : start + 10]])
        assert record.ledger.state_of("gpu119") == "dead"
        for name in ("gpu0", "gpu119"):  # the first one trimmed again as more came
            proof = record.proofs[name]
            assert proof["reads"][-1]["at"] == frozen.reads[-1].at  # the newest kept
            assert proof["reads_left_out"] == 61 - len(proof["reads"])
    finally:
        leader.stop()


def test_a_leader_whose_member_key_another_process_holds_leads_no_more(
    etcd_server: EtcdCluster, keys: Keys
) -> None:
    """README: a process whose member name another process holds "leads nothing". A
    leader whose key another took (an earlier build's process under its name writes over
    it, as it always did; or the key deleted and taken) went on leading: it stopped
    confirming its leader key too, every round, so a deleted one went unnoticed."""
    etcd = Etcd(etcd_server.endpoints)
    clock, log = Clock(), list[str]()
    leader = elector(etcd, keys, "x", clock, log)
    other = elector(etcd, keys, "x", clock, log)
    try:
        leader.step()
        assert leader.decision().may_act
        lease = etcd.grant(3)  # an earlier build's process "x": no compare, no `process`
        value = json.dumps({"member": "x", "host": "h2", "pid": 7, "lease": lease})
        etcd.txn([], [put(keys.member("x"), value.encode(), lease)])
        leader.step()
        assert leader.member_refused is not None
        assert not leader.decision().may_act, "refused, and still leading"
        etcd.revoke(lease)  # that process ends: its name is free again
        leader.step()  # a new lease: the name and the lead are its again
        assert leader.member_refused is None and leader.decision().may_act
        other.step()
        assert other.member_refused is not None and not other.decision().may_act
    finally:
        leader.stop()
        other.stop()


def test_a_member_key_write_whose_answer_was_lost_is_not_refused_as_anothers(
    etcd_server: EtcdCluster, keys: Keys
) -> None:
    """The member key created on this lease, its answer lost and the write offered to the
    next endpoint: the compare failed on the key the first attempt made, and the process
    refused its own name ("held by another process (host <its own>, pid <its own>)"): no
    campaign that round, and its publication refused."""
    txns = []

    def forward(connection: socket.socket, number: int) -> None:
        host, _, port = etcd_server.endpoints[0].removeprefix("http://").partition(":")
        head, body = read_posted(connection)
        answer = b""
        with socket.create_connection((host, int(port)), timeout=5) as upstream:
            upstream.sendall(head + b"\r\n\r\n" + body)
            while chunk := upstream.recv(65536):
                answer += chunk
        if head.startswith(b"POST /v3/kv/txn "):
            txns.append(number)
            if len(txns) == 2:  # the member key's creation, the first's compare failed
                return
        connection.sendall(answer)

    log: list[str] = []
    with tcp_server(forward) as (lossy, _):
        etcd = Etcd([lossy, *etcd_server.endpoints])
        member = elector(etcd, keys, "c", Clock(), log)
        try:
            member.step()
            assert len(txns) >= 2
            assert member.member_refused is None, log
            assert member.decision().may_act
        finally:
            member.stop()


def test_a_publication_without_a_lease_is_not_logged_as_published_again(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """etcd away: the publication failed and was logged; at the renew deadline the member
    stepped down, its lease gone, and ``publish`` returned at once (nothing while it has
    no lease): logged "published again", the last word of the whole outage."""
    with running_etcd(tmp_path) as etcd_cluster:
        target = Target("gpu0", "http://127.0.0.1:9")
        cluster_config = ClusterConfig(
            tuple(etcd_cluster.endpoints), "/llmhealth-members/away", 3.0, "b", shard_reads=True
        )
        config = Config(backends=(Backend("gpu0", target.url),), cluster=cluster_config)
        seat, clock, daemon = on_a_seat(config, [target])
        shares = daemon._shares
        assert shares is not None
        down = Verdict(VerdictKind.DOWN, False, "down: refused")
        published = Publication({"gpu0": 1}, {"gpu0": down}, {"gpu0": 1}, {}, {})
        try:
            seat.elector.step()
            etcd_cluster.members[0].stop()
            capsys.readouterr()
            daemon._publish(shares, published)
            assert "not published" in capsys.readouterr().err
            clock.now += 10.0  # past the renew deadline: it steps down, and gets no lease
            with contextlib.suppress(ClusterError):
                seat.elector.step()
            assert seat.elector.lease_id is None
            daemon._publish(shares, published)
            assert "published again" not in capsys.readouterr().err
        finally:
            seat.elector.stop()


@pytest.mark.slow
def test_a_shard_reader_in_read_workers_keeps_the_step_of_a_backend_a_reload_renames(
    etcd_server: EtcdCluster, keys: Keys, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A reload's renamed backend starts its reading with the longest step the record
    learned of it (``Daemon._reload_config``). With shard_reads, the new name is read
    only from the next cycle's share, and read workers (``ReadPool``) dropped what they
    were told to remember of a target no worker read yet: the step was lost, and the
    share's own news of the new name (the record still called it by the old) had none.
    An engine inside a long step (frozen) was wedged at two waits."""
    import asyncio  # noqa: PLC0415
    import os  # noqa: PLC0415
    import signal  # noqa: PLC0415
    import time  # noqa: PLC0415

    from pytest_httpserver import HTTPServer  # noqa: PLC0415

    from llmhealth.cycle import fresh_record, ledger_policy  # noqa: PLC0415
    from llmhealth.fleet import Sighting  # noqa: PLC0415
    from llmhealth.metrics import parse_metrics  # noqa: PLC0415
    from llmhealth.window import LongestStep  # noqa: PLC0415

    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    frozen = (Path(__file__).parent.parent / "fixtures" / "vllm-0.32" / "wedge-1.txt").read_text()
    with HTTPServer() as server:
        server.expect_request("/metrics").respond_with_data(frozen, content_type="text/plain")
        url = server.url_for("").rstrip("/")
        elsewhere = "http://127.0.0.1:9"
        cluster_config = ClusterConfig(
            tuple(etcd_server.endpoints), keys.prefix, 3.0, "m", shard_reads=True
        )
        config = Config(timeout=1.0, answer_timeout=1.0, read_workers=2, cluster=cluster_config)
        now = time.time()
        record = fresh_record(ledger_policy(config.policy), {"a": url, "x": elsewhere}, now - 100)
        step = LongestStep(600.0, "a long prefill seen")  # a window of 1,800 s
        record.sightings["a"] = Sighting(now - 10, True, parse_metrics(frozen), step)
        verb = EtcdStore(Etcd(etcd_server.endpoints), keys, None)
        with verb.locked():
            verb.load(dict)
            verb.save(record.to_dict())
        fleets = [[Target("a", url), Target("x", elsewhere)]]
        seat = Seat.for_config(cluster_config, [].append)
        daemon = Daemon(
            lambda: (config, fleets[-1]),
            seat,
            listen=None,
            wait_override=0.1,
            serving_file=None,
            console=Console(stderr=True),
        )

        async def kinds_read(name: str) -> list[str]:
            kinds: list[str] = []
            for _ in range(1500):
                probe = daemon._state.probes.get(name)
                if probe is not None and probe.outcome is not None:
                    kind = str(probe.outcome.verdict.kind)
                    if not kinds or kinds[-1] != kind:
                        kinds.append(kind)
                if probe is not None and probe.examinations >= 6:
                    break
                await asyncio.sleep(0.02)
            probe = daemon._state.probes.get(name)
            # Read past two waits, or "not wedged" proves nothing (a reload that never came).
            assert probe is not None and probe.examinations >= 6, f"{name} was not read enough"
            return kinds

        async def scenario() -> tuple[list[str], list[str]]:
            running = asyncio.create_task(daemon.run())
            try:
                before = await kinds_read("a")
                fleets.append([Target("b", url), Target("x", elsewhere)])
                os.kill(os.getpid(), signal.SIGHUP)
                return before, await kinds_read("b")
            finally:
                daemon.stop()
                assert await asyncio.wait_for(running, 20.0) == 0

        before, after = asyncio.run(scenario())
    assert "wedged" not in before
    # Before: after == ["wedged"].
    assert "wedged" not in after


@dataclass
class _Leading:
    """Member "m" leading on a saved record of backends a (refusing every connection) and
    b, with its config and targets and the clock its elector reads."""

    config: Config
    targets: list[Target]
    seat: Seat
    clock: Clock
    refused: str


def _leading_to_a_refusing_backend(
    etcd_server: EtcdCluster, keys: Keys, monkeypatch: pytest.MonkeyPatch
) -> _Leading:
    from llmhealth.cycle import fresh_record, ledger_policy  # noqa: PLC0415
    from tests.etcdproc import free_port  # noqa: PLC0415

    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    refused = f"http://127.0.0.1:{free_port()}"  # every request through it fails
    cluster_config = ClusterConfig(tuple(etcd_server.endpoints), keys.prefix, 3.0, "m")
    backends = (Backend("a", refused), Backend("b", "http://127.0.0.1:9"))
    config = Config(backends=backends, cluster=cluster_config)
    record = fresh_record(ledger_policy(config.policy), {b.name: b.url for b in backends}, 1e9)
    verb = EtcdStore(Etcd(etcd_server.endpoints), keys, None)
    with verb.locked():
        verb.load(dict)
        verb.save(record.to_dict())
    seat = Seat.for_config(cluster_config, [].append)
    clock = Clock()
    seat.elector._clock = clock  # leads while the test runs, however slowly
    seat.elector.step_and_observe()
    assert seat.elector.decision().may_act
    return _Leading(config, [Target(b.name, b.url) for b in backends], seat, clock, refused)


@contextlib.asynccontextmanager
async def _routing_a_failure(leading: _Leading) -> AsyncIterator[tuple[Router, Daemon]]:
    """Its daemon and router, the router having failed one request on a (so out of its
    choice until a settle says otherwise); both closed after."""
    import httpx  # noqa: PLC0415

    from llmhealth.config import Router as RouterConfig  # noqa: PLC0415
    from llmhealth.router import Router  # noqa: PLC0415
    from tests.etcdproc import free_port  # noqa: PLC0415

    router = Router(RouterConfig(connect_timeout=1.0), leading.config.backends)
    daemon = Daemon(
        lambda: (leading.config, leading.targets),
        leading.seat,
        listen=None,
        wait_override=0.2,
        serving_file=None,
        console=Console(stderr=True),
        router=router,
    )
    port = free_port()
    await router.start("127.0.0.1", port)
    try:
        router.push({"a": ANY_MODEL}, {"a": "healthy", "b": "healthy"}, 1)
        async with httpx.AsyncClient() as client:
            answer = await client.post(
                f"http://127.0.0.1:{port}/v1/completions",
                json={"model": "m", "prompt": "x"},
                timeout=10.0,
            )
        assert answer.status_code >= 500 and "a" not in router._pick_set()
        yield router, daemon
    finally:
        await daemon._reading.close()
        await router.close()


async def _cycles(daemon: Daemon, count: int) -> str:
    """Run its loop for ``count`` cycles, then stop it; the notes its cycles left."""
    import asyncio  # noqa: PLC0415

    looping = asyncio.create_task(daemon._loop())
    for _ in range(500):
        if daemon._state.cycles >= count:
            break
        await asyncio.sleep(0.01)
    daemon.stop()
    await asyncio.wait_for(looping, 20.0)
    assert daemon._state.cycles >= count, f"{count} cycles did not run"
    return " ".join(daemon._state.notes)


@pytest.mark.parametrize("cut_off", ["fenced out", "etcd away past the renew deadline"])
def test_a_leaders_settle_that_writes_nothing_gives_the_routers_failures_back(
    etcd_server: EtcdCluster, keys: Keys, monkeypatch: pytest.MonkeyPatch, cut_off: str
) -> None:
    """A leader's settle that fails in etcd (fenced out; cut off, deposed) stands by for
    the cycle, and so does a leader stepping down with etcd away past its renew deadline
    (a few seconds of a lease_ttl). The failures of real traffic it drained from the
    router were never given back, as a save that fails on disk gives them: the push
    after it let the failing backend back into the router's choice, each wait for as
    long as etcd stayed away, and the next settle, leader again, had never heard of
    them."""
    import asyncio  # noqa: PLC0415

    leading = _leading_to_a_refusing_backend(etcd_server, keys, monkeypatch)
    seat = leading.seat

    async def scenario() -> tuple[bool, bool, str]:
        async with _routing_a_failure(leading) as (router, daemon):
            if cut_off == "fenced out":
                # Another member took the leader key: this one's cached view still leads,
                # and its save fails on the fence (FencedOutError), after the drain.
                seat.etcd.txn([], [{"request_delete_range": {"key": _b64(keys.leader)}}])
                seat.etcd.txn([], [put(keys.leader, b'{"member": "other"}')])
            else:  # no renewal answered for longer than the renew deadline
                leading.clock.now += seat.elector.timing.renew_deadline + 1
                assert not seat.elector.decision().may_act
            notes = await _cycles(daemon, 1)
            return router._log.has_failure("a"), "a" in router._pick_set(), notes

    try:
        kept, chosen, notes = asyncio.run(scenario())
    finally:
        seat.elector.stop()
    assert ("did not settle" if cut_off == "fenced out" else "standby") in notes, notes
    assert kept, "the failure the settle drained was lost"
    assert not chosen, "the failing backend went back to the router's choice"


def test_a_leader_stepped_down_by_its_elector_with_etcd_away_keeps_the_routers_failures(
    etcd_server: EtcdCluster, keys: Keys, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As above, with the elector's thread doing what it does: its next round past the
    renew deadline steps down (its lease forgotten) and fails to get another, so every
    settle after that one sees a standby, not one stepping down. Those dropped the
    router's failures, and the failing backend went back into the choice each wait for
    as long as etcd stayed away, as before the fix."""
    import asyncio  # noqa: PLC0415

    from llmhealth import etcd_http  # noqa: PLC0415
    from llmhealth.leadership import Standing  # noqa: PLC0415

    leading = _leading_to_a_refusing_backend(etcd_server, keys, monkeypatch)
    seat = leading.seat

    async def scenario() -> tuple[bool, bool, str]:
        async with _routing_a_failure(leading) as (router, daemon):
            # etcd away (every endpoint refuses) past the renew deadline, and the
            # elector's round: it steps down, and no lease is granted.
            seat.etcd._wires = seat.elector.etcd._wires = [
                etcd_http.Endpoint.from_url(leading.refused)
            ]
            leading.clock.now += seat.elector.timing.renew_deadline + 1
            with contextlib.suppress(ClusterError):
                seat.elector.step()
            seat.elector.observed = Observation(False, None, seat.elector.observed.members)
            assert seat.elector.decision().standing is Standing.STANDBY
            notes = await _cycles(daemon, 2)
            return router._log.has_failure("a"), "a" in router._pick_set(), notes

    try:
        kept, chosen, notes = asyncio.run(scenario())
    finally:
        seat.elector.stop(resign=False)
    assert "standby" in notes, notes
    assert kept, "the failure the stepped-down settles drained was lost"
    assert not chosen, "the failing backend went back to the router's choice"


def _a_stepped_down_member(
    etcd_server: EtcdCluster, keys: Keys, monkeypatch: pytest.MonkeyPatch
) -> tuple[Seat, Daemon, Clock, Etcd]:
    """Member "m" leading on a saved record of backends a and b; its daemon has no router
    (``_settle`` is given the router's outcomes as the loop drains them)."""
    from llmhealth.cycle import fresh_record, ledger_policy  # noqa: PLC0415

    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    cluster_config = ClusterConfig(tuple(etcd_server.endpoints), keys.prefix, 3.0, "m")
    backends = (Backend("a", "http://127.0.0.1:9"), Backend("b", "http://127.0.0.2:9"))
    config = Config(backends=backends, cluster=cluster_config)
    targets = [Target(b.name, b.url) for b in backends]
    record = fresh_record(ledger_policy(config.policy), {b.name: b.url for b in backends}, 1e9)
    admin = Etcd(etcd_server.endpoints)
    verb = EtcdStore(admin, keys, None)
    with verb.locked():
        verb.load(dict)
        verb.save(record.to_dict())
    seat = Seat.for_config(cluster_config, [].append)
    clock = Clock()
    seat.elector._clock = clock
    seat.elector.step_and_observe()
    assert seat.elector.decision().may_act
    daemon = Daemon(
        lambda: (config, targets),
        seat,
        listen=None,
        wait_override=0.2,
        serving_file=None,
        console=Console(stderr=True),
    )
    return seat, daemon, clock, admin


def _failed_request() -> dict[str, tuple[RequestOutcome, ...]]:
    import time  # noqa: PLC0415

    failure = RequestOutcome(time.time(), "POST", "/v1/completions", FailureKind.REFUSED)
    return {"a": (failure,)}


def test_a_settle_during_the_round_that_steps_down_keeps_the_routers_failures(
    etcd_server: EtcdCluster, keys: Keys, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A leader whose elector ran no round for a renew deadline (the process paused, as
    a VM migrating does) while etcd went silent: its next round steps down, then waits
    seconds on etcd for a new lease. A settle meanwhile (the loop is late too) saw a
    standby whose last observation, the round before the pause, said etcd answered, and
    dropped the router's failures: only a round that had failed since kept them."""
    import threading  # noqa: PLC0415

    seat, daemon, clock, _ = _a_stepped_down_member(etcd_server, keys, monkeypatch)
    elector = seat.elector
    asked, answer = threading.Event(), threading.Event()

    def silent_grant(ttl: int) -> int:
        asked.set()
        answer.wait(20.0)
        raise ClusterError("etcd: no answer")

    monkeypatch.setattr(elector.etcd, "grant", silent_grant)
    clock.now += elector.timing.renew_deadline + 1

    def round_run() -> None:
        with contextlib.suppress(ClusterError):
            elector.step()

    round_ = threading.Thread(target=round_run)
    round_.start()
    try:
        assert asked.wait(20.0), "the round did not ask for a lease"
        assert not elector.decision().may_act
        requests = _failed_request()
        kept = settled(daemon, requests)
    finally:
        answer.set()
        round_.join(20.0)
        elector.stop(resign=False)
        asyncio_run_close(daemon)
    assert kept == requests, "the failures drained in the stepping-down round were dropped"


def test_a_stepped_down_member_drops_what_it_kept_once_etcd_shows_another_leader(
    etcd_server: EtcdCluster, keys: Keys, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Kept while etcd is away; once a whole round shows another member leading, this one
    is a standby like any other: the router's outcomes are not written down (the other
    leader's record never hears of them) nor kept on."""
    from llmhealth import etcd_http  # noqa: PLC0415
    from tests.etcdproc import free_port  # noqa: PLC0415

    seat, daemon, clock, admin = _a_stepped_down_member(etcd_server, keys, monkeypatch)
    elector = seat.elector
    lease = elector.lease_id
    assert lease is not None
    wires = seat.etcd._wires
    other = elector_for(etcd_server, keys, "o")
    try:
        seat.etcd._wires = seat.elector.etcd._wires = [
            etcd_http.Endpoint.from_url(f"http://127.0.0.1:{free_port()}")
        ]
        clock.now += elector.timing.renew_deadline + 1
        with contextlib.suppress(ClusterError):
            elector.step_and_observe()
        elector.observed = Observation(False, None, elector.observed.members)  # as _run does
        requests = _failed_request()
        kept = settled(daemon, requests)
        assert kept == requests
        admin.revoke(lease)  # its lease ran out meanwhile: "o" leads
        other.step_and_observe()
        assert other.decision().may_act
        seat.etcd._wires = seat.elector.etcd._wires = wires
        elector.step_and_observe()
        assert not elector.decision().may_act and not elector.led_last
        assert settled(daemon, kept) is None
    finally:
        other.stop()
        elector.stop(resign=False)
        asyncio_run_close(daemon)
    store = EtcdStore(Etcd(etcd_server.endpoints), keys, None)
    with store.locked():
        saved = store.load(dict)
    assert "request_streaks" not in saved or "a" not in saved["request_streaks"], saved


def test_a_stepped_down_member_leading_again_settles_what_it_kept_once(
    etcd_server: EtcdCluster, keys: Keys, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Kept while etcd is away; leading again when it answers, written down by the first
    settle, and not given back to be counted a second time."""
    from llmhealth import etcd_http  # noqa: PLC0415
    from tests.etcdproc import free_port  # noqa: PLC0415

    seat, daemon, clock, admin = _a_stepped_down_member(etcd_server, keys, monkeypatch)
    elector = seat.elector
    lease = elector.lease_id
    assert lease is not None
    wires = seat.etcd._wires
    try:
        seat.etcd._wires = seat.elector.etcd._wires = [
            etcd_http.Endpoint.from_url(f"http://127.0.0.1:{free_port()}")
        ]
        clock.now += elector.timing.renew_deadline + 1
        with contextlib.suppress(ClusterError):
            elector.step_and_observe()
        elector.observed = Observation(False, None, elector.observed.members)
        requests = _failed_request()
        kept = settled(daemon, requests)
        assert kept == requests
        admin.revoke(lease)
        seat.etcd._wires = seat.elector.etcd._wires = wires
        elector.step_and_observe()
        assert elector.decision().may_act and elector.led_last
        assert settled(daemon, kept) is None
        assert settled(daemon, None) is None
        failures = daemon._snapshots["a"].request_failures
    finally:
        elector.stop(resign=False)
        asyncio_run_close(daemon)
    assert failures == 1, failures


def on_a_seat(config: Config, targets: list[Target]) -> tuple[Seat, Clock, Daemon]:
    """A daemon on the seat of ``config``'s [cluster], its elector on a clock the test
    moves (so that it leads however slowly the test runs)."""
    assert config.cluster is not None
    seat = Seat.for_config(config.cluster, [].append)
    clock = Clock()
    seat.elector._clock = clock
    daemon = Daemon(
        lambda: (config, targets),
        seat,
        listen=None,
        wait_override=None,
        serving_file=None,
        console=Console(stderr=True),
    )
    return seat, clock, daemon


def settled(daemon: Daemon, requests: dict[str, tuple[RequestOutcome, ...]] | None) -> object:
    """One settle of what the router drained, as the loop makes it: what it kept back."""
    daemon._unsettled_requests = None
    daemon._settle(News([], [], requests))
    return daemon._unsettled_requests


def elector_for(etcd_server: EtcdCluster, keys: Keys, member: str) -> Elector:
    cluster_config = ClusterConfig(tuple(etcd_server.endpoints), keys.prefix, 3.0, member)
    return Seat.for_config(cluster_config, [].append).elector


def asyncio_run_close(daemon: Daemon) -> None:
    import asyncio  # noqa: PLC0415

    asyncio.run(daemon._reading.close())


def test_a_restart_whose_last_look_outlasted_the_lead_is_not_run(
    etcd_server: EtcdCluster, keys: Keys, tmp_path: Path
) -> None:
    """The fencing token is given to the command when it is launched; its thread then
    reads the record (has a verb withdrawn it?), which with etcd slow or away takes a
    call's whole bound, and ran the command when that read ended: past the renew
    deadline the lead had when the read began, as etcd may be giving it to another."""
    target = Target("gpu0", "http://127.0.0.1:9")
    cluster_config = ClusterConfig(tuple(etcd_server.endpoints), keys.prefix, 3.0, "a")
    config = Config(backends=(Backend("gpu0", target.url),), cluster=cluster_config)
    seat, clock, daemon = on_a_seat(config, [target])
    ran = tmp_path / "ran"
    try:
        seat.elector.step()
        assert seat.elector.decision().may_act
        with seat.store.locked():
            seat.store.load(lambda document: document)
            seat.store.save({})  # the save that committed the restart, under this fence
        order = RestartOrder(
            "gpu0", target.url, ("touch", str(ran)), 10.0, 0.0, "wedged", seat.store.command_env()
        )
        read = seat.store.read

        def slow_read(decode: Callable[[dict[str, Any]], object]) -> object:
            clock.now += CALL_SECONDS  # the read took its call's whole bound
            return read(decode)

        seat.store.read = slow_read  # type: ignore[method-assign]
        done = daemon._run_unless_withdrawn(order)
        assert not ran.exists()
        assert done.result.exit_code is None and "not run" in done.result.stderr
    finally:
        seat.elector.stop()
