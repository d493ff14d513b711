import asyncio
import random
from collections import Counter

import pytest

from gateway.request.intake import take_in
from gateway.routing.replicas import Replica, ReplicaState
from gateway.routing.router import ModelPool, Router, request_cost
from tandem_core.errors import ErrorKind, TandemError
from tandem_core.protocol import EngineInfo


def _pool(*states, kind="autoregressive", **kw):
    return ModelPool("m", kind, [Replica(id=f"m/{i}", model="m", handle=None, initial=s) for i, s in enumerate(states)],
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
        pool.replicas[0].move_to(ReplicaState.UNHEALTHY, "health check timed out")
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
        pool.replicas[0].move_to(ReplicaState.RESTARTING, "its process died")  # Effect.FAIL_WAITERS
        assert pool.queued == 0  # failed at once, not at a deadline (it has none)
        with pytest.raises(TandemError) as e:
            await asyncio.wait_for(waiter, 1)
        assert e.value.status == 503 and "restarting" in e.value.message and pool.queued == 0
    run(main())


def test_queued_requests_get_503_when_the_last_healthy_replica_turns_unhealthy():
    """The state machine's decision: a queued request is failed as a new one would be (503), not
    left to wait out its deadline, when the last healthy replica leaves the rotation; with another
    healthy replica left it keeps waiting."""
    async def main():
        pool = _full_pool()
        await pool.acquire()
        waiter = asyncio.create_task(pool.acquire(deadline_s=60))
        await asyncio.sleep(0)  # one loop turn: the new tasks run to their first await (no I/O: deterministic)
        pool.replicas[0].move_to(ReplicaState.UNHEALTHY, "health check timed out")
        assert pool.queued == 0  # failed at once, not at its 60 s deadline
        with pytest.raises(TandemError) as e:
            await asyncio.wait_for(waiter, 1)
        assert e.value.status == 503 and "restarting" in e.value.message and pool.queued == 0

        two = ModelPool("m", "autoregressive", [Replica(id=f"m/{i}", model="m", handle=None,
                                                        initial=ReplicaState.HEALTHY) for i in range(2)],
                        max_in_flight=1)
        held = {s.replica.id: s for s in (await two.acquire(), await two.acquire())}
        waiter = asyncio.create_task(two.acquire(deadline_s=60))
        await asyncio.sleep(0)
        two.replicas[0].move_to(ReplicaState.UNHEALTHY, "health check timed out")
        assert two.queued == 1  # another healthy replica is left: it waits on
        two.replicas[0].move_to(ReplicaState.HEALTHY)  # back, with its slot still taken
        assert two.queued == 1
        two.release(held["m/1"])  # a slot frees: the waiter gets it
        assert (await asyncio.wait_for(waiter, 1)).replica is two.replicas[1]
    run(main())


# ---------------------------------------------------------------- routing: prefix
def _tenant(t: int, question: str = "What are your opening hours?") -> tuple[int, ...]:
    system = f"Tenant {t}: you are the support assistant of organisation {t}. " * 30  # ~1,800 characters
    body = {"model": "m", "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}]}
    return _pool(ReplicaState.HEALTHY, routing="prefix").prefix_blocks(take_in(body, "chat"))


def _prefix_pool(n=2, **kw):
    return _pool(*[ReplicaState.HEALTHY] * n, routing="prefix", **kw)


def test_prefix_blocks_only_under_prefix_routing():
    body = take_in({"messages": [{"role": "user", "content": "x" * 2000}]}, "chat")
    assert len(_pool(ReplicaState.HEALTHY, routing="prefix").prefix_blocks(body)) == 7
    assert _pool(ReplicaState.HEALTHY).prefix_blocks(body) == ()  # p2c: nothing computed
    assert _pool(ReplicaState.HEALTHY, kind="diffusion", routing="prefix").routing == "prefix"  # (its cache)
    with pytest.raises(ValueError, match="routing"):
        _pool(ReplicaState.HEALTHY, routing="random")


def test_a_shared_prefix_goes_to_the_replica_that_has_it():
    async def main():
        pool = _prefix_pool(4)
        first = await pool.acquire(cost=500, prefix=_tenant(1))
        pool.release(first)
        for q in ("Where is my parcel?", "How do I reset my password?", "Do you ship abroad?"):
            slot = await pool.acquire(cost=500, prefix=_tenant(1, q))  # same system prompt, other question
            assert slot.replica is first.replica
            pool.release(slot)
        assert pool.prefix_index(first.replica).match(_tenant(1)) == len(_tenant(1))
    run(main())


def test_the_load_bound_sends_a_hot_prefix_elsewhere():
    async def main():
        pool = _prefix_pool(2)
        hot = _tenant(1)
        body = take_in({"messages": [{"role": "user", "content": "y" * 1800}], "max_tokens": 256}, "chat")
        cost = request_cost("autoregressive", body)  # 450 prompt tokens + 256 output
        slots = []
        for _ in range(40):  # all in flight at once
            bound = 1.25 * (sum(r.load for r in pool.replicas) + cost) / 2  # 1.25 x average, counting this one
            slots.append(await pool.acquire(cost=cost, prefix=hot))
            assert slots[-1].replica.load - slots[-1].cost <= bound
        home = slots[0].replica
        # a request whose prefix is cached weighs its uncached tokens and output, not its prompt
        assert slots[0].cost == cost and slots[1].replica is home and cost - 7 * 64 <= slots[1].cost < cost
        assert any(s.replica is not home for s in slots[:4])  # the output still counts: it spills early
        loads = [r.load for r in pool.replicas]
        assert max(loads) <= 1.25 * sum(loads) / 2 + cost, loads  # the bound holds at the end too
        # both now hold the prefix; one at a time, it goes to one of them (its rendezvous first),
        # not alternately to both (which would keep it in two caches)
        for s in slots:
            pool.release(s)
        assert all(r.load == 0 for r in pool.replicas)
        sequential = set()
        for _ in range(10):
            slot = await pool.acquire(cost=cost, prefix=hot)
            sequential.add(slot.replica.id)
            pool.release(slot)
        assert len(sequential) == 1
        # other gateway processes' load counts too: the same request now goes to the other replica
        preferred = next(r for r in pool.replicas if r.id in sequential)
        other = next(r for r in pool.replicas if r is not preferred)
        preferred.others_load = 10_000
        assert (await pool.acquire(cost=cost, prefix=hot)).replica is other
    run(main())


def test_different_prefixes_spread_and_each_sticks():
    async def main():
        pool = _prefix_pool(2)
        homes = {}
        for t in range(16):  # first request of each tenant, all in flight: p2c spreads them
            homes[t] = (await pool.acquire(cost=100, prefix=_tenant(t))).replica
        assert sorted(Counter(r.id for r in homes.values()).values()) == [8, 8]
        for r in pool.replicas:  # finish them all
            r.outstanding, r.load = 0, 0.0
        for rnd in range(3):
            for t in range(16):
                slot = await pool.acquire(cost=100, prefix=_tenant(t, f"question {rnd}"))
                assert slot.replica is homes[t]
                pool.release(slot)
    run(main())


def test_no_match_routes_like_p2c():
    async def main():
        prefix, p2c = _prefix_pool(4), _pool(*[ReplicaState.HEALTHY] * 4)
        for i in range(50):  # the same rng draws: the same choices while nothing matches
            a = await prefix.acquire(cost=10 + i % 7, prefix=_tenant(100 + i))
            b = await p2c.acquire(cost=10 + i % 7)
            assert a.replica.id == b.replica.id
        c = await prefix.acquire(cost=10, prefix=())  # no full block (a short prompt): p2c too
        assert c.replica.id == (await p2c.acquire(cost=10)).replica.id
    run(main())


def test_a_restarted_replica_starts_with_an_empty_index():
    """The index is keyed by the replica's engine generation: a restart (``Effect.RESTART``) drops
    it, and the new engine starts with an empty one."""
    async def main():
        pool = _prefix_pool(2)
        slot = await pool.acquire(cost=10, prefix=_tenant(1))
        pool.release(slot)
        r = slot.replica
        assert pool.prefix_index(r).match(_tenant(1)) > 0
        r.move_to(ReplicaState.UNHEALTHY, "health check timed out")  # the same engine, out of rotation: kept
        assert pool.prefix_index(r).match(_tenant(1)) > 0
        r.move_to(ReplicaState.RESTARTING, "unresponsive")  # its engine and cache are gone
        assert (r.generation, r.restarts) == (1, 1) and pool.prefix_index(r) is None
        r.move_to(ReplicaState.HEALTHY)
        assert pool.prefix_index(r) is None
        other = next(x for x in pool.replicas if x is not r)
        pool.release(await pool.acquire(cost=10, prefix=_tenant(1)))  # routed where no replica holds it
        assert sum(1 for x in pool.replicas if pool.prefix_index(x) and pool.prefix_index(x).match(_tenant(1))) == 1
        pool.release(await pool.acquire(cost=10, prefix=_tenant(3)))
        home = next(x for x in (r, other) if pool.prefix_index(x) and pool.prefix_index(x).match(_tenant(3)))
        home.move_to(ReplicaState.DRAINING)  # removed: its index goes at once
        assert pool.prefix_index(home) is None
    run(main())


def test_the_index_is_bounded_by_the_engines_kv_capacity():
    async def main():
        pool = _prefix_pool(1)
        (r,) = pool.replicas
        r.info = EngineInfo("m", "autoregressive", extra={"kv_cache_tokens": 64 * 50})  # 50 blocks of ~64 tokens
        for t in range(40):
            pool.release(await pool.acquire(cost=10, prefix=_tenant(t)))
            assert len(pool.prefix_index(r)) <= 50
        assert pool.prefix_index(r).max_blocks == 50
        assert pool.prefix_index(r).match(_tenant(39)) == len(_tenant(39))  # the latest is kept
        assert pool.prefix_index(r).match(_tenant(0)) == 0  # the oldest forgotten
        fixed = _prefix_pool(1, prefix_index_blocks=7)
        fixed.release(await fixed.acquire(cost=10, prefix=_tenant(0)))
        assert len(fixed.prefix_index(fixed.replicas[0])) == 7
    run(main())


def test_prefix_and_affinity_together_the_prefix_wins_the_key_breaks_no_match():
    async def main():
        pool = _prefix_pool(4, affinity_load_factor=1.25)
        keyed = _pool(*[ReplicaState.HEALTHY] * 4, affinity_load_factor=1.25)
        # no match: the session key decides (as affinity alone would), not p2c
        for t in range(8):
            a = await pool.acquire(cost=10, key=f"s{t}", prefix=_tenant(t))
            b = await keyed.acquire(cost=10, key=f"s{t}")
            assert a.replica.id == b.replica.id
            pool.release(a)
            keyed.release(b)
        # a match beats the key: tenant 0's prompt is cached where session s0 went, another
        # session with that prompt follows the prompt, not its own key
        home = next(r for r in pool.replicas if pool.prefix_index(r) and pool.prefix_index(r).match(_tenant(0)))
        for i in range(100):  # a session whose own replica is another one
            moved = f"x{i}"
            if (await keyed.acquire(cost=0, key=moved)).replica.id != home.id:
                break
        assert (await pool.acquire(cost=10, key=moved, prefix=_tenant(0, "another question"))).replica is home
    run(main())


def test_a_queued_request_keeps_its_prefix():
    async def main():
        pool = _prefix_pool(2, max_in_flight=1)
        pool.release(await pool.acquire(cost=10, prefix=_tenant(1)))
        home = pool.replicas[[pool.prefix_index(r) is not None and pool.prefix_index(r).match(_tenant(1)) > 0
                              for r in pool.replicas].index(True)]
        busy = [await pool.acquire(cost=10, prefix=_tenant(t)) for t in (7, 8)]  # both replicas full
        waiter = asyncio.ensure_future(pool.acquire(cost=10, prefix=_tenant(1, "later")))
        await wait_queued(pool, 1)
        pool.max_in_flight = 2  # room on both at once: the waiter's prefix decides
        pool.wake()
        assert (await waiter).replica is home
        for s in busy:
            pool.release(s)
    run(main())


async def wait_queued(pool, n):
    while pool.queued < n:
        await asyncio.sleep(0)
