"""A diffusion request's output, OpenAI's way: per-choice events -> chunks and responses.

``DiffusionEngine.generate`` turns the loop's ``SeqEvent``s into the typed choice events below
(text already decoded, stop strings applied by ``ChoiceText``); ``openai_items`` builds the chat
and completions answers from them (SSE chunks ending with ``[DONE]``, or one response object);
``diffusion_plugin.api.responses`` builds the Responses API's events from the same stream.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass
from typing import NamedTuple

from diffusion_plugin.api.structured import ToolCallStream, tool_calls_from_text
from diffusion_plugin.api.token_text import TextOffsets, token_bytes, token_string
from diffusion_plugin.batcher.request import FINISH_REASON, SeqStatus
from tandem_core.errors import TandemError
from tandem_core.protocol import DONE, Item


@dataclass
class Preview:
    """The current block's argmax canvas (replace semantics): {block, step, max_steps, text}."""

    index: int
    preview: dict


class Entry(NamedTuple):
    """One committed token's logprobs: its id, logprob, the top (id, logprob) pairs, most probable
    first, and its offset into the choice's text (``token_text``)."""

    token_id: int
    logprob: float
    top: list
    offset: int


@dataclass
class Delta:
    """A committed block's new text; ``entries``: an ``Entry`` per token kept, or None; ``ids``: the
    tokens of exactly that text, when a parser reads it (``ChoiceText`` raw mode), else None."""

    index: int
    text: str
    entries: list | None = None
    ids: list | None = None
    tokens: int = 0  # the choice's output tokens so far (continuous usage)


@dataclass
class End:
    """A choice ended: its last text and logprob entries (held back until now), its finish_reason
    (and, raw mode, the ids of that text), and vLLM's ``stop_reason``: the stop string that ended
    it, else None."""

    index: int
    text: str
    finish_reason: str
    entries: list | None = None
    ids: list | None = None
    tokens: int = 0  # the choice's output tokens (continuous usage)
    stop_reason: str | None = None


@dataclass
class Prompt:
    """A choice's prompt, before its output: completions' ``echo`` text and (with logprobs) its
    entries (the first token's logprob None), and vLLM's ``prompt_logprobs`` list."""

    index: int
    text: str
    entries: list | None = None
    prompt_logprobs: list | None = None


@dataclass
class Usage:
    """The request's token counts; the last event of a request that did not fail."""

    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int | None = None  # prompt tokens found in the prefix cache (None: no cache)


Event = Preview | Prompt | Delta | End | Usage


class Released(NamedTuple):
    """What ``ChoiceText.add`` releases: new text, whether a stop string ended the choice, the
    logprob entries of the tokens kept (None without logprobs) and, raw mode, those tokens' ids."""

    text: str
    stopped: bool
    entries: list | None
    ids: list | None


