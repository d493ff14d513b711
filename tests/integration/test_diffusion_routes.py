"""The diffusion model's routes beyond chat and completions, through the real stack with the
openai SDK: the Responses API (streamed and not, previews), /tokenize and /detokenize, logprobs,
a 400 naming each refused field, temperature 0 without a seed."""

import httpx
import openai
import pytest
from transformers import AutoTokenizer

MODEL = "tiny-diffusiongemma"
MSGS = [{"role": "user", "content": "Tell me about the library."}]


def _post(stack, path: str, body: dict) -> httpx.Response:
    return httpx.post(stack.url + path, json={"model": MODEL, **body}, timeout=120)


@pytest.fixture(scope="module")
def tokenizer(stack):
    return AutoTokenizer.from_pretrained(stack.diffusion_path)


# -- Responses -------------------------------------------------------------------------------------


def test_responses_create_not_streamed(stack):
    r = stack.client().responses.create(model=MODEL, input="Tell me about the river.", max_output_tokens=40,
                                        temperature=0, instructions="Be brief.")
    assert r.object == "response" and r.id.startswith("resp_")
    assert r.status in ("completed", "incomplete")
    assert r.output[0].type == "message" and r.output[0].content[0].type == "output_text"
    assert r.output_text == r.output[0].content[0].text  # (empty if the model's first token is EOS)
    assert r.usage.input_tokens > 0 and r.usage.output_tokens <= 40
    assert (r.status == "incomplete") == (r.usage.output_tokens == 40 and r.incomplete_details is not None)


def test_responses_create_streamed_equals_not_streamed(stack):
    c = stack.client()
    inp = [{"role": "user", "content": [{"type": "input_text", "text": "Tell me about the river."}]}]
    full = c.responses.create(model=MODEL, input=inp, max_output_tokens=80, temperature=0)
    events = list(c.responses.create(model=MODEL, input=inp, max_output_tokens=80, temperature=0, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:-1] == ["response.output_text.done", "response.content_part.done", "response.output_item.done"]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    # At most one per committed block (80 tokens = 3 blocks of 32) and the text held back to the end.
    assert len(deltas) <= 4
    assert "".join(deltas) == full.output_text == events[-4].text
    assert events[-1].response.output_text == full.output_text
    assert [e.sequence_number for e in events] == list(range(len(events)))


def test_responses_previews_are_an_extension_event(stack):
    r = httpx.post(stack.url + "/v1/responses", timeout=120, json={
        "model": MODEL, "input": "Hi", "max_output_tokens": 64, "stream": True, "temperature": 0,
        "diffusion": {"previews": True, "max_denoising_steps": 6}})
    assert r.status_code == 200
    kinds = [line[len("event: "):] for line in r.text.splitlines() if line.startswith("event: ")]
    assert "response.diffusion_preview" in kinds
    first_delta = kinds.index("response.output_text.delta")
    assert kinds.index("response.diffusion_preview") < first_delta


@pytest.mark.parametrize("field, value", [
    ("store", True), ("previous_response_id", "resp_x"), ("reasoning", {"effort": "low"}), ("top_p", 1.5),
])
def test_responses_refuses_unimplemented_fields(stack, field, value):
    r = _post(stack, "/v1/responses", {"input": "Hi", field: value})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == field


# -- honesty on chat and completions ---------------------------------------------------------------


@pytest.mark.parametrize("field, value", [
    ("tool_choice", "required"), ("top_p", 1.5), ("top_k", -2), ("frequency_penalty", 0.5),
    ("presence_penalty", 0.5), ("repetition_penalty", 1.3), ("logit_bias", {"x": 5}), ("min_tokens", 5),
    ("functions", [{"name": "f"}]),
])
def test_chat_refuses_unimplemented_fields(stack, field, value):
    r = _post(stack, "/v1/chat/completions", {"messages": MSGS, "max_tokens": 4, field: value})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == field and field in err["message"]


@pytest.mark.parametrize("field, value", [("best_of", 3), ("suffix", "!"), ("top_p", 0), ("min_p", 2)])
def test_completions_refuses_unimplemented_fields(stack, field, value):
    r = _post(stack, "/v1/completions", {"prompt": "The river", "max_tokens": 4, field: value})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == field


def test_neutral_values_are_accepted(stack):
    r = stack.client().chat.completions.create(model=MODEL, messages=MSGS, max_tokens=8, top_p=1, seed=1,
                                               frequency_penalty=0, presence_penalty=0, user="u")
    assert r.choices[0].message.content is not None


def test_chat_logprobs_consistent_with_the_tokens(stack, tokenizer):
    """Holds for any output: a token's bytes decode to its string, the bytes of the tokens the
    text keeps join to the text (a character split across tokens included), and the stream's
    logprobs equal the whole answer's."""
    c = stack.client()
    r = c.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=40, seed=4, logprobs=True, top_logprobs=2)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    joined = bytes(b for t in content if t.token not in tokenizer.all_special_tokens for b in t.bytes)
    assert joined.decode("utf-8", errors="replace") == r.choices[0].message.content
    for t in content:
        assert len(t.top_logprobs) == 2 and t.logprob <= 0
        assert t.logprob == t.top_logprobs[0].logprob  # a committed token is its step's argmax
        assert t.top_logprobs[0].logprob >= t.top_logprobs[1].logprob
        assert bytes(t.bytes).decode("utf-8", errors="replace") == t.token
    plain = c.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=40, seed=4)
    assert plain.choices[0].message.content == r.choices[0].message.content and plain.choices[0].logprobs is None
    chunks = list(c.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=40, seed=4, logprobs=True,
                                            top_logprobs=2, stream=True))
    streamed = [t for ch in chunks if ch.choices and ch.choices[0].logprobs for t in ch.choices[0].logprobs.content]
    assert [t.model_dump() for t in streamed] == [t.model_dump() for t in content]


