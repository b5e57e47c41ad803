"""The fast extraction gives prometheus_client's answers: on every capture and on any text.

``parse_metrics`` finds its dozen series with one scan and remembers label sets between
reads; a full parse by prometheus_client is the independent reading it must agree with.
Its samples are fed through the same combination as ours (``_combine``), so what is
compared is exactly what the speed work touched: which lines are found, and how their
labels and values are read. Every field is compared, the histograms' figures too.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families

from llmhealth import metrics
from llmhealth.metrics import Signals, parse_metrics

FOLDER = Path(__file__).resolve().parent.parent / "fixtures" / "vllm-0.32"
# A real capture is a body with its response headers beside it (as in test_metrics.py).
CAPTURES = sorted(FOLDER / f"{path.stem}.txt" for path in FOLDER.glob("*.headers"))
READ = {**metrics._SERIES, metrics._PREFILL_SUM: "prefill_seconds"}  # series name -> field
BUCKETS = metrics._BUCKETS
PREFILL_BUCKETS = metrics._PREFILL_BUCKETS  # read by a second scan, where needed
SLEEP, START = metrics._SLEEP_SERIES, metrics._START_SERIES
BY_REASON = metrics._BY_REASON_SERIES


def oracle(text: str) -> tuple[dict[str, tuple[object, ...]], float | None]:
    """Per engine its signals, and the process start, from prometheus_client's samples."""
    samples: dict[tuple[str, str, frozenset[tuple[str, str]]], float] = {}
    buckets: dict[tuple[str, str, frozenset[tuple[str, str]]], dict[float, float]] = {}
    prefill: dict[tuple[str, str, frozenset[tuple[str, str]]], dict[float, float]] = {}
    sleep: dict[str, dict[str, float]] = {}
    start = None
    starts = set()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            name, labels, value = sample.name, dict(sample.labels), float(sample.value)
            if name == START:
                if not labels and math.isfinite(value) and value > 0:
                    start = value
                    starts.add(value)
                continue
            engine = labels.get("engine", "0")
            if name == SLEEP:
                if "sleep_state" in labels and math.isfinite(value):
                    sleep.setdefault(engine, {})[labels["sleep_state"]] = value
            elif name in READ and math.isfinite(value) and value >= 0:
                samples[(READ[name], engine, frozenset(labels.items()))] = value
            elif name in BUCKETS and math.isfinite(value) and value >= 0:
                bound = _bound(labels.pop("le", None))
                if bound is not None:
                    key = (BUCKETS[name], engine, frozenset(labels.items()))
                    buckets.setdefault(key, {})[bound] = value
            elif name == PREFILL_BUCKETS and math.isfinite(value) and value >= 0:
                bound = _bound(labels.pop("le", None))
                if bound is not None:
                    key = ("longest_prefill", engine, frozenset(labels.items()))
                    prefill.setdefault(key, {})[bound] = value
            elif (
                name == BY_REASON
                and math.isfinite(value)
                and value >= 0
                and labels.pop("reason", None) == "deferred"
            ):
                samples[("waiting_deferred", engine, frozenset(labels.items()))] = value
    if len(starts) > 1:  # more than one server's text: not read (parse_metrics's rule)
        return {}, None
    signals = Signals(metrics._combine(samples, sleep, buckets))
    bounds = Signals(metrics._combine({}, {}, prefill))
    return _by_engine(metrics.with_prefill_bounds(signals, bounds)), start


def _bound(text: str | None) -> float | None:
    """A bucket's upper bound, as Prometheus reads ``le``; None for one no count can have."""
    try:
        bound = float(text) if text is not None else math.nan
    except ValueError:
        return None
    return None if math.isnan(bound) or bound < 0 else bound


def ours(text: str) -> tuple[dict[str, tuple[object, ...]], float | None]:
    signals = parse_metrics(text)
    return _by_engine(signals), signals.process_start


def _by_engine(signals: Signals) -> dict[str, tuple[object, ...]]:
    return {
        engine.engine: (
            engine.running,
            engine.waiting,
            engine.waiting_deferred,
            engine.kv_usage,
            engine.sleep_state,
            tuple(sorted(engine.counters.items())),
            engine.longest_gap,
            engine.gap_beyond,
            engine.largest_step_tokens,
            engine.prefill_seconds,
            engine.longest_prefill,
        )
        for engine in signals.engines
    }


@pytest.mark.parametrize("path", CAPTURES, ids=[path.stem for path in CAPTURES])
def test_every_capture_reads_as_prometheus_client_reads_it(path: Path) -> None:
    text = path.read_text(encoding="utf-8")
    assert ours(text) == oracle(text)


def _prefill_stretched(text: str) -> str:
    """``text`` with its prefill time's sum 100 times as long: every capture's prefill
    figure then passes PREFILL_BOUNDED_OVER, so its time-to-first-token buckets are read too."""
    lines = []
    for line in text.splitlines():
        head, _, value = line.rpartition(" ")
        stretched = head.startswith(metrics._PREFILL_SUM)
        lines.append(f"{head} {float(value) * 100!r}" if stretched else line)
    return "\n".join(lines) + "\n"


@pytest.mark.parametrize("path", CAPTURES, ids=[path.stem for path in CAPTURES])
def test_every_capture_whose_prefill_needs_its_bound_reads_as_prometheus_client_reads_it(
    path: Path,
) -> None:
    text = _prefill_stretched(path.read_text(encoding="utf-8"))
    assert ours(text) == oracle(text)


