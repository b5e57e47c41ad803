"""Long engine steps against the wedge window: false wedges, and what detection costs.

`../.venv/bin/python bench_longsteps.py` runs a cron-style `check` (`run_cycle` with a
state file, every `PERIOD` seconds) against a stand-in for a vLLM backend whose counters
follow a timeline: stepping, then frozen inside one long step (and stepping again), or
frozen for good. The stand-in is its own process on 127.0.0.1 with an "engine" child
that uses a little CPU (as an engine inside a step does), so llmhealth's local CPU
evidence is real. Each case runs twice, side by side: with the wedge window (llmhealth
now) and with the two-wait rule alone (llmhealth before: `step_factor` 0, no startup
window). Times are scaled down (a wait of 0.5 s); what is compared is the same in both.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from report import Section, Table

from llmhealth.classify import Target, VerdictKind
from llmhealth.config import Backend, Config, Policy
from llmhealth.cycle import run_cycle
from llmhealth.probe import ProbeSettings
from llmhealth.remediate import Mode
from llmhealth.state import StateFile
from llmhealth.window import WedgeRules

WAIT = 0.5
PERIOD = 2.0  # the check timer (one minute, scaled)
MAX_CHECK_TIME = 30.0
STARTUP_GRACE = 120.0
STARTUP_WEDGE_AFTER = 20.0
WINDOW = WedgeRules(startup_grace=STARTUP_GRACE, startup_wedge_after=STARTUP_WEDGE_AFTER)
TWO_WAITS_ONLY = WedgeRules(step_factor=0.0, startup_wedge_after=0.0)

# The stand-in backend. argv[1] is its timeline as JSON: the age its process claims, the
# longest inter-token gap it recorded before, and freezes as [at, seconds or null].
TIMELINE_SERVER = r"""
import http.server, json, signal, subprocess, sys, time
spec = json.loads(sys.argv[1])
born = time.monotonic()
start = time.time() - spec["age"]
bounds = [0.01, 0.025, 0.05, 0.1, 0.5, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0]
def state(t):
    frozen, gaps = 0.0, [spec["prior_gap"]] if spec["prior_gap"] else []
    for at, length in spec["freezes"]:
        if t <= at:
            continue
        if length is None or t < at + length:
            return at - frozen, gaps
        frozen += length
        gaps.append(length)
    return t - frozen, gaps
def text():
    active, gaps = state(time.monotonic() - born)
    steps = 1000 + int(50 * active)
    lines = [f"process_start_time_seconds {start:.2f}"]
    e = 'engine="0",model_name="m"'
    lines += [f"vllm:num_requests_running{{{e}}} 1.0", f"vllm:num_requests_waiting{{{e}}} 0.0"]
    lines += [f"vllm:iteration_tokens_total_count{{{e}}} {steps}.0"]
    lines += [f"vllm:generation_tokens_total{{{e}}} {steps}.0"]
    lines += [f"vllm:kv_cache_usage_perc{{{e}}} {0.1 + (steps % 997) / 1e4}"]
    for bound in bounds + [float("inf")]:
        count = steps + sum(1 for gap in gaps if gap <= bound)
        le = "+Inf" if bound == float("inf") else repr(bound)
        lines.append(f'vllm:inter_token_latency_seconds_bucket{{{e},le="{le}"}} {count}.0')
    return ("\n".join(lines) + "\n").encode()
class Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        body = text()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
    def log_message(self, *args):
        pass
server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
# Named as vLLM's engine core names itself: llmhealth samples no process that names no
# vLLM (a forwarder's idle CPU proved wedges), and a stand-in named python gave none.
engine = subprocess.Popen(["VLLM::EngineCore", "-c",
    "import time\nwhile True:\n    sum(range(300000))\n    time.sleep(0.005)"],
    executable=sys.executable)
print(server.server_address[1], engine.pid, flush=True)
signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # so that the engine goes too
try:
    server.serve_forever()
finally:
    engine.kill()
