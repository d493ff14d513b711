"""The gateway's edge, configured: API keys, rate limits, input limits, CORS, and the refusals.

What each part does lives beside it: ``gateway/auth.py`` (keys, per-key token buckets, the auth
middleware), ``gateway/limits.py`` (input limits, the body-size middleware); ``install_security``
puts them on an app. Every refusal is a ``SecurityError`` whose kind is in ``gateway.errors``'
table, so it leaves in the OpenAI envelope like every other error.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict, Field, SecretStr, model_validator
from starlette.types import Scope, Send

from gateway.errors import STATUS_TABLE, ErrorKind, TandemError

if TYPE_CHECKING:
    from gateway.auth import RateLimiter

logger = logging.getLogger(__name__)

MiB = 1024 * 1024

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


def header(scope: Scope, name: bytes) -> bytes | None:
    """A request header's raw value (ASGI scope), or None."""
    return next((v for k, v in scope.get("headers", ()) if k.lower() == name), None)


# ---------------------------------------------------------------- wiring


def install_security(app: Any, auth: AuthConfig, limits: LimitsConfig, cors: CorsConfig, *,
                     clock: Callable[[], float] = time.monotonic,
                     on_reject: Callable[[Scope, SecurityError], None] | None = None,
                     environ: Mapping[str, str] | None = None, base_dir: Path | None = None) -> RateLimiter:
    """Add the middlewares to a Starlette/FastAPI ``app``: CORS outermost (so refusals carry its
    headers), then auth (a 401 before any body is read), then the body limit. Returns the
    limiter whose ``check_tokens`` the routes call. Raises ValueError for an unreadable key."""
    from starlette.middleware.cors import CORSMiddleware

    from gateway.auth import AuthMiddleware, KeyStore, RateLimiter, resolve_keys
    from gateway.limits import BodySizeLimit

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
