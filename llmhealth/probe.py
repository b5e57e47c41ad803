"""HTTP at the edge: bounded reads of /metrics, the tiny request, a proxy's /v1/models.

Every request goes through ``wire`` and is capped in bytes and in total time (a server
trickling one byte a second must not hold a check past its timeout), and every failure
is translated here, once, into a value: a sick backend is data, never an exception that escapes. Any
other exception while examining one backend becomes that backend's verdict too, and
everything the server said is made printable here, before anything shows it.
"""

from __future__ import annotations

import asyncio
import json
import math
import socket
import ssl
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from llmhealth import __version__, wire
from llmhealth.classify import (
    Answer,
    Decision,
    Outcome,
    Read,
    ReadProblem,
    SendTinyRequest,
    TakeRead,
    Target,
    Verdict,
    VerdictKind,
    answered_another_process,
    asleep_engines,
    decide,
    freeze_began,
    judge_proxy,
    learned_step,
    left_unasked,
    newest_vllm_read,
    reads_still_needed,
    window_for,
)
from llmhealth.config import LONGEST_READ, SHORTEST_DURATION
from llmhealth.localcpu import LocalCpu
from llmhealth.metrics import Signals, parse_metrics, sharing
from llmhealth.text import printable
from llmhealth.window import LongestStep, WedgeRules

Clock = Callable[[], float]
Sleep = Callable[[float], Awaitable[None]]


def steady_for(clock: Clock, steady: Clock | None = None) -> Clock | None:
    """The steady clock reads and answers are stamped with besides ``clock``, for the
    time between them (``classify.Read.tick``): ``steady`` where given, else
    ``time.monotonic`` for the wall clock, and none for another clock a caller injected (a
    test's or a simulation's, which moves only as told): time is then taken on it."""
    if steady is not None:
        return steady
    return time.monotonic if clock is time.time else None


def _tick(steady: Clock | None) -> float | None:
    return None if steady is None else steady()


_SMALL_BODY = 1024 * 1024  # /v1/models and completions answers are small; cap them hard
_TINY_PROMPT = "Hi"
# The longest model id taken from /v1/models: a served name or a local path (Hugging
# Face ids are at most 96 characters), far from what a hostile list can make of it.
_MAX_MODEL_ID = 1024
_USER_AGENT = f"llmhealth/{__version__}"


# A cluster's member that may not act (a standby daemon reading every backend, a check
# from cron that did not win the lease): nothing it sees is settled, its tiny request
# would take a slot for nothing, and the leader's read of that idle backend would show
# the request as work.
STANDBY_ASKS_NOTHING = "a standby leaves the tiny request to the leader"
# Nothing a RETIRED backend answers is used (only a reset moves it, and then it is
# asked as any STALE one), and its server may be serving someone else by now.
RETIRED_ASKED_NOTHING = "it is retired; only a reset brings it back"


def seconds_argument(value: object, name: str) -> float:
    """A caller's number of seconds for a read or a wait, for the library's entry points:
    from a millisecond to an hour, as in a config (``config.SHORTEST_DURATION``,
    ``LONGEST_READ``): an infinite timeout let a hung backend hold a call for ever, 5000
    meant milliseconds, and a wait of 1e-310 overflowed the count of reads it allows."""
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not SHORTEST_DURATION <= value <= LONGEST_READ
    ):
        raise ValueError(
            f"{name} must be a number of seconds from a millisecond to an hour, got {value!r}"
        )
    return float(value)


# Of the wait: how much sooner a target's next read starts once its server has closed an
# idle connection of ours. A server times out a connection idle for its keep-alive
# (uvicorn's default, so vLLM's: 5 s, llmhealth's default wait), and a read due one wait
# after the last one began reached it just after that about every other time: a new
# connection then, the dearest part of a read (bench/README.md, "Reading before the
# keep-alive runs out"). 0.2 s at a 5 s wait keeps the connection through an event loop
# running 5,000 reads; the cost is a read in 25 more, for those targets only.
KEEP_ALIVE_LEAD = 0.04
# Seconds a caller's timer may fire early (uvloop counts in milliseconds), at most this
# share of a wait: the Prober reads a backend whose call comes that little sooner, so a
# loop calling every wait from each call's start reads at every call.
_TIMER_JITTER = 0.01
_TIMER_JITTER_SHARE = 0.002


