"""A diffusion request's output, OpenAI's way: per-choice events -> chunks and responses.

``DiffusionEngine.generate`` turns the loop's ``SeqEvent``s into the typed choice events below
(text already decoded, stop strings applied by ``ChoiceText``); ``openai_items`` builds the chat
and completions answers from them (SSE chunks ending with ``[DONE]``, or one response object);
``diffusion_plugin.responses`` builds the Responses API's events from the same stream.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass

from diffusion_plugin.request import FINISH_REASON, SeqStatus
from tandem_core.errors import TandemError
from tandem_core.protocol import DONE, Item


@dataclass
class Preview:
    """The current block's argmax canvas (replace semantics): {block, step, max_steps, text}."""

    index: int
    preview: dict


@dataclass
class Delta:
    """A committed block's new text; ``entries``: (token id, logprob, top) per token kept, or None."""

    index: int
    text: str
    entries: list | None = None


@dataclass
class End:
    """A choice ended: its last text (held back until now) and its finish_reason."""

    index: int
    text: str
    finish_reason: str


@dataclass
class Usage:
    """The request's token counts; the last event of a request that did not fail."""

    prompt_tokens: int
    completion_tokens: int


Event = Preview | Delta | End | Usage


class ChoiceText:
    """Incremental text of one sequence: deltas, stop strings, previews."""

    def __init__(self, tokenizer, stops: list[str]):
        self.tok = tokenizer
        self.stops = stops
        self.ids: list[int] = []
        self.text = ""
        self.sent = 0
        self.stopped = False

    @property
    def num_tokens(self) -> int:
        return len(self.ids)

    def add(self, new_ids: list[int], logprobs: list | None = None) -> tuple[str, bool, list | None]:
        """The new text, whether a stop string ended it, and the logprob entries (id, logprob,
        top) of the tokens kept (a stop string drops those whose text starts after it)."""
        if self.stopped:
            return "", True, [] if logprobs is not None else None
        self.ids.extend(new_ids)
        self.text = self.tok.decode(self.ids, skip_special_tokens=True)
        for stop in self.stops:
            at = self.text.find(stop)
            if at != -1:
                self.text = self.text[:at]
                self.stopped = True
        # Hold back a trailing incomplete UTF-8 sequence until the next block completes it, and
        # a tail that may be the start of a stop string the next block completes (sent text
        # cannot be taken back); ``flush`` sends what is held when the sequence ends.
        safe = len(self.text) if self.stopped else len(self.text.rstrip("\ufffd")) - self._stop_prefix()
        delta, self.sent = self.text[self.sent:safe], max(self.sent, safe)
        entries = None
        if logprobs is not None:
            entries = [(t, lp, top) for t, (lp, top) in zip(new_ids, logprobs, strict=False)]
            if self.stopped:
                keep = len(self.tok.decode(self.ids[:len(self.ids) - len(new_ids)], skip_special_tokens=True))
                kept = []
                for e in entries:
                    if keep >= len(self.text):
                        break
                    kept.append(e)
                    keep += len(self.tok.decode([e[0]], skip_special_tokens=True))
                entries = kept
        return delta, self.stopped, entries

    def _stop_prefix(self) -> int:
        """The length of the longest tail of the text that begins some stop string."""
        text = self.text.rstrip("\ufffd")
        return max((k for stop in self.stops for k in range(min(len(stop) - 1, len(text)), 0, -1)
                    if text.endswith(stop[:k])), default=0)

    def flush(self) -> str:
        delta, self.sent = self.text[self.sent:], len(self.text)
        return delta

    def preview(self, canvas_ids: list[int]) -> str:
        return self.tok.decode(canvas_ids, skip_special_tokens=True)

    def finish_reason(self, status: SeqStatus) -> str:
        return "stop" if self.stopped else FINISH_REASON.get(status, "stop")


