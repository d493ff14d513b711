"""``POST /v1/responses`` on a diffusion model: text (and image) input; reasoning, text and
function-call output.

Honoured: ``model``, ``input`` (a string, or a list of items: messages -- ``{"role", "content"}``
with a string or ``input_text`` / ``output_text`` / ``input_image`` (URL) parts; role
``developer`` reads as ``system`` -- ``function_call`` / ``function_call_output`` items, which
become an assistant turn with tool calls and ``tool`` turns for the chat template, and
``reasoning`` items, the next assistant turn's reasoning), ``instructions`` (a system message
first), ``max_output_tokens``, ``temperature`` (as on chat; 0 without ``seed`` is
deterministic), ``seed`` (an extension, as on chat), ``stream``, ``diffusion`` (the knobs of
chat; ``previews`` streams ``response.diffusion_preview`` events {block, step, max_steps, text},
each replacing the previous one of its block, between that block's
``response.output_text.delta`` events), ``text.format`` (``json_schema``, ``json_object``) and
vLLM's ``structured_outputs`` (structured outputs, ``diffusion_plugin.api.structured``), ``tools``
(function tools, given to the chat template) with ``tool_choice`` ``"required"`` or a named
function (the output is ``function_call`` items, constrained to vLLM's tool-call schema),
``"auto"`` (needs ``engine_args.tool_call_parser``: the output parsed by vLLM's parser,
``diffusion_plugin.api.parsing``) or ``"none"``, ``parallel_tool_calls``, ``user``, ``metadata``.
With a reasoning parser the model's thinking is a ``reasoning`` item.

Output items open as their first delta comes (``Outputs``): a reasoning item streams
``response.reasoning_text.delta`` events, a message ``response.output_text.delta`` events, a
function call ``response.output_item.added`` (name, call_id) then
``response.function_call_arguments.delta`` events; at most one event of each per committed block.

Refused with a 400 naming the field unless null or neutral: ``store`` (false: nothing is stored;
retrieval is not served), ``background`` (false), ``previous_response_id``, ``conversation``,
``reasoning`` (the effort knob: a chat template's thinking is not switched by it), ``include``
([]), ``top_p`` (1), ``top_logprobs``, ``truncation`` ("disabled"), ``max_tool_calls``,
``prompt``, ``service_tier`` ("auto"), ``tool_choice: "auto"`` with tools without a tool parser
(as ``vllm serve`` without one), and any other field. The Response object has OpenAI's shape:
``status`` "completed", or "incomplete" with ``incomplete_details.reason`` "max_output_tokens".
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from diffusion_plugin.api import params as P
from diffusion_plugin.api.chunks import Delta, End, Preview
from diffusion_plugin.api.structured import ToolCallStream, tool_calls_from_text
from tandem_core.errors import TandemError, invalid


class ResponsesBody(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    seed: int | None = Field(None, ge=-2**63, le=2**63 - 1)  # vLLM's range (int64)
    cache_salt: str | None = Field(None, min_length=1)  # vLLM's: prompts under different salts share nothing
    priority: int = Field(0, strict=True)  # vLLM's: lower is more urgent (the scheduler's order)
    top_p: float | None = Field(None, gt=0, le=1)  # vLLM's sampling field (``diffusion_plugin.step.filters``)
    stream: bool = False
    text: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None  # vLLM's (not with text.format)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    diffusion: P.DiffusionKnobs = Field(default_factory=P.DiffusionKnobs)

    def sampling_fields(self) -> dict[str, Any]:
        return {"top_p": 1.0 if self.top_p is None else self.top_p}


NEUTRAL: dict[str, tuple] = {
    "store": (False,), "background": (False,), "previous_response_id": (), "conversation": (), "reasoning": (),
    "include": ([],), "top_logprobs": (), "truncation": ("disabled",), "max_tool_calls": (),
    "prompt": (), "service_tier": ("auto",),
}


_PARTS = {"input_text": "text", "output_text": "text", "text": "text"}


def to_messages(req: ResponsesBody) -> list[dict]:
    """Responses input -> chat messages for the model's chat template (as vLLM's
    ``construct_input_messages``: consecutive function calls are one assistant turn with
    ``tool_calls``, a function call's output a ``tool`` turn)."""
    messages = [{"role": "system", "content": req.instructions}] if req.instructions else []
    reasoning = None  # a reasoning item's text, for the assistant turn after it
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
                messages.append(_assistant({"role": "assistant", "content": None, "tool_calls": [call]}, reasoning))
                reasoning = None
            continue
        if kind == "reasoning":  # a reasoning output item sent back: the next assistant turn's reasoning
            texts = [c.get("text") for c in item.get("content") or [] if isinstance(c, dict)]
            if not all(isinstance(t, str) for t in texts):
                raise invalid(f"input.{i}: a reasoning item's content is reasoning_text parts", "input")
            reasoning = "".join(texts)
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
        message = {"role": "system" if role == "developer" else role, "content": content}
        if role == "assistant":
            message, reasoning = _assistant(message, reasoning), None
        messages.append(message)
    if not messages:
        raise invalid("input: at least one message", param="input")
    return messages


