"""Signals from one vLLM ``/metrics`` text, per data-parallel engine.

Pure: a body goes in, values come out, and no text can make it raise. It runs on every
read of every backend, so it looks up only the series it needs by name instead of
building every metric family (a real 53 KB text has ~90 families and ~640 samples), and
its cost is linear in the text: no per-engine scan of anything per engine.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

# vLLM series name -> the EngineSignals field it feeds. Counters and gauges with extra
# labels (finished_reason, model_name) are summed per engine; kv use takes the maximum.
_SERIES: dict[str, str] = {
    "vllm:num_requests_running": "running",
    "vllm:num_requests_waiting": "waiting",
    "vllm:iteration_tokens_total_count": "steps",
    "vllm:generation_tokens_total": "generation_tokens",
    "vllm:prompt_tokens_total": "prompt_tokens",
    "vllm:request_success_total": "finished",
    "vllm:num_preemptions_total": "preemptions",
    "vllm:kv_cache_usage_perc": "kv_usage",
    # Before vLLM 0.10 the KV gauge had this name; it is read only when the new one is absent.
    "vllm:gpu_cache_usage_perc": "kv_usage_legacy",
}
# Histograms that say how long this engine's steps can take (see ``llmhealth.window``):
# the bucket series by their EngineSignals field, and the prefill time's sum.
_BUCKETS: dict[str, str] = {
    "vllm:inter_token_latency_seconds_bucket": "longest_gap",
    "vllm:iteration_tokens_total_bucket": "largest_step_tokens",
}
_PREFILL_SUM = "vllm:request_prefill_time_seconds_sum"
_SLEEP_SERIES = "vllm:engine_sleep_state"
_START_SERIES = "process_start_time_seconds"
_GAUGES = frozenset({"running", "waiting", "kv_usage", "kv_usage_legacy"})
# vLLM v0 had no engine label; its single engine is reported under this name.
_DEFAULT_ENGINE = "0"


@dataclass(frozen=True, slots=True)
class EngineSignals:
    """What one engine's series say at one moment; None where the text does not say."""

    engine: str
    running: float | None = None
    waiting: float | None = None
    steps: float | None = None
    generation_tokens: float | None = None
    prompt_tokens: float | None = None
    finished: float | None = None
    preemptions: float | None = None
    kv_usage: float | None = None
    sleep_state: str | None = None
    # From the histograms: the upper bound of the highest non-empty inter-token-latency
    # bucket (its largest finite bound when a gap landed in +Inf, with ``gap_beyond``
    # set: then it is a lower bound), the same for the tokens of one engine step, and
    # the total time requests spent in prefill.
    longest_gap: float | None = None
    gap_beyond: bool = False
    largest_step_tokens: float | None = None
    prefill_seconds: float | None = None

    @property
    def work(self) -> float | None:
        """Requests running plus waiting; None while vLLM omits the running gauge.

        With several API servers vLLM publishes no gauges until its first request, and
        "unknown" must not be mistaken for "nothing to do".
        """
        if self.running is None:
            return None
        return self.running + (self.waiting or 0.0)

    @property
    def asleep(self) -> bool:
        """An engine put to sleep on purpose steps no more, and is not wedged."""
        return self.sleep_state is not None and self.sleep_state != "awake"

    @property
    def counters(self) -> dict[str, float]:
        """The monotonic counters that are present, by name: what a restart would reset."""
        values = {
            "steps": self.steps,
            "generation_tokens": self.generation_tokens,
            "prompt_tokens": self.prompt_tokens,
            "finished": self.finished,
            "preemptions": self.preemptions,
        }
        return {name: value for name, value in values.items() if value is not None}


@dataclass(frozen=True, slots=True)
class Signals:
    """Everything llmhealth uses from one text. No engines means "no metrics"."""

    engines: tuple[EngineSignals, ...] = ()
    process_start: float | None = None
    skipped_lines: int = 0
    notes: tuple[str, ...] = field(default=())
    # Engines by name, built once: comparing two reads engine by engine must not scan
    # every engine for every engine (40,000 data-parallel engines made that minutes).
    _by_name: dict[str, EngineSignals] = field(
        init=False, repr=False, compare=False, default_factory=dict
    )

    def __post_init__(self) -> None:
        for engine in self.engines:
            self._by_name.setdefault(engine.engine, engine)  # the first one, as a scan found

    @property
    def has_vllm(self) -> bool:
        return bool(self.engines)

    def engine(self, name: str) -> EngineSignals | None:
        return self._by_name.get(name)


