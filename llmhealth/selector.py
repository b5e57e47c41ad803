"""Which serving backend takes the next request, and the bookkeeping around one request.

The rule is ``choice.fewest_in_flight`` over the fleet's serving set, ties by name (shard
indices ascending, or names in order), as DESIGN says and the router does. The counts of
requests in flight live here, in the caller's process; the ledger only hears how each
request ended.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable, Collection, Iterator
from contextlib import contextmanager

from llmhealth.choice import fewest_in_flight
from llmhealth.fleet_health import FleetHealth, Key
from llmhealth.ledger import NoServingBackend


def counts_against_backend(error: Exception) -> bool:
    """Whether a failed request is the backend's fault, by the router's rule: an answer
    below 500 never is (a 4xx or a 429 is the client's own; a redirect is no failure of
    the server). The status is read as the OpenAI SDK (``status_code``) and httpx
    (``response``) carry it; any error without one counts."""
    status = getattr(error, "status_code", None)
    if status is None:
        status = getattr(getattr(error, "response", None), "status_code", None)
    return not (isinstance(status, int) and status < 500)


class Selector:
    """Least-outstanding selection over a FleetHealth's serving set.

    Least in flight rather than round-robin: it steers away from a backend that is merely
    slow or stuck before anything has diagnosed it. Not thread-safe; one event loop or one
    thread owns it, as the fleet it reads.
    """

    def __init__(self, fleet: FleetHealth) -> None:
        self._fleet = fleet
        self._inflight: dict[Key, int] = {}

    @property
    def fleet(self) -> FleetHealth:
        return self._fleet

    def next_shard(self, *, exclude: Collection[Key] = ()) -> Key:
        """The serving backend with the fewest requests in flight, ties by name, other
        than those in ``exclude`` (a request's retry elsewhere: the one that failed is
        still serving while only SUSPECT, and idle again it won the tie back);
        ``NoServingBackend`` (with every backend's state and last error) when none is."""
        if isinstance(exclude, str):  # one name is no collection of them ("gpu1" in "gpu10")
            raise TypeError("exclude takes a collection of keys, not one key")
        excluded = {self._fleet.key_for(key) for key in exclude}  # as acquire() takes them
        left = [key for key in self._fleet.serving_shards() if key not in excluded]
        chosen = fewest_in_flight(sorted(left), self._inflight)
        if chosen is None:
            elsewhere = " other than the excluded" if exclude else ""
            raise NoServingBackend(f"no backend{elsewhere} is serving: {self._fleet.floor_message}")
        return chosen

    def acquire(self, key: Key) -> None:
        """Count one more request in flight on ``key``."""
        key = self._fleet.key_for(key)  # an unknown key is refused before it is counted
        self._inflight[key] = self._inflight.get(key, 0) + 1

    def release(self, key: Key) -> None:
        """Count one request fewer; releasing more than was acquired is a caller bug."""
        key = self._fleet.key_for(key)
        count = self._inflight.get(key, 0)
        if count == 0:
            raise ValueError(f"release({key!r}) without a matching acquire")
        if count == 1:
            del self._inflight[key]
        else:
            self._inflight[key] = count - 1

    def inflight(self, key: Key) -> int:
        return self._inflight.get(self._fleet.key_for(key), 0)

    @contextmanager
    def lease(
        self,
        *,
        counts: Callable[[Exception], bool] = counts_against_backend,
        exclude: Collection[Key] = (),
    ) -> Iterator[Key]:
        """``with selector.lease() as key:`` a backend for one request (not one of
        ``exclude``, as ``next_shard``).

        Released on any exit. A normal exit reports a success to the ledger; an exception
        for which ``counts`` is true reports a failure (by default every one but those
        carrying a status below 500, as in ``counts_against_backend``: the router's
        rule). Cancellation (asyncio's, or ``concurrent.futures``' from a future of another
        thread) and interrupts are never the backend's fault, so they report nothing; nor
        does a request whose backend's process a verb said ended or was
        replaced meanwhile (``FleetHealth.process_changes``): its end is the old process's,
        and requests hung on a wedged engine condemned its rebuilt replacement.
        """
        if not callable(counts):
            # Taken, it failed only when the request did: a TypeError in place of the
            # request's own error, which the caller's handler missed, and no failure counted.
            raise TypeError(f"counts must be a callable taking the exception, got {counts!r}")
        key = self.next_shard(exclude=exclude)
        self.acquire(key)
        process = self._fleet.process_changes(key)
        try:
            yield key
        except concurrent.futures.CancelledError:
            # A cancellation heard through a future of another thread's loop
            # (``asyncio.run_coroutine_threadsafe``) or a pool is an Exception, unlike
            # asyncio's: counted, stragglers cancelled at a batch's end condemned a backend.
            raise
        except Exception as exc:
            if counts(exc) and self._fleet.process_changes(key) == process:
                self._fleet.report_failure(key, exc)
            raise
        else:
            if self._fleet.process_changes(key) == process:
                self._fleet.report_success(key)
        finally:
            self.release(key)
