"""Route a request by ``model`` to one of that model's replicas, with admission control.

Choice: power of two choices on outstanding work. Two healthy replicas with a free slot are
drawn at random and the less loaded one wins, where load is the summed ``request_cost`` of
what the gateway has in flight there: tokens for autoregressive replicas (what fills a KV
cache), batch rows against ``max_batch`` for diffusion replicas (free slots at the next block
boundary). Optional session affinity (autoregressive): a request with a session key goes to
the key's own replica (rendezvous hashing) unless that replica is above ``load_factor`` times
the average load, so prefix caches get hit without one hot session owning a replica.

``routing: prefix`` (autoregressive): each replica has an approximate index of the prompts this
gateway process routed there (``gateway/prefix.py``); a request goes to the replica holding the
longest run of its prompt's leading blocks, among those within the same kind of load bound
(``prefix_load_factor`` x the average, counting this request); among replicas with equally long
matches, the prefix's own first choice (rendezvous hashing on the last matched block), so a
prefix that spilled onto a second replica under load comes back to the first instead of
alternating between them and filling both caches. A request weighs its uncached tokens where its
prefix is cached (the cached blocks are shared, not computed again): in-flight requests of
cached tenants do not push each other off their replica; their output still counts. No match
anywhere: session affinity if the request has a key and affinity is on, else p2c. With both on,
the prefix match wins (it is what the replica has seen, the session key only a proxy for it). An
index describes one engine: it is keyed by (replica id, ``generation``) and dropped when the
replica state machine says that engine is gone (``Effect.DROP_CACHE``). Load, everywhere loads are
compared, is ``load + others_load``: what this gateway put there plus what other gateway
processes did.

Admission: ``max_in_flight`` requests per replica (None: no limit, the engine queues). When
every replica is full the request waits in a bounded FIFO queue; when the queue is full it is
refused at once with 429 and a ``Retry-After`` estimated from the queue length and the recent
completion rate. A request that waits past its deadline gets 408. 503 only when the model has
no live replica.

Draining (autoscaling down): a replica in state ``draining`` is not healthy, so it gets no new
request; the ones it holds finish and are released as usual; then ``remove`` drops it (and its
prefix index) from the pool.
"""

from __future__ import annotations

import asyncio
import hashlib
import math
import random
import time
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from gateway.intake import Intake
from gateway.prefix import BLOCK_CHARS, DEFAULT_INDEX_BLOCKS, PrefixIndex
from gateway.replicas import Effect, Move, Replica, ReplicaState
from tandem_core.errors import ErrorKind, TandemError

RATE_WINDOW_S = 30.0
# Tokens a prefix block stands for (the gateway's estimate of 4 characters a token).
TOKENS_PER_BLOCK = BLOCK_CHARS // 4


def request_cost(kind: str, intake: Intake) -> float:
    """What one request weighs on a replica. Autoregressive: the tokens it may hold (the same
    estimate the per-key token limit uses, ``Intake.tokens``). Diffusion: the batch rows it
    takes (``n``). Never fails: validation is the engine's job."""
    if kind == "diffusion":
        n = intake.body.get("n")
        return float(n if isinstance(n, int) and 1 <= n <= 128 else 1)
    return float(intake.tokens)


@dataclass(eq=False)
class Slot:
    """A request's place on a replica, from ``acquire`` until ``release``."""

    replica: Replica
    cost: float = 1.0


@dataclass(eq=False)
class _Waiter:
    cost: float
    key: str | None
    exclude: frozenset[str]
    prefix: Sequence[int] = ()
    future: asyncio.Future = field(default_factory=lambda: asyncio.get_running_loop().create_future())


