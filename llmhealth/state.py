"""The state file: one JSON document, replaced atomically, held under an exclusive lock.

A run holds the lock from its first read of the state to its last write, so two checks on
one fleet never both act. A file that cannot be read back is moved aside, never deleted
and never silently replaced: it is the only record of what the fleet went through. The
state, its temp file and the lock are the owner's alone (0600) whatever the umask: the
state holds every backend's URL and evidence.
"""

from __future__ import annotations

import codecs
import contextlib
import glob
import json
import os
import re
import stat
import tempfile
import threading
import time
from collections.abc import Callable, Hashable, Iterator, Mapping
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any, Protocol, TypeVar

from llmhealth.ledger import SCHEMA as LEDGER_SCHEMA
from llmhealth.openfiles import (
    LOCK_TIMEOUT,
    lock_beside,
    lock_within,
    make_directories,
    open_within,
    read_regular_file,
    trusted_target,
    unlock_and_close,
)
from llmhealth.rows import Rows, Table
from llmhealth.text import printable

SCHEMA = 1
_MAX_STATE_BYTES = 64 * 1024 * 1024

T = TypeVar("T")


class StateError(Exception):
    """The state could not be used; the run must stop with UNKNOWN and this message."""


class StateLockedError(StateError):
    pass


class StateCorruptError(StateError):
    pass


class RecordMovedError(StateError):
    """Another writer saved between this section's load and its save (a cluster leader's
    settle, beside an operator's verb): nothing was written, and the same change may be
    made again on the record as it is now."""


# What a stored record that cannot be used raises in decode_record: JSONDecodeError and
# UnicodeDecodeError are ValueErrors; deeply nested JSON raises RecursionError and a huge
# integer can raise OverflowError in a validator.
UNREADABLE = (ValueError, RecursionError, OverflowError)


def decode_record(raw: bytes, decode: Callable[[dict[str, Any]], T], where: str) -> T:
    """A stored record, read the same way from every store: a JSON object of our SCHEMA.

    Raises one of UNREADABLE; the store sets such a record aside. A record of a newer
    schema raises StateError instead and stays where it is: a newer llmhealth wrote it
    (an upgrade rolled back, a cluster member upgraded first), and set aside as corrupt
    it was replaced by a fresh ledger, a retired backend serving again, a hold gone.
    """
    document = json.loads(raw)
    if not isinstance(document, dict):
        raise ValueError("not a JSON object")
    schema = document.get("schema")
    # The ledger's layout has a schema of its own, bumped "on any incompatible change":
    # newer, it is as much a newer llmhealth's as a newer document.
    ledger = document.get("ledger")
    inner = ledger.get("schema") if isinstance(ledger, dict) else None
    for found, reads, of in ((schema, SCHEMA, ""), (inner, LEDGER_SCHEMA, "ledger ")):
        if isinstance(found, int) and not isinstance(found, bool) and found > reads:
            raise StateError(
                f"state {where} was written by a newer llmhealth ({of}schema {found}; this "
                f"one reads {of}schema {reads}): left in place; run the newer version, or "
                "move it aside to start a fresh ledger"
            )
    if schema != SCHEMA:
        raise ValueError(f"schema {schema!r}, expected {SCHEMA}")
    return decode(document)


def given_path(value: str) -> Path:
    """A state path someone gave. An empty one is refused rather than taken for none given:
    a script's unset variable would otherwise lock and rewrite the default (system-wide)
    state, forgetting every backend the call did not name."""
    if not value.strip():
        raise ValueError("an empty state path: name a file, or leave it out")
    path = Path(value)
    if not path.name:  # "/", ".": no file to lock beside, nor an audit log to put beside it
        raise ValueError(f"{value!r} names a directory, not a state file")
    if os.path.isdir(path):
        # `--state /var/lib/llmhealth`, the state's directory: read as a state it failed,
        # after a lock file was made beside it.
        raise ValueError(
            f"{value!r} is a directory, not a state file (the file in it, e.g. "
            f"{str(path / 'state.json')!r})"
        )
    return path


