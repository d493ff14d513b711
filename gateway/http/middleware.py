"""The pure-ASGI middleware of the HTTP edge:

- ``BodySizeLimit``: a body over ``max_body_bytes`` is 413, whether Content-Length says so or a
  chunked body grows past it while it is received.
- ``AuthMiddleware``: ``Authorization: Bearer <key>`` or 401, then the key's role and its
  requests per minute (429 with ``Retry-After``). Public paths and CORS preflights pass. The keys
  and limits themselves are admission's (``gateway/admission/keys.py``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable

from starlette.types import ASGIApp, Receive, Scope, Send

from gateway.admission.keys import KeyStore, RateLimiter
from tandem_core.errors import BodyTooLarge, ErrorKind, TandemError, Unauthenticated

logger = logging.getLogger(__name__)


def header(scope: Scope, name: bytes) -> bytes | None:
    """A request header's raw value (ASGI scope), or None."""
    return next((v for k, v in scope.get("headers", ()) if k.lower() == name), None)


def _declared_length(scope: Scope) -> int | None:
    raw = (header(scope, b"content-length") or b"").strip()
    if not raw.isdigit():
        return None  # absent (chunked) or malformed: the server's HTTP parser deals with the latter
    return int(raw) if len(raw) <= 18 else 10**18


class BodySizeLimit:
    """413 for a body over ``max_body_bytes``: at once when Content-Length says so, else as soon
    as the received chunks pass it (``receive`` raises BodyTooLarge inside the app).

    Install it with ``app.add_middleware`` so it sits inside Starlette's ServerErrorMiddleware:
    an ``Exception`` handler then never sees BodyTooLarge. Should the app turn it into its own
    error response anyway (FastAPI's body parsing makes it a 400), that response is replaced."""

    def __init__(self, app: ASGIApp, max_body_bytes: int, per_path: dict[str, int] | None = None):
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.per_path = per_path or {}  # a route's own limit (uploads: ``batches.max_file_bytes``)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        limit = self.per_path.get(scope["path"], self.max_body_bytes)
        error = BodyTooLarge(limit)
        declared = _declared_length(scope)
        if declared is not None and declared > limit:
            logger.info("refused %s %s: Content-Length %d is over %d bytes", scope.get("method"), scope["path"],
                        declared, limit)
            return await error.send_to(send)
        received = 0
        exceeded = started = answered = False

        async def limited_receive() -> dict:
            nonlocal received, exceeded
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    if not exceeded:
                        logger.info("refused %s %s: body over %d bytes", scope.get("method"), scope["path"],
                                    limit)
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



def _is_preflight(scope: Scope) -> bool:
    return scope.get("method") == "OPTIONS" and header(scope, b"access-control-request-method") is not None


class AuthMiddleware:
    """``Authorization: Bearer <key>`` on every path but the public ones (and CORS preflights),
    then the key's role (``admin_paths`` and ``/admin/*``: 403 for a user key), then the key's
    requests per minute. Sets ``scope["state"]["tandem_key_name"]`` (logs,
    ``RateLimiter.check_tokens``) and ``["tandem_key"]`` (its tenant and models).
    ``on_reject(scope, error)`` is called on each refusal
    (for metrics)."""

    def __init__(self, app: ASGIApp, keystore: KeyStore, limiter: RateLimiter, public_paths: Iterable[str],
                 on_reject: Callable[[Scope, TandemError], None] | None = None, admin_paths: Iterable[str] = ()):
        self.app = app
        self.keystore = keystore
        self.limiter = limiter
        self.public_paths = frozenset(public_paths)
        self.admin_paths = frozenset(admin_paths)  # only an admin key gets through (403 for a user key)
        self.on_reject = on_reject

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket") or scope["path"] in self.public_paths or _is_preflight(scope):
            return await self.app(scope, receive, send)
        try:
            name = self._authenticate(scope)
            key = self.keystore.by_name[name]
            state = scope.setdefault("state", {})
            state["tandem_key_name"], state["tandem_key"] = name, key
            if key.role != "admin" and (scope["path"] in self.admin_paths or scope["path"].startswith("/admin/")):
                raise TandemError(ErrorKind.FORBIDDEN, f"API key {name!r} is a user key; {scope['path']} needs an "
                                  "admin key (auth.api_keys[].role: admin)")
            self.limiter.check_request(name)
        except TandemError as err:
            logger.info("refused %s %s: %s", scope.get("method", "WEBSOCKET"), scope["path"], err.message)
            if self.on_reject is not None:
                self.on_reject(scope, err)
            if scope["type"] == "websocket":
                return await send({"type": "websocket.close", "code": 1008})
            return await err.send_to(send)
        await self.app(scope, receive, send)

    def _authenticate(self, scope: Scope) -> str:
        value = header(scope, b"authorization")
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
