"""What one examination costs to cross a read worker's pipe: pickled, then unpickled.

With read workers, each examination of a backend goes to the daemon as one `_Heard`
(the read not sent before, the verdict without its reads), batched into frames; the
worker pickles it and the daemon's loop unpickles it, 10,000 a wait at 10,000 backends.
This builds what a worker sends at a backend's seventh read (bench_window's windows:
texts the simulator's engine renders 5 s apart, parsed and judged as `watch` does) for
bench_scale's mix, in frames of 200, each backend's objects its own, and times both
directions per examination two ways in the same process, alternated: with the package's
pickling (`llmhealth/pickling.py`: each object as a call of its class) and with the
state functions `dataclasses` gives a frozen slots class (the hook taken off).

Usage: bench_pipe.py [ROUNDS]
"""

from __future__ import annotations

import pickle
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from bench_window import FLEET, judge, window

from llmhealth import readers
from llmhealth.classify import Answer, Read, Target, Verdict
from llmhealth.metrics import EngineSignals, Signals
from llmhealth.window import CpuSample, LongestStep

FRAME = 200  # examinations per frame; a worker's 20 ms of flushing gathers about this many
LENGTH = 7
PICKLED_AS_CALLS = (EngineSignals, Signals, LongestStep, CpuSample, Read, Answer, Verdict)


@contextmanager
def dataclass_state_functions() -> Iterator[None]:
    """The classes pickled as before `pickling.py`: its hook taken off, then put back."""
    classes = (*PICKLED_AS_CALLS, readers._Heard)
    hooks = {cls: cls.__dict__["__reduce__"] for cls in classes}
    for cls in classes:
        delattr(cls, "__reduce__")
    try:
        yield
    finally:
        for cls, hook in hooks.items():
            cls.__reduce__ = hook


def frame() -> list[object]:
    """FRAME examinations in bench_scale's mix, as a worker sends them: the newest read
    fresh, the verdict's reads the window's own (sent as a count)."""
    total = sum(FLEET.values())
    heard: list[object] = []
    for mode, count in FLEET.items():
        for index in range(round(FRAME * count / total)):
            reads = window(mode, LENGTH)
            verdict = judge(reads)
            assert isinstance(verdict, Verdict), verdict
            target = Target(f"{mode}-{index}", "http://127.0.0.1:1")
            heard.append(readers._heard(target, verdict, 0.01, reads, reads[-2]))
    return heard


def per_item_us(work: Callable[[], object], items: int, rounds: int = 20) -> float:
    times = []
    for _ in range(rounds):
        started = time.process_time()
        work()
        times.append((time.process_time() - started) / items * 1e6)
    return statistics.median(times)


def measure(items: list[object]) -> tuple[float, float, int]:
    """Pickling and unpickling µs per examination, and bytes per examination."""
    body = readers._frame(items)
    unpickled = pickle.loads(body[readers._HEADER.size :])
    assert unpickled == items  # every field back, either way
    dumped = per_item_us(lambda: readers._frame(items), len(items))
    loaded = per_item_us(lambda: pickle.loads(body[readers._HEADER.size :]), len(items))
    return dumped, loaded, len(body) // len(items)


def main() -> None:
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 7
    items = frame()
    figures: dict[str, list[tuple[float, float, int]]] = {"calls": [], "state": []}
    for index in range(rounds):
        for way in ("calls", "state") if index % 2 == 0 else ("state", "calls"):
            if way == "calls":
                figures[way].append(measure(items))
            else:
                with dataclass_state_functions():
                    figures[way].append(measure(items))
    names = {"calls": "as calls of their classes (now)", "state": "dataclasses' state functions"}
    print(f"{len(items)} examinations a frame, {rounds} rounds alternated, median (min-max):")
    print("| pickled | worker: pickle µs | daemon: unpickle µs | bytes |")
    print("| --- | --- | --- | --- |")
    for way, rows in figures.items():
        cells = []
        for column in (0, 1):
            values = [row[column] for row in rows]
            cells.append(f"{statistics.median(values):.1f} ({min(values):.1f}-{max(values):.1f})")
        print(f"| {names[way]} | {cells[0]} | {cells[1]} | {rows[0][2]} |")


if __name__ == "__main__":
    main()
