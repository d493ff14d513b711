"""Memory accounting for admission: what one sequence may take at most, and the engine's budget.

Pure Python (no torch): the scheduler admits a sequence only while the sum of its running
sequences' reservations stays within the budget, so a flood of long prompts waits instead of
running the replica out of memory.

A sequence's reservation covers its whole life, computed from the model's shape:
- its KV cache at its longest (prompt + max_tokens + one canvas, per layer; a sliding layer
  holds at most ``window`` tokens) in whole ``PAGE_TOKENS`` pages (the fast mode's page pool;
  the exact mode's ``DynamicCache`` holds no more), plus one layer's history read back while
  the encoder attends (``DynamicLayer``'s ``cat``, or the page pool's gather): both modes read
  the cache in place otherwise, there is no padded copy;
- its state held between steps (canvas, self-conditioning soft embedding, stability history);
- its share of the decoder trunk's activations (a few canvas x hidden tensors, attention scores
  over its keys).
The vocab-wide part of a step runs a bounded number of rows at a time, so its transient
(``VOCAB_UNITS`` canvas x vocab float32 tensors per row in flight) is a fixed cost taken off the
budget once, not per sequence.
"""

from __future__ import annotations

from dataclasses import dataclass

GIB = 1 << 30
SAFETY_FRACTION = 0.8  # of the memory free at engine start (after the weights are loaded)
# Canvas x vocab float32 tensors alive at once per row in the vocab-wide part of a step, with a
# margin (exact: 3 in its in-place sampler, 4 with logprobs; measured 0.93 GiB peak growth at
# the real shape, batch 1).
VOCAB_UNITS = {"exact": 5, "fast": 4}
PAGE_TOKENS = 256  # tokens per KV page (= attention.ATTN_BLOCK, the kernel's key block)


@dataclass(frozen=True)
class MemoryShape:
    canvas_length: int
    vocab_size: int
    hidden_size: int
    itemsize: int  # bytes per activation / cache element
    layers: tuple[tuple[int, int | None], ...]  # per layer: (kv heads x head dim, window or None)
    num_heads: int = 8  # attention heads (scores per query)


def kv_bytes(shape: MemoryShape, tokens: int) -> int:
    return sum(2 * width * shape.itemsize * (min(tokens, window) if window else tokens)
               for width, window in shape.layers)


def _pages(tokens: int, window: int | None) -> int:
    """Pages one layer of a sequence holds at most: a sliding layer keeps ``window`` tokens, which
    straddle one more page than they fill."""
    pages = -(-tokens // PAGE_TOKENS)
    return min(pages, -(-window // PAGE_TOKENS) + 1) if window else pages


def page_bytes(shape: MemoryShape, width: int) -> int:
    return 2 * width * shape.itemsize * PAGE_TOKENS


def kv_page_bytes(shape: MemoryShape, tokens: int) -> int:
    """A sequence's KV in whole pages."""
    return sum(_pages(tokens, window) * page_bytes(shape, width) for width, window in shape.layers)


def pool_pages(shape: MemoryShape, budget_bytes: int, lazy: bool = True) -> int:
    """Pages per layer of the fast mode's pool (+ the null page).

    ``lazy`` (host memory, committed page by page as written): enough for every set of sequences
    that fits ``budget_bytes``: each holds as many pages in every full-attention layer (and no
    more in a sliding one) and its reservation counts them all, so the full layers' pages bound
    every layer's. Otherwise (a device, where the pool is reserved at once): the pool's bytes
    stay within the budget (every layer gets the same count), which the full layers could
    outgrow only if sequences whose reservations are mostly KV filled the whole budget."""
    full = [width for width, window in shape.layers if not window] or [w for w, _ in shape.layers]
    widths = full if lazy else [w for w, _ in shape.layers]
    return budget_bytes // sum(page_bytes(shape, width) for width in widths) + 1


def sequence_bytes(shape: MemoryShape, prompt_tokens: int, max_tokens: int) -> int:
    """The most one sequence holds at once, from admission to retirement."""
    C, H = shape.canvas_length, shape.hidden_size
    tokens = prompt_tokens + max_tokens + C
    history = max(2 * width * shape.itemsize * (min(tokens, window) if window else tokens)
                  for width, window in shape.layers)
    kv = kv_page_bytes(shape, tokens) + history
    state = C * (H * shape.itemsize + 8 * 4)  # soft embedding, canvas / argmax / history ids
    activations = C * shape.itemsize * 16 * H + 4 * C * shape.num_heads * min(tokens, 4 * C)
    # The encoder's prompt pass: activations over the whole prompt, once.
    prefill = prompt_tokens * shape.itemsize * 16 * H
    return kv + state + activations + prefill


def step_transient_bytes(shape: MemoryShape, sampler: str, chunk_rows: int) -> int:
    """The vocab-wide part of one step: fixed, whatever the batch."""
    return VOCAB_UNITS[sampler] * chunk_rows * shape.canvas_length * shape.vocab_size * 4


@dataclass
class MemoryBudget:
    """The scheduler's view: bytes available to sequences, and each one's reservation."""

    shape: MemoryShape
    budget_bytes: int

    def need(self, prompt_tokens: int, max_tokens: int) -> int:
        return sequence_bytes(self.shape, prompt_tokens, max_tokens)

    def max_prompt_tokens(self, max_tokens: int) -> int:
        """The longest prompt that fits alone with this max_tokens (0 if none does)."""
        lo, hi = 0, 1
        while self.need(hi, max_tokens) <= self.budget_bytes and hi < 1 << 40:
            hi *= 2
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.need(mid, max_tokens) <= self.budget_bytes:
                lo = mid
            else:
                hi = mid - 1
        return lo


def default_budget_bytes(free_bytes: int, transient_bytes: int) -> int:
    """SAFETY_FRACTION of the memory free at start, less the fixed per-step transient."""
    return max(0, int(free_bytes * SAFETY_FRACTION) - transient_bytes)


def host_available_bytes() -> int:
    """MemAvailable from /proc/meminfo (Linux); 0 when unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0
