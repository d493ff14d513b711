"""LoRA adapters through the real gateway on fake engines (``gateway/routing/adapters.py``): an adapter is
served by its base's replicas with the adapter applied, listed in /v1/models with its base as
parent, loaded and unloaded at run time on every replica (and again on a replica that restarts),
routed to the replicas that hold it, refused on a diffusion base; the config's checks."""

import httpx
import openai
import pytest
from pydantic import ValidationError

from tandem_core.config import TandemConfig
from tests.unit.gateway_server import fake_gateway
from tests.waiting import wait_for

LORA = {"model_fields": {"lora_modules": {"tiny-lora": "/adapters/tiny"}, "engine_args": {"max_loras": 1}}}


def _chat(url, model, **kw):
    c = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    return c.chat.completions.create(model=model, messages=[{"role": "user", "content": "x"}], max_tokens=2, **kw)


def test_a_configured_adapter_is_served_by_its_base_and_listed_with_its_parent():
    with fake_gateway({"num_tokens": 2}, replicas=2, extra=LORA) as (url, service, dep):
        assert _chat(url, "tiny-lora").choices[0].message.content == "tiny-lora:tok0 tiny-lora:tok1"
        assert _chat(url, "fake").choices[0].message.content == "tok0 tok1"
        models = {m["id"]: m for m in httpx.get(url + "/v1/models", timeout=10).json()["data"]}
        assert models["tiny-lora"]["parent"] == "fake" and models["tiny-lora"]["root"] == "/adapters/tiny"
        assert "parent" not in models["fake"]
        assert httpx.get(url + "/v1/models/tiny-lora", timeout=10).json()["parent"] == "fake"
        with pytest.raises(openai.NotFoundError, match="tiny-lora"):  # the valid aliases list it
            _chat(url, "nope")
        text = httpx.get(url + "/metrics", timeout=10).text
        assert 'tandem_requests_total{model="tiny-lora"' in text  # its own label, bounded by the config


def test_load_and_unload_reach_every_replica_and_a_restarted_one_gets_the_adapter_back():
    with fake_gateway({"num_tokens": 1}, replicas=2, extra=LORA) as (url, service, dep):
        r = httpx.post(url + "/v1/load_lora_adapter", json={"lora_name": "late", "lora_path": "/adapters/late"},
                       timeout=30)
        assert r.status_code == 200 and r.text == "Success: LoRA adapter 'late' added successfully."
        assert all(e.loras.get("late") == "/adapters/late" for e in dep.engines.values())
        assert _chat(url, "late").choices[0].message.content == "late:tok0"
        again = httpx.post(url + "/v1/load_lora_adapter", json={"lora_name": "late", "lora_path": "/x"}, timeout=30)
        assert again.status_code == 400 and "already been loaded" in again.json()["error"]["message"]
        # A restarted replica is a fresh engine: the gateway loads the adapter onto it before it serves.
        replica = service.router.all_replicas()[0]
        service.loop.call_soon_threadsafe(service.supervisor.recover, replica, "test", False)
        wait_for(lambda: replica.restarts == 1 and replica.state.value == "healthy", "the replica restarted")
        assert dep.engines[replica.id].loras.get("late") == "/adapters/late"
        r = httpx.post(url + "/v1/unload_lora_adapter", json={"lora_name": "late"}, timeout=30)
        assert r.status_code == 200 and r.text == "Success: LoRA adapter 'late' removed successfully."
        assert not any("late" in e.loras for e in dep.engines.values())
        with pytest.raises(openai.NotFoundError):
            _chat(url, "late")
        gone = httpx.post(url + "/v1/unload_lora_adapter", json={"lora_name": "late"}, timeout=30)
        assert gone.status_code == 404 and "cannot be found" in gone.json()["error"]["message"]
        bad = httpx.post(url + "/v1/load_lora_adapter", json={"lora_name": "x"}, timeout=30)
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "lora_name"
        clash = httpx.post(url + "/v1/load_lora_adapter", json={"lora_name": "fake", "lora_path": "/p"}, timeout=30)
        assert clash.status_code == 400 and "conflicts with a served base model" in clash.json()["error"]["message"]


