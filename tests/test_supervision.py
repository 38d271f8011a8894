"""The supervision against real etcd: every fatal signal, what the child leaves behind outside
its process group, and a hold lost before the child starts."""

from __future__ import annotations

import logging
import signal
from pathlib import Path

import pytest

from conch.errors import NoSlot
from conch.etcd import Client, lease
from conch.flag import Flag
from conch.hold import Hold
from conch.semaphore import Semaphore
from conch.supervisor import supervise
from tests.conftest import DEADLINE, Gate, Runner, poll, sema_keys
from tests.test_sema import DEFAULT_SIGNALS, _ignored

# The signals whose default action ends a process that conch handled as anything but that
# (INT, TERM and HUP are covered in test_sema): the named ones and both ends of the real-time
# range.
FATAL_SIGNALS = [
    signal.SIGQUIT,
    signal.SIGUSR1,
    signal.SIGUSR2,
    signal.SIGALRM,
    signal.SIGVTALRM,
    signal.SIGPROF,
    signal.SIGIO,
    signal.SIGPWR,
    signal.SIGSTKFLT,
    signal.SIGXCPU,
    signal.SIGRTMIN,
    signal.SIGRTMAX,
]


def test_every_fatal_signal_to_a_queued_conch_withdraws_and_exits_128_plus_it(
    conch: Runner, gate: Gate, client: Client, name: str
) -> None:
    """SIGQUIT (^\\), SIGUSR1, SIGALRM and the like killed a queued conch outright, leaving
    its key in etcd until the lease's TTL ran out. Each now withdraws, as SIGTERM does."""
    holder = conch.start("sema", name, "--max", "1", "--", *gate.cmd("h"))
    poll(lambda: gate.now_running() == {"h"}, what="holder")
    waiters = {
        sig: conch.start("sema", name, "--max", "1", "--", "true", launcher=DEFAULT_SIGNALS)
        for sig in FATAL_SIGNALS
    }
    poll(lambda: len(sema_keys(client, name)) == 1 + len(waiters), what="every waiter queued")
    for sig, waiter in waiters.items():
        waiter.signal(sig)
    codes = {sig: waiter.wait() for sig, waiter in waiters.items()}
    assert codes == {sig: 128 + sig for sig in FATAL_SIGNALS}
    assert len(sema_keys(client, name)) == 1, "a waiter left its key behind"
    for sig, waiter in waiters.items():
        assert f"event=interrupted name={name} signum={int(sig)}" in waiter.log()
    gate.release("h")
    assert holder.wait() == 0


@pytest.mark.parametrize("sig", [signal.SIGQUIT, signal.SIGRTMIN])
def test_a_fatal_signal_to_a_running_conch_terminates_the_child_and_releases(
    conch: Runner, client: Client, name: str, tmp_path: Path, sig: int
) -> None:
    """As SIGTERM: the child's group gets SIGTERM, conch releases and exits with the child's
    status (contract section 7)."""
    up, marker = tmp_path / "up", tmp_path / "trapped"
    script = f"trap 'echo term > {marker}; exit 42' TERM; touch {up}; while :; do sleep 0.05; done"
    proc = conch.start("sema", name, "--max", "1", "--", "sh", "-c", script)
    poll(up.exists, what="child up")
    proc.signal(sig)
    assert proc.wait() == 42, proc.log()
    assert marker.read_text().strip() == "term"
    assert sema_keys(client, name) == []
    events = proc.events()
    assert events.index("signal") < events.index("term-sent") < events.index("released")


def test_fatal_signals_ignored_by_whoever_started_conch_stay_ignored(
    conch: Runner, name: str, tmp_path: Path
) -> None:
    """A script's background job ignores SIGQUIT as it does SIGINT; whatever is ignored when
    conch starts neither stops conch nor reaches the child as anything but ignored."""
    up, status = tmp_path / "up", tmp_path / "status"
    script = f"cat /proc/self/status > {status}; touch {up}; while :; do sleep 0.05; done"
    ignoring = ["sh", "-c", "trap '' QUIT USR1; exec \"$@\"", "sh"]
    launcher = [*DEFAULT_SIGNALS, *ignoring]
    proc = conch.start("sema", name, "--max", "1", "--", "sh", "-c", script, launcher=launcher)
    poll(up.exists, what="child up")
    assert _ignored(status.read_text()) == (1 << (signal.SIGQUIT - 1)) | (1 << (signal.SIGUSR1 - 1))
    for sig in (signal.SIGQUIT, signal.SIGUSR1, signal.SIGTERM):
        proc.signal(sig)
    assert proc.wait() == 128 + signal.SIGTERM
    assert f"event=signal signum={int(signal.SIGTERM)} " in proc.log()


# -- a hold lost before the child starts -------------------------------------------------------


class LostOnce(Semaphore):
    """A semaphore whose first hold is lost right after its acquisition, before the child
    starts: its lease revoked from outside, and the session has noticed."""

    rounds = 0

    def _acquire(self, timeout: float | None, interrupt: Flag | None) -> Hold:
        hold = super()._acquire(timeout, interrupt)
        LostOnce.rounds += 1
        if LostOnce.rounds == 1:
            lease.revoke(self.client, hold.lease_id)
            assert hold.lost.wait(DEADLINE), "the session did not notice the revoke"
        return hold


def test_a_hold_lost_before_the_child_starts_requeues_and_the_child_runs(
    client: Client, name: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A waiter whose session died as it reached the front logged acquired, then lost, and
    exited 70 without ever running its command. Nothing ran: it queues again instead."""
    LostOnce.rounds = 0
    caplog.set_level(logging.INFO, logger="conch")
    marker = tmp_path / "ran"
    sema = LostOnce(client, name, max=1, ttl=3)
    assert supervise(sema, ["touch", str(marker)], 20.0, 1.0, Flag("stop")) == 0
    assert LostOnce.rounds == 2 and marker.exists()
    assert "event=requeue" in caplog.text and "before the child started" in caplog.text
    assert sema_keys(client, name) == []


def test_a_hold_lost_before_the_child_starts_with_no_wait_left_is_no_slot(
    client: Client, name: str, tmp_path: Path
) -> None:
    """--nonblock (or a --wait run out): the lost hold is no slot (exit 75), not a loss
    while the child ran (70); the child never starts and nothing is left in etcd."""
    LostOnce.rounds = 0
    marker = tmp_path / "ran"
    sema = LostOnce(client, name, max=1, ttl=3)
    with pytest.raises(NoSlot) as raised:
        supervise(sema, ["touch", str(marker)], 0.0, 1.0, Flag("stop"))
    assert raised.value.exit_code == 75
    assert LostOnce.rounds == 1 and not marker.exists()
    assert sema_keys(client, name) == []
