"""What crosses a read worker's pipe comes back whole, rebuilt by a call of its class."""

from __future__ import annotations

import pickle
from dataclasses import dataclass, field

import pytest

from llmhealth import readers
from llmhealth.classify import Answer, Read, Target, Verdict, VerdictKind
from llmhealth.metrics import EngineSignals, Signals
from llmhealth.pickling import pickled_as_a_call
from llmhealth.window import CpuSample, LongestStep

BUILT: list[str] = []


@pickled_as_a_call
@dataclass(frozen=True, slots=True)
class _Counted:
    name: str
    size: int = 0
    derived: int = field(init=False, default=0)

    def __post_init__(self) -> None:
        BUILT.append(self.name)
        object.__setattr__(self, "derived", self.size * 2)


def test_an_object_is_rebuilt_by_calling_its_class_which_rebuilds_what_it_derives() -> None:
    original = _Counted("a", 21)
    BUILT.clear()

    copy = pickle.loads(pickle.dumps(original, protocol=pickle.HIGHEST_PROTOCOL))

    assert BUILT == ["a"]  # dataclasses' own state functions never call the class
    assert copy == original
    assert copy.derived == 42


def test_a_class_with_one_field_it_takes_is_refused() -> None:
    @dataclass(frozen=True)
    class Lone:
        only: int

    with pytest.raises(TypeError, match="two or more fields"):
        pickled_as_a_call(Lone)


def test_a_workers_frame_comes_back_equal_with_the_daemons_engine_lookup_working() -> None:
    engines = tuple(EngineSignals(str(i), running=float(i), steps=10.0 * i) for i in range(40))
    signals = Signals(engines, process_start=5.0, skipped_lines=2, notes=("a note",))
    cpu = CpuSample(1.5, (10, 11), at=3.0, stopped=(11,))
    read = Read(3.0, signals, detail="", cpu=cpu)
    verdict = Verdict(
        VerdictKind.IDLE,
        True,
        "idle: ...",
        running=0,
        requests_sent=1,
        reads=(read,),
        answer=Answer(3.2, True, "ok", "m", ("m",)),
        longest_step=LongestStep(0.4, "histogram"),
    )
    heard = readers._heard(Target("b1", "http://127.0.0.1:1"), verdict, 0.2, [read], None)

    (back,) = pickle.loads(readers._frame([heard])[readers._HEADER.size :])

    assert back == heard
    assert back.fresh[0].signals.engine("39") == engines[39]  # the map of 40 engines rebuilt
