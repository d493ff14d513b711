"""Structured outputs and forced tool calls on the diffusion model, through the real stack with
the openai SDK: whatever the random model prefers, every output parses (strict ``json.loads``)
and validates, streamed or not, with n=1 and n=2."""

import json
import re

import jsonschema
import openai
import pytest

from tests.schemas import SCHEMAS

MODEL = "tiny-diffusiongemma"
MSGS = [{"role": "user", "content": "Fill the form."}]
FAST = {"diffusion": {"max_denoising_steps": 4}}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                         "days": {"type": "integer", "minimum": 1, "maximum": 7}},
        "required": ["city", "days"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"tz": {"enum": ["UTC", "CET", "JST"]}}, "required": ["tz"],
        "additionalProperties": False}}},
]
PARAMS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


def _texts(stack, stream: bool, n: int, **kw) -> tuple[list[str], list[str]]:
    """(texts, finish reasons) of the n choices."""
    c = stack.client()
    kw.setdefault("extra_body", FAST)
    if not stream:
        r = c.chat.completions.create(model=MODEL, messages=MSGS, n=n, seed=n, **kw)
        return [ch.message.content for ch in r.choices], [ch.finish_reason for ch in r.choices]
    texts, finish = [""] * n, [None] * n
    for chunk in c.chat.completions.create(model=MODEL, messages=MSGS, n=n, seed=n, stream=True, **kw):
        for ch in chunk.choices:
            texts[ch.index] += ch.delta.content or ""
            finish[ch.index] = ch.finish_reason or finish[ch.index]
    return texts, finish


@pytest.mark.parametrize("stream", [False, True])
def test_twenty_bounded_schemas_give_valid_json(stack, stream):
    failures = []
    for i, schema in enumerate(SCHEMAS):
        n = 1 + i % 2
        fmt = {"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": schema, "strict": i % 3 == 0}}
        texts, finish = _texts(stack, stream, n, max_tokens=600, response_format=fmt)
        for text, reason in zip(texts, finish, strict=True):
            try:
                jsonschema.validate(json.loads(text), schema)
                assert reason == "stop", reason  # the grammar ended the output
            except (ValueError, jsonschema.ValidationError, AssertionError) as e:
                failures.append(f"schema {i}: {e}: {text!r}")
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("stream", [False, True])
def test_json_object_regex_and_choice(stack, stream):
    # An object's strings are unbounded: a random model may still be inside one at max_tokens
    # (``length``); an output the grammar ended (``stop``) always parses.
    texts, finish = _texts(stack, stream, 2, max_tokens=400, response_format={"type": "json_object"})
    for text, reason in zip(texts, finish, strict=True):
        assert text.startswith("{") and reason in ("stop", "length"), (reason, text)
        assert reason == "length" or isinstance(json.loads(text), dict), text
    texts, _ = _texts(stack, stream, 1, max_tokens=64, extra_body={**FAST, "structured_outputs": {
        "regex": "(red|blue)-[0-9]{2,3}"}})
    assert re.fullmatch("(red|blue)-[0-9]{2,3}", texts[0]), texts
    texts, _ = _texts(stack, stream, 2, max_tokens=16, extra_body={**FAST, "structured_outputs": {
        "choice": ["alpha", "beta", "gamma"]}})
    assert set(texts) <= {"alpha", "beta", "gamma"}, texts


def test_completions_take_a_schema_too(stack):
    schema = SCHEMAS[0]
    r = stack.client().completions.create(model=MODEL, prompt="A person:", max_tokens=300, seed=3, extra_body={
        **FAST, "response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": schema}}})
    jsonschema.validate(json.loads(r.choices[0].text), schema)


def test_max_tokens_cuts_a_constrained_output_with_length(stack):
    texts, finish = _texts(stack, False, 1, max_tokens=3, response_format={
        "type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMAS[19]}})
    assert finish == ["length"]
    assert texts[0].startswith("{")


@pytest.mark.parametrize("stream", [False, True])
def test_tool_choice_required_answers_tool_calls_that_validate(stack, stream):
    c = stack.client()
    # One call at most (parallel_tool_calls false: vLLM's schema bounds the array), so any model ends it.
    kw = {"model": MODEL, "messages": MSGS, "tools": TOOLS, "tool_choice": "required", "max_tokens": 600, "seed": 5,
          "parallel_tool_calls": False, "extra_body": FAST}
    if not stream:
        choice = c.chat.completions.create(**kw).choices[0]
        calls = [(t.id, t.function.name, t.function.arguments) for t in choice.message.tool_calls]
        finish = choice.finish_reason
    else:
        by_index, finish = {}, None
        for chunk in c.chat.completions.create(stream=True, **kw):
            ch = chunk.choices[0]
            assert not ch.delta.content  # tool calls only
            for t in ch.delta.tool_calls or []:
                if t.index not in by_index:  # a call's first delta names it, as OpenAI clients need
                    assert t.id and t.type == "function" and t.function.name, t
                    by_index[t.index] = [t.id, t.function.name, ""]
                by_index[t.index][2] += t.function.arguments or ""
            finish = ch.finish_reason or finish
        calls = [tuple(v) for _, v in sorted(by_index.items())]
    assert calls and finish == "tool_calls"
    for call_id, name, arguments in calls:
        assert call_id and name in PARAMS
        jsonschema.validate(json.loads(arguments), PARAMS[name])


def test_a_named_tool_choice_calls_that_function(stack):
    choice = stack.client().chat.completions.create(
        model=MODEL, messages=MSGS, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_time"}},
        max_tokens=200, seed=2, extra_body=FAST).choices[0]
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_time" and choice.finish_reason == "stop"  # vLLM's (and OpenAI's) for named
    jsonschema.validate(json.loads(call.function.arguments), PARAMS["get_time"])


def test_what_cannot_be_served_is_a_400_naming_the_field(stack):
    c = stack.client()
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model=MODEL, messages=MSGS, tools=TOOLS, max_tokens=8)  # "auto": no tool parser
    assert e.value.body["param"] == "tool_choice"
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model=MODEL, messages=MSGS, tools=TOOLS, max_tokens=8,
                                  tool_choice={"type": "function", "function": {"name": "nope"}})
    assert e.value.body["param"] == "tool_choice"
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=8,
                                  extra_body={"structured_outputs": {"regex": "(unclosed"}})
    assert e.value.body["param"] == "structured_outputs"
    assert c.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=4, extra_body=FAST).choices  # serving on



