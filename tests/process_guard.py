"""A pytest plugin: no test may leave a process running, and none outlives the session.

Tests start real simulators, watch daemons, etcd and vLLM. One that forgets to stop a
process (or stops the parent while a grandchild lives on) used to leave it running for
good, reparented to init, eating the shared cores. Here the pytest process becomes a
child subreaper (Linux), so such orphans reparent to pytest and stay visible as its
descendants. After each test's teardown, a descendant that no wider-scoped fixture still
owns is a leak: it is named, with the test, killed, and the teardown fails. At the end of
the session anything still alive is killed too and the run fails, so CI never hangs on it.

Cheap: one read of /proc/loadavg per test; the /proc scan runs only when some process was
created on the machine since the last scan (the kernel's last pid moved).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
import time
from collections.abc import Generator
from dataclasses import dataclass, field

import pytest

_PR_SET_CHILD_SUBREAPER = 36
# A process being stopped may still be exiting when teardown ends: give it this long.
EXIT_GRACE_SECONDS = 3.0
_COMMAND_SHOWN = 160


@dataclass(frozen=True)
class _Descendant:
    pid: int
    parent: int
    command: str


def _become_subreaper() -> bool:
    libc = ctypes.CDLL(None, use_errno=True)
    return bool(libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0)


def _last_pid() -> str:
    # The fifth field of /proc/loadavg is the last pid the kernel handed out.
    with open("/proc/loadavg", encoding="ascii") as loadavg:
        return loadavg.read().rsplit(" ", 1)[-1]


def _command(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as cmdline:
            raw = cmdline.read(4 * _COMMAND_SHOWN)
    except OSError:
        return "?"
    text = raw.replace(b"\0", b" ").decode(errors="replace").strip()
    # Escaped: a test's arguments reach the terminal here.
    return "".join(c if c.isprintable() else f"\\x{ord(c):02x}" for c in text)[:_COMMAND_SHOWN]


def _descendants(root: int) -> dict[int, _Descendant]:
    """Live (not zombie) processes below ``root``, by pid."""
    parents: dict[int, int] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as stat:
                text = stat.read()
        except OSError:
            continue  # gone meanwhile
        # "pid (comm) state ppid ...": comm may hold spaces and parentheses.
        state, ppid = text[text.rindex(b")") + 2 :].split(b" ", 2)[:2]
        if state != b"Z":
            parents[int(name)] = int(ppid)
    below: dict[int, _Descendant] = {}
    frontier = [root]
    while frontier:
        parent = frontier.pop()
        for pid, ppid in parents.items():
            if ppid == parent and pid not in below:
                below[pid] = _Descendant(pid, ppid, _command(pid))
                frontier.append(pid)
    return below


def _kill(pids: list[int]) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


@dataclass(eq=False)  # pluggy hashes its plugins
class ProcessGuard:
    """Registered once per session by the conftest files that want it.

    ``per_test``: fail the test whose teardown left a process running. The e2e lane turns
    it off: its shared vLLM server is restarted by function-scoped fixtures and owned by
    the session, so there only the session's end is checked (naming the test after which
    each process first appeared).
    """

    per_test: bool = True
    exit_grace: float = EXIT_GRACE_SECONDS
    _root: int = field(default_factory=os.getpid)
    _seen_last_pid: str = ""
    # pid -> fixture definition that started it (module, class or session scope): its
    # processes may outlive a test, not the fixture.
    _owned: dict[int, pytest.FixtureDef[object]] = field(default_factory=dict)
    _first_seen_after: dict[int, str] = field(default_factory=dict)
    _started_by: dict[int, str] = field(default_factory=dict)
    _session_leaks: list[str] = field(default_factory=list)

    @pytest.hookimpl(tryfirst=True)
    def pytest_sessionstart(self, session: pytest.Session) -> None:
        if not _become_subreaper():
            session.config.issue_config_time_warning(
                pytest.PytestWarning("process guard: prctl(PR_SET_CHILD_SUBREAPER) failed"), 2
            )

    @pytest.hookimpl(wrapper=True)
    def pytest_fixture_setup(
        self, fixturedef: pytest.FixtureDef[object]
    ) -> Generator[None, object, object]:
        if fixturedef.scope == "function":
            return (yield)
        before = _descendants(self._root)
        try:
            return (yield)
        finally:
            for pid in _descendants(self._root).keys() - before.keys():
                self._owned[pid] = fixturedef
                self._started_by[pid] = f"fixture {fixturedef.argname!r} ({fixturedef.scope})"

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_teardown(self, item: pytest.Item) -> Generator[None, None, None]:
        yield
        if not self.per_test:
            self._note_first_seen(after=item.nodeid)
            return
        leaks = self._leaks(after=item.nodeid)
        if leaks:
            _kill(list(leaks))
            raise pytest.fail.Exception(
                f"{item.nodeid} left {len(leaks)} process(es) running (killed now); "
                "stop every process a test or fixture starts, failure paths included:\n"
                + "\n".join(self._describe(leak) for leak in leaks.values()),
                pytrace=False,
            )

    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        self._seen_last_pid = ""
        self._owned.clear()
        leaks = self._leaks(after="the session")
        if leaks:
            _kill(list(leaks))
            self._session_leaks = [self._describe(leak) for leak in leaks.values()]
            session.exitstatus = pytest.ExitCode.TESTS_FAILED
        # Orphans that exited under us are our zombies: collect them.
        with contextlib.suppress(ChildProcessError):
            while os.waitpid(-1, os.WNOHANG)[0]:
                pass

    @pytest.hookimpl(trylast=True)
    def pytest_terminal_summary(self, terminalreporter: pytest.TerminalReporter) -> None:
        # Last of the summary sections, just above the counts line: CI keeps only the tail
        # of a run's output, and a leak written earlier (to stderr, as it once was) left a
        # failed run showing "24 passed" and nothing else.
        if not self._session_leaks:
            return
        terminalreporter.section("process guard", red=True)
        terminalreporter.write_line(
            "processes still running at the end of the session (killed now), which fails the run:"
        )
        for line in self._session_leaks:
            terminalreporter.write_line(line)

    def _note_first_seen(self, after: str) -> dict[int, _Descendant]:
        alive = _descendants(self._root)
        for pid in alive:
            self._first_seen_after.setdefault(pid, after)
        return alive

    def _leaks(self, after: str) -> dict[int, _Descendant]:
        last_pid = _last_pid()
        if last_pid == self._seen_last_pid:
            return {}  # no process was created anywhere since the last scan found none
        alive = self._note_first_seen(after)
        for owner, fixturedef in list(self._owned.items()):
            if fixturedef.cached_result is None or owner not in alive:
                del self._owned[owner]  # that fixture finished, or its process is gone
        leaks = {pid: d for pid, d in alive.items() if not self._is_owned(pid, alive)}
        deadline = time.monotonic() + self.exit_grace
        while leaks and time.monotonic() < deadline:
            time.sleep(0.05)
            still = _descendants(self._root)
            leaks = {pid: d for pid, d in leaks.items() if pid in still}
        if not leaks and not self._owned:
            self._seen_last_pid = last_pid
        return leaks

    def _is_owned(self, pid: int, alive: dict[int, _Descendant]) -> bool:
        """Started by a wider-scoped fixture that is still set up, or below such a process."""
        while pid in alive:
            if pid in self._owned:
                return True
            pid = alive[pid].parent
        return False

    def _describe(self, leak: _Descendant) -> str:
        where = self._started_by.get(leak.pid) or (
            f"first seen after {self._first_seen_after.get(leak.pid, '?')}"
        )
        where += f", parent {leak.parent}"
        return f"  pid {leak.pid} ({where}): {leak.command}"


def register(
    config: pytest.Config, *, per_test: bool, exit_grace: float = EXIT_GRACE_SECONDS
) -> None:
    """Register the guard, once (tests/ and e2e/ may both be collected), on Linux only."""
    if sys.platform != "linux" or config.pluginmanager.has_plugin("process-guard"):
        return
    config.pluginmanager.register(
        ProcessGuard(per_test=per_test, exit_grace=exit_grace), "process-guard"
    )
