"""The one error taxonomy of tandem and the one table that maps it to HTTP.

Engines and workers raise or return these as *values* (they cross the Ray actor boundary
pickled); the gateway turns them into HTTP exactly once, here. Every error leaves in the
OpenAI envelope ``{"error": {"message", "type", "param", "code"}}``.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from enum import Enum
from typing import Any


class ErrorKind(str, Enum):
    INVALID_REQUEST = "invalid_request"  # malformed JSON, failed validation, bad value
    CONTEXT_TOO_LONG = "context_too_long"  # prompt (+ max_tokens) over the model's context
    MODEL_NOT_FOUND = "model_not_found"
    NOT_FOUND = "not_found"  # unknown route
    METHOD_NOT_ALLOWED = "method_not_allowed"
    OVERLOADED = "overloaded"
    QUEUE_TIMEOUT = "queue_timeout"  # waited past the request's deadline
    SHUTTING_DOWN = "shutting_down"
    NO_REPLICA = "no_replica"  # the model has no live replica
    UNAUTHORIZED = "unauthorized"  # no or a wrong API key
    FORBIDDEN = "forbidden"  # a key whose role may not use this route
    RATE_LIMITED = "rate_limited"  # the key's requests or tokens per minute are spent
    REQUEST_TOO_LARGE = "request_too_large"  # the body is over limits.max_body_bytes
    REQUEST_TIMEOUT = "request_timeout"  # over limits.request_timeout_s
    ENGINE_ERROR = "engine_error"  # this request failed inside the engine
    ENGINE_DEAD = "engine_dead"  # the replica itself is gone
    NOT_IMPLEMENTED = "not_implemented"  # the engine has no way to serve this (vLLM's 501s)
    INTERNAL = "internal"


# kind -> (HTTP status, OpenAI error "type")
STATUS_TABLE: dict[ErrorKind, tuple[int, str]] = {
    ErrorKind.INVALID_REQUEST: (400, "invalid_request_error"),
    ErrorKind.CONTEXT_TOO_LONG: (400, "invalid_request_error"),
    ErrorKind.MODEL_NOT_FOUND: (404, "not_found_error"),
    ErrorKind.NOT_FOUND: (404, "not_found_error"),
    ErrorKind.METHOD_NOT_ALLOWED: (405, "invalid_request_error"),
    ErrorKind.OVERLOADED: (429, "rate_limit_error"),
    ErrorKind.UNAUTHORIZED: (401, "authentication_error"),
    ErrorKind.FORBIDDEN: (403, "permission_error"),
    ErrorKind.RATE_LIMITED: (429, "rate_limit_error"),
    ErrorKind.REQUEST_TOO_LARGE: (413, "invalid_request_error"),
    ErrorKind.REQUEST_TIMEOUT: (504, "timeout_error"),
    ErrorKind.QUEUE_TIMEOUT: (408, "timeout_error"),
    ErrorKind.SHUTTING_DOWN: (503, "service_unavailable_error"),
    ErrorKind.NO_REPLICA: (503, "service_unavailable_error"),
    ErrorKind.ENGINE_ERROR: (500, "server_error"),
    ErrorKind.ENGINE_DEAD: (500, "server_error"),
    ErrorKind.NOT_IMPLEMENTED: (501, "NotImplementedError"),  # vLLM's type, as `vllm serve` answers
    ErrorKind.INTERNAL: (500, "server_error"),
}

# OpenAI "code" strings for the kinds that have a well-known one.
_CODES = {
    ErrorKind.CONTEXT_TOO_LONG: "context_length_exceeded",
    ErrorKind.MODEL_NOT_FOUND: "model_not_found",
    ErrorKind.UNAUTHORIZED: "invalid_api_key",
    ErrorKind.RATE_LIMITED: "rate_limit_exceeded",
    ErrorKind.REQUEST_TOO_LARGE: "request_too_large",
}


class TandemError(Exception):
    """An error meant for the client. Safe to pickle across the actor boundary."""

    def __init__(self, kind: ErrorKind, message: str, param: str | None = None, retry_after: int | None = None):
        super().__init__(kind, message, param, retry_after)
        self.kind = kind
        self.message = message
        self.param = param
        self.retry_after = retry_after  # seconds, sent as Retry-After

    def __str__(self) -> str:
        return self.message

    def __repr__(self) -> str:
        return f"TandemError({self.kind.value}, {self.message!r}, param={self.param!r})"

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and self.args == other.args  # type: ignore[union-attr]

    def headers(self) -> dict[str, str]:
        return {"Retry-After": str(self.retry_after)} if self.retry_after is not None else {}

    __hash__ = Exception.__hash__

    @property
    def status(self) -> int:
        return STATUS_TABLE[self.kind][0]

    @property
    def error_type(self) -> str:
        return STATUS_TABLE[self.kind][1]

    @property
    def code(self) -> str | int:
        return _CODES.get(self.kind, self.status)

    def envelope(self) -> dict:
        return {
            "error": {
                "message": self.message,
                "type": self.error_type,
                "param": self.param,
                "code": self.code,
            }
        }

    def sse(self) -> str:
        """The last event of a stream that failed after it began (followed by [DONE])."""
        return f"data: {json.dumps(self.envelope())}\n\n"


    async def send_to(self, send: Callable[[dict[str, Any]], Awaitable[None]]) -> None:
        """Answer with this error directly on an ASGI ``send`` (the edge middlewares refuse with it)."""
        body = json.dumps(self.envelope()).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        headers += [(k.lower().encode(), v.encode()) for k, v in self.headers().items()]
        await send({"type": "http.response.start", "status": self.status, "headers": headers})
        await send({"type": "http.response.body", "body": body})


# ---------------------------------------------------------------- refusals at the gateway's edge
# Raised by the auth, rate-limit and input-limit checks; the same taxonomy, the same handler.
# Each keeps its own constructor arguments as ``args`` (pickling rebuilds it from them).


class Unauthenticated(TandemError):
    def __init__(self, message: str):
        super().__init__(ErrorKind.UNAUTHORIZED, message)
        self.args = (message,)

    def headers(self) -> dict[str, str]:
        return {"WWW-Authenticate": "Bearer"}


class RateLimited(TandemError):
    def __init__(self, retry_after: int, message: str):
        super().__init__(ErrorKind.RATE_LIMITED, message, retry_after=max(1, int(retry_after)))
        self.args = (retry_after, message)


class LimitExceeded(TandemError):
    """An input limit (400, the field named in ``param``)."""

    def __init__(self, message: str, param: str | None):
        super().__init__(ErrorKind.INVALID_REQUEST, message, param)
        self.args = (message, param)


class BodyTooLarge(TandemError):
    def __init__(self, max_body_bytes: int):
        super().__init__(ErrorKind.REQUEST_TOO_LARGE,
                         f"the request body is larger than the limit of {max_body_bytes} bytes")
        self.args = (max_body_bytes,)

    def headers(self) -> dict[str, str]:
        return {"Connection": "close"}  # the rest of the body is never read


class EngineConfigError(Exception):
    """An engine cannot start with its configuration: one line naming the model, the field and the
    engine's own reason. Only a message: it pickles (Ray carries it from the replica's process),
    unlike the validation errors it replaces."""


def config_error_line(model: str, fields: dict, exc: BaseException) -> str:
    """``exc`` (a validation error, a ValueError...) as one line naming ``model`` and the field of
    ``fields`` it is about (pydantic's location, else the first field its message names)."""
    errors = getattr(exc, "errors", None)
    first = errors()[0] if callable(errors) else None
    loc = ".".join(str(p) for p in first["loc"]) if first else ""
    reason = (first["msg"] if first else str(exc)).removeprefix("Value error, ").strip()
    field = loc or next((k for k in fields if k in reason), "")
    reason = " ".join(reason.split())  # one line
    return f"model {model!r}: " + (f"engine_args.{field}: " if field else "") + reason


def engine_config_line(exc: BaseException) -> str | None:
    """The one line of an EngineConfigError, also as Ray raises it from a replica (a subclass of
    it that keeps the replica's exception as ``cause`` and prints the remote traceback), else None."""
    if not isinstance(exc, EngineConfigError):
        return None
    cause = getattr(exc, "cause", None)  # Ray's wrapper: str() would be its traceback
    return str(cause if isinstance(cause, EngineConfigError) else exc)


def kind_for_status(status: int) -> ErrorKind:
    """Map an engine's own HTTP-ish status (e.g. vLLM's ErrorResponse.code) to a kind."""
    if status == 404:
        return ErrorKind.MODEL_NOT_FOUND
    if 400 <= status < 500:
        return ErrorKind.INVALID_REQUEST
    if status == 501:
        return ErrorKind.NOT_IMPLEMENTED
    return ErrorKind.ENGINE_ERROR


def invalid(message: str, param: str | None = None) -> TandemError:
    return TandemError(ErrorKind.INVALID_REQUEST, message, param)


def request_timeout() -> TandemError:
    return TandemError(ErrorKind.REQUEST_TIMEOUT, "the request took longer than the server's limit "
                       "(limits.request_timeout_s); retry, or ask for fewer tokens")
