"""Replicas as the gateway sees them: their state, load and the handle that reaches each one.

A replica's state is changed only by ``Replica.move_to``, against one table (``TRANSITIONS``)
that says which moves are legal and what each one sets off (``Effect``): handing free slots to
queued requests, failing them when the model has no healthy replica left, dropping the prefix
index of an engine that is gone, publishing the owner's replica table, counting a restart. The
replica's listeners carry the effects out: its pool (slots, queue, prefix index) and the
supervisor (the published table, the restart metric). ``generation`` counts the engines a
replica has run: it goes up at every restart, and what describes one engine (the prefix index)
is keyed by it.

The handles themselves (Ray and in-process) are the transport, in ``workers/transport``; the
protocol they follow is ``tandem_core.protocol.ReplicaHandle``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import InitVar, dataclass, field
from enum import Enum, Flag, auto

from tandem_core.protocol import EngineInfo, ReplicaHandle


class ReplicaState(str, Enum):
    STARTING = "starting"
    PENDING = "pending"  # not placed: no node of the cluster offers its resources (yet)
    HEALTHY = "healthy"
    UNHEALTHY = "unhealthy"  # out of rotation; being restarted
    RESTARTING = "restarting"
    FAILED = "failed"  # could not start
    # Being removed (autoscaling down): no new requests; the ones it holds finish, then it is
    # shut down and leaves the pool. Not health-checked nor restarted meanwhile.
    DRAINING = "draining"

    @property
    def live(self) -> bool:
        """Reachable for health checks and stats."""
        return self in (ReplicaState.HEALTHY, ReplicaState.UNHEALTHY, ReplicaState.DRAINING)

    @property
    def serving_soon(self) -> bool:
        """Counted as one of the model's replicas: serving, or on its way to (not draining)."""
        return self is not ReplicaState.DRAINING


class Effect(Flag):
    """What a move sets off (carried out by the replica's listeners)."""

    NONE = 0
    WAKE = auto()  # it serves (again): hand free slots to queued requests
    FAIL_WAITERS = auto()  # it stops serving: if the model has no healthy replica left, queued requests get 503 now
    DROP_CACHE = auto()  # its engine (and what it cached) is gone: forget the prefix index of it
    PUBLISH = auto()  # the owner's replica table changed (a replica draining)
    RESTART = auto()  # a new engine generation: counted in ``restarts`` and the restart metric


S = ReplicaState
_LEAVES = Effect.FAIL_WAITERS
_DRAIN = Effect.PUBLISH | Effect.DROP_CACHE | Effect.FAIL_WAITERS
# (from, to) -> what the move sets off; a move not listed is a bug (``IllegalMove``).
TRANSITIONS: dict[tuple[ReplicaState, ReplicaState], Effect] = {
    # bringing an engine up: waiting for a node (pending) and back, serving, or failing for good
    **{(w, S.PENDING): Effect.NONE for w in (S.STARTING, S.RESTARTING)},
    **{(S.PENDING, w): Effect.NONE for w in (S.STARTING, S.RESTARTING)},
    **{(w, S.HEALTHY): Effect.WAKE for w in (S.STARTING, S.PENDING, S.RESTARTING)},
    **{(w, S.FAILED): _LEAVES for w in (S.STARTING, S.PENDING, S.RESTARTING)},
    (S.RESTARTING, S.RESTARTING): Effect.NONE,  # a restart try failed; the next one follows
    # health: a passing check (slots may have freed), out of rotation on timeouts, and back.
    # Decided here: a model whose last healthy replica goes unhealthy fails its queued requests
    # with the 503 a new request gets, rather than letting them wait out their deadline.
    (S.HEALTHY, S.HEALTHY): Effect.WAKE,
    (S.UNHEALTHY, S.HEALTHY): Effect.WAKE,
    (S.HEALTHY, S.UNHEALTHY): _LEAVES,
    (S.UNHEALTHY, S.UNHEALTHY): Effect.NONE,
    # recovery: its requests fail (the supervisor's job), a new engine is brought up
    **{(w, S.RESTARTING): Effect.RESTART | Effect.DROP_CACHE | _LEAVES for w in (S.HEALTHY, S.UNHEALTHY)},
    # removal (scaling down, or the owner removed it): from any state, once
    **{(w, S.DRAINING): _DRAIN for w in S if w is not S.DRAINING},
    (S.DRAINING, S.DRAINING): Effect.NONE,
}
del S


class IllegalMove(RuntimeError):
    pass


@dataclass(frozen=True)
class Move:
    replica: Replica
    old: ReplicaState
    new: ReplicaState
    effects: Effect


@dataclass(eq=False)
class Replica:
    id: str
    model: str
    handle: ReplicaHandle
    initial: InitVar[ReplicaState] = ReplicaState.STARTING
    outstanding: int = 0  # requests routed here and not yet finished
    load: float = 0.0  # their summed cost (``router.request_cost``): tokens (AR) or batch rows (diffusion)
    # The load other gateway processes put on it (same units as ``load``), from what the replica
    # itself reports; 0 with a single gateway. Routing weighs ``load + others_load``.
    others_load: float = 0.0
    others_outstanding: int = 0  # the requests behind ``others_load`` (the autoscaler counts requests)
    info: EngineInfo | None = None
    last_error: str | None = None
    consecutive_failures: int = 0
    incarnation: str | None = None  # of the actor process the engine was started in
    progress: int = -1  # last ``ReplicaHealth.progress`` seen, and since when
    progress_since: float = field(default_factory=time.monotonic)
    unhealthy_since: float = 0.0
    restarts: int = 0
    generation: int = 0  # engines started before the current one (``Effect.RESTART``)
    listeners: list[Callable[[Move], None]] = field(default_factory=list)

    def __post_init__(self, initial: ReplicaState) -> None:
        self._state = initial

    @property
    def state(self) -> ReplicaState:
        return self._state

    def move_to(self, state: ReplicaState, reason: str | None = None) -> Move:
        """The one way a replica changes state: checked against ``TRANSITIONS``; ``reason``
        becomes ``last_error`` (None clears it); the listeners carry out the move's effects."""
        effects = TRANSITIONS.get((self._state, state))
        if effects is None:
            raise IllegalMove(f"replica {self.id}: {self._state.value} -> {state.value} is not a move")
        move = Move(self, self._state, state, effects)
        self._state, self.last_error = state, reason
        if state is ReplicaState.UNHEALTHY and move.old is not state:
            self.unhealthy_since = time.monotonic()
        if Effect.RESTART in effects:
            self.restarts += 1
            self.generation += 1
        for listener in list(self.listeners):
            listener(move)
        return move

    @property
    def capacity(self) -> float:
        """What ``load`` is measured against: a diffusion replica's batch rows, else 1."""
        max_batch = (self.info.extra.get("max_batch") if self.info else None) or 1
        return float(max_batch)
