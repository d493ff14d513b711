"""API keys, per-key rate limits and input limits: what the gateway checks at its edge.

- ``AuthMiddleware`` (pure ASGI): ``Authorization: Bearer <key>`` or 401, then the key's
  requests per minute or 429 with ``Retry-After``. Public paths and CORS preflights pass.
- ``BodySizeLimit`` (pure ASGI): a body over ``max_body_bytes`` is 413, whether Content-Length
  says so or a chunked body grows past it while it is received.
- ``check_limits`` and ``RateLimiter.check_tokens``: called by the routes once the JSON body
  is parsed; they raise ``LimitExceeded`` (400) and ``RateLimited`` (429).

Every refusal is a ``SecurityError`` and leaves in the OpenAI envelope. A key is never logged
or echoed: the store keeps only SHA-256 digests and compares a token with every one of them.
``resolve_keys`` is the one place that reads key environment variables and files.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import math
import os
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, SecretStr, model_validator
from starlette.middleware.cors import CORSMiddleware
from starlette.types import ASGIApp, Receive, Scope, Send

from gateway.errors import STATUS_TABLE, ErrorKind, TandemError

logger = logging.getLogger(__name__)

MiB = 1024 * 1024
CHARS_PER_TOKEN = 4  # the estimate of prompt tokens: ceil(characters / 4)
DEFAULT_MAX_OUTPUT_TOKENS = 256  # the estimate of output tokens when a request names none


# ---------------------------------------------------------------- configuration


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ApiKey(_Strict):
    key: SecretStr | None = Field(None, description="The key itself (prefer key_env or key_file: configs get shared).")
    key_env: str | None = Field(None, min_length=1, description="An environment variable that holds the key.")
    key_file: Path | None = Field(None, description="A file that holds the key (surrounding whitespace is stripped); "
                                  "a relative path is relative to the config file's folder.")
    name: str | None = Field(None, min_length=1, pattern=r"^\S(.*\S)?$",
                             description="Shown in logs and messages instead of the key. Default: `key-<i>`, i "
                             "being the 0-based position in auth.api_keys.")
    requests_per_minute: int | None = Field(None, ge=1, description="Requests this key may make per minute "
                                            "(burst: a minute's worth). None: auth.default_requests_per_minute.")
    tokens_per_minute: int | None = Field(None, ge=1, description="Estimated tokens (prompt chars / 4 + max output "
                                          "tokens x n) this key may spend per minute. None: "
                                          "auth.default_tokens_per_minute.")

    @model_validator(mode="after")
    def _exactly_one_source(self) -> ApiKey:
        given = [n for n in ("key", "key_env", "key_file") if getattr(self, n) is not None]
        if len(given) != 1:
            raise ValueError(f"give exactly one of key, key_env, key_file (got {', '.join(given) or 'none'})")
        return self


class AuthConfig(_Strict):
    api_keys: list[ApiKey] = Field(default_factory=list, description="The keys clients may send. With neither "
                                   "api_keys nor api_keys_env, auth is off and every request is served.")
    api_keys_env: str | None = Field(None, min_length=1, description="An environment variable holding more keys, "
                                     "comma-separated; named `<VAR>[<i>]`, with the default limits.")
    public_paths: list[str] = Field(default_factory=lambda: ["/health"], description="Paths served without a key "
                                    "(exact match; add /metrics here for an unauthenticated scraper).")
    ready_public: bool = Field(True, description="Serve /ready without a key too (load balancers probe it).")
    default_requests_per_minute: int | None = Field(None, ge=1, description="Requests per minute of a key that "
                                                    "names none. None: no limit.")
    default_tokens_per_minute: int | None = Field(None, ge=1, description="Estimated tokens per minute of a key "
                                                  "that names none. None: no limit.")

    @model_validator(mode="after")
    def _check(self) -> AuthConfig:
        names = [k.name for k in self.api_keys if k.name is not None]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"API key names must be unique; repeated: {', '.join(dupes)}")
        bad = [p for p in self.public_paths if not p.startswith("/")]
        if bad:
            raise ValueError(f"public paths must start with '/': {', '.join(bad)}")
        return self

    @property
    def enabled(self) -> bool:
        return bool(self.api_keys) or self.api_keys_env is not None

    def public(self) -> frozenset[str]:
        return frozenset([*self.public_paths, *(["/ready"] if self.ready_public else [])])


class LimitsConfig(_Strict):
    max_body_bytes: int | None = Field(4 * MiB, ge=1, description="Largest request body in bytes; beyond, 413. "
                                       "None: no limit.")
    max_messages: int | None = Field(1024, ge=1, description="Most messages in a chat request, and prompts in a "
                                     "batched completions request. None: no limit.")
    max_tokens_ceiling: int | None = Field(None, ge=1, description="Largest max_tokens / max_completion_tokens a "
                                           "request may ask for. None: only the model's context length bounds it.")
    max_n: int | None = Field(16, ge=1, description="Largest n (and best_of): choices generated per request. "
                              "None: no limit.")
    max_prompt_chars: int | None = Field(1_000_000, ge=1, description="Most characters of prompt or message text "
                                         "in one request (token-id prompts are left to the engine's context "
                                         "check). None: no limit.")
    max_json_depth: int = Field(32, ge=4, description="Deepest nesting of the JSON body (OpenAI requests need "
                                "under 10; deeper is 400 before anything recurses over it).")
    request_timeout_s: float | None = Field(600, gt=0, description="Wall-clock limit on one request, queueing and "
                                            "generation included; the app enforces it. None: no limit.")


class CorsConfig(_Strict):
    allow_origins: list[str] = Field(default_factory=list, description="Origins that may call the API from a "
                                     "browser ('*': any). Empty: CORS is off.")
    allow_methods: list[str] = Field(default_factory=lambda: ["GET", "POST", "OPTIONS"],
                                     description="Methods a cross-origin request may use.")
    allow_headers: list[str] = Field(default_factory=lambda: ["*"], description="Request headers a cross-origin "
                                     "request may send ('*' echoes what the preflight asks, Authorization included).")
    expose_headers: list[str] = Field(default_factory=lambda: ["Retry-After", "X-Request-Id"],
                                      description="Response headers a browser script may read.")
    allow_credentials: bool = Field(False, description="Allow cookies / HTTP auth (never with origin '*').")
    max_age: int = Field(600, ge=0, description="Seconds a browser may cache a preflight answer.")

    @model_validator(mode="after")
    def _no_credentials_for_any_origin(self) -> CorsConfig:
        if self.allow_credentials and "*" in self.allow_origins:
            raise ValueError("allow_credentials cannot be used with allow_origins '*'")
        return self

    @property
    def enabled(self) -> bool:
        return bool(self.allow_origins)

    def middleware_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of starlette's ``CORSMiddleware``."""
        return self.model_dump()


