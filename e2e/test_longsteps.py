"""The slow-engine lane: long engine steps on a real vLLM are not wedges; a stopped engine is.

vLLM publishes its counters and gauges when an engine step ends, so an engine inside one
long step shows frozen counters for as long as the step lasts. Here the step is real: a
~186 M-parameter random Llama (make_model.py's ``slow`` shape) in float32 on the CPU,
where one step of a 3,500-token prompt takes 15-25 s on the one core vLLM binds its
worker to (the CPU's bf16 matrix units did it in 4 s, too short to outlast a check). No
compile is involved (``--enforce-eager``), and ``--max-num-batched-tokens 4096`` puts the
whole prompt, with the decode beside it, into that one step.

The configs make the engine count as old (``startup_grace`` 1 s), so the young-process
window cannot be what saves it: each freeze is judged by the rule the test names, with
llmhealth's local CPU evidence (the engine's processes found through the port) read
against the real processes. A restart command that writes a marker file is configured
throughout; it must never run during a freeze, and it does run for the real wedge.
"""

from __future__ import annotations

import json
import os
import random
import signal
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from conftest import record, start_server, watch_log
from helpers import (
    GENERATED,
    RUNNING,
    CheckRun,
    FreezeWatch,
    Load,
    StreamedDecode,
    check,
    prefill_body,
    scrape,
    wait_for,
    wait_quiet,
)
from vllm_server import SLOW_MODEL_DIR, VllmServer, free_port, process_state

WAIT = 2.0  # seconds between reads: two waits are 4 s, far shorter than one long step
# A short cron check: three reads (two waits), then it must say what it saw. Short, so
# that the lane needs a step of only a few waits and stays meaningful on a faster CPU.
MAX_CHECK_TIME = 4.0
ANSWER_TIMEOUT = 2.0  # the configured tiny request timeout, before the learned step grows it
WEDGE_AFTER = 60.0  # the floor the README tells CPU operators to set: above any first step
PROMPT_TOKENS = 3500
MAX_MODEL_LEN = 4096
SLOW_ARGS = (
    "--enforce-eager",
    "--max-num-batched-tokens",
    str(MAX_MODEL_LEN),
)
# Every check during a freeze must say one of these; never wedged, never unanswered.
NOT_PROOF = {"busy", "stalled", "idle"}
OK, WARNING, CRITICAL = 0, 1, 2


@pytest.fixture(scope="module")
def slow_engine(vllm: VllmServer, workdir: Path) -> Iterator[VllmServer]:
    """The slow model's server, alone on the machine (the shared one is stopped first)."""
    vllm.stop()
    server = VllmServer(
        free_port(),
        workdir / "vllm-slow.log",
        extra_args=SLOW_ARGS,
        model=SLOW_MODEL_DIR,
        max_model_len=MAX_MODEL_LEN,
        dtype="float32",
    )
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def slow_server(slow_engine: VllmServer) -> VllmServer:
    if not slow_engine.alive():
        start_server(slow_engine)
    watch_log(slow_engine)
    return slow_engine


def write_config(
    path: Path,
    server: VllmServer,
    state: Path,
    *,
    wedge_after: float | None,
    marker: Path | None = None,
) -> Path:
    """A cron-style check's config; the restart command only leaves ``marker`` behind."""
    floor = "" if wedge_after is None else f'wedge_after = "{wedge_after:g}s"\n'
    restart = ""
    if marker is not None:
        argv = [sys.executable, "-c", "import sys; open(sys.argv[1], 'w').close()", str(marker)]
        restart = f"restart = {json.dumps(argv)}\n"
    path.write_text(
        f'wait = "{WAIT:g}s"\n'
        'timeout = "10s"\n'
        f'answer_timeout = "{ANSWER_TIMEOUT:g}s"\n'
        f'max_check_time = "{MAX_CHECK_TIME:g}s"\n'
        f'state = "{state}"\n'
        "[policy]\n"
        # Old at once: the young-process window must not be what keeps it from wedged.
        'startup_grace = "1s"\n'
        # Doubt is counted, but must not condemn it here: then a real wedge would find it
        # DEAD already and the restart command (the positive control) could not show. A
        # slower host's long step (62 s, against 33 s) was eleven cron checks of doubt.
        "unhealthy_threshold = 30\n"
        "[[backend]]\n"
        'name = "cpu0"\n'
        f'url = "{server.url}"\n'
        f"{floor}{restart}",
        encoding="utf-8",
    )
    return path


