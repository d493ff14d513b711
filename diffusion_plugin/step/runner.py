"""The runner: per-sequence tensors and the execution of one ``StepBatch``.

Per sequence: its own KV cache (prompt + committed blocks), canvas, self-conditioning soft
embedding (canvas x hidden: nothing vocab-sized is held between steps), stability history,
random generator (exact mode), freed when it leaves.
Per step:
1. the encoder passes (prefills and commits, each row with its own mask into its cache);
2. the decoder trunk over every row being denoised -> hidden states;
3. the vocab-wide head and sampler -> each row's draws, argmax canvas, entropy, soft embedding;
4. entropy-bound acceptance for all rows at once (``accept``, the passes' form of it), and ONE host
   transfer of every row's decisions (argmax canvas, confidence).
Steps 1-3 are the sampler's own passes, each in its module: ``exact_passes`` (``generate()`` run
alone, bit for bit: row by row with HF's shapes and experts) and ``fast_passes`` (batched,
batch-invariant, fused: one forward for all rows, the KV page pool, the prefix cache). The
runner reaches the model only through its family (``diffusion_plugin.family.Family``).
"""

from __future__ import annotations

import time
from dataclasses import replace

import torch

from diffusion_plugin.batcher import memory
from diffusion_plugin.batcher.batch import Pins, RowOutput, StepBatch, StepOutput
from diffusion_plugin.batcher.request import READ_CANVAS, SCORE_SEED, Sequence
from diffusion_plugin.family import Family
from diffusion_plugin.step.draws import INIT, hash_draws
from diffusion_plugin.step.exact_passes import ExactPasses
from diffusion_plugin.step.fast_passes import FastPasses
from diffusion_plugin.step.rows import Row
from diffusion_plugin.step.staging import stage

SAMPLERS = ("exact", "fast")


