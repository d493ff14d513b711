import asyncio

import pytest

from gateway.errors import ErrorKind, TandemError
from gateway.replicas import Replica, ReplicaState
from gateway.router import ModelPool, Router


def _pool(*states):
    return ModelPool("m", "autoregressive", [Replica(id=f"m/{i}", model="m", handle=None, state=s)
                                               for i, s in enumerate(states)])


def test_least_outstanding_among_healthy():
    async def main():
        pool = _pool(ReplicaState.HEALTHY, ReplicaState.HEALTHY, ReplicaState.UNHEALTHY)
        a = await pool.acquire()
        b = await pool.acquire()
        assert {a.id, b.id} == {"m/0", "m/1"}  # spread, never the unhealthy one
        pool.release(a)
        assert await pool.acquire() is a
        assert all([(await pool.acquire()).id != "m/2" for _ in range(5)])

    asyncio.run(main())


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


def _full_pool(max_queue=2):
    return ModelPool("m", "autoregressive", [Replica(id="m/0", model="m", handle=None, state=ReplicaState.HEALTHY)],
                     max_in_flight=1, max_queue=max_queue)


def test_full_replicas_queue_fifo_then_429_with_retry_after():
    async def main():
        pool = _full_pool(max_queue=2)
        first = await pool.acquire()
        w1 = asyncio.create_task(pool.acquire())
        w2 = asyncio.create_task(pool.acquire())
        await asyncio.sleep(0)
        assert pool.queued == 2
        with pytest.raises(TandemError) as e:
            await pool.acquire()
        assert e.value.status == 429 and e.value.headers()["Retry-After"].isdigit()
        pool.release(first)
        r1 = await asyncio.wait_for(w1, 1)
        assert r1 is first and r1.outstanding == 1 and not w2.done()  # FIFO, one slot, no overcommit
        pool.release(r1)
        assert (await asyncio.wait_for(w2, 1)).outstanding == 1
    asyncio.run(main())


def test_a_request_past_its_queue_deadline_gets_408_and_leaves_the_queue():
    async def main():
        pool = _full_pool()
        await pool.acquire()
        with pytest.raises(TandemError) as e:
            await pool.acquire(deadline_s=0.05)
        assert e.value.status == 408 and pool.queued == 0
    asyncio.run(main())


def test_a_cancelled_waiter_gives_its_slot_on():
    async def main():
        pool = _full_pool()
        first = await pool.acquire()
        gone = asyncio.create_task(pool.acquire())
        kept = asyncio.create_task(pool.acquire())
        await asyncio.sleep(0)
        gone.cancel()
        await asyncio.sleep(0)
        pool.release(first)
        assert (await asyncio.wait_for(kept, 1)) is first and first.outstanding == 1
    asyncio.run(main())


def test_no_live_replica_is_503_even_with_a_queue():
    async def main():
        pool = _full_pool()
        pool.replicas[0].state = ReplicaState.UNHEALTHY
        with pytest.raises(TandemError) as e:
            await pool.acquire()
        assert e.value.status == 503
    asyncio.run(main())
