"""Restart commands and the audit log, with real processes and a real disk."""

from __future__ import annotations

import errno
import json
import math
import os
import re
import signal
import stat
import subprocess
import sys
import time
import tracemalloc
from collections import deque
from collections.abc import Iterator, Mapping
from enum import IntEnum
from pathlib import Path
from types import MappingProxyType
from typing import Any

import pytest
from diskfaults import directory_syncs
from hypothesis import given
from hypothesis import strategies as st

from llmhealth import actions
from llmhealth.actions import (
    AuditError,
    AuditLog,
    CommandResult,
    encode_record,
    how_it_ended,
    parse_records,
    read,
    restart_environment,
    run_command,
    scan,
)

PY = sys.executable


def python(code: str) -> list[str]:
    return [PY, "-c", code]


def live_members(pgid: int) -> list[int]:
    """PIDs in process group ``pgid`` that are not zombies (a zombie holds no resources,
    and whether one lingers depends on the container's init, not on us)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue  # it exited while we looked
        # The command name is in parentheses and may hold spaces; fields follow the last ')'.
        fields = stat[stat.rindex(")") + 2 :].split()
        state, group = fields[0], int(fields[2])
        if group == pgid and state not in ("Z", "X"):
            found.append(int(entry.name))
    return found


def wait_until_gone(pgid: int, bound: float = 10.0) -> list[int]:
    # Killed children are reparented and reaped asynchronously; this bounds the wait for
    # that bookkeeping and says nothing about speed.
    deadline = time.monotonic() + bound
    while (members := live_members(pgid)) and time.monotonic() < deadline:
        time.sleep(0.05)
    return members


needs_proc = pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs /proc")


# --- run_command ------------------------------------------------------------------------


def test_a_command_that_succeeds_reports_both_streams() -> None:
    result = run_command(["sh", "-c", "echo restarted; echo 'a warning' >&2"], timeout=30)
    assert result.ok
    assert (result.exit_code, result.timed_out) == (0, False)
    assert (result.stdout, result.stderr) == ("restarted\n", "a warning\n")
    assert result.argv == ("sh", "-c", "echo restarted; echo 'a warning' >&2")
    # Recorded, and sane; how long the command took is no claim of this test.
    assert math.isfinite(result.duration) and result.duration >= 0


def test_a_non_zero_exit_is_recorded_and_not_ok() -> None:
    result = run_command(["sh", "-c", "echo 'Job for vllm@0.service failed' >&2; exit 3"], 30)
    assert not result.ok
    assert (result.exit_code, result.timed_out) == (3, False)
    assert result.stderr == "Job for vllm@0.service failed\n"


def test_a_command_a_signal_ended_is_told_by_the_signal_not_a_negative_exit() -> None:
    """``subprocess``'s -15 is no exit status: "exited -15" in the daemon's log for its
    serving hook, and in a failed restart's last error."""
    result = run_command(["sh", "-c", "kill -TERM $$"], 30)
    assert result.exit_code == -signal.SIGTERM
    assert how_it_ended(result) == "was killed by SIGTERM"
    assert how_it_ended(run_command(["sh", "-c", "exit 3"], 30)) == "exited 3"


@pytest.mark.slow
@needs_proc
def test_a_command_past_its_timeout_is_killed_with_its_children(tmp_path: Path) -> None:
    # The command marks the moment it has run well past its 1 s timeout (5 s); killed at
    # the timeout, it never gets there. Allowed to run on, it would leave the mark.
    late = tmp_path / "ran-past-its-timeout"
    script = 'sleep 60 & echo "$$ $!"; sleep 5; echo late > "$1"; sleep 60'
    result = run_command(["sh", "-c", script, "sh", str(late)], timeout=1.0)
    pgid, child = map(int, result.stdout.split())
    assert result.timed_out and not result.ok
    assert result.exit_code is not None and result.exit_code < 0  # ended by a signal
    assert not late.exists(), "the command ran on past its timeout"
    assert f"timed out: sent SIGTERM to process group {pgid}" in result.stderr
    assert wait_until_gone(pgid) == []
    assert child not in live_members(pgid)


@pytest.mark.slow
@needs_proc
def test_a_group_that_ignores_sigterm_gets_sigkill_after_the_grace() -> None:
    # An ignored signal stays ignored in children, so the whole group shrugs off SIGTERM.
    script = 'trap "" TERM; sleep 60 & echo "$$"; sleep 60'
    result = run_command(["sh", "-c", script], timeout=1.0, kill_grace=0.5)
    pgid = int(result.stdout)
    assert result.timed_out
    assert result.exit_code == -9
    assert "still running 0.5s after SIGTERM: sent SIGKILL" in result.stderr
    assert wait_until_gone(pgid) == []


@pytest.mark.slow
@needs_proc
def test_a_command_that_closes_its_output_is_still_bounded_by_the_timeout() -> None:
    result = run_command(["sh", "-c", "exec >&- 2>&-; sleep 60"], timeout=1.0)
    assert result.timed_out and result.exit_code is not None and result.exit_code < 0


