"""`make bench`: every benchmark in this folder, one after the other, then bench/RESULTS.md.

Each section is printed as soon as it is measured (a full run takes minutes), and the
same sections are written to RESULTS.md at the end with the machine, the date and the
commands. A section that fails is recorded as failed, the others still run, and the exit
status says so: a partial RESULTS.md must not pass for a complete one.
"""

from __future__ import annotations

import datetime
import os
import sys
import time
import traceback
from collections.abc import Callable

import bench_check
import bench_compare
import bench_longsteps
import bench_read
import bench_scale
import bench_startup
import bench_takeover
import report
from report import Section


def check_200() -> list[Section]:
    began = time.monotonic()
    text = bench_check.run(200)
    return [
        Section(
            title="3d. One check over 200 backends (bench_check)",
            command="cd bench && ../.venv/bin/python bench_check.py 200",
            intro=[
                "The older in-process figure: `check_fleet` alone over 200 simulated backends "
                "(half busy, a quarter idle, a quarter wedged), wait 1 s, 3 rounds in one "
                "process."
            ],
            preformatted=text,
            seconds=time.monotonic() - began,
        )
    ]


STEPS: list[tuple[str, Callable[[], list[Section]]]] = [
    ("1. saturation (bench_compare)", bench_compare.saturation),
    ("2. wedge detection (bench_compare)", bench_compare.wedge),
    ("2b. long steps and the wedge window (bench_longsteps)", bench_longsteps.run),
    ("3a. signal extraction (bench_scale)", lambda: bench_scale.run("parse")),
    ("3b. bytes per check (bench_scale)", lambda: bench_scale.run("bytes")),
    ("3c. check and watch at scale (bench_scale)", lambda: bench_scale.run("scale")),
    ("3d. check over 200 backends (bench_check)", check_200),
    ("3e. CPU per /metrics read (bench_read)", bench_read.run),
    ("4. start-up (bench_startup)", bench_startup.run),
    ("5. takeover on etcd (bench_takeover)", bench_takeover.run),
]


def main() -> int:
    started = datetime.datetime.now().astimezone()
    began = time.monotonic()
    sections: list[Section] = []
    failed = []
    loads: list[tuple[str, float]] = []
    for name, step in STEPS:
        loads.append((name.split(" ", 1)[0].rstrip("."), os.getloadavg()[0]))
        print(f"== {name} (load {loads[-1][1]:.1f})", flush=True)
        step_began = time.monotonic()
        try:
            produced = step()
        except Exception:
            failed.append(name)
            produced = [
                Section(
                    title=f"FAILED: {name}",
                    command="cd bench && ../.venv/bin/python run.py",
                    preformatted=traceback.format_exc()[-4000:],
                    seconds=time.monotonic() - step_began,
                )
            ]
        for section in produced:
            print(report.section_markdown(section), flush=True)
        sections.extend(produced)
    seconds = time.monotonic() - began
    loads.append(("end", os.getloadavg()[0]))
    path = report.write(sections, started, seconds, loads)
    print(f"wrote {path} after {seconds / 60:.1f} min", flush=True)
    if failed:
        print(f"FAILED: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
