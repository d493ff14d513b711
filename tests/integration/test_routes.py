"""The routes `vllm serve` offers besides chat and completions, through the real stack (vLLM on
tiny-llama in a Ray actor, the diffusion model beside it), with the official SDKs: OpenAI's
Responses API, Anthropic's Messages API (on both model kinds), /tokenize, /detokenize, /version;
temperature 0 without a seed; errors worded as vLLM words them."""

import anthropic
import httpx
import openai
import pytest

MODEL = "tiny-llama"
DIFFUSION = "tiny-diffusiongemma"
MSGS = [{"role": "user", "content": "Tell me about the river."}]


def _anthropic(stack) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=stack.url, api_key="unused", max_retries=0)


def _post(stack, path: str, body: dict) -> httpx.Response:
    return httpx.post(stack.url + path, json=body, timeout=120)


# -- OpenAI's Responses API -------------------------------------------------------------------


def test_responses_create_not_streamed(stack):
    r = stack.client().responses.create(model=MODEL, input="Tell me about the river.", max_output_tokens=8,
                                        temperature=0)
    assert r.object == "response" and r.model == MODEL and r.id.startswith("resp_")
    assert r.output_text and r.usage.output_tokens == 8
    assert r.incomplete_details.reason == "max_output_tokens"


def test_responses_create_streamed_equals_not_streamed_at_temperature_0(stack):
    c = stack.client()
    full = c.responses.create(model=MODEL, input="Tell me about the river.", max_output_tokens=12, temperature=0)
    events = list(c.responses.create(model=MODEL, input="Tell me about the river.", max_output_tokens=12,
                                     temperature=0, stream=True))
    types = [e.type for e in events]
    assert types[0] == "response.created" and types[-1] in ("response.completed", "response.incomplete")
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert len(deltas) >= 1  # vLLM merges deltas its consumer has not taken yet (a busy box): how many is not fixed
    assert "".join(deltas) == full.output_text
    assert events[-1].response.output_text == full.output_text
    assert events[0].response.id.startswith("resp_")


def test_responses_retrieve_and_cancel_unknown_id_say_what_vllm_says(stack):
    """vLLM stores responses only with VLLM_ENABLE_RESPONSES_API_STORE=1 (off in `vllm serve` by
    default, and here): retrieval is vLLM's 404, routed to the replica named in the id."""
    r = stack.client().responses.create(model=MODEL, input="Hi", max_output_tokens=2)
    for call in (lambda c: c.responses.retrieve(r.id), lambda c: c.responses.cancel(r.id)):
        with pytest.raises(openai.NotFoundError) as e:
            call(stack.client())
        assert f"Response with id '{r.id}' not found." in e.value.message
    with pytest.raises(openai.NotFoundError) as e:  # vLLM's answer, not a gateway failure
        stack.client().responses.create(model=MODEL, input="Hi", max_output_tokens=2, previous_response_id=r.id)
    assert f"Response with id '{r.id}' not found." in e.value.message
    got = httpx.get(stack.url + "/v1/responses/resp_nosuchthing", timeout=30)
    assert got.status_code == 404
    assert got.json()["error"]["message"] == "Response with id 'resp_nosuchthing' not found."


def test_responses_refuses_what_vllm_refuses(stack):
    with pytest.raises(openai.BadRequestError) as e:
        stack.client().responses.create(model=MODEL, input="Hi", max_output_tokens=2, temperature=-1)
    assert e.value.status_code == 400 and "temperature" in e.value.message


# -- Anthropic's Messages API ------------------------------------------------------------------


def test_messages_create_not_streamed(stack):
    m = _anthropic(stack).messages.create(model=MODEL, max_tokens=8, messages=MSGS, extra_body={"temperature": 0})
    assert m.type == "message" and m.role == "assistant" and m.model == MODEL
    assert m.content[0].type == "text" and m.content[0].text
    assert m.stop_reason == "max_tokens" and m.usage.output_tokens == 8


def test_messages_create_streamed_equals_not_streamed_at_temperature_0(stack):
    client = _anthropic(stack)
    full = client.messages.create(model=MODEL, max_tokens=12, messages=MSGS, extra_body={"temperature": 0})
    with client.messages.stream(model=MODEL, max_tokens=12, messages=MSGS, extra_body={"temperature": 0}) as stream:
        pieces = list(stream.text_stream)
        final = stream.get_final_message()
    assert len(pieces) >= 1  # vLLM merges deltas its consumer has not taken yet (a busy box): how many is not fixed
    assert "".join(pieces) == full.content[0].text == final.content[0].text
    events = list(client.messages.create(model=MODEL, max_tokens=4, messages=MSGS, stream=True))
    assert events[0].type == "message_start" and events[-1].type == "message_stop"


def test_messages_count_tokens_equals_the_usage_of_the_same_messages(stack):
    client = _anthropic(stack)
    counted = client.messages.count_tokens(model=MODEL, messages=MSGS)
    used = client.messages.create(model=MODEL, max_tokens=1, messages=MSGS)
    assert counted.input_tokens == used.usage.input_tokens > 0


