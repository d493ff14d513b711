"""The runner: per-sequence tensors and the execution of one ``StepBatch``.

Per sequence: its own KV cache (prompt + committed blocks), canvas, self-conditioning soft
embedding (canvas x hidden: nothing vocab-sized is held between steps), stability history,
random generator (exact mode), freed when it leaves. Exact mode: HF's ``DynamicCache`` per
sequence. Fast mode: the sequence's pages in one pool per layer (``kv_view``), sized once from
the memory budget, written by the encoder and read in place by the decoder; a sequence joining
or leaving copies nobody's K/V.
Per step:
1. the encoder passes (prefills and commits, each row with its own mask into its cache): one
   batched pass in fast mode, row by row in exact mode;
2. the decoder trunk over every row being denoised -> hidden states (fast: ONE batched forward,
   one attention call per layer reading the pool in place, the experts as two grouped GEMMs
   per MoE layer for all rows; exact: row by row, see ``_trunk``);
3. the vocab-wide head and sampler over ``chunk_rows`` rows at a time (``diffusiongemma_vocab``),
   so its transient peak does not grow with the batch; random draws just in time;
4. entropy-bound acceptance for all rows at once, and ONE host transfer of every row's
   decisions (argmax canvas, confidence).

``sampler="exact"`` reproduces ``generate()`` run alone bit for bit (per-row encoder, trunk and
vocab work with HF's shapes and HF's experts: exact mode only). ``sampler="fast"``: one
attention call per layer, grouped experts, fused vocab work, hash-based draws; batch-invariant,
not equal to HF.
"""

from __future__ import annotations

import time
from dataclasses import replace

import torch

from diffusion_plugin import gemm, memory
from diffusion_plugin.attention import FAST
from diffusion_plugin.batch import Pins, RowOutput, StepBatch, StepOutput
from diffusion_plugin.draws import hash_draws, hash_uniform
from diffusion_plugin.family import Family
from diffusion_plugin.kv_view import FastViews, KVPool, free_bytes, release
from diffusion_plugin.memory import PAGE_TOKENS
from diffusion_plugin.prefix_cache import chunks, page_keys
from diffusion_plugin.request import SCORE_SEED, Sequence
from diffusion_plugin.rows import Row, by_length

SAMPLERS = ("exact", "fast")
# Streams of the fast mode's hash draws (_GRAMMAR: a constrained row's redraws, ``grammar``).
_INIT, _SAMPLE, _RENOISE, _GRAMMAR = 1, 2, 3, 4


