"""CPU time of a backend's engine processes, when the backend runs on this host.

I/O: reads /proc (Linux) or a cgroup's ``cpu.stat``, nothing else, and never raises: no
evidence is a value (None). The processes are found through the address and port the
backend listens on: the listening process is vLLM's API server, and its descendants are
the engine core and its workers; when it has none, the engine runs inside it. Only
processes of which one names vLLM in its command line are sampled. A configured cgroup
(a systemd unit's) counts every process in it instead.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import math
import os
import socket
import struct
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from llmhealth.window import CpuSample

_PROC = Path("/proc")
_LISTEN = "0A"  # TCP_LISTEN in /proc/net/tcp's st column
_ANY = {4: ipaddress.ip_address("0.0.0.0"), 6: ipaddress.ip_address("::")}
_LOCALHOST = (ipaddress.ip_address("127.0.0.1"), ipaddress.ip_address("::1"))

IpAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
Socket = tuple[IpAddress, int]  # the local address and port a process listens on
_MAX_PROCESSES = 4096  # a bound on one scan of /proc; a host with more is not read
# Seconds a sample may take before it is given up on (no evidence); /proc reads take
# milliseconds, but one of a process stuck in the kernel takes as long as it is stuck.
SAMPLE_LIMIT = 1.0
_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


@dataclass(frozen=True, slots=True)
class _Found:
    pid: int
    started: int  # /proc/<pid>/stat starttime: a reused pid is another process
    # The listening socket's inode. A server that closed it and lingers on (a slow
    # shutdown) is no longer the backend: kept because it lived, its idle CPU was taken
    # for the engine of the server started in its place, which it proved wedged.
    socket: int


Holder = tuple[int, int]  # a listening socket's holder: its pid, and the socket's inode


class LocalCpu:
    """Samples the engine processes behind one backend URL; remembers who listens."""

    def __init__(self, url: str, cgroup: str | None = None) -> None:
        self._cgroup = Path(cgroup) if cgroup else None
        self._where = _local_address(url)
        self._found: _Found | None = None
        self._sampling: threading.Thread | None = None

    @property
    def applies(self) -> bool:
        """Is there anything to read: a configured cgroup, or a port on this host."""
        return self._cgroup is not None or self._where is not None

    def sample(self) -> CpuSample | None:
        """The CPU seconds used so far by the engine processes; None when unknown."""
        try:
            if self._cgroup is not None:
                return _cgroup_sample(self._cgroup)
            if self._where is None:
                return None
            listener = self._listener()
            if listener is None:
                return None
            processes = _descendants(listener.pid) or [listener.pid]
            if not any(_names_vllm(pid) for pid in processes):
                # Not vLLM's: a forwarder listening in its place (docker-proxy for a
                # published port, socat, `ssh -L`) has no engine below it, and an API
                # server whose only children are helpers (multiprocessing's resource
                # tracker) runs its engine itself. Their idle CPU proved a wedge of an
                # engine that was computing.
                return None
            stats = {pid: _stat_fields(pid) for pid in processes}
            seconds = sum((int(f[11]) + int(f[12])) / _TICKS for f in stats.values())
            stopped = _stopped_engines({pid: f[0] for pid, f in stats.items()})
            return CpuSample(seconds, tuple(sorted(processes)), time.monotonic(), stopped)
        except (OSError, ValueError):
            return None

    async def sample_within_limit(self) -> CpuSample | None:
        """``sample()`` off the event loop, None once SAMPLE_LIMIT has passed.

        A wedging engine is what gets sampled, and an engine stuck in the kernel (its
        memory lock held: "D" state) blocks a read of its /proc files for as long as it
        is stuck. In asyncio's thread pool such a read held the backend's probing task
        for ever, unseen, with its last verdict standing; the pool's few threads stalled
        every later sample; and the pool is joined at exit, which the stop waited for.
        So each sample runs in a daemon thread of its own, and while one is stuck this
        backend is not sampled again (no evidence) rather than stacking threads.
        """
        if self._sampling is not None and self._sampling.is_alive():
            return None
        loop = asyncio.get_running_loop()
        taken: asyncio.Future[CpuSample | None] = loop.create_future()

        def hand_over(sample: CpuSample | None) -> None:
            if not taken.done():  # given up on meanwhile
                taken.set_result(sample)

        def run() -> None:
            sample = self.sample()
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
                loop.call_soon_threadsafe(hand_over, sample)

        self._sampling = threading.Thread(target=run, name="llmhealth-cpu-sample", daemon=True)
        try:
            self._sampling.start()
        except RuntimeError:  # no thread to be had: no evidence, as a stuck sample
            self._sampling = None
            return None
        try:
            # Not wait_for: Python 3.11's returns a result that came in the turn of the
            # loop its task was cancelled in, and drops the cancellation: a probing task
            # cancelled so read on for ever, and the stop that waited for it with it.
            async with asyncio.timeout(SAMPLE_LIMIT):
                return await taken
        except TimeoutError:
            return None

    def _listener(self) -> _Found | None:
        found = self._found
        if (
            found is not None
            and _start_of(found.pid) == found.started
            and found.socket in _listening_sockets()
        ):
            return found
        assert self._where is not None
        hosts, port = self._where
        holder = _listening_holder(hosts, port)
        started = None if holder is None else _start_of(holder[0])
        if holder is None or started is None:
            self._found = None
        else:
            self._found = _Found(holder[0], started, holder[1])
        return self._found


def _local_address(url: str) -> tuple[tuple[IpAddress, ...], int] | None:
    """The addresses and port of a URL whose host is this machine's loopback (both of
    localhost's); None for anything else."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    try:
        port = parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError:
        return None
    if host == "localhost":
        return _LOCALHOST, port
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return None
    return ((address,), port) if address.is_loopback else None


