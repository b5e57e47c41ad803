"""The state file on a real disk: atomic replacement, the lock, and corrupt files set aside."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import random
import signal
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from diskfaults import directory_syncs
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from llmhealth import state as state_module
from llmhealth.actions import AuditLog
from llmhealth.fleet import FleetRecord
from llmhealth.ledger import LedgerPolicy
from llmhealth.rows import Rows, Table, plain
from llmhealth.state import (
    SCHEMA,
    MemoryStore,
    StateCorruptError,
    StateError,
    StateFile,
    StateLockedError,
    default_path,
    encode_pieces,
)


def identity(document: dict[str, Any]) -> dict[str, Any]:
    return document


def test_no_file_yet_loads_as_none(tmp_path: Path) -> None:
    store = StateFile(tmp_path / "state.json")
    with store.locked():
        assert store.load(identity) is None


def test_a_saved_document_loads_back_with_its_schema(tmp_path: Path) -> None:
    store = StateFile(tmp_path / "deep" / "state.json")
    with store.locked():
        store.save({"ledger": {"gpu0": "healthy"}})
        assert store.load(identity) == {"ledger": {"gpu0": "healthy"}, "schema": SCHEMA}
    assert not [p for p in store.path.parent.iterdir() if p.name.endswith(".tmp")]


@pytest.mark.parametrize(
    "content",
    [
        b"{not json",
        b'{"schema": 0}',
        b'{"ledger": "\xff\xfe binary"}',
        b"",
        b"\x00" * 4096,
        b'{"a": ' * 200_000,
        b"{}",
        b'{"ledger": {"gpu0": "retired"}}',
    ],
    ids=[
        "broken-json",
        "past-schema",
        "binary",
        "empty",
        "zeros",
        "deeply-nested",
        # What is left of a state may be an empty object, or lack its schema alone: still
        # a state's, not another program's file to leave in place.
        "empty-object",
        "no-schema",
    ],
)
def test_a_corrupt_file_is_moved_aside_and_reported(tmp_path: Path, content: bytes) -> None:
    store = StateFile(tmp_path / "state.json")
    store.path.write_bytes(content)
    with store.locked(), pytest.raises(StateCorruptError, match="moved aside to") as caught:
        store.load(identity)
    aside = [p for p in tmp_path.iterdir() if ".corrupt-" in p.name]
    assert len(aside) == 1
    assert aside[0].read_bytes() == content  # kept, byte for byte
    assert str(aside[0]) in str(caught.value)
    assert not store.path.exists()
    with store.locked():
        assert store.load(identity) is None  # the next run starts fresh


@pytest.mark.parametrize(
    "content",
    [b"[1, 2]", b"\xff\xfe binary", b"root:x:0:0:root:/root:/bin/bash\n", b'state = "x"\n'],
    ids=["a-list", "binary", "passwd", "a-config"],
)
def test_a_file_llmhealth_never_wrote_is_left_in_place(tmp_path: Path, content: bytes) -> None:
    """Every state is saved as one JSON object. A file that does not begin with "{" was
    never one (a config given as --state, or as root any file a slip names): moved aside
    as corrupt, it was gone from where its own program looks for it."""
    _left_in_place(StateFile(tmp_path / "fleet.toml"), content)


def _left_in_place(store: StateFile, content: bytes) -> None:
    """``content`` at the state's path is refused by load and read, and stays as it is."""
    store.path.write_bytes(content)
    for use in (store.load, store.read):
        with store.locked(), pytest.raises(StateError, match="not a file llmhealth wrote"):
            use(identity)
    assert store.path.read_bytes() == content
    assert not [p for p in store.path.parent.iterdir() if ".corrupt-" in p.name]


