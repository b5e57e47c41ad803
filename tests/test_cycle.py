"""The one settle path (``cycle.settle_fleet``) over a real state file and audit log."""

from __future__ import annotations

import asyncio
import gc
import itertools
import json
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any, TypeVar

import pytest
from pytest_httpserver import HTTPServer
from werkzeug import Request, Response

from llmhealth import cycle as cycle_module
from llmhealth import operate
from llmhealth.actions import AuditLog, CommandResult, read, run_command
from llmhealth.classify import Answer, Outcome, Read, Target, Verdict, VerdictKind, decide
from llmhealth.config import Backend, Config, Policy
from llmhealth.cycle import (
    Kept,
    Settled,
    backend_urls,
    fresh_record,
    ledger_policy,
    run_cycle,
    run_loop,
    settle,
    settle_fleet,
    withdrawn_now,
)
from llmhealth.fleet import PROOF_BYTES, FleetRecord, Sighting, process_of
from llmhealth.ledger import (
    GoodVerdict,
    NewProcessUp,
    Readmitted,
    RestartIssued,
    State,
    WedgeProven,
)
from llmhealth.metrics import EngineSignals, Signals
from llmhealth.policy import Hold, RestartHistory
from llmhealth.probe import ProbeSettings
from llmhealth.remediate import CommandDone, Mode, RestartOrder
from llmhealth.state import StateError, StateFile, StateLockedError, nothing_before
from llmhealth.traffic import FailureKind, RequestOutcome

T = TypeVar("T")

T0 = 1_796_000_000.0
GPU0 = Target("gpu0", "http://127.0.0.1:9")
GPU1 = Target("gpu1", "http://127.0.0.1:10")
CONFIG = Config(backends=(Backend("gpu0", GPU0.url), Backend("gpu1", GPU1.url)))


def ticking(start: float = T0) -> Callable[[], float]:
    """A clock for the settle: each call is one second after the last."""
    seconds = itertools.count(1)
    return lambda: start + next(seconds)


def wedged(target: Target) -> Outcome:
    return Outcome(target, Verdict(VerdictKind.WEDGED, False, "wedged: steps 5→5→5"))


def saved(path: Path) -> dict[str, dict[str, object]]:
    document = json.loads(path.read_text())
    return {b["name"]: b for b in document["ledger"]["backends"]}


def test_the_backends_of_a_run_are_its_backend_targets_not_its_proxies() -> None:
    proxy = Target("lb", "http://127.0.0.1:11", "proxy")
    assert backend_urls([GPU0, proxy, GPU1]) == {"gpu0": GPU0.url, "gpu1": GPU1.url}


def test_a_settle_holds_the_lock_while_it_gathers_and_saves_what_it_settled(
    tmp_path: Path,
) -> None:
    path = tmp_path / "state.json"
    store = StateFile(path)
    audit = AuditLog(tmp_path / "audit.jsonl")
    seen_locked = []

    def gather(record: FleetRecord) -> Sequence[Outcome]:
        # Another writer (a verb, a second check) cannot get in while verdicts are gathered.
        with pytest.raises(StateLockedError), StateFile(path, lock_timeout=0.0).locked():
            pass
        seen_locked.append(record.ledger.names)
        return [wedged(GPU0)]

    times = ticking()
    settled = settle_fleet(
        store,
        CONFIG,
        backend_urls([GPU0, GPU1]),
        gather,
        mode=Mode.ACT,
        audit=audit,
        clock=times,
    )
    assert seen_locked == [("gpu0", "gpu1")]
    assert settled.report.checked_at == T0 + 1.0  # when the record was loaded
    assert settled.record.ledger.state_of("gpu0") == "dead"
    backends = saved(path)
    assert (backends["gpu0"]["state"], backends["gpu1"]["state"]) == ("dead", "healthy")
    lines = [(line["backend"], line["event"], line["to"]) for line in read(audit.path)]
    # Condemned with its proof, then the restart decision: none, as it has no command.
    assert lines == [("gpu0", "wedge_proven", "dead"), ("gpu0", "restart_skipped", "dead")]
    with StateFile(path, lock_timeout=0.0).locked():  # and let go afterwards
        pass


def test_a_settle_reconciles_the_saved_record_with_the_backends_and_says_so(
    tmp_path: Path,
) -> None:
    path = tmp_path / "state.json"
    store = StateFile(path)
    times = ticking()
    settle_fleet(
        store,
        CONFIG,
        {"gpu0": GPU0.url},
        lambda _record: [],
        mode=Mode.ACT,
        audit=None,
        clock=times,
    )
    settled = settle_fleet(
        store,
        CONFIG,
        backend_urls([GPU0, GPU1]),
        lambda _record: [],
        mode=Mode.ACT,
        audit=None,
        clock=times,
        notes=["first"],
    )
    assert settled.report.notes == ("first", f"gpu1: new backend at {GPU1.url}; starts HEALTHY")
    assert set(saved(path)) == {"gpu0", "gpu1"}


def test_a_verdict_read_at_a_backends_old_address_is_not_the_new_ones(tmp_path: Path) -> None:
    # A reload moved gpu0 while its probe read the old address: that read (refused there)
    # condemned the server at the new address, which a restart command then hit.
    store, times = StateFile(tmp_path / "state.json"), ticking()
    moved = Config(backends=(Backend("gpu0", "http://127.0.0.1:11"), CONFIG.backends[1]))
    settle_fleet(
        store, CONFIG, backend_urls([GPU0, GPU1]), lambda _record: [], mode=Mode.ACT, audit=None,
        clock=times,
    )  # fmt: skip
    settled = settle_fleet(
        store,
        moved,
        {"gpu0": "http://127.0.0.1:11", "gpu1": GPU1.url},
        lambda _record: [wedged(GPU0), wedged(GPU1)],  # GPU0: read at its old address
        mode=Mode.ACT,
        audit=None,
        clock=times,
    )
    states = {name: backend["state"] for name, backend in saved(tmp_path / "state.json").items()}
    assert states == {"gpu0": "healthy", "gpu1": "dead"}  # gpu1's was read where it is
    assert settled.report.notes == (
        "gpu0: moved from http://127.0.0.1:9 to http://127.0.0.1:11; stays healthy",
    )


def test_without_a_store_a_settle_keeps_nothing(tmp_path: Path) -> None:
    settled = settle_fleet(
        None,
        CONFIG,
        backend_urls([GPU0]),
        lambda _record: [wedged(GPU0)],
        mode=Mode.OFF,
        audit=None,
    )
    assert settled.record.ledger.state_of("gpu0") == "dead"
    assert list(tmp_path.iterdir()) == []


RESTART = ("systemctl", "restart", "vllm@0")
RESTARTABLE = Config(backends=(Backend("gpu0", GPU0.url, restart=RESTART),))


def issued(tmp_path: Path) -> tuple[StateFile, AuditLog, RestartOrder]:
    """gpu0 wedged and a restart issued by a settle: saved RESTARTING, command not run."""
    store, audit = StateFile(tmp_path / "state.json"), AuditLog(tmp_path / "audit.jsonl")
    settled = settle_fleet(
        store,
        RESTARTABLE,
        backend_urls([GPU0]),
        lambda _record: [wedged(GPU0)],
        mode=Mode.ACT,
        audit=audit,
        clock=ticking(),
    )
    [order] = settled.orders
    return store, audit, order


def settle_empty(
    store: StateFile,
    audit: AuditLog,
    start: float,
    *,
    mode: Mode = Mode.ACT,
    commands: Sequence[CommandDone] = (),
    commands_running: frozenset[str] = frozenset(),
) -> Settled:
    """A settle of gpu0 with no verdicts, its clock ticking from ``start``."""
    return settle_fleet(
        store,
        RESTARTABLE,
        backend_urls([GPU0]),
        lambda _record: [],
        mode=mode,
        audit=audit,
        clock=ticking(start),
        commands=commands,
        commands_running=commands_running,
    )


def hear(
    store: StateFile, audit: AuditLog, done: CommandDone, start: float = T0 + 100
) -> FleetRecord:
    settled = settle_empty(store, audit, start, mode=Mode.OFF, commands=[done])
    assert settled.orders == ()
    return settled.record


def result(exit_code: int) -> CommandResult:
    return CommandResult(RESTART, exit_code, False, 1.5, "", "")


def test_a_settle_issues_a_restart_and_saves_it_before_any_command_runs(tmp_path: Path) -> None:
    store, audit, order = issued(tmp_path)
    assert (order.name, order.argv, order.issued_at) == ("gpu0", RESTART, T0 + 2.0)
    assert order.env["LLMHEALTH_BACKEND"] == "gpu0"
    assert "LLMHEALTH_BACKEND" not in repr(order)  # the environment is never shown
    assert saved(store.path)["gpu0"]["state"] == "restarting"
    [line] = [r for r in read(audit.path) if r["event"] == "restart"]
    assert (line["to"], line["argv"]) == ("restarting", list(RESTART))
    assert "command" not in line  # not run yet


def test_a_failed_command_heard_later_sends_the_backend_back_to_dead(tmp_path: Path) -> None:
    store, audit, order = issued(tmp_path)
    record = hear(store, audit, CommandDone(order, result(1)))
    assert record.ledger.state_of("gpu0") == "dead"
    assert record.restarts["gpu0"].failures == 1  # the cooldown doubles
    assert saved(store.path)["gpu0"]["last_error"] == "restart failed: restart command exited 1"
    [line] = [r for r in read(audit.path) if r["event"] == "restart_command"]
    assert (line["from"], line["to"], line["command"]["exit_code"]) == ("restarting", "dead", 1)


