"""The event loop choice: asyncio's unless LLMHEALTH_LOOP asks for uvloop, never a guess."""

from __future__ import annotations

import asyncio
import os
import subprocess
from pathlib import Path

import pytest

from llmhealth import eventloop
from llmhealth.config import ConfigError


@pytest.mark.parametrize(
    ("setting", "installed", "chosen"),
    [
        (None, True, "asyncio"),
        ("", True, "asyncio"),
        (None, False, "asyncio"),
        ("asyncio", True, "asyncio"),
        ("asyncio", False, "asyncio"),
        ("uvloop", True, "uvloop"),
    ],
)
def test_uvloop_only_when_the_environment_asks_for_it(
    setting: str | None, installed: bool, chosen: str
) -> None:
    assert eventloop.chosen_loop(setting, installed) == chosen


@pytest.mark.parametrize(("setting", "installed"), [("uvloop", False), ("trio", True)])
def test_a_loop_that_cannot_be_had_is_a_config_error(setting: str, installed: bool) -> None:
    with pytest.raises(ConfigError, match="LLMHEALTH_LOOP"):
        eventloop.chosen_loop(setting, installed)


def test_run_runs_on_the_chosen_loop(each_loop: str) -> None:
    async def kind() -> str:
        return type(asyncio.get_running_loop()).__module__.split(".")[0]

    assert eventloop.run(kind()) == each_loop


def test_a_bad_setting_fails_before_the_coroutine_starts(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(eventloop.ENV, "trio")
    started = []

    async def work() -> None:
        started.append(True)

    with pytest.raises(ConfigError):
        eventloop.run(work())  # and no "never awaited" warning, an error under pytest
    assert not started


def test_a_uvloop_installed_but_not_importable_is_a_config_error(
    entry_point: str, tmp_path: Path
) -> None:
    """Found, but its extension built for another Python: `watch` printed a traceback
    and called it llmhealth's own bug, for an installation to fix."""
    broken = tmp_path / "site" / "uvloop"
    broken.mkdir(parents=True)
    (broken / "__init__.py").write_text(
        'raise ImportError("loop.cpython-311-x86_64-linux-gnu.so: undefined symbol")\n'
    )
    environment = {
        **os.environ,
        "PYTHONPATH": str(broken.parent),
        eventloop.ENV: "uvloop",
    }
    done = subprocess.run(
        [entry_point, "watch", "http://127.0.0.1:9", "--state", str(tmp_path / "s.json")],
        capture_output=True,
        text=True,
        timeout=60,
        env=environment,
        check=False,
    )
    assert done.returncode == 3
    assert "uvloop cannot be imported: loop.cpython-311" in done.stderr
    assert "Traceback" not in done.stderr and "internal error" not in done.stderr