def decode_running(server: VllmServer) -> StreamedDecode:
    """A decode that outlasts the scenario (the model holds 4,096 positions), running."""
    before = scrape(server.url).get(GENERATED, 0.0)
    decode = StreamedDecode(server.url, max_tokens=MAX_MODEL_LEN - 16)

    def stepping() -> bool:
        now = scrape(server.url)
        return now[RUNNING] == 1 and now[GENERATED] > before + 2

    try:
        wait_for("the decode to run", stepping, 120)
    except BaseException:
        decode.close()
        raise
    return decode


def checks_through_a_freeze(
    server: VllmServer, config: Path, seed: int, control: Path | None = None
) -> tuple[list[CheckRun], float, Load, CheckRun | None]:
    """Send one long prompt and run the check back to back until it is answered, then once
    more; returns the checks, the longest the step counter stood still, the prompt, and
    the ``control`` config's check, run beside the first one."""
    watch = FreezeWatch(server.url).start()
    prompt = Load(server.url, [prefill_body(random.Random(seed), PROMPT_TOKENS)]).start()
    runs: list[CheckRun] = []
    beside = None
    try:
        time.sleep(1.0)  # the prompt reaches the engine before the first check's first read
        with ThreadPoolExecutor(1) as pool:
            if control is not None:
                beside = pool.submit(check, "--config", str(control))
            deadline = time.monotonic() + 180
            while time.monotonic() < deadline:
                answered = prompt.join(0)
                runs.append(check("--config", str(config)))
                if answered:
                    break
    finally:
        prompt.stop()
        prompt.join(60)
        watch.stop()
    return runs, watch.longest_freeze(), prompt, None if beside is None else beside.result()


def verdicts(runs: list[CheckRun]) -> list[str]:
    return [run.backend["verdict"] for run in runs]


def learned_step(state: Path) -> dict[str, Any]:
    """The longest step the state file keeps for the backend (what later runs start from)."""
    document = json.loads(state.read_text(encoding="utf-8"))
    step: dict[str, Any] | None = document["sightings"]["cpu0"].get("longest_step")
    assert step is not None, f"no longest_step in {state}: {document['sightings']}"
    return step


