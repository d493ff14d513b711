"""The fast vocabulary pass of a chunk of rows as one compiled graph: a device's form.

On a device a step's cost is its launches as much as its maths: the eager passes of
``diffusiongemma_vocab.fast_chunk`` are ~60 aten ops per chunk, and the host's blocked pass
(``diffusiongemma_blocked``) ~100 launches a row (its blocks keep a CPU's cache warm; a GPU has
no use for that). Here a chunk's whole plain pass is one ``torch.compile`` graph
(``compiled.compile_part``: rows dynamic, reductions unsplit): the head as one ``bmm`` over the
rows' canvas halves (``gemm.bmm_halves``: a row's bits do not depend on its mates, and a lone
row costs one GEMM, not two),
softcap, temperature, the max, exponents, mass and entropy fused, the soft embedding as a second
``bmm``, and the inverse-CDF draw, each row's C draws from its own uniforms.

Served, with ``compiled_vocab`` on a cuda device (``Scratch(batched=True)``), to rows with no
filter, grammar, top logprobs or pinned scores, as the blocked pass is on the host; not bit-equal
to the eager passes (another GEMM form; the softcap as ``tanh_over``).
"""

from __future__ import annotations

import torch

from diffusion_plugin.families.diffusiongemma_blocked import tanh_over
from diffusion_plugin.step.attention import MIN_EXPONENT, TINY_EXP
from diffusion_plugin.step.compiled import compile_part
from diffusion_plugin.step.gemm import bmm_halves

CDF_BLOCK = 512  # the inverse CDF finds a block of this many ids first, then the id inside it


def plain(hidden: torch.Tensor, head: torch.Tensor, embed: torch.Tensor, scale: torch.Tensor, inv_t: torch.Tensor,
          uniform: torch.Tensor, cap: float):
    """R rows' hidden states (R, C, H), the head's and the embedding's (V, H) weights, the
    embedding's scale, 1/temperature (R,), one uniform per position (R, C) float64 -> (sampled,
    argmax, entropy) each (R, C) and the soft embedding (R, C, H): the eager passes' maths."""
    _, e, total, argmax, entropy = exponents(bmm_halves(hidden, head.t()).to(torch.float32), inv_t, cap)
    soft = bmm_halves(e.to(embed.dtype), embed) / total[..., None].to(embed.dtype)
    return inverse_cdf(e, uniform), argmax, entropy, soft * scale.to(hidden.dtype)


def exponents(x: torch.Tensor, inv_t: torch.Tensor, cap: float):
    """Rows' raw logits (R, C, V) and 1/temperature (R,) -> the processed logits shifted by their
    max z (clamped at ``MIN_EXPONENT``), their exponents e (zero at or below ``TINY_EXP``), the mass
    (R, C), the argmax and the entropy of softmax: the compiled passes' maths (``plain``, and
    ``diffusiongemma_vocab._vocab_math``, which says why the softcap is ``tanh_over``)."""
    y = tanh_over(x, cap) * (cap * inv_t)[:, None, None]
    top, argmax = y.max(dim=-1)
    z = (y - top[..., None]).clamp(min=MIN_EXPONENT)
    e = torch.exp(z)
    e = torch.where(e <= TINY_EXP, torch.zeros_like(e), e)
    total = e.sum(-1)
    return z, e, total, argmax, torch.log(total) - (z * e).sum(-1) / total  # log S - sum(z e) / S


class Batched:
    """``plain`` compiled (its graphs compile at their first call: ``warm`` calls both); a plain
    pass of ``diffusiongemma_vocab.Scratch`` (``takes``, ``run``, ``warm``)."""

    def __init__(self):
        self.fn = compile_part(plain)

    @staticmethod
    def takes(weight: torch.Tensor) -> bool:
        return True  # any dtype

    def run(self, model, hidden: torch.Tensor, inv_t: torch.Tensor, uniform: torch.Tensor):
        embed = model.model.decoder.embed_tokens
        return self.fn(hidden, model.lm_head.weight, embed.weight, embed.embed_scale, inv_t, uniform,
                       float(model.final_logit_softcapping))

    def instrument(self, wrap) -> None:
        self.fn = wrap("vocab", plain)

    def warm(self, model, canvas: int, device) -> None:
        """A lone row's graph and the several rows' one."""
        H = model.lm_head.weight.shape[1]
        for rows in (1, 2):
            uniform = torch.full((rows, canvas), 0.5, dtype=torch.float64, device=device)
            self.run(model, torch.zeros(rows, canvas, H, dtype=model.lm_head.weight.dtype, device=device),
                     torch.ones(rows, device=device), uniform)


def inverse_cdf(e: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """The id whose cumulative (unnormalised) mass first exceeds u * total, per position: block
    sums, their cumsum, then a cumsum inside the one chosen block (C x 512, not C x V)."""
    R, C, V = e.shape
    nb = -(-V // CDF_BLOCK)
    if nb * CDF_BLOCK != V:
        e = torch.nn.functional.pad(e, (0, nb * CDF_BLOCK - V))
    blocks = e.view(R, C, nb, CDF_BLOCK)
    cdf = blocks.sum(-1).to(torch.float64).cumsum(-1)  # (R, C, nb); float64 only over nb values
    target = uniform.to(torch.float64) * cdf[..., -1]
    bi = torch.searchsorted(cdf, target[..., None], right=True).clamp_(max=nb - 1)  # (R, C, 1)
    before = torch.where(bi > 0, cdf.gather(-1, (bi - 1).clamp(min=0)), torch.zeros_like(target[..., None]))
    inside = blocks.gather(2, bi[..., None].expand(R, C, 1, CDF_BLOCK))[:, :, 0].to(torch.float64).cumsum(-1) + before
    j = torch.searchsorted(inside, target[..., None], right=True).clamp_(max=CDF_BLOCK - 1)
    return (bi * CDF_BLOCK + j)[..., 0].clamp_(max=V - 1)
