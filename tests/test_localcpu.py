"""CPU evidence from /proc, against real processes: a listener and the child it started."""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import os
import shutil
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from llmhealth.classify import Target, Verdict, VerdictKind
from llmhealth.localcpu import LocalCpu
from llmhealth.probe import ProbeSettings, examine_backend, new_client
from llmhealth.window import LongestStep

# How the stand-ins below start an "engine core": Popen returns once exec has closed the
# child's close-on-exec pipe, a moment before the kernel sets up the new command line, and
# a sample in that moment finds no vLLM there (no sample: the CI's flaky localcpu tests,
# on a loaded machine). A real engine core is sampled long after it started.
ENGINE = """
import subprocess, sys, time
def engine(code):
    child = subprocess.Popen(["VLLM::EngineCore", "-c", code], executable=sys.executable)
    for _ in range(10_000):
        with open(f"/proc/{child.pid}/cmdline", "rb") as cmdline:
            if b"VLLM::EngineCore" in cmdline.read():
                return child
        time.sleep(0.001)
    child.kill()
    raise RuntimeError("the engine's command line never appeared")
"""

# A stand-in for vLLM's API server: it listens, prints its port, and starts one child
# (the "engine core", titled as vLLM's is) that spins on the CPU until stopped.
SERVER = (
    ENGINE
    + """
import socket, subprocess, sys
listener = socket.socket(socket.AF_INET6 if ":" in sys.argv[1] else socket.AF_INET)
listener.bind((sys.argv[1], int(sys.argv[2])))
listener.listen()
engine = engine("while True: pass")
print(listener.getsockname()[1], engine.pid, flush=True)
try:
    sys.stdin.read()
finally:
    engine.kill()
    engine.wait()
"""
)

pytestmark = pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="Linux /proc")