class ModelPool:
    def __init__(self, name: str, kind: str, replicas: list[Replica] | None = None,
                 max_in_flight: int | None = None, max_queue: int = 256, affinity_load_factor: float | None = None,
                 rng: random.Random | None = None, routing: str = "p2c", prefix_load_factor: float = 1.25,
                 prefix_index_blocks: int | None = None):
        self.name = name
        self.kind = kind
        self.replicas: list[Replica] = []
        self.max_in_flight = max_in_flight
        self.max_queue = max_queue
        self.affinity_load_factor = affinity_load_factor  # None: no session affinity
        self.rng = rng or random.Random()
        if routing not in ("p2c", "prefix"):
            raise ValueError(f"routing: p2c or prefix, not {routing!r}")
        self.routing = routing  # (the config allows prefix on a diffusion model only with its prefix cache)
        self.prefix_load_factor = prefix_load_factor
        # Blocks each replica's index holds; None: the engine's KV capacity (``kv_cache_tokens``
        # in its info) in blocks, else ``DEFAULT_INDEX_BLOCKS``.
        self.prefix_index_blocks = prefix_index_blocks
        self._indexes: dict[tuple[str, int], PrefixIndex] = {}  # (replica id, generation) -> its index
        self._waiters: deque[_Waiter] = deque()
        self._completions: deque[float] = deque()
        for r in replicas or ():
            self.add(r)

    def add(self, replica: Replica) -> None:
        """``replica`` joins the pool; the pool carries out its moves' effects on slots, queue
        and prefix index."""
        self.replicas.append(replica)
        replica.listeners.append(self._on_move)

    def _on_move(self, move: Move) -> None:
        if Effect.DROP_CACHE in move.effects:
            self._drop_indexes(move.replica.id)
        if Effect.FAIL_WAITERS in move.effects:
            self.fail_waiters_if_no_replica()
        if Effect.WAKE in move.effects:
            self.wake()

    def _drop_indexes(self, replica_id: str) -> None:
        for key in [k for k in self._indexes if k[0] == replica_id]:
            del self._indexes[key]

    def healthy(self) -> list[Replica]:
        return [r for r in self.replicas if r.state is ReplicaState.HEALTHY]

    @property
    def queued(self) -> int:
        return len(self._waiters)

    def _has_room(self, r: Replica) -> bool:
        return self.max_in_flight is None or r.outstanding < self.max_in_flight

    def prefix_blocks(self, intake: Intake) -> tuple[int, ...]:
        """What ``acquire`` needs to route ``intake`` by prefix: its prompt's block hashes under
        ``routing: prefix``, else () (nothing computed)."""
        return intake.prefix_blocks() if self.routing == "prefix" else ()

    def _choose(self, cost: float, key: str | None, exclude: Iterable[str] = (),
                prefix: Sequence[int] = ()) -> Replica | None:
        """The replica for one more request now, or None if every healthy one is full.
        ``exclude`` (a retry's failed replica) is avoided when another one has room."""
        healthy = self.healthy()
        free = [r for r in healthy if self._has_room(r)]
        preferred = [r for r in free if r.id not in exclude]
        candidates = preferred or free
        if not candidates:
            return None
        if prefix and self.routing == "prefix":
            best = self._longest_prefix(candidates, healthy, cost, prefix)
            if best is not None:
                return best
        if key is not None and self.affinity_load_factor is not None:
            return self._affine(candidates, healthy, cost, key)
        if len(candidates) == 1:
            return candidates[0]
        a, b = self.rng.sample(candidates, 2)
        return min(a, b, key=_score)

    def _affine(self, candidates: list[Replica], healthy: list[Replica], cost: float, key: str) -> Replica:
        """Rendezvous hashing with bounded load: the key's first replica in its own order whose
        load is within ``load_factor`` x the average (counting this request; the least loaded
        replica always is, unless it is full)."""
        bound = _bound(self.affinity_load_factor, healthy, cost)
        ordered = sorted(candidates, key=lambda r: _rendezvous(key, r.id), reverse=True)
        return next((r for r in ordered if _load(r) <= bound), min(candidates, key=_score))

    def _longest_prefix(self, candidates: list[Replica], healthy: list[Replica], cost: float,
                        prefix: Sequence[int]) -> Replica | None:
        """Among the candidates within ``prefix_load_factor`` x the average load (counting this
        request), the one whose index holds the most leading blocks of ``prefix``; on a tie, the
        matched prefix's first in its rendezvous order. None when none holds any."""
        bound = _bound(self.prefix_load_factor, healthy, cost)
        best, best_blocks, best_rank = None, 0, 0
        for r in candidates:
            if _load(r) > bound:
                continue
            n = self._index(r).match(prefix)
            if n == 0 or n < best_blocks:
                continue
            rank = hash((prefix[n - 1], r.id))  # per process, like the block hashes
            if n > best_blocks or rank > best_rank:
                best, best_blocks, best_rank = r, n, rank
        return best

    def _index(self, r: Replica) -> PrefixIndex:
        """The prefix index of ``r``'s current engine (``generation``), sized by its KV capacity."""
        index = self._indexes.get((r.id, r.generation))
        if index is not None:
            return index
        if self.prefix_index_blocks is not None:
            size = self.prefix_index_blocks
        else:
            kv_tokens = r.info.extra.get("kv_cache_tokens") if r.info is not None else None
            size = (max(1, int(kv_tokens) // TOKENS_PER_BLOCK) if isinstance(kv_tokens, int | float) and kv_tokens > 0
                    else DEFAULT_INDEX_BLOCKS)
        self._drop_indexes(r.id)  # an older generation's, if it was not dropped yet
        index = self._indexes[(r.id, r.generation)] = PrefixIndex(size)
        return index

    def remove(self, replica: Replica) -> None:
        """Drop a drained replica (its requests finished or failed): it is gone for good."""
        if replica in self.replicas:
            self.replicas.remove(replica)
        if self._on_move in replica.listeners:
            replica.listeners.remove(self._on_move)
        self._drop_indexes(replica.id)
        self.fail_waiters_if_no_replica()

    def prefix_index(self, replica: Replica) -> PrefixIndex | None:
        """The prefix index of a replica's current engine (for /admin and tests); None before any
        prefix routing there."""
        return self._indexes.get((replica.id, replica.generation))

    def _no_replica_error(self) -> TandemError:
        states = {r.state for r in self.replicas}
        why = ("is restarting" if ReplicaState.RESTARTING in states or ReplicaState.UNHEALTHY in states
               else "is still starting" if ReplicaState.STARTING in states
               else "has no healthy replica")
        return TandemError(ErrorKind.NO_REPLICA, f"model {self.name!r} {why}; try again shortly", retry_after=1)

    def _no_live_replica(self) -> None:
        if not self.healthy():
            raise self._no_replica_error()

    def _overloaded(self) -> TandemError:
        now = time.monotonic()
        while self._completions and now - self._completions[0] > RATE_WINDOW_S:
            self._completions.popleft()
        rate = len(self._completions) / RATE_WINDOW_S
        wait = (len(self._waiters) + 1) / rate if rate > 0 else 1.0
        return TandemError(ErrorKind.OVERLOADED,
                           f"model {self.name!r} is at capacity ({len(self._waiters)} requests queued); retry later",
                           retry_after=max(1, min(60, math.ceil(wait))))

    async def acquire(self, deadline_s: float | None = None, cost: float = 1.0, key: str | None = None,
                      exclude: Iterable[str] = (), prefix: Sequence[int] = ()) -> Slot:
        """A slot on a replica, counted there until ``release``. ``prefix``: the prompt's block
        hashes (``prefix_blocks``) under ``routing: prefix``. Raises 503 (no live replica), 429
        (queue full) or 408 (waited past ``deadline_s``)."""
        exclude = frozenset(exclude)
        if not self._waiters:  # FIFO: nobody may overtake a waiter
            replica = self._choose(cost, key, exclude, prefix)
            if replica is not None:
                return self._take(replica, cost, prefix)
        self._no_live_replica()
        if len(self._waiters) >= self.max_queue:
            raise self._overloaded()
        return await self._wait(_Waiter(cost, key, exclude, prefix), deadline_s)

    def _take(self, replica: Replica, cost: float, prefix: Sequence[int] = ()) -> Slot:
        if prefix and self.routing == "prefix":
            index = self._index(replica)
            # The cached part of the prompt is neither computed again nor held twice (requests
            # share its KV blocks): the request weighs its uncached tokens and its output there.
            cost = max(1.0, cost - index.match(prefix) * TOKENS_PER_BLOCK)
            index.insert(prefix)  # the engine will hold (at least) this prompt now
        replica.outstanding += 1
        replica.load += cost
        return Slot(replica, cost)

    async def _wait(self, waiter: _Waiter, deadline_s: float | None) -> Slot:
        fut = waiter.future
        self._waiters.append(waiter)
        try:
            return await asyncio.wait_for(asyncio.shield(fut), deadline_s)
        except TimeoutError:
            raise TandemError(ErrorKind.QUEUE_TIMEOUT,
                              f"waited {deadline_s:.3f} s in the queue of model {self.name!r}; shed") from None
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled() and fut.exception() is None:  # given a slot as the client left
                self._give_back(fut.result())
            raise
        finally:
            if waiter in self._waiters:
                self._waiters.remove(waiter)
            if not fut.done():
                fut.cancel()

    def release(self, slot: Slot) -> None:
        self._completions.append(time.monotonic())
        self._give_back(slot)

    def _give_back(self, slot: Slot) -> None:
        slot.replica.outstanding -= 1
        slot.replica.load -= slot.cost
        self.wake()

    def wake(self) -> None:
        """Hand free slots to the oldest waiters (FIFO), reserving each slot for its waiter.
        Called when a request ends and when a replica becomes healthy."""
        while self._waiters:
            waiter = self._waiters[0]
            if waiter.future.done():  # cancelled or timed out; its own cleanup removes it
                self._waiters.popleft()
                continue
            target = self._choose(waiter.cost, waiter.key, waiter.exclude, waiter.prefix)
            if target is None:
                return
            self._waiters.popleft()
            waiter.future.set_result(self._take(target, waiter.cost, waiter.prefix))

    def fail_waiters_if_no_replica(self) -> None:
        """The model lost its last healthy replica: queued requests get the 503 a new one would
        get, at once, instead of waiting for a restart that may take minutes."""
        if self.healthy():
            return
        while self._waiters:
            fut = self._waiters.popleft().future
            if not fut.done():
                fut.set_exception(self._no_replica_error())


def _load(r: Replica) -> float:
    """What is in flight on ``r``: from this gateway process and from the others."""
    return r.load + r.others_load


def _bound(load_factor: float, healthy: list[Replica], cost: float) -> float:
    """The bounded-load ceiling: ``load_factor`` x the average load, counting a request of
    ``cost``. The least loaded healthy replica is always within it."""
    return load_factor * (sum(_load(r) for r in healthy) + cost) / len(healthy)


def _score(r: Replica) -> tuple[float, int]:
    # AR: capacity is 1, so this orders by tokens in flight; diffusion: by free batch rows.
    return (_load(r) - r.capacity, r.outstanding)


def _rendezvous(key: str, replica_id: str) -> int:
    return int.from_bytes(hashlib.blake2b(f"{key}\0{replica_id}".encode(), digest_size=8).digest(), "big")


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
                f"The model `{model}` does not exist. Valid aliases: {', '.join(sorted(self.pools))}.",  # vLLM's words
                "model",
            )
        return pool

    def ready(self) -> bool:
        return all(p.healthy() for p in self.pools.values())

    def all_replicas(self) -> list[Replica]:
        return [r for p in self.pools.values() for r in p.replicas]