class Runner:
    def __init__(self, adapter: Family, sampler: str = "exact", chunk_rows: int = 1, kv_budget_bytes: int | None = None,
                 kv_groups: tuple[memory.KVGroup, ...] = (), prefix_cache: bool = False,
                 rowwise: bool = False, compiled_vocab: bool = False):
        """Fast mode's KV pool, one ``torch.empty`` per layer: ``kv_groups`` (``memory.plan_pool``,
        the plan the scheduler admits against: a device) gives its pages per layer group.
        Otherwise ``kv_budget_bytes``, the memory budget, sizes it (default: the budget the engine
        derives by default from the memory free now): on the host (``memory.pool_pages``,
        lazy: only the pages written take memory, and whatever the budget admits fits), or an
        equal count per layer within the budget on a device without a plan (tests)."""
        if sampler not in SAMPLERS:
            raise ValueError(f"sampler must be one of {SAMPLERS}")
        self.adapter = adapter
        self.sampler = sampler
        self.chunk_rows = max(1, int(chunk_rows)) if sampler == "fast" else 1  # exact: HF's (1, C, V)
        self.kv_budget_bytes = kv_budget_bytes
        self.kv_groups = tuple(kv_groups)
        self.pool: KVPool | None = None  # fast mode: made at the first admission
        self.rows: dict[str, Row] = {}
        # Fast mode only (``prefix_cache``): prompts encoded in page-aligned chunks, their whole
        # pages kept for reuse in the pool. Exact mode encodes a prompt in one pass, as generate().
        self.prefix_cache = prefix_cache and sampler == "fast"
        self.cached: dict[str, int] = {}  # this step's admitted sequences: prompt tokens found cached
        self.prefix_queries = self.prefix_hits = 0  # since start (a pool reset keeps them: counters)
        self._views = FastViews()  # fast mode only
        self.rowwise = bool(rowwise)  # each row alone through the fast passes (slower; measurements)
        self._row_views: dict[str, FastViews] = {}
        self._scratch = adapter.vocab_scratch(compiled_vocab and sampler == "fast")  # fast mode's, reused

    def admit(self, seq: Sequence) -> None:
        gen = torch.Generator(device=self.adapter.device).manual_seed(seq.params.seed)
        pending = torch.tensor([seq.prompt_ids], dtype=torch.long, device=self.adapter.device)
        cache = self.adapter.new_cache(self._kv_pool() if self.sampler == "fast" else None)
        grammar = None
        if seq.grammar is not None:
            from diffusion_plugin.grammar import RowGrammar

            grammar = RowGrammar(seq.grammar, self.adapter.vocab_size, seq.params.eos_token_ids or
                                 self.adapter.eos_token_ids, self.adapter.canvas_length)
        row = self.rows[seq.seq_id] = Row(seq=seq, cache=cache, generator=gen, pending=pending,
                                           images=seq.images, grammar=grammar)
        if self.prefix_cache and seq.images is None and not seq.score_ids:  # (images, scoring: not yet)
            self._adopt(row)

    def _adopt(self, row: Row) -> None:
        """A new sequence starts from the cached pages of its prompt's longest cached prefix (at
        least one token is left to encode)."""
        pool, prompt = self.pool, row.seq.prompt_ids
        row.keys = page_keys(prompt, row.seq.cache_salt)
        layers = row.cache.layers
        keys = row.keys[:(len(prompt) - 1) // PAGE_TOKENS]
        j = pool.cache.lookup(keys, lambda layer, n: layers[layer].needed_pages(n * PAGE_TOKENS))
        self.prefix_queries += len(prompt)  # (vLLM's prefix-cache counters: prompt tokens queried and found)
        self.prefix_hits += j * PAGE_TOKENS
        if j:
            for i, layer in enumerate(layers):
                need = layer.needed_pages(j * PAGE_TOKENS)
                layer.adopt([pool.cache.page(keys[k], i) for k in need], need.start, j * PAGE_TOKENS)
            row.pending = row.pending[:, j * PAGE_TOKENS:]
            row.cur_len = j * PAGE_TOKENS
        self.cached[row.seq.seq_id] = j * PAGE_TOKENS

    def _register(self, row: Row, page: int) -> None:
        """The prompt's whole page ``page`` is written: each layer that holds it keeps it for reuse."""
        for i, layer in enumerate(row.cache.layers):
            physical = layer.page_at(page)
            if physical is not None:
                self.pool.cache.register(row.keys[page], i, physical)

    def free(self, seq_id: str) -> None:
        row = self.rows.pop(seq_id, None)
        if row is not None and self.pool is not None:
            release(row.cache)  # its pages back to the pool

    def reset(self) -> None:
        """After a failed batch: drop every sequence's state (and the pool: a failure may have
        left a row's pages half written)."""
        self.rows.clear()
        self._views.reset()
        self.pool = None  # (and the prefix cache with it)

    def _kv_pool(self) -> KVPool:
        if self.pool is None:
            self.pool = KVPool(self.adapter.kv_layout(), self.kv_pages(), self.adapter.dtype, self.adapter.device)
        return self.pool

    def kv_pages(self) -> int | list[int]:
        """The fast mode's pool size: pages per layer (with the null page), or one count for all."""
        shape = self.adapter.memory_shape()
        if self.kv_groups:
            return [max(2, n) for n in memory.layer_pages(shape, self.kv_groups)]
        budget = self.kv_budget_bytes
        if budget is None:  # as the engine decides it (``memory.plan``) from the memory free now
            budget = memory.plan(shape, self.sampler, chunk_rows=self.chunk_rows,
                                 free_bytes=free_bytes(self.adapter.device)).budget_bytes
        return max(2, memory.pool_pages(shape, budget, lazy=self.adapter.device.type == "cpu"))

    def prefix_stats(self) -> dict:
        """The prefix cache's counters and what it holds now (fast mode with ``prefix_cache``)."""
        pool = self.pool
        return {"prefix_cache_queries": self.prefix_queries, "prefix_cache_hits": self.prefix_hits,
                "kv_cached_pages": pool.cache.cached_pages() if pool is not None else 0,
                "prefix_cache_evictions": pool.cache.evictions if pool is not None else 0}

    def reset_prefix_cache(self) -> bool:
        """Every cached page no sequence holds, freed; False while running sequences still hold
        cached pages (those stay findable until they finish: vLLM's answer, retry later)."""
        if self.pool is None:
            return True
        self.pool.reset_cache()
        return not any(self.pool.cache.key_of)  # what is still registered is held by a sequence

    def warm(self) -> None:
        """Compiles what fast mode compiles (``compiled_vocab``) now, not in a request's step."""
        self.adapter.warm_vocab(self._scratch)

    def held_bytes(self) -> int:
        """Bytes held by sequences between steps beyond their KV caches (for measurements)."""
        total = 0
        for r in self.rows.values():
            for t in (r.canvas, r.soft, r.argmax, r.pending):
                if t is not None:
                    total += t.numel() * t.element_size()
        return total

    @torch.no_grad()
    def execute(self, batch: StepBatch, seqs: dict[str, Sequence]) -> StepOutput:
        t0 = time.perf_counter()
        for seq_id in batch.free:
            self.free(seq_id)
        self.cached = {}
        for seq_id in batch.admit:
            self.admit(seqs[seq_id])
        forward_s = 0.0
        # 1. Encoder passes (prefills and commits), then each row draws its new canvas.
        encoding = [self.rows[s] for s in batch.encode]
        if encoding:
            t = time.perf_counter()
            # Exact mode encodes row by row (as generate() alone). Fast mode batches the rows whose
            # pending tokens are a whole canvas (commits); any other pass (a prefill, a short score
            # block) runs alone. Batching rows changes the GEMMs' row count, and for a few rows of
            # a few tokens the CPU BLAS takes another kernel: two 4-token prefills batched moved a
            # row's K/V by ~1e-6 and flipped its samples (left-padding to a batch mate's length did
            # the same). Whole-canvas commits batched are row-invariant (tested).
            C = self.adapter.canvas_length
            chunked = [r for r in encoding if r.keys is not None and r.prefill]
            rest = [r for r in encoding if r.keys is None or not r.prefill]
            groups = ([[r] for r in rest] if self.sampler == "exact" or self.rowwise else
                      by_length([r for r in rest if r.pending.shape[1] == C]) +
                      [[r] for r in rest if r.pending.shape[1] != C])
            for row in chunked:  # the prompt in page-aligned chunks, each whole page kept
                for a, b in chunks(row.cur_len, row.cur_len + row.pending.shape[1]):
                    with self.adapter.fast_experts(self.sampler == "fast"):
                        self.adapter.encode([row.cache], [row.pending[:, a - row.cur_len:b - row.cur_len]], [a])
                    if b % PAGE_TOKENS == 0:
                        self._register(row, b // PAGE_TOKENS - 1)
            for group in groups:
                images = [r.images for r in group]
                canvas = C if self.sampler == "fast" and group[0].pending.shape[1] == C else 0
                with self.adapter.fast_experts(self.sampler == "fast"), gemm.rows(canvas):
                    self.adapter.encode([r.cache for r in group], [r.pending for r in group],
                                        [r.cur_len for r in group],
                                        images if any(i is not None for i in images) else None)
            forward_s += time.perf_counter() - t
        for row in encoding:
            row.prefill = False
            row.images = row.seq.images = None  # in the cache now: the features are freed
            row.cur_len += row.pending.shape[1]
            row.version += 1
            row.pending = None
            self._plan(row)
            row.canvas = self._init_canvas(row)
            row.soft, row.history = None, None
        out = StepOutput()
        if batch.denoise:
            rows = [self.rows[s] for s in batch.denoise]
            t = time.perf_counter()
            hidden = self._trunk(rows)
            forward_s += time.perf_counter() - t
            out.rows = self._sample(rows, hidden)
        out.forward_s = forward_s
        out.cached = self.cached
        out.step_s = time.perf_counter() - t0
        return out

    # -- 2. the trunk -----------------------------------------------------------------------
    def _trunk(self, rows: list[Row]) -> torch.Tensor:
        C = self.adapter.canvas_length
        canvas = torch.cat([r.canvas for r in rows])
        positions = torch.stack([torch.arange(r.cur_len, r.cur_len + C, dtype=torch.int32, device=canvas.device)
                                 for r in rows])  # on the canvas's device, as HF
        soft = self._soft(rows)
        if self.sampler == "exact":
            # Exact mode only: each row alone through the decoder over its own cache, exactly
            # generate()'s call. Batched GEMMs are not row-invariant on every BLAS (on this box
            # a batched trunk or encoder pass moved logits by ~1e-6 and flipped samples), and
            # at the real shape the trunk is a small share of a step.
            return torch.cat([self.adapter.decode_hidden(canvas[b:b + 1], r.cache, positions[b:b + 1],
                                                         None if soft is None else soft[b:b + 1])
                              for b, r in enumerate(rows)])
        if self.rowwise:
            for gone in set(self._row_views) - set(self.rows):
                del self._row_views[gone]
            return torch.cat([self._fast_trunk(
                self._row_views.setdefault(r.seq.seq_id, FastViews()), [r], canvas[b:b + 1], positions[b:b + 1],
                None if soft is None else soft[b:b + 1]) for b, r in enumerate(rows)])
        return self._fast_trunk(self._views, rows, canvas, positions, soft)

    def _fast_trunk(self, views: FastViews, rows: list[Row], canvas, positions, soft) -> torch.Tensor:
        view, spec = views.get([r.seq.seq_id for r in rows], [r.version for r in rows], [r.cache for r in rows])
        token = FAST.set(spec)
        try:
            fast = self.sampler == "fast"
            with self.adapter.fast_experts(fast), gemm.rows(self.adapter.canvas_length if fast else 0):
                return self.adapter.decode_hidden(canvas, view, positions, soft)
        finally:
            FAST.reset(token)

    def _soft(self, rows: list[Row]) -> torch.Tensor | None:
        if all(r.soft is None for r in rows):
            return None  # the decoder's own zeros
        like = next(r.soft for r in rows if r.soft is not None)
        return torch.cat([r.soft if r.soft is not None else torch.zeros_like(like) for r in rows])

    # -- 3./4. the vocab-wide head, the sampler, the decisions ------------------------------
    def _sample(self, rows: list[Row], hidden: torch.Tensor) -> list[RowOutput]:
        steps_left = [r.bp.max_denoising_steps - r.seq.step for r in rows]
        if self.sampler == "fast":
            sampled, argmax, entropy, renoise, soft, tops, scores = self._fast(rows, hidden, steps_left)
        else:
            sampled, argmax, entropy, renoise, soft, tops, scores = self._exact(rows, hidden, steps_left)
        for b, r in enumerate(rows):  # pinned positions hold their tokens, with certainty
            if r.pins is not None:
                pos = torch.tensor(r.pins.positions, dtype=torch.long, device=argmax.device)
                tok = torch.tensor(r.pins.tokens, dtype=argmax.dtype, device=argmax.device)
                argmax[b, pos] = tok
                sampled[b, pos] = tok.to(sampled.dtype)
                entropy[b, pos] = 0.0
        canvas = torch.cat([r.canvas for r in rows])
        bounds = torch.tensor([r.bp.entropy_bound for r in rows], dtype=entropy.dtype,
                              device=entropy.device).unsqueeze(-1)
        # Entropy-bound acceptance (HF's expressions), all rows at once: sorts and cumsums are per row.
        sorted_entropy, sorted_idx = torch.sort(entropy, dim=-1, descending=False)
        selection = torch.cumsum(sorted_entropy, dim=-1) - sorted_entropy <= bounds
        accepted = torch.scatter(input=torch.zeros_like(selection), dim=-1, index=sorted_idx, src=selection)
        new_canvas = torch.where(~accepted, renoise, torch.where(accepted, sampled, canvas))
        # Compared as HF does: a float32 mean against the threshold as a float32 scalar.
        thresholds = torch.tensor([r.bp.confidence_threshold for r in rows], dtype=entropy.dtype,
                                  device=entropy.device)
        confident = entropy.mean(-1) < thresholds
        decisions = torch.cat([argmax, confident[:, None].to(argmax.dtype)], dim=1).tolist()  # one host transfer
        outputs = []
        for b, row in enumerate(rows):
            p = row.bp
            row.canvas, row.argmax, row.soft = new_canvas[b:b + 1], argmax[b:b + 1], soft[b:b + 1]
            tokens, confident_b = decisions[b][:-1], bool(decisions[b][-1])
            stable = row.stable(tokens, p.stability_threshold)
            done = (stable and confident_b) or steps_left[b] <= 1
            if done:  # the commit pass encodes the argmax canvas (a partial score block: its tokens)
                row.pending = row.argmax if row.plan.width is None else row.argmax[:, :row.plan.width]
            if row.constrained is not None:
                row.grammar.settle(committed=done)  # the committed tokens are this step's argmax canvas
            logprobs = None
            if done and tops[b] is not None:  # one host transfer, for the rows that asked, at their commit
                values, ids = (t.tolist() for t in tops[b])
                # (a grammar's refused tokens are -inf in exact mode: not candidates, left out)
                logprobs = [(v[0], [(t, x) for t, x in zip(i, v, strict=True) if x != float("-inf")])
                            for v, i in zip(values, ids, strict=True)]
                for j, sc in zip(row.pins.positions if row.pins else (), scores[b] or (), strict=True):
                    logprobs[j] = (sc.logprob, logprobs[j][1])  # a pinned token: its own logprob
            outputs.append(RowOutput(seq_id=row.seq.seq_id, block_done=done, committed=tokens if done else None,
                                     preview=tokens if p.previews else None, logprobs=logprobs,
                                     scores=scores[b] if done and row.plan.scoring else None))
        return outputs

    def _exact(self, rows, hidden, steps_left):
        """Per row, HF's shapes and ops, each row's draws from its own generator in HF's order
        (multinomial noise, then renoise). Exact mode only: bit-exactness needs (1, C, V)."""
        parts = [self.adapter.vocab_exact(hidden[b:b + 1], r.bp, steps_left[b], r.generator, len(r.seq.output_ids),
                                          r.pins, None if r.constrained is None else r.grammar)
                 for b, r in enumerate(rows)]
        return (*(torch.cat(xs) for xs in zip(*(x[:5] for x in parts), strict=True)), [x[5] for x in parts],
                [x[6] for x in parts])

    def _fast(self, rows, hidden, steps_left):
        seeds, counters = self._counters(rows)
        V = self.adapter.vocab_size
        inv_t = torch.tensor([1.0 / _temperature(r.bp, s) for r, s in zip(rows, steps_left, strict=True)],
                             dtype=torch.float32, device=hidden.device)
        C = self.adapter.canvas_length
        uniform = hash_uniform(seeds, counters, C, _SAMPLE)
        renoise = hash_draws(seeds, counters, C, _RENOISE) % V
        k = self.chunk_rows
        ks = [r.bp.logprobs for r in rows]
        grammars = [r.constrained for r in rows]
        filtered = [(r.bp, len(r.seq.output_ids)) if r.bp.filtered(len(r.seq.output_ids)) else None for r in rows]
        pins = [r.pins for r in rows]
        uniform2 = hash_uniform(seeds, counters, C, _GRAMMAR) if any(g is not None for g in grammars) else None
        parts = [self.adapter.vocab_fast(hidden[i:i + k], inv_t[i:i + k], uniform[i:i + k], self._scratch,
                                         ks[i:i + k] if any(x is not None for x in ks[i:i + k]) else None,
                                         grammars[i:i + k] if any(g is not None for g in grammars[i:i + k]) else None,
                                         None if uniform2 is None else uniform2[i:i + k], filtered[i:i + k],
                                         pins[i:i + k])
                 for i in range(0, len(rows), k)]
        sampled, argmax, entropy, soft = (torch.cat(xs) for xs in zip(*(x[:4] for x in parts), strict=True))
        return (sampled, argmax, entropy, renoise, soft, [t for x in parts for t in x[4]],
                [t for x in parts for t in x[5]])

    def _counters(self, rows: list[Row]) -> tuple[torch.Tensor, torch.Tensor]:
        device = self.adapter.device
        seeds = torch.tensor([r.seq.params.seed for r in rows], dtype=torch.int64, device=device)
        counters = torch.tensor([r.seq.block * 4096 + r.seq.step for r in rows], dtype=torch.int64, device=device)
        return seeds, counters

    def _plan(self, row: Row) -> None:
        """The block starting now: its plan, its knobs (a score block: one plain read at
        temperature 1, the top ``score_k``) and its pins."""
        seq = row.seq
        row.plan = plan = seq.plan(self.adapter.canvas_length)
        p = seq.params
        if plan.scoring:
            row.bp = replace(p, max_denoising_steps=1, t_min=1.0, t_max=1.0, top_k=0, top_p=1.0, min_p=0.0,
                             allowed_token_ids=None, min_tokens=0, logprobs=None, previews=False)
        else:
            row.bp = p
        row.pins = None
        if plan.pinned:
            k = seq.score_k if plan.scoring else (p.logprobs or 0)
            row.pins = Pins(list(plan.pinned), [plan.seed[j] for j in plan.pinned], k)

    def _init_canvas(self, row: Row) -> torch.Tensor:
        C = self.adapter.canvas_length
        if row.plan.scoring:  # noise that depends on nothing but the position (same read for any seed)
            seeds = torch.tensor([SCORE_SEED], dtype=torch.int64, device=self.adapter.device)
            counters = torch.zeros(1, dtype=torch.int64, device=self.adapter.device)
            canvas = hash_draws(seeds, counters, C, _INIT) % self.adapter.vocab_size
        elif self.sampler == "exact":
            canvas = self.adapter.init_canvas(row.generator)
        else:
            seeds, counters = self._counters([row])
            canvas = hash_draws(seeds, counters, C, _INIT) % self.adapter.vocab_size
        if row.plan.seed:
            canvas[0, :len(row.plan.seed)] = torch.tensor(row.plan.seed, dtype=canvas.dtype, device=canvas.device)
        return canvas


def _temperature(p, steps_left: int) -> float:
    return p.t_min + (p.t_max - p.t_min) * (steps_left / p.max_denoising_steps)
