"""Fast mode's batch-invariant GEMMs: a row's result has the same bits whatever its batch mates.

A BLAS picks a GEMM's kernel by its size, so a row's linear over (B*C, H) moves with B: on this
CPU at hidden 2816, on an H200 (cuBLAS) at hidden 1024 and 2816 (``tests/gpu/probe_gemm.py``).
A batched GEMM (``bmm``) over n equal blocks gave every block the same bits for every n >= 2
(2..100, on both), and other bits at n = 1. So in fast mode's batched passes (``ROWS`` set: the
decoder over canvases, batched commits) every linear over (B, C, H) rows is one ``bmm`` over its
B rows' 2B canvas halves (``bmm_halves``: the weight broadcast, never copied; a lone row is
two blocks, so it costs one GEMM, not two padded ones), and so is one over the same rows
flattened (the MoE router's input). The experts run as grouped GEMMs
(``diffusiongemma_moe``). Prompt passes run alone and are left as they are.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

from diffusion_plugin.step.local_var import LocalVar

# The canvas length while a fast-mode pass over canvases runs (0: off).
ROWS: LocalVar[int] = LocalVar("tandem_row_gemms", 0)


def bmm_blocks(x: torch.Tensor, weight_t: torch.Tensor) -> torch.Tensor:
    """(n, m, k) x (k, o) -> (n, m, o) as one bmm over max(n, 2) blocks (a lone block padded)."""
    n = x.shape[0]
    if n == 1:
        x = x.expand(2, -1, -1)
    return torch.bmm(x, weight_t.expand(x.shape[0], -1, -1))[:n]


def bmm_halves(x: torch.Tensor, weight_t: torch.Tensor) -> torch.Tensor:
    """(n, m, k) x (k, o) -> (n, m, o) as one bmm over the 2n halves of the n blocks (m even): the
    same rule (every call a bmm over >= 2 equal blocks), and a lone block costs one GEMM, not two
    (the vocabulary pass, ``diffusiongemma_batched``, whose two GEMMs are most of a row's step)."""
    n, m, k = x.shape
    if m % 2:
        return bmm_blocks(x, weight_t)
    halves = x.reshape(2 * n, m // 2, k)
    return torch.bmm(halves, weight_t.expand(2 * n, -1, -1)).reshape(n, m, -1)


@torch.library.custom_op("tandem::grouped_mm", mutates_args=())
def grouped_mm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """``torch._grouped_mm(a, b, offs=offs)`` as one opaque op. Its own meta function takes bf16
    only, so a float32 trunk could not be traced (``torch.compile``); through this op a traced
    trunk calls the grouped GEMM as it is, and eager mode runs the same kernel."""
    return torch._grouped_mm(a, b, offs=offs)


@grouped_mm.register_fake
def _(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    return a.new_empty(a.shape[0], b.shape[-1])


def install(model, skip: tuple = ()) -> None:
    """Route every ``nn.Linear`` of ``model`` (but ``skip``) through ``_linear`` while ``ROWS`` is set."""
    for module in model.modules():
        if isinstance(module, torch.nn.Linear) and not any(module is s for s in skip):
            hf_forward = module.forward
            module.forward = lambda x, _m=module, _hf=hf_forward: _linear(_m, _hf, x)


def _linear(module, hf_forward, x: torch.Tensor) -> torch.Tensor:
    """(B, C, H) rows, or the same flattened to (B*C, H) (the MoE router's input): one block per row."""
    canvas = ROWS.get()
    rows = x.shape[1] if x.dim() == 3 else x.shape[0] if x.dim() == 2 else 0
    if not canvas or not rows or rows % canvas:
        return hf_forward(x)
    blocks = x.reshape(-1, canvas, x.shape[-1])
    y = bmm_halves(blocks, module.weight.t()).reshape(*x.shape[:-1], -1)
    return y if module.bias is None else y + module.bias


@contextmanager
def rows(canvas: int):
    """Fast mode's passes over canvases (the trunk, commits): batch-invariant linears over rows of
    ``canvas`` tokens (0: plain linears)."""
    token = ROWS.set(canvas)
    try:
        yield
    finally:
        ROWS.reset(token)
