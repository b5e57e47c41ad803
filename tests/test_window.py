"""The wedge window: which term applies, and what the engine's histograms teach."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from llmhealth.metrics import EngineSignals, Signals
from llmhealth.window import (
    CpuSample,
    LongestStep,
    WedgeRules,
    cpu_span,
    cpu_used,
    describe_cpu,
    longest_step,
    stopped_throughout,
    wedge_window,
)


def test_an_engine_with_no_histograms_teaches_nothing() -> None:
    assert longest_step(Signals((EngineSignals("0", running=1.0),))) is None


def test_the_prefill_cost_of_the_largest_step_can_be_the_longest() -> None:
    # 2 s of prefill over 1,000 prompt tokens, and steps of up to 4,096 tokens: ~8.2 s,
    # longer than the 0.05 s the inter-token gaps show.
    engine = EngineSignals(
        "3",
        prompt_tokens=1000.0,
        prefill_seconds=2.0,
        largest_step_tokens=4096.0,
        longest_gap=0.05,
    )
    step = longest_step(Signals((engine,)))
    assert step is not None
    assert step.seconds == pytest.approx(8.192)
    assert step.why == "engine 3: prefill 2 ms per prompt token x up to 4096 tokens in one step"


def test_prompts_prefilled_together_in_one_step_are_one_step_not_one_each() -> None:
    """Eight 400-token prompts prefilled in one 20 s step: each request counts the whole
    step in the prefill sum, so the product alone said 205 s (a 614 s window, past what a
    check can cover, where a real wedge was never proven). No request waited over 20 s
    for its first token, and a step that holds a chunk of a prompt is no longer than that."""
    engine = EngineSignals(
        "0",
        prompt_tokens=8 * 400.0,
        prefill_seconds=8 * 20.0,
        largest_step_tokens=4096.0,
        longest_prefill=20.0,
        longest_gap=0.05,
    )
    step = longest_step(Signals((engine,)))
    assert step is not None
    assert step.seconds == 20.0
    assert step.why == (
        "engine 0: prefill 50 ms per prompt token x up to 4096 tokens in one step, "
        "at most the longest wait for a first token, up to 20 s"
    )
    assert wedge_window(WedgeRules(), step, 3600.0).seconds == 60.0
    # A bound above the product bounds nothing: the product stands.
    roomy = longest_step(Signals((replace(engine, longest_prefill=240.0),)))
    assert roomy is not None and roomy.seconds == pytest.approx(204.8)


def test_figures_whose_product_is_no_number_teach_nothing_and_save_as_they_load() -> None:
    """1e308 s of prefill for one prompt token, times 512 tokens: each figure finite, the
    step infinite. Saved, it made the state unreadable at the next load, and a fresh
    ledger forgot every DEAD, RETIRED, hold and budget."""
    from llmhealth.fleet import Sighting  # noqa: PLC0415

    engine = EngineSignals(
        "0", prompt_tokens=1.0, prefill_seconds=1e308, largest_step_tokens=512.0, longest_gap=0.5
    )
    step = longest_step(Signals((engine,)))
    assert step is not None and step.seconds == 0.5  # the gap alone
    sighting = Sighting(1.0, True, longest_step=step)
    assert Sighting.from_dict(sighting.to_dict(), "sightings.b") == sighting


def test_the_longest_of_several_engines_counts() -> None:
    engines = (
        EngineSignals("0", longest_gap=0.5),
        EngineSignals("1", longest_gap=80.0, gap_beyond=True),
    )
    assert longest_step(Signals(engines)) == LongestStep(
        80.0, "engine 1: an inter-token gap over 80 s"
    )


def test_the_largest_term_sets_the_window_and_says_why() -> None:
    rules = WedgeRules(wedge_after=120.0, startup_grace=900.0, startup_wedge_after=300.0)
    step = LongestStep(31.0, "engine 0: inter-token gaps up to 40 s")
    assert wedge_window(rules, None, None).why == "wedge_after 120 s"
    window = wedge_window(WedgeRules(), step, 5000.0)
    assert (window.seconds, window.extended) == (93.0, True)
    assert window.why.startswith("longest step seen 31 s x3")
    young = wedge_window(rules, step, 60.0)
    assert young.seconds == 300.0
    assert "process 60 s old" in young.why
    unknown = wedge_window(rules, None, None, nothing_finished=True)
    assert unknown.seconds == 300.0 and "process age unknown" in unknown.why
    assert wedge_window(rules, None, 5000.0, nothing_finished=True).seconds == 120.0
    skewed = wedge_window(rules, None, -90.0)  # its host's clock 90 s ahead of ours
    assert skewed.seconds == 300.0 and "90 s ahead of this host's clock" in skewed.why
    # Clocks a startup_grace or more apart: no start-up window, as before.
    assert wedge_window(rules, None, -5000.0, nothing_finished=True).seconds == 120.0
    none = wedge_window(WedgeRules(startup_wedge_after=0), None, 60.0)
    assert (none.seconds, none.extended, none.why) == (0.0, False, "two waits")


def test_cpu_is_compared_only_over_the_same_processes() -> None:
    assert cpu_used(CpuSample(1.0, (5,)), CpuSample(3.5, (5,))) == 2.5
    assert cpu_used(CpuSample(1.0, (5,)), CpuSample(3.5, (6,))) is None
    assert cpu_used(CpuSample(4.0, (5,)), CpuSample(3.5, (5,))) is None
    assert cpu_used(None, CpuSample(3.5, (5,))) is None
    assert "stopped or deadlocked" in describe_cpu(0.01, 10.0)
    assert "compiling or computing" in describe_cpu(19.6, 10.0)


def test_a_little_cpu_above_idle_is_not_printed_as_none() -> None:
    # Seen on a real vLLM whose EngineCore was SIGSTOPped: its worker still used 0.03 s in
    # 4 s, above the idle share; one decimal printed it as "used 0.0 s CPU", and called
    # it "compiling or computing".
    assert describe_cpu(0.03, 4.0).endswith("used 0.03 s CPU in 4.0 s: polling, not computing")
    assert describe_cpu(19.6, 10.0).endswith("used 19.6 s CPU in 10.0 s: compiling or computing")


@pytest.mark.parametrize(
    "bad",
    [
        None,
        [],
        {"seconds": -1, "why": "x"},
        {"seconds": 1.0},
        {"seconds": True, "why": "x"},  # a JSON true is no number of seconds
        # JSON's "Infinity" and "NaN" load as floats: saved, no state could be read back.
        {"seconds": math.inf, "why": "x"},
        {"seconds": math.nan, "why": "x"},
    ],
)
def test_a_malformed_longest_step_is_a_value_error(bad: object) -> None:
    with pytest.raises(ValueError, match="step"):
        LongestStep.from_dict(bad, "step")


def test_a_process_exactly_startup_grace_old_is_no_longer_young() -> None:
    # README: startup_wedge_after applies "while the process is younger than startup_grace".
    rules = WedgeRules(wedge_after=120.0, startup_grace=900.0, startup_wedge_after=300.0)
    assert wedge_window(rules, None, 899.0).seconds == 300.0
    assert wedge_window(rules, None, 900.0).seconds == 120.0


def test_cpu_is_timed_by_its_samples_own_clock_when_both_have_one() -> None:
    # Two reads 200 s apart on the wall clock (stepped forward), their samples 30 s apart
    # on the steady one: 0.5 s of CPU is idle over 200 s, not over the 30 s it took.
    first, last = CpuSample(1.0, (5,), at=100.0), CpuSample(1.5, (5,), at=130.0)
    assert cpu_span(first, last, 200.0) == 30.0
    assert cpu_span(CpuSample(1.0, (5,)), last, 200.0) == 200.0


def test_only_processes_stopped_in_every_sample_were_stopped_throughout() -> None:
    samples = [CpuSample(1.0, (5, 6), stopped=(5, 6)), CpuSample(1.0, (5, 6), stopped=(5,))]
    assert stopped_throughout(samples) == (5,)
    assert stopped_throughout([*samples, CpuSample(1.0, (5, 6))]) == ()
    assert stopped_throughout([]) == ()


def test_a_start_exactly_startup_grace_ahead_is_no_longer_taken_for_young() -> None:
    # As for a process exactly startup_grace old: "less than startup_grace" apart only.
    rules = WedgeRules(wedge_after=120.0, startup_grace=900.0, startup_wedge_after=300.0)
    assert wedge_window(rules, None, -899.0).seconds == 300.0
    assert wedge_window(rules, None, -900.0).seconds == 120.0


def test_samples_that_name_no_process_say_nothing_of_cpu() -> None:
    # No process to measure is no CPU known, not none used: 0 s over 0 s read as idle
    # proved a wedge at two waits.
    assert cpu_used(CpuSample(0.0, ()), CpuSample(0.0, ())) is None


def test_cpu_exactly_at_the_idle_share_is_not_idle() -> None:
    # "Less than this share" did nothing: 0.05 s in 10 s is the share itself.
    assert describe_cpu(0.05, 10.0).endswith("polling, not computing")
    assert describe_cpu(0.0499, 10.0).endswith("stopped or deadlocked, not computing")


def test_an_empty_lowest_gap_bucket_teaches_no_step() -> None:
    assert longest_step(Signals((EngineSignals("0", longest_gap=0.0),))) is None
