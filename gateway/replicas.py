"""Replicas as the gateway sees them, and the handles that reach their engines.

``ReplicaHandle`` is the gateway's side of ``workers.protocol.Engine``. ``RayReplicaHandle``
talks to an ``EngineActor`` through Ray streaming generators; ``LocalReplicaHandle`` runs
an engine in the gateway's own process (unit tests, no Ray).
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Protocol

from gateway.errors import ErrorKind, TandemError
from workers.channel import Demux, items_of
from workers.protocol import EngineInfo, EngineStats, Item

logger = logging.getLogger(__name__)


class ReplicaState(str, Enum):
    STARTING = "starting"
    HEALTHY = "healthy"
    UNHEALTHY = "unhealthy"
    FAILED = "failed"  # could not start


class ReplicaHandle(Protocol):
    def generate(self, route: str, body: dict, request_id: str) -> AsyncIterator[Item]: ...
    async def abort(self, request_id: str) -> bool: ...
    async def check_health(self) -> None: ...
    async def stats(self) -> EngineStats: ...
    async def start(self) -> EngineInfo: ...
    async def shutdown(self) -> None: ...


@dataclass(eq=False)
class Replica:
    id: str
    model: str
    handle: Any  # ReplicaHandle
    state: ReplicaState = ReplicaState.STARTING
    outstanding: int = 0
    info: EngineInfo | None = None
    last_error: str | None = None
    consecutive_failures: int = 0
    extra: dict = field(default_factory=dict)


class ChannelReplicaHandle:
    """Reaches an ``EngineActor`` through one multiplexed channel (``workers/channel.py``).

    ``call(method, *args)`` awaits one actor method; ``stream(method, *args)`` iterates a
    streaming one. Subclasses bind them to Ray or to an in-process actor.
    """

    def __init__(self) -> None:
        self.channel_id = uuid.uuid4().hex
        self._demux: Demux | None = None
        self._reader: asyncio.Task | None = None

    async def call(self, method: str, *args):
        raise NotImplementedError

    def stream(self, method: str, *args) -> AsyncIterator:
        raise NotImplementedError

    def _dead(self, exc: BaseException) -> TandemError:
        return TandemError(ErrorKind.ENGINE_DEAD, "the replica serving this request failed")

    def _channel(self) -> Demux:
        """The open channel; (re)opened when there is none or it broke (e.g. after a restart)."""
        if self._demux is None or self._demux.broken is not None:
            self._demux = Demux()
            self._reader = asyncio.create_task(self._read(self._demux), name=f"channel-{self.channel_id}")
        return self._demux

    async def _read(self, demux: Demux) -> None:
        try:
            async for batch in self.stream("open_channel", self.channel_id):
                demux.feed(batch)
            err = TandemError(ErrorKind.ENGINE_DEAD, "the replica closed its channel")
        except asyncio.CancelledError:
            demux.fail_all(TandemError(ErrorKind.ENGINE_DEAD, "the gateway is shutting down"))
            raise
        except Exception as e:  # noqa: BLE001 - whatever broke it, every request on it must end
            logger.warning("channel %s broke: %s: %s", self.channel_id, type(e).__name__, e)
            err = self._dead(e)
        demux.fail_all(err)

    async def start(self) -> EngineInfo:
        info = await self.call("start")
        self._channel()
        return info

    async def generate(self, route: str, body: dict, request_id: str) -> AsyncIterator[Item]:
        demux = self._channel()
        queue = demux.register(request_id)
        finished = False
        try:
            try:
                await self.call("submit", self.channel_id, route, body, request_id)
            except TandemError:
                raise
            except Exception as e:  # noqa: BLE001
                raise self._dead(e) from e
            async for item in items_of(queue):
                yield item
            finished = True
        finally:
            demux.unregister(request_id)
            if not finished:  # the client went away (or the stream failed): abort it there
                asyncio.ensure_future(self._abort_quietly(request_id))

    async def _abort_quietly(self, request_id: str) -> None:
        try:
            await self.call("abort", request_id)
        except Exception:  # noqa: BLE001 - the replica may be gone; nothing to abort then
            pass

    async def abort(self, request_id: str) -> bool:
        return await self.call("abort", request_id)

    async def check_health(self) -> None:
        await self.call("check_health")

    async def stats(self) -> EngineStats:
        return await self.call("stats")

    async def shutdown(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
        await self.call("shutdown")


class LocalReplicaHandle(ChannelReplicaHandle):
    """An ``EngineActor`` in this process (unit tests, no Ray); same channel code path."""

    def __init__(self, actor):
        super().__init__()
        self.actor = actor

    async def call(self, method: str, *args):
        return await getattr(self.actor, method)(*args)

    def stream(self, method: str, *args) -> AsyncIterator:
        return getattr(self.actor, method)(*args)


class RayReplicaHandle(ChannelReplicaHandle):
    """An ``EngineActor`` in the Ray cluster."""

    def __init__(self, actor):
        super().__init__()
        self.actor = actor

    async def call(self, method: str, *args):
        return await getattr(self.actor, method).remote(*args)

    async def stream(self, method: str, *args) -> AsyncIterator:
        gen = getattr(self.actor, method).options(num_returns="streaming").remote(*args)
        try:
            async for ref in gen:
                yield await ref
        finally:
            import ray

            ray.cancel(gen)

    def _dead(self, exc: BaseException) -> TandemError:
        from ray.exceptions import RayActorError

        if isinstance(exc, RayActorError):
            return TandemError(ErrorKind.ENGINE_DEAD, "the replica serving this request died")
        logger.error("replica call failed: %s: %s", type(exc).__name__, exc)
        return TandemError(ErrorKind.ENGINE_ERROR, "the replica failed on this request")
