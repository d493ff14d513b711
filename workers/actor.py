"""The thin Ray actor shell around one engine (one replica, one GPU).

It owns no serving logic: it builds the engine from the model's config, starts it, and
forwards requests, coalescing what it streams back (``workers/coalesce.py``) and keeping the
per-request tasks so ``abort`` can cancel them. Errors go back as values.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import AsyncIterator

from gateway.config import ModelConfig
from gateway.errors import TandemError, invalid
from workers.coalesce import coalesce
from workers.protocol import EngineInfo, EngineStats, Item
from workers.registry import create_engine

logger = logging.getLogger(__name__)


class EngineActor:
    """Decorated with ``ray.remote`` by ``workers.deployment``; plain Python otherwise."""

    def __init__(self, model: dict, source_path: str, replica_id: str, engine_key: str | None = None):
        self.cfg = ModelConfig.model_validate(model)
        self.replica_id = replica_id
        self.engine = create_engine(self.cfg, source_path, engine_key)
        self.info: EngineInfo | None = None
        self._running: dict[str, asyncio.Task] = {}

    async def start(self) -> EngineInfo:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        logger.info("replica %s (pid %d) starting %s", self.replica_id, os.getpid(), self.cfg.name)
        self.info = await self.engine.start()
        return self.info

    async def generate(self, route: str, body: dict, request_id: str) -> AsyncIterator[Item]:
        """A Ray streaming generator: see ``workers.protocol`` for what it yields."""
        if route == "chat":
            items = self.engine.chat(body, request_id)
        elif route == "completions":
            items = self.engine.completions(body, request_id)
        else:
            yield invalid(f"unknown route {route!r}")
            return
        async for item in coalesce(items, request_id, self._running):
            yield item

    async def abort(self, request_id: str) -> bool:
        task = self._running.get(request_id)
        if task is not None:
            task.cancel()
        engine_held = await self.engine.abort(request_id)
        return task is not None or engine_held

    async def check_health(self) -> None:
        await self.engine.check_health()

    async def stats(self) -> EngineStats:
        s = await self.engine.stats()
        return EngineStats(running=s.running, waiting=s.waiting,
                           extra={**s.extra, "actor_in_flight": len(self._running)})

    async def shutdown(self) -> None:
        for task in list(self._running.values()):
            task.cancel()
        await self.engine.shutdown()

    def ping(self) -> str:
        return self.replica_id


__all__ = ["EngineActor", "TandemError"]
