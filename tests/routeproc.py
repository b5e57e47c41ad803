"""`llmhealth route` as a real process, and idle client sockets against it: the helpers
tests/test_route.py and the e2e lane's connection-load test share."""

from __future__ import annotations

import contextlib
import resource
import selectors
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import httpx
from simproc import child_env

BOUND = 60.0  # seconds any awaited condition may take on a loaded machine; not a claim
FIRST_BYTE = 1.0
COMPLETION = {"model": "tiny", "prompt": "hi", "max_tokens": 2}  # what the simulator serves
ACCEPT_BATCH = 500  # idle connections opened before a real client must be answered


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@contextlib.contextmanager
def running_route(
    entry_point: str,
    config: Path,
    port: int,
    file_limit: tuple[int, int] | None = None,
    started: list[int] | None = None,
    more: Sequence[str] = (),
) -> Iterator[str]:
    """`llmhealth route` on ``port`` until the block ends; always stopped.

    ``file_limit``: the (soft, hard) open-file limit it starts with; ``started`` gets its
    PID; ``more``: further arguments.
    """

    def limited() -> None:
        if file_limit is not None:
            resource.setrlimit(resource.RLIMIT_NOFILE, file_limit)

    with tempfile.TemporaryFile() as stderr:
        process = subprocess.Popen(
            [entry_point, "route", "--config", str(config), "--listen", f"127.0.0.1:{port}", *more],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=stderr,
            env=child_env(),
            preexec_fn=limited if file_limit is not None else None,  # noqa: PLW1509
        )
        if started is not None:
            started.append(process.pid)
        url = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + BOUND
            while True:
                assert process.poll() is None, _text(stderr)
                with contextlib.suppress(httpx.HTTPError):
                    if httpx.get(url + "/health", timeout=2).status_code == 200:
                        break
                assert time.monotonic() < deadline, f"route not up; stderr:\n{_text(stderr)}"
                time.sleep(0.1)
            yield url
        finally:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(15)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(5)
        assert process.returncode == 0, _text(stderr)


def _text(stderr: object) -> str:
    assert hasattr(stderr, "seek") and hasattr(stderr, "read")
    stderr.seek(0)
    text: str = stderr.read().decode(errors="replace")
    return text


def write_config(
    tmp_path: Path, backends: dict[str, str], extra: str = "", first_byte: float = FIRST_BYTE
) -> Path:
    """A `route` config over ``backends``; ``extra`` lines go into its [router] table."""
    lines = [
        'wait = "0.5s"',
        f'state = "{tmp_path / "state.json"}"',
        "[policy]",
        "unhealthy_threshold = 3",
        "[router]",
        f'first_byte_timeout = "{first_byte}s"',
        f'connect_timeout = "{min(3.0, first_byte * 0.9):g}s"',  # within the first-byte bound
        extra,
    ]
    for name, url in backends.items():
        lines += ["[[backend]]", f'name = "{name}"', f'url = "{url}"']
    path = tmp_path / "llmhealth.toml"
    path.write_text("\n".join(lines) + "\n")
    return path


def open_files(pid: int) -> int:
    return len(list(Path(f"/proc/{pid}/fd").iterdir()))


def idle_sockets(port: int, count: int, route: str) -> list[socket.socket]:
    """``count`` client connections that never send a whole request, a tenth of them half
    a request head, and a real client answered after every ``ACCEPT_BATCH`` of them.

    The real client's connection comes after the batch in the router's listen queue, so
    its answer also says the router accepted the batch: a queue that overflows drops
    SYNs, and the kernel resends them only a second later.
    """
    held: list[socket.socket] = []
    try:
        for index in range(count):
            sock = socket.create_connection(("127.0.0.1", port), timeout=BOUND)
            held.append(sock)
            if index % 10 == 0:  # a head that never ends (slowloris)
                sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
            if (index + 1) % ACCEPT_BATCH == 0 or index + 1 == count:
                reply = httpx.post(route + "/v1/completions", json=COMPLETION, timeout=BOUND)
                assert reply.status_code == 200, (index, reply.text)
    except BaseException:
        for sock in held:
            sock.close()
        raise
    return held


def wait_closed_by_peer(sockets: list[socket.socket], count: int) -> None:
    """Until ``count`` of ``sockets`` have been closed by the router (end of stream)."""
    closed = 0
    with selectors.DefaultSelector() as selector:
        for sock in sockets:
            sock.setblocking(False)
            selector.register(sock, selectors.EVENT_READ)
        deadline = time.monotonic() + BOUND
        while closed < count:
            assert time.monotonic() < deadline, f"only {closed} of {count} closed by the router"
            for key, _ in selector.select(timeout=1):
                sock = key.fileobj
                assert isinstance(sock, socket.socket)
                with contextlib.suppress(BlockingIOError):
                    try:
                        data = sock.recv(4096)
                    except ConnectionResetError:
                        data = b""
                    if not data:
                        selector.unregister(sock)
                        closed += 1


@contextlib.contextmanager
def file_limit_at_least(wanted: int) -> Iterator[int]:
    """This process's open-file soft limit raised toward ``wanted`` (the hard limit caps it);
    the limit reached. Restored afterwards."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    reachable = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
    if soft != resource.RLIM_INFINITY and soft < reachable:
        resource.setrlimit(resource.RLIMIT_NOFILE, (reachable, hard))
    try:
        yield resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
