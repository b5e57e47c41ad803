"""The process guard (tests/process_guard.py) names and kills what a test leaves running.

Each case runs a small suite in a real pytest subprocess, as the guard runs here: the
leaking processes are real, reparented orphans included, and must be gone afterwards.
"""

from __future__ import annotations

import ctypes
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent

LEAKY_SUITE = """
import subprocess, sys
import pytest

def write_pid(name, pid):
    with open(name, "a") as pids:
        pids.write(f"{pid}\\n")

def test_stops_what_it_starts():
    subprocess.run([sys.executable, "-c", "pass"], check=True)

def test_leaves_an_orphan():
    # The shell exits at once: its background child reparents (to pytest, the subreaper).
    out = subprocess.run(["sh", "-c", "sleep 300 >/dev/null 2>&1 & echo $!"], check=True,
                         capture_output=True, text=True).stdout
    write_pid("pids", int(out))

def test_leaves_a_child():
    write_pid("pids", subprocess.Popen([sys.executable, "-c", "while True: pass"]).pid)

@pytest.fixture(scope="module")
def server():
    process = subprocess.Popen(["sleep", "301"])
    write_pid("pids", process.pid)
    yield process  # never stopped

def test_a_module_fixture_may_keep_its_process_between_tests(server):
    assert server.poll() is None

def test_runs_last():
    pass
"""


def run_suite(
    directory: Path, suite: str, *, per_test: bool = True
) -> subprocess.CompletedProcess[str]:
    (directory / "conftest.py").write_text(
        f"import sys\nsys.path.insert(0, {str(TESTS)!r})\n"
        "from process_guard import register\n"
        "def pytest_configure(config):\n"
        f"    register(config, per_test={per_test}, exit_grace=0.3)\n",
        encoding="utf-8",
    )
    (directory / "test_suite.py").write_text(textwrap.dedent(suite), encoding="utf-8")
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rE", "."],
        check=False,
        cwd=directory,
        capture_output=True,
        text=True,
        timeout=120,
    )


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            return stat.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except OSError:
        return False


@pytest.mark.slow
def test_each_leak_fails_the_test_that_left_it_and_is_killed(tmp_path: Path) -> None:
    result = run_suite(tmp_path, LEAKY_SUITE)
    pids = [int(line) for line in (tmp_path / "pids").read_text().split()]
    assert [pid for pid in pids if alive(pid)] == []
    assert result.returncode == 1, result.stdout
    errors = re.findall(r"^ERROR test_suite.py::(\w+)", result.stdout, re.MULTILINE)
    # The fixture's process counts against the test at whose teardown the fixture ended.
    assert errors == ["test_leaves_an_orphan", "test_leaves_a_child", "test_runs_last"]
    assert "5 passed, 3 errors" in result.stdout
    assert f"pid {pids[0]} (first seen after test_suite.py::test_leaves_an_orphan" in (
        result.stdout
    )
    assert "while True: pass" in result.stdout
    assert f"pid {pids[2]} (fixture 'server' (module)" in result.stdout


@pytest.mark.slow
def test_a_leak_found_at_the_sessions_end_is_named_in_the_last_lines_and_fails_the_run(
    tmp_path: Path,
) -> None:
    # The e2e lane checks only at the session's end, and CI shows only a run's tail.
    result = run_suite(tmp_path, LEAKY_SUITE, per_test=False)
    pids = [int(line) for line in (tmp_path / "pids").read_text().split()]
    assert [pid for pid in pids if alive(pid)] == []
    assert result.returncode == 1, result.stdout
    tail = result.stdout.splitlines()[-6:]
    assert "process guard" in tail[0], result.stdout
    assert tail[-1].startswith("5 passed"), result.stdout
    assert f"pid {pids[0]} (first seen after test_suite.py::test_leaves_an_orphan" in (
        "\n".join(tail)
    )
    assert "while True: pass" in "\n".join(tail)


@pytest.mark.slow
def test_a_clean_suite_passes_untouched(tmp_path: Path) -> None:
    clean = """
    import subprocess, sys
    def test_waits_for_its_child():
        with subprocess.Popen([sys.executable, "-c", "pass"]) as child:
            child.wait(30)
    """
    result = run_suite(tmp_path, clean)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "1 passed" in result.stdout
    assert "process" not in result.stdout + result.stderr


def test_the_guard_makes_this_pytest_a_subreaper() -> None:
    # PR_GET_CHILD_SUBREAPER (37) writes the flag into an int.
    flag = ctypes.c_int(0)
    assert ctypes.CDLL(None).prctl(37, ctypes.byref(flag), 0, 0, 0) == 0
    assert flag.value == 1
