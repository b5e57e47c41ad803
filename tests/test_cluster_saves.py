"""A leader's saves and the audit trim on a real etcd: a lost answer under a verb's write,
hand-written audit keys, a trail larger than one answer."""

from __future__ import annotations

import asyncio
import base64
import json
import socket
import threading
import tracemalloc
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console

from llmhealth import cli, cluster, etcd_http
from llmhealth.actions import encode_record
from llmhealth.classify import Outcome, Target, Verdict, VerdictKind
from llmhealth.cluster import (
    UNANSWERED_KEPT,
    Etcd,
    EtcdStore,
    FencedOutError,
    Keys,
    Seat,
    read_audit,
    trim_audit,
)
from llmhealth.config import Backend, Config, Policy
from llmhealth.cycle import settle_fleet
from llmhealth.daemon import Daemon, News
from llmhealth.fleet import FleetRecord
from llmhealth.remediate import Mode
from llmhealth.state import RecordMovedError
from tests.etcdproc import EtcdCluster, running_etcd
from tests.test_cluster import Clock, b64, elector, losing_txn_answers, read_posted, store_value
from tests.test_wire import read_request, tcp_server


@pytest.fixture(scope="module")
def etcd_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EtcdCluster]:
    with running_etcd(tmp_path_factory.mktemp("etcd")) as cluster:
        yield cluster


@pytest.fixture
def keys(request: pytest.FixtureRequest) -> Keys:
    return Keys(f"/llmhealth-saves/{request.node.name}")


def test_a_save_without_records_whose_answer_was_lost_under_a_verb_is_found_written(
    etcd_server: EtcdCluster, keys: Keys
) -> None:
    # Most settles write no audit record (no backend changed state: a failure streak
    # grew, a good streak grew). Such a save whose answer was lost, with an operator's
    # verb written on top before the retry, was said "moved, nothing written"
    # (RecordMovedError) though it went in: the daemon settled the same verdicts again
    # on the verb's record, which already held them, and a second failure of a SUSPECT
    # backend counted as two (DEAD, and a restart, a failure early).
    def verb_writes() -> None:
        verb = EtcdStore(Etcd(etcd_server.endpoints), keys, None)
        with verb.locked():
            verb.save({**(verb.load(dict) or {}), "value": 99})

    with tcp_server(losing_txn_answers(etcd_server.endpoints[0], verb_writes)) as (lossy, _):
        etcd = Etcd([lossy, *etcd_server.endpoints])
        clock, log = Clock(), []
        leader = elector(Etcd(etcd_server.endpoints), keys, "a", clock, log)
        leader.step()
        store = EtcdStore(etcd, keys, leader)
        with store.locked():
            store.load(dict)
            store.save({"value": 1})  # no audit record: RecordMovedError before
        assert store_value(etcd, keys) == 99
        with store.locked():  # the next section goes on from the record as it is
            assert (store.load(dict) or {})["value"] == 99
        leader.stop()


def test_a_settle_whose_answer_was_lost_under_a_verb_counts_its_verdicts_once(
    etcd_server: EtcdCluster, keys: Keys
) -> None:
    # As the daemon settles: a RecordMovedError is settled again on the record as it now
    # is (daemon.SETTLE_ATTEMPTS). gpu0 is SUSPECT after one failure; its second failure
    # is settled, the answer lost, and a verb (here one that changes nothing) writes the
    # record on top. Said "nothing written", the second failure was settled again on the
    # verb's record, which held it already: three failures, DEAD, for two.

    gpu0, gpu1 = Target("gpu0", "http://127.0.0.1:9"), Target("gpu1", "http://127.0.0.1:10")
    config = Config(backends=(Backend("gpu0", gpu0.url), Backend("gpu1", gpu1.url)))
    backends = {"gpu0": gpu0.url, "gpu1": gpu1.url}
    down = [Outcome(gpu0, Verdict(VerdictKind.DOWN, False, "down: refused"))]
    armed = [False]

    def verb_writes() -> None:
        if not armed[0]:
            return
        armed[0] = False
        verb = EtcdStore(Etcd(etcd_server.endpoints), keys, None)
        with verb.locked():
            verb.save(verb.load(dict) or {})

    with tcp_server(losing_txn_answers(etcd_server.endpoints[0], verb_writes)) as (lossy, _):
        clock, log = Clock(), []
        leader = elector(Etcd(etcd_server.endpoints), keys, "a", clock, log)
        leader.step()
        direct = EtcdStore(Etcd(etcd_server.endpoints), keys, leader)
        lossy_store = EtcdStore(Etcd([lossy, *etcd_server.endpoints]), keys, leader)

        def settle(store: EtcdStore) -> FleetRecord:
            for attempt in range(1, 4):  # as Daemon._settle does
                try:
                    settled = settle_fleet(
                        store, config, backends, lambda _: down, mode=Mode.ACT, audit=store.audit
                    )
                except RecordMovedError:
                    if attempt == 3:
                        raise
                else:
                    return settled.record
            raise AssertionError("unreachable")

        first = settle(direct)
        assert first.ledger.state_of("gpu0") == "suspect"
        armed[0] = True
        settle(lossy_store)
        reader = EtcdStore(Etcd(etcd_server.endpoints), keys, None)
        with reader.locked():
            stored = reader.load(dict)
        assert stored is not None
        (gpu0_saved,) = [b for b in stored["ledger"]["backends"] if b["name"] == "gpu0"]
        assert (gpu0_saved["state"], gpu0_saved["probe_failures"]) == ("suspect", 2)
        leader.stop()


