"""How long an engine may show no progress before that proves a wedge.

Pure. vLLM publishes its counters and gauges when a step ends, so an engine inside one
long step (a big prefill on a CPU, a new shape compiling) looks frozen for as long as the
step lasts. Two waits without progress prove a wedge only for an engine whose steps are
short; for the others the window is the larger of two waits, the operator's
``wedge_after`` floor, a multiple of the longest step the engine itself recorded in its
histograms, and ``startup_wedge_after`` while its process is young. CPU time used by the
engine's local processes can only settle a freeze one way: none used is proof at two
waits; some used never proves health, it only lets the window run.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from llmhealth.metrics import Signals
from llmhealth.pickling import pickled_as_a_call

# Frozen engine processes that used less than this share of one CPU did nothing at all:
# a stopped or deadlocked process uses none, a computing one about one CPU per thread, and
# even on a host loaded eight times over its cores it gets far more than this.
CPU_IDLE_SHARE = 0.005
# Evidence wording only: above the idle share but under this one, the processes poll or
# wait (a real vLLM worker whose EngineCore was SIGSTOPped used 0.75 % of a CPU); a step
# that computes or compiles keeps about a whole CPU busy.
CPU_POLLING_SHARE = 0.05


@pickled_as_a_call
@dataclass(frozen=True, slots=True)
class LongestStep:
    """The longest step an engine is known to take, and where that figure came from."""

    seconds: float
    why: str

    def to_dict(self) -> dict[str, Any]:
        return {"seconds": self.seconds, "why": self.why}

    @classmethod
    def from_dict(cls, data: object, where: str) -> LongestStep:
        if not isinstance(data, dict):
            raise ValueError(f"{where}: expected a table")
        seconds, why = data.get("seconds"), data.get("why")
        if (
            isinstance(seconds, bool)
            or not isinstance(seconds, int | float)
            or not math.isfinite(seconds)
            or seconds < 0
        ):
            raise ValueError(f"{where}.seconds: expected a number of seconds, got {seconds!r}")
        if not isinstance(why, str):
            raise ValueError(f"{where}.why: expected a string")
        return cls(float(seconds), why)


@dataclass(frozen=True, slots=True)
class WedgeRules:
    """The configured part of the window (seconds; 0 turns a term off)."""

    wedge_after: float = 0.0
    step_factor: float = 3.0
    startup_grace: float = 900.0
    startup_wedge_after: float = 300.0


DEFAULT_RULES = WedgeRules()


@dataclass(frozen=True, slots=True)
class Window:
    """How long a freeze must last to prove a wedge beyond two waits; 0 means two waits."""

    seconds: float
    why: str

    @property
    def extended(self) -> bool:
        return self.seconds > 0


@pickled_as_a_call
@dataclass(frozen=True, slots=True)
class CpuSample:
    """CPU seconds the engine's local processes had used when a read was taken.

    ``processes`` names them (pids): two samples compare only over the same processes,
    since a process that exited takes its CPU time with it. ``at`` is when the sample
    was taken, which may be a while after its read (finding the processes takes time), on
    the steady clock (``time.monotonic``): a wall clock stepped forward between two
    samples made an engine computing all along look idle, and wedged it at two waits.
    ``stopped`` names those stopped by a signal (SIGSTOP, a debugger): a stopped engine
    core is frozen whatever its workers do (they may spin waiting for it).
    """

    seconds: float
    processes: tuple[int, ...]
    at: float | None = None
    stopped: tuple[int, ...] = ()


def longest_step(signals: Signals) -> LongestStep | None:
    """The longest step any engine of this text has recorded, from its own histograms.

    Two figures: the highest non-empty inter-token-latency bucket (a decode request
    waits out every step of the batch it is in), and the prefill time per prompt token
    times the most tokens the engine has put in one step (``EngineSignals.prefill_step``),
    at most the longest one request waited for its first token where that was read
    (``longest_prefill``). Each of the prompts prefilled together in one step counts that
    step's whole time in the prefill sum, so the product alone was that many steps long:
    eight prompts in one 20 s step made a 205 s "step", a 614 s window a check could
    never cover, and a real wedge there was never proven. A request's wait for its first
    token spans every step that holds a chunk of its prompt, and it is recorded as the
    prompt's tokens are, so that bound is no shorter than any such step. (The prefill
    time's own buckets are recorded when a request finishes: a request still generating
    after a long prefill step was in none, and that step was bounded by shorter ones.)
    """
    best: LongestStep | None = None
    for engine in signals.engines:
        if engine.longest_gap is not None and engine.longest_gap > 0:
            gap = engine.longest_gap
            why = (
                f"an inter-token gap over {gap:g} s"
                if engine.gap_beyond
                else f"inter-token gaps up to {gap:g} s"
            )
            best = longer(best, LongestStep(gap, f"engine {engine.engine}: {why}"))
        seconds, per_token = engine.prefill_step, engine.prefill_per_token
        if seconds is not None and per_token is not None:
            computed = " computed" if engine.computed_prompt_tokens != engine.prompt_tokens else ""
            why = (
                f"engine {engine.engine}: prefill {per_token * 1000:.3g} ms per prompt token"
                f"{computed} x up to {engine.largest_step_tokens:g} tokens in one step"
            )
            if engine.longest_prefill is not None and engine.longest_prefill < seconds:
                seconds = engine.longest_prefill
                why += f", at most the longest wait for a first token, up to {seconds:g} s"
            if not math.isfinite(seconds):
                # Finite figures whose product is not (a server's 1e308 s of prefill):
                # saved, an infinite step made the state unreadable, and a fresh ledger
                # forgot every DEAD, RETIRED, hold and budget.
                continue
            best = longer(best, LongestStep(seconds, why))
    return best


def longer(first: LongestStep | None, second: LongestStep | None) -> LongestStep | None:
    if first is None:
        return second
    if second is None or second.seconds <= first.seconds:
        return first
    return second


def wedge_window(
    rules: WedgeRules,
    learned: LongestStep | None,
    process_age: float | None,
    *,
    nothing_finished: bool = False,
) -> Window:
    """The window for an engine with this longest step, in a process this old.

    ``nothing_finished``: the process has finished no request yet. Where its age is
    unknown (several API servers: vLLM's multiprocess mode publishes no
    ``process_start_time_seconds``), that is taken for youth: a process restarted, or
    started with its fleet, compiles on its first requests with none finished. Without
    it such an engine had no startup window at all, and was wedged in two waits.
    """
    terms: list[tuple[float, str]] = []
    if rules.wedge_after > 0:
        terms.append((rules.wedge_after, f"wedge_after {rules.wedge_after:g} s"))
    if learned is not None and rules.step_factor > 0:
        terms.append(
            (
                learned.seconds * rules.step_factor,
                f"longest step seen {learned.seconds:g} s x{rules.step_factor:g} ({learned.why})",
            )
        )
    young = None
    if process_age is not None and process_age < 0:
        # Started "later" than this host's clock reads: the two clocks disagree. By less
        # than startup_grace it is taken for young: dropping the window wedged a
        # compiling engine in two waits, after every restart, until it was retired.
        if -process_age < rules.startup_grace:
            young = (
                f"process start {-process_age:.0f} s ahead of this host's clock: taken for young"
            )
    elif process_age is not None and process_age < rules.startup_grace:
        young = f"process {process_age:.0f} s old, within startup_grace {rules.startup_grace:g} s"
    elif process_age is None and nothing_finished:
        young = "process age unknown (several API servers) and no request finished in it yet"
    if young is not None and rules.startup_wedge_after > 0:
        terms.append(
            (
                rules.startup_wedge_after,
                f"{young}: startup_wedge_after {rules.startup_wedge_after:g} s "
                "(a young engine compiles)",
            )
        )
    if not terms:
        return Window(0.0, "two waits")
    seconds, why = max(terms, key=lambda term: term[0])
    return Window(seconds, why)


def cpu_span(first: CpuSample, last: CpuSample, reads_apart: float) -> float:
    """The time two samples are apart: their own times when known, else their reads'."""
    if first.at is not None and last.at is not None:
        return last.at - first.at
    return reads_apart


