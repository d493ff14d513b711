"""Fuzzing the real stack (vLLM and the diffusion batcher behind the gateway):

- schemathesis drives every operation of tandem's own OpenAPI document (served at
  /openapi.json) with schema-valid and schema-violating inputs: never a 5xx (also not hidden
  in a stream as an error event), every error in the OpenAI envelope;
- a burst of adversarial inputs (huge strings, deep nesting, invalid UTF-8, lone surrogates,
  control characters, NaN, thousands of tiny messages) gets 4xx answers;
- afterwards no replica was restarted and both models still give the same answer as before.

Bounded: a fixed number of derandomized examples per operation (``TANDEM_FUZZ_EXAMPLES``)."""

import concurrent.futures as cf
import json
import os
from collections import Counter

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from schemathesis import GenerationMode

EXAMPLES = int(os.environ.get("TANDEM_FUZZ_EXAMPLES", "30"))
MODELS = ("tiny-llama", "tiny-diffusiongemma")
ENVELOPE = {"message", "type", "param", "code"}


@pytest.fixture(scope="module")
def api(stack):
    return schemathesis.openapi.from_url(stack.url + "/openapi.json")


def _reference(stack) -> dict:
    """A deterministic answer from each model (temperature 0 / a fixed seed)."""
    out = {}
    for model in MODELS:
        r = httpx.post(stack.url + "/v1/chat/completions", timeout=120, json={
            "model": model, "messages": [{"role": "user", "content": "Tell me about the river."}],
            "max_tokens": 12, "temperature": 0, "seed": 7})
        assert r.status_code == 200, r.text
        out[model] = r.json()["choices"][0]["message"]["content"]
    return out


def _restarts(stack) -> dict:
    rows = httpx.get(stack.url + "/admin/replicas", timeout=30).json()["replicas"]
    return {r["id"]: r["restarts"] for r in rows}


def _bound(body) -> None:
    """Keep generation short (the subject is input handling, not output length): shrink large
    but valid sizes; invalid values are left as generated."""
    if not isinstance(body, dict):
        return
    for key, most in (("max_tokens", 16), ("max_completion_tokens", 16), ("n", 2), ("logprobs", 2)):
        v = body.get(key)
        if type(v) is int and v > most:
            body[key] = most
    knobs = body.get("diffusion")
    if isinstance(knobs, dict) and type(knobs.get("max_denoising_steps")) is int and knobs["max_denoising_steps"] > 8:
        knobs["max_denoising_steps"] = 8
    questions = body.get("questions")  # /v1/decisions: a few questions of a few options (each option is a read)
    if isinstance(questions, list):
        del questions[3:]
        for q in questions:
            for key in ("choices", "levels"):
                if isinstance(q, dict) and isinstance(q.get(key), list):
                    del q[key][4:]


def _check(response, failures: list, what: str) -> None:
    text = response.text
    if response.status_code >= 500 or '"server_error"' in text:
        failures.append(f"{what}: {response.status_code} {text[:300]}")
    elif response.status_code >= 400:
        try:
            ok = set(response.json()["error"]) == ENVELOPE
        except (ValueError, KeyError, TypeError):
            ok = False
        if not ok:
            failures.append(f"{what}: not the OpenAI envelope: {text[:300]}")


@pytest.fixture(scope="module")
def before(stack):
    return _reference(stack), _restarts(stack)


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE], ids=lambda m: m.value)
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_schemathesis_generation_routes(stack, api, before, path, mode):
    op = api[path]["POST"]
    statuses: Counter = Counter()
    failures: list[str] = []

    @settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=True, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(case=op.as_strategy(generation_mode=mode))
    def run(case):
        _bound(case.body)
        r = case.call(base_url=stack.url, timeout=120)
        statuses[r.status_code] += 1
        _check(r, failures, json.dumps(case.body, default=str)[:300])

    run()
    print(f"\n{path} {mode.value}: {dict(statuses)}")
    assert not failures, "\n".join(failures[:10])
    assert sum(statuses.values()) >= min(EXAMPLES, 10)
    if mode is GenerationMode.POSITIVE:
        assert statuses[200] > 0  # valid inputs were served, not all refused
    else:
        assert sum(n for s, n in statuses.items() if 400 <= s < 500) > 0


@pytest.mark.parametrize("path", ["/v1/responses", "/v1/messages", "/v1/messages/count_tokens", "/tokenize",
                                  "/detokenize"])
