"""The diffusion engine: ``tandem_core.protocol.Engine`` over tandem's block-granular batcher.

OpenAI in, OpenAI out: each committed block is an ordinary delta chunk (append-only); with
``"diffusion": {"previews": true}`` preview chunks (empty ``delta`` plus ``diffusion_preview``,
replace semantics) come between them. Routes: ``chat``, ``completions``, ``responses``
(``diffusion_plugin.responses``), ``tokenize``, ``detokenize``. Which OpenAI fields are honoured
and which are refused (400 naming the field), the logprobs definition and temperature 0's seed:
``diffusion_plugin.params``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from diffusion_plugin import params as P
from diffusion_plugin.images import ImageLimits, extract_images, load_images
from diffusion_plugin.loop import DiffusionLoop, SeqEvent
from diffusion_plugin.memory import GIB, MemoryBudget, default_budget_bytes, host_available_bytes, step_transient_bytes
from diffusion_plugin.request import FINISH_REASON, SamplingParams, SeqStatus, Sequence
from tandem_core.errors import ErrorKind, TandemError, invalid
from tandem_core.protocol import DONE, EngineInfo, EngineStats, Item

logger = logging.getLogger(__name__)


class DiffusionEngine:
    def __init__(self, model: str, source: str, engine_args: dict[str, Any]):
        args = dict(engine_args)
        args.pop("family", None)
        self.model = model
        self.source = source
        self.max_batch = int(args.pop("max_batch", 16))
        self.row_boundaries = args.pop("boundaries", "block") == "row"
        self.dtype = args.pop("dtype", "float32")
        self.num_threads = args.pop("num_threads", None)
        # "exact": bit-exact with generate() alone; "fast": batch-invariant, fused, not equal to HF.
        self.sampler = args.pop("sampler", "exact")
        if self.sampler not in ("exact", "fast"):
            raise ValueError("engine_args.sampler: must be 'exact' or 'fast'")
        # Bytes sequences may reserve (KV + per-row state); default: memory.SAFETY_FRACTION of the
        # memory free once the weights are loaded (host MemAvailable, or the device's free
        # memory), less the fixed vocab-wide transient of a step.
        budget = args.pop("memory_budget_gib", None)
        self.memory_budget_gib = float(budget) if budget is not None else None
        self.device = args.pop("device", "cpu")
        self.image_limits = ImageLimits.from_engine_args(args)
        if args:
            raise ValueError(f"engine_args.{next(iter(args))}: not a diffusion engine argument")
        self.adapter = None
        self.loop: DiffusionLoop | None = None
        self._requests: dict[str, list[str]] = {}
        self.image_stats = {"images": 0, "image_requests": 0, "image_encode_s": 0.0}

    async def start(self) -> EngineInfo:
        from diffusion_plugin.families.diffusiongemma import DiffusionGemmaAdapter
        from diffusion_plugin.runner import Runner
        from diffusion_plugin.scheduler import Scheduler

        self.adapter = await asyncio.to_thread(DiffusionGemmaAdapter, self.source, self.dtype, device=self.device,
                                               num_threads=self.num_threads)
        self.memory = self._budget()
        scheduler = Scheduler(self.max_batch, self.adapter.canvas_length, self.row_boundaries, memory=self.memory)
        self.loop = DiffusionLoop(scheduler, Runner(self.adapter, self.sampler, chunk_rows=self._chunk_rows()))
        self.loop.start()
        return EngineInfo(model=self.model, kind="diffusion", max_model_len=self.adapter.max_position,
                          extra={"canvas_length": self.adapter.canvas_length, "max_batch": self.max_batch,
                                 "boundaries": "row" if self.row_boundaries else "block"})

    def _chunk_rows(self) -> int:
        # CPU: one row at a time (a C x V matmul is already large); a GPU takes a few rows per pass.
        return 1 if self.sampler == "exact" or str(self.device).startswith("cpu") else 4

    def _budget(self) -> MemoryBudget:
        shape = self.adapter.memory_shape()
        if self.memory_budget_gib is not None:
            return MemoryBudget(shape, int(self.memory_budget_gib * GIB))
        if str(self.device).startswith("cuda"):
            import torch

            free = torch.cuda.mem_get_info(torch.device(self.device))[0]
        else:
            free = host_available_bytes()
        transient = step_transient_bytes(shape, self.sampler, self._chunk_rows())
        return MemoryBudget(shape, default_budget_bytes(free, transient))

    # -- requests -------------------------------------------------------------------------
    def chat(self, body: dict, request_id: str) -> AsyncIterator[Item]:
        return self._serve(body, request_id, chat=True)

    def completions(self, body: dict, request_id: str) -> AsyncIterator[Item]:
        return self._serve(body, request_id, chat=False)

    def _prompt_ids(self, messages: list | None, prompt: str | None) -> list[int]:
        tok = self.adapter.tokenizer
        if messages is not None:
            try:
                return tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                               return_dict=False)
            except Exception as e:  # noqa: BLE001 - a malformed message is the client's error
                raise invalid(f"messages: cannot apply the chat template: {e}", param="messages") from None
        return tok(prompt).input_ids

    async def _images(self, messages: list) -> tuple[list, object | None]:
        """The messages with image parts as placeholders, and the request's encoded images (None
        without any). Decoding and the vision tower run in a worker thread, not in the denoise
        loop: a large image delays its own request, not the other sequences' steps."""
        messages, sources = extract_images(messages, self.image_limits)
        if not sources:
            return messages, None
        if not self.adapter.has_vision:
            raise invalid(f"messages: model {self.model!r} does not take image input", "messages")
        pictures = await load_images(sources, self.image_limits)
        t0 = time.perf_counter()
        embeds = await asyncio.to_thread(self.adapter.encode_images, pictures)
        self.image_stats["image_encode_s"] += time.perf_counter() - t0
        self.image_stats["images"] += len(pictures)
        self.image_stats["image_requests"] += 1
        return messages, embeds

    async def _prepare(self, req, chat: bool, messages: list | None = None) -> tuple[list[int], object | None, dict]:
        """The prompt's ids, its encoded images (or None) and the effective knobs; raises TandemError."""
        images = None
        if chat:
            messages, images = await self._images(req.messages if messages is None else messages)
            prompt_ids = self._prompt_ids(messages, None)
        else:
            prompt_ids = self._prompt_ids(None, req.prompt)
        if images is not None:
            try:
                prompt_ids = self.adapter.expand_image_tokens(prompt_ids, images.num_soft_tokens)
            except ValueError as e:
                raise invalid(f"messages: {e}", "messages") from None
        return prompt_ids, images, P.resolve(req, self.adapter.defaults())

    def _check_fits(self, prompt_ids: list[int], max_tokens: int, knobs: dict, field: str,
                    limit_field: str = "max_tokens") -> None:
        limit = self.adapter.max_position
        if limit and len(prompt_ids) + max_tokens + self.adapter.canvas_length > limit:
            raise TandemError(ErrorKind.CONTEXT_TOO_LONG,
                              f"This model's maximum context length is {limit} tokens; the prompt has "
                              f"{len(prompt_ids)} and {limit_field} is {max_tokens}.", field)
        if not self.loop.scheduler.fits_alone(Sequence("probe", prompt_ids, SamplingParams(
                max_tokens=max_tokens, seed=0, **{k: v for k, v in knobs.items() if k != "seed"}))):
            longest = self.memory.max_prompt_tokens(max_tokens)
            budget = self.memory.budget_bytes / GIB
            if longest > 0:
                raise TandemError(ErrorKind.CONTEXT_TOO_LONG,
                                  f"{field}: the prompt ({len(prompt_ids)} tokens) with {limit_field} {max_tokens} "
                                  f"needs more than this replica's memory budget ({budget:.2f} GiB); with that "
                                  f"{limit_field} the prompt may have at most {longest} tokens", field)
            raise TandemError(ErrorKind.CONTEXT_TOO_LONG,
                              f"{limit_field}: {max_tokens} needs more than this replica's memory budget "
                              f"({budget:.2f} GiB) even with an empty prompt", limit_field)

    async def _generate(self, request_id: str, prompt_ids: list[int], images, knobs: dict, max_tokens: int, n: int,
                        stops: list[str], previews: bool, logprobs: int | None) -> AsyncIterator[tuple]:
        """The request's sequences run: yields ("preview", index, preview dict), ("block", index,
        delta text, logprob entries or None) and ("finished", index, last delta, finish_reason),
        then ("usage", prompt_tokens, completion_tokens). Aborts its sequences when closed."""
        seed = knobs.pop("seed")
        seqs = [Sequence(seq_id=f"{request_id}-{i}", prompt_ids=list(prompt_ids),
                         params=SamplingParams(max_tokens=max_tokens, seed=seed + i,
                                               eos_token_ids=self.adapter.eos_token_ids,
                                               previews=previews, logprobs=logprobs, **knobs),
                         images=images)
                for i in range(n)]
        self._requests[request_id] = [s.seq_id for s in seqs]
        merged: asyncio.Queue = asyncio.Queue()
        pumps = [asyncio.create_task(_forward(self.loop.submit(s), merged)) for s in seqs]
        texts = {s.seq_id: _Text(self.adapter.tokenizer, stops) for s in seqs}
        finished = 0
        try:
            while finished < len(seqs):
                ev: SeqEvent = await merged.get()
                index = seqs.index(ev.seq)
                text = texts[ev.seq.seq_id]
                if ev.kind == "preview" and previews:
                    yield ("preview", index, {"block": ev.seq.block, "step": ev.step,
                                              "max_steps": ev.seq.params.max_denoising_steps,
                                              "text": text.preview(ev.new_ids)})
                elif ev.kind == "block":
                    delta, stopped, entries = text.add(ev.new_ids, ev.logprobs)
                    if stopped:
                        self.loop.abort(ev.seq.seq_id, SeqStatus.FINISHED_STOPPED)
                    if delta or entries:
                        yield ("block", index, delta, entries)
                elif ev.kind == "finished":
                    finished += 1
                    if ev.seq.status is SeqStatus.FINISHED_ERROR:
                        raise TandemError(ErrorKind.ENGINE_ERROR, f"the diffusion batch failed: {ev.seq.error}")
                    yield ("finished", index, text.flush(), _finish(ev.seq, text))
            yield ("usage", len(prompt_ids) * len(seqs), sum(texts[s.seq_id].num_tokens for s in seqs))
        finally:
            for p in pumps:
                p.cancel()
            for s in seqs:
                if not s.status.finished:
                    self.loop.abort(s.seq_id)
            self._requests.pop(request_id, None)

    async def _serve(self, body: dict, request_id: str, chat: bool) -> AsyncIterator[Item]:
        try:
            req = P.parse(P.ChatBody if chat else P.CompletionBody, body)
            prompt_ids, images, knobs = await self._prepare(req, chat)
            max_tokens = req.output_limit() or 256
            self._check_fits(prompt_ids, max_tokens, knobs, "messages" if chat else "prompt")
        except TandemError as e:
            yield e
            return
        k = req.top_logprobs_k()
        tok = self.adapter.tokenizer
        created = int(time.time())
        rid = ("chatcmpl-" if chat else "cmpl-") + request_id
        texts = [""] * req.n
        entries: list[list] = [[] for _ in range(req.n)]
        finish = [None] * req.n
        gen = self._generate(request_id, prompt_ids, images, knobs, max_tokens, req.n, req.stops(),
                             req.diffusion.previews and req.stream, k)
        try:
            if req.stream and chat:
                for i in range(req.n):
                    yield _sse(_chunk(rid, created, self.model, chat, i, {"role": "assistant", "content": ""}))
            async for ev in gen:
                if ev[0] == "preview":
                    yield _sse(_chunk(rid, created, self.model, chat, ev[1], {}, extra={"diffusion_preview": ev[2]}))
                elif ev[0] == "block":
                    _, i, delta, lps = ev
                    offset = len(texts[i])
                    texts[i] += delta
                    if lps is not None:
                        entries[i].extend(lps)
                    if req.stream:
                        lp = None if lps is None else _logprobs(tok, lps, k, chat, offset)
                        yield _sse(_chunk(rid, created, self.model, chat, i, {"content": delta}, logprobs=lp))
                elif ev[0] == "finished":
                    _, i, delta, finish[i] = ev
                    texts[i] += delta
                    if req.stream:
                        yield _sse(_chunk(rid, created, self.model, chat, i, {"content": delta} if delta else {},
                                          finish=finish[i]))
                else:
                    usage = {"prompt_tokens": ev[1], "completion_tokens": ev[2], "total_tokens": ev[1] + ev[2]}
        except TandemError as e:
            yield e
            return
        finally:
            await gen.aclose()
        if req.stream:
            if req.include_usage():
                yield _sse({"id": rid, "object": "chat.completion.chunk" if chat else "text_completion",
                            "created": created, "model": self.model, "choices": [], "usage": usage})
            yield DONE
            return
        choices = []
        for i in range(req.n):
            out = {"message": {"role": "assistant", "content": texts[i]}} if chat else {"text": texts[i]}
            lp = None if k is None else _logprobs(tok, entries[i], k, chat, 0)
            choices.append({"index": i, **out, "logprobs": lp, "finish_reason": finish[i]})
        yield {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": created,
               "model": self.model, "choices": choices, "usage": usage}

    # -- the Responses API, tokenize, detokenize ------------------------------------------------
    def responses(self, body: dict, request_id: str) -> AsyncIterator[Item]:
        from diffusion_plugin.responses import serve_responses

        return serve_responses(self, body, request_id)

    async def tokenize(self, body: dict, request_id: str) -> AsyncIterator[Item]:
        """vLLM's /tokenize: ``prompt`` (add_special_tokens, default true) or ``messages`` through
        the model's chat template (add_generation_prompt, default true); return_token_strs."""
        try:
            req = P.parse(P.TokenizeBody, body)
            tok = self.adapter.tokenizer
            if req.messages is not None:
                if req.prompt is not None:
                    raise invalid("give either prompt or messages, not both", param="prompt")
                messages, _ = extract_images(req.messages, self.image_limits)
                try:
                    text = tok.apply_chat_template(messages, add_generation_prompt=req.add_generation_prompt,
                                                   continue_final_message=req.continue_final_message,
                                                   tokenize=False)
                except Exception as e:  # noqa: BLE001 - a malformed message is the client's error
                    raise invalid(f"messages: cannot apply the chat template: {e}", param="messages") from None
                ids = tok(text, add_special_tokens=req.add_special_tokens).input_ids
            elif req.prompt is not None:
                ids = tok(req.prompt, add_special_tokens=req.add_special_tokens).input_ids
            else:
                raise invalid("prompt: field required (or messages)", param="prompt")
        except TandemError as e:
            yield e
            return
        out = {"count": len(ids), "max_model_len": self.adapter.max_position, "tokens": list(ids),
               "token_strs": tok.convert_ids_to_tokens(list(ids)) if req.return_token_strs else None}
        yield out

    async def detokenize(self, body: dict, request_id: str) -> AsyncIterator[Item]:
        """vLLM's /detokenize: ``tokens`` -> ``prompt`` (special tokens kept, so it round-trips)."""
        try:
            req = P.parse(P.DetokenizeBody, body)
            vocab_size = len(self.adapter.tokenizer)
            bad = next((t for t in req.tokens if t >= vocab_size), None)
            if bad is not None:
                raise invalid(f"tokens: token id {bad} is out of vocabulary (size {vocab_size})", param="tokens")
        except TandemError as e:
            yield e
            return
        yield {"prompt": self.adapter.tokenizer.decode(req.tokens, skip_special_tokens=False)}

    async def abort(self, request_id: str) -> bool:
        ids = self._requests.get(request_id, [])
        for seq_id in ids:
            self.loop.abort(seq_id)
        return bool(ids)

    async def check_health(self) -> None:
        if self.loop is None or self.loop.dead is not None:
            raise RuntimeError("the diffusion loop is not running")

    async def stats(self) -> EngineStats:
        if self.loop is None:
            return EngineStats(running=0)
        s = self.loop.scheduler
        st = s.stats
        return EngineStats(running=len(s.running), waiting=len(s.waiting), extra={
            "steps": st.steps, "row_steps": st.row_steps, "row_steps_waiting": st.row_steps_waiting,
            "blocks_committed": st.blocks_committed, "tokens_committed": st.tokens_committed,
            "encode_passes": st.encode_passes, "aborted": st.aborted, "forward_s": self.loop.stats.forward_s,
            "busy_s": self.loop.stats.busy_s, "errors": self.loop.stats.errors,
            "admitted": self.loop.stats.admitted, "admission_wait_sum_s": self.loop.stats.admission_wait_sum_s,
            "block_seconds": self.loop.stats.block_seconds, "active_batch": len(s.running),
            "canvas_occupancy": len(s.running) / s.max_batch, "sampler": self.sampler,
            "memory_budget_bytes": self.memory.budget_bytes, "memory_reserved_bytes": s.reserved_bytes,
            "waiting_for_memory": st.waiting_for_memory, **self.image_stats},
            progress=st.row_steps + st.encode_passes)

    async def shutdown(self) -> None:
        if self.loop is not None:
            await self.loop.stop()


