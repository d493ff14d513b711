"""Route a request by ``model`` to one of that model's replicas, with admission control.

Choice (``gateway/routing/choosers.py``, each policy alone): among the healthy replicas with a free
slot, the prefix match under ``routing: prefix`` (an index per replica engine, dropped when the
replica's state machine says that engine is gone: ``Effect.DROP_CACHE``), else session affinity
for a keyed request when it is on, else power of two choices on outstanding work: tokens for
autoregressive replicas (what fills a KV cache), batch rows against ``max_batch`` for diffusion
replicas (free slots at the next block boundary). With both prefix and affinity on, the prefix
match wins (it is what the replica has seen, the session key only a proxy for it). Load,
everywhere loads are compared, is ``load + others_load``: what this gateway put there plus
what other gateway processes did.

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
import contextlib
import math
import random
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from gateway.admission.policy import Admission, Ticket
from gateway.admission.shared import POLL_S, PROMOTED
from gateway.request.envelope import NO_CLAIM, Claim, Envelope
from gateway.request.intake import Intake
from gateway.routing.choosers import AdapterAffinity, Affinity, PrefixChooser, p2c
from gateway.routing.prefix_index import PrefixIndex
from gateway.routing.replicas import Effect, Move, Replica, ReplicaState
from tandem_core.errors import ErrorKind, TandemError
from tandem_core.model_config import ModelKind

RATE_WINDOW_S = 30.0


def request_cost(kind: ModelKind | str, intake: Intake) -> float:
    """What one request weighs on a replica. Autoregressive: the tokens it may hold (the same
    estimate the per-key token limit uses, ``Intake.tokens``). Diffusion: the batch rows it
    takes (``n``). Never fails: validation is the engine's job."""
    if ModelKind(kind) is ModelKind.DIFFUSION:
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
    adapter: str | None = None
    claim: Claim = NO_CLAIM
    future: asyncio.Future = field(default_factory=lambda: asyncio.get_running_loop().create_future())
    ticket: Ticket | None = None


