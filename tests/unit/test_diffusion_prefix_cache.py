"""The fast mode's prompt prefix cache on the real tiny model: a hit changes no bit of an answer,
shared prompt pages are adopted (not recomputed, not copied), a different cache_salt shares
nothing, cached pages give way when memory is needed, and the bookkeeping alone."""

import random

import pytest
import torch

from diffusion_plugin.batcher.memory import PAGE_TOKENS
from diffusion_plugin.batcher.request import SamplingParams, Sequence
from diffusion_plugin.batcher.scheduler import Scheduler
from diffusion_plugin.families.diffusiongemma import DiffusionGemmaAdapter
from diffusion_plugin.step.prefix_cache import PageCache, chunks, page_keys
from diffusion_plugin.step.runner import Runner
from workers import tiny_models


def test_keys_chain_the_prefix_and_the_salt():
    a = list(range(3, 3 + 3 * PAGE_TOKENS + 7))
    b = a[:PAGE_TOKENS] + [9] + a[PAGE_TOKENS + 1:]
    ka, kb = page_keys(a), page_keys(b)
    assert len(ka) == 3  # whole pages only
    assert ka[0] == kb[0] and ka[1] != kb[1] and ka[2] != kb[2]  # a change moves every later key
    assert page_keys(a, "tenant-1")[0] != ka[0] and page_keys(a, "tenant-1") == page_keys(a, "tenant-1")
    P = PAGE_TOKENS
    assert chunks(0, 2 * P + 88) == [(0, P), (P, 2 * P), (2 * P, 2 * P + 88)]
    assert chunks(2 * P, 2 * P + 18) == [(2 * P, 2 * P + 18)] and chunks(P + 44, P + 44) == []
    assert chunks(P + 44, 3 * P) == [(P + 44, 2 * P), (2 * P, 3 * P)]  # a cut ends on the page grid


def test_page_cache_references_lru_and_eviction():
    cache = PageCache(1)
    for page in (1, 2, 3):
        cache.ref(0, page)
    cache.register(b"k1", 0, 1)
    cache.register(b"k2", 0, 2)
    assert cache.unref(0, 3) is True  # unnamed: free at once
    assert cache.unref(0, 1) is False and cache.unref(0, 2) is False  # named: kept, least recent first
    assert cache.cached_pages() == 2
    cache.ref(0, 1)  # adopted again: out of the LRU
    assert cache.evict(0) == 2 and cache.pages.get(b"k2") is None
    assert cache.evict(0) is None  # page 1 is referenced
    assert cache.lookup([b"k1", b"k2"], lambda layer, n: range(0, n)) == 1


@pytest.fixture(scope="module")
def adapter():
    torch.set_num_threads(1)
    return DiffusionGemmaAdapter(str(tiny_models.build(tiny_models.TINY_DIFFUSIONGEMMA)))


SYSTEM = [(13 * j) % 900 + 5 for j in range(2 * PAGE_TOKENS + 40)]  # two whole pages and some


def _seq(adapter, name, prompt, seed, salt=None, max_tokens=70):
    return Sequence(name, prompt, SamplingParams(max_tokens=max_tokens, seed=seed, eos_token_ids=(),
                                                 **{**adapter.defaults(), "max_denoising_steps": 6}),
                    cache_salt=salt)


def _drive(sched, runner, seqs, arrivals: dict[int, list[Sequence]]) -> None:
    step = 0
    while step <= max(arrivals, default=0) or sched.has_work():
        for seq in arrivals.get(step, []):
            seqs[seq.seq_id] = seq
            sched.add(seq)
        step += 1
        batch, _ = sched.schedule()
        if not batch.empty():
            sched.update(runner.execute(batch, seqs))
        else:  # as the loop does: a retired sequence's state is dropped even with nothing to run
            for seq_id in batch.free:
                runner.free(seq_id)


def _fresh(adapter, budget=64 << 20):
    return Scheduler(max_batch=4, canvas_length=adapter.canvas_length), Runner(
        adapter, "fast", kv_budget_bytes=budget, prefix_cache=True)


def _alone(adapter, name, prompt, seed, salt=None):
    sched, runner = _fresh(adapter)
    seqs = {}
    _drive(sched, runner, seqs, {0: [_seq(adapter, name, prompt, seed, salt)]})
    return seqs[name]


