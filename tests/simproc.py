"""Test helper: start real `llmhealth simulate` processes on free ports, and always stop them.

`with running_simulator(["busy", "idle"]) as sim: sim.urls` gives one URL per mode. Every
process started here is terminated (then killed) when the block exits, failing test or not,
and every wait is bounded.
"""

from __future__ import annotations

import os
import queue
import random
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import llmhealth

# Switch to [sys.executable, "-m", "llmhealth", "simulate"] once the CLI has the command.
LAUNCH = [sys.executable, "-m", "llmhealth", "simulate"]
READY_TIMEOUT = 20.0
STOP_TIMEOUT = 5.0
# Below Linux's ephemeral range (32768+), so outgoing connections do not take these ports.
PORT_RANGE = (20000, 32000)
START_ATTEMPTS = 5


class SimulatorStartError(RuntimeError):
    """The simulator did not come up; the message carries its stderr."""


class _PortsTakenError(Exception):
    pass


@dataclass
class Simulator:
    process: subprocess.Popen[bytes]
    modes: list[str]
    urls: list[str]
    _stderr: IO[bytes]
    _stdout_pump: threading.Thread

    def url(self, mode: str) -> str:
        return self.urls[self.modes.index(mode)]

    def stop(self, signum: int = signal.SIGTERM) -> int:
        """Signal the process, wait (bounded), kill if it lingers; returns the exit code."""
        if self.process.poll() is None:
            self.process.send_signal(signum)
            try:
                self.process.wait(STOP_TIMEOUT)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(STOP_TIMEOUT)
        return self.process.returncode

    def stderr(self) -> str:
        self._stderr.seek(0)
        return self._stderr.read().decode(errors="replace")

    def close(self) -> None:
        self.stop()
        self._stdout_pump.join(STOP_TIMEOUT)
        if self.process.stdout is not None:
            self.process.stdout.close()
        self._stderr.close()


def simulator_argv(
    modes: Sequence[str],
    *,
    port: int,
    host: str = "127.0.0.1",
    max_num_seqs: int = 4,
    model: str = "tiny",
    engines: int = 1,
    request_seconds: float = 4.0,
    keep_alive: float = 5.0,
    age: float | None = None,
) -> list[str]:
    return [
        *LAUNCH,
        *modes,
        f"--host={host}",
        f"--port={port}",
        f"--max-num-seqs={max_num_seqs}",
        f"--model={model}",
        f"--engines={engines}",
        f"--request-seconds={request_seconds}",
        f"--keep-alive={keep_alive}",
        *([] if age is None else [f"--age={age}"]),
    ]


def free_port_block(count: int, host: str = "127.0.0.1", tries: int = 200) -> int:
    """A first port such that `count` consecutive ports bind now (they may be taken later)."""
    for _ in range(tries):
        base = random.randrange(PORT_RANGE[0], PORT_RANGE[1] - count)
        if all(_bindable(host, base + i) for i in range(count)):
            return base
    raise SimulatorStartError(f"no {count} consecutive free ports on {host} after {tries} tries")


def _bindable(host: str, port: int) -> bool:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        # The same option asyncio's servers set, so a port in TIME_WAIT counts as free.
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError:
            return False
    return True


def child_env() -> dict[str, str]:
    # The child imports the same llmhealth as the tests, installed or not.
    root = str(Path(llmhealth.__file__).resolve().parent.parent)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    env["PYTHONUNBUFFERED"] = "1"
    return env


def _pump(stream: IO[bytes], lines: queue.Queue[str | None]) -> None:
    for raw in stream:
        lines.put(raw.decode(errors="replace").rstrip("\n"))
    lines.put(None)


def _start(argv: list[str], modes: list[str], ready_timeout: float) -> Simulator:
    with ExitStack() as undo:
        stderr = undo.enter_context(tempfile.TemporaryFile())
        process = subprocess.Popen(
            argv, stdout=subprocess.PIPE, stderr=stderr, stdin=subprocess.DEVNULL, env=child_env()
        )
        assert process.stdout is not None
        lines: queue.Queue[str | None] = queue.Queue()
        pump = threading.Thread(target=_pump, args=(process.stdout, lines), daemon=True)
        pump.start()
        sim = Simulator(process, modes, [], stderr, pump)
        undo.callback(sim.close)
        deadline = time.monotonic() + ready_timeout
        while True:
            try:
                line = lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise SimulatorStartError(
                    f"simulator not ready after {ready_timeout} s; stderr:\n{sim.stderr()}"
                ) from None
            if line is None:
                process.wait(STOP_TIMEOUT)
                text = sim.stderr()
                if "cannot listen" in text:
                    raise _PortsTakenError(text)
                raise SimulatorStartError(
                    f"simulator exited with {process.returncode} before ready; stderr:\n{text}"
                )
            if line == "ready":
                break
            word, _, rest = line.partition(" ")
            url, _, mode = rest.partition(" ")
            if word != "listening" or len(sim.urls) >= len(modes) or mode != modes[len(sim.urls)]:
                raise SimulatorStartError(f"unexpected simulator output {line!r} for {modes}")
            sim.urls.append(url)
        if len(sim.urls) != len(modes):
            raise SimulatorStartError(f"simulator announced {sim.urls} for modes {modes}")
        undo.pop_all()
        return sim


@contextmanager
def running_simulator(
    modes: Sequence[str],
    *,
    host: str = "127.0.0.1",
    max_num_seqs: int = 4,
    model: str = "tiny",
    engines: int = 1,
    request_seconds: float = 4.0,
    keep_alive: float = 5.0,
    ready_timeout: float = READY_TIMEOUT,
    age: float | None = None,
) -> Iterator[Simulator]:
    """One simulator process serving `modes` on consecutive free ports, stopped on exit."""
    failure = ""
    for _ in range(START_ATTEMPTS):
        port = free_port_block(len(modes), host)
        argv = simulator_argv(
            modes,
            port=port,
            host=host,
            max_num_seqs=max_num_seqs,
            model=model,
            engines=engines,
            request_seconds=request_seconds,
            keep_alive=keep_alive,
            age=age,
        )
        try:
            sim = _start(argv, list(modes), ready_timeout)
        except _PortsTakenError as exc:
            failure = str(exc)  # someone took a port between our check and its bind: retry
            continue
        try:
            yield sim
        finally:
            sim.close()
        return
    raise SimulatorStartError(f"ports kept being taken; last stderr:\n{failure}")


def children(pid: int) -> set[int]:
    """The processes ``pid`` started, from the kernel's list (none once it is gone)."""
    try:
        text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    except OSError:
        return set()
    return {int(word) for word in text.split()}


def alive(pid: int) -> bool:
    """Running, not gone and not a zombie waiting to be reaped."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"
