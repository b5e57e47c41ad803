"""Which event loop ``route`` and ``watch`` run on: asyncio's, or uvloop's when asked.

uvloop is an optional extra (``pip install 'llmhealth[uvloop]'``) taken only with
``LLMHEALTH_LOOP=uvloop`` (a config error where it is not installed): measured with the
routers' order turned each round, it did not take CPU off the router's requests beyond
the run-to-run spread (bench/README.md, "uvloop"), so installing it changes nothing by
itself. uvloop is imported only when the loop is about to run. ``check`` is not among
the callers: one short run would pay uvloop's import before its first request.
"""

from __future__ import annotations

import asyncio
import importlib.util
import os
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from llmhealth.config import ConfigError

ENV = "LLMHEALTH_LOOP"
CHOICES = ("asyncio", "uvloop")
_T = TypeVar("_T")


def chosen_loop(setting: str | None, uvloop_installed: bool) -> str:
    """The loop to run, from ``LLMHEALTH_LOOP``'s value (None or empty: not set)."""
    if not setting:
        return "asyncio"
    if setting not in CHOICES:
        raise ConfigError(f"{ENV}={setting!r}: expected one of {', '.join(CHOICES)}")
    if setting == "uvloop" and not uvloop_installed:
        raise ConfigError(f"{ENV}=uvloop, but uvloop is not installed: llmhealth[uvloop]")
    return setting


def loop_in_use() -> str:
    """The loop ``run`` would use in this process's environment."""
    return chosen_loop(os.environ.get(ENV), importlib.util.find_spec("uvloop") is not None)


def _factory(name: str) -> Callable[[], asyncio.AbstractEventLoop] | None:
    if name == "asyncio":
        return None  # asyncio.Runner's own default, as asyncio.run
    try:
        import uvloop  # noqa: PLC0415 - only when a loop is about to run
    except ImportError as exc:
        # Found but not importable (built for another Python, a library of its missing):
        # the installation's fault, not a bug of llmhealth's to report with a traceback.
        raise ConfigError(f"{ENV}=uvloop, but uvloop cannot be imported: {exc}") from None
    return uvloop.new_event_loop


def run(main: Coroutine[Any, Any, _T]) -> _T:
    """``asyncio.run(main)`` on the loop ``loop_in_use`` names."""
    try:
        factory = _factory(loop_in_use())
    except BaseException:
        main.close()  # never started: no "coroutine was never awaited" warning
        raise
    with asyncio.Runner(loop_factory=factory) as runner:
        return runner.run(main)
