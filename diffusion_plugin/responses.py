"""``POST /v1/responses`` on a diffusion model: text (and image) input, text output.

Honoured: ``model``, ``input`` (a string, or a list of messages -- ``{"role", "content"}`` with a
string or ``input_text`` / ``output_text`` / ``input_image`` (URL) parts; role ``developer``
reads as ``system``), ``instructions`` (a system message first), ``max_output_tokens``,
``temperature`` (as on chat; 0 without ``seed`` is deterministic), ``seed`` (an extension, as on
chat), ``stream``, ``diffusion`` (the knobs of chat; ``previews`` streams
``response.diffusion_preview`` events {block, step, max_steps, text}, each replacing the
previous one of its block, between that block's ``response.output_text.delta`` events),
``user``, ``metadata``. One ``response.output_text.delta`` per committed block.

Refused with a 400 naming the field unless null or neutral: ``tools`` ([]), ``tool_choice``
("none", "auto"), ``store`` (false: nothing is stored; retrieval is not served), ``background``
(false), ``previous_response_id``, ``conversation``, ``reasoning``, ``text`` (only
``{"format": {"type": "text"}}``), ``include`` ([]), ``top_p`` (1), ``top_logprobs``,
``truncation`` ("disabled"), ``max_tool_calls``, ``prompt``, ``service_tier`` ("auto"), and any
other field. The Response object has OpenAI's shape: ``status`` "completed", or "incomplete"
with ``incomplete_details.reason`` "max_output_tokens".
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
    diffusion: P.DiffusionKnobs = Field(default_factory=P.DiffusionKnobs)


NEUTRAL: dict[str, tuple] = {
    "tools": ([],), "tool_choice": ("none", "auto"), "store": (False,), "background": (False,),
    "previous_response_id": (), "conversation": (), "reasoning": (), "text": ({"format": {"type": "text"}},),
    "include": ([],), "top_p": (1,), "top_logprobs": (), "truncation": ("disabled",), "max_tool_calls": (),
    "prompt": (), "service_tier": ("auto",), "parallel_tool_calls": (True, False),
}


_PARTS = {"input_text": "text", "output_text": "text", "text": "text"}


def to_messages(req: ResponsesBody) -> list[dict]:
    """Responses input -> chat messages for the model's chat template."""
    messages = [{"role": "system", "content": req.instructions}] if req.instructions else []
    if isinstance(req.input, str):
        return messages + [{"role": "user", "content": req.input}]
    for i, item in enumerate(req.input):
        kind = item.get("type", "message")
        role = item.get("role")
        if kind != "message" or role not in ("user", "assistant", "system", "developer"):
            raise invalid(f"input.{i}: only messages (role user, assistant, system or developer) are supported "
                          f"by the diffusion engine, not {kind!r}", param="input")
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


async def serve_responses(engine, body: dict, request_id: str) -> AsyncIterator:
    try:
        req = P.parse(ResponsesBody, body, NEUTRAL)
        sreq = await engine.intake.responses(req, to_messages(req))
    except TandemError as e:
        yield e
        return
    rid = request_id if request_id.startswith("resp_") else f"resp_{request_id}"
    msg_id = f"msg_{uuid.uuid4().hex}"
    created = int(time.time())
    text, finish, usage = "", "stop", (0, 0)

    def response(status: str) -> dict:
        output = [] if status == "in_progress" else [_message(msg_id, text, "completed")]
        incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
        inp, out = usage
        return {"id": rid, "object": "response", "created_at": created, "model": engine.model, "status": status,
                "error": None, "incomplete_details": incomplete, "instructions": req.instructions,
                "max_output_tokens": req.max_output_tokens, "metadata": body.get("metadata"), "output": output,
                "parallel_tool_calls": False, "temperature": req.temperature, "tool_choice": "none", "tools": [],
                "top_p": 1.0, "text": {"format": {"type": "text"}}, "truncation": "disabled", "store": False,
                "background": False, "user": body.get("user"),
                "usage": None if status == "in_progress" else {
                    "input_tokens": inp, "input_tokens_details": {"cached_tokens": 0}, "output_tokens": out,
                    "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": inp + out}}

    seq = 0

    def event(kind: str, **fields) -> str:
        nonlocal seq
        data = {"type": kind, "sequence_number": seq, **fields}
        seq += 1
        return f"event: {kind}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"

    where = {"item_id": msg_id, "output_index": 0, "content_index": 0}
    try:
        async with aclosing(engine.generate(request_id, sreq)) as events:
            if req.stream:
                yield event("response.created", response=response("in_progress"))
                yield event("response.in_progress", response=response("in_progress"))
                yield event("response.output_item.added", output_index=0,
                            item=_message(msg_id, "", "in_progress", []))
                yield event("response.content_part.added", **where, part=_part(""))
            async for ev in events:
                if isinstance(ev, Preview):
                    if req.stream:
                        yield event("response.diffusion_preview", **where, **ev.preview)
                elif isinstance(ev, Delta | End):
                    text += ev.text
                    if isinstance(ev, End):
                        finish = ev.finish_reason
                    if req.stream and ev.text:
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
    yield event("response.output_text.done", **where, text=text, logprobs=[])
    yield event("response.content_part.done", **where, part=_part(text))
    yield event("response.output_item.done", output_index=0, item=_message(msg_id, text, "completed"))
    yield event("response.incomplete" if status == "incomplete" else "response.completed", response=response(status))


def _part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _message(msg_id: str, text: str, status: str, content: list | None = None) -> dict:
    return {"id": msg_id, "type": "message", "role": "assistant", "status": status,
            "content": [_part(text)] if content is None else content}
