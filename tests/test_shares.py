"""Sharded reads as values: a verdict through JSON and back, and what a leader settles."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import replace

import pytest

from llmhealth.classify import Answer, Read, ReadProblem, Verdict, VerdictKind, decide
from llmhealth.metrics import parse_metrics
from llmhealth.shares import (
    Intake,
    Published,
    parse_publication,
    publication,
    take_published,
    verdict_from_dict,
    verdict_to_dict,
)
from llmhealth.window import CpuSample, LongestStep

Load = Callable[[str], str]
UNDECIDED = 600.0  # a reader's max_check_time and a wait, longer than these walks


def wedged_verdict(fixture_text: Load) -> Verdict:
    """A real wedge proof: three reads of a frozen engine (the dead-engine capture)."""
    reads = [
        Read(at=100.0 + 5 * index, signals=parse_metrics(fixture_text(f"vllm-0.32/{name}.txt")))
        for index, name in enumerate(("dead-1", "dead-2", "dead-3"))
    ]
    decision = decide(reads, max_reads=3)
    assert isinstance(decision, Verdict)
    return decision


def test_a_real_verdict_comes_back_from_json_as_it_was(fixture_text: Load) -> None:
    verdict = wedged_verdict(fixture_text)
    text = json.dumps(verdict_to_dict(verdict), allow_nan=False)
    assert verdict_from_dict(json.loads(text), "v") == verdict


def test_every_part_of_a_verdict_survives_the_trip() -> None:
    verdict = Verdict(
        VerdictKind.IDLE,
        healthy=True,
        evidence="idle: answered",
        running=0,
        waiting=0,
        steps_per_s=0.0,
        requests_sent=1,
        reads=(
            Read(10.0, problem=ReadProblem.UNRESPONSIVE, detail="timed out after 1 s"),
            Read(11.0, cpu=CpuSample(3.5, (12, 13), at=11.2, stopped=(13,)), sent=10.9),
        ),
        answer=Answer(12.0, True, "200", "tiny", ("tiny", "other"), timed_out=False),
        longest_step=LongestStep(0.25, "histogram"),
    )
    assert verdict_from_dict(json.loads(json.dumps(verdict_to_dict(verdict))), "v") == verdict


def test_a_read_asked_for_after_its_answer_came_is_taken_as_asked_for_when_it_came() -> None:
    """A member's read said it was sent after it was in: a freeze measured to it would
    have lasted longer than any read showed."""
    document = verdict_to_dict(
        Verdict(VerdictKind.BUSY, True, "busy", reads=(Read(11.0, sent=99.0),))
    )
    [read] = verdict_from_dict(json.loads(json.dumps(document)), "v").reads
    assert (read.at, read.sent) == (11.0, 11.0)


def test_a_verdict_not_judged_stays_not_judged_at_the_leader() -> None:
    # A member's own failure (starved, its worker lost, our key refused) came back judged:
    # news of the backend, which the leader's ledger then took.
    refused = Answer(12.0, False, "not sent: GET /v1/models answered HTTP 401", refused=True)
    verdict = Verdict(VerdictKind.IDLE, False, "idle: refused", answer=refused, judged=False)
    assert verdict_from_dict(json.loads(json.dumps(verdict_to_dict(verdict))), "v") == verdict
    older = verdict_to_dict(replace(verdict, judged=True, answer=None))
    del older["judged"]  # what a member before this change writes
    assert verdict_from_dict(older, "v").judged


def test_numbers_json_cannot_carry_are_left_unsaid_not_refused(fixture_text: Load) -> None:
    signals = parse_metrics(fixture_text("hostile/negative-and-nan.txt"))
    verdict = Verdict(VerdictKind.BUSY, True, "busy", reads=(Read(1.0, signals=signals),))
    assert json.dumps(verdict_to_dict(verdict), allow_nan=False)  # would raise on NaN


@pytest.mark.parametrize(
    ("document", "message"),
    [
        ("nope", "v: expected a table"),
        ({"kind": "sleepy", "healthy": True, "evidence": "", "requests_sent": 0}, "sleepy"),
        ({"kind": "busy", "healthy": "yes", "evidence": "", "requests_sent": 0}, "v.healthy"),
        (
            {"kind": "busy", "healthy": True, "evidence": "", "requests_sent": 0, "reads": {}},
            "v.reads",
        ),
        (
            {"kind": "busy", "healthy": True, "evidence": "", "requests_sent": 0, "reads": [{}]},
            r"v.reads\[0\].at",
        ),
    ],
)
def test_a_published_verdict_that_is_not_one_is_refused_naming_the_field(
    document: object, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        verdict_from_dict(document, "v")


def test_text_from_another_member_reaches_nobody_raw() -> None:
    document = verdict_to_dict(Verdict(VerdictKind.BUSY, True, "busy \x1b[2J now"))
    assert verdict_from_dict(document, "v").evidence == "busy \\x1b[2J now"


def test_a_published_longest_step_reaches_nobody_raw() -> None:
    """Its why goes on into the leader's state and every later window's evidence: it was
    the one text of a published verdict taken as the member wrote it."""
    step = LongestStep(2.0, "engine 0: \x1b]0;pwned\x07 gaps")
    document = verdict_to_dict(Verdict(VerdictKind.BUSY, True, "busy", longest_step=step))
    taken = verdict_from_dict(json.loads(json.dumps(document)), "v").longest_step
    assert taken == LongestStep(2.0, "engine 0: \\x1b]0;pwned\\x07 gaps")


def healthy(label: str) -> Verdict:
    return Verdict(VerdictKind.BUSY, True, f"busy: {label}")


def published(member: str, **serials: int) -> dict[str, Published]:
    return {
        name: Published(member, serial, healthy(f"{member}#{serial}"))
        for name, serial in serials.items()
    }


def test_a_new_leader_takes_what_is_published_then_as_settled_and_each_later_verdict_once() -> None:
    intake = Intake(started=0.0, undecided_for=UNDECIDED)
    owners = {"gpu1": "b", "gpu2": "b"}
    first = take_published(intake, owners, {"b": published("b", gpu1=4, gpu2=7)}, 1.0, 10.0)
    assert first.verdicts == {} and first.stale == ()  # its predecessor may have settled them
    second = take_published(intake, owners, {"b": published("b", gpu1=5, gpu2=7)}, 2.0, 10.0)
    assert second.verdicts == {"gpu1": healthy("b#5")}
    third = take_published(intake, owners, {"b": published("b", gpu1=5, gpu2=7)}, 3.0, 10.0)
    assert third.verdicts == {}  # nothing new: nothing settled twice


def test_a_backend_with_no_fresh_verdict_becomes_doubt_every_wait_until_one_comes() -> None:
    intake = Intake(started=0.0, undecided_for=UNDECIDED)
    owners = {"gpu1": "b", "gpu2": "c"}
    take_published(intake, owners, {"b": published("b", gpu1=1)}, 1.0, 10.0)
    quiet = take_published(intake, owners, {"b": published("b", gpu1=1)}, 10.5, 10.0)
    assert quiet.stale == ("gpu2",)  # c never published: stale since this leader started
    doubt = quiet.verdicts["gpu2"]
    assert (doubt.kind, doubt.healthy) == (VerdictKind.STALLED, False)
    assert "no member has published a verdict of it; c reads it" in doubt.evidence
    later = take_published(intake, owners, {"b": published("b", gpu1=1)}, 11.5, 10.0)
    assert set(later.stale) == {"gpu1", "gpu2"}
    assert (
        "b reads it; the newest published is b's, already settled"
        in later.verdicts["gpu1"].evidence
    )
    back = take_published(
        intake, owners, {"b": published("b", gpu1=2), "c": published("c", gpu2=1)}, 12.0, 10.0
    )
    assert back.stale == () and set(back.verdicts) == {"gpu1", "gpu2"}
    assert all(verdict.healthy for verdict in back.verdicts.values())


def test_what_a_member_read_at_another_address_is_no_news_and_becomes_doubt_naming_both() -> None:
    """Two members' configs give a backend two addresses: settle dropped every verdict of
    the other address, while it and the examinations there kept the backend from doubt,
    so an address nobody read stayed serving for as long as the configs differed."""
    intake = Intake(started=0.0, undecided_for=UNDECIDED)
    owners, here = {"gpu1": "b"}, {"gpu1": "http://10.0.0.1:8000"}
    there = "http://10.0.0.9:8000"

    def moved(serial: int, examined: int) -> dict[str, dict[str, Published]]:
        found = Published("b", serial, healthy(f"b#{serial}"), examined=examined, url=there)
        return {"b": {"gpu1": replace(found, reading_at=there)}}

    take_published(intake, owners, moved(1, 1), 1.0, 10.0, here)
    for at in range(2, 10):  # new verdicts and examinations every wait, all elsewhere
        taken = take_published(intake, owners, moved(at, at), float(at), 10.0, here)
        assert taken.verdicts == {} and taken.stale == (), at
    doubted = take_published(intake, owners, moved(10, 10), 10.0, 10.0, here)
    assert doubted.stale == ("gpu1",)
    assert (
        f"b reads it at {there}, not at {here['gpu1']} as this leader's config has it"
        in doubted.verdicts["gpu1"].evidence
    )
    agreed = {"b": {"gpu1": Published("b", 12, healthy("b#12"), examined=12, url=here["gpu1"])}}
    settled = take_published(intake, owners, agreed, 12.0, 10.0, here)
    assert settled.verdicts == {"gpu1": healthy("b#12")} and settled.stale == ()


def reading(member: str, **examined: int) -> dict[str, Published]:
    """A member's publication of backends it reads on without a verdict yet."""
    return {name: Published(member, 0, None, examined=count) for name, count in examined.items()}


