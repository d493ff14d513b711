"""Admission by memory in the pure scheduler, with hand-built sequences (no torch)."""

import random

import pytest

from diffusion_plugin.batcher.memory import (
    DEVICE_CHUNK_ROWS,
    KV_FRACTION,
    PAGE_TOKENS,
    PLAN_TOKENS,
    SAFETY_FRACTION,
    MemoryBudget,
    MemoryShape,
    group_shares,
    kv_bytes,
    kv_page_bytes,
    layer_pages,
    plan_pool,
    pool_pages,
    sequence_bytes,
    step_transient_bytes,
)
from diffusion_plugin.batcher.request import SamplingParams, SeqStatus, Sequence
from diffusion_plugin.batcher.scheduler import Scheduler
from diffusion_plugin.engine import DiffusionEngine
from diffusion_plugin.engine_args import DiffusionEngineArgs
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
    window_pages = -(-1023 // PAGE_TOKENS) + 1  # the window (1,023 tokens) and the page it straddles
    assert kv_page_bytes(REAL, 10_000) == 2 * 4 * PAGE_TOKENS * (2048 * window_pages + 1024 * -(-10_000 // PAGE_TOKENS))
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


# -- a device's pool (reserved at once): pages planned per layer group, admission by pages -------------
# The released model's pattern (5 sliding : 1 full) with the shape model's widths.
HYBRID = MemoryShape(canvas_length=256, vocab_size=262144, hidden_size=128, itemsize=4,
                     layers=tuple((1024, None) if i % 6 == 5 else (2048, 1023) for i in range(12)), num_heads=16)
GIB_ = 1 << 30


def _flood(budget, lengths, max_batch=64):
    """Admit ``(prompt, max_tokens)`` sequences in order at one boundary; the scheduler."""
    s = Scheduler(max_batch=max_batch, canvas_length=budget.shape.canvas_length, memory=budget)
    for i, (prompt, max_tokens) in enumerate(lengths):
        s.add(_seq(f"s{i}", prompt=prompt, max_tokens=max_tokens))
    s.schedule()
    return s


def test_the_plan_gives_sliding_layers_only_what_max_batch_windows_hold():
    plan = plan_pool(HYBRID, 8 * GIB_, max_batch=16)
    full, sliding = plan
    assert (full.window, sliding.window) == (None, 1023) and len(full.layers) == 2 and len(sliding.layers) == 10
    assert sliding.pages == 16 * (-(-1023 // PAGE_TOKENS) + 1)  # the pages a 1023-token window straddles
    pool = sum(g.pages * g.page_bytes for g in plan)
    assert 8 * GIB_ - full.page_bytes < pool <= 8 * GIB_  # the full layers take the rest
    equal = pool_pages(HYBRID, 8 * GIB_, lazy=False) - 1
    assert full.pages > 3 * equal  # what an equal count per layer gave them
    assert layer_pages(HYBRID, plan) == [full.pages + 1 if i % 6 == 5 else sliding.pages + 1 for i in range(12)]
    # A small pool: no group gets more than an equal split would give it.
    small = plan_pool(HYBRID, 64 * full.page_bytes, max_batch=16)
    assert small[1].pages <= small[0].pages and sum(g.pages * g.page_bytes for g in small) <= 64 * full.page_bytes


def test_the_split_serves_every_length_up_to_the_plan_within_its_share():
    """Against a pool shared by every group (the best any split can do for one length)."""
    pool = 64 * GIB_
    plan = plan_pool(HYBRID, pool)
    floor_ = 1 / sum(group_shares(HYBRID))
    assert 0.6 < floor_ < 1
    worst = 1.0
    for tokens in range(1, 4 * PLAN_TOKENS, 97):
        held = [g.seq_pages(tokens) for g in plan]
        held_equal = pool // sum(g.page_bytes for g in plan) // held[0]  # every layer the same count
        got = min(g.pages // p for g, p in zip(plan, held, strict=True))
        shared = pool // sum(p * g.page_bytes for g, p in zip(plan, held, strict=True))
        if tokens <= PLAN_TOKENS:
            worst = min(worst, got / shared)
            assert got >= floor_ * shared - 1, tokens
        # Beyond two windows the equal count held fewer (its full layers ran out first).
        assert got >= 1 and (tokens < 2 * PAGE_TOKENS * plan[1].window_pages or got > held_equal), tokens
    print(f"worst share of a shared pool's concurrency up to {PLAN_TOKENS} tokens: {worst:.2f} (bound {floor_:.2f})")


def test_long_sequences_are_admitted_only_as_far_as_the_full_layers_pages_allow():
    budget = DiffusionEngine("m", "", {"sampler": "fast", "device": "cuda", "max_batch": 16}).budget_for(
        HYBRID, 12 * GIB_)
    full, sliding = budget.groups
    assert budget.pool_bytes <= KV_FRACTION * 12 * GIB_ and budget.pool_bytes + budget.rest_bytes == 12 * GIB_
    long_ = (20_000 - 512 - 256, 512)  # 20,000 tokens: every page in a full layer, a window's in a sliding one
    n_full, n_sliding = -(-20_000 // PAGE_TOKENS), -(-1023 // PAGE_TOKENS) + 1
    s = _flood(budget, [long_] * 16, max_batch=16)
    admitted = len(s.running)
    assert 1 < admitted == full.pages // n_full < 16 and s.pages_reserved == (n_full * admitted, n_sliding * admitted)
    assert s.reserved_bytes + budget.need(*long_) <= budget.rest_bytes  # bytes were not what stopped it
    # An equal count per layer within the same pool bytes (before) held fewer of them.
    equal = budget.pool_bytes // sum(g.page_bytes for g in budget.groups)
    assert equal // n_full < admitted
    # Short sequences (2 pages per layer) fill max_batch on the same plan.
    assert len(_flood(budget, [(100, 100)] * 20, max_batch=16).running) == 16


def test_short_sequences_pack_to_the_byte_budget():
    budget = DiffusionEngine("m", "", {"sampler": "fast", "device": "cuda", "max_batch": 64,
                                       "kv_cache_fraction": 0.9}).budget_for(HYBRID, 8 * GIB_)
    short = (100, 100)
    s = _flood(budget, [short] * 64)
    assert 0 < len(s.running) < 64 and all(p <= g.pages for p, g in zip(s.pages_reserved, budget.groups, strict=True))
    assert s.reserved_bytes <= budget.rest_bytes < s.reserved_bytes + budget.need(*short)


def test_random_floods_never_exceed_a_group_or_the_rest():
    rng = random.Random(1)
    for fraction in (0.2, 0.5, 0.8):
        budget = DiffusionEngine("m", "", {"sampler": "fast", "device": "cuda:0", "max_batch": 16,
                                           "kv_cache_fraction": fraction}).budget_for(HYBRID, 8 * GIB_)
        for _ in range(50):
            s = Scheduler(max_batch=16, canvas_length=256, memory=budget)
            d = FakeDenoiser(s)
            for i in range(30):
                s.add(_seq(f"s{i}", prompt=rng.choice([10, 700, 3000, 20_000]), max_tokens=rng.randint(1, 2048)))
            for _ in range(10):
                d.step()
                assert all(p <= g.pages for p, g in zip(s.pages_reserved, budget.groups, strict=True))
                assert s.reserved_bytes <= budget.rest_bytes
                assert s.reserved_bytes + budget.pages_bytes(s.pages_reserved) <= budget.budget_bytes


def test_a_sequence_the_pages_can_never_hold_is_refused():
    budget = MemoryBudget(HYBRID, 4 * GIB_, plan_pool(HYBRID, 2 * GIB_, max_batch=4))
    longest = budget.max_prompt_tokens(256)
    assert budget.fits_alone(longest, 256) and not budget.fits_alone(longest + 1, 256)
    assert -(-(longest + 1 + 256 + 256) // PAGE_TOKENS) > budget.groups[0].pages  # the full layers' pages refuse it
    s = Scheduler(max_batch=4, canvas_length=256, memory=budget)
    assert not s.fits_alone(_seq("huge", prompt=longest + 1, max_tokens=256))


def test_the_host_and_the_exact_sampler_keep_one_byte_budget():
    for args in ({"sampler": "fast", "device": "cpu"}, {"sampler": "exact", "device": "cuda"}):
        budget = DiffusionEngine("m", "", args).budget_for(HYBRID, 4 * GIB_)
        assert budget.groups == () and budget.pool_bytes == 0 and budget.rest_bytes == 4 * GIB_
        assert budget.need(3000, 500) == sequence_bytes(HYBRID, 3000, 500) and budget.pages(3000, 500) == ()


@pytest.mark.parametrize("bad", [0, 1, 1.5, -0.1])
def test_kv_cache_fraction_is_validated(bad):
    with pytest.raises(ValueError, match="kv_cache_fraction"):
        DiffusionEngine("m", "", {"kv_cache_fraction": bad})
    assert DiffusionEngineArgs(kv_cache_fraction=0.3).kv_cache_fraction == 0.3


@pytest.mark.parametrize(("sampler", "device", "rows"), [("fast", "cpu", 1), ("exact", "cuda", 1),
                                                          ("fast", "cuda:0", DEVICE_CHUNK_ROWS)])
def test_the_engine_plans_the_vocabulary_transient_of_the_chunks_its_runner_takes(sampler, device, rows):
    """One rule for the rows a vocabulary pass takes at once: the runner's chunks and the plan's
    fixed transient read the same number."""
    engine = DiffusionEngine("m", "", {"sampler": sampler, "device": device, "max_batch": 16})
    assert engine._chunk_rows() == rows
    shape = MemoryShape(canvas_length=256, vocab_size=262144, hidden_size=128, num_heads=4, itemsize=2,
                        layers=((256, None),))
    free, one_row = 64 << 30, step_transient_bytes(shape, sampler, 1)
    assert engine._plan(shape, free_bytes=free).budget_bytes == int(free * SAFETY_FRACTION) - rows * one_row