def parse_metrics(body: str | bytes) -> Signals:
    """Extract the signals; any text at all yields Signals, possibly with no engines.

    One regular-expression scan finds the lines of the series read; what each line's name
    and label text mean (which field, engine, label set, bucket bound) is worked out once
    per process and remembered (``_meaning``), so a line costs a look-up and a ``float``.
    """
    # Scanned as bytes, as they came: only the few label sets not seen before are decoded
    # (as the whole text would be, with U+FFFD for what is not UTF-8).
    data = body if isinstance(body, bytes) else body.encode("utf-8", errors="surrogatepass")
    # Per (field, engine, label set): a duplicate series overwrites, as the Prometheus
    # server would keep only one sample of it. The parsed labels, not their raw text, say
    # which series it is: label order and spacing do not make a new one.
    samples: dict[tuple[str, str, frozenset[tuple[str, str]]], float] = {}
    sleep: dict[str, dict[str, float]] = {}
    # Per (field, engine, label set without le): bucket bound -> cumulative count.
    buckets: dict[tuple[str, str, frozenset[tuple[str, str]]], dict[float, float]] = {}
    process_start: float | None = None
    skipped = 0
    # (name and label text, the rest of the line) per line; so line 1 is found too.
    lines = _LINES.findall(b"\n" + data)
    heads, tails = zip(*lines, strict=True) if lines else ((), ())
    # Looked up and converted in C, line by line; per line in Python only where needed.
    meanings = list(map(_MEANINGS.get, heads))
    if None in meanings:  # not seen before, or labels that do not parse
        meanings = [
            meaning or _meaning(head) for meaning, head in zip(meanings, heads, strict=True)
        ]
    try:
        values: list[float | None] = list(map(float, tails))  # a value alone: vLLM's lines
    except ValueError:
        values = [_value_before_timestamp(tail) for tail in tails]
    for meaning, converted, tail in zip(meanings, values, tails, strict=True):
        if meaning is None:
            skipped += 1
            continue
        kind, key, extra, leftover = meaning
        # A "}" after the label set ended is part of what follows it.
        value = _value_before_timestamp(leftover + tail) if leftover else converted
        if value is None:
            skipped += 1
            continue
        if kind <= _BUCKET:  # a sample or a bucket, nearly every line: tested first
            if not 0.0 <= value < math.inf:
                # A NaN, infinite or negative count says nothing usable; treat it as
                # absent rather than let it fake progress or a restart.
                skipped += 1
            elif kind == _BUCKET:
                if extra is None:  # a bound that is not a number
                    skipped += 1
                else:
                    buckets.setdefault(key, {})[extra] = value
            else:
                samples[key] = value
        elif kind == _START:
            if math.isfinite(value) and value > 0:
                process_start = value
        elif kind == _SLEEP and math.isfinite(value):
            engine, state = extra
            sleep.setdefault(engine, {})[state] = value
    for (field_name, engine, labels_set), counts in buckets.items():
        highest = _highest_bucket(counts)
        if highest is not None:
            # Several label sets (model names) of one engine: the longest of them counts.
            bound, beyond = highest
            samples[(field_name, engine, labels_set)] = bound
            if beyond and field_name == "longest_gap":
                samples[("gap_beyond", engine, labels_set)] = 1.0
    engines = _combine(samples, sleep)
    notes = (f"{skipped} malformed or unusable vLLM sample(s) ignored",) if skipped else ()
    return Signals(engines, process_start, skipped, notes)


# What a line is, by its name and labels (plain ints: an Enum member's look-up costs
# more than the rest of the line's work). The key and extra of a _Meaning for each:
_SAMPLE = 1  # a counter or gauge: key is (field, engine, label set)
_BUCKET = 2  # key is (field, engine, label set without le); extra the bound or None
_SLEEP = 3  # extra is (engine, sleep state)
_START = 4  # the process start time, without labels
_IGNORE = 5  # well formed, nothing to read (a start time with labels, a sleep gauge
# without its state): only its value must parse


# What a line's name and label text mean: its kind, key and extra (see _SAMPLE), and what
# of the label text follows the end of its label set, when a "}" does (b"" otherwise).
_Meaning = tuple[int, tuple[str, str, frozenset[tuple[str, str]]], Any, bytes]


