"""``llmhealth.check`` and ``check_async``: the CLI's check, called from code.

The same cycle as ``llmhealth check`` (read, judge, feed the ledger, persist, act), with
the same rule that a backend showing work is never sent a request; the report is typed,
and ``to_dict()`` is exactly what ``check --format json`` prints.
"""

from __future__ import annotations

import asyncio
import copy
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from os import PathLike, fspath
from typing import Any

from llmhealth import config as config_module
from llmhealth.classify import Target, VerdictKind
from llmhealth.cycle import run_cycle_async, run_cycle_in_cluster, run_loop, state_path_for
from llmhealth.lateness import lent_to
from llmhealth.ledger import State, Transition
from llmhealth.probe import ProbeSettings, seconds_argument
from llmhealth.remediate import Mode
from llmhealth.report import (
    BackendReport,
    CycleReport,
    ExitCode,
    FleetSummary,
    RestartNote,
    as_json,
    backend_exit_code,
    exit_code,
)
from llmhealth.state import StateFile
from llmhealth.text import printable

PathArg = str | PathLike[str]
_LOGGER = logging.getLogger("llmhealth")


@dataclass(frozen=True, slots=True)
class BackendResult:
    """One backend's or proxy's verdict this run, and its ledger record after it."""

    name: str
    url: str
    kind: str  # "backend" or "proxy"
    verdict: VerdictKind
    healthy: bool
    evidence: str  # what the reads showed and what was compared
    running: int | None
    waiting: int | None
    steps_per_s: float | None
    tokens_per_s: float | None
    requests_sent: int  # tiny requests sent this run; 0 for a backend that showed work
    state: State | None  # None for a proxy: proxies are not in the ledger
    serving: bool | None
    last_error: str | None
    transitions: tuple[Transition, ...]  # the ledger moves this run made
    exit_code: ExitCode


@dataclass(frozen=True, slots=True)
class CheckReport:
    """What one check found. ``exit_code`` is the monitoring-plugin code the CLI exits with."""

    checked_at: float
    exit_code: ExitCode
    backends: tuple[BackendResult, ...]
    fleet: FleetSummary
    notes: tuple[str, ...]
    restarts: tuple[RestartNote, ...]
    _document: dict[str, Any] = field(repr=False, compare=False)

    @property
    def healthy(self) -> bool:
        return self.exit_code is ExitCode.OK

    def backend(self, name: str) -> BackendResult:
        """The result for one target by name (a bare URL's name is its host:port)."""
        for result in self.backends:
            if result.name == name:
                return result
        raise KeyError(name)

    def to_dict(self) -> dict[str, Any]:
        """The document ``llmhealth check --format json`` prints for the same run."""
        return copy.deepcopy(self._document)


def check(
    urls: Sequence[str] = (),
    *,
    proxies: Sequence[str] = (),
    config: PathArg | None = None,
    state: PathArg | None = None,
    wait: float | None = None,
    timeout: float | None = None,
    answer_timeout: float | None = None,
    dry_run: bool = False,
    no_restart: bool = False,
) -> CheckReport:
    """Check every backend once, as ``llmhealth check`` does, and return the report.

    Blocking; it runs its own event loop, so call ``check_async`` from inside one.
    ``state``: a state file that keeps the ledger between calls (with ``config`` its
    ``state`` is the default); without either nothing is remembered. Restart commands come
    only from a ``config``; ``dry_run`` and ``no_restart`` are the CLI's flags. Bad
    arguments raise ``ValueError``; a bad config ``ConfigError``; a locked or corrupt state
    file ``StateError``; an audit log that cannot be written ``AuditError`` (all exported
    by the package). A sick server is never an exception: it is in the report.

    With a ``[cluster]`` in the config it is cron's check beside the daemons: it acts only
    if it wins the lease for the run, and the record is etcd's (``state`` is not used).
    """
    if _loop_running():
        raise RuntimeError(
            "llmhealth.check() cannot run inside a running event loop: "
            "await llmhealth.check_async(...) there"
        )
    options = _Options(proxies, config, state, wait, timeout, answer_timeout, dry_run, no_restart)
    run = _prepared(urls, options, may_block=True)
    if run.config.cluster is not None:
        report = run_cycle_in_cluster(
            run.config, run.config.cluster, run.targets, run.settings, mode=run.mode, log=_log
        )
        return _typed(report)
    return _typed(run_loop(_cycle(run)))


async def check_async(
    urls: Sequence[str] = (),
    *,
    proxies: Sequence[str] = (),
    config: PathArg | None = None,
    state: PathArg | None = None,
    wait: float | None = None,
    timeout: float | None = None,
    answer_timeout: float | None = None,
    dry_run: bool = False,
    no_restart: bool = False,
) -> CheckReport:
    """``check`` inside a running event loop: no thread, no new loop.

    Three things that would hold the loop are refused instead: waiting for a state file
    another run has locked (``StateLockedError`` at once), running a restart command (a
    config with restart commands needs ``dry_run`` or ``no_restart`` here), and a config
    with a ``[cluster]`` (its etcd client blocks: ``ValueError``; call ``check`` from a
    thread).
    """
    options = _Options(proxies, config, state, wait, timeout, answer_timeout, dry_run, no_restart)
    run = _prepared(urls, options, may_block=False)
    return _typed(await _cycle(run))


@dataclass(frozen=True, slots=True)
class _Options:
    proxies: Sequence[str]
    config: PathArg | None
    state: PathArg | None
    wait: float | None
    timeout: float | None
    answer_timeout: float | None
    dry_run: bool
    no_restart: bool


