"""Restart only proven wedges: remediation end to end, with real processes and no mocks.

Every scenario runs the installed `llmhealth check` several times on one state file
against simulated vLLM servers that the configured restart command really replaces
(tests/restartable.py): the old process is killed, a new one with a new start time takes
its port. Each run is a fresh process, so all a run knows of the last came through the
state file. What is asserted is what an operator sees: the JSON report, the exit status,
the state file and the audit log beside it. Reads are fast (wait 0.3 s) and every server
is stopped when its test ends, failing or not.
"""

from __future__ import annotations

import asyncio
import fcntl
import itertools
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import pytest
from restartable import Fleet, Server, alive, restartable_fleet, stop

from llmhealth import config as config_module
from llmhealth.actions import read as read_audit
from llmhealth.cycle import run_cycle, run_cycle_async
from llmhealth.probe import ProbeSettings
from llmhealth.state import StateError, StateFile

WEDGE = "wedge:0.3"  # busy, then the engine freezes 0.3 s after the process started
# One HTTP read. No test waits for it to expire; 2 s rather than 1 s so that a simulator
# starved of CPU for a moment (this machine is shared) is not judged unresponsive.
TIMEOUT = "2s"
RUN_TIMEOUT = 60.0  # a bound for a hung run, far above the ~1.5 s a run takes here
BASE_POLICY: dict[str, object] = {"cooldown": "1s", "cooldown_max": "4s"}
# Fails like a broken `systemctl restart`, and leaves a mark for every time it ran.
FAILING = "import sys; open(sys.argv[1], 'a').write('x'); sys.exit(3)"
TOUCH = "import pathlib, sys; pathlib.Path(sys.argv[1]).touch()"
# The audit log's name for each kind of restart decision (remediate._AUDIT_EVENTS).
RESTART, SKIPPED, RETIRE = "restart", "restart_skipped", "retire"
COMMAND = "restart_command"  # how a restart command went, written once it has finished
T = TypeVar("T")


@pytest.fixture
def fleet(tmp_path: Path) -> Iterator[Fleet]:
    with restartable_fleet(tmp_path) as servers:
        yield servers


def until_frozen(*servers: Server) -> None:
    """Sleep until each wedging server's engine has frozen, so every read sees the wedge
    (a first read taken before the freeze would show progress: stalled, not wedged). The
    engine freezes 0.3 s after its process started, which was before it first answered."""
    sleep_until(max(server.ready_at for server in servers) + 0.4)


# --- running llmhealth ----------------------------------------------------------------


@dataclass(frozen=True)
class Run:
    code: int
    stdout: str
    stderr: str

    @property
    def report(self) -> dict[str, Any]:
        assert self.stdout, f"no JSON on stdout (exit {self.code}); stderr:\n{self.stderr}"
        document: dict[str, Any] = json.loads(self.stdout)
        assert document["exit_code"] == self.code, "the JSON and the exit status disagree"
        return document

    def backend(self, name: str) -> dict[str, Any]:
        found: dict[str, Any] = next(b for b in self.report["backends"] if b["name"] == name)
        return found

    def seen(self, name: str) -> tuple[str, str | None, bool | None, int]:
        """verdict, ledger state, serving, and this run's exit code."""
        backend = self.backend(name)
        return backend["verdict"], backend["state"], backend["serving"], self.code

    @property
    def restarts(self) -> list[dict[str, Any]]:
        notes: list[dict[str, Any]] = self.report["restarts"]
        return notes


def _toml(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)  # a JSON string is a valid TOML basic string
    if isinstance(value, list | tuple):
        return "[" + ", ".join(_toml(item) for item in value) + "]"
    raise TypeError(f"no TOML for {value!r}")


@dataclass(frozen=True)
class Setup:
    """One fleet's config, state file and audit log, and the CLI run on them."""

    entry_point: str
    config: Path

    @property
    def state(self) -> Path:
        return self.config.with_name("state.json")

    @property
    def audit_path(self) -> Path:
        return self.config.with_name("audit.jsonl")

    def where(self) -> list[str]:
        return ["--config", str(self.config), "--state", str(self.state)]

    def check(self, *flags: str) -> Run:
        completed = self._run("check", *self.where(), "--format", "json", *flags)
        return Run(completed.returncode, completed.stdout, completed.stderr)

    def verb(self, *args: str) -> subprocess.CompletedProcess[str]:
        return self._run(*args, *self.where())

    def _run(self, *args: str) -> subprocess.CompletedProcess[str]:
        started = time.monotonic()
        completed = subprocess.run(
            [self.entry_point, *args],
            capture_output=True,
            text=True,
            timeout=RUN_TIMEOUT,  # on expiry subprocess.run kills the child before raising
            check=False,
        )
        # Shown by pytest only when the test fails: what ran, how long, what it said.
        print(f"llmhealth {args[0]}: exit {completed.returncode} after", end=" ")
        print(f"{time.monotonic() - started:.2f} s\n{completed.stdout}{completed.stderr}")
        assert "Traceback" not in completed.stderr, completed.stderr
        return completed

    def audit(self) -> list[dict[str, Any]]:
        return read_audit(self.audit_path)

    def restart_lines(self) -> list[dict[str, Any]]:
        """The audit lines of restart decisions: llmhealth's own, not an operator's retire."""
        decided = (RESTART, SKIPPED, RETIRE)
        return [r for r in self.audit() if r["actor"] == "llmhealth" and r["event"] in decided]

    def saved(self, name: str) -> dict[str, Any]:
        document = json.loads(self.state.read_text())
        found: dict[str, Any] = next(b for b in document["ledger"]["backends"] if b["name"] == name)
        return found

    def history(self, name: str) -> dict[str, Any]:
        found: dict[str, Any] = json.loads(self.state.read_text())["restarts"][name]
        return found


def configure(
    entry_point: str,
    folder: Path,
    backends: Sequence[tuple[str, str, Sequence[str] | None]],
    *,
    proxies: Sequence[tuple[str, str]] = (),
    **policy: object,
) -> Setup:
    lines = ['wait = "0.3s"', f'timeout = "{TIMEOUT}"', 'answer_timeout = "2s"', "", "[policy]"]
    lines += [f"{key} = {_toml(value)}" for key, value in {**BASE_POLICY, **policy}.items()]
    for name, url, restart in backends:
        lines += ["", "[[backend]]", f"name = {_toml(name)}", f"url = {_toml(url)}"]
        if restart is not None:
            lines.append(f"restart = {_toml(list(restart))}")
    for name, url in proxies:
        lines += ["", "[[proxy]]", f"name = {_toml(name)}", f"url = {_toml(url)}"]
    config = folder / "fleet.toml"
    config.write_text("\n".join(lines) + "\n")
    return Setup(entry_point, config)


def transitions(run: Run, name: str) -> list[tuple[str, str, str]]:
    return [(t["event"], t["from"], t["to"]) for t in run.backend(name)["transitions"]]


def sleep_until(moment: float) -> None:
    time.sleep(max(0.0, moment - time.time()))


# --- the scenarios --------------------------------------------------------------------


