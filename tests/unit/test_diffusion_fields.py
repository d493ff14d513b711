"""Diffusion honesty: every OpenAI field honoured or refused (400 naming it); logprobs in the
runner (both samplers) leave the outputs unchanged and are consistent with the committed tokens;
temperature 0 without a seed is seeded."""

import asyncio
import json

import pytest
import torch

from diffusion_plugin.api import params as P
from diffusion_plugin.api.responses import NEUTRAL as RESPONSES_NEUTRAL
from diffusion_plugin.api.responses import ResponsesBody, to_messages
from diffusion_plugin.batcher.request import SamplingParams, Sequence
from diffusion_plugin.batcher.scheduler import Scheduler
from diffusion_plugin.engine import DiffusionEngine
from diffusion_plugin.families.diffusiongemma import DiffusionGemmaAdapter
from diffusion_plugin.step.runner import Runner
from tandem_core.errors import TandemError
from tests.texts import stop_string_in
from workers import tiny_models

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
DEFAULTS = {"t_min": 0.5, "t_max": 1.0, "max_denoising_steps": 8, "entropy_bound": 1.0, "stability_threshold": 1,
            "confidence_threshold": 0.1}


def _param(cls, body, neutral=None) -> str | None:
    with pytest.raises(TandemError) as e:
        P.parse(cls, body, neutral)
    return e.value.param


@pytest.mark.parametrize("field, value", [
    ("frequency_penalty", 0.5), ("presence_penalty", -1),
    ("repetition_penalty", 1.2), ("functions", [{"name": "f"}]),
    ("function_call", "auto"), ("store", True), ("prediction", {"type": "content", "content": "x"}),
    ("audio", {"voice": "x"}), ("modalities", ["text", "audio"]), ("reasoning_effort", "hard"), ("made_up_field", 1),
])
def test_chat_refuses_what_it_does_not_implement(field, value):
    assert _param(P.ChatBody, {**CHAT, field: value}) == field


def test_chat_reasoning_effort_switches_the_templates_thinking_as_vllm_does():
    """vLLM's ``build_chat_params``: the effort to the template, thinking on for any but "none",
    unless the request's ``chat_template_kwargs`` set ``enable_thinking``."""
    def kwargs(**kw):
        return P.parse(P.ChatBody, {**CHAT, **kw}).template_kwargs()

    assert kwargs(reasoning_effort="low") == {"reasoning_effort": "low", "enable_thinking": True}
    assert kwargs(reasoning_effort="none") == {"reasoning_effort": "none", "enable_thinking": False}
    assert kwargs(reasoning_effort="high", chat_template_kwargs={"enable_thinking": False})["enable_thinking"] is False
    assert kwargs() is None


@pytest.mark.parametrize("field, value", [("best_of", 2), ("suffix", "end"), ("presence_penalty", 0.1),
                                          ("reasoning_effort", "low")])
def test_completions_refuses_what_it_does_not_implement(field, value):
    assert _param(P.CompletionBody, {"model": "m", "prompt": "x", field: value}) == field


@pytest.mark.parametrize("extra", [
    {"top_p": 1}, {"top_p": 1.0}, {"frequency_penalty": 0.0}, {"presence_penalty": 0}, {"logit_bias": {}},
    {"tools": []}, {"response_format": {"type": "text"}}, {"user": "u"}, {"metadata": {"a": "b"}},
    {"store": False}, {"top_p": None, "tools": None}, {"stream_options": {"include_usage": True}, "stream": True},
])
def test_neutral_values_and_harmless_fields_are_accepted(extra):
    P.parse(P.ChatBody, {**CHAT, **extra})