def _listening_holder(hosts: tuple[IpAddress, ...], port: int) -> Holder | None:
    """The process that holds the listening socket behind one of these addresses and
    this port, from a scan of /proc that every backend shares (``_listeners``); scanned
    again when none is in it, its process is gone or its socket listens no more, and a
    socket listens there that the scan did not look for (a server started or restarted
    since)."""
    taken, found, looked_for = _listeners()
    holder = _serving(found, hosts, port)
    listening = _listening_sockets()
    if holder is not None and _start_of(holder[0]) is not None and holder[1] in listening:
        return holder
    # Scanned again only for a socket that scan did not look for: one it looked for and
    # found no holder of (another user's process, or one with capabilities, under the
    # shipped unit's capability-less root; one in another PID namespace; past the bound)
    # no scan finds either, and each sample of such a backend scanned the whole host
    # again, once per backend as before the scan was shared.
    started = {where: (0, inode) for inode, where in listening.items() if inode not in looked_for}
    if _serving(started, hosts, port) is None:
        return None
    _, found, _ = _listeners(newer_than=taken)
    return _serving(found, hosts, port)


def _serving(found: dict[Socket, Holder], hosts: tuple[IpAddress, ...], port: int) -> Holder | None:
    """Who answers a connection to one of ``hosts`` at ``port``: a socket bound to that
    very address, else one bound to every address (IPv6's also takes IPv4).

    By port alone, two servers on one port of two loopback addresses (127.0.0.2:8000 and
    127.0.0.3:8000) were one: the second backend's CPU evidence was the first's engine.
    """
    wildcards = [_ANY[host.version] for host in hosts] + [_ANY[6]]
    for address in (*hosts, *wildcards):
        holder = found.get((address, port))
        if holder is not None:
            return holder
    return None


_SCAN_FRESH = 2.0  # seconds one scan of who listens where answers every lookup
_scan_lock = threading.Lock()
# (when, socket -> holder, the inodes of the listening sockets whose holders it looked for)
Scan = tuple[float, dict[Socket, Holder], frozenset[int]]
_scan: Scan = (-math.inf, {}, frozenset())


def _listeners(newer_than: float = -math.inf) -> Scan:
    """Which process listens on each local TCP port, when that was scanned, and which
    listening sockets it looked for: at most ``_SCAN_FRESH`` seconds ago and after
    ``newer_than``, by one thread at a time.

    One scan lists the listening sockets and reads every process's descriptors until
    it has found their holders, which on a host with tens of thousands of descriptors
    costs about 0.1 s of CPU: once per backend, a check of 750 local backends spent 76 s
    of CPU in the threads sampling them, and the event loop starved beside them. A
    listener found here is checked by its start time (``LocalCpu._listener``), so a stale
    entry gives no sample, never a wrong one.
    """
    global _scan  # noqa: PLW0603 - the one shared scan, replaced whole under its lock
    with _scan_lock:
        taken = _scan[0]
        if time.monotonic() - taken > _SCAN_FRESH or taken <= newer_than:
            listening = _listening_sockets()
            _scan = (time.monotonic(), _scan_listeners(listening), frozenset(listening))
        return _scan


