import asyncio
import hmac
import json
import logging
import math

import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ValidationError

from gateway.admission.keys import KeyStore, RateLimiter, ResolvedKey, TokenBucket, resolve_keys
from gateway.http import security
from gateway.http.middleware import AuthMiddleware, BodySizeLimit
from gateway.http.security import install_security
from gateway.request.intake import parse_json, take_in
from gateway.request.limits import check_limits, estimate_tokens
from tandem_core.config import ApiKey, AuthConfig, CorsConfig, LimitsConfig
from tandem_core.errors import BodyTooLarge, LimitExceeded, RateLimited, TandemError, Unauthenticated

KEY = "sk-tandem-test-Zq8vXr2Lm9"
OTHER = "sk-tandem-other-Hw3nPa7Tk1"


class FakeClock:
    def __init__(self, t: float = 1000.0):
        self.t = t

    def __call__(self) -> float:
        return self.t

    def advance(self, seconds: float) -> None:
        self.t += seconds


# ---------------------------------------------------------------- helpers: a tiny app


def make_app(auth: AuthConfig | None = None, limits: LimitsConfig | None = None, cors: CorsConfig | None = None,
             clock: FakeClock | None = None, on_reject=None, reached: list | None = None) -> FastAPI:
    """A tiny app wired like tandem's: TandemError handler, a catch-all Exception handler, a
    chat route that takes its JSON body in and calls check_limits then check_tokens."""
    auth = auth if auth is not None else AuthConfig(api_keys=[ApiKey(key=KEY, name="alice"), ApiKey(key=OTHER)])
    limits = limits or LimitsConfig()
    app = FastAPI()

    @app.exception_handler(TandemError)
    async def _refused(request: Request, exc: TandemError):
        return JSONResponse(exc.envelope(), status_code=exc.status, headers=exc.headers())

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception):
        return JSONResponse({"error": {"message": "internal", "type": "server_error", "param": None, "code": 500}},
                            status_code=500)

    limiter = install_security(app, auth, limits, cors or CorsConfig(), clock=clock or FakeClock(),
                               on_reject=on_reject, environ={})

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        intake = take_in(json.loads(await request.body()), "chat")
        name = getattr(request.state, "tandem_key_name", None)
        check_limits(intake, limits)
        limiter.check_tokens(name, intake)
        if reached is not None:
            reached.append(name)
        return {"ok": True, "key_name": name}

    @app.get("/health")
    async def health():
        return {"ok": True}

    @app.get("/ready")
    async def ready():
        return {"ok": True}

    @app.get("/v1/models")
    async def models():
        return {"ok": True}

    return app


def send(app, *requests: tuple) -> list[httpx.Response]:
    """Serve (method, path, kwargs) requests through the ASGI app, in order."""

    async def main():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
            return [await client.request(method, path, **kw) for method, path, kw in requests]

    return asyncio.run(main())


def one(app, method: str, path: str, **kw) -> httpx.Response:
    return send(app, (method, path, kw))[0]


def bearer(key: str = KEY) -> dict:
    return {"Authorization": f"Bearer {key}"}


CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def assert_envelope(r: httpx.Response, status: int, type_: str, code, param=None) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert (err["type"], err["code"], err["param"]) == (type_, code, param)
    return err


def assert_no_key(responses, caplog) -> None:
    for r in responses:
        assert KEY not in r.text and OTHER not in r.text
        assert all(KEY not in v and OTHER not in v for v in r.headers.values())
    assert KEY not in caplog.text and OTHER not in caplog.text


# ---------------------------------------------------------------- configs


@pytest.mark.parametrize("model", [ApiKey, AuthConfig, LimitsConfig, CorsConfig])
def test_every_config_field_has_a_description(model: type[BaseModel]):
    assert all(f.description for f in model.model_fields.values()), model


@pytest.mark.parametrize("fields", [{}, {"key": "a", "key_env": "E"}, {"key_env": "E", "key_file": "f"}])
def test_api_key_needs_exactly_one_source(fields):
    with pytest.raises(ValidationError, match="exactly one of key, key_env, key_file"):
        ApiKey(**fields)


def test_configs_are_strict_and_frozen():
    with pytest.raises(ValidationError):
        AuthConfig(api_key=[])  # a typo is an error, not ignored
    cfg = LimitsConfig()
    with pytest.raises(ValidationError):
        cfg.max_n = 3


