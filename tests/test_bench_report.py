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