@contextmanager
def api_server_with_engine(
    host: str = "127.0.0.1", port: int = 0
) -> Iterator[tuple[int, int, int]]:
    process = subprocess.Popen(
        [sys.executable, "-c", SERVER, host, str(port)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert process.stdout is not None
        port, engine = (int(field) for field in process.stdout.readline().split())
        yield port, process.pid, engine
    finally:
        assert process.stdin is not None and process.stdout is not None
        process.stdin.close()
        process.wait(timeout=10)
        process.stdout.close()


def test_the_engine_processes_are_found_through_the_listening_port() -> None:
    with api_server_with_engine() as (port, server, engine):
        cpu = LocalCpu(f"http://127.0.0.1:{port}")
        assert cpu.applies
        first = cpu.sample()
        assert first is not None
        # The listener's descendants are the engine: the API server itself is left out.
        assert first.processes == (engine,)
        assert server not in first.processes
        deadline = time.monotonic() + 10
        while (later := cpu.sample()) is not None and later.seconds <= first.seconds:
            assert time.monotonic() < deadline, "a spinning engine used no CPU"
            time.sleep(0.1)


def test_two_servers_on_one_port_of_two_loopback_addresses_are_told_apart() -> None:
    # Each backend's evidence must be its own engine's: by port alone, the second was
    # sampled through the first's processes (bench_scale's simulators, 86 of 3,000).
    with api_server_with_engine("127.0.0.2") as (port, _first, first_engine):  # noqa: SIM117
        with api_server_with_engine("127.0.0.3", port) as (_, _second, second_engine):
            samples = [LocalCpu(f"http://127.0.0.{host}:{port}").sample() for host in (2, 3)]
            # Nothing listens on that port of a third address: no evidence, not theirs.
            assert LocalCpu(f"http://127.0.0.4:{port}").sample() is None
    assert [sample.processes if sample else None for sample in samples] == [
        (first_engine,),
        (second_engine,),
    ]
    # Bound to every address, a server answers on any loopback address of its port.
    with api_server_with_engine("0.0.0.0") as (port, _server, engine):
        for url in (f"http://127.0.0.9:{port}", f"http://localhost:{port}"):
            sample = LocalCpu(url).sample()
            assert sample is not None and sample.processes == (engine,), url


# A listener that is not vLLM's: a forwarder (docker-proxy for a published port, socat)
# with no engine below it, or, given a child's code, a server whose only child is a
# helper (multiprocessing's resource tracker) that names no vLLM process.
NOT_VLLM = """
import socket, subprocess, sys, time
listener = socket.socket()
listener.bind(("127.0.0.1", 0))
listener.listen()
helpers = [subprocess.Popen([sys.executable, "-c", code]) for code in sys.argv[1:]]
print(listener.getsockname()[1], flush=True)
try:
    sys.stdin.read()
finally:
    for helper in helpers:
        helper.kill()
        helper.wait()
"""


@pytest.mark.parametrize("children", [[], ["import time\nwhile True: time.sleep(1)"]])
def test_a_listener_with_no_vllm_process_below_it_gives_no_evidence(children: list[str]) -> None:
    """The idle CPU of a forwarder in front of vLLM, or of a helper beside an engine that
    runs inside its API server, proved a wedge in two waits of an engine computing."""
    with listening([sys.executable, "-c", NOT_VLLM, *children]) as port:
        cpu = LocalCpu(f"http://127.0.0.1:{port}")
        assert cpu.applies and cpu.sample() is None


@contextmanager
def listening(argv: list[str]) -> Iterator[int]:
    """The port a process started with ``argv`` prints once it listens; it leaves when
    its stdin closes, and is waited for."""
    process = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert process.stdout is not None
        yield int(process.stdout.readline())
    finally:
        assert process.stdin is not None and process.stdout is not None
        process.stdin.close()
        process.wait(timeout=10)
        process.stdout.close()


# A server that closes its listening socket when told to and lingers on, as a vLLM API
# server slow to shut down does, with its idle engine.
LINGERING = (
    ENGINE
    + """
import socket, subprocess, sys
listener = socket.socket()
listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
listener.bind(("127.0.0.1", 0))
listener.listen()
code = "import time\\nwhile True: time.sleep(1)"
engine = engine(code)
print(listener.getsockname()[1], engine.pid, flush=True)
try:
    sys.stdin.readline()
    listener.close()
    print("closed", flush=True)
    sys.stdin.read()
finally:
    engine.kill()
    engine.wait()
"""
)


def test_a_server_that_stopped_listening_is_no_longer_the_backend() -> None:
    """Kept while it lived, a server slow to shut down (its socket closed) was sampled in
    place of the one started on its port: its idle engine proved the new one wedged."""
    old = subprocess.Popen(
        [sys.executable, "-c", LINGERING],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert old.stdin is not None and old.stdout is not None
        port, old_engine = (int(field) for field in old.stdout.readline().split())
        cpu = LocalCpu(f"http://127.0.0.1:{port}")
        first = cpu.sample()
        assert first is not None and first.processes == (old_engine,)
        old.stdin.write("close\n")
        old.stdin.flush()
        assert old.stdout.readline().strip() == "closed"
        with api_server_with_engine(port=port) as (_, _new, new_engine):
            later = cpu.sample()
        assert later is not None and later.processes == (new_engine,)
    finally:
        assert old.stdin is not None and old.stdout is not None
        old.stdin.close()
        old.wait(timeout=10)
        old.stdout.close()


def stop(pid: int) -> None:
    """SIGSTOP, then wait for the kernel to show the process stopped: the signal lands
    only once the process is next scheduled, and on a loaded machine a read made at once
    found it still running (state S), so the core was not "stopped throughout"."""
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + 10.0
    while Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] not in "Tt":
        assert time.monotonic() < deadline, f"process {pid} not stopped 10 s after SIGSTOP"
        time.sleep(0.01)


def test_a_stopped_engine_uses_no_cpu() -> None:
    with api_server_with_engine() as (port, _server, engine):
        cpu = LocalCpu(f"http://localhost:{port}")
        stop(engine)
        try:
            time.sleep(0.2)  # let the last tick land
            before = cpu.sample()
            time.sleep(0.5)
            after = cpu.sample()
        finally:
            os.kill(engine, signal.SIGCONT)
    assert before is not None and after is not None
    assert before.processes == after.processes
    assert after.seconds - before.seconds < 0.02


def test_a_backend_on_another_host_or_without_a_listener_gives_no_evidence() -> None:
    assert not LocalCpu("http://10.0.0.5:8000").applies
    assert not LocalCpu("http://gpu0.example:8000").applies
    with socket.socket() as spare:
        spare.bind(("127.0.0.1", 0))
        port = spare.getsockname()[1]  # bound, not listening
        assert LocalCpu(f"http://127.0.0.1:{port}").sample() is None


def test_a_configured_cgroup_is_read_from_its_cpu_stat(tmp_path: Path) -> None:
    (tmp_path / "cpu.stat").write_text("usage_usec 19600000\nuser_usec 19000000\n")
    cpu = LocalCpu("http://10.0.0.5:8000", cgroup=str(tmp_path))
    assert cpu.applies
    sample = cpu.sample()
    assert sample is not None
    assert sample.seconds == pytest.approx(19.6)
    (tmp_path / "cpu.stat").write_text("garbage\n")
    assert cpu.sample() is None
    assert LocalCpu("http://x:1", cgroup=str(tmp_path / "absent")).sample() is None


def test_a_sample_stuck_in_a_read_is_given_up_on_and_not_started_twice(tmp_path: Path) -> None:
    # A read of a process stuck in the kernel blocks as long as it is stuck: in asyncio's
    # pool it held the backend's probing task for ever, and the pool is joined at exit.
    # Here the read is of a FIFO no one writes: it blocks until the test writes.
    stat = tmp_path / "cpu.stat"
    os.mkfifo(stat)
    cpu = LocalCpu("http://10.0.0.5:8000", cgroup=str(tmp_path))

    def samplers() -> list[threading.Thread]:
        return [t for t in threading.enumerate() if t.name == "llmhealth-cpu-sample"]

    async def main() -> tuple[object, object, int]:
        first = await cpu.sample_within_limit()
        second = await cpu.sample_within_limit()  # the first still stuck: none stacked
        return first, second, len(samplers())

    first, second, stuck = asyncio.run(main())  # returns: no thread of it is joined
    assert (first, second, stuck) == (None, None, 1)
    with stat.open("w") as writer:  # the stuck read gets its text and ends
        writer.write("usage_usec 5000000\n")
    for thread in samplers():
        thread.join(timeout=30)
    stat.unlink()
    stat.write_text("usage_usec 7000000\n")
    third = asyncio.run(cpu.sample_within_limit())
    assert third is not None and third.seconds == pytest.approx(7.0)


def test_a_sample_cancelled_as_it_comes_in_is_cancelled_not_returned(tmp_path: Path) -> None:
    """Cancelled (a daemon stopping, a reload dropping the backend) in the same turn of
    the loop as its sample came in, the probing task went on: Python 3.11's wait_for
    returns the result and drops the cancellation. ReadTasks.close then waited for ever
    on a task still reading its backend each wait (`llmhealth demo` hung so at the end
    of its routing part, the router's port and its simulator held)."""
    stat = tmp_path / "cpu.stat"
    os.mkfifo(stat)  # the sample blocks reading it until the test writes
    cpu = LocalCpu("http://10.0.0.5:8000", cgroup=str(tmp_path))

    async def main() -> asyncio.Task[object]:
        task: asyncio.Task[object] = asyncio.create_task(cpu.sample_within_limit())
        await asyncio.sleep(0)  # its thread started, and blocks in the read
        with stat.open("w") as writer:
            writer.write("usage_usec 5000000\n")
        for thread in threading.enumerate():
            if thread.name == "llmhealth-cpu-sample":
                thread.join(timeout=30)  # its sample is handed to the loop, not taken yet
        task.cancel()
        await asyncio.wait({task})
        return task

    assert asyncio.run(main()).cancelled()


# A frozen vLLM: its /metrics (a real capture of work and no progress) is served by the
# listener, and the "engine core" child is the process that gets stopped.
# A server of the text in the file its first argument names, at every GET.
SERVING_A_FILE = """
import http.server, sys
text = open(sys.argv[1], "rb").read()
class Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.send_header("Content-Length", str(len(text)))
        self.end_headers()
        self.wfile.write(text)
    def log_message(self, *args):
        pass
server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
"""
FROZEN_SERVER = (
    ENGINE
    + SERVING_A_FILE
    + """
import signal
# The engine core, then any workers: one child process per code given.
children = [engine(code) for code in sys.argv[2:]]
print(server.server_address[1], *(child.pid for child in children), flush=True)
signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # so that the children go too
try:
    server.serve_forever()
finally:
    for child in children:
        child.kill()
"""
)


def frozen_text(folder: Path, *, young: bool = False) -> Path:
    """wedge-1 (work, frozen) whose histogram holds one gap past 80 s: window 240 s.

    ``young``: its process started a minute ago instead, and took no long step yet.
    """
    capture = Path(__file__).parent.parent / "fixtures" / "vllm-0.32" / "wedge-1.txt"
    lines = []
    for line in capture.read_text().splitlines():
        head, _, value = line.rpartition(" ")
        counted = head.startswith("vllm:inter_token_latency_seconds_count") or (
            head.startswith("vllm:inter_token_latency_seconds_bucket") and 'le="+Inf"' in head
        )
        if young and head == "process_start_time_seconds":
            lines.append(f"{head} {time.time() - 60:.2f}")
        elif counted and not young:
            lines.append(f"{head} {float(value) + 1}")
        else:
            lines.append(line)
    path = folder / "frozen.txt"
    path.write_text("\n".join(lines) + "\n")
    return path


@contextmanager
def frozen_backend(
    folder: Path, engine_code: str, *workers: str, young: bool = False
) -> Iterator[tuple[str, int]]:
    text = frozen_text(folder, young=young)
    process = subprocess.Popen(
        [sys.executable, "-c", FROZEN_SERVER, str(text), engine_code, *workers],
        stdout=subprocess.PIPE,
        text=True,
    )
    children: list[int] = []
    try:
        assert process.stdout is not None
        port, *children = (int(field) for field in process.stdout.readline().split())
        yield f"http://127.0.0.1:{port}", children[0]
    finally:
        process.terminate()
        process.wait(timeout=10)
        for child in children:
            with contextlib.suppress(ProcessLookupError):
                os.kill(child, signal.SIGKILL)  # gone with its server already, normally
        assert process.stdout is not None
        process.stdout.close()


def examine(url: str, learned: LongestStep | None = None) -> Verdict:
    settings = ProbeSettings(wait=0.5, timeout=5.0, answer_timeout=1.0, max_reads=4)

    async def run() -> Verdict:
        async with new_client() as client:
            return await examine_backend(client, Target("cpu0", url), settings, learned=learned)

    return asyncio.run(run())


SLEEPER = "import time\nwhile True: time.sleep(1)"
LEARNED = LongestStep(80.0, "engine 0: an inter-token gap over 80 s")


@pytest.mark.parametrize(
    ("young", "learned"), [(False, LEARNED), (True, None)], ids=["learned", "young"]
)
def test_a_stopped_engine_behind_a_long_window_is_wedged_in_two_waits(
    tmp_path: Path, young: bool, learned: LongestStep | None
) -> None:
    # Either an earlier run learned 80 s+ steps (window 240 s), or the process is a
    # minute old on a first run (startup window 300 s): no CPU used proves it anyway.
    with frozen_backend(tmp_path, SLEEPER, young=young) as (url, engine):
        stop(engine)
        try:
            verdict = examine(url, learned)
        finally:
            os.kill(engine, signal.SIGCONT)
    assert verdict.kind is VerdictKind.WEDGED
    assert len(verdict.reads) == 3
    assert "stopped or deadlocked, not computing" in verdict.evidence


@pytest.mark.slow
def test_an_engine_computing_behind_a_long_window_is_only_stalled(tmp_path: Path) -> None:
    with frozen_backend(tmp_path, "while True: pass") as (url, _engine):
        verdict = examine(url, LEARNED)
    assert verdict.kind is VerdictKind.STALLED
    assert "compiling or computing" in verdict.evidence
    assert "window 240 s" in verdict.evidence


def test_a_stopped_engine_core_is_wedged_while_its_worker_spins(tmp_path: Path) -> None:
    # vLLM's worker polls for the engine core's next batch, so with the core stopped the
    # engine's processes still use CPU: the stopped state of the core is the evidence.
    with frozen_backend(tmp_path, SLEEPER, "while True: pass", young=True) as (url, engine):
        stop(engine)
        try:
            verdict = examine(url)
        finally:
            os.kill(engine, signal.SIGCONT)
    assert verdict.kind is VerdictKind.WEDGED
    assert len(verdict.reads) == 3
    assert f"engine process {engine} stayed stopped by a signal (state T) throughout" in (
        verdict.evidence
    )
    assert "compiling or computing" in verdict.evidence


def counted_scans(monkeypatch: pytest.MonkeyPatch) -> list[None]:
    """One item for each scan of every process's descriptors from now on."""
    from llmhealth import localcpu  # noqa: PLC0415 - its scan is counted

    scans: list[None] = []
    real_scan = localcpu._scan_listeners

    def counted(listening: dict[int, localcpu.Socket]) -> dict[localcpu.Socket, localcpu.Holder]:
        scans.append(None)
        return real_scan(listening)

    monkeypatch.setattr(localcpu, "_scan_listeners", counted)
    return scans


def test_many_local_backends_share_one_scan_of_the_socket_tables(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Finding who listens reads every socket on the host and every process's
    descriptors: once per backend, 750 local backends cost 76 s of CPU on a host with
    30,000 sockets, and starved the check."""
    scans = counted_scans(monkeypatch)
    with api_server_with_engine() as (port, _server, engine):
        samples = [LocalCpu(f"http://127.0.0.1:{port}").sample() for _ in range(20)]
    assert [sample.processes if sample else None for sample in samples] == [(engine,)] * 20
    assert 1 <= len(scans) <= 2  # the first scan, and one more at most


def test_a_listener_whose_holder_no_scan_finds_is_not_scanned_for_at_each_sample(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A listening socket whose holder the scan cannot see (another user's process, or
    one with capabilities, under the shipped unit's capability-less root; one in another
    PID namespace): each sample of its backend scanned every process on the host again,
    as before the scan was shared. This process's own listener stands in for it: the
    scan passes this process over. A server started meanwhile is still found at once."""
    scans = counted_scans(monkeypatch)
    with socket.socket() as unseen:
        unseen.bind(("127.0.0.1", 0))
        unseen.listen()
        url = f"http://127.0.0.1:{unseen.getsockname()[1]}"
        assert [LocalCpu(url).sample() for _ in range(20)] == [None] * 20
        assert 1 <= len(scans) <= 2
        with api_server_with_engine() as (port, _server, engine):
            sample = LocalCpu(f"http://127.0.0.1:{port}").sample()
    assert sample is not None and sample.processes == (engine,)


# A listener whose descriptor before its listening socket (a connection) is closed when
# told to, as a server's connections close while its descriptors are read.
CLOSING = (
    ENGINE
    + """
import os, socket, sys
early, _ = os.pipe()
listener = socket.socket()
listener.bind(("127.0.0.1", 0))
listener.listen()
engine = engine("import time\\nwhile True: time.sleep(1)")
print(listener.getsockname()[1], engine.pid, early, listener.fileno(), flush=True)
try:
    sys.stdin.readline()
    os.close(early)
    print("closed", flush=True)
    sys.stdin.read()
finally:
    engine.kill()
    engine.wait()
"""
)


def test_a_descriptor_closed_during_the_scan_hides_no_listening_socket(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A descriptor closed between the listing of a process's descriptors and its own
    read ended the read of all the others: the listening socket after it went unfound."""
    from llmhealth import localcpu  # noqa: PLC0415 - its scan alone

    process = subprocess.Popen(
        [sys.executable, "-c", CLOSING], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert process.stdin is not None and process.stdout is not None
        port, _engine, early, held = (int(field) for field in process.stdout.readline().split())
        assert early < held  # read first: /proc lists descriptors in order
        real_readlink = os.readlink

        def closing_first(path: str) -> str:
            if path == f"/proc/{process.pid}/fd/{early}" and process.stdin is not None:
                process.stdin.write("close\n")
                process.stdin.flush()
                assert process.stdout is not None and process.stdout.readline() == "closed\n"
            return real_readlink(path)

        monkeypatch.setattr(os, "readlink", closing_first)
        found = localcpu._scan_listeners(localcpu._listening_sockets())
        monkeypatch.undo()
    finally:
        assert process.stdin is not None and process.stdout is not None
        process.stdin.close()
        process.wait(timeout=10)
        process.stdout.close()
    assert found.get((ipaddress.ip_address("127.0.0.1"), port), (None,))[0] == process.pid


def test_the_engine_is_found_without_reading_every_process_on_the_host(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Each sample of an idle or frozen engine looked for its processes in every
    /proc/<pid>/stat of the host: 4.5 s of CPU in a check of 750 idle local backends."""
    from llmhealth import localcpu  # noqa: PLC0415 - its /proc root is swapped below

    stats: list[str] = []

    class CountedPath(type(Path())):  # type: ignore[misc]
        def read_text(self, *args: object, **kwargs: object) -> str:
            if self.name == "stat":
                stats.append(self.parent.name)
            return super().read_text(*args, **kwargs)  # type: ignore[arg-type]

    with api_server_with_engine() as (port, server, engine):
        cpu = LocalCpu(f"http://127.0.0.1:{port}")
        assert cpu.sample() is not None  # the listener found, the sockets scanned
        monkeypatch.setattr(localcpu, "_PROC", CountedPath("/proc"))
        sample = cpu.sample()
        read = len(stats)
        walked = localcpu._descendants(server)
        scanned = localcpu._scan_descendants(server)  # the way without children lists
    assert sample is not None and sample.processes == (engine,)
    assert read <= 3  # the listener's start time, and the engine's CPU
    assert walked == scanned == [engine]


def _listening(family: socket.AddressFamily, host: str) -> socket.socket:
    listener = socket.socket(family)
    if family == socket.AF_INET6:
        listener.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
    listener.bind((host, 0))
    listener.listen()
    return listener


def test_the_kernels_socket_diagnostics_list_what_proc_net_tcp_lists() -> None:
    from llmhealth import localcpu  # noqa: PLC0415 - its private scans, side by side

    with contextlib.ExitStack() as held:
        listeners = [held.enter_context(_listening(socket.AF_INET, "127.0.0.2"))]
        if socket.has_ipv6:
            with contextlib.suppress(OSError):  # a host without IPv6 loopback
                listeners.append(held.enter_context(_listening(socket.AF_INET6, "::1")))
                mapped = _listening(socket.AF_INET6, "::ffff:127.0.0.5")
                listeners.append(held.enter_context(mapped))
        # A connection too: only listening sockets are listed.
        client = held.enter_context(socket.create_connection(listeners[0].getsockname()[:2]))
        by_kernel = localcpu._diag_listening()
        by_proc = localcpu._proc_listening()
        ours = {os.fstat(sock.fileno()).st_ino: sock.getsockname()[:2] for sock in listeners}
        connected = os.fstat(client.fileno()).st_ino
    for inode, (host, port) in ours.items():
        expected = localcpu._plain_address(ipaddress.ip_address(host)), port
        assert by_kernel.get(inode) == by_proc.get(inode) == expected, (host, port)
    assert connected not in by_kernel and connected not in by_proc


def test_without_socket_diagnostics_the_listeners_come_from_proc(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A sandbox that refuses netlink sockets: the slower way, the same answer.
    real_socket = socket.socket

    def no_netlink(family: int = -1, *args: object, **kwargs: object) -> socket.socket:
        if family == socket.AF_NETLINK:
            raise PermissionError(1, "netlink refused")
        return real_socket(family, *args, **kwargs)  # type: ignore[arg-type]

    with api_server_with_engine("127.0.0.6") as (port, _server, engine):
        monkeypatch.setattr(socket, "socket", no_netlink)
        sample = LocalCpu(f"http://127.0.0.6:{port}").sample()
    assert sample is not None and sample.processes == (engine,)


class _Datagrams:
    """A netlink socket's side of a dump, as the tests below need it answered."""

    def __init__(self, datagrams: list[bytes]) -> None:
        self._datagrams = datagrams
        self._then = datagrams[-1] if datagrams else b""  # then the last one, for ever

    def recv(self, _size: int) -> bytes:
        return self._datagrams.pop(0) if self._datagrams else self._then


def _message(kind: int, sequence: int, body: bytes = b"", length: int | None = None) -> bytes:
    size = 16 + len(body) if length is None else length
    return struct.pack("=IHHII", size, kind, 0, sequence, 0) + body


@pytest.mark.parametrize(
    ("datagrams", "error"),
    [
        ([_message(20, 1, length=4)], ValueError),  # shorter than its own header
        ([_message(2, 1, b"\0" * 20)], OSError),  # the kernel's error answer
        ([_message(20, 1, b"\0" * 72)] * 1000, ValueError),  # no end: bounded
        ([b""], ValueError),  # nothing at all, for ever: not a loop
    ],
    ids=["short", "refused", "endless", "empty"],
)
def test_a_broken_socket_diagnostics_dump_is_an_error_not_an_answer(
    monkeypatch: pytest.MonkeyPatch, datagrams: list[bytes], error: type[Exception]
) -> None:
    from llmhealth import localcpu  # noqa: PLC0415 - its dump reader alone

    monkeypatch.setattr(localcpu, "_DIAG_MAX_BYTES", 64 * 1024)
    with pytest.raises(error):
        localcpu._read_diag_dump(_Datagrams(datagrams), 1, {})  # type: ignore[arg-type]


# A forwarder on this host, its engine elsewhere, that names vLLM only in its arguments
# (`kubectl port-forward svc/vllm`, `ssh -L 8000:localhost:8000 vllm-01`) or in the
# directories of its path (a vllm service account's ~/.local/bin/kubectl).
FORWARDER = """
import socket, sys
listener = socket.socket()
listener.bind(("127.0.0.1", 0))
listener.listen()
print(listener.getsockname()[1], flush=True)
sys.stdin.read()
"""
FORWARDED_FROZEN = (
    SERVING_A_FILE
    + """
print(server.server_address[1], flush=True)
server.serve_forever()
"""
)


def forwarder_program(tmp_path: Path, where: str) -> tuple[str, list[str]]:
    """The forwarder's program and the arguments after its code: this Python, told the
    vLLM it forwards to, or a link to it in the home of a service account named vllm."""
    if where == "arguments":
        return sys.executable, ["port-forward", "svc/vllm", "8000:8000"]
    home_bin = tmp_path / "home" / "vllm" / ".local" / "bin"
    home_bin.mkdir(parents=True)
    kubectl = home_bin / "kubectl"
    os.symlink(os.path.realpath(sys.executable), kubectl)
    return str(kubectl), ["port-forward", "svc/model", "8000:8000"]


@pytest.mark.parametrize("where", ["arguments", "directory"])
def test_a_forwarder_naming_vllm_outside_its_programs_name_gives_no_evidence(
    tmp_path: Path, where: str
) -> None:
    program, arguments = forwarder_program(tmp_path, where)
    with listening([program, "-c", FORWARDER, *arguments]) as port:
        sample = LocalCpu(f"http://127.0.0.1:{port}").sample()
    # Its idle CPU is not the remote engine's: sampled, it proves a computing engine
    # wedged in two waits ("the engine is doing nothing").
    assert sample is None, sample


@pytest.mark.slow
@pytest.mark.parametrize("where", ["arguments", "directory"])
def test_an_engine_inside_a_long_step_behind_such_a_forwarder_is_not_wedged(
    tmp_path: Path, where: str
) -> None:
    # The remote engine is inside an 80 s step (window 240 s); the local forwarder idles.
    program, arguments = forwarder_program(tmp_path, where)
    process = subprocess.Popen(
        [program, "-c", FORWARDED_FROZEN, str(frozen_text(tmp_path)), *arguments],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert process.stdout is not None
        port = int(process.stdout.readline())
        verdict = examine(f"http://127.0.0.1:{port}", LEARNED)
    finally:
        process.terminate()
        process.wait(timeout=10)
        assert process.stdout is not None
        process.stdout.close()
    assert verdict.kind is not VerdictKind.WEDGED, verdict.evidence


# An API server with its engine and one helper, the server or the helper named (through
# /proc/<pid>/comm, as prctl and setproctitle name a process) with a name the kernel cut
# at 15 bytes, inside a character: "tokenizer-poolü" is kept as b"tokenizer-pool\xc3".
ODDLY_NAMED = (
    ENGINE
    + """
import socket, subprocess, sys
NAME = "tokenizer-pool\\u00fc".encode()
def named():
    with open("/proc/self/comm", "wb") as comm:
        comm.write(NAME)
listener = socket.socket()
listener.bind(("127.0.0.1", 0))
listener.listen()
engine = engine("import time\\nwhile True: time.sleep(1)")
helper = subprocess.Popen(
    [sys.executable, "-c", "import sys, time\\nexec(sys.argv[1])\\nnamed()\\ntime.sleep(600)",
     "def named():\\n    open('/proc/self/comm', 'wb').write(%r)" % NAME]
)
if sys.argv[1] == "server":
    named()
for _ in range(10_000):  # the helper renamed itself
    with open(f"/proc/{helper.pid}/comm", "rb") as comm:
        if comm.read().startswith(NAME[:14]):
            break
    time.sleep(0.001)
print(listener.getsockname()[1], engine.pid, helper.pid, flush=True)
try:
    sys.stdin.read()
finally:
    for child in (engine, helper):
        child.kill()
        child.wait()
"""
)


@pytest.mark.parametrize("named", ["server", "helper"])
def test_a_process_name_cut_inside_a_character_still_gives_evidence(named: str) -> None:
    """/proc/<pid>/stat holds the name as the kernel keeps it, 15 bytes cut anywhere: read
    as UTF-8 text, one such name (the API server's, or any process below it) failed every
    sample of the backend, and its engine was never sampled."""
    process = subprocess.Popen(
        [sys.executable, "-c", ODDLY_NAMED, named],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert process.stdin is not None and process.stdout is not None
        port, engine, helper = (int(field) for field in process.stdout.readline().split())
        with open(f"/proc/{process.pid if named == 'server' else helper}/comm", "rb") as comm:
            assert comm.read() == b"tokenizer-pool\xc3\n"  # what the kernel kept
        sample = LocalCpu(f"http://127.0.0.1:{port}").sample()
    finally:
        assert process.stdin is not None and process.stdout is not None
        process.stdin.close()
        process.wait(timeout=10)
        process.stdout.close()
    assert sample is not None
    assert sample.processes == tuple(sorted((engine, helper)))


def test_samples_are_timed_on_the_steady_clock(tmp_path: Path) -> None:
    """Two samples' span divides the CPU they show: on the wall clock, a step forward
    between them (NTP, a VM resumed, ``date -s``) made an engine computing all along use
    "no CPU" over the hour the clock jumped, and wedged it at two waits."""
    (tmp_path / "cpu.stat").write_text("usage_usec 19600000\n")
    with api_server_with_engine() as (port, _server, _engine):
        for cpu in (
            LocalCpu("http://10.0.0.5:8000", cgroup=str(tmp_path)),
            LocalCpu(f"http://127.0.0.1:{port}"),
        ):
            before = time.monotonic()
            sample = cpu.sample()
            after = time.monotonic()
            assert sample is not None and sample.at is not None
            assert before <= sample.at <= after


def test_a_stopped_engine_core_in_a_configured_cgroup_is_named_stopped(tmp_path: Path) -> None:
    # Named by the unit's cgroup rather than by its port, the engine core stopped by a
    # signal went unnamed: its spinning worker kept the group's CPU above the idle share.
    with api_server_with_engine() as (_port, server, engine):
        (tmp_path / "cpu.stat").write_text("usage_usec 19600000\n")
        (tmp_path / "cgroup.procs").write_text(f"{server}\n")
        (tmp_path / "engine").mkdir()  # the engine in a group of its own below the unit's
        (tmp_path / "engine" / "cgroup.procs").write_text(f"{engine}\n")
        cpu = LocalCpu("http://10.0.0.5:8000", cgroup=str(tmp_path))
        stop(engine)
        try:
            sample = cpu.sample()
        finally:
            os.kill(engine, signal.SIGCONT)
    assert sample is not None
    assert sample.seconds == pytest.approx(19.6)
    assert sample.stopped == (engine,)


@pytest.mark.slow
def test_a_cgroup_holding_no_vllm_process_gives_no_evidence(tmp_path: Path) -> None:
    # A unit that runs `docker run`: its group holds the idle client, the engine computes
    # in the container's group. The group's flat CPU wedged that engine in two waits.
    with (
        frozen_backend(tmp_path, "while True: pass") as (url, _engine),
        subprocess.Popen([sys.executable, "-c", SLEEPER]) as client,
    ):
        try:
            unit = tmp_path / "unit"
            unit.mkdir()
            (unit / "cpu.stat").write_text("usage_usec 19600000\n")
            (unit / "cgroup.procs").write_text(f"{client.pid}\n")
            settings = ProbeSettings(wait=0.5, timeout=5.0, answer_timeout=1.0, max_reads=4)

            async def run() -> Verdict:
                async with new_client() as http:
                    target = Target("cpu0", url, cgroup=str(unit))
                    return await examine_backend(http, target, settings, learned=LEARNED)

            verdict = asyncio.run(run())
        finally:
            client.kill()
    assert verdict.kind is not VerdictKind.WEDGED, verdict.evidence
    assert "window 240 s" in verdict.evidence


# What the shipped units' root, stripped of every capability, sees of a backend.
UNIT_ROOT = ["setpriv", "--bounding-set=-all", "--inh-caps=-all", "--"]
SAMPLED = """
import sys
from llmhealth.localcpu import LocalCpu
sample = LocalCpu(*sys.argv[1:]).sample()
print(None if sample is None else sample.processes)
"""


@pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("setpriv") is None, reason="root, and util-linux setpriv"
)
def test_the_units_capability_less_root_finds_a_backend_by_its_cgroup_not_its_port(
    tmp_path: Path,
) -> None:
    """README.md and systemd/llmhealth.service say so: the holder of a port is seen only
    through its descriptors, which the kernel shows a capability-less root only for
    root's processes without capabilities."""
    with api_server_with_engine() as (port, server, engine):
        (tmp_path / "cpu.stat").write_text("usage_usec 19600000\n")
        (tmp_path / "cgroup.procs").write_text(f"{server}\n{engine}\n")
        seen = [
            subprocess.run(
                [*UNIT_ROOT, sys.executable, "-c", SAMPLED, f"http://127.0.0.1:{port}", *where],
                capture_output=True,
                text=True,
                check=True,
            ).stdout.strip()
            for where in ([], [str(tmp_path)])
        ]
    assert seen == ["None", f"({os.stat(tmp_path).st_ino},)"]


# What the server below does: start its engine as it was started itself.
RUNS_ITSELF = "import subprocess, sys; subprocess.run([sys.executable, '-c', ''], check=True)"


def granted(*capabilities: str) -> list[str]:
    """The unit's root given back these capabilities alone, as systemd/llmhealth.service
    suggests."""
    some = ",".join(f"+{name}" for name in capabilities)
    return [
        "setpriv",
        f"--bounding-set=-all,{some}",
        f"--inh-caps=-all,{some}",
        f"--ambient-caps=-all,{some}",
        "--",
    ]


@pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("setpriv") is None, reason="root, and util-linux setpriv"
)
def test_another_users_engine_is_found_by_its_port_with_dac_read_search_as_well_as_ptrace() -> None:
    """README.md and systemd/llmhealth.service: CAP_SYS_PTRACE alone, given back to the
    unit's root, found no vLLM of another user by its port: listing its /proc/<pid>/fd
    is that user's alone, CAP_DAC_READ_SEARCH's besides."""
    nobody = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "--"]
    # The tests' interpreter may lie in a directory that user cannot enter (root's home).
    tried = (os.path.realpath(sys.executable), "/usr/bin/python3")
    ran = [
        subprocess.run([*nobody, python, "-c", RUNS_ITSELF], check=False, stderr=subprocess.DEVNULL)
        for python in tried
    ]
    runs = [python for python, done in zip(tried, ran, strict=True) if done.returncode == 0]
    if not runs:
        pytest.skip("no Python another user may run")
    python = runs[0]
    server = subprocess.Popen(
        [*nobody, python, "-c", SERVER, "127.0.0.1", "0"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert server.stdout is not None
        port, engine = (int(field) for field in server.stdout.readline().split())
        seen = [
            subprocess.run(
                [*given, sys.executable, "-c", SAMPLED, f"http://127.0.0.1:{port}"],
                capture_output=True,
                text=True,
                check=True,
            ).stdout.strip()
            for given in (granted("sys_ptrace"), granted("sys_ptrace", "dac_read_search"))
        ]
    finally:
        assert server.stdin is not None and server.stdout is not None
        server.stdin.close()
        server.wait(timeout=10)
        server.stdout.close()
    assert seen == ["None", f"({engine},)"]