def test_inline_key_is_not_shown_by_repr():
    k = ApiKey(key=KEY, name="a")
    assert KEY not in repr(k) and KEY not in str(k)
    assert KEY not in repr(ResolvedKey("a", KEY))


def test_auth_config_checks_names_and_paths():
    with pytest.raises(ValidationError, match="unique; repeated: a"):
        AuthConfig(api_keys=[ApiKey(key="x", name="a"), ApiKey(key="y", name="a")])
    with pytest.raises(ValidationError, match="must start with '/'"):
        AuthConfig(public_paths=["health"])
    with pytest.raises(ValidationError):
        ApiKey(key="x", name=" padded ")


def test_auth_config_enabled_and_public_paths():
    assert not AuthConfig().enabled
    assert AuthConfig(api_keys_env="K").enabled
    assert AuthConfig(api_keys=[ApiKey(key="x")]).enabled
    assert AuthConfig().public() == {"/health", "/ready"}
    assert AuthConfig(ready_public=False, public_paths=["/health", "/metrics"]).public() == {"/health", "/metrics"}


def test_defaults():
    limits = LimitsConfig()
    assert limits.max_body_bytes == 4 * 1024 * 1024
    assert (limits.max_messages, limits.max_n, limits.max_tokens_ceiling) == (1024, 16, None)
    assert (limits.max_prompt_chars, limits.request_timeout_s) == (1_000_000, 600)
    cors = CorsConfig()
    assert not cors.enabled and not cors.allow_credentials


def test_cors_refuses_credentials_for_any_origin():
    with pytest.raises(ValidationError, match="allow_credentials"):
        CorsConfig(allow_origins=["*"], allow_credentials=True)


# ---------------------------------------------------------------- resolve_keys


def test_resolve_keys_from_every_source(tmp_path):
    (tmp_path / "key.txt").write_text(f"  {OTHER}\n")
    cfg = AuthConfig(
        api_keys=[ApiKey(key=KEY, requests_per_minute=5), ApiKey(key_env="MY_KEY", name="env-key"),
                  ApiKey(key_file="key.txt", name="file-key", tokens_per_minute=7)],
        api_keys_env="MORE_KEYS", default_requests_per_minute=60, default_tokens_per_minute=1000)
    keys = resolve_keys(cfg, {"MY_KEY": "sk-from-env\n", "MORE_KEYS": " sk-a, sk-b ,,"}, base_dir=tmp_path)
    assert [(k.name, k.key, k.requests_per_minute, k.tokens_per_minute) for k in keys] == [
        ("key-0", KEY, 5, 1000),
        ("env-key", "sk-from-env", 60, 1000),
        ("file-key", OTHER, 60, 7),
        ("MORE_KEYS[0]", "sk-a", 60, 1000),
        ("MORE_KEYS[1]", "sk-b", 60, 1000),
    ]


def test_resolve_keys_reads_the_process_environment_by_default(monkeypatch):
    monkeypatch.setenv("TANDEM_TEST_KEY", KEY)
    assert resolve_keys(AuthConfig(api_keys=[ApiKey(key_env="TANDEM_TEST_KEY")]))[0].key == KEY


