"""Start-up: seconds from exec to the first request on the wire, and CPU of `check --help`.

A raw listener on 127.0.0.1 stands for the backend: the clock starts just before the
command is started and stops when the listener has the request's first bytes. The
listener then closes the connection (a DOWN verdict), so the run also ends quickly. The
baseline is the same command with the eager imports of before (rich, the HTTP client,
the cycle, the operator verbs and the renderer loaded by the command line module before
it parses anything), run alternately with it in the same loop so both see the same load.
The package's bytecode is compiled first (``compileall``, as pip does when it installs
llmhealth): an environment with PYTHONDONTWRITEBYTECODE set, as the development machine's
is, would otherwise compile every llmhealth module from source in every run, a cost no
installed copy pays. Target: at most 0.3 s from exec to the first request.
"""

from __future__ import annotations

import argparse
import compileall
import os
import resource
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

from report import Section, Table, spread

TARGET_SECONDS = 0.3
PACKAGE = Path(__file__).resolve().parent.parent / "llmhealth"
ENTRY = str(Path(sys.executable).parent / "llmhealth")
# What llmhealth.cli imported at the top before the lazy imports: forced, then the CLI runs.
EAGER = (
    "import asyncio, httpx, rich.console, llmhealth.cycle, llmhealth.operate, "
    "llmhealth.render, llmhealth.probe; from llmhealth.cli import main; main()"
)
VARIANTS: dict[str, list[str]] = {
    "llmhealth check (imports per verb)": [ENTRY],
    "baseline: the same with the former eager imports": [sys.executable, "-c", EAGER],
}


def first_request_seconds(command: list[str]) -> tuple[float, float]:
    """(exec → first request bytes on the listener, the child's whole CPU seconds)."""
    with socket.create_server(("127.0.0.1", 0)) as listener:
        listener.settimeout(30)
        url = f"http://127.0.0.1:{listener.getsockname()[1]}"
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        started = time.perf_counter()
        child = subprocess.Popen(
            [*command, "check", url, "--timeout", "10", "--format", "nagios"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            connection, _ = listener.accept()
            with connection:
                connection.settimeout(30)
                connection.recv(1)
                elapsed = time.perf_counter() - started
            child.wait(timeout=30)
        finally:
            if child.poll() is None:
                child.kill()
                child.wait()
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return elapsed, cpu


def help_cpu_seconds(command: list[str]) -> float:
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    subprocess.run([*command, "check", "--help"], stdout=subprocess.DEVNULL, check=True)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def run(repeats: int = 15) -> list[Section]:
    began = time.monotonic()
    compileall.compile_dir(str(PACKAGE), quiet=1)  # into __pycache__, as an install has it
    load_before = os.getloadavg()[0]
    first: dict[str, list[float]] = {name: [] for name in VARIANTS}
    whole_cpu: dict[str, list[float]] = {name: [] for name in VARIANTS}
    help_cpu: dict[str, list[float]] = {name: [] for name in VARIANTS}
    for _ in range(repeats):
        for name, command in VARIANTS.items():  # alternated: both see the same load
            elapsed, cpu = first_request_seconds(command)
            first[name].append(elapsed)
            whole_cpu[name].append(cpu)
            help_cpu[name].append(help_cpu_seconds(command))
    load = os.getloadavg()[0]
    rows = [
        [
            name,
            spread(first[name], 3),
            f"{max(first[name]):.3f}",
            spread(whole_cpu[name], 3),
            spread(help_cpu[name], 3),
        ]
        for name in VARIANTS
    ]
    ours = statistics.median(first["llmhealth check (imports per verb)"])
    verdict = "met" if ours <= TARGET_SECONDS else "**MISSED**"
    return [
        Section(
            title="4. Start-up: exec to the first request on the wire",
            command="cd bench && ../.venv/bin/python bench_startup.py",
            intro=[
                f"{repeats} runs of each, alternated. A raw listener on 127.0.0.1 stands for "
                "the backend and closes the connection when the request's first bytes "
                "arrive (the check then reports it DOWN and exits). *CPU to exit* is the "
                "child's user + system time for the whole run, verdict and output included. "
                "The package's bytecode is compiled before the runs, as an installed copy "
                "has it (this machine's environment sets PYTHONDONTWRITEBYTECODE, under "
                "which each run compiled every llmhealth module from source). 1-minute "
                f"load average {load_before:.1f} at the start, {load:.1f} at the end, on "
                f"{os.cpu_count()} cores."
            ],
            tables=[
                Table(
                    [
                        "command",
                        "exec → first request s",
                        "max s",
                        "CPU to exit s",
                        "`check --help` CPU s",
                    ],
                    rows,
                )
            ],
            notes=[
                f"Target ≤ {TARGET_SECONDS} s from exec to the first request (median): "
                f"{verdict} ({ours:.3f} s)."
            ],
            seconds=time.monotonic() - began,
        )
    ]


def main() -> None:
    import report  # noqa: PLC0415 - the module, beside the names imported above

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=15)
    arguments = parser.parse_args()
    for section in run(arguments.repeats):
        print(report.section_markdown(section))


if __name__ == "__main__":
    main()
