"""A session: one lease, kept alive, and the moment it is lost (contract section 3). The
keepalive thread holds only the session's keeper (the lease and its loss), never the
Session, so a Session nobody references is noticed (``weakref.finalize``) and revoked."""

from __future__ import annotations

import contextlib
import threading
import time
import warnings
import weakref
from collections.abc import Callable
from typing import Generic, TypeVar

from conch import log
from conch.core.loss import Loss
from conch.core.session import SendKeepalive, SessionAction, SessionMachine, WakeAt
from conch.errors import EtcdError, UsageError
from conch.etcd import lease
from conch.etcd.client import Client
from conch.flag import Flag
from conch.timer import Cancellable, Handle, Scheduler, listen, timer_for

MAX_LEASE_TTL = 9_000_000_000  # seconds: etcd refuses longer leases

KeeperT = TypeVar("KeeperT", bound="Keeper")


def check_ttl(ttl: int) -> None:
    """Raise UsageError unless ``ttl`` is whole seconds, 1 to MAX_LEASE_TTL."""
    if type(ttl) is not int or not 1 <= ttl <= MAX_LEASE_TTL:
        raise UsageError(f"bad ttl {ttl!r}: want whole seconds, 1 to {MAX_LEASE_TTL}")


def check_client(client: object, kind: type = Client, face: str = "conch") -> None:
    """Raise UsageError unless ``client`` is a ``kind``, the Client of ``face``."""
    if not isinstance(client, kind):
        raise UsageError(f"bad client {client!r}: want a {face}.Client ({face}.connect(...))")


class Keeper:
    """A lease and its SessionMachine (``conch.core.session``: the keepalive schedule, E,
    the loss decision), executed on ``timer`` for either face, which gives the rest."""

    send: Callable[[float], None]  # one keepalive, its deadline; its outcome to ``settle``
    declare_lost: Callable[[Loss], None]
    tell: Callable[[Callable[[Loss], None], Loss], None]  # a listener: a failure is logged
    dropped: Callable[[], None]  # its Session was collected unclosed: revoke the lease

    def __init__(self, lease_id: int, ttl: int, granted_at: float, timer: Scheduler) -> None:
        self.lease_id = lease_id
        self.machine = SessionMachine(ttl, granted_at)
        self.expiry_listeners: dict[object, Callable[[Loss], None]] = {}
        self.timer = timer
        self.next_wake: Cancellable = Handle(0.0, 0, None)  # none yet: a cancel does nothing

    def execute(self, actions: list[SessionAction]) -> None:
        for action in actions:
            if isinstance(action, WakeAt):
                self.next_wake.cancel()
                self.next_wake = self.timer.call_later(action.at - time.monotonic(), self.wake)
            elif isinstance(action, SendKeepalive):
                self.send(action.deadline)
            elif action.lost:
                self.declare_lost(action.loss)
            else:
                for listener in tuple(self.expiry_listeners.values()):
                    self.tell(listener, action.loss)

    def wake(self) -> None:
        self.execute(self.machine.wake(time.monotonic()))

    def settle(self, sent: float, outcome: lease.Outcome) -> None:
        self.execute(self.machine.settle(sent, time.monotonic(), outcome))

    def stop(self) -> None:
        self.machine.close()
        self.next_wake.cancel()

    def collected(self, face: str) -> None:
        # Its Session collected unclosed: warn, as Python does for an unclosed file.
        said = f"{face} session (lease {self.lease_id:x}) dropped without close(); revoking it"
        warnings.warn(said, ResourceWarning, stacklevel=2)
        log.warning("session-dropped", lease=f"{self.lease_id:x}")
        self.dropped()