def test_a_command_a_signal_ended_is_said_killed_by_it_not_exited_with_a_negative_status(
    tmp_path: Path,
) -> None:
    """``subprocess`` gives a signal's end as a negative code: "restart command exited -9"
    read as an exit status in `status` and the audit trail, for an OOM kill."""
    store, audit, order = issued(tmp_path)
    killed = [sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"]
    ran = run_command(killed, 30.0)
    assert ran.exit_code == -signal.SIGKILL and not ran.timed_out
    record = hear(store, audit, CommandDone(order, ran))
    assert record.ledger.state_of("gpu0") == "dead"
    assert saved(store.path)["gpu0"]["last_error"] == (
        "restart failed: restart command was killed by SIGKILL"
    )
    [line] = [r for r in read(audit.path) if r["event"] == "restart_command"]
    assert line["command"]["exit_code"] == -9  # the record keeps subprocess's code


def test_a_command_that_exited_0_proves_nothing_and_changes_no_state(tmp_path: Path) -> None:
    store, audit, order = issued(tmp_path)
    record = hear(store, audit, CommandDone(order, result(0)))
    assert record.ledger.state_of("gpu0") == "restarting"
    assert record.restarts["gpu0"].failures == 0
    [line] = [r for r in read(audit.path) if r["event"] == "restart_command"]
    assert (line["from"], line["to"]) == ("restarting", "restarting")


def test_the_outcome_of_a_restart_the_ledger_moved_past_changes_nothing(tmp_path: Path) -> None:
    store, audit, order = issued(tmp_path)
    # A later restart of the same backend, as if the grace had failed this one and the
    # plan had tried again: the late failure of the first command must not fail it.
    outdated = CommandDone(replace(order, issued_at=order.issued_at - 50.0), result(1))
    record = hear(store, audit, outdated)
    assert record.ledger.state_of("gpu0") == "restarting"
    assert record.restarts["gpu0"].failures == 0
    [line] = [r for r in read(audit.path) if r["event"] == "restart_command"]
    assert line["superseded"] is True
    assert "to" not in line


def test_a_restart_whose_command_still_runs_keeps_its_grace_which_counts_from_its_end(
    tmp_path: Path,
) -> None:
    """A command longer than the grace (a restart_timeout past it) failed its own restart:
    DEAD, an attempt spent, and the next restart killed what the command brought up."""
    store, audit, order = issued(tmp_path)  # issued at T0 + 2; the grace is 900 s
    long_after = settle_empty(store, audit, T0 + 2000, commands_running=frozenset({"gpu0"}))
    assert (long_after.orders, long_after.record.ledger.state_of("gpu0")) == ((), "restarting")
    ended = hear(store, audit, CommandDone(order, result(0)), start=T0 + 2500)
    assert ended.ledger.state_of("gpu0") == "restarting"  # its grace starts now
    ran_at = ended.ledger.snapshot("gpu0", T0 + 2600).restart_ran_at
    assert ran_at is not None and ran_at > T0 + 2500
    assert settle_empty(store, audit, ran_at + 800).orders == ()
    assert "startup_expired" not in [r["event"] for r in read(audit.path)]
    expired = settle_empty(store, audit, ran_at + 900)
    assert expired.record.ledger.state_of("gpu0") == "restarting"  # failed, and retried
    [line] = [r for r in read(audit.path) if r["event"] == "startup_expired"]
    assert line["evidence"]["restart_ran_at"] == ran_at
    assert [o.name for o in expired.orders] == ["gpu0"]


def test_a_dead_backend_whose_restart_command_still_runs_is_not_restarted_again() -> None:
    # Its replacement came up during a slow command and wedged: DEAD while it runs.
    record = fresh_record(ledger_policy(RESTARTABLE.policy), backend_urls([GPU0]), now=T0)
    record.ledger.apply("gpu0", WedgeProven(now=T0, evidence="steps 5→5→5"))
    record.ledger.apply("gpu0", RestartIssued(now=T0 + 1))
    record.ledger.apply("gpu0", NewProcessUp(now=T0 + 60))
    record.ledger.apply("gpu0", WedgeProven(now=T0 + 200, evidence="steps 9→9→9"))
    later = T0 + 3600  # any cooldown over
    report, orders = settle(
        record,
        RESTARTABLE,
        [],
        later,
        mode=Mode.ACT,
        audit=None,
        commands_running=frozenset({"gpu0"}),
    )
    assert orders == []
    assert [(n.action, n.reason) for n in report.restarts] == [
        ("skip", "its last restart command still runs")
    ]
    _, orders = settle(record, RESTARTABLE, [], later, mode=Mode.ACT, audit=None)
    assert [order.name for order in orders] == ["gpu0"]  # once it has ended


def test_a_command_heard_after_a_reload_renamed_its_backend_is_that_backends(
    tmp_path: Path,
) -> None:
    store, audit, order = issued(tmp_path)
    renamed = Config(backends=(Backend("node-gpu0", GPU0.url, restart=RESTART),))
    settled = settle_fleet(
        store,
        renamed,
        {"node-gpu0": GPU0.url},
        lambda _record: [],
        mode=Mode.OFF,
        audit=audit,
        clock=ticking(T0 + 100),
        commands=[CommandDone(order, result(1))],
    )
    assert settled.record.ledger.state_of("node-gpu0") == "dead"  # before: "superseded"
    [line] = [r for r in read(audit.path) if r["event"] == "restart_command"]
    assert (line["backend"], line["issued_as"], line["to"]) == ("node-gpu0", "gpu0", "dead")
    # The report (and watch's llmhealth_backend_restarts_total) names it as the trail does:
    # under the old name, a series a reload had just dropped came back for a name gone.
    assert [(n.name, n.ran, n.ok) for n in settled.report.restarts] == [("node-gpu0", True, False)]


class CountingFile(StateFile):
    """A real state file that counts its loads (each one a read and a decode) and can be
    told to fail its next save after writing nothing."""

    def __init__(self, path: Path) -> None:
        super().__init__(path)
        self.loads = 0
        self.fail_saves = 0

    def load(self, decode: Callable[[dict[str, Any]], T]) -> T | None:
        self.loads += 1
        return super().load(decode)

    def save(
        self, document: dict[str, Any], *, before: Callable[[], None] = nothing_before
    ) -> None:
        if self.fail_saves:
            self.fail_saves -= 1
            raise StateError(f"cannot write state {self.path}: disk full")
        super().save(document, before=before)


def keeping(store: StateFile, kept: Kept, config: Config = CONFIG) -> Callable[..., Settled]:
    """A settle as `watch` makes it: on one store, with the record it kept."""
    times = ticking()

    def settle(outcomes: Sequence[Outcome], **options: Any) -> Settled:
        return settle_fleet(
            store,
            config,
            backend_urls([GPU0, GPU1]) if config is CONFIG else backend_urls([GPU0]),
            lambda _record: outcomes,
            mode=Mode.ACT,
            audit=AuditLog(store.path.with_name("audit.jsonl")),
            clock=times,
            kept=kept,
            **options,
        )

    return settle


def decoded(path: Path, config: Config = CONFIG) -> dict[str, Any]:
    record = FleetRecord.from_dict(json.loads(path.read_text()), ledger_policy(config.policy))
    return record.to_dict()


def test_a_kept_record_is_not_read_again_while_the_state_file_is_unchanged(
    tmp_path: Path,
) -> None:
    store = CountingFile(tmp_path / "state.json")
    settle = keeping(store, Kept())
    settle([])
    assert store.loads == 1  # the first settle finds no file yet
    settle([wedged(GPU0)])
    last = settle([])
    assert store.loads == 1  # the two after it start from what the one before saved
    assert last.record.ledger.state_of("gpu0") == "dead"
    assert decoded(store.path) == last.record.to_dict()  # memory is what the file holds


def test_an_operator_verb_between_two_settles_is_seen_by_the_next(tmp_path: Path) -> None:
    store = CountingFile(tmp_path / "state.json")
    settle = keeping(store, Kept())
    settle([wedged(GPU0)])
    settle([])
    assert store.loads == 1
    # Another process's verb, through its own store object on the same file.
    other = StateFile(store.path)
    retired = operate.retire(other, AuditLog(tmp_path / "audit.jsonl"), CONFIG, "gpu0", "bad")
    assert retired.applied, retired.message
    after = settle([])
    assert store.loads == 2  # the verb's save changed the file: read again
    assert after.record.ledger.state_of("gpu0") == "retired"
    assert saved(store.path)["gpu0"]["state"] == "retired"  # and the settle kept it so
    settle([])
    assert store.loads == 2


def test_a_state_file_replaced_with_the_same_bytes_is_still_read_again(tmp_path: Path) -> None:
    store = CountingFile(tmp_path / "state.json")
    settle = keeping(store, Kept())
    settle([])
    StateFile(store.path).save(json.loads(store.path.read_text()))
    settle([])
    assert store.loads == 2


def test_a_failed_save_keeps_nothing_and_the_restart_it_planned_is_issued_once(
    tmp_path: Path,
) -> None:
    store = CountingFile(tmp_path / "state.json")
    kept = Kept()
    settle = keeping(store, kept, RESTARTABLE)
    settle([])
    store.fail_saves = 1
    with pytest.raises(StateError, match="disk full"):
        settle([wedged(GPU0)])  # condemned and restarted in memory, never on disk
    assert kept.record is None
    assert saved(store.path)["gpu0"]["state"] == "healthy"
    again = settle([])
    assert store.loads == 2  # the next settle starts from the file, not from memory
    assert again.record.ledger.state_of("gpu0") == "healthy"
    assert again.orders == ()
    issued = settle([wedged(GPU0)])
    assert [order.name for order in issued.orders] == ["gpu0"]
    assert saved(store.path)["gpu0"]["state"] == "restarting"
    assert decoded(store.path, RESTARTABLE) == issued.record.to_dict()


def test_a_settle_whose_state_cannot_be_written_writes_none_of_its_audit_records(
    tmp_path: Path,
) -> None:
    """The new state is written aside before the settle's records are made durable. Here
    the file system refuses the temporary file's name (ENAMETOOLONG: the lock's name
    fits, the temporary one's does not), as a full disk refuses a large state after a
    small batch. Before, the records went first: a restart "issued" at every settle that
    never was, and the state still HEALTHY."""
    store = StateFile(tmp_path / ("s" * 245))
    settle = keeping(store, Kept(), RESTARTABLE)
    with pytest.raises(StateError, match="cannot write state"):
        settle([wedged(GPU0)])
    assert not store.path.exists()
    assert not (tmp_path / "audit.jsonl").exists()


def test_a_settle_that_fails_before_its_save_keeps_nothing(tmp_path: Path) -> None:
    store = CountingFile(tmp_path / "state.json")
    kept = Kept()
    settle = keeping(store, kept)
    settle([])

    def broken(_record: FleetRecord) -> Sequence[Outcome]:
        raise RuntimeError("a bug while gathering")

    with pytest.raises(RuntimeError):
        settle_fleet(
            store, CONFIG, backend_urls([GPU0, GPU1]), broken, mode=Mode.ACT, audit=None, kept=kept
        )
    assert kept.record is None
    settle([])
    assert store.loads == 2


def test_a_changed_policy_reads_the_record_again_under_it(tmp_path: Path) -> None:
    store = CountingFile(tmp_path / "state.json")
    kept = Kept()
    keeping(store, kept)([])
    stricter = replace(CONFIG, policy=replace(CONFIG.policy, unhealthy_threshold=5))
    settled = keeping(store, kept, stricter)([])
    assert store.loads == 2
    assert settled.record.ledger.policy.unhealthy_threshold == 5


def test_a_check_s_loop_gives_back_its_value_unrendered_and_the_collector_as_it_was() -> None:
    """asyncio.run rendered the main task's result (a whole report) with ``repr`` on
    leaving, and threw the text away: 87,000 calls for a check of 3,000 backends."""
    rendered: list[object] = []

    class Report:
        def __repr__(self) -> str:
            rendered.append(self)
            return "Report()"

    report = Report()
    before = gc.get_threshold()

    async def check() -> Report:
        return report

    assert run_loop(check()) is report
    assert rendered == []
    assert gc.get_threshold() == before


def test_check_asks_a_stale_backend_whose_work_just_finished_and_readmits_it(
    httpserver: HTTPServer, tmp_path: Path
) -> None:
    """check hands its probes the record's STALE backends: one whose engine moved (its
    work just finished) is still asked, since only an answer re-admits it."""
    captures = Path(__file__).parent.parent / "fixtures" / "vllm-0.32"
    texts = [
        (captures / f"{name}.txt").read_text() for name in ("apifreeze-pre", "apifreeze-after")
    ]
    asked: list[Request] = []

    def metrics(_request: Request) -> Response:
        return Response(texts.pop(0) if len(texts) > 1 else texts[0])

    def complete(request: Request) -> Response:
        asked.append(request)
        return Response(json.dumps({"id": "c", "choices": [{"text": "!"}]}))

    httpserver.expect_request("/metrics").respond_with_handler(metrics)
    httpserver.expect_request("/v1/models").respond_with_json({"data": [{"id": "tiny"}]})
    httpserver.expect_request("/v1/completions", method="POST").respond_with_handler(complete)
    url = httpserver.url_for("").rstrip("/")
    config = Config(backends=(Backend("b", url),))
    store, audit = StateFile(tmp_path / "state.json"), AuditLog(tmp_path / "audit.jsonl")
    for verb in (
        lambda: operate.retire(store, audit, config, "b", "replaced the card"),
        lambda: operate.reset(store, audit, config, "b"),
    ):
        assert verb().applied
    assert saved(store.path)["b"]["state"] == "stale"

    settings = ProbeSettings(wait=0.0, timeout=1.0, answer_timeout=1.0)
    report = run_cycle(config, [Target("b", url)], settings, store, audit=audit)
    (backend,) = report.backends
    assert backend.outcome.verdict.kind is VerdictKind.BUSY
    assert backend.outcome.verdict.answer is not None and len(asked) == 1
    assert saved(store.path)["b"]["state"] == "healthy"


# --- a restart's replacement, judged in the settle that first sees it -------------------

SHARED_FAULT_FLEET = Config(
    backends=tuple(
        Backend(name, f"http://10.0.0.{i}:8000", restart=("true",))
        for i, name in enumerate(("a", "b", "c"))
    )
)


def _serving(steps: float, finished: float, start: float | None) -> Signals:
    engine = EngineSignals(
        engine="0", running=4.0, waiting=0.0, steps=steps, generation_tokens=4 * steps,
        prompt_tokens=48.0, finished=finished, preemptions=0.0, kv_usage=0.1,
    )  # fmt: skip
    return Signals(engines=(engine,), process_start=start)


def _restarted(names: Sequence[str], at: float) -> FleetRecord:
    """SHARED_FAULT_FLEET, the named backends proven wedged and restarted at ``at``."""
    urls = {backend.name: backend.url for backend in SHARED_FAULT_FLEET.backends}
    record = fresh_record(ledger_policy(SHARED_FAULT_FLEET.policy), urls, now=at - 100)
    for name in names:
        record.ledger.apply(name, WedgeProven(now=at - 10))
        record.ledger.apply(name, RestartIssued(now=at))
        record.restarts[name] = RestartHistory(0, at)
        record.sightings[name] = Sighting(at - 10, True, _serving(10, 1, at - 5000))
    return record


def _settled(record: FleetRecord, name: str, verdict: Verdict, now: float) -> list[str]:
    target = Target(name, record.ledger.url_of(name))
    _, orders = settle(
        record, SHARED_FAULT_FLEET, [Outcome(target, verdict)], now, mode=Mode.ACT, audit=None
    )
    return [order.name for order in orders]


def test_a_replacement_first_seen_working_after_its_grace_is_not_restarted() -> None:
    # A model that loads for 15 min, read by a check every 5: its first verdict, busy
    # and finishing requests, moved it to STALE, and the same settle's expiry found the
    # restart unproven past its grace, failed it, and restarted a healthy server.
    at = T0
    record = _restarted(["a"], at)
    now = at + record.ledger.policy.startup_grace + 2
    reads = (Read(now - 5, _serving(100, 3, at + 600)), Read(now, _serving(140, 5, at + 600)))
    busy = Verdict(VerdictKind.BUSY, True, "busy: engine 0 progressed", reads=reads)
    assert _settled(record, "a", busy, now) == []
    assert record.ledger.state_of("a") is State.STALE
    assert not record.ledger.restart_unproven("a", now)


@pytest.mark.parametrize("proven", [True, False], ids=["proven", "still unproven"])
def test_our_replacement_first_seen_past_its_grace_gets_one_settle_to_prove_itself(
    proven: bool,
) -> None:
    # Busy with long generations, it finished nothing between its two reads: moved to
    # STALE and failed by the grace in the same settle, its healthy server restarted. The
    # spare is one settle: one that still proves nothing then is a failed restart.
    at = T0
    record = _restarted(["a"], at)
    now = at + record.ledger.policy.startup_grace + 100
    start = at + 600
    first = (Read(now - 5, _serving(100, 3, start)), Read(now, _serving(140, 3, start)))
    busy = Verdict(VerdictKind.RESTARTED, True, "restarted: a new process", reads=first)
    assert _settled(record, "a", busy, now) == []
    assert record.ledger.state_of("a") is State.STALE
    idle = (Read(now + 295, _serving(300, 9, start)), Read(now + 300, _serving(300, 9, start)))
    said = "answered in 0.1 s by model tiny" if proven else "failed: no answer within 1 s"
    answer = Answer(now + 300, proven, said, "tiny", ("tiny",))
    kind = VerdictKind.IDLE if proven else VerdictKind.UNANSWERED
    then = Verdict(kind, proven, f"{kind}: {said}", reads=idle, answer=answer)
    assert _settled(record, "a", then, now + 300) == ([] if proven else ["a"])
    assert record.ledger.state_of("a") is (State.HEALTHY if proven else State.RESTARTING)


def test_a_restart_failed_by_its_grace_is_in_the_settles_report() -> None:
    # Its command exited 0 (counted ok), and no new process came within the grace: the
    # restart failed, and the daemon counts the report's expired ones as failed restarts
    # (llmhealth_backend_restarts_total{outcome="failed"}, LLMHealthRestartsFailing).
    at = T0
    record = _restarted(["a"], at)
    now = at + record.ledger.policy.startup_grace + 1
    down = Verdict(VerdictKind.DOWN, False, "down: refused")
    report, _ = settle(
        record,
        SHARED_FAULT_FLEET,
        [Outcome(Target("a", record.ledger.url_of("a")), down)],
        now,
        mode=Mode.ACT,
        audit=None,
    )
    assert [(t.name, t.from_state, t.to_state) for t in report.expired] == [
        ("a", State.RESTARTING, State.DEAD)
    ]


def test_a_stale_spell_begun_after_the_restarts_grace_ran_out_is_not_failed_by_it() -> None:
    # The restart's grace ran out (DEAD), an operator held the backend and restarted it by
    # hand: the new process was failed by that old grace the moment it was seen (a second
    # failure), and restarted once the hold ended, undoing the operator's fix.
    at = T0
    grace = ledger_policy(SHARED_FAULT_FLEET.policy).startup_grace
    record = _restarted(["a"], at)
    record.ledger.expire_restarts(at + grace)
    assert record.ledger.state_of("a") is State.DEAD
    start = at + grace + 500
    for now in (at + grace + 600, at + grace + 900, at + 3 * grace):
        reads = (Read(now - 5, _serving(100, 3, start)), Read(now, _serving(140, 3, start)))
        kind = VerdictKind.RESTARTED if now == at + grace + 600 else VerdictKind.BUSY
        busy = Verdict(kind, True, f"{kind}: progressing", reads=reads)
        assert _settled(record, "a", busy, now) == []
        assert record.ledger.state_of("a") is State.STALE
    assert not record.ledger.restart_unproven("a", at + 3 * grace)


def test_a_replacement_replaced_again_before_it_was_proven_is_judged_as_the_new_one() -> None:
    # systemd restarted the replacement: the ledger kept comparing against the process
    # that was gone, turned away the new one's finished requests, and the grace failed a
    # working server.
    at = T0
    record = _restarted(["a"], at)
    first = (Read(at + 60, _serving(10, 0, at + 30)), Read(at + 65, _serving(12, 0, at + 30)))
    up = Verdict(VerdictKind.RESTARTED, True, "restarted: a new process", reads=first)
    assert _settled(record, "a", up, at + 65) == []
    second = (Read(at + 460, _serving(10, 0, at + 450)), Read(at + 465, _serving(30, 2, at + 450)))
    again = Verdict(VerdictKind.RESTARTED, True, "restarted: another one", reads=second)
    assert _settled(record, "a", again, at + 465) == []
    assert record.ledger.snapshot("a", at + 465).last_ok_at == at + 465  # seen working
    late = at + ledger_policy(SHARED_FAULT_FLEET.policy).startup_grace + 10
    working = (Read(late - 5, _serving(300, 60, at + 450)), Read(late, _serving(340, 62, at + 450)))
    busy = Verdict(VerdictKind.BUSY, True, "busy: progressing", reads=working)
    assert _settled(record, "a", busy, late) == []
    assert record.ledger.state_of("a") is State.STALE


def _restarted_without_start_times(at: float) -> tuple[FleetRecord, CommandDone, Target]:
    """ "a" restarted at ``at`` after a last read with no start time (vLLM's multiprocess
    mode): the record, its command's exit 0 to be heard, and the target."""
    record = _restarted(["a"], at)
    record.sightings["a"] = Sighting(at - 10, True, _serving(10, 1, None))
    order = RestartOrder("a", "http://10.0.0.0:8000", ("true",), 60.0, at, "wedged", {})
    ran = CommandDone(order, CommandResult(("true",), 0, False, 0.1, "", ""))
    return record, ran, Target("a", order.url)


def test_a_replacement_without_start_times_is_seen_once_its_command_has_run() -> None:
    # vLLM's multiprocess mode publishes no start time: a cron check saw the replacement's
    # counters past the wedged process's, took it for that process, and failed a working
    # server at the grace ("no new process").
    at = T0
    record, ran, _ = _restarted_without_start_times(at)
    settle(record, SHARED_FAULT_FLEET, [], at + 5, mode=Mode.ACT, audit=None, commands=[ran])
    now = at + 300
    reads = (Read(now - 5, _serving(3000, 100, None)), Read(now, _serving(3100, 104, None)))
    busy = Verdict(VerdictKind.BUSY, True, "busy: progressing", reads=reads)
    assert _settled(record, "a", busy, now) == []
    assert record.ledger.state_of("a") is State.STALE  # its replacement, seen working


def test_reads_of_the_old_process_settled_after_its_restart_command_are_not_its_replacement() -> (
    None
):
    # No start times: the verdict heard in the same settle as the command's end held reads
    # and an answer of the process the command was replacing, taken for its replacement,
    # re-admitted unproven.
    at = T0
    record, ran, target = _restarted_without_start_times(at)
    old = (Read(at + 20, _serving(10, 1, None)), Read(at + 25, _serving(10, 1, None)))
    answered = Answer(at + 25, True, "answered in 0.1 s by model tiny", "tiny", ("tiny",))
    idle = Verdict(VerdictKind.IDLE, True, "idle: answered", reads=old, answer=answered)
    settle(
        record,
        SHARED_FAULT_FLEET,
        [Outcome(target, idle)],
        at + 31,
        mode=Mode.OFF,
        audit=None,
        commands=[ran],
    )
    assert record.ledger.state_of("a") is State.RESTARTING


def test_a_replacement_without_start_times_read_in_watch_is_seen_at_the_next_settle() -> None:
    # watch hears the command and the verdict read before it in one settle; a rule that
    # marked the sighting then lost the mark to that verdict, and the replacement, its
    # counters no lower than the wedged process's, was never seen: failed by the grace.
    at = T0
    record, ran, target = _restarted_without_start_times(at)
    for when, commands in ((at + 35, [ran]), (at + 65, [])):
        reads = (Read(when - 5, _serving(10, 1, None)), Read(when, _serving(10, 1, None)))
        answer = Answer(when, True, "answered in 0.1 s by model tiny", "tiny", ("tiny",))
        idle = Verdict(VerdictKind.IDLE, True, "idle: answered", reads=reads, answer=answer)
        outcomes = [Outcome(target, idle)]
        settle(
            record, SHARED_FAULT_FLEET, outcomes, when, mode=Mode.OFF, audit=None, commands=commands
        )
    assert record.ledger.state_of("a") is State.HEALTHY


def _heard_then_read(
    condemned: Signals | None, reads: Sequence[Signals], *, during: Signals | None = None
) -> FleetRecord:
    """ "a" condemned on ``condemned`` (None: never read) and restarted at T0, read on
    ``during`` while its command ran, the command heard exiting 0 at T0 + 5, then idle
    verdicts answered on ``reads``, 30 s apart."""
    at = T0
    urls = {backend.name: backend.url for backend in SHARED_FAULT_FLEET.backends}
    record = fresh_record(ledger_policy(SHARED_FAULT_FLEET.policy), urls, now=at - 100)
    target = Target("a", urls["a"])

    def settled(when: float, verdict: Verdict | None, done: Sequence[CommandDone] = ()) -> None:
        outcomes = [] if verdict is None else [Outcome(target, verdict)]
        settle(record, SHARED_FAULT_FLEET, outcomes, when, mode=Mode.OFF, audit=None, commands=done)

    if condemned is not None:
        frozen = Verdict(VerdictKind.WEDGED, False, "wedged", reads=(Read(at - 10, condemned),))
        record.observe("a", frozen, at - 10)
    else:
        record.ledger.apply("a", WedgeProven(now=at - 10))
    record.ledger.apply("a", RestartIssued(now=at))
    if during is not None:
        settled(at + 3, Verdict(VerdictKind.BUSY, True, "busy", reads=(Read(at + 3, during),)))
    order = RestartOrder("a", urls["a"], ("true",), 60.0, at, "wedged", {})
    settled(at + 5, None, [CommandDone(order, CommandResult(("true",), 0, False, 0.1, "", ""))])
    for index, signals in enumerate(reads, start=1):
        when = at + 5 + index * 30.0
        answer = Answer(when, True, "answered in 0.1 s by model tiny", "tiny", ("tiny",))
        read = (Read(when - 1, signals), Read(when, signals))
        settled(when, Verdict(VerdictKind.IDLE, True, "idle", reads=read, answer=answer))
    return record


def test_the_old_process_still_answering_after_its_restart_command_is_not_its_replacement() -> None:
    # A command that signals and returns at once (`kubectl rollout restart`): the wedged
    # process, no start times, still answers /metrics, its counters frozen. Taken for the
    # replacement it went to STALE, then DEAD on its wedge, a failed restart.
    old = _serving(10, 1, None)
    assert _heard_then_read(old, [old, old]).ledger.state_of("a") is State.RESTARTING


def test_the_old_process_is_known_as_last_read_not_as_condemned() -> None:
    # Its counters moved while DEAD (a tiny request it answered): compared with them as
    # condemned, the old process, still answering after a command that returned at once,
    # was "another process" and re-admitted as its own replacement.
    at = T0
    urls = {backend.name: backend.url for backend in SHARED_FAULT_FLEET.backends}
    record = fresh_record(ledger_policy(SHARED_FAULT_FLEET.policy), urls, now=at - 100)
    target = Target("a", urls["a"])
    frozen = Verdict(
        VerdictKind.WEDGED, False, "wedged", reads=(Read(at - 20, _serving(100, 10, None)),)
    )
    record.observe("a", frozen, at - 20)
    moved = _serving(101, 11, None)
    answer = Answer(at - 10, True, "answered in 0.1 s by model tiny", "tiny", ("tiny",))
    idle = Verdict(VerdictKind.IDLE, True, "idle", reads=(Read(at - 10, moved),), answer=answer)
    _, orders = settle(
        record, SHARED_FAULT_FLEET, [Outcome(target, idle)], at, mode=Mode.ACT, audit=None
    )
    assert [o.name for o in orders] == ["a"]
    ran = CommandDone(orders[0], CommandResult(("true",), 0, False, 0.1, "", ""))
    settle(record, SHARED_FAULT_FLEET, [], at + 5, mode=Mode.OFF, audit=None, commands=[ran])
    again = Answer(at + 35, True, "answered in 0.1 s by model tiny", "tiny", ("tiny",))
    still = (Read(at + 34, moved), Read(at + 35, moved))
    old = Verdict(VerdictKind.IDLE, True, "idle", reads=still, answer=again)
    settle(record, SHARED_FAULT_FLEET, [Outcome(target, old)], at + 35, mode=Mode.OFF, audit=None)
    assert record.ledger.state_of("a") is State.RESTARTING


def test_a_replacement_read_while_its_command_ran_is_seen_once_it_ended() -> None:
    # Start times, and the old process never read with metrics: the sighting became the
    # replacement while the command ran, and compared with it the replacement was "the
    # old one" for good, failed by the grace and restarted though it answered.
    new = _serving(50, 5, T0 + 2)
    record = _heard_then_read(None, [new], during=_serving(40, 4, T0 + 2))
    assert record.ledger.state_of("a") is State.HEALTHY


def test_a_replacement_that_wedges_again_holds_the_slot_and_doubles_its_cooldown() -> None:
    # One fault shared by every backend: the first one's replacement came up and wedged
    # too, which freed the slot (b, then c restarted, every 80 s) and left its cooldown
    # at one minute: the fleet restarted in turn, each burning its budget.
    at = T0
    record = _restarted(["a"], at)
    for name in ("b", "c"):
        record.ledger.apply(name, WedgeProven(now=at))
    start = at + 10
    up = (Read(at + 20, _serving(5, 0, start)), Read(at + 25, _serving(5, 0, start)))
    wedged = Verdict(VerdictKind.WEDGED, False, "wedged: steps 5→5→5", reads=up)
    assert _settled(record, "a", wedged, at + 30) == []  # a new process: STALE
    again = (*up, Read(at + 35, _serving(5, 0, start)))
    wedged = Verdict(VerdictKind.WEDGED, False, "wedged: steps 5→5→5", reads=again)
    assert _settled(record, "a", wedged, at + 35) == []  # its wedge proven: DEAD
    assert record.ledger.state_of("a") is State.DEAD
    assert record.restarts["a"].failures == 1  # its restart failed: the cooldown doubles
    assert record.ledger.restart_unproven("a", at + 35)  # and b, c wait
    later = at + record.ledger.policy.startup_grace + 1
    idle = Verdict(VerdictKind.WEDGED, False, "wedged: steps 5→5→5", reads=up[-1:])
    assert _settled(record, "b", idle, later) == ["a"]  # grace over: a again, first in line


def test_a_wedge_proven_on_a_backend_traffic_condemned_is_audited_and_restarted_with_its_proof(
    tmp_path: Path,
) -> None:
    # Failed requests condemned gpu0 (not in restart_on); a wedge proven later becomes the
    # condemning cause and the restart follows. That re-condemnation, DEAD to DEAD, was
    # written nowhere, and the restart was audited "condemned_by: wedged" with the failed
    # requests as its evidence: the reads that proved the wedge were in no record.
    store, audit = StateFile(tmp_path / "state.json"), AuditLog(tmp_path / "audit.jsonl")
    failed = [
        RequestOutcome(T0 + i, "POST", "/v1/completions", FailureKind.SERVER_ERROR, 500)
        for i in range(3)
    ]
    first = settle_fleet(
        store, RESTARTABLE, backend_urls([GPU0]), lambda _record: [], mode=Mode.ACT,
        audit=audit, clock=ticking(T0 + 10), requests={"gpu0": failed},
    )  # fmt: skip
    assert first.record.ledger.snapshot("gpu0", T0 + 20).condemned_by == "request_failures"
    assert first.orders == ()
    settled = settle_fleet(
        store, RESTARTABLE, backend_urls([GPU0]), lambda _record: [wedged(GPU0)],
        mode=Mode.ACT, audit=audit, clock=ticking(T0 + 20),
    )  # fmt: skip
    assert [order.name for order in settled.orders] == ["gpu0"]
    lines = read(audit.path)
    [proven] = [line for line in lines if line["event"] == "wedge_proven"]
    assert (proven["from"], proven["to"]) == ("dead", "dead")
    assert proven["evidence"]["verdict"] == "wedged"
    [restart] = [line for line in lines if line["event"] == "restart"]
    assert restart["condemned_by"] == "wedged"
    assert restart["evidence"]["verdict"] == "wedged"  # not the failed requests


def test_a_reload_that_only_respells_a_url_loses_no_failure_nor_verdict(
    tmp_path: Path,
) -> None:
    # The router counts a request's failure across a reload that writes the backend's URL
    # another way (the scheme's own port dropped, a host's case): the same server. The
    # settle dropped every outcome drained across it as if it had moved (three 500s in a
    # row left gpu0 HEALTHY and serving), and the verdict read just before the reload
    # (gpu1's wedge, proven a settle late).
    store, audit = StateFile(tmp_path / "state.json"), AuditLog(tmp_path / "audit.jsonl")
    before = {"gpu0": "http://127.0.0.1:80", "gpu1": "http://LOCALHOST:10"}
    after = {"gpu0": "http://127.0.0.1", "gpu1": "http://localhost:10"}

    def config(urls: dict[str, str]) -> Config:
        return Config(backends=tuple(Backend(name, url) for name, url in urls.items()))

    settle_fleet(
        store, config(before), before, lambda _record: [], mode=Mode.ACT, audit=audit,
        clock=ticking(T0),
    )  # fmt: skip
    failed = [
        RequestOutcome(T0 + 5 + i, "POST", "/v1/completions", FailureKind.SERVER_ERROR, 500)
        for i in range(3)
    ]
    read_before = wedged(Target("gpu1", before["gpu1"]))
    settled = settle_fleet(
        store, config(after), after, lambda _record: [read_before], mode=Mode.ACT,
        audit=audit, clock=ticking(T0 + 10), requests={"gpu0": failed},
    )  # fmt: skip
    ledger = settled.record.ledger
    assert {name: ledger.url_of(name) for name in after} == after  # as the config writes them
    gpu0, gpu1 = (ledger.snapshot(name, T0 + 20) for name in ("gpu0", "gpu1"))
    assert (gpu0.state, gpu0.condemned_by) == (State.DEAD, "request_failures")
    assert (gpu1.state, gpu1.condemned_by) == (State.DEAD, "wedged")


def test_failures_recorded_under_a_name_a_reload_then_changed_count_against_the_backend(
    tmp_path: Path,
) -> None:
    # A rename keeps the backend's failure streak; the router's outcomes recorded under
    # the old name before the reload, drained at the next settle, were dropped as those of
    # a backend no longer configured: the failure that made three in a row was lost.
    store, audit = StateFile(tmp_path / "state.json"), AuditLog(tmp_path / "audit.jsonl")
    url = GPU0.url

    def failed(at: float) -> RequestOutcome:
        return RequestOutcome(at, "POST", "/v1/completions", FailureKind.SERVER_ERROR, 500)

    settle_fleet(
        store, Config(backends=(Backend("gpu0", url),)), {"gpu0": url}, lambda _record: [],
        mode=Mode.ACT, audit=audit, clock=ticking(T0 + 10),
        requests={"gpu0": [failed(T0 + 1), failed(T0 + 2)]},
    )  # fmt: skip
    settled = settle_fleet(
        store, Config(backends=(Backend("node-gpu0", url),)), {"node-gpu0": url},
        lambda _record: [], mode=Mode.ACT, audit=audit, clock=ticking(T0 + 20),
        requests={"gpu0": [failed(T0 + 15)]},
    )  # fmt: skip
    snap = settled.record.ledger.snapshot("node-gpu0", T0 + 30)
    assert (snap.state, snap.condemned_by) == (State.DEAD, "request_failures")
    proof = settled.record.proofs["node-gpu0"]["requests"]
    assert [r["at"] for r in proof] == [T0 + 1, T0 + 2, T0 + 15]


def test_a_restart_after_a_failed_one_still_tells_its_command_what_condemned_the_backend(
    tmp_path: Path,
) -> None:
    """README: LLMHEALTH_REASON is the evidence that condemned the backend. The retry
    after a failed command (or a startup grace run out) was told the last error instead,
    "restart failed: restart command exited 1", and a script choosing by cause chose wrong."""
    store, audit, order = issued(tmp_path)
    assert order.env["LLMHEALTH_REASON"] == "wedged: steps 5→5→5"
    hear(store, audit, CommandDone(order, result(1)))
    retried = settle_empty(store, audit, T0 + 1000)  # past the doubled cooldown
    [again] = retried.orders
    assert again.env["LLMHEALTH_REASON"] == "wedged: steps 5→5→5"
    # And after a restart whose replacement never came: the grace ran out.
    hear(store, audit, CommandDone(again, result(0)), start=T0 + 1010)
    expired = settle_empty(store, audit, T0 + 5000)
    [third] = expired.orders
    assert third.env["LLMHEALTH_REASON"] == "wedged: steps 5→5→5"


def test_a_dead_backend_a_reload_moved_is_not_restarted_before_it_is_read_where_it_is_now(
    tmp_path: Path,
) -> None:
    """The wedge was proven on the server it left: restarted in the settle that moved it
    (here its hold released meanwhile), the new server was restarted never having been
    read, let alone proven wedged. Its first read there decides, as fleet.py intends."""
    store, audit = StateFile(tmp_path / "state.json"), AuditLog(tmp_path / "audit.jsonl")
    held = operate.hold(store, audit, RESTARTABLE, "gpu0", 3600, "moving it", clock=lambda: T0)
    assert held.applied, held.message
    first = settle_fleet(
        store,
        RESTARTABLE,
        backend_urls([GPU0]),
        lambda _record: [wedged(GPU0)],
        mode=Mode.ACT,
        audit=audit,
        clock=ticking(T0 + 10),
    )
    assert first.orders == () and first.record.ledger.state_of("gpu0") == "dead"
    there = Target("gpu0", "http://127.0.0.1:11")
    moved = Config(backends=(Backend("gpu0", there.url, restart=RESTART),))
    released = operate.release(store, audit, moved, "gpu0", clock=lambda: T0 + 100)
    assert released.applied, released.message

    def settle_moved(outcomes: list[Outcome], start: float) -> Settled:
        return settle_fleet(
            store,
            moved,
            backend_urls([there]),
            lambda _record: outcomes,
            mode=Mode.ACT,
            audit=audit,
            clock=ticking(start),
        )

    unread = settle_moved([], T0 + 200)
    assert unread.orders == ()  # before: a restart of the server at :11, never read
    assert [(n.action, n.reason) for n in unread.report.restarts] == [
        ("skip", "moved to http://127.0.0.1:11: not read there yet")
    ]
    read_there = settle_moved([wedged(there)], T0 + 300)  # its first read: wedged as well
    assert [order.url for order in read_there.orders] == [there.url]


def test_a_dead_backend_dropped_and_added_back_at_another_server_is_read_before_a_restart(
    tmp_path: Path,
) -> None:
    """It comes back DEAD as it left, but at another address: what condemned it was the
    server it left, as for a backend a reload moved. Restarted in the settle that added it
    back, the new server was restarted never having been read."""
    store, audit = StateFile(tmp_path / "state.json"), AuditLog(tmp_path / "audit.jsonl")
    first = settle_fleet(
        store,
        RESTARTABLE,
        backend_urls([GPU0]),
        lambda _record: [wedged(GPU0)],
        mode=Mode.OFF,  # --no-restart: condemned, not restarted yet
        audit=audit,
        clock=ticking(T0),
    )
    assert first.record.ledger.state_of("gpu0") == "dead"
    without = Config(backends=(Backend("gpu1", GPU1.url),))
    settle_fleet(
        store,
        without,
        backend_urls([GPU1]),
        lambda _record: [],
        mode=Mode.ACT,
        audit=audit,
        clock=ticking(T0 + 100),
    )
    there = Target("gpu0", "http://127.0.0.1:11")
    back = Config(backends=(Backend("gpu0", there.url, restart=RESTART), Backend("gpu1", GPU1.url)))

    def settle_back(outcomes: list[Outcome], start: float) -> Settled:
        return settle_fleet(
            store,
            back,
            backend_urls([there, GPU1]),
            lambda _record: outcomes,
            mode=Mode.ACT,
            audit=audit,
            clock=ticking(start),
        )

    unread = settle_back([], T0 + 200)
    assert unread.record.ledger.state_of("gpu0") == "dead"  # as it left
    assert unread.orders == ()  # before: a restart of the server at :11, never read
    assert [(n.action, n.reason) for n in unread.report.restarts] == [
        ("skip", "moved to http://127.0.0.1:11: not read there yet")
    ]
    read_there = settle_back([wedged(there)], T0 + 300)  # its first read: wedged as well
    assert [order.url for order in read_there.orders] == [there.url]


def test_a_restart_dropped_because_an_operator_held_its_backend_is_no_failed_restart(
    tmp_path: Path,
) -> None:
    """check drops a later command whose backend was held meanwhile (``_no_longer_to_run``):
    the operator only held it. Heard as a failed command, its cooldown doubled, as though
    the restart had been tried and failed."""
    store, audit, order = issued(tmp_path)
    held = operate.hold(store, audit, RESTARTABLE, "gpu0", 60, "sync", clock=lambda: T0 + 10)
    assert held.applied, held.message
    dropped = withdrawn_now(store, RESTARTABLE, order, T0 + 20)  # as check drops a later command
    assert dropped is not None and "hold" in dropped.result.stderr, dropped
    record = hear(store, audit, dropped, start=T0 + 30)
    assert record.ledger.state_of("gpu0") == "dead"  # owed its restart once the hold ends
    assert record.restarts["gpu0"].failures == 0  # before: 1, the cooldown doubled


@pytest.mark.parametrize(
    ("reloaded", "why"),
    [
        pytest.param(
            Backend("gpu0", GPU0.url, restart=("/bin/true", "gpu0")),
            "restart command was changed by a reload",
            id="changed",
        ),
        pytest.param(Backend("gpu0", GPU0.url), "restart command was changed", id="removed"),
        pytest.param(  # not "its command changed": the audit trail said so of a dropped one
            Backend("gpu9", "http://127.0.0.1:99", restart=RESTART),
            "server was taken out of the config by a reload",
            id="gone",
        ),
    ],
)
def test_a_restart_whose_command_a_reload_changed_is_withdrawn_not_run(
    tmp_path: Path, reloaded: Backend, why: str
) -> None:
    """A daemon's reload between the settle that issued a restart and its command's start
    (the command thread asks ``withdrawn_now`` with the config as it is then) ran the
    command the config no longer names: a wrong unit restarted, or one the operator took
    away. Withdrawn, it spends no attempt, and its backend is owed its restart anew."""
    store, audit, order = issued(tmp_path)
    after = Config(backends=(reloaded,))
    dropped = withdrawn_now(store, after, order, T0 + 20)
    assert dropped is not None and dropped.withdrawn, dropped
    assert why in dropped.result.stderr
    assert withdrawn_now(store, RESTARTABLE, order, T0 + 20) is None  # the same config: run
    record = hear(store, audit, dropped, start=T0 + 30)
    assert record.ledger.state_of("gpu0") == "dead"
    assert record.ledger.snapshot("gpu0", T0 + 30).restart_attempts == 0


def test_a_restart_withdrawn_because_an_operator_held_its_backend_spends_no_attempt(
    tmp_path: Path,
) -> None:
    """A withdrawn command never ran, so it is no attempt against the restart budget
    (DESIGN: attempts are bounded): it kept the attempt its RESTARTING spent, and with
    restart_budget 1 the backend released from its hold was retired without a single
    command ever having run."""
    config = replace(RESTARTABLE, policy=Policy(restart_budget=1))
    store, audit = StateFile(tmp_path / "state.json"), AuditLog(tmp_path / "audit.jsonl")

    def settle_at(start: float, commands: Sequence[CommandDone] = ()) -> Settled:
        return settle_fleet(
            store,
            config,
            backend_urls([GPU0]),
            lambda _record: [wedged(GPU0)] if start == T0 else [],
            mode=Mode.OFF if commands else Mode.ACT,
            audit=audit,
            clock=ticking(start),
            commands=commands,
        )

    [order] = settle_at(T0).orders
    held = operate.hold(store, audit, config, "gpu0", 3600, "sync", clock=lambda: T0 + 10)
    assert held.applied, held.message
    dropped = withdrawn_now(store, config, order, T0 + 20)  # as check drops a later command
    assert dropped is not None and dropped.withdrawn, dropped
    record = settle_at(T0 + 30, [dropped]).record
    assert record.ledger.state_of("gpu0") == "dead"
    assert record.ledger.snapshot("gpu0", T0 + 30).restart_attempts == 0  # before: 1
    released = operate.release(store, audit, config, "gpu0", clock=lambda: T0 + 100)
    assert released.applied, released.message
    after = settle_at(T0 + 200)
    assert [(n.action, n.reason) for n in after.report.restarts] == [
        ("restart", "condemned by wedged: restart 1 of 1 allowed in 24h")
    ]  # before: ("retire", "restart budget spent: 1 attempt in 24h ...")
    assert [o.name for o in after.orders] == ["gpu0"]


def test_a_backend_traffic_condemned_and_restarted_in_one_settle_has_its_restart_awaited() -> None:
    # Real traffic condemned "a" (request_failures in restart_on) in the settle that then
    # restarted it; its verdict in between, busy with requests finishing, was counted
    # towards recovery in place as if no restart were pending, and stamped it good at the
    # restart's own instant. That stamp passed for the replacement proving itself: a
    # replacement that never answered stayed STALE for ever, never failed by its grace,
    # never restarted or retired, and it held no restart slot meanwhile.
    config = Config(
        backends=(Backend("a", "http://10.0.0.1:8000", restart=("true",)),),
        policy=Policy(restart_on=("wedged", "request_failures")),
    )
    record = fresh_record(ledger_policy(config.policy), {"a": config.backends[0].url}, T0 - 100)
    start = T0 - 5000
    record.sightings["a"] = Sighting(T0 - 10, True, _serving(10, 1, start))
    record.ledger.apply("a", GoodVerdict(now=T0 - 10, process=process_of(_serving(10, 1, start))))
    failed = [
        RequestOutcome(T0 - 8 + i, "POST", "/v1/completions", FailureKind.SERVER_ERROR, 500)
        for i in range(3)
    ]
    reads = (Read(T0 - 5, _serving(100, 3, start)), Read(T0 - 1, _serving(140, 5, start)))
    busy = Verdict(VerdictKind.BUSY, True, "busy: progressing", reads=reads)
    target = Target("a", config.backends[0].url)
    report, orders = settle(
        record, config, [Outcome(target, busy)], T0, mode=Mode.ACT, audit=None,
        requests={"a": failed},
    )  # fmt: skip
    assert [order.name for order in orders] == ["a"]
    [verdict] = report.backends[0].transitions  # the restart decides, not this process
    assert not verdict.applied and "a restart is pending" in verdict.reason, verdict
    assert record.ledger.state_of("a") is State.RESTARTING
    # Its replacement comes up and fails every tiny request.
    later = T0 + 60
    up = Read(later - 1, _serving(0, 0, T0 + 30))
    answer = Answer(later, False, "failed: HTTP 500", "tiny", ("tiny",))
    new = Verdict(VerdictKind.RESTARTED, False, "restarted: new", reads=(up,), answer=answer)
    settle(record, config, [Outcome(target, new)], later, mode=Mode.ACT, audit=None)
    assert record.ledger.state_of("a") is State.STALE
    assert record.ledger.restart_unproven("a", later)  # its restart holds the slot
    past = T0 + record.ledger.policy.startup_grace + 1
    still = Verdict(
        VerdictKind.UNANSWERED, False, "unanswered: HTTP 500",
        reads=(Read(past - 1, _serving(0, 0, T0 + 30)),),
        answer=Answer(past, False, "failed: HTTP 500", "tiny", ("tiny",)),
    )  # fmt: skip
    report, _ = settle(record, config, [Outcome(target, still)], past, mode=Mode.ACT, audit=None)
    assert [(t.name, t.to_state) for t in report.expired] == [("a", State.DEAD)]


@pytest.mark.parametrize("ahead", [6 * 3600.0, 1e300], ids=["clock stepped back 6 h", "1e300"])
def test_a_restart_stamped_after_now_is_failed_one_grace_after_it_is_first_seen(
    ahead: float,
) -> None:
    # The wall clock stepped back after "a" was restarted (NTP correcting a clock that ran
    # ahead, a VM resumed from a snapshot), or the state holds a time far ahead: "a" stayed
    # RESTARTING for as long as the step (for ever at 1e300), its replacement never came,
    # and its restart held the fleet's one slot, so a wedged "b" was never restarted.
    now = T0
    record = _restarted(["a"], now + ahead)
    record.ledger.apply("b", WedgeProven(now=now - 1))
    down = Verdict(VerdictKind.DOWN, False, "down: refused")
    assert _settled(record, "a", down, now) == []
    assert record.ledger.state_of("a") is State.RESTARTING
    later = now + record.ledger.policy.startup_grace + 1
    record.holds["a"] = Hold("looking at it", later + 60, "operator")
    assert _settled(record, "a", down, later) == ["b"]
    assert record.ledger.state_of("a") is State.DEAD
    # Its own next attempt waits a cooldown counted from when the step was seen, not
    # from an attempt stamped ahead.
    record.ledger.apply("b", NewProcessUp(now=later + 1))
    record.ledger.apply("b", Readmitted(now=later + 2))
    del record.holds["a"]
    assert _settled(record, "a", down, later + 3) == ["a"]


def test_a_command_running_when_the_clock_stepped_back_is_heard_as_its_restarts(
    tmp_path: Path,
) -> None:
    """watch runs a restart command beside its settles: one settle while it ran found the
    restart stamped ahead of a clock stepped back and took it as now, and the command's
    failure, heard after, no longer matched its restart's time: dropped as superseded, the
    backend stayed RESTARTING for a whole grace instead of DEAD and retried."""
    store, audit, order = issued(tmp_path)  # issued at T0 + 2 by a clock 2 h ahead
    back = T0 - 7200
    during = settle_empty(store, audit, back, commands_running=frozenset({"gpu0"}))
    assert during.record.ledger.state_of("gpu0") == "restarting"
    record = hear(store, audit, CommandDone(order, result(1)), start=back + 30)
    [line] = [r for r in read(audit.path) if r["event"] == "restart_command"]
    assert "superseded" not in line, line
    assert record.ledger.state_of("gpu0") == "dead"
    assert record.restarts["gpu0"].failures == 1


def test_a_replacement_seen_working_before_the_clock_stepped_back_is_not_failed_by_its_grace() -> (
    None
):
    """Taken back to now, a restart and the replacement's requests seen finishing after it
    became one instant, and that good no longer came after the restart: the grace failed
    a working replacement busy with long generations, and restarted it."""
    at = T0 + 7200  # stamped by a clock two hours ahead
    record = _restarted(["a"], at)
    start = at + 30
    first = (Read(at + 60, _serving(10, 0, start)), Read(at + 65, _serving(30, 2, start)))
    up = Verdict(VerdictKind.RESTARTED, True, "restarted: a new process", reads=first)
    assert _settled(record, "a", up, at + 65) == []
    assert record.ledger.snapshot("a", at + 65).last_ok_at == at + 65  # seen working
    grace = record.ledger.policy.startup_grace
    for now in (T0, T0 + grace + 10):  # the clock stepped back; long generations finish nothing
        reads = (Read(now - 5, _serving(300, 2, start)), Read(now, _serving(340, 2, start)))
        busy = Verdict(VerdictKind.BUSY, True, "busy: progressing", reads=reads)
        assert _settled(record, "a", busy, now) == []
        assert record.ledger.state_of("a") is State.STALE


def test_a_dead_backend_moved_after_the_clock_stepped_back_is_still_read_before_its_restart(
    tmp_path: Path,
) -> None:
    """Its death and its last read stamped by a clock two hours ahead, then taken back to
    now: moved by a reload in that settle, it looked dead since no earlier than the move
    and read since it, and the server it moved to was restarted never having been read."""
    ahead = 7200.0
    store, audit = StateFile(tmp_path / "state.json"), AuditLog(tmp_path / "audit.jsonl")
    held = operate.hold(
        store, audit, RESTARTABLE, "gpu0", 3600, "moving it", clock=lambda: T0 + ahead
    )
    assert held.applied, held.message
    first = settle_fleet(
        store,
        RESTARTABLE,
        backend_urls([GPU0]),
        lambda _record: [wedged(GPU0)],
        mode=Mode.ACT,
        audit=audit,
        clock=ticking(T0 + ahead + 10),
    )
    assert first.orders == () and first.record.ledger.state_of("gpu0") == "dead"
    there = Target("gpu0", "http://127.0.0.1:11")
    moved = Config(backends=(Backend("gpu0", there.url, restart=RESTART),))
    released = operate.release(store, audit, moved, "gpu0", clock=lambda: T0 + ahead + 100)
    assert released.applied, released.message
    unread = settle_fleet(
        store,
        moved,
        backend_urls([there]),
        lambda _record: [],
        mode=Mode.ACT,
        audit=audit,
        clock=ticking(T0 + 200),  # the clock stepped back
    )
    assert unread.orders == ()
    assert [(n.action, n.reason) for n in unread.report.restarts] == [
        ("skip", "moved to http://127.0.0.1:11: not read there yet")
    ]


def test_requests_drained_after_the_clock_stepped_back_keep_their_order_with_the_restart() -> None:
    """Real traffic seen before the wall clock stepped back is stamped by the clock that
    ran ahead, and drained by the first settle after the step: fed after that settle took
    the record's times back, its answered request's time stayed two hours ahead, after
    the restart the same settle issued. That passed for the replacement proving itself:
    one that never answered stayed STALE for ever, never failed by its grace, and freed
    its restart slot at once."""
    config = Config(
        backends=(Backend("a", "http://10.0.0.1:8000", restart=("true",)),),
        policy=Policy(restart_on=("wedged", "request_failures")),
    )
    ahead = T0 + 7200  # what the clock read before it stepped back
    record = fresh_record(ledger_policy(config.policy), {"a": config.backends[0].url}, ahead - 100)
    start = T0 - 5000
    serving = _serving(10, 1, start)
    record.sightings["a"] = Sighting(ahead - 10, True, serving)
    record.ledger.apply("a", GoodVerdict(now=ahead - 10, process=process_of(serving)))
    seen = [RequestOutcome(ahead - 9, "POST", "/v1/completions")] + [
        RequestOutcome(ahead - 8 + i, "POST", "/v1/completions", FailureKind.SERVER_ERROR, 500)
        for i in range(3)
    ]
    target = Target("a", config.backends[0].url)
    _, orders = settle(record, config, [], T0, mode=Mode.ACT, audit=None, requests={"a": seen})
    assert [order.name for order in orders] == ["a"]
    assert record.ledger.state_of("a") is State.RESTARTING
    later = T0 + 60
    up = Read(later - 1, _serving(0, 0, T0 + 30))
    answer = Answer(later, False, "failed: HTTP 500", "tiny", ("tiny",))
    new = Verdict(VerdictKind.RESTARTED, False, "restarted: new", reads=(up,), answer=answer)
    settle(record, config, [Outcome(target, new)], later, mode=Mode.ACT, audit=None)
    assert record.ledger.state_of("a") is State.STALE
    assert record.ledger.restart_unproven("a", later)  # its restart holds the slot
    past = T0 + record.ledger.policy.startup_grace + 1
    still = Verdict(
        VerdictKind.UNANSWERED, False, "unanswered: HTTP 500",
        reads=(Read(past - 1, _serving(0, 0, T0 + 30)),),
        answer=Answer(past, False, "failed: HTTP 500", "tiny", ("tiny",)),
    )  # fmt: skip
    report, _ = settle(record, config, [Outcome(target, still)], past, mode=Mode.ACT, audit=None)
    assert [(t.name, t.to_state) for t in report.expired] == [("a", State.DEAD)]


def test_a_command_of_a_restart_taken_back_is_not_heard_as_the_restart_after_it() -> None:
    """A cron check ran the command of a restart stamped by a clock two hours ahead (a
    `restart_timeout` past the grace: it waits for the server). The clock stepped back;
    the next checks took the restart back to their time, failed it at its grace and
    issued another, whose command a later check ran. The first command's timeout, heard
    then, was taken as the second restart's: its restart "issued" two hours after the
    ledger's last, it passed for that restart taken back, and failed the one whose
    command still ran."""
    at = T0 + 7200  # the clock ran two hours ahead
    record = _restarted(["a"], at)
    first = RestartOrder("a", record.ledger.url_of("a"), ("true",), 1200.0, at, "wedged", {})
    down = Verdict(VerdictKind.DOWN, False, "down: refused")
    assert _settled(record, "a", down, T0) == []  # the clock stepped back
    past = T0 + record.ledger.policy.startup_grace + 1
    assert _settled(record, "a", down, past) == ["a"]  # its grace ran out: restarted again
    second_at = record.ledger.snapshot("a", past).last_restart_at
    assert second_at == past
    timed_out = CommandResult(("true",), None, True, 1200.0, "", "")
    settle(
        record, SHARED_FAULT_FLEET, [], past + 100, mode=Mode.OFF, audit=None,
        commands=[CommandDone(first, timed_out)],
    )  # fmt: skip
    assert record.ledger.state_of("a") is State.RESTARTING  # the second's command still runs
    assert record.ledger.snapshot("a", past + 100).last_restart_at == second_at


def test_requests_drained_after_the_clock_stepped_back_are_before_a_restart_through_the_store(
    tmp_path: Path,
) -> None:
    """As watch settles (``settle_fleet``): the record's times are taken back as it is
    opened, the requests with them, before the restart the settle issues."""
    config = Config(
        backends=(Backend("a", "http://10.0.0.1:8000", restart=("true",)),),
        policy=Policy(restart_on=("wedged", "request_failures")),
    )
    ahead = T0 + 7200  # what the clock read before it stepped back
    store = StateFile(tmp_path / "state.json")
    record = fresh_record(ledger_policy(config.policy), {"a": config.backends[0].url}, ahead - 100)
    record.ledger.apply("a", GoodVerdict(now=ahead - 10))
    with store.locked():
        store.load(dict)
        store.save(record.to_document())
    seen = [RequestOutcome(ahead - 9, "POST", "/v1/completions")] + [
        RequestOutcome(ahead - 8 + i, "POST", "/v1/completions", FailureKind.SERVER_ERROR, 500)
        for i in range(3)
    ]
    settled = settle_fleet(
        store, config, {"a": config.backends[0].url}, lambda _record: [], mode=Mode.ACT,
        audit=None, clock=ticking(T0), requests={"a": seen},
    )  # fmt: skip
    assert [order.name for order in settled.orders] == ["a"]
    snapshot = settled.record.ledger.snapshot("a", T0 + 5)
    assert snapshot.last_ok_at is not None and snapshot.last_restart_at is not None
    assert snapshot.last_ok_at < snapshot.last_restart_at  # 7,189 s after it before


@pytest.mark.parametrize("ahead", [0.0, 7200.0], ids=["no step", "clock stepped back 2 h"])
def test_requests_after_a_verdict_read_before_the_clock_stepped_back_stay_after_it(
    tmp_path: Path, ahead: float
) -> None:
    """watch reads a backend, the wall clock steps back (NTP correcting a clock that ran
    ahead), and the settle after it feeds that read's verdict with the real requests
    drained since. The requests were taken back with the record's times, the verdict's
    reads were not: every request passed for one that ended before the read, and went
    first. A failed tiny request, then a real request answered and two failed: that
    order leaves two failures in a row; fed the other way round, three condemned it."""
    config = Config(backends=(Backend("a", "http://10.0.0.1:8000"),))
    stamped = T0 + ahead  # what the clock read before it stepped back
    store = StateFile(tmp_path / "state.json")
    urls = {"a": config.backends[0].url}
    record = fresh_record(ledger_policy(config.policy), urls, stamped - 100)
    serving = _serving(0, 0, T0 - 5000)
    record.ledger.apply("a", GoodVerdict(now=stamped - 30, process=process_of(serving)))
    with store.locked():
        store.load(dict)
        store.save(record.to_document())
    target = Target("a", config.backends[0].url)
    unanswered = Verdict(
        VerdictKind.UNANSWERED, False, "unanswered: HTTP 500",
        reads=(Read(stamped - 11, serving),),
        answer=Answer(stamped - 10, False, "failed: HTTP 500", "tiny", ("tiny",)),
    )  # fmt: skip
    seen = [RequestOutcome(stamped - 8, "POST", "/v1/completions")] + [
        RequestOutcome(stamped - 6 + i, "POST", "/v1/completions", FailureKind.SERVER_ERROR, 500)
        for i in range(2)
    ]
    settled = settle_fleet(
        store, config, {"a": target.url}, lambda _record: [Outcome(target, unanswered)],
        mode=Mode.ACT, audit=None, clock=ticking(T0), requests={"a": seen},
    )  # fmt: skip
    snapshot = settled.record.ledger.snapshot("a", T0 + 5)
    assert (snapshot.state, snapshot.request_failures) == (State.SUSPECT, 2)


@pytest.mark.parametrize("ahead", [0.0, 7200.0], ids=["no step", "clock stepped back 2 h"])
def test_requests_failed_after_the_clock_stepped_back_count_against_a_backend_restarted_before(
    tmp_path: Path, ahead: float
) -> None:
    """A backend re-admitted while the wall clock ran ahead (its fresh start stamped two
    hours on), then the clock stepped back, and its new process failed every real request
    since. Taken back to just before the settle, the fresh start passed for one after
    those requests, stamped by the corrected clock: dropped as the old process's, they
    never counted, and the first settle after the step left it HEALTHY and serving."""
    config = Config(backends=(Backend("a", "http://10.0.0.1:8000"),))
    stamped = T0 + ahead  # what the clock read before it stepped back
    store = StateFile(tmp_path / "state.json")
    urls = {"a": config.backends[0].url}
    record = fresh_record(ledger_policy(config.policy), urls, stamped - 100)
    serving = _serving(0, 0, T0 - 5000)
    record.ledger.apply("a", GoodVerdict(now=stamped - 30, process=process_of(serving)))
    record.fresh_since["a"] = stamped - 30
    with store.locked():
        store.load(dict)
        store.save(record.to_document())
    seen = [
        RequestOutcome(T0 - 3 + i, "POST", "/v1/completions", FailureKind.SERVER_ERROR, 500)
        for i in range(3)
    ]
    settled = settle_fleet(
        store, config, urls, lambda _record: [], mode=Mode.ACT, audit=None,
        clock=ticking(T0), requests={"a": seen},
    )  # fmt: skip
    snapshot = settled.record.ledger.snapshot("a", T0 + 5)
    assert (snapshot.state, snapshot.request_failures) == (State.DEAD, 3)


@pytest.mark.parametrize("ahead", [0.0, 7200.0], ids=["no step", "clock stepped back 2 h"])
def test_requests_before_the_clock_stepped_back_go_before_a_verdict_read_after_it(
    tmp_path: Path, ahead: float
) -> None:
    """The mirror: real requests seen before the wall clock stepped back, a read after it,
    then a request answered. Taken back to just before the settle, the requests passed
    for ones after the read, and went after its verdict: an answered request, two failed
    and a failed tiny request, three in a row that condemn it, were fed as one failure
    and then two."""
    config = Config(backends=(Backend("a", "http://10.0.0.1:8000"),))
    stamped = T0 + ahead - 20  # what the clock read before it stepped back
    store = StateFile(tmp_path / "state.json")
    urls = {"a": config.backends[0].url}
    record = fresh_record(ledger_policy(config.policy), urls, stamped - 100)
    serving = _serving(0, 0, T0 - 5000)
    record.ledger.apply("a", GoodVerdict(now=stamped - 30, process=process_of(serving)))
    with store.locked():
        store.load(dict)
        store.save(record.to_document())
    target = Target("a", config.backends[0].url)
    seen = [
        RequestOutcome(stamped - 8, "POST", "/v1/completions"),
        *(
            RequestOutcome(stamped - 6 + i, "POST", "/v1/completions", FailureKind.SERVER_ERROR)
            for i in range(2)
        ),
        RequestOutcome(T0 - 0.5, "POST", "/v1/completions"),  # after the read
    ]
    unanswered = Verdict(
        VerdictKind.UNANSWERED, False, "unanswered: HTTP 500",
        reads=(Read(T0 - 2, serving),),
        answer=Answer(T0 - 1, False, "failed: HTTP 500", "tiny", ("tiny",)),
    )  # fmt: skip
    settled = settle_fleet(
        store, config, urls, lambda _record: [Outcome(target, unanswered)], mode=Mode.ACT,
        audit=None, clock=ticking(T0), requests={"a": seen},
    )  # fmt: skip
    assert settled.record.ledger.state_of("a") is State.DEAD


@pytest.mark.parametrize("ahead", [0.0, 7200.0], ids=["no step", "clock stepped back 2 h"])
def test_requests_failed_after_the_clock_stepped_back_under_a_new_name_count(
    tmp_path: Path, ahead: float
) -> None:
    """As above, with a reload that renamed the backend at its server since the last
    settle: the router counts its requests under the new name. The record's times were
    taken back under the old name, the requests under the new one were not re-spaced
    after them: stamped by the corrected clock, they fell before the fresh start taken
    back and were dropped as the old process's."""
    config = Config(backends=(Backend("b", "http://10.0.0.1:8000"),))
    stamped = T0 + ahead  # what the clock read before it stepped back
    store = StateFile(tmp_path / "state.json")
    urls = {"a": config.backends[0].url}
    record = fresh_record(ledger_policy(config.policy), urls, stamped - 100)
    serving = _serving(0, 0, T0 - 5000)
    record.ledger.apply("a", GoodVerdict(now=stamped - 30, process=process_of(serving)))
    record.fresh_since["a"] = stamped - 30
    with store.locked():
        store.load(dict)
        store.save(record.to_document())
    seen = [
        RequestOutcome(T0 - 3 + i, "POST", "/v1/completions", FailureKind.SERVER_ERROR, 500)
        for i in range(3)
    ]
    settled = settle_fleet(
        store, config, {"b": config.backends[0].url}, lambda _record: [], mode=Mode.ACT,
        audit=None, clock=ticking(T0), requests={"b": seen},
    )  # fmt: skip
    snapshot = settled.record.ledger.snapshot("b", T0 + 5)
    assert (snapshot.state, snapshot.request_failures) == (State.DEAD, 3)


def test_a_cooldown_counting_down_writes_its_skip_once_whole_minutes_or_not(
    tmp_path: Path,
) -> None:
    """A skip is written again only when its reason changed, numbers aside. The time left
    in a cooldown is one number written as several ("1m5s", "1m", "55s"): each time it
    came out a whole number of minutes, or fell under one, the skip's reason read as new
    and the same decision went to the trail again, with its proof, fsync'd."""
    store, audit, order = issued(tmp_path)  # issued at T0 + 2
    hear(store, audit, CommandDone(order, result(1)), start=T0 + 3)  # 2 min of cooldown
    for step in range(14):  # a settle every 5 s, from 1m11s to 6s left
        settled = settle_empty(store, audit, T0 + 50 + 5 * step)
        assert settled.orders == ()
    skips = [r["reason"] for r in read(audit.path) if r["event"] == "restart_skipped"]
    assert len(skips) == 1, skips


def test_a_wedged_server_dropped_and_configured_again_under_a_new_name_stays_dead(
    tmp_path: Path,
) -> None:
    """A wedged gpu0 dropped from the config in one run and added as "node-a" at its
    server in a later one came in as a new backend, HEALTHY and serving the wedge."""
    path = tmp_path / "state.json"
    store, audit, times = StateFile(path), AuditLog(tmp_path / "audit.jsonl"), ticking()

    def settle(backends: dict[str, str], outcomes: Sequence[Outcome] = ()) -> Settled:
        config = Config(backends=tuple(Backend(name, url) for name, url in backends.items()))
        return settle_fleet(
            store, config, backends, lambda _record: outcomes, mode=Mode.ACT, audit=audit,
            clock=times,
        )  # fmt: skip

    settle(backend_urls([GPU0, GPU1]), [wedged(GPU0)])
    settle({"gpu1": GPU1.url})
    settled = settle({"gpu1": GPU1.url, "node-a": GPU0.url})
    assert settled.record.ledger.serving == ("gpu1",)
    assert saved(path)["node-a"]["state"] == "dead"
    assert saved(path)["node-a"]["condemned_by"] == "wedged"
    lines = [(r["backend"], r["event"], r["to"]) for r in read(audit.path)][-2:]
    assert lines[0] == ("node-a", "renamed", "dead")


def test_a_command_heard_after_a_reload_shifted_its_name_off_its_server_is_that_servers(
    tmp_path: Path,
) -> None:
    """{gpu0 (restarting): u0} -> {node-gpu0: u0, gpu0: u1}: the record at u0 is node-gpu0
    now (``FleetRecord.renames``), and its command's failure is that record's, not the
    new gpu0's at u1 ("superseded", the RESTARTING u0 left to its grace)."""
    store, audit, order = issued(tmp_path)
    shifted = Config(
        backends=(Backend("node-gpu0", GPU0.url, restart=RESTART), Backend("gpu0", GPU1.url))
    )
    settled = settle_fleet(
        store,
        shifted,
        {"node-gpu0": GPU0.url, "gpu0": GPU1.url},
        lambda _record: [],
        mode=Mode.OFF,
        audit=audit,
        clock=ticking(T0 + 100),
        commands=[CommandDone(order, result(1))],
    )
    assert settled.record.ledger.by_url(GPU0.url) == "node-gpu0"
    assert settled.record.ledger.state_of("node-gpu0") == "dead"
    [line] = [r for r in read(audit.path) if r["event"] == "restart_command"]
    assert (line["backend"], line["issued_as"], line["to"]) == ("node-gpu0", "gpu0", "dead")
    assert [(n.name, n.ran, n.ok) for n in settled.report.restarts] == [("node-gpu0", True, False)]


def test_our_replacement_put_to_sleep_is_not_restarted_by_its_startup_grace() -> None:
    # An RL trainer put the server we restarted to sleep between rollouts (it loaded its
    # model to be put to sleep): a sleeping vLLM is never sent the tiny request, so nothing
    # proved it, its grace failed it, and the restart policy restarted a sleeping server.
    at = T0
    record = _restarted(["a"], at)
    asleep = EngineSignals(
        engine="0", running=0.0, waiting=0.0, steps=0.0, generation_tokens=0.0,
        prompt_tokens=0.0, finished=0.0, preemptions=0.0, kv_usage=0.0,
        sleep_state="weights_offloaded",
    )  # fmt: skip
    new = Signals(engines=(asleep,), process_start=at + 30)
    baseline = record.sightings["a"].baseline
    up = decide([Read(at + 60, new)], baseline=baseline)
    assert isinstance(up, Verdict) and up.kind is VerdictKind.RESTARTED and up.requests_sent == 0
    assert _settled(record, "a", up, at + 60) == []
    assert record.ledger.state_of("a") is State.STALE
    later = at + record.ledger.policy.startup_grace + 1
    sleeping = decide([Read(later - 5, new), Read(later, new)])
    assert isinstance(sleeping, Verdict) and sleeping.requests_sent == 0
    assert _settled(record, "a", sleeping, later) == []
    assert record.ledger.state_of("a") is State.STALE


def _wedge_of(start: float, at: float, steps: float) -> Verdict:
    """A wedge proven on the process started at ``start``, read at ``at``."""
    reads = (Read(at - 2, _serving(steps, 1, start)), Read(at - 1, _serving(steps, 1, start)))
    return Verdict(VerdictKind.WEDGED, False, f"wedged: steps {steps}→{steps}", reads=reads)


def _working(start: float, at: float, steps: float) -> Verdict:
    """The process started at ``start`` progressing and finishing requests, read at ``at``
    (pass more ``steps`` each time: its requests finished climb with them)."""
    reads = (
        Read(at - 5, _serving(steps, steps / 10, start)),
        Read(at - 1, _serving(steps + 40, steps / 10 + 2, start)),
    )
    return Verdict(VerdictKind.BUSY, True, "busy: progressing", reads=reads)


@pytest.mark.parametrize("held", [True, False], ids=["held", "not held"])
def test_a_dead_backend_recovers_in_place_only_when_no_restart_of_it_is_pending(
    held: bool,
) -> None:
    """A restart to come decides for a DEAD backend, not its own process (its command
    still runs here, then a cooldown): it stays DEAD however well it reads. A hold keeps
    the restart from coming (only remediation waits), so nothing decides for the held
    process: it may prove its way back in place. Counted as a pending restart, it stayed
    DEAD, out of serving, for the whole hold."""
    record = fresh_record(ledger_policy(RESTARTABLE.policy), backend_urls([GPU0]), T0 - 100)
    start = T0 - 5000
    running = frozenset({"gpu0"})  # a command of its own: no restart now, one pending
    settle(record, RESTARTABLE, [Outcome(GPU0, _wedge_of(start, T0, 5))], T0,
           mode=Mode.ACT, audit=None, commands_running=running)  # fmt: skip
    assert record.ledger.state_of("gpu0") is State.DEAD
    if held:
        record.holds["gpu0"] = Hold("weight sync", T0 + 3600, "trainer")
    for later, steps in [(T0 + 60, 100), (T0 + 120, 200)]:  # healthy_threshold: 2
        _, orders = settle(
            record, RESTARTABLE, [Outcome(GPU0, _working(start, later, steps))], later,
            mode=Mode.ACT, audit=None, commands_running=running,
        )  # fmt: skip
        assert orders == []
    assert record.ledger.state_of("gpu0") is (State.STALE if held else State.DEAD)


def test_a_skip_is_written_again_once_its_backend_left_dead_and_came_back(
    tmp_path: Path,
) -> None:
    """A skip written once is not written again while its reason stands, but only while
    the backend stays DEAD: condemned again after it recovered, the same reason is a new
    decision on new proof, and belongs in the trail."""
    config = Config(backends=(Backend("gpu0", GPU0.url),))  # no restart command
    audit = AuditLog(tmp_path / "audit.jsonl")
    record = fresh_record(ledger_policy(config.policy), backend_urls([GPU0]), T0 - 100)
    start = T0 - 5000
    for at, verdict in [
        (T0, _wedge_of(start, T0, 5)),
        (T0 + 30, _wedge_of(start, T0 + 30, 5)),  # the same skip: not written again
        (T0 + 60, _working(start, T0 + 60, 100)),
        (T0 + 90, _working(start, T0 + 90, 200)),  # STALE: its own process proved itself
        (T0 + 120, _wedge_of(start, T0 + 120, 300)),
    ]:
        settle(record, config, [Outcome(GPU0, verdict)], at, mode=Mode.ACT, audit=audit)
    skips = [r["time"] for r in read(audit.path) if r["event"] == "restart_skipped"]
    assert skips == [T0, T0 + 120]


def test_a_backend_traffic_condemned_where_a_reload_moved_it_is_restarted_unread() -> None:
    """Only a condemnation from before a move waits for the first read at the new server
    (what condemned it was the server it left). Real traffic that condemned it at its new
    server since judged that server: its restart does not wait for a read."""
    policy = Policy(restart_on=("wedged", "request_failures"))
    old = Config(backends=(Backend("a", "http://10.0.0.1:8000", restart=("true",)),), policy=policy)
    new = replace(old, backends=(Backend("a", "http://10.0.0.2:8000", restart=("true",)),))
    record = fresh_record(ledger_policy(policy), {"a": old.backends[0].url}, T0 - 100)
    record.sightings["a"] = Sighting(T0 - 50, True, _serving(10, 1, T0 - 5000))
    record.reconcile({"a": new.backends[0].url}, T0 - 20)  # the reload
    failed = [
        RequestOutcome(T0 - 8 + i, "POST", "/v1/completions", FailureKind.SERVER_ERROR, 500)
        for i in range(3)
    ]
    _, orders = settle(record, new, [], T0, mode=Mode.ACT, audit=None, requests={"a": failed})
    assert [order.name for order in orders] == ["a"]
    assert record.ledger.state_of("a") is State.RESTARTING


def test_a_restart_its_caller_has_not_read_yet_is_not_failed_by_its_grace() -> None:
    """``unread`` (a daemon just started, a backend just added or moved): a restart past
    its grace with no verdict of this settle waits for the first read. Failed unseen, a
    server that came back meanwhile was restarted again, never read."""
    record = fresh_record(ledger_policy(RESTARTABLE.policy), backend_urls([GPU0]), T0 - 100)
    record.ledger.apply("gpu0", WedgeProven(now=T0 - 50, evidence="steps 5→5→5"))
    record.ledger.apply("gpu0", RestartIssued(now=T0))
    past = T0 + record.ledger.policy.startup_grace + 10
    report, orders = settle(
        record, RESTARTABLE, [], past, mode=Mode.ACT, audit=None, unread=frozenset({"gpu0"})
    )
    assert (report.expired, orders) == ((), [])
    assert record.ledger.state_of("gpu0") is State.RESTARTING
    report, _ = settle(record, RESTARTABLE, [], past + 1, mode=Mode.ACT, audit=None)
    assert [t.name for t in report.expired] == ["gpu0"]  # once its caller has read it


def test_a_skip_logged_in_a_dry_run_is_logged_again_by_the_next_run_that_acts(
    tmp_path: Path,
) -> None:
    """A dry run logs every decision, marked ``dry_run``, and remembers none as written:
    the real run after it logs its own skip, or the trail held only a dry run's word
    for what the daemon decided."""
    config = Config(backends=(Backend("gpu0", GPU0.url),))  # no restart command
    audit = AuditLog(tmp_path / "audit.jsonl")
    record = fresh_record(ledger_policy(config.policy), backend_urls([GPU0]), T0 - 100)
    settle(record, config, [wedged(GPU0)], T0, mode=Mode.DRY_RUN, audit=audit)
    settle(record, config, [], T0 + 30, mode=Mode.DRY_RUN, audit=audit)
    settle(record, config, [], T0 + 60, mode=Mode.ACT, audit=audit)
    skips = [r for r in read(audit.path) if r["event"] == "restart_skipped"]
    assert [(r["time"], r["dry_run"]) for r in skips] == [
        (T0, True), (T0 + 30, True), (T0 + 60, False)
    ]  # fmt: skip


def test_a_proof_kept_with_the_record_is_cut_to_its_share_the_audit_line_is_not(
    tmp_path: Path,
) -> None:
    """The record keeps a condemnation's reads only within ``PROOF_BYTES`` (it is one etcd
    request); the condemnation's own audit line has them whole."""
    audit = AuditLog(tmp_path / "audit.jsonl")
    record = fresh_record(ledger_policy(CONFIG.policy), backend_urls([GPU0]), T0 - 1000)
    start = T0 - 5000
    reads = tuple(Read(T0 - 400 + i, _serving(5, 1, start)) for i in range(400))
    verdict = Verdict(VerdictKind.WEDGED, False, "wedged: steps 5→5", reads=reads)
    settle(record, CONFIG, [Outcome(GPU0, verdict)], T0, mode=Mode.OFF, audit=audit)
    proof = record.proofs["gpu0"]
    assert proof["reads_left_out"] > 0
    assert len(json.dumps(proof)) <= PROOF_BYTES
    [line] = [r for r in read(audit.path) if r["event"] == "wedge_proven"]
    assert len(line["evidence"]["reads"]) == 400


def _without_descriptors(action: Callable[[], T]) -> T:
    """``action`` run while this process can open no file: its soft limit lowered to the
    descriptors it holds, every one left taken."""
    import resource  # noqa: PLC0415

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    taken: list[int] = []
    # A file an earlier test left in a cycle, closed by a collection while ``action`` runs,
    # would give it descriptors back: collected now, before every one is taken.
    gc.collect()
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(256, soft), hard))
    try:
        try:
            while True:
                taken.append(os.open(os.devnull, os.O_RDONLY))
        except OSError:
            pass
        return action()
    finally:
        for descriptor in taken:
            os.close(descriptor)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_a_restart_command_this_process_had_no_descriptor_to_start_spends_no_attempt() -> None:
    """A command llmhealth could not start for want of its own descriptors (EMFILE for
    its pipes) is no restart that failed: counted as one, a daemon short of descriptors
    spent each wedged backend's budget, doubled its cooldown, and retired it."""
    at = T0
    record = _restarted(["a"], at)
    order = RestartOrder("a", record.ledger.url_of("a"), ("true",), 60.0, at, "wedged", {})
    result = _without_descriptors(lambda: run_command(order.argv, 5.0))
    assert result.exit_code is None and result.own_shortage, result
    done = CommandDone(order, result)
    settle(record, SHARED_FAULT_FLEET, [], at + 5, mode=Mode.OFF, audit=None, commands=[done])
    assert record.ledger.state_of("a") is State.DEAD
    assert record.ledger.snapshot("a", at + 5).restart_attempts == 0
    assert record.restarts["a"] == RestartHistory(0, at)  # its cooldown stands, undoubled


