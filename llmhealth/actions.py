"""Remediation I/O: run a restart command, and append what was done to the audit log.

A command is an argv list run without a shell, in its own process group, bounded in time
and in the output kept. A command that cannot run is a result, not an exception. An audit
record that cannot be kept raises AuditError: the caller decides, nothing is lost silently.
"""

from __future__ import annotations

import contextlib
import errno
import json
import math
import os
import selectors
import signal
import stat
import subprocess
import sys
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Final, Protocol

from llmhealth.openfiles import (
    LOCK_TIMEOUT,
    OUT_OF_FILES,
    NotRegularFileError,
    lock_within,
    make_directories,
    open_within,
    trusted_target,
    unlock_and_close,
)
from llmhealth.text import printable

DEFAULT_OUTPUT_LIMIT: Final = 4096
KILL_GRACE: Final = 2.0  # seconds between SIGTERM and SIGKILL to a timed-out command
# Once the command has exited, its own output is already in the pipes; only a process it
# left behind can keep them open, and that one is not waited for.
_DRAIN_AFTER_EXIT: Final = 1.0
_POLL: Final = 0.1  # how often exit is checked while the pipes stay quiet
_CHUNK: Final = 65536
_MAX_DEPTH: Final = 32
# Errors starting a command that are this process's want, not the command's failing: no
# descriptor for its pipes, or no process (a pids limit, as a thread not started is in
# `watch`) or memory to fork. Not the backend's, so no restart of it that failed.
_OWN_SHORTAGE: Final = OUT_OF_FILES | {errno.EAGAIN, errno.ENOMEM}


# --- restart commands -----------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class CommandResult:
    """What one command did. ``exit_code`` is None when it never ran (the reason is in
    ``stderr``) and negative when a signal ended it, as in ``subprocess``.

    ``own_shortage``: it never ran because this process had no descriptor left for its
    pipes (``openfiles.OUT_OF_FILES``), no process or memory to fork, or no thread to run
    it in: llmhealth's own failure, no restart that failed.
    """

    argv: tuple[str, ...]
    exit_code: int | None
    timed_out: bool
    duration: float  # seconds, from start to the end of reading its output
    stdout: str
    stderr: str
    own_shortage: bool = False

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not self.timed_out

    def to_dict(self) -> dict[str, object]:
        return {
            "argv": list(self.argv),
            "exit_code": self.exit_code,
            "timed_out": self.timed_out,
            "duration": self.duration,
            "stdout": self.stdout,
            "stderr": self.stderr,
        }


def how_it_ended(result: CommandResult) -> str:
    """How a command that was not ``ok`` ended, as an operator reads it. A negative code
    is no exit status but the signal that ended it: "exited -9" was read as one, for a
    command the OOM killer or an operator's ``kill -9`` ended."""
    if result.timed_out:  # its exit code None too, when it outlived SIGKILL
        return "timed out"
    if result.exit_code is None:
        return "did not run"  # its stderr says why
    if result.exit_code >= 0:
        return f"exited {result.exit_code}"
    try:
        name = signal.Signals(-result.exit_code).name
    except ValueError:  # a real-time signal, which has no name of its own
        name = f"signal {-result.exit_code}"
    return f"was killed by {name}"


def without_keys(inherited: Mapping[str, str], secrets: Iterable[str]) -> dict[str, str]:
    """The environment for a command llmhealth runs (a restart, the serving-change hook):
    its own, less the variables some backend's ``api_key_env`` names. No such command has
    any business with a key, least of all another backend's."""
    hidden = frozenset(secrets)
    return {name: value for name, value in inherited.items() if name not in hidden}


def restart_environment(
    inherited: Mapping[str, str],
    secrets: Iterable[str],
    *,
    backend: str,
    url: str,
    reason: str,
) -> dict[str, str]:
    """A restart command's environment: no API key, and which backend to restart and why."""
    environment = without_keys(inherited, secrets)
    environment["LLMHEALTH_BACKEND"] = backend
    environment["LLMHEALTH_URL"] = url
    # An environment value cannot hold NUL, and a script may echo it: printable, bounded.
    shown = printable(reason)
    environment["LLMHEALTH_REASON"] = shown if len(shown) <= 1000 else shown[:997] + "..."
    return environment


