"""Input limits: what a request may carry (checked once its JSON is parsed) and how large its
body may be (checked while it is received).

- ``check_limits``: messages, prompts, text, ``n``, ``max_tokens`` (as the request's ``Intake``
  measured them); a 400 naming the field and the limit. Any JSON shape is accepted: type
  validation stays with the engines.
- ``BodySizeLimit`` (pure ASGI): a body over ``max_body_bytes`` is 413, whether Content-Length
  says so or a chunked body grows past it while it is received.
"""

from __future__ import annotations

import logging
from typing import Any

from starlette.types import ASGIApp, Receive, Scope, Send

from gateway.request.intake import COPIES, DEFAULT_MAX_OUTPUT_TOKENS, NUMBERS, Intake, take_in
from tandem_core.config import LimitsConfig
from tandem_core.errors import BodyTooLarge, LimitExceeded

logger = logging.getLogger(__name__)

# ---------------------------------------------------------------- input limits
# They read the sizes ``gateway.request.intake.take_in`` measured: no walk of the body here. Nothing
# below may raise anything but LimitExceeded.


def show(v: int | float) -> str:
    return str(v) if isinstance(v, float) or -(10**30) < v < 10**30 else "a huge number"


def _check_number(name: str, v: int | float, limit: int | None, setting: str | None = None) -> None:
    if limit is None:
        return
    if v > limit and setting:  # vLLM's own wording for its n limit (clients match on it)
        raise LimitExceeded(f"{name} must be at most {limit}, got {show(v)}. To increase this limit, set "
                            f"{setting} in the server's configuration.", name)
    if v > limit:
        raise LimitExceeded(f"{name}: {show(v)} exceeds the limit of {limit}", name)


def _check_size(param: str, count: int, what: str, limit: int | None) -> None:
    if limit is not None and count > limit:
        raise LimitExceeded(f"{param}: {count} {what} exceed the limit of {limit}", param)


def check_limits(intake: Intake, limits: LimitsConfig) -> None:
    """Called by a generation route once its body is taken in, before ``check_tokens``. The
    intake's route "chat" checks messages, "completions" checks prompt; any other route checks
    both. Raises LimitExceeded (400) naming the field and the limit."""
    route = intake.route
    if route != "completions" and intake.messages is not None:
        _check_size("messages", intake.messages, "messages", limits.max_messages)
        _check_size("messages", intake.message_chars, "characters of text", limits.max_prompt_chars)
    if route != "chat" and intake.prompts is not None:
        _check_size("prompt", intake.prompts, "prompts", limits.max_messages)
    if route != "chat":
        _check_size("prompt", intake.prompt_chars, "characters of text", limits.max_prompt_chars)
    if intake.inputs is not None:  # the Responses API: a string, or a list of message items
        _check_size("input", intake.inputs, "input items", limits.max_messages)
    _check_size("input", intake.input_chars, "characters of text", limits.max_prompt_chars)
    for name, v in zip(NUMBERS, intake.numbers, strict=True):
        if v is not None:
            if name in COPIES:
                _check_number(name, v, limits.max_n, "limits.max_n")
            else:  # the max output tokens
                _check_number(name, v, limits.max_tokens_ceiling)


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


def estimate_tokens(body: Any, generates: bool = True) -> int:
    """What a request may cost: ceil(prompt, message or input characters / 4) + token ids given +
    the output it may produce, (max_completion_tokens or max_tokens or max_output_tokens or 256)
    x max(n, best_of); no output for a route that generates none (``generates``: tokenize...).
    The gateway reads it from its intake (``Intake.tokens``); this is the same figure for a body."""
    if not isinstance(body, dict):
        return DEFAULT_MAX_OUTPUT_TOKENS if generates else 1
    return take_in(body, "other", generates=generates).tokens