def test_logprobs_fields():
    assert P.parse(P.ChatBody, {**CHAT, "logprobs": True, "top_logprobs": 3}).top_logprobs_k() == 3
    assert P.parse(P.ChatBody, {**CHAT, "logprobs": True}).top_logprobs_k() == 0
    assert P.parse(P.ChatBody, CHAT).top_logprobs_k() is None
    assert _param(P.ChatBody, {**CHAT, "top_logprobs": 2}) == "top_logprobs"
    assert _param(P.ChatBody, {**CHAT, "logprobs": True, "top_logprobs": 21}) == "top_logprobs"
    assert P.parse(P.CompletionBody, {"model": "m", "prompt": "x", "logprobs": 2}).top_logprobs_k() == 2
    assert _param(P.CompletionBody, {"model": "m", "prompt": "x", "logprobs": -1}) == "logprobs"


def test_temperature_0_without_seed_is_seeded():
    req = P.parse(P.ChatBody, {**CHAT, "temperature": 0})
    assert P.resolve(req, DEFAULTS)["seed"] == P.resolve(req, DEFAULTS)["seed"] == P.GREEDY_SEED
    assert P.resolve(P.parse(P.ChatBody, {**CHAT, "temperature": 0, "seed": 9}), DEFAULTS)["seed"] == 9


def test_temperatures_too_small_for_float32_are_refused_or_floored():
    """logits / t overflows float32 for t ~1e-40 (the sampler then returns garbage, seen here):
    a schedule end below GREEDY_T is a 400 naming it; a tiny ``temperature`` is near-greedy."""
    for knob in ("t_min", "t_max"):
        assert _param(P.ChatBody, {**CHAT, "diffusion": {knob: 1e-40}}) == f"diffusion.{knob}"
    knobs = P.resolve(P.parse(P.ChatBody, {**CHAT, "temperature": 1e-40}), DEFAULTS)
    assert knobs["t_min"] == knobs["t_max"] == P.GREEDY_T
    assert P.resolve(P.parse(P.ChatBody, {**CHAT, "diffusion": {"t_min": P.GREEDY_T}}), DEFAULTS)["t_min"] == P.GREEDY_T


@pytest.mark.parametrize("field, value", [
    ("store", True), ("previous_response_id", "resp_1"), ("reasoning", {"effort": "low"}), ("background", True),
    ("top_p", 1.5), ("top_logprobs", 2), ("include", ["message.output_text.logprobs"]), ("conversation", "c"),
])
def test_responses_refuses_what_it_does_not_implement(field, value):
    assert _param(ResponsesBody, {"model": "m", "input": "hi", field: value}, RESPONSES_NEUTRAL) == field


def test_responses_input_to_messages():
    req = P.parse(ResponsesBody, {"model": "m", "instructions": "Be brief.", "input": [
        {"role": "developer", "content": "d"},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi"}]}]}, RESPONSES_NEUTRAL)
    assert to_messages(req) == [{"role": "system", "content": "Be brief."}, {"role": "system", "content": "d"},
                                {"role": "user", "content": [{"type": "text", "text": "hi"}]}]
    calls = P.parse(ResponsesBody, {"model": "m", "input": [
        {"role": "user", "content": "weather?"},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
        {"type": "function_call", "call_id": "c2", "name": "g", "arguments": "{\"a\": 1}"},
        {"type": "function_call_output", "call_id": "c1", "output": "sunny"}]}, RESPONSES_NEUTRAL)
    assert to_messages(calls)[1:] == [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}},
            {"id": "c2", "type": "function", "function": {"name": "g", "arguments": "{\"a\": 1}"}}]},
        {"role": "tool", "content": "sunny", "tool_call_id": "c1"}]
    bad = P.parse(ResponsesBody, {"model": "m", "input": [{"type": "function_call_output", "output": "x"}]},
                  RESPONSES_NEUTRAL)
    with pytest.raises(TandemError) as e:
        to_messages(bad)
    assert e.value.param == "input"


# -- logprobs in the runner ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def adapter():
    torch.set_num_threads(1)
    return DiffusionGemmaAdapter(str(tiny_models.build(tiny_models.TINY_DIFFUSIONGEMMA)))


