"""Who holds or waits: the JSON value at every key (contract section 6). Why ``cmd`` is the
program's name only unless ``record_args``: docs/design.md, "The key schema"."""

from __future__ import annotations

import json
import os
import socket
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from datetime import UTC, datetime

CMD_MAX_BYTES = 256


def cut_utf8(text: str, limit: int) -> str:
    """``text`` cut to at most ``limit`` bytes of UTF-8 without splitting a character."""
    return text.encode("utf-8", "replace")[:limit].decode("utf-8", "ignore")


@dataclass(frozen=True)
class Identity:
    """Who holds or waits: the value at every key, one line of JSON (docs/design.md)."""

    host: str
    pid: int
    started: str  # UTC RFC 3339; a key says when it was written (``entering``)
    cmd: str

    @classmethod
    def current(
        cls, argv: Sequence[str] = (), host: str | None = None, record_args: bool = False
    ) -> Identity:
        """This process's identity for running ``argv``: ``cmd`` is ``argv[0]`` (empty for
        no argv), or with ``record_args`` the whole of ``argv`` joined by spaces; either cut
        to CMD_MAX_BYTES bytes of UTF-8. ``host`` defaults to ``CONCH_HOST``, else the hostname."""
        cmd = cut_utf8(" ".join(argv if record_args else argv[:1]), CMD_MAX_BYTES)
        host = host or os.environ.get("CONCH_HOST") or socket.gethostname()
        return cls(host, os.getpid(), "", cmd).entering()

    def entering(self) -> Identity:
        """This identity, ``started`` now: what a key written now says (a Semaphore of a
        long-lived service is made long before it queues)."""
        return replace(self, started=datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"))

    def to_json(self) -> bytes:
        return json.dumps(asdict(self), ensure_ascii=False, separators=(",", ":")).encode("utf-8")
