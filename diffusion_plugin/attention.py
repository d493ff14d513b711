"""Attention for batched passes over sequences of different lengths.

Encoder passes (``ENCODE``, fast mode's batched prefills and commits): each row's new K/V go
to its own cache and each row attends with the very SDPA call and mask a lone sequence makes.

Decoder passes in fast mode (``FAST``): ONE call per layer for the whole batch. The decoder sees
only the canvas keys (an empty cache view), and each row's context K/V comes from a right-padded
view whose length is a multiple of ``ATTN_BLOCK``. Attention runs blockwise with an online
softmax: the canvas block first, then the context blocks. Padded SDPA is not batch-invariant
(its result moves by ~1e-7 with the padded length, i.e. with the longest batch mate), but here a
row's blocks are laid out by its own length only, and the blocks beyond it are fully masked,
which adds exact zeros: a row's attention output does not depend on its batch mates.
(On a GPU a varlen kernel reading a paged cache in place is the better answer.)

Outside both (the exact mode's per-row passes) this is plain SDPA, as in generate().
"""

from __future__ import annotations

from contextvars import ContextVar

import torch

ATTN_NAME = "tandem_rowwise"
# Batched encoder passes: per row, its own K/V (written to its own cache) and its own mask.
ENCODE: ContextVar[EncodeSpec | None] = ContextVar("tandem_encode", default=None)
FAST: ContextVar[FastSpec | None] = ContextVar("tandem_fast", default=None)
ATTN_BLOCK = 256
# exp() of anything below this is a float32 denormal, and a matmul over denormals runs ~60x
# slower on CPU; exponents are clamped here (fast mode only). A clamped masked key adds at most
# exp(-87) ~ 1.6e-38 to a denominator >= 1 (absorbed exactly) and 0 x 0 (zero padding) to the sum.
MIN_EXPONENT = -87.0
# Attention kernel calls made by decoder forwards (tests count them per step).
KERNEL_CALLS = [0]


class FastSpec:
    """Per layer: the rows' context K/V right-padded to a multiple of ATTN_BLOCK (zeros beyond
    each row), and each row's valid context length (B,)."""

    def __init__(self, kv: dict[int, tuple[torch.Tensor, torch.Tensor]], valid: dict[int, torch.Tensor]):
        self.kv, self.valid = kv, valid


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
        KERNEL_CALLS[0] += 1
        k, v = fast.kv[module.layer_idx]
        return blocked_attention(query, key, value, k, v, fast.valid[module.layer_idx], module.scaling), None
    if not module.is_causal:  # a decoder pass (exact mode: one row)
        KERNEL_CALLS[0] += 1
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


def blocked_attention(query, canvas_k, canvas_v, ctx_k, ctx_v, valid, scaling):
    """query (B, H, C, d) over [canvas | each row's context]; returns (B, C, H, d) as SDPA's
    wrapper does. Online softmax over the canvas block, then ATTN_BLOCK-sized context blocks."""
    B, H, C, d = query.shape
    kvh = canvas_k.shape[1]
    q = query.reshape(B, kvh, (H // kvh) * C, d)  # grouped-query heads share their K/V head
    if scaling != 1.0:
        q = q * scaling
    scores = torch.matmul(q, canvas_k.transpose(-1, -2))
    m = scores.amax(-1)
    p = torch.exp((scores - m[..., None]).clamp_(min=MIN_EXPONENT))
    denom = p.sum(-1)
    acc = torch.matmul(p, canvas_v)
    for j in range(0, ctx_k.shape[2], ATTN_BLOCK):
        s = torch.matmul(q, ctx_k[:, :, j:j + ATTN_BLOCK].transpose(-1, -2))
        pos = torch.arange(j, j + ATTN_BLOCK, device=s.device)
        s.masked_fill_((pos[None, :] >= valid[:, None])[:, None, None, :], float("-inf"))
        m_new = torch.maximum(m, s.amax(-1))
        corr = torch.exp(m - m_new)  # exactly 1 for a row whose block is all padding
        p = torch.exp((s - m_new[..., None]).clamp_(min=MIN_EXPONENT))
        denom = denom * corr + p.sum(-1)
        acc = acc * corr[..., None] + torch.matmul(p, ctx_v[:, :, j:j + ATTN_BLOCK])
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