class ModelPool:
    def __init__(self, name: str, kind: ModelKind | str, replicas: list[Replica] | None = None,
                 max_in_flight: int | None = None, max_queue: int = 256, affinity_load_factor: float | None = None,
                 rng: random.Random | None = None, routing: str = "p2c", prefix_load_factor: float = 1.25,
                 prefix_index_blocks: int | None = None, adapter_slots: int | None = None,
                 reserve: int = 0, promote_after_s: float | None = 30.0):
        self.name = name
        self.kind = ModelKind(kind)
        self.replicas: list[Replica] = []
        self.max_in_flight = max_in_flight
        self.max_queue = max_queue
        self.rng = rng or random.Random()
        if routing not in ("p2c", "prefix"):
            raise ValueError(f"routing: p2c or prefix, not {routing!r}")
        self.routing = routing  # (the config allows prefix on a diffusion model only with its prefix cache)
        self.affinity = Affinity(affinity_load_factor) if affinity_load_factor is not None else None
        self.prefix = PrefixChooser(prefix_load_factor, prefix_index_blocks) if routing == "prefix" else None
        # LoRA adapters served on this base: prefer replicas holding a request's adapter (None: none served)
        self.adapters = AdapterAffinity(adapter_slots) if adapter_slots is not None else None
        self.is_adapter: Callable[[str], bool] = lambda model: False  # a LoRA adapter's name (the Router's)
        # Who goes next when every slot is taken: priority, then tenants' fair shares, then arrival.
        self.admission = Admission(promote_after_s)
        # Slots of each replica (of max_in_flight) that requests of priority > 0 may not take, so
        # that an urgent request finds one free under a flood of lower ones.
        self.reserve = min(reserve, max_in_flight - 1) if max_in_flight is not None else 0
        self._completions: deque[float] = deque()
        # Several gateway processes: the model's slots, its tenants' counters and each process's
        # head waiter, shared (``gateway/admission/shared.py``); None: this process decides alone.
        self.shares = None
        self._poller: asyncio.Task | None = None
        for r in replicas or ():
            self.add(r)

    def share(self, shares) -> None:
        """Admit with the other gateway processes (``gateway.admission.shared.SharedShares``)."""
        self.shares = shares
        self.admission.counters = shares.counters

    def _locked(self):
        return self.shares.locked() if self.shares is not None else contextlib.nullcontext()

    def add(self, replica: Replica) -> None:
        """``replica`` joins the pool; the pool carries out its moves' effects on slots, queue
        and prefix index."""
        self.replicas.append(replica)
        replica.listeners.append(self._on_move)

    def _on_move(self, move: Move) -> None:
        if Effect.DROP_CACHE in move.effects:
            self._forget(move.replica.id)
        if Effect.FAIL_WAITERS in move.effects:
            self.fail_waiters_if_no_replica()
        if Effect.WAKE in move.effects:
            self.wake()


    def healthy(self) -> list[Replica]:
        return [r for r in self.replicas if r.state is ReplicaState.HEALTHY]

    @property
    def queued(self) -> int:
        return len(self.admission)

    def _has_room(self, r: Replica, priority: int = 0) -> bool:
        if self.max_in_flight is None:
            return True
        return r.outstanding < self.max_in_flight - (self.reserve if priority > 0 else 0)

    def _shared_turn(self, priority: float, tenant: str) -> bool:
        """With shared admission: the model has a free slot, every process counted, and no other
        process's head waiter goes before this one. True when this process decides alone."""
        if self.shares is None:
            return True
        if self.max_in_flight is not None:
            capacity = (self.max_in_flight - (self.reserve if priority > 0 else 0)) * len(self.healthy())
            if self.shares.held() >= capacity:
                return False
        first = self.shares.first_elsewhere()
        return first is None or (priority, self.admission.counter(tenant)) <= first

    def _publish_head(self, now: float) -> None:
        if self.shares is not None:
            head = self.admission.peek(now)
            if head is None:
                self.shares.publish_head(None, None)
            else:
                self.shares.publish_head(PROMOTED if self.admission.promoted(head, now) else head.priority,
                                         head.tenant)

    def prefix_blocks(self, intake: Intake) -> tuple[int, ...]:
        """What ``acquire`` needs to route ``intake`` by prefix: its prompt's block hashes under
        ``routing: prefix``, else () (nothing computed)."""
        return intake.prefix_blocks() if self.routing == "prefix" else ()

    def _forget(self, replica_id: str) -> None:
        """What described a replica's engine (its prefix index, its adapters) is gone."""
        for chooser in (self.prefix, self.adapters):
            if chooser is not None:
                chooser.drop(replica_id)

    def _choose(self, cost: float, key: str | None, exclude: Iterable[str] = (),
                prefix: Sequence[int] = (), adapter: str | None = None, priority: int = 0) -> Replica | None:
        """The replica for one more request now, or None if every healthy one is full (for a
        request of ``priority`` > 0: all but the reserved slots).
        ``exclude`` (a retry's failed replica) is avoided when another one has room."""
        healthy = self.healthy()
        free = [r for r in healthy if self._has_room(r, priority)]
        preferred = [r for r in free if r.id not in exclude]
        candidates = preferred or free
        if not candidates:
            return None
        if adapter is not None and self.adapters is not None:
            best = self.adapters.choose(candidates, healthy, cost, adapter)
            if best is not None:
                return best
        if prefix and self.prefix is not None:
            best = self.prefix.choose(candidates, healthy, cost, prefix)
            if best is not None:
                return best
        if key is not None and self.affinity is not None:
            return self.affinity.choose(candidates, healthy, cost, key)
        return p2c(candidates, self.rng)

    def remove(self, replica: Replica) -> None:
        """Drop a drained replica (its requests finished or failed): it is gone for good."""
        if replica in self.replicas:
            self.replicas.remove(replica)
        if self._on_move in replica.listeners:
            replica.listeners.remove(self._on_move)
        self._forget(replica.id)
        self.fail_waiters_if_no_replica()

    def prefix_index(self, replica: Replica) -> PrefixIndex | None:
        """The prefix index of a replica's current engine (for /admin and tests); None before any
        prefix routing there."""
        return self.prefix.existing(replica) if self.prefix is not None else None

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
        wait = (len(self.admission) + 1) / rate if rate > 0 else 1.0
        return TandemError(ErrorKind.OVERLOADED,
                           f"model {self.name!r} is at capacity ({len(self.admission)} requests queued); retry later",
                           retry_after=max(1, min(60, math.ceil(wait))))

    async def place(self, env: Envelope, exclude: Iterable[str] = (), deadline_s: float | None = None) -> Slot:
        """``acquire`` for one request's record: its cost (``request_cost``), its session key, its
        prefix blocks (``prefix_blocks``), its adapter and its claim all read from ``env``."""
        return await self.acquire(deadline_s, request_cost(self.kind, env.intake), env.intake.session_key, exclude,
                                  self.prefix_blocks(env.intake), env.model if self.is_adapter(env.model) else None,
                                  env.claim)

    async def acquire(self, deadline_s: float | None = None, cost: float = 1.0, key: str | None = None,
                      exclude: Iterable[str] = (), prefix: Sequence[int] = (), adapter: str | None = None,
                      claim: Claim = NO_CLAIM) -> Slot:
        """A slot on a replica, counted there until ``release``. ``prefix``: the prompt's block
        hashes (``prefix_blocks``) under ``routing: prefix``; ``claim``: its priority and tenant
        (``gateway/admission/policy.py`` orders the waiters by them). Raises 503 (no live replica), 429
        (queue full) or 408 (waited past ``deadline_s``)."""
        exclude = frozenset(exclude)
        with self._locked():
            if self.admission.goes_before_every_waiter(claim.priority, time.monotonic()):
                if self.shares is not None:
                    self.admission.level(claim.tenant, self.shares.tenants_waiting_elsewhere())
                if self._shared_turn(claim.priority, claim.tenant):
                    replica = self._choose(cost, key, exclude, prefix, adapter, claim.priority)
                    if replica is not None:
                        if self.shares is not None:  # others may wait: this one counts to its share
                            self.admission.charge(claim.tenant, cost, claim.weight)
                        return self._take(replica, cost, prefix, adapter)
        self._no_live_replica()
        if len(self.admission) >= self.max_queue:
            raise self._overloaded()
        return await self._wait(_Waiter(cost, key, exclude, prefix, adapter, claim), deadline_s)

    def _take(self, replica: Replica, cost: float, prefix: Sequence[int] = (), adapter: str | None = None) -> Slot:
        if adapter is not None and self.adapters is not None:
            self.adapters.take(replica, adapter)
        if prefix and self.prefix is not None:
            cost = self.prefix.take(replica, cost, prefix)  # the engine will hold this prompt now
        if self.shares is not None:
            self.shares.take()  # (the caller holds the lock)
        replica.outstanding += 1
        replica.load += cost
        return Slot(replica, cost)

    async def _wait(self, waiter: _Waiter, deadline_s: float | None) -> Slot:
        fut = waiter.future
        c = waiter.claim
        with self._locked():
            waiter.ticket = self.admission.push(
                Ticket(waiter, c.priority, c.tenant, c.weight, waiter.cost, time.monotonic()),
                self.shares.tenants_waiting_elsewhere() if self.shares is not None else ())
        self.wake()  # a waiter more urgent than those ahead may take a free slot at once
        if self.shares is not None and self._poller is None:
            self._poller = asyncio.create_task(self._poll())
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
            with self._locked():
                self.admission.remove(waiter.ticket)
                self._publish_head(time.monotonic())
            if not fut.done():
                fut.cancel()

    async def _poll(self) -> None:
        """With shared admission, while anyone waits here: a slot another process freed, or its
        head waiter gone, is seen within ``POLL_S``."""
        try:
            while len(self.admission):
                await asyncio.sleep(POLL_S)
                self.wake()
        finally:
            self._poller = None

    def release(self, slot: Slot) -> None:
        self._completions.append(time.monotonic())
        self._give_back(slot)

    def _give_back(self, slot: Slot) -> None:
        if self.shares is not None:
            self.shares.give()
        slot.replica.outstanding -= 1
        slot.replica.load -= slot.cost
        self.wake()

    def wake(self) -> None:
        """Hand free slots to the waiters admission puts first (priority, then fair shares, then
        arrival), reserving each slot for its waiter. Called when a request ends, when a replica
        becomes healthy, when a request starts waiting and (shared admission) every ``POLL_S``
        while anyone waits."""
        with self._locked():
            now = time.monotonic()
            while (ticket := self.admission.peek(now)) is not None:
                waiter: _Waiter = ticket.item
                if waiter.future.done():  # cancelled or timed out; its own cleanup removes it
                    self.admission.remove(ticket)
                    continue
                promoted = self.admission.promoted(ticket, now)
                priority = min(ticket.priority, 0) if promoted else ticket.priority
                if not self._shared_turn(PROMOTED if promoted else priority, ticket.tenant):
                    break
                target = self._choose(waiter.cost, waiter.key, waiter.exclude, waiter.prefix, waiter.adapter,
                                      priority)
                if target is None:
                    break
                self.admission.pop(now)
                waiter.future.set_result(self._take(target, waiter.cost, waiter.prefix, waiter.adapter))
            self._publish_head(now)

    def fail_waiters_if_no_replica(self) -> None:
        """The model lost its last healthy replica: queued requests get the 503 a new one would
        get, at once, instead of waiting for a restart that may take minutes."""
        if self.healthy():
            return
        with self._locked():
            for ticket in self.admission.tickets():
                self.admission.remove(ticket)
                fut = ticket.item.future
                if not fut.done():
                    fut.set_exception(self._no_replica_error())
            self._publish_head(time.monotonic())