@dataclass(frozen=True, slots=True)
class ProbeSettings:
    wait: float = 5.0
    timeout: float = 5.0
    answer_timeout: float = 10.0
    max_body: int = 16 * 1024 * 1024
    # A run keeps reading a frozen backend until its wedge window is covered, for at
    # most this long; ``max_reads`` fixes the number of reads instead, where given.
    max_check_time: float = 300.0
    max_reads: int | None = None
    # Why this reader sends no tiny request, or None when it may (STANDBY_ASKS_NOTHING).
    unasked: str | None = None
    # Backends whose ledger waits for an answered tiny request (STALE: only re-admission
    # brings one back): asked whenever idle, even though their counters moved.
    awaiting_answer: frozenset[str] = frozenset()
    # Backends RETIRED in the ledger: read, never asked (RETIRED_ASKED_NOTHING).
    retired: frozenset[str] = frozenset()

    def why_unasked(self, name: str) -> str | None:
        """Why this reader sends ``name`` no tiny request, or None when it may."""
        if self.unasked is not None:
            return self.unasked
        return RETIRED_ASKED_NOTHING if name in self.retired else None

    def wants_answer(self, name: str) -> bool:
        """Whether this reader should ask ``name`` even though its engine moved: its
        ledger waits for an answer, and this reader may send one."""
        return name in self.awaiting_answer and self.why_unasked(name) is None

    @property
    def read_limit(self) -> int:
        """Reads one verdict may take: three (two waits) at least."""
        if self.max_reads is not None:
            return self.max_reads
        if self.wait <= 0:
            return 3
        return max(3, 1 + int(self.max_check_time // self.wait))

    @property
    def paced_read_limit(self) -> int:
        """``read_limit`` for reads on a schedule (``watch``, the ``Prober``), which start
        ``soonest_read`` apart at the closest: as many as span ``max_check_time`` at that
        pace, and one more (65 at the defaults). The 61 reads of the defaults came 4.8 s
        apart and spanned 288 s, short of a 300 s window (``startup_wedge_after``): a young
        engine's wedge was proven only once its startup grace had ended, 10 min later.
        The one more: a freeze lasts from its first read's answer to its newest read's
        request (``classify``), and a read is asked for only once the one before it is
        in, so N reads span at least N - 2 paces whatever the answers took; with answers
        of 2.5 s, 64 reads fell short of 300 s for ever."""
        if self.max_reads is not None or self.wait <= 0:
            return self.read_limit
        return max(self.read_limit, 2 + math.ceil(self.max_check_time / self.soonest_read))

    @property
    def soonest_read(self) -> float:
        """The least time between the starts of two reads on a schedule: a wait, less
        ``KEEP_ALIVE_LEAD`` of it, less what a caller's timer may fire early (the
        ``Prober`` reads a backend whose call comes that little sooner)."""
        return self.wait * (1 - KEEP_ALIVE_LEAD) - min(
            _TIMER_JITTER, _TIMER_JITTER_SHARE * self.wait
        )

    @property
    def longest_undecided(self) -> float:
        """How long a ``watch`` reader may examine a backend without a verdict, whatever
        its reads' pace: it decides by its paced read limit ("stalled" at worst), a wait
        apart at the slowest. A cluster's leader waits this long for a member's verdict
        before it takes the silence for doubt; ``max_check_time`` and a wait was shorter
        than the paced read limit's reads a wait apart, and doubted backends still being
        read."""
        return self.paced_read_limit * self.wait

    def wants_cpu(
        self, reads: Sequence[Read], learned: LongestStep | None, rules: WedgeRules
    ) -> bool:
        """Is local CPU time worth sampling: only a window past two waits can use it.

        Finding a backend's processes scans /proc; a fleet of engines with short steps
        never pays for it.
        """
        window = window_for(reads, learned, rules).seconds
        if reads:  # a freeze keeps the youth it began with (classify._judge_freeze)
            window = max(window, window_for(reads, learned, rules, since=reads[0]).seconds)
        return window > 2 * self.wait

    def for_answer(
        self, reads: Sequence[Read], learned: LongestStep | None, rules: WedgeRules
    ) -> ProbeSettings:
        """The tiny request waits as long as the engine's longest steps can make it queue.

        An engine inside a long step answers only after it; the same multiple of the
        longest step known as the wedge window uses, bounded by ``max_check_time``.
        """
        step = learned_step(reads, learned)
        if step is None:
            return self
        grown = min(self.max_check_time, rules.step_factor * step.seconds)
        return replace(self, answer_timeout=max(self.answer_timeout, grown))


class _RequestFailedError(Exception):
    """Internal: a request that gave no usable answer, already classified."""

    def __init__(
        self, problem: ReadProblem, detail: str, status: int | None = None, *, sent: bool = True
    ) -> None:
        super().__init__(detail)
        self.problem = problem
        self.detail = detail
        self.status = status  # the HTTP status that made the answer unusable, if one did
        self.sent = sent  # False: no connection, so the request never went out


class CheckerStarvedError(Exception):
    """A request cut off because this process could not run, not because of the server.

    Not a verdict on the backend: it ends the examination as "not judged", and no ledger
    event follows from it (see ``_unexamined``).
    """


@dataclass(frozen=True, slots=True)
class _Response:
    status: int
    body: bytes
    headers: Mapping[str, str]
    elapsed: float


class Client:
    """One target's connection: every request to it goes through ``wire``, in turn.

    One client per target, so its connection is reused between that target's requests
    and no pool is ever searched; a target's requests are sequential, so one connection
    is all it needs. The TLS context is the fleet's, shared.
    """

    def __init__(self, tls: ssl.SSLContext | None = None) -> None:
        self.connection = wire.Connection(tls, _USER_AGENT)

    async def aclose(self) -> None:
        """Close for good: a request under way on it (another task's) opens no new one."""
        await self.connection.shut()

    async def __aenter__(self) -> Client:
        return self

    async def __aexit__(self, *_exc: object) -> None:
        await self.aclose()


def new_client(tls: ssl.SSLContext | None = None) -> Client:
    """A client for one target; ``tls`` is shared by the fleet (None: the process's default
    context, built only if an https target needs it)."""
    return Client(tls)


async def _request(
    client: Client,
    method: str,
    url: str,
    *,
    timeout: float,
    max_bytes: int,
    body: Mapping[str, Any] | None = None,
    headers: Mapping[str, str] | None = None,
) -> _Response:
    """One bounded request: connect to last byte within ``timeout``, at most ``max_bytes``.

    ``wire`` retries a GET once on a fresh connection when a kept-alive one turns out
    dead before any byte of the answer (a server closes idle connections on its own
    clock: uvicorn after 5 s, the default wait), within the same ``timeout``; the tiny
    request, which may not be sent twice, is never retried, and goes on a fresh
    connection unless the kept one was used just now (``wire.Connection.request``).
    """
    started = time.monotonic()
    deadline = asyncio.get_running_loop().time() + timeout
    payload = None
    if body is not None:
        # RecursionError and non-JSON values are ours to get wrong, not the server's.
        payload = json.dumps(body, separators=(",", ":"), allow_nan=False).encode()
    try:
        answer = await client.connection.request(
            method,
            url,
            deadline=deadline,
            max_bytes=max_bytes,
            body=payload,
            headers=headers,
            accept=lambda status, got: _refuse_encoded(status, got, method, url),
        )
    except wire.WireError as exc:
        if exc.failure is wire.Failure.STARVED:
            raise CheckerStarvedError(f"{method} {_path(url)}: {exc.detail}") from exc
        raise _wire_failure(exc, method, url, timeout, max_bytes) from exc
    return _Response(answer.status, answer.body, answer.headers, time.monotonic() - started)


def _wire_failure(
    exc: wire.WireError, method: str, url: str, timeout: float, max_bytes: int
) -> _RequestFailedError:
    """What a failed request says about the server: the problem, and the evidence."""
    failure, received = exc.failure, exc.received
    if failure is wire.Failure.CONNECT_TIMEOUT:
        return _RequestFailedError(
            ReadProblem.DOWN, f"no TCP connection within {timeout:g} s (no route?)", sent=False
        )
    if failure is wire.Failure.CONNECT_FAILED:
        return _RequestFailedError(ReadProblem.DOWN, _connect_error(_root_cause(exc)), sent=False)
    if failure is wire.Failure.ANSWER_TIMEOUT:
        return _RequestFailedError(
            ReadProblem.UNRESPONSIVE,
            f"{method} {_path(url)}: connected, but {exc.detail} within {timeout:g} s"
            + (f" ({received} bytes received)" if received else ""),
        )
    if failure is wire.Failure.TOO_BIG:
        return _RequestFailedError(
            ReadProblem.UNUSABLE, f"{method} {_path(url)} sent more than the {_size(max_bytes)} cap"
        )
    if failure is wire.Failure.MALFORMED:  # no usable answer, as a reset gives none
        return _RequestFailedError(
            ReadProblem.DOWN,
            f"{method} {_path(url)}: answered, but not in HTTP/1.x: {_reason(exc)}",
        )
    where = f"mid-body after {received} bytes" if received else "before an answer"
    return _RequestFailedError(
        ReadProblem.DOWN, f"connection closed or reset {where}: {_reason(exc)}"
    )


async def read_metrics(
    client: Client,
    target: Target,
    settings: ProbeSettings,
    clock: Clock,
    steady: Clock | None = None,
) -> Read:
    """One GET /metrics, as a Read; never raises for anything the server does.
    ``steady``: as ``steady_for`` takes it."""
    url = f"{target.url}/metrics"
    steady = steady_for(clock, steady)
    sent_tick = _tick(steady)
    sent = clock()
    try:
        response = await _request(
            client, "GET", url, timeout=settings.timeout, max_bytes=settings.max_body
        )
    except _RequestFailedError as failure:
        return Read(clock(), problem=failure.problem, detail=failure.detail, tick=_tick(steady))
    if 300 <= response.status < 400 and "location" in response.headers:
        # Without a Location (a 304 to a request that asked nothing conditional) it is no
        # redirect: said as "redirected (304) to ?", it is answered as any other status.
        location = _shortened(printable(response.headers["location"]))
        return Read(
            clock(),
            problem=ReadProblem.UNUSABLE,
            detail=f"GET /metrics redirected ({response.status}) to {location}; not followed",
            tick=_tick(steady),
        )
    if not 200 <= response.status < 300:
        return Read(
            clock(),
            problem=ReadProblem.UNUSABLE,
            detail=f"GET /metrics answered HTTP {response.status}",
            tick=_tick(steady),
        )
    try:
        signals = _printable_signals(parse_metrics(response.body))
    except Exception as exc:  # the parser must never raise; if it does, this read is unusable
        return Read(
            clock(),
            problem=ReadProblem.UNUSABLE,
            detail=f"GET /metrics: its {len(response.body)} bytes could not be read "
            f"({_exception(exc)})",
            tick=_tick(steady),
        )
    detail = ""
    if not signals.has_vllm:
        kind = printable(response.headers.get("content-type", "no content type")[:100])
        # The parser's own note when it gave up on the text ("without vLLM series" was
        # false of a text too long to read, as one showing work could be).
        said = f": {'; '.join(signals.notes)}" if signals.notes else " without vLLM series"
        detail = f"GET /metrics sent {len(response.body)} bytes ({kind}){said}"
    return Read(
        clock(), signals=signals, detail=detail, sent=sent, tick=_tick(steady), sent_tick=sent_tick
    )


async def list_models(
    client: Client, target: Target, timeout: float, headers: Mapping[str, str]
) -> tuple[str, ...]:
    """The model ids GET /v1/models lists, as listed (not yet made printable); raises
    _RequestFailedError with the cause otherwise."""
    response = await _request(
        client,
        "GET",
        f"{target.url}/v1/models",
        timeout=timeout,
        max_bytes=_SMALL_BODY,
        headers=headers,
    )
    # Any 2xx with a list (DESIGN: a proxy is `up` by one): a balancer's 203 was `down`.
    if not 200 <= response.status < 300:
        raise _RequestFailedError(
            ReadProblem.UNUSABLE, f"GET /v1/models answered HTTP {response.status}", response.status
        )
    try:
        listing = json.loads(response.body)
        models = tuple(_model_id(entry["id"]) for entry in listing["data"])
    # RecursionError: 200,000 nested brackets fit well under the body cap.
    except (ValueError, KeyError, TypeError, RecursionError) as exc:
        raise _RequestFailedError(
            ReadProblem.UNUSABLE, "GET /v1/models did not send a model list"
        ) from exc
    return models


def _model_id(value: object) -> str:
    """One listed model id: a name, not any JSON value made into text (a list 900 deep
    was sent as the tiny request's model), and short (one id of 170,000 characters went
    whole into every status line, the state and each audit record)."""
    if not isinstance(value, str) or not 0 < len(value) <= _MAX_MODEL_ID:
        raise ValueError("a model id that is not a name")
    return value  # as served: callers make it printable where it is shown or kept


# Statuses by which a server turns away our credentials, not our request: vLLM's
# --api-key answers 401; a proxy's access rule may answer 403.
_KEY_REFUSED = frozenset({401, 403})


async def ask_tiny(
    client: Client,
    target: Target,
    settings: ProbeSettings,
    clock: Clock,
    steady: Clock | None = None,
) -> Answer:
    """The tiny request: one completion of one token, for the configured or listed model.
    ``steady``: as ``steady_for`` takes it."""
    answer = await _ask_tiny(client, target, settings, clock)
    steady = steady_for(clock, steady)
    return answer if steady is None else replace(answer, tick=steady())


async def _ask_tiny(
    client: Client, target: Target, settings: ProbeSettings, clock: Clock
) -> Answer:
    headers = {"Authorization": f"Bearer {target.api_key}"} if target.api_key else {}
    try:
        models = await list_models(client, target, settings.timeout, headers)
    except _RequestFailedError as failure:
        refused = failure.status in _KEY_REFUSED
        return Answer(clock(), False, f"not sent: {failure.detail}", refused=refused, sent=False)
    # The id as the server listed it is the one it serves: made printable, the tiny
    # request asked for a model it does not have ("llama\\xa03"), and an idle backend
    # was unanswered. What is shown and kept stays printable.
    asked = target.model or (models[0] if models else None)
    if asked is None:
        return Answer(clock(), False, "not sent: GET /v1/models lists no model", sent=False)
    # An expected_model is printable (config.py), so one with a character that is not
    # can only be written as it is shown: asked for as the server listed it.
    if asked not in models:
        asked = next((listed for listed in models if printable(listed) == asked), asked)
    models, model = tuple(map(printable, models)), printable(asked)
    try:
        response = await _request(
            client,
            "POST",
            f"{target.url}/v1/completions",
            timeout=settings.answer_timeout,
            max_bytes=_SMALL_BODY,
            body={"model": asked, "prompt": _TINY_PROMPT, "max_tokens": 1, "temperature": 0},
            headers=headers,
        )
    except _RequestFailedError as failure:
        timed_out = failure.problem is ReadProblem.UNRESPONSIVE
        return Answer(
            clock(),
            False,
            f"failed: {failure.detail}",
            model,
            models,
            timed_out=timed_out,
            sent=failure.sent,  # not when no connection took it
        )
    if response.status != 200:
        return Answer(
            clock(),
            False,
            f"answered HTTP {response.status} for model {model}",
            model,
            models,
            refused=response.status in _KEY_REFUSED,
        )
    try:
        choices = json.loads(response.body)["choices"]
        # A completion's first choice has its text: `{"choices": [null], "error": ...}`
        # is a 200 that completed nothing.
        answered = isinstance(choices[0], dict) and isinstance(choices[0].get("text"), str)
    except (ValueError, KeyError, IndexError, TypeError, RecursionError):
        answered = False
    if not answered:
        return Answer(clock(), False, "answered 200 without a completion", model, models)
    return Answer(
        clock(), True, f"answered in {response.elapsed:.2f} s by model {model}", model, models
    )


async def examine_backend(
    client: Client,
    target: Target,
    settings: ProbeSettings,
    *,
    clock: Clock = time.time,
    sleep: Sleep = asyncio.sleep,
    baseline: Signals | None = None,
    learned: LongestStep | None = None,
    steady: Clock | None = None,
) -> Verdict:
    """Read, wait and ask exactly as much as ``decide`` needs, then return its verdict.
    ``steady``: the clock time between reads is taken on (``steady_for``)."""
    steady = steady_for(clock, steady)
    reads: list[Read] = []
    answer: Answer | None = None
    dropped = 0  # tiny requests sent to a process found replaced: sent all the same
    cpu = LocalCpu(target.url, target.cgroup)
    try:
        while True:
            decision = decide(
                reads,
                answer,
                max_reads=settings.read_limit,
                baseline=baseline,
                learned=learned,
                rules=target.rules,
                answer_wanted=settings.wants_answer(target.name),
            )
            if isinstance(decision, Verdict):
                # Counted from the answer it was judged by: the old process's was sent too.
                sent = decision.requests_sent + dropped
                return replace(decision, requests_sent=sent) if dropped else decision
            if isinstance(decision, TakeRead):
                if reads:
                    await sleep(settings.wait)
                read = with_birth(
                    await read_metrics(client, target, settings, clock, steady), reads
                )
                reads.append(await _with_cpu(read, reads, cpu, settings, learned, target.rules))
                if answer is not None and answered_another_process(reads):
                    dropped += int(answer.sent)
                    answer = None  # the old process's: the new one is asked its own
            elif isinstance(decision, SendTinyRequest) and (
                unasked := settings.why_unasked(target.name)
            ):
                return left_unasked(reads, decision, unasked)
            elif isinstance(decision, SendTinyRequest):
                answer_settings = settings.for_answer(reads, learned, target.rules)
                answer = await ask_tiny(client, target, answer_settings, clock, steady)
    except Exception as exc:  # one backend's problem must not end the fleet's check
        return _unexamined(exc)


async def examine_once(
    client: Client,
    target: Target,
    settings: ProbeSettings,
    window: list[Read],
    *,
    clock: Clock = time.time,
    baseline: Signals | None = None,
    learned: LongestStep | None = None,
    cpu: LocalCpu | None = None,
    steady: Clock | None = None,
) -> Verdict | None:
    """One read for the watch loop, judged with the reads of earlier cycles.

    In ``watch`` the wait between two reads is the loop interval, so a verdict needs no
    sleeping here: ``window`` keeps this backend's last reads across cycles (as many as
    ``max_check_time`` holds, so a long wedge window is covered). None means "not
    decided yet" (a first read that shows work, or a freeze still inside its window),
    never a failure: failures are verdicts. Its callers (``watch``'s reading tasks, the
    ``Prober``) start a read every ``settings.wait`` (up to ``KEEP_ALIVE_LEAD`` of it
    early) whenever the last one ended, not a full wait after it: see ``decide``'s
    ``paced_wait``. ``steady``: the clock time between reads is taken on (``steady_for``).
    """
    steady = steady_for(clock, steady)
    limit = settings.paced_read_limit
    answer_wanted = settings.wants_answer(target.name)

    async def read_into_window() -> None:
        read = with_birth(await read_metrics(client, target, settings, clock, steady), window)
        kept = await _with_cpu(read, window, cpu, settings, learned, target.rules)
        keep_read(window, kept, limit)

    def judge(answer: Answer | None) -> Decision:
        return decide(
            window,
            answer,
            max_reads=limit,
            baseline=baseline,
            learned=learned,
            rules=target.rules,
            answer_wanted=answer_wanted,
            paced_wait=settings.wait,
        )

    try:
        await read_into_window()
        decision = judge(None)
        if isinstance(decision, SendTinyRequest) and (unasked := settings.why_unasked(target.name)):
            decision = left_unasked(window, decision, unasked)
        if isinstance(decision, SendTinyRequest):
            answer = await ask_tiny(
                client, target, settings.for_answer(window, learned, target.rules), clock, steady
            )
            decision = judge(answer)
            if isinstance(decision, TakeRead):
                # A timed-out tiny request wants one more read to see whether the engine
                # moved meanwhile; the answer does not outlive this cycle, so read now.
                # A new process found there was not asked: the next cycle asks it.
                await read_into_window()
                decision = judge(None if answered_another_process(window) else answer)
    except CheckerStarvedError as exc:
        # Cut off by this process's own lateness: no read of the server, as a failed read
        # is none, and the reads before it stand. Emptied, each overloaded moment started
        # a freeze's proof again.
        return _unexamined(exc)
    except Exception as exc:  # a verdict, and a fresh window: these reads judged nothing
        window.clear()
        return _unexamined(exc)
    if isinstance(decision, Verdict) and decision.kind is VerdictKind.RESTARTED:
        # The new process's reads start here: the old one's must not be compared again.
        # From its newest read with vLLM series, where failed reads came after it (the
        # verdict came at one): read asleep, it stays unasked until a read shows it awake.
        newest = newest_vllm_read(window)
        del window[: len(window) - 1 if newest is None else newest]
    return decision if isinstance(decision, Verdict) else None


def keep_read(window: list[Read], read: Read, limit: int) -> None:
    """Append a read to a watch window, which keeps what later decisions can use
    (``classify.reads_still_needed``: the current freeze, else a few reads), at most
    ``limit`` reads.

    A read whose signals equal the previous read's shares that one's: a frozen engine's
    window (up to 65 reads at the defaults) then holds its values once, not 65 times.
    Any other read shares what did not change (``metrics.sharing``): a busy engine's
    gauges and histogram figures.
    """
    signals, earlier = read.signals, window[-1].signals if window else None
    if signals is not None and earlier is not None:
        shared = earlier if signals == earlier else sharing(signals, earlier)
        read = replace(read, signals=shared)
    window.append(read)
    needed = reads_still_needed(window)
    if needed > limit >= 2:
        # A freeze longer than the reads kept: its first read stays, with the newest
        # ones, so that the freeze is measured from its beginning and its window can be
        # covered (reads dropped between were all of it: no progress between any two).
        first = freeze_began(window)
        if first is not None and first < len(window) - limit:
            tail = len(window) - (limit - 1)
            newest = newest_vllm_read(window)
            if (
                limit >= 3
                and newest is not None
                and first < newest < tail
                and asleep_engines(window[newest].signals)
            ):
                # Asleep too (below): that read stays as well, one read fewer of the rest.
                del window[newest + 1 : tail + 1]
                del window[first + 1 : newest]
            else:
                del window[first + 1 : tail]
            del window[:first]
            return
    keep = min(limit, needed)
    cut = max(0, len(window) - keep) if keep else 0  # as ``del window[:-keep]``
    newest = newest_vllm_read(window) if cut > 0 and limit >= 2 else None
    if newest is not None and newest < cut and asleep_engines(window[newest].signals):
        # Asleep until a read shows it awake (``classify.decide``): the newest read with
        # vLLM series stays however many failed reads came after it, or the read after
        # them sent the completion that crashes a sleeping vLLM.
        del window[newest + 1 : cut + 1]
        del window[:newest]
        return
    del window[:cut]


def with_birth(read: Read, earlier: Sequence[Read]) -> Read:
    """``read`` with its process's start on the steady clock (``Read.born``): the newest
    earlier read's where that one shows the same process, else taken from its age now."""
    start = None if read.signals is None else read.signals.process_start
    if read.born is not None or read.tick is None or start is None:
        return read
    for before in reversed(earlier):
        if before.signals is not None and before.signals.has_vllm:
            if before.born is not None and before.signals.process_start == start:
                return replace(read, born=before.born)
            break
    return replace(read, born=read.tick - (read.at - start))


async def _with_cpu(
    read: Read,
    earlier: Sequence[Read],
    cpu: LocalCpu | None,
    settings: ProbeSettings,
    learned: LongestStep | None,
    rules: WedgeRules,
) -> Read:
    """The read with the engine processes' CPU time, when that is worth sampling.

    Sampled right after the text arrived, so that two samples span about the same time
    as the two texts; decided with this read included, so a process that this very read
    shows to be young is sampled from its first read on.
    """
    if cpu is None or not cpu.applies or read.signals is None:
        return read
    if not settings.wants_cpu([*earlier, read], learned, rules):
        return read
    return replace(read, cpu=await cpu.sample_within_limit())


async def examine_proxy(client: Client, target: Target, settings: ProbeSettings) -> Verdict:
    """Reachability only: behind a balancer, each /metrics scrape may be another backend's."""
    headers = {"Authorization": f"Bearer {target.api_key}"} if target.api_key else {}
    try:
        models = await list_models(client, target, settings.timeout, headers)
    except _RequestFailedError as failure:
        if failure.status in _KEY_REFUSED:  # it answers: our key, not the proxy, failed
            why = f"{failure.detail}: the proxy turned our API key away (see api_key_env)"
            refused = Answer(time.time(), False, failure.detail, refused=True, sent=False)
            return replace(judge_proxy(False, why, ()), judged=False, answer=refused)
        return judge_proxy(False, failure.detail, ())
    except Exception as exc:  # one proxy's problem must not end the fleet's check
        # Our own failure (a read cut off by this process's lateness, a lookup that failed
        # for now, a bug): not judged, the very verdict a backend's is. Judged, it was a
        # proxy `down` that paged as a failed balancer; of kind `down`, `watch` still
        # exported and counted it `down`, and LLMHealthBackendDown paged it all the same.
        return _unexamined(exc)
    return judge_proxy(True, "", tuple(map(printable, models)))


async def check_fleet(
    targets: list[Target],
    settings: ProbeSettings,
    *,
    clock: Clock = time.time,
    sleep: Sleep = asyncio.sleep,
    baselines: Mapping[str, Signals] | None = None,
    learned: Mapping[str, LongestStep] | None = None,
    steady: Clock | None = None,
) -> list[Outcome]:
    """Examine every target concurrently; one hung backend costs only its own timeouts.

    ``baselines`` holds an earlier run's last read per backend name, to see restarts;
    ``learned`` the longest step earlier runs saw each backend take.
    """
    known = baselines or {}
    steps = learned or {}

    async def one(target: Target) -> Outcome:
        # One TLS context for the fleet (the process's default), built only if needed.
        async with new_client() as client:
            if target.kind == "proxy":
                return Outcome(target, await examine_proxy(client, target, settings))
            verdict = await examine_backend(
                client,
                target,
                settings,
                clock=clock,
                sleep=sleep,
                baseline=known.get(target.name),
                learned=steps.get(target.name),
                steady=steady,
            )
            return Outcome(target, verdict)

    return list(await asyncio.gather(*(one(target) for target in targets)))


def _connect_error(root: BaseException) -> str:
    """What stopped a connection, from the innermost error (socket, TLS or name lookup)."""
    if isinstance(root, ConnectionRefusedError):
        return "connection refused"
    if isinstance(root, ssl.SSLError):
        return f"TLS handshake failed: {_reason(root)}"
    if isinstance(root, socket.gaierror):
        return f"name does not resolve: {_reason(root)}"
    reason = _reason(root)
    lowered = reason.lower()
    if "refused" in lowered:
        return "connection refused"
    if "ssl" in lowered or "certificate" in lowered or "tls" in lowered:
        return f"TLS handshake failed: {reason}"
    if "name or service" in lowered or "nodename" in lowered or "getaddrinfo" in lowered:
        return f"name does not resolve: {reason}"
    return f"cannot connect: {reason}"


def _root_cause(exc: BaseException) -> BaseException:
    """The innermost error (socket, TLS, name lookup) names the cause.

    Below an OSError only what it was raised ``from`` is followed: the error it was
    merely raised during is whatever was being handled around the check (a cluster
    `check` probing after etcd failed, a library caller's own ``except``), and the
    refused backend's evidence said "cannot connect: no etcd endpoint answered ..."."""
    seen = {id(exc)}
    while (
        inner := exc.__cause__ or (None if isinstance(exc, OSError) else exc.__context__)
    ) is not None and id(inner) not in seen:
        seen.add(id(inner))
        exc = inner
    return exc


def _reason(exc: BaseException) -> str:
    """An exception's message, printable and short: it may quote what the server sent."""
    return _shortened(printable(str(exc) or type(exc).__name__))


def _exception(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {_reason(exc)}"


def _shortened(text: str) -> str:
    return text if len(text) <= 200 else text[:197] + "..."


def _refuse_encoded(_status: int, headers: Mapping[str, str], method: str, url: str) -> None:
    """Only identity was asked for; any other encoding, or a stack of them, is unusable.

    Decoding would make the byte cap count inflated bytes (a few KB of gzip, twice
    stacked, inflates to hundreds of MiB); refusing keeps wire bytes = parsed bytes.
    """
    encoding = headers.get("content-encoding", "").strip().lower()
    if encoding not in ("", "identity"):
        raise _RequestFailedError(
            ReadProblem.UNUSABLE,
            f"{method} {_path(url)} sent Content-Encoding: "
            f"{_shortened(printable(encoding))}, though asked for identity; not decoded",
        )


def _printable_signals(signals: Signals) -> Signals:
    """Engine labels and sleep states as printable text: they reach tables, logs and audits."""
    if all(
        engine.engine.isprintable()
        and (engine.sleep_state is None or engine.sleep_state.isprintable())
        for engine in signals.engines
    ):
        return signals
    engines = tuple(
        replace(
            engine,
            engine=printable(engine.engine),
            sleep_state=None if engine.sleep_state is None else printable(engine.sleep_state),
        )
        for engine in signals.engines
    )
    return replace(signals, engines=engines)


def _not_judged(exc: Exception) -> str:
    if isinstance(exc, CheckerStarvedError):
        return f"not judged: {_reason(exc)}"
    return (
        f"not judged: examining it raised {_exception(exc)} "
        "(input llmhealth cannot handle, or a bug in llmhealth)"
    )


def unjudged(why: str) -> Verdict:
    """A failure of llmhealth itself while examining one backend: that backend's verdict,
    ``why`` saying what failed.

    Unhealthy and not judged, so the run says UNKNOWN (the monitoring convention for "could
    not check") and a person looks, without paging as if a server had failed; no ledger
    event follows from it (no read and no answer to count), so our own bug never condemns
    a backend.
    """
    return Verdict(VerdictKind.NO_METRICS, False, f"{VerdictKind.NO_METRICS}: {why}", judged=False)


def _unexamined(exc: Exception) -> Verdict:
    return unjudged(_not_judged(exc))


def _path(url: str) -> str:
    return "/" + url.split("/", 3)[3] if url.count("/") >= 3 else url


def _size(count: int) -> str:
    return f"{count // (1024 * 1024)} MiB" if count >= 1024 * 1024 else f"{count} bytes"
