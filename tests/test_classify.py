"""decide() walked like the shell walks it, on real vLLM 0.32 texts given synthetic times."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from llmhealth.classify import (
    Answer,
    Decision,
    Read,
    ReadProblem,
    SendTinyRequest,
    TakeRead,
    Verdict,
    VerdictKind,
    decide,
    freeze_began,
    judge_proxy,
    reads_still_needed,
)
from llmhealth.metrics import EngineSignals, Signals, parse_metrics
from llmhealth.probe import ProbeSettings, keep_read
from llmhealth.report import ExitCode, verdict_exit_code
from llmhealth.window import CpuSample, LongestStep, WedgeRules, longer, longest_step

Load = Callable[[str], str]

T0 = 1_796_100_000.0
WAIT = 5.0
OK_DETAIL = "answered in 0.04 s by model tiny"
FAILED_DETAIL = "timed out after 10.0 s"


# --- building reads ------------------------------------------------------------------


def capture(load: Load, name: str) -> str:
    return load(f"vllm-0.32/{name}.txt")


def relabel(text: str, engine: str) -> str:
    """The vLLM sample lines of a text, moved from engine "0" to another engine."""
    return "\n".join(
        line.replace('engine="0"', f'engine="{engine}"')
        for line in text.splitlines()
        if line.startswith("vllm:")
    )


def set_sample(text: str, name: str, value: str, **labels: str) -> str:
    """Set the value of every sample of ``name`` that carries all the given labels."""
    lines = []
    hits = 0
    for line in text.splitlines():
        head, _, _ = line.rpartition(" ")
        if head.split("{")[0] == name and all(f'{k}="{v}"' in head for k, v in labels.items()):
            lines.append(f"{head} {value}")
            hits += 1
        else:
            lines.append(line)
    assert hits, f"no sample of {name} with {labels}"
    return "\n".join(lines) + "\n"


def asleep(text: str) -> str:
    text = set_sample(text, "vllm:engine_sleep_state", "0.0", sleep_state="awake")
    return set_sample(text, "vllm:engine_sleep_state", "1.0", sleep_state="weights_offloaded")


def timed(texts: Sequence[str], wait: float = WAIT) -> list[Read]:
    return [Read(T0 + index * wait, parse_metrics(text)) for index, text in enumerate(texts)]


def reads_of(load: Load, *names: str, wait: float = WAIT) -> list[Read]:
    return timed([capture(load, name) for name in names], wait)


def problem(kind: ReadProblem, detail: str, at: float = T0) -> Read:
    return Read(at, None, kind, detail)


def answer(ok: bool, at: float = T0 + 100) -> Answer:
    if ok:
        return Answer(at, True, OK_DETAIL, "tiny", ("tiny",))
    return Answer(at, False, FAILED_DETAIL)


def shows_awake_work(read: Read) -> bool:
    if read.signals is None:
        return False
    return any((e.work or 0) > 0 for e in read.signals.engines if not e.asleep)


@dataclass
class Walk:
    """What the shell saw while it followed decide() to a verdict."""

    verdict: Verdict
    reads: list[Read]
    decisions: list[Decision] = field(default_factory=list)
    requests: int = 0


def walk(available: Sequence[Read], answer_ok: bool | None = None, max_reads: int = 3) -> Walk:
    """Drive decide() as the shell does: read when told to, ask when told to.

    ``answer_ok`` None means the walk must never be told to send the tiny request. Every
    walk checks the bounds: at most ``max_reads`` reads, at most one tiny request, and
    none while the latest read shows work on an awake engine.
    """
    taken: list[Read] = []
    decisions: list[Decision] = []
    sent: Answer | None = None
    while True:
        decision = decide(taken, sent, max_reads=max_reads)
        decisions.append(decision)
        if isinstance(decision, Verdict):
            return Walk(decision, taken, decisions, 0 if sent is None else 1)
        if isinstance(decision, TakeRead):
            assert len(taken) < max_reads, f"read {len(taken) + 1} asked for: {decision}"
            assert len(taken) < len(available), f"the walk wanted more reads: {decision}"
            taken.append(available[len(taken)])
        else:
            assert isinstance(decision, SendTinyRequest)
            assert answer_ok is not None, f"a tiny request was asked for: {decision.reason}"
            assert sent is None, "a second tiny request was asked for"
            # The rule that carries the weight: a server that shows work is never asked.
            assert taken, "a tiny request before any read"
            assert not shows_awake_work(taken[-1]), decision.reason
            sent = answer(answer_ok, taken[-1].at + 0.1 if taken else T0)


def settled(decision: Decision) -> Verdict:
    assert isinstance(decision, Verdict), decision
    return decision


def sends_a_request(decisions: Sequence[Decision]) -> bool:
    return any(isinstance(decision, SendTinyRequest) for decision in decisions)


# --- busy ----------------------------------------------------------------------------


def test_a_busy_server_is_never_sent_a_request(fixture_text: Load) -> None:
    result = walk(reads_of(fixture_text, "busy-1", "busy-2"))
    verdict = result.verdict
    assert verdict.kind is VerdictKind.BUSY
    assert verdict.healthy
    assert verdict.requests_sent == 0
    assert verdict.answer is None
    assert (verdict.running, verdict.waiting) == (4, 8)
    # busy-1 → busy-2: steps 998 → 1682, generated 3329 → 6065, over 5 s.
    assert verdict.steps_per_s == pytest.approx(684 / 5)
    assert verdict.tokens_per_s == pytest.approx(2736 / 5)
    assert len(result.reads) == 2
    assert [type(decision) for decision in result.decisions] == [TakeRead, TakeRead, Verdict]


@pytest.mark.parametrize(
    ("names", "kind"),
    [
        (("apifreeze-0", "apifreeze-after"), VerdictKind.IDLE),
        (("busy-1", "busy-after"), VerdictKind.BUSY),
    ],
)
def test_an_engine_that_moved_and_has_no_work_is_asked_only_when_an_answer_is_wanted(
    fixture_text: Load, names: tuple[str, str], kind: VerdictKind
) -> None:
    reads = reads_of(fixture_text, *names)
    unwanted = decide(reads)
    assert isinstance(unwanted, Verdict) and unwanted.kind is kind and unwanted.answer is None
    wanted = decide(reads, answer_wanted=True)
    assert isinstance(wanted, SendTinyRequest) and wanted.good is kind
    answered = decide(reads, answer(True), answer_wanted=True)
    assert isinstance(answered, Verdict) and answered.kind is kind and answered.healthy
    assert answered.answer is not None and "progressed" in answered.evidence
    # Work now is never asked, wanted or not; nor is an engine asleep on purpose.
    busy = reads_of(fixture_text, "busy-1", "busy-2")
    assert isinstance(decide(busy, answer_wanted=True), Verdict)
    sleeping = timed([asleep(capture(fixture_text, name)) for name in names])
    assert isinstance(decide(sleeping, answer_wanted=True), Verdict)


@pytest.mark.parametrize(
    ("names", "kind"),
    [
        (("apifreeze-0", "apifreeze-after"), VerdictKind.IDLE),
        (("busy-1", "busy-after"), VerdictKind.BUSY),
    ],
)
@pytest.mark.parametrize("timed_out", [False, True])
def test_a_wanted_answer_that_failed_is_unanswered_whatever_moved_before_it(
    fixture_text: Load, names: tuple[str, str], kind: VerdictKind, timed_out: bool
) -> None:
    # Asked because an answer is wanted (STALE, or DEAD with request failures), the
    # request failed: the counters had moved before it went out, which says nothing of
    # it. Taken as healthy, a replacement failing every request counted good verdicts
    # towards recovery in place, and its failures were never counted.
    reads = reads_of(fixture_text, *names)
    assert isinstance(decide(reads, answer_wanted=True), SendTinyRequest)
    failed = Answer(reads[-1].at + 0.5, False, "HTTP 500", timed_out=timed_out)
    decision = decide(reads, failed, answer_wanted=True)
    if timed_out and isinstance(decision, TakeRead):
        # A young engine may hold it inside a long step: a read after it tells.
        again = Read(reads[-1].at + WAIT, reads[-1].signals)
        decision = decide([*reads, again], failed, answer_wanted=True)
        assert settled(decision).kind is VerdictKind.STALLED
    else:
        assert settled(decision).kind is VerdictKind.UNANSWERED
    assert not settled(decision).healthy and settled(decision).requests_sent == 1


def test_a_busy_server_shown_from_any_prefix_is_never_sent_a_request(fixture_text: Load) -> None:
    reads = reads_of(fixture_text, "busy-1", "busy-2", "busy-3")
    for end in range(len(reads) + 1):
        assert not isinstance(decide(reads[:end]), SendTinyRequest)


def test_a_busy_server_whose_text_has_legal_blanks_is_busy_without_a_request(
    fixture_text: Load,
) -> None:
    """``name {labels}`` and ``engine = "0"`` are legal text: a busy server written so was
    read as having no vLLM series, and sent the tiny request (``no_metrics``)."""

    def spaced(text: str) -> str:
        return "\n".join(
            line.replace("{", " {", 1).replace('="', ' = "') if line.startswith("vllm:") else line
            for line in text.splitlines()
        )

    reads = timed([spaced(capture(fixture_text, name)) for name in ("busy-1", "busy-2")])
    result = walk(reads)
    assert result.verdict.kind is VerdictKind.BUSY
    assert not sends_a_request(result.decisions)


def test_busy_rates_match_the_capture_summary_at_the_real_times(fixture_text: Load) -> None:
    # The real epochs from INDEX.tsv: 1.56 s apart, at 1,754 generated tokens/s and 438 steps/s.
    reads = [
        Read(1796024490.647, parse_metrics(capture(fixture_text, "busy-1"))),
        Read(1796024492.207, parse_metrics(capture(fixture_text, "busy-2"))),
    ]
    verdict = settled(decide(reads))
    assert verdict.kind is VerdictKind.BUSY
    assert verdict.tokens_per_s == pytest.approx(1754, rel=0.01)
    assert verdict.steps_per_s == pytest.approx(438, rel=0.01)


def test_the_last_few_tokens_before_a_wedge_still_count_as_progress(fixture_text: Load) -> None:
    # wedge-pre → wedge-1: the engine stopped ~1 s in; steps +4, generated +16.
    verdict = walk(reads_of(fixture_text, "wedge-pre", "wedge-1")).verdict
    assert verdict.kind is VerdictKind.BUSY
    assert "steps +4" in verdict.evidence
    assert "generated +16" in verdict.evidence


@pytest.mark.parametrize(
    "names",
    [
        ("prefill-0", "prefill-1", "prefill-2"),
        ("prefill-1", "prefill-2", "prefill-3"),
        ("prefill2-1", "prefill2-2", "prefill2-3"),
        ("prefill2-3", "prefill2-4", "prefill2-5"),
        ("prefill2-4", "prefill2-5", "prefill2-after"),
        ("chunk-0", "chunk-1", "chunk-2"),
    ],
)
def test_a_prefill_heavy_server_is_never_stalled(
    fixture_text: Load, names: tuple[str, ...]
) -> None:
    reads = reads_of(fixture_text, *names)
    for end in range(1, len(reads) + 1):
        decision = decide(reads[:end], answer(True))
        if isinstance(decision, Verdict):
            assert decision.kind not in (VerdictKind.STALLED, VerdictKind.WEDGED), decision
    # prefill2-*: KV use holds at 0.275 % with 3 running and 95 waiting, yet prompts are read.
    if names[0].startswith("prefill2"):
        assert walk(reads).verdict.kind is VerdictKind.BUSY


def test_a_change_in_kv_cache_use_alone_is_progress(fixture_text: Load) -> None:
    before = capture(fixture_text, "wedge-1")
    after = set_sample(before, "vllm:kv_cache_usage_perc", "0.003")
    verdict = walk(timed([before, after])).verdict
    assert verdict.kind is VerdictKind.BUSY
    assert verdict.requests_sent == 0
    assert "kv 0.0015→0.0030" in verdict.evidence


def test_prompt_tokens_rising_without_output_is_progress(fixture_text: Load) -> None:
    # A long prompt being read: no output token, no step counted, KV use unchanged.
    before = capture(fixture_text, "wedge-1")
    after = set_sample(before, "vllm:prompt_tokens_total", "1674177.0")
    verdict = walk(timed([before, after])).verdict
    assert verdict.kind is VerdictKind.BUSY
    assert "prompt +2000" in verdict.evidence
    assert verdict.tokens_per_s == 0.0


def test_a_finished_request_or_a_preemption_alone_is_progress(fixture_text: Load) -> None:
    before = capture(fixture_text, "wedge-1")
    for name, value, labels in (
        ("vllm:request_success_total", "1.0", {"finished_reason": "abort"}),
        ("vllm:num_preemptions_total", "1.0", {}),
    ):
        after = set_sample(before, name, value, **labels)
        assert walk(timed([before, after])).verdict.kind is VerdictKind.BUSY


def test_a_counter_going_down_under_the_same_start_time_is_not_a_restart(
    fixture_text: Load,
) -> None:
    before = capture(fixture_text, "busy-1")
    after = set_sample(capture(fixture_text, "busy-2"), "vllm:generation_tokens_total", "10.0")
    verdict = walk(timed([before, after])).verdict
    assert verdict.kind is VerdictKind.BUSY  # the steps still rose
    assert verdict.requests_sent == 0


# --- stalled and wedged --------------------------------------------------------------


@pytest.mark.parametrize("run", ["wedge", "dead"])
def test_a_frozen_engine_is_wedged_only_at_the_third_read(fixture_text: Load, run: str) -> None:
    reads = reads_of(fixture_text, f"{run}-1", f"{run}-2", f"{run}-3")
    assert isinstance(decide(reads[:1]), TakeRead)
    assert isinstance(decide(reads[:2]), TakeRead)
    result = walk(reads)
    verdict = result.verdict
    assert verdict.kind is VerdictKind.WEDGED
    assert not verdict.healthy
    assert verdict.requests_sent == 0
    assert not sends_a_request(result.decisions)
    assert len(result.reads) == 3
    assert (verdict.running, verdict.waiting) == (4, 8)


def test_a_paced_freeze_of_exactly_its_least_span_proves_the_wedge(fixture_text: Load) -> None:
    # A freeze proves a wedge once it spans PACED_SPAN paced waits: 1.5 x 2 s = 3 s.
    texts = [capture(fixture_text, name) for name in ("wedge-1", "wedge-2", "wedge-3")]
    reads = [
        Read(T0 + at, parse_metrics(text)) for at, text in zip((0.0, 1.5, 3.0), texts, strict=True)
    ]
    verdict = decide(reads, paced_wait=2.0, max_reads=61)
    assert isinstance(verdict, Verdict) and verdict.kind is VerdictKind.WEDGED, verdict


def test_two_reads_in_one_wait_of_a_paced_reader_are_not_two_waits(fixture_text: Load) -> None:
    """``watch`` reads on a schedule: a read answered late (a slow /metrics, under load) and
    the next one on time came 0.05 s apart, and a freeze of one wait proved a wedge."""
    texts = [capture(fixture_text, name) for name in ("wedge-1", "wedge-2", "wedge-3")]
    late = [Read(T0, parse_metrics(texts[0])), Read(T0 + 1.95, parse_metrics(texts[1]))]
    squeezed = [*late, Read(T0 + 2.0, parse_metrics(texts[2]))]
    assert decide(squeezed).kind is VerdictKind.WEDGED  # type: ignore[union-attr]
    paced = {"paced_wait": 2.0, "max_reads": 61}  # watch's read limit at its defaults
    undecided = decide(squeezed, **paced)  # type: ignore[arg-type]
    assert isinstance(undecided, TakeRead), undecided
    assert "less than 3 s of waits" in undecided.reason
    covered = [*squeezed, Read(T0 + 4.0, parse_metrics(texts[2]))]
    assert decide(covered, **paced).kind is VerdictKind.WEDGED  # type: ignore[arg-type,union-attr]
    # Reads on their schedule (every 0.96 of a wait) are two waits, as before.
    on_time = [
        Read(T0 + index * 0.96 * 2.0, parse_metrics(text)) for index, text in enumerate(texts)
    ]
    assert decide(on_time, **paced).kind is VerdictKind.WEDGED  # type: ignore[arg-type,union-attr]


def test_a_freeze_lasts_until_the_newest_read_was_asked_for_not_until_it_was_taken_in(
    fixture_text: Load,
) -> None:
    """A read stamped when its answer was taken in carried its own event loop's lateness
    (seconds, at thousands of backends): a freeze shorter than two waits was stretched
    past them, and a working engine in one long step was proven wedged."""
    first, second, third = (
        parse_metrics(capture(fixture_text, name)) for name in ("wedge-1", "wedge-2", "wedge-3")
    )
    paced = {"paced_wait": 2.0, "max_reads": 61}  # two waits: 3 s at least
    # The first answer was slow; the third was in at T0 + 2.35 but taken in at T0 + 3.2.
    reads = [
        Read(T0, first, sent=T0 - 1.5),
        Read(T0 + 0.43, second, sent=T0 + 0.42),
        Read(T0 + 3.2, third, sent=T0 + 2.34),
    ]
    undecided = decide(reads, **paced)  # type: ignore[arg-type]
    assert isinstance(undecided, TakeRead), undecided
    assert "in 2.3 s, less than 3 s of waits" in undecided.reason
    # Without when it was asked for (a read from before the field), as it was taken in.
    unsent = [replace(read, sent=None) for read in reads]
    assert decide(unsent, **paced).kind is VerdictKind.WEDGED  # type: ignore[arg-type,union-attr]


def test_a_wedge_is_reported_with_the_frozen_numbers(fixture_text: Load) -> None:
    verdict = walk(reads_of(fixture_text, "wedge-1", "wedge-2", "wedge-3")).verdict
    for fact in (
        "engine 0",
        "10.0 s",
        "running 4→4→4",
        "waiting 8→8→8",
        "steps 8660→8660→8660",
        "generated 33940→33940→33940",
        "finished 894→894→894",
        "start time 1796024376.26 unchanged",
        "engine awake",
        "window two waits",
    ):
        assert fact in verdict.evidence


def test_two_reads_can_only_say_stalled(fixture_text: Load) -> None:
    verdict = walk(reads_of(fixture_text, "wedge-1", "wedge-2"), max_reads=2).verdict
    assert verdict.kind is VerdictKind.STALLED
    assert not verdict.healthy
    assert verdict.requests_sent == 0
    assert "steps 8660→8660" in verdict.evidence
    assert "5.0 s" in verdict.evidence


def test_an_engine_that_resumes_after_one_frozen_wait_is_busy(fixture_text: Load) -> None:
    result = walk(reads_of(fixture_text, "wedge-2", "wedge-3", "wedge-resume-1"))
    assert isinstance(result.decisions[1], TakeRead)
    assert result.verdict.kind is VerdictKind.BUSY
    assert result.verdict.healthy
    assert "steps +346" in result.verdict.evidence


def two_engines(load: Load, zero: str, one: str) -> str:
    return capture(load, zero) + "\n" + relabel(capture(load, one), "1") + "\n"


def test_one_frozen_engine_among_busy_ones_wedges_the_backend(fixture_text: Load) -> None:
    # Engine 0 keeps decoding (busy-*), engine 1 is frozen with work (wedge-*); same process.
    texts = [two_engines(fixture_text, f"busy-{index}", f"wedge-{index}") for index in (1, 2, 3)]
    reads = timed(texts)
    assert [engine.engine for engine in parse_metrics(texts[0]).engines] == ["0", "1"]
    # After one wait engine 0 progressed, but engine 1 did not: not busy yet, read again.
    assert isinstance(decide(reads[:2]), TakeRead)
    result = walk(reads)
    assert result.verdict.kind is VerdictKind.WEDGED
    assert "engine 1" in result.verdict.evidence
    assert (result.verdict.running, result.verdict.waiting) == (8, 12)
    assert not sends_a_request(result.decisions)


def test_an_asleep_engine_with_frozen_work_is_never_wedged(fixture_text: Load) -> None:
    texts = [asleep(capture(fixture_text, f"wedge-{index}")) for index in (1, 2, 3)]
    result = walk(timed(texts))
    assert result.verdict.kind not in (VerdictKind.WEDGED, VerdictKind.STALLED)
    assert result.verdict.requests_sent == 0
    assert "weights_offloaded" in result.verdict.evidence


def test_a_wait_that_began_with_the_engine_asleep_does_not_count_towards_a_wedge(
    fixture_text: Load,
) -> None:
    # A wedge is two waits of no progress with the engine awake: woken at the second
    # read, the frozen engine has been watched awake over one wait only.
    texts = [asleep(capture(fixture_text, "wedge-1"))]
    texts += [capture(fixture_text, name) for name in ("wedge-2", "wedge-3")]
    verdict = settled(decide(timed(texts)))
    assert verdict.kind is VerdictKind.STALLED
    assert not verdict.healthy


def test_an_asleep_engine_beside_a_busy_one_does_not_wedge_the_backend(
    fixture_text: Load,
) -> None:
    texts = [
        capture(fixture_text, f"busy-{index}")
        + "\n"
        + relabel(asleep(capture(fixture_text, f"wedge-{index}")), "1")
        for index in (1, 2, 3)
    ]
    result = walk(timed(texts))
    assert result.verdict.kind is VerdictKind.BUSY
    assert not sends_a_request(result.decisions)


def test_a_restarted_process_asleep_on_purpose_is_not_sent_a_request(fixture_text: Load) -> None:
    # An RL trainer restarted the server and put it to sleep: a completion sent to a
    # sleeping vLLM crashed it (vllm#15483), and asleep is no failure to look for.
    old, new = capture(fixture_text, "restart-0"), asleep(capture(fixture_text, "restart-1"))
    reads = timed([old, new])
    for decision in (decide(reads), decide(reads[1:], baseline=parse_metrics(old))):
        verdict = settled(decision)
        assert verdict.kind is VerdictKind.RESTARTED
        assert not verdict.healthy  # news, unproven without an answer
        assert verdict.requests_sent == 0
        assert "engine 0 weights_offloaded" in verdict.evidence


def test_a_server_read_asleep_is_not_asked_when_a_later_metrics_read_is_unusable(
    fixture_text: Load,
) -> None:
    # Asleep at the last read with vLLM series (this run's, or the earlier run's), then a
    # /metrics answered HTTP 503: nothing shows it awake, so no completion may go to it.
    sleeping = parse_metrics(asleep(capture(fixture_text, "idle-1")))
    failed = problem(ReadProblem.UNUSABLE, "GET /metrics answered HTTP 503", T0 + WAIT)
    for decision in (
        decide([Read(T0, sleeping), failed]),
        decide([failed], baseline=sleeping),
    ):
        verdict = settled(decision)
        assert verdict.kind is VerdictKind.NO_METRICS
        assert not verdict.healthy
        assert verdict.requests_sent == 0
        assert "engine 0 weights_offloaded" in verdict.evidence


def test_a_server_read_with_work_is_not_asked_when_a_later_metrics_read_is_unusable(
    fixture_text: Load,
) -> None:
    # 4 running, 8 waiting, then a /metrics answered HTTP 503: nothing shows the work
    # gone, so no request may go to it (it queued behind the work, timed out, and the
    # busy backend was failed as no_metrics for the check's own request).
    busy = reads_of(fixture_text, "busy-1")
    failed = problem(ReadProblem.UNUSABLE, "GET /metrics answered HTTP 503", T0 + WAIT)
    verdict = settled(decide([*busy, failed]))
    assert verdict.kind is VerdictKind.NO_METRICS
    assert not verdict.healthy
    assert verdict.requests_sent == 0
    assert "showed 4 running, 8 waiting" in verdict.evidence
    # Nothing shown before it, or nothing to do: asked as before.
    assert isinstance(decide([failed]), SendTinyRequest)
    idle = reads_of(fixture_text, "idle-1")
    assert isinstance(decide([*idle, failed]), SendTinyRequest)
    # Failing again (restarted without metrics, say): asked, or never judged again.
    again = problem(ReadProblem.UNUSABLE, "GET /metrics answered HTTP 404", T0 + 2 * WAIT)
    assert isinstance(decide([*busy, failed, again], max_reads=4), SendTinyRequest)


def test_a_new_process_without_vllm_series_after_a_busy_read_is_asked(fixture_text: Load) -> None:
    # Read busy, then another process answered /metrics without vLLM series (started
    # again with --disable-log-stats): the work shown was the old process's, and a new
    # one starts with none, as it starts awake (``asleep_now``). Left unasked, it was
    # called unproven and its evidence named the old process's work as its own.
    busy = reads_of(fixture_text, "busy-1")
    start = _signals_of(busy[-1]).process_start
    assert start is not None
    other = parse_metrics(f"process_start_time_seconds {start + 60:.1f}\n")
    assert not other.has_vllm and other.process_start != start
    decision = decide([*busy, Read(T0 + WAIT, other)])
    assert isinstance(decision, SendTinyRequest)
    # The same process, still without its series: not asked, as the read showed work.
    same = parse_metrics(f"process_start_time_seconds {start!r}\n")
    assert settled(decide([*busy, Read(T0 + WAIT, same)])).requests_sent == 0


def _signals_of(read: Read) -> Signals:
    assert read.signals is not None
    return read.signals


@pytest.mark.parametrize("sleeper", ["idle-2", "wedge-1"])
def test_an_idle_engine_beside_an_asleep_one_is_not_sent_a_request(
    fixture_text: Load, sleeper: str
) -> None:
    # Data-parallel: engine 0 asleep on purpose (with nothing queued, or with requests),
    # engine 1 idle. The server routes a request to any engine with the least queued,
    # the asleep one included, and the backend shows work on it in the second case.
    text = asleep(capture(fixture_text, sleeper)) + relabel(capture(fixture_text, "idle-1"), "1")
    result = walk(timed([text, text, text]))
    assert result.verdict.kind is VerdictKind.IDLE
    assert result.verdict.requests_sent == 0
    assert "engine 0 weights_offloaded" in result.verdict.evidence


# --- idle, unanswered, work unknown --------------------------------------------------


@pytest.mark.parametrize("name", ["idle-1", "busy-after", "restart-2", "multiapi-after-load"])
def test_an_idle_server_is_asked_once_and_is_idle_when_it_answers(
    fixture_text: Load, name: str
) -> None:
    reads = reads_of(fixture_text, name)
    assert isinstance(decide(reads), SendTinyRequest)
    result = walk(reads, answer_ok=True)
    verdict = result.verdict
    assert verdict.kind is VerdictKind.IDLE
    assert verdict.healthy
    assert verdict.requests_sent == 1
    assert verdict.answer is not None and verdict.answer.ok
    assert (verdict.running, verdict.waiting) == (0, 0)
    assert OK_DETAIL in verdict.evidence
    assert "0 running, 0 waiting" in verdict.evidence


def deferred(text: str, waiting: int, deferred: int) -> str:
    """The text with ``waiting`` requests waiting, ``deferred`` of them deferred by vLLM
    (a grammar compiling, KV blocks still to come from a prefill instance)."""
    text = set_sample(text, "vllm:num_requests_waiting", f"{waiting}.0")
    by_reason = "vllm:num_requests_waiting_by_reason"
    text = set_sample(text, by_reason, f"{deferred}.0", reason="deferred")
    return set_sample(text, by_reason, f"{waiting - deferred}.0", reason="capacity")


@pytest.mark.parametrize("ok", [True, False])
def test_requests_vllm_defers_are_no_work_and_the_tiny_request_judges(
    fixture_text: Load, ok: bool
) -> None:
    # Nothing running, one request waiting that vLLM defers: its grammar compiles in a
    # thread pool (minutes for a large tool schema) and no counter moves meanwhile. As
    # work, it was wedged at the third read; the engine would answer anything else.
    text = deferred(capture(fixture_text, "prefill2-after"), waiting=1, deferred=1)
    result = walk(timed([text, text, text]), answer_ok=ok)
    verdict = result.verdict
    assert verdict.kind is (VerdictKind.IDLE if ok else VerdictKind.UNANSWERED)
    assert verdict.requests_sent == 1
    assert "0 running, 1 waiting (1 deferred by vLLM: not work)" in verdict.evidence


def test_a_request_waiting_for_capacity_beside_a_deferred_one_is_still_work(
    fixture_text: Load,
) -> None:
    text = deferred(capture(fixture_text, "prefill2-after"), waiting=2, deferred=1)
    verdict = walk(timed([text, text, text])).verdict
    assert verdict.kind is VerdictKind.WEDGED
    assert verdict.requests_sent == 0


def test_an_idle_server_that_does_not_answer_is_unanswered(fixture_text: Load) -> None:
    verdict = walk(reads_of(fixture_text, "idle-1"), answer_ok=False).verdict
    assert verdict.kind is VerdictKind.UNANSWERED
    assert not verdict.healthy
    assert verdict.requests_sent == 1
    assert FAILED_DETAIL in verdict.evidence
    assert "0 running, 0 waiting" in verdict.evidence


@pytest.mark.parametrize("ok", [True, False])
def test_unknown_work_is_judged_by_the_tiny_request_and_never_wedged(
    fixture_text: Load, ok: bool
) -> None:
    # Several API servers: no running/waiting gauges before the first request.
    reads = reads_of(fixture_text, "multiapi-idle-1", "multiapi-idle-1", "multiapi-idle-1")
    result = walk(reads, answer_ok=ok)
    assert result.verdict.kind is (VerdictKind.IDLE if ok else VerdictKind.UNANSWERED)
    assert result.verdict.healthy is ok
    assert result.verdict.requests_sent == 1
    assert "work unknown" in result.verdict.evidence
    assert (result.verdict.running, result.verdict.waiting) == (None, None)


def test_unknown_work_on_one_engine_does_not_excuse_work_on_another(fixture_text: Load) -> None:
    # Engine 0 publishes no gauges yet; engine 1 shows 12 requests and is frozen.
    texts = [
        capture(fixture_text, "multiapi-idle-1")
        + "\n"
        + relabel(capture(fixture_text, f"wedge-{index}"), "1")
        for index in (1, 2, 3)
    ]
    reads = timed(texts)
    assert not isinstance(decide(reads[:1]), SendTinyRequest)
    result = walk(reads)
    assert result.verdict.kind is VerdictKind.WEDGED
    assert "engine 1" in result.verdict.evidence


def test_work_that_finished_during_the_wait_is_busy_without_a_request(fixture_text: Load) -> None:
    # The shell of `watch` keeps the last read: busy-3 then busy-after, 22 s later.
    reads = reads_of(fixture_text, "busy-3", "busy-after", wait=22.0)
    verdict = settled(decide(reads))
    assert verdict.kind is VerdictKind.BUSY
    assert verdict.requests_sent == 0


# --- restarts ------------------------------------------------------------------------


@pytest.mark.parametrize("ok", [True, False])
def test_a_changed_start_time_is_a_restart_judged_by_the_tiny_request(
    fixture_text: Load, ok: bool
) -> None:
    # restart-0 is idle, so a single run would have asked it already; `watch` keeps the
    # last read of one cycle and compares it with the first of the next.
    reads = reads_of(fixture_text, "restart-0", "restart-1")
    assert isinstance(decide(reads), SendTinyRequest)
    verdict = settled(decide(reads, answer(ok)))
    assert verdict.kind is VerdictKind.RESTARTED
    assert verdict.healthy is ok
    assert verdict.requests_sent == 1
    assert "1796024376.26 → 1796024675.47" in verdict.evidence


def test_counters_going_down_without_a_start_time_is_a_restart(fixture_text: Load) -> None:
    # Prometheus multiprocess mode has no process start time; only the counters can tell.
    before = capture(fixture_text, "multiapi-after-load")
    after = capture(fixture_text, "multiapi-after-load-2")
    for name, value in (
        ("vllm:generation_tokens_total", "1000.0"),
        ("vllm:iteration_tokens_total_count", "500.0"),
        ("vllm:prompt_tokens_total", "20.0"),
    ):
        after = set_sample(after, name, value)
    reads = timed([before, after])
    assert isinstance(decide(reads), SendTinyRequest)
    verdict = settled(decide(reads, answer(True)))
    assert verdict.kind is VerdictKind.RESTARTED
    assert "counters went down" in verdict.evidence


def test_a_multiprocess_server_that_comes_back_empty_is_a_restart(fixture_text: Load) -> None:
    # After load, then the shape of a fresh start: counters at zero, no gauges yet.
    reads = reads_of(fixture_text, "multiapi-after-load", "multiapi-idle-1")
    assert isinstance(decide(reads), SendTinyRequest)
    verdict = settled(decide(reads, answer(False)))
    assert verdict.kind is VerdictKind.RESTARTED
    assert not verdict.healthy


def test_equal_counters_without_a_start_time_are_the_same_process(fixture_text: Load) -> None:
    reads = reads_of(fixture_text, "multiapi-after-load", "multiapi-after-load-2")
    verdict = settled(decide(reads, answer(True)))
    assert verdict.kind is VerdictKind.IDLE


def test_a_restarted_process_with_work_is_judged_by_its_own_next_reads(
    fixture_text: Load,
) -> None:
    # busy-3 is server #1 decoding; dead-pre and dead-1 are server #3, decoding 12 requests.
    result = walk(reads_of(fixture_text, "busy-3", "dead-pre", "dead-1"))
    assert not sends_a_request(result.decisions)
    assert isinstance(result.decisions[1], TakeRead)
    verdict = result.verdict
    assert verdict.kind is VerdictKind.RESTARTED
    assert verdict.healthy
    assert verdict.requests_sent == 0
    assert "steps +5" in verdict.evidence


def test_a_restarted_process_with_frozen_work_is_not_healthy_and_not_asked(
    fixture_text: Load,
) -> None:
    result = walk(reads_of(fixture_text, "busy-3", "dead-1", "dead-2"))
    assert not sends_a_request(result.decisions)
    assert result.verdict.kind is VerdictKind.RESTARTED
    assert not result.verdict.healthy
    assert result.verdict.requests_sent == 0


def test_a_restarted_process_with_frozen_work_is_judged_after_one_wait_of_its_own(
    fixture_text: Load,
) -> None:
    # A run allowed many reads (a long max_check_time, or watch's kept reads) must not
    # hold the verdict on a new process until they run out: that kept a standby daemon
    # from ever proving a wedge that came with a restart.
    result = walk(reads_of(fixture_text, "busy-3", "dead-1", "dead-2", "dead-3"), max_reads=60)
    assert len(result.reads) == 3
    assert result.verdict.kind is VerdictKind.RESTARTED
    assert not result.verdict.healthy


def test_counters_of_two_different_processes_are_never_compared(fixture_text: Load) -> None:
    # Three processes, each with work: #1 (busy-3), #2 (apifreeze-pre, 513 steps), #3
    # (dead-pre, 4,777 steps). #3's counters are above #2's, but that is nobody's progress.
    result = walk(reads_of(fixture_text, "busy-3", "apifreeze-pre", "dead-pre"))
    assert not sends_a_request(result.decisions)
    verdict = result.verdict
    assert verdict.kind is VerdictKind.RESTARTED
    assert not verdict.healthy
    assert "busy" not in verdict.evidence
    assert "1796024805.75" in verdict.evidence


# --- reads that failed, texts without vLLM series ------------------------------------


@pytest.mark.parametrize(
    ("kind", "expected", "detail"),
    [
        (ReadProblem.DOWN, VerdictKind.DOWN, "connection refused"),
        (ReadProblem.UNRESPONSIVE, VerdictKind.UNRESPONSIVE, "no answer within 5.0 s"),
    ],
)
def test_a_failed_read_is_its_own_verdict_without_a_request(
    kind: ReadProblem, expected: VerdictKind, detail: str
) -> None:
    result = walk([problem(kind, detail)])
    assert result.verdict.kind is expected
    assert not result.verdict.healthy
    assert result.verdict.requests_sent == 0
    assert detail in result.verdict.evidence


def test_a_server_that_exits_while_frozen_is_down(fixture_text: Load) -> None:
    # dead-1, dead-2, then dead-4: the engine timed out and the API server exited.
    reads = reads_of(fixture_text, "dead-1", "dead-2")
    reads.append(problem(ReadProblem.DOWN, "connection refused", T0 + 2 * WAIT))
    verdict = walk(reads).verdict
    assert verdict.kind is VerdictKind.DOWN
    assert verdict.requests_sent == 0


@pytest.mark.parametrize("ok", [True, False])
def test_an_unusable_metrics_answer_is_judged_by_the_tiny_request(ok: bool) -> None:
    result = walk([problem(ReadProblem.UNUSABLE, "HTTP 404 Not Found")], answer_ok=ok)
    verdict = result.verdict
    assert isinstance(result.decisions[-2], SendTinyRequest)
    assert verdict.kind is VerdictKind.NO_METRICS
    assert verdict.healthy is ok
    assert verdict.requests_sent == 1
    assert "HTTP 404" in verdict.evidence
    assert (OK_DETAIL if ok else FAILED_DETAIL) in verdict.evidence


@pytest.mark.parametrize("name", ["proxy-metrics", "html-error", "truncated-mid-label"])
def test_a_text_without_vllm_series_is_no_metrics(fixture_text: Load, name: str) -> None:
    reads = timed([fixture_text(f"hostile/{name}.txt")])
    result = walk(reads, answer_ok=True)
    assert result.verdict.kind is VerdictKind.NO_METRICS
    assert result.verdict.healthy
    assert "no vLLM series" in result.verdict.evidence


def test_no_reads_yet_means_take_one() -> None:
    assert isinstance(decide([]), TakeRead)


# --- proxies -------------------------------------------------------------------------


def test_a_proxy_that_lists_models_is_up() -> None:
    verdict = judge_proxy(True, "", ["tiny", "tiny-2"])
    assert verdict.kind is VerdictKind.UP
    assert verdict.healthy
    assert "tiny, tiny-2" in verdict.evidence
    assert verdict.requests_sent == 0


def test_a_proxy_listing_a_thousand_models_names_a_few() -> None:
    # Every id went into the evidence: a megabyte a line of output and of the log.
    models = [f"model-{number:04}" for number in range(1000)]
    verdict = judge_proxy(True, "", models)
    assert verdict.evidence.startswith("up: /v1/models lists model-0000, model-0001")
    assert verdict.evidence.endswith(" and 992 more models")


@pytest.mark.parametrize(
    ("ok", "detail", "models", "shown"),
    [
        (False, "connection refused", ["tiny"], "connection refused"),
        (False, "HTTP 502", [], "HTTP 502"),
        (True, "", [], "lists no model"),
    ],
)
def test_a_proxy_that_does_not_list_models_is_down(
    ok: bool, detail: str, models: list[str], shown: str
) -> None:
    verdict = judge_proxy(ok, detail, models)
    assert verdict.kind is VerdictKind.DOWN
    assert not verdict.healthy
    assert shown in verdict.evidence


# --- every walk, at random -----------------------------------------------------------

POOL_CAPTURES = [
    "idle-1",
    "busy-0",
    "busy-1",
    "busy-2",
    "busy-3",
    "busy-after",
    "prefill-1",
    "prefill2-2",
    "prefill2-3",
    "wedge-pre",
    "wedge-1",
    "wedge-2",
    "wedge-3",
    "wedge-resume-1",
    "restart-0",
    "restart-1",
    "apifreeze-pre",
    "chunk-1",
    "serve3-busy-1",
    "dead-pre",
    "dead-1",
    "dead-2",
    "multiapi-idle-1",
    "multiapi-after-load",
]
POOL_SYNTHETIC = [
    "two-engines-1",
    "two-engines-2",
    "asleep-1",
    "asleep-2",
    "unknown-beside-work",
    "no-vllm",
    "down",
    "unresponsive",
    "unusable",
]


@pytest.fixture(scope="session")
def pool(fixture_text: Load) -> dict[str, Read]:
    """Reads by name, at time 0; a walk gives each its own time."""
    texts = {name: capture(fixture_text, name) for name in POOL_CAPTURES}
    texts["two-engines-1"] = two_engines(fixture_text, "busy-1", "wedge-1")
    texts["two-engines-2"] = two_engines(fixture_text, "busy-2", "wedge-2")
    texts["asleep-1"] = asleep(capture(fixture_text, "wedge-1"))
    texts["asleep-2"] = asleep(capture(fixture_text, "wedge-2"))
    texts["unknown-beside-work"] = (
        capture(fixture_text, "multiapi-idle-1")
        + "\n"
        + relabel(capture(fixture_text, "wedge-1"), "1")
    )
    texts["no-vllm"] = fixture_text("hostile/proxy-metrics.txt")
    reads = {name: Read(0.0, parse_metrics(text)) for name, text in texts.items()}
    reads["down"] = problem(ReadProblem.DOWN, "connection refused", 0.0)
    reads["unresponsive"] = problem(ReadProblem.UNRESPONSIVE, "no answer within 5.0 s", 0.0)
    reads["unusable"] = problem(ReadProblem.UNUSABLE, "HTTP 404 Not Found", 0.0)
    return reads


def same_process(reads: Sequence[Read]) -> bool:
    """Equal start times where both texts carry one; else no counter of an engine went down.

    A start time missing from only one text is not taken as proof of a new process: a
    body cut short loses it as well.
    """
    if not all(read.signals is not None for read in reads):
        return False
    signals = [read.signals for read in reads if read.signals is not None]
    for older, newer in itertools.pairwise(signals):
        if older.process_start is not None and newer.process_start is not None:
            if older.process_start != newer.process_start:
                return False
            continue
        for engine in newer.engines:
            before = older.engine(engine.engine)
            if before is None:
                continue
            for name, value in engine.counters.items():
                if name in before.counters and value < before.counters[name]:
                    return False
    return True


@settings(deadline=None, max_examples=300, suppress_health_check=[HealthCheck.too_slow])
@given(
    names=st.lists(st.sampled_from(POOL_CAPTURES + POOL_SYNTHETIC), min_size=6, max_size=6),
    waits=st.lists(st.floats(min_value=0.0, max_value=60.0), min_size=6, max_size=6),
    answer_ok=st.booleans(),
    max_reads=st.integers(min_value=2, max_value=6),
)
def test_any_walk_ends_within_max_reads_and_never_asks_a_server_with_work(
    pool: dict[str, Read],
    names: list[str],
    waits: list[float],
    answer_ok: bool,
    max_reads: int,
) -> None:
    available = []
    at = T0
    for name, wait in zip(names, waits, strict=True):
        at += wait
        template = pool[name]
        available.append(Read(at, template.signals, template.problem, template.detail))

    result = walk(available, answer_ok, max_reads)
    verdict, taken, asked = result.verdict, result.reads, result.requests
    assert verdict.evidence.strip()
    assert verdict.requests_sent == asked
    assert verdict.reads == tuple(taken)
    assert (verdict.answer is not None) == (asked == 1)
    if verdict.kind is VerdictKind.WEDGED:
        assert len(taken) >= 3
        assert not verdict.healthy
        assert same_process(taken[-3:])
    if verdict.kind is VerdictKind.BUSY or (
        verdict.kind is VerdictKind.RESTARTED and verdict.healthy and asked == 0
    ):
        # Progress is only ever measured between two reads of one process.
        assert same_process(taken[-2:])
    if verdict.kind in (VerdictKind.BUSY, VerdictKind.WEDGED, VerdictKind.STALLED):
        assert asked == 0
    # The same inputs give the same answer: nothing is remembered between calls.
    assert decide(taken, verdict.answer, max_reads=max_reads) == verdict


@settings(deadline=None, max_examples=300, suppress_health_check=[HealthCheck.too_slow])
@given(
    names=st.lists(
        st.sampled_from(POOL_CAPTURES + POOL_SYNTHETIC + ["again"] * 6), min_size=1, max_size=24
    ),
    learned_seconds=st.sampled_from([None, 1.0, 40.0]),
)
# A freeze read on both sides of two texts without vLLM series: the window let its first
# read go, and a later decision measured the freeze from the second (20 s, not 25).
@example(names=["busy-1", "busy-1", "no-vllm", "no-vllm", "busy-1", "busy-1"], learned_seconds=40.0)
# A restart seen just before two failed reads: the window must keep the read before the
# restart (``reads_still_needed``), or it decides the idle read after them otherwise.
@example(names=["restart-1", "busy-1", "down", "down", "idle-1"], learned_seconds=None)
def test_a_sliding_window_decides_as_one_that_keeps_every_read(
    pool: dict[str, Read], names: list[str], learned_seconds: float | None
) -> None:
    """``watch`` lets reads go that ``reads_still_needed`` says no later decision uses.
    Read for read, the window it keeps decides as one that kept every read (while neither
    reaches ``max_reads``), as watch drives them: a restart's verdict starts both afresh.
    ``again`` repeats the read before it: freezes of any length. The longest step a
    verdict carries may come from a read the window let go (an old process's, across a
    restart): the state already holds it from an earlier verdict, as ``kept`` does."""
    learned = None if learned_seconds is None else LongestStep(learned_seconds, "seen")
    kept = learned  # every earlier verdict's longest step, as the state keeps it
    every: list[Read] = []
    sliding: list[Read] = []
    template = pool["idle-1"]
    for number, name in enumerate(names):
        template = template if name == "again" else pool[name]
        read = Read(T0 + 5.0 * number, template.signals, template.problem, template.detail)
        every.append(read)
        sliding.append(read)
        del sliding[: -reads_still_needed(sliding)]
        whole = decide(every, max_reads=1000, learned=learned)
        slid = decide(sliding, max_reads=1000, learned=learned)
        if isinstance(whole, SendTinyRequest) and isinstance(slid, SendTinyRequest):
            sent = answer(True, at=read.at + 0.1)  # asked at once, in the same cycle
            whole = decide(every, sent, max_reads=1000, learned=learned)
            slid = decide(sliding, sent, max_reads=1000, learned=learned)
        if isinstance(whole, Verdict) and isinstance(slid, Verdict):
            same = {"reads": (), "longest_step": None}
            assert replace(slid, **same) == replace(whole, **same), (names, number)
            kept = longer(kept, slid.longest_step)
            assert longer(kept, whole.longest_step) == kept, (names, number)
            if whole.kind is VerdictKind.RESTARTED:
                del every[:-1], sliding[:-1]
        else:
            assert slid == whole, (names, number)


# --- evidence ------------------------------------------------------------------------


def verdicts_of_every_kind(load: Load) -> dict[VerdictKind, tuple[Verdict, list[str]]]:
    """One verdict per kind, with the numbers its evidence must show."""
    found: dict[VerdictKind, tuple[Verdict, list[str]]] = {}

    def add(result: Walk | Verdict, *facts: str) -> None:
        verdict = result.verdict if isinstance(result, Walk) else result
        found[verdict.kind] = (verdict, list(facts))

    add(walk(reads_of(load, "busy-1", "busy-2")), "4 running, 8 waiting", "steps +684", "5.0 s")
    add(walk(reads_of(load, "idle-1"), answer_ok=True), "0 running, 0 waiting", OK_DETAIL)
    add(walk(reads_of(load, "idle-1"), answer_ok=False), "0 running, 0 waiting", FAILED_DETAIL)
    add(walk(reads_of(load, "wedge-1", "wedge-2"), max_reads=2), "steps 8660→8660", "5.0 s")
    add(walk(reads_of(load, "wedge-1", "wedge-2", "wedge-3")), "steps 8660→8660→8660", "10.0 s")
    add(
        settled(decide(reads_of(load, "restart-0", "restart-1"), answer(True))),
        "1796024376.26 → 1796024675.47",
        "0 running, 0 waiting",
    )
    add(walk([problem(ReadProblem.UNUSABLE, "HTTP 404")], answer_ok=True), "HTTP 404")
    add(walk([problem(ReadProblem.UNRESPONSIVE, "no answer in 5.0 s")]), "5.0 s")
    add(walk([problem(ReadProblem.DOWN, "connection refused")]), "connection refused")
    add(judge_proxy(True, "", ["tiny"]), "tiny")
    return found


def test_every_verdict_kind_carries_the_numbers_it_relied_on(fixture_text: Load) -> None:
    found = verdicts_of_every_kind(fixture_text)
    assert set(found) == set(VerdictKind)
    for kind, (verdict, facts) in found.items():
        assert verdict.evidence.startswith(str(kind)), verdict.evidence
        for fact in facts:
            assert fact in verdict.evidence, (kind, fact, verdict.evidence)


# --- the baseline from an earlier run -----------------------------------------------


def test_a_new_start_time_since_the_last_run_is_a_restart(fixture_text: Load) -> None:
    baseline = parse_metrics(capture(fixture_text, "restart-0"))
    reads = reads_of(fixture_text, "restart-1")
    assert isinstance(decide(reads, baseline=baseline), SendTinyRequest)
    verdict = settled(decide(reads, answer(True), baseline=baseline))
    assert verdict.kind is VerdictKind.RESTARTED
    assert verdict.healthy
    assert "since the last run" in verdict.evidence
    assert "1796024376.26 → 1796024675.47" in verdict.evidence


def test_the_same_process_as_last_run_is_judged_on_this_runs_reads_only(
    fixture_text: Load,
) -> None:
    # The earlier run saw busy counters; progress is never measured across runs, so an
    # idle read of the same process is simply idle.
    baseline = parse_metrics(capture(fixture_text, "busy-2"))
    reads = reads_of(fixture_text, "busy-after")
    verdict = settled(decide(reads, answer(True), baseline=baseline))
    assert verdict.kind is VerdictKind.IDLE


def test_a_start_time_missing_from_one_text_alone_is_no_restart(fixture_text: Load) -> None:
    cut = "\n".join(
        line
        for line in capture(fixture_text, "busy-2").splitlines()
        if not line.startswith("process_start_time_seconds")
    )
    reads = timed([capture(fixture_text, "busy-1"), cut], WAIT)
    verdict = settled(decide(reads))
    assert verdict.kind is VerdictKind.BUSY


def test_an_idle_engine_that_stepped_is_idle_and_spends_no_request(fixture_text: Load) -> None:
    # chunk-0 → chunk-2: nothing running at either read, yet two requests finished in
    # between (in `watch`, often llmhealth's own tiny request of the cycle before).
    verdict = settled(decide(reads_of(fixture_text, "chunk-0", "chunk-2")))
    assert verdict.kind is VerdictKind.IDLE
    assert verdict.healthy
    assert verdict.requests_sent == 0
    assert "finished +2" in verdict.evidence


# --- the wedge window: long steps are not wedges ----------------------------------------


def with_gap_histogram(text: str, longest: str) -> str:
    """A capture whose inter-token-latency histogram recorded one gap in bucket ``longest``.

    Every bucket from ``longest`` up (and the count) gains one observation, as vLLM's
    histogram does when a step that long ends.
    """
    lines = []
    reached = False
    for line in text.splitlines():
        head, _, value = line.rpartition(" ")
        if head.startswith("vllm:inter_token_latency_seconds_bucket{"):
            reached = reached or f'le="{longest}"' in head
        counted = head.startswith("vllm:inter_token_latency_seconds_count{") or (
            reached and head.startswith("vllm:inter_token_latency_seconds_bucket{")
        )
        lines.append(f"{head} {float(value) + 1}" if counted else line)
    assert reached, longest
    return "\n".join(lines) + "\n"


def test_the_window_is_learned_from_a_real_freeze_the_engine_recorded(fixture_text: Load) -> None:
    # wedgeworker-* come from the server that had just come back from a 20 s SIGSTOP: its
    # inter-token histogram holds a gap of 10-20 s, so 20 s x3 must pass before proof.
    names = ("wedgeworker-1", "wedgeworker-2", "wedgeworker-3")
    short = walk(reads_of(fixture_text, *names, wait=WAIT)).verdict
    assert short.kind is VerdictKind.STALLED
    assert "short of its window 60 s" in short.evidence
    assert "inter-token gaps up to 20 s" in short.evidence
    assert short.longest_step is not None and short.longest_step.seconds == 20.0
    proof = walk(reads_of(fixture_text, *names, wait=30.0)).verdict
    assert proof.kind is VerdictKind.WEDGED
    assert "window 60 s: longest step seen 20 s x3" in proof.evidence


def test_a_freeze_inside_the_window_keeps_reading_and_is_wedged_once_it_is_covered(
    fixture_text: Load,
) -> None:
    # The first case: a decode request running, then one step of about 180 s. The
    # engine had taken an 80 s+ step before, so its window is 240 s: at a 5 s wait a
    # check reads on through the freeze and proves nothing until 240 s have passed.
    frozen = with_gap_histogram(capture(fixture_text, "wedge-1"), "+Inf")
    reads = timed([frozen] * 60, wait=WAIT)
    decisions = [decide(reads[:end], max_reads=60) for end in range(1, 49)]
    assert all(isinstance(decision, TakeRead) for decision in decisions)
    assert "inside its window 240 s" in decisions[-1].reason  # type: ignore[union-attr]
    verdict = settled(decide(reads[:50], max_reads=60))
    assert verdict.kind is VerdictKind.WEDGED
    assert "over 49 consecutive waits (245.0 s)" in verdict.evidence
    assert "window 240 s: longest step seen 80 s x3 (engine 0: an inter-token gap over 80 s)" in (
        verdict.evidence
    )
    assert "steps 8660→8660→…(47 more)…→8660" in verdict.evidence


def test_a_step_of_prompts_prefilled_together_does_not_stretch_the_window_by_their_count(
    fixture_text: Load,
) -> None:
    """Eight prompts prefilled in one 20 s step: each request counts the step in the
    prefill sum, and the figure said 160 s (a 480 s window, past a check's 300 s), so a
    real wedge there was never proven. No request waited over 20 s for its first token
    (which holds its prefill): 60 s."""
    text = capture(fixture_text, "wedge-1")
    prompt_tokens = parse_metrics(text).engines[0].prompt_tokens
    assert prompt_tokens is not None
    # 160 s per 2,048 tokens (the largest step of the capture), as eight 20 s prefills.
    text = set_sample(
        text, "vllm:request_prefill_time_seconds_sum", f"{prompt_tokens * 160 / 2048!r}"
    )
    reads = timed([_first_tokens_waited_20_s(text)] * 30, wait=WAIT)
    verdict = settled(decide(reads[:14], max_reads=61))
    assert verdict.kind is VerdictKind.WEDGED
    assert "window 60 s: longest step seen 20 s x3" in verdict.evidence


def _first_tokens_waited_20_s(text: str) -> str:
    """``text`` with every time-to-first-token bucket below 20 s emptied: each request
    waited out a 20 s step for its first token."""
    lines = []
    for line in text.splitlines():
        head, _, value = line.rpartition(" ")
        if head.startswith("vllm:time_to_first_token_seconds_bucket{"):
            bound = head.split('le="')[1].split('"')[0]
            if bound != "+Inf" and float(bound) < 20:
                value = "0.0"
        lines.append(f"{head} {value}")
    return "\n".join(lines) + "\n"


def test_prompt_tokens_from_the_prefix_cache_do_not_shorten_the_prefill_step(
    fixture_text: Load,
) -> None:
    """Multi-turn conversations: 99 % of the prompt tokens came from the prefix cache,
    and only the rest were prefilled. Divided by every prompt token, the prefill time
    made a 2,048-token step of 20 s one of 0.2 s: a window of two waits, and a healthy
    engine inside its next such step was wedged at 10 s, and restarted."""
    text = set_sample(capture(fixture_text, "wedge-1"), "vllm:prompt_tokens_total", "1000000.0")
    text = set_sample(text, "vllm:prompt_tokens_cached_total", "990000.0")
    # 20 s per 2,048 tokens computed (the largest step of the capture).
    text = set_sample(text, "vllm:request_prefill_time_seconds_sum", f"{10_000 * 20 / 2048!r}")
    reads = timed([_first_tokens_waited_20_s(text)] * 15, wait=WAIT)
    decision = decide(reads[:3], max_reads=61)
    assert isinstance(decision, TakeRead)
    assert "inside its window 60 s" in decision.reason
    assert "prefill 9.77 ms per prompt token computed" in decision.reason
    verdict = settled(decide(reads[:14], max_reads=61))
    assert verdict.kind is VerdictKind.WEDGED
    assert "window 60 s: longest step seen 20 s x3" in verdict.evidence


def test_a_check_that_runs_out_of_reads_inside_the_window_says_stalled(fixture_text: Load) -> None:
    frozen = with_gap_histogram(capture(fixture_text, "wedge-1"), "+Inf")
    result = walk(timed([frozen] * 5), max_reads=5)
    assert result.verdict.kind is VerdictKind.STALLED
    assert not result.verdict.healthy
    assert "max_check_time" in result.verdict.evidence
    assert not sends_a_request(result.decisions)


def test_a_longest_step_from_an_earlier_run_widens_the_window(fixture_text: Load) -> None:
    reads = reads_of(fixture_text, "wedge-1", "wedge-2", "wedge-3")
    learned = LongestStep(31.0, "engine 0: inter-token gaps up to 31 s")
    decision = decide(reads, learned=learned, max_reads=4)
    assert isinstance(decision, TakeRead)
    verdict = settled(decide(reads, learned=learned, max_reads=3))
    assert verdict.kind is VerdictKind.STALLED
    assert "window 93 s" in verdict.evidence
    # The earlier figure is handed back with the verdict, to be kept for the next run.
    assert verdict.longest_step == learned


def test_the_floor_and_the_startup_window_apply(fixture_text: Load) -> None:
    reads = reads_of(fixture_text, "wedge-1", "wedge-2", "wedge-3", wait=30.0)
    floor = WedgeRules(wedge_after=60.0)
    assert "window 60 s: wedge_after 60 s" in settled(decide(reads, rules=floor)).evidence
    # A process 200 s old at the reads' times, within startup_grace: 300 s window.
    start = parse_metrics(capture(fixture_text, "wedge-1")).process_start
    assert start is not None
    young = [Read(start + 200 + index * 150.0, read.signals) for index, read in enumerate(reads)]
    verdict = settled(decide(young))
    assert verdict.kind is VerdictKind.WEDGED
    assert "within startup_grace 900 s: startup_wedge_after 300 s" in verdict.evidence
    assert settled(decide([*young[:2], Read(start + 400, reads[2].signals)])).kind is (
        VerdictKind.STALLED
    )


def test_a_read_that_failed_within_a_freeze_does_not_start_the_freeze_again(
    fixture_text: Load,
) -> None:
    """One /metrics timeout ended the freeze: with a window of minutes, a wedge read
    through an occasional timeout was never proven. Counters only grow within a
    process, so the reads either side of a failed one show it made no progress."""
    w1, w2, w3 = (parse_metrics(capture(fixture_text, f"wedge-{i}")) for i in (1, 2, 3))
    rules = WedgeRules(wedge_after=60.0)
    gap = problem(ReadProblem.UNRESPONSIVE, "GET /metrics: no answer", at=T0 + 30)
    reads = [Read(T0, w1), gap, Read(T0 + 60, w2), Read(T0 + 90, w3)]
    verdict = settled(decide(reads, rules=rules))
    assert verdict.kind is VerdictKind.WEDGED
    assert "steps 8660→?→8660→8660" in verdict.evidence
    # The newest wait must be read at both ends: a read just after a failed one may
    # show counters its held-up API server has not caught up with yet.
    newest_unread = decide(reads[:3], rules=WedgeRules(), max_reads=3)
    assert not (isinstance(newest_unread, Verdict) and newest_unread.kind is VerdictKind.WEDGED)
    # Another process after the gap (a new start time) is no freeze across it.
    start = w1.process_start
    assert start is not None
    restarted = [parse_metrics(set_sample(capture(fixture_text, f"wedge-{i}"),
        "process_start_time_seconds", f"{start + 20:.1f}")) for i in (2, 3)]  # fmt: skip
    after_a_restart = [Read(T0, w1), gap, Read(T0 + 60, restarted[0]), Read(T0 + 90, restarted[1])]
    decision = decide(after_a_restart, rules=rules)
    assert not (isinstance(decision, Verdict) and decision.kind is VerdictKind.WEDGED)


def test_a_freeze_without_start_times_is_not_carried_across_a_failed_read(
    fixture_text: Load,
) -> None:
    """vLLM's multiprocess mode publishes no start time: across a failed read there is no
    telling the process is the same one, so the freeze ends there (``_stall_streak``), as
    it does at a new start time; only the reads after the gap count."""
    text = set_sample(
        capture(fixture_text, "multiapi-after-load"), "vllm:num_requests_running", "2.0"
    )
    frozen = parse_metrics(text)
    assert frozen.process_start is None
    rules = WedgeRules(wedge_after=60.0)
    gap = problem(ReadProblem.UNRESPONSIVE, "GET /metrics: no answer", at=T0 + 30)
    reads = [Read(T0, frozen), gap, Read(T0 + 60, frozen), Read(T0 + 90, frozen)]
    decision = decide(reads, rules=rules)
    assert not (isinstance(decision, Verdict) and decision.kind is VerdictKind.WEDGED), decision
    # Control: the same reads without the gap are a wedge.
    steady = [Read(T0 + 30 * index, frozen) for index in range(4)]
    assert settled(decide(steady, rules=rules, max_reads=4)).kind is VerdictKind.WEDGED


def test_a_process_of_unknown_age_that_finished_nothing_yet_gets_the_startup_window(
    fixture_text: Load,
) -> None:
    # Several API servers: vLLM's multiprocess mode publishes no process start time, so
    # a young engine compiling on its first requests had no startup window, and was
    # wedged in two waits (a restarted one again and again, until retired).
    text = set_sample(
        capture(fixture_text, "multiapi-after-load"), "vllm:num_requests_running", "2.0"
    )
    assert parse_metrics(text).process_start is None
    first = set_sample(text, "vllm:request_success_total", "0.0")
    verdict = walk(timed([first, first, first])).verdict
    assert verdict.kind is VerdictKind.STALLED  # not proof: its reads ran out first
    assert "process age unknown (several API servers) and no request finished" in (verdict.evidence)
    assert "startup_wedge_after 300 s" in verdict.evidence
    # Once a request has finished, the process is not taken for a young one.
    assert walk(timed([text, text, text])).verdict.kind is VerdictKind.WEDGED


def cpu_reads(load: Load, *used: float, wait: float = WAIT) -> list[Read]:
    frozen = [capture(load, name) for name in ("wedge-1", "wedge-2", "wedge-3")]
    total = 0.0
    reads = []
    for index, (text, seconds) in enumerate(zip(frozen, used, strict=True)):
        total += seconds
        reads.append(Read(T0 + index * wait, parse_metrics(text), cpu=CpuSample(total, (7, 8))))
    return reads


def test_a_young_engine_that_used_no_cpu_is_wedged_in_two_waits(fixture_text: Load) -> None:
    reads = cpu_reads(fixture_text, 100.0, 0.0, 0.0)
    long_steps = LongestStep(80.0, "engine 0: an inter-token gap over 80 s")
    verdict = settled(decide(reads, learned=long_steps, rules=WedgeRules(wedge_after=600)))
    assert verdict.kind is VerdictKind.WEDGED
    assert "engine processes used 0.00 s CPU in 10.0 s: stopped or deadlocked" in (verdict.evidence)


def test_an_engine_that_burns_cpu_while_frozen_is_doubt_until_its_window(
    fixture_text: Load,
) -> None:
    reads = cpu_reads(fixture_text, 100.0, 9.8, 9.8)
    verdict = settled(decide(reads, learned=LongestStep(80.0, "gaps"), max_reads=3))
    assert verdict.kind is VerdictKind.STALLED
    assert "engine processes used 19.6 s CPU in 10.0 s: compiling or computing" in (
        verdict.evidence
    )
    # CPU never proves health: with no long step known, two waits still prove the wedge.
    assert settled(decide(reads)).kind is VerdictKind.WEDGED


@pytest.mark.parametrize("step", [0.0, 3600.0], ids=["steady", "stepped"])
def test_a_wall_clock_stepped_forward_proves_no_freeze_and_no_idle_cpu(
    fixture_text: Load, step: float
) -> None:
    """Reads and CPU samples on the steady clock as the reader stamps them (``Read.tick``,
    ``CpuSample.at``), the wall clock stepped an hour forward before the third read: an
    engine computing a whole CPU inside a long step is still only in doubt."""
    reads = []
    for index, read in enumerate(cpu_reads(fixture_text, 100.0, 5.0, 5.0)):
        tick = 500.0 + index * WAIT
        cpu = replace(read.cpu, at=tick) if read.cpu is not None else None
        wall = read.at + (step if index == 2 else 0.0)
        reads.append(replace(read, at=wall, sent=wall, tick=tick, sent_tick=tick, cpu=cpu))
    verdict = settled(decide(reads, learned=LongestStep(80.0, "gaps"), max_reads=3))
    assert verdict.kind is VerdictKind.STALLED, verdict.evidence
    assert "no progress over 2 waits (10.0 s)" in verdict.evidence
    assert "engine processes used 10.0 s CPU in 10.0 s: compiling or computing" in (
        verdict.evidence
    )


def test_cpu_of_other_processes_is_not_compared(fixture_text: Load) -> None:
    reads = cpu_reads(fixture_text, 100.0, 0.0, 0.0)
    reads[-1] = Read(reads[-1].at, reads[-1].signals, cpu=CpuSample(100.0, (7, 9)))
    verdict = settled(decide(reads, learned=LongestStep(80.0, "gaps"), max_reads=3))
    assert verdict.kind is VerdictKind.STALLED
    assert "CPU" not in verdict.evidence


def timed_out(at: float) -> Answer:
    return Answer(at, False, "failed: no complete HTTP answer within 10 s", timed_out=True)


def test_a_tiny_request_stuck_behind_a_long_step_is_stalled_not_unanswered(
    fixture_text: Load,
) -> None:
    # The second case: gauges say idle while the engine is inside its first
    # long step; the tiny request queues behind it and times out; no counter moves.
    idle = with_gap_histogram(capture(fixture_text, "idle-2"), "+Inf")
    reads = timed([idle, idle])
    assert isinstance(decide(reads[:1]), SendTinyRequest)
    answer = timed_out(T0 + 3.0)
    assert isinstance(decide(reads[:1], answer), TakeRead)
    verdict = settled(decide(reads, answer))
    assert verdict.kind is VerdictKind.STALLED
    assert verdict.requests_sent == 1
    assert "no counter moved over 5.0 s" in verdict.evidence
    assert "window 240 s" in verdict.evidence


def test_a_tiny_request_timeout_on_an_engine_with_short_steps_is_unanswered(
    fixture_text: Load,
) -> None:
    reads = reads_of(fixture_text, "idle-1", "idle-2")
    verdict = settled(decide(reads, timed_out(T0 + 3.0)))
    assert verdict.kind is VerdictKind.UNANSWERED
    # A refusal is no timeout: no extra read is taken for it.
    refused = Answer(T0 + 1, False, "failed: connection refused")
    assert settled(decide(reads[:1], refused)).kind is VerdictKind.UNANSWERED


def test_a_young_process_that_times_out_the_tiny_request_is_doubt(fixture_text: Load) -> None:
    text = capture(fixture_text, "restart-1")
    start = parse_metrics(text).process_start
    assert start is not None
    reads = [Read(start + 60, parse_metrics(text)), Read(start + 65, parse_metrics(text))]
    verdict = settled(decide(reads, timed_out(start + 62)))
    assert verdict.kind is VerdictKind.STALLED
    assert "startup_wedge_after 300 s" in verdict.evidence


class CountedName(str):
    """An engine name that counts how often it is compared, to catch per-engine scans."""

    comparisons = 0

    def __eq__(self, other: object) -> bool:
        CountedName.comparisons += 1
        return str.__eq__(self, other)

    __hash__ = str.__hash__


def test_judging_many_engines_compares_each_engine_a_bounded_number_of_times() -> None:
    # 4,000 data-parallel engines: a lookup that scans the engines for every engine made
    # ~8 million name comparisons per pair of reads (40,000 engines: minutes per verdict).
    count = 4_000

    def frozen_engines(steps: float) -> Signals:
        return Signals(
            tuple(
                EngineSignals(CountedName(str(index)), running=1.0, waiting=0.0, steps=steps)
                for index in range(count)
            ),
            process_start=1.0,
        )

    reads = [Read(T0 + index * WAIT, frozen_engines(10.0)) for index in range(3)]
    CountedName.comparisons = 0
    verdict = settled(decide(reads))
    assert verdict.kind is VerdictKind.WEDGED
    assert CountedName.comparisons < 50 * count
    moving = [Read(T0, frozen_engines(10.0)), Read(T0 + WAIT, frozen_engines(11.0))]
    CountedName.comparisons = 0
    busy = settled(decide(moving))
    assert busy.kind is VerdictKind.BUSY
    assert CountedName.comparisons < 50 * count
    # The evidence names a few engines and counts the rest.
    assert "and 3992 more engines progressed" in busy.evidence
    assert len(busy.evidence) < 1000


@pytest.mark.slow
def test_a_legal_text_with_40000_engines_gets_a_verdict(fixture_text: Load) -> None:
    # The hostile server: 40,000 data-parallel engines, each with work, in about
    # 8 MB (under the 16 MiB cap). Before the engine lookups were indexed this took
    # minutes per verdict; the comparison count above is the bound, this the whole path.
    def text(steps: int) -> str:
        lines = ["process_start_time_seconds 1.0"]
        for index in range(40_000):
            engine = f'{{engine="{index}"}}'
            lines.append(f"vllm:num_requests_running{engine} 1")
            lines.append(f"vllm:num_requests_waiting{engine} 0")
            lines.append(f"vllm:iteration_tokens_total_count{engine} {steps}")
        return "\n".join(lines) + "\n"

    frozen, moved = text(10), text(11)
    assert 3_000_000 < len(frozen) < 16 * 1024 * 1024
    still, later = parse_metrics(frozen), parse_metrics(moved)
    assert len(still.engines) == 40_000
    reads = [Read(T0 + index * WAIT, still) for index in range(3)]
    wedged = settled(decide(reads))
    assert wedged.kind is VerdictKind.WEDGED
    busy = settled(decide([reads[0], Read(T0 + WAIT, later)]))
    assert busy.kind is VerdictKind.BUSY
    assert "and 39992 more engines progressed" in busy.evidence


def test_a_tiny_request_timeout_while_the_engine_used_no_cpu_is_unanswered(
    fixture_text: Load,
) -> None:
    idle = parse_metrics(with_gap_histogram(capture(fixture_text, "idle-2"), "+Inf"))
    reads = [
        Read(T0, idle, cpu=CpuSample(50.0, (7,))),
        Read(T0 + WAIT, idle, cpu=CpuSample(50.0, (7,))),
    ]
    verdict = settled(decide(reads, timed_out(T0 + 3.0)))
    assert verdict.kind is VerdictKind.UNANSWERED
    assert "used 0.00 s CPU in 5.0 s" in verdict.evidence


def test_cpu_samples_that_start_late_must_span_two_waits_themselves(fixture_text: Load) -> None:
    frozen = parse_metrics(capture(fixture_text, "wedge-1"))
    long_steps = LongestStep(80.0, "engine 0: an inter-token gap over 80 s")
    samples = [None, CpuSample(5.0, (7,)), CpuSample(5.0, (7,)), CpuSample(5.0, (7,))]
    reads = [Read(T0 + index * WAIT, frozen, cpu=cpu) for index, cpu in enumerate(samples)]
    # Two samples (one wait of CPU evidence) prove nothing yet ...
    assert isinstance(decide(reads[:3], learned=long_steps, max_reads=10), TakeRead)
    # ... three do: the stopped engine is wedged without waiting out its 240 s window.
    verdict = settled(decide(reads, learned=long_steps, max_reads=10))
    assert verdict.kind is VerdictKind.WEDGED
    assert "used 0.00 s CPU in 10.0 s" in verdict.evidence


def test_stopped_samples_that_start_late_must_span_two_waits_themselves(
    fixture_text: Load,
) -> None:
    # As for CPU used: a stopped engine seen in two samples (one wait of them) proves
    # nothing yet, however long the freeze before the sampling began.
    frozen = parse_metrics(capture(fixture_text, "wedge-1"))
    long_steps = LongestStep(80.0, "engine 0: an inter-token gap over 80 s")
    stopped = [CpuSample(5.0 + 4.9 * index, (7, 8), stopped=(7,)) for index in range(3)]
    samples = [None, *stopped]
    reads = [Read(T0 + index * WAIT, frozen, cpu=cpu) for index, cpu in enumerate(samples)]
    assert isinstance(decide(reads[:3], learned=long_steps, max_reads=10), TakeRead)
    verdict = settled(decide(reads, learned=long_steps, max_reads=10))
    assert verdict.kind is VerdictKind.WEDGED
    assert "engine process 7 stayed stopped by a signal (state T) throughout" in verdict.evidence


def test_an_engine_process_stopped_throughout_proves_the_wedge_while_others_spin(
    fixture_text: Load,
) -> None:
    frozen = parse_metrics(capture(fixture_text, "wedge-1"))
    long_steps = LongestStep(80.0, "engine 0: an inter-token gap over 80 s")
    samples = [CpuSample(5.0 + 4.9 * index, (7, 8), stopped=(7,)) for index in range(3)]
    reads = [Read(T0 + index * WAIT, frozen, cpu=cpu) for index, cpu in enumerate(samples)]
    verdict = settled(decide(reads, learned=long_steps, max_reads=10))
    assert verdict.kind is VerdictKind.WEDGED
    assert "engine process 7 stayed stopped by a signal (state T) throughout" in verdict.evidence
    # Stopped in one sample only (a debugger that let go) proves nothing.
    samples[1] = CpuSample(9.9, (7, 8))
    reads = [Read(T0 + index * WAIT, frozen, cpu=cpu) for index, cpu in enumerate(samples)]
    assert isinstance(decide(reads, learned=long_steps, max_reads=10), TakeRead)


def test_a_stopped_engine_whose_workers_used_no_cpu_either_is_named_stopped(
    fixture_text: Load,
) -> None:
    # vLLM's worker may poll a little or not at all while its engine core is stopped;
    # the evidence names the stopped process either way, with the CPU figure beside it.
    frozen = parse_metrics(capture(fixture_text, "wedge-1"))
    long_steps = LongestStep(80.0, "engine 0: an inter-token gap over 80 s")
    samples = [CpuSample(5.0 + 0.005 * index, (7, 8), stopped=(7,)) for index in range(3)]
    reads = [Read(T0 + index * WAIT, frozen, cpu=cpu) for index, cpu in enumerate(samples)]
    verdict = settled(decide(reads, learned=long_steps, max_reads=10))
    assert verdict.kind is VerdictKind.WEDGED
    assert "engine process 7 stayed stopped by a signal (state T) throughout" in verdict.evidence
    assert "stopped or deadlocked, not computing" in verdict.evidence


@pytest.mark.parametrize(
    ("used", "shown"), [(5.0, "compiling or computing"), (0.0, "stopped or deadlocked")]
)
def test_a_tiny_request_held_by_a_stopped_engine_is_unanswered(
    fixture_text: Load, used: float, shown: str
) -> None:
    # Whether its worker polled meanwhile or not, the stopped process is what is named.
    idle = parse_metrics(with_gap_histogram(capture(fixture_text, "idle-2"), "+Inf"))
    reads = [
        Read(T0, idle, cpu=CpuSample(50.0, (7, 8), stopped=(7,))),
        Read(T0 + WAIT, idle, cpu=CpuSample(50.0 + used, (7, 8), stopped=(7,))),
    ]
    verdict = settled(decide(reads, timed_out(T0 + 3.0)))
    assert verdict.kind is VerdictKind.UNANSWERED
    assert "engine process 7 stopped by a signal" in verdict.evidence
    assert shown in verdict.evidence


def test_gauges_that_add_up_past_a_float_are_a_verdict_not_an_error(fixture_text: Load) -> None:
    # Two engines claiming 1e308 running each summed to inf, and int(inf) raised: the
    # backend was "not judged" on every read, a wedge on its engine 0 hidden behind it.
    hostile = "".join(
        f'vllm:num_requests_running{{engine="{engine}",model_name="m"}} 1e308\n'
        for engine in ("1", "2")
    )
    signals = parse_metrics(capture(fixture_text, "wedge-2") + hostile)
    reads = [Read(T0 + WAIT * index, signals=signals) for index in range(3)]
    verdict = decide(reads, max_reads=3)
    assert isinstance(verdict, Verdict) and verdict.kind is VerdictKind.WEDGED
    assert verdict.running is None
    # The same with deferred requests, which the first read's description summed.
    deferred = "".join(
        f'vllm:num_requests_running{{engine="{engine}",model_name="m"}} 0\n'
        f'vllm:num_requests_waiting{{engine="{engine}",model_name="m"}} 1e308\n'
        f'vllm:num_requests_waiting_by_reason{{engine="{engine}",model_name="m",'
        'reason="deferred"} 1e308\n'
        for engine in ("1", "2")
    )
    signals = parse_metrics(capture(fixture_text, "wedge-2") + deferred)
    first = decide([Read(T0, signals=signals)], max_reads=3)
    assert not isinstance(first, Verdict)  # a first read, described, not an error


def test_a_new_process_that_turns_our_key_away_is_news_unproven_not_a_failure(
    fixture_text: Load,
) -> None:
    # A key rotated with the restart, most often: CRITICAL before, and no word of the key.
    signals = parse_metrics(capture(fixture_text, "idle-1"))
    assert signals.process_start is not None
    before = replace(signals, process_start=signals.process_start - 600.0)
    refused = Answer(T0, False, "not sent: GET /v1/models answered HTTP 401", refused=True)
    verdict = decide([Read(T0, signals=signals)], refused, baseline=before)
    assert isinstance(verdict, Verdict) and verdict.kind is VerdictKind.RESTARTED
    assert verdict.judged and not verdict.healthy and "api_key_env" in verdict.evidence
    assert verdict_exit_code(verdict) is ExitCode.WARNING


def test_a_young_engine_compiling_across_the_end_of_startup_grace_is_not_wedged_at_once(
    fixture_text: Load,
) -> None:
    """A big model loads for ~13 minutes (process_start is the API server's start), its
    first request arrives and compiles a new shape: a young engine's long first step,
    inside startup_wedge_after (300 s). The freeze starts at age 880 s; 30 s later the
    process turns 900 s old and the startup window vanishes mid-step: wedged 20 s into
    a step the same rules gave 300 s when it began."""
    signals = parse_metrics(capture(fixture_text, "serve3-busy-1"))  # 4 running, real
    start = signals.process_start
    assert start is not None
    reads = [Read(start + 880 + index * WAIT, signals) for index in range(10)]  # ages 880..925
    verdict = walk(reads, max_reads=len(reads)).verdict
    assert verdict.kind is not VerdictKind.WEDGED, verdict.evidence


def test_a_busy_engine_read_again_after_one_slow_metrics_answer_is_not_stalled(
    fixture_text: Load,
) -> None:
    """watch: busy-1, then one /metrics that took longer than the timeout (an API server
    event loop saturated by streaming; the apifreeze captures show the engine generating
    on while its API server does not answer), then busy-2: steps 998 -> 1682, generated
    3329 -> 6065 across the gap. Counters only grow within a process (same start time),
    so the engine progressed; the failed read was already judged (unresponsive) on its
    own. The read after it must not say "no engine progressed in the last wait"."""
    settings = ProbeSettings()
    window: list[Read] = []
    slow = problem(ReadProblem.UNRESPONSIVE, "no complete answer within 5 s", T0 + WAIT)
    first, last = reads_of(fixture_text, "busy-1", "busy-2", wait=2 * WAIT)
    for read in (first, slow, last):
        keep_read(window, read, settings.paced_read_limit)
    # What examine_once asks after the third read.
    decision = decide(window, max_reads=settings.paced_read_limit, paced_wait=settings.wait)
    assert isinstance(decision, Verdict)
    assert decision.healthy and decision.kind is VerdictKind.BUSY, decision.evidence


def _watch_stopped_engine(fixture_text: Load, first_age: float, reads: int) -> list[object]:
    """watch's reading of an engine whose core was SIGSTOPped (wedge-1: 4 running, 8
    waiting, every counter frozen), its CPU sampled exactly when ``wants_cpu`` says so
    (probe._with_cpu); the stopped process shows in every sample taken."""
    frozen = parse_metrics(capture(fixture_text, "wedge-1"))
    assert frozen.process_start is not None
    settings = ProbeSettings(wait=WAIT)
    window: list[Read] = []
    decisions: list[object] = []
    for index in range(reads):
        read = Read(frozen.process_start + first_age + index * WAIT, frozen)
        if settings.wants_cpu([*window, read], None, WedgeRules()):
            read = Read(read.at, frozen, cpu=CpuSample(5.0, (7, 8), stopped=(7,)))
        keep_read(window, read, settings.paced_read_limit)
        decisions.append(decide(window, max_reads=settings.paced_read_limit))
    return decisions


def test_a_stopped_engine_whose_freeze_began_young_is_still_sampled_and_proven(
    fixture_text: Load,
) -> None:
    """A freeze keeps the youth it began with (window 300 s), and so must the choice to
    sample CPU: taken at the newest read, once the process turned startup_grace (900 s)
    old it said "two waits, CPU not worth sampling", the samples that prove a stopped
    engine at two waits stopped coming, and the wedge waited out the whole window."""
    # Control: a freeze that begins at 800 s is sampled throughout and proven at two waits.
    early = _watch_stopped_engine(fixture_text, 800.0, 6)
    assert any(isinstance(d, Verdict) and d.kind is VerdictKind.WEDGED for d in early)
    # The same freeze beginning at 896 s: 12 reads (55 s), never proven.
    late = _watch_stopped_engine(fixture_text, 896.0, 12)
    assert any(isinstance(d, Verdict) and d.kind is VerdictKind.WEDGED for d in late), [
        d.reason if isinstance(d, TakeRead) else d for d in late[-2:]
    ]


def test_a_young_engine_compiling_across_startup_grace_is_doubt_not_unanswered(
    fixture_text: Load,
) -> None:
    """A fresh server (idle-1: nothing run yet) gets its first request at age 880 s and
    compiles: its gauges are published when that first step ends, so it shows no work,
    and our tiny request (sent at 895 s) queues behind the step and times out at 905 s.
    Youth taken at the newest read, the process had turned 900 s old meanwhile, and the
    timeout was `unanswered`, a failure (three condemn a healthy engine mid-compile)
    where ten seconds younger it was doubt. It is taken when the request was sent."""
    idle = parse_metrics(capture(fixture_text, "idle-1"))
    assert idle.process_start is not None
    start = idle.process_start
    reads = [Read(start + 885.0, idle), Read(start + 890.0, idle), Read(start + 895.0, idle)]
    timed_out = Answer(start + 905.1, False, "timed out after 10.0 s", timed_out=True)
    reads.append(Read(start + 906.0, idle))
    decision = decide(reads, timed_out, max_reads=65)
    assert not (isinstance(decision, Verdict) and decision.kind is VerdictKind.UNANSWERED), decision
    # Ten seconds younger, the same reads are doubt, never a failure.
    younger = [Read(read.at - 10.0, idle) for read in reads]
    earlier = Answer(timed_out.at - 10.0, False, "timed out after 10.0 s", timed_out=True)
    assert settled(decide(younger, earlier, max_reads=65)).kind is VerdictKind.STALLED


def test_watch_proves_a_freeze_whose_learned_window_is_longer_than_its_reads_span(
    fixture_text: Load,
) -> None:
    """A CPU engine whose first prompt compiled for 214 s learned a 218 s step (prefill
    106 ms per token x 2,048 tokens in one step): its window is 654 s, past the 320 s that
    watch's 65 reads span at the defaults. Its EngineCore then freezes for good with 4
    running and 8 waiting (wedge-pre, then wedge-1..4 over and over, reads 5 s apart with
    their steady ticks, as examine_once keeps and judges them). Frozen past its window,
    it is wedged; sliding past the freeze's first read, it was "stalled" for ever."""
    settings = ProbeSettings(wait=WAIT)
    limit = settings.paced_read_limit
    learned = LongestStep(218.0, "engine 0: prefill 106 ms per prompt token x up to 2048")
    pre = parse_metrics(capture(fixture_text, "wedge-pre"))
    frozen = [parse_metrics(capture(fixture_text, f"wedge-{n}")) for n in (1, 2, 3, 4)]
    window: list[Read] = []
    kinds: list[VerdictKind] = []
    for index in range(160):  # 800 s
        signals = pre if index == 0 else frozen[index % 4]
        at = T0 + index * WAIT
        read = Read(at, signals, sent=at - 0.01, tick=at - T0, sent_tick=at - T0 - 0.01)
        keep_read(window, read, limit)
        assert len(window) <= limit
        decision = decide(window, max_reads=limit, learned=learned, paced_wait=WAIT)
        if isinstance(decision, Verdict):
            kinds.append(decision.kind)
            if decision.kind is VerdictKind.WEDGED:
                assert "window 654 s" in decision.evidence, decision.evidence
                assert "(655.0 s)" in decision.evidence, decision.evidence
                break
    assert kinds[-1] is VerdictKind.WEDGED, kinds[-3:]
    assert VerdictKind.WEDGED not in kinds[:-1]


def test_a_long_step_the_old_process_recorded_outlives_a_restart_seen_between_reads(
    fixture_text: Load,
) -> None:
    """restart-0 (the old server, its histograms holding a 20 s inter-token gap) then
    restart-1 (the new one, empty): the hardware stays, and the figure is kept across
    restarts; taken from the new process's text alone, it was lost with the old one, and
    the next long step of the new process past its startup grace was wedged at two waits."""
    reads = reads_of(fixture_text, "restart-0", "restart-1")
    verdict = settled(decide(reads, answer(True, reads[-1].at + 0.1)))
    assert verdict.kind is VerdictKind.RESTARTED
    assert verdict.longest_step is not None and verdict.longest_step.seconds == 20.0


def test_work_gauges_without_any_counter_or_kv_use_never_prove_a_wedge(
    fixture_text: Load,
) -> None:
    """busy-1..3 (a busy server: waiting 8 -> 8 -> 4) with only its running and waiting
    gauges and its start time left (counters filtered out or lost on the way): nothing
    there can show progress, so no freeze is proven. It was "wedged" at the third read,
    its evidence "steps ?→?→?", and restarted."""
    kept = ("vllm:num_requests_running", "vllm:num_requests_waiting", "process_start")

    def gauges(name: str) -> str:
        lines = capture(fixture_text, name).splitlines()
        return "\n".join(line for line in lines if line.startswith(kept)) + "\n"

    reads = timed([gauges(name) for name in ("busy-1", "busy-2", "busy-3")])
    assert reads[0].signals is not None and reads[0].signals.engines[0].steps is None
    verdict = walk(reads).verdict
    assert verdict.kind is not VerdictKind.WEDGED, verdict.evidence


def test_work_gauges_with_a_steady_kv_use_but_no_counter_never_prove_a_wedge(
    fixture_text: Load,
) -> None:
    """prefill2-1..3 (a busy server: 98 requests, 100+ engine steps and 400+ tokens a
    wait) with its KV use steady at 0.0027 while it works. Its counters filtered out on
    the way, the running/waiting/KV gauges left: an unchanged KV use over two waits is no
    freeze where no counter is there to show the steps, as gauges alone are not."""
    kept = (
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "process_start",
    )

    def gauges(name: str) -> str:
        lines = capture(fixture_text, name).splitlines()
        return "\n".join(line for line in lines if line.startswith(kept)) + "\n"

    reads = timed([gauges(name) for name in ("prefill2-1", "prefill2-2", "prefill2-3")])
    engine = reads[0].signals.engines[0] if reads[0].signals is not None else None
    assert engine is not None and engine.steps is None and engine.kv_usage is not None
    verdict = walk(reads).verdict
    assert verdict.kind is not VerdictKind.WEDGED, verdict.evidence


def test_a_tiny_request_that_timed_out_is_kept_in_the_restart_verdict_after_it(
    fixture_text: Load,
) -> None:
    # Idle, asked, the request timed out (an engine with a long step), and the reads after
    # it came from a new process that shows work and progress: a request was sent, and
    # the verdict says so, as a busy one after it does.
    def new_process(name: str) -> str:
        return capture(fixture_text, name).replace(
            "process_start_time_seconds 1.79602437626e+09",
            "process_start_time_seconds 1.79602467547e+09",
        )

    reads = timed([capture(fixture_text, "idle-1"), new_process("busy-1"), new_process("busy-2")])
    step = LongestStep(60.0, "a long step")
    assert isinstance(decide(reads[:1], learned=step), SendTinyRequest)
    timed_out = Answer(T0 + 10, False, "timed out after 10.0 s", timed_out=True)
    assert isinstance(decide(reads[:1], timed_out, max_reads=61, learned=step), TakeRead)
    assert isinstance(decide(reads[:2], timed_out, max_reads=61, learned=step), TakeRead)
    verdict = settled(decide(reads, timed_out, max_reads=61, learned=step))
    assert verdict.kind is VerdictKind.RESTARTED, verdict.evidence
    assert verdict.requests_sent == 1, verdict.evidence
    assert verdict.answer is timed_out


def test_progress_stands_when_the_tiny_request_was_turned_away_for_our_key(
    fixture_text: Load,
) -> None:
    # A key turned away is no failure of the engine: the counters that moved while the
    # work finished still prove it busy, as without the request.
    reads = reads_of(fixture_text, "busy-3", "busy-after")
    refused = Answer(T0 + WAIT + 0.1, False, "answered HTTP 401", refused=True)
    verdict = settled(decide(reads, refused))
    assert (verdict.kind, verdict.healthy) == (VerdictKind.BUSY, True)


def test_a_freeze_ends_where_the_process_changed_across_a_failed_read(fixture_text: Load) -> None:
    # Counters of two processes are never compared: a replacement frozen at counters
    # no higher than its predecessor's did not continue its freeze across the gap.
    def started(name: str, start: str) -> str:
        return set_sample(capture(fixture_text, name), "process_start_time_seconds", start)

    old = Read(T0, parse_metrics(started("wedge-1", "1796024376.26")))
    failed = problem(ReadProblem.UNRESPONSIVE, "timed out after 5.0 s", T0 + WAIT)
    new = [
        Read(T0 + index * WAIT, parse_metrics(started(name, "1796024500.0")))
        for index, name in ((2, "wedge-2"), (3, "wedge-3"))
    ]
    assert freeze_began([old, failed, *new]) == 2
    # The same process on both sides of the gap: the freeze is read across it.
    same = [
        Read(read.at, parse_metrics(started(name, "1796024376.26")))
        for read, name in zip(new, ("wedge-2", "wedge-3"), strict=True)
    ]
    assert freeze_began([old, failed, *same]) == 0


def test_a_new_process_without_vllm_series_after_an_asleep_read_is_asked(
    fixture_text: Load,
) -> None:
    # Read asleep, then another process answered /metrics without vLLM series: a new
    # process starts awake (``asleep_now``), so it is asked as any server without series.
    # Kept asleep, it was never asked, routed to nor re-admitted again.
    sleeping = [Read(T0, parse_metrics(asleep(capture(fixture_text, "idle-1"))))]
    start = _signals_of(sleeping[-1]).process_start
    assert start is not None
    other = parse_metrics(f"process_start_time_seconds {start + 60:.1f}\n")
    assert isinstance(decide([*sleeping, Read(T0 + WAIT, other)]), SendTinyRequest)
    # The same process, still without its series: asleep as last shown, not asked.
    same = parse_metrics(f"process_start_time_seconds {start!r}\n")
    assert settled(decide([*sleeping, Read(T0 + WAIT, same)])).requests_sent == 0


def test_work_on_an_engine_with_no_comparable_read_before_it_waits_one_more_read(
    fixture_text: Load,
) -> None:
    # Engine 0 had work, then only engine 1 is shown with work: no read before it to
    # compare, so no baseline and no doubt yet; a check reads once more, not "stalled".
    first = capture(fixture_text, "wedge-1")
    moved = relabel(capture(fixture_text, "wedge-2"), "1")
    reads = timed([first, moved])
    decision = decide(reads, max_reads=3)
    assert isinstance(decision, TakeRead), decision
    assert "no baseline to compare yet" in decision.reason


def test_a_restart_with_work_seen_at_the_third_read_gets_one_wait_of_its_own(
    fixture_text: Load,
) -> None:
    # A new process with work at the third read: judged on its own next read where the
    # run may take one, not at once from a single read of it.
    reads = reads_of(fixture_text, "busy-2", "busy-3", "dead-1", "dead-2")
    decision = decide(reads[:3], max_reads=4)
    assert isinstance(decision, TakeRead), decision
    assert "judging it from a fresh baseline" in decision.reason
    verdict = settled(decide(reads, max_reads=4))
    assert verdict.kind is VerdictKind.RESTARTED and not verdict.healthy


def test_a_wall_clock_stepped_since_the_process_started_keeps_it_young(
    fixture_text: Load,
) -> None:
    # The process is 200 s old on the steady clock (``Read.born``), though the wall
    # clock, stepped an hour forward since it started, makes it over an hour old: its
    # startup window applies, and two waits of a compiling engine prove nothing.
    start = parse_metrics(capture(fixture_text, "wedge-1")).process_start
    assert start is not None
    reads = []
    for index, read in enumerate(reads_of(fixture_text, "wedge-1", "wedge-2", "wedge-3")):
        tick = 1000.0 + index * WAIT
        wall = start + 3800.0 + index * WAIT
        reads.append(replace(read, at=wall, tick=tick, sent_tick=tick, born=800.0))
    verdict = settled(decide(reads))
    assert verdict.kind is VerdictKind.STALLED, verdict.evidence
    assert "process 200 s old, within startup_grace" in verdict.evidence


def test_no_work_beside_unknown_work_is_judged_as_unknown_work(fixture_text: Load) -> None:
    # Engine 0 idle, engine 1 without running/waiting gauges (several API servers before
    # their first request): its work is unknown, and the evidence says so.
    text = (
        capture(fixture_text, "idle-1")
        + "\n"
        + relabel(capture(fixture_text, "multiapi-idle-1"), "1")
    )
    decision = decide(timed([text]))
    assert isinstance(decision, SendTinyRequest)
    assert decision.reason.startswith("work unknown"), decision.reason


def test_work_that_appeared_after_idle_reads_of_a_window_waits_for_its_baseline(
    fixture_text: Load,
) -> None:
    # A watch window holds idle reads before the first one with work: that work has no
    # baseline yet, so it is read once more where reads are left, not "stalled" at once.
    idle = capture(fixture_text, "idle-1")
    work = set_sample(idle, "vllm:num_requests_running", "2.0")
    reads = timed([idle, idle, work])
    decision = decide(reads, max_reads=4)
    assert isinstance(decision, TakeRead), decision
    assert "no baseline to compare yet" in decision.reason
    assert settled(decide(reads, max_reads=3)).kind is VerdictKind.STALLED


def test_a_freeze_on_the_steady_clock_lasts_until_the_newest_read_was_asked_for(
    fixture_text: Load,
) -> None:
    # As on the wall clock: the third read asked for at tick 2.34, taken in at 3.2.
    first, second, third = (
        parse_metrics(capture(fixture_text, name)) for name in ("wedge-1", "wedge-2", "wedge-3")
    )
    paced = {"paced_wait": 2.0, "max_reads": 61}  # two waits: 3 s at least
    reads = [
        Read(T0, first, tick=0.0, sent_tick=-1.5),
        Read(T0 + 0.43, second, tick=0.43, sent_tick=0.42),
        Read(T0 + 3.2, third, tick=3.2, sent_tick=2.34),
    ]
    undecided = decide(reads, **paced)  # type: ignore[arg-type]
    assert isinstance(undecided, TakeRead), undecided
    assert "in 2.3 s, less than 3 s of waits" in undecided.reason


def test_busy_rates_are_taken_on_the_steady_clock(fixture_text: Load) -> None:
    # The wall clock stepped an hour forward between the two reads, 1.56 s apart.
    reads = [
        Read(1796024490.647, parse_metrics(capture(fixture_text, "busy-1")), tick=10.0),
        Read(1796028092.207, parse_metrics(capture(fixture_text, "busy-2")), tick=11.56),
    ]
    verdict = settled(decide(reads))
    assert verdict.kind is VerdictKind.BUSY
    assert verdict.tokens_per_s == pytest.approx(1754, rel=0.01)
    assert "progressed over 1.6 s" in verdict.evidence


def test_a_timeout_exactly_as_long_as_the_window_is_unanswered(fixture_text: Load) -> None:
    # Only a window longer than the request waited excuses its timeout: one just as
    # long means the engine should have answered within it.
    reads = reads_of(fixture_text, "idle-1", "idle-2")
    verdict = settled(decide(reads, timed_out(T0 + 3.0), rules=WedgeRules(wedge_after=3.0)))
    assert verdict.kind is VerdictKind.UNANSWERED, verdict.evidence
    longer_window = decide(reads, timed_out(T0 + 3.0), rules=WedgeRules(wedge_after=3.5))
    assert settled(longer_window).kind is VerdictKind.STALLED


def test_a_process_stopped_in_one_sample_only_is_not_named_stopped(fixture_text: Load) -> None:
    # Stopped "throughout" needs a sample when the request went out and one after it.
    idle = parse_metrics(with_gap_histogram(capture(fixture_text, "idle-2"), "+Inf"))
    reads = [
        Read(T0, idle),
        Read(T0 + WAIT, idle, cpu=CpuSample(50.0, (7, 8), stopped=(7,))),
    ]
    verdict = settled(decide(reads, timed_out(T0 + 3.0)))
    assert verdict.kind is VerdictKind.STALLED, verdict.evidence
    assert "stopped by a signal" not in verdict.evidence


def test_counters_lost_from_one_side_of_a_wait_prove_no_freeze(fixture_text: Load) -> None:
    """wedge-2 with only its work gauges and start time (counters filtered out or lost on
    the way) between two whole texts: no counter is in both reads of either wait, so
    neither shows a freeze (``_measurable``), and three reads prove no wedge."""
    kept = ("vllm:num_requests_running", "vllm:num_requests_waiting", "process_start")

    def gauges(name: str) -> str:
        lines = capture(fixture_text, name).splitlines()
        return "\n".join(line for line in lines if line.startswith(kept)) + "\n"

    reads = timed(
        [capture(fixture_text, "wedge-1"), gauges("wedge-2"), capture(fixture_text, "wedge-3")]
    )
    verdict = walk(reads).verdict
    assert verdict.kind is not VerdictKind.WEDGED, verdict.evidence


def test_a_restarted_process_with_work_only_on_an_asleep_engine_is_not_read_on(
    fixture_text: Load,
) -> None:
    # Work gauges on an engine put to sleep are no work: the new process is news at
    # once, unproven and unasked, as one asleep without work.
    old = capture(fixture_text, "restart-0")
    new = set_sample(asleep(capture(fixture_text, "restart-1")), "vllm:num_requests_running", "2.0")
    verdict = settled(decide(timed([old, new])))
    assert verdict.kind is VerdictKind.RESTARTED
    assert not verdict.healthy and verdict.requests_sent == 0
    assert "engine 0 weights_offloaded" in verdict.evidence


def test_a_tiny_request_that_never_went_out_is_no_request_sent(fixture_text: Load) -> None:
    reads = reads_of(fixture_text, "idle-1")
    unsent = Answer(T0 + 1, False, "not sent: GET /v1/models answered HTTP 500", sent=False)
    verdict = settled(decide(reads, unsent))
    assert verdict.kind is VerdictKind.UNANSWERED
    assert verdict.requests_sent == 0


def _counted_again(text: str) -> str:
    """``text`` with its counters started again from 0 and a few steps counted since,
    the process start time unchanged (vLLM's stat loggers made anew)."""
    for name, value, labels in (
        ("vllm:iteration_tokens_total_count", "100.0", {}),
        ("vllm:generation_tokens_total", "400.0", {}),
        ("vllm:prompt_tokens_total", "60.0", {}),
        ("vllm:request_success_total", "3.0", {"finished_reason": "length"}),
    ):
        text = set_sample(text, name, value, **labels)
    return text


def test_counters_started_again_under_the_same_start_time_are_no_frozen_wait(
    fixture_text: Load,
) -> None:
    """vLLM re-creates its stat loggers when elastic EP scales up (``scale_elastic_ep``):
    every counter starts again from 0 in the same process, the start time unchanged, and
    with work in flight. What they show since is steps taken in that wait; compared as
    "did not rise", that wait was a frozen one, and a busy engine scaled up and then
    inside one long step for a single wait was proven wedged ("steps 8660→100→100")."""
    counted_again = _counted_again(capture(fixture_text, "wedge-2"))
    texts = [capture(fixture_text, "wedge-1"), counted_again, counted_again]
    reads = timed(texts)
    assert reads[0].signals.process_start == reads[1].signals.process_start  # type: ignore[union-attr]
    verdict = decide(reads, max_reads=61)
    assert not (isinstance(verdict, Verdict) and verdict.kind is VerdictKind.WEDGED), verdict
    scaled = settled(decide(reads[:2]))
    assert scaled.kind is VerdictKind.BUSY, scaled.evidence
    assert "counters started again in the same process on engine 0" in scaled.evidence
    # Frozen past its window after the counters started again is a wedge, as any (the
    # window: 3 x the longest wait for a first token the text shows, 10 s).
    frozen = decide(timed([*texts, *[counted_again] * 6]), max_reads=61)
    assert isinstance(frozen, Verdict) and frozen.kind is VerdictKind.WEDGED, frozen
    assert "steps 100→100→" in frozen.evidence


def test_a_long_step_recorded_before_the_counters_started_again_is_kept(
    fixture_text: Load,
) -> None:
    """vLLM's stat loggers made anew (elastic EP scaling up) start its histograms again
    too: a long step the text recorded before then is gone from the next, as a restarted
    process's is, though the engine and its hardware are the same. The verdict keeps it,
    as it keeps the one a process recorded before it restarted."""
    before = with_gap_histogram(capture(fixture_text, "wedge-1"), "40.0")
    counted_again = _counted_again(capture(fixture_text, "wedge-2"))
    reads = timed([before, counted_again])
    long_one = longest_step(reads[0].signals)  # type: ignore[arg-type]
    assert long_one is not None and long_one.seconds >= 40
    verdict = settled(decide(reads))
    assert verdict.kind is VerdictKind.BUSY, verdict.evidence
    assert verdict.longest_step is not None
    assert verdict.longest_step.seconds >= long_one.seconds, verdict.longest_step
