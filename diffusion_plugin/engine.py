"""The diffusion engine: ``tandem_core.protocol.Engine`` over tandem's block-granular batcher.

OpenAI in, OpenAI out: each committed block is an ordinary delta chunk (append-only); with
``"diffusion": {"previews": true}`` preview chunks (empty ``delta`` plus ``diffusion_preview``,
replace semantics) come between them. Routes: ``chat``, ``completions``, ``responses``
(``diffusion_plugin.api.responses``), ``tokenize``, ``detokenize``. Which OpenAI fields are honoured
and which are refused (400 naming the field), the logprobs definition and temperature 0's seed:
``diffusion_plugin.api.params``.

This module is the glue between requests and the loop: every generation route's request is
prepared by ``diffusion_plugin.api.prepare`` (body -> a typed ``Prepared``: the route's body model,
its ``SeqRequest``, structured output and parsers), its sequences are submitted to the
``DiffusionLoop`` with one queue for all of them, ``generate`` turns the loop's events into
choice events, and ``diffusion_plugin.api.chunks`` (or ``.responses``) builds the answer.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from contextlib import aclosing, asynccontextmanager
from dataclasses import asdict
from typing import Any

from diffusion_plugin.api.chunks import ChoiceText, Delta, End, Entry, Event, Preview, Prompt, Usage, openai_items
from diffusion_plugin.api.decisions import serve as serve_decisions
from diffusion_plugin.api.intake import Intake, SeqRequest
from diffusion_plugin.api.parsing import Parsers
from diffusion_plugin.api.prepare import Preparer
from diffusion_plugin.api.structured import warm_structured
from diffusion_plugin.api.token_text import TextOffsets, token_string
from diffusion_plugin.batcher.loop import DiffusionLoop, EventKind
from diffusion_plugin.batcher.memory import GIB, PAGE_TOKENS, MemoryBudget, chunk_rows, host_available_bytes
from diffusion_plugin.batcher.memory import plan as memory_plan
from diffusion_plugin.batcher.request import SeqStatus
from diffusion_plugin.batcher.scheduler import Scheduler
from diffusion_plugin.batcher.spans import SeqSpans
from diffusion_plugin.batcher.vllm_names import RequestHistograms, vllm_exposition
from diffusion_plugin.engine_args import DiffusionEngineArgs
from tandem_core import tracing
from tandem_core.errors import ErrorKind, TandemError
from tandem_core.protocol import EngineInfo, EngineStats, Item

logger = logging.getLogger(__name__)


class DiffusionEngine:
    def __init__(self, model: str, source: str, engine_args: dict[str, Any] | DiffusionEngineArgs):
        """``engine_args``: ``DiffusionEngineArgs`` or its fields (a ValueError names a bad one;
        a config's were checked when it loaded)."""
        if not isinstance(engine_args, DiffusionEngineArgs):
            engine_args = _validated(engine_args)
        self.args = engine_args
        self.model = model
        self.source = source
        self.max_batch = engine_args.max_batch
        self.row_boundaries = engine_args.row_boundaries
        self.sampler = engine_args.sampler
        self.device = engine_args.device
        self.memory_budget_gib = engine_args.memory_budget_gib
        self.image_limits = engine_args.image_limits()
        self.adapter = None
        self.memory: MemoryBudget | None = None
        self.loop: DiffusionLoop | None = None
        self._kv_cache_tokens: int | None = None  # the prefix cache's capacity, known once started
        self.intake: Intake | None = None
        self._requests: dict[str, list[str]] = {}
        self.preparer: Preparer | None = None  # every generation route's way in, once started

    async def start(self) -> EngineInfo:
        from diffusion_plugin.families import load_adapter
        from diffusion_plugin.step.runner import Runner

        adapter = await asyncio.to_thread(load_adapter, self.args.family, self.source, self.args.load_dtype,
                                          device=self.device, num_threads=self.args.num_threads)
        self.adapter = adapter
        memory = self._budget()
        # The fast mode's KV pool is sized for the budget the scheduler admits against (on a
        # device: its planned pages per layer group).
        runner = Runner(adapter, self.sampler, chunk_rows=self._chunk_rows(), kv_budget_bytes=memory.budget_bytes,
                        kv_groups=memory.groups, prefix_cache=self.args.prefix_cache,
                        compiled_vocab=self.args.use_compiled_vocab, compiled_trunk=self.args.use_compiled_trunk,
                        cuda_graphs=self.args.cuda_graphs)
        # vLLM's request models and xgrammar (structured outputs) take seconds to import: at
        # start, not in the first constrained request's time.
        await asyncio.to_thread(warm_structured)
        await asyncio.to_thread(runner.warm)  # (compiled_vocab: its kernel)
        compiled = " (compiled vocabulary pass)" if self.args.use_compiled_vocab else ""
        if self.args.use_compiled_trunk:
            compiled += " (compiled trunk, CUDA graphs)" if self.args.cuda_graphs else " (compiled trunk)"
        logger.info("%s: diffusion engine on %s, dtype %s, sampler %s%s, boundaries %s, max_batch %d; memory budget "
                    "%.2f GiB (KV page pool %.2f GiB%s); one device per replica (no tensor or pipeline parallelism)",
                    self.model, self.device, str(adapter.dtype).removeprefix("torch."), self.sampler, compiled,
                    self.args.boundaries, self.max_batch, memory.budget_bytes / GIB, memory.pool_bytes / GIB,
                    "" if memory.groups else ": committed as written")
        return self.start_with(adapter, runner, memory)

    def start_with(self, adapter, runner, memory: MemoryBudget | None) -> EngineInfo:
        """Serve on a loaded model adapter and a runner (``start``'s, or test doubles: a runner
        is ``execute(StepBatch, seqs) -> StepOutput``, ``free(seq_id)``, ``reset()``). Called in
        the event loop; ``memory`` None: no budget."""
        self.adapter, self.memory = adapter, memory
        scheduler = Scheduler(self.max_batch, adapter.canvas_length, self.row_boundaries, memory=memory)
        self.intake = Intake(self.model, adapter, self.image_limits, scheduler, memory)
        # vLLM's parsers for tool_choice "auto" and reasoning: a name vLLM does not know fails here.
        self.preparer = Preparer(adapter, self.intake, Parsers(adapter.tokenizer, self.args.tool_call_parser,
                                                               self.args.reasoning_parser))
        self.loop = DiffusionLoop(scheduler, runner, RequestHistograms(adapter.max_position), _spans(runner))
        self.loop.start()
        extra = {"canvas_length": adapter.canvas_length, "max_batch": self.max_batch,
                 "boundaries": "row" if self.row_boundaries else "block"}
        if getattr(runner, "prefix_cache", False):  # the prefix cache's capacity, as a vLLM replica reports it
            pages = runner.kv_pages()
            extra["kv_cache_tokens"] = (min(pages) if isinstance(pages, list) else pages) * PAGE_TOKENS - PAGE_TOKENS
        self._kv_cache_tokens = extra.get("kv_cache_tokens")
        return EngineInfo(model=self.model, kind="diffusion", max_model_len=adapter.max_position, extra=extra)

    def _chunk_rows(self) -> int:
        return chunk_rows(self.sampler, str(self.device))

    def _budget(self) -> MemoryBudget:
        """``memory.plan`` for this engine: its budget (``memory_budget_gib``, else from the memory
        free once the weights are loaded: the device's, or the host's MemAvailable)."""
        free = None
        if self.memory_budget_gib is None and self._device_pool():
            import torch

            from diffusion_plugin.step.kv_view import free_bytes

            free = free_bytes(torch.device(self.device))
        elif self.memory_budget_gib is None:
            free = host_available_bytes()
        return self._plan(self.adapter.memory_shape(), free_bytes=free,
                          budget_bytes=None if self.memory_budget_gib is None else int(self.memory_budget_gib * GIB))

    def _device_pool(self) -> bool:
        return str(self.device).startswith("cuda")

    def budget_for(self, shape, budget_bytes: int) -> MemoryBudget:
        """The budget the scheduler admits against, for ``budget_bytes`` (``memory.plan``)."""
        return self._plan(shape, budget_bytes=budget_bytes)

    def _plan(self, shape, free_bytes: int | None = None, budget_bytes: int | None = None) -> MemoryBudget:
        return memory_plan(shape, self.sampler, chunk_rows=self._chunk_rows(), free_bytes=free_bytes,
                           budget_bytes=budget_bytes, device_pool=self._device_pool(), max_batch=self.max_batch,
                           kv_fraction=self.args.kv_cache_fraction)

    # -- requests -------------------------------------------------------------------------
    def chat(self, body: dict, request_id: str) -> AsyncIterator[Item]:
        return self._serve(body, request_id, chat=True)

    def completions(self, body: dict, request_id: str) -> AsyncIterator[Item]:
        return self._serve(body, request_id, chat=False)

    async def _serve(self, body: dict, request_id: str, chat: bool) -> AsyncIterator[Item]:
        try:
            p = await self.preparer.prepare(body, "chat" if chat else "completions")
        except TandemError as e:
            yield e
            return
        req, sreq = p.body, p.request
        items = openai_items(self.generate(request_id, sreq), chat=chat, request_id=request_id, model=self.model,
                             tokenizer=self.adapter.tokenizer, n=sreq.choices, stream=req.stream,
                             include_usage=req.include_usage(), top_logprobs=sreq.params.logprobs,
                             structured=p.structured,
                             parsing=p.parsing,
                             continuous_usage=sum(map(len, sreq.prompt.prompts)) if req.continuous_usage() else None)
        async with aclosing(items):
            async for item in items:
                yield item

    async def generate(self, request_id: str, sreq: SeqRequest) -> AsyncGenerator[Event, None]:
        """The request's sequences run: yields ``Preview``, ``Delta`` and ``End`` per choice, then
        ``Usage``. A sequence whose batch failed raises ``TandemError`` (engine error). Closed
        early (the client left), it aborts whatever of its sequences still runs."""
        seqs = sreq.sequences(request_id)
        prompt, output = sreq.prompt, sreq.output
        index = {s.seq_id: i for i, s in enumerate(seqs)}
        texts = [ChoiceText(self.adapter.tokenizer, list(output.stops), raw=output.raw_text,
                            min_tokens=sreq.params.min_tokens, include_stop=output.include_stop,
                            keep_special=output.keep_special) for _ in seqs]
        prompts = [prompt.prompts[i // output.n] if (output.echo or output.prompt_logprobs) else None
                   for i in range(len(seqs))]
        shift = [0] * len(seqs)  # echo: the prompt's text comes first, so the output's offsets move by it
        async with self.submitted(request_id, seqs) as queue:
            left = len(seqs)
            while left:
                ev = await queue.get()
                i = index[ev.seq.seq_id]
                text = texts[i]
                if prompts[i] is not None and ev.kind is not EventKind.PREVIEW and ev.seq.status not in (
                        SeqStatus.FINISHED_ERROR, SeqStatus.FINISHED_ABORTED):  # scored by now
                    first = prompt_event(self.adapter.tokenizer, i, prompts[i], ev.seq, sreq)
                    prompts[i], shift[i] = None, len(first.text)
                    yield first
                if ev.kind is EventKind.PREVIEW:
                    if sreq.params.previews:
                        yield Preview(i, {"block": ev.seq.block, "step": ev.step,
                                          "max_steps": ev.seq.params.max_denoising_steps,
                                          "text": text.preview(ev.new_ids)})
                elif ev.kind is EventKind.BLOCK:
                    out = text.add(ev.new_ids, ev.logprobs)
                    if out.stopped:
                        self.loop.abort(ev.seq.seq_id, SeqStatus.FINISHED_STOPPED)
                    if out.text or out.entries or out.ids:
                        yield Delta(i, out.text, _shifted(out.entries, shift[i]), out.ids, text.num_tokens)
                else:
                    left -= 1
                    if ev.seq.status is SeqStatus.FINISHED_ERROR:
                        raise TandemError(ErrorKind.ENGINE_ERROR, f"the diffusion batch failed: {ev.seq.error}")
                    rest = text.flush()
                    yield End(i, rest.text, text.finish_reason(ev.seq.status),
                              _shifted(rest.entries, shift[i]) if sreq.params.logprobs is not None else None, rest.ids,
                              text.num_tokens, text.stop_string)
            cached = None
            if getattr(self.loop.runner, "prefix_cache", False):  # each prompt's, once (its choices share it)
                cached = sum(max(s.cached_tokens for s in seqs[p * output.n:(p + 1) * output.n])
                             for p in range(len(prompt.prompts)))
            yield Usage(sum(map(len, prompt.prompts)), sum(t.num_tokens for t in texts), cached)  # each prompt once

    @asynccontextmanager
    async def submitted(self, request_id: str, seqs: list) -> AsyncIterator[asyncio.Queue]:
        """The loop runs ``seqs`` for ``request_id`` (``abort(request_id)`` reaches them) and the
        context gives their event queue; on exit, whatever of them still runs is aborted."""
        ids = self._requests.setdefault(request_id, [])
        ids.extend(s.seq_id for s in seqs)
        try:
            yield self.loop.submit(*seqs)
        finally:
            for s in seqs:
                if not s.status.finished:
                    self.loop.abort(s.seq_id)
                ids.remove(s.seq_id)
            if not ids:
                self._requests.pop(request_id, None)

    # -- the Responses and Messages APIs, tokenize, detokenize ------------------------------------------------
    def responses(self, body: dict, request_id: str) -> AsyncIterator[Item]:
        from diffusion_plugin.api.responses import serve_responses

        return serve_responses(self, body, request_id)

    def messages(self, body: dict, request_id: str) -> AsyncIterator[Item]:
        """Anthropic's Messages API: vLLM's conversions around ``chat`` (``api/messages.py``)."""
        from diffusion_plugin.api.messages import serve_messages

        return serve_messages(self, body, request_id)

    async def messages_count_tokens(self, body: dict, request_id: str) -> AsyncIterator[Item]:
        from diffusion_plugin.api.messages import count_tokens

        try:
            out = await count_tokens(self, body)
        except TandemError as e:
            out = e
        yield out

    def decisions(self, body: dict, request_id: str) -> AsyncIterator[Item]:
        return serve_decisions(self, body, request_id, "decisions")

    def systemone(self, body: dict, request_id: str) -> AsyncIterator[Item]:
        return serve_decisions(self, body, request_id, "systemone")

    def tokenize(self, body: dict, request_id: str) -> AsyncIterator[Item]:
        return _answered(self.intake.tokenize, body)

    def detokenize(self, body: dict, request_id: str) -> AsyncIterator[Item]:
        return _answered(self.intake.detokenize, body)

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
        s, mem = self.loop.scheduler, self.memory
        st = s.stats
        ls = self.loop.stats
        reserved = s.reserved_bytes + (mem.pages_bytes(s.pages_reserved) if mem else 0)
        usage = reserved / mem.budget_bytes if mem and mem.budget_bytes else 0.0
        return EngineStats(running=len(s.running), waiting=len(s.waiting), extra={
            **asdict(st), **asdict(ls), "active_batch": len(s.running),
            "canvas_occupancy": len(s.running) / s.max_batch, "sampler": self.sampler,
            "memory_budget_bytes": self.memory.budget_bytes if self.memory else None,
            "memory_reserved_bytes": reserved,
            "kv_pool_bytes": mem.pool_bytes if mem else 0,  # a device's page pool (planned): part of the budget
            "kv_pages_reserved": list(s.pages_reserved),  # per layer group (full first), one layer's pages
            "kv_pages_capacity": [g.pages for g in mem.groups] if mem else [],
            **self.intake.image_stats, **self._prefix_stats(),
            "kv_cache_tokens": self._kv_cache_tokens,  # as a vLLM replica's stats say it
            "exposition": vllm_exposition(self.model, len(s.running), len(s.waiting), st.prompt_tokens,
                                          st.tokens_committed, self._prefix_stats(), usage)
            + self.loop.requests.exposition(self.model)},
            progress=st.row_steps + st.encode_passes)

    async def reset_prefix_cache(self) -> bool:
        if self.loop is None:
            return True
        return await self.loop.reset_prefix_cache()

    def _prefix_stats(self) -> dict:
        runner = self.loop.runner
        return runner.prefix_stats() if getattr(runner, "prefix_cache", False) else {}

    async def shutdown(self) -> None:
        if self.loop is not None:
            await self.loop.stop()


def _spans(runner) -> SeqSpans | None:
    tracer = tracing.tracer()
    if tracer is None:
        return None

    def grammar_seconds(seq_id: str) -> float:
        return getattr(getattr(runner.rows.get(seq_id), "grammar", None), "seconds", 0.0)

    return SeqSpans(tracer, grammar_seconds)


def prompt_event(tok, index: int, ids: list[int], seq, sreq: SeqRequest) -> Prompt:
    """A choice's prompt (echo, prompt_logprobs), from its sequence's scores (``Sequence.scores``:
    every prompt token but the first, which has none, as on vLLM)."""
    scored = sreq.prompt.score_k is not None
    if scored and len(seq.scores) != len(ids) - 1:
        raise TandemError(ErrorKind.ENGINE_ERROR, f"bug: {len(seq.scores)} scores for a {len(ids)}-token prompt")
    text = tok.decode(ids, skip_special_tokens=True) if sreq.output.echo else ""
    entries = None
    if sreq.output.echo and scored and sreq.params.logprobs is not None:
        offsets = TextOffsets(tok)
        entries = [Entry(ids[0], None, None, offsets.push(ids[0]))]
        entries += [Entry(t, sc.logprob, sc.top, offsets.push(t)) for t, sc in zip(ids[1:], seq.scores, strict=True)]
    plp = None
    if sreq.output.prompt_logprobs:
        k = sreq.prompt.score_k
        plp = [None] + [{str(t): {"logprob": sc.logprob, "rank": sc.rank, "decoded_token": token_string(tok, t)},
                         **{str(i): {"logprob": v, "rank": r, "decoded_token": token_string(tok, i)}
                            for r, (i, v) in enumerate(sc.top[:k], 1) if i != t}}
                        for t, sc in zip(ids[1:], seq.scores, strict=True)]
    return Prompt(index, text, entries, plp)


def _shifted(entries: list | None, by: int) -> list | None:
    return entries if not by or not entries else [e._replace(offset=e.offset + by) for e in entries]


def _validated(engine_args: dict[str, Any]) -> DiffusionEngineArgs:
    from pydantic import ValidationError

    try:
        return DiffusionEngineArgs.model_validate(engine_args)
    except ValidationError as e:
        first = e.errors()[0]
        loc = ".".join(str(p) for p in first["loc"])
        raise ValueError(f"engine_args.{loc}: {first['msg']}") from None


def create_engine(cfg, source_path: str) -> DiffusionEngine:
    """The ``diffusion`` (and ``diffusion:diffusiongemma``) entry in ``workers.registry``."""
    return DiffusionEngine(cfg.name, source_path, cfg.engine_args)


__all__ = ["DiffusionEngine", "create_engine"]


async def _answered(answer: Callable[[dict], dict], body: dict) -> AsyncIterator[Item]:
    """One item: ``answer(body)``, or the TandemError it raised (routes the batcher never sees)."""
    try:
        out = answer(body)
    except TandemError as e:
        out = e
    yield out