def test_a_large_file_llmhealth_never_wrote_is_left_in_place_too(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Past the size a run reads back (64 MiB), any file was moved aside as a corrupt
    state before its first byte was looked at: `--state /var/log/syslog`, a model's
    weights or an initrd named by a slip, as root, went from where their programs look."""
    monkeypatch.setattr(state_module, "_MAX_STATE_BYTES", 1024)
    _left_in_place(StateFile(tmp_path / "syslog"), b"Jan  1 00:00:00 host kernel: a line\n" * 100)


@pytest.mark.parametrize(
    ("name", "content"),
    [
        (
            "serving.json",
            b'{\n "serving": [\n  {\n   "name": "gpu0",\n   "url": "http://h:8"\n  }\n ]\n}',
        ),
        ("daemon.json", b'{"log-driver": "journald", "data-root": "/srv/docker"}\n'),
        ("access.jsonl", b'{"time": 1, "status": 200}\n{"time": 2, "status": 502}\n'),
        ("settings.json", '{"editor.fontSize": 14}'.encode("utf-16")),
    ],
    ids=["the-serving-file", "a-json-config", "a-json-lines-log", "utf-16-with-a-mark"],
)
def test_a_json_file_llmhealth_never_wrote_is_left_in_place(
    tmp_path: Path, name: str, content: bytes
) -> None:
    """A file that begins with "{" but is a whole JSON object with none of a state's keys
    is someone else's: `hold --state serving.json` (the daemon's own --serving-file, a
    balancer reads it) or, as root, `--state /etc/docker/daemon.json` moved it aside as a
    corrupt state, gone from where its program looks for it."""
    _left_in_place(StateFile(tmp_path / name), content)


def test_a_large_json_lines_file_is_left_in_place_too(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(state_module, "_MAX_STATE_BYTES", 1024)
    _left_in_place(StateFile(tmp_path / "app.jsonl"), b'{"level": "info", "msg": "a"}\n' * 100)


@pytest.mark.parametrize("encoding", ["utf-8-sig", "utf-16", "utf-32"])
def test_a_state_saved_again_by_an_editor_with_a_byte_order_mark_still_loads(
    tmp_path: Path, encoding: str
) -> None:
    """JSON read from bytes takes a byte order mark (json.loads, RFC 8259 8.1 lets a
    parser ignore it), so a state an operator's editor saved again with one loaded; it
    was refused as "not a file llmhealth wrote (it does not begin with '{')" and every
    run exited 3, though the file begins with "{" in every editor."""
    store = StateFile(tmp_path / "state.json")
    with store.locked():
        store.save({"ledger": {"gpu0": "retired"}})
    text = store.path.read_bytes().decode()
    store.path.write_bytes(text.encode(encoding))
    with store.locked():
        assert store.load(identity) == {"ledger": {"gpu0": "retired"}, "schema": SCHEMA}
    assert store.read(identity) == {"ledger": {"gpu0": "retired"}, "schema": SCHEMA}


def test_two_corrupt_files_set_aside_in_one_second_keep_their_name(tmp_path: Path) -> None:
    # The second one's name was cut at the first "~": "fleet~prod.json" became "fleet~1".
    store = StateFile(tmp_path / "fleet~prod.json")
    for content in (b"{one", b"{two"):
        store.path.write_bytes(content)
        with store.locked(), pytest.raises(StateCorruptError):
            store.load(identity)
    aside = sorted(p.name for p in tmp_path.iterdir() if ".corrupt-" in p.name)
    assert len(aside) == 2
    assert all(name.startswith("fleet~prod.json.corrupt-") for name in aside), aside


def test_a_state_path_that_is_a_symlink_is_saved_where_it_points(tmp_path: Path) -> None:
    # os.replace renamed over the link itself: the link became a file of its own, and
    # the record it pointed to (on another volume, say) was left behind, stale.
    (tmp_path / "volume").mkdir()
    record = tmp_path / "volume" / "state.json"
    store = StateFile(tmp_path / "state.json")
    store.path.symlink_to(record)
    with store.locked():
        store.save({"ledger": {"gpu0": "healthy"}})
    with store.locked():
        store.save({"ledger": {"gpu0": "retired"}})
        assert store.load(identity) == {"ledger": {"gpu0": "retired"}, "schema": SCHEMA}
    assert store.path.is_symlink()
    assert json.loads(record.read_text())["ledger"] == {"gpu0": "retired"}
    record.write_bytes(b"{corrupt")
    with store.locked(), pytest.raises(StateCorruptError):
        store.load(identity)
    assert [
        p.name.split(".corrupt-")[0]
        for p in (tmp_path / "volume").iterdir()
        if p.name != "state.json.lock"  # the lock is beside the file too
    ] == [
        "state.json"
    ]  # the file was set aside where it lives; the link is left to point at the next one
    assert store.path.is_symlink()


def test_a_save_removes_the_temp_files_of_writers_killed_mid_save(tmp_path: Path) -> None:
    # Each kill mid-save left its temp file for good: 19 of 20 kills, 63.5 MB.
    store = StateFile(tmp_path / "state[1].json")  # a name glob() would read as a pattern
    left = [tmp_path / f".state[1].json.{tag}.tmp" for tag in ("a1b2c3d4", "zz_9yx8w")]
    others = [
        tmp_path / ".other.json.a1b2c3d4.tmp",
        tmp_path / ".state[1].json.x.a1b2c3d4.tmp",  # another state's, "state[1].json.x"
        tmp_path / "state[1].json.keep",
    ]
    for path in left + others:
        path.write_bytes(b"{half")
    with store.locked():
        store.save({"ledger": {}})
    assert sorted(p.name for p in tmp_path.iterdir() if p.suffix == ".tmp") == [
        ".other.json.a1b2c3d4.tmp",
        ".state[1].json.x.a1b2c3d4.tmp",
    ]
    assert all(path.exists() for path in others)


def test_a_symlink_to_a_missing_state_is_refused_not_started_afresh(tmp_path: Path) -> None:
    # Its volume not mounted yet: a fresh ledger was started in its place (a retired
    # backend serving again), and its save replaced the link for good.
    store = StateFile(tmp_path / "state.json")
    store.path.symlink_to(tmp_path / "unmounted" / "state.json")
    with pytest.raises(StateError, match="which does not exist"), store.locked():
        store.load(identity)
    assert store.path.is_symlink()


def test_a_state_path_that_is_a_fifo_is_refused_at_once(tmp_path: Path) -> None:
    # A plain open() waited for a writer for ever, holding the lock: every check, verb and
    # settle behind it waited too.
    script = (
        "import sys\nfrom llmhealth.state import StateFile, StateError\n"
        "try:\n    StateFile(sys.argv[1]).load(lambda d: d)\n"
        "except StateError as error:\n    print(error)\n"
    )
    os.mkfifo(tmp_path / "state.json")
    done = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path / "state.json")],
        capture_output=True, text=True, timeout=30, check=True,
    )  # fmt: skip
    assert "not a regular file" in done.stdout


def test_content_the_decoder_rejects_is_set_aside_too(tmp_path: Path) -> None:
    store = StateFile(tmp_path / "state.json")
    with store.locked():
        store.save({"ledger": "nonsense"})

    def strict(document: dict[str, Any]) -> dict[str, Any]:
        if not isinstance(document["ledger"], dict):
            raise ValueError("ledger is not a table")
        return document

    with store.locked(), pytest.raises(StateCorruptError, match="ledger is not a table"):
        store.load(strict)


def test_a_second_holder_waits_then_gives_up_naming_the_pid(tmp_path: Path) -> None:
    path = tmp_path / "state.json"
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time; from llmhealth.state import StateFile\n"
            "with StateFile(sys.argv[1]).locked():\n"
            "    print('held', flush=True); time.sleep(30)",
            str(path),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None
        assert holder.stdout.readline().strip() == "held"
        with (
            pytest.raises(StateLockedError, match=f"PID {holder.pid}"),
            StateFile(path, lock_timeout=0.3).locked(),
        ):
            pass
    finally:
        holder.kill()
        holder.wait(10)
        if holder.stdout is not None:
            holder.stdout.close()
    with StateFile(path, lock_timeout=5).locked():  # a dead holder's lock is released
        pass


WRITER = """
import sys
from llmhealth.state import StateFile
store = StateFile(sys.argv[1])
n = 0
print("writing", flush=True)
while True:
    n += 1
    with store.locked():
        store.save({"n": n, "pad": ["x" * 100] * 2000})