class _Text:
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
        # Hold back a trailing incomplete UTF-8 sequence until the next block completes it.
        safe = len(self.text) if self.stopped else len(self.text.rstrip("\ufffd"))
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

    def flush(self) -> str:
        delta, self.sent = self.text[self.sent:], len(self.text)
        return delta

    def preview(self, canvas_ids: list[int]) -> str:
        return self.tok.decode(canvas_ids, skip_special_tokens=True)


def _finish(seq: Sequence, text: _Text) -> str:
    return "stop" if text.stopped else FINISH_REASON.get(seq.status, "stop")


async def _forward(queue: asyncio.Queue, merged: asyncio.Queue) -> None:
    while True:
        ev = await queue.get()
        merged.put_nowait(ev)
        if ev.kind == "finished":
            return


def _token_str(tok, token_id: int) -> str:
    """A token as logprobs name it: its own text, special tokens included (the text skips them)."""
    return tok.decode([token_id])


def _logprobs(tok, entries: list, k: int, chat: bool, offset: int) -> dict:
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


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def create_engine(cfg, source_path: str) -> DiffusionEngine:
    """The ``diffusion`` (and ``diffusion:diffusiongemma``) entry in ``workers.registry``."""
    return DiffusionEngine(cfg.name, source_path, cfg.engine_args)


__all__ = ["DiffusionEngine", "create_engine"]
