"""A scripted runner commits a chosen token sequence a canvas at a time (the tiny models' real
byte-level tokenizer), so the inputs are built, not sampled:

- logprobs of committed tokens whose characters are split across tokens and across blocks: the
  streamed answer's logprobs, joined, equal the whole answer's (completions and chat), and a
  token's string, bytes and offset are what ``diffusion_plugin.api.token_text`` says (``Ѣ`` and
  ``€`` are several tokens each; the script is shifted so split characters fall inside a block
  and across a block boundary);
- tool calls streamed from blocks that hold several call boundaries or half of one.
"""

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

from diffusion_plugin.api.token_text import TextOffsets, token_bytes
from tests import scripted
from tests.scripted import payloads
from workers import tiny_models
from workers.tiny_models.diffusiongemma import END_OF_TURN

CANVAS = 4
TEXT = "ab Ѣ€ c€dѢ"


@pytest.fixture(scope="module")
def tok():
    return AutoTokenizer.from_pretrained(tiny_models.build(tiny_models.TINY_DIFFUSIONGEMMA))


def serve(tok, script, calls):
    return scripted.serve(tok, script, calls, canvas=CANVAS)


def shifted(tok, shift):
    """``shift`` one-byte tokens, then TEXT's tokens: the split characters move across blocks."""
    return tok("x" * shift, add_special_tokens=False).input_ids + tok(TEXT, add_special_tokens=False).input_ids


def straddles(tok, ids) -> bool:
    """Whether some character's tokens lie in two blocks."""
    return any(tok.decode(ids[:b]).endswith("\ufffd") for b in range(CANVAS, len(ids), CANVAS))


def test_the_inputs_split_characters_inside_and_across_blocks(tok):
    ids = tok(TEXT, add_special_tokens=False).input_ids
    assert len(ids) > len(TEXT)  # some character is several tokens
    assert any(straddles(tok, shifted(tok, s)) for s in range(CANVAS))
    assert any(tok.decode([i]) == "\ufffd" for i in ids)


@pytest.mark.parametrize("shift", range(CANVAS))
def test_completions_streamed_logprobs_equal_the_whole_answers(tok, shift):
    script = shifted(tok, shift)
    body = {"model": "m", "prompt": "p", "max_tokens": len(script), "logprobs": 2, "seed": 1}
    (whole,), streamed = serve(tok, script, [("completions", body), ("completions", {**body, "stream": True})])
    choice = whole["choices"][0]
    assert choice["text"] == "x" * shift + TEXT and choice["finish_reason"] == "length"
    lp = choice["logprobs"]
    joined = {key: [v for c in payloads(streamed) for ch in c["choices"] if ch["logprobs"]
                    for v in ch["logprobs"][key]] for key in lp}
    assert joined == lp
    # The definitions: a token decoded alone; the offset of the character holding its first byte.
    assert lp["tokens"] == [tok.decode([t]) for t in script]
    assert lp["text_offset"] == [len(tok.decode(script[:i]).rstrip("\ufffd")) for i in range(len(script))]
    text_bytes = choice["text"].encode()
    at = 0
    for t, offset in zip(script, lp["text_offset"], strict=True):
        assert len(choice["text"][:offset].encode()) <= at < len(choice["text"][:offset + 1].encode())
        at += len(token_bytes(tok, t))
    assert at == len(text_bytes)
    assert lp["token_logprobs"] == [max(top.values()) for top in lp["top_logprobs"]]


@pytest.mark.parametrize("shift", range(CANVAS))
def test_chat_streamed_logprobs_equal_the_whole_answers_and_bytes_join_to_the_text(tok, shift):
    script = shifted(tok, shift)
    body = {"model": "m", "messages": [{"role": "user", "content": "p"}], "max_tokens": len(script),
            "logprobs": True, "top_logprobs": 2, "seed": 1}
    (whole,), streamed = serve(tok, script, [("chat", body), ("chat", {**body, "stream": True})])
    choice = whole["choices"][0]
    content = choice["logprobs"]["content"]
    joined = [e for c in payloads(streamed) for ch in c["choices"] if ch["logprobs"] for e in ch["logprobs"]["content"]]
    assert joined == content and len(content) == len(script)
    assert bytes(b for e in content for b in e["bytes"]) == choice["message"]["content"].encode()
    assert "".join(ch["delta"].get("content", "") for c in payloads(streamed) for ch in c["choices"]) == \
        choice["message"]["content"] == "x" * shift + TEXT
    assert all(e["top_logprobs"][0]["logprob"] == e["logprob"] and len(e["top_logprobs"]) == 2 for e in content)