def _scan_listeners(listening: Mapping[int, Socket]) -> dict[Socket, Holder]:
    """Every listening TCP socket of this host (``listening``, from the kernel:
    ``_listening_sockets``), by the process holding it, from each process's open
    descriptors, this process's own passed over (it is never a backend's engine, and a
    check of 3,000 backends holds 3,000 sockets of its own)."""
    sockets = {f"socket:[{inode}]": (where, inode) for inode, where in listening.items()}
    by_socket: dict[Socket, Holder] = {}
    ours = str(os.getpid())
    # Plain strings, not Paths: a simulated fleet's servers hold thousands of descriptors.
    for count, pid in enumerate(os.listdir(_PROC)):
        if not sockets or count >= _MAX_PROCESSES:
            break  # every listening socket's holder found, or the bound reached
        if not pid.isdigit() or pid == ours:
            continue
        descriptors = f"{_PROC}/{pid}/fd"
        try:
            listed = os.listdir(descriptors)
        except OSError:
            continue  # gone meanwhile, or not ours to look into
        for fd in listed:
            try:
                held = os.readlink(f"{descriptors}/{fd}")
            except FileNotFoundError:
                # Closed meanwhile: a server opens and closes connections all the time.
                # Taken for the whole process, its listening socket, further on, went
                # unfound.
                continue
            except OSError:
                break  # not ours to look into: none of its descriptors is
            found = sockets.pop(held, None)
            if found is not None:
                where, inode = found
                by_socket.setdefault(where, (int(pid), inode))
    return by_socket


def _listening_sockets() -> dict[int, Socket]:
    """The host's listening TCP sockets (inode -> where): from the kernel's socket
    diagnostics over netlink, which hands over the listening ones alone, else from
    /proc/net/tcp and tcp6, which the kernel writes out whole, every connection and
    TIME_WAIT included (28 ms of CPU to read 9,000 of them, against 0.13 ms for the
    netlink dump, on the machine of bench/README.md's sixth pass)."""
    try:
        return _diag_listening()
    except (OSError, ValueError, struct.error):
        return _proc_listening()


def _proc_listening() -> dict[int, Socket]:
    found: dict[int, Socket] = {}
    for table in ("tcp", "tcp6"):
        try:
            lines = (_PROC / "net" / table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if len(fields) >= 10 and fields[3] == _LISTEN:
                with contextlib.suppress(ValueError):
                    found[int(fields[9])] = _socket_of(fields[1])
    return found


_NETLINK_SOCK_DIAG = 4
_SOCK_DIAG_BY_FAMILY = 20
_NLMSG_ERROR, _NLMSG_DONE = 2, 3
_NLM_F_REQUEST, _NLM_F_DUMP = 0x1, 0x300
_TCP_LISTEN = 10
_NLMSG = struct.Struct("=IHHII")  # length, type, flags, sequence, port id
_DIAG_REQUEST = struct.Struct("=BBBBI48x")  # family, protocol, extensions, pad, states, id
# inet_diag_msg: family, state, timer, retransmits, then the socket id (source port and
# destination port big-endian, source and destination addresses, interface, cookie),
# expires, receive and send queues, uid, inode.
_DIAG_MESSAGE = struct.Struct("=BBBB")
_DIAG_PORT = struct.Struct(">H")
_DIAG_INODE = struct.Struct("=I")
_DIAG_SIZE = 72
_DIAG_MAX_BYTES = 64 * 1024 * 1024  # a bound on one dump: 900,000 listening sockets
_DIAG_TIMEOUT = 2.0  # seconds for the kernel's answer; it comes at once


def _diag_listening() -> dict[int, Socket]:
    """Listening sockets from NETLINK_SOCK_DIAG (what ``ss -lt`` reads); raises OSError
    where the kernel or a sandbox does not offer it."""
    found: dict[int, Socket] = {}
    with socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM, _NETLINK_SOCK_DIAG) as link:
        link.settimeout(_DIAG_TIMEOUT)
        for sequence, family in enumerate((socket.AF_INET, socket.AF_INET6), start=1):
            request = _DIAG_REQUEST.pack(family, socket.IPPROTO_TCP, 0, 0, 1 << _TCP_LISTEN)
            header = _NLMSG.pack(
                _NLMSG.size + len(request),
                _SOCK_DIAG_BY_FAMILY,
                _NLM_F_REQUEST | _NLM_F_DUMP,
                sequence,
                0,
            )
            link.send(header + request)
            _read_diag_dump(link, sequence, found)
    return found


