"""Several daemons on etcd: how long a takeover takes, and what the fenced record costs.

- Takeover: two real `llmhealth watch` daemons on one restartable simulated backend and a
  real etcd; each round injects a wedge and SIGKILLs the leader at once, and times the
  kill to the new leader's first action (the restart command's first line). The killed
  daemon is replaced by a fresh standby before the next round. Baseline: one daemon alone,
  killed the same way and started again at once (a supervisor with no restart delay);
  it must prove the wedge from cold reads.
- Counts: restarts per wedge (a double restart would show as two lines), and lines
  written by a daemon after it was killed (a deposed leader acting).
- The record's cost: one settle's store round trip (lock, load, save) for 1,000
  backends, etcd (a fenced transaction through the JSON gateway) against the state file.

`python bench_takeover.py` prints the section; `run()` hands it to run.py.
"""

from __future__ import annotations

import signal
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from clusterscene import TTL, inject_wedge, leads, staged, until
from etcdproc import running_etcd
from report import Section, Table, spread
from test_daemon import Page, Watch, watching

from llmhealth.classify import Verdict, VerdictKind
from llmhealth.cluster import Elector, Etcd, EtcdStore, Keys
from llmhealth.fleet import FleetRecord, Sighting
from llmhealth.leadership import LeaseTiming
from llmhealth.ledger import Ledger, LedgerPolicy
from llmhealth.metrics import EngineSignals, Signals
from llmhealth.state import StateFile

KILLS = 20
BASELINE_KILLS = 5
SETTLES = 30
BACKENDS = 1000
ENTRY_POINT = str(Path(sys.executable).with_name("llmhealth"))
# One wedge after another on the same backend: no cooldown between restarts, and a
# budget that 20 rounds do not spend (the defaults would wait 1 min, then retire it).
POLICY = 'cooldown = "1s"\nrestart_budget = 100'


def _healthy_on(watches: list[Watch]) -> None:
    until(
        "gpu healthy",
        lambda: any((w.scrape() or Page("")).state("gpu") == "healthy" for w in watches),
        timeout=120,
    )


def takeovers(kills: int = KILLS) -> tuple[list[float], int, int]:
    """Seconds from each kill to the new leader's restart; double restarts; deposed acts."""
    seconds: list[float] = []
    deposed = 0
    with (
        tempfile.TemporaryDirectory(ignore_cleanup_errors=True) as folder,
        staged(ENTRY_POINT, Path(folder), policy=POLICY) as scene,
        ExitStack() as stack,
    ):
        watches = [stack.enter_context(scene.daemon("d0"))]
        watches[0].until("a leader", leads, timeout=60)
        watches.append(stack.enter_context(scene.daemon("d1")))
        watches[1].until("a standby", lambda p: p.cycled, timeout=60)
        for round_ in range(kills):
            _healthy_on(watches)
            until("a leader", lambda: any(leads(w.scrape() or Page("")) for w in watches), 60)
            leader = next(w for w in watches if leads(w.scrape() or Page("")))
            member = (leader.scrape() or Page("")).samples("llmhealth_cluster_leader")[0]
            killed_member = member.labels["member"]
            before = len(scene.restarts.lines())
            inject_wedge(scene.gpu)
            leader.process.send_signal(signal.SIGKILL)
            killed = time.monotonic()
            until(
                "the new leader's restart",
                lambda n=before: len(scene.restarts.lines()) > n,
                120,
            )
            seconds.append(time.monotonic() - killed)
            leader.process.wait(10)
            watches.remove(leader)
            watches.append(stack.enter_context(scene.daemon(f"d{round_ + 2}")))
            _healthy_on(watches)
            deposed += sum(1 for _, who in scene.restarts.lines()[before:] if who == killed_member)
        lines = scene.restarts.lines()
    return seconds, len(lines) - kills, deposed


def baseline(kills: int = BASELINE_KILLS) -> list[float]:
    """One daemon with a state file (no cluster), killed with a wedge injected, started
    again at once on the same state."""
    seconds: list[float] = []
    with (
        tempfile.TemporaryDirectory(ignore_cleanup_errors=True) as folder,
        staged(ENTRY_POINT, Path(folder), policy=POLICY) as scene,
        ExitStack() as stack,
    ):
        solo = Path(folder) / "solo.toml"
        text = scene.config.read_text()
        cluster = text.index("\n[cluster]")
        rest = text.find("\n[", cluster + 1)  # the [policy] table after it stays
        solo.write_text(text[:cluster] + (text[rest:] if rest >= 0 else "\n"))
        state = Path(folder) / "solo-state.json"
        watch = stack.enter_context(watching(ENTRY_POINT, solo, state))
        watch.until("a first cycle", lambda p: p.cycled, timeout=60)
        for _ in range(kills):
            _healthy_on([watch])
            before = len(scene.restarts.lines())
            inject_wedge(scene.gpu)
            watch.process.send_signal(signal.SIGKILL)
            killed = time.monotonic()
            watch.process.wait(10)
            watch = stack.enter_context(watching(ENTRY_POINT, solo, state))
            until("the restart", lambda n=before: len(scene.restarts.lines()) > n, 120)
            seconds.append(time.monotonic() - killed)
    return seconds


