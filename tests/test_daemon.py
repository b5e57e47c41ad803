"""`llmhealth watch` as systemd runs it: a real daemon process against real simulators.

Each test starts the installed `llmhealth watch` with `--wait 0.5`, a TOML config with
short timeouts, its state in tmp_path and its own /metrics on a free loopback port, then
watches it from outside: its metrics page (parsed with prometheus_client), its stderr, its
state file, its serving file and the datagrams it sends to a NOTIFY_SOCKET. One simulator
process serves every backend of the module; one test brings its own small server that
drops reused connections. Every wait polls against a deadline, and every process started
here is stopped when its test ends, failing or not.

Then two tests run the Daemon class in this process (what a subprocess cannot show: its
asyncio tasks, a shortened shutdown grace), and at the end come unit tests of the
sd_notify client and of the fleet stall watch.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import gc
import importlib.resources
import io
import itertools
import json
import math
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, cast

import httpx
import pytest
from captures import CAPTURES, asleep_capture
from etcdproc import running_etcd
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample
from pytest_httpserver import HTTPServer
from rich.console import Console
from simproc import Simulator, child_env, free_port_block, running_simulator
from werkzeug import Request, Response

from llmhealth import cli, eventloop, operate, probe, readers
from llmhealth import config as config_module
from llmhealth import daemon as daemon_module
from llmhealth.actions import AuditLog, CommandResult, read
from llmhealth.classify import Outcome, Read, Target, Verdict, VerdictKind, decide
from llmhealth.cycle import audit_path_for, fresh_record, ledger_policy, settle_fleet
from llmhealth.daemon import Daemon, News, Notifier
from llmhealth.fleet import READS_KEEP_UP, Sighting, StallWatch
from llmhealth.gctune import YOUNG
from llmhealth.ledger import State
from llmhealth.metrics import EngineSignals, Signals, parse_metrics
from llmhealth.remediate import CommandDone, Mode, RestartOrder
from llmhealth.simengine import MetricsText, SimBackend, SimConfig, parse_mode
from llmhealth.simulate import TEMPLATE_NAME
from llmhealth.state import RecordMovedError, StateFile, StateLockedError
from llmhealth.window import LongestStep

if TYPE_CHECKING:
    from llmhealth.router import Router

WAIT = 0.5
STOP_BOUND = 5.0  # SIGTERM to exit; far above what a daemon with nothing to finish needs
POLL = 0.05
# Bounds for "eventually": each is met in 1-4 s here, but this machine is shared and its
# load sometimes starves a process for seconds; a bound only has to end a hung test.
PATIENCE = 30.0
MODES = ["busy", "idle", "hang", "wedge:0.5", "wedge:0.5", "prefill", "unanswered", "busy"]
# Port 9 (discard) on loopback: nothing listens there, so a read is refused at once.
REFUSED_URL = "http://127.0.0.1:9"


class NotObservedError(Exception):
    """The daemon did not show, in time, what a test waits for before its assertions.

    Not an AssertionError: "the machine was too slow to get there" and "what it showed
    was wrong" are different failures.
    """


class DaemonExitedError(Exception):
    """The daemon process ended while a test still expected it to run."""


@pytest.fixture(scope="module")
def sim() -> Iterator[Simulator]:
    # The wedging engines freeze 0.5 s after this starts, so by the first daemon they are
    # wedged from its first read on: proven after three reads, about one second.
    with running_simulator(MODES) as simulator:
        yield simulator


@dataclass(frozen=True)
class Urls:
    busy: str
    idle: str
    hang: str
    wedge_a: str
    wedge_b: str
    prefill: str
    unanswered: str
    busy2: str


@pytest.fixture(scope="module")
def urls(sim: Simulator) -> Urls:
    return Urls(*sim.urls)


# --- config -------------------------------------------------------------------------------


def toml_value(value: object) -> str:
    # JSON strings and arrays of strings are valid TOML basic strings and arrays.
    return json.dumps(value)


def fleet_config(
    backends: Sequence[Mapping[str, object]],
    *,
    proxies: Sequence[Mapping[str, object]] = (),
    timeout: str = "1s",
    answer_timeout: str = "1s",
    **top: object,
) -> str:
    lines = [f"timeout = {toml_value(timeout)}", f"answer_timeout = {toml_value(answer_timeout)}"]
    lines += [f"{key} = {toml_value(value)}" for key, value in top.items()]
    for kind, tables in (("backend", backends), ("proxy", proxies)):
        for table in tables:
            lines.append(f"\n[[{kind}]]")
            lines += [f"{key} = {toml_value(value)}" for key, value in table.items()]
    return "\n".join(lines) + "\n"


def write_config(path: Path, text: str) -> Path:
    temporary = path.with_name(path.name + ".tmp")
    temporary.write_text(text)
    os.replace(temporary, path)  # the daemon never reads a half-written file
    return path


def busy_and_hung(urls: Urls, tmp_path: Path, *, timeout: str) -> Path:
    """A busy backend, and one whose every read hangs until `timeout` ends it."""
    return write_config(
        tmp_path / "fleet.toml",
        fleet_config(
            [{"name": "busy", "url": urls.busy}, {"name": "hung", "url": urls.hang}],
            timeout=timeout,
        ),
    )


def touch_command(marker: Path) -> list[str]:
    return ["touch", str(marker)]


def append_command(log: Path) -> list[str]:
    """Appends "changed", and "KEY LEAKED" if it was handed the BUSY_KEY variable."""
    return [
        sys.executable,
        "-c",
        "import os, sys; open(sys.argv[1], 'a').write("
        "'changed\\n' + ('KEY LEAKED\\n' if 'BUSY_KEY' in os.environ else ''))",
        str(log),
    ]


# --- the metrics page -----------------------------------------------------------------------


def a_daemon(
    load: daemon_module.Loader,
    store: StateFile | daemon_module.MemoryStore,
    *,
    wait: float | None = None,
    listen: tuple[str, int] | None = None,
    serving_file: Path | None = None,
    console: Console | None = None,
    **more: Any,
) -> Daemon:
    """A daemon as most tests here run one: no metrics listener, no serving file, the
    wait its config says, its lines on stderr; a test names only what it differs in."""
    return Daemon(
        load,
        store,
        listen=listen,
        wait_override=wait,
        serving_file=serving_file,
        console=console or Console(stderr=True),
        **more,
    )


class Page:
    """One scrape of the daemon's /metrics: the raw text and the parsed families."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.families = {f.name: f for f in text_string_to_metric_families(text)}

    def samples(self, family: str) -> list[Sample]:
        found = self.families.get(family)
        return list(found.samples) if found is not None else []

    def get(self, family: str, **labels: str) -> float | None:
        matching = [s.value for s in self.samples(family) if s.labels == labels]
        assert len(matching) <= 1, (family, labels)
        return matching[0] if matching else None

    def ones(self, family: str, backend: str, label: str) -> list[str]:
        return [
            s.labels[label]
            for s in self.samples(family)
            if s.labels.get("backend") == backend and s.value == 1.0
        ]

    def verdict(self, backend: str) -> str | None:
        current = self.ones("llmhealth_backend_verdict", backend, "verdict")
        assert len(current) <= 1, f"{backend} has several current verdicts: {current}"
        return current[0] if current else None

    def state(self, backend: str) -> str | None:
        current = self.ones("llmhealth_backend_state", backend, "state")
        assert len(current) <= 1, f"{backend} has several current states: {current}"
        return current[0] if current else None

    def counts(self, family: str, label: str) -> dict[tuple[str, str], float]:
        return {(s.labels["backend"], s.labels[label]): s.value for s in self.samples(family)}

    @property
    def last_cycle(self) -> float | None:
        return self.get("llmhealth_last_cycle_timestamp_seconds")

    @property
    def cycled(self) -> bool:
        return "llmhealth_fleet_serving_backends" in self.families


def scrape(port: int) -> Page | None:
    try:
        response = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=2.0)
    except httpx.TransportError:
        return None  # not listening yet
    assert response.status_code == 200
    return Page(response.text)


class Watch:
    """A running `llmhealth watch` process and what can be seen of it from outside."""

    def __init__(self, process: subprocess.Popen[bytes], port: int, stderr: IO[bytes]) -> None:
        self.process = process
        self.port = port
        self._stderr = stderr

    def stderr(self) -> str:
        self._stderr.seek(0)
        return self._stderr.read().decode(errors="replace")

    def scrape(self) -> Page | None:
        return scrape(self.port)

    def _alive(self, waiting_for: str) -> None:
        code = self.process.poll()
        if code is not None:
            raise DaemonExitedError(
                f"llmhealth watch exited with {code} while waiting for {waiting_for}; "
                f"stderr:\n{self.stderr()}"
            )

    def until(
        self, what: str, predicate: Callable[[Page], bool], timeout: float = PATIENCE
    ) -> Page:
        """The first scrape for which `predicate` holds; fails naming `what` at the deadline."""
        deadline = time.monotonic() + timeout
        last: Page | None = None
        while time.monotonic() < deadline:
            self._alive(what)
            page = self.scrape()
            if page is not None:
                last = page
                if predicate(page):
                    return page
            time.sleep(POLL)
        shown = last.text if last is not None else "(no scrape answered)"
        raise NotObservedError(
            f"no {what} within {timeout} s; last page:\n{shown}\n{self.stderr()}"
        )

    def next_cycle(self, after: Page, timeout: float = PATIENCE) -> Page:
        seen = after.last_cycle or 0.0
        return self.until("a later cycle", lambda p: (p.last_cycle or 0.0) > seen, timeout)

    def logged(self, text: str, timeout: float = PATIENCE) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            log = self.stderr()
            if text in log:
                return log
            self._alive(repr(text))
            time.sleep(POLL)
        raise NotObservedError(f"{text!r} not logged within {timeout} s; stderr:\n{self.stderr()}")

    def signal(self, signum: int) -> None:
        self._alive(f"signal {signum}")
        self.process.send_signal(signum)

    def stop(self, timeout: float = STOP_BOUND) -> tuple[int, float]:
        """SIGTERM, then the exit code and how long the exit took (killed past `timeout`)."""
        started = time.monotonic()
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout)
                raise AssertionError(
                    f"llmhealth watch ignored SIGTERM for {timeout} s; stderr:\n{self.stderr()}"
                ) from None
        return self.process.returncode, time.monotonic() - started


@contextmanager
def watching(
    entry_point: str,
    config: Path | None,
    state: Path | None,
    *args: str,
    env: dict[str, str] | None = None,
    cwd: Path | None = None,
) -> Iterator[Watch]:
    """`llmhealth watch` until the block ends; ``config`` and ``state`` None leave their
    options out."""
    port = free_port_block(1)
    environment = child_env()
    environment.pop("NOTIFY_SOCKET", None)
    environment.update(env or {})
    argv = [entry_point, "watch"]
    argv += ["--config", str(config)] if config is not None else []
    argv += ["--state", str(state)] if state is not None else []
    argv += ["--wait", str(WAIT), "--listen", f"127.0.0.1:{port}", *args]
    with ExitStack() as stack:
        stderr = stack.enter_context(tempfile.TemporaryFile())
        process = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=stderr,
            env=environment,
            cwd=cwd,
        )
        watch = Watch(process, port, stderr)

        def reap() -> None:
            if process.poll() is None:
                process.kill()
            process.wait(STOP_BOUND)

        stack.callback(reap)
        yield watch
        assert "Traceback" not in watch.stderr(), watch.stderr()


# --- the metrics page of a running daemon ---------------------------------------------------


@pytest.mark.slow
def test_the_metrics_page_shows_each_backend_its_verdict_state_errors_and_the_fleet(
    entry_point: str, urls: Urls, tmp_path: Path
) -> None:
    config = write_config(
        tmp_path / "fleet.toml",
        fleet_config(
            [
                {"name": "busy", "url": urls.busy},
                {"name": "idle", "url": urls.idle},
                {"name": "mute", "url": urls.unanswered},
                {"name": "gone", "url": REFUSED_URL},
            ],
            proxies=[{"name": "lb", "url": urls.busy2}],
        ),
    )
    names = ["busy", "idle", "mute", "gone"]

    def complete(page: Page) -> bool:
        errors = page.counts("llmhealth_backend_probe_errors", "kind")
        return (
            page.cycled
            and all(page.verdict(name) is not None for name in [*names, "lb"])
            and ("mute", "unanswered") in errors
            and ("gone", "down") in errors
        )

    # The fleet's stall clock counts from the daemon's start, growing every cycle, until a
    # finished request is seen: then from that cycle (0 there) and less than before.
    since_seen: list[float] = []

    def finished_seen(p: Page) -> bool:
        since = p.get("llmhealth_fleet_seconds_since_last_finished_request")
        if since is None:
            return False
        since_seen.append(since)
        return since == 0.0 or any(since < earlier for earlier in since_seen)

    launched = time.time()
    with watching(entry_point, config, tmp_path / "state.json") as watch:
        page = watch.until("every target judged, with errors counted", complete)
        later = watch.next_cycle(page)
        # The busy backend finishes one a second; the bound only ends a hung test.
        watch.until("a finished request seen by the fleet's stall clock", finished_seen)
        rc, _ = watch.stop()
        scraped = time.time()
    assert rc == 0

    # One current verdict per target, the one each simulator mode calls for.
    assert {name: page.verdict(name) for name in [*names, "lb"]} == {
        "busy": "busy",
        "idle": "idle",
        "mute": "unanswered",
        "gone": "down",
        "lb": "up",
    }
    # One current ledger state per backend; the failing ones are doubted or condemned.
    assert page.state("busy") == page.state("idle") == "healthy"
    assert page.state("mute") in {"suspect", "dead"}
    assert page.state("gone") in {"suspect", "dead"}
    for name in names:
        states = [s for s in page.samples("llmhealth_backend_state") if s.labels["backend"] == name]
        assert len(states) == 6, "every state is exported, all but one as 0"
    # A proxy is not in the ledger: a verdict, no state, no serving flag.
    assert page.ones("llmhealth_backend_state", "lb", "state") == []
    assert page.get("llmhealth_backend_serving", backend="lb") is None

    assert page.get("llmhealth_backend_serving", backend="busy") == 1.0
    assert page.get("llmhealth_backend_running_requests", backend="busy") == 4.0
    assert page.get("llmhealth_backend_waiting_requests", backend="busy") == 8.0
    assert page.get("llmhealth_backend_running_requests", backend="idle") == 0.0
    steps = page.get("llmhealth_backend_engine_steps_per_second", backend="busy")
    assert steps is not None and steps > 0
    durations = {
        s.labels["backend"]: s.value
        for s in page.samples("llmhealth_backend_probe_duration_seconds")
    }
    assert set(durations) == {*names, "lb"}
    assert all(math.isfinite(value) and value >= 0.0 for value in durations.values())
    # The unanswered backend's probe includes its tiny request's 1 s timeout, which the
    # busy backend's answer does not wait for.
    assert durations["mute"] > durations["busy"]

    errors = page.counts("llmhealth_backend_probe_errors", "kind")
    assert set(errors) == {("mute", "unanswered"), ("gone", "down")}
    assert all(count >= 1 for count in errors.values())
    assert page.samples("llmhealth_backend_restarts") == []  # no restart commands

    serving = [s for s in page.samples("llmhealth_backend_serving") if s.value == 1.0]
    assert page.get("llmhealth_fleet_serving_backends") == len(serving) >= 2
    assert page.get("llmhealth_fleet_min_healthy") == 1.0
    epoch = page.get("llmhealth_fleet_membership_epoch")
    assert epoch is not None and epoch >= 0 and epoch == int(epoch)
    assert page.get("llmhealth_fleet_floor_breached") == 0.0
    assert page.get("llmhealth_fleet_stalled") == 0.0
    since = page.get("llmhealth_fleet_seconds_since_last_finished_request")
    assert since is not None and math.isfinite(since) and since >= 0.0
    cycle_seconds = page.get("llmhealth_cycle_duration_seconds")
    assert cycle_seconds is not None and math.isfinite(cycle_seconds) and cycle_seconds >= 0.0
    assert page.last_cycle is not None and later.last_cycle is not None
    assert later.last_cycle > page.last_cycle
    # Unix time, taken while the daemon ran.
    assert launched <= page.last_cycle < later.last_cycle <= scraped

    assert all(name.startswith("llmhealth_") for name in page.families)
    counters = {n for n, f in page.families.items() if f.type == "counter"}
    assert counters == {
        "llmhealth_backend_probe_errors",
        "llmhealth_backend_restarts",
        "llmhealth_backend_probe_task_restarts",
        "llmhealth_backend_examinations",
    }
    # Every target read is counted, and each later cycle has heard more of them.
    examined = page.counts("llmhealth_backend_examinations", "backend")
    examined_later = later.counts("llmhealth_backend_examinations", "backend")
    assert {name for name, _ in examined} == {*names, "lb"}
    assert all(count >= 1 for count in examined.values())
    assert sum(examined_later.values()) > sum(examined.values())
    pace = later.get("llmhealth_fleet_reads_per_wait")
    assert pace is not None and pace > 0.0
    # Every target's probing task is counted from zero, so increase() sees the first death.
    assert page.counts("llmhealth_backend_probe_task_restarts", "backend") == {
        (name, name): 0.0 for name in [*names, "lb"]
    }
    for line in page.text.splitlines():
        if line.startswith("# TYPE") and line.endswith(" counter"):
            assert line.split()[2].endswith("_total"), line
        elif line.startswith("llmhealth_backend_probe_errors"):
            assert line.startswith("llmhealth_backend_probe_errors_total{"), line


@pytest.mark.slow
def test_watch_outlives_the_reader_of_its_log(entry_point: str) -> None:
    """`watch ... 2>&1 | logger`, the logger gone: the daemon's next log line raised
    BrokenPipeError and it exited 1, silently, its metrics, restarts and routing with it."""
    with ExitStack() as stack:
        watch = _watch_whose_log_reader_leaves(entry_point, stack, {})
        first = watch.until("a cycle", lambda page: page.last_cycle is not None)
        watch.next_cycle(watch.next_cycle(first))  # each cycle logged a line to nobody
        assert watch.stop()[0] == 0


@pytest.mark.slow
def test_a_hung_backend_does_not_hold_up_the_cycles_of_the_others(
    entry_point: str, urls: Urls, tmp_path: Path
) -> None:
    config = busy_and_hung(urls, tmp_path, timeout="3s")
    # Each scrape while hung is unjudged: last cycle timestamp, busy's verdict, and hung's
    # ledger state and serving flag (HEALTHY and serving from the start, so shown as such).
    unjudged: list[tuple[float, str | None, str | None, float | None]] = []
    with watching(entry_point, config, tmp_path / "state.json") as watch:

        def hung_judged(page: Page) -> bool:
            if page.verdict("hung") is not None:
                return True
            if page.cycled and page.last_cycle is not None:
                serving = page.get("llmhealth_backend_serving", backend="hung")
                unjudged.append(
                    (page.last_cycle, page.verdict("busy"), page.state("hung"), serving)
                )
            return False

        judged = watch.until("a verdict on the hung backend", hung_judged)
        rc, _ = watch.stop()
    assert rc == 0
    assert judged.verdict("hung") == "unresponsive"
    assert judged.verdict("busy") == "busy"
    hung_probe = judged.get("llmhealth_backend_probe_duration_seconds", backend="hung")
    assert hung_probe is not None and hung_probe >= 2.9

    assert "busy" in [verdict for _, verdict, _, _ in unjudged], (
        "the busy backend was never judged while the hung one was out"
    )
    # A backend whose read is still out keeps its ledger state on the page meanwhile.
    assert {(state, serving) for _, _, state, serving in unjudged} == {("healthy", 1.0)}
    cycles = sorted({stamp for stamp, _, _, _ in unjudged})
    assert len(cycles) >= 3, f"only {len(cycles)} cycles completed during the 3 s read"
    gaps = [later - earlier for earlier, later in itertools.pairwise(cycles)]
    # Waiting on the hung read would open a gap of about 3 s; one wait is 0.5 s.
    assert max(gaps) < 2.0, f"cycles {gaps} apart with a wait of {WAIT} s"


@pytest.mark.slow
def test_a_wedged_backend_goes_dead_and_one_with_a_restart_command_is_restarted(
    entry_point: str, urls: Urls, tmp_path: Path
) -> None:
    marker = tmp_path / "restarted"
    config = write_config(
        tmp_path / "fleet.toml",
        fleet_config(
            [
                {"name": "busy", "url": urls.busy},
                {"name": "wedge-a", "url": urls.wedge_a},
                {"name": "wedge-b", "url": urls.wedge_b, "restart": touch_command(marker)},
            ]
        ),
    )

    def settled(page: Page) -> bool:
        restarts = page.counts("llmhealth_backend_restarts", "outcome")
        return (
            page.state("wedge-a") == "dead"
            and page.state("wedge-b") == "restarting"
            and restarts.get(("wedge-b", "ok"), 0) >= 1
        )

    with watching(entry_point, config, tmp_path / "state.json") as watch:
        page = watch.until("wedge-a dead and wedge-b restarting", settled)
        watch.logged("wedge-b: restart")
        rc, _ = watch.stop()
        log = watch.stderr()
    assert rc == 0
    assert marker.exists(), "the restart command did not run"
    assert page.verdict("wedge-a") == page.verdict("wedge-b") == "wedged"
    assert page.state("busy") == "healthy"
    assert page.get("llmhealth_backend_serving", backend="wedge-a") == 0.0
    assert page.get("llmhealth_backend_serving", backend="wedge-b") == 0.0
    assert page.get("llmhealth_fleet_serving_backends") == 1.0
    epoch = page.get("llmhealth_fleet_membership_epoch")
    assert epoch is not None and epoch >= 1
    # One restart. A backend with a command has its counters from the start, at 0; one
    # without a command has none, and stays DEAD.
    assert page.counts("llmhealth_backend_restarts", "outcome") == {
        ("wedge-b", "ok"): 1.0,
        ("wedge-b", "failed"): 0.0,
        ("wedge-b", "retired"): 0.0,
    }
    assert "wedge-a: healthy -> dead: wedged: " in log


@pytest.mark.slow
def test_a_restart_whose_backend_never_came_back_counts_as_failed_for_the_alert(
    entry_point: str, urls: Urls, tmp_path: Path
) -> None:
    """The command exits 0 (`systemctl restart` does at once) and the server never comes
    up: the startup grace fails the restart, and LLMHealthRestartsFailing counts
    ``outcome="failed"``. Before, every such restart was counted ``ok``, so a server that
    dies at each start never raised the alert meant for failing restarts."""
    marker = tmp_path / "restarted"
    config = write_config(
        tmp_path / "fleet.toml",
        fleet_config([{"name": "wedge", "url": urls.wedge_b, "restart": touch_command(marker)}])
        + '\n[policy]\nstartup_grace = "1s"\ncooldown = "1s"\ncooldown_max = "1s"\n',
    )
    audit = tmp_path / "audit.jsonl"

    def expired() -> int:
        lines = audit.read_text().splitlines() if audit.exists() else []
        return sum(json.loads(line)["event"] == "startup_expired" for line in lines)

    with watching(entry_point, config, tmp_path / "state.json") as watch:
        page = watch.until("a restart", lambda p: p.state("wedge") == "restarting")
        deadline = time.monotonic() + PATIENCE
        while expired() < 1:
            if time.monotonic() > deadline:
                raise NotObservedError(f"no startup_expired; stderr:\n{watch.stderr()}")
            time.sleep(POLL)
        page = watch.next_cycle(page)
        rc, _ = watch.stop()
        log = watch.stderr()
    assert rc == 0
    assert "restart failed: no new process within the startup grace" in log
    assert page.counts("llmhealth_backend_restarts", "outcome")[("wedge", "failed")] >= 1


@pytest.mark.slow
def test_a_dead_backend_left_alone_is_audited_once_not_once_per_cycle(
    entry_point: str, urls: Urls, tmp_path: Path
) -> None:
    config = write_config(
        tmp_path / "fleet.toml",
        fleet_config([{"name": "busy", "url": urls.busy}, {"name": "wedge", "url": urls.wedge_a}]),
    )
    with watching(entry_point, config, tmp_path / "state.json") as watch:
        page = watch.until("wedge dead", lambda p: p.state("wedge") == "dead")
        for _ in range(4):
            page = watch.next_cycle(page)
        rc, _ = watch.stop()
    assert rc == 0
    entries = [json.loads(line) for line in (tmp_path / "audit.jsonl").read_text().splitlines()]
    about = [(e["event"], e["reason"]) for e in entries if e["backend"] == "wedge"]
    assert about[0][0] == "wedge_proven"
    skipped = [reason for event, reason in about if event == "restart_skipped"]
    assert len(set(skipped)) == 1, "one reason: it has no restart command"
    assert len(skipped) == 1, f"the same decision written {len(skipped)} times in 5 cycles"


@pytest.mark.slow
def test_a_backend_whose_metrics_hang_comes_back_in_place_under_watch(
    entry_point: str, tmp_path: Path
) -> None:
    """Condemned by doubt, then the same process proves itself: no restart, no operator."""
    with running_simulator(["idle"]) as own:
        url = own.urls[0]
        config = write_config(
            tmp_path / "fleet.toml", fleet_config([{"name": "paused", "url": url}])
        )

        def hang(value: bool) -> None:
            reply = httpx.post(f"{url}/sim/metrics", json={"hang": value}, timeout=2.0)
            assert reply.json() == {"metrics_hang": value}

        with watching(entry_point, config, tmp_path / "state.json") as watch:
            watch.until("paused seen idle", lambda p: p.verdict("paused") == "idle")
            hang(True)
            watch.until("paused dead", lambda p: p.state("paused") == "dead")
            hang(False)
            page = watch.until("paused serving again", lambda p: p.state("paused") == "healthy")
            rc, _ = watch.stop()
        stats = httpx.get(f"{url}/sim/stats", timeout=2.0).json()
    assert rc == 0
    assert stats["restarts"] == 0
    assert page.get("llmhealth_backend_in_place_recoveries", backend="paused") == 1.0
    entries = [json.loads(line) for line in (tmp_path / "audit.jsonl").read_text().splitlines()]
    moves = [(e["from"], e["to"]) for e in entries if e["backend"] == "paused" and "from" in e]
    assert ("dead", "stale") in moves and moves[-1] == ("stale", "healthy")
    (back,) = [e for e in entries if (e.get("from"), e.get("to")) == ("dead", "stale")]
    assert back["reason"].startswith("same process, back after ")