@pytest.mark.parametrize("stop", ["€d", "c€", "Ѣ€"])
def test_a_stop_string_after_a_split_character_keeps_the_tokens_before_it(tok, stop):
    script = shifted(tok, 1)
    body = {"model": "m", "prompt": "p", "max_tokens": len(script), "logprobs": 1, "seed": 1}
    (whole,), (cut,), streamed = serve(tok, script, [("completions", body), ("completions", {**body, "stop": stop}),
                                                     ("completions", {**body, "stop": stop, "stream": True})])
    full, lp = whole["choices"][0]["logprobs"], cut["choices"][0]["logprobs"]
    text = cut["choices"][0]["text"]
    assert text == ("x" + TEXT)[:("x" + TEXT).index(stop)] and cut["choices"][0]["finish_reason"] == "stop"
    n = len(lp["tokens"])
    assert lp["tokens"] == full["tokens"][:n] and lp["text_offset"] == full["text_offset"][:n]
    assert all(o < len(text) for o in lp["text_offset"]) and full["text_offset"][n] >= len(text)
    joined = {key: [v for c in payloads(streamed) for ch in c["choices"] if ch["logprobs"]
                    for v in ch["logprobs"][key]] for key in lp}
    assert joined == lp


@settings(max_examples=200, deadline=None)
@given(st.lists(st.one_of(st.integers(0, 1038), st.integers(6, 300)), max_size=40))
def test_offsets_are_a_function_of_the_tokens_before(tok, ids):
    """Any token sequence (invalid UTF-8, special tokens, image tokens): the incremental offsets
    equal the definition, and the tokens' bytes join to the text."""
    offsets = TextOffsets(tok)
    assert [offsets.push(t) for t in ids] == \
        [len(tok.decode(ids[:i], skip_special_tokens=True).rstrip("\ufffd")) for i in range(len(ids))]
    special = {i for i, t in tok.added_tokens_decoder.items() if t.special}  # the text skips them
    joined = bytes(b for t in ids if t not in special for b in token_bytes(tok, t))
    assert joined.decode("utf-8", errors="replace") == tok.decode(ids, skip_special_tokens=True)


# -- tool calls streamed from committed blocks (the same scripted runner) --------------------------

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}},
         {"type": "function", "function": {"name": "get_time", "parameters": {
             "type": "object", "properties": {"tz": {"type": "string"}}}}}]
CALLS = ('[{"name": "get_weather", "parameters": {"city": "Paris", "days": 3}}, '
         '{"name": "get_time", "parameters": {"tz": "UTC"}}, {"name": "get_time", "parameters": {"tz": "JST"}}]')


@pytest.mark.parametrize("shift", range(CANVAS))
def test_streamed_tool_calls_across_blocks_equal_the_whole_answers(tok, shift):
    """Blocks of 4 tokens over a 3-call array: some blocks hold several call boundaries, others
    cut a boundary in two; whatever the cut, each call's first delta names it (id, type,
    function.name), the joined arguments are its arguments, and the stream equals the whole."""
    script = tok(" " * shift + CALLS, add_special_tokens=False).input_ids
    eos = tok.convert_tokens_to_ids(END_OF_TURN)
    body = {"model": "m", "messages": [{"role": "user", "content": "p"}], "tools": TOOLS, "tool_choice": "required",
            "max_tokens": len(script) + 1, "seed": 1}
    (whole,), streamed = serve(tok, script + [eos], [("chat", body), ("chat", {**body, "stream": True})])
    choice = whole["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] == ""
    expected = [(c["name"], c["parameters"]) for c in json.loads(CALLS)]
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in choice["message"]["tool_calls"]] \
        == expected
    calls, finish = {}, None
    for payload in payloads(streamed):
        for ch in payload["choices"]:
            assert not ch["delta"].get("content")
            for entry in ch["delta"].get("tool_calls", []):
                if entry["index"] not in calls:
                    assert entry["id"] and entry["type"] == "function" and entry["function"]["name"], entry
                    calls[entry["index"]] = [entry["function"]["name"], ""]
                calls[entry["index"]][1] += entry["function"].get("arguments") or ""
            finish = ch["finish_reason"] or finish
    assert [(name, json.loads(args)) for _, (name, args) in sorted(calls.items())] == expected
    assert finish == "tool_calls"