def _meaning(head: bytes) -> _Meaning | None:
    """``_interpret(head)``, remembered per name and label text.

    A backend sends the same few dozen lines every read, and a fleet's backends send the
    same ones, so each is understood once per process, not once per line. Memoization
    only; cleared when it grows past its bound, so a server inventing new label values
    cannot grow it without limit. A label text is all the interpretation reads: a label
    set that parses ends at a ``}`` no later than the line's last one.
    """
    if head in _MEANINGS:
        return _MEANINGS[head]
    if len(_MEANINGS) >= _MEANINGS_MAX:
        _MEANINGS.clear()
    meaning = _MEANINGS[head] = _interpret(head)
    return meaning


_MEANINGS: dict[bytes, _Meaning | None] = {}
_MEANINGS_MAX = 4096
_NO_KEY: tuple[str, str, frozenset[tuple[str, str]]] = ("", "", frozenset())


def _interpret(head: bytes) -> _Meaning | None:
    """What one series line means, from its name and label text; None when the labels
    do not parse (the line is then counted as malformed)."""
    name_bytes, brace, label_bytes = head.partition(b"{")
    name = name_bytes.decode("ascii")  # one of ours, which _LINES matched
    labels: dict[str, str] = {}
    leftover = b""
    if brace:
        label_text = (brace + label_bytes).decode("utf-8", errors="replace")
        parsed = _parse_labels(label_text)
        if parsed is None:
            return None
        labels, end = parsed
        leftover = label_text[end:].encode("utf-8")
    if name == _START_SERIES:
        # `{}` is no labels too; a start time with labels is not the process's.
        return (_IGNORE if labels else _START, _NO_KEY, None, leftover)
    engine = labels.get("engine", _DEFAULT_ENGINE)
    if name == _SLEEP_SERIES:
        state = labels.get("sleep_state")
        if state is None:
            return (_IGNORE, _NO_KEY, None, leftover)
        return (_SLEEP, _NO_KEY, (engine, state), leftover)
    if name in _BUCKETS:
        bound = _bucket_bound(labels.pop("le", None))
        key = (_BUCKETS[name], engine, frozenset(labels.items()))
        return (_BUCKET, key, bound, leftover)
    field_name = "prefill_seconds" if name == _PREFILL_SUM else _SERIES[name]
    return (_SAMPLE, (field_name, engine, frozenset(labels.items())), None, leftover)


def _combine(
    samples: dict[tuple[str, str, frozenset[tuple[str, str]]], float],
    sleep: dict[str, dict[str, float]],
) -> tuple[EngineSignals, ...]:
    per_engine: dict[str, dict[str, float]] = {}
    for (field_name, engine, _), value in samples.items():
        fields = per_engine.setdefault(engine, {})
        if field_name in _TAKE_MAXIMUM:
            fields[field_name] = max(fields.get(field_name, value), value)
        else:
            fields[field_name] = fields.get(field_name, 0.0) + value
    for engine in sleep:
        per_engine.setdefault(engine, {})
    result = []
    for engine in sorted(per_engine, key=_engine_order):
        fields = per_engine[engine]
        legacy_kv = fields.pop("kv_usage_legacy", None)
        if "kv_usage" not in fields and legacy_kv is not None:
            fields["kv_usage"] = legacy_kv
        gap_beyond = fields.pop("gap_beyond", 0.0) > 0
        result.append(
            EngineSignals(
                engine=engine,
                sleep_state=_sleep_state(sleep.get(engine)),
                gap_beyond=gap_beyond,
                **fields,
            )
        )
    return tuple(result)


# Fields of several label sets of one engine that combine by maximum, not by sum.
_TAKE_MAXIMUM = frozenset(
    {"kv_usage", "kv_usage_legacy", "longest_gap", "gap_beyond", "largest_step_tokens"}
)


def _bucket_bound(text: str | None) -> float | None:
    if text is None:
        return None
    try:
        bound = float(text)
    except ValueError:
        return None
    return None if math.isnan(bound) or bound < 0 else bound


