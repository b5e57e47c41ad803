"""Real vLLM /metrics texts from fixtures/, and the one change the sleep tests make to
them: an engine put to sleep on purpose, as RL trainers do between rollouts."""

from __future__ import annotations

from pathlib import Path

CAPTURES = Path(__file__).parent.parent / "fixtures" / "vllm-0.32"


def put_to_sleep(text: str) -> str:
    """``text`` with its engine put to sleep on purpose (weights offloaded)."""
    return text.replace('sleep_state="awake"} 1.0', 'sleep_state="awake"} 0.0').replace(
        'sleep_state="weights_offloaded"} 0.0', 'sleep_state="weights_offloaded"} 1.0'
    )


def asleep_capture(name: str = "idle-1") -> str:
    """The capture ``name`` with its engine asleep on purpose."""
    return put_to_sleep((CAPTURES / f"{name}.txt").read_text())
