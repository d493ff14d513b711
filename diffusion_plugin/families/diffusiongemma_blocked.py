"""The fast vocabulary pass blocked over the vocabulary, for the host (``compiled_vocab``).

``diffusiongemma_vocab.fast_chunk`` writes a row's canvas x vocabulary logits (256 MiB at the
released shape), then reads and rewrites them a few times: the softcap and exponents, the soft
embedding's GEMM, the inverse CDF's block sums. On a CPU that memory traffic, not the maths,
is most of what separates the pass from its two GEMMs. Here one row's vocabulary is taken in
blocks of ``VOCAB_BLOCK`` ids whose logits stay in the cache: each block's head GEMM, then its
softcap, temperature and exponents (one inductor kernel, ``_block``), then its share of the soft
embedding's GEMM, with the running max, mass and entropy sums rescaled as the max grows (as an
online softmax does). Nothing vocabulary-sized is written to memory.

The draw is the same inverse CDF with one uniform per position: the mass of every ``SUB`` ids is
kept (C x V / 128 values), the sub-block holding ``u x total`` is found from them, and only its
``SUB`` logits are computed again (a small batched GEMV) for the id inside it.

Served for a row with no filter, grammar, top logprobs or pinned scores (those read the whole
logits: ``fast_chunk``'s passes serve them). Per row (the same kernels and shapes whatever its
batch mates), so a row's tokens do not depend on them; not bit-equal to the eager passes (the
exponents are taken relative to the running max, and the GEMMs are blocked).
"""

from __future__ import annotations

import torch

from diffusion_plugin.step.attention import MIN_EXPONENT, TINY_EXP

VOCAB_BLOCK = 8192  # ids per block: a (256, 8192) float32 block is 8 MiB (the fastest of 2k-16k measured)
SUB = 128  # ids per sub-block of the draw (a multiple of it divides VOCAB_BLOCK)
_FLOOR = torch.finfo(torch.float32).min  # the running max before the first block (finite: no inf - inf)


def tanh_over(x: torch.Tensor, cap: float) -> torch.Tensor:
    """tanh(x / cap) as 1 - 2 / (exp(2x / cap) + 1): the compiled passes' softcap (the reason is in
    ``diffusiongemma_vocab._vocab_math``'s docstring)."""
    return 1 - 2 / (torch.exp(x * (2 / cap)) + 1)


def _block(y: torch.Tensor, m: torch.Tensor, mass: torch.Tensor, zsum: torch.Tensor, inv_t: torch.Tensor, cap: float):
    """One block's raw logits ``y`` (C, B) against the running max ``m`` (C,), mass and sum of
    z x e (float64, relative to ``m``) -> its exponents e (C, B), relative to the new max; the new
    max; the old sums' rescale factor; the block's max and its argmax; the new mass and z x e sum;
    and e's sub-block sums (C, ceil(B / SUB)). The softcap as the fused pass takes it
    (``tanh_over``)."""
    y = tanh_over(y, cap) * (cap * inv_t)
    top, argmax = y.max(dim=-1)
    new = torch.maximum(m, top)
    z = (y - new[:, None]).clamp(min=MIN_EXPONENT)
    e = torch.exp(z)
    e = torch.where(e <= TINY_EXP, torch.zeros_like(e), e)
    shift = (m - new).to(torch.float64)  # <= 0: the old sums' exponents move down by it
    rescale = torch.exp(shift)
    zsum = rescale * (zsum + shift * mass) + (z * e).sum(-1).to(torch.float64)
    mass = rescale * mass + e.sum(-1).to(torch.float64)
    B = e.shape[-1]
    padded = e if B % SUB == 0 else torch.nn.functional.pad(e, (0, SUB - B % SUB))
    return e, new, rescale.to(torch.float32), top, argmax, mass, zsum, padded.view(e.shape[0], -1, SUB).sum(-1)


