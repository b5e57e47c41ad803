"""Start-up: each verb imports only what it needs before it does its work.

An on-call shell check and a once-a-minute timer pay the interpreter and every import
each time they run, so the modules loaded are checked here (their cost is measured in
bench/bench_startup.py, never timed in a test). Each run is a real subprocess: the
module cache of this test process would hide every import.
"""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

# Loaded by other verbs, or after the first request: never before a check's first read.
_NOT_BEFORE_THE_FIRST_READ = (
    "httpx",  # only for the tiny request and model lists; /metrics goes through wire.py
    "rich",
    "prometheus_client",
    "llmhealth.daemon",
    "llmhealth.render",
    "llmhealth.exporter",
    "llmhealth.simulate",
    "llmhealth.operate",
)
# Nothing that reads, serves or renders: the command line module only parses arguments.
_NOT_ON_IMPORT = (*_NOT_BEFORE_THE_FIRST_READ, "asyncio", "ssl", "llmhealth.cycle")


def _imported(importtime_output: str) -> set[str]:
    """Module names from ``python -X importtime`` lines ("import time: self | total | name")."""
    names = set()
    for line in importtime_output.splitlines():
        if line.startswith("import time:") and "|" in line:
            name = line.rsplit("|", 1)[1].strip()
            if name != "imported package":  # the header line
                names.add(name)
    return names


def _loaded_from(names: set[str], prefixes: tuple[str, ...]) -> list[str]:
    return sorted(
        name
        for name in names
        if any(name == prefix or name.startswith(prefix + ".") for prefix in prefixes)
    )


def test_importing_the_command_line_loads_no_client_renderer_or_event_loop() -> None:
    listing = subprocess.run(
        [sys.executable, "-c", "import sys, llmhealth.cli; print('\\n'.join(sys.modules))"],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    loaded = set(listing.stdout.split())
    assert "llmhealth.cli" in loaded
    assert _loaded_from(loaded, _NOT_ON_IMPORT) == []


def test_check_help_loads_no_client_and_no_cycle(entry_point: str) -> None:
    shown = subprocess.run(
        [sys.executable, "-X", "importtime", entry_point, "check", "--help"],
        capture_output=True,
        check=False,
        text=True,
        timeout=60,
    )
    assert shown.returncode == 0, shown.stderr[-2000:]
    assert "--wait" in shown.stdout
    loaded = _imported(shown.stderr)
    assert "typer" in loaded  # the listing is real: the parser was imported
    heavy = ("httpx", "asyncio", "prometheus_client", "llmhealth.cycle", "llmhealth.probe")
    assert _loaded_from(loaded, heavy) == []


def test_check_sends_its_first_request_before_loading_the_renderer(
    entry_point: str, tmp_path: Path
) -> None:
    """The imports written before the server sees the request are all a check paid for it.

    stderr goes to a file, which ``-X importtime`` writes line by line as it imports: when
    the first request arrives, the file holds exactly what was imported before it.
    """
    trace = tmp_path / "importtime.txt"
    with socket.create_server(("127.0.0.1", 0)) as listener, trace.open("w") as stderr:
        listener.settimeout(60)
        url = f"http://127.0.0.1:{listener.getsockname()[1]}"
        check = subprocess.Popen(
            [sys.executable, "-X", "importtime", entry_point, "check", url, "--timeout", "30"],
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
        )
        try:
            connection, _ = listener.accept()
            with connection:
                connection.settimeout(60)
                request = connection.recv(4096)
                before_the_read = _imported(trace.read_text())
            # Closed before an answer: the check must go on to report a verdict.
            output, _ = check.communicate(timeout=60)
        finally:
            if check.poll() is None:
                check.kill()
                check.wait()
    assert request.startswith(b"GET /metrics HTTP/1.1\r\n")
    assert "llmhealth.classify" in before_the_read
    assert _loaded_from(before_the_read, _NOT_BEFORE_THE_FIRST_READ) == []
    assert check.returncode == 2, output
    assert "rich" in _imported(trace.read_text())  # the table came after the read
