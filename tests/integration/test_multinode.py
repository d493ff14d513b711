"""Several Ray nodes on this machine (ray.cluster_utils.Cluster, fake GPUs): replicas spread
across nodes; a node removed mid-load loses no request silently and the model keeps serving.
Engines are fakes (the subject is placement and failure handling, not vLLM)."""

import asyncio
import concurrent.futures as cf
import json
import threading

import httpx
import pytest

from tests.integration.stack import ray_cluster
from tests.unit.gateway_server import fake_gateway, stream_outcome
from tests.waiting import wait_for


@pytest.fixture(scope="module")
def cluster():
    with ray_cluster({"num_cpus": 1, "num_gpus": 0}, [{"num_cpus": 1, "num_gpus": 1}] * 2) as c:
        yield c


def _short(url: str) -> str:
    r = httpx.post(url + "/v1/completions", json={"model": "fake", "prompt": "x", "max_tokens": 3}, timeout=30)
    return r.json()["choices"][0]["text"] if r.status_code == 200 else r.text


def _call(service, coro, timeout: float = 30):
    return asyncio.run_coroutine_threadsafe(coro, service.loop).result(timeout)


STREAMS = 8
TOKENS = 40


def test_replicas_spread_and_a_lost_node_loses_no_request(cluster, tmp_path):
    """Deterministic: the node goes only once every stream has its first token and the streams are
    known to sit on both replicas; the lost node's replica is held first (no tokens, health checks
    pass), so its streams cannot finish before Ray declares the node dead, and the gateway's stall
    timeout is far away, so only the node's loss can end them."""
    import ray

    from workers.deployment import RayDeployment

    c, nodes = cluster
    control = tmp_path / "control.json"
    control.write_text("{}")
    extra = {"gateway": {"stall_timeout_s": 600},
             "model_fields": {"resources": {"num_gpus": 1, "num_cpus": 1},
                              "engine_args": {"num_tokens": TOKENS, "token_delay_s": 0.05,
                                              "control_file": str(control)}}}
    with fake_gateway(replicas=2, extra=extra, deployment_factory=lambda cfg: RayDeployment(cfg, engine_key="fake")) \
            as (url, service, deployment):
        replicas = service.router.all_replicas()
        handles = [r.handle.actor for r in replicas]
        node_ids = ray.get([h.node_id.remote() for h in handles])
        assert len(set(node_ids)) == 2  # one per GPU node
        lost = next(r for r, n in zip(replicas, node_ids, strict=True) if n == nodes[0].node_id)
        survivor = next(r for r in replicas if r is not lost)
        lost_pid, survivor_pid = (_call(service, r.handle.describe())["pid"] for r in (lost, survivor))
        first = [threading.Event() for _ in range(STREAMS)]
        with cf.ThreadPoolExecutor(STREAMS) as ex:
            futures = [ex.submit(stream_outcome, url, TOKENS, timeout=300, first_token=e) for e in first]
            wait_for(lambda: all(e.is_set() for e in first), "every stream to receive its first token")
            # Hold both replicas (no tokens, no finishing; health checks pass) for a consistent count.
            control.write_text(json.dumps({str(lost_pid): "stall", str(survivor_pid): "stall"}))
            on_lost = _call(service, lost.handle.stats()).running
            on_survivor = _call(service, survivor.handle.stats()).running
            finished = STREAMS - on_lost - on_survivor  # before the hold (a slow box): whole answers
            wait_for(lambda: sum(f.done() for f in futures) == finished, "finished streams to reach their clients")
            # least-loaded routing over two replicas puts streams on both (p2c draws both)
            assert on_lost >= 1, (on_lost, on_survivor)
            control.write_text(json.dumps({str(lost_pid): "stall"}))  # the survivor goes on
            c.remove_node(nodes[0])
            results = [f.result(timeout=300) for f in futures]
        # the lost replica's held streams end with an error event then [DONE]; the others complete
        assert sorted(results) == sorted(["error"] * on_lost + ["ok"] * (STREAMS - on_lost)), results
        wait_for(lambda: len(service.router.pools["fake"].healthy()) == 1, "the dead replica to leave the rotation")
        assert [_short(url) for _ in range(3)] == ["tok0 tok1 tok2"] * 3  # the survivor serves
        # a new GPU node joins: Ray restarts the lost replica there and it rejoins the rotation
        c.add_node(num_cpus=1, num_gpus=1)
        wait_for(lambda: len(service.router.pools["fake"].healthy()) == 2,
                 "the lost replica to come back on the new node", timeout=180)
        node_ids = ray.get([h.node_id.remote() for h in handles])
        assert len(set(node_ids)) == 2 and nodes[0].node_id not in node_ids
