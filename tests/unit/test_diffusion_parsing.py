"""``tool_choice: "auto"`` and reasoning through vLLM's ``gemma4`` parsers, on committed blocks.

A scripted runner commits a Gemma 4 answer (a thinking channel, text, two tool calls) a canvas at
a time with the tiny model's tokenizer, whose Gemma 4 markers are special tokens; the canvas
length moves the block boundaries, so some blocks hold several call boundaries and others cut a
marker's neighbourhood (``call:name{``, ``<|"|>``) in two. Whatever the cut, the stream's joined
deltas equal the whole answer, and both equal what the text says.
"""

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

from diffusion_plugin.api.chunks import ChoiceText
from diffusion_plugin.engine import DiffusionEngine
from tests import scripted
from tests.scripted import Adapter, ScriptRunner, payloads
from workers import tiny_models
from workers.tiny_models.diffusiongemma import END_OF_TURN, GEMMA4_TOKENS

PARSERS = {"tool_call_parser": "gemma4", "reasoning_parser": "gemma4"}
ANSWER = ('<|channel>thought\nLet me check.<channel|>Sure.'
          '<|tool_call>call:get_weather{city:<|"|>Paris<|"|>,days:3}<tool_call|>'
          '<|tool_call>call:get_time{tz:<|"|>UTC<|"|>}<tool_call|>')
REASONING, CONTENT = "Let me check.", "Sure."
CALLS = [("get_weather", {"city": "Paris", "days": 3}), ("get_time", {"tz": "UTC"})]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}},
         {"type": "function", "function": {"name": "get_time", "parameters": {
             "type": "object", "properties": {"tz": {"type": "string"}}}}}]
CANVASES = range(1, 9)
MSGS = [{"role": "user", "content": "Weather and time?"}]


@pytest.fixture(scope="module")
def tok():
    return AutoTokenizer.from_pretrained(tiny_models.build(tiny_models.TINY_DIFFUSIONGEMMA))


def serve(tok, script, canvas, calls, engine_args=PARSERS, runner=None):
    return scripted.serve(tok, script, calls, canvas=canvas, engine_args=engine_args, runner=runner)


def script_of(tok, text=ANSWER):
    return tok(text, add_special_tokens=False).input_ids + [tok.convert_tokens_to_ids(END_OF_TURN)]


def chat(**kw):
    return {"model": "m", "messages": MSGS, "tools": TOOLS, "max_tokens": 200, "seed": 1, **kw}


def joined_stream(items) -> dict:
    """A streamed choice's parts: reasoning, content, the calls (first entries checked), finish."""
    out = {"reasoning": "", "content": "", "calls": {}, "finish": None}
    for payload in payloads(items):
        for ch in payload["choices"]:
            delta = ch["delta"]
            out["reasoning"] += delta.get("reasoning") or ""
            out["content"] += delta.get("content") or ""
            for entry in delta.get("tool_calls", []):
                if entry["index"] not in out["calls"]:
                    assert entry["id"] and entry["type"] == "function" and entry["function"]["name"], entry
                    out["calls"][entry["index"]] = [entry["function"]["name"], ""]
                else:
                    assert "id" not in entry and "name" not in entry.get("function", {}), entry
                out["calls"][entry["index"]][1] += entry.get("function", {}).get("arguments") or ""
            out["finish"] = ch["finish_reason"] or out["finish"]
    return out


def test_the_blocks_hold_several_boundaries_or_cut_one(tok):
    """The inputs: with some canvas a block holds two or more markers (the end of one call and the
    start of the next); with another a call's head ``call:name{`` or a ``<|"|>`` pair is cut."""
    ids = script_of(tok)
    markers = set(tok.convert_tokens_to_ids(GEMMA4_TOKENS))
    several = cut = False
    for canvas in CANVASES:
        for b in range(0, len(ids), canvas):
            block = ids[b:b + canvas]
            several |= sum(t in markers for t in block) >= 2
            text_before, text_in = tok.decode(ids[:b]), tok.decode(ids[:b + canvas])
            cut |= any(text_before.endswith(p) for p in ("call:", "call:get_", "{city:", '<|"|>Par'))
            cut |= text_in.endswith("<|tool_call>")
    assert several and cut


