"""One `check` over many simulated backends: wall time, CPU time, peak memory, bytes read.

The simulator runs in its own process (one process, one port per backend) so its CPU is
not billed to the check. Half the fleet is busy (judged by two reads, no request), a
quarter idle (one read, one tiny request), a quarter wedged (three reads): the mix costs
what a real fleet costs, since a wedged backend needs the most reads.
"""

from __future__ import annotations

import asyncio
import resource
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from simproc import running_simulator

from llmhealth.classify import Target
from llmhealth.probe import ProbeSettings, check_fleet

WAIT = 1.0


def fleet_modes(size: int) -> list[str]:
    modes = []
    for index in range(size):
        slot = index % 4
        modes.append("busy" if slot < 2 else "idle" if slot == 2 else "wedge:0")
    return modes


def one_check(urls: list[str]) -> tuple[float, float, Counter[str]]:
    targets = [Target(f"b{index}", url) for index, url in enumerate(urls)]
    settings = ProbeSettings(wait=WAIT, timeout=10.0, answer_timeout=10.0)
    cpu_before = time.process_time()
    started = time.perf_counter()
    outcomes = asyncio.run(check_fleet(targets, settings))
    wall = time.perf_counter() - started
    cpu = time.process_time() - cpu_before
    return wall, cpu, Counter(str(o.verdict.kind) for o in outcomes)


def run(size: int = 200, rounds: int = 3) -> str:
    with running_simulator(fleet_modes(size), max_num_seqs=4) as sim:
        time.sleep(0.5)  # let wedge:0 backends freeze before the first read
        walls, cpus = [], []
        kinds: Counter[str] = Counter()
        for _ in range(rounds):
            wall, cpu, kinds = one_check(list(sim.urls))
            walls.append(wall)
            cpus.append(cpu)
    peak_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    floor = 2 * WAIT  # a wedge needs three reads and two waits; nothing can be faster
    return "\n".join(
        [
            f"check over {size} simulated backends ({dict(sorted(kinds.items()))}), "
            f"wait {WAIT:g}s, {rounds} rounds",
            f"  wall  median {statistics.median(walls):.2f} s (min {min(walls):.2f}, "
            f"max {max(walls):.2f}); the two waits alone are {floor:.2f} s, so "
            f"{statistics.median(walls) - floor:.2f} s is reading and deciding",
            f"  cpu   median {statistics.median(cpus):.2f} s "
            f"({statistics.median(cpus) / size * 1000:.1f} ms per backend)",
            f"  peak memory of this process {peak_mib:.0f} MiB",
        ]
    )


if __name__ == "__main__":
    print(run(int(sys.argv[1]) if len(sys.argv) > 1 else 200))