def test_a_failed_load_leaves_no_replica_holding_the_adapter():
    with fake_gateway({"num_tokens": 1}, replicas=2, extra=LORA) as (url, service, dep):
        first = next(iter(dep.engines.values()))
        first.lora_enabled = False  # this replica refuses: the other one must not keep it either
        r = httpx.post(url + "/v1/load_lora_adapter", json={"lora_name": "half", "lora_path": "/p"}, timeout=30)
        assert r.status_code == 400 and "LoRA support" in r.json()["error"]["message"]
        assert not any("half" in e.loras for e in dep.engines.values())
        assert "half" not in {m["id"] for m in httpx.get(url + "/v1/models", timeout=10).json()["data"]}


def test_requests_for_an_adapter_stay_on_the_replicas_holding_it():
    with fake_gateway({"num_tokens": 1}, replicas=2, extra=LORA) as (url, service, dep):
        for _ in range(6):
            _chat(url, "tiny-lora")
        served = {rid: e.lora_requests.get("tiny-lora", 0) for rid, e in dep.engines.items()}
        assert sorted(served.values()) == [0, 6], served  # sequential: the first one's replica keeps it
        pool = service.router.pools["fake"]
        assert pool.adapters.loads == 1


def test_a_diffusion_base_takes_no_adapter():
    with pytest.raises(ValidationError, match="a diffusion model takes no LoRA adapters"):
        TandemConfig.model_validate({"models": [{"name": "d", "kind": "diffusion", "source": "x",
                                                 "lora_modules": {"l": "/p"}}]})
    with pytest.raises(ValidationError, match="name no model nor another adapter"):
        TandemConfig.model_validate({"models": [
            {"name": "a", "kind": "autoregressive", "source": "x", "lora_modules": {"b": "/p"}},
            {"name": "b", "kind": "autoregressive", "source": "x"}]})
    extra = {"model_fields": {"engine_args": {}}}
    with fake_gateway({"num_tokens": 1}, models=("fake", "other"), extra=extra) as (url, service, dep):
        r = httpx.post(url + "/v1/load_lora_adapter", json={"lora_name": "l", "lora_path": "/p"}, timeout=30)
        assert r.status_code == 400 and "none takes adapters" in r.json()["error"]["message"]
        r = httpx.post(url + "/v1/load_lora_adapter", json={"lora_name": "l", "lora_path": "/p", "model": "fake"},
                       timeout=30)
        assert r.status_code == 400 and "takes no LoRA adapters" in r.json()["error"]["message"]


def test_loading_onto_a_diffusion_model_is_a_400_that_says_why():
    import asyncio

    from gateway.routing.adapters import Adapters
    from tandem_core.errors import TandemError

    config = TandemConfig.model_validate({"models": [
        {"name": "dllm", "kind": "diffusion", "source": "x"},
        {"name": "llm", "kind": "autoregressive", "source": "x", "engine_args": {"enable_lora": True}}]})
    with pytest.raises(TandemError) as e:
        asyncio.run(Adapters(config).load(None, {"lora_name": "l", "lora_path": "/p", "model": "dllm"}))
    assert e.value.status == 400 and e.value.param == "model" and "diffusion model" in e.value.message


def test_the_built_in_adapter_is_a_peft_lora_vllm_accepts_for_tiny_llama(tmp_path):
    """``tiny-llama-lora``: PEFT's files, every linear layer of tiny-llama at rank 8, checked by
    vLLM's own reader against a LoRA config like the one `--max-lora-rank 8` gives."""
    from safetensors.torch import load_file
    from vllm.config.lora import LoRAConfig
    from vllm.lora.peft_helper import PEFTHelper

    from workers import tiny_models

    path = tiny_models.build(tiny_models.TINY_LLAMA_LORA, tmp_path)
    helper = PEFTHelper.from_local_dir(str(path), max_position_embeddings=1024)
    helper.validate_legal(LoRAConfig(max_lora_rank=8, max_loras=2))
    assert helper.r == 8 and set(helper.target_modules) == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                             "up_proj", "down_proj"}
    weights = load_file(str(path / "adapter_model.safetensors"))
    assert len(weights) == 2 * 7 * 2 and weights["base_model.model.model.layers.1.mlp.down_proj.lora_B.weight"].shape \
        == (128, 8)
    again = tiny_models.build(tiny_models.TINY_LLAMA_LORA, tmp_path / "again")
    assert (again / "adapter_model.safetensors").read_bytes() == (path / "adapter_model.safetensors").read_bytes()
