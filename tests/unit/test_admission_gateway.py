"""Admission through the gateway on fake engines (issue 33): a key's default priority, the slot
reserved for requests of priority <= 0 under a bulk flood, weighted shares between two flooding
tenants, min_priority raising a request, and priority reaching the engine."""

import concurrent.futures as cf
import threading

import httpx
import pytest

from tests.unit.gateway_server import fake_gateway
from tests.waiting import wait_for

INTERACTIVE, BULK, LIGHT, HEAVY = "sk-inter-012345678", "sk-bulk-0123456789", "sk-light-012345678", "sk-heavy-012345678"


def _post(url: str, key: str, **body) -> httpx.Response:
    """20 tokens at 50 ms: a second each, unless ``max_tokens`` says fewer."""
    return httpx.post(url + "/v1/completions", headers={"Authorization": f"Bearer {key}"},
                      json={"model": "fake", "prompt": "x", "max_tokens": 20, **body}, timeout=120)


@pytest.fixture()
def gw():
    extra = {"auth": {"api_keys": [
        {"key": INTERACTIVE, "name": "inter"},
        {"key": BULK, "name": "bulk", "priority": 10, "min_priority": 10},
        {"key": LIGHT, "name": "light", "weight": 1},
        {"key": HEAVY, "name": "heavy", "weight": 3}]},
        "model_fields": {"max_in_flight_per_replica": 2}}
    with fake_gateway({"num_tokens": 20, "token_delay_s": 0.05}, extra=extra) as g:
        yield g


def test_an_interactive_request_takes_the_reserved_slot_under_a_bulk_flood(gw):
    url, service, deployment = gw
    pool = service.router.pools["fake"]
    with cf.ThreadPoolExecutor(9) as ex:
        bulk = [ex.submit(_post, url, BULK) for _ in range(8)]
        # bulk may take one slot of two (priority_reserve 1): one runs, seven wait
        wait_for(lambda: pool.queued == 7, "seven bulk requests to queue behind the one running")
        assert sum(r.outstanding for r in pool.replicas) == 1
        r = _post(url, INTERACTIVE)
        done = sum(f.done() for f in bulk)
        assert r.status_code == 200
        assert done <= 2, f"{done} bulk requests (1 s each, one at a time) finished before the interactive one"
        assert all(f.result().status_code == 200 for f in bulk)
    (engine,) = deployment.engines.values()
    assert engine.priorities.count(10) == 8 and engine.priorities.count(0) == 1  # the engine received them


def test_min_priority_raises_a_request_never_refuses_it(gw):
    url, _, deployment = gw
    assert _post(url, BULK, priority=-5).status_code == 200  # asked for -5, raised to the key's 10
    (engine,) = deployment.engines.values()
    assert engine.priorities[-1] == 10
    bad = _post(url, INTERACTIVE, priority="high")
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "priority"


def test_two_flooding_tenants_share_by_weight(gw):
    """Weights 1 and 3, eight clients each, two slots: the shares are read after a warm-up (the
    first completions depend on which clients connected first) over a bounded number of requests."""
    url, _, _ = gw
    order: list[str] = []
    lock = threading.Lock()
    stop = threading.Event()
    start = threading.Barrier(16)
    warmup, total = 16, 96

    def flood(name: str, key: str) -> None:
        start.wait(timeout=60)
        while not stop.is_set():
            r = _post(url, key, max_tokens=4)  # 0.2 s each
            assert r.status_code == 200, r.text
            with lock:
                order.append(name)
                if len(order) >= total:
                    stop.set()

    with cf.ThreadPoolExecutor(16) as ex:
        futures = [ex.submit(flood, name, key) for name, key in (("light", LIGHT), ("heavy", HEAVY))
                   for _ in range(8)]
        for f in futures:
            f.result(timeout=600)
    steady = order[warmup:total]
    ratio = steady.count("heavy") / max(1, steady.count("light"))
    print(f"completed after warm-up: heavy {steady.count('heavy')}, light {steady.count('light')}, ratio {ratio:.2f}")
    assert 2.2 <= ratio <= 3.8, "".join(n[0] for n in order)
