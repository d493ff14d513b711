"""Attention for batched passes over sequences of different lengths.

Encoder passes (``ENCODE``, fast mode's batched prefills and commits): each row's new K/V go
to its own cache and each row attends with the very SDPA call and mask a lone sequence makes.

Decoder passes in fast mode (``FAST``): ONE call per layer for the whole batch. The decoder sees
only the canvas keys (an empty cache view); each row's context K/V is read in place from the
layer's page pool (``kv_view``) through the row's block table, one ATTN_BLOCK-key block per
kernel step (a gather of one page per row), with each row's valid positions. Attention runs
blockwise with an online softmax: the canvas block first, then the context blocks. A row's
blocks are laid out by its own positions only (its page p holds its positions
[p*ATTN_BLOCK, (p+1)*ATTN_BLOCK)); beyond its last block a row reads the null page, fully
masked: the running max stays, the correction is exp(0) = 1 and the masked weights are set to
exactly 0, so those blocks add exact zeros. A row's attention output does not depend on its
batch mates (padded SDPA is not batch-invariant: its result moves by ~1e-7 with the padded
length, i.e. with the longest batch mate).

Outside both (the exact mode's per-row passes) this is plain SDPA, as in generate().
"""

from __future__ import annotations

import torch

from diffusion_plugin.batcher.memory import PAGE_TOKENS
from diffusion_plugin.step.local_var import LocalVar

ATTN_NAME = "tandem_rowwise"
# Batched encoder passes: per row, its own K/V (written to its own cache) and its own mask.
ENCODE: LocalVar[EncodeSpec | None] = LocalVar("tandem_encode", None)
FAST: LocalVar[FastSpec | None] = LocalVar("tandem_fast", None)
ATTN_BLOCK = PAGE_TOKENS  # keys per kernel step = tokens per KV page (kv_view)
# exp() of anything below this is a float32 denormal, and a matmul over denormals runs ~60x
# slower on CPU; exponents are clamped here (fast mode only). A masked key's weight is then set
# to exactly 0 (its page may hold another position's values).
MIN_EXPONENT = -87.0
TINY_EXP = 1e-30  # an exponent at or below this is zero: a product with e^-87 is denormal, and a
# matmul over denormals runs ~25x slower on CPU (a near-greedy step's soft embedding, a peaked
# attention row); what is dropped is < 1e-30 of a row's mass per entry


def _no_denormals(t: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.threshold_(t, TINY_EXP, 0.0)
# Attention kernel calls made by eager decoder forwards (tests count them per step).
KERNEL_CALLS = [0]


class PagedKV:
    """One layer's context for a decoder pass: the pool's K/V pages (num_pages, kv_heads,
    ATTN_BLOCK, d), each row's block table (B, blocks; 0 = the null page) and, per row, the
    position of its first block and its valid positions [lo, hi) (B,)."""

    def __init__(self, k_pages, v_pages, table, base, lo, hi):
        self.k_pages, self.v_pages, self.table, self.base, self.lo, self.hi = k_pages, v_pages, table, base, lo, hi


class FastSpec:
    """Per layer index: its ``PagedKV``."""

    def __init__(self, layers: dict[int, PagedKV]):
        self.layers = layers


class EncodeSpec:
    """Rows of a batched encoder pass: queries are left-padded to the longest row."""

    def __init__(self, caches: list, lengths: list[int], masks: list[dict]):
        self.caches, self.lengths, self.masks = caches, lengths, masks
        self.kv: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}


class EncodeCacheView:
    """Passed as ``past_key_values`` to a batched encoder pass: each row's new K/V go into its
    own cache (exactly the ``update`` a lone sequence makes); attention reads them back per row."""

    is_compileable = False

    def __init__(self, spec: EncodeSpec):
        self.spec = spec

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        total = key_states.shape[2]
        self.spec.kv[layer_idx] = [
            cache.update(key_states[b:b + 1, :, total - n:], value_states[b:b + 1, :, total - n:], layer_idx)
            for b, (cache, n) in enumerate(zip(self.spec.caches, self.spec.lengths, strict=True))]
        return key_states, value_states


_registered = False


def tandem_attention(module, query, key, value, attention_mask, **kwargs):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    enc = ENCODE.get()
    if enc is not None:
        total = query.shape[2]
        outs = []
        for b, n in enumerate(enc.lengths):
            k, v = enc.kv[module.layer_idx][b]
            mask = enc.masks[b][module.layer_type]
            out = sdpa_attention_forward(module, query[b:b + 1, :, total - n:], k, v, mask, **kwargs)[0]
            outs.append(torch.nn.functional.pad(out, (0, 0, 0, 0, total - n, 0)))  # back to the left-padded length
        return torch.cat(outs, dim=0), None
    fast = FAST.get()
    if fast is not None:
        if not torch.compiler.is_compiling():  # a compiled trunk would guard on the count: not counted
            KERNEL_CALLS[0] += 1
        return blocked_attention(query, key, value, fast.layers[module.layer_idx], module.scaling), None
    if not module.is_causal:  # a decoder pass (exact mode: one row)
        KERNEL_CALLS[0] += 1
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


def blocked_attention(query, canvas_k, canvas_v, ctx: PagedKV, scaling):
    """query (B, H, C, d) over [canvas | each row's context, read in place from the pool];
    returns (B, C, H, d) as SDPA's wrapper does. Online softmax over the canvas block, then
    ATTN_BLOCK-sized context blocks (one page per row per step)."""
    B, H, C, d = query.shape
    kvh = canvas_k.shape[1]
    q = query.reshape(B, kvh, (H // kvh) * C, d)  # grouped-query heads share their K/V head
    if scaling != 1.0:
        q = q * scaling
    scores = torch.matmul(q, canvas_k.transpose(-1, -2))
    m = scores.amax(-1)
    p = _no_denormals(torch.exp((scores - m[..., None]).clamp_(min=MIN_EXPONENT)))
    denom = p.sum(-1)
    acc = torch.matmul(p, canvas_v)
    offsets = torch.arange(ATTN_BLOCK, device=q.device)
    for j in range(ctx.table.shape[1]):
        pages = ctx.table[:, j]
        k = ctx.k_pages.index_select(0, pages)  # (B, kvh, ATTN_BLOCK, d)
        v = ctx.v_pages.index_select(0, pages)
        s = torch.matmul(q, k.transpose(-1, -2))
        pos = (ctx.base + j * ATTN_BLOCK)[:, None] + offsets[None, :]
        masked = ((pos < ctx.lo[:, None]) | (pos >= ctx.hi[:, None]))[:, None, None, :]
        s.masked_fill_(masked, float("-inf"))
        m_new = torch.maximum(m, s.amax(-1))
        corr = _no_denormals(torch.exp(m - m_new))  # exactly 1 for a row whose block is all masked
        p = _no_denormals(torch.exp((s - m_new[..., None]).clamp_(min=MIN_EXPONENT)).masked_fill_(masked, 0.0))
        denom = denom * corr + p.sum(-1)
        acc = acc * corr[..., None] + torch.matmul(p, v)
        m = m_new
    out = (acc / denom[..., None]).reshape(B, H, C, d)
    return out.transpose(1, 2).contiguous()


def register() -> None:
    global _registered
    if not _registered:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

        AttentionInterface.register(ATTN_NAME, tandem_attention)
        # Encoder passes must get exactly the masks SDPA gets (mask creation is chosen by name).
        AttentionMaskInterface.register(ATTN_NAME, sdpa_mask)
        _registered = True