class ChoiceText:
    """Incremental text of one sequence: deltas, stop strings, previews.

    ``raw`` (a parser reads the text, ``diffusion_plugin.api.parsing``): the text keeps special tokens
    (as vLLM's parsers set ``skip_special_tokens=False``) and only whole tokens are released,
    each delta with the ids of exactly its tokens, so the parser's text and ids agree."""

    def __init__(self, tokenizer, stops: list[str], raw: bool = False, min_tokens: int = 0,
                 include_stop: bool = False, keep_special: bool = False):
        self.tok = tokenizer
        self.stops = stops
        self.include_stop = include_stop  # vLLM's include_stop_str_in_output
        self.skip = not (raw or keep_special)  # special tokens left out of the text (vLLM's default)
        self.min_tokens = min_tokens  # vLLM's: no stop string ends within the first min_tokens tokens' text
        self._floor: int | None = None if min_tokens else 0
        self.raw = raw
        self.ids: list[int] = []
        self.text = ""
        self.sent = 0
        self.fed = 0  # raw mode: the tokens released
        self.stopped = False
        self.stop_string: str | None = None  # the stop string that ended the choice (vLLM's stop_reason)
        self.offsets = TextOffsets(tokenizer)
        self.held: list[Entry] = []  # logprob entries of tokens whose text is held back

    @property
    def num_tokens(self) -> int:
        return len(self.ids)

    def add(self, new_ids: list[int], logprobs: list | None = None) -> Released:
        """The new text, whether a stop string ended it, and the logprob entries of the tokens
        kept (a stop string drops those whose text starts at or after it)."""
        if self.stopped:
            return Released("", True, [] if logprobs is not None else None, [] if self.raw else None)
        self.ids.extend(new_ids)
        self.text = self.tok.decode(self.ids, skip_special_tokens=self.skip)
        if self._floor is None and len(self.ids) > self.min_tokens:
            self._floor = len(self.tok.decode(self.ids[:self.min_tokens], skip_special_tokens=self.skip))
        for stop in self.stops if self._floor is not None else ():
            at = self.text.find(stop, max(0, self._floor - len(stop) + 1))
            if at != -1:
                self.text = self.text[:at + len(stop) if self.include_stop else at]
                self.stopped = True
                self.stop_string = stop  # the last one found cut earliest: the one that ended the text
        # Hold back a trailing incomplete UTF-8 sequence until the next block completes it, and
        # a tail that may be the start of a stop string the next block completes (sent text
        # cannot be taken back); ``flush`` sends what is held when the sequence ends.
        safe = len(self.text) if self.stopped else len(self.text.rstrip("\ufffd")) - self._stop_prefix()
        ids = None
        if self.raw:
            safe, ids = self._whole_tokens(safe)
        delta, self.sent = self.text[self.sent:safe], max(self.sent, safe)
        if logprobs is None:
            return Released(delta, self.stopped, None, ids)
        self.held += [Entry(t, lp, top, self.offsets.push(t)) for t, (lp, top) in zip(new_ids, logprobs, strict=True)]
        if self.raw:  # entries go with their tokens
            entries, self.held = self.held[:len(ids)], self.held[len(ids):]
            if self.stopped:
                self.held = []
            return Released(delta, self.stopped, entries, ids)
        # A token's entry goes with its text: held while the text where it starts is held, dropped
        # if a stop string cuts before it. Offsets depend on the tokens before only, so a stream
        # and a whole answer carry the same entries whatever the blocks.
        if self.stopped:
            entries, self.held = [e for e in self.held if e.offset < len(self.text)], []
        else:
            entries = [e for e in self.held if e.offset < self.sent]
            self.held = self.held[len(entries):]
        return Released(delta, self.stopped, entries, None)

    def _whole_tokens(self, safe: int) -> tuple[int, list[int]]:
        """Raw mode: the text end and the ids to release now: the most tokens whose text is
        complete and within ``safe`` (a stop string's cut: the tokens up to the one it falls in)."""
        n = len(self.ids)
        if self.stopped:
            k = self.fed
            while k < n and len(self.tok.decode(self.ids[:k], skip_special_tokens=False)) < safe:
                k += 1
        else:
            k = n
            while k > self.fed:
                text = self.tok.decode(self.ids[:k], skip_special_tokens=False)
                if len(text) <= safe and not text.endswith("\ufffd"):
                    safe = len(text)
                    break
                k -= 1
            else:
                safe = self.sent
        ids, self.fed = self.ids[self.fed:k], k
        return max(safe, self.sent), ids

    def _stop_prefix(self) -> int:
        """The length of the longest tail of the text that begins some stop string."""
        text = self.text.rstrip("\ufffd")
        return max((k for stop in self.stops for k in range(min(len(stop) - 1, len(text)), 0, -1)
                    if text.endswith(stop[:k])), default=0)

    def flush(self) -> Released:
        """What was held back, sent when the sequence ends: its text, logprob entries and, raw
        mode, the ids not yet released."""
        delta, self.sent = self.text[self.sent:], len(self.text)
        entries, self.held = self.held, []
        ids = None
        if self.raw:
            ids, self.fed = ([] if self.stopped else self.ids[self.fed:]), len(self.ids)
        return Released(delta, self.stopped, entries, ids)

    def preview(self, canvas_ids: list[int]) -> str:
        return self.tok.decode(canvas_ids, skip_special_tokens=self.skip)

    def finish_reason(self, status: SeqStatus) -> str:
        return "stop" if self.stopped else FINISH_REASON.get(status, "stop")