def run_command(
    argv: Sequence[str],
    timeout: float,
    output_limit: int = DEFAULT_OUTPUT_LIMIT,
    *,
    kill_grace: float = KILL_GRACE,
    env: Mapping[str, str] | None = None,
) -> CommandResult:
    """Run ``argv`` with no shell and no stdin, for at most ``timeout`` seconds.

    Past the timeout its whole process group gets SIGTERM, then SIGKILL after
    ``kill_grace``. A command that exits in time is never killed, nor is anything it
    left running: a restart script may legitimately start the server in the background
    (it should send that server's output elsewhere, as these pipes close once the command
    has exited). Each stream keeps at most ``output_limit`` bytes, its first and last
    halves.
    """
    # A str is a Sequence[str] too; iterating one would run each character as an argument.
    if isinstance(argv, str | bytes):
        raise TypeError("argv must be a list of arguments, not a string: no shell is used")
    args = tuple(argv)
    if not args or not all(isinstance(a, str) for a in args):
        raise TypeError(f"argv must be a non-empty list of strings, got {argv!r}")
    if not (isinstance(timeout, int | float) and math.isfinite(timeout) and timeout > 0):
        raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
    if isinstance(output_limit, bool) or not isinstance(output_limit, int) or output_limit < 0:
        raise ValueError(f"output_limit must be a whole number of bytes, got {output_limit!r}")

    start = time.monotonic()
    nul = next((i for i, a in enumerate(args) if "\0" in a), None)
    if nul is not None:
        return _not_run(args, start, f"argument {nul} contains a NUL byte")
    try:
        proc = subprocess.Popen(
            args,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,  # its own group, so a timeout reaches its children
            close_fds=True,
            env=env,  # None: this process's own
        )
    except OSError as exc:  # missing, not executable, not a valid binary...
        # Or no descriptor left for its pipes, no process or memory to fork: this process's
        # want, said as such, so that it is not held against the backend as a failed
        # restart (remediate.hear_commands).
        own = exc.errno in _OWN_SHORTAGE
        return _not_run(args, start, exc.strerror or str(exc), own_shortage=own)
    except ValueError as exc:  # an environment no process can be given (a NUL in a value)
        return _not_run(args, start, f"its environment cannot be passed: {exc}")

    out, err = _Capture(output_limit), _Capture(output_limit)
    assert proc.stdout is not None and proc.stderr is not None  # both are PIPE above
    streams: dict[IO[bytes], _Capture] = {proc.stdout: out, proc.stderr: err}
    notes: list[str] = []
    try:
        _collect(proc, streams, start + timeout)
        timed_out = proc.poll() is None
        if timed_out:
            notes += _stop_group(proc, kill_grace)
            # What the group wrote before it died is still in the pipes.
            _collect(proc, streams, time.monotonic() + _DRAIN_AFTER_EXIT)
        if any(not f.closed for f in streams):
            notes.append("output still held open by a process the command started; stopped reading")
    except BaseException:
        # Interrupted (KeyboardInterrupt, a bug): do not leave the command running unowned.
        _signal_group(proc.pid, signal.SIGKILL)
        raise
    finally:
        for f in streams:
            f.close()
        _reap(proc)
    stderr = err.text()
    if notes:
        # Our own lines are tagged, so the audit log tells them from the command's.
        tagged = "\n".join(f"[llmhealth: {note}]" for note in notes)
        stderr += ("\n" if stderr and not stderr.endswith("\n") else "") + tagged
    return CommandResult(
        argv=args,
        exit_code=proc.returncode,
        timed_out=timed_out,
        duration=time.monotonic() - start,
        stdout=out.text(),
        stderr=stderr,
    )


class _Capture:
    """One stream's first and last bytes, at most ``limit`` in all; the middle is counted
    and dropped. The tail is kept because a failing command usually says why at its end."""

    def __init__(self, limit: int) -> None:
        self._tail_limit = limit // 2
        self._head_limit = limit - self._tail_limit
        self._head = bytearray()
        self._tail = bytearray()
        self._total = 0

    def add(self, chunk: bytes) -> None:
        self._total += len(chunk)
        room = self._head_limit - len(self._head)
        if room > 0:
            self._head += chunk[:room]
            chunk = chunk[room:]
        if chunk and self._tail_limit:
            self._tail += chunk[-self._tail_limit :]
            del self._tail[: -self._tail_limit]

    def text(self) -> str:
        head = self._head.decode("utf-8", errors="replace")
        tail = self._tail.decode("utf-8", errors="replace")
        omitted = self._total - len(self._head) - len(self._tail)
        if omitted == 0:  # one text: a character may straddle the two halves
            return (self._head + self._tail).decode("utf-8", errors="replace")
        return f"{head}\n[... {omitted} bytes omitted ...]\n{tail}"


