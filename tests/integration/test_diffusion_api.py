"""The diffusion model through the real stack (Ray actor, gateway) with the openai SDK."""

import asyncio

import httpx
import pytest
from transformers import AutoTokenizer

from tests.texts import first_with_a_stop_string
from tests.waiting import async_wait_for, wait_for

MODEL = "tiny-diffusiongemma"
MSGS = [{"role": "user", "content": "Tell me about the library."}]
CANVAS = 32


@pytest.fixture(scope="module")
def tokenizer(stack):
    return AutoTokenizer.from_pretrained(stack.diffusion_path)


def test_non_streaming_counts_and_finish(stack, tokenizer):
    r = stack.client().chat.completions.create(model=MODEL, messages=MSGS, max_tokens=40, seed=7,
                                               extra_body={"ignore_eos": True})
    prompt = tokenizer.apply_chat_template(MSGS, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert r.usage.prompt_tokens == len(prompt)
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 40  # exact, not 64
    assert r.choices[0].message.content


def test_streaming_blocks_arrive_as_deltas_equal_to_non_streaming(stack):
    c = stack.client()
    eos = {"ignore_eos": True}
    full = c.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=80, seed=3, extra_body=eos)
    chunks = list(c.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=80, seed=3, stream=True,
                                            stream_options={"include_usage": True}, extra_body=eos))
    deltas = [ch.choices[0].delta.content for ch in chunks if ch.choices and ch.choices[0].delta.content]
    assert "".join(deltas) == full.choices[0].message.content  # same seed: same tokens, batched or not
    # At most one delta per committed block (80 tokens = 3 blocks of 32), and the text held back at
    # the end (a partial character, a possible stop string's start) with the finish.
    assert 1 <= len(deltas) <= 4
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens == 80


def test_previews_replace_then_commit(stack):
    stream = stack.client().chat.completions.create(
        model=MODEL, messages=MSGS, max_tokens=64, seed=5, stream=True,  # 2 blocks of 6 steps each, by design:
        extra_body={"ignore_eos": True, "diffusion": {"previews": True, "max_denoising_steps": 6,
                                                      "confidence_threshold": 0.0}})  # never an early commit
    events = []
    for ch in stream:
        choice = ch.choices[0]
        preview = choice.model_extra.get("diffusion_preview")
        if preview:
            assert choice.delta.content in (None, "")  # previews never append text
            events.append(("preview", preview))
        elif choice.delta.content:
            events.append(("delta", choice.delta.content))
    previews = [e[1] for e in events if e[0] == "preview"]
    assert previews and all(p["max_steps"] == 6 and 1 <= p["step"] < 6 for p in previews)
    assert {p["block"] for p in previews} == {0, 1}
    first_delta = next(i for i, e in enumerate(events) if e[0] == "delta")
    assert all(e[1]["block"] == 0 for e in events[:first_delta])  # block 0's previews, then its commit
    steps0 = [p["step"] for p in previews if p["block"] == 0]
    assert steps0 == sorted(steps0) and len(set(steps0)) == len(steps0)  # each replaces the previous


@pytest.mark.parametrize("knobs, param", [
    ({"diffusion": {"entropy_bound": -1}}, "diffusion.entropy_bound"),
    ({"diffusion": {"max_denoising_steps": 0}}, "diffusion.max_denoising_steps"),
    ({"diffusion": {"t_min": 0.9, "t_max": 0.5}}, "diffusion.t_min"),
    ({"diffusion": {"stability_threshold": -2}}, "diffusion.stability_threshold"),
    ({"diffusion": {"confidence_threshold": "high"}}, "diffusion.confidence_threshold"),
    ({"diffusion": {"unknown_knob": 1}}, "diffusion.unknown_knob"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"temperature": 5}, "temperature"),
])
def test_bad_knobs_are_400_naming_the_field(stack, knobs, param):
    r = httpx.post(stack.url + "/v1/chat/completions", json={"model": MODEL, "messages": MSGS, **knobs})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_completions_route_and_stop(stack):
    c = stack.client()
    eos = {"ignore_eos": True}
    seed, text, stop = first_with_a_stop_string(lambda i: c.completions.create(
        model=MODEL, prompt="The river", max_tokens=32, seed=2 + i, extra_body=eos).choices[0].text)
    r = c.completions.create(model=MODEL, prompt="The river", max_tokens=32, seed=2 + seed, stop=[stop], extra_body=eos)
    assert r.choices[0].finish_reason == "stop" and r.choices[0].text == text[:text.index(stop)]


def test_client_that_disconnects_mid_block_leaves_the_batch(stack):
    slow = {"model": MODEL, "messages": MSGS, "max_tokens": 96, "stream": True, "seed": 1,
            "diffusion": {"max_denoising_steps": 400, "stability_threshold": 0, "confidence_threshold": 0.0}}
    keep = {**slow, "seed": 2, "max_tokens": 33, "ignore_eos": True, "diffusion": {"max_denoising_steps": 40}}

    def diffusion_engine():
        return stack.replica_stats(MODEL)[0]["engine"]

    async def main():
        async with httpx.AsyncClient(timeout=120) as client:
            async def consume(body):
                async with client.stream("POST", stack.url + "/v1/chat/completions", json=body) as r:
                    return [line async for line in r.aiter_lines() if line.startswith("data: ")]

            kept = asyncio.create_task(consume(keep))
            async with client.stream("POST", stack.url + "/v1/chat/completions",
                                     json={**slow, "diffusion": {**slow["diffusion"], "previews": True}}) as r:
                lines = r.aiter_lines()
                while not (await anext(lines)).startswith("data: {"):
                    pass
                await async_wait_for(lambda: diffusion_engine()["running"] >= 1, "the slow request to be in the batch")
                aborted_before = diffusion_engine()["aborted"]
            # the slow stream is mid-block (400 steps, far from done): the counter proves the abort
            await async_wait_for(lambda: diffusion_engine()["aborted"] > aborted_before,
                                 "the dropped request to leave the batch")
            return await kept

    kept_lines = asyncio.run(main())
    assert kept_lines[-1] == "data: [DONE]" and '"finish_reason": "length"' in "".join(kept_lines)
    wait_for(lambda: diffusion_engine()["running"] == 0, "the batch to empty")


def test_n_2_gives_two_sequences_with_their_own_seeds(stack):
    r = stack.client().chat.completions.create(model=MODEL, messages=MSGS, max_tokens=20, seed=11, n=2,
                                               extra_body={"ignore_eos": True})
    assert sorted(ch.index for ch in r.choices) == [0, 1]
    assert r.usage.completion_tokens == 40 and r.choices[0].message.content != r.choices[1].message.content
    one = stack.client().chat.completions.create(model=MODEL, messages=MSGS, max_tokens=20, seed=12,
                                                 extra_body={"ignore_eos": True})
    assert one.choices[0].message.content == r.choices[1].message.content  # choice i uses seed + i
