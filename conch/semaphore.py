"""The counting semaphore recipe of 04_sema.md: enqueue, rank, wait, hold, release, who.

Every holder or waiter owns one key under ``/conch/v1/sema/<name>/<max>/``, bound to its
session's lease. Keys rank by create_revision; the first ``max`` hold a slot.

How a waiter waits (no polling, no herd; docs/design.md, "Waiting", has the reasoning). The
design page says "watch the key at rank r-N"; that alone misses a release when N > 1 and
holders leave out of order (N=2, holders A B, waiter C watching A: B leaves, C stays asleep
with a slot free). So the queue has a *window*: its first ``window_size(N)`` keys, the N
holders and the ``window_size(N) - N`` waiters first in line (N + 1, at most 8).

* a waiter in the window watches the deletions under the semaphore's prefix (one etcd
  watcher, so in revision order) and knows, from one read, every key ahead of it: each
  deletion of one of them moves it up with no read, and once fewer than N are left, with no
  deletion of its own key before, it holds a slot at that revision. So the waiter that gets
  a slot gets it from the release's own event, whatever the job's length and the max, and
  nothing is read or written before its child starts;
* a waiter behind the window watches its immediate predecessor for deletion or change;
* a waiter in the window re-puts its own key under a compare on its create_revision (a
  *touch*), once, as soon as the waiter just behind it belongs in the window (fewer than
  ``window_size(N) - 1`` keys ahead of it): the change that tells that waiter to read the
  queue and join the window. The waiter that moves up makes this write, not the new holder:
  a release wakes the holder-to-be and the ``window_size(N) - N - 1`` others in the window,
  and only the last one writes, while the new holder starts its child. A waiter that got its
  slot without passing through that state (a read found it holding, or one event took
  several keys ahead of it) leaves the touch to its Hold (hold.py).

A release therefore wakes the waiters of the window and one behind it: constant work per
release, whatever the length of the queue.

The decisions are ``conch.core.waiter.Waiter``'s, a pure state machine; this module is its
threaded driver (``_Wait``): it executes the machine's actions with the etcd layer on the
calling thread and feeds back the answers, the watch notices, the deadline and the losses.
"""

from __future__ import annotations

import queue
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from conchpb.etcdserverpb import rpc_pb2

from conch import keys, log
from conch.core import codec, messages, waiter
from conch.core.waiter import WINDOW_WAITERS_CAP, window_size
from conch.errors import (
    EtcdError,
    Interrupted,
    NoSlot,
    SessionLost,
    UsageError,
)
from conch.etcd import kv, lease, status
from conch.etcd.client import Backoff, Client, check_timeout
from conch.etcd.watch import Watch, WatchNotice
from conch.flag import Flag, Mailbox, remaining
from conch.hold import WITHDRAW_TIMEOUT, Hold
from conch.identity import Identity
from conch.session import Session, check_client, check_ttl

__all__ = ["REENTRY_BACKOFF_CAP", "WINDOW_WAITERS_CAP", "Semaphore", "window_size"]

REENTRY_BACKOFF_CAP = 2.0  # seconds between attempts to re-enter after a lost session