async def openai_items(events: AsyncGenerator[Event, None], *, chat: bool, request_id: str, model: str, tokenizer,
                       n: int, stream: bool, include_usage: bool, top_logprobs: int | None) -> AsyncIterator[Item]:
    """Chat or completions output: SSE chunks then ``DONE`` (``stream``), or one response object.
    A ``TandemError`` raised by ``events`` is yielded as the request's error (mid-stream too)."""
    k = top_logprobs
    created = int(time.time())
    rid = ("chatcmpl-" if chat else "cmpl-") + request_id
    texts = [""] * n
    entries: list[list] = [[] for _ in range(n)]
    finish: list[str | None] = [None] * n
    usage = None

    def chunk(index, delta, finish=None, extra=None, logprobs=None) -> str:
        return sse(_chunk(rid, created, model, chat, index, delta, finish, extra, logprobs))

    try:
        if stream and chat:
            for i in range(n):
                yield chunk(i, {"role": "assistant", "content": ""})
        async for ev in events:
            if isinstance(ev, Preview):
                yield chunk(ev.index, {}, extra={"diffusion_preview": ev.preview})
            elif isinstance(ev, Delta):
                offset = len(texts[ev.index])
                texts[ev.index] += ev.text
                if ev.entries is not None:
                    entries[ev.index].extend(ev.entries)
                if stream:
                    lp = None if ev.entries is None else logprobs_object(tokenizer, ev.entries, k, chat, offset)
                    yield chunk(ev.index, {"content": ev.text}, logprobs=lp)
            elif isinstance(ev, End):
                texts[ev.index] += ev.text
                finish[ev.index] = ev.finish_reason
                if stream:
                    yield chunk(ev.index, {"content": ev.text} if ev.text else {}, finish=ev.finish_reason)
            else:
                usage = {"prompt_tokens": ev.prompt_tokens, "completion_tokens": ev.completion_tokens,
                         "total_tokens": ev.prompt_tokens + ev.completion_tokens}
    except TandemError as e:
        yield e
        return
    finally:
        await events.aclose()  # the client left (or the request failed): abort its sequences now
    if usage is None:  # the generator ended without its last event: never answer as if it had
        raise RuntimeError("bug: a diffusion request's events ended without usage")
    if stream:
        if include_usage:
            yield sse({"id": rid, "object": "chat.completion.chunk" if chat else "text_completion",
                       "created": created, "model": model, "choices": [], "usage": usage})
        yield DONE
        return
    choices = []
    for i in range(n):
        out = {"message": {"role": "assistant", "content": texts[i]}} if chat else {"text": texts[i]}
        lp = None if k is None else logprobs_object(tokenizer, entries[i], k, chat, 0)
        choices.append({"index": i, **out, "logprobs": lp, "finish_reason": finish[i]})
    yield {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": created,
           "model": model, "choices": choices, "usage": usage}


def _token_str(tok, token_id: int) -> str:
    """A token as logprobs name it: its own text, special tokens included (the text skips them)."""
    return tok.decode([token_id])


def logprobs_object(tok, entries: list, k: int, chat: bool, offset: int) -> dict:
    """OpenAI's logprobs object for (token id, logprob, top [(id, logprob)...]) entries: chat's
    ``content`` list, or completions' parallel lists (``text_offset`` from ``offset``)."""
    if chat:
        def item(t, lp):
            s = _token_str(tok, t)
            return {"token": s, "logprob": lp, "bytes": list(s.encode("utf-8"))}
        return {"content": [{**item(t, lp), "top_logprobs": [item(i, v) for i, v in top[:k]]}
                            for t, lp, top in entries], "refusal": None}
    tokens = [_token_str(tok, t) for t, _, _ in entries]
    offsets = []  # into the returned text, which skips special tokens
    for t, _, _ in entries:
        offsets.append(offset)
        offset += len(tok.decode([t], skip_special_tokens=True))
    tops = []
    for t, lp, top in entries:
        d = {_token_str(tok, i): v for i, v in top[:k]}
        d.setdefault(_token_str(tok, t), lp)  # the chosen token is always there, as vLLM does
        tops.append(d)
    return {"tokens": tokens, "token_logprobs": [lp for _, lp, _ in entries], "top_logprobs": tops,
            "text_offset": offsets}


def _chunk(rid, created, model, chat, index, delta, finish=None, extra=None, logprobs=None) -> dict:
    choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish} if chat else \
        {"index": index, "text": delta.get("content", ""), "logprobs": logprobs, "finish_reason": finish}
    if extra:
        choice.update(extra)
    return {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion", "created": created,
            "model": model, "choices": [choice]}


def sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"
