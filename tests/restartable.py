"""Test harness: simulated vLLM servers that a configured restart command really restarts.

Each server is one `llmhealth simulate MODE --port P` process, started detached (its own
session, output to a log file, its PID in a pidfile) by a short-lived launcher, so it is
nobody's child in the test and outlives whichever process started it, as a real server
outlives the `systemctl restart` that started it. The same file is the restart command:

    [sys.executable, "tests/restartable.py", "restart", "--pidfile", F, "--port", P,
     "--mode", M]

stops the process named in the pidfile, starts a new one in mode M on the same port (a new
process, so a new `process_start_time_seconds`), waits (bounded) until it answers, writes
its PID and exits 0. With `--start-when FILE` it returns at once and the new server only
begins once FILE exists, like a unit that is slow to come up.

In a test, `with restartable_fleet(tmp_path) as fleet: server = fleet.start("gpu0", mode)`;
when the block exits every process any launcher or restart command recorded is stopped,
failing test or not. Processes are only signalled after their command line was checked
to be one of ours, so a PID reused by the system is never touched.

The script half imports nothing from llmhealth and nothing outside the standard library:
it runs as a restart command under whatever environment `llmhealth check` has.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
import urllib.request
import warnings
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SCRIPT = Path(__file__).resolve()
ROOT = SCRIPT.parent.parent  # the checkout, whose llmhealth the servers run
HOST = "127.0.0.1"
READY_TIMEOUT = 20.0
STOP_TIMEOUT = 5.0
START_WHEN_TIMEOUT = 60.0  # a delayed server gives up waiting for its go file after this
POLL = 0.05
# Below Linux's ephemeral range (32768+), so outgoing connections do not take these ports
# between one process of a server and the next.
PORT_RANGE = (20000, 32000)
START_ATTEMPTS = 5


class HarnessError(RuntimeError):
    """A server did not start, did not answer, or would not stop."""


# --- processes ------------------------------------------------------------------------


def simulate_argv(mode: str, port: int) -> list[str]:
    return [sys.executable, "-m", "llmhealth", "simulate", mode, f"--host={HOST}", f"--port={port}"]


def _server_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    env["PYTHONUNBUFFERED"] = "1"
    return env


def alive(pid: int) -> bool:
    """True while the process runs. A zombie (dead, not yet reaped by whoever adopted it)
    counts as gone: it holds no socket and answers nothing."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    # The command name in parentheses may hold spaces; the state letter follows it.
    return stat.rpartition(")")[2].split()[0] not in ("Z", "X")


def ours(pid: int) -> bool:
    """The process is a simulator (or a launcher waiting to become one) started here."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return b"simulate" in argv and any(a.startswith(f"--host={HOST}".encode()) for a in argv)


def stop(pid: int, timeout: float = STOP_TIMEOUT) -> None:
    """SIGTERM, wait (bounded), SIGKILL; a process that is gone or not ours is left alone."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        if not alive(pid) or not ours(pid):
            return
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, os.WNOHANG)  # reap it if it happens to be our child
            if not alive(pid):
                return
            time.sleep(POLL)
    if alive(pid):
        raise HarnessError(f"process {pid} still runs after SIGKILL")


