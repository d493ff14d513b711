"""LoRA adapters on tiny-llama through the real stack (vLLM in a Ray actor, `lora_modules` in the
config), against `vllm serve --enable-lora --lora-modules` on the same files: the adapter's greedy
answers differ from the base's and equal vLLM's; /v1/models lists it as vLLM does; an adapter
loaded and unloaded at run time while requests run, none of them failing; one loaded at run time
is loaded again on a replica whose process was killed and restarted."""

import os
import signal
import sys
import threading

import httpx
import openai
import pytest

from tandem_tools.bench.servers import Server
from tandem_tools.bench.setups import _vllm_flags
from tests.integration.stack import ENGINE_ARGS, REPO, running_stack
from tests.unit.gateway_server import free_port
from tests.waiting import wait_for
from workers import tiny_models

MODEL, ADAPTER, LATE = "tiny-llama", "tiny-lora", "late-lora"
PROMPTS = ["The river bends twice", "def add(a, b):", "Hello! How are you today?"]
LORA_ARGS = {**ENGINE_ARGS, "max_loras": 2, "max_lora_rank": 8}


def _answers(url: str, models: list[str]) -> dict[str, list[str]]:
    c = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
    return {m: [c.completions.create(model=m, prompt=p, max_tokens=12, temperature=0).choices[0].text
                for p in PROMPTS] for m in models}


@pytest.fixture(scope="module")
def files():
    return (str(tiny_models.build(tiny_models.TINY_LLAMA, REPO / "models")),
            str(tiny_models.build(tiny_models.TINY_LLAMA_LORA, REPO / "models")))


@pytest.fixture(scope="module")
def reference(files, tmp_path_factory) -> dict:
    """`vllm serve` on the same files (alone: stopped before tandem's stack starts)."""
    model_path, lora_path = files
    port = free_port()
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1"}
    argv = [sys.executable, "-m", "tandem_tools.vllm_cli_shim", "serve", model_path, "--served-model-name", MODEL,
            "--host", "127.0.0.1", "--port", str(port), "--enable-lora", "--lora-modules", f"{ADAPTER}={lora_path}",
            *_vllm_flags(LORA_ARGS)]
    with Server("vllm serve", argv, port, "/v1/models", tmp_path_factory.mktemp("vllm") / "vllm.log", env) as s:
        s.wait_ready(600)
        url = f"http://127.0.0.1:{port}"
        out = {"answers": _answers(url, [MODEL, ADAPTER]),
               "models": httpx.get(url + "/v1/models", timeout=30).json()["data"]}
        load = httpx.post(url + "/v1/load_lora_adapter", json={"lora_name": LATE, "lora_path": lora_path},
                          timeout=120)
        out["load"] = (load.status_code, load.text)
        out["late"] = _answers(url, [LATE])[LATE]
        unload = httpx.post(url + "/v1/unload_lora_adapter", json={"lora_name": LATE}, timeout=120)
        out["unload"] = (unload.status_code, unload.text)
        gone = httpx.post(url + "/v1/unload_lora_adapter", json={"lora_name": LATE}, timeout=120)
        out["gone"] = (gone.status_code, gone.json()["error"]["message"])
    return out