def _assistant(message: dict, reasoning: str | None) -> dict:
    """An assistant turn with the reasoning that preceded it (``reasoning``, which chat templates
    read as vLLM gives it; Gemma 4's renders it before tool calls)."""
    return {**message, "reasoning": reasoning} if reasoning else message


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
        p = await engine.preparer.prepare(body, "responses")
    except TandemError as e:
        yield e
        return
    req, sreq, structured, parsing = p.body, p.request, p.structured, p.parsing
    tool_mode = structured.tool_mode if structured is not None else None
    rid = request_id if request_id.startswith("resp_") else f"resp_{request_id}"
    created = int(time.time())
    text, ids, finish, usage = "", [], "stop", (0, 0, 0)
    seq = 0

    def event(kind: str, **fields) -> str:
        nonlocal seq
        data = {"type": kind, "sequence_number": seq, **fields}
        seq += 1
        return f"event: {kind}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"

    out = Outputs(event)
    if parsing is not None:  # the model's parsers: reasoning, text and function calls
        choice = parsing.choice()

        def fields(ev) -> dict:
            return choice.add(ev.text, ev.ids or [], finished=isinstance(ev, End))
    elif tool_mode:  # constrained tool calls: function calls only
        calls = ToolCallStream(structured)

        def fields(ev) -> dict:
            return {"tool_calls": calls.add(ev.text)}
    else:  # text: one message, opened first (it carries the previews)
        out.open("message")

        def fields(ev) -> dict:
            return {"content": ev.text}

    def response(status: str, output: list[dict]) -> dict:
        incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
        inp, n_out, cached = usage
        return {"id": rid, "object": "response", "created_at": created, "model": engine.model, "status": status,
                "error": None, "incomplete_details": incomplete, "instructions": req.instructions,
                "max_output_tokens": req.max_output_tokens, "metadata": body.get("metadata"), "output": output,
                "parallel_tool_calls": req.parallel_tool_calls is not False, "temperature": req.temperature,
                "tool_choice": req.tool_choice or ("auto" if req.tools else "none"), "tools": req.tools or [],
                "top_p": 1.0, "text": req.text or {"format": {"type": "text"}}, "truncation": "disabled",
                "store": False, "background": False, "user": body.get("user"),
                "usage": None if status == "in_progress" else {
                    "input_tokens": inp, "input_tokens_details": {"cached_tokens": cached}, "output_tokens": n_out,
                    "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": inp + n_out}}

    try:
        async with aclosing(engine.generate(request_id, sreq)) as events:
            if req.stream:
                yield event("response.created", response=response("in_progress", []))
                yield event("response.in_progress", response=response("in_progress", []))
                for e in out.pending():
                    yield e
            async for ev in events:
                if isinstance(ev, Preview):
                    if req.stream and out.preview_item is not None:
                        yield event("response.diffusion_preview", **out.preview_item, **ev.preview)
                elif isinstance(ev, Delta | End):
                    text += ev.text
                    ids += ev.ids or []
                    if isinstance(ev, End):
                        finish = ev.finish_reason
                    if req.stream:
                        for e in out.add(fields(ev)):
                            yield e
                else:
                    usage = (ev.prompt_tokens, ev.completion_tokens, ev.cached_tokens or 0)
        status = "incomplete" if finish == "length" else "completed"
        if not req.stream:  # the whole answer's items, as vLLM builds them
            if parsing is not None:
                reasoning, content, tool_calls = choice.whole(text, ids)
                out.add({"reasoning": reasoning, "content": content, "tool_calls": [
                    {**c, "index": i} for i, c in enumerate(tool_calls)]})
                if not out.items:
                    out.open("message")
            elif tool_mode:
                calls_made = tool_calls_from_text(text, structured)
                out.add({"tool_calls": [{**c, "index": i} for i, c in enumerate(calls_made)]})
            else:
                out.add(fields(End(0, text, finish)))
            out.finish()
            yield response(status, out.items)
            return
    except TandemError as e:
        yield e
        return
    for e in out.finish():
        yield e
    yield event("response.incomplete" if status == "incomplete" else "response.completed",
                response=response(status, out.items))


