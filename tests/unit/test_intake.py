"""The body read once (gateway/request/intake.py): the record's sizes, depth, estimate and session key
against the functions that walked the body before (kept below as the oracle), and the gateway
walking a request's body once before it asks for a slot."""

import json
import math
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import gateway.http.generate as generate_module
import gateway.serving.serve as serve_module
from gateway.request.intake import DEFAULT_MAX_OUTPUT_TOKENS, parse_json, take_in
from gateway.request.limits import check_limits, estimate_tokens
from gateway.routing.router import request_cost
from tandem_core.config import LimitsConfig
from tandem_core.errors import LimitExceeded, TandemError
from tests.unit.gateway_server import fake_gateway

# ---------------------------------------------------------------- the oracle: the walks before intake
# A copy of gateway/request/limits.py and gateway/http/generate.py as they were (commit ceef3d2).


def old_content_chars(content: Any) -> int:
    if isinstance(content, str):
        return len(content)
    if not isinstance(content, list):
        return 0
    total = 0
    for part in content:
        if isinstance(part, str):
            total += len(part)
        elif isinstance(part, dict) and isinstance(part.get("text"), str):
            total += len(part["text"])
    return total


def old_messages_chars(messages: Any) -> int:
    if not isinstance(messages, list):
        return 0
    total = 0
    for m in messages:
        if not isinstance(m, dict):
            continue
        total += old_content_chars(m.get("content"))
        calls = m.get("tool_calls")
        for call in calls if isinstance(calls, list) else ():
            fn = call.get("function") if isinstance(call, dict) else None
            if isinstance(fn, dict) and isinstance(fn.get("arguments"), str):
                total += len(fn["arguments"])
    return total


def old_prompt_size(prompt: Any) -> tuple[int, int]:
    if isinstance(prompt, str):
        return len(prompt), 0
    if not isinstance(prompt, list):
        return 0, 0
    chars = ids = 0
    for p in prompt:
        if isinstance(p, str):
            chars += len(p)
        elif isinstance(p, list):
            ids += len(p)
        elif isinstance(p, int) and not isinstance(p, bool):
            ids += 1
    return chars, ids


def old_input_chars(inputs: Any) -> int:
    return len(inputs) if isinstance(inputs, str) else old_messages_chars(inputs)


def old_count(v: Any) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) and v > 0 else None


def old_estimate_tokens(body: Any, generates: bool = True) -> int:
    if not isinstance(body, dict):
        return 256 if generates else 1
    chars, ids = old_prompt_size(body.get("prompt"))
    chars += old_messages_chars(body.get("messages")) + old_input_chars(body.get("input"))
    if not generates:
        return max(1, math.ceil(chars / 4) + ids)
    out = (old_count(body.get("max_completion_tokens")) or old_count(body.get("max_tokens"))
           or old_count(body.get("max_output_tokens")) or 256)
    copies = max(old_count(body.get("n")) or 1, old_count(body.get("best_of")) or 1)
    return math.ceil(chars / 4) + ids + out * copies


def old_depth_over(value: object, limit: int) -> bool:
    stack = [(value, 1)]
    while stack:
        v, depth = stack.pop()
        if depth > limit:
            return True
        if isinstance(v, dict):
            stack.extend((c, depth + 1) for c in v.values() if isinstance(c, (dict, list)))
        elif isinstance(v, list):
            stack.extend((c, depth + 1) for c in v if isinstance(c, (dict, list)))
    return False


def old_show(v):
    return str(v) if isinstance(v, float) or -(10**30) < v < 10**30 else "a huge number"


def old_check_number(body, name, limit, setting=None):
    v = body.get(name)
    if limit is None or isinstance(v, bool) or not isinstance(v, int | float):
        return
    if v > limit and setting:
        raise LimitExceeded(f"{name} must be at most {limit}, got {old_show(v)}. To increase this limit, set "
                            f"{setting} in the server's configuration.", name)
    if v > limit:
        raise LimitExceeded(f"{name}: {old_show(v)} exceeds the limit of {limit}", name)


def old_check_size(param, count, what, limit):
    if limit is not None and count > limit:
        raise LimitExceeded(f"{param}: {count} {what} exceed the limit of {limit}", param)


