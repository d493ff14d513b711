import pytest

from gateway.errors import ErrorKind, TandemError
from gateway.replicas import Replica, ReplicaState
from gateway.router import ModelPool, Router


def _pool(*states):
    return ModelPool("m", "autoregressive", [Replica(id=f"m/{i}", model="m", handle=None, state=s)
                                               for i, s in enumerate(states)])


def test_least_outstanding_among_healthy():
    pool = _pool(ReplicaState.HEALTHY, ReplicaState.HEALTHY, ReplicaState.UNHEALTHY)
    a = pool.acquire()
    b = pool.acquire()
    assert {a.id, b.id} == {"m/0", "m/1"}  # spread, never the unhealthy one
    pool.release(a)
    assert pool.acquire() is a
    assert all(r.id != "m/2" for r in (pool.acquire() for _ in range(5)))


def test_no_healthy_replica_is_503_and_says_why():
    with pytest.raises(TandemError) as e:
        _pool(ReplicaState.STARTING).pick()
    assert e.value.kind is ErrorKind.NO_REPLICA and e.value.status == 503 and "starting" in e.value.message
    with pytest.raises(TandemError, match="no healthy replica"):
        _pool(ReplicaState.UNHEALTHY, ReplicaState.FAILED).pick()


def test_unknown_and_missing_model():
    router = Router([_pool(ReplicaState.HEALTHY)])
    with pytest.raises(TandemError) as e:
        router.pool("other")
    assert e.value.status == 404 and e.value.param == "model" and "m" in e.value.message
    for bad in (None, 3, ""):
        with pytest.raises(TandemError) as e:
            router.pool(bad)
        assert e.value.status == 400 and e.value.param == "model"


def test_ready_needs_every_model():
    assert Router([_pool(ReplicaState.HEALTHY)]).ready()
    assert not Router([_pool(ReplicaState.HEALTHY), ModelPool("n", "diffusion", [])]).ready()