def test_schemathesis_more_routes(stack, api, before, path):
    """The routes besides chat and completions: never a 5xx; errors in the OpenAI envelope, or
    in Anthropic's shape on /v1/messages*. Fewer examples (same code path as the two above)."""
    op = api[path]["POST"]
    statuses: Counter = Counter()
    failures: list[str] = []
    anthropic = path.startswith("/v1/messages")

    @settings(max_examples=max(EXAMPLES // 3, 5), deadline=None, database=None, derandomize=True,
              phases=[Phase.generate], suppress_health_check=list(HealthCheck))
    @given(case=op.as_strategy(generation_mode=GenerationMode.POSITIVE)
           | op.as_strategy(generation_mode=GenerationMode.NEGATIVE))
    def run(case):
        _bound(case.body)
        if isinstance(case.body, dict) and type(case.body.get("max_output_tokens")) is int:
            case.body["max_output_tokens"] = min(case.body["max_output_tokens"], 16)
        r = case.call(base_url=stack.url, timeout=120)
        statuses[r.status_code] += 1
        what = json.dumps(case.body, default=str)[:300]
        if anthropic and r.status_code >= 400:
            if r.status_code >= 500 or r.json().get("type") != "error" or set(r.json()["error"]) != {"type",
                                                                                                  "message"}:
                failures.append(f"{what}: {r.status_code} {r.text[:300]}")
        else:
            _check(r, failures, what)

    run()
    print(f"\n{path}: {dict(statuses)}")
    assert not failures, "\n".join(failures[:10])
    assert sum(statuses.values()) >= 5


def test_schemathesis_other_operations(stack, api, before):
    failures: list[str] = []
    operations = [r.ok() for r in api.get_all_operations()]
    others = [op for op in operations if op.method.upper() == "GET"]
    assert {op.path for op in others} >= {"/v1/models", "/v1/models/{model_id}", "/health", "/ready"}
    def fuzz(op):
        @settings(max_examples=8, deadline=None, database=None, derandomize=True, phases=[Phase.generate],
                  suppress_health_check=list(HealthCheck))
        @given(case=op.as_strategy())
        def run(case):
            _check(case.call(base_url=stack.url, timeout=60), failures, f"GET {case.formatted_path}")

        run()

    for op in others:
        fuzz(op)
    assert not failures, "\n".join(failures[:10])


def _adversarial() -> list[tuple[str, bytes]]:
    deep = b'{"model": "M", "messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    nested_ok_json = {"model": "M", "messages": [{"role": "user", "content": "x"}], "x": {}}
    cur = nested_ok_json["x"]
    for _ in range(60):
        cur["y"] = {}
        cur = cur["y"]
    cases = {
        "huge string": {"model": "M", "messages": [{"role": "user", "content": "ab " * 1_000_000}]},
        "huge body": {"model": "M", "messages": [{"role": "user", "content": "x" * (5 * 1024 * 1024)}]},
        "deep dicts": nested_ok_json,
        "control chars": {"model": "M", "messages": [{"role": "user", "content": "\x00\x01\x07\x1b[31m\u202e\ufeff"}],
                          "max_tokens": 4},
        "lone surrogate": {"model": "M", "messages": [{"role": "user", "content": "\ud800 and \udfff"}], "max_tokens": 4},
        "thousand tiny messages": {"model": "M", "messages": [{"role": "user", "content": "a"}] * 1000},
        "five thousand messages": {"model": "M", "messages": [{"role": "user", "content": "a"}] * 5000},
        "wrong types": {"model": "M", "messages": [{"role": 5, "content": {"a": [1, 2]}}], "max_tokens": "many"},
        "messages not a list": {"model": "M", "messages": "hello"},
        "giant numbers": {"model": "M", "messages": [{"role": "user", "content": "x"}], "max_tokens": 10**30,
                          "n": 10**12, "seed": 10**40, "temperature": 1e308},
        "negative numbers": {"model": "M", "messages": [{"role": "user", "content": "x"}], "max_tokens": -(2**63),
                             "top_p": -1, "n": 0},
        "bad diffusion knobs": {"model": "M", "messages": [{"role": "user", "content": "x"}],
                                "diffusion": {"max_denoising_steps": -1, "t_min": "x", "previews": [1]}},
        "empty content": {"model": "M", "messages": [{"role": "user", "content": ""}], "max_tokens": 2},
        "huge model name": {"model": "m" * 100_000, "messages": [{"role": "user", "content": "x"}]},
    }
    out = [(name, json.dumps(body).encode()) for name, body in cases.items()]
    out += [("deep lists", deep),
            ("invalid utf-8", b'{"model": "M", "messages": [{"role": "user", "content": "\xff\xfe\xc3"}]}'),
            ("NaN", b'{"model": "M", "messages": [{"role": "user", "content": "x"}], "temperature": NaN}'),
            ("truncated", b'{"model": "M", "messages": [{"role": "us'),
            ("not an object", b'"just a string"')]
    return out


def test_adversarial_burst_leaves_every_worker_serving(stack, before):
    reference, restarts = before
    jobs = []
    for model in MODELS:
        for name, raw in _adversarial():
            body = raw.replace(b'"model": "M"', json.dumps({"model": model})[1:-1].encode(), 1)
            for path in ("/v1/chat/completions", "/v1/completions"):
                jobs.append((f"{model} {path} {name}", path, body))

    def send(job):
        what, path, body = job
        try:
            r = httpx.post(stack.url + path, content=body, headers={"content-type": "application/json"}, timeout=120)
        except httpx.HTTPError as e:
            return what, None, f"{type(e).__name__}"
        return what, r, None

    failures: list[str] = []
    statuses: Counter = Counter()
    with cf.ThreadPoolExecutor(8) as ex:
        for what, r, err in ex.map(send, jobs):
            if r is None:
                failures.append(f"{what}: {err}")
                continue
            statuses[r.status_code] += 1
            _check(r, failures, what)
    print(f"\nadversarial burst: {len(jobs)} requests, {dict(statuses)}")
    assert not failures, "\n".join(failures[:10])
    assert statuses[413] >= 1 and statuses[400] >= len(jobs) // 2
    # the workers survived: nobody restarted, the answers are the same as before the fuzzing
    assert _restarts(stack) == restarts
    assert _reference(stack) == reference
