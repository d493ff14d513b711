"""Autoscaling and draining, for the supervisor.

A loop per autoscaled model samples its load (requests in flight and queued) and asks
``gateway.fleet.autoscaler`` for the replica count. Up: new replicas are created through the
deployment with fresh ids (``<model>/<n>``, n never reused) and brought up like the first ones
(pending, with the reason, while no node can hold one; served once healthy). Down: the least
loaded replica (one not serving yet first) is drained: the router sends it nothing new, its
requests finish (up to ``gateway.drain_timeout_s``), then its engine is shut down, its actor
released and it leaves the pool.

With several gateway processes only the owner decides, on the requests in flight on the
replicas (every process's, as the replicas count them) plus those queued in every gateway
process on this host (the shared metrics; `--attach` processes on other nodes: once their
requests reach a replica). It publishes each model's replica table ({id: serving | draining},
``Deployment.publish_replicas``) whenever it changes (``Effect.PUBLISH``); attached processes
poll it every ``autoscaling.interval_s`` and follow: a new replica is attached and served once
the owner has started it, a draining one gets no new request from them either, a removed one
leaves. So that every process has stopped sending to a draining replica, the owner waits two
intervals before it trusts the replica's own count of requests in flight (all processes') to
reach 0.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Protocol

from gateway.fleet import views
from gateway.fleet.autoscaler import Autoscaler, Decision
from gateway.observability.metrics import Metrics
from gateway.routing.replicas import Replica, ReplicaState
from gateway.routing.router import Router
from tandem_core.config import ModelConfig, TandemConfig
from tandem_core.errors import ErrorKind, TandemError
from tandem_core.protocol import ReplicaHandle, Role

logger = logging.getLogger(__name__)

DRAIN_POLL_S = 0.05
SERVING, DRAINING = "serving", "draining"  # a replica in the owner's published table
# A replica to remove, by preference: one that serves nothing yet (or no more), then the least loaded.
_REMOVE_FIRST = (ReplicaState.FAILED, ReplicaState.PENDING, ReplicaState.STARTING, ReplicaState.RESTARTING,
                 ReplicaState.UNHEALTHY, ReplicaState.HEALTHY)


class Lifecycle(Protocol):
    """What scaling asks of the supervisor's lifecycle part."""

    @property
    def stopping(self) -> bool: ...

    def add(self, model: ModelConfig, rid: str, handle: ReplicaHandle) -> Replica: ...

    def spawn(self, coro) -> asyncio.Task: ...

    def stop_bringing_up(self, replica: Replica) -> None: ...