def cpu_used(first: CpuSample | None, last: CpuSample | None) -> float | None:
    """CPU seconds used between two samples of the same processes; None when unknown."""
    if first is None or last is None or first.processes != last.processes:
        return None
    if not first.processes or last.seconds < first.seconds:
        return None
    return last.seconds - first.seconds


def stopped_throughout(samples: list[CpuSample]) -> tuple[int, ...]:
    """The engine processes that every sample found stopped by a signal."""
    if not samples:
        return ()
    stopped = set(samples[0].stopped)
    for sample in samples[1:]:
        stopped &= set(sample.stopped)
    return tuple(sorted(stopped))


def cpu_was_idle(used: float, elapsed: float) -> bool:
    return elapsed > 0 and used < CPU_IDLE_SHARE * elapsed


def describe_cpu(used: float, elapsed: float) -> str:
    if cpu_was_idle(used, elapsed):
        return (
            f"engine processes used {used:.2f} s CPU in {elapsed:.1f} s: "
            "stopped or deadlocked, not computing"
        )
    # Under a second, two decimals: a little CPU above the idle share must not read as 0.0.
    shown = f"{used:.2f}" if used < 1 else f"{used:.1f}"
    if used < CPU_POLLING_SHARE * elapsed:
        return f"engine processes used {shown} s CPU in {elapsed:.1f} s: polling, not computing"
    return f"engine processes used {shown} s CPU in {elapsed:.1f} s: compiling or computing"
