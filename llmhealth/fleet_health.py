"""The ledger for a program that drives its own fleet: a trainer's verbs over one Ledger.

No I/O: the caller probes, restarts and syncs weights, and tells this object what happened;
the only thing read here is the injectable clock. Every verb is one event of the ledger's
transition table (``llmhealth/ledger.py``), so ``check``, ``watch``, the router and this
API share one state machine. A verb the table refuses changes nothing and returns why.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TypeAlias, TypeVar

from llmhealth.classify import Verdict
from llmhealth.config import check_url
from llmhealth.fleet import events_for
from llmhealth.ledger import (
    BackendSnapshot,
    Condemned,
    Event,
    GoodVerdict,
    Ledger,
    LedgerPolicy,
    NewProcessUp,
    ProbeFailure,
    ProcessGone,
    Readmitted,
    RequestFailure,
    RequestSuccess,
    RestartFailed,
    RestartIssued,
    Retire,
    State,
    Transition,
    UnknownBackend,
    UnplannedRestart,
    WeightsPartial,
    WeightsStamped,
    is_finite_number,
)
from llmhealth.text import openai_root, printable

# A backend is named by its shard index when the fleet was given a list of URLs, and by
# its name when it was given a mapping of names to URLs.
Key: TypeAlias = int | str
Clock: TypeAlias = Callable[[], float]
# A mapping's names: any str type, a StrEnum's members too. Mapping is invariant in its key,
# so typed Mapping[str, str] the constructor took a dict[Gpu, str] at run time, and mypy
# refused it in the caller's code.
_Name = TypeVar("_Name", bound=str)

_MAX_ERROR_TEXT = 300  # an exception's text ends up in status output; keep it bounded


class FleetExhausted(RuntimeError):  # noqa: N818 - named for the condition, as in seed 000
    """Too few backends serve for the run to be worth continuing; names every backend."""


# LedgerPolicy field -> the FleetPolicy field it comes from, where the names differ.
_FIELD_FOR = {"restart_budget": "max_restart_attempts", "restart_budget_window": "restart_window"}


@dataclass(frozen=True, slots=True)
class FleetPolicy:
    """Thresholds for a FleetHealth. Refused at construction, field named, when out of range.

    ``max_restart_attempts`` counts ``mark_restarting`` calls per backend within
    ``restart_window`` seconds; the attempt past it retires the backend.
    ``recover_in_place`` (off, as in seed 000: a trainer restarts every DEAD shard) lets
    the condemned process itself back to STALE when verdicts identify it as the same one;
    ``max_in_place_recoveries`` bounds that within ``restart_window``.
    """

    unhealthy_threshold: int = 3
    healthy_threshold: int = 2
    max_restart_attempts: int = 5
    min_healthy: int = 1
    restart_window: float = 86400.0
    recover_in_place: bool = False
    max_in_place_recoveries: int = 3

    def __post_init__(self) -> None:
        # The ledger's policy holds the range of every field (one rule, not two copies);
        # only the names differ, and the error names ours.
        try:
            self.ledger_policy()
        except ValueError as exc:
            field, _, rule = str(exc).partition(" ")
            raise ValueError(f"FleetPolicy.{_FIELD_FOR.get(field, field)} {rule}") from None

    def ledger_policy(self) -> LedgerPolicy:
        return LedgerPolicy(
            unhealthy_threshold=self.unhealthy_threshold,
            healthy_threshold=self.healthy_threshold,
            min_healthy=self.min_healthy,
            restart_budget=self.max_restart_attempts,
            restart_budget_window=self.restart_window,
            recover_in_place=self.recover_in_place,
            max_in_place_recoveries=self.max_in_place_recoveries,
        )


class FleetHealth:
    """Per-backend health for a fleet the caller drives, and the serving set it implies.

    ``base_urls``: a list (backends are shard indices 0..n-1) or a mapping of names to
    URLs, each a server's root (``http://10.0.0.5:8000``, as for ``check``), since the
    ``Prober`` reads ``/metrics`` beside ``/v1``. Every verb takes that index or name (or
    the name a ``Transition`` or snapshot carries: ``"1"`` for shard 1); an unknown one
    raises ``UnknownBackend`` (a ``LookupError``). ``clock`` defaults to
    ``time.monotonic``; tests inject their own.
    """

    def __init__(
        self,
        base_urls: Sequence[str] | Mapping[_Name, str],
        *,
        policy: FleetPolicy | None = None,
        clock: Clock | None = None,
    ) -> None:
        if policy is not None and not isinstance(policy, FleetPolicy):
            raise TypeError(f"policy must be a FleetPolicy, got {type(policy).__name__}")
        self._policy = policy if policy is not None else FleetPolicy()
        self._clock: Clock = clock if clock is not None else time.monotonic
        now = self._clock()
        if not is_finite_number(now):
            raise TypeError(f"clock must return seconds as a number, got {now!r}")
        if isinstance(base_urls, str | bytes):
            raise TypeError("base_urls must be a list of URLs or a mapping of names to URLs")
        if isinstance(base_urls, Mapping):
            self._keys: tuple[Key, ...] = tuple(base_urls)
            for key in self._keys:
                if not isinstance(key, str) or not key:
                    raise ValueError(f"backend names must be non-empty strings, got {key!r}")
            urls = [_base_url(url) for url in base_urls.values()]
        else:
            urls = [_base_url(url) for url in base_urls]
            self._keys = tuple(range(len(urls)))
        if not self._keys:
            raise ValueError("a fleet needs at least one backend URL")
        if self._policy.min_healthy > len(self._keys):
            raise ValueError(
                f"FleetPolicy.min_healthy is {self._policy.min_healthy}, more than the "
                f"{len(self._keys)} backends given: the fleet would start exhausted"
            )
        # A name's own text: str() of a (str, Enum) member is "Gpu.A", not its "gpu0".
        self._names = {key: _text_of(key) for key in self._keys}
        # Per ledger name: how often the caller said the process ended or was replaced.
        self._process_changes: dict[str, int] = {}
        self._key_of = {name: key for key, name in self._names.items()}
        self._ledger = Ledger(
            self._policy.ledger_policy(),
            [(self._names[key], url) for key, url in zip(self._keys, urls, strict=True)],
            now=now,
        )

    # --- verbs: what the caller saw or did -------------------------------------------

    def record_probe(self, key: Key, *, ok: bool, error: str = "") -> Transition:
        """Fold one probe result in. Probes never resurrect: outside the serving set a good
        one is ignored, because an answer says nothing about the weights."""
        if not isinstance(ok, bool):  # "no" or a response object would read as a pass
            raise TypeError(f"ok must be True or False, got {ok!r}")
        if ok:
            return self._apply(key, GoodVerdict(now=self._clock()))
        failure = ProbeFailure(now=self._clock(), reason="probe failed", detail=_describe(error))
        return self._apply(key, failure)

    def record_actor_death(self, key: Key, error: str = "") -> Transition:
        """Proof the process is gone: DEAD at once, with no counting of further rounds.

        Waiting for ``unhealthy_threshold`` probes would only delay the same conclusion,
        long enough for a weight sync hung on that process to abort first. Said of a
        backend doubt already condemned, it stays DEAD and that process never recovers
        in place; said again, it changes nothing.
        """
        gone = ProcessGone(now=self._clock(), reason="process gone", detail=_describe(error))
        return self._apply(key, gone)

    def condemn_silent_participant(self, key: Key, *, reason: str) -> Transition:
        """DEAD for a process that answers yet did not take part in a collective.

        A judgement, not an observation: ``reason`` must say why this backend is the
        culprit. DEAD rather than STALE, since a STALE process still joins the next sync.
        """
        detail = _reason(reason, "condemning")
        return self._apply(
            key, Condemned(now=self._clock(), reason="silent participant", detail=detail)
        )

    def report_failure(self, key: Key, error: BaseException | str) -> Transition:
        """A real request failed on this backend. Counted on its own streak, which only a
        completed request clears (never a good probe): a server that answers every probe
        and fails every request is still condemned."""
        return self._apply(
            key,
            RequestFailure(
                now=self._clock(), reason="request failed", detail=_describe(error), traffic=True
            ),
        )

    def report_success(self, key: Key) -> Transition:
        """A real request completed: clears the request-failure streak."""
        return self._apply(key, RequestSuccess(now=self._clock()))

    def mark_restarting(self, key: Key) -> Transition:
        """A replacement is being brought up for a DEAD backend; past the attempt budget
        the backend is retired instead."""
        return self._apply(key, RestartIssued(now=self._clock()))

    def mark_loaded(self, key: Key, *, base_url: str | None = None) -> Transition:
        """The replacement is up: STALE, holding whatever weights it loaded at start.

        ``base_url``: the replacement's address when it bound a new one; the serving URLs
        follow it, or traffic would go to a socket nobody listens on.
        """
        url = None if base_url is None else _base_url(base_url)
        return self._apply(key, NewProcessUp(now=self._clock(), url=url))

    def mark_restart_failed(self, key: Key, *, error: str = "") -> Transition:
        """The restart did not bring the engine up: back to DEAD, ``last_error`` saying
        what the reload failed on (a held GPU and a bad config want different answers)."""
        why = _describe(error) if error else "the engine did not come up"
        return self._apply(key, RestartFailed(now=self._clock(), reason=why))

    def mark_weights_partial(self, key: Key) -> Transition:
        """An aborted weight sync left this backend with mixed weights: STALE until a
        completed refit, remembering whether it was SUSPECT. Absent backends are left alone."""
        return self._apply(key, WeightsPartial(now=self._clock()))

    def record_weight_version(self, key: Key, *, weight_version: int) -> Transition:
        """This serving backend received this sync's weights. Nothing else changes: a
        transition here would clear the request-failure streak after every sync."""
        return self._apply(key, WeightsStamped(now=self._clock(), weight_version=weight_version))

    def report_refit(self, key: Key, *, weight_version: int) -> Transition:
        """A completed refit: the only way for a STALE backend back into the serving set,
        HEALTHY, or SUSPECT with its failures if it was so when its weights were left
        partial. A serving backend is not refit this way (``applied`` False): stamp it
        with ``record_weight_version``. The version is required, as ``record_weight_version``
        requires it: None (a trainer's unset variable) would re-admit with none recorded.
        """
        if weight_version is None:
            raise ValueError("report_refit: weight_version must be an integer, got None")
        return self._apply(key, Readmitted(now=self._clock(), weight_version=weight_version))

    def retire(self, key: Key, *, reason: str) -> Transition:
        """Out for good; the run continues on what is left."""
        return self._apply(key, Retire(now=self._clock(), reason=_reason(reason, "retiring")))

    def record_verdict(self, key: Key, verdict: Verdict) -> list[Transition]:
        """Feed one of llmhealth's own verdicts (``Prober`` does), with the meaning ``check``
        gives it, except that an answered tiny request never re-admits: here only
        ``report_refit`` does, because an answer says nothing about the weights."""
        events = events_for(
            verdict,
            self.state_of(key),
            now=self._clock(),
            previous=None,
            readmit_on_answer=False,
        )
        return [self._apply(key, event) for event in events]

    def raise_if_exhausted(self) -> None:
        """Raise ``FleetExhausted`` when fewer than ``min_healthy`` backends serve.

        The message names every backend's state and last error, so the failure says why.
        """
        if self._ledger.floor_breached:
            raise FleetExhausted(self._ledger.floor_message)

    # --- views -----------------------------------------------------------------------

    @property
    def policy(self) -> FleetPolicy:
        return self._policy

    @property
    def keys(self) -> tuple[Key, ...]:
        """Every backend's index or name, in the order given."""
        return self._keys

    @property
    def membership_epoch(self) -> int:
        """Moves by one each time the serving set changes, and only then."""
        return self._ledger.epoch

    def state_of(self, key: Key) -> State:
        return self._ledger.state_of(self._name(key))

    def key_for(self, key: Key) -> Key:
        """The fleet's own key for a backend named by index, name or a ledger name
        (``"1"`` for shard 1), so that one backend is never counted under two keys."""
        return self._key_of[self._name(key)]

    def process_changes(self, key: Key) -> int:
        """How many times a verb said this backend's process ended or was replaced
        (``record_actor_death``, ``mark_loaded``), or a verdict showed it restarted by
        itself (``record_verdict``). A reader that keeps reads between calls starts
        afresh when it moves: a restart, load and refit all between two of
        its reads must not be compared with the old process's, nor called unplanned."""
        return self._process_changes.get(self._name(key), 0)

    def base_url_of(self, key: Key) -> str:
        return self._ledger.snapshot(self._name(key), self._clock()).url

    def snapshot(self) -> dict[Key, BackendSnapshot]:
        """Everything known about each backend, in the order given."""
        now = self._clock()
        return {key: self._ledger.snapshot(self._names[key], now) for key in self._keys}

    def serving_shards(self) -> list[Key]:
        """The backends that may be handed traffic (HEALTHY or SUSPECT)."""
        return self._in(self._ledger.serving)

    def awaiting_an_answer(self) -> list[Key]:
        """DEAD backends condemned by failed requests that may come back in place
        (``recover_in_place``): a reader asks them the tiny request whenever they are idle
        (``Ledger.awaiting_an_answer``), as `watch` does."""
        return self._in(self._ledger.awaiting_an_answer)

    def absent_shards(self) -> list[Key]:
        """The backends whose process cannot take part in a collective (DEAD, RESTARTING,
        RETIRED). Not the complement of serving: a STALE process is alive and refits."""
        return self._in(self._ledger.absent)

    def suspected_shards(self) -> list[Key]:
        """SUSPECT, or STALE having been SUSPECT when a weight sync broke. Not for routing:
        for a caller with independent evidence that something stopped taking part."""
        return self._in(self._ledger.suspected)

    def serving_base_urls(self) -> list[str]:
        """The serving backends' URLs, e.g. to push to a router."""
        now = self._clock()
        return [self._ledger.snapshot(self._names[key], now).url for key in self.serving_shards()]

    def shard_for_base_url(self, url: str) -> Key | None:
        """The backend behind a URL, for failures reported by something that knows URLs.

        An OpenAI base URL (``http://10.0.0.5:8000/v1``, what a rollout router knows its
        backends by) names the server at its root: looked up as given, it found none, and
        every failure reported that way was lost. White space around it is dropped, as the
        constructor and ``mark_loaded`` drop it: a URL read from a file ends in a newline,
        and the fleet took it that way yet found nothing by it.
        """
        if not isinstance(url, str):
            # Its type, not its repr: b"http://alice:s3cret@host" is a URL with a password.
            raise TypeError(f"a backend URL must be a string, got {type(url).__name__}")
        url = url.strip()
        name = self._ledger.by_url(openai_root(url) or url)
        return None if name is None else self._key_of[name]

    def counts_by_state(self) -> dict[State, int]:
        return self._ledger.counts

    def as_metrics(self) -> dict[str, float]:
        """Flat numbers for a training logger: ``fleet/serving``, ``fleet/dead``, …"""
        return {f"fleet/{key}": float(value) for key, value in self._ledger.metrics.items()}

    @property
    def floor_message(self) -> str:
        return self._ledger.floor_message

    # --- internals -------------------------------------------------------------------

    def _apply(self, key: Key, event: Event) -> Transition:
        # Transition.name is the ledger's name; callers know the backend by its key.
        name = self._name(key)
        transition = self._ledger.apply(name, event)
        # A restart seen in a verdict (a supervisor's) is a new process as much as a
        # verb's: requests hung on the old one were counted against its refit successor.
        if transition.applied and isinstance(event, ProcessGone | NewProcessUp | UnplannedRestart):
            self._process_changes[name] = self._process_changes.get(name, 0) + 1
        return transition

    def _name(self, key: Key) -> str:
        # bool is an int and 1.0 hashes as 1: either would silently mean shard 1. A str
        # subclass (a StrEnum, numpy's str_) is a name: the constructor took it as one, and
        # refused here its own keys, so a Selector's lease() of them raised UnknownBackend.
        if type(key) is int or isinstance(key, str):
            if key in self._names:
                return self._names[key]
            if key in self._key_of:
                # The ledger's name, as a Transition or snapshot carries it ("1" for shard
                # 1): what the fleet hands out must be taken back.
                return self._names[self._key_of[key]]
        raise UnknownBackend(f"no backend {key!r} in this fleet; it has {_listing(self._keys)}")

    def _in(self, names: Iterable[str]) -> list[Key]:
        wanted = set(names)
        return [key for key in self._keys if self._names[key] in wanted]


def _base_url(url: object) -> str:
    if not isinstance(url, str):
        # Its type, not its repr: a bytes URL (os.environb's) with a password in it was
        # repeated whole, before check_url's refusal of user info could see it.
        raise ValueError(f"a backend URL must be a string, got {type(url).__name__}")
    return check_url(url)  # ValueError naming the URL when it is not http(s) with a host


def _text_of(key: Key) -> str:
    """A key's ledger name: an index's digits, or a name's own text (of a str subclass
    too, whose str() may be something else)."""
    return str(key) if isinstance(key, int) else str.__str__(key)


def _listing(keys: Sequence[Key]) -> str:
    if all(isinstance(key, int) for key in keys):
        return f"shards 0..{len(keys) - 1}"
    return "backends " + ", ".join(repr(key) for key in keys)


def _reason(reason: object, doing: str) -> str:
    """A judgement's stated cause: required, since it is all an operator will read of it."""
    if not isinstance(reason, str) or not reason.strip():
        raise ValueError(f"{doing} a backend needs a reason, got {reason!r}")
    return _describe(reason)


def _describe(error: BaseException | str | None) -> str:
    """Short and printable: an exception's text often quotes the server (an SDK's error
    carries the response body), and it reaches snapshots, messages and terminals. None,
    an untyped caller's `str(e) if e else None`, is no text, not "NoneType: None"."""
    if error is None:
        return ""
    text = error if isinstance(error, str) else f"{type(error).__name__}: {error}".rstrip(": ")
    # Escaped before the cut (an escape takes up to ten characters), but only the part
    # that can be shown: each character escapes to one or more, so the first
    # _MAX_ERROR_TEXT + 1 say all the cut needs. A megabyte of an error body with its
    # newlines, escaped whole, held the caller's event loop a quarter of a second.
    text = printable(text[: _MAX_ERROR_TEXT + 1])
    return text if len(text) <= _MAX_ERROR_TEXT else text[: _MAX_ERROR_TEXT - 3] + "..."
