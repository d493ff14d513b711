"""The fast mode's KV pool planned per layer group (a device's pool, reserved at once), on the tiny
model on the CPU: page counts per layer, admission by pages, and a sliding layer that never holds
more pages than its window straddles (a long prompt's pass included)."""

import dataclasses

import pytest
import torch

from diffusion_plugin.batcher import memory
from diffusion_plugin.batcher.request import SamplingParams, SeqStatus, Sequence
from diffusion_plugin.batcher.scheduler import Scheduler
from diffusion_plugin.families.diffusiongemma import DiffusionGemmaAdapter
from diffusion_plugin.step import kv_view
from diffusion_plugin.step.runner import Runner
from workers import tiny_models

LONG = [(7 * i + j) % 1000 + 3 for i in range(1) for j in range(600)]  # 600 + 40 + 32 tokens
LONG_PAGES = -(-(600 + 40 + 32) // memory.PAGE_TOKENS)
SHORT = [(5 * j) % 1000 + 3 for j in range(25)]  # 1 page


@pytest.fixture(scope="module")
def adapter():
    torch.set_num_threads(1)
    return DiffusionGemmaAdapter(str(tiny_models.build(tiny_models.TINY_DIFFUSIONGEMMA)))


def _plan(adapter, full_pages: int, max_batch: int):
    """The tiny model's groups (full: layer 1; sliding, window 63: layer 0), the full layers holding
    ``full_pages`` pages and the sliding ones what ``max_batch`` windows hold."""
    groups = memory.layer_groups(adapter.memory_shape())
    return tuple(dataclasses.replace(g, pages=full_pages if g.window is None else max_batch * g.window_pages)
                 for g in groups)


def _run(adapter, prompts, groups=(), max_batch=4, on_step=None):
    shape = adapter.memory_shape()
    budget = memory.MemoryBudget(shape, 1 << 40, groups) if groups else None
    sched = Scheduler(max_batch=max_batch, canvas_length=adapter.canvas_length, memory=budget)
    runner = Runner(adapter, "fast", kv_budget_bytes=64 << 20, kv_groups=groups)
    params = {**adapter.defaults(), "max_denoising_steps": 2}
    seqs = {}
    for i, prompt in enumerate(prompts):
        seq = Sequence(seq_id=f"s{i}", prompt_ids=prompt, params=SamplingParams(
            max_tokens=40, seed=10 + i, eos_token_ids=(), **params))
        seqs[seq.seq_id] = seq
        sched.add(seq)
    while sched.has_work():
        batch, finished = sched.schedule()
        assert not finished, [f.seq.error for f in finished]
        if batch.empty():
            for seq_id in batch.free:  # as the loop does
                runner.free(seq_id)
            continue
        out = runner.execute(batch, seqs)  # a MemoryError here fails the test
        if on_step is not None:
            on_step(sched, runner)  # before update: a sequence retired there frees its pages at the next step
        sched.update(out)
    return seqs, runner


def test_a_sliding_layer_never_holds_more_pages_than_its_window_straddles(adapter):
    """A 600-token prompt pass in a sliding layer (window 63) with 2 pages: it writes only what it
    keeps, gives pages back before taking new ones, and returns what HF's layers return."""
    full = -(-(600 + 32 + 32 + 250 + 32) // memory.PAGE_TOKENS) + 1  # every token's page + null
    pool = kv_view.KVPool(adapter.kv_layout(), [3, full], torch.float32, "cpu")  # sliding: 2 pages + null
    assert [k.shape[0] for k in pool.k] == [3, full] and pool.nbytes() == 2 * (3 + full) * 64 * memory.PAGE_TOKENS * 4
    paged, plain = adapter.new_cache(pool), adapter.new_cache()
    g = torch.Generator().manual_seed(0)
    for n in (600, 32, 32, 250, 32):
        for i, (h, d) in enumerate(adapter.kv_layout()):
            k, v = torch.randn(1, h, n, d, generator=g), torch.randn(1, h, n, d, generator=g)
            a, b = paged.update(k, v, i), plain.update(k, v, i)
            assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
            assert paged.get_mask_sizes(32, i) == plain.get_mask_sizes(32, i)
        assert pool.pages_in_use(0) <= 2 == memory._pages(1 << 30, 63)
    kv_view.release(paged)
    assert pool.pages_in_use(0) == pool.pages_in_use(1) == 0


def test_a_planned_pool_admits_long_sequences_by_pages_and_never_runs_out(adapter):
    groups = _plan(adapter, full_pages=2 * LONG_PAGES + 1, max_batch=4)  # two long ones at a time
    full, sliding = groups
    seen = {"long": 0}

    def check(sched, runner):
        assert [k.shape[0] for k in runner.pool.k] == [sliding.pages + 1, full.pages + 1]
        for group, reserved in zip(groups, sched.pages_reserved, strict=True):
            assert reserved <= group.pages
            for i in group.layers:
                assert runner.pool.pages_in_use(i) <= reserved
        seen["long"] = max(seen["long"], sum(1 for s in sched.running.values() if len(s.prompt_ids) == 600))

    prompts = [LONG, SHORT, LONG, LONG, SHORT, LONG]
    seqs, runner = _run(adapter, prompts, groups, on_step=check)
    assert seen["long"] == 2
    assert all(s.status is SeqStatus.FINISHED_LENGTH and len(s.output_ids) == 40 for s in seqs.values()), [
        (s.status, len(s.output_ids)) for s in seqs.values()]
    assert all(runner.pool.pages_in_use(i) == 0 for i in range(len(runner.pool.k)))
    # The pool's layout does not change what is generated: the host's lazy pool gives the same tokens.
    host, _ = _run(adapter, prompts)
    assert {k: s.output_ids for k, s in seqs.items()} == {k: s.output_ids for k, s in host.items()}
