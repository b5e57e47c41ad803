"""Several daemons on one fleet: membership and leadership on etcd leases, fenced state.

I/O around ``leadership``. Each daemon keeps a lease alive from its own thread (never the
cycle's), holds a member key on it, and tries to create the leader key on it. The fleet
record lives in one etcd key; every write of it is a transaction that compares the
revision that was read *and* the leader key's creation revision (the fencing token), so
a deposed leader's write fails whole. The audit records of a settle ride in that same
transaction (one key per write, the newest ``audit_keep`` records kept), so a deposed
leader's records fail with its state. etcd is reached through its v3 JSON gateway
(``/v3/``, etcd 3.4 and later) by ``etcd_http``, from threads, every exchange bounded in
bytes and time as a model server's is. Its errors become ``ClusterUnavailableError`` here,
once.
"""

from __future__ import annotations

import base64
import contextlib
import json
import math
import os
import random
import secrets
import socket
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, TypeVar

from llmhealth import etcd_http
from llmhealth.actions import AuditError, AuditScan, encode_record, parse_records
from llmhealth.classify import Verdict
from llmhealth.config import DEFAULT_AUDIT_KEEP, check_base_url
from llmhealth.config import Cluster as ClusterConfig
from llmhealth.leadership import (
    Decision,
    LeaseFacts,
    LeaseTiming,
    Standing,
    decide,
    owner,
    renewal_due,
    retry_due,
    share_of,
)
from llmhealth.openfiles import LOCK_TIMEOUT
from llmhealth.rows import plain
from llmhealth.shares import (
    Intake,
    Published,
    Taken,
    parse_publication,
    publication,
    take_published,
)
from llmhealth.state import (
    SCHEMA,
    UNREADABLE,
    RecordMovedError,
    StateCorruptError,
    StateError,
    StateLockedError,
    decode_record,
    nothing_before,
)
from llmhealth.text import printable

if TYPE_CHECKING:
    from llmhealth.remediate import RestartOrder

T = TypeVar("T")
Log = Callable[[str], None]
_ETCD_SAID = 300  # characters of an etcd error's own text kept in ours
REQUEST_TIMEOUT = 2.0  # one etcd request; a leader renews several times per deadline
# One call over every endpoint: seven silent ones at 2 s each, three calls a cycle, held a
# cycle past systemd's WatchdogSec (30 s) while etcd was away, and the unit was killed.
CALL_SECONDS = 5.0
# One audit record as kept in etcd, and one write's records together: the state and its
# records share a transaction, and etcd refuses a request past 1.5 MiB by default. A
# record over its share keeps its decision whole and has its bulkiest fields cut.
AUDIT_RECORD_BYTES = 8 * 1024
AUDIT_BATCH_BYTES = 256 * 1024
AUDIT_SHARE_FLOOR = 384  # bytes per record when one write carries hundreds of them
_AUDIT_WHOLE = frozenset({"time", "actor", "backend", "event", "from", "to", "member", "fence"})
_AUDIT_PAGE = 64  # audit keys' names read per request by ``read_audit``, newest first
# The values of those read in one request, as their names' record counts bound them
# (``_batch_bytes``): about 11 MiB as etcd's JSON, a third of what an answer may be, as a
# record whose decision alone passes its share is kept whole. Read 64 at a time whatever
# they held, the batches of settles of 1,500 records (500 KB each) made an answer past
# the 32 MiB one may be, and `llmhealth audit` failed on every run.
_AUDIT_VALUES_BYTES = 8 * 1024 * 1024
_TRIM_PAGE = 10_000  # audit keys' names read per request by the trim: about 2 MiB
PUBLICATION_BYTES = 512 * 1024  # one key of a member's published verdicts (shard_reads)
PUBLICATION_PAGE = 16  # such keys per read of them: 8 MiB, about 11 as etcd's JSON
# etcd keeps every revision of every key until it is compacted, and its own compaction is
# off by default: the leader's record each settle and the members' publications each
# wait filled the 2 GiB quota in about half an hour at 3,000 backends, and from then on
# nothing could be written, leases included. The leader compacts every this many saves
# (two minutes at the default wait) to the revision of its save that many before, so
# etcd holds about two periods of history.
COMPACT_EVERY_SAVES = 24
# A leader's saves said unanswered that it remembers, the newest, until one answers: at
# most one of them can go in, long before this many settles later. All of them, a leader
# whose every save etcd refused (a record past its request bound, a slow disk's time-outs)
# while its lease held grew by a settle's news, the router's outcomes, each cycle.
UNANSWERED_KEPT = 8


class ClusterError(StateError):
    """Why this daemon did not settle this cycle; it keeps probing and reporting."""


class ClusterUnavailableError(ClusterError):
    """No etcd endpoint answered: nobody may act, probing goes on."""


class NotLeaderError(ClusterError):
    """This daemon does not lead (or no longer may act); the message says who does."""


class FencedOutError(ClusterError):
    """A fenced write failed: the leader key is not this leader's any more."""


class SaveUnansweredError(ClusterUnavailableError):
    """A leader's save neither of whose offers was answered: it may have gone in all the
    same. ``nonce`` is its own (``Keys.saved``): a later load of this store finds whether
    it did (``LostSaveLandedError``)."""

    def __init__(self, message: str, nonce: bytes) -> None:
        super().__init__(message)
        self.nonce = nonce
        # The restarts that save issued (``settle_fleet`` names them): gone in, the record
        # holds them RESTARTING, and nobody runs them unless whoever finds it went in does.
        self.orders: tuple[RestartOrder, ...] = ()


class LostSaveLandedError(ClusterError):
    """A load found that a save said unanswered (``SaveUnansweredError``, ``nonce``) went
    in: the record holds what that settle was given, and giving it to this one again
    counts it twice. Nothing was done in this section; it may be made again at once."""

    def __init__(self, message: str, nonce: bytes) -> None:
        super().__init__(message)
        self.nonce = nonce


@dataclass(frozen=True, slots=True)
class KeyValue:
    value: bytes
    mod_revision: int
    create_revision: int
    lease: int
    # The key's own bytes: its name as text was decoded lossily (anyone may write a key
    # that is not UTF-8), and re-encoded it can sort elsewhere than the key does.
    key: bytes = b""


def _b64(text: str | bytes) -> str:
    raw = text.encode() if isinstance(text, str) else text
    return base64.b64encode(raw).decode()


def _after_prefix(prefix: str) -> str:
    """The first key past every key that starts with ``prefix`` (ours are ASCII)."""
    return prefix[:-1] + chr(ord(prefix[-1]) + 1)


def put(key: str, value: bytes, lease: int | None = None) -> dict[str, Any]:
    request: dict[str, Any] = {"key": _b64(key), "value": _b64(value)}
    if lease is not None:  # etcd takes lease 0 for "no lease": ``grant`` never returns it
        request["lease"] = str(lease)
    return {"request_put": request}


def compare_created(key: str, revision: int) -> dict[str, Any]:
    """The key was created at ``revision`` (0: the key does not exist)."""
    return {"key": _b64(key), "result": "EQUAL", "target": "CREATE", "create_revision": revision}


def compare_lease(key: str, lease: int) -> dict[str, Any]:
    """The key is held on ``lease`` (a key that does not exist is on none)."""
    return {"key": _b64(key), "result": "EQUAL", "target": "LEASE", "lease": str(lease)}


def compare_modified(key: str, revision: int) -> dict[str, Any]:
    """The key was last written at ``revision`` (0: the key does not exist)."""
    return {"key": _b64(key), "result": "EQUAL", "target": "MOD", "mod_revision": revision}


