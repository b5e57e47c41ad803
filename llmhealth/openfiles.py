"""Open files: the descriptor limit, locks waited for in bounds, files read in bounds.

Every connection holds a descriptor, and most processes start with 1024.

``watch`` and ``check`` keep a connection to each backend (and the tiny request one
more), the router one per client and one per forwarded request, the exporter one per
scraper: the soft limit a shell or systemd (``DefaultLimitNOFILE=1024:524288``) starts a
process with is exhausted by a fleet of a thousand, and then every read fails at once.
The hard limit is the operator's ceiling; the soft one is ours to raise to it.

When the descriptors do run out, the failures are this process's own: a connection
that could not be opened, or a trust store that could not be read, judges no server.

The state file, its lock, the audit log and the config are files anyone may meddle with
(a backup script's ``flock``, a FIFO or a device given as a path): a wait for a lock
ends, and a read neither blocks nor takes more than its caller's bound.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import functools
import os
import resource
import socket
import stat
import struct
import sys
import time
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, Final

# One of getaddrinfo's answers: family, type, protocol, canonical name, address.
AddressInfo = tuple[int, int, int, str, Any]

if TYPE_CHECKING:
    import asyncio
    import ssl

# Where the soft limit is raised to when the hard one is unlimited (Linux's nr_open).
FILE_LIMIT_CEILING: Final = 1 << 20
# How long a run waits for another holder of a lock (the state's, the audit log's): a
# settle or a check ends within it, and it is a third of systemd's 30 s watchdog.
LOCK_TIMEOUT: Final = 10.0
_LOCK_POLL: Final = 0.05  # seconds between tries of a held lock
# Errors that are this process's want of descriptors or buffers, not a server's doing.
OUT_OF_FILES: Final = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS})


class NotRegularFileError(OSError):
    """A path that names a FIFO, a device, a socket or a directory, not a file to read."""


class UntrustedLinkError(OSError):
    """A path root will not write through: another user could change where it leads."""


def trusted_target(path: Path) -> Path:
    """Where ``path`` leads through its symbolic links: the file the state or the audit
    log is.

    The state and the audit log live in a directory a service's user may own, and the
    operator's verbs may run as root. Through a path that user could change, root moved
    a file of its choosing aside as a corrupt state, saved the state over it, created
    files beside it or appended audit records to it: its own link at the state's name
    (to /etc/shadow, say), a directory on the way swapped for a link, or root's own links
    renamed into each other's places. So, run as root, a path is used only where nobody
    else can change it: each link on the way is followed only when it is root's and
    every directory above it is root's alone (``_root_alone``), and so is every directory
    above the one holding the file. That directory may be anyone's: what is in it is
    opened without following links, created exclusively or renamed over. The path comes
    back with its links resolved, so nothing on it is read again. Any other user follows
    its links as before: it can only reach what it could anyway.
    Raises UntrustedLinkError.
    """
    if os.geteuid() != 0:
        return Path(os.path.realpath(path)) if os.path.islink(path) else path
    resolved = Path("/")
    # Absolute, its ".." kept: taken before the link ahead of it is followed, as abspath
    # takes it, it named another file than the kernel's (and every other user's).
    pending = list(Path(path).absolute().parts[1:])
    links = 0
    while pending:
        name = pending.pop(0)
        if name == "..":
            resolved = resolved.parent  # of a path with no links left: the kernel's ".."
            continue
        here = resolved / name
        try:
            status = os.lstat(here)
        except FileNotFoundError:
            resolved = here  # made by root, when it is made
            continue
        if not stat.S_ISLNK(status.st_mode):
            resolved = here
            continue
        links += 1
        if links > 40:  # Linux's own limit on links in one lookup
            raise UntrustedLinkError(f"{path}: too many levels of symbolic links")
        if status.st_uid != 0:
            raise UntrustedLinkError(
                f"{here} is a symbolic link owned by uid {status.st_uid}: run as root, "
                "llmhealth follows only root's links (run it as that user instead)"
            )
        _root_alone(resolved, f"the symbolic link {here}")
        leads_to = Path(os.readlink(here))
        if leads_to.is_absolute():
            resolved = Path("/")
        pending[:0] = [part for part in leads_to.parts if part not in ("/", ".")]
    _root_alone(resolved.parent.parent, str(resolved))
    # A sticky directory keeps what root made there root's, not what its owner made: the
    # service's own directory in one (a spool 1770, or /tmp without protected_symlinks)
    # can be renamed away by its owner and a link of its own put in its place.
    holding = resolved.parent
    with contextlib.suppress(FileNotFoundError):
        if os.lstat(holding).st_uid != 0 and os.lstat(holding.parent).st_mode & 0o022:
            raise UntrustedLinkError(
                f"{holding.parent}, a directory above {resolved}, is writable by others "
                f"than root, and {holding} is not root's: its owner may rename it there "
                "(run it as the directory's owner)"
            )
    return resolved


def _root_alone(directory: Path, holding: str) -> None:
    """``directory`` and each above it: root's, no link, and writable by nobody else
    (or sticky, as /tmp is, where nobody else may rename or remove what root made)."""
    for each in (directory, *directory.parents):
        try:
            status = os.lstat(each)
        except FileNotFoundError:
            continue  # made by root, when it is made
        if stat.S_ISLNK(status.st_mode):
            why = "is a symbolic link"
        elif status.st_uid != 0:
            why = f"is owned by uid {status.st_uid}"
        elif status.st_mode & 0o022 and not status.st_mode & stat.S_ISVTX:
            why = "is writable by others than root"
        else:
            continue
        raise UntrustedLinkError(
            f"{each}, a directory above {holding}, {why}: run as root, llmhealth writes "
            "only where nobody else can redirect it (run it as the directory's owner)"
        )


def make_directories(directory: Path) -> None:
    """``directory`` and each missing above it, made 0755 at most whatever the umask: the
    state's and the audit log's. Made 0777 under a umask of 0 (0775 under 002), they
    let anyone rename a state of their own in, and run as root, llmhealth then refused
    the very directories it had made ("writable by others than root"), every run after
    its first. A directory there already is left as it is."""
    missing = [each for each in (directory, *directory.parents) if not os.path.lexists(each)]
    for each in reversed(missing):
        with contextlib.suppress(FileExistsError):  # made meanwhile, by another run
            os.mkdir(each, 0o755)


def raise_file_limit() -> int:
    """Raise this process's open-file soft limit to its hard limit; the limit now in force.

    A refusal leaves the limit as it was: the reads that then cannot open a connection
    say so as llmhealth's own failure ("not judged"), never as the server's.
    """
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = FILE_LIMIT_CEILING if hard == resource.RLIM_INFINITY else hard
    if soft != resource.RLIM_INFINITY and soft < wanted:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
        except (ValueError, OSError):
            return soft
        return wanted
    return FILE_LIMIT_CEILING if soft == resource.RLIM_INFINITY else soft


def out_of_files(exc: OSError) -> bool:
    """Whether an operation failed for want of descriptors in this process.

    The resolver says so only as "name unknown" (it could not open /etc/hosts, nor a
    socket to ask DNS): for a failed lookup, one more descriptor is asked for to see.
    """
    if exc.errno in OUT_OF_FILES:
        return True
    return isinstance(exc, socket.gaierror) and short_of_descriptors()


def own_connect_shortage(exc: OSError, destinations: Iterable[tuple[int, Any]]) -> bool:
    """Whether a connection to ``destinations`` (each a family and an address, as
    getaddrinfo gives them) failed for this process's own shortage, never the server's:
    of descriptors, or of local ports (EADDRNOTAVAIL: the ephemeral range in use or in
    TIME_WAIT towards that server). Counted against the server, a burst of connections
    judged a healthy fleet `down`, or dropped it from the router's choice.

    EADDRNOTAVAIL says as well that this host has no address to send from towards the
    server (IPv6 turned off, as containers have it by default, and a name's ``::1`` or
    an IPv6 backend): out of reach from here, the server's to be judged. Told apart by a
    UDP socket's connect to the same address, which picks a source address as TCP's does
    but sends nothing and takes none of TCP's ports."""
    if out_of_files(exc):
        return True
    return exc.errno == errno.EADDRNOTAVAIL and any(
        _has_source(family, address) for family, address in destinations
    )