def _read_diag_dump(link: socket.socket, sequence: int, found: dict[int, Socket]) -> None:
    """One dump's answers into ``found``, bounded in bytes and in datagrams: an empty or
    endless answer is an error (the caller falls back to /proc), never a loop."""
    received = 0
    for _ in range(_DIAG_MAX_BYTES // 4096):
        datagram = link.recv(1 << 16)
        if not datagram:
            raise ValueError("an empty netlink datagram")
        received += len(datagram)
        if received > _DIAG_MAX_BYTES:
            break
        offset = 0
        while offset + _NLMSG.size <= len(datagram):
            length, kind, _flags, seq, _port = _NLMSG.unpack_from(datagram, offset)
            if length < _NLMSG.size:
                raise ValueError("a netlink message shorter than its header")
            body = offset + _NLMSG.size
            if seq == sequence:
                if kind == _NLMSG_DONE:
                    return
                if kind == _NLMSG_ERROR:
                    raise OSError("the kernel refused the socket diagnostics request")
                if kind == _SOCK_DIAG_BY_FAMILY and length - _NLMSG.size >= _DIAG_SIZE:
                    family, state, _timer, _retrans = _DIAG_MESSAGE.unpack_from(datagram, body)
                    if state == _TCP_LISTEN:
                        (port,) = _DIAG_PORT.unpack_from(datagram, body + 4)
                        size = 4 if family == socket.AF_INET else 16
                        source = datagram[body + 8 : body + 8 + size]
                        (inode,) = _DIAG_INODE.unpack_from(datagram, body + _DIAG_SIZE - 4)
                        found[inode] = (_plain_address(ipaddress.ip_address(source)), port)
            offset += (length + 3) & ~3
    raise ValueError(f"socket diagnostics past {_DIAG_MAX_BYTES} bytes")


def _plain_address(address: IpAddress) -> IpAddress:
    """An IPv4 address for an IPv4-mapped IPv6 one (``::ffff:127.0.0.2``)."""
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped
    return address


def _socket_of(local: str) -> Socket:
    """/proc/net/tcp's ``local_address``: the address in hex, as the kernel holds it in
    32-bit words of host order (little-endian here), then the port in hex."""
    hexed, _, port = local.rpartition(":")
    raw = bytes.fromhex(hexed)
    ordered = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    return _plain_address(ipaddress.ip_address(ordered)), int(port, 16)


_CMDLINE_BYTES = 4096


def _names_vllm(pid: int) -> bool:
    """Whether a process's program or name names vLLM: its engine core and workers
    retitle themselves (``VLLM::EngineCore``, ``VLLM::Worker``, with setproctitle, which
    sets both), its API server runs ``vllm`` (the script, or ``python -m vllm...``).
    Its program only, not its arguments: a forwarder on this host names the vLLM it
    forwards to (``kubectl port-forward svc/vllm``, ``ssh -L ... vllm-01``)."""
    try:
        with open(f"{_PROC}/{pid}/comm", "rb") as handle:
            if b"vllm" in handle.read(_CMDLINE_BYTES).lower():
                return True
        with open(f"{_PROC}/{pid}/cmdline", "rb") as handle:
            return b"vllm" in _program(handle.read(_CMDLINE_BYTES).split(b"\0")).lower()
    except OSError:
        return False


def _program(argv: list[bytes]) -> bytes:
    """What a command line runs: its first word's name, or the name of the script or the
    module a Python runs; never a directory on the way (``/home/vllm/.local/bin/kubectl``
    is a forwarder's, in the home of a service account named after the engine)."""
    if not os.path.basename(argv[0]).startswith(b"python"):
        return os.path.basename(argv[0])
    rest = iter(argv[1:])
    for word in rest:
        if word in (b"-m", b"-X", b"-W"):
            module = next(rest, b"")
            if word == b"-m":
                return module
        elif word.startswith(b"-m"):
            return word[2:]
        elif word == b"-c" or not word.startswith(b"-"):
            return b"" if word == b"-c" else os.path.basename(word)
    return b""


def _stat_fields(pid: int) -> list[str]:
    raw = (_PROC / str(pid) / "stat").read_bytes()
    # The command name is in parentheses and may hold spaces or parentheses itself, and
    # any bytes: the kernel cuts a name at 15 of them, inside a character if it must.
    # Read as text, such a name failed every sample of its backend. Only what follows it
    # is read, and that is numbers and a state letter.
    return raw[raw.rindex(b")") + 2 :].decode("ascii").split()


def _start_of(pid: int) -> int | None:
    try:
        return int(_stat_fields(pid)[19])
    except (OSError, ValueError, IndexError):
        return None


def _descendants(root: int) -> list[int]:
    """Every process below root: from each thread's list of the children it started
    (``/proc/<pid>/task/<tid>/children``), else from a scan of every process's parent.

    Sampled once per read of a frozen or idle engine, the scan of every /proc/<pid>/stat
    on the host was about 2 ms of CPU each time (on a quiet host of 94 processes): 4.5 s
    in a check of 750 idle local backends. The children lists name the same processes
    and cost a read per thread of the processes found. The kernel may build them without
    ``CONFIG_PROC_CHILDREN``; then the scan it was.
    """
    try:
        return _walk_children(root)
    except _NoChildrenListsError:
        return _scan_descendants(root)


class _NoChildrenListsError(Exception):
    """This kernel has no /proc/<pid>/task/<tid>/children."""


def _walk_children(root: int) -> list[int]:
    found: list[int] = []
    pending = [root]
    count = 0
    while pending and count < _MAX_PROCESSES:
        pid = pending.pop()
        count += 1
        if pid != root:
            found.append(pid)
        try:
            tasks = list((_PROC / str(pid) / "task").iterdir())
        except OSError:
            continue  # gone meanwhile: it and its children are not the engine's now
        for task in tasks:
            try:
                listed = (task / "children").read_text()
            except FileNotFoundError:
                if not (task / "stat").exists():
                    continue  # the thread ended meanwhile
                raise _NoChildrenListsError from None
            except OSError:
                continue
            pending.extend(int(child) for child in listed.split())
    return found


def _scan_descendants(root: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for count, entry in enumerate(_PROC.iterdir()):
        if count >= _MAX_PROCESSES:
            break
        if not entry.name.isdigit():
            continue
        try:
            parent = int(_stat_fields(int(entry.name))[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(parent, []).append(int(entry.name))
    found: list[int] = []
    pending = list(children.get(root, []))
    while pending:
        pid = pending.pop()
        found.append(pid)
        pending.extend(children.get(pid, []))
    return found


def _cgroup_sample(path: Path) -> CpuSample | None:
    """cgroup v2 ``cpu.stat``: usage_usec counts every process in the group.

    The group's processes (``cgroup.procs``, its own and its child groups') are held to
    what the port's are: none of them vLLM's (a unit whose ``docker run`` client waits
    while the engine runs in the container's own group), the group's idle CPU proved a
    wedge of an engine that was computing, and gives no evidence; a vLLM process among
    them stopped by a signal is named, as a stopped engine core whose worker spins.
    Where the group's processes cannot be listed, its ``cpu.stat`` alone is read.
    """
    seconds: float | None = None
    for line in (path / "cpu.stat").read_text().splitlines():
        key, _, value = line.partition(" ")
        if key == "usage_usec":
            seconds = int(value) / 1e6
            break
    if seconds is None:
        return None
    # One stable identity for the group: its inode (a recreated unit is another).
    identity = (path.stat().st_ino,)
    members = _cgroup_members(path)
    if members is None:
        return CpuSample(seconds, identity, time.monotonic())
    if not any(_names_vllm(pid) for pid in members):
        return None
    states = {}
    for pid in members:
        with contextlib.suppress(OSError, ValueError, IndexError):
            states[pid] = _stat_fields(pid)[0]  # gone since it was listed: not stopped
    return CpuSample(seconds, identity, time.monotonic(), _stopped_engines(states))


def _stopped_engines(states: Mapping[int, str]) -> tuple[int, ...]:
    """The processes, of these by their state, that are vLLM's and stopped by a signal
    (``T``, or ``t`` traced). Only vLLM's own: a helper (or, where pid 1 holds the socket,
    any process on the host) stopped in a terminal is no engine stopped."""
    return tuple(
        sorted(pid for pid, state in states.items() if state in ("T", "t") and _names_vllm(pid))
    )


_MAX_CGROUPS = 1024  # a bound on the groups below a configured one that are listed


def _cgroup_members(path: Path) -> list[int] | None:
    """The processes in a cgroup and the groups below it, at most ``_MAX_PROCESSES``;
    None when its own ``cgroup.procs`` cannot be read."""
    try:
        listed = (path / "cgroup.procs").read_text()
    except OSError:
        return None
    members = [int(pid) for pid in listed.split()[:_MAX_PROCESSES]]
    pending = [path]
    groups = 0
    while pending and groups < _MAX_CGROUPS and len(members) < _MAX_PROCESSES:
        group = pending.pop()
        groups += 1
        try:
            below = [entry for entry in group.iterdir() if entry.is_dir()]
        except OSError:
            continue
        for child in below:
            with contextlib.suppress(OSError):
                listed = (child / "cgroup.procs").read_text()
                members.extend(int(pid) for pid in listed.split()[: _MAX_PROCESSES - len(members)])
            pending.append(child)
    return members