def default_path(environ: dict[str, str] | None = None) -> Path:
    """systemd's StateDirectory, else the system state dir for root, else the user's."""
    env = os.environ if environ is None else environ
    if env.get("STATE_DIRECTORY"):
        # systemd may pass several directories separated by ':'; the first is ours.
        return Path(env["STATE_DIRECTORY"].split(":")[0]) / "state.json"
    if os.geteuid() == 0:
        return Path("/var/lib/llmhealth/state.json")
    base = env.get("XDG_STATE_HOME")
    # A relative one is no base at all (the XDG spec: "consider the path invalid and
    # ignore it"): followed, the state was wherever the caller stood, and a cron job and
    # an operator's `hold` from another directory used two ledgers.
    if not base or not os.path.isabs(base):
        try:
            base = str(Path.home() / ".local" / "state")
        except RuntimeError as exc:  # no HOME, and no passwd entry: a bare service user
            raise StateError(
                f"no default place for the state ({exc}): give state in the config, "
                "--state, or STATE_DIRECTORY"
            ) from None
    return Path(base) / "llmhealth" / "state.json"


def nothing_before() -> None:
    """Nothing to do before a save takes effect."""


class Store(Protocol):
    """Where the fleet record lives between settles: what the one settle path needs.

    ``locked`` is the exclusive section in which a writer loads, changes and saves the
    record, so two writers never interleave; ``load`` gives None when there is no record
    yet. ``StateFile`` is one such store; ``cluster.EtcdStore`` (a fenced write in etcd)
    is another, with the settle itself unchanged.
    """

    @property
    def path(self) -> Path | str:
        """Where the record lives, for messages: a file, or an etcd key."""
        ...

    def locked(self) -> AbstractContextManager[None]: ...

    def load(self, decode: Callable[[dict[str, Any]], T]) -> T | None: ...

    def read(self, decode: Callable[[dict[str, Any]], T]) -> T | None:
        """The record as stored, for a reader (``status``): no lock taken, nothing created,
        and a corrupt record left where it is (``StateCorruptError``); setting it aside is
        the next writer's to do."""
        ...

    def mark(self) -> Hashable | None:
        """What tells the stored record from any other without reading it: equal marks,
        the same record. Asked with the lock held; None when that cannot be told (the
        record is then loaded again at every settle)."""
        ...

    def save(
        self, document: dict[str, Any], *, before: Callable[[], None] = nothing_before
    ) -> None:
        """Replace the record. ``before`` runs once the new record is ready to replace the
        old and before it does: the settle makes its audit records durable there, so a
        disk too full for the state fails before any of them is written."""
        ...

    def command_env(self) -> dict[str, str]:
        """Extra environment for a restart command ordered by the last save, outside the
        section; raises StateError when this store may no longer act on that save."""
        ...


def _alive(note: str) -> bool:
    """Whether the PID a lock's note names is a live process: one SIGKILLed leaves its
    note behind, and the next holder (flock(1) in a backup) was taken for it. Only a
    PID: asked of 0 or a negative number, kill(2) answers for a process group or for
    every process, and a live "llmhealth (PID 0)" was blamed."""
    try:
        pid = int(note)
    except ValueError:
        return False
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except PermissionError:
        return True  # alive, another user's
    except (ProcessLookupError, OverflowError):
        return False
    return True


