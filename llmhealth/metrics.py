"""Signals from one vLLM ``/metrics`` text, per data-parallel engine.

Pure: a body goes in, values come out, and no text can make it raise. It runs on every
read of every backend, so it looks up only the series it needs by name instead of
building every metric family (a real 53 KB text has ~90 families and ~640 samples), and
its cost is linear in the text: no per-engine scan of anything per engine.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from dataclasses import fields as dataclass_fields
from itertools import count
from operator import attrgetter, itemgetter
from typing import Any, TypeVar

from llmhealth.pickling import pickled_as_a_call

# vLLM series name -> the EngineSignals field it feeds. Counters and gauges with extra
# labels (finished_reason, model_name) are summed per engine; kv use takes the maximum.
_SERIES: dict[str, str] = {
    "vllm:num_requests_running": "running",
    "vllm:num_requests_waiting": "waiting",
    "vllm:iteration_tokens_total_count": "steps",
    "vllm:generation_tokens_total": "generation_tokens",
    "vllm:prompt_tokens_total": "prompt_tokens",
    "vllm:prompt_tokens_cached_total": "prompt_tokens_cached",
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
# One request's time to its first token, read into ``longest_prefill`` only for an engine
# whose prefill figure (``EngineSignals.prefill_step``) passes ``PREFILL_BOUNDED_OVER``: a
# scan of its own, which most reads never pay (``parse_metrics``). Not the prefill time's
# buckets: vLLM observes those when a request finishes (an aborted one, in some versions
# never), but counts its prompt in ``vllm:iteration_tokens_total`` and its time to first
# token when that token comes. A request still generating after a 15 s prefill step is in
# no prefill-time bucket: bounded by the finished ones' 0.3 s, the next such step of a
# healthy engine would be "wedged".
_PREFILL_BUCKETS = "vllm:time_to_first_token_seconds_bucket"
# Seconds. Below it the figure makes a window of a few seconds at most, whatever inflates
# it; above it, prompts prefilled together in one step made it that many steps long.
PREFILL_BOUNDED_OVER = 1.0
_SLEEP_SERIES = "vllm:engine_sleep_state"
_START_SERIES = "process_start_time_seconds"
# Waiting requests by reason (vLLM 0.11 on): only the "deferred" ones are read, into
# ``waiting_deferred``; "capacity" is waiting for the engine, which is the engine's work.
_BY_REASON_SERIES = "vllm:num_requests_waiting_by_reason"
_DEFERRED = "deferred"
# vLLM v0 had no engine label; its single engine is reported under this name.
_DEFAULT_ENGINE = "0"
# Bounds on what one text may ask of the reader. vLLM writes about 53 lines of the series
# read per engine and numbers its engines ("0", "1", ...). 131,072 lines still read a
# legal text of 40,000 engines of three lines each (tests/test_classify.py), and not the
# 350,000 one-line engines that held a reader for minutes and gigabytes.
MAX_LINES = 131_072
MAX_ENGINE_LABEL = 64
# vLLM's sleep states are "awake", "weights_offloaded" and "discard_all"; one is named in
# the verdict of an engine asleep, and a longer one makes its line malformed, as an
# engine label does (200,000 characters of it went into verdicts, the state and etcd).
MAX_SLEEP_STATE = 64
# Up to this many engines, a read's engine is found by a scan of them, not a dict.
_SCANNED_ENGINES = 8


@pickled_as_a_call
@dataclass(frozen=True, slots=True)
class EngineSignals:
    """What one engine's series say at one moment; None where the text does not say."""

    engine: str
    running: float | None = None
    waiting: float | None = None
    # Of the waiting, those vLLM defers for constraints outside the engine's step (a
    # structured-output grammar still compiling, KV blocks still arriving from a prefill
    # instance, a LoRA budget): the scheduler passes over them and runs the rest.
    waiting_deferred: float | None = None
    steps: float | None = None
    generation_tokens: float | None = None
    prompt_tokens: float | None = None
    # Of the prompt tokens, those taken from a prefix cache (local, or transferred from a
    # prefill instance) rather than prefilled; absent before vLLM counted them.
    prompt_tokens_cached: float | None = None
    finished: float | None = None
    preemptions: float | None = None
    kv_usage: float | None = None
    sleep_state: str | None = None
    # From the histograms: the upper bound of the highest non-empty inter-token-latency
    # bucket (its largest finite bound when a gap landed in +Inf, with ``gap_beyond``
    # set: then it is a lower bound), the same for the tokens of one engine step, and
    # the total time requests spent in prefill; then the upper bound of the highest
    # non-empty bucket of one request's time to its first token (from its arrival: it
    # holds its whole prefill, and is observed as the prompt is counted), read only where
    # ``prefill_step`` passes ``PREFILL_BOUNDED_OVER`` (None otherwise, and when one landed
    # in +Inf: then no bound is known).
    longest_gap: float | None = None
    gap_beyond: bool = False
    largest_step_tokens: float | None = None
    prefill_seconds: float | None = None
    longest_prefill: float | None = None

    @property
    def prefill_per_token(self) -> float | None:
        """The prefill time per prompt token computed; None where a figure is missing or
        zero.

        Tokens found in the prefix cache cost a step nothing: counted, a server whose
        multi-turn prompts came 99 % from the cache had its prefill time spread over a
        hundred times the tokens it computed, a 20 s step figured at 0.2 s, and the
        engine was wedged inside its next one."""
        prefill, prompts = self.prefill_seconds, self.computed_prompt_tokens
        if not (prefill and prompts) or prompts < 0:
            return None
        return prefill / prompts

    @property
    def computed_prompt_tokens(self) -> float | None:
        """The prompt tokens prefilled: all of them, less those from a prefix cache where
        vLLM counts those (and fewer than all)."""
        prompts, cached = self.prompt_tokens, self.prompt_tokens_cached
        if prompts is None or cached is None or not 0 < cached < prompts:
            return prompts
        return prompts - cached

    @property
    def prefill_step(self) -> float | None:
        """The prefill time per prompt token times the most tokens put in one step: how
        long the engine's largest step would take if it were all prefill; None where a
        figure is missing or zero. Not bounded by ``longest_prefill`` (``window`` does)."""
        per_token, tokens = self.prefill_per_token, self.largest_step_tokens
        if per_token is None or not tokens:
            return None
        return per_token * tokens

    @property
    def work(self) -> float | None:
        """Requests running plus waiting, less those waiting deferred; None while vLLM
        omits the running gauge.

        With several API servers vLLM publishes no gauges until its first request, and
        "unknown" must not be mistaken for "nothing to do". A deferred request is no work
        the engine could be stepping: a grammar compiles in a thread pool (minutes for a
        large tool schema), and an engine with only those moves no counter at all while
        it would answer any other request at once. Counted as work, it was "wedged" in
        two waits, and restarted.
        """
        if self.running is None:
            return None
        waiting = max(0.0, (self.waiting or 0.0) - (self.waiting_deferred or 0.0))
        return self.running + waiting

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


