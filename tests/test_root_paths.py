"""Root over a directory another user owns: the audit verb and the audit append go only
where nobody else can redirect them (llmhealth.openfiles.trusted_target), never into a
FIFO or a device, and no file lease of the owner's holds root's run past its bounds.
The state file's side is in test_state.py."""

from __future__ import annotations

import contextlib
import fcntl
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from llmhealth import state as state_module
from llmhealth.actions import AuditError, AuditLog
from llmhealth.cli import app
from llmhealth.state import StateError, StateFile

SOMEONE_ELSE = 40123


def _as_root() -> None:
    if os.geteuid() != 0:
        pytest.skip("as root only")


def _service_dir(parent: Path, mode: int = 0o755) -> Path:
    _as_root()
    service = parent / "service"
    service.mkdir()
    service.chmod(mode)
    os.chown(service, SOMEONE_ELSE, SOMEONE_ELSE)
    return service


def _their_link(link: Path, target: Path | str) -> None:
    link.symlink_to(target)
    os.lchown(link, SOMEONE_ELSE, SOMEONE_ELSE)


def test_the_audit_verb_as_root_never_reads_through_the_service_users_link(tmp_path: Path) -> None:
    """`sudo llmhealth audit` (default audit log beside the state) opens whatever the
    directory's owner linked audit.jsonl to: a file of root's is read and printed, a
    FIFO or /dev/zero would hang it, a device is opened (acted on)."""
    service = _service_dir(tmp_path)
    secret = tmp_path / "root-only" / "secret.jsonl"
    secret.parent.mkdir(mode=0o700)
    secret.write_text('{"api_key": "root-only-secret"}\n')
    secret.chmod(0o600)
    _their_link(service / "audit.jsonl", secret)
    result = CliRunner().invoke(app, ["audit", "--state", str(service / "state.json")])
    assert "root-only-secret" not in result.stdout


def test_the_audit_verb_never_waits_on_a_fifo_the_owner_planted(tmp_path: Path) -> None:
    """Not a regular file: never waited on (the README's promise for the state). The
    owner's FIFO at audit.jsonl, held open by a writer of its own: `audit` hangs."""
    service = _service_dir(tmp_path)
    fifo = service / "audit.jsonl"
    os.mkfifo(fifo)
    os.chown(fifo, SOMEONE_ELSE, SOMEONE_ELSE)
    writer = os.open(fifo, os.O_RDWR | os.O_NONBLOCK)  # the owner's writer, never ending
    os.write(writer, b"x")
    try:
        run = subprocess.run(
            [
                sys.executable,
                "-c",
                "from llmhealth.cli import main; main()",
                "audit",
                "--state",
                str(service / "state.json"),
            ],
            capture_output=True,
            timeout=10,
            check=False,
        )
        hung = False
    except subprocess.TimeoutExpired:
        hung = True
    finally:
        os.close(writer)
    assert not hung
    assert run.returncode != 0


def test_no_directory_is_made_for_the_audit_log_before_its_path_is_checked(tmp_path: Path) -> None:
    """An audit_log two levels under the service's directory: its owner makes the first
    a link to a directory of root's, and root's append creates a directory there before
    trusted_target refuses the path."""
    service = _service_dir(tmp_path)
    etc = tmp_path / "etc"  # root's, root's alone
    etc.mkdir()
    _their_link(service / "logs", etc)
    log = AuditLog(service / "logs" / "llmhealth" / "audit.jsonl")
    with pytest.raises(AuditError, match="owned by uid"):
        log.append({"event": "hold"})
    assert sorted(p.name for p in etc.iterdir()) == []


