"""Signal extraction against prometheus_client's full parser, on every real vLLM capture.

Both run in this process on the same texts, alternated within each round (a round reads
every capture), each timed by this process's CPU time (``time.process_time``), not the
wall clock: on a shared machine another job's time slice then lands on neither side, and
the ratio holds where absolute microseconds do not. ``--baseline REF`` also times
``parse_metrics`` as it was at git REF (loaded from ``git show``), in the same rounds.
Target: llmhealth at least 100x faster on every capture, with the same answers
(tests/test_metrics_oracle.py checks that).

``--prefill-bound`` times instead what an engine whose prefill figure passes
``PREFILL_BOUNDED_OVER`` costs: a few captures as they are, and with their prefill time's
sum 100 times as long, which makes ``parse_metrics`` scan for the time-to-first-token
buckets too (every real capture's figure is under a second: none of the rows above pays
for it).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from llmhealth.metrics import PREFILL_BOUNDED_OVER, parse_metrics

ROOT = Path(__file__).resolve().parent.parent
CAPTURES = ROOT / "fixtures" / "vllm-0.32"
TARGET_RATIO = 100.0
ROUNDS = 9
OURS_CALLS = 100  # calls per round: long enough for the CPU clock, short for the noise
THEIRS_CALLS = 3
STRETCHED = ("busy-after", "wedge-1", "multiapi-after-load", "prefill2-after")
PREFILL_SUM = b"vllm:request_prefill_time_seconds_sum"


def captures() -> list[Path]:
    """Every real capture: a body saved with its response headers beside it."""
    return sorted(path.with_suffix(".txt") for path in CAPTURES.glob("*.headers"))


def per_call_us(function: Callable[[bytes], object], body: bytes, calls: int) -> float:
    """CPU microseconds per call over ``calls`` calls."""
    started = time.process_time()
    for _ in range(calls):
        function(body)
    return (time.process_time() - started) / calls * 1e6


def full_parse(body: bytes) -> object:
    """prometheus_client reading the whole text, as a scrape would (it takes text)."""
    return list(text_string_to_metric_families(body.decode("utf-8")))


def former_parser(ref: str) -> Callable[[bytes], object]:
    """``parse_metrics`` as it was at git ``ref``, loaded beside today's."""
    source = subprocess.run(
        ["git", "show", f"{ref}:llmhealth/metrics.py"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    spec = importlib.util.spec_from_loader("llmhealth_metrics_former", loader=None)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while building
    exec(compile(source, f"{ref}:llmhealth/metrics.py", "exec"), module.__dict__)
    parse: Callable[[bytes], object] = module.parse_metrics
    return parse


def run(rounds: int = ROUNDS, baseline: str | None = None) -> list[dict[str, float | str]]:
    former = former_parser(baseline) if baseline else None
    bodies = {path.stem: path.read_bytes() for path in captures()}
    ours: dict[str, list[float]] = {name: [] for name in bodies}
    theirs: dict[str, list[float]] = {name: [] for name in bodies}
    before: dict[str, list[float]] = {name: [] for name in bodies}
    # Every capture in every round, the parsers alternated within it: a spell of load on a
    # shared machine (a second or so) then costs each capture one round, which the median
    # leaves out, where timing one capture's rounds back to back put every round of that
    # capture in it (one run read its twin captures of the same bytes 90.9x and 106.5x).
    for _ in range(rounds):
        for name, body in bodies.items():
            ours[name].append(per_call_us(parse_metrics, body, OURS_CALLS))
            theirs[name].append(per_call_us(full_parse, body, THEIRS_CALLS))
            if former is not None:
                before[name].append(per_call_us(former, body, OURS_CALLS))
    rows: list[dict[str, float | str]] = []
    for name, body in bodies.items():
        row: dict[str, float | str] = {
            "capture": name,
            "bytes": float(len(body)),
            "llmhealth_us": statistics.median(ours[name]),
            "llmhealth_max_us": max(ours[name]),
            "prometheus_client_us": statistics.median(theirs[name]),
            "ratio": statistics.median(theirs[name]) / statistics.median(ours[name]),
            # The worst round for us against the best for them: the ratio no round beat.
            "worst_ratio": min(theirs[name]) / max(ours[name]),
        }
        if former is not None:
            row["former_us"] = statistics.median(before[name])
        rows.append(row)
    return rows


def stretched(body: bytes) -> bytes:
    """``body`` with its prefill time's sum 100 times as long (its figure past 1 s)."""
    lines = []
    for line in body.split(b"\n"):
        head, _, value = line.rpartition(b" ")
        lines.append(
            b"%s %r" % (head, float(value) * 100) if head.startswith(PREFILL_SUM) else line
        )
    return b"\n".join(lines)


def prefill_bound_run(rounds: int = ROUNDS) -> list[dict[str, float | str]]:
    """Per capture of ``STRETCHED``: ``parse_metrics`` on it as captured and stretched,
    alternated within each round, and prometheus_client on the stretched one."""
    bodies = {name: (CAPTURES / f"{name}.txt").read_bytes() for name in STRETCHED}
    longer = {name: stretched(body) for name, body in bodies.items()}
    for name, body in longer.items():
        step = parse_metrics(body).engines[0].prefill_step
        assert step is not None and step > PREFILL_BOUNDED_OVER, (name, step)
    plain: dict[str, list[float]] = {name: [] for name in bodies}
    bound: dict[str, list[float]] = {name: [] for name in bodies}
    theirs: dict[str, list[float]] = {name: [] for name in bodies}
    for _ in range(rounds):
        for name, body in bodies.items():
            plain[name].append(per_call_us(parse_metrics, body, OURS_CALLS))
            bound[name].append(per_call_us(parse_metrics, longer[name], OURS_CALLS))
            theirs[name].append(per_call_us(full_parse, longer[name], THEIRS_CALLS))
    return [
        {
            "capture": name,
            "plain_us": statistics.median(plain[name]),
            "plain_max_us": max(plain[name]),
            "bound_us": statistics.median(bound[name]),
            "bound_max_us": max(bound[name]),
            "prometheus_client_us": statistics.median(theirs[name]),
            "ratio": statistics.median(theirs[name]) / statistics.median(bound[name]),
        }
        for name in bodies
    ]


def prefill_bound_report(rows: list[dict[str, float | str]]) -> str:
    lines = [
        "an engine whose prefill figure needs its bound (CPU µs per call, median of rounds)",
        f"{'capture':<24}{'as captured':>12}{'max':>8}{'prefill x100':>14}{'max':>8}"
        f"{'prom_client':>13}{'ratio':>8}",
    ]
    for row in rows:
        lines.append(
            f"{row['capture']!s:<24}{row['plain_us']:>12.1f}{row['plain_max_us']:>8.1f}"
            f"{row['bound_us']:>14.1f}{row['bound_max_us']:>8.1f}"
            f"{row['prometheus_client_us']:>13.0f}{row['ratio']:>7.1f}x"
        )
    lines.append(f"load average (1 min) {os.getloadavg()[0]:.1f}")
    return "\n".join(lines)


def report(rows: list[dict[str, float | str]]) -> str:
    former = "former_us" in rows[0]
    lines = [
        "signal extraction vs prometheus_client (CPU µs per call, median of rounds)",
        f"{'capture':<24}{'bytes':>7}{'llmhealth':>11}{'max':>8}"
        + (f"{'former':>9}" if former else "")
        + f"{'prom_client':>13}{'ratio':>8}{'worst':>8}",
    ]
    for row in rows:
        lines.append(
            f"{row['capture']!s:<24}{row['bytes']:>7.0f}{row['llmhealth_us']:>11.1f}"
            f"{row['llmhealth_max_us']:>8.1f}"
            + (f"{row['former_us']:>9.1f}" if former else "")
            + f"{row['prometheus_client_us']:>13.0f}{row['ratio']:>7.1f}x"
            f"{row['worst_ratio']:>7.1f}x"
        )
    worst = min(float(row["ratio"]) for row in rows)
    verdict = "meets" if worst >= TARGET_RATIO else "MISSES"
    lines.append(
        f"worst median ratio {worst:.1f}x over {len(rows)} captures: {verdict} the "
        f"{TARGET_RATIO:.0f}x target; load average (1 min) {os.getloadavg()[0]:.1f}"
    )
    return "\n".join(lines)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=ROUNDS)
    parser.add_argument("--baseline", metavar="REF", help="also time parse_metrics at git REF")
    parser.add_argument(
        "--prefill-bound",
        action="store_true",
        help="time an engine whose prefill figure needs its bound instead",
    )
    arguments = parser.parse_args()
    if arguments.prefill_bound:
        print(prefill_bound_report(prefill_bound_run(arguments.rounds)))
    else:
        print(report(run(arguments.rounds, arguments.baseline)))