@dataclass(frozen=True)
class Semaphore:
    """The semaphore (``name``, ``max``) on ``client``.

    ``ttl`` is the session lease TTL in whole seconds; ``spread`` keys slots by host (one
    per node); ``identity`` is what our key says about us. Immutable (``max`` is part of
    the semaphore's identity: its keys live under ``<name>/<max>/``); for another capacity
    make another Semaphore. Raises UsageError naming the bad parameter (name, max, ttl,
    the identity's host).
    """

    client: Client
    name: str
    max: int
    ttl: int = 10
    spread: bool = False
    identity: Identity = field(default_factory=Identity.current)
    prefix: bytes = field(init=False, repr=False)

    def __post_init__(self) -> None:
        keys.check_name(self.name)
        keys.check_host(self.identity.host)
        keys.check_max(self.max)
        check_client(self.client)
        check_ttl(self.ttl)
        object.__setattr__(self, "prefix", keys.sema_prefix(self.name, self.max))

    def acquire(
        self,
        timeout: float | None = None,
        interrupt: Flag | None = None,
        session: Session | None = None,
        *,
        guard: bool = True,
    ) -> Hold:
        """Wait for a slot and return the Hold.

        ``timeout`` in seconds: None waits as long as it takes, 0 tries once (``--nonblock``).
        Each etcd call inside has the client's request timeout (failover to another member
        needs it), so with etcd slow or away the wait can run over by up to that, plus
        WITHDRAW_TIMEOUT (1 s) to withdraw our key.
        ``interrupt``, when set (e.g. by a signal handler), withdraws and raises Interrupted.
        Raises NoSlot when time runs out, Unavailable when no session can be established.
        Whatever ends the wait, our key is deleted unless we hold the slot. A lost session
        while queued re-enters at the back of the queue if time allows. A ``timeout`` that
        is negative, not finite or over 10 years raises UsageError before any etcd call.

        ``session``: a ``conch.Session`` of this client to hold the slot on, shared with
        other holds (``ttl`` is then the session's). Without it the hold gets a lease of
        its own. On a shared session a loss while queued raises SessionLost (a new lease
        is the caller's call, not ours); a second wait for this semaphore on the same
        session raises UsageError while the first waits or holds.

        ``guard=False`` returns the Hold with its guard (the watch on our key, the touch that
        moves the next waiter up) not yet started: the caller must call
        ``hold.start_guard()`` at once (the supervisor does, just after the child's spawn).
        Until then a loss of the session is noticed, a deletion of our key only later.
        """
        hold = self._acquire(timeout, interrupt, session=session)
        if guard:
            hold.start_guard()
        return hold

    def _acquire(
        self, timeout: float | None, interrupt: Flag | None, session: Session | None = None
    ) -> Hold:
        """``acquire`` without starting the Hold's guard (the caller must, at once)."""
        if timeout is not None:
            check_timeout("timeout", timeout, zero=True)
        started = time.monotonic()
        deadline = None if timeout is None else started + timeout
        interrupt = interrupt or Flag("interrupt")
        if session is None:
            return _Wait(self, interrupt, deadline, started).run()
        if session.client is not self.client:
            raise UsageError("session: belongs to another client than the semaphore")
        key = self._key(session)
        session._claim(key)
        try:
            return _Wait(self, interrupt, deadline, started, session).run()
        except BaseException:
            session._unclaim(key)
            raise

    def pause_before_reentry(
        self, cause: Exception, deadline: float | None, interrupt: Flag, backoff: Backoff
    ) -> None:
        """After losing our place (a hold lost before its use, too): raise NoSlot if time is
        up, else pause (capped, jittered backoff, cut short by ``interrupt``) before
        re-entering at the back of the queue."""
        if deadline is not None and time.monotonic() >= deadline:
            raise NoSlot(f"no slot of {self.name}[{self.max}]: {cause}")
        log.warning("requeue", name=self.name, reason=str(cause))
        pause = backoff.next()
        left = remaining(deadline)
        interrupt.wait(pause if left is None else min(pause, left))

    def _key(self, session: Session) -> bytes:
        if self.spread:
            return keys.spread_key(self.name, self.max, self.identity.host)
        return keys.holder_key(self.name, self.max, session.lease_id)

    def _enqueue(self, key: bytes, lease_id: int, interrupt: Flag) -> tuple[bytes, kv.TxnResponse]:
        """Step 1 (``codec.enqueue_call``): put our key bound to the lease, create-if-absent,
        and read the first ``max`` keys in the same KV.Txn (else read the key found in our
        place). Returns the value we sent and the response."""
        value = self.identity.entering().to_json()
        call = codec.enqueue_call(
            messages.SendEnqueue(0, key, lease_id), self.prefix, self.max, value
        )
        response: kv.TxnResponse = send(self.client, call, interrupt)
        return value, response

    def _standing(self, key: bytes, revision: int, interrupt: Flag) -> codec.Together:
        """Steps 2-3 (``codec.standing_reads``): the window, and our key with the one just
        ahead, seen at one revision, read by the plan for the endpoint's etcd release."""
        reads = codec.standing_reads(messages.ReadStanding(0, key, revision), self.prefix, self.max)
        return read_together(self.client, reads, read_plan(self.client, interrupt), interrupt)


