"""Operator verbs over the persisted fleet record: readmit, retire, reset, hold, release.

Each verb takes the state lock, changes the record through the ledger's own guarded
events (so an operator cannot do what the rules forbid, only what they allow), and saves
it with one audit line, written only once the new state is ready to replace the old: a
save that fails leaves no record of a change that was not made. A verb the ledger
refuses changes nothing and says why.
Before the first check, a verb on a backend the config names works on the record a
check would start from, so maintenance can be declared on a new deployment.
"""

from __future__ import annotations

import contextlib
import functools
import getpass
import os
import time
import unicodedata
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, replace
from typing import Any, ParamSpec

from llmhealth.actions import Audit, AuditLog
from llmhealth.config import COMMAND_LINE, Config
from llmhealth.cycle import fresh_record, ledger_policy
from llmhealth.fleet import FleetRecord, MembershipChange, saved_floor
from llmhealth.ledger import Event, LedgerPolicy, OperatorReset, Readmitted, Retire
from llmhealth.policy import Hold
from llmhealth.state import RecordMovedError, StateError, Store

Clock = Callable[[], float]
_P = ParamSpec("_P")
VERB_ATTEMPTS = 5  # a verb raced by a leader's settles is made again this many times in all


@dataclass(frozen=True, slots=True)
class VerbResult:
    applied: bool
    message: str


def actor() -> str:
    """Who is acting, for the audit log: the login behind sudo if there is one.

    sudo sets LOGNAME and USER to the user it runs as (root), which getpass reads first,
    and keeps the caller in SUDO_USER: every on-call verb was written down as root's, or
    as the service's user when run as it (``sudo -u``), as the README asks.
    """
    behind_sudo = os.environ.get("SUDO_USER")
    if behind_sudo:
        return f"operator:{behind_sudo}"
    try:
        return f"operator:{getpass.getuser()}"
    except (KeyError, OSError):
        return "operator"


@dataclass(frozen=True)
class _Edit:
    """The record a verb changes, and where a change is saved, said in its message."""

    record: FleetRecord
    saved: str
    # The backend's name as the record or config spells it (``_spelled``).
    name: str
    # A configured backend the record did not hold, added (or a saved one renamed, and a
    # backend that rename displaced forgotten) for this verb: audited with the verb's own
    # record when the verb saves.
    added: tuple[MembershipChange, ...] = ()

    def save(self, store: Store, audit: Audit, now: float, entry: Mapping[str, object]) -> None:
        """Save the changed record with the verb's audit record, as a settle saves its own
        (``cycle._close``): the records are written once the new state is on disk under
        its temporary name and before it replaces the old. Written first, a save that
        then failed (a full disk) left the trail saying the verb was applied when the
        state said it was not."""
        with contextlib.ExitStack() as batch:
            batch.enter_context(audit.batch())
            for change in self.added:
                audit.append(change.audit_record(now, actor()))
            audit.append(entry)
            try:
                store.save(self.record.to_document(), before=batch.close)
            except StateError:
                if isinstance(audit, AuditLog):  # its records may be durable already
                    audit.take_back_batch()
                raise