class OwnShortageError(OSError):
    """A connection this process had no descriptor or local port for
    (``own_connect_shortage``): never the server's failure, whatever the caller counts."""


def shortage_or(exc: OSError, host: str, port: int) -> OSError:
    """``exc``, of a connection to the address ``host``, as an ``OwnShortageError`` when
    it was this process's own shortage."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    if own_connect_shortage(exc, [(family, (host, port))]):
        return OwnShortageError(exc.errno, exc.strerror)
    return exc


async def connect_one_of(host: str, found: Sequence[AddressInfo]) -> socket.socket:
    """A socket connected to the first of a name's addresses (``found``, as getaddrinfo
    gives them) that takes one, each tried on a socket of its own.

    Not asyncio's ``create_connection``: it merges the errors of a name's addresses into
    one without an errno, so a dual-stack name whose IPv4 server had no local port left
    towards it (its ``::1`` refused) was the server's failure. This process's own
    shortage at any address is raised first, as an ``OwnShortageError``; else the one
    error, or one naming each."""
    import asyncio  # noqa: PLC0415  (loaded by whoever awaits this)

    loop = asyncio.get_running_loop()
    errors: list[OSError] = []
    ours: OSError | None = None
    for family, kind, proto, _name, address in found:
        sock = None
        try:
            # Made here, not before: a family this host cannot open (IPv6 turned off)
            # is one address failed, and the next is tried, as asyncio does.
            sock = socket.socket(family, kind, proto)
            sock.setblocking(False)
            await loop.sock_connect(sock, address)
        except OSError as exc:
            if sock is not None:
                sock.close()
            errors.append(exc)
            if ours is None and own_connect_shortage(exc, [(family, address)]):
                ours = exc
            continue
        except BaseException:
            if sock is not None:
                sock.close()
            raise
        return sock
    if ours is not None:
        raise OwnShortageError(ours.errno, ours.strerror) from ours
    if not errors:
        raise OSError(f"the name {host} has no address to connect to")
    if len({str(error) for error in errors}) == 1:
        raise errors[0]
    raise OSError(f"every address of {host} failed: {'; '.join(map(str, errors))}")


def _has_source(family: int, address: Any) -> bool:
    """Whether this host has an address to send from towards ``address``."""
    try:
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.connect(address)
    except OSError as exc:
        return exc.errno != errno.EADDRNOTAVAIL
    return True


def tls_leftover(transport: asyncio.BaseTransport | None) -> tuple[bytes, bool]:
    """Once a connection's transport saw its end: what its TLS object holds that the
    transport never handed on, and whether the end was orderly. Over TLS that is the
    peer's close_notify (RFC 9112 9.8): a TCP end without it (a server or its TLS front
    killed mid-body) cuts a body framed by the connection's end short. uvloop's TLS
    layer, its reading paused, drops what it holds at the TCP end, close_notify with
    it. A plain TCP connection's end is its own: (b"", True)."""
    import ssl  # noqa: PLC0415  (loaded by whoever made the connection)

    tls = None if transport is None else transport.get_extra_info("ssl_object")
    if not isinstance(tls, ssl.SSLObject | ssl.SSLSocket):
        return b"", True
    held = bytearray()
    try:
        while piece := tls.read(65536):
            held += piece
    except ssl.SSLZeroReturnError:  # close_notify, and our own answer to it already sent
        return bytes(held), True
    except (ssl.SSLError, ValueError):  # wants more: no close_notify (ValueError: closed)
        return bytes(held), False
    return bytes(held), True