@pickled_as_a_call
@dataclass(frozen=True, slots=True)
class Signals:
    """Everything llmhealth uses from one text. No engines means "no metrics"."""

    engines: tuple[EngineSignals, ...] = ()
    process_start: float | None = None
    skipped_lines: int = 0
    notes: tuple[str, ...] = field(default=())
    # Engines by name, built once when there are more than a few: comparing two reads
    # engine by engine must not scan every engine for every engine (40,000 data-parallel
    # engines made that minutes). A few are scanned instead: a window holds 65 reads of
    # one backend, and a dict per read was a quarter of a busy engine's read.
    _by_name: dict[str, EngineSignals] | None = field(
        init=False, repr=False, compare=False, default=None
    )

    def __post_init__(self) -> None:
        if len(self.engines) > _SCANNED_ENGINES:
            by_name: dict[str, EngineSignals] = {}
            for engine in self.engines:
                by_name.setdefault(engine.engine, engine)  # the first one, as a scan finds
            object.__setattr__(self, "_by_name", by_name)

    @property
    def has_vllm(self) -> bool:
        return bool(self.engines)

    def engine(self, name: str) -> EngineSignals | None:
        if self._by_name is not None:
            return self._by_name.get(name)
        for engine in self.engines:
            if engine.engine == name:
                return engine
        return None


def sharing(signals: Signals, earlier: Signals) -> Signals:
    """``signals`` holding ``earlier``'s value objects wherever the two are equal.

    A window keeps up to 65 reads of a backend; a busy engine's counters move between reads
    but its gauges, start time and histogram figures mostly do not, and each float is
    24 bytes of its own. What equals the earlier read's is taken from it, as ``==`` says
    (the rule a window already shares a whole read's signals by), so every figure and
    every comparison is the same; an engine that did not change at all is taken whole.
    """
    engines = []
    for engine in signals.engines:
        before = earlier.engine(engine.engine)
        if before is None:
            engines.append(engine)
        elif engine == before:
            engines.append(before)
        else:
            engines.append(EngineSignals(*map(_same, _fields(engine), _fields(before))))
    return Signals(
        tuple(engines),
        _same(signals.process_start, earlier.process_start),
        signals.skipped_lines,
        earlier.notes if signals.notes == earlier.notes else signals.notes,
    )


