"""Metrics against a real Prometheus scraping the real stack (AR and diffusion models)."""

import base64
import io
import json
import re
import shutil
import subprocess
import time
from pathlib import Path

import httpx
import pytest
from PIL import Image

from tests.unit.gateway_server import free_port
from tests.waiting import wait_for

REPO = Path(__file__).resolve().parents[2]
DASHBOARD = REPO / "deploy" / "grafana" / "tandem-dashboard.json"


def _metrics(stack) -> str:
    return httpx.get(stack.url + "/metrics", timeout=10).text


def _value(text: str, name: str, **labels) -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            if all(f'{k}="{v}"' in line for k, v in labels.items()):
                total += float(line.rsplit(" ", 1)[1])
    return total


def _series(text: str) -> set[str]:
    return {line.rsplit(" ", 1)[0] for line in text.splitlines() if line and not line.startswith("#")}


@pytest.fixture(scope="module")
def prometheus(stack, tmp_path_factory):
    binary = shutil.which("prometheus")
    assert binary, "prometheus is not installed (make test / .ci/run install the Debian package)"
    tmp = tmp_path_factory.mktemp("prometheus")
    port = free_port()
    target = stack.url.removeprefix("http://")
    (tmp / "prometheus.yml").write_text(
        "global: {scrape_interval: 1s, evaluation_interval: 1s}\n"
        f"scrape_configs:\n  - job_name: tandem\n    static_configs:\n      - targets: ['{target}']\n")
    proc = subprocess.Popen([binary, f"--config.file={tmp / 'prometheus.yml'}", f"--storage.tsdb.path={tmp / 'data'}",
                             f"--web.listen-address=127.0.0.1:{port}"], stdout=(tmp / "log").open("w"),
                            stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(url + "/-/ready", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, (tmp / "log").read_text()[-2000:]
            time.sleep(0.5)  # a poll interval of the wait above (deadline, loud failure)
        yield url
    finally:
        proc.terminate()
        proc.wait(30)


def _load(stack) -> dict:
    """A bounded load through both models; returns the usage the responses reported (and the
    number of requests), per model."""
    c = stack.client()
    usage = {"tiny-llama": [0, 0, 0], "tiny-diffusiongemma": [0, 0, 0]}  # prompt, completion, requests
    for model, n in (("tiny-llama", 6), ("tiny-diffusiongemma", 3)):
        for i in range(n):
            msgs = [{"role": "user", "content": f"hello {i}"}]
            if i % 2:
                chunks = list(c.chat.completions.create(model=model, messages=msgs, max_tokens=12, stream=True,
                                                        stream_options={"include_usage": True}))
                u = chunks[-1].usage
            else:
                u = c.chat.completions.create(model=model, messages=msgs, max_tokens=12).usage
            usage[model][0] += u.prompt_tokens
            usage[model][1] += u.completion_tokens
            usage[model][2] += 1
    return usage


def test_counters_match_the_responses(stack):
    before = _metrics(stack)
    usage = _load(stack)
    after = _metrics(stack)
    for model, n in (("tiny-llama", 6), ("tiny-diffusiongemma", 3)):
        delta = (_value(after, "tandem_requests_total", model=model, route="/v1/chat/completions", status="2xx")
                 - _value(before, "tandem_requests_total", model=model, route="/v1/chat/completions", status="2xx"))
        assert delta == n, model
        for metric, i in (("tandem_prompt_tokens_total", 0), ("tandem_output_tokens_total", 1)):
            got = _value(after, metric, model=model) - _value(before, metric, model=model)
            assert got == usage[model][i], (model, metric)
        ttft = (_value(after, "tandem_time_to_first_token_seconds_count", model=model)
                - _value(before, "tandem_time_to_first_token_seconds_count", model=model))
        assert ttft == n // 2  # the streamed half
    # vLLM's own token counters (through the gateway's replica poll) saw at least these tokens.
    def generated() -> float:
        return (_value(_metrics(stack), "tandem_engine_generation_tokens_total", model="tiny-llama")
                - _value(before, "tandem_engine_generation_tokens_total", model="tiny-llama"))

    wait_for(lambda: generated() >= usage["tiny-llama"][1], "vLLM's generation-token counter to reach the responses'")


def test_unknown_models_and_random_paths_do_not_grow_the_series(stack):
    _load(stack)
    httpx.post(stack.url + "/v1/chat/completions", json={"model": "warm-up", "messages": []})
    httpx.get(stack.url + "/warm/up/path")
    before = _series(_metrics(stack))
    for i in range(20):
        httpx.post(stack.url + "/v1/chat/completions", json={"model": f"nope-{i}", "messages": []})
        httpx.get(stack.url + f"/random/{i}/path?x={i}")
        httpx.post(stack.url + f"/v1/{i}")
    after = _series(_metrics(stack))
    assert after == before, sorted(after ^ before)[:10]
    text = _metrics(stack)
    assert "nope-" not in text and "/random/" not in text
    assert _value(text, "tandem_requests_rejected_total", model="other", reason="unknown_model") >= 20


def _one_batch(stack) -> None:
    client = stack.client()
    line = {"custom_id": "dashboard-0", "method": "POST", "url": "/v1/completions",
            "body": {"model": "tiny-llama", "prompt": "x", "max_tokens": 2}}
    f = client.files.create(file=("b.jsonl", (json.dumps(line) + "\n").encode()), purpose="batch")
    batch = client.batches.create(input_file_id=f.id, endpoint="/v1/completions", completion_window="24h")
    wait_for(lambda: client.batches.retrieve(batch.id).status == "completed", "a one-line batch to complete",
             timeout=120, interval=0.5)


def test_every_dashboard_expression_returns_data(stack, prometheus):
    dashboard = json.loads(DASHBOARD.read_text())
    # (the dashboard's $model variable at its "All" value, as Grafana substitutes it)
    exprs = [t["expr"].replace("$model", ".+") for p in dashboard["panels"] for t in p.get("targets", [])]
    assert any(v["name"] == "model" for v in dashboard["templating"]["list"])
    assert len(exprs) >= 20
    # A bounded load while Prometheus scrapes every second; a cancelled diffusion request and an
    # image request too.
    _load(stack)
    buf = io.BytesIO()
    Image.new("RGB", (32, 48), (200, 30, 30)).save(buf, format="PNG")
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()}}
    stack.client().chat.completions.create(model="tiny-diffusiongemma", max_tokens=8, messages=[
        {"role": "user", "content": [{"type": "text", "text": "what is this?"}, image]}])
    with httpx.stream("POST", stack.url + "/v1/chat/completions",
                      json={"model": "tiny-diffusiongemma", "messages": [{"role": "user", "content": "x"}],
                            "stream": True, "max_tokens": 64, "diffusion": {"max_denoising_steps": 300}}) as r:
        next(r.iter_lines())
    _load(stack)
    _one_batch(stack)  # the batch row: a line admitted at the batch class

    def empty_expressions() -> list[str]:
        empty = []
        for expr in exprs:
            r = httpx.get(prometheus + "/api/v1/query", params={"query": expr}, timeout=10).json()
            assert r["status"] == "success", (expr, r)
            if not r["data"]["result"]:
                empty.append(expr)
        return empty

    # Prometheus scrapes every second; a rate needs two scrapes of a series: wait for them.
    last = {"empty": exprs}

    def all_have_data() -> bool:
        last["empty"] = empty_expressions()
        return not last["empty"]

    try:
        wait_for(all_have_data, "every dashboard expression to return data", timeout=120, interval=1)
    except AssertionError:
        raise AssertionError(f"{len(last['empty'])} dashboard expressions returned no data: {last['empty']}") from None
    # The series are per configured model and per replica, never per request.
    r = httpx.get(prometheus + "/api/v1/query", params={"query": "count by (model) (tandem_requests_total)"}).json()
    assert {s["metric"]["model"] for s in r["data"]["result"]} == {"tiny-llama", "tiny-diffusiongemma", "other"}
    assert re.match(r"tiny-llama/\d+", httpx.get(prometheus + "/api/v1/query", params={
        "query": "tandem_engine_kv_cache_usage_ratio"}).json()["data"]["result"][0]["metric"]["replica"])