@dataclass(frozen=True, slots=True)
class _Prepared:
    """What one check runs: the fleet, how it reads, whether it acts, where it keeps state."""

    config: config_module.Config
    targets: list[Target]
    settings: ProbeSettings
    mode: Mode
    store: StateFile | None


def _prepared(urls: Sequence[str], options: _Options, *, may_block: bool) -> _Prepared:
    """The arguments checked and the config read, before anything is sent."""
    proxies, config, state = options.proxies, options.config, options.state
    if isinstance(urls, str | bytes) or isinstance(proxies, str | bytes):
        raise TypeError("urls and proxies are lists of URLs, not one string")
    if urls is None or proxies is None:
        raise TypeError("urls and proxies are lists of URLs, not None")
    urls, proxies = list(urls), list(proxies)  # an iterator is read once, here
    for name, given in (("urls", urls), ("proxies", proxies)):
        for index, url in enumerate(given):
            if not isinstance(url, str):
                # The culprit's type, not the list: the others are URLs, and one with a
                # password in it would be repeated before refuse_user_info saw it.
                raise TypeError(
                    f"{name}: each one a URL string, got {type(url).__name__} at [{index}]"
                )
    for name, flag in (("dry_run", options.dry_run), ("no_restart", options.no_restart)):
        if not isinstance(flag, bool):  # "no" would act as True: dry_run="no" ran dry
            raise TypeError(f"{name} is True or False, got {flag!r}")
    config, state = _path_text(config, "config"), _path_text(state, "state")
    loaded = config_module.load(config) if config is not None else config_module.Config()
    targets = config_module.targets_for(loaded, urls, proxies)
    if not targets:
        raise ValueError("nothing to check: give backend URLs, proxies or a config")
    settings = ProbeSettings(
        wait=_seconds(options.wait, "wait", loaded.wait),
        timeout=_seconds(options.timeout, "timeout", loaded.timeout),
        answer_timeout=_seconds(options.answer_timeout, "answer_timeout", loaded.answer_timeout),
        max_body=loaded.max_body,
        max_check_time=loaded.max_check_time,
    )
    mode = Mode.OFF if options.no_restart else Mode.DRY_RUN if options.dry_run else Mode.ACT
    if not may_block and loaded.cluster is not None:
        raise ValueError(
            "check_async cannot take part in a cluster (its etcd client would hold the "
            "event loop): call check() from a thread, e.g. asyncio.to_thread(llmhealth.check, ...)"
        )
    if not may_block and mode is Mode.ACT and any(b.restart for b in loaded.backends):
        raise ValueError(
            "check_async runs no restart command (it would hold the event loop): pass "
            "dry_run=True or no_restart=True, or call check()"
        )
    store = None
    # In a cluster the record is etcd's: nothing is kept in a state file.
    if loaded.cluster is None and (state is not None or config is not None):
        path = state_path_for(loaded, state)
        store = StateFile(path) if may_block else StateFile(path, lock_timeout=0.0)
    return _Prepared(loaded, targets, settings, mode, store)


def _path_text(value: PathArg | None, name: str) -> str | None:
    """A path argument as text. Only text: str() of os.environb's b"" is "b''", and of a
    number its digits, which made a state file by those names in the working directory
    (and slipped past the refusal of an empty path)."""
    if value is None:
        return None
    text = fspath(value) if isinstance(value, PathLike) else value
    if not isinstance(text, str):
        raise TypeError(f"{name} is a path (str or os.PathLike[str]), got {type(value).__name__}")
    return text


async def _cycle(run: _Prepared) -> CycleReport:
    # The reads' measure of the loop's lateness ticks only while they run: in
    # check_async's loop, the caller's, it ticked on after the check.
    with lent_to(asyncio.get_running_loop()):
        return await run_cycle_async(
            run.config, run.targets, run.settings, run.store, mode=run.mode
        )


def _log(message: str) -> None:
    """The cluster's news during a check from code (who leads, etcd's errors), escaped."""
    _LOGGER.info("%s", printable(message))


def _loop_running() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


def _seconds(value: float | None, name: str, default: float) -> float:
    return default if value is None else seconds_argument(value, name)


def _typed(report: CycleReport) -> CheckReport:
    return CheckReport(
        checked_at=report.checked_at,
        exit_code=exit_code(report),
        backends=tuple(_result(backend) for backend in report.backends),
        fleet=report.fleet,
        notes=report.notes,
        restarts=report.restarts,
        _document=as_json(report),
    )


def _result(report: BackendReport) -> BackendResult:
    verdict, snapshot, target = report.outcome.verdict, report.snapshot, report.outcome.target
    return BackendResult(
        name=target.name,
        url=target.url,
        kind=target.kind,
        verdict=verdict.kind,
        healthy=verdict.healthy,
        evidence=verdict.evidence,
        running=verdict.running,
        waiting=verdict.waiting,
        steps_per_s=verdict.steps_per_s,
        tokens_per_s=verdict.tokens_per_s,
        requests_sent=verdict.requests_sent,
        state=None if snapshot is None else snapshot.state,
        serving=None if snapshot is None else snapshot.serving,
        last_error=None if snapshot is None else snapshot.last_error or None,
        transitions=tuple(
            t for t in report.transitions if t.applied and t.from_state != t.to_state
        ),
        exit_code=backend_exit_code(report),
    )
