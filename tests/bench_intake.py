"""Per-request CPU of reading a body: the old chain (json.loads, depth walk, check_limits,
estimate_tokens for the rate limiter and again for request_cost, session key) vs the intake
(parse_json, take_in, then the checks reading its record). Run from the repo root: `.venv/bin/python tests/bench_intake.py` (the old chain is kept in
tests/unit/test_intake.py as the intake's test oracle)."""
import json
import sys
import time
import timeit

sys.path.insert(0, ".")
from gateway.request.intake import parse_json, take_in  # noqa: E402
from gateway.request.limits import check_limits  # noqa: E402
from gateway.routing.router import request_cost  # noqa: E402
from tandem_core.config import LimitsConfig  # noqa: E402
from tests.unit.test_intake import (  # noqa: E402
    old_check_limits,
    old_depth_over,
    old_estimate_tokens,
    old_request_cost,
    old_session_key,
)

LIMITS = LimitsConfig()
HEADERS = {"x-session-id": "abc"}


def old(raw, route, keys):
    body = json.loads(raw)
    if not isinstance(body, dict) or old_depth_over(body, 32):
        raise ValueError
    old_check_limits(body, LIMITS, route)
    if keys:
        old_estimate_tokens(body, True)  # check_tokens with a token limit
    cost = old_request_cost("autoregressive", body, True)
    return cost, old_session_key(HEADERS, body, "x-session-id")


def new(raw, route, keys):
    intake = take_in(parse_json(raw, 32), route, max_depth=32, headers=HEADERS, session_header="x-session-id")
    check_limits(intake, LIMITS)
    if keys:
        intake.tokens  # noqa: B018
    return request_cost("autoregressive", intake), intake.session_key


chat = {"model": "tiny", "messages": [{"role": "system", "content": "You are a helpful assistant."},
                                      {"role": "user", "content": "Hello, how are you today? Tell me a story."}],
        "max_tokens": 64, "stream": True, "temperature": 0.7}
long_chat = {"model": "tiny", "max_tokens": 64, "messages": [
    {"role": "user" if i % 2 == 0 else "assistant", "content": "word " * 20} for i in range(1000)]}
image_chat = {"model": "tiny", "messages": [{"role": "user", "content": [
    {"type": "text", "text": "what is this?"}, {"type": "image_url", "image_url": {"url": "data:," + "A" * 100_000}}]}]}
ids = {"model": "tiny", "prompt": list(range(2000)), "max_tokens": 16}
tools = {**chat, "tools": [{"type": "function", "function": {"name": f"f{i}", "parameters": {
    "type": "object", "properties": {"a": {"type": "string"}, "b": {"type": "array", "items": {"type": "integer"}}}}}}
    for i in range(20)]}
cases = [("chat, 2 messages", chat, "chat"), ("chat, 1000 messages", long_chat, "chat"),
         ("chat, image 100 kB", image_chat, "chat"), ("completions, 2000 ids", ids, "completions"),
         ("chat, 20 tools", tools, "chat")]
for name, body, route in cases:
    raw = json.dumps(body).encode()
    assert old(raw, route, True) == new(raw, route, True)
    n = 20000 if len(raw) < 5000 else 300
    loads = min(timeit.repeat(lambda raw=raw: json.loads(raw), number=n, repeat=5, timer=time.process_time)) / n
    for keys in (False, True):
        t_old, t_new = (min(timeit.repeat(lambda f=f, raw=raw, route=route, keys=keys: f(raw, route, keys), number=n,
                                          repeat=5, timer=time.process_time)) / n for f in (old, new))
        print(f"{name:24s} {len(raw):7d} B token limit {'on ' if keys else 'off'}: old {t_old * 1e6:8.1f} us  "
              f"new {t_new * 1e6:8.1f} us  ({t_new / t_old:4.2f}x; json.loads alone {loads * 1e6:7.1f} us)")