def test_a_backend_its_reader_examines_on_undecided_is_never_doubt_until_it_stops() -> None:
    # An engine inside a long step (a young one compiling: a 300 s window) is read every
    # wait and decided only at the window's end. Timed by verdicts alone, the leader
    # settled "stalled" for it once stale_after passed, and three condemned it.
    intake = Intake(started=0.0, undecided_for=UNDECIDED)
    owners = {"young": "b"}
    for wait in range(1, 60):
        taken = take_published(intake, owners, {"b": reading("b", young=wait)}, 5.0 * wait, 10.0)
        assert taken.verdicts == {} and taken.stale == (), wait
    quiet = take_published(intake, owners, {"b": reading("b", young=59)}, 300.0, 10.0)
    assert quiet.stale == ()  # one wait without an examination: not yet
    gone = take_published(intake, owners, {"b": reading("b", young=59)}, 305.0, 10.0)
    assert gone.stale == ("young",)  # ten seconds since its reader last examined it
    assert "b published 59 examinations of it, none decided" in gone.verdicts["young"].evidence
    decided = {"b": {"young": Published("b", 1, healthy("b#1"), examined=60)}}
    assert take_published(intake, owners, decided, 306.0, 10.0).verdicts == {
        "young": healthy("b#1")
    }


def test_examinations_without_a_verdict_for_longer_than_a_reader_may_are_no_news() -> None:
    # A member that keeps starting over (a crash loop under the same name) publishes
    # counts that change every wait and never reaches the end of a window: its counts
    # kept the backend fresh for ever, a wedge there never proven nor doubted.
    intake = Intake(started=0.0, undecided_for=30.0)
    owners = {"young": "b"}
    stale_at = None
    for wait in range(1, 40):
        count = 1 + wait % 2  # 1, 2, 1, 2...: every wait a change
        taken = take_published(intake, owners, {"b": reading("b", young=count)}, 5.0 * wait, 10.0)
        if taken.stale and stale_at is None:
            stale_at = 5.0 * wait
    assert stale_at == 35.0  # counts were news up to 25 s (under 30), then 10 s of none