def test_a_stretched_capture_has_its_prefill_bound_read() -> None:
    """The test above compares the second scan's reading, not two Nones."""
    text = _prefill_stretched((FOLDER / "busy-after.txt").read_text(encoding="utf-8"))
    assert [engine.longest_prefill for engine in parse_metrics(text).engines] == [10.0]


NAMES = [*READ, *BUCKETS, PREFILL_BUCKETS, SLEEP, START, BY_REASON, "vllm:other_total"]
LABEL_NAMES = ["engine", "model_name", "finished_reason", "sleep_state", "le", "reason"]
LABEL_VALUES = [
    "0",
    "1",
    "12",
    "tiny",
    "awake",
    "weights_offloaded",
    "deferred",
    "capacity",
    "a}b",
    'q\\"t',
    "x\\\\y",
    "",
    "0.5",
    "+Inf",
]
VALUES = ["0", "1", "3.5", "1e3", "-2", "NaN", "+Inf", "-Inf", "1796024376.26", "17"]


@st.composite
def exposition(draw: st.DrawFn) -> str:
    """A valid Prometheus text of our series and their neighbours, duplicates included."""
    lines = []
    for _ in range(draw(st.integers(0, 24))):
        name = draw(st.sampled_from(NAMES))
        keys = draw(st.lists(st.sampled_from(LABEL_NAMES), max_size=3, unique=True))
        labels = ",".join(f'{key}="{draw(st.sampled_from(LABEL_VALUES))}"' for key in keys)
        braces = f"{{{labels}}}" if keys or draw(st.booleans()) else ""
        stamp = draw(st.sampled_from(["", " 1700000000000"]))
        lines.append(f"{name}{braces} {draw(st.sampled_from(VALUES))}{stamp}")
    return "\n".join(lines) + "\n"


@settings(deadline=None, max_examples=300, suppress_health_check=[HealthCheck.too_slow])
@given(exposition())
@pytest.mark.slow
def test_any_valid_text_reads_as_prometheus_client_reads_it(text: str) -> None:
    try:
        expected = oracle(text)
    except ValueError:
        assume(False)  # prometheus_client refuses it: nothing to compare with
        raise
    assert ours(text) == expected
    assert ours(text) == expected  # read again: remembered label sets answer the same


def test_a_start_time_written_with_empty_braces_is_read() -> None:
    """``{}`` is an empty label set; the start time was ignored when written that way."""
    assert parse_metrics("process_start_time_seconds{} 1796024376.26\n").process_start == (
        1796024376.26
    )


def test_a_label_set_remembered_from_one_text_reads_the_same_in_another() -> None:
    first = parse_metrics('vllm:num_requests_running{engine="3"} 2\n')
    again = parse_metrics('vllm:num_requests_running{engine="3"} 5\n')
    assert [(e.engine, e.running) for e in (*first.engines, *again.engines)] == [
        ("3", 2.0),
        ("3", 5.0),
    ]


def test_quoted_label_names_read_as_prometheus_client_reads_them() -> None:
    """A label name may be written quoted (the text format's UTF-8 form, which Prometheus
    and prometheus_client read): ``"engine"`` was taken for a label of its own, so every
    engine's lines were engine "0"'s, summed (a wedged engine hidden by busy ones)."""
    text = "".join(
        f'vllm:num_requests_running{{"engine"="{engine}", "model_name"="tiny"}} 4\n'
        f'vllm:iteration_tokens_total_count{{"engine"="{engine}",model_name="tiny"}} {steps}\n'
        for engine, steps in (("0", 10), ("1", 20))
    )
    assert ours(text) == oracle(text)
    assert set(ours(text)[0]) == {"0", "1"}


def test_a_quoted_label_name_holding_an_equals_sign_reads_as_prometheus_client_reads_it() -> None:
    """A label name is quoted when it is not a legacy name, and may then hold "=": the
    first "=" was taken for the one after the name, the label set did not parse, and the
    line was dropped as malformed (an engine's counters or gauges lost)."""
    text = "".join(
        f'vllm:num_requests_running{{"pod=x"="a", engine="{engine}"}} 4\n'
        f'vllm:iteration_tokens_total_count{{engine="{engine}","a=b" = "c"}} {steps}\n'
        for engine, steps in (("0", 10), ("1", 20))
    )
    assert ours(text) == oracle(text)
    assert set(ours(text)[0]) == {"0", "1"}


@settings(deadline=None, max_examples=300, suppress_health_check=[HealthCheck.too_slow])
@given(exposition(), st.sampled_from(["", " ", "\t "]), st.booleans())
def test_the_prefill_buckets_scanned_in_part_of_a_text_are_those_of_the_whole(
    text: str, indent: str, leading_newline: bool
) -> None:
    """The second scan reads only from the first line naming the series to the last: it
    finds every line a scan of the whole text finds, the first line, indented lines and
    names inside other lines' labels included."""
    data = (("\n" if leading_newline else "") + text.replace("\n", "\n" + indent)).encode()
    whole = metrics._extract(data, metrics._PREFILL_LINES, metrics._FIRST_PREFILL_LINE, len(data))
    assert metrics._prefill_bounds(data) == whole
