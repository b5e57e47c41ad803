"""The simulated engine as a pure model: modes, counters over injected time, /metrics text."""

from __future__ import annotations

import ast
import importlib.resources
import itertools
import math
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.utils import floatToGoString

import llmhealth.simengine as se
from llmhealth.metrics import parse_metrics
from llmhealth.simengine import Load, ModeError, Outcome, SimBackend, SimConfig, parse_mode
from llmhealth.window import longest_step

BORN = 1_796_024_376.26
CAPTURES = Path(__file__).resolve().parent.parent / "fixtures" / "vllm-0.32"
TEMPLATE = importlib.resources.files("llmhealth").joinpath("vllm_metrics_template.txt").read_text()


def backend(mode: str, **config: object) -> SimBackend:
    # age 0: the start times below are the simulated process's real ones.
    settings = {"age": 0.0, **config}
    return SimBackend(parse_mode(mode), SimConfig(**settings), born=BORN)  # type: ignore[arg-type]


def at(seconds: float) -> float:
    return BORN + seconds


def series(text: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


# --- modes ---------------------------------------------------------------------------------


def test_a_bare_load_parses_to_that_load() -> None:
    assert parse_mode("idle").load is Load.IDLE
    assert parse_mode("busy").load is Load.BUSY
    assert parse_mode("prefill").load is Load.PREFILL


def test_a_wedge_without_a_load_is_a_busy_engine_that_freezes() -> None:
    spec = parse_mode("wedge:2.5")
    assert (spec.load, spec.wedge_after, spec.wedge_one) == (Load.BUSY, 2.5, False)
    assert parse_mode("wedge-one:3").wedge_one
    assert parse_mode("prefill+wedge:1").load is Load.PREFILL


def test_modifiers_combine_with_plus_in_any_order() -> None:
    spec = parse_mode("restart:5+busy+multiproc")
    assert (spec.load, spec.restart_every, spec.multiproc) == (Load.BUSY, 5.0, True)
    assert parse_mode("busy+restart:5s").restart_every == 5.0
    assert not parse_mode("unanswered").answers
    assert parse_mode("no-metrics").no_metrics
    assert parse_mode("hang").hang
    assert parse_mode("asleep").asleep


def test_a_proxy_takes_the_rest_of_the_string_as_urls() -> None:
    spec = parse_mode("proxy:http://127.0.0.1:8100/,http://127.0.0.1:8101")
    assert spec.proxy_urls == ("http://127.0.0.1:8100", "http://127.0.0.1:8101")
    assert spec.is_proxy


@pytest.mark.parametrize(
    ("mode", "complaint"),
    [
        ("bogus", "unknown mode"),
        ("busy+busy", "given twice"),
        ("busy+prefill", "one of idle, busy, prefill"),
        ("idle+wedge:2", "idle engine cannot wedge"),
        ("wedge:2+wedge-one:2", "not both"),
        ("wedge", "needs seconds"),
        ("wedge:soon", "needs seconds"),
        ("wedge:-1", "seconds >= 0"),
        ("restart:0", "above 0"),
        ("busy:3", "takes no argument"),
        ("proxy:ftp://x", "http(s) URLs"),
    ],
)
def test_a_bad_mode_is_rejected_with_a_reason(mode: str, complaint: str) -> None:
    with pytest.raises(ModeError, match=complaint.replace("(", r"\(").replace(")", r"\)")):
        parse_mode(mode)


def test_a_config_without_slots_or_engines_is_rejected() -> None:
    with pytest.raises(ValueError, match="max_num_seqs"):
        SimConfig(max_num_seqs=0)
    with pytest.raises(ValueError, match="engines"):
        SimConfig(engines=0)
    with pytest.raises(ValueError, match="request_seconds"):
        SimConfig(request_seconds=0)
    with pytest.raises(ValueError, match="age"):
        SimConfig(age=-1.0)
    with pytest.raises(ValueError, match="keep_alive"):
        SimConfig(keep_alive=0)
    with pytest.raises(ValueError, match="keep_alive"):
        SimConfig(keep_alive=float("inf"))


# --- counters over time --------------------------------------------------------------------


def test_an_idle_engine_shows_nothing_and_moves_nothing() -> None:
    b = backend("idle")
    first, later = b.observe(at(1)), b.observe(at(100))
    assert first == later
    (engine,) = first.engines
    assert (engine.running, engine.waiting, engine.steps, engine.finished) == (0, 0, 0, 0)
    assert engine.kv_usage == 0.0
    assert first.start_time == BORN


def test_a_busy_engine_fills_every_slot_and_advances_its_counters() -> None:
    b = backend("busy", max_num_seqs=4, request_seconds=4.0)
    (one,) = b.observe(at(1)).engines
    (two,) = b.observe(at(2)).engines
    assert (two.running, two.waiting) == (4, 8)
    assert two.steps - one.steps == pytest.approx(se.STEP_RATE, abs=1)
    assert two.generation_tokens == two.steps * 4
    assert two.finished > one.finished
    assert two.prompt_tokens > one.prompt_tokens
    assert two.kv_usage != one.kv_usage
    assert 0 < two.kv_usage < 1


def test_a_prefilling_engine_moves_only_its_kv_use() -> None:
    b = backend("prefill")
    reads = [b.observe(at(t)).engines[0] for t in (1.0, 2.0, 3.0, 3.001, 11.0)]
    for read in reads:
        assert read.running > 0
        assert read.waiting > 0
        assert (read.steps, read.generation_tokens, read.prompt_tokens, read.finished) == (
            0,
            0,
            0,
            0,
        )
    kvs = [r.kv_usage for r in reads]
    # Even reads a whole number of sawtooth periods apart differ.
    assert all(a != b for a, b in itertools.pairwise(kvs))


def test_a_wedged_engine_freezes_every_counter_and_gauge_with_work_present() -> None:
    b = backend("wedge:2")
    before = b.observe(at(1)).engines[0]
    frozen = b.observe(at(3)).engines[0]
    assert frozen.steps > before.steps
    assert b.observe(at(10)).engines[0] == frozen
    assert b.observe(at(1000)).engines[0] == frozen
    assert frozen.running > 0
    assert frozen.waiting > 0


def test_a_completion_to_a_wedged_engine_never_answers() -> None:
    b = backend("wedge:2")
    assert b.submit(at(5), 3, 1).outcome is Outcome.HANG
    assert b.submit(at(5), 3, 1).at == math.inf


def test_a_completion_caught_by_the_wedge_never_answers() -> None:
    b = backend("wedge:2", request_seconds=0.4)
    # Queued behind the synthetic load, it would be answered after the freeze.
    assert b.submit(at(1.9), 3, 1).outcome is Outcome.HANG


def test_only_the_last_engine_wedges_with_wedge_one() -> None:
    b = backend("wedge-one:2", engines=3)
    early = b.observe(at(3)).engines
    late = b.observe(at(8)).engines
    assert late[2] == early[2]
    assert late[0].steps > early[0].steps
    assert late[1].steps > early[1].steps


def test_a_simulated_process_may_claim_to_be_older_than_it_is() -> None:
    old = backend("wedge:1", age=3600.0)
    assert old.observe(at(2)).start_time == BORN - 3600.0


def test_a_restarted_process_is_young_however_old_the_first_claimed_to_be() -> None:
    """Aged too, a restart's wedge was proven in two waits where a real one's young
    process gets its startup window (minutes): tests proved what a server never would."""
    b = backend("restart:5+wedge:1", age=3600.0)
    assert b.observe(at(2)).start_time == BORN - 3600.0
    assert b.observe(at(7)).start_time == at(5)


def test_a_restart_gives_a_new_start_time_and_counters_from_zero() -> None:
    b = backend("restart:5")
    ticket = b.submit(at(1), 7, 3)
    assert ticket.outcome is Outcome.ANSWER
    before = b.observe(at(2))
    assert before.start_time == BORN
    assert before.engines[0].finished == 1
    assert before.engines[0].prompt_tokens == 7
    after = b.observe(at(6))
    assert after.start_time == at(5)
    assert after.engines[0].finished == 0
    assert after.engines[0].generation_tokens == 0
    assert b.observe(at(12)).start_time == at(10)


def test_a_busy_engine_restarts_its_counters_too() -> None:
    b = backend("restart:5+busy")
    assert b.observe(at(4.9)).engines[0].steps > b.observe(at(5.1)).engines[0].steps


def test_a_request_in_flight_at_a_restart_is_dropped_at_the_restart() -> None:
    b = backend("restart:5+busy")
    ticket = b.submit(at(4), 3, 1)
    assert (ticket.outcome, ticket.at) == (Outcome.DROP, at(5))


def test_an_idle_engine_answers_a_tiny_request_at_once_and_counts_it() -> None:
    b = backend("idle")
    ticket = b.submit(at(1), 5, 1)
    assert ticket.outcome is Outcome.ANSWER
    assert ticket.at == pytest.approx(at(1) + se.FIRST_TOKEN_SECONDS)
    held = b.observe(at(1.01)).engines[0]
    assert (held.running, held.waiting) == (1, 0)
    done = b.observe(at(2)).engines[0]
    assert (done.running, done.steps, done.generation_tokens) == (0, 1, 1)
    assert (done.prompt_tokens, done.finished) == (5, 1)


def test_real_requests_beyond_the_slots_wait_in_fifo_order() -> None:
    b = backend("idle", max_num_seqs=2)
    tickets = [b.submit(at(1), 1, 1) for _ in range(3)]
    assert [t.at - at(1) for t in tickets] == pytest.approx([0.05, 0.05, 0.10])
    now = b.observe(at(1.01)).engines[0]
    assert (now.running, now.waiting) == (2, 1)


def test_a_completion_to_a_busy_engine_waits_behind_the_synthetic_queue() -> None:
    b = backend("busy", max_num_seqs=4, request_seconds=4.0)
    quiet = backend("busy", max_num_seqs=4, request_seconds=4.0)
    ticket = b.submit(at(1), 5, 1)
    assert ticket.outcome is Outcome.ANSWER
    # Two queue lengths of synthetic requests (8 at one per second) go first.
    assert 8.0 <= ticket.at - at(1) <= 10.0
    assert b.observe(at(2)).engines[0].waiting == 9
    after = b.observe(ticket.at + 1).engines[0]
    assert after.finished == quiet.observe(ticket.at + 1).engines[0].finished + 1


@pytest.mark.parametrize("mode", ["unanswered", "asleep", "hang+unanswered"])
def test_an_engine_that_never_answers_still_shows_no_work(mode: str) -> None:
    b = backend(mode)
    assert b.submit(at(1), 1, 1).outcome is Outcome.HANG
    engine = b.observe(at(2)).engines[0]
    assert (engine.running, engine.waiting, engine.finished) == (0, 0, 0)


def test_an_asleep_engine_says_so() -> None:
    engine = backend("asleep").observe(at(1)).engines[0]
    assert not engine.awake
    assert backend("idle").observe(at(1)).engines[0].awake


def test_engines_take_real_requests_in_turn() -> None:
    b = backend("idle", engines=2)
    assert [b.submit(at(1), 1, 1).engine for _ in range(3)] == [0, 1, 0]


def test_time_never_runs_backwards_inside_a_backend() -> None:
    b = backend("busy")
    later = b.observe(at(5))
    assert b.observe(at(1)) == later


# --- /metrics text -------------------------------------------------------------------------


def render(b: SimBackend, now: float, *, multiproc: bool = False) -> str:
    text = se.MetricsText(
        TEMPLATE, engines=b.config.engines, model=b.config.model, multiproc=multiproc
    )
    return text.render(b.observe(now))


def test_the_text_has_exactly_the_series_of_the_real_capture() -> None:
    real = series((CAPTURES / "busy-2.txt").read_text())
    simulated = series(render(backend("busy"), at(5)))
    assert simulated.keys() == real.keys()


def test_the_text_carries_the_model_values() -> None:
    b = backend("busy")
    got = series(render(b, at(5)))
    (engine,) = b.observe(at(5)).engines
    labels = frozenset({("engine", "0"), ("model_name", "tiny")})
    assert got[("vllm:num_requests_running", labels)] == engine.running
    assert got[("vllm:num_requests_waiting", labels)] == engine.waiting
    assert got[("vllm:iteration_tokens_total_count", labels)] == engine.steps
    assert got[("vllm:generation_tokens_total", labels)] == engine.generation_tokens
    assert got[("vllm:prompt_tokens_total", labels)] == engine.prompt_tokens
    assert got[("vllm:kv_cache_usage_perc", labels)] == engine.kv_usage
    success = frozenset(labels | {("finished_reason", "length")})
    assert got[("vllm:request_success_total", success)] == engine.finished
    assert got[("process_start_time_seconds", frozenset())] == pytest.approx(BORN)
    created = [v for (name, _), v in got.items() if name.endswith("_created")]
    assert created
    assert set(created) == {BORN}


def test_each_data_parallel_engine_gets_its_own_series() -> None:
    text = render(backend("busy", engines=2), at(5))
    engines = {
        s.labels.get("engine")
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if family.name == "vllm:num_requests_running"
    }
    assert engines == {"0", "1"}
    assert text.count("# HELP vllm:num_requests_running ") == 1


def test_multiprocess_mode_has_no_process_series_and_no_gauges_before_a_request() -> None:
    b = backend("multiproc")
    text = render(b, at(1), multiproc=True)
    for absent in ("process_start_time_seconds", "python_gc", "_created", "kv_cache_usage"):
        assert absent not in text
    assert "vllm:num_requests_running" not in text
    assert "vllm:generation_tokens_total" in text
    b.submit(at(2), 3, 1)
    assert "vllm:num_requests_running" not in render(b, at(2.01), multiproc=True)
    assert "vllm:num_requests_running{" in render(b, at(3), multiproc=True)


def test_multiprocess_mode_with_a_load_shows_its_gauges_from_the_start() -> None:
    text = render(backend("busy+multiproc"), at(1), multiproc=True)
    assert 'vllm:num_requests_running{engine="0",model_name="tiny"} 4.0' in text


def test_a_sleeping_engine_reports_its_sleep_state() -> None:
    got = series(render(backend("asleep"), at(1)))
    base = {("engine", "0"), ("model_name", "tiny")}
    assert got[("vllm:engine_sleep_state", frozenset(base | {("sleep_state", "awake")}))] == 0
    offloaded = frozenset(base | {("sleep_state", "weights_offloaded")})
    assert got[("vllm:engine_sleep_state", offloaded)] == 1


def test_a_model_name_with_quotes_is_escaped_in_labels() -> None:
    name = 'org/we"ird\\model'
    text = render(backend("idle", model=name), at(1))
    models = {
        s.labels["model_name"]
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if "model_name" in s.labels
    }
    assert models == {name}


def test_an_unknown_placeholder_in_the_template_is_an_error() -> None:
    bad = "# HELP x help\n# TYPE x gauge\nx {{nonsense}}\n"
    with pytest.raises(ValueError, match="nonsense"):
        se.MetricsText(bad, engines=1, model="m", multiproc=False)


@given(st.floats(min_value=0, max_value=9.9e9, allow_nan=False))
def test_values_are_written_as_prometheus_client_writes_them(value: float) -> None:
    assert se.format_value(value) == floatToGoString(value)  # type: ignore[no-untyped-call]


def test_the_engine_model_is_pure() -> None:
    tree = ast.parse(Path(se.__file__).read_text())
    imported = {
        name.split(".")[0]
        for node in ast.walk(tree)
        if isinstance(node, ast.Import | ast.ImportFrom)
        for name in (
            [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
        )
    }
    assert imported <= {"__future__", "math", "re", "collections", "dataclasses", "enum"}


def test_an_idle_engine_decoding_a_long_request_shows_its_progress() -> None:
    # vLLM publishes its counters at each step's end. Counted only when the request
    # finished, a 2,000-token stream (5 s) showed running 1 and frozen counters, and
    # watch or route proved the serving backend wedged and restarted it mid-stream.
    b = backend("idle")
    ticket = b.submit(at(1), 5, 2000)
    assert ticket.outcome is Outcome.ANSWER
    one, two = b.observe(at(2)).engines[0], b.observe(at(3)).engines[0]
    assert one.running == two.running == 1
    assert two.steps - one.steps == pytest.approx(se.STEP_RATE, abs=1)
    assert two.generation_tokens > one.generation_tokens
    assert one.prompt_tokens == 5
    assert two.kv_usage != one.kv_usage
    done = b.observe(ticket.at + 1).engines[0]
    assert (done.running, done.steps, done.generation_tokens, done.finished) == (0, 2000, 2000, 1)
    assert done.prompt_tokens == 5


def histogram_problems(text: str) -> list[str]:
    """What no real histogram shows: buckets that fall, +Inf other than the count, or a
    sum that the buckets' bounds cannot hold."""
    problems = []
    for family in text_string_to_metric_families(text):
        if family.type != "histogram":
            continue
        groups: dict[frozenset[tuple[str, str]], list[tuple[str, float, float]]] = {}
        for s in family.samples:
            key = frozenset((k, v) for k, v in s.labels.items() if k != "le")
            groups.setdefault(key, []).append((s.name, float(s.labels.get("le", "nan")), s.value))
        for samples in groups.values():
            buckets = [(le, v) for name, le, v in samples if name.endswith("_bucket")]
            (count,) = [v for name, _, v in samples if name.endswith("_count")]
            (total,) = [v for name, _, v in samples if name.endswith("_sum")]
            values = [v for _, v in buckets]
            if values != sorted(values) or values[-1] != count:
                problems.append(f"{family.name}: buckets {values}, count {count}")
            below, most = 0.0, 0.0
            for le, v in buckets:
                if v > below:
                    most += (v - below) * le
                below = v
            if total > most:
                problems.append(f"{family.name}: sum {total} over the buckets' {most}")
    return problems


def test_the_real_captures_histograms_are_consistent() -> None:
    for name in ("busy-2", "chunk-1", "chunk-2", "prefill2-3", "wedge-2"):
        assert histogram_problems((CAPTURES / f"{name}.txt").read_text()) == [], name


@pytest.mark.parametrize("mode", ["idle", "busy", "prefill"])
@pytest.mark.parametrize("max_num_seqs", [4, 64])
def test_a_step_that_read_a_long_prompt_is_counted_in_the_bucket_that_holds_it(
    mode: str, max_num_seqs: int
) -> None:
    """Every step was counted under le="8.0" whatever its tokens: one 2,000-token prompt
    (or 64 sequences decoding) made a sum no bucket could hold, and llmhealth learned
    that no step of the simulator held more than 8 tokens, where the real server's
    buckets say 2,048 (chunk-1.txt)."""
    b = backend(mode, max_num_seqs=max_num_seqs)
    ticket = b.submit(at(0.5), 2000, 1)
    assert histogram_problems(render(b, at(0.5))) == []
    later = ticket.at + 0.1 if ticket.outcome is Outcome.ANSWER else at(3)
    text = render(b, later)
    assert histogram_problems(text) == []
    if mode != "busy" or ticket.outcome is Outcome.ANSWER:
        (engine,) = parse_metrics(text).engines
        # Busy: the prompt shares its step with the other slots' tokens.
        assert engine.finished and engine.largest_step_tokens == (
            4096 if max_num_seqs == 64 and mode == "busy" else 2048
        )
    if mode != "busy":
        # The one request read, as chunk-1.txt's server read it: the step learned is
        # about its 0.10 s, not 12 s from busy-0's rate per prompt token.
        real = parse_metrics((CAPTURES / "chunk-1.txt").read_text())
        step, real_step = longest_step(parse_metrics(text)), longest_step(real)
        assert step is not None and real_step is not None
        assert step.seconds < 2 * real_step.seconds


def test_a_fresh_busy_engine_counts_no_prompt_before_a_step_read_it() -> None:
    (engine,) = backend("busy").observe(at(0.001)).engines
    assert engine.prompt_tokens and engine.steps >= 4
    assert histogram_problems(render(backend("busy"), at(0.001))) == []


def test_a_process_that_made_no_token_shows_no_inter_token_gap() -> None:
    """The template's inter-token histogram was a captured busy server's 6,059 gaps, in
    every process: a fresh or restarted one that had made no token showed them, where a
    real one shows none (restart-1.txt), and llmhealth learned its steps from them."""
    real_new = parse_metrics((CAPTURES / "restart-1.txt").read_text()).engines[0]
    assert real_new.longest_gap is None
    b = backend("idle")
    (fresh,) = parse_metrics(render(b, at(1))).engines
    assert fresh.longest_gap is None
    ticket = b.submit(at(1), 5, 16)
    text = render(b, ticket.at + 1)
    (served,) = parse_metrics(text).engines
    assert served.longest_gap is not None and served.longest_gap <= 0.01
    assert histogram_problems(text) == []
    labels = frozenset({("engine", "0"), ("model_name", "tiny")})
    assert series(text)[("vllm:inter_token_latency_seconds_count", labels)] == 15