# --- signals ------------------------------------------------------------------------------


@pytest.mark.slow  # 3.4 s a loop: a daemon reloaded twice
@pytest.mark.usefixtures("each_loop")
def test_sighup_loads_a_good_config_and_refuses_a_bad_one_keeping_the_old(
    entry_point: str, urls: Urls, tmp_path: Path
) -> None:
    path = tmp_path / "fleet.toml"
    write_config(path, fleet_config([{"name": "busy", "url": urls.busy}]))
    with watching(entry_point, path, tmp_path / "state.json") as watch:
        watch.until("a verdict on busy", lambda p: p.verdict("busy") == "busy")

        two = [{"name": "busy", "url": urls.busy}, {"name": "newcomer", "url": urls.idle}]
        write_config(path, fleet_config(two))
        watch.signal(signal.SIGHUP)
        added = watch.until(
            "the added backend's series",
            lambda p: p.verdict("newcomer") == "idle" and p.state("newcomer") == "healthy",
        )
        assert "config reloaded: 2 targets" in watch.stderr()

        three = [*two, {"name": "never", "url": urls.busy2}]
        write_config(path, "colour = 'blue'\n" + fleet_config(three))
        watch.signal(signal.SIGHUP)
        log = watch.logged("reload refused")
        after = watch.next_cycle(watch.next_cycle(added))
        rc, _ = watch.stop()
    assert rc == 0
    refusal = next(line for line in log.splitlines() if "reload refused" in line)
    assert "colour" in refusal and str(path) in refusal
    # Still running the old config: the two backends, not the third.
    shown = {s.labels["backend"] for s in after.samples("llmhealth_backend_verdict")}
    assert shown == {"busy", "newcomer"}
    assert after.verdict("newcomer") == "idle"


@pytest.mark.slow
def test_sighup_changing_the_configs_state_is_taken_when_state_is_given_on_the_command_line(
    entry_point: str, urls: Urls, tmp_path: Path
) -> None:
    """`--state` decides where the ledger lives, whatever the config's `state` says: a
    reload that changed only that key was refused as moving the ledger, and every other
    change in it (a backend added) was lost with it."""
    path = tmp_path / "fleet.toml"
    write_config(path, fleet_config([{"name": "busy", "url": urls.busy}]))
    with watching(entry_point, path, tmp_path / "state.json") as watch:
        watch.until("a verdict on busy", lambda p: p.verdict("busy") == "busy")
        two = [{"name": "busy", "url": urls.busy}, {"name": "newcomer", "url": urls.idle}]
        elsewhere = tmp_path / "elsewhere" / "state.json"
        write_config(path, f"state = {json.dumps(str(elsewhere))}\n" + fleet_config(two))
        watch.signal(signal.SIGHUP)
        watch.until("the added backend's verdict", lambda p: p.verdict("newcomer") == "idle")
        rc, _ = watch.stop()
        log = watch.stderr()
    assert rc == 0
    assert "reload refused" not in log and "config reloaded: 2 targets" in log
    saved = json.loads((tmp_path / "state.json").read_text())
    assert {b["name"] for b in saved["ledger"]["backends"]} == {"busy", "newcomer"}
    assert not elsewhere.parent.exists()


@pytest.mark.slow
def test_sighup_that_drops_a_backend_forgets_it_aloud_and_an_empty_config_is_refused(
    entry_point: str, urls: Urls, tmp_path: Path
) -> None:
    """The dropped backend leaves /metrics (a frozen error counter kept alerts firing), the
    log and the audit trail say it was forgotten, and an empty file, refused at start, is
    refused on reload too: it would forget every retirement and restart budget."""
    path = tmp_path / "fleet.toml"
    both = [{"name": "busy", "url": urls.busy}, {"name": "gone", "url": REFUSED_URL}]
    write_config(path, fleet_config(both))
    with watching(entry_point, path, tmp_path / "state.json") as watch:
        watch.until(
            "an error counted against gone",
            lambda p: (
                p.get("llmhealth_backend_probe_errors", backend="gone", kind="down") is not None
            ),
        )
        write_config(path, fleet_config(both[:1]))
        watch.signal(signal.SIGHUP)
        watch.logged("gone: no longer configured; forgotten (")
        after = watch.next_cycle(watch.until("reloaded", lambda p: p.verdict("gone") is None))
        path.write_text("")
        watch.signal(signal.SIGHUP)
        log = watch.logged("reload refused")
        still = watch.next_cycle(after)
        rc, _ = watch.stop()
    assert rc == 0
    assert 'backend="gone"' not in after.text
    assert "nothing to watch" in next(line for line in log.splitlines() if "reload refused" in line)
    assert still.verdict("busy") == "busy"
    entries = [json.loads(line) for line in (tmp_path / "audit.jsonl").read_text().splitlines()]
    assert [(e["backend"], e["event"]) for e in entries if e["event"] == "forgotten"] == [
        ("gone", "forgotten")
    ]


@pytest.mark.slow
def test_sighup_onto_a_fifo_or_an_oversize_file_is_refused_and_the_loop_goes_on(
    entry_point: str, urls: Urls, tmp_path: Path
) -> None:
    """A FIFO blocked the reload, on the loop's thread, until a writer came: no cycle, no
    SIGTERM. Both are refused at once, the running config kept."""
    path = tmp_path / "fleet.toml"
    write_config(path, fleet_config([{"name": "busy", "url": urls.busy}]))
    with watching(entry_point, path, tmp_path / "state.json") as watch:
        first = watch.until("a verdict on busy", lambda p: p.verdict("busy") == "busy")
        path.unlink()
        os.mkfifo(path)
        watch.signal(signal.SIGHUP)
        watch.logged(f"reload refused, keeping the running config: {path}: cannot read: not a")
        after_fifo = watch.next_cycle(watch.next_cycle(first), timeout=10)
        path.unlink()
        write_config(path, "#" * (config_module.MAX_CONFIG_BYTES + 1))
        watch.signal(signal.SIGHUP)
        log = watch.logged(f"{path}: larger than")
        after = watch.next_cycle(watch.next_cycle(after_fifo), timeout=10)
        rc, _ = watch.stop()
    assert rc == 0
    assert log.count("reload refused") == 2
    assert after.verdict("busy") == "busy"


@pytest.mark.slow
def test_sighup_with_a_config_that_names_a_command_line_backend_again_is_refused(
    entry_point: str, urls: Urls, tmp_path: Path
) -> None:
    path = tmp_path / "fleet.toml"
    write_config(path, fleet_config([{"name": "busy", "url": urls.busy}]))
    bare = urls.idle.removeprefix("http://")  # a bare URL's backend is named host:port
    with watching(entry_point, path, tmp_path / "state.json", urls.idle) as watch:
        first = watch.until("a verdict on both", lambda p: p.verdict(bare) == "idle")
        twice = [{"name": "busy", "url": urls.busy}, {"name": bare, "url": urls.busy2}]
        write_config(path, fleet_config(twice))
        watch.signal(signal.SIGHUP)
        log = watch.logged("reload refused")
        after = watch.next_cycle(watch.next_cycle(first))
        rc, _ = watch.stop()
    assert rc == 0
    refusal = next(line for line in log.splitlines() if "reload refused" in line)
    assert "named twice" in refusal
    assert after.verdict(bare) == "idle"  # still the command line's backend, unchanged


def unwritable_audit(tmp_path: Path, backends: list[dict[str, object]]) -> Path:
    """A config whose audit log cannot be opened (its directory is a file; root writes any
    file), over ``backends`` and one that is down, so every settle has records to write."""
    not_a_directory = tmp_path / "not-a-directory"
    not_a_directory.write_text("")
    where = not_a_directory / "audit.jsonl"
    down = {"name": "down", "url": REFUSED_URL}
    return write_config(
        tmp_path / "fleet.toml",
        f"audit_log = {toml_value(str(where))}\n" + fleet_config([*backends, down]),
    )


@pytest.mark.slow
def test_an_audit_log_that_cannot_be_written_skips_the_cycle_and_the_daemon_goes_on(
    entry_point: str, urls: Urls, tmp_path: Path
) -> None:
    # The audit records of a settle go first, then the state that follows from them: when
    # they cannot be written nothing is saved, as when the state cannot be. The daemon
    # exited instead, and under systemd a full disk became a restart loop.
    config = unwritable_audit(tmp_path, [{"name": "busy", "url": urls.busy}])
    state = tmp_path / "state.json"
    with watching(entry_point, config, state) as watch:
        watch.logged("cycle skipped")
        deadline = time.monotonic() + PATIENCE
        while watch.stderr().count("cycle skipped") < 3:  # each settle tries again
            assert time.monotonic() < deadline, watch.stderr()
            time.sleep(POLL)
        assert watch.scrape() is not None  # its page still answers
        assert "cannot open the audit log" in watch.stderr()
        rc, _ = watch.stop()
    assert rc == 0
    assert not state.exists()  # nothing saved ahead of its records


@pytest.mark.slow
def test_a_daemon_whose_first_settles_cannot_be_saved_still_tells_systemd_it_is_ready(
    entry_point: str, urls: Urls, tmp_path: Path
) -> None:
    # It probes, serves its page and routes all the same; READY=1 only after a saved
    # settle let systemd's start timeout restart it in a loop while the disk was full.
    config = unwritable_audit(tmp_path, [])
    address = str(tmp_path / "notify.sock")
    messages: list[list[str]] = []
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind(address)
        sock.settimeout(PATIENCE)
        with watching(
            entry_point, config, tmp_path / "state.json", env={"NOTIFY_SOCKET": address}
        ) as watch:
            while sum("WATCHDOG=1" in m for m in messages) < 2:
                messages.append(sock.recv(4096).decode().split("\n"))
            rc, _ = watch.stop()
    assert rc == 0
    assert messages[0][0] == "READY=1", messages
    assert messages[0][1].startswith("STATUS=state unusable: ")
    assert sum("READY=1" in m for m in messages) == 1


@pytest.mark.slow
def test_watch_on_bare_urls_keeps_no_state_and_leaves_the_default_state_file_alone(
    entry_point: str, urls: Urls, tmp_path: Path
) -> None:
    # For root the default state file is the service's: a settle over a URL given by hand
    # would have dropped every other backend's record from it.
    home = tmp_path / "service"
    env = {"STATE_DIRECTORY": str(home)}
    service = subprocess.run(
        [entry_point, "check", urls.busy, "--state", str(home / "state.json"), "--wait", "0.2"],
        capture_output=True,
        timeout=60,
        check=False,
    )
    assert service.returncode == 0, service.stderr
    before = {path.name: path.read_bytes() for path in home.iterdir()}
    assert "state.json" in before
    bare = urls.idle.removeprefix("http://")
    with watching(entry_point, None, None, urls.idle, env=env) as watch:
        page = watch.until("the idle backend proven", lambda p: p.state(bare) == "healthy")
        for _ in range(2):
            page = watch.next_cycle(page)
        rc, _ = watch.stop()
    assert rc == 0
    assert {path.name: path.read_bytes() for path in home.iterdir()} == before


@pytest.mark.slow  # the settle gives up on the lock after its 10 s
def test_sigterm_while_a_settle_waits_for_a_held_lock_still_exits_0(
    entry_point: str, urls: Urls, tmp_path: Path
) -> None:
    """The settle fails (the lock stays held) while the daemon waits for it to stop: that
    failure is heard like any skipped cycle's, not raised out of the loop as exit 3."""
    config = write_config(
        tmp_path / "fleet.toml", fleet_config([{"name": "idle", "url": urls.idle}])
    )
    state = tmp_path / "state.json"
    with watching(entry_point, config, state) as watch:
        page = watch.until("idle judged", lambda p: p.verdict("idle") == "idle")
        descriptor = os.open(state.with_name("state.json.lock"), os.O_RDWR)
        try:
            fcntl.flock(descriptor, fcntl.LOCK_EX)
            settled = watch.stderr().count("settled in")
            time.sleep(3.0)  # past the wait: the next settle is waiting for the lock
            assert watch.stderr().count("settled in") == settled, "no settle got the lock"
            rc, _ = watch.stop(timeout=STOP_BOUND + 15.0)
        finally:
            os.close(descriptor)
        log = watch.stderr()
    assert page.verdict("idle") == "idle"
    assert rc == 0, log
    # The lock file's PID note was the daemon's own, left from its last settle; it goes
    # with each hold now, so a holder that writes none is not taken for the daemon.
    assert "is locked by a process that is not llmhealth" in log


@pytest.mark.slow
@pytest.mark.usefixtures("each_loop")
def test_sigterm_exits_0_promptly_and_leaves_a_state_file_that_status_reads(
    entry_point: str, urls: Urls, tmp_path: Path
) -> None:
    config = write_config(
        tmp_path / "fleet.toml",
        fleet_config(
            [{"name": "busy", "url": urls.busy}, {"name": "hung", "url": urls.hang}],
            timeout="1h",  # the longest read there is: hung's never ends while the test runs
        ),
    )
    state = tmp_path / "state.json"
    with watching(entry_point, config, state) as watch:
        page = watch.until("two cycles with busy judged", lambda p: p.verdict("busy") == "busy")
        # hung's first read is still out, and stays out for an hour: a daemon that waited
        # for it would not exit (the bound only ends such a hung test).
        rc, _ = watch.stop(timeout=PATIENCE)
        log = watch.stderr()
    assert page.verdict("hung") is None, "hung's read ended: it was never outstanding"
    assert rc == 0
    assert log.rstrip().endswith("stopped")

    document = json.loads(state.read_text())
    saved = {b["name"]: b["state"] for b in document["ledger"]["backends"]}
    assert saved.keys() == {"busy", "hung"}
    assert saved["busy"] == "healthy"
    assert not list(tmp_path.glob(".state.json.*"))  # no temporary file left behind

    status = subprocess.run(
        [entry_point, "status", "--state", str(state), "--format", "json"],
        capture_output=True,
        text=True,
        timeout=30.0,
        check=False,
    )
    assert status.returncode in {0, 1, 2}, status.stderr
    shown = json.loads(status.stdout)
    assert shown["exit_code"] == status.returncode
    assert {b["name"]: b["state"] for b in shown["backends"]} == saved


@pytest.mark.slow
@pytest.mark.usefixtures("each_loop")
def test_systemd_hears_ready_after_the_first_cycle_then_watchdogs_then_stopping(
    entry_point: str, urls: Urls, tmp_path: Path
) -> None:
    config = write_config(tmp_path / "fleet.toml", fleet_config([{"name": "b", "url": urls.busy}]))
    state = tmp_path / "state.json"
    address = str(tmp_path / "notify.sock")
    assert len(address) < 100, "a unix socket path must fit in sun_path"
    messages: list[list[str]] = []
    state_when_ready: bool | None = None
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind(address)

        def receive(until: Callable[[], bool], timeout: float) -> None:
            deadline = time.monotonic() + timeout
            while not until():
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise NotObservedError(f"systemd heard only {messages}")
                sock.settimeout(remaining)
                try:
                    data = sock.recv(4096)
                except TimeoutError:
                    continue
                messages.append(data.decode().split("\n"))

        with watching(entry_point, config, state, env={"NOTIFY_SOCKET": address}) as watch:
            receive(lambda: bool(messages), PATIENCE)
            state_when_ready = state.exists()
            receive(lambda: sum("WATCHDOG=1" in m for m in messages) >= 3, PATIENCE)
            rc, _ = watch.stop()
            receive(lambda: "STOPPING=1" in messages[-1], STOP_BOUND)
    assert rc == 0
    first = messages[0]
    assert first[0] == "READY=1"
    assert first[1].startswith("STATUS=1 serving (min 1), epoch 0")
    assert state_when_ready, "READY=1 came before the first cycle had saved the state"
    assert sum("READY=1" in m for m in messages) == 1
    watchdogs = [m for m in messages if "WATCHDOG=1" in m]
    assert all(len(m) == 2 and m[1].startswith("STATUS=") for m in watchdogs)
    assert messages[-1] == ["STOPPING=1"]


@pytest.mark.slow
def test_the_watchdog_hears_from_a_daemon_waiting_longer_than_its_period(
    entry_point: str, urls: Urls, tmp_path: Path
) -> None:
    """WATCHDOG=1 came only after each cycle: a `wait` past WatchdogSec (35 s against the
    unit's 30 s) had systemd kill the daemon every cycle. Here the period is 0.2 s
    against a wait of 0.5 s, and it is told between cycles as well, on its own."""
    config = write_config(tmp_path / "fleet.toml", fleet_config([{"name": "b", "url": urls.busy}]))
    address = str(tmp_path / "notify.sock")
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind(address)
        sock.settimeout(PATIENCE)
        env = {"NOTIFY_SOCKET": address, "WATCHDOG_USEC": "200000"}
        with watching(entry_point, config, tmp_path / "state.json", env=env) as watch:
            deadline = time.monotonic() + PATIENCE
            while sock.recv(4096) != b"WATCHDOG=1":  # alone: not a cycle's, with its STATUS
                assert time.monotonic() < deadline, watch.stderr()
            rc, _ = watch.stop()
    assert rc == 0


def test_the_watchdog_hears_from_a_daemon_as_its_wait_ends_not_only_half_a_period_before(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The wait's last WATCHDOG=1 came up to half a period before the cycle (none at all
    in a wait shorter than that), so a settle had only WatchdogSec less that much: with
    a 15 s wait against the unit's 30 s, a settle that waited its 10 s for the state lock
    (or three etcd calls of 5 s with etcd away) and then did its work was killed. The
    wait's end is the loop turning too: systemd hears it, and the settle gets a period."""
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    config = config_module.Config(timeout=1.0, answer_timeout=1.0, read_workers=1)
    daemon = in_process(lambda: (config, [Target("b", REFUSED_URL)]), tmp_path, 1.0)
    told: list[tuple[float, tuple[str, ...]]] = []

    class Heard:
        def send(self, *fields: str) -> None:
            told.append((time.monotonic(), fields))

    monkeypatch.setattr(daemon, "_notifier", Heard())
    monkeypatch.setattr(daemon, "_watchdog_every", 0.05)
    daemon._ready_told = True

    async def wait() -> float:
        due = time.monotonic() + 0.2
        assert await daemon._wait_until(due) == due
        return due

    due = asyncio.run(wait())
    assert told, "no WATCHDOG=1 while waiting"
    assert all(fields == ("WATCHDOG=1",) for _, fields in told)
    at, _ = told[-1]
    assert at >= due, "the last WATCHDOG=1 came before the wait ended"


@pytest.mark.parametrize(
    ("environment", "expected"),
    [
        ({"WATCHDOG_USEC": "30000000"}, 15.0),
        ({"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": "42"}, 15.0),
        ({"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": "43"}, None),  # another process's
        ({"WATCHDOG_USEC": "soon"}, None),
        ({"WATCHDOG_USEC": "0"}, None),
        ({}, None),
    ],
)
def test_the_watchdog_period_is_systemds_for_this_process_only(
    environment: dict[str, str], expected: float | None
) -> None:
    assert daemon_module.watchdog_interval(environment, 42) == expected


# --- connections the server closes -----------------------------------------------------------


class DroppingBackend:
    """A busy simulated vLLM that answers the first request on each connection and closes
    the connection, unanswered, when the next request arrives on it.

    That is what a client sees when it reuses a kept-alive connection just as the server's
    keep-alive timeout closes it. uvicorn, and so vLLM, closes idle connections after 5 s,
    as `llmhealth simulate` does; the default wait is 5 s, so `watch` reuses each
    connection right at that moment. Here the race is lost every time, at any wait.
    """

    def __init__(self) -> None:
        template = importlib.resources.files("llmhealth").joinpath(TEMPLATE_NAME)
        self._text = MetricsText(
            template.read_text("utf-8"), engines=1, model="tiny", multiproc=False
        )
        self._model = SimBackend(parse_mode("busy"), SimConfig(), born=time.time())
        self._lock = threading.Lock()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.settimeout(0.2)
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self.answered = 0
        self.dropped = 0
        self.url = f"http://127.0.0.1:{self._listener.getsockname()[1]}"

    def __enter__(self) -> DroppingBackend:
        self._spawn(self._accept)
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(STOP_BOUND)
        self._listener.close()

    def _spawn(self, target: Callable[..., None], *args: object) -> None:
        thread = threading.Thread(target=target, args=args, daemon=True)
        self._threads.append(thread)
        thread.start()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                connection, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            self._spawn(self._serve, connection)

    def _request(self, connection: socket.socket) -> bool:
        """Read one request head (GETs only); False when the peer closed or we stop."""
        data = b""
        while b"\r\n\r\n" not in data:
            if self._stop.is_set():
                return False
            try:
                chunk = connection.recv(65536)
            except TimeoutError:
                continue
            except OSError:
                return False
            if not chunk:
                return False
            data += chunk
        return True

    def _serve(self, connection: socket.socket) -> None:
        connection.settimeout(0.2)
        with connection:
            if not self._request(connection):
                return
            with self._lock:
                body = self._text.render(self._model.observe(time.time())).encode()
                self.answered += 1
            head = (
                "HTTP/1.1 200 OK\r\ncontent-type: text/plain; version=0.0.4\r\n"
                f"content-length: {len(body)}\r\n\r\n"
            )
            connection.sendall(head.encode() + body)
            if self._request(connection):
                with self._lock:
                    self.dropped += 1
            # Leaving the block closes the connection without a word.

    @property
    def reads(self) -> int:
        with self._lock:
            return self.answered + self.dropped


@pytest.mark.slow
def test_a_kept_alive_connection_closed_by_the_server_is_retried_not_judged_down(
    entry_point: str, tmp_path: Path
) -> None:
    with DroppingBackend() as backend:
        config = write_config(
            tmp_path / "fleet.toml", fleet_config([{"name": "busy", "url": backend.url}])
        )
        with watching(entry_point, config, tmp_path / "state.json") as watch:
            page = watch.until("five reads", lambda p: backend.reads >= 5 and p.cycled)
            page = watch.next_cycle(page)
            rc, _ = watch.stop()
            log = watch.stderr()
    assert rc == 0
    if backend.dropped == 0:
        return  # the daemon never reused a connection: nothing could go wrong
    assert page.counts("llmhealth_backend_probe_errors", "kind") == {}, log
    assert "-> suspect" not in log
    assert page.verdict("busy") == "busy"


# --- the serving file and its hook ----------------------------------------------------------


def poll_file(path: Path, done: Callable[[str], bool], timeout: float = PATIENCE) -> list[str]:
    """Every distinct content `path` had, polled until `done` holds for the latest one."""
    seen: list[str] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            text = path.read_text()
        except FileNotFoundError:
            text = None
        if text is not None and (not seen or seen[-1] != text):
            seen.append(text)
            if done(text):
                return seen
        time.sleep(POLL / 2)
    raise NotObservedError(f"{path} never reached what was expected; contents seen: {seen}")


def nginx_servers(text: str) -> set[str]:
    return {line for line in text.splitlines() if not line.startswith("#")}


def server_line(url: str) -> str:
    return f"server {url.removeprefix('http://')};"


def settled_by_hand(
    tmp_path: Path,
    fleet: Callable[[], list[Target]],
    serving: Path | None = None,
    *,
    config: config_module.Config | None = None,
    router: Router | None = None,
) -> Daemon:
    """A daemon over ``fleet()`` (read again at each reload), its state in ``tmp_path``,
    writing ``serving`` if given: settled and reloaded by hand, no loop running."""
    return a_daemon(
        lambda: (config or config_module.Config(), fleet()),
        StateFile(tmp_path / "state.json"),
        serving_file=serving,
        router=router,
    )


def serving_names(serving: Path) -> list[str]:
    """The names a JSON serving file lists, in its order."""
    return [entry["name"] for entry in json.loads(serving.read_text())["serving"]]


@pytest.mark.slow
def test_an_nginx_serving_file_lists_exactly_the_serving_backends_and_the_hook_runs(
    entry_point: str, urls: Urls, tmp_path: Path
) -> None:
    hook_log = tmp_path / "hook.log"
    config = write_config(
        tmp_path / "fleet.toml",
        fleet_config(
            [
                {"name": "busy", "url": urls.busy, "api_key_env": "BUSY_KEY"},
                {"name": "idle", "url": urls.idle},
                {"name": "wedge", "url": urls.wedge_a},
            ],
            on_serving_change=append_command(hook_log),
        ),
    )
    serving = tmp_path / "upstream.conf"
    survivors = {server_line(urls.busy), server_line(urls.idle)}
    with watching(
        entry_point,
        config,
        tmp_path / "state.json",
        "--serving-file",
        str(serving),
        env={"BUSY_KEY": "s3cret"},  # the hook must not get it
    ) as watch:
        seen = poll_file(serving, lambda text: nginx_servers(text) == survivors)
        page = watch.until("wedge dead", lambda p: p.state("wedge") == "dead")
        hooks = poll_file(hook_log, lambda text: text.count("changed") >= 2)
        watch.next_cycle(watch.next_cycle(page))
        rc, _ = watch.stop()
    assert rc == 0
    assert nginx_servers(seen[0]) == {*survivors, server_line(urls.wedge_a)}
    assert seen[0].startswith("# ")
    assert len(seen) == 2, f"the file changed more often than the serving set: {seen}"
    assert hooks[-1] == hook_log.read_text() == "changed\nchanged\n"  # once per change
    assert not list(tmp_path.glob(".upstream.conf*"))


