"""The scheduler: many waiters' ``conch.core.waiter.Waiter`` machines against one ``SimEtcd``,
interleaved by a seeded random schedule, with the recipe's properties checked at every step.

A ``World`` is one semaphore (name, N) and the processes that acquire it. It is the driver
the machines expect (conch/core/waiter.py's docstring), written over the model instead of gRPC:
each action a machine returns becomes a request *in flight*; the schedule decides, one step
at a time, which thing happens next:

* a request in flight is applied to the model (or fails: etcd unreachable, space alarm);
* an answer is delivered to its machine, or lost (for a write: applied, then the answer
  lost, which the machine sees as "unreachable");
* a watch delivers its next notice (each watch in its own order; different watches and
  different answers in any order: etcd orders a watcher's events, not the responses to
  different requests);
* the clock moves on (pauses end, keepalives go out, leases run out, holds end);
* the world does something: a process arrives, a holder's job ends (one, or several at
  once), a waiter is interrupted or its session lost, etcd becomes unreachable or refuses
  writes (NOSPACE) for a while, the history is compacted, a watch breaks.

Holders are the driver's part, as ``conch/hold.py`` does it: the touch the machine says is
owed, retried while etcd is away, and the watch on its own key, each when and as the
recipe's guard machine says (``conch.core.guard.GuardMachine``); the release
(revoke a private lease, delete the key of a shared one). A holder's session is lost for it
before etcd can expire the lease: conch's ``check()`` counts the TTL from when the last
confirmed keepalive was *sent*, which is never after etcd restarted its countdown.

Everything is drawn from one ``random.Random(seed)``; nothing depends on the wall clock or
on hash order, so a seed replays exactly. ``trace`` is the compact schedule that a failure
prints.
"""

from __future__ import annotations

import collections
import functools
import math
import random
from collections.abc import Callable, Generator, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import grpc
from conchpb.etcdserverpb import rpc_pb2
from conchpb.mvccpb import kv_pb2

from conch.core import codec, loss
from conch.core import guard as g
from conch.core import messages as m
from conch.core import session as sm
from conch.core import waiter as r
from conch.errors import Compacted, EtcdError, LeaseNotFound, Unavailable
from conch.etcd.client import map_rpc_error
from tests.sim.model import ModelError, SimEtcd

TTL = 5  # seconds: every session's lease
GUARD = -1  # the machine id under which a holder's guard watch is kept
# Steady steps (no fault, no slow request, nobody backing off) a waiter may sleep while the
# model says it holds, or a holder hold on after its key was deleted: a release reaches the
# waiter it promotes in a handful of deliveries (its event, a read, a watch), interleaved
# with the others'. The most seen: 40 and 18 in the first 600 seeds when a read was one
# request; on releases read by pinned Ranges a gap check is one request per key (up to 18
# at N=9), and seed 2829 slept 201 steps: the bound is doubled.
ASLEEP_BOUND = 400
RUN_STEPS = 1500  # steps of the phase with faults and arrivals, at most
CALM_STEPS = 20000  # steps to finish once faults are over: more is a livelock
# etcd releases the schedules model, each read by the codec's plan for it: the suite's
# (refuses a read-only Txn at its space quota, panics on one past its deadline: pinned
# Ranges), one with both fixed and Debian's 3.4 (one read-only Txn), and a 3.4 from before
# 3.4.20 (one read-only Txn, refused at the quota: the fallback to pinned Ranges).
RELEASES = ("3.5.1", "3.5.7", "3.4.23", "3.4.19")
VALUE = b'{"sim":1}'  # every key's value
MORE = object()  # what applying one request of several answers: the next is due
READS = (m.ReadStanding, m.ReadKeys)  # the actions read as Ranges together


class PropertyFailed(AssertionError):
    """A property of the recipe does not hold in this schedule; ``trace`` is the whole of
    the schedule up to the failure (the message has its tail)."""

    def __init__(self, message: str, trace: Sequence[str] = ()) -> None:
        super().__init__(message)
        self.trace = list(trace)


class SimBackoff:
    """conch's Backoff (capped, doubling), with jitter drawn from the world's generator."""

    def __init__(self, rng: random.Random, first: float = 0.1, cap: float = 2.0) -> None:
        self._rng, self._first, self._cap = rng, first, cap
        self._next = first

    def next(self) -> float:
        pause = self._next
        self._next = min(self._cap, self._next * 2)
        return pause * self._rng.uniform(0.5, 1.0)

    def reset(self) -> None:
        self._next = self._first


@dataclass
class Session:
    """A lease kept alive for its owner by the shipped session machine
    (``conch.core.session.SessionMachine``); ``wake`` its latest WakeAt."""

    lease_id: int
    shared: bool
    machine: sm.SessionMachine
    wake: float = math.inf
    kept: bool = True  # not closed
    frozen: bool = False  # its keepalives reach etcd no more (the process stopped)
    lost: bool = False  # etcd said the lease is gone


@dataclass
class Proc:
    """One acquire: a Waiter, then (if it holds) the hold, until released."""

    name: str
    waiter: r.Waiter
    timeout: float | None
    shared: Session | None = None
    holding: bool = False  # believes it holds (the hold neither released nor lost)
    held: m.Held | None = None
    done: bool = False  # released, or gave up
    watches: dict[int, int] = field(default_factory=dict)  # machine's id -> model's id
    cancelled: set[int] = field(default_factory=set)  # watches cancelled (maybe unopened)
    asleep: int = 0  # steps the model has said it holds while it does not know
    guard: g.GuardMachine | None = None  # the hold's guard, once it holds
    unnoticed: int = 0  # steps holding a key that is gone, its guard not yet aware


@dataclass
class InFlight:
    """A request sent and not yet applied (``answer`` None), or applied and not yet
    delivered. ``write``: it changes etcd when applied (its answer may be lost)."""

    proc: Proc
    what: str
    apply: Callable[[], Any]
    deliver: Callable[[Any], None]
    write: bool
    weight: float
    answer: Any = None
    applied: bool = False


@dataclass
class Timer:
    at: float
    seq: int
    proc: Proc | None
    what: str
    fire: Callable[[], None]


