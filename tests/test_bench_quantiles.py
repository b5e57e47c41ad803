"""Every bench's percentiles are nearest-rank (``report.nearest_rank``).

Found by review: the index ``int(q * n)`` took the next value whenever ``q * n`` was whole,
so the p99 of 100 latencies was their maximum, the router's paced run's p99 of its 8,000
answers the 7,921st, and bench_watch's p90 of 1,000 probe durations the 901st.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

from report import nearest_rank


def test_a_quantile_is_the_nearest_rank() -> None:
    hundred = [float(value) for value in range(100, 0, -1)]
    assert nearest_rank(hundred, 0.99) == 99.0
    assert nearest_rank(hundred, 0.5) == 50.0
    paced = [float(value) for value in range(1, 8001)]
    assert nearest_rank(paced, 0.99) == 7920.0
    assert nearest_rank([4.0, 1.0, 3.0, 2.0], 0.5) == 2.0
    assert nearest_rank([7.0], 0.99) == 7.0
    assert nearest_rank([], 0.5) != nearest_rank([], 0.5)  # NaN: nothing measured


def test_bench_watch_reports_the_nearest_rank_p90_of_its_probe_durations() -> None:
    from bench_watch import CycleSample, report  # noqa: PLC0415 - its own bench

    probes = [float(value) for value in range(1, 11)]  # 10 durations: p90 is the 9th
    samples = [
        CycleSample(number, float(number * 5), 0.01, float(number), 0.0, probe_seconds=probes)
        for number in range(1, 4)
    ]
    text = report(samples, 5.0, 10, 1.0, 1024, 1024)
    line = next(line for line in text.splitlines() if "probe duration" in line)
    assert "median 5.500 s, p90 9.000 s, max 10.000 s" in line