"""


@pytest.mark.slow
def test_a_writer_killed_at_random_moments_never_leaves_an_unloadable_file(
    tmp_path: Path,
) -> None:
    path = tmp_path / "state.json"
    chooser = random.Random(20261130)
    last_seen = 0
    for _ in range(12):
        writer = subprocess.Popen(
            [sys.executable, "-c", WRITER, str(path)], stdout=subprocess.PIPE, text=True
        )
        try:
            assert writer.stdout is not None
            writer.stdout.readline()
            time.sleep(chooser.uniform(0.0, 0.15))
        finally:
            os.kill(writer.pid, signal.SIGKILL)
            writer.wait(10)
            if writer.stdout is not None:
                writer.stdout.close()
        if path.exists():
            with StateFile(path).locked():
                document = StateFile(path).load(identity)
            assert document is not None
            assert document["n"] >= 1
            last_seen = max(last_seen, document["n"])
    assert last_seen > 0
    assert json.loads(path.read_text())["schema"] == SCHEMA


def test_the_default_path_follows_systemd_then_root_then_the_user() -> None:
    assert default_path({"STATE_DIRECTORY": "/var/lib/llmhealth:/other"}) == Path(
        "/var/lib/llmhealth/state.json"
    )
    expected = (
        Path("/var/lib/llmhealth/state.json")
        if os.geteuid() == 0
        else Path("/xdg/llmhealth/state.json")
    )
    assert default_path({"XDG_STATE_HOME": "/xdg"}) == expected


def test_a_relative_xdg_state_home_is_ignored_not_taken_from_the_working_directory(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    expected = Path.home() / ".local" / "state" / "llmhealth" / "state.json"
    assert default_path({"XDG_STATE_HOME": "state"}) == expected
    assert default_path({"XDG_STATE_HOME": "/xdg"}) == Path("/xdg/llmhealth/state.json")


# --- who may read it --------------------------------------------------------------------


@pytest.fixture
def open_umask() -> Iterator[None]:
    """The most permissive umask: whatever the files get is what llmhealth asked for."""
    previous = os.umask(0)
    try:
        yield
    finally:
        os.umask(previous)


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_the_state_its_temp_file_and_the_lock_are_the_owners_alone(
    tmp_path: Path, open_umask: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = StateFile(tmp_path / "state.json")
    temporaries: list[tuple[str, int]] = []
    real_replace = os.replace

    def replace(source: Any, target: Any) -> None:  # sees the temp file just before it is renamed
        temporaries.append((Path(source).name, mode(Path(source))))
        real_replace(source, target)

    monkeypatch.setattr(state_module.os, "replace", replace)
    for _ in range(2):
        with store.locked():
            store.save({"n": 1})
    monkeypatch.undo()
    assert mode(store.path) == 0o600
    assert mode(store.lock_path) == 0o600
    assert [m for _, m in temporaries] == [0o600, 0o600]
    first, second = (name for name, _ in temporaries)
    assert first != second, "temp names are not predictable"
    assert first.startswith(".state.json.") and first.endswith(".tmp")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["state.json", "state.json.lock"]


def test_a_symlink_planted_at_a_temp_name_is_never_written_through(tmp_path: Path) -> None:
    """Before, the temp name was .state.json.<pid>.tmp, opened without O_EXCL."""
    victim = tmp_path / "victim"
    victim.write_text("untouched")
    store = StateFile(tmp_path / "state.json")
    (tmp_path / f".state.json.{os.getpid()}.tmp").symlink_to(victim)
    with store.locked():
        store.save({"n": 1})
    assert victim.read_text() == "untouched"
    assert json.loads(store.path.read_text())["n"] == 1
    assert not store.path.is_symlink()


def test_an_older_world_readable_lock_file_is_made_the_owners_alone(
    tmp_path: Path, open_umask: None
) -> None:
    store = StateFile(tmp_path / "state.json")
    store.lock_path.touch(mode=0o644)
    with store.locked():
        pass
    assert mode(store.lock_path) == 0o600


def test_the_audit_log_is_readable_by_the_group_and_no_one_else(
    tmp_path: Path, open_umask: None
) -> None:
    log = AuditLog(tmp_path / "audit.jsonl")
    log.append({"event": "x"})
    assert mode(tmp_path / "audit.jsonl") == 0o640


def test_the_directories_made_for_the_state_and_audit_log_are_writable_by_the_owner_alone(
    tmp_path: Path, open_umask: None
) -> None:
    """Made under the umask alone, a state's new directory was 0777 under a umask of 0
    (0775 under 002): anyone could rename a state of their own in, and run as root, the
    next save refused the very directories the lock had just made ("writable by others
    than root"), as did every run after."""
    store = StateFile(tmp_path / "new" / "deeper" / "state.json")
    with store.locked():
        store.save({"n": 1})
    AuditLog(tmp_path / "logs" / "llmhealth" / "audit.jsonl").append({"event": "x"})
    made = ("new", "new/deeper", "logs", "logs/llmhealth")
    assert {name: mode(tmp_path / name) for name in made} == dict.fromkeys(made, 0o755)
    assert json.loads(store.path.read_text())["n"] == 1


_JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True) | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.dictionaries(st.text(max_size=6), inner, max_size=4)
        | st.dictionaries(st.integers(), inner, max_size=3)
    ),  # left whole, to json's key rules
    max_leaves=30,
)
# Long enough to be written in runs of items (state._CHUNK), as a fleet's tables are.
_LONG = st.lists(st.integers() | st.text(max_size=3), min_size=60, max_size=200) | (
    st.dictionaries(
        st.text(min_size=1, max_size=4),
        st.integers() | st.lists(st.integers(), max_size=3),
        min_size=60,
        max_size=200,
    )
)


# Each long example is a few hundred values: under load (the suite beside other work)
# drawing them tripped the too_slow health check, failing the test about half the time.
@settings(max_examples=40, suppress_health_check=[HealthCheck.too_slow])
@given(_JSON_VALUES | st.dictionaries(st.text(max_size=6), _LONG | _JSON_VALUES, max_size=4))
def test_a_document_in_pieces_is_the_whole_encoding_byte_for_byte(document: object) -> None:
    # `llmhealth status`, older versions and the etcd store read the same bytes.
    assert b"".join(encode_pieces(document)) == json.dumps(document, sort_keys=True).encode()


