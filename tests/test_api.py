"""llmhealth.check and check_async against real simulated vLLM processes: the same report
the CLI prints, as typed objects, from a blocking call or inside a running loop."""

from __future__ import annotations

import asyncio
import fcntl
import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from etcdproc import EtcdCluster, free_port, running_etcd
from simproc import running_simulator
from wakes import CountedSelector

import llmhealth
from llmhealth import ConfigError, ExitCode, State, VerdictKind
from llmhealth.cluster import Elector, Etcd, Keys
from llmhealth.leadership import LeaseTiming
from llmhealth.state import StateFile, StateLockedError

FAST: dict[str, Any] = {"wait": 0.3, "timeout": 1.0, "answer_timeout": 2.0}
CLI_FAST = ["--wait", "0.3", "--timeout", "1", "--answer-timeout", "2"]


def completions_received(url: str) -> int:
    stats: dict[str, Any] = httpx.get(f"{url}/sim/stats", timeout=2.0).json()
    return int(stats["completions_received"])


def shape(value: Any) -> Any:
    """The keys and value types of a document, recursively: what must match exactly."""
    if isinstance(value, dict):
        return {key: shape(item) for key, item in value.items()}
    if isinstance(value, list):
        return [shape(item) for item in value]
    return type(value).__name__


@pytest.mark.slow
def test_to_dict_is_the_document_check_format_json_prints(entry_point: str) -> None:
    with running_simulator(["idle", "unanswered"]) as sim:
        cli = subprocess.run(
            [entry_point, "check", *sim.urls, "--format", "json", *CLI_FAST],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        printed = json.loads(cli.stdout)
        report = llmhealth.check(sim.urls, **FAST)
    ours = report.to_dict()
    assert shape(ours) == shape(printed)
    assert ours["exit_code"] == printed["exit_code"] == cli.returncode == report.exit_code == 2
    for field in ("name", "url", "kind", "verdict", "healthy", "state", "serving"):
        assert [b[field] for b in ours["backends"]] == [b[field] for b in printed["backends"]]
    assert ours["fleet"] == printed["fleet"]
    # The typed objects say the same as the document.
    for typed, plain in zip(report.backends, ours["backends"], strict=True):
        assert (typed.name, typed.verdict, typed.healthy) == (
            plain["name"],
            plain["verdict"],
            plain["healthy"],
        )
        assert (typed.state, typed.evidence, typed.requests_sent) == (
            plain["state"],
            plain["evidence"],
            plain["requests_sent"],
        )
    idle, unanswered = report.backends
    assert idle.verdict is VerdictKind.IDLE and idle.exit_code is ExitCode.OK
    assert unanswered.verdict is VerdictKind.UNANSWERED and unanswered.state is State.SUSPECT


def test_a_busy_backend_checked_from_code_is_never_sent_a_request() -> None:
    with running_simulator(["busy"]) as sim:
        report = llmhealth.check(sim.urls, **FAST)
        assert completions_received(sim.urls[0]) == 0
    busy = report.backends[0]
    assert busy.verdict is VerdictKind.BUSY and busy.healthy
    assert busy.requests_sent == 0
    assert busy.running is not None and busy.running > 0
    assert busy.steps_per_s is not None and busy.steps_per_s > 0
    assert report.healthy


def test_check_async_runs_in_the_callers_loop_without_holding_it() -> None:
    ticks = 0

    async def ticker() -> None:
        nonlocal ticks
        while True:
            await asyncio.sleep(0.01)
            ticks += 1

    async def main(urls: list[str]) -> llmhealth.CheckReport:
        beat = asyncio.create_task(ticker())
        try:
            return await llmhealth.check_async(urls, **FAST)
        finally:
            beat.cancel()

    with running_simulator(["busy"]) as sim:
        report = asyncio.run(main(sim.urls))
    assert report.backends[0].verdict is VerdictKind.BUSY
    # A busy verdict needs a wait between two reads; the loop kept running through it.
    assert ticks > 0


@pytest.mark.slow
def test_check_async_leaves_nothing_running_in_the_callers_loop() -> None:
    """The reads' measure of the loop's lateness ticked every 0.1 s in the caller's loop
    for the rest of its life, after one check."""
    selector = CountedSelector()
    loop = asyncio.SelectorEventLoop(selector)

    async def main(urls: list[str]) -> int:
        await llmhealth.check_async(urls, **FAST)
        wakes = selector.wakes
        await asyncio.sleep(1.0)  # an idle second of the caller's own
        return selector.wakes - wakes

    try:
        with running_simulator(["idle"]) as sim:
            woke = loop.run_until_complete(main(sim.urls))
    finally:
        loop.close()
    assert woke <= 2  # the sleep's own timer, not ten ticks


def test_check_refuses_to_start_a_loop_inside_a_running_one() -> None:
    async def main() -> None:
        llmhealth.check(["http://127.0.0.1:9"], **FAST)

    with pytest.raises(RuntimeError, match="running event loop"):
        asyncio.run(main())


@pytest.mark.slow
def test_a_state_file_keeps_the_ledger_between_calls(tmp_path: Path) -> None:
    state = tmp_path / "state.json"
    with running_simulator(["unanswered"]) as sim:
        seen = [llmhealth.check(sim.urls, state=state, **FAST).backends[0] for _ in range(3)]
    assert [b.state for b in seen] == [State.SUSPECT, State.SUSPECT, State.DEAD]
    assert seen[-1].last_error is not None and "unanswered" in seen[-1].last_error


def test_check_async_does_not_wait_for_a_state_another_run_holds(tmp_path: Path) -> None:
    state = tmp_path / "state.json"
    with StateFile(state).locked(), pytest.raises(StateLockedError):
        asyncio.run(llmhealth.check_async(["http://127.0.0.1:9"], state=state, **FAST))


def test_check_async_does_not_wait_for_an_audit_log_another_process_holds(
    tmp_path: Path,
) -> None:
    # A backup or log shipper holding flock on the audit log held the caller's event
    # loop for the audit's 10 s, and the check failed after it anyway.
    state = tmp_path / "state.json"
    audit = tmp_path / "audit.jsonl"
    audit.touch()
    with audit.open("rb") as holder:
        fcntl.flock(holder, fcntl.LOCK_EX)
        with pytest.raises(
            llmhealth.AuditError, match=r"locked by another process.*gave up after 0 s"
        ):
            asyncio.run(llmhealth.check_async(["http://127.0.0.1:9"], state=state, **FAST))


# Forks in a fresh interpreter of its own: pytest's has threads of its own.
_FORK_WHILE_A_THREAD_CHECKS = """
import asyncio, os, socket, sys, threading, time
import llmhealth
state = sys.argv[1]
silent = socket.socket()  # accepts (the backlog does) and never answers
silent.bind(("127.0.0.1", 0))
silent.listen()
url = f"http://127.0.0.1:{silent.getsockname()[1]}"
quick = {"wait": 0.2, "timeout": 2.0, "answer_timeout": 2.0}
checking = threading.Thread(target=llmhealth.check, args=([url],), kwargs={"state": state, **quick})
checking.start()
note = f"{os.getpid()}\\n"
while True:  # until the check holds the state's lock: its note names this process
    try:
        with open(state + ".lock") as lock:
            if lock.read() == note:
                break
    except FileNotFoundError:
        pass
    time.sleep(0.01)
worker_r, worker_w = os.pipe()
pid = os.fork()
if pid == 0:  # a data-loader worker: lives on, and touches nothing of the check
    os.close(worker_w)
    os.read(worker_r, 1)
    os._exit(0)
os.close(worker_r)
checking.join()
try:
    asyncio.run(llmhealth.check_async([url], state=state, **{**quick, "timeout": 0.2}))
    print("free")
except llmhealth.StateLockedError as exc:
    print("held:", exc)
os.close(worker_w)
os.waitpid(pid, 0)
"""


def test_a_process_forked_while_a_thread_checks_does_not_keep_the_state_locked(
    tmp_path: Path,
) -> None:
    """A trainer's data-loader workers fork while a thread of the trainer runs
    ``llmhealth.check``: each kept a copy of the lock's descriptor, and closing its own
    let go of nothing while a copy stayed open, so the state stayed locked for the
    workers' whole life and every check after it was refused."""
    done = subprocess.run(
        [sys.executable, "-c", _FORK_WHILE_A_THREAD_CHECKS, str(tmp_path / "state.json")],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.stdout.strip() == "free", done.stdout + done.stderr


def test_what_a_check_raises_is_importable_from_the_package(tmp_path: Path) -> None:
    # A caller catches these by name; the package's own modules are internal.
    locked = tmp_path / "locked" / "state.json"
    with StateFile(locked).locked(), pytest.raises(llmhealth.StateLockedError):
        asyncio.run(llmhealth.check_async(["http://127.0.0.1:9"], state=locked, **FAST))
    assert issubclass(llmhealth.StateLockedError, llmhealth.StateError)
    bad = tmp_path / "bad.toml"
    bad.write_text("wait = -1\n")
    with pytest.raises(llmhealth.ConfigError, match="wait"):
        llmhealth.check(config=bad)
    (tmp_path / "audit.jsonl").mkdir()  # an audit log that cannot be opened
    with pytest.raises(llmhealth.AuditError, match="cannot open the audit log"):
        llmhealth.check(["http://127.0.0.1:9"], state=tmp_path / "state.json", **FAST)


def test_check_async_runs_no_restart_command(tmp_path: Path) -> None:
    config = tmp_path / "fleet.toml"
    config.write_text(
        '[[backend]]\nname = "gpu0"\nurl = "http://127.0.0.1:9"\nrestart = ["true"]\n'
    )
    with pytest.raises(ValueError, match="no_restart"):
        asyncio.run(llmhealth.check_async(config=config, state=tmp_path / "s.json"))


@pytest.fixture(scope="module")
def etcd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EtcdCluster]:
    with running_etcd(tmp_path_factory.mktemp("etcd")) as cluster:
        yield cluster


def test_check_from_code_in_a_cluster_acts_only_with_the_lease_and_keeps_the_record_in_etcd(
    tmp_path: Path, etcd: EtcdCluster
) -> None:
    # A script's check beside a cluster's daemons is cron's: a ledger of its own in a state
    # file would settle and restart behind the leader's back.
    keys = Keys("/llmhealth-api")
    state = tmp_path / "state.json"
    config = tmp_path / "fleet.toml"
    holder = Elector(Etcd(etcd.endpoints), keys, "holder", LeaseTiming.for_ttl(3.0), log=[].append)
    with running_simulator(["idle"]) as sim:
        config.write_text(
            f'state = "{state}"\n[[backend]]\nname = "gpu0"\nurl = "{sim.urls[0]}"\n'
            f'[cluster]\netcd = {json.dumps(etcd.endpoints)}\nprefix = "{keys.prefix}"\n'
            "lease_ttl = 3\n"
        )
        holder.start()
        try:
            deadline = time.monotonic() + 30.0
            while not holder.decision().may_act:
                assert time.monotonic() < deadline, "the holder never led"
                time.sleep(0.05)
            standing_by = llmhealth.check(config=config, **FAST)
        finally:
            holder.stop(resign=True)
        assert Etcd(etcd.endpoints).get(keys.state) is None
        # Not acting, it asked nothing either: the tiny request is the leader's to send.
        assert completions_received(sim.urls[0]) == 0
        leading = llmhealth.check(config=config, **FAST)
        assert completions_received(sim.urls[0]) == 1
        with pytest.raises(ValueError, match="cluster"):
            asyncio.run(llmhealth.check_async(config=config, no_restart=True, **FAST))
    assert any("not acting: standby (holder leads)" in note for note in standing_by.notes), (
        standing_by.notes
    )
    assert standing_by.backend("gpu0").verdict is VerdictKind.IDLE
    assert (
        "no request sent: a standby leaves the tiny request" in standing_by.backend("gpu0").evidence
    )
    record = Etcd(etcd.endpoints).get(keys.state)
    assert record is not None and b'"gpu0"' in record.value
    assert leading.backend("gpu0").state is State.HEALTHY
    assert not state.exists()


def test_check_from_code_with_its_cluster_away_acts_on_nothing_and_says_why(
    tmp_path: Path,
) -> None:
    state = tmp_path / "state.json"
    config = tmp_path / "fleet.toml"
    with running_simulator(["idle"]) as sim:
        config.write_text(
            f'state = "{state}"\n[[backend]]\nname = "gpu0"\nurl = "{sim.urls[0]}"\n'
            f'[cluster]\netcd = ["http://127.0.0.1:{free_port()}"]\nlease_ttl = 3\n'
        )
        report = llmhealth.check(config=config, **FAST)
        assert completions_received(sim.urls[0]) == 0
    assert len(report.notes) == 1 and report.notes[0].startswith("etcd unreachable"), report.notes
    assert report.backend("gpu0").verdict is VerdictKind.IDLE
    assert not state.exists()


@pytest.mark.parametrize(
    ("urls", "options", "error"),
    [
        ([], {}, ValueError),
        (["not a url"], {}, ValueError),
        ("http://127.0.0.1:9", {}, TypeError),
        (["http://127.0.0.1:9", "http://127.0.0.1:9/"], {}, ValueError),
        (["http://127.0.0.1:9"], {"wait": -1.0}, ValueError),
        (["http://127.0.0.1:9"], {"timeout": float("nan")}, ValueError),
        (["http://127.0.0.1:9"], {"timeout": 5000}, ValueError),  # milliseconds, as a config
        (["http://127.0.0.1:9"], {"wait": 1e-310}, ValueError),  # no timer counts so little
        (b"http://127.0.0.1:9", {}, TypeError),
        (None, {}, TypeError),
        ([9], {}, TypeError),
        (["http://127.0.0.1:9"], {"proxies": [None]}, TypeError),
        (["http://127.0.0.1:9"], {"dry_run": "no"}, TypeError),  # ran dry: "no" is true
        (["http://127.0.0.1:9"], {"no_restart": 1}, TypeError),
        (["http://127.0.0.1:9"], {"state": ""}, ValueError),
        (["http://127.0.0.1:9"], {"state": " "}, ValueError),
        (["http://127.0.0.1:9"], {"config": ""}, ConfigError),
        # str() made them the paths "b''" and "0" in the working directory.
        (["http://127.0.0.1:9"], {"state": b""}, TypeError),
        (["http://127.0.0.1:9"], {"state": b"/tmp/x.json"}, TypeError),
        (["http://127.0.0.1:9"], {"state": 0}, TypeError),
        (["http://127.0.0.1:9"], {"config": b"fleet.toml"}, TypeError),
    ],
)
def test_bad_arguments_are_errors_that_name_the_problem(
    urls: Any,
    options: dict[str, Any],
    error: type[Exception],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # An empty state was taken for none given: the default (system-wide as root) state
    # was locked and rewritten, forgetting every backend the call did not name.
    monkeypatch.setenv("STATE_DIRECTORY", str(tmp_path))
    monkeypatch.chdir(tmp_path)
    with pytest.raises(error, match=r"\w"):
        llmhealth.check(urls, **options)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    ("urls", "proxies"),
    [
        (["http://alice:s3cret@127.0.0.1:9", 9], []),
        (["http://127.0.0.1:9"], ["http://alice:s3cret@127.0.0.1:8", None]),
    ],
)
def test_a_list_with_one_non_url_is_refused_without_repeating_the_others(
    urls: list[Any], proxies: list[Any]
) -> None:
    # The TypeError repeated the whole list, the password of a URL in it too.
    with pytest.raises(TypeError) as raised:
        llmhealth.check(urls, proxies=proxies)
    assert "s3cret" not in str(raised.value) and "alice" not in str(raised.value)
    assert "[1]" in str(raised.value)


def test_a_backend_that_is_down_is_in_the_report_not_an_exception() -> None:
    with running_simulator(["idle"]) as sim:
        url = sim.urls[0]
    # Any iterable of URLs: an iterator was used up by the check of its items.
    report = llmhealth.check(iter([url]), **FAST)
    assert report.backends[0].verdict is VerdictKind.DOWN
    assert report.exit_code is ExitCode.CRITICAL
    assert report.backend(report.backends[0].name) is report.backends[0]