def test_what_a_successful_command_leaves_running_is_not_killed() -> None:
    # A restart script may start the server in the background; killing its group on a
    # clean exit would kill the server it just started.
    result = run_command(["sh", "-c", 'sleep 30 & echo "$!"'], timeout=30)
    child = int(result.stdout)
    try:
        assert result.ok
        assert "output still held open by a process the command started" in result.stderr
        os.kill(child, 0)  # still there
    finally:
        os.kill(child, signal.SIGKILL)


def test_the_command_runs_in_its_own_session_with_no_stdin() -> None:
    code = "import os, sys; print(os.getsid(0) == os.getpid(), repr(sys.stdin.read()))"
    result = run_command(python(code), timeout=30)
    assert result.stdout == "True ''\n"


def test_long_output_keeps_its_first_and_last_bytes_within_the_limit() -> None:
    code = "import sys; sys.stdout.write('a' * 3000 + 'b' * 3000); sys.stderr.write('e' * 10)"
    result = run_command(python(code), timeout=30, output_limit=4096)
    assert result.ok
    assert result.stdout == "a" * 2048 + "\n[... 1904 bytes omitted ...]\n" + "b" * 2048
    assert result.stderr == "e" * 10


def test_megabytes_on_both_streams_neither_deadlock_nor_pile_up() -> None:
    # Far past a pipe buffer on both streams at once: reading one stream at a time would
    # leave the command blocked writing the other.
    code = (
        "import sys\n"
        "for i in range(64):\n"
        "    sys.stdout.write('o' * 32768); sys.stderr.write('e' * 32768)\n"
        "sys.stdout.write('END'); sys.stderr.write('END')\n"
    )
    result = run_command(python(code), timeout=60, output_limit=1000)
    assert result.ok
    for text, letter in ((result.stdout, "o"), (result.stderr, "e")):
        assert text.startswith(letter * 500) and text.endswith(letter * 497 + "END")
        assert f"[... {64 * 32768 + 3 - 1000} bytes omitted ...]" in text
        assert len(text) < 1100


def test_output_that_is_not_utf8_is_replaced_not_fatal() -> None:
    result = run_command(["printf", "ok \\377\\n"], timeout=30)
    assert result.ok
    assert result.stdout == "ok \ufffd\n"


def test_shell_metacharacters_in_argv_are_passed_literally(tmp_path: Path) -> None:
    marker = tmp_path / "x"
    text = f"$(touch {marker}); rm -rf {tmp_path} `touch {marker}` | > {marker} &&"
    result = run_command(["printf", "%s", text], timeout=30)
    assert result.ok
    assert result.stdout == text
    assert not marker.exists()
    assert tmp_path.is_dir()


def test_a_missing_executable_is_a_result_not_an_exception() -> None:
    result = run_command(["/nonexistent/bin/systemctl", "restart", "vllm@0"], timeout=30)
    assert not result.ok
    assert (result.exit_code, result.timed_out, result.stdout) == (None, False, "")
    assert "/nonexistent/bin/systemctl" in result.stderr
    assert "No such file or directory" in result.stderr
    assert how_it_ended(result) == "did not run"  # not "exited None"
    assert not result.own_shortage  # the command's own failing, not this process's want


@pytest.mark.parametrize("code", [errno.EMFILE, errno.EAGAIN, errno.ENOMEM])
def test_a_command_this_process_could_not_start_for_its_own_want_is_its_own_shortage(
    monkeypatch: pytest.MonkeyPatch, code: int
) -> None:
    """No descriptor for the pipes, or no process or memory to fork (a pids limit, as a
    thread not started is in `watch`): llmhealth's want, not a restart that failed."""

    def refused(*_args: object, **_kwargs: object) -> None:
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(subprocess, "Popen", refused)
    result = run_command(["true"], timeout=30)
    assert result.exit_code is None and result.own_shortage, result
    assert os.strerror(code) in result.stderr


def test_a_file_without_execute_permission_is_a_result_not_an_exception(tmp_path: Path) -> None:
    script = tmp_path / "restart.sh"
    script.write_text("#!/bin/sh\necho hi\n")
    script.chmod(0o644)  # even root cannot exec a file with no execute bit at all
    result = run_command([str(script)], timeout=30)
    assert result.exit_code is None
    assert "Permission denied" in result.stderr


def test_a_nul_byte_in_an_argument_is_a_result_not_an_exception() -> None:
    result = run_command(["echo", "a\0b"], timeout=30)
    assert result.exit_code is None
    assert "argument 1 contains a NUL byte" in result.stderr


def test_an_environment_no_process_can_be_given_is_a_result_not_an_exception() -> None:
    # A config URL whose path held "\\u0000" reached LLMHEALTH_URL: Popen raised
    # ValueError, `check` died with a traceback and its backend was left RESTARTING.
    result = run_command(["true"], timeout=30, env={"LLMHEALTH_URL": "http://h:8000/a\0b"})
    assert result.exit_code is None and not result.ok
    assert "its environment cannot be passed" in result.stderr


def test_a_string_is_refused_as_argv_since_no_shell_will_split_it() -> None:
    with pytest.raises(TypeError, match="not a string"):
        run_command("systemctl restart vllm@0", timeout=30)
    with pytest.raises(TypeError, match="non-empty list"):
        run_command([], timeout=30)
    with pytest.raises(ValueError, match="timeout"):
        run_command(["true"], timeout=0)