def _highest_bucket(counts: dict[float, float]) -> tuple[float, bool] | None:
    """The bound of the lowest bucket that holds every observation; None when empty.

    When some observations are only in +Inf, it is the largest finite bound and True:
    the longest value is then only known to exceed it. Bounds are never NaN or negative
    (``_bucket_bound``), so +Inf sorts last.
    """
    total = max(counts.values(), default=0.0)
    if total <= 0:
        return None
    largest_finite = None
    for bound in sorted(counts):
        if bound == math.inf:
            break
        if counts[bound] >= total:
            return bound, False
        largest_finite = bound
    return None if largest_finite is None else (largest_finite, True)


def _engine_order(engine: str) -> tuple[int, str]:
    # isdigit() alone admits "²" (int() rejects it) and int() refuses over 4300 digits.
    if engine.isascii() and engine.isdigit() and len(engine) <= 18:
        return (int(engine), "")
    return (1 << 62, engine)


def _sleep_state(states: dict[str, float] | None) -> str | None:
    if not states:
        return None
    active = [state for state, value in states.items() if value >= 1]
    if not active:
        return None
    # "awake" wins a tie: only a clear report of sleep may excuse an engine that stopped.
    return "awake" if "awake" in active else sorted(active)[0]


_READ = (*_SERIES, *_BUCKETS, _PREFILL_SUM, _SLEEP_SERIES, _START_SERIES)


def _value_before_timestamp(tail: bytes) -> float | None:
    """The value of ``value [timestamp]``; None when that is not what follows the labels.

    Read as the text it is (U+FFFD for what is not UTF-8): any Unicode space separates.
    """
    parts = tail.decode("utf-8", errors="replace").split()
    if not parts or len(parts) > 2:
        return None
    try:
        return float(parts[0])
    except ValueError:
        return None


def _alternatives(names: Iterable[str]) -> str:
    """A pattern matching exactly ``names``, as a tree of their common prefixes.

    The regex engine tries a flat list of alternatives one after another at every line
    start; as a tree, a line that is none of them fails on its first differing letter.
    """
    tree: dict[str, Any] = {}
    for name in names:
        node = tree
        for char in name:
            node = node.setdefault(char, {})
        node[""] = {}  # a name ends here

    def pattern(node: dict[str, Any]) -> str:
        branches = [
            re.escape(char) + pattern(child) for char, child in sorted(node.items()) if char
        ]
        if not branches:
            return ""
        if len(branches) == 1 and "" not in node:
            return branches[0]
        group = f"(?:{'|'.join(branches)})"
        return group + "?" if "" in node else group

    return pattern(tree)


# Every sample line of the series read, in one pass in C over the text: its name (which
# must start a line and be followed by ``{``, a space or a tab: a longer name sharing the
# prefix is another series) with its label text up to the line's last ``}`` (a lone ``{``
# when there is none, which no label set parses from), and the rest of the line.
_LINES = re.compile(
    (rf"\n((?:{_alternatives(_READ)})(?=[{{ \t])(?:\{{[^\n]*\}}|\{{|))([^\n]*)").encode("ascii")
)


_ESCAPES = {"\\": "\\", '"': '"', "n": "\n"}


def _parse_labels(text: str) -> tuple[dict[str, str], int] | None:
    """Parse ``{a="x",b="y\\"z"}`` from the start of text; return labels and length used."""
    labels: dict[str, str] = {}
    position = 1
    length = len(text)
    while True:
        while position < length and text[position] in " \t,":
            position += 1
        if position >= length:
            return None
        if text[position] == "}":
            return labels, position + 1
        equals = text.find("=", position)
        if equals == -1 or equals + 1 >= length or text[equals + 1] != '"':
            return None
        key = text[position:equals].strip()
        if not key:
            return None
        position = equals + 2
        closing = text.find('"', position)
        if closing == -1:
            return None
        if "\\" not in text[position:closing]:
            labels[key] = text[position:closing]
            position = closing + 1
            continue
        value, position = _unescape_value(text, position)
        if position < 0:
            return None
        labels[key] = value


def _unescape_value(text: str, position: int) -> tuple[str, int]:
    """Read an escaped label value up to its closing quote; position -1 when unterminated."""
    chars: list[str] = []
    length = len(text)
    while position < length:
        char = text[position]
        if char == '"':
            return "".join(chars), position + 1
        if char == "\\" and position + 1 < length:
            escaped = text[position + 1]
            chars.append(_ESCAPES.get(escaped, "\\" + escaped))
            position += 2
            continue
        chars.append(char)
        position += 1
    return "", -1
