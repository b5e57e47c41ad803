"""Leadership and the fenced store against a real etcd (started here, on free ports).

The electors are stepped by hand (``step()``), not by their threads, and their monotonic
clock is a value the test moves: what is under test is what etcd answers and what each
daemon concludes from it, never how fast a loaded machine runs.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from llmhealth.cluster import (
    ClusterUnavailableError,
    Elector,
    Etcd,
    EtcdStore,
    FencedOutError,
    Keys,
    NotLeaderError,
    read_leader,
)
from llmhealth.leadership import LeaseTiming, Standing
from tests.etcdproc import EtcdCluster, free_port, running_etcd

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
        with pytest.raises(FencedOutError, match="nobody leads"):
            first.save(document(1))
    assert store_value(etcd, keys) == 2


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


def b64(text: str) -> str:
    import base64  # noqa: PLC0415

    return base64.b64encode(text.encode()).decode()


def test_an_endpoint_that_does_not_answer_is_passed_over(
    etcd_server: EtcdCluster, keys: Keys
) -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    etcd = Etcd([dead, *etcd_server.endpoints], timeout=1.0)
    etcd.txn([], [{"request_put": {"key": b64(keys.state), "value": b64("{}")}}])
    assert etcd.get(keys.state) is not None


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
