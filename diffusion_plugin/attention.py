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
_registered = False


def rowwise_attention(module, query, key, value, attention_mask, **kwargs):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

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