async def look_up(loop: asyncio.AbstractEventLoop, host: str, port: int) -> Sequence[AddressInfo]:
    """``host``'s addresses for a TCP connection; a lookup that failed (but for "try
    again", ``EAI_AGAIN``) is made once more when this process has a descriptor free by
    then.

    Out of descriptors, the resolver can open neither /etc/hosts nor a socket to DNS and
    says only "Name or service not known" (``out_of_files``). Whether this process was
    short is asked only once the failure is back on the loop: at the limit, another
    connection closed meanwhile, and the healthy server behind the name was `down`
    ("name does not resolve"). A name that does not resolve fails twice.

    In the loop's default executor, as asyncio's ``loop.getaddrinfo`` looks it up, on
    uvloop too: uvloop's looked it up in libuv's threads, which its loop's close waits
    for, and a stop of `watch` waited out a DNS server that did not answer, where the
    daemon's own executor leaves the lookup to the exit (``daemon.LeftAtExit``).
    """
    lookup = functools.partial(socket.getaddrinfo, host, port, type=socket.SOCK_STREAM)
    try:
        return await loop.run_in_executor(None, lookup)
    except socket.gaierror as exc:
        if exc.errno == socket.EAI_AGAIN or short_of_descriptors():
            raise  # for now, or short still: told apart by the caller
    return await loop.run_in_executor(None, lookup)


def lock_beside(target: Path) -> Path:
    """The lock file of the state file ``target``: beside it, named after it (the state's
    own lock, and ``config``'s checks that no other file llmhealth writes is one)."""
    return target.with_name(target.name + ".lock")


def short_of_descriptors(wanted: int = 1) -> bool:
    """Whether this process could not open ``wanted`` more files now."""
    opened: list[int] = []
    try:
        for _ in range(wanted):
            opened.append(os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC))
    except OSError as probe:
        return probe.errno in OUT_OF_FILES
    finally:
        for descriptor in opened:
            os.close(descriptor)
    return False