# ---------------------------------------------------------------- errors


class SecurityError(Exception):
    """A request refused at the edge. Its kind is one of ``gateway.errors``' (one status table);
    ``status``, ``headers()`` and ``envelope()`` are its answer."""

    kind: ErrorKind = ErrorKind.INVALID_REQUEST

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message, param)
        self.message = message
        self.param = param

    def __str__(self) -> str:
        return self.message

    def to_tandem(self) -> TandemError:
        return TandemError(self.kind, self.message, self.param, retry_after=getattr(self, "retry_after", None))

    @property
    def status(self) -> int:
        return STATUS_TABLE[self.kind][0]

    @property
    def error_type(self) -> str:
        return STATUS_TABLE[self.kind][1]

    @property
    def code(self) -> str | int:
        return self.envelope()["error"]["code"]

    def headers(self) -> dict[str, str]:
        return self.to_tandem().headers()

    def envelope(self) -> dict:
        return self.to_tandem().envelope()

    async def send_to(self, send: Send) -> None:
        """Answer with this error directly on an ASGI ``send`` (for the middlewares)."""
        body = json.dumps(self.envelope()).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        headers += [(k.lower().encode(), v.encode()) for k, v in self.headers().items()]
        await send({"type": "http.response.start", "status": self.status, "headers": headers})
        await send({"type": "http.response.body", "body": body})


class Unauthenticated(SecurityError):
    kind = ErrorKind.UNAUTHORIZED

    def headers(self) -> dict[str, str]:
        return {"WWW-Authenticate": "Bearer"}


class RateLimited(SecurityError):
    kind = ErrorKind.RATE_LIMITED

    def __init__(self, retry_after: int, message: str):
        super().__init__(message)
        self.args = (retry_after, message)
        self.retry_after = max(1, int(retry_after))


class LimitExceeded(SecurityError):
    """An input limit (400, the field named in ``param``)."""

    def __init__(self, message: str, param: str | None):
        super().__init__(message, param)


