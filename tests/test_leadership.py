"""The leadership rule and the rendezvous shares, as values: no etcd, no clock."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from llmhealth import leadership
from llmhealth.leadership import (
    LeaseFacts,
    LeaseTiming,
    Standing,
    decide,
    owner,
    renewal_due,
    share_of,
)
from tests.test_metrics import FORBIDDEN, called_names, imported_modules

TIMING = LeaseTiming.for_ttl(10.0)
ROOT = Path(__file__).resolve().parent.parent


def test_default_timing_keeps_a_third_of_the_lease_in_hand() -> None:
    assert TIMING.renew_deadline == pytest.approx(10.0 * 2 / 3)
    assert TIMING.retry_period < TIMING.renew_deadline < TIMING.ttl


def test_a_timing_whose_deadline_reaches_the_lease_is_refused() -> None:
    with pytest.raises(ValueError, match="renew_deadline < ttl"):
        LeaseTiming(ttl=10.0, renew_deadline=10.0, retry_period=1.0)
    with pytest.raises(ValueError, match="retry_period < renew_deadline"):
        LeaseTiming(ttl=10.0, renew_deadline=2.0, retry_period=3.0)


def test_a_timing_with_no_retry_period_or_one_as_long_as_the_deadline_is_refused() -> None:
    # A zero retry period asks etcd in a loop; one as long as the renew deadline leaves
    # a leader no second try before it must step down.
    with pytest.raises(ValueError, match="0 < retry_period"):
        LeaseTiming(ttl=10.0, renew_deadline=6.0, retry_period=0.0)
    with pytest.raises(ValueError, match="retry_period < renew_deadline"):
        LeaseTiming(ttl=10.0, renew_deadline=6.0, retry_period=6.0)


def test_a_daemon_without_the_leader_key_is_a_standby() -> None:
    decision = decide(LeaseFacts(lease_id=7, renewed_at=100.0), TIMING, 100.5)
    assert decision.standing is Standing.STANDBY
    assert not decision.may_act
    assert decision.acts_until is None


def test_a_leader_acts_until_its_renew_deadline_and_not_a_moment_after() -> None:
    facts = LeaseFacts(lease_id=7, renewed_at=100.0, leader_since=99.0)
    inside = decide(facts, TIMING, 100.0 + TIMING.renew_deadline - 0.001)
    assert inside.may_act
    assert inside.acts_until == pytest.approx(100.0 + TIMING.renew_deadline)
    at_deadline = decide(facts, TIMING, 100.0 + TIMING.renew_deadline)
    assert at_deadline.standing is Standing.STEPPING_DOWN
    assert "past the renew deadline" in at_deadline.reason


def test_a_leader_paused_past_its_lease_steps_down_before_hearing_anything() -> None:
    # SIGSTOP at 100 s for 30 s: the first thing it sees on waking is its own clock.
    facts = LeaseFacts(lease_id=7, renewed_at=100.0, leader_since=50.0)
    decision = decide(facts, TIMING, 130.0)
    assert decision.standing is Standing.STEPPING_DOWN
    assert not decision.may_act


def test_a_leader_key_on_no_known_lease_is_never_acted_on() -> None:
    decision = decide(LeaseFacts(leader_since=1.0), TIMING, 1.0)
    assert decision.standing is Standing.STEPPING_DOWN


def test_a_leader_key_whose_lease_was_lost_is_never_acted_on_though_renewed_lately() -> None:
    # The lease id is gone (revoked, or a new one being granted) while the renewal time
    # and leader key are still remembered: nothing proves the key is held.
    decision = decide(LeaseFacts(lease_id=None, renewed_at=1.0, leader_since=1.0), TIMING, 1.5)
    assert decision.standing is Standing.STEPPING_DOWN
    assert not decision.may_act


def test_renewal_is_due_a_retry_period_after_the_last_one_was_sent() -> None:
    assert renewal_due(LeaseFacts(), TIMING, 5.0) == 5.0
    facts = LeaseFacts(lease_id=1, renewed_at=10.0)
    assert renewal_due(facts, TIMING, 10.5) == pytest.approx(10.0 + TIMING.retry_period)
    assert renewal_due(facts, TIMING, 99.0) == 99.0  # late: at once


@given(
    ttl=st.floats(min_value=2.0, max_value=120.0),
    renewed_at=st.floats(min_value=0.0, max_value=1e6),
    elapsed=st.floats(min_value=0.0, max_value=1e3),
)
def test_no_leader_ever_acts_once_its_lease_may_have_expired(
    ttl: float, renewed_at: float, elapsed: float
) -> None:
    timing = LeaseTiming.for_ttl(ttl)
    decision = decide(LeaseFacts(1, renewed_at, renewed_at), timing, renewed_at + elapsed)
    if decision.may_act:
        # etcd cannot expire the lease before renewed_at + ttl: acting ends well before.
        assert decision.acts_until is not None
        assert renewed_at + elapsed < decision.acts_until < renewed_at + ttl
    else:
        assert elapsed >= timing.renew_deadline


def test_without_a_lease_a_failing_etcd_is_retried_ever_later_up_to_a_limit() -> None:
    period = TIMING.retry_period
    waits = [
        leadership.retry_due(LeaseFacts(), TIMING, 50.0, failures, 0.0, 50.0) - 50.0
        for failures in (1, 2, 3)
    ]
    assert waits == pytest.approx([period, 2 * period, 4 * period])
    assert leadership.retry_due(
        LeaseFacts(), TIMING, 50.0, 1000, 0.0, 50.0
    ) - 50.0 == pytest.approx(leadership.BACKOFF_LIMIT * period)
    # A lease renewed more than a TTL ago is gone: nothing to keep, so it backs off too.
    gone = LeaseFacts(7, 10.0, 10.0)
    assert leadership.retry_due(
        gone, TIMING, 10.0 + TIMING.ttl, 3, 0.0, 10.0 + TIMING.ttl
    ) == pytest.approx(10.0 + TIMING.ttl + 4 * period)


def test_a_lease_past_its_renew_deadline_but_inside_its_ttl_is_retried_at_the_renewal_pace() -> (
    None
):
    # Between the renew deadline and the TTL the leader has stepped down, but etcd may
    # still hold the lease: it is renewed a retry period after the failed try, however
    # many rounds failed, rather than backed off and let lapse.
    facts = LeaseFacts(7, 0.0, None)
    now = (TIMING.renew_deadline + TIMING.ttl) / 2
    due = leadership.retry_due(facts, TIMING, now, 5, 0.0, now)
    assert due == pytest.approx(now + TIMING.retry_period)


def test_the_longest_backoff_brings_a_member_back_within_a_renew_deadline() -> None:
    # With no lease alive the wait doubles, but never past a renew deadline (jitter
    # included): a member whose etcd came back campaigns again before a leader that
    # was renewing through the outage would have to step down.
    longest = leadership.retry_due(LeaseFacts(), TIMING, 50.0, 1000, 0.999, 50.0) - 50.0
    assert longest == pytest.approx(4 * TIMING.retry_period * (1 + 0.999 * leadership.RETRY_JITTER))
    assert longest < TIMING.renew_deadline


@given(
    renewed_ago=st.floats(min_value=0.0, max_value=100.0),
    failures=st.integers(min_value=1, max_value=10_000),
    jitter=st.floats(min_value=0.0, max_value=0.999),
    leading=st.booleans(),
    took=st.floats(min_value=0.0, max_value=6.0),
)
def test_after_a_failure_etcd_is_never_asked_within_a_retry_period_nor_a_lease_let_lapse(
    renewed_ago: float, failures: int, jitter: float, leading: bool, took: float
) -> None:
    now = 0.0  # any monotonic reading; 0 keeps the waits exact in floats
    started = now - took  # the failed round's start: a slow one took its wait already
    facts = LeaseFacts(7, now - renewed_ago, now - renewed_ago if leading else None)
    due = leadership.retry_due(facts, TIMING, now, failures, jitter, started)
    longest = TIMING.retry_period * leadership.BACKOFF_LIMIT * (1 + leadership.RETRY_JITTER)
    # Within a float's rounding: due is started plus the wait, and taking started back
    # off can land one ulp short (took=0.18028310382552182 gave 1.3333333333333331).
    assert due >= now and due - started >= TIMING.retry_period - 1e-9
    assert due - started <= longest or due == now
    if renewed_ago < TIMING.ttl:
        # The lease may be alive: retried at the renewal pace from the failed try's
        # start, several tries before the renew deadline, however many rounds failed.
        assert due - started <= TIMING.retry_period * (1 + leadership.RETRY_JITTER) or due == now
        assert 3 * (due - started) < TIMING.renew_deadline or due == now


def test_a_leader_whose_renewal_failed_slowly_tries_again_before_its_deadline() -> None:
    # Waited from the end of a 5 s failed keepalive (silent endpoints), the next try came
    # at 7.7 s, past the 6.7 s renew deadline of a 10 s lease: the leader stepped down
    # where it used to renew at 6.4 s.
    facts = LeaseFacts(7, 0.0, 0.0)
    due = leadership.retry_due(facts, TIMING, 6.333, 1, 0.999, 1.333)
    assert due == 6.333  # at once: the round itself took longer than a retry period
    assert leadership.decide(facts, TIMING, due).may_act


BACKENDS = [f"gpu{i}" for i in range(60)]


def test_every_backend_has_exactly_one_reader() -> None:
    members = ["node-a", "node-b", "node-c"]
    shares = {member: share_of(member, BACKENDS, members) for member in members}
    read = [backend for share in shares.values() for backend in share]
    assert sorted(read) == sorted(BACKENDS)
    assert all(shares.values()), "60 backends over 3 members leave nobody idle"


def test_a_member_that_leaves_hands_on_only_its_own_share() -> None:
    before = {backend: owner(backend, ["a", "b", "c"]) for backend in BACKENDS}
    after = {backend: owner(backend, ["a", "b"]) for backend in BACKENDS}
    moved = {backend for backend in BACKENDS if before[backend] != after[backend]}
    assert moved == {backend for backend in BACKENDS if before[backend] == "c"}


def test_shares_do_not_depend_on_the_order_members_are_listed() -> None:
    assert share_of("b", BACKENDS, ["c", "a", "b"]) == share_of("b", BACKENDS, ["a", "b", "c"])
    assert owner("gpu1", []) is None
    # A member not yet listed still gets the share it will have once it is.
    assert share_of("d", BACKENDS, ["a", "b"]) == share_of("d", BACKENDS, ["a", "b", "d"])


def test_the_leadership_rule_does_no_io() -> None:
    source = (ROOT / "llmhealth" / "leadership.py").read_text(encoding="utf-8")
    imported = imported_modules(source)
    assert "hashlib" in imported
    assert not imported & (FORBIDDEN | {"importlib"})
    assert not called_names(source) & {"open", "__import__", "exec", "eval"}
