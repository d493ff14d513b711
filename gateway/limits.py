"""Input limits: what a request may carry (checked once its JSON is parsed) and how large its
body may be (checked while it is received).

- ``check_limits``: messages, prompts, text, ``n``, ``max_tokens``; a 400 naming the field and
  the limit. Any JSON shape is accepted: type validation stays with the engines.
- ``BodySizeLimit`` (pure ASGI): a body over ``max_body_bytes`` is 413, whether Content-Length
  says so or a chunked body grows past it while it is received.
"""

from __future__ import annotations

import logging
import math
from typing import Any

from starlette.types import ASGIApp, Receive, Scope, Send

from tandem_core.config import LimitsConfig
from tandem_core.errors import BodyTooLarge, LimitExceeded

logger = logging.getLogger(__name__)

CHARS_PER_TOKEN = 4  # the estimate of prompt tokens: ceil(characters / 4)
DEFAULT_MAX_OUTPUT_TOKENS = 256  # the estimate of output tokens when a request names none

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


def messages_chars(messages: Any) -> int:
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


def prompt_size(prompt: Any) -> tuple[int, int]:
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


def show(v: int | float) -> str:
    return str(v) if isinstance(v, float) or -(10**30) < v < 10**30 else "a huge number"


def _check_number(body: dict, name: str, limit: int | None, setting: str | None = None) -> None:
    v = body.get(name)
    if limit is None or isinstance(v, bool) or not isinstance(v, int | float):
        return
    if v > limit and setting:  # vLLM's own wording for its n limit (clients match on it)
        raise LimitExceeded(f"{name} must be at most {limit}, got {show(v)}. To increase this limit, set "
                            f"{setting} in the server's configuration.", name)
    if v > limit:
        raise LimitExceeded(f"{name}: {show(v)} exceeds the limit of {limit}", name)


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
        _check_size("messages", messages_chars(messages), "characters of text", limits.max_prompt_chars)
    if route != "chat" and isinstance(prompt, list):
        _check_size("prompt", sum(isinstance(p, str | list) for p in prompt), "prompts", limits.max_messages)
    if route != "chat":
        _check_size("prompt", prompt_size(prompt)[0], "characters of text", limits.max_prompt_chars)
    inputs = body.get("input")  # the Responses API: a string, or a list of message items
    if isinstance(inputs, list):
        _check_size("input", len(inputs), "input items", limits.max_messages)
    _check_size("input", _input_chars(inputs), "characters of text", limits.max_prompt_chars)
    for name in ("n", "best_of"):
        _check_number(body, name, limits.max_n, "limits.max_n")
    for name in ("max_tokens", "max_completion_tokens", "max_output_tokens"):
        _check_number(body, name, limits.max_tokens_ceiling)


def header(scope: Scope, name: bytes) -> bytes | None:
    """A request header's raw value (ASGI scope), or None."""
    return next((v for k, v in scope.get("headers", ()) if k.lower() == name), None)


def _input_chars(inputs: Any) -> int:
    return len(inputs) if isinstance(inputs, str) else messages_chars(inputs)


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


def count(v: Any) -> int | None:
    """``v`` if it is a positive integer (not a bool), else None."""
    return v if isinstance(v, int) and not isinstance(v, bool) and v > 0 else None


def estimate_tokens(body: Any, generates: bool = True) -> int:
    """What a request may cost: ceil(prompt, message or input characters / 4) + token ids given +
    the output it may produce, (max_completion_tokens or max_tokens or max_output_tokens or 256)
    x max(n, best_of); no output for a route that generates none (``generates``: tokenize...)."""
    if not isinstance(body, dict):
        return DEFAULT_MAX_OUTPUT_TOKENS if generates else 1
    chars, ids = prompt_size(body.get("prompt"))
    chars += messages_chars(body.get("messages")) + _input_chars(body.get("input"))
    if not generates:
        return max(1, math.ceil(chars / CHARS_PER_TOKEN) + ids)
    out = (count(body.get("max_completion_tokens")) or count(body.get("max_tokens"))
           or count(body.get("max_output_tokens")) or DEFAULT_MAX_OUTPUT_TOKENS)
    copies = max(count(body.get("n")) or 1, count(body.get("best_of")) or 1)
    return math.ceil(chars / CHARS_PER_TOKEN) + ids + out * copies
