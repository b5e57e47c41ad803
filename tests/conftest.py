"""Shared test helpers: fixture files by name, the installed command, and the process guard."""

from __future__ import annotations

import importlib.util
import shutil
import sys
from collections.abc import Callable
from functools import cache
from pathlib import Path

import pytest
from process_guard import register as register_process_guard

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"


@cache
def _load(name: str) -> str:
    # Cached: the real captures are ~50 KB each and many tests read the same ones.
    return (FIXTURES / name).read_text(encoding="utf-8")


@pytest.fixture(scope="session")
def fixture_text() -> Callable[[str], str]:
    """``fixture_text("vllm-0.32/busy-1.txt")``: a fixture file's text, by path under fixtures/.

    Session-scoped so that hypothesis tests may use it too.
    """
    return _load


@pytest.fixture(scope="session")
def entry_point() -> str:
    """The installed `llmhealth` console script: tests run the command operators run."""
    found = shutil.which("llmhealth", path=str(Path(sys.executable).parent))
    assert found, "the llmhealth console script is not installed next to this Python"
    return found


# uvloop is opt-in (llmhealth.eventloop): its half runs in `make e2e`'s lane (marked slow).
@pytest.fixture(params=["asyncio", pytest.param("uvloop", marks=pytest.mark.slow)])
def each_loop(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """The test once on asyncio's event loop and once on uvloop's (LLMHEALTH_LOOP, read by
    llmhealth.eventloop in this process and in the commands a test starts): their
    transports, timers and signal handling differ. The dev extra installs uvloop; a venv
    made before it skips that half."""
    if request.param == "uvloop" and importlib.util.find_spec("uvloop") is None:
        pytest.skip("uvloop is not installed: pip install -e '.[dev]' (make .venv/.installed)")
    monkeypatch.setenv("LLMHEALTH_LOOP", request.param)
    return str(request.param)


def pytest_configure(config: pytest.Config) -> None:
    register_process_guard(config, per_test=True)
