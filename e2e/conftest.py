"""Fixtures for the e2e lane: one real vLLM server shared by the scenarios, always stopped.

The suite runs with the dev venv's pytest (and the project's `filterwarnings = error`);
vLLM itself runs from `.venv-e2e` in other processes. Every process started here belongs
to a fixture whose finalizer stops its whole process group, failing test or not (the process
guard of tests/process_guard.py fails the session, and kills, whatever is left). A failing
test gets the tail of every server log it used attached to its report, and the session
ends with the time each phase took.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Generator, Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
# The process guard lives with the unit tests; here it checks at the session's end only.
sys.path.insert(1, str(Path(__file__).resolve().parent.parent / "tests"))

from process_guard import register as register_process_guard
from vllm_server import MODEL_DIR, ROOT, VENV_PYTHON, VllmServer, free_port

# Logs, state files and nginx's directory live here, not under /tmp/pytest-of-*: other pytest
# runs on the same machine prune that directory to their last three, mid-run. Kept after
# the run (cleared at the next), so a failure's full logs can be read. One per checkout, not
# inside .e2e: worktrees share .e2e through a link, and pytest empties the basetemp at the
# start of a run, which deleted the files of another checkout's e2e run under way.
BASETEMP = ROOT / ".e2e-tmp"

# (what, seconds), printed at the end of the session.
TIMINGS: list[tuple[str, float]] = []
# Logs a test has used (title -> tail reader): attached to its report when it fails.
_LOGS_IN_USE: dict[str, Callable[[], str]] = {}
_MAIN_LOG = "vLLM log tail (shared server)"


def pytest_configure(config: pytest.Config) -> None:
    # Session-wide only: the shared vLLM server is (re)started by function-scoped fixtures
    # and lives until the session ends.
    register_process_guard(config, per_test=False)
    if not config.option.basetemp:
        config.option.basetemp = str(BASETEMP)


def record(what: str, seconds: float) -> None:
    TIMINGS.append((what, seconds))


def watch_log(server: VllmServer, title: str | None = None) -> None:
    _LOGS_IN_USE[title or f"vLLM log tail ({server.log_path.name})"] = server.log_tail


@pytest.fixture(scope="session")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("e2e")


@pytest.fixture(scope="session")
def vllm(workdir: Path) -> Iterator[VllmServer]:
    """The shared server; a test that stops it leaves it stopped, the next one restarts it
    through ``ensure_running``."""
    if not VENV_PYTHON.exists() or not MODEL_DIR.exists():
        pytest.fail(f"{VENV_PYTHON} or {MODEL_DIR} missing: run `python3 e2e/setup.py` first")
    server = VllmServer(free_port(), workdir / "vllm-main.log")
    watch_log(server, _MAIN_LOG)
    try:
        yield server
    finally:
        server.stop()


def ensure_running(server: VllmServer) -> VllmServer:
    if not server.alive():
        seconds = server.start()
        record(f"vLLM start #{server.starts} ({server.log_path.name})", seconds)
    return server


def start_server(server: VllmServer) -> None:
    watch_log(server)
    seconds = server.start()
    record(f"vLLM start #{server.starts} ({server.log_path.name})", seconds)


@pytest.fixture
def server(vllm: VllmServer) -> VllmServer:
    return ensure_running(vllm)


@pytest.fixture
def spare_servers() -> Iterator[list[VllmServer]]:
    """Servers a test starts itself; each is stopped afterwards."""
    started: list[VllmServer] = []
    try:
        yield started
    finally:
        for server in started:
            server.stop()


# --- nginx ---------------------------------------------------------------------------

NGINX_CONF = """\
daemon off;
master_process on;
worker_processes 1;
pid {dir}/nginx.pid;
error_log {dir}/error.log info;
events {{ worker_connections 256; }}
http {{
    access_log {dir}/access.log;
    client_body_temp_path {dir}/client_body;
    proxy_temp_path {dir}/proxy;
    fastcgi_temp_path {dir}/fastcgi;
    uwsgi_temp_path {dir}/uwsgi;
    scgi_temp_path {dir}/scgi;
    upstream vllm {{
        least_conn;
        server 127.0.0.1:{backend};
    }}
    server {{
        listen 127.0.0.1:{port};
        location / {{
            proxy_pass http://vllm;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_buffering off;
            proxy_read_timeout 600s;
        }}
    }}
}}
"""


def nginx_binary() -> str | None:
    for candidate in ("/usr/sbin/nginx", "/usr/bin/nginx"):
        if os.access(candidate, os.X_OK):
            return candidate
    return None


class Nginx:
    def __init__(self, directory: Path, backend_port: int) -> None:
        self.directory = directory
        self.port = free_port()
        self.backend_port = backend_port
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, binary: str) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        # Worker processes may run as an unprivileged user: let them through the directory.
        self.directory.chmod(0o755)
        conf = self.directory / "nginx.conf"
        conf.write_text(
            NGINX_CONF.format(dir=self.directory, port=self.port, backend=self.backend_port),
            encoding="utf-8",
        )
        with (self.directory / "stdout.log").open("wb") as output:
            self.process = subprocess.Popen(
                [binary, "-p", str(self.directory), "-c", str(conf), "-e", "stderr"],
                stdin=subprocess.DEVNULL,
                stdout=output,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"nginx exited at start:\n{self.logs()}")
            with (
                contextlib.suppress(OSError),
                socket.create_connection(("127.0.0.1", self.port), timeout=1),
            ):
                return
            time.sleep(0.1)
        raise RuntimeError(f"nginx not listening after 15 s:\n{self.logs()}")

    def access_log(self) -> str:
        with contextlib.suppress(OSError):
            return (self.directory / "access.log").read_text(encoding="utf-8", errors="replace")
        return ""

    def logs(self) -> str:
        parts = []
        for name in ("stdout.log", "error.log"):
            with contextlib.suppress(OSError):
                parts.append((self.directory / name).read_text(errors="replace")[-3000:])
        return "\n".join(parts)

    def stop(self) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        # SIGQUIT is nginx's graceful stop; the group signal reaches the workers too.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGQUIT)
        try:
            self.process.wait(10)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(5)


@pytest.fixture(scope="session")
def nginx(vllm: VllmServer, workdir: Path) -> Iterator[Nginx]:
    binary = nginx_binary()
    if binary is None:
        pytest.skip("nginx not installed (python3 e2e/setup.py installs it when run as root)")
    proxy = Nginx(workdir / "nginx", vllm.port)
    try:
        proxy.start(binary)
        _LOGS_IN_USE["nginx logs"] = proxy.logs
        yield proxy
    finally:
        proxy.stop()


# --- reporting -----------------------------------------------------------------------


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item) -> Generator[None, None, None]:
    # Each test reports the shared logs plus those it opened itself.
    for title in [t for t in _LOGS_IN_USE if t not in (_MAIN_LOG, "nginx logs")]:
        del _LOGS_IN_USE[title]
    started = time.monotonic()
    yield
    record(f"test {item.name} (setup, call, teardown)", time.monotonic() - started)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, None]:
    outcome = yield
    report = outcome.get_result()
    if report.failed:
        for title, tail in _LOGS_IN_USE.items():
            report.sections.append((title, tail()))


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if not TIMINGS:
        return
    terminalreporter.section("e2e timings")
    for what, seconds in TIMINGS:
        terminalreporter.write_line(f"{seconds:7.1f} s  {what}")
    starts = sum(seconds for what, seconds in TIMINGS if what.startswith("vLLM start"))
    total = sum(seconds for what, seconds in TIMINGS if what.startswith("test "))
    terminalreporter.write_line(f"{total:7.1f} s  all tests, of which {starts:.1f} s vLLM starts")
