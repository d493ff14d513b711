"""What the gateway shows of its replicas: /v1/models cards, /ready, /admin/replicas."""

from __future__ import annotations

import asyncio
import logging

from gateway.routing.replicas import Replica, ReplicaState
from gateway.routing.router import ModelPool, Router

logger = logging.getLogger(__name__)

_COMING_UP = frozenset({ReplicaState.STARTING, ReplicaState.PENDING})


def replica_counts(pool: ModelPool) -> dict[str, int]:
    """A model's replicas by what they mean to its capacity: ``desired`` (those asked for: every
    replica but the draining ones; the autoscaler acts on each decision at once, so this is its
    count), ``running`` (serving), ``pending`` (created and not serving yet: starting, or waiting
    for a node), ``draining`` (being removed)."""
    states = [r.state for r in pool.replicas]
    return {"desired": sum(s is not ReplicaState.DRAINING for s in states),
            "running": sum(s is ReplicaState.HEALTHY for s in states),
            "pending": sum(s in _COMING_UP for s in states),
            "draining": sum(s is ReplicaState.DRAINING for s in states)}


def scaling(router: Router) -> dict[str, dict[str, int]]:
    """``replica_counts`` of every model (/admin/replicas)."""
    return {name: replica_counts(pool) for name, pool in router.pools.items()}


def model_card(router: Router, name: str) -> dict:
    """``name``: a model's name or alias (a card of its own, as vLLM lists each served name), or
    a LoRA adapter's."""
    if name not in router.pools and router.adapters is not None and router.adapters.base_of(name):
        return router.adapters.card(name)
    pool = router.pools[router.aliases.get(name, name)]
    info = next((r.info for r in pool.replicas if r.info is not None), None)
    return {
        "id": name,
        "object": "model",
        "created": 0,
        "owned_by": "tandem",
        "kind": pool.kind.value,
        "max_model_len": info.max_model_len if info else None,
        "replicas": {"total": len(pool.replicas), "healthy": len(pool.healthy()), **replica_counts(pool)},
    }


async def replica_stats(router: Router, placement_of=None) -> list[dict]:
    """Each replica as the router sees it, with its engine's own stats and description;
    ``placement_of(replica id)``: its placement group, where it holds one (TP x PP > 1)."""

    async def one(r: Replica) -> dict:
        row = {"id": r.id, "model": r.model, "state": r.state.value, "outstanding": r.outstanding,
               "load": r.load, "others_load": r.others_load, "restarts": r.restarts, "error": r.last_error}
        group = await asyncio.to_thread(placement_of, r.id) if placement_of is not None else None
        if group is not None:
            row["placement_group"] = group
        if r.state.live:
            try:
                s = await asyncio.wait_for(r.handle.stats(), timeout=5)
                row["engine"] = {"running": s.running, "waiting": s.waiting,
                                 **{k: v for k, v in s.extra.items() if k != "exposition"}}  # (that: /metrics)
                row.update(await asyncio.wait_for(r.handle.describe(), timeout=5))
            except Exception as e:  # noqa: BLE001 - reported, not raised
                row["engine_error"] = f"{type(e).__name__}: {e}"
        return row

    return list(await asyncio.gather(*(one(r) for r in router.all_replicas())))


async def reset_prefix_cache(router: Router, model: str | None) -> dict:
    """vLLM's ``/reset_prefix_cache`` over every live replica of ``model`` (all models if None):
    success only if each one dropped every cached page (False while running requests hold some,
    or a replica did not answer: retry)."""
    pools = [router.pool(model)] if model else list(router.pools.values())
    live = [r for pool in pools for r in pool.replicas if r.state.live]

    async def one(r: Replica) -> bool:
        try:
            return bool(await asyncio.wait_for(r.handle.reset_prefix_cache(), timeout=30))
        except Exception as e:  # noqa: BLE001 - reported as a failed reset
            logger.warning("replica %s: prefix cache reset failed: %s: %s", r.id, type(e).__name__, e)
            return False

    done = await asyncio.gather(*(one(r) for r in live))
    return {"success": all(done), "replicas": len(live)}


def readiness(router: Router, names: list[str] | None = None) -> dict:
    """/ready's body. ``ready``: with ``names`` (models or aliases, each checked by the caller),
    each of them has a healthy replica; without, some model has one (the gateway serves: a model
    without a replica answers its own requests 503, and never takes the others out of service).
    ``all_ready``: every model has one."""
    models = {}
    for name, pool in router.pools.items():
        models[name] = {
            "ready": bool(pool.healthy()),
            "replicas": [{"id": r.id, "state": r.state.value, "error": r.last_error} for r in pool.replicas],
        }
    ready = (all(models[router.aliases.get(n, n)]["ready"] for n in names) if names
             else any(m["ready"] for m in models.values()))
    return {"ready": ready, "all_ready": all(m["ready"] for m in models.values()), "models": models}
