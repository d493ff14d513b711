"""Create replicas as Ray actors, one per replica, each holding its declared resources."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

from tandem_core.config import BUILTIN_PREFIX, ModelConfig, TandemConfig
from tandem_core.protocol import Role
from workers.transport.handles import CHANNEL_LEASE_MIN_S, AttachedReplicaHandle, RayReplicaHandle

logger = logging.getLogger(__name__)


def resolve_source(model: ModelConfig, models_dir: Path) -> str:
    """A built-in name becomes its built directory (built now if missing); others pass as-is."""
    if not model.is_builtin():
        return model.source
    from workers import tiny_models

    return str(tiny_models.build(model.builtin_name(), models_dir))


def resolve_path(source: str, models_dir: Path) -> str:
    """``builtin:<name>`` becomes its built directory (built now if missing); others pass as-is."""
    if not source.startswith(BUILTIN_PREFIX):
        return source
    from workers import tiny_models

    return str(tiny_models.build(source[len(BUILTIN_PREFIX):], models_dir))


def with_resolved_adapters(model: ModelConfig, models_dir: Path) -> ModelConfig:
    """``model`` with its LoRA adapters' built-in paths resolved (what its replicas load)."""
    if not model.lora_modules:
        return model
    return model.model_copy(update={"lora_modules": {n: resolve_path(p, models_dir)
                                                     for n, p in model.lora_modules.items()}})


def local_ray_cpus(config: TandemConfig) -> int:
    """CPUs of a local Ray: enough for every replica (a placement group's bundles included)."""
    needed = sum(_most_replicas(m) * (sum(b.get("CPU", 0) for b in group_bundles(m)) if m.devices_per_replica > 1
                                      else m.resources.num_cpus) for m in config.models)
    return max(int(needed + 0.999), os.cpu_count() or 1)


def _most_replicas(model: ModelConfig) -> int:
    return model.autoscaling.max_replicas if model.autoscaling is not None else model.replicas


def _table_key(model: str) -> str:
    return f"tandem-replicas:{model}"


def actor_name(replica_id: str) -> str:
    """The Ray name (namespace ``tandem``) of a shared replica's actor."""
    return f"tandem-replica:{replica_id}"


