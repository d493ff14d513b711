"""Admission shared by gateway processes (``gateway/admission/shared.py``): two ``ModelPool``s
stand for two processes (each its own ``Replica`` objects for the same replica, as each
process has), sharing one store file. Slots are counted across them, priority and weighted
shares hold across them, and a replacement process starts with a clean row."""

from __future__ import annotations

import asyncio
import random

from gateway.admission.shared import SharedShares, create_shared_admission, create_store, tenants_of
from gateway.admission.shared_limits import SharedStore
from gateway.request.envelope import Claim
from gateway.routing.replicas import Replica, ReplicaState
from gateway.routing.router import ModelPool
from tandem_core.config import TandemConfig

TENANTS = ["anonymous", "light", "heavy"]


def _pools(tmp_path, max_in_flight: int = 2, reserve: int = 0) -> list[ModelPool]:
    path = _path(tmp_path)
    create_store(path, 1, 2, len(TENANTS))
    pools = []  # each "process" maps the file itself
    for me in range(2):
        pool = ModelPool("m", "autoregressive", [Replica(id="m/0", model="m", handle=None,
                                                         initial=ReplicaState.HEALTHY)],
                         max_in_flight=max_in_flight, reserve=reserve, rng=random.Random(me))
        shares = SharedShares(SharedStore(path), 0, me, 2, TENANTS)
        shares.clear_mine()
        pool.share(shares)
        pools.append(pool)
    return pools


def test_one_process_without_a_store_and_the_tenants_in_config_order(tmp_path):
    config = TandemConfig.model_validate({
        "gateway": {"processes": 1},
        "auth": {"api_keys": [{"key": "sk-a-0123456789abcdef", "name": "a", "tenant": "team"},
                              {"key": "sk-b-0123456789abcdef", "name": "b", "tenant": "team"},
                              {"key": "sk-c-0123456789abcdef", "name": "c"}]},
        "models": [{"name": "fake", "kind": "autoregressive", "source": "none"}]})
    assert create_shared_admission(config, str(tmp_path)) is None
    assert tenants_of(config) == ["anonymous", "team", "c"]


def test_slots_are_counted_across_processes(tmp_path):
    async def main():
        a, b = _pools(tmp_path, max_in_flight=2)
        s1 = await a.acquire()
        s2 = await b.acquire()
        waiting = asyncio.create_task(a.acquire())  # two held in all: the third waits
        await asyncio.sleep(0.1)
        assert not waiting.done() and a.queued == 1
        b.release(s2)  # freed by the other process: seen by a's poll
        s3 = await asyncio.wait_for(waiting, 5)
        assert a.shares.held() == 2
        for pool, slot in ((a, s1), (a, s3)):
            pool.release(slot)
        assert a.shares.held() == 0
    asyncio.run(main())


def test_a_more_urgent_waiter_in_another_process_goes_first(tmp_path):
    async def main():
        a, b = _pools(tmp_path, max_in_flight=1)
        held = await a.acquire()
        bulk = asyncio.create_task(a.acquire(claim=Claim(5)))
        await asyncio.sleep(0.05)
        urgent = asyncio.create_task(b.acquire(claim=Claim(0)))
        await asyncio.sleep(0.05)
        a.release(held)  # a's own waiter is less urgent than b's: b's takes the slot
        slot = await asyncio.wait_for(urgent, 5)
        await asyncio.sleep(0.1)
        assert not bulk.done()
        b.release(slot)
        a.release(await asyncio.wait_for(bulk, 5))
    asyncio.run(main())


def test_weighted_shares_hold_when_each_tenant_lands_on_its_own_process(tmp_path):
    """Tenant light (weight 1) only on process a, heavy (weight 3) only on b, both backlogged, two
    slots: each process alone would give its tenant its own slots (1:1); shared, 3:1."""
    async def main():
        a, b = _pools(tmp_path, max_in_flight=2)
        done = {"light": 0, "heavy": 0}
        stop = asyncio.Event()

        async def client(pool: ModelPool, tenant: str, weight: float):
            while not stop.is_set():
                slot = await pool.acquire(claim=Claim(0, tenant, weight))
                await asyncio.sleep(0.02)  # the request runs
                pool.release(slot)
                done[tenant] += 1
                if sum(done.values()) >= 200:
                    stop.set()

        tasks = [asyncio.create_task(client(a, "light", 1.0)) for _ in range(6)]
        tasks += [asyncio.create_task(client(b, "heavy", 3.0)) for _ in range(6)]
        await asyncio.wait_for(stop.wait(), 60)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        ratio = done["heavy"] / done["light"]
        assert 2.2 <= ratio <= 3.8, done
    asyncio.run(main())


def test_a_tenant_alone_takes_every_slot_of_both_processes(tmp_path):
    """Work conserving across processes: a lone tenant on process a holds every slot of the model
    (the other process sees them held); a request on b then waits for one of them, and gets it."""
    async def main():
        a, b = _pools(tmp_path, max_in_flight=3)
        slots = [await a.acquire(claim=Claim(0, "light", 1.0)) for _ in range(3)]
        assert a.shares.held() == 3 == b.shares.held()
        waiting = asyncio.create_task(b.acquire(claim=Claim(0, "heavy", 3.0)))
        await asyncio.wait({waiting}, timeout=0.2)  # b's polls see no free slot
        assert not waiting.done() and b.queued == 1
        a.release(slots.pop())
        b.release(await asyncio.wait_for(waiting, 5))
        for s in slots:
            a.release(s)
        assert a.shares.held() == 0
    asyncio.run(main())


def test_a_replacement_process_clears_its_row(tmp_path):
    async def main():
        a, b = _pools(tmp_path, max_in_flight=2)
        await a.acquire()
        await a.acquire()  # then process a dies holding two
        assert b.shares.held() == 2
        SharedShares(SharedStore(_path(tmp_path)), 0, 0, 2, TENANTS).clear_mine()  # its replacement
        assert b.shares.held() == 0
        b.release(await asyncio.wait_for(b.acquire(), 5))
    asyncio.run(main())


def _path(tmp_path) -> str:
    return str(tmp_path / "admission")
