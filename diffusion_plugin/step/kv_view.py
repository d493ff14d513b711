"""The fast mode's KV store: one page pool per layer, written in place, read in place.

Each layer has a pool of pages (``num_pages, kv_heads, ATTN_BLOCK, head_dim``) for keys and one
for values; page 0 is the null page (zeros, never handed out). A sequence's cache
(``paged_cache``) is a transformers ``DynamicCache`` whose layers write the tokens the encoder
commits into the sequence's own pages (a page covers positions ``[p*ATTN_BLOCK, (p+1)*ATTN_BLOCK)``
of that sequence) and return what a ``DynamicLayer`` / ``DynamicSlidingWindowLayer`` returns
(history + new tokens, the same values), so the encoder's masks and attention are unchanged. A
sliding layer gives back the pages wholly before its window, before it takes new ones (the
history it returns was read first), and never writes tokens that fall before its window: a
sequence holds at most ``memory._pages(window)`` pages of a sliding layer at any moment, a long
prompt's pass included. Retiring a sequence gives its pages back; a page is zeroed when handed
out, so every page a kernel reads holds finite values.

The decoder reads the pool in place (``attention.blocked_attention``), one key block per kernel
step through each row's block table, with each row's valid positions: nothing is copied when a
row joins or leaves; per batch only the block tables (a few ints per row) are rebuilt.

The pool is allocated once, at its full size, with ``torch.empty``: on the host the kernel
commits its memory page by page as it is written (RSS grows with the KV in use, not with the
pool's size); on a device it is reserved at start, as vLLM reserves its KV cache, with a page
count per layer group (``memory.plan_pool``: full-attention layers, and sliding layers, which
never get more than ``max_batch`` windows' pages) that the scheduler admits against. The exact
mode needs none of this: each row keeps HF's own ``DynamicCache``, as ``generate()`` does.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer, DynamicSlidingWindowLayer

from diffusion_plugin.batcher.memory import host_available_bytes
from diffusion_plugin.step.attention import ATTN_BLOCK, FastSpec, PagedKV
from diffusion_plugin.step.prefix_cache import PageCache
from diffusion_plugin.step.staging import stage


class KVPool:
    """Per layer: K and V pages and a free list. ``layers``: per layer (kv_heads, head_dim);
    ``num_pages``: per layer (with the null page), or one count for every layer."""

    def __init__(self, layers: list[tuple[int, int]], num_pages: int | list[int], dtype: torch.dtype, device):
        counts = [num_pages] * len(layers) if isinstance(num_pages, int) else list(num_pages)
        if len(counts) != len(layers):
            raise ValueError(f"{len(counts)} page counts for {len(layers)} layers")
        if min(counts) < 2:
            raise ValueError("the KV pool needs at least 2 pages per layer (page 0 is the null page)")
        self.num_pages = counts
        self.k = [torch.empty((n, h, ATTN_BLOCK, d), dtype=dtype, device=device)
                  for n, (h, d) in zip(counts, layers, strict=True)]
        self.v = [torch.empty_like(k) for k in self.k]
        for t in (*self.k, *self.v):
            t[0].zero_()
        self.free = [list(range(n - 1, 0, -1)) for n in counts]
        self.cache = PageCache(len(layers))  # references, and the prompt pages kept for reuse

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.k, *self.v))

    def take(self, layer: int) -> int:
        """A zeroed page for one writer: a free one, else the least recently released cached one
        (a cached page never makes admission wait: its memory is taken back here)."""
        page = self.free[layer].pop() if self.free[layer] else self.cache.evict(layer)
        if page is None:
            raise MemoryError(f"KV pool of layer {layer} exhausted ({self.num_pages[layer]} pages): admission should "
                              "have prevented this; this is a bug")
        self.k[layer][page].zero_()
        self.v[layer][page].zero_()
        self.cache.ref(layer, page)
        return page

    def adopt(self, layer: int, page: int) -> int:
        """A cached page shared with one more sequence (read only: it is whole)."""
        self.cache.ref(layer, page)
        return page

    def give(self, layer: int, pages: list[int]) -> None:
        """One reference to each page dropped; a page nobody holds is free again, or kept for
        reuse while a prompt key names it."""
        self.free[layer].extend(p for p in reversed(pages) if self.cache.unref(layer, p))

    def reset_cache(self) -> int:
        """Every cached page no sequence holds, freed (vLLM's ``/reset_prefix_cache``): how many."""
        freed = 0
        for layer in range(len(self.k)):
            pages = self.cache.clear(layer)
            self.free[layer].extend(pages)
            freed += len(pages)
        return freed

    def pages_in_use(self, layer: int) -> int:
        """Pages sequences hold (cached pages nobody holds are not in use: they are reclaimable)."""
        return self.num_pages[layer] - 1 - len(self.free[layer]) - len(self.cache.lru[layer])


class _Paged:
    """What both paged layers share: this sequence's pages of one layer's pool."""

    def _bind(self, pool: KVPool, layer: int, window: int | None) -> None:
        self.pool, self.layer, self.window = pool, layer, window
        self.pages: list[int] = []  # physical pages of logical pages first_page, first_page + 1, ...
        self.first_page = 0
        self.length = 0  # tokens written
        self.is_initialized = True

    def adopt(self, pages: list[int], first_page: int, length: int) -> None:
        """Start from cached pages: logical pages ``first_page``.. (shared, whole) holding
        positions up to ``length`` (a page boundary), as if this sequence had written them."""
        self.pages = [self.pool.adopt(self.layer, p) for p in pages]
        self.first_page, self.length = first_page, length
        if self.window is not None:
            self.cumulative_length = length

    def page_at(self, logical: int) -> int | None:
        """The physical page of logical page ``logical``, if this layer holds it."""
        i = logical - self.first_page
        return self.pages[i] if 0 <= i < len(self.pages) else None

    def needed_pages(self, length: int) -> range:
        """The logical pages a position ``length`` reads (its window's, for a sliding layer)."""
        return range(self.visible_from(length) // ATTN_BLOCK if length else 0, -(-length // ATTN_BLOCK))

    def visible_from(self, length: int) -> int:
        """The first position this layer's cache holds once ``length`` tokens are written."""
        return 0 if self.window is None else max(0, length - (self.window - 1))

    def _write(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """keys/values (1, kv_heads, n, d) at positions [length, length + n). A sliding layer
        first gives back the pages wholly before its window once they are written (read by
        ``update`` already), then skips the tokens that fall on those pages."""
        end = self.length + keys.shape[2]
        if self.window is not None:
            self._drop_before(self.visible_from(end))
        pos = max(self.length, self.first_page * ATTN_BLOCK)
        while pos < end:
            logical, offset = divmod(pos, ATTN_BLOCK)
            while self.first_page + len(self.pages) <= logical:
                self.pages.append(self.pool.take(self.layer))
            page = self.pages[logical - self.first_page]
            n = min(end - pos, ATTN_BLOCK - offset)
            src = slice(pos - self.length, pos - self.length + n)
            self.pool.k[self.layer][page, :, offset:offset + n] = keys[0, :, src]
            self.pool.v[self.layer][page, :, offset:offset + n] = values[0, :, src]
            pos += n

    def _read(self, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This sequence's positions [start, end) as (1, kv_heads, end - start, d) (a copy: the
        encoder's SDPA over its own history, as ``DynamicLayer.update``'s ``cat`` copies it)."""
        lo, hi = start // ATTN_BLOCK, -(-end // ATTN_BLOCK)
        ids = stage(self.pool.k[self.layer].device,
                    ids=(torch.long, self.pages[lo - self.first_page:hi - self.first_page]))["ids"]
        out = []
        for pool in (self.pool.k[self.layer], self.pool.v[self.layer]):
            blocks = pool.index_select(0, ids)  # (pages, h, ATTN_BLOCK, d)
            flat = blocks.transpose(0, 1).reshape(1, blocks.shape[1], -1, blocks.shape[3])
            out.append(flat[:, :, start - lo * ATTN_BLOCK:end - lo * ATTN_BLOCK])
        return out[0], out[1]

    def update(self, key_states, value_states, *args, **kwargs):
        start = self.length
        history_from = self.visible_from(start)
        history = self._read(history_from, start) if history_from < start else None
        self._write(key_states, value_states)
        self.length += key_states.shape[2]
        self._after_write()
        if history is None:
            return key_states.contiguous(), value_states.contiguous()
        return torch.cat([history[0], key_states], dim=-2), torch.cat([history[1], value_states], dim=-2)

    def _after_write(self) -> None:
        if self.window is None:
            return
        self.cumulative_length = self.length  # what DynamicSlidingWindowLayer's mask sizes read
        self._drop_before(self.visible_from(self.length))

    def _drop_before(self, position: int) -> None:
        """Give back the pages wholly before ``position`` (possibly more than are held: the
        pages a long write skips are never taken)."""
        drop = position // ATTN_BLOCK - self.first_page
        if drop > 0:
            self.pool.give(self.layer, self.pages[:drop])
            self.pages, self.first_page = self.pages[drop:], self.first_page + drop

    def release(self) -> None:
        self.pool.give(self.layer, self.pages)
        self.pages = []

    def get_seq_length(self) -> int:
        return self.length


class PagedLayer(_Paged, DynamicLayer):
    pass


class PagedSlidingLayer(_Paged, DynamicSlidingWindowLayer):
    pass


def paged_cache(config, pool: KVPool) -> DynamicCache:
    """A sequence's cache: HF's ``DynamicCache`` for ``config`` with its layers paged in ``pool``."""
    cache = DynamicCache(config=config)
    layers = []
    for i, layer in enumerate(cache.layers):
        if isinstance(layer, DynamicSlidingWindowLayer):
            paged = PagedSlidingLayer(sliding_window=layer.sliding_window)
            paged._bind(pool, i, layer.sliding_window)
        else:
            paged = PagedLayer()
            paged._bind(pool, i, None)
        layers.append(paged)
    cache.layers = layers
    return cache


def free_bytes(device: torch.device) -> int:
    """Memory free for a pool on ``device`` now."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    return host_available_bytes()


def release(cache) -> None:
    for layer in cache.layers:
        layer.release()


class LayerView:
    def __init__(self, keys: torch.Tensor, values: torch.Tensor):
        self.keys, self.values = keys, values


class CacheView:
    """What the decoder reads as ``past_key_values``: ``layers[i].keys/values``, empty (the
    decoder's own concat then yields the canvas keys only; the context comes from the pool)."""

    is_compileable = False

    def __init__(self, layers: list[LayerView]):
        self.layers = layers


def bucket_width(pages: int) -> int:
    """A block table's width padded to the next power of two (the extra pages: the null page,
    fully masked: they add exact zeros)."""
    return 1 << max(0, pages - 1).bit_length()


class FastViews:
    """The decoder's per-batch metadata (block tables, valid ranges), rebuilt when the batch or a
    row's cache changes (in block mode: at block boundaries). Never a copy of K/V."""

    def __init__(self, bucket: bool = False):
        """``bucket``: a table is as wide as its longest row's pages padded to a power of two
        (``bucket_width``; the compiled trunk's few graphs per size class); else that many pages."""
        self._key: tuple | None = None
        self._spec: tuple[CacheView, FastSpec] | None = None
        self._bucket = bucket

    def reset(self) -> None:
        self._key, self._spec = None, None

    def get(self, ids: list[str], versions: list[int], caches: list):
        key = (tuple(ids), tuple(versions))
        if self._key != key:
            self._key, self._spec = key, self._build(caches)
        return self._spec

    def _build(self, caches: list):
        """Every layer's block table and ranges, onto the device in one copy (``staging``)."""
        arrays = {}
        for i in range(len(caches[0].layers)):
            rows = [c.layers[i] for c in caches]
            width = max(len(r.pages) for r in rows)
            width = bucket_width(width) if self._bucket else width
            arrays[f"table{i}"] = (torch.long, [r.pages + [0] * (width - len(r.pages)) for r in rows])
            arrays[f"ranges{i}"] = (torch.long, [[r.first_page * ATTN_BLOCK, r.visible_from(r.length), r.length]
                                                 for r in rows])
        staged = stage(caches[0].layers[0].pool.k[0].device, **arrays)
        layers, empty = {}, []
        for i, first in enumerate(caches[0].layers):
            ranges = staged[f"ranges{i}"]
            layers[i] = PagedKV(first.pool.k[i], first.pool.v[i], staged[f"table{i}"], ranges[:, 0], ranges[:, 1],
                                ranges[:, 2])
            h, d = first.pool.k[i].shape[1], first.pool.k[i].shape[3]
            shape = (len(caches), h, 0, d)
            empty.append(LayerView(first.pool.k[i].new_zeros(shape), first.pool.v[i].new_zeros(shape)))
        return CacheView(empty), FastSpec(layers)
