"""Create replicas as Ray actors, one per replica, each holding its declared resources."""

from __future__ import annotations

import logging
import os
from pathlib import Path

from tandem_core.config import ModelConfig, TandemConfig
from workers.transport.handles import RayReplicaHandle

logger = logging.getLogger(__name__)


def resolve_source(model: ModelConfig, models_dir: Path) -> str:
    """A built-in name becomes its built directory (built now if missing); others pass as-is."""
    if not model.is_builtin():
        return model.source
    from workers import tiny_models

    return str(tiny_models.build(model.builtin_name(), models_dir))


def local_ray_cpus(config: TandemConfig) -> int:
    needed = sum(m.replicas * m.resources.num_cpus for m in config.models)
    return max(int(needed + 0.999), os.cpu_count() or 1)


class RayDeployment:
    def __init__(self, config: TandemConfig, engine_key: str | None = None):
        import ray

        self.config = config
        self.engine_key = engine_key  # tests: force an engine (e.g. "fake")
        self._actors: list = []
        if not ray.is_initialized():
            if config.ray.address:
                logger.info("joining the Ray cluster at %s", config.ray.address)
                ray.init(address=config.ray.address, namespace="tandem")
            else:
                cpus = config.ray.num_cpus or local_ray_cpus(config)
                logger.info("starting a local Ray (%d CPUs)", cpus)
                ray.init(num_cpus=cpus, include_dashboard=False, namespace="tandem")

    def create_replicas(self, model: ModelConfig) -> list[tuple[str, RayReplicaHandle]]:
        """One actor per replica of ``model``: (replica id, its handle) each."""
        import ray

        from workers.actor import EngineActor

        source = resolve_source(model, self.config.models_dir)
        remote_cls = ray.remote(EngineActor)
        replicas = []
        for i in range(model.replicas):
            rid = f"{model.name}/{i}"
            # SPREAD: replicas of a model go to different nodes when the cluster has room.
            # max_restarts: Ray brings a dead actor back (the gateway starts its engine again);
            # no task retries: a request on a dead replica fails, the gateway decides on a retry.
            options = {"num_cpus": model.resources.num_cpus, "num_gpus": model.resources.num_gpus,
                       "scheduling_strategy": "SPREAD", "max_restarts": model.max_restarts, "max_task_retries": 0}
            if model.env:
                options["runtime_env"] = {"env_vars": dict(model.env)}
            actor = remote_cls.options(**options).remote(model.model_dump(mode="json"), source, rid, self.engine_key)
            self._actors.append(actor)
            replicas.append((rid, RayReplicaHandle(actor)))
        return replicas

    def placement_problem(self, model: ModelConfig) -> str | None:
        """Why a replica of ``model`` cannot be placed: no live node offers its resources at all
        (e.g. ``num_gpus: 1`` on a cluster without GPU nodes). None if some node could hold it."""
        import ray

        need = {k: v for k, v in (("CPU", model.resources.num_cpus), ("GPU", model.resources.num_gpus)) if v}
        nodes = [n for n in ray.nodes() if n.get("Alive")]
        if any(all(n["Resources"].get(k, 0) >= v for k, v in need.items()) for n in nodes):
            return None
        offers = "; ".join(
            f"{n.get('NodeManagerAddress', '?')}: " + ", ".join(f"{k} {n['Resources'].get(k, 0):g}" for k in need)
            for n in nodes) or "no live node"
        wants = ", ".join(f"{k} {v:g}" for k, v in need.items())
        return f"needs {wants} on one node; no node of the Ray cluster has that ({offers}); add such a node"

    def close(self) -> None:
        import ray

        for actor in self._actors:
            try:
                ray.kill(actor)
            except Exception:  # noqa: BLE001 - already gone
                pass
        self._actors.clear()