def test_a_saved_fleet_is_the_whole_encoding_and_reads_back(tmp_path: Path) -> None:
    document = {
        "ledger": {
            "backends": [{"name": f"b{i}", "state": "healthy", "x": [i, 0.5]} for i in range(200)],
            "epoch": 3,
        },
        "sightings": {f"b{i}": {"at": 1.5, "baseline": None} for i in range(130)},
        "proofs": {},
        "caf\u00e9": "\udcff",  # a lone surrogate, escaped as json escapes it
    }
    store = StateFile(tmp_path / "state.json")
    store.save(document)
    raw = (tmp_path / "state.json").read_bytes()
    assert raw == json.dumps({**document, "schema": SCHEMA}, sort_keys=True).encode()
    assert json.loads(raw) == {**document, "schema": SCHEMA}


def test_a_document_json_cannot_hold_fails_its_save_and_leaves_the_state_whole(
    tmp_path: Path,
) -> None:
    store = StateFile(tmp_path / "state.json")
    store.save({"ledger": {"epoch": 1}})
    before = (tmp_path / "state.json").read_bytes()
    backends = [{"name": f"b{i}"} for i in range(100)] + [{"name": "bad", "seen": {1.5}}]
    with pytest.raises(TypeError):
        store.save({"ledger": {"backends": backends}})  # the set is past the first pieces
    assert (tmp_path / "state.json").read_bytes() == before
    assert sorted(path.name for path in tmp_path.iterdir()) == ["state.json"]


