"""Start, find and always stop a real vLLM API server for the e2e lane. Stdlib only.

`VllmServer(port, log_path).start()` launches `python -m vllm.entrypoints.openai.api_server`
from `.venv-e2e` in its own process group (which holds the API server, the EngineCore and
its worker), waits for `/v1/models` with a bound, and `stop()` ends the whole group, waking
stopped processes first. `engine_core_pid()` finds the EngineCore child
through /proc (psutil is not guaranteed).

It is also a small command line, so that a restart command can use the same code:
`python e2e/vllm_server.py restart --pidfile F --port P --log L` kills the group named in F
and starts a new server in the background without waiting for it.
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VENV_PYTHON = ROOT / ".venv-e2e" / "bin" / "python"
MODEL_DIR = ROOT / ".e2e" / "model"
SLOW_MODEL_DIR = ROOT / ".e2e" / "model-slow"  # make_model.py's "slow" shape
VLLM_CLI = Path(__file__).resolve().parent / "vllm_cli.py"
MODEL_NAME = "tiny"
MAX_NUM_SEQS = 4
MAX_MODEL_LEN = 2048
READY_TIMEOUT = 240.0
STOP_TIMEOUT = 20.0
LOG_TAIL_LINES = 60
# Access-log lines of polling, and the list of routes at startup: left out of the log tail
# that a failure prints, where they would crowd out what matters.
_POLLING = ('"GET /metrics HTTP', '"GET /v1/models HTTP', '"GET /health HTTP', "] Route: /")
# Below Linux's ephemeral range (32768+), so outgoing connections do not take these ports,
# and below tests/simproc.py's 20000-32000, so simulators that the unit tests start on the
# same machine do not take a port between our pick and vLLM's bind (a minute later).
PORT_RANGE = (12000, 19999)

SERVER_ENV = {
    # 1 GiB of KV cache is plenty for a 2,048-position model with 4 sequences.
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "TOKENIZERS_PARALLELISM": "false",
}


class ServerError(RuntimeError):
    """The server did not come up or did not go away; the message ends with its log tail."""


def free_port() -> int:
    """A port nobody listens on now, picked at random below the ephemeral range."""
    for _ in range(200):
        port = random.randint(*PORT_RANGE)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise ServerError("no free port found in 200 tries")


def server_argv(
    port: int,
    extra: Sequence[str] = (),
    *,
    serve: bool = False,
    model: Path = MODEL_DIR,
    max_model_len: int = MAX_MODEL_LEN,
    dtype: str = "bfloat16",
) -> list[str]:
    """The API server's command: the module entry point, or with ``serve`` the `vllm serve`
    command line (through e2e/vllm_cli.py), which alone runs several API servers."""
    entry = (
        [str(VLLM_CLI), "serve", str(model)]
        if serve
        else ["-m", "vllm.entrypoints.openai.api_server", "--model", str(model)]
    )
    return [
        str(VENV_PYTHON),
        *entry,
        "--served-model-name",
        MODEL_NAME,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--dtype",
        dtype,
        "--max-model-len",
        str(max_model_len),
        "--max-num-seqs",
        str(MAX_NUM_SEQS),
        *extra,
    ]


# --- /proc ---------------------------------------------------------------------------


def _stat_fields(pid: int) -> list[str] | None:
    """Fields of /proc/PID/stat after the command name (which may hold spaces and parens)."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text(encoding="utf-8", errors="replace")
    except OSError:
        return None
    return text[text.rfind(")") + 2 :].split()


def process_state(pid: int) -> str | None:
    """One letter: R, S, T (stopped), Z...; None when there is no such process."""
    fields = _stat_fields(pid)
    return fields[0] if fields else None


