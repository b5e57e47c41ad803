"""Leadership and the fenced store against a real etcd (started here, on free ports).

The electors are stepped by hand (``step()``), not by their threads, and their monotonic
clock is a value the test moves: what is under test is what etcd answers and what each
daemon concludes from it, never how fast a loaded machine runs.
"""

from __future__ import annotations

import base64
import contextlib
import json
import re
import socket
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
from pytest_httpserver import HTTPServer

from llmhealth import cluster, etcd_http, leadership, operate
from llmhealth.actions import AuditError
from llmhealth.classify import Answer, Read, Verdict, VerdictKind
from llmhealth.cluster import (
    AUDIT_RECORD_BYTES,
    ClusterUnavailableError,
    Elector,
    Etcd,
    EtcdStore,
    FencedOutError,
    Keys,
    KeyValue,
    NotLeaderError,
    Observation,
    ReadOnlyStore,
    Seat,
    SharedReads,
    describe,
    read_audit,
    read_leader,
    read_members,
)
from llmhealth.config import Backend, Config
from llmhealth.config import Cluster as ClusterConfig
from llmhealth.cycle import run_cycle_in_cluster
from llmhealth.fleet import FleetRecord
from llmhealth.leadership import LeaseTiming, Standing
from llmhealth.ledger import Ledger, LedgerPolicy, Readmitted
from llmhealth.metrics import EngineSignals, Signals
from llmhealth.probe import ProbeSettings
from llmhealth.remediate import Mode
from llmhealth.state import RecordMovedError, StateLockedError
from tests.etcdproc import EtcdCluster, free_port, running_etcd
from tests.test_wire import Handler, read_request, tcp_server

TIMING = LeaseTiming.for_ttl(3.0)


@pytest.fixture(scope="module")
def etcd_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EtcdCluster]:
    with running_etcd(tmp_path_factory.mktemp("etcd")) as cluster:
        yield cluster


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def keys(request: pytest.FixtureRequest) -> Keys:
    return Keys(f"/llmhealth-test/{request.node.name}")


def elector(etcd: Etcd, keys: Keys, name: str, clock: Clock, log: list[str]) -> Elector:
    return Elector(etcd, keys, name, TIMING, log=log.append, clock=clock)


def document(value: int) -> dict[str, object]:
    return {"value": value}


def test_of_two_daemons_exactly_one_leads_and_its_fence_is_the_leader_key(
    etcd_server: EtcdCluster, keys: Keys
) -> None:
    etcd = Etcd(etcd_server.endpoints)
    clock, log = Clock(), []
    first, second = elector(etcd, keys, "a", clock, log), elector(etcd, keys, "b", clock, log)
    first.step()
    second.step()
    assert first.decision().standing is Standing.LEADER
    assert second.decision().standing is Standing.STANDBY
    leader = read_leader(etcd, keys)
    assert leader is not None
    assert (leader.member, leader.fence, leader.lease) == ("a", first.fence, first.lease_id)
    assert second.fence is None
    members = etcd.get_prefix(keys.members)
    assert sorted(members) == [keys.member("a"), keys.member("b")]
    first.stop()
    second.stop()


def test_a_resigning_leader_hands_over_at_the_next_campaign(
    etcd_server: EtcdCluster, keys: Keys
) -> None:
    etcd = Etcd(etcd_server.endpoints)
    clock, log = Clock(), []
    first, second = elector(etcd, keys, "a", clock, log), elector(etcd, keys, "b", clock, log)
    first.step()
    second.step()
    old_fence = first.fence
    first.stop(resign=True)  # revokes the lease: leader and member keys go with it
    second.step()
    assert second.decision().may_act
    assert second.fence is not None and old_fence is not None
    assert second.fence > old_fence  # a later leader always holds a larger token
    assert keys.member("a") not in etcd.get_prefix(keys.members)
    second.stop()


def test_a_campaign_whose_answer_was_lost_leads_by_the_key_it_made(
    etcd_server: EtcdCluster, keys: Keys
) -> None:
    # The campaign's transaction reached etcd but its answer did not: the next round's
    # compare fails on our own key. Before, the key sat on a lease we kept renewing and
    # nobody led again.
    etcd = Etcd(etcd_server.endpoints)
    clock, log = Clock(), []
    holder, lost = elector(etcd, keys, "a", clock, log), elector(etcd, keys, "b", clock, log)
    holder.step()
    lost.step()  # has its lease; "a" leads
    assert lost.lease_id is not None and not lost.decision().may_act
    holder.stop(resign=True)
    value = b'{"member": "b", "since": 1.0}'
    etcd.txn([], [cluster.put(keys.leader, value, lost.lease_id)])  # the campaign's write
    made = etcd.get(keys.leader)
    assert made is not None
    lost.step()
    assert lost.decision().may_act
    assert lost.fence == made.create_revision
    leader = read_leader(etcd, keys)
    assert leader is not None and leader.member == "b"
    lost.stop()


def test_a_leader_past_its_renew_deadline_steps_down_and_may_not_save(
    etcd_server: EtcdCluster, keys: Keys
) -> None:
    etcd = Etcd(etcd_server.endpoints)
    clock, log = Clock(), []
    leader = elector(etcd, keys, "a", clock, log)
    leader.step()
    store = EtcdStore(etcd, keys, leader)
    with store.locked():
        store.load(dict)
        store.save(document(1))
        # Paused past the deadline in the middle of a settle: its own clock says stop.
        clock.now += TIMING.renew_deadline
        with pytest.raises(NotLeaderError, match="may no longer act"):
            store.save(document(2))
    with pytest.raises(NotLeaderError, match="does not lead"), store.locked():
        pass
    assert Etcd(etcd_server.endpoints).get(keys.state) is not None
    assert store_value(etcd, keys) == 1
    leader.step()  # steps down and campaigns again on a new lease: leads again, no rival
    assert any("steps down" in line for line in log)
    assert leader.decision().may_act
    leader.stop()


def store_value(etcd: Etcd, keys: Keys) -> object:
    loaded = EtcdStore(etcd, keys, None)
    with loaded.locked():
        record = loaded.load(dict)
    assert record is not None
    return record["value"]


def test_a_deposed_leader_that_still_believes_it_leads_writes_nothing(
    etcd_server: EtcdCluster, keys: Keys
) -> None:
    etcd = Etcd(etcd_server.endpoints)
    clock, log = Clock(), []
    old, new = elector(etcd, keys, "old", clock, log), elector(etcd, keys, "new", clock, log)
    old.step()
    new.step()
    old_store = EtcdStore(etcd, keys, old)
    with old_store.locked():
        old_store.load(dict)
        old_store.save(document(1))
        old_lease = old.lease_id
        assert old_lease is not None
        # Its lease expires behind its back (as after a long GC pause shorter than its own
        # deadline as it measures it): etcd deletes its keys, the other daemon leads.
        etcd.revoke(old_lease)
        new.step()
        assert new.decision().may_act
        assert old.decision().may_act  # nothing told it yet: only the fence stops it
        with pytest.raises(FencedOutError, match="new leads"):
            old_store.save(document(99))
    assert store_value(etcd, keys) == 1
    new_store = EtcdStore(etcd, keys, new)
    with new_store.locked():
        loaded = new_store.load(dict)
        assert loaded is not None
        assert (loaded["value"], loaded["written_by"]["member"]) == (1, "old")
        new_store.save(document(2))
    old.step()  # it learns the lease is gone and joins as a standby
    assert old.decision().standing is Standing.STANDBY
    assert any("no longer leader" in line for line in log)
    old.stop()
    new.stop()


def test_a_write_between_read_and_save_fails_the_save(etcd_server: EtcdCluster, keys: Keys) -> None:
    etcd = Etcd(etcd_server.endpoints)
    first, second = EtcdStore(etcd, keys, None), EtcdStore(etcd, keys, None)
    with first.locked():
        assert first.load(dict) is None
        with second.locked():
            assert second.load(dict) is None
            second.save(document(2))
        with pytest.raises(RecordMovedError, match="written by another since it was read"):
            first.save(document(1))
    assert store_value(etcd, keys) == 2


def saved_fleet_of_one(etcd: Etcd, keys: Keys) -> EtcdStore:
    """A verb's store over a saved record of one healthy backend, gpu0."""
    store = EtcdStore(etcd, keys, None)
    with store.locked():
        store.load(dict)
        ledger = Ledger(LedgerPolicy(), [("gpu0", "http://10.0.0.5:8000")], now=0.0)
        store.save(FleetRecord(ledger).to_dict())
    return store


def test_a_verb_raced_by_a_settle_is_made_again_on_the_record_as_it_now_is(
    etcd_server: EtcdCluster, keys: Keys
) -> None:
    """A leader settles every wait: an operator's verb whose save lost the race wrote
    nothing and exited 3 ("run it again"); it is made again, and audited once."""
    etcd = Etcd(etcd_server.endpoints)
    store = saved_fleet_of_one(etcd, keys)

    class RacedAudit:
        """The verb's own audit, with a settle's write slipped in at its first record:
        between the verb's load and its save."""

        def __init__(self) -> None:
            self.raced = 0

        def append(self, record: Mapping[str, object]) -> None:
            if not self.raced:
                self.raced += 1
                settle = EtcdStore(etcd, keys, None)
                with settle.locked():
                    settle.save(settle.load(dict) or {})
            store.audit.append(record)

        def batch(self) -> contextlib.AbstractContextManager[None]:
            return contextlib.nullcontext()

    raced = RacedAudit()
    held = operate.hold(store, raced, Config(), "gpu0", 3600.0, "weight sync")
    assert held.applied and raced.raced == 1
    with store.locked():
        saved = store.load(lambda doc: FleetRecord.from_dict(doc, LedgerPolicy()))
    assert saved is not None and saved.holds["gpu0"].reason == "weight sync"
    trail = read_audit(etcd, keys).records
    assert [r["event"] for r in trail] == ["hold"]