"""


@dataclass(frozen=True)
class Case:
    name: str
    age: float  # seconds the process claims to have run
    prior_gap: float  # longest inter-token gap recorded before the timeline starts
    freeze_at: float
    freeze_for: float | None  # None: frozen for good (a wedge)
    stop_engine: bool = False  # SIGSTOP the engine child when the freeze starts
    runs_for: float = 24.0


CASES = [
    Case("young engine, first long step of 6 s", 30.0, 0.0, 4.0, 6.0),
    Case("old engine that took a 4 s step before; a 6 s step", 3600.0, 4.0, 4.0, 6.0),
    Case("old engine, short steps, wedged for good", 3600.0, 0.0, 4.0, None),
    Case("old engine with 4 s steps, wedged for good (computing)", 3600.0, 4.0, 4.0, None),
    Case("the same, engine stopped (no CPU)", 3600.0, 4.0, 4.0, None, stop_engine=True),
]


@dataclass
class Outcome:
    checks: int = 0
    wedged: int = 0
    restarts: int = 0  # restarts a restart command would have been run for (dry run)
    detection: float | None = None  # seconds from the freeze to the first `wedged`
    verdicts: list[str] = field(default_factory=list)


@contextmanager
def stand_in(case: Case) -> Iterator[tuple[str, int, float]]:
    spec = {
        "age": case.age,
        "prior_gap": case.prior_gap,
        "freezes": [[case.freeze_at, case.freeze_for]],
    }
    process = subprocess.Popen(
        [sys.executable, "-c", TIMELINE_SERVER, json.dumps(spec)],
        stdout=subprocess.PIPE,
        text=True,
    )
    born = time.monotonic()
    engine: int | None = None
    try:
        assert process.stdout is not None
        port, engine = (int(field) for field in process.stdout.readline().split())
        yield f"http://127.0.0.1:{port}", engine, born
    finally:
        process.terminate()
        process.wait(timeout=10)
        if process.stdout is not None:
            process.stdout.close()
        if engine is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(engine, signal.SIGKILL)  # gone with its server already, normally


def run_case(case: Case, rules: WedgeRules) -> Outcome:
    settings = ProbeSettings(wait=WAIT, timeout=5.0, max_check_time=MAX_CHECK_TIME)
    outcome = Outcome()
    with tempfile.TemporaryDirectory() as folder, stand_in(case) as (url, engine, born):
        # A restart command, so that a wedge is a restart decision; in dry run none runs.
        config = Config(
            wait=WAIT,
            max_check_time=MAX_CHECK_TIME,
            policy=Policy(startup_grace=STARTUP_GRACE),
            backends=(Backend("cpu0", url, restart=("true",)),),
        )
        store = StateFile(Path(folder) / "state.json")
        target = Target("cpu0", url, rules=rules)
        stopped = False
        try:
            while (now := time.monotonic() - born) < case.runs_for:
                if case.stop_engine and not stopped and now >= case.freeze_at:
                    os.kill(engine, signal.SIGSTOP)
                    stopped = True
                report = run_cycle(config, [target], settings, store, mode=Mode.DRY_RUN)
                ended = time.monotonic() - born
                verdict = report.backends[0].outcome.verdict
                outcome.checks += 1
                outcome.verdicts.append(str(verdict.kind))
                outcome.restarts += sum(1 for note in report.restarts if note.action == "restart")
                if verdict.kind is VerdictKind.WEDGED:
                    outcome.wedged += 1
                    if outcome.detection is None:
                        outcome.detection = ended - case.freeze_at
                time.sleep(max(0.0, PERIOD - (time.monotonic() - born - now)))
        finally:
            if stopped:
                os.kill(engine, signal.SIGCONT)
    return outcome


def run() -> list[Section]:
    began = time.monotonic()
    rows = []
    for case in CASES:
        for label, rules in (("window", WINDOW), ("two waits", TWO_WAITS_ONLY)):
            outcome = run_case(case, rules)
            frozen_for = "for good" if case.freeze_for is None else f"{case.freeze_for:g} s"
            detection = "-" if outcome.detection is None else f"{outcome.detection:.1f}"
            rows.append(
                [
                    case.name,
                    label,
                    frozen_for,
                    str(outcome.checks),
                    str(outcome.wedged if case.freeze_for is not None else "-"),
                    str(outcome.restarts),
                    detection if case.freeze_for is None else "-",
                    " ".join(_runs(outcome.verdicts)),
                ]
            )
            print(" | ".join(rows[-1]), flush=True)
    table = Table(
        [
            "case",
            "rule",
            "frozen",
            "checks",
            "false wedges",
            "restarts decided",
            "wedge → verdict (s)",
            "verdicts in order",
        ],
        rows,
    )
    return [
        Section(
            title="2b. Long engine steps and the wedge window (bench_longsteps)",
            command="cd bench && ../.venv/bin/python bench_longsteps.py",
            intro=[
                f"A `check` every {PERIOD:g} s (the one-minute timer scaled down 30x, wait "
                f"{WAIT:g} s, `max_check_time` {MAX_CHECK_TIME:g} s, `startup_grace` "
                f"{STARTUP_GRACE:g} s, `startup_wedge_after` {STARTUP_WEDGE_AFTER:g} s) against "
                "a stand-in backend on 127.0.0.1 whose counters freeze "
                f"{CASES[0].freeze_at:g} s after it starts: for one long step that ends, or for "
                "good. Its engine child uses a little CPU unless stopped. `window` is "
                "llmhealth now; `two waits` is the rule before the window (no learned step, "
                "no startup window), measured in the same run. Restarts are decided in dry "
                "run: none is carried out.",
            ],
            tables=[table],
            notes=[
                "Target: 0 false wedges while a step is longer than two waits but inside the "
                "window; a stopped engine still proven at two waits by its CPU time; the cost "
                "of the window is the detection time of a wedge of a computing engine with "
                "long steps (three times its longest step).",
                "One run per case and rule. `restarts decided` counts the checks whose plan "
                "was a restart: in dry run the backend stays DEAD, so every later check "
                "decides it again. A check inside a freeze keeps reading until the window is "
                "covered or the engine moves, so fewer checks fit in a window run.",
            ],
            seconds=time.monotonic() - began,
        )
    ]


def _runs(verdicts: list[str]) -> list[str]:
    """`busy x3 stalled x2 ...`: the verdicts in order, repeats counted."""
    out: list[str] = []
    for verdict in verdicts:
        if out and out[-1].split(" x")[0] == verdict:
            head, _, count = out[-1].partition(" x")
            out[-1] = f"{head} x{int(count or 1) + 1}"
        else:
            out.append(verdict)
    return out


def main() -> None:
    from report import section_markdown  # noqa: PLC0415 - printing only

    for section in run():
        print(section_markdown(section))


if __name__ == "__main__":
    main()
