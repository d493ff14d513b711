"""Decisions through the real stack (vLLM on tiny-llama in a Ray actor, the diffusion batcher on
tiny-diffusiongemma): OpenAI's ``client.decisions.create`` with the newest SDK on both model
kinds, and vLLM's /v1/systemone, on tiny-llama against `vllm serve` on the same files (a Llama:
vLLM has no read strategy for it, so its answer is a 501) and on the diffusion model in vLLM's
response shape. Answers hold for any output a random model gives: their shape, order, sums and
repeatability are checked, never which option wins."""

from __future__ import annotations

import os
import sys

import httpx
import openai
import pytest

from tandem_tools.bench.servers import Server
from tests.integration.stack import ENGINE_ARGS, REPO
from tests.unit.gateway_server import free_port
from workers import tiny_models

MODELS = ["tiny-llama", "tiny-diffusiongemma"]
QUESTIONS = [
    {"type": "predicate", "name": "happy", "instructions": "The customer is happy."},
    {"type": "choice", "name": "topic", "instructions": "What is the message about?",
     "choices": [{"value": "billing"}, {"value": "shipping", "description": "where the parcel is"},
                 {"value": True}]},
    {"type": "score", "name": "urgency", "instructions": "How urgent is it?",
     "levels": [{"label": str(i)} for i in range(1, 6)]},
]
INPUT = "My parcel has not arrived and I was charged twice. Please help today."
SYSTEMONE = {"state": {"ticket": INPUT}, "questions": {
    "happy": {"type": "noul", "instructions": "Is the customer happy?"},
    "topic": {"type": "choice", "instructions": "Topic?", "criteria": {"billing": None, "shipping": "the parcel"}},
    "urgency": {"type": "score", "instructions": "Urgency?", "criteria": ["low", "medium", "high"]}}}


def _probabilities(answer) -> list[float]:
    return [p.probability for p in answer.probabilities]


def _numbers(answers) -> list[float]:
    out = []
    for a in answers:
        out += [getattr(a, k) for k in ("probability", "confidence", "score") if getattr(a, k, None) is not None]
        out += _probabilities(a) if getattr(a, "probabilities", None) else []
    return out


@pytest.fixture(scope="module")
def vllm_systemone(tmp_path_factory) -> list[tuple[int, dict]]:
    """`vllm serve` on tiny-llama's files, alone: its answers to /v1/systemone."""
    path = str(tiny_models.build(tiny_models.TINY_LLAMA, REPO / "models"))
    port = free_port()
    argv = [sys.executable, "-m", "tandem_tools.vllm_cli_shim", "serve", path, "--served-model-name", "tiny-llama",
            "--host", "127.0.0.1", "--port", str(port), "--enforce-eager", "--max-model-len",
            str(ENGINE_ARGS["max_model_len"]), "--dtype", ENGINE_ARGS["dtype"]]
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"}
    with Server("vllm serve", argv, port, "/v1/models", tmp_path_factory.mktemp("vllm") / "vllm.log", env) as s:
        s.wait_ready(600)
        out = []
        for body in ({"model": "tiny-llama", **SYSTEMONE}, {"model": "tiny-llama", "state": "x", "questions": {}}):
            r = httpx.post(f"http://127.0.0.1:{port}/v1/systemone", json=body, timeout=120)
            out.append((r.status_code, r.json()))
        return out


@pytest.mark.parametrize("model", MODELS)
def test_the_newest_sdk_decides_on_both_model_kinds(stack, model):
    client = stack.client()
    first = client.decisions.create(model=model, input=INPUT, questions=QUESTIONS)
    assert first.model == model and [a.type for a in first.answers] == ["predicate", "choice", "score"]
    assert [a.name for a in first.answers] == ["happy", "topic", "urgency"]
    predicate, choice, score = first.answers
    assert 0 <= predicate.probability <= 1
    assert [p.value for p in choice.probabilities] == ["billing", "shipping", True]  # typed: True is no string
    assert abs(sum(_probabilities(choice)) - 1) < 1e-4 and abs(sum(_probabilities(score)) - 1) < 1e-4
    assert choice.choice in ("billing", "shipping", True) and 0 < choice.confidence <= 1
    assert [p.label for p in score.probabilities] == ["1", "2", "3", "4", "5"]
    assert [p.value for p in score.probabilities] == [0, 1, 2, 3, 4] and 0 <= score.score <= 4
    assert first.usage.input_tokens > 0 and first.usage.output_tokens == 0
    again = client.decisions.create(model=model, input=INPUT, questions=QUESTIONS)
    if model == "tiny-diffusiongemma":
        assert again.answers == first.answers  # bit for bit: batch-invariant reads, fixed noise
    else:  # vLLM reads the second time through its prefix cache: a prefill of other lengths, on
        # CPU another GEMM kernel for a few rows (~1e-7 apart), so the same up to float rounding
        assert _numbers(again.answers) == pytest.approx(_numbers(first.answers), rel=1e-5, abs=1e-7)
        assert [a.type for a in again.answers] == [a.type for a in first.answers]