def test_a_refused_verb_raced_by_a_settle_is_made_again_and_refused(
    etcd_server: EtcdCluster, keys: Keys
) -> None:
    """A refusal writes its audit record alone, on the record it read: a settle landing in
    between failed it as "fenced out" (exit 3, naming a leader), where it is a refusal
    like any other once made again on the record as it now is."""
    etcd = Etcd(etcd_server.endpoints)
    store = saved_fleet_of_one(etcd, keys)
    raced = []

    def readmit_raced(now: float) -> Readmitted:
        if not raced:  # between the verb's load and its write, a settle saves
            raced.append(now)
            settle = EtcdStore(etcd, keys, None)
            with settle.locked():
                settle.save(settle.load(dict) or {})
        return Readmitted(now=now)

    result = operate.apply_event(store, store.audit, Config(), "gpu0", readmit_raced, "readmit")
    assert len(raced) == 1
    assert not result.applied and "readmit refused in healthy" in result.message
    trail = read_audit(etcd, keys).records
    assert [(r["event"], r["applied"]) for r in trail] == [("readmit", False)]


def test_a_leaders_save_raced_by_an_operator_verb_is_a_moved_record_not_a_fence(
    etcd_server: EtcdCluster, keys: Keys
) -> None:
    """A verb saved between a leader's load and save: the leader still leads and may settle
    again on the verb's record (the daemon does); reported as fenced out, naming itself,
    it stood by and lost the cycle's verdicts."""
    etcd = Etcd(etcd_server.endpoints)
    clock, log = Clock(), []
    leader = elector(etcd, keys, "leader", clock, log)
    leader.step()
    store, verb = EtcdStore(etcd, keys, leader), EtcdStore(etcd, keys, None)
    with pytest.raises(RecordMovedError, match="an operator's verb"), store.locked():
        store.load(dict)
        with verb.locked():
            verb.load(dict)
            verb.save(document(7))
        store.save(document(1))
    assert store_value(etcd, keys) == 7
    with store.locked():  # made again on the record as it now is
        assert (store.load(dict) or {})["value"] == 7
        store.save(document(2))
    assert store_value(etcd, keys) == 2
    leader.stop()


def test_a_leader_compacts_etcds_history_of_its_saves(
    etcd_server: EtcdCluster, keys: Keys, monkeypatch: pytest.MonkeyPatch
) -> None:
    """etcd keeps every revision until compacted, and compacts nothing by default: the
    record saved each settle filled its quota within the hour at scale, after which
    nothing, not even a lease, could be written. The leader compacts every few saves to
    the revision of its save a period before, so the newest period stays readable."""
    monkeypatch.setattr(cluster, "COMPACT_EVERY_SAVES", 3)
    etcd = Etcd(etcd_server.endpoints)
    clock, log = Clock(), []
    leader = elector(etcd, keys, "leader", clock, log)
    leader.step()
    store = EtcdStore(etcd, keys, leader)
    revisions = []
    for value in range(7):
        with store.locked():
            store.load(dict)
            store.save(document(value))
        revisions.append(store.revision)

    def state_at(revision: int) -> object:
        request = {"key": b64(keys.state), "revision": revision}
        return etcd.call("kv/range", request, lambda answer: answer.get("kvs"))

    # The first save starts the count (compacting to what it loaded: nothing yet); the
    # fourth compacts to the first's revision, the seventh to the fourth's.
    with pytest.raises(ClusterUnavailableError, match="compacted"):
        state_at(revisions[2])
    assert state_at(revisions[3])  # the newest period, and its start, stay readable
    assert store_value(etcd, keys) == 6
    leader.stop()


def test_runs_that_save_once_each_still_compact_etcds_history(
    etcd_server: EtcdCluster, keys: Keys
) -> None:
    """A cluster run by `check` from cron alone: one or two saves a process, counted per
    process, never reached a compaction, and the history grew until etcd's quota."""
    etcd = Etcd(etcd_server.endpoints)
    clock, log = Clock(), []
    revisions = []
    for value in range(3):  # three runs, each its own process's store
        leader = elector(etcd, keys, f"cron-{value}", clock, log)
        leader.step()
        store = EtcdStore(etcd, keys, leader)
        with store.locked():
            store.load(dict)
            store.save(document(value))
        revisions.append(store.revision)
        leader.stop()

    def state_at(revision: int) -> object:
        request = {"key": b64(keys.state), "revision": revision}
        return etcd.call("kv/range", request, lambda answer: answer.get("kvs"))

    with pytest.raises(ClusterUnavailableError, match="compacted"):
        state_at(revisions[0])
    assert state_at(revisions[1])  # what the last run loaded stays readable
    assert store_value(etcd, keys) == 2