def test_an_undecided_entry_goes_through_json_and_an_older_leader_reads_it_as_doubt() -> None:
    (chunk,) = publication(
        {"gpu1": 2}, {"gpu1": healthy("x")}, {"gpu1": 9, "young": 4}, 4096, {"gpu1": "http://a"}
    )
    entries = parse_publication("b", json.loads(chunk))
    assert entries == {
        "gpu1": Published("b", 2, healthy("x"), examined=9, url="http://a"),
        "young": Published("b", 0, None, examined=4),
    }
    # A leader of the version before reads "verdict" alone: an entry without one is
    # unreadable to it, which is doubt once stale, as a silent member was to it.
    without = json.loads(chunk)
    del without["verdicts"]["young"]["examined"]
    assert parse_publication("b", without)["young"].problem


def test_a_verdict_is_taken_with_the_address_its_member_read_it_at() -> None:
    # Without it the leader settled a verdict against its own idea of the backend's
    # address: a member that read the old one (its config not yet reloaded, or reloaded
    # after it read) condemned the server at the new one.
    (chunk,) = publication({"gpu1": 3}, {"gpu1": healthy("x")}, {}, 4096, {"gpu1": "http://old"})
    intake = Intake(started=0.0, undecided_for=60.0)
    take_published(intake, {"gpu1": "b"}, {"b": {}}, 1.0, 10.0)
    taken = take_published(
        intake, {"gpu1": "b"}, {"b": parse_publication("b", json.loads(chunk))}, 2.0, 10.0
    )
    assert (taken.verdicts, taken.urls) == ({"gpu1": healthy("x")}, {"gpu1": "http://old"})
    older = json.loads(chunk)
    del older["verdicts"]["gpu1"]["url"]  # a member of the version before says nothing
    assert parse_publication("b", older)["gpu1"].url is None
    older["verdicts"]["gpu1"]["url"] = 7
    assert "url" in parse_publication("b", older)["gpu1"].problem


