"""The table people read: numbers in columns, each verdict's evidence as a sentence below."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from rich.console import Console, RenderableType
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from llmhealth.ledger import BackendSnapshot
from llmhealth.policy import Hold
from llmhealth.report import (
    BackendReport,
    CycleReport,
    ExitCode,
    FleetSummary,
    backend_exit_code,
)
from llmhealth.text import printable

_STYLE = {
    ExitCode.OK: "green",
    ExitCode.WARNING: "yellow",
    ExitCode.UNKNOWN: "magenta",  # not judged: our failure, not the server's
    ExitCode.CRITICAL: "bold red",
}


def print_report(report: CycleReport, console: Console) -> None:
    for renderable in report_renderables(report):
        console.print(renderable, highlight=False)


def report_renderables(report: CycleReport) -> list[RenderableType]:
    """Numbers in a table, evidence below it: evidence is a sentence and needs the width."""
    table = Table()
    columns = ("name", "kind", "verdict", "state", "running", "waiting", "steps/s", "tok/s", "req")
    for column in columns:
        table.add_column(column, no_wrap=True)
    for backend in report.backends:
        table.add_row(*_row(backend))
    lines: list[RenderableType] = [table]
    for backend in report.backends:
        line = f"[bold]{escape(backend.outcome.target.name)}[/bold]: "
        line += escape(backend.outcome.verdict.evidence)
        for transition in backend.transitions:
            if transition.applied and transition.from_state != transition.to_state:
                line += (
                    f"\n    ledger: {transition.from_state} → {transition.to_state} "
                    f"({transition.kind})"
                )
        lines.append(Text.from_markup(line))
    fleet = report.fleet
    if fleet.floor_breached:
        message = escape(printable(fleet.message))
        lines.append(Text.from_markup(f"[bold red]fleet[/bold red]: {message}"))
    elif any(backend.snapshot is not None for backend in report.backends):
        lines.append(
            Text.from_markup(
                f"[bold]fleet[/bold]: {fleet.serving} serving (min_healthy {fleet.min_healthy}), "
                f"membership epoch {fleet.epoch}"
            )
        )
    for restart in report.restarts:
        if restart.dry_run and restart.action != "skip":
            done = "dry run: would " + restart.action
        elif restart.ran:
            done = "restarted" if restart.ok else "restart FAILED"
        else:
            done = restart.action
        lines.append(
            Text.from_markup(
                f"[bold]{escape(restart.name)}[/bold]: {done}: {escape(printable(restart.reason))}"
            )
        )
    lines += [Text(f"note: {printable(note)}", style="dim") for note in report.notes]
    return lines


def console_for_output() -> Console:
    """The terminal's width on a terminal; elsewhere (cron mail, journald) wide enough."""
    probe = Console()
    return probe if probe.is_terminal else Console(width=132)


def _row(backend: BackendReport) -> tuple[str, ...]:
    verdict = backend.outcome.verdict
    style = _STYLE.get(backend_exit_code(backend), "")
    state = "-" if backend.snapshot is None else str(backend.snapshot.state)
    return (
        escape(backend.outcome.target.name),
        backend.outcome.target.kind,
        f"[{style}]{verdict.kind}[/{style}]" if style else str(verdict.kind),
        f"[{style}]{state}[/{style}]" if style else state,
        _cell(verdict.running),
        _cell(verdict.waiting),
        _cell(verdict.steps_per_s),
        _cell(verdict.tokens_per_s),
        str(verdict.requests_sent),
    )


def _cell(value: float | None) -> str:
    return "-" if value is None else f"{value:g}" if isinstance(value, int) else f"{value:.1f}"


def print_status(
    snapshots: Sequence[BackendSnapshot],
    holds: Mapping[str, Hold],
    fleet: FleetSummary,
    now: float,
    console: Console,
) -> None:
    """The ledger as saved: no probing, so it is safe to run at any moment during on-call."""
    table = Table()
    columns = ("name", "state", "serving", "since", "probe fails", "req fails", "restarts")
    for column in (*columns, "back in place"):
        table.add_column(column, no_wrap=True)
    table.add_column("hold / last error", overflow="fold")
    for snap in snapshots:
        hold = holds.get(snap.name)
        note = hold.describe(now) if hold is not None and hold.active(now) else snap.last_error
        table.add_row(
            escape(snap.name),
            str(snap.state),
            "yes" if snap.serving else "no",
            "-" if snap.state_since is None else _ago(now - snap.state_since),
            str(snap.probe_failures),
            str(snap.request_failures),
            str(snap.restart_attempts),
            str(snap.in_place_recoveries),
            escape(printable(note or "-")),
        )
    console.print(table)
    style = "bold red" if fleet.floor_breached else "bold"
    console.print(f"[{style}]fleet[/{style}]: {escape(printable(fleet.message))}", highlight=False)
    console.print(f"membership epoch {fleet.epoch}", highlight=False)


def _ago(seconds: float) -> str:
    seconds = max(seconds, 0.0)
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds / size:.0f}{unit} ago"
    return f"{seconds:.0f}s ago"