class World:
    """One semaphore of ``max_holders`` slots on ``etcd``, and the processes acquiring it."""

    def __init__(
        self,
        seed: int,
        max_holders: int,
        etcd: SimEtcd | None = None,
        waiter: type[r.Waiter] = r.Waiter,
        auto_release: bool = True,
        reader: type[codec.ReadTogether] = codec.ReadTogether,
    ) -> None:
        """``waiter``, ``reader``: the machine and the read plan to drive (a variant, to
        show a property catches its bug). ``auto_release``: holders' jobs end after a
        random time (else only when ``release`` is called)."""
        self.seed = seed
        self.waiter = waiter
        self.reader = reader
        self.auto_release = auto_release
        self.counts: collections.Counter[str] = collections.Counter()  # what was explored
        self.rng = random.Random(seed)
        self.max = max_holders
        self.etcd = etcd or SimEtcd()
        self.prefix = b"/conch/v1/sema/sim/%d/" % max_holders
        # As a client learns it on connecting (Maintenance.Status): how Ranges are read
        # together on this release.
        self.plan = codec.read_plan(self.etcd.status().version)
        self.procs: list[Proc] = []
        self.in_flight: list[InFlight] = []
        self.timers: list[Timer] = []
        self.sessions: list[Session] = []
        self.live: list[Session] = []  # sessions not yet done (a superset, pruned each step)
        self.watch_owner: dict[int, tuple[Proc, int]] = {}  # model's watch id -> (proc, id)
        self.broken: list[tuple[Proc, int, bool]] = []  # ended watch notices to deliver
        self.trace = Trace()
        self.steps = 0
        self.requests = 0  # requests sent to etcd (by machines and holders)
        self.faulty = False  # a fault is active: liveness is not counted
        self.lost_rate = 0.0
        self.slow_rate = 0.1  # the share of requests left slow
        self.notice_weight = 1.0  # how eagerly watch notices are delivered, against answers
        self._seq = 0

    # -- the trace -----------------------------------------------------------------------

    def log(self, line: str, *items: object) -> None:
        """A line of the trace: ``line`` with each ``{}`` an item (formatted when read)."""
        self.trace.add((self.steps, self.etcd.now, self.etcd.revision, line, items))

    def fail(self, message: str) -> None:
        tail = "\n".join(self.trace.lines()[-60:])
        raise PropertyFailed(
            f"seed {self.seed} (N={self.max}), step {self.steps}: {message}\n"
            f"replay: scripts/simulate.py --replay {self.seed}\nlast of the trace:\n{tail}",
            self.trace.lines(),
        )

    # -- processes -----------------------------------------------------------------------

    def arrive(self, shared: bool = False, timeout: float | None = None) -> Proc:
        """A process starts an acquire (on a session of its own, or on a shared one the
        driver grants first, outside any fault)."""
        name = f"w{len(self.procs)}"
        backoff = SimBackoff(self.rng)
        session = None
        if shared:
            reachable, nospace = self.etcd.reachable, self.etcd.nospace
            self.etcd.reachable, self.etcd.nospace = True, False
            grant = self.etcd.lease_grant(rpc_pb2.LeaseGrantRequest(TTL=TTL))
            self.etcd.reachable, self.etcd.nospace = reachable, nospace
            session = self._session(grant.ID, shared=True, granted_at=self.etcd.now)
            key = self.prefix + b"%x" % grant.ID
            waiter = self.waiter(self.prefix, self.max, backoff, key=key, lease_id=grant.ID)
        else:
            waiter = self.waiter(self.prefix, self.max, backoff)
        proc = Proc(name, waiter, timeout, shared=session)
        self.procs.append(proc)
        self.log(f"{name} arrives ({'shared' if shared else 'private'}, timeout={timeout})")
        if timeout is not None:
            self._timer(timeout, proc, "deadline", lambda: self.feed(proc, m.DeadlineReached()))
        self.execute(proc, proc.waiter.start())
        self._after_outcome(proc, r.State.ENQUEUEING)
        return proc

    def _session(self, lease_id: int, shared: bool, granted_at: float) -> Session:
        """The session of a lease granted by a LeaseGrant sent at ``granted_at``."""
        session = Session(lease_id, shared, sm.SessionMachine(TTL, granted_at))
        self.sessions.append(session)
        self.live.append(session)
        self._session_do(session, session.machine.start())
        return session

    def feed(self, proc: Proc, event: m.Input) -> None:
        self.log("{} <- {}", proc.name, event)
        before = proc.waiter.state
        self.counts[type(event).__name__] += 1
        if isinstance(event, m.Watched):
            kind = "ended" if event.ended else "created" if event.created else "events"
            self.counts[f"Watched.{kind}"] += 1
        if isinstance(event, m.Failed):
            self.counts[f"Failed.{event.failure.name}"] += 1
        self.execute(proc, proc.waiter.feed(event))
        self._after_outcome(proc, before)

    def _after_outcome(self, proc: Proc, before: r.State) -> None:
        outcome = proc.waiter.outcome
        if outcome is None or proc.held is not None or proc.done:
            return
        if isinstance(outcome, m.GaveUp):
            self.log(f"{proc.name} gave up: {outcome.reason.value} {outcome.detail}")
            proc.done = True
            self._close_shared(proc)
            return
        self.counts[f"held.{before.name}.{outcome.touch.name}"] += 1
        self._granted(proc, outcome)

    # -- executing actions ---------------------------------------------------------------

    def execute(self, proc: Proc, actions: Sequence[m.Action]) -> None:
        self.counts[f"state.{proc.waiter.state.name}"] += 1
        for action in actions:
            self.counts[type(action).__name__] += 1
            if isinstance(action, m.Note):
                continue
            self.log("{} -> {}", proc.name, action)
            if isinstance(action, m.CancelWatch):
                self._cancel_watch(proc, action.id)
            elif isinstance(action, m.Pause):
                over = m.Over(action.id)
                self._timer(action.seconds, proc, "pause", functools.partial(self.feed, proc, over))
            else:
                self._send(proc, action)

    def _send(self, proc: Proc, action: m.Action) -> None:
        """The action's requests, built by the shipped codec, in flight one after the
        other (a read by pinned Ranges is several); the answer decoded by it too."""
        self.requests += 1
        if isinstance(action, m.OpenWatch):
            self._in_flight(proc, "open-watch", lambda: self._open_watch(proc, action), None, False)
            return
        if isinstance(action, m.Withdraw) and action.revoke:
            self._stop_session(action.lease_id)  # a private session closes: no keepalives
        write = isinstance(action, (m.OpenSession, m.SendEnqueue, m.Touch, m.Withdraw))
        exchange = self._exchange(action)
        call = [next(exchange)]

        def applied() -> Any:
            try:
                try:
                    response = call[0]()
                except ModelError as error:
                    call[0] = exchange.throw(etcd_error(error))
                else:
                    call[0] = exchange.send(response)
            except StopIteration as done:
                return done.value
            except EtcdError as error:
                if isinstance(action, m.Withdraw):
                    return m.Over(action.id)  # best effort: over either way
                failed = codec.failed(getattr(action, "id", 0), error)
                if isinstance(action, READS) and failed.failure == m.Failure.NO_SPACE:
                    # etcd serves Ranges under its space alarm: a read that fails for it
                    # stalls the waiter for the alarm's whole length.
                    self.fail(f"{proc.name}: {type(action).__name__} refused under the space alarm")
                return failed
            return MORE

        self._in_flight(
            proc, type(action).__name__, applied, functools.partial(self.feed, proc), write
        )

    def _exchange(self, action: m.Action) -> Generator[Callable[[], Any], Any, Any]:
        """The requests that carry ``action`` out, each yielded as a call on the model and
        sent its response (or thrown the EtcdError it met); returns the machine's input."""
        if isinstance(action, m.OpenSession):
            grant = yield lambda: self.etcd.lease_grant(rpc_pb2.LeaseGrantRequest(TTL=TTL))
            lease_id = int(grant.ID)
            opened = m.SessionOpened(action.id, lease_id, self.prefix + b"%x" % lease_id)
            return opened, self.etcd.now  # when the countdown started: ``_on_opened``
        if isinstance(action, m.SendEnqueue):
            request = codec.enqueue_call(action, self.prefix, self.max, VALUE)
            return codec.enqueue_answer(action, (yield self._on_model(request)), VALUE)
        if isinstance(action, READS):
            reads = (
                codec.standing_reads(action, self.prefix, self.max)
                if isinstance(action, m.ReadStanding)
                else codec.keys_reads(action)
            )
            read = self.reader(reads, self.plan)
            while (call := read.next_call()) is not None:
                try:
                    read.answer((yield self._on_model(call)))
                except EtcdError as error:
                    read.refused(error)
            fell_back = read.plan != self.plan  # the Txn refused under the space alarm
            self.counts[f"read.{'fell-back' if fell_back else read.plan.name}"] += 1
            if isinstance(action, m.ReadStanding):
                return codec.standing_answer(action, read.result)
            return codec.keys_answer(action, read.result)
        if isinstance(action, m.Touch):
            request = codec.touch_call(action.key, action.revision, action.value, action.lease_id)
            return codec.touch_answer(action, (yield self._on_model(request)))
        if isinstance(action, m.CheckLease):
            ask = rpc_pb2.LeaseTimeToLiveRequest(ID=action.lease_id)
            return m.LeaseAnswer(
                action.id, int((yield lambda: self.etcd.lease_time_to_live(ask)).TTL)
            )
        if isinstance(action, m.Withdraw):
            if action.revoke:
                yield lambda: self._revoke(action.lease_id)
            else:
                yield self._on_model(codec.withdraw_call(action))
            return m.Over(action.id)
        raise AssertionError(f"unknown action {action!r}")

    def _on_model(self, call: codec.Call) -> Callable[[], Any]:
        """A codec Call as the model's method."""
        methods: dict[str, Callable[[Any], Any]] = {"Txn": self.etcd.txn, "Range": self.etcd.range}
        return functools.partial(methods[call.method], call.request)

    def _in_flight(
        self,
        proc: Proc,
        what: str,
        apply: Callable[[], Any],
        deliver: Callable[[Any], None] | None,
        write: bool,
    ) -> None:
        # Some requests are slow: far less likely to be picked at any step.
        weight = 0.05 if self.rng.random() < self.slow_rate else 1.0
        self.in_flight.append(
            InFlight(proc, what, apply, deliver or (lambda _: None), write, weight)
        )

    def _open_watch(self, proc: Proc, action: m.OpenWatch) -> None:
        if action.id in proc.cancelled:
            return  # cancelled before its create request went out
        key, range_end, only_deletes = codec.watch_range(action)
        request = rpc_pb2.WatchCreateRequest(key=key, range_end=range_end)
        if only_deletes:
            request.filters.append(rpc_pb2.WatchCreateRequest.NOPUT)
        try:
            model_id = self.etcd.watch_create(request)
        except ModelError as error:
            self.feed(proc, codec.failed(action.id, etcd_error(error)))
            return
        proc.watches[action.id] = model_id
        self.watch_owner[model_id] = (proc, action.id)

    def _cancel_watch(self, proc: Proc, machine_id: int) -> None:
        proc.cancelled.add(machine_id)
        model_id = proc.watches.pop(machine_id, None)
        if model_id is not None:
            self.etcd.watch_cancel(model_id)
            self.watch_owner.pop(model_id, None)
        self.broken = [b for b in self.broken if (b[0], b[1]) != (proc, machine_id)]

    # -- sessions ------------------------------------------------------------------------

    def _stop_session(self, lease_id: int) -> None:
        for session in self.sessions:
            if session.lease_id == lease_id:
                session.kept = False
                session.machine.close()

    def session_of(self, proc: Proc) -> Session | None:
        lease_id = proc.waiter.lease_id if proc.held is None else proc.held.lease_id
        for session in self.sessions:
            if session.lease_id == lease_id and session.kept and not session.lost:
                return session
        return None

    def _session_do(self, session: Session, actions: Sequence[sm.SessionAction]) -> None:
        """Execute the session machine's actions, as conch/session.py does: one timer for
        the latest WakeAt, each keepalive sent at once (its answer fed after the rest)."""
        sends = []
        for action in actions:
            lost = isinstance(action, sm.Expired) and action.lost
            self.counts["Lost" if lost else type(action).__name__] += 1
            if isinstance(action, sm.WakeAt):
                session.wake = action.at
            elif isinstance(action, sm.SendKeepalive):
                sends.append(action)
            elif isinstance(action, sm.Expired):
                self._session_ended(session, action.loss, lost=action.lost)
        for send in sends:
            self._keepalive(session, send.deadline)

    def _keepalive(self, session: Session, deadline: float) -> None:
        """One LeaseKeepAlive, answered at once, or never (etcd away, or the process
        frozen): then unanswered at its deadline."""
        sent = self.etcd.now
        try:
            if session.frozen:
                raise ModelError("UNAVAILABLE", "frozen")
            answer = self.etcd.lease_keepalive(rpc_pb2.LeaseKeepAliveRequest(ID=session.lease_id))
        except ModelError:
            unanswered = functools.partial(self._keepalive_unanswered, session, deadline)
            self._timer(deadline - sent, None, "keepalive", unanswered)
            return
        gone = LeaseNotFound(f"lease {session.lease_id:x} expired or was revoked")
        outcome = gone if answer.TTL <= 0 else answer.TTL
        self._session_do(session, session.machine.settle(sent, self.etcd.now, outcome))

    def _keepalive_unanswered(self, session: Session, deadline: float) -> None:
        self.counts["keepalive.unanswered"] += 1
        no_answer = Unavailable("keepalive: no answer by its deadline")
        self._session_do(session, session.machine.settle(deadline, deadline, no_answer))

    def _session_ended(self, session: Session, reason: loss.Loss, lost: bool) -> None:
        """The session's E passed unconfirmed (``lost`` False: its holds are lost, its
        waiters carry on), or etcd said its lease is gone (holds and waiters told)."""
        if lost:
            session.lost, session.kept = True, False
        for proc in self.procs:
            lease_id = proc.held.lease_id if proc.held is not None else proc.waiter.lease_id
            if lease_id != session.lease_id or proc.done:
                continue
            if proc.holding and proc.guard is not None:
                self._guard(proc, proc.guard.session_ended(reason, lost))
            elif lost and proc.waiter.outcome is None:
                self.feed(proc, m.SessionLost(reason))

    # -- holds -------------------------------------------------------------------------------

    def _granted(self, proc: Proc, held: m.Held) -> None:
        proc.held = held
        for watch in held.retire:  # the watch that woke us, closed off the handoff's path
            self._cancel_watch(proc, watch)
        live = self.etcd.under(self.prefix)
        ahead = [kv for kv in live if kv.create_revision < held.revision]
        mine = [kv for kv in live if kv.key == held.key]
        self.log(f"{proc.name} HOLDS rev={held.revision} at={held.held_at} ahead={len(ahead)}")
        if not mine or mine[0].create_revision != held.revision:
            deleted = self.etcd.deleted_at.get(held.key, 0)
            if deleted <= held.held_at:
                self.fail(
                    f"{proc.name} holds at {held.held_at} a key deleted at {deleted} "
                    f"(rev {held.revision})"
                )
            # Deleted after the revision it holds at (from outside, meanwhile): its
            # guard, watching from there, is to see the deletion.
        elif len(ahead) >= self.max:
            self.fail(
                f"FIFO: {proc.name} (rev {held.revision}) holds with {len(ahead)} earlier "
                f"live keys ahead of it: {[int(kv.create_revision) for kv in ahead]}"
            )
        proc.holding = True
        # The guard, as conch/hold.py runs it: made with the hold, started at once (the
        # supervisor starts it once its child is spawned).
        proc.guard = g.GuardMachine(
            held.touch, held.revision, held.held_at, SimBackoff(self.rng).next
        )
        self._guard(proc, proc.guard.made())
        self._guard(proc, proc.guard.start())
        session = next(s for s in reversed(self.sessions) if s.lease_id == held.lease_id)
        if not session.machine.certainly_alive(self.etcd.now):
            # Held on a lease past its E (etcd away meanwhile): the supervisor's deadline
            # is already due, its child stopped before it could run.
            self._guard(proc, proc.guard.session_ended(loss.NOT_CONFIRMED))
        self._check_expiries()
        if self.auto_release:
            hold_for = self.rng.expovariate(0.7)
            self._timer(hold_for, proc, "job-ends", lambda: self.release(proc))

    def _hold_lost(self, proc: Proc, reason: loss.Loss) -> None:
        if proc.holding:
            self.log(f"{proc.name} hold lost: {reason} ({reason.reason.value})")
            assert proc.held is not None
            kv = self.etcd.kvs.get(proc.held.key)
            if reason.reason.slot_taken and kv and kv.create_revision == proc.held.revision:
                # The supervisor kills the child at once on such a loss: it must be true.
                self.fail(f"{proc.name} lost for {reason.reason.value}, yet etcd has its key")
            proc.holding = False
            self._release(proc, lost=True)

    def _guard(self, proc: Proc, actions: Sequence[g.GuardAction]) -> None:
        """Execute the actions of the hold's guard (``conch.core.guard.GuardMachine``), as
        conch/hold.py does: timers, the touch, the watch on our key, the look at it."""
        guard, held = proc.guard, proc.held
        assert guard is not None and held is not None
        for action in actions:
            self.counts[type(action).__name__] += 1
            if isinstance(action, g.GuardAfter):
                step = functools.partial(guard.step, action.step)
                later = functools.partial(self._guard_later, proc, step)
                self._timer(action.seconds, proc, "guard", later)
            elif isinstance(action, g.GuardCall):
                self.counts[f"GuardCall.{action.step.name}"] += 1
                if action.step is g.GuardStep.WATCH_OWN_KEY:
                    self._guard_watch(proc, action.start)
                elif action.step is g.GuardStep.LOOK:
                    self._guard_look(proc)
                else:
                    self._guard_touch(proc, action.step)
            elif isinstance(action, loss.Loss):
                self._hold_lost(proc, action)

    def _guard_later(self, proc: Proc, step: Callable[[], list[g.GuardAction]]) -> None:
        self._guard(proc, step())

    def _guard_touch(self, proc: Proc, step: g.GuardStep) -> None:
        """The touch the hold owes the waiter behind (KV.Txn on our create_revision)."""
        guard, held = proc.guard, proc.held
        assert guard is not None and held is not None
        call = codec.touch_call(held.key, held.revision, held.value, held.lease_id)

        def apply() -> Any:
            try:
                return self.etcd.txn(call.request)
            except ModelError as error:
                return error

        def deliver(answer: Any) -> None:
            if isinstance(answer, ModelError):
                self._guard(proc, guard.touch_failed(step, answer.message))
            else:
                revision = int(answer.header.revision)
                self._guard(proc, guard.touched(step, revision, answer.succeeded))

        self.requests += 1
        self.log(f"{proc.name} -> hold touch")
        self._in_flight(proc, "hold-touch", apply, deliver, True)

    def _guard_watch(self, proc: Proc, start: int) -> None:
        """Watch our key for deletion from ``start`` (the revision it is known ours at, + 1)."""
        guard, held = proc.guard, proc.held
        assert guard is not None and held is not None
        self._cancel_watch(proc, GUARD)

        def apply() -> None:
            if guard.done or GUARD in proc.cancelled:
                return
            request = rpc_pb2.WatchCreateRequest(
                key=held.key, start_revision=start, filters=[rpc_pb2.WatchCreateRequest.NOPUT]
            )
            try:
                model_id = self.etcd.watch_create(request)
            except ModelError:
                self._guard(proc, guard.watch_failed())
                return
            proc.watches[GUARD] = model_id
            self.watch_owner[model_id] = (proc, GUARD)

        proc.cancelled.discard(GUARD)
        self._in_flight(proc, "guard-watch", apply, None, False)

    def _guard_notice(self, proc: Proc, ended: bool) -> None:
        """A notice of the guard's watch: our key deleted, or the watch over (compacted,
        broken)."""
        if ended:
            proc.watches.pop(GUARD, None)
        assert proc.guard is not None
        self._guard(proc, proc.guard.notice(ended))

    def _guard_look(self, proc: Proc) -> None:
        """Read our key again after the guard's watch ended (KV.Range)."""
        guard, held = proc.guard, proc.held
        assert guard is not None and held is not None

        def apply() -> Any:
            try:
                return self.etcd.range(rpc_pb2.RangeRequest(key=held.key))
            except ModelError as error:
                return error

        def deliver(answer: Any) -> None:
            if isinstance(answer, ModelError):
                self._guard(proc, guard.watch_failed())
                return
            found = codec.key_rev(answer.kvs[0]) if answer.kvs else None
            self._guard(proc, guard.looked(found, int(answer.header.revision)))

        self.requests += 1
        self._in_flight(proc, "guard-look", apply, deliver, False)

    def release(self, proc: Proc) -> None:
        """The holder's job ends: give the slot back."""
        if not proc.holding:
            return
        proc.holding = False
        assert proc.guard is not None
        proc.guard.release()
        self.log(f"{proc.name} releases")
        self._release(proc, lost=False)

    def _release(self, proc: Proc, lost: bool) -> None:
        held = proc.held
        assert held is not None
        proc.done = True
        self._cancel_watch(proc, GUARD)
        if proc.shared is None:
            self._stop_session(held.lease_id)
            self.requests += 1
            self._in_flight(
                proc, "release-revoke", lambda: self._revoke(held.lease_id), lambda _: None, True
            )
            return
        if not lost:
            self.requests += 1
            withdraw = m.Withdraw(0, held.key, held.revision, held.lease_id, False)
            self._in_flight(
                proc, "release-delete", lambda: self._quiet(withdraw), lambda _: None, True
            )
        self._close_shared(proc)

    def _close_shared(self, proc: Proc) -> None:
        """The caller closes its shared session once done with it (revokes its lease)."""
        if proc.shared is None or not proc.shared.kept:
            return
        lease_id = proc.shared.lease_id
        proc.shared.kept = False
        proc.shared.machine.close()
        self.requests += 1
        self._in_flight(proc, "close-shared", lambda: self._revoke(lease_id), lambda _: None, True)

    def _revoke(self, lease_id: int) -> Any:
        try:
            return self.etcd.lease_revoke(rpc_pb2.LeaseRevokeRequest(ID=lease_id))
        except ModelError as error:
            return error

    def _quiet(self, withdraw: m.Withdraw) -> Any:
        try:
            return self.etcd.txn(codec.withdraw_call(withdraw).request)
        except ModelError as error:
            return error

    # -- time ----------------------------------------------------------------------------

    def _timer(
        self, seconds: float, proc: Proc | None, what: str, fire: Callable[[], None]
    ) -> None:
        self._seq += 1
        self.timers.append(Timer(self.etcd.now + seconds, self._seq, proc, what, fire))

    def advance(self, seconds: float) -> None:
        """Move the clock on by ``seconds``, firing what falls due on the way, in order:
        timers, keepalives, a session's certainty running out (before etcd may expire it),
        and the model's own lease expiry."""
        until = self.etcd.now + seconds
        while True:
            due = self._next_due(until)
            if due is None:
                break
            at, fire = due
            self.etcd.advance(max(0.0, at - self.etcd.now))
            fire()
            self._check_expiries()
        self.etcd.advance(max(0.0, until - self.etcd.now))
        self._check_expiries()

    def _next_due(self, until: float) -> tuple[float, Callable[[], None]] | None:
        best: tuple[float, int, Callable[[], None]] | None = None
        for timer in self.timers:
            if timer.at <= until and (best is None or (timer.at, timer.seq) < best[:2]):
                best = (timer.at, timer.seq, self._firing(timer))
        for i, session in enumerate(self.sessions):
            if session.machine.done or not session.kept:
                continue
            at = session.wake
            if at <= until and (best is None or (at, -1 - i) < best[:2]):
                best = (at, -1 - i, functools.partial(self._wake, session))
        return None if best is None else (best[0], best[2])

    def _wake(self, session: Session) -> None:
        session.wake = math.inf
        self._session_do(session, session.machine.wake(self.etcd.now))

    def _firing(self, timer: Timer) -> Callable[[], None]:
        def fire() -> None:
            self.timers.remove(timer)
            timer.fire()

        return fire

    # -- one step ------------------------------------------------------------------------

    def pending(self) -> bool:
        """Whether anything is in flight: a request, an answer, a watch notice."""
        return bool(self.in_flight or self.broken or self._notices())

    def _notices(self) -> list[int]:
        if not self.etcd.reachable:
            return []  # the watch stream is cut: notices wait (conch's hub resumes it)
        return [w for w in self.watch_owner if self.etcd.watch_pending(w)]

    def step_messages(self) -> bool:
        """Deliver one thing in flight, picked at random; False when nothing is."""
        items, notices, broken = list(self.in_flight), self._notices(), list(self.broken)
        weights = [item.weight for item in items]
        weights += [self.notice_weight] * len(notices) + [1.0] * len(broken)
        if not weights:
            return False
        pick = self.rng.choices(range(len(weights)), weights)[0]
        if pick < len(items):
            self._progress(items[pick])
        elif pick < len(items) + len(notices):
            self._notice(notices[pick - len(items)])
        else:
            self._deliver_broken(broken[pick - len(items) - len(notices)])
        return True

    def _progress(self, item: InFlight) -> None:
        if not item.applied:
            self.log("{} applied {}", item.proc.name, item.what)
            answer = item.apply()
            if answer is MORE:
                return  # one request of several: the next goes out
            item.applied, item.answer = True, answer
            if item.what == "open-watch":
                self.in_flight.remove(item)
            return
        self.in_flight.remove(item)
        answer = item.answer
        if item.write and self.rng.random() < self.lost_rate:
            self.log(f"{item.proc.name} answer to {item.what} lost")
            answer = _lost(answer)
        if isinstance(answer, tuple):
            opened, granted = answer
            self._on_opened(item.proc, opened, granted)
            return
        item.deliver(answer)

    def _on_opened(self, proc: Proc, opened: m.SessionOpened, granted: float) -> None:
        self._session(opened.lease_id, shared=False, granted_at=granted)
        self.feed(proc, opened)

    def _notice(self, model_id: int) -> None:
        proc, machine_id = self.watch_owner[model_id]
        response = self.etcd.watch_next(model_id, revisions=self.rng.choice((1, 1, 1, 3)))
        if response is None:
            return
        if machine_id == GUARD:
            if response.canceled:
                self.watch_owner.pop(model_id, None)
            if response.canceled or response.events:
                self.log(f"{proc.name}'s guard <- {'ended' if response.canceled else 'deleted'}")
                self._guard_notice(proc, ended=bool(response.canceled))
            return
        if response.canceled:
            self.watch_owner.pop(model_id, None)
            proc.watches.pop(machine_id, None)
        self.feed(proc, codec.watch_input(machine_id, Notice.of(response)))

    def _deliver_broken(self, broken: tuple[Proc, int, bool]) -> None:
        self.broken.remove(broken)
        proc, machine_id, compacted = broken
        if machine_id == GUARD:
            self._guard_notice(proc, ended=True)
            return
        gave_up = Notice(Compacted("compacted") if compacted else Unavailable("stream gave up"))
        self.feed(proc, codec.watch_input(machine_id, gave_up))

    # -- the world's doings --------------------------------------------------------------

    def break_watch(self) -> None:
        if not self.watch_owner:
            return
        model_id = self.rng.choice(sorted(self.watch_owner))
        proc, machine_id = self.watch_owner.pop(model_id)
        proc.watches.pop(machine_id, None)
        self.etcd.break_watch(model_id)
        self.log(f"{proc.name}'s watch {machine_id} breaks")
        self.broken.append((proc, machine_id, False))

    def compact(self) -> None:
        if self.etcd.revision > self.etcd.compact_revision:
            self.log(f"compaction at {self.etcd.revision}")
            self.etcd.auto_compact(self.etcd.revision)

    def outside_revoke(self, proc: Proc) -> None:
        """A lease revoked from outside (etcdctl): the key goes at once; a waiter learns it
        from its watch, a read, or the next keepalive; a holder from its guard, or the next
        keepalive."""
        lease_id = proc.held.lease_id if proc.held is not None else proc.waiter.lease_id
        if lease_id and lease_id in self.etcd.leases:
            self.log(f"{proc.name}'s lease {lease_id:x} revoked from outside")
            self.etcd.revoke_by_hand(lease_id)

    def outside_delete(self, proc: Proc) -> None:
        """A key deleted by hand (etcdctl del): its lease lives on."""
        key = proc.held.key if proc.held is not None else proc.waiter.key
        if key and key in self.etcd.kvs:
            self.log(f"{proc.name}'s key deleted from outside")
            self.etcd.delete_by_hand(key)

    def freeze_session(self, proc: Proc, seconds: float) -> None:
        """The process's keepalives stop reaching etcd for ``seconds`` (frozen, cut off):
        its holds end at E; etcd expires the lease a moment later, which the session
        learns once its keepalives get through again."""
        session = self.session_of(proc)
        if session is not None and not session.frozen:
            self.log(f"{proc.name}'s session {session.lease_id:x} frozen for {seconds:.1f}s")
            session.frozen = True
            self._timer(seconds, None, "thaw", functools.partial(self.thaw, session))

    def thaw(self, session: Session) -> None:
        session.frozen = False

    # -- the properties ------------------------------------------------------------------

    def check(self) -> None:
        """At every step: never more than N holders whose key is live, as the machines
        believe it, and each of them among the first N keys as the model has them; a holder
        whose key was deleted from outside is told by its guard within ASLEEP_BOUND steps
        (it could not be, were the key gone before the revision the guard watches from); a
        waiter the model says holds does not sleep on beyond ASLEEP_BOUND steps while no
        fault is active."""
        live = self.etcd.under(self.prefix)
        first = {bytes(kv.key): kv for kv in live[: self.max]}
        keyed = []
        for proc in (p for p in self.procs if p.holding):
            assert proc.held is not None
            kv = self.etcd.kvs.get(proc.held.key)
            if kv is not None and kv.create_revision == proc.held.revision:
                keyed.append(proc.name)
                if proc.held.key not in first:
                    ranks = [int(k.create_revision) for k in live]
                    self.fail(
                        f"{proc.name} believes it holds (rev {proc.held.revision}) but its key "
                        f"is not among the first {self.max} live keys {ranks}"
                    )
                continue
            deleted = self.etcd.deleted_at.get(proc.held.key, 0)
            assert proc.guard is not None
            if deleted <= proc.guard.held_at:
                self.fail(
                    f"{proc.name} holds a key deleted at {deleted}, not after the revision "
                    f"{proc.guard.held_at} its guard watches from: the loss goes unnoticed"
                )
            proc.unnoticed += 1 if self._steady() else 0
            if proc.unnoticed > ASLEEP_BOUND:
                self.fail(f"{proc.name} holds on {proc.unnoticed} steps after its key went")
        if len(keyed) > self.max:
            self.fail(f"{len(keyed)} holders of {self.max}: {keyed}")
        owners = {p.waiter.key: p for p in self.procs if p.waiter.outcome is None and p.waiter.key}
        for key, kv in first.items():
            sleeper = owners.get(key)
            if sleeper is None or sleeper.waiter.revision != kv.create_revision:
                continue
            if self._orphan_ahead(kv, live):
                continue
            sleeper.asleep += 1 if self._steady() else 0
            if sleeper.asleep > ASLEEP_BOUND:
                self.fail(
                    f"{sleeper.name} (rev {kv.create_revision}) asleep in state "
                    f"{sleeper.waiter.state.value} for {sleeper.asleep} steps while it holds a slot"
                )

    def _check_expiries(self) -> None:
        """The session machine's E (the earliest expiry) is never after etcd's own: a lease
        etcd still has expires no sooner; and no holder holds past its session's E (its
        child is stopped by then). Both change only as the clock moves (keepalives are
        answered as they are sent, as time passes): checked then, and at each grant."""
        self.live = [s for s in self.live if not s.machine.done]
        live = {s.lease_id: s for s in self.live}
        for session in live.values():
            lease = self.etcd.leases.get(session.lease_id)
            if lease is not None and lease.expires < session.machine.alive_until:
                self.fail(
                    f"lease {session.lease_id:x}: E {session.machine.alive_until:.3f} is after "
                    f"etcd's expiry {lease.expires:.3f}"
                )
        for proc in self.procs:
            mine = live.get(proc.held.lease_id) if proc.holding and proc.held else None
            if mine is not None and self.etcd.now > mine.machine.alive_until:
                self.fail(
                    f"{proc.name} holds past its session's E ({mine.machine.alive_until:.3f})"
                )

    def _steady(self) -> bool:
        """Whether this step counts towards a bound on sleeping: no fault active, no slow
        request in flight, nobody backing off (a pause, a guard's retry). A release then
        reaches the waiter it promotes in a bounded number of steps."""
        return not (
            self.faulty
            or any(item.weight < 1.0 for item in self.in_flight)
            or any(t.what in ("pause", "guard") for t in self.timers)
        )

    def _orphan_ahead(self, kv: kv_pb2.KeyValue, live: Sequence[kv_pb2.KeyValue]) -> bool:
        """Whether a key ahead of ``kv`` is an orphan: on a lease nobody keeps alive any more
        (its process gave up and its withdraw was lost, or it froze), so it goes only when
        the lease expires, within the TTL. A waiter behind the window whose predecessor is
        such a key (or waits behind one that is) is woken by no touch, only by that expiry:
        the recipe's documented limit, as with any crashed waiter."""
        kept = {s.lease_id for s in self.sessions if s.kept and not s.lost and not s.frozen}
        return any(
            other.create_revision < kv.create_revision and other.lease not in kept for other in live
        )

    def check_quiet(self) -> None:
        """With nothing in flight and no machine paused: every key among the first N
        belongs to a holder (or to one whose release is under way): nobody sleeps with a
        slot free."""
        for proc in self.procs:
            if proc.holding and proc.held is not None and proc.held.key not in self.etcd.kvs:
                self.fail(f"quiet, yet {proc.name} holds on a key deleted from outside")
        live = self.etcd.under(self.prefix)
        for kv in live[: self.max]:
            for proc in self.procs:
                if proc.waiter.outcome is None and proc.waiter.key == kv.key:
                    if self._orphan_ahead(kv, live):
                        self.counts["asleep-behind-an-orphan"] += 1
                        continue
                    self.fail(
                        f"quiet, yet {proc.name} (rev {kv.create_revision}) sleeps in state "
                        f"{proc.waiter.state.value} with a slot free"
                    )

    def quiet(self) -> bool:
        return not self.pending() and not any(
            t.what in ("pause", "guard")
            for t in self.timers
            if t.proc is not None and (not t.proc.done or t.what == "guard")
        )

    def check_empty(self) -> None:
        """Once every process is done, nothing is left: no watch open; after the TTL (no
        keepalive is sent any more), no key and no lease."""
        if self.etcd.watches:
            owners = [self.watch_owner.get(w, (None, 0))[0] for w in self.etcd.watches]
            self.fail(f"watches left open: {[p.name if p else '?' for p in owners]}")
        kept = [s for s in self.sessions if s.kept and not s.lost]
        if kept:
            self.fail(f"sessions still kept alive at the end: {[hex(s.lease_id) for s in kept]}")
        self.advance(TTL + 1)
        left = self.etcd.under(self.prefix)
        if left or self.etcd.leases:
            self.fail(
                f"left behind: keys {[kv.key for kv in left]}, leases "
                f"{[hex(lease) for lease in sorted(self.etcd.leases)]}"
            )