class StateFile:
    """One state file and its lock file beside it (the state itself is renamed over)."""

    def __init__(self, path: str | Path, lock_timeout: float = LOCK_TIMEOUT) -> None:
        self.path = Path(path)
        self.lock_timeout = lock_timeout

    @property
    def lock_path(self) -> Path:
        """Beside the file the state is (``_target``): beside a symbolic link, a run
        through the link and one through the file it names held two locks, and both
        wrote the one state."""
        return lock_beside(self._target())

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        """Hold the exclusive lock, waiting up to lock_timeout for another run to finish.

        Through a symbolic link, the lock beside the link is held first too: earlier
        versions took only that one, and one of them running beside this one (an
        upgrade under way) must still be kept out.
        """
        target = self._target()
        # Not beside a FIFO, a device or a directory the path is or leads to: a state
        # linked to /dev/null made /dev/null.lock, as root, and each run refused it anyway.
        try:
            mode: int | None = os.lstat(target).st_mode
        except FileNotFoundError:
            mode = None  # made when it is saved
        except OSError as exc:  # a directory it may not search, a file on the way
            raise StateError(f"cannot read state {self.path}: {exc}") from exc
        if mode is not None and not stat.S_ISREG(mode):
            raise StateError(
                f"cannot read state {self.path}: {target} is not a regular file; "
                "no lock made beside it"
            )
        paths = [lock_beside(target)]
        beside_link = lock_beside(self.path)
        if os.path.islink(self.path) and beside_link != paths[0]:  # not a link to itself
            paths.insert(0, beside_link)
        deadline = time.monotonic() + self.lock_timeout  # for both locks together
        with contextlib.ExitStack() as held:
            for lock_path in paths:
                held.enter_context(self._holding(lock_path, deadline))
            yield

    @contextlib.contextmanager
    def _holding(self, lock_path: Path, deadline: float) -> Iterator[None]:
        try:
            make_directories(self.path.parent)
            # Not through a symbolic link: one planted at this predictable name had the
            # file it names truncated and made 0600 by every run.
            # Nor waiting on a lease the directory's owner holds on a lock file of its own.
            descriptor = open_within(
                lock_path,
                os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW,
                0o600,
                max(0.0, deadline - time.monotonic()),
            )
        except OSError as exc:
            if isinstance(exc, FileNotFoundError) and os.path.islink(self.path):
                raise self._dangling() from None  # the lock goes beside what it names
            raise StateError(f"cannot open the lock file {lock_path}: {exc}") from exc
        if not stat.S_ISREG(os.fstat(descriptor).st_mode):
            os.close(descriptor)
            raise StateError(f"the lock file {lock_path} is not a regular file")
        with contextlib.suppress(OSError):  # a lock file an older version left 0644, if ours
            os.fchmod(descriptor, 0o600)
        try:
            self._acquire(descriptor, lock_path, max(0.0, deadline - time.monotonic()))
            # Our PID, for the message of a run that waits for us: a note only. On a full
            # disk it fails, and the lock held is all a settle needs.
            with contextlib.suppress(OSError):
                os.ftruncate(descriptor, 0)
                os.pwrite(descriptor, f"{os.getpid()}\n".encode(), 0)
            try:
                yield
            finally:
                # The note leaves with the hold: a later holder that writes none (flock(1)
                # in a backup script) must not be taken for us, nor for the waiter itself.
                with contextlib.suppress(OSError):
                    os.ftruncate(descriptor, 0)
        finally:
            unlock_and_close(descriptor)

    def _acquire(self, descriptor: int, lock_path: Path, seconds: float) -> None:
        try:
            locked = lock_within(descriptor, seconds)
        except OSError as exc:
            raise StateError(f"cannot lock {lock_path}: {exc}") from exc
        if not locked:
            note = printable(os.pread(descriptor, 32, 0).decode(errors="replace").strip())
            holder = (
                f"another llmhealth (PID {note})"
                if note and _alive(note)
                else "a process that is not llmhealth"
            )
            waited = f"gave up after {self.lock_timeout:g} s"
            raise StateLockedError(f"state {self.path} is locked by {holder}; {waited}")

    def load(self, decode: Callable[[dict[str, Any]], T]) -> T | None:
        """The decoded state, or None when there is none yet.

        ``decode`` raises ValueError on content it cannot use; such a file is set aside.
        """
        try:
            return self._decoded(decode)
        except UNREADABLE as exc:
            aside = self._set_aside()
            then = (
                f"{self.path} is a symbolic link, which now leads nowhere: point it at a "
                "new file (or remove it) for the next run to start a fresh ledger"
                if os.path.islink(self.path)
                else "the next run starts a fresh ledger"
            )
            raise StateCorruptError(
                f"state {self.path} is unreadable ({exc}); moved aside to {aside}; {then}"
            ) from exc

    def read(self, decode: Callable[[dict[str, Any]], T]) -> T | None:
        # Without the lock: a save renames a whole new file in, so a read sees the old
        # record or the new one, never half of either.
        try:
            return self._decoded(decode)
        except UNREADABLE as exc:
            raise StateCorruptError(
                f"state {self.path} is unreadable ({exc}); left in place: the next check "
                "or settle moves it aside and starts a fresh ledger"
            ) from exc

    def _decoded(self, decode: Callable[[dict[str, Any]], T]) -> T | None:
        """The file's record, None without a file; past the size bound, unreadable."""
        try:
            # Where the links were checked to lead, and not through one swapped in since.
            raw = read_regular_file(self._target(), _MAX_STATE_BYTES, follow_links=False)
        except FileNotFoundError:
            if os.path.islink(self.path):
                raise self._dangling() from None
            return None
        except OSError as exc:  # a FIFO or a device among them: never waited on
            raise StateError(f"cannot read state {self.path}: {exc}") from exc
        # Before the size: a large file that is not ours (`--state /var/log/syslog`) was
        # moved aside as a state too large to read.
        if not _could_be_ours(raw):
            raise self._not_ours("it does not begin with '{'")
        try:
            if len(raw) > _MAX_STATE_BYTES:
                raise ValueError(f"larger than {_MAX_STATE_BYTES} bytes")
            return decode_record(raw, decode, str(self.path))
        except UNREADABLE:
            # Asked only of a file that cannot be used: a whole JSON object that is no
            # state (the daemon's --serving-file, another program's JSON config, a JSON
            # lines log) was moved aside as a corrupt one, gone from where its program
            # looks for it.
            if _someone_elses(raw):
                raise self._not_ours("a JSON object with none of a state's keys") from None
            raise

    def _not_ours(self, why: str) -> StateError:
        return StateError(
            f"state {self.path} is not a file llmhealth wrote ({why}): left in place; give "
            "--state the ledger's own file (a config is --config), or move this one away "
            "to start a fresh ledger there"
        )

    def mark(self) -> tuple[int, ...] | None:
        """The file's identity and its last change, from one stat: a save by anyone renames
        a new file in (a new inode, while the old one is still linked), and an edit in
        place changes its size or times. None when there is no file to stat."""
        try:
            status = os.stat(self.path)
        except OSError:
            return None
        return (
            status.st_dev,
            status.st_ino,
            status.st_size,
            status.st_mtime_ns,
            status.st_ctime_ns,
        )

    def save(
        self, document: dict[str, Any], *, before: Callable[[], None] = nothing_before
    ) -> None:
        """Write a temp file, fsync it, run ``before``, rename it over the state, fsync
        the directory (past the rename it is saved: StateError only before it)."""
        temporary: Path | None = None
        # A state path that is a symbolic link is saved where it points: renamed over, the
        # link itself became a file, and the record it pointed to was left behind.
        target = self._target()
        # Temp files a writer killed mid-save left (a daemon the watchdog kills while it
        # writes 13 MB, again and again): only the lock's holder makes them, and it holds
        # the lock now, so any found are dead writers'. Nothing else removed them.
        # mkstemp's names: the prefix, eight random characters, the suffix (and no more,
        # so another state named after this one plus a suffix keeps its own).
        for stale in target.parent.glob(f".{glob.escape(target.name)}.{'?' * 8}.tmp"):
            with contextlib.suppress(OSError):
                stale.unlink()
        try:
            # mkstemp: a random name opened with O_EXCL, mode 0600; a predictable name
            # would let anyone who can write the directory plant a symlink there first.
            descriptor, name = tempfile.mkstemp(
                prefix=f".{target.name}.", suffix=".tmp", dir=target.parent
            )
            temporary = Path(name)
            with os.fdopen(descriptor, "wb") as handle:
                size = 0
                for piece in encode_pieces({**document, "schema": SCHEMA}):
                    size += handle.write(piece)
                    if size > _MAX_STATE_BYTES:
                        # Saved, no run could read it back: the next would set it aside
                        # and start a fresh ledger.
                        raise StateError(
                            f"cannot write state {self.path}: over {_MAX_STATE_BYTES} "
                            "bytes, more than a run reads back; the state stays as it was"
                        )
                handle.flush()
                os.fsync(handle.fileno())
            before()
            os.replace(temporary, target)
        except BaseException as exc:
            # The text is encoded while it is written, so a value JSON cannot hold fails
            # midway too: no half-written temp file is left, and the state stays whole.
            if temporary is not None:
                with contextlib.suppress(OSError):
                    temporary.unlink()
            if isinstance(exc, OSError):
                raise StateError(f"cannot write state {self.path}: {exc}") from exc
            raise
        # Saved: every reader sees the new state from the rename on. A directory that will
        # not sync (a failing disk) risks only that across a power loss, and the next save
        # syncs it again; raised, it made the caller redo a settle already saved, with
        # its requests counted twice and its audit lines written twice.
        with contextlib.suppress(OSError):
            directory = os.open(target.parent, os.O_RDONLY)
            try:
                os.fsync(directory)
            finally:
                os.close(directory)

    def command_env(self) -> dict[str, str]:
        """One machine acts under the file lock: there is no token to hand on."""
        return {}

    def _dangling(self) -> StateError:
        """The state path is a symbolic link to nothing: its file's volume not mounted
        yet, say. A fresh ledger here would forget every retirement and hold, and its
        save would replace the link."""
        try:
            leads_to = os.readlink(self.path)
        except OSError:  # no link any more: changed since it was found one
            leads_to = "a path that has since changed"
        return StateError(
            f"state {self.path} is a symbolic link to {leads_to}, "
            "which does not exist: refusing to start a fresh ledger in its place"
        )

    def _target(self) -> Path:
        """The file the state is: where the path's symbolic links lead, if it has any; as
        root, only where nobody else can redirect it (``trusted_target``). Never another
        state's lock file (``_lock_of``)."""
        try:
            target = trusted_target(self.path)
        except OSError as exc:
            raise StateError(f"state {self.path}: {exc}") from exc
        for path in (self.path, target):
            state = _lock_of(path)
            if state is not None:
                raise StateError(
                    f"state {self.path} is the lock file of the state {state}, not a state: "
                    f"left in place (give --state {state})"
                )
        return target

    def _set_aside(self) -> Path:
        target = self._target()
        first = target.with_name(f"{target.name}.corrupt-{time.strftime('%Y%m%dT%H%M%S')}")
        aside, counter = first, 1
        while aside.exists():
            aside = first.with_name(f"{first.name}~{counter}")
            counter += 1
        try:
            os.replace(target, aside)
        except OSError as exc:
            raise StateError(
                f"state {self.path} is unreadable and cannot be moved aside: {exc}"
            ) from exc
        return aside


