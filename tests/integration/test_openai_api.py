"""The OpenAI API through the real stack (vLLM on tiny-llama in a Ray actor), via the openai SDK."""

import pytest
from transformers import AutoTokenizer

from tests.texts import first_with_a_stop_string

MODEL = "tiny-llama"
MSGS = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Tell me about the river."}]


@pytest.fixture(scope="module")
def tokenizer(stack):
    return AutoTokenizer.from_pretrained(stack.model_path)


def test_models_list_shows_the_model_with_its_kind(stack):
    models = {m.id: m.model_dump() for m in stack.client().models.list().data}
    assert sorted(models) == ["tiny-diffusiongemma", MODEL]
    assert models[MODEL]["kind"] == "autoregressive" and models[MODEL]["max_model_len"] == 512
    assert models["tiny-diffusiongemma"]["kind"] == "diffusion"
    assert stack.client().models.retrieve(MODEL).id == MODEL


def test_chat_usage_equals_the_tokenizers_counts(stack, tokenizer):
    r = stack.client().chat.completions.create(model=MODEL, messages=MSGS, max_tokens=7, temperature=0,
                                               extra_body={"return_token_ids": True, "ignore_eos": True})
    prompt_ids = tokenizer.apply_chat_template(MSGS, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert r.usage.prompt_tokens == len(prompt_ids)
    assert r.usage.completion_tokens == 7 == len(r.choices[0].model_extra["token_ids"])
    assert r.usage.total_tokens == len(prompt_ids) + 7
    assert r.choices[0].finish_reason == "length"
    # vLLM's detokenizer holds back a trailing incomplete UTF-8 sequence (shown as U+FFFD).
    decoded = tokenizer.decode(r.choices[0].model_extra["token_ids"], skip_special_tokens=True)
    assert decoded.rstrip("\ufffd") == r.choices[0].message.content


def test_completion_usage_equals_the_tokenizers_counts(stack, tokenizer):
    prompt = "The library opens at nine and"
    r = stack.client().completions.create(model=MODEL, prompt=prompt, max_tokens=5, temperature=0,
                                          extra_body={"ignore_eos": True})
    assert r.usage.prompt_tokens == len(tokenizer(prompt).input_ids)
    assert r.usage.completion_tokens == 5 and r.choices[0].finish_reason == "length"


@pytest.mark.parametrize("route", ["chat", "completions"])
def test_streamed_equals_non_streamed_at_temperature_0(stack, route):
    c = stack.client()
    if route == "chat":
        full = c.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=24, temperature=0)
        chunks = list(c.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=24, temperature=0,
                                                stream=True, stream_options={"include_usage": True}))
        text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
        expected = full.choices[0].message.content
    else:
        full = c.completions.create(model=MODEL, prompt="Good software is", max_tokens=24, temperature=0)
        chunks = list(c.completions.create(model=MODEL, prompt="Good software is", max_tokens=24, temperature=0,
                                           stream=True, stream_options={"include_usage": True}))
        text = "".join(ch.choices[0].text for ch in chunks if ch.choices)
        expected = full.choices[0].text
    assert text == expected and len(text) > 0
    assert len([ch for ch in chunks if ch.choices]) >= 1  # vLLM merges deltas its consumer has not taken yet (a busy box): how many is not fixed
    assert chunks[-1].usage is not None and not chunks[-1].choices  # the usage chunk comes last
    assert chunks[-1].usage.model_dump() == full.usage.model_dump()
    finishes = [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason]
    assert finishes == [full.choices[0].finish_reason]


def test_n_2_gives_two_choices(stack):
    r = stack.client().chat.completions.create(model=MODEL, messages=MSGS, n=2, max_tokens=6, temperature=1.0, seed=3,
                                               extra_body={"ignore_eos": True})
    assert sorted(ch.index for ch in r.choices) == [0, 1]
    assert all(ch.finish_reason == "length" for ch in r.choices)
    assert r.usage.completion_tokens == 12


def test_stop_string_ends_with_finish_reason_stop(stack):
    c = stack.client()
    prompts = [f"Question {i}: What is" for i in range(20)]
    i, text, stop = first_with_a_stop_string(lambda i: c.completions.create(
        model=MODEL, prompt=prompts[i], max_tokens=16, temperature=0, extra_body={"ignore_eos": True}).choices[0].text)
    r = c.completions.create(model=MODEL, prompt=prompts[i], max_tokens=16, temperature=0, stop=[stop],
                             extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].text == text[:text.index(stop)]


def test_logprobs(stack):
    r = stack.client().chat.completions.create(model=MODEL, messages=MSGS, max_tokens=5, temperature=0,
                                               logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True})
    content = r.choices[0].logprobs.content
    assert len(content) == 5
    for tok in content:
        assert tok.logprob <= 0 and len(tok.top_logprobs) == 2
        assert tok.top_logprobs[0].logprob >= tok.top_logprobs[1].logprob
        assert tok.token == tok.top_logprobs[0].token  # greedy: the chosen one is the most likely


def test_seeded_sampling_is_reproducible(stack):
    c = stack.client()
    a = c.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=12, temperature=1.0, seed=11)
    b = c.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=12, temperature=1.0, seed=11)
    assert a.choices[0].message.content == b.choices[0].message.content
