"""What the batched decoder forward reads of the rows' KV caches (never written).

- Exact mode: a left-padded K/V per layer over the rows' caches (built once per block, sliced
  as rows leave), read row by row by ``attention.rowwise_attention`` (bit-exactness).
- Fast mode: the decoder gets an empty cache view (so its own concat yields the canvas keys
  only), and ``attention.blocked_attention`` reads the rows' context from a right-padded K/V
  whose length is a multiple of ``ATTN_BLOCK`` (batch invariance, one call per layer).
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


def _pad(tensors: list[torch.Tensor], length: int, left: bool) -> torch.Tensor:
    out = tensors[0].new_zeros((len(tensors), tensors[0].shape[1], length, tensors[0].shape[3]))
    for b, t in enumerate(tensors):
        n = t.shape[2]
        if left:
            out[b, :, length - n:] = t[0]
        else:
            out[b, :, :n] = t[0]
    return out


class ExactViews:
    """Left-padded views keyed by (rows, cache versions); a departure slices the last one."""

    def __init__(self, canvas_length: int):
        self.C = canvas_length
        self._key: tuple | None = None
        self._view: tuple[CacheView, dict[int, list[int]]] | None = None

    def reset(self) -> None:
        self._key, self._view = None, None

    def get(self, ids: list[str], versions: list[int], caches: list):
        key = (tuple(ids), tuple(versions))
        if self._key == key:
            return self._view
        old = dict(zip(*self._key, strict=True)) if self._key is not None else {}
        if self._key is not None and all(old.get(s) == v for s, v in zip(*key, strict=True)):
            view = self._slice(key)
        else:
            view = self._build(caches)
        self._key, self._view = key, view
        return view

    def _slice(self, key):
        old_ids = list(self._key[0])
        index = torch.tensor([old_ids.index(s) for s in key[0]])
        view, lengths = self._view
        new_lengths = {i: [lengths[i][j] for j in index.tolist()] for i in lengths}
        layers = []
        for i, layer in enumerate(view.layers):
            keys, values = layer.keys.index_select(0, index), layer.values.index_select(0, index)
            need = max(new_lengths[i]) - self.C  # trim the left padding no row needs
            layers.append(LayerView(keys[:, :, keys.shape[2] - need:], values[:, :, values.shape[2] - need:]))
        return CacheView(layers), new_lengths

    def _build(self, caches: list):
        layers, lengths = [], {}
        for i in range(len(caches[0].layers)):
            ks = [c.layers[i].keys for c in caches]
            vs = [c.layers[i].values for c in caches]
            longest = max(k.shape[2] for k in ks)
            layers.append(LayerView(_pad(ks, longest, True), _pad(vs, longest, True)))
            lengths[i] = [k.shape[2] + self.C for k in ks]
        return CacheView(layers), lengths


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
            kv[i] = (_pad(ks, length, False), _pad(vs, length, False))
            valid[i] = torch.tensor([k.shape[2] for k in ks], device=ks[0].device)
            shape = (len(caches), ks[0].shape[1], 0, ks[0].shape[3])
            empty.append(LayerView(ks[0].new_zeros(shape), vs[0].new_zeros(shape)))
        return CacheView(empty), FastSpec(kv, valid)
