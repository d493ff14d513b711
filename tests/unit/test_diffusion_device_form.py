"""The step's device form on the host (``compiled_vocab`` with ``batched_vocab`` and the trunk
compiled, ``diffusion_plugin.step.compiled``) and an engine with the compiled trunk, on the tiny
model: batch invariance, the launches a layer (issue 36's measure), the compiled draws' and
acceptance's bits, and no compile in a serving step. (Apart from ``test_diffusion_compiled.py``,
the trunk's own checks: each module compiles for minutes on a fresh machine, and the unit tests'
two workers take one each.)"""

import pytest
import torch

from diffusion_plugin.families.diffusiongemma import DiffusionGemmaAdapter
from tests.fast_runs import run as _run
from workers import tiny_models

# Prompts 25, 40 and 90 tokens long, joining mid-run (as ``test_diffusion_compiled.py``'s).
ARRIVALS = {0: [0, 1], 3: [2]}


@pytest.fixture(scope="module")
def adapter():
    torch.set_num_threads(1)
    return DiffusionGemmaAdapter(str(tiny_models.build(tiny_models.TINY_DIFFUSIONGEMMA)))


def test_the_device_form_is_batch_invariant_on_the_host(adapter):
    """The step's device form (``compiled_vocab`` with ``batched_vocab``: a chunk's vocabulary
    pass, the draws and the acceptance each one compiled graph; the trunk compiled): a row's
    tokens alone equal its tokens among mates joining mid-block, in chunks of 3 rows and of 1."""
    together, _, widths = _run(adapter, ARRIVALS, compiled=True, batched=True, trunk=True, steps=8)
    assert max(widths) == 3
    for i in (0, 2):
        alone, _, _ = _run(adapter, {0: [i]}, compiled=True, batched=True, trunk=True, steps=8)
        assert alone[f"s{i}"] == together[f"s{i}"], f"row {i} depends on its batch mates"
    assert len({tuple(v) for v in together.values()}) == 3


def test_the_device_form_step_takes_at_most_60_a_layer_whatever_the_rows(adapter):
    """Issue 36's measure (``tandem_tools.bench.opcount --device-form``) on the tiny model's code path: a
    whole fast step in its device form counts the compiled parts' launches (from inductor's code)
    and every other aten op; at most 60 a layer, at 1 row as at 4 (no growth with the rows), no
    host sync."""
    from tandem_tools.bench.opcount import count_step

    one, four = (count_step(adapter, rows, "fast", device_form=True) for rows in (1, 4))
    for result in (one, four):
        assert result["per_layer"] <= 60 and not result["syncs"] and not result["host_tensors"], result
        assert set(result["parts"]) == {"trunk", "vocab", "draws", "accept"}, result["parts"]
        assert all(c["kernels"] > 0 for calls in result["parts"].values() for c in calls), result["parts"]
    # (a lone row's trunk graph is not the several rows' one: a kernel or two apart, either way)
    assert abs(one["ops"] - four["ops"]) <= 4, (one, four)


def test_the_compiled_draws_and_acceptance_equal_the_eager_ones():
    """The device form's compiled draws and acceptance give the eager functions' bits (the draws'
    int64 hashing wraps alike; the acceptance's sort, cumsum and scatter), for one row and several."""
    from diffusion_plugin.step.accept import accept
    from diffusion_plugin.step.compiled import compile_part
    from diffusion_plugin.step.draws import step_draws

    draws, accepts = compile_part(step_draws), compile_part(accept)
    g = torch.Generator().manual_seed(3)
    for rows in (1, 3, 5):
        seeds = torch.randint(0, 2**62, (rows,), generator=g)
        counters = torch.randint(0, 2**20, (rows,), generator=g)
        assert all(torch.equal(a, b) for a, b in zip(draws(seeds, counters, 32, 1027),
                                                      step_draws(seeds, counters, 32, 1027), strict=True))
        entropy = torch.rand(rows, 32, generator=g) * 3
        ids = [torch.randint(0, 1027, (rows, 32), generator=g) for _ in range(4)]
        bounds, thresholds = torch.rand(rows, 1, generator=g) * 10, torch.rand(rows, generator=g) * 3
        assert all(torch.equal(a, b) for a, b in zip(accepts(entropy, bounds, thresholds, *ids),
                                                      accept(entropy, bounds, thresholds, *ids), strict=True))


def test_an_engine_with_the_compiled_trunk_compiles_at_start_and_then_serves_without_compiling():
    """``engine_args.compiled_trunk`` through ``DiffusionEngine``: its start rehearses a block of
    one row and of two (``Runner.warm``), so chats of one page of context, alone and two at once,
    compile no graph in a serving step, and answer as the same engine's eager trunk would in kind
    (the tokens differ in the last bits' draws: not compared)."""
    import asyncio

    import torch._dynamo
    from torch._dynamo.utils import counters

    from diffusion_plugin.engine import DiffusionEngine

    path = str(tiny_models.build(tiny_models.TINY_DIFFUSIONGEMMA))
    body = {"model": "m", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 40}

    async def main():
        engine = DiffusionEngine("m", path, {"sampler": "fast", "num_threads": 1, "compiled_trunk": True})
        await engine.start()
        try:
            async def chat(seed: int, rid: str) -> list:
                return [x async for x in engine.chat({**body, "seed": seed}, rid)]

            at_start = counters["stats"]["unique_graphs"]
            started = (await engine.stats()).extra
            assert (started["prefix_cache_queries"], started["steps"]) == (0, 0)  # the rehearsal is no request
            alone = await chat(1, "a")
            two = await asyncio.gather(chat(2, "b"), chat(3, "c"))
            return at_start, counters["stats"]["unique_graphs"], alone, two
        finally:
            await engine.shutdown()

    torch._dynamo.reset()  # the graphs earlier tests compiled (other adapters) are not this engine's
    before = counters["stats"]["unique_graphs"]
    at_start, after, alone, two = asyncio.run(main())
    assert at_start - before >= 4  # the trunk's: one row and several, a block's first step and later ones
    assert after == at_start, "a serving step compiled a graph the start did not"
    for answer in [alone[0], *(t[0] for t in two)]:
        assert answer["choices"][0]["finish_reason"] in ("stop", "length") and answer["usage"]["completion_tokens"] > 0