class Etcd:
    """The etcd endpoints, tried in turn; the one that answered last is tried first (or,
    after a call that ran out of time, the first it did not reach)."""

    def __init__(
        self,
        endpoints: Sequence[str],
        timeout: float = REQUEST_TIMEOUT,
        bounds: etcd_http.Bounds | None = None,
        *,
        call_seconds: float = CALL_SECONDS,
        clock: Callable[[], float] = time.monotonic,
        hurried: float | None = None,
    ) -> None:
        if not endpoints:
            raise ValueError("no etcd endpoint")
        # Checked here too, not only in the config: an endpoint is named in every error.
        self.endpoints = tuple(check_base_url(url) for url in endpoints)
        self._wires = [etcd_http.Endpoint.from_url(url) for url in self.endpoints]
        self._bounds = bounds or etcd_http.Bounds(silence=timeout)
        self._call_seconds = call_seconds
        self._clock = clock
        # The wait on an endpoint while a call has others left to ask (the elector's); the
        # last has nobody to move on to and waits ``timeout``: hurried too, one endpoint
        # (a one-member etcd) slow but answering within the renew deadline failed every
        # request, and nobody led.
        self._hurried = hurried
        self._current = 0
        self._lock = threading.Lock()

    def call(
        self,
        path: str,
        body: Mapping[str, Any],
        read: Callable[[dict[str, Any]], T],
        *,
        within: float | None = None,
    ) -> T:
        """``read`` of etcd's answer at ``/v3/<path>``, from the first endpoint that gives
        one, all of them within ``within`` seconds (default: the call's bound)."""
        payload = etcd_http.encode(body)
        with self._lock:
            first = self._current
        problems = []
        spent = self._call_seconds if within is None else min(within, self._call_seconds)
        deadline = self._clock() + spent
        untried: int | None = None  # the first endpoint this call's bound did not reach
        for step in range(len(self._wires)):
            index = (first + step) % len(self._wires)
            left = deadline - self._clock()
            if left <= 0:
                problems.append(f"{self.endpoints[index]}: not tried, {spent:g} s spent")
                untried = index if untried is None else untried
                continue
            silence = self._bounds.silence
            if self._hurried is not None and step < len(self._wires) - 1:
                silence = min(silence, self._hurried)
            bounds = replace(
                self._bounds,
                silence=min(silence, left),
                whole=min(self._bounds.whole, left),
            )
            try:
                result = read(etcd_http.post(self._wires[index], path, payload, bounds))
            except etcd_http.EndpointError as exc:
                problems.append(f"{self.endpoints[index]}: {printable(str(exc)[:_ETCD_SAID])}")
                continue
            except (ValueError, KeyError, TypeError, AttributeError, OverflowError) as exc:
                # JSON that is not etcd's answer to this request (a proxy's, another
                # service's): not etcd's word on the request, so the next endpoint may be.
                problems.append(f"{self.endpoints[index]}: not etcd's answer ({exc!r:.80})")
                continue
            except etcd_http.EtcdRefusedError as exc:
                # etcd's own error (its JSON, not a proxy's page) that is not "unavailable"
                # is a real error, not a dead endpoint: trying the next one would hide it.
                # Its text is the endpoint's words, bound for terminals and logs.
                said = printable(str(exc)[:_ETCD_SAID])
                raise ClusterUnavailableError(f"etcd {self.endpoints[index]}: {said}") from exc
            with self._lock:
                self._current = index
            return result
        if untried is not None:
            # The next call starts where this one's bound ran out: started again at the
            # first, three silent endpoints (paused members) ahead of a live one took every
            # call's bound, and the live one was never asked while it would have answered.
            with self._lock:
                self._current = untried
        raise ClusterUnavailableError("no etcd endpoint answered (" + "; ".join(problems) + ")")

    def get(self, key: str) -> KeyValue | None:
        """``key``'s value, or None. An answer holding any other key is not etcd's to this
        request (a proxy that ignores the key asked), and the next endpoint is asked: its
        first key was taken for the record, called unreadable by a standby, and copied
        aside by a leader's load as it settled on a fresh ledger."""
        wanted = key.encode()

        def read(answer: dict[str, Any]) -> KeyValue | None:
            found = _ranged_keys(answer)
            if any(value.key != wanted for _, value in found):
                raise ValueError(f"a key other than {key!r} in the answer")
            return found[0][1] if found else None

        return self.call("kv/range", {"key": _b64(key)}, read)

    def get_prefix(self, prefix: str) -> dict[str, KeyValue]:
        return dict(self._range({"key": _b64(prefix), "range_end": _b64(_after_prefix(prefix))}))

    def get_prefix_paged(
        self, prefix: str, page: int, *, skip: str | None = None
    ) -> Iterator[tuple[str, KeyValue]]:
        """The keys under ``prefix`` but those under ``skip``, in key order, ``page`` keys
        per request: read at once, the members' publications (a frozen backend's verdict
        carries up to 61 reads) outgrew the 32 MiB an answer may be, and the leader
        settled nothing while they did.

        Only keys within the range asked: an endpoint answering full pages of keys past
        it (a proxy that ignores ``range_end``) was asked for the next page for ever, a
        leader's settle never ending, each key taken for a member's publication. A key
        outside the range ends the span, as etcd's own answer would have."""
        spans = [(prefix, _after_prefix(prefix))]
        if skip is not None and skip.startswith(prefix):
            spans = [(prefix, skip), (_after_prefix(skip), _after_prefix(prefix))]
        for first, end in spans:
            start, stop = first.encode(), end.encode()
            while True:
                request = {"key": _b64(start), "range_end": _b64(end), "limit": page}
                found = self._range(request)
                inside = [(name, value) for name, value in found if start <= value.key < stop]
                yield from inside
                # Past the last key by its bytes: its text re-encoded sorts elsewhere when
                # it is not UTF-8, and the keys between were skipped.
                following = inside[-1][1].key + b"\0" if inside else start
                if len(found) < page or len(inside) < len(found) or following <= start:
                    break  # the span's end (or an answer that moved no further, or out)
                start = following

    def scan_down(
        self, prefix: str, end: str | bytes | None, limit: int, *, keys_only: bool = False
    ) -> list[tuple[str, KeyValue]]:
        """Up to ``limit`` keys under ``prefix`` below ``end`` (exclusive), largest first.

        Only those: the trim and ``read_audit`` ask for the page below the last key they
        have while pages come back full, and an endpoint answering keys outside the range
        asked (the same page again) was asked for ever, a leader's settle never ending."""
        range_end = end if end is not None else _after_prefix(prefix)
        low, high = prefix.encode(), range_end.encode() if isinstance(range_end, str) else range_end
        found = self._range(
            {
                "key": _b64(prefix),
                "range_end": _b64(range_end),
                "sort_order": "DESCEND",
                "sort_target": "KEY",
                "limit": limit,
                "keys_only": keys_only,
            }
        )
        return [(name, value) for name, value in found if low <= value.key < high]

    def _range(self, request: dict[str, Any]) -> list[tuple[str, KeyValue]]:
        return self.call("kv/range", request, _ranged_keys)

    def txn(
        self,
        compare: list[dict[str, Any]],
        success: list[dict[str, Any]],
        failure: list[dict[str, Any]] | None = None,
        *,
        within: float | None = None,
    ) -> tuple[bool, int, list[KeyValue | None]]:
        """Whether the compares held, the revision after it, and what each operation of
        the branch that ran found: a ``request_range``'s first key, None for the others
        (and for a range that found nothing).

        Only an answer to these operations: one holding another key where a range asked
        for one (a proxy that ignores the key asked), or more or fewer responses than the
        branch that ran has operations, is not etcd's, and the next endpoint is asked. A
        campaign's failed compare took such a key on this member's lease (its member key)
        for the leader key: it led, its fence that key's revision, while another held the
        lead."""
        body = {"compare": compare, "success": success, "failure": failure or []}

        def read(answer: dict[str, Any]) -> tuple[bool, int, list[KeyValue | None]]:
            return _txn_result(answer, success, failure or [])

        return self.call("kv/txn", body, read, within=within)

    def grant(self, ttl: int) -> int:
        return self.call("lease/grant", {"TTL": ttl, "ID": 0}, _granted)

    def keepalive(self, lease: int) -> int:
        """Renew a lease; its TTL, or -1 when etcd no longer has it (no TTL in the answer)."""
        return self.call("lease/keepalive", {"ID": lease}, _renewed_ttl)

    def revoke(self, lease: int) -> None:
        self.call("kv/lease/revoke", {"ID": lease}, _header)

    def compact(self, revision: int) -> None:
        """Drop the history of every key before ``revision`` (its current values stay)."""
        self.call("kv/compaction", {"revision": revision, "physical": False}, _header)


def _header(answer: dict[str, Any]) -> dict[str, Any]:
    """The header etcd gives every answer (its revision, its member); TypeError without
    one. Another service's JSON where an endpoint was listed (``{}``) read as etcd's
    word was a range that found nothing and a transaction whose compares failed: the
    record etcd held read as none, and the leader's every save "fenced out: nobody
    leads", that endpoint asked first every time as the one that answered."""
    header = answer.get("header")
    if not isinstance(header, dict):
        raise TypeError(f"no header in the answer (a {type(header).__name__})")
    return header