def _commands_for(pidfile: Path) -> list[int]:
    """Launchers and restart commands of this script still running for ``pidfile``
    (a restart command's `sh` wrapper execs into one, keeping its PID)."""
    marks = (str(pidfile).encode(), str(SCRIPT).encode())
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == os.getpid():
            continue
        try:
            argv = Path(f"/proc/{name}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if all(mark in argv for mark in marks) and alive(int(name)):
            found.append(int(name))
    return found


def _wait_for_commands(pidfile: Path) -> None:
    """Until no command for ``pidfile`` runs: each is bounded by its own stop and ready
    timeouts; one still running past them is killed."""
    deadline = time.monotonic() + STOP_TIMEOUT + READY_TIMEOUT + 5.0
    while (running := _commands_for(pidfile)) and time.monotonic() < deadline:
        time.sleep(POLL)
    for pid in running:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def read_pid(pidfile: Path) -> int | None:
    try:
        return int(pidfile.read_text().strip())
    except (OSError, ValueError):
        return None


def history_path(pidfile: Path) -> Path:
    return pidfile.with_name(pidfile.name + ".history")


def launches(pidfile: Path) -> list[dict[str, Any]]:
    """Every process started for this pidfile, oldest first: {pid, mode, at, by}."""
    try:
        lines = history_path(pidfile).read_text().splitlines()
    except FileNotFoundError:
        return []
    return [json.loads(line) for line in lines if line.strip()]


def stats(port: int, timeout: float = 2.0) -> dict[str, Any]:
    """The simulator's GET /sim/stats, read directly (environment proxies ignored)."""
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with opener.open(f"http://{HOST}:{port}/sim/stats", timeout=timeout) as response:
        document: dict[str, Any] = json.load(response)
    return document


def wait_ready(
    port: int,
    mode: str,
    *,
    timeout: float = READY_TIMEOUT,
    process: subprocess.Popen[bytes] | None = None,
    log: Path | None = None,
) -> None:
    """Until the server on `port` answers as `mode` (so not an older process), bounded."""
    deadline = time.monotonic() + timeout
    while True:
        if process is not None and process.poll() is not None:
            raise HarnessError(
                f"server for {mode!r} on port {port} exited {process.returncode} before "
                f"answering; its log:\n{_tail(log)}"
            )
        with contextlib.suppress(OSError, ValueError):
            if stats(port, timeout=1.0).get("mode") == mode:
                return
        if time.monotonic() >= deadline:
            raise HarnessError(
                f"server for {mode!r} on port {port} not answering after {timeout:g} s; "
                f"its log:\n{_tail(log)}"
            )
        time.sleep(POLL)


def _tail(log: Path | None, size: int = 2000) -> str:
    if log is None:
        return "(no log)"
    try:
        return log.read_bytes()[-size:].decode(errors="replace")
    except OSError as exc:
        return f"(log unreadable: {exc})"


def spawn(
    mode: str, port: int, pidfile: Path, log: Path, *, by: str, start_when: Path | None = None
) -> subprocess.Popen[bytes]:
    """Start one detached server; its PID goes to the history first, then the pidfile."""
    argv = simulate_argv(mode, port)
    if start_when is not None:
        argv = [sys.executable, str(SCRIPT), "serve-when", str(start_when), "--", *argv]
    with open(log, "ab") as out:
        out.write(f"--- {time.time():.3f} {by}: {mode} on port {port}\n".encode())
        out.flush()
        process = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=out,  # a file, never the caller's pipes: a restart command's pipes close
            stderr=subprocess.STDOUT,
            start_new_session=True,
            close_fds=True,
            env=_server_env(),
        )
    # Recorded before anything can fail, so the cleanup finds it whatever happens next.
    entry = {"pid": process.pid, "mode": mode, "at": time.time(), "by": by}
    with open(history_path(pidfile), "a") as history:
        history.write(json.dumps(entry) + "\n")
    _write_atomically(pidfile, f"{process.pid}\n")
    return process


def _write_atomically(path: Path, text: str) -> None:
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    temporary.write_text(text)
    temporary.replace(path)


def _let_go(process: subprocess.Popen[bytes]) -> None:
    """Leave a detached server running when this short-lived process exits."""
    with warnings.catch_warnings():
        # Popen warns about a child still running when it is dropped; that is the point.
        warnings.simplefilter("ignore", ResourceWarning)
        del process


# --- the commands ---------------------------------------------------------------------


def _start(args: argparse.Namespace) -> int:
    """Start a server (no old one to stop) and wait until it answers."""
    process = spawn(args.mode, args.port, args.pidfile, args.log, by="start")
    try:
        wait_ready(args.port, args.mode, timeout=args.ready_timeout, process=process, log=args.log)
    except HarnessError as exc:
        print(exc, file=sys.stderr)
        stop(process.pid)
        return 75 if "cannot listen" in str(exc) else 1
    print(f"started pid {process.pid} ({args.mode}) on port {args.port}")
    _let_go(process)
    return 0


def _restart(args: argparse.Namespace) -> int:
    """The restart command: stop the old process, start a new one, wait until it answers."""
    old = read_pid(args.pidfile)
    if old is not None:
        try:
            stop(old)
        except HarnessError as exc:
            print(exc, file=sys.stderr)
            return 1
    start_when = Path(args.start_when) if args.start_when else None
    process = spawn(
        args.mode, args.port, args.pidfile, args.log, by="restart", start_when=start_when
    )
    if start_when is None:
        try:
            wait_ready(
                args.port, args.mode, timeout=args.ready_timeout, process=process, log=args.log
            )
        except HarnessError as exc:
            print(exc, file=sys.stderr)
            return 1
    when = f", serving once {start_when} exists" if start_when else ""
    print(f"restarted: pid {old} -> {process.pid} ({args.mode}) on port {args.port}{when}")
    _let_go(process)
    return 0


