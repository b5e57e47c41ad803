"""From timed reads of a backend to a verdict with its evidence.

Pure and step-wise, after aioquic: the shell hands over what it has seen so far, and
``decide`` answers either with a verdict or with the one thing it needs next (another
read after a wait, or the tiny request). Time arrives inside the reads; no clock here.
The rules that carry the weight: a backend that shows work is never sent a request, and
a freeze proves a wedge only once it outlasts the engine's window (``llmhealth.window``).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from enum import StrEnum

from llmhealth.metrics import EngineSignals, Signals
from llmhealth.pickling import pickled_as_a_call
from llmhealth.window import (
    DEFAULT_RULES,
    CpuSample,
    LongestStep,
    WedgeRules,
    Window,
    cpu_span,
    cpu_used,
    cpu_was_idle,
    describe_cpu,
    longer,
    longest_step,
    stopped_throughout,
    wedge_window,
)

# Reads that span two waits: what every verdict but a long window's needs at most.
_TWO_WAITS = 3
# For a caller reading on a schedule: how many of its waits the reads of "two waits"
# must span. Not two: ``watch`` reads every 0.96 of a wait (probe.KEEP_ALIVE_LEAD) and a
# read may come a little late; more than one, so that two reads in one wait are not two.
PACED_SPAN = 1.5
# Evidence names at most this many engines; a text may legally carry 40,000 of them.
_NAMED_ENGINES = 8


class VerdictKind(StrEnum):
    BUSY = "busy"  # work present and the engine stepped in the last wait
    IDLE = "idle"  # no work, and the tiny request was answered
    STALLED = "stalled"  # no progress for less than the engine's window: doubt, not proof
    WEDGED = "wedged"  # work present, no progress over two waits and the window: proof
    UNANSWERED = "unanswered"  # no work shown, yet the tiny request failed
    RESTARTED = "restarted"  # another process answered than the one read before
    NO_METRICS = "no_metrics"  # no usable vLLM series; judged by the tiny request alone
    UNRESPONSIVE = "unresponsive"  # TCP connects, HTTP does not answer in time
    DOWN = "down"  # refused, reset, no route
    UP = "up"  # a proxy answered GET /v1/models with a model list


class ReadProblem(StrEnum):
    """Why a read gave no metrics text, grouped by the verdict each implies."""

    DOWN = "down"  # no connection: refused, reset, DNS, TLS, no route
    UNRESPONSIVE = "unresponsive"  # connected, but no complete answer in time
    UNUSABLE = "unusable"  # answered, but not with a metrics text (status, size, redirect)


@pickled_as_a_call
@dataclass(frozen=True, slots=True)
class Read:
    """One GET /metrics: when it was taken, and either its signals or what went wrong.

    ``at`` is when the answer was in; ``sent``, where known, when the request went out,
    on the same clock. The server's text is from between the two: an event loop seconds
    behind (thousands of reads at once) takes an answer in long after it was written.
    ``tick`` and ``sent_tick``: the same two moments on a steady clock
    (``time.monotonic``), where the reader has one. Time between reads is taken on them:
    a wall clock stepped forward between two reads (NTP, a VM resumed, ``date -s``)
    stretched a freeze of seconds past its window, and a busy engine inside a long step
    was wedged. ``at`` stays the wall time, for the record.
    ``born``: the process's start on that steady clock, taken from its age at the first
    read of it and carried from read to read (``probe.with_birth``); its age is taken on
    it: a wall clock stepped forward since the process started made a young engine an hour
    old, out of its startup window, and wedged at two waits.
    """

    at: float
    signals: Signals | None = None
    problem: ReadProblem | None = None
    detail: str = ""
    cpu: CpuSample | None = None  # the engine's local CPU time, when it runs on this host
    sent: float | None = None
    tick: float | None = None
    sent_tick: float | None = None
    born: float | None = None


@pickled_as_a_call
@dataclass(frozen=True, slots=True)
class Answer:
    """The tiny request: POST /v1/completions with max_tokens 1, and how it went."""

    at: float
    ok: bool
    detail: str
    model: str | None = None
    models_served: tuple[str, ...] = ()
    timed_out: bool = False  # sent, and no answer came within its timeout
    # Turned away for its credentials (HTTP 401 or 403): says nothing of the engine.
    refused: bool = False
    # False when it never went out ("not sent: GET /v1/models ..."): no request was spent.
    sent: bool = True
    tick: float | None = None  # ``at`` on the reads' steady clock (``Read.tick``)


@dataclass(frozen=True, slots=True)
class TakeRead:
    """Wait, then read /metrics again."""

    reason: str


@dataclass(frozen=True, slots=True)
class SendTinyRequest:
    """The backend shows no work (or cannot show it): one tiny request may be spent.

    ``good`` is the verdict an answer would give, which a caller that may not ask gives
    instead, marked as unasked (``left_unasked``).
    """

    reason: str
    good: VerdictKind


@pickled_as_a_call
@dataclass(frozen=True, slots=True)
class Verdict:
    kind: VerdictKind
    healthy: bool
    evidence: str
    running: int | None = None
    waiting: int | None = None
    steps_per_s: float | None = None
    tokens_per_s: float | None = None
    requests_sent: int = 0
    reads: tuple[Read, ...] = ()
    answer: Answer | None = None
    longest_step: LongestStep | None = None  # what is known of the engine's steps now
    # False when llmhealth could not examine the backend (our own failure or starvation):
    # no verdict on the server at all, so it moves nothing and a run says UNKNOWN for it.
    judged: bool = True


Decision = Verdict | TakeRead | SendTinyRequest


@dataclass(frozen=True, slots=True)
class Target:
    """Something to check: a backend (read directly) or a proxy (asked /v1/models only)."""

    name: str
    url: str
    kind: str = "backend"
    api_key: str | None = field(default=None, repr=False)  # a secret: never in a repr
    model: str | None = None
    rules: WedgeRules = DEFAULT_RULES  # this backend's wedge window rules
    cgroup: str | None = None  # where its processes' CPU time is, when not by its port


@dataclass(frozen=True, slots=True)
class Outcome:
    target: Target
    verdict: Verdict


def decide(
    reads: Sequence[Read],
    answer: Answer | None = None,
    *,
    max_reads: int = 3,
    baseline: Signals | None = None,
    learned: LongestStep | None = None,
    rules: WedgeRules = DEFAULT_RULES,
    answer_wanted: bool = False,
    paced_wait: float = 0.0,
) -> Decision:
    """The next step for one backend, given its reads in order and the tiny request if sent.

    ``max_reads`` bounds a run (three reads are two waits, the least that proves a wedge;
    a longer window needs more). ``baseline`` is what an earlier run last read from this
    backend: it can only reveal a restart between runs; progress is never measured across
    runs. ``learned`` is the longest step earlier runs saw this backend take.
    ``answer_wanted`` says the caller's ledger waits for an answered tiny request (a
    STALE backend re-enters only by one): an engine with nothing to do is then asked even
    though its counters moved, or someone else's requests, each landing between two of
    our reads, would keep it out for as long as they come.
    ``paced_wait``: the period of a caller that reads on a schedule (``watch``), where a
    read answered late is followed at once by the next one on time. Two waits are then
    counted in reads but may have lasted one: a freeze proves a wedge only once it spans
    ``PACED_SPAN`` such waits (``watch``'s reading tasks and the library's ``Prober``).
    0 (``check``): the caller waits its full interval after each answer, so every two
    reads are two waits apart.
    """
    if not reads:
        return TakeRead("first read")
    known = learned_step(reads, learned)
    freeze = _Freeze(known, rules, PACED_SPAN * paced_wait)
    decision = _decide(reads, answer, max_reads, baseline, freeze, answer_wanted)
    if isinstance(decision, SendTinyRequest) and (asleep := asleep_now(reads, baseline)):
        # A completion sent to a server asleep on purpose crashed it (vLLM #15483), and a
        # data-parallel server routes it to any engine with nothing queued, asleep or not.
        # A new process is news, but unproven without an answer (as when our key is
        # refused); an engine with nothing to do beside a sleeping one is idle as shown.
        # Asleep until a read shows it awake (as the router keeps it): a /metrics that
        # failed since (HTTP 503) made it "no metrics", and it was sent the request.
        unasked = left_unasked(reads, decision, f"asleep on purpose ({asleep})")
        unproven = (VerdictKind.RESTARTED, VerdictKind.NO_METRICS)
        return replace(unasked, healthy=decision.good not in unproven)
    if isinstance(decision, SendTinyRequest) and (work := work_shown(reads)):
        # A /metrics that failed since (HTTP 503, past the size cap) shows no work gone:
        # asked, the request queued behind it, timed out, and a busy backend was failed
        # for the check's own request. Unproven, as a server asleep is, until a read shows.
        unasked = left_unasked(reads, decision, f"the last read with vLLM series showed {work}")
        return replace(unasked, healthy=False)
    if isinstance(decision, Verdict):
        return replace(decision, longest_step=longer(known, _learned_before_restarts(reads)))
    return decision


def asleep_now(reads: Sequence[Read], baseline: Signals | None) -> str:
    """The engines asleep on purpose in the newest signals with vLLM series (of these
    reads, else the earlier run's), for evidence; "" when none, or when a read after
    them shows another process: a new process starts awake. Kept asleep, one without
    vLLM series (vLLM started again with --disable-log-stats, another server) was never
    asked, routed to nor re-admitted, since no read would ever show it awake."""
    newest = newest_vllm_read(reads)
    sleeper = baseline if newest is None else reads[newest].signals
    asleep = asleep_engines(sleeper)
    if not asleep or sleeper is None or sleeper.process_start is None:
        return asleep
    for read in reads if newest is None else reads[newest + 1 :]:
        start = read.signals.process_start if read.signals is not None else None
        if start is not None and start != sleeper.process_start:
            return ""
    return asleep


def work_shown(reads: Sequence[Read]) -> str:
    """The work the read before the newest showed on an awake engine, for evidence, when
    the newest has no vLLM series; "" otherwise. No request goes to a backend with work,
    and one failed read after it does not show the work gone. Only one: a server whose
    /metrics keeps failing (restarted without metrics, past the size cap) is asked at the
    next, or a window keeping its last busy read never asked it again. None when the
    newest shows another process (its start time, without vLLM series): a new one starts
    with no work, as it starts awake (``asleep_now``)."""
    if len(reads) < 2 or _has_vllm(reads[-1]) or not _has_vllm(reads[-2]):
        return ""
    shown, newest = _signals(reads[-2]), reads[-1].signals
    start = newest.process_start if newest is not None else None
    if start is not None and shown.process_start not in (None, start):
        return ""
    return _describe_work(shown) if _had_work(reads[-2]) else ""


def newest_vllm_read(reads: Sequence[Read]) -> int | None:
    """The index of the newest read with vLLM series; None without one. Such a read
    showing an engine asleep keeps it unasked (``decide``), so a window keeps it too."""
    for index in range(len(reads) - 1, -1, -1):
        if _has_vllm(reads[index]):
            return index
    return None


def _learned_before_restarts(reads: Sequence[Read]) -> LongestStep | None:
    """The longest step the processes these reads saw restart had recorded: their last
    texts' histograms. Only the newest process's were taken, and a long step the old one
    had just recorded was lost with it, though the hardware stays (``fleet.Sighting``).
    So too where a process started its series again (a counter gone down under the same
    start time: vLLM's stat loggers made anew as elastic EP scales up), its histograms
    with them."""
    readable = [_signals(read) for read in reads if _has_vllm(read)]
    best = None
    for older, newer in itertools.pairwise(readable):
        if older is not newer and (restarted_between(older, newer) or _went_down(older, newer)):
            best = longer(best, longest_step(older))
    return best


def _went_down(older: Signals, newer: Signals) -> bool:
    """Any engine's counter is lower in ``newer`` than in ``older``."""
    return any(
        _counter_went_down(before, after) for _, before, after in _engine_pairs(older, newer)
    )


def _counter_went_down(before: EngineSignals, after: EngineSignals) -> bool:
    earlier = before.counters
    return any(value < earlier.get(name, value) for name, value in after.counters.items())


def reads_still_needed(reads: Sequence[Read]) -> int:
    """How many of the newest reads a later decision can still look at, where the reads
    slide past (``watch`` keeps each backend's across its cycles).

    A decision looks back over the current freeze of any engine (and the read before it);
    over the two newest reads with vLLM series (a restart between them; the newest one's
    process age, histograms and work), however many failed reads lie between; over a
    restart not yet judged (``watch`` starts afresh at a ``restarted`` verdict, so one
    still in the window was followed by a failure instead); and over a few reads whatever
    they are: one wait's progress, a first baseline, a restart just seen.

    Older reads say nothing more, and kept they did harm: counted against ``max_reads``
    they made a freeze of one wait look as if it had used up ``max_check_time`` once the
    daemon had run that long (``stalled`` where its first minutes said "not decided",
    ``unanswered`` where they took one more read), and each busy engine held 61 reads.
    """
    last = _signals(reads[-1]) if reads else Signals()
    streak = max((_stall_streak(reads, engine.engine) for engine in last.engines), default=0)
    at_least = max(_TWO_WAITS + 1, streak + 2)
    if at_least >= len(reads):
        return at_least  # a freeze as long as the window keeps all of it: no more to look for
    readable = [index for index, read in enumerate(reads) if _has_vllm(read)]
    keep_from = readable[-2:][0] if readable else len(reads)
    if len(readable) < len(reads) and readable:
        # A failed read in the window: a freeze the newest readable read ends may go on
        # across it at a later read (``_stall_streak``), back to its own beginning.
        newest = readable[-1]
        before = reads[: newest + 1]
        engines = _signals(reads[newest]).engines
        held = max(
            (_stall_streak(before, engine.engine, newest_wait_read=False) for engine in engines),
            default=0,
        )
        keep_from = min(keep_from, max(0, newest - held - 1))
    restart = _last_restart(reads, None)
    if restart is not None:
        keep_from = min(keep_from, readable[readable.index(restart[0]) - 1])
    return max(at_least, len(reads) - keep_from)


def freeze_began(reads: Sequence[Read]) -> int | None:
    """The index of the first read of the longest freeze the newest readable read ends
    (work, no progress, the same process), across failed reads; None without one.

    ``watch`` keeps it when the freeze outgrows its reads (``probe.keep_read``): a freeze
    is proven once it outlasts its window, and a window longer than the reads span (a
    learned 218 s step: a window of 654 s, past ``max_check_time``) was never covered by
    reads that slid past its beginning; the engine was ``stalled`` for ever.
    """
    readable = [index for index, read in enumerate(reads) if _has_vllm(read)]
    if not readable:
        return None
    newest = readable[-1]
    before = reads[: newest + 1]
    held = max(
        (
            _stall_streak(before, engine.engine, newest_wait_read=False)
            for engine in _signals(reads[newest]).engines
        ),
        default=0,
    )
    return newest - held if held > 0 else None


def asleep_engines(signals: Signals | None) -> str:
    """The engines of a read put to sleep on purpose, for evidence; "" when none. No
    request goes to such a server (``decide``, the router's set): a completion sent to a
    sleeping vLLM crashed it."""
    if signals is None:
        return ""
    states = [f"engine {e.engine} {e.sleep_state}" for e in signals.engines if e.asleep]
    return _first_few(states, "engines") if states else ""


def _has_vllm(read: Read) -> bool:
    return read.signals is not None and read.signals.has_vllm


def learned_step(reads: Sequence[Read], learned: LongestStep | None) -> LongestStep | None:
    """The longest step known: earlier runs' figure, or what these reads' histograms say."""
    for read in reversed(reads):
        if read.signals is not None and read.signals.has_vllm:
            # Histograms only grow within a process: its newest text knows the most.
            return longer(learned, longest_step(read.signals))
    return learned


def window_for(
    reads: Sequence[Read],
    learned: LongestStep | None,
    rules: WedgeRules = DEFAULT_RULES,
    *,
    since: Read | None = None,
) -> Window:
    """The wedge window that applies to the newest process seen in these reads.

    ``since``: the read the freeze being judged began at; the process's youth is taken
    then, so a step that began inside ``startup_grace`` keeps the startup window to its
    end. On the steady clock where the reads have the process's start on it (``born``).
    """
    age = None
    nothing_finished = False
    for read in reversed(reads):
        if read.signals is not None and read.signals.has_vllm:
            start = read.signals.process_start
            then = read if since is None else since
            if start is None:
                age = None
            elif read.born is not None and then.tick is not None:
                age = then.tick - read.born
            else:
                age = then.at - start
            nothing_finished = not any(engine.finished for engine in read.signals.engines)
            break
    step = learned_step(reads, learned)
    return wedge_window(rules, step, age, nothing_finished=nothing_finished)


@dataclass(frozen=True, slots=True)
class _Freeze:
    """What decides how long a freeze may last: the step known and the configured rules."""

    learned: LongestStep | None
    rules: WedgeRules
    least_span: float = 0.0  # seconds two waits must have lasted (``decide``'s paced_wait)


def _decide(
    reads: Sequence[Read],
    answer: Answer | None,
    max_reads: int,
    baseline: Signals | None,
    freeze: _Freeze,
    answer_wanted: bool,
) -> Decision:
    last = reads[-1]
    if last.problem is ReadProblem.DOWN:
        return _verdict(VerdictKind.DOWN, False, f"down: {last.detail}", reads)
    if last.problem is ReadProblem.UNRESPONSIVE:
        return _verdict(VerdictKind.UNRESPONSIVE, False, f"unresponsive: {last.detail}", reads)

    restart = _last_restart(reads, baseline)
    if restart is not None:
        index, before, across_runs = restart
        change = _describe_restart(before, _signals(reads[index]), across_runs)
        return _judge_restarted(reads, index, change, answer, max_reads)
    if last.signals is None or not last.signals.has_vllm:
        why = last.detail or "the text has no vLLM series"
        return _by_answer(
            reads, answer, VerdictKind.NO_METRICS, VerdictKind.NO_METRICS, f"no metrics ({why})"
        )
    return _judge_work(reads, answer, max_reads, freeze, answer_wanted)


def judge_proxy(ok: bool, detail: str, models: Sequence[str]) -> Verdict:
    """A proxy is only asked GET /v1/models: its /metrics may be any backend's, or its own."""
    if ok and models:
        return Verdict(VerdictKind.UP, True, _first_few(models, "models", "up: /v1/models lists "))
    return Verdict(VerdictKind.DOWN, False, f"down: {detail or '/v1/models lists no model'}")


# --- work and progress -------------------------------------------------------------


def _judge_work(
    reads: Sequence[Read],
    answer: Answer | None,
    max_reads: int,
    freeze: _Freeze,
    answer_wanted: bool,
) -> Decision:
    last_signals = _signals(reads[-1])
    awake = [engine for engine in last_signals.engines if not engine.asleep]
    if not awake:
        states = _first_few(
            [f"engine {e.engine} {e.sleep_state}" for e in last_signals.engines], "engines"
        )
        return _verdict(
            VerdictKind.IDLE, True, f"idle: asleep on purpose ({states}); no request sent", reads
        )
    working = [engine for engine in awake if (engine.work or 0) > 0]
    # Unknown work on one engine must not open the door to a request while another
    # engine shows work: only when no engine shows any is the tiny request the judge.
    if not working and any(engine.work is None for engine in awake):
        if len(reads) >= 2:
            busy = _healthy_if_progressing(reads, answer=answer)
            if busy is not None:
                return busy
        return _ask_or_doubt(
            reads,
            answer,
            max_reads,
            freeze,
            "work unknown: the running/waiting gauges are absent "
            "(several API servers publish them only after their first request)",
        )

    if not working:
        if len(reads) >= 2:
            previous = _previous_readable(reads)
            had_work = previous is not None and _had_work(previous)
            kind = VerdictKind.BUSY if had_work else VerdictKind.IDLE
            progressed = _healthy_if_progressing(reads, kind, answer)
            if _failed_after(answer, reads[-1]):
                # Asked because an answer is wanted, it failed: what moved before it went
                # out says nothing of it. Taken as healthy, a replacement failing every
                # request counted towards recovery in place, its failures never counted.
                progressed = None
            if progressed is not None and answer is None and answer_wanted:
                wanted = "an answer is wanted to re-admit it"
                return SendTinyRequest(f"no work ({_describe_work(last_signals)}); {wanted}", kind)
            if progressed is not None:
                return progressed
        return _ask_or_doubt(
            reads, answer, max_reads, freeze, f"no work ({_describe_work(last_signals)})"
        )
    if len(reads) < 2:
        return TakeRead(f"{_describe_work(last_signals)}: watching for progress over one wait")

    streaks = {engine.engine: _stall_streak(reads, engine.engine) for engine in working}
    worst = max(streaks, key=lambda name: (streaks[name], name))
    if streaks[worst] >= 2:
        return _judge_freeze(reads, worst, streaks[worst], max_reads, freeze, answer)
    if streaks[worst] == 1:
        if len(reads) < max_reads:
            return TakeRead(f"engine {worst}: no progress over one wait; one more wait decides")
        return _verdict(VerdictKind.STALLED, False, _stall_evidence(reads, worst), reads, answer)
    # With the tiny request that timed out before work showed, if one did: it was sent.
    busy = _healthy_if_progressing(reads, answer=answer)
    if busy is not None:
        return busy
    # Work appeared on an engine with no comparable read before it (new engine, or work
    # that arrived during the wait): no baseline yet, so no doubt either. The next read
    # gives one; only a frozen engine's window may take a run past three reads.
    # Counted from the work's first read: a watch window holds the idle reads before it,
    # and the same read was ``stalled`` there at once, where a check reads once more.
    previous = _previous_readable(reads)
    appeared = previous is not None and not _had_work(previous)
    if len(reads) < min(max_reads, _TWO_WAITS) or (appeared and len(reads) < max_reads):
        return TakeRead(f"{_describe_work(last_signals)}: no baseline to compare yet")
    return _verdict(
        VerdictKind.STALLED,
        False,
        f"stalled: {_describe_work(last_signals)}, and no engine progressed in the last wait",
        reads,
        answer,
    )


def _judge_freeze(
    reads: Sequence[Read],
    worst: str,
    streak: int,
    max_reads: int,
    freeze: _Freeze,
    answer: Answer | None = None,
) -> Decision:
    """Two or more waits without progress: proof once the freeze outlasts the window.

    CPU time settles it sooner only one way: engine processes that used none over two
    waits are stopped or deadlocked, whatever their window; CPU used proves nothing.
    """
    frozen = reads[-1 - streak :]
    elapsed = _stood_still(frozen)
    window = window_for(reads, freeze.learned, freeze.rules, since=frozen[0])
    if elapsed < freeze.least_span:
        # A read answered late and the next on schedule: the reads of two waits came
        # within about one (a slow server's /metrics, under load), and 2 s of freeze at
        # a 2 s wait proved a wedge. The next read on schedule settles it.
        squeezed = f"less than {freeze.least_span:g} s of waits"
        if len(reads) < max_reads:
            return TakeRead(
                f"engine {worst}: no progress over {streak} reads in {elapsed:.1f} s, {squeezed}"
            )
        return _stalled(reads, worst, streak, elapsed, squeezed, answer)
    # The shell samples CPU only once a long window makes it worth its cost, so the
    # samples may start after the freeze did: they must span two waits of it themselves.
    sampled = [read.cpu for read in frozen if read.cpu is not None]
    used = cpu_used(sampled[0], sampled[-1]) if len(sampled) >= 3 else None
    apart = 0.0
    if used is not None:
        first = next(read for read in frozen if read.cpu is not None)
        apart = cpu_span(sampled[0], sampled[-1], _apart(first, frozen[-1]))
    cpu_text = "" if used is None else f"; {describe_cpu(used, apart)}"
    # A process stopped throughout is named first: it says which process to look at and
    # why, where "no CPU" alone fits a deadlock too. Which of the two a stopped engine
    # core shows must not hang on how much its workers happened to poll meanwhile.
    stopped = stopped_throughout(sampled) if len(sampled) >= 3 else ()
    if stopped:
        why = (
            f"no wait beyond two: engine process {', '.join(map(str, stopped))} stayed stopped "
            "by a signal (state T) throughout"
        )
        return _verdict(
            VerdictKind.WEDGED, False, _wedge_evidence(frozen, worst, why + cpu_text), reads, answer
        )
    if used is not None and cpu_was_idle(used, apart):
        why = "no wait beyond two: the engine is doing nothing"
        return _verdict(
            VerdictKind.WEDGED, False, _wedge_evidence(frozen, worst, why + cpu_text), reads, answer
        )
    if elapsed >= window.seconds:
        return _verdict(
            VerdictKind.WEDGED,
            False,
            _wedge_evidence(frozen, worst, _window_text(window, frozen) + cpu_text),
            reads,
            answer,
        )
    if len(reads) < max_reads:
        return TakeRead(
            f"engine {worst}: no progress for {elapsed:.1f} s, inside its window "
            f"{window.seconds:g} s ({window.why}){cpu_text}"
        )
    short = f"short of its window {window.seconds:g} s ({window.why}){cpu_text}"
    return _stalled(reads, worst, streak, elapsed, short, answer)


def _stood_still(frozen: Sequence[Read]) -> float:
    """How long an engine surely stood still over reads that all show it as it was: from
    the first one's arrival to when the newest was asked for. Both taken on arrival, a
    loop that took the newest in seconds late (its lateness forgiven by the read's
    deadline) stretched a 7 s freeze past the 7.5 s two waits need, and into a wedge."""
    newest, first = frozen[-1], frozen[0]
    if newest.tick is not None and first.tick is not None:  # the steady clock (Read.tick)
        asked = newest.tick if newest.sent_tick is None else newest.sent_tick
        return asked - first.tick
    asked = newest.at if newest.sent is None else newest.sent
    return asked - first.at


def _apart(earlier: Read | Answer, later: Read | Answer) -> float:
    """Seconds from ``earlier`` to ``later``: on the steady clock where both were stamped
    on it (``Read.tick``), as a wall clock may step between them."""
    if earlier.tick is not None and later.tick is not None:
        return later.tick - earlier.tick
    return later.at - earlier.at


def _stalled(
    reads: Sequence[Read],
    worst: str,
    streak: int,
    elapsed: float,
    short_of: str,
    answer: Answer | None = None,
) -> Verdict:
    """A freeze the reads ran out on before it proved anything (``short_of``: what it
    did not yet reach)."""
    return _verdict(
        VerdictKind.STALLED,
        False,
        f"stalled: engine {worst} had work and made no progress over {streak} waits "
        f"({elapsed:.1f} s), {short_of}; this run's reads ran out first (max_check_time); "
        "not yet proof",
        reads,
        answer,
    )


def _window_text(window: Window, frozen: Sequence[Read]) -> str:
    two_waits = _stood_still(frozen[:3])
    if window.seconds >= two_waits:
        return f"window {window.seconds:g} s: {window.why}"
    if window.extended:
        return f"window two waits ({two_waits:.1f} s), longer than {window.why}"
    return "window two waits: no long step known"


def _ask_or_doubt(
    reads: Sequence[Read], answer: Answer | None, max_reads: int, freeze: _Freeze, context: str
) -> Decision:
    """No work shown: the tiny request judges, unless it timed out behind a long step.

    vLLM publishes its gauges when a step ends, so an engine inside a long first step
    shows no work while it computes, and the tiny request queues behind it. A timeout
    then proves nothing about an engine whose window is longer than the request waited
    (known long steps, a young process, a floor) while no counter moved: that is doubt,
    not ``unanswered``, unless its processes used no CPU meanwhile, or no read is left to
    show whether it moved (the reads a check may take ran out at the answer).
    """
    if answer is None or answer.ok or not answer.timed_out:
        return _by_answer(reads, answer, VerdictKind.IDLE, VerdictKind.UNANSWERED, context)
    asked_after = [read for read in reads if _apart(read, answer) >= 0]
    # The process's youth when the request was sent, as a freeze keeps the youth it began
    # with: a young engine's first step is no less long once the process turns old.
    since = asked_after[-1] if asked_after else None
    window = window_for(reads, freeze.learned, freeze.rules, since=since)
    waited = _apart(asked_after[-1], answer) if asked_after else 0.0
    # Only a window longer than the request waited can excuse the timeout (a step that
    # long may hold it); otherwise the engine should have answered at once.
    if not window.seconds > waited:
        return _by_answer(reads, answer, VerdictKind.IDLE, VerdictKind.UNANSWERED, context)
    if _apart(reads[-1], answer) >= 0:
        if len(reads) < max_reads:
            return TakeRead("the tiny request timed out: one more read shows if the engine moved")
        return _by_answer(reads, answer, VerdictKind.IDLE, VerdictKind.UNANSWERED, context)
    asked = asked_after[-1] if asked_after else reads[0]
    elapsed = _apart(asked, reads[-1])
    used = cpu_used(asked.cpu, reads[-1].cpu)
    apart = elapsed
    if asked.cpu is not None and reads[-1].cpu is not None:
        apart = cpu_span(asked.cpu, reads[-1].cpu, elapsed)
    cpu_text = "" if used is None else f"; {describe_cpu(used, apart)}"
    held = [read.cpu for read in (asked, reads[-1]) if read.cpu is not None]
    stopped = stopped_throughout(held) if len(held) == 2 else ()
    if stopped:  # named before "no CPU", as in _judge_freeze
        return _by_answer(
            reads,
            answer,
            VerdictKind.IDLE,
            VerdictKind.UNANSWERED,
            f"{context}; engine process {', '.join(map(str, stopped))} stopped by a signal"
            f"{cpu_text}",
        )
    if used is not None and cpu_was_idle(used, apart):
        # No CPU used while holding our request: not inside a step, but stuck.
        return _by_answer(
            reads, answer, VerdictKind.IDLE, VerdictKind.UNANSWERED, context + cpu_text
        )
    return _verdict(
        VerdictKind.STALLED,
        False,
        f"stalled: {context}; tiny request {answer.detail}, and no counter moved over "
        f"{elapsed:.1f} s; an engine inside one long step shows no work and answers late "
        f"(window {window.seconds:g} s: {window.why}{cpu_text}); not proof of a failure",
        reads,
        answer,
    )


def _healthy_if_progressing(
    reads: Sequence[Read], kind: VerdictKind = VerdictKind.BUSY, answer: Answer | None = None
) -> Verdict | None:
    """Healthy when any engine advanced over the last wait; work that just finished counts.

    ``kind`` IDLE is for a backend with no work before or after whose engine still
    stepped: alive and idle, proven without spending a request (or with one that timed
    out while the engine moved: queued, not ignored).
    """
    previous = _previous_readable(reads)
    if previous is None:
        return None
    # Across a failed read (judged on its own): counters only grow within a process, and
    # a restart between the two was judged before this (``_last_restart``).
    before, after = _signals(previous), _signals(reads[-1])
    elapsed = _apart(previous, reads[-1])
    moved = [
        name for name, older, newer in _engine_pairs(before, after) if _progressed(older, newer)
    ]
    if not moved:
        return None
    steps = _delta_sum(before, after, "steps")
    tokens = _delta_sum(before, after, "generation_tokens")
    steps_rate = steps / elapsed if elapsed > 0 else None
    tokens_rate = tokens / elapsed if elapsed > 0 else None
    rate_text = ""
    if steps_rate is not None and tokens_rate is not None:
        rate_text = f", {steps_rate:.1f} steps/s, {tokens_rate:.1f} tokens/s"
    asked = "no request sent" if answer is None else f"tiny request {answer.detail}"
    evidence = (
        f"{kind}: {_describe_work(before)} then {_describe_work(after)}; "
        f"{_first_few(moved, 'engines', prefix='engine ')} progressed over {elapsed:.1f} s "
        f"({_describe_deltas(before, after)}){rate_text}; {asked}"
    )
    return _verdict(
        kind, True, evidence, reads, answer, steps_per_s=steps_rate, tokens_per_s=tokens_rate
    )


def _failed_after(answer: Answer | None, newest: Read) -> bool:
    """The tiny request failed, and no read was taken since it was answered: nothing
    shows the engine moved while it held the request (a key turned away is no failure
    of the engine)."""
    return (
        answer is not None and not answer.ok and not answer.refused and _apart(newest, answer) >= 0
    )


def _previous_readable(reads: Sequence[Read]) -> Read | None:
    """The newest read with vLLM series before the newest read."""
    for read in reversed(reads[:-1]):
        if _has_vllm(read):
            return read
    return None


def _had_work(read: Read) -> bool:
    signals = _signals(read)
    return any((engine.work or 0) > 0 for engine in signals.engines if not engine.asleep)


def _stall_streak(reads: Sequence[Read], engine_name: str, *, newest_wait_read: bool = True) -> int:
    """How many of the latest waits in a row this engine had work and made no progress.

    A read that failed earlier in a freeze (a /metrics timeout) ends nothing: counters
    only grow within a process, so the readable reads either side of it still show
    whether the engine progressed across it. It ended the freeze before, so a wedge read
    through an occasional timeout was never proven once its window was longer than the
    gap between two failures. But the newest wait must be read at both ends: the API
    server that did not answer may have been held up, and with it the counters it keeps,
    which then catch up at a later read; and only the same process on both sides of a
    gap counts (a new start time, or none to compare in vLLM's multiprocess mode, ends
    the freeze there). ``newest_wait_read`` False: a freeze as a later read may find it,
    the newest wait's gap crossed as well.
    """
    streak = 0
    newer_index = len(reads) - 1
    for index in range(len(reads) - 2, -1, -1):
        if not _has_vllm(reads[index]):
            if streak == 0 and newest_wait_read:
                break  # the newest wait was not read at both ends
            continue  # an earlier failed read: compared across
        older_signals, newer_signals = _signals(reads[index]), _signals(reads[newer_index])
        older = older_signals.engine(engine_name)
        newer = newer_signals.engine(engine_name)
        if older is None or newer is None or older.asleep or newer.asleep:
            break
        if not (older.work or 0) > 0 or not (newer.work or 0) > 0:
            break
        across_a_gap = index < newer_index - 1
        start = newer_signals.process_start
        if across_a_gap and (start is None or older_signals.process_start != start):
            break
        if _progressed(older, newer) or not _measurable(older, newer):
            break
        streak = len(reads) - 1 - index
        newer_index = index
    return streak


def _measurable(older: EngineSignals, newer: EngineSignals) -> bool:
    """Whether two reads of an engine can show a freeze at all: a counter in both.
    Gauges alone (a text whose counters were filtered out or lost) showed none ever, and
    a busy engine whose waiting went 8 -> 4 was "wedged" in two waits. The KV use shows
    progress when it moves, but a busy engine's may stand still over waits (prefill2:
    100 steps a wait at one KV use), so without a counter it proves no freeze."""
    if older.steps is not None and newer.steps is not None:
        return True  # every vLLM text has it: no dict built for a frozen window's walk
    if older is newer:
        return bool(older.counters)
    return not older.counters.keys().isdisjoint(newer.counters)


def _progressed(older: EngineSignals, newer: EngineSignals) -> bool:
    """Any engine step, token, finished request or preemption, or a KV cache change.

    Output tokens alone would miss a long prompt being read: vLLM emits nothing then,
    but its KV use moves every step. A counter gone down counts too: two reads compared
    here are of one process (a restart was judged first), and vLLM starts every counter
    again from 0 in the same process when elastic EP scales up (its stat loggers are
    made anew), work in flight; what they show then was counted since. Taken for "did
    not rise", that wait was a frozen one, and one long step after it proved a wedge.
    """
    if older is newer:
        # A watch window's reads share one object while nothing changed (``keep_read``):
        # a frozen engine's whole window is walked at every read of it, twice (to decide,
        # and to know which reads to keep), and each step would build both dicts below.
        return False
    # ``counters`` builds a dict: once per side, not once per counter.
    before = older.counters
    for name, value in newer.counters.items():
        previous = before.get(name)
        if previous is not None and value != previous:
            return True
    return (
        older.kv_usage is not None
        and newer.kv_usage is not None
        and older.kv_usage != newer.kv_usage
    )


# --- restarts ----------------------------------------------------------------------


def _last_restart(
    reads: Sequence[Read], baseline: Signals | None
) -> tuple[int, Signals, bool] | None:
    """The last read that came from another process than the readable one before it.

    The last, not the first: after two restarts only the newest process's reads are its
    own, and counters of two processes are never compared. Returns that read's index, the
    signals it was compared with, and whether those were the earlier run's baseline.
    """
    readable: list[tuple[int, Signals]] = [
        (index, read.signals)
        for index, read in enumerate(reads)
        if read.signals is not None and read.signals.has_vllm
    ]
    if baseline is not None and baseline.has_vllm:
        readable.insert(0, (-1, baseline))
    last = None
    for (older_index, older), (index, newer) in itertools.pairwise(readable):
        if restarted_between(older, newer):
            last = (index, older, older_index < 0)
    return last


def answered_another_process(reads: Sequence[Read]) -> bool:
    """The newest read, taken after the tiny request was answered (one that timed out
    asks for one more read), shows another process than the readable read before it: the
    answer was the old process's. Judged by it, a new process never asked "failed the
    tiny request" (``restarted``, CRITICAL); it is asked its own."""
    previous = _previous_readable(reads)
    if previous is None or not reads or not _has_vllm(reads[-1]):
        return False
    return restarted_between(_signals(previous), _signals(reads[-1]))


def restarted_between(older: Signals, newer: Signals) -> bool:
    """Start time changed; without start times (multiprocess mode), a counter went down.

    A start time present in only one of the two texts proves nothing by itself (a body
    cut short loses it too), so then the counters decide.
    """
    if older.process_start is not None and newer.process_start is not None:
        return older.process_start != newer.process_start
    return _went_down(older, newer)


def _judge_restarted(
    reads: Sequence[Read],
    restart: int,
    change: str,
    answer: Answer | None,
    max_reads: int,
) -> Decision:
    """A new process is judged on its own reads only, never against the old one's counters."""
    since = reads[restart:]
    last = _signals(since[-1]) if since[-1].signals is not None else None
    if last is None or not last.has_vllm:
        why = since[-1].detail or "no vLLM series"
        return _by_answer(
            reads, answer, VerdictKind.RESTARTED, VerdictKind.RESTARTED, f"{change}; then {why}"
        )
    awake = [engine for engine in last.engines if not engine.asleep]
    has_work = any((engine.work or 0) > 0 for engine in awake)
    if not has_work:
        return _by_answer(
            reads,
            answer,
            VerdictKind.RESTARTED,
            VerdictKind.RESTARTED,
            f"{change}; the new process shows {_describe_work(last)}",
        )
    if len(since) >= 2:
        # With the tiny request that timed out before the new process showed work, if
        # one did: it was sent.
        busy = _healthy_if_progressing(since, answer=answer)
        if busy is not None:
            return Verdict(
                VerdictKind.RESTARTED,
                True,
                f"restarted: {change}; the new process is {busy.evidence}",
                busy.running,
                busy.waiting,
                busy.steps_per_s,
                busy.tokens_per_s,
                requests_sent=busy.requests_sent,
                reads=tuple(reads),
                answer=answer,
            )
    # One wait of the new process's own reads, as before a wedge window existed: a run
    # that may read for minutes must not wait them out before it says "restarted".
    if len(since) < 2 and len(reads) < min(max_reads, _TWO_WAITS + 1):
        return TakeRead(f"{change}; the new process has work: judging it from a fresh baseline")
    return _verdict(
        VerdictKind.RESTARTED,
        False,
        f"restarted: {change}; the new process shows {_describe_work(last)} and no progress yet",
        reads,
        answer,
    )


# --- shared pieces -----------------------------------------------------------------


def _by_answer(
    reads: Sequence[Read],
    answer: Answer | None,
    good: VerdictKind,
    bad: VerdictKind,
    context: str,
) -> Decision:
    if answer is None:
        return SendTinyRequest(context, good)
    if answer.refused:
        # Our key, not the server: a rotated or missing one read as "unanswered" condemned
        # every idle backend of a fleet. Not judged, so a run says UNKNOWN and nothing
        # moves; a new process (RESTARTED) is news all the same, and is judged (unproven).
        evidence = (
            f"{good}: {context}; tiny request {answer.detail}: the server turned our API key "
            "away (see api_key_env), so nothing is proven either way"
        )
        verdict = _verdict(good, False, evidence, reads, answer)
        return verdict if good is VerdictKind.RESTARTED else replace(verdict, judged=False)
    kind = good if answer.ok else bad
    return _verdict(
        kind, answer.ok, f"{kind}: {context}; tiny request {answer.detail}", reads, answer
    )


def left_unasked(reads: Sequence[Read], decision: SendTinyRequest, why: str) -> Verdict:
    """The verdict of a read whose tiny request a caller may not send, ``why`` said.

    Healthy as far as /metrics shows, with no answer, as a busy verdict is: it proves
    nothing only an answer proves (no re-admission, no recovery in place, no request
    failure cleared), and its evidence says why nothing was asked.
    """
    return _verdict(
        decision.good, True, f"{decision.good}: {decision.reason}; no request sent: {why}", reads
    )


def _verdict(
    kind: VerdictKind,
    healthy: bool,
    evidence: str,
    reads: Sequence[Read],
    answer: Answer | None = None,
    *,
    steps_per_s: float | None = None,
    tokens_per_s: float | None = None,
) -> Verdict:
    running, waiting = _work_counts(reads)
    return Verdict(
        kind,
        healthy,
        evidence,
        running,
        waiting,
        steps_per_s,
        tokens_per_s,
        requests_sent=1 if answer is not None and answer.sent else 0,
        reads=tuple(reads),
        answer=answer,
    )


def _work_counts(reads: Sequence[Read]) -> tuple[int | None, int | None]:
    for read in reversed(reads):
        if read.signals is not None and read.signals.has_vllm:
            engines = read.signals.engines
            if any(engine.running is None for engine in engines):
                return None, None
            return (
                _whole(sum(engine.running or 0 for engine in engines)),
                _whole(sum(engine.waiting or 0 for engine in engines)),
            )
    return None, None


def _whole(total: float) -> int | None:
    """A count as a whole number; None past what a float holds: engines' gauges of 1e308
    each add up to inf, whose int() raised and left a wedged engine beside them unjudged."""
    return int(total) if math.isfinite(total) else None


def _signals(read: Read) -> Signals:
    return read.signals if read.signals is not None else Signals()


def _engine_pairs(older: Signals, newer: Signals) -> list[tuple[str, EngineSignals, EngineSignals]]:
    pairs = []
    for engine in newer.engines:
        before = older.engine(engine.engine)
        if before is not None:
            pairs.append((engine.engine, before, engine))
    return pairs


def _delta_sum(older: Signals, newer: Signals, counter: str) -> float:
    total = 0.0
    for _, before, after in _engine_pairs(older, newer):
        previous, current = before.counters.get(counter), after.counters.get(counter)
        if previous is not None and current is not None and current > previous:
            total += current - previous
    return total


def _describe_work(signals: Signals) -> str:
    running, waiting = _work_counts([Read(0.0, signals)])
    if running is None:
        return "work unknown"
    deferred = _whole(sum(engine.waiting_deferred or 0 for engine in signals.engines))
    if deferred:
        return f"{running} running, {waiting} waiting ({deferred} deferred by vLLM: not work)"
    return f"{running} running, {waiting} waiting"


def _describe_deltas(older: Signals, newer: Signals) -> str:
    parts = []
    for label, counter in (
        ("steps", "steps"),
        ("generated", "generation_tokens"),
        ("prompt", "prompt_tokens"),
        ("finished", "finished"),
        ("preempted", "preemptions"),
    ):
        delta = _delta_sum(older, newer, counter)
        if delta:
            parts.append(f"{label} +{delta:g}")
    kv_moves = [
        f"kv {before.kv_usage:.4f}→{after.kv_usage:.4f}"
        for _, before, after in _engine_pairs(older, newer)
        if before.kv_usage is not None
        and after.kv_usage is not None
        and before.kv_usage != after.kv_usage
    ]
    if len(kv_moves) > 1:
        kv_moves = [f"kv moved on {len(kv_moves)} engines"]
    if parts or kv_moves:
        return ", ".join(parts + kv_moves)
    # Progress without a rise (``_progressed``): the same process started its counters
    # again. Looked for only then: a busy verdict's evidence is built at every read.
    again = [
        f"engine {name}"
        for name, before, after in _engine_pairs(older, newer)
        if _counter_went_down(before, after)
    ]
    if again:
        return _first_few(again, "engines", "counters started again in the same process on ")
    return "no counter moved"


def _first_few(items: Sequence[str], what: str, prefix: str = "") -> str:
    """A list for evidence, cut after a few: the rest are counted, not named."""
    if len(items) <= _NAMED_ENGINES:
        return prefix + ", ".join(items)
    shown = ", ".join(items[:_NAMED_ENGINES])
    return f"{prefix}{shown} and {len(items) - _NAMED_ENGINES} more {what}"


def _series(reads: Sequence[Read], engine_name: str, field_name: str) -> str:
    def shown(read: Read) -> str:
        engine = _signals(read).engine(engine_name)
        value = None if engine is None else getattr(engine, field_name)
        return "?" if value is None else f"{value:g}"

    if len(reads) > 4:  # a long window: the ends say it, the middle is counted
        return f"{shown(reads[0])}→{shown(reads[1])}→…({len(reads) - 3} more)…→{shown(reads[-1])}"
    return "→".join(shown(read) for read in reads)


def _wedge_evidence(frozen: Sequence[Read], engine_name: str, window_text: str) -> str:
    elapsed = _stood_still(frozen)
    start = _signals(frozen[-1]).process_start
    same_process = (
        f"start time {start:.2f} unchanged" if start is not None else "no counter went back"
    )
    return (
        f"wedged: engine {engine_name} had work and made no progress over "
        f"{len(frozen) - 1} consecutive waits "
        f"({elapsed:.1f} s): running {_series(frozen, engine_name, 'running')}, "
        f"waiting {_series(frozen, engine_name, 'waiting')}, "
        f"steps {_series(frozen, engine_name, 'steps')}, "
        f"generated {_series(frozen, engine_name, 'generation_tokens')}, "
        f"finished {_series(frozen, engine_name, 'finished')}, "
        f"kv {_series(frozen, engine_name, 'kv_usage')}; {same_process}; engine awake; "
        f"{window_text}"
    )


def _stall_evidence(reads: Sequence[Read], engine_name: str) -> str:
    window = reads[-2:]
    elapsed = _apart(window[0], window[-1])
    return (
        f"stalled: engine {engine_name} had work and made no progress over one wait "
        f"({elapsed:.1f} s): running {_series(window, engine_name, 'running')}, "
        f"steps {_series(window, engine_name, 'steps')}, "
        f"generated {_series(window, engine_name, 'generation_tokens')}; not yet proof"
    )


def _describe_restart(before: Signals, newer: Signals, across_runs: bool) -> str:
    when = "since the last run" if across_runs else "between reads"
    if before.process_start is not None and newer.process_start is not None:
        return (
            f"process start time {_fmt(before.process_start)} → {_fmt(newer.process_start)} {when}"
        )
    return f"counters went down {when} (no start time: Prometheus multiprocess mode)"


def _fmt(value: float | None) -> str:
    return "absent" if value is None else f"{value:.2f}"
