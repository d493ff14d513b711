"""Admission by memory in the pure scheduler, with hand-built sequences (no torch)."""

import random

from diffusion_plugin.memory import (
    PAGE_TOKENS,
    MemoryBudget,
    MemoryShape,
    kv_bytes,
    kv_page_bytes,
    pool_pages,
    sequence_bytes,
)
from diffusion_plugin.request import SamplingParams, SeqStatus, Sequence
from diffusion_plugin.scheduler import Scheduler
from tests.unit.diffusion_fakes import FakeDenoiser

C = 4
SHAPE = MemoryShape(canvas_length=C, vocab_size=100, hidden_size=8, itemsize=4,
                    layers=((16, 6), (16, None)), num_heads=2)


def _seq(name, prompt=3, max_tokens=8):
    p = SamplingParams(max_tokens=max_tokens, max_denoising_steps=2, entropy_bound=0.1, t_min=0.4, t_max=0.8,
                       stability_threshold=1, confidence_threshold=0.005, seed=0, eos_token_ids=(99,))
    return Sequence(seq_id=name, prompt_ids=[1] * prompt, params=p)


def test_kv_counts_sliding_windows_and_every_token():
    assert kv_bytes(SHAPE, 10) == 2 * 16 * 4 * 6 + 2 * 16 * 4 * 10
    assert sequence_bytes(SHAPE, 100, 8) > sequence_bytes(SHAPE, 10, 8) > sequence_bytes(SHAPE, 10, 4)


def test_admits_only_what_fits_and_the_rest_wait_in_order():
    budget = MemoryBudget(SHAPE, sequence_bytes(SHAPE, 3, 8) * 2 + 1)  # room for two short ones
    s = Scheduler(max_batch=8, canvas_length=C, memory=budget)
    for name in "abc":
        s.add(_seq(name))
    batch, _ = s.schedule()
    assert batch.admit == ["a", "b"] and [w.seq_id for w in s.waiting] == ["c"]
    assert s.reserved_bytes == 2 * sequence_bytes(SHAPE, 3, 8) <= budget.budget_bytes
    assert s.stats.waiting_for_memory == 1


def test_a_long_head_is_not_overtaken_and_joins_when_memory_frees():
    short = sequence_bytes(SHAPE, 3, 4)
    long_ = sequence_bytes(SHAPE, 40, 4)
    budget = MemoryBudget(SHAPE, long_ + short // 2)  # the long one fits alone, not beside a short one
    s = Scheduler(max_batch=8, canvas_length=C, memory=budget)
    d = FakeDenoiser(s)
    s.add(_seq("a", max_tokens=4))
    s.add(_seq("long", prompt=40, max_tokens=4))
    s.add(_seq("b", max_tokens=4))
    d.step()
    assert list(s.running) == ["a"] and [w.seq_id for w in s.waiting] == ["long", "b"]  # b does not overtake
    seen = set()
    for _ in range(20):
        d.step()
        seen |= set(s.running)
        assert s.reserved_bytes <= budget.budget_bytes
        if not s.has_work():
            break
    assert {"long", "b"} <= seen and not s.has_work()


def test_a_sequence_that_can_never_fit_is_refused_not_queued_forever():
    budget = MemoryBudget(SHAPE, sequence_bytes(SHAPE, 3, 8))
    s = Scheduler(max_batch=8, canvas_length=C, memory=budget)
    assert s.fits_alone(_seq("ok")) and not s.fits_alone(_seq("huge", prompt=500))
    s.add(_seq("huge", prompt=500))
    s.add(_seq("ok"))
    batch, finished = s.schedule()
    assert [f.seq.seq_id for f in finished] == ["huge"] and finished[0].seq.status is SeqStatus.FINISHED_ERROR
    assert batch.admit == ["ok"]


def test_max_prompt_tokens_is_the_largest_that_fits():
    budget = MemoryBudget(SHAPE, sequence_bytes(SHAPE, 50, 8))
    n = budget.max_prompt_tokens(8)
    assert budget.need(n, 8) <= budget.budget_bytes < budget.need(n + 1, 8)
    assert MemoryBudget(SHAPE, 10).max_prompt_tokens(8) == 0


def test_no_budget_means_no_memory_limit():
    s = Scheduler(max_batch=2, canvas_length=C)
    s.add(_seq("a", prompt=10**6))
    batch, _ = s.schedule()
    assert batch.admit == ["a"]


# The shape model's layout: a sliding layer (8 x 256 wide, window 1023) and a full one (2 x 512).
REAL = MemoryShape(canvas_length=256, vocab_size=262144, hidden_size=128, itemsize=4,
                   layers=((2048, 1023), (1024, None)), num_heads=16)


def test_kv_is_reserved_once_in_whole_pages():
    tokens = 300 + 256 + 256
    pages = -(-tokens // PAGE_TOKENS)
    assert kv_page_bytes(REAL, tokens) == pages * PAGE_TOKENS * 2 * 4 * (2048 + 1024)
    assert kv_page_bytes(REAL, 10_000) == 2 * 4 * PAGE_TOKENS * (2048 * 5 + 1024 * 40)  # the window: 5 pages
    assert kv_page_bytes(REAL, tokens) <= sequence_bytes(REAL, 300, 256) < 2 * kv_page_bytes(REAL, tokens) + 10**9


def test_the_page_pool_holds_every_set_of_sequences_the_budget_admits():
    rng = random.Random(0)
    budget = 8 << 30
    pages = pool_pages(REAL, budget) - 1  # less the null page
    for _ in range(200):
        held, used = [], 0
        while True:
            prompt, max_tokens = rng.randint(1, 20_000), rng.randint(1, 4096)
            need = sequence_bytes(REAL, prompt, max_tokens)
            if used + need > budget:
                break
            used += need
            held.append(prompt + max_tokens + REAL.canvas_length)
        for _width, window in REAL.layers:
            per_seq = [-(-t // PAGE_TOKENS) for t in held]
            if window:
                per_seq = [min(p, -(-window // PAGE_TOKENS) + 1) for p in per_seq]
            assert sum(per_seq) <= pages
