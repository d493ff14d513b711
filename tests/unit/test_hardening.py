"""Security and hardening through the real gateway (uvicorn, real sockets, fake engines), with the
`openai` SDK and raw httpx: API keys, per-key rate limits, input limits, request timeout, CORS,
request ids on failures (the pieces themselves are unit-tested in test_security.py)."""

import logging
import time

import httpx
import openai
import pytest

from tests.unit.gateway_server import fake_gateway
from tests.waiting import wait_for

KEY, OTHER_KEY, WRONG = "sk-tandem-test-0123456789", "sk-tandem-other-9876543210", "sk-wrong-000000000000"
MSG = [{"role": "user", "content": "hi"}]


def _client(url, key):
    return openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0)


@pytest.fixture(scope="module")
def secured():
    extra = {"auth": {"api_keys": [{"key": KEY, "name": "team-a", "role": "admin"},
                                   {"key": OTHER_KEY, "name": "team-b", "requests_per_minute": 60}]},
             "limits": {"max_body_bytes": 64 * 1024, "max_messages": 8, "max_n": 2, "max_tokens_ceiling": 100,
                        "max_prompt_chars": 2000, "max_json_depth": 16},
             "model_fields": {"max_tokens_ceiling": 50}}
    with fake_gateway({"num_tokens": 3}, extra=extra) as g:
        yield g


def test_missing_and_wrong_keys_get_401_in_the_envelope_and_the_right_key_works(secured, caplog):
    url, _, _ = secured
    caplog.set_level(logging.DEBUG)
    for key in (WRONG, "Bearer-less"):
        with pytest.raises(openai.AuthenticationError) as e:
            _client(url, key).chat.completions.create(model="fake", messages=MSG)
        assert e.value.status_code == 401 and e.value.body["code"] == "invalid_api_key"
    raw = httpx.post(url + "/v1/chat/completions", json={"model": "fake", "messages": MSG})
    assert raw.status_code == 401 and raw.headers["www-authenticate"] == "Bearer"
    assert set(raw.json()["error"]) == {"message", "type", "param", "code"}
    r = _client(url, KEY).chat.completions.create(model="fake", messages=MSG)
    assert r.choices[0].message.content == "tok0 tok1 tok2"
    chunks = list(_client(url, KEY).completions.create(model="fake", prompt="x", stream=True))
    assert "".join(c.choices[0].text for c in chunks) == "tok0 tok1 tok2 "
    for path in ("/v1/models", "/metrics", "/admin/replicas"):  # everything but the public paths needs a key
        assert httpx.get(url + path).status_code == 401
        assert httpx.get(url + path, headers={"Authorization": f"Bearer {KEY}"}).status_code == 200
    assert httpx.get(url + "/health").status_code == 200 and httpx.get(url + "/ready").status_code == 200
    # keys are never logged or echoed (names are)
    wrong = httpx.get(url + "/v1/models", headers={"Authorization": f"Bearer {WRONG}"})
    assert WRONG not in wrong.text and KEY not in wrong.text
    assert KEY not in caplog.text and WRONG not in caplog.text and OTHER_KEY not in caplog.text


def test_rate_limit_is_per_key_429_with_retry_after_then_recovers(secured):
    url, _, _ = secured
    limited = _client(url, OTHER_KEY)  # 60 requests per minute: a burst of 60, then one a second
    codes = []
    for _ in range(70):
        r = httpx.get(url + "/v1/models", headers={"Authorization": f"Bearer {OTHER_KEY}"})
        codes.append(r.status_code)
        if r.status_code == 429:
            break
    assert codes[-1] == 429 and len(codes) > 50, codes
    assert r.headers["retry-after"].isdigit() and int(r.headers["retry-after"]) >= 1
    assert r.json()["error"]["type"] == "rate_limit_error"
    with pytest.raises(openai.RateLimitError):
        limited.chat.completions.create(model="fake", messages=MSG)
    # the other key is not affected
    assert _client(url, KEY).chat.completions.create(model="fake", messages=MSG).choices
    # Not a synchronisation point: the bucket refills with time itself, so waiting out Retry-After is
    # the behaviour under test (no condition to poll but the clock).
    time.sleep(int(r.headers["retry-after"]) + 0.2)
    assert limited.chat.completions.create(model="fake", messages=MSG).choices[0].message.content


@pytest.mark.parametrize("body, param, words", [
    ({"messages": [{"role": "user", "content": "x"}] * 9}, "messages", "limit of 8"),
    ({"messages": MSG, "n": 3}, "n", "n must be at most 2, got 3"),  # vLLM's wording
    ({"messages": MSG, "max_tokens": 51}, "max_tokens", "limit of 50"),  # the model's own ceiling wins
    ({"messages": MSG, "max_completion_tokens": 51}, "max_completion_tokens", "limit of 50"),
    ({"messages": [{"role": "user", "content": "x" * 2001}]}, "messages", "limit of 2000"),
    ({"messages": MSG, "tools": [{"a": [[[[[[[[[[[[[[[[[1]]]]]]]]]]]]]]]]]}]}, None, "deeper than 16"),
])
def test_input_limits_are_400s_naming_the_field_and_the_limit(secured, body, param, words):
    url, _, _ = secured
    with pytest.raises(openai.BadRequestError) as e:
        _client(url, KEY).chat.completions.create(model="fake", **body)
    assert e.value.status_code == 400 and e.value.body["param"] == param and words in e.value.body["message"]


