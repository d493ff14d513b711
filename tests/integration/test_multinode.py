"""Several Ray nodes on this machine (ray.cluster_utils.Cluster, fake GPUs): replicas spread
across nodes; a node removed mid-load loses no request silently and the model keeps serving.
Engines are fakes (the subject is placement and failure handling, not vLLM)."""

import concurrent.futures as cf
import time

import httpx
import pytest

from tests.unit.gateway_server import fake_gateway, stream_outcome


@pytest.fixture(scope="module")
def cluster():
    import ray
    from ray.cluster_utils import Cluster

    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "num_gpus": 0})
    nodes = [c.add_node(num_cpus=1, num_gpus=1) for _ in range(2)]
    ray.init(address=c.address)
    c.wait_for_nodes()
    try:
        yield c, nodes
    finally:
        ray.shutdown()
        c.shutdown()


def _stream(url: str) -> str:
    return stream_outcome(url, 80, timeout=60)


def _short(url: str) -> str:
    r = httpx.post(url + "/v1/completions", json={"model": "fake", "prompt": "x", "max_tokens": 3}, timeout=30)
    return r.json()["choices"][0]["text"] if r.status_code == 200 else r.text


def test_replicas_spread_and_a_lost_node_loses_no_request(cluster):
    import ray

    from workers.deployment import RayDeployment

    c, nodes = cluster
    extra = {"model_fields": {"resources": {"num_gpus": 1, "num_cpus": 1},
                              "engine_args": {"num_tokens": 80, "token_delay_s": 0.1}}}
    with fake_gateway(replicas=2, extra=extra, deployment_factory=lambda cfg: RayDeployment(cfg, engine_key="fake")) \
            as (url, service, deployment):
        handles = [r.handle.actor for r in service.router.all_replicas()]
        node_ids = ray.get([h.node_id.remote() for h in handles])
        assert len(set(node_ids)) == 2  # one per GPU node
        with cf.ThreadPoolExecutor(8) as ex:
            futures = [ex.submit(_stream, url) for _ in range(8)]
            time.sleep(0.5)  # mid-stream (8 s streams: the node is declared dead within them)
            c.remove_node(nodes[0])
            results = [f.result(timeout=60) for f in futures]
        assert all(r in ("ok", "error") for r in results), results  # nothing lost, nothing malformed
        assert results.count("ok") >= 1 and results.count("error") >= 1
        deadline = time.monotonic() + 20
        while len(service.router.pools["fake"].healthy()) != 1:
            assert time.monotonic() < deadline, "the dead replica never left the rotation"
            time.sleep(0.1)
        assert [_short(url) for _ in range(3)] == ["tok0 tok1 tok2"] * 3  # the survivor serves
        # a new GPU node joins: Ray restarts the lost replica there and it rejoins the rotation
        c.add_node(num_cpus=1, num_gpus=1)
        deadline = time.monotonic() + 90
        while len(service.router.pools["fake"].healthy()) != 2:
            assert time.monotonic() < deadline, "the lost replica never came back on the new node"
            time.sleep(0.2)
        node_ids = ray.get([h.node_id.remote() for h in handles])
        assert len(set(node_ids)) == 2 and nodes[0].node_id not in node_ids