def _collect(
    proc: subprocess.Popen[bytes], streams: Mapping[IO[bytes], _Capture], deadline: float
) -> None:
    """Read every open stream until each reaches EOF, the deadline passes, or the command
    has exited and the short drain after it is over. A stream at EOF is closed."""
    with selectors.DefaultSelector() as selector:
        for f, capture in streams.items():
            if not f.closed:
                selector.register(f, selectors.EVENT_READ, (f, capture))
        exited_at: float | None = None
        while selector.get_map():
            now = time.monotonic()
            if exited_at is None and proc.poll() is not None:
                exited_at = now
            until = deadline if exited_at is None else min(deadline, exited_at + _DRAIN_AFTER_EXIT)
            if now >= until:
                return
            for key, _ in selector.select(min(until - now, _POLL)):
                f, capture = key.data
                data = os.read(key.fd, _CHUNK)
                if data:
                    capture.add(data)
                else:
                    selector.unregister(f)
                    f.close()
    # Both streams closed, yet the command may still run (it closed them itself).
    if proc.poll() is None:
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(max(deadline - time.monotonic(), 0))


def _stop_group(proc: subprocess.Popen[bytes], grace: float) -> list[str]:
    """SIGTERM the command's process group, then SIGKILL whatever is left after ``grace``.
    Returns notes for stderr about signals that could not be sent."""
    pgid = proc.pid  # start_new_session made the command the leader of its own group
    notes = [f"timed out: sent SIGTERM to process group {pgid}"]
    problem = _signal_group(pgid, signal.SIGTERM)
    if problem:
        return [*notes, problem]
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline:
        proc.poll()  # reap the leader, so a dead leader no longer counts as a member
        if not _group_alive(pgid):
            return notes
        time.sleep(0.02)
    # Sent only while the group still has members: a process group ID cannot be reused
    # while any member lives, so this cannot reach an unrelated process.
    notes.append(f"still running {grace:g}s after SIGTERM: sent SIGKILL")
    problem = _signal_group(pgid, signal.SIGKILL)
    if problem:
        notes.append(problem)
    return notes


def _signal_group(pgid: int, sig: signal.Signals) -> str | None:
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        return None
    except PermissionError:
        # e.g. a setuid program such as sudo, when llmhealth does not run as root.
        return f"not permitted to send {sig.name} to process group {pgid}"
    return None


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _reap(proc: subprocess.Popen[bytes]) -> None:
    # Bounded only for a process that outlives SIGKILL (stuck in the kernel): a hung
    # health checker is worse, and returncode then stays None and says so.
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(KILL_GRACE if proc.poll() is None else None)


def _not_run(
    args: tuple[str, ...], start: float, why: str, *, own_shortage: bool = False
) -> CommandResult:
    return CommandResult(
        argv=args,
        exit_code=None,
        timed_out=False,
        duration=time.monotonic() - start,
        stdout="",
        stderr=f"cannot run {args[0]!r}: {why}",
        own_shortage=own_shortage,
    )


# --- the audit log --------------------------------------------------------------------


class AuditError(Exception):
    """The audit log could not be written or read; for a write, the record was not kept."""


class Audit(Protocol):
    """Where a settle's or a verb's audit records go: ``AuditLog`` (a local file), or a
    cluster's etcd trail (``cluster.EtcdAudit``), whose records are written in the same
    fenced transaction as the state they led to."""

    def append(self, record: Mapping[str, object]) -> None: ...

    def batch(self) -> contextlib.AbstractContextManager[None]: ...


