"""How a unary call is retried: the endpoint and time of each attempt, which failures fail
over or renew the token, and the capped, jittered backoff between rounds; the same
decisions for blocking calls and for coroutines."""

from __future__ import annotations

import random
import time
from typing import TYPE_CHECKING

from conch.errors import EtcdError, TokenInvalid, Unavailable
from conch.etcd.endpoints import Endpoint, check_timeout

if TYPE_CHECKING:
    from conch.etcd.client import Client

BACKOFF_FIRST = 0.05  # seconds
BACKOFF_CAP = 1.0  # seconds
ATTEMPT_FIRST = 1.0  # seconds; see _attempt_time


_JITTER = random.Random()


class Backoff:
    """Capped exponential backoff with decorrelated jitter: ``next()`` gives the next pause
    in seconds, drawn from [``first``, 3 x the previous pause] (the first from [``first``,
    3 x ``first``]), never over ``cap``.

    Without jitter every waiter on every machine that saw one outage would retry in
    lockstep after it (the pauses of all of them the same sequence), each retry a burst
    on etcd. ``rng`` (a ``random.Random``) makes the sequence reproducible; ``reset()``
    starts again from ``first`` (after progress)."""

    def __init__(
        self,
        first: float = BACKOFF_FIRST,
        cap: float = BACKOFF_CAP,
        rng: random.Random | None = None,
    ) -> None:
        self._first = first
        self._cap = cap
        self._last = first
        # One generator for all by default: seeding one costs tens of microseconds (from
        # os.urandom), and a Hold makes its Backoff on the handoff's path.
        self._rng = rng or _JITTER

    def next(self) -> float:
        self._last = min(self._cap, self._rng.uniform(self._first, self._last * 3))
        return self._last

    def reset(self) -> None:
        self._last = self._first


def _attempt_time(rounds: int) -> float:
    """Seconds one attempt of a unary call may take on one member, with other endpoints to
    try, after ``rounds`` full rounds over the endpoints failed. A silent member (cut off, or
    a leader cut from us) holds each call this long before another member is asked, so it
    starts short; it doubles each round, so a link that is only slow still gets calls
    through. (An attempt of half the time left held a LeaseRevoke 2.5 s on an unreachable
    leader, and the next holder waited as long.)"""
    return ATTEMPT_FIRST * 2.0 ** min(rounds, 6)


class Attempts:
    """The decisions of one unary call across its attempts, the same for ``Client.call``
    and ``Client.call_async``: the endpoint and time of each attempt, which errors fail over
    (UNAVAILABLE, a timeout) and which mean a stale token, when to give up, and the pause
    before the next attempt (capped exponential backoff between rounds over the endpoints).
    ``timeout`` (seconds, default the client's ``request_timeout``) bounds the whole call."""

    def __init__(self, client: Client, timeout: float | None) -> None:
        if timeout is not None:
            check_timeout("timeout", timeout)  # nan or inf would make gRPC wait forever
        self._client = client
        total = client.request_timeout if timeout is None else timeout
        self.deadline = time.monotonic() + total
        self._backoff = Backoff()
        self._tried_in_round = self._stale_tokens = self._rounds = 0

    def left(self) -> float:
        """Seconds left until the call's deadline (negative once past)."""
        return self.deadline - time.monotonic()

    def next(self) -> tuple[Endpoint, float]:
        """The endpoint of the next attempt, and the seconds it may take there."""
        endpoint = self._client.endpoint
        left = self.left()
        many = len(self._client.endpoints) > 1
        attempt = min(left, _attempt_time(self._rounds)) if many else left
        return endpoint, max(attempt, 0.001)

    def failed(self, error: EtcdError, endpoint: Endpoint, token: str | None) -> float:
        """After an attempt on ``endpoint`` (carrying ``token``) failed with ``error``: the
        seconds to pause before the next attempt (0: at once). Raises ``error`` when it is
        not worth retrying or time is up (Unavailable when a fresh token never came)."""
        stale = isinstance(error, TokenInvalid) and token is not None
        if not (stale or isinstance(error, Unavailable)) or time.monotonic() >= self.deadline:
            if stale:
                # Out of time while renewing a token (a restarted member that forgot
                # it, a burst of auth changes): as transient as a member that is away.
                raise Unavailable(f"no fresh auth token accepted in time: {error}") from None
            raise error
        if stale:
            # Any auth change makes every JWT token issued before it stale, and a burst
            # of them can outrun any fixed number of retries: retry while time is left,
            # at once after the first stale token, then backing off.
            self._client.invalidate_token(token)
            self._stale_tokens += 1
            if self._stale_tokens == 1:
                return 0.0
        else:
            self._client.failover(endpoint)
            self._tried_in_round += 1
            if self._tried_in_round < len(self._client.endpoints):
                return 0.0
            self._tried_in_round = 0
            self._rounds += 1
        return min(self._backoff.next(), max(0.0, self.left()))