def _record(backends: int) -> FleetRecord:
    names = [(f"gpu{i}", f"http://10.0.{i // 250}.{i % 250}:8000") for i in range(backends)]
    record = FleetRecord(Ledger(LedgerPolicy(), names, now=1.0))
    # What a settle keeps per backend: its ledger entry and the last process it saw.
    engine = EngineSignals("0", 4, 8, 1200.0, 4800.0, 9600.0, 30.0, 0.0, 0.3)
    busy = Verdict(VerdictKind.BUSY, True, "busy")
    for name, _ in names:
        record.observe(name, busy, 2.0)
        record.sightings[name] = Sighting(2.0, True, Signals((engine,), 1_796_000_000.0))
    return record


def store_costs(backends: int = BACKENDS, settles: int = SETTLES) -> dict[str, object]:
    record = _record(backends)
    document = record.to_dict()
    policy = LedgerPolicy()
    results: dict[str, object] = {}
    with tempfile.TemporaryDirectory() as folder:
        state = StateFile(Path(folder) / "state.json")
        times = []
        for _ in range(settles):
            began = time.perf_counter()
            with state.locked():
                state.load(lambda d: FleetRecord.from_dict(d, policy))
                state.save(document)
            times.append(time.perf_counter() - began)
        results["file"] = times
        results["bytes"] = (Path(folder) / "state.json").stat().st_size
        with running_etcd(Path(folder) / "etcd") as etcd_cluster:
            etcd = Etcd(etcd_cluster.endpoints)
            keys = Keys("/llmhealth/bench")
            elector = Elector(etcd, keys, "bench", LeaseTiming.for_ttl(30.0), log=lambda _: None)
            elector.step()
            store = EtcdStore(etcd, keys, elector)
            times = []
            for _ in range(settles):
                began = time.perf_counter()
                with store.locked():
                    store.load(lambda d: FleetRecord.from_dict(d, policy))
                    store.save(document)
                times.append(time.perf_counter() - began)
            elector.stop()
            results["etcd"] = times
    return results


def run() -> list[Section]:
    began = time.monotonic()
    taken, doubles, deposed = takeovers()
    alone = baseline()
    costs = store_costs()
    file_ms = [t * 1000 for t in costs["file"]]  # type: ignore[attr-defined]
    etcd_ms = [t * 1000 for t in costs["etcd"]]  # type: ignore[attr-defined]
    rows = [
        [
            f"standby takes over (lease_ttl {TTL} s, wait 0.5 s)",
            str(len(taken)),
            spread(taken, 2, " s"),
            f"{max(taken):.2f} s",
        ],
        [
            "baseline: one daemon, started again at once",
            str(len(alone)),
            spread(alone, 2, " s"),
            f"{max(alone):.2f} s",
        ],
    ]
    return [
        Section(
            title="5. Several daemons on etcd: takeover and the fenced record (bench_takeover)",
            command="cd bench && ../.venv/bin/python bench_takeover.py",
            intro=[
                "Two `llmhealth watch` daemons (`--wait 0.5`) on one restartable simulated "
                "backend and a one-member etcd. Each round injects a wedge and SIGKILLs the "
                "leader at once; the time is from the kill to the new leader's first action "
                "(its restart command's first line). The killed daemon is replaced by a "
                "fresh standby before the next round."
            ],
            tables=[
                Table(
                    [
                        "who acts after the kill",
                        "kills",
                        "kill → first action, median (min-max)",
                        "max",
                    ],
                    rows,
                ),
                Table(
                    [
                        "store",
                        f"one settle's lock+load+save, {BACKENDS} backends, ms",
                        "record bytes",
                    ],
                    [
                        ["state file (fsync, rename)", spread(file_ms, 1), str(costs["bytes"])],
                        [
                            "etcd (range + fenced txn, gateway)",
                            spread(etcd_ms, 1),
                            str(costs["bytes"]),
                        ],
                    ],
                ),
            ],
            notes=[
                f"Restarts beyond one per wedge (double restarts): {doubles}. "
                f"Restarts run by a daemon after it was killed (deposed leader acting): {deposed}.",
                "The standby's time is about one lease TTL: it had been reading the backend "
                "all along, so the wedge is already proven when the old lease lapses. The "
                "baseline starts from cold reads and must wait two waits to prove it; with "
                "a 0.5 s wait that is quicker than a 3 s lease, but it needs its own machine "
                "alive to be started again, which a takeover does not.",
            ],
            seconds=time.monotonic() - began,
        )
    ]


if __name__ == "__main__":
    import report

    for section in run():
        print(report.section_markdown(section))
