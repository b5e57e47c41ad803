"""What the e2e scenarios do to a real server: load it, read its counters, run llmhealth.

Plain `http.client`, one connection per request: on 2 cores shared with a busy vLLM, a
heavier client (an SSL context per httpx client, say) is slow enough to trickle its load
in over tens of seconds. Every wait is bounded; every load thread catches what goes wrong
and records it instead of raising in a thread.
"""

from __future__ import annotations

import contextlib
import http.client
import itertools
import json
import random
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from vllm_server import MODEL_NAME, VllmServer

# The installed console script of the dev venv: the same entry point an operator runs.
_SCRIPT = Path(sys.executable).with_name("llmhealth")
LLMHEALTH = [str(_SCRIPT)] if _SCRIPT.exists() else [sys.executable, "-m", "llmhealth"]
CHECK_TIMEOUT = 180.0

RUNNING = "vllm:num_requests_running"
WAITING = "vllm:num_requests_waiting"
FINISHED = "vllm:request_success_total"
GENERATED = "vllm:generation_tokens_total"
STEPS = "vllm:iteration_tokens_total_count"
START = "process_start_time_seconds"


# --- reading the server's own counters ------------------------------------------------


def request(
    url: str, method: str, path: str, body: bytes | None = None, timeout: float = 10.0
) -> tuple[int, bytes]:
    """One request on a fresh connection: status and body. Raises OSError or HTTPException."""
    parts = urlsplit(url)
    connection = http.client.HTTPConnection(parts.hostname or "", parts.port, timeout=timeout)
    try:
        headers = {"Content-Type": "application/json"} if body is not None else {}
        connection.request(method, path, body=body, headers=headers)
        response = connection.getresponse()
        return response.status, response.read()
    finally:
        connection.close()


TRANSIENT = (OSError, http.client.HTTPException)


def scrape(url: str, timeout: float = 10.0) -> dict[str, float]:
    """Every series in /metrics summed by name over its labels (engines, finish reasons)."""
    status, body = request(url, "GET", "/metrics", timeout=timeout)
    if status != 200:
        raise http.client.HTTPException(f"GET /metrics answered {status}")
    text = body.decode(errors="replace")
    sums: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        ends = [i for i in (line.find("{"), line.find(" ")) if i >= 0]
        if not ends:
            continue
        name = line[: min(ends)]
        try:
            value = float(line.rsplit(" ", 1)[1])
        except (IndexError, ValueError):
            continue
        sums[name] = sums.get(name, 0.0) + value
    return sums


def admitted(values: Mapping[str, float]) -> float:
    """Requests the engine has seen: finished + running + waiting. Only a new request
    moves it (one finishing moves from running to finished)."""
    return values.get(FINISHED, 0.0) + values.get(RUNNING, 0.0) + values.get(WAITING, 0.0)


def work(values: Mapping[str, float]) -> float:
    return values.get(RUNNING, 0.0) + values.get(WAITING, 0.0)


def wait_for(what: str, predicate: Callable[[], bool], timeout: float, every: float = 0.3) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if predicate():
                return
        except TRANSIENT:
            pass
        time.sleep(every)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


def wait_quiet(server: VllmServer, timeout: float = 180.0) -> dict[str, float]:
    """Until the server shows no work; its counters then."""
    wait_for("the server to show no work", lambda: work(scrape(server.url)) == 0, timeout)
    return scrape(server.url)


def access_lines(server: VllmServer, since: int, request: str) -> list[str]:
    """uvicorn access-log lines for ``request`` (e.g. 'POST /v1/completions') past byte
    offset ``since`` of the server log."""
    with server.log_path.open("rb") as log:
        log.seek(since)
        text = log.read().decode(errors="replace")
    return [line for line in text.splitlines() if f'"{request} HTTP/' in line]


def log_size(server: VllmServer) -> int:
    return server.log_path.stat().st_size


# --- load ---------------------------------------------------------------------------


def decode_body(max_tokens: int = 1000) -> dict[str, Any]:
    """A short prompt and a long answer: the decode-bound work of a busy server."""
    return {
        "model": MODEL_NAME,
        "prompt": "The health of a server is",
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "temperature": 0,
    }


def prefill_body(rng: random.Random, length: int = 1900) -> dict[str, Any]:
    """A long prompt (random token ids) and a short answer: prefill-bound work."""
    return {
        "model": MODEL_NAME,
        "prompt": [rng.randrange(10, 2000) for _ in range(length)],
        "max_tokens": 8,
        "ignore_eos": True,
        "temperature": 0,
    }