# OpenSSL's verify codes for an issuer not found (X509_V_ERR_UNABLE_TO_GET_ISSUER_CERT,
# _DEPTH_ZERO_SELF_SIGNED_CERT, _SELF_SIGNED_CERT_IN_CHAIN, _UNABLE_TO_GET_ISSUER_CERT_
# LOCALLY): all a CA directory's file not opened can make of a chain, which is built
# before its names and dates are checked.
_ISSUER_NOT_FOUND: Final = frozenset({2, 18, 19, 20})


def trust_unread(exc: OSError, short: bool) -> bool:
    """Whether a refused certificate may be this process's want of descriptors: a CA
    directory is read during the handshake, and an issuer's file that cannot be opened
    fails the chain. ``short``: asked (``short_of_descriptors``) with the connection's
    socket counted, before the handshake, which closes it on failure before its caller
    hears. The handshake's own waits may free or take a descriptor meanwhile: rare, and
    then one read judged, or one not."""
    return short and getattr(exc, "verify_code", None) in _ISSUER_NOT_FOUND


class _DefaultTls:
    """The process's default TLS context, once one was built whole."""

    context: ssl.SSLContext | None = None


def default_tls() -> ssl.SSLContext:
    """The process's default TLS context, shared: building one costs about 20 ms of CPU.

    OpenSSL reads the default CA file while it builds the context, and says nothing when
    it cannot open it. Built while this process had no descriptor left, the context
    trusted no one, and kept, it failed every https handshake for the process's life:
    each such backend `down`, each request the router sent counted against its backend.
    A context that holds no certificate where a CA file is there loads that file again,
    which says why it fails: for want of descriptors, OSError(EMFILE) and nothing kept;
    any other reason (unreadable, nothing in it) is the operator's to mend, and the
    context is kept as it is (every handshake says so). A CA directory is read at each
    handshake instead: ``trust_unread`` tells that want apart there.
    """
    import ssl  # noqa: PLC0415 - only a verb that opens https connections pays for it

    kept = _DefaultTls.context
    if kept is not None:
        return kept
    context = ssl.create_default_context()
    ca_file = ssl.get_default_verify_paths().cafile
    if ca_file is not None and not context.cert_store_stats()["x509"]:
        try:
            context.load_verify_locations(cafile=ca_file)
        except OSError as exc:  # ssl.SSLError among them: a file with nothing to trust
            # An SSLError's errno is OpenSSL's reason, which may be any number.
            if exc.errno in OUT_OF_FILES and not isinstance(exc, ssl.SSLError):
                raise OSError(exc.errno, f"the CA certificates could not be read: {exc}") from exc
    if _DefaultTls.context is None:  # another thread's, built meanwhile, is as good
        _DefaultTls.context = context
    return _DefaultTls.context


def lock_within(descriptor: int, seconds: float) -> bool:
    """Take ``descriptor``'s exclusive flock, waiting at most ``seconds`` for its holder;
    False when it is still held then. Any other failure raises OSError."""
    deadline = time.monotonic() + seconds
    while True:
        try:
            fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            pass  # held elsewhere (EAGAIN/EWOULDBLOCK)
        if time.monotonic() >= deadline:
            return False
        time.sleep(_LOCK_POLL)


def unlock_and_close(descriptor: int) -> None:
    """Give up ``descriptor``'s flock, then close it. The close alone gives it up only once
    every descriptor of that open file is closed: a process forked while it was held (a
    trainer's data-loader workers, beside a thread running ``llmhealth.check``) keeps a
    copy, and the lock stayed held for that process's whole life, every run after refused."""
    with contextlib.suppress(OSError):
        fcntl.flock(descriptor, fcntl.LOCK_UN)
    os.close(descriptor)


def open_within(path: Path, flags: int, mode: int, seconds: float) -> int:
    """``os.open(path, flags | O_NONBLOCK, mode)``, tried again for at most ``seconds``
    while it would block. An open for writing waits for a file lease (fcntl F_SETLEASE)
    the file's owner holds to be given up, for lease-break-time (45 s by default): the
    owner of the state's directory held root's run that long with its own lock file or
    audit log. O_NONBLOCK does nothing else to a regular file. Raises OSError
    (BlockingIOError when a lease is still held at the end)."""
    deadline = time.monotonic() + seconds
    while True:
        try:
            return os.open(path, flags | os.O_NONBLOCK, mode)
        except BlockingIOError:
            if time.monotonic() >= deadline:
                raise
        time.sleep(_LOCK_POLL)


