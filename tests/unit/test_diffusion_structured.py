"""``diffusion_plugin.api.structured``: a request's constraint read with vLLM's request models; every
malformed or unservable field is a 400 naming it (``TandemError``), never another exception."""

import json

import pytest

from diffusion_plugin.api.structured import resolve, tool_calls_from_text
from tandem_core.errors import TandemError

MSGS = [{"role": "user", "content": "hi"}]
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
    "a": {"type": "integer"}}}}}, {"type": "function", "function": {"name": "g"}}]


def chat(**kw) -> dict:
    return {"model": "m", "messages": MSGS, **kw}


@pytest.mark.parametrize("body, route, kind, param, tool_mode", [
    (chat(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}),
     "chat", "json", "response_format", None),
    (chat(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"},
                                                                  "strict": True}}),
     "chat", "json", "response_format", None),
    (chat(response_format={"type": "json_object"}), "chat", "json_object", "response_format", None),
    (chat(structured_outputs={"regex": "[a-z]+"}), "chat", "regex", "structured_outputs", None),
    (chat(structured_outputs={"choice": ["a", "b"]}), "chat", "grammar", "structured_outputs", None),
    (chat(structured_outputs={"grammar": 'root ::= "x"'}), "chat", "grammar", "structured_outputs", None),
    (chat(tools=TOOLS, tool_choice="required"), "chat", "json", "tools", "required"),
    (chat(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "g"}}), "chat", "json", "tools",
     "named"),
    ({"model": "m", "prompt": "x", "response_format": {"type": "json_object"}}, "completions", "json_object",
     "response_format", None),
    ({"model": "m", "input": "x", "text": {"format": {"type": "json_schema", "name": "x", "schema": {}}}},
     "responses", "json", "text", None),
    ({"model": "m", "input": "x", "tools": [{"type": "function", "name": "f", "parameters": {}}],
      "tool_choice": "required"}, "responses", "json", "tools", "required"),
])
def test_constraints_read_as_vllm_reads_them(body, route, kind, param, tool_mode):
    s = resolve(body, route)
    assert (s.kind, s.param, s.tool_mode) == (kind, param, tool_mode)


def test_no_constraint():
    assert resolve(chat(), "chat") is None
    assert resolve(chat(response_format={"type": "text"}), "chat") is None
    assert resolve(chat(tools=TOOLS, tool_choice="none"), "chat") is None


def test_required_schema_is_vllms_and_bounded_without_parallel_calls():
    schema = json.loads(resolve(chat(tools=TOOLS, tool_choice="required", parallel_tool_calls=False), "chat").spec)
    assert schema["type"] == "array" and schema["minItems"] == 1 and schema["maxItems"] == 1
    assert [b["properties"]["name"]["enum"] for b in schema["items"]["anyOf"]] == [["f"], ["g"]]


@pytest.mark.parametrize("body, param", [
    (chat(response_format={"type": "json_schema"}), "response_format"),
    (chat(response_format={"type": "nope"}), "response_format"),
    (chat(response_format="json"), "response_format"),
    (chat(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "integer",
                                                                                          "multipleOf": 2}}}),
     "response_format"),
    (chat(structured_outputs={"regex": "a", "choice": ["a"]}), "structured_outputs"),
    (chat(structured_outputs={"regex": "(unclosed"}), "structured_outputs"),
    (chat(structured_outputs={"choice": []}), "structured_outputs"),
    (chat(structured_outputs=[1, 2]), "structured_outputs"),
    (chat(tool_choice="required"), "tool_choice"),
    (chat(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "h"}}), "tool_choice"),
    (chat(tools=[{"type": "function"}], tool_choice="required"), "tools"),
    (chat(tools="x", tool_choice="required"), "tools"),
    (chat(tools=TOOLS, tool_choice=5), "tool_choice"),
])
def test_what_vllm_refuses_is_a_400_naming_the_field(body, param):
    with pytest.raises(TandemError) as e:
        resolve(body, "chat")
    assert e.value.status == 400 and e.value.param == param, (e.value.param, e.value.message)


def test_tool_calls_from_a_finished_or_cut_output():
    required = resolve(chat(tools=TOOLS, tool_choice="required"), "chat")
    calls = tool_calls_from_text('[{"name": "f", "parameters": {"a": 1}}, {"name": "g", "parameters": {}}]', required)
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [("f", {"a": 1}),
                                                                                                 ("g", {})]
    assert all(c["id"] and c["type"] == "function" for c in calls)
    assert tool_calls_from_text('[{"name": "f", "param', required) == []  # cut by max_tokens
    named = resolve(chat(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "f"}}), "chat")
    assert [c["function"] for c in tool_calls_from_text('{"a": 2}', named)] == [{"name": "f", "arguments": '{"a": 2}'}]
