"""The replica supervisor: brings every replica up, checks its health and progress, takes a
failed one out of rotation (failing its requests), restarts it, and feeds the engines' stats to
the metrics. How replicas come to exist is injected (``Deployment``): Ray actors in production
(``workers.deployment.RayDeployment``), in-process engines in unit tests.

With several gateway processes (``gateway/processes.py``) one supervisor owns the replicas and
the others are ``attached``: an attached one takes a failed replica out of rotation and fails
its requests at once, as the owner does, but never restarts or shuts one down (two restarts of
one actor would kill a healthy one); it waits for the owner to bring the replica back. Each one
reads from the replicas how many requests the other processes have on them (``others_load``).

Autoscaling (a model's ``autoscaling``): a loop per model samples the model's load (requests in
flight and queued) and asks ``gateway.autoscaler`` for the replica count. Up: new replicas are
created through the deployment with fresh ids (``<model>/<n>``, n never reused) and brought up
like the first ones (pending, with the reason, while no node can hold one; served once healthy).
Down: the least loaded replica (one not serving yet first) is drained: the router sends it
nothing new, its requests finish (up to ``gateway.drain_timeout_s``), then its engine is shut
down, its actor released and it leaves the pool.

Autoscaling with several gateway processes: only the owner decides, on the requests in flight on
the replicas (every process's, as the replicas count them) plus those queued in every gateway
process on this host (the shared metrics; `--attach` processes on other nodes: once their
requests reach a replica). It publishes each model's replica table ({id: serving | draining},
``Deployment.publish_replicas``) whenever it changes; attached processes poll it every
``autoscaling.interval_s`` and follow: a new replica is attached and served once the owner has
started it, a draining one gets no new request from them either, a removed one leaves. So that
every process has stopped sending to a draining replica, the owner waits two intervals before
it trusts the replica's own count of requests in flight (all processes') to reach 0.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from functools import partial
from typing import Protocol

from gateway import views
from gateway.autoscaler import Autoscaler, Decision
from gateway.metrics import Metrics
from gateway.replicas import Replica, ReplicaState
from gateway.router import Router
from tandem_core.config import ModelConfig, TandemConfig
from tandem_core.errors import ErrorKind, TandemError, engine_config_line
from tandem_core.protocol import ReplicaHandle

logger = logging.getLogger(__name__)

PROGRESS_EVERY_S = 15.0
PLACEMENT_CHECK_S = 5.0  # a replica not started by then: ask whether it can be placed at all
STATS_EVERY_S = 2.0
RESTART_BACKOFF_S = (1.0, 30.0)
DRAIN_POLL_S = 0.05
SERVING, DRAINING = "serving", "draining"  # a replica in the owner's published table
# A replica to remove, by preference: one that serves nothing yet (or no more), then the least loaded.
_REMOVE_FIRST = (ReplicaState.FAILED, ReplicaState.PENDING, ReplicaState.STARTING, ReplicaState.RESTARTING,
                 ReplicaState.UNHEALTHY, ReplicaState.HEALTHY)


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

    shares_replicas: bool  # other gateway processes may serve these replicas

    def publish_replicas(self, model: str, table: dict[str, str]) -> None:
        """Owner: write {replica id: "serving" | "draining"} of an autoscaled model where the
        attached gateway processes read it (``replica_table``); blocking."""

    def replica_table(self, model: str) -> dict[str, str] | None:
        """The table the owner last published for ``model``, None if none; blocking."""

    def close(self) -> None:
        """Release everything the deployment holds (actors, the Ray connection)."""


class Supervisor:
    def __init__(self, config: TandemConfig, deployment: Deployment, router: Router, metrics: Metrics,
                 attached: bool = False):
        self.config = config
        self.deployment = deployment
        self.router = router
        self.metrics = metrics
        self.attached = attached  # another process owns (restarts, shuts down) the replicas
        self._tasks: list[asyncio.Task] = []
        self._stopping = False
        self._bringing_up: dict[str, asyncio.Task] = {}  # replica id -> its start or restart task
        self.scalers: dict[str, Autoscaler] = {}
        self._next_index: dict[str, int] = {}
        # Called with one line when a replica's first start fails for its configuration before
        # every model has served (``tandem serve`` then exits 2); ``_served``: they have.
        self.on_fatal: Callable[[str], None] | None = None
        self._served = False

    def start(self) -> None:
        """Create every replica and start them in the background (the router serves each one
        once it is healthy); then the health and stats loops."""
        for model in self.config.models:
            pool = self.router.pools[model.name]
            pool.replicas = []
            if self.attached and model.autoscaling is not None:  # the owner's replicas, as it says now
                self.follow(model, self._table(model) or {f"{model.name}/{i}": SERVING for i in range(model.replicas)})
                self._spawn(self._follow_loop(model))
                continue
            created = self.deployment.create_replicas(model)
            for rid, handle in created:
                self._add(model, rid, handle)
            self._next_index[model.name] = len(created)
            if model.autoscaling is not None:
                self.scalers[model.name] = Autoscaler(model.autoscaling, len(created))
                self._publish(model.name)
                self._spawn(self._autoscale_loop(model))
        self._spawn(self._health_loop())
        self._spawn(self._stats_loop())

    def _add(self, model: ModelConfig, rid: str, handle: ReplicaHandle) -> Replica:
        """A created replica joins the pool and starts in the background (served once healthy)."""
        replica = Replica(id=rid, model=model.name, handle=handle)
        replica.handle.on_broken = partial(self._on_broken, replica)
        self.router.pools[model.name].replicas.append(replica)
        self._bringing_up[rid] = self._spawn(self._start_replica(replica))
        return replica

    def _spawn(self, coro) -> asyncio.Task:
        task = asyncio.create_task(coro)
        self._tasks.append(task)
        task.add_done_callback(self._forget)
        return task

    def _forget(self, task: asyncio.Task) -> None:
        if not self._stopping and task in self._tasks:  # while stopping, stop() awaits the list
            self._tasks.remove(task)

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
                    replica.state, replica.last_error = ReplicaState.PENDING, problem
                elif not problem and replica.state is ReplicaState.PENDING:
                    replica.state, replica.last_error = waiting_state, None
                logger.info("replica %s: still %s (%.0f s)", replica.id,
                            "waiting for placement" if problem else "loading", time.monotonic() - t0)
        finally:
            task.cancel()  # no-op when done; stops a restart loop when the service stops
        if replica.state is ReplicaState.DRAINING:  # removed while it came up (the remover cancels us too)
            return
        replica.info = task.result()
        replica.state, replica.last_error = ReplicaState.HEALTHY, None
        replica.incarnation, replica.consecutive_failures = None, 0
        replica.progress, replica.progress_since = -1, time.monotonic()
        self.router.pools[replica.model].wake()
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
            replica.state = ReplicaState.FAILED
            config_line = engine_config_line(e)
            replica.last_error = config_line or f"{type(e).__name__}: {e}"
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
            self._recover(replica, "its process died" if err.kind is ErrorKind.ENGINE_DEAD else str(err), kill=False)

    def _recover(self, replica: Replica, reason: str, kill: bool) -> None:
        """Take a failed replica out of rotation, end every request on it with an error, and
        restart it in the background (it rejoins when started). ``kill``: it is stuck, not dead."""
        if replica.state not in (ReplicaState.HEALTHY, ReplicaState.UNHEALTHY) or self._stopping:
            return  # already being restarted, or never started
        logger.warning("replica %s: out of rotation, %s: %s", replica.id,
                       "waiting for its owner to restart it" if self.attached else "restarting", reason)
        replica.state, replica.last_error = ReplicaState.RESTARTING, reason
        replica.restarts += 1
        if not self.attached:  # counted once, by the process that restarts it
            self.metrics.restarts.labels(self.metrics.model_label(replica.model)).inc()
        replica.handle.fail_in_flight(TandemError(
            ErrorKind.ENGINE_DEAD, f"the replica serving this request failed ({reason}); it is being restarted"))
        pool = self.router.pools[replica.model]
        pool.fail_waiters_if_no_replica()
        self._bringing_up[replica.id] = self._spawn(self._restart(replica, kill))

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
                config_line = engine_config_line(e)
                if config_line:  # its configuration cannot work: trying again cannot help
                    replica.state, replica.last_error = ReplicaState.FAILED, config_line
                    logger.error("replica %s: restart failed: %s", replica.id, config_line)
                    return
                replica.state, replica.last_error = ReplicaState.RESTARTING, f"restart: {type(e).__name__}: {e}"
                logger.error("replica %s: %s; next try in %.0f s", replica.id, replica.last_error, backoff)
                kill = True
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, RESTART_BACKOFF_S[1])

    # -- health ---------------------------------------------------------------------------------

    async def _health_loop(self) -> None:
        interval = self.config.gateway.health_interval_s
        while not self._stopping:  # a flag too: 3.11's wait_for can swallow a cancellation
            await asyncio.sleep(interval)
            checks = [self._check(r) for r in self.router.all_replicas()
                      if r.state.live and r.state is not ReplicaState.DRAINING]
            await asyncio.gather(*checks)

    async def _stats_loop(self) -> None:
        """Poll every replica's engine stats for /metrics (works wherever the actors run)."""
        interval = min(self.config.gateway.health_interval_s, STATS_EVERY_S)
        while not self._stopping:
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
                self.metrics.set_scaling(name, views.replica_counts(pool))
            await asyncio.sleep(interval)

    async def _check(self, replica: Replica) -> None:
        """One health check. A timeout takes the replica out of rotation after ``unhealthy_after``
        in a row, and restarts it if it stays so for ``stall_timeout_s``; an engine that says it
        is broken is restarted after ``unhealthy_after``; a dead or restarted process, or one that
        holds requests without progress for ``stall_timeout_s``, is restarted at once."""
        gw = self.config.gateway
        now = time.monotonic()
        timeout = gw.health_timeout_s or gw.health_interval_s
        try:
            health = await asyncio.wait_for(replica.handle.health(), timeout=timeout)
        except Exception as e:  # noqa: BLE001 - any failure counts
            if isinstance(e, TandemError) and e.kind is ErrorKind.ENGINE_DEAD:
                return self._recover(replica, "its process died", kill=False)
            replica.consecutive_failures += 1
            timed_out = isinstance(e, TimeoutError)
            replica.last_error = "health check timed out" if timed_out else f"health check: {type(e).__name__}: {e}"
            if replica.consecutive_failures < gw.unhealthy_after:
                return
            if not timed_out:
                return self._recover(replica, f"its engine failed ({replica.last_error})", kill=True)
            if replica.state is ReplicaState.HEALTHY:
                replica.state = ReplicaState.UNHEALTHY
                replica.unhealthy_since = now
                logger.warning("replica %s: out of rotation (%s)", replica.id, replica.last_error)
            elif now - replica.unhealthy_since >= gw.stall_timeout_s:
                self._recover(replica, f"unresponsive for {now - replica.unhealthy_since:.0f} s", kill=True)
            return
        if not health.started or (replica.incarnation is not None and health.incarnation != replica.incarnation):
            return self._recover(replica, "its process was restarted", kill=False)
        replica.incarnation = health.incarnation
        if health.in_flight and health.progress == replica.progress:
            if now - replica.progress_since >= gw.stall_timeout_s:
                return self._recover(replica, f"no progress for {now - replica.progress_since:.0f} s with "
                                     f"{health.in_flight} request(s)", kill=True)
        else:
            replica.progress, replica.progress_since = health.progress, now
        if replica.state is ReplicaState.UNHEALTHY:
            logger.info("replica %s: healthy again", replica.id)
        replica.consecutive_failures = 0
        replica.last_error = None
        replica.state = ReplicaState.HEALTHY
        self.router.pools[replica.model].wake()

    # -- autoscaling ----------------------------------------------------------------------------

    async def _autoscale_loop(self, model: ModelConfig) -> None:
        scaler, pool = self.scalers[model.name], self.router.pools[model.name]
        while not self._stopping:
            await asyncio.sleep(model.autoscaling.interval_s)
            load = model_load(pool)
            if self.deployment.shares_replicas:  # the other gateway processes' queues (this host)
                load += max(0.0, self.metrics.queued_everywhere(model.name) - pool.queued)
            decision = scaler.observe(time.monotonic(), load)
            if decision is not None and not self._stopping:
                self.scale(model, decision)

    def _publish(self, model: str) -> None:
        """Owner: tell the attached gateway processes which replicas a model has now."""
        if self.attached or not self.deployment.shares_replicas:
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
        while not self._stopping:
            await asyncio.sleep(model.autoscaling.interval_s)
            table = await asyncio.to_thread(self._table, model)
            if table is not None and not self._stopping:
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
                self._add(model, rid, handle)
                logger.info("replica %s: added by the owner", rid)
            elif replica is not None and table[rid] == DRAINING and replica.state is not ReplicaState.DRAINING:
                self._stop_bringing_up(replica)
                replica.state, replica.last_error = ReplicaState.DRAINING, None
                logger.info("replica %s: draining (the owner removes it)", rid)
        for rid, replica in known.items():
            if rid not in table:
                self._spawn(self._let_go(replica))

    async def _let_go(self, replica: Replica) -> None:
        """Attached: the owner removed ``replica``; what this process still had there fails."""
        self._stop_bringing_up(replica)
        replica.state = ReplicaState.DRAINING
        if replica.outstanding:
            replica.handle.fail_in_flight(TandemError(
                ErrorKind.SHUTTING_DOWN, "the replica serving this request was removed (scaled down)"))
        try:
            await asyncio.wait_for(replica.handle.shutdown(), timeout=30)  # attached: this process's side only
        except Exception as e:  # noqa: BLE001 - gone anyway
            logger.debug("replica %s: %s", replica.id, e)
        self.router.pools[replica.model].remove(replica)
        logger.info("replica %s: removed by the owner", replica.id)

    def _stop_bringing_up(self, replica: Replica) -> None:
        up = self._bringing_up.pop(replica.id, None)
        if up is not None:
            up.cancel()

    def scale(self, model: ModelConfig, decision: Decision) -> None:
        """Add or drain replicas until ``decision.desired`` of them are serving or on their way."""
        pool = self.router.pools[model.name]
        counted = [r for r in pool.replicas if r.state is not ReplicaState.DRAINING]
        logger.info("model %s: scaling %s from %d to %d replica(s) (load %.1f: requests in flight and queued)",
                    model.name, decision.direction, len(counted), decision.desired, decision.load)
        self.metrics.scale_events.labels(model.name, decision.direction).inc()
        for _ in range(decision.desired - len(counted)):
            index = self._next_index[model.name]
            self._next_index[model.name] = index + 1
            rid, handle = self.deployment.create_replica(model, index)
            self._add(model, rid, handle)
            logger.info("replica %s: added", rid)
        for _ in range(len(counted) - decision.desired):
            victim = min((r for r in pool.replicas if r.state is not ReplicaState.DRAINING), key=_removal_order)
            self._spawn(self.drain_and_remove(victim))
        self._publish(model.name)
        self.metrics.set_scaling(model.name, views.replica_counts(pool))

    async def drain_and_remove(self, replica: Replica) -> None:
        """Take ``replica`` out of rotation at once, let its requests finish (up to
        ``gateway.drain_timeout_s``; then they fail), shut its engine down, release it and drop
        it from the pool. One that was still coming up is stopped where it is."""
        pool = self.router.pools[replica.model]
        engine_up = replica.state in (ReplicaState.HEALTHY, ReplicaState.UNHEALTHY)
        self._stop_bringing_up(replica)
        replica.state, replica.last_error = ReplicaState.DRAINING, None
        self._publish(replica.model)
        logger.info("replica %s: draining (%d request(s) in flight here, %d from other gateway processes)",
                    replica.id, replica.outstanding, replica.others_outstanding)
        if engine_up:
            now = time.monotonic()
            deadline = now + self.config.gateway.drain_timeout_s
            model = self.config.model(replica.model)
            shared = self.deployment.shares_replicas
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
                    f"drain timeout ({self.config.gateway.drain_timeout_s:g} s) ran out"))
            try:
                await asyncio.wait_for(replica.handle.shutdown(), timeout=30)
            except Exception as e:  # noqa: BLE001 - it is released anyway
                logger.warning("replica %s: shutdown: %s", replica.id, e)
        try:
            await asyncio.to_thread(self.deployment.remove_replica, replica.id)
        except Exception as e:  # noqa: BLE001 - gone from the pool anyway; close() releases the rest
            logger.warning("replica %s: release: %s", replica.id, e)
        pool.remove(replica)
        self._publish(replica.model)
        self.metrics.set_scaling(replica.model, views.replica_counts(pool))
        logger.info("replica %s: removed", replica.id)

    async def _in_flight_everywhere(self, replica: Replica) -> int:
        """The requests ``replica`` runs for every gateway process, as it counts them now (0 if it
        does not answer: nothing of it is left to wait for)."""
        try:
            return (await asyncio.wait_for(replica.handle.health(), timeout=self.config.gateway.health_interval_s
                                           + 5)).in_flight
        except Exception as e:  # noqa: BLE001 - dead or stuck: its requests are lost either way
            logger.warning("replica %s: in-flight count while draining: %s", replica.id, e)
            return 0

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


def others_outstanding(replica: Replica, per_channel: dict[str, int] | None) -> int:
    """The requests other gateway processes have on ``replica`` (from its per-channel counts)."""
    if not per_channel:
        return 0
    mine = getattr(replica.handle, "channel_id", None)
    return sum(n for cid, n in per_channel.items() if cid != mine)


def others_load(replica: Replica, per_channel: dict[str, int] | None) -> float:
    """The load the other gateway processes put on ``replica``, in ``Replica.load``'s units: the
    requests the replica holds for other channels than this process's, each weighed as this
    process's own requests on it weigh on average (1 request = 1 unit when it has none)."""
    if not per_channel:
        return 0.0
    mine = getattr(replica.handle, "channel_id", None)
    others = sum(n for cid, n in per_channel.items() if cid != mine)
    if not others:
        return 0.0
    per_request = replica.load / replica.outstanding if replica.outstanding else 1.0
    return others * per_request
