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

Where the fast mode's page pool is reserved at once (a device), the budget is split in two
(``plan_pool``): the pool, as pages per layer group (full-attention layers; sliding layers of
each window), and the rest, which the sequences' other bytes (state, activations, prompt pass,
the encoder's history copy) are reserved against. A sequence then reserves its pages in each
group (what it may hold there at most) against that group's pages, and its other bytes against
the rest: the two are counted once each and never double-booked. On the host the pool commits
pages as they are written, so sequences reserve all their bytes against the whole budget.
"""

from __future__ import annotations

from dataclasses import dataclass

GIB = 1 << 30
SAFETY_FRACTION = 0.8  # of the memory free at engine start (after the weights are loaded)
# Canvas x vocab float32 tensors alive at once per row in the vocab-wide part of a step, with a
# margin (exact: 3 in its in-place sampler, 4 with logprobs; measured 0.93 GiB peak growth at
# the real shape, batch 1).
VOCAB_UNITS = {"exact": 5, "fast": 4}
DEVICE_CHUNK_ROWS = 4  # a device's fast vocabulary pass: rows per chunk (``chunk_rows``)
PAGE_TOKENS = 128  # tokens per KV page (= attention.ATTN_BLOCK, the kernel's key block) and the prefix
# cache's grain: each request recomputes the partial last page of a shared prompt (docs/benchmarks.md)
# Device, fast mode: the share of the budget the KV page pool takes by default (engine_args
# ``kv_cache_fraction`` overrides it), like vLLM's carve-out of gpu_memory_utilization. KV pages
# are this share of a sequence's reservation at the released model's layout (bf16) with a ~4k
# prompt, so a flood of those fills both parts together; 0.78 at 100 tokens, 0.28 at 16k (the
# prompt pass's activations grow faster than the KV).
KV_FRACTION = 0.5
# Device, fast mode: the longest sequence the page pool's split between layer groups is balanced
# for (``plan_pool``).
PLAN_TOKENS = 16_384


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
    """Pages per layer of the fast mode's pool (+ the null page), every layer the same count.

    ``lazy`` (host memory, committed page by page as written): enough for every set of sequences
    that fits ``budget_bytes``: each holds as many pages in every full-attention layer (and no
    more in a sliding one) and its reservation counts them all, so the full layers' pages bound
    every layer's. Otherwise: the pool's bytes stay within the budget; without admission by
    pages (``plan_pool``) the full layers can run out first, so only tests use it."""
    full = [width for width, window in shape.layers if not window] or [w for w, _ in shape.layers]
    widths = full if lazy else [w for w, _ in shape.layers]
    return budget_bytes // sum(page_bytes(shape, width) for width in widths) + 1


@dataclass(frozen=True)
class KVGroup:
    """Layers with one window (None: full attention): a sequence holds as many pages in each."""

    window: int | None
    layers: tuple[int, ...]  # layer indices
    page_bytes: int  # one page in every layer of the group
    pages: int = 0  # per layer, the null page excluded (0: not planned)

    def seq_pages(self, tokens: int) -> int:
        return _pages(tokens, self.window)

    @property
    def window_pages(self) -> int | None:
        """The most pages a sequence holds in one of its layers (None: unbounded, full attention)."""
        return _pages(1 << 62, self.window) if self.window else None


def layer_groups(shape: MemoryShape) -> tuple[KVGroup, ...]:
    """The shape's layers grouped by window, full attention first, then windows ascending."""
    by: dict[int | None, list[int]] = {}
    for i, (_width, window) in enumerate(shape.layers):
        by.setdefault(window or None, []).append(i)
    order = sorted(by, key=lambda w: (w is not None, w or 0))
    return tuple(KVGroup(w, tuple(by[w]), sum(page_bytes(shape, shape.layers[i][0]) for i in by[w])) for w in order)


def group_shares(shape: MemoryShape, long_tokens: int = PLAN_TOKENS) -> tuple[float, ...]:
    """Per group (``layer_groups``' order): the largest share of a sequence's KV page bytes the
    group takes at any length up to ``long_tokens``. Short sequences hold as many pages in every
    layer (the sliding layers' share peaks there, or where their window fills); long ones hold
    many pages in each full layer and ``_pages(window)`` in each sliding one (the full layers'
    share grows with the length)."""
    groups = layer_groups(shape)
    lengths = {1, long_tokens} | {min(long_tokens, PAGE_TOKENS * g.window_pages) for g in groups if g.window}
    top = [0.0] * len(groups)
    for tokens in lengths:
        held = [g.seq_pages(tokens) * g.page_bytes for g in groups]
        top = [max(t, h / sum(held)) for t, h in zip(top, held, strict=True)]
    return tuple(top)