class _Keeper(Keeper):
    """On the client's keepalive thread (``lease.KeepAlives.timer``), which makes no call
    that waits on etcd: one session's slow step never holds back another's loss."""

    def __init__(self, client: Client, lease_id: int, ttl: int, granted_at: float) -> None:
        self.keepalives = lease.keepalives_for(client)
        super().__init__(lease_id, ttl, granted_at, self.keepalives.timer)
        self.client = client
        self.lost = Flag("session-lost")
        self.listeners: dict[object, Callable[[], None]] = {}
        # The client's close() revokes a lease still open on it: its keys go now, not at TTL.
        self.forget_client = client.on_close(self.client_closing)

    def client_closing(self, seconds: float) -> None:
        if not self.machine.closed:
            self.close(seconds)

    def send(self, deadline: float) -> None:
        sent = time.monotonic()
        self.keepalives.refresh(self.lease_id, deadline, lambda got: self.answered(sent, got))

    def answered(self, sent: float, outcome: lease.Outcome) -> None:
        if self.machine.closed:
            self.keepalives.forget(self.lease_id)  # closed while it was under way
            return
        # Scheduled before the listeners run, so that none of them can stop the keepalives.
        self.settle(sent, outcome)
        if not isinstance(outcome, EtcdError):
            for listener in tuple(self.listeners.values()):
                self.tell(listener)

    def declare_lost(self, reason: Loss) -> None:
        if not self.machine.closed:  # close() may come from another thread meanwhile
            self.keepalives.forget(self.lease_id)
            self.lost.set(reason)

    def tell(self, listener: Callable[..., None], *args: object) -> None:
        try:
            listener(*args)
        except Exception as exc:  # one embedder's bug must not end the others' calls
            log.error("keepalive-listener-failed", listener=repr(listener), error=repr(exc))

    def dropped(self) -> None:
        self.stop()  # and revoke from the client's timer thread, not the collector's
        timer_for(self.client).call_later(0, lambda: self.close(None))

    def close(self, timeout: float | None) -> bool:
        self.stop()
        self.forget_client()
        try:
            lease.revoke(self.client, self.lease_id, timeout)
        except EtcdError as exc:
            log.warning("revoke-failed", lease=f"{self.lease_id:x}", error=str(exc))
            return False
        finally:  # after the revoke, which a waiter waits for (the machine is closed)
            self.keepalives.forget(self.lease_id)
        return True


class SessionBase(Generic[KeeperT]):
    """Both faces' Sessions: the lease's figures, from its keeper, and the claims."""

    def __init__(self, client: object, ttl: int, kind: type = Client, face: str = "conch") -> None:
        check_client(client, kind, face)
        check_ttl(ttl)
        self.ttl = ttl
        self._face = face
        self._keeper: KeeperT | None = None
        self._claims: set[bytes] = set()
        self._claims_lock = threading.Lock()
        self._suffix = 0  # the last suffix given to a second key of one semaphore

    def _keep(self, keeper: KeeperT) -> None:
        keeper.execute(keeper.machine.start())  # RuntimeError: no keepalive thread to be had
        self._keeper = keeper  # etcd counts from receiving the grant: alive to its send + TTL
        self._finalizer = weakref.finalize(self, keeper.collected, self._face)
        self._finalizer.atexit = False  # at exit the lease simply expires after its TTL
        asked, self.ttl = self.ttl, keeper.machine.ttl
        log.info("session", lease=f"{keeper.lease_id:x}", ttl=f"{self.ttl}s")
        if self.ttl != asked:  # etcd's minimum TTL is 1.5 election timeouts, 2 s by default
            log.warning("ttl-raised", asked=f"{asked}s", granted=f"{self.ttl}s", by="etcd")

    def _closing(self) -> KeeperT:
        keeper = self._kept  # UsageError if never opened; else it has its finalizer
        self._finalizer.detach()
        return keeper

    @property
    def _kept(self) -> KeeperT:
        if self._keeper is None:
            raise UsageError("session not open: await it or use async with")
        return self._keeper

    @property
    def lease_id(self) -> int:
        return self._kept.lease_id

    @property
    def interval(self) -> float:
        """Seconds between keepalives (TTL/3)."""
        return self._kept.machine.interval

    @property
    def alive_until(self) -> float:
        """``time.monotonic()`` until which the lease is alive for sure (the last confirmed
        keepalive's send time + TTL)."""
        return self._kept.machine.alive_until

    def certainly_alive(self) -> bool:
        """Whether the lease is alive for sure now: not lost, not closed (a hold left on a shared
        session closed under it is no longer ours), and etcd's countdown from our last confirmed
        keepalive not run out (a process frozen past its TTL fails this)."""
        return self._kept.machine.certainly_alive(time.monotonic())

    def _claim(self, key: bytes, many: bool) -> bytes:
        """Our key on this lease: ``key``, or with ``many`` (a key named by the lease, so any
        number of holds of one semaphore fit on one session) the first free of ``key``,
        ``key-1``, ``key-2``, ... Raises UsageError for a second ``key`` without ``many``."""
        with self._claims_lock:
            claimed = key
            while claimed in self._claims:
                if not many:  # --spread: one key per host, so one hold per session
                    raise UsageError(
                        f"session {self.lease_id:x} already waits for or holds "
                        f"{key.decode()!r}: one spread hold per semaphore per session"
                    )
                self._suffix += 1
                claimed = key + b"-%d" % self._suffix
            self._claims.add(claimed)
            return claimed

    def _unclaim(self, key: bytes) -> None:
        with self._claims_lock:
            self._claims.discard(key)


