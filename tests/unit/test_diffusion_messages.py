"""Anthropic's Messages API and completions on a diffusion model whose parsers are set (issue 49).

A scripted runner commits a Gemma 4 answer (a thinking channel, text, two tool calls) with the tiny
model's tokenizer, through the engine with vLLM's ``gemma4`` tool and reasoning parsers, as
``configs/default.yaml`` serves tiny-diffusiongemma:
- completions are answered as the model wrote them (vLLM parses no completion), on every prompt
  form, streamed or not (``echo`` + ``logprobs`` needs the real batcher's scores: the route sweep
  of ``tests/integration/test_default_config.py``);
- Messages gives ``thinking``, ``text`` and ``tool_use`` blocks, streamed equal to whole, with
  vLLM's stop reasons and usage; ``thinking`` and ``output_config.effort`` switch the template's
  thinking as vLLM's conversion does; ``count_tokens`` counts what the request is billed for.
"""

import json

import pytest
from transformers import AutoTokenizer

from tandem_core.errors import TandemError
from tests import scripted
from tests.scripted import ScriptRunner, payloads
from workers import tiny_models

PARSERS = {"tool_call_parser": "gemma4", "reasoning_parser": "gemma4"}
ANSWER = ('<|channel>thought\nLet me check.<channel|>Sure.'
          '<|tool_call>call:get_weather{city:<|"|>Paris<|"|>,days:3}<tool_call|>'
          '<|tool_call>call:get_time{tz:<|"|>UTC<|"|>}<tool_call|>')
CALLS = [("get_weather", {"city": "Paris", "days": 3}), ("get_time", {"tz": "UTC"})]
TOOLS = [{"name": "get_weather", "input_schema": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}},
         {"name": "get_time", "input_schema": {"type": "object", "properties": {"tz": {"type": "string"}}}}]
MSGS = [{"role": "user", "content": "Weather and time?"}]


@pytest.fixture(scope="module")
def tok():
    return AutoTokenizer.from_pretrained(tiny_models.build(tiny_models.TINY_DIFFUSIONGEMMA))


def script_of(tok, text=ANSWER):
    from workers.tiny_models.diffusiongemma import END_OF_TURN

    return tok(text, add_special_tokens=False).input_ids + [tok.convert_tokens_to_ids(END_OF_TURN)]


def serve(tok, calls, canvas=4, script=None, runner=None):
    return scripted.serve(tok, script_of(tok) if script is None else script, calls, canvas=canvas,
                          engine_args=PARSERS, runner=runner)


def message(**kw):
    return {"model": "m", "max_tokens": 200, "messages": MSGS, "tools": TOOLS, **kw}


def events(items) -> list[dict]:
    assert all(isinstance(x, str) for x in items), [x for x in items if not isinstance(x, str)]
    return [json.loads(x.split("data: ", 1)[1]) for x in items]


def blocks_of(evs: list[dict]) -> list[tuple]:
    """A Messages stream's content blocks, joined: (type, text or (name, input))."""
    out = {}
    for e in evs:
        if e["type"] == "content_block_start":
            out[e["index"]] = [e["content_block"]["type"], e["content_block"].get("name"), ""]
        elif e["type"] == "content_block_delta":
            d = e["delta"]
            out[e["index"]][2] += d.get("thinking") or d.get("text") or d.get("partial_json") or ""
    return [(t, (name, json.loads(acc)) if t == "tool_use" else acc) for t, name, acc in out.values()]


def whole_blocks(m: dict) -> list[tuple]:
    return [(b["type"], (b["name"], b["input"]) if b["type"] == "tool_use" else b.get("thinking", b.get("text")))
            for b in m["content"]]


@pytest.mark.parametrize("prompt", ["Once upon a time", ["Once upon", "a time"], [5, 6, 7], [[5, 6], [7, 8]]])
def test_completions_with_the_parsers_set_are_answered_as_written(tok, prompt):
    """The 500 of issue 49: a completion carries no tools, and the parsers are not applied to it."""
    body = {"model": "m", "prompt": prompt, "max_tokens": 200, "seed": 1}
    whole, streamed = serve(tok, [("completions", body), ("completions", {**body, "stream": True})])
    n = len(prompt) if isinstance(prompt[0], list | str) and not isinstance(prompt, str) else 1
    expected = tok.decode(script_of(tok)[:-1], skip_special_tokens=True)
    (answer,) = whole
    assert [c["text"] for c in answer["choices"]] == [expected] * n
    texts = [""] * n
    for p in payloads(streamed):
        for c in p["choices"]:
            texts[c["index"]] += c["text"]
    assert texts == [expected] * n