class BodyTooLarge(SecurityError):
    kind = ErrorKind.REQUEST_TOO_LARGE

    def __init__(self, max_body_bytes: int):
        super().__init__(f"the request body is larger than the limit of {max_body_bytes} bytes")
        self.args = (max_body_bytes,)

    def headers(self) -> dict[str, str]:
        return {"Connection": "close"}  # the rest of the body is never read


# ---------------------------------------------------------------- keys


@dataclass(frozen=True)
class ResolvedKey:
    name: str
    key: str = field(repr=False)
    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None


def resolve_keys(cfg: AuthConfig, environ: Mapping[str, str] | None = None,
                 base_dir: Path | None = None) -> list[ResolvedKey]:
    """Read every key from the config, its environment variables and files. A ValueError names
    the missing variable or file, or the key's name; never the key."""
    env = os.environ if environ is None else environ
    rpm, tpm = cfg.default_requests_per_minute, cfg.default_tokens_per_minute
    keys = []
    for i, k in enumerate(cfg.api_keys):
        name = k.name or f"key-{i}"
        keys.append(ResolvedKey(name, _valid_key(_read_key(k, name, env, base_dir), name),
                                k.requests_per_minute if k.requests_per_minute is not None else rpm,
                                k.tokens_per_minute if k.tokens_per_minute is not None else tpm))
    if cfg.api_keys_env is not None:
        raw = env.get(cfg.api_keys_env)
        if raw is None:
            raise ValueError(f"auth.api_keys_env: environment variable {cfg.api_keys_env} is not set")
        listed = [p.strip() for p in raw.split(",") if p.strip()]
        if not listed:
            raise ValueError(f"auth.api_keys_env: environment variable {cfg.api_keys_env} holds no keys")
        for j, key in enumerate(listed):
            name = f"{cfg.api_keys_env}[{j}]"
            keys.append(ResolvedKey(name, _valid_key(key, name), rpm, tpm))
    by_key: dict[str, str] = {}
    for k in keys:
        if k.key in by_key:
            raise ValueError(f"API keys {by_key[k.key]!r} and {k.name!r} are the same key")
        by_key[k.key] = k.name
    names = [k.name for k in keys]
    if len(set(names)) != len(names):
        raise ValueError(f"API key names must be unique; got {', '.join(names)}")
    return keys


def _read_key(k: ApiKey, name: str, env: Mapping[str, str], base_dir: Path | None) -> str:
    if k.key is not None:
        return k.key.get_secret_value()
    if k.key_env is not None:
        if k.key_env not in env:
            raise ValueError(f"API key {name!r}: environment variable {k.key_env} is not set")
        return env[k.key_env].strip()
    assert k.key_file is not None, "this is a bug: ApiKey validated with no source"
    path = k.key_file if k.key_file.is_absolute() or base_dir is None else base_dir / k.key_file
    try:
        return path.read_text().strip()
    except OSError as e:
        raise ValueError(f"API key {name!r}: cannot read key file {path}: {e.strerror or type(e).__name__}") from None
    except UnicodeDecodeError:
        raise ValueError(f"API key {name!r}: key file {path} is not UTF-8 text") from None


def _valid_key(key: str, name: str) -> str:
    if not key:
        raise ValueError(f"API key {name!r} is empty")
    if not all(33 <= ord(c) <= 126 for c in key):  # it travels in an HTTP header
        raise ValueError(f"API key {name!r} must be printable ASCII without spaces")
    return key


def _digest(raw: bytes) -> bytes:
    return hashlib.sha256(raw).digest()


class KeyStore:
    """Which configured key a bearer token is. Holds only digests; comparing equal-length digests
    with ``hmac.compare_digest`` against every key, without an early exit, leaks neither a key's
    length nor which key came close."""

    def __init__(self, keys: Iterable[ResolvedKey]):
        self._entries = [(_digest(k.key.encode()), k.name) for k in keys]

    def __len__(self) -> int:
        return len(self._entries)

    def lookup(self, token: str | bytes) -> str | None:
        raw = token.encode("utf-8", "surrogatepass") if isinstance(token, str) else token
        digest = _digest(raw)
        found = None
        for stored, name in self._entries:
            if hmac.compare_digest(digest, stored) and found is None:
                found = name
        return found


# ---------------------------------------------------------------- rate limits


