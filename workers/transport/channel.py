"""One multiplexed stream per (gateway, replica) instead of one Ray stream per request.

Measured here: with a Ray streaming generator per request, the Ray hop (an object, an RPC
and an asyncio future per item on each side) cost as much CPU as vLLM's serving layer and
held tandem to 0.4x of `vllm serve` at 32 streams on 2 cores. Instead, every request of a
gateway on a replica shares one long-lived Ray stream: the actor appends ``(request_id,
item)`` to an outbox and the stream hands over the whole outbox each time the previous
batch has left, so one Ray item carries every token produced since, for all requests.

Actor side: ``Outbox`` (what ``EngineActor`` keeps per open channel).
Gateway side: ``Demux`` (routes batches to per-request queues; fails them all at once if the
channel breaks, e.g. the replica died).

Pure asyncio: no Ray here, so both halves are unit-tested directly.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any

from tandem_core.errors import ErrorKind, TandemError
from tandem_core.protocol import Item

logger = logging.getLogger(__name__)

END = None  # the last item of every request on a channel (survives pickling, unlike a sentinel)
Batch = list[tuple[str, Any]]


class Outbox:
    """The actor's half: requests append, the channel stream drains."""

    def __init__(self) -> None:
        self._items: Batch = []
        self._ready = asyncio.Event()
        self._closed = False
        self.tasks: dict[str, asyncio.Task] = {}

    def put(self, request_id: str, item: Any) -> None:
        items = self._items
        # Join consecutive SSE text of the same request: fewer, larger items.
        if isinstance(item, str) and items and items[-1][0] == request_id and isinstance(items[-1][1], str):
            items[-1] = (request_id, items[-1][1] + item)
        else:
            items.append((request_id, item))
        self._ready.set()

    async def stream(self) -> AsyncIterator[Batch]:
        """Yields every batch until closed. Runs as the actor's channel generator."""
        while not self._closed:
            await self._ready.wait()
            self._ready.clear()
            batch, self._items = self._items, []
            if batch:
                yield batch

    def start(self, request_id: str, items: AsyncIterator[Item], context=None) -> None:
        """Run one request, sending what it yields (then END) through this outbox; ``context``:
        the ``contextvars.Context`` its task runs in (None: a copy of the caller's)."""
        self.tasks[request_id] = asyncio.create_task(self._run(request_id, items), name=f"req-{request_id}",
                                                     context=context)

    async def _run(self, request_id: str, items: AsyncIterator[Item]) -> None:
        try:
            async for item in items:
                self.put(request_id, item)
        except asyncio.CancelledError:
            pass  # aborted: the gateway no longer listens for it
        except Exception as e:  # noqa: BLE001 - every failure must reach the client
            logger.exception("request %s failed in the engine", request_id)
            err = e if isinstance(e, TandemError) else TandemError(
                ErrorKind.ENGINE_ERROR, f"the engine failed on this request: {type(e).__name__}")
            # The error as a value, before or after a stream began: the gateway frames it for
            # its route (gateway/http/streaming.py).
            self.put(request_id, err)
        finally:
            self.tasks.pop(request_id, None)
            self.put(request_id, END)

    def abort(self, request_id: str) -> bool:
        task = self.tasks.get(request_id)
        if task is None:
            return False
        task.cancel()
        return True

    def close(self) -> None:
        self._closed = True
        for task in list(self.tasks.values()):
            task.cancel()
        self._ready.set()


class Demux:
    """The gateway's half: one queue per request in flight on a channel."""

    def __init__(self) -> None:
        self.queues: dict[str, asyncio.Queue] = {}
        self.broken: TandemError | None = None

    def register(self, request_id: str) -> asyncio.Queue:
        if self.broken is not None:
            raise self.broken
        queue: asyncio.Queue = asyncio.Queue()
        self.queues[request_id] = queue
        return queue

    def unregister(self, request_id: str) -> None:
        self.queues.pop(request_id, None)

    def feed(self, batch: Batch) -> None:
        for request_id, item in batch:
            queue = self.queues.get(request_id)
            if queue is not None:  # else: aborted, its late items are dropped
                queue.put_nowait(item)

    def fail_all(self, err: TandemError) -> None:
        """The channel broke: every request on it ends now, with ``err`` (the first cause wins)."""
        if self.broken is not None:
            return
        self.broken = err
        for queue in self.queues.values():
            queue.put_nowait(err)
            queue.put_nowait(END)


async def items_of(queue: asyncio.Queue) -> AsyncIterator[Item]:
    """A request's items from its queue until END (an error is an item like the others: the
    gateway frames it for its route)."""
    while True:
        item = await queue.get()
        if item is END:
            return
        yield item