def test_a_backend_that_just_became_another_members_share_gets_time_to_be_read() -> None:
    # The leader read gpu1 itself for an hour; a member joins and gpu1 is its share
    # now. Timed from the leader's start, it was doubt at once, before the new reader
    # had read it even once.
    intake = Intake(started=0.0, undecided_for=UNDECIDED)
    take_published(intake, {"gpu2": "c"}, {"c": published("c", gpu2=1)}, 1.0, 10.0)
    joined = {"gpu1": "b", "gpu2": "c"}
    news = {"c": published("c", gpu2=2)}
    assert take_published(intake, joined, news, 3600.0, 10.0).stale == ()
    assert take_published(intake, joined, news, 3609.0, 10.0).stale == ()
    assert take_published(intake, joined, news, 3610.0, 10.0).stale == ("gpu1", "gpu2")
    # Back to the leader and out again: timed afresh, not from what it last heard.
    take_published(intake, {"gpu2": "c"}, {"c": published("c", gpu2=3)}, 3611.0, 10.0)
    assert take_published(intake, joined, {"c": published("c", gpu2=4)}, 4000.0, 10.0).stale == ()


def test_a_share_that_just_moved_is_taken_from_its_former_reader() -> None:
    intake = Intake(started=0.0, undecided_for=UNDECIDED, primed=True)
    taken = take_published(intake, {"gpu1": "c"}, {"b": published("b", gpu1=3)}, 1.0, 10.0)
    assert taken.verdicts == {"gpu1": healthy("b#3")}


def test_a_publication_says_where_each_verdict_was_read_and_where_reading_goes_on() -> None:
    verdicts = {"gpu1": healthy("b#3")}
    chunks = publication(
        {"gpu1": 3, "gpu2": 0},
        verdicts,
        {"gpu1": 9, "gpu2": 4},
        1 << 20,
        {"gpu1": "http://old:8000"},
        {"gpu1": "http://new:8000", "gpu2": "http://two:8000"},
    )
    (chunk,) = chunks
    found = parse_publication("b", json.loads(chunk))
    assert (found["gpu1"].url, found["gpu1"].reading_at) == ("http://old:8000", "http://new:8000")
    assert (found["gpu2"].url, found["gpu2"].reading_at) == (None, "http://two:8000")