class AuditLog:
    """An append-only JSON-lines file: one object per line, one ``write`` per record (per
    batch inside ``batch``).

    Fields by convention (only ``time`` is filled in here; the rest are the caller's):

    - ``time``: unix seconds; the record's own, else the moment of the append
    - ``actor``: who acted, e.g. ``llmhealth``, ``operator:alice``, ``trainer``
    - ``backend``: the backend's name
    - ``event``: what happened: ``restart``, ``retire``, ``hold``, ``readmit``, ...
    - ``from``, ``to``: ledger states before and after
    - ``reason``: the sentence from the ledger or the restart plan
    - ``evidence``: the verdict's evidence that proved it
    - ``argv``: for an issued ``restart``, the command about to run
    - ``command``: for a ``restart_command`` (how it went, written once it finished),
      ``CommandResult.to_dict()``
    - ``dry_run``: true when it was decided and logged but not done

    Values JSON cannot hold are written as text (NaN as ``"nan"``, an object as its
    ``to_dict()`` or ``str()``), so a record is never refused for its evidence.
    """

    def __init__(self, path: str | os.PathLike[str], lock_timeout: float = LOCK_TIMEOUT) -> None:
        self.path = Path(path)
        self.lock_timeout = lock_timeout
        self._pending: list[bytes] | None = None  # an open batch's lines, not yet written
        # A batch's encoded container values by identity (encode_record); a record's
        # values are not changed while its batch is open.
        self._shared: dict[int, tuple[object, str]] | None = None
        # Where the last batch's write landed (``take_back_batch``), until the next batch.
        self._landed: _Landed | None = None

    @contextlib.contextmanager
    def batch(self) -> Iterator[None]:
        """Appends inside are written together when the batch ends, by one write and one
        fsync (AuditError if that write or fsync fails). A batch inside a batch is part
        of it. A batch ended by an exception writes nothing: it is a settle that saves
        nothing, and the next settle decides again from the state as it was and writes
        its own records (kept, they said a restart was issued that never was, once per
        settle while the disk stayed full).

        A settle that proves 750 wedges writes 1,500 records; one fsync each took
        seconds on a busy disk, inside the settle, and one open, lock and write each
        was still about a tenth of a second of its CPU. None of them is durable before
        the fsync anyway, so holding them until then loses nothing a crash would have
        kept. The settle ends its batch once the new state is on disk under its
        temporary name and before that replaces the old (``Store.save``'s ``before``),
        so no saved state ever runs ahead of its audit records, and a disk too full for
        the state stops the settle before any of its records are written.
        """
        if self._pending is not None:
            yield
            return
        self._pending = []
        self._shared = {}
        self._landed = None
        try:
            yield
        except BaseException:
            self._pending = self._shared = None
            raise
        lines, self._pending, self._shared = self._pending, None, None
        if lines:
            self._landed = self._write(b"".join(lines), len(lines))

    def take_back_batch(self) -> None:
        """Cut the last batch's records back out of the log: the state they led to was
        written aside and then not put in place (its rename refused after they were made
        durable: a state file that is a mount of its own, as a container's single-file
        volume is, or an immutable one). Kept, the trail said a verb was applied, or a
        restart issued, that never was, once more at every try. Only while the log still
        ends where that write ended, in the same file: records appended since, by a
        writer that takes no lock, stay, and with them ours. Best effort: the caller
        already fails for its state."""
        landed, self._landed = self._landed, None
        if landed is None:
            return
        deadline = time.monotonic() + self.lock_timeout
        try:
            fd = open_within(
                trusted_target(self.path),
                os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW,
                0,
                self.lock_timeout,
            )
        except OSError:
            return
        try:
            if lock_within(fd, max(0.0, deadline - time.monotonic())):
                status = os.fstat(fd)
                if (status.st_dev, status.st_ino, status.st_size) == (
                    landed.device,
                    landed.inode,
                    landed.end,
                ):
                    os.ftruncate(fd, landed.start)
                    os.fsync(fd)
        except OSError:
            pass
        finally:
            unlock_and_close(fd)

    def append(self, record: Mapping[str, object]) -> None:
        """Write one record durably (fsync, or at the end of a batch) or raise AuditError."""
        line = encode_record(record, self._shared)
        if self._pending is not None:
            self._pending.append(line)
        else:
            self._write(line, 1)

    def _write(self, lines: bytes, count: int) -> _Landed:
        kept = (
            "the record was not kept" if count == 1 else f"not all of its {count} records were kept"
        )
        # One bound for the lease and the lock together, as for the state's (README): each
        # given its own, a lease broken late and a flock after it held a settle, and the
        # state lock with it, twice as long.
        deadline = time.monotonic() + self.lock_timeout
        try:
            # Where its links lead (as root, only where nobody else can redirect it),
            # opened there without following a link swapped in since. Checked before any
            # directory is made: a missing parent made through another user's link was
            # made wherever that link led.
            path = trusted_target(self.path)
            make_directories(self.path.parent)
            # Read as well as written: the last byte says whether a torn line needs ending.
            # Not waiting on a lease longer than on the lock (openfiles.open_within).
            fd = open_within(
                path,
                os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW,
                0o640,
                max(0.0, deadline - time.monotonic()),
            )
        except OSError as exc:
            raise AuditError(f"{self.path}: cannot open the audit log: {_why(exc)}") from exc
        if not stat.S_ISREG(os.fstat(fd).st_mode):  # a FIFO its directory's owner made
            os.close(fd)
            raise AuditError(f"{self.path}: the audit log is not a regular file")
        try:
            # O_APPEND keeps each write whole on a local filesystem; the lock keeps it whole
            # on the others too, and for records larger than one atomic write.
            self._lock(fd, kept, max(0.0, deadline - time.monotonic()))
            size = os.fstat(fd).st_size
            lines = _after_a_torn_line(fd) + lines
            written = os.write(fd, lines)
            if written != len(lines):
                _take_back(fd, size, size + written)
                raise AuditError(
                    f"{self.path}: short write ({written} of {len(lines)} bytes, disk "
                    f"full?); {kept}"
                )
            try:
                os.fsync(fd)
            except OSError as exc:
                _take_back(fd, size, size + written)
                raise AuditError(
                    f"{self.path}: cannot make the records durable: {_why(exc)}"
                ) from exc
            if size == 0:
                # A new log's entry, or one whose first records were cut back below
                # (the file stays, empty): told by its size under the lock, not by its
                # existence before the open, which took such a log for an old one and
                # synced no directory for the records of the retry.
                # Cut back as for a failed fsync, under the lock: kept while the caller
                # took the records for unwritten, its state unsaved, they were written
                # again by the next try.
                try:
                    _fsync_dir(path.parent)
                except AuditError:
                    _take_back(fd, size, size + written)
                    raise
            status = os.fstat(fd)
            return _Landed(status.st_dev, status.st_ino, size, size + written)
        except OSError as exc:
            raise AuditError(f"{self.path}: cannot write the audit log: {_why(exc)}") from exc
        finally:
            unlock_and_close(fd)

    def _lock(self, fd: int, kept: str, seconds: float) -> None:
        """Take the log's exclusive lock within ``seconds`` (what the open left of
        ``lock_timeout``). Anything may flock it (a backup, a log shipper): waited for
        without end, every writer hung behind it while holding the state lock, and the
        daemon stopped petting the watchdog."""
        if not lock_within(fd, seconds):
            raise AuditError(
                f"{self.path}: the audit log is locked by another process (a backup or "
                f"log shipper holding flock on it?); gave up after "
                f"{self.lock_timeout:g} s; {kept}"
            )