def test_completions_logprobs_shape(stack, tokenizer):
    """Holds for any output: parallel lists, one entry per token; offsets start at 0, never
    decrease and stay in the text; a token starts at its offset, unless the text there is an
    undecodable byte run (``diffusion_plugin.api.token_text``); the stream's lists equal the whole's."""
    c = stack.client()
    r = c.completions.create(model=MODEL, prompt="The river", max_tokens=20, seed=2, logprobs=3)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == \
        r.usage.completion_tokens
    text = r.choices[0].text
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset) and lp.text_offset[-1] <= len(text)
    for token, offset in zip(lp.tokens, lp.text_offset, strict=True):
        if token not in tokenizer.all_special_tokens and "\ufffd" not in token:
            assert text.startswith(token, offset) or text[offset] == "\ufffd", (token, offset, text)
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert logprob == max(top.values()) and top[token] == logprob
    chunks = list(c.completions.create(model=MODEL, prompt="The river", max_tokens=20, seed=2, logprobs=3,
                                       stream=True))
    keys = ("tokens", "token_logprobs", "top_logprobs", "text_offset")
    streamed = {key: [v for ch in chunks for choice in ch.choices if choice.logprobs
                      for v in getattr(choice.logprobs, key)] for key in keys}
    assert streamed == {key: getattr(lp, key) for key in keys}
    assert "".join(choice.text for ch in chunks for choice in ch.choices) == text


# -- temperature 0, tokenize -----------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True])
def test_temperature_0_without_seed_is_deterministic(stack, stream):
    c = stack.client()

    first, second = (stack.completion_text(MODEL, "Good software is", 40, stream, temperature=0) for _ in range(2))
    assert first == second and len(first) > 0
    chat = [c.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=40, temperature=0)
            .choices[0].message.content for _ in range(2)]
    assert chat[0] == chat[1]


def test_tokenize_round_trips_with_detokenize(stack):
    r = _post(stack, "/tokenize", {"prompt": "The river runs past the library.", "return_token_strs": True})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["count"] == len(body["tokens"]) == len(body["token_strs"]) and body["max_model_len"] > 0
    back = _post(stack, "/detokenize", {"tokens": body["tokens"]})
    assert back.status_code == 200 and back.json()["prompt"] == "The river runs past the library."
    chat = _post(stack, "/tokenize", {"messages": MSGS}).json()
    completion = stack.client().chat.completions.create(model=MODEL, messages=MSGS, max_tokens=4, seed=1)
    assert chat["count"] == completion.usage.prompt_tokens  # the chat template the model applies
    again = _post(stack, "/tokenize", {"prompt": _post(stack, "/detokenize", {"tokens": chat["tokens"]}).json()["prompt"],
                                       "add_special_tokens": False}).json()
    assert again["tokens"] == chat["tokens"]


def test_detokenize_refuses_an_out_of_vocabulary_id(stack):
    r = _post(stack, "/detokenize", {"tokens": [1, 10**9]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tokens"


def test_sdk_raises_bad_request_naming_the_field(stack):
    """A schema feature xgrammar cannot compile is a 400 naming the field, as on vLLM."""
    with pytest.raises(openai.BadRequestError) as e:
        stack.client().chat.completions.create(model=MODEL, messages=MSGS, max_tokens=4, response_format={
            "type": "json_schema", "json_schema": {"name": "n", "schema": {"type": "integer", "multipleOf": 3}}})
    assert e.value.status_code == 400 and e.value.body["param"] == "response_format"
    assert "xgrammar" in e.value.body["message"]