class Runner:
    def __init__(self, adapter: Family, sampler: str = "exact", chunk_rows: int = 1, kv_budget_bytes: int | None = None,
                 kv_groups: tuple[memory.KVGroup, ...] = (), prefix_cache: bool = False,
                 rowwise: bool = False, compiled_vocab: bool = False, compiled_trunk: bool = False,
                 cuda_graphs: bool = False, batched_vocab: bool | None = None):
        """``sampler``'s passes (``exact_passes``, ``fast_passes``: the others' arguments are
        fast mode's, see ``FastPasses``; exact mode ignores them)."""
        if sampler not in SAMPLERS:
            raise ValueError(f"sampler must be one of {SAMPLERS}")
        self.adapter = adapter
        self.sampler = sampler
        self.passes: ExactPasses | FastPasses = (
            FastPasses(adapter, chunk_rows, kv_budget_bytes, kv_groups, prefix_cache, rowwise, compiled_vocab,
                       compiled_trunk, cuda_graphs, batched_vocab)
            if sampler == "fast" else ExactPasses(adapter))
        self.rows: dict[str, Row] = {}
        self.cached: dict[str, int] = {}  # this step's admitted sequences: prompt tokens found cached

    @property
    def pool(self):
        """Fast mode's KV page pool (None until the first admission, and in exact mode)."""
        return self.passes.pool

    @property
    def chunk_rows(self) -> int:
        return self.passes.chunk_rows

    @property
    def prefix_cache(self) -> bool:
        return self.passes.prefix_cache

    def admit(self, seq: Sequence) -> None:
        gen = torch.Generator(device=self.adapter.device).manual_seed(seq.params.seed)
        pending = torch.tensor([seq.prompt_ids], dtype=torch.long, device=self.adapter.device)
        cache = self.passes.new_cache()
        grammar = None
        if seq.grammar is not None:
            from diffusion_plugin.step.grammar import RowGrammar

            grammar = RowGrammar(seq.grammar, self.adapter.vocab_size, seq.params.eos_token_ids or
                                 self.adapter.eos_token_ids, self.adapter.canvas_length)
        row = self.rows[seq.seq_id] = Row(seq=seq, cache=cache, generator=gen, pending=pending,
                                           images=seq.images, grammar=grammar)
        cached = self.passes.admitted(row, images=seq.images is not None, scoring=bool(seq.score_ids))
        if cached is not None:
            self.cached[seq.seq_id] = cached

    def free(self, seq_id: str) -> None:
        row = self.rows.pop(seq_id, None)
        if row is not None:
            self.passes.release(row)

    def reset(self) -> None:
        """After a failed batch: drop every sequence's state (and the passes' shared state)."""
        self.rows.clear()
        self.passes.reset()

    def kv_pages(self) -> int | list[int]:
        return self.passes.kv_pages()

    def prefix_stats(self) -> dict:
        """The prefix cache's counters and what it holds now (fast mode with ``prefix_cache``)."""
        p, pool = self.passes, self.passes.pool
        return {"prefix_cache_queries": p.prefix_queries, "prefix_cache_hits": p.prefix_hits,
                "kv_cached_pages": pool.cache.cached_pages() if pool is not None else 0,
                "prefix_cache_evictions": pool.cache.evictions if pool is not None else 0}

    def reset_prefix_cache(self) -> bool:
        """Every cached page no sequence holds, freed; False while running sequences still hold
        cached pages (those stay findable until they finish: vLLM's answer, retry later)."""
        pool = self.passes.pool
        if pool is None:
            return True
        pool.reset_cache()
        return not any(pool.cache.key_of)  # what is still registered is held by a sequence

    def warm(self) -> None:
        """Compiles what the sampler compiles now, not in a request's step: fast mode's
        ``compiled_vocab`` kernels, and with ``compiled_trunk`` the trunk's graphs of a context of
        one page (a lone row and several; a block's first step and the others), by running a
        one-block rehearsal of one row, then of two. A longer context's graphs (tables of 2, 4, ...
        pages) compile in the first step that needs them."""
        self.passes.warm()
        if self.sampler == "fast" and self.passes.compiled_trunk:
            for rows in (1, 2):
                self._rehearse(rows)

    def _rehearse(self, rows: int) -> None:
        """``rows`` one-token prompts through a scheduler of their own for one block of two
        denoising steps; their rows freed after (their pages back to the pool), and the prefix
        cache's counters as they were (a rehearsal is no request)."""
        from diffusion_plugin.batcher.request import SamplingParams
        from diffusion_plugin.batcher.scheduler import Scheduler

        C = self.adapter.canvas_length
        sched, seqs = Scheduler(max_batch=rows, canvas_length=C), {}
        params = {**self.adapter.defaults(), "max_denoising_steps": 2}
        for i in range(rows):
            seq = Sequence(seq_id=f"rehearsal-{rows}-{i}", prompt_ids=[i + 1],
                           params=SamplingParams(max_tokens=C, seed=i, eos_token_ids=(), **params))
            seqs[seq.seq_id] = seq
            sched.add(seq)
        try:
            with self.passes.uncounted():
                while sched.has_work():
                    batch, _ = sched.schedule()
                    if not batch.empty():
                        sched.update(self.execute(batch, seqs))
        finally:
            for seq_id in seqs:
                self.free(seq_id)

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
            self.passes.encode(encoding)
            forward_s += time.perf_counter() - t
        for row in encoding:
            row.prefill = False
            row.images = row.seq.images = None  # in the cache now: the features are freed
            row.cur_len += row.pending.shape[1]
            row.version += 1
            row.pending = None
            self._plan(row)
            row.soft, row.history = None, None
        if encoding:
            self._init_canvases(encoding)
        out = StepOutput()
        if batch.denoise:
            rows = [self.rows[s] for s in batch.denoise]
            reads, rest = [r for r in rows if r.plan.reads], [r for r in rows if not r.plan.reads]
            steps_left = [r.bp.max_denoising_steps - r.seq.step for r in rest]
            numbers = self._numbers(reads, rest, steps_left)
            t = time.perf_counter()  # the decoder forwards: the reads' narrow one, then the others'
            read_hidden = self._trunk(reads, self._width(reads[0]), numbers["read_starts"]) if reads else None
            hidden = self._trunk(rest, self.adapter.canvas_length, numbers["starts"]) if rest else None
            forward_s += time.perf_counter() - t
            out.rows = ((self._read(reads, read_hidden) if reads else [])
                        + (self._decide(rest, hidden, steps_left, numbers) if rest else []))
        out.forward_s = forward_s
        out.cached = self.cached
        out.step_s = time.perf_counter() - t0
        return out

    # -- 2. the trunk -----------------------------------------------------------------------
    def _numbers(self, reads: list[Row], rest: list[Row], steps_left: list[int]) -> dict[str, torch.Tensor]:
        """The numbers a step reads, onto the device in one copy that does not stall the host
        (``staging``): the label reads' starts; the other rows' starts, acceptance knobs (in the
        entropy's dtype, float32 in both samplers), pinned positions (``pin_rows``,
        ``pin_positions``, ``pin_tokens``: every row's at once) and the passes' own numbers
        (``step_numbers``)."""
        arrays = {"read_starts": (torch.int32, [r.cur_len for r in reads])} if reads else {}
        if rest:
            arrays |= {"starts": (torch.int32, [r.cur_len for r in rest]),
                       "bounds": (torch.float32, [[r.bp.entropy_bound] for r in rest]),
                       "thresholds": (torch.float32, [r.bp.confidence_threshold for r in rest]),
                       **self.passes.step_numbers(rest, steps_left)}
            pinned = [(b, r.pins) for b, r in enumerate(rest) if r.pins is not None]  # (``_plan``: never empty)
            if pinned:
                arrays |= {"pin_rows": (torch.int64, [b for b, p in pinned for _ in p.positions]),
                           "pin_positions": (torch.int64, [j for _, p in pinned for j in p.positions]),
                           "pin_tokens": (torch.int64, [t for _, p in pinned for t in p.tokens])}
        return stage(self.adapter.device, **arrays)

    def _trunk(self, rows: list[Row], width: int, starts: torch.Tensor) -> torch.Tensor:
        """The decoder over the rows' canvases, their first ``width`` positions (label reads: a
        narrow canvas of their own; every other row: the whole canvas), from ``starts``."""
        canvas = torch.cat([r.canvas if r.canvas.shape[1] == width else r.canvas[:, :width] for r in rows])
        positions = starts[:, None] + torch.arange(width, dtype=torch.int32, device=canvas.device)
        return self.passes.trunk(rows, canvas, positions, self._soft(rows), width)  # (positions as HF's, int32)

    def _soft(self, rows: list[Row]) -> torch.Tensor | None:
        if all(r.soft is None for r in rows):
            return None  # the decoder's own zeros
        like = next(r.soft for r in rows if r.soft is not None)
        return torch.cat([r.soft if r.soft is not None else torch.zeros_like(like) for r in rows])

    # -- 3./4. the vocab-wide head, the sampler, the decisions ------------------------------
    def _read(self, rows: list[Row], hidden: torch.Tensor) -> list[RowOutput]:
        """Label reads: the head on each row's first position alone (a fixed shape per row: the
        same bits whatever shares the batch), not over canvas x vocabulary."""
        return [RowOutput(seq_id=r.seq.seq_id, block_done=True, committed=None, preview=None,
                          scores=self.adapter.read_scores(hidden[b:b + 1], list(r.plan.reads)))
                for b, r in enumerate(rows)]

    def _decide(self, rows: list[Row], hidden: torch.Tensor, steps_left: list[int],
                numbers: dict[str, torch.Tensor]) -> list[RowOutput]:
        sampled, argmax, entropy, renoise, soft, tops, scores = self.passes.vocab(rows, hidden, steps_left, numbers)
        if "pin_rows" in numbers:  # pinned positions hold their tokens, with certainty (all rows' at once)
            at, tokens = (numbers["pin_rows"], numbers["pin_positions"]), numbers["pin_tokens"]
            argmax[at] = tokens.to(argmax.dtype)
            sampled[at] = tokens.to(sampled.dtype)
            entropy.index_put_(at, entropy.new_zeros(()))  # (a device zero: 0.0 would be a tensor from the host)
        canvas = torch.cat([r.canvas for r in rows])
        bounds, thresholds = numbers["bounds"], numbers["thresholds"]
        if entropy.dtype != bounds.dtype:  # (compared in the entropy's dtype, as HF does)
            raise TypeError(f"bug: the entropy is {entropy.dtype}, the staged bounds {bounds.dtype}")
        new_canvas, decisions = self.passes.accept(entropy, bounds, thresholds, sampled, renoise, canvas, argmax)
        decisions = decisions.tolist()  # one host transfer
        outputs = []
        for b, (row, row_canvas, row_argmax, row_soft) in enumerate(zip(rows, new_canvas.split(1), argmax.split(1),
                                                                        soft.split(1), strict=True)):
            p = row.bp
            row.canvas, row.argmax, row.soft = row_canvas, row_argmax, row_soft
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

    def _width(self, row: Row) -> int:
        """A row's canvas width: a label read's narrow canvas, else the model's."""
        return min(READ_CANVAS, self.adapter.canvas_length) if row.plan.reads else self.adapter.canvas_length

    def _init_canvases(self, rows: list[Row]) -> None:
        """Each row's first canvas of its block: a score block's noise depends on nothing but the
        position (the same read for any seed), any other row's is its sampler's; a plan's seed
        tokens are written over it. The host's numbers go in one copy (``staging``)."""
        plain = [r for r in rows if not r.plan.scoring]
        for row, canvas in zip(plain, self.passes.init_canvases(plain) if plain else (), strict=True):
            row.canvas = canvas
        seeded = [r for r in rows if r.plan.seed]
        if len(plain) == len(rows) and not seeded:
            return
        n = stage(self.adapter.device, score=(torch.int64, [SCORE_SEED, 0]),
                  **{f"seed{i}": (torch.int64, list(r.plan.seed)) for i, r in enumerate(seeded)})
        for row in (r for r in rows if r.plan.scoring):
            row.canvas = hash_draws(n["score"][:1], n["score"][1:], self._width(row), INIT) % self.adapter.vocab_size
        for i, row in enumerate(seeded):
            row.canvas[0, :len(row.plan.seed)] = n[f"seed{i}"].to(row.canvas.dtype)
