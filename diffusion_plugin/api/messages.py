"""Anthropic's Messages API on a diffusion model, served as ``vllm serve`` serves it: vLLM's own
conversions around the chat route.

vLLM's ``AnthropicServingMessages`` turns a Messages request into a chat request and the chat
answer back; its conversions need no engine, so the diffusion model uses the same ones:

1. the body is vLLM's ``AnthropicMessagesRequest`` (``AnthropicCountTokensRequest``);
2. ``to_chat_completion_request`` makes the chat request: ``system``, text, image, ``tool_use``
   and ``tool_result`` blocks, ``tools``, ``tool_choice`` (``auto``, ``any`` -> "required",
   ``tool`` -> a named function, ``none``), ``stop_sequences``, ``temperature``, ``top_p``,
   ``top_k``, ``thinking`` and ``output_config`` (``effort`` -> ``reasoning_effort``, a JSON
   schema format -> ``response_format``), streamed with usage in every chunk;
3. the engine's chat route serves it (``DiffusionEngine.chat``): the model's parsers make the
   thinking and the tool calls, a structured output constrains ``any``/``tool``;
4. ``messages_full_converter`` / ``message_stream_converter`` make Anthropic's message or event
   stream: ``thinking``, ``text`` and ``tool_use`` blocks, ``stop_reason`` (``end_turn``,
   ``max_tokens``, ``stop_sequence`` with the string that matched, ``tool_use``) and ``usage``.

What the chat route refuses is refused here, a 400 naming the field. Thinking is switched as
vLLM's conversion switches it: ``output_config.effort`` is ``reasoning_effort`` (Gemma 4's
template thinks), ``thinking: {"type": "disabled"}`` is ``reasoning_effort: "none"``, ``adaptive``
leaves it to the effort. ``thinking: {"type": "enabled", "budget_tokens": N}`` is vLLM's
``thinking_token_budget``, which vLLM enforces by forcing the end of the thinking after N tokens
(and refuses without a reasoning config); the diffusion engine cannot cut a thinking short, so it
is a 400 naming ``thinking.budget_tokens``, never ignored.

Imports vLLM when first used, in the replica, never in the gateway.
"""

from __future__ import annotations

import functools
from collections.abc import AsyncIterator
from contextlib import aclosing

from diffusion_plugin.api import params as P
from tandem_core.errors import TandemError, invalid


@functools.cache
def _vllm():
    """vLLM's Messages serving class (its conversions only: no engine behind it) and a converter
    instance (``messages_full_converter`` and ``message_stream_converter`` read no state of it)."""
    from vllm.entrypoints.anthropic.serving import AnthropicServingMessages

    return AnthropicServingMessages, object.__new__(AnthropicServingMessages)


@functools.cache
def _merge_inline_system(chat_template: str | None) -> bool:
    """vLLM's probe: a template that refuses a system message after the first turn gets them merged."""
    cls, _ = _vllm()
    return cls._detect_merge_inline_system(chat_template)


def chat_body(engine, body: dict, count: bool = False) -> dict:
    """The chat body vLLM would serve for a Messages body (``count``: a count_tokens body).
    Raises ``TandemError`` (a 400 naming the field)."""
    from vllm.entrypoints.anthropic.protocol import AnthropicCountTokensRequest, AnthropicMessagesRequest

    req = P.parse(AnthropicCountTokensRequest if count else AnthropicMessagesRequest, body)
    cls, _ = _vllm()
    template = getattr(engine.adapter.tokenizer, "chat_template", None)
    try:
        chat = cls.to_chat_completion_request(req, merge_inline_system=_merge_inline_system(template),
                                              disabled_thinking_effort="none")
    except ValueError as e:  # vLLM's refusal of the conversation (a tool change naming no tool...)
        raise invalid(f"messages: {e}", param="messages") from None
    out = chat.model_dump(mode="json", by_alias=True, exclude_unset=True, exclude_none=True)
    if out.pop("thinking_token_budget", None) is not None and not count:
        raise invalid("thinking.budget_tokens: a thinking budget is not enforced by the diffusion engine (it cannot "
                      "cut a model's thinking short); give thinking {\"type\": \"adaptive\"} with "
                      "output_config.effort", param="thinking.budget_tokens")
    return out


async def serve_messages(engine, body: dict, request_id: str) -> AsyncIterator:
    """``POST /v1/messages``: Anthropic's message (one dict) or its event stream (SSE text); a
    ``TandemError`` first (a refusal) or last (a failure mid-stream), framed by the gateway."""
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionResponse

    try:
        chat = chat_body(engine, body)
    except TandemError as e:
        yield e
        return
    _, convert = _vllm()
    async with aclosing(engine.chat(chat, request_id)) as items:
        if not chat.get("stream"):
            async for item in items:
                if isinstance(item, TandemError):
                    yield item
                else:
                    message = convert.messages_full_converter(ChatCompletionResponse.model_validate(item))
                    yield message.model_dump(mode="json", exclude_none=True)
            return
        first = await anext(items)  # a refusal comes before the stream begins
        if isinstance(first, TandemError):
            yield first
            return
        failed: list[TandemError] = []

        async def stream() -> AsyncIterator[str]:  # the chat stream, up to a failure
            yield first
            async for item in items:
                if isinstance(item, TandemError):
                    failed.append(item)
                    return
                yield item

        async with aclosing(convert.message_stream_converter(stream())) as events:
            async for event in events:
                yield event
        if failed:
            yield failed[0]


async def count_tokens(engine, body: dict) -> dict:
    """``POST /v1/messages/count_tokens``: the prompt tokens the same Messages request is billed for."""
    chat = chat_body(engine, body, count=True)
    kwargs = P.template_kwargs(chat.get("reasoning_effort"), chat.get("chat_template_kwargs"))
    ids, _ = await engine.intake.chat_prompt(chat["messages"], chat.get("tools"), kwargs)
    return {"input_tokens": len(ids), "context_management": {"original_input_tokens": len(ids)}}