class TokenBucket:
    """``capacity`` tokens, refilled evenly at ``refill_per_s``; starts full. The caller passes
    ``now`` (any monotonic clock), so tests drive it with a fake one."""

    def __init__(self, capacity: float, refill_per_s: float):
        if not (capacity > 0 and refill_per_s > 0):
            raise ValueError("a token bucket needs a positive capacity and refill rate")
        self.capacity = capacity
        self.refill_per_s = refill_per_s
        self.tokens = float(capacity)
        self._last: float | None = None

    def _refill(self, now: float) -> None:
        if self._last is not None and now > self._last:
            self.tokens = min(self.capacity, self.tokens + (now - self._last) * self.refill_per_s)
        if self._last is None or now > self._last:  # a clock that steps back refills nothing
            self._last = now

    def try_take(self, amount: float, now: float) -> float:
        """Take ``amount`` and return 0.0; or take nothing and return the seconds until
        ``amount`` will be there (``math.inf`` if it is more than the bucket holds)."""
        self._refill(now)
        if amount <= self.tokens:
            self.tokens -= amount
            return 0.0
        if amount > self.capacity:
            return math.inf
        return (amount - self.tokens) / self.refill_per_s

    def give_back(self, amount: float) -> None:
        self.tokens = min(self.capacity, self.tokens + amount)


def _count(v: Any) -> int | None:
    """``v`` if it is a positive integer (not a bool), else None."""
    return v if isinstance(v, int) and not isinstance(v, bool) and v > 0 else None


def estimate_tokens(body: Any) -> int:
    """What a request may cost: ceil(prompt or message characters / 4) + token ids given + the
    output it may produce, (max_completion_tokens or max_tokens or 256) x max(n, best_of)."""
    if not isinstance(body, dict):
        return DEFAULT_MAX_OUTPUT_TOKENS
    chars, ids = _prompt_size(body.get("prompt"))
    chars += _messages_chars(body.get("messages"))
    out = _count(body.get("max_completion_tokens")) or _count(body.get("max_tokens")) or DEFAULT_MAX_OUTPUT_TOKENS
    copies = max(_count(body.get("n")) or 1, _count(body.get("best_of")) or 1)
    return math.ceil(chars / CHARS_PER_TOKEN) + ids + out * copies


class RateLimiter:
    """Per-key request and token buckets, each holding a minute's worth and refilling evenly.
    Its methods never await, so each check is atomic on the event loop. A key without limits,
    or no key at all (auth off: ``key_name`` None), is never limited."""

    def __init__(self, keys: Iterable[ResolvedKey] = (), clock: Callable[[], float] = time.monotonic):
        self.clock = clock
        self._requests: dict[str, TokenBucket] = {}
        self._tokens: dict[str, TokenBucket] = {}
        for k in keys:
            if k.requests_per_minute is not None:
                self._requests[k.name] = TokenBucket(k.requests_per_minute, k.requests_per_minute / 60)
            if k.tokens_per_minute is not None:
                self._tokens[k.name] = TokenBucket(k.tokens_per_minute, k.tokens_per_minute / 60)

    def check_request(self, key_name: str | None) -> None:
        """Called by AuthMiddleware once per authenticated request: takes one request from the
        key's bucket, or raises RateLimited and takes nothing."""
        bucket = self._requests.get(key_name) if key_name is not None else None
        if bucket is None:
            return
        wait = bucket.try_take(1, self.clock())
        if wait:
            raise RateLimited(math.ceil(wait), f"rate limit reached for API key {key_name!r}: "
                              f"{bucket.capacity} requests per minute; retry in {math.ceil(wait)} s")

    def check_tokens(self, key_name: str | None, body: Any) -> None:
        """Called by a generation route once its JSON body is parsed (after ``check_limits``),
        once per request that passed AuthMiddleware. Takes ``estimate_tokens(body)`` from the
        key's bucket, or raises RateLimited (429), or LimitExceeded (400) when the request alone
        needs more than a minute's worth. A refused request also gets back the request that
        check_request took: it costs nothing."""
        bucket = self._tokens.get(key_name) if key_name is not None else None
        if bucket is None:
            return
        need = estimate_tokens(body)
        wait = bucket.try_take(need, self.clock())
        if not wait:
            return
        if key_name in self._requests:
            self._requests[key_name].give_back(1)
        limit = f"{int(bucket.capacity)} tokens per minute"
        if math.isinf(wait):
            fields = ("max_completion_tokens", "max_tokens") if isinstance(body, dict) else ()
            param = next((p for p in fields if _count(body.get(p))), None)
            raise LimitExceeded(f"this request may use about {_show(need)} tokens (prompt + max output tokens x n), "
                                f"more than API key {key_name!r} may use: {limit}", param)
        raise RateLimited(math.ceil(wait), f"rate limit reached for API key {key_name!r}: {limit}; this request "
                          f"may use about {need} tokens; retry in {math.ceil(wait)} s")