def test_oversized_body_is_413_and_the_server_keeps_serving(secured):
    url, _, _ = secured
    big = {"model": "fake", "messages": [{"role": "user", "content": "x" * 70_000}]}
    headers = {"Authorization": f"Bearer {KEY}"}
    r = httpx.post(url + "/v1/chat/completions", json=big, headers=headers)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"

    def chunked():  # no Content-Length: cut while it is received
        for _ in range(100):
            yield b" " * 1024
    r = httpx.post(url + "/v1/chat/completions", content=chunked(), headers={**headers, "content-type": "application/json"})
    assert r.status_code == 413
    assert _client(url, KEY).chat.completions.create(model="fake", messages=MSG).choices


def test_request_timeout_504_and_an_error_event_in_a_stream():
    extra = {"limits": {"request_timeout_s": 0.5}}
    with fake_gateway({"num_tokens": 100, "token_delay_s": 0.05}, extra=extra) as (url, service, dep):
        r = httpx.post(url + "/v1/completions", json={"model": "fake", "prompt": "x"}, timeout=10)
        assert r.status_code == 504 and r.json()["error"]["type"] == "timeout_error"  # not the 5 s answer
        assert r.headers["x-request-id"] in r.json()["error"]["message"]  # a 5xx names the request id
        with httpx.stream("POST", url + "/v1/chat/completions", timeout=10,
                          json={"model": "fake", "messages": MSG, "stream": True}) as s:
            lines = [ln for ln in s.iter_lines() if ln.startswith("data: ")]
        assert lines[-1] == "data: [DONE]" and "timeout_error" in lines[-2] and 1 < len(lines) < 50
        engine = next(iter(dep.engines.values()))
        # aborted in the engine, not left running
        wait_for(lambda: not engine.running and len(engine.aborted) == 2, "both requests to be aborted in the engine")


def test_a_500_carries_the_request_id_and_no_internals():
    with fake_gateway({"fail": "request"}) as (url, _, _):
        r = httpx.post(url + "/v1/completions", json={"model": "fake", "prompt": "x"})
        assert r.status_code == 500
        msg = r.json()["error"]["message"]
        assert r.headers["x-request-id"] in msg and "Traceback" not in r.text and "fake_engine" not in r.text
        assert httpx.post(url + "/v1/completions", json={"model": "fake", "prompt": "x"}).status_code == 500


def test_cors_is_off_by_default_and_configurable(secured):
    url, _, _ = secured
    preflight = {"Origin": "https://app.example", "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization,content-type"}
    r = httpx.options(url + "/v1/chat/completions", headers=preflight)
    assert "access-control-allow-origin" not in r.headers
    with fake_gateway({"num_tokens": 2}, extra={"cors": {"allow_origins": ["https://app.example"]},
                                               "auth": {"api_keys": [{"key": KEY}]}}) as (cors_url, _, _):
        r = httpx.options(cors_url + "/v1/chat/completions", headers=preflight)
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "https://app.example"
        # refusals carry CORS headers too, so a browser can read the 401
        r = httpx.post(cors_url + "/v1/chat/completions", json={"model": "fake", "messages": MSG},
                       headers={"Origin": "https://app.example"})
        assert r.status_code == 401 and r.headers["access-control-allow-origin"] == "https://app.example"
        other = httpx.options(cors_url + "/v1/chat/completions", headers={**preflight, "Origin": "https://evil.example"})
        assert other.headers.get("access-control-allow-origin") != "https://evil.example"


def test_a_clients_request_id_is_echoed_and_reaches_the_engine():
    with fake_gateway({"num_tokens": 2}) as (url, _, dep):
        engine = next(iter(dep.engines.values()))
        for _ in range(2):  # the same id twice: the engine's ids still differ
            r = httpx.post(url + "/v1/completions", json={"model": "fake", "prompt": "x"},
                           headers={"x-request-id": "client-id.42"})
            assert r.status_code == 200 and r.headers["x-request-id"] == "client-id.42"
        ours = [rid for rid in engine.served if "client-id.42" in rid]
        assert len(ours) == 2 and len(set(ours)) == 2
        r = httpx.post(url + "/v1/completions", json={"model": "fake", "prompt": "x"})
        assert r.status_code == 200 and len(r.headers["x-request-id"]) == 32  # one of ours
        for bad in ("has space", "x" * 129):
            r = httpx.post(url + "/v1/completions", json={"model": "fake", "prompt": "x"}, headers={"x-request-id": bad})
            assert r.status_code == 400 and r.json()["error"]["param"] == "x-request-id", r.text