# -- one seeded schedule -------------------------------------------------------------------


@dataclass
class Stats:
    steps: int = 0
    held: int = 0
    gave_up: int = 0
    requests: int = 0
    counts: collections.Counter[str] = field(default_factory=collections.Counter)
    trace: Trace = field(default_factory=lambda: Trace())


def run(
    seed: int,
    max_holders: int | None = None,
    waiter: type[r.Waiter] = r.Waiter,
    reader: type[codec.ReadTogether] = codec.ReadTogether,
) -> Stats:
    """One schedule: its parameters, then its steps, all drawn from ``seed``. Raises
    PropertyFailed with the seed and the trace's tail when a property fails."""
    rng = random.Random(f"schedule:{seed}")  # its own stream, apart from the world's
    n = max_holders or rng.randint(1, 9)
    # Which etcd release, where releases differ (the space alarm; a stream of its own, so
    # the schedules' draws stay as they were).
    version = random.Random(f"release:{seed}").choice(RELEASES)
    world = World(seed, n, etcd=SimEtcd(version=version), waiter=waiter, reader=reader)
    world.counts[f"release.{version}"] += 1
    world.lost_rate = rng.choice((0.0, 0.05, 0.2))
    world.slow_rate = rng.choice((0.0, 0.1, 0.3))
    world.notice_weight = rng.choice((0.3, 1.0, 3.0))
    arrivals = rng.randint(1, 3 * n + 6)
    faults = rng.random() < 0.8
    # Each kind of step's weight: deliveries dominate, the world acts now and then.
    f = 1.0 if faults else 0.0
    rates = {
        "message": 10.0,
        "tick": 1.0,
        "arrive": 3.0,
        "release": 0.7,
        "burst": 0.1,
        "interrupt": 0.15 * f,
        "lose": 0.1 * f,
        "outside": 0.1 * f,
        "unreachable": 0.05 * f,
        "restart": 0.03 * f,
        "nospace": 0.05 * f,
        "compact": 0.2 * f,
        "break": 0.1 * f,
    }
    fault_ends: list[tuple[str, float]] = []
    for _ in range(rng.randint(0, arrivals)):  # a queue at once, or one that builds up
        world.arrive(shared=rng.random() < 0.3, timeout=rng.choice((None, None, 5.0)))
        world.check()
    for _ in range(RUN_STEPS):
        world.steps += 1
        arrived = len(world.procs)
        kinds = [k for k in rates if rates[k] and (k != "arrive" or arrived < arrivals)]
        kind = rng.choices(kinds, [rates[k] for k in kinds])[0]
        _do(world, rng, kind, fault_ends)
        world.faulty = bool(fault_ends)
        world.check()
        if world.quiet() and not world.faulty:
            world.check_quiet()
        if arrived >= arrivals and all(p.done for p in world.procs) and not world.pending():
            break
    # Calm: faults over, the holders' jobs end on their own, everything drains.
    if world.etcd.down:
        world.etcd.start()
    for session in world.sessions:
        session.frozen = False
    world.etcd.reachable, world.etcd.nospace, world.faulty = True, False, False
    world.log("calm")
    for _ in range(CALM_STEPS):
        if (
            len(world.procs) >= arrivals
            and all(p.done for p in world.procs)
            and not world.pending()
        ):
            break
        world.steps += 1
        if not world.step_messages():
            if world.quiet():
                world.check_quiet()
            world.advance(_next_timer(world) + 0.001)
        world.check()
        if len(world.procs) < arrivals and rng.random() < 0.05:
            world.arrive(shared=rng.random() < 0.3)
    else:
        world.fail(f"not done after {CALM_STEPS} calm steps")
    world.check_empty()
    return Stats(
        world.steps,
        sum(p.held is not None for p in world.procs),
        sum(isinstance(p.waiter.outcome, m.GaveUp) for p in world.procs),
        world.requests,
        world.counts,
        world.trace,
    )