class Scaling:
    def __init__(self, config: TandemConfig, deployment, router: Router, metrics: Metrics, lifecycle: Lifecycle):
        self.config, self.deployment, self.router, self.metrics = config, deployment, router, metrics
        self.lifecycle = lifecycle
        self.scalers: dict[str, Autoscaler] = {}
        self.next_index: dict[str, int] = {}

    def manage(self, model: ModelConfig, created: int) -> None:
        """Owner: autoscale ``model``, whose first ``created`` replicas exist."""
        self.next_index[model.name] = created
        if model.autoscaling is not None:
            self.scalers[model.name] = Autoscaler(model.autoscaling, created)
            self.publish(model.name)
            self.lifecycle.spawn(self._autoscale_loop(model))

    def attach(self, model: ModelConfig) -> None:
        """Attached: the owner's replicas of an autoscaled ``model``, as it says now and later."""
        self.follow(model, self._table(model) or {f"{model.name}/{i}": SERVING for i in range(model.replicas)})
        self.lifecycle.spawn(self._follow_loop(model))

    async def _autoscale_loop(self, model: ModelConfig) -> None:
        scaler, pool = self.scalers[model.name], self.router.pools[model.name]
        while not self.lifecycle.stopping:
            await asyncio.sleep(model.autoscaling.interval_s)
            load = model_load(pool)
            if self.deployment.role.shared:  # the other gateway processes' queues (this host)
                load += max(0.0, self.metrics.queued_everywhere(model.name) - pool.queued)
            decision = scaler.observe(time.monotonic(), load)
            if decision is not None and not self.lifecycle.stopping:
                self.scale(model, decision)

    def publish(self, model: str) -> None:
        """Owner: tell the attached gateway processes which replicas a model has now."""
        if self.deployment.role is not Role.OWNER:
            return
        table = {r.id: DRAINING if r.state is ReplicaState.DRAINING else SERVING
                 for r in self.router.pools[model].replicas}
        try:
            self.deployment.publish_replicas(model, table)
        except Exception as e:  # noqa: BLE001 - the next change publishes again
            logger.warning("model %s: could not publish its replicas: %s", model, e)

    def _table(self, model: ModelConfig) -> dict[str, str] | None:
        try:
            return self.deployment.replica_table(model.name)
        except Exception as e:  # noqa: BLE001 - the next poll tries again
            logger.debug("model %s: replica table: %s", model.name, e)
            return None

    async def _follow_loop(self, model: ModelConfig) -> None:
        """Attached: follow the owner's replica table of an autoscaled model."""
        while not self.lifecycle.stopping:
            await asyncio.sleep(model.autoscaling.interval_s)
            table = await asyncio.to_thread(self._table, model)
            if table is not None and not self.lifecycle.stopping:
                self.follow(model, table)

    def follow(self, model: ModelConfig, table: dict[str, str]) -> None:
        """Attached: make the pool match the owner's ``table``: attach its new serving replicas
        (served once the owner has started them), stop sending to its draining ones, drop the
        ones it no longer lists."""
        pool = self.router.pools[model.name]
        known = {r.id: r for r in pool.replicas}
        for rid in sorted(table, key=_index_of):
            replica = known.get(rid)
            if replica is None and table[rid] == SERVING:
                _, handle = self.deployment.create_replica(model, _index_of(rid))
                self.lifecycle.add(model, rid, handle)
                logger.info("replica %s: added by the owner", rid)
            elif replica is not None and table[rid] == DRAINING and replica.state is not ReplicaState.DRAINING:
                self.lifecycle.stop_bringing_up(replica)
                replica.move_to(ReplicaState.DRAINING)
                logger.info("replica %s: draining (the owner removes it)", rid)
        for rid, replica in known.items():
            if rid not in table:
                self.lifecycle.spawn(self._let_go(replica))

    async def _let_go(self, replica: Replica) -> None:
        """Attached: the owner removed ``replica``; what this process still had there fails."""
        self.lifecycle.stop_bringing_up(replica)
        replica.move_to(ReplicaState.DRAINING)
        if replica.outstanding:
            replica.handle.fail_in_flight(TandemError(
                ErrorKind.SHUTTING_DOWN, "the replica serving this request was removed (scaled down)"))
        try:
            await asyncio.wait_for(replica.handle.shutdown(), timeout=30)  # attached: this process's side only
        except Exception as e:  # noqa: BLE001 - gone anyway
            logger.debug("replica %s: %s", replica.id, e)
        self.router.pools[replica.model].remove(replica)
        logger.info("replica %s: removed by the owner", replica.id)

    def scale(self, model: ModelConfig, decision: Decision) -> None:
        """Add or drain replicas until ``decision.desired`` of them are serving or on their way."""
        pool = self.router.pools[model.name]
        counted = [r for r in pool.replicas if r.state is not ReplicaState.DRAINING]
        logger.info("model %s: scaling %s from %d to %d replica(s) (load %.1f: requests in flight and queued)",
                    model.name, decision.direction, len(counted), decision.desired, decision.load)
        self.metrics.scale_events.labels(model.name, decision.direction).inc()
        for _ in range(decision.desired - len(counted)):
            index = self.next_index[model.name]
            self.next_index[model.name] = index + 1
            rid, handle = self.deployment.create_replica(model, index)
            self.lifecycle.add(model, rid, handle)
            logger.info("replica %s: added", rid)
        for _ in range(len(counted) - decision.desired):
            victim = min((r for r in pool.replicas if r.state is not ReplicaState.DRAINING), key=_removal_order)
            self.lifecycle.spawn(self.drain_and_remove(victim))
        self.publish(model.name)
        self.metrics.set_scaling(model.name, views.replica_counts(pool))

    async def drain_and_remove(self, replica: Replica) -> None:
        """Take ``replica`` out of rotation at once, let its requests finish (up to
        ``gateway.drain_timeout_s``; then they fail), shut its engine down, release it and drop
        it from the pool. One that was still coming up is stopped where it is."""
        pool = self.router.pools[replica.model]
        engine_up = replica.state in (ReplicaState.HEALTHY, ReplicaState.UNHEALTHY)
        self.lifecycle.stop_bringing_up(replica)
        replica.move_to(ReplicaState.DRAINING)  # published (Effect.PUBLISH)
        logger.info("replica %s: draining (%d request(s) in flight here, %d from other gateway processes)",
                    replica.id, replica.outstanding, replica.others_outstanding)
        if engine_up:
            await self._drain(replica)
        try:
            await asyncio.to_thread(self.deployment.remove_replica, replica.id)
        except Exception as e:  # noqa: BLE001 - gone from the pool anyway; close() releases the rest
            logger.warning("replica %s: release: %s", replica.id, e)
        pool.remove(replica)
        self.publish(replica.model)
        self.metrics.set_scaling(replica.model, views.replica_counts(pool))
        logger.info("replica %s: removed", replica.id)

    async def _drain(self, replica: Replica) -> None:
        """Wait for the requests on ``replica`` (every process's) to finish, fail what is left at
        the drain timeout, shut its engine down."""
        gw = self.config.gateway
        now = time.monotonic()
        deadline = now + gw.drain_timeout_s
        model = self.config.model(replica.model)
        shared = self.deployment.role.shared
        # Other gateway processes see `draining` at their next look at the table.
        noticed = now + (2 * model.autoscaling.interval_s if shared and model.autoscaling else 0.0)
        while time.monotonic() < deadline:
            if replica.outstanding == 0 and time.monotonic() >= noticed:
                if not shared or await self._in_flight_everywhere(replica) == 0:
                    break
            await asyncio.sleep(DRAIN_POLL_S)  # a poll: releases come from many requests and processes
        if replica.outstanding:
            logger.warning("replica %s: drain timeout, %d request(s) still in flight fail", replica.id,
                           replica.outstanding)
            replica.handle.fail_in_flight(TandemError(
                ErrorKind.SHUTTING_DOWN, "the replica serving this request was removed (scaled down) and its "
                f"drain timeout ({gw.drain_timeout_s:g} s) ran out"))
        try:
            await asyncio.wait_for(replica.handle.shutdown(), timeout=30)
        except Exception as e:  # noqa: BLE001 - it is released anyway
            logger.warning("replica %s: shutdown: %s", replica.id, e)

    async def _in_flight_everywhere(self, replica: Replica) -> int:
        """The requests ``replica`` runs for every gateway process, as it counts them now (0 if it
        does not answer: nothing of it is left to wait for)."""
        try:
            return (await asyncio.wait_for(replica.handle.health(), timeout=self.config.gateway.health_interval_s
                                           + 5)).in_flight
        except Exception as e:  # noqa: BLE001 - dead or stuck: its requests are lost either way
            logger.warning("replica %s: in-flight count while draining: %s", replica.id, e)
            return 0


def model_load(pool) -> float:
    """The autoscaler's signal for one model: requests in flight on its replicas, from this
    gateway process and the others, plus those queued here."""
    return float(sum(r.outstanding + r.others_outstanding for r in pool.replicas) + pool.queued)


def _index_of(replica_id: str) -> int:
    """n of replica ``<model>/<n>``."""
    return int(replica_id.rsplit("/", 1)[-1])


def _removal_order(r: Replica) -> tuple[int, int, int]:
    """Remove first what serves nothing (not started, failed), then the least loaded, then the
    newest."""
    rank = _REMOVE_FIRST.index(r.state) if r.state in _REMOVE_FIRST else 0
    tail = r.id.rsplit("/", 1)[-1]
    return (rank, r.outstanding + r.others_outstanding, -int(tail) if tail.isdigit() else 0)
