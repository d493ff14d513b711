"""Fast mode's passes: batch-invariant, batched, fused (``Runner(sampler="fast")``).

The sequences' K/V live in one page pool per layer (``kv_view``), sized once from the memory
budget, written by the encoder and read in place by the decoder; a sequence joining or leaving
copies nobody's K/V. With ``prefix_cache`` a prompt is encoded in page-aligned chunks and its
whole pages are kept for reuse (``prefix_cache``).
- encoder: the rows whose pending tokens are a whole canvas (commits) in one batched pass; any
  other pass (a prefill, a short score block) alone;
- trunk: ONE batched decoder forward over every row being denoised, one attention call per layer
  reading the pool in place, the experts as two grouped GEMMs per MoE layer (the family's
  ``fast_experts``), every linear over canvases batch-invariant (``gemm.rows``);
- vocabulary: the family's ``vocab_fast`` over ``chunk_rows`` rows at a time (its transient peak
  does not grow with the batch), hash-based draws (``draws``) just in time.
Not equal to HF's ``generate()``: a row's tokens do not depend on its batch mates.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

from diffusion_plugin.batcher import memory
from diffusion_plugin.batcher.memory import PAGE_TOKENS
from diffusion_plugin.family import Family
from diffusion_plugin.step import gemm
from diffusion_plugin.step.accept import accept
from diffusion_plugin.step.attention import FAST
from diffusion_plugin.step.compiled import compile_part, compile_trunk, mark_static
from diffusion_plugin.step.draws import GRAMMAR, INIT, hash_draws, hash_uniform, step_draws
from diffusion_plugin.step.kv_view import FastViews, KVPool, free_bytes, release
from diffusion_plugin.step.prefix_cache import chunks, page_keys
from diffusion_plugin.step.rows import Row, by_length
from diffusion_plugin.step.staging import stage


class FastPasses:
    sampler = "fast"

    def __init__(self, adapter: Family, chunk_rows: int = 1, kv_budget_bytes: int | None = None,
                 kv_groups: tuple[memory.KVGroup, ...] = (), prefix_cache: bool = False, rowwise: bool = False,
                 compiled_vocab: bool = False, compiled_trunk: bool = False, cuda_graphs: bool = False,
                 batched_vocab: bool | None = None):
        """The KV pool, one ``torch.empty`` per layer: ``kv_groups`` (``memory.plan_pool``, the
        plan the scheduler admits against: a device) gives its pages per layer group. Otherwise
        ``kv_budget_bytes``, the memory budget, sizes it (default: the budget the engine derives by
        default from the memory free now): on the host (``memory.pool_pages``, lazy: only the pages
        written take memory, and whatever the budget admits fits), or an equal count per layer
        within the budget on a device without a plan (tests). ``rowwise``: each row alone through
        the passes (slower; for measurements). ``compiled_trunk``: the decoder forward compiled
        (``compiled``), with ``cuda_graphs`` captured and replayed as CUDA graphs.
        ``compiled_vocab``: the family's compiled vocabulary passes, in their device form where
        ``batched_vocab`` (None: on a cuda device) — a chunk's plain pass as one graph — and with
        it the step's draws and acceptance compiled too (a few launches each, not ~100 ops)."""
        self.adapter = adapter
        self.chunk_rows = max(1, int(chunk_rows))
        self.kv_budget_bytes = kv_budget_bytes
        self.kv_groups = tuple(kv_groups)
        self.pool: KVPool | None = None  # made at the first admission
        self.prefix_cache = bool(prefix_cache)
        self.prefix_queries = self.prefix_hits = 0  # since start (a pool reset keeps them: counters)
        self.compiled_trunk = bool(compiled_trunk)
        self.views = FastViews(bucket=compiled_trunk)
        self.cuda_graphs = bool(cuda_graphs and compiled_trunk)
        self._decode = (compile_trunk(adapter.decode_hidden, self.cuda_graphs) if compiled_trunk
                        else adapter.decode_hidden)
        self.rowwise = bool(rowwise)
        self.row_views: dict[str, FastViews] = {}
        batched = adapter.device.type != "cpu" if batched_vocab is None else bool(batched_vocab)
        self.scratch = adapter.vocab_scratch(compiled_vocab, batched)  # reusable vocabulary buffers
        self.device_form = bool(compiled_vocab and batched)
        self._draws = compile_part(step_draws) if self.device_form else step_draws
        self.accept = compile_part(accept) if self.device_form else accept

    # -- the KV pool and the prefix cache -----------------------------------------------------
    def new_cache(self):
        return self.adapter.new_cache(self._kv_pool())

    def admitted(self, row: Row, images: bool, scoring: bool) -> int | None:
        """A new sequence: with the prefix cache (not for images or scoring yet), it starts from
        the cached pages of its prompt's longest cached prefix; the prompt tokens found, or None."""
        if not self.prefix_cache or images or scoring:
            return None
        pool, prompt = self.pool, row.seq.prompt_ids
        row.keys = page_keys(prompt, row.seq.cache_salt)
        layers = row.cache.layers
        keys = row.keys[:(len(prompt) - 1) // PAGE_TOKENS]  # at least one token is left to encode
        j = pool.cache.lookup(keys, lambda layer, n: layers[layer].needed_pages(n * PAGE_TOKENS))
        self.prefix_queries += len(prompt)  # (vLLM's prefix-cache counters: prompt tokens queried and found)
        self.prefix_hits += j * PAGE_TOKENS
        if j:
            for i, layer in enumerate(layers):
                need = layer.needed_pages(j * PAGE_TOKENS)
                layer.adopt([pool.cache.page(keys[k], i) for k in need], need.start, j * PAGE_TOKENS)
            row.pending = row.pending[:, j * PAGE_TOKENS:]
            row.cur_len = j * PAGE_TOKENS
        return j * PAGE_TOKENS

    @contextmanager
    def uncounted(self):
        """What runs inside is no request (``Runner``'s start-up rehearsal): the prefix cache's
        counters are left as they were."""
        counters = self.prefix_queries, self.prefix_hits
        try:
            yield
        finally:
            self.prefix_queries, self.prefix_hits = counters

    def _register(self, row: Row, page: int) -> None:
        """The prompt's whole page ``page`` is written: each layer that holds it keeps it for reuse."""
        for i, layer in enumerate(row.cache.layers):
            physical = layer.page_at(page)
            if physical is not None:
                self.pool.cache.register(row.keys[page], i, physical)

    def release(self, row: Row) -> None:
        self.row_views.pop(row.seq.seq_id, None)
        if self.pool is not None:
            release(row.cache)  # its pages back to the pool

    def reset(self) -> None:
        """After a failed batch: the pool goes too (a failure may have left a row's pages half
        written), and the prefix cache with it."""
        self.views.reset()
        self.row_views.clear()
        self.pool = None

    def _kv_pool(self) -> KVPool:
        if self.pool is None:
            self.pool = KVPool(self.adapter.kv_layout(), self.kv_pages(), self.adapter.dtype, self.adapter.device)
            if self.cuda_graphs:
                mark_static(self.pool)
        return self.pool

    def kv_pages(self) -> int | list[int]:
        """The pool's size: pages per layer (with the null page), or one count for all."""
        shape = self.adapter.memory_shape()
        if self.kv_groups:
            return [max(2, n) for n in memory.layer_pages(shape, self.kv_groups)]
        budget = self.kv_budget_bytes
        if budget is None:  # as the engine decides it (``memory.plan``) from the memory free now
            budget = memory.plan(shape, self.sampler, chunk_rows=self.chunk_rows,
                                 free_bytes=free_bytes(self.adapter.device)).budget_bytes
        return max(2, memory.pool_pages(shape, budget, lazy=self.adapter.device.type == "cpu"))

    # -- the passes -----------------------------------------------------------------------------
    def encode(self, encoding: list[Row]) -> None:
        """Prefills and commits. Batching rows changes the GEMMs' row count, and for a few rows of
        a few tokens the CPU BLAS takes another kernel: two 4-token prefills batched moved a row's
        K/V by ~1e-6 and flipped its samples (left-padding to a batch mate's length did the same).
        Whole-canvas commits batched are row-invariant (tested); any other pass runs alone."""
        C = self.adapter.canvas_length
        chunked = [r for r in encoding if r.keys is not None and r.prefill]
        rest = [r for r in encoding if r.keys is None or not r.prefill]
        whole = [r for r in rest if r.pending.shape[1] == C]
        groups = ([[r] for r in rest] if self.rowwise else
                  by_length(whole) + [[r] for r in rest if r.pending.shape[1] != C])
        for row in chunked:  # the prompt in page-aligned chunks, each whole page kept
            for a, b in chunks(row.cur_len, row.cur_len + row.pending.shape[1]):
                with self.adapter.fast_experts(True):
                    self.adapter.encode([row.cache], [row.pending[:, a - row.cur_len:b - row.cur_len]], [a])
                if b % PAGE_TOKENS == 0:
                    self._register(row, b // PAGE_TOKENS - 1)
        for group in groups:
            images = [r.images for r in group]
            canvas = C if group[0].pending.shape[1] == C else 0
            with self.adapter.fast_experts(True), gemm.rows(canvas):
                self.adapter.encode([r.cache for r in group], [r.pending for r in group], [r.cur_len for r in group],
                                    images if any(i is not None for i in images) else None)

    def trunk(self, rows: list[Row], canvas, positions, soft, width: int) -> torch.Tensor:
        """The decoder over ``width``-wide canvases (the model's, or a label read's)."""
        if not self.rowwise:
            return self._trunk(self.views, rows, canvas, positions, soft, width)
        return torch.cat([self._trunk(self.row_views.setdefault(r.seq.seq_id, FastViews()), [r], canvas[b:b + 1],
                                      positions[b:b + 1], None if soft is None else soft[b:b + 1], width)
                          for b, r in enumerate(rows)])

    def _trunk(self, views: FastViews, rows: list[Row], canvas, positions, soft, width: int) -> torch.Tensor:
        view, spec = views.get([r.seq.seq_id for r in rows], [r.version for r in rows], [r.cache for r in rows])
        token = FAST.set(spec)
        try:
            with self.adapter.fast_experts(True), gemm.rows(width):
                return self._decode(canvas, view, positions, soft)
        finally:
            FAST.reset(token)

    def step_numbers(self, rows: list[Row], steps_left: list[int]) -> dict:
        """The numbers ``vocab`` reads, for the runner's one copy (``staging``): per row its seed,
        its draws' counter and 1/temperature."""
        return {**counters_of(rows),
                "inv_t": (torch.float32, [1.0 / temperature(r.bp, s) for r, s in zip(rows, steps_left, strict=True)])}

    def vocab(self, rows: list[Row], hidden: torch.Tensor, steps_left: list[int], numbers: dict[str, torch.Tensor]):
        """(sampled, argmax, entropy, renoise, soft, tops, scores) for ``rows``, ``numbers`` their
        ``step_numbers`` on the device."""
        seeds, counters, inv_t = numbers["seeds"], numbers["counters"], numbers["inv_t"]
        V, C = self.adapter.vocab_size, self.adapter.canvas_length
        uniform, renoise = self._draws(seeds, counters, C, V)
        k = self.chunk_rows
        ks = [r.bp.logprobs for r in rows]
        grammars = [r.constrained for r in rows]
        filtered = [(r.bp, len(r.seq.output_ids)) if r.bp.filtered(len(r.seq.output_ids)) else None for r in rows]
        pins = [r.pins for r in rows]
        uniform2 = hash_uniform(seeds, counters, C, GRAMMAR) if any(g is not None for g in grammars) else None
        parts = [self.adapter.vocab_fast(hidden[i:i + k], inv_t[i:i + k], uniform[i:i + k], self.scratch,
                                         ks[i:i + k] if any(x is not None for x in ks[i:i + k]) else None,
                                         grammars[i:i + k] if any(g is not None for g in grammars[i:i + k]) else None,
                                         None if uniform2 is None else uniform2[i:i + k], filtered[i:i + k],
                                         pins[i:i + k])
                 for i in range(0, len(rows), k)]
        sampled, argmax, entropy, soft = (torch.cat(xs) if len(xs) > 1 else xs[0]
                                          for xs in zip(*(x[:4] for x in parts), strict=True))
        return (sampled, argmax, entropy, renoise, soft, [t for x in parts for t in x[4]],
                [t for x in parts for t in x[5]])

    def init_canvases(self, rows: list[Row]) -> list[torch.Tensor]:
        """The first canvas of each row's block, drawn for all the rows at once (a row's draws
        depend on its seed and counter alone)."""
        n = stage(self.adapter.device, **counters_of(rows))
        canvases = hash_draws(n["seeds"], n["counters"], self.adapter.canvas_length, INIT) % self.adapter.vocab_size
        return list(canvases.split(1))

    def warm(self) -> None:
        """Compiles what the family compiles (``compiled_vocab``) now, not in a request's step, and
        in the device form the draws' and the acceptance's graphs (a lone row's, several rows')."""
        self.adapter.warm_vocab(self.scratch)
        if not self.device_form:
            return
        C, device = self.adapter.canvas_length, self.adapter.device
        for rows in (1, 2):
            seeds = torch.zeros(rows, dtype=torch.int64, device=device)
            self._draws(seeds, seeds, C, self.adapter.vocab_size)
            ids, entropy = torch.zeros(rows, C, dtype=torch.long, device=device), torch.zeros(rows, C, device=device)
            self.accept(entropy, entropy[:, :1], entropy[:, 0], ids, ids, ids, ids)

    def instrument(self, wrap) -> None:
        """For a measuring tool (``tandem_tools.bench.opcount``): each compiled part of the step (the
        trunk; in the device form the draws, the acceptance and the family's compiled vocabulary
        pass) becomes ``wrap(name, eager)``, ``eager`` the part's uncompiled function."""
        if self.compiled_trunk:
            self._decode = wrap("trunk", self.adapter.decode_hidden)
        if self.device_form:
            self._draws = wrap("draws", step_draws)
            self.accept = wrap("accept", accept)
            instrument = getattr(self.scratch, "instrument", None)  # (a family's scratch may have no compiled pass)
            if instrument is not None:
                instrument(wrap)


def counters_of(rows: list[Row]) -> dict:
    """Each row's seed and the counter of its draws now (its block and step), for ``staging``."""
    return {"seeds": (torch.int64, [r.seq.params.seed for r in rows]),
            "counters": (torch.int64, [r.seq.block * 4096 + r.seq.step for r in rows])}


def temperature(p, steps_left: int) -> float:
    return p.t_min + (p.t_max - p.t_min) * (steps_left / p.max_denoising_steps)