@dataclass(frozen=True, slots=True)
class _Landed:
    """Where a write went: the log's file (device, inode), its size before the write,
    and after it."""

    device: int
    inode: int
    start: int
    end: int


def _after_a_torn_line(fd: int) -> bytes:
    """A newline when the log ends inside a line, else nothing.

    A short write on a full disk leaves a fragment, and the newline meant to end it fails
    too while the disk stays full: the next record would be glued onto it and skipped as
    malformed, a verb that was done missing from the trail.
    """
    size = os.fstat(fd).st_size
    if size and os.pread(fd, 1, size - 1) != b"\n":
        return b"\n"
    return b""


@dataclass(frozen=True, slots=True)
class AuditScan:
    records: list[dict[str, object]]
    malformed: int  # lines that were not a JSON object (a torn write, a hand edit)
    missing: bool = False  # no log there: nothing written yet, or the wrong path


# The longest audit line read whole, as the state file's bound: a record of one
# backend's proof is kilobytes; only a torn or corrupt tail comes near it.
MAX_AUDIT_LINE: Final = 64 * 1024 * 1024


def parse_records(
    lines: Iterable[bytes],
    last: int | None = None,
    each: Callable[[dict[str, object]], None] | None = None,
) -> AuditScan:
    """Audit records from JSON lines, oldest first; only the ``last`` ones if given.

    One rule for every place a trail is kept (the local file, etcd's audit keys):
    blank lines are passed over, and a line that is not a JSON object (a torn write, a
    hand edit, one nested thousands deep, or a number JSON has not: ``NaN``, ``1e999``)
    is skipped and counted, never fatal.

    ``each``: every record is handed to it, oldest first, and none kept in ``records``;
    without ``last`` as soon as it is read. A local log is never rotated, and one held
    whole as dicts took seven times its size (2.3 GB for 300 MB) before `audit` printed
    its first line.
    """
    # More than a deque can hold is more than any trail has: all of them.
    keep: deque[dict[str, object]] = deque(maxlen=None if last is None else min(last, sys.maxsize))
    malformed = 0
    for raw in lines:
        if not raw.strip():
            continue
        try:
            value = json.loads(raw, parse_constant=_no_constant, parse_float=_finite)
        except (ValueError, RecursionError):  # ValueError includes UnicodeDecodeError
            malformed += 1
            continue
        if not isinstance(value, dict):
            malformed += 1
        elif each is not None and last is None:
            each(value)
        else:
            keep.append(value)
    if each is not None:
        for record in keep:
            each(record)
        keep.clear()
    return AuditScan(list(keep), malformed)


