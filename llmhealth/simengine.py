"""Pure model of the backends that `llmhealth simulate` serves: modes, counters, /metrics text.

Rule: no sockets, no clock, no files. Every call takes `now` (seconds since the epoch) and the
counters are derived from elapsed time when they are read, so a backend costs nothing between
reads and a thousand of them fit in one process. The shell (simulate.py) only does I/O.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from enum import Enum

# Shape of the synthetic load, after the real busy capture (max-num-seqs 4: ~410 steps/s).
STEP_RATE = 400.0  # engine steps per second while decoding
FIRST_TOKEN_SECONDS = 0.05  # how long a max_tokens=1 request holds its slot
WAITING_PER_SLOT = 2  # synthetic queue length, per slot
SYNTHETIC_PROMPT_TOKENS = 12
DEFAULT_MAX_TOKENS = 16  # vLLM's default for /v1/completions
MAX_MODEL_LEN = 2048  # what /v1/models reports, as the captured server did
# Prefill time of one request, the captured server's own: busy-0.txt read two short
# prompts in 0.1003 s, chunk-1.txt one of 2,000 tokens in 0.1008 s, so the time goes with
# the request, not its prompt's length. A process shows the prefill time of the requests
# it has finished, which llmhealth divides by its prompt tokens and multiplies by the
# most tokens of one step to learn how long a step can take: at 5.9 ms a prompt token
# (busy-0's 0.1003 s over its 17 tokens) one 2,000-token prompt was a 12 s step, where
# the real server learns 0.1 s from it.
PREFILL_SECONDS = 0.1003197850000106 / 2
# The finite bucket bounds of vLLM's histogram of tokens per engine step, as the template
# writes them. A request's prompt is read in the step that makes its first token
# (chunk-1.txt: one 2,000-token prompt, one step of 2,001 tokens, under le="2048.0"), and
# llmhealth learns from these buckets how many tokens one step can hold: every step
# counted under le="8.0" said 8 whatever the prompts, with a sum no bucket could hold.
STEP_TOKEN_BOUNDS: tuple[float, ...] = (1.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0)
STEP_TOKEN_BOUNDS += (1024.0, 2048.0, 4096.0, 8192.0, 16384.0)


class Load(Enum):
    IDLE = "idle"  # no work of its own; only real requests run
    BUSY = "busy"  # every slot decoding, a queue waiting: steps and tokens advance
    PREFILL = "prefill"  # every slot reading a long prompt: only KV use moves


class Outcome(Enum):
    ANSWER = "answer"  # answer at `Ticket.at`
    HANG = "hang"  # never answer; the client gives up, as with a wedged vLLM
    DROP = "drop"  # the process "restarts" at `Ticket.at`: close without an answer


class ModeError(ValueError):
    """A mode string that does not parse; the message names the offending part."""


@dataclass(frozen=True)
class ModeSpec:
    text: str
    load: Load = Load.IDLE
    wedge_after: float | None = None  # seconds after (re)start when engines freeze
    wedge_one: bool = False  # only the last engine freezes
    restart_every: float | None = None
    answers: bool = True  # False: completions never answer ("unanswered")
    hang: bool = False  # HTTP never answers at all
    no_metrics: bool = False
    multiproc: bool = False
    asleep: bool = False
    proxy_urls: tuple[str, ...] = ()

    @property
    def is_proxy(self) -> bool:
        return bool(self.proxy_urls)


@dataclass(frozen=True)
class SimConfig:
    max_num_seqs: int = 4
    request_seconds: float = 4.0  # how long one synthetic request lasts
    engines: int = 1
    model: str = "tiny"
    # How long before it really started the first simulated process says it started: a
    # server that has been up an hour by default, so a freeze is judged as on one (a
    # young process gets minutes of startup window); 0 shows a young process. A restart
    # (``restart:N``'s next process, or ``/sim/restart``) is young, as a real one is.
    age: float = 3600.0
    # How long an idle client connection stays open: uvicorn's default, which vLLM keeps
    # (VLLM_HTTP_TIMEOUT_KEEP_ALIVE), so a reader that comes back every 5 s finds its
    # connection closed as on a real server; longer shows what a raised setting saves.
    keep_alive: float = 5.0

    def __post_init__(self) -> None:
        if not 0 <= self.age < math.inf:
            raise ValueError("age must be a finite number of seconds, 0 or more")
        if not 0 < self.keep_alive < math.inf:
            raise ValueError("keep_alive must be a positive, finite number of seconds")
        if self.max_num_seqs < 1:
            raise ValueError("max_num_seqs must be at least 1")
        if self.engines < 1:
            raise ValueError("engines must be at least 1")
        if not self.request_seconds > 0 or math.isinf(self.request_seconds):
            raise ValueError("request_seconds must be a positive number")
        if not self.model:
            raise ValueError("model must not be empty")


_LOADS = {load.value: load for load in Load}
_FLAGS = ("unanswered", "hang", "no-metrics", "multiproc", "asleep")
_TIMED = ("wedge", "wedge-one", "restart")
_KNOWN = ", ".join([*_LOADS, *_FLAGS, *(f"{name}:SECONDS" for name in _TIMED), "proxy:URL,..."])


def parse_mode(text: str) -> ModeSpec:
    """`busy`, `wedge:2`, `restart:5+busy+multiproc`, `proxy:URL,URL`, ... -> ModeSpec."""
    if text.startswith("proxy:"):
        urls = tuple(u.strip().rstrip("/") for u in text[len("proxy:") :].split(","))
        if any(not u.startswith(("http://", "https://")) for u in urls):
            raise ModeError(f"{text!r}: proxy needs a comma-separated list of http(s) URLs")
        return ModeSpec(text=text, proxy_urls=urls)
    load: Load | None = None
    flags: set[str] = set()
    timed: dict[str, float] = {}
    for part in text.split("+"):
        name, colon, arg = part.partition(":")
        if name in flags or name in timed or (load is not None and name == load.value):
            raise ModeError(f"{text!r}: {name!r} given twice")
        if name in _TIMED:
            timed[name] = _parse_seconds(text, part, arg if colon else "")
        elif colon:
            raise ModeError(f"{text!r}: {name!r} takes no argument")
        elif name in _FLAGS:
            flags.add(name)
        elif name in _LOADS:
            if load is not None:
                raise ModeError(f"{text!r}: give one of idle, busy, prefill")
            load = _LOADS[name]
        else:
            raise ModeError(f"{text!r}: unknown mode {part!r}; known: {_KNOWN}")
    if "wedge" in timed and "wedge-one" in timed:
        raise ModeError(f"{text!r}: give wedge or wedge-one, not both")
    wedge_after = timed.get("wedge", timed.get("wedge-one"))
    if wedge_after is not None:
        # A wedge needs work in flight to be one; with no load named, the engine is busy.
        if load is Load.IDLE:
            raise ModeError(f"{text!r}: an idle engine cannot wedge; use busy or prefill")
        load = load or Load.BUSY
    restart_every = timed.get("restart")
    if restart_every is not None and restart_every <= 0:
        raise ModeError(f"{text!r}: restart needs a period above 0 s")
    return ModeSpec(
        text=text,
        load=load or Load.IDLE,
        wedge_after=wedge_after,
        wedge_one="wedge-one" in timed,
        restart_every=restart_every,
        answers="unanswered" not in flags,
        hang="hang" in flags,
        no_metrics="no-metrics" in flags,
        multiproc="multiproc" in flags,
        asleep="asleep" in flags,
    )


def _parse_seconds(text: str, part: str, arg: str) -> float:
    try:
        seconds = float(arg.removesuffix("s"))
    except ValueError:
        raise ModeError(
            f"{text!r}: {part!r} needs seconds, e.g. {part.partition(':')[0]}:2"
        ) from None
    if not math.isfinite(seconds) or seconds < 0:
        raise ModeError(f"{text!r}: {part!r} needs a finite number of seconds >= 0")
    return seconds


@dataclass(frozen=True)
class Ticket:
    """What will happen to one real completion request, decided when it arrives."""

    outcome: Outcome
    at: float  # when to answer or drop; inf for HANG
    engine: int
    prompt_tokens: int
    completion_tokens: int


@dataclass(frozen=True)
class EngineSnapshot:
    running: int
    waiting: int
    kv_usage: float
    steps: int
    generation_tokens: int
    prompt_tokens: int
    finished: int
    preemptions: int
    awake: bool
    # Steps by how many tokens each held, one count per STEP_TOKEN_BOUNDS bucket and one
    # over them (not cumulative); empty: none.
    step_buckets: tuple[int, ...] = ()
    # Requests that made their first token: every later token came one step (an
    # inter-token gap of 1 / STEP_RATE s) after the one before it.
    first_tokens: int = 0


def _bucket(bounds: tuple[float, ...], value: float) -> int:
    """The index of the first bucket of ``bounds`` that holds ``value``; len(bounds): +Inf."""
    return next((index for index, bound in enumerate(bounds) if value <= bound), len(bounds))


@dataclass(frozen=True)
class BackendSnapshot:
    start_time: float  # of the current simulated process
    gauges_visible: bool  # False: multiprocess mode before the first request went through
    engines: tuple[EngineSnapshot, ...]


@dataclass
class _RealRequest:
    arrival: float
    start: float
    finish: float
    prompt_tokens: int
    completion_tokens: int


@dataclass
class _EngineState:
    """Real requests of one engine in one simulated process; synthetic load is computed."""

    slot_free: list[float]  # when each slot frees, for loads without synthetic requests
    first_step_extra: int = 1  # tokens of others in the step that reads a prompt
    last_event: int = -1  # last synthetic slot-free event handed to a real request
    in_flight: list[_RealRequest] = field(default_factory=list)
    steps: int = 0
    generation_tokens: int = 0
    prompt_tokens: int = 0
    finished: int = 0
    first_done_at: float = math.inf
    # The steps that read the finished requests' prompts, by STEP_TOKEN_BOUNDS bucket.
    step_buckets: list[int] = field(default_factory=lambda: [0] * (len(STEP_TOKEN_BOUNDS) + 1))

    def fold(self, t: float) -> None:
        """Move requests finished by `t` into the totals, so reads stay O(requests in flight)."""
        if not any(r.finish <= t for r in self.in_flight):
            return
        still: list[_RealRequest] = []
        for r in self.in_flight:
            if r.finish <= t:
                self.steps += r.completion_tokens
                self.generation_tokens += r.completion_tokens
                self.prompt_tokens += r.prompt_tokens
                self.finished += 1
                self.first_done_at = min(self.first_done_at, r.finish)
                self.step_buckets[self.first_step(r.prompt_tokens)] += 1
            else:
                still.append(r)
        self.in_flight = still

    def first_step(self, prompt_tokens: int) -> int:
        """The bucket of the step that reads this prompt and makes its first token."""
        return _bucket(STEP_TOKEN_BOUNDS, prompt_tokens + self.first_step_extra)


class SimBackend:
    """One simulated vLLM process (possibly restarting), with one or more engines."""

    def __init__(self, spec: ModeSpec, config: SimConfig, born: float) -> None:
        if spec.is_proxy:
            raise ValueError("a proxy is not a simulated backend")
        self.spec = spec
        self.config = config
        self.born = born
        self._last_now = born
        self._generation = 0
        self._next_engine = 0
        self._engines = self._fresh_engines()

    def _fresh_engines(self) -> list[_EngineState]:
        n = self.config.max_num_seqs
        # Busy: a prompt is read in a step with the other slots' decode tokens.
        extra = n if self.spec.load is Load.BUSY else 1
        return [
            _EngineState(slot_free=[-math.inf] * n, first_step_extra=extra)
            for _ in range(self.config.engines)
        ]

    def _advance(self, now: float) -> tuple[float, float]:
        """Clamp time to run forward; switch process on a restart. Returns (now, start)."""
        now = max(now, self._last_now)
        self._last_now = now
        period = self.spec.restart_every
        if period is None:
            return now, self.born
        generation = int((now - self.born) // period)
        if generation != self._generation:
            self._generation = generation
            self._next_engine = 0
            self._engines = self._fresh_engines()
        return now, self.born + generation * period

    def _wedge_at(self, engine: int, start: float) -> float:
        if self.spec.wedge_after is None:
            return math.inf
        if self.spec.wedge_one and engine != self.config.engines - 1:
            return math.inf
        return start + self.spec.wedge_after

    def start_time(self, now: float) -> float:
        return self._advance(now)[1]

    def submit(self, now: float, prompt_tokens: int, max_tokens: int) -> Ticket:
        """A real completion arrives: queue it FIFO behind whatever holds the slots."""
        now, start = self._advance(now)
        engine = self._next_engine
        self._next_engine = (engine + 1) % self.config.engines
        hang = Ticket(Outcome.HANG, math.inf, engine, prompt_tokens, max_tokens)
        wedge_at = self._wedge_at(engine, start)
        # A frozen engine never sees the request (its gauges do not move either); an asleep one
        # and an "unanswered" one take it and never reply.
        if not self.spec.answers or self.spec.asleep or now >= wedge_at:
            return hang
        state = self._engines[engine]
        service = FIRST_TOKEN_SECONDS + (max_tokens - 1) / STEP_RATE
        if self.spec.load is Load.IDLE:
            slot = min(range(len(state.slot_free)), key=state.slot_free.__getitem__)
            begin = max(now, state.slot_free[slot])
            state.slot_free[slot] = begin + service
        else:
            # Synthetic requests free a slot every `interval`; the synthetic queue and earlier
            # real requests get the next free slots first.
            n = self.config.max_num_seqs
            interval = self.config.request_seconds / n
            next_event = int((now - start) // interval) + 1
            real_waiting = sum(1 for r in state.in_flight if r.start > now)
            event = max(next_event + WAITING_PER_SLOT * n + real_waiting, state.last_event + 1)
            state.last_event = event
            begin = start + event * interval
        finish = begin + service
        state.in_flight.append(_RealRequest(now, begin, finish, prompt_tokens, max_tokens))
        if finish >= wedge_at:
            return hang
        if self.spec.restart_every is not None:
            restart_at = start + self.spec.restart_every
            if finish >= restart_at:
                return Ticket(Outcome.DROP, restart_at, engine, prompt_tokens, max_tokens)
        return Ticket(Outcome.ANSWER, finish, engine, prompt_tokens, max_tokens)

    def observe(self, now: float) -> BackendSnapshot:
        now, start = self._advance(now)
        engines = tuple(self._engine_snapshot(i, start, now) for i in range(self.config.engines))
        if self.spec.load is not Load.IDLE:
            # The synthetic load stands for traffic that went through before we looked.
            visible = True
        else:
            visible = any(
                s.first_done_at <= min(now, self._wedge_at(i, start))
                for i, s in enumerate(self._engines)
            )
        age = self.config.age if start == self.born else 0.0  # a restart is young
        return BackendSnapshot(start_time=start - age, gauges_visible=visible, engines=engines)

    def _engine_snapshot(self, index: int, start: float, now: float) -> EngineSnapshot:
        # A wedged engine shows exactly what it showed when it froze.
        t = min(now, self._wedge_at(index, start))
        state = self._engines[index]
        state.fold(t)
        n = self.config.max_num_seqs
        real_running = sum(1 for r in state.in_flight if r.start <= t)
        real_waiting = sum(1 for r in state.in_flight if r.arrival <= t < r.start)
        load = self.spec.load
        if self.spec.asleep:
            waiting = 0 if load is Load.IDLE else (1 + WAITING_PER_SLOT) * n
            return EngineSnapshot(0, waiting, 0.0, 0, 0, 0, 0, 0, awake=False)
        if load is Load.IDLE:
            # Requests still decoding count the tokens made so far, as vLLM publishes its
            # counters at every step's end: counted only when a request finished, a stream
            # longer than two waits showed work and no progress, and was proven a wedge.
            made = [_tokens_made(r, t) for r in state.in_flight]
            begun = [
                r.prompt_tokens for r, tokens in zip(state.in_flight, made, strict=True) if tokens
            ]
            steps = state.steps + sum(made)
            buckets = list(state.step_buckets)
            for prompt in begun:
                buckets[state.first_step(prompt)] += 1
            return EngineSnapshot(
                running=real_running,
                waiting=real_waiting,
                kv_usage=0.002 * real_running + 0.00001 * sum(made),
                steps=steps,
                generation_tokens=state.generation_tokens + sum(made),
                prompt_tokens=state.prompt_tokens + sum(begun),
                finished=state.finished,
                preemptions=0,
                awake=True,
                step_buckets=_with_steps(buckets, steps, 1),
                first_tokens=state.finished + len(begun),
            )
        elapsed = t - start
        kv = _kv_usage(elapsed, n, self.config.request_seconds, load)
        waiting = WAITING_PER_SLOT * n + real_waiting
        if load is Load.PREFILL:
            # Prompt tokens are credited only at a request's first output token, and steps that
            # only read a prompt emit nothing: only the real requests count.
            return EngineSnapshot(
                running=n,
                waiting=waiting,
                kv_usage=kv,
                steps=state.steps,
                generation_tokens=state.generation_tokens,
                prompt_tokens=state.prompt_tokens,
                finished=state.finished,
                preemptions=0,
                awake=True,
                step_buckets=_with_steps(list(state.step_buckets), state.steps, 1),
                first_tokens=state.finished,
            )
        # Busy: real requests ride in slots whose steps the synthetic count already includes.
        # Each request's prompt was read in a step of its own (the first ones at once: no
        # prompt is counted before a step read it).
        finished = int(elapsed // (self.config.request_seconds / n))
        firsts = n + finished
        steps = max(int(elapsed * STEP_RATE), firsts + state.finished)
        buckets = list(state.step_buckets)
        buckets[_bucket(STEP_TOKEN_BOUNDS, SYNTHETIC_PROMPT_TOKENS + n)] += firsts
        return EngineSnapshot(
            running=n,
            waiting=waiting,
            kv_usage=kv,
            steps=steps,
            generation_tokens=steps * n,
            prompt_tokens=firsts * SYNTHETIC_PROMPT_TOKENS + state.prompt_tokens,
            finished=finished + state.finished,
            preemptions=0,
            awake=True,
            step_buckets=_with_steps(buckets, steps, n),
            first_tokens=firsts + state.finished,
        )


def _with_steps(buckets: list[int], steps: int, tokens: int) -> tuple[int, ...]:
    """``buckets`` (the steps that read a prompt) and the rest of ``steps``, of ``tokens``
    tokens each, in their bucket."""
    buckets[_bucket(STEP_TOKEN_BOUNDS, tokens)] += steps - sum(buckets)
    return tuple(buckets)


def _tokens_made(request: _RealRequest, t: float) -> int:
    """Output tokens a real request in flight has made by `t`: the first one after
    FIRST_TOKEN_SECONDS in its slot, then one per step, as its stream sends them."""
    first = request.start + FIRST_TOKEN_SECONDS
    if t < first:
        return 0
    return min(request.completion_tokens, 1 + int((t - first) * STEP_RATE))


def _kv_usage(elapsed: float, n: int, request_seconds: float, load: Load) -> float:
    """KV use of n staggered requests that each grow over request_seconds, then restart.

    The mean fill of n evenly staggered sawtooths has a closed form; the slow drift term keeps
    two reads a whole number of periods apart from showing the same value.
    """
    cycles = n * elapsed / request_seconds
    mean_fill = ((n - 1) / 2 + (cycles - math.floor(cycles))) / n
    drift = 0.01 * ((elapsed / 3600.0) % 1.0)
    if load is Load.PREFILL:
        return 0.05 + 0.5 * mean_fill + drift
    return 0.02 + 0.3 * mean_fill + drift


# --- /metrics text -------------------------------------------------------------------------

_PLACEHOLDER = re.compile(r"\{\{(\w+)\}\}")
_PROCESS_KEYS = frozenset({"start", "created"})
_ENGINE_KEYS = frozenset(
    {"running", "waiting", "kv", "steps", "iter_sum", "gen", "prompt", "finished"}
    | {"preemptions", "awake", "offloaded", "prefill"}
    | {f"steps_b{index}" for index in range(len(STEP_TOKEN_BOUNDS))}
    | {"gaps", "gaps_sum"}
)
# Prometheus multiprocess mode leaves these out until the engine first reported stats.
_LATE_GAUGES = frozenset(
    {
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:num_requests_waiting_by_reason",
        "vllm:kv_cache_usage_perc",
    }
)


def format_value(value: float) -> str:
    """A sample value as prometheus_client writes it (Go-style exponent from 1e6 up)."""
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    text = repr(float(value))
    if abs(value) >= 1e6 and "e" not in text:
        sign = "-" if value < 0 else ""
        digits = text.lstrip("-")
        dot = digits.index(".")
        mantissa = f"{digits[0]}.{digits[1:dot]}{digits[dot + 1 :]}".rstrip("0").rstrip(".")
        return f"{sign}{mantissa}e+{dot - 1:02d}"
    return text


def escape_label(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


@dataclass(frozen=True)
class _Family:
    name: str
    lines: tuple[str, ...]


def _families(template: str) -> Iterator[_Family]:
    name = ""
    lines: list[str] = []
    for line in template.splitlines():
        if line.startswith("# HELP "):
            if lines:
                yield _Family(name, tuple(lines))
            name, lines = line.split(" ", 3)[2], []
        elif line.startswith("#") and not line.startswith("# TYPE "):
            continue  # template notes, not part of the text
        elif not line.strip():
            continue
        lines.append(line)
    if lines:
        yield _Family(name, tuple(lines))


class _Compiled:
    """Literal pieces with holes; rendering fills the holes and joins."""

    def __init__(self, template: str, engines: int, model: str, keep: set[str] | None) -> None:
        self.pieces: list[str] = []
        self.holes: list[tuple[int, int, str]] = []  # (piece index, engine or -1, key)
        literal: list[str] = []
        model_label = escape_label(model)
        for family in _families(template):
            if keep is not None and family.name not in keep:
                continue
            lines = family.lines
            i = 0
            while i < len(lines):
                if "{{engine}}" not in lines[i]:
                    self._add_line(literal, lines[i], -1, model_label)
                    i += 1
                    continue
                # A run of per-engine lines repeats once per engine, as vLLM writes each label
                # set of a family in turn.
                j = i
                while j < len(lines) and "{{engine}}" in lines[j]:
                    j += 1
                for engine in range(engines):
                    for line in lines[i:j]:
                        self._add_line(literal, line, engine, model_label)
                i = j
        self.pieces.append("".join(literal))

    def _add_line(self, literal: list[str], line: str, engine: int, model_label: str) -> None:
        line = line.replace("{{engine}}", str(engine)).replace("{{model}}", model_label)
        pos = 0
        for match in _PLACEHOLDER.finditer(line):
            key = match.group(1)
            if key in _PROCESS_KEYS:
                owner = -1
            elif key in _ENGINE_KEYS and engine >= 0:
                owner = engine
            else:
                raise ValueError(f"metrics template: unknown placeholder {{{{{key}}}}} in {line!r}")
            literal.append(line[pos : match.start()])
            self.pieces.append("".join(literal))
            literal.clear()
            self.holes.append((len(self.pieces), owner, key))
            self.pieces.append("")
            pos = match.end()
        literal.append(line[pos:] + "\n")

    def render(self, process: dict[str, str], engines: Sequence[dict[str, str]]) -> str:
        pieces = self.pieces.copy()
        for index, owner, key in self.holes:
            pieces[index] = process[key] if owner < 0 else engines[owner][key]
        return "".join(pieces)


class MetricsText:
    """The /metrics text for one backend shape, compiled once from the template."""

    def __init__(self, template: str, *, engines: int, model: str, multiproc: bool) -> None:
        names = [family.name for family in _families(template)]
        keep: set[str] | None = None
        if multiproc:
            # Multiprocess mode has no process/python collectors and writes no _created series.
            keep = {
                n
                for n in names
                if not n.startswith(("process_", "python_")) and not n.endswith("_created")
            }
        self.engines = engines
        self._full = _Compiled(template, engines, model, keep)
        self._early = self._full
        if multiproc:
            self._early = _Compiled(template, engines, model, (keep or set()) - _LATE_GAUGES)

    def render(self, snapshot: BackendSnapshot) -> str:
        if len(snapshot.engines) != self.engines:
            raise ValueError("snapshot has a different number of engines than the template")
        compiled = self._full if snapshot.gauges_visible else self._early
        start = format_value(round(snapshot.start_time, 2))
        process = {"start": start, "created": format_value(snapshot.start_time)}
        return compiled.render(process, [_engine_values(e) for e in snapshot.engines])


def _engine_values(e: EngineSnapshot) -> dict[str, str]:
    gaps = max(0, e.generation_tokens - e.first_tokens)
    return {
        "running": format_value(e.running),
        "waiting": format_value(e.waiting),
        "kv": format_value(e.kv_usage),
        "steps": format_value(e.steps),
        "iter_sum": format_value(e.generation_tokens + e.prompt_tokens),
        "gen": format_value(e.generation_tokens),
        "prompt": format_value(e.prompt_tokens),
        "finished": format_value(e.finished),
        # Every finished request's prefill took PREFILL_SECONDS: all under le="0.3".
        "prefill": format_value(e.finished * PREFILL_SECONDS),
        "preemptions": format_value(e.preemptions),
        "awake": "1.0" if e.awake else "0.0",
        "offloaded": "0.0" if e.awake else "1.0",
        **_cumulative("steps", e.step_buckets, len(STEP_TOKEN_BOUNDS)),
        # The gaps between a request's tokens, all under the lowest bound (0.01 s): the
        # template's were a captured busy server's 6,059, which a process that had made
        # no token showed too, and llmhealth learned its steps from them.
        "gaps": format_value(gaps),
        "gaps_sum": format_value(gaps / STEP_RATE),
    }


def _cumulative(key: str, counts: tuple[int, ...], bounds: int) -> dict[str, str]:
    """A histogram's finite buckets as vLLM writes them: each counts all below its bound."""
    values: dict[str, str] = {}
    total = 0
    for index in range(bounds):
        total += counts[index] if index < len(counts) else 0
        values[f"{key}_b{index}"] = format_value(total)
    return values
