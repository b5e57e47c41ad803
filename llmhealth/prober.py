"""A probe pump for a program that runs its own event loop and keeps a FleetHealth.

Each ``await prober.probe()`` reads every serving backend due a read, concurrently, and
judges it with the same logic as ``watch``: the caller's own loop sets the pace, so a call
never sleeps, but a backend is read again only once ``wait`` has passed since its last
read began, as ``watch`` reads it. Verdicts go to the fleet through ``record_verdict``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from types import TracebackType

from llmhealth.classify import Read, Target, Verdict, VerdictKind
from llmhealth.fleet import StallWatch
from llmhealth.fleet_health import FleetHealth, Key
from llmhealth.lateness import lent_to
from llmhealth.ledger import BackendSnapshot, State, Transition
from llmhealth.metrics import Signals
from llmhealth.probe import Client, ProbeSettings, examine_once, new_client, seconds_argument
from llmhealth.text import header_safe, same_server
from llmhealth.window import LongestStep, longer

# Servers whose longest step is remembered: a trainer rebuilding its shards on fresh
# ports would otherwise add one for each rebuild, for the life of its process. The one
# heard from longest ago goes first.
_SERVERS_REMEMBERED = 1024


@dataclass(frozen=True, slots=True)
class ProbeResult:
    """What one call learned about one backend. ``verdict`` is None while undecided: a
    first read that shows work, or one wait without progress, needs the next call's read."""

    key: Key
    verdict: VerdictKind | None
    evidence: str
    transitions: tuple[Transition, ...]


@dataclass(slots=True)
class _Slot:
    url: str
    process_changes: int  # the fleet's count when this slot began (FleetHealth.process_changes)
    client: Client
    window: list[Read] = field(default_factory=list)  # this backend's last reads
    read_started: float | None = None  # time.monotonic() when its last examination began
    # The newest vLLM read of a verdict the fleet was given: once the window no longer
    # holds it, reads are also compared with it, so a restart is seen that the window no
    # longer shows (a read not judged empties the window; a cancelled call's verdicts
    # never reached the fleet, while its reads were kept), as ``watch`` compares with the
    # record's last sighting.
    sighted: Signals | None = None


async def _let_go(slots: list[_Slot]) -> None:
    """Close the slots' clients, together: each TLS close waits up to 0.1 s for a goodbye,
    which a lost node's servers never send, and one after another 30 of them held every
    surviving backend's read back 3 s (past a controller's bound on its call), or a
    controller's shutdown as long."""
    await asyncio.gather(*(slot.client.aclose() for slot in slots))