def test_a_service_directory_its_owner_may_rename_is_refused_as_root(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """_root_alone accepts a sticky directory others may write ("nobody else may rename
    what root made"), but the file's own directory is the service's, not root's: in a
    sticky directory its owner may still rename it, and swap in a link of its own (no
    fs.protected_symlinks for a directory that is not world-writable). The swap lands
    after trusted_target looked: here at once, as a loop of renames sometimes does."""
    _as_root()
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chown(shared, 0, SOMEONE_ELSE)
    shared.chmod(0o1770)  # root:svc, sticky, group-writable: e.g. a spool
    service = shared / "svc"
    service.mkdir()
    os.chown(service, SOMEONE_ELSE, SOMEONE_ELSE)
    victim_dir = tmp_path / "root-only"
    victim_dir.mkdir()
    (victim_dir / "state.json").write_text('{"root": "x:0:0"}\n')
    store = StateFile(service / "state.json")
    real = state_module.trusted_target

    def then_swapped(path: Path) -> Path:
        if service.is_symlink():  # the owner puts its directory back for each look,
            service.unlink()
            os.rename(shared / "old", service)
        found = real(path)
        os.rename(service, shared / "old")  # and once it is looked at, renames it away
        _their_link(service, victim_dir)  # with its own link in its place
        return found

    monkeypatch.setattr(state_module, "trusted_target", then_swapped)
    with contextlib.suppress(StateError), store.locked():
        store.load(lambda doc: doc)
    # Root's file was moved aside as corrupt, and a lock made beside it.
    assert sorted(p.name for p in victim_dir.iterdir()) == ["state.json"]
    assert (victim_dir / "state.json").read_text() == '{"root": "x:0:0"}\n'


def test_the_audit_append_never_writes_into_a_fifo(tmp_path: Path) -> None:
    """No regular-file check after the open (the lock file and the state have one): a
    FIFO at audit.jsonl takes root's records (the owner reads them) and a batch past the
    pipe's 64 KiB blocks the writer for ever, the state lock held."""
    service = _service_dir(tmp_path)
    fifo = service / "audit.jsonl"
    os.mkfifo(fifo)
    os.chown(fifo, SOMEONE_ELSE, SOMEONE_ELSE)
    log = AuditLog(fifo)
    outcome: list[object] = []

    def append() -> None:
        try:
            log.append({"event": "hold", "reason": "x" * 100_000})
            outcome.append("written")
        except AuditError as exc:
            outcome.append(exc)

    thread = threading.Thread(target=append, daemon=True)
    thread.start()
    thread.join(5)
    blocked = thread.is_alive()
    if blocked:  # let it go: drain the pipe as its owner would
        drain = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
        while thread.is_alive():
            with contextlib.suppress(BlockingIOError):
                os.read(drain, 1 << 16)
        os.close(drain)
    assert not blocked
    assert isinstance(outcome[0], AuditError)


class _Holder:
    """A process of the directory's owner holding a read lease on a file of its own."""

    def __init__(self, pid: int) -> None:
        self.pid = pid

    def kill(self) -> None:
        os.kill(self.pid, signal.SIGKILL)

    def wait(self) -> None:
        os.waitpid(self.pid, 0)


def _their_leased_file(path: Path) -> _Holder:
    """The directory's owner makes ``path`` its own file and holds a read lease on it."""
    if os.geteuid() != 0:
        pytest.skip("as root only")
    path.write_text("")
    os.chown(path, SOMEONE_ELSE, SOMEONE_ELSE)
    ready_r, ready_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the owner: its uid, its own file, a read lease, then wait to be killed
        try:
            signal.signal(signal.SIGIO, signal.SIG_IGN)  # a lease break would end it
            # Opened before the uid is dropped only because pytest's tmp_path is 0700:
            # the directory's owner opens its own file in its own directory.
            fd = os.open(path, os.O_RDONLY)
            os.setgroups([])
            os.setgid(SOMEONE_ELSE)
            os.setuid(SOMEONE_ELSE)
            fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_RDLCK)
            os.write(ready_w, b"leased")
            while True:
                time.sleep(60)
        finally:
            os._exit(1)
    os.close(ready_w)
    said = os.read(ready_r, 16)
    os.close(ready_r)
    assert said == b"leased"
    return _Holder(pid)


def _within(seconds: float, work: object) -> tuple[bool, float, list[object]]:
    outcome: list[object] = []

    def run() -> None:
        try:
            outcome.append(work())  # type: ignore[operator]
        except (StateError, AuditError) as exc:
            outcome.append(exc)

    started = time.monotonic()
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    return thread.is_alive(), time.monotonic() - started, outcome


def test_a_lease_on_the_lock_file_never_holds_root_past_the_lock_timeout(tmp_path: Path) -> None:
    service = _service_dir(tmp_path)
    holder = _their_leased_file(service / "state.json.lock")
    store = StateFile(service / "state.json", lock_timeout=1.0)

    def lock_once() -> str:
        with store.locked():
            return "held"

    try:
        hung, _, outcome = _within(5.0, lock_once)
    finally:
        holder.kill()  # the lease goes with its holder: root's open goes on
        holder.wait()
    assert not hung, "root's lock open waited on the owner's lease (lease-break-time)"
    assert isinstance(outcome[0], StateError)


def test_a_lease_on_the_audit_log_never_holds_roots_append_past_its_bound(tmp_path: Path) -> None:
    service = _service_dir(tmp_path)
    holder = _their_leased_file(service / "audit.jsonl")
    log = AuditLog(service / "audit.jsonl", lock_timeout=1.0)
    try:
        hung, _, outcome = _within(5.0, lambda: log.append({"event": "hold"}))
    finally:
        holder.kill()
        holder.wait()
    assert not hung, "root's audit open waited on the owner's lease (lease-break-time)"
    assert isinstance(outcome[0], AuditError)