def test_an_unreadable_publication_is_doubt_with_its_reason_never_health() -> None:
    (chunk,) = publication({"gpu1": 1}, {"gpu1": healthy("x")}, {"gpu1": 3}, 4096, {})
    document = json.loads(chunk)
    document["verdicts"]["gpu1"]["verdict"]["healthy"] = "very"
    entries = parse_publication("b", document)
    assert entries["gpu1"].verdict is None
    assert entries["gpu1"].examined is None  # a count beside an unreadable verdict is no news
    intake = Intake(started=0.0, undecided_for=UNDECIDED)
    taken = take_published(intake, {"gpu1": "b"}, {"b": entries}, 20.0, 10.0)
    assert taken.stale == ("gpu1",)
    assert "cannot be read" in taken.verdicts["gpu1"].evidence
    assert "expected true or false" in taken.verdicts["gpu1"].evidence
    assert parse_publication("b", "garbage") == {}


@pytest.mark.parametrize(
    ("processes", "why"),
    [([{"pid": 12}], "TypeError"), ([1e400], "OverflowError"), ([[[[12]]]], "TypeError")],
)
def test_a_publication_with_values_of_the_wrong_kind_is_doubt_not_a_dead_leader(
    processes: list[object], why: str
) -> None:
    # int() of a dict or of infinity is not a ValueError: it escaped the parse and ended
    # the leader's settle, and every leader after it, while the member kept publishing.
    sampled = Verdict(
        VerdictKind.BUSY, True, "busy", reads=(Read(11.0, cpu=CpuSample(3.5, (12,), at=11.2)),)
    )
    (chunk,) = publication({"gpu1": 1}, {"gpu1": sampled}, {}, 4096, {})
    document = json.loads(chunk)
    document["verdicts"]["gpu1"]["verdict"]["reads"][0]["cpu"]["processes"] = processes
    entries = parse_publication("b", json.loads(json.dumps(document)))
    assert entries["gpu1"].verdict is None, why
    assert entries["gpu1"].problem


def test_a_large_share_is_published_in_chunks_of_bounded_size_that_add_up(
    fixture_text: Load,
) -> None:
    verdict = wedged_verdict(fixture_text)
    verdicts = {f"gpu{index:04d}": verdict for index in range(300)}
    chunks = publication({name: 7 for name in verdicts}, verdicts, {}, 64 * 1024, {})
    entry = len(json.dumps(verdict_to_dict(verdict))) + 40
    assert len(chunks) > 1
    assert all(len(chunk) <= 64 * 1024 + entry for chunk in chunks)
    merged: dict[str, Published] = {}
    for chunk in chunks:
        merged.update(parse_publication("b", json.loads(chunk)))
    assert merged == {name: Published("b", 7, verdict) for name in verdicts}
    assert publication({}, {}, {}, 1024, {}) == [b'{"verdicts":{}}']  # an empty share clears


def test_a_member_whose_config_only_respells_the_address_is_read_at_the_same_server() -> None:
    # A reload that writes a backend's URL another way (the scheme's own port dropped, the
    # host's case) is no move: settle takes a verdict read at the old spelling (cycle's
    # text.other_server, the router's _moved). Until the member reading it reloads too (a
    # rolling rollout, or for good), the leader took its verdicts for reads elsewhere:
    # none settled, then "stalled" doubt every wait, three of which condemn a server that
    # answers, and a wedge it proved was never settled.
    intake = Intake(started=0.0, undecided_for=UNDECIDED)
    owners, here = {"gpu1": "b"}, {"gpu1": "http://gpu1.example"}
    there = "HTTP://GPU1.example:80"

    def respelled(serial: int) -> dict[str, dict[str, Published]]:
        found = Published("b", serial, healthy(f"b#{serial}"), examined=serial, url=there)
        return {"b": {"gpu1": replace(found, reading_at=there)}}

    take_published(intake, owners, respelled(1), 1.0, 10.0, here)
    for at in range(2, 12):
        taken = take_published(intake, owners, respelled(at), float(at), 10.0, here)
        assert taken.stale == (), at
        assert taken.verdicts == {"gpu1": healthy(f"b#{at}")}, at
        assert taken.urls == {"gpu1": there}  # settle compares it with same_server