class Load:
    """Concurrent /v1/completions from background threads, one connection per request.

    ``Load(url, bodies)`` sends each body once. ``Load(url, bodies, until_stopped=True)``
    keeps every body in flight, sending it again as soon as it is answered, until
    ``stop()``: a busy state that lasts however long a starved test machine needs to get
    around to checking. A thread stops at its first failure. ``sent`` counts requests
    sent, which is what the server's counters must add up to.
    """

    def __init__(
        self,
        url: str,
        bodies: Iterable[Mapping[str, Any]],
        *,
        until_stopped: bool = False,
        timeout: float = 600,
    ) -> None:
        self.url = url
        self.timeout = timeout
        self.until_stopped = until_stopped
        self.outcomes: list[int | str] = []
        self.sent = 0
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._threads = [
            threading.Thread(target=self._send, args=(json.dumps(body).encode(),), daemon=True)
            for body in bodies
        ]

    def _send(self, body: bytes) -> None:
        while not self._stop.is_set():
            with self._lock:
                self.sent += 1
            outcome: int | str
            try:
                outcome, _ = request(self.url, "POST", "/v1/completions", body, self.timeout)
            except Exception as exc:  # a thread must not raise; the test reads it
                outcome = f"{type(exc).__name__}: {exc}"
            with self._lock:
                self.outcomes.append(outcome)
            if outcome != 200 or not self.until_stopped:
                return

    def start(self) -> Load:
        for thread in self._threads:
            thread.start()
        return self

    def stop(self) -> None:
        """Send nothing new; what is in flight is still answered (see ``join``)."""
        self._stop.set()

    def join(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        return not any(thread.is_alive() for thread in self._threads)

    def summary(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        with self._lock:
            for outcome in self.outcomes:
                counts[str(outcome)] = counts.get(str(outcome), 0) + 1
        return counts

    @property
    def all_ok(self) -> bool:
        with self._lock:
            return len(self.outcomes) == self.sent and all(o == 200 for o in self.outcomes)


class StreamedDecode:
    """One long streamed decode that runs until ``close()``, which aborts it.

    A non-streamed request can only be waited out; closing a streamed one's connection
    makes vLLM abort the request at once (its running gauge drops). A thread drains what
    the server streams, so that the server never waits on a full socket buffer.
    """

    def __init__(self, url: str, max_tokens: int) -> None:
        parts = urlsplit(url)
        body = json.dumps({**decode_body(max_tokens), "stream": True}).encode()
        head = (
            f"POST /v1/completions HTTP/1.1\r\nHost: {parts.hostname}:{parts.port}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
        )
        self._sock = socket.create_connection((parts.hostname or "", parts.port or 80), 10)
        self._sock.sendall(head.encode() + body)
        self.received = 0
        self._reader = threading.Thread(target=self._drain, daemon=True)
        self._reader.start()

    def _drain(self) -> None:
        with contextlib.suppress(OSError):
            self._sock.settimeout(None)
            while chunk := self._sock.recv(65536):
                self.received += len(chunk)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()
        self._reader.join(10)

    def __enter__(self) -> StreamedDecode:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()


class FreezeWatch:
    """Reads the engine's step counter twice a second in a thread; the longest time it
    stood still is the longest step seen from outside (to within a read)."""

    def __init__(self, url: str, every: float = 0.5) -> None:
        self.url = url
        self.every = every
        self.seen: list[tuple[float, float]] = []  # (monotonic time, steps) at each change
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)

    def _watch(self) -> None:
        while not self._stop.is_set():
            with contextlib.suppress(*TRANSIENT):
                steps = scrape(self.url).get(STEPS)
                now = time.monotonic()
                if steps is not None and (not self.seen or steps != self.seen[-1][1]):
                    self.seen.append((now, steps))
            self._stop.wait(self.every)

    def start(self) -> FreezeWatch:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(30)

    def longest_freeze(self) -> float:
        """The most seconds between two reads that saw the counter change (a step that
        has not ended yet is not counted)."""
        times = [at for at, _ in self.seen]
        return max((b - a for a, b in itertools.pairwise(times)), default=0.0)


# --- llmhealth ----------------------------------------------------------------------


@dataclass
class CheckRun:
    argv: list[str]
    code: int
    doc: dict[str, Any]
    stdout: str
    stderr: str
    seconds: float

    def entry(self, kind: str = "backend", index: int = 0) -> dict[str, Any]:
        entries = [b for b in self.doc["backends"] if b["kind"] == kind]
        assert len(entries) > index, f"no {kind} #{index} in the report\n{self}"
        return entries[index]

    @property
    def backend(self) -> dict[str, Any]:
        return self.entry("backend")

    @property
    def proxy(self) -> dict[str, Any]:
        return self.entry("proxy")

    def __repr__(self) -> str:
        """One line per entry, for assertion messages (pytest truncates long ones; the
        whole JSON is in the test's captured stdout)."""
        lines = [f"llmhealth check: exit {self.code} after {self.seconds:.1f} s"]
        for entry in self.doc.get("backends", []):
            lines.append(
                f"  {entry['kind']} {entry['name']}: {entry['verdict']}, state {entry['state']}: "
                f"{entry['evidence']}"
            )
        return "\n".join(lines)

    def __str__(self) -> str:
        return (
            f"$ {' '.join(self.argv)}\n(exit {self.code} after {self.seconds:.1f} s)\n"
            f"{self.stdout}\n{self.stderr}"
        )


def check(*args: str, timeout: float = CHECK_TIMEOUT) -> CheckRun:
    """The real CLI in a subprocess, JSON out; the document must parse, whatever the code."""
    argv = [*LLMHEALTH, "check", *args, "--format", "json"]
    started = time.monotonic()
    done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=False)
    seconds = time.monotonic() - started
    try:
        doc = json.loads(done.stdout)
    except ValueError as exc:
        raise AssertionError(
            f"llmhealth printed no JSON (exit {done.returncode}):\n{done.stdout}\n{done.stderr}"
        ) from exc
    run = CheckRun(argv, done.returncode, doc, done.stdout, done.stderr, seconds)
    print(run, flush=True)  # in the report of a failing test, in full
    return run
