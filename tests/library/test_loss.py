"""How a hold and a session are lost, through both faces, against real etcd: the typed
reason (``conch.core.loss.LossReason``) each fault path gives, the log events it writes,
and the loss rule (a late keepalive alone loses nothing before the lease's earliest
expiry; a waiter's session is lost only when etcd says its lease is gone)."""

from __future__ import annotations

import logging
from typing import Any

import pytest

import conch
from conch.core.loss import Loss, LossReason
from conch.etcd import Client, kv, lease
from tests.conftest import sema_keys
from tests.library.test_parity import Face, _poll, face, run, said_here

__all__ = ["face"]  # the fixture, imported for pytest


def lost_reason(hold: Any) -> object:
    """What the hold was lost with: ``conch.Hold.lost.reason``, ``conch.aio.Hold.reason``."""
    return hold.reason if hasattr(hold, "reason") else hold.lost.reason


def session_reason(session: Any) -> object:
    """Why the session was lost (None while it is not), through either face."""
    if isinstance(session, conch.Session):
        return session.lost.reason if session.lost.is_set() else None
    return session.reason


def loss_events(caplog: pytest.LogCaptureFixture, name: str) -> list[str]:
    """The conch log's events of trouble (warnings and errors) of this test's, in order."""
    return [event for event, _ in said_here(caplog, name, logging.WARNING)]


def test_a_lease_revoked_by_hand_loses_the_hold_as_lease_not_found(
    face: Face, client: Client, name: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="conch")

    async def scenario(fclient: Any) -> None:
        hold = await face.acquire(face.semaphore(fclient, name, max=1, ttl=5), timeout=10)
        lease.revoke(client, hold.lease_id)
        await face.wait_lost(hold)
        # The guard's watch may see our key go before the keepalive hears of the lease:
        # either way the loss was seen in etcd itself.
        said = lost_reason(hold)
        assert Loss.of(said) in (LossReason.LEASE_NOT_FOUND, LossReason.KEY_DELETED), said
        assert isinstance(said, Loss) and said.reason.slot_taken
        session = hold.session
        await _poll(lambda: session_reason(session) is not None, "the session's loss")
        gone = session_reason(session)
        assert isinstance(gone, Loss) and gone.reason is LossReason.LEASE_NOT_FOUND, gone
        assert str(gone) == "lease expired or was revoked"
        await face.release(hold)

    run(face, scenario)
    assert loss_events(caplog, name) == ["lost"]


def test_a_key_deleted_by_hand_loses_the_hold_as_key_deleted(
    face: Face, client: Client, name: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="conch")

    async def scenario(fclient: Any) -> None:
        hold = await face.acquire(face.semaphore(fclient, name, max=1, ttl=30), timeout=10)
        called: list[object] = []
        hold.on_lost(called.append)
        [key] = sema_keys(client, name)
        kv.delete(client, key.key)
        await face.wait_lost(hold)
        said = lost_reason(hold)
        assert isinstance(said, Loss) and said.reason is LossReason.KEY_DELETED, said
        assert said.reason.slot_taken
        # on_lost's callback gets the Loss itself, its reason with it (the docs branch on it)
        await _poll(lambda: called, "the on_lost callback")
        [given] = called
        assert isinstance(given, Loss) and given.reason is LossReason.KEY_DELETED, repr(given)
        await face.release(hold)

    run(face, scenario)
    assert loss_events(caplog, name) == ["lost"]


def test_a_guarded_write_after_the_key_is_deleted_loses_the_hold_as_key_deleted(
    face: Face, client: Client, name: str
) -> None:
    async def scenario(fclient: Any) -> None:
        hold = await face.acquire(face.semaphore(fclient, name, max=1, ttl=30), timeout=10)
        [key] = sema_keys(client, name)
        kv.delete(client, key.key)
        with pytest.raises(conch.HoldLost):
            await face.put(hold, f"{name}-data".encode(), b"x")
        said = lost_reason(hold)
        assert isinstance(said, Loss) and said.reason is LossReason.KEY_DELETED, said
        await face.release(hold)

    run(face, scenario)


def test_a_loss_is_a_string_with_its_reason() -> None:
    loss = Loss(LossReason.KEY_DELETED, "our key was deleted")
    assert loss == "our key was deleted" and loss.reason is LossReason.KEY_DELETED
    within = loss.within("session lost: ")
    assert str(within) == "session lost: our key was deleted"
    assert within.reason is LossReason.KEY_DELETED
    assert Loss.of("some text") is None
    assert not LossReason.NO_KEEPALIVE.slot_taken