class RayDeployment:
    """``role``: ``solo`` (the default: one gateway process; unnamed actors, as always), ``owner``
    (creates the replicas as named actors that other gateway processes attach to, and is the one
    process that restarts them), ``attached`` (finds the owner's named actors and never creates,
    restarts or kills one)."""

    def __init__(self, config: TandemConfig, engine_key: str | None = None, role: Role | str = Role.SOLO):
        import ray

        self.config = config
        self.engine_key = engine_key  # tests: force an engine (e.g. "fake")
        self.role = Role(role)
        self._actors: dict[str, object] = {}  # replica id -> its actor handle
        self._published: set[str] = set()  # models whose replica table this owner wrote
        self._groups: dict[str, object] = {}  # replica id -> its placement group (TP x PP > 1)
        if not ray.is_initialized():
            if config.ray.address:
                logger.info("joining the Ray cluster at %s", config.ray.address)
                ray.init(address=config.ray.address, namespace="tandem")
            else:
                cpus = config.ray.num_cpus or local_ray_cpus(config)
                logger.info("starting a local Ray (%d CPUs)", cpus)
                # Ray starts its workers at nice 15 (ours: the replica actors, so vLLM's EngineCore
                # and worker too); under load their output stalled behind the gateway's process
                # (the p99 gap between engine outputs: docs/benchmarks.md). The raylet
                # reads this when it starts; on a cluster, set it for `ray start` (deploy/).
                os.environ.setdefault("RAY_worker_niceness", "0")
                # address="local": always a Ray of its own, never one another program started on this host
                # (joining one fails: "num_cpus must not be provided"); ray.address joins a cluster.
                _start_local_ray(cpus)

    def gcs_address(self) -> str:
        """The Ray cluster's address, for the gateway processes that attach to it."""
        import ray

        return ray.get_runtime_context().gcs_address

    def create_replicas(self, model: ModelConfig) -> list[tuple[str, RayReplicaHandle]]:
        """One actor per replica of ``model``: (replica id, its handle) each. Attached: the
        owner's actors, found by name (waiting for the owner to create them)."""
        return [self.create_replica(model, i) for i in range(model.replicas)]

    def create_replica(self, model: ModelConfig, index: int) -> tuple[str, RayReplicaHandle]:
        """One more actor of ``model`` (autoscaling): replica ``<model>/<index>``. Attached: the
        owner's actor of that id, found by name (once the owner's replica table lists it)."""
        if self.role is Role.ATTACHED:
            gw = self.config.gateway
            rid = f"{model.name}/{index}"
            lease = max(CHANNEL_LEASE_MIN_S, 10 * gw.health_interval_s)
            return rid, AttachedReplicaHandle(actor_name(rid), lease, channel=gw.channel)
        return self._create(model, index)

    # -- the replica table: how attached gateway processes follow an autoscaled model ----------
    # The owner writes {replica id: "serving" | "draining"} of each autoscaled model to Ray's
    # key-value store (the GCS: every node of the cluster reads it) whenever the set changes;
    # attached processes poll it. No public Ray API offers a cluster-wide value without Ray's
    # dashboard or an actor of its own; ``ray.experimental.internal_kv`` is what Ray's own
    # libraries use for this.

    def publish_replicas(self, model: str, table: dict[str, str]) -> None:
        """Owner: the replicas of ``model`` as they are now (blocking, a GCS write)."""
        if self.role is not Role.OWNER:
            return
        from ray.experimental.internal_kv import _internal_kv_put

        _internal_kv_put(_table_key(model), json.dumps(table), overwrite=True, namespace="tandem")
        self._published.add(model)

    def replica_table(self, model: str) -> dict[str, str] | None:
        """The owner's latest table of ``model``; None before it wrote one (blocking)."""
        from ray.experimental.internal_kv import _internal_kv_get

        raw = _internal_kv_get(_table_key(model), namespace="tandem")
        return json.loads(raw) if raw else None

    def _create(self, model: ModelConfig, index: int) -> tuple[str, RayReplicaHandle]:
        import ray

        from tandem_core.tracing import replica_settings
        from workers.actor import EngineActor

        source = resolve_source(model, self.config.models_dir)
        model = with_resolved_adapters(model, self.config.models_dir)
        rid = f"{model.name}/{index}"
        # SPREAD: replicas of a model go to different nodes when the cluster has room.
        # max_restarts: Ray brings a dead actor back (the gateway starts its engine again);
        # no task retries: a request on a dead replica fails, the gateway decides on a retry.
        options = {"num_cpus": model.resources.num_cpus, "num_gpus": model.resources.num_gpus,
                   "scheduling_strategy": "SPREAD", "max_restarts": model.max_restarts, "max_task_retries": 0}
        if model.resources.custom:
            options["resources"] = dict(model.resources.custom)
        if model.devices_per_replica > 1:
            options.update(self._group_for(model, rid))
        if model.env:
            options["runtime_env"] = {"env_vars": dict(model.env)}
        if self.role is Role.OWNER:  # other gateway processes find it by name
            options["name"] = actor_name(rid)
        actor = ray.remote(EngineActor).options(**options).remote(
            model.model_dump(mode="json"), source, rid, self.engine_key,
            trace_settings=replica_settings(self.config.observability))
        self._actors[rid] = actor
        return rid, RayReplicaHandle(actor, channel=self.config.gateway.channel)

    # -- replicas larger than one device: a placement group per replica ------------------------
    # As Ray Serve LLM places vLLM: the replica's actor runs in bundle 0 of a group of TP x PP
    # bundles (one per engine worker) and captures it, so vLLM, built inside the actor, finds the
    # group (``ray.util.get_current_placement_group``), picks its Ray executor and puts one worker
    # on each bundle. TP's workers share one node (STRICT_PACK: their all-reduce needs NVLink or
    # PCIe, not the network); PP alone packs where it can (PACK). The group is the replica's:
    # Ray restarts its actor inside it; removing the replica removes it.

    def _group_for(self, model: ModelConfig, rid: str) -> dict:
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        strategy = group_strategy(model)
        pg = placement_group(group_bundles(model), strategy=strategy, name=f"tandem-group:{rid}")
        self._groups[rid] = pg
        logger.info("replica %s: a placement group of %d bundles (%s, %s) for tensor_parallel_size x "
                    "pipeline_parallel_size = %d", rid, model.devices_per_replica, strategy,
                    group_bundles(model)[-1], model.devices_per_replica)
        # The actor takes bundle 0's CPU (and custom resources); the engine's workers its GPUs.
        return {"num_gpus": 0, "scheduling_strategy": PlacementGroupSchedulingStrategy(
            pg, placement_group_bundle_index=0, placement_group_capture_child_tasks=True)}

    def placement_of(self, replica_id: str) -> dict | None:
        """A replica's placement group as /admin/replicas shows it (None: a one-device replica)."""
        pg = self._groups.get(replica_id)
        if pg is None:
            return None
        from ray.util import placement_group_table

        try:
            table = placement_group_table(pg)
        except Exception as e:  # noqa: BLE001 - a view only
            return {"error": f"{type(e).__name__}: {e}"}
        return {"id": pg.id.hex(), "strategy": table.get("strategy"), "state": table.get("state"),
                "bundles": list(table.get("bundles", {}).values()),
                "nodes": sorted(set(table.get("bundles_to_node_id", {}).values()))}

    def _remove_group(self, replica_id: str) -> None:
        pg = self._groups.pop(replica_id, None)
        if pg is not None and self.role.owns:
            from ray.util import remove_placement_group

            try:
                remove_placement_group(pg)
            except Exception as e:  # noqa: BLE001 - already gone with the cluster
                logger.debug("placement group of %s: %s", replica_id, e)

    def remove_replica(self, replica_id: str) -> None:
        """Kill one replica's actor for good (autoscaling down; its engine is shut down), and
        release its placement group."""
        import ray

        actor = self._actors.pop(replica_id, None)
        if actor is not None and self.role.owns:
            ray.kill(actor, no_restart=True)
        self._remove_group(replica_id)

    @property
    def fixed_nodes(self) -> bool:
        """No node can join: a local Ray (a cluster joined by address may grow: its autoscaler or
        an operator adds nodes, so there a replica waits)."""
        return not self.config.ray.address

    def placement_problem(self, model: ModelConfig, replica_id: str | None = None) -> str | None:
        """Why a replica of ``model`` cannot be placed: no live node offers its resources at all
        (e.g. ``num_gpus: 1`` on a cluster without GPU nodes; with TP > 1, the whole group on one
        node), or (``replica_id``: that replica, when Ray has not placed its actor yet) none has
        them free now, every one being taken. None if some node could hold it, or the replica is
        placed (then it is loading)."""
        import ray

        need: dict[str, float] = {"CPU": 0, "GPU": 0}
        for bundle in (group_bundles(model) if group_strategy(model) == "STRICT_PACK" else
                       [model.resources.ray_needs()]):
            for k, v in bundle.items():
                need[k] = need.get(k, 0) + v
        need = {k: v for k, v in need.items() if v}
        nodes = [n for n in ray.nodes() if n.get("Alive")]
        if any(all(n["Resources"].get(k, 0) >= v for k, v in need.items()) for n in nodes):
            if replica_id is None or self._actor_state(replica_id) != "PENDING_CREATION":
                return None
            free = ray.available_resources()
            wants = ", ".join(f"{k} {v:g}" for k, v in need.items())
            return (f"waiting for a node with {wants} free (free in the whole cluster now: "
                    + ", ".join(f"{k} {free.get(k, 0):g}" for k in need)
                    + "); it starts when one is added (the Ray autoscaler adds nodes where it is enabled) or freed")
        offers = "; ".join(
            f"{n.get('NodeManagerAddress', '?')}: " + ", ".join(f"{k} {n['Resources'].get(k, 0):g}" for k in need)
            for n in nodes) or "no live node"
        wants = ", ".join(f"{k} {v:g}" for k, v in need.items())
        return f"needs {wants} on one node; no node of the Ray cluster has that ({offers}); add such a node"

    def _actor_state(self, replica_id: str) -> str | None:
        """Ray's state of a replica's actor (``PENDING_CREATION``, ``ALIVE``...), None if unknown."""
        actor = self._actors.get(replica_id)
        if actor is None:
            return None
        try:  # no public API without Ray's dashboard (ray.util.state needs it): the GCS's actor table
            from ray._private import state

            return state.actors(actor._actor_id.hex()).get("State")
        except Exception as e:  # noqa: BLE001 - a diagnosis only
            logger.debug("actor state of %s: %s", replica_id, e)
            return None

    def close(self) -> None:
        import ray

        if self.role is Role.ATTACHED:  # the owner's actors: never killed here
            return
        if self._published:
            from ray.experimental.internal_kv import _internal_kv_del

            for model in self._published:
                try:
                    _internal_kv_del(_table_key(model), namespace="tandem")
                except Exception:  # noqa: BLE001 - Ray already gone
                    pass
            self._published.clear()
        for actor in self._actors.values():
            try:
                ray.kill(actor)
            except Exception:  # noqa: BLE001 - already gone
                pass
        self._actors.clear()
        for rid in list(self._groups):
            self._remove_group(rid)


