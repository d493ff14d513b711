"""Route a request by ``model`` to one of that model's replicas, with admission control.

Least outstanding requests among healthy replicas with a free slot (``max_in_flight`` per
replica; None: no limit, the engine queues). When every replica is full the request waits in
a bounded FIFO queue; when the queue is full it is refused at once with 429 and a
``Retry-After`` estimated from the queue length and the recent completion rate. A request
that waits past its deadline gets 408. 503 only when the model has no live replica.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import deque

from gateway.errors import ErrorKind, TandemError
from gateway.replicas import Replica, ReplicaState

RATE_WINDOW_S = 30.0


class ModelPool:
    def __init__(self, name: str, kind: str, replicas: list[Replica] | None = None,
                 max_in_flight: int | None = None, max_queue: int = 256):
        self.name = name
        self.kind = kind
        self.replicas: list[Replica] = list(replicas or [])
        self.max_in_flight = max_in_flight
        self.max_queue = max_queue
        self._waiters: deque[asyncio.Future] = deque()
        self._completions: deque[float] = deque()

    def healthy(self) -> list[Replica]:
        return [r for r in self.replicas if r.state is ReplicaState.HEALTHY]

    @property
    def queued(self) -> int:
        return len(self._waiters)

    def _free(self) -> Replica | None:
        live = [r for r in self.healthy() if self.max_in_flight is None or r.outstanding < self.max_in_flight]
        return min(live, key=lambda r: r.outstanding) if live else None

    def pick(self) -> Replica:
        """The replica to use now (no queueing): raises 503 without a healthy replica, 429 if all are full."""
        replica = self._free()
        if replica is not None:
            return replica
        self._no_live_replica()
        raise self._overloaded()

    def _no_live_replica(self) -> None:
        if not self.healthy():
            starting = any(r.state is ReplicaState.STARTING for r in self.replicas)
            why = "is still starting" if starting else "has no healthy replica"
            raise TandemError(ErrorKind.NO_REPLICA, f"model {self.name!r} {why}; try again shortly", retry_after=1)

    def _overloaded(self) -> TandemError:
        now = time.monotonic()
        while self._completions and now - self._completions[0] > RATE_WINDOW_S:
            self._completions.popleft()
        rate = len(self._completions) / RATE_WINDOW_S
        wait = (len(self._waiters) + 1) / rate if rate > 0 else 1.0
        return TandemError(ErrorKind.OVERLOADED,
                           f"model {self.name!r} is at capacity ({len(self._waiters)} requests queued); retry later",
                           retry_after=max(1, min(60, math.ceil(wait))))

    async def acquire(self, deadline_s: float | None = None) -> Replica:
        """A replica with one more outstanding request counted on it; pair with ``release``."""
        replica = self._free()
        if replica is not None:
            replica.outstanding += 1
            return replica
        self._no_live_replica()
        if len(self._waiters) >= self.max_queue:
            raise self._overloaded()
        return await self._wait(deadline_s)

    async def _wait(self, deadline_s: float | None) -> Replica:
        fut: asyncio.Future = asyncio.get_running_loop().create_future()
        self._waiters.append(fut)
        try:
            return await asyncio.wait_for(asyncio.shield(fut), deadline_s)
        except TimeoutError:
            raise TandemError(ErrorKind.QUEUE_TIMEOUT,
                              f"waited {deadline_s:.3f} s in the queue of model {self.name!r}; shed") from None
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():  # given a slot just as the client went away
                self._give_back(fut.result())
            raise
        finally:
            if fut in self._waiters:
                self._waiters.remove(fut)
            if not fut.done():
                fut.cancel()

    def release(self, replica: Replica) -> None:
        self._completions.append(time.monotonic())
        self._give_back(replica)

    def _give_back(self, replica: Replica) -> None:
        replica.outstanding -= 1
        self.wake()

    def wake(self) -> None:
        """Hand free slots to the oldest waiters (FIFO), reserving each slot for its waiter.
        Called when a request ends and when a replica becomes healthy."""
        while self._waiters:
            target = self._free()
            if target is None:
                return
            fut = self._waiters.popleft()
            if not fut.done():
                target.outstanding += 1
                fut.set_result(target)


class Router:
    def __init__(self, pools: list[ModelPool]):
        self.pools = {p.name: p for p in pools}

    def pool(self, model: object) -> ModelPool:
        if not isinstance(model, str) or not model:
            raise TandemError(ErrorKind.INVALID_REQUEST, "model: a model name (string) is required", "model")
        pool = self.pools.get(model)
        if pool is None:
            raise TandemError(
                ErrorKind.MODEL_NOT_FOUND,
                f"The model {model!r} does not exist; available: {', '.join(sorted(self.pools))}",
                "model",
            )
        return pool

    def ready(self) -> bool:
        return all(p.healthy() for p in self.pools.values())

    def all_replicas(self) -> list[Replica]:
        return [r for p in self.pools.values() for r in p.replicas]