def _ranged_keys(answer: dict[str, Any]) -> list[tuple[str, KeyValue]]:
    _header(answer)
    return _key_values(answer.get("kvs"))


def _renewed_ttl(answer: dict[str, Any]) -> int:
    result = answer["result"]
    if not isinstance(result, dict):
        raise TypeError(f"result is a {type(result).__name__}")
    _header(result)
    return int(result.get("TTL", -1))


def _key_values(kvs: object) -> list[tuple[str, KeyValue]]:
    """A range answer's keys and values; a key etcd's gateway leaves out is its default."""
    if kvs is None:
        return []
    if not isinstance(kvs, list):
        raise TypeError(f"kvs is a {type(kvs).__name__}")
    return [
        (
            raw.decode(errors="replace"),
            KeyValue(
                value=base64.b64decode(item.get("value", ""), validate=True),
                mod_revision=int(item.get("mod_revision", 0)),
                create_revision=int(item.get("create_revision", 0)),
                lease=int(item.get("lease", 0)),
                key=raw,
            ),
        )
        for item in kvs
        for raw in (base64.b64decode(item["key"], validate=True),)
    ]


def _granted(answer: dict[str, Any]) -> int:
    """A granted lease's ID. etcd never grants lease 0 (its "no lease"): a key put on it
    would outlive its leader, and the leader key would be held until an operator came.
    Nor one past its int64: kept, every request on it was refused, no other lease was
    asked for, and the member was out of every election for as long as it ran."""
    _header(answer)
    lease = int(answer["ID"])
    if not 0 < lease < 2**63:
        raise ValueError(f"lease ID {lease}")
    return lease


def _txn_result(
    answer: dict[str, Any], success: list[dict[str, Any]], failure: list[dict[str, Any]]
) -> tuple[bool, int, list[KeyValue | None]]:
    """Read whole inside the call, ranges included: a garbled failure branch (a proxy's
    ``{"response_range": null}``) read later escaped the call's guard and every caller's,
    and ended the daemon's loop."""
    revision = int(_header(answer).get("revision", 0))
    responses = answer.get("responses") or []
    if not isinstance(responses, list):
        raise TypeError(f"responses is a {type(responses).__name__}")
    # A JSON boolean, left out when false: ``bool("false")`` is true, and a deposed
    # leader's fenced save, refused by etcd, was said written through such an answer.
    succeeded = answer.get("succeeded", False)
    if not isinstance(succeeded, bool):
        raise TypeError(f"succeeded is a {type(succeeded).__name__}")
    operations = success if succeeded else failure
    if len(responses) != len(operations):
        raise ValueError(f"{len(responses)} responses to {len(operations)} operations")
    return (
        succeeded,
        revision,
        [_ranged(operation, item) for operation, item in zip(operations, responses, strict=True)],
    )


def _ranged(operation: dict[str, Any], response: object) -> KeyValue | None:
    """The first key one response of a transaction found, if it is a range's that did;
    ValueError when a range for one key found another."""
    if not isinstance(response, dict):
        raise TypeError(f"a response is a {type(response).__name__}")
    asked = operation.get("request_range")
    if "response_range" not in response:
        if asked is not None:
            raise ValueError("no response_range to a request_range")
        return None  # a put's or a delete's
    if asked is None:
        raise ValueError("a response_range to another request")
    ranged = response["response_range"]
    if not isinstance(ranged, dict):
        raise TypeError(f"response_range is a {type(ranged).__name__}")
    found = _key_values(ranged.get("kvs"))
    if "range_end" not in asked:
        wanted = base64.b64decode(asked["key"])
        if any(value.key != wanted for _, value in found):
            raise ValueError(f"a key other than {wanted!r} in a response_range")
    return found[0][1] if found else None


@dataclass(frozen=True, slots=True)
class Keys:
    """Where a fleet lives under its prefix."""

    prefix: str

    @property
    def leader(self) -> str:
        return f"{self.prefix}/leader"

    @property
    def state(self) -> str:
        return f"{self.prefix}/state"

    @property
    def members(self) -> str:
        return f"{self.prefix}/members/"

    def member(self, name: str) -> str:
        return f"{self.members}{name}"

    @property
    def audit(self) -> str:
        return f"{self.prefix}/audit/"

    @property
    def verdicts(self) -> str:
        return f"{self.prefix}/verdicts/"

    @property
    def saved(self) -> str:
        """A nonce of the last leader's save, written with it: a save whose answer was lost
        finds there whether it went in when another wrote the record on top since."""
        return f"{self.prefix}/saved"

    def audit_batch(self, revision: int, count: int) -> str:
        """One write's audit records: after the state revision the write compared with, so
        keys sort as the writes happened; a nonce keeps apart two record-only writes at
        one revision; the record count lets the trail be trimmed from key names alone."""
        return f"{self.audit}{revision:020d}-{secrets.token_hex(4)}-{count:06d}"


def default_member_name() -> str:
    """Unique on one machine too (two daemons in a test), readable in ``status``."""
    return f"{socket.gethostname()}-{os.getpid()}"


@dataclass(frozen=True, slots=True)
class Leader:
    """Who leads, as the leader key says."""

    member: str
    lease: int
    fence: int  # the leader key's creation revision: larger for every later leader
    since: float  # wall time, as the leader wrote it


@dataclass(frozen=True, slots=True)
class Observation:
    """What this daemon last saw of the cluster, for its metrics and ``status``."""

    etcd_up: bool = False
    leader: Leader | None = None
    members: tuple[tuple[str, dict[str, Any]], ...] = ()  # name, what its key says


def _finite_json(text: bytes) -> Any:
    """Another member's JSON, every number a finite float can hold (else ValueError):
    ``status --format json`` prints what members wrote, and strict JSON has no word for
    NaN or Infinity, which ``NaN``, ``Infinity`` and ``1e999`` all decode to, nor can a
    400-digit integer become the float the exporter makes of a report's time."""
    return json.loads(
        text, parse_constant=_no_constant, parse_float=_finite, parse_int=_within_float
    )


def _no_constant(name: str) -> object:
    raise ValueError(f"{name} is not a JSON number")


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"{text[:20]} is past a float's range")
    return value


def _within_float(text: str) -> int:
    value = int(text)
    try:
        float(value)
    except OverflowError:
        raise ValueError(f"{text[:20]}... is past a float's range") from None
    return value


def read_members(etcd: Etcd, keys: Keys) -> tuple[tuple[str, dict[str, Any]], ...]:
    members = []
    for key, found in sorted(etcd.get_prefix(keys.members).items()):
        try:
            value = _finite_json(found.value)
        except (ValueError, RecursionError):  # nested thousands deep: unreadable too
            value = {}
        name = printable(key.removeprefix(keys.members))  # another member wrote it
        members.append((name, value if isinstance(value, dict) else {}))
    return tuple(members)


def read_leader(etcd: Etcd, keys: Keys) -> Leader | None:
    found = etcd.get(keys.leader)
    if found is None:
        return None
    try:
        value = _finite_json(found.value)
        member = printable(str(value["member"]))  # another member wrote it
        since = float(value["since"])  # float("nan") too: refused below
        if not math.isfinite(since):
            raise ValueError(f"since {since}")
        return Leader(member, found.lease, found.create_revision, since)
    except (ValueError, KeyError, TypeError, RecursionError):  # RecursionError: nested deep
        return Leader("?", found.lease, found.create_revision, 0.0)


