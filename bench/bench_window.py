"""What a window of reads costs `watch` per backend and cycle, after 7 reads and after 61.

`watch` keeps at most 1 + max_check_time / wait reads of a backend (61 at the defaults:
5 min of 5 s waits) so that a long wedge window is covered, and of those only what a
later decision can use (`classify.reads_still_needed`: a frozen engine's whole freeze,
a busy or idle one's last few); trees before that kept all 61. It judges the window
again at every read: restarts are looked for between every pair, a frozen engine's
streak is walked back, a wedge's evidence quotes its reads. `bench_scale.py` runs eight
cycles, so its windows never pass nine reads; this measures the steady state, in one
process, with no network: real texts rendered by the simulator's own engine (busy, idle,
wedged from the start) at 5 s apart, parsed as a read parses them, judged by `decide`
as `examine_once` judges them (an idle backend's tiny request answered), and the size of
what the window's reads hold. Then a fleet of 3,000 in bench_scale's mix.

Usage: bench_window.py [ROUNDS]; with PYTHONPATH at an older checkout, that tree's judging
and windows (the baseline RESULTS.md shows beside this tree's).
"""

from __future__ import annotations

import importlib.resources
import statistics
import sys
import time

from llmhealth.classify import Answer, Read, SendTinyRequest, decide
from llmhealth.metrics import parse_metrics

try:
    from llmhealth.probe import keep_read
except ImportError:  # an older tree on PYTHONPATH, as a baseline: windows as it kept them

    def keep_read(window: list[Read], read: Read, limit: int) -> None:
        window.append(read)
        del window[:-limit]


from llmhealth.simengine import MetricsText, SimBackend, SimConfig, parse_mode
from llmhealth.simulate import TEMPLATE_NAME

WAIT = 5.0
LENGTHS = (7, 61)  # a short window, and the defaults' steady state
READ_LIMIT = 61  # ProbeSettings().read_limit: 1 + max_check_time 300 s / wait 5 s
FLEET = {"busy": 1500, "idle": 750, "wedge:0": 750}  # bench_scale's mix at 3,000
BORN = 1_000_000.0


def window(mode: str, length: int) -> list[Read]:
    """``length`` reads of one simulated backend, ``WAIT`` apart, as a read parses them."""
    template = importlib.resources.files("llmhealth").joinpath(TEMPLATE_NAME).read_text("utf-8")
    text = MetricsText(template, engines=1, model="tiny", multiproc=False)
    backend = SimBackend(parse_mode(mode), SimConfig(), born=BORN)
    reads: list[Read] = []
    for index in range(length):
        at = BORN + 600.0 + index * WAIT  # the simulator's processes are an hour old
        body = text.render(backend.observe(at)).encode()
        keep_read(reads, Read(at, signals=parse_metrics(body)), READ_LIMIT)  # as watch keeps it
    return reads


def judge(reads: list[Read]) -> object:
    """As examine_once: decide; an idle backend's tiny request answered, decide again."""
    limit = READ_LIMIT
    decision = decide(reads, None, max_reads=limit)
    if isinstance(decision, SendTinyRequest):
        answer = Answer(reads[-1].at + 0.01, True, "answered in 0.01 s by model tiny", "tiny")
        decision = decide(reads, answer, max_reads=limit)
    return decision


def cpu_us(reads: list[Read], rounds: int) -> float:
    """CPU microseconds for one judgement, median of ``rounds`` batches."""
    batch = 200
    times = []
    for _ in range(rounds):
        started = time.process_time()
        for _ in range(batch):
            judge(reads)
        times.append((time.process_time() - started) / batch * 1e6)
    return statistics.median(times)


def resident_kb(mode: str, length: int) -> float:
    """What one window's reads hold, each object once (``sys.getsizeof`` over everything
    they reach). Not tracemalloc: it also counts what building a window leaves in caches
    every backend shares (extraction's layouts, bounded, taking new entries as a busy
    text grows buckets) and in the interpreter's free lists, which no one window holds."""
    seen: set[int] = set()
    size = 0
    pending: list[object] = [window(mode, length)]
    while pending:
        item = pending.pop()
        if id(item) in seen:
            continue
        seen.add(id(item))
        size += sys.getsizeof(item)
        if isinstance(item, list | tuple):
            pending.extend(item)
        elif isinstance(item, dict):
            pending.extend(item.keys())
            pending.extend(item.values())
        else:
            for cls in type(item).__mro__:
                for slot in getattr(cls, "__slots__", ()):
                    if hasattr(item, slot):
                        pending.append(getattr(item, slot))
    return size / 1024


def main() -> None:
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 7
    print(f"per backend and cycle (median of {rounds} batches of 200 judgements):")
    print("| backend | reads taken | reads kept | judged as | CPU µs | window KB |")
    print("| --- | --- | --- | --- | --- | --- |")
    fleet_cpu = dict.fromkeys(LENGTHS, 0.0)
    fleet_kb = dict.fromkeys(LENGTHS, 0.0)
    for mode, count in FLEET.items():
        for length in LENGTHS:
            reads = window(mode, length)
            decision = judge(reads)
            kind = getattr(decision, "kind", type(decision).__name__)
            used, kept = cpu_us(reads, rounds), resident_kb(mode, length)
            fleet_cpu[length] += used * count
            fleet_kb[length] += kept * count
            print(f"| {mode} | {length} | {len(reads)} | {kind} | {used:.1f} | {kept:.1f} |")
    size = sum(FLEET.values())
    print(f"\na fleet of {size:,} ({', '.join(f'{n} {m}' for m, n in FLEET.items())}):")
    for length in LENGTHS:
        print(
            f"  after {length} reads: judging {fleet_cpu[length] / 1e6:.3f} s of CPU per cycle, "
            f"windows {fleet_kb[length] / 1024:.0f} MiB ({fleet_kb[length] / size:.1f} KB "
            "per backend)"
        )


if __name__ == "__main__":
    main()