def _next_timer(world: World) -> float:
    times = [t.at for t in world.timers]
    times += [s.wake for s in world.sessions if not s.machine.done]
    return max(0.0, min(times, default=world.etcd.now + 1.0) - world.etcd.now)


def _do(world: World, rng: random.Random, kind: str, fault_ends: list[tuple[str, float]]) -> None:
    now = world.etcd.now
    for fault, end in list(fault_ends):
        if end <= now:
            fault_ends.remove((fault, end))
            world.log(f"{fault} over")
            if fault == "restart":
                world.etcd.start()
            elif fault == "unreachable":
                world.etcd.reachable = True
            else:
                world.etcd.nospace = False
    waiting = [p for p in world.procs if p.waiter.outcome is None]
    holders = [p for p in world.procs if p.holding]
    world.counts[f"world.{kind}"] += 1
    if kind == "arrive":
        timeout = rng.choice((None, None, None, None, None, 0.0, rng.uniform(1.0, 20.0)))
        world.arrive(shared=rng.random() < 0.3, timeout=timeout)
    elif kind == "message":
        if not world.step_messages():
            world.advance(min(_next_timer(world) + 0.001, 0.5))
    elif kind == "tick":
        world.advance(rng.uniform(0.0, 0.3))
    elif kind == "release" and holders:
        world.release(rng.choice(holders))
    elif kind == "burst" and holders:
        for proc in rng.sample(holders, rng.randint(1, len(holders))):
            world.release(proc)
    elif kind == "interrupt" and (waiting or holders):
        proc = rng.choice(waiting + holders)
        if proc.holding:
            world.release(proc)
        else:
            world.feed(proc, m.Interrupt("sim"))
    elif kind == "lose" and (waiting or holders):
        world.freeze_session(rng.choice(waiting + holders), rng.uniform(0.5, 3 * TTL))
    elif kind == "outside" and (waiting or holders):
        proc = rng.choice(waiting + holders)
        if rng.random() < 0.5:
            world.outside_revoke(proc)
        else:
            world.outside_delete(proc)
    elif kind in ("unreachable", "restart", "nospace") and not any(
        f == kind or {f, kind} == {"unreachable", "restart"} for f, _ in fault_ends
    ):
        world.log(f"{kind} for a while")
        if kind in ("unreachable", "restart"):
            if kind == "restart":
                world.etcd.stop()  # no lease expires until it is back
            world.etcd.reachable = False
            for model_id in sorted(world.watch_owner):
                if rng.random() < 0.3:  # the hub gave up on this one
                    owner, machine_id = world.watch_owner.pop(model_id)
                    owner.watches.pop(machine_id, None)
                    world.etcd.break_watch(model_id)
                    world.broken.append((owner, machine_id, False))
        else:
            world.etcd.nospace = True
        fault_ends.append((kind, now + rng.choice((0.2, 0.5, 1.0, 3.0, 8.0))))
    elif kind == "compact":
        world.compact()
    elif kind == "break":
        world.break_watch()


