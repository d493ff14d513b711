"""The replica supervisor: brings every replica up, takes a failed one out of rotation (failing
its requests) and restarts it. How replicas come to exist is injected (``Deployment``): Ray
actors in production (``workers.deployment.RayDeployment``), in-process engines in unit tests.
Its two other parts: ``gateway/fleet/health.py`` (health checks, engine stats) and
``gateway/fleet/scaling.py`` (autoscaling, draining, following the owner's replica table). A
replica's state moves only through ``Replica.move_to``; the supervisor carries out the moves'
effects that are its own (publishing the replica table, the restart metric), the pool the rest.

With several gateway processes (``gateway/processes.py``) one supervisor owns the replicas and
the others are ``attached``: an attached one takes a failed replica out of rotation and fails
its requests at once, as the owner does, but never restarts or shuts one down (two restarts of
one actor would kill a healthy one); it waits for the owner to bring the replica back. Each one
reads from the replicas how many requests the other processes have on them (``others_load``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Protocol

from gateway.fleet.health import HealthMonitor
from gateway.fleet.scaling import Scaling
from gateway.observability.metrics import Metrics
from gateway.routing.replicas import Effect, Move, Replica, ReplicaState
from gateway.routing.router import Router
from tandem_core.config import ModelConfig, TandemConfig
from tandem_core.errors import ErrorKind, TandemError, engine_config_line
from tandem_core.protocol import ReplicaHandle, Role

logger = logging.getLogger(__name__)

PROGRESS_EVERY_S = 15.0
PLACEMENT_CHECK_S = 5.0  # a replica not started by then: ask whether it can be placed at all
RESTART_BACKOFF_S = (1.0, 30.0)


class Deployment(Protocol):
    def create_replicas(self, model: ModelConfig) -> list[tuple[str, ReplicaHandle]]:
        """Create (not start) the replicas of one model, (replica id, handle) each; called once
        per model at start-up."""

    def create_replica(self, model: ModelConfig, index: int) -> tuple[str, ReplicaHandle]:
        """Create (not start) one more replica of ``model`` (autoscaling), its id built from
        ``index``, an index never used before for this model."""

    def remove_replica(self, replica_id: str) -> None:
        """Release a replica created here, its engine already shut down (autoscaling); blocking."""

    def placement_problem(self, model: ModelConfig, replica_id: str | None = None) -> str | None:
        """Why a replica of ``model`` (``replica_id``: that one, created and not started yet)
        cannot be placed now, or None; blocking (asks the cluster)."""

    # Optional: ``fixed_nodes`` (True: no node can join, so a replica no node can hold fails the
    # start) and ``placement_of(replica_id)`` (a replica's placement group, for /admin/replicas).

    role: Role  # who owns the replicas (and whether other gateway processes serve them too)

    def publish_replicas(self, model: str, table: dict[str, str]) -> None:
        """Owner: write {replica id: "serving" | "draining"} of an autoscaled model where the
        attached gateway processes read it (``replica_table``); blocking."""

    def replica_table(self, model: str) -> dict[str, str] | None:
        """The table the owner last published for ``model``, None if none; blocking."""

    def close(self) -> None:
        """Release everything the deployment holds (actors, the Ray connection)."""


class Supervisor:
    def __init__(self, config: TandemConfig, deployment: Deployment, router: Router, metrics: Metrics):
        self.config = config
        self.deployment = deployment
        self.router = router
        self.metrics = metrics
        self._tasks: list[asyncio.Task] = []
        self._stopping = False
        self._bringing_up: dict[str, asyncio.Task] = {}  # replica id -> its start or restart task
        self.health = HealthMonitor(config, router, metrics, self.recover, lambda: self._stopping)
        self.scaling = Scaling(config, deployment, router, metrics, self)
        # Called with one line when a replica's first start fails for its configuration before
        # every model has served (``tandem serve`` then exits 2); ``_served``: they have.
        self.on_fatal: Callable[[str], None] | None = None
        self._served = False
        # Awaited when a replica's engine has (re)started, before it serves (LoRA adapters loaded at run time).
        self.on_engine_started: Callable[[Replica], Awaitable[None]] | None = None

    @property
    def attached(self) -> bool:
        """Another process owns (restarts, shuts down) the replicas (the deployment's role)."""
        return self.deployment.role is Role.ATTACHED

    @property
    def stopping(self) -> bool:
        return self._stopping

    def start(self) -> None:
        """Create every replica and start them in the background (the router serves each one
        once it is healthy); then the health and stats loops."""
        if self._unplaceable():
            return
        for model in self.config.models:
            pool = self.router.pools[model.name]
            pool.replicas = []
            if self.attached and model.autoscaling is not None:
                self.scaling.attach(model)
                continue
            created = self.deployment.create_replicas(model)
            for rid, handle in created:
                self.add(model, rid, handle)
            self.scaling.manage(model, len(created))
        self.spawn(self.health.health_loop())
        self.spawn(self.health.stats_loop())

    def _unplaceable(self) -> bool:
        """Where no node can join (a local Ray), a model whose replica no node can hold (a GPU on a
        host without one; a TP group larger than any node) cannot work: say so in one line and stop
        (``on_fatal``) instead of waiting forever. On a cluster it waits, and /ready and
        /admin/replicas say for what."""
        if self.attached or not getattr(self.deployment, "fixed_nodes", False):
            return False
        for model in self.config.models:
            problem = self.deployment.placement_problem(model)
            if problem:
                line = (f"model {model.name!r}: a replica needs resources this local Ray does not have "
                        f"(resources.num_gpus, num_cpus, custom; TP x PP): {problem.replace('; add such a node', '')}")
                logger.error("%s", line)
                if self.on_fatal is not None:
                    self.on_fatal(line)
                return True
        return False

    def add(self, model: ModelConfig, rid: str, handle: ReplicaHandle) -> Replica:
        """A created replica joins the pool and starts in the background (served once healthy)."""
        replica = Replica(id=rid, model=model.name, handle=handle)
        replica.handle.on_broken = partial(self._on_broken, replica)
        self.router.pools[model.name].add(replica)
        replica.listeners.append(self._on_move)
        self._bringing_up[rid] = self.spawn(self._start_replica(replica))
        return replica

    def _on_move(self, move: Move) -> None:
        """The effects of a replica's move that are the supervisor's."""
        if Effect.PUBLISH in move.effects:
            self.scaling.publish(move.replica.model)
        if Effect.RESTART in move.effects and not self.attached:  # counted once, by the process that restarts it
            self.metrics.restarts.labels(self.metrics.model_label(move.replica.model)).inc()

    def spawn(self, coro) -> asyncio.Task:
        task = asyncio.create_task(coro)
        self._tasks.append(task)
        task.add_done_callback(self._forget)
        return task

    def _forget(self, task: asyncio.Task) -> None:
        if not self._stopping and task in self._tasks:  # while stopping, stop() awaits the list
            self._tasks.remove(task)

    def stop_bringing_up(self, replica: Replica) -> None:
        up = self._bringing_up.pop(replica.id, None)
        if up is not None:
            up.cancel()

    # -- bringing replicas up --------------------------------------------------------------

    async def _bring_up(self, replica: Replica, op) -> None:
        """Await ``op`` (start or restart); meanwhile say in the log and in /ready what it waits
        for, and whether it can be placed at all. Raises what ``op`` raises."""
        model = self.config.model(replica.model)
        t0 = time.monotonic()
        waiting_state = replica.state
        task = asyncio.ensure_future(op)
        timeout = PLACEMENT_CHECK_S
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=timeout)
                if done:
                    break
                timeout = PROGRESS_EVERY_S
                problem = await self._placement_problem(model, replica.id)
                if problem and replica.state is not ReplicaState.PENDING:
                    logger.warning("replica %s: cannot be placed: %s", replica.id, problem)
                    replica.move_to(ReplicaState.PENDING, problem)
                elif not problem and replica.state is ReplicaState.PENDING:
                    replica.move_to(waiting_state)
                logger.info("replica %s: still %s (%.0f s)", replica.id,
                            "waiting for placement" if problem else "loading", time.monotonic() - t0)
        finally:
            task.cancel()  # no-op when done; stops a restart loop when the service stops
        if replica.state is ReplicaState.DRAINING:  # removed while it came up (the remover cancels us too)
            return
        replica.info = task.result()
        if self.on_engine_started is not None:
            await self.on_engine_started(replica)
            if replica.state is ReplicaState.DRAINING:  # removed meanwhile
                return
        replica.incarnation, replica.consecutive_failures = None, 0
        replica.progress, replica.progress_since = -1, time.monotonic()
        replica.move_to(ReplicaState.HEALTHY)  # served from now on (Effect.WAKE)
        logger.info("replica %s: ready in %.1f s", replica.id, time.monotonic() - t0)
        if self.config.gateway.avoid_engine_cores:
            from workers.cpu_affinity import keep_off_vllm_workers

            keep_off_vllm_workers()

    async def _placement_problem(self, model: ModelConfig | None, replica_id: str) -> str | None:
        if model is None:
            return None
        try:  # off the event loop: asking the cluster (Ray's GCS) blocks
            return await asyncio.to_thread(self.deployment.placement_problem, model, replica_id)
        except Exception as e:  # noqa: BLE001 - a diagnosis must not break start-up
            logger.debug("placement check failed: %s", e)
            return None

    async def _start_replica(self, replica: Replica) -> None:
        logger.info("replica %s: loading %s", replica.id, replica.model)
        try:
            await self._bring_up(replica, replica.handle.start())
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - reported in /ready and the log
            if replica.state is ReplicaState.DRAINING:  # removed meanwhile
                return
            config_line = engine_config_line(e)
            replica.move_to(ReplicaState.FAILED, config_line or f"{type(e).__name__}: {e}")
            logger.error("replica %s: failed to start: %s", replica.id, replica.last_error)
            if config_line and not self._served and self.on_fatal is not None:
                self.on_fatal(config_line)  # its configuration cannot work: `tandem serve` exits, as vLLM's would
            return
        self._served = self._served or self.router.ready()
        if self.router.ready():
            logger.info("all models ready: %s", ", ".join(self.router.pools))

    # -- failure: out of rotation, fail its requests, restart ---------------------------------

    def _on_broken(self, replica: Replica, err: TandemError) -> None:
        """The replica's channel broke (its actor died, its node left): restart it now."""
        if not self._stopping:
            self.recover(replica, "its process died" if err.kind is ErrorKind.ENGINE_DEAD else str(err), kill=False)

    def recover(self, replica: Replica, reason: str, kill: bool) -> None:
        """Take a failed replica out of rotation, end every request on it with an error, and
        restart it in the background (it rejoins when started). ``kill``: it is stuck, not dead."""
        if replica.state not in (ReplicaState.HEALTHY, ReplicaState.UNHEALTHY) or self._stopping:
            return  # already being restarted, or never started
        logger.warning("replica %s: out of rotation, %s: %s", replica.id,
                       "waiting for its owner to restart it" if self.attached else "restarting", reason)
        replica.move_to(ReplicaState.RESTARTING, reason)  # a new generation; queued requests may fail
        replica.handle.fail_in_flight(TandemError(
            ErrorKind.ENGINE_DEAD, f"the replica serving this request failed ({reason}); it is being restarted"))
        self._bringing_up[replica.id] = self.spawn(self._restart(replica, kill))

    async def _restart(self, replica: Replica, kill: bool) -> None:
        backoff = RESTART_BACKOFF_S[0]
        while not self._stopping:
            try:
                await self._bring_up(replica, replica.handle.restart(kill))
                logger.info("replica %s: back in rotation after restart #%d", replica.id, replica.restarts)
                return
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - e.g. the engine failed to start; try again
                if replica.state is ReplicaState.DRAINING:  # removed meanwhile
                    return
                config_line = engine_config_line(e)
                if config_line:  # its configuration cannot work: trying again cannot help
                    replica.move_to(ReplicaState.FAILED, config_line)
                    logger.error("replica %s: restart failed: %s", replica.id, config_line)
                    return
                replica.move_to(ReplicaState.RESTARTING, f"restart: {type(e).__name__}: {e}")
                logger.error("replica %s: %s; next try in %.0f s", replica.id, replica.last_error, backoff)
                kill = True
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, RESTART_BACKOFF_S[1])

    async def stop(self) -> None:
        """Stop the loops, shut every live replica's engine down, release the deployment.
        Attached: only this process's channels close; the replicas are the owner's."""
        self._stopping = True
        for task in self._tasks:
            task.cancel()
        await asyncio.wait(self._tasks, timeout=10) if self._tasks else None
        if self.attached:
            for r in self.router.all_replicas():
                r.handle.fail_in_flight(TandemError(ErrorKind.SHUTTING_DOWN, "the gateway is shutting down"))
            self.deployment.close()
            return
        replicas = [r for r in self.router.all_replicas() if r.state.live]  # the others: killed by close()
        results = await asyncio.gather(
            *(asyncio.wait_for(r.handle.shutdown(), timeout=30) for r in replicas), return_exceptions=True)
        for r, res in zip(replicas, results, strict=True):
            if isinstance(res, BaseException):
                logger.warning("replica %s: shutdown: %s", r.id, res)
        self.deployment.close()