@pytest.mark.parametrize("stream", [False, True])
def test_a_seed_canvas_with_a_structured_output_is_refused_on_every_route(stack, stream):
    """The grammar decides every token, so a seed canvas cannot be served with one: one rule for
    chat, completions and Responses, streamed or not."""
    c = stack.client()
    seeded = {"diffusion": {"seed_canvas": "{", "max_denoising_steps": 4}}
    fmt = {"type": "json_schema", "json_schema": {"name": "s", "schema": SCHEMAS[0]}}
    calls = [
        lambda: c.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=8, response_format=fmt,
                                          extra_body=seeded, stream=stream),
        lambda: c.completions.create(model=MODEL, prompt="A user:", max_tokens=8, stream=stream,
                                     extra_body={**seeded, "response_format": fmt}),
        lambda: c.responses.create(model=MODEL, input="A user:", max_output_tokens=8, stream=stream,
                                   text={"format": {"type": "json_schema", "name": "s", "schema": SCHEMAS[0]}},
                                   extra_body=seeded),
    ]
    for call in calls:
        with pytest.raises(openai.BadRequestError) as e:
            call()
        assert e.value.body["param"] == "diffusion.seed_canvas", e.value.body
    assert c.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=4, extra_body=FAST).choices  # serving on


# -- the Responses API ------------------------------------------------------------------------------

RESPONSE_TOOLS = [{"type": "function", **t["function"]} for t in TOOLS]


def test_responses_text_format_gives_valid_json(stack):
    schema = SCHEMAS[7]
    fmt = {"format": {"type": "json_schema", "name": "user", "schema": schema, "strict": True}}
    c = stack.client()
    r = c.responses.create(model=MODEL, input="A user:", max_output_tokens=400, text=fmt, extra_body=FAST)
    assert r.status == "completed"
    jsonschema.validate(json.loads(r.output_text), schema)
    events = list(c.responses.create(model=MODEL, input="A user:", max_output_tokens=400, text=fmt, extra_body=FAST,
                                     stream=True))
    streamed = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    jsonschema.validate(json.loads(streamed), schema)
    assert events[-1].type == "response.completed" and events[-1].response.output_text == streamed


@pytest.mark.parametrize("stream", [False, True])
def test_responses_required_tool_choice_gives_function_calls(stack, stream):
    c = stack.client()
    kw = {"model": MODEL, "input": "Weather in Paris?", "tools": RESPONSE_TOOLS, "tool_choice": "required",
          "parallel_tool_calls": False, "max_output_tokens": 600, "extra_body": FAST}
    if not stream:
        r = c.responses.create(**kw)
    else:
        events = list(c.responses.create(stream=True, **kw))
        added = [e for e in events if e.type == "response.output_item.added"]
        assert added and all(e.item.type == "function_call" and e.item.name and e.item.call_id for e in added)
        args = {}
        for e in events:
            if e.type == "response.function_call_arguments.delta":
                args[e.output_index] = args.get(e.output_index, "") + e.delta
        done = {e.output_index: e.arguments for e in events if e.type == "response.function_call_arguments.done"}
        assert done == args
        assert events[-1].type == "response.completed"
        r = events[-1].response
    calls = [item for item in r.output if item.type == "function_call"]
    assert calls and len(calls) == len(r.output)
    for call in calls:
        assert call.call_id and call.name in PARAMS and call.status == "completed"
        jsonschema.validate(json.loads(call.arguments), PARAMS[call.name])


def test_responses_follow_up_turn_with_the_function_output(stack):
    c = stack.client()
    first = c.responses.create(model=MODEL, input="Weather in Paris?", tools=RESPONSE_TOOLS,
                               tool_choice={"type": "function", "name": "get_weather"}, max_output_tokens=300,
                               extra_body=FAST)
    (call,) = first.output
    assert call.type == "function_call" and call.name == "get_weather"
    follow = c.responses.create(
        model=MODEL, tools=RESPONSE_TOOLS, tool_choice="none", max_output_tokens=24, extra_body=FAST,
        input=[{"role": "user", "content": "Weather in Paris?"},
               {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
               {"type": "function_call_output", "call_id": call.call_id, "output": '{"temp": 21}'}])
    assert follow.status in ("completed", "incomplete") and follow.output[0].type == "message"
    assert follow.usage.input_tokens > first.usage.input_tokens  # the call and its output are in the prompt


def test_responses_auto_tool_choice_needs_a_tool_parser(stack):
    with pytest.raises(openai.BadRequestError) as e:
        stack.client().responses.create(model=MODEL, input="hi", tools=RESPONSE_TOOLS, max_output_tokens=8)
    assert e.value.body["param"] == "tool_choice"