class _Wait:
    """The threaded driver of one ``waiter.Waiter``: it executes the machine's actions on
    the calling thread (unary calls with the client's deadlines, ``interrupt`` ending their
    retries), and sleeps on one mailbox for what comes from elsewhere (watch notices from
    the client's stream reader, the session's loss, the interrupt) and for the deadline
    and the pauses the machine asks for."""

    def __init__(
        self,
        sema: Semaphore,
        interrupt: Flag,
        deadline: float | None,
        started: float,
        shared: Session | None = None,
    ) -> None:
        self.sema = sema
        self.client = sema.client
        self.interrupt = interrupt
        self.deadline = deadline
        self.started = started
        self.session = shared  # the session our key is on (a private one once opened)
        self.shared = shared is not None
        self.box: Mailbox = queue.SimpleQueue()
        self.watches: dict[int, Watch] = {}
        self.ids: dict[Watch, int] = {}
        self.pauses: dict[int, float] = {}  # pause id: when it is over (monotonic)
        self.told: set[object] = set()  # flags and the deadline already fed
        backoff = Backoff(first=0.1, cap=REENTRY_BACKOFF_CAP)
        on = (shared.lease_id, sema._key(shared)) if shared is not None else (None, None)
        self.machine = waiter.Waiter(sema.prefix, sema.max, backoff, key=on[1], lease_id=on[0])

    def run(self) -> Hold:
        """Drive the machine to its outcome: the Hold, or the exception it gives up with
        (NoSlot, Interrupted, SessionLost, Unavailable, another EtcdError)."""
        self.interrupt.subscribe(self.box)
        if self.session is not None:
            self.session.lost.subscribe(self.box)
        machine = self.machine
        try:
            todo: deque[messages.Action] = deque(machine.start())
            while machine.outcome is None:
                polled = self._poll()
                if polled is not None:
                    todo.extend(machine.feed(polled))
                    continue
                answer = self._execute(todo.popleft()) if todo else self._next_input()
                if answer is not None:
                    todo.extend(machine.feed(answer))
            for action in todo:  # cancels of watches the hold does not retire
                self._execute(action)
            return self._outcome(machine.outcome)
        finally:
            self._clean_up()

    # -- inputs --------------------------------------------------------------------------

    def _poll(self) -> messages.Input | None:
        """What must be fed at once, before the next action: an interrupt, our session's
        loss, the deadline (once each)."""
        if self.interrupt.is_set() and self.interrupt not in self.told:
            self.told.add(self.interrupt)
            return messages.Interrupt(self.interrupt.reason)
        session = self.session
        if session is not None and session.lost.is_set() and session.lost not in self.told:
            self.told.add(session.lost)
            return messages.SessionLost(str(session.lost.reason))
        if "deadline" not in self.told and self._late():
            self.told.add("deadline")
            return messages.DeadlineReached()
        return None

    def _late(self) -> bool:
        return self.deadline is not None and time.monotonic() >= self.deadline

    def _next_input(self) -> messages.Input | None:
        """Sleep until a notice, a flag, the deadline or a pause's end."""
        over = self._pause_over()
        if over is not None:  # first: notices coming all the time must not starve a pause
            return over
        wake = [] if self.deadline is None or "deadline" in self.told else [self.deadline]
        wake += self.pauses.values()
        timeout = None if not wake else max(0.0, min(wake) - time.monotonic())
        try:
            item = self.box.get(timeout=None if timeout is None else min(timeout, 3600.0))
        except queue.Empty:
            return self._pause_over()  # or the deadline: _poll feeds it
        if isinstance(item, WatchNotice):
            return self._notice(item)
        return None  # a flag: _poll feeds it

    def _pause_over(self) -> messages.PauseOver | None:
        """The first pause whose time has come, if any."""
        now = time.monotonic()
        due = [(end, pause) for pause, end in self.pauses.items() if end <= now]
        if not due:
            return None
        _, pause = min(due)
        del self.pauses[pause]
        return messages.PauseOver(pause)

    def _notice(self, notice: WatchNotice) -> messages.Input | None:
        watch_id = self.ids.get(notice.watch)
        if watch_id is None:
            return None  # a cancelled watch
        return codec.watch_input(watch_id, notice)

    # -- actions -------------------------------------------------------------------------

    def _execute(self, action: messages.Action) -> messages.Input | None:
        """Do ``action``; return its answer when it has one now."""
        if isinstance(action, messages.CancelWatch):
            watch = self.watches.pop(action.id, None)
            if watch is not None:
                del self.ids[watch]
                watch.cancel()
            return None
        if isinstance(action, messages.Pause):
            left = remaining(self.deadline)
            seconds = action.seconds if left is None else min(action.seconds, left)
            self.pauses[action.id] = time.monotonic() + seconds
            return None
        if isinstance(action, messages.Note):
            self._log(action)
            return None
        if isinstance(action, messages.Withdraw):
            self._withdraw(action)
            return messages.Withdrawn(action.id)
        try:
            return self._call(action)
        except Interrupted:
            return None  # _poll feeds the interrupt next
        except EtcdError as exc:
            return codec.failed(action.id, exc)

    def _call(self, action: messages.Action) -> messages.Input | None:
        """The actions that call etcd. Raises EtcdError, Interrupted."""
        sema, interrupt = self.sema, self.interrupt
        if isinstance(action, messages.OpenSession):
            session = Session(self.client, sema.ttl, interrupt)
            self.session = session
            session.lost.subscribe(self.box)
            return messages.SessionOpened(action.id, session.lease_id, sema._key(session))
        if isinstance(action, messages.SendEnqueue):
            value, response = sema._enqueue(action.key, action.lease_id, interrupt)
            return codec.enqueue_answer(action, response, value)
        if isinstance(action, messages.ReadStanding):
            return codec.standing_answer(
                action, sema._standing(action.key, action.revision, interrupt)
            )
        if isinstance(action, messages.ReadKeys):
            plan = read_plan(self.client, interrupt)
            read = read_together(self.client, codec.keys_reads(action), plan, interrupt)
            return codec.keys_answer(action, read)
        if isinstance(action, messages.OpenWatch):
            self._open_watch(action)
            return None
        if isinstance(action, messages.Touch):
            call = codec.touch_call(action.key, action.revision, action.value, action.lease_id)
            return codec.touch_answer(action, send(self.client, call, interrupt))
        if isinstance(action, messages.CheckLease):
            assert self.session is not None
            if not self.session.certainly_alive():
                return messages.LeaseAnswer(action.id, 0)
            ttl = lease.time_to_live(self.client, action.lease_id, WITHDRAW_TIMEOUT)
            return messages.LeaseAnswer(action.id, ttl)
        raise AssertionError(f"unknown action {action!r}")  # pragma: no cover

    def _open_watch(self, action: messages.OpenWatch) -> None:
        # From "now", not from the standing's revision + 1: etcd serves a watch that starts
        # in the past from a catch-up loop that runs every 100 ms, which would add up to
        # 100 ms to a handoff. The machine closes the gap once etcd confirms the watch.
        key, end, only_deletes = codec.watch_range(action)
        watch = Watch(
            self.client,
            key,
            0,
            self.box.put,
            range_end=end,
            only_deletes=only_deletes,
            confirm=True,
        )
        self.watches[action.id] = watch
        self.ids[watch] = action.id

    def _withdraw(self, action: messages.Withdraw) -> None:
        if action.revoke:
            session, self.session = self.session, None
            if session is not None and session.lease_id == action.lease_id:
                session.lost.unsubscribe(self.box)
                session.close(timeout=WITHDRAW_TIMEOUT)
            return
        _withdraw(self.client, action)

    def _log(self, note: messages.Note) -> None:
        sema = self.sema
        ahead = None
        revision = revision_to_count(note)
        if revision is not None:
            try:
                request = codec.count_ahead_request(sema.prefix, revision)
                ahead = len(kv.range_(self.client, request, interrupt=self.interrupt).kvs)
            except (EtcdError, Interrupted):
                ahead = None
        log_note(sema.name, sema.max, sema.identity.host, note, ahead)

    # -- the outcome ---------------------------------------------------------------------

    def _outcome(self, outcome: messages.Outcome) -> Hold:
        sema = self.sema
        if isinstance(outcome, messages.GaveUp):
            raise _gave_up(sema, outcome, self.interrupt)
        session = self.session
        assert session is not None and session.lease_id == outcome.lease_id
        log_acquired(sema.name, sema.max, outcome, self.started)
        retire = [self.watches.pop(w) for w in outcome.retire if w in self.watches]
        for watch in retire:
            del self.ids[watch]
        hold = Hold(
            sema,
            session,
            outcome.key,
            outcome.revision,
            outcome.value,
            touch=outcome.touch,
            retire=retire,
            held_at=outcome.held_at,
            shared=self.shared,
        )
        self.session = None  # the hold's now
        return hold

    def _clean_up(self) -> None:
        """Whatever ended the run: no watch of ours left open, no subscription left; and
        if it ended without an outcome (an exception of ours, KeyboardInterrupt), no key or
        private lease left behind."""
        for watch in self.watches.values():
            watch.cancel()
        self.watches.clear()
        self.ids.clear()
        self.interrupt.unsubscribe(self.box)
        session = self.session
        if session is None:
            return
        session.lost.unsubscribe(self.box)
        if self.machine.outcome is not None:
            return  # withdrawn by the machine (or held: the hold took the session)
        if self.shared:
            machine = self.machine
            _withdraw(
                self.client,
                messages.Withdraw(0, machine.key, machine.revision, session.lease_id, False),
            )
        else:
            session.close(timeout=WITHDRAW_TIMEOUT)


