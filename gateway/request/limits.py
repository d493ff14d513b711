"""Input limits: what a request may carry (checked once its JSON is parsed) and how large its
body may be (checked while it is received).

- ``check_limits``: messages, prompts, text, ``n``, ``max_tokens`` (as the request's ``Intake``
  measured them); a 400 naming the field and the limit. Any JSON shape is accepted: type
  validation stays with the engines.

The body size is checked while it is received, at the HTTP edge (``BodySizeLimit`` in
``gateway/http/middleware.py``).
"""

from __future__ import annotations

import logging
from typing import Any

from gateway.request.intake import COPIES, DEFAULT_MAX_OUTPUT_TOKENS, NUMBERS, Intake, take_in
from tandem_core.config import LimitsConfig
from tandem_core.errors import LimitExceeded

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


def estimate_tokens(body: Any, generates: bool = True) -> int:
    """What a request may cost: ceil(prompt, message or input characters / 4) + token ids given +
    the output it may produce, (max_completion_tokens or max_tokens or max_output_tokens or 256)
    x max(n, best_of); no output for a route that generates none (``generates``: tokenize...).
    The gateway reads it from its intake (``Intake.tokens``); this is the same figure for a body."""
    if not isinstance(body, dict):
        return DEFAULT_MAX_OUTPUT_TOKENS if generates else 1
    return take_in(body, "other", generates=generates).tokens