async def openai_items(events: AsyncGenerator[Event, None], *, chat: bool, request_id: str, model: str, tokenizer,
                       n: int, stream: bool, include_usage: bool, top_logprobs: int | None,
                       structured=None, parsing=None, continuous_usage: int | None = None) -> AsyncIterator[Item]:
    """Chat or completions output: SSE chunks then ``DONE`` (``stream``), or one response object.
    A ``TandemError`` raised by ``events`` is yielded as the request's error (mid-stream too).
    ``structured`` (``diffusion_plugin.api.structured.Structured``) with a ``tool_mode``: the text is
    the tool calls' JSON, answered as ``tool_calls`` (streamed as vLLM streams them), with
    ``finish_reason`` "tool_calls" for "required" (and "stop" for a named function), as vLLM.
    ``parsing`` (``diffusion_plugin.api.parsing.Parsing``): the model's parsers read each choice's
    text (``content``, ``reasoning``, ``tool_calls``; "tool_calls" ends a choice that called one).
    ``continuous_usage`` (vLLM's ``continuous_usage_stats``): the prompt tokens; every chunk then
    carries the usage so far."""
    k = top_logprobs
    tool_mode = structured.tool_mode if structured is not None else None
    calls = [ToolCallStream(structured) for _ in range(n)] if tool_mode else None
    parsers = [parsing.choice() for _ in range(n)] if parsing is not None else None
    created = int(time.time())
    rid = ("chatcmpl-" if chat else "cmpl-") + request_id
    texts = [""] * n
    ids: list[list[int]] = [[] for _ in range(n)]
    entries: list[list] = [[] for _ in range(n)]
    finish: list[str | None] = [None] * n
    stop_reasons: list[str | None] = [None] * n  # vLLM's stop_reason: the stop string that ended a choice
    prompt_lps: list = [None] * n
    usage = None

    made = [0] * n  # output tokens per choice so far (continuous usage)

    def chunk(index, delta, finish=None, extra=None, logprobs=None) -> str:
        out = _chunk(rid, created, model, chat, index, delta, finish, extra, logprobs)
        if continuous_usage is not None:
            out["usage"] = {"prompt_tokens": continuous_usage, "completion_tokens": sum(made),
                            "total_tokens": continuous_usage + sum(made)}
        return sse(out)

    def content(ev: Delta | End) -> dict:
        if parsers is not None:
            return parsers[ev.index].add(ev.text, ev.ids or [], finished=isinstance(ev, End))
        if calls is None:
            return {"content": ev.text} if ev.text else {}
        entries = calls[ev.index].add(ev.text)
        return {"tool_calls": entries} if entries else {}

    def keep(ev: Delta | End) -> None:  # what the final answer (and usage) is built from
        made[ev.index] = max(made[ev.index], ev.tokens)
        texts[ev.index] += ev.text
        ids[ev.index] += ev.ids or []
        if ev.entries is not None:
            entries[ev.index].extend(ev.entries)

    def finish_reason(index: int, reason: str) -> str:
        called = tool_mode == "required" or (parsers is not None and parsers[index].tools_called)
        return "tool_calls" if called and reason == "stop" else reason

    try:
        if stream and chat:
            for i in range(n):
                yield chunk(i, {"role": "assistant", "content": ""})
        async for ev in events:
            if isinstance(ev, Preview):
                yield chunk(ev.index, {}, extra={"diffusion_preview": ev.preview})
            elif isinstance(ev, Prompt):  # completions' echo (chat: prompt_logprobs only)
                texts[ev.index] += ev.text
                entries[ev.index].extend(ev.entries or [])
                prompt_lps[ev.index] = ev.prompt_logprobs
                if stream and (ev.text or ev.entries):
                    lp = None if ev.entries is None else logprobs_object(tokenizer, ev.entries, k, chat)
                    yield chunk(ev.index, {"content": ev.text}, logprobs=lp)
            elif isinstance(ev, Delta):
                keep(ev)
                if stream:
                    lp = None if ev.entries is None else logprobs_object(tokenizer, ev.entries, k, chat)
                    delta = content(ev)
                    if delta or lp is not None:
                        yield chunk(ev.index, delta, logprobs=lp)
            elif isinstance(ev, End):
                keep(ev)
                stop_reasons[ev.index] = ev.stop_reason
                if stream:
                    lp = None if not ev.entries else logprobs_object(tokenizer, ev.entries, k, chat)
                    delta = content(ev)
                    finish[ev.index] = finish_reason(ev.index, ev.finish_reason)
                    yield chunk(ev.index, delta, finish=finish[ev.index], logprobs=lp,
                                extra={"stop_reason": ev.stop_reason})
                else:
                    finish[ev.index] = ev.finish_reason
            else:
                usage = {"prompt_tokens": ev.prompt_tokens, "completion_tokens": ev.completion_tokens,
                         "total_tokens": ev.prompt_tokens + ev.completion_tokens}
                if ev.cached_tokens is not None:  # vLLM's prompt_tokens_details (with its prefix cache)
                    usage["prompt_tokens_details"] = {"cached_tokens": ev.cached_tokens}
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
        if tool_mode:
            out = {"message": {"role": "assistant", "content": "",
                               "tool_calls": tool_calls_from_text(texts[i], structured)}}
        elif parsers is not None:
            try:
                reasoning, text, tool_calls = parsers[i].whole(texts[i], ids[i])
            except TandemError as e:
                yield e
                return
            message = {"role": "assistant", "content": text, "reasoning": reasoning}
            out = {"message": {**message, "tool_calls": tool_calls} if tool_calls else message}
        else:
            out = {"message": {"role": "assistant", "content": texts[i]}} if chat else {"text": texts[i]}
        lp = None if k is None else logprobs_object(tokenizer, entries[i], k, chat)
        choices.append({"index": i, **out, "logprobs": lp, "finish_reason": finish_reason(i, finish[i]),
                        "stop_reason": stop_reasons[i]})
        if prompt_lps[i] is not None and not chat:  # vLLM's: per choice on completions
            choices[-1]["prompt_logprobs"] = prompt_lps[i]
    answer = {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": created,
              "model": model, "choices": choices, "usage": usage}
    if chat and prompt_lps[0] is not None:  # vLLM's: once per chat response
        answer["prompt_logprobs"] = prompt_lps[0]
    yield answer


