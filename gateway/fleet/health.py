"""Health and stats of the replicas, for the supervisor.

Every ``gateway.health_interval_s`` each live replica (not draining) is asked for its health,
which round-trips its engine (``ReplicaHandle.health``). A check that times out
``unhealthy_after`` times in a row takes the replica out of rotation (``unhealthy``), and one
that stays so for ``stall_timeout_s`` is restarted; an engine that says it is broken
``unhealthy_after`` times in a row is restarted; a dead or restarted process, or one that holds
requests without progress (tokens, denoise steps) for ``stall_timeout_s``, is restarted at once.
Restarting is the lifecycle's (``recover``); states move only through ``Replica.move_to``.

The stats loop polls every live replica's engine stats for /metrics, and reads from them the
load other gateway processes put there (``others_load``, ``others_outstanding``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from gateway.fleet import views
from gateway.observability.metrics import Metrics
from gateway.routing.replicas import Replica, ReplicaState
from gateway.routing.router import Router
from tandem_core.config import TandemConfig
from tandem_core.errors import ErrorKind, TandemError

logger = logging.getLogger(__name__)

STATS_EVERY_S = 2.0

# recover(replica, reason, kill): out of rotation, its requests failed, restarted.
Recover = Callable[[Replica, str, bool], None]


class HealthMonitor:
    def __init__(self, config: TandemConfig, router: Router, metrics: Metrics, recover: Recover,
                 stopping: Callable[[], bool]):
        self.config, self.router, self.metrics = config, router, metrics
        self._recover, self._stopping = recover, stopping

    async def health_loop(self) -> None:
        interval = self.config.gateway.health_interval_s
        while not self._stopping():  # a flag too: 3.11's wait_for can swallow a cancellation
            await asyncio.sleep(interval)
            checks = [self.check(r) for r in self.router.all_replicas()
                      if r.state.live and r.state is not ReplicaState.DRAINING]
            await asyncio.gather(*checks)

    async def stats_loop(self) -> None:
        """Poll every replica's engine stats for /metrics (works wherever the actors run)."""
        interval = min(self.config.gateway.health_interval_s, STATS_EVERY_S)
        while not self._stopping():
            rows = []
            for r in self.router.all_replicas():
                stats = None
                if r.state.live:
                    try:
                        s = await asyncio.wait_for(r.handle.stats(), timeout=interval)
                        stats = {"running": s.running, "waiting": s.waiting, **s.extra}
                    except Exception:  # noqa: BLE001 - the health loop judges the replica
                        stats = None
                    else:
                        per_channel = stats.pop("channel_in_flight", None)
                        r.others_load = others_load(r, per_channel)
                        r.others_outstanding = others_outstanding(r, per_channel)
                rows.append((r.model, r.id, r.state.value, stats))
            self.metrics.set_replicas(rows, [s.value for s in ReplicaState])
            for name, pool in self.router.pools.items():
                self.metrics.queued.labels(name).set(pool.queued)
                self.metrics.set_queued_by_class(name, pool.admission.queued_by_priority())
                self.metrics.set_scaling(name, views.replica_counts(pool))
            await asyncio.sleep(interval)

    async def check(self, replica: Replica) -> None:
        """One health check (the rules are the module's)."""
        gw = self.config.gateway
        now = time.monotonic()
        timeout = gw.health_timeout_s or gw.health_interval_s
        try:
            health = await asyncio.wait_for(replica.handle.health(), timeout=timeout)
        except Exception as e:  # noqa: BLE001 - any failure counts
            if isinstance(e, TandemError) and e.kind is ErrorKind.ENGINE_DEAD:
                return self._recover(replica, "its process died", False)
            replica.consecutive_failures += 1
            timed_out = isinstance(e, TimeoutError)
            replica.last_error = "health check timed out" if timed_out else f"health check: {type(e).__name__}: {e}"
            if replica.consecutive_failures < gw.unhealthy_after:
                return
            if not timed_out:
                return self._recover(replica, f"its engine failed ({replica.last_error})", True)
            if replica.state is ReplicaState.HEALTHY:
                replica.move_to(ReplicaState.UNHEALTHY, replica.last_error)
                logger.warning("replica %s: out of rotation (%s)", replica.id, replica.last_error)
            elif now - replica.unhealthy_since >= gw.stall_timeout_s:
                self._recover(replica, f"unresponsive for {now - replica.unhealthy_since:.0f} s", True)
            return
        if not health.started or (replica.incarnation is not None and health.incarnation != replica.incarnation):
            return self._recover(replica, "its process was restarted", False)
        replica.incarnation = health.incarnation
        if health.in_flight and health.progress == replica.progress:
            if now - replica.progress_since >= gw.stall_timeout_s:
                return self._recover(replica, f"no progress for {now - replica.progress_since:.0f} s with "
                                     f"{health.in_flight} request(s)", True)
        else:
            replica.progress, replica.progress_since = health.progress, now
        if replica.state is ReplicaState.UNHEALTHY:
            logger.info("replica %s: healthy again", replica.id)
        replica.consecutive_failures = 0
        replica.move_to(ReplicaState.HEALTHY)


def others_outstanding(replica: Replica, per_channel: dict[str, int] | None) -> int:
    """The requests other gateway processes have on ``replica`` (from its per-channel counts)."""
    if not per_channel:
        return 0
    mine = replica.handle.channel_id
    return sum(n for cid, n in per_channel.items() if cid != mine)


def others_load(replica: Replica, per_channel: dict[str, int] | None) -> float:
    """The load the other gateway processes put on ``replica``, in ``Replica.load``'s units: the
    requests the replica holds for other channels than this process's, each weighed as this
    process's own requests on it weigh on average (1 request = 1 unit when it has none)."""
    others = others_outstanding(replica, per_channel)
    if not others:
        return 0.0
    per_request = replica.load / replica.outstanding if replica.outstanding else 1.0
    return others * per_request