def test_messages_errors_have_anthropics_shape(stack):
    client = _anthropic(stack)
    with pytest.raises(anthropic.NotFoundError) as e:  # the gateway's own refusal
        client.messages.create(model="nope", max_tokens=4, messages=MSGS)
    assert e.value.body == {"type": "error", "error": {"type": "not_found_error", "message": e.value.body[
        "error"]["message"]}}
    assert "nope" in e.value.body["error"]["message"]
    with pytest.raises(anthropic.BadRequestError) as e:  # the engine's (vLLM's words)
        client.messages.create(model=MODEL, max_tokens=4, messages=[])
    assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "invalid_request_error"
    assert "empty conversation" in e.value.body["error"]["message"]
    bad = _post(stack, "/v1/messages", {"model": MODEL, "messages": MSGS})  # no max_tokens
    assert bad.status_code == 400 and bad.json()["type"] == "error"
    assert "max_tokens" in bad.json()["error"]["message"]


# -- tokenize, detokenize, version ------------------------------------------------------------------


def test_tokenize_round_trips_with_detokenize(stack):
    text = "Good software is simple."
    tok = _post(stack, "/tokenize", {"model": MODEL, "prompt": text, "add_special_tokens": False})
    assert tok.status_code == 200, tok.text
    body = tok.json()
    assert body["count"] == len(body["tokens"]) > 0 and body["max_model_len"] == 512
    back = _post(stack, "/detokenize", {"model": MODEL, "tokens": body["tokens"]})
    assert back.status_code == 200 and back.json() == {"prompt": text}
    chat = _post(stack, "/tokenize", {"model": MODEL, "messages": MSGS})
    assert chat.status_code == 200 and chat.json()["count"] > body["count"]  # the chat template's tokens


def test_tokenize_counts_what_completions_bills(stack):
    text = "Good software is simple."
    count = _post(stack, "/tokenize", {"model": MODEL, "prompt": text}).json()["count"]
    r = stack.client().completions.create(model=MODEL, prompt=text, max_tokens=1)
    assert r.usage.prompt_tokens == count


def test_detokenize_refuses_negative_ids_as_vllm_does(stack):
    r = _post(stack, "/detokenize", {"model": MODEL, "tokens": [-1]})
    assert r.status_code == 400
    assert "greater than or equal to 0" in r.json()["error"]["message"]


def test_version(stack):
    r = httpx.get(stack.url + "/version", timeout=10)
    assert r.status_code == 200 and r.json()["version"][0].isdigit()


def test_reset_prefix_cache_resets_vllms_and_the_batchers_caches(stack):
    """vLLM's POST /reset_prefix_cache (a `vllm serve` dev-mode route): through AsyncLLM on
    tiny-llama and through the diffusion loop; ``{"success": true}`` once no request holds cached
    blocks (vLLM answers false meanwhile: waited for, never assumed)."""
    from tests.waiting import wait_for

    _post(stack, "/v1/completions", {"model": MODEL, "prompt": "the river " * 20, "max_tokens": 2})
    answers = []

    def reset(params: dict) -> bool:
        r = httpx.post(stack.url + "/reset_prefix_cache", params=params, timeout=60)
        assert r.status_code == 200, r.text
        answers.append(r.json())
        return answers[-1]["success"] is True

    wait_for(lambda: reset({}), "every replica's prefix cache reset", timeout=60, interval=0.5)
    wait_for(lambda: reset({"model": MODEL}), "tiny-llama's prefix cache reset", timeout=60, interval=0.5)
    assert answers[-1]["replicas"] >= 1
    r = httpx.post(stack.url + "/reset_prefix_cache", params={"model": "missing"}, timeout=60)
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"


# -- Anthropic's Messages API on the diffusion model (issue 49: it was a 400) -----------------------

TOOL = {"name": "get_time", "description": "The time in a zone.", "input_schema": {
    "type": "object", "properties": {"tz": {"enum": ["UTC", "CET", "JST"]}}, "required": ["tz"],
    "additionalProperties": False}}


def _text(m) -> str:
    return "".join(b.text for b in m.content if b.type == "text")


def test_diffusion_messages_streamed_equals_not_streamed_at_temperature_0(stack):
    client = _anthropic(stack)
    full = client.messages.create(model=DIFFUSION, max_tokens=12, messages=MSGS, extra_body={"temperature": 0})
    assert full.type == "message" and full.model == DIFFUSION and full.content[0].type == "text"
    assert full.stop_reason in ("end_turn", "max_tokens") and 0 < full.usage.output_tokens <= 12
    with client.messages.stream(model=DIFFUSION, max_tokens=12, messages=MSGS, extra_body={"temperature": 0}) as stream:
        pieces = list(stream.text_stream)
        final = stream.get_final_message()
    assert "".join(pieces) == _text(full) == _text(final)
    assert (final.stop_reason, final.usage.input_tokens, final.usage.output_tokens) == \
        (full.stop_reason, full.usage.input_tokens, full.usage.output_tokens)


