"""The session machine (``conch.core.session``) on its own inputs: the keepalive schedule on
SEND_GRID, the earliest expiry E, and the loss rule (late keepalives lose nothing; E passing
unconfirmed is Expired, for holds; only etcd saying the lease is gone is Expired(lost=True),
for the session). The same machine runs in both faces, against real etcd, in
tests/faults/test_outage.py and test_loss.py."""

from __future__ import annotations

from conch.core.loss import LossReason
from conch.core.session import (
    KEEPALIVE_RETRY,
    KEEPALIVE_RETRY_CAP,
    SEND_GRID,
    Expired,
    SendKeepalive,
    SessionAction,
    SessionMachine,
    WakeAt,
    keepalive_margin,
)
from conch.errors import LeaseNotFound, Unavailable

NO_ANSWER = Unavailable("no answer")


def wake_at(actions: list[SessionAction]) -> float:
    (wake,) = [a for a in actions if isinstance(a, WakeAt)]
    return wake.at


def test_the_first_keepalive_is_due_one_interval_after_the_grant_on_the_grid() -> None:
    machine = SessionMachine(ttl=9, granted_at=100.2)
    at = wake_at(machine.start())
    assert at == 103.125  # 103.2 brought forward onto the 0.375 s grid (9 / 3 / 8)
    actions = machine.wake(at)
    (send,) = [a for a in actions if isinstance(a, SendKeepalive)]
    assert send.deadline == at + 3 + keepalive_margin(9)
    assert wake_at(actions) == machine.alive_until == 109.2  # E, nothing else to do


def test_an_answer_moves_e_to_its_send_time_plus_the_ttl_and_the_next_send_on() -> None:
    machine = SessionMachine(ttl=30, granted_at=0.0)
    machine.start()
    machine.wake(9.9)
    actions = machine.settle(sent=9.9, now=9.95, outcome=30)
    assert machine.alive_until == 39.9
    assert wake_at(actions) == 19.5  # 19.9 on the 0.5 s grid
    assert SEND_GRID == 0.5


def test_unanswered_keepalives_are_sent_again_with_backoff_to_a_cap_and_lose_nothing() -> None:
    machine = SessionMachine(ttl=10, granted_at=0.0)
    machine.start()
    now, pauses = 3.0, []
    machine.wake(now)
    while now < 9.0:
        now += 0.5
        at = wake_at(machine.settle(now, now, NO_ANSWER))
        pauses.append(at - now)
        now = at
        assert any(isinstance(a, SendKeepalive) for a in machine.wake(now))
    assert pauses[0] == KEEPALIVE_RETRY and max(pauses) == KEEPALIVE_RETRY_CAP
    assert machine.lost is None and machine.certainly_alive(now)


def test_e_passing_unconfirmed_is_expired_once_then_a_late_answer_rearms_it() -> None:
    machine = SessionMachine(ttl=6, granted_at=0.0)
    machine.start()
    machine.wake(2.0)  # sent, never answered
    actions = machine.settle(2.0, 5.0, NO_ANSWER)
    assert wake_at(actions) <= 6.0
    told = machine.wake(6.0)
    (expired,) = [a for a in told if isinstance(a, Expired)]
    assert expired.loss.reason is LossReason.NO_KEEPALIVE
    assert not machine.certainly_alive(6.0) and machine.lost is None
    assert not any(isinstance(a, Expired) for a in machine.wake(6.5))
    machine.settle(sent=6.5, now=6.6, outcome=6)  # the lease lived through it
    assert machine.certainly_alive(7.0)
    assert any(isinstance(a, Expired) for a in machine.wake(12.5))


def test_only_etcd_saying_the_lease_is_gone_loses_the_session() -> None:
    machine = SessionMachine(ttl=10, granted_at=0.0)
    machine.start()
    machine.wake(3.0)
    (lost,) = machine.settle(3.0, 3.05, LeaseNotFound("lease gone"))
    assert isinstance(lost, Expired) and lost.lost
    assert lost.loss.reason is LossReason.LEASE_NOT_FOUND
    assert machine.lost is lost.loss and not machine.certainly_alive(3.1)
    assert machine.wake(4.0) == [] and machine.settle(3.0, 4.1, 10) == []


def test_a_closed_session_asks_for_nothing() -> None:
    machine = SessionMachine(ttl=10, granted_at=0.0)
    machine.start()
    machine.close()
    assert machine.wake(3.5) == [] and machine.settle(3.5, 4.0, NO_ANSWER) == []
    assert not machine.certainly_alive(1.0)
