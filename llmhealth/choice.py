"""Which backend gets a request: the one selection rule, and the router's choice around it.

Pure: candidates and in-flight counts in, one candidate out. The library's ``Selector``
and the router's ``choose`` both end in ``fewest_in_flight``, so
"least in flight, ties in a fixed order" is written once. ``choose`` adds the router's
filtering: the pick set, the request's model, and optional session affinity (rendezvous
hashing, kept while the sticky backend is less than ``slack`` requests busier).
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Hashable, Iterable, Mapping
from dataclasses import dataclass
from typing import Final, Literal, TypeVar

from llmhealth.http1 import TOKEN, HeaderSource

Key = TypeVar("Key", bound=Hashable)


def fewest_in_flight(candidates: Iterable[Key], in_flight: Mapping[Key, int]) -> Key | None:
    """The candidate with the fewest requests in flight; None when there is no candidate.

    Least-outstanding rather than round-robin because it steers away from a backend that
    is merely slow or stuck before anything has diagnosed it. A candidate missing from
    ``in_flight`` has none. Ties go to the earliest candidate in the order given, so the
    choice is deterministic: the router passes names sorted, a shard list passes indices
    in order.
    """
    best: Key | None = None
    fewest = 0
    for candidate in candidates:
        count = in_flight.get(candidate, 0)
        if best is None or count < fewest:
            best, fewest = candidate, count
    return best


# A backend whose model list nobody has seen yet (busy since start, so never sent the tiny
# request that lists models, and no expected_model configured) is taken to serve any model:
# refusing it would strand traffic on a fleet whose every backend is busy.
ANY_MODEL: Final = None
MAX_KEY_CHARS: Final = 512  # a session key longer than this is cut: it is only hashed

Models = frozenset[str] | None


@dataclass(frozen=True, slots=True)
class Affinity:
    """Where a request's session key comes from: a header, or a top-level body field."""

    source: Literal["header", "body"]
    name: str

    @classmethod
    def parse(cls, spec: str) -> Affinity:
        """``"header:X-Session-Id"`` or ``"body:user"``; ValueError saying what is wrong."""
        source, _, name = spec.partition(":")
        name = name.strip()
        if source not in ("header", "body") or not name:
            raise ValueError(
                f"{spec!r} is not an affinity source (write 'header:NAME' or 'body:FIELD')"
            )
        if source == "header" and re.fullmatch(TOKEN, name) is None:
            # The edge refuses a request whose field name is not a token (a space, a
            # control character): taken, the affinity found no session key in any request.
            raise ValueError(
                f"{spec!r}: {name!r} is not a header name (letters, digits and "
                "!#$%&'*+-.^_`|~ only), so no request could carry it"
            )
        return cls("header" if source == "header" else "body", name)

    def key_of(self, headers: HeaderSource, body: Mapping[str, object] | None) -> str | None:
        """The request's session key, or None when it has none (then plain least-in-flight).

        ``headers`` must look names up case-insensitively (as HTTP header maps do). A body
        field counts only as a string or an integer: anything else is not a session name.
        """
        if self.source == "header":
            value: object = headers.get(self.name)
        else:
            value = None if body is None else body.get(self.name)
        if isinstance(value, bool) or not isinstance(value, str | int):
            return None
        key = str(value)
        return key[:MAX_KEY_CHARS] if key else None


def serves(models: Models, model: str | None) -> bool:
    """A request without a model goes anywhere; an unknown model list accepts any model."""
    return model is None or models is ANY_MODEL or model in models


def choose(
    pool: Mapping[str, Models],
    in_flight: Mapping[str, int],
    *,
    model: str | None,
    key: str | None = None,
    slack: int = 1,
) -> str | None:
    """The backend for one request, or None when no backend in ``pool`` serves ``model``.

    ``pool`` is the pick set: serving backends, minus any reflex-dropped or already tried,
    each with the models it serves. With a ``key``, the rendezvous winner for that key
    keeps it unless it has ``slack`` or more requests in flight beyond the least loaded
    candidate: the session's prefix cache is worth a little queueing, not a pile-up.
    """
    if slack < 1:
        raise ValueError(f"slack must be at least 1, got {slack}")
    # Sorted, so ties go to the first name whatever order the pool was built in.
    candidates = sorted(name for name, models in pool.items() if serves(models, model))
    least = fewest_in_flight(candidates, in_flight)
    if least is None or key is None:
        return least
    # Highest random weight: when a backend leaves, only its own keys move elsewhere.
    sticky = max(candidates, key=lambda name: (_weight(key, name), name))
    if in_flight.get(sticky, 0) - in_flight.get(least, 0) >= slack:
        return least
    return sticky


def _weight(key: str, name: str) -> int:
    # blake2b, not hash(): Python salts str hashes per process, and a restarted router must
    # send a session where the previous one did. surrogatepass: a key may hold lone
    # surrogates (a header's non-UTF-8 bytes as decoded, a JSON "\udcff"), which a strict
    # encode refused with an error that ended the client's request.
    text = f"{key}\0{name}".encode("utf-8", "surrogatepass")
    digest = hashlib.blake2b(text, digest_size=8).digest()
    return int.from_bytes(digest, "big")