def logprobs_object(tok, entries: list[Entry], k: int, chat: bool) -> dict:
    """OpenAI's logprobs object for ``entries``: chat's ``content`` list (with each token's bytes),
    or completions' parallel lists. What a token's string, bytes and offset are: ``token_text``."""
    if chat:
        def item(t, lp):
            return {"token": token_string(tok, t), "logprob": lp, "bytes": token_bytes(tok, t)}
        return {"content": [{**item(e.token_id, e.logprob), "top_logprobs": [item(i, v) for i, v in e.top[:k]]}
                            for e in entries], "refusal": None}
    tops = []
    for e in entries:
        if e.logprob is None:  # an echoed prompt's first token: nothing before it to score it by
            tops.append(None)
            continue
        d: dict[str, float] = {}
        for i, v in [(e.token_id, e.logprob), *e.top[:k]]:  # the chosen token is always there, as on vLLM;
            d.setdefault(token_string(tok, i), v)  # tokens with one string (partial characters): the first
        tops.append(d)
    return {"tokens": [token_string(tok, e.token_id) for e in entries],
            "token_logprobs": [e.logprob for e in entries], "top_logprobs": tops,
            "text_offset": [e.offset for e in entries]}


def _chunk(rid, created, model, chat, index, delta, finish=None, extra=None, logprobs=None) -> dict:
    choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish} if chat else \
        {"index": index, "text": delta.get("content", ""), "logprobs": logprobs, "finish_reason": finish}
    if extra:
        choice.update(extra)
    return {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion", "created": created,
            "model": model, "choices": [choice]}


def sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"