@pytest.mark.parametrize("canvas", CANVASES)
def test_auto_tool_calls_and_reasoning_streamed_equal_the_whole_answer(tok, canvas):
    (whole,), streamed = serve(tok, script_of(tok), canvas, [("chat", chat()), ("chat", chat(stream=True))])
    choice = whole["choices"][0]
    message = choice["message"]
    assert (message["reasoning"], message["content"], choice["finish_reason"]) == (REASONING, CONTENT, "tool_calls")
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message["tool_calls"]] == CALLS
    assert all(c["id"] and c["type"] == "function" for c in message["tool_calls"])
    got = joined_stream(streamed)
    assert (got["reasoning"], got["content"], got["finish"]) == (REASONING, CONTENT, "tool_calls")
    assert [(name, json.loads(args)) for _, (name, args) in sorted(got["calls"].items())] == CALLS


@pytest.mark.parametrize("canvas", [3, 8])
def test_without_tools_reasoning_is_still_parsed_and_include_reasoning_false_drops_it(tok, canvas):
    script = script_of(tok, "<|channel>thought\nHmm.<channel|>Hello there.")
    body = {"model": "m", "messages": MSGS, "max_tokens": 50, "seed": 1}
    (whole,), streamed, (hidden,), hidden_stream = serve(tok, script, canvas, [
        ("chat", body), ("chat", {**body, "stream": True}), ("chat", {**body, "include_reasoning": False}),
        ("chat", {**body, "include_reasoning": False, "stream": True})])
    message = whole["choices"][0]["message"]
    assert (message["reasoning"], message["content"], whole["choices"][0]["finish_reason"]) == \
        ("Hmm.", "Hello there.", "stop")
    assert "tool_calls" not in message
    got = joined_stream(streamed)
    assert (got["reasoning"], got["content"], got["finish"]) == ("Hmm.", "Hello there.", "stop")
    assert hidden["choices"][0]["message"]["reasoning"] is None
    assert hidden["choices"][0]["message"]["content"] == "Hello there."
    got = joined_stream(hidden_stream)
    assert (got["reasoning"], got["content"]) == ("", "Hello there.")


def test_tool_choice_none_makes_no_tool_calls(tok):
    (whole,), streamed = serve(tok, script_of(tok), 4, [("chat", chat(tool_choice="none")),
                                                        ("chat", chat(tool_choice="none", stream=True))])
    choice = whole["choices"][0]
    assert "tool_calls" not in choice["message"] and choice["finish_reason"] == "stop"
    assert choice["message"]["content"] == CONTENT  # vLLM's parser drops the calls the model wrote anyway
    got = joined_stream(streamed)
    assert not got["calls"] and got["finish"] == "stop" and got["content"] == CONTENT