def test_a_result_reads_as_a_plain_record() -> None:
    result = CommandResult(("true",), 0, False, 0.5, "", "")
    assert json.loads(json.dumps(result.to_dict())) == {
        "argv": ["true"],
        "exit_code": 0,
        "timed_out": False,
        "duration": 0.5,
        "stdout": "",
        "stderr": "",
    }


# --- the audit log ----------------------------------------------------------------------


def test_records_are_json_lines_stamped_with_a_time(tmp_path: Path) -> None:
    path = tmp_path / "deep" / "er" / "audit.jsonl"  # directories are created
    log = AuditLog(path)
    before = time.time()
    log.append({"actor": "llmhealth", "backend": "gpu0", "event": "restart", "from": "dead"})
    log.append({"time": 1234.5, "actor": "operator:alice", "event": "hold"})
    lines = path.read_text(encoding="ascii").splitlines()
    assert len(lines) == 2
    first, second = (json.loads(line) for line in lines)
    assert list(first) == ["time", "actor", "backend", "event", "from"]
    assert before <= first["time"] <= time.time()
    assert second == {"time": 1234.5, "actor": "operator:alice", "event": "hold"}


def test_a_second_writer_appends_and_never_overwrites(tmp_path: Path) -> None:
    path = tmp_path / "audit.jsonl"
    AuditLog(path).append({"event": "restart", "n": 1})
    AuditLog(path).append({"event": "restart", "n": 2})
    AuditLog(str(path)).append({"event": "restart", "n": 3})
    assert [r["n"] for r in read(path)] == [1, 2, 3]


def test_a_restart_record_carries_the_command_result(tmp_path: Path) -> None:
    log = AuditLog(tmp_path / "audit.jsonl")
    result = run_command(["sh", "-c", "echo done"], timeout=30)
    log.append({"event": "restart", "backend": "gpu0", "command": result})
    (record,) = read(log.path)
    assert record["command"] == json.loads(json.dumps(result.to_dict()))


def test_values_json_cannot_hold_are_written_as_text(tmp_path: Path) -> None:
    log = AuditLog(tmp_path / "audit.jsonl")
    log.append(
        {
            "evidence": {"kv": float("nan"), "steps": (1, 2), 3: "key", "path": tmp_path},
            "reason": "caf\u00e9 \udcff",
        }
    )
    (record,) = read(log.path)
    assert record["evidence"] == {"kv": "nan", "steps": [1, 2], "3": "key", "path": str(tmp_path)}
    assert record["reason"] == "caf\u00e9 \udcff"


def test_a_record_with_a_bad_time_is_refused_loudly(tmp_path: Path) -> None:
    log = AuditLog(tmp_path / "audit.jsonl")
    with pytest.raises(AuditError, match="time"):
        log.append({"time": "yesterday", "event": "restart"})
    for stamp in (math.nan, math.inf):  # no moment, and not JSON: AuditError as any other
        with pytest.raises(AuditError, match="time"):
            log.append({"time": stamp, "event": "restart"})
    assert read(log.path) == []


def test_a_log_that_cannot_be_written_raises_audit_error(tmp_path: Path) -> None:
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    with pytest.raises(AuditError, match="cannot open the audit log"):
        AuditLog(blocker / "audit.jsonl").append({"event": "restart"})
    with pytest.raises(AuditError, match="cannot open the audit log"):
        AuditLog(tmp_path).append({"event": "restart"})  # a directory


def test_reading_skips_and_counts_malformed_lines(tmp_path: Path) -> None:
    path = tmp_path / "audit.jsonl"
    log = AuditLog(path)
    log.append({"n": 1})
    with path.open("ab") as f:
        f.write(b'{"n": 2, "torn\n[1, 2]\n\n\xff\xfe\n')
    log.append({"n": 3})
    found = scan(path)
    assert [r["n"] for r in found.records] == [1, 3]
    assert found.malformed == 3
    assert [r["n"] for r in scan(path, last=1).records] == [3]