@pytest.mark.parametrize("cfg, environ, message", [
    (AuthConfig(api_keys=[ApiKey(key_env="NOPE", name="k")]), {}, "'k': environment variable NOPE is not set"),
    (AuthConfig(api_keys_env="NOPE"), {}, "environment variable NOPE is not set"),
    (AuthConfig(api_keys_env="E"), {"E": " , "}, "environment variable E holds no keys"),
    (AuthConfig(api_keys=[ApiKey(key_env="E")]), {"E": ""}, "'key-0' is empty"),
    (AuthConfig(api_keys=[ApiKey(key=KEY, name="a"), ApiKey(key_env="E", name="b")]), {"E": KEY},
     "'a' and 'b' are the same key"),
    (AuthConfig(api_keys=[ApiKey(key=KEY + " x")]), {}, "printable ASCII without spaces"),
    (AuthConfig(api_keys=[ApiKey(key=KEY + "é")]), {}, "printable ASCII without spaces"),
    (AuthConfig(api_keys=[ApiKey(key=KEY, name="E[0]")], api_keys_env="E"), {"E": OTHER}, "names must be unique"),
])
def test_resolve_keys_errors_name_the_source_never_the_key(cfg, environ, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[")) as e:
        resolve_keys(cfg, environ)
    assert KEY not in str(e.value) and OTHER not in str(e.value)


def test_resolve_keys_names_a_missing_or_binary_key_file(tmp_path):
    with pytest.raises(ValueError, match=r"'k': cannot read key file .*missing\.txt"):
        resolve_keys(AuthConfig(api_keys=[ApiKey(key_file=tmp_path / "missing.txt", name="k")]), {})
    (tmp_path / "bin").write_bytes(b"\xff\xfe" + KEY.encode())
    with pytest.raises(ValueError, match="is not UTF-8 text") as e:
        resolve_keys(AuthConfig(api_keys=[ApiKey(key_file="bin")]), {}, base_dir=tmp_path)
    assert KEY not in str(e.value)


# ---------------------------------------------------------------- KeyStore


def test_keystore_lookup():
    store = KeyStore([ResolvedKey("a", KEY), ResolvedKey("b", OTHER)])
    assert len(store) == 2
    assert store.lookup(KEY) == "a" and store.lookup(OTHER.encode()) == "b"
    for wrong in ["", KEY[:-1], KEY + "x", KEY.upper(), "\udc80", "é", b"\xff"]:
        assert store.lookup(wrong) is None
    assert KeyStore([]).lookup(KEY) is None


@pytest.mark.parametrize("token", [KEY, OTHER, "sk-wrong", ""])
def test_keystore_compares_against_every_key_in_constant_time(monkeypatch, token):
    calls = []
    real = hmac.compare_digest

    def counting(a, b):
        calls.append((len(a), len(b)))
        return real(a, b)

    monkeypatch.setattr(hmac, "compare_digest", counting)
    store = KeyStore([ResolvedKey("a", KEY), ResolvedKey("b", OTHER), ResolvedKey("c", "sk-third")])
    store.lookup(token)
    assert len(calls) == 3  # no early exit, hit or miss
    assert set(calls) == {(32, 32)}  # digests: the key's length does not show


# ---------------------------------------------------------------- TokenBucket


def test_token_bucket_starts_full_and_refills_evenly():
    b = TokenBucket(capacity=10, refill_per_s=2)
    assert b.try_take(10, now=0) == 0
    assert b.try_take(1, now=0) == pytest.approx(0.5)
    assert b.try_take(4, now=1) == pytest.approx(1.0)  # 2 there, 2 more needed at 2/s; nothing taken
    assert b.try_take(4, now=2) == 0
    assert b.tokens == pytest.approx(0)
    assert b.try_take(1, now=1000) == 0 and b.tokens == pytest.approx(9)  # refill capped at capacity


def test_token_bucket_never_fits_more_than_capacity_and_ignores_a_clock_stepping_back():
    b = TokenBucket(capacity=10, refill_per_s=1)
    assert b.try_take(11, now=0) == math.inf and b.tokens == 10
    assert b.try_take(10, now=5) == 0
    assert b.try_take(1, now=3) == pytest.approx(1)  # back in time: no refill, no negative refill
    assert b.try_take(1, now=6) == 0
    b.give_back(100)
    assert b.tokens == 10
    with pytest.raises(ValueError):
        TokenBucket(0, 1)


# ---------------------------------------------------------------- estimate_tokens


def test_estimate_tokens_for_chat():
    body = {"messages": [{"role": "system", "content": "x" * 10},
                         {"role": "user", "content": [{"type": "text", "text": "y" * 5},
                                                      {"type": "image_url", "image_url": {"url": "data:" + "z" * 999}},
                                                      "w"]},
                         {"role": "assistant", "content": None,
                          "tool_calls": [{"function": {"name": "f", "arguments": "a" * 4}}]}],
            "max_tokens": 100, "n": 2}
    assert estimate_tokens(body) == math.ceil(20 / 4) + 200


def test_estimate_tokens_for_completions_and_defaults():
    assert estimate_tokens({"prompt": "abcde"}) == 2 + 256
    assert estimate_tokens({"prompt": ["abcd", "efgh"], "max_tokens": 1}) == 2 + 1
    assert estimate_tokens({"prompt": [1, 2, 3], "max_tokens": 1}) == 3 + 1
    assert estimate_tokens({"prompt": [[1, 2], [3]], "max_tokens": 1}) == 3 + 1
    assert estimate_tokens({"prompt": "", "max_tokens": 10, "max_completion_tokens": 3}) == 3
    assert estimate_tokens({"prompt": "", "max_tokens": 10, "n": 2, "best_of": 5}) == 50


@pytest.mark.parametrize("body", [
    None, [], "text", 3, {}, {"messages": "hi"}, {"messages": [None, 1, "x", {"content": 5}, {"content": {"a": 1}}]},
    {"messages": [{"content": [None, 1, {"text": 5}, {"text": ["x"]}]}], "tool_calls": 3},
    {"messages": [{"content": "x", "tool_calls": [1, {"function": 2}, {"function": {"arguments": {}}}]}]},
    {"prompt": [None, {}, 1.5, True]}, {"max_tokens": "lots", "n": -3, "best_of": True},
    {"max_tokens": 0, "max_completion_tokens": None, "n": 1.5},
])
def test_estimate_tokens_survives_any_shape(body):
    assert isinstance(estimate_tokens(body), int) and estimate_tokens(body) >= 256


# ---------------------------------------------------------------- RateLimiter


def limited(rpm=None, tpm=None, clock=None) -> RateLimiter:
    return RateLimiter([ResolvedKey("a", KEY, rpm, tpm), ResolvedKey("free", OTHER)], clock or FakeClock())


def test_requests_per_minute():
    clock = FakeClock()
    rl = limited(rpm=2, clock=clock)
    rl.check_request("a")
    rl.check_request("a")
    with pytest.raises(RateLimited) as e:
        rl.check_request("a")
    assert e.value.retry_after == 30 and e.value.headers() == {"Retry-After": "30"}
    assert e.value.status == 429 and "2 requests per minute" in e.value.message
    clock.advance(29)
    with pytest.raises(RateLimited) as e:
        rl.check_request("a")
    assert e.value.retry_after == 1
    clock.advance(1)
    rl.check_request("a")
    for _ in range(100):  # no limits: never refused
        rl.check_request("free")
        rl.check_request(None)
        rl.check_request("unknown")


def test_tokens_per_minute_and_a_refusal_costs_nothing():
    clock = FakeClock()
    rl = limited(rpm=10, tpm=1000, clock=clock)
    body = {"messages": [{"role": "user", "content": "x" * 400}], "max_tokens": 300}  # 100 + 300 = 400
    for _ in range(2):
        rl.check_request("a")
        rl.check_tokens("a", take_in(body, "chat"))
    rl.check_request("a")
    requests_left, tokens_left = rl._requests["a"].tokens, rl._tokens["a"].tokens
    with pytest.raises(RateLimited) as e:
        rl.check_tokens("a", take_in(body, "chat"))  # 200 left, 400 needed at 1000/60 per s: 12 s
    assert e.value.retry_after == 12 and "1000 tokens per minute" in e.value.message
    assert rl._tokens["a"].tokens == tokens_left  # took nothing
    assert rl._requests["a"].tokens == requests_left + 1  # and gave the request back
    clock.advance(12)
    rl.check_tokens("a", take_in(body, "chat"))
    rl.check_tokens("free", take_in(body, "chat"))
    rl.check_tokens(None, take_in(body, "chat"))


def test_a_request_bigger_than_a_minute_of_tokens_is_a_400_not_a_429():
    rl = limited(tpm=1000)
    with pytest.raises(LimitExceeded) as e:
        rl.check_tokens("a", take_in({"prompt": "x", "max_tokens": 5000}, "chat"))
    assert e.value.status == 400 and e.value.param == "max_tokens"
    assert "about 5001 tokens" in e.value.message and "1000 tokens per minute" in e.value.message
    with pytest.raises(LimitExceeded) as e:
        rl.check_tokens("a", take_in({"prompt": "x" * 8000}, "chat"))
    assert e.value.param is None
    with pytest.raises(LimitExceeded):
        rl.check_tokens("a", take_in({"max_tokens": 10**5000, "n": 10**5000}, "chat"))  # huge numbers neither overflow nor print
    rl.check_tokens("a", take_in({"prompt": "x", "max_tokens": 10}, "chat"))  # the failures took nothing


# ---------------------------------------------------------------- check_limits


SMALL = LimitsConfig(max_messages=3, max_n=2, max_tokens_ceiling=100, max_prompt_chars=10)


@pytest.mark.parametrize("route, body, param, message", [
    ("chat", {"messages": [{"content": "a"}] * 4}, "messages", "messages: 4 messages exceed the limit of 3"),
    ("chat", {"messages": [{"content": "a" * 6}, {"content": [{"type": "text", "text": "b" * 5}]}]}, "messages",
     "messages: 11 characters of text exceed the limit of 10"),
    ("completions", {"prompt": "a" * 11}, "prompt", "prompt: 11 characters of text exceed the limit of 10"),
    ("completions", {"prompt": ["aaaaaa", "bbbbbb"]}, "prompt", "prompt: 12 characters of text exceed the limit of 10"),
    ("completions", {"prompt": ["a", "b", [1], "c"]}, "prompt", "prompt: 4 prompts exceed the limit of 3"),
    ("chat", {"n": 3}, "n", "n must be at most 2, got 3. To increase this limit, set limits.max_n in the server's configuration."),
    ("completions", {"best_of": 5}, "best_of", "best_of must be at most 2, got 5. To increase this limit, set limits.max_n in the server's configuration."),
    ("chat", {"max_tokens": 101}, "max_tokens", "max_tokens: 101 exceeds the limit of 100"),
    ("chat", {"max_completion_tokens": 100.5}, "max_completion_tokens",
     "max_completion_tokens: 100.5 exceeds the limit of 100"),
    ("chat", {"n": float("inf")}, "n", "n must be at most 2, got inf. To increase this limit, set limits.max_n in the server's configuration."),
    ("chat", {"n": 10**100}, "n", "n must be at most 2, got a huge number. To increase this limit, set limits.max_n in the server's configuration."),
])
def test_check_limits_names_the_field_and_the_limit(route, body, param, message):
    with pytest.raises(LimitExceeded) as e:
        check_limits(take_in(body, route), SMALL)
    assert (e.value.param, e.value.message, e.value.status) == (param, message, 400)
    assert e.value.envelope() == {"error": {"message": message, "type": "invalid_request_error", "param": param,
                                            "code": 400}}


@pytest.mark.parametrize("route, body", [
    ("chat", {"messages": [{"content": "a"}] * 3, "n": 2, "max_tokens": 100, "max_completion_tokens": 100}),
    ("completions", {"prompt": list(range(5000))}),  # token ids: not prompts, not characters
    ("completions", {"prompt": [[1, 2]] * 3}),
    ("completions", {"messages": [{"content": "a"}] * 50}),  # not this route's field
    ("chat", {"prompt": "a" * 50}),
    ("chat", {"messages": [{"content": {"text": "a" * 50}}, {"content": [{"image_url": "x" * 50}]}]}),
    ("chat", {"n": True, "max_tokens": "9999", "best_of": None, "n_": 99}),
    ("chat", {"n": float("nan")}),
])
def test_check_limits_passes_what_is_within_limits_or_not_its_business(route, body):
    check_limits(take_in(body, route), SMALL)


@pytest.mark.parametrize("body", [
    None, [], "x", 1.5, {"messages": None}, {"messages": "a" * 100}, {"messages": {"content": "x"}},
    {"messages": [None, [], 3, "str", {"content": None}, {"content": 7}, {"content": [None, 1, {"text": None}]}]},
    {"messages": [{"content": "x", "tool_calls": "nope"}, {"tool_calls": [None, {"function": None}]}]},
    {"prompt": None}, {"prompt": 12}, {"prompt": {"a": "b" * 100}}, {"prompt": [None, {}, 1.5, [None]]},
    {"n": "3", "best_of": [5], "max_tokens": {"x": 1}, "max_completion_tokens": None},
    {"n": -(10**100)},
])
@pytest.mark.parametrize("route", ["chat", "completions", "other"])
def test_check_limits_survives_any_shape(body, route):
    if not isinstance(body, dict):  # refused before the limits are checked
        with pytest.raises(TandemError, match="must be a JSON object"):
            parse_json(json.dumps(body).encode(), 32)
        return
    check_limits(take_in(body, route), LimitsConfig())
    try:
        check_limits(take_in(body, route), SMALL)
    except LimitExceeded:
        pass  # the only exception it may raise


def test_check_limits_with_every_limit_off_passes_anything():
    off = LimitsConfig(max_body_bytes=None, max_messages=None, max_n=None, max_tokens_ceiling=None,
                       max_prompt_chars=None)
    check_limits(take_in({"messages": [{"content": "a" * 10**6}] * 5000, "n": 10**9, "max_tokens": 10**9}, "chat"),
                 off)
    check_limits(take_in({"prompt": ["a"] * 5000}, "completions"), off)


def test_route_other_checks_both_fields():
    with pytest.raises(LimitExceeded, match="prompt"):
        check_limits(take_in({"prompt": "a" * 11}, "other"), SMALL)
    with pytest.raises(LimitExceeded, match="messages"):
        check_limits(take_in({"messages": [{}] * 4}, "other"), SMALL)


# ---------------------------------------------------------------- errors


def test_error_envelopes_and_headers():
    assert Unauthenticated("no").envelope() == {"error": {"message": "no", "type": "authentication_error",
                                                          "param": None, "code": "invalid_api_key"}}
    assert (Unauthenticated("no").status, Unauthenticated("no").headers()) == (401, {"WWW-Authenticate": "Bearer"})
    r = RateLimited(0, "slow down")
    assert (r.status, r.retry_after, r.envelope()["error"]["type"], r.code) == (429, 1, "rate_limit_error",
                                                                                "rate_limit_exceeded")
    b = BodyTooLarge(10)
    assert (b.status, b.code, b.error_type) == (413, "request_too_large", "invalid_request_error")
    assert (LimitExceeded("m", "p").status, LimitExceeded("m", "p").param) == (400, "p")
    assert all(issubclass(c, TandemError) for c in (Unauthenticated, RateLimited, LimitExceeded, BodyTooLarge))


# ---------------------------------------------------------------- ASGI: auth


def test_missing_wrong_and_right_keys(caplog):
    caplog.set_level(logging.DEBUG)
    app = make_app()
    responses = send(
        app,
        ("POST", "/v1/chat/completions", {"json": CHAT}),
        ("POST", "/v1/chat/completions", {"json": CHAT, "headers": bearer("sk-wrong")}),
        ("POST", "/v1/chat/completions", {"json": CHAT, "headers": bearer(KEY[:-1])}),
        ("POST", "/v1/chat/completions", {"json": CHAT, "headers": {"Authorization": f"Basic {KEY}"}}),
        ("POST", "/v1/chat/completions", {"json": CHAT, "headers": {"Authorization": "Bearer "}}),
        ("POST", "/v1/chat/completions", {"json": CHAT, "headers": {"x-api-key": KEY}}),  # only Bearer counts
        ("GET", "/v1/models", {}),
        ("POST", "/v1/chat/completions", {"json": CHAT, "headers": bearer(KEY)}),
        ("POST", "/v1/chat/completions", {"json": CHAT, "headers": {"authorization": f"bearer  {OTHER} "}}),
        ("GET", "/v1/models", {"headers": bearer(OTHER)}),
    )
    for r in responses[:7]:
        err = assert_envelope(r, 401, "authentication_error", "invalid_api_key")
        assert r.headers["www-authenticate"] == "Bearer"
        assert err["message"]
    assert "missing API key" in responses[0].json()["error"]["message"]
    assert responses[1].json()["error"]["message"] == "invalid API key"
    assert "malformed" in responses[3].json()["error"]["message"]
    assert responses[7].json() == {"ok": True, "key_name": "alice"}
    assert responses[8].json() == {"ok": True, "key_name": "key-1"}
    assert responses[9].status_code == 200
    assert_no_key(responses, caplog)
    assert "refused POST /v1/chat/completions: invalid API key" in caplog.text


def test_public_paths_need_no_key():
    app = make_app()
    assert one(app, "GET", "/health").status_code == 200
    assert one(app, "GET", "/ready").status_code == 200
    assert one(app, "GET", "/health/").status_code == 401  # exact match only
    closed = make_app(AuthConfig(api_keys=[ApiKey(key=KEY)], ready_public=False))
    assert one(closed, "GET", "/ready").status_code == 401
    assert one(closed, "GET", "/health").status_code == 200


def test_auth_off_without_keys():
    app = make_app(AuthConfig(default_requests_per_minute=1, default_tokens_per_minute=1))
    responses = send(app, *[("POST", "/v1/chat/completions", {"json": CHAT})] * 3)
    assert [r.json() for r in responses] == [{"ok": True, "key_name": None}] * 3


def test_cors_preflight_and_refusals_carry_cors_headers():
    cors = CorsConfig(allow_origins=["https://ui.example"])
    app = make_app(cors=cors)
    pre = one(app, "OPTIONS", "/v1/chat/completions", headers={
        "Origin": "https://ui.example", "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type, x-stainless-os"})
    assert pre.status_code == 200
    assert pre.headers["access-control-allow-origin"] == "https://ui.example"
    assert "authorization" in pre.headers["access-control-allow-headers"].lower()
    refused = one(app, "POST", "/v1/chat/completions", json=CHAT, headers={"Origin": "https://ui.example"})
    assert refused.status_code == 401 and refused.headers["access-control-allow-origin"] == "https://ui.example"
    assert "Retry-After" in refused.headers["access-control-expose-headers"]
    assert one(app, "OPTIONS", "/v1/chat/completions").status_code == 401  # not a preflight


def test_websocket_without_a_key_is_closed_and_lifespan_passes():
    seen = []

    async def inner(scope, receive, send):
        seen.append(scope["type"])

    mw = AuthMiddleware(inner, KeyStore([ResolvedKey("a", KEY)]), RateLimiter(), ["/health"])
    sent = []

    async def collect(message):
        sent.append(message)

    async def main():
        await mw({"type": "websocket", "path": "/ws", "headers": []}, None, collect)
        await mw({"type": "websocket", "path": "/ws", "headers": [(b"authorization", f"Bearer {KEY}".encode())]},
                 None, collect)
        await mw({"type": "lifespan"}, None, collect)

    asyncio.run(main())
    assert sent == [{"type": "websocket.close", "code": 1008}]
    assert seen == ["websocket", "lifespan"]


# ---------------------------------------------------------------- ASGI: rate limits


def test_requests_per_minute_429_then_recovered(caplog):
    caplog.set_level(logging.DEBUG)
    clock = FakeClock()
    rejected = []
    auth = AuthConfig(api_keys=[ApiKey(key=KEY, name="alice", requests_per_minute=2), ApiKey(key=OTHER)])
    app = make_app(auth, clock=clock, on_reject=lambda scope, err: rejected.append((scope["path"], err.status)))
    call = ("POST", "/v1/chat/completions", {"json": CHAT, "headers": bearer()})
    responses = send(app, call, call, call, ("GET", "/v1/models", {"headers": bearer(OTHER)}))
    assert [r.status_code for r in responses] == [200, 200, 429, 200]  # the other key is not limited
    err = assert_envelope(responses[2], 429, "rate_limit_error", "rate_limit_exceeded")
    assert responses[2].headers["retry-after"] == "30" and "'alice'" in err["message"]
    assert rejected == [("/v1/chat/completions", 429)]
    clock.advance(30)
    assert one(app, *call[:2], **call[2]).status_code == 200
    assert one(app, "GET", "/health").status_code == 200  # public paths are not counted
    assert_no_key(responses, caplog)


def test_tokens_per_minute_429_then_recovered():
    clock = FakeClock()
    reached = []
    app = make_app(AuthConfig(api_keys=[ApiKey(key=KEY, tokens_per_minute=600)]), clock=clock, reached=reached)
    body = {"model": "m", "messages": [{"role": "user", "content": "x" * 400}], "max_tokens": 200}  # 300 tokens
    call = ("POST", "/v1/chat/completions", {"json": body, "headers": bearer()})
    responses = send(app, call, call, call)
    assert [r.status_code for r in responses] == [200, 200, 429]
    assert_envelope(responses[2], 429, "rate_limit_error", "rate_limit_exceeded")
    assert responses[2].headers["retry-after"] == "30"  # 300 tokens at 10/s
    clock.advance(29)
    assert one(app, *call[:2], **call[2]).status_code == 429
    clock.advance(1)
    assert one(app, *call[:2], **call[2]).status_code == 200
    too_big = one(app, "POST", "/v1/chat/completions", json={**body, "max_tokens": 5000}, headers=bearer())
    assert_envelope(too_big, 400, "invalid_request_error", 400, "max_tokens")
    assert len(reached) == 3


# ---------------------------------------------------------------- ASGI: body size and input limits


def test_413_on_content_length_before_the_app_runs():
    reached = []
    app = make_app(limits=LimitsConfig(max_body_bytes=100), reached=reached)
    big = {"model": "m", "messages": [{"role": "user", "content": "x" * 200}]}
    r = one(app, "POST", "/v1/chat/completions", json=big, headers=bearer())
    assert_envelope(r, 413, "invalid_request_error", "request_too_large")
    assert "limit of 100 bytes" in r.json()["error"]["message"]
    assert one(app, "POST", "/v1/chat/completions", json=big).status_code == 401  # auth comes first
    assert one(app, "POST", "/v1/chat/completions", json=CHAT, headers=bearer()).status_code == 200
    assert reached == ["alice"]


def chunks(*parts: bytes):
    async def gen():
        for p in parts:
            yield p

    return gen()


@pytest.mark.parametrize("handler", ["security_error", "exception_only", "pydantic_body"])
def test_413_on_a_chunked_body_growing_past_the_limit(handler, caplog):
    """Whatever the app does with the exception raised from receive (its own TandemError
    handler, a catch-all 500, FastAPI's 400 for a body it cannot parse), the answer is 413."""
    caplog.set_level(logging.DEBUG)
    app = FastAPI()
    reached = []

    if handler == "security_error":
        @app.exception_handler(TandemError)
        async def _refused(request: Request, exc: TandemError):
            return JSONResponse(exc.envelope(), status_code=exc.status, headers=exc.headers())

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception):
        return JSONResponse({"error": {"message": "internal"}}, status_code=500)

    class Body(BaseModel):
        text: str

    if handler == "pydantic_body":
        @app.post("/echo")
        async def echo_model(body: Body):
            reached.append(1)
            return {"n": len(body.text)}
    else:
        @app.post("/echo")
        async def echo(request: Request):
            raw = await request.body()
            reached.append(1)
            return {"n": len(raw)}

    app.add_middleware(BodySizeLimit, max_body_bytes=50)
    r = one(app, "POST", "/echo", content=chunks(b'{"text": "', b"x" * 30, b"y" * 30, b'"}'),
            headers={"Content-Type": "application/json"})
    assert "content-length" not in r.request.headers
    assert_envelope(r, 413, "invalid_request_error", "request_too_large")
    assert reached == []
    ok = one(app, "POST", "/echo", content=chunks(b'{"text": "', b"x" * 20, b'"}'),
             headers={"Content-Type": "application/json"})
    assert ok.status_code == 200
    assert "body over 50 bytes" in caplog.text


def test_body_size_limit_as_the_outermost_wrapper():
    app = FastAPI()

    @app.post("/echo")
    async def echo(request: Request):
        return {"n": len(await request.body())}

    wrapped = BodySizeLimit(app, max_body_bytes=10)
    r = one(wrapped, "POST", "/echo", content=chunks(b"x" * 6, b"y" * 6))
    assert_envelope(r, 413, "invalid_request_error", "request_too_large")
    assert one(wrapped, "POST", "/echo", content=b"x" * 11).status_code == 413
    assert one(wrapped, "POST", "/echo", content=b"x" * 10).json() == {"n": 10}


def test_body_size_limit_when_the_app_swallows_the_error():
    async def swallowing(scope, receive, send):
        try:
            await receive()
        except BodyTooLarge:
            return

    r = one(BodySizeLimit(swallowing, max_body_bytes=1), "POST", "/", content=chunks(b"xx"))
    assert r.status_code == 413


@pytest.mark.parametrize("body, param", [
    ({"messages": [{"role": "user", "content": "a"}] * 4}, "messages"),
    ({"messages": [{"role": "user", "content": "a" * 11}]}, "messages"),
    ({**CHAT, "n": 3}, "n"),
    ({**CHAT, "max_tokens": 101}, "max_tokens"),
    ({**CHAT, "max_completion_tokens": 101}, "max_completion_tokens"),
])
def test_input_limits_through_the_app(body, param):
    app = make_app(limits=SMALL)
    r = one(app, "POST", "/v1/chat/completions", json={"model": "m", **body}, headers=bearer())
    err = assert_envelope(r, 400, "invalid_request_error", 400, param)
    assert err["message"].startswith((f"{param}: ", f"{param} must be at most "))


def test_install_security_orders_cors_auth_body_limit():
    app = FastAPI()
    install_security(app, AuthConfig(api_keys=[ApiKey(key=KEY)]), LimitsConfig(),
                     CorsConfig(allow_origins=["*"]), environ={})
    assert [m.cls.__name__ for m in app.user_middleware] == ["CORSMiddleware", "AuthMiddleware", "BodySizeLimit"]
    bare = FastAPI()
    install_security(bare, AuthConfig(), LimitsConfig(max_body_bytes=None), CorsConfig(), environ={})
    assert bare.user_middleware == []


def test_install_security_fails_on_an_unreadable_key():
    with pytest.raises(ValueError, match="environment variable NOPE is not set"):
        install_security(FastAPI(), AuthConfig(api_keys=[ApiKey(key_env="NOPE")]), LimitsConfig(), CorsConfig(),
                         environ={})


def test_module_reads_environment_only_in_resolve_keys():
    import inspect

    from gateway.admission import keys as auth
    from gateway.request import limits
    assert inspect.getsource(auth).count("os.environ") == 1
    assert "os.environ" not in inspect.getsource(security) + inspect.getsource(limits)