def test_two_sections_on_one_store_wait_for_each_other(
    etcd_server: EtcdCluster, keys: Keys, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A stop's last settle beside a cycle still running: both on one store, whose
    section lives on the store, and one's save went over the other's unseen."""
    etcd = Etcd(etcd_server.endpoints)
    store = EtcdStore(etcd, keys, None)
    entered = threading.Event()
    release = threading.Event()

    def first() -> None:
        with store.locked():
            store.load(dict)
            entered.set()
            release.wait(10.0)
            store.save(document(1))

    thread = threading.Thread(target=first)
    thread.start()
    try:
        assert entered.wait(10.0)
        monkeypatch.setattr(cluster, "LOCK_TIMEOUT", 0.2)
        with (
            pytest.raises(StateLockedError, match="another section of this process"),
            store.locked(),
        ):
            pass
        monkeypatch.undo()
    finally:
        release.set()
        thread.join(10.0)
    with store.locked():
        assert (store.load(dict) or {})["value"] == 1
        store.save(document(2))
    assert store_value(etcd, keys) == 2


def read_posted(connection: socket.socket) -> tuple[bytes, bytes]:
    """A POST's head and its whole Content-Length body, off a raw socket."""
    request = read_request(connection)
    head, _, body = request.partition(b"\r\n\r\n")
    length = int(re.search(rb"Content-Length: (\d+)", head)[1])  # type: ignore[index]
    while len(body) < length:
        body += connection.recv(65536)
    return head, body


def losing_txn_answers(
    endpoint: str, meanwhile: Callable[[], None] = lambda: None
) -> Callable[[socket.socket, int], None]:
    """An etcd endpoint that passes each request on to ``endpoint`` and its answer back,
    except a transaction's answer, which it drops: a write that reached etcd, whose
    answer was lost on the way back; ``meanwhile`` runs before the client hears nothing."""
    host, _, port = endpoint.removeprefix("http://").partition(":")

    def forward(connection: socket.socket, _: int) -> None:
        head, body = read_posted(connection)
        answer = b""
        with socket.create_connection((host, int(port)), timeout=5) as upstream:
            upstream.sendall(head + b"\r\n\r\n" + body)
            while chunk := upstream.recv(65536):  # the request asks etcd to close
                answer += chunk
        if not head.startswith(b"POST /v3/kv/txn "):
            connection.sendall(answer)
        else:
            meanwhile()

    return forward


def txns_rewritten(
    endpoint: str, rewrite: Callable[[dict[str, Any]], None]
) -> Callable[[socket.socket, int], None]:
    """An etcd endpoint that passes each request on to ``endpoint`` and its answer back,
    a transaction's body first given to ``rewrite``: etcd's own answer (its header, its
    keys) to operations other than those asked, as a proxy that rewrote them gives."""
    host, _, port = endpoint.removeprefix("http://").partition(":")

    def forward(connection: socket.socket, _: int) -> None:
        head, body = read_posted(connection)
        if head.startswith(b"POST /v3/kv/txn "):
            request = json.loads(body)
            rewrite(request)
            body = json.dumps(request).encode()
            head = re.sub(rb"Content-Length: \d+", b"Content-Length: %d" % len(body), head)
        answer = b""
        with socket.create_connection((host, int(port)), timeout=5) as upstream:
            upstream.sendall(head + b"\r\n\r\n" + body)
            while chunk := upstream.recv(65536):  # the request asks etcd to close
                answer += chunk
        connection.sendall(answer)

    return forward


def test_a_transaction_answered_with_another_key_does_not_make_a_leader(
    etcd_server: EtcdCluster, keys: Keys
) -> None:
    # A campaign's failed compare reads the leader key; answered with another key on
    # this member's lease (its member key, by a proxy that ignores the key asked), it
    # was taken for the leader key created by a campaign whose answer was lost: the
    # member led, its fence that key's revision, while another held the lead.
    clock, log = Clock(), []
    holder = elector(Etcd(etcd_server.endpoints), keys, "b", clock, log)
    holder.step()
    assert holder.decision().standing is Standing.LEADER
    served = [0]

    def member_key_for_every_range(request: dict[str, Any]) -> None:
        served[0] += 1
        for operation in [*request["success"], *request["failure"]]:
            if "request_range" in operation:
                operation["request_range"] = {"key": b64(keys.member("a"))}

    with tcp_server(txns_rewritten(etcd_server.endpoints[0], member_key_for_every_range)) as (
        proxy,
        _,
    ):
        standby = elector(Etcd([proxy, *etcd_server.endpoints]), keys, "a", clock, log)
        standby.step()
        assert standby.decision().standing is Standing.STANDBY
        assert standby.fence is None
        standby.stop()
    assert served[0] >= 2  # the member key's write, then the campaign
    leader = read_leader(Etcd(etcd_server.endpoints), keys)
    assert leader is not None and (leader.member, leader.fence) == ("b", holder.fence)
    holder.stop()


def test_a_transaction_answered_for_fewer_operations_is_not_etcds_answer(
    etcd_server: EtcdCluster, keys: Keys
) -> None:
    # Responses to other operations than the branch that ran: not etcd's answer to this
    # transaction, and the next endpoint is asked.
    etcd = Etcd(etcd_server.endpoints)
    etcd.txn([], [cluster.put(keys.leader, b"held")])

    def failure_dropped(request: dict[str, Any]) -> None:
        request["failure"] = []

    with tcp_server(txns_rewritten(etcd_server.endpoints[0], failure_dropped)) as (proxy, _):
        written, _, found = Etcd([proxy, *etcd_server.endpoints]).txn(
            [cluster.compare_created(keys.leader, 0)],
            [cluster.put(keys.leader, b"mine")],
            [{"request_range": {"key": b64(keys.leader)}}],
        )
    assert not written
    assert [held.value if held else None for held in found] == [b"held"]


@pytest.mark.parametrize("verb_on_top", [False, True], ids=["alone", "a verb on top"])
def test_a_save_whose_answer_was_lost_is_found_written_not_reported_as_nothing_written(
    etcd_server: EtcdCluster, keys: Keys, verb_on_top: bool
) -> None:
    # The first endpoint took the transaction to etcd and lost its answer; the client
    # offered it to the next endpoint, whose compare failed on the write itself. The
    # save said "nothing written": the settle was reported lost and the restart it
    # ordered never ran, while the record said RESTARTING. With an operator's verb
    # writing the record on top before the retry, the read-back found the verb's state:
    # the daemon settled again on it, and the cycle's verdicts counted twice.
    def verb_writes() -> None:
        verb = EtcdStore(Etcd(etcd_server.endpoints), keys, None)
        with verb.locked():
            verb.save({**(verb.load(dict) or {}), "value": 99})

    meanwhile = verb_writes if verb_on_top else lambda: None
    with tcp_server(losing_txn_answers(etcd_server.endpoints[0], meanwhile)) as (lossy, _):
        etcd = Etcd([lossy, *etcd_server.endpoints])
        clock, log = Clock(), []
        leader = elector(Etcd(etcd_server.endpoints), keys, "a", clock, log)
        leader.step()
        store = EtcdStore(etcd, keys, leader)
        with store.locked():
            store.load(dict)
            store.append_record({"event": "restart_ordered", "backend": "gpu1"})
            store.save(document(1))
            written = store.revision
        assert store_value(etcd, keys) == (99 if verb_on_top else 1)
        found = Etcd(etcd_server.endpoints).get(keys.state)
        assert found is not None
        # The revision our write made: the state's while nobody wrote after it.
        assert (written < found.mod_revision) if verb_on_top else written == found.mod_revision
        with store.locked():  # and the next section goes on from the record as it is
            store.load(dict)
            store.save(document(2))
        assert store_value(etcd, keys) == 2
        audit = [record["event"] for record in read_audit(etcd, keys).records]
        assert audit == ["restart_ordered"], audit
        leader.stop()


def test_the_audit_trail_is_read_to_its_end_past_keys_that_are_not_utf8(
    etcd_server: EtcdCluster, keys: Keys
) -> None:
    # Anyone who may write etcd can leave keys under PREFIX/audit/ that are not UTF-8. A
    # page's last key, decoded with U+FFFD and encoded again, sorts above the real key, so
    # the next page was the same page: `llmhealth audit` read for ever, its memory
    # growing a page a request.
    etcd = Etcd(etcd_server.endpoints)
    record = b'{"time": 1.0, "backend": "gpu0", "event": "x", "from": "a", "to": "b"}\n'
    for index in range(70):  # more than a page
        key = keys.audit.encode() + b"\x80" + bytes([0x21 + index])
        etcd.txn([], [{"request_put": {"key": b64(key), "value": b64(record)}}])
    done: list[object] = []
    reading = threading.Thread(target=lambda: done.append(read_audit(etcd, keys)), daemon=True)
    reading.start()
    reading.join(15.0)
    assert done, "read_audit read the same page again and again"
    assert len(done[0].records) == 70  # type: ignore[attr-defined]


def test_a_corrupt_state_key_is_kept_aside_and_reported(
    etcd_server: EtcdCluster, keys: Keys
) -> None:
    etcd = Etcd(etcd_server.endpoints)
    etcd.txn([], [{"request_put": {"key": b64(keys.state), "value": b64("{not json")}}])
    store = EtcdStore(etcd, keys, None)
    with pytest.raises(Exception, match="unreadable") as raised, store.locked():
        store.load(dict)
    assert "corrupt" in str(raised.value)
    aside = [key for key in etcd.get_prefix(keys.prefix) if ".corrupt-" in key]
    assert len(aside) == 1
    assert etcd.get(aside[0]) is not None
    assert etcd.get(keys.state) is None


def test_a_reader_leaves_a_corrupt_state_key_where_it_is(
    etcd_server: EtcdCluster, keys: Keys
) -> None:
    # `status` on a cluster config: a look changes nothing; the next settle sets it aside.
    etcd = Etcd(etcd_server.endpoints)
    reader = EtcdStore(etcd, keys, None)
    assert reader.read(dict) is None and reader.revision == 0
    etcd.txn([], [{"request_put": {"key": b64(keys.state), "value": b64("{not json")}}])
    with pytest.raises(Exception, match="left in place"):
        reader.read(dict)
    # What status shows as the record's revision: the one this read saw.
    written = etcd.get(keys.state)
    assert written is not None and reader.revision == written.mod_revision
    # A standby's view (and a cron check that lost the lease) loads it the same way: a
    # non-leader writes nothing, not even the corrupt record's copy aside.
    standby = ReadOnlyStore(etcd, keys)
    with pytest.raises(Exception, match="left in place"), standby.locked():
        standby.load(dict)
    assert [key for key in etcd.get_prefix(keys.prefix) if ".corrupt-" in key] == []
    kept = etcd.get(keys.state)
    assert kept is not None and kept.value == b"{not json"
    assert [key for key in etcd.get_prefix(keys.prefix) if ".corrupt-" in key] == []


def b64(text: str | bytes) -> str:
    return base64.b64encode(text.encode() if isinstance(text, str) else text).decode()


def test_an_endpoint_that_does_not_answer_is_passed_over(
    etcd_server: EtcdCluster, keys: Keys
) -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    etcd = Etcd([dead, *etcd_server.endpoints], timeout=1.0)
    etcd.txn([], [{"request_put": {"key": b64(keys.state), "value": b64("{}")}}])
    assert etcd.get(keys.state) is not None


def test_an_endpoint_answering_what_etcd_would_not_is_passed_over(
    etcd_server: EtcdCluster, keys: Keys, httpserver: HTTPServer
) -> None:
    # A proxy's page in place of etcd's JSON: etcd3gw lets requests' and json's own
    # errors through, and in the elector's thread one of them ended elections for good.
    httpserver.expect_request(re.compile(".*")).respond_with_data("<html>busy</html>")
    page = httpserver.url_for("").rstrip("/")
    etcd = Etcd([page, *etcd_server.endpoints], timeout=1.0)
    etcd.txn([], [{"request_put": {"key": b64(keys.state), "value": b64("{}")}}])
    assert etcd.get(keys.state) is not None
    with pytest.raises(ClusterUnavailableError, match="JSONDecodeError"):
        Etcd([page], timeout=1.0).get(keys.state)


def test_what_an_endpoint_says_in_its_error_reaches_no_terminal_raw() -> None:
    # etcd3gw's error text is the answer's reason phrase and body: printed by every verb
    # on a cluster config and shown in a check's notes.
    def refuse(connection: socket.socket, _: int) -> None:
        read_request(connection)
        connection.sendall(b"HTTP/1.1 400 \x1b]0;owned\x07\r\nContent-Length: 8\r\n\r\n\x1b[2Jnope")

    with tcp_server(refuse) as (url, _), pytest.raises(ClusterUnavailableError) as raised:
        Etcd([url], timeout=2.0).get("/x")
    said = str(raised.value)
    assert "owned" in said and "\x1b" not in said and "\x07" not in said


def test_the_electors_thread_outlives_an_error_of_any_kind(
    etcd_server: EtcdCluster, keys: Keys, monkeypatch: pytest.MonkeyPatch
) -> None:
    log: list[str] = []
    seat = Seat(etcd_server.endpoints, keys.prefix, "a", 3.0, log=log.append)
    rounds = []
    real = seat.elector.step_and_observe

    def once_broken() -> None:
        rounds.append(1)
        if len(rounds) == 1:
            raise RuntimeError("a bug past every guard")
        real()

    monkeypatch.setattr(seat.elector, "step_and_observe", once_broken)
    seat.elector.start()
    try:
        deadline = time.monotonic() + 30.0
        while not seat.elector.decision().may_act:
            assert time.monotonic() < deadline, log
            time.sleep(0.05)
    finally:
        seat.elector.stop(resign=True)
    assert any("RuntimeError: a bug past every guard" in line for line in log), log


def test_no_endpoint_answering_is_one_clear_error(tmp_path: Path) -> None:
    etcd = Etcd([f"http://127.0.0.1:{free_port()}"], timeout=1.0)
    with pytest.raises(ClusterUnavailableError, match="no etcd endpoint answered"):
        etcd.get("/x")
    clock, log = Clock(), []
    lonely = elector(etcd, Keys("/x"), "a", clock, log)
    with pytest.raises(ClusterUnavailableError):
        lonely.step()
    assert lonely.decision().standing is Standing.STANDBY


def test_an_etcd_endpoint_with_a_password_is_refused_without_repeating_it() -> None:
    # Each endpoint is named in every "unavailable" error: a password in one would be printed.
    with pytest.raises(ValueError, match="user name or password") as refused:
        Etcd(["http://127.0.0.1:2379", "http://root:s3cret@127.0.0.1:2380"])
    assert "s3cret" not in str(refused.value) and "root" not in str(refused.value)


# --- the audit trail in etcd ----------------------------------------------------------


def audit_record(index: int, **extra: object) -> dict[str, object]:
    return {
        "time": 1000.0 + index,
        "actor": "llmhealth",
        "backend": "gpu",
        "event": "restart",
        "n": index,
        **extra,
    }


def test_a_settles_audit_records_are_written_in_the_transaction_of_its_state(
    etcd_server: EtcdCluster, keys: Keys
) -> None:
    etcd = Etcd(etcd_server.endpoints)
    clock, log = Clock(), []
    leader = elector(etcd, keys, "a", clock, log)
    leader.step()
    store = EtcdStore(etcd, keys, leader)
    with store.locked():
        store.load(dict)
        store.audit.append(audit_record(1))
        store.audit.append(audit_record(2))
        store.save(document(1))
    state = etcd.get(keys.state)
    batches = etcd.get_prefix(keys.audit)
    assert state is not None and len(batches) == 1
    # One transaction: the batch key was created at the revision that wrote the state.
    (batch,) = batches.values()
    assert batch.create_revision == state.mod_revision
    trail = read_audit(etcd, keys)
    assert [record["n"] for record in trail.records] == [1, 2]
    assert all(r["member"] == "a" and r["fence"] == leader.fence for r in trail.records)
    assert trail.malformed == 0
    leader.stop()


def test_a_deposed_leaders_audit_records_fail_with_its_write(
    etcd_server: EtcdCluster, keys: Keys
) -> None:
    etcd = Etcd(etcd_server.endpoints)
    clock, log = Clock(), []
    old, new = elector(etcd, keys, "old", clock, log), elector(etcd, keys, "new", clock, log)
    old.step()
    new.step()
    old_store = EtcdStore(etcd, keys, old)
    with pytest.raises(FencedOutError), old_store.locked():
        old_store.load(dict)
        old_lease = old.lease_id
        assert old_lease is not None
        etcd.revoke(old_lease)  # deposed behind its back, as in a pause
        new.step()
        old_store.audit.append(audit_record(99))
        old_store.save(document(99))
    assert read_audit(etcd, keys).records == []
    # Nor does a record left over reach the next section's write.
    new_store = EtcdStore(etcd, keys, new)
    with new_store.locked():
        new_store.load(dict)
        new_store.audit.append(audit_record(1))
        new_store.save(document(1))
    assert [(r["n"], r["member"]) for r in read_audit(etcd, keys).records] == [(1, "new")]
    old.stop()
    new.stop()


def test_records_of_a_section_that_saved_nothing_are_written_only_on_the_record_read(
    etcd_server: EtcdCluster, keys: Keys
) -> None:
    etcd = Etcd(etcd_server.endpoints)
    verb = EtcdStore(etcd, keys, None)  # an operator's verb that the ledger refused
    with verb.locked():
        verb.load(dict)
        verb.audit.append(audit_record(1, applied=False))
    assert [r["n"] for r in read_audit(etcd, keys).records] == [1]
    assert "member" not in read_audit(etcd, keys).records[0]  # no leader wrote it
    other = EtcdStore(etcd, keys, None)
    # A refusal of a stale record: the verb is made again (operate), not failed as fenced.
    with pytest.raises(RecordMovedError, match="audit records of this section"), verb.locked():
        verb.load(dict)
        verb.audit.append(audit_record(2, applied=False))
        with other.locked():  # a settle lands in between: the refusal was of a stale record
            other.load(dict)
            other.save(document(5))
    assert [r["n"] for r in read_audit(etcd, keys).records] == [1]


def test_a_record_outside_any_section_is_refused_not_lost_silently(
    etcd_server: EtcdCluster, keys: Keys
) -> None:
    store = EtcdStore(Etcd(etcd_server.endpoints), keys, None)
    with pytest.raises(AuditError, match="not kept"):
        store.audit.append(audit_record(1))


def test_the_trail_keeps_the_newest_records_and_reads_them_in_order(
    etcd_server: EtcdCluster, keys: Keys
) -> None:
    etcd = Etcd(etcd_server.endpoints)
    clock, log = Clock(), []
    leader = elector(etcd, keys, "a", clock, log)
    leader.step()
    store = EtcdStore(etcd, keys, leader, audit_keep=100)
    for index in range(150):  # more batches than one page of keys read
        with store.locked():
            store.load(dict)
            store.audit.append(audit_record(index))
            store.save(document(index))
    kept = [r["n"] for r in read_audit(etcd, keys).records]
    # Trimmed on the first write, then after every tenth of audit_keep more records.
    assert 100 <= len(kept) < 100 + 10, len(kept)
    assert kept == list(range(150 - len(kept), 150))
    assert [r["n"] for r in read_audit(etcd, keys, last=70).records] == list(range(80, 150))
    assert read_audit(etcd, keys, last=0).records == []
    leader.stop()


def test_a_huge_record_is_cut_to_fit_and_keeps_its_decision(
    etcd_server: EtcdCluster, keys: Keys
) -> None:
    etcd = Etcd(etcd_server.endpoints)
    store = EtcdStore(etcd, keys, None)
    with store.locked():
        store.load(dict)
        store.audit.append(audit_record(1, evidence={"reads": ["x" * 100_000]}, reason="wedged"))
        store.save(document(1))
    (batch,) = etcd.get_prefix(keys.audit).values()
    assert len(batch.value) <= AUDIT_RECORD_BYTES
    (record,) = read_audit(etcd, keys).records
    assert (record["backend"], record["event"], record["reason"]) == ("gpu", "restart", "wedged")
    assert isinstance(record["evidence"], str) and "cut to fit etcd" in record["evidence"]


def test_a_settle_with_thousands_of_records_still_fits_one_etcd_request(
    etcd_server: EtcdCluster, keys: Keys
) -> None:
    # 750 wedges proven at once write 1,500 records with their reads: etcd refuses a
    # request past 1.5 MiB (its default), and the state rides in the same one.
    etcd = Etcd(etcd_server.endpoints)
    store = EtcdStore(etcd, keys, None)
    reads = [{"at": float(i), "engines": {"0": {"running": 3, "waiting": 1}}} for i in range(40)]
    with store.locked():
        store.load(dict)
        for index in range(1500):
            store.audit.append(audit_record(index, evidence={"reads": reads}))
        store.save({"value": 1, "padding": "p" * 500_000})
    trail = read_audit(etcd, keys)
    assert [r["n"] for r in trail.records] == list(range(1500))
    assert sum(len(found.value) for found in etcd.get_prefix(keys.audit).values()) <= 600_000


@pytest.mark.slow
def test_a_trail_of_settles_of_thousands_of_records_is_still_read(
    etcd_server: EtcdCluster, keys: Keys
) -> None:
    # 750 wedges proven at once write 1,500 records (about 500 KB). The trail was read 64
    # keys' values at a time: 64 such settles made an answer past the 32 MiB one may be,
    # and `llmhealth audit`, even `--last 1`, failed on every run while they were kept.
    etcd = Etcd(etcd_server.endpoints)
    store = EtcdStore(etcd, keys, None)
    why = "wedged: engine 0 ran 3 requests and waited 1 for 412 s without a step"
    evidence = f"{why}; tokens 120934 unchanged; window 300 s (two waits), prefill 0.2 s"
    with store.locked():
        store.load(dict)
        for index in range(1500):
            record = audit_record(index, member="node-a", fence=12, reason=why, evidence=evidence)
            store.audit.append(record)
        store.save({"value": 1})
    [batch] = etcd.get_prefix(keys.audit).values()
    assert len(batch.value) > 450_000
    for index in range(1, 64):  # the next 63 such settles, newest last
        later = f"{keys.audit}{batch.mod_revision + index:020d}-0000{index:04x}-001500"
        etcd.txn([], [cluster.put(later, batch.value)])
    trail = read_audit(etcd, keys, last=1)
    assert [record["n"] for record in trail.records] == [1499]
    counted: list[int] = []
    read_audit(etcd, keys, each=lambda _record: counted.append(1))
    assert len(counted) == 64 * 1500


def test_a_batch_written_between_the_trails_names_and_values_hides_none_read(
    etcd_server: EtcdCluster, keys: Keys
) -> None:
    # Sections that save nothing write their records alone, under the record's revision as
    # read, and a random nonce: a later one's key may sort below an earlier one's. Written
    # between the read of the trail's names and that of their values, it took a place in
    # the run of values asked by count, and the run's oldest batch was in no audit read.
    etcd = Etcd(etcd_server.endpoints)

    def write(revision: int, nonce: str, index: int) -> None:
        key = f"{keys.audit}{revision:020d}-{nonce}-000001"
        etcd.txn([], [cluster.put(key, json.dumps(audit_record(index)).encode())])

    write(10, "aaaaaaaa", 0)
    write(20, "ffffffff", 1)

    class Writing(Etcd):
        def scan_down(
            self, prefix: str, end: str | bytes | None, limit: int, *, keys_only: bool = False
        ) -> list[tuple[str, KeyValue]]:
            found = super().scan_down(prefix, end, limit, keys_only=keys_only)
            if keys_only:  # another section's records, between the names and the values
                write(20, "00000000", 2)
            return found

    trail = read_audit(Writing(etcd_server.endpoints), keys)
    assert sorted(record["n"] for record in trail.records) == [0, 1]


def test_operator_verbs_on_a_cluster_write_their_records_into_its_trail(
    etcd_server: EtcdCluster, keys: Keys
) -> None:
    from llmhealth import operate  # noqa: PLC0415

    config = Config(backends=(Backend("gpu", "http://127.0.0.1:9"),))
    store = EtcdStore(Etcd(etcd_server.endpoints), keys, None)
    held = operate.hold(store, store.audit, config, "gpu", 600.0, "weight sync")
    refused = operate.readmit(store, store.audit, config, "gpu", None)  # HEALTHY already
    assert held.applied and not refused.applied
    trail = read_audit(store.etcd, keys).records
    assert [(r["event"], r.get("applied")) for r in trail] == [("hold", None), ("readmit", False)]
    assert trail[0]["reason"] == "weight sync"


# --- sharded reads ----------------------------------------------------------------------


def test_members_agree_on_shares_publish_on_their_lease_and_the_leader_takes_each_once(
    etcd_server: EtcdCluster, keys: Keys
) -> None:
    backends = {f"gpu{index}": f"http://10.0.0.{index}:8000" for index in range(12)}
    clock, log = Clock(), []
    seats = {
        name: Seat(etcd_server.endpoints, keys.prefix, name, 3.0, log=log.append) for name in "abc"
    }
    # a and b are daemons that share the reads (as a daemon does, before its elector
    # starts); c is a `check` from cron, which holds a member key and reads everything.
    reads = {name: SharedReads(seat, clock=clock) for name, seat in seats.items() if name != "c"}
    for seat in seats.values():
        seat.elector.step()
    for seat in seats.values():  # what each elector's thread would have seen
        seat.elector.observed = Observation(True, None, read_members(seat.etcd, seat.keys))
    assert {name for name, _ in seats["a"].elector.observed.members} == {"a", "b", "c"}
    assert reads["a"].members() == reads["b"].members() == ["a", "b"]
    seats["c"].elector.stop()
    shares = {name: shared.share(backends) for name, shared in reads.items()}
    assert shares["a"].isdisjoint(shares["b"]) and shares["a"] | shares["b"] == set(backends)
    assert shares["a"] and shares["b"]  # twelve backends: both read some
    leader, member = reads["a"], reads["b"]
    assert seats["a"].elector.decision().may_act
    first = leader.take(backends, stale_after=10.0, undecided_for=300.0)
    assert first.verdicts == {} and first.stale == ()
    verdicts = {name: Verdict(VerdictKind.BUSY, True, f"busy {name}") for name in shares["b"]}
    member.publish({name: 1 for name in verdicts}, verdicts, {name: 2 for name in verdicts}, {})
    assert leader.take(backends, stale_after=10.0, undecided_for=300.0).verdicts == verdicts
    assert leader.take(backends, stale_after=10.0, undecided_for=300.0).verdicts == {}  # each once
    # The member dies: its publication goes with its lease, and its backends go stale.
    lease = seats["b"].elector.lease_id
    assert lease is not None
    seats["b"].etcd.revoke(lease)
    assert not [k for k in seats["a"].etcd.get_prefix(keys.verdicts) if "/verdicts/b/" in k]
    clock.now += 10.0
    stale = leader.take(backends, stale_after=10.0, undecided_for=300.0)
    assert set(stale.stale) == shares["b"]
    assert all(v.kind is VerdictKind.STALLED and not v.healthy for v in stale.verdicts.values())
    # Once the leader sees it alone, the whole fleet is its share.
    seats["a"].elector.observed = Observation(True, None, read_members(seats["a"].etcd, keys))
    assert leader.share(backends) == set(backends)
    seats["a"].elector.stop()


def test_a_share_that_shrinks_leaves_no_chunk_of_its_old_publication(
    etcd_server: EtcdCluster, keys: Keys, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(cluster, "PUBLICATION_BYTES", 1024)
    seat = Seat(etcd_server.endpoints, keys.prefix, "b", 3.0, log=[].append)
    seat.elector.step()
    reads = SharedReads(seat)
    verdicts = {f"gpu{index}": Verdict(VerdictKind.BUSY, True, "busy " * 40) for index in range(12)}
    reads.publish({name: 1 for name in verdicts}, verdicts, {}, {})
    chunks = [key for key in seat.etcd.get_prefix(keys.verdicts) if "/verdicts/b/" in key]
    assert len(chunks) > 2
    found = seat.etcd.get(chunks[0])
    assert found is not None and found.lease == seat.elector.lease_id  # gone with the member
    reads.publish({"gpu1": 2}, {"gpu1": verdicts["gpu1"]}, {"gpu1": 5}, {})
    assert sorted(seat.etcd.get_prefix(keys.verdicts)) == [f"{keys.verdicts}b/00000"]
    seat.elector.stop()


def three_members(
    etcd_server: EtcdCluster, keys: Keys, clock: Clock
) -> tuple[dict[str, Seat], dict[str, SharedReads]]:
    """Members a, b and c sharing the reads, each through one elector round (a leads)."""
    seats = {
        name: Seat(etcd_server.endpoints, keys.prefix, name, 3.0, log=[].append) for name in "abc"
    }
    reads = {name: SharedReads(seat, clock=clock) for name, seat in seats.items()}
    for seat in seats.values():
        seat.elector.step()
    return seats, reads


def test_the_leader_takes_publications_larger_than_one_answer_page_by_page(
    etcd_server: EtcdCluster, keys: Keys, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Read in one answer, the others' publications outgrew what an answer may be (32 MiB:
    about 830 frozen backends' verdicts of 61 reads), and the leader settled nothing. Here
    an answer may be 64 KiB and the publications are twice that; the leader's own are not
    read at all."""
    monkeypatch.setattr(cluster, "PUBLICATION_BYTES", 4096)
    monkeypatch.setattr(cluster, "PUBLICATION_PAGE", 4)  # 16 KiB a page, as 8 MiB is to 32
    backends = {f"gpu{index}": f"http://10.0.0.{index}:8000" for index in range(120)}
    seats, reads = three_members(etcd_server, keys, Clock())
    for seat in seats.values():
        seat.elector.observed = Observation(True, None, read_members(seat.etcd, seat.keys))
    assert seats["a"].elector.decision().may_act
    assert reads["a"].take(backends, stale_after=10.0, undecided_for=300.0).verdicts == {}
    published = {}
    for name in "abc":
        share = reads[name].share(backends)
        verdicts = {b: Verdict(VerdictKind.BUSY, True, f"busy {b} " + "x" * 1000) for b in share}
        reads[name].publish({b: 1 for b in share}, verdicts, {b: 2 for b in share}, {})
        published[name] = verdicts
    seats["a"].etcd._bounds = etcd_http.Bounds(silence=2.0, max_bytes=64 * 1024)
    taken = reads["a"].take(backends, stale_after=10.0, undecided_for=300.0)
    assert taken.verdicts == {**published["b"], **published["c"]}
    mine = f"{keys.verdicts}a/"
    assert seats["a"].etcd.get_prefix(mine)  # published, and never read back:
    paged = seats["a"].etcd.get_prefix_paged(keys.verdicts, 2, skip=mine)
    assert [key for key, _ in paged if key.startswith(mine)] == []
    for seat in seats.values():
        seat.elector.stop()


def test_an_audit_key_with_a_count_int_cannot_read_counts_as_one_record() -> None:
    # isdigit() admits "²", which int() refuses: one key written by hand ended the trim.
    assert cluster._records_in("/p/audit/00000000000000000042-3") == 3
    assert cluster._records_in("/p/audit/00000000000000000042-\u00b2") == 1
    assert cluster._records_in("/p/audit/by-hand") == 1


# --- answers etcd would not give, and an etcd that fails -------------------------------

Edit = Callable[[str, Any], Any]  # a request's path and etcd's answer -> the answer sent


def editing(endpoint: str, edit: Edit) -> Handler:
    """An endpoint that passes each request on to ``endpoint`` (a real etcd) and sends
    back etcd's answer, its JSON as ``edit`` leaves it."""
    direct = urllib.request.build_opener(urllib.request.ProxyHandler({}))

    def forward(connection: socket.socket, _: int) -> None:
        head, body = read_posted(connection)
        path = head.split(b" ")[1].decode()
        upstream = urllib.request.Request(f"{endpoint}{path}", data=body, method="POST")
        try:
            with direct.open(upstream, timeout=5) as answered:
                status, said = answered.status, answered.read()
        except urllib.error.HTTPError as refused:
            status, said = refused.code, refused.read()
        sent = json.dumps(edit(path, json.loads(said))).encode()
        connection.sendall(
            b"HTTP/1.1 %d X\r\nContent-Length: %d\r\n\r\n%s" % (status, len(sent), sent)
        )

    return forward


def test_a_garbled_failure_branch_is_not_etcds_answer_and_no_caller_crashes_on_it(
    etcd_server: EtcdCluster, keys: Keys
) -> None:
    # A proxy's `{"response_range": null}` in a failed transaction was read after the
    # call, outside every guard: an AttributeError out of the save ended the daemon.
    def garble(path: str, answer: Any) -> Any:
        if path == "/v3/kv/txn" and not answer.get("succeeded"):
            answer["responses"] = [{"response_range": None}]
        return answer

    direct = Etcd(etcd_server.endpoints)
    with tcp_server(editing(etcd_server.endpoints[0], garble)) as (url, _):
        etcd = Etcd([url])
        store = EtcdStore(etcd, keys, None)
        with pytest.raises(ClusterUnavailableError, match="not etcd's answer"), store.locked():
            store.load(dict)
            direct.txn([], [cluster.put(keys.state, b'{"someone": "else"}')])  # a racing write
            store.save(document(1))
        clock, log = Clock(), []
        rival = elector(direct, keys, "a", clock, log)
        rival.step()
        assert rival.decision().may_act
        campaigner = elector(etcd, keys, "b", clock, log)
        with pytest.raises(ClusterUnavailableError, match="not etcd's answer"):
            campaigner.step()  # its campaign's compare fails: the failure branch is read
        assert campaigner.decision().standing is Standing.STANDBY
        campaigner.stop()
        rival.stop()
    found = direct.get(keys.state)
    assert found is not None and found.value == b'{"someone": "else"}'


def test_a_member_or_leader_key_nested_thousands_deep_reads_as_unreadable(
    etcd_server: EtcdCluster, keys: Keys
) -> None:
    # Observation failed every round (etcd shown as unreachable), `status` failed, and a
    # fenced-out save raised RecursionError from naming who leads.
    etcd = Etcd(etcd_server.endpoints)
    nested = b"[" * 50_000 + b"]" * 50_000
    etcd.txn([], [cluster.put(keys.member("deep"), nested)])
    clock, log = Clock(), []
    member = elector(etcd, keys, "a", clock, log)
    member.step_and_observe()
    assert member.observed.etcd_up
    assert dict(member.observed.members)["deep"] == {}
    assert dict(read_members(etcd, keys))["deep"] == {}
    member.stop()
    etcd.txn([], [cluster.put(keys.leader, b'{"member": ' + nested + b', "since": 1}')])
    leader = read_leader(etcd, keys)
    assert leader is not None and leader.member == "?"
    assert describe(etcd, keys, 0)["leader"]["member"] == "?"


def test_nan_or_infinity_another_member_wrote_never_reaches_status_json(
    etcd_server: EtcdCluster, keys: Keys
) -> None:
    # json.loads takes NaN and Infinity, float() takes "nan": `status --format json`,
    # which refuses them (strict JSON), then ended in "internal error".
    etcd = Etcd(etcd_server.endpoints)
    etcd.txn([], [cluster.put(keys.member("odd"), b'{"last_report": {"at": Infinity}}')])
    etcd.txn([], [cluster.put(keys.member("big"), b'{"last_report": {"at": 1e999}}')])
    etcd.txn(
        [], [cluster.put(keys.member("long"), b'{"last_report": {"at": 1' + b"0" * 400 + b"}}")]
    )
    etcd.txn([], [cluster.put(keys.leader, b'{"member": "odd", "since": "nan"}')])
    shown = describe(etcd, keys, 0)
    assert shown["members"] == {"odd": {}, "big": {}, "long": {}}
    assert shown["leader"]["member"] == "?"
    json.dumps(shown, allow_nan=False)  # raised ValueError before


@pytest.mark.slow
def test_an_error_that_recurs_every_round_is_logged_once(
    etcd_server: EtcdCluster, keys: Keys
) -> None:
    # Another member leads, so each round's own work succeeds, and then reading who leads
    # fails the same way: the error was cleared before the observation, and logged again
    # every round.
    asked: list[str] = []

    def garble_ranges(path: str, answer: Any) -> Any:
        if path == "/v3/kv/range":
            asked.append(path)
            return {"kvs": "garbled"}
        return answer

    direct = Etcd(etcd_server.endpoints)
    held = direct.grant(60)
    direct.txn([], [cluster.put(keys.leader, b'{"member": "b", "since": 1}', held)])
    log: list[str] = []
    with tcp_server(editing(etcd_server.endpoints[0], garble_ranges)) as (url, _):
        member = Elector(Etcd([url]), keys, "a", TIMING, log=log.append)
        member.start()
        try:
            deadline = time.monotonic() + 60.0
            while len(asked) < 4:
                assert time.monotonic() < deadline, log
                time.sleep(0.05)
        finally:
            member.stop()
    direct.revoke(held)
    assert not member.observed.etcd_up
    errors = [line for line in log if "not etcd's answer" in line]
    assert len(errors) == 1, log


class Waits(threading.Event):
    """The stop event of an elector's thread, noting how long each round asked to wait."""

    def __init__(self) -> None:
        super().__init__()
        self.asked: list[float] = []

    def wait(self, timeout: float | None = None) -> bool:
        if timeout is not None:
            self.asked.append(timeout)
        return super().wait(timeout)


@pytest.mark.slow  # an elector's rounds at their real pace: 5 s each (the retry rule
# itself is a property test in test_leadership.py, which stays in `make test`)
@pytest.mark.parametrize("failing", ["refused", "etcd-busy"])
def test_an_etcd_that_fails_fast_is_asked_again_no_sooner_than_a_retry_period(
    failing: str,
) -> None:
    # After a failed round the thread waited 50 ms: sixty requests in three seconds to an
    # etcd that refused at once, or said it had too many.
    said = json.dumps({"error": "too many requests", "message": "too many", "code": 8})

    def busy(connection: socket.socket, _: int) -> None:
        read_request(connection)
        connection.sendall(
            b"HTTP/1.1 429 Too Many\r\nContent-Length: %d\r\n\r\n%s" % (len(said), said.encode())
        )

    with contextlib.ExitStack() as stack:
        if failing == "refused":
            url = f"http://127.0.0.1:{free_port()}"
        else:
            url, _ = stack.enter_context(tcp_server(busy))
        member = Elector(Etcd([url]), Keys("/llmhealth-test/busy"), "a", TIMING, log=[].append)
        waits = Waits()
        member._stop = waits
        member.start()
        try:
            deadline = time.monotonic() + 60.0
            while len(waits.asked) < 5:
                assert time.monotonic() < deadline
                time.sleep(0.05)
        finally:
            member.stop(resign=False)
    rounds = waits.asked[:5]
    assert all(wait >= TIMING.retry_period for wait in rounds), rounds
    most = TIMING.retry_period * leadership.BACKOFF_LIMIT * (1 + leadership.RETRY_JITTER)
    assert all(wait <= most for wait in rounds), rounds
    assert rounds[3] >= 2 * TIMING.retry_period, rounds  # no lease to keep: it backs off


def test_a_lease_granted_as_zero_is_not_taken_and_no_leader_key_outlives_its_leader(
    etcd_server: EtcdCluster, keys: Keys
) -> None:
    # Lease 0 is etcd's "no lease": the leader key was written on none, and nobody could
    # lead after its leader was gone until an operator deleted it.
    zeroed: list[str] = []

    def zero_once(path: str, answer: Any) -> Any:
        if path == "/v3/lease/grant" and not zeroed:
            zeroed.append(path)
            return {**answer, "ID": "0"}
        return answer

    direct = Etcd(etcd_server.endpoints)
    with tcp_server(editing(etcd_server.endpoints[0], zero_once)) as (url, _):
        clock, log = Clock(), []
        member = elector(Etcd([url]), keys, "a", clock, log)
        with pytest.raises(ClusterUnavailableError, match=r"not etcd's answer.*lease ID 0"):
            member.step()
        assert direct.get(keys.leader) is None
        assert member.lease_id is None and not member.decision().may_act
        member.step()  # a real lease the next round
        assert member.decision().may_act
        held = direct.get(keys.leader)
        assert held is not None and held.lease == member.lease_id and held.lease > 0
        member.stop()
    assert direct.get(keys.leader) is None  # resigned: the key went with its lease


def test_a_campaign_answer_without_a_revision_does_not_lead_on_fence_zero(
    etcd_server: EtcdCluster, keys: Keys
) -> None:
    """Read as 0, the fence compared as "no leader key": a leader's writes would pass
    whenever nobody held the key, as lease 0's would (refused above)."""
    succeeded: list[str] = []

    def strip_once(path: str, answer: Any) -> Any:
        # A round's transactions: its member key's put, then the campaign.
        if path == "/v3/kv/txn" and answer.get("succeeded"):
            succeeded.append(path)
            if len(succeeded) == 2:
                answer["header"].pop("revision", None)  # a header without it
        return answer

    with tcp_server(editing(etcd_server.endpoints[0], strip_once)) as (url, _):
        clock, log = Clock(), []
        member = elector(Etcd([url]), keys, "a", clock, log)
        with pytest.raises(ClusterUnavailableError, match="names no revision"):
            member.step()
        assert not member.decision().may_act and member.fence is None
        member.step()  # its key, on its lease, found the next round: leads by its revision
        assert member.decision().may_act and (member.fence or 0) > 0
        member.stop()


def test_a_check_that_won_the_lead_and_then_lost_etcd_gives_the_lead_back(
    etcd_server: EtcdCluster, keys: Keys
) -> None:
    """Won, then a read failed: the run reported etcd away and was gone, its leader key
    left on its lease, and no daemon could lead for a whole lease."""
    succeeded: list[str] = []
    garbled: list[str] = []

    def garble_after_winning(path: str, answer: Any) -> Any:
        if path == "/v3/kv/txn" and answer.get("succeeded"):
            succeeded.append(path)
        elif path == "/v3/kv/range" and len(succeeded) >= 2 and not garbled:
            garbled.append(path)
            return {"kvs": "garbled"}
        return answer

    direct = Etcd(etcd_server.endpoints)
    with tcp_server(editing(etcd_server.endpoints[0], garble_after_winning)) as (url, _):
        report = run_cycle_in_cluster(
            Config(),
            ClusterConfig(etcd=(url,), prefix=keys.prefix, member="cron"),
            [],
            ProbeSettings(wait=0.1, timeout=0.5),
            mode=Mode.OFF,
            log=lambda _message: None,
        )
    assert garbled, "the round never won the lead"
    assert any("etcd unreachable" in note for note in report.notes), report.notes
    assert direct.get(keys.leader) is None


def test_a_leader_that_lost_and_won_the_lead_between_two_settles_takes_no_verdict_twice(
    etcd_server: EtcdCluster, keys: Keys
) -> None:
    """a leads and settles c's verdict 1; a's lease lapses, b leads and settles c's
    verdict 2; b's lapses and a leads again before its next settle, so it never settled
    as a standby. Its intake, kept across the two leads, took verdict 2 as new: a
    backend's failure counted twice, once by each leader, condemns early."""
    backends = {f"gpu{index}": f"http://10.0.0.{index}:8000" for index in range(12)}
    seats, reads = three_members(etcd_server, keys, Clock())
    for seat in seats.values():
        seat.elector.observed = Observation(True, None, [])  # each alone with c's verdicts
    for shared in reads.values():
        shared.members = lambda: ["a", "b", "c"]  # type: ignore[method-assign]
    mine = {b for b in backends if leadership.owner(b, ["a", "b", "c"]) == "c"}
    assert mine

    def publish(serial: int) -> dict[str, Verdict]:
        verdicts = {b: Verdict(VerdictKind.WEDGED, False, f"wedged {serial}") for b in mine}
        reads["c"].publish({b: serial for b in mine}, verdicts, {b: serial for b in mine}, {})
        return verdicts

    def lapse(name: str) -> None:
        lease = seats[name].elector.lease_id
        assert lease is not None
        seats[name].etcd.revoke(lease)
        seats[name].elector.step()  # finds its lease gone: no longer leads

    assert seats["a"].elector.decision().may_act
    assert reads["a"].take(backends, stale_after=60.0, undecided_for=300.0).verdicts == {}
    first = publish(1)
    assert reads["a"].take(backends, stale_after=60.0, undecided_for=300.0).verdicts == first
    lapse("a")
    seats["b"].elector.step()
    assert seats["b"].elector.decision().may_act
    assert reads["b"].take(backends, stale_after=60.0, undecided_for=300.0).verdicts == {}
    second = publish(2)
    assert reads["b"].take(backends, stale_after=60.0, undecided_for=300.0).verdicts == second
    lapse("b")
    seats["a"].elector.step()  # a new lease, then the campaign
    assert seats["a"].elector.decision().may_act
    assert reads["a"].take(backends, stale_after=60.0, undecided_for=300.0).verdicts == {}
    third = publish(3)
    assert reads["a"].take(backends, stale_after=60.0, undecided_for=300.0).verdicts == third
    for seat in seats.values():
        seat.elector.stop()


def test_a_leader_on_a_slow_etcd_renews_in_time_and_keeps_the_lead(
    etcd_server: EtcdCluster, keys: Keys
) -> None:
    # Every answer 0.5 s after its request, well within each bound (2 s a wait): a round
    # of five requests (renewal, member key, leader key, who leads, who is a member) took
    # 2.5 s between two renewals, past the 2 s renew deadline of a 3 s lease etcd kept
    # alive all along. The leader stepped down every round, revoked its own live lease
    # and campaigned again: nobody acted for most of each round, the leadership flapped.
    clock, log = Clock(), []

    def slow(_: str, answer: Any) -> Any:
        clock.now += 0.5
        return answer

    with tcp_server(editing(etcd_server.endpoints[0], slow)) as (url, _):
        leader = elector(Etcd([url]), keys, "a", clock, log)
        try:
            for _ in range(3):
                leader.step_and_observe()
                assert leader.decision().may_act, log
        finally:
            leader.stop()
    assert leader.transitions == 1, log
    assert not any("steps down" in line for line in log), log


def test_publications_are_read_page_by_page_past_a_key_that_is_not_utf8(
    etcd_server: EtcdCluster, keys: Keys
) -> None:
    # A key under PREFIX/verdicts/ that is not UTF-8 (anyone who may write etcd can leave
    # one), last on a page: its name decoded with U+FFFD and encoded again sorts above
    # the real key, and the next page began there, past every key in between: a member
    # named "b한" (its name's bytes sort there) went unread, its share settled `stalled`.
    etcd = Etcd(etcd_server.endpoints)
    names = [b"a/00000", b"b\xe9/00000", "b한/00000".encode()]
    for name in names:
        key = b64(keys.verdicts.encode() + name)
        etcd.txn([], [{"request_put": {"key": key, "value": b64("{}")}}])
    read = [found.key for _, found in etcd.get_prefix_paged(keys.verdicts, 2)]
    assert read == [keys.verdicts.encode() + name for name in names]


def test_the_elector_outlives_a_log_it_cannot_write(
    etcd_server: EtcdCluster, keys: Keys, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`watch` or `route` logging to a file on a full disk: the elector's "leads" line
    raised OSError (ENOSPC) in its round, the line saying so raised again, and its thread
    died: the member leader no longer renewed its lease, its daemon alive and unaware."""
    from llmhealth.cli import _log_quoted  # noqa: PLC0415 - the daemon's own logger

    full = open("/dev/full", "w")  # noqa: SIM115 - closed below
    monkeypatch.setattr(sys, "stderr", full)
    member = Elector(Etcd(etcd_server.endpoints), keys, "a", TIMING, log=_log_quoted)
    member.start()
    try:
        deadline = time.monotonic() + 30.0
        while not member.observed.etcd_up:
            assert time.monotonic() < deadline, "the elector never completed a round"
            time.sleep(0.05)
        assert member.transitions == 1 and member.fence is not None
    finally:
        member.stop()
        monkeypatch.undo()
        with contextlib.suppress(OSError):
            full.close()


def test_one_verdict_too_large_for_etcd_costs_neither_its_own_publication_nor_the_others(
    etcd_server: EtcdCluster, keys: Keys
) -> None:
    """A backend whose /metrics lists 128 engines (wide data-parallel, or a hostile
    text: a legal one may list 40,000), frozen: its wedged verdict of 61 reads was 2.2 MB,
    over etcd's 1.5 MiB. etcd refused the member's whole chunk, the publish stopped there
    (silently: the daemon suppresses StateError) and the leader settled that backend and
    every one after it in the member's publication `stalled` for as long as it lasted."""
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
            longest_gap=0.01,
            largest_step_tokens=256,
            prefill_seconds=12.5,
        )
        for i in range(128)
    )
    frozen = tuple(
        Read(1.7e9 + 5 * i, signals=Signals(engines, process_start=1.6e9)) for i in range(61)
    )
    wedged = Verdict(VerdictKind.WEDGED, False, "wedged: frozen", reads=frozen)
    taken, published, first = published_first(etcd_server, keys, wedged)
    assert {n: v for n, v in taken.items() if n != first} == {
        n: v for n, v in published.items() if n != first
    }
    got = taken[first]
    assert got.kind is VerdictKind.WEDGED and not got.healthy
    assert got.reads and got.reads[-1] == frozen[-1]  # the newest kept: the baseline


def published_first(
    etcd_server: EtcdCluster, keys: Keys, first: Verdict
) -> tuple[dict[str, Verdict], dict[str, Verdict], str]:
    """Two sharding members on etcd, ``b`` publishing busy verdicts of its share with
    ``first`` first in the publication's order: what the leader ``a`` took of every one
    of them, what was published, and the name ``first`` went under."""
    backends = {f"gpu{index}": f"http://10.0.0.{index}:8000" for index in range(12)}
    clock = Clock()
    seats = {
        name: Seat(etcd_server.endpoints, keys.prefix, name, 3.0, log=[].append) for name in "ab"
    }
    reads = {name: SharedReads(seat, clock=clock) for name, seat in seats.items()}
    try:
        for seat in seats.values():
            seat.elector.step()
        for seat in seats.values():
            seat.elector.observed = Observation(True, None, read_members(seat.etcd, seat.keys))
        leader, member = reads["a"], reads["b"]
        assert seats["a"].elector.decision().may_act
        assert leader.take(backends, stale_after=10.0, undecided_for=300.0).verdicts == {}
        share = sorted(member.share(backends))
        assert len(share) >= 2, share
        verdicts = {name: Verdict(VerdictKind.BUSY, True, f"busy {name}") for name in share}
        verdicts[share[0]] = first
        member.publish({n: 1 for n in share}, verdicts, {n: 1 for n in share}, {})
        taken = leader.take(backends, stale_after=10.0, undecided_for=300.0).verdicts
        assert set(taken) == set(share)  # none stopped the publication
        return taken, verdicts, share[0]
    finally:
        for seat in seats.values():
            seat.elector.stop()


def test_a_verdict_whose_model_list_is_too_large_for_etcd_costs_no_publication(
    etcd_server: EtcdCluster, keys: Keys
) -> None:
    """A backend whose /v1/models lists 1,000 ids of 1,024 DEL characters (a 1 MB body,
    under the probe's cap) answered the tiny request: the verdict's model list, each id
    made printable (``\\x7f`` four times longer, then JSON-escaped), was 5 MB whatever
    its reads. Dropping every read left the entry over etcd's limit, and the member's
    publication stopped there: that backend and every one after it settled `stalled`."""
    served = tuple("\\x7f" * 1024 for _ in range(1000))  # as probe.ask_tiny keeps them
    answer = Answer(1.7e9, True, "answered in 0.01 s by model m", served[0], served)
    idle = Verdict(VerdictKind.IDLE, True, "idle: answered", answer=answer, requests_sent=1)
    taken, _, first = published_first(etcd_server, keys, idle)
    got = taken[first]
    assert got.kind is VerdictKind.IDLE and got.healthy
    assert got.answer is not None and got.answer.ok and got.answer.model == served[0]


def test_a_lease_id_past_etcds_int64_is_not_taken_for_a_lease(
    etcd_server: EtcdCluster, keys: Keys
) -> None:
    # A grant answered with an ID etcd cannot hold (past int64) was kept: every later
    # request on it (the member key, each keep-alive) was refused by etcd as a JSON
    # error, no new lease was ever asked for, and the member stayed out of every
    # election for as long as it ran.
    answered = [0]

    def garbled_once(connection: socket.socket, _: int) -> None:
        read_request(connection)
        answered[0] += 1
        if answered[0] == 1:
            said = json.dumps({"ID": str(2**64 + 5), "TTL": "3"}).encode()
            connection.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(said) + said)

    with tcp_server(garbled_once) as (garbled, _):
        clock, log = Clock(), []
        etcd = Etcd([garbled, *etcd_server.endpoints], timeout=1.0)
        leader = elector(etcd, keys, "a", clock, log)
        errors = []
        for _ in range(3):
            try:
                leader.step()
            except ClusterUnavailableError as exc:
                errors.append(str(exc))
        assert leader.decision().may_act, [error[:100] for error in errors]
        leader.stop()


def test_a_reload_that_lets_readers_examine_longer_undecided_reaches_the_leaders_intake(
    etcd_server: EtcdCluster, keys: Keys
) -> None:
    """The leader's intake kept the undecided bound of the config it took the lead
    under: after a SIGHUP that lengthened the wait or max_check_time, a backend its
    member still examined, undecided, within the new bound was settled "stalled"."""
    backends = {f"gpu{index}": f"http://10.0.0.{index}:8000" for index in range(12)}
    clock = Clock()
    seats, reads = three_members(etcd_server, keys, clock)
    for seat in seats.values():
        seat.elector.observed = Observation(True, None, read_members(seat.etcd, seat.keys))
    assert seats["a"].elector.decision().may_act
    leader = reads["a"]
    young = next(name for name in backends if name not in reads["a"].share(backends))
    owner = next(name for name in "bc" if young in reads[name].share(backends))
    leader.take(backends, stale_after=10.0, undecided_for=30.0)
    stale_at = None
    for wait in range(1, 12):
        clock.now += 5.0
        reads[owner].publish({}, {}, {young: wait}, {})  # examined on, undecided
        # The config reloaded after the first waits: readers may now examine 300 s.
        taken = leader.take(backends, stale_after=10.0, undecided_for=30.0 if wait < 3 else 300.0)
        if young in taken.stale and stale_at is None:
            stale_at = wait
    for seat in seats.values():
        seat.elector.stop()
    assert stale_at is None, f"doubted at wait {stale_at}"


@pytest.mark.slow
def test_a_leader_keeps_the_lead_when_one_etcd_member_of_three_is_paused(
    tmp_path: Path,
) -> None:
    """etcd keeps its quorum with one member of three paused (SIGSTOP: it takes the
    connection and never answers). Each request waited 2 s on it before the next member
    was asked, all of a 3 s lease's 2 s renew deadline: the leader stepped down (with a
    2 s lease, etcd even let the lease lapse) and the lead changed hands for nothing."""
    log: list[str] = []
    with running_etcd(tmp_path / "etcd", members=3) as etcd_cluster:
        seat = Seat(etcd_cluster.endpoints, "/paused", "a", 3.0, log=log.append)
        seat.elector.step_and_observe()
        assert seat.elector.decision().may_act, log
        paused = etcd_cluster.members[seat.elector.etcd._current]
        seat.elector.start()
        try:
            paused.pause()
            deadline = time.monotonic() + 2 * seat.elector.timing.ttl
            while time.monotonic() < deadline:  # rounds go on in the elector's thread
                time.sleep(0.1)
            paused.resume()
            assert seat.elector.decision().may_act, log
        finally:
            paused.resume()
            seat.elector.stop()
    assert seat.elector.transitions == 1, log
    assert not any("steps down" in line or "no longer leader" in line for line in log), log


@pytest.mark.slow
def test_a_seat_on_one_etcd_endpoint_slow_to_answer_still_leads(
    etcd_server: EtcdCluster, keys: Keys
) -> None:
    """One endpoint (a one-member etcd) answering each request in 0.8 s, within the 2 s
    renew deadline of a 3 s lease: the elector's waits on one endpoint, cut to a third of
    that deadline so that a paused member's successor is asked in time, failed every
    request, though there was no other endpoint to ask, and nobody ever led."""
    log: list[str] = []

    def slow(_: str, answer: Any) -> Any:
        time.sleep(0.8)
        return answer

    with tcp_server(editing(etcd_server.endpoints[0], slow)) as (url, _):
        seat = Seat([url], keys.prefix, "a", 3.0, log=log.append)
        try:
            seat.elector.step_and_observe()
        finally:
            seat.elector.stop()
    assert seat.elector.transitions == 1, log


@pytest.mark.slow
def test_a_round_that_outlasts_stop_takes_no_lead_after_it(
    etcd_server: EtcdCluster, keys: Keys
) -> None:
    """``stop()`` waits a lease's TTL for the round under way. A round that outlasted it
    (a revoke and a grant answered 1.8 s late, within every bound) took a new lease after
    ``stop()`` had given the old one back, and the lead on it: nobody renewed nor revoked
    that lease, and its leader key kept every standby out for a TTL after the resign."""
    clock, log = Clock(), []
    slow, revoking = threading.Event(), threading.Event()

    def late(path: str, answer: Any) -> Any:
        if slow.is_set() and "lease/" in path:  # the step-down's revoke, the new grant
            revoking.set()
            time.sleep(1.8)
        return answer

    with tcp_server(editing(etcd_server.endpoints[0], late)) as (url, _):
        member = elector(Etcd([url], timeout=5.0), keys, "a", clock, log)
        member.step()
        assert member.decision().may_act
        clock.now += TIMING.renew_deadline  # its next round steps down and asks for a lease
        slow.set()
        member.start()
        assert revoking.wait(10.0)  # the round is under way
        member.stop()  # gives up on the round after 3 s: it is then asking for its lease
        assert member._thread is not None
        member._thread.join(30.0)
        assert not member._thread.is_alive()
    assert read_leader(Etcd(etcd_server.endpoints), keys) is None, log
    assert not member.decision().may_act
