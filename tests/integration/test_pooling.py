"""An embedding model through the real stack (`tiny-embed` in vLLM's pooling runner, in a Ray
actor), against `vllm serve` on the same files: /v1/embeddings (float, base64, token ids,
`dimensions`, and a bad one refused as vLLM refuses it), /pooling, /score, /v1/score, /rerank, /v1/rerank
answer what vLLM answers; the OpenAI SDK's `embeddings.create` and LangChain's
`OpenAIEmbeddings` as clients; a generation route on it, and an embedding route on a generative
model, are 400s naming the route."""

import base64
import os
import struct
import sys

import httpx
import openai
import pytest

from tandem_tools.bench.servers import Server
from tests.integration.stack import REPO, running_stack
from tests.unit.gateway_server import free_port
from workers import tiny_models

MODEL = "tiny-embed"
ARGS = {"enforce_eager": True, "max_model_len": 512, "dtype": "float32", "runner": "pooling"}  # vLLM's pooling runner
TEXTS = ["The river bends twice", "Good software is boring in the best way.", "A"]
# (path, body): what both servers are asked; the answers compared without ids and timestamps.
CALLS = [
    ("/v1/embeddings", {"model": MODEL, "input": TEXTS}),
    ("/v1/embeddings", {"model": MODEL, "input": TEXTS[0], "encoding_format": "base64"}),
    ("/v1/embeddings", {"model": MODEL, "input": [[5, 17, 33, 90], [7, 8]]}),
    ("/v1/embeddings", {"model": MODEL, "input": TEXTS[0], "dimensions": 8}),
    ("/v1/embeddings", {"model": MODEL, "input": TEXTS[0], "dimensions": 0}),
    ("/pooling", {"model": MODEL, "input": TEXTS[1]}),
    ("/score", {"model": MODEL, "text_1": TEXTS[0], "text_2": TEXTS[1:]}),
    ("/v1/score", {"model": MODEL, "text_1": TEXTS[0], "text_2": TEXTS[1]}),
    ("/rerank", {"model": MODEL, "query": TEXTS[0], "documents": TEXTS[1:]}),
    ("/v1/rerank", {"model": MODEL, "query": TEXTS[0], "documents": TEXTS, "top_n": 2}),
]
VOLATILE = ("id", "created", "request_id")


def _strip(x):
    if isinstance(x, dict):
        # An error's `type`: OpenAI's names in tandem's envelope (invalid_request_error), vLLM's
        # exception names in its own; message, param and code are compared.
        return {k: _strip(v) for k, v in x.items() if k not in VOLATILE and not (k == "type" and "message" in x)}
    if isinstance(x, list):
        return [_strip(v) for v in x]
    return x