# -- small helpers -------------------------------------------------------------------------


class Notice(NamedTuple):
    """A watch notice as conch's etcd layer hands it to the codec (``WatchNotice``)."""

    error: EtcdError | None
    created: bool = False
    revision: int = 0
    events: Sequence[kv_pb2.Event] = ()

    @classmethod
    def of(cls, response: rpc_pb2.WatchResponse) -> Notice:
        """A WatchResponse of the model, as the etcd layer makes it a notice."""
        if not response.canceled:
            return cls(None, response.created, int(response.header.revision), response.events)
        if response.compact_revision:
            return cls(Compacted("watch start revision compacted", response.compact_revision))
        return cls(EtcdError(f"watch cancelled by etcd: {response.cancel_reason}"))


class _Status(grpc.RpcError, grpc.Call):
    """A ModelError as gRPC raises the error etcd answered (for ``map_rpc_error``)."""

    def __init__(self, error: ModelError) -> None:
        self._error = error

    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode[self._error.code]

    def details(self) -> str:
        return self._error.message

    def initial_metadata(self) -> Any:
        return ()

    def trailing_metadata(self) -> Any:
        return ()

    def is_active(self) -> bool:
        return False

    def time_remaining(self) -> float:
        return 0.0

    def cancel(self) -> bool:
        return False

    def add_callback(self, callback: Any) -> bool:
        return False