def _same(value: Any, before: Any) -> Any:
    """``before`` when it is the same value of the same type, else ``value``."""
    return before if type(value) is type(before) and value == before else value


_fields = attrgetter(*(f.name for f in dataclass_fields(EngineSignals)))


def parse_metrics(body: str | bytes) -> Signals:
    """Extract the signals; any text at all yields Signals, possibly with no engines.

    One regular-expression scan finds the lines of the series read. What those lines
    are, by name and label text, is worked out once per process and remembered as a
    ``_Layout`` (which line feeds which field of which engine), because a backend sends
    the same lines read after read and only their values change; a read is then the scan,
    a ``float`` per line and a look-up per series, all in C but the last few steps.

    An engine whose prefill figure passes ``PREFILL_BOUNDED_OVER`` has its time to first
    token's buckets read by a second scan (``longest_prefill``, which bounds that figure):
    23 more lines per engine in the first scan cost every read about an eighth more, and
    most engines' figures are a fraction of a second.
    """
    # Scanned as bytes, as they came: only the few label sets not seen before are decoded
    # (as the whole text would be, with U+FFFD for what is not UTF-8).
    data = body if isinstance(body, bytes) else body.encode("utf-8", errors="surrogatepass")
    signals = _extract(data, _LINES, _FIRST_LINE, len(data))
    if any(_unbounded(engine) for engine in signals.engines):
        return with_prefill_bounds(signals, _prefill_bounds(data))
    return signals


def _prefill_bounds(data: bytes) -> Signals:
    """The engines' ``longest_prefill`` alone, from the part of the text that can hold
    their time-to-first-token buckets: from the line of the series' name's first
    appearance to the end of the line of its last (found in C, scanned by the expression
    only there): a second scan of the whole text cost nearly as much as the first."""
    first = data.find(_PREFILL_NAME)
    if first < 0:
        return Signals()
    end = data.find(b"\n", data.rfind(_PREFILL_NAME))
    start = data.rfind(b"\n", 0, first)  # the newline that starts its line, or -1
    return _extract(data, _PREFILL_LINES, _FIRST_PREFILL_LINE, len(data) if end < 0 else end, start)


def _unbounded(engine: EngineSignals) -> bool:
    step = engine.prefill_step
    return step is not None and step > PREFILL_BOUNDED_OVER


def with_prefill_bounds(signals: Signals, bounds: Signals) -> Signals:
    """``signals``, each engine whose prefill figure passes ``PREFILL_BOUNDED_OVER`` given
    its ``longest_prefill`` from ``bounds`` (a text's time-to-first-token buckets alone)."""
    engines = []
    for engine in signals.engines:
        bound = bounds.engine(engine.engine)
        if _unbounded(engine) and bound is not None and bound.longest_prefill is not None:
            engines.append(replace(engine, longest_prefill=bound.longest_prefill))
        else:
            engines.append(engine)
    return Signals(tuple(engines), signals.process_start, signals.skipped_lines, signals.notes)


def _extract(
    data: bytes,
    lines_of: re.Pattern[bytes],
    first_line: re.Pattern[bytes],
    end: int,
    start: int = 0,
) -> Signals:
    """The signals of the lines these patterns find (``_LINES``, ``_FIRST_LINE``) in
    ``data[start:end]``; a line found must begin after ``start`` (there a newline) or be
    the text's first."""
    # (name and label text, the rest of the line) per line.
    lines = lines_of.findall(data, max(start, 0), end)
    first = first_line.match(data, 0, end) if start <= 0 else None
    if first is not None:
        lines.insert(0, first.groups())
    if not lines:
        return Signals()
    if len(lines) > MAX_LINES:
        # Working out what 350,000 lines mean held the loop for seconds, and an engine
        # per line made verdicts, state and audit records hundreds of MB: not a vLLM.
        return Signals(notes=(f"more than {MAX_LINES} lines of vLLM series: not read",))
    heads, tails = zip(*lines, strict=True)
    layout = _LAYOUTS.get(heads) or _layout(heads)
    if not layout.leftovers:
        try:
            values = list(map(float, tails))  # a value alone: vLLM's lines
        except ValueError:
            pass
        else:
            # Every value finite and not negative (a NaN or an infinity makes the sum
            # NaN or infinite): every line counts as it stands, the last of a series wins.
            if min(values) >= 0.0 and sum(values) < math.inf:
                return _read(layout, values, layout.malformed)
    return _read_usable(heads, tails, layout)


