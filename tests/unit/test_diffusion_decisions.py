"""Label reads in the diffusion batcher (``diffusion_plugin.decisions``) on the real tiny model:
a read is one read-only row (nothing committed, the sequence ends after it), its log-softmax
does not depend on what shares the batch (fast mode: other reads, generating rows), the same
request twice gives the same answers, and vLLM's /v1/systemone shape comes back."""

from __future__ import annotations

import asyncio

import pytest
import torch

from diffusion_plugin.decisions import DiffusionReader
from diffusion_plugin.engine import DiffusionEngine
from tandem_core.label_reads import Probe
from workers import tiny_models

BODY = {"model": "m", "input": "The parcel is late.", "questions": [
    {"type": "predicate", "instructions": "The customer is happy."},
    {"type": "choice", "instructions": "Topic?", "choices": [{"value": "billing"}, {"value": "shipping"}]},
    {"type": "score", "instructions": "Urgency?", "levels": [{"label": "low"}, {"label": "high"}]}]}


async def _run(sampler: str):
    torch.set_num_threads(1)
    engine = DiffusionEngine("m", str(tiny_models.build(tiny_models.TINY_DIFFUSIONGEMMA)),
                             {"max_batch": 4, "sampler": sampler})
    await engine.start()
    try:
        reader = DiffusionReader(engine, "probe")
        yes_no = [t for w in ("y", "n") for t in reader.tokenizer.encode(w, add_special_tokens=False)]
        probes = [Probe(await reader.render([{"role": "user", "content": f"Case {k}: is it late?"}], None), yes_no)
                  for k in range(3)]
        alone = [(await reader.probe([p], None))[0].logprobs for p in probes]
        chat = engine.chat({"model": "m", "messages": [{"role": "user", "content": "Write a story."}],
                            "max_tokens": 40}, "gen")
        story = asyncio.ensure_future(_drain(chat))
        together = [r.logprobs for r in await reader.probe(probes, None)]
        await story
        answers = []
        for i in range(2):
            async for out in engine.decisions(dict(BODY), f"d{i}"):
                answers.append(out)
        systemone = []
        async for out in engine.systemone({"model": "m", "state": "late parcel", "questions": {
                "q": {"type": "noul", "instructions": "Happy?"}}}, "s1"):
            systemone.append(out)
        return alone, together, answers, systemone, engine.loop.scheduler.stats
    finally:
        await engine.shutdown()


async def _drain(stream):
    async for _ in stream:
        pass


@pytest.mark.parametrize("sampler", ["fast", "exact"])
def test_reads_are_batch_invariant_repeatable_and_commit_nothing(sampler):
    alone, together, answers, systemone, stats = asyncio.run(_run(sampler))
    assert together == alone  # bit for bit, with each other and a generating row in the batch
    assert all(isinstance(a, dict) for a in answers) and answers[0]["answers"] == answers[1]["answers"]
    probs = [p["probability"] for p in answers[0]["answers"][1]["probabilities"]]
    assert abs(sum(probs) - 1) < 1e-9
    (s,) = systemone
    assert s["object"] == "structured_decision" and set(s["answers"]) == {"q"}
    assert s["answers"]["q"]["type"] == "noul" and 0 <= s["diagnostics"]["q"]["label_mass"] <= 1
    assert stats.tokens_scored == 0  # a read commits and scores no prompt token