def etcd_error(error: ModelError) -> EtcdError:
    """What conch's etcd layer makes of the error etcd answered (its one mapping)."""
    return map_rpc_error(_Status(error))


def _lost(answer: Any) -> Any:
    """What the machine sees of an answer lost on the way: its request timed out."""
    if isinstance(answer, tuple):
        answer = answer[0]
    machine_id = getattr(answer, "id", None)
    if isinstance(answer, m.Over) or machine_id is None or machine_id == 0:
        return answer
    return codec.failed(machine_id, etcd_error(ModelError("DEADLINE_EXCEEDED", "answer lost")))


class Trace:
    """The schedule's lines, kept as records and formatted only when read (a failure, a
    replay): formatting each step's line costs more than the step."""

    def __init__(self) -> None:
        self._records: list[tuple[int, float, int, str, tuple[object, ...]]] = []

    def add(self, record: tuple[int, float, int, str, tuple[object, ...]]) -> None:
        self._records.append(record)

    def lines(self) -> list[str]:
        return [
            f"{steps} t={now:.2f} rev={revision} "
            + (line.format(*map(_short, items)) if items else line)
            for steps, now, revision, line, items in self._records
        ]

    def __iter__(self) -> Iterator[str]:
        return iter(self.lines())

    def __len__(self) -> int:
        return len(self._records)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Trace) and self.lines() == other.lines()

    __hash__ = None  # type: ignore[assignment]