@pytest.mark.slow
def test_a_key_variable_a_reload_dropped_reaches_neither_the_hook_nor_a_restart_command(
    entry_point: str, urls: Urls, tmp_path: Path
) -> None:
    """The reload leaves BUSY_KEY in the daemon's environment though no backend names it
    any more: the hook and the restart command that run after it must still go without."""
    hook_log, restart_log = tmp_path / "hook.log", tmp_path / "restart.log"
    path = tmp_path / "fleet.toml"
    hook = append_command(hook_log)
    idle = {"name": "idle", "url": urls.idle}
    keyed = {"name": "busy", "url": urls.busy, "api_key_env": "BUSY_KEY"}
    write_config(path, fleet_config([keyed, idle], on_serving_change=hook))
    with watching(
        entry_point,
        path,
        tmp_path / "state.json",
        "--serving-file",
        str(tmp_path / "upstream.conf"),
        env={"BUSY_KEY": "s3cret"},
    ) as watch:
        poll_file(hook_log, lambda text: text.count("changed") >= 1)
        # busy goes (the serving set changes, so the hook runs again), and a wedged
        # backend comes, to be restarted.
        wedge = {"name": "wedge", "url": urls.wedge_a, "restart": append_command(restart_log)}
        write_config(path, fleet_config([idle, wedge], on_serving_change=hook))
        watch.signal(signal.SIGHUP)
        watch.logged("config reloaded")
        restarted = poll_file(restart_log, lambda text: "changed" in text)
        hooks = poll_file(hook_log, lambda text: text.count("changed") >= 2)
        rc, _ = watch.stop()
    assert rc == 0
    assert "KEY LEAKED" not in hooks[-1] + hook_log.read_text()
    assert restarted[-1] == "changed\n"


@pytest.mark.slow
def test_a_json_serving_file_lists_the_serving_backends_by_name_and_url(
    entry_point: str, urls: Urls, tmp_path: Path
) -> None:
    config = write_config(
        tmp_path / "fleet.toml",
        fleet_config([{"name": "busy", "url": urls.busy}, {"name": "wedge", "url": urls.wedge_b}]),
    )
    serving = tmp_path / "serving.json"
    # The temp name an older version always used: a symlink planted there is not followed.
    victim = tmp_path / "victim"
    victim.write_text("untouched")
    (tmp_path / ".serving.json.tmp").symlink_to(victim)
    after = {"serving": [{"name": "busy", "url": urls.busy}]}
    with watching(
        entry_point, config, tmp_path / "state.json", "--serving-file", str(serving)
    ) as watch:
        seen = poll_file(serving, lambda text: json.loads(text) == after)
        rc, _ = watch.stop()
    assert rc == 0
    assert victim.read_text() == "untouched"
    assert not serving.is_symlink()
    assert serving.stat().st_mode & 0o777 == 0o644  # the balancer, another user, reads it
    first: dict[str, Any] = json.loads(seen[0])
    assert sorted(first["serving"], key=lambda entry: entry["name"]) == [
        {"name": "busy", "url": urls.busy},
        {"name": "wedge", "url": urls.wedge_b},
    ]