# ---------------------------------------------------------------- input limits
# Robust to any JSON shape: a field of an unexpected type is skipped here, and the engine's
# validation names it. Nothing below may raise anything but LimitExceeded.


def _content_chars(content: Any) -> int:
    if isinstance(content, str):
        return len(content)
    if not isinstance(content, list):
        return 0
    total = 0
    for part in content:  # text parts only: an image's base64 is not prompt text
        if isinstance(part, str):
            total += len(part)
        elif isinstance(part, dict) and isinstance(part.get("text"), str):
            total += len(part["text"])
    return total


def _messages_chars(messages: Any) -> int:
    if not isinstance(messages, list):
        return 0
    total = 0
    for m in messages:
        if not isinstance(m, dict):
            continue
        total += _content_chars(m.get("content"))
        calls = m.get("tool_calls")
        for call in calls if isinstance(calls, list) else ():
            fn = call.get("function") if isinstance(call, dict) else None
            if isinstance(fn, dict) and isinstance(fn.get("arguments"), str):
                total += len(fn["arguments"])
    return total


def _prompt_size(prompt: Any) -> tuple[int, int]:
    """(characters of text, token ids) of a completions prompt: a string, a list of strings,
    a list of token ids, or a list of such lists."""
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


def _show(v: int | float) -> str:
    return str(v) if isinstance(v, float) or -(10**30) < v < 10**30 else "a huge number"


def _check_number(body: dict, name: str, limit: int | None) -> None:
    v = body.get(name)
    if limit is None or isinstance(v, bool) or not isinstance(v, int | float):
        return
    if v > limit:
        raise LimitExceeded(f"{name}: {_show(v)} exceeds the limit of {limit}", name)


def _check_size(param: str, count: int, what: str, limit: int | None) -> None:
    if limit is not None and count > limit:
        raise LimitExceeded(f"{param}: {count} {what} exceed the limit of {limit}", param)


def check_limits(body: Any, limits: LimitsConfig, route: str) -> None:
    """Called by a generation route once its JSON body is parsed, before ``check_tokens``.
    ``route`` is "chat" (checks messages) or "completions" (checks prompt); any other value
    checks both. Raises LimitExceeded (400) naming the field and the limit."""
    if not isinstance(body, dict):
        return
    messages, prompt = body.get("messages"), body.get("prompt")
    if route != "completions" and isinstance(messages, list):
        _check_size("messages", len(messages), "messages", limits.max_messages)
        _check_size("messages", _messages_chars(messages), "characters of text", limits.max_prompt_chars)
    if route != "chat" and isinstance(prompt, list):
        _check_size("prompt", sum(isinstance(p, str | list) for p in prompt), "prompts", limits.max_messages)
    if route != "chat":
        _check_size("prompt", _prompt_size(prompt)[0], "characters of text", limits.max_prompt_chars)
    for name in ("n", "best_of"):
        _check_number(body, name, limits.max_n)
    for name in ("max_tokens", "max_completion_tokens"):
        _check_number(body, name, limits.max_tokens_ceiling)


# ---------------------------------------------------------------- middlewares


def _header(scope: Scope, name: bytes) -> bytes | None:
    return next((v for k, v in scope.get("headers", ()) if k.lower() == name), None)


def _declared_length(scope: Scope) -> int | None:
    raw = (_header(scope, b"content-length") or b"").strip()
    if not raw.isdigit():
        return None  # absent (chunked) or malformed: the server's HTTP parser deals with the latter
    return int(raw) if len(raw) <= 18 else 10**18


def _is_preflight(scope: Scope) -> bool:
    return scope.get("method") == "OPTIONS" and _header(scope, b"access-control-request-method") is not None