def test_a_restart_command_not_started_for_want_of_descriptors_keeps_its_undoubled_cooldown() -> (
    None
):
    """README: one llmhealth could not start for want of its own descriptors is "back to
    DEAD with no attempt spent, its next try after the cooldown, not doubled": not at the
    very next settle (a withdrawn order's "no cooldown"), nor after a doubled one."""
    at = T0
    record = _restarted(["a"], at)
    order = RestartOrder("a", record.ledger.url_of("a"), ("true",), 60.0, at, "wedged", {})
    result = CommandResult(("true",), None, False, 0.0, "", "cannot run", own_shortage=True)
    settle(
        record, SHARED_FAULT_FLEET, [], at + 5, mode=Mode.OFF, audit=None,
        commands=[CommandDone(order, result)],
    )  # fmt: skip
    cooldown = SHARED_FAULT_FLEET.policy.cooldown

    def orders(now: float) -> list[str]:
        _, issued = settle(record, SHARED_FAULT_FLEET, [], now, mode=Mode.ACT, audit=None)
        return [issued_order.name for issued_order in issued]

    assert orders(at + 6) == []
    assert orders(at + cooldown - 1) == []
    assert orders(at + cooldown + 1) == ["a"]


def test_a_checks_restart_command_with_no_thread_to_run_it_in_is_heard_as_not_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Out of threads (a pids limit), `check` could not hand its restart command to a
    thread: the RuntimeError ended the check with a traceback after the restart was
    saved, its backend left RESTARTING until the grace failed it as a tried restart.
    It is heard as `watch` hears it: not run, no attempt spent, and the check reports."""
    marker = tmp_path / "restarted"
    config = Config(backends=(Backend("gpu0", GPU0.url, restart=("touch", str(marker))),))
    store, audit = StateFile(tmp_path / "state.json"), AuditLog(tmp_path / "audit.jsonl")

    async def probe(targets: Sequence[Target], *_args: object, **_kwargs: object) -> list[Outcome]:
        return [wedged(target) for target in targets]

    def start(self: threading.Thread) -> None:
        raise RuntimeError("can't start new thread")

    monkeypatch.setattr("llmhealth.cycle.check_fleet", probe)
    monkeypatch.setattr(threading.Thread, "start", start)
    report = run_cycle(config, [GPU0], ProbeSettings(wait=0.0, timeout=1.0), store, audit=audit)
    monkeypatch.undo()
    assert not marker.exists()
    [note] = [note for note in report.restarts if note.action == "restart"]
    assert note.ok is False, note
    assert saved(store.path)["gpu0"]["state"] == "dead"
    assert saved(store.path)["gpu0"]["restart_times"] == [], "an attempt was spent"
    commands = [r for r in read(audit.path) if r["event"] == "restart_command"]
    assert len(commands) == 1 and "no thread" in commands[0]["command"]["stderr"], commands


def test_a_restart_command_a_check_gave_up_for_want_of_a_thread_never_runs_later(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The loop's executor queues a call before the thread it starts for it fails: one
    of its threads still busy (a resolver's call for a name that does not answer) took
    the queued command once free, and ran the restart the check had heard as not run."""
    marker = tmp_path / "restarted"
    config = Config(backends=(Backend("gpu0", GPU0.url, restart=("touch", str(marker))),))
    store, audit = StateFile(tmp_path / "state.json"), AuditLog(tmp_path / "audit.jsonl")
    real_start = threading.Thread.start

    def start(self: threading.Thread) -> None:
        if self.name.startswith("asyncio"):  # the loop's executor: no thread more
            raise RuntimeError("can't start new thread")
        real_start(self)

    # The busy thread is held until the check has given the command up, then takes it.
    held, taken = threading.Event(), threading.Event()
    real_run, real_give_up = cycle_module._Handoff.run, cycle_module._Handoff.give_up

    def run(self: cycle_module._Handoff) -> CommandResult:
        try:
            return real_run(self)
        finally:
            taken.set()

    def give_up(self: cycle_module._Handoff) -> bool:
        try:
            return real_give_up(self)
        finally:
            held.set()

    async def probe(targets: Sequence[Target], *_args: object, **_kwargs: object) -> list[Outcome]:
        asyncio.get_running_loop().run_in_executor(None, held.wait, 60.0)  # still busy
        monkeypatch.setattr(threading.Thread, "start", start)
        return [wedged(target) for target in targets]

    monkeypatch.setattr(cycle_module._Handoff, "run", run)
    monkeypatch.setattr(cycle_module._Handoff, "give_up", give_up)
    monkeypatch.setattr("llmhealth.cycle.check_fleet", probe)
    try:
        run_cycle(config, [GPU0], ProbeSettings(wait=0.0, timeout=1.0), store, audit=audit)
    finally:
        held.set()
    assert taken.wait(60.0), "the freed thread never took the queued call"
    monkeypatch.undo()
    assert not marker.exists(), "the restart heard as not run ran after all"
    assert saved(store.path)["gpu0"]["state"] == "dead"


