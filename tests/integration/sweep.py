"""The route sweep: every generating route sent to one model of a running stack, streamed and not,
with the official SDKs, each answer checked for a well-formed body or stream (issue 49).

Holds for any output a random model may give: nothing here asserts what the text says, only that
each route answers 200 with OpenAI's (or Anthropic's) shape, its stream ends as that API ends one,
and its usage adds up.
"""

from __future__ import annotations

import anthropic
import openai

MSGS = [{"role": "user", "content": "Tell me about the river."}]
FINISH = {"stop", "length", "tool_calls"}
TOOL = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                                         "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                        "required": ["city"]}}}


def _body(kw: dict, knobs: dict | None) -> dict:
    """``kw`` with ``knobs`` (extra body fields, e.g. a diffusion model's ``diffusion`` knobs) merged
    into its ``extra_body`` (the ``diffusion`` object field by field)."""
    if not knobs:
        return kw
    extra = dict(kw.get("extra_body") or {})
    for name, value in knobs.items():
        extra[name] = {**value, **extra.get(name, {})} if isinstance(value, dict) else extra.get(name, value)
    return {**kw, "extra_body": extra}


def _usage_adds_up(u, max_tokens: int) -> None:
    assert u.prompt_tokens > 0 and 0 <= u.completion_tokens <= max_tokens, u
    assert u.total_tokens == u.prompt_tokens + u.completion_tokens, u


def chat(client: openai.OpenAI, model: str, knobs: dict | None = None, **kw) -> None:
    kw = _body(kw, knobs)
    r = client.chat.completions.create(model=model, messages=MSGS, max_tokens=8, **kw)
    assert r.object == "chat.completion" and r.model == model and len(r.choices) == 1
    assert r.choices[0].message.role == "assistant" and r.choices[0].finish_reason in FINISH
    _usage_adds_up(r.usage, 8)
    chunks = list(client.chat.completions.create(model=model, messages=MSGS, max_tokens=8, stream=True,
                                                 stream_options={"include_usage": True}, **kw))
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] != []
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    _usage_adds_up(chunks[-1].usage, 8)


def completions(client: openai.OpenAI, model: str, prompt, stream: bool, max_tokens: int = 6,
                knobs: dict | None = None, **kw) -> list[str]:
    """One completion request (``prompt`` any of OpenAI's forms); the choices' texts."""
    kw = _body(kw, knobs)
    n = len(prompt) if isinstance(prompt, list) and isinstance(prompt[0], list | str) else 1
    if not stream:
        r = client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, **kw)
        assert r.object == "text_completion" and sorted(c.index for c in r.choices) == list(range(n))
        assert all(c.finish_reason in FINISH for c in r.choices)
        _usage_adds_up(r.usage, max_tokens * n)
        return [c.text for c in sorted(r.choices, key=lambda c: c.index)]
    texts, finished = [""] * n, set()
    chunks = list(client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, stream=True,
                                            stream_options={"include_usage": True}, **kw))
    for c in chunks:
        for ch in c.choices:
            texts[ch.index] += ch.text
            if ch.finish_reason is not None:
                assert ch.finish_reason in FINISH
                finished.add(ch.index)
    assert finished == set(range(n)) and chunks[-1].usage is not None and chunks[-1].choices == []
    return texts


def completion_forms(client: openai.OpenAI, model: str, token_ids: list[int], knobs: dict | None = None) -> None:
    """Completions: text, a list of texts, token ids, lists of token ids, and ``echo`` with
    ``logprobs`` (lm-eval's scoring request), streamed and not."""
    for stream in (False, True):
        completions(client, model, "Once upon a time", stream, knobs=knobs)
        completions(client, model, ["Once upon a time", "The river"], stream, knobs=knobs)
        completions(client, model, token_ids, stream, knobs=knobs)
        completions(client, model, [token_ids, token_ids[:2]], stream, knobs=knobs)
        (text,) = completions(client, model, "Once upon a time", stream, max_tokens=1, echo=True, logprobs=1,
                              temperature=0, knobs=knobs)
        assert text.startswith("Once upon a time"), text
    r = client.completions.create(model=model, prompt="Once upon a time", max_tokens=1, echo=True, logprobs=1,
                                  **_body({}, knobs))
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) >= 2 and lp.token_logprobs[0] is None  # the first: no context


