"""The counting semaphore recipe of 04_sema.md: enqueue, rank, wait, hold, release, who.

Every holder or waiter owns one key under ``/conch/v1/sema/<name>/<max>/``, bound to its
session's lease; keys rank by create_revision, the first ``max`` hold a slot. How a waiter
waits (the window, the touch; constant work per release): docs/design.md, "Waiting". The
decisions are ``conch.core.waiter.Waiter``'s; this module is its threaded driver
(``_Wait``) and what both faces' drivers share (``Driver``: the etcd calls of each action,
the withdraw, the log lines, what an outcome means to the caller).
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any, ClassVar, Generic, NamedTuple, TypeVar, cast

from conchpb.etcdserverpb import rpc_pb2

from conch import keys, log
from conch.core import codec, messages, waiter
from conch.core.line import Line
from conch.core.waiter import WINDOW_WAITERS_CAP, window_size
from conch.errors import EtcdError, Interrupted, NoSlot, SessionLost, UsageError
from conch.etcd import kv, lease, status
from conch.etcd.client import Backoff, Client, check_timeout
from conch.etcd.watch import Watch, WatchNotice
from conch.flag import Flag, remaining
from conch.hold import WITHDRAW_TIMEOUT, Hold
from conch.identity import Identity
from conch.session import Session, check_client, check_ttl
from conch.timer import Cancellable

__all__ = ["REENTRY_BACKOFF_CAP", "WINDOW_WAITERS_CAP", "Semaphore", "window_size"]

REENTRY_BACKOFF_CAP = 2.0  # seconds between attempts to re-enter after a lost session

T = TypeVar("T")
Steps = Generator[Any, Any, T]  # an exchange: the steps a face executes, then its answer
HEAD = 32  # keys of a standing read for a line with members parked
PLAN = object()  # a step: the read plan for the endpoint called now (``codec.read_plan``)


class Run(Generic[T]):
    """``steps`` as a face executes them: ``for step in run`` gives each step, whose answer
    the face sets as ``reply`` (or its EtcdError or Interrupted as ``error``, thrown back
    into the steps); ``answer`` once they end."""

    def __init__(self, steps: Steps[T]) -> None:
        self.steps = steps
        self.reply: Any = None
        self.error: BaseException | None = None

    def __iter__(self) -> Iterator[Any]:
        while True:
            error, self.error = self.error, None
            try:
                step = self.steps.send(self.reply) if error is None else self.steps.throw(error)
            except StopIteration as stop:
                self.answer: T = stop.value
                return
            yield step


class Next(NamedTuple):
    """A step: the next input from elsewhere (None if none came within ``timeout`` s)."""

    timeout: float | None


@dataclass(frozen=True)
class Recipe:
    """What both faces' Semaphores share: their fields and checks, their keys, the claim."""

    client: object
    name: str
    max: int
    ttl: int = 10
    spread: bool = False
    identity: Identity = field(default_factory=Identity.current)
    prefix: bytes = field(init=False, repr=False)
    _face: ClassVar[tuple[type, str]] = (Client, "conch")  # its Client, for check_client

    def __post_init__(self) -> None:
        check_client(self.client, *self._face)
        keys.check_name(self.name)
        keys.check_host(self.identity.host)
        keys.check_max(self.max)
        check_ttl(self.ttl)
        object.__setattr__(self, "prefix", keys.sema_prefix(self.name, self.max))

    def _standing(self, action: messages.ReadStanding, head: int = 0) -> Steps[codec.Together]:
        """Steps 2-3: the window (or ``head`` first keys), our key and the one ahead, at once."""
        return together(codec.standing_reads(action, self.prefix, self.max, head))

    def _key(self, lease_id: int) -> bytes:
        if self.spread:
            return keys.spread_key(self.name, self.max, self.identity.host)
        return keys.holder_key(self.name, self.max, lease_id)

    def _claim(
        self, session: Any, timeout: float | None
    ) -> tuple[bytes | None, Callable[[], None]]:
        """The checks before any etcd call, and our key claimed on a shared ``session`` (None
        without one): the key, and the function that lets go of it (a wait that ends without
        a hold calls it)."""
        if timeout is not None:
            check_timeout("timeout", timeout, zero=True)
        if session is None:
            return None, lambda: None
        if session.client is not self.client:
            raise UsageError("session: belongs to another client than the semaphore")
        key = session._claim(self._key(session.lease_id), many=not self.spread)
        return key, lambda: session._unclaim(key)


