"""`llmhealth demo`: a simulated fleet on loopback, one check of it, and everything stopped.

It runs the real simulator as a child process and the real check against it, so what it
shows is what an operator would see against servers in those states.
"""

from __future__ import annotations

import contextlib
import socket
import subprocess
import sys
import time
from collections.abc import Iterator

from rich.console import Console

from llmhealth.classify import Target
from llmhealth.config import Config
from llmhealth.cycle import run_cycle
from llmhealth.probe import ProbeSettings
from llmhealth.render import print_report
from llmhealth.report import exit_code

_HOST = "127.0.0.1"
_READY_WITHIN = 30.0
_WEDGE_AFTER = 1.0
# name, simulator mode; the proxy fronts the first two backends
_FLEET = (
    ("gpu0-busy", "busy"),
    ("gpu1-idle", "idle"),
    ("gpu2-wedging", f"wedge:{_WEDGE_AFTER:g}"),
    ("gpu3-no-metrics", "no-metrics"),
)


def free_port_block(count: int, attempts: int = 50) -> int:
    """First port of ``count`` consecutive free ports on loopback."""
    for _ in range(attempts):
        with socket.socket() as probe:
            probe.bind((_HOST, 0))
            base = int(probe.getsockname()[1])
        if base + count > 65535:
            continue
        sockets: list[socket.socket] = []
        try:
            for offset in range(count):
                sock = socket.socket()
                sockets.append(sock)
                sock.bind((_HOST, base + offset))
        except OSError:
            continue
        finally:
            for sock in sockets:
                sock.close()
        return base
    raise RuntimeError(f"no block of {count} free ports on {_HOST}")


@contextlib.contextmanager
def simulated_fleet(modes: list[str], base_port: int) -> Iterator[subprocess.Popen[str]]:
    """Run ``llmhealth simulate`` until the block exits; it is always stopped."""
    argv = [sys.executable, "-m", "llmhealth", "simulate", *modes, "--port", str(base_port)]
    process = subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True
    )
    try:
        _wait_ready(process)
        yield process
    finally:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=10)
        for stream in (process.stdout, process.stderr):
            if stream is not None:
                stream.close()


def _wait_ready(process: subprocess.Popen[str]) -> None:
    deadline = time.monotonic() + _READY_WITHIN
    assert process.stdout is not None
    while time.monotonic() < deadline:
        line = process.stdout.readline()
        if line.strip() == "ready":
            return
        if not line and process.poll() is not None:
            error = process.stderr.read() if process.stderr else ""
            raise RuntimeError(f"the simulator exited with {process.returncode}: {error}")
    raise RuntimeError(f"the simulator was not ready within {_READY_WITHIN:g} s")


def run_demo(console: Console) -> int:
    base = free_port_block(len(_FLEET) + 1)
    urls = [f"http://{_HOST}:{base + index}" for index in range(len(_FLEET))]
    proxy_url = f"http://{_HOST}:{base + len(_FLEET)}"
    modes = [mode for _, mode in _FLEET] + [f"proxy:{urls[0]},{urls[1]}"]
    targets = [Target(name, url) for (name, _), url in zip(_FLEET, urls, strict=True)]
    targets.append(Target("lb", proxy_url, "proxy"))
    settings = ProbeSettings(wait=2.0, timeout=3.0, answer_timeout=5.0)

    console.rule("llmhealth demo")
    console.print(f"Simulated fleet on {_HOST}:{base}-{base + len(_FLEET)}:")
    for target, mode in zip(targets, modes, strict=True):
        console.print(f"  {target.name:<16} {target.url}  simulator mode {mode}")
    with simulated_fleet(modes, base):
        time.sleep(_WEDGE_AFTER + 0.5)  # let gpu2 wedge before the first read
        command = " ".join(["llmhealth check", *urls, "--proxy", proxy_url, "--wait", "2s"])
        console.print(f"\n$ {command}\n")
        report = run_cycle(Config(), targets, settings, None)
        print_report(report, console)
    code = exit_code(report)
    console.print(
        f"\nThe check would exit {int(code)} ({code.name}). The busy backend was judged by its "
        "own counters and sent no request; the wedged one was proven over two waits; "
        "the proxy was only asked for /v1/models. Simulator stopped."
    )
    return 0
