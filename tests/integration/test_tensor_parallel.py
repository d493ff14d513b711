"""vLLM itself with tensor_parallel_size 2 on this CPU (issue 32): tiny-llama split over two
engine workers (vLLM's `mp` executor: its CPU platform has no Ray one; each rank bound to a core)
in a replica holding a placement group of two CPU bundles, answering greedily as the shared
stack's TP=1 replica does."""

import httpx
import pytest

from tests.integration.stack import ENGINE_ARGS, REPO, running_stack
from tests.unit.gateway_server import free_port

PROMPTS = ["Hello world", "The weather today is", "Once upon a time"]


@pytest.fixture(scope="module")
def tp_stack(tmp_path_factory):
    config = {"gateway": {"host": "127.0.0.1", "port": free_port(), "health_interval_s": 2},
              "models_dir": str(REPO / "models"),
              "models": [{"name": "tiny-llama", "kind": "autoregressive", "source": "builtin:tiny-llama",
                          "resources": {"num_gpus": 0, "num_cpus": 1},
                          # vLLM binds a rank per NUMA node by default; this box has one: a core each
                          "env": {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "0|1"},
                          "engine_args": {**ENGINE_ARGS, "tensor_parallel_size": 2}}]}
    with running_stack(config, tmp_path_factory.mktemp("tp2")) as s:
        yield s


def _greedy(url: str, prompt: str) -> str:
    r = httpx.post(url + "/v1/completions", timeout=120, json={
        "model": "tiny-llama", "prompt": prompt, "max_tokens": 16, "temperature": 0})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def test_a_tp2_replica_answers_as_tp1_does(tp_stack, stack):
    row = httpx.get(tp_stack.url + "/admin/replicas", timeout=30).json()["replicas"][0]
    group = row["placement_group"]
    assert (group["state"], len(group["bundles"])) == ("CREATED", 2), group
    assert "tensor_parallel_size 2 x pipeline_parallel_size 1 (mp executor)" in tp_stack.log.read_text()
    assert [_greedy(tp_stack.url, p) for p in PROMPTS] == [_greedy(stack.url, p) for p in PROMPTS]