# The metric names vLLM's own Grafana dashboard queries
# (examples/online_serving/prometheus_grafana/grafana.json in vLLM's repository).
MODELS = ("tiny-llama", "tiny-diffusiongemma")
VLLM_DASHBOARD = ("vllm:e2e_request_latency_seconds_bucket", "vllm:prompt_tokens_total", "vllm:generation_tokens_total",
                  "vllm:time_per_output_token_seconds_bucket", "vllm:num_requests_running",
                  "vllm:num_requests_waiting", "vllm:time_to_first_token_seconds_bucket", "vllm:gpu_cache_usage_perc",
                  "vllm:request_prompt_tokens_bucket", "vllm:request_generation_tokens_bucket",
                  "vllm:request_success_total", "vllm:request_queue_time_seconds_sum",
                  "vllm:request_prefill_time_seconds_sum", "vllm:request_decode_time_seconds_sum",
                  "vllm:request_max_num_generation_tokens_sum")
# Of those, the ones vLLM 0.32 no longer exports (renamed: vllm:kv_cache_usage_perc,
# vllm:inter_token_latency_seconds): `vllm serve` lacks them too.
VLLM_032_DROPPED = {"vllm:gpu_cache_usage_perc", "vllm:time_per_output_token_seconds_bucket"}



def test_vllm_families_under_vllm_names_with_a_replica_label(stack):
    """One scrape of the gateway has every replica's vLLM families, as `vllm serve` names them
    (plus `replica`); the diffusion replica exports those that mean the same there; the token
    counters agree with the usage the responses reported."""
    def tokens(text: str) -> dict:
        return {m: (_value(text, "vllm:prompt_tokens_total", model_name=m),
                    _value(text, "vllm:generation_tokens_total", model_name=m)) for m in MODELS}

    def served(text: str) -> dict:
        return {m: _value(text, "vllm:e2e_request_latency_seconds_count", model_name=m) for m in MODELS}

    wait_for(lambda: "vllm:prompt_tokens_total" in _metrics(stack), "vLLM's families in the gateway's /metrics")
    first = _metrics(stack)
    before, served_before = tokens(first), served(first)
    usage = _load(stack)

    def counted() -> bool:
        now = tokens(_metrics(stack))
        return all(now[m][0] - before[m][0] == usage[m][0] for m in MODELS) and \
            now["tiny-llama"][1] - before["tiny-llama"][1] == usage["tiny-llama"][1] and \
            now["tiny-diffusiongemma"][1] - before["tiny-diffusiongemma"][1] >= usage["tiny-diffusiongemma"][1]

    wait_for(counted, f"vLLM's token counters to grow by the responses' usage {usage}", timeout=60)
    text = _metrics(stack)
    for name in VLLM_DASHBOARD:
        if name in VLLM_032_DROPPED:
            assert name not in text, name
            continue
        lines = [ln for ln in text.splitlines() if ln.startswith(name + "{")]
        for m in MODELS:  # (a diffusion replica's: vllm_names.py)
            assert any(f'model_name="{m}"' in ln and f'replica="{m}/0"' in ln for ln in lines), (name, m)
    for m in MODELS:  # the dashboard's cache panel, under its 0.32 name
        assert f'vllm:kv_cache_usage_perc{{engine="0",model_name="{m}",replica="{m}/0"}}' in text, m
    # one latency observation per request served (each made one choice), and one success
    wait_for(lambda: all(served(_metrics(stack))[m] - served_before[m] == usage[m][2] for m in MODELS),
             f"one e2e latency observation per request {usage}", timeout=30)
    for m in MODELS:
        text = _metrics(stack)
        assert _value(text, "vllm:request_success_total", model_name=m, finished_reason="stop") + \
            _value(text, "vllm:request_success_total", model_name=m, finished_reason="length") == \
            _value(text, "vllm:e2e_request_latency_seconds_count", model_name=m), m