def children_of(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            fields = _stat_fields(int(entry.name))
            if fields and fields[1] == str(pid):
                found.append(int(entry.name))
    return sorted(found)


def descendants_of(pid: int) -> list[int]:
    found, todo = [], [pid]
    while todo:
        for child in children_of(todo.pop()):
            found.append(child)
            todo.append(child)
    return found


def group_members(pgid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            fields = _stat_fields(int(entry.name))
            if fields and fields[2] == str(pgid) and fields[0] != "Z":
                found.append(int(entry.name))
    return sorted(found)


def process_title(pid: int) -> str:
    """What `ps` shows: vLLM renames its processes (``VLLM::EngineCore``) with setproctitle."""
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
        comm = Path(f"/proc/{pid}/comm").read_text(encoding="utf-8", errors="replace").strip()
    except OSError:
        return ""
    return raw.replace(b"\0", b" ").decode(errors="replace").strip() + f" [{comm}]"


def listening_pids(port: int) -> set[int]:
    """PIDs holding a socket that listens on 127.0.0.1:``port`` (or any address)."""
    inodes = set()
    with contextlib.suppress(OSError):
        for line in Path("/proc/net/tcp").read_text(encoding="ascii").splitlines()[1:]:
            fields = line.split()
            local, state, inode = fields[1], fields[3], fields[9]
            if state == "0A" and int(local.rsplit(":", 1)[1], 16) == port:
                inodes.add(f"socket:[{inode}]")
    holders = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            for fd in (entry / "fd").iterdir():
                with contextlib.suppress(OSError):
                    if os.readlink(fd) in inodes:
                        holders.add(int(entry.name))
    return holders


def _signal_quietly(pid: int, signum: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.kill(pid, signum)


# --- the server ------------------------------------------------------------------------


@dataclass
class VllmServer:
    port: int
    log_path: Path
    env: Mapping[str, str] = field(default_factory=dict)
    extra_args: Sequence[str] = ()
    serve: bool = False  # `vllm serve` instead of the module entry point
    model: Path = MODEL_DIR
    max_model_len: int = MAX_MODEL_LEN
    dtype: str = "bfloat16"
    pid: int | None = None
    _process: subprocess.Popen[bytes] | None = field(default=None, repr=False)
    starts: int = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    # Launch and readiness.

    def launch(self) -> int:
        """Start the server in its own session and return at once; the log is appended to."""
        if not VENV_PYTHON.exists() or not self.model.exists():
            raise ServerError(f"{VENV_PYTHON} or {self.model} missing: run `python3 e2e/setup.py`")
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, **SERVER_ENV, **self.env}
        with self.log_path.open("ab") as log:
            log.write(f"\n===== e2e: start #{self.starts + 1} on port {self.port} =====\n".encode())
            log.flush()
            self._process = subprocess.Popen(
                server_argv(
                    self.port,
                    self.extra_args,
                    serve=self.serve,
                    model=self.model,
                    max_model_len=self.max_model_len,
                    dtype=self.dtype,
                ),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                cwd=ROOT,
                # Its own process group, so that stop() reaches the engine too; but not its
                # own session. With the kernel's autogroups a session is a scheduling group,
                # and a busy vLLM in a group of its own left a waking test process or
                # llmhealth waiting seconds for a CPU on 2 cores (measured: 10 s of runqueue
                # wait in 12 s). In the caller's session, they compete task by task.
                process_group=0,
            )
        self.pid = self._process.pid
        self.starts += 1
        return self.pid

    def wait_ready(self, timeout: float = READY_TIMEOUT) -> float:
        """Poll /v1/models until it lists the model; seconds taken. Bounded, and it notices
        a server that exited."""
        started = time.monotonic()
        deadline = started + timeout
        while time.monotonic() < deadline:
            if not self.alive():
                raise ServerError(f"vLLM exited during startup\n{self.log_tail()}")
            # http.client, not urllib: environment proxies must not come between us.
            connection = http.client.HTTPConnection("127.0.0.1", self.port, timeout=2)
            try:
                connection.request("GET", "/v1/models")
                body = json.loads(connection.getresponse().read())
                models = body.get("data", []) if isinstance(body, dict) else []
                if any(isinstance(m, dict) and m.get("id") == MODEL_NAME for m in models):
                    self._check_port_is_ours()
                    return time.monotonic() - started
            except (OSError, ValueError, http.client.HTTPException):
                pass
            finally:
                connection.close()
            time.sleep(0.5)
        raise ServerError(f"vLLM not ready after {timeout:.0f} s\n{self.log_tail()}")

    def _check_port_is_ours(self) -> None:
        """Whoever answered must be this server, not something else that took the port."""
        assert self.pid is not None
        ours = {self.pid, *descendants_of(self.pid)}
        holders = listening_pids(self.port)
        if holders and not holders & ours:
            titles = {pid: process_title(pid) for pid in holders}
            raise ServerError(f"port {self.port} is held by another process: {titles}")

    def start(self, timeout: float = READY_TIMEOUT) -> float:
        self.launch()
        try:
            return self.wait_ready(timeout)
        except BaseException:
            self.stop()
            raise

    def adopt(self, pid: int) -> None:
        """Take charge of a server started by someone else (a restart command)."""
        self._process = None
        self.pid = pid

    # Inspection.

    def alive(self) -> bool:
        if self.pid is None:
            return False
        if self._process is not None:
            return self._process.poll() is None
        state = process_state(self.pid)
        return state is not None and state != "Z"

    def engine_core_pid(self, timeout: float = 10.0) -> int:
        """The EngineCore process: the API server's descendant titled ``VLLM::EngineCore``."""
        if self.pid is None:
            raise ServerError("server not started")
        deadline = time.monotonic() + timeout
        while True:
            for pid in descendants_of(self.pid):
                if "EngineCore" in process_title(pid):
                    return pid
            if time.monotonic() > deadline:
                titles = {pid: process_title(pid) for pid in descendants_of(self.pid)}
                raise ServerError(f"no EngineCore among the server's descendants: {titles}")
            time.sleep(0.2)

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(encoding="utf-8", errors="replace")
        except OSError:
            return ""

    def log_tail(self, lines: int = LOG_TAIL_LINES) -> str:
        """The log's last lines, without the polling (/metrics, /v1/models) access lines."""
        lines_all = self.log_text().splitlines()
        kept = [line for line in lines_all if not any(poll in line for poll in _POLLING)]
        tail = "\n".join(kept[-lines:])
        return (
            f"--- last {lines} lines of {self.log_path} (polling requests left out) ---\n"
            f"{tail}\n--- end of log ---"
        )

    # Stopping.

    def stop(self, timeout: float = STOP_TIMEOUT) -> None:
        """End the whole process group (and any descendant that left it), always.

        Stopped (SIGSTOP) processes are woken first, or SIGTERM would wait for them.
        """
        if self.pid is None:
            return
        stop_group(self.pid, timeout)
        if self._process is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._process.wait(1)
        self._process = None
        self.pid = None

    def restart(self, timeout: float = READY_TIMEOUT) -> float:
        self.stop()
        wait_port_free(self.port)
        return self.start(timeout)


def stop_group(leader: int, timeout: float = STOP_TIMEOUT) -> None:
    """SIGCONT, SIGTERM, then SIGKILL to the session started for ``leader`` and everything
    below it, each bounded; returns when none of them is left."""
    targets = set(group_members(leader)) | set(descendants_of(leader)) | {leader}
    for pid in targets:
        _signal_quietly(pid, signal.SIGCONT)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(leader, signal.SIGTERM)
    for pid in targets:
        _signal_quietly(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and _any_alive(targets):
        _reap_children()
        time.sleep(0.2)
    if _any_alive(targets):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(leader, signal.SIGKILL)
        for pid in targets:
            _signal_quietly(pid, signal.SIGKILL)
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and _any_alive(targets):
            _reap_children()
            time.sleep(0.1)
    _reap_children()


def _any_alive(pids: set[int]) -> bool:
    return any(process_state(pid) not in (None, "Z") for pid in pids)


def _reap_children() -> None:
    """Collect our own exited children, so that they do not linger as zombies."""
    with contextlib.suppress(ChildProcessError):
        while True:
            pid, _ = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                return


def wait_port_free(port: int, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:
                time.sleep(0.2)
                continue
            return
    holders = subprocess.run(
        ["ss", "-tanp", f"sport = :{port}"], capture_output=True, text=True, check=False
    ).stdout
    raise ServerError(f"port {port} still taken after {timeout:.0f} s:\n{holders}")


@contextlib.contextmanager
def running_server(
    log_path: Path, env: Mapping[str, str] | None = None, port: int | None = None
) -> Iterator[VllmServer]:
    """A started server that is stopped when the block exits, however it exits."""
    server = VllmServer(port or free_port(), log_path, env=dict(env or {}))
    try:
        server.start()
        yield server
    finally:
        server.stop()


# --- command line, for restart scripts --------------------------------------------------


def _read_pid(pidfile: Path) -> int | None:
    try:
        return int(pidfile.read_text(encoding="utf-8").strip())
    except (OSError, ValueError):
        return None


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Start or restart the e2e vLLM server.")
    parser.add_argument("action", choices=["start", "restart", "stop"])
    parser.add_argument("--pidfile", type=Path, required=True)
    parser.add_argument("--port", type=int)
    parser.add_argument("--log", type=Path)
    parser.add_argument("--wait", action="store_true", help="Wait until it serves the model.")
    args = parser.parse_args(argv)
    old = _read_pid(args.pidfile)
    if args.action in ("restart", "stop") and old is not None:
        stop_group(old)
        print(f"stopped process group {old}")
    if args.action == "stop":
        args.pidfile.unlink(missing_ok=True)
        return 0
    if args.port is None or args.log is None:
        parser.error("start and restart need --port and --log")
    wait_port_free(args.port)
    server = VllmServer(args.port, args.log)
    pid = server.launch()
    args.pidfile.write_text(f"{pid}\n", encoding="utf-8")
    print(f"started vLLM as pid {pid} on port {args.port}, log {args.log}")
    if args.wait:
        try:
            server.wait_ready()
        except BaseException:
            # Not ready in time (a loaded machine): a server nobody will adopt must not be
            # left running, so the caller's clean-up has nothing to miss.
            server.stop()
            args.pidfile.unlink(missing_ok=True)
            raise
    return 0


if __name__ == "__main__":
    sys.exit(main())