@pytest.fixture(scope="module")
def lora_stack(reference, files, tmp_path_factory):
    config = {"gateway": {"host": "127.0.0.1", "port": free_port(), "health_interval_s": 2},
              "ray": {"num_cpus": 2}, "models_dir": str(REPO / "models"),
              "models": [{"name": MODEL, "kind": "autoregressive", "source": "builtin:tiny-llama",
                          "resources": {"num_gpus": 0, "num_cpus": 1},
                          # vLLM's response store on: the stored-responses test below joins this stack
                          "env": {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ENABLE_RESPONSES_API_STORE": "1"},
                          "engine_args": LORA_ARGS, "lora_modules": {ADAPTER: "builtin:tiny-llama-lora"}}]}
    with running_stack(config, tmp_path_factory.mktemp("lora")) as s:
        yield s


def test_the_adapters_greedy_answers_differ_from_the_bases_and_equal_vllm_serves(reference, lora_stack):
    got = _answers(lora_stack.url, [MODEL, ADAPTER])
    assert got == reference["answers"]
    assert got[ADAPTER] != got[MODEL]  # the adapter is applied (its weights are large on purpose)


def test_models_list_the_adapter_with_its_base_as_parent(reference, lora_stack):
    want = {m["id"]: m.get("parent") for m in reference["models"]}
    got = {m["id"]: m.get("parent") for m in httpx.get(lora_stack.url + "/v1/models", timeout=30).json()["data"]}
    assert got == want == {MODEL: None, ADAPTER: MODEL}


def test_an_adapter_loaded_and_unloaded_while_requests_run_answers_as_vllms(reference, files, lora_stack):
    _, lora_path = files
    c = openai.OpenAI(base_url=lora_stack.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    stop, failures, done = threading.Event(), [], [0]

    def traffic():
        while not stop.is_set():
            for m in (MODEL, ADAPTER):
                try:
                    c.completions.create(model=m, prompt="The river bends twice", max_tokens=4, temperature=0)
                    done[0] += 1
                except Exception as e:  # noqa: BLE001 - counted: none may fail
                    failures.append(repr(e))

    t = threading.Thread(target=traffic, daemon=True)
    t.start()
    try:
        load = httpx.post(lora_stack.url + "/v1/load_lora_adapter", json={"lora_name": LATE, "lora_path": lora_path},
                          timeout=300)
        assert (load.status_code, load.text) == reference["load"]
        assert _answers(lora_stack.url, [LATE])[LATE] == reference["late"]
        unload = httpx.post(lora_stack.url + "/v1/unload_lora_adapter", json={"lora_name": LATE}, timeout=300)
        assert (unload.status_code, unload.text) == reference["unload"]
        gone = httpx.post(lora_stack.url + "/v1/unload_lora_adapter", json={"lora_name": LATE}, timeout=300)
        assert (gone.status_code, gone.json()["error"]["message"]) == reference["gone"]
    finally:
        stop.set()
        t.join(300)
    assert not failures and done[0] > 0, failures


def test_a_restarted_replica_gets_the_adapter_loaded_at_run_time_back(reference, files, lora_stack):
    """The replica's process killed (SIGKILL): Ray restarts it, and the gateway loads the adapter
    loaded at run time onto the new engine before it serves again."""
    _, lora_path = files
    load = httpx.post(lora_stack.url + "/v1/load_lora_adapter", json={"lora_name": LATE, "lora_path": lora_path},
                      timeout=300)
    assert load.status_code == 200, load.text
    before = lora_stack.replica_stats(MODEL)[0]
    os.kill(before["pid"], signal.SIGKILL)

    def back() -> bool:
        rows = lora_stack.replica_stats(MODEL)
        return bool(rows) and rows[0]["restarts"] > before["restarts"] and rows[0]["state"] == "healthy"

    wait_for(back, "the killed replica restarted and healthy", timeout=600, interval=1)
    assert lora_stack.replica_stats(MODEL)[0]["pid"] != before["pid"]
    assert _answers(lora_stack.url, [LATE])[LATE] == reference["late"]
    assert _answers(lora_stack.url, [ADAPTER]) == {ADAPTER: reference["answers"][ADAPTER]}  # the configured one too
    unload = httpx.post(lora_stack.url + "/v1/unload_lora_adapter", json={"lora_name": LATE}, timeout=300)
    assert unload.status_code == 200, unload.text


# -- stored responses, with vLLM's store on (VLLM_ENABLE_RESPONSES_API_STORE=1; the shared stack has
# it off, as `vllm serve` does by default): on this module's stack rather than a stack of its own.

def test_stored_responses_are_retrieved_through_the_replica_that_made_them(lora_stack):
    c = lora_stack.client()
    r = c.responses.create(model=MODEL, input="Tell me about the river.", max_output_tokens=6, temperature=0)
    got = c.responses.retrieve(r.id)
    assert got.id == r.id and got.output_text == r.output_text and got.status == r.status
    with pytest.raises(openai.BadRequestError, match="Cannot cancel a synchronous response"):
        c.responses.cancel(r.id)
    follow = c.responses.create(model=MODEL, input="And then?", max_output_tokens=4, previous_response_id=r.id)
    assert follow.previous_response_id == r.id and follow.usage.input_tokens > r.usage.input_tokens