def _run(adapter, sampler, logprobs):
    params = {**adapter.defaults(), "max_denoising_steps": 6}
    sched = Scheduler(max_batch=4, canvas_length=adapter.canvas_length, row_boundaries=False)
    runner, seqs, blocks = Runner(adapter, sampler), {}, {}
    for i in range(3):
        seq = Sequence(seq_id=f"s{i}", prompt_ids=[(5 * i + j) % 900 + 3 for j in range(12 + 7 * i)],
                       params=SamplingParams(max_tokens=50, seed=3 + i, eos_token_ids=(),
                                             logprobs=logprobs if i != 1 else None, **params))
        seqs[seq.seq_id] = seq
        sched.add(seq)
    while sched.has_work():
        batch, _ = sched.schedule()
        if batch.empty():
            continue
        committed, _ = sched.update(runner.execute(batch, seqs))
        for c in committed:
            blocks.setdefault(c.seq.seq_id, []).append((c.new_ids, c.logprobs))
    return {s: q.output_ids for s, q in seqs.items()}, blocks


@pytest.mark.parametrize("sampler", ["exact", "fast"])
def test_logprobs_leave_outputs_unchanged_and_match_the_committed_tokens(adapter, sampler):
    plain, _ = _run(adapter, sampler, None)
    with_lp, blocks = _run(adapter, sampler, 3)
    assert with_lp == plain  # asking for logprobs changes no token
    assert all(lp is None for _, lp in blocks["s1"])  # the row that did not ask got none
    for seq_id in ("s0", "s2"):
        for ids, lps in blocks[seq_id]:
            assert len(lps) == len(ids)
            for token, (logprob, top) in zip(ids, lps, strict=True):
                assert len(top) == 3 and logprob <= 0
                assert [v for _, v in top] == sorted((v for _, v in top), reverse=True)
                assert logprob == top[0][1]  # the committed token is that step's argmax
                assert token == top[0][0] or abs(top[1][1] - logprob) < 1e-6  # (or tied with it)


def test_engine_logprobs_stop_at_the_stop_string_and_streamed_equals_whole():
    """On the real tiny model, whatever it writes (the built-to-split cases are in
    ``test_diffusion_logprobs``): a stop string keeps the tokens before it and their logprobs,
    and a stream's logprobs equal the whole answer's."""
    path = str(tiny_models.build(tiny_models.TINY_DIFFUSIONGEMMA))
    body = {"model": "m", "prompt": "The river", "max_tokens": 60, "logprobs": 1, "ignore_eos": True}

    async def main():
        engine = DiffusionEngine("m", path, {"sampler": "exact", "num_threads": 1})
        await engine.start()
        try:
            for seed in range(5, 25):  # a seed whose answer has a stop string to take (nearly any)
                body["seed"] = seed
                whole = [x async for x in engine.completions(body, "a")][0]["choices"][0]
                stop = stop_string_in(whole["text"])
                if stop:
                    break
            else:
                raise AssertionError("no answer of 20 seeds had 3 decodable characters after its first")
            cut = [x async for x in engine.completions({**body, "stop": stop}, "b")][0]["choices"][0]
            chunks = [x async for x in engine.completions({**body, "stream": True}, "c")]
            cut_chunks = [x async for x in engine.completions({**body, "stop": stop, "stream": True}, "d")]
            return whole, stop, cut, chunks, cut_chunks
        finally:
            await engine.shutdown()

    whole, stop, cut, chunks, cut_chunks = asyncio.run(main())
    assert cut["text"] == whole["text"][:whole["text"].index(stop)] and cut["finish_reason"] == "stop"
    lp, full = cut["logprobs"], whole["logprobs"]
    n = len(lp["tokens"])
    assert 0 < n < len(full["tokens"])
    for key in lp:  # the tokens before the stop string, as the whole answer has them
        assert lp[key] == full[key][:n]
    assert lp["text_offset"][-1] < len(cut["text"]) <= full["text_offset"][n]
    for answer, streamed in ((full, chunks), (lp, cut_chunks)):
        payloads = [json.loads(c[len("data: "):]) for c in streamed if c.startswith("data: {")]
        joined = {key: [v for s in payloads for ch in s["choices"] if ch["logprobs"] for v in ch["logprobs"][key]]
                  for key in answer}
        assert joined == answer
