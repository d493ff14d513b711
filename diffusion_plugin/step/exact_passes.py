"""Exact mode's passes: ``generate()`` run alone, bit for bit (``Runner(sampler="exact")``).

Each row alone, with HF's shapes and HF's experts: its own ``DynamicCache``, its encoder pass (a
prompt in one pass, as ``generate()``), its decoder forward over its own cache, its vocabulary
pass at (1, C, V), its draws from its own generator in HF's order (multinomial noise, then
renoise). Batched GEMMs are not row-invariant on every BLAS (on this box a batched trunk or
encoder pass moved logits by ~1e-6 and flipped samples), and at the real shape the trunk is a
small share of a step.
"""

from __future__ import annotations

import torch

from diffusion_plugin.family import Family
from diffusion_plugin.step.accept import accept as _accept
from diffusion_plugin.step.rows import Row


class ExactPasses:
    sampler = "exact"
    chunk_rows = 1  # HF's (1, C, V)
    pool = None  # no page pool: HF's caches
    prefix_cache = False  # a prompt is encoded in one pass, as generate(): nothing to reuse
    prefix_queries = prefix_hits = 0
    accept = staticmethod(_accept)  # eager: HF's bits

    def __init__(self, adapter: Family):
        self.adapter = adapter

    def new_cache(self):
        return self.adapter.new_cache(None)

    def admitted(self, row: Row, images: bool, scoring: bool) -> None:
        return None

    def release(self, row: Row) -> None:
        pass

    def reset(self) -> None:
        pass

    def encode(self, encoding: list[Row]) -> None:
        for r in encoding:
            with self.adapter.fast_experts(False):
                self.adapter.encode([r.cache], [r.pending], [r.cur_len], None if r.images is None else [r.images])

    def trunk(self, rows: list[Row], canvas, positions, soft, width: int) -> torch.Tensor:
        with self.adapter.fast_experts(False):
            return torch.cat([self.adapter.decode_hidden(canvas[b:b + 1], r.cache, positions[b:b + 1],
                                                         None if soft is None else soft[b:b + 1])
                              for b, r in enumerate(rows)])

    def step_numbers(self, rows: list[Row], steps_left: list[int]) -> dict:
        return {}  # (the generators and HF's own tensors: nothing staged)

    def vocab(self, rows: list[Row], hidden: torch.Tensor, steps_left: list[int], numbers: dict):
        """(sampled, argmax, entropy, renoise, soft, tops, scores) for ``rows``, row by row (``numbers``:
        the runner's staged numbers; this sampler reads none, its rows' generators are HF's)."""
        parts = [self.adapter.vocab_exact(hidden[b:b + 1], r.bp, steps_left[b], r.generator, len(r.seq.output_ids),
                                          r.pins, None if r.constrained is None else r.grammar)
                 for b, r in enumerate(rows)]
        return (*(torch.cat(xs) for xs in zip(*(x[:5] for x in parts), strict=True)), [x[5] for x in parts],
                [x[6] for x in parts])

    def init_canvases(self, rows: list[Row]) -> list[torch.Tensor]:
        return [self.adapter.init_canvas(r.generator) for r in rows]

    def warm(self) -> None:
        pass

    def kv_pages(self) -> int:
        raise ValueError("the exact sampler has no KV page pool")