def _no_constant(name: str) -> object:
    raise ValueError(f"{name} is not a JSON number")


def _finite(text: str) -> float:
    """A JSON number as a float, refused past a float's range: printed again it would be
    ``Infinity``, which strict JSON parsers reject."""
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"{text[:20]} is past a float's range")
    return value


def scan(
    path: str | os.PathLike[str],
    last: int | None = None,
    each: Callable[[dict[str, object]], None] | None = None,
) -> AuditScan:
    """The records of an audit log, oldest first; only the ``last`` ones if given. A log
    not yet written is empty; malformed lines are skipped and counted. ``each``: as for
    ``parse_records``, the records handed to it as they are read."""
    try:
        # As root, only where nobody else can redirect it (the log beside the state is in
        # the service's directory), and never a FIFO or a device: opened without waiting
        # and without following a link swapped in since.
        target = trusted_target(Path(path))
        if not stat.S_ISREG(os.stat(target, follow_symlinks=False).st_mode):
            raise NotRegularFileError("not a regular file")
        fd = os.open(
            target, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC | os.O_NOFOLLOW
        )
    except FileNotFoundError:
        return AuditScan([], 0, missing=True)
    except OSError as exc:
        raise AuditError(f"{path}: cannot read the audit log: {_why(exc)}") from exc
    with open(fd, "rb") as f:
        # Only the reading's errors are the log's: one of ``each`` (its reader gone) is not.
        return parse_records(_lines_read(f, path), last, each)


def _lines_read(handle: IO[bytes], path: str | os.PathLike[str]) -> Iterator[bytes]:
    """``_lines_within`` the audit log's bound, each failure to read it an AuditError."""
    try:
        if not stat.S_ISREG(os.fstat(handle.fileno()).st_mode):
            raise NotRegularFileError("not a regular file")
        yield from _lines_within(handle, MAX_AUDIT_LINE)
    except OSError as exc:
        raise AuditError(f"{path}: cannot read the audit log: {_why(exc)}") from exc


def _lines_within(handle: IO[bytes], limit: int) -> Iterator[bytes]:
    """The file's lines, none held longer than ``limit`` bytes: the rest of a longer one
    is passed over in pieces and the line given as malformed. A crash can leave a tail of
    NUL bytes without a newline (gigabytes, on ext4 or XFS), and ``audit --last 1`` held
    it whole: 3.1 GB resident for a 1.5 GB tail."""
    while line := handle.readline(limit + 1):
        if len(line) <= limit or line.endswith(b"\n"):
            yield line
            continue
        while (rest := handle.readline(limit)) and not rest.endswith(b"\n"):
            pass
        yield b"\x00"  # not JSON: counted as malformed


def read(path: str | os.PathLike[str]) -> list[dict[str, object]]:
    """Every well-formed record of an audit log, oldest first."""
    return scan(path).records