def test_a_line_past_the_bound_is_passed_over_in_pieces_not_held_whole(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A crash's tail of NUL bytes with no newline was read as one line: `audit --last 1`
    # held 3.1 GB for a 1.5 GB tail. Here the bound is 1 MiB and the tail 48 MiB.
    monkeypatch.setattr(actions, "MAX_AUDIT_LINE", 1 << 20)
    path = tmp_path / "audit.jsonl"
    log = AuditLog(path)
    log.append({"n": 1})
    with path.open("ab") as f:
        f.write(b"\0" * (48 << 20) + b"\n")
    log.append({"n": 2})
    tracemalloc.start()
    try:
        found = scan(path, last=1)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert ([r["n"] for r in found.records], found.malformed) == ([2], 1)
    assert peak < 8 << 20, peak  # a few pieces of the bound at most, never the tail


def test_a_log_not_yet_written_reads_as_empty(tmp_path: Path) -> None:
    assert read(tmp_path / "absent.jsonl") == []
    assert scan(tmp_path / "absent.jsonl").malformed == 0


_WRITER = """
import sys, time
from pathlib import Path
from llmhealth.actions import AuditLog
path, writer, go = sys.argv[1], int(sys.argv[2]), Path(sys.argv[3])
while not go.exists():  # start together, so that the appends really interleave
    time.sleep(0.005)
log = AuditLog(path)
for seq in range(50):
    log.append({"actor": "test", "writer": writer, "seq": seq, "pad": str(writer) * 3000})
"""


def test_four_processes_appending_at_once_leave_every_line_whole(tmp_path: Path) -> None:
    path, go = tmp_path / "audit.jsonl", tmp_path / "go"
    writers = [
        subprocess.Popen([PY, "-c", _WRITER, str(path), str(w), str(go)], env=os.environ.copy())
        for w in range(4)
    ]
    go.touch()
    for w in writers:
        assert w.wait(timeout=60) == 0
    lines = path.read_bytes().splitlines()
    assert len(lines) == 200
    records = [json.loads(line) for line in lines]
    assert sorted((r["writer"], r["seq"]) for r in records) == [
        (w, s) for w in range(4) for s in range(50)
    ]
    assert all(r["pad"] == str(r["writer"]) * 3000 for r in records)
    assert scan(path).malformed == 0


def test_a_restart_environment_drops_every_key_variable_and_names_the_backend() -> None:
    inherited = {"PATH": "/usr/bin", "GPU0_KEY": "a", "GPU1_KEY": "b", "LLMHEALTH_URL": "old"}
    environment = restart_environment(
        inherited,
        {"GPU0_KEY", "GPU1_KEY", "UNSET_KEY"},
        backend="gpu0",
        url="http://10.0.0.5:8000",
        reason="wedged: engine 0\x00\x1b had work",
    )
    assert environment == {
        "PATH": "/usr/bin",
        "LLMHEALTH_BACKEND": "gpu0",
        "LLMHEALTH_URL": "http://10.0.0.5:8000",
        # NUL cannot be in an environment value at all; an escape must not reach a script's log.
        "LLMHEALTH_REASON": "wedged: engine 0\\x00\\x1b had work",
    }


def test_a_command_runs_with_exactly_the_environment_it_is_given() -> None:
    script = "import json, os; print(json.dumps(dict(os.environ)))"
    result = run_command([sys.executable, "-c", script], 10.0, env={"ONLY": "this"})
    assert result.ok, result
    shown = json.loads(result.stdout)
    assert shown.get("ONLY") == "this"
    assert "PATH" not in shown


def test_a_batch_of_appends_is_written_and_made_durable_once_at_its_end(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    log = AuditLog(tmp_path / "audit.jsonl")
    log.append({"event": "first"})  # the file exists: no directory fsync below
    synced: list[int] = []
    writes: list[int] = []
    real_fsync, real_write = os.fsync, os.write

    def counting_fsync(fd: int) -> None:
        synced.append(fd)
        real_fsync(fd)

    def counting_write(fd: int, data: bytes) -> int:
        writes.append(len(data))
        return real_write(fd, data)

    monkeypatch.setattr(os, "fsync", counting_fsync)
    monkeypatch.setattr(os, "write", counting_write)
    with log.batch():
        for number in range(50):
            log.append({"event": "moved", "n": number})
        with log.batch():  # inside a batch: part of it
            log.append({"event": "inner"})
        assert synced == []
        assert writes == []
    assert len(synced) == 1
    assert len(writes) == 1  # 51 records, one open, lock and write
    records = read(tmp_path / "audit.jsonl")
    assert [record["event"] for record in records] == ["first", *["moved"] * 50, "inner"]
    log.append({"event": "alone"})  # outside a batch: its own write and fsync again
    assert (len(synced), len(writes)) == (2, 2)


def test_a_batch_ended_by_an_exception_writes_nothing(tmp_path: Path) -> None:
    # A settle that fails saves nothing; the next one decides again from the state as it
    # was. Kept, its records said a restart was issued that never was, once per settle.
    log = AuditLog(tmp_path / "audit.jsonl")
    with pytest.raises(RuntimeError, match="mid-settle"), log.batch():
        log.append({"event": "moved"})
        raise RuntimeError("mid-settle")
    assert not log.path.exists()
    log.append({"event": "after"})
    assert [record["event"] for record in read(log.path)] == ["after"]


def test_a_batch_taken_back_leaves_only_what_it_did_not_write(tmp_path: Path) -> None:
    # Its state refused its rename (cycle._close, operate): the batch's records go, and
    # nothing else does: not an earlier batch's, when the last one wrote nothing, nor a
    # record another writer appended after it.
    log = AuditLog(tmp_path / "audit.jsonl")
    with log.batch():
        log.append({"event": "saved"})
    with log.batch():
        log.append({"event": "unsaved"})
    log.take_back_batch()
    log.take_back_batch()  # once only
    assert [record["event"] for record in read(log.path)] == ["saved"]
    with pytest.raises(RuntimeError, match="before its write"), log.batch():
        log.append({"event": "never written"})
        raise RuntimeError("before its write")
    log.take_back_batch()
    assert [record["event"] for record in read(log.path)] == ["saved"]
    with log.batch():
        log.append({"event": "unsaved"})
    AuditLog(log.path).append({"event": "another writer's"})
    log.take_back_batch()
    events = [record["event"] for record in read(log.path)]
    assert events == ["saved", "unsaved", "another writer's"]


def test_a_batch_that_cannot_be_written_raises_audit_error(
    tmp_path: Path,
) -> None:
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    log = AuditLog(blocker / "audit.jsonl")
    with pytest.raises(AuditError, match="cannot open the audit log"), log.batch():
        log.append({"event": "moved"})
        log.append({"event": "restart"})


def test_records_sharing_a_proof_in_a_batch_are_written_as_each_alone(tmp_path: Path) -> None:
    # A batch encodes a value its records share once (a condemned backend's proof goes
    # in its ledger move and its restart decision); each line must still be the record's
    # own encoding, and field by field the same bytes as the whole object's.
    proof = {"verdict": "wedged", "reads": [{"at": 1.0, "kv": float("nan"), 2: ("x", "é")}]}
    records = [
        {"time": 5.0, "backend": "b0", "event": "wedged", "evidence": proof},
        {"time": 5.0, "backend": "b0", "event": "restart", "evidence": proof},
        {"time": 6, "backend": "b1", "evidence": {"last_error": None}},
    ]
    log = AuditLog(tmp_path / "audit.jsonl")
    with log.batch():
        for record in records:
            log.append(record)
    lines = (tmp_path / "audit.jsonl").read_bytes().splitlines(keepends=True)
    assert lines == [encode_record(record) for record in records]
    whole = {"time": 5.0, "backend": "b0", "event": "wedged", "evidence": proof}
    expected = json.dumps(
        {
            **whole,
            "evidence": {"verdict": "wedged", "reads": [{"at": 1.0, "kv": "nan", "2": ["x", "é"]}]},
        }
    )
    assert lines[0] == expected.encode("ascii") + b"\n"


class Level(IntEnum):
    LOW = 1


class Tag(str):
    """A str subclass, as a StrEnum member is: JSON writes its text, not its str()."""

    def __str__(self) -> str:
        return "not this"


class Ratio(float):
    def __repr__(self) -> str:
        return "not this"


class Reading:
    """An object the audit writes as its ``to_dict()``."""

    def to_dict(self) -> dict[str, object]:
        return {"at": 1.5, "kv": float("inf")}


class PosingAsStr(type):
    """A class that says it is ``str`` to anything that asks by ``==`` and hash."""

    def __eq__(cls, other: object) -> bool:
        return True

    def __hash__(cls) -> int:
        return hash(str)


class Impostor(metaclass=PosingAsStr):
    def __str__(self) -> str:
        return "impostor"


def as_the_audit_writes(value: object, depth: int = 1) -> object:
    """What an audit record's value becomes, as AuditLog's docstring tells it, walked one
    value at a time: the oracle for `encode_record`'s shortcuts."""
    if value is None or isinstance(value, bool | int | str):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else str(value)
    if depth > 32:
        return str(value)
    if isinstance(value, Mapping):
        return {str(k): as_the_audit_writes(v, depth + 1) for k, v in value.items()}
    if isinstance(value, list | tuple | set | frozenset | deque):
        return [as_the_audit_writes(v, depth + 1) for v in value]
    if isinstance(value, Reading):
        return as_the_audit_writes(value.to_dict(), depth + 1)
    return str(value)


TEXT = st.text(max_size=6) | st.text(st.characters(categories=["Cs"]), max_size=3)
LEAVES = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats()
    | TEXT
    | st.builds(Ratio, st.floats())
    | st.sampled_from([Level.LOW, Tag("tagged"), Path("/tmp/x"), Reading(), Impostor()])
)
KEYS = TEXT | st.integers() | st.booleans() | st.none() | st.floats()
VALUES = st.recursive(
    LEAVES,
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.tuples(inner, inner)
        | st.frozensets(st.integers(), max_size=3)
        | st.dictionaries(KEYS, inner, max_size=4)
        | st.dictionaries(KEYS, inner, max_size=3).map(MappingProxyType)
    ),
    max_leaves=25,
)


