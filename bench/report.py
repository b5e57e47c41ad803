"""The figures of one `make bench` as Markdown: `bench/RESULTS.md`.

Every benchmark hands back `Section`s (prose, tables, a verdict on its target) instead of
printing as it goes, so the console and RESULTS.md show the same numbers from the same
run, and the file also says on which machine, when, and by which command they were seen:
a figure without its machine is not comparable with the next one.
"""

from __future__ import annotations

import datetime
import math
import os
import platform
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "RESULTS.md"
PYTHON = "../.venv/bin/python"


@dataclass
class Table:
    headers: list[str]
    rows: list[list[str]]
    caption: str = ""


@dataclass
class Section:
    """One heading of RESULTS.md: what was measured, how, the tables, and the verdict."""

    title: str
    command: str
    intro: list[str] = field(default_factory=list)
    tables: list[Table] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    seconds: float = 0.0  # how long producing it took
    preformatted: str = ""  # text printed by an older benchmark, kept verbatim


def spread(values: Sequence[float], digits: int = 2, unit: str = "") -> str:
    """`median (min-max)`, the form every repeated figure takes in the tables."""
    if not values:
        return "-"
    med = statistics.median(values)
    if len(values) == 1:
        return f"{med:.{digits}f}{unit}"
    return f"{med:.{digits}f}{unit} ({min(values):.{digits}f}-{max(values):.{digits}f})"


def nearest_rank(values: Sequence[float], fraction: float) -> float:
    """The nearest-rank percentile, every bench's: the smallest value that ``fraction`` of
    them do not exceed (NaN for none). ``sorted(values)[int(fraction * n)]`` took the next
    one whenever ``fraction * n`` was whole: the maximum as the p99 of 100."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[max(0, math.ceil(fraction * len(ordered)) - 1)]


def machine() -> dict[str, str]:
    """Cores, memory, CPU model, Python and kernel: what the figures depend on."""
    model = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    memory = "unknown"
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                memory = f"{int(line.split()[1]) / 1024 / 1024:.1f} GiB"
                break
    except (OSError, ValueError):
        pass
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:
        usable = os.cpu_count() or 0
    return {
        "CPU": model,
        "cores": f"{os.cpu_count()} ({usable} usable by this process)",
        "memory": memory,
        "Python": f"{platform.python_implementation()} {platform.python_version()}",
        "kernel": f"{platform.system()} {platform.release()}",
    }


def markdown_table(table: Table) -> str:
    lines = []
    if table.caption:
        lines += [table.caption, ""]
    lines.append("| " + " | ".join(table.headers) + " |")
    lines.append("| " + " | ".join("---" for _ in table.headers) + " |")
    for row in table.rows:
        lines.append("| " + " | ".join(cell.replace("|", "\\|") for cell in row) + " |")
    return "\n".join(lines)


def section_markdown(section: Section) -> str:
    parts = [f"## {section.title}", ""]
    for paragraph in section.intro:
        parts += [paragraph, ""]
    if section.preformatted:
        parts += ["```", section.preformatted.rstrip("\n"), "```", ""]
    for table in section.tables:
        parts += [markdown_table(table), ""]
    for note in section.notes:
        parts += [note, ""]
    parts += [f"Command: `{section.command}` ({section.seconds:.0f} s)", ""]
    return "\n".join(parts)


def document(
    sections: Sequence[Section],
    started: datetime.datetime,
    seconds: float,
    loads: Sequence[tuple[str, float]] = (),
) -> str:
    facts = machine()
    header = [
        "# Benchmark results",
        "",
        "Written by `make bench` (`cd bench && ../.venv/bin/python run.py`); do not edit by "
        "hand, run it again. Every figure below was measured in that one run.",
        "",
        f"- date: {started.strftime('%Y-%m-%d %H:%M:%S %Z').strip()}",
        *(f"- {key}: {value}" for key, value in facts.items()),
        f"- whole run: {seconds / 60:.1f} min",
        *(
            [
                "- load average (1 min) as each step began, on this shared machine: "
                + ", ".join(f"{name} {load:.1f}" for name, load in loads)
            ]
            if loads
            else []
        ),
        "",
        "Times are medians with (min-max) over the repeats stated; the machine is shared and "
        "noisy, so compare ratios and counts before absolute times.",
        "",
    ]
    return "\n".join(header + [section_markdown(s) for s in sections]).rstrip("\n") + "\n"


STANDALONE = "## Not from this run: "  # a block of sections a benchmark run alone wrote


def _split(text: str, heading: str) -> list[str]:
    """``text`` cut before every line that starts with ``heading`` (the first piece is
    what comes before the first such line)."""
    pieces = [""]
    for line in text.splitlines(keepends=True):
        if line.startswith(heading):
            pieces.append("")
        pieces[-1] += line
    return pieces


def _bench_of(title: str) -> str:
    """``bench_x`` of a title ending ``(bench_x)`` or ``(bench_x --option)``; else ""."""
    tail = title.rstrip().rsplit("(", 1)[-1]
    return tail.split()[0].rstrip(")") if title.rstrip().endswith(")") else ""


def standalone_blocks(text: str, measured: Sequence[Section]) -> list[str]:
    """The ``## Not from this run:`` blocks of ``text`` whose benchmark ``measured`` (a
    `make bench` run's sections) did not measure: `make bench` keeps them as they are.
    A benchmark that failed in the run keeps its older figures."""
    done = {_bench_of(s.title) for s in measured if not s.title.startswith("FAILED")}
    return [
        block
        for block in _split(text, "## ")[1:]
        if block.startswith(STANDALONE) and _bench_of(block.splitlines()[0]) not in done
    ]


def write(
    sections: Sequence[Section],
    started: datetime.datetime,
    seconds: float,
    loads: Sequence[tuple[str, float]] = (),
    path: Path = RESULTS,
) -> Path:
    kept = standalone_blocks(path.read_text(), sections) if path.exists() else []
    text = document(sections, started, seconds, loads)
    path.write_text("\n".join([text.rstrip("\n"), *(b.rstrip("\n") for b in kept)]) + "\n")
    return path


def write_standalone(section: Section, block: str, note: str, path: Path = RESULTS) -> Path:
    """``section`` into RESULTS.md under ``## Not from this run: {block}``, as a ``###``
    subsection replacing the one of the same number (``5.``, ``5b.``); the rest of the
    file, other subsections of the block included, stays as it is. ``note`` opens a
    block that does not exist yet, which goes at the end."""
    heading = f"{STANDALONE}{block}"
    number = section.title.split(" ", 1)[0]
    sub = "#" + section_markdown(section).rstrip("\n") + "\n"
    text = path.read_text() if path.exists() else ""
    blocks = _split(text, "## ")
    for index, current in enumerate(blocks):
        if index == 0 or current.splitlines()[0] != heading:
            continue
        parts = _split(current, "### ")
        for at, part in enumerate(parts[1:], start=1):
            if part.split(" ", 2)[1] == number:
                parts[at] = sub + "\n"
                break
        else:
            parts[-1] = parts[-1].rstrip("\n") + "\n\n"
            parts.append(sub + "\n")
        blocks[index] = "".join(parts)
        break
    else:
        blocks[-1] = blocks[-1].rstrip("\n") + "\n\n" if blocks[-1].strip() else blocks[-1]
        blocks.append(f"{heading}\n\n{note}\n\n{sub}")
    path.write_text("".join(blocks).rstrip("\n") + "\n")
    return path