def test_the_serving_file_is_on_disk_before_it_is_renamed_into_place(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Renamed unsynced, a power loss could leave the nginx include empty: an upstream
    without servers, which nginx refuses, so the balancer did not come up at boot."""
    synced: list[str] = []
    real_fsync = os.fsync

    def fsync(descriptor: int) -> None:
        synced.append(os.readlink(f"/proc/self/fd/{descriptor}"))
        real_fsync(descriptor)

    monkeypatch.setattr(os, "fsync", fsync)
    serving = tmp_path / "upstream.conf"
    config = config_module.Config(timeout=1.0, answer_timeout=1.0, read_workers=1)
    daemon = in_process(lambda: (config, []), tmp_path, None, serving_file=serving)
    daemon._write_serving(("gpu0",), {"gpu0": "http://10.0.0.5:8000"})
    assert nginx_servers(serving.read_text()) == {"server 10.0.0.5:8000;"}
    assert [Path(name).name for name in synced if ".upstream.conf." in name], synced


def _watch_refused(
    entry_point: str, config: Path, *options: str
) -> subprocess.CompletedProcess[str]:
    """``watch`` with these options, which must refuse to start (exit 3)."""
    result = subprocess.run(
        [entry_point, "watch", "--config", str(config), "--listen", "off", *options],
        capture_output=True,
        text=True,
        timeout=PATIENCE,
        check=False,
        env=child_env(),
    )
    assert result.returncode == 3, result.stderr
    return result


@pytest.mark.parametrize("serving", ["state.json", "state.json.lock", "audit.jsonl", "linked"])
def test_a_serving_file_that_is_the_state_its_lock_or_the_audit_log_is_refused_at_start(
    entry_point: str, tmp_path: Path, serving: str
) -> None:
    # Each write of the serving list renames it over its path: over the state, the ledger
    # (here an operator's hold) was gone and every settle after it skipped as "not a file
    # llmhealth wrote"; over the lock or the audit log, the lock or the trail was.
    config = write_config(
        tmp_path / "fleet.toml", fleet_config([{"name": "gpu0", "url": "http://127.0.0.1:9"}])
    )
    state = tmp_path / "state.json"
    hold = ["hold", "gpu0", "--for", "1h", "--reason", "weight sync"]
    held = subprocess.run(
        [entry_point, *hold, "--config", str(config), "--state", str(state)],
        capture_output=True,
        text=True,
        timeout=PATIENCE,
        check=False,
    )
    assert held.returncode == 0, held.stderr
    (tmp_path / "linked").symlink_to(state)
    before = {path.name: path.read_bytes() for path in tmp_path.iterdir() if path.is_file()}
    result = _watch_refused(
        entry_point, config, "--state", str(state), "--serving-file", str(tmp_path / serving)
    )
    assert "is the state file, its lock or the audit log" in result.stderr
    assert {path.name: path.read_bytes() for path in tmp_path.iterdir() if path.is_file()} == before


def test_a_url_that_would_break_the_nginx_include_is_refused_at_start(
    entry_point: str, tmp_path: Path
) -> None:
    # It started and wrote "server [::1]x;}:9;" into the include: the upstream block
    # ended there, and the balancer's every reload failed on the file.
    config = write_config(
        tmp_path / "fleet.toml", fleet_config([{"name": "gpu0", "url": "http://[::1]x;}:9"}])
    )
    serving = tmp_path / "upstream.conf"
    result = _watch_refused(
        entry_point, config, "--state", str(tmp_path / "state.json"), "--serving-file", str(serving)
    )
    assert "more than a bracketed address and a port" in result.stderr
    assert not serving.exists()


def test_a_zoned_ipv6_backend_is_refused_at_start_and_reload_with_an_nginx_serving_file(
    entry_point: str, tmp_path: Path
) -> None:
    # It started and wrote "server [fe80::1%25lo]:9;": nginx's upstream parser takes no
    # zone ("invalid IPv6 address"), and the balancer's every reload failed on the file.
    zoned = fleet_config([{"name": "gpu0", "url": "http://[fe80::1%25lo]:9"}])
    config = write_config(tmp_path / "fleet.toml", zoned)
    serving = tmp_path / "upstream.conf"
    result = _watch_refused(
        entry_point, config, "--state", str(tmp_path / "state.json"), "--serving-file", str(serving)
    )
    assert "IPv6 zone, which nginx takes in no upstream server" in result.stderr
    assert not serving.exists()
    # On SIGHUP the same loader refuses it, the running config kept; a JSON file lists it.
    with pytest.raises(config_module.ConfigError, match="IPv6 zone"):
        cli._daemon_loader([], [], str(config), None, str(serving))()
    _, targets = cli._daemon_loader([], [], str(config), None, str(tmp_path / "serving.json"))()
    assert [target.url for target in targets] == ["http://[fe80::1%25lo]:9"]


def test_an_idn_host_is_written_into_the_nginx_include_as_requests_resolve_it(
    tmp_path: Path,
) -> None:
    # Written "server bücher.example:8000;": nginx looks the name up as written, finds no
    # such host, and refuses the whole file, failing every reload of the balancer.
    serving = tmp_path / "upstream.conf"
    config = config_module.Config(timeout=1.0, answer_timeout=1.0, read_workers=1)
    daemon = in_process(lambda: (config, []), tmp_path, None, serving_file=serving)
    daemon._write_serving(("gpu0",), {"gpu0": "https://Bücher.example"})
    assert nginx_servers(serving.read_text()) == {"server xn--bcher-kva.example:443;"}


@pytest.mark.parametrize("serving", ["fleet.toml", "linked"])
def test_a_serving_file_that_is_the_config_is_refused_at_start(
    entry_point: str, tmp_path: Path, serving: str
) -> None:
    # The first write of the serving list renamed it over the config: its backends gone,
    # and the next start or SIGHUP refused it. A cluster's daemon has no state file here.
    config = write_config(
        tmp_path / "fleet.toml", fleet_config([{"name": "gpu0", "url": "http://127.0.0.1:9"}])
    )
    (tmp_path / "linked").symlink_to(config)
    before = config.read_bytes()
    state = str(tmp_path / "state.json")
    result = _watch_refused(
        entry_point, config, "--state", state, "--serving-file", str(tmp_path / serving)
    )
    assert "is the config file" in result.stderr
    assert config.read_bytes() == before


@pytest.mark.slow
def test_a_serving_file_that_can_no_longer_be_written_is_reported_and_watching_goes_on(
    entry_point: str, urls: Urls, tmp_path: Path
) -> None:
    config = write_config(
        tmp_path / "fleet.toml",
        fleet_config([{"name": "busy", "url": urls.busy}, {"name": "wedge", "url": urls.wedge_a}]),
    )
    folder = tmp_path / "balancer"
    folder.mkdir()
    serving = folder / "upstream.conf"
    with watching(
        entry_point, config, tmp_path / "state.json", "--serving-file", str(serving)
    ) as watch:
        poll_file(serving, lambda text: "server " in text)
        shutil.rmtree(folder)  # gone, like an unmounted volume: the next write fails
        page = watch.until("wedge dead", lambda p: p.state("wedge") == "dead")
        log = watch.logged(f"cannot write the serving file {serving}")
        watch.next_cycle(watch.next_cycle(page))
        folder.mkdir()  # back: a later cycle writes what it could not
        written = poll_file(serving, lambda text: nginx_servers(text) == {server_line(urls.busy)})
        rc, _ = watch.stop()
    assert rc == 0
    assert len(written) == 1
    failure = next(line for line in log.splitlines() if "cannot write" in line)
    assert "No such file or directory" in failure


# --- the fleet stall watch -------------------------------------------------------------------


@pytest.mark.slow
def test_pending_work_with_no_finished_request_stalls_the_fleet_and_restarts_nothing(
    entry_point: str, urls: Urls, tmp_path: Path
) -> None:
    marker = tmp_path / "restarted"
    config = write_config(
        tmp_path / "fleet.toml",
        fleet_config(
            [{"name": "reader", "url": urls.prefill, "restart": touch_command(marker)}],
            stall_timeout="1s",
        ),
    )
    with watching(entry_point, config, tmp_path / "state.json") as watch:
        page = watch.until("a fleet stall", lambda p: p.get("llmhealth_fleet_stalled") == 1.0)
        log = watch.logged("fleet stall")
        rc, _ = watch.stop()
    assert rc == 0
    # Each backend alone is fine: its KV use moves, so it is busy, healthy and serving.
    assert page.verdict("reader") == "busy"
    assert page.state("reader") == "healthy"
    since = page.get("llmhealth_fleet_seconds_since_last_finished_request")
    assert since is not None and since >= 1.0
    assert "nothing is restarted" in log
    assert page.counts("llmhealth_backend_restarts", "outcome") == {
        ("reader", "ok"): 0.0,
        ("reader", "failed"): 0.0,
        ("reader", "retired"): 0.0,
    }
    assert "restart" not in log.replace("nothing is restarted", "")
    assert not marker.exists()


@pytest.mark.slow
def test_reads_that_fall_behind_the_wait_show_on_the_page_and_in_the_log(
    entry_point: str, urls: Urls, tmp_path: Path
) -> None:
    # The hung backend's reads each take the 2 s timeout, four waits. The median of two
    # targets is their mean, so the pair is read about 0.62 times per wait where the
    # probing tasks intend once: as a loop short of CPU would read them.
    config = busy_and_hung(urls, tmp_path, timeout="2s")

    def behind(page: Page) -> bool:
        pace = page.get("llmhealth_fleet_reads_per_wait")
        return pace is not None and 0.0 < pace < READS_KEEP_UP

    with watching(entry_point, config, tmp_path / "state.json") as watch:
        watch.until("reads behind the wait", behind)
        log = watch.logged("reads behind the wait")
        examined = watch.until(
            "the hung backend examined",
            lambda p: (p.get("llmhealth_backend_examinations", backend="hung") or 0.0) >= 1.0,
        )
        rc, _ = watch.stop()
    assert rc == 0
    line = next(line for line in log.splitlines() if "reads behind the wait" in line)
    pace = float(line.split("examined ", 1)[1].split(" times", 1)[0])
    assert 0.0 < pace < READS_KEEP_UP
    assert "llmhealth_backend_probe_duration_seconds" in line and "read_workers" in line
    # What the operator follows to the cause: the hung backend's examinations are slow.
    slow = examined.get("llmhealth_backend_probe_duration_seconds", backend="hung")
    assert slow is not None and slow >= 1.9
    busy = examined.get("llmhealth_backend_examinations", backend="busy")
    assert busy is not None and busy >= 1.0


# --- the daemon in this process ---------------------------------------------------------------


def _fast_daemon_over_one_busy_backend(urls: Urls, tmp_path: Path) -> Daemon:
    """A daemon reading one busy backend every 0.05 s, its log on stderr."""

    def load() -> tuple[config_module.Config, list[Target]]:
        return config_module.Config(timeout=1.0, answer_timeout=1.0), [Target("b", urls.busy)]

    return a_daemon(load, StateFile(tmp_path / "state.json"), wait=0.05)


def _restart_launched_after_a_hold(tmp_path: Path) -> tuple[Daemon, Path, list[CommandDone]]:
    """A settle issues a restart of "w" (RESTARTING saved, the state lock let go), an
    operator's hold is saved, and then the daemon launches the command: the daemon, the
    file the command would make, and what the daemon heard of it."""
    marker = tmp_path / "restarted"
    target = Target("w", REFUSED_URL)
    backend = config_module.Backend("w", REFUSED_URL, restart=("touch", str(marker)))
    config = config_module.Config(backends=(backend,))
    store, audit = StateFile(tmp_path / "state.json"), AuditLog(tmp_path / "audit.jsonl")
    wedge = Outcome(target, Verdict(VerdictKind.WEDGED, False, "wedged: steps 5→5→5"))
    settled = settle_fleet(
        store, config, {"w": REFUSED_URL}, lambda _record: [wedge], mode=Mode.ACT, audit=audit
    )
    [order] = settled.orders
    held = operate.hold(store, audit, config, "w", 3600, "weight sync")
    assert held.applied, held.message
    daemon = a_daemon(lambda: (config, [target]), store)

    async def launch() -> None:
        try:
            daemon._launch(order)
            await asyncio.wait(set(daemon._commands_running))
        finally:
            await daemon._reading.close()

    asyncio.run(launch())
    return daemon, marker, daemon._take_commands()


def test_a_hold_saved_after_the_settle_that_issued_a_restart_withdraws_its_command(
    tmp_path: Path,
) -> None:
    # watch saves a restart as issued (RESTARTING), lets go of the state lock, and only
    # then launches its command. An operator's hold waiting for that lock was saved in
    # between and answered as applied, and the command ran all the same; check looks at
    # the record again before a command for this very reason.
    _, marker, [done] = _restart_launched_after_a_hold(tmp_path)
    assert not marker.exists(), "the restart command ran though its backend was held"
    assert done.withdrawn and "on hold" in done.result.stderr, done


def test_a_restart_command_watch_had_no_thread_to_run_spends_no_attempt(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Out of threads (a pids limit), a restart command `watch` could not start is its own
    shortage, as one it had no descriptor for: held against the backend as a failed
    restart, a daemon at its limit spent each wedged backend's budget and retired it."""
    marker = tmp_path / "restarted"
    target = Target("w", REFUSED_URL)
    backend = config_module.Backend("w", REFUSED_URL, restart=("touch", str(marker)))
    config = config_module.Config(backends=(backend,))
    store = StateFile(tmp_path / "state.json")
    wedge = Outcome(target, Verdict(VerdictKind.WEDGED, False, "wedged: steps 5→5→5"))
    settled = settle_fleet(
        store, config, {"w": REFUSED_URL}, lambda _record: [wedge], mode=Mode.ACT, audit=None
    )
    [order] = settled.orders
    daemon = a_daemon(lambda: (config, [target]), store)
    real_start = threading.Thread.start

    def start(self: threading.Thread) -> None:
        if self.name == "llmhealth-cycle":
            raise RuntimeError("can't start new thread")
        real_start(self)

    async def launch() -> None:
        try:
            with monkeypatch.context() as patched:
                patched.setattr(threading.Thread, "start", start)
                daemon._launch(order)
        finally:
            await daemon._reading.close()

    asyncio.run(launch())
    [done] = daemon._take_commands()
    assert not marker.exists() and "no thread" in done.result.stderr, done
    heard = settle_fleet(
        store, config, {"w": REFUSED_URL}, lambda _record: [], mode=Mode.OFF, audit=None,
        commands=[done],
    )  # fmt: skip
    assert heard.record.ledger.state_of("w") is State.DEAD
    assert heard.record.ledger.snapshot("w", time.time()).restart_attempts == 0
    assert heard.record.restarts["w"].failures == 0  # its cooldown not doubled


def test_a_restart_command_watch_had_no_descriptor_to_start_starts_no_grace(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Nothing ran, as for a withdrawn order: its "end" must not start a startup grace
    on the steady clock, which kept the backend's restart before it (given back the
    ledger's latest again) under way, holding a concurrency slot, for another 15 min."""
    target = Target("w", REFUSED_URL)
    backend = config_module.Backend("w", REFUSED_URL, restart=("true",))
    config = config_module.Config(backends=(backend,))
    daemon = a_daemon(lambda: (config, [target]), StateFile(tmp_path / "state.json"))
    order = RestartOrder("w", REFUSED_URL, ("true",), 60.0, time.time(), "wedged", {})
    short = CommandResult(("true",), None, False, 0.0, "", "cannot run", own_shortage=True)
    monkeypatch.setattr(daemon_module, "_run_order", lambda _order: short)
    monkeypatch.setattr(daemon_module, "withdrawn_now", lambda *_args: None)

    async def launch() -> frozenset[str]:
        try:
            daemon._launch(order)
            await asyncio.wait(set(daemon._commands_running))
            return daemon._in_grace()
        finally:
            await daemon._reading.close()

    assert asyncio.run(launch()) == frozenset()
    [done] = daemon._take_commands()
    assert done.result.own_shortage, done


def test_a_reload_that_shortens_the_wait_forgets_each_targets_timing_until_its_next_read(
    tmp_path: Path,
) -> None:
    target = Target("b", REFUSED_URL)
    configs = [config_module.Config(wait=5.0), config_module.Config(wait=0.5)]
    daemon = a_daemon(lambda: (configs[0], [target]), StateFile(tmp_path / "state.json"))

    async def scenario() -> tuple[float | None, float | None]:
        # Two examinations heard under the 5 s wait: the average gap is about 5 s, one
        # wait. Kept after a reload to 0.5 s, it would read as ten waits: "behind"; and
        # the gap to the next examination still spans the old wait.
        daemon.hear(target, None, 0.01)
        daemon.hear(target, None, 0.01)
        configs.pop(0)
        daemon._reload_config()
        try:
            forgotten = daemon._reads_per_wait(time.monotonic())
            daemon.hear(target, None, 0.01)
            heard_at = daemon._state.probes["b"].heard_at
            assert heard_at is not None
            return forgotten, daemon._reads_per_wait(heard_at)
        finally:
            await daemon._reading.close()

    # No figure until the target is examined again, then one from the new wait alone.
    assert asyncio.run(scenario()) == (None, 1.0)


@pytest.mark.slow
def test_the_daemon_keeps_no_more_tasks_after_many_cycles_than_after_one(
    urls: Urls, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    daemon = _fast_daemon_over_one_busy_backend(urls, tmp_path)
    log = ""

    def cycles() -> int:
        nonlocal log
        log += capsys.readouterr().err
        found = re.findall(r"^cycle (\d+):", log, re.MULTILINE)
        return int(found[-1]) if found else 0

    async def scenario() -> tuple[int, int]:
        running = asyncio.create_task(daemon.run())
        deadline = time.monotonic() + 15.0
        while cycles() < 2:
            if time.monotonic() > deadline or running.done():
                raise NotObservedError(f"not enough cycles:\n{log}")
            await asyncio.sleep(POLL)
        early = len(asyncio.all_tasks())
        while cycles() < 30:
            if time.monotonic() > deadline or running.done():
                raise NotObservedError(f"not enough cycles:\n{log}")
            await asyncio.sleep(POLL)
        late = len(asyncio.all_tasks())
        daemon.stop()
        assert await asyncio.wait_for(running, STOP_BOUND) == 0
        return early, late

    early, late = asyncio.run(scenario())
    assert late <= early + 1, f"{early} tasks after 2 cycles, {late} after 30"


class MovedByOthers:
    """An idle vLLM whose engine someone else's requests move between any two reads: its
    generated-token counter is one higher at each read; the tiny requests it answers are
    counted."""

    def __init__(self, server: HTTPServer) -> None:
        captures = Path(__file__).parent.parent / "fixtures" / "vllm-0.32"
        self._text = (captures / "apifreeze-after.txt").read_text()
        self._series = 'vllm:generation_tokens_total{engine="0",model_name="tiny"} '
        assert self._text.count(self._series) == 1
        self._reads = 0
        self.completions = 0
        server.expect_request("/metrics").respond_with_handler(self._metrics)
        server.expect_request("/v1/models").respond_with_json(
            {"object": "list", "data": [{"id": "tiny", "object": "model"}]}
        )
        server.expect_request("/v1/completions", method="POST").respond_with_handler(self._complete)
        self.url = server.url_for("").rstrip("/")

    def _metrics(self, _request: Request) -> Response:
        self._reads += 1
        text = self._text.replace(f"{self._series}8000.0", f"{self._series}{8000 + self._reads}.0")
        return Response(text, content_type="text/plain; version=1.0.0; charset=utf-8")

    def _complete(self, _request: Request) -> Response:
        self.completions += 1
        answer = {"id": "cmpl-1", "object": "text_completion", "choices": [{"text": "!"}]}
        return Response(json.dumps(answer), content_type="application/json")


def _daemon_on_one(
    url: str, read_workers: int | None, tmp_path: Path
) -> tuple[config_module.Config, Path, Daemon]:
    """A daemon watching backend "b" at ``url`` every 0.2 s, its state in ``tmp_path``."""
    config = config_module.Config(timeout=1.0, answer_timeout=1.0, read_workers=read_workers)
    state = tmp_path / "state.json"
    daemon = a_daemon(lambda: (config, [Target("b", url)]), StateFile(state), wait=0.2)
    return config, state, daemon


async def _until_seen(
    state: Path, what: str, predicate: Callable[[], bool], running: asyncio.Task[int]
) -> None:
    """Poll until ``predicate`` holds, within 20 s and while the daemon runs."""
    deadline = time.monotonic() + 20.0
    while not predicate():
        if time.monotonic() > deadline or running.done():
            raise NotObservedError(f"no {what}; b is {_saved_state(state, 'b')}")
        await asyncio.sleep(POLL)


def _saved_state(path: Path, name: str) -> str | None:
    with contextlib.suppress(OSError, ValueError):
        for backend in json.loads(path.read_text())["ledger"]["backends"]:
            if backend["name"] == name:
                return str(backend["state"])
    return None


@pytest.mark.slow
@pytest.mark.parametrize("read_workers", [1, 2])
def test_a_stale_backend_whose_engine_others_keep_moving_is_asked_and_readmitted(
    httpserver: HTTPServer,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    read_workers: int,
) -> None:
    """Re-admission needs an answered tiny request. Judged by its counters, a backend
    that someone else keeps moving (a second checker, clients of its own) was never
    asked, and stayed out of the serving set for as long as they came."""
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    backend = MovedByOthers(httpserver)
    config, state, daemon = _daemon_on_one(backend.url, read_workers, tmp_path)
    until = partial(_until_seen, state)

    async def scenario() -> int:
        running = asyncio.create_task(daemon.run())
        try:
            # Watched a while, so its window holds reads that show the engine moving.
            await until("settled healthy", lambda: _saved_state(state, "b") == "healthy", running)
            await asyncio.sleep(1.0)
            # An operator's retire and reset: the backend is STALE, out until re-admitted.
            operator = StateFile(state)
            audit = AuditLog(audit_path_for(config, state))
            for verb in (
                lambda: operate.retire(operator, audit, config, "b", "replaced the card"),
                lambda: operate.reset(operator, audit, config, "b"),
            ):
                done = await asyncio.to_thread(verb)
                assert done.applied, done.message
            asked_before = backend.completions
            await until("re-admission", lambda: _saved_state(state, "b") == "healthy", running)
            return backend.completions - asked_before
        finally:
            daemon.stop()
            assert await asyncio.wait_for(running, STOP_BOUND) == 0

    assert asyncio.run(scenario()) >= 1
    readmitted = [r for r in read(audit_path_for(config, state)) if r.get("event") == "readmitted"]
    assert readmitted and "tiny request answered" in json.dumps(readmitted[-1])


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["backend", "proxy"])
def test_a_target_that_turns_our_key_away_is_counted_for_alerts_and_not_condemned(
    entry_point: str, httpserver: HTTPServer, tmp_path: Path, kind: str
) -> None:
    """A key missing here or rotated there: every idle backend was `unanswered` until
    condemned, and a proxy `down`, paging as a failed balancer. Not judged now (no
    current verdict), and counted where an alert can see it."""
    idle = (Path(__file__).parent.parent / "fixtures" / "vllm-0.32" / "idle-1.txt").read_text()
    httpserver.expect_request("/metrics").respond_with_data(idle, content_type="text/plain")
    httpserver.expect_request("/v1/models").respond_with_json({"error": "Unauthorized"}, 401)
    url = httpserver.url_for("").rstrip("/")
    target = [{"name": "k", "url": url}]
    text = fleet_config(target) if kind == "backend" else fleet_config([], proxies=target)
    config = write_config(tmp_path / "fleet.toml", text)
    with watching(entry_point, config, tmp_path / "state.json") as watch:
        page = watch.until(
            "the refusal counted",
            lambda p: (
                p.counts("llmhealth_backend_probe_errors", "kind").get(("k", "key_refused"))
                is not None
            ),
        )
        for _ in range(4):  # more than unhealthy_threshold waits
            page = watch.next_cycle(page)
        rc, _ = watch.stop()
    assert rc == 0
    assert page.counts("llmhealth_backend_probe_errors", "kind")[("k", "key_refused")] >= 4
    assert page.verdict("k") is None
    assert page.state("k") == ("healthy" if kind == "backend" else None)


class FrozenIdle:
    """An idle server whose counters never move: asked at every read while it serves."""

    def __init__(self, server: HTTPServer) -> None:
        captures = Path(__file__).parent.parent / "fixtures" / "vllm-0.32"
        text = (captures / "idle-1.txt").read_text()
        self.reads = 0
        self.completions = 0
        server.expect_request("/metrics").respond_with_handler(self._metrics)
        server.expect_request("/v1/models").respond_with_json(
            {"object": "list", "data": [{"id": "tiny", "object": "model"}]}
        )
        server.expect_request("/v1/completions", method="POST").respond_with_handler(self._complete)
        self._text = text
        self.url = server.url_for("").rstrip("/")

    def _metrics(self, _request: Request) -> Response:
        self.reads += 1
        return Response(self._text, content_type="text/plain; version=1.0.0; charset=utf-8")

    def _complete(self, _request: Request) -> Response:
        self.completions += 1
        answer = {"id": "cmpl-1", "object": "text_completion", "choices": [{"text": "!"}]}
        return Response(json.dumps(answer), content_type="application/json")


@pytest.mark.slow  # a real daemon and its read workers over a dozen waits
def test_a_retired_backend_is_read_but_sent_no_tiny_request_until_a_reset(
    httpserver: HTTPServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An operator who retired a server may have lent it to someone else: watch keeps
    reading it and leaves its request slots alone until a reset asks for proof again;
    read workers, which hold the settings their share came with, are told (the daemon's
    own tasks read the same settings before every read)."""
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    backend = FrozenIdle(httpserver)
    config, state, daemon = _daemon_on_one(backend.url, 2, tmp_path)
    until = partial(_until_seen, state)
    operator = StateFile(state)
    audit = AuditLog(audit_path_for(config, state))

    async def reads(count: int, running: asyncio.Task[int]) -> None:
        goal = backend.reads + count
        await until(f"{count} more reads", lambda: backend.reads >= goal, running)

    async def scenario() -> tuple[int, int]:
        running = asyncio.create_task(daemon.run())
        try:
            await until("a tiny request", lambda: backend.completions >= 2, running)
            verb = partial(operate.retire, operator, audit, config, "b", "lent out")
            assert (await asyncio.to_thread(verb)).applied
            await until("the retirement seen", lambda: "b" in daemon.settings.retired, running)
            # Five more waits: told to every reader (at the next cycle's start), and any
            # examination under way when it was made has ended.
            await reads(5, running)
            asked_when_retired = backend.completions
            await reads(8, running)
            asked_since = backend.completions - asked_when_retired
            assert (await asyncio.to_thread(operate.reset, operator, audit, config, "b")).applied
            await until("re-admission", lambda: _saved_state(state, "b") == "healthy", running)
            return asked_since, backend.completions - asked_when_retired
        finally:
            daemon.stop()
            assert await asyncio.wait_for(running, STOP_BOUND) == 0

    asked_while_retired, asked_by_the_end = asyncio.run(scenario())
    assert asked_while_retired == 0
    assert asked_by_the_end >= 1  # the reset's proof: an answered tiny request


class RacedSaves(StateFile):
    """A store whose first saves find the record moved since it was read, as a cluster
    leader's does when an operator's verb saves between its load and its save."""

    def __init__(self, path: Path, races: int) -> None:
        super().__init__(path)
        self.races = races

    def save(self, document: dict[str, Any], **kwargs: Any) -> None:
        if self.races:
            self.races -= 1
            raise RecordMovedError(f"{self.path} was written by another since it was read")
        super().save(document, **kwargs)


def quiet_daemon(target: Target, store: StateFile) -> Daemon:
    """A daemon over ``target`` alone with the default config, on ``store``: no listener,
    no serving file; driven by its methods, its loop never run."""
    return a_daemon(lambda: (config_module.Config(), [target]), store)


def test_a_settle_raced_by_an_operator_verb_is_made_again_on_the_verbs_record(
    tmp_path: Path,
) -> None:
    """Standing by after such a race (as when deposed) cost the cycle's verdicts: a
    wedge proven a wait late. Made again, it settles them; a race every time is a
    skipped cycle, as any failed save is."""
    target = Target("b", REFUSED_URL)
    wedged = Verdict(VerdictKind.WEDGED, False, "wedged: steps 5→5→5")
    for races, settles in ((daemon_module.SETTLE_ATTEMPTS - 1, True), (99, False)):
        store = RacedSaves(tmp_path / f"state-{races}.json", races)
        daemon = quiet_daemon(target, store)
        daemon.hear(target, wedged, 0.01)
        news = daemon_module.News(daemon._take_fresh(), [])
        if settles:
            settled = daemon._settle(news)
            assert str(settled.record.ledger.state_of("b")) == "dead"
            assert store.races == 0 and store.path.exists()
        else:
            with pytest.raises(RecordMovedError):
                daemon._settle(news)
            assert store.races == 99 - daemon_module.SETTLE_ATTEMPTS
            assert not store.path.exists()


def proof_then_lost_reader(tmp_path: Path) -> tuple[Daemon, Verdict]:
    """A daemon that heard backend b proven wedged, then that b's reader was lost, with
    no settle between; and the proof."""
    target = Target("b", REFUSED_URL)
    wedged = Verdict(VerdictKind.WEDGED, False, "wedged: steps 5→5→5")
    daemon = quiet_daemon(target, StateFile(tmp_path / "state.json"))
    daemon.hear(target, wedged, 0.01)
    daemon.hear(target, probe.unjudged("not judged: read worker 1 exited (-9)"), 0.0)
    return daemon, wedged


def test_a_wedge_proven_then_its_reader_lost_before_the_settle_is_still_settled(
    tmp_path: Path,
) -> None:
    """A worker that sent a wedge's proof and died before the settle: the notice that
    its targets were not judged replaced the proof, and proving it again took two more
    waits after a new worker started. The notice still counts as an examination."""
    daemon, wedged = proof_then_lost_reader(tmp_path)
    fresh = daemon._take_fresh()
    assert [outcome.verdict for outcome in fresh] == [wedged]
    assert daemon._state.probes["b"].examinations == 2
    settled = daemon._settle(daemon_module.News(fresh, []))
    assert str(settled.record.ledger.state_of("b")) == "dead"
    # The notice is the next settle's: a reader lost for good is said as such.
    assert [outcome.verdict.judged for outcome in daemon._take_fresh()] == [False]
    assert daemon._take_fresh() == []


def test_a_cluster_member_publishes_a_proof_its_lost_reader_followed_under_its_serial(
    tmp_path: Path,
) -> None:
    """A member takes its news, then publishes its share for the leader (the loop's
    order): the notice that took the proof's place at the take went out under the
    proof's serial, and the leader never heard of the wedge."""
    daemon, _ = proof_then_lost_reader(tmp_path)
    daemon._shares = cast(Any, object())  # a member's: only its presence is asked here
    published = []
    for _ in range(2):
        daemon._take_fresh()
        publication = daemon._publication()
        assert publication is not None
        published.append((publication.serials["b"], publication.verdicts["b"].judged))
    first = published[0][0]
    assert published == [(first, True), (first + 1, False)]


def test_a_restart_whose_verdict_a_second_read_replaced_before_the_settle_is_still_seen(
    tmp_path: Path,
) -> None:
    """Reads run every 0.96 wait against settles every wait (probe.KEEP_ALIVE_LEAD), and
    a settle takes each backend's newest verdict: a "restarted" one followed by a read of
    the new process alone must not leave a restarted backend serving unproven."""
    captures = Path(__file__).parent.parent / "fixtures" / "vllm-0.32"
    texts = [parse_metrics((captures / f"busy-{n}.txt").read_bytes()) for n in (1, 2, 3)]
    later = (texts[0].process_start or 0.0) + 600  # a new process, started meanwhile
    fresh = [replace(text, process_start=later) for text in texts]
    target = Target("b", REFUSED_URL)
    daemon = quiet_daemon(target, StateFile(tmp_path / "state.json"))
    now = time.time()

    def settle_after(*windows: list[Read]) -> str:
        for window in windows:
            verdict = decide(window)
            assert isinstance(verdict, Verdict), verdict
            daemon.hear(target, verdict, 0.01)
        settled = daemon._settle(daemon_module.News(daemon._take_fresh(), []))
        return str(settled.record.ledger.state_of("b"))

    assert settle_after([Read(now - 5, texts[0]), Read(now, texts[1])]) == "healthy"
    # The new process at work: judged "restarted" once it shows progress, at its second
    # read; the window then keeps that read alone, and the next read, before the settle,
    # makes a "busy" verdict of the new process's two reads: the newest, so the settled.
    restarted = [Read(now, texts[1]), Read(now + 4.8, fresh[0]), Read(now + 9.6, fresh[1])]
    verdict = decide(restarted)
    assert isinstance(verdict, Verdict) and verdict.kind is VerdictKind.RESTARTED
    after = [restarted[-1], Read(now + 14.4, fresh[2])]
    newest = decide(after)
    assert isinstance(newest, Verdict) and newest.kind is VerdictKind.BUSY
    assert settle_after(restarted, after) == "stale"


def test_the_daemon_spaces_young_collections_while_it_runs_and_gives_them_back(
    urls: Urls, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """At 10,000 backends the default's full collections were a quarter of its CPU."""
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    before = gc.get_threshold()
    daemon = _fast_daemon_over_one_busy_backend(urls, tmp_path)

    async def scenario() -> tuple[int, ...]:
        running = asyncio.create_task(daemon.run())
        log, deadline = "", time.monotonic() + 15.0
        while not re.search(r"^cycle 1:", log, re.MULTILINE):
            if time.monotonic() > deadline or running.done():
                raise NotObservedError(f"no cycle:\n{log}")
            await asyncio.sleep(POLL)
            log += capsys.readouterr().err
        during = gc.get_threshold()
        daemon.stop()
        assert await asyncio.wait_for(running, STOP_BOUND) == 0
        return during

    during = asyncio.run(scenario())
    assert during == (max(YOUNG, before[0]), *before[1:])
    assert gc.get_threshold() == before


# Writes its first argument, then waits for its second to exist (at most 2 minutes) and
# exits 0: a `systemctl restart` that takes as long as the test wants.
SLOW_RESTART = (
    "import os, sys, time; open(sys.argv[1], 'w').write(str(os.getpid()))\n"
    "deadline = time.monotonic() + 120\n"
    "while not os.path.exists(sys.argv[2]) and time.monotonic() < deadline: time.sleep(0.05)"
)


def until_exists(path: Path, watch: Watch, what: str) -> None:
    deadline = time.monotonic() + PATIENCE
    while not (path.exists() and path.read_text()):
        if time.monotonic() > deadline:
            raise NotObservedError(f"no {what} within {PATIENCE} s:\n{watch.stderr()}")
        watch._alive(what)
        time.sleep(POLL)


def verb(
    entry_point: str, config: Path, state: Path, *args: str
) -> subprocess.CompletedProcess[str]:
    argv = [entry_point, *args, "--config", str(config), "--state", str(state)]
    return subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)


@pytest.mark.slow
def test_a_slow_restart_command_holds_neither_the_settles_nor_the_operator_verbs(
    entry_point: str, urls: Urls, tmp_path: Path
) -> None:
    started, go = tmp_path / "command.pid", tmp_path / "command.go"
    command = [sys.executable, "-c", SLOW_RESTART, str(started), str(go)]
    state = tmp_path / "state.json"
    try:
        with running_simulator(["idle"]) as doomed:  # its own process, to kill mid-command
            config = write_config(
                tmp_path / "fleet.toml",
                fleet_config(
                    [
                        {"name": "slow", "url": urls.wedge_a, "restart": command},
                        {"name": "doomed", "url": doomed.urls[0]},
                        {"name": "busy", "url": urls.busy},
                    ]
                ),
            )
            with watching(entry_point, config, state) as watch:
                until_exists(started, watch, "restart command started")
                # The command runs now, and goes on until `go` exists. Before, it ran
                # inside the settle and the state lock: both verbs gave up on the lock
                # after 10 s with exit 3, and no backend's verdict was settled.
                status = verb(entry_point, config, state, "status", "--format", "json")
                assert status.returncode in (0, 1, 2), status.stderr
                shown = {b["name"]: b["state"] for b in json.loads(status.stdout)["backends"]}
                assert shown["slow"] == "restarting"  # committed before the command ran
                held = verb(
                    entry_point, config, state, "hold", "busy", "--for", "1m", "--reason", "t"
                )
                assert held.returncode == 0, held.stderr
                doomed.stop()  # a second backend dies while the command runs
                page = watch.until("doomed out of serving", lambda p: p.state("doomed") == "dead")
                assert not go.exists()  # so the command was still running all along
                assert page.state("slow") == "restarting"
                assert page.get("llmhealth_backend_serving", backend="doomed") == 0.0
                assert page.counts("llmhealth_backend_restarts", "outcome")[("slow", "ok")] == 0
                go.touch()
                watch.until(
                    "the command's outcome heard",
                    lambda p: (
                        p.counts("llmhealth_backend_restarts", "outcome")[("slow", "ok")] == 1
                    ),
                )
                rc, _ = watch.stop()
        assert rc == 0
    finally:
        go.touch()  # whatever happened, the command ends by itself
    audit = [json.loads(line) for line in (tmp_path / "audit.jsonl").read_text().splitlines()]
    slow = [(r["event"], r.get("from"), r.get("to")) for r in audit if r["backend"] == "slow"]
    assert slow == [
        ("wedge_proven", "healthy", "dead"),
        ("restart", "dead", "restarting"),
        ("restart_command", "restarting", "restarting"),  # exit 0 proves nothing yet
    ]
    [heard] = [r for r in audit if r["event"] == "restart_command"]
    assert (heard["command"]["exit_code"], heard["command"]["argv"]) == (0, command)
    assert [r["event"] for r in audit if r["backend"] == "busy"] == ["hold"]


@pytest.mark.slow
def test_sigterm_while_a_restart_command_runs_leaves_the_restart_on_record(
    entry_point: str, urls: Urls, tmp_path: Path
) -> None:
    started, go = tmp_path / "command.pid", tmp_path / "command.go"
    command = [sys.executable, "-c", SLOW_RESTART, str(started), str(go)]
    state = tmp_path / "state.json"
    config = write_config(
        tmp_path / "fleet.toml",
        fleet_config([{"name": "slow", "url": urls.wedge_a, "restart": command}]),
    )
    try:
        with watching(entry_point, config, state) as watch:
            until_exists(started, watch, "restart command started")
            # The daemon gives the command its shutdown grace, then leaves it running.
            rc, _ = watch.stop(timeout=daemon_module.SHUTDOWN_GRACE + STOP_BOUND)
            log = watch.stderr()
            assert not go.exists()
    finally:
        go.touch()
    assert rc == 0
    assert "slow: restart command still running; its restart stays issued" in log
    [saved] = json.loads(state.read_text())["ledger"]["backends"]
    assert saved["state"] == "restarting"
    assert len(saved["restart_times"]) == 1
    audit = [json.loads(line) for line in (tmp_path / "audit.jsonl").read_text().splitlines()]
    assert [(r["event"], r["to"]) for r in audit] == [
        ("wedge_proven", "dead"),
        ("restart", "restarting"),
    ]
    # status reads it as it was left, a restart in progress.
    status = verb(entry_point, config, state, "status", "--format", "json")
    assert json.loads(status.stdout)["backends"][0]["state"] == "restarting"


@pytest.mark.slow
def test_sigterm_waits_for_a_restart_command_that_ends_within_the_grace_and_saves_it(
    entry_point: str, urls: Urls, tmp_path: Path
) -> None:
    started, go = tmp_path / "command.pid", tmp_path / "command.go"
    command = [sys.executable, "-c", SLOW_RESTART, str(started), str(go)]
    state = tmp_path / "state.json"
    config = write_config(
        tmp_path / "fleet.toml",
        fleet_config([{"name": "slow", "url": urls.wedge_a, "restart": command}]),
    )
    try:
        with watching(entry_point, config, state) as watch:
            until_exists(started, watch, "restart command started")
            watch.signal(signal.SIGTERM)
            watch.logged("waiting up to")
            go.touch()  # the command ends inside the grace
            rc, _ = watch.stop(timeout=daemon_module.SHUTDOWN_GRACE + STOP_BOUND)
    finally:
        go.touch()
    assert rc == 0
    audit = [json.loads(line) for line in (tmp_path / "audit.jsonl").read_text().splitlines()]
    assert [(r["event"], r["to"]) for r in audit] == [
        ("wedge_proven", "dead"),
        ("restart", "restarting"),
        ("restart_command", "restarting"),
    ]


# Appends a line to its first argument, then waits (at most 2 minutes) for its second to
# exist: an on_serving_change hook as slow as the test wants.
SLOW_HOOK = (
    "import os, sys, time; open(sys.argv[1], 'a').write('ran\\n')\n"
    "deadline = time.monotonic() + 120\n"
    "while not os.path.exists(sys.argv[2]) and time.monotonic() < deadline: time.sleep(0.05)"
)


def busy_and_gone_behind_a_slow_hook(urls: Urls, tmp_path: Path) -> tuple[Path, Path, Path, Path]:
    """A busy backend and a refused one (condemned over a few settles), the serving file
    announced by SLOW_HOOK: the config, the serving file, the hook's log and its go."""
    ran, go = tmp_path / "hook.log", tmp_path / "hook.go"
    config = write_config(
        tmp_path / "fleet.toml",
        fleet_config(
            [{"name": "busy", "url": urls.busy}, {"name": "gone", "url": REFUSED_URL}],
            on_serving_change=[sys.executable, "-c", SLOW_HOOK, str(ran), str(go)],
        ),
    )
    return config, tmp_path / "serving.json", ran, go


@pytest.mark.slow
def test_a_slow_serving_hook_holds_no_settle_and_runs_again_for_a_later_change(
    entry_point: str, urls: Urls, tmp_path: Path
) -> None:
    config, serving, ran, go = busy_and_gone_behind_a_slow_hook(urls, tmp_path)

    def named() -> list[str]:
        return [b["name"] for b in json.loads(serving.read_text())["serving"]]

    try:
        with watching(
            entry_point, config, tmp_path / "state.json", "--serving-file", str(serving)
        ) as watch:
            until_exists(ran, watch, "the hook started")
            # While the first hook waits, `gone` is condemned over three more settles and
            # the serving file follows it: before, the settle ran the hook itself and
            # stood still until it returned.
            watch.until("gone condemned", lambda p: p.state("gone") == "dead")
            assert named() == ["busy"]
            assert ran.read_text() == "ran\n"  # one run so far, still waiting
            go.touch()
            deadline = time.monotonic() + PATIENCE
            while ran.read_text() != "ran\nran\n":  # once more, for the later change
                assert time.monotonic() < deadline, watch.stderr()
                time.sleep(POLL)
            rc, _ = watch.stop()
    finally:
        go.touch()
    assert rc == 0


@pytest.mark.slow
def test_a_serving_change_pending_behind_a_running_hook_is_announced_at_a_stop(
    entry_point: str, urls: Urls, tmp_path: Path
) -> None:
    """The serving file changed while the hook ran, then the daemon was stopped: the file
    on disk named the new set and the balancer was never told of it."""
    config, serving, ran, go = busy_and_gone_behind_a_slow_hook(urls, tmp_path)
    release = threading.Timer(1.0, go.touch)  # the first hook ends during the stop
    try:
        with watching(
            entry_point, config, tmp_path / "state.json", "--serving-file", str(serving)
        ) as watch:
            until_exists(ran, watch, "the hook started")
            watch.until("gone condemned", lambda p: p.state("gone") == "dead")
            assert [b["name"] for b in json.loads(serving.read_text())["serving"]] == ["busy"]
            assert ran.read_text() == "ran\n"  # the change waits for the first run
            release.start()
            rc, _ = watch.stop()
    finally:
        release.cancel()
        go.touch()
    assert rc == 0
    assert ran.read_text() == "ran\nran\n"


@pytest.mark.slow
def test_a_restart_command_longer_than_the_grace_neither_fails_it_nor_runs_twice(
    entry_point: str, urls: Urls, tmp_path: Path
) -> None:
    """A startup grace shorter than the command. Before, the grace failed the restart
    while its command ran, the plan issued the next at once (an attempt of the budget,
    and a `max_concurrent_restarts` place given up) and queued it behind the first."""
    ran, go = tmp_path / "command.log", tmp_path / "command.go"
    audit = tmp_path / "audit.jsonl"
    command = [sys.executable, "-c", SLOW_HOOK, str(ran), str(go)]  # logs, then waits
    config = write_config(
        tmp_path / "fleet.toml",
        fleet_config([{"name": "slow", "url": urls.wedge_a, "restart": command}])
        + '\n[policy]\nstartup_grace = "1s"\ncooldown = "1s"\ncooldown_max = "2s"\n',
    )

    def trail() -> list[str]:
        lines = audit.read_text().splitlines() if audit.exists() else []
        return [json.loads(line)["event"] for line in lines]

    try:
        with watching(entry_point, config, tmp_path / "state.json") as watch:
            page = watch.until("the restart", lambda p: p.state("slow") == "restarting")
            until_exists(ran, watch, "the command started")
            for _ in range(4):  # grace and cooldown long over: before, a second restart
                page = watch.next_cycle(page)
                assert page.state("slow") == "restarting"
            assert ran.read_text() == "ran\n"
            assert "startup_expired" not in trail() and trail().count("restart") == 1
            go.touch()  # the command exits 0; the wedge stays: the grace fails it now
            deadline = time.monotonic() + PATIENCE
            while ran.read_text().count("ran") < 2:  # the next restart's command
                assert time.monotonic() < deadline, watch.stderr()
                time.sleep(POLL)
            rc, _ = watch.stop()
    finally:
        go.touch()
    assert rc == 0
    decided = [event for event in trail() if event != "restart_skipped"]
    assert decided[:5] == [
        "wedge_proven",
        "restart",
        "restart_command",  # the first command, heard once it ended
        "startup_expired",
        "restart",
    ]


@pytest.mark.slow
def test_a_reload_renaming_a_backend_whose_restart_runs_restarts_nothing_beside_it(
    entry_point: str, urls: Urls, tmp_path: Path
) -> None:
    """The new name came with no sign of the running command: its server, still wedged,
    was restarted again beside it, and the old name's command no longer held the one
    `max_concurrent_restarts` place, so the other wedged backend was restarted too."""
    ran, go = tmp_path / "command.log", tmp_path / "command.go"
    audit = tmp_path / "audit.jsonl"
    command = [sys.executable, "-c", SLOW_HOOK, str(ran), str(go)]
    policy = '\n[policy]\ncooldown = "1s"\ncooldown_max = "2s"\n'
    other = {"name": "w2", "url": urls.wedge_b, "restart": [sys.executable, "-c", "pass"]}

    def config(name: str) -> str:
        return fleet_config([{"name": name, "url": urls.wedge_a, "restart": command}, other])

    path = write_config(tmp_path / "fleet.toml", config("w1") + policy)

    def restarted() -> list[str]:
        lines = audit.read_text().splitlines() if audit.exists() else []
        return [r["backend"] for r in map(json.loads, lines) if r["event"] == "restart"]

    try:
        with watching(entry_point, path, tmp_path / "state.json") as watch:
            page = watch.until("w1 restarting", lambda p: p.state("w1") == "restarting")
            until_exists(ran, watch, "w1's command started")
            assert restarted() == ["w1"]  # w2 waits for the one place
            write_config(path, config("w1new") + policy)
            watch.signal(signal.SIGHUP)
            # Renamed, it keeps its restart under way (before: HEALTHY, then wedged again
            # and restarted beside the running command).
            page = watch.until("w1new renamed", lambda p: p.state("w1new") == "restarting")
            for _ in range(4):
                page = watch.next_cycle(page)
                assert page.state("w1new") == "restarting"
            assert restarted() == ["w1"] and ran.read_text() == "ran\n"
            go.touch()  # or the stop waits out its grace for the command
            rc, _ = watch.stop()
    finally:
        go.touch()
    assert rc == 0


def test_a_stop_during_a_long_restart_command_returns_after_the_grace_not_the_command(
    urls: Urls, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    monkeypatch.setattr(daemon_module, "SHUTDOWN_GRACE", 0.5)
    # The command runs until `go` exists, which this test never makes (or two minutes).
    marker = tmp_path / "restart.pid"
    command = (sys.executable, "-c", SLOW_RESTART, str(marker), str(tmp_path / "go"))
    backend = config_module.Backend("w", urls.wedge_b, restart=command)

    def load() -> tuple[config_module.Config, list[Target]]:
        config = config_module.Config(timeout=1.0, answer_timeout=1.0, backends=(backend,))
        return config, [Target("w", urls.wedge_b)]

    daemon = a_daemon(load, StateFile(tmp_path / "state.json"), wait=0.1)

    async def scenario() -> int:
        running = asyncio.create_task(daemon.run())
        deadline = time.monotonic() + PATIENCE
        while not (marker.exists() and marker.read_text()):
            if time.monotonic() > deadline or running.done():
                raise NotObservedError("the restart command did not start")
            await asyncio.sleep(POLL)
        daemon.stop()
        # The command never ends on its own: a stop that waited for it would not return
        # (this bound only ends such a hung test).
        return await asyncio.wait_for(running, PATIENCE)

    try:
        assert asyncio.run(scenario()) == 0
        pid = int(marker.read_text())
        # Its own process still, not a zombie nobody reaped.
        stat = Path(f"/proc/{pid}/stat")
        still_running = stat.exists() and stat.read_text().rsplit(")", 1)[1].split()[0] != "Z"
    finally:
        # Whatever the outcome, the command started for this test does not outlive it.
        with contextlib.suppress(ValueError, OSError):
            os.kill(int(marker.read_text()), signal.SIGKILL)
    # Returned after the grace, with the command left running as documented (systemd's
    # KillMode=mixed ends it), its restart kept as issued.
    assert still_running, "the restart command was ended, not left to itself"
    said = capsys.readouterr().err
    assert "w: restart command still running; its restart stays issued" in said, said
    assert said.rstrip().endswith("stopped"), said


def test_a_stop_during_the_settle_that_issues_a_restart_runs_no_command(
    urls: Urls, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SIGTERM came while the settle that condemned a wedge and issued its restart ran
    (waiting for the state lock, a slow disk): the daemon waited for that settle, then
    launched its command on the way out, gave it the shutdown grace and left it running
    (or systemd's KillMode=mixed killed it half-way). Stopping, it runs no new command:
    the restart is heard as not run, withdrawn, DEAD with no attempt spent."""
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    monkeypatch.setattr(daemon_module, "SHUTDOWN_GRACE", 0.5)
    marker = tmp_path / "restart.pid"
    command = (sys.executable, "-c", SLOW_RESTART, str(marker), str(tmp_path / "go"))
    backend = config_module.Backend("w", urls.wedge_b, restart=command)
    config = config_module.Config(timeout=1.0, answer_timeout=1.0, backends=(backend,))

    def load() -> tuple[config_module.Config, list[Target]]:
        return config, [Target("w", urls.wedge_b)]

    daemon = a_daemon(load, StateFile(tmp_path / "state.json"), wait=0.1)
    entered, go_on = threading.Event(), threading.Event()
    settle = daemon._settle

    def slow_settle(news: daemon_module.News) -> Any:
        # The settle that will condemn "w" is held until the stop has come.
        if any(o.verdict.kind is VerdictKind.WEDGED for o in news.verdicts):
            entered.set()
            go_on.wait(PATIENCE)
        return settle(news)

    daemon._settle = slow_settle  # type: ignore[method-assign]

    async def scenario() -> int:
        running = asyncio.create_task(daemon.run())
        deadline = time.monotonic() + PATIENCE
        while not entered.is_set():
            if time.monotonic() > deadline or running.done():
                raise NotObservedError("no settle took the wedge")
            await asyncio.sleep(POLL)
        daemon.stop()
        await asyncio.sleep(0.2)  # heard by the loop, which waits for the settle
        go_on.set()
        return await asyncio.wait_for(running, PATIENCE)

    try:
        assert asyncio.run(scenario()) == 0
    finally:
        go_on.set()
        with contextlib.suppress(ValueError, OSError):
            os.kill(int(marker.read_text()), signal.SIGKILL)
    assert not marker.exists(), "a restart command was started after the stop"
    audit = read(tmp_path / "audit.jsonl")
    assert [(r["event"], r.get("to")) for r in audit if r["backend"] == "w"] == [
        ("wedge_proven", "dead"),
        ("restart", "restarting"),
        ("restart_command", "dead"),  # not run: the daemon was stopping
    ]
    [entry] = json.loads((tmp_path / "state.json").read_text())["ledger"]["backends"]
    assert (entry["state"], entry["restart_times"]) == ("dead", [])


def _stopped_past_the_grace(
    daemon: Daemon,
    monkeypatch: pytest.MonkeyPatch,
    held: Callable[[daemon_module.News], bool],
    fail: Exception | None = None,
) -> None:
    """Run ``daemon`` until a settle ``held`` picks begins, stop it, and hold that settle
    past the stop's first grace (1 s); then let it go on (raising ``fail`` if given) with
    all the grace a loaded machine may take, a bound only. The daemon exits 0."""
    monkeypatch.setattr(daemon_module, "SHUTDOWN_GRACE", 1.0)
    entered, go_on = threading.Event(), threading.Event()
    settle, log = daemon._settle, daemon._log

    def held_settle(news: daemon_module.News) -> Any:
        if held(news):
            entered.set()
            go_on.wait(PATIENCE)
            if fail is not None:
                raise fail
        return settle(news)

    def said(message: str) -> None:
        log(message)
        if message == "stopping with a cycle unfinished":
            # The held settle goes on while the daemon still stops (read when it waits).
            monkeypatch.setattr(daemon_module, "SHUTDOWN_GRACE", PATIENCE)
            go_on.set()

    daemon._settle = held_settle  # type: ignore[method-assign]
    daemon._log = said  # type: ignore[method-assign]

    async def scenario() -> int:
        running = asyncio.create_task(daemon.run())
        deadline = time.monotonic() + PATIENCE
        while not entered.is_set():
            if time.monotonic() > deadline or running.done():
                raise NotObservedError("no settle was held")
            await asyncio.sleep(POLL)
        daemon.stop()
        return await asyncio.wait_for(running, PATIENCE)

    try:
        assert asyncio.run(scenario()) == 0
        for thread in threading.enumerate():  # the held settle, whatever became of it
            if thread.name == "llmhealth-cycle":
                thread.join(PATIENCE)
    finally:
        go_on.set()


def test_a_settle_still_running_past_the_stops_grace_has_its_restart_heard_as_not_run(
    urls: Urls, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SIGTERM came while the settle that condemned a wedge and issued its restart was
    held past the shutdown grace (the audit log flocked by a backup, a slow disk): the
    loop gave up on it, but its thread went on and saved RESTARTING, an attempt spent,
    while the daemon finished stopping, and nobody ran its command; the next start failed
    that restart after its grace. Its orders are heard as not run, as at any stop."""
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    marker = tmp_path / "restart.pid"
    command = (sys.executable, "-c", SLOW_RESTART, str(marker), str(tmp_path / "go"))
    backend = config_module.Backend("w", urls.wedge_b, restart=command)
    config = config_module.Config(timeout=1.0, answer_timeout=1.0, backends=(backend,))

    def load() -> tuple[config_module.Config, list[Target]]:
        return config, [Target("w", urls.wedge_b)]

    daemon = a_daemon(load, StateFile(tmp_path / "state.json"), wait=0.1)

    def condemning(news: daemon_module.News) -> bool:
        return any(o.verdict.kind is VerdictKind.WEDGED for o in news.verdicts)

    try:
        _stopped_past_the_grace(daemon, monkeypatch, condemning)
    finally:
        with contextlib.suppress(ValueError, OSError):
            os.kill(int(marker.read_text()), signal.SIGKILL)
    assert not marker.exists(), "a restart command was started after the stop"
    [entry] = json.loads((tmp_path / "state.json").read_text())["ledger"]["backends"]
    assert (entry["state"], entry["restart_times"]) == ("dead", [])
    audit = read(tmp_path / "audit.jsonl")
    assert [(r["event"], r.get("to")) for r in audit if r["backend"] == "w"] == [
        ("wedge_proven", "dead"),
        ("restart", "restarting"),
        ("restart_command", "dead"),  # not run: the daemon was stopping
    ]


def test_a_restart_commands_outcome_given_to_a_settle_past_the_stops_grace_is_not_lost(
    urls: Urls, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The settle that took a finished restart command's outcome was held past the
    shutdown grace and then failed (the state locked): that outcome was in neither the
    state nor the audit log. The last settle hears it, as after any failed settle."""
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    marker, go = tmp_path / "restart.pid", tmp_path / "go"
    go.touch()  # the command ends at once, exit 0
    command = (sys.executable, "-c", SLOW_RESTART, str(marker), str(go))
    backend = config_module.Backend("w", urls.wedge_b, restart=command)
    config = config_module.Config(timeout=1.0, answer_timeout=1.0, backends=(backend,))

    def load() -> tuple[config_module.Config, list[Target]]:
        return config, [Target("w", urls.wedge_b)]

    daemon = a_daemon(load, StateFile(tmp_path / "state.json"), wait=0.1)

    def hearing_the_command(news: daemon_module.News) -> bool:
        return bool(news.commands) and not news.final

    locked = StateLockedError("state is locked by another llmhealth")
    _stopped_past_the_grace(daemon, monkeypatch, hearing_the_command, fail=locked)
    records = [r for r in read(tmp_path / "audit.jsonl") if r["backend"] == "w"]
    assert [r["event"] for r in records] == ["wedge_proven", "restart", "restart_command"]
    assert records[-1]["command"]["exit_code"] == 0


def test_a_restart_commands_outcome_the_last_settle_cannot_save_is_still_in_the_audit_log(
    urls: Urls, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A restart command ended within the shutdown grace, and the last settle could not
    record it (the state locked by a `check` or a verb, a disk full): its exit status and
    output were in no trail at all, though DESIGN sends them to the audit log. As
    `check` does, the outcome goes to a file audit log by itself, marked unsettled."""
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    monkeypatch.setattr(daemon_module, "SHUTDOWN_GRACE", PATIENCE)
    marker, go = tmp_path / "restart.pid", tmp_path / "go"
    command = (sys.executable, "-c", SLOW_RESTART, str(marker), str(go))
    backend = config_module.Backend("w", urls.wedge_b, restart=command)
    config = config_module.Config(timeout=1.0, answer_timeout=1.0, backends=(backend,))
    state = tmp_path / "state.json"

    def load() -> tuple[config_module.Config, list[Target]]:
        return config, [Target("w", urls.wedge_b)]

    daemon = a_daemon(load, StateFile(state, lock_timeout=0.2), wait=0.1)

    async def scenario() -> int:
        running = asyncio.create_task(daemon.run())
        deadline = time.monotonic() + PATIENCE
        while not (marker.exists() and marker.read_text()):
            if time.monotonic() > deadline or running.done():
                raise NotObservedError("the restart command did not start")
            await asyncio.sleep(POLL)
        with StateFile(state).locked():  # another run holds the state meanwhile
            daemon.stop()
            go.touch()  # the command ends within the grace, exit 0
            return await asyncio.wait_for(running, PATIENCE)

    try:
        assert asyncio.run(scenario()) == 0
    finally:
        go.touch()
    records = [r for r in read(tmp_path / "audit.jsonl") if r["backend"] == "w"]
    assert [r["event"] for r in records] == ["wedge_proven", "restart", "restart_command"]
    heard = records[-1]
    assert heard["command"]["exit_code"] == 0 and heard["command"]["argv"] == list(command)
    assert "unsettled" in heard, heard


def test_systemd_hears_stopping_when_the_stop_begins_not_after_the_grace(
    urls: Urls, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """STOPPING=1 came only once the restart commands' grace and the last settle were over
    (up to 30 s after SIGTERM): all that while systemd took the daemon for a running one
    that had stopped petting its watchdog (a SIGTERM not sent by systemd itself: `kill`,
    `systemctl kill`), and could abort it in the middle of saving the commands' outcomes."""
    address = str(tmp_path / "notify.sock")
    monkeypatch.setenv("NOTIFY_SOCKET", address)
    monkeypatch.setattr(daemon_module, "SHUTDOWN_GRACE", PATIENCE)
    started, go = tmp_path / "command.pid", tmp_path / "command.go"
    command = (sys.executable, "-c", SLOW_RESTART, str(started), str(go))
    backend = config_module.Backend("w", urls.wedge_b, restart=command)

    def load() -> tuple[config_module.Config, list[Target]]:
        config = config_module.Config(timeout=1.0, answer_timeout=1.0, backends=(backend,))
        return config, [Target("w", urls.wedge_b)]

    state = tmp_path / "state.json"
    heard: list[bytes] = []

    async def scenario(sock: socket.socket) -> int:
        daemon = a_daemon(load, StateFile(state), wait=0.1)
        running = asyncio.create_task(daemon.run())
        deadline = time.monotonic() + PATIENCE
        while not (started.exists() and started.read_text()):
            if time.monotonic() > deadline or running.done():
                raise NotObservedError("the restart command did not start")
            await asyncio.sleep(POLL)
        daemon.stop()
        deadline = time.monotonic() + STOP_BOUND
        while b"STOPPING=1" not in heard:
            with contextlib.suppress(BlockingIOError):
                heard.append(sock.recv(4096))
                continue
            if time.monotonic() > deadline:
                break  # the command still runs: nothing more comes until it ends
            await asyncio.sleep(POLL)
        told_while_the_command_ran = b"STOPPING=1" in heard
        go.touch()  # the command ends inside the grace, and its outcome is saved
        code = await asyncio.wait_for(running, PATIENCE)
        assert told_while_the_command_ran, heard
        return code

    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
            sock.bind(address)
            sock.setblocking(False)
            assert asyncio.run(scenario(sock)) == 0
    finally:
        go.touch()
    assert heard.count(b"STOPPING=1") == 1
    audit = [json.loads(line) for line in (tmp_path / "audit.jsonl").read_text().splitlines()]
    assert [r["event"] for r in audit][-1] == "restart_command"


# --- sd_notify, unit ----------------------------------------------------------------------


def receive_one(sock: socket.socket) -> bytes:
    sock.settimeout(5.0)
    return sock.recv(4096)


def test_the_notifier_sends_one_datagram_of_newline_separated_fields_to_a_path(
    tmp_path: Path,
) -> None:
    address = str(tmp_path / "n.sock")
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind(address)
        Notifier(address).send("READY=1", "STATUS=3 serving")
        Notifier(address).send("WATCHDOG=1")
        assert receive_one(sock) == b"READY=1\nSTATUS=3 serving"
        assert receive_one(sock) == b"WATCHDOG=1"


def test_the_notifier_reaches_an_abstract_socket_named_with_an_at_sign() -> None:
    name = f"llmhealth-test-{uuid.uuid4().hex}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind("\0" + name)
        Notifier("@" + name).send("STOPPING=1")
        assert receive_one(sock) == b"STOPPING=1"


def test_the_notifier_never_waits_for_a_systemd_that_takes_nothing(tmp_path: Path) -> None:
    # The datagram is sent from the event loop's thread: a full queue must not hold it.
    address = str(tmp_path / "n.sock")
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind(address)  # and never read: its queue fills after some hundred notices
        notifier = Notifier(address)
        sender = threading.Thread(
            target=lambda: [notifier.send("WATCHDOG=1", "STATUS=x" * 50) for _ in range(5000)],
            daemon=True,
        )
        sender.start()
        sender.join(STOP_BOUND * 6)
        assert not sender.is_alive(), "a send waited for the full queue"
        assert receive_one(sock).startswith(b"WATCHDOG=1")


def test_the_notifier_is_silent_without_systemd_and_when_nobody_listens(tmp_path: Path) -> None:
    Notifier(None).send("READY=1")
    Notifier("").send("READY=1")
    Notifier(str(tmp_path / "nobody.sock")).send("READY=1")  # no such socket: no error
    Notifier("@" + uuid.uuid4().hex).send("WATCHDOG=1")


# --- the fleet stall watch, unit -------------------------------------------------------------

START = 1_000.0


def engine(
    running: float | None = 4.0,
    waiting: float = 8.0,
    finished: float = 0.0,
    sleep_state: str | None = None,
) -> Signals:
    one = EngineSignals(
        "0", running=running, waiting=waiting, finished=finished, sleep_state=sleep_state
    )
    return Signals(engines=(one,))


IDLE = engine(running=0.0, waiting=0.0)


def test_a_fleet_with_work_and_no_finished_request_stalls_at_the_timeout_not_before() -> None:
    watch = StallWatch(started_at=START)
    for at in (START + 1, START + 5, START + 9.9):
        watch.observe({"a": engine(finished=3)}, at)
        assert not watch.stalled(at, 10.0)
    watch.observe({"a": engine(finished=3)}, START + 10)
    assert watch.stalled(START + 10, 10.0)
    assert watch.seconds_since_finished(START + 10) == 10.0


def test_a_fleet_with_nothing_to_do_never_stalls() -> None:
    watch = StallWatch(started_at=START)
    watch.observe({"a": IDLE, "b": IDLE}, START + 3600)
    assert watch.work_pending is False
    assert not watch.stalled(START + 3600, 10.0)
    assert watch.seconds_since_finished(START + 3600) == 3600.0


def test_one_backend_finishing_a_request_clears_the_stall_of_the_whole_fleet() -> None:
    watch = StallWatch(started_at=START)
    watch.observe({"a": engine(finished=5), "b": engine(finished=0)}, START + 1)
    watch.observe({"a": engine(finished=5), "b": engine(finished=0)}, START + 20)
    assert watch.stalled(START + 20, 10.0)
    watch.observe({"a": engine(finished=5), "b": engine(finished=1)}, START + 21)
    assert not watch.stalled(START + 21, 10.0)
    assert watch.last_finished_at == START + 21
    assert watch.seconds_since_finished(START + 25) == 4.0


def test_the_first_sighting_of_a_backend_is_a_baseline_not_progress() -> None:
    watch = StallWatch(started_at=START)
    watch.observe({"a": engine(finished=1_000)}, START + 20)
    assert watch.last_finished_at is None
    assert watch.stalled(START + 20, 10.0)


def test_a_counter_that_went_down_is_a_new_process_not_progress() -> None:
    watch = StallWatch(started_at=START)
    watch.observe({"a": engine(finished=50)}, START + 1)
    watch.observe({"a": engine(finished=2)}, START + 15)  # restarted: counts from zero
    assert watch.last_finished_at is None
    assert watch.stalled(START + 15, 10.0)
    watch.observe({"a": engine(finished=3)}, START + 16)  # progress from the new baseline
    assert watch.last_finished_at == START + 16
    assert not watch.stalled(START + 16, 10.0)


def test_work_on_a_sleeping_engine_or_of_unknown_size_is_not_pending_work() -> None:
    watch = StallWatch(started_at=START)
    watch.observe({"asleep": engine(sleep_state="sleeping")}, START + 60)
    assert not watch.stalled(START + 60, 10.0)
    watch.observe({"multiproc": engine(running=None, waiting=0.0)}, START + 61)
    assert not watch.stalled(START + 61, 10.0)
    watch.observe({"awake": engine(sleep_state="awake")}, START + 62)
    assert watch.stalled(START + 62, 10.0)


def test_time_since_the_last_finished_request_is_never_negative() -> None:
    watch = StallWatch(started_at=START)
    assert watch.seconds_since_finished(START - 5) == 0.0
    watch.observe({"a": engine(finished=1)}, START + 1)
    watch.observe({"a": engine(finished=2)}, START + 2)
    assert watch.seconds_since_finished(START + 1.5) == 0.0


def test_a_wall_clock_stepped_back_holds_back_no_fleet_stall() -> None:
    """A stall watch fed the wall clock (watch's was, and a caller's may be): stepped back
    two hours (NTP correcting a clock that ran ahead), the last finished request stayed
    two hours in the future, and
    a fleet that stalled then was not reported stalled for two hours and the timeout."""
    watch = StallWatch(started_at=START)
    watch.observe({"a": engine(finished=1)}, START + 1)
    watch.observe({"a": engine(finished=2)}, START + 2)
    back = START - 7200
    for at in (back, back + 5, back + 10):
        watch.observe({"a": engine(finished=2)}, at)
    assert watch.seconds_since_finished(back + 10) == 10.0
    assert watch.stalled(back + 10, 10.0)


def test_a_wall_clock_stepped_forward_stalls_no_fleet(
    urls: Urls, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """watch fed the stall watch the wall clock: stepped forward an hour (NTP, a VM
    resumed, `date -s`) while work was pending and no request had finished since the last
    cycle, a fleet seconds old was called stalled (LLMHealthFleetStalled, critical) for a
    stall_timeout of ten minutes. Time since a finished request is the steady clock's."""
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    step = [0.0]

    def load() -> tuple[config_module.Config, list[Target]]:
        config = config_module.Config(
            timeout=1.0, answer_timeout=1.0, read_workers=1, stall_timeout=600.0
        )
        return config, [Target("reader", urls.prefill)]  # work pending, nothing finishes

    daemon = a_daemon(
        load,
        StateFile(tmp_path / "state.json"),
        wait=0.1,
        clock=lambda: time.time() + step[0],
        steady=time.monotonic,
    )

    async def until_cycles(count: int, running: asyncio.Task[int]) -> None:
        deadline = time.monotonic() + PATIENCE
        while daemon._state.cycles < count:
            if time.monotonic() > deadline or running.done():
                raise NotObservedError(f"{count} cycles")
            await asyncio.sleep(POLL)

    async def scenario() -> None:
        running = asyncio.create_task(daemon.run())
        try:
            await until_cycles(3, running)
            step[0] = 3600.0
            await until_cycles(daemon._state.cycles + 2, running)
        finally:
            daemon.stop()
            assert await asyncio.wait_for(running, STOP_BOUND) == 0

    asyncio.run(scenario())
    assert daemon._state.stall.work_pending  # the stall watch saw the work
    assert "fleet stall" not in capsys.readouterr().err


def dies_at_call(monkeypatch: pytest.MonkeyPatch, call: int, message: str) -> Callable[[], int]:
    """Make the probing tasks' ``call``-th examination raise, past examine_once's own
    guard, as a future bug would; how many were made so far, when asked."""
    real_examine_once = readers.examine_once
    calls = 0

    async def dies(*args: Any, **kwargs: Any) -> Any:
        nonlocal calls
        calls += 1
        if calls == call:
            raise RuntimeError(message)
        return await real_examine_once(*args, **kwargs)

    monkeypatch.setattr(readers, "examine_once", dies)
    return lambda: calls


def test_a_probing_task_that_dies_is_logged_counted_and_started_again(
    urls: Urls, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """examine_once turns any failure into a verdict; this injects one past that guard, as
    a future bug would, to show the task is not lost silently."""
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    examinations = dies_at_call(monkeypatch, 1, "injected \x1b[2J fault")
    port = free_port_block(1)

    def load() -> tuple[config_module.Config, list[Target]]:
        return config_module.Config(timeout=1.0, answer_timeout=1.0), [Target("b", urls.busy)]

    daemon = a_daemon(
        load, StateFile(tmp_path / "state.json"), wait=0.1, listen=("127.0.0.1", port)
    )

    async def scenario() -> Page:
        running = asyncio.create_task(daemon.run())
        try:
            deadline = time.monotonic() + PATIENCE
            while True:
                page = await asyncio.to_thread(scrape, port)
                if page is not None and page.verdict("b") == "busy":
                    return page
                if time.monotonic() > deadline or running.done():
                    raise NotObservedError("no verdict from the restarted probing task")
                await asyncio.sleep(POLL)
        finally:
            daemon.stop()
            assert await asyncio.wait_for(running, STOP_BOUND) == 0

    page = asyncio.run(scenario())
    log = capsys.readouterr().err
    assert "b: probing task died (RuntimeError: injected \\x1b[2J fault); started again" in log
    assert "\x1b" not in log
    assert page.get("llmhealth_backend_probe_task_restarts", backend="b") == 1.0
    assert examinations() >= 2


def test_a_fleets_first_reads_start_spread_over_the_first_half_of_the_wait(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """All at once, a big fleet's first reads held every 53 KB body in memory together."""
    backends = [{"name": f"b{i}", "url": f"http://127.0.0.1:{9 + i}"} for i in range(4)]
    config = config_module.from_mapping({"wait": 2.0, "backend": backends}, "<test>")
    targets = [Target(b.name, b.url) for b in config.backends]
    daemon = a_daemon(
        lambda: (config, targets), StateFile(tmp_path / "state.json"), console=Console(quiet=True)
    )
    started: list[tuple[str, float]] = []
    reading = daemon._reading
    assert isinstance(reading, readers.ReadTasks)  # four targets: read in the daemon's loop
    monkeypatch.setattr(
        reading, "_start", lambda target, delay=0.0: started.append((target.name, delay))
    )
    daemon._start_probes()
    assert started == [("b0", 0.0), ("b1", 0.25), ("b2", 0.5), ("b3", 0.75)]


def in_process(
    load: Callable[[], tuple[config_module.Config, list[Target]]],
    tmp_path: Path,
    wait: float | None,
    serving_file: Path | None = None,
) -> Daemon:
    """A daemon in this process, its state in ``tmp_path``, no metrics listener."""
    return a_daemon(load, StateFile(tmp_path / "state.json"), wait=wait, serving_file=serving_file)


def test_sighup_reads_a_backend_it_adds_without_waiting_out_the_wait(
    httpserver: HTTPServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """README: SIGHUP reloads the config, "the rest at once". With a long wait (here
    120 s) the reload was only taken at the next cycle: a backend the reload added went
    unread, and one it dropped kept being read, for up to a whole wait."""
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    read = threading.Event()

    def metrics(_request: Request) -> Response:
        read.set()
        return Response("", status=500)

    httpserver.expect_request("/metrics").respond_with_handler(metrics)
    added = Target("added", httpserver.url_for("").rstrip("/"))
    config = config_module.Config(wait=120.0, timeout=1.0, answer_timeout=1.0, read_workers=1)
    fleets = [[Target("first", REFUSED_URL)]]
    daemon = in_process(lambda: (config, fleets[-1]), tmp_path, None)

    async def scenario() -> bool:
        running = asyncio.create_task(daemon.run())
        try:
            # Up and reading: its first target was examined.
            for _ in range(int(PATIENCE / 0.05)):
                probe = daemon._state.probes.get("first")
                if probe is not None and probe.examinations:
                    break
                await asyncio.sleep(0.05)
            fleets.append([Target("first", REFUSED_URL), added])
            os.kill(os.getpid(), signal.SIGHUP)
            return await asyncio.to_thread(read.wait, PATIENCE)
        finally:
            daemon.stop()
            assert await asyncio.wait_for(running, 10.0) == 0

    assert asyncio.run(scenario()), "the backend SIGHUP added was not read"


@pytest.mark.slow
def test_a_reload_that_renames_a_backend_keeps_the_longest_step_it_was_seen_to_take(
    httpserver: HTTPServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The record keeps the longest step a backend took, across restarts and renames
    (``fleet.Sighting``), and a daemon's reading starts with it. Renamed by a reload at
    its server, the backend was read afresh without it: an engine inside a long step
    (here frozen, an old process whose histograms show only short gaps) was wedged at
    two waits, and its busy server restarted."""
    from llmhealth.cycle import fresh_record, ledger_policy  # noqa: PLC0415
    from llmhealth.fleet import Sighting  # noqa: PLC0415
    from llmhealth.window import LongestStep  # noqa: PLC0415

    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    frozen = (Path(__file__).parent.parent / "fixtures" / "vllm-0.32" / "wedge-1.txt").read_text()
    httpserver.expect_request("/metrics").respond_with_data(frozen, content_type="text/plain")
    url = httpserver.url_for("").rstrip("/")
    config = config_module.Config(timeout=1.0, answer_timeout=1.0, read_workers=1)
    store = StateFile(tmp_path / "state.json")
    now = time.time()
    record = fresh_record(ledger_policy(config.policy), {"a": url}, now - 100)
    step = LongestStep(600.0, "a long prefill seen")  # a window of 1,800 s
    record.sightings["a"] = Sighting(now - 10, True, parse_metrics(frozen), step)
    with store.locked():
        store.save(record.to_document())
    fleets = [[Target("a", url)]]
    daemon = in_process(lambda: (config, fleets[-1]), tmp_path, 0.1)

    def state(name: str) -> str | None:
        snap = daemon._snapshots.get(name)
        return None if snap is None else str(snap.state)

    async def read_a_few_times(name: str) -> str | None:
        for _ in range(int(PATIENCE / 0.02)):
            probe = daemon._state.probes.get(name)
            if (probe is not None and probe.examinations >= 6) or state(name) == "dead":
                break
            await asyncio.sleep(0.02)
        settled = daemon._state.cycles
        while daemon._state.cycles < settled + 2:  # what it read, settled
            await asyncio.sleep(0.02)
        return state(name)

    async def scenario() -> tuple[str | None, str | None]:
        running = asyncio.create_task(daemon.run())
        try:
            before = await read_a_few_times("a")
            fleets.append([Target("b", url)])
            os.kill(os.getpid(), signal.SIGHUP)
            return before, await read_a_few_times("b")
        finally:
            daemon.stop()
            assert await asyncio.wait_for(running, 10.0) == 0

    # Before: ("healthy", "dead"), "b: healthy -> dead: wedged: ... window two waits".
    assert asyncio.run(scenario()) == ("healthy", "healthy")
    assert [r["event"] for r in read(tmp_path / "audit.jsonl")] == ["renamed"]


@pytest.mark.parametrize(
    ("condemned_at", "kept_aside", "after", "read_as"),
    [
        # Left the config DEAD, kept aside with its sighting; back by a SIGHUP at another
        # server (read there before any restart), its reading started without its step.
        ("left", True, {"x": "elsewhere", "a": "url"}, "a"),
        # Its server back under a new name, which the record renames it to.
        ("url", True, {"x": "elsewhere", "b": "url"}, "b"),
        # {a (condemned): u0, x: u1} -> {b: u0, a: u1}: renamed to b at u0, the names
        # staying configured (``FleetRecord.renames``).
        ("url", False, {"b": "url", "a": "elsewhere"}, "b"),
    ],
    ids=["back-elsewhere", "kept-named-anew", "shifted"],
)
def test_a_reload_that_brings_a_condemned_record_back_keeps_the_longest_step_it_took(
    httpserver: HTTPServer,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    condemned_at: str,
    kept_aside: bool,
    after: dict[str, str],
    read_as: str,
) -> None:
    """A condemned backend's record keeps the longest step it took (``fleet.Sighting``);
    a reading that starts with it at a daemon's start waits out that window. Brought back
    by a SIGHUP (kept aside, renamed, shifted), the reading of its server started without
    it: an engine inside a long step (frozen, as in the rename test) was proven wedged at
    two waits, and its busy server restarted."""
    from llmhealth.cycle import fresh_record, ledger_policy  # noqa: PLC0415
    from llmhealth.fleet import Sighting  # noqa: PLC0415
    from llmhealth.ledger import Condemned  # noqa: PLC0415
    from llmhealth.window import LongestStep  # noqa: PLC0415

    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    frozen = (Path(__file__).parent.parent / "fixtures" / "vllm-0.32" / "wedge-1.txt").read_text()
    httpserver.expect_request("/metrics").respond_with_data(frozen, content_type="text/plain")
    urls = {
        "url": httpserver.url_for("").rstrip("/"),
        "elsewhere": "http://127.0.0.1:9",  # nothing listens: "x" reads as down, and that is all
        "left": "http://127.0.0.1:11",  # where it was condemned, when it comes back elsewhere
    }
    config = config_module.Config(timeout=1.0, answer_timeout=1.0, read_workers=1)
    store = StateFile(tmp_path / "state.json")
    now = time.time()
    backends = {"a": urls[condemned_at], "x": urls["elsewhere"]}
    record = fresh_record(ledger_policy(config.policy), backends, now - 100)
    record.ledger.apply("a", Condemned(now=now - 90, reason="a test's condemnation"))
    step = LongestStep(600.0, "a long prefill seen")  # a window of 1,800 s
    record.sightings["a"] = Sighting(now - 80, True, parse_metrics(frozen), step)
    if kept_aside:
        record.reconcile({"x": urls["elsewhere"]}, now - 50)
        assert "a" in record.withheld_forgotten
    with store.locked():
        store.save(record.to_document())
    first = {"x": backends["x"]} if kept_aside else backends
    fleets = [[Target(name, url) for name, url in first.items()]]
    daemon = in_process(lambda: (config, fleets[-1]), tmp_path, 0.1)

    async def kinds_read(name: str) -> list[str]:
        kinds: list[str] = []
        for _ in range(int(PATIENCE / 0.02)):
            probe = daemon._state.probes.get(name)
            if probe is not None and probe.outcome is not None:
                kind = str(probe.outcome.verdict.kind)
                if not kinds or kinds[-1] != kind:
                    kinds.append(kind)
            if probe is not None and probe.examinations >= 6:
                break
            await asyncio.sleep(0.02)
        probe = daemon._state.probes.get(name)
        # Read past two waits, or "not wedged" proves nothing (a reload that never came).
        assert probe is not None and probe.examinations >= 6, f"{name} was not read enough"
        return kinds

    async def scenario() -> list[str]:
        running = asyncio.create_task(daemon.run())
        try:
            settled = daemon._state.cycles
            while daemon._state.cycles < settled + 2:
                await asyncio.sleep(0.02)
            fleets.append([Target(name, urls[where]) for name, where in after.items()])
            os.kill(os.getpid(), signal.SIGHUP)
            return await kinds_read(read_as)
        finally:
            daemon.stop()
            assert await asyncio.wait_for(running, 10.0) == 0

    # Before: ["busy", "wedged"]: the long step it was seen to take was not its reading's.
    assert "wedged" not in asyncio.run(scenario())


@pytest.mark.slow
def test_a_daemon_whose_backends_are_renamed_keeps_nothing_of_the_names_they_left(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Pods: each deploy renames the backends and reloads. What the daemon keeps per
    backend name must follow the config, not grow by every name it ever had (the
    router's model lists, the stall watch's finished counts)."""
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    config = config_module.Config(timeout=1.0, answer_timeout=1.0, read_workers=1)
    generation = [0]
    with running_simulator(["idle", "busy"]) as sim:

        def load() -> tuple[config_module.Config, list[Target]]:
            return config, [Target(f"pod{generation[0]}-{i}", u) for i, u in enumerate(sim.urls)]

        daemon = in_process(load, tmp_path, 0.2)

        async def seen_by_a_settle(names: set[str]) -> None:
            for _ in range(int(PATIENCE / 0.05)):
                if names <= daemon._state.stall._finished.keys() and any(
                    n in daemon._models for n in names
                ):
                    return
                await asyncio.sleep(0.05)
            raise AssertionError(f"{names} never settled")

        async def scenario() -> tuple[set[str], set[str], set[str]]:
            running = asyncio.create_task(daemon.run())
            try:
                for _ in range(5):
                    await seen_by_a_settle({f"pod{generation[0]}-{i}" for i in range(2)})
                    generation[0] += 1
                    os.kill(os.getpid(), signal.SIGHUP)
                await seen_by_a_settle({f"pod{generation[0]}-{i}" for i in range(2)})
                now = {t.name for t in daemon._targets}
                return now, set(daemon._models), set(daemon._state.stall._finished)
            finally:
                daemon.stop()
                assert await asyncio.wait_for(running, 10.0) == 0

        configured, models, finished = asyncio.run(scenario())
    assert models <= configured, sorted(models - configured)
    assert finished <= configured, sorted(finished - configured)


@pytest.mark.parametrize("refused_thread", ["llmhealth-cycle", "llmhealth-hook"])
def test_a_settle_or_hook_that_gets_no_thread_is_put_off_not_the_end_of_watch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, refused_thread: str
) -> None:
    """Out of threads (a pids limit), starting the settle's thread raised out of the loop
    and ended `watch`, the verdicts and command outcomes it held with it; the serving
    hook's likewise. The cycle is skipped, the hook run after the next settle."""
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    real_start = threading.Thread.start
    refused = threading.Event()

    def start(self: threading.Thread) -> None:
        if self.name == refused_thread and not refused.is_set():
            refused.set()
            raise RuntimeError("can't start new thread")
        real_start(self)

    monkeypatch.setattr(threading.Thread, "start", start)
    hook_log = tmp_path / "hook.log"
    config = config_module.Config(
        timeout=1.0, answer_timeout=1.0, read_workers=1, on_serving_change=append_command(hook_log)
    )
    daemon = in_process(
        lambda: (config, [Target("b", REFUSED_URL)]), tmp_path, 0.2, tmp_path / "serving.json"
    )

    async def scenario() -> int:
        running = asyncio.create_task(daemon.run())
        for _ in range(int(PATIENCE / 0.05)):
            if (daemon._state.cycles >= 2 and hook_log.exists()) or running.done():
                break
            await asyncio.sleep(0.05)
        cycles = daemon._state.cycles
        daemon.stop()
        assert await asyncio.wait_for(running, 10.0) == 0
        return cycles

    cycles = asyncio.run(scenario())
    assert refused.is_set()
    assert cycles >= 2
    assert hook_log.read_text().startswith("changed\n")


def test_a_reload_that_shortens_the_wait_does_not_wait_out_the_old_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """README: SIGHUP applies "the rest at once, between two settles, without waiting out
    the wait". A wait cut from 600 s to 0.5 s is still waited out: the next settle stays
    due 600 s after the last, while the probes already read every 0.5 s. Nor may the
    probe sleep out the old wait: it slept 600 s, and the settles had nothing to settle."""
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    configs = [config_module.Config(wait=600.0, timeout=1.0, answer_timeout=1.0, read_workers=1)]
    targets = [Target("first", REFUSED_URL)]
    daemon = in_process(lambda: (configs[-1], targets), tmp_path, None)
    state = tmp_path / "state.json"

    async def scenario() -> bool:
        running = asyncio.create_task(daemon.run())
        try:
            for _ in range(int(PATIENCE / 0.05)):  # up and reading
                probe = daemon._state.probes.get("first")
                if probe is not None and probe.examinations:
                    break
                await asyncio.sleep(0.05)
            assert not state.exists()  # no settle yet: the first is due one wait in
            configs.append(
                config_module.Config(wait=0.5, timeout=1.0, answer_timeout=1.0, read_workers=1)
            )
            os.kill(os.getpid(), signal.SIGHUP)
            for _ in range(int(PATIENCE / 0.05)):
                probe = daemon._state.probes.get("first")
                if state.exists() and probe is not None and probe.examinations >= 3:
                    return True
                await asyncio.sleep(0.05)
            return False
        finally:
            daemon.stop()
            assert await asyncio.wait_for(running, 10.0) == 0

    settled = asyncio.run(scenario())
    assert daemon._wait == 0.5, "the reload was not applied"
    assert settled, "no settle, or no read, within PATIENCE of a reload to a 0.5 s wait (600 s)"


@pytest.mark.slow
@pytest.mark.parametrize("forced", ["FORCE_COLOR", "TTY_COMPATIBLE"])
def test_watch_told_its_log_is_a_terminal_outlives_the_log_reader(
    entry_point: str, forced: str
) -> None:
    """FORCE_COLOR=1 (or TTY_COMPATIBLE=1), as a container or CI environment may set it:
    rich takes the pipe for a terminal, the daemon logs through its console, and rich's
    answer to the reader gone was SystemExit(1): `watch ... 2>&1 | logger` died with it."""
    with ExitStack() as stack:
        watch = _watch_whose_log_reader_leaves(entry_point, stack, {forced: "1"})
        first = watch.until("a cycle", lambda page: page.last_cycle is not None)
        watch.next_cycle(watch.next_cycle(first))  # each cycle logged a line to nobody
        assert watch.stop()[0] == 0


def _watch_whose_log_reader_leaves(
    entry_point: str, stack: ExitStack, forced: Mapping[str, str]
) -> Watch:
    """`watch` logging to a pipe whose reader reads the first line and leaves."""
    read_end, write_end = os.pipe()
    try:
        watch = _watch_logging_to(entry_point, write_end, stack, forced)
    finally:
        os.close(write_end)
    with os.fdopen(read_end, "rb") as log:
        assert b"metrics on" in log.readline(), "it logs to its stderr"
    return watch  # its log's reader is gone from here on


def _watch_logging_to(
    entry_point: str,
    log: int,
    stack: ExitStack,
    forced: Mapping[str, str] | None = None,
    given: Sequence[str] = (REFUSED_URL,),
) -> Watch:
    """`watch` of ``given`` (a refused URL) whose stderr is ``log`` (``forced``:
    environment variables set for it); reaped by ``stack``."""
    port = free_port_block(1)
    environment = child_env()
    for name in ("NOTIFY_SOCKET", "FORCE_COLOR", "TTY_COMPATIBLE"):
        environment.pop(name, None)
    environment.update(forced or {})
    unused = stack.enter_context(tempfile.TemporaryFile())  # noqa: SIM115 - stack closes it
    process = subprocess.Popen(
        [entry_point, "watch", *given, "--wait", str(WAIT), "--listen", f"127.0.0.1:{port}"],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=log,
        env=environment,
        start_new_session=True,  # a terminal given as its log is not its controlling one
    )

    def reap() -> None:
        if process.poll() is None:
            process.kill()
        process.wait(STOP_BOUND)

    stack.callback(reap)
    return Watch(process, port, unused)


@pytest.mark.slow
def test_watch_outlives_a_log_on_a_full_disk(entry_point: str) -> None:
    """`watch ... 2>>/var/log/llmhealth.log` with the disk full: the next log line raised
    OSError (ENOSPC) and the daemon exited 1, routing and restarts with it, in the very
    incident that filled the disk."""
    with ExitStack() as stack, open("/dev/full", "wb") as full:
        watch = _watch_logging_to(entry_point, full.fileno(), stack)
        first = watch.until("a cycle", lambda page: page.last_cycle is not None)
        watch.next_cycle(watch.next_cycle(first))  # each cycle logged a line it could not
        assert watch.stop()[0] == 0


@pytest.mark.slow
def test_watch_outlives_the_terminal_it_logs_to(entry_point: str) -> None:
    """`llmhealth watch ... & disown`, and the terminal closed: each write to it fails
    with EIO, which rich does not take as a broken pipe, and the daemon exited 1."""
    import pty  # noqa: PLC0415

    master, terminal = pty.openpty()
    with ExitStack() as stack:
        try:
            watch = _watch_logging_to(entry_point, terminal, stack)
        finally:
            os.close(terminal)
        try:
            assert b"metrics on" in os.read(master, 4096), "it logs to its terminal"
        finally:
            os.close(master)  # the terminal hangs up
        first = watch.until("a cycle", lambda page: page.last_cycle is not None)
        watch.next_cycle(watch.next_cycle(first))  # each cycle logged a line to nobody
        assert watch.stop()[0] == 0


def _fill(write_end: int) -> None:
    """Fill a pipe (shrunk to 4 KiB) through its write end, which stays blocking."""
    fcntl.fcntl(write_end, fcntl.F_SETPIPE_SZ, 4096)
    os.set_blocking(write_end, False)
    with contextlib.suppress(BlockingIOError):
        while True:
            os.write(write_end, b"x" * 512)
    os.set_blocking(write_end, True)


@pytest.mark.slow
def test_watch_goes_on_while_the_reader_of_its_log_stops_reading(entry_point: str) -> None:
    """`watch ... 2>&1 | less` left unscrolled, a log shipper or container log driver that
    stalls: its pipe full, the next log line's write blocked the event loop for as long
    as nobody read. No cycle, no watchdog ping, no routing; and SIGTERM, whose handler
    runs on that loop, was ignored until systemd's SIGKILL."""
    read_end, write_end = os.pipe()
    with ExitStack() as stack, os.fdopen(read_end, "rb"):  # held open, never read
        _fill(write_end)  # full before the daemon's first line
        try:
            watch = _watch_logging_to(entry_point, write_end, stack)
        finally:
            os.close(write_end)
        first = watch.until("a cycle", lambda page: page.last_cycle is not None)
        watch.next_cycle(watch.next_cycle(first))  # each cycle a line nobody takes
        code, took = watch.stop()
        assert code == 0
        assert took < STOP_BOUND


@pytest.mark.slow
def test_a_cluster_member_goes_on_leading_while_the_reader_of_its_log_stops_reading(
    entry_point: str, tmp_path: Path
) -> None:
    """The elector logs from its own thread ("cluster: ... leads"): written there to a
    log nobody read, that thread blocked and kept the lease alive no more. The only
    member of the fleet lost its leadership a TTL on, and with it every restart, for as
    long as nobody read; its stop waited the TTL for the elector's thread."""
    read_end, write_end = os.pipe()
    with running_etcd(tmp_path / "etcd") as etcd, ExitStack() as stack:
        config = tmp_path / "llmhealth.toml"
        config.write_text(
            f'[[backend]]\nname = "a"\nurl = "{REFUSED_URL}"\n\n'
            f'[cluster]\netcd = ["{etcd.endpoints[0]}"]\nprefix = "/stalled"\nlease_ttl = "2s"\n'
        )
        stack.enter_context(os.fdopen(read_end, "rb"))  # held open, never read
        _fill(write_end)  # full before the daemon's first line
        try:
            watch = _watch_logging_to(
                entry_point, write_end, stack, given=["--config", str(config)]
            )
        finally:
            os.close(write_end)
        first = watch.until("a cycle", lambda page: page.last_cycle is not None)
        time.sleep(3 * 2.0)  # past the lease's TTL, many times its renewal
        page = watch.next_cycle(first)
        leads = [s.value for s in page.samples("llmhealth_cluster_leader")]
        assert leads == [1.0], f"leadership lost: {page.text}"
        assert (page.get("llmhealth_cluster_leader_fence") or 0.0) > 0
        code, took = watch.stop()
        assert code == 0
        assert took < STOP_BOUND


def test_a_reload_that_only_respells_or_renames_keeps_what_the_server_was_seen_serving(
    tmp_path: Path,
) -> None:
    """A busy backend is never sent the tiny request that lists its models: the list the
    daemon learned is kept "while the backend is busy" (``_remember_models``). A reload
    that only wrote its URL another way (same_server, as the router and the settle take
    it), or renamed it at its server, dropped it: pushed as serving any model, it was
    sent every other model's requests (a 404 to each client) and left /v1/models."""
    from llmhealth.config import Backend  # noqa: PLC0415
    from llmhealth.config import Router as RouterConfig  # noqa: PLC0415
    from llmhealth.ledger import Ledger, LedgerPolicy  # noqa: PLC0415
    from llmhealth.router import Router  # noqa: PLC0415

    fleets = [
        [Target("b", "http://127.0.0.1:80"), Target("c", "http://127.0.0.2:8000")],
        [Target("b", "HTTP://127.0.0.1"), Target("node-c", "http://127.0.0.2:8000")],
    ]
    config = config_module.Config(timeout=1.0, answer_timeout=1.0)

    async def scenario() -> dict[str, object]:
        router = Router(RouterConfig(), [Backend(t.name, t.url) for t in fleets[0]])
        daemon = settled_by_hand(tmp_path, lambda: fleets[0], config=config, router=router)
        try:
            daemon._models.update(b=frozenset({"m1"}), c=frozenset({"m2"}))
            fleets.pop(0)
            daemon._reload_config()
            now = time.time()
            ledger = Ledger(LedgerPolicy(), [(t.name, t.url) for t in fleets[0]], now=now)
            daemon._snapshots = {snap.name: snap for snap in ledger.snapshots(now)}
            daemon._push_router()
            return dict(router._serving)
        finally:
            await daemon._reading.close()
            await router.close()

    assert asyncio.run(scenario()) == {"b": frozenset({"m1"}), "node-c": frozenset({"m2"})}


def test_a_restart_command_heard_after_a_rename_counts_under_the_new_name(
    tmp_path: Path,
) -> None:
    """The settle hears a command's outcome under the name its server has now (its
    audit line, the ledger's DEAD); the daemon counted the failure under the name the
    order was issued as, which the reload had dropped: a frozen series of a backend no
    longer configured, and LLMHealthRestartsFailing one failure short for the renamed."""
    from llmhealth.cycle import backend_urls, settle_fleet  # noqa: PLC0415
    from llmhealth.remediate import CommandDone, Mode  # noqa: PLC0415

    url = "http://127.0.0.1:9"
    restart = ("systemctl", "restart", "vllm@0")
    before = config_module.Config(backends=(config_module.Backend("gpu0", url, restart=restart),))
    after = config_module.Config(
        backends=(config_module.Backend("node-gpu0", url, restart=restart),)
    )
    store = StateFile(tmp_path / "state.json")
    wedged = Verdict(VerdictKind.WEDGED, False, "wedged: steps 5→5→5")
    issued = settle_fleet(
        store,
        before,
        backend_urls([Target("gpu0", url)]),
        lambda _record: [Outcome(Target("gpu0", url), wedged)],
        mode=Mode.ACT,
        audit=None,
    )
    [order] = issued.orders
    configs = [(before, [Target("gpu0", url)]), (after, [Target("node-gpu0", url)])]

    async def scenario() -> dict[tuple[str, str], int]:
        daemon = a_daemon(lambda: configs[0], store, console=Console(file=io.StringIO()))
        try:
            configs.pop(0)
            daemon._reload_config()  # SIGHUP while the command runs: a new name, same server
            failed = CommandDone(order, CommandResult(restart, 1, False, 0.1, "", "no unit"))
            settled = daemon._settle(daemon_module.News([], [failed]))
            assert settled.record.ledger.state_of("node-gpu0") == "dead"
            daemon._after_cycle(settled.report, 0.0, None, None)
            return dict(daemon._state.restarts)
        finally:
            await daemon._reading.close()

    assert asyncio.run(scenario()) == {("node-gpu0", "failed"): 1}


def _saved_restarting(store: StateFile, url: str, then: float) -> None:
    """gpu0 proven wedged and restarted at ``then`` by an earlier run, its old process
    sighted (started long before), the command's outcome never heard."""
    from llmhealth.cycle import fresh_record, ledger_policy  # noqa: PLC0415
    from llmhealth.fleet import Sighting  # noqa: PLC0415
    from llmhealth.ledger import RestartIssued, WedgeProven  # noqa: PLC0415
    from llmhealth.policy import RestartHistory  # noqa: PLC0415

    policy = ledger_policy(config_module.Config(backends=()).policy)
    record = fresh_record(policy, {"gpu0": url}, now=then - 100)
    record.ledger.apply("gpu0", WedgeProven(now=then - 10, evidence="steps 10→10→10"))
    record.ledger.apply("gpu0", RestartIssued(now=then))
    record.restarts["gpu0"] = RestartHistory(0, then)
    engine = EngineSignals(
        engine="0", running=4.0, waiting=8.0, steps=10.0, generation_tokens=40.0,
        prompt_tokens=48.0, finished=1.0, preemptions=0.0, kv_usage=0.1,
    )  # fmt: skip
    old = Signals(engines=(engine,), process_start=then - 5000)
    record.sightings["gpu0"] = Sighting(then - 10, True, old)
    with store.locked():
        store.save(record.to_document())


@pytest.mark.slow
def test_a_restart_past_its_grace_is_not_failed_before_the_new_daemon_read_it(
    entry_point: str, tmp_path: Path
) -> None:
    """The daemon was down (an upgrade, a crash loop) longer than startup_grace while a
    restart was under way, and the replacement came up meanwhile and serves. The new
    daemon's first settle, before any verdict of it, failed that restart ("no new process
    within the startup grace"), counted it failed and restarted the busy server."""
    marker = tmp_path / "restarted"
    with running_simulator(["busy"]) as sim:  # its process started an hour ago
        url = sim.urls[0]
        state = tmp_path / "state.json"
        _saved_restarting(StateFile(state), url, time.time() - 5000)
        config = write_config(
            tmp_path / "fleet.toml",
            fleet_config([{"name": "gpu0", "url": url, "restart": touch_command(marker)}]),
        )
        with watching(entry_point, config, state) as watch:
            watch.until("its replacement seen", lambda page: page.state("gpu0") == "stale")
            rc, _ = watch.stop()
    assert rc == 0
    events = [(r["event"], r.get("to")) for r in read(tmp_path / "audit.jsonl")]
    assert ("startup_expired", "dead") not in events, events
    assert not marker.exists()


def test_a_route_reload_to_a_config_with_no_backend_is_refused_as_its_start_is(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`route` refuses to start with no backend ("nothing to route to"); its reload took a
    file naming only a [[proxy]] (which `config check --for-reload`, the unit's
    ExecReload, passes): the router was left with no backend, every client's request
    refused, and every backend forgotten with its retirement, proof and budget."""
    from llmhealth.config import Backend  # noqa: PLC0415
    from llmhealth.config import Router as RouterConfig  # noqa: PLC0415
    from llmhealth.router import Router  # noqa: PLC0415

    backend = Target("b", "http://127.0.0.1:9")
    fleets = [
        (config_module.Config(), [backend]),
        (
            config_module.Config(proxies=(config_module.Proxy("lb", "http://127.0.0.1:10"),)),
            [Target("lb", "http://127.0.0.1:10", "proxy")],
        ),
    ]

    async def scenario() -> list[str]:
        router = Router(RouterConfig(), [Backend(backend.name, backend.url)])
        daemon = a_daemon(lambda: fleets[0], StateFile(tmp_path / "state.json"), router=router)
        try:
            fleets.pop(0)
            daemon._reload_config()
            return list(router._backends)
        finally:
            await daemon._reading.close()
            await router.close()

    assert asyncio.run(scenario()) == ["b"]
    assert "reload refused, keeping the running config: nothing to route to" in (
        capsys.readouterr().err
    )


@pytest.mark.parametrize(
    "edit",
    [
        lambda text: "wait = 1" + "0" * 400 + "\n" + text,
        lambda text: text + f'restart = ["/{"a" * 5000} x"]\n',
    ],
    ids=["a duration past a float's range", "a restart program no path can name"],
)
def test_a_reload_to_a_file_python_itself_refuses_is_refused_and_the_daemon_goes_on(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], edit: Callable[[str], str]
) -> None:
    """`wait = 1000...0` (400 digits, within Python's digit limit) raised OverflowError,
    and a restart program with a space, past the file system's name limit, was looked up
    on disk and raised OSError (ENAMETOOLONG): neither did the reload take for a bad
    config, and SIGHUP ended `watch` with a traceback."""
    path = tmp_path / "llmhealth.toml"
    path.write_text('[[backend]]\nname = "b"\nurl = "http://127.0.0.1:9"\n')

    def load() -> tuple[config_module.Config, list[Target]]:
        loaded = config_module.load(path)
        return loaded, config_module.targets_for(loaded, [], [])

    daemon = a_daemon(load, StateFile(tmp_path / "state.json"))
    path.write_text(edit(path.read_text()))
    try:
        daemon._reload_config()
    finally:
        asyncio.run(daemon._reading.close())
    assert daemon._config.wait == config_module.DEFAULT_WAIT
    assert daemon._config.backends[0].restart == ()
    assert "reload refused, keeping the running config" in capsys.readouterr().err


def test_a_members_serials_keep_no_backend_the_config_no_longer_names(tmp_path: Path) -> None:
    """Counted by name for the leader's intake, every backend a daemon ever watched kept
    its count for as long as the daemon ran, copied into each wait's publication: a
    fleet whose names change (pods) grew it by a name per rollout. A backend that leaves
    and comes back still never repeats a serial the leader may have settled."""
    names = iter(f"pod-{n}" for n in range(1000))
    current = [Target(next(names), REFUSED_URL)]
    daemon = a_daemon(
        lambda: (config_module.Config(), list(current)), StateFile(tmp_path / "state.json")
    )
    daemon._shares = cast(Any, object())  # a member's: only its presence is asked here
    idle = Verdict(VerdictKind.IDLE, True, "idle")
    published: list[int] = []

    async def rollouts() -> None:
        for _ in range(20):
            daemon._start_probes()
            daemon.hear(current[0], idle, 0.01)
            daemon._take_fresh()
            publication = daemon._publication()
            assert publication is not None
            published.append(publication.serials[current[0].name])
            current[0] = Target(next(names), REFUSED_URL)  # the next rollout's pod
            daemon._reload_config()
        assert set(daemon._serials) <= {current[0].name}
        back = Target("pod-0", REFUSED_URL)
        current[0] = back
        daemon._reload_config()
        daemon.hear(back, idle, 0.01)
        daemon._take_fresh()
        publication = daemon._publication()
        assert publication is not None
        assert publication.serials["pod-0"] not in published
        await daemon._reading.close()

    asyncio.run(rollouts())


@pytest.mark.slow  # a 3 s shutdown grace run out
def test_the_last_settle_of_a_stop_does_not_fail_a_restart_whose_command_still_runs(
    urls: Urls, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """While its command runs, a restart's startup grace does not run out (a command that
    waits for its server to be ready, a restart_timeout past the grace, costs time, not
    attempts); every settle is told which commands run. The last settle of a stop, which
    saves the commands that ended within the shutdown grace, was not: it failed the
    restart of a command still running (`startup_expired`, the cooldown doubled) and the
    trail said its new process was never re-admitted while the command was still at it."""
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    # Long enough for the quick command and the last settle; the slow one outlasts it.
    monkeypatch.setattr(daemon_module, "SHUTDOWN_GRACE", 3.0)
    slow_started, slow_go = tmp_path / "slow.pid", tmp_path / "slow.go"
    quick_started, quick_go = tmp_path / "quick.pid", tmp_path / "quick.go"
    backends = (
        config_module.Backend(
            "slow",
            urls.wedge_a,
            restart=(sys.executable, "-c", SLOW_RESTART, str(slow_started), str(slow_go)),
        ),
        config_module.Backend(
            "quick",
            urls.wedge_b,
            restart=(sys.executable, "-c", SLOW_RESTART, str(quick_started), str(quick_go)),
        ),
    )
    policy = config_module.Policy(max_concurrent_restarts=2, startup_grace=1.0)

    def load() -> tuple[config_module.Config, list[Target]]:
        config = config_module.Config(
            timeout=1.0, answer_timeout=1.0, backends=backends, policy=policy
        )
        return config, [Target("slow", urls.wedge_a), Target("quick", urls.wedge_b)]

    daemon = a_daemon(load, StateFile(tmp_path / "state.json"), wait=0.1)

    async def scenario() -> int:
        running = asyncio.create_task(daemon.run())
        deadline = time.monotonic() + PATIENCE
        while not (slow_started.exists() and quick_started.exists()):
            if time.monotonic() > deadline or running.done():
                raise NotObservedError("the restart commands did not start")
            await asyncio.sleep(POLL)
        await asyncio.sleep(1.5)  # both restarts' graces are over: their commands run on
        daemon.stop()
        quick_go.touch()  # one command ends within the shutdown grace: a last settle
        return await asyncio.wait_for(running, PATIENCE)  # the other is left running

    try:
        assert asyncio.run(scenario()) == 0
    finally:
        slow_go.touch()
        quick_go.touch()
    audit = [json.loads(line) for line in (tmp_path / "audit.jsonl").read_text().splitlines()]
    heard = [r["backend"] for r in audit if r["event"] == "restart_command"]
    assert "quick" in heard  # the last settle ran
    expired = [r["backend"] for r in audit if r["event"] == "startup_expired"]
    assert "slow" not in expired, "failed while its command still ran"


def clocked_daemon(
    load: Callable[[], tuple[config_module.Config, list[Target]]],
    store: StateFile,
    wall: list[float],
    ticks: list[float],
) -> Daemon:
    """A daemon on a wall clock and a steady one the test moves (``wall[0]``, ``ticks[0]``)."""
    return a_daemon(
        load,
        store,
        console=Console(file=io.StringIO()),
        clock=lambda: wall[0],
        steady=lambda: ticks[0],
    )


def command_heard(daemon: Daemon, order: RestartOrder, argv: tuple[str, ...]) -> None:
    """The daemon hears ``order``'s restart command exit 0 now (on its event loop)."""
    ran: asyncio.Future[CommandDone] = asyncio.get_running_loop().create_future()
    ran.set_result(CommandDone(order, CommandResult(argv, 0, False, 0.1, "", "")))
    daemon._commands_running[ran] = order
    daemon._command_finished(ran)


@pytest.mark.parametrize("step", [0.0, 3600.0], ids=["steady", "wall clock stepped 1 h"])
def test_a_wall_clock_stepped_forward_fails_no_restart_within_its_grace(
    tmp_path: Path, step: float
) -> None:
    """The restart command exited 0 and the new server loads its model (refused the while);
    then the wall clock stepped an hour forward (NTP, a VM resumed, `date -s`). The
    daemon's next settle, seconds later on any steady clock, failed the restart ("no new
    process within the startup grace of 15m") and restarted the server still loading.
    The grace still runs out on the steady clock."""
    from llmhealth.cycle import backend_urls, settle_fleet  # noqa: PLC0415
    from llmhealth.remediate import Mode  # noqa: PLC0415

    restart = ("true",)
    config = config_module.Config(
        backends=(config_module.Backend("gpu0", REFUSED_URL, restart=restart),)
    )
    target = Target("gpu0", REFUSED_URL)
    store = StateFile(tmp_path / "state.json")
    wall, ticks = [time.time()], [1000.0]
    wedged = Verdict(VerdictKind.WEDGED, False, "wedged: steps 5→5→5")
    issued = settle_fleet(
        store,
        config,
        backend_urls([target]),
        lambda _record: [Outcome(target, wedged)],
        mode=Mode.ACT,
        audit=None,
        clock=lambda: wall[0],
    )
    [order] = issued.orders
    down = Verdict(VerdictKind.DOWN, False, "down: connection refused")
    grace = config.policy.startup_grace

    def later(seconds: float, stepped: float = 0.0) -> None:
        wall[0] += seconds + stepped
        ticks[0] += seconds

    async def scenario() -> list[tuple[str, list[str], list[str]]]:
        daemon = clocked_daemon(lambda: (config, [target]), store, wall, ticks)
        seen = []
        try:
            later(2.0)
            command_heard(daemon, order, restart)
            for seconds, stepped in ((3.0, 0.0), (5.0, step), (grace, 0.0)):
                later(seconds, stepped)
                news = daemon_module.News(
                    [Outcome(target, down)], daemon._take_commands(), in_grace=daemon._in_grace()
                )
                settled = daemon._settle(news)
                seen.append(
                    (
                        str(settled.record.ledger.state_of("gpu0")),
                        [t.name for t in settled.report.expired],
                        [o.name for o in settled.orders],
                    )
                )
            return seen
        finally:
            await daemon._reading.close()

    assert asyncio.run(scenario()) == [
        ("restarting", [], []),  # the command's exit heard: the grace counts from here
        ("restarting", [], []),  # still loading, seconds later
        ("restarting", ["gpu0"], ["gpu0"]),  # the grace over: failed, and restarted
    ]


def test_a_wall_clock_stepped_forward_fails_no_restart_a_reload_renamed_in_its_grace(
    tmp_path: Path,
) -> None:
    """The restart command of gpu0 exited 0; a reload then renamed it gpu1 at the same
    server (the ledger keeps its restart under the new name), and the wall clock stepped
    an hour forward. The daemon's sparing went by the order's old name: the next settle
    failed the restart seconds after its command, and restarted the server still loading."""
    from llmhealth.cycle import backend_urls, settle_fleet  # noqa: PLC0415
    from llmhealth.remediate import Mode  # noqa: PLC0415

    restart = ("true",)
    before = config_module.Config(
        backends=(config_module.Backend("gpu0", REFUSED_URL, restart=restart),)
    )
    after = config_module.Config(
        backends=(config_module.Backend("gpu1", REFUSED_URL, restart=restart),)
    )
    old, new = Target("gpu0", REFUSED_URL), Target("gpu1", REFUSED_URL)
    store = StateFile(tmp_path / "state.json")
    wall, ticks = [time.time()], [1000.0]
    wedged = Verdict(VerdictKind.WEDGED, False, "wedged: steps 5→5→5")
    issued = settle_fleet(
        store,
        before,
        backend_urls([old]),
        lambda _record: [Outcome(old, wedged)],
        mode=Mode.ACT,
        audit=None,
        clock=lambda: wall[0],
    )
    [order] = issued.orders
    down = Verdict(VerdictKind.DOWN, False, "down: connection refused")

    async def scenario() -> list[tuple[str, list[str], list[str]]]:
        # The reload's config: gpu0 renamed gpu1.
        daemon = clocked_daemon(lambda: (after, [new]), store, wall, ticks)
        seen = []
        try:
            command_heard(daemon, order, restart)
            for seconds, stepped in ((3.0, 0.0), (5.0, 3600.0)):
                wall[0] += seconds + stepped
                ticks[0] += seconds
                news = daemon_module.News(
                    [Outcome(new, down)], daemon._take_commands(), in_grace=daemon._in_grace()
                )
                settled = daemon._settle(news)
                seen.append(
                    (
                        str(settled.record.ledger.state_of("gpu1")),
                        [t.name for t in settled.report.expired],
                        [o.name for o in settled.orders],
                    )
                )
            return seen
        finally:
            await daemon._reading.close()

    assert asyncio.run(scenario()) == [
        ("restarting", [], []),  # renamed, the command's exit heard
        ("restarting", [], []),  # still loading, seconds later on the steady clock
    ]


@pytest.mark.parametrize("step", [0.0, 3600.0], ids=["steady", "wall clock stepped 1 h"])
def test_a_wall_clock_stepped_forward_frees_no_restart_slot_within_its_grace(
    tmp_path: Path, step: float
) -> None:
    """z was restarted (max_concurrent_restarts 1); its command exited 0, its replacement
    came up and wedged again, DEAD within its startup grace: its restart holds the slot,
    so b, condemned since, waits (a fault they share must not restart them all). The wall
    clock stepped an hour forward: seconds later on any steady clock, the slot was freed
    and b restarted."""
    from llmhealth.cycle import backend_urls, settle_fleet  # noqa: PLC0415
    from llmhealth.metrics import EngineSignals, Signals  # noqa: PLC0415
    from llmhealth.remediate import Mode  # noqa: PLC0415

    restart = ("true",)
    z_url, b_url = REFUSED_URL, "http://127.0.0.2:9"
    config = config_module.Config(
        backends=(
            config_module.Backend("z", z_url, restart=restart),
            config_module.Backend("b", b_url, restart=restart),
        )
    )
    z, b = Target("z", z_url), Target("b", b_url)
    store = StateFile(tmp_path / "state.json")
    wall, ticks = [time.time()], [1000.0]
    wedged = Verdict(VerdictKind.WEDGED, False, "wedged: steps 5→5→5")
    idle = Verdict(VerdictKind.IDLE, True, "idle: answered")
    issued = settle_fleet(
        store,
        config,
        backend_urls([z, b]),
        lambda _record: [Outcome(z, wedged), Outcome(b, idle)],
        mode=Mode.ACT,
        audit=None,
        clock=lambda: wall[0],
    )
    [order] = issued.orders

    def later(seconds: float, stepped: float = 0.0) -> None:
        wall[0] += seconds + stepped
        ticks[0] += seconds

    def signals(start: float, steps: float) -> Signals:
        engine = EngineSignals("0", running=1.0, waiting=0.0, steps=steps, finished=0.0)
        return Signals((engine,), start)

    async def scenario() -> str:
        daemon = clocked_daemon(lambda: (config, [z, b]), store, wall, ticks)
        try:
            later(2.0)
            command_heard(daemon, order, restart)
            later(5.0)
            reads = (
                Read(wall[0] - 5, signals(wall[0] - 300, 50)),
                Read(wall[0], signals(wall[0], 1)),
            )
            new = Verdict(VerdictKind.RESTARTED, False, "restarted: new process", reads=reads)
            rounds = [
                (new, idle, 5.0, 0.0),
                (wedged, wedged, 5.0, 0.0),
                (wedged, wedged, 5.0, step),
            ]
            for z_verdict, b_verdict, seconds, stepped in rounds:
                later(seconds, stepped)
                news = daemon_module.News(
                    [Outcome(z, z_verdict), Outcome(b, b_verdict)],
                    daemon._take_commands(),
                    in_grace=daemon._in_grace(),
                )
                settled = daemon._settle(news)
            return str(settled.record.ledger.state_of("b"))
        finally:
            await daemon._reading.close()

    # z's replacement DEAD again within its grace: b waits for the slot
    assert asyncio.run(scenario()) == "dead"


async def settles_past(daemon: Daemon, cycles: int) -> None:
    """Until the daemon has settled ``cycles`` cycles, with a snapshot of its backend."""
    deadline = time.monotonic() + PATIENCE
    while daemon._state.cycles < cycles or daemon._snapshots.get("a") is None:
        if time.monotonic() > deadline:
            raise NotObservedError(f"{cycles} settles")
        await asyncio.sleep(POLL)


def test_a_daemon_started_while_the_state_is_locked_still_reads_with_the_steps_it_learned(
    httpserver: HTTPServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A `check` (which holds the lock for its whole run, minutes on a frozen backend) or
    an operator's verb holding the state lock when `watch` starts: it starts "without
    earlier reads", and its reading never got the longest step the record keeps, even
    once its settles loaded that record. An engine inside a long step the record knew
    (600 s here) was wedged at two waits, and its busy server restarted."""
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    frozen = (Path(__file__).parent.parent / "fixtures" / "vllm-0.32" / "wedge-1.txt").read_text()
    httpserver.expect_request("/metrics").respond_with_data(frozen, content_type="text/plain")
    url = httpserver.url_for("").rstrip("/")
    config = config_module.Config(timeout=1.0, answer_timeout=1.0, read_workers=1)
    path = tmp_path / "state.json"
    holder = StateFile(path)
    now = time.time()
    record = fresh_record(ledger_policy(config.policy), {"a": url}, now - 100)
    step = LongestStep(600.0, "a long prefill seen")  # a window of 1,800 s
    record.sightings["a"] = Sighting(now - 10, True, parse_metrics(frozen), step)
    with holder.locked():
        holder.save(record.to_document())
    daemon = a_daemon(
        lambda: (config, [Target("a", url)]), StateFile(path, lock_timeout=0.2), wait=0.1
    )
    release = threading.Event()
    held = threading.Event()

    def hold() -> None:  # another run holding the lock past the daemon's first try
        with StateFile(path).locked():
            held.set()
            release.wait(PATIENCE)

    async def scenario() -> str | None:
        holding = threading.Thread(target=hold)
        holding.start()
        held.wait(PATIENCE)
        running = asyncio.create_task(daemon.run())
        try:
            for _ in range(int(PATIENCE / 0.02)):  # read for many waits, nothing saved
                probe = daemon._state.probes.get("a")
                if probe is not None and probe.examinations >= 8:
                    break
                await asyncio.sleep(0.02)
            release.set()
            await asyncio.to_thread(holding.join, PATIENCE)
            settled = daemon._state.cycles
            await settles_past(daemon, settled + 2)
            snap = daemon._snapshots.get("a")
            return None if snap is None else str(snap.state)
        finally:
            release.set()
            daemon.stop()
            assert await asyncio.wait_for(running, 10.0) == 0

    assert asyncio.run(scenario()) == "healthy"


def test_a_probing_task_started_again_still_reads_with_the_step_the_record_keeps(
    httpserver: HTTPServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A probing task that died (a bug past every guard) is started again, "its reads
    start afresh"; but without the longest step the record keeps, which the first task
    took at its first read: a backend inside a long step was wedged at two waits, as a
    lost read worker's replacement (which is handed the record's steps) is not."""
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    dies_at_call(monkeypatch, 2, "injected fault")
    frozen = (Path(__file__).parent.parent / "fixtures" / "vllm-0.32" / "wedge-1.txt").read_text()
    httpserver.expect_request("/metrics").respond_with_data(frozen, content_type="text/plain")
    url = httpserver.url_for("").rstrip("/")
    config = config_module.Config(timeout=1.0, answer_timeout=1.0, read_workers=1)
    store = StateFile(tmp_path / "state.json")
    now = time.time()
    record = fresh_record(ledger_policy(config.policy), {"a": url}, now - 100)
    record.sightings["a"] = Sighting(
        now - 10, True, parse_metrics(frozen), LongestStep(600.0, "a long prefill seen")
    )
    with store.locked():
        store.save(record.to_document())
    daemon = a_daemon(lambda: (config, [Target("a", url)]), store, wait=0.1)

    async def scenario() -> str | None:
        running = asyncio.create_task(daemon.run())
        try:
            for _ in range(int(PATIENCE / 0.02)):
                probe = daemon._state.probes.get("a")
                snap = daemon._snapshots.get("a")
                if (probe is not None and probe.examinations >= 8) or (
                    snap is not None and str(snap.state) == "dead"
                ):
                    break
                await asyncio.sleep(0.02)
            await settles_past(daemon, daemon._state.cycles + 2)
            snap = daemon._snapshots.get("a")
            return None if snap is None else str(snap.state)
        finally:
            daemon.stop()
            assert await asyncio.wait_for(running, 10.0) == 0

    assert asyncio.run(scenario()) == "healthy"
    assert daemon._state.probe_task_restarts["a"] == 1


def test_the_router_routes_to_a_new_process_without_vllm_series_after_one_read_asleep(
    tmp_path: Path,
) -> None:
    """A server read asleep, then replaced by a new process whose /metrics has no vLLM
    series (vLLM started again with --disable-log-stats): a new process starts awake,
    but the window kept the old one's asleep read (``probe.keep_read``) and the router
    sent it no client for ever, as from the record's read after the window's."""
    target = Target("b", REFUSED_URL)
    daemon = quiet_daemon(target, StateFile(tmp_path / "state.json"))
    asleep = parse_metrics(asleep_capture().encode())
    replaced = parse_metrics(b"process_start_time_seconds 1.9e+09\n")
    assert asleep.process_start is not None and replaced.process_start != asleep.process_start
    now = time.time()
    daemon._heard(target, None, 0.01, [Read(now - 5, asleep)])
    assert daemon._asleep("b")
    daemon._heard(target, None, 0.01, [Read(now - 5, asleep), Read(now, replaced)])
    assert not daemon._asleep("b")
    # The same when only the record saw it asleep (a daemon started since).
    daemon._news = ({"b": asleep}, {})
    daemon._heard(target, None, 0.01, [Read(now, replaced)])
    assert not daemon._asleep("b")


def test_a_server_read_asleep_by_an_undecided_read_stays_unrouted_when_its_reader_is_lost(
    tmp_path: Path,
) -> None:
    """Engine 0 put to sleep as engine 1 took work: a read that decides nothing, so the
    record still shows it awake. Its probing task died, or its read worker was lost
    (OOM-killed): the notice comes with no reads, and the router took that for no read
    at all, routing clients to the sleeping server (vLLM #15483) until the new reader's
    first read, a wait on, though no read had shown it awake."""
    target = Target("b", REFUSED_URL)
    daemon = quiet_daemon(target, StateFile(tmp_path / "state.json"))
    asleep = parse_metrics(asleep_capture().encode())
    daemon._heard(target, None, 0.01, [Read(time.time(), asleep)])
    assert daemon._asleep("b")
    lost = probe.unjudged("not judged: read worker 1 exited (-9); its reads start afresh")
    daemon._heard(target, lost, 0.0, ())
    assert daemon._asleep("b")


def test_a_withdrawn_restart_is_not_counted_as_a_failed_restart_in_the_metrics(
    tmp_path: Path,
) -> None:
    # An operator's hold saved between the settle that issued a restart and its launch
    # withdraws the command: it never ran, so it is no failed restart, in the ledger
    # (no failure, no attempt) nor on /metrics, where two such holds fired
    # LLMHealthRestartsFailing ("restarting w failed 2 times").
    daemon, marker, done = _restart_launched_after_a_hold(tmp_path)
    assert [d.withdrawn for d in done] == [True]
    heard = daemon._settle(daemon_module.News([], done))
    daemon._after_cycle(heard.report, 0.0, None, None)
    restarts = daemon._collector.view.restarts
    assert restarts[("w", "failed")] == 0, restarts
    assert not marker.exists()


def test_a_restart_heard_after_its_backend_left_the_config_leaves_no_series_behind(
    tmp_path: Path,
) -> None:
    # A reload dropped "w" while its restart command ran: its series left /metrics at the
    # reload, and the command's outcome, heard at the next settle, must not bring a
    # counter of a backend nobody configures back for the daemon's life.
    target, other = Target("w", REFUSED_URL), Target("b", "http://127.0.0.1:10")
    backend = config_module.Backend("w", REFUSED_URL, restart=("true",))
    kept = config_module.Backend("b", other.url, restart=("true",))
    config = config_module.Config(backends=(backend, kept))
    store, audit = StateFile(tmp_path / "state.json"), AuditLog(tmp_path / "audit.jsonl")
    wedge = Outcome(target, Verdict(VerdictKind.WEDGED, False, "wedged: steps 5→5→5"))
    settled = settle_fleet(
        store,
        config,
        {"w": REFUSED_URL, "b": other.url},
        lambda _record: [wedge],
        mode=Mode.ACT,
        audit=audit,
    )
    [order] = settled.orders
    reloaded = config_module.Config(backends=(kept,))
    daemon = a_daemon(lambda: (reloaded, [other]), store)
    failed = CommandResult(order.argv, 1, False, 0.1, "", "unit not found")
    try:
        heard = daemon._settle(daemon_module.News([], [CommandDone(order, failed)]))
        daemon._after_cycle(heard.report, 0.0, None, None)
    finally:
        asyncio.run(daemon._reading.close())
    view = daemon._collector.view
    assert {name for name, _ in view.restarts} == {"b"}, view.restarts


def test_a_member_restarted_under_its_name_never_repeats_a_serial_the_leader_settled(
    tmp_path: Path,
) -> None:
    """A cluster member restarted under the same `member` name (a config edit and a
    restart soon after a deploy, a crash loop) counted its serials from 1 again. The
    leader remembers the last (member, serial) it settled of each backend for as long as
    it leads, and took the new process's first verdicts, under the very serials the old
    process had last published, for verdicts it had settled: dropped, unsettled."""
    from llmhealth.shares import (  # noqa: PLC0415
        Intake,
        parse_publication,
        publication,
        take_published,
    )

    target = Target("b", REFUSED_URL)
    idle = Verdict(VerdictKind.IDLE, True, "idle")
    down = Verdict(VerdictKind.DOWN, False, "down: refused")
    intake = Intake(0.0, 60.0)
    take_published(intake, {"b": "m"}, {}, 0.0, 1e9)  # the leader's first take primes it

    def one_process(verdict: Verdict) -> list[Verdict]:
        daemon = settled_by_hand(tmp_path, lambda: [target])
        daemon._shares = cast(Any, object())  # a member's: only its presence is asked here

        async def one_wait() -> list[Verdict]:
            daemon._start_probes()
            daemon.hear(target, verdict, 0.01)
            daemon._take_fresh()
            made = daemon._publication()
            assert made is not None
            (chunk,) = publication(*made[:3], 512 * 1024, made.urls, made.reading_at)
            found = parse_publication("m", json.loads(chunk))
            await daemon._reading.close()
            taken = take_published(intake, {"b": "m"}, {"m": found}, 1.0, 1e9)
            return list(taken.verdicts.values())

        return asyncio.run(one_wait())

    assert one_process(idle) == [idle]
    # The same member, a new process: its first verdict is news to the leader.
    assert one_process(down) == [down]


def test_a_backend_a_reload_moved_is_routed_to_only_once_a_read_there_is_settled(
    tmp_path: Path,
) -> None:
    """A reload that moves a serving backend to another address keeps its state, and the
    first read there decides whether another process answers (STALE, then re-admission).
    The settle after the reload, which had no read at the new address yet, pushed it to
    the router and wrote it to the serving file as serving: clients were sent to a server
    nothing had read (in a run, one `unanswered` there cost a client a 500 after the
    first-byte bound, before the read that made it STALE)."""
    from llmhealth.config import Backend  # noqa: PLC0415
    from llmhealth.config import Router as RouterConfig  # noqa: PLC0415
    from llmhealth.router import Router  # noqa: PLC0415

    old, new = "http://127.0.0.1:9", "http://127.0.0.2:9"
    fleets = [
        [Target("b", old), Target("c", "http://127.0.0.3:9")],
        [Target("b", new), Target("c", "http://127.0.0.3:9")],
    ]
    config = config_module.Config(timeout=1.0, answer_timeout=1.0)
    serving_file = tmp_path / "serving.json"
    idle = Verdict(VerdictKind.IDLE, True, "idle: answered")

    def listed() -> list[str]:
        return [entry["url"] for entry in json.loads(serving_file.read_text())["serving"]]

    async def scenario() -> tuple[set[str], list[str], set[str], list[str]]:
        router = Router(RouterConfig(), [Backend(t.name, t.url) for t in fleets[0]])
        daemon = settled_by_hand(
            tmp_path, lambda: fleets[0], serving_file, config=config, router=router
        )
        try:
            daemon._settle(News([Outcome(t, idle) for t in fleets[0]], []))
            fleets.pop(0)
            daemon._reload_config()
            # The next settle hears nothing read at b's new address yet.
            daemon._settle(News([Outcome(fleets[0][1], idle)], []))
            daemon._push_router()
            before = set(router._serving), listed()
            # Then a read there is settled: b serves again.
            daemon._settle(News([Outcome(fleets[0][0], idle)], []))
            daemon._push_router()
            return *before, set(router._serving), listed()
        finally:
            await daemon._reading.close()
            await router.close()

    unread_names, unread_file, read_names, read_file = asyncio.run(scenario())
    assert unread_names == {"c"} and unread_file == ["http://127.0.0.3:9"]
    assert read_names == {"b", "c"} and read_file == [new, "http://127.0.0.3:9"]


def _moved_scenario(
    tmp_path: Path,
    first_read: Verdict,
    *,
    restarted: bool = False,
    new: str = "http://127.0.0.2:9",
) -> tuple[set[str], list[str]]:
    """b serving at one address, then moved to another (a reload, or the config edited
    across a restart); the next settle hears ``first_read`` of b at its new address, and
    c read: what the router and the serving file are handed then."""
    from llmhealth.config import Backend  # noqa: PLC0415
    from llmhealth.config import Router as RouterConfig  # noqa: PLC0415
    from llmhealth.router import Router  # noqa: PLC0415

    old, other = "http://127.0.0.1:9", "http://127.0.0.3:9"
    fleets = [[Target("b", old), Target("c", other)], [Target("b", new), Target("c", other)]]
    config = config_module.Config(timeout=1.0, answer_timeout=1.0)
    serving_file = tmp_path / "serving.json"
    idle = Verdict(VerdictKind.IDLE, True, "idle: answered")

    def made(router: Router) -> Daemon:
        return a_daemon(
            lambda: (config, fleets[0]),
            StateFile(tmp_path / "state.json"),
            serving_file=serving_file,
            router=router,
        )

    async def scenario() -> tuple[set[str], list[str]]:
        router = Router(RouterConfig(), [Backend(t.name, t.url) for t in fleets[0]])
        daemon = made(router)
        try:
            daemon._settle(News([Outcome(t, idle) for t in fleets[0]], []))
            fleets.pop(0)
            if restarted:
                await daemon._reading.close()
                await router.close()
                router = Router(RouterConfig(), [Backend(t.name, t.url) for t in fleets[0]])
                daemon = made(router)
                daemon._read_baselines()
            else:
                daemon._reload_config()
            read = [Outcome(fleets[0][1], idle), Outcome(fleets[0][0], first_read)]
            daemon._settle(News(read, []))
            daemon._push_router()
            listed = [e["url"] for e in json.loads(serving_file.read_text())["serving"]]
            return set(router._serving), listed
        finally:
            await daemon._reading.close()
            await router.close()

    return asyncio.run(scenario())


def test_a_moved_backend_is_not_routed_to_on_a_read_there_that_judged_nothing(
    tmp_path: Path,
) -> None:
    # A read at the new address that llmhealth could not judge (its own shortage, a read
    # worker lost, our API key turned away there) says nothing of what answers there.
    names, listed = _moved_scenario(
        tmp_path, probe.unjudged("not judged: read worker 1 exited (-9)")
    )
    assert names == {"c"} and listed == ["http://127.0.0.3:9"]


def test_a_moved_backend_is_not_routed_to_on_a_leaders_doubt_of_it(tmp_path: Path) -> None:
    # With shard_reads, a backend no member read at the leader's address (its reader's
    # config not reloaded yet, or its reader gone) is settled as the leader's doubt, a
    # verdict made of no read, given the leader's address (``_others_verdicts``).
    from llmhealth.shares import doubt  # noqa: PLC0415

    names, listed = _moved_scenario(tmp_path, doubt("m2", None, 40.0))
    assert names == {"c"} and listed == ["http://127.0.0.3:9"]


def test_a_backend_moved_while_the_daemon_was_stopped_waits_for_a_read_there(
    tmp_path: Path,
) -> None:
    # The config edited and the daemon restarted (not reloaded): the saved ledger's b is
    # moved at start, and nothing has been read at its new address yet.
    names, listed = _moved_scenario(tmp_path, probe.unjudged("not judged: x"), restarted=True)
    assert names == {"c"} and listed == ["http://127.0.0.3:9"]


@pytest.mark.parametrize("restarted", [False, True])
def test_a_backend_only_written_another_way_is_not_held_back_as_moved(
    tmp_path: Path, restarted: bool
) -> None:
    # The same server, its address written another way (a trailing slash): nothing moved,
    # on a reload as across a restart; held back, a lone backend's clients had no backend
    # for a wait, and for as long as its reads were not judged (our API key turned away).
    names, listed = _moved_scenario(
        tmp_path, probe.unjudged("not judged: x"), restarted=restarted, new="http://127.0.0.1:9/"
    )
    assert names == {"b", "c"} and len(listed) == 2


@pytest.mark.xfail(
    strict=True, reason="nothing saved says a moved backend's new address was never judged"
)
def test_a_moved_backend_unread_there_stays_out_across_a_restart(tmp_path: Path) -> None:
    # Moved by a reload, the settle after it judged nothing there (a read worker lost),
    # then the daemon restarted: the saved ledger has b at its new address already, and
    # nothing says no read there was ever judged.
    from llmhealth.config import Backend  # noqa: PLC0415
    from llmhealth.config import Router as RouterConfig  # noqa: PLC0415
    from llmhealth.router import Router  # noqa: PLC0415

    old, new, other = "http://127.0.0.1:9", "http://127.0.0.2:9", "http://127.0.0.3:9"
    fleets = [[Target("b", old), Target("c", other)], [Target("b", new), Target("c", other)]]
    config = config_module.Config(timeout=1.0, answer_timeout=1.0)
    idle = Verdict(VerdictKind.IDLE, True, "idle: answered")
    unjudged = probe.unjudged("not judged: read worker 1 exited (-9)")

    def made(router: Router) -> Daemon:
        return a_daemon(
            lambda: (config, fleets[0]),
            StateFile(tmp_path / "state.json"),
            serving_file=tmp_path / "serving.json",
            router=router,
        )

    async def scenario() -> set[str]:
        router = Router(RouterConfig(), [Backend(t.name, t.url) for t in fleets[0]])
        daemon = made(router)
        try:
            daemon._settle(News([Outcome(t, idle) for t in fleets[0]], []))
            fleets.pop(0)
            daemon._reload_config()
            daemon._settle(News([Outcome(fleets[0][1], idle), Outcome(fleets[0][0], unjudged)], []))
            await daemon._reading.close()
            await router.close()
            router = Router(RouterConfig(), [Backend(t.name, t.url) for t in fleets[0]])
            daemon = made(router)
            daemon._read_baselines()
            daemon._push_router()  # as the router starts (``_start_router``)
            return set(router._serving)
        finally:
            await daemon._reading.close()
            await router.close()

    assert asyncio.run(scenario()) == {"c"}


@pytest.mark.slow  # a daemon over two cycles
def test_a_proxy_watch_could_not_read_is_not_exported_down(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A proxy whose name could not be looked up for now (no DNS server answered) is not
    judged, as a backend by name is then: exported `down` and counted as a `down` probe
    error, LLMHealthBackendDown paged it as a failed balancer after 5 minutes, where the
    backends beside it were `no_metrics` and paged nothing."""
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)

    def getaddrinfo(host: str, *args: object, **kwargs: object) -> object:
        raise socket.gaierror(socket.EAI_AGAIN, "lookup failed")

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    config = config_module.Config(timeout=1.0, answer_timeout=1.0, read_workers=1)
    targets = [Target("b", "http://b.test:8000"), Target("lb", "http://lb.test:8000", "proxy")]
    daemon = a_daemon(lambda: (config, targets), StateFile(tmp_path / "state.json"), wait=0.2)

    def examined() -> bool:
        views = {view.name: view for view in daemon._collector.view.backends}
        return all(name in views and (views[name].examinations or 0) >= 2 for name in ("b", "lb"))

    async def scenario() -> None:
        running = asyncio.create_task(daemon.run())
        try:
            deadline = time.monotonic() + 20.0
            while not examined():
                assert time.monotonic() < deadline and not running.done(), "not examined"
                await asyncio.sleep(POLL)
        finally:
            daemon.stop()
            assert await asyncio.wait_for(running, STOP_BOUND) == 0

    asyncio.run(scenario())
    view = daemon._collector.view
    verdicts = {backend.name: backend.verdict for backend in view.backends}
    assert verdicts["b"] == "no_metrics"
    assert verdicts["lb"] != "down", verdicts
    assert ("lb", "down") not in view.probe_errors, view.probe_errors


@pytest.mark.slow  # a lookup held for a while
def test_a_stop_does_not_wait_for_a_name_lookup_that_hangs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, each_loop: str
) -> None:
    """A backend named by a host whose DNS server does not answer (glibc: 5 s, twice, per
    server and search domain): its lookup ran in the loop's default executor, whose
    threads the loop's close and the interpreter's exit both wait for, and a stopped
    daemon's exit waited for the resolver, past the stop systemd allows. On uvloop, in
    libuv's threads, which its loop's close waits for likewise."""
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    real = socket.getaddrinfo
    asked, answer = threading.Event(), threading.Event()

    def getaddrinfo(host: str, *args: Any, **kwargs: Any) -> Any:
        if host == "hung.test":
            asked.set()
            answer.wait(STOP_BOUND * 3)
            raise socket.gaierror(socket.EAI_AGAIN, "Temporary failure in name resolution")
        return real(host, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    config = config_module.Config(timeout=1.0, answer_timeout=1.0, read_workers=1)
    targets = [Target("h", "http://hung.test:8000")]
    daemon = a_daemon(lambda: (config, targets), StateFile(tmp_path / "state.json"), wait=0.2)

    async def scenario() -> int:
        running = asyncio.create_task(daemon.run())
        deadline = time.monotonic() + PATIENCE
        while not asked.is_set():
            assert time.monotonic() < deadline and not running.done(), "never looked up"
            await asyncio.sleep(POLL)
        daemon.stop()
        return await running

    try:
        started = time.monotonic()
        assert eventloop.run(scenario()) == 0  # as `watch` runs it
        took = time.monotonic() - started
    finally:
        answer.set()
    assert took < STOP_BOUND, f"the stop waited {took:.1f} s for a name lookup"


def test_the_daemons_default_executor_runs_calls_and_ends_its_threads_at_shutdown() -> None:
    """Its threads are left to the exit, not waited for; told to end at shutdown all the
    same, or each loop a daemon ran in (a test's, a library's) left them blocked for the
    process's life."""

    def pool_threads() -> int:
        return sum(thread.name == "llmhealth-pool" for thread in threading.enumerate())

    before = pool_threads()
    executor = daemon_module.LeftAtExit()
    futures = [executor.submit(pow, 2, n) for n in range(20)]
    assert [future.result(PATIENCE) for future in futures] == [2**n for n in range(20)]
    assert pool_threads() > before
    executor.shutdown(wait=False)
    with pytest.raises(RuntimeError):
        executor.submit(pow, 2, 2)
    deadline = time.monotonic() + PATIENCE
    while pool_threads() > before:
        assert time.monotonic() < deadline, "the pool's threads never ended"
        time.sleep(POLL)


def test_an_nginx_serving_file_names_the_port_each_backend_listens_on(tmp_path: Path) -> None:
    """nginx reads a `server` line without a port as port 80: an https backend written
    without one (its scheme's 443) was handed clients on port 80, and a URL with an
    empty port (`http://h:`, taken as `http://h`) became `server h:;`, which nginx
    refuses, so its reload failed and the balancer kept the old set."""
    backends = [
        Target("tls", "https://vllm-0.internal"),
        Target("empty", "http://vllm-1.internal:"),
        Target("six", "http://[::1]:8000"),
        Target("bare", "http://vllm-3.internal/v1"),
    ]
    serving = tmp_path / "upstream.conf"
    daemon = settled_by_hand(tmp_path, lambda: backends, serving)
    idle = Verdict(VerdictKind.IDLE, True, "idle: answered")

    async def settle() -> None:
        try:
            daemon._settle(News([Outcome(t, idle) for t in backends], []))
        finally:
            await daemon._reading.close()

    asyncio.run(settle())
    assert nginx_servers(serving.read_text()) == {
        "server vllm-0.internal:443;",
        "server vllm-1.internal:80;",
        "server [::1]:8000;",
        "server vllm-3.internal:80;",
    }


def test_a_server_read_asleep_is_left_out_of_the_serving_file_as_out_of_the_router(
    tmp_path: Path,
) -> None:
    """A completion sent to a sleeping vLLM crashed it (vLLM #15483): `route` sends such a
    server no client request, but `--serving-file` still listed it, and the balancer
    reading that file sent it clients' completions. Listed again once a read shows it
    awake."""
    backends = [Target("b", "http://127.0.0.1:9"), Target("c", "http://127.0.0.3:9")]
    serving = tmp_path / "serving.json"
    daemon = settled_by_hand(tmp_path, lambda: backends, serving)
    idle = Verdict(VerdictKind.IDLE, True, "idle: answered")
    asleep = parse_metrics(asleep_capture().encode())
    awake = parse_metrics((CAPTURES / "idle-1.txt").read_bytes())

    async def scenario() -> tuple[list[str], list[str]]:
        try:
            daemon._heard(backends[0], None, 0.01, [Read(time.time(), asleep)])
            read = [Outcome(t, idle) for t in backends]
            daemon._settle(News(read, [], asleep=daemon._asleep_now()))
            while_asleep = serving_names(serving)
            daemon._heard(backends[0], None, 0.01, [Read(time.time(), awake)])
            daemon._settle(News([], [], asleep=daemon._asleep_now()))
            return while_asleep, serving_names(serving)
        finally:
            await daemon._reading.close()

    while_asleep, once_awake = asyncio.run(scenario())
    assert while_asleep == ["c"]
    assert once_awake == ["b", "c"]


def test_a_moved_backend_renamed_before_a_read_there_is_judged_stays_out(tmp_path: Path) -> None:
    """A reload moved b; nothing judged was read at its new address yet (our key turned
    away there, a read worker lost), and a second reload renamed it there (the same
    server, so its record went to the new name). The new name was not held back as
    moved: the router and the serving file were handed a server nothing had judged."""
    from llmhealth.config import Backend  # noqa: PLC0415
    from llmhealth.config import Router as RouterConfig  # noqa: PLC0415
    from llmhealth.router import Router  # noqa: PLC0415

    old, new, other = "http://127.0.0.1:9", "http://127.0.0.2:9", "http://127.0.0.3:9"
    fleets = [
        [Target("b", old), Target("c", other)],
        [Target("b", new), Target("c", other)],
        [Target("b2", new), Target("c", other)],
    ]
    config = config_module.Config(timeout=1.0, answer_timeout=1.0)
    serving_file = tmp_path / "serving.json"
    idle = Verdict(VerdictKind.IDLE, True, "idle: answered")
    unjudged = probe.unjudged("not judged: read worker 1 exited (-9)")

    async def scenario() -> tuple[set[str], list[str], str | None]:
        router = Router(RouterConfig(), [Backend(t.name, t.url) for t in fleets[0]])
        daemon = settled_by_hand(
            tmp_path, lambda: fleets[0], serving_file, config=config, router=router
        )
        try:
            daemon._settle(News([Outcome(t, idle) for t in fleets[0]], []))
            fleets.pop(0)
            daemon._reload_config()
            daemon._settle(News([Outcome(fleets[0][1], idle), Outcome(fleets[0][0], unjudged)], []))
            fleets.pop(0)
            daemon._reload_config()
            daemon._settle(News([Outcome(fleets[0][1], idle), Outcome(fleets[0][0], unjudged)], []))
            daemon._push_router()
            listed = serving_names(serving_file)
            return set(router._serving), listed, _saved_state(tmp_path / "state.json", "b2")
        finally:
            await daemon._reading.close()
            await router.close()

    names, listed, b2 = asyncio.run(scenario())
    assert b2 == "healthy"  # renamed: b's record, serving, went to b2
    assert names == {"c"} and listed == ["c"]


def test_a_server_the_record_saw_asleep_stays_out_of_the_serving_file_when_renamed(
    tmp_path: Path,
) -> None:
    """b was read asleep and left out of the file and the router; a reload renamed it (the
    same server: its record, asleep, went to the new name) and no read of b2 came before
    the next settle. The file's asleep set was taken before the settle, from the record
    that did not know b2 yet: the file listed b2, a sleeping vLLM handed clients'
    completions (vLLM #15483), while the router, pushed after it, left it out; the
    balancer's set changed twice, its hook run twice."""
    from llmhealth.config import Backend  # noqa: PLC0415
    from llmhealth.config import Router as RouterConfig  # noqa: PLC0415
    from llmhealth.router import Router  # noqa: PLC0415

    url, other = "http://127.0.0.1:9", "http://127.0.0.3:9"
    fleets = [
        [Target("b", url), Target("c", other)],
        [Target("b2", url), Target("c", other)],
    ]
    serving = tmp_path / "serving.json"
    asleep = parse_metrics(asleep_capture().encode())

    async def scenario() -> tuple[list[str], list[str], set[str]]:
        router = Router(RouterConfig(), [Backend(t.name, t.url) for t in fleets[0]])
        daemon = settled_by_hand(tmp_path, lambda: fleets[0], serving, router=router)
        try:
            read = Read(time.time(), asleep)
            slept = Verdict(VerdictKind.IDLE, True, "idle: asleep", reads=(read,))
            idle = Verdict(VerdictKind.IDLE, True, "idle: answered")
            daemon._heard(fleets[0][0], None, 0.01, [read])
            outcomes = [Outcome(fleets[0][0], slept), Outcome(fleets[0][1], idle)]
            daemon._settle(News(outcomes, [], asleep=daemon._asleep_now()))
            before = serving_names(serving)
            fleets.pop(0)
            daemon._reload_config()
            daemon._settle(News([Outcome(fleets[0][1], idle)], [], asleep=daemon._asleep_now()))
            daemon._push_router()
            return before, serving_names(serving), set(router._serving)
        finally:
            await daemon._reading.close()
            await router.close()

    before, after, routed = asyncio.run(scenario())
    assert before == ["c"]
    assert routed == {"c"}
    assert after == ["c"]


def test_a_backend_a_reload_drops_leaves_metrics_at_the_reload_not_a_settle_later(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """README: "A backend the config no longer names leaves /metrics at the reload". Its
    series stayed on the page until the next cycle published another: a whole wait (here
    600 s), or for as long as settles were skipped (a full disk), its "down" verdict and
    error counter firing alerts for a backend nobody runs any more."""
    from prometheus_client import CollectorRegistry, generate_latest  # noqa: PLC0415

    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    both = [Target("kept", REFUSED_URL), Target("gone", "http://127.0.0.1:10")]
    fleets = [(config_module.Config(wait=0.3, timeout=1.0, answer_timeout=1.0), both)]
    daemon = in_process(lambda: fleets[-1], tmp_path, None)
    registry = CollectorRegistry()
    registry.register(daemon._collector)

    def page() -> str:
        return generate_latest(registry).decode()

    async def scenario() -> tuple[str, str]:
        running = asyncio.create_task(daemon.run())
        try:
            for _ in range(int(PATIENCE / 0.05)):
                if 'llmhealth_backend_probe_errors_total{backend="gone"' in page():
                    break
                await asyncio.sleep(0.05)
            before = page()
            fleets.append((replace(fleets[0][0], wait=600.0), both[:1]))
            os.kill(os.getpid(), signal.SIGHUP)
            for _ in range(int(PATIENCE / 0.05)):
                if daemon._wait == 600.0:
                    break
                await asyncio.sleep(0.05)
            return before, page()
        finally:
            daemon.stop()
            assert await asyncio.wait_for(running, 10.0) == 0

    before, after = asyncio.run(scenario())
    assert 'backend="gone"' in before
    assert daemon._wait == 600.0, "the reload was not applied"
    assert 'backend="gone"' not in after
    assert 'llmhealth_backend_verdict{backend="kept",verdict="down"} 1.0' in after


def test_a_route_reload_that_changes_the_wait_has_the_router_say_the_new_one(
    tmp_path: Path,
) -> None:
    """README: no backend for the model is a 503 "with Retry-After (the wait)", and a
    reload applies the wait at once. The router kept saying the wait it started with: cut
    from 600 s to 5 s, clients were still told to come back in ten minutes."""
    from llmhealth.config import Backend  # noqa: PLC0415
    from llmhealth.config import Router as RouterConfig  # noqa: PLC0415
    from llmhealth.router import Router  # noqa: PLC0415

    backend = Target("b", REFUSED_URL)
    fleets = [(config_module.Config(wait=600.0), [backend])]
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]

    async def scenario() -> list[str]:
        router = Router(RouterConfig(), [Backend(backend.name, backend.url)], retry_after=600.0)
        daemon = a_daemon(lambda: fleets[-1], StateFile(tmp_path / "state.json"), router=router)
        said = []
        try:
            await router.start("127.0.0.1", port)
            async with httpx.AsyncClient(timeout=10.0) as http:
                for _ in range(2):
                    answer = await http.post(
                        f"http://127.0.0.1:{port}/v1/completions", json={"model": "m"}
                    )
                    assert answer.status_code == 503
                    said.append(answer.headers["Retry-After"])
                    fleets.append((config_module.Config(wait=5.0), [backend]))
                    daemon._reload_config()
            return said
        finally:
            await daemon._reading.close()
            await router.close()

    assert asyncio.run(scenario()) == ["600", "5"]


def test_the_metrics_address_watch_logs_on_ipv6_is_a_url_that_answers(entry_point: str) -> None:
    """`watch --listen [::1]:PORT` logged "metrics on http://::1:PORT/metrics", which no
    client takes as a URL: an operator's curl of it failed, though the page was served."""
    try:
        with socket.socket(socket.AF_INET6) as probe_socket:
            probe_socket.bind(("::1", 0))
    except OSError:
        pytest.skip("no IPv6 loopback here")
    port = free_port_block(1)
    environment = child_env()
    environment.pop("NOTIFY_SOCKET", None)
    process = subprocess.Popen(
        [entry_point, "watch", REFUSED_URL, "--wait", str(WAIT), "--listen", f"[::1]:{port}"],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        env=environment,
    )
    try:
        assert process.stderr is not None
        line = process.stderr.readline().decode()
        assert line.startswith("metrics on "), line
        url = line.removeprefix("metrics on ").strip()
        assert url == f"http://[::1]:{port}/metrics"
        assert httpx.get(url, timeout=5.0, trust_env=False).status_code == 200
    finally:
        process.terminate()
        process.wait(STOP_BOUND)
        assert process.stderr is not None
        process.stderr.close()