def test_an_audit_key_whose_count_has_thousands_of_digits_ends_no_settle_nor_audit(
    etcd_server: EtcdCluster, keys: Keys
) -> None:
    # A key under PREFIX/audit/ that ends in "-" and more digits than int() takes from
    # text (4,300: Python's guard against quadratic conversion) raised ValueError out of
    # the trim, so out of a leader's save that had been written: the daemon's loop
    # ended with a traceback at its first settle with a record, after every restart; and
    # `llmhealth audit` ended in one too.

    etcd = Etcd(etcd_server.endpoints)
    hand = f"{keys.audit}by-hand-{'9' * 5000}".encode()
    line = b'{"time": 1.0, "backend": "gpu0", "event": "x", "from": "a", "to": "b"}\n'
    body = {"key": base64.b64encode(hand).decode(), "value": base64.b64encode(line).decode()}
    etcd.call("kv/put", body, lambda _: None)
    clock, log = Clock(), []
    leader = elector(etcd, keys, "a", clock, log)
    leader.step()
    store = EtcdStore(etcd, keys, leader)
    with store.locked():
        store.load(dict)
        store.append_record({"event": "restart_ordered", "backend": "gpu1"})
        store.save({"value": 1})  # ValueError before, though written
    events = [record["event"] for record in read_audit(etcd, keys).records]
    assert sorted(events) == ["restart_ordered", "x"]
    leader.stop()


def test_a_trail_of_more_keys_than_one_answer_holds_is_still_trimmed(
    etcd_server: EtcdCluster, keys: Keys, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The trim read every audit key's name in one answer. Past what one answer may hold
    # (about 200,000 keys at 32 MiB; on a real etcd 230,000 keys already took longer than
    # the 2 s an answer may keep silent) every trim failed, silently (best effort), and
    # the trail grew without bound, towards etcd's quota, past which nothing, leases
    # included, can be written. An audit_keep of 200,000 (250,000 records of 8 KiB is
    # etcd's 2 GiB) got there. Here one answer may hold 64 KiB, and pages of 128 keys do.

    monkeypatch.setattr(cluster, "_TRIM_PAGE", 128, raising=False)
    etcd = Etcd(etcd_server.endpoints, bounds=etcd_http.Bounds(silence=2.0, max_bytes=64 * 1024))
    line = base64.b64encode(b'{"time": 1.0, "backend": "gpu0", "event": "x"}\n').decode()
    for start in range(0, 1200, 120):
        etcd.txn(
            [],
            [
                {"request_put": {"key": base64.b64encode(name.encode()).decode(), "value": line}}
                for name in (keys.audit_batch(1000 + i, 1) for i in range(start, start + 120))
            ],
        )
    assert trim_audit(etcd, keys, 1000, None) == 200
    left = Etcd(etcd_server.endpoints).scan_down(keys.audit, None, 5000, keys_only=True)
    assert len(left) == 1000
    assert left[-1][0].startswith(f"{keys.audit}{1200:020d}-")  # the oldest 200 went


def test_a_deposed_leaders_save_of_an_unchanged_record_with_records_is_not_taken_as_written(
    etcd_server: EtcdCluster, keys: Keys
) -> None:
    # A settle that changes nothing in the record but writes an audit record (a dry run's
    # "would restart", a skip) by a leader deposed behind its back (its lease revoked, as
    # after a pause): its compare fails on the fence. The record in etcd is still the bytes
    # its own last settle wrote, the same as this one's; taken for this write's, the save
    # was said written and its records were lost, though its nonce (and its audit key)
    # said it never went in.
    etcd = Etcd(etcd_server.endpoints)
    clock, log = Clock(), []
    old, new = elector(etcd, keys, "old", clock, log), elector(etcd, keys, "new", clock, log)
    old.step()
    new.step()
    old_store = EtcdStore(etcd, keys, old)
    with old_store.locked():
        old_store.load(dict)
        old_store.save({"value": 1})
    with pytest.raises(FencedOutError), old_store.locked():
        old_store.load(dict)
        old_lease = old.lease_id
        assert old_lease is not None
        etcd.revoke(old_lease)
        new.step()
        assert old.decision().may_act  # nothing told it yet: only the fence stops it
        old_store.append_record({"event": "restart_dry_run", "backend": "gpu1"})
        old_store.save({"value": 1})  # said written before: the record lost
    old.stop()
    new.stop()


def the_same_page(keys: Keys, size: int, served: list[int]) -> Callable[[socket.socket, int], None]:
    """An endpoint answering every range with the same ``size`` audit keys, whatever range
    it was asked for (a transaction: succeeded); after 20 answers, an error page."""
    line = base64.b64encode(b'{"time": 1.0, "backend": "gpu0", "event": "x"}\n').decode()
    kvs = [
        {
            "key": base64.b64encode(keys.audit_batch(1000 + index, 1).encode()).decode(),
            "value": line,
            "create_revision": str(1000 + index),
            "mod_revision": str(1000 + index),
        }
        for index in range(size, 0, -1)
    ]
    page = json.dumps({"header": {"revision": "5000"}, "kvs": kvs}).encode()
    # The trim's one delete, answered as etcd answers it.
    deleted = {"response_delete_range": {"header": {"revision": "5001"}, "deleted": "54"}}
    txn = json.dumps(
        {"header": {"revision": "5001"}, "succeeded": True, "responses": [deleted]}
    ).encode()

    def answer(connection: socket.socket, _: int) -> None:
        request = read_request(connection)
        served[0] += 1
        if served[0] > 20:
            connection.sendall(b"HTTP/1.1 500 Enough\r\nContent-Length: 0\r\n\r\n")
            return
        body = txn if request.startswith(b"POST /v3/kv/txn ") else page
        connection.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(body) + body)

    return answer


