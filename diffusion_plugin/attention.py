"""Row-wise attention for batched decoder forwards over sequences of different lengths.

Padded SDPA over rows of different cache lengths drifts by ~1e-6 in the logits on padded rows,
enough to flip a near-tie. Instead each row attends over its own valid keys only, with the very
SDPA call a lone sequence makes, so a row's logits do not depend on its batch mates. The runner
sets ``ROWS`` (valid key counts per layer, keys left-padded) around a batched decoder forward;
outside it (encoder passes) this is plain SDPA.
"""

from __future__ import annotations

from contextvars import ContextVar

import torch

ATTN_NAME = "tandem_rowwise"
ROWS: ContextVar[dict[int, list[int]] | None] = ContextVar("tandem_rows", default=None)
# Batched encoder passes: per row, its own K/V (written to its own cache) and its own mask.
ENCODE: ContextVar[EncodeSpec | None] = ContextVar("tandem_encode", default=None)


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


def rowwise_attention(module, query, key, value, attention_mask, **kwargs):
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
    spec = ROWS.get()
    if spec is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    lengths = spec[module.layer_idx]
    total = key.shape[2]
    outs = [sdpa_attention_forward(module, query[b:b + 1], key[b:b + 1, :, total - n:], value[b:b + 1, :, total - n:],
                                   None, **kwargs)[0] for b, n in enumerate(lengths)]
    return torch.cat(outs, dim=0), None


def register() -> None:
    global _registered
    if not _registered:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

        AttentionInterface.register(ATTN_NAME, rowwise_attention)
        # Encoder passes must get exactly the masks SDPA gets (mask creation is chosen by name).
        AttentionMaskInterface.register(ATTN_NAME, sdpa_mask)
        _registered = True