def _read_usable(heads: tuple[bytes, ...], tails: tuple[bytes, ...], layout: _Layout) -> Signals:
    """Read a text with unusable lines: drop them, then read what is left.

    A NaN, infinite or negative count says nothing usable (treated as absent rather than
    let it fake progress or a restart), nor does a value that does not parse; either is
    counted as skipped, as is a line whose labels do not parse. A start time must be
    finite and positive, a sleep gauge finite: otherwise they are dropped unremarked.
    What is left is read like any text, so a duplicate that is unusable does not hide
    the usable one before it.
    """
    try:
        values: list[float | None] = list(map(float, tails))
    except ValueError:
        values = [_value_before_timestamp(tail) for tail in tails]
    for position, leftover in layout.leftovers.items():
        # A "}" after the label set ended is part of what follows it.
        values[position] = _value_before_timestamp(leftover + tails[position])
    kept_heads: list[bytes] = []
    kept_values: list[float] = []
    skipped = 0
    for head, kind, value in zip(heads, layout.kinds, values, strict=True):
        if kind is None or value is None:
            skipped += 1
        elif kind <= _BUCKET:  # a sample or a bucket
            if 0.0 <= value < math.inf:
                kept_heads.append(head)
                kept_values.append(value)
            else:
                skipped += 1
        elif (kind == _START and math.isfinite(value) and value > 0) or (
            kind == _SLEEP and math.isfinite(value)
        ):
            kept_heads.append(head)
            kept_values.append(value)
    if not kept_heads:
        return _read(_EMPTY_LAYOUT, [], skipped)
    kept = tuple(kept_heads)
    return _read(_LAYOUTS.get(kept) or _layout(kept), kept_values, skipped)


def _read(layout: _Layout, values: list[float], skipped: int) -> Signals:
    """The signals from one value per line of ``layout``, each usable as it stands."""
    started = {values[position] for position in layout.starts if values[position] > 0}
    if len(started) > 1:
        # Two processes' texts in one (a proxy merging its servers' /metrics): read as
        # one, a busy server's counters hid a wedged one's, or every read was a restart.
        why = f"{len(started)} process start times: the text of more than one server; not read"
        return Signals((), None, skipped, (why,))
    process_start = None
    for position in reversed(layout.starts):  # the last one that is a time
        if values[position] > 0:
            process_start = values[position]
            break
    notes = (f"{skipped} malformed or unusable vLLM sample(s) ignored",) if skipped else ()
    return Signals(_engines(layout.engines, values), process_start, skipped, notes)


_Key = tuple[str, str, frozenset[tuple[str, str]]]  # (field, engine, label set)


@dataclass(frozen=True, slots=True)
class _Layout:
    """What the lines of one text are, by position, whatever their values.

    A series written twice is read from its last line (the Prometheus server would keep
    one sample of it too); series are in the order of their first line.
    """

    kinds: tuple[int | None, ...]  # per line; None for a line that is malformed as written
    malformed: int
    # Lines whose label set ended before their last "}", with what followed it.
    leftovers: dict[int, bytes]
    engines: tuple[_Engine, ...]  # in the order Signals lists them
    starts: tuple[int, ...]  # every line of the process start time without labels


@dataclass(frozen=True, slots=True)
class _Engine:
    """How one engine's signals are read from a text's values, worked out once per layout.

    Which fields an engine has, and from which lines, depends only on the lines' names
    and labels; so the grouping by engine, the sum-or-maximum choice, the legacy KV
    gauge's fallback and the sleep states' precedence are decided here, and a read only
    fetches values (each ``_Getter`` in one C call), adds, compares and builds.
    """

    name: str
    # Fields of one label set, each read from one line (most of them).
    single_fields: tuple[str, ...]
    singles: _Getter
    # Counters and gauges of several label sets (finished_reason, model_name): summed in
    # the order of their first lines, or for the KV gauges the largest.
    sums: tuple[tuple[str, _Getter], ...]
    maxima: tuple[tuple[str, _Getter], ...]
    # Per histogram field, per label set: its bounds ascending and their counts' lines.
    histograms: tuple[tuple[str, tuple[tuple[tuple[float, ...], _Getter], ...]], ...]
    # Sleep states by precedence: "awake" first (only a clear report of sleep may excuse
    # an engine that stopped), then by name; the first one whose gauge is 1 is the state.
    sleep: tuple[tuple[str, int], ...]
    # Listed whatever its histograms hold: it has a counter, a gauge or a sleep gauge.
    # An engine with only histograms is listed when one of them is not empty.
    listed: bool


