"""Row-invariant mixture-of-experts for batched passes (the fast mode's batch invariance).

HF's experts (``grouped_mm`` here) run one GEMM per expert over every token routed to it, from
all rows at once. A GEMM's result for a token depends on how many rows the GEMM has (the BLAS
picks its kernel and blocking by M; seen here: 5 tokens alone vs among 37..513 differ by
~1e-7), so a row's output would depend on what its batch mates routed to the same expert, and
on the shape model rows drifted apart within a step. So, in a batched pass, the experts run once
per row, HF's own call on that row's tokens: bit for bit what the row gets alone. It is the one
per-row loop left in a fast-mode step (B calls per MoE layer, each over C tokens); a
batch-invariant grouped GEMM (fixed tiling whatever M) would remove it. Set ``ROW_TOKENS``
(tokens per row of the flattened batch) around a batched pass; without it this is HF's forward.
"""

from __future__ import annotations

from contextvars import ContextVar

import torch

ROW_TOKENS: ContextVar[int | None] = ContextVar("tandem_row_tokens", default=None)


def install(model) -> None:
    """Route every experts module of ``model`` through ``_forward``."""
    for module in model.modules():
        if type(module).__name__ == "DiffusionGemmaTextExperts":
            hf_forward = module.forward
            module.forward = lambda h, idx, w, _m=module, _hf=hf_forward: _forward(_m, _hf, h, idx, w)


def _forward(module, hf_forward, hidden_states, top_k_index, top_k_weights):
    n = ROW_TOKENS.get()
    if n is None or hidden_states.shape[0] <= n:
        return hf_forward(hidden_states, top_k_index, top_k_weights)
    return torch.cat([hf_forward(hidden_states[i:i + n], top_k_index[i:i + n], top_k_weights[i:i + n])
                      for i in range(0, hidden_states.shape[0], n)])