class Outputs:
    """A Response's output items, built from per-block delta fields (``reasoning``, ``content``,
    ``tool_calls`` as the chat route streams them), and their streamed events: a reasoning item,
    a message or a function call opens when its first delta comes and the item before it is
    done then; function calls are done at the end."""

    def __init__(self, event):
        self.event = event
        self.items: list[dict] = []
        self.open_text: int | None = None  # the output index of the open reasoning or message item
        self.calls: dict[int, int] = {}  # tool-call index -> output index
        self.preview_item: dict | None = None
        self._pending: list[tuple[str, dict]] = []  # events not yet numbered: (type, fields)

    def pending(self) -> list[str]:
        """The queued events, numbered now (in the order they are sent)."""
        out, self._pending = self._pending, []
        return [self.event(kind, **fields) for kind, fields in out]

    def _queue(self, kind: str, **fields) -> None:
        self._pending.append((kind, fields))

    def add(self, fields: dict) -> list[str]:
        events = self.pending()
        if fields.get("reasoning"):
            events += self._text("reasoning", fields["reasoning"])
        if fields.get("content"):
            events += self._text("message", fields["content"])
        for entry in fields.get("tool_calls") or []:
            events += self._call(entry)
        return events

    def open(self, kind: str) -> None:
        index = len(self.items)
        if kind == "message":
            self.items.append({"id": f"msg_{uuid.uuid4().hex}", "type": "message", "role": "assistant",
                               "status": "in_progress", "content": []})
            where = {"item_id": self.items[index]["id"], "output_index": index, "content_index": 0}
            self.preview_item = where if index == 0 else None
            self._queue("response.output_item.added", output_index=index, item=_copy(self.items[index]))
            self._queue("response.content_part.added", **where, part=_part(""))
            self.items[index]["content"] = [_part("")]
        else:
            self.items.append({"id": f"rs_{uuid.uuid4().hex}", "type": "reasoning", "summary": [],
                               "status": "in_progress", "content": []})
            self._queue("response.output_item.added", output_index=index, item=_copy(self.items[index]))
            self.items[index]["content"] = [{"type": "reasoning_text", "text": ""}]
        self.open_text = index

    def _text(self, kind: str, delta: str) -> list[str]:
        if self.open_text is None or self.items[self.open_text]["type"] != kind:
            self._close_text()
            self.open(kind)
        index = self.open_text
        item = self.items[index]
        item["content"][0]["text"] += delta
        where = {"item_id": item["id"], "output_index": index, "content_index": 0}
        name = "response.output_text.delta" if kind == "message" else "response.reasoning_text.delta"
        extra = {"logprobs": []} if kind == "message" else {}
        self._queue(name, **where, delta=delta, **extra)
        return self.pending()

    def _close_text(self) -> None:
        if self.open_text is None:
            return
        index, self.open_text = self.open_text, None
        item = self.items[index]
        item["status"] = "completed"
        text = item["content"][0]["text"]
        where = {"item_id": item["id"], "output_index": index, "content_index": 0}
        if item["type"] == "message":
            self._queue("response.output_text.done", **where, text=text, logprobs=[])
            self._queue("response.content_part.done", **where, part=_part(text))
        else:
            self._queue("response.reasoning_text.done", **where, text=text)
        self._queue("response.output_item.done", output_index=index, item=_copy(item))

    def _call(self, entry: dict) -> list[str]:
        fn = entry.get("function") or {}
        if entry["index"] not in self.calls:
            self._close_text()
            self.calls[entry["index"]] = len(self.items)
            self.items.append(_function_call(entry["id"], fn["name"], "", "in_progress"))
            self._queue("response.output_item.added", output_index=len(self.items) - 1, item=_copy(self.items[-1]))
        index = self.calls[entry["index"]]
        if fn.get("arguments"):
            self.items[index]["arguments"] += fn["arguments"]
            self._queue("response.function_call_arguments.delta", item_id=self.items[index]["id"], output_index=index,
                        delta=fn["arguments"])
        return self.pending()

    def finish(self) -> list[str]:
        """The open items' done events; every item completed."""
        self._close_text()
        for index in self.calls.values():
            item = self.items[index]
            item["status"] = "completed"
            self._queue("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                        arguments=item["arguments"])
            self._queue("response.output_item.done", output_index=index, item=_copy(item))
        return self.pending()


def _copy(item: dict) -> dict:
    return json.loads(json.dumps(item))


def _function_call(call_id: str, name: str, arguments: str, status: str) -> dict:
    return {"id": f"fc_{uuid.uuid4().hex}", "type": "function_call", "call_id": call_id, "name": name,
            "arguments": arguments, "status": status}


def _part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