class Elector:
    """Keeps this daemon's lease alive and its member key on it, and campaigns to lead.

    Runs in its own thread so that neither a slow settle nor a restart command can delay
    a renewal. The cycle asks ``decision()`` before every act; the answer depends only on
    the facts gathered here and the monotonic clock, never on a request made then.
    """

    def __init__(
        self,
        etcd: Etcd,
        keys: Keys,
        member: str,
        timing: LeaseTiming,
        *,
        log: Log,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self.etcd = etcd
        self.keys = keys
        self.member = member
        self.timing = timing
        self._log = log
        self._clock = clock
        self._wall = wall
        self._lock = threading.Lock()
        self._facts = LeaseFacts()
        self._fence: int | None = None
        self._report: dict[str, Any] = {}
        self._stop = threading.Event()
        self._resign = True  # whether the lease is revoked once stopped (``stop``)
        self._thread: threading.Thread | None = None
        # Whether this member reads a share of the backends (a daemon with shard_reads),
        # said in its member key: a `check` from cron holds a member key too, and counted
        # among the readers it took a share away from the daemons for as long as it ran
        # (minutes, proving a slow wedge), a share it never reads.
        self.shares_reads = False
        # Why the member key is another process's, while it is (None: it is ours); and
        # what tells this process's own key, left on a lease it lost, from another's.
        self.member_refused: str | None = None
        self._process = secrets.token_hex(8)
        self.transitions = 0  # times this daemon became leader
        # Whether it led at the end of the last round etcd answered whole: a leader whose
        # round past the renew deadline stepped down while etcd was away is a standby,
        # and yet the last leader anyone can know of until etcd answers again.
        self.led_last = False
        self.last_error: str | None = None
        self.observed = Observation()

    # --- what the cycle asks -------------------------------------------------------------

    def decision(self) -> Decision:
        with self._lock:
            facts = self._facts
        return decide(facts, self.timing, self._clock())

    @property
    def fence(self) -> int | None:
        """The fencing token while this daemon may act, else None."""
        with self._lock:
            fence = self._fence
        return fence if self.decision().may_act else None

    @property
    def lease_id(self) -> int | None:
        with self._lock:
            return self._facts.lease_id

    def report(self, summary: dict[str, Any]) -> None:
        """What the member key says about this daemon's last cycle (written on renewal)."""
        with self._lock:
            self._report = summary

    # --- the thread ------------------------------------------------------------------------

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="llmhealth-elector", daemon=True)
        self._thread.start()

    def stop(self, *, resign: bool = True) -> None:
        """Stop renewing; resigning revokes the lease so a standby takes over at once.

        The round under way is waited for up to a TTL. One that outlasts that (etcd slow
        to answer) campaigns no more, and its thread gives back the lease it took after
        this gave its own back: it led on it, and that leader key, renewed by nobody,
        kept every standby out for a TTL after the resign."""
        self._resign = resign
        self._stop.set()
        if self._thread is not None:
            self._thread.join(self.timing.ttl)
        self._give_back()

    def _give_back(self) -> None:
        """Forget the lease (and the lead); revoke it when resigning."""
        with self._lock:
            lease, self._facts, self._fence = self._facts.lease_id, LeaseFacts(), None
        if self._resign and lease is not None:
            with contextlib.suppress(StateError):
                self.etcd.revoke(lease)

    def step_and_observe(self) -> None:
        """One round, then who leads and who is a member as etcd shows them: what
        ``standing`` says. A process that takes part for one run (a check from cron) has
        no thread to observe for it, and would say etcd was unreachable."""
        self.step()
        self._renew_if_due()
        leader = read_leader(self.etcd, self.keys)
        self._renew_if_due()
        self.observed = Observation(True, leader, read_members(self.etcd, self.keys))
        with self._lock:
            self.led_last = self._fence is not None

    def _run(self) -> None:
        failures = 0  # rounds failed in a row
        while not self._stop.is_set():
            started = self._clock()
            try:
                self.step_and_observe()
            except Exception as exc:  # the thread must outlive any one round
                # Not only StateError: a thread that died here would leave this member
                # silently out of every election while its daemon looks alive.
                why = str(exc) if isinstance(exc, StateError) else f"{type(exc).__name__}: {exc}"
                if why != self.last_error:
                    self._log(f"cluster: {why}")
                self.last_error = why
                self.observed = Observation(False, None, self.observed.members)
                failures += 1
            else:
                # Cleared only by a whole round: cleared in ``step``, before an observation
                # that then failed, the same error was logged again every round.
                self.last_error, failures = None, 0
            with self._lock:
                facts = self._facts
            now = self._clock()
            if failures:  # a failing etcd (one that fails fast too) is not asked at once
                due = retry_due(facts, self.timing, now, failures, random.random(), started)
            else:
                due = renewal_due(facts, self.timing, now)
            self._stop.wait(max(0.05, due - now))
        self._give_back()  # a lease taken by a round that outlasted ``stop()``'s wait

    def step(self) -> None:
        """One round: step down if late, renew or get a lease, then hold or try the lead."""
        decision = self.decision()
        if decision.standing is Standing.STEPPING_DOWN:
            self._step_down(decision.reason)
        lease = self._renew()
        if lease is None:
            with self._lock:
                leading = self._fence is not None
            if leading and self.member_refused is not None:
                # Its member key another process's (README: it "leads nothing"): kept,
                # the lead went on unconfirmed, a deleted leader key unnoticed.
                self._step_down(self.member_refused)
            return
        self._renew_if_due()
        with self._lock:
            if self._facts.lease_id != lease:
                return  # etcd no longer has it: the next round gets another
            leading = self._fence is not None
        if self._stop.is_set():
            return  # stopped while this round waited on etcd: no lead taken after that
        if leading:
            self._confirm()
        else:
            self._campaign(lease)

    def _renew(self) -> int | None:
        with self._lock:
            lease = self._facts.lease_id
        sent = self._clock()
        if lease is None:
            lease = self.etcd.grant(max(1, round(self.timing.ttl)))
            with self._lock:
                self._facts = LeaseFacts(lease, sent, None)
        elif not self._keep_alive(lease):
            return None
        return lease if self._put_member(lease) else None

    def _keep_alive(self, lease: int) -> bool:
        """Renew ``lease``; False (and the lead lost) when etcd no longer has it."""
        sent = self._clock()
        if self.etcd.keepalive(lease) <= 0:
            self._lose(f"etcd no longer has lease {lease:x}")
            return False
        with self._lock:
            if self._facts.lease_id == lease:
                self._facts = LeaseFacts(lease, sent, self._facts.leader_since)
        return True

    def _renew_if_due(self) -> None:
        """A renewal between a round's other requests once one is due: a round makes five,
        and on an etcd slow to answer each (0.5 s, within every bound) they outlasted the
        renew deadline of a lease etcd kept alive, so the leader stepped down and revoked
        it every round. Not past the deadline: then the next round steps down."""
        with self._lock:
            facts = self._facts
        now = self._clock()
        if facts.lease_id is None or renewal_due(facts, self.timing, now) > now:
            return
        if decide(facts, self.timing, now).standing is Standing.STEPPING_DOWN:
            return
        self._keep_alive(facts.lease_id)

    def _put_member(self, lease: int) -> bool:
        """Write the member key on ``lease``; False (said once) when another process holds
        it under this name. Two processes as one member (``member`` set in a config
        copied to two machines) wrote the key and their publications over each other's,
        and as their serials are their own, every overwrite was a new verdict to the
        leader: one failed read each counted as three failures, DEAD. The one that holds
        the name keeps it; the other leads nothing and publishes nothing until its lease
        ends."""
        with self._lock:
            report = dict(self._report)
            leading = self._fence is not None
        value = {
            "member": self.member,
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "lease": lease,
            "leader": leading,
            "shares_reads": self.shares_reads,
            "renewed_at": self._wall(),
            "last_report": report,
            "process": self._process,
        }
        key = self.keys.member(self.member)
        write = [put(key, json.dumps(value).encode(), lease)]
        read = [{"request_range": {"key": _b64(key)}}]
        held, _, found = self.etcd.txn([compare_lease(key, lease)], write, read)
        holder = None if held or not found else found[0]
        if not held and (holder is None or self._written_here(holder)):
            # None yet (this lease's first round, or its last expired), or ours on a
            # lease this process lost without revoking it (etcd was away).
            taken = (
                compare_created(key, 0)
                if holder is None
                else compare_modified(key, holder.mod_revision)
            )
            held, _, found = self.etcd.txn([taken], write, read)
            holder = None if held or not found else found[0]
            # On this lease, which only this process writes: the write went in, its answer
            # lost and the write offered again (the compare then failed on itself).
            held = held or (holder is not None and holder.lease == lease)
        if held:
            self.member_refused = None
            return True
        why = f"member name {self.member!r} is held by another process ({_holder(holder)})"
        why += ": each process of a cluster needs its own [cluster] member name; this one "
        why += "leads nothing and publishes nothing while that one's lease lives"
        if why != self.member_refused:
            self._log(f"cluster: {why}")
        self.member_refused = why
        return False

    def _written_here(self, found: KeyValue) -> bool:
        try:
            value = _finite_json(found.value)
        except (ValueError, RecursionError):
            return False
        return isinstance(value, dict) and value.get("process") == self._process

    def _campaign(self, lease: int) -> None:
        """Create the leader key on our lease if nobody holds it (etcd's election, simply).

        A campaign whose answer was lost (cut, timed out, then tried on the next endpoint
        or at the next round) may have created the key all the same: the failed compare
        then finds it on our own lease, which only we write, and we lead by it. Without
        that the key would sit on a lease we keep renewing, and nobody would ever lead.
        """
        since = self._wall()
        value = json.dumps({"member": self.member, "since": since}).encode()
        won, revision, found = self.etcd.txn(
            [compare_created(self.keys.leader, 0)],
            [put(self.keys.leader, value, lease)],
            [{"request_range": {"key": _b64(self.keys.leader)}}],
        )
        if not won:
            held = found[0] if found else None
            if held is None or held.lease != lease:
                return
            revision = held.create_revision
        if revision <= 0:
            # No revision in the answer: fence 0 compares as "no leader key", which
            # every write would pass whenever nobody held it (as a lease 0 is refused).
            raise ClusterUnavailableError(f"etcd's campaign answer names no revision ({revision})")
        with self._lock:
            facts = self._facts
            if facts.lease_id != lease:
                return
            self._facts = LeaseFacts(lease, facts.renewed_at, self._clock())
            self._fence = revision
        self.transitions += 1
        self._log(f"cluster: {self.member} leads (lease {lease:x}, fence {revision})")

    def _confirm(self) -> None:
        """The leader key is still the one we created (an operator may have deleted it)."""
        current = self.etcd.get(self.keys.leader)
        with self._lock:
            fence = self._fence
        if current is None or current.create_revision != fence:
            self._lose("the leader key is gone or belongs to another member")

    def _step_down(self, why: str) -> None:
        with self._lock:
            lease = self._facts.lease_id
            self._facts, self._fence = LeaseFacts(), None
        self._log(f"cluster: {self.member} steps down: {why}")
        if lease is not None:
            # Best effort: a revoked lease lets a standby lead at once instead of after TTL.
            with contextlib.suppress(StateError):
                self.etcd.revoke(lease)

    def _lose(self, why: str) -> None:
        with self._lock:
            was_leading = self._fence is not None
            self._facts, self._fence = LeaseFacts(), None
        if was_leading:
            self._log(f"cluster: {self.member} is no longer leader: {why}")