def old_check_limits(body: Any, limits: LimitsConfig, route: str) -> None:
    if not isinstance(body, dict):
        return
    messages, prompt = body.get("messages"), body.get("prompt")
    if route != "completions" and isinstance(messages, list):
        old_check_size("messages", len(messages), "messages", limits.max_messages)
        old_check_size("messages", old_messages_chars(messages), "characters of text", limits.max_prompt_chars)
    if route != "chat" and isinstance(prompt, list):
        old_check_size("prompt", sum(isinstance(p, str | list) for p in prompt), "prompts", limits.max_messages)
    if route != "chat":
        old_check_size("prompt", old_prompt_size(prompt)[0], "characters of text", limits.max_prompt_chars)
    inputs = body.get("input")
    if isinstance(inputs, list):
        old_check_size("input", len(inputs), "input items", limits.max_messages)
    old_check_size("input", old_input_chars(inputs), "characters of text", limits.max_prompt_chars)
    for name in ("n", "best_of"):
        old_check_number(body, name, limits.max_n, "limits.max_n")
    for name in ("max_tokens", "max_completion_tokens", "max_output_tokens"):
        old_check_number(body, name, limits.max_tokens_ceiling)


def old_request_cost(kind: str, body: dict, generates: bool = True) -> float:
    if kind == "diffusion":
        n = body.get("n")
        return float(n if isinstance(n, int) and 1 <= n <= 128 else 1)
    return float(old_estimate_tokens(body, generates))


def old_session_key(headers: dict, body: dict, header: str | None) -> str | None:
    if header is None:
        return None
    key = headers.get(header) or body.get("user")
    return key if isinstance(key, str) and key else None


# ---------------------------------------------------------------- random OpenAI-ish bodies

json_leaf = st.none() | st.booleans() | st.integers(-(10**20), 10**20) | st.floats() | st.text(max_size=12)
any_json = st.recursive(json_leaf, lambda inner: st.lists(inner, max_size=4)
                        | st.dictionaries(st.text(max_size=6), inner, max_size=4), max_leaves=20)
number = (st.integers(-5, 300) | st.integers(-(10**40), 10**40) | st.booleans() | st.floats(allow_nan=True)
          | st.text(max_size=3) | st.none())
text = st.text(max_size=40)
part = (text | st.builds(lambda t, extra: {"type": "text", "text": t, **extra}, text | any_json,
                         st.dictionaries(st.sampled_from(["cache", "x"]), any_json, max_size=1))
        | st.builds(lambda url: {"type": "image_url", "image_url": {"url": url}}, text) | any_json)
call = st.builds(lambda args, fn_extra, call_extra: {"function": {"name": "f", "arguments": args, **fn_extra},
                                                     **call_extra},
                 text | any_json, st.dictionaries(st.just("deep"), any_json, max_size=1),
                 st.dictionaries(st.sampled_from(["id", "type"]), any_json, max_size=1)) | any_json
message = st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "user", "assistant", "tool"])},
    optional={"content": text | st.lists(part, max_size=4) | any_json, "tool_calls": st.lists(call, max_size=3)
              | any_json, "name": any_json}) | any_json
messages = st.lists(message, max_size=6) | any_json
prompt = (text | st.lists(text | st.lists(st.integers(0, 50_000), max_size=5) | st.integers(-1, 9) | any_json,
                          max_size=5) | any_json)
body_st = st.fixed_dictionaries({}, optional={
    "model": st.sampled_from(["tiny", "other"]) | any_json, "messages": messages, "prompt": prompt,
    "input": text | messages, "n": number, "best_of": number, "max_tokens": number,
    "max_completion_tokens": number, "max_output_tokens": number, "user": text | any_json,
    "tools": any_json, "stream": st.booleans(), "response_format": any_json})
ROUTES = ["chat", "completions", "responses", "tokenize", "messages", "other"]
TIGHT = LimitsConfig(max_messages=3, max_n=2, max_tokens_ceiling=100, max_prompt_chars=20)


def raised(f, *args):
    try:
        f(*args)
    except LimitExceeded as e:
        return (e.param, e.message, e.status)
    return None


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(body=body_st, route=st.sampled_from(ROUTES))
def test_the_intake_agrees_with_the_walks_it_replaces(body, route):
    agree(json.loads(json.dumps(body)), route)  # what the gateway sees: parsed JSON


def agree(body: dict, route: str) -> None:
    intake = take_in(body, route)
    for generates in (True, False):
        assert take_in(body, route, generates=generates).tokens == old_estimate_tokens(body, generates)
        assert estimate_tokens(body, generates) == old_estimate_tokens(body, generates)
    assert intake.tokens == old_estimate_tokens(body, intake.generates)
    for limit in range(1, 9):
        assert (intake.depth > limit) == old_depth_over(body, limit)
    for limits in (TIGHT, LimitsConfig()):
        assert raised(check_limits, intake, limits) == raised(old_check_limits, body, limits, route)
    for kind in ("autoregressive", "diffusion"):
        assert request_cost(kind, intake) == old_request_cost(kind, body, intake.generates)
    assert intake.message_chars == old_messages_chars(body.get("messages"))
    assert intake.input_chars == old_input_chars(body.get("input"))
    assert (intake.prompt_chars, intake.prompt_ids) == old_prompt_size(body.get("prompt"))
    listed = {k: body[k] if isinstance(body.get(k), list) else None for k in ("messages", "prompt", "input")}
    assert intake.messages == (None if listed["messages"] is None else len(listed["messages"]))
    assert intake.inputs == (None if listed["input"] is None else len(listed["input"]))
    assert intake.prompts == (None if listed["prompt"] is None
                              else sum(isinstance(p, (str, list)) for p in listed["prompt"]))
    headers = {"x-session-id": "s1"}
    for header in (None, "x-session-id", "x-other"):
        key = take_in(body, route, headers=headers, session_header=header).session_key
        assert key == old_session_key(headers, body, header)