def test_the_fleets_cleanup_waits_for_a_restart_command_still_running(tmp_path: Path) -> None:
    """A daemon killed mid-restart leaves its command running in its own session; the
    cleanup that followed at once read the history before the command recorded the new
    server, and left that server running (a CI run's e2e lane failed on it)."""
    with restartable_fleet(tmp_path) as fleet:
        server = fleet.start("gpu", "busy")
        command = subprocess.Popen(
            server.restart_argv("idle"),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        # Running as the command it is (past fork and exec), as a daemon's had been.
        until_running = time.monotonic() + 30
        while str(server.pidfile) not in Path(f"/proc/{command.pid}/cmdline").read_text():
            assert time.monotonic() < until_running, "the restart command never started"
            time.sleep(0.01)
    try:
        assert command.wait(60) == 0  # the command finished: the cleanup waited for it
    finally:
        if command.poll() is None:
            command.kill()
            command.wait(10)
    launched = server.launches()
    assert [entry["by"] for entry in launched] == ["start", "restart"]
    assert [entry["pid"] for entry in launched if alive(entry["pid"])] == []


def test_a_wedged_backend_is_restarted_once_and_readmitted_by_the_tiny_request_next_run(
    entry_point: str, fleet: Fleet, tmp_path: Path
) -> None:
    gpu = fleet.start("gpu0", WEDGE)
    restart = gpu.restart_argv("idle")
    setup = configure(entry_point, tmp_path, [("gpu0", gpu.url, restart)])
    until_frozen(gpu)
    wedged_pid = gpu.pid
    first = setup.check()
    new_pid = gpu.pid
    second = setup.check()
    third = setup.check()
    stats = gpu.stats()

    # Run 1: the wedge is proven (DEAD at once), the plan allows a restart, the ledger
    # hears RestartIssued (RESTARTING) and the command replaces the process.
    assert first.seen("gpu0") == ("wedged", "restarting", False, 2)
    assert transitions(first, "gpu0") == [("wedge_proven", "healthy", "dead")]
    assert first.restarts == [
        {
            "name": "gpu0",
            "action": "restart",
            "reason": "condemned by wedged: restart 1 of 5 allowed in 24h",
            "ran": True,
            "ok": True,
            "dry_run": False,
        }
    ]
    assert [(e["mode"], e["by"]) for e in gpu.launches()] == [(WEDGE, "start"), ("idle", "restart")]
    assert wedged_pid is not None and new_pid not in (None, wedged_pid)
    assert not alive(wedged_pid)

    # Run 2 does both steps, RESTARTING → STALE → HEALTHY, in one run: run 1 saved the
    # wedged process's start time as the baseline, so the first read of run 2 shows
    # another process (verdict `restarted`, a NewProcessUp). That new process has no work,
    # so the classifier sends the tiny request; it is answered, which is re-admission, and
    # fleet.events_for feeds NewProcessUp and Readmitted together. A restart is a WARNING.
    assert second.seen("gpu0") == ("restarted", "healthy", True, 1)
    assert transitions(second, "gpu0") == [
        ("new_process_up", "restarting", "stale"),
        ("readmitted", "stale", "healthy"),
    ]
    assert "since the last run" in second.backend("gpu0")["evidence"]
    assert second.backend("gpu0")["requests_sent"] == 1
    assert second.report["fleet"]["epoch"] == 2  # out of the serving set, and back in
    assert second.restarts == []
    assert third.seen("gpu0") == ("idle", "healthy", True, 0)
    assert third.restarts == []
    assert [e["pid"] for e in gpu.launches()] == [wedged_pid, new_pid]  # restarted once
    assert stats["mode"] == "idle"
    assert stats["completions_answered"] == 2  # the tiny requests of runs 2 and 3

    # The audit log: the wedge, the restart decision with its proof, the way back.
    audit = setup.audit()
    assert [r["event"] for r in audit] == [
        "wedge_proven",
        RESTART,
        COMMAND,
        "new_process_up",
        "readmitted",
    ]
    decision = audit[1]
    assert (decision["backend"], decision["from"], decision["to"]) == ("gpu0", "dead", "restarting")
    assert decision["condemned_by"] == "wedged"
    assert decision["dry_run"] is False
    assert decision["argv"] == restart
    # Issued and saved first; how the command went is a line of its own, after it ran.
    heard = audit[2]
    assert (heard["backend"], heard["from"], heard["to"]) == ("gpu0", "restarting", "restarting")
    command = heard["command"]
    assert command["argv"] == restart
    assert (command["exit_code"], command["timed_out"]) == (0, False)
    assert f"-> {new_pid} (idle)" in command["stdout"]
    proof = decision["evidence"]
    assert proof["verdict"] == "wedged"
    assert "no progress over 2 consecutive waits" in proof["evidence"]
    reads = proof["reads"]
    assert len(reads) == 3  # two waits
    assert all(later["at"] - earlier["at"] >= 0.25 for earlier, later in itertools.pairwise(reads))
    assert len({read["process_start"] for read in reads}) == 1  # one process throughout
    engines = [read["engines"]["0"] for read in reads]
    assert all(e["running"] > 0 and e["waiting"] > 0 for e in engines)  # work present...
    for counter in ("steps", "generation_tokens", "running", "waiting", "kv_usage"):
        assert len({e[counter] for e in engines}) == 1, counter  # ...and nothing moved
    assert setup.saved("gpu0")["state"] == "healthy"
    assert setup.history("gpu0") == {"failures": 0, "last_attempt_at": decision["time"]}


@pytest.mark.slow
def test_a_saturated_backend_that_progresses_is_never_restarted_nor_sent_a_request(
    entry_point: str, fleet: Fleet, tmp_path: Path
) -> None:
    gpu = fleet.start("gpu0", "busy")
    setup = configure(entry_point, tmp_path, [("gpu0", gpu.url, gpu.restart_argv("idle"))])
    runs = [setup.check() for _ in range(6)]
    stats = gpu.stats()
    assert [run.seen("gpu0") for run in runs] == [("busy", "healthy", True, 0)] * 6
    assert [run.backend("gpu0")["requests_sent"] for run in runs] == [0] * 6
    assert [run.restarts for run in runs] == [[]] * 6
    assert stats["completions_received"] == 0
    assert stats["models_reads"] == 0  # not even asked which model it serves
    assert len(gpu.launches()) == 1  # the restart command never ran
    assert setup.audit() == []  # no decision, no transition: nothing to write down
    assert setup.saved("gpu0")["state"] == "healthy"


@pytest.mark.slow
def test_a_proxy_in_front_of_a_wedged_backend_is_only_asked_for_models_and_never_restarted(
    entry_point: str, fleet: Fleet, tmp_path: Path
) -> None:
    gpu = fleet.start("gpu0", WEDGE)
    proxy = fleet.start("lb", f"proxy:{gpu.url}")
    setup = configure(
        entry_point,
        tmp_path,
        [("gpu0", gpu.url, gpu.restart_argv("idle"))],
        proxies=[("lb", proxy.url)],
    )
    until_frozen(gpu)
    proxy_pid = proxy.pid
    runs = [setup.check() for _ in range(3)]
    proxy_stats = proxy.stats()

    for run in runs:
        assert run.backend("lb")["kind"] == "proxy"
        assert run.seen("lb")[:3] == ("up", None, None)  # no ledger state: not a backend
    assert runs[0].seen("gpu0") == ("wedged", "restarting", False, 2)
    assert [note["name"] for run in runs for note in run.restarts] == ["gpu0"]
    assert runs[2].seen("gpu0") == ("idle", "healthy", True, 0)
    # The proxy: never replaced, never in the ledger, never in the audit log...
    assert proxy_pid is not None and alive(proxy_pid)
    assert proxy.pid == proxy_pid and len(proxy.launches()) == 1
    ledger = json.loads(setup.state.read_text())["ledger"]
    assert [backend["name"] for backend in ledger["backends"]] == ["gpu0"]
    assert all(record["backend"] == "gpu0" for record in setup.audit())
    # ...and asked nothing but GET /v1/models, once per run.
    assert proxy_stats["metrics_reads"] == 0
    assert proxy_stats["completions_received"] == 0
    assert proxy_stats["models_reads"] == len(runs)


@pytest.mark.slow
def test_with_one_restart_at_a_time_the_second_wedge_waits_until_the_first_is_back(
    entry_point: str, fleet: Fleet, tmp_path: Path
) -> None:
    first_gpu = fleet.start("gpu-a", WEDGE)
    second_gpu = fleet.start("gpu-b", WEDGE)
    go = tmp_path / "gpu-a.go"  # gpu-a's new process starts serving only once this exists
    setup = configure(
        entry_point,
        tmp_path,
        [
            ("gpu-a", first_gpu.url, first_gpu.restart_argv("idle", start_when=go)),
            ("gpu-b", second_gpu.url, second_gpu.restart_argv("idle")),
        ],
        max_concurrent_restarts=1,
    )
    until_frozen(first_gpu, second_gpu)
    first = setup.check()
    second = setup.check()
    go.touch()
    first_gpu.wait_ready("idle")
    third = setup.check()
    fourth = setup.check()
    waiting = "1 restart already under way (max_concurrent_restarts 1)"

    # Run 1: both wedged at once; the first by name is restarted, the other waits.
    assert first.seen("gpu-a") == ("wedged", "restarting", False, 2)
    assert first.seen("gpu-b") == ("wedged", "dead", False, 2)
    assert [(n["name"], n["action"], n["ran"]) for n in first.restarts] == [
        ("gpu-a", "restart", True),
        ("gpu-b", "skip", False),
    ]
    assert first.restarts[1]["reason"] == waiting
    # Run 2: gpu-a's new process is not up yet (refused): still RESTARTING, so gpu-b waits.
    assert second.seen("gpu-a") == ("down", "restarting", False, 2)
    assert [(n["name"], n["action"], n["reason"]) for n in second.restarts] == [
        ("gpu-b", "skip", waiting)
    ]
    # Run 3: gpu-a is back and re-admitted before the plan is made; now gpu-b's turn.
    assert third.seen("gpu-a") == ("restarted", "healthy", True, 2)
    assert third.seen("gpu-b") == ("wedged", "restarting", False, 2)
    assert [(n["name"], n["action"], n["ran"], n["ok"]) for n in third.restarts] == [
        ("gpu-b", "restart", True, True)
    ]
    assert fourth.seen("gpu-b") == ("restarted", "healthy", True, 1)
    assert fourth.seen("gpu-a") == ("idle", "healthy", True, 1)
    assert fourth.restarts == []

    issued = [
        (r["backend"], r["to"])
        for r in setup.restart_lines()
        if r["event"] == RESTART and r["to"] == "restarting"
    ]
    assert issued == [("gpu-a", "restarting"), ("gpu-b", "restarting")]
    assert [len(first_gpu.launches()), len(second_gpu.launches())] == [2, 2]


# Fails as a broken restart does, after spoiling the state file its check saves next.
SPOILING = (
    "import sys; open(sys.argv[1], 'w').write('{spoilt'); "
    "print('unit vllm@0 not found', file=sys.stderr); sys.exit(1)"
)


@pytest.mark.slow
def test_a_command_whose_outcome_the_state_cannot_take_is_still_in_the_trail(
    entry_point: str, fleet: Fleet, tmp_path: Path
) -> None:
    """The settle that records the command failed (here the state spoilt; a lock held
    past its wait does the same): the command's exit code and stderr went with it, in no
    trail and no report, while the run said only why the state failed."""
    gpu = fleet.start("gpu0", WEDGE)
    restart = [sys.executable, "-c", SPOILING, str(tmp_path / "state.json")]
    setup = configure(entry_point, tmp_path, [("gpu0", gpu.url, restart)])
    assert setup.state == tmp_path / "state.json"
    until_frozen(gpu)
    run = setup.check()
    assert run.seen("gpu0")[:2] == ("wedged", "restarting")
    notes = " ".join(run.report["notes"])
    assert "gpu0: restart command failed (unit vllm@0 not found); its outcome is in no state" in (
        notes
    )
    assert "in the audit log (unsettled)" in notes
    assert [(n["action"], n["ran"], n["ok"]) for n in run.restarts] == [("restart", True, False)]
    [heard] = [r for r in setup.audit() if r["event"] == COMMAND]
    assert heard["command"]["exit_code"] == 1 and "unsettled" in heard
    assert "unit vllm@0 not found" in heard["command"]["stderr"]


@pytest.mark.slow
def test_a_failing_restart_command_cools_down_is_retried_then_retires_past_its_budget(
    entry_point: str, fleet: Fleet, tmp_path: Path
) -> None:
    gpu = fleet.start("gpu0", WEDGE)
    ran = tmp_path / "attempts"  # one "x" per time the command ran
    restart = [sys.executable, "-c", FAILING, str(ran)]
    # A 2 s base cooldown, 4 s after a failure: run 2 lands well inside it, even on a
    # loaded machine (a run takes about 1 s here).
    setup = configure(
        entry_point,
        tmp_path,
        [("gpu0", gpu.url, restart)],
        cooldown="2s",
        cooldown_max="4s",
        restart_budget=2,
    )
    until_frozen(gpu)

    first = setup.check()
    assert first.seen("gpu0") == ("wedged", "dead", False, 2)  # RESTARTING, then back
    assert [(n["action"], n["ran"], n["ok"]) for n in first.restarts] == [("restart", True, False)]
    assert ran.read_text() == "x"
    assert setup.saved("gpu0")["last_error"] == "restart failed: restart command exited 3"
    attempted = setup.history("gpu0")
    assert attempted["failures"] == 1

    second = setup.check()  # at once: inside the doubled cooldown
    assert second.seen("gpu0") == ("wedged", "dead", False, 2)
    [note] = second.restarts
    assert (note["action"], note["ran"]) == ("skip", False)
    assert note["reason"].startswith("cooling down: ")
    assert note["reason"].endswith(" left after 1 failed attempt")
    assert ran.read_text() == "x"

    sleep_until(attempted["last_attempt_at"] + 4.0)
    third = setup.check()  # out of the cooldown: tried again, fails again
    assert [(n["action"], n["reason"], n["ran"], n["ok"]) for n in third.restarts] == [
        ("restart", "condemned by wedged: restart 2 of 2 allowed in 24h", True, False)
    ]
    assert third.seen("gpu0") == ("wedged", "dead", False, 2)
    assert ran.read_text() == "xx"
    attempted = setup.history("gpu0")
    assert attempted["failures"] == 2

    sleep_until(attempted["last_attempt_at"] + 4.0)  # 1 s doubled twice, capped at 4 s
    fourth = setup.check()  # the attempt past the budget retires it; nothing runs
    assert [(n["action"], n["ran"]) for n in fourth.restarts] == [("retire", False)]
    assert fourth.restarts[0]["reason"].startswith("restart budget spent: 2 attempts in 24h")
    assert fourth.seen("gpu0") == ("wedged", "retired", False, 2)
    fifth = setup.check()  # RETIRED is out for good: no more decisions
    assert fifth.seen("gpu0") == ("wedged", "retired", False, 2)
    assert fifth.restarts == []
    assert ran.read_text() == "xx"

    lines = setup.restart_lines()
    assert [(r["event"], r["from"], r["to"]) for r in lines] == [
        (RESTART, "dead", "restarting"),
        (SKIPPED, "dead", "dead"),
        (RESTART, "dead", "restarting"),
        (RETIRE, "dead", "retired"),
    ]
    commands = [r for r in setup.audit() if r["event"] == COMMAND]
    assert [(r["from"], r["to"], r["command"]["exit_code"]) for r in commands] == [
        ("restarting", "dead", 3)
    ] * 2
    assert all(r["command"]["argv"] == restart for r in commands)
    assert setup.saved("gpu0")["state"] == "retired"
    assert setup.saved("gpu0")["last_error"].startswith(
        "restart budget spent: 2 attempts in 24h; last error: "
    )
    assert len(gpu.launches()) == 1


@pytest.mark.slow
def test_a_held_backend_is_not_restarted_until_the_hold_is_released(
    entry_point: str, fleet: Fleet, tmp_path: Path
) -> None:
    gpu = fleet.start("gpu0", WEDGE)
    setup = configure(entry_point, tmp_path, [("gpu0", gpu.url, gpu.restart_argv("idle"))])
    until_frozen(gpu)
    condemned = setup.check("--no-restart")  # a first run creates the state to hold in
    assert condemned.seen("gpu0") == ("wedged", "dead", False, 2)

    held = setup.verb("hold", "gpu0", "--for", "1h", "--reason", "weight sync")
    assert held.returncode == 0, held.stderr
    status = setup.verb("status", "--format", "json")
    assert json.loads(status.stdout)["backends"][0]["hold"]["reason"] == "weight sync"

    while_held = setup.check()
    [note] = while_held.restarts
    assert (note["action"], note["ran"]) == ("skip", False)
    assert note["reason"].startswith("on hold until ")
    assert note["reason"].endswith(": weight sync")
    assert while_held.seen("gpu0") == ("wedged", "dead", False, 2)  # verdicts go on
    assert len(gpu.launches()) == 1

    released = setup.verb("release", "gpu0")
    assert released.returncode == 0, released.stderr
    after = setup.check()
    assert [(n["action"], n["ran"], n["ok"]) for n in after.restarts] == [("restart", True, True)]
    assert after.seen("gpu0") == ("wedged", "restarting", False, 2)
    assert setup.check().seen("gpu0") == ("restarted", "healthy", True, 1)
    assert [e["mode"] for e in gpu.launches()] == [WEDGE, "idle"]
    assert [r["event"] for r in setup.audit()] == [
        "wedge_proven",
        "hold",
        SKIPPED,
        "release",
        RESTART,
        COMMAND,
        "new_process_up",
        "readmitted",
    ]


@pytest.mark.slow
def test_a_restarted_backend_that_never_answers_stays_stale_and_out_of_serving(
    entry_point: str, fleet: Fleet, tmp_path: Path
) -> None:
    gpu = fleet.start("gpu0", WEDGE)
    setup = configure(entry_point, tmp_path, [("gpu0", gpu.url, gpu.restart_argv("unanswered"))])
    until_frozen(gpu)
    first = setup.check()
    later = [setup.check() for _ in range(3)]
    stats = gpu.stats()

    assert first.seen("gpu0") == ("wedged", "restarting", False, 2)
    # The new process is seen (STALE) but the tiny request goes unanswered: no
    # re-admission; a new process failing its request is CRITICAL, and nothing serves.
    assert later[0].seen("gpu0") == ("restarted", "stale", False, 2)
    assert transitions(later[0], "gpu0") == [("new_process_up", "restarting", "stale")]
    assert [run.seen("gpu0") for run in later[1:]] == [("unanswered", "stale", False, 2)] * 2
    for run in later:
        assert run.restarts == []  # STALE is not DEAD: no second restart
        assert run.report["fleet"]["serving"] == 0
        assert run.backend("gpu0")["requests_sent"] == 1
    assert stats["mode"] == "unanswered"
    assert (stats["completions_received"], stats["completions_answered"]) == (3, 0)
    assert len(gpu.launches()) == 2
    assert setup.saved("gpu0")["state"] == "stale"


@pytest.mark.slow
def test_a_replacement_not_readmitted_within_the_startup_grace_is_a_failed_restart(
    entry_point: str, fleet: Fleet, tmp_path: Path
) -> None:
    gpu = fleet.start("gpu0", WEDGE)
    # Long enough for the run after the restart to see the replacement STALE first, even
    # on a loaded machine.
    setup = configure(
        entry_point,
        tmp_path,
        [("gpu0", gpu.url, gpu.restart_argv("unanswered"))],
        startup_grace="6s",
    )
    until_frozen(gpu)
    assert setup.check().seen("gpu0") == ("wedged", "restarting", False, 2)
    issued_at = setup.history("gpu0")["last_attempt_at"]
    ran_at = setup.saved("gpu0")["restart_ran_at"]  # the grace counts from the command's end
    assert ran_at > issued_at
    assert setup.check().seen("gpu0") == ("restarted", "stale", False, 2)

    # Past the grace: the STALE replacement counts as a failed restart (DEAD, the cooldown
    # doubled), and, out of that cooldown, the plan restarts it again.
    sleep_until(ran_at + 6.0)
    third = setup.check()
    assert any(
        note.startswith(
            "gpu0: restart failed: the new process was not re-admitted within "
            "the startup grace of 6s"
        )
        for note in third.report["notes"]
    ), third.report["notes"]
    assert [(n["action"], n["reason"], n["ran"]) for n in third.restarts] == [
        ("restart", "condemned by wedged: restart 2 of 5 allowed in 24h", True)
    ]
    assert third.seen("gpu0")[1] == "restarting"
    [expired] = [r for r in setup.audit() if r["event"] == "startup_expired"]
    assert (expired["from"], expired["to"]) == ("stale", "dead")
    assert expired["evidence"]["restarted_at"] == issued_at
    assert expired["evidence"]["restart_ran_at"] == ran_at
    assert expired["evidence"]["startup_grace"] == 6.0
    # What this run saw of it: up, yet its tiny request still unanswered.
    assert expired["evidence"]["verdict"] == "unanswered"
    assert "tiny request failed" in expired["evidence"]["evidence"]
    assert [(r["event"], r["from"], r["to"]) for r in setup.audit()] == [
        ("wedge_proven", "healthy", "dead"),
        (RESTART, "dead", "restarting"),
        (COMMAND, "restarting", "restarting"),
        ("new_process_up", "restarting", "stale"),
        ("startup_expired", "stale", "dead"),
        (RESTART, "dead", "restarting"),
        (COMMAND, "restarting", "restarting"),
    ]


@pytest.mark.slow  # 3 s: three checks of a wedge
def test_dry_run_logs_the_decision_without_acting_and_no_restart_logs_nothing(
    entry_point: str, fleet: Fleet, tmp_path: Path
) -> None:
    gpu = fleet.start("gpu0", WEDGE)
    marker = tmp_path / "restarted"
    restart = [sys.executable, "-c", TOUCH, str(marker)]
    setup = configure(entry_point, tmp_path, [("gpu0", gpu.url, restart)])
    until_frozen(gpu)

    dry = setup.check("--dry-run")
    assert dry.seen("gpu0") == ("wedged", "dead", False, 2)
    assert dry.restarts == [
        {
            "name": "gpu0",
            "action": "restart",
            "reason": "condemned by wedged: restart 1 of 5 allowed in 24h",
            "ran": False,
            "ok": None,
            "dry_run": True,
        }
    ]
    assert not marker.exists()
    [decision] = setup.restart_lines()
    assert decision["dry_run"] is True
    assert (decision["event"], decision["from"], decision["to"]) == (
        RESTART,
        "dead",
        "dead",
    )
    assert "command" not in decision
    assert decision["evidence"]["verdict"] == "wedged"
    # The verdict and the ledger move it caused are saved; nothing was issued or spent:
    # no attempt in the ledger's budget, no cooldown started.
    assert setup.saved("gpu0")["state"] == "dead"
    assert setup.saved("gpu0")["restart_times"] == []
    assert json.loads(setup.state.read_text())["restarts"] == {}
    logged = len(setup.audit())

    off = setup.check("--no-restart")
    assert off.seen("gpu0") == ("wedged", "dead", False, 2)
    assert off.restarts == []
    assert len(setup.audit()) == logged  # not a line: no decision was even made
    assert not marker.exists()

    # The control: the same config, acting, does run the command.
    acting = setup.check()
    assert acting.seen("gpu0") == ("wedged", "restarting", False, 2)
    assert marker.exists()
    assert [r["dry_run"] for r in setup.restart_lines()] == [True, False]


@pytest.mark.slow
def test_two_checks_started_together_issue_exactly_one_restart(
    entry_point: str, fleet: Fleet, tmp_path: Path
) -> None:
    gpu = fleet.start("gpu0", WEDGE)
    setup = configure(entry_point, tmp_path, [("gpu0", gpu.url, gpu.restart_argv("idle"))])
    until_frozen(gpu)
    argv = [entry_point, "check", *setup.where(), "--format", "json"]
    processes: list[subprocess.Popen[str]] = []
    try:
        for _ in range(2):
            processes.append(
                subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            )
        outputs = [process.communicate(timeout=RUN_TIMEOUT) for process in processes]
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.communicate()
    runs = [Run(p.returncode, out, err) for p, (out, err) in zip(processes, outputs, strict=True)]

    issued = [
        r
        for r in setup.audit()
        if r["actor"] == "llmhealth" and r["event"] == RESTART and r["to"] == "restarting"
    ]
    assert len(issued) == 1
    assert len(gpu.launches()) == 2  # the command ran once
    finished = []
    for index, run in enumerate(runs):
        assert "Traceback" not in run.stderr, run.stderr
        if run.code == 3:  # gave up waiting for the lock, naming its holder
            holder = processes[1 - index].pid
            assert f"locked by another llmhealth (PID {holder})" in run.stderr, run.stderr
        else:
            finished.append(run)
    assert finished, "neither run got the lock"
    restarted = [run for run in finished if run.restarts]
    assert len(restarted) == 1
    # Its report shows the state after its command: still RESTARTING, unless the other
    # run took the lock meanwhile and saw the replacement (STALE, or re-admitted).
    assert restarted[0].seen("gpu0")[0] == "wedged"
    assert restarted[0].seen("gpu0")[1] in ("restarting", "stale", "healthy")
    for run in finished:
        if run is not restarted[0]:
            # It took the lock after the first let go, which is before the first's command
            # ran: it saw the restart under way (or done), and issued none of its own.
            assert run.seen("gpu0")[1] in ("restarting", "stale", "healthy"), run.report
            assert run.restarts == []


@pytest.mark.slow
def test_a_restart_that_brings_up_no_process_within_the_startup_grace_fails_and_is_retried(
    entry_point: str, fleet: Fleet, tmp_path: Path
) -> None:
    gpu = fleet.start("gpu0", WEDGE)
    go = tmp_path / "gpu0.go"  # until this exists, no restart brings up a server
    setup = configure(
        entry_point,
        tmp_path,
        [("gpu0", gpu.url, gpu.restart_argv("idle", start_when=go))],
        # Long enough for the second restart's server to be seen in the run after it,
        # even on a loaded machine; the first one's is waited out.
        startup_grace="4s",
    )
    until_frozen(gpu)
    first = setup.check()  # the command exits 0, yet nothing will listen
    assert first.seen("gpu0") == ("wedged", "restarting", False, 2)
    ran_at = setup.saved("gpu0")["restart_ran_at"]  # the grace counts from the command's end

    # Past the grace (and the cooldown after one failure, 1 s doubled): the next run fails
    # the restart after its verdicts are fed, and the plan made then tries again.
    sleep_until(ran_at + 4.0)
    second = setup.check()
    assert second.seen("gpu0") == ("down", "restarting", False, 2)
    assert any(
        note.startswith("gpu0: ") and "no new process within the startup grace of 4s" in note
        for note in second.report["notes"]
    ), second.report["notes"]
    assert [(n["action"], n["reason"], n["ran"], n["ok"]) for n in second.restarts] == [
        ("restart", "condemned by wedged: restart 2 of 5 allowed in 24h", True, True)
    ]
    assert setup.history("gpu0")["failures"] == 1

    go.touch()
    gpu.wait_ready("idle")
    third = setup.check()
    assert third.seen("gpu0") == ("restarted", "healthy", True, 1)
    assert setup.history("gpu0")["failures"] == 0  # re-admission proved the restart

    assert [(r["event"], r["from"], r["to"]) for r in setup.audit()] == [
        ("wedge_proven", "healthy", "dead"),
        (RESTART, "dead", "restarting"),
        (COMMAND, "restarting", "restarting"),
        ("startup_expired", "restarting", "dead"),
        (RESTART, "dead", "restarting"),
        (COMMAND, "restarting", "restarting"),
        ("new_process_up", "restarting", "stale"),
        ("readmitted", "stale", "healthy"),
    ]
    # Three processes were launched: the wedged one, one that never served (stopped by
    # the second restart), and the one that came up.
    assert [e["by"] for e in gpu.launches()] == ["start", "restart", "restart"]


@pytest.mark.slow
def test_a_restart_of_a_backend_condemned_in_an_earlier_run_is_audited_with_its_proof(
    entry_point: str, fleet: Fleet, tmp_path: Path
) -> None:
    gpu = fleet.start("gpu0", WEDGE)
    setup = configure(entry_point, tmp_path, [("gpu0", gpu.url, gpu.restart_argv("idle"))])
    until_frozen(gpu)
    condemned = setup.check("--no-restart")
    assert condemned.seen("gpu0") == ("wedged", "dead", False, 2)
    wedge_proof = condemned.backend("gpu0")["evidence"]
    assert "no progress over 2 consecutive waits" in wedge_proof

    # The wedged process dies before the next run (OOM killer, an impatient operator).
    wedged_pid = gpu.pid
    assert wedged_pid is not None
    stop(wedged_pid)
    restarted = setup.check()
    assert restarted.seen("gpu0") == ("down", "restarting", False, 2)
    [decision] = setup.restart_lines()
    assert (decision["event"], decision["condemned_by"]) == (RESTART, "wedged")
    # The line must carry what proved the wedge, not only this run's unrelated verdict.
    evidence = decision["evidence"]
    assert "no progress over 2 consecutive waits" in json.dumps(evidence), evidence


# Writes the environment it was given, as JSON, to the file named by its argument.
DUMP_ENVIRONMENT = "import json, os, sys; json.dump(dict(os.environ), open(sys.argv[1], 'w'))"


@pytest.mark.slow
def test_the_restart_command_gets_no_api_key_and_is_told_what_to_restart_and_why(
    entry_point: str, fleet: Fleet, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    gpu = fleet.start("gpu0", WEDGE)
    dumped = tmp_path / "restart-env.json"
    restart = [sys.executable, "-c", DUMP_ENVIRONMENT, str(dumped)]
    setup = configure(entry_point, tmp_path, [("gpu0", gpu.url, restart)])
    # Two backends with keys: gpu0's own, and a neighbour's that is none of its business.
    text = setup.config.read_text().replace("restart = [", 'api_key_env = "GPU0_KEY"\nrestart = [')
    text += '\n[[backend]]\nname = "gpu1"\nurl = "http://127.0.0.1:9"\napi_key_env = "GPU1_KEY"\n'
    setup.config.write_text(text)
    monkeypatch.setenv("GPU0_KEY", "s3cret-zero")
    monkeypatch.setenv("GPU1_KEY", "s3cret-one")
    monkeypatch.setenv("UNRELATED_SETTING", "kept")
    until_frozen(gpu)
    run = setup.check()
    assert run.restarts[0]["ran"], run.report
    environment = json.loads(dumped.read_text())
    assert "GPU0_KEY" not in environment
    assert "GPU1_KEY" not in environment
    assert not [name for name, value in environment.items() if "s3cret" in value]
    assert environment["UNRELATED_SETTING"] == "kept"
    assert environment["LLMHEALTH_BACKEND"] == "gpu0"
    assert environment["LLMHEALTH_URL"] == gpu.url
    assert environment["LLMHEALTH_REASON"].startswith("wedged: engine 0 had work and made no")


@pytest.mark.slow
def test_a_command_already_run_is_heard_when_a_later_order_may_not_run(
    fleet: Fleet, tmp_path: Path
) -> None:
    """check runs its orders one after another; when a later one's store refuses
    (command_env: a cluster leader whose lease lapsed while the first command ran), the
    first command's outcome (it ran, exit 3) must still reach the trail or the report."""
    gpu0, gpu1 = fleet.start("gpu0", WEDGE), fleet.start("gpu1", WEDGE)
    failing = [sys.executable, "-c", "import sys; sys.stderr.write('boom'); sys.exit(3)"]
    setup = configure(
        "unused",
        tmp_path,
        [("gpu0", gpu0.url, failing), ("gpu1", gpu1.url, failing)],
        max_concurrent_restarts=2,
    )

    class LeaseLapsesAfterTheFirstCommand(StateFile):
        asked = 0

        def command_env(self) -> dict[str, str]:
            self.asked += 1
            if self.asked > 1:
                raise StateError("the lease passed on while the first command ran; not run")
            return {}

    loaded = config_module.load(setup.config)
    targets = config_module.targets_for(loaded, [], [])
    settings = settings_of(loaded)
    until_frozen(gpu0, gpu1)
    report = run_cycle(loaded, targets, settings, LeaseLapsesAfterTheFirstCommand(setup.state))
    ran = [note for note in report.restarts if note.action == "restart" and note.ran]
    commands = [r for r in read_audit(setup.audit_path) if r["event"] == "restart_command"]
    assert len(ran) == 1 and len(commands) == 1, "the command that ran is in no trail"


@pytest.mark.slow  # three wedges read and a check's commands
def test_no_order_after_one_its_store_refused_runs(fleet: Fleet, tmp_path: Path) -> None:
    """Once the store refuses a command its environment (a cluster leader whose lease may
    have passed on), the check runs none of the orders after it either, even if the store
    would answer again: a leader that lost its lease for one order has lost it for all."""
    servers = [fleet.start(f"gpu{i}", WEDGE) for i in range(3)]
    markers = [tmp_path / f"gpu{i}-restarted" for i in range(3)]
    setup = configure(
        "unused",
        tmp_path,
        [
            (f"gpu{i}", server.url, [sys.executable, "-c", TOUCH, str(markers[i])])
            for i, server in enumerate(servers)
        ],
        max_concurrent_restarts=3,
    )

    class RefusesTheSecondOrderOnly(StateFile):
        asked = 0

        def command_env(self) -> dict[str, str]:
            self.asked += 1
            if self.asked == 2:
                raise StateError("the lease may have passed on; not run")
            return {}

    loaded = config_module.load(setup.config)
    targets = config_module.targets_for(loaded, [], [])
    until_frozen(*servers)
    report = run_cycle(loaded, targets, settings_of(loaded), RefusesTheSecondOrderOnly(setup.state))
    assert [marker.exists() for marker in markers] == [True, False, False]
    assert any("gpu1: restart saved but not run" in note for note in report.notes), report.notes


INTERRUPTIBLE = (
    "import os, sys, time; open(sys.argv[1], 'w').write(str(os.getpid()));"
    " time.sleep(3); sys.stderr.write('restart failed'); sys.exit(7)"
)


def settings_of(loaded: config_module.Config) -> ProbeSettings:
    """The probe settings `check` takes from its config."""
    return ProbeSettings(
        wait=loaded.wait,
        timeout=loaded.timeout,
        answer_timeout=loaded.answer_timeout,
        max_body=loaded.max_body,
        max_check_time=loaded.max_check_time,
    )


def ctrl_c_once_a_command_started(
    setup: Setup,
    started: Path,
    clock: Callable[[], float] = time.time,
    on_press: Callable[[], object] = lambda: None,
) -> None:
    """Run a check in this process, and Ctrl-C it once the file its first restart command
    writes appears: its task cancelled, what asyncio.run does with the main task on
    Ctrl-C. ``on_press`` runs just before (a clock stepped, say)."""
    loaded = config_module.load(setup.config)
    targets = config_module.targets_for(loaded, [], [])

    async def interrupted() -> None:
        check = asyncio.ensure_future(
            run_cycle_async(
                loaded, targets, settings_of(loaded), StateFile(setup.state), clock=clock
            )
        )
        until = time.monotonic() + RUN_TIMEOUT
        while not started.exists():
            assert not check.done(), check.result()
            assert time.monotonic() < until, "the first restart command never started"
            await asyncio.sleep(0.05)
        on_press()
        check.cancel()
        with pytest.raises(asyncio.CancelledError):
            await check

    asyncio.run(interrupted())


def check_in_background(entry_point: str, setup: Setup) -> subprocess.Popen[str]:
    """`check` as from a shell: a background job (CI) starts with SIGINT ignored."""
    return subprocess.Popen(
        [entry_point, "check", *setup.where(), "--format", "json"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),  # noqa: PLW1509
    )


def wedged_with_a_failing_command(
    entry_point: str, fleet: Fleet, tmp_path: Path
) -> tuple[Setup, Server, Path]:
    """A wedging backend configured with a restart command (3 s, then exit 7), and the
    file the command writes its pid to."""
    gpu = fleet.start("gpu0", WEDGE)
    started = tmp_path / "command-started"
    setup = configure(
        entry_point,
        tmp_path,
        [("gpu0", gpu.url, [sys.executable, "-c", INTERRUPTIBLE, str(started)])],
    )
    return setup, gpu, started


def check_running_a_failing_command(
    entry_point: str, fleet: Fleet, tmp_path: Path
) -> tuple[Setup, subprocess.Popen[str], Path]:
    """A `check` in the background that condemns a wedged backend and runs its restart
    command (``wedged_with_a_failing_command``), and the file the command writes its pid
    to."""
    setup, gpu, started = wedged_with_a_failing_command(entry_point, fleet, tmp_path)
    until_frozen(gpu)
    return setup, check_in_background(entry_point, setup), started


def command_started(check: subprocess.Popen[str], started: Path) -> Path:
    """The running command's /proc entry, once it wrote its pid to ``started``."""
    until = time.monotonic() + 60
    while not started.exists() or not started.read_text():
        assert check.poll() is None, check.communicate()
        assert time.monotonic() < until, "the restart command never started"
        time.sleep(0.05)
    return Path(f"/proc/{started.read_text()}")


def signalled(
    check: subprocess.Popen[str], started: Path, signals: Sequence[int]
) -> tuple[str, str]:
    """``signals`` sent to ``check`` while its restart command runs, half a second apart,
    each handled apart (not coalesced with the one before); its stdout and stderr once it
    has exited. Killed if it does not exit in time."""
    try:
        command = command_started(check, started)
        for sent, signum in enumerate(signals):
            if sent:
                time.sleep(0.5)
                assert command.exists(), "the command ended before this signal"
            check.send_signal(signum)
        return check.communicate(timeout=60)
    finally:
        if check.poll() is None:
            check.kill()
            check.wait(10)


@pytest.mark.slow  # a check and its command each time: 4 s a case
@pytest.mark.parametrize("presses", [1, 2, 3], ids=["once", "twice", "three times"])
def test_ctrl_c_during_a_checks_restart_command_still_records_how_it_went(
    entry_point: str, fleet: Fleet, tmp_path: Path, presses: int
) -> None:
    """Ctrl-C while check runs a restart command: check waits for the command anyway
    (asyncio.run joins its thread), then left without the settle that records it: a
    failed command's exit code and stderr were in no audit line, its backend RESTARTING
    until the startup grace instead of DEAD. An operator who sees nothing happen presses
    it again: asyncio.run's close then cancelled the thread's task and lost it again, and
    a third press abandoned the task ("Task was destroyed but it is pending!")."""
    setup, check, started = check_running_a_failing_command(entry_point, fleet, tmp_path)
    out, err = signalled(check, started, [signal.SIGINT] * presses)  # Ctrl-C
    commands = [r for r in setup.audit() if r["event"] == "restart_command"]
    assert [c["command"]["exit_code"] for c in commands] == [7], (setup.audit(), out, err)
    assert check.returncode == 130  # still an interrupted run
    assert "Task was destroyed" not in err


@pytest.mark.slow  # 6 s of a check, its command and a lock held
def test_a_second_ctrl_c_while_the_record_waits_for_the_state_lock_keeps_it(
    entry_point: str, fleet: Fleet, tmp_path: Path
) -> None:
    """Another run holds the state (a cron check, flock(1) in a backup) when the command
    ends: the settle that records it waits up to 10 s for the lock, and a second Ctrl-C
    then was a KeyboardInterrupt inside that settle, the record lost."""
    setup, check, started = check_running_a_failing_command(entry_point, fleet, tmp_path)
    lock = None
    try:
        command = command_started(check, started)
        # The first settle let go of the lock before the command ran: another run takes it.
        lock = os.open(setup.state.with_name("state.json.lock"), os.O_RDWR | os.O_CREAT, 0o600)
        fcntl.flock(lock, fcntl.LOCK_EX)
        check.send_signal(signal.SIGINT)  # Ctrl-C
        until = time.monotonic() + 30
        while command.exists():
            assert time.monotonic() < until, "the command did not end"
            time.sleep(0.05)
        time.sleep(1.0)  # check's recording settle now waits for the lock (up to 10 s)
        assert check.poll() is None, "check gave up on the lock already"
        check.send_signal(signal.SIGINT)  # Ctrl-C again: nothing seems to happen
        time.sleep(0.5)
        fcntl.flock(lock, fcntl.LOCK_UN)
        out, err = check.communicate(timeout=60)
    finally:
        if lock is not None:
            os.close(lock)
        if check.poll() is None:
            check.kill()
            check.wait(10)
    commands = [r for r in setup.audit() if r["event"] == "restart_command"]
    assert [c["command"]["exit_code"] for c in commands] == [7], (setup.audit(), out, err)
    assert check.returncode == 130


@pytest.mark.slow  # a check and its command each time: 4 s a case
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP], ids=["SIGTERM", "SIGHUP"])
def test_a_check_stopped_during_its_restart_command_records_how_it_went_then_ends(
    entry_point: str, fleet: Fleet, tmp_path: Path, signum: signal.Signals
) -> None:
    """`timeout 10m llmhealth check` from cron, a oneshot unit stopped, a CronJob's
    deadline, an ssh session closed: the check died at once, its command ran on in its
    own session with nobody to hear it, its exit code and stderr in no audit line, and
    its backend RESTARTING until the startup grace (15 min) failed it, a command that
    had failed at once included. Held off until the outcome is recorded, the signal
    still ends the check, as it would have."""
    setup, check, started = check_running_a_failing_command(entry_point, fleet, tmp_path)
    out, err = signalled(check, started, [signum])
    commands = [r for r in setup.audit() if r["event"] == "restart_command"]
    assert [c["command"]["exit_code"] for c in commands] == [7], (setup.audit(), out, err)
    assert setup.saved("gpu0")["state"] == "dead"  # failed now, not after its grace
    assert check.returncode == -signum  # still ended by the signal it was sent


