"""The fast mode's prompt prefix cache: which KV pages hold which prompt prefix.

A prompt's whole pages (``PAGE_TOKENS`` tokens each, from position 0) are keyed by a chained
hash: page i's key hashes page i-1's key and the page's token ids, and the chain starts from the
request's ``cache_salt``, so two keys are equal only for equal prefixes under the same salt (a
different salt shares nothing, as vLLM defines it).

``PageCache`` is the pool's bookkeeping (``kv_view.KVPool`` owns it; pure Python): per layer,
each page's references (a page adopted by several sequences is shared, never copied), the key a
page was registered under, and the pages no sequence references that a key still names, least
recently released first: they stay until their memory is needed (``evict``: the pool takes from
its free list first). A sliding-window layer registers the pages it still holds when a page of
the prompt is complete; a hit needs, for each layer, the pages the new sequence's first token
would read (all earlier pages for a full-attention layer, its window's for a sliding one).

Why a hit never changes a response: a prompt is encoded in page-aligned chunks (``chunks``) of a
fixed shape whether or not its prefix was cached, so a page's K/V depend only on the tokens up to
its end, and a sequence that adopts cached pages reads exactly the values it would have written.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Callable

from diffusion_plugin.batcher.memory import PAGE_TOKENS


def page_keys(tokens: list[int], salt: str | None = None, page: int = PAGE_TOKENS) -> list[bytes]:
    """The chained keys of the prompt's whole pages (a partial last page has none)."""
    prev = hashlib.sha256(b"tandem-prefix\0" + (salt or "").encode()).digest()
    keys = []
    for i in range(len(tokens) // page):
        h = hashlib.sha256(prev)
        h.update(array("q", tokens[i * page:(i + 1) * page]).tobytes())
        prev = h.digest()
        keys.append(prev)
    return keys


def chunks(start: int, end: int, page: int = PAGE_TOKENS) -> list[tuple[int, int]]:
    """[start, end) cut at page boundaries: the prompt pass's fixed-shape chunks."""
    out, pos = [], start
    while pos < end:
        nxt = min(end, (pos // page + 1) * page)
        out.append((pos, nxt))
        pos = nxt
    return out


class PageCache:
    def __init__(self, num_layers: int):
        self.num_layers = num_layers
        self.refs: list[dict[int, int]] = [{} for _ in range(num_layers)]  # page -> references
        self.key_of: list[dict[int, bytes]] = [{} for _ in range(num_layers)]  # registered page -> key
        self.lru: list[OrderedDict[int, None]] = [OrderedDict() for _ in range(num_layers)]  # unreferenced
        self.pages: dict[bytes, list[int | None]] = {}  # key -> its page per layer (None: not kept)
        self.evictions = 0

    # -- references ----------------------------------------------------------------------
    def ref(self, layer: int, page: int) -> None:
        self.refs[layer][page] = self.refs[layer].get(page, 0) + 1
        self.lru[layer].pop(page, None)

    def unref(self, layer: int, page: int) -> bool:
        """One reference dropped; True when the page is free now (nobody references it and no
        key names it). A registered page goes to the LRU instead."""
        n = self.refs[layer][page] - 1
        if n:
            self.refs[layer][page] = n
            return False
        del self.refs[layer][page]
        if page in self.key_of[layer]:
            self.lru[layer][page] = None
            return False
        return True

    def evict(self, layer: int) -> int | None:
        """The least recently released cached page of ``layer``, unregistered (None: none)."""
        if not self.lru[layer]:
            return None
        page, _ = self.lru[layer].popitem(last=False)
        key = self.key_of[layer].pop(page)
        held = self.pages.get(key)
        if held is not None:
            held[layer] = None
            if all(p is None for p in held):
                del self.pages[key]
        self.evictions += 1
        return page

    def clear(self, layer: int) -> list[int]:
        """Every unreferenced cached page of ``layer``, unregistered: the pages to free."""
        out = []
        while self.lru[layer]:
            out.append(self.evict(layer))
        return out

    # -- keys ----------------------------------------------------------------------------
    def register(self, key: bytes, layer: int, page: int) -> None:
        """``page`` (referenced by its writer) holds ``key``'s page of ``layer`` (the first
        registration wins: a page computed twice at once is kept once)."""
        held = self.pages.setdefault(key, [None] * self.num_layers)
        if held[layer] is None and page not in self.key_of[layer]:
            held[layer] = page
            self.key_of[layer][page] = key

    def lookup(self, keys: list[bytes], needed: Callable[[int, int], range]) -> int:
        """The most leading pages of ``keys`` a new sequence can adopt: j such that, for each
        layer, every page in ``needed(layer, j)`` (the pages its position ``j * PAGE_TOKENS`` reads)
        is cached."""
        j = len(keys)
        while j > 0 and not all(self.pages.get(keys[i]) is not None and self.pages[keys[i]][layer] is not None
                                for layer in range(self.num_layers) for i in needed(layer, j)):
            j -= 1
        return j

    def page(self, key: bytes, layer: int) -> int:
        return self.pages[key][layer]

    def cached_pages(self) -> int:
        """Pages (all layers) no sequence references that a key still names."""
        return sum(len(lru) for lru in self.lru)