def test_the_template_gets_tools_thinking_and_past_calls_in_gemma4_format(tok):
    runner = ScriptRunner(script_of(tok), 4)
    past = [*MSGS, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_time", "arguments": '{"tz": "UTC"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "12:00"}]
    serve(tok, None, 4, [("chat", chat(messages=past, chat_template_kwargs={"enable_thinking": True}))],
          runner=runner)
    prompt = tok.decode(runner.prompts[0])
    assert prompt.startswith("<|turn>system\n<|think|>\n<|tool>declaration:get_weather{")
    assert '<|turn>model\n<|tool_call>call:get_time{tz:<|"|>UTC<|"|>}<tool_call|>' \
        '<|tool_response>response:get_time{value:<|"|>12:00<|"|>}<tool_response|>' in prompt
    assert prompt.endswith("<tool_response|>")  # the model continues its turn after a tool result


def test_responses_auto_gives_reasoning_message_and_function_call_items(tok):
    body = {"model": "m", "input": "Weather and time?", "max_output_tokens": 200, "seed": 1,
            "tools": [{"type": "function", **t["function"]} for t in TOOLS]}
    (whole,), streamed = serve(tok, script_of(tok), 5, [("responses", body), ("responses", {**body, "stream": True})])

    def summary(items):
        return [(i["type"], i["content"][0]["text"] if i["type"] != "function_call" else
                 (i["name"], json.loads(i["arguments"]))) for i in items]

    expected = [("reasoning", REASONING), ("message", CONTENT), ("function_call", CALLS[0]),
                ("function_call", CALLS[1])]
    assert summary(whole["output"]) == expected and whole["status"] == "completed"
    events = [json.loads(e.split("data: ", 1)[1]) for e in streamed if isinstance(e, str)]
    done = [e["item"] for e in events if e["type"] == "response.output_item.done"]
    assert summary(sorted(done, key=lambda i: [d["id"] for d in events[-1]["response"]["output"]].index(i["id"]))) \
        == expected
    assert summary(events[-1]["response"]["output"]) == expected
    deltas = "".join(e["delta"] for e in events if e["type"] == "response.reasoning_text.delta")
    assert deltas == REASONING
    assert [e["sequence_number"] for e in events] == list(range(len(events)))


def test_a_parser_name_vllm_does_not_know_fails_the_start(tok):
    engine = DiffusionEngine("m", "unused", {"tool_call_parser": "no-such-parser"})
    with pytest.raises(ValueError, match="engine_args.tool_call_parser"):
        engine.start_with(Adapter(tok, 4), ScriptRunner([0], 4), memory=None)


def test_auto_without_a_tool_parser_is_a_400_naming_tool_choice(tok):
    (items,) = serve(tok, script_of(tok), 4, [("chat", chat())], engine_args={"reasoning_parser": "gemma4"})
    assert items[0].param == "tool_choice" and "tool_call_parser" in items[0].message


@settings(max_examples=150, deadline=None)
@given(st.lists(st.one_of(st.integers(0, 1038), st.sampled_from([264, 300, 1029, 1030, 1035])), max_size=40),
       st.integers(1, 7))
def test_raw_text_releases_whole_tokens_with_their_ids(tok, ids, canvas):
    """Raw mode (a parser reads the text): every release is whole tokens and their exact text, so
    the released ids, decoded with special tokens, are the released text at every block."""
    text = ChoiceText(tok, [], raw=True)
    sent_ids, sent_text = [], ""
    for b in range(0, len(ids), canvas):
        out = text.add(ids[b:b + canvas])
        sent_ids += out.ids
        sent_text += out.text
        assert tok.decode(sent_ids, skip_special_tokens=False) == sent_text
    rest = text.flush()
    assert sent_ids + rest.ids == ids and sent_text + rest.text == tok.decode(ids, skip_special_tokens=False)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.one_of(st.integers(6, 300), st.sampled_from([1029, 1031, 1032, 1035])), min_size=1, max_size=30),
       st.integers(1, 7), st.integers(0, 29), st.integers(1, 3))
def test_raw_text_with_a_stop_string_releases_the_text_before_it(tok, ids, canvas, at, length):
    """A stop string cut from the raw text itself: the released text is the text before it, and
    the released ids are the tokens up to the one it starts in."""
    full = tok.decode(ids, skip_special_tokens=False)
    stop = full[min(at, len(full) - 1):][:length]
    if not stop or "\ufffd" in stop:
        return
    text = ChoiceText(tok, [stop], raw=True)
    sent_ids, sent_text = [], ""
    for b in range(0, len(ids), canvas):
        out = text.add(ids[b:b + canvas])
        sent_ids += out.ids
        sent_text += out.text
        if out.stopped:
            break
    rest = text.flush()
    sent_ids += rest.ids
    sent_text += rest.text
    assert sent_text == full[:full.find(stop)]
    assert sent_ids == ids[:len(sent_ids)]
    # (a token may straddle the stop's start: the ids end before it, their text then short of a
    # character, ending in a partial byte)
    decoded = tok.decode(sent_ids, skip_special_tokens=False)
    assert decoded.startswith(sent_text) or sent_text.startswith(decoded.rstrip("\ufffd"))