def test_a_hit_gives_the_tokens_a_miss_gives(adapter):
    prompt = SYSTEM + [7, 8, 9]
    miss = _alone(adapter, "a", prompt, 5)
    assert miss.cached_tokens == 0
    sched, runner = _fresh(adapter)
    seqs = {}
    _drive(sched, runner, seqs, {0: [_seq(adapter, "warm", SYSTEM + [1, 2], 9)]})
    assert runner.pool.cache.cached_pages() > 0  # the finished sequence's prompt pages stay
    _drive(sched, runner, seqs, {0: [_seq(adapter, "a", prompt, 5)]})
    hit = seqs["a"]
    assert hit.cached_tokens == 2 * PAGE_TOKENS
    assert hit.output_ids == miss.output_ids


def test_random_prompts_joining_mid_run_equal_their_misses(adapter):
    """Prompts sharing 1-2 pages of prefix (and some sharing none), several seeds, arriving while
    others run: each equals the same prompt and seed run alone on an empty cache."""
    rng = random.Random(7)
    other = [(17 * j) % 900 + 11 for j in range(PAGE_TOKENS + 30)]
    prompts = [SYSTEM[:PAGE_TOKENS + rng.randint(1, 300)] + [rng.randint(5, 900) for _ in range(rng.randint(1, 20))]
               for _ in range(4)] + [other + [3, 4], other[:PAGE_TOKENS] + [6]]
    arrivals: dict[int, list[Sequence]] = {}
    for i, prompt in enumerate(prompts):
        arrivals.setdefault(rng.choice([0, 0, 2, 5, 9, 14]), []).append(_seq(adapter, f"s{i}", prompt, 20 + i))
    sched, runner = _fresh(adapter)
    seqs = {}
    _drive(sched, runner, seqs, arrivals)
    assert sum(s.cached_tokens > 0 for s in seqs.values()) >= 2, "some rows must hit"
    for i, prompt in enumerate(prompts):
        assert seqs[f"s{i}"].output_ids == _alone(adapter, f"s{i}", prompt, 20 + i).output_ids, f"row {i}"


def test_a_different_salt_shares_nothing(adapter):
    sched, runner = _fresh(adapter)
    seqs = {}
    _drive(sched, runner, seqs, {0: [_seq(adapter, "a", SYSTEM, 1, salt="x")]})
    _drive(sched, runner, seqs, {0: [_seq(adapter, "b", SYSTEM, 1, salt="y"), _seq(adapter, "c", SYSTEM, 1)]})
    _drive(sched, runner, seqs, {0: [_seq(adapter, "d", SYSTEM, 1, salt="x")]})
    assert (seqs["b"].cached_tokens, seqs["c"].cached_tokens, seqs["d"].cached_tokens) == (0, 0, 2 * PAGE_TOKENS)
    assert seqs["d"].output_ids == seqs["a"].output_ids


def test_cached_pages_give_way_when_memory_is_needed(adapter):
    """A pool with room for little more than one sequence: later prompts evict the cached pages of
    earlier ones instead of failing, and the pool's references balance when all is done."""
    from diffusion_plugin.batcher import memory

    shape = adapter.memory_shape()
    budget = memory.kv_page_bytes(shape, len(SYSTEM) + 70 + adapter.canvas_length) * 2
    sched, runner = _fresh(adapter, budget=budget)
    seqs = {}
    for k in range(8):
        prompt = [(k * 101 + 7 * j) % 900 + 5 for j in range(len(SYSTEM))]
        _drive(sched, runner, seqs, {0: [_seq(adapter, f"p{k}", prompt, k)]})
        assert len(seqs[f"p{k}"].output_ids) == 70
    assert runner.pool.cache.evictions > 0
    pool = runner.pool
    for layer in range(len(pool.k)):
        assert pool.pages_in_use(layer) == 0 and not pool.cache.refs[layer]
    assert pool.reset_cache() > 0 and pool.cache.cached_pages() == 0