_Getter = Callable[[list[float]], tuple[float, ...]]


def _getter(positions: Iterable[int]) -> _Getter:
    """The values at these lines, as a tuple (``itemgetter`` returns a lone item bare)."""
    at = tuple(positions)
    if len(at) >= 2:
        return itemgetter(*at)
    return lambda values: tuple(values[position] for position in at)


def _plan(
    samples: dict[_Key, int],
    histograms: dict[_Key, dict[float, int]],
    sleep: dict[tuple[str, str], int],
) -> tuple[_Engine, ...]:
    """Each engine's part of a layout, from the line of each series (the last one)."""
    fields: dict[str, dict[str, list[int]]] = {}  # engine -> field -> lines, first-line order
    for (field_name, engine, _), position in samples.items():
        fields.setdefault(engine, {}).setdefault(field_name, []).append(position)
    buckets: dict[str, dict[str, list[tuple[tuple[float, ...], _Getter]]]] = {}
    for (field_name, engine, _), lines in histograms.items():
        bounds = tuple(sorted(lines))
        per_field = buckets.setdefault(engine, {}).setdefault(field_name, [])
        per_field.append((bounds, _getter(lines[bound] for bound in bounds)))
    states: dict[str, list[tuple[str, int]]] = {}
    for (engine, state), position in sleep.items():
        states.setdefault(engine, []).append((state, position))
    plans = []
    for engine in sorted(fields.keys() | buckets.keys() | states.keys(), key=_engine_order):
        own = fields.get(engine, {})
        legacy = own.pop("kv_usage_legacy", None)
        if "kv_usage" not in own and legacy is not None:
            own["kv_usage"] = legacy  # the gauge's name before vLLM 0.10, when the new is absent
        summed = {name: lines for name, lines in own.items() if name not in _TAKE_MAXIMUM}
        singles = {name: lines[0] for name, lines in summed.items() if len(lines) == 1}
        plans.append(
            _Engine(
                name=engine,
                single_fields=tuple(singles),
                singles=_getter(singles.values()),
                sums=tuple(
                    (name, _getter(lines)) for name, lines in summed.items() if len(lines) > 1
                ),
                maxima=tuple(
                    (name, _getter(lines)) for name, lines in own.items() if name in _TAKE_MAXIMUM
                ),
                histograms=tuple(
                    (name, tuple(sets)) for name, sets in buckets.get(engine, {}).items()
                ),
                sleep=tuple(
                    sorted(states.get(engine, ()), key=lambda item: (item[0] != "awake", item[0]))
                ),
                listed=engine in fields or engine in states,
            )
        )
    return tuple(plans)


def _engines(plans: tuple[_Engine, ...], values: list[float]) -> tuple[EngineSignals, ...]:
    """Each engine's signals from one value per line; every value usable as it stands."""
    result = []
    for plan in plans:
        # 0.0 + value, as a sum of one: a written "-0" reads as 0.0, as a sum of several.
        fields: dict[str, Any] = dict(
            zip(plan.single_fields, map(_ZERO.__add__, plan.singles(values)), strict=True)
        )
        for name, several in plan.sums:
            total = 0.0
            for one in several(values):
                total += one
            if total < math.inf:
                # Label sets of finite counts may add up past a float (1e308 twice): no
                # usable count, absent as an unusable line's is, not infinite.
                fields[name] = total
        for name, several in plan.maxima:
            fields[name] = max(several(values))  # the first of equal ones
        for name, label_sets in plan.histograms:
            # Several label sets (model names) of one engine: the longest of them counts.
            highest = None
            beyond = False
            for bounds, counts in label_sets:
                found = _highest_bucket(bounds, counts(values))
                if found is not None:
                    if highest is None or found[0] > highest:
                        highest = found[0]
                    beyond = beyond or found[1]
            if highest is not None and beyond and name == "longest_prefill":
                continue  # only known to exceed its last bound: it bounds nothing
            if highest is not None:
                fields[name] = highest
                if beyond and name == "longest_gap":
                    fields["gap_beyond"] = True
        if not fields and not plan.listed:
            continue  # only histograms, all empty
        for state, position in plan.sleep:
            if values[position] >= 1:
                fields["sleep_state"] = state
                break
        result.append(EngineSignals(plan.name, **fields))
    return tuple(result)


_ZERO = 0.0


