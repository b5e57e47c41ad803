"""How often the cyclic garbage collector runs while llmhealth reads a fleet.

At CPython's default a young collection runs every 700 allocations, and every eleventh
of the next generation's makes a full one, which walks every object the process holds.
A process that reads a fleet allocates fast, and what it keeps (each backend's window of
reads, the record, a task and a connection per backend) grows with the fleet, so the
full collections grew with it: a `watch` of 10,000 backends in its own loop made 22-27
of them in an eight-cycle run, up to 1 s each, 8.8-12.5 s of its 34-47 s of CPU (about
0.4 ms per read made, against 0.15 at 3,000). Young collections every YOUNG allocations
left 3 (2.1-2.2 s), and the CPU per read made fell from 1.76 to 1.33-1.37 ms
(bench/README.md, "Where the time per read goes at 10,000"). CPython's own rule still
holds a full collection back until the objects that survived young ones are a quarter of
those it last kept, so it does not come more often as the heap grows.
"""

from __future__ import annotations

import contextlib
import gc
import os
import threading
from collections.abc import Iterator

YOUNG = 10_000  # allocations between two young collections while a fleet is read


class _Spacing:
    """Who spaces them now, and the thresholds the first of them found; under a lock, as
    ``llmhealth.check`` may run in several threads at once: two first holders together
    each took the other's setting for the one to restore, and left it for good."""

    lock = threading.Lock()
    holders = 0
    before: tuple[int, ...] = ()
    spaced: tuple[int, ...] = ()  # what the first holder set them to
    # Of them, the calling thread's: the one thread a forked child keeps.
    mine = threading.local()


@contextlib.contextmanager
def young_collections_spaced() -> Iterator[None]:
    """Young collections every YOUNG allocations inside, the thresholds as they were after;
    none inside where automatic collection was turned off (a young threshold of 0).

    Counted, so that two daemons in one process (the tests) leave the collector as the
    first found it whichever ends first.
    """
    with _Spacing.lock:
        if _Spacing.holders == 0:
            _Spacing.before = gc.get_threshold()
            young, *older = _Spacing.before
            # 0 is automatic collection turned off (an application embedding the library
            # API may run so): raised to YOUNG, collections ran in all of it while a fleet
            # was read.
            _Spacing.spaced = (max(YOUNG, young) if young else 0, *older)
            gc.set_threshold(*_Spacing.spaced)
        _Spacing.holders += 1
    _Spacing.mine.holders = getattr(_Spacing.mine, "holders", 0) + 1
    try:
        yield
    finally:
        _Spacing.mine.holders -= 1
        with _Spacing.lock:
            _Spacing.holders -= 1
            if _Spacing.holders == 0:
                _give_back()


def _give_back() -> None:
    """The thresholds as the first holder found them, unless the application set its own
    meanwhile (a trainer's thread beside the one running ``llmhealth.check``): put back
    over them, its setting was lost for good when the check ended."""
    if gc.get_threshold() == _Spacing.spaced:
        gc.set_threshold(*_Spacing.before)


def _settled_before_a_fork() -> None:
    """Forks wait for a thread inside the lock to leave it: forked between its setting the
    thresholds and its count of holders (either way round), the child found them raised
    and no holder to give them back, and kept young collections at YOUNG for good."""
    _Spacing.lock.acquire()


def _settled_in_the_parent() -> None:
    _Spacing.lock.release()


def _only_this_thread_in_a_child() -> None:
    """A forked child has only the thread that forked: the holders it counts are that
    thread's alone. A trainer's data-loader workers, forked while a thread of its own ran
    ``llmhealth.check``, kept young collections at YOUNG for good: the holder counted was
    a thread the child does not have, so nothing gave the thresholds back; and the lock,
    taken for the fork, is the child's afresh."""
    _Spacing.lock = threading.Lock()
    left = getattr(_Spacing.mine, "holders", 0)
    if _Spacing.holders and not left:
        _give_back()
    _Spacing.holders = left


os.register_at_fork(
    before=_settled_before_a_fork,
    after_in_parent=_settled_in_the_parent,
    after_in_child=_only_this_thread_in_a_child,
)
