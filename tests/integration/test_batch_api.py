"""OpenAI's Files and Batch API on the real stack (issue 34): the `openai` SDK as shipped runs
batches on tiny-llama (vLLM) and tiny-diffusiongemma (the diffusion batcher): upload, create,
poll, download; bad lines to the error file; greedy lines equal the same request sent online;
cancel, list and expiry."""

from __future__ import annotations

import json
import time

import openai
from openai.types import Completion
from openai.types.chat import ChatCompletion

from tests.waiting import wait_for

FINAL = ("completed", "failed", "expired", "cancelled")


def _chat(i: int, model: str, max_tokens: int = 8) -> dict:
    return {"custom_id": f"{model}-chat-{i}", "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": model, "max_tokens": max_tokens, "temperature": 0,
                     "messages": [{"role": "user", "content": f"Tell me about the number {i}."}]}}


def _completion(i: int) -> dict:
    return {"custom_id": f"cmpl-{i}", "method": "POST", "url": "/v1/completions",
            "body": {"model": "tiny-llama", "max_tokens": 8, "temperature": 0, "prompt": f"Once upon a time {i}"}}


def _jsonl(items) -> bytes:
    return "".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in items).encode()


def _run(client: openai.OpenAI, lines, endpoint: str, window: str = "24h", timeout: float = 900):
    f = client.files.create(file=("batch.jsonl", _jsonl(lines)), purpose="batch")
    batch = client.batches.create(input_file_id=f.id, endpoint=endpoint, completion_window=window)
    return _wait(client, batch.id, timeout)


def _wait(client: openai.OpenAI, batch_id: str, timeout: float = 900):
    seen = {}

    def finished() -> bool:
        seen["b"] = client.batches.retrieve(batch_id)
        return seen["b"].status in FINAL

    wait_for(finished, f"batch {batch_id} to finish", timeout=timeout, interval=1)
    return seen["b"]


def _lines(client: openai.OpenAI, file_id: str | None) -> list[dict]:
    return [] if file_id is None else [json.loads(x) for x in client.files.content(file_id).text.splitlines()]


def test_the_sdk_runs_a_batch_on_both_kinds(stack):
    client = stack.client(timeout=300)
    chat = [_chat(i, "tiny-llama") for i in range(100)] + [_chat(i, "tiny-diffusiongemma") for i in range(40)]
    malformed = ["{not json", json.dumps({**_chat(0, "tiny-llama"), "custom_id": "bad-url", "url": "/v1/completions"}),
                 json.dumps({**_chat(1, "tiny-llama"), "custom_id": "no-model",
                             "body": {**_chat(1, "tiny-llama")["body"], "model": "no-such-model"}})]
    batch = _run(client, [*chat[:70], *malformed, *chat[70:]], "/v1/chat/completions")
    assert batch.status == "completed", batch
    assert (batch.request_counts.total, batch.request_counts.completed, batch.request_counts.failed) == (143, 140, 3)
    output, errors = _lines(client, batch.output_file_id), _lines(client, batch.error_file_id)
    ids = [x["custom_id"] for x in output + errors if x["custom_id"] is not None]
    assert len(ids) == len(set(ids)) == 142 and set(ids) >= {c["custom_id"] for c in chat}
    assert sorted(e["error"]["code"] for e in errors) == ["invalid_json_line", "invalid_url", "model_not_found"]
    answers = {}
    for o in output:
        assert o["response"]["status_code"] == 200, o
        answers[o["custom_id"]] = ChatCompletion.model_validate(o["response"]["body"])
    assert batch.usage.output_tokens == sum(a.usage.completion_tokens for a in answers.values())
    # Greedy lines equal the same requests sent online, on both kinds.
    for line in (chat[0], chat[55], chat[99], chat[100], chat[139]):
        online = client.chat.completions.create(**line["body"])
        assert online.choices[0].message.content == answers[line["custom_id"]].choices[0].message.content, line

    completions = [_completion(i) for i in range(60)]
    batch = _run(client, completions, "/v1/completions")
    assert batch.status == "completed" and batch.request_counts.completed == 60, batch
    output = {o["custom_id"]: Completion.model_validate(o["response"]["body"])
              for o in _lines(client, batch.output_file_id)}
    assert sorted(output) == sorted(c["custom_id"] for c in completions)
    online = client.completions.create(**completions[7]["body"])
    assert online.choices[0].text == output["cmpl-7"].choices[0].text
    assert {b.id for b in client.batches.list(limit=100).data} >= {batch.id}


def test_a_responses_batch_on_both_kinds(stack):
    client = stack.client(timeout=300)
    lines = [{"custom_id": f"{model}-{i}", "method": "POST", "url": "/v1/responses",
              "body": {"model": model, "input": f"Say {i}", "max_output_tokens": 8, "temperature": 0}}
             for model in ("tiny-llama", "tiny-diffusiongemma") for i in range(4)]
    batch = _run(client, lines, "/v1/responses")
    assert batch.status == "completed" and batch.request_counts.completed == 8, batch
    output = _lines(client, batch.output_file_id)
    assert sorted(o["custom_id"] for o in output) == sorted(x["custom_id"] for x in lines)
    for o in output:  # (read as the SDK reads an answer: vLLM 0.32's usage lacks cache_write_tokens, which
        body = o["response"]["body"]  # openai 3.3's type marks required; the SDK does not validate strictly)
        assert body["object"] == "response" and body["status"] in ("completed", "incomplete"), o
        assert body["usage"]["output_tokens"] >= 1 and body["output"], o


def test_cancel_and_expiry_on_the_real_stack(stack):
    client = stack.client(timeout=300)
    lines = [_chat(i, "tiny-llama", max_tokens=48) for i in range(300)]
    f = client.files.create(file=("batch.jsonl", _jsonl(lines)), purpose="batch")
    batch = client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    wait_for(lambda: client.batches.retrieve(batch.id).request_counts.completed >= 5, "five lines done",
             timeout=300, interval=0.5)
    t0 = time.monotonic()
    client.batches.cancel(batch.id)
    batch = _wait(client, batch.id, timeout=60)
    assert batch.status == "cancelled" and time.monotonic() - t0 < 15, batch
    output = _lines(client, batch.output_file_id)
    assert len(output) == batch.request_counts.completed and 5 <= len(output) < 300

    # A window shorter than the batch takes: expired, its finished lines kept, the rest in the error file.
    # (300 lines of 256 tokens: ~15 s on this box, 5x the window)
    lines = [_chat(i, "tiny-llama", max_tokens=256) for i in range(300)]
    for line in lines:
        line["body"]["ignore_eos"] = True  # (vLLM's field: whatever a random model says, 256 tokens)
    batch = _run(client, lines, "/v1/chat/completions", window="3s", timeout=120)
    assert batch.status == "expired", batch
    output, errors = _lines(client, batch.output_file_id), _lines(client, batch.error_file_id)
    assert {e["error"]["code"] for e in errors} == {"batch_expired"} and len(output) < 300
    assert sorted(x["custom_id"] for x in output + errors) == sorted(c["custom_id"] for c in lines)
