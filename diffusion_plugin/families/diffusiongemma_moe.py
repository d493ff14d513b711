"""Batch-invariant mixture-of-experts for the fast mode (a grouped GEMM with fixed tiles).

HF's experts run one GEMM per expert over every token routed to it, from all rows at once. A
GEMM's result for a token depends on how many rows (M) the GEMM has: the BLAS picks its kernel
and blocking by M (seen here: 5 tokens alone vs among 8..513 differ by ~1e-7 at hidden 128,
1024 and 2816), so a row's output would depend on what its batch mates routed to the same
expert. Within one GEMM of a fixed shape, a token's result does not depend on the other rows nor
on its position (measured: ``tests/unit/test_diffusion_fast.py``).

So in fast mode (``FAST_EXPERTS`` set around the fast mode's passes, a lone row included) the
experts run as a grouped GEMM whose every call has the same shape whatever the batch:
1. the flattened batch's (token, slot) assignments are sorted by expert (a stable sort);
2. each expert's group is padded to a multiple of ``TILE`` rows in one (tiles x TILE, H) buffer;
3. per expert hit (the loop HF makes): one ``bmm`` of its tiles by its ``gate_up`` weight, the
   activation, one ``bmm`` by its ``down`` weight: every GEMM in them is (TILE, H) x (H, 2I) or
   (TILE, I) x (I, H), whatever the batch (a ``bmm`` over n >= 2 tiles gives the same bits per
   tile for every n, on this CPU and on an H200; n = 1 other bits: a lone tile is padded to two,
   ``gemm.bmm_blocks``);
4. each output times its routing weight, gathered back to (token, slot) and summed per token
   over its experts in ascending expert order, the order of HF's ``index_add_`` from zeros.
Only each expert's own weights are read (broadcast over its tiles: a view, never copied;
measured: no allocation). A single ``bmm`` over all tiles would need one weight copy per tile,
24 MB each at the released model's 2816 x 704 experts. Memory: the padded buffer (at most
``N*K + E*(TILE-1)`` rows of H) and its outputs, a few MB per row at the real shape.
The result equals HF's up to the GEMMs' blocking (~1e-7). Exact mode leaves it unset: HF's own
forward, bit-exact with ``generate()``.
"""

from __future__ import annotations

from contextlib import contextmanager
from contextvars import ContextVar

import torch

from diffusion_plugin.gemm import bmm_blocks

FAST_EXPERTS: ContextVar[bool] = ContextVar("tandem_fast_experts", default=False)
TILE = 32  # rows of every expert GEMM
# Expert GEMM calls made (tests count them per step: they must not grow with the rows).
GEMM_CALLS = [0]


def install(model) -> None:
    """Route every experts module of ``model`` through ``_forward``."""
    for module in model.modules():
        if type(module).__name__ == "DiffusionGemmaTextExperts":
            hf_forward = module.forward
            module.forward = lambda h, idx, w, _m=module, _hf=hf_forward: _forward(_m, _hf, h, idx, w)


def _forward(module, hf_forward, hidden_states, top_k_index, top_k_weights):
    if not FAST_EXPERTS.get():
        return hf_forward(hidden_states, top_k_index, top_k_weights)
    return tiled_experts(module.gate_up_proj, module.down_proj, module.act_fn, hidden_states, top_k_index,
                         top_k_weights)


def tiled_experts(gate_up: torch.Tensor, down: torch.Tensor, act, hidden: torch.Tensor, top_k_index: torch.Tensor,
                  top_k_weights: torch.Tensor, tile: int = TILE) -> torch.Tensor:
    """HF's experts math over (N, H) tokens, each GEMM over exactly ``tile`` rows.

    ``gate_up`` (E, 2I, H), ``down`` (E, H, I), ``top_k_index``/``top_k_weights`` (N, K)."""
    N, H = hidden.shape
    K = top_k_index.shape[1]
    E = gate_up.shape[0]
    flat = top_k_index.reshape(-1)
    order = torch.argsort(flat, stable=True)  # assignments grouped by expert
    counts = torch.bincount(flat, minlength=E)
    tiles = (counts + tile - 1) // tile
    padded_start = (torch.cumsum(tiles, 0) - tiles) * tile  # each expert's first row in the buffer
    start = torch.cumsum(counts, 0) - counts
    sorted_expert = flat[order]
    rank = torch.arange(order.numel(), device=flat.device) - start[sorted_expert]
    row = padded_start[sorted_expert] + rank  # buffer row of each sorted assignment
    meta = torch.cat([tiles, padded_start]).tolist()  # one host transfer per layer (HF makes one too)
    n_tiles, first = meta[:E], meta[E:]
    total = sum(n_tiles) * tile
    x = hidden.new_zeros((total, H))
    x[row] = hidden[order // K]
    out = hidden.new_empty((total, H))
    hit = [e for e in range(E) if n_tiles[e]]
    for e in hit:
        n, s = n_tiles[e], first[e]
        # (n, tile, H) x (H, 2I) as n fixed-shape GEMMs: the weight is broadcast (a view, no copy).
        xs = x[s:s + n * tile].view(n, tile, H)
        gate, up = bmm_blocks(xs, gate_up[e].t()).chunk(2, dim=-1)
        out[s:s + n * tile] = bmm_blocks(act(gate) * up, down[e].t()).view(n * tile, H)
        GEMM_CALLS[0] += 2
    del x
    # Back to (token, slot), weighted, then summed per token in ascending expert order.
    weighted = torch.empty((N * K, H), dtype=hidden.dtype, device=hidden.device)
    weighted[order] = out[row] * top_k_weights.reshape(-1)[order, None].to(out.dtype)
    weighted = weighted.view(N, K, H)
    by_expert = torch.argsort(top_k_index, dim=1, stable=True)
    final = torch.zeros_like(hidden)
    for k in range(K):
        final += torch.gather(weighted, 1, by_expert[:, k, None, None].expand(N, 1, H))[:, 0]
    return final


@contextmanager
def fast_experts(on: bool):
    """``on`` (fast mode): the batch-invariant tiled experts, a lone row included; else HF's own."""
    token = FAST_EXPERTS.set(on)
    try:
        yield
    finally:
        FAST_EXPERTS.reset(token)
