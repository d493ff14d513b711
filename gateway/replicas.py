"""Replicas as the gateway sees them: their state, load and the handle that reaches each one.

The handles themselves (Ray and in-process) are the transport, in ``workers/transport``; the
protocol they follow is ``tandem_core.protocol.ReplicaHandle``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import Enum

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


@dataclass(eq=False)
class Replica:
    id: str
    model: str
    handle: ReplicaHandle
    state: ReplicaState = ReplicaState.STARTING
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

    @property
    def capacity(self) -> float:
        """What ``load`` is measured against: a diffusion replica's batch rows, else 1."""
        max_batch = (self.info.extra.get("max_batch") if self.info else None) or 1
        return float(max_batch)