def nested(levels: int) -> Any:
    value: Any = 1.5
    for _ in range(levels):
        value = {"in": [value]}
    return value


DEEP = {"time": 7, "deep": nested(40), "flat": nested(3)}


@given(st.dictionaries(TEXT.filter(lambda k: k != "time"), VALUES, max_size=6), st.booleans())
def test_a_record_is_written_as_its_values_made_plain_then_encoded(
    fields: dict[str, object], batched: bool
) -> None:
    # The shortcuts for plain leaves and fields (str, int, bool, None, finite float by
    # exact type) must write the bytes the walk writes, whatever else the record holds:
    # subclasses, NaN, keys JSON would print otherwise, nesting past the depth bound.
    # Batched, the records share one cache, and the second takes a container from it.
    shared: dict[int, tuple[object, str]] | None = {} if batched else None
    records = ({"time": 7.25, **fields}, {"time": 8, "again": fields, **fields}, DEEP)
    for record in records:
        plain = {key: as_the_audit_writes(value) for key, value in record.items()}
        expected = json.dumps(plain, ensure_ascii=True, allow_nan=False)
        written = encode_record(record, shared)
        assert json.loads(written) == json.loads(expected)
        assert written == expected.encode("ascii") + b"\n"


def test_a_batch_whose_fsync_fails_says_so(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    log = AuditLog(tmp_path / "audit.jsonl")

    def failing(_fd: int) -> None:
        raise OSError(errno.EIO, "I/O error")

    log.append({"event": "before"})
    with pytest.raises(AuditError, match="cannot make the records durable"), log.batch():
        log.append({"event": "moved"})
        monkeypatch.setattr(os, "fsync", failing)
    # Taken back: a settle that saved nothing must leave no record saying it acted.
    assert [record["event"] for record in read(log.path)] == ["before"]


def test_a_short_write_is_taken_back_whole_and_says_which_records_were_lost(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The batch's whole first record was kept: a restart in the trail that was never
    saved nor run, written again by the settle made again once the disk had room."""
    log = AuditLog(tmp_path / "audit.jsonl")
    log.append({"time": 1.0, "event": "before"})
    real_write = os.write

    def short(fd: int, data: bytes) -> int:
        return real_write(fd, data[: len(data) // 2] if len(data) > 1 else data)

    monkeypatch.setattr(os, "write", short)
    with (
        pytest.raises(AuditError, match=r"short write .*not all of its 2 records were kept"),
        log.batch(),
    ):
        # Fixed times, so the cut falls inside the second line, never at its start.
        log.append({"time": 1.0, "event": "moved"})
        log.append({"time": 1.0, "event": "restart"})
    with pytest.raises(AuditError, match="the record was not kept"):
        log.append({"time": 1.0, "event": "alone"})
    monkeypatch.setattr(os, "write", real_write)
    log.append({"time": 1.0, "event": "after"})
    found = scan(log.path)
    assert [record["event"] for record in found.records] == ["before", "after"]
    assert found.malformed == 0


def test_a_failed_fsync_leaves_what_another_writer_appended_meanwhile(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A writer that takes no lock (a shell's >>) may append after our whole write and
    before its take-back: cut back to where ours began, its line went with ours. Then
    nothing is cut (our records stay, as before the take-back existed)."""
    log = AuditLog(tmp_path / "audit.jsonl")
    log.append({"time": 1.0, "event": "before"})

    def another_then_fail(_fd: int) -> None:
        with open(log.path, "ab") as other:
            other.write(b'{"event": "theirs"}\n')
        raise OSError(errno.EIO, "I/O error")

    with pytest.raises(AuditError, match="cannot make the records durable"), log.batch():
        log.append({"time": 1.0, "event": "moved"})
        monkeypatch.setattr(os, "fsync", another_then_fail)
    monkeypatch.undo()
    events = [record["event"] for record in scan(log.path).records]
    assert events == ["before", "moved", "theirs"]


_HOLDER = """
import fcntl, sys
with open(sys.argv[1], "ab") as log:
    fcntl.flock(log, fcntl.LOCK_EX)  # as flock(1) in a backup or log-shipping script
    print("held", flush=True)
    sys.stdin.read()  # until the test closes our stdin
"""


def test_a_log_another_process_keeps_locked_fails_the_append_instead_of_hanging(
    tmp_path: Path,
) -> None:
    path = tmp_path / "audit.jsonl"
    AuditLog(path).append({"event": "before"})
    with subprocess.Popen(
        [PY, "-c", _HOLDER, str(path)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    ) as holder:
        assert holder.stdin is not None and holder.stdout is not None
        try:
            assert holder.stdout.readline() == "held\n"
            locked = rf"{re.escape(str(path))}: the audit log is locked by another process"
            with pytest.raises(AuditError, match=locked):
                AuditLog(path, lock_timeout=0.2).append({"event": "blocked"})
        finally:
            holder.stdin.close()
            holder.wait(timeout=60)
    AuditLog(path, lock_timeout=0.2).append({"event": "after"})  # let go: appends again
    assert [record["event"] for record in read(path)] == ["before", "after"]


def test_a_record_after_a_fragment_left_without_its_newline_is_on_a_line_of_its_own(
    tmp_path: Path,
) -> None:
    # A short write on a full disk, whose closing newline failed too as the disk was
    # still full: the next record must not be glued to the fragment and lost with it.
    path = tmp_path / "audit.jsonl"
    path.write_bytes(b'{"event": "whole"}\n{"event": "torn", "rea')
    AuditLog(path).append({"event": "after"})
    found = scan(path)
    assert [record["event"] for record in found.records] == ["whole", "after"]
    assert found.malformed == 1
    AuditLog(path).append({"event": "next"})  # a log that ends a line gets no blank one
    assert path.read_bytes().count(b"\n") == 4


def test_root_never_appends_to_a_file_another_users_audit_link_names(tmp_path: Path) -> None:
    """The owner of the state directory made the audit log a link to a file of root's:
    each verb run as root appended its records there."""
    if os.geteuid() != 0:
        pytest.skip("making a link another user's takes root")
    victim = tmp_path / "root-only" / "authorized_keys"
    victim.parent.mkdir()
    victim.write_text("ssh-ed25519 AAAA root@here\n")
    audit = tmp_path / "service" / "audit.jsonl"
    audit.parent.mkdir()
    audit.symlink_to(victim)
    os.lchown(audit, 40123, 40123)
    with pytest.raises(AuditError, match="owned by uid 40123"):
        AuditLog(audit).append({"event": "hold", "backend": "gpu0"})
    assert victim.read_text() == "ssh-ed25519 AAAA root@here\n"


def test_output_within_the_limit_keeps_a_character_that_straddles_the_halves() -> None:
    # Its head and tail were decoded apart though nothing was left out: two U+FFFD.
    """4096 bytes of output, nothing omitted: the é across the head/tail seam is lost."""
    written = "a" * 2047 + "é" + "b" * 2047  # 4096 bytes, the default limit
    script = f"import sys; sys.stdout.buffer.write({written.encode()!r})"
    result = run_command([sys.executable, "-c", script], timeout=30)
    assert result.ok
    assert result.stdout == written


def test_a_scan_hands_each_record_on_as_it_is_read_and_keeps_none(tmp_path: Path) -> None:
    """`audit` held the whole log as dicts before printing its first line: a log is never
    rotated, and 300 MB of it took 2.3 GB."""
    handed: list[dict[str, object]] = []

    def lines() -> Iterator[bytes]:
        yield b'{"time": 1, "n": 1}\n'
        assert handed == [{"time": 1, "n": 1}], "the first record was held, not handed on"
        yield b"torn\n"
        yield b'{"time": 2, "n": 2}\n'

    found = parse_records(lines(), each=handed.append)
    assert (found.records, found.malformed) == ([], 1)
    assert [record["n"] for record in handed] == [1, 2]
    path = tmp_path / "audit.jsonl"
    path.write_bytes(b'{"n": 1}\n{"n": 2}\n{"n": 3}\n')
    newest: list[dict[str, object]] = []
    assert scan(path, last=2, each=newest.append).records == []
    assert newest == [{"n": 2}, {"n": 3}]


def test_an_error_of_the_records_taker_is_not_the_logs(tmp_path: Path) -> None:
    """A reader gone (`audit | head`) is no audit log that cannot be read (exit 3)."""
    path = tmp_path / "audit.jsonl"
    path.write_bytes(b'{"n": 1}\n{"n": 2}\n')

    def gone(record: dict[str, object]) -> None:
        raise BrokenPipeError(32, "Broken pipe")

    with pytest.raises(BrokenPipeError):
        scan(path, each=gone)


_LEASED_THEN_LOCKED = """
import fcntl, signal, sys, time
broken = []
signal.signal(signal.SIGIO, lambda *_: broken.append(1))  # a lease break would end us
with open(sys.argv[1], "rb") as locked, open(sys.argv[1], "rb") as leased:
    fcntl.flock(locked, fcntl.LOCK_EX)  # as flock(1) in a backup script
    try:
        fcntl.fcntl(leased, fcntl.F_SETLEASE, fcntl.F_RDLCK)  # as a file-syncing agent
    except OSError as exc:  # a filesystem without leases
        print(f"no lease: {exc}", flush=True)
        sys.exit()
    print("held", flush=True)
    while not broken:
        time.sleep(0.01)
    time.sleep(float(sys.argv[2]))  # the lease given up late, the flock kept
    fcntl.fcntl(leased, fcntl.F_SETLEASE, fcntl.F_UNLCK)
    sys.stdin.read()  # until the test closes our stdin
"""


def test_the_lease_and_the_lock_on_the_audit_log_share_one_bound(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # README: "An audit record waits at most 10 s for another holder of the audit log's
    # lock ... (a file lease another process holds on either counts in those 10 s)".
    # The flock was given the whole bound again after the open's wait for the lease: a
    # settle, holding the state lock, waited twice as long.
    path = tmp_path / "audit.jsonl"
    AuditLog(path).append({"event": "before"})
    # The lock is not waited for here (the holder's flock is another test's): what the
    # open leaves it is all this one asks, and a bound far past the lease's 0.5 s keeps
    # a loaded machine's stalls from failing the open before the lease is given up.
    bound, leased_for = 10.0, 0.5
    given: list[float] = []

    def lock_within(_fd: int, seconds: float) -> bool:
        given.append(seconds)
        return False

    monkeypatch.setattr(actions, "lock_within", lock_within)
    with subprocess.Popen(
        [PY, "-c", _LEASED_THEN_LOCKED, str(path), str(leased_for)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    ) as holder:
        assert holder.stdin is not None and holder.stdout is not None
        try:
            said = holder.stdout.readline()
            if said.startswith("no lease"):
                pytest.skip(said)
            assert said == "held\n"
            with pytest.raises(AuditError, match="locked by another process"):
                AuditLog(path, lock_timeout=bound).append({"event": "blocked"})
        finally:
            holder.stdin.close()
            holder.wait(timeout=60)
    # The open waited at least until the lease was given up: only the rest is the lock's.
    assert len(given) == 1 and given[0] <= bound - leased_for
    assert [record["event"] for record in read(path)] == ["before"]


def test_a_log_left_empty_by_a_directory_that_would_not_sync_has_it_synced_by_the_next(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first record of a new log is cut back out when its directory will not sync,
    leaving the file there, empty: the next append took it for an old log and synced no
    directory, so the retried settle saved its state with its records in a log a crash
    could take away whole."""
    path = tmp_path / "audit.jsonl"
    directory_syncs(monkeypatch, fail=True)
    with pytest.raises(AuditError, match="directory"):
        AuditLog(path).append({"event": "hold"})
    assert path.read_bytes() == b""
    dirs_synced = directory_syncs(monkeypatch, fail=False)
    AuditLog(path).append({"event": "hold"})
    assert [record["event"] for record in read(path)] == ["hold"]
    assert len(dirs_synced) == 1
    AuditLog(path).append({"event": "release"})  # a log with records in it: none again
    assert len(dirs_synced) == 1


def test_a_restart_reason_is_cut_to_its_bound_with_a_mark() -> None:
    environment = restart_environment({}, (), backend="gpu0", url="http://h", reason="x" * 5000)
    assert environment["LLMHEALTH_REASON"] == "x" * 997 + "..."


def test_an_output_limit_that_is_a_bool_is_refused() -> None:
    with pytest.raises(ValueError, match="output_limit"):
        run_command(["true"], timeout=30, output_limit=True)


def test_an_output_limit_of_zero_keeps_no_output_and_counts_it() -> None:
    result = run_command(python("print('x' * 10_000)"), timeout=30, output_limit=0)
    assert result.ok
    assert result.stdout == "\n[... 10001 bytes omitted ...]\n"


@needs_proc
def test_the_command_never_reads_this_processs_stdin() -> None:
    """A restart script that reads stdin (a prompt, `read`) waited on the daemon's own
    stdin, or took what was meant for it: it gets /dev/null, whatever ours is."""
    reading, writing = os.pipe()
    saved = os.dup(0)
    try:
        os.dup2(reading, 0)
        os.write(writing, b"meant for llmhealth\n")
        result = run_command(python("import os; print(os.readlink('/proc/self/fd/0'))"), 30)
    finally:
        os.dup2(saved, 0)
        for fd in (saved, reading, writing):
            os.close(fd)
    assert result.stdout == "/dev/null\n"


@needs_proc
def test_an_interrupted_run_kills_the_command_group_it_started(tmp_path: Path) -> None:
    """Interrupted (KeyboardInterrupt, a bug), the command is not left running unowned."""
    started = tmp_path / "pgid"

    class InterruptError(Exception):
        pass

    def interrupt(*_: object) -> None:
        if started.exists() and started.read_text().strip():
            raise InterruptError
        signal.setitimer(signal.ITIMER_REAL, 0.05)  # not started yet: look again

    previous = signal.signal(signal.SIGALRM, interrupt)
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.05)
        script = 'sleep 60 & echo "$$" > "$1"; wait'
        with pytest.raises(InterruptError):
            run_command(["sh", "-c", script, "sh", str(started)], timeout=60)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    assert wait_until_gone(int(started.read_text())) == []


def test_a_command_that_closes_its_output_then_exits_in_time_is_not_timed_out() -> None:
    """Its streams at EOF, the command is still waited for until its timeout: taken for
    timed out at once, it was killed mid-restart."""
    result = run_command(["sh", "-c", "exec >&- 2>&-; sleep 0.3; exit 3"], timeout=30)
    assert (result.exit_code, result.timed_out) == (3, False)


def test_a_group_that_ends_on_sigterm_is_not_sent_sigkill() -> None:
    """The leader reaped and the group gone, nothing is left to kill, nor said to be."""
    result = run_command(["sleep", "30"], timeout=0.5)
    assert result.timed_out and result.exit_code == -signal.SIGTERM
    assert "SIGKILL" not in result.stderr, result.stderr
    assert how_it_ended(result) == "timed out"  # not "killed by SIGTERM": we sent that


def test_what_a_timed_out_command_says_as_it_stops_is_kept() -> None:
    """Its last words after SIGTERM (a trap saying what it left undone) are still in the
    pipes once it has died, and the audit record keeps them."""
    result = run_command(["sh", "-c", "trap 'echo stopping vllm@0; exit 1' TERM; sleep 30"], 0.5)
    assert result.timed_out and result.exit_code == 1
    assert result.stdout == "stopping vllm@0\n"


def test_a_number_past_a_floats_range_is_a_malformed_line() -> None:
    """Read as infinity, it would be written again as ``Infinity``, which strict JSON
    parsers reject (`audit -f json` piped on)."""
    found = parse_records([b'{"n": 1e999}\n', b'{"n": -1e999}\n', b'{"n": 1.5}\n'])
    assert (found.records, found.malformed) == ([{"n": 1.5}], 2)


@pytest.mark.parametrize("refusal", [errno.EINVAL, errno.ENOTSUP])
def test_a_new_log_on_a_filesystem_that_cannot_sync_directories_is_kept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, refusal: int
) -> None:
    """Some filesystems refuse to fsync a directory at all: the record is on disk, and
    refusing it would stop every settle there for good."""
    real_fsync = os.fsync

    def fsync(descriptor: int) -> None:
        if stat.S_ISDIR(os.fstat(descriptor).st_mode):
            raise OSError(refusal, os.strerror(refusal))
        real_fsync(descriptor)

    monkeypatch.setattr(os, "fsync", fsync)
    path = tmp_path / "audit.jsonl"
    AuditLog(path).append({"event": "hold"})
    assert [record["event"] for record in read(path)] == ["hold"]