def group_strategy(model: ModelConfig) -> str:
    """STRICT_PACK with tensor parallelism (one node), PACK for pipeline stages alone."""
    return "STRICT_PACK" if int(model.engine_args.get("tensor_parallel_size", 1)) > 1 else "PACK"


def group_bundles(model: ModelConfig) -> list[dict[str, float]]:
    """One bundle per engine worker: ``num_gpus`` GPUs each (on a host without GPUs, ``num_cpus``
    CPUs each); the first also holds the replica actor's CPUs and custom resources."""
    r = model.resources
    worker = {"GPU": r.num_gpus} if r.num_gpus else {"CPU": r.num_cpus or 1}
    first = {**worker, **({"CPU": worker.get("CPU", 0) + r.num_cpus} if r.num_cpus else {}), **r.custom}
    return [first] + [dict(worker) for _ in range(model.devices_per_replica - 1)]


def _start_local_ray(cpus: int) -> None:
    """A local Ray, tried twice: Ray waits a fixed 30 s for its raylet to register with the GCS,
    which a loaded 2-core host can miss (seen once in CI, right after another stack's teardown)."""
    import ray

    for attempt in (1, 2):
        try:
            ray.init(address="local", num_cpus=cpus, include_dashboard=False, namespace="tandem")
            return
        except Exception as e:  # Ray raises a bare Exception for this
            if attempt == 2 or "timed out during startup" not in str(e):
                raise
            logger.warning("the local Ray did not start (%s); starting it once more", e)
            ray.shutdown()
