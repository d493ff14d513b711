"""``POST /v1/responses`` on a diffusion model: text (and image) input, text or function-call output.

Honoured: ``model``, ``input`` (a string, or a list of items: messages -- ``{"role", "content"}``
with a string or ``input_text`` / ``output_text`` / ``input_image`` (URL) parts; role
``developer`` reads as ``system`` -- and ``function_call`` / ``function_call_output`` items, which
become an assistant turn with tool calls and ``tool`` turns for the chat template),
``instructions`` (a system message first), ``max_output_tokens``, ``temperature`` (as on chat; 0
without ``seed`` is deterministic), ``seed`` (an extension, as on chat), ``stream``,
``diffusion`` (the knobs of chat; ``previews`` streams ``response.diffusion_preview`` events
{block, step, max_steps, text}, each replacing the previous one of its block, between that
block's ``response.output_text.delta`` events), ``text.format`` (``json_schema``,
``json_object``: structured outputs, ``diffusion_plugin.structured``), ``tools`` (function
tools, given to the chat template) with ``tool_choice`` ``"required"`` or a named function (the
output is ``function_call`` items, constrained to vLLM's tool-call schema; ``"none"``: text),
``parallel_tool_calls``, ``user``, ``metadata``. One ``response.output_text.delta`` per committed
block; function calls stream as ``response.output_item.added`` (name, call_id) then
``response.function_call_arguments.delta`` events, per committed block.

Refused with a 400 naming the field unless null or neutral: ``store`` (false: nothing is stored;
retrieval is not served), ``background`` (false), ``previous_response_id``, ``conversation``,
``reasoning``, ``include`` ([]), ``top_p`` (1), ``top_logprobs``, ``truncation`` ("disabled"),
``max_tool_calls``, ``prompt``, ``service_tier`` ("auto"), ``tool_choice: "auto"`` with tools (no
tool parser: as ``vllm serve`` without one), and any other field. The Response object has
OpenAI's shape: ``status`` "completed", or "incomplete" with ``incomplete_details.reason``
"max_output_tokens".
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from diffusion_plugin import params as P
from diffusion_plugin.chunks import Delta, End, Preview
from diffusion_plugin.structured import ToolCallStream, tool_calls_from_text
from tandem_core.errors import TandemError, invalid


class ResponsesBody(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    seed: int | None = Field(None, ge=0, le=2**63 - 1)
    stream: bool = False
    text: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    diffusion: P.DiffusionKnobs = Field(default_factory=P.DiffusionKnobs)


NEUTRAL: dict[str, tuple] = {
    "store": (False,), "background": (False,), "previous_response_id": (), "conversation": (), "reasoning": (),
    "include": ([],), "top_p": (1,), "top_logprobs": (), "truncation": ("disabled",), "max_tool_calls": (),
    "prompt": (), "service_tier": ("auto",),
}


_PARTS = {"input_text": "text", "output_text": "text", "text": "text"}


def to_messages(req: ResponsesBody) -> list[dict]:
    """Responses input -> chat messages for the model's chat template (as vLLM's
    ``construct_input_messages``: consecutive function calls are one assistant turn with
    ``tool_calls``, a function call's output a ``tool`` turn)."""
    messages = [{"role": "system", "content": req.instructions}] if req.instructions else []
    if isinstance(req.input, str):
        return messages + [{"role": "user", "content": req.input}]
    for i, item in enumerate(req.input):
        kind = item.get("type", "message")
        role = item.get("role")
        if kind == "function_call":
            call = {"id": item.get("call_id"), "type": "function",
                    "function": {"name": item.get("name"), "arguments": item.get("arguments")}}
            if not all(isinstance(v, str) for v in (call["id"], *call["function"].values())):
                raise invalid(f"input.{i}: a function_call needs call_id, name and arguments (strings)", "input")
            if messages and messages[-1]["role"] == "assistant" and messages[-1].get("tool_calls"):
                messages[-1]["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
            continue
        if kind == "function_call_output":
            output = item.get("output")
            if not isinstance(item.get("call_id"), str) or not isinstance(output, str):
                raise invalid(f"input.{i}: a function_call_output needs call_id and output (strings)", "input")
            messages.append({"role": "tool", "content": output, "tool_call_id": item["call_id"]})
            continue
        if kind != "message" or role not in ("user", "assistant", "system", "developer"):
            raise invalid(f"input.{i}: only messages (role user, assistant, system or developer), function_call "
                          f"and function_call_output items are supported by the diffusion engine, not {kind!r}",
                          param="input")
        content = item.get("content")
        if not isinstance(content, str):
            parts = []
            for part in content or []:
                t = part.get("type") if isinstance(part, dict) else None
                if t in _PARTS and isinstance(part.get("text"), str):
                    parts.append({"type": "text", "text": part["text"]})
                elif t == "input_image" and isinstance(part.get("image_url"), str):
                    parts.append({"type": "image_url", "image_url": {"url": part["image_url"]}})
                else:
                    raise invalid(f"input.{i}.content: part type {t!r} is not supported by the diffusion engine",
                                  param="input")
            content = parts
        messages.append({"role": "system" if role == "developer" else role, "content": content})
    if not messages:
        raise invalid("input: at least one message", param="input")
    return messages


def chat_tools(tools: list[dict] | None) -> list[dict] | None:
    """Responses' flat function tools -> chat's ``{"type": "function", "function": {...}}`` for the
    chat template (as vLLM's ``construct_tool_dicts``)."""
    if not tools:
        return None
    out = []
    for i, t in enumerate(tools):
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(t.get("name"), str):
            raise invalid(f"tools.{i}: only function tools are supported by the diffusion engine", param="tools")
        out.append({"type": "function", "function": {k: t[k] for k in ("name", "description", "parameters", "strict")
                                                     if t.get(k) is not None}})
    return out


async def serve_responses(engine, body: dict, request_id: str) -> AsyncIterator:
    try:
        req = P.parse(ResponsesBody, body, NEUTRAL)
        tools = chat_tools(req.tools)
        structured, grammar = await engine.constraint(body, "responses")
        sreq = await engine.intake.responses(req, to_messages(req), tools)
        sreq.grammar = grammar
    except TandemError as e:
        yield e
        return
    tool_mode = structured.tool_mode if structured is not None else None
    rid = request_id if request_id.startswith("resp_") else f"resp_{request_id}"
    msg_id = f"msg_{uuid.uuid4().hex}"
    created = int(time.time())
    text, finish, usage = "", "stop", (0, 0)
    calls = ToolCallStream(structured) if tool_mode else None
    streamed_calls: dict[int, dict] = {}  # output index -> its function_call item, as streamed

    def output(status: str) -> list[dict]:
        if status == "in_progress":
            return []
        if not tool_mode:
            return [_message(msg_id, text, "completed")]
        if req.stream:
            return [{**item, "status": "completed"} for _, item in sorted(streamed_calls.items())]
        return [_function_call(c["id"], c["function"]["name"], c["function"]["arguments"], "completed")
                for c in tool_calls_from_text(text, structured)]

    def response(status: str) -> dict:
        incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
        inp, out = usage
        return {"id": rid, "object": "response", "created_at": created, "model": engine.model, "status": status,
                "error": None, "incomplete_details": incomplete, "instructions": req.instructions,
                "max_output_tokens": req.max_output_tokens, "metadata": body.get("metadata"), "output": output(status),
                "parallel_tool_calls": req.parallel_tool_calls is not False, "temperature": req.temperature,
                "tool_choice": req.tool_choice or ("auto" if req.tools else "none"), "tools": req.tools or [],
                "top_p": 1.0, "text": req.text or {"format": {"type": "text"}}, "truncation": "disabled",
                "store": False, "background": False, "user": body.get("user"),
                "usage": None if status == "in_progress" else {
                    "input_tokens": inp, "input_tokens_details": {"cached_tokens": 0}, "output_tokens": out,
                    "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": inp + out}}

    seq = 0

    def event(kind: str, **fields) -> str:
        nonlocal seq
        data = {"type": kind, "sequence_number": seq, **fields}
        seq += 1
        return f"event: {kind}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"

    def call_events(new_text: str):
        """A committed block's function-call events: a call's item when it starts (name, call_id),
        then its arguments as they come (vLLM's streaming of the tool-call JSON)."""
        for entry in calls.add(new_text):
            index, fn = entry["index"], entry.get("function", {})
            if index not in streamed_calls:
                streamed_calls[index] = _function_call(entry["id"], fn["name"], "", "in_progress")
                yield event("response.output_item.added", output_index=index, item=streamed_calls[index])
            if fn.get("arguments"):
                streamed_calls[index]["arguments"] += fn["arguments"]
                yield event("response.function_call_arguments.delta", item_id=streamed_calls[index]["id"],
                            output_index=index, delta=fn["arguments"])

    where = {"item_id": msg_id, "output_index": 0, "content_index": 0}
    try:
        async with aclosing(engine.generate(request_id, sreq)) as events:
            if req.stream:
                yield event("response.created", response=response("in_progress"))
                yield event("response.in_progress", response=response("in_progress"))
                if not tool_mode:
                    yield event("response.output_item.added", output_index=0,
                                item=_message(msg_id, "", "in_progress", []))
                    yield event("response.content_part.added", **where, part=_part(""))
            async for ev in events:
                if isinstance(ev, Preview):
                    if req.stream and not tool_mode:
                        yield event("response.diffusion_preview", **where, **ev.preview)
                elif isinstance(ev, Delta | End):
                    text += ev.text
                    if isinstance(ev, End):
                        finish = ev.finish_reason
                    if req.stream and tool_mode:
                        for e in call_events(ev.text):
                            yield e
                    elif req.stream and ev.text:
                        yield event("response.output_text.delta", **where, delta=ev.text, logprobs=[])
                else:
                    usage = (ev.prompt_tokens, ev.completion_tokens)
    except TandemError as e:
        yield e
        return
    status = "incomplete" if finish == "length" else "completed"
    if not req.stream:
        yield response(status)
        return
    if tool_mode:
        for index, item in sorted(streamed_calls.items()):
            yield event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                        arguments=item["arguments"])
            yield event("response.output_item.done", output_index=index, item={**item, "status": "completed"})
    else:
        yield event("response.output_text.done", **where, text=text, logprobs=[])
        yield event("response.content_part.done", **where, part=_part(text))
        yield event("response.output_item.done", output_index=0, item=_message(msg_id, text, "completed"))
    yield event("response.incomplete" if status == "incomplete" else "response.completed", response=response(status))


def _function_call(call_id: str, name: str, arguments: str, status: str) -> dict:
    return {"id": f"fc_{uuid.uuid4().hex}", "type": "function_call", "call_id": call_id, "name": name,
            "arguments": arguments, "status": status}


def _part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _message(msg_id: str, text: str, status: str, content: list | None = None) -> dict:
    return {"id": msg_id, "type": "message", "role": "assistant", "status": status,
            "content": [_part(text)] if content is None else content}