def test_a_verdict_too_large_for_one_key_is_published_with_its_newest_reads_that_fit(
    fixture_text: Load,
) -> None:
    # Alone in its chunk, a frozen window of a server with many engines was larger than
    # etcd takes in one request: the publish failed there, and everything after it in the
    # member's publication was settled `stalled` by the leader (cluster test beside).
    verdict = wedged_verdict(fixture_text)
    many = replace(verdict, reads=tuple(replace(verdict.reads[-1], at=float(i)) for i in range(40)))
    one_read = len(json.dumps(verdict_to_dict(replace(verdict, reads=verdict.reads[-1:]))))
    limit = 10 * one_read
    (chunk,) = publication({"gpu1": 4}, {"gpu1": many}, {"gpu1": 9}, limit, {})
    assert len(chunk) <= limit + len(b'{"verdicts":{}}')
    found = parse_publication("b", json.loads(chunk))["gpu1"]
    assert found.verdict is not None and found.examined == 9 and found.serial == 4
    assert (found.verdict.kind, found.verdict.healthy) == (many.kind, many.healthy)
    kept = found.verdict.reads
    assert 0 < len(kept) < len(many.reads)
    assert kept == many.reads[-len(kept) :]  # the newest: the leader's baseline
    assert f"without its {len(many.reads) - len(kept)} oldest of 40 reads" in found.verdict.evidence


def test_a_verdict_whose_model_list_is_too_large_keeps_its_reads_and_the_model_asked(
    fixture_text: Load,
) -> None:
    # /v1/models of 1,000 ids of 1,024 DEL characters (1 MB, under the probe's cap) made
    # printable is 5 MB: with every read dropped the entry was still that, and etcd
    # refused the chunk (tests/test_cluster.py beside).
    served = tuple(f"m{i}" + "\\x7f" * 1024 for i in range(1000))
    answer = Answer(120.0, True, "answered", served[500], served)
    verdict = replace(wedged_verdict(fixture_text), answer=answer)
    limit = 512 * 1024
    (chunk,) = publication({"gpu1": 4}, {"gpu1": verdict}, {"gpu1": 9}, limit, {})
    assert len(chunk) <= limit + len(b'{"verdicts":{}}')
    found = parse_publication("b", json.loads(chunk))["gpu1"].verdict
    assert found is not None and found.reads == verdict.reads
    assert found.answer is not None and found.answer.models_served == (served[500],)
    assert "without the 999 other models its server lists" in found.evidence


def test_the_intake_forgets_backends_the_config_no_longer_names() -> None:
    # A fleet whose names change (pods, renamed at each deploy) grew a leader's intake by
    # a settled serial and a count of examinations per name it ever had, for as long as
    # it led.
    intake = Intake(started=0.0, undecided_for=UNDECIDED)
    for deploy in range(50):
        names = [f"pod-{deploy}-{index}" for index in range(20)]
        owners = {name: "b" for name in names}
        addresses = {name: f"http://10.0.{deploy}.{index}:8000" for index, name in enumerate(names)}
        found = {
            name: Published("b", 1, healthy(name), examined=3, url=addresses[name])
            for name in names
        }
        for at in range(2):
            take_published(intake, owners, {"b": found}, float(deploy * 10 + at), 10.0, addresses)
    kept = set(intake.settled) | set(intake.examined) | set(intake.news_at)
    assert kept == set(names), len(kept)