def _combine(
    samples: dict[_Key, float],
    sleep: dict[str, dict[str, float]],
    buckets: dict[_Key, dict[float, float]] | None = None,
) -> tuple[EngineSignals, ...]:
    """The engines' signals from samples already read, by the rules ``_read`` uses;
    ``buckets`` are each histogram's counts by bound."""
    values = list(samples.values())
    positions = dict(zip(samples, range(len(values)), strict=True))
    states = {}
    for engine, by_state in sleep.items():
        for state, reading in by_state.items():
            states[(engine, state)] = len(values)
            values.append(reading)
    histograms: dict[_Key, dict[float, int]] = {}
    for key, counts in (buckets or {}).items():
        for bound, reading in counts.items():
            histograms.setdefault(key, {})[bound] = len(values)
            values.append(reading)
    return _engines(_plan(positions, histograms, states), values)


def _layout(heads: tuple[bytes, ...]) -> _Layout:
    """The layout of these lines, remembered (bounded, as ``_MEANINGS`` is)."""
    samples: dict[tuple[str, str, frozenset[tuple[str, str]]], int] = {}
    histograms: dict[tuple[str, str, frozenset[tuple[str, str]]], dict[float, int]] = {}
    sleep: dict[tuple[str, str], int] = {}
    starts: list[int] = []
    kinds: list[int | None] = []
    leftovers: dict[int, bytes] = {}
    for position, head in enumerate(heads):
        meaning = _meaning(head)
        if meaning is None or (meaning[0] == _BUCKET and meaning[2] is None):
            kinds.append(None)  # labels that do not parse, or a bound that is not a number
            continue
        kind, key, extra, leftover = meaning
        kinds.append(kind)
        if leftover:
            leftovers[position] = leftover
        if kind == _SAMPLE:
            samples[key] = position
        elif kind == _BUCKET:
            histograms.setdefault(key, {})[extra] = position
        elif kind == _SLEEP:
            sleep[extra] = position
        elif kind == _START:
            starts.append(position)
    layout = _Layout(
        kinds=tuple(kinds),
        malformed=kinds.count(None),
        leftovers=leftovers,
        engines=_plan(samples, histograms, sleep),
        starts=tuple(starts),
    )
    _LAYOUTS.remember(heads, layout, _layout_size(heads, layout))
    return layout


# What a remembered layout holds besides its lines' text (measured with tracemalloc): its
# lines' bytes objects and their places in its tuples and getters, about 130 bytes a line,
# and each engine's plan with its getters, about 450. Its text alone was counted: a server
# inventing a text of 20,000 one-line engines on each read kept 15 times the memo's budget
# (600 MB for its 32 MiB). A line's leftover (what follows its label set's "}") is bytes
# of its own, kept even when its meaning is not: up to three times its text (U+FFFD for
# each byte not UTF-8), so a text of such lines kept four times what it was counted at.
_LINE_COST = 144
_ENGINE_COST = 512


def _layout_size(heads: tuple[bytes, ...], layout: _Layout) -> int:
    leftovers = layout.leftovers.values()
    return (
        sum(map(len, heads))
        + sum(map(len, leftovers))
        + _LINE_COST * (len(heads) + len(leftovers))
        + _ENGINE_COST * len(layout.engines)
    )


_K = TypeVar("_K")
_V = TypeVar("_V")
_MISSES_WHEN_FULL = count()
_ADMIT_ONE_IN = 16


class _Memo(dict[_K, _V]):
    """A memo bounded in entries and in the bytes of its entries (``remember``, told the
    size of each); looked up as the plain dict it is, on the read path.

    In bytes too: a server sending a megabyte of label value, new on every read, filled
    an entry-bounded memo with copies of it (122 MB after 60 reads; gigabytes within the
    body cap). A real vLLM line is about 100 bytes of name and labels (a long model path
    adds a few hundred), a text 4 KB of them, 250 KB with 32 data-parallel engines: an
    entry may be an eighth of the budget, and what is larger is understood afresh on each
    read (as the first read of it was).
    """

    def __init__(self, entries: int, budget: int) -> None:
        super().__init__()
        self.entries = entries
        self.budget = budget
        self._sizes: dict[_K, int] = {}
        self._bytes = 0

    def remember(self, key: _K, value: _V, size: int) -> None:
        """Keep ``value`` under ``key``, ``size`` bytes.

        Emptying a full memo made every read miss once more than it holds were read in
        turn (each one's entry gone before its next read): a fleet of 300 different
        layouts rebuilt every layout of every read. So a full memo stays full and takes
        one newcomer in ``_ADMIT_ONE_IN``, in place of its oldest entries: what is kept
        keeps hitting, and entries no longer read still make way for new ones in time.
        """
        if size > self.budget // 8:
            return
        if len(self) >= self.entries or self._bytes + size > self.budget:
            if next(_MISSES_WHEN_FULL) % _ADMIT_ONE_IN:
                return
            while self and (len(self) >= self.entries or self._bytes + size > self.budget):
                try:
                    oldest = next(iter(self))
                except RuntimeError:
                    # Another thread's read (the library's ``asyncio.to_thread(check)``)
                    # changed the memo between two steps: this newcomer is not kept.
                    return
                self.pop(oldest, None)
                self._bytes -= self._sizes.pop(oldest, 0)
        # Two threads that missed the same line both remember it: counted once.
        self._bytes += size - self._sizes.get(key, 0)
        self[key] = value
        self._sizes[key] = size

    def clear(self) -> None:
        super().clear()
        self._sizes.clear()
        self._bytes = 0


