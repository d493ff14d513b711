import asyncio
import random
from collections import Counter

import pytest

from gateway.intake import take_in
from gateway.replicas import Replica, ReplicaState
from gateway.router import ModelPool, Router, request_cost
from tandem_core.errors import ErrorKind, TandemError
from tandem_core.protocol import EngineInfo


def _pool(*states, kind="autoregressive", **kw):
    return ModelPool("m", kind, [Replica(id=f"m/{i}", model="m", handle=None, state=s) for i, s in enumerate(states)],
                     rng=random.Random(0), **kw)


def run(coro):
    return asyncio.run(coro)


def test_never_an_unhealthy_replica_and_slots_are_counted():
    async def main():
        pool = _pool(ReplicaState.HEALTHY, ReplicaState.HEALTHY, ReplicaState.UNHEALTHY)
        slots = [await pool.acquire(cost=10) for _ in range(6)]
        assert all(s.replica.id != "m/2" for s in slots)
        assert sum(r.outstanding for r in pool.replicas) == 6 and sum(r.load for r in pool.replicas) == 60
        for s in slots:
            pool.release(s)
        assert all(r.outstanding == 0 and r.load == 0 for r in pool.replicas)
    run(main())


def test_power_of_two_choices_balances_by_tokens_in_flight():
    async def main():
        pool = _pool(*[ReplicaState.HEALTHY] * 4)
        for _ in range(400):
            await pool.acquire(cost=100)
        loads = [r.load for r in pool.replicas]
        assert max(loads) - min(loads) <= 200, loads  # P2C keeps the spread within a couple of requests
    run(main())


def test_heavy_requests_weigh_more_than_light_ones():
    async def main():
        pool = _pool(ReplicaState.HEALTHY, ReplicaState.HEALTHY)
        heavy = await pool.acquire(cost=1000)
        light = [await pool.acquire(cost=10) for _ in range(5)]
        # outstanding counts alone would have split 3/3; tokens in flight put every light one elsewhere
        assert all(s.replica is not heavy.replica for s in light)
    run(main())


def test_diffusion_goes_to_the_replica_with_the_most_free_batch_rows():
    async def main():
        pool = _pool(ReplicaState.HEALTHY, ReplicaState.HEALTHY, kind="diffusion")
        small, big = pool.replicas
        small.info = EngineInfo("m", "diffusion", extra={"max_batch": 2})
        big.info = EngineInfo("m", "diffusion", extra={"max_batch": 8})
        picks = Counter([(await pool.acquire(cost=1)).replica.id for _ in range(10)])
        # free rows: the big one keeps more free rows until it is down to the small one's
        assert picks == {"m/1": 8, "m/0": 2}, picks
    run(main())


def test_request_cost():
    def cost(kind, body):
        return request_cost(kind, take_in(body, "chat"))

    assert cost("diffusion", {"n": 3, "max_tokens": 999}) == 3
    assert cost("autoregressive", {"prompt": "x" * 400, "max_tokens": 50}) == 150
    assert cost("autoregressive", {"messages": [{"role": "user", "content": "y" * 40}], "n": 2,
                                    "max_completion_tokens": 5}) == 20
    assert cost("autoregressive", {"messages": [{"content": [{"type": "text", "text": "z" * 8}]}]}) == 258
    for junk in ({"messages": 5, "n": "x", "max_tokens": -3}, {"prompt": [[[[[[["deep"]]]]]]]}, {}):
        assert cost("autoregressive", junk) > 0  # never raises on garbage
    assert request_cost("autoregressive", take_in({"prompt": "x" * 40}, "tokenize")) == 10  # no output


def test_session_affinity_sticks_and_spills_over_under_load():
    async def main():
        pool = _pool(*[ReplicaState.HEALTHY] * 3, affinity_load_factor=1.25)
        homes = {}
        for user in ("alice", "bob", "carol", "dave"):
            s = await pool.acquire(cost=1, key=user)
            homes[user] = s.replica
            pool.release(s)
        for user, home in homes.items():  # light load: always the same replica
            for _ in range(5):
                s = await pool.acquire(cost=1, key=user)
                assert s.replica is home
                pool.release(s)
        assert len(set(homes.values())) >= 2  # keys spread over replicas
        # one hot session: it keeps its replica until that is over 1.25x the average, then spills
        hot = [await pool.acquire(cost=1, key="alice") for _ in range(30)]
        counts = Counter(s.replica.id for s in hot)
        assert counts[homes["alice"].id] == max(counts.values()) and len(counts) == 3
        assert max(counts.values()) <= 1.25 * 30 / 3 + 1
    run(main())