@contextlib.contextmanager
def _editing(
    store: Store, config: Config, name: str, clock: Clock, *, or_held: bool = False
) -> Iterator[_Edit]:
    """The record of a fleet that has this backend, with the state lock held.

    With no saved record yet, the one a first check would start from (every configured
    backend HEALTHY); a configured backend the saved record does not know yet (added
    or renamed since the last check) is added or renamed as a check would. Either is
    saved only if the verb changes something. The message names where: a verb that found
    no state makes a new one, which a daemon keeping its state elsewhere (another user's
    default path, a config without ``state``) never reads, and the operator must be able
    to see that.
    ``or_held``: a name the config dropped whose hold is kept will do (``release``).
    """
    with store.locked():
        policy = ledger_policy(config.policy)
        record = store.load(lambda doc: FleetRecord.from_dict(doc, _policy(config, doc)))
        configured = {backend.name: backend.url for backend in config.backends}
        saved_names = () if record is None else (*record.ledger.names, *record.holds)
        # The config's spelling first: the saved one (the same text in another form, a
        # name the config dropped) held the record a check renames to another name.
        name = _spelled(name, configured)
        if name not in configured:
            name = _spelled(name, saved_names)
        saved = f"saved to {store.path}"
        if record is None:
            if name not in configured:
                raise StateError(
                    f"no state at {store.path} yet, and no backend named {name!r} in the "
                    "config: name the config with --config, or run 'llmhealth check' first"
                )
            record = fresh_record(policy, configured, clock())
            saved = (
                f"saved to a new state at {store.path}: no check had saved one there, and "
                "a daemon keeping its state elsewhere does not see this"
            )
        added: tuple[MembershipChange, ...] = ()
        if name in configured and (name not in record.ledger or _renamed(record, name, configured)):
            # A new name the config gives a saved backend's server is renamed, as a check
            # renames it (``reconcile``), its record kept: added, it shared the address.
            # Along its chain, as a check renames it: its own record kept aside goes on to
            # the name now at its server first (taken over, a condemned server's record was
            # dropped, and it came in HEALTHY under that name at the next check). A saved
            # name the config now gives another server likewise: its record goes on to the
            # name at its server, or the verb acted on that server (the operator's hold or
            # retirement followed the record there, and this name came in without it).
            trial = FleetRecord.from_dict(record.to_dict(), record.ledger.policy)
            try:
                added = tuple(trial.renamed_for(name, configured, clock()))
                if name not in trial.ledger:
                    added += (trial.admit(name, configured[name], clock()),)
                record = trial
            except ValueError:
                # Its server is still a saved backend's that the config moves or drops
                # (gpu0 leaves port 11 for 12, which the config now gives gpu1): only a
                # check's whole reconcile moves that one off first. Refused, every verb
                # on the name failed until a check ran ("share the URL").
                try:
                    added = tuple(record.reconcile(configured, clock()))
                except ValueError as exc:
                    raise StateError(f"cannot add {name!r} from the config: {exc}") from exc
        if name not in record.ledger and not (or_held and name in record.holds):
            known = ", ".join(record.ledger.names) or "none"
            raise StateError(f"no backend named {name!r} in the state (known: {known})")
        yield _Edit(record, saved, name, added)


def _renamed(record: FleetRecord, name: str, configured: Mapping[str, str]) -> bool:
    """Whether a check would rename a saved record to ``name`` or give ``name``'s own
    record another name (``FleetRecord.renames``): the config's ``name`` is not the record
    the state holds under it."""
    pending = record.renames(configured)
    return name in pending or name in pending.values()


def _spelled(name: str, known: Iterable[str]) -> str:
    """``name`` as the record or config spells it: the one known name that is the same
    text in another Unicode form ("café" typed composed, saved decomposed), else as typed.
    Told apart by bytes alone, a verb said "no backend named 'café' (known: café)"."""
    wanted = unicodedata.normalize("NFC", name)
    same = {other for other in known if unicodedata.normalize("NFC", other) == wanted}
    return name if name in same or len(same) != 1 else same.pop()


def _again_when_moved(verb: Callable[_P, VerbResult]) -> Callable[_P, VerbResult]:
    """A verb that raced another writer (in a cluster, the leader settles every wait) wrote
    nothing: it is made again on the record as it now is, a few times, before the
    operator hears of it. A file store never races: its lock keeps writers apart."""

    @functools.wraps(verb)
    def again(*args: _P.args, **kwargs: _P.kwargs) -> VerbResult:
        for _ in range(VERB_ATTEMPTS - 1):
            with contextlib.suppress(RecordMovedError):
                return verb(*args, **kwargs)
        return verb(*args, **kwargs)

    return again


@_again_when_moved
def apply_event(
    store: Store,
    audit: Audit,
    config: Config,
    name: str,
    make_event: Callable[[float], Event],
    verb: str,
    reason: str = "",
    *,
    clock: Clock = time.time,
) -> VerbResult:
    """Lock, feed one operator event to the ledger, save it with its audit record (a
    refusal is only audited)."""
    with _editing(store, config, name, clock) as edit:
        record, now, name = edit.record, clock(), edit.name
        transition = record.ledger.apply(name, make_event(now))
        entry: dict[str, Any] = {
            "time": now,
            "actor": actor(),
            "backend": name,
            "event": verb,
            "from": str(transition.from_state),
            "to": str(transition.to_state),
            "reason": reason or transition.reason,
            "applied": transition.applied,
        }
        record.moved(name, [transition], now)
        if transition.applied:
            edit.save(store, audit, now, entry)
            return VerbResult(
                True,
                f"{name}: {transition.from_state} → {transition.to_state} ({verb}); {edit.saved}",
            )
        audit.append(entry)  # a refusal saves nothing: its record is all there is to write
        return VerbResult(
            False, f"{name}: {verb} refused in {transition.from_state}: {transition.reason}"
        )