def _holder(found: KeyValue | None) -> str:
    """Who a member key says wrote it, for a message (another process wrote it)."""
    if found is None:
        return "gone since"
    try:
        value = _finite_json(found.value)
        host, pid = printable(str(value["host"])), printable(str(value["pid"]))
    except (ValueError, KeyError, TypeError, RecursionError):
        return f"lease {found.lease:x}"
    return f"host {host}, pid {pid}, lease {found.lease:x}"


class EtcdStore:
    """The fleet record in one etcd key, with the same face as ``StateFile``.

    ``locked`` admits only a leader that may act now (or, without an elector, an operator
    verb); ``load`` remembers the revision it read; ``save`` writes only if that revision
    is still current and, for a leader, its leader key is still the one it created. A
    record saved twice in one section (a restart committed before its command runs, then
    the command's outcome) compares against its own previous write.

    ``audit`` takes the section's audit records; each save writes those appended since
    the last one in its own transaction, and records left at the end of a section that
    saved nothing (a verb the ledger refused) are written alone under the same compares.
    A failed save or a section ended by an error writes none of them.
    """

    def __init__(
        self,
        etcd: Etcd,
        keys: Keys,
        elector: Elector | None,
        *,
        audit_keep: int = DEFAULT_AUDIT_KEEP,
    ) -> None:
        self.etcd = etcd
        self.keys = keys
        self.elector = elector
        self.path = keys.state  # where it lives, for messages
        self.audit = EtcdAudit(self)
        self.audit_keep = audit_keep
        self._read_revision: int | None = None
        self._last_revision = 0
        self._fence: int | None = None
        self._saved_fence: int | None = None  # the fence of the last successful save
        self._pending: list[bytes] | None = None  # audit lines of the open section
        self._records_untrimmed: int | None = None  # None: not trimmed by this process yet
        self._saves_uncompacted = 0  # a leader's saves since its last compaction
        # Nonces of this leader's saves whose offers all went unanswered since its last
        # save that was answered: one of them may have gone in (``_find_unanswered``).
        self._unanswered: list[bytes] = []
        self._compact_to = 0  # the revision the next compaction may drop history before
        # One section at a time, as the file's lock makes it: a section's revision, fence
        # and records live here, and two at once (a stop's last settle beside a cycle
        # still running) saved one's update over the other's unseen.
        self._section = threading.Lock()

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        if not self._section.acquire(timeout=LOCK_TIMEOUT):
            raise StateLockedError(
                f"state {self.keys.state} is in use by another section of this process; "
                f"gave up after {LOCK_TIMEOUT:g} s"
            )
        try:
            fence = None
            if self.elector is not None:
                decision = self.elector.decision()
                fence = self.elector.fence
                if not decision.may_act or fence is None:
                    raise NotLeaderError(f"{self.elector.member} does not lead: {decision.reason}")
            self._fence, self._read_revision, self._pending = fence, None, []
            try:
                yield
                if self._pending:
                    self._write_records_alone()
            finally:
                self._fence, self._read_revision, self._pending = None, None, None
        finally:
            self._section.release()

    def load(self, decode: Callable[[dict[str, Any]], T]) -> T | None:
        found = self.etcd.get(self.keys.state)
        if self._unanswered:
            self._find_unanswered()
        self._read_revision = 0 if found is None else found.mod_revision
        self._last_revision = self._read_revision
        if found is None:
            return None
        try:
            return decode_record(found.value, decode, self.keys.state)
        except UNREADABLE as exc:
            aside = f"{self.keys.state}.corrupt-{found.mod_revision}"
            self.etcd.txn(
                [compare_modified(self.keys.state, found.mod_revision)],
                [put(aside, found.value), {"request_delete_range": {"key": _b64(self.keys.state)}}],
            )
            raise StateCorruptError(
                f"state {self.keys.state} is unreadable ({exc}); copied aside to {aside}; "
                "the next settle starts a fresh ledger"
            ) from exc

    def _find_unanswered(self) -> None:
        """Raise ``LostSaveLandedError`` if a save of ours said unanswered went in.

        Read after the record: found, it went in before this load read what it wrote;
        not found, it has not gone in by the record this load read, and going in later it
        fails this section's save (the record moved). The daemon had kept that settle's
        command outcomes and the router's failures for the next settle, which heard them
        again on the record already holding them: two request failures counted as four,
        a backend condemned (and restarted) on half its threshold.
        """
        saved = self.etcd.get(self.keys.saved)
        if saved is not None and saved.value in self._unanswered:
            self._unanswered = []  # the others compared the record this one moved on
            raise LostSaveLandedError(
                f"a save of {self.keys.state} said unanswered went in after all", saved.value
            )

    def read(self, decode: Callable[[dict[str, Any]], T]) -> T | None:
        found = self.etcd.get(self.keys.state)
        self._last_revision = 0 if found is None else found.mod_revision  # for status
        if found is None:
            return None
        try:
            return decode_record(found.value, decode, self.keys.state)
        except UNREADABLE as exc:
            raise StateCorruptError(
                f"state {self.keys.state} is unreadable ({exc}); left in place: the next "
                "settle copies it aside and starts a fresh ledger"
            ) from exc

    def mark(self) -> None:
        """Never: a save compares against the revision this section's load read, so every
        settle loads."""
        return None

    def _compares(self) -> list[dict[str, Any]]:
        """What a write in this section stands on: the record as read and, for a leader,
        the leader key it created; raises when it may not write at all."""
        if self._read_revision is None:
            raise StateError("save without a load in this section: nothing to compare with")
        compare = [compare_modified(self.keys.state, self._read_revision)]
        if self.elector is not None:
            if self._fence is None or not self.elector.decision().may_act:
                raise NotLeaderError(f"{self.elector.member} may no longer act; nothing written")
            compare.append(compare_created(self.keys.leader, self._fence))
        return compare

    def _records(self) -> tuple[list[tuple[str, bytes]], int]:
        """The key and value of the section's unwritten audit records (none if there are
        none), and how many records that is."""
        assert self._read_revision is not None
        lines = self._pending or []
        if not lines:
            return [], 0
        key = self.keys.audit_batch(self._read_revision, len(lines))
        return [(key, audit_value(lines))], len(lines)

    def save(
        self, document: dict[str, Any], *, before: Callable[[], None] = nothing_before
    ) -> None:
        # The audit records go in the same transaction as the record: ``before`` has
        # nothing of its own to make durable first (EtcdAudit's batch holds nothing).
        before()
        loaded = self._read_revision or 0
        compare = self._compares()
        # Who wrote the record, for operators reading etcd (and tests proving who did not).
        writer: dict[str, Any] = {"member": None, "fence": None}
        if self.elector is not None:
            writer = {"member": self.elector.member, "fence": self._fence}
        payload = json.dumps(
            {**document, "schema": SCHEMA, "written_by": writer}, sort_keys=True, default=plain
        ).encode()
        records, count = self._records()
        # A leader's save carries a nonce of its own (verbs always write an audit record,
        # which is one): most settles write no record, and without it a lost answer under
        # a verb's write could not be told from a write that never went in.
        proof = [(self.keys.saved, secrets.token_hex(8).encode())] if self.elector else []
        writes = [(self.keys.state, payload), *records, *proof]
        read_back = [{"request_range": {"key": _b64(key)}} for key, _ in writes]
        puts = [put(key, value) for key, value in writes]
        try:
            written, revision, found = self.etcd.txn(compare, puts, read_back)
        except ClusterUnavailableError as exc:
            # No endpoint gave the answer (one endpoint, or each cut or slow in turn): the
            # write may have gone in all the same. Said "not written", the daemon stood by,
            # the restart it had ordered never ran and the commands it recorded were heard
            # again. Offered again under the same compares, as to a next endpoint: a read
            # alone proved nothing of a write still on its way (a balancer slow past the
            # bound), which went in after it. Once this one is answered, the first can no
            # longer go in (it went in, and this one found it, or the record moved on).
            # Within one request's bound: the settle already spent a call's on the write,
            # and a settle longer than the unit's WatchdogSec has the daemon killed.
            try:
                written, revision, found = self.etcd.txn(
                    compare, puts, read_back, within=REQUEST_TIMEOUT
                )
            except ClusterUnavailableError:
                if not proof:
                    raise exc from None
                # Either may still have gone in: the next load finds out, before the
                # settle after it hears again what this one was given.
                nonce = proof[0][1]
                self._unanswered = [*self._unanswered, nonce][-UNANSWERED_KEPT:]
                raise SaveUnansweredError(str(exc), nonce) from None
            # Answered: its compares held (written) or failed for good, and then the first
            # fails them too. Found not ours, nothing went in: the record moved (a verb, a
            # leader's settle) or the fence did, told apart as for any failed compare; said
            # "no etcd endpoint answered", a verb was not made again on the moved record.
        if not written:
            # Our own transaction may be what failed the compare: offered again after its
            # answer was lost (cut or timed out, then sent to the next endpoint). Every
            # key holding the very bytes we wrote (our fence, this settle's times) says
            # it went in, whole, and that nobody wrote after it. So does the audit key
            # alone, whose name only this write makes (a nonce), or the save's own nonce,
            # when another (an operator's verb) wrote the record on top since: said
            # "nothing written", the daemon settled again on the verb's record, the
            # restart this write had ordered never ran and the cycle's verdicts counted
            # twice.
            ours = [
                held is not None and held.value == value
                for held, (_, value) in zip(found, writes, strict=False)
            ]
            if len(found) != len(writes):
                raise self._not_written(f"the write of {self.keys.state} failed")
            # A leader's record alone proves nothing: a settle that changed nothing writes
            # the very bytes its last one did, and fenced out, it found them and was said
            # written, its audit records lost. Its nonce is this write's alone.
            whole = ours[-1] if proof else all(ours)
            if not whole and not (records and ours[1]):
                raise self._not_written(f"the write of {self.keys.state} failed")
            # The revision our write made: where a later save of this section stands.
            if whole:  # the nonce (or, for a verb, every key): nobody saved after it
                made = found[-1]
                assert made is not None
                revision = made.mod_revision
            else:  # the audit key, made by this write alone
                made = found[1]
                assert made is not None
                revision = made.create_revision
        self._read_revision = self._last_revision = revision
        self._saved_fence = self._fence
        # Went in on the record as this section read it, found without any unanswered
        # save of ours in it: those compared older records, and none can go in any more.
        self._unanswered = []
        self._pending = []
        self._trim_after(count)
        self._compact_after(revision, loaded)

    def _write_records_alone(self) -> None:
        """Audit records of a section that saved nothing, under the same compares."""
        compare = self._compares()
        records, count = self._records()
        [(key, value)] = records
        try:
            written, _, _ = self.etcd.txn(compare, [put(key, value)])
        except ClusterUnavailableError as exc:
            # Its answer lost (one endpoint, or each in turn): offered again, as ``save``
            # does, only if its key is not there yet (its name is this write's alone).
            # Said unwritten, a refused verb was an etcd error to the operator while its
            # record was in the trail, and trying again wrote it twice.
            try:
                written, _, found = self.etcd.txn(
                    [*compare, compare_created(key, 0)],
                    [put(key, value)],
                    [{"request_range": {"key": _b64(key)}}],
                    within=REQUEST_TIMEOUT,
                )
            except ClusterUnavailableError:
                raise exc from None
            held = found[0] if found else None
            written = written or (held is not None and held.value == value)
        if not written:
            raise self._not_written("the audit records of this section were not written")
        self._pending = []
        self._trim_after(count)

    def _not_written(self, what: str) -> StateError:
        """Why a write's compares failed: the record moved (another wrote it since it was
        read, and whoever wrote here still may), which a caller answers by doing its work
        again on the record as it now is; or the leader key is no longer this leader's.

        Told apart because they call for different things: an operator's verb landing
        between a leader's load and save failed the leader's settle as "fenced out",
        naming the leader itself, and cost the cycle's verdicts; a verb refused on a
        record a settle had just moved exited 3 where it is made again.
        """
        moved = f"{what}: {self.keys.state} was written by another since it was read"
        if self.elector is None:  # a verb's write: only the record's revision is compared
            return RecordMovedError(f"{moved}; nothing written")
        holder = read_leader(self.etcd, self.keys)
        if holder is not None and holder.fence == self._fence:
            return RecordMovedError(f"{moved} (an operator's verb); nothing written")
        who = f"{holder.member} leads (fence {holder.fence})" if holder else "nobody leads"
        return FencedOutError(f"{what}, fenced out: {who}; nothing written")

    def _trim_after(self, written: int) -> None:
        """Keep the newest ``audit_keep`` records: trimmed by a leader, on its first write
        of records and then after every tenth of ``audit_keep`` more (an operator's verb
        adds a record and leaves trimming to the daemons). Best effort: a trail a little
        long is no reason to fail a settle that was written."""
        if written == 0 or self.elector is None:
            return
        untrimmed = self._records_untrimmed
        if untrimmed is not None and untrimmed + written < max(1, self.audit_keep // 10):
            self._records_untrimmed = untrimmed + written
            return
        with contextlib.suppress(StateError):
            trim_audit(self.etcd, self.keys, self.audit_keep, self._fence)
            self._records_untrimmed = 0

    def _compact_after(self, revision: int, loaded: int) -> None:
        """A leader's save: every ``COMPACT_EVERY_SAVES``, etcd's history is compacted to
        the revision of the save as many before; at this process's first, to the
        revision it loaded (a `check` from cron saves once or twice and is gone: counted
        per process, a cluster run by cron alone was never compacted). Best effort, as
        trimming is: another compaction past it (etcd's own, if configured) or etcd
        away is no reason to fail a settle that was written."""
        if self.elector is None:
            return
        if not self._compact_to:
            if loaded:
                with contextlib.suppress(StateError):
                    self.etcd.compact(loaded)
            self._compact_to = revision
            return
        self._saves_uncompacted += 1
        if self._saves_uncompacted < COMPACT_EVERY_SAVES:
            return
        self._saves_uncompacted = 0
        if self._compact_to:
            with contextlib.suppress(StateError):
                self.etcd.compact(self._compact_to)
        self._compact_to = revision

    def append_record(self, record: Mapping[str, object]) -> None:
        """One audit record into the open section (``EtcdAudit.append``)."""
        if self._pending is None:
            raise AuditError(
                f"an audit record outside a section of {self.keys.state} would be written "
                "by no transaction; it was not kept"
            )
        if self.elector is not None:  # which leader decided, under which token
            record = {**record, "member": self.elector.member, "fence": self._fence}
        self._pending.append(encode_record(record))

    @property
    def revision(self) -> int:
        """The record's revision as last read or written here (0: none yet)."""
        return self._last_revision

    def command_env(self) -> dict[str, str]:
        """The fencing token for a restart command the last save ordered.

        The token is the leader key's creation revision, larger for every later leader, so
        a restart tool can refuse one smaller than the largest it has seen. Refused (and
        the command not run) once this daemon may not act, or leads under another token
        than the one its last save was fenced with: refused at launch, the restart stays
        RESTARTING in the record and expires to DEAD after startup_grace, at most once,
        never twice; refused when asked again after the command's thread read the record
        (the daemon's last look for an operator's withdrawal), the order is heard as not
        run, with no attempt spent, by whoever settles next.
        """
        if self.elector is None:
            return {}
        fence = self.elector.fence
        if fence is None or fence != self._saved_fence:
            why = self.elector.decision().reason
            raise NotLeaderError(f"{self.elector.member} may no longer act ({why}); not run")
        lease = self.elector.lease_id
        return {
            "LLMHEALTH_FENCE": str(fence),
            "LLMHEALTH_LEASE": "" if lease is None else f"{lease:x}",
            "LLMHEALTH_MEMBER": self.elector.member,
        }


class EtcdAudit:
    """A cluster's audit trail as a settle sees it: ``AuditLog``'s face, records held by
    the store until the transaction that writes the state they led to."""

    def __init__(self, store: EtcdStore) -> None:
        self._store = store

    def append(self, record: Mapping[str, object]) -> None:
        self._store.append_record(record)

    def batch(self) -> contextlib.AbstractContextManager[None]:
        """Every record is written with the next save already: one transaction, no fsync."""
        return contextlib.nullcontext()


def audit_value(lines: Sequence[bytes]) -> bytes:
    """One write's records as JSON lines, each within its share of the batch's bytes."""
    bounded = [bounded_record(line, AUDIT_RECORD_BYTES) for line in lines]
    if sum(map(len, bounded)) > AUDIT_BATCH_BYTES:
        share = max(AUDIT_SHARE_FLOOR, AUDIT_BATCH_BYTES // len(lines))
        bounded = [bounded_record(line, share) for line in lines]
    return b"".join(bounded)


def bounded_record(line: bytes, limit: int) -> bytes:
    """An audit line of at most about ``limit`` bytes: who, what, from, to kept whole, the
    bulkiest other fields (reads, command output) cut to a prefix of their JSON that says
    how long it was."""
    if len(line) <= limit:
        return line
    record = json.loads(line)
    sizes = {
        key: len(json.dumps(value)) for key, value in record.items() if key not in _AUDIT_WHOLE
    }
    keep = max(48, limit // 8)
    for key in sorted(sizes, key=sizes.__getitem__, reverse=True):
        if sizes[key] <= keep:
            break
        text = json.dumps(record[key])
        record[key] = f"{text[:keep]}... ({len(text)} bytes, cut to fit etcd)"
        line = encode_record(record)
        if len(line) <= limit:
            break
    return line


def _records_in(key: str) -> int:
    """How many records a batch key says it holds (1 for a key written by hand). Ours
    have six digits or a few more; int() refuses text past 4,300 digits (ValueError),
    and a key written by hand with that many ended the leader's trim, and its settle."""
    count = key.rpartition("-")[2]
    return int(count) if count.isascii() and count.isdigit() and len(count) <= 18 else 1


def trim_audit(etcd: Etcd, keys: Keys, keep: int, fence: int | None) -> int:
    """Delete the oldest audit batches while at least ``keep`` records remain; how many
    records went. Fenced by the leader key when a leader trims.

    The keys' names are read newest first, ``_TRIM_PAGE`` per answer: read in one, a
    trail of some 200,000 keys (an ``audit_keep`` of 200,000) outgrew what an answer may
    be (in bytes, and in the time etcd took to make it), every trim failed, silently,
    and the trail grew without bound towards etcd's quota."""
    kept, deleted, oldest_kept, cut = 0, 0, b"", False
    end: bytes | None = None
    while True:
        page = etcd.scan_down(keys.audit, end, _TRIM_PAGE, keys_only=True)
        for name, found in page:  # newest first
            if kept >= keep:
                cut = True
                deleted += _records_in(name)
            else:
                kept += _records_in(name)
                oldest_kept = found.key  # its bytes: a bound of its text could cut more
        if len(page) < _TRIM_PAGE:
            break
        end = page[-1][1].key
    if not cut or not oldest_kept:
        return 0
    compare = [] if fence is None else [compare_created(keys.leader, fence)]
    delete = {"request_delete_range": {"key": _b64(keys.audit), "range_end": _b64(oldest_kept)}}
    written, _, _ = etcd.txn(compare, [delete])
    return deleted if written else 0


def read_audit(
    etcd: Etcd,
    keys: Keys,
    last: int | None = None,
    each: Callable[[dict[str, object]], None] | None = None,
) -> AuditScan:
    """The audit records under the prefix, oldest first; only the ``last`` ones if given.

    Read newest first a page of keys' names at a time, then their values in runs one
    answer can carry, so ``--last 20`` reads a few keys, not the whole trail; ordered by
    the revision each batch was written at.

    ``each``: as for ``parse_records``, every record handed to it as it is parsed and
    none kept. The batches' bytes are held (at most ``audit_keep`` records of 8 KiB);
    their records held as dicts too took seven times their bytes in all, GBs at the largest
    ``audit_keep``, before ``audit`` printed its first line.
    """
    batches: list[tuple[int, str, bytes]] = []
    held, end = 0, None
    while last is None or held < last:
        page = etcd.scan_down(keys.audit, end, _AUDIT_PAGE, keys_only=True)
        for group in _value_groups(page):
            if last is not None and held >= last:
                break  # ``--last 20`` reads no run of values past those it shows
            for name, found in _values_of(etcd, keys, group):
                batches.append((found.create_revision, name, found.value))
                held += _records_in(name)
        if len(page) < _AUDIT_PAGE:
            break
        # The next page below this one's last key, by its bytes: its text re-encoded sorts
        # above a key that is not UTF-8, and the same page came back for ever.
        end = page[-1][1].key
    batches.sort()
    lines = (raw for _, _, value in batches for raw in value.splitlines())
    return parse_records(lines, last, each)


def _batch_bytes(key: str) -> int:
    """About the most a batch key's value holds, by the record count its name gives
    (``audit_value``): 8 KiB a record, within 256 KiB in all, or 384 bytes a record past
    that (a settle of hundreds)."""
    records = _records_in(key)
    return min(records * AUDIT_RECORD_BYTES, max(AUDIT_BATCH_BYTES, records * AUDIT_SHARE_FLOOR))


def _value_groups(
    page: list[tuple[str, KeyValue]],
) -> Iterator[list[tuple[str, KeyValue]]]:
    """A page of audit keys, newest first, in runs whose values one answer can carry
    (``_AUDIT_VALUES_BYTES``; one key at least)."""
    group: list[tuple[str, KeyValue]] = []
    size = 0
    for name, found in page:
        if group and size + _batch_bytes(name) > _AUDIT_VALUES_BYTES:
            yield group
            group, size = [], 0
        group.append((name, found))
        size += _batch_bytes(name)
    if group:
        yield group


def _values_of(
    etcd: Etcd, keys: Keys, group: list[tuple[str, KeyValue]]
) -> list[tuple[str, KeyValue]]:
    """The values of a run of audit keys (newest first), read at once: those below its
    first key's bytes down to its last's (a trim since the names were read leaves fewer;
    none below the run is taken, the next run reads those). Only the names read: a batch
    written since may sort inside the run (records alone, under the revision last read,
    and a random nonce), and taken in one answer asked by count, it pushed the run's
    oldest out, a batch in no read of the trail; so the answer is read on below its last
    key while a name is missing."""
    wanted = {found.key for _, found in group}
    end, bottom = group[0][1].key + b"\0", group[-1][1].key
    values: list[tuple[str, KeyValue]] = []
    while wanted:
        found = etcd.scan_down(keys.audit, end, len(wanted))
        inside = [(name, value) for name, value in found if value.key >= bottom]
        values += [(name, value) for name, value in inside if value.key in wanted]
        wanted -= {value.key for _, value in inside}
        if len(inside) < len(found) or not inside:
            break  # past the run's last key, or nothing left in it
        end = inside[-1][1].key
    return values


class ReadOnlyStore(EtcdStore):
    """The record as a standby or a ``check`` that lost the election sees it: never written."""

    def __init__(self, etcd: Etcd, keys: Keys) -> None:
        super().__init__(etcd, keys, None)

    def load(self, decode: Callable[[dict[str, Any]], T]) -> T | None:
        """As ``read``: a non-leader writes nothing, not even a corrupt record's copy aside
        (the leader's next settle makes it)."""
        return self.read(decode)

    def save(
        self, document: dict[str, Any], *, before: Callable[[], None] = nothing_before
    ) -> None:
        """A non-leader keeps what it concluded to itself; the leader settles for real."""

    def append_record(self, record: Mapping[str, object]) -> None:
        raise AuditError("a standby's view of the record keeps no audit records")


class Seat:
    """One process's place in a cluster: its elector, and the stores it writes and reads."""

    def __init__(
        self,
        endpoints: Sequence[str],
        prefix: str,
        member: str,
        lease_ttl: float,
        *,
        log: Log,
        audit_keep: int = DEFAULT_AUDIT_KEEP,
    ) -> None:
        self.etcd = Etcd(endpoints)
        self.keys = Keys(prefix)
        timing = LeaseTiming.for_ttl(lease_ttl)
        # The elector's requests are small; each waits on one endpoint at most a third of
        # the renew deadline while others are left to ask. At the 2 s of the others, one
        # paused etcd member of three (quorum kept) took the whole deadline of a 3 s lease
        # before the next member was asked, and the leader stepped down, its lead handed
        # on for nothing.
        silence = min(REQUEST_TIMEOUT, timing.renew_deadline / 3)
        elector_etcd = Etcd(endpoints, hurried=silence)
        self.elector = Elector(elector_etcd, self.keys, member, timing, log=log)
        # Fenced, for the leader; its audit trail rides in the same transactions.
        self.store = EtcdStore(self.etcd, self.keys, self.elector, audit_keep=audit_keep)
        self.reader = ReadOnlyStore(self.etcd, self.keys)  # for standbys and views

    @classmethod
    def for_config(cls, cluster: ClusterConfig, log: Log) -> Seat:
        """The seat a config's [cluster] table describes; without a ``member`` name, this
        host's name and process ID."""
        return cls(
            cluster.etcd,
            cluster.prefix,
            cluster.member or default_member_name(),
            cluster.lease_ttl,
            log=log,
            audit_keep=cluster.audit_keep,
        )

    @property
    def member(self) -> str:
        return self.elector.member

    def standing(self) -> str:
        """One line for logs and systemd's STATUS: who acts, seen from here."""
        decision = self.elector.decision()
        if decision.may_act:
            return f"leader ({self.member})"
        observed = self.elector.observed
        if not observed.etcd_up:
            return "standby: etcd unreachable, nobody here acts"
        leader = observed.leader
        return f"standby ({leader.member} leads)" if leader else "standby (no leader yet)"


class SharedReads:
    """One member's part in sharded reads (``[cluster] shard_reads``).

    Its share is its rendezvous share of the backends among the members whose keys it
    last saw; it publishes its share's newest verdicts under ``PREFIX/verdicts/NAME`` on
    its own lease (a member that dies takes its publication with it, and its share moves
    once its member key expires). Leading, it takes the others' verdicts for its settle
    (``shares.take_published``). Called from the settle's thread only.
    """

    def __init__(self, seat: Seat, clock: Callable[[], float] = time.monotonic) -> None:
        self.seat = seat
        seat.elector.shares_reads = True  # in its member key from its next renewal on
        self._clock = clock
        self._intake: Intake | None = None
        self._intake_fence: int | None = None  # the lead it belongs to
        self.stale: tuple[str, ...] = ()  # backends the last settle settled as doubt

    def members(self) -> list[str]:
        """The members the backends are shared among: this one, and those whose member
        keys say they read a share (not a `check`, nor a daemon without shard_reads)."""
        observed = self.seat.elector.observed.members
        readers = (name for name, value in observed if value.get("shares_reads") is True)
        return sorted({self.seat.member, *readers})

    def share(self, backends: Sequence[str]) -> frozenset[str]:
        return frozenset(share_of(self.seat.member, backends, self.members()))

    def publish(
        self,
        serials: Mapping[str, int],
        verdicts: Mapping[str, Verdict],
        examined: Mapping[str, int],
        urls: Mapping[str, str],
        reading_at: Mapping[str, str] | None = None,
    ) -> bool:
        """This member's newest verdicts (and where each was read) and examination counts
        (and where they are made) for whoever leads (see
        ``shares.publication``), in keys of at most about
        ``PUBLICATION_BYTES`` (``NAME/00000``, ``NAME/00001``, ...); the chunks a shrunken
        share no longer fills are deleted with the last. Nothing while it has no lease
        (False: nothing published)."""
        lease = self.seat.elector.lease_id
        if lease is None:
            return False
        if (refused := self.seat.elector.member_refused) is not None:
            raise ClusterError(refused)
        mine = f"{self.seat.keys.verdicts}{self.seat.member}/"
        chunks = publication(serials, verdicts, examined, PUBLICATION_BYTES, urls, reading_at)
        for index, chunk in enumerate(chunks):
            operations = [put(f"{mine}{index:05d}", chunk, lease)]
            if index == len(chunks) - 1:
                left = {
                    "key": _b64(f"{mine}{index + 1:05d}"),
                    "range_end": _b64(_after_prefix(mine)),
                }
                operations.append({"request_delete_range": left})
            self.seat.etcd.txn([], operations)
        return True

    def take(self, backends: Mapping[str, str], stale_after: float, undecided_for: float) -> Taken:
        """The others' verdicts to settle now: each once, doubt for what went stale or was
        read at another address than ``backends`` (name → URL) gives it
        (``shares.take_published``, ``shares.Intake``)."""
        now = self._clock()
        fence = self.seat.elector.fence
        if self._intake is None or fence != self._intake_fence:
            # A lead lost and won again between two settles never met ``stand_down``: the
            # intake it kept took what the leader between settled as news, a second time.
            self._intake, self._intake_fence = Intake(now, undecided_for), fence
        # As the config has it now: kept from the lead's start, a reload that let readers
        # examine longer undecided (a longer wait or max_check_time) had the backends they
        # still examined within it settled "stalled", unhealthy.
        self._intake.undecided_for = undecided_for
        members = self.members()
        owners = {
            name: found
            for name in backends
            if (found := owner(name, members)) is not None and found != self.seat.member
        }
        published = self._published()
        taken = take_published(self._intake, owners, published, now, stale_after, backends)
        self.stale = taken.stale
        return taken

    def stand_down(self) -> None:
        """Not leading (any more): a later lead starts a new intake."""
        self._intake = None
        self.stale = ()

    def _published(self) -> dict[str, dict[str, Published]]:
        prefix = self.seat.keys.verdicts
        mine = f"{prefix}{self.seat.member}/"  # its own reads reach its settle directly
        published: dict[str, dict[str, Published]] = {}
        for key, found in self.seat.etcd.get_prefix_paged(prefix, PUBLICATION_PAGE, skip=mine):
            # Another member wrote the key and its name: made printable before any use.
            member = printable(key.removeprefix(prefix).rpartition("/")[0])
            if member == self.seat.member:
                continue
            try:
                document = json.loads(found.value)
            except (ValueError, RecursionError):  # nested thousands deep: unreadable too
                document = None
            published.setdefault(member, {}).update(parse_publication(member, document))
        return published


def describe(etcd: Etcd, keys: Keys, revision: int) -> dict[str, Any]:
    """Who leads, since when, on which lease, and each member's last report: for ``status``."""
    leader = read_leader(etcd, keys)
    return {
        "prefix": keys.prefix,
        "leader": None
        if leader is None
        else {
            "member": leader.member,
            "since": leader.since,
            "lease": f"{leader.lease:x}",
            "fence": leader.fence,
        },
        "revision": revision,
        "members": {name: value.get("last_report", {}) for name, value in read_members(etcd, keys)},
    }
