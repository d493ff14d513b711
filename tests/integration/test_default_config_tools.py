"""``tool_choice: "auto"`` and reasoning on the diffusion model through vLLM's ``gemma4`` parsers,
on the real stack: ``tiny-diffusiongemma`` with ``tool_call_parser`` and ``reasoning_parser`` set,
as the shipped default config sets them (the session's ``default_stack``, which
``test_default_config.py`` starts; the shared stack's diffusion model has no parser).

A random model never writes a Gemma 4 tool call by itself, so each request that needs one adds
vLLM's ``structured_outputs.structural_tag``: Gemma 4's markers as tokens (xgrammar's ``token``
format: the special token itself, which the streaming parser needs) around bounded arguments.
Whatever the model fills in, every answer then holds the forced calls, streamed or not, with
n=1 and n=2, on chat, Responses and the OpenAI Agents SDK."""

import json
import re
from typing import Annotated

import jsonschema
import pytest
from pydantic import Field

from tests.agents_sdk import run_agent
from tests.integration.stack import REPO

MODEL = "tiny-diffusiongemma"
FAST = {"diffusion": {"max_denoising_steps": 4}}
Q = '<|"|>'
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "pattern": "^[A-Za-z]{1,8}$"},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                           "parameters": WEATHER}}]


def _token(text: str) -> dict:
    """xgrammar's ``token`` format by id (vLLM validates a structural tag without the tokenizer,
    so a token named by its string is refused, on ``vllm serve`` too)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(REPO / "models" / MODEL)
    return {"type": "token", "token": tok.convert_tokens_to_ids(text)}


def _call() -> dict:
    """One Gemma 4 call of get_weather, its arguments bounded: city (1-8 letters) and days (1-7)."""
    return {"type": "sequence", "elements": [
        _token("<|tool_call>"), {"type": "const_string", "value": "call:get_weather{city:"},
        _token(Q), {"type": "regex", "pattern": "[A-Za-z]{1,8}"}, _token(Q),
        {"type": "const_string", "value": ",days:"}, {"type": "regex", "pattern": "[1-7]"},
        {"type": "const_string", "value": "}"}, _token("<tool_call|>")]}


def _forced(*elements) -> dict:
    return {**FAST, "structured_outputs": {"structural_tag": json.dumps(
        {"type": "structural_tag", "format": {"type": "sequence", "elements": list(elements)}})}}


def _think_then_two_calls() -> dict:
    return _forced(_token("<|channel>"), {"type": "const_string", "value": "thought\n"},
                   {"type": "regex", "pattern": "[a-z]{1,6}"}, _token("<channel|>"),
                   {"type": "regex", "pattern": "[a-z]{1,6}"}, _call(), _call())


@pytest.fixture(scope="module")
def tools_stack(default_stack):
    """The shipped default config's stack (``conftest.py``): its diffusion model has both gemma4
    parsers, and a stack of its own would cost a start for nothing."""
    model = next(m for m in default_stack.config["models"] if m["name"] == MODEL)
    assert {"tool_call_parser": "gemma4", "reasoning_parser": "gemma4"}.items() <= model["engine_args"].items()
    return default_stack


def _check_calls(calls: list[tuple[str, str]], n: int) -> None:
    assert len(calls) == n, calls
    for name, arguments in calls:
        assert name == "get_weather"
        jsonschema.validate(json.loads(arguments), WEATHER)


@pytest.mark.parametrize("n", [1, 2])
def test_chat_auto_gives_reasoning_and_the_calls_streamed_or_not(tools_stack, n):
    c = tools_stack.client()
    kw = {"model": MODEL, "messages": [{"role": "user", "content": "Weather in two cities?"}], "tools": TOOLS,
          "tool_choice": "auto", "max_tokens": 120, "n": n, "seed": 5, "extra_body": _think_then_two_calls()}
    r = c.chat.completions.create(**kw)
    for ch in r.choices:
        assert ch.finish_reason == "tool_calls", ch
        assert re.fullmatch("[a-z]{1,6}", ch.message.reasoning) and re.fullmatch("[a-z]{1,6}", ch.message.content)
        _check_calls([(t.function.name, t.function.arguments) for t in ch.message.tool_calls], 2)
    reasoning, content, calls, finish = [""] * n, [""] * n, [{} for _ in range(n)], [None] * n
    for chunk in c.chat.completions.create(**kw, stream=True):
        for ch in chunk.choices:
            i = ch.index
            reasoning[i] += getattr(ch.delta, "reasoning", None) or ""
            content[i] += ch.delta.content or ""
            for t in ch.delta.tool_calls or []:
                if t.index not in calls[i]:  # a call's first delta names it
                    assert t.id and t.type == "function" and t.function.name, t
                    calls[i][t.index] = [t.function.name, ""]
                calls[i][t.index][1] += t.function.arguments or ""
            finish[i] = ch.finish_reason or finish[i]
    for i in range(n):
        assert finish[i] == "tool_calls"
        assert re.fullmatch("[a-z]{1,6}", reasoning[i]) and re.fullmatch("[a-z]{1,6}", content[i])
        _check_calls([tuple(v) for _, v in sorted(calls[i].items())], 2)


def test_chat_auto_without_a_call_is_text_and_a_follow_up_turn_renders(tools_stack):
    c = tools_stack.client()
    msgs = [{"role": "user", "content": "Weather in Paris?"}]
    first = c.chat.completions.create(model=MODEL, messages=msgs, tools=TOOLS, max_tokens=60, seed=1,
                                      extra_body=_forced(_call()))
    call = first.choices[0].message.tool_calls[0]
    msgs += [first.choices[0].message.model_dump(exclude_none=True),
             {"role": "tool", "tool_call_id": call.id, "content": "sunny"}]
    # A plain answer (no call forced): whatever the model writes, the answer is well formed.
    r = c.chat.completions.create(model=MODEL, messages=msgs, tools=TOOLS, max_tokens=40, seed=2, extra_body=FAST)
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert r.usage.prompt_tokens > first.usage.prompt_tokens


@pytest.mark.parametrize("stream", [False, True])
def test_responses_auto_gives_reasoning_and_function_call_items(tools_stack, stream):
    c = tools_stack.client()
    kw = {"model": MODEL, "input": "Weather in two cities?", "max_output_tokens": 120,
          "tools": [{"type": "function", "name": "get_weather", "parameters": WEATHER}],
          "extra_body": {**_think_then_two_calls(), "seed": 3}}
    if stream:
        with c.responses.stream(**kw) as events:
            kinds = [e.type for e in events]
            r = events.get_final_response()
        assert "response.reasoning_text.delta" in kinds and "response.function_call_arguments.delta" in kinds
    else:
        r = c.responses.create(**kw)
    assert [item.type for item in r.output] == ["reasoning", "message", "function_call", "function_call"]
    assert re.fullmatch("[a-z]{1,6}", r.output[0].content[0].text)
    _check_calls([(item.name, item.arguments) for item in r.output[2:]], 2)
    follow = c.responses.create(model=MODEL, max_output_tokens=20, extra_body={**FAST, "seed": 4},
                                tools=kw["tools"], input=[
                                    {"role": "user", "content": "Weather in two cities?"},
                                    *[item.model_dump(exclude_none=True) for item in r.output],
                                    *[{"type": "function_call_output", "call_id": item.call_id, "output": "sunny"}
                                      for item in r.output[2:]]])
    assert follow.status in ("completed", "incomplete") and follow.usage.input_tokens > r.usage.input_tokens


@pytest.mark.parametrize("api", ["chat", "responses"])
def test_openai_agents_sdk_with_auto_tool_choice(tools_stack, api):
    calls = []

    def get_weather(city: Annotated[str, Field(pattern="^[A-Za-z]{1,8}$")],
                    days: Annotated[int, Field(ge=1, le=7)]) -> str:
        """The weather in a city for the next days."""
        calls.append((city, days))
        return f"sunny in {city} for {days} days"

    run_agent(tools_stack.url, MODEL, api, get_weather, max_tokens=80, extra_body=_forced(_call()))
    assert len(calls) == 1 and re.fullmatch("[A-Za-z]{1,8}", calls[0][0]) and 1 <= calls[0][1] <= 7
