"""What each replica probably has in its prefix cache, as one gateway process saw it.

``PrefixIndex`` keeps the block hashes (``gateway/request/prefix.py``) of the prompts routed to one
replica, least recently used first, up to ``max_blocks`` (memory bounded: ~100 bytes an entry). A
prompt's blocks are recorded last block first, so its first blocks are the most recent and the
last to be forgotten, as vLLM frees a finished request's blocks tail first. ``match`` counts the
leading blocks present.

Approximate by design: the index holds what this process routed, not what the engine kept (the
engine evicts under its own memory pressure; other gateway processes route there too).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

DEFAULT_INDEX_BLOCKS = 16384  # per replica when the engine does not say its KV capacity (~1M tokens, ~2 MB)


class PrefixIndex:
    """The block hashes routed to one replica's engine, least recently used first, at most
    ``max_blocks`` (``router.ModelPool`` keeps one per replica id and engine generation)."""

    def __init__(self, max_blocks: int = DEFAULT_INDEX_BLOCKS):
        if max_blocks < 1:
            raise ValueError("max_blocks must be at least 1")
        self.max_blocks = max_blocks
        self._blocks: OrderedDict[int, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._blocks)

    def match(self, blocks: Sequence[int]) -> int:
        """How many of ``blocks``' leading blocks this replica probably holds."""
        n = 0
        for h in blocks:
            if h not in self._blocks:
                break
            n += 1
        return n

    def insert(self, blocks: Sequence[int]) -> None:
        """Record a prompt routed here: its blocks become the most recent, its first block last
        of all; the least recently used blocks beyond ``max_blocks`` are forgotten."""
        d = self._blocks
        for h in reversed(blocks[:self.max_blocks]):
            if h in d:
                d.move_to_end(h)
            else:
                d[h] = None
        while len(d) > self.max_blocks:
            d.popitem(last=False)

    def clear(self) -> None:
        self._blocks.clear()