def test_a_verdict_settled_before_its_name_left_the_config_is_not_settled_again_on_its_return() -> (
    None
):
    # A reload that dropped a backend and one that named it again (an edit undone) while
    # its reader had published nothing newer: the intake had forgotten the settled
    # serial, and the same failure was counted a second time.
    intake = Intake(started=0.0, undecided_for=UNDECIDED)
    addresses = {"gpu1": "http://10.0.0.1:8000"}
    failed = {"gpu1": Published("b", 4, healthy("b#4"), url=addresses["gpu1"])}
    take_published(intake, {"gpu1": "b"}, {"b": {}}, 1.0, 10.0, addresses)
    settled = take_published(intake, {"gpu1": "b"}, {"b": failed}, 2.0, 10.0, addresses)
    assert settled.verdicts == {"gpu1": healthy("b#4")}
    take_published(intake, {}, {"b": failed}, 3.0, 10.0, {})  # dropped by a reload
    back = take_published(intake, {"gpu1": "b"}, {"b": failed}, 4.0, 10.0, addresses)
    assert back.verdicts == {}


def test_a_verdict_restarts_the_time_a_reader_may_examine_undecided() -> None:
    # undecided_for counts from the last verdict: examinations soon after a fresh one are
    # news, however long ago this leader started.
    intake = Intake(started=0.0, undecided_for=30.0)
    owners = {"gpu1": "b"}
    take_published(intake, owners, {"b": reading("b", gpu1=1)}, 1.0, 5.0)
    verdict = {"gpu1": Published("b", 1, healthy("x"), examined=2)}
    assert take_published(intake, owners, {"b": verdict}, 100.0, 5.0).verdicts
    more = {"gpu1": Published("b", 1, healthy("x"), examined=3)}
    assert take_published(intake, owners, {"b": more}, 110.0, 5.0).stale == ()


def test_an_answer_published_without_refused_was_not_refused() -> None:
    # An earlier member wrote no "refused": its answers were all ones the backend took.
    document = verdict_to_dict(
        Verdict(
            VerdictKind.IDLE,
            healthy=True,
            evidence="idle",
            answer=Answer(12.0, True, "200", "tiny", ("tiny",), timed_out=False),
        )
    )
    del document["answer"]["refused"]
    answer = verdict_from_dict(document, "v").answer
    assert answer is not None and answer.refused is False


def test_a_verdict_settled_before_its_share_moved_away_and_back_is_not_settled_again() -> None:
    # b read gpu1, and its failure was settled; b was cut off from etcd past its lease
    # (gpu1 went to c, whose verdict was settled), then came back still publishing that
    # same verdict (gpu1 undecided since, inside a long step). Only the newest settled
    # (member, serial) was remembered: b's old failure was settled a second time.
    intake = Intake(started=0.0, undecided_for=UNDECIDED)
    take_published(intake, {"gpu1": "b"}, {"b": {}}, 1.0, 10.0)
    first = take_published(intake, {"gpu1": "b"}, {"b": published("b", gpu1=4)}, 2.0, 10.0)
    assert first.verdicts == {"gpu1": healthy("b#4")}
    moved = take_published(intake, {"gpu1": "c"}, {"c": published("c", gpu1=9)}, 3.0, 10.0)
    assert moved.verdicts == {"gpu1": healthy("c#9")}
    both = {"b": published("b", gpu1=4), "c": published("c", gpu1=9)}
    assert take_published(intake, {"gpu1": "b"}, both, 4.0, 10.0).verdicts == {}
    assert take_published(intake, {"gpu1": "c"}, both, 5.0, 10.0).verdicts == {}
    later = {"b": published("b", gpu1=5), "c": published("c", gpu1=9)}
    assert take_published(intake, {"gpu1": "b"}, later, 6.0, 10.0).verdicts == {
        "gpu1": healthy("b#5")
    }


def test_a_new_leader_takes_every_member_s_publication_then_as_settled() -> None:
    # Two members published gpu1 when this leader took over (its share had just moved):
    # its predecessor may have settled either.
    intake = Intake(started=0.0, undecided_for=UNDECIDED)
    both = {"b": published("b", gpu1=4), "c": published("c", gpu1=9)}
    assert take_published(intake, {"gpu1": "c"}, both, 1.0, 10.0).verdicts == {}
    assert take_published(intake, {"gpu1": "b"}, both, 2.0, 10.0).verdicts == {}