class AuthMiddleware:
    """``Authorization: Bearer <key>`` on every path but the public ones (and CORS preflights),
    then the key's requests per minute. Sets ``scope["state"]["tandem_key_name"]`` for logs and
    for ``RateLimiter.check_tokens``. ``on_reject(scope, error)`` is called on each refusal
    (for metrics)."""

    def __init__(self, app: ASGIApp, keystore: KeyStore, limiter: RateLimiter, public_paths: Iterable[str],
                 on_reject: Callable[[Scope, SecurityError], None] | None = None):
        self.app = app
        self.keystore = keystore
        self.limiter = limiter
        self.public_paths = frozenset(public_paths)
        self.on_reject = on_reject

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket") or scope["path"] in self.public_paths or _is_preflight(scope):
            return await self.app(scope, receive, send)
        try:
            name = self._authenticate(scope)
            scope.setdefault("state", {})["tandem_key_name"] = name
            self.limiter.check_request(name)
        except SecurityError as err:
            logger.info("refused %s %s: %s", scope.get("method", "WEBSOCKET"), scope["path"], err.message)
            if self.on_reject is not None:
                self.on_reject(scope, err)
            if scope["type"] == "websocket":
                return await send({"type": "websocket.close", "code": 1008})
            return await err.send_to(send)
        await self.app(scope, receive, send)

    def _authenticate(self, scope: Scope) -> str:
        value = _header(scope, b"authorization")
        if value is None:
            raise Unauthenticated("missing API key: send it in the header 'Authorization: Bearer <key>'")
        scheme, _, token = value.strip().partition(b" ")
        token = token.strip()
        if scheme.lower() != b"bearer" or not token:
            raise Unauthenticated("malformed Authorization header: expected 'Bearer <key>'")
        name = self.keystore.lookup(token)
        if name is None:
            raise Unauthenticated("invalid API key")
        return name


class BodySizeLimit:
    """413 for a body over ``max_body_bytes``: at once when Content-Length says so, else as soon
    as the received chunks pass it (``receive`` raises BodyTooLarge inside the app).

    Install it with ``app.add_middleware`` so it sits inside Starlette's ServerErrorMiddleware:
    an ``Exception`` handler then never sees BodyTooLarge. Should the app turn it into its own
    error response anyway (FastAPI's body parsing makes it a 400), that response is replaced."""

    def __init__(self, app: ASGIApp, max_body_bytes: int):
        self.app = app
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        error = BodyTooLarge(self.max_body_bytes)
        declared = _declared_length(scope)
        if declared is not None and declared > self.max_body_bytes:
            logger.info("refused %s %s: Content-Length %d is over %d bytes", scope.get("method"), scope["path"],
                        declared, self.max_body_bytes)
            return await error.send_to(send)
        received = 0
        exceeded = started = answered = False

        async def limited_receive() -> dict:
            nonlocal received, exceeded
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_body_bytes:
                    if not exceeded:
                        logger.info("refused %s %s: body over %d bytes", scope.get("method"), scope["path"],
                                    self.max_body_bytes)
                    exceeded = True
                    raise error
            return message

        async def guarded_send(message: dict) -> None:
            nonlocal started, answered
            if exceeded:  # whatever the app answers to the exception, the answer is 413
                if not started:
                    started = answered = True
                    await error.send_to(send)
                return
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, limited_receive, guarded_send)
        except BodyTooLarge:
            if started and not answered:
                raise  # the app had begun its own answer: let the server cut the connection
        if exceeded and not started:
            await error.send_to(send)


# ---------------------------------------------------------------- wiring


def install_security(app: Any, auth: AuthConfig, limits: LimitsConfig, cors: CorsConfig, *,
                     clock: Callable[[], float] = time.monotonic,
                     on_reject: Callable[[Scope, SecurityError], None] | None = None,
                     environ: Mapping[str, str] | None = None, base_dir: Path | None = None) -> RateLimiter:
    """Add the middlewares to a Starlette/FastAPI ``app``: CORS outermost (so refusals carry its
    headers), then auth (a 401 before any body is read), then the body limit. Returns the
    limiter whose ``check_tokens`` the routes call. Raises ValueError for an unreadable key."""
    keys = resolve_keys(auth, environ, base_dir)
    limiter = RateLimiter(keys, clock)
    # add_middleware puts each new middleware outside the ones added before it
    if limits.max_body_bytes is not None:
        app.add_middleware(BodySizeLimit, max_body_bytes=limits.max_body_bytes)
    if auth.enabled:
        app.add_middleware(AuthMiddleware, keystore=KeyStore(keys), limiter=limiter, public_paths=auth.public(),
                           on_reject=on_reject)
        logger.info("API keys required on all but %s: %s", ", ".join(sorted(auth.public())),
                    ", ".join(k.name for k in keys))
    if cors.enabled:
        app.add_middleware(CORSMiddleware, **cors.middleware_kwargs())
    return limiter
