"""Replicas as the gateway sees them, and the handles that reach their engines.

``ReplicaHandle`` is the gateway's side of ``workers.protocol.Engine``. ``RayReplicaHandle``
talks to an ``EngineActor`` through Ray streaming generators; ``LocalReplicaHandle`` runs
an engine in the gateway's own process (unit tests, no Ray).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Protocol

from gateway.errors import ErrorKind, TandemError
from workers.coalesce import coalesce
from workers.protocol import Engine, EngineInfo, EngineStats, Item

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


class LocalReplicaHandle:
    """An engine in this process. Same contract as the Ray handle, coalescing included."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self._running: dict[str, asyncio.Task] = {}

    async def start(self) -> EngineInfo:
        return await self.engine.start()

    async def generate(self, route: str, body: dict, request_id: str) -> AsyncIterator[Item]:
        items = self.engine.chat(body, request_id) if route == "chat" else self.engine.completions(body, request_id)
        async for item in coalesce(items, request_id, self._running):
            yield item

    async def abort(self, request_id: str) -> bool:
        task = self._running.get(request_id)
        if task is not None:
            task.cancel()
        return task is not None

    async def check_health(self) -> None:
        await self.engine.check_health()

    async def stats(self) -> EngineStats:
        return await self.engine.stats()

    async def shutdown(self) -> None:
        await self.engine.shutdown()


class RayReplicaHandle:
    """An ``EngineActor`` in the Ray cluster."""

    def __init__(self, actor):
        self.actor = actor

    async def start(self) -> EngineInfo:
        return await self.actor.start.remote()

    async def generate(self, route: str, body: dict, request_id: str) -> AsyncIterator[Item]:
        import ray
        from ray.exceptions import RayActorError, RayTaskError

        gen = self.actor.generate.options(num_returns="streaming").remote(route, body, request_id)
        finished = False
        try:
            async for ref in gen:
                yield await ref
            finished = True
        except RayActorError as e:
            finished = True
            raise TandemError(ErrorKind.ENGINE_DEAD, "the replica serving this request died") from e
        except RayTaskError as e:
            finished = True
            logger.error("request %s failed in its replica: %s", request_id, e)
            raise TandemError(ErrorKind.ENGINE_ERROR, "the replica failed on this request") from e
        finally:
            if not finished:  # the client went away (or we were cancelled): abort it there
                ray.cancel(gen)
                self.actor.abort.remote(request_id)

    async def abort(self, request_id: str) -> bool:
        return await self.actor.abort.remote(request_id)

    async def check_health(self) -> None:
        await self.actor.check_health.remote()

    async def stats(self) -> EngineStats:
        return await self.actor.stats.remote()

    async def shutdown(self) -> None:
        await self.actor.shutdown.remote()
