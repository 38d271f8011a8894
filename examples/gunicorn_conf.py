"""gunicorn settings for a WSGI app that uses conch (here examples/django_app.py's).

    CONCH_ENDPOINTS=127.0.0.1:2379 gunicorn -c examples/gunicorn_conf.py \
        examples.django_app:wsgi_app

gunicorn forks its workers from the master, and gRPC channels do not survive ``fork()``
(docs/embedding.md, "Pre-fork servers"). With ``preload_app`` the master imports the app
(and conch) once; what makes that safe is that the master never connects: each worker
connects its own client after the fork (``post_fork``, eagerly, so that a worker that cannot
reach etcd says so at start) and closes it when it exits, releasing any hold left. The
master's ``timeout`` restarts a worker that does not come up or hangs.
"""

from __future__ import annotations

import os
from typing import Any

bind = os.environ.get("CONCH_EXAMPLE_BIND", "127.0.0.1:8000")
workers = int(os.environ.get("CONCH_EXAMPLE_WORKERS", "3"))
worker_class = "sync"
preload_app = True
timeout = 30
graceful_timeout = 10  # a request holding a slot has this long to finish at shutdown


def post_fork(server: Any, worker: Any) -> None:
    from examples import django_app

    django_app.process_client()  # this worker's own client


def worker_exit(server: Any, worker: Any) -> None:
    from examples import django_app

    django_app.close_process_client()
