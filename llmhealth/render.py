"""The table people read: numbers in columns, each verdict's evidence as a sentence below."""

from __future__ import annotations

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from llmhealth.classify import Outcome
from llmhealth.report import ExitCode, verdict_exit_code

_STYLE = {ExitCode.OK: "green", ExitCode.WARNING: "yellow", ExitCode.CRITICAL: "bold red"}


def print_table(outcomes: list[Outcome], console: Console) -> None:
    """Numbers in a table, evidence below it: evidence is a sentence and needs the width."""
    table = Table()
    for column in ("name", "kind", "verdict", "running", "waiting", "steps/s", "tok/s", "req"):
        table.add_column(column, no_wrap=True)
    for outcome in outcomes:
        verdict = outcome.verdict
        style = _STYLE.get(verdict_exit_code(verdict), "")
        table.add_row(
            escape(outcome.target.name),
            outcome.target.kind,
            f"[{style}]{verdict.kind}[/{style}]" if style else str(verdict.kind),
            _cell(verdict.running),
            _cell(verdict.waiting),
            _cell(verdict.steps_per_s),
            _cell(verdict.tokens_per_s),
            str(verdict.requests_sent),
        )
    console.print(table)
    for outcome in outcomes:
        console.print(
            f"[bold]{escape(outcome.target.name)}[/bold]: {escape(outcome.verdict.evidence)}",
            highlight=False,
        )


def _cell(value: float | None) -> str:
    return "-" if value is None else f"{value:g}" if isinstance(value, int) else f"{value:.1f}"