@dataclass(frozen=True)
class Semaphore(Recipe):
    """The semaphore (``name``, ``max``) on ``client``.

    ``ttl`` is the session lease TTL in whole seconds; ``spread`` keys slots by host (one
    per node); ``identity`` is what our key says about us. Immutable (``max`` is part of
    the semaphore's identity: its keys live under ``<name>/<max>/``); for another capacity
    make another Semaphore. Raises UsageError naming the bad parameter (client, name, max,
    ttl, the identity's host).
    """

    client: Client

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
        is the caller's call, not ours). Any number of waits for this semaphore may share
        one session, each its own key on the lease (``<lease-id>``, ``<lease-id>-1``, ...),
        one Txn to queue and one delete to release; with ``spread`` (one key per host) a
        second raises UsageError while the first waits or holds.

        ``guard=False`` returns the Hold with its guard (the watch on our key, the touch that
        moves the next waiter up) not yet started: the caller must call
        ``hold.start_guard()`` at once (the supervisor does, just after the child's spawn).
        Until then a loss of the session is noticed, a deletion of our key only later.
        """
        key, unclaim = self._claim(session, timeout)
        try:
            hold = _Wait(self, timeout, interrupt or Flag("interrupt"), session, key).run()
        except BaseException:
            unclaim()
            raise
        if guard:
            hold.start_guard()
        return hold

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


def together(reads: list[rpc_pb2.RangeRequest]) -> Steps[codec.Together]:
    """Ranges seen at one revision, read as ``codec.ReadTogether`` decides."""
    read = codec.ReadTogether(reads, (yield PLAN))
    while (call := read.next_call()) is not None:
        try:
            read.answer((yield call))
        except EtcdError as exc:
            read.refused(exc)
    return read.result


def withdrawing(sema: Recipe, action: messages.Withdraw) -> Steps[None]:
    """Our key deleted from a shared session, best effort: else it stays till the session ends."""
    try:
        yield replace(codec.withdraw_call(action), timeout=WITHDRAW_TIMEOUT)
    except EtcdError as exc:
        log.warning("withdraw-failed", name=sema.name, error=str(exc))


W = TypeVar("W", bound=Cancellable)  # a face's watch
# The Lines (conch.core.line) by client and semaphore prefix, while any waiter is in one; the
# lock: a threaded face's drivers share a line across threads.
_lines: dict[tuple[Any, bytes], Line[Any]] = {}
_lines_lock = threading.Lock()


class Driver(Generic[W]):
    """What both faces' drivers of one ``waiter.Waiter`` share: the machine (as our claimed
    ``key`` on a ``shared`` session's lease, else on private sessions), its watches, deadline
    and pauses, the queue ``box`` of what arrives from elsewhere (drained before each step: no
    event waits behind a slow call), the ``steps`` that drive it and what its outcome means."""

    def __init__(self, sema: Recipe, shared: Any, key: bytes | None, timeout: float | None) -> None:
        self.sema = sema
        self.shared = shared
        self.box: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self.started = time.monotonic()
        self.deadline = None if timeout is None else self.started + timeout  # None once fed
        self.watches: dict[int, W] = {}
        self.pauses: dict[int, float] = {}  # pause id: when it is over (monotonic)
        self.forget: list[Callable[[], None]] = []  # subscriptions to remove at the end
        lease_id = None if shared is None else shared.lease_id
        self.current_lease = lease_id or 0
        backoff = Backoff(first=0.1, cap=REENTRY_BACKOFF_CAP)
        self.machine = waiter.Waiter(sema.prefix, sema.max, backoff, key, lease_id)
        self.todo: list[messages.Action] = []  # the machine's actions not yet executed
        self.parked: messages.ReadStanding | None = None  # behind a waiter of this process
        self.line: Line[Any] | None = None  # our process's, once we enqueue
        self.placed = 0  # our key's revision as the line has it
        self.overdue = False  # past the deadline: out of the line for good

    def steps(self) -> Steps[messages.Outcome]:
        """The machine driven to its outcome: each action's steps, and ``Next`` when there is
        nothing to do but wait (a pause over first: a stream of notices must not starve it)."""
        machine, todo = self.machine, self.todo
        todo.extend(machine.start())
        while machine.outcome is None or todo:
            answer = self.arrived() or self._late()
            if answer is None and todo:
                answer = yield from self.exchange(todo.pop(0))
            elif answer is None and machine.outcome is None:
                first = min(self.pauses, key=self.pauses.__getitem__, default=None)
                if first is not None and self.pauses[first] <= time.monotonic():
                    del self.pauses[first]
                    answer = messages.Over(first)
                else:
                    answer = yield Next(self._wake())
            if answer is not None:
                if isinstance(answer, messages.Watched) and self.line is not None:
                    with _lines_lock:
                        self.line.seen(answer.events)
                todo.extend(machine.feed(answer))
                self._in_line()
        return machine.outcome

    def _in_line(self, leave: bool = False) -> None:
        """Our process's line told where our key stands now, or (``leave``, or an outcome)
        that we wait no more: then we are out of it for good."""
        revision, line = self.machine.revision, self.line
        leave = leave or self.machine.outcome is not None
        if line is None or (not leave and revision == self.placed):
            return
        with _lines_lock:
            if leave:
                woken, self.line = line.leave(self), None
                if not len(line):
                    _lines.pop((self.sema.client, self.sema.prefix), None)
            else:
                woken = line.placed(self, revision)
        self.placed = revision
        for driver in woken:
            driver.put(driver.unparked)  # from this driver's thread or task

    def _join(self) -> bool:
        """Into our process's line as we enqueue, unless past the deadline; whether our Txn
        reads our standing (fewer than the line's limit are in it)."""
        if self.overdue:
            return True
        with _lines_lock:
            limit = window_size(self.sema.max) - self.sema.max
            self.line = _lines.setdefault((self.sema.client, self.sema.prefix), Line(limit))
            return self.line.joined(self)

    def unparked(self) -> None:
        """On our ``box``: the parked standing read, if one still is, may go now."""
        self.todo.extend([self.parked] if self.parked is not None else [])
        self.parked = None

    def arrived(self) -> messages.Input | None:
        while not self.box.empty():
            answer = self.input(self.box.get_nowait())
            if answer is not None:
                return answer
        return None

    def input(self, item: Any) -> messages.Input | None:
        """A ``box`` item as an input (a function's, called now)."""
        return cast(messages.Input | None, item() if callable(item) else item)

    def put(self, item: Any) -> None:
        """``item`` queued on ``box``, from any thread or task (a face may wake its steps too)."""
        self.box.put_nowait(item)

    def tell(self, watch_id: int, notice: WatchNotice) -> None:
        """Watch ``watch_id``'s ``notice`` queued on ``box`` as an input (each face's watch's)."""
        self.put(codec.watch_input(watch_id, notice))

    def on_session(self, lease_id: int) -> Callable[[object], None]:
        """Now on the session of ``lease_id``: the listener that queues its loss (dropped if
        by then we are on another session)."""
        self.current_lease = lease_id
        return lambda reason: self.put(partial(self._lost, lease_id, str(reason)))

    def _lost(self, lease_id: int, reason: str) -> messages.SessionLost | None:
        return messages.SessionLost(reason) if lease_id == self.current_lease else None

    def _late(self) -> messages.DeadlineReached | None:
        if self.deadline is None or time.monotonic() < self.deadline:
            return None
        self.deadline, self.overdue = None, True
        self._in_line(leave=True)  # a read parked goes now: the machine gives up on its answer
        self.unparked()
        return messages.DeadlineReached()

    def _wake(self) -> float | None:
        wake = [*self.pauses.values(), *([] if self.deadline is None else [self.deadline])]
        return max(0.0, min(wake) - time.monotonic()) if wake else None

    def exchange(self, action: messages.Action) -> Steps[messages.Input | None]:
        """``action`` as steps (a Call, PLAN, or an action of the face's own) and
        its answer: ``Failed`` for an EtcdError, none after Interrupted (it is fed next)."""
        sema = self.sema
        if isinstance(action, messages.CancelWatch):
            self.cancel(action.id)
        elif isinstance(action, messages.Pause):  # the deadline, which comes first, cuts it
            self.pauses[action.id] = time.monotonic() + action.seconds
        elif isinstance(action, messages.Note):
            yield from self.noting(action)
        if isinstance(action, messages.CancelWatch | messages.Pause | messages.Note):
            return None
        try:
            if isinstance(action, messages.SendEnqueue):  # step 1
                value = sema.identity.entering().to_json()
                txn = codec.enqueue_call(action, sema.prefix, sema.max, value, read=self._join())
                return codec.enqueue_answer(action, (yield txn), value)
            if isinstance(action, messages.ReadStanding):
                with _lines_lock:
                    parked = self.line is not None and self.line.park(self, action.revision)
                if not parked:
                    return (yield from self._standing(action))
                self.parked = action
                if self.machine.queued_said_elsewhere():
                    yield from self.noting(messages.Note("queued", {"rev": action.revision}))
                return None
            if isinstance(action, messages.ReadKeys):
                return codec.keys_answer(action, (yield from together(codec.keys_reads(action))))
            if isinstance(action, messages.Touch):
                call = codec.touch_call(action.key, action.revision, action.value, action.lease_id)
                return codec.touch_answer(action, (yield call))
            if isinstance(action, messages.Withdraw) and not action.revoke:
                yield from withdrawing(sema, action)
                return messages.Over(action.id)
            answer: messages.Input | None = yield action
            return answer
        except Interrupted:
            return None
        except EtcdError as exc:
            return codec.failed(action.id, exc)

    def _standing(self, action: messages.ReadStanding) -> Steps[messages.StandingAnswer | None]:
        """Steps 2-3: our key's standing, from the first keys of the queue our line read last
        if ours is in the window there (``codec.head_answer``), else read: those first keys
        (``HEAD``) while the line has parked members, the window alone if not."""
        sema, line = self.sema, self.line
        with _lines_lock:
            answer = None if line is None else codec.head_answer(action, line.head, sema.max)
            head = HEAD if line is not None and len(line) > line.limit else 0
        if answer or line is None or not head:
            return answer or codec.standing_answer(action, (yield from sema._standing(action)))
        read = yield from sema._standing(action, head)
        with _lines_lock:
            line.head = read.revision, [codec.key_rev(k) for k in read.responses[0].kvs]
        return codec.head_answer(action, line.head, sema.max, read.responses[1:])

    def noting(self, note: messages.Note) -> Steps[None]:
        """``note``'s log line; ``queued`` counts the keys ahead (``codec.count_ahead``)."""
        sema, fields = self.sema, dict(note.fields)
        if note.event == "queued":
            fields = {"max": sema.max, **fields}
            if "ahead" not in note.fields:
                with contextlib.suppress(EtcdError, Interrupted):  # said without the count, then
                    ahead = yield from codec.count_ahead(sema.prefix, int(str(note.fields["rev"])))
                    fields.update(position=ahead + 1, ahead=ahead)
        if note.event == "spread-busy":
            fields = {"host": sema.identity.host, **fields}
        emit = log.warning if note.warning else log.info
        emit(note.event, name=sema.name, **fields)

    def cancel(self, watch_id: int) -> None:
        watch = self.watches.pop(watch_id, None)
        if watch is not None:
            watch.cancel()

    def let_go(self) -> messages.Held | None:
        """Subscriptions removed, all watches cancelled but a held slot's (its Held, returned)."""
        for forget in self.forget:
            forget()
        self._in_line(leave=True)
        outcome = self.machine.outcome
        held = outcome if isinstance(outcome, messages.Held) else None
        for watch_id in [w for w in self.watches if held is None or w not in held.retire]:
            self.cancel(watch_id)
        return held

    def held(self, outcome: messages.Outcome | None) -> tuple[messages.Held, list[W]]:
        """The slot held and the watches its Hold retires; else raises why the wait gave up."""
        sema = self.sema
        if isinstance(outcome, messages.GaveUp):
            if outcome.reason == messages.Reason.NO_SLOT:
                raise NoSlot.in_time(sema.name, sema.max, outcome.detail)
            if outcome.reason == messages.Reason.INTERRUPTED:
                raise Interrupted(outcome.cause)
            if outcome.reason == messages.Reason.SESSION_LOST:
                raise SessionLost(outcome.detail)
            failed = outcome.cause
            if isinstance(failed, messages.Failed) and isinstance(failed.cause, BaseException):
                raise failed.cause  # etcd unreachable at the first session (69), or refused
            raise EtcdError(outcome.detail)
        assert outcome is not None
        log.info(
            "acquired",
            name=sema.name,
            max=sema.max,
            rev=outcome.revision,
            lease=f"{outcome.lease_id:x}",
            waited=f"{time.monotonic() - self.started:.3f}s",
        )
        return outcome, [self.watches.pop(w) for w in outcome.retire if w in self.watches]


class _Wait(Driver[Watch]):
    """The threaded driver: the steps on the calling thread (``interrupt`` ends a call's
    retries), one mailbox for watch notices, the sessions' losses and the interrupt."""

    sema: Semaphore

    def __init__(
        self,
        sema: Semaphore,
        timeout: float | None,
        interrupt: Flag,
        shared: Session | None,
        key: bytes | None,
    ) -> None:
        super().__init__(sema, shared, key, timeout)
        self.client = sema.client
        self.interrupt = interrupt
        self.session = shared  # the session our key is on (a private one once opened)

    def run(self) -> Hold:
        put = self.box.put
        self.forget.append(self.interrupt.add_callback(lambda f: put(messages.Interrupt(f.reason))))
        if self.session is not None:
            self._subscribe(self.session)
        try:
            held, retire = self.held(drive(self.client, self.steps(), self.interrupt, self._act))
            session, self.session = self.session, None  # the hold's now
            assert session is not None and session.lease_id == held.lease_id
            return Hold(self.sema, session, held, retire, self.shared is not None)
        finally:
            self._clean_up()

    def _subscribe(self, session: Session) -> None:
        lost = self.on_session(session.lease_id)
        self.forget.append(session.lost.add_callback(lambda flag: lost(flag.reason)))

    def _act(self, action: Any) -> messages.Input | None:
        sema, interrupt = self.sema, self.interrupt
        if isinstance(action, Next):
            wait = 3600.0 if action.timeout is None else min(action.timeout, 3600.0)
            with contextlib.suppress(queue.Empty):
                return self.input(self.box.get(timeout=wait))
            return None
        if isinstance(action, messages.OpenSession):
            session = self.session = Session(self.client, sema.ttl, interrupt)
            self._subscribe(session)
            return messages.SessionOpened(action.id, session.lease_id, sema._key(session.lease_id))
        if isinstance(action, messages.CheckLease):
            assert self.session is not None
            alive = self.session.certainly_alive()
            ttl = lease.time_to_live(self.client, action.lease_id, WITHDRAW_TIMEOUT) if alive else 0
            return messages.LeaseAnswer(action.id, ttl)
        if isinstance(action, messages.Withdraw):  # a private session's: revoked
            private, self.session = self.session, None
            if private is not None and private.lease_id == action.lease_id:
                private.close(timeout=WITHDRAW_TIMEOUT)
            return messages.Over(action.id)
        assert isinstance(action, messages.OpenWatch)
        # From "now": etcd serves a watch from the past by a 100 ms catch-up loop, which would
        # slow a handoff. The machine closes the gap once etcd confirms the watch.
        key, end, deletes = codec.watch_range(action)
        tell = partial(self.tell, action.id)
        self.watches[action.id] = Watch(
            self.client, key, 0, tell, range_end=end, only_deletes=deletes, confirm=True
        )
        return None

    def _clean_up(self) -> None:
        """No watch or subscription left; without an outcome (a bug, KeyboardInterrupt), no
        key or private lease either."""
        self.let_go()
        session, machine = self.session, self.machine
        if session is None or machine.outcome is not None:
            return  # withdrawn by the machine (or held: the hold took the session)
        if self.shared is not None:
            withdraw = messages.Withdraw(0, machine.key, machine.revision, session.lease_id, False)
            drive(self.client, withdrawing(self.sema, withdraw))
        else:
            session.close(timeout=WITHDRAW_TIMEOUT)


def drive(
    client: Client,
    steps: Steps[T],
    interrupt: Flag | None = None,
    act: Callable[[Any], Any] | None = None,
) -> T:
    """``steps`` executed on this thread (PLAN by one Status per endpoint, a Call by the etcd
    layer's call for it, ``kv.txn`` or ``kv.range_``, which ``interrupt`` ends unless the
    Call has a timeout of its own; other steps by ``act``): their answer."""
    run = Run(steps)
    for step in run:
        try:
            if step is PLAN:
                run.reply = codec.read_plan(status.server_version(client, interrupt))
            elif isinstance(step, codec.Call):
                request, cut = step.request, interrupt if step.timeout is None else None
                if isinstance(request, rpc_pb2.TxnRequest):
                    ops = list(request.compare), list(request.success), list(request.failure)
                    run.reply = kv.txn(client, *ops, step.timeout, cut)
                else:
                    run.reply = kv.range_(client, request, step.timeout, cut)
            else:
                assert act is not None
                run.reply = act(step)
        except (EtcdError, Interrupted) as exc:
            run.error = exc
    return run.answer
