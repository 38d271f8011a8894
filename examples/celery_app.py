"""Celery (prefork): at most N tasks at once touch a backend, across every worker host.

    CONCH_ENDPOINTS=127.0.0.1:2379 celery -A examples.celery_app worker --pool prefork -c 4

The pool's processes are forked from the worker's main process, and gRPC channels do not
survive ``fork()`` (docs/embedding.md, "Pre-fork servers"). So the main process never
touches etcd: each pool process connects its own ``conch.Client`` in
``worker_process_init`` and closes it in ``worker_process_shutdown``. A task takes a slot of
``CONCH_EXAMPLE_NAME`` [``CONCH_EXAMPLE_MAX``] for its body; when none comes within
``CONCH_EXAMPLE_WAIT`` seconds it is retried later (``conch.NoSlot`` is retryable, like
exit 75), rather than holding a pool process hostage.

The broker here is Celery's filesystem transport (``CONCH_EXAMPLE_BROKER_DIR``), so the
example runs with no broker server; any broker does. Celery is not a dependency of conch.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from celery import Celery, Task
from celery.signals import worker_process_init, worker_process_shutdown

import conch

_base = Path(os.environ.get("CONCH_EXAMPLE_BROKER_DIR", "/tmp/conch-celery"))
for _folder in ("queue", "processed", "results"):
    (_base / _folder).mkdir(parents=True, exist_ok=True)

app = Celery("conch_example", broker="filesystem://", backend=f"file://{_base / 'results'}")
app.conf.broker_transport_options = {
    "data_folder_in": str(_base / "queue"),
    "data_folder_out": str(_base / "queue"),
    "processed_folder": str(_base / "processed"),
}
app.conf.broker_connection_retry_on_startup = True

NAME = os.environ.get("CONCH_EXAMPLE_NAME", "billing")
MAX = int(os.environ.get("CONCH_EXAMPLE_MAX", "3"))
WAIT = float(os.environ.get("CONCH_EXAMPLE_WAIT", "10"))
JOB = float(os.environ.get("CONCH_EXAMPLE_JOB", "0.2"))
JOURNAL = os.environ.get("CONCH_EXAMPLE_JOURNAL")

_client: conch.Client | None = None


@worker_process_init.connect
def connect_conch(**_: Any) -> None:
    """In each pool process, after the fork: its own client."""
    global _client
    _client = conch.connect(os.environ.get("CONCH_ENDPOINTS", "127.0.0.1:2379"))


@worker_process_shutdown.connect
def close_conch(**_: Any) -> None:
    if _client is not None:
        _client.close()


@app.task(bind=True, max_retries=None)
def call_backend(self: Task[Any, Any], job: str) -> int:
    """The backend call under a slot; returns the fencing token it ran with."""
    assert _client is not None, "worker_process_init connects the client"
    sema = conch.Semaphore(_client, NAME, max=MAX, ttl=10)
    try:
        with sema.acquire(timeout=WAIT) as hold:
            _journal(f"start {job} {hold.revision}")
            time.sleep(JOB)  # the call to the backend, fenced by hold.revision
            hold.check()
            _journal(f"end {job} {hold.revision}")
            return hold.revision
    except conch.NoSlot as exc:
        raise self.retry(exc=exc, countdown=1) from exc


def _journal(line: str) -> None:
    if JOURNAL:
        with open(JOURNAL, "a") as out:  # one short append per line: lines do not interleave
            out.write(f"{time.monotonic():.6f} {line}\n")