class Router:
    def __init__(self, pools: list[ModelPool], adapters=None, aliases: dict[str, str] | None = None):
        self.pools = {p.name: p for p in pools}
        self.adapters = adapters  # ``gateway.routing.adapters.Adapters``: a LoRA adapter's name is served by its base
        self.aliases = dict(aliases or {})  # another served name -> the model's name
        if adapters is not None:
            for pool in pools:
                pool.is_adapter = lambda model: isinstance(model, str) and adapters.base_of(model) is not None

    def pool(self, model: object) -> ModelPool:
        """The pool serving ``model``: a model's own (by its name or an alias), or a LoRA
        adapter's base's."""
        if not isinstance(model, str) or not model:
            raise TandemError(ErrorKind.INVALID_REQUEST, "model: a model name (string) is required", "model")
        base = self.adapters.base_of(model) if self.adapters is not None else None
        pool = self.pools.get(base or self.aliases.get(model, model))
        if pool is None:
            raise self.not_found(model)
        return pool

    def not_found(self, model: object, visible: Iterable[str] | None = None) -> TandemError:
        """The 404 for ``model``, naming the models there are (``visible``: those the caller may see)."""
        names = sorted(visible if visible is not None else
                       [*self.pools, *self.aliases, *(self.adapters.base if self.adapters is not None else ())])
        return TandemError(ErrorKind.MODEL_NOT_FOUND,
                           f"The model `{model}` does not exist. Valid aliases: {', '.join(names)}.",  # vLLM's words
                           "model")

    def ready(self) -> bool:
        """Every model has a healthy replica."""
        return all(p.healthy() for p in self.pools.values())

    def all_replicas(self) -> list[Replica]:
        return [r for p in self.pools.values() for r in p.replicas]
