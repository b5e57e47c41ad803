"""examples/ run as their users run them: real processes against real simulated backends."""

from __future__ import annotations

import asyncio
import importlib.util
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest
from simproc import child_env, running_simulator

from llmhealth import FleetHealth, FleetPolicy, State

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
HEALTH = EXAMPLES / "llm-health.py"
TRAINER = EXAMPLES / "trainer_loop.py"
RUN_TIMEOUT = 120.0  # a bound for a hung example, far above what a run takes


def run(script: Path, *args: str) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(
        [sys.executable, str(script), *args],
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT,
        env=child_env(),
        check=False,
    )
    assert "Traceback" not in done.stderr, done.stderr
    return done


def health(url: str, *args: str) -> subprocess.CompletedProcess[str]:
    return run(HEALTH, url, "--wait", "0.3", "--timeout", "1", *args)


def completions_received(url: str) -> int:
    stats: dict[str, Any] = httpx.get(f"{url}/sim/stats", timeout=2.0).json()
    return int(stats["completions_received"])


def test_the_health_script_is_well_under_fifty_lines() -> None:
    assert len(HEALTH.read_text(encoding="utf-8").splitlines()) < 50


def test_the_health_script_says_ok_for_an_idle_server() -> None:
    with running_simulator(["idle"]) as sim:
        done = health(sim.urls[0])
    assert done.returncode == 0
    assert done.stdout.startswith("OK - idle: ")
    assert len(done.stdout.splitlines()) == 1


def test_the_health_script_never_sends_a_busy_server_a_request_nor_restarts_it(
    tmp_path: Path,
) -> None:
    marker = tmp_path / "restarted"
    with running_simulator(["busy"]) as sim:
        done = health(sim.urls[0], "--restart-cmd", f"touch {marker}")
        assert completions_received(sim.urls[0]) == 0
    assert done.returncode == 0 and done.stdout.startswith("OK - busy: ")
    assert not marker.exists()


@pytest.mark.slow
def test_the_health_script_restarts_a_proven_wedge(tmp_path: Path) -> None:
    marker = tmp_path / "restarted"
    with running_simulator(["wedge:0.1"]) as sim:
        done = health(sim.urls[0], "--restart-cmd", f"touch {marker}")
    assert done.returncode == 2
    assert done.stdout.startswith("CRITICAL - wedged: ")
    assert "restart command exited 0" in done.stdout
    assert marker.exists()


def test_the_health_script_does_not_restart_a_server_that_is_down(tmp_path: Path) -> None:
    marker = tmp_path / "restarted"
    with running_simulator(["idle"]) as sim:
        url = sim.urls[0]
    done = health(url, "--restart-cmd", f"touch {marker}")
    assert done.returncode == 2 and done.stdout.startswith("CRITICAL - down: ")
    assert "down: down:" not in done.stdout  # the evidence names its verdict; once is enough
    assert not marker.exists()


def test_the_health_script_is_unknown_for_a_bad_url() -> None:
    done = health("not-a-url")
    assert done.returncode == 3 and done.stdout.startswith("UNKNOWN - ")


@pytest.mark.slow
def test_the_trainer_loop_condemns_restarts_and_refits_back_to_a_full_fleet() -> None:
    with running_simulator(["idle", "unanswered"], request_seconds=0.2) as sim:
        done = run(TRAINER, *sim.urls, "--request-timeout", "1")
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    # Shard 1 never answers: its failed rollouts condemn it, and the controller rebuilds it.
    assert any(line.startswith("restarting shard 1 (request failed: ") for line in lines)
    assert "step 1: 4 of 4 rollouts" in lines  # retried on shard 0, nothing lost
    assert any(line.startswith("weight sync 2 aborted") for line in lines)
    assert lines[-2:] == [
        "shard 0: healthy weight_version=4",
        "shard 1: healthy weight_version=4",
    ]


def test_the_trainer_loop_restarts_no_shard_the_restart_budget_retired() -> None:
    """Past ``max_restart_attempts`` the ledger retires the shard; an example that
    restarted it anyway would teach callers to spend a budget the ledger refused."""
    spec = importlib.util.spec_from_file_location("trainer_loop", TRAINER)
    assert spec is not None and spec.loader is not None
    trainer = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(trainer)

    async def rounds(urls: list[str]) -> FleetHealth:
        fleet = FleetHealth(urls, policy=FleetPolicy(max_restart_attempts=2))
        async with httpx.AsyncClient(timeout=5.0) as client:
            for version in range(4):
                fleet.record_actor_death(0, f"actor died ({version})")
                await trainer.rebuild(client, fleet)
                if fleet.state_of(0) is State.STALE:
                    fleet.report_refit(0, weight_version=version)
        return fleet

    with running_simulator(["idle", "idle"]) as sim:
        fleet = asyncio.run(rounds(sim.urls))
        restarts = httpx.get(f"{sim.urls[0]}/sim/stats", timeout=2.0).json()["restarts"]
    assert fleet.state_of(0) is State.RETIRED
    assert restarts == 2


def test_the_health_script_is_unknown_not_critical_for_bad_arguments() -> None:
    """A typo in a health script's options is the check's failure (3), never the server's
    (2, which pages as a dead server), and never a usage text a plugin runner shows."""
    for args in (["--wait", "abc"], ["--bogus"]):
        done = run(HEALTH, "http://127.0.0.1:9", *args)
        assert done.returncode == 3, (args, done.stdout, done.stderr)
        assert done.stdout.startswith("UNKNOWN - "), done.stdout


def test_a_restart_command_that_does_not_parse_is_unknown_before_any_check(
    tmp_path: Path,
) -> None:
    """Found at start, not at the first wedge: there it was a traceback and exit 1
    (WARNING) in place of CRITICAL, and the wedged server was never restarted."""
    with running_simulator(["wedge:0.1"]) as sim:
        for command in ("touch 'unclosed", " "):
            done = health(sim.urls[0], "--restart-cmd", command)
            assert done.returncode == 3, (command, done.stdout, done.stderr)
            assert done.stdout.startswith("UNKNOWN - argument --restart-cmd"), done.stdout
        assert completions_received(sim.urls[0]) == 0


def test_the_health_script_is_one_line_when_its_restart_command_prints() -> None:
    """A plugin runner (Nagios, NRPE) takes the first line of stdout as the status: a
    restart command that prints (`docker restart vllm` echoes the container's name) put
    its words first, and the status line "CRITICAL - wedged: ..." second."""
    with running_simulator(["wedge:0.1"]) as sim:
        done = health(sim.urls[0], "--restart-cmd", "echo vllm")
    assert done.returncode == 2
    assert done.stdout.splitlines() == [done.stdout.rstrip("\n")], done.stdout
    assert done.stdout.startswith("CRITICAL - wedged: ")
    assert "restart command exited 0" in done.stdout
