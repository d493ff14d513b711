"""Replicas larger than one device (issue 32): a replica with tensor_parallel_size x
pipeline_parallel_size > 1 holds a Ray placement group of that many bundles, runs its actor in
it (so vLLM, built inside, finds the group and puts a worker on each bundle), is restarted
inside it, and gives it back when removed. On a Ray cluster of this machine with fake GPUs
(ray.cluster_utils); engines are fakes: the subject is placement and lifecycle. Whether vLLM's
CPU backend itself runs TP is the README's and the closing note's."""

import asyncio

import httpx
import pytest

from tests.integration.stack import ray_cluster
from tests.unit.gateway_server import fake_gateway
from tests.waiting import wait_for


@pytest.fixture(scope="module")
def cluster():
    with ray_cluster({"num_cpus": 1, "num_gpus": 0}, [{"num_cpus": 2, "num_gpus": 2},
                                                      {"num_cpus": 1, "num_gpus": 2}]) as c:
        yield c


def _call(service, coro, timeout: float = 30):
    return asyncio.run_coroutine_threadsafe(coro, service.loop).result(timeout)


def _free_gpus() -> float:
    import ray

    return ray.available_resources().get("GPU", 0)


def _tp(tp: int) -> dict:
    return {"model_fields": {"resources": {"num_gpus": 1, "num_cpus": 1},
                             "engine_args": {"tensor_parallel_size": tp, "num_tokens": 3}}}


def test_a_tp2_replica_holds_a_group_of_two_gpus_on_one_node_and_is_restarted_inside_it(cluster):
    import ray

    from workers.deployment import RayDeployment

    _, nodes = cluster
    wait_for(lambda: _free_gpus() == 4, "the cluster's 4 fake GPUs to be free")
    with fake_gateway(extra=_tp(2), deployment_factory=lambda cfg: RayDeployment(cfg, engine_key="fake")) \
            as (url, service, deployment):
        (replica,) = service.router.all_replicas()
        row = httpx.get(url + "/admin/replicas", timeout=30).json()["replicas"][0]
        group = row["placement_group"]
        assert (group["strategy"], group["state"], len(group["bundles"])) == ("STRICT_PACK", "CREATED", 2)
        assert all(b.get("GPU") == 1 for b in group["bundles"]) and group["bundles"][0].get("CPU") == 1
        assert len(group["nodes"]) == 1  # TP's workers share a node
        assert _free_gpus() == 2  # the group holds two; the replica's actor takes none of its own
        where = _call(service, replica.handle.describe())
        assert where["placement_group_id"] == group["id"] and where["node_id"] == group["nodes"][0]
        r = httpx.post(url + "/v1/completions", json={"model": "fake", "prompt": "x", "max_tokens": 3}, timeout=30)
        assert r.status_code == 200, r.text

        # Killed: Ray restarts the actor in the same group; the gateway serves it again as one replica.
        pid = where["pid"]
        ray.kill(replica.handle.actor, no_restart=False)
        wait_for(lambda: replica.restarts >= 1 and replica.state.value == "healthy",
                 "the killed replica to be restarted and back in rotation", timeout=120)
        again = _call(service, replica.handle.describe())
        assert again["pid"] != pid
        assert again["placement_group_id"] == group["id"]
        assert _free_gpus() == 2
        r = httpx.post(url + "/v1/completions", json={"model": "fake", "prompt": "x", "max_tokens": 3}, timeout=30)
        assert r.status_code == 200, r.text

        # Removed (as autoscaling removes one): its group is given back.
        deployment.remove_replica(replica.id)
        wait_for(lambda: _free_gpus() == 4, "the removed replica's group to free its GPUs")


def test_a_group_no_node_can_hold_fails_the_start_in_one_line(cluster):
    """TP=4: the cluster has four GPUs, but no node holds four (STRICT_PACK). Where no node can
    join (no ray.address: nobody adds one), that is a start that cannot work."""
    from workers.deployment import RayDeployment

    wait_for(lambda: _free_gpus() == 4, "the cluster's 4 fake GPUs to be free")
    with fake_gateway(extra=_tp(4), deployment_factory=lambda cfg: RayDeployment(cfg, engine_key="fake"),
                      wait_ready=False) as (url, service, _):
        wait_for(lambda: service.fatal is not None, "the start to be refused")
        assert "\n" not in service.fatal and "GPU 4 on one node" in service.fatal, service.fatal
        assert service.router.all_replicas() == []  # nothing was created
