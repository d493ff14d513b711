"""Route a request by ``model`` to one of that model's replicas.

For now: least outstanding requests among healthy replicas (ties: the first listed).
"""

from __future__ import annotations

from gateway.errors import ErrorKind, TandemError
from gateway.replicas import Replica, ReplicaState


class ModelPool:
    def __init__(self, name: str, kind: str, replicas: list[Replica] | None = None):
        self.name = name
        self.kind = kind
        self.replicas: list[Replica] = list(replicas or [])

    def healthy(self) -> list[Replica]:
        return [r for r in self.replicas if r.state is ReplicaState.HEALTHY]

    def pick(self) -> Replica:
        live = self.healthy()
        if not live:
            starting = any(r.state is ReplicaState.STARTING for r in self.replicas)
            why = "is still starting" if starting else "has no healthy replica"
            raise TandemError(ErrorKind.NO_REPLICA, f"model {self.name!r} {why}; try again shortly")
        return min(live, key=lambda r: r.outstanding)

    def acquire(self) -> Replica:
        """Pick a replica and count one more outstanding request on it; pair with release."""
        replica = self.pick()
        replica.outstanding += 1
        return replica

    @staticmethod
    def release(replica: Replica) -> None:
        replica.outstanding -= 1


class Router:
    def __init__(self, pools: list[ModelPool]):
        self.pools = {p.name: p for p in pools}

    def pool(self, model: object) -> ModelPool:
        if not isinstance(model, str) or not model:
            raise TandemError(ErrorKind.INVALID_REQUEST, "model: a model name (string) is required", "model")
        pool = self.pools.get(model)
        if pool is None:
            raise TandemError(
                ErrorKind.MODEL_NOT_FOUND,
                f"The model {model!r} does not exist; available: {', '.join(sorted(self.pools))}",
                "model",
            )
        return pool

    def ready(self) -> bool:
        return all(p.healthy() for p in self.pools.values())

    def all_replicas(self) -> list[Replica]:
        return [r for p in self.pools.values() for r in p.replicas]