@pytest.mark.parametrize("model", MODELS)
def test_input_items_and_many_questions(stack, model):
    """Messages, a function call and its output as the input; 30 choices (two-letter labels) and
    more questions than one engine call takes (chunked), answered in order."""
    items = [{"role": "developer", "content": "You triage support tickets."},
             {"role": "user", "content": [{"type": "input_text", "text": INPUT},
                                          {"type": "input_json", "data": {"order": 42}}]},
             {"type": "function_call", "call_id": "c1", "name": "lookup", "arguments": "{\"order\": 42}"},
             {"type": "function_call_output", "call_id": "c1", "output": "in transit"}]
    many = [{"type": "choice", "instructions": "Which code?", "choices": [{"value": f"v{i}"} for i in range(30)]},
            *({"type": "predicate", "instructions": f"Statement {i} holds."} for i in range(69))]
    d = stack.client().decisions.create(model=model, input=items, questions=many)
    assert len(d.answers) == 70 and d.answers[0].type == "choice"
    assert all(a.type == "predicate" for a in d.answers[1:])
    assert abs(sum(_probabilities(d.answers[0])) - 1) < 1e-4


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("questions, param", [
    ([{"type": "predicate", "instructions": "x"}] * 401, "questions"),
    ([{"type": "choice", "instructions": "x", "choices": []}], "questions"),
    ([{"type": "score", "instructions": "x", "levels": [{"label": "a"}, {"description": "no label"}]}], "questions"),
    ([{"type": "rank", "instructions": "x"}], "questions"),
])
def test_bad_questions_are_a_400_naming_the_field(stack, model, questions, param):
    with pytest.raises(openai.BadRequestError) as e:
        stack.client().decisions.create(model=model, input=INPUT, questions=questions)
    assert e.value.status_code == 400 and e.value.body["param"] == param
    assert "questions" in e.value.message
    assert stack.client().models.list().data  # still serving


def test_a_tool_output_without_its_call_is_a_400(stack):
    with pytest.raises(openai.BadRequestError) as e:
        stack.client().decisions.create(model="tiny-llama", questions=QUESTIONS[:1], input=[
            {"type": "function_call_output", "call_id": "nope", "output": "x"}])
    assert e.value.body["param"] == "input" and "call_id" in e.value.message


def test_systemone_on_tiny_llama_answers_what_vllm_serve_answers(stack, vllm_systemone):
    for body, (status, theirs) in zip(({"model": "tiny-llama", **SYSTEMONE},
                                       {"model": "tiny-llama", "state": "x", "questions": {}}),
                                      vllm_systemone, strict=True):
        r = httpx.post(stack.url + "/v1/systemone", json=body, timeout=120)
        assert (r.status_code, r.json()["error"]["message"]) == (status, theirs["error"]["message"])
        assert status == 501  # a Llama: vLLM has no read strategy for it


def test_systemone_on_the_diffusion_model_answers_in_vllms_shape(stack):
    from vllm.entrypoints.generate.structured_decisions.protocol import StructuredDecisionResponse

    r = httpx.post(stack.url + "/v1/systemone", json={"model": "tiny-diffusiongemma", **SYSTEMONE}, timeout=120)
    assert r.status_code == 200, r.text
    got = StructuredDecisionResponse.model_validate(r.json())
    assert list(got.answers) == ["happy", "topic", "urgency"] and got.object == "structured_decision"
    assert got.answers["topic"]["choice"] in ("billing", "shipping")
    assert abs(sum(got.answers["urgency"]["probabilities"].values()) - 1) < 1e-6
    bad = httpx.post(stack.url + "/v1/systemone", json={"model": "tiny-diffusiongemma", "state": "x",
                                                        "questions": {"q": {"type": "noul", "bogus": 1}}}, timeout=60)
    assert bad.status_code == 400 and "bogus" in bad.json()["error"]["message"]