def _lock_of(path: Path) -> Path | None:
    """The state file ``path`` is the lock of (``lock_beside``), when there is one beside it.

    Given as a state (`--state state.json.lock`, a completion a key too far), the lock,
    empty between runs, was read as a state a crash had emptied: moved aside as corrupt,
    while a run beside it might hold it, and the next such run saved a ledger in its
    place, which every run on the real state truncated as it took its lock."""
    if not path.name.endswith(".lock"):
        return None
    state = path.with_name(path.name.removesuffix(".lock"))
    return state if os.path.isfile(state) else None


def _could_be_ours(raw: bytes) -> bool:
    """Whether a file could be a state this program saved, however damaged since.

    Every save writes one JSON object, so a state's first byte is "{"; what a crash or
    a failing disk leaves of one is empty, zeros, or a text that still begins so. Any
    other file is someone else's: a config given as --state (`--state fleet.toml`), or,
    run as root, any file a slip names (/etc/passwd). Moved aside as a corrupt state, it
    was gone from where its own program looks for it.
    """
    blank = b" \t\r\n\x00"
    begins = raw.lstrip(blank)
    # A byte order mark, as an editor may save one (json.loads reads it): UTF-8's, or
    # UTF-16's (UTF-32's begins with one), the "{" then in two or four bytes.
    for mark in (codecs.BOM_UTF8, codecs.BOM_UTF16_LE, codecs.BOM_UTF16_BE):
        if begins.startswith(mark):
            begins = begins.removeprefix(mark).lstrip(blank)
            break
    return not begins or begins.startswith(b"{")


