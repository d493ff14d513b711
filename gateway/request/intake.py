"""The request body, read once.

``parse_json`` turns the raw body into a JSON object; ``take_in`` then walks it once and returns
an ``Intake``: everything the gateway's checks and its router need to know about the body (its
nesting depth, the sizes the input limits bound, the copies and output tokens asked for, the
token estimate, the session key, when the request times out). ``check_limits``, the rate limiter's
``check_tokens``, ``request_cost`` and the session affinity read that record; none of them
walks the body again.

Robust to any JSON shape: a field of an unexpected type is skipped here (it counts nothing), and
the engine's validation names it. Nothing here raises but ``parse_json``/``take_in``'s 400s.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Any, NamedTuple

from gateway.request.prefix import prompt_blocks
from tandem_core.errors import TandemError, invalid
from tandem_core.protocol import GENERATING_ROUTES

CHARS_PER_TOKEN = 4  # the estimate of prompt tokens: ceil(characters / 4)
DEFAULT_MAX_OUTPUT_TOKENS = 256  # the estimate of output tokens when a request names none
# The numeric fields the input limits bound, in the order they are checked.
NUMBERS = ("n", "best_of", "max_tokens", "max_completion_tokens", "max_output_tokens")
COPIES = frozenset({"n", "best_of"})  # of NUMBERS: choices generated (bounded by limits.max_n)
_NUMBER_SLOT = {name: i for i, name in enumerate(NUMBERS)}
# isinstance with a tuple, not a union: ``X | Y`` costs ten times as much per call on 3.11.
_CONTAINERS = (dict, list)
_NUMBER_TYPES = (int, float)
_INT = {int}


class Intake(NamedTuple):
    """What the gateway knows of one request's body after reading it once. Immutable; a named
    tuple because it is built on every request (a third of a frozen dataclass's cost)."""

    body: dict[str, Any]
    route: str  # a route of ``tandem_core.protocol.ROUTE_TABLE``
    generates: bool  # the route generates tokens (``GENERATING_ROUTES``)
    depth: int  # nesting levels of the body (an object of scalars: 1)
    messages: int | None  # items in ``messages`` when it is a list
    message_chars: int  # characters of text in ``messages`` (contents, text parts, tool-call arguments)
    prompts: int | None  # strings and lists in ``prompt`` when it is a list
    prompt_chars: int  # characters of text in ``prompt``
    prompt_ids: int  # token ids in ``prompt``
    inputs: int | None  # items in ``input`` (the Responses API) when it is a list
    input_chars: int  # characters of text in ``input``
    numbers: tuple[int | float | None, ...]  # each of ``NUMBERS`` when given as a number (not a bool), else None
    copies: int  # max(n, best_of): choices generated
    max_output: int  # max_completion_tokens or max_tokens or max_output_tokens or 256
    output_param: str | None  # which of max_completion_tokens / max_tokens set ``max_output``
    tokens: int  # the estimate: what the request may cost in tokens (``estimate``)
    session_key: str | None  # the session-affinity key (None: affinity off, or none given)
    timeout_at: float | None  # the event loop's time when the request times out

    @property
    def model(self) -> object:
        return self.body.get("model")

    @property
    def text_chars(self) -> int:
        return self.prompt_chars + self.message_chars + self.input_chars

    def prefix_blocks(self) -> tuple[int, ...]:
        """The chained hashes of the prompt's blocks (``gateway.request.prefix.prompt_blocks``), for
        ``routing: prefix``. Not part of the walk: only prefix routing pays for it, and hashing
        reads every character where the walk only counts them."""
        return prompt_blocks(self.body)


def parse_json(raw: bytes, max_depth: int) -> dict[str, Any]:
    """The body as a JSON object, or a 400: not JSON, nested past what ``json`` can recurse
    into (reported as the depth limit), not an object."""
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise invalid(f"the request body is not valid JSON: {e}") from None
    except RecursionError:
        raise too_deep(max_depth) from None
    if not isinstance(body, dict):
        raise invalid(f"the request body must be a JSON object, got {type(body).__name__}")
    return body


def too_deep(max_depth: int) -> TandemError:
    return invalid(f"the request body is nested deeper than {max_depth} levels")


def take_in(body: dict[str, Any], route: str, *, max_depth: int | None = None, generates: bool | None = None,
            headers: Mapping[str, str] | None = None, session_header: str | None = None,
            timeout_at: float | None = None) -> Intake:
    """Walk ``body`` once. A 400 when it nests deeper than ``max_depth`` (None: not checked).
    ``generates``: None to follow the route. ``session_header``: the header carrying the
    session key (None: session affinity off); else the body's ``user`` is the key."""
    depth, messages, message_chars, prompts, prompt_chars, prompt_ids, inputs, input_chars, numbers = _walk(body)
    if max_depth is not None and depth > max_depth:
        raise too_deep(max_depth)
    n, best_of, max_tokens, max_completion_tokens, max_output_tokens = numbers
    # Each counts when a positive int (``numbers`` holds no bools); else the default.
    copies = max(n if isinstance(n, int) and n > 0 else 1, best_of if isinstance(best_of, int) and best_of > 0 else 1)
    if isinstance(max_completion_tokens, int) and max_completion_tokens > 0:
        output_param, max_output = "max_completion_tokens", max_completion_tokens
    elif isinstance(max_tokens, int) and max_tokens > 0:
        output_param, max_output = "max_tokens", max_tokens
    else:
        output_param = None
        max_output = (max_output_tokens if isinstance(max_output_tokens, int) and max_output_tokens > 0
                      else DEFAULT_MAX_OUTPUT_TOKENS)
    if generates is None:
        generates = route in GENERATING_ROUTES
    tokens = estimate(prompt_chars + message_chars + input_chars, prompt_ids, max_output, copies, generates)
    key = None
    if session_header is not None:
        key = ((headers.get(session_header) if headers is not None else None) or body.get("user")
               or body.get("prompt_cache_key"))  # (OpenAI's cache routing key: decisions, Responses)
        key = key if isinstance(key, str) and key else None
    return Intake(body=body, route=route, generates=generates, depth=depth, messages=messages,
                  message_chars=message_chars, prompts=prompts, prompt_chars=prompt_chars, prompt_ids=prompt_ids,
                  inputs=inputs, input_chars=input_chars, numbers=numbers, copies=copies, max_output=max_output,
                  output_param=output_param, tokens=tokens, session_key=key, timeout_at=timeout_at)


def estimate(chars: int, ids: int, max_output: int, copies: int, generates: bool) -> int:
    """What a request may cost: ceil(characters of text / 4) + token ids given + the output it
    may produce (``max_output`` x ``copies``); no output for a route that generates none."""
    if not generates:
        return max(1, math.ceil(chars / CHARS_PER_TOKEN) + ids)
    return math.ceil(chars / CHARS_PER_TOKEN) + ids + max_output * copies


# -- the walk ---------------------------------------------------------------------------------------
# One pass over the parsed body: the fields the sizes come from (messages, prompt, input) are
# walked by their shape, counting text as they go, and every other container by ``_depth``.
# Each function returns the deepest level it saw; ``level`` is the level of the value it gets.


def _walk(body: dict) -> tuple[int, int | None, int, int | None, int, int, int | None, int, tuple]:
    deepest = 1
    messages = prompts = inputs = None
    message_chars = prompt_chars = prompt_ids = input_chars = 0
    numbers = [None] * len(NUMBERS)
    for key, value in body.items():
        if isinstance(value, str):
            if key == "prompt":
                prompt_chars = len(value)
            elif key == "input":
                input_chars = len(value)
            continue
        if isinstance(value, list):
            if key == "messages":
                messages = len(value)
                message_chars, d = _messages(value, 2)
            elif key == "input":
                inputs = len(value)
                input_chars, d = _messages(value, 2)
            elif key == "prompt":
                prompts, prompt_chars, prompt_ids, d = _prompt(value, 2)
            else:
                d = _depth(value, 2)
        elif isinstance(value, dict):
            d = _depth(value, 2)
        else:
            if isinstance(value, _NUMBER_TYPES) and not isinstance(value, bool):
                slot = _NUMBER_SLOT.get(key)
                if slot is not None:
                    numbers[slot] = value
            continue
        if d > deepest:
            deepest = d
    return (deepest, messages, message_chars, prompts, prompt_chars, prompt_ids, inputs, input_chars,
            tuple(numbers))


def _messages(messages: list, level: int) -> tuple[int, int]:
    """(characters of text, deepest level) of chat messages: text contents, text parts and
    tool-call arguments count; an image's base64 is not prompt text."""
    chars = 0
    deepest = level
    inner = level + 1  # a message's level
    for m in messages:  # the hot loop of a long conversation: no call per message but items()
        if isinstance(m, dict):
            if deepest < inner:
                deepest = inner
            for key, v in m.items():
                if isinstance(v, str):
                    if key == "content":
                        chars += len(v)
                elif isinstance(v, _CONTAINERS):
                    if key == "content" and isinstance(v, list):
                        c, d = _parts(v, inner + 1)
                        chars += c
                    elif key == "tool_calls" and isinstance(v, list):
                        c, d = _calls(v, inner + 1)
                        chars += c
                    else:
                        d = _depth(v, inner + 1)
                    if d > deepest:
                        deepest = d
        elif isinstance(m, list):
            d = _depth(m, inner)
            if d > deepest:
                deepest = d
    return chars, deepest


def _parts(parts: list, level: int) -> tuple[int, int]:
    """A content list: strings and the ``text`` of part objects."""
    chars = 0
    deepest = level
    inner = level + 1
    for p in parts:
        if isinstance(p, str):
            chars += len(p)
        elif isinstance(p, dict):
            text = p.get("text")
            if isinstance(text, str):
                chars += len(text)
            if deepest < inner:
                deepest = inner
            for v in p.values():
                if isinstance(v, _CONTAINERS):
                    d = _depth(v, inner + 1)
                    if d > deepest:
                        deepest = d
        elif isinstance(p, list):
            d = _depth(p, inner)
            if d > deepest:
                deepest = d
    return chars, deepest


def _calls(calls: list, level: int) -> tuple[int, int]:
    """A message's tool calls: the characters of each ``function.arguments`` string."""
    chars = 0
    for call in calls:
        fn = call.get("function") if isinstance(call, dict) else None
        if isinstance(fn, dict):
            arguments = fn.get("arguments")
            if isinstance(arguments, str):
                chars += len(arguments)
    return chars, _depth(calls, level)  # tool calls are rare: their nesting is walked generically


def _prompt(prompt: list, level: int) -> tuple[int, int, int, int]:
    """(prompts, characters of text, token ids, deepest level) of a list prompt: strings, token
    ids, or lists of token ids."""
    if set(map(type, prompt)) <= _INT:  # token ids, the long prompts: counted at C speed
        return 0, 0, len(prompt), level
    prompts = chars = ids = 0
    deepest = level
    for p in prompt:
        if isinstance(p, str):
            prompts += 1
            chars += len(p)
        elif isinstance(p, list):
            prompts += 1
            ids += len(p)
            d = _depth(p, level + 1)
            if d > deepest:
                deepest = d
        elif isinstance(p, int) and not isinstance(p, bool):
            ids += 1
        elif isinstance(p, dict):
            d = _depth(p, level + 1)
            if d > deepest:
                deepest = d
    return prompts, chars, ids, deepest


def _depth(value: dict | list, level: int) -> int:
    """The deepest level of containers in ``value`` (at ``level``): iterative, so no recursion
    to exhaust however deep the body nests."""
    deepest = level
    stack = [(value, level)]
    while stack:
        v, d = stack.pop()
        if d > deepest:
            deepest = d
        d += 1
        children = v.values() if isinstance(v, dict) else v
        if len(children) > 16 and not any(issubclass(t, _CONTAINERS) for t in set(map(type, children))):
            continue  # a long list of scalars (token ids, numbers): seen at C speed
        for c in children:
            if isinstance(c, _CONTAINERS):
                stack.append((c, d))
    return deepest