# Layouts by the name and label text of their lines. A fleet of alike backends shares a
# few; the bounds keep a server that invents label values from growing it without limit.
_LAYOUTS_MAX = 256
_LAYOUTS: _Memo[tuple[bytes, ...], _Layout] = _Memo(_LAYOUTS_MAX, 32 * 1024 * 1024)
_EMPTY_LAYOUT = _Layout((), 0, {}, (), ())


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
    only, bounded (``_Memo``), so a server inventing new label values cannot grow it
    without limit. A label text is all the interpretation reads: a label set that parses
    ends at a ``}`` no later than the line's last one.
    """
    # One look-up, not "in" then "[]": another thread's read (the library's
    # ``asyncio.to_thread(check)``) may evict the entry between the two.
    try:
        return _MEANINGS[head]
    except KeyError:
        pass  # rare: a fleet's lines are understood once
    meaning = _interpret(head)
    _MEANINGS.remember(head, meaning, _meaning_size(head, meaning))
    return meaning


# What a remembered meaning holds besides its line's text (measured with tracemalloc): its
# tuples, label set and the memo's entries for it, and per label a pair in the set, with
# the label's name and value as strings of their own. Its text alone was counted: a server
# sending lines of many short labels, new on each read, kept 20 times the memo's budget
# (160 MB for its 8 MiB).
_MEANING_COST = 512
_LABEL_COST = 128
# A string's size at most, by arithmetic (``sys.getsizeof`` is not for this pure module):
# its header, under 80 bytes in CPython, and a byte a character, four unless all ASCII.
_STRING_COST = 80


def _string_size(text: str) -> int:
    return _STRING_COST + (len(text) if text.isascii() else 4 * len(text))


def _meaning_size(head: bytes, meaning: _Meaning | None) -> int:
    if meaning is None:
        return len(head)
    labels = meaning[1][2]
    strings = sum(_string_size(name) + _string_size(value) for name, value in labels)
    return len(head) + len(meaning[3]) + _MEANING_COST + _LABEL_COST * len(labels) + strings


_MEANINGS_MAX = 4096
_MEANINGS: _Memo[bytes, _Meaning | None] = _Memo(_MEANINGS_MAX, 8 * 1024 * 1024)
_NO_KEY: tuple[str, str, frozenset[tuple[str, str]]] = ("", "", frozenset())


def _interpret(head: bytes) -> _Meaning | None:
    """What one series line means, from its name and label text; None when the labels
    do not parse (the line is then counted as malformed)."""
    name_bytes, brace, label_bytes = head.partition(b"{")
    name = name_bytes.decode("ascii").rstrip(" \t")  # one of ours, which _LINES matched
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
    if len(engine) > MAX_ENGINE_LABEL:
        return None  # malformed: its name would be repeated in every verdict about it
    if name == _SLEEP_SERIES:
        state = labels.get("sleep_state")
        if state is None:
            return (_IGNORE, _NO_KEY, None, leftover)
        if len(state) > MAX_SLEEP_STATE:
            return None
        return (_SLEEP, _NO_KEY, (engine, state), leftover)
    if name == _BY_REASON_SERIES:
        if labels.pop("reason", None) != _DEFERRED:
            return (_IGNORE, _NO_KEY, None, leftover)
        return (_SAMPLE, ("waiting_deferred", engine, frozenset(labels.items())), None, leftover)
    if name in _BUCKETS or name == _PREFILL_BUCKETS:
        bound = _bucket_bound(labels.pop("le", None))
        key = (_BUCKETS.get(name, "longest_prefill"), engine, frozenset(labels.items()))
        return (_BUCKET, key, bound, leftover)
    field_name = "prefill_seconds" if name == _PREFILL_SUM else _SERIES[name]
    return (_SAMPLE, (field_name, engine, frozenset(labels.items())), None, leftover)


# Fields of several label sets of one engine that combine by maximum, not by sum.
_TAKE_MAXIMUM = frozenset(
    {
        "kv_usage",
        "kv_usage_legacy",
        "longest_gap",
        "gap_beyond",
        "largest_step_tokens",
        "longest_prefill",
    }
)


def _bucket_bound(text: str | None) -> float | None:
    if text is None:
        return None
    try:
        bound = float(text)
    except ValueError:
        return None
    return None if math.isnan(bound) or bound < 0 else bound


def _highest_bucket(
    bounds: tuple[float, ...], counts: tuple[float, ...]
) -> tuple[float, bool] | None:
    """The bound of the lowest bucket that holds every observation; None when empty.

    ``bounds`` ascend, one count each. When some observations are only in +Inf, it is the
    largest finite bound and True: the longest value is then only known to exceed it.
    Bounds are never NaN or negative (``_bucket_bound``), so +Inf sorts last; counts are
    usable (``_read``): the first bucket holding the largest count holds them all.
    """
    total = max(counts)
    if total <= 0:
        return None
    lowest = counts.index(total)
    if bounds[lowest] != math.inf:
        return bounds[lowest], False
    return None if lowest == 0 else (bounds[lowest - 1], True)


def _engine_order(engine: str) -> tuple[int, str]:
    # isdigit() alone admits "²" (int() rejects it) and int() refuses over 4300 digits.
    if engine.isascii() and engine.isdigit() and len(engine) <= 18:
        return (int(engine), engine)  # the name breaks a tie: "0" and "00"
    return (1 << 62, engine)


_READ = (*_SERIES, *_BUCKETS, _PREFILL_SUM, _SLEEP_SERIES, _START_SERIES, _BY_REASON_SERIES)


def _value_before_timestamp(tail: bytes) -> float | None:
    """The value of ``value [timestamp] [# exemplar]``; None when that is not what follows
    the labels.

    Read as the text it is (U+FFFD for what is not UTF-8): any Unicode space separates.
    An OpenMetrics exporter may follow a bucket or counter with an exemplar (a sample
    request's labels and value after ``#``); dropping such a line lost a histogram's top
    buckets, and with them a long step's evidence. No value contains a ``#``.
    """
    parts = tail.partition(b"#")[0].decode("utf-8", errors="replace").split()
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
# when there is none, which no label set parses from), and the rest of the line. Blanks
# may come between the name and its labels, as the text format allows (Prometheus and
# prometheus_client read them): such lines were dropped as malformed, and a busy server
# written so had no engines. Blanks before a line's name are allowed too, line by line
# ("leading whitespace is ignored"; prometheus_client strips every line): read only in a
# text that found no line without them, the indented lines beside unindented ones were
# dropped (a busy engine's counters, or its gauges). Read possessively (no name starts
# with a blank), they cost a vLLM text about 4 %; they are outside the name and label
# text, so an indented line is remembered as the same line unindented. The first line is
# matched on its own, sparing a copy of the text to put a newline before it.
def _line_of(names: Iterable[str]) -> bytes:
    return (
        rf"((?:{_alternatives(names)})(?=[{{ \t])"
        rf"(?:\{{[^\n]*\}}|[ \t]+\{{[^\n]*\}}|\{{|[ \t]+\{{|))([^\n]*)"
    ).encode("ascii")


_LINES = re.compile(b"\n[ \t]*+" + _line_of(_READ))
_FIRST_LINE = re.compile(b"[ \t]*+" + _line_of(_READ))
# The second scan: one request's time to first token, for an engine whose figure needs it.
_PREFILL_NAME = _PREFILL_BUCKETS.encode("ascii")
_PREFILL_LINES = re.compile(b"\n[ \t]*+" + _line_of([_PREFILL_BUCKETS]))
_FIRST_PREFILL_LINE = re.compile(b"[ \t]*+" + _line_of([_PREFILL_BUCKETS]))


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
        # A quoted name (the format's UTF-8 form, for a name that is not a legacy one)
        # may hold "=" itself: the one after the name follows its closing quote.
        named = text.find('"', position + 1) + 1 if text[position] == '"' else position
        if named == 0:
            return None
        equals = text.find("=", named)
        if equals == -1:
            return None
        quote = equals + 1
        while quote < length and text[quote] in " \t":  # the format allows blanks around "="
            quote += 1
        if quote >= length or text[quote] != '"':
            return None
        key = text[position:equals].strip()
        if len(key) >= 2 and key[0] == key[-1] == '"':
            # A quoted name (the format's UTF-8 form): ``"engine"`` is the engine label.
            key = key[1:-1]
        if not key:
            return None
        position = quote + 1
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