@pytest.mark.parametrize("reader", ["audit", "trim"])
def test_an_endpoint_answering_the_same_page_again_ends_the_audit_read_and_the_trim(
    keys: Keys, reader: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # read_audit and trim_audit asked for the page below the last key they had, for as
    # long as pages came back full: an endpoint that answered the same keys whatever
    # range was asked (or keys outside it) was asked again for ever, `llmhealth audit`
    # holding every page it got, and a leader's settle never ending (its trim runs in
    # the save). get_prefix_paged already stops on an answer that moves no further.
    monkeypatch.setattr(cluster, "_TRIM_PAGE", 64)
    served = [0]
    with tcp_server(the_same_page(keys, 64, served)) as (url, _):
        etcd = Etcd([url], timeout=2.0)
        if reader == "audit":
            assert len(read_audit(etcd, keys).records) == 64
        else:
            assert trim_audit(etcd, keys, 10, None) == 54
    assert served[0] <= 3


@pytest.mark.slow
def test_audit_prints_an_etcd_trail_as_read_not_held_whole_as_records(
    etcd_server: EtcdCluster, keys: Keys, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # `llmhealth audit` with a [cluster] read the whole trail, then parsed every record
    # into dicts, then printed them: about four times the trail's bytes on top of them
    # (audit_keep allows 100,000 records of 8 KiB: GBs) before its first line. Records
    # are printed as parsed now, as a local log's are.
    etcd = Etcd(etcd_server.endpoints)
    reads = [{"at": 1000.0 + i, "sent": 999.5 + i, "detail": f"read {i}"} for i in range(40)]
    raw = 0
    for batch in range(20):
        puts = []
        for index in range(40):
            number = batch * 40 + index
            record = {"time": 1.0 + number, "backend": "gpu0", "event": "x", "reads": reads}
            lines = encode_record(record) * 4
            raw += len(lines)
            key = keys.audit_batch(1000 + number, 4)
            puts.append({"request_put": {"key": b64(key), "value": b64(lines)}})
        etcd.txn([], puts)
    config = tmp_path / "cluster.toml"
    endpoints = ", ".join(json.dumps(url) for url in etcd_server.endpoints)
    config.write_text(f"[cluster]\netcd = [{endpoints}]\nprefix = {json.dumps(keys.prefix)}\n")
    with (tmp_path / "warm").open("w") as out:
        monkeypatch.setattr("sys.stdout", out)
        cli.audit(last=1, config_file=str(config), state=None)  # its imports, untraced
    with (tmp_path / "out").open("w") as out:
        monkeypatch.setattr("sys.stdout", out)
        tracemalloc.start()
        try:
            cli.audit(last=None, config_file=str(config), state=None)
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
    printed = (tmp_path / "out").read_text().splitlines()
    assert len(printed) == 3200
    assert json.loads(printed[-1])["time"] == 800.0
    assert peak < 3 * raw, (peak, raw)


def keys_past_the_range(served: list[int]) -> Callable[[socket.socket, int], None]:
    """An endpoint answering every range with a full page of new keys past any range it
    was asked for (as a proxy that ignores ``range_end`` would, over a keyspace that goes
    on); after 20 answers, an error page."""

    def answer(connection: socket.socket, _: int) -> None:
        read_request(connection)
        served[0] += 1
        if served[0] > 20:
            connection.sendall(b"HTTP/1.1 500 Enough\r\nContent-Length: 0\r\n\r\n")
            return
        kvs = [
            {
                "key": base64.b64encode(b"~elsewhere/%06d" % (served[0] * 16 + index)).decode(),
                "value": base64.b64encode(b"{}").decode(),
            }
            for index in range(16)
        ]
        body = json.dumps({"header": {"revision": "5000"}, "kvs": kvs}).encode()
        connection.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(body) + body)

    return answer


def test_an_endpoint_answering_keys_past_the_range_ends_the_read_of_publications(
    keys: Keys,
) -> None:
    # get_prefix_paged asked for the page after the last key it had for as long as pages
    # came back full, whatever keys they held: an endpoint answering keys past the range
    # asked was asked again for ever, a leader's settle never ending, and every key it
    # answered taken for a member's publication.
    served = [0]
    with tcp_server(keys_past_the_range(served)) as (url, _):
        found = list(Etcd([url], timeout=2.0).get_prefix_paged(keys.verdicts, 16))
    assert found == []
    assert served[0] == 1


def succeeded_in_words(endpoint: str) -> Callable[[socket.socket, int], None]:
    """An endpoint passing each request on to ``endpoint``, answering a transaction whose
    compares failed with ``"succeeded": "false"``: a string where etcd writes a boolean
    (and leaves it out when false)."""
    host, _, port = endpoint.removeprefix("http://").partition(":")

    def forward(connection: socket.socket, _: int) -> None:
        head, body = read_posted(connection)
        with socket.create_connection((host, int(port)), timeout=5) as upstream:
            upstream.sendall(head + b"\r\n\r\n" + body)
            answer = b""
            while chunk := upstream.recv(65536):  # the request asks etcd to close
                answer += chunk
        if head.startswith(b"POST /v3/kv/txn "):
            document = json.loads(answer.partition(b"\r\n\r\n")[2])
            document.setdefault("succeeded", "false")
            said = json.dumps(document).encode()
            answer = b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(said) + said
        connection.sendall(answer)

    return forward


def test_a_transaction_said_succeeded_in_a_string_is_not_taken_for_a_written_one(
    etcd_server: EtcdCluster, keys: Keys
) -> None:
    # `bool(answer.get("succeeded"))`: the string "false" is true. A deposed leader's
    # fenced save, failed in etcd, was said written through such an answer; its restart
    # order would have run under a fence etcd had refused.
    etcd = Etcd(etcd_server.endpoints)
    clock, log = Clock(), []
    old, new = elector(etcd, keys, "old", clock, log), elector(etcd, keys, "new", clock, log)
    old.step()
    with tcp_server(succeeded_in_words(etcd_server.endpoints[0])) as (worded, _):
        store = EtcdStore(Etcd([worded, *etcd_server.endpoints]), keys, old)
        with pytest.raises(FencedOutError), store.locked():
            store.load(dict)
            old_lease = old.lease_id
            assert old_lease is not None
            etcd.revoke(old_lease)
            new.step()
            store.save({"value": 1})  # said written before
    assert etcd.get(keys.state) is None
    new.stop()
    old.stop()


def test_a_save_whose_answer_was_lost_on_the_only_endpoint_is_found_written(
    etcd_server: EtcdCluster, keys: Keys
) -> None:
    # One endpoint (one etcd, or a load balancer in front of several): the transaction
    # reached etcd and went in, its answer was lost (cut, or later than the client's
    # bound). There is no next endpoint to offer it to, so the save raised "no etcd
    # endpoint answered": the daemon stood by for the cycle, the restart this write had
    # ordered (RESTARTING in the record) never ran until startup_grace failed it, and the
    # command outcomes it had recorded were heard again by the next settle.
    with tcp_server(first_answer_lost(etcd_server.endpoints[0])) as (lossy, _):
        etcd = Etcd([lossy])
        clock, log = Clock(), []
        leader = elector(Etcd(etcd_server.endpoints), keys, "a", clock, log)
        leader.step()
        store = EtcdStore(etcd, keys, leader)
        with store.locked():
            store.load(dict)
            store.append_record({"event": "restart_ordered", "backend": "gpu1"})
            store.save({"value": 1})
            written = store.revision
        found = Etcd(etcd_server.endpoints).get(keys.state)
        assert found is not None
        assert (store_value(etcd, keys), written) == (1, found.mod_revision)
        leader.stop()


def first_answer_lost(endpoint: str) -> Callable[[socket.socket, int], None]:
    """An endpoint in front of ``endpoint`` that drops the first transaction's answer (the
    transaction went in) and passes everything else on, both ways."""
    lost = [False]

    def once() -> None:
        lost[0] = True

    forward = losing_txn_answers(endpoint, once)

    def handle(connection: socket.socket, number: int) -> None:
        if lost[0]:
            _pass_through(endpoint, connection)
        else:
            forward(connection, number)

    return handle


def _pass_through(
    endpoint: str, connection: socket.socket, head: bytes = b"", body: bytes = b""
) -> None:
    """One request (read here unless given) passed on to ``endpoint``, its answer back."""
    host, _, port = endpoint.removeprefix("http://").partition(":")
    if not head:
        head, body = read_posted(connection)
    answer = b""
    with socket.create_connection((host, int(port)), timeout=5) as upstream:
        upstream.sendall(head + b"\r\n\r\n" + body)
        while chunk := upstream.recv(65536):
            answer += chunk
    connection.sendall(answer)


def test_a_settle_ordering_a_restart_whose_answer_was_lost_still_orders_it(
    etcd_server: EtcdCluster, keys: Keys
) -> None:
    # As the daemon settles, with one etcd endpoint: a wedge is proven, the restart is
    # written down (RESTARTING) and the answer lost. Raised, the restart was never run
    # while the record said RESTARTING, until startup_grace failed it.
    url = "http://127.0.0.1:9"
    config = Config(backends=(Backend("gpu0", url, restart=("true",)),))
    wedged = [Outcome(Target("gpu0", url), Verdict(VerdictKind.WEDGED, False, "wedged"))]
    with tcp_server(first_answer_lost(etcd_server.endpoints[0])) as (lossy, _):
        clock, log = Clock(), []
        leader = elector(Etcd(etcd_server.endpoints), keys, "a", clock, log)
        leader.step()
        store = EtcdStore(Etcd([lossy]), keys, leader)
        settled = settle_fleet(
            store, config, {"gpu0": url}, lambda _: wedged, mode=Mode.ACT, audit=store.audit
        )
        assert [order.name for order in settled.orders] == ["gpu0"]
        assert str(settled.record.ledger.state_of("gpu0")) == "restarting"
        assert "LLMHEALTH_FENCE" in store.command_env()  # the command may run
        leader.stop()


def test_a_save_that_never_reached_the_only_endpoint_is_still_not_written(
    etcd_server: EtcdCluster, keys: Keys
) -> None:
    # The read-back after a lost answer proves a write only by what that write alone made:
    # a transaction cut before it reached etcd is still "no etcd endpoint answered".
    def drop_transactions(connection: socket.socket, _: int) -> None:
        head, _body = read_posted(connection)
        if not head.startswith(b"POST /v3/kv/txn ") or b"request_put" not in _body:
            _pass_through(etcd_server.endpoints[0], connection, head, _body)

    with tcp_server(drop_transactions) as (lossy, _):
        clock, log = Clock(), []
        leader = elector(Etcd(etcd_server.endpoints), keys, "a", clock, log)
        leader.step()
        store = EtcdStore(Etcd([lossy]), keys, leader)
        with pytest.raises(cluster.ClusterUnavailableError), store.locked():
            store.load(dict)
            store.append_record({"event": "restart_ordered", "backend": "gpu1"})
            store.save({"value": 1})
        assert Etcd(etcd_server.endpoints).get(keys.state) is None
        assert read_audit(Etcd(etcd_server.endpoints), keys).records == []
        leader.stop()


def test_a_save_said_unwritten_after_its_answer_was_late_does_not_go_in_later(
    etcd_server: EtcdCluster, keys: Keys
) -> None:
    # One endpoint (a load balancer in front of etcd) slow past the client's bound: the
    # transaction reaches etcd only after the read-back that was to tell whether it went
    # in. Said "no etcd endpoint answered", the settle stood by, yet its write (the
    # restart it ordered, RESTARTING) went in a moment later: the restart never ran and
    # sat RESTARTING until startup_grace failed it, as before the read-back.
    answered, landed = threading.Event(), threading.Event()
    held: list[bytes] = []
    url = "http://127.0.0.1:9"
    config = Config(backends=(Backend("gpu0", url, restart=("true",)),))
    wedged = [Outcome(Target("gpu0", url), Verdict(VerdictKind.WEDGED, False, "wedged"))]

    def late_writes(connection: socket.socket, _: int) -> None:
        head, body = read_posted(connection)
        first = head.startswith(b"POST /v3/kv/txn ") and b"request_put" in body and not held
        if not first:  # the next transaction (the client's second look) is answered first
            _pass_through(etcd_server.endpoints[0], connection, head, body)
            if head.startswith(b"POST /v3/kv/txn "):
                answered.set()
            return
        held.append(body)
        answered.wait(5)  # the client gave up on this one long ago
        host, _, port = etcd_server.endpoints[0].removeprefix("http://").partition(":")
        with socket.create_connection((host, int(port)), timeout=5) as upstream:
            upstream.sendall(head + b"\r\n\r\n" + body)
            while upstream.recv(65536):
                pass
        landed.set()

    with tcp_server(late_writes) as (lossy, _):
        clock, log = Clock(), []
        leader = elector(Etcd(etcd_server.endpoints), keys, "a", clock, log)
        leader.step()
        store = EtcdStore(Etcd([lossy], timeout=0.3), keys, leader)
        try:
            settle_fleet(
                store, config, {"gpu0": url}, lambda _: wedged, mode=Mode.ACT, audit=store.audit
            )
        except cluster.ClusterUnavailableError:
            written = False
        else:
            written = True
        assert landed.wait(5)  # the first offer reached etcd, after the client's second look
        found = Etcd(etcd_server.endpoints).get(keys.state)
        # Said written, the restart may run; said not, nothing of it may be in etcd.
        ledger = json.loads(found.value)["ledger"]["backends"] if found else None
        assert written or found is None, [(b["name"], b["state"]) for b in ledger or []]
        leader.stop()


def test_a_refused_verb_whose_records_answer_was_lost_is_said_refused(
    etcd_server: EtcdCluster, keys: Keys
) -> None:
    # A verb the ledger refuses writes its audit record alone (``_write_records_alone``).
    # Its answer lost on the only endpoint, the operator was told "no etcd endpoint
    # answered" while the refusal was in the trail, and trying again wrote it twice.
    from llmhealth import operate  # noqa: PLC0415

    config = Config(backends=(Backend("gpu", "http://127.0.0.1:9"),))
    plain = EtcdStore(Etcd(etcd_server.endpoints), keys, None)
    assert operate.hold(plain, plain.audit, config, "gpu", 600.0, "weight sync").applied
    with tcp_server(first_answer_lost(etcd_server.endpoints[0])) as (lossy, _):
        store = EtcdStore(Etcd([lossy]), keys, None)
        refused = operate.readmit(store, store.audit, config, "gpu", None)  # HEALTHY already
    assert not refused.applied, refused
    trail = read_audit(plain.etcd, keys).records
    assert [(r["event"], r.get("applied")) for r in trail] == [("hold", None), ("readmit", False)]


def test_a_verb_whose_lost_write_was_offered_again_on_a_moved_record_is_made_again(
    etcd_server: EtcdCluster, keys: Keys
) -> None:
    # A verb's write cut before it reached the only endpoint (a balancer), the leader's
    # settle writing the record meanwhile: the second offer is answered, its compare
    # failed, and nothing of it is there. Neither offer can go in any more (the record
    # moved on): the verb raced the leader, and is made again on its record. It was "no
    # etcd endpoint answered" to the operator, the hold not made, etcd answering all along.
    from llmhealth import operate  # noqa: PLC0415

    backends = (Backend("gpu", "http://127.0.0.1:9"), Backend("gpu2", "http://127.0.0.1:10"))
    config = Config(backends=backends)
    plain = EtcdStore(Etcd(etcd_server.endpoints), keys, None)
    assert operate.hold(plain, plain.audit, config, "gpu2", 600.0, "first").applied
    dropped: list[bytes] = []

    def leader_writes_then_drop(connection: socket.socket, _: int) -> None:
        head, body = read_posted(connection)
        if head.startswith(b"POST /v3/kv/txn ") and b"request_put" in body and not dropped:
            dropped.append(body)
            # Another writer (the leader's settle; here a verb), between this one's load
            # and its save.
            assert operate.release(plain, plain.audit, config, "gpu2").applied
            return  # cut: never reached etcd
        _pass_through(etcd_server.endpoints[0], connection, head, body)

    with tcp_server(leader_writes_then_drop) as (lossy, _):
        store = EtcdStore(Etcd([lossy]), keys, None)
        held = operate.hold(store, store.audit, config, "gpu", 600.0, "weight sync")
    assert dropped
    assert held.applied, held
    trail = read_audit(plain.etcd, keys).records
    assert [r["event"] for r in trail] == ["hold", "release", "hold"], trail


def test_a_settle_whose_write_landed_and_answer_was_lost_is_not_settled_twice(
    etcd_server: EtcdCluster, keys: Keys
) -> None:
    # The only endpoint takes the settle's write to etcd and loses its answer; the write
    # offered again under the same compares fails them (the first moved the record). Its
    # failed branch reads back this save's nonce at PREFIX/saved: written, not a moved
    # record. Taken as moved, the daemon's next attempt (SETTLE_ATTEMPTS) settled the
    # router's failures again on a record already holding them (two for one), and the
    # restart it had written down (RESTARTING) was never ordered.
    import time  # noqa: PLC0415

    from llmhealth.traffic import FailureKind, RequestOutcome  # noqa: PLC0415

    gpu0, gpu1 = Target("gpu0", "http://127.0.0.1:9"), Target("gpu1", "http://127.0.0.1:10")
    config = Config(
        backends=(Backend("gpu0", gpu0.url), Backend("gpu1", gpu1.url, restart=("true",)))
    )
    backends = {"gpu0": gpu0.url, "gpu1": gpu1.url}
    wedged = [Outcome(gpu1, Verdict(VerdictKind.WEDGED, False, "wedged"))]
    failure = RequestOutcome(time.time(), "POST", "/v1/completions", FailureKind.REFUSED)
    requests = {"gpu0": (failure,)}
    dropped: list[bytes] = []
    second: list[bytes] = []

    def first_write_answer_lost(connection: socket.socket, _: int) -> None:
        head, body = read_posted(connection)
        if head.startswith(b"POST /v3/kv/txn ") and b"request_put" in body and not dropped:
            dropped.append(body)
            host, _, port = etcd_server.endpoints[0].removeprefix("http://").partition(":")
            with socket.create_connection((host, int(port)), timeout=5) as upstream:
                upstream.sendall(head + b"\r\n\r\n" + body)
                while upstream.recv(65536):  # etcd wrote it; its answer goes nowhere
                    pass
            return
        if head.startswith(b"POST /v3/kv/txn ") and b"request_put" in body:
            second.append(body)
        _pass_through(etcd_server.endpoints[0], connection, head, body)

    with tcp_server(first_write_answer_lost) as (lossy, _):
        clock, log = Clock(), []
        leader = elector(Etcd(etcd_server.endpoints), keys, "a", clock, log)
        leader.step()
        store = EtcdStore(Etcd([lossy]), keys, leader)
        attempts, orders = 0, []
        for attempt in range(1, 4):  # as Daemon._settle does
            attempts += 1
            try:
                settled = settle_fleet(
                    store,
                    config,
                    backends,
                    lambda _: wedged,
                    mode=Mode.ACT,
                    audit=store.audit,
                    requests=requests,
                )
            except RecordMovedError:
                if attempt == 3:
                    raise
            else:
                orders.extend(order.name for order in settled.orders)
                break
        assert dropped and second  # the first went in unanswered; offered again
        assert (attempts, orders) == (1, ["gpu1"])
        reader = EtcdStore(Etcd(etcd_server.endpoints), keys, None)
        with reader.locked():
            stored = reader.load(dict)
        assert stored is not None
        (gpu0_saved,) = [b for b in stored["ledger"]["backends"] if b["name"] == "gpu0"]
        assert gpu0_saved["request_failures"] == 1, gpu0_saved
        trail = read_audit(Etcd(etcd_server.endpoints), keys).records
        ordered = [r for r in trail if r.get("backend") == "gpu1" and "restart" in r["event"]]
        assert len(ordered) == 1, trail
        leader.stop()


def leading_daemon(
    etcd_server: EtcdCluster, keys: Keys, configs: list[Config], targets: list[Target]
) -> tuple[Seat, Daemon]:
    """A daemon in the lead of ``keys`` on the real etcd, its config the last of
    ``configs`` (append one to reload), reading nothing: a test drives its settles."""
    seat = Seat(etcd_server.endpoints, keys.prefix, "a", 10.0, log=lambda _: None)
    daemon = Daemon(
        lambda: (configs[-1], targets),
        seat,
        listen=None,
        wait_override=None,
        serving_file=None,
        console=Console(stderr=True),
    )
    seat.elector.step()
    assert seat.elector.decision().may_act
    return seat, daemon


def state_answers_lost(
    etcd_server: EtcdCluster, keys: Keys, *, landed: bool = True
) -> Callable[[socket.socket, int], None]:
    """An endpoint in front of the real etcd that loses the answer of every write of the
    record (gone in; with ``landed`` False, cut before etcd) and passes all else on."""
    state_key = base64.b64encode(keys.state.encode())

    def handle(connection: socket.socket, _: int) -> None:
        head, body = read_posted(connection)
        if not (head.startswith(b"POST /v3/kv/txn ") and state_key in body):
            _pass_through(etcd_server.endpoints[0], connection, head, body)
        elif landed:
            host, _, port = etcd_server.endpoints[0].removeprefix("http://").partition(":")
            with socket.create_connection((host, int(port)), timeout=5) as upstream:
                upstream.sendall(head + b"\r\n\r\n" + body)
                while upstream.recv(65536):  # etcd wrote it; its answer goes nowhere
                    pass

    return handle


@pytest.mark.parametrize("landed", [True, False], ids=["went in", "cut before etcd"])
def test_a_settle_whose_write_landed_and_both_answers_were_lost_hears_nothing_twice(
    etcd_server: EtcdCluster, keys: Keys, landed: bool
) -> None:
    # The only endpoint takes the settle's write to etcd and loses its answer, and that
    # of the write offered again (whose compare failed on the first): "no etcd endpoint
    # answered". The daemon stood by and kept the cycle's news (a restart command's
    # outcome, the router's failures) for the next settle, which heard them again on the
    # record already holding them: two request failures counted as four (gpu0 DEAD, a
    # restart, on two), the command's outcome twice in the trail. Cut before etcd, the
    # next settle hears them once all the same.
    import time  # noqa: PLC0415

    from llmhealth.actions import CommandResult  # noqa: PLC0415
    from llmhealth.remediate import CommandDone  # noqa: PLC0415
    from llmhealth.traffic import FailureKind, RequestOutcome  # noqa: PLC0415

    gpu0, gpu1 = Target("gpu0", "http://127.0.0.1:9"), Target("gpu1", "http://127.0.0.1:10")
    config = Config(
        backends=(Backend("gpu0", gpu0.url), Backend("gpu1", gpu1.url, restart=("true",)))
    )
    seat, daemon = leading_daemon(etcd_server, keys, [config], [gpu0, gpu1])
    direct = seat.store.etcd
    try:
        wedged = Outcome(gpu1, Verdict(VerdictKind.WEDGED, False, "wedged"))
        (order,) = daemon._settle(News([wedged], [])).orders
        ran = CommandDone(order, CommandResult(order.argv, 0, False, 0.1, "", ""))
        now = time.time()
        failures = {
            "gpu0": tuple(
                RequestOutcome(now + n, "POST", "/v1/completions", FailureKind.REFUSED)
                for n in (0.0, 0.1)
            )
        }
        with tcp_server(state_answers_lost(etcd_server, keys, landed=landed)) as (lossy, _):
            seat.store.etcd = Etcd([lossy], timeout=0.5)
            daemon._settle(News([], [ran], failures))  # went in; "no etcd endpoint answered"
        seat.store.etcd = direct
        # As the loop does: the router's failures back to it, drained by the next settle.
        back, daemon._unsettled_requests = daemon._unsettled_requests, None
        daemon._settle(News([], daemon._take_commands(), back))
        found = direct.get(keys.state)
        assert found is not None
        saved = {b["name"]: b for b in json.loads(found.value)["ledger"]["backends"]}
        trail = read_audit(direct, keys).records
        assert [r["event"] for r in trail].count("restart_command") == 1, trail
        assert (saved["gpu0"]["state"], saved["gpu0"]["request_failures"]) == ("suspect", 2)
    finally:
        seat.elector.stop()


@pytest.mark.parametrize("outcomes", [True, False], ids=["with outcomes", "nothing else"])
def test_a_restart_a_stops_last_settle_finds_issued_by_a_lost_save_is_heard_as_not_run(
    etcd_server: EtcdCluster, keys: Keys, outcomes: bool
) -> None:
    # The settle before a stop issued gpu1's restart; its save went in and the answer was
    # lost. The last settle on the way out found it went in and took that restart as one
    # of its own orders, which nobody launches nor hears once stopping: gpu1 stayed
    # RESTARTING, an attempt spent, no command run, and the next start failed it after
    # its grace. Heard as not run instead, as any order the stopping loop drops. With no
    # outcome to save, no last settle ran at all, and none found it.
    from llmhealth.actions import CommandResult  # noqa: PLC0415
    from llmhealth.remediate import CommandDone  # noqa: PLC0415

    gpu0, gpu1 = Target("gpu0", "http://127.0.0.1:9"), Target("gpu1", "http://127.0.0.1:10")
    config = Config(
        backends=(
            Backend("gpu0", gpu0.url, restart=("true",)),
            Backend("gpu1", gpu1.url, restart=("true",)),
        ),
        policy=Policy(max_concurrent_restarts=2),
    )
    seat, daemon = leading_daemon(etcd_server, keys, [config], [gpu0, gpu1])
    direct = seat.store.etcd
    try:
        first = Outcome(gpu0, Verdict(VerdictKind.WEDGED, False, "wedged"))
        (order,) = daemon._settle(News([first], [])).orders
        ran = [CommandDone(order, CommandResult(order.argv, 0, False, 0.1, "", ""))]
        wedged = Outcome(gpu1, Verdict(VerdictKind.WEDGED, False, "wedged"))
        with tcp_server(state_answers_lost(etcd_server, keys)) as (lossy, _):
            seat.store.etcd = Etcd([lossy], timeout=0.5)
            assert not daemon._settle(News([wedged], ran if outcomes else [])).orders
        seat.store.etcd = direct
        daemon.stop()
        asyncio.run(daemon._finish_commands())  # the last settle: it finds that save went in
        found = direct.get(keys.state)
        assert found is not None
        saved = {b["name"]: b for b in json.loads(found.value)["ledger"]["backends"]}
        assert (saved["gpu1"]["state"], saved["gpu1"]["restart_times"]) == ("dead", [])
        trail = read_audit(direct, keys).records
        events = [(r["event"], r.get("to")) for r in trail if r.get("backend") == "gpu1"]
        assert events == [
            ("wedge_proven", "dead"),
            ("restart", "restarting"),
            ("restart_command", "dead"),  # not run: the daemon was stopping
        ], trail
    finally:
        seat.elector.stop()


def test_saves_refused_cycle_after_cycle_keep_a_bounded_memory_of_what_they_were_given(
    etcd_server: EtcdCluster, keys: Keys
) -> None:
    # etcd refuses every write of the record (its space quota reached, a record larger
    # than its request bound) while the leader's lease is kept alive: each settle's save
    # is said unanswered, and the daemon and the store each remembered it, with what the
    # settle was given (the router's failures, command outcomes), until a save answered.
    # A daemon running for days that way grew by a settle's news every cycle.
    gpu0 = Target("gpu0", "http://127.0.0.1:9")
    config = Config(backends=(Backend("gpu0", gpu0.url),))
    seat, daemon = leading_daemon(etcd_server, keys, [config], [gpu0])
    state_key = base64.b64encode(keys.state.encode())
    refused = (
        b'{"error":"etcdserver: mvcc: database space exceeded","code":8,'
        b'"message":"etcdserver: mvcc: database space exceeded"}'
    )

    def saves_refused(connection: socket.socket, _: int) -> None:
        head, body = read_posted(connection)
        if head.startswith(b"POST /v3/kv/txn ") and state_key in body:
            connection.sendall(
                b"HTTP/1.1 429 Too Many Requests\r\nContent-Type: application/json\r\n"
                b"Content-Length: %d\r\nConnection: close\r\n\r\n" % len(refused) + refused
            )
            return
        _pass_through(etcd_server.endpoints[0], connection, head, body)

    try:
        daemon._settle(News([], []))  # a record to compare with
        with tcp_server(saves_refused) as (refusing, _):
            seat.store.etcd = Etcd([refusing], timeout=0.5)
            for _ in range(UNANSWERED_KEPT + 5):
                daemon._settle(News([], []))
        assert len(daemon._unanswered) <= UNANSWERED_KEPT
        assert len(seat.store._unanswered) <= UNANSWERED_KEPT
    finally:
        seat.elector.stop()


@pytest.mark.parametrize("lossy_settles", [1, 2], ids=["found in", "found in unanswered"])
def test_a_restart_issued_by_a_save_whose_answers_were_both_lost_is_run_once_found_in(
    etcd_server: EtcdCluster, keys: Keys, lossy_settles: int
) -> None:
    # The settle's save went in, a restart of gpu1 with it (RESTARTING, "restart" in the
    # trail), and both its offers lost their answers: the daemon stood by and ran no
    # command. The next settle found that save in and settled without it, ordering
    # nothing (gpu1 already RESTARTING): gpu1 stayed wedged until its startup grace ran
    # out, an attempt spent on a restart nobody ran. With two lossy settles, the one that
    # found the first save in had its own save's answers lost too (etcd as flaky as
    # before), and the restart it was to run was kept nowhere.
    gpu1 = Target("gpu1", "http://127.0.0.1:10")
    config = Config(backends=(Backend("gpu1", gpu1.url, restart=("true",)),))
    seat, daemon = leading_daemon(etcd_server, keys, [config], [gpu1])
    direct = seat.store.etcd
    try:
        daemon._settle(News([], []))
        wedged = Outcome(gpu1, Verdict(VerdictKind.WEDGED, False, "wedged"))
        with tcp_server(state_answers_lost(etcd_server, keys)) as (lossy, _):
            seat.store.etcd = Etcd([lossy], timeout=0.5)
            for _ in range(lossy_settles):  # each went in, unanswered (the later found it)
                assert daemon._settle(News([wedged], daemon._take_commands())).orders == ()
        seat.store.etcd = direct
        settled = daemon._settle(News([wedged], daemon._take_commands()))
        assert [order.name for order in settled.orders] == ["gpu1"]
        assert not daemon._run_unless_withdrawn(settled.orders[0]).withdrawn  # still its own
        trail = read_audit(direct, keys).records
        assert [r["event"] for r in trail].count("restart") == 1, trail
    finally:
        seat.elector.stop()


def test_a_restart_found_in_after_a_reload_changed_its_command_does_not_run_the_old_one(
    etcd_server: EtcdCluster, keys: Keys
) -> None:
    # The save that went in while both its answers were lost ordered gpu1's restart with
    # the command configured then; a reload before the settle that found it in gave gpu1
    # another (the old one wrong, or its host's unit renamed). That settle ran the old
    # command, which the config no longer names: a reload applies between two settles.
    gpu1 = Target("gpu1", "http://127.0.0.1:10")
    configs = [Config(backends=(Backend("gpu1", gpu1.url, restart=("true",)),))]
    seat, daemon = leading_daemon(etcd_server, keys, configs, [gpu1])
    direct = seat.store.etcd
    try:
        daemon._settle(News([], []))
        wedged = Outcome(gpu1, Verdict(VerdictKind.WEDGED, False, "wedged"))
        with tcp_server(state_answers_lost(etcd_server, keys)) as (lossy, _):
            seat.store.etcd = Etcd([lossy], timeout=0.5)
            assert daemon._settle(News([wedged], [])).orders == ()  # went in, unanswered
        seat.store.etcd = direct
        configs.append(Config(backends=(Backend("gpu1", gpu1.url, restart=("false",)),)))

        async def reload() -> None:  # SIGHUP, between two settles
            daemon._reload_config()
            await daemon._reading.close()

        asyncio.run(reload())
        assert daemon._config.backends[0].restart == ("false",)
        settled = daemon._settle(News([wedged], daemon._take_commands()))
        for order in settled.orders:  # as each order's command thread begins
            done = daemon._run_unless_withdrawn(order)
            assert done.withdrawn == (order.argv != ("false",)), done
            daemon._commands_done.append(done)
        assert [o.argv for o in settled.orders if o.argv != ("false",)] == [("true",)]
        for _ in range(2):  # the withdrawal heard, no attempt spent: issued anew
            settled = daemon._settle(News([wedged], daemon._take_commands()))
            if settled.orders:
                break
        assert [order.argv for order in settled.orders] == [("false",)]
    finally:
        seat.elector.stop()


def test_a_reload_applied_while_a_command_reads_the_record_withdraws_its_old_command(
    etcd_server: EtcdCluster, keys: Keys, tmp_path: Path
) -> None:
    # The command's thread asks the config before it reads the record, which with etcd
    # slow takes up to a call's bound: a reload the loop applied meanwhile (it applies
    # one as soon as the settle's orders are launched) gave the backend another command,
    # and the one the config no longer names ran anyway.
    ran = tmp_path / "ran"
    gpu1 = Target("gpu1", "http://127.0.0.1:10")
    configs = [Config(backends=(Backend("gpu1", gpu1.url, restart=("touch", str(ran))),))]
    seat, daemon = leading_daemon(etcd_server, keys, configs, [gpu1])
    try:
        daemon._settle(News([], []))
        wedged = Outcome(gpu1, Verdict(VerdictKind.WEDGED, False, "wedged"))
        settled = daemon._settle(News([wedged], []))
        assert [order.argv[0] for order in settled.orders] == ["touch"]
        read = seat.store.read

        def read_while_reloaded(decode: Callable[[dict[str, Any]], object]) -> object:
            configs.append(Config(backends=(Backend("gpu1", gpu1.url, restart=("false",)),)))

            async def reload() -> None:  # SIGHUP, applied by the loop meanwhile
                daemon._reload_config()
                await daemon._reading.close()

            asyncio.run(reload())
            return read(decode)

        seat.store.read = read_while_reloaded  # type: ignore[method-assign]
        done = daemon._run_unless_withdrawn(settled.orders[0])
        assert daemon._config.backends[0].restart == ("false",)
        assert done.withdrawn and not ran.exists(), done
    finally:
        seat.elector.stop()


def empty_objects(served: list[int]) -> Callable[[socket.socket, int], None]:
    """Another service's JSON API where an etcd endpoint was listed: every request, its
    body unread, answered 200 with an empty object (no ``header``, which etcd gives every
    answer)."""

    def answer(connection: socket.socket, _: int) -> None:
        read_posted(connection)
        served[0] += 1
        connection.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}")

    return answer


