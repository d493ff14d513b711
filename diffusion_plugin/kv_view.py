"""What the fast mode's batched decoder forward reads of the rows' KV caches (never written).

The decoder gets an empty cache view (so its own concat yields the canvas keys only), and
``attention.blocked_attention`` reads the rows' context from a right-padded K/V whose length is
a multiple of ``ATTN_BLOCK`` (batch invariance, one call per layer). (The exact mode needs no
view: each row's decoder pass reads its own cache, as generate() does.)
"""

from __future__ import annotations

import torch

from diffusion_plugin.attention import ATTN_BLOCK, FastSpec


class LayerView:
    def __init__(self, keys: torch.Tensor, values: torch.Tensor):
        self.keys, self.values = keys, values


class CacheView:
    """What the decoder reads as ``past_key_values``: ``layers[i].keys/values``."""

    is_compileable = False

    def __init__(self, layers: list[LayerView]):
        self.layers = layers


def _pad(tensors: list[torch.Tensor], length: int) -> torch.Tensor:
    """Right-padded with zeros (finite: a masked key's weight is exactly 0, and 0 * 0 adds 0)."""
    out = tensors[0].new_zeros((len(tensors), tensors[0].shape[1], length, tensors[0].shape[3]))
    for b, t in enumerate(tensors):
        out[b, :, :t.shape[2]] = t[0]
    return out


class FastViews:
    """Right-padded, block-aligned context K/V keyed by (rows, cache versions); rebuilt when the
    batch changes (in block mode: at block boundaries, when every cache has changed anyway)."""

    def __init__(self):
        self._key: tuple | None = None
        self._spec: tuple[CacheView, FastSpec] | None = None

    def reset(self) -> None:
        self._key, self._spec = None, None

    def get(self, ids: list[str], versions: list[int], caches: list):
        key = (tuple(ids), tuple(versions))
        if self._key != key:
            self._key, self._spec = key, self._build(caches)
        return self._spec

    @staticmethod
    def _build(caches: list):
        kv, valid, empty = {}, {}, []
        for i in range(len(caches[0].layers)):
            ks = [c.layers[i].keys for c in caches]
            vs = [c.layers[i].values for c in caches]
            longest = max(k.shape[2] for k in ks)
            length = -(-longest // ATTN_BLOCK) * ATTN_BLOCK
            kv[i] = (_pad(ks, length), _pad(vs, length))
            valid[i] = torch.tensor([k.shape[2] for k in ks], device=ks[0].device)
            shape = (len(caches), ks[0].shape[1], 0, ks[0].shape[3])
            empty.append(LayerView(ks[0].new_zeros(shape), vs[0].new_zeros(shape)))
        return CacheView(empty), FastSpec(kv, valid)