IDS = list(range(40))


@pytest.mark.parametrize("body", [
    {"prompt": IDS}, {"prompt": IDS + [True]}, {"prompt": IDS + [None, 1.5]}, {"prompt": IDS + [[1, [2]]]},
    {"prompt": IDS + ["ab"]}, {"prompt": IDS + [{"a": [1]}]}, {"prompt": [IDS, IDS + [[[1]]]]}, {"prompt": []},
    {"tools": [1] * 40 + [{"a": [[1]]}]}, {"tools": {str(i): i for i in range(40)} | {"x": [[]]}},
    {"x": [1.5] * 40}, {"x": [[1.5] * 40] * 20}, {"messages": [{"content": "a"}] * 40 + [[[[1]]]]},
])
@pytest.mark.parametrize("route", ["chat", "completions"])
def test_long_lists_agree_with_the_walks_they_replace(body, route):
    """Long lists of scalars take a C-speed path (hypothesis' lists are short)."""
    agree(body, route)


@settings(max_examples=100, deadline=None)
@given(value=any_json)
def test_depth_of_any_json_object(value):
    body = {"x": value}
    for limit in range(1, 8):
        assert (take_in(body, "chat").depth > limit) == old_depth_over(body, limit)


# ---------------------------------------------------------------- the record, by hand


def test_sizes_of_a_chat_body():
    body = {"model": "tiny", "max_tokens": 100, "n": 2, "best_of": 1, "user": "u",
            "messages": [{"role": "system", "content": "x" * 10},
                         {"role": "user", "content": [{"type": "text", "text": "y" * 5},
                                                      {"type": "image_url", "image_url": {"url": "data:" + "z" * 99}},
                                                      "w"]},
                         {"role": "assistant", "content": None,
                          "tool_calls": [{"function": {"name": "f", "arguments": "a" * 4}}]}]}
    i = take_in(body, "chat", timeout_at=12.5)
    assert (i.model, i.route, i.generates, i.body) == ("tiny", "chat", True, body)
    assert (i.messages, i.message_chars, i.prompts, i.prompt_chars, i.prompt_ids, i.inputs, i.input_chars) == (
        3, 20, None, 0, 0, None, 0)
    assert i.depth == 6  # body > messages > message > content > image part > image_url
    assert (i.copies, i.max_output, i.output_param, i.tokens) == (2, 100, "max_tokens", 5 + 200)
    assert i.numbers == (2, 1, 100, None, None)  # NUMBERS: n, best_of, max_tokens, max_completion_tokens, ...
    assert (i.session_key, i.timeout_at, i.text_chars) == (None, 12.5, 20)
    with pytest.raises(AttributeError):
        i.tokens = 1  # immutable


def test_sizes_of_completions_and_responses_bodies():
    i = take_in({"prompt": ["ab", [1, 2, 3], 7, True, None, "cde"], "max_completion_tokens": 3,
                 "max_tokens": 9, "n": True}, "completions")
    assert (i.prompts, i.prompt_chars, i.prompt_ids, i.depth) == (3, 5, 4, 3)
    assert (i.copies, i.max_output, i.output_param, i.tokens) == (1, 3, "max_completion_tokens", 2 + 4 + 3)
    i = take_in({"input": [{"role": "user", "content": "a" * 8}, "junk"], "max_output_tokens": 10}, "responses")
    assert (i.inputs, i.input_chars, i.max_output, i.output_param, i.tokens) == (2, 8, 10, None, 2 + 10)
    i = take_in({"prompt": "a" * 40}, "tokenize")
    assert (i.generates, i.tokens) == (False, 10)
    assert take_in({}, "chat").tokens == DEFAULT_MAX_OUTPUT_TOKENS and take_in({}, "tokenize").tokens == 1