def _save_seven(etcd_server: EtcdCluster, keys: Keys) -> None:
    """A record of ``{"value": 7}`` in etcd, saved as an operator's verb saves it."""
    verb = EtcdStore(Etcd(etcd_server.endpoints), keys, None)
    with verb.locked():
        verb.load(dict)
        verb.save({"value": 7})


def test_an_endpoint_answering_an_empty_object_is_not_etcd_saying_no_record(
    etcd_server: EtcdCluster, keys: Keys
) -> None:
    # `{}` read as etcd's word: a range that found nothing, a transaction whose compares
    # failed. With such an endpoint first in the list, the record etcd held was read as
    # none (`status` showed an empty fleet, a standby's router served nothing), and the
    # leader's every save was "fenced out: nobody leads", nothing settled while etcd was
    # there to answer, the endpoint that said so asked first every time.
    _save_seven(etcd_server, keys)
    served = [0]
    with tcp_server(empty_objects(served)) as (other, _):
        etcd = Etcd([other, *etcd_server.endpoints])
        assert (cluster.ReadOnlyStore(etcd, keys).read(dict) or {}).get("value") == 7
        clock, log = Clock(), []
        leader = elector(Etcd(etcd_server.endpoints), keys, "a", clock, log)
        leader.step()
        store = EtcdStore(etcd, keys, leader)
        with store.locked():
            store.save({"value": (store.load(dict) or {"value": 0})["value"] + 1})
        leader.stop()
    assert served[0] >= 1
    assert store_value(Etcd(etcd_server.endpoints), keys) == 8


def test_an_endpoint_answering_another_key_is_not_read_for_the_record(
    etcd_server: EtcdCluster, keys: Keys
) -> None:
    # A range for one key answered with others (a proxy that ignores the key asked):
    # the first was taken for the record, which a standby then called unreadable, and a
    # leader's load "copied aside" and settled on as a fresh ledger. Not etcd's answer to
    # that request: the next endpoint is asked, as for the paged reads.
    _save_seven(etcd_server, keys)
    served = [0]
    with tcp_server(keys_past_the_range(served)) as (elsewhere, _):
        etcd = Etcd([elsewhere, *etcd_server.endpoints])
        assert (cluster.ReadOnlyStore(etcd, keys).read(dict) or {}).get("value") == 7
        assert cluster.read_leader(Etcd([elsewhere, *etcd_server.endpoints]), keys) is None
    assert served[0] >= 1