@pytest.mark.slow
def test_a_check_stopped_during_one_restart_command_runs_no_further_one(
    entry_point: str, fleet: Fleet, tmp_path: Path
) -> None:
    """The orders after the command a SIGTERM came during are not run, and are heard as
    not run (no attempt spent), as after a Ctrl-C."""
    gpu0, gpu1 = fleet.start("gpu0", WEDGE), fleet.start("gpu1", WEDGE)
    started, marker = tmp_path / "gpu0-command-started", tmp_path / "gpu1-restarted"
    setup = configure(
        entry_point,
        tmp_path,
        [
            ("gpu0", gpu0.url, [sys.executable, "-c", INTERRUPTIBLE, str(started)]),
            ("gpu1", gpu1.url, [sys.executable, "-c", TOUCH, str(marker)]),
        ],
        max_concurrent_restarts=2,
    )
    until_frozen(gpu0, gpu1)
    check = check_in_background(entry_point, setup)
    signalled(check, started, [signal.SIGTERM])
    assert check.returncode == -signal.SIGTERM
    assert not marker.exists()  # gpu1's command was not run
    heard = {r["backend"]: r for r in setup.audit() if r["event"] == COMMAND}
    assert heard["gpu0"]["command"]["exit_code"] == 7
    assert heard["gpu1"]["command"]["stderr"] == (
        "not run: the check was stopped (SIGTERM) before it ran"
    )
    assert setup.saved("gpu1")["state"] == "dead"
    assert setup.saved("gpu1")["restart_times"] == []  # no command ran: no attempt spent


