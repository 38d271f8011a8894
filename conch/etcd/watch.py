"""The Watch stream: keys watched from a start revision, events delivered to a mailbox."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from conchpb.etcdserverpb import rpc_pb2
from conchpb.mvccpb import kv_pb2

from conch.errors import Compacted, EtcdError
from conch.etcd.client import BidiStream, Client, StreamItem

PUT = kv_pb2.Event.PUT
DELETE = kv_pb2.Event.DELETE


@dataclass(frozen=True)
class WatchNotice:
    """What a Watch delivers: ``events`` (etcd mvccpb.Event list) and the response's header
    ``revision``; or, last, ``error`` (Compacted with the oldest revision left, or another
    EtcdError) when the watch ended."""

    watch: Watch
    events: Sequence[kv_pb2.Event]
    revision: int
    error: EtcdError | None = None


class Watch:
    """Watch.Watch on ``keys`` (each one key, or a prefix with ``prefix=True``) from
    ``start_revision`` on, on one stream. Notices go to ``deliver`` from a reader thread.
    ``only_deletes`` asks etcd to filter out PUT events. ``cancel()`` stops delivery."""

    def __init__(
        self,
        client: Client,
        keys: Sequence[bytes],
        start_revision: int,
        deliver: Callable[[WatchNotice], None],
        only_deletes: bool = False,
    ) -> None:
        self._deliver = deliver
        self._cancelled = False
        self._stream = BidiStream(client, "watch", "Watch", self._on_item)
        filters = [rpc_pb2.WatchCreateRequest.NOPUT] if only_deletes else []
        for key in keys:
            self._stream.send(
                rpc_pb2.WatchRequest(
                    create_request=rpc_pb2.WatchCreateRequest(
                        key=key, start_revision=start_revision, filters=filters
                    )
                )
            )

    def cancel(self) -> None:
        self._cancelled = True
        self._stream.close()

    def _on_item(self, item: StreamItem) -> None:
        if self._cancelled:
            return
        if item.error is not None:
            self._deliver(WatchNotice(self, (), 0, item.error))
            return
        response = item.response
        revision = response.header.revision
        if response.canceled:
            error: EtcdError
            if response.compact_revision:
                error = Compacted(
                    f"watch start revision compacted (oldest left {response.compact_revision})",
                    response.compact_revision,
                )
            else:
                error = EtcdError(f"watch cancelled by etcd: {response.cancel_reason}")
            self._deliver(WatchNotice(self, (), revision, error))
            self.cancel()
        elif response.events:
            self._deliver(WatchNotice(self, list(response.events), revision))
