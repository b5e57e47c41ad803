"""The table people read: every string shown as it is, verdict and state never cut."""

from __future__ import annotations

import io
from dataclasses import replace
from types import SimpleNamespace

from rich.console import Console
from test_ledger import fresh

from llmhealth.classify import Outcome, Target, Verdict, VerdictKind
from llmhealth.daemon import Daemon
from llmhealth.ledger import BackendSnapshot, State
from llmhealth.policy import Hold
from llmhealth.render import print_report, print_status
from llmhealth.report import BackendReport, CycleReport, FleetSummary

FLEET = FleetSummary(serving=1, min_healthy=1, epoch=0, floor_breached=False, message="ok")
LONG = "gpu-" * 20 + "rack1-a"  # 87 characters, as in a real rack naming scheme


def snapshot(name: str, state: State = State.HEALTHY, last_error: str = "") -> BackendSnapshot:
    """A newly configured backend's snapshot (test_ledger's), named and in ``state``."""
    return replace(fresh(), name=name, state=state, last_error=last_error, state_since=None)


def shown(report: CycleReport, width: int = 132) -> str:
    out = io.StringIO()
    print_report(report, Console(file=out, width=width, color_system=None))
    return out.getvalue()


def one(name: str, verdict: Verdict, state: State = State.HEALTHY) -> CycleReport:
    backend = BackendReport(Outcome(Target(name, "http://a:1"), verdict), snapshot(name, state))
    return CycleReport(checked_at=1.0, backends=(backend,), fleet=FLEET)


def test_emoji_codes_and_brackets_in_names_and_evidence_are_shown_as_written() -> None:
    evidence = "idle: tiny request answered by model llama:fire::warning: [bold]x"
    text = shown(one("gpu:fire:", Verdict(VerdictKind.IDLE, True, evidence)))
    assert "🔥" not in text and "⚠" not in text, text
    assert "llama:fire::warning: [bold]x" in text, text
    assert "│ gpu:fire:" in text, text


def test_a_trailing_backslash_in_a_name_is_shown_once() -> None:
    text = shown(one("h\\", Verdict(VerdictKind.IDLE, True, "idle")))
    assert "│ h\\ " in text and "h\\\\" not in text, text
    assert "h\\: idle" in text, text


def test_a_non_finite_rate_is_shown_as_unknown_not_inf() -> None:
    verdict = Verdict(VerdictKind.BUSY, True, "busy", running=2, tokens_per_s=float("inf"))
    text = shown(one("gpu0", verdict))
    table = text.split("gpu0:")[0]
    assert "inf" not in table and "?" in table, text


def test_a_long_name_folds_and_verdict_and_state_stay_whole() -> None:
    # Not on a terminal the table is 132 wide: the name was cut and so were verdict
    # ("un…") and state ("su…"), the two columns people read the table for.
    text = shown(one(LONG, Verdict(VerdictKind.UNRESPONSIVE, False, "x"), State.SUSPECT))
    table = text.split(f"{LONG}: x")[0]
    assert "…" not in table, table
    assert "unresponsive" in table and "suspect" in table, table
    cells = [line.split("│")[1].strip() for line in table.splitlines() if line.startswith("│")]
    assert "".join(cells) == LONG, table  # folded over lines, nothing dropped


def test_status_shows_a_hold_reason_and_a_name_as_written() -> None:
    out = io.StringIO()
    hold = Hold(reason="sync :fire: [red]x", until=2000.0, by="op")
    print_status(
        [snapshot("gpu0\\")],
        {"gpu0\\": hold},
        FLEET,
        1000.0,
        Console(file=out, width=200, color_system=None),
    )
    text = out.getvalue()
    assert "sync :fire: [red]x" in text and "🔥" not in text, text
    assert "│ gpu0\\ " in text, text


def test_status_shows_a_held_backend_s_last_error_beside_its_hold() -> None:
    """The fleet's line below the table no longer names each last error: a held DEAD
    backend's, hidden behind its hold in the table, was shown nowhere."""
    out = io.StringIO()
    hold = Hold(reason="weight sync", until=2000.0, by="op")
    print_status(
        [snapshot("gpu0", State.DEAD, last_error="wedged: steps 1→1→1")],
        {"gpu0": hold},
        FLEET,
        1000.0,
        Console(file=out, width=300, color_system=None),
    )
    text = out.getvalue()
    assert "weight sync; wedged: steps 1→1→1" in text, text


def test_the_daemons_log_on_a_terminal_shows_emoji_codes_as_written() -> None:
    # rich turned ":fire:" in a model id or an operator's reason into an emoji, so the
    # logged line no longer matched the real string.
    shown = io.StringIO()
    daemon = SimpleNamespace(_console=Console(file=shown, force_terminal=True, width=200))
    Daemon._log(daemon, "gpu0: hold set: 'sync :fire: weights' [bold]x[/bold]")  # type: ignore[arg-type]
    assert "sync :fire: weights' [bold]x[/bold]" in shown.getvalue()
