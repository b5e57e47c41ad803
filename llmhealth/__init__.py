"""llmhealth: health checks for LLM inference fleets that read the server's own metrics first.

The public API is exactly ``__all__``; everything else is internal and may change. Names
are imported on first use, so ``import llmhealth`` (and the CLI's start-up) loads neither
httpx nor rich until a check or a prober is asked for.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"  # the same as pyproject.toml; a test holds them together

if TYPE_CHECKING:
    from llmhealth.actions import AuditError
    from llmhealth.api import BackendResult, CheckReport, check, check_async
    from llmhealth.classify import VerdictKind
    from llmhealth.config import ConfigError
    from llmhealth.fleet import StallWatch
    from llmhealth.fleet_health import FleetExhausted, FleetHealth, FleetPolicy, Key
    from llmhealth.ledger import (
        BackendSnapshot,
        NoServingBackend,
        State,
        Transition,
        UnknownBackend,
    )
    from llmhealth.prober import Prober, ProbeResult
    from llmhealth.report import ExitCode, FleetSummary
    from llmhealth.selector import Selector
    from llmhealth.state import StateCorruptError, StateError, StateLockedError

_HOMES = {
    "check": "llmhealth.api",
    "check_async": "llmhealth.api",
    "CheckReport": "llmhealth.api",
    "BackendResult": "llmhealth.api",
    "ExitCode": "llmhealth.report",
    "FleetSummary": "llmhealth.report",
    "VerdictKind": "llmhealth.classify",
    "FleetHealth": "llmhealth.fleet_health",
    "FleetPolicy": "llmhealth.fleet_health",
    "FleetExhausted": "llmhealth.fleet_health",
    "Key": "llmhealth.fleet_health",
    "State": "llmhealth.ledger",
    "BackendSnapshot": "llmhealth.ledger",
    "Transition": "llmhealth.ledger",
    "UnknownBackend": "llmhealth.ledger",
    "NoServingBackend": "llmhealth.ledger",
    "Selector": "llmhealth.selector",
    "Prober": "llmhealth.prober",
    "ProbeResult": "llmhealth.prober",
    "StallWatch": "llmhealth.fleet",
    # What check and check_async raise besides ValueError: a caller catches them by name.
    "ConfigError": "llmhealth.config",
    "StateError": "llmhealth.state",
    "StateLockedError": "llmhealth.state",
    "StateCorruptError": "llmhealth.state",
    "AuditError": "llmhealth.actions",
}

__all__ = [
    "AuditError",
    "BackendResult",
    "BackendSnapshot",
    "CheckReport",
    "ConfigError",
    "ExitCode",
    "FleetExhausted",
    "FleetHealth",
    "FleetPolicy",
    "FleetSummary",
    "Key",
    "NoServingBackend",
    "ProbeResult",
    "Prober",
    "Selector",
    "StallWatch",
    "State",
    "StateCorruptError",
    "StateError",
    "StateLockedError",
    "Transition",
    "UnknownBackend",
    "VerdictKind",
    "__version__",
    "check",
    "check_async",
]


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'llmhealth' has no attribute {name!r}")
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value  # later look-ups skip this function
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
