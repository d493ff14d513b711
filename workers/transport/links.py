"""The gateway's end of one replica channel, by transport (``GatewayConfig.channel``): how its
batches arrive and how requests are submitted and aborted on it. ``ChannelReplicaHandle``
composes one of them with the ``Demux`` that hands each request its items.

- ``RayLink``: a Ray streaming call (``open_channel``) carries the batches; submits and aborts
  are Ray calls.
- ``SocketLink``: a TCP connection to the actor (``socket_channel.py``; a Ray call says where it
  listens) carries both ways.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Protocol

from tandem_core.protocol import EngineRequest
from workers.transport.channel import Batch
from workers.transport.socket_channel import ChannelClient


class Actor(Protocol):
    """What a link needs of its handle: the replica's actor methods."""

    async def call(self, method: str, *args): ...

    def stream(self, method: str, *args) -> AsyncIterator: ...


class Link(Protocol):
    def batches(self) -> AsyncIterator[Batch]:
        """Every batch the replica sends on this channel, until either end closes it."""

    async def submit(self, request: EngineRequest) -> None:
        """Start a request on the replica; its items come back in ``batches``."""

    def abort_soon(self, request_id: str) -> None:
        """Abort a request there, without waiting (best effort: the replica may be gone)."""

    def close(self) -> None:
        """Stop waiting for the channel to open (requests waiting to submit fail)."""


class RayLink:
    def __init__(self, channel_id: str, actor: Actor):
        self.channel_id, self.actor = channel_id, actor

    def batches(self) -> AsyncIterator[Batch]:
        return self.actor.stream("open_channel", self.channel_id)

    async def submit(self, request: EngineRequest) -> None:
        await self.actor.call("submit", self.channel_id, request)

    def abort_soon(self, request_id: str) -> None:
        asyncio.ensure_future(self._abort_quietly(request_id))

    async def _abort_quietly(self, request_id: str) -> None:
        try:
            await self.actor.call("abort", request_id)
        except Exception:  # noqa: BLE001 - the replica may be gone; nothing to abort then
            pass

    def close(self) -> None:
        pass


class SocketLink:
    def __init__(self, channel_id: str, lease_s: float | None, actor: Actor):
        self.channel_id, self.lease_s, self.actor = channel_id, lease_s, actor
        # the open connection, once connected (fails if it could not be opened)
        self._client: asyncio.Future[ChannelClient] = asyncio.get_running_loop().create_future()

    async def batches(self) -> AsyncIterator[Batch]:
        """Where it listens comes from the actor (a Ray call), then batches until either end
        closes the connection."""
        conn = None
        try:
            host, port, token = await self.actor.call("open_socket", self.channel_id, self.lease_s)
            conn = await ChannelClient.connect(host, port, token)
            self._client.set_result(conn)
            async for batch in conn.batches():
                yield batch
        except Exception as e:
            _resolve(self._client, e)  # requests waiting to submit hear why
            raise
        finally:
            if conn is not None:
                conn.close()  # the replica aborts whatever was still running on it

    async def submit(self, request: EngineRequest) -> None:
        # shielded: a request given up while the channel connects leaves it be
        await (await asyncio.shield(self._client)).submit(request)

    def abort_soon(self, request_id: str) -> None:
        client = self._client
        if client.done() and not client.cancelled() and client.exception() is None:
            conn = client.result()
            if not conn.closed:  # closed: the replica aborted everything on it already
                conn.abort(request_id)
        # not connected yet: this request was never submitted

    def close(self) -> None:
        _resolve(self._client, ConnectionAbortedError("the channel was closed"))


def _resolve(client: asyncio.Future, exc: Exception) -> None:
    """A socket channel that will not connect (any more): requests waiting to submit get ``exc``."""
    if not client.done():
        client.set_exception(exc)
        client.exception()  # retrieved: no request may come to ask