class Session(SessionBase[_Keeper], contextlib.AbstractContextManager["Session"]):
    """One etcd lease of ``ttl`` seconds (Lease.LeaseGrant), refreshed every TTL/3 (up to
    SEND_GRID early) on the client's one LeaseKeepAlive stream from its keepalive thread (no
    thread per session). Raises Unavailable (or another EtcdError) when LeaseGrant fails,
    Interrupted when ``interrupt`` is set while it retries. ``lost`` (a Flag) is set when
    etcd says the lease is gone (TTL <= 0; its ``reason``: a ``conch.core.loss.Loss``,
    LossReason.LEASE_NOT_FOUND); an unanswered keepalive is sent again, with backoff, and
    loses nothing by itself: past ``alive_until`` unconfirmed the holds on it are lost
    (``on_expired``), the session and a waiter on it live on. ``close()`` (or leaving
    ``with``) revokes the lease: every key on it goes at once; one dropped unclosed is
    revoked when collected (ResourceWarning). Shared (``Semaphore.acquire(session=...)``), a
    hold releases by deleting its own key and the session's loss loses every hold on it, of
    every semaphore at once; holds of one semaphore are keys of their own on the lease::

        with conch.Session(client, ttl=10) as session:
            with sema_a.acquire(timeout=5, session=session), sema_b.acquire(session=session):
                ...
    """

    def __init__(self, client: Client, ttl: int = 10, interrupt: Flag | None = None) -> None:
        super().__init__(client, ttl)
        self.client = client
        asked = time.monotonic()
        granted = lease.grant(client, ttl, interrupt=interrupt)
        keeper = _Keeper(client, granted.id, granted.ttl, asked)
        self.lost = keeper.lost
        try:
            self._keep(keeper)
        except BaseException:  # no keepalive thread to be had: leave no lease behind
            keeper.close(None)
            raise

    def on_expired(self, listener: Callable[[Loss], None]) -> Callable[[], None]:
        """Call ``listener(loss)`` (LossReason.NO_KEEPALIVE: a hold on the session is lost) each
        time ``alive_until`` passes with no keepalive confirmed since, on the client's keepalive
        thread: it must not block. Returns the function that removes it."""
        return listen(self._kept.expiry_listeners, listener)

    def on_keepalive(self, listener: Callable[[], None]) -> Callable[[], None]:
        """Call ``listener()`` after every confirmed keepalive, once ``alive_until`` has moved, on
        the client's keepalive thread (shared by its sessions, and ``lost``'s callbacks): it must
        not block (a heartbeat, a flag, ``loop.call_soon_threadsafe``); one that raises is logged.
        Returns the function that removes it."""
        return listen(self._kept.listeners, listener)

    def close(self, timeout: float | None = None) -> bool:
        """Stop the keepalives and revoke the lease (Lease.LeaseRevoke), waiting at most
        ``timeout`` seconds (default: the client's request timeout). Returns False when the
        revoke could not be confirmed (the lease then expires after its TTL)."""
        return self._closing().close(timeout)

    def __exit__(self, *exc: object) -> None:
        self.close()
