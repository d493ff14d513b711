"""The gateway's running state: the router, the replicas, their start-up and health loop.

How replicas come to exist is injected (``Deployment``): Ray actors in production
(``workers.deployment.RayDeployment``), in-process engines in unit tests.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Protocol

from gateway.config import ModelConfig, TandemConfig
from gateway.metrics import Metrics
from gateway.replicas import Replica, ReplicaState
from gateway.router import ModelPool, Router

logger = logging.getLogger(__name__)

PROGRESS_EVERY_S = 15.0
UNHEALTHY_AFTER = 2  # consecutive failed health checks
STATS_EVERY_S = 2.0


class Deployment(Protocol):
    def create_replicas(self, model: ModelConfig) -> list[Replica]:
        """Create (not start) the replicas of one model; called once per model at start-up."""

    def close(self) -> None:
        """Release everything the deployment holds (actors, the Ray connection)."""


class Service:
    def __init__(self, config: TandemConfig, deployment: Deployment):
        self.config = config
        self.deployment = deployment
        self.router = Router([ModelPool(m.name, m.kind.value, max_in_flight=m.max_in_flight_per_replica,
                                        max_queue=config.gateway.max_queue) for m in config.models])
        self.draining = False
        self.started_at = time.monotonic()
        self._tasks: list[asyncio.Task] = []
        self._stopping = False
        self.metrics = Metrics([m.name for m in config.models])
        self._metrics_server = None

    async def start(self) -> None:
        """Create every replica and start them in the background; /ready says when they serve."""
        self.started_at = time.monotonic()
        for model in self.config.models:
            pool = self.router.pools[model.name]
            pool.replicas = self.deployment.create_replicas(model)
            for replica in pool.replicas:
                self._tasks.append(asyncio.create_task(self._start_replica(replica)))
        self._tasks.append(asyncio.create_task(self._health_loop()))
        self._tasks.append(asyncio.create_task(self._stats_loop()))
        if self.config.metrics.port is not None:
            from prometheus_client import start_http_server

            self._metrics_server, _ = start_http_server(self.config.metrics.port, self.config.metrics.host,
                                                        registry=self.metrics.registry)
            logger.info("metrics on http://%s:%d/metrics", self.config.metrics.host, self.config.metrics.port)

    async def _start_replica(self, replica: Replica) -> None:
        t0 = time.monotonic()
        logger.info("replica %s: loading %s", replica.id, replica.model)
        start = asyncio.ensure_future(replica.handle.start())
        while True:
            done, _ = await asyncio.wait({start}, timeout=PROGRESS_EVERY_S)
            if done:
                break
            logger.info("replica %s: still loading (%.0f s)", replica.id, time.monotonic() - t0)
        try:
            replica.info = start.result()
        except Exception as e:  # noqa: BLE001 - reported in /ready and the log
            replica.state = ReplicaState.FAILED
            replica.last_error = f"{type(e).__name__}: {e}"
            logger.error("replica %s: failed to start: %s", replica.id, replica.last_error)
            return
        replica.state = ReplicaState.HEALTHY
        self.router.pools[replica.model].wake()
        logger.info("replica %s: ready in %.1f s", replica.id, time.monotonic() - t0)
        if self.config.gateway.avoid_engine_cores:
            from workers.cpu_affinity import keep_off_vllm_workers

            keep_off_vllm_workers()
        if self.router.ready():
            logger.info("all models ready: %s", ", ".join(self.router.pools))

    async def _health_loop(self) -> None:
        interval = self.config.gateway.health_interval_s
        while not self._stopping:  # a flag too: 3.11's wait_for can swallow a cancellation
            await asyncio.sleep(interval)
            checks = [self._check(r) for r in self.router.all_replicas()
                      if r.state in (ReplicaState.HEALTHY, ReplicaState.UNHEALTHY)]
            await asyncio.gather(*checks)

    async def _stats_loop(self) -> None:
        """Poll every replica's engine stats for /metrics (works wherever the actors run)."""
        interval = min(self.config.gateway.health_interval_s, STATS_EVERY_S)
        while not self._stopping:
            rows = []
            for r in self.router.all_replicas():
                stats = None
                if r.state in (ReplicaState.HEALTHY, ReplicaState.UNHEALTHY):
                    try:
                        s = await asyncio.wait_for(r.handle.stats(), timeout=interval)
                        stats = {"running": s.running, "waiting": s.waiting, **s.extra}
                    except Exception:  # noqa: BLE001 - the health loop judges the replica
                        stats = None
                rows.append((r.model, r.id, r.state.value, stats))
            self.metrics.set_replicas(rows, [s.value for s in ReplicaState])
            for name, pool in self.router.pools.items():
                self.metrics.queued.labels(name).set(pool.queued)
            await asyncio.sleep(interval)

    async def _check(self, replica: Replica) -> None:
        try:
            await asyncio.wait_for(replica.handle.check_health(), timeout=self.config.gateway.health_interval_s)
        except Exception as e:  # noqa: BLE001 - any failure counts
            replica.consecutive_failures += 1
            replica.last_error = f"health check: {type(e).__name__}: {e}"
            if replica.consecutive_failures >= UNHEALTHY_AFTER and replica.state is ReplicaState.HEALTHY:
                replica.state = ReplicaState.UNHEALTHY
                logger.warning("replica %s: unhealthy (%s)", replica.id, replica.last_error)
            return
        if replica.state is ReplicaState.UNHEALTHY:
            logger.info("replica %s: healthy again", replica.id)
        replica.consecutive_failures = 0
        replica.state = ReplicaState.HEALTHY
        self.router.pools[replica.model].wake()

    def in_flight(self) -> int:
        return sum(r.outstanding for r in self.router.all_replicas())

    async def drain(self) -> bool:
        """Refuse new requests (and say so in /ready); wait for in-flight ones. True if drained."""
        self.draining = True
        deadline = time.monotonic() + self.config.gateway.drain_timeout_s
        logger.info("draining: %d request(s) in flight, up to %.0f s", self.in_flight(),
                    self.config.gateway.drain_timeout_s)
        while self.in_flight() and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        left = self.in_flight()
        if left:
            logger.warning("drain timeout: %d request(s) still in flight", left)
        return left == 0

    async def stop(self) -> None:
        self._stopping = True
        for task in self._tasks:
            task.cancel()
        await asyncio.wait(self._tasks, timeout=10) if self._tasks else None
        replicas = [r for r in self.router.all_replicas() if r.state is not ReplicaState.FAILED]
        results = await asyncio.gather(
            *(asyncio.wait_for(r.handle.shutdown(), timeout=30) for r in replicas), return_exceptions=True)
        for r, res in zip(replicas, results, strict=True):
            if isinstance(res, BaseException):
                logger.warning("replica %s: shutdown: %s", r.id, res)
        self.deployment.close()
        if self._metrics_server is not None:
            self._metrics_server.shutdown()

    def model_card(self, name: str) -> dict:
        pool = self.router.pools[name]
        info = next((r.info for r in pool.replicas if r.info is not None), None)
        return {
            "id": name,
            "object": "model",
            "created": 0,
            "owned_by": "tandem",
            "kind": pool.kind,
            "max_model_len": info.max_model_len if info else None,
            "replicas": {"total": len(pool.replicas), "healthy": len(pool.healthy())},
        }

    async def replica_stats(self) -> list[dict]:
        replicas = self.router.all_replicas()

        async def one(r: Replica) -> dict:
            row = {"id": r.id, "model": r.model, "state": r.state.value, "outstanding": r.outstanding}
            if r.state in (ReplicaState.HEALTHY, ReplicaState.UNHEALTHY):
                try:
                    s = await asyncio.wait_for(r.handle.stats(), timeout=5)
                    row["engine"] = {"running": s.running, "waiting": s.waiting, **s.extra}
                except Exception as e:  # noqa: BLE001 - reported, not raised
                    row["engine_error"] = f"{type(e).__name__}: {e}"
            return row

        return list(await asyncio.gather(*(one(r) for r in replicas)))

    def readiness(self) -> dict:
        models = {}
        for name, pool in self.router.pools.items():
            models[name] = {
                "ready": bool(pool.healthy()),
                "replicas": [{"id": r.id, "state": r.state.value, "error": r.last_error} for r in pool.replicas],
            }
        return {"ready": all(m["ready"] for m in models.values()), "models": models}