def readmit(
    store: Store, audit: Audit, config: Config, name: str, weight_version: int | None
) -> VerbResult:
    return apply_event(
        store,
        audit,
        config,
        name,
        lambda now: Readmitted(now=now, weight_version=weight_version),
        "readmit",
        "" if weight_version is None else f"weight version {weight_version}",
    )


def retire(store: Store, audit: Audit, config: Config, name: str, reason: str) -> VerbResult:
    return apply_event(
        store, audit, config, name, lambda now: Retire(now=now, reason=reason), "retire", reason
    )


def reset(store: Store, audit: Audit, config: Config, name: str) -> VerbResult:
    return apply_event(store, audit, config, name, lambda now: OperatorReset(now=now), "reset")


@_again_when_moved
def hold(
    store: Store,
    audit: Audit,
    config: Config,
    name: str,
    seconds: float,
    reason: str,
    *,
    clock: Clock = time.time,
) -> VerbResult:
    """Keep remediation away from a backend for a while; verdicts are still recorded.

    A backend has one hold: a new one replaces a running one (a trainer's short hold may
    end an operator's long one), so the answer and the trail name what it replaced.
    """
    with _editing(store, config, name, clock) as edit:
        record, now, name = edit.record, clock(), edit.name
        new_hold = Hold(reason=reason, until=now + seconds, by=actor())
        running = record.holds.get(name)
        replaced = running if running is not None and running.active(now) else None
        record.holds[name] = new_hold
        change: dict[str, object] = {
            "time": now,
            "actor": new_hold.by,
            "backend": name,
            "event": "hold",
            "until": new_hold.until,
            "reason": reason,
        }
        message = f"{name}: {new_hold.describe(now)}"
        if replaced is not None:
            change["replaces"] = replaced.to_dict()
            message += f"; replaces the hold {replaced.describe(now).removeprefix('on hold ')}"
        edit.save(store, audit, now, change)
        return VerbResult(True, f"{message}; {edit.saved}")


@_again_when_moved
def release(
    store: Store, audit: Audit, config: Config, name: str, *, clock: Clock = time.time
) -> VerbResult:
    """End a hold early; also one a name keeps after the config dropped it."""
    with _editing(store, config, name, clock, or_held=True) as edit:
        now, name = clock(), edit.name
        held = edit.record.holds.get(name)
        if held is None or not held.active(now):
            # An ended hold holds nothing (the next settle drops it): releasing it would
            # put a change in the trail that changed nothing.
            ended = "" if held is None else f" (its hold by {held.by} has ended)"
            return VerbResult(False, f"{name}: not on hold{ended}")
        removed = edit.record.holds.pop(name)
        edit.save(
            store,
            audit,
            now,
            {
                "time": now,
                "actor": actor(),
                "backend": name,
                "event": "release",
                "reason": f"released hold: {removed.reason}",
            },
        )
        return VerbResult(True, f"{name}: hold released ({removed.reason}); {edit.saved}")


def _policy(config: Config, document: Mapping[str, Any]) -> LedgerPolicy:
    """The config's thresholds; without a config file, the floor the record was saved
    with, so that ``status`` judges it as the daemon did and a verb saves it unchanged."""
    policy = ledger_policy(config.policy)
    floor = saved_floor(document) if config.source == COMMAND_LINE else None
    return policy if floor is None else replace(policy, min_healthy=floor)


def read_record(store: Store, config: Config) -> FleetRecord:
    """For ``status``: the record as saved. Only read (``Store.read``): a look creates no
    lock file or directory, and moves no corrupt record aside."""
    record = store.read(lambda doc: FleetRecord.from_dict(doc, _policy(config, doc)))
    if record is None:
        raise StateError(f"no state at {store.path} yet: run 'llmhealth check' with it first")
    return record