def test_without_affinity_the_key_is_ignored():
    async def main():
        pool = _pool(ReplicaState.HEALTHY, ReplicaState.HEALTHY)
        picks = {(await pool.acquire(key="alice")).replica.id for _ in range(10)}
        assert picks == {"m/0", "m/1"}
    run(main())


def test_a_retry_avoids_the_replica_that_failed():
    async def main():
        pool = _pool(ReplicaState.HEALTHY, ReplicaState.HEALTHY)
        for _ in range(10):
            s = await pool.acquire(exclude=["m/0"])
            assert s.replica.id == "m/1"
            pool.release(s)
    run(main())


def test_no_healthy_replica_is_503_and_says_why():
    async def main():
        for states, why in (((ReplicaState.STARTING,), "starting"), ((ReplicaState.RESTARTING,), "restarting"),
                            ((ReplicaState.FAILED, ReplicaState.PENDING), "no healthy replica")):
            with pytest.raises(TandemError) as e:
                await _pool(*states).acquire()
            assert e.value.kind is ErrorKind.NO_REPLICA and e.value.status == 503 and why in e.value.message
    run(main())


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
    return _pool(ReplicaState.HEALTHY, max_in_flight=1, max_queue=max_queue)


def test_full_replicas_queue_fifo_then_429_with_retry_after():
    async def main():
        pool = _full_pool(max_queue=2)
        first = await pool.acquire()
        w1 = asyncio.create_task(pool.acquire())
        w2 = asyncio.create_task(pool.acquire())
        await asyncio.sleep(0)  # one loop turn: the new tasks run to their first await (no I/O: deterministic)
        assert pool.queued == 2
        with pytest.raises(TandemError) as e:
            await pool.acquire()
        assert e.value.status == 429 and e.value.headers()["Retry-After"].isdigit()
        pool.release(first)
        r1 = await asyncio.wait_for(w1, 1)
        assert r1.replica is first.replica and r1.replica.outstanding == 1 and not w2.done()  # FIFO, no overcommit
        pool.release(r1)
        assert (await asyncio.wait_for(w2, 1)).replica.outstanding == 1
    run(main())


def test_a_request_past_its_queue_deadline_gets_408_and_leaves_the_queue():
    async def main():
        pool = _full_pool()
        await pool.acquire()
        with pytest.raises(TandemError) as e:
            await pool.acquire(deadline_s=0.05)
        assert e.value.status == 408 and pool.queued == 0
    run(main())


def test_a_cancelled_waiter_gives_its_slot_on():
    async def main():
        pool = _full_pool()
        first = await pool.acquire()
        gone = asyncio.create_task(pool.acquire())
        kept = asyncio.create_task(pool.acquire())
        await asyncio.sleep(0)  # one loop turn: the new tasks run to their first await (no I/O: deterministic)
        gone.cancel()
        await asyncio.sleep(0)  # one loop turn: the new tasks run to their first await (no I/O: deterministic)
        pool.release(first)
        s = await asyncio.wait_for(kept, 1)
        assert s.replica is first.replica and s.replica.outstanding == 1
    run(main())


def test_no_live_replica_is_503_even_with_a_queue():
    async def main():
        pool = _full_pool()
        pool.replicas[0].state = ReplicaState.UNHEALTHY
        with pytest.raises(TandemError) as e:
            await pool.acquire()
        assert e.value.status == 503
    run(main())


def test_queued_requests_get_503_when_the_last_replica_fails():
    async def main():
        pool = _full_pool()
        await pool.acquire()
        waiter = asyncio.create_task(pool.acquire())
        await asyncio.sleep(0)  # one loop turn: the new tasks run to their first await (no I/O: deterministic)
        pool.replicas[0].state = ReplicaState.RESTARTING
        pool.fail_waiters_if_no_replica()
        with pytest.raises(TandemError) as e:
            await asyncio.wait_for(waiter, 1)
        assert e.value.status == 503 and "restarting" in e.value.message and pool.queued == 0
    run(main())