def test_a_check_interrupted_when_its_loop_cannot_start_the_thread_that_closes_it_is_interrupted(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Out of threads when the loop's close shuts its executor down, a check a Ctrl-C had
    ended raised the close's RuntimeError in place of the KeyboardInterrupt: a traceback
    as a bug report ("internal error") where the run was only interrupted."""

    def start(self: threading.Thread) -> None:
        raise RuntimeError("can't start new thread")

    async def check() -> None:
        await asyncio.get_running_loop().run_in_executor(None, int)  # the executor exists
        monkeypatch.setattr(threading.Thread, "start", start)
        signal.raise_signal(signal.SIGINT)  # asyncio.run's handler cancels the check
        await asyncio.sleep(10)

    with pytest.raises(KeyboardInterrupt):
        run_loop(check())
    monkeypatch.undo()


def test_a_restart_command_a_freed_thread_took_before_the_check_gave_it_up_is_heard_as_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A thread of the loop's executor freed after the call was queued and before the
    check gave it up (its own thread failing to start) ran the restart, while the check
    heard it as not run: DEAD, no attempt spent, a restart that did happen unrecorded."""
    marker = tmp_path / "restarted"
    config = Config(backends=(Backend("gpu0", GPU0.url, restart=("touch", str(marker))),))
    store, audit = StateFile(tmp_path / "state.json"), AuditLog(tmp_path / "audit.jsonl")
    real_start, release = threading.Thread.start, threading.Event()

    def start(self: threading.Thread) -> None:
        if not self.name.startswith("asyncio"):
            real_start(self)
            return
        release.set()  # the busy thread frees now, and takes the queued command
        queue = self._args[1]  # type: ignore[attr-defined]  # the executor's work queue
        for _ in range(500):
            if queue.empty():
                break
            time.sleep(0.01)
        raise RuntimeError("can't start new thread")

    async def probe(targets: Sequence[Target], *_args: object, **_kwargs: object) -> list[Outcome]:
        asyncio.get_running_loop().run_in_executor(None, release.wait, 5.0)  # still busy
        monkeypatch.setattr(threading.Thread, "start", start)
        return [wedged(target) for target in targets]

    monkeypatch.setattr("llmhealth.cycle.check_fleet", probe)
    report = run_cycle(config, [GPU0], ProbeSettings(wait=0.0, timeout=1.0), store, audit=audit)
    monkeypatch.undo()
    [note] = [note for note in report.restarts if note.action == "restart"]
    ran = marker.exists()
    assert note.ok is ran, (ran, note)
    assert saved(store.path)["gpu0"]["state"] == ("restarting" if ran else "dead")