def test_a_save_renamed_into_place_is_saved_though_its_directory_will_not_sync(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A failing disk's directory fsync raised after the rename: the daemon took the
    settle for unsaved and gave its requests back, and the next settle, loading the
    state saved all the same, counted them twice."""
    directory_syncs(monkeypatch, fail=True)
    store = StateFile(tmp_path / "state.json")
    store.save({"ledger": {"epoch": 2}})
    assert json.loads((tmp_path / "state.json").read_bytes())["ledger"] == {"epoch": 2}
    assert sorted(path.name for path in tmp_path.iterdir()) == ["state.json"]


def test_a_memory_store_keeps_a_record_for_the_run_as_a_file_would_hold_it() -> None:
    store = MemoryStore()
    with store.locked():
        assert store.load(dict) is None
        first = store.mark()
        document = {"ledger": {"backends": [{"name": "gpu0", "state": "healthy"}]}}
        store.save(document)
        assert store.mark() != first
        loaded = store.load(dict)
    assert loaded == {**document, "schema": SCHEMA}
    assert loaded is not None and loaded["ledger"] is not document["ledger"]  # new objects
    kept = store.mark()
    with pytest.raises(TypeError), store.locked():
        store.save({"ledger": object()})  # what JSON cannot hold, as a file refuses it
    assert store.mark() == kept and store.load(dict) == loaded  # the last record stays


def test_a_lock_whose_pid_note_cannot_be_written_still_holds(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # ENOSPC on the lock file's PID note raised a bare OSError out of every settle and
    # verb (a traceback) before the save, whose own failure is reported cleanly.
    def full(*_: object) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    store = StateFile(tmp_path / "state.json")
    monkeypatch.setattr(os, "pwrite", full)
    with store.locked():
        store.save({"n": 1})
    assert json.loads(store.path.read_text())["n"] == 1


def refused_while_held(store: StateFile) -> str:
    """What a run says when another process (flock(1) in a backup) holds the lock."""
    descriptor = os.open(store.lock_path, os.O_RDWR)
    try:
        fcntl.flock(descriptor, fcntl.LOCK_EX)
        with pytest.raises(StateLockedError) as refused, store.locked():
            pass
    finally:
        os.close(descriptor)
    return str(refused.value)


def test_a_lock_held_by_something_else_is_not_blamed_on_the_last_llmhealth(
    tmp_path: Path,
) -> None:
    """The PID note goes with each hold: a backup script's flock(1) after an llmhealth
    run was reported as that run, or as the very process that was waiting."""
    store = StateFile(tmp_path / "state.json", lock_timeout=0.2)
    with store.locked():
        store.save({"n": 1})
    refused = refused_while_held(store)
    assert "locked by a process that is not llmhealth" in refused
    assert str(os.getpid()) not in refused


def test_no_default_state_path_without_a_home_is_a_state_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A service user with no HOME and no passwd entry: a traceback, "internal error"."""
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    monkeypatch.delenv("HOME")
    monkeypatch.setattr("pwd.getpwuid", lambda _uid: (_ for _ in ()).throw(KeyError(_uid)))
    with pytest.raises(StateError, match="give state in the config, --state, or STATE_DIRECTORY"):
        default_path({})


def test_a_state_a_newer_llmhealth_wrote_is_left_in_place_not_started_afresh(
    tmp_path: Path,
) -> None:
    """An upgrade rolled back: set aside as corrupt, the next run started a fresh ledger,
    a retired GPU serving again and a weight-sync hold forgotten."""
    store = StateFile(tmp_path / "state.json")
    newer = b'{"schema": 2, "ledger": {"gpu1": "retired"}}'
    store.path.write_bytes(newer)
    for look in (store.load, store.read):
        with store.locked(), pytest.raises(StateError) as refused:
            look(identity)
        assert not isinstance(refused.value, StateCorruptError)
        assert "written by a newer llmhealth (schema 2; this one reads schema 1)" in str(
            refused.value
        )
    assert store.path.read_bytes() == newer
    assert sorted(p.name for p in tmp_path.iterdir()) == ["state.json", "state.json.lock"]


def test_a_run_through_a_symlink_and_one_through_its_file_share_one_lock(
    tmp_path: Path,
) -> None:
    """Beside the link, each had its own lock and both wrote the one state."""
    (tmp_path / "data").mkdir()
    real = StateFile(tmp_path / "data" / "state.json", lock_timeout=0.2)
    linked = StateFile(tmp_path / "state.json", lock_timeout=0.2)
    linked.path.symlink_to(real.path)
    with real.locked():
        real.save({"n": 1})
    assert linked.lock_path == real.lock_path
    with real.locked(), pytest.raises(StateLockedError), linked.locked():
        pass
    # The lock beside the link, the only one earlier versions took, is held too: one of
    # them still running beside this one (an upgrade under way) is kept out.
    beside_link = os.open(tmp_path / "state.json.lock", os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(beside_link, fcntl.LOCK_EX)
        with pytest.raises(StateLockedError), linked.locked():
            pass
    finally:
        os.close(beside_link)
    with linked.locked():  # both free again
        assert linked.load(identity) == {"n": 1, "schema": SCHEMA}


def test_a_symlink_planted_at_the_lock_name_is_refused_not_written_through(
    tmp_path: Path,
) -> None:
    """Opened through it, the file it names was truncated and made 0600 by every run."""
    victim = tmp_path / "victim.conf"
    victim.write_text("kept")
    victim.chmod(0o644)
    store = StateFile(tmp_path / "state.json")
    store.lock_path.symlink_to(victim)
    with pytest.raises(StateError, match="cannot open the lock file"), store.locked():
        pass
    assert victim.read_text() == "kept" and mode(victim) == 0o644


def test_a_lock_note_of_a_process_that_has_exited_is_not_blamed(tmp_path: Path) -> None:
    """A run SIGKILLed leaves its PID in the note; the next holder (flock(1) in a backup)
    was reported as that llmhealth, long gone."""
    store = StateFile(tmp_path / "state.json", lock_timeout=0.2)
    gone = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        capture_output=True,
        text=True,
        check=True,
    )
    with store.locked():
        pass
    store.lock_path.write_text(gone.stdout)
    assert "locked by a process that is not llmhealth" in refused_while_held(store)


def test_a_state_too_large_to_read_back_is_not_saved(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Saved, the next run set it aside as unreadable and started a fresh ledger."""
    monkeypatch.setattr(state_module, "_MAX_STATE_BYTES", 1024)
    store = StateFile(tmp_path / "state.json")
    with store.locked():
        store.save({"n": 1})
        with pytest.raises(StateError, match="more than a run reads back"):
            store.save({"n": 2, "pad": "x" * 4096})
        assert store.load(identity) == {"n": 1, "schema": SCHEMA}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["state.json", "state.json.lock"]


def test_a_corrupt_state_behind_a_symlink_says_the_link_now_leads_nowhere(
    tmp_path: Path,
) -> None:
    """It promised a fresh ledger, and every later run refused the dangling link."""
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "state.json").write_bytes(b"{not json")
    store = StateFile(tmp_path / "state.json")
    store.path.symlink_to(tmp_path / "data" / "state.json")
    with store.locked(), pytest.raises(StateCorruptError) as refused:
        store.load(identity)
    assert "is a symbolic link, which now leads nowhere: point it at a new file" in str(
        refused.value
    )


def test_a_state_path_linked_to_itself_is_an_error_not_a_lock_on_itself(tmp_path: Path) -> None:
    """Through a link the lock beside the link is held too; for a link to itself that is
    the one lock twice, and the run waited out its own lock, blaming itself."""
    store = StateFile(tmp_path / "state.json", lock_timeout=0.2)
    store.path.symlink_to(store.path)
    # Root resolves the links itself (openfiles.trusted_target), anyone else at the read.
    refused = "too many levels of symbolic links" if os.geteuid() == 0 else "cannot read state"
    with pytest.raises(StateError, match=refused), store.locked():
        store.load(identity)


SOMEONE_ELSE = 40123  # a uid no account here has
# Root's file a link leads to: it begins as a state does, so the link rules alone keep
# it from being moved aside or saved over (a file that does not is never moved aside).
VICTIM = '{"root": "x:0:0"}\n'


def link_of_someone_else(link: Path, target: Path) -> None:
    """A symbolic link as the owner of a service's state directory could plant one: only
    root can make a link another user's, so the tests that need one run as root."""
    if os.geteuid() != 0:
        pytest.skip("making a link another user's takes root")
    link.symlink_to(target)
    os.lchown(link, SOMEONE_ELSE, SOMEONE_ELSE)


@pytest.mark.parametrize("verb", ["load", "save"])
def test_root_never_moves_aside_nor_saves_over_a_file_another_users_link_names(
    tmp_path: Path, verb: str
) -> None:
    """The owner of the state directory swapped the state for a link to a file of root's:
    `sudo llmhealth hold`, finding no JSON there, moved that file aside, or saved the
    state over it."""
    victim = tmp_path / "root-only" / "shadow"
    victim.parent.mkdir()
    victim.write_text(VICTIM)
    store = StateFile(tmp_path / "service" / "state.json")
    store.path.parent.mkdir()
    link_of_someone_else(store.path, victim)
    with pytest.raises(StateError, match=f"owned by uid {SOMEONE_ELSE}"), store.locked():
        if verb == "load":
            store.load(identity)
        else:
            store.save({"ledger": {}})
    assert victim.read_text() == VICTIM
    assert sorted(p.name for p in victim.parent.iterdir()) == ["shadow"]


def test_a_link_of_roots_leading_to_another_users_link_is_not_followed_further(
    tmp_path: Path,
) -> None:
    """Root's own link is followed; the next one, in the service's directory, is not."""
    victim = tmp_path / "root-only" / "shadow"
    victim.parent.mkdir()
    victim.write_text(VICTIM)
    (tmp_path / "service").mkdir()
    link_of_someone_else(tmp_path / "service" / "state.json", victim)
    store = StateFile(tmp_path / "state.json")
    store.path.symlink_to(tmp_path / "service" / "state.json")
    with pytest.raises(StateError, match=f"owned by uid {SOMEONE_ELSE}"), store.locked():
        store.load(identity)
    assert victim.read_text() == VICTIM


def test_roots_own_link_is_still_followed_as_root(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("as root only")
    (tmp_path / "data").mkdir()
    store = StateFile(tmp_path / "state.json")
    store.path.symlink_to(Path("data") / "state.json")  # relative, as `ln -s` makes them
    with store.locked():
        store.save({"n": 1})
        assert store.load(identity) == {"n": 1, "schema": SCHEMA}
    assert store.path.is_symlink()
    assert json.loads((tmp_path / "data" / "state.json").read_text())["n"] == 1


def _service_dir(tmp_path: Path) -> Path:
    if os.geteuid() != 0:
        pytest.skip("as root only")
    service = tmp_path / "service"
    service.mkdir()
    os.chown(service, SOMEONE_ELSE, SOMEONE_ELSE)  # the hostile service user's
    return service


def test_roots_link_swapped_out_and_back_by_the_directorys_owner_is_not_followed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The two lstats compare the inode, not what readlink read: the directory's owner
    renames root's own link away, puts its own in, and renames root's back (one
    renameat2(RENAME_EXCHANGE) each way). Both lstats see root's link; readlink read the
    other. Here the attacker always wins the race, as a loop of exchanges sometimes does."""
    service = _service_dir(tmp_path)
    victim = tmp_path / "root-only" / "shadow"
    victim.parent.mkdir()
    victim.write_text(VICTIM)
    volume = tmp_path / "volume"  # the state on another volume, by root's own link
    volume.mkdir()
    (volume / "state.json").write_text(json.dumps({"schema": SCHEMA}))
    store = StateFile(service / "state.json")
    store.path.symlink_to(volume / "state.json")
    link_of_someone_else(service / "evil", victim)
    read_link = os.readlink

    def exchanged_around(path: Any = "", *args: Any, **kwargs: Any) -> str:
        if kwargs.get("dir_fd") is None and Path(path) != store.path:
            return read_link(path, *args, **kwargs)
        os.rename(store.path, service / "held")  # attacker: root's link away,
        os.rename(service / "evil", store.path)  # its own in
        try:
            return read_link(path, *args, **kwargs)
        finally:
            os.rename(store.path, service / "evil")  # and root's back: same inode
            os.rename(service / "held", store.path)

    monkeypatch.setattr(os, "readlink", exchanged_around)
    with contextlib.suppress(StateError), store.locked():
        store.load(identity)
    assert victim.read_text() == VICTIM
    assert sorted(p.name for p in victim.parent.iterdir()) == ["shadow"]


def test_a_directory_on_the_way_that_another_user_swaps_is_refused(
    tmp_path: Path,
) -> None:
    """Root's link `state.json -> data/state.json` (as the commit's own test makes it):
    `data` is in the service's directory, and its owner swaps it for a link of its own
    to another directory; trusted_target realpaths the directory, whoever's links."""
    service = _service_dir(tmp_path)
    other = tmp_path / "otherservice"  # root's: another program's state.json
    other.mkdir()
    (other / "state.json").write_text("{not json: another program's}\n")
    store = StateFile(service / "state.json")
    store.path.symlink_to(Path("data") / "state.json")
    link_of_someone_else(service / "data", other)  # was a directory; now the attacker's link
    with contextlib.suppress(StateError), store.locked():
        store.load(identity)
    assert (other / "state.json").read_text() == "{not json: another program's}\n"
    assert sorted(p.name for p in other.iterdir()) == ["state.json"]


def test_a_directory_on_the_way_that_another_user_swaps_gets_no_save_nor_lock(
    tmp_path: Path,
) -> None:
    service = _service_dir(tmp_path)
    other = tmp_path / "etc-like"  # root's directory
    other.mkdir()
    store = StateFile(service / "state.json")
    store.path.symlink_to(Path("data") / "state.json")
    link_of_someone_else(service / "data", other)
    with contextlib.suppress(StateError), store.locked():
        store.save({"ledger": {}})
    assert sorted(p.name for p in other.iterdir()) == []


def test_roots_links_renamed_into_each_others_places_are_not_followed(tmp_path: Path) -> None:
    """Root's own links are trusted under whatever name the directory's owner gives them:
    with the state and the audit log both linked elsewhere, it exchanges the two, and
    root's `hold` moves the audit log (outside the directory) aside as a corrupt state."""
    service = _service_dir(tmp_path)
    volume = tmp_path / "volume"
    volume.mkdir()
    (volume / "state.json").write_text(json.dumps({"schema": SCHEMA}))
    logs = tmp_path / "log"
    logs.mkdir()
    (logs / "audit.jsonl").write_text('{"event": "hold"}\n{"event": "readmit"}\n')
    (service / "state.json").symlink_to(volume / "state.json")  # root's
    (service / "audit.jsonl").symlink_to(logs / "audit.jsonl")  # root's
    os.rename(service / "state.json", service / "t")  # the owner exchanges them
    os.rename(service / "audit.jsonl", service / "state.json")
    os.rename(service / "t", service / "audit.jsonl")
    store = StateFile(service / "state.json")
    with contextlib.suppress(StateError), store.locked():
        store.load(identity)
    assert sorted(p.name for p in logs.iterdir()) == ["audit.jsonl"]


def test_dotdot_after_roots_directory_link_is_the_kernels(tmp_path: Path) -> None:
    """Root took ".." before following the link ahead of it (a config beside a linked
    directory: state = "../state/state.json"), and so worked on another file than the
    kernel, and every other user, reach: a fresh ledger beside the real one."""
    if os.geteuid() != 0:
        pytest.skip("as root only")
    real = tmp_path / "opt" / "llmhealth"
    (real / "etc").mkdir(parents=True)
    (real / "state").mkdir()
    (real / "state" / "state.json").write_text(json.dumps({"schema": SCHEMA, "n": 1}))
    (tmp_path / "etc").mkdir()
    (tmp_path / "etc" / "llmhealth").symlink_to(real / "etc")  # root's link, as /etc/x -> /opt/x
    (tmp_path / "etc" / "state").mkdir()  # an unrelated directory at the lexical place
    given = tmp_path / "etc" / "llmhealth" / ".." / "state" / "state.json"
    assert json.loads(Path(given).read_text())["n"] == 1  # what open() and any user reach
    store = StateFile(given)
    assert store.read(lambda doc: doc) == {"schema": SCHEMA, "n": 1}
    with store.locked():
        store.save({"n": 2})
    assert json.loads((real / "state" / "state.json").read_text())["n"] == 2
    assert sorted(p.name for p in (tmp_path / "etc" / "state").iterdir()) == []


def test_a_ledger_a_newer_llmhealth_laid_out_is_left_in_place_not_started_afresh(
    tmp_path: Path,
) -> None:
    """The ledger's layout has its own schema, to be raised on any incompatible change:
    raised alone, a rollback set the state aside as corrupt and started a fresh ledger."""
    store = StateFile(tmp_path / "state.json")
    newer = b'{"schema": 1, "ledger": {"schema": 2, "epoch": 0, "backends": []}}'
    store.path.write_bytes(newer)
    for look in (store.load, store.read):
        with store.locked(), pytest.raises(StateError) as refused:
            look(lambda document: FleetRecord.from_dict(document, LedgerPolicy()))
        assert not isinstance(refused.value, StateCorruptError)
        assert "newer llmhealth (ledger schema 2; this one reads ledger schema 1)" in str(
            refused.value
        )
    assert store.path.read_bytes() == newer
    assert sorted(p.name for p in tmp_path.iterdir()) == ["state.json", "state.json.lock"]


@pytest.mark.parametrize("kind", ["fifo", "directory"])
def test_no_lock_file_is_made_beside_what_is_not_a_state_file(tmp_path: Path, kind: str) -> None:
    # A state linked to /dev/null (state kept nowhere, an operator thought): every run was
    # refused, and each left /dev/null.lock behind, made as root in /dev.
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    if kind == "fifo":
        os.mkfifo(elsewhere / "sink")
    else:
        (elsewhere / "sink").mkdir()
    store = StateFile(tmp_path / "state.json", lock_timeout=0.5)
    store.path.symlink_to(elsewhere / "sink")
    with pytest.raises(StateError, match="not a regular file"), store.locked():
        store.load(identity)
    assert sorted(os.listdir(elsewhere)) == ["sink"]
    assert sorted(os.listdir(tmp_path)) == ["elsewhere", "state.json"]


def _refusal_as_another_user(path: Path) -> str:
    """What ``StateFile(path).locked()`` raises, taken as a user other than root: the
    class of the exception and its message."""
    if os.geteuid() != 0:
        try:
            with StateFile(path, lock_timeout=0.5).locked():
                return "locked"
        except Exception as exc:  # what escapes is the finding
            return f"{type(exc).__name__}: {exc}"
    said_r, said_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover  (the child)
        try:
            os.close(said_r)
            os.setgroups([])
            os.setgid(40123)
            os.setuid(40123)
            try:
                with StateFile(path, lock_timeout=0.5).locked():
                    said = "locked"
            except BaseException as exc:
                said = f"{type(exc).__name__}: {exc}"
            os.write(said_w, said.encode()[:4000])
        finally:
            os._exit(0)
    os.close(said_w)
    with os.fdopen(said_r, "rb") as said_file:
        said = said_file.read().decode()
    os.waitpid(pid, 0)
    return said


def test_a_state_path_that_cannot_be_looked_at_is_a_state_error(tmp_path: Path) -> None:
    # Looked at before its lock is made (not beside a FIFO or a device): a path in a
    # directory its user may not search (or beneath a file) escaped as a raw OSError, a
    # CLI verb's "internal error (the traceback above is a bug report)".
    (tmp_path / "closed").mkdir(mode=0o700)
    path = tmp_path / "closed" / "state.json"
    if os.geteuid() != 0:
        (tmp_path / "closed").chmod(0o600)
    try:
        said = _refusal_as_another_user(path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            (tmp_path / "closed").chmod(0o700)
    assert said.startswith("StateError: "), said


def test_rows_and_tables_make_only_the_rows_asked_for_and_read_back_whole() -> None:
    made: list[int] = []

    def row(item: int) -> dict[str, int]:
        made.append(item)
        return {"n": item}

    rows = Rows([1, 2, 3, 4], row)
    assert len(rows) == 4 and not made
    assert rows[1:3] == [{"n": 2}, {"n": 3}]
    assert made == [2, 3]  # a run makes its own rows, not the whole list
    table = Table({"a": 1, "b": 2}, row)
    document = {"rows": rows, "table": table}
    assert json.loads(json.dumps(document, default=plain)) == {
        "rows": [{"n": 1}, {"n": 2}, {"n": 3}, {"n": 4}],
        "table": {"a": {"n": 1}, "b": {"n": 2}},
    }
    with pytest.raises(TypeError, match="not JSON serializable"):
        plain(object())


def test_a_large_json_object_llmhealth_never_wrote_is_left_in_place_too(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Read up to the bound, a JSON object past it was never whole, and every one was
    moved aside as a corrupt state: a program's 100 MB JSON named by a slip, as root."""
    monkeypatch.setattr(state_module, "_MAX_STATE_BYTES", 1024)
    packages = ", ".join(f'"p{i}": {{"version": "1.0.{i}"}}' for i in range(100))
    content = f'{{"name": "app", "packages": {{{packages}}}}}'.encode()
    _left_in_place(StateFile(tmp_path / "package-lock.json"), content)


@pytest.mark.parametrize("cut_after", ['"sha', '"sha256-0"'])
def test_a_large_json_object_cut_within_a_key_or_before_its_colon_is_left_in_place_too(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cut_after: str
) -> None:
    """A map of many short members (a cache's hashes) is as likely cut at the bound in a
    key as in a value: the keys before it stand, and it was moved aside as corrupt."""
    monkeypatch.setattr(state_module, "_MAX_STATE_BYTES", 1024)
    head = '{"name": "'
    # A run reads one byte past the bound: the cut falls just after ``cut_after``.
    filler = "x" * (1025 - len(head) - len('", ') - len(cut_after))
    members = "".join(f', "sha256-{i}": {i}' for i in range(1, 100))
    content = f'{head}{filler}", "sha256-0": 0{members}}}'.encode()
    assert content[:1025].endswith(cut_after.encode())
    _left_in_place(StateFile(tmp_path / "cache.json"), content)


def test_a_state_cut_past_the_bound_within_its_ledger_is_still_moved_aside(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(state_module, "_MAX_STATE_BYTES", 1024)
    store = StateFile(tmp_path / "state.json")
    backends = [{"name": f"gpu{i}", "state": "healthy"} for i in range(100)]
    store.path.write_text(json.dumps({"holds": {}, "ledger": {"backends": backends}}))
    with store.locked(), pytest.raises(StateCorruptError, match="larger than 1024 bytes"):
        store.load(identity)


def test_the_size_bound_saved_is_the_bound_read_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A state of exactly the bound saves and loads; a byte more is neither saved nor,
    found on disk whole, read back."""
    monkeypatch.setattr(state_module, "_MAX_STATE_BYTES", 64)
    store = StateFile(tmp_path / "state.json")
    empty = len(b"".join(encode_pieces({"pad": "", "schema": SCHEMA})))
    with store.locked():
        store.save({"pad": "x" * (64 - empty)})
        assert store.path.stat().st_size == 64
        assert store.load(identity) == {"pad": "x" * (64 - empty), "schema": SCHEMA}
        with pytest.raises(StateError, match="more than a run reads back"):
            store.save({"pad": "x" * (65 - empty)})
    store.path.write_bytes(store.path.read_bytes() + b" ")  # whole, and a byte too large
    with store.locked(), pytest.raises(StateCorruptError, match="larger than 64 bytes"):
        store.load(identity)


@pytest.mark.parametrize("kind", ["file", "memory"])
def test_a_save_whose_before_fails_leaves_the_record_as_it_was(tmp_path: Path, kind: str) -> None:
    """``before`` makes the settle's audit records durable: failing (a full disk), the
    state must not run ahead of them."""
    store: StateFile | MemoryStore = (
        StateFile(tmp_path / "state.json") if kind == "file" else MemoryStore()
    )

    def audit_failed() -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    with store.locked():
        store.save({"n": 1})
        kept = store.mark()
        with pytest.raises((OSError, StateError)):
            store.save({"n": 2}, before=audit_failed)
        assert store.load(identity) == {"n": 1, "schema": SCHEMA}
        assert store.mark() == kept
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]


def test_both_locks_through_a_symlink_are_taken_within_one_lock_timeout(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The lock beside the link and the one beside its file share one bound (README): each
    given its own, a run waited twice as long as it was told."""
    asked: list[float] = []

    def lock_within(descriptor: int, seconds: float) -> bool:
        asked.append(seconds)
        return True

    monkeypatch.setattr(state_module, "lock_within", lock_within)
    (tmp_path / "real.json").write_bytes(b"")
    (tmp_path / "state.json").symlink_to(tmp_path / "real.json")
    with StateFile(tmp_path / "state.json", lock_timeout=5.0).locked():
        pass
    assert len(asked) == 2 and all(seconds <= 5.0 for seconds in asked)


def test_a_reader_leaves_a_corrupt_state_where_it_is(tmp_path: Path) -> None:
    """`status` takes no lock: setting the file aside is the next writer's to do."""
    store = StateFile(tmp_path / "state.json")
    store.path.write_bytes(b"{not json")
    with pytest.raises(StateCorruptError, match="left in place"):
        store.read(identity)
    assert store.path.read_bytes() == b"{not json"
    assert not [p for p in tmp_path.iterdir() if ".corrupt-" in p.name]


@pytest.mark.parametrize("note", ["9" * 30, "0", "-1", "-4194304"])
def test_a_lock_note_past_any_pid_is_not_blamed_nor_a_crash(tmp_path: Path, note: str) -> None:
    """The note is anyone's to write (a holder's own text): a number no PID can be made
    ``os.kill`` raise OverflowError, a traceback of the waiting run; 0 or a negative one
    asked it of this process group or of every process, and a live "llmhealth (PID 0)"
    was blamed."""
    store = StateFile(tmp_path / "state.json", lock_timeout=0.2)
    with store.locked():
        pass
    store.lock_path.write_text(note)
    assert "locked by a process that is not llmhealth" in refused_while_held(store)


def test_corrupt_files_set_aside_within_one_second_are_all_kept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Set aside under one second's name, each took the last one's place: records lost."""
    monkeypatch.setattr(state_module.time, "strftime", lambda _: "20260101T000000")
    store = StateFile(tmp_path / "state.json")
    contents = [b"{one", b"{two", b"{three", b"{four"]
    for content in contents:
        store.path.write_bytes(content)
        with store.locked(), pytest.raises(StateCorruptError):
            store.load(identity)
    aside = [p for p in tmp_path.iterdir() if ".corrupt-" in p.name]
    assert sorted(p.read_bytes() for p in aside) == sorted(contents)


def test_a_save_syncs_the_directory_its_rename_is_in(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The rename is durable only once its directory is: a power loss after it could
    bring the old state back, with its restarts issued again."""
    synced = directory_syncs(monkeypatch, fail=False)
    store = StateFile(tmp_path / "state.json")
    with store.locked():
        store.save({"n": 1})
    assert len(synced) == 1


@pytest.mark.parametrize("verb", ["check", "status"])
def test_a_state_path_that_is_another_states_lock_is_left_in_place(
    tmp_path: Path, verb: str
) -> None:
    # `--state state.json.lock`, a completion a key too far. The lock, empty between runs,
    # was taken for a state a crash had emptied and moved aside as corrupt (a run beside
    # it may hold it); the next such check saved a ledger in its place, renamed over the
    # lock another run held, which every run on the real state then truncated.
    state = StateFile(tmp_path / "state.json")
    with state.locked():
        state.save({"ledger": {}})
    lock = state.lock_path
    before = lock.stat()
    command = Path(sys.executable).with_name("llmhealth")
    args = ["http://127.0.0.1:9"] if verb == "check" else []
    done = subprocess.run(
        [str(command), verb, *args, "--state", str(lock)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 3, done.stderr
    assert f"is the lock file of the state {state.path}" in done.stderr
    after = lock.stat()
    assert (after.st_ino, after.st_size) == (before.st_ino, 0)
    assert sorted(os.listdir(tmp_path)) == ["state.json", "state.json.lock"]
