"""Batch-invariant mixture-of-experts for the fast mode: every expert's GEMMs in one grouped GEMM.

HF's experts run one GEMM per expert hit, over every token routed to it from all rows at once, and
look up which experts were hit on the host (``nonzero``): ~10 ops per expert hit per layer (at
128 experts, ~2,800 aten ops per layer per step at the real shape; every op is a kernel launch
on a device), a host synchronisation in each layer, and a row's result depends on its batch
mates wherever a GEMM's kernel depends on its row count.

In fast mode (``FAST_EXPERTS`` set around the fast mode's passes, a lone row included) the
experts run as ``grouped_experts``, a fixed sequence of ~35 ops whatever the rows or the experts
hit, with no host synchronisation:
1. the flattened batch's (token, slot) assignments are sorted by expert (a stable sort) and
   counted per expert on the device;
2. each expert's group is padded to a multiple of ``TILE`` rows inside one buffer of a static
   size (``N*K + E*(TILE-1)`` rows: the most the padded groups can take), its groups' ends kept
   on the device;
3. ``torch._grouped_mm`` over that buffer by the experts' ``gate_up`` weights, the activation,
   ``torch._grouped_mm`` by their ``down`` weights: two calls per layer, each expert's weights
   read in place (never copied), the rows past the last group not computed;
4. each output times its routing weight, back to (token, slot), summed per token in ascending
   expert order (the order of HF's ``index_add_``).

Batch invariance: a grouped GEMM computes each group as its own GEMM, so a token's bits may
depend only on its group's row count. On this CPU (MKL) a row's result is the same for every
row count from 5 up, at hidden 128, 1,024 and 2,816 (``tests/gpu/probe_gemm.py cpu``); groups are
padded to multiples of ``TILE`` (8), so never below. On a device, ``_grouped_mm``'s kernel (bf16,
sm90+) tiles each group by fixed row tiles with one reduction per output: checked in
``tests/gpu`` when a device is lent. The result equals HF's up to the GEMMs' blocking (~1e-7).
Exact mode leaves ``FAST_EXPERTS`` unset: HF's own forward, bit-exact with ``generate()``.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

from diffusion_plugin.step.gemm import grouped_mm
from diffusion_plugin.step.local_var import LocalVar

FAST_EXPERTS: LocalVar[bool] = LocalVar("tandem_fast_experts", False)
TILE = 8  # every expert group's row count is a multiple of this (a GEMM of >= 5 rows: row-invariant)
# Grouped GEMM calls made in eager mode (tests count them per step: two per MoE layer, whatever the rows).
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
    return grouped_experts(module.gate_up_proj, module.down_proj, module.act_fn, hidden_states, top_k_index,
                           top_k_weights)


def grouped_experts(gate_up: torch.Tensor, down: torch.Tensor, act, hidden: torch.Tensor, top_k_index: torch.Tensor,
                    top_k_weights: torch.Tensor, tile: int = TILE) -> torch.Tensor:
    """HF's experts math over (N, H) tokens as two grouped GEMMs, each group a multiple of ``tile`` rows.

    ``gate_up`` (E, 2I, H), ``down`` (E, H, I), ``top_k_index``/``top_k_weights`` (N, K)."""
    N, H = hidden.shape
    K = top_k_index.shape[1]
    E = gate_up.shape[0]
    flat = top_k_index.reshape(-1)
    order = torch.argsort(flat, stable=True)  # assignments grouped by expert
    counts = torch.zeros(E, dtype=torch.long, device=flat.device).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + tile - 1) // tile * tile
    ends = torch.cumsum(padded, 0)
    sorted_expert = flat[order]
    # Each sorted assignment's row in the buffer: its expert's padded start plus its rank there.
    row = (ends - padded - torch.cumsum(counts, 0) + counts)[sorted_expert] + torch.arange(
        order.numel(), device=flat.device)
    x = hidden.new_zeros((N * K + E * (tile - 1), H))  # static: the most the padded groups take
    x.index_copy_(0, row, hidden[order // K])
    offs = ends.to(torch.int32)
    gate, up = grouped_mm(x, gate_up.transpose(1, 2), offs).chunk(2, dim=-1)
    out = grouped_mm(act(gate) * up, down.transpose(1, 2), offs)
    if not torch.compiler.is_compiling():  # a compiled trunk would guard on the count: not counted
        GEMM_CALLS[0] += 2
    # Back to (token, slot), weighted, then summed per token in ascending expert order.
    slot_row = torch.empty_like(row).index_copy_(0, order, row)
    weighted = (out[slot_row] * top_k_weights.reshape(-1, 1).to(out.dtype)).view(N, K, H)
    by_expert = torch.argsort(top_k_index, dim=1, stable=True)
    return torch.gather(weighted, 1, by_expert[:, :, None].expand(N, K, H)).sum(1)


@contextmanager
def fast_experts(on: bool):
    """``on`` (fast mode): the batch-invariant grouped experts, a lone row included; else HF's own."""
    token = FAST_EXPERTS.set(on)
    try:
        yield
    finally:
        FAST_EXPERTS.reset(token)