def read_regular_file(path: Path, limit: int, *, follow_links: bool = True) -> bytes:
    """At most ``limit + 1`` bytes of the regular file at ``path`` (one past the bound
    tells the caller it is too large).

    A FIFO would block the read until a writer came (a reload, on the daemon's loop), a
    device could be read for ever (/dev/zero until the memory ran out), and opening some
    devices acts on them: a path that is not a regular file is refused before it is
    opened, and the open does not wait (O_NONBLOCK), its fstat deciding should the path
    have changed in between. Without ``follow_links`` a path that is a link is refused
    too (a path ``trusted_target`` resolved, which must not have become one since).
    Raises FileNotFoundError, NotRegularFileError or OSError.
    """
    if not stat.S_ISREG(os.stat(path, follow_symlinks=follow_links).st_mode):
        raise NotRegularFileError("not a regular file")
    flags = os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
    descriptor = os.open(path, flags if follow_links else flags | os.O_NOFOLLOW)
    try:
        if not stat.S_ISREG(os.fstat(descriptor).st_mode):
            raise NotRegularFileError("not a regular file")
        chunks: list[bytes] = []
        size = 0
        while size <= limit:
            chunk = os.read(descriptor, limit + 1 - size)
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
        return b"".join(chunks)
    finally:
        os.close(descriptor)


@contextlib.contextmanager
def reader_may_leave(stream: IO[str]) -> Iterator[None]:
    """Writes to ``stream`` that nobody reads any more (a closed pipe: ``| head``, a log
    reader that went away) end here, and the rest of this process's output there goes to
    /dev/null: Python ignores SIGPIPE, so a write raised BrokenPipeError, and a check or
    verb exited 1 (click's answer to it: WARNING, or "refused" for a hold that was saved)
    or 120 (a flush at exit), and ``watch`` or ``route`` died at its next log line. What
    the run decides (its exit code, its state, its routing) does not depend on a reader.
    """
    try:
        yield
        stream.flush()  # what is buffered fails here, not at exit
    except BrokenPipeError:
        discard_output(stream)


@contextlib.contextmanager
def output_may_fail(stream: IO[str]) -> Iterator[None]:
    """``reader_may_leave``, for a run's one output (a check's verdicts, a verb's line):
    also an output that cannot be written, a terminal that hung up (EIO), a file on a full
    disk or over quota (``check -f json > report.json``), goes to /dev/null from then on,
    as rich's console is answered (render.py). ``check -f nagios`` of a CRITICAL fleet
    exited 1 (WARNING) with two tracebacks, the "cannot check" line failing as the verdicts
    had, and a hold that was saved said "internal error". Not for a daemon's log, which a
    disk freed again must take again."""
    try:
        with reader_may_leave(stream):
            yield
    except OSError as exc:
        if not output_gone(exc):
            raise
        discard_output(stream)
        if stream is not sys.stderr:
            say_output_dropped(exc)


_OUTPUT_GONE: Final = frozenset({errno.EIO, errno.ENOSPC, errno.EDQUOT})


def output_gone(error: OSError) -> bool:
    """Whether ``error`` is an output that cannot be written (``output_may_fail``)."""
    return error.errno in _OUTPUT_GONE


def say_output_dropped(error: OSError) -> None:
    """The one line on stderr for a run's output that could not be written. Said where it
    can be: silent, `check -f json > report.json` on a full disk left an empty or cut-off
    report and an exit code that says all is well."""
    why = os.strerror(error.errno) if error.errno is not None else str(error)
    with contextlib.suppress(OSError, ValueError), reader_may_leave(sys.stderr):
        print(
            f"llmhealth: the output could not be written ({why}); the rest of it was dropped",
            file=sys.stderr,
            flush=True,
        )


def discard_output(stream: IO[str]) -> None:
    """Send what is written to ``stream`` from now on, and what it still buffers, to
    /dev/null: its reader is gone."""
    with contextlib.suppress(OSError, ValueError):  # a stream without a descriptor
        null = os.open(os.devnull, os.O_WRONLY)
        try:
            os.dup2(null, stream.fileno())
        finally:
            os.close(null)


_RESET_ON_CLOSE: Final = struct.pack("ii", 1, 0)  # SO_LINGER on, 0 s: close sends a reset


def end_with_reset(transport: asyncio.WriteTransport) -> None:
    """End a connection now with a reset, dropping whatever is unsent. Aborted without
    it, the kernel still held the connection and the bytes it had taken until the peer
    read them: a client that stopped reading, a backend that froze (the router's two
    sides, ``edge`` and ``upstream``)."""
    sock = transport.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _RESET_ON_CLOSE)
    transport.abort()