def _short(item: object) -> str:
    if isinstance(item, str):
        return item
    name = type(item).__name__
    fields = getattr(item, "__dataclass_fields__", {})
    parts = []
    for f in fields:
        value = getattr(item, f)
        if isinstance(value, bytes):
            value = value.rsplit(b"/", 1)[-1].decode(errors="replace")
        elif isinstance(value, (list, tuple)):
            value = f"[{len(value)}]"
        parts.append(f"{f}={value}")
    return f"{name}({', '.join(parts)})"


# -- the cost of a release -----------------------------------------------------------------


def settle(world: World, limit: int = 100000) -> None:
    """Deliver everything in flight and fire every timer due, until nothing is left to do
    but keepalives (no faults, no lost answers: the calm a cost is measured in)."""
    for _ in range(limit):
        if world.step_messages():
            continue
        if not world.timers:
            return
        world.advance(max(0.0, min(t.at for t in world.timers) - world.etcd.now) + 0.001)
    world.fail(f"not settled after {limit} steps")


def cost_per_release(
    max_holders: int, queued: int, releases: int, seed: int = 0
) -> list[tuple[int, int]]:
    """For each of ``releases`` releases, each by a holder picked at random, with ``queued``
    waiters behind the N holders: the requests sent to etcd (by every machine and holder)
    and the watch notices delivered, from the release until all is settled again. No
    arrivals, no faults."""
    world = World(seed, max_holders, auto_release=False)
    for _ in range(max_holders + queued):
        world.arrive()
    settle(world)
    costs = []
    for _ in range(releases):
        holders = [p for p in world.procs if p.holding]
        requests, notices = world.requests, world.counts["Watched.events"]
        world.release(world.rng.choice(holders))
        settle(world)
        world.check()
        world.check_quiet()
        costs.append((world.requests - requests, world.counts["Watched.events"] - notices))
    return costs


def drain_under_alarm(version: str, waiters: int = 6) -> list[str]:
    """The space alarm's case: one holder at max 1 and ``waiters`` queued behind it, then
    etcd's backend at its quota (``version``'s alarm), then each holder releasing in turn.
    Who held, in order (each new holder within 20 model seconds of the release, or the
    list ends there)."""
    world = World(0, 1, etcd=SimEtcd(version=version), auto_release=False)
    for _ in range(waiters + 1):
        world.arrive()
        settle(world)
    world.etcd.nospace = world.faulty = True
    order = [p.name for p in world.procs if p.holding]
    while len(order) <= waiters:
        world.release(next(p for p in world.procs if p.holding))
        deadline = world.etcd.now + 20.0
        while not any(p.holding for p in world.procs) and world.etcd.now < deadline:
            if not world.step_messages():
                world.advance(_next_timer(world) + 0.001)
            world.check()
        holders = [p.name for p in world.procs if p.holding]
        if not holders:
            break
        order += holders
    return order