@pytest.mark.parametrize("canvas", [3, 5])
def test_messages_gives_thinking_text_and_tool_use_blocks_streamed_equal_to_whole(tok, canvas):
    body = message(output_config={"effort": "high"})
    (whole,), streamed = serve(tok, [("messages", body), ("messages", {**body, "stream": True})], canvas=canvas)
    expected = [("thinking", "Let me check."), ("text", "Sure."), *(("tool_use", c) for c in CALLS)]
    assert whole["type"] == "message" and whole["role"] == "assistant"
    assert whole_blocks(whole) == expected
    assert whole["stop_reason"] == "tool_use" and whole.get("stop_sequence") is None  # (dumped without nulls, as the AR lane)
    assert whole["usage"]["input_tokens"] > 0 and whole["usage"]["output_tokens"] > 0
    evs = events(streamed)
    assert evs[0]["type"] == "message_start" and evs[-1]["type"] == "message_stop"
    assert blocks_of(evs) == expected
    delta = next(e for e in evs if e["type"] == "message_delta")
    assert delta["delta"]["stop_reason"] == "tool_use"
    assert delta["usage"]["output_tokens"] == whole["usage"]["output_tokens"]
    assert delta["usage"]["input_tokens"] == whole["usage"]["input_tokens"]


@pytest.mark.parametrize("stream", [False, True])
def test_a_stop_sequence_ends_the_message_and_is_named(tok, stream):
    script = script_of(tok, "Hello there, river friend.")
    ((out, *rest),) = serve(tok, [("messages", message(tools=None, stop_sequences=["river"], stream=stream))],
                            script=script)
    if stream:
        evs = events([out, *rest])
        delta = next(e for e in evs if e["type"] == "message_delta")["delta"]
        assert blocks_of(evs) == [("text", "Hello there, ")]
        assert (delta["stop_reason"], delta["stop_sequence"]) == ("stop_sequence", "river")
    else:
        assert whole_blocks(out) == [("text", "Hello there, ")]
        assert (out["stop_reason"], out["stop_sequence"]) == ("stop_sequence", "river")


def test_max_tokens_is_the_stop_reason_when_the_answer_is_cut(tok):
    ((out,),) = serve(tok, [("messages", message(tools=None, max_tokens=3))], script=script_of(tok, "Hello there."))
    assert out["stop_reason"] == "max_tokens" and out["usage"]["output_tokens"] == 3


def test_thinking_switches_the_templates_thinking_as_vllms_conversion_does(tok):
    """``output_config.effort`` is vLLM's ``reasoning_effort`` (thinking on), with ``thinking:
    adaptive`` too; ``thinking: disabled`` is ``reasoning_effort: "none"`` (off); chat's
    ``reasoning_effort`` the same."""
    runner = ScriptRunner(script_of(tok, "Hi."), 4)
    serve(tok, [("messages", message(output_config={"effort": "low"})),
                ("messages", message(thinking={"type": "disabled"})),
                ("messages", message(thinking={"type": "adaptive"}, output_config={"effort": "high"})),
                ("messages", message()),
                ("chat", {"model": "m", "messages": MSGS, "max_tokens": 8, "reasoning_effort": "medium"}),
                ("chat", {"model": "m", "messages": MSGS, "max_tokens": 8, "reasoning_effort": "none"})],
          runner=runner)
    thinking = ["<|think|>" in tok.decode(p) for p in runner.prompts]
    assert thinking == [True, False, True, False, True, False]


def test_a_thinking_budget_is_a_400_naming_it(tok):
    """vLLM enforces ``budget_tokens`` (its ``thinking_token_budget``, a 400 there too without a
    reasoning config); the diffusion engine cannot cut a thinking short: refused, never ignored."""
    ((err,),) = serve(tok, [("messages", message(thinking={"type": "enabled", "budget_tokens": 1024},
                                                 max_tokens=2048))])
    assert isinstance(err, TandemError) and err.status == 400 and err.param == "thinking.budget_tokens"


@pytest.mark.parametrize("body, param", [
    ({"messages": MSGS}, "max_tokens"),
    ({"max_tokens": 8, "messages": MSGS, "frequency_penalty": 1}, None),  # vLLM's model ignores unknown fields
    ({"max_tokens": 8, "messages": [{"role": "user", "content": [{"type": "nope"}]}]}, "messages.content"),
])
def test_bad_messages_are_a_400_naming_the_field(tok, body, param):
    ((out,),) = serve(tok, [("messages", {"model": "m", **body})])
    if param is None:
        assert out["type"] == "message"
    else:
        assert isinstance(out, TandemError) and out.status == 400 and out.param.startswith(param), out


def test_count_tokens_equals_the_usage_of_the_same_request(tok):
    body = message(system="Be brief.")
    (counted,), (used,) = serve(tok, [("messages_count_tokens", {k: v for k, v in body.items() if k != "max_tokens"}),
                                      ("messages", body)])
    assert counted["input_tokens"] == used["usage"]["input_tokens"] > 0