class Prober:
    """Probes a FleetHealth's serving backends, each at most once per wait, and feeds it
    the verdicts.

    Use as ``async with Prober(fleet) as prober:`` (or call ``aclose``) so its
    connections are closed. ``stall``: a ``StallWatch`` to feed with every read, on
    ``time.monotonic`` time; it never acts, it only answers whether the fleet as a whole
    is still finishing requests.

    ``wait``: the least time from the start of one read of a backend to the start of the
    next, as ``watch`` paces its reads (up to ``KEEP_ALIVE_LEAD`` of it early, so a loop
    whose interval is the wait, from each call's start or after it returns, reads every
    time); a call sooner leaves the backend unread (undecided). A freeze proves a wedge
    over two waits: when every call read, a loop calling every 0.2 s condemned a busy
    engine whose counters stood still for 0.4 s (one long step), and one calling without
    a pause spent the 61 reads of a 300 s window in a tenth of a second and condemned it
    as ``stalled``. The default is ``watch``'s.
    """

    def __init__(
        self,
        fleet: FleetHealth,
        *,
        wait: float = 5.0,
        timeout: float = 5.0,
        answer_timeout: float = 10.0,
        api_key: str | None = None,
        model: str | None = None,
        stall: StallWatch | None = None,
    ) -> None:
        if not isinstance(fleet, FleetHealth):
            raise TypeError(f"fleet must be a FleetHealth, got {type(fleet).__name__}")
        if stall is not None and not isinstance(stall, StallWatch):
            raise TypeError(f"stall must be a StallWatch or None, got {type(stall).__name__}")
        # Refused here, not at each read: a key read from a file with its newline made
        # every tiny request fail on our side, so a backend that never answered stayed
        # HEALTHY; a model that is not a name earned a 404 and condemned a healthy one.
        if api_key is not None and not (
            isinstance(api_key, str) and _is_token(api_key) and header_safe(api_key)
        ):
            raise ValueError(
                "api_key must be printable ASCII without spaces at either end "
                "(a key read from a file keeps its newline: strip it)"
            )
        if model is not None and not (isinstance(model, str) and _is_token(model)):
            raise ValueError(f"model must be a model name or None, got {model!r}")
        self._fleet = fleet
        self._settings = ProbeSettings(
            wait=seconds_argument(wait, "wait"),
            timeout=seconds_argument(timeout, "timeout"),
            answer_timeout=seconds_argument(answer_timeout, "answer_timeout"),
        )
        self._api_key = api_key
        self._model = model
        self._stall = stall
        self._slots: dict[Key, _Slot] = {}
        # The longest step each backend was seen to take, as `watch` keeps it: per backend,
        # not per slot, so it outlives a process change (the hardware stays). Dropped with
        # the slot, a replacement inside its first long step was wedged at two waits.
        self._learned: dict[Key, LongestStep] = {}
        # And per server (``same_server``), as `watch` gives a backend moved to another
        # address the longer of its own step and its new server's: a shard rebuilt where
        # another took long steps, inside its first one there, was wedged at two waits.
        self._learned_at: dict[str, LongestStep] = {}
        self._probing = False
        self._closed = False
        self._loop: asyncio.AbstractEventLoop | None = None

    @property
    def stall(self) -> StallWatch | None:
        return self._stall

    async def probe(self) -> list[ProbeResult]:
        """One read of each serving backend due one (and a tiny request to an idle one),
        judged and fed to the fleet; one read less than ``wait`` ago is left undecided,
        unread. A backend out of the serving set is not probed: an answer would
        not bring it back, and its next reads start afresh. The exception is a DEAD one
        when the policy allows recovery in place: its own process may prove itself.
        Each verdict goes to the fleet as soon as its own read ends, so a backend slow to
        answer holds back no other's, and a call cancelled midway keeps those given.

        One call at a time: two at once shared each backend's connection, and the
        collision read as the backend's ``down``, three of which condemned a healthy one.
        """
        if self._probing:
            raise RuntimeError("Prober.probe() is already running: await one call at a time")
        if self._closed:
            # Its connections were closed for good: reopened here, nothing closed them again.
            raise RuntimeError("this Prober is closed (aclose, or its async with ended)")
        loop = asyncio.get_running_loop()
        if self._loop is None:
            self._loop = loop
        elif loop is not self._loop:
            # Its connections are its first loop's: called from a new loop each time
            # (``asyncio.run`` per step), every other read failed on a closed loop and
            # emptied the window, so a wedged engine stayed HEALTHY, silently.
            raise RuntimeError(
                "a Prober serves the event loop of its first probe(): for a caller "
                "without one of its own, run every call in one asyncio.Runner"
            )
        self._probing = True
        try:
            # The reads' measure of the loop's lateness ticks only during a call: it
            # ticked on in the caller's loop between calls and after ``aclose``.
            with lent_to(loop):
                return await self._probe()
        finally:
            self._probing = False

    async def _probe(self) -> list[ProbeResult]:
        keys = self._targets()
        # All taken out of the slots first (an ``aclose`` meanwhile finds them gone).
        await _let_go([self._slots.pop(key) for key in [k for k in self._slots if k not in keys]])
        now = time.monotonic()
        unread = {key: why for key in keys if (why := self._not_due(key, now)) is not None}
        due = [key for key in keys if key not in unread]
        settings = self._asking(due)

        async def read_and_feed(key: Key) -> ProbeResult:
            # Fed as its own read ends, not once every read has: a backend whose /metrics
            # hangs held a proven wedge back for its whole timeout (the selector still
            # sending to the wedged engine), and a call cancelled meanwhile lost it.
            return self._feed(key, await self._examine(key, now, settings))

        try:
            fed = dict(zip(due, await asyncio.gather(*map(read_and_feed, due)), strict=True))
        finally:
            # A call cancelled midway (an ``asyncio.wait_for`` around it while one backend
            # hangs) fed the fleet its ended reads' verdicts: the stall watch hears them
            # too, or it never heard a read while that backend hung.
            if self._stall is not None:
                self._stall.observe(self._newest_signals(), time.monotonic())
        return [fed[key] if key in fed else ProbeResult(key, None, unread[key], ()) for key in keys]

    def _feed(self, key: Key, verdict: Verdict | None) -> ProbeResult:
        """One backend's verdict given to the fleet, and what came of it."""
        if verdict is None:
            return ProbeResult(key, None, "undecided: needs the next read", ())
        if self._moved(key):
            # The caller rebuilt it while it was read (an actor's death, a restart, a
            # new address): the verdict is the old process's, not the replacement's.
            return ProbeResult(key, None, MOVED_WHILE_READ, ())
        transitions = tuple(self._fleet.record_verdict(key, verdict))
        self._sighted(key)
        return ProbeResult(key, verdict.kind, verdict.evidence, transitions)

    def _sighted(self, key: Key) -> None:
        """Its verdict given to the fleet: the window's newest vLLM read is what the next
        reads are compared with. Not after an undecided one: a restart judged "from a
        fresh baseline" is undecided, and its old process's reads may leave the window
        before the verdict comes."""
        slot = self._slots.get(key)  # gone if aclose() ran meanwhile
        if slot is None:
            return
        for read in reversed(slot.window):
            if read.signals is not None and read.signals.has_vllm:
                slot.sighted = read.signals
                return

    def _not_due(self, key: Key, now: float) -> str | None:
        """Why a backend is not read in this call (its last read began less than a wait
        ago), or None when it is due. A new or moved backend is due at once: its reads
        start afresh."""
        slot = self._slots.get(key)
        if slot is None or slot.read_started is None or self._moved(key):
            return None
        ago = now - slot.read_started
        if ago >= self._settings.soonest_read:
            return None
        wait = self._settings.wait
        return f"undecided: read {ago:.1f} s ago; read again once {wait:g} s have passed"

    def _moved(self, key: Key) -> bool:
        """Whether the backend is no longer what its slot read: at another address, or
        another process by the caller's word."""
        slot = self._slots.get(key)
        fleet = self._fleet
        return (
            slot is None
            or slot.url != fleet.base_url_of(key)
            or slot.process_changes != fleet.process_changes(key)
        )

    def _targets(self) -> list[Key]:
        fleet = self._fleet
        if not fleet.policy.recover_in_place:
            return fleet.serving_shards()
        serving = set(fleet.serving_shards())  # once: it sorts the whole ledger
        # DEAD ones may come back in place, but not those condemned on the caller's word:
        # reading an orphaned server, and asking it the tiny request, proves nothing.
        snapshots = fleet.snapshot()
        return [k for k in fleet.keys if k in serving or _may_recover(snapshots[k])]

    async def aclose(self) -> None:
        """Close every connection; the Prober is not used again after it."""
        self._closed = True
        slots, self._slots = list(self._slots.values()), {}
        await _let_go(slots)

    async def __aenter__(self) -> Prober:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        await self.aclose()

    def _asking(self, keys: Sequence[Key]) -> ProbeSettings:
        """The settings of this call's reads: a DEAD backend whose request failures only
        an answered request clears is asked the tiny request whenever it has nothing to
        do, as `watch` asks it (``Ledger.awaiting_readmission``). The caller sends it
        nothing, and another client's requests finishing between two reads kept it DEAD
        for as long as they came, its same process proving itself at every read."""
        wanted = set(keys)
        awaiting = frozenset(str(key) for key in self._fleet.awaiting_an_answer() if key in wanted)
        return replace(self._settings, awaiting_answer=awaiting)

    async def _examine(self, key: Key, called: float, settings: ProbeSettings) -> Verdict | None:
        if self._closed:
            return None  # closed while this call ran: no connection is opened again
        slot = self._slots.get(key)
        if slot is None or self._moved(key):
            # A new address, or a process the caller said ended or was replaced, is a new
            # process: its reads must not be compared with the old one's.
            if slot is not None:
                await slot.client.aclose()
                if self._closed:
                    # Closed while that close waited for a TLS server's goodbye: the new
                    # client would read after the close, its connection closed by nobody.
                    return None
            # The client builds a TLS context only if an https backend needs one.
            fleet = self._fleet
            slot = _Slot(fleet.base_url_of(key), fleet.process_changes(key), new_client())
            self._slots[key] = slot
        url = slot.url
        target = Target(str(key), url, "backend", api_key=self._api_key, model=self._model)
        # The call's time, as the next call's is compared with it: each task's own start
        # came later, by as much as the tasks before it took, and left the backend
        # short of its wait at the next call on the caller's schedule.
        slot.read_started = called
        # Reads on the wall clock, as check's and watch's: a process's age is a read's
        # time less its start time, which vLLM publishes in seconds since the epoch.
        # The baseline stands before the window's oldest read: only once the window no
        # longer holds it (emptied, or trimmed to a new process). Still in it, the oldest
        # reads are older than it, and without start times their lower counters read as
        # "a counter went down": a busy engine restarted.
        baseline = slot.sighted
        if baseline is not None and any(read.signals is baseline for read in slot.window):
            baseline = None
        server = same_server(url)
        verdict = await examine_once(
            slot.client,
            target,
            settings,
            slot.window,
            baseline=baseline,
            learned=longer(self._learned.get(key), self._learned_at.get(server)),
        )
        if verdict is not None and verdict.longest_step is not None:
            if step := longer(self._learned.get(key), verdict.longest_step):
                self._learned[key] = step
            if step := longer(self._learned_at.pop(server, None), verdict.longest_step):
                self._learned_at[server] = step  # the newest heard last: kept longest
                if len(self._learned_at) > _SERVERS_REMEMBERED:
                    del self._learned_at[next(iter(self._learned_at))]
        return verdict

    def _newest_signals(self) -> dict[str, Signals]:
        newest = {}
        for key, slot in self._slots.items():
            if slot.window and slot.window[-1].signals is not None:
                newest[str(key)] = slot.window[-1].signals
        return newest


def _may_recover(snapshot: BackendSnapshot) -> bool:
    return snapshot.state is State.DEAD and not snapshot.caller_condemned


def _is_token(text: str) -> bool:
    """Printable, and no spaces at either end: what a header value or model name may be."""
    return bool(text) and text.isprintable() and text == text.strip()


MOVED_WHILE_READ = "undecided: the backend was rebuilt or moved while it was read"