class Blocked:
    """The blocked pass (its kernel compiled at the first call: ``warm``), one row at a time; a
    plain pass of ``diffusiongemma_vocab.Scratch`` (``takes``, ``run``, ``warm``)."""

    def __init__(self):
        self.math = torch.compile(_block, dynamic=False)

    @staticmethod
    def takes(weight: torch.Tensor) -> bool:
        return weight.dtype == torch.float32  # (its buffers are float32, as the trunk's hidden states then)

    def run(self, model, hidden: torch.Tensor, inv_t: torch.Tensor, uniform: torch.Tensor):
        """R rows (R, C, H) -> (sampled, argmax, entropy) each (R, C) and the soft embedding (R, C, H)."""
        parts = [self.row(model, hidden[b], inv_t[b:b + 1], uniform[b]) for b in range(hidden.shape[0])]
        return tuple(torch.stack(xs) for xs in zip(*parts, strict=True))

    def warm(self, model, canvas: int, device) -> None:
        H = model.lm_head.weight.shape[1]
        self.run(model, torch.zeros(1, canvas, H, device=device), torch.ones(1, device=device),
                 torch.full((1, canvas), 0.5, dtype=torch.float64, device=device))

    @torch.no_grad()
    def row(self, model, hidden: torch.Tensor, inv_t: torch.Tensor, uniform: torch.Tensor):
        """One row's hidden states (C, H), 1/temperature (1,), uniforms (C,) float64 ->
        (sampled, argmax, entropy) each (C,) and the soft embedding (C, H)."""
        cap = float(model.final_logit_softcapping)
        weight, embed = model.lm_head.weight, model.model.decoder.embed_tokens
        V, (C, H) = weight.shape[0], hidden.shape
        m = torch.full((C,), _FLOOR, device=hidden.device)
        mass = torch.zeros(C, dtype=torch.float64, device=hidden.device)
        zsum = torch.zeros_like(mass)
        soft = torch.zeros(C, H, device=hidden.device)
        argmax = torch.zeros(C, dtype=torch.long, device=hidden.device)
        sums, maxes = [], []
        y = torch.empty(C, min(VOCAB_BLOCK, V), device=hidden.device)
        for start in range(0, V, VOCAB_BLOCK):
            rows = weight[start:start + VOCAB_BLOCK]
            block = y if rows.shape[0] == y.shape[1] else torch.empty(C, rows.shape[0], device=hidden.device)
            torch.matmul(hidden, rows.t(), out=block)
            e, new, rescale, top, top_id, mass, zsum, sub = self.math(block, m, mass, zsum, inv_t, cap)
            soft.mul_(rescale[:, None]).addmm_(e, embed.weight[start:start + VOCAB_BLOCK])
            argmax = torch.where(top > m, top_id + start, argmax)  # (m: the max so far) the first of equal maxima
            m = new
            sums.append(sub)
            maxes.append(m)
        # Every sub-block's mass relative to the final max: the CDF the draw reads.
        cdf = torch.cat([s * torch.exp(k - m)[:, None] for s, k in zip(sums, maxes, strict=True)], 1)
        sampled = _draw(hidden, weight, cdf.to(torch.float64).cumsum(-1), m, inv_t, cap, uniform)
        entropy = (torch.log(mass) - zsum / mass).to(torch.float32)  # of softmax(y): log S - sum(z e) / S
        soft = soft / mass[:, None].to(soft.dtype) * embed.embed_scale.to(hidden.dtype)
        return sampled, argmax, entropy, soft


def _draw(hidden, weight, cdf, m, inv_t, cap: float, uniform):
    """The id whose cumulative mass first exceeds u x total, per position: its sub-block from
    ``cdf`` (C, sub-blocks), then the sub-block's exponents computed again and summed up inside it."""
    V, (C, H) = weight.shape[0], hidden.shape
    target = uniform * cdf[:, -1]
    sub = torch.searchsorted(cdf, target[:, None], right=True).clamp_(max=cdf.shape[1] - 1)  # (C, 1)
    before = torch.where(sub > 0, cdf.gather(-1, (sub - 1).clamp(min=0)), torch.zeros_like(target[:, None]))
    ids = sub * SUB + torch.arange(SUB, device=hidden.device)  # (C, SUB)
    valid = ids < V
    rows = weight.index_select(0, ids.clamp(max=V - 1).flatten()).view(C, SUB, H)
    y = torch.bmm(rows, hidden[:, :, None])[:, :, 0]
    y = tanh_over(y, cap) * (cap * inv_t)
    e = torch.exp((y - m[:, None]).clamp(min=MIN_EXPONENT))
    e = torch.where(valid & (e > TINY_EXP), e, torch.zeros_like(e))
    inside = e.to(torch.float64).cumsum(-1) + before
    j = torch.searchsorted(inside, target[:, None], right=True).clamp_(max=SUB - 1)
    return torch.minimum(ids.gather(-1, j)[:, 0], valid.sum(-1) - 1 + sub[:, 0] * SUB)