def test_diffusion_messages_stop_sequences_end_and_name_the_match(stack):
    from tests.texts import first_with_a_stop_string

    client = _anthropic(stack)
    i, text, stop = first_with_a_stop_string(lambda i: _text(client.messages.create(
        model=DIFFUSION, max_tokens=24, messages=[{"role": "user", "content": f"Tell me about river {i}."}],
        extra_body={"temperature": 0})))
    ask = {"model": DIFFUSION, "max_tokens": 24, "extra_body": {"temperature": 0}, "stop_sequences": [stop],
           "messages": [{"role": "user", "content": f"Tell me about river {i}."}]}
    cut = client.messages.create(**ask)
    assert (cut.stop_reason, cut.stop_sequence) == ("stop_sequence", stop)
    assert _text(cut) == text[:text.index(stop)]
    with client.messages.stream(**ask) as stream:
        final = stream.get_final_message()
    assert (final.stop_reason, final.stop_sequence, _text(final)) == ("stop_sequence", stop, _text(cut))


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("choice", [{"type": "any", "disable_parallel_tool_use": True},
                                    {"type": "tool", "name": "get_time"}])
def test_diffusion_messages_forced_tool_use_validates(stack, stream, choice):
    """``any`` and ``tool`` are constrained to vLLM's tool-call schema, whatever the model prefers
    (one call: the array is bounded), and answered as ``tool_use`` blocks."""
    client = _anthropic(stack)
    ask = {"model": DIFFUSION, "max_tokens": 600, "messages": MSGS, "tools": [TOOL], "tool_choice": choice}
    if stream:
        with client.messages.stream(**ask) as s:
            m = s.get_final_message()
    else:
        m = client.messages.create(**ask)
    uses = [b for b in m.content if b.type == "tool_use"]
    assert m.stop_reason == "tool_use" and len(uses) == 1
    assert uses[0].name == "get_time" and uses[0].input["tz"] in ("UTC", "CET", "JST") and uses[0].id


def test_diffusion_messages_thinking_and_tools_as_chat_serves_them(stack):
    """The shared stack's diffusion model has no parsers: ``tool_choice`` auto is a 400 naming it,
    as on chat; thinking switched by effort or off is served; a thinking budget is refused, named."""
    client = _anthropic(stack)
    for kw in ({"output_config": {"effort": "low"}, "thinking": {"type": "adaptive"}},
               {"thinking": {"type": "disabled"}}):
        m = client.messages.create(model=DIFFUSION, max_tokens=4, messages=MSGS, extra_body=kw)
        assert m.type == "message" and m.usage.output_tokens <= 4
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(model=DIFFUSION, max_tokens=2048, messages=MSGS,
                               thinking={"type": "enabled", "budget_tokens": 1024})
    assert e.value.body["type"] == "error" and "thinking.budget_tokens" in e.value.body["error"]["message"]
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(model=DIFFUSION, max_tokens=4, messages=MSGS, tools=[TOOL],
                               tool_choice={"type": "auto"})
    assert "tool_call_parser" in e.value.body["error"]["message"]


def test_diffusion_messages_count_tokens_equals_the_usage_of_the_same_messages(stack):
    client = _anthropic(stack)
    counted = client.messages.count_tokens(model=DIFFUSION, messages=MSGS, system="Be brief.")
    used = client.messages.create(model=DIFFUSION, max_tokens=1, messages=MSGS, system="Be brief.")
    assert counted.input_tokens == used.usage.input_tokens > 0


# -- temperature 0 without a seed: the same answer twice -----------------------------------------


@pytest.mark.parametrize("stream", [False, True])
def test_temperature_0_without_seed_is_deterministic(stack, stream):
    first, second = (stack.completion_text(MODEL, "Good software is", 24, stream, temperature=0) for _ in range(2))
    assert first == second and len(first) > 0


# -- errors the gateway answers itself, worded as vLLM words them ----------------------------------


@pytest.mark.parametrize("path", ["/v1/responses", "/v1/completions", "/tokenize"])
def test_unknown_model_is_vllms_404(stack, path):
    r = _post(stack, path, {"model": "nope", "input": "hi", "prompt": "hi"})
    assert r.status_code == 404 and r.json()["error"]["message"].startswith("The model `nope` does not exist.")


def test_seed_out_of_range_says_what_vllm_says(stack):
    r = _post(stack, "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 2, "seed": 2**64})
    assert r.status_code == 400
    assert "less than or equal to 9223372036854775807" in r.json()["error"]["message"]


def test_nested_negative_prompt_ids_say_what_vllm_says(stack):
    r = _post(stack, "/v1/completions", {"model": MODEL, "prompt": [[1, -5]], "max_tokens": 2})
    assert r.status_code == 400
    assert "greater than or equal to 0" in r.json()["error"]["message"]