def encode_record(
    record: Mapping[str, object], shared: dict[int, tuple[object, str]] | None = None
) -> bytes:
    """One audit record as a JSON line (``time`` first), as every audit trail keeps it.

    ``shared``: the JSON text of container values already encoded, by identity, for a
    batch whose records share them: a settle that condemns 750 wedges writes each proof
    twice (the ledger's move and the restart decision), and encoding a proof's reads was
    most of that settle's audit cost. Each field is encoded alone and the line joined
    from them, which is byte for byte what encoding the whole object at once writes.
    """
    if not isinstance(record, Mapping):
        raise AuditError(f"an audit record must be a mapping, got {type(record).__name__}")
    fields = {str(key): value for key, value in record.items()}
    stamp = fields.pop("time", None)
    stamp = time.time() if stamp is None else _plain(stamp, 1)
    if isinstance(stamp, bool) or not isinstance(stamp, int | float):
        raise AuditError(f"audit record time must be unix seconds, got {stamp!r}")
    parts = [f'"time": {_JSON.encode(stamp)}']
    for key, value in fields.items():
        known = shared.get(id(value)) if shared is not None else None
        text = known[1] if known is not None and known[0] is value else _scalar_text(value)
        if text is None:
            text = _JSON.encode(_plain(value, 1))
            if shared is not None and isinstance(value, Mapping | list | tuple):
                shared[id(value)] = (value, text)  # held, so its id is not reused
        parts.append(f"{_ascii_text(key)}: {text}")
    return ("{" + ", ".join(parts) + "}").encode("ascii") + b"\n"


# ensure_ascii: any str, even one holding lone surrogates, becomes encodable bytes.
_JSON: Final = json.JSONEncoder(ensure_ascii=True, allow_nan=False)
_ascii_text: Final = json.encoder.encode_basestring_ascii  # what _JSON writes for a str
# What JSON holds as it is: most of a record's fields and of its proof's values. A settle
# that condemns 2,500 wedges writes 5,000 records in one batch, and a call of `_plain`
# per leaf and of the encoder per field were a quarter of their CPU (2,250 records:
# 0.055 s, 0.041 s without them). Known by the identity of their exact type, so no
# class's own __eq__ or __hash__ is asked; a subclass takes the walk, to the same text.
_AS_IS: Final = frozenset(map(id, (str, int, bool, type(None))))


def _scalar_text(value: object) -> str | None:
    """The JSON text _JSON writes for a str, int, bool, None or finite float, written
    the way its C encoder writes them; None for any other value."""
    if type(value) is str:
        return _ascii_text(value)
    if type(value) is bool:
        return "true" if value else "false"
    if type(value) is int:
        return int.__repr__(value)
    if type(value) is float and math.isfinite(value):
        return float.__repr__(value)
    return "null" if value is None else None


def _plain(value: object, depth: int) -> object:
    """``value`` as JSON can hold it; see AuditLog for what becomes text."""
    if value is None or isinstance(value, bool | int | str):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else str(value)
    if depth > _MAX_DEPTH:
        return str(value)  # a cycle, or nesting no reader wants
    # Leaves JSON holds as they are stay where they are, with no call of their own.
    if isinstance(value, dict | Mapping):
        return {
            str(k): v
            if id(type(v)) in _AS_IS or (type(v) is float and math.isfinite(v))
            else _plain(v, depth + 1)
            for k, v in value.items()
        }
    if isinstance(value, list | tuple | set | frozenset | deque):
        return [
            v
            if id(type(v)) in _AS_IS or (type(v) is float and math.isfinite(v))
            else _plain(v, depth + 1)
            for v in value
        ]
    to_dict = getattr(value, "to_dict", None)
    if callable(to_dict):
        return _plain(to_dict(), depth + 1)
    return str(value)


def _take_back(fd: int, size: int, ours_end: int) -> None:
    """Cut the log back to ``size``, under its lock, after a write that failed: the
    batch's whole records kept said a restart was issued that was never saved nor run,
    and the settle made again wrote them a second time. Only if what follows ``size`` is
    all ours (``ours_end``): a writer that takes no lock (a shell's ``>>``) may have
    appended meanwhile. Else, or if the cut fails, the fragment is at least ended, so
    readers skip it as malformed instead of merging it with the next record (or the
    next append ends it: ``_after_a_torn_line``)."""
    try:
        if os.fstat(fd).st_size != ours_end:
            raise OSError("another writer appended")
        os.ftruncate(fd, size)
    except OSError:
        with contextlib.suppress(OSError):
            os.write(fd, b"\n")


def _fsync_dir(path: Path) -> None:
    # Makes a new log's directory entry durable too; best effort, as some filesystems
    # refuse to open or fsync a directory and the record itself is already on disk.
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError as exc:
        if exc.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EBADF):
            raise AuditError(f"{path}: cannot sync the audit log's directory: {_why(exc)}") from exc
    finally:
        os.close(fd)


def _why(exc: OSError) -> str:
    return exc.strerror or str(exc)
