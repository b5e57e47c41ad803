"""Operator verbs over a real state file and audit log, through the installed command."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path
from unittest.mock import ANY

import pytest
from diskfaults import directory_syncs

from llmhealth import operate
from llmhealth.actions import AuditLog, read
from llmhealth.config import Config
from llmhealth.config import load as load_config
from llmhealth.fleet import FleetRecord
from llmhealth.ledger import (
    GoodVerdict,
    Ledger,
    LedgerPolicy,
    NewProcessUp,
    ProcessSeen,
    Readmitted,
    State,
    WedgeProven,
)
from llmhealth.policy import Hold
from llmhealth.state import StateError, StateFile
from llmhealth.traffic import FailureKind, RequestOutcome

T0 = 1_796_000_000.0


def saved_fleet(path: Path, backends: list[tuple[str, str]], wedged: str) -> Path:
    """A state at ``path`` holding ``backends`` (name, URL), ``wedged`` condemned for a
    wedge and the rest healthy."""
    ledger = Ledger(LedgerPolicy(), backends, now=T0)
    ledger.apply(wedged, WedgeProven(now=T0, evidence="steps 8660→8660→8660"))
    store = StateFile(path)
    with store.locked():
        store.save(FleetRecord(ledger).to_dict())
    return path


def load_saved(path: Path) -> FleetRecord:
    store = StateFile(path)
    with store.locked():
        loaded = store.load(lambda doc: FleetRecord.from_dict(doc, LedgerPolicy()))
    assert loaded is not None
    return loaded


@pytest.fixture
def state(tmp_path: Path) -> Path:
    """A saved fleet of two: gpu0 healthy, gpu1 condemned for a wedge."""
    fleet = [("gpu0", "http://127.0.0.1:9"), ("gpu1", "http://127.0.0.1:10")]
    return saved_fleet(tmp_path / "state.json", fleet, "gpu1")


def llmhealth(*args: str) -> subprocess.CompletedProcess[str]:
    command = shutil.which("llmhealth", path=str(Path(sys.executable).parent))
    assert command is not None
    return subprocess.run([command, *args], capture_output=True, text=True, timeout=60, check=False)


def status(path: Path) -> dict[str, dict[str, object]]:
    result = llmhealth("status", "--state", str(path), "--format", "json")
    assert result.returncode in (0, 1, 2), result.stderr
    return {b["name"]: b for b in json.loads(result.stdout)["backends"]}


def test_status_shows_the_saved_ledger_and_exits_by_its_states(state: Path) -> None:
    result = llmhealth("status", "--state", str(state), "--format", "json")
    assert result.returncode == 2  # a DEAD backend is critical
    document = json.loads(result.stdout)
    assert document["fleet"]["serving"] == 1
    gpu1 = document["backends"][1]
    assert (gpu1["name"], gpu1["state"], gpu1["serving"]) == ("gpu1", "dead", False)
    assert gpu1["condemned_by"] == "wedged"
    table = llmhealth("status", "--state", str(state))
    assert "gpu1" in table.stdout
    assert "dead" in table.stdout


def test_status_shows_no_terminal_control_a_record_holds(tmp_path: Path) -> None:
    # A record's texts can be a server's words (a 5xx reason phrase the router heard) or
    # anyone's who can write the etcd key: the table escapes them.
    ledger = Ledger(LedgerPolicy(), [("gpu0", "http://127.0.0.1:9")], now=T0)
    ledger.apply("gpu0", WedgeProven(now=T0, evidence="steps \x1b[2J\x1b]0;owned\x07 frozen"))
    path = tmp_path / "state.json"
    store = StateFile(path)
    with store.locked():
        store.save(FleetRecord(ledger).to_dict())
    table = llmhealth("status", "--state", str(path))
    assert "frozen" in table.stdout
    assert "\x1b" not in table.stdout and "\x07" not in table.stdout


def test_status_names_each_backend_s_last_error_once_not_again_below_the_table(
    tmp_path: Path,
) -> None:
    """Below the table, the fleet's line repeated every backend's state and last error,
    each wedge's evidence in full: 200 wedged backends put 90 KB more on the operator's
    terminal in one paragraph, after the table that already shows them."""
    backends = [(f"gpu{i}", f"http://127.0.0.1:{1000 + i}") for i in range(200)]
    ledger = Ledger(LedgerPolicy(), backends, now=T0)
    for name, _ in backends:
        ledger.apply(name, WedgeProven(now=T0, evidence="steps 8660→8660→8660 " + "x" * 400))
    path = tmp_path / "state.json"
    store = StateFile(path)
    with store.locked():
        store.save(FleetRecord(ledger).to_dict())
    table = llmhealth("status", "--state", str(path))
    assert table.returncode == 2, table.stderr
    below = table.stdout.rpartition("└")[2]
    assert "last error" not in below and len(below) < 300, below[:600]
    assert "floor breached" in below.lower() and "0 serving" in below, below


def test_a_check_under_its_floor_says_so_in_one_short_line(tmp_path: Path) -> None:
    """A check under the floor ended with the fleet's line naming every backend's state
    and last error again, the evidence of each past wedge in full: at 3 a.m. the lines
    that matter scrolled away behind it."""
    backends = [(f"gpu{i}", f"http://127.0.0.1:{9 + i}") for i in range(2)]
    path = saved_fleet(tmp_path / "state.json", backends, "gpu1")
    config = tmp_path / "fleet.toml"
    config.write_text(
        f'state = "{path}"\n[policy]\nmin_healthy = 2\n'
        + "".join(f'[[backend]]\nname = "{n}"\nurl = "{u}"\n' for n, u in backends)
    )
    result = llmhealth("check", "--config", str(config), "--no-restart", "--wait", "0.1")
    assert result.returncode == 2, result.stderr
    (fleet,) = [line for line in result.stdout.splitlines() if line.startswith("fleet")]
    assert "FLOOR BREACHED" in fleet and "8660" not in result.stdout, result.stdout
    assert len(fleet) < 100, fleet


def test_a_dead_backend_cannot_be_readmitted_and_nothing_changes(state: Path) -> None:
    before = state.read_bytes()
    result = llmhealth("readmit", "gpu1", "--state", str(state))
    assert result.returncode == 1
    assert "only a STALE backend can be re-admitted" in result.stderr
    assert state.read_bytes() == before
    [entry] = read(state.with_name("audit.jsonl"))
    assert (entry["event"], entry["applied"], entry["from"], entry["to"]) == (
        "readmit",
        False,
        "dead",
        "dead",
    )


@pytest.mark.slow
def test_retire_reset_readmit_walks_retired_stale_healthy_with_an_audit_line_each(
    state: Path,
) -> None:
    assert llmhealth("retire", "gpu1", "--reason", "bad GPU", "--state", str(state)).returncode == 0
    assert status(state)["gpu1"]["state"] == "retired"
    assert llmhealth("reset", "gpu1", "--state", str(state)).returncode == 0
    assert status(state)["gpu1"]["state"] == "stale"
    result = llmhealth("readmit", "gpu1", "--weight-version", "7", "--state", str(state))
    assert result.returncode == 0, result.stderr
    gpu1 = status(state)["gpu1"]
    assert (gpu1["state"], gpu1["serving"], gpu1["weight_version"]) == ("healthy", True, 7)
    audit = read(state.with_name("audit.jsonl"))
    assert [(e["event"], e["from"], e["to"]) for e in audit] == [
        ("retire", "dead", "retired"),
        ("reset", "retired", "stale"),
        ("readmit", "stale", "healthy"),
    ]
    assert audit[0]["reason"] == "bad GPU"
    assert all(str(e["actor"]).startswith("operator") for e in audit)


def test_a_weight_version_past_64_bits_is_a_bad_argument_and_changes_nothing(
    state: Path,
) -> None:
    before = state.read_bytes()
    result = llmhealth("readmit", "gpu1", "--weight-version", str(2**63), "--state", str(state))
    assert result.returncode == 3, result.stderr
    assert "--weight-version" in result.stderr
    assert "Traceback" not in result.stderr
    assert state.read_bytes() == before


@pytest.mark.slow
def test_a_hold_is_saved_shown_and_released(state: Path) -> None:
    result = llmhealth(
        "hold", "gpu1", "--for", "30m", "--reason", "weight sync", "--state", str(state)
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().endswith(f"; saved to {state}"), result.stdout
    hold = status(state)["gpu1"]["hold"]
    assert isinstance(hold, dict)
    assert hold["reason"] == "weight sync"
    released = llmhealth("release", "gpu1", "--state", str(state))
    assert released.returncode == 0
    assert released.stdout.strip().endswith(f"; saved to {state}"), released.stdout
    assert status(state)["gpu1"]["hold"] is None
    again = llmhealth("release", "gpu1", "--state", str(state))
    assert again.returncode == 1
    assert "not on hold" in again.stderr
    events = [e["event"] for e in read(state.with_name("audit.jsonl"))]
    assert events == ["hold", "release"]


def test_a_verb_run_through_sudo_names_the_operator_behind_it(state: Path) -> None:
    # sudo sets LOGNAME and USER to the user it runs as and keeps the caller in
    # SUDO_USER: every on-call hold, retire and readmit was written down as root's.
    command = shutil.which("llmhealth", path=str(Path(sys.executable).parent))
    assert command is not None
    as_sudo = {**os.environ, "LOGNAME": "root", "USER": "root", "SUDO_USER": "alice"}
    result = subprocess.run(
        [command, "hold", "gpu1", "--for", "10m", "--reason", "swap", "--state", str(state)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env=as_sudo,
    )
    assert result.returncode == 0, result.stderr
    assert "by operator:alice" in result.stdout
    assert [e["actor"] for e in read(state.with_name("audit.jsonl"))] == ["operator:alice"]


@pytest.mark.slow
def test_a_hold_over_a_running_one_names_what_it_replaced(state: Path) -> None:
    """One hold per backend: a trainer's half hour over an operator's four hours ends
    the longer one, and said nothing of it."""
    where = ["--state", str(state)]
    first = llmhealth("hold", "gpu1", "--for", "4h", "--reason", "disk swap", *where)
    assert first.returncode == 0, first.stderr
    assert "replaces" not in first.stdout
    second = llmhealth("hold", "gpu1", "--for", "30m", "--reason", "weight sync", *where)
    assert second.returncode == 0, second.stderr
    assert "; replaces the hold until " in second.stdout
    assert ": disk swap; saved to" in second.stdout
    hold = status(state)["gpu1"]["hold"]
    assert isinstance(hold, dict) and hold["reason"] == "weight sync"
    records = read(state.with_name("audit.jsonl"))
    assert "replaces" not in records[0]
    assert records[1]["replaces"]["reason"] == "disk swap"
    assert records[1]["replaces"]["until"] == records[0]["until"]


@pytest.mark.parametrize(
    "verb", [("hold", "gpu1", "--for", "30m"), ("retire", "gpu1")], ids=["hold", "retire"]
)
@pytest.mark.parametrize("reason", ["", "   "], ids=["empty", "blank"])
def test_a_verb_without_a_reason_exits_3_saying_so_and_changes_nothing(
    state: Path, verb: tuple[str, ...], reason: str
) -> None:
    before = state.read_bytes()
    result = llmhealth(*verb, "--reason", reason, "--state", str(state))
    assert result.returncode == 3, result.stderr
    assert "--reason" in result.stderr and "Traceback" not in result.stderr
    assert state.read_bytes() == before
    assert not state.with_name("audit.jsonl").exists()


def test_verbs_on_an_unknown_backend_or_missing_state_exit_3(state: Path, tmp_path: Path) -> None:
    result = llmhealth("retire", "gpu9", "--reason", "x", "--state", str(state))
    assert result.returncode == 3
    assert "no backend named 'gpu9'" in result.stderr
    missing = llmhealth("status", "--state", str(tmp_path / "none.json"))
    assert missing.returncode == 3
    assert "run 'llmhealth check'" in missing.stderr


def test_status_only_reads_a_corrupt_or_missing_state(tmp_path: Path) -> None:
    # An operator looking into a problem must not change it: a corrupt record stays where
    # it is for the next writer (or a person) to deal with, and a mistyped path creates
    # no directory and no lock file.
    corrupt = tmp_path / "state.json"
    corrupt.write_text("{garbage")
    looked = llmhealth("status", "--state", str(corrupt), "--format", "nagios")
    assert looked.returncode == 3
    assert "unreadable" in looked.stderr and "left in place" in looked.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["state.json"]
    assert corrupt.read_text() == "{garbage"
    typo = tmp_path / "typo" / "state.json"
    missing = llmhealth("status", "--state", str(typo))
    assert missing.returncode == 3 and "no state at" in missing.stderr
    assert not typo.parent.exists()


def test_a_bad_hold_duration_exits_3(state: Path) -> None:
    result = llmhealth("hold", "gpu1", "--for", "soon", "--reason", "x", "--state", str(state))
    assert result.returncode == 3
    assert "is not a duration" in result.stderr
    assert status(state)["gpu1"]["state"] == State.DEAD


def test_a_hold_longer_than_a_year_exits_3(state: Path) -> None:
    """`--for 1e308` was taken, and printed a 300-digit "until"."""
    result = llmhealth("hold", "gpu1", "--for", "367d", "--reason", "x", "--state", str(state))
    assert result.returncode == 3
    assert "'367d' is longer than 366 days" in result.stderr
    assert status(state)["gpu1"]["hold"] is None


@pytest.mark.slow
def test_a_hold_whose_backend_the_config_dropped_is_shown_and_released_by_name(
    tmp_path: Path,
) -> None:
    ledger = Ledger(LedgerPolicy(), [("gpu0", "http://127.0.0.1:9")], now=T0)
    record = FleetRecord(ledger)
    record.holds["gpu1"] = Hold("moving racks", time.time() + 600, "ops")
    path = tmp_path / "state.json"
    store = StateFile(path)
    with store.locked():
        store.save(record.to_dict())
    shown = llmhealth("status", "--state", str(path), "--format", "json")
    held = json.loads(shown.stdout)["holds_of_unconfigured_names"]
    assert list(held) == ["gpu1"] and held["gpu1"]["reason"] == "moving racks"
    table = llmhealth("status", "--state", str(path))
    assert "gpu1 (not configured): on hold until" in table.stdout
    released = llmhealth("release", "gpu1", "--state", str(path))
    assert released.returncode == 0, released.stderr
    assert "hold released (moving racks)" in released.stdout
    shown = llmhealth("status", "--state", str(path), "--format", "json")
    assert json.loads(shown.stdout)["holds_of_unconfigured_names"] == {}


def test_releasing_an_ended_hold_changes_nothing_and_says_so(tmp_path: Path) -> None:
    """It said "hold released" and audited a change that changed nothing."""
    ledger = Ledger(LedgerPolicy(), [("gpu0", "http://127.0.0.1:9")], now=T0)
    record = FleetRecord(ledger)
    record.holds["gpu0"] = Hold("weight sync", T0, "ops")  # ended long ago
    path = tmp_path / "state.json"
    store = StateFile(path)
    with store.locked():
        store.save(record.to_dict())
    ended = llmhealth("release", "gpu0", "--state", str(path))
    assert ended.returncode == 1
    assert "gpu0: not on hold (its hold by ops has ended)" in ended.stderr
    assert not (tmp_path / "audit.jsonl").exists()


def fleet_config(tmp_path: Path, *names: str) -> Path:
    lines = []
    for port, name in enumerate(names, start=9):
        lines += ["[[backend]]", f'name = "{name}"', f'url = "http://127.0.0.1:{port}"', ""]
    path = tmp_path / "fleet.toml"
    path.write_text("\n".join(lines))
    return path


@pytest.mark.slow
def test_verbs_before_the_first_check_work_on_the_state_the_config_starts(
    tmp_path: Path,
) -> None:
    config, state = fleet_config(tmp_path, "gpu0", "gpu1"), tmp_path / "state.json"
    where = ["--config", str(config), "--state", str(state)]
    held = llmhealth("hold", "gpu0", "--for", "2h", "--reason", "maintenance", *where)
    assert held.returncode == 0, held.stderr
    # A verb that finds no state makes one: the operator sees where, and that a daemon
    # keeping its state elsewhere (another user's default path) will not see the hold.
    assert f"saved to a new state at {state}: no check had saved one there" in held.stdout
    shown = status(state)
    assert {name: b["state"] for name, b in shown.items()} == {
        "gpu0": "healthy",
        "gpu1": "healthy",
    }
    hold = shown["gpu0"]["hold"]
    assert isinstance(hold, dict)
    assert hold["reason"] == "maintenance"
    retired = llmhealth("retire", "gpu1", "--reason", "not racked yet", *where)
    assert retired.returncode == 0, retired.stderr
    assert retired.stdout.strip().endswith(f"(retire); saved to {state}"), retired.stdout
    assert status(state)["gpu1"]["state"] == "retired"
    audit = read(state.with_name("audit.jsonl"))
    assert [(e["backend"], e["event"]) for e in audit] == [("gpu0", "hold"), ("gpu1", "retire")]
    # Made as a first check makes it (epoch 0); only the retirement moved the serving set.
    document = json.loads(state.read_text())
    assert document["ledger"]["epoch"] == 1


def test_a_refused_verb_before_the_first_check_saves_no_state(tmp_path: Path) -> None:
    config, state = fleet_config(tmp_path, "gpu0"), tmp_path / "state.json"
    where = ["--config", str(config), "--state", str(state)]
    refused = llmhealth("readmit", "gpu0", *where)  # HEALTHY: nothing to re-admit
    assert refused.returncode == 1
    assert "only a STALE backend can be re-admitted" in refused.stderr
    assert not state.exists()
    unknown = llmhealth("hold", "gpu7", "--for", "1h", "--reason", "x", *where)
    assert unknown.returncode == 3
    assert "no backend named 'gpu7' in the config" in unknown.stderr
    assert not state.exists()


def test_a_backend_configured_since_the_last_check_can_be_held_before_the_next(
    state: Path, tmp_path: Path
) -> None:
    # The saved fleet has gpu0 (port 9) and gpu1 (port 10); the config now adds gpu2.
    config = fleet_config(tmp_path, "gpu0", "gpu1", "gpu2")
    held = llmhealth(
        "hold",
        "gpu2",
        "--for",
        "1h",
        "--reason",
        "burn-in",
        "--config",
        str(config),
        "--state",
        str(state),
    )
    assert held.returncode == 0, held.stderr
    shown = status(state)
    assert (shown["gpu1"]["state"], shown["gpu2"]["state"]) == ("dead", "healthy")
    assert isinstance(shown["gpu2"]["hold"], dict)


def test_a_readmit_starts_the_backend_afresh_so_requests_failed_before_it_never_count(
    tmp_path: Path,
) -> None:
    """An operator's readmit left the record as it was: failures known before it but
    drained at the next settle condemned the backend again at once, and the streak and
    proof of the old condemnation stayed."""
    now = time.time()
    record = FleetRecord(Ledger(LedgerPolicy(), [("gpu0", "http://127.0.0.1:9")], now=now - 60))
    failed = [
        RequestOutcome(now - 50 + i, "POST", "/v1/completions", FailureKind.SERVER_ERROR, 500)
        for i in range(3)
    ]
    record.observe_requests("gpu0", failed)
    assert record.ledger.state_of("gpu0") is State.DEAD and "gpu0" in record.proofs
    record.ledger.apply("gpu0", NewProcessUp(now=now - 40))  # STALE, its proof to come
    path = tmp_path / "state.json"
    store = StateFile(path)
    with store.locked():
        store.save(record.to_dict())
    assert llmhealth("readmit", "gpu0", "--state", str(path)).returncode == 0
    with store.locked():
        readmitted = store.load(lambda document: FleetRecord.from_dict(document, LedgerPolicy()))
    assert readmitted is not None
    assert "gpu0" not in readmitted.proofs and "gpu0" not in readmitted.request_streaks
    late = [replace(outcome, at=now - 30 + i) for i, outcome in enumerate(failed)]
    readmitted.observe_requests("gpu0", late)  # failed before the readmit, drained after
    assert readmitted.ledger.state_of("gpu0") is State.HEALTHY


def test_status_counts_in_place_recoveries_within_the_window(tmp_path: Path) -> None:
    """A backend at the cap stays DEAD for an operator; status says how often it came back."""
    now = time.time()
    ledger = Ledger(LedgerPolicy(recover_in_place=True), [("gpu0", "http://127.0.0.1:9")], now=now)
    process = ProcessSeen(start=now - 3600, counters={"engine 0 finished": 10.0})
    ledger.apply("gpu0", GoodVerdict(now=now - 900, request_ok=True, process=process))
    for recovery in range(3):
        at = now - 800 + 100 * recovery
        ledger.apply("gpu0", WedgeProven(now=at, process=process))
        while ledger.state_of("gpu0") is State.DEAD:
            ledger.apply("gpu0", GoodVerdict(now=at + 1, request_ok=True, process=process))
        ledger.apply("gpu0", Readmitted(now=at + 2))
    ledger.apply("gpu0", WedgeProven(now=now - 60, process=process))
    path = tmp_path / "state.json"
    store = StateFile(path)
    with store.locked():
        store.save(FleetRecord(ledger).to_dict())
    gpu0 = status(path)["gpu0"]
    assert (gpu0["state"], gpu0["in_place_recoveries"]) == ("dead", 3)
    command = shutil.which("llmhealth", path=str(Path(sys.executable).parent))
    assert command is not None
    table = subprocess.run(
        [command, "status", "--state", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env={**os.environ, "COLUMNS": "200"},  # one line per row: the header whole
    )
    header = next(line for line in table.stdout.splitlines() if "back in place" in line)
    row = next(line for line in table.stdout.splitlines() if "gpu0" in line)
    cells = dict(zip(header.strip("┃").split("┃"), row.strip("│").split("│"), strict=True))
    assert {name.strip(): value.strip() for name, value in cells.items()}["back in place"] == "3"


def test_a_verb_that_adds_a_retired_backend_back_from_the_config_keeps_it_retired(
    tmp_path: Path,
) -> None:
    """A check with a smaller config forgot retired gpu1; a hold named from the full
    config before the next check added it back HEALTHY and serving, unaudited."""
    path = tmp_path / "state.json"
    ledger = Ledger(LedgerPolicy(), [("gpu0", "http://127.0.0.1:9")], now=T0)
    record = FleetRecord(ledger, retired_forgotten={"gpu1": T0})
    store = StateFile(path)
    with store.locked():
        store.save(record.to_dict())
    config = tmp_path / "fleet.toml"
    config.write_text(
        '[[backend]]\nname = "gpu0"\nurl = "http://127.0.0.1:9"\n'
        '[[backend]]\nname = "gpu1"\nurl = "http://127.0.0.1:10"\n'
    )
    held = llmhealth(
        "hold",
        "gpu1",
        "--for",
        "1h",
        "--reason",
        "sync",
        "--state",
        str(path),
        "--config",
        str(config),
    )
    assert held.returncode == 0, held.stderr
    assert status(path)["gpu1"]["state"] == "retired"
    assert json.loads(path.read_text())["retired_forgotten"] == {}
    events = [(r["event"], r.get("to")) for r in read(path.with_name("audit.jsonl"))]
    assert events == [("added", "retired"), ("hold", None)]


# Runs a command with RLIMIT_FSIZE: a write past the limit fails with EFBIG from the
# kernel, as on a full disk, and does so as root too (a read-only directory does not).
_FULL_DISK = """
import os, resource, signal, sys
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG instead of being killed
limit = int(sys.argv[1])
resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
os.execv(sys.argv[2], sys.argv[2:])
"""

_SET_UP = {
    "retire": [],
    "hold": [],
    "release": [("hold", "gpu1", "--for", "30m", "--reason", "weight sync")],
    "reset": [("retire", "gpu1", "--reason", "bad GPU")],
    "readmit": [("retire", "gpu1", "--reason", "bad GPU"), ("reset", "gpu1")],
}
_VERB = {
    "retire": ("retire", "gpu1", "--reason", "bad GPU"),
    "hold": ("hold", "gpu1", "--for", "30m", "--reason", "weight sync"),
    "release": ("release", "gpu1"),
    "reset": ("reset", "gpu1"),
    "readmit": ("readmit", "gpu1"),
}


@pytest.mark.slow
@pytest.mark.parametrize("verb", list(_VERB))
def test_a_verb_whose_state_cannot_be_saved_leaves_no_audit_record(
    tmp_path: Path, verb: str
) -> None:
    # Ten backends: the state is several times an audit line, so a limit can let the
    # verb's audit line through and stop its state.
    names = [(f"gpu{i}", f"http://127.0.0.1:{9 + i}") for i in range(10)]
    ledger = Ledger(LedgerPolicy(), names, now=T0)
    ledger.apply("gpu1", WedgeProven(now=T0, evidence="steps 8660→8660→8660"))
    state, audit = tmp_path / "state.json", tmp_path / "audit.jsonl"
    store = StateFile(state)
    with store.locked():
        store.save(FleetRecord(ledger).to_dict())
    for step in _SET_UP[verb]:
        done = llmhealth(*step, "--state", str(state))
        assert done.returncode == 0, done.stderr
    saved, trail = state.read_bytes(), read(audit)
    limit = (audit.stat().st_size if audit.exists() else 0) + 1024
    assert len(saved) > limit + 1024  # the new state cannot fit, whatever the verb adds

    command = shutil.which("llmhealth", path=str(Path(sys.executable).parent))
    assert command is not None
    argv = [command, *_VERB[verb], "--state", str(state)]
    failed = subprocess.run(
        [sys.executable, "-c", _FULL_DISK, str(limit), *argv],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert failed.returncode == 3, failed.stderr
    assert f"cannot write state {state}" in failed.stderr
    # Nothing was applied, and the trail does not say it was.
    assert state.read_bytes() == saved
    assert read(audit) == trail
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        ["state.json", "state.json.lock", *(["audit.jsonl"] if trail else [])]
    )


def test_a_verb_finds_a_name_typed_in_another_unicode_form(tmp_path: Path) -> None:
    # A config written with "café" decomposed (e + U+0301, as some tools save text), an
    # operator's terminal typing it composed: "no backend named 'café' (known: café)".
    from llmhealth import operate  # noqa: PLC0415
    from llmhealth.actions import AuditLog  # noqa: PLC0415
    from llmhealth.config import Config  # noqa: PLC0415

    decomposed, composed = "cafe\u0301", "caf\u00e9"
    ledger = Ledger(LedgerPolicy(), [(decomposed, "http://127.0.0.1:9")], now=T0)
    path = tmp_path / "state.json"
    store = StateFile(path)
    with store.locked():
        store.save(FleetRecord(ledger).to_dict())
    audit = AuditLog(tmp_path / "audit.jsonl")
    held = operate.hold(store, audit, Config(), composed, 3600.0, "weight sync")
    assert held.applied, held.message
    retired = operate.retire(store, audit, Config(), composed, "bad GPU")
    assert retired.applied, retired.message
    saved = json.loads(path.read_text())
    assert list(saved["holds"]) == [decomposed]
    assert [b["name"] for b in saved["ledger"]["backends"]] == [decomposed]
    assert saved["ledger"]["backends"][0]["state"] == "retired"
    assert [r["backend"] for r in read(tmp_path / "audit.jsonl")] == [decomposed, decomposed]


@pytest.mark.slow
def test_a_state_with_keys_a_later_build_added_keeps_its_ledger_on_a_rollback(
    state: Path,
) -> None:
    # Every key added so far came within schema 1 (`state_before_partial`, `process`, ...
    # `restart_stamped_at`). Refused as unknown, the state a later build wrote was set
    # aside as corrupt when an upgrade was rolled back: the next run started a fresh
    # ledger, the retired GPU serving again and the weight-sync hold gone.
    assert llmhealth("retire", "gpu1", "--reason", "bad GPU", "--state", str(state)).returncode == 0
    held = llmhealth("hold", "gpu0", "--for", "30m", "--reason", "sync", "--state", str(state))
    assert held.returncode == 0, held.stderr
    document = json.loads(state.read_text())
    document["a_table_added_later"] = {}
    document["ledger"]["added_later"] = 1
    for entry in document["ledger"]["backends"]:
        entry["added_later"] = True
    document["holds"]["gpu0"]["added_later"] = "x"
    document["restarts"] = {"gpu1": {"failures": 0, "last_attempt_at": None, "added_later": 2}}
    state.write_text(json.dumps(document))
    saved = status(state)
    assert saved["gpu1"]["state"] == "retired"
    assert saved["gpu0"]["hold"] == {"reason": "sync", "until": ANY, "by": ANY}
    released = llmhealth("release", "gpu0", "--state", str(state))
    assert released.returncode == 0, released.stderr
    assert status(state)["gpu1"]["state"] == "retired"
    assert sorted(p.name for p in state.parent.iterdir() if "corrupt" in p.name) == []


def test_a_backend_the_config_renamed_since_the_last_check_is_found_by_its_new_name(
    state: Path, tmp_path: Path
) -> None:
    # The saved fleet has gpu0 (port 9) and gpu1 (port 10, DEAD); the config now calls the
    # server at port 10 "gpu1b". A check renames it, keeping its record; a verb under the
    # new name exited 3 ("backends 'gpu1' and 'gpu1b' share the URL") until one had run.
    config = tmp_path / "fleet.toml"
    config.write_text(
        '[[backend]]\nname = "gpu0"\nurl = "http://127.0.0.1:9"\n\n'
        '[[backend]]\nname = "gpu1b"\nurl = "http://127.0.0.1:10"\n'
    )
    retired = llmhealth(
        "retire", "gpu1b", "--reason", "bad GPU", "--config", str(config), "--state", str(state)
    )
    assert retired.returncode == 0, retired.stderr
    shown = status(state)
    assert sorted(shown) == ["gpu0", "gpu1b"]
    assert shown["gpu1b"]["state"] == "retired"
    audit = read(state.with_name("audit.jsonl"))
    assert [(e["backend"], e["event"]) for e in audit] == [
        ("gpu1b", "renamed"),
        ("gpu1b", "retire"),
    ]
    assert audit[1]["from"] == "dead"  # its record kept: not re-added HEALTHY


def test_a_verb_under_a_name_a_condemned_server_kept_aside_had_keeps_that_server_condemned(
    tmp_path: Path,
) -> None:
    """gpu1 (DEAD at port 10) was dropped from the config and kept aside; the config now
    calls port 9 (gpu0's) "gpu1" and port 10 "gpu2". A check renames gpu1's record onto
    gpu2 and gpu0's onto gpu1; a verb on gpu1 before it renamed gpu0's record alone and
    dropped gpu1's kept one: the next check took the wedged port 10 in HEALTHY as gpu2."""
    path = tmp_path / "state.json"
    ledger = Ledger(
        LedgerPolicy(), [("gpu0", "http://127.0.0.1:9"), ("gpu1", "http://127.0.0.1:10")], now=T0
    )
    ledger.apply("gpu1", WedgeProven(now=T0, evidence="steps 8660→8660→8660"))
    record = FleetRecord(ledger)
    record.reconcile({"gpu0": "http://127.0.0.1:9"}, T0 + 1)  # gpu1 kept aside, DEAD
    assert "gpu1" in record.withheld_forgotten
    store = StateFile(path)
    with store.locked():
        store.save(record.to_dict())
    config = tmp_path / "fleet.toml"
    config.write_text(
        '[[backend]]\nname = "gpu1"\nurl = "http://127.0.0.1:9"\n\n'
        '[[backend]]\nname = "gpu2"\nurl = "http://127.0.0.1:10"\n'
    )
    held = llmhealth(
        "hold", "gpu1", "--for", "1h", "--reason", "sync", "--config", str(config),
        "--state", str(path),
    )  # fmt: skip
    assert held.returncode == 0, held.stderr
    loaded = load_saved(path)
    loaded.reconcile({"gpu1": "http://127.0.0.1:9", "gpu2": "http://127.0.0.1:10"}, T0 + 3)
    assert loaded.ledger.state_of("gpu1") is State.HEALTHY  # gpu0's server
    assert loaded.ledger.state_of("gpu2") is State.DEAD  # the wedged server stays so
    assert loaded.ledger.serving == ("gpu1",)


def test_a_verb_under_a_name_the_config_gave_another_server_acts_on_that_server(
    state: Path, tmp_path: Path
) -> None:
    """The saved fleet has gpu1 DEAD at port 10; the config now calls port 10 "gpu1b" and
    gives "gpu1" to port 11. A check renames the DEAD record to gpu1b and adds gpu1 at
    port 11; a verb on gpu1 before it acted on the saved record at port 10: the hold (or
    retirement) the operator gave gpu1 followed that record to gpu1b, and gpu1 at port 11
    came in HEALTHY with neither."""
    config = tmp_path / "fleet.toml"
    config.write_text(
        '[[backend]]\nname = "gpu0"\nurl = "http://127.0.0.1:9"\n\n'
        '[[backend]]\nname = "gpu1b"\nurl = "http://127.0.0.1:10"\n\n'
        '[[backend]]\nname = "gpu1"\nurl = "http://127.0.0.1:11"\n'
    )
    for verb in (
        ["hold", "gpu1", "--for", "1h", "--reason", "sync"],
        ["retire", "gpu1", "--reason", "bad GPU"],
    ):
        done = llmhealth(*verb, "--config", str(config), "--state", str(state))
        assert done.returncode == 0, done.stderr
    loaded = load_saved(state)
    loaded.reconcile(
        {
            "gpu0": "http://127.0.0.1:9",
            "gpu1b": "http://127.0.0.1:10",
            "gpu1": "http://127.0.0.1:11",
        },
        T0 + 3,
    )
    assert loaded.ledger.url_of("gpu1") == "http://127.0.0.1:11"
    assert loaded.ledger.state_of("gpu1") is State.RETIRED
    assert "gpu1" in loaded.holds and "gpu1b" not in loaded.holds
    assert loaded.ledger.state_of("gpu1b") is State.DEAD  # the wedged port 10 stays so


def test_a_verb_under_a_renamed_name_whose_server_the_config_moves_another_off_works(
    tmp_path: Path,
) -> None:
    """The saved fleet has gpu1 DEAD at port 10 and gpu0 at port 11; the config now calls
    port 10 "gpu1b", gives "gpu1" port 11 and moves gpu0 to port 12. A check renames,
    moves gpu0 off port 11 and adds gpu1 there; the verb renamed and added before that
    move, and every verb on gpu1 failed: "backends 'gpu0' and 'gpu1' share the URL"."""
    fleet = [("gpu0", "http://127.0.0.1:11"), ("gpu1", "http://127.0.0.1:10")]
    state = saved_fleet(tmp_path / "state.json", fleet, "gpu1")
    config = tmp_path / "fleet.toml"
    config.write_text(
        '[[backend]]\nname = "gpu0"\nurl = "http://127.0.0.1:12"\n\n'
        '[[backend]]\nname = "gpu1b"\nurl = "http://127.0.0.1:10"\n\n'
        '[[backend]]\nname = "gpu1"\nurl = "http://127.0.0.1:11"\n'
    )
    done = llmhealth(
        "hold",
        "gpu1",
        "--for",
        "1h",
        "--reason",
        "sync",
        "--config",
        str(config),
        "--state",
        str(state),
    )
    assert done.returncode == 0, done.stderr
    loaded = load_saved(state)
    assert loaded.ledger.url_of("gpu1") == "http://127.0.0.1:11"
    assert loaded.ledger.url_of("gpu0") == "http://127.0.0.1:12"
    assert loaded.ledger.state_of("gpu1b") is State.DEAD
    assert list(loaded.holds) == ["gpu1"]
    events = [(line["backend"], line["event"]) for line in read(tmp_path / "audit.jsonl")]
    assert ("gpu1b", "renamed") in events and ("gpu0", "readdressed") in events
    # Each change is audited once: the next check finds nothing left to change.
    assert (
        loaded.reconcile(
            {
                "gpu0": "http://127.0.0.1:12",
                "gpu1b": "http://127.0.0.1:10",
                "gpu1": "http://127.0.0.1:11",
            },
            time.time(),
        )
        == []
    )


def test_a_name_typed_as_saved_is_the_configs_when_the_config_spells_it_another_way(
    tmp_path: Path,
) -> None:
    """Saved: "café" decomposed, DEAD at port 10. The config, saved by another tool,
    spells it composed at port 11 and calls port 10 "cafe2". Typed as the state spells it,
    the verb held the saved record, which the next check renamed to cafe2: the hold on
    port 10, the café the config names coming in without it. Typed composed, it did not."""
    decomposed, composed = "cafe\u0301", "caf\u00e9"
    state = saved_fleet(tmp_path / "state.json", [(decomposed, "http://127.0.0.1:10")], decomposed)
    config = tmp_path / "fleet.toml"
    config.write_text(
        f'[[backend]]\nname = "{composed}"\nurl = "http://127.0.0.1:11"\n\n'
        '[[backend]]\nname = "cafe2"\nurl = "http://127.0.0.1:10"\n',
        encoding="utf-8",
    )
    done = llmhealth(
        "hold", decomposed, "--for", "1h", "--reason", "sync", "--config", str(config),
        "--state", str(state),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    loaded = load_saved(state)
    loaded.reconcile({composed: "http://127.0.0.1:11", "cafe2": "http://127.0.0.1:10"}, T0 + 3)
    assert list(loaded.holds) == [composed]
    assert loaded.ledger.state_of("cafe2") is State.DEAD


def test_a_verb_whose_new_audit_logs_directory_will_not_sync_keeps_neither_record(
    state: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first record of a new log, written and synced, stayed in it when the sync of
    its directory failed (a failing disk) and the verb, refused, saved nothing: the trail
    said gpu0 was held, the state that it was not, and the hold tried again was in it
    twice. README: a record "that would not sync, is cut back out of the log"."""
    from llmhealth import operate  # noqa: PLC0415
    from llmhealth.actions import AuditError, AuditLog  # noqa: PLC0415
    from llmhealth.config import Config  # noqa: PLC0415

    before = state.read_bytes()
    directory_syncs(monkeypatch, fail=True)
    log = state.with_name("audit.jsonl")
    with pytest.raises(AuditError, match="directory"):
        operate.hold(StateFile(state), AuditLog(log), Config(), "gpu0", 3600.0, "weight sync")
    assert state.read_bytes() == before
    assert read(log) == []


def test_a_refused_verb_audits_the_ledgers_reason_and_an_applied_hold_what_it_replaced(
    state: Path,
) -> None:
    """In process, on a clock: a refusal with no reason of the operator's carries the
    ledger's; a hold over one that has ended replaces nothing, and says nothing of it."""
    audit = AuditLog(state.with_name("audit.jsonl"))
    store = StateFile(state)
    refused = operate.readmit(store, audit, Config(), "gpu1", None)
    assert not refused.applied
    first = operate.hold(store, audit, Config(), "gpu0", 60.0, "sync", clock=lambda: T0)
    second = operate.hold(store, audit, Config(), "gpu0", 60.0, "swap", clock=lambda: T0 + 120)
    assert first.applied and second.applied
    assert "replaces" not in second.message
    records = read(state.with_name("audit.jsonl"))
    assert "only a STALE backend can be re-admitted" in records[0]["reason"]
    assert [("replaces" in r, r["reason"]) for r in records[1:]] == [
        (False, "sync"),
        (False, "swap"),
    ]


def test_a_config_files_floor_outranks_the_floor_the_record_was_saved_with(
    tmp_path: Path,
) -> None:
    """The saved floor stands in only without a config file (``status`` with --state
    alone); a config file's min_healthy is the floor its daemon judges by."""
    ledger = Ledger(LedgerPolicy(min_healthy=3), [("gpu0", "http://127.0.0.1:9")], now=T0)
    path = tmp_path / "state.json"
    store = StateFile(path)
    with store.locked():
        store.save(FleetRecord(ledger).to_dict())
    config = tmp_path / "fleet.toml"
    config.write_text(
        '[policy]\nmin_healthy = 2\n\n[[backend]]\nname = "gpu0"\nurl = "http://127.0.0.1:9"\n'
    )
    assert operate.read_record(store, load_config(config)).ledger.policy.min_healthy == 2
    assert operate.read_record(store, Config()).ledger.policy.min_healthy == 3
    # A verb without a config file saves the floor as it found it, not the default (1).
    audit = AuditLog(tmp_path / "audit.jsonl")
    assert operate.hold(store, audit, Config(), "gpu0", 60.0, "sync").applied
    assert operate.read_record(store, Config()).ledger.policy.min_healthy == 3


def test_only_release_acts_on_a_name_the_config_dropped_that_keeps_its_hold(
    tmp_path: Path,
) -> None:
    """The kept hold lets ``release`` end it; a hold or retirement under that name has
    no backend to act on and is refused, saving nothing."""
    record = FleetRecord(Ledger(LedgerPolicy(), [("gpu0", "http://127.0.0.1:9")], now=T0))
    record.holds["gone"] = Hold("weight sync", time.time() + 3600, "ops")
    path = tmp_path / "state.json"
    store = StateFile(path)
    with store.locked():
        store.save(record.to_dict())
    audit = AuditLog(tmp_path / "audit.jsonl")
    before = path.read_bytes()
    with pytest.raises(StateError, match="no backend named 'gone'"):
        operate.hold(store, audit, Config(), "gone", 60.0, "again")
    assert path.read_bytes() == before
    assert operate.release(store, audit, Config(), "gone").applied
    assert [(r["event"], r["reason"]) for r in read(tmp_path / "audit.jsonl")] == [
        ("release", "released hold: weight sync")
    ]


@pytest.mark.slow
@pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("unshare") is None,
    reason="root and util-linux unshare (a mount namespace of its own)",
)
@pytest.mark.parametrize(
    "run", [("hold", "gpu0", "--for", "30m", "--reason", "weight sync"), ("check",)]
)
def test_a_run_whose_state_cannot_be_renamed_over_leaves_no_audit_record(
    state: Path, run: tuple[str, ...]
) -> None:
    """A state file that is a mount of its own (a container's single-file volume, `docker
    run -v state.json:...`) is written aside, then refused its rename (EBUSY) after the
    run's audit records were made durable: kept, the trail said a verb was applied, or a
    settle's moves made, that never were, once more at every try (every wait, in
    `watch`)."""
    config = state.with_name("fleet.toml")
    config.write_text(
        f'state = "{state}"\n'
        '[[backend]]\nname = "gpu0"\nurl = "http://127.0.0.1:9"\n'
        '[[backend]]\nname = "gpu1"\nurl = "http://127.0.0.1:10"\n'
    )
    audit = state.with_name("audit.jsonl")
    done = llmhealth("retire", "gpu1", "--reason", "bad GPU", "--config", str(config))
    assert done.returncode == 0, done.stderr
    saved, trail = state.read_bytes(), audit.read_bytes()
    command = shutil.which("llmhealth", path=str(Path(sys.executable).parent))
    assert command is not None
    failed = subprocess.run(
        [
            "unshare",
            "-m",
            "sh",
            "-c",
            'mount --bind "$0" "$0" || exit 77; for try in 1 2; do "$@"; done',
            str(state),
            command,
            *run,
            "--config",
            str(config),
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    if failed.returncode == 77 or "unshare:" in failed.stderr:
        pytest.skip(f"no mount namespace here: {failed.stderr.strip()[:200]}")
    assert failed.returncode == 3, failed.stderr
    assert f"cannot write state {state}" in failed.stderr
    assert "Device or resource busy" in failed.stderr
    # Nothing was applied, and the trail does not say it was.
    assert state.read_bytes() == saved
    assert audit.read_bytes() == trail