def test_the_engine_reports_cached_tokens_and_honours_cache_salt(adapter):
    """Through the engine (fast sampler, prefix_cache on): usage's prompt_tokens_details.cached_tokens
    on chat and completions, input_tokens_details on Responses, the salt, the counters; an answer
    with its prefix cached equals the one computed."""
    import asyncio

    from diffusion_plugin.engine import DiffusionEngine

    path = str(tiny_models.build(tiny_models.TINY_DIFFUSIONGEMMA))
    text = " ".join(f"w{i % 97}" for i in range(700))
    body = {"model": "m", "prompt": text, "max_tokens": 40, "temperature": 0}
    chat = {"model": "m", "messages": [{"role": "system", "content": text}, {"role": "user", "content": "Hi"}],
            "max_tokens": 8}

    async def main():
        engine = DiffusionEngine("m", path, {"sampler": "fast", "num_threads": 1, "prefix_cache": True})
        started = await engine.start()

        async def one(route, b, rid):
            return [x async for x in getattr(engine, route)(b, rid)]
        try:
            first = await one("completions", body, "a")
            second = await one("completions", body, "b")
            salted = await one("completions", {**body, "cache_salt": "t1"}, "c")
            await one("chat", chat, "d")
            chat2 = await one("chat", {**chat, "messages": chat["messages"][:1] + [{"role": "user", "content": "Yo"}]},
                              "e")
            resp = await one("responses", {"model": "m", "instructions": text, "input": "Yo", "max_output_tokens": 8},
                             "f")
            stats = await engine.stats()
            reset = await engine.reset_prefix_cache()  # vLLM's /reset_prefix_cache: nothing cached after
            after = await engine.stats()
            third = await one("completions", body, "g")
            return started, first[0], second[0], salted[0], chat2[0], resp, stats, (reset, after, third[0])
        finally:
            await engine.shutdown()

    info, first, second, salted, chat2, resp, stats, (reset, after, third) = asyncio.run(main())
    assert reset is True and after.extra["kv_cached_pages"] == 0
    assert third["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}  # computed again
    assert third["choices"][0]["text"] == first["choices"][0]["text"]
    assert info.extra["kv_cache_tokens"] > 0
    assert stats.extra["kv_cache_tokens"] == info.extra["kv_cache_tokens"]  # /admin/replicas, as vLLM's replicas
    assert first["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached >= PAGE_TOKENS and cached % PAGE_TOKENS == 0 and cached < second["usage"]["prompt_tokens"]
    assert second["choices"][0]["text"] == first["choices"][0]["text"]
    assert salted["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert chat2["usage"]["prompt_tokens_details"]["cached_tokens"] >= PAGE_TOKENS  # the system prompt's pages
    assert resp[0]["usage"]["input_tokens_details"]["cached_tokens"] >= PAGE_TOKENS
    assert stats.extra["prefix_cache_hits"] >= 2 * PAGE_TOKENS and stats.extra["prefix_cache_queries"] > 0
    assert stats.extra["kv_cached_pages"] > 0


def test_a_follow_up_turn_reuses_the_previous_prompt(adapter):
    """Chat: turn 2 (turn 1's messages, its answer, a new question) finds at least turn 1's whole
    prompt pages cached. (Turn 1's committed answer is not reused: its K/V were written by commit
    passes of canvas size, which a prompt's page-aligned pass would not reproduce bit for bit.)"""
    import asyncio

    from diffusion_plugin.engine import DiffusionEngine

    path = str(tiny_models.build(tiny_models.TINY_DIFFUSIONGEMMA))
    system = " ".join(f"rule{i % 89}" for i in range(650))
    turn1 = [{"role": "system", "content": system}, {"role": "user", "content": "Hello there"}]

    async def main():
        engine = DiffusionEngine("m", path, {"sampler": "fast", "num_threads": 1})
        await engine.start()
        try:
            first = [x async for x in engine.chat({"model": "m", "messages": turn1, "max_tokens": 40}, "a")][0]
            answer = first["choices"][0]["message"]["content"]
            turn2 = turn1 + [{"role": "assistant", "content": answer}, {"role": "user", "content": "And then?"}]
            second = [x async for x in engine.chat({"model": "m", "messages": turn2, "max_tokens": 8}, "b")][0]
            return first, second
        finally:
            await engine.shutdown()

    first, second = asyncio.run(main())
    p1 = first["usage"]["prompt_tokens"]
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] >= (p1 // PAGE_TOKENS) * PAGE_TOKENS > 0


def test_a_reset_frees_what_nobody_holds_and_says_false_while_rows_hold_cached_pages(adapter):
    sched, runner = _fresh(adapter)
    seqs = {}
    _drive(sched, runner, seqs, {0: [_seq(adapter, "warm", SYSTEM + [1, 2], 9)]})
    assert runner.pool.cache.cached_pages() > 0
    held = _seq(adapter, "held", SYSTEM + [3], 4)  # admitted (its prompt adopts the cached pages), not finished
    seqs["held"] = held
    sched.add(held)
    batch, _ = sched.schedule()
    sched.update(runner.execute(batch, seqs))
    assert held.cached_tokens > 0 and not held.output_ids
    assert runner.reset_prefix_cache() is False  # as vLLM: running requests still hold cached pages
    _drive(sched, runner, seqs, {})
    assert held.output_ids
    assert runner.reset_prefix_cache() is True
    assert runner.pool.cache.cached_pages() == 0
