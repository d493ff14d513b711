"""Admission by memory on the shape model (canvas 256, vocab 262,144), in process.

A flood of long prompts against a budget that holds two of them at a time: nothing runs out of
memory, the reservations never exceed the budget, the rest wait, every request ends with an
answer, and one that can never fit is a 400 naming the prompt and the limit (its batch mates
are not affected). Kept short: one denoise step per block, a few tokens, the fast sampler.
"""

import asyncio

import pytest
import torch

from diffusion_plugin.engine import DiffusionEngine
from tandem_core.errors import TandemError
from workers import tiny_models


async def _collect(engine, body, rid):
    items = [item async for item in engine.completions(body, rid)]
    return items[-1]


@pytest.mark.timeout(600)
def test_a_flood_of_long_prompts_waits_for_memory_and_all_finish():
    torch.set_num_threads(1)
    path = tiny_models.build(tiny_models.SHAPE_DIFFUSIONGEMMA)

    async def main():
        engine = DiffusionEngine("shape", str(path), {"sampler": "fast", "max_batch": 8, "num_threads": 1})
        await engine.start()
        try:
            long_prompt = "the river and the sea " * 120
            n_long = len(engine.adapter.tokenizer(long_prompt).input_ids)
            need = engine.memory.need(n_long, 8)
            engine.memory.budget_bytes = int(2.5 * need)  # two at a time (the scheduler holds this object)
            body = {"model": "shape", "prompt": long_prompt, "max_tokens": 8, "seed": 1, "ignore_eos": True,
                    "diffusion": {"max_denoising_steps": 1}}
            huge = {**body, "prompt": long_prompt * 8}
            peak, waited = 0, 0
            tasks = [asyncio.create_task(_collect(engine, {**body, "seed": i}, f"r{i}")) for i in range(5)]
            tasks.append(asyncio.create_task(_collect(engine, huge, "huge")))
            while not all(t.done() for t in tasks):
                stats = (await engine.stats()).extra
                peak = max(peak, stats["memory_reserved_bytes"])
                waited = max(waited, stats["waiting_for_memory"])
                await asyncio.sleep(0.05)
            results = [t.result() for t in tasks]
        finally:
            await engine.shutdown()
        return results, peak, waited, engine.memory.budget_bytes

    results, peak, waited, budget = asyncio.run(main())
    *answers, refused = results
    assert all(isinstance(a, dict) and a["choices"][0]["finish_reason"] == "length" for a in answers), answers
    assert isinstance(refused, TandemError) and refused.status == 400 and refused.param == "prompt"
    assert "memory budget" in str(refused) and "at most" in str(refused)
    assert 0 < peak <= budget and waited > 0
