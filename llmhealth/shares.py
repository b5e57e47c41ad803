"""Sharded reads: a verdict as plain values and back, and what a leader settles of others'.

Pure: values in, values out; ``now`` is the caller's monotonic clock. With
``shard_reads`` each member reads its rendezvous share of the backends
(``leadership.share_of``) and publishes its verdicts; the leader settles every backend
every wait, its own share from its reads and the others from what was published. A
published verdict is settled once (by the publisher's serial, not by time: members'
clocks differ), and a backend with no news for ``stale_after`` becomes a ``stalled``
verdict that says who should have read it: doubt, never silence and never health. News
is a new verdict, or a reader's count of its examinations having grown: an engine inside
a long step (a young one compiling, minutes of a window) is read every wait and decided
only at its window's end, and its reader is no less alive for that.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from llmhealth.classify import Answer, Read, ReadProblem, Verdict, VerdictKind
from llmhealth.metrics import EngineSignals, Signals
from llmhealth.text import other_server, printable
from llmhealth.window import CpuSample, LongestStep

_ENGINE_NUMBERS = (
    "running",
    "waiting",
    "waiting_deferred",
    "steps",
    "generation_tokens",
    "prompt_tokens",
    "prompt_tokens_cached",
    "finished",
    "preemptions",
    "kv_usage",
    "longest_gap",
    "largest_step_tokens",
    "prefill_seconds",
    "longest_prefill",
)
_VERDICT_NUMBERS = ("steps_per_s", "tokens_per_s")


# --- a verdict as plain values ---------------------------------------------------------


def verdict_to_dict(verdict: Verdict) -> dict[str, Any]:
    """Everything the ledger and the audit use of a verdict; None fields left out."""
    document: dict[str, Any] = {
        "kind": str(verdict.kind),
        "healthy": verdict.healthy,
        "evidence": verdict.evidence,
        "requests_sent": verdict.requests_sent,
        "reads": [_read_to_dict(read) for read in verdict.reads],
        "judged": verdict.judged,
    }
    for name in ("running", "waiting", *_VERDICT_NUMBERS):
        value = getattr(verdict, name)
        if _finite(value):
            document[name] = value
    if verdict.answer is not None:
        answer = verdict.answer
        document["answer"] = {
            "at": answer.at,
            "ok": answer.ok,
            "detail": answer.detail,
            "model": answer.model,
            "models_served": list(answer.models_served),
            "timed_out": answer.timed_out,
            "refused": answer.refused,
            "sent": answer.sent,
        }
    if verdict.longest_step is not None:
        document["longest_step"] = verdict.longest_step.to_dict()
    return document


def _read_to_dict(read: Read) -> dict[str, Any]:
    document: dict[str, Any] = {"at": read.at}
    if read.sent is not None:
        document["sent"] = read.sent
    if read.problem is not None:
        document["problem"] = str(read.problem)
    if read.detail:
        document["detail"] = read.detail
    if read.cpu is not None:
        document["cpu"] = {
            "seconds": read.cpu.seconds,
            "processes": list(read.cpu.processes),
            "at": read.cpu.at,
            "stopped": list(read.cpu.stopped),
        }
    if read.signals is not None:
        signals = read.signals
        document["signals"] = {
            "process_start": signals.process_start if _finite(signals.process_start) else None,
            "skipped_lines": signals.skipped_lines,
            "notes": list(signals.notes),
            "engines": [_engine_to_dict(engine) for engine in signals.engines],
        }
    return document


def _engine_to_dict(engine: EngineSignals) -> dict[str, Any]:
    document: dict[str, Any] = {"engine": engine.engine}
    for name in _ENGINE_NUMBERS:
        value = getattr(engine, name)
        if _finite(value):
            document[name] = value
    if engine.sleep_state is not None:
        document["sleep_state"] = engine.sleep_state
    if engine.gap_beyond:
        document["gap_beyond"] = True
    return document


def _finite(value: float | None) -> bool:
    """A number JSON can carry; NaN and infinities (a hostile text's) are left unsaid."""
    return value is not None and math.isfinite(value)


def verdict_from_dict(data: object, where: str) -> Verdict:
    """A published verdict; ValueError naming the field when it is not one. Text in it
    is made printable again: any member, or anyone who can write etcd, wrote it."""
    table = _table(data, where)
    kind = VerdictKind(_text(table, "kind", where))
    reads = tuple(
        _read_from_dict(read, f"{where}.reads[{index}]")
        for index, read in enumerate(_list(table, "reads", where))
    )
    answer = None
    if table.get("answer") is not None:
        raw = _table(table["answer"], f"{where}.answer")
        model = raw.get("model")
        answer = Answer(
            at=_number(raw, "at", f"{where}.answer"),
            ok=_flag(raw, "ok", f"{where}.answer"),
            detail=_text(raw, "detail", f"{where}.answer"),
            model=None if model is None else printable(str(model)),
            models_served=tuple(
                printable(str(m)) for m in _list(raw, "models_served", f"{where}.answer")
            ),
            timed_out=_flag(raw, "timed_out", f"{where}.answer"),
            refused=_flag(raw, "refused", f"{where}.answer", missing=False),
            sent=_flag(raw, "sent", f"{where}.answer", missing=True),
        )
    step = table.get("longest_step")
    learned = None if step is None else LongestStep.from_dict(step, f"{where}.longest_step")
    running, waiting = (_optional(table, name, where) for name in ("running", "waiting"))
    return Verdict(
        kind=kind,
        healthy=_flag(table, "healthy", where),
        evidence=_text(table, "evidence", where),
        running=None if running is None else int(running),
        waiting=None if waiting is None else int(waiting),
        steps_per_s=_optional(table, "steps_per_s", where),
        tokens_per_s=_optional(table, "tokens_per_s", where),
        requests_sent=int(_number(table, "requests_sent", where)),
        reads=reads,
        answer=answer,
        # Its why too: settled, it goes on into the state and every later window's evidence.
        longest_step=None if learned is None else replace(learned, why=printable(learned.why)),
        # A member's own failure (starved, a worker lost) read as judged was news of the
        # backend at the leader; absent in what an earlier member wrote: judged.
        judged=_flag(table, "judged", where, missing=True),
    )


def _read_from_dict(data: object, where: str) -> Read:
    table = _table(data, where)
    problem = table.get("problem")
    cpu = None
    if table.get("cpu") is not None:
        raw = _table(table["cpu"], f"{where}.cpu")
        cpu = CpuSample(
            seconds=_number(raw, "seconds", f"{where}.cpu"),
            processes=tuple(int(p) for p in _list(raw, "processes", f"{where}.cpu")),
            at=_optional(raw, "at", f"{where}.cpu"),
            stopped=tuple(int(p) for p in _list(raw, "stopped", f"{where}.cpu")),
        )
    signals = None
    if table.get("signals") is not None:
        raw = _table(table["signals"], f"{where}.signals")
        signals = Signals(
            engines=tuple(
                _engine_from_dict(engine, f"{where}.signals.engines[{index}]")
                for index, engine in enumerate(_list(raw, "engines", f"{where}.signals"))
            ),
            process_start=_optional(raw, "process_start", f"{where}.signals"),
            skipped_lines=int(_number(raw, "skipped_lines", f"{where}.signals")),
            notes=tuple(printable(str(n)) for n in _list(raw, "notes", f"{where}.signals")),
        )
    at = _number(table, "at", where)
    sent = _optional(table, "sent", where)
    return Read(
        at=at,
        signals=signals,
        problem=None if problem is None else ReadProblem(str(problem)),
        detail=printable(str(table.get("detail", ""))),
        cpu=cpu,
        # Never after the answer was in: a later one would lengthen the freezes it ends.
        sent=None if sent is None else min(sent, at),
    )


def _engine_from_dict(data: object, where: str) -> EngineSignals:
    table = _table(data, where)
    numbers = {name: _optional(table, name, where) for name in _ENGINE_NUMBERS}
    sleep_state = table.get("sleep_state")
    return EngineSignals(
        engine=_text(table, "engine", where),
        sleep_state=None if sleep_state is None else printable(str(sleep_state)),
        gap_beyond=bool(table.get("gap_beyond", False)),
        **numbers,
    )


def _table(data: object, where: str) -> Mapping[str, Any]:
    if not isinstance(data, dict):
        raise ValueError(f"{where}: expected a table")
    return data


def _list(table: Mapping[str, Any], key: str, where: str) -> list[Any]:
    value = table.get(key, [])
    if not isinstance(value, list):
        raise ValueError(f"{where}.{key}: expected a list")
    return value


def _text(table: Mapping[str, Any], key: str, where: str) -> str:
    value = table.get(key)
    if not isinstance(value, str):
        raise ValueError(f"{where}.{key}: expected a string")
    return printable(value)


def _whole(table: Mapping[str, Any], key: str, where: str) -> int:
    value = table.get(key)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{where}.{key}: expected a whole number")
    return value


def _flag(table: Mapping[str, Any], key: str, where: str, missing: bool | None = None) -> bool:
    """A true/false field; ``missing`` is its value when absent (None: it must be there)."""
    value = table.get(key, missing)
    if not isinstance(value, bool):
        raise ValueError(f"{where}.{key}: expected true or false")
    return value


def _number(table: Mapping[str, Any], key: str, where: str) -> float:
    value = _optional(table, key, where)
    if value is None:
        raise ValueError(f"{where}.{key}: expected a number")
    return value


def _optional(table: Mapping[str, Any], key: str, where: str) -> float | None:
    value = table.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{where}.{key}: expected a number, got {value!r}")
    if not math.isfinite(value):
        raise ValueError(f"{where}.{key}: not a finite number")
    return float(value)


# --- what the leader settles of the others' reads --------------------------------------


@dataclass(frozen=True, slots=True)
class Published:
    """One backend's newest verdict as a member published it, and how far it has read."""

    member: str
    serial: int  # new with each of the member's verdicts of this backend: news when it changes
    verdict: Verdict | None  # None: none yet (``examined`` says so), or unreadable
    problem: str = ""  # why it could not be read, when it could not
    examined: int | None = None  # examinations, decided or not; None: not published
    url: str | None = None  # where the verdict was read; None: not said (an older member)
    reading_at: str | None = None  # where the examinations are made now; None: not said


def publication(
    serials: Mapping[str, int],
    verdicts: Mapping[str, Verdict],
    examined: Mapping[str, int],
    limit: int,
    urls: Mapping[str, str],
    reading_at: Mapping[str, str] | None = None,
) -> list[bytes]:
    """What a member writes under its keys: per backend of its share, the newest verdict
    with its serial and the address it was read at (``urls``), and the count of
    examinations with the address they are made at (``reading_at``; a backend still
    undecided has the count alone), as JSON documents of about ``limit`` bytes at most
    each (one etcd request each: a verdict of three reads is about 2 KB, and a share can
    hold thousands)."""
    reading_at = reading_at or {}
    chunks: list[bytes] = []
    entries: list[bytes] = []
    size = 0
    for name in sorted(verdicts.keys() | examined.keys()):
        entry: dict[str, Any] = {"serial": serials.get(name, 0)}
        if name in examined:
            entry["examined"] = examined[name]
            if name in reading_at:
                entry["reading_at"] = reading_at[name]
        if name in verdicts:
            entry["verdict"] = verdict_to_dict(verdicts[name])
            if name in urls:
                entry["url"] = urls[name]
        text = _entry_text(name, entry)
        if len(text) > limit and "verdict" in entry:
            # A frozen window of a server with many engines (128 engines by 61 reads is
            # 2.2 MB): etcd refused the whole chunk, and the publication stopped there.
            text = _entry_text(name, _fitted(entry, len(text) - limit))
        if entries and size + len(text) > limit:
            chunks.append(_chunk(entries))
            entries, size = [], 0
        entries.append(text)
        size += len(text) + 1
    if entries or not chunks:
        chunks.append(_chunk(entries))
    return chunks


def _entry_text(name: str, entry: Mapping[str, Any]) -> bytes:
    return (json.dumps(name) + ":" + json.dumps(entry, allow_nan=False)).encode()


def _fitted(entry: Mapping[str, Any], excess: int) -> dict[str, Any]:
    """An entry ``excess`` bytes over the limit, its verdict without the models its
    server lists but the one asked, then without as many of its oldest reads as that
    takes: the newest are those the leader compares a new process
    with, and the verdict is the news. Its evidence says how many were left out."""
    verdict = dict(entry["verdict"])
    answer = verdict.get("answer")
    if answer is not None and len(answer["models_served"]) > 1:
        # A /v1/models of a thousand long ids (1 MB, under the probe's cap) was 5 MB made
        # printable, past etcd whatever the reads. The leader asks only whether the
        # model asked for is listed (``fleet.events_for``): that one is kept.
        listed = answer["models_served"]
        asked = [model for model in listed if model == answer["model"]][:1]
        verdict["answer"] = {**answer, "models_served": asked}
        said = f" (published without the {len(listed) - len(asked)} other models its server lists)"
        verdict["evidence"] += said
        excess -= len(json.dumps(listed)) - len(json.dumps(asked)) - (len(json.dumps(said)) - 2)
    reads = verdict["reads"]

    def note(dropped: int) -> str:
        return f" (published without its {dropped} oldest of {len(reads)} reads, to fit etcd)"

    excess += len(json.dumps(note(len(reads)))) - 2  # the note's longest, its quotes shared
    dropped = 0
    while dropped < len(reads) and excess > 0:
        excess -= len(json.dumps(reads[dropped], allow_nan=False)) + 2  # and its ", "
        dropped += 1
    verdict["reads"] = reads[dropped:]
    verdict["evidence"] += note(dropped)
    return {**entry, "verdict": verdict}


def _chunk(entries: list[bytes]) -> bytes:
    return b'{"verdicts":{' + b",".join(entries) + b"}}"


def parse_publication(member: str, document: object) -> dict[str, Published]:
    """A member's publication by backend; an entry that cannot be read is kept as such
    (it becomes doubt at the leader, with the reason), never dropped."""
    if not isinstance(document, dict) or not isinstance(document.get("verdicts"), dict):
        return {}
    published = {}
    for name, entry in document["verdicts"].items():
        where = f"{member}: {name}"
        try:
            table = _table(entry, where)
            serial = _whole(table, "serial", where)
            examined = None if table.get("examined") is None else _whole(table, "examined", where)
            verdict = None
            if examined is None or table.get("verdict") is not None:
                verdict = verdict_from_dict(table.get("verdict"), where)
            url, reading_at = table.get("url"), table.get("reading_at")
            for key, value in (("url", url), ("reading_at", reading_at)):
                if value is not None and not isinstance(value, str):
                    raise TypeError(f"{where}: {key} is {type(value).__name__}, not text")
            published[str(name)] = Published(
                member, serial, verdict, examined=examined, url=url, reading_at=reading_at
            )
        except (ValueError, TypeError, OverflowError, RecursionError) as exc:
            # Another member's text (another version's, a hand's): whatever cannot be read
            # is that entry's problem; the leader's settle goes on.
            published[str(name)] = Published(member, -1, None, printable(str(exc)))
    return published


# Members remembered per backend in ``Intake.settled``: a fleet whose member names
# change (pods) would grow it by a name per deploy.
SETTLED_MEMBERS = 8


@dataclass(slots=True)
class Intake:
    """The leader's memory of others' verdicts since it took the lead: which it settled,
    and when (its monotonic clock) each backend last had news. A new leader starts a new
    one, and takes what is published then as already settled by its predecessor: at
    worst each member's verdict of a backend published then goes unsettled (one, or one
    of each member publishing it while its share moves), never one settled twice (two
    failures counted for one would condemn early)."""

    started: float
    # The longest a reader may examine a backend without deciding (its max_check_time):
    # past it since the last verdict, a growing count is no news. A member that keeps
    # starting its reads over (a crash loop under the same name) would otherwise keep an
    # undecided backend fresh for ever, a wedge in it never proven nor doubted.
    undecided_for: float
    # By backend, the serial last settled of each member that published one: a share
    # that moved away and back (a member cut off past its lease, and back still
    # publishing a verdict it has not replaced) is no news of the member it came back
    # to. The newest ``SETTLED_MEMBERS`` members' of each.
    settled: dict[str, dict[str, int]] = field(default_factory=dict)
    examined: dict[str, tuple[str, int]] = field(default_factory=dict)  # as last heard
    news_at: dict[str, float] = field(default_factory=dict)  # of others' backends only
    verdict_at: dict[str, float] = field(default_factory=dict)  # likewise
    primed: bool = False


@dataclass(frozen=True, slots=True)
class Taken:
    verdicts: dict[str, Verdict]  # by backend: to settle this wait
    stale: tuple[str, ...]  # backends given a doubt verdict for want of news
    # Where each published verdict was read, when its member said: a reload may have
    # moved the backend since, on that member or on the leader.
    urls: dict[str, str] = field(default_factory=dict)


def take_published(
    intake: Intake,
    owners: Mapping[str, str],
    published: Mapping[str, Mapping[str, Published]],
    now: float,
    stale_after: float,
    addresses: Mapping[str, str] | None = None,
) -> Taken:
    """The verdicts to settle for the backends others read (``owners``: backend → the
    member whose share it is now), each at most once.

    ``addresses``: where the leader's config has each backend. A verdict read, or
    examinations made, at another address (the two members' configs differ) are no
    news of it: counted as news, they kept it from doubt while settle dropped every such
    verdict, so an address nobody read stayed serving for as long as the configs
    differed.

    A backend's verdict is taken from its owner's publication, else from whichever
    member published one (the share just moved). No news of it (a new verdict, or more
    examinations by its reader, for ``intake.undecided_for`` after the last verdict at
    most) for ``stale_after`` since the last, or since it became
    another's share (this leader's start, for those that were then): a ``stalled``
    verdict saying so, every wait until news comes. A backend that became this leader's
    own is no longer timed here: its own reads judge it.
    """
    for name in [name for name in intake.news_at if name not in owners]:
        del intake.news_at[name]
        intake.verdict_at.pop(name, None)
    if addresses is not None:
        # Nor a backend the config no longer names and no member publishes any more: kept,
        # a fleet whose names change (pods) grew the intake by a name a deploy for as long
        # as this leader led. One still published keeps its settled serial: named again (a
        # reload undone), its last verdict was settled a second time.
        still_published = {name for by in published.values() for name in by}
        gone = [name for name in intake.settled if name not in addresses]
        gone += [name for name in intake.examined if name not in addresses]
        for name in set(gone) - still_published:
            intake.settled.pop(name, None)
            intake.examined.pop(name, None)
    addresses = addresses or {}
    verdicts: dict[str, Verdict] = {}
    urls: dict[str, str] = {}
    stale = []
    for name, owner in owners.items():
        found = published.get(owner, {}).get(name)
        if found is None:
            others = [by[name] for _, by in sorted(published.items()) if name in by]
            found = others[0] if others else None
        timed_from = now if intake.primed else intake.started
        intake.news_at.setdefault(name, timed_from)
        intake.verdict_at.setdefault(name, timed_from)
        news = False
        address = addresses.get(name)
        read_elsewhere = found is not None and _apart(found.url, address)
        reading_elsewhere = found is not None and _apart(found.reading_at, address)
        if found is not None and found.examined is not None and not reading_elsewhere:
            heard = (found.member, found.examined)
            reading_on = intake.examined.get(name) != heard  # its reader reads on, undecided
            news = reading_on and now - intake.verdict_at[name] < intake.undecided_for
            intake.examined[name] = heard
        if not intake.primed:
            # Any member's then, not only the one taken: a share may have just moved.
            for by in published.values():
                early = by.get(name)
                if early is not None and early is not found and early.verdict is not None:
                    _settle(intake, name, early)
        if (
            found is not None
            and not read_elsewhere
            and found.verdict is not None
            and intake.settled.get(name, {}).get(found.member) != found.serial
        ):
            _settle(intake, name, found)
            intake.verdict_at[name] = now
            news = True
            if intake.primed:  # else the former leader may have settled it already
                verdicts[name] = found.verdict
                if found.url is not None:
                    urls[name] = found.url
        if news:
            intake.news_at[name] = now
            continue
        age = now - intake.news_at[name]
        if age >= stale_after:
            stale.append(name)
            elsewhere = read_elsewhere or reading_elsewhere
            verdicts[name] = doubt(owner, found, age, address if elsewhere else None)
    intake.primed = True
    return Taken(verdicts, tuple(stale), urls)


def _settle(intake: Intake, name: str, found: Published) -> None:
    """``found``'s serial as the one of its member last settled for ``name``."""
    by_member = intake.settled.setdefault(name, {})
    by_member.pop(found.member, None)  # the newest last
    by_member[found.member] = found.serial
    for member in list(by_member)[:-SETTLED_MEMBERS]:
        del by_member[member]


def _apart(said: str | None, address: str | None) -> bool:
    """Whether a member said it read at another server than the leader's address
    (compared as ``cycle`` compares them: written another way is the same server,
    ``same_server``); an unsaid one is not apart."""
    return said is not None and address is not None and other_server(said, address)


def doubt(
    owner: str, found: Published | None, seconds: float, address: str | None = None
) -> Verdict:
    """The verdict for a backend nobody has read lately: doubt, with who should have.
    ``address``: where the leader has it, when the member read it elsewhere."""
    if found is None:
        why = f"no member has published a verdict of it; {owner} reads it"
    elif address is not None:
        where = found.reading_at if _apart(found.reading_at, address) else found.url
        why = (
            f"{found.member} reads it at {where}, not at {address} as this leader's config "
            "has it: the members' configs differ"
        )
    elif found.verdict is None and found.problem:
        why = f"{found.member} published one that cannot be read ({found.problem})"
    elif found.verdict is None:
        why = (
            f"{found.member} published {found.examined} examinations of it, none decided, "
            "and has examined it no more since, or for longer than a reader may"
        )
    else:
        why = f"{owner} reads it; the newest published is {found.member}'s, already settled"
    evidence = (
        f"stalled: no fresh verdict or examination for {seconds:.0f} s (sharded reads): {why}"
    )
    return Verdict(VerdictKind.STALLED, healthy=False, evidence=printable(evidence))
