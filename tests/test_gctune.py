"""The collector's spacing while a fleet is read: set inside, given back as found after."""

from __future__ import annotations

import gc
import subprocess
import sys
import threading
import time

import pytest

from llmhealth.gctune import YOUNG, young_collections_spaced


def test_young_collections_are_spaced_inside_and_the_thresholds_given_back_after() -> None:
    before = gc.get_threshold()
    with young_collections_spaced():
        young, *older = gc.get_threshold()
        assert young == max(YOUNG, before[0])
        assert tuple(older) == before[1:]  # the older generations keep their own rule
    assert gc.get_threshold() == before


def test_two_holders_ending_in_either_order_leave_the_collector_as_the_first_found_it() -> None:
    """Two daemons in one process (the tests) may stop in any order."""
    before = gc.get_threshold()
    first, second = young_collections_spaced(), young_collections_spaced()
    first.__enter__()
    second.__enter__()
    first.__exit__(None, None, None)
    assert gc.get_threshold()[0] == max(YOUNG, before[0])  # the second still reads
    second.__exit__(None, None, None)
    assert gc.get_threshold() == before


def test_collection_turned_off_stays_off_inside() -> None:
    """A young threshold of 0 turns automatic collection off (an application embedding
    ``llmhealth.check`` may run so): raised to YOUNG, it ran collections in all of it."""
    before = gc.get_threshold()
    gc.set_threshold(0, *before[1:])
    try:
        with young_collections_spaced():
            assert gc.get_threshold()[0] == 0
        assert gc.get_threshold() == (0, *before[1:])
    finally:
        gc.set_threshold(*before)


def test_a_failure_inside_still_gives_the_thresholds_back() -> None:
    before = gc.get_threshold()
    with pytest.raises(RuntimeError), young_collections_spaced():
        raise RuntimeError("a read went wrong")
    assert gc.get_threshold() == before


def test_thresholds_the_application_set_meanwhile_are_left_as_it_set_them() -> None:
    """A trainer's own thread tunes the collector while another runs ``llmhealth.check``:
    the check's end put back what it had found over the trainer's setting, for good."""
    before = gc.get_threshold()
    inside, tuned = threading.Event(), threading.Event()

    def check_in_a_thread() -> None:
        with young_collections_spaced():
            inside.set()
            tuned.wait(30)

    reader = threading.Thread(target=check_in_a_thread)
    reader.start()
    try:
        assert inside.wait(30)
        gc.set_threshold(2_000, 5, 5)  # the application's own, set while the check reads
        tuned.set()
        reader.join(30)
        assert gc.get_threshold() == (2_000, 5, 5)
    finally:
        tuned.set()
        reader.join(30)
        gc.set_threshold(*before)


def test_holders_in_several_threads_at_once_leave_the_collector_as_found(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``llmhealth.check`` from several threads: a first holder that read the thresholds
    after another had set them restored the set ones, for good. A slow read of the
    thresholds widens the window a real race has."""
    read = gc.get_threshold

    def slow_read() -> tuple[int, int, int]:
        time.sleep(0.01)
        return read()

    monkeypatch.setattr(gc, "get_threshold", slow_read)
    before = read()

    def hold(delay: float) -> None:
        time.sleep(delay)
        with young_collections_spaced():
            time.sleep(0.02)

    threads = [threading.Thread(target=hold, args=(0.003 * i,)) for i in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert read() == before


# Forks in a fresh interpreter of its own: pytest's has threads of its own.
_FORK_WHILE_ANOTHER_THREAD_READS = """
import gc, os, threading
from llmhealth.gctune import YOUNG, young_collections_spaced
before = gc.get_threshold()
inside, done = threading.Event(), threading.Event()
def check_in_a_thread():
    with young_collections_spaced():
        inside.set()
        done.wait()
reader = threading.Thread(target=check_in_a_thread)
reader.start()
inside.wait()
pid = os.fork()
if pid == 0:  # a data-loader worker: nothing reads in it
    as_forked = gc.get_threshold()
    with young_collections_spaced():  # a check of its own
        spaced = gc.get_threshold()
    os._exit(0 if as_forked == before == gc.get_threshold() and spaced[0] == YOUNG else 1)
done.set()
reader.join()
_, status = os.waitpid(pid, 0)
print(os.waitstatus_to_exitcode(status), gc.get_threshold() == before)
"""


def _forks_and_gets_them_back(script: str) -> None:
    """``script`` in an interpreter of its own (a fork there leaves this one alone): it
    prints the child's exit status and whether the parent's thresholds are as found."""
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=True
    )
    assert done.stdout.split() == ["0", "True"], done.stderr


def test_a_child_forked_while_another_thread_reads_gets_the_thresholds_back() -> None:
    """A trainer's data-loader workers fork while a thread of the trainer runs
    ``llmhealth.check``: they kept young collections every YOUNG allocations for good,
    and their own checks never gave them back (counting a holder they do not have)."""
    _forks_and_gets_them_back(_FORK_WHILE_ANOTHER_THREAD_READS)


# The reader's first hold is caught between raising the thresholds and counting itself.
_FORK_WHILE_ANOTHER_THREAD_TAKES_ITS_FIRST_HOLD = """
import gc, os, threading
from llmhealth.gctune import YOUNG, young_collections_spaced
before = gc.get_threshold()
raised, go = threading.Event(), threading.Event()
set_threshold = gc.set_threshold
def set_then_wait(*thresholds):
    set_threshold(*thresholds)
    if threading.current_thread().name == "reader" and thresholds[0] == YOUNG:
        raised.set()
        go.wait()
gc.set_threshold = set_then_wait
def check_in_a_thread():
    with young_collections_spaced():
        pass
reader = threading.Thread(target=check_in_a_thread, name="reader")
reader.start()
raised.wait()
threading.Timer(0.2, go.set).start()  # the fork waits for it now
pid = os.fork()
if pid == 0:
    gc.set_threshold = set_threshold
    with young_collections_spaced():  # a check of its own
        pass
    os._exit(0 if gc.get_threshold() == before else 1)
reader.join()
_, status = os.waitpid(pid, 0)
print(os.waitstatus_to_exitcode(status), gc.get_threshold() == before)
"""


def test_a_child_forked_while_another_thread_sets_the_thresholds_gets_them_back() -> None:
    """Forked between another thread's raising the thresholds and its counting itself a
    holder (under the lock), the child found them raised and no holder: its own checks
    then took YOUNG for the thresholds to give back, for good."""
    _forks_and_gets_them_back(_FORK_WHILE_ANOTHER_THREAD_TAKES_ITS_FIRST_HOLD)