def _close(a, b) -> bool:
    """Equal JSON, floats within 1e-5 (a batch of other rows may move a float's last bits)."""
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_close(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_close(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, float) and isinstance(b, float):
        return abs(a - b) <= 1e-5 * max(1.0, abs(a), abs(b))
    return a == b


def _ask(url: str) -> list[tuple[int, object]]:
    out = []
    for path, body in CALLS:
        r = httpx.post(url + path, json=body, timeout=120)
        out.append((r.status_code, _strip(r.json())))
    return out


@pytest.fixture(scope="module")
def path():
    return str(tiny_models.build(tiny_models.TINY_EMBED, REPO / "models"))


@pytest.fixture(scope="module")
def reference(path, tmp_path_factory):
    port = free_port()
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"}
    argv = [sys.executable, "-m", "tandem_tools.vllm_cli_shim", "serve", path, "--served-model-name", MODEL,
            "--host", "127.0.0.1", "--port", str(port), "--enforce-eager", "--max-model-len", "512",
            "--dtype", "float32", "--runner", "pooling"]
    with Server("vllm serve", argv, port, "/v1/models", tmp_path_factory.mktemp("vllm") / "vllm.log", env) as s:
        s.wait_ready(600)
        return _ask(f"http://127.0.0.1:{port}")


@pytest.fixture(scope="module")
def embed_stack(reference, tmp_path_factory):
    config = {"gateway": {"host": "127.0.0.1", "port": free_port(), "health_interval_s": 2},
              "ray": {"num_cpus": 2}, "models_dir": str(REPO / "models"),
              "models": [{"name": MODEL, "kind": "autoregressive", "source": "builtin:tiny-embed",
                          "resources": {"num_gpus": 0, "num_cpus": 1}, "env": {"VLLM_CPU_KVCACHE_SPACE": "1"},
                          "engine_args": ARGS}]}
    with running_stack(config, tmp_path_factory.mktemp("embed")) as s:
        yield s


def test_pooling_routes_answer_what_vllm_serve_answers(reference, embed_stack):
    got = _ask(embed_stack.url)
    for (path, body), mine, theirs in zip(CALLS, got, reference, strict=True):
        assert mine[0] == theirs[0], (path, body, mine, theirs)
        assert _close(mine[1], theirs[1]), (path, body, mine, theirs)
    assert reference[0][0] == 200 and len(reference[0][1]["data"]) == 3
    assert reference[3][0] == 200 and len(reference[3][1]["data"][0]["embedding"]) == 8  # a matryoshka model
    assert reference[4][0] == 400  # a bad `dimensions`: vLLM's refusal, and ours


def test_the_openai_sdk_and_langchain_embed_through_tandem(reference, embed_stack):
    from langchain_openai import OpenAIEmbeddings

    want = [d["embedding"] for d in reference[0][1]["data"]]
    c = openai.OpenAI(base_url=embed_stack.url + "/v1", api_key="unused", max_retries=0)
    got = [d.embedding for d in c.embeddings.create(model=MODEL, input=TEXTS).data]
    assert _close(got, want)
    # The SDK's default encoding_format is base64 (little-endian float32): decoded, the same vectors.
    raw = c.embeddings.with_raw_response.create(model=MODEL, input=TEXTS[0], encoding_format="base64").http_response
    packed = base64.b64decode(raw.json()["data"][0]["embedding"])
    assert _close(list(struct.unpack(f"<{len(packed) // 4}f", packed)), want[0])
    # LangChain counts tokens with OpenAI's tokenizer by default (ids a tiny vocabulary does not have):
    # with any other model, strings are what it must send.
    lc = OpenAIEmbeddings(model=MODEL, base_url=embed_stack.url + "/v1", api_key="unused",
                          check_embedding_ctx_length=False)
    assert _close(lc.embed_documents(TEXTS), want)
    assert _close(lc.embed_query(TEXTS[0]), want[0])


def test_a_route_the_model_does_not_serve_is_a_400_naming_it(embed_stack, stack):
    r = httpx.post(embed_stack.url + "/v1/chat/completions",
                   json={"model": MODEL, "messages": [{"role": "user", "content": "x"}]}, timeout=60)
    assert r.status_code == 400 and "POST /v1/chat/completions is not served by model 'tiny-embed'" in \
        r.json()["error"]["message"]
    r = httpx.post(embed_stack.url + "/classify", json={"model": MODEL, "input": "x"}, timeout=60)
    assert r.status_code == 400 and "POST /classify" in r.json()["error"]["message"]
    r = httpx.post(stack.url + "/v1/embeddings", json={"model": "tiny-llama", "input": "x"}, timeout=60)
    assert r.status_code == 400 and "POST /v1/embeddings is not served by model 'tiny-llama'" in \
        r.json()["error"]["message"]


def test_an_embeddings_batch_answers_what_the_online_route_answers(embed_stack):
    """OpenAI's Batch API with `/v1/embeddings` lines (issue 34): each line's body is what the
    online route answers for it (floats within 1e-5)."""
    import json
    import time

    client = openai.OpenAI(base_url=embed_stack.url + "/v1", api_key="unused", max_retries=0)
    bodies = [b for path, b in CALLS if path == "/v1/embeddings" and b.get("dimensions") != 0]
    lines = [{"custom_id": f"e{i}", "method": "POST", "url": "/v1/embeddings", "body": b} for i, b in enumerate(bodies)]
    f = client.files.create(file=("e.jsonl", "".join(json.dumps(x) + "\n" for x in lines).encode()), purpose="batch")
    batch = client.batches.create(input_file_id=f.id, endpoint="/v1/embeddings", completion_window="24h")
    deadline = time.monotonic() + 300
    while (batch := client.batches.retrieve(batch.id)).status not in ("completed", "failed", "expired", "cancelled"):
        assert time.monotonic() < deadline, batch
        time.sleep(0.5)
    assert batch.status == "completed" and batch.request_counts.completed == len(lines), batch
    answers = {o["custom_id"]: o for o in map(json.loads, client.files.content(batch.output_file_id).text.splitlines())}
    for line in lines:
        online = httpx.post(embed_stack.url + "/v1/embeddings", json=line["body"], timeout=120).json()
        assert _close(_strip(answers[line["custom_id"]]["response"]["body"]), _strip(online)), line["custom_id"]
