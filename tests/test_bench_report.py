"""bench/report.py keeps RESULTS.md whole: a benchmark run on its own replaces its own
subsection, and `make bench` keeps the blocks of benchmarks it did not run.

Found by the router's bench: run alone, it looked for a heading RESULTS.md no longer had
and would have appended a second copy of its section.
"""

from __future__ import annotations

import datetime
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

from report import Section, write, write_standalone

ROUTER = "the router (bench_router)"
RESULTS = """# Benchmark results

The header of a make bench run.

## 1. Saturation (bench_compare)

figures of step 1

## Not from this run: takeover on etcd (bench_takeover)

kept by hand

### 5. Several daemons on etcd (bench_takeover)

takeover figures

## Not from this run: the router (bench_router)

the block's note

### 5. The router against nginx and vllm-router (bench_router)

old router figures

### 5b. The router before and after (bench_router --baseline)

old comparison

### 5c. Reading 5 and 5b (by hand)

analysis
"""


def router_section(number: str, text: str) -> Section:
    return Section(title=f"{number} The router, {text} (bench_router)", command="c", intro=[text])


def headings(path: Path) -> list[str]:
    return [line for line in path.read_text().splitlines() if line.startswith("#")]


def test_a_standalone_run_replaces_its_own_subsection_and_nothing_else(tmp_path: Path) -> None:
    path = tmp_path / "RESULTS.md"
    path.write_text(RESULTS)
    for run in ("first run", "second run"):
        write_standalone(router_section("5.", run), ROUTER, "unused note", path)
    text = path.read_text()
    assert "second run" in text and "first run" not in text and "old router figures" not in text
    assert headings(path) == [
        "# Benchmark results",
        "## 1. Saturation (bench_compare)",
        "## Not from this run: takeover on etcd (bench_takeover)",
        "### 5. Several daemons on etcd (bench_takeover)",  # another block's 5.: untouched
        "## Not from this run: the router (bench_router)",
        "### 5. The router, second run (bench_router)",
        "### 5b. The router before and after (bench_router --baseline)",
        "### 5c. Reading 5 and 5b (by hand)",
    ]
    before_block = RESULTS.split("## Not from this run: the router", maxsplit=1)[0]
    assert text.startswith(before_block)
    assert "old comparison" in text and "analysis" in text


def test_a_standalone_run_opens_its_block_when_there_is_none(tmp_path: Path) -> None:
    path = tmp_path / "RESULTS.md"
    path.write_text("# Benchmark results\n\n## 1. Saturation (bench_compare)\n\nfigures\n")
    write_standalone(router_section("5b.", "compared"), ROUTER, "what this block is", path)
    text = path.read_text()
    assert text.endswith(
        "## Not from this run: the router (bench_router)\n\nwhat this block is\n\n"
        "### 5b. The router, compared (bench_router)\n\ncompared\n\nCommand: `c` (0 s)\n"
    )


def test_make_bench_keeps_the_blocks_of_benchmarks_it_did_not_measure(tmp_path: Path) -> None:
    path = tmp_path / "RESULTS.md"
    path.write_text(RESULTS)
    measured = [
        Section(title="1. Saturation (bench_compare)", command="c"),
        Section(title="5. Takeover on etcd (bench_takeover)", command="c"),  # measured now
    ]
    write(measured, datetime.datetime(2026, 12, 1, tzinfo=datetime.UTC), 1.0, [], path)
    found = headings(path)
    assert "## Not from this run: takeover on etcd (bench_takeover)" not in found  # stale now
    assert found[-4:] == [
        "## Not from this run: the router (bench_router)",
        "### 5. The router against nginx and vllm-router (bench_router)",
        "### 5b. The router before and after (bench_router --baseline)",
        "### 5c. Reading 5 and 5b (by hand)",
    ]
    # A step that failed keeps its older figures.
    path.write_text(RESULTS)
    failed = [Section(title="FAILED: 5. takeover on etcd (bench_takeover)", command="c")]
    write(failed, datetime.datetime(2026, 12, 1, tzinfo=datetime.UTC), 1.0, [], path)
    assert "## Not from this run: takeover on etcd (bench_takeover)" in headings(path)


# The titles `make bench` (bench/run.py) gives its sections: what it measures again.
MAKE_BENCH_TITLES = (
    "1. Saturation without false restarts",
    "2. Wedge detection",
    "2b. Long engine steps and the wedge window (bench_longsteps)",
    "3a. Signal extraction vs prometheus_client",
    "3b. Bytes read per check",
    "3c. One check and one watch cycle over 100, 1,000, 3,000, 10,000 backends",
    "3d. One check over 200 backends (bench_check)",
    "3e. CPU per /metrics read: llmhealth's read client against httpx",
    "4. Start-up: exec to the first request on the wire",
    "5. Several daemons on etcd: takeover and the fenced record (bench_takeover)",
)
MAKE_BENCH_BENCHES = {"bench_longsteps", "bench_check", "bench_takeover"}


def test_make_bench_keeps_every_section_of_a_benchmark_it_does_not_run(tmp_path: Path) -> None:
    """The figures of a benchmark `make bench` does not run (bench_window's, the README
    quotes them) must sit in a ``## Not from this run:`` block, or the next `make bench`
    drops them: a subsection inside a section it writes again goes with that section."""
    real = Path(__file__).resolve().parent.parent / "bench" / "RESULTS.md"
    path = tmp_path / "RESULTS.md"
    path.write_text(real.read_text())
    kept_apart = [
        line
        for line in headings(path)
        if line.startswith("##") and line.endswith(")") and "(bench_" in line
        if line.rsplit("(", 1)[1].split()[0].rstrip(")") not in MAKE_BENCH_BENCHES
    ]
    assert any("(bench_window)" in line for line in kept_apart)
    measured = [Section(title=title, command="c") for title in MAKE_BENCH_TITLES]
    write(measured, datetime.datetime(2026, 12, 1, tzinfo=datetime.UTC), 1.0, [], path)
    after = headings(path)
    assert [line for line in kept_apart if line not in after] == []
