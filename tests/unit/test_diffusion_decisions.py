"""Label reads in the diffusion batcher (``diffusion_plugin.api.decisions``) on the real tiny model:
a read is one read-only row (nothing committed, the sequence ends after it), its log-softmax
does not depend on what shares the batch (fast mode: other reads, generating rows), the same
request twice gives the same answers, images are read with the questions, and vLLM's
/v1/systemone shape comes back."""

from __future__ import annotations

import asyncio
import base64
import io
import time

import pytest
import torch

from diffusion_plugin.api.decisions import DiffusionReader
from diffusion_plugin.engine import DiffusionEngine
from tandem_core.errors import TandemError
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
        # A request's abort reaches its submitted reads (``DiffusionEngine.submitted``): long chats
        # hold every batch slot, so the reads wait; aborted, the decision ends in an error, and then
        # nothing of it is tracked.
        long = [asyncio.ensure_future(_drain(engine.chat({
            "model": "m", "messages": [{"role": "user", "content": "Go on."}], "max_tokens": 256,
            "ignore_eos": True}, f"long{k}"))) for k in range(4)]
        gone = asyncio.ensure_future(_collect(engine.decisions(dict(BODY), "gone")))
        deadline = time.monotonic() + 120
        while not await engine.abort("gone"):  # true once its first reads are submitted
            assert time.monotonic() < deadline and not gone.done(), "the decision's reads were never submitted"
            await asyncio.sleep(0.005)
        aborted = (await gone, await engine.abort("gone"), await engine.abort("d0"))
        for k, task in enumerate(long):
            await engine.abort(f"long{k}")
            await task
        systemone = []
        async for out in engine.systemone({"model": "m", "state": "late parcel", "images": [_picture()],
                                           "questions": {"q": {"type": "noul", "instructions": "Happy?"}}}, "s1"):
            systemone.append(out)
        shown = {**BODY, "input": [{"role": "user", "content": [
            {"type": "input_text", "text": "What is in the picture?"},
            {"type": "input_image", "image_url": _picture()}]}]}
        seen = []
        for i in range(2):
            async for out in engine.decisions(dict(shown), f"i{i}"):
                seen.append(out)
        return alone, together, answers, systemone, seen, engine.loop.scheduler.stats, aborted
    finally:
        await engine.shutdown()


def _picture() -> str:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (32, 24), (200, 40, 10)).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


async def _drain(stream):
    async for _ in stream:
        pass


async def _collect(stream) -> list:
    return [item async for item in stream]


@pytest.mark.parametrize("sampler", ["fast", "exact"])
def test_reads_are_batch_invariant_repeatable_and_commit_nothing(sampler):
    alone, together, answers, systemone, seen, stats, aborted = asyncio.run(_run(sampler))
    (out,), tracked_after, finished_tracked = aborted
    assert isinstance(out, TandemError) and "aborted" in out.message, out
    assert not tracked_after and not finished_tracked  # an ended request leaves nothing to abort
    assert together == alone  # bit for bit, with each other and a generating row in the batch
    assert all(isinstance(a, dict) for a in answers) and answers[0]["answers"] == answers[1]["answers"]
    probs = [p["probability"] for p in answers[0]["answers"][1]["probabilities"]]
    assert abs(sum(probs) - 1) < 1e-9
    (s,) = systemone
    assert s["object"] == "structured_decision" and set(s["answers"]) == {"q"}
    assert s["answers"]["q"]["type"] == "noul" and 0 <= s["diagnostics"]["q"]["label_mass"] <= 1
    assert stats.tokens_scored == 0  # a read commits and scores no prompt token
    # an image in the input (the tiny family sees): read with every question, the same twice
    assert all(isinstance(a, dict) for a in seen) and seen[0]["answers"] == seen[1]["answers"]
    assert [a["type"] for a in seen[0]["answers"]] == ["predicate", "choice", "score"]
    assert seen[0]["usage"]["input_tokens"] > answers[0]["usage"]["input_tokens"]  # the image's tokens