def _serve_when(args: argparse.Namespace) -> int:
    """Wait (bounded) for the go file, then become the server: same PID, as recorded."""
    go = Path(args.file)
    deadline = time.monotonic() + START_WHEN_TIMEOUT
    while not go.exists():
        if time.monotonic() >= deadline:
            print(f"{go} never appeared; not starting", file=sys.stderr)
            return 1
        time.sleep(POLL)
    argv = list(args.argv)
    os.execv(argv[0], argv)
    return 1  # not reached: execv returns only by raising


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    commands = parser.add_subparsers(dest="command", required=True)
    for name in ("start", "restart"):
        command = commands.add_parser(name)
        command.add_argument("--pidfile", type=Path, required=True)
        command.add_argument("--port", type=int, required=True)
        command.add_argument("--mode", required=True)
        command.add_argument("--log", type=Path, help="default: the pidfile with .log")
        command.add_argument("--ready-timeout", type=float, default=READY_TIMEOUT)
        if name == "restart":
            command.add_argument("--start-when", help="return at once; serve once this exists")
    serve_when = commands.add_parser("serve-when")
    serve_when.add_argument("file")
    serve_when.add_argument("argv", nargs="+")
    args = parser.parse_args(argv)
    if args.command == "serve-when":
        return _serve_when(args)
    if args.log is None:
        args.log = args.pidfile.with_suffix(".log")
    return _start(args) if args.command == "start" else _restart(args)


# --- the test side --------------------------------------------------------------------


def _bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as asyncio's servers
        try:
            probe.bind((HOST, port))
        except OSError:
            return False
    return True


def free_port(tries: int = 200) -> int:
    for _ in range(tries):
        port = random.randrange(*PORT_RANGE)
        if _bindable(port):
            return port
    raise HarnessError(f"no free port on {HOST} after {tries} tries")


@dataclass
class Server:
    """One restartable simulated backend: a fixed name, port, pidfile and log."""

    name: str
    port: int
    mode: str  # the mode it was first started in
    pidfile: Path
    log: Path
    ready_at: float = 0.0  # when its first process answered: it was born before this

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"

    @property
    def pid(self) -> int | None:
        return read_pid(self.pidfile)

    def restart_argv(self, mode: str, *, start_when: Path | None = None) -> list[str]:
        """The config's `restart` for this server: bring it back in `mode`."""
        argv = [sys.executable, str(SCRIPT), "restart", "--pidfile", str(self.pidfile)]
        argv += ["--port", str(self.port), "--mode", mode, "--log", str(self.log)]
        if start_when is not None:
            argv += ["--start-when", str(start_when)]
        return argv

    def launches(self) -> list[dict[str, Any]]:
        return launches(self.pidfile)

    def stats(self) -> dict[str, Any]:
        return stats(self.port)

    def wait_ready(self, mode: str, timeout: float = READY_TIMEOUT) -> None:
        wait_ready(self.port, mode, timeout=timeout, log=self.log)

    def stop_all(self) -> None:
        """Every process ever recorded for this server, newest first, once no restart
        command for it still runs.

        A daemon killed mid-restart (the tests' teardown kills daemons) leaves its command
        running in the command's own session, and a command that starts its server after
        the history was read here would leave that server behind: it did, in a CI run.
        """
        _wait_for_commands(self.pidfile)
        stopped: set[int] = set()
        while True:  # once more if a launch was recorded meanwhile
            pids = [entry["pid"] for entry in self.launches()]
            current = self.pid
            if current is not None and current not in pids:
                pids.append(current)
            if not set(pids) - stopped:
                return
            for pid in reversed(pids):
                if pid not in stopped:
                    stop(pid)
                    stopped.add(pid)


@dataclass
class Fleet:
    folder: Path
    servers: list[Server] = field(default_factory=list)

    def start(self, name: str, mode: str) -> Server:
        """Start `name` in `mode` on a free port and return once it answers."""
        failure = ""
        for _ in range(START_ATTEMPTS):
            server = Server(
                name, free_port(), mode, self.folder / f"{name}.pid", self.folder / f"{name}.log"
            )
            self.servers.append(server)  # before starting: the cleanup must know it
            argv = [sys.executable, str(SCRIPT), "start", "--pidfile", str(server.pidfile)]
            argv += ["--port", str(server.port), "--mode", mode, "--log", str(server.log)]
            done = subprocess.run(
                argv, capture_output=True, text=True, timeout=READY_TIMEOUT + 10, check=False
            )
            if done.returncode == 0:
                server.ready_at = time.time()
                return server
            failure = done.stderr
            server.stop_all()
            if done.returncode != 75:  # anything but a port taken under us is final
                break
            server.pidfile.unlink(missing_ok=True)
            history_path(server.pidfile).unlink(missing_ok=True)
        raise HarnessError(f"could not start {name} ({mode}):\n{failure}")

    def stop_all(self) -> None:
        problems = []
        for server in self.servers:
            try:
                server.stop_all()
            except HarnessError as exc:
                problems.append(str(exc))
        if problems:
            raise HarnessError("; ".join(problems))


@contextmanager
def restartable_fleet(folder: Path) -> Iterator[Fleet]:
    """Servers that restart commands may replace; all of them stopped on exit, always."""
    fleet = Fleet(folder)
    try:
        yield fleet
    finally:
        fleet.stop_all()


if __name__ == "__main__":
    sys.exit(main())