@pytest.mark.slow  # an etcd, a check and its command
def test_a_cluster_check_stopped_during_its_restart_command_gives_the_lead_back(
    entry_point: str, fleet: Fleet, tmp_path: Path
) -> None:
    """A cluster's check from cron stopped (SIGTERM) while it ran a restart command: its
    outcome went to etcd, and then the stop ended the check inside the cycle, before the
    resign that follows it: its leader key stayed on its lease, and no daemon could
    lead for a whole lease (10 s by default) after the check was gone."""
    from llmhealth.cluster import Etcd, Keys, read_audit  # noqa: PLC0415 - only a cluster's
    from tests.etcdproc import running_etcd  # noqa: PLC0415 - only this test needs etcd

    setup, gpu, started = wedged_with_a_failing_command(entry_point, fleet, tmp_path)
    keys = Keys("/llmhealth-test/stopped")
    with running_etcd(tmp_path / "etcd") as cluster:
        with setup.config.open("a") as config:
            config.write(
                f"\n[cluster]\netcd = {_toml(list(cluster.endpoints))}\n"
                f'prefix = {_toml(keys.prefix)}\nlease_ttl = "60s"\n'  # a kept key outlasts it
            )
        until_frozen(gpu)
        check = subprocess.Popen(
            [entry_point, "check", "--config", str(setup.config), "--format", "json"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        out, err = signalled(check, started, [signal.SIGTERM])
        etcd = Etcd(cluster.endpoints)
        records: list[dict[str, Any]] = read_audit(etcd, keys).records  # in etcd, settled
        assert check.returncode == -signal.SIGTERM, (out, err)
        commands = [r for r in records if r["event"] == COMMAND]
        assert [c["command"]["exit_code"] for c in commands] == [7], (records, err)
        assert etcd.get(keys.leader) is None  # given back: a daemon may lead at once


# Runs an operator's verb (the rest of its argv), as one typed while a check's command runs.
VERB = "import subprocess, sys; sys.exit(subprocess.run(sys.argv[1:]).returncode)"


@pytest.mark.slow
@pytest.mark.parametrize("verb", ["hold", "retire"])
def test_a_restart_held_or_retired_while_an_earlier_command_of_the_check_runs_is_not_run(
    entry_point: str, fleet: Fleet, tmp_path: Path, verb: str
) -> None:
    """`check` runs its commands one after another, outside the state lock, so operator
    verbs are not held up meanwhile: a hold (a trainer's weight sync) or a retire ("bad
    HBM") saved while gpu0's command ran was then ignored, and gpu1 restarted anyway."""
    gpu0, gpu1 = fleet.start("gpu0", WEDGE), fleet.start("gpu1", WEDGE)
    marker = tmp_path / "gpu1-restarted"
    config, state = tmp_path / "fleet.toml", tmp_path / "state.json"
    where = ["--config", str(config), "--state", str(state)]
    said = ["--for", "1h"] if verb == "hold" else []
    operator = [sys.executable, "-c", VERB, entry_point, verb, "gpu1", *said, "--reason", "sync"]
    setup = configure(
        entry_point,
        tmp_path,
        [
            ("gpu0", gpu0.url, [*operator, *where]),
            ("gpu1", gpu1.url, [sys.executable, "-c", TOUCH, str(marker)]),
        ],
        max_concurrent_restarts=2,
    )
    until_frozen(gpu0, gpu1)
    run = setup.check()
    assert [(n["name"], n["action"]) for n in run.restarts] == [
        ("gpu0", "restart"),
        ("gpu1", "restart"),
    ]
    assert run.restarts[0]["ok"] is True  # the verb went through, its change saved
    assert not marker.exists()  # before: gpu1 restarted all the same
    # Withdrawn, not run: no failed restart, in the report as in the ledger.
    assert (run.restarts[1]["ran"], run.restarts[1]["ok"]) == (False, None)
    assert run.restarts[1]["reason"].startswith("not run: "), run.restarts[1]
    [heard] = [r for r in setup.audit() if r["event"] == COMMAND and r["backend"] == "gpu1"]
    assert heard["command"]["stderr"].startswith("not run: ")
    assert setup.saved("gpu1")["state"] == ("dead" if verb == "hold" else "retired")
    if verb == "hold":  # released later, it has its whole budget: no command ran
        assert setup.saved("gpu1")["restart_times"] == []


# Writes its pid to its first argument, then fails after a moment: a command still
# running when Ctrl-C comes, and over soon after.
BRIEFLY = (
    "import os, sys, time; open(sys.argv[1], 'w').write(str(os.getpid()));"
    " time.sleep(0.5); sys.exit(7)"
)


@pytest.mark.slow
def test_a_restart_a_ctrl_c_kept_from_running_is_heard_as_not_run_with_no_attempt_spent(
    fleet: Fleet, tmp_path: Path
) -> None:
    """check runs its orders one after another; Ctrl-C during gpu0's command recorded
    gpu0's outcome and left gpu1's order unrun and unheard: RESTARTING with an attempt
    spent, its `restart` line saying a command was about to run and no line ever saying
    it did not, holding a `max_concurrent_restarts` place until the startup grace failed
    it as a failed restart (with restart_budget = 1: retired, no command having run)."""
    gpu0, gpu1 = fleet.start("gpu0", WEDGE), fleet.start("gpu1", WEDGE)
    started, marker = tmp_path / "gpu0-command-started", tmp_path / "gpu1-restarted"
    setup = configure(
        "unused",
        tmp_path,
        [
            ("gpu0", gpu0.url, [sys.executable, "-c", BRIEFLY, str(started)]),
            ("gpu1", gpu1.url, [sys.executable, "-c", TOUCH, str(marker)]),
        ],
        max_concurrent_restarts=2,
    )
    until_frozen(gpu0, gpu1)
    ctrl_c_once_a_command_started(setup, started)
    assert not marker.exists()  # gpu1's command was not run
    heard = {r["backend"]: r for r in setup.audit() if r["event"] == COMMAND}
    assert heard["gpu0"]["command"]["exit_code"] == 7
    assert "gpu1" in heard, "gpu1's restart is in the trail as about to run, never as not run"
    assert heard["gpu1"]["command"]["stderr"].startswith("not run: ")
    assert setup.saved("gpu1")["state"] == "dead"
    assert setup.saved("gpu1")["restart_times"] == []  # no command ran: no attempt spent


@pytest.mark.slow
def test_a_ctrl_c_between_two_commands_of_a_check_runs_no_further_command(
    fleet: Fleet, tmp_path: Path
) -> None:
    """Between two of a check's commands it reads the state again (an operator's verb may
    have held the next backend): a Ctrl-C pressed then, after gpu0's command ended and
    before gpu1's started, still started gpu1's command, and the check waited for it
    before it stopped. A Ctrl-C runs no command not yet started."""
    gpu0, gpu1 = fleet.start("gpu0", WEDGE), fleet.start("gpu1", WEDGE)
    marker = tmp_path / "gpu1-restarted"
    setup = configure(
        "unused",
        tmp_path,
        [
            ("gpu0", gpu0.url, [sys.executable, "-c", "import sys; sys.exit(7)"]),
            ("gpu1", gpu1.url, [sys.executable, "-c", TOUCH, str(marker)]),
        ],
        max_concurrent_restarts=2,
    )

    class CtrlCAfterTheFirstCommand(StateFile):
        """The operator's Ctrl-C lands while the check reads the state between commands."""

        pressed = False

        def read(self, decode: Callable[[dict[str, Any]], T]) -> T | None:
            if not self.pressed:
                self.pressed = True
                signal.raise_signal(signal.SIGINT)  # asyncio.run's handler hears it
            return super().read(decode)

    loaded = config_module.load(setup.config)
    targets = config_module.targets_for(loaded, [], [])
    settings = settings_of(loaded)
    until_frozen(gpu0, gpu1)
    store = CtrlCAfterTheFirstCommand(setup.state)
    with pytest.raises(KeyboardInterrupt):
        run_cycle(loaded, targets, settings, store)
    assert store.pressed
    assert not marker.exists(), "gpu1's command ran after the Ctrl-C"
    heard = {r["backend"]: r for r in setup.audit() if r["event"] == COMMAND}
    assert heard["gpu0"]["command"]["exit_code"] == 7
    assert heard["gpu1"]["command"]["stderr"].startswith("not run: ")
    assert setup.saved("gpu1")["state"] == "dead"
    assert setup.saved("gpu1")["restart_times"] == []


@pytest.mark.slow  # 5 s of a check, its command and a lock held
def test_ctrl_c_twice_once_the_commands_ended_and_the_record_waits_for_the_lock_keeps_it(
    entry_point: str, fleet: Fleet, tmp_path: Path
) -> None:
    """The command ended before any Ctrl-C; the settle that records it then waits up to
    10 s for a lock another run holds. The operator presses Ctrl-C, sees nothing happen
    and presses it again: that second press was a KeyboardInterrupt inside the settle,
    the command's outcome in no trail and its backend RESTARTING until its grace. Held
    off only after a Ctrl-C that came while a command ran, as if one had to come then."""
    gpu = fleet.start("gpu0", WEDGE)
    started = tmp_path / "command-started"
    setup = configure(
        entry_point,
        tmp_path,
        [("gpu0", gpu.url, [sys.executable, "-c", BRIEFLY, str(started)])],
    )
    until_frozen(gpu)
    check = check_in_background(entry_point, setup)
    lock = None
    try:
        command = command_started(check, started)
        lock = os.open(setup.state.with_name("state.json.lock"), os.O_RDWR | os.O_CREAT, 0o600)
        fcntl.flock(lock, fcntl.LOCK_EX)
        until = time.monotonic() + 30
        while command.exists():
            assert time.monotonic() < until, "the command did not end"
            time.sleep(0.05)
        time.sleep(1.0)  # check's recording settle now waits for the lock (up to 10 s)
        assert check.poll() is None, "check gave up on the lock already"
        check.send_signal(signal.SIGINT)  # Ctrl-C
        time.sleep(0.5)
        check.send_signal(signal.SIGINT)  # and again: nothing seemed to happen
        time.sleep(0.5)
        fcntl.flock(lock, fcntl.LOCK_UN)
        out, err = check.communicate(timeout=60)
    finally:
        if lock is not None:
            os.close(lock)
        if check.poll() is None:
            check.kill()
            check.wait(10)
    commands = [r for r in setup.audit() if r["event"] == COMMAND]
    assert [c["command"]["exit_code"] for c in commands] == [7], (setup.audit(), out, err)
    assert setup.saved("gpu0")["state"] == "dead"
    assert check.returncode == 130


@pytest.mark.slow  # two checks and a command
@pytest.mark.parametrize("step", [0.0, -120.0], ids=["steady", "clock stepped back 2 min"])
def test_a_restart_a_ctrl_c_kept_from_running_leaves_no_cooldown_behind(
    fleet: Fleet, tmp_path: Path, step: float
) -> None:
    """Its attempt was given back, yet the restart history kept the time it was issued:
    the check run again at once left gpu1 DEAD, "cooling down: 10m left after the last
    attempt", an attempt no command made. And with the wall clock stepped back (NTP,
    `date -s`) while gpu0's command ran: the settle that heard the commands took gpu1's
    restart back to its clock, and the history's attempt with it, so compared with the
    order's own stamp the ledger's budget was given back and the cooldown was not."""
    gpu0, gpu1 = fleet.start("gpu0", WEDGE), fleet.start("gpu1", WEDGE)
    started, marker = tmp_path / "gpu0-command-started", tmp_path / "gpu1-restarted"
    setup = configure(
        "unused",
        tmp_path,
        [
            ("gpu0", gpu0.url, [sys.executable, "-c", BRIEFLY, str(started)]),
            ("gpu1", gpu1.url, [sys.executable, "-c", TOUCH, str(marker)]),
        ],
        max_concurrent_restarts=2,
        cooldown="10m",
        cooldown_max="20m",
    )
    stepped = [0.0]

    def clock() -> float:
        return time.time() + stepped[0]

    until_frozen(gpu0, gpu1)
    ctrl_c_once_a_command_started(setup, started, clock, lambda: stepped.__setitem__(0, step))
    assert not marker.exists() and setup.saved("gpu1")["state"] == "dead"
    assert setup.saved("gpu1")["restart_times"] == []  # the budget's attempt given back
    assert setup.history("gpu1")["last_attempt_at"] is None  # and the cooldown's
    loaded = config_module.load(setup.config)
    targets = config_module.targets_for(loaded, [], [])
    again = run_cycle(loaded, targets, settings_of(loaded), StateFile(setup.state), clock=clock)
    [gpu1_note] = [note for note in again.restarts if note.name == "gpu1"]
    assert gpu1_note.action == "restart", gpu1_note  # not "cooling down: 10m left"
    assert marker.exists()


@pytest.mark.slow  # two checks, each with a command
def test_two_checks_interrupted_together_in_one_program_give_ctrl_c_back(
    fleet: Fleet, tmp_path: Path
) -> None:
    """A program checking two fleets at once (check_async, asyncio.gather) is interrupted
    while both run their commands. Each holds Ctrl-C off until its command is recorded,
    and each put back the handler it had replaced: the first to finish put back asyncio's,
    and the second then put back the first's, which ignores Ctrl-C. Neither asyncio.run
    nor anything after it took that one off: Ctrl-C did nothing for the rest of the
    program's life."""
    runs = []
    for name, pause in (("a", 0.5), ("b", 1.5)):
        folder = tmp_path / name
        folder.mkdir()
        server = fleet.start(f"gpu-{name}", WEDGE)
        started = folder / "command-started"
        waits = (
            "import os, sys, time; open(sys.argv[1], 'w').write(str(os.getpid()));"
            f" time.sleep({pause})"
        )
        setup = configure(
            "unused", folder, [("gpu0", server.url, [sys.executable, "-c", waits, str(started)])]
        )
        runs.append((server, setup, started))
    until_frozen(*(server for server, _, _ in runs))

    async def main() -> None:
        checks = []
        for _, setup, _ in runs:
            loaded = config_module.load(setup.config)
            settings = settings_of(loaded)
            targets = config_module.targets_for(loaded, [], [])
            checks.append(
                asyncio.ensure_future(
                    run_cycle_async(loaded, targets, settings, StateFile(setup.state))
                )
            )
        until = time.monotonic() + RUN_TIMEOUT
        while not all(started.exists() for _, _, started in runs):
            assert not any(check.done() for check in checks), [
                c.result() for c in checks if c.done()
            ]
            assert time.monotonic() < until, "a restart command never started"
            await asyncio.sleep(0.02)
        for check in checks:  # Ctrl-C, as asyncio.gather passes it on to each
            check.cancel()
            await asyncio.sleep(0.05)
        for check in checks:
            with pytest.raises(asyncio.CancelledError):
                await check

    before = signal.getsignal(signal.SIGINT)
    try:
        asyncio.run(main())
        after = signal.getsignal(signal.SIGINT)
    finally:
        signal.signal(signal.SIGINT, before)
    assert after is before, after
    for _, setup, _ in runs:
        assert [r["command"]["exit_code"] for r in setup.audit() if r["event"] == COMMAND] == [0]


@pytest.mark.slow
def test_a_check_without_a_store_restarts_nothing_even_with_a_restart_command(
    fleet: Fleet, tmp_path: Path
) -> None:
    """No store, nothing to remember a restart by: a check called with none (the library's
    ``check`` with no state) judges the wedge and runs no command, as bare URLs do."""
    gpu0 = fleet.start("gpu0", WEDGE)
    marker = tmp_path / "gpu0-restarted"
    setup = configure(
        "unused", tmp_path, [("gpu0", gpu0.url, [sys.executable, "-c", TOUCH, str(marker)])]
    )
    loaded = config_module.load(setup.config)
    targets = config_module.targets_for(loaded, [], [])
    until_frozen(gpu0)
    report = run_cycle(loaded, targets, settings_of(loaded), None)
    assert [(b.outcome.verdict.kind, b.snapshot and b.snapshot.state) for b in report.backends] == [
        ("wedged", "dead")
    ]
    assert report.restarts == ()
    assert not marker.exists(), "a restart command ran with no state to remember it by"