def test_depth_limit_and_parse_errors_keep_their_words():
    body = {"tools": [{"a": [[[1]]]}]}  # 1 body, 2 tools, 3 tool, 4 a, 5, 6
    assert take_in(body, "chat").depth == 6
    assert take_in(body, "chat", max_depth=6).depth == 6
    with pytest.raises(TandemError, match="nested deeper than 5 levels") as e:
        take_in(body, "chat", max_depth=5)
    assert (e.value.status, e.value.param) == (400, None)
    with pytest.raises(TandemError, match="not valid JSON"):
        parse_json(b"{nope", 32)
    with pytest.raises(TandemError, match="must be a JSON object, got list"):
        parse_json(b"[1]", 32)
    with pytest.raises(TandemError, match="nested deeper than 32 levels"):
        parse_json(b"[" * 100_000 + b"]" * 100_000, 32)  # past what json can recurse into
    assert parse_json('{"a": "é"}'.encode(), 32) == {"a": "é"}


def test_session_key_header_then_user():
    body = {"user": "alice"}
    assert take_in(body, "chat", headers={"x-s": "h"}, session_header="x-s").session_key == "h"
    assert take_in(body, "chat", headers={}, session_header="x-s").session_key == "alice"
    assert take_in(body, "chat", headers={"x-s": "h"}).session_key is None  # affinity off
    assert take_in({"user": ""}, "chat", headers={"x-s": ""}, session_header="x-s").session_key is None
    assert take_in({"user": 5}, "chat", session_header="x-s").session_key is None


# ---------------------------------------------------------------- the gateway reads a body once


class CountingList(list):
    """A list that counts how often it is iterated."""

    iterations = 0

    def __iter__(self):
        CountingList.iterations += 1
        return super().__iter__()


def test_the_gateway_walks_a_body_once_before_it_takes_a_slot(monkeypatch):
    parse, acquire = generate_module.parse_json, serve_module._acquire
    seen = []

    def counting_parse(raw, max_depth):
        body = parse(raw, max_depth)
        body["messages"] = CountingList(body["messages"])
        CountingList.iterations = 0
        return body

    async def counting_acquire(*args, **kwargs):
        seen.append(CountingList.iterations)
        return await acquire(*args, **kwargs)

    monkeypatch.setattr(generate_module, "parse_json", counting_parse)
    monkeypatch.setattr(serve_module, "_acquire", counting_acquire)
    key = "sk-tandem-intake-0123456789"
    extra = {"model_fields": {"session_affinity": {"enabled": True}},
             "auth": {"api_keys": [{"key": key, "tokens_per_minute": 100_000}]}}
    with fake_gateway({"num_tokens": 2}, extra=extra) as (url, _, _):
        body = {"model": "fake", "messages": [{"role": "user", "content": "hi"}] * 50, "max_tokens": 2,
                "user": "u"}
        r = httpx.post(url + "/v1/chat/completions", json=body, timeout=30, headers={"authorization": f"Bearer {key}"})
        assert r.status_code == 200, r.text
    # The intake's walk; the depth and input limits, the token rate limit, the cost for routing and
    # the session key read its record (before: 4 walks of these messages).
    assert seen == [1]


def test_the_gateway_keeps_its_error_order():
    """Each body breaks the rule it is named for and every rule checked after it: the first
    rule in the order (JSON, depth, draining, model, limits, token rate) answers."""
    key = "sk-tandem-intake-0123456789"
    extra = {"auth": {"api_keys": [{"key": key, "name": "k", "tokens_per_minute": 1000}]},
             "limits": {"max_messages": 4, "max_json_depth": 8}}
    many = [{"role": "user", "content": "x"}] * 5
    deep = {"tools": [[[[[[[[1]]]]]]]]}
    with fake_gateway({"num_tokens": 2}, extra=extra) as (url, service, _):
        def post(body):
            content = body if isinstance(body, bytes) else json.dumps(body).encode()
            r = httpx.post(url + "/v1/chat/completions", content=content, timeout=30,
                           headers={"authorization": f"Bearer {key}", "content-type": "application/json"})
            return r.status_code, r.json()["error"]["message"] if r.status_code != 200 else ""

        assert post(b"{bad")[0] == 400 and "not valid JSON" in post(b"{bad")[1]
        assert post({"model": "nope", "messages": many, "max_tokens": 5000, **deep}) == (
            400, "the request body is nested deeper than 8 levels")
        service.draining = True
        try:
            assert post({"model": "nope", "messages": many})[0] == 503
        finally:
            service.draining = False
        assert post({"model": "nope", "messages": many, "max_tokens": 5000})[0] == 404
        assert post({"model": "fake", "messages": many, "max_tokens": 5000}) == (
            400, "messages: 5 messages exceed the limit of 4")
        status, message = post({"model": "fake", "messages": many[:1], "max_tokens": 5000})
        assert status == 400 and "about 5001 tokens" in message
        assert post({"model": "fake", "messages": many[:1], "max_tokens": 600})[0] == 200
        status, message = post({"model": "fake", "messages": many[:1], "max_tokens": 600})
        assert status == 429 and "1000 tokens per minute" in message