def responses(client: openai.OpenAI, model: str, knobs: dict | None = None) -> None:
    kw = _body({}, knobs)
    r = client.responses.create(model=model, input="Tell me about the river.", max_output_tokens=8, **kw)
    assert r.object == "response" and r.status in ("completed", "incomplete") and isinstance(r.output_text, str)
    assert r.usage.input_tokens > 0 and r.usage.output_tokens <= 8
    events = list(client.responses.create(model=model, input="Tell me about the river.", max_output_tokens=8,
                                          stream=True, **kw))
    assert events[0].type == "response.created"
    assert events[-1].type in ("response.completed", "response.incomplete")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[-1].response.usage.input_tokens == r.usage.input_tokens


def messages(client: anthropic.Anthropic, model: str, **kw) -> None:
    m = client.messages.create(model=model, max_tokens=8, messages=MSGS, **kw)
    assert m.type == "message" and m.role == "assistant" and m.model == model and m.content
    assert m.stop_reason in ("end_turn", "max_tokens", "stop_sequence", "tool_use")
    assert m.usage.input_tokens > 0 and 0 <= m.usage.output_tokens <= 8
    with client.messages.stream(model=model, max_tokens=8, messages=MSGS, **kw) as stream:
        events = list(stream)
        final = stream.get_final_message()
    assert events[0].type == "message_start" and events[-1].type == "message_stop"
    assert final.stop_reason in ("end_turn", "max_tokens", "stop_sequence", "tool_use")
    assert final.usage.input_tokens == m.usage.input_tokens


def seed_canvas(client: openai.OpenAI, model: str, token_ids: list[int], knobs: dict | None = None) -> None:
    """The diffusion extension: a seed canvas with pinned positions, on chat and completions."""
    kw = _body({"extra_body": {"diffusion": {"seed_canvas": token_ids, "pinned": [0, len(token_ids) - 1]}}}, knobs)
    for stream in (False, True):
        completions(client, model, "Once upon a time", stream, **kw)
        if not stream:
            r = client.chat.completions.create(model=model, messages=MSGS, max_tokens=8, **kw)
            assert r.choices[0].finish_reason in FINISH
        else:
            chunks = list(client.chat.completions.create(model=model, messages=MSGS, max_tokens=8, stream=True,
                                                         **kw))
            assert any(c.choices and c.choices[0].finish_reason in FINISH for c in chunks)


def every_route(url: str, model: str, token_ids: list[int], diffusion: bool, tools: bool,
                knobs: dict | None = None) -> None:
    """The sweep on ``model``: chat, completions' forms, Responses, Anthropic Messages (``tools``:
    also with a tool and ``tool_choice`` auto, for a model with a tool parser), and on a
    diffusion model a pinned seed canvas. ``knobs``: extra body fields of the OpenAI routes (a
    model at DiffusionGemma's real shape on a CPU: fewer denoising steps); Messages takes none."""
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=900)
    claude = anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0, timeout=900)
    chat(client, model, knobs)
    completion_forms(client, model, token_ids, knobs)
    responses(client, model, knobs)
    messages(claude, model)
    messages(claude, model, stop_sequences=["the", "a"], extra_body={"temperature": 0.5})  # (the SDK dropped it)
    if tools:
        chat(client, model, knobs, tools=[TOOL], tool_choice="auto")
        messages(claude, model, tools=[{"name": "get_weather", "input_schema": TOOL["function"]["parameters"]}],
                 tool_choice={"type": "auto"})
    if diffusion:
        seed_canvas(client, model, token_ids, knobs)
