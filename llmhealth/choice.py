"""The one selection rule: of the backends that may take a request, the least busy one.

Pure: candidates and in-flight counts in, one candidate out. The ledger's ``select``, the
library's ``Selector`` and the router's choice all end here, so "least in flight, ties in
a fixed order" is written once. Filtering (serving set, model, affinity) is the caller's.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Mapping
from typing import TypeVar

Key = TypeVar("Key", bound=Hashable)


def fewest_in_flight(candidates: Iterable[Key], in_flight: Mapping[Key, int]) -> Key | None:
    """The candidate with the fewest requests in flight; None when there is no candidate.

    Least-outstanding rather than round-robin because it steers away from a backend that
    is merely slow or stuck before anything has diagnosed it. A candidate missing from
    ``in_flight`` has none. Ties go to the earliest candidate in the order given, so the
    choice is deterministic: the ledger passes names sorted, a shard list passes indices
    in order.
    """
    best: Key | None = None
    fewest = 0
    for candidate in candidates:
        count = in_flight.get(candidate, 0)
        if best is None or count < fewest:
            best, fewest = candidate, count
    return best