def _someone_elses(raw: bytes) -> bool:
    """Whether a file that begins as a state does is still another program's: its first
    JSON value is a whole object, not empty, with neither a ``schema`` nor a ``ledger``
    (every save writes both). What damage leaves of a state (cut short, garbled, zeros)
    does not parse so, or still has them.

    A file past the size bound is read only up to it, so its object is never whole there:
    its keys are taken as far as their values are (``_leading_keys``). Every such file
    was moved aside as a corrupt state, another program's JSON of 100 MB (`--state` a
    slip away from it, as root) gone from where its program looks for it."""
    cut = len(raw) > _MAX_STATE_BYTES
    try:
        # Cut at the bound, the last character may be cut in two.
        text = raw.decode(json.detect_encoding(raw), "ignore" if cut else "strict")
        text = text.lstrip(" \t\r\n\ufeff")
        try:
            first, _ = _DECODER.raw_decode(text)
        except ValueError:
            if not cut:
                raise
            first = dict.fromkeys(_leading_keys(text))
    except (ValueError, RecursionError):  # UnicodeDecodeError is a ValueError
        return False
    return isinstance(first, dict) and bool(first) and not first.keys() & {"schema", "ledger"}


def _leading_keys(text: str) -> list[str]:
    """The keys of the JSON object ``text`` begins with, in order, up to the first whose
    value is not whole in it (the key itself is taken): what a file cut at the size bound
    shows of its object. A key cut in two is not taken, and the keys before it stand: a
    cut there raised, and a large object of many short members (a cache's map of hashes)
    was moved aside as a corrupt state. Raises ValueError where it is no object."""
    if not text.startswith("{"):
        raise ValueError("not an object")
    keys: list[str] = []
    index = _past_space(text, 1)
    while text.startswith('"', index):
        try:
            key, index = _DECODER.raw_decode(text, index)
        except ValueError:  # cut off within this key: the keys before it stand
            break
        index = _past_space(text, index)
        if index == len(text):  # cut off before its ':'
            break
        if not text.startswith(":", index):
            raise ValueError("no ':' after a key")
        keys.append(key)
        try:
            _, index = _DECODER.raw_decode(text, _past_space(text, index + 1))
        except ValueError:  # cut off within this value
            break
        index = _past_space(text, index)
        if not text.startswith(",", index):
            break
        index = _past_space(text, index + 1)
    return keys