def plan_pool(shape: MemoryShape, pool_bytes: int, max_batch: int | None = None,
              long_tokens: int = PLAN_TOKENS) -> tuple[KVGroup, ...]:
    """Pages per layer group for a pool reserved at once within ``pool_bytes``.

    The split is static while the mix is not: each group gets its ``group_shares`` of the bytes,
    normalised, so that a flood of sequences of any one length from one page to ``long_tokens``
    reaches at least ``1 / sum(group_shares)`` of the concurrency a pool shared by every group
    would give it (0.68 at the released model's layout with 16k tokens; longer sequences still
    fit, fewer at once). An equal count per layer (``pool_pages(lazy=False)``) gave long
    sequences a small fraction of it: their full layers ran out first. A sliding layer never
    holds more than ``_pages(window)`` pages of a sequence, so with ``max_batch`` sequences
    never more than ``max_batch`` times that: the bytes a sliding group would get beyond go to
    the full layers (without full layers they are not reserved)."""
    groups = layer_groups(shape)
    top = group_shares(shape, long_tokens)
    pages = [int(pool_bytes * t / sum(top)) // g.page_bytes for g, t in zip(groups, top, strict=True)]
    if max_batch is not None:
        pages = [min(n, max_batch * g.window_pages) if g.window else n for g, n in zip(groups, pages, strict=True)]
    left = pool_bytes - sum(n * g.page_bytes for g, n in zip(groups, pages, strict=True))
    pages = [n + left // g.page_bytes if g.window is None else n for g, n in zip(groups, pages, strict=True)]
    return tuple(KVGroup(g.window, g.layers, g.page_bytes, n) for g, n in zip(groups, pages, strict=True))


def layer_pages(shape: MemoryShape, groups: tuple[KVGroup, ...]) -> list[int]:
    """Per layer: its group's pages + the null page (``KVPool``'s counts)."""
    out = [0] * len(shape.layers)
    for g in groups:
        for i in g.layers:
            out[i] = g.pages + 1
    return out


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


def chunk_rows(sampler: str, device: str) -> int:
    """Rows a step's vocabulary pass takes at once (its transient: ``VOCAB_UNITS`` a row): one on
    the host (a canvas x vocabulary GEMM is already large there) and in exact mode (HF's shape);
    ``DEVICE_CHUNK_ROWS`` in a device's fast mode."""
    return 1 if sampler == "exact" or str(device).startswith("cpu") else DEVICE_CHUNK_ROWS


def step_transient_bytes(shape: MemoryShape, sampler: str, chunk_rows: int) -> int:
    """The vocab-wide part of one step: fixed, whatever the batch."""
    return VOCAB_UNITS[sampler] * chunk_rows * shape.canvas_length * shape.vocab_size * 4


@dataclass
class MemoryBudget:
    """The scheduler's view: bytes available to sequences, and each one's reservation.

    ``groups`` empty (the host, or the exact mode): a sequence reserves all its bytes against
    ``budget_bytes``. Planned (``plan_pool``: a device's fast mode): the pool takes
    ``pool_bytes`` of the budget; a sequence reserves its pages per group against each group's
    ``pages`` and its other bytes against the rest (``rest_bytes``)."""

    shape: MemoryShape
    budget_bytes: int
    groups: tuple[KVGroup, ...] = ()

    @property
    def pool_bytes(self) -> int:
        return sum(g.pages * g.page_bytes for g in self.groups)

    @property
    def rest_bytes(self) -> int:
        return self.budget_bytes - self.pool_bytes

    def need(self, prompt_tokens: int, max_tokens: int) -> int:
        """Bytes reserved against ``rest_bytes`` (every byte when the pool is not planned)."""
        total = sequence_bytes(self.shape, prompt_tokens, max_tokens)
        if self.groups:
            total -= kv_page_bytes(self.shape, prompt_tokens + max_tokens + self.shape.canvas_length)
        return total

    def pages(self, prompt_tokens: int, max_tokens: int) -> tuple[int, ...]:
        """Pages reserved per group (one layer's; empty when the pool is not planned)."""
        tokens = prompt_tokens + max_tokens + self.shape.canvas_length
        return tuple(g.seq_pages(tokens) for g in self.groups)

    def pages_bytes(self, pages: tuple[int, ...]) -> int:
        """The pool's bytes under ``pages`` (per group, one layer's count)."""
        return sum(p * g.page_bytes for p, g in zip(pages, self.groups, strict=True))

    def fits(self, need: int, pages: tuple[int, ...], held: int = 0, held_pages: tuple[int, ...] = ()) -> bool:
        """``need`` bytes and ``pages`` beside what is ``held`` already."""
        held_pages = held_pages or (0,) * len(self.groups)
        return held + need <= self.rest_bytes and all(
            h + p <= g.pages for g, h, p in zip(self.groups, held_pages, pages, strict=True))

    def fits_alone(self, prompt_tokens: int, max_tokens: int) -> bool:
        return self.fits(self.need(prompt_tokens, max_tokens), self.pages(prompt_tokens, max_tokens))

    def max_prompt_tokens(self, max_tokens: int) -> int:
        """The longest prompt that fits alone with this max_tokens (0 if none does)."""
        lo, hi = 0, 1
        while self.fits_alone(hi, max_tokens) and hi < 1 << 40:
            hi *= 2
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.fits_alone(mid, max_tokens):
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


def plan(shape: MemoryShape, sampler: str, *, chunk_rows: int, free_bytes: int | None = None,
         budget_bytes: int | None = None, device_pool: bool = False, max_batch: int | None = None,
         kv_fraction: float | None = None) -> MemoryBudget:
    """The one place a diffusion engine's memory budget is decided. Bytes sequences may reserve
    (KV + per-row state): ``budget_bytes`` when given (``memory_budget_gib``), else
    ``SAFETY_FRACTION`` of ``free_bytes`` (memory free once the weights are loaded) less the
    fixed vocab-wide transient of a step. Fast sampler with a pool reserved on a device:
    ``kv_fraction`` (default ``KV_FRACTION``) of it is the page pool, planned per layer group for
    ``max_batch`` sequences (``plan_pool``); the rest is for the sequences' other bytes."""
    if budget_bytes is None:
        if free_bytes is None:
            raise ValueError("plan: free_bytes or budget_bytes")
        budget_bytes = default_budget_bytes(free_bytes, step_transient_bytes(shape, sampler, chunk_rows))
    if sampler != "fast" or not device_pool:
        return MemoryBudget(shape, budget_bytes)
    fraction = KV_FRACTION if kv_fraction is None else kv_fraction
    return MemoryBudget(shape, budget_bytes, plan_pool(shape, int(budget_bytes * fraction), max_batch))