def send(
    client: Client, call: codec.Call, interrupt: Flag | None = None, timeout: float | None = None
) -> Any:
    """Send ``call`` (built by the codec) with the etcd layer's call for it (``kv.txn``,
    ``kv.range_``, else ``client.call``): its response. Raises as ``Client.call``."""
    request = call.request
    if isinstance(request, rpc_pb2.TxnRequest):
        compare, success, failure = list(request.compare), list(request.success), request.failure
        return kv.txn(client, compare, success, list(failure), timeout, interrupt)
    if isinstance(request, rpc_pb2.RangeRequest):
        return kv.range_(client, request, timeout, interrupt)
    return client.call(call.service, call.method, request, timeout, interrupt=interrupt)


def read_plan(client: Client, interrupt: Flag | None = None) -> codec.ReadPlan:
    """How to read Ranges together from the endpoint ``client`` calls now: the codec's
    plan for its etcd release (Maintenance.Status, asked once per endpoint)."""
    return codec.read_plan(status.server_version(client, interrupt))


def read_together(
    client: Client, reads: list[rpc_pb2.RangeRequest], plan: codec.ReadPlan, interrupt: Flag
) -> codec.Together:
    """Ranges seen at one revision, read by ``plan`` (``codec.ReadTogether`` decides, also
    to go on with pinned Ranges when etcd's space alarm refuses the read-only Txn). Raises
    EtcdError, Interrupted."""
    read = codec.ReadTogether(reads, plan)
    while (call := read.next_call()) is not None:
        try:
            read.answer(send(client, call, interrupt))
        except EtcdError as exc:
            read.refused(exc)
    return read.result