def test_long_prefill_steps_are_busy_or_stalled_never_wedged_nor_restarted(
    slow_server: VllmServer, tmp_path: Path
) -> None:
    marker = tmp_path / "restart-ran"
    state = tmp_path / "state.json"
    with_floor = write_config(
        tmp_path / "floor.toml", slow_server, state, wedge_after=WEDGE_AFTER, marker=marker
    )
    # The control: the same check without the floor (and without a restart command).
    two_waits = write_config(
        tmp_path / "two-waits.toml", slow_server, tmp_path / "two-waits.json", wedge_after=None
    )

    # 1. A decode running, then one long prompt: running 1 frozen for the whole step. The
    #    engine is old and nothing it did so far took long, so the wedge_after floor is
    #    what widens its window (the control shows two waits alone calling it a wedge).
    wait_quiet(slow_server)
    started = time.monotonic()
    with decode_running(slow_server):
        runs, freeze, prompt, control = checks_through_a_freeze(
            slow_server, with_floor, seed=1, control=two_waits
        )
    seen = ", ".join(verdicts(runs))
    record(f"slow lane: decode + long prompt, step {freeze:.1f} s: {seen}", 0.0)
    record("slow lane: phase with a decode running", time.monotonic() - started)
    history = "\n".join(map(repr, [*runs, control]))
    assert prompt.all_ok, prompt.summary()
    assert freeze > 3 * WAIT, f"the long step took {freeze:.1f} s: no freeze to judge\n{history}"
    assert set(verdicts(runs)) <= {"busy", "stalled"}, history
    assert all(run.code in (OK, WARNING) for run in runs), history
    assert all(run.backend["requests_sent"] == 0 for run in runs), history
    assert all(run.doc["restarts"] == [] for run in runs), history
    stalled = [run.backend["evidence"] for run in runs if run.backend["verdict"] == "stalled"]
    # A check whose reads saw the step begin only in their last wait says "one wait"; the
    # others saw it over two waits or more, where the window is what kept it from wedged.
    judged = [e for e in stalled if "no progress over one wait" not in e]
    assert judged, f"no check saw the freeze over two waits\n{history}"
    for evidence in judged:
        assert f"short of its window {WEDGE_AFTER:g} s (wedge_after {WEDGE_AFTER:g} s)" in evidence
        # The engine's own processes, found through the port, were computing all along.
        assert "engine processes used" in evidence and "compiling or computing" in evidence
        assert "this run's reads ran out first (max_check_time)" in evidence
    assert runs[-1].backend["verdict"] == "busy", history
    assert control is not None and control.backend["verdict"] == "wedged", history
    assert "window two waits" in control.backend["evidence"], history
    # The step is now in the engine's own histograms, and the state file keeps it.
    step = learned_step(state)
    assert step["seconds"] >= 2 * WAIT, step
    record(f"slow lane: learned step {step['seconds']:g} s ({step['why']})", 0.0)

    # 2. Idle, then another long prompt: /metrics says 0 running throughout the step and the
    #    tiny request queues behind it. No floor now: the step learned above widens the
    #    window, and the tiny request that timed out is doubt, not "unanswered".
    wait_quiet(slow_server)
    learned_only = write_config(
        tmp_path / "learned.toml", slow_server, state, wedge_after=None, marker=marker
    )
    started = time.monotonic()
    runs, freeze, prompt, _ = checks_through_a_freeze(slow_server, learned_only, seed=2)
    seen = ", ".join(verdicts(runs))
    record(f"slow lane: idle + long prompt, step {freeze:.1f} s: {seen}", 0.0)
    record("slow lane: phase with the engine idle", time.monotonic() - started)
    history = "\n".join(map(repr, runs))
    assert prompt.all_ok, prompt.summary()
    # The tiny request needs the step to outlast its wait, and one more read after it.
    assert freeze > 1 + MAX_CHECK_TIME + WAIT, (
        f"the long step took {freeze:.1f} s: too short to hold the tiny request\n{history}"
    )
    assert set(verdicts(runs)) <= NOT_PROOF, history
    assert all(run.doc["restarts"] == [] for run in runs), history
    queued = [run.backend["evidence"] for run in runs if run.backend["verdict"] == "stalled"]
    assert queued, f"no tiny request was held by the step\n{history}"
    for evidence in queued:
        # It waited longer than answer_timeout: the learned step grew its timeout, up to
        # max_check_time.
        assert f"no complete HTTP answer within {MAX_CHECK_TIME:g} s" in evidence, evidence
        assert "no counter moved" in evidence, evidence
        assert "longest step seen" in evidence, evidence
        assert "compiling or computing" in evidence, evidence
    assert not marker.exists(), "a restart command ran during a long step"


def test_an_engine_core_stopped_under_load_is_still_wedged_in_two_waits(
    slow_server: VllmServer, tmp_path: Path
) -> None:
    marker = tmp_path / "restart-ran"
    config = write_config(
        tmp_path / "floor.toml",
        slow_server,
        tmp_path / "state.json",
        wedge_after=WEDGE_AFTER,
        marker=marker,
    )
    wait_quiet(slow_server)
    with decode_running(slow_server):
        engine = slow_server.engine_core_pid()
        os.kill(engine, signal.SIGSTOP)
        try:
            time.sleep(1.0)  # let the last step's numbers reach /metrics
            wedged = check("--config", str(config))
            stopped = process_state(engine)
        finally:
            os.kill(engine, signal.SIGCONT)
    backend = wedged.backend
    assert stopped == "T"
    assert wedged.code == CRITICAL, wedged
    assert backend["verdict"] == "wedged", wedged
    evidence = backend["evidence"]
    # Proven by the local evidence at two waits, well inside the 60 s window.
    assert "no progress over 2 consecutive waits" in evidence, wedged
    assert f"engine process {engine}" in evidence, wedged
    assert "stayed stopped by a signal (state T) throughout" in evidence, wedged
    # Its worker may poll a little meanwhile; the CPU evidence never calls that computing.
    assert "not computing" in evidence, wedged
    # The positive control: the same restart command does run for a real wedge.
    assert [r["action"] for r in wedged.doc["restarts"]] == ["restart"], wedged
    assert wedged.doc["restarts"][0]["ran"] is True, wedged
    assert marker.exists()