# -- completions' prompt forms, usage and vLLM's rules (the same scripted runner) ----------------


@pytest.mark.parametrize("stream", [False, True])
def test_completions_take_every_prompt_form_with_choices_indexed_as_vllm(tok, stream):
    """A string, a list of strings, token ids and a list of token-id lists; prompt p's choice i is
    choice p * n + i, and the prompt tokens count each prompt once."""
    script = tok("hello there", add_special_tokens=False).input_ids
    forms = {"one": "ab", "strings": ["ab", "cd e", "f"], "ids": [40, 41, 42], "id lists": [[40, 41], [42]]}
    lengths = {"one": [len(tok("ab").input_ids)], "strings": [len(tok(p).input_ids) for p in ("ab", "cd e", "f")],
               "ids": [3], "id lists": [2, 1]}
    for name, prompt in forms.items():
        body = {"model": "m", "prompt": prompt, "n": 2, "max_tokens": 4, "seed": 1, "stream": stream,
                **({"stream_options": {"include_usage": True}} if stream else {})}
        (items,) = serve(tok, script, [("completions", body)])
        if stream:
            chunks = payloads(items)
            indexes = {ch["index"] for c in chunks for ch in c["choices"]}
            usage = chunks[-1]["usage"]
        else:
            indexes = {ch["index"] for ch in items[0]["choices"]}
            usage = items[0]["usage"]
        assert indexes == set(range(2 * len(lengths[name]))), (name, indexes)
        assert usage["prompt_tokens"] == sum(lengths[name]), (name, usage)


@pytest.mark.parametrize("body, param, words", [
    ({"prompt": [40, 99999]}, "prompt", "out of vocabulary"),
    ({"prompt": []}, "prompt", "cannot be empty"),
    ({"prompt": ["a", ""]}, "prompt", "cannot be empty"),
    ({"prompt": "a", "stream_options": {"include_usage": True}}, "stream_options", "only be defined when `stream=True`"),
    ({"prompt": "a", "n": 2, "temperature": 0}, "n", "n must be 1 when using greedy sampling, got 2."),
    ({"prompt": "a", "n": 0}, "n", "n must be at least 1, got 0."),
    ({"prompt": "a", "n": 17}, "n", "n must be at most 16, got 17."),
    ({"prompt": "a", "seed": -2**63 - 1}, "seed", "[type=greater_than_equal]"),
    ({"prompt": "a", "top_k": -2}, "top_k", "top_k must be 0 (disable), or at least 1, got -2."),
])
def test_completions_refusals_name_the_field(tok, body, param, words):
    (items,) = serve(tok, [40], [("completions", {"model": "m", "max_tokens": 2, **body})])
    err = items[0]
    assert err.param == param and words in err.message, err


def test_chat_usage_counts_the_prompt_once_whatever_n(tok):
    body = {"model": "m", "messages": [{"role": "user", "content": "p"}], "max_tokens": 4, "seed": 1}
    (one,), (two,) = serve(tok, [40, 41, 42, 43], [("chat", body), ("chat", {**body, "n": 2})])
    assert one["usage"]["prompt_tokens"] == two["usage"]["prompt_tokens"] > 0
    assert two["usage"]["completion_tokens"] == 2 * one["usage"]["completion_tokens"]
