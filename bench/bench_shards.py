"""Sharded reads on etcd: what publishing and taking verdicts cost a wait, at 1,000 backends.

Two members of one real etcd (one member of etcd, on this machine), 1,000 backends split
by rendezvous hashing. Every round: the standby publishes its share's newest verdicts
(each a real three-read verdict of the busy capture, about 2 KB), and the leader takes
them (reads every publication, parses it, keeps the new ones). Beside it, in the same
rounds, the baseline every leader pays with or without sharding: one settle's store
round trip (lock, load, fenced save) of the 1,000-backend record. Medians with maxima;
the load average before and after.

`python bench_shards.py` prints the section (it is not one of `make bench`'s steps).
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from bench_takeover import _record
from etcdproc import running_etcd
from report import Section, Table, section_markdown, spread

from llmhealth.classify import Read, Verdict, decide
from llmhealth.cluster import EtcdStore, Observation, Seat, SharedReads, read_members
from llmhealth.fleet import FleetRecord
from llmhealth.ledger import LedgerPolicy
from llmhealth.metrics import parse_metrics

BACKENDS = 1000
ROUNDS = 30
FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "vllm-0.32"


def busy_verdict() -> Verdict:
    reads = [
        Read(100.0 + 5 * index, signals=parse_metrics((FIXTURES / f"busy-{index}.txt").read_text()))
        for index in range(3)
    ]
    verdict = decide(reads, max_reads=3)
    assert isinstance(verdict, Verdict)
    return verdict


def measure(rounds: int = ROUNDS) -> dict[str, object]:
    backends = [f"gpu{index}" for index in range(BACKENDS)]
    verdict = busy_verdict()
    document = _record(BACKENDS).to_dict()
    policy = LedgerPolicy()
    publish, take, store_ms = [], [], []
    with tempfile.TemporaryDirectory() as folder, running_etcd(Path(folder) / "etcd") as etcd:
        seats = {
            name: Seat(etcd.endpoints, "/llmhealth/bench-shards", name, 30.0, log=lambda _: None)
            for name in ("leader", "reader")
        }
        seats["leader"].elector.step()
        seats["reader"].elector.step()
        for seat in seats.values():
            seat.elector.observed = Observation(True, None, read_members(seat.etcd, seat.keys))
        leader, reader = SharedReads(seats["leader"]), SharedReads(seats["reader"])
        share = sorted(reader.share(backends))
        verdicts = {name: verdict for name in share}
        store = EtcdStore(seats["leader"].etcd, seats["leader"].keys, seats["leader"].elector)
        leader.take(
            backends, stale_after=3600.0, undecided_for=300.0
        )  # a new leader's first take primes
        taken = 0
        for serial in range(1, rounds + 1):
            began = time.perf_counter()
            reader.publish(
                {name: serial for name in share}, verdicts, {name: serial for name in share}
            )
            publish.append((time.perf_counter() - began) * 1000)
            began = time.perf_counter()
            taken = len(leader.take(backends, stale_after=3600.0, undecided_for=300.0).verdicts)
            take.append((time.perf_counter() - began) * 1000)
            began = time.perf_counter()
            with store.locked():
                store.load(lambda d: FleetRecord.from_dict(d, policy))
                store.save(document)
            store_ms.append((time.perf_counter() - began) * 1000)
        published = seats["leader"].etcd.get_prefix(seats["leader"].keys.verdicts)
        size = sum(len(found.value) for found in published.values())
        for seat in seats.values():
            seat.elector.stop()
    return {
        "share": len(share),
        "taken": taken,
        "bytes": size,
        "chunks": len(published),
        "publish": publish,
        "take": take,
        "store": store_ms,
    }


def run() -> list[Section]:
    began = time.monotonic()
    load_before = os.getloadavg()[0]
    result = measure()
    load_after = os.getloadavg()[0]
    publish, take, store = (result[key] for key in ("publish", "take", "store"))
    assert isinstance(publish, list) and isinstance(take, list) and isinstance(store, list)
    rows = [
        [
            f"reader publishes its share ({result['share']} verdicts, {result['chunks']} keys, "
            f"{result['bytes']} bytes)",
            spread(publish, 1),
            f"{max(publish):.1f}",
        ],
        [
            f"leader takes the others' verdicts ({result['taken']} new each round)",
            spread(take, 1),
            f"{max(take):.1f}",
        ],
        [
            f"baseline: one settle's store round trip, {BACKENDS} backends (every leader)",
            spread(store, 1),
            f"{max(store):.1f}",
        ],
    ]
    return [
        Section(
            title=f"5d. Sharded reads: publishing and taking verdicts, {BACKENDS} backends "
            "(bench_shards)",
            command="cd bench && ../.venv/bin/python bench_shards.py",
            intro=[
                f"Two members of a one-member etcd, {BACKENDS} backends split by rendezvous "
                f"hashing, {ROUNDS} rounds; in each the standby publishes and the leader "
                "takes, and the leader's store round trip is measured in the same round. "
                f"Load average {load_before:.1f} before the run and {load_after:.1f} after "
                "(2 cores, shared with other work)."
            ],
            tables=[Table(["step, per wait", "ms, median (min-max)", "max ms"], rows)],
            notes=[
                "The reads a member no longer makes are its share's /metrics reads and "
                "verdicts (section 3c gives their cost per cycle); what it adds is the "
                "publish, and the leader adds the take to each settle."
            ],
            seconds=time.monotonic() - began,
        )
    ]


if __name__ == "__main__":
    for section in run():
        print(section_markdown(section))