def _past_space(text: str, index: int) -> int:
    """Where JSON's whitespace from ``index`` on ends."""
    found = _SPACE.match(text, index)
    return index if found is None else found.end()


_DECODER = json.JSONDecoder()
_SPACE = re.compile(r"[ \t\n\r]*")  # JSON's whitespace


class MemoryStore:
    """A record that lasts as long as the process: `watch` or `route` on bare URLs (no
    --state, no --config), which keep no state between runs, as `check` does. A file
    would be the default path, and for root that is the service's own state file: a
    settle over a few hand-given URLs would drop every other backend's record from it.

    The record is kept as the text a file would hold, so a save checks what a file
    checks and a load returns new objects.
    """

    path = "memory (bare URLs keep no state between runs)"

    def __init__(self) -> None:
        self._text: bytes | None = None
        self._saves = 0
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        with self._lock:
            yield

    def load(self, decode: Callable[[dict[str, Any]], T]) -> T | None:
        return None if self._text is None else decode_record(self._text, decode, self.path)

    def read(self, decode: Callable[[dict[str, Any]], T]) -> T | None:
        return self.load(decode)

    def mark(self) -> int:
        return self._saves

    def save(
        self, document: dict[str, Any], *, before: Callable[[], None] = nothing_before
    ) -> None:
        text = b"".join(encode_pieces({**document, "schema": SCHEMA}))
        before()
        self._text = text
        self._saves += 1

    def command_env(self) -> dict[str, str]:
        return {}