def _gave_up(sema: Semaphore, outcome: messages.GaveUp, interrupt: Flag) -> BaseException:
    """The exception a waiter that gave up raises."""
    reason = outcome.reason
    if reason == messages.Reason.NO_SLOT:
        return NoSlot.in_time(sema.name, sema.max, outcome.detail)
    if reason == messages.Reason.INTERRUPTED:
        return Interrupted(interrupt.reason)
    if reason == messages.Reason.SESSION_LOST:
        return SessionLost(outcome.detail)
    failed = outcome.cause
    if isinstance(failed, messages.Failed) and isinstance(failed.cause, BaseException):
        return failed.cause  # etcd unreachable at the first session (69), or refused
    return EtcdError(outcome.detail)


def _withdraw(client: Client, action: messages.Withdraw) -> None:
    """Delete our key from a shared session (its lease lives on), best effort within
    WITHDRAW_TIMEOUT (``codec.withdraw_call``): if etcd cannot be reached it stays until
    the session ends."""
    try:
        send(client, codec.withdraw_call(action), timeout=WITHDRAW_TIMEOUT)
    except EtcdError as exc:
        log.warning("withdraw-failed", name=action.key.decode(errors="replace"), error=str(exc))


def log_acquired(name: str, max: int, outcome: messages.Held, started: float) -> None:
    """The ``acquired`` line both faces log when a wait ends in a hold begun at ``started``
    (a time.monotonic() reading)."""
    log.info(
        "acquired",
        name=name,
        max=max,
        rev=outcome.revision,
        lease=f"{outcome.lease_id:x}",
        waited=f"{time.monotonic() - started:.3f}s",
    )


def revision_to_count(note: messages.Note) -> int | None:
    """Our key's revision when ``note`` is a ``queued`` line that does not say how many are
    ahead (the face counts the keys ahead of it), else None."""
    if note.event == "queued" and "ahead" not in note.fields:
        return int(str(note.fields["rev"]))
    return None


def log_note(name: str, max: int, host: str, note: messages.Note, ahead: int | None) -> None:
    """``note`` as the log line both faces write for it: ``queued`` with ``max`` (and the
    count ``ahead``, when one was made), ``spread-busy`` with our ``host``."""
    fields = dict(note.fields)
    if note.event == "queued":
        fields = {"max": max, **fields}
        if ahead is not None:
            fields.update(position=ahead + 1, ahead=ahead)
    if note.event == "spread-busy":
        fields = {"host": host, **fields}
    emit = log.warning if note.warning else log.info
    emit(note.event, name=name, **fields)
