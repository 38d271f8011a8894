"""Loud loss and fencing for services that embed the library: ``Hold.check()``, HoldLost on
leaving the block, the WARNING, and the guarded write."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import os
import signal
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path

import pytest

import conch
from conch.etcd import Client, kv, lease
from tests.conftest import DEADLINE, poll, sema_keys
from tests.etcd_server import EtcdCluster

ROOT = Path(__file__).resolve().parents[2]


def test_check_and_leaving_the_block_raise_after_an_outside_revoke(
    client: Client, name: str, caplog: pytest.LogCaptureFixture
) -> None:
    sema = conch.Semaphore(client, name, max=2, ttl=5)
    reasons: list[str] = []
    caplog.set_level(logging.WARNING, logger="conch")
    with pytest.raises(conch.HoldLost) as raised, sema.acquire(timeout=10) as hold:
        hold.check()  # held: no exception
        hold.on_lost(reasons.append)
        lease.revoke(client, hold.lease_id)
        assert hold.lost.wait(timeout=DEADLINE)
        with pytest.raises(conch.HoldLost):
            hold.check()
    assert "lost" in str(raised.value)
    assert len(reasons) == 1
    warnings = [r for r in caplog.records if r.name == "conch" and r.levelno == logging.WARNING]
    assert any("event=lost" in r.getMessage() for r in warnings), caplog.text
    assert sema_keys(client, name) == []


def test_leaving_the_block_after_a_loss_keeps_the_bodys_own_exception(
    client: Client, name: str
) -> None:
    sema = conch.Semaphore(client, name, max=1, ttl=5)
    with pytest.raises(KeyError), sema.acquire(timeout=10) as hold:
        lease.revoke(client, hold.lease_id)
        assert hold.lost.wait(timeout=DEADLINE)
        raise KeyError("the body's own")
    assert sema_keys(client, name) == []


def test_a_hold_released_in_the_block_leaves_it_quietly_and_no_longer_checks(
    client: Client, name: str
) -> None:
    with conch.Semaphore(client, name, max=1, ttl=5).acquire(timeout=10) as hold:
        hold.release()
        with pytest.raises(conch.HoldLost, match="released"):
            hold.check()
    assert not hold.lost.is_set()
    assert sema_keys(client, name) == []


# Holds a slot, then calls hold.check() in a tight loop until it raises, and prints how long
# before that the last check passed: the process is frozen (SIGSTOP) meanwhile until its
# lease expired, and the first check after it resumes must raise, so that time spans the
# freeze. Then leaves the block, which must raise HoldLost too.
_FROZEN = textwrap.dedent(
    """
    import sys, time
    import conch

    with conch.connect(sys.argv[1]) as client:
        sema = conch.Semaphore(client, sys.argv[2], max=1, ttl=3)
        try:
            with sema.acquire(timeout=10) as hold:
                passed = time.monotonic()
                hold.check()
                print("held", flush=True)
                while True:
                    try:
                        hold.check()
                    except conch.HoldLost:
                        print(f"raised {time.monotonic() - passed:.3f}", flush=True)
                        break
                    passed = time.monotonic()
                    time.sleep(0.005)  # the checks' pace, part of the scenario
        except conch.HoldLost:
            print("exit raised", flush=True)
    """
)


def test_check_raises_the_moment_a_process_frozen_past_its_ttl_resumes(
    etcd: EtcdCluster, client: Client, name: str
) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-c", _FROZEN, etcd.endpoints, name],
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        first = proc.stdout.readline().split()
        assert first[0] == "held", first
        proc.send_signal(signal.SIGSTOP)
        # Frozen until etcd let the lease expire: our key is gone, another may hold now.
        poll(lambda: not sema_keys(client, name), what="the frozen holder's lease to expire")
        proc.send_signal(signal.SIGCONT)
        out, _ = proc.communicate(timeout=DEADLINE)
    finally:
        proc.kill()
        proc.wait()
    raised, left = out.splitlines()
    # The lease expires at most a TTL (3 s) after the last keepalive, which came at most
    # TTL/3 before the freeze: a check passed after the resume would leave well under 1 s.
    assert raised.startswith("raised ") and float(raised.split()[1]) > 1.0, out
    assert left == "exit raised"
    assert proc.returncode == 0


def test_the_guarded_write_lands_while_held_and_is_refused_after_an_outside_revoke(
    client: Client, name: str
) -> None:
    resource = f"/app/{name}/state".encode()
    sema = conch.Semaphore(client, name, max=2, ttl=5)
    with pytest.raises(conch.HoldLost), sema.acquire(timeout=10) as hold:
        written = hold.put(resource, "v1")
        found = kv.get(client, resource)
        assert found is not None and found.value == b"v1"
        assert found.mod_revision == written > hold.revision
        assert found.lease == 0  # the resource outlives the hold
        assert hold.delete(resource) > written
        assert kv.get(client, resource) is None
        hold.put(resource, b"v2")
        lease.revoke(client, hold.lease_id)
        with pytest.raises(conch.HoldLost, match="guarded write was not made"):
            hold.put(resource, b"v3")
        with pytest.raises(conch.HoldLost):
            hold.delete(resource)
    found = kv.get(client, resource)
    assert found is not None and found.value == b"v2"
    kv.delete(client, resource)


def test_the_guarded_write_is_refused_after_the_release(client: Client, name: str) -> None:
    resource = f"/app/{name}/state".encode()
    hold = conch.Semaphore(client, name, max=1, ttl=5).acquire(timeout=10)
    hold.release()
    with pytest.raises(conch.HoldLost):
        hold.put(resource, b"late")
    assert kv.get(client, resource) is None


def test_the_typed_caller_runs(etcd: EtcdCluster, client: Client, name: str) -> None:
    from tests.typed_caller import guarded_job

    loop = asyncio.new_event_loop()
    try:
        assert guarded_job(etcd.endpoints, name, loop) > 0
    finally:
        loop.close()
    assert sema_keys(client, name) == []


def test_the_security_types_and_errors_are_exported() -> None:
    from conch import errors
    from conch.etcd import client as client_module

    assert conch.TLS is client_module.TLS and conch.Credentials is client_module.Credentials
    assert conch.AuthenticationFailed is errors.AuthenticationFailed
    assert conch.TokenInvalid is errors.TokenInvalid and conch.HoldLost is errors.HoldLost


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda c, n: conch.Semaphore(c, n, max=0), "bad max 0"),
        (lambda c, n: conch.Semaphore(c, n, max=1, ttl=0), "bad ttl 0"),
        (lambda c, n: conch.Semaphore(c, n, max=1).acquire(timeout=-1), "bad timeout -1"),
        (lambda c, n: conch.Semaphore(c, n, max=1).acquire(timeout=math.nan), "bad timeout nan"),
        (lambda c, n: conch.Semaphore(c, n, max=1).acquire(timeout=math.inf), "bad timeout inf"),
        (lambda c, n: conch.connect("127.0.0.1:1", dial_timeout=-1), "bad dial_timeout -1"),
        (
            lambda c, n: conch.connect("127.0.0.1:1", request_timeout=math.nan),
            "bad request_timeout",
        ),
    ],
)
def test_bad_parameters_are_usage_errors_that_name_them(
    client: Client, name: str, make: Callable[[Client, str], object], message: str
) -> None:
    with pytest.raises(conch.UsageError) as raised:
        make(client, name)
    assert str(raised.value).startswith(message)
    assert "--" not in str(raised.value)  # the library's words, not the command's flags
    assert sema_keys(client, name) == []


def test_a_semaphore_is_immutable(client: Client, name: str) -> None:
    sema = conch.Semaphore(client, name, max=2)
    with pytest.raises(dataclasses.FrozenInstanceError):
        sema.max = 3  # type: ignore[misc]
    assert sema.prefix.endswith(b"/2/")


def test_unavailable_keeps_the_grpc_status_code() -> None:
    from tests.etcd_server import free_port

    with pytest.raises(conch.Unavailable) as raised:
        conch.connect(f"127.0.0.1:{free_port()}", dial_timeout=0.5)
    assert raised.value.code in ("UNAVAILABLE", "DEADLINE_EXCEEDED")


def test_closing_a_client_under_its_waiter_and_holder_leaves_no_key(
    etcd: EtcdCluster, client: Client, name: str
) -> None:
    """close() while a thread waits (or a hold is left open) on that client: the waiter
    ended at once with an error, but its key stayed until its lease expired, keeping its
    place ahead of every later waiter."""
    other = conch.connect(etcd.endpoints)
    holder = conch.Semaphore(client, name, max=1, ttl=30).acquire(timeout=10)
    left_open = conch.Semaphore(other, name + "-b", max=1, ttl=30).acquire(timeout=10)
    errors: list[BaseException] = []

    def wait() -> None:
        try:
            conch.Semaphore(other, name, max=1, ttl=30).acquire(timeout=DEADLINE)
        except conch.ConchError as exc:
            errors.append(exc)

    import threading

    waiter = threading.Thread(target=wait, daemon=True)
    waiter.start()
    try:
        poll(lambda: len(sema_keys(client, name)) == 2, what="the waiter queued")
        other.close()
        waiter.join(DEADLINE)
        assert not waiter.is_alive() and len(errors) == 1, errors
        # At once, not after the 30 s TTL.
        assert [k.lease for k in sema_keys(client, name)] == [holder.lease_id]
        assert sema_keys(client, name + "-b") == []
        with pytest.raises(conch.HoldLost):
            left_open.check()
    finally:
        holder.release()


@pytest.mark.parametrize("bad", [math.nan, math.inf, -1.0, 1e12])
def test_bad_timeouts_of_guarded_writes_and_session_close_are_usage_errors(
    client: Client, name: str, bad: float
) -> None:
    """nan, inf or 1e12 reached gRPC unchecked and the call waited forever; -1 ran with 1 ms."""
    hold = conch.Semaphore(client, name, max=1, ttl=5).acquire(timeout=10)
    session = conch.Session(client, ttl=5)
    try:
        with pytest.raises(conch.UsageError, match="bad timeout"):
            hold.put(f"/{name}/x", "v", timeout=bad)
        with pytest.raises(conch.UsageError, match="bad timeout"):
            hold.delete(f"/{name}/x", timeout=bad)
        with pytest.raises(conch.UsageError, match="bad timeout"):
            session.close(timeout=bad)
    finally:
        hold.release()
        session.close()


@pytest.mark.parametrize(
    ("make", "says"),
    [
        (lambda c: conch.Session(c, ttl=0), "bad ttl 0"),
        (lambda c: conch.Session(c, ttl=1.5), "bad ttl 1.5"),  # type: ignore[arg-type]
        (lambda c: conch.Session(c, ttl=10**10), "bad ttl"),
        (lambda c: conch.Session(None), "bad client None"),  # type: ignore[arg-type]
        (lambda c: conch.Semaphore(None, "n", max=1), "bad client None"),  # type: ignore[arg-type]
        (lambda c: conch.Semaphore(c, None, max=1), "bad name None"),  # type: ignore[arg-type]
        (lambda c: conch.who(c, "n", max_holders=0), "bad max_holders 0"),
    ],
)
def test_bad_session_and_semaphore_parameters_are_usage_errors(
    client: Client, make: Callable[[Client], object], says: str
) -> None:
    """A ttl of 0 became a 2 s lease, 1.5 a TypeError, 10**10 an etcd error; a None client
    was accepted, a None name an AttributeError, who(max_holders=0) an empty list."""
    with pytest.raises(conch.UsageError, match=says):
        make(client)


def test_an_interrupt_says_its_reason(client: Client, name: str) -> None:
    """An interrupt Flag set with a reason gave 'interrupted by signal 0'."""
    from conch.flag import Flag

    stop = Flag("stop")
    stop.set("shutdown requested")
    with pytest.raises(conch.Interrupted, match="shutdown requested"):
        conch.Semaphore(client, name, max=1, ttl=5).acquire(timeout=10, interrupt=stop)
    assert sema_keys(client, name) == []
