"""Tenants on the real stack (issue 33): tiny-llama in vLLM and tiny-diffusiongemma in the
diffusion batcher behind two gateway processes (`gateway.processes: 2`), with API keys of two
roles, two tenants, a bulk key and a key limited to one model. Clients are the official
`openai` SDK as shipped. Nothing assumes which gateway process answers a request."""

from __future__ import annotations

import concurrent.futures as cf

import httpx
import openai
import pytest

from tests.integration.stack import ENGINE_ARGS, REPO, running_stack
from tests.unit.gateway_server import free_port
from tests.waiting import wait_for

MODELS = ("tiny-llama", "tiny-diffusiongemma")
ADMIN, ALPHA, BETA, BULK, NARROW = (f"sk-{n}-0123456789abcdef" for n in ("admin", "alpha", "beta", "bulk", "narrow"))
KEYS = [{"key": ADMIN, "name": "ops", "role": "admin"},
        {"key": ALPHA, "name": "alpha", "tenant": "team-a"},
        {"key": BETA, "name": "beta", "tenant": "team-b", "weight": 3},
        {"key": BULK, "name": "bulk", "tenant": "team-a", "priority": 10, "min_priority": 10},
        {"key": NARROW, "name": "narrow", "models": ["tiny-llama"]}]
# Every admin route, as a user key calls it (403 before anything else is looked at).
ADMIN_ROUTES = [("GET", "/admin/replicas", None), ("GET", "/admin/usage", None),
                ("POST", "/reset_prefix_cache", None),
                ("POST", "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "/nonexistent"}),
                ("POST", "/v1/unload_lora_adapter", {"lora_name": "x"})]


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    config = {
        "gateway": {"host": "127.0.0.1", "port": free_port(), "health_interval_s": 2, "processes": 2},
        "ray": {"num_cpus": 2},
        "models_dir": str(REPO / "models"),
        "auth": {"api_keys": KEYS},
        "models": [{
            "name": "tiny-llama", "kind": "autoregressive", "source": "builtin:tiny-llama",
            "resources": {"num_gpus": 0, "num_cpus": 1}, "env": {"VLLM_CPU_KVCACHE_SPACE": "1"},
            "engine_args": ENGINE_ARGS, "max_in_flight_per_replica": 4,
        }, {
            "name": "tiny-diffusiongemma", "kind": "diffusion", "source": "builtin:tiny-diffusiongemma",
            "resources": {"num_gpus": 0, "num_cpus": 1}, "max_in_flight_per_replica": 4,
            "engine_args": {"family": "diffusiongemma", "max_batch": 4},
        }],
    }
    with running_stack(config, tmp_path_factory.mktemp("tenants")) as s:
        yield s


def _auth(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


def _client(stack, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.url + "/v1", api_key=key, max_retries=0, timeout=300)


def test_a_user_key_gets_403_on_every_admin_route_and_an_admin_key_gets_through(stack):
    for method, path, body in ADMIN_ROUTES:
        r = httpx.request(method, stack.url + path, json=body, headers=_auth(ALPHA), timeout=60)
        assert r.status_code == 403, (path, r.text)
        assert r.json()["error"]["type"] == "permission_error", (path, r.text)
        admin = httpx.request(method, stack.url + path, json=body, headers=_auth(ADMIN), timeout=60)
        assert admin.status_code != 403 and admin.status_code < 500, (path, admin.status_code, admin.text)
    assert httpx.get(stack.url + "/admin/usage", headers=_auth(ADMIN), timeout=60).status_code == 200


def test_a_model_outside_a_keys_list_is_404_as_if_absent_on_both_kinds(stack):
    narrow = _client(stack, NARROW)
    assert [m.id for m in narrow.models.list()] == ["tiny-llama"]
    with pytest.raises(openai.NotFoundError) as hidden:
        narrow.chat.completions.create(model="tiny-diffusiongemma", max_tokens=2,
                                       messages=[{"role": "user", "content": "Hi"}])
    with pytest.raises(openai.NotFoundError) as absent:
        narrow.chat.completions.create(model="no-such-model", max_tokens=2, messages=[{"role": "user", "content": "Hi"}])
    assert hidden.value.body["type"] == absent.value.body["type"] and hidden.value.body["param"] == "model"
    # word for word what a model that does not exist gets (the models it may call named)
    assert hidden.value.body["message"] == absent.value.body["message"].replace("no-such-model", "tiny-diffusiongemma")
    r = narrow.chat.completions.create(model="tiny-llama", max_tokens=2, messages=[{"role": "user", "content": "Hi"}])
    assert r.usage.completion_tokens >= 1
    # The admin key sees both models.
    assert sorted(m.id for m in _client(stack, ADMIN).models.list()) == sorted(MODELS)


def _usage_of(stack) -> dict:
    return httpx.get(stack.url + "/admin/usage", headers=_auth(ADMIN), timeout=60).json()["tenants"]


def _tokens(usage: dict, tenant: str, model: str) -> tuple[int, int, int]:
    row = usage.get(tenant, {}).get(model, {})
    return row.get("requests", 0), row.get("prompt_tokens", 0), row.get("generation_tokens", 0)


@pytest.mark.parametrize("model", MODELS)
def test_tenant_token_counters_equal_the_usage_the_clients_received(stack, model):
    """Two tenants (one of two keys each... team-a has alpha and bulk), each route shape the SDK
    sends (chat, streamed chat with usage, completions), on both processes: the counters grow by
    exactly what the clients were told."""
    before = _usage_of(stack)
    received: dict[str, list[int]] = {"team-a": [0, 0, 0], "team-b": [0, 0, 0]}

    def one(key: str, tenant: str, i: int) -> None:
        c = _client(stack, key)
        if i % 3 == 0:
            r = c.chat.completions.create(model=model, max_tokens=5, messages=[{"role": "user", "content": f"Hi {i}"}])
            usage = r.usage
        elif i % 3 == 1:
            stream = c.chat.completions.create(model=model, max_tokens=5, stream=True,
                                               stream_options={"include_usage": True},
                                               messages=[{"role": "user", "content": f"Hello {i}"}])
            usage = [chunk for chunk in stream][-1].usage
        else:
            usage = c.completions.create(model=model, max_tokens=5, prompt=f"Once {i}").usage
        assert usage is not None and usage.completion_tokens >= 1
        row = received[tenant]
        row[0] += 1
        row[1] += usage.prompt_tokens
        row[2] += usage.completion_tokens

    jobs = [(ALPHA, "team-a", i) for i in range(4)] + [(BULK, "team-a", i) for i in range(4, 6)] + \
           [(BETA, "team-b", i) for i in range(6)]
    with cf.ThreadPoolExecutor(6) as ex:
        for f in [ex.submit(one, *job) for job in jobs]:
            f.result(600)

    def grown() -> dict:
        now = _usage_of(stack)
        return {t: [a - b for a, b in zip(_tokens(now, t, model), _tokens(before, t, model), strict=True)]
                for t in received}

    wait_for(lambda: grown() == received, f"the tenants' counters to grow by {received}", timeout=60)


@pytest.mark.parametrize("model", MODELS)
def test_an_interactive_request_is_served_under_a_bulk_flood(stack, model):
    """A bulk key's flood (its default priority 10) and an interactive request on the same
    replica: all answered (no 5xx), the engine takes each request's priority, and the admission
    metrics count the two classes apart. (How long the interactive one waits is the benchmark's
    to measure: `tandem bench --mode tenants`.)"""
    def bulk(i: int) -> int:
        r = httpx.post(stack.url + "/v1/chat/completions", headers=_auth(BULK), timeout=600,
                       json={"model": model, "max_tokens": 16, "messages": [{"role": "user", "content": f"Bulk {i}"}]})
        return r.status_code

    with cf.ThreadPoolExecutor(12) as ex:
        flood = [ex.submit(bulk, i) for i in range(12)]
        r = _client(stack, ALPHA).chat.completions.create(model=model, max_tokens=4,
                                                          messages=[{"role": "user", "content": "Now"}])
        assert r.choices[0].finish_reason in ("stop", "length")
        assert [f.result(600) for f in flood] == [200] * 12
    text = httpx.get(stack.url + "/metrics", headers=_auth(ADMIN), timeout=60).text
    for cls in ("default", "bulk"):
        line = f'tandem_admission_wait_seconds_count{{model="{model}",priority_class="{cls}"}}'
        assert line in text, cls


def test_a_batch_runs_once_under_its_keys_tenant_behind_two_processes(stack):
    """A batch submitted with team-a's key: one of the two gateway processes runs it (every
    custom_id once), its lines count to team-a's usage, and another tenant's key cannot see it."""
    import json

    alpha, beta = _client(stack, ALPHA), _client(stack, BETA)
    lines = [{"custom_id": f"{model}-{i}", "method": "POST", "url": "/v1/chat/completions",
              "body": {"model": model, "max_tokens": 4, "messages": [{"role": "user", "content": f"Hi {i}"}]}}
             for model in MODELS for i in range(10)]
    before = _usage_of(stack)
    f = alpha.files.create(file=("b.jsonl", "".join(json.dumps(x) + "\n" for x in lines).encode()), purpose="batch")
    batch = alpha.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    with pytest.raises(openai.NotFoundError):
        beta.batches.retrieve(batch.id)
    with pytest.raises(openai.NotFoundError):
        beta.files.retrieve(f.id)
    assert batch.id not in [b.id for b in beta.batches.list().data]
    state = {}

    def done() -> bool:
        state["b"] = alpha.batches.retrieve(batch.id)
        return state["b"].status in ("completed", "failed", "expired", "cancelled")

    wait_for(done, "the batch to finish", timeout=600, interval=1)
    b = state["b"]
    assert b.status == "completed" and b.request_counts.completed == 20, b
    output = [json.loads(x) for x in alpha.files.content(b.output_file_id).text.splitlines()]
    assert sorted(o["custom_id"] for o in output) == sorted(x["custom_id"] for x in lines)
    assert _client(stack, ADMIN).batches.retrieve(batch.id).id == batch.id  # an admin sees every tenant's
    expected = {m: [10, sum(o["response"]["body"]["usage"]["prompt_tokens"] for o in output if o["custom_id"].startswith(m + "-")),
                    sum(o["response"]["body"]["usage"]["completion_tokens"] for o in output
                        if o["custom_id"].startswith(m + "-"))] for m in MODELS}

    def grown() -> dict:
        now = _usage_of(stack)
        return {m: [a - b for a, b in zip(_tokens(now, "team-a", m), _tokens(before, "team-a", m), strict=True)]
                for m in MODELS}

    wait_for(lambda: grown() == expected, f"team-a's counters to grow by the batch's usage {expected}", timeout=60)
