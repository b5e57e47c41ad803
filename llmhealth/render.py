"""The table people read: numbers in columns, each verdict's evidence as a sentence below."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from rich.console import Console, RenderableType
from rich.table import Table
from rich.text import Text

from llmhealth.classify import VerdictKind
from llmhealth.ledger import BackendSnapshot, State
from llmhealth.openfiles import discard_output, output_gone, say_output_dropped
from llmhealth.policy import Hold
from llmhealth.report import (
    BackendReport,
    CycleReport,
    ExitCode,
    FleetSummary,
    backend_exit_code,
    unconfigured_holds,
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


# Every cell and line is a Text of printable words, never a markup string: rich would
# read a model id's ":fire:" as an emoji and "[bold]" as a tag, and escape() shows a
# name's trailing backslash doubled. What is shown is then the string as it is.
_VERDICT_WIDTH = max(len(kind) for kind in VerdictKind)
_STATE_WIDTH = max(len(state) for state in State)


def report_renderables(report: CycleReport) -> list[RenderableType]:
    """Numbers in a table, evidence below it: evidence is a sentence and needs the width."""
    table = Table()
    # A long name folds onto more lines; verdict and state, what the table is read for,
    # are never cut: each column is at least as wide as its longest value.
    table.add_column("name", overflow="fold")
    table.add_column("kind", no_wrap=True, min_width=len("backend"))
    table.add_column("verdict", no_wrap=True, min_width=_VERDICT_WIDTH)
    table.add_column("state", no_wrap=True, min_width=_STATE_WIDTH)
    for column in ("running", "waiting", "steps/s", "tok/s", "req"):
        table.add_column(column, overflow="fold")
    for backend in report.backends:
        table.add_row(*_row(backend))
    lines: list[RenderableType] = [table]
    for backend in report.backends:
        line = Text.assemble(
            (printable(backend.outcome.target.name), "bold"),
            ": ",
            printable(backend.outcome.verdict.evidence),
        )
        for transition in backend.transitions:
            if transition.applied and transition.from_state != transition.to_state:
                line.append(
                    f"\n    ledger: {transition.from_state} → {transition.to_state} "
                    f"({transition.kind})"
                )
        lines.append(line)
    if report.fleet.floor_breached or any(b.snapshot is not None for b in report.backends):
        lines.append(_fleet_line(report.fleet))
    for restart in report.restarts:
        if restart.dry_run and restart.action != "skip":
            done = "dry run: would " + restart.action
        elif restart.ran:
            done = "restarted" if restart.ok else "restart FAILED"
        else:
            done = restart.action
        lines.append(
            Text.assemble(
                (printable(restart.name), "bold"), f": {done}: ", printable(restart.reason)
            )
        )
    lines += [Text(f"note: {printable(note)}", style="dim") for note in report.notes]
    return lines


def console_for_output() -> Console:
    """The terminal's width on a terminal; elsewhere (cron mail, journald) wide enough."""
    probe = _Output()
    return probe if probe.is_terminal else _Output(width=132)


def console_for_log() -> Console:
    """The daemon's log, on stderr: a pipe taken for a terminal (FORCE_COLOR,
    TTY_COMPATIBLE) is written through it, and its reader leaving stops no daemon."""
    return _Output(stderr=True)


class _Output(Console):
    """A console whose reader may leave: rich's own ends the process with exit 1 then,
    which for `check` reads as WARNING and for `watch` stops the daemon."""

    def on_broken_pipe(self) -> None:
        """Nobody reads the table any more (``| head``): the rest goes nowhere, and the
        run's own exit code stands. rich's own answer exits 1, WARNING to a monitor."""
        self.quiet = True
        discard_output(self.file)

    def _check_buffer(self) -> None:
        # rich answers a broken pipe only: a terminal that hung up (EIO, `watch & disown`
        # and the terminal closed) or a full disk raised through every log line and
        # every Live refresh, and ended the daemon.
        try:
            super()._check_buffer()
        except OSError as exc:
            self.on_broken_pipe()
            if not self.stderr and output_gone(exc):
                # The table of `check > report.txt` on a full disk, dropped with nothing
                # said, where its JSON (``output_may_fail``) says so on stderr.
                say_output_dropped(exc)


def _row(backend: BackendReport) -> tuple[Text, ...]:
    verdict = backend.outcome.verdict
    style = _STYLE.get(backend_exit_code(backend), "")
    state = "-" if backend.snapshot is None else str(backend.snapshot.state)
    return (
        Text(printable(backend.outcome.target.name)),
        Text(backend.outcome.target.kind),
        Text(str(verdict.kind), style=style),
        Text(state, style=style),
        Text(_cell(verdict.running)),
        Text(_cell(verdict.waiting)),
        Text(_cell(verdict.steps_per_s)),
        Text(_cell(verdict.tokens_per_s)),
        Text(str(verdict.requests_sent)),
    )


def _cell(value: float | None) -> str:
    if value is None:
        return "-"
    if isinstance(value, int):
        return str(value)
    # A summed rate a hostile server pushed past the largest float: unknown, not "inf".
    return f"{value:.1f}" if math.isfinite(value) else "?"


def print_status(
    snapshots: Sequence[BackendSnapshot],
    holds: Mapping[str, Hold],
    fleet: FleetSummary,
    now: float,
    console: Console,
) -> None:
    """The ledger as saved: no probing, so it is safe to run at any moment during on-call."""
    table = Table()
    table.add_column("name", overflow="fold")
    table.add_column("state", no_wrap=True, min_width=_STATE_WIDTH)
    columns = ("serving", "since", "probe fails", "req fails", "restarts", "back in place")
    for column in columns:
        table.add_column(column, no_wrap=True)
    table.add_column("hold / last error", overflow="fold")
    for snap in snapshots:
        hold = holds.get(snap.name)
        # Both: a held backend's last error is shown nowhere else (the fleet's line names
        # none), and the hold is why a DEAD one is not restarted.
        held = hold.describe(now) if hold is not None and hold.active(now) else ""
        note = "; ".join(part for part in (held, snap.last_error) if part)
        table.add_row(
            Text(printable(snap.name)),
            Text(str(snap.state)),
            Text("yes" if snap.serving else "no"),
            Text("-" if snap.state_since is None else _ago(now - snap.state_since)),
            Text(str(snap.probe_failures)),
            Text(str(snap.request_failures)),
            Text(str(snap.restart_attempts)),
            Text(str(snap.in_place_recoveries)),
            Text(printable(note or "-")),
        )
    console.print(table)
    for name, hold in unconfigured_holds(snapshots, holds, now).items():
        console.print(Text(printable(f"{name} (not configured): {hold.describe(now)}")))
    console.print(_fleet_line(fleet))


def _fleet_line(fleet: FleetSummary) -> Text:
    """The fleet against its floor, in one short line. Not ``fleet.message``: that names
    every backend's state and last error, each wedge's evidence in full, which the rows
    above show already; below them it was a paragraph as long as the fleet (90 KB for 200
    wedged backends) that pushed the table off the operator's screen."""
    breached = "FLOOR BREACHED: " if fleet.floor_breached else ""
    return Text.assemble(
        ("fleet", "bold red" if fleet.floor_breached else "bold"),
        f": {breached}{fleet.serving} serving (min_healthy {fleet.min_healthy}), "
        f"membership epoch {fleet.epoch}",
    )


def _ago(seconds: float) -> str:
    seconds = max(seconds, 0.0)
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds / size:.0f}{unit} ago"
    return f"{seconds:.0f}s ago"