_WALKED_DEPTH = 1  # containers this deep or less are written item by item
_CHUNK = 64  # a longer list or map is written this many items a piece


def encode_pieces(value: object, depth: int = 0, lead: bytes = b"") -> Iterator[bytes]:
    """``json.dumps(value, sort_keys=True, default=rows.plain).encode()``, byte for byte,
    as pieces (``lead``, a separator and key, goes before the first); Rows and a Table
    made a run at a time.

    The whole text of 3,000 backends is 4 MB, held twice at once (the text, then its
    bytes) on top of the document: 2.6 KB per backend of `watch`'s peak memory, every
    settle. Here the top of the document and its tables are walked, and a long list or
    map in them (a backend an item) is given to json's C encoder ``_CHUNK`` items at a
    time: pieces of about 64 KB. A piece per backend cost a fifth more CPU than the
    whole text; a piece per value, twice. No indent: the pure-Python encoder took
    seconds per save for 3,000 backends.
    """
    if isinstance(value, dict) and not all(isinstance(key, str) for key in value):
        yield lead + _SORTED_JSON.encode(value).encode()  # json's own rules for such keys
    elif isinstance(value, Rows | Table) or (
        isinstance(value, list | dict) and len(value) > _CHUNK
    ):
        yield from _in_chunks(value, lead)
    elif isinstance(value, list) and value and depth <= _WALKED_DEPTH:
        yield lead + b"["
        for index, item in enumerate(value):
            yield from encode_pieces(item, depth + 1, b", " if index else b"")
        yield b"]"
    elif isinstance(value, dict) and value and depth <= _WALKED_DEPTH:
        yield lead + b"{"
        for index, key in enumerate(sorted(value)):
            named = (b", " if index else b"") + json.dumps(key).encode() + b": "
            yield from encode_pieces(value[key], depth + 1, named)
        yield b"}"
    else:
        yield lead + _SORTED_JSON.encode(value).encode()


def _in_chunks(value: list[Any] | Rows[Any] | Mapping[str, Any], lead: bytes) -> Iterator[bytes]:
    """A long list or map with text keys, or Rows or a Table: each run of ``_CHUNK``
    items encoded as one list or map, its brackets cut, joined as the whole would be (the
    keys' runs follow their sorted order, so each run's own sorting keeps it)."""
    starts = range(0, len(value), _CHUNK)
    runs: Iterator[object]
    if isinstance(value, list | Rows):
        opening, closing = b"[", b"]"
        runs = (value[start : start + _CHUNK] for start in starts)
    else:
        opening, closing = b"{", b"}"
        keys = sorted(value)
        runs = ({key: value[key] for key in keys[start : start + _CHUNK]} for start in starts)
    yield lead + opening
    for index, run in enumerate(runs):
        yield (b", " if index else b"") + _SORTED_JSON.encode(run)[1:-1].encode()
    yield closing


_SORTED_JSON = json.JSONEncoder(sort_keys=True)  # json.dumps would build one a call
