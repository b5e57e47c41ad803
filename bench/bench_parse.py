"""Signal extraction against prometheus_client's full parser, on the real vLLM captures.

Both run in this process on the same texts, so the ratio holds on a noisy shared machine
where absolute microseconds do not. Target: llmhealth at least 100x faster.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from llmhealth.metrics import parse_metrics

CAPTURES = Path(__file__).resolve().parent.parent / "fixtures" / "vllm-0.32"
SAMPLES = ("idle-1", "busy-2", "prefill2-3", "wedge-2", "multiapi-after-load")
TARGET_RATIO = 100.0


def per_call_us(
    function: Callable[[str], object], text: str, rounds: int, repeat: int
) -> list[float]:
    """Microseconds per call, one figure per round of ``repeat`` calls."""
    figures = []
    for _ in range(rounds):
        started = time.perf_counter()
        for _ in range(repeat):
            function(text)
        figures.append((time.perf_counter() - started) / repeat * 1e6)
    return figures


def full_parse(text: str) -> object:
    return list(text_string_to_metric_families(text))


def run(rounds: int = 7) -> list[dict[str, float | str]]:
    rows: list[dict[str, float | str]] = []
    for name in SAMPLES:
        text = (CAPTURES / f"{name}.txt").read_text()
        ours = per_call_us(parse_metrics, text, rounds, 200)
        theirs = per_call_us(full_parse, text, rounds, 10)
        rows.append(
            {
                "capture": name,
                "bytes": float(len(text.encode())),
                "llmhealth_us": statistics.median(ours),
                "llmhealth_spread_us": max(ours) - min(ours),
                "prometheus_client_us": statistics.median(theirs),
                "prometheus_client_spread_us": max(theirs) - min(theirs),
                "ratio": statistics.median(theirs) / statistics.median(ours),
            }
        )
    return rows


def report(rows: list[dict[str, float | str]]) -> str:
    lines = [
        "signal extraction vs prometheus_client (median of rounds, same process)",
        f"{'capture':<22}{'bytes':>8}{'llmhealth µs':>15}{'prom_client µs':>16}{'ratio':>8}",
    ]
    for row in rows:
        lines.append(
            f"{row['capture']!s:<22}{row['bytes']:>8.0f}{row['llmhealth_us']:>15.1f}"
            f"{row['prometheus_client_us']:>16.1f}{row['ratio']:>7.1f}x"
        )
    worst = min(float(row["ratio"]) for row in rows)
    verdict = "meets" if worst >= TARGET_RATIO else "MISSES"
    lines.append(f"worst ratio {worst:.1f}x: {verdict} the {TARGET_RATIO:.0f}x target")
    return "\n".join(lines)


if __name__ == "__main__":
    print(report(run()))
